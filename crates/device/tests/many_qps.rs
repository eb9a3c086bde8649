//! Scale, functionally: two devices on loopback with 2000 connected RC QPs each (one CQ per
//! device), a checked 64-byte WRITE and SEND on every pair, and the descriptors the
//! devices open for it bounded (per-QP UDP source ports beyond the send-socket cache leave
//! from the device socket). Nothing here is timed: `softrdma scale` measures; this keeps
//! it working. Alone in its test binary, so the descriptor count is this test's own.

mod rc;

use std::time::Duration;

use softrdma_device::verbs::{
    Access, Qpn, RecvWr, SendFlags, SendOp, Sge, WcOpcode, WcStatus, WorkCompletion,
};

/// QP pairs: large enough that a per-QP cost (a socket each, a scan of every QP per step)
/// shows, small enough for seconds in a debug build.
const QPS: usize = 2000;
/// Bytes per operation.
const MSG: usize = 64;

/// The bytes QP `i` moves in phase `phase`: distinct per QP and phase.
fn pattern(i: usize, phase: u8) -> [u8; MSG] {
    let mut b = [0u8; MSG];
    for (k, x) in b.iter_mut().enumerate() {
        *x = (i as u8) ^ ((i >> 8) as u8).rotate_left(3) ^ (k as u8).wrapping_mul(29) ^ phase;
    }
    b
}

fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// A device with QPS RC QPs on one CQ and a buffer of 2 × QPS × 64 bytes: WRITEs land
/// in the first half at 64 × i, SENDs in the second; a side sends from the same places.
struct Side {
    host: rc::Host,
    qpns: Vec<Qpn>,
}

impl Side {
    fn new(name: &str) -> Side {
        let host = rc::Host::new(
            name,
            2 * QPS * MSG,
            0,
            2 * QPS as u32 + 16,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        );
        let qpns = (0..QPS).map(|_| host.rc_qp(4)).collect();
        Side { host, qpns }
    }

    /// Connect QP i to the peer's QP i.
    fn connect_qp(&self, i: usize, peer: &Side) {
        let cfg = rc::QpCfg {
            access: Access::REMOTE_WRITE,
            ..rc::cfg()
        };
        let to = rc::Peer::at(peer.host.dev.gid(), peer.qpns[i], i as u32);
        self.host.connect(self.qpns[i], &cfg, &to, i as u32);
    }

    fn sge(&self, at: usize) -> Sge {
        self.host.sge(at, MSG)
    }

    /// Wait for `n` completions, all successful.
    fn reap(&self, n: usize) -> Vec<WorkCompletion> {
        let wcs = self.host.wait_wcs(n, Duration::from_secs(120));
        for w in &wcs {
            assert_eq!(w.status, WcStatus::Success, "{w:?}");
        }
        assert_eq!(wcs.len(), n, "more completions than WRs");
        wcs
    }
}

#[test]
fn two_thousand_connected_rc_qps_each_move_checked_data() {
    let fds_before = fds();
    let mut a = Side::new("many-a");
    let b = Side::new("many-b");
    // Pair by pair: a QP in RTS whose peer is not yet in RTR is an idle connection whose
    // keepalive goes unanswered, lost within a second on this host.
    for i in 0..QPS {
        a.connect_qp(i, &b);
        b.connect_qp(i, &a);
    }
    // What a sends: QP i's WRITE at 64 i, its SEND at 64 (QPS + i). Written before any
    // traffic, with nothing in flight.
    for i in 0..QPS {
        a.host.mem[i * MSG..(i + 1) * MSG].copy_from_slice(&pattern(i, 1));
        a.host.mem[(QPS + i) * MSG..(QPS + i + 1) * MSG].copy_from_slice(&pattern(i, 2));
    }
    for (i, &qpn) in b.qpns.iter().enumerate() {
        let wr = RecvWr {
            wr_id: i as u64,
            sg_list: vec![b.sge((QPS + i) * MSG)],
        };
        b.host.dev.post_recv(qpn, wr).unwrap();
    }
    let base = b.host.addr(0);
    for (i, &qpn) in a.qpns.iter().enumerate() {
        let write = SendOp::Write {
            remote_addr: base + (i * MSG) as u64,
            rkey: b.host.rkey,
        };
        let signaled = SendFlags::SIGNALED;
        a.host
            .post_send(qpn, i as u64, write, signaled, a.sge(i * MSG));
        let send = a.sge((QPS + i) * MSG);
        a.host
            .post_send(qpn, (QPS + i) as u64, SendOp::Send, signaled, send);
    }
    let sent = a.reap(2 * QPS);
    let mut seen = vec![0u8; QPS];
    for w in &sent {
        let i = w.wr_id as usize % QPS;
        assert_eq!(w.qp_num, a.qpns[i], "{w:?}");
        let want = if w.wr_id < QPS as u64 {
            WcOpcode::RdmaWrite
        } else {
            WcOpcode::Send
        };
        assert_eq!(w.opcode, want, "{w:?}");
        seen[i] += 1;
    }
    assert!(
        seen.iter().all(|&k| k == 2),
        "a WRITE and a SEND on every QP"
    );
    let recvd = b.reap(QPS);
    let mut got = vec![false; QPS];
    for w in &recvd {
        let i = w.wr_id as usize;
        assert_eq!(
            (w.opcode, w.qp_num, w.byte_len),
            (WcOpcode::Recv, b.qpns[i], MSG as u32)
        );
        assert!(!got[i], "two receives on QP {i}");
        got[i] = true;
    }
    let mem = b.host.contents();
    for i in 0..QPS {
        assert_eq!(mem[i * MSG..(i + 1) * MSG], pattern(i, 1), "QP {i}'s WRITE");
        let s = (QPS + i) * MSG;
        assert_eq!(mem[s..s + MSG], pattern(i, 2), "QP {i}'s SEND");
    }
    // 2 × 2000 QPs have about 2 × 1700 distinct source ports: the devices' sockets stay
    // bounded by the send-socket cache, not by the QPs. Besides those, each device has a
    // few of its own (sockets, epoll sets, eventfds, and for the same-host path its
    // rendezvous socket, its grants table and a ring each way).
    let opened = fds().saturating_sub(fds_before);
    assert!(opened < 2 * 64 + 48, "{opened} descriptors for two devices");
}
