//! The requester's one-sided placement ([`crate::Placement`]): which WRITEs and READs it
//! places, what then crosses the network (nothing, or a placed WRITE for one with
//! immediate data), completion order, and the grants it withdraws when its QP fails.

use std::sync::{Arc, Mutex};

use super::*;

/// What a [`Fake`] was asked to do: (is a read, rkey, address, bytes).
type Calls = Arc<Mutex<Vec<(bool, u32, u64, Vec<u8>)>>>;

/// A placement that copies nothing into another process: a write records the bytes it
/// was given, a read fills the pieces with `fill`; both succeed if `ok`.
#[derive(Debug)]
struct Fake {
    ok: bool,
    /// What [`Placement::peer_polls`] answers.
    polls: bool,
    /// What [`Placement::peer_wrote`] answers: tests move it as a peer's placed WRITE
    /// would.
    wrote: Arc<std::sync::atomic::AtomicU64>,
    fill: u8,
    calls: Calls,
}

impl Placement for Fake {
    fn write(
        &mut self,
        _dst: SocketAddr,
        _dqpn: u32,
        rkey: u32,
        va: u64,
        src: &[(u64, usize)],
    ) -> bool {
        let mut bytes = Vec::new();
        for &(a, n) in src {
            // SAFETY: the engine hands out pieces of a registered region of the test's
            // `Mem` (or of the WR's inline copy), alive and not written during the call.
            bytes.extend_from_slice(unsafe { std::slice::from_raw_parts(a as *const u8, n) });
        }
        self.calls.lock().unwrap().push((false, rkey, va, bytes));
        self.ok
    }

    fn reachable(
        &mut self,
        _dst: SocketAddr,
        _dqpn: u32,
        _rkey: u32,
        _va: u64,
        _len: usize,
        _write: bool,
    ) -> bool {
        self.ok
    }

    fn peer_polls(&mut self, _dst: SocketAddr) -> bool {
        self.polls
    }

    fn peer_wrote(&mut self, _dst: SocketAddr) -> u64 {
        self.wrote.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn read(
        &mut self,
        _dst: SocketAddr,
        _dqpn: u32,
        rkey: u32,
        va: u64,
        dst: &[(u64, usize)],
    ) -> bool {
        let mut n_all = 0;
        for &(a, n) in dst {
            // SAFETY: pieces of the READ's scatter list in the test's registered `Mem`,
            // which the engine lets the copy overwrite and nothing else touches meanwhile.
            unsafe { std::ptr::write_bytes(a as *mut u8, self.fill, n) };
            n_all += n;
        }
        self.calls
            .lock()
            .unwrap()
            .push((true, rkey, va, vec![self.fill; n_all]));
        self.ok
    }
}

/// `a` places through a [`Fake`] (`ok`) to a peer that does not poll, and the calls it
/// made.
fn placing(a: &mut Node, ok: bool) -> Calls {
    placing_to(a, ok, false).0
}

/// As [`placing`], to a peer that polls if `polls`, with the peer's placement count the
/// test moves.
fn placing_to(a: &mut Node, ok: bool, polls: bool) -> (Calls, Arc<std::sync::atomic::AtomicU64>) {
    let calls = Calls::default();
    let wrote = Arc::default();
    a.nic.set_placement(Box::new(Fake {
        ok,
        polls,
        wrote: Arc::clone(&wrote),
        fill: 0x5A,
        calls: Arc::clone(&calls),
    }));
    (calls, wrote)
}

fn write_op(b: &Node, off: u64) -> SendOp {
    SendOp::Write {
        remote_addr: b.base + off,
        rkey: b.rkey,
    }
}

/// Pump until quiet, counting the request packets `a` sent.
fn pump_counting(a: &mut Node, b: &mut Node, now: &mut u64) -> usize {
    let sent = RefCell::new(0usize);
    pump(a, b, now, |from_a, t| {
        if from_a && t.kind == TransmitKind::Request {
            *sent.borrow_mut() += 1;
        }
        false
    });
    sent.into_inner()
}

#[test]
fn a_placed_write_and_read_send_nothing_take_no_psn_and_complete_in_order() {
    let (mut a, mut b) = pair(QpType::Rc, &Cfg::default());
    let calls = placing(&mut a, true);
    let data = pattern(3000, 9);
    a.write(0, &data);
    b.post_recv(7, 8192, 64);
    let mut now = 0;
    a.send(now, 1, write_op(&b, 100), vec![a.sge(0, 3000)])
        .unwrap();
    a.send(
        now,
        2,
        SendOp::Read {
            remote_addr: b.base + 100,
            rkey: b.rkey,
        },
        vec![a.sge(10_000, 500)],
    )
    .unwrap();
    assert_eq!(pump_counting(&mut a, &mut b, &mut now), 0, "one-sided");
    {
        let c = calls.lock().unwrap();
        assert_eq!(c.len(), 2);
        assert_eq!(c[0], (false, b.rkey, b.base + 100, data.clone()));
        assert_eq!(
            (c[1].0, c[1].1, c[1].2, c[1].3.len()),
            (true, b.rkey, b.base + 100, 500)
        );
    }
    assert_eq!(a.read(10_000, 500), vec![0x5A; 500]);
    // They took no PSN: the SEND after them is the one the peer expects.
    a.send(now, 3, SendOp::Send, vec![a.sge(0, 64)]).unwrap();
    assert_eq!(pump_counting(&mut a, &mut b, &mut now), 1);
    assert_eq!(b.read(8192, 64), data[..64]);
    let w = a.wcs();
    let got: Vec<_> = w
        .iter()
        .map(|c| (c.wr_id, c.opcode, c.status, c.byte_len))
        .collect();
    assert_eq!(
        got,
        vec![
            (1, WcOpcode::RdmaWrite, WcStatus::Success, 3000),
            (2, WcOpcode::RdmaRead, WcStatus::Success, 500),
            (3, WcOpcode::Send, WcStatus::Success, 64),
        ]
    );
    let s = a.nic.stats();
    assert_eq!((s.placed_writes, s.placed_reads, s.retransmits), (1, 1, 0));
    // Nothing was written at the responder by packets: the fake placed nothing there.
    assert_eq!(b.read(100, 3000), vec![0; 3000]);
}

#[test]
fn a_write_behind_an_unacknowledged_send_waits_for_it() {
    let (mut a, mut b) = pair(QpType::Rc, &Cfg::default());
    let calls = placing(&mut a, true);
    let data = pattern(4096, 4);
    a.write(0, &data);
    b.post_recv(7, 8192, 64);
    let mut now = 0;
    // Posted together: the WRITE would land before the SEND's packets if it were placed
    // at once, and would keep the WRITEs after it from being placed if it went as
    // packets; it waits for the SEND's acknowledgement instead. (Large WRITEs: small
    // ones posted together are a stream, which goes as packets.)
    a.send(now, 1, SendOp::Send, vec![a.sge(0, 64)]).unwrap();
    a.send(now, 2, write_op(&b, 0), vec![a.sge(0, 4096)])
        .unwrap();
    a.send(now, 3, write_op(&b, 12288), vec![a.sge(0, 4096)])
        .unwrap();
    assert!(
        calls.lock().unwrap().is_empty(),
        "nothing placed before the ACK"
    );
    assert_eq!(pump_counting(&mut a, &mut b, &mut now), 1, "the SEND alone");
    assert_eq!(calls.lock().unwrap().len(), 2);
    assert_eq!(b.read(8192, 64), data[..64]);
    let ids: Vec<_> = a.wcs().iter().map(|c| (c.wr_id, c.status)).collect();
    assert_eq!(
        ids,
        vec![
            (1, WcStatus::Success),
            (2, WcStatus::Success),
            (3, WcStatus::Success)
        ]
    );
}

#[test]
fn a_write_with_immediate_is_placed_and_its_placed_write_is_refused_from_the_network() {
    let (mut a, mut b) = pair(QpType::Rc, &Cfg::default());
    let calls = placing(&mut a, true);
    a.write(0, &pattern(5000, 1));
    b.post_recv(7, 8192, 0);
    let mut now = 0;
    a.send(
        now,
        1,
        SendOp::WriteWithImm {
            remote_addr: b.base,
            rkey: b.rkey,
            imm: 0x1234,
        },
        vec![a.sge(0, 5000)],
    )
    .unwrap();
    // The placed WRITE that stands for it crosses `sim`, a network: the responder drops
    // it (it takes one only from a same-host ring), and the requester retries until it
    // gives up; nothing is written twice, and no receive is consumed.
    let mut seen = Vec::new();
    pump(&mut a, &mut b, &mut now, |from_a, t| {
        if from_a && t.kind == TransmitKind::Request {
            seen.push(t.data[0]);
        }
        false
    });
    assert_eq!(calls.lock().unwrap().len(), 1, "copied once");
    assert!(!seen.is_empty());
    assert!(
        seen.iter().all(|&op| op == wire::ext::PLACED_WRITE_IMM.0),
        "{seen:x?}"
    );
    assert!(b.wcs().is_empty(), "no receive consumed");
    assert_eq!(a.wcs()[0].status, WcStatus::RetryExcErr);
}

#[test]
fn a_refused_placement_sends_the_packets() {
    let (mut a, mut b) = pair(QpType::Rc, &Cfg::default());
    let calls = placing(&mut a, false);
    let data = pattern(5000, 2);
    a.write(0, &data);
    let mut now = 0;
    a.send(now, 1, write_op(&b, 0), vec![a.sge(0, 5000)])
        .unwrap();
    a.send(
        now,
        2,
        SendOp::Read {
            remote_addr: b.base,
            rkey: b.rkey,
        },
        vec![a.sge(20_000, 5000)],
    )
    .unwrap();
    assert!(pump_counting(&mut a, &mut b, &mut now) >= 3);
    assert_eq!(
        calls.lock().unwrap().len(),
        1,
        "the READ waited for the WRITE"
    );
    assert_eq!(b.read(0, 5000), data);
    assert_eq!(a.read(20_000, 5000), data);
    let s = a.nic.stats();
    assert_eq!((s.placed_writes, s.placed_reads), (0, 0));
}

/// Records what an engine publishes.
#[derive(Debug, Default)]
struct Sink(Arc<Mutex<Vec<(u32, bool)>>>);

impl GrantSink for Sink {
    fn region(&mut self, _r: &verbs::RemoteView) {}
    fn revoke_region(&mut self, _rkey: u32) {}
    fn qp(&mut self, qpn: u32, ready: Option<(Access, PdId)>) {
        self.0.lock().unwrap().push((qpn, ready.is_some()));
    }
}

#[test]
fn a_qp_that_fails_withdraws_its_grant() {
    let cfg = Cfg {
        retry: 1,
        ..Default::default()
    };
    let (mut a, mut b) = pair(QpType::Rc, &cfg);
    let seen = Arc::new(Mutex::new(Vec::new()));
    a.nic.set_grant_sink(Box::new(Sink(Arc::clone(&seen))));
    assert_eq!(seen.lock().unwrap().as_slice(), &[(a.qpn, true)]);
    let mut now = 0;
    a.send(now, 1, SendOp::Send, vec![a.sge(0, 10)]).unwrap();
    pump(&mut a, &mut b, &mut now, |from_a, _| from_a);
    assert_eq!(a.wcs()[0].status, WcStatus::RetryExcErr);
    assert_eq!(
        seen.lock().unwrap().last(),
        Some(&(a.qpn, false)),
        "withdrawn when the engine failed the QP"
    );
}

#[test]
fn a_stream_of_small_writes_to_a_polling_peer_goes_as_packets_and_a_large_one_is_placed() {
    let (mut a, mut b) = pair(QpType::Rc, &Cfg::default());
    let (calls, _) = placing_to(&mut a, true, true);
    let data = pattern(8192, 6);
    a.write(0, &data);
    let mut now = 0;
    // A lone small WRITE is placed (its peer may be a program watching its memory), and
    // so is the next (the first to learn whether the peer answers in between)...
    a.send(now, 1, write_op(&b, 0), vec![a.sge(0, 64)]).unwrap();
    a.send(now, 6, write_op(&b, 200), vec![a.sge(200, 8)])
        .unwrap();
    assert_eq!(calls.lock().unwrap().len(), 2);
    // ...one that follows them at once, with nothing from the peer, is a stream: its
    // packets, while the peer polls.
    a.send(now, 2, write_op(&b, 64), vec![a.sge(64, 64)])
        .unwrap();
    assert_eq!(pump_counting(&mut a, &mut b, &mut now), 1, "its packet");
    assert_eq!(calls.lock().unwrap().len(), 2);
    assert_eq!(b.read(64, 64), data[64..128]);
    a.send(now, 3, write_op(&b, 100), vec![a.sge(0, 8192)])
        .unwrap();
    assert_eq!(pump_counting(&mut a, &mut b, &mut now), 0, "placed");
    assert_eq!(calls.lock().unwrap().len(), 3);
    // A small READ is placed all the same: its packets would need the peer to answer.
    a.send(
        now,
        4,
        SendOp::Read {
            remote_addr: b.base,
            rkey: b.rkey,
        },
        vec![a.sge(20_000, 8)],
    )
    .unwrap();
    assert_eq!(pump_counting(&mut a, &mut b, &mut now), 0);
    assert_eq!(calls.lock().unwrap().len(), 4);
    // Long after the last, a small WRITE is lone again: placed.
    now += 1_000_000;
    a.send(now, 5, write_op(&b, 0), vec![a.sge(0, 64)]).unwrap();
    assert_eq!(calls.lock().unwrap().len(), 5);
    let ids: Vec<_> = a.wcs().iter().map(|c| (c.wr_id, c.status)).collect();
    assert_eq!(
        ids,
        [1, 6, 2, 3, 4, 5].map(|k| (k, WcStatus::Success)).to_vec()
    );
}

#[test]
fn small_writes_the_peer_answers_in_between_are_a_ping_pong_and_stay_placed() {
    let (mut a, mut b) = pair(QpType::Rc, &Cfg::default());
    let (calls, wrote) = placing_to(&mut a, true, true);
    let data = pattern(256, 7);
    a.write(0, &data);
    let mut now = 0;
    a.send(now, 1, write_op(&b, 0), vec![a.sge(0, 8)]).unwrap();
    assert_eq!(calls.lock().unwrap().len(), 1, "a lone one is placed");
    // The peer placed its answer in our memory: the next one, however soon, is the next
    // turn of a ping-pong (a latency test), not a stream.
    wrote.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    now += 500;
    a.send(now, 2, write_op(&b, 8), vec![a.sge(8, 8)]).unwrap();
    assert_eq!(
        pump_counting(&mut a, &mut b, &mut now),
        0,
        "placed, no packet"
    );
    assert_eq!(calls.lock().unwrap().len(), 2);
    // The peer answered with a request to this QP (a SEND): the same.
    a.post_recv(1, 4096, 64);
    b.send(now, 10, SendOp::Send, vec![b.sge(0, 16)]).unwrap();
    pump(&mut a, &mut b, &mut now, |_, _| false);
    a.send(now, 3, write_op(&b, 16), vec![a.sge(16, 8)])
        .unwrap();
    assert_eq!(
        pump_counting(&mut a, &mut b, &mut now),
        0,
        "placed, no packet"
    );
    assert_eq!(calls.lock().unwrap().len(), 3);
    // Nothing from the peer in between: a stream, its packets.
    a.send(now, 4, write_op(&b, 24), vec![a.sge(24, 8)])
        .unwrap();
    assert_eq!(pump_counting(&mut a, &mut b, &mut now), 1, "its packet");
    assert_eq!(calls.lock().unwrap().len(), 3);
    assert_eq!(b.read(24, 8), data[24..32]);
}

#[test]
fn a_small_write_that_waited_for_an_ack_is_not_a_stream_with_itself() {
    let (mut a, mut b) = pair(QpType::Rc, &Cfg::default());
    let calls = placing(&mut a, true);
    let data = pattern(64, 8);
    a.write(0, &data);
    b.post_recv(7, 8192, 64);
    let mut now = 0;
    // The WRITE waits behind the SEND; when the ACK lets it go, it is still the one lone
    // small WRITE: placed.
    a.send(now, 1, SendOp::Send, vec![a.sge(0, 64)]).unwrap();
    a.send(now, 2, write_op(&b, 0), vec![a.sge(0, 8)]).unwrap();
    assert!(calls.lock().unwrap().is_empty());
    assert_eq!(pump_counting(&mut a, &mut b, &mut now), 1, "the SEND alone");
    assert_eq!(calls.lock().unwrap().len(), 1, "the WRITE placed");
}

#[test]
fn a_stream_of_small_writes_to_a_sleeping_peer_is_placed() {
    // Its program may spin on the memory the stream fills, on the core its device's
    // thread would need: a packet would wake that thread to take the core.
    let (mut a, mut b) = pair(QpType::Rc, &Cfg::default());
    let calls = placing(&mut a, true);
    a.write(0, &pattern(64, 9));
    let mut now = 0;
    for k in 0..4u64 {
        a.send(now, k, write_op(&b, 8 * k), vec![a.sge(8 * k as usize, 8)])
            .unwrap();
    }
    assert_eq!(pump_counting(&mut a, &mut b, &mut now), 0, "no packet");
    assert_eq!(calls.lock().unwrap().len(), 4);
}
