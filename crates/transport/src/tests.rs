//! Two devices on the `sim` network, in virtual time: the tests that read or set the
//! engine's private state (its QPs' recovery, congestion and round-trip state, the bytes
//! it holds), and those that share their harness.
//!
//! The harness is `Node`, an engine of this crate with one PD, CQ, buffer and QP, and
//! `pump`, which moves packets between two of them. It cannot be the test kit's `World`:
//! the kit depends on this crate, so in this crate's own test build it holds another
//! copy of `Rnic`, not `crate::Rnic`, whose private fields these tests read. What the kit
//! holds that names no type of this crate it lends: the QP walk to RTS ([`QpCfg`], whose
//! attributes are the `verbs` crate's) and the buffer the engine writes ([`Mem`]).

use std::cell::RefCell;

use super::*;
use softrdma_net::sim::{Endpoint, Faults, Network, Packet, Sim};
use softrdma_testkit::{Mem, Peer, QpCfg};
use verbs::{
    Access, AhAttr, Gid, GlobalRoute, Mtu, PdId, QpCap, RecvWr, SendOp, SendWr, Sge, WcOpcode,
    WorkCompletion,
};
use wire::SplitMix64;

/// An engine with one PD, one CQ, one registered buffer and (once created) one QP.
/// Field order: the engine drops before the buffer it may write.
pub(crate) struct Node {
    pub nic: Rnic,
    pub pd: PdId,
    pub cq: verbs::CqId,
    pub mem: Mem,
    pub lkey: u32,
    pub rkey: u32,
    pub base: u64,
    pub qpn: u32,
}

const BUF: usize = 1 << 16;

impl Node {
    pub fn new(ip: &str, seed: u64) -> Node {
        Node::with_alt(ip, None, seed)
    }
    /// A node whose device also has `alt`, an address of the other IP version.
    pub fn with_alt(ip: &str, alt: Option<&str>, seed: u64) -> Node {
        let addr: SocketAddr = format!("{ip}:4791").parse().unwrap();
        let alt = alt.map(|a| a.parse().unwrap());
        let mut nic = Rnic::with_alt(addr, alt, seed);
        let pd = nic.alloc_pd().unwrap();
        let (cq, _) = nic.create_cq(256, None, false).unwrap();
        let mem = Mem::new(BUF);
        let access = Access::LOCAL_WRITE
            | Access::REMOTE_WRITE
            | Access::REMOTE_READ
            | Access::REMOTE_ATOMIC;
        // SAFETY: `mem` lives in the Node next to the engine, which drops first (field
        // order), and is only read and written by copying.
        let mr = unsafe { nic.reg_mr(pd, mem.ptr(), BUF, mem.addr(), access) }.unwrap();
        Node {
            nic,
            pd,
            cq,
            base: mem.addr(),
            mem,
            lkey: mr.lkey,
            rkey: mr.rkey,
            qpn: 0,
        }
    }
    pub fn create(&mut self, t: QpType) {
        let cfg = qp_cfg(t, &Cfg::default());
        self.qpn = self
            .nic
            .create_qp(cfg.create_attr(self.pd, self.cq, self.cq, None))
            .unwrap();
    }
    pub fn read(&self, off: usize, len: usize) -> Vec<u8> {
        self.mem.read(off, len)
    }
    pub fn write(&mut self, off: usize, data: &[u8]) {
        self.mem.write(off, data)
    }
    pub fn sge(&self, off: usize, len: usize) -> Sge {
        Sge {
            addr: self.base + off as u64,
            length: len as u32,
            lkey: self.lkey,
        }
    }
    pub fn post_recv(&mut self, wr_id: u64, off: usize, len: usize) {
        let sge = self.sge(off, len);
        self.nic
            .post_recv(
                0,
                self.qpn,
                RecvWr {
                    wr_id,
                    sg_list: vec![sge],
                },
            )
            .unwrap();
    }
    pub fn send(&mut self, now: u64, wr_id: u64, op: SendOp, sg: Vec<Sge>) -> verbs::Result<()> {
        self.nic.post_send(
            now,
            self.qpn,
            SendWr {
                wr_id,
                op,
                flags: SendFlags::SIGNALED,
                sg_list: sg,
                inline_data: None,
                ud: None,
            },
        )
    }
    pub fn wcs(&mut self) -> Vec<WorkCompletion> {
        let mut out = [WorkCompletion::default(); 64];
        let n = self.nic.poll_cq(self.cq, &mut out).unwrap();
        out[..n].to_vec()
    }
    pub fn gid(&self) -> Gid {
        Gid::from_ip(self.nic.addr().ip())
    }
}

pub(crate) struct Cfg {
    pub mtu: Mtu,
    pub psn_a: u32,
    pub psn_b: u32,
    pub retry: u8,
    pub rnr_retry: u8,
    pub timeout: u8,
    pub rnr_timer: u8,
    /// The source GID index both sides use (the peer's GID of that index is the dgid).
    pub sgid_index: u8,
}

impl Default for Cfg {
    fn default() -> Self {
        Cfg {
            mtu: Mtu::Mtu1024,
            psn_a: 0xFF_FFF0,
            psn_b: 100,
            retry: 7,
            rnr_retry: 7,
            timeout: 14,
            rnr_timer: 1,
            sgid_index: 0,
        }
    }
}

/// A QP of type `t` as `cfg` says: every remote right, 4 READs/atomics each way, queues
/// 64 deep with 4 SGEs and 64 bytes inline, Q_Key 0x1111_1111 (UD).
fn qp_cfg(t: QpType, cfg: &Cfg) -> QpCfg {
    QpCfg {
        qp_type: t,
        mtu: cfg.mtu,
        access: Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC,
        timeout: cfg.timeout,
        retry_cnt: cfg.retry,
        rnr_retry: cfg.rnr_retry,
        min_rnr_timer: cfg.rnr_timer,
        max_rd_atomic: 4,
        max_dest_rd_atomic: 4,
        cap: QpCap {
            max_send_wr: 64,
            max_recv_wr: 64,
            max_send_sge: 4,
            max_recv_sge: 4,
            max_inline_data: 64,
        },
        sq_sig_all: false,
        qkey: 0x1111_1111,
    }
}

/// Take `n`'s QP to RTS towards `peer`'s (RC/UC; a UD QP only to RTS), sending from
/// `my_psn` and receiving from `peer_psn`.
fn connect(n: &mut Node, peer: &Node, t: QpType, cfg: &Cfg, my_psn: u32, peer_psn: u32) {
    let to = (t != QpType::Ud).then(|| Peer {
        av: AhAttr::roce(peer.nic.gid(cfg.sgid_index).unwrap(), cfg.sgid_index),
        qpn: peer.qpn,
        psn: peer_psn,
    });
    let qpn = n.qpn;
    qp_cfg(t, cfg).walk_to_rts(to.as_ref(), my_psn, |a, m| n.nic.modify_qp(0, qpn, a, m));
}

pub(crate) fn pair(t: QpType, cfg: &Cfg) -> (Node, Node) {
    let mut a = Node::new("10.0.0.1", 1);
    let mut b = Node::new("10.0.0.2", 2);
    a.create(t);
    b.create(t);
    let (pa, pb) = (cfg.psn_a, cfg.psn_b);
    connect(&mut a, &b, t, cfg, pa, pb);
    connect(&mut b, &a, t, cfg, pb, pa);
    (a, b)
}

/// Give `n`'s QP a congestion controller whose window and slow-start threshold start at
/// `w` packets, under the ceiling of the QP's path.
fn set_window(n: &mut Node, w: u32) {
    use crate::cc::Controller;
    let rx = n.nic.env.rx_buffer;
    let q = n.nic.qps.get_mut(&n.qpn).unwrap();
    let mut cc = crate::cc::Reno::with_window(w);
    cc.on_path(q.mtu(), rx);
    q.req.cc = Box::new(cc);
}

/// Virtual time a run may take before it counts as hung.
const RUN_LIMIT: u64 = 60_000_000_000;

/// An RC window's ceiling follows the path MTU and the receive buffer the device says it
/// has, and a message larger than the ceiling has that many packets in flight before
/// the first ACK.
#[test]
fn the_window_ceiling_follows_the_path_mtu_and_the_receive_buffer() {
    let ceiling = |rx: Option<usize>, mtu: Mtu| {
        let mut a = Node::new("10.0.0.1", 1);
        let mut b = Node::new("10.0.0.2", 2);
        if let Some(rx) = rx {
            a.nic.set_rx_buffer(rx);
        }
        a.create(QpType::Rc);
        b.create(QpType::Rc);
        let cfg = Cfg {
            mtu,
            ..Cfg::default()
        };
        connect(&mut a, &b, QpType::Rc, &cfg, 0, 0);
        connect(&mut b, &a, QpType::Rc, &cfg, 0, 0);
        let w = a.nic.qps[&a.qpn].req.cc.window();
        let rx = rx.unwrap_or(crate::cc::DEFAULT_RX_BUFFER);
        let c = crate::cc::ceiling_for(mtu.bytes(), rx);
        assert_eq!(w, c, "a new connection starts at its ceiling");
        (w, a, b)
    };
    assert_eq!(ceiling(None, Mtu::Mtu1024).0, 2048);
    assert_eq!(ceiling(None, Mtu::Mtu4096).0, 512);
    assert_eq!(
        ceiling(Some(425_984), Mtu::Mtu4096).0,
        50,
        "Debian's rmem_max"
    );
    assert_eq!(ceiling(Some(425_984), Mtu::Mtu1024).0, 184);

    // 40 WRITEs of 64 KiB at MTU 1024: 2,560 packets, of which 2,048 go out before
    // anything is answered.
    let (_, mut a, b) = ceiling(None, Mtu::Mtu1024);
    for id in 0..40 {
        let op = SendOp::Write {
            remote_addr: b.base,
            rkey: b.rkey,
        };
        a.send(0, id, op, vec![a.sge(0, BUF)]).unwrap();
    }
    let mut sent = 0;
    while a.nic.poll_transmit(0).is_some() {
        sent += 1;
    }
    assert_eq!(sent, 2048);
}

/// A node attached to the sim network. Both sides share `drop`, which sees (sender is
/// a, packet) in the order the sim takes packets and returns true to lose it, so a test
/// can lose exactly the packet it means to.
struct Side<'a, F> {
    node: &'a mut Node,
    is_a: bool,
    drop: &'a RefCell<F>,
}

impl<F: FnMut(bool, &Transmit) -> bool> Endpoint for Side<'_, F> {
    fn addr(&self) -> SocketAddr {
        self.node.nic.addr()
    }
    fn handle_packet(&mut self, now: u64, pkt: Packet) {
        self.node
            .nic
            .handle_datagram(now, pkt.src, pkt.dst, &pkt.data);
    }
    fn poll_transmit(&mut self, now: u64) -> Option<Packet> {
        loop {
            let t = self.node.nic.poll_transmit(now)?;
            // With two nodes, a packet to anyone but ourselves is for the peer; one to
            // nobody is counted by the sim and checked by `run`.
            assert_ne!(t.dst, self.node.nic.addr(), "packet to itself");
            if (self.drop.borrow_mut())(self.is_a, &t) {
                continue;
            }
            return Some(Packet {
                src: t.src,
                dst: t.dst,
                tos: t.tos,
                data: t.data,
            });
        }
    }
    fn poll_timeout(&self) -> Option<u64> {
        self.node.nic.poll_timeout()
    }
    fn handle_timeout(&mut self, now: u64) {
        self.node.nic.handle_timeout(now);
    }
}

/// Run `a` and `b` on `net` from `*now` until nothing is in flight and no timer is
/// armed, firing timers in virtual time; `*now` is where the run ended.
fn run(
    a: &mut Node,
    b: &mut Node,
    now: &mut u64,
    net: Network,
    drop: impl FnMut(bool, &Transmit) -> bool,
) {
    let drop = RefCell::new(drop);
    let mut sim = Sim::new(net);
    sim.now = *now;
    sim.add(Side {
        node: a,
        is_a: true,
        drop: &drop,
    });
    sim.add(Side {
        node: b,
        is_a: false,
        drop: &drop,
    });
    let settled = sim.run_to_idle(now.saturating_add(RUN_LIMIT));
    *now = sim.now;
    assert!(settled, "the nodes did not settle: {:?}", sim.net.stats());
    assert_eq!(
        sim.net.stats().dropped_no_endpoint,
        0,
        "packet to a stranger"
    );
}

/// Move packets both ways until quiet over a perfect link, firing timers in virtual
/// time. `drop` sees (sender is a, packet) and returns true to lose it. The link has no
/// delay so that virtual time moves only with the engines' timers, which some tests
/// check to the nanosecond.
pub(crate) fn pump(
    a: &mut Node,
    b: &mut Node,
    now: &mut u64,
    drop: impl FnMut(bool, &Transmit) -> bool,
) {
    let link = Faults {
        delay_ns: 0,
        ..Faults::default()
    };
    run(a, b, now, Network::new(0, link), drop);
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn rc_send_recv_multi_mtu_with_psn_wrap() {
    let (mut a, mut b) = pair(QpType::Rc, &Cfg::default());
    let data = pattern(5000, 7);
    a.write(0, &data);
    b.post_recv(11, 8192, 8192);
    let mut now = 0;
    a.send(
        now,
        1,
        SendOp::SendWithImm { imm: 0xabcd },
        vec![a.sge(0, 5000)],
    )
    .unwrap();
    pump(&mut a, &mut b, &mut now, |_, _| false);
    assert_eq!(b.read(8192, 5000), data);
    let w = b.wcs();
    assert_eq!(w.len(), 1);
    assert_eq!(w[0].wr_id, 11);
    assert_eq!(w[0].status, WcStatus::Success);
    assert_eq!(w[0].opcode, WcOpcode::Recv);
    assert_eq!(w[0].byte_len, 5000);
    assert_eq!(w[0].imm_data, 0xabcd);
    assert!(w[0].wc_flags.contains(verbs::WcFlags::WITH_IMM));
    let w = a.wcs();
    assert_eq!(w.len(), 1);
    assert_eq!(
        (w[0].wr_id, w[0].status, w[0].opcode),
        (1, WcStatus::Success, WcOpcode::Send)
    );
    assert_eq!(a.nic.stats().retransmits, 0);
}

#[test]
fn rc_write_and_read_across_mtus() {
    let cfg = Cfg {
        mtu: Mtu::Mtu256,
        ..Default::default()
    };
    let (mut a, mut b) = pair(QpType::Rc, &cfg);
    let data = pattern(3001, 3);
    a.write(0, &data);
    let mut now = 0;
    let remote = b.base + 1000;
    a.send(
        now,
        1,
        SendOp::Write {
            remote_addr: remote,
            rkey: b.rkey,
        },
        vec![a.sge(0, 3001)],
    )
    .unwrap();
    a.send(
        now,
        2,
        SendOp::Read {
            remote_addr: remote,
            rkey: b.rkey,
        },
        vec![a.sge(10_000, 3001)],
    )
    .unwrap();
    pump(&mut a, &mut b, &mut now, |_, _| false);
    assert_eq!(b.read(1000, 3001), data);
    assert_eq!(a.read(10_000, 3001), data);
    let w = a.wcs();
    assert_eq!(w.len(), 2);
    assert_eq!(
        (w[0].wr_id, w[0].opcode, w[0].status),
        (1, WcOpcode::RdmaWrite, WcStatus::Success)
    );
    assert_eq!(
        (w[1].wr_id, w[1].opcode, w[1].byte_len),
        (2, WcOpcode::RdmaRead, 3001)
    );
    assert!(b.wcs().is_empty());
}

#[test]
fn rc_atomics() {
    let (mut a, mut b) = pair(QpType::Rc, &Cfg::default());
    b.write(64, &5u64.to_ne_bytes());
    let mut now = 0;
    let va = b.base + 64;
    a.send(
        now,
        1,
        SendOp::FetchAdd {
            remote_addr: va,
            rkey: b.rkey,
            add: 10,
        },
        vec![a.sge(0, 8)],
    )
    .unwrap();
    a.send(
        now,
        2,
        SendOp::CompareSwap {
            remote_addr: va,
            rkey: b.rkey,
            compare: 15,
            swap: 99,
        },
        vec![a.sge(8, 8)],
    )
    .unwrap();
    pump(&mut a, &mut b, &mut now, |_, _| false);
    assert_eq!(a.read(0, 8), 5u64.to_ne_bytes());
    assert_eq!(a.read(8, 8), 15u64.to_ne_bytes());
    assert_eq!(b.read(64, 8), 99u64.to_ne_bytes());
    let w = a.wcs();
    assert_eq!(w.len(), 2);
    assert_eq!((w[0].opcode, w[0].byte_len), (WcOpcode::FetchAdd, 8));
    assert_eq!(w[1].opcode, WcOpcode::CompSwap);
}

#[test]
fn rc_retransmit_after_drop() {
    let (mut a, mut b) = pair(QpType::Rc, &Cfg::default());
    let data = pattern(4096, 9);
    a.write(0, &data);
    b.post_recv(1, 8192, 8192);
    let mut now = 0;
    a.send(now, 1, SendOp::Send, vec![a.sge(0, 4096)]).unwrap();
    let mut n = 0;
    pump(&mut a, &mut b, &mut now, |from_a, _| {
        n += 1;
        from_a && n == 2
    });
    assert_eq!(b.read(8192, 4096), data);
    assert_eq!(b.wcs().len(), 1);
    assert_eq!(a.wcs()[0].status, WcStatus::Success);
    assert!(a.nic.stats().retransmits >= 1);
    assert_eq!(b.nic.stats().naks_sent_seq, 1);
    assert_eq!(a.nic.stats().naks_rcvd_seq, 1);
}

#[test]
fn rc_retransmit_after_lost_last_packet_by_timeout() {
    let (mut a, mut b) = pair(QpType::Rc, &Cfg::default());
    b.post_recv(1, 8192, 8192);
    let mut now = 0;
    a.send(now, 1, SendOp::Send, vec![a.sge(0, 3000)]).unwrap();
    let mut n = 0;
    pump(&mut a, &mut b, &mut now, |from_a, _| {
        n += 1;
        from_a && n == 3
    });
    assert_eq!(a.nic.stats().timeouts, 1);
    assert_eq!(b.wcs().len(), 1);
    assert_eq!(a.wcs()[0].status, WcStatus::Success);
    assert!(now >= 4096 << 14);
}

/// An acknowledgement that both acknowledges a WRITE (progress) and lands past a READ whose
/// response was lost is new evidence of a new loss: the retries are renewed by the progress
/// and the READ is asked again at once. Here the WRITE's first transmission is lost (a
/// sequence NAK spends the only retry), then on the resend the WRITE's ACK and the READ
/// response are lost, and the ACK of the WRITE after the READ arrives. Before the fix the
/// progress this ACK made was dropped on the way to the lost READ: the retry under way
/// swallowed the evidence, the timer fired with no retry left, and the READ completed with
/// RETRY_EXC_ERR after one retry per loss — which is what `retry_cnt = 1` allows.
/// The requester is told its peer goes back N, as rxe does: against a softrdma peer it
/// resends the lost WRITE alone instead (`selective_repeat_resends_only_the_hole`).
#[test]
fn ack_past_lost_read_response_after_progress_renews_retries() {
    use wire::{Headers, Opcode, Syndrome};
    let cfg = Cfg {
        retry: 1,
        ..Default::default()
    };
    let (mut a, mut b) = pair(QpType::Rc, &cfg);
    let req = &mut a.nic.qps.get_mut(&a.qpn).unwrap().req;
    req.rec.learn_peer_drops();
    let p = cfg.psn_a;
    a.write(0, &pattern(64, 1));
    b.write(4096, &pattern(100, 2));
    let mut now = 0;
    let write = |b: &Node, off: u64| SendOp::Write {
        remote_addr: b.base + off,
        rkey: b.rkey,
    };
    let w1 = write(&b, 0);
    a.send(now, 1, w1, vec![a.sge(0, 64)]).unwrap();
    let read = SendOp::Read {
        remote_addr: b.base + 4096,
        rkey: b.rkey,
    };
    a.send(now, 2, read, vec![a.sge(8192, 100)]).unwrap();
    let w2 = write(&b, 256);
    a.send(now, 3, w2, vec![a.sge(0, 64)]).unwrap();
    let (mut lost_write, mut lost_ack, mut lost_resp) = (false, false, false);
    pump(&mut a, &mut b, &mut now, |from_a, t| {
        let (h, _) = Headers::parse(&t.data).unwrap();
        let (op, psn) = (h.bth.opcode, h.bth.psn);
        let lose = if from_a {
            op == Opcode::RC_RDMA_WRITE_ONLY && psn == p && !lost_write
        } else if op == Opcode::RC_RDMA_READ_RESPONSE_ONLY {
            !lost_resp
        } else {
            // The ACK of the first WRITE (not the sequence NAK of the same PSN).
            let is_ack = matches!(h.aeth.map(|a| a.syndrome), Some(Syndrome::Ack { .. }));
            op == Opcode::RC_ACKNOWLEDGE && psn == p && is_ack && !lost_ack
        };
        if lose {
            if from_a {
                lost_write = true;
            } else if op == Opcode::RC_RDMA_READ_RESPONSE_ONLY {
                lost_resp = true;
            } else {
                lost_ack = true;
            }
        }
        lose
    });
    assert!(
        lost_write && lost_ack && lost_resp,
        "every planned loss happened"
    );
    let w = a.wcs();
    let got: Vec<(u64, WcStatus)> = w.iter().map(|c| (c.wr_id, c.status)).collect();
    assert_eq!(
        got,
        vec![
            (1, WcStatus::Success),
            (2, WcStatus::Success),
            (3, WcStatus::Success)
        ]
    );
    assert_eq!(a.read(8192, 100), pattern(100, 2), "READ data");
    assert_eq!(a.nic.stats().naks_rcvd_seq, 1);
    // The lost READ response was recovered from the ACK's evidence, not by the timer.
    assert_eq!(a.nic.stats().timeouts, 0);
}

#[test]
fn duplicate_atomic_applied_once() {
    let (mut a, mut b) = pair(QpType::Rc, &Cfg::default());
    b.write(0, &1u64.to_ne_bytes());
    let mut now = 0;
    a.send(
        now,
        1,
        SendOp::FetchAdd {
            remote_addr: b.base,
            rkey: b.rkey,
            add: 1,
        },
        vec![a.sge(0, 8)],
    )
    .unwrap();
    let mut dropped = false;
    pump(&mut a, &mut b, &mut now, |from_a, _| {
        if !from_a && !dropped {
            dropped = true;
            return true;
        }
        false
    });
    assert_eq!(b.read(0, 8), 2u64.to_ne_bytes());
    assert_eq!(a.read(0, 8), 1u64.to_ne_bytes());
    assert_eq!(b.nic.stats().duplicates, 1);
    assert_eq!(a.wcs()[0].status, WcStatus::Success);
}

#[test]
fn rnr_then_success() {
    let (mut a, mut b) = pair(QpType::Rc, &Cfg::default());
    let mut now = 0;
    a.send(now, 1, SendOp::Send, vec![a.sge(0, 100)]).unwrap();
    // No receive posted: RNR NAK, wait, retry.
    while let Some(t) = a.nic.poll_transmit(now) {
        b.nic.handle_datagram(now, t.src, t.dst, &t.data);
    }
    while let Some(t) = b.nic.poll_transmit(now) {
        a.nic.handle_datagram(now, t.src, t.dst, &t.data);
    }
    assert_eq!(b.nic.stats().rnr_naks_sent, 1);
    assert_eq!(a.nic.stats().rnr_naks_rcvd, 1);
    b.post_recv(5, 0, 100);
    pump(&mut a, &mut b, &mut now, |_, _| false);
    assert_eq!(b.wcs()[0].wr_id, 5);
    assert_eq!(a.wcs()[0].status, WcStatus::Success);
    assert_eq!(now, 10_000);
}

#[test]
fn rnr_retry_exhausted() {
    let cfg = Cfg {
        rnr_retry: 2,
        ..Default::default()
    };
    let (mut a, mut b) = pair(QpType::Rc, &cfg);
    b.post_recv(7, 0, 10); // consumed by nothing: the send goes to a QP... keep one recv queued
    let _ = b.wcs();
    let mut now = 0;
    a.send(now, 1, SendOp::Send, vec![a.sge(0, 10)]).unwrap();
    a.send(now, 2, SendOp::Send, vec![a.sge(0, 10)]).unwrap();
    a.send(now, 3, SendOp::Send, vec![a.sge(0, 10)]).unwrap();
    pump(&mut a, &mut b, &mut now, |_, _| false);
    let w = a.wcs();
    assert_eq!(w.len(), 3);
    assert_eq!(w[0].status, WcStatus::Success);
    assert_eq!(w[1].status, WcStatus::RnrRetryExcErr);
    assert_eq!(w[2].status, WcStatus::WrFlushErr);
    assert_eq!(a.nic.query_qp(a.qpn).unwrap().qp_state, verbs::QpState::Err);
}

#[test]
fn retry_exhausted_when_peer_silent() {
    let cfg = Cfg {
        retry: 3,
        ..Default::default()
    };
    let (mut a, mut b) = pair(QpType::Rc, &cfg);
    b.post_recv(1, 0, 100);
    let mut now = 0;
    a.send(now, 1, SendOp::Send, vec![a.sge(0, 10)]).unwrap();
    pump(&mut a, &mut b, &mut now, |from_a, _| from_a);
    assert_eq!(a.nic.stats().timeouts, 4);
    assert_eq!(a.nic.stats().retransmits, 3);
    let w = a.wcs();
    assert_eq!(w[0].status, WcStatus::RetryExcErr);
}

#[test]
fn remote_access_error() {
    let (mut a, mut b) = pair(QpType::Rc, &Cfg::default());
    b.post_recv(9, 0, 100);
    let mut now = 0;
    a.send(
        now,
        1,
        SendOp::Write {
            remote_addr: b.base,
            rkey: b.rkey ^ 0x100,
        },
        vec![a.sge(0, 10)],
    )
    .unwrap();
    a.send(now, 2, SendOp::Send, vec![a.sge(0, 10)]).unwrap();
    pump(&mut a, &mut b, &mut now, |_, _| false);
    let w = a.wcs();
    assert_eq!(w.len(), 2);
    assert_eq!(w[0].status, WcStatus::RemAccessErr);
    assert_eq!(w[1].status, WcStatus::WrFlushErr);
    let w = b.wcs();
    assert_eq!(w.len(), 1);
    assert_eq!(w[0].status, WcStatus::WrFlushErr);
    assert_eq!(b.nic.stats().naks_sent_access, 1);
}

#[test]
fn recv_too_small() {
    let (mut a, mut b) = pair(QpType::Rc, &Cfg::default());
    b.post_recv(9, 0, 10);
    let mut now = 0;
    a.send(now, 1, SendOp::Send, vec![a.sge(0, 100)]).unwrap();
    pump(&mut a, &mut b, &mut now, |_, _| false);
    assert_eq!(a.wcs()[0].status, WcStatus::RemInvReqErr);
    assert_eq!(b.wcs()[0].status, WcStatus::LocLenErr);
}

#[test]
fn ud_send_with_grh() {
    let cfg = Cfg::default();
    let (mut a, mut b) = pair(QpType::Ud, &cfg);
    let ah = a
        .nic
        .create_ah(
            a.pd,
            &AhAttr {
                grh: GlobalRoute {
                    dgid: b.gid(),
                    traffic_class: 0x10,
                    ..Default::default()
                },
                is_global: true,
                port_num: 1,
                ..Default::default()
            },
        )
        .unwrap();
    b.post_recv(3, 0, 200);
    let data = pattern(100, 1);
    a.write(1000, &data);
    let mut now = 0;
    a.nic
        .post_send(
            now,
            a.qpn,
            SendWr {
                wr_id: 4,
                op: SendOp::SendWithImm { imm: 77 },
                flags: SendFlags::SIGNALED,
                sg_list: vec![a.sge(1000, 100)],
                inline_data: None,
                ud: Some(verbs::UdDest {
                    ah,
                    remote_qpn: b.qpn,
                    remote_qkey: 0x8000_0000,
                }),
            },
        )
        .unwrap();
    let t = a.nic.poll_transmit(now).unwrap();
    assert_eq!(t.tos, 0x10);
    b.nic.handle_datagram(now, t.src, t.dst, &t.data);
    pump(&mut a, &mut b, &mut now, |_, _| false);
    let w = b.wcs();
    assert_eq!(w.len(), 1);
    assert_eq!(w[0].byte_len, 140);
    assert_eq!(w[0].src_qp, a.qpn);
    assert_eq!(w[0].imm_data, 77);
    assert!(w[0].wc_flags.contains(verbs::WcFlags::GRH));
    // The RoCE packet type where Mellanox devices report it: RoCE v2 (UDP), IPv4.
    assert_eq!(w[0].sl, 0xA);
    assert_eq!(b.read(40, 100), data);
    assert_eq!(a.wcs()[0].status, WcStatus::Success);
    // Too large for the MTU: rejected at post.
    let r = a.nic.post_send(
        now,
        a.qpn,
        SendWr {
            wr_id: 5,
            op: SendOp::Send,
            flags: SendFlags::SIGNALED,
            sg_list: vec![a.sge(0, 5000)],
            inline_data: None,
            ud: Some(verbs::UdDest {
                ah,
                remote_qpn: b.qpn,
                remote_qkey: 0x1111_1111,
            }),
        },
    );
    assert!(r.is_err());
}

#[test]
fn uc_lost_middle_drops_message() {
    let (mut a, mut b) = pair(QpType::Uc, &Cfg::default());
    b.post_recv(1, 0, 8192);
    let data = pattern(3000, 5);
    a.write(0, &data);
    let mut now = 0;
    a.send(now, 1, SendOp::Send, vec![a.sge(0, 3000)]).unwrap();
    a.send(now, 2, SendOp::Send, vec![a.sge(0, 3000)]).unwrap();
    let mut n = 0;
    pump(&mut a, &mut b, &mut now, |_, _| {
        n += 1;
        n == 2
    });
    let w = b.wcs();
    assert_eq!(w.len(), 1);
    assert_eq!(w[0].wr_id, 1);
    assert_eq!(w[0].byte_len, 3000);
    assert_eq!(b.read(0, 3000), data);
    assert_eq!(a.wcs().len(), 2);
}

#[test]
fn bad_icrc_and_garbage_are_counted() {
    let (mut a, mut b) = pair(QpType::Rc, &Cfg::default());
    b.post_recv(1, 0, 100);
    a.send(0, 1, SendOp::Send, vec![a.sge(0, 10)]).unwrap();
    let t = a.nic.poll_transmit(0).unwrap();
    let mut bad = t.data.clone();
    bad[13] ^= 1;
    b.nic.handle_datagram(0, t.src, t.dst, &bad);
    assert_eq!(b.nic.stats().icrc_errors, 1);
    b.nic.handle_datagram(0, t.src, t.dst, &[1, 2, 3]);
    assert_eq!(b.nic.stats().malformed, 1);
    // Right ICRC, wrong source IP: the ICRC fails as it covers the addresses.
    let other: SocketAddr = "10.0.0.9:4791".parse().unwrap();
    b.nic.handle_datagram(0, other, t.dst, &t.data);
    assert_eq!(b.nic.stats().icrc_errors, 2);
    for len in 0..t.data.len() {
        b.nic.handle_datagram(0, t.src, t.dst, &t.data[..len]);
    }
}

/// One changed byte that some IPv4 ID explains (UDP payload offset 93, XOR 0x0F: any
/// packet long enough has such bytes, and which ones depends only on where they are)
/// must not pass as a packet from an active sender that uses ID 0.
#[test]
fn corruption_that_an_ip_id_explains_is_dropped() {
    let (mut a, mut b) = pair(QpType::Rc, &Cfg::default());
    b.post_recv(1, 0, 300);
    b.post_recv(2, 300, 300);
    let data = pattern(200, 9);
    a.write(0, &data);
    a.send(0, 1, SendOp::Send, vec![a.sge(0, 200)]).unwrap();
    a.send(0, 2, SendOp::Send, vec![a.sge(0, 200)]).unwrap();
    let first = a.nic.poll_transmit(0).unwrap();
    let second = a.nic.poll_transmit(0).unwrap();
    b.nic.handle_datagram(0, first.src, first.dst, &first.data);
    let mut bad = second.data.clone();
    bad[93] ^= 0x0F;
    let addrs = wire::Addrs::new(second.src, second.dst);
    let id = wire::icrc::verify_unknown_ip_id(&addrs, &bad);
    assert!(
        id.is_some_and(|id| id >= 64),
        "ID {id:?} explains the change"
    );
    b.nic.handle_datagram(1_000, second.src, second.dst, &bad);
    assert_eq!(b.nic.stats().icrc_errors, 1);
    assert_eq!(b.wcs().len(), 1, "only the first SEND arrived");
    b.nic
        .handle_datagram(2_000, second.src, second.dst, &second.data);
    let w = b.wcs();
    assert_eq!(w.len(), 1);
    assert_eq!((w[0].wr_id, w[0].status), (2, WcStatus::Success));
    assert_eq!(b.read(300, 200), data);
}

/// Like `pump`, but over a 1 µs link that loses 10% of the packets, duplicates 5% and
/// holds 5% back behind later ones.
fn lossy_pump(a: &mut Node, b: &mut Node, now: &mut u64, seed: u64) {
    let faults = Faults {
        loss: 0.10,
        duplicate: 0.05,
        reorder: 0.05,
        delay_ns: 1_000,
        ..Faults::default()
    };
    run(a, b, now, Network::new(seed, faults), |_, _| false);
}

#[test]
fn rc_exactly_once_in_order_under_loss_dup_reorder() {
    for seed in 0..400u64 {
        let mut rng = SplitMix64::new(seed);
        let cfg = Cfg {
            mtu: Mtu::Mtu256,
            psn_a: 0xFF_FF00 + seed as u32,
            timeout: 10,
            ..Default::default()
        };
        let (mut a, mut b) = pair(QpType::Rc, &cfg);
        let src: Vec<u8> = (0..32768).map(|_| rng.next_u64() as u8).collect();
        a.write(0, &src);
        let rsrc: Vec<u8> = (0..4000).map(|_| rng.next_u64() as u8).collect();
        b.write(56_000, &rsrc);
        b.write(64_000, &0u64.to_ne_bytes());
        for i in 0..12 {
            b.post_recv(100 + i, (i as usize) * 2000, 2000);
        }
        let mut expect_recv = Vec::new();
        let mut expect_write = Vec::new();
        let mut expect_read = Vec::new();
        let (mut ns, mut nw, mut nr, mut na) = (0usize, 0usize, 0usize, 0usize);
        let mut added = 0u64;
        let now0 = 0;
        for id in 0..36u64 {
            let len = rng.below(2001) as usize;
            let off = rng.below(30_000) as usize;
            let kind = loop {
                let k = rng.below(4);
                if [ns < 12, nw < 8, nr < 8, na < 8][k as usize] {
                    break k;
                }
            };
            let op = match kind {
                0 => {
                    expect_recv.push((100 + ns as u64, ns * 2000, src[off..off + len].to_vec()));
                    ns += 1;
                    a.send(now0, id, SendOp::Send, vec![a.sge(off, len)])
                }
                1 => {
                    let dst = 40_000 + nw * 2000;
                    expect_write.push((dst, src[off..off + len].to_vec()));
                    nw += 1;
                    a.send(
                        now0,
                        id,
                        SendOp::Write {
                            remote_addr: b.base + dst as u64,
                            rkey: b.rkey,
                        },
                        vec![a.sge(off, len)],
                    )
                }
                2 => {
                    let at = rng.below(2000) as usize;
                    let dst = 40_000 + nr * 2000;
                    expect_read.push((dst, rsrc[at..at + len].to_vec()));
                    nr += 1;
                    a.send(
                        now0,
                        id,
                        SendOp::Read {
                            remote_addr: b.base + 56_000 + at as u64,
                            rkey: b.rkey,
                        },
                        vec![a.sge(dst, len)],
                    )
                }
                _ => {
                    let add = rng.below(1000) + 1;
                    added += add;
                    na += 1;
                    a.send(
                        now0,
                        id,
                        SendOp::FetchAdd {
                            remote_addr: b.base + 64_000,
                            rkey: b.rkey,
                            add,
                        },
                        vec![a.sge(60_000 + 8 * na, 8)],
                    )
                }
            };
            op.unwrap();
        }
        let mut now = 0;
        lossy_pump(&mut a, &mut b, &mut now, seed ^ 0xdead);
        let wa = a.wcs();
        if wa.iter().any(|w| w.status != WcStatus::Success) {
            eprintln!("seed {seed} a {:?}\nb {:?}", a.nic.stats(), b.nic.stats());
        }
        assert_eq!(
            wa.len(),
            36,
            "seed {seed}: {:?}",
            wa.iter().find(|w| w.status != WcStatus::Success)
        );
        for (i, w) in wa.iter().enumerate() {
            assert_eq!(
                (w.wr_id, w.status),
                (i as u64, WcStatus::Success),
                "seed {seed}"
            );
        }
        let wb = b.wcs();
        assert_eq!(wb.len(), 12, "seed {seed}");
        for (w, (id, off, data)) in wb.iter().zip(&expect_recv) {
            assert_eq!(
                (w.wr_id, w.byte_len as usize),
                (*id, data.len()),
                "seed {seed}"
            );
            assert_eq!(&b.read(*off, data.len()), data, "seed {seed}");
        }
        for (dst, data) in &expect_write {
            assert_eq!(&b.read(*dst, data.len()), data, "seed {seed}");
        }
        for (dst, data) in &expect_read {
            assert_eq!(&a.read(*dst, data.len()), data, "seed {seed}");
        }
        assert_eq!(
            b.read(64_000, 8),
            added.to_ne_bytes(),
            "seed {seed}: atomics applied once"
        );
        // Every fetch-add saw a distinct earlier value.
        let mut seen: Vec<u64> = (1..=8)
            .map(|k| u64::from_ne_bytes(a.read(60_000 + 8 * k, 8).try_into().unwrap()))
            .collect();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 8, "seed {seed}");
    }
}

#[test]
fn fence_waits_for_reads() {
    let (mut a, mut b) = pair(QpType::Rc, &Cfg::default());
    b.write(0, &[7u8; 100]);
    b.post_recv(1, 1000, 100);
    let now = 0;
    a.send(
        now,
        1,
        SendOp::Read {
            remote_addr: b.base,
            rkey: b.rkey,
        },
        vec![a.sge(0, 100)],
    )
    .unwrap();
    a.nic
        .post_send(
            now,
            a.qpn,
            SendWr {
                wr_id: 2,
                op: SendOp::Send,
                flags: SendFlags::SIGNALED | SendFlags::FENCE,
                sg_list: vec![a.sge(0, 100)],
                inline_data: None,
                ud: None,
            },
        )
        .unwrap();
    // Only the READ request is out: the fenced SEND waits for its response.
    assert!(a.nic.poll_transmit(now).is_some());
    assert!(a.nic.poll_transmit(now).is_none());
    let mut now = now;
    pump(&mut a, &mut b, &mut now, |_, _| false);
    // The SEND carried the data the READ brought back.
    assert_eq!(b.read(1000, 100), vec![7u8; 100]);
    assert_eq!(a.wcs().len(), 2);
}

#[test]
fn big_write_is_paced_and_completes() {
    let (mut a, mut b) = pair(
        QpType::Rc,
        &Cfg {
            mtu: Mtu::Mtu256,
            ..Default::default()
        },
    );
    let mut now = 0;
    a.send(
        now,
        1,
        SendOp::Write {
            remote_addr: b.base,
            rkey: b.rkey,
        },
        vec![a.sge(0, BUF)],
    )
    .unwrap();
    let mut queued = 0;
    while a.nic.poll_transmit(now).is_some() {
        queued += 1;
    }
    let ceiling = a.nic.qps[&a.qpn].req.cc.window() as usize;
    assert!(queued <= ceiling, "{queued}");
    // Start over with delivery (the ones taken above are lost: retransmitted on timeout).
    pump(&mut a, &mut b, &mut now, |_, _| false);
    assert_eq!(a.wcs()[0].status, WcStatus::Success);
}

/// Move every packet between `a` and `b` by hand (the sim routes one address per
/// endpoint) until neither has anything to send; returns the (source, destination) of each.
fn shuttle(a: &mut Node, b: &mut Node, now: u64) -> Vec<(SocketAddr, SocketAddr)> {
    let mut seen = Vec::new();
    loop {
        let mut moved = false;
        while let Some(t) = a.nic.poll_transmit(now) {
            seen.push((t.src, t.dst));
            b.nic.handle_datagram(now, t.src, t.dst, &t.data);
            moved = true;
        }
        while let Some(t) = b.nic.poll_transmit(now) {
            seen.push((t.src, t.dst));
            a.nic.handle_datagram(now, t.src, t.dst, &t.data);
            moved = true;
        }
        if !moved {
            return seen;
        }
    }
}

#[test]
fn gid_index_1_is_the_second_address_and_its_packets_use_it() {
    let mut a = Node::with_alt("10.0.0.1", Some("fd00::1"), 1);
    let mut b = Node::with_alt("10.0.0.2", Some("fd00::2"), 2);
    assert_eq!(
        a.nic.gids(),
        &[
            Gid::from_ip("10.0.0.1".parse().unwrap()),
            Gid::from_ip("fd00::1".parse().unwrap())
        ]
    );
    assert_eq!(a.nic.alt_addr(), Some("[fd00::1]:4791".parse().unwrap()));
    let cfg = Cfg {
        sgid_index: 1,
        ..Default::default()
    };
    a.create(QpType::Rc);
    b.create(QpType::Rc);
    connect(&mut a, &b, QpType::Rc, &cfg, cfg.psn_a, cfg.psn_b);
    connect(&mut b, &a, QpType::Rc, &cfg, cfg.psn_b, cfg.psn_a);
    let data = pattern(3000, 7);
    a.write(0, &data);
    b.post_recv(5, 0, 4096);
    a.send(0, 1, SendOp::Send, vec![a.sge(0, 3000)]).unwrap();
    a.send(
        0,
        2,
        SendOp::Write {
            remote_addr: b.base + 8192,
            rkey: b.rkey,
        },
        vec![a.sge(0, 3000)],
    )
    .unwrap();
    let seen = shuttle(&mut a, &mut b, 0);
    // Requests, responses and ACKs: all between the two IPv6 addresses.
    assert!(seen.len() >= 7, "{seen:?}");
    let (a6, b6): (IpAddr, IpAddr) = ("fd00::1".parse().unwrap(), "fd00::2".parse().unwrap());
    for (src, dst) in &seen {
        assert!(
            (src.ip(), dst.ip()) == (a6, b6) || (src.ip(), dst.ip()) == (b6, a6),
            "{src} -> {dst}"
        );
    }
    let wcs = a.wcs();
    assert_eq!(wcs.len(), 2);
    assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
    let r = b.wcs();
    assert_eq!(
        (r[0].wr_id, r[0].status, r[0].byte_len),
        (5, WcStatus::Success, 3000)
    );
    assert_eq!(b.read(0, 3000), data);
    assert_eq!(b.read(8192, 3000), data);
}

#[test]
fn sgid_and_dgid_of_different_ip_versions_are_refused() {
    let mut a = Node::with_alt("10.0.0.1", Some("fd00::1"), 1);
    let b = Node::with_alt("10.0.0.2", Some("fd00::2"), 2);
    a.create(QpType::Rc);
    let cfg = qp_cfg(QpType::Rc, &Cfg::default());
    let (init, m) = cfg.init_attr();
    a.nic.modify_qp(0, a.qpn, &init, m).unwrap();
    for (sgid_index, dgid) in [(0, b.nic.gid(1).unwrap()), (1, b.nic.gid(0).unwrap())] {
        let (rtr, m) = cfg.rtr_attr(Some(&Peer {
            av: AhAttr::roce(dgid, sgid_index),
            qpn: 5,
            psn: 0,
        }));
        let e = a.nic.modify_qp(0, a.qpn, &rtr, m).unwrap_err();
        assert_eq!(e.errno, verbs::Errno::EINVAL, "sgid {sgid_index}: {e}");
        let ah = a.nic.create_ah(a.pd, &rtr.ah_attr).unwrap_err();
        assert_eq!(ah.errno, verbs::Errno::EINVAL);
    }
    // One address only: no GID index 1, and an alt of the same IP version is ignored.
    let c = Node::with_alt("10.0.0.3", Some("10.0.0.4"), 3);
    assert_eq!(c.nic.gids().len(), 1);
    assert!(c.nic.gid(1).is_err());
}

/// Responses of a READ lost here and there (10, 20 and 30 of 256): the ones that arrive
/// past a loss are placed at once, and the requester asks again for exactly the missing
/// ones, each in a request naming just its bytes, which the responder answers beside the
/// rest of its stream. Nothing goes back N, nothing waits for a timer, the responder
/// sends each response once more at most, and the bytes are right.
#[test]
fn a_read_asks_again_for_exactly_its_lost_responses() {
    let mut lost = Vec::new();
    let r = read_losing(3, |k| {
        let hit = [10, 20, 30].contains(&k) && !lost.contains(&k);
        if hit {
            lost.push(k);
        }
        hit
    });
    assert_eq!(lost, [10, 20, 30]);
    let (mut a, b) = (r.a, r.b);
    let wcs = a.wcs();
    assert_eq!(wcs.len(), 1);
    assert_eq!(wcs[0].status, WcStatus::Success);
    assert!(a.read(0, BUF) == r.data, "READ bytes");
    assert_eq!(
        r.requests,
        vec![(0, BUF as u32), (10, 256), (20, 256), (30, 256)],
        "(first response asked, bytes asked) of each READ request"
    );
    assert_eq!(
        r.responses,
        256 + 3,
        "each lost response sent once more, nothing else"
    );
    let s = a.nic.stats();
    assert_eq!((s.timeouts, s.rtt_timeouts, s.retransmits), (0, 0, 3));
    assert_eq!(b.nic.stats().read_replays, 3);
}

/// What [`read_losing`] left: the pair, the bytes the READ had to bring, (first response
/// asked, bytes asked) of every READ request, and how many responses were sent.
struct ReadRun {
    a: Node,
    b: Node,
    data: Vec<u8>,
    requests: Vec<(u32, u32)>,
    responses: u32,
}

/// One READ of `BUF` bytes at path MTU 256 over a link of 20 µs, each response lost when
/// `lose` says so of its index in the READ.
fn read_losing(seed: u8, mut lose: impl FnMut(u32) -> bool) -> ReadRun {
    use wire::{Headers, Opcode};
    let cfg = Cfg {
        mtu: Mtu::Mtu256,
        ..Default::default()
    };
    let (mut a, mut b) = pair(QpType::Rc, &cfg);
    let data = pattern(BUF, seed);
    b.write(0, &data);
    let mut now = 0;
    let read = SendOp::Read {
        remote_addr: b.base,
        rkey: b.rkey,
    };
    a.send(now, 1, read, vec![a.sge(0, BUF)]).unwrap();
    let first = cfg.psn_a;
    let (mut requests, mut responses) = (Vec::new(), 0);
    let link = Faults {
        delay_ns: 20_000,
        ..Faults::default()
    };
    run(
        &mut a,
        &mut b,
        &mut now,
        Network::new(0, link),
        |from_a, t| {
            let (h, _) = Headers::parse(&t.data).unwrap();
            let k = wire::psn::diff(h.bth.psn, first) as u32;
            if from_a {
                if h.bth.opcode == Opcode::RC_RDMA_READ_REQUEST {
                    requests.push((k, h.reth.unwrap().dma_len));
                }
                return false;
            }
            responses += 1;
            lose(k)
        },
    );
    ReadRun {
        a,
        b,
        data,
        requests,
        responses,
    }
}

/// Many QPs on one engine, with every first transmission lost: their retransmission
/// timers are armed and fire together, through the timer index ([`timers::Timers`]),
/// which debug builds check against a scan of every QP on each `poll_timeout`. Every QP's
/// WRITE then lands exactly once, in its own place.
#[test]
fn many_qps_time_out_together_and_each_delivers() {
    // Below the CQ capacity of a `Node` (256): the completions are reaped at the end.
    const QPS: usize = 200;
    const LEN: usize = 64;
    let cfg = Cfg::default();
    let mut a = Node::new("10.0.0.1", 1);
    let mut b = Node::new("10.0.0.2", 2);
    let mut pairs = Vec::with_capacity(QPS);
    for i in 0..QPS {
        a.create(QpType::Rc);
        b.create(QpType::Rc);
        let psn = i as u32 * 3;
        connect(&mut a, &b, QpType::Rc, &cfg, psn, psn + 1);
        connect(&mut b, &a, QpType::Rc, &cfg, psn + 1, psn);
        pairs.push((a.qpn, b.qpn));
        a.write(i * LEN, &pattern(LEN, i as u8));
    }
    let mut now = 0;
    for (i, &(qpn, _)) in pairs.iter().enumerate() {
        let wr = SendWr {
            wr_id: i as u64,
            op: SendOp::Write {
                remote_addr: b.base + (i * LEN) as u64,
                rkey: b.rkey,
            },
            flags: SendFlags::SIGNALED,
            sg_list: vec![a.sge(i * LEN, LEN)],
            inline_data: None,
            ud: None,
        };
        a.nic.post_send(now, qpn, wr).unwrap();
    }
    assert!(a.nic.poll_timeout().is_some(), "timers armed");
    let mut lost = std::collections::HashSet::new();
    pump(&mut a, &mut b, &mut now, |from_a, t| {
        from_a && t.kind == TransmitKind::Request && lost.insert(t.data[4..8].to_vec())
    });
    assert_eq!(lost.len(), QPS, "one loss per QP");
    assert_eq!(a.nic.stats().timeouts, QPS as u64);
    assert_eq!(a.nic.poll_timeout(), None, "no timer left");
    let mut done = [false; QPS];
    loop {
        let wcs = a.wcs();
        if wcs.is_empty() {
            break;
        }
        for wc in wcs {
            assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
            let i = wc.wr_id as usize;
            assert_eq!(wc.qp_num, pairs[i].0);
            assert!(!done[i], "QP {i} completed twice");
            done[i] = true;
        }
    }
    assert!(done.iter().all(|&d| d), "every QP's WRITE completed");
    for i in 0..QPS {
        assert_eq!(b.read(i * LEN, LEN), pattern(LEN, i as u8), "QP {i}");
    }
}

/// A 32 KiB WRITE (32 packets, MTU 1024) from a to b at offset 4096 whose request
/// packet `lost_idx` is lost once, everything else delivered; checks the data and
/// the WRITE's completion and returns the pair.
fn write_losing_one_packet(lost_idx: u32) -> (Node, Node) {
    use wire::Headers;
    let cfg = Cfg::default();
    let (mut a, mut b) = pair(QpType::Rc, &cfg);
    let data = pattern(32 * 1024, lost_idx as u8);
    a.write(0, &data);
    let mut now = 0;
    let op = SendOp::Write {
        remote_addr: b.base + 4096,
        rkey: b.rkey,
    };
    a.send(now, 1, op, vec![a.sge(0, data.len())]).unwrap();
    let hole = wire::psn::add(cfg.psn_a, lost_idx);
    let mut lost = false;
    pump(&mut a, &mut b, &mut now, |from_a, t| {
        // softrdma's SACK messages are not IBTA packets (and never the lost one).
        let Ok((h, _)) = Headers::parse(&t.data) else {
            return false;
        };
        let lose = from_a && h.bth.psn == hole && !lost;
        lost |= lose;
        lose
    });
    assert!(lost);
    assert_eq!(b.read(4096, data.len()), data);
    let w = a.wcs();
    assert_eq!(w.len(), 1);
    assert_eq!(w[0].status, WcStatus::Success);
    (a, b)
}

/// The sixth packet lost: the responder holds the 26 packets after the hole, the
/// requester resends the hole alone, and the filled gap acknowledges the rest. The peer
/// is learnt to hold.
#[test]
fn selective_repeat_resends_only_the_hole() {
    let (a, b) = write_losing_one_packet(5);
    let (sa, sb) = (a.nic.stats(), b.nic.stats());
    assert_eq!(sa.naks_rcvd_seq, 1);
    assert_eq!(sa.retransmits, 1, "only the hole is resent");
    assert_eq!((sa.timeouts, sa.rtt_timeouts), (0, 0));
    assert_eq!(sb.held, 26, "every packet after the hole was held");
    assert_eq!(sb.duplicates, 0);
    assert_eq!(b.nic.env.held_bytes, 0, "nothing stays held");
    let q = &a.nic.qps[&a.qpn];
    assert_eq!(q.req.rec.peer_holds(), Some(true));
    assert_eq!(q.req.rec.hole(), None);
    // Having seen b hold, a asked for SACKs, and b's answer says it sends them.
    assert!(q.req.rec.peer_sacks());
    assert!(b.nic.qps[&b.qpn].resp.sack_peer);
}

/// The first packet lost, so the responder cannot hold what follows it (the peer's port
/// is not known yet; an IBTA responder such as rxe never holds): the answer to the
/// resent hole acknowledges the hole only, and the requester goes back N from the packet
/// after it at once, without a timer, and from then on goes back N without trying a
/// selective resend first.
#[test]
fn selective_repeat_falls_back_to_go_back_n() {
    let (a, b) = write_losing_one_packet(0);
    let (sa, sb) = (a.nic.stats(), b.nic.stats());
    assert_eq!(sb.held, 0);
    assert_eq!(sa.naks_rcvd_seq, 1);
    assert_eq!(sa.retransmits, 32, "the hole, then the 31 packets after it");
    assert_eq!((sa.timeouts, sa.rtt_timeouts), (0, 0));
    assert_eq!(a.nic.qps[&a.qpn].req.rec.peer_holds(), Some(false));
}

/// Two WRITEs a → b over a link with a 20 µs one-way delay. The first (32 packets) loses
/// its sixth packet, so a learns that b holds packets past a gap and asks for SACKs; the
/// second (60 packets, over the first) loses `lost` (indices into it) once each. Returns the pair and
/// every opcode a sent, and the packets both sent, in the order the link took them, as
/// (from a, PSN, is a sequence NAK).
#[allow(clippy::type_complexity)]
fn write_twice_losing(lost: &[u32]) -> (Node, Node, Vec<wire::Opcode>, Vec<(bool, u32, bool)>) {
    use wire::Headers;
    let cfg = Cfg::default();
    let (mut a, mut b) = pair(QpType::Rc, &cfg);
    let first = pattern(32 * 1024, 1);
    let second = pattern(64 * 1024 - 4096, 2);
    a.write(0, &first);
    let mut now = 0;
    let link = Faults {
        delay_ns: 20_000,
        ..Faults::default()
    };
    let sent = RefCell::new(Vec::new());
    let log = RefCell::new(Vec::new());
    let lose_once = |from_a: bool, t: &Transmit, psns: &mut Vec<u32>| {
        if from_a {
            sent.borrow_mut().push(wire::Opcode(t.data[0]));
        }
        let Ok((h, _)) = Headers::parse(&t.data) else {
            return false;
        };
        let nak = h
            .aeth
            .is_some_and(|a| a.syndrome == wire::Syndrome::Nak(wire::NakCode::PsnSequenceError));
        log.borrow_mut().push((from_a, h.bth.psn, nak));
        let hit = from_a && psns.contains(&h.bth.psn);
        psns.retain(|&p| !(hit && p == h.bth.psn));
        hit
    };
    let (b_base, b_rkey) = (b.base, b.rkey);
    let op = |off| SendOp::Write {
        remote_addr: b_base + off,
        rkey: b_rkey,
    };
    let op1 = op(0);
    a.send(now, 1, op1, vec![a.sge(0, first.len())]).unwrap();
    let mut psns = vec![wire::psn::add(cfg.psn_a, 5)];
    run(
        &mut a,
        &mut b,
        &mut now,
        Network::new(0, link.clone()),
        |f, t| lose_once(f, t, &mut psns),
    );
    assert!(psns.is_empty());
    assert_eq!(b.read(0, first.len()), first);
    let q = &a.nic.qps[&a.qpn];
    assert_eq!(q.req.rec.peer_holds(), Some(true));
    assert!(q.req.rec.peer_sacks(), "b answered the SACK_PERMIT");
    let base = wire::psn::add(cfg.psn_a, 32);
    a.write(4096, &second);
    let op2 = op(0);
    a.send(now, 2, op2, vec![a.sge(4096, second.len())])
        .unwrap();
    let mut psns: Vec<u32> = lost.iter().map(|&i| wire::psn::add(base, i)).collect();
    let before = a.nic.stats().clone();
    run(
        &mut a,
        &mut b,
        &mut now,
        Network::new(0, link.clone()),
        |f, t| lose_once(f, t, &mut psns),
    );
    assert!(psns.is_empty());
    assert_eq!(b.read(0, second.len()), second);
    let w = a.wcs();
    assert_eq!(w.len(), 2);
    assert!(w.iter().all(|w| w.status == WcStatus::Success), "{w:?}");
    let after = a.nic.stats();
    assert_eq!(
        after.retransmits - before.retransmits,
        lost.len() as u64,
        "each lost packet resent once, nothing else"
    );
    assert_eq!((after.timeouts, after.rtt_timeouts), (0, 0));
    (a, b, sent.into_inner(), log.into_inner())
}

/// Three holes in one window: the SACKs that show them make the requester resend the
/// two that the sequence NAK cannot name, before the responder reaches them, so the
/// responder sends one NAK for the three.
#[test]
fn sack_repairs_every_hole_of_a_window_at_once() {
    let (a, b, sent, log) = write_twice_losing(&[3, 20, 40]);
    let (sa, sb) = (a.nic.stats(), b.nic.stats());
    assert_eq!(sa.sack_resends, 2, "holes 20 and 40 resent from SACKs");
    // The answer to the SACK_PERMIT (which a takes for no more than that: nothing was
    // outstanding), then one for the three holes: the window arrived at one instant,
    // and the drains' NAKs come without a SACK of their own.
    assert_eq!((sb.sacks_sent, sa.sacks_rcvd), (2, 1));
    // Both resends left before the responder, executing the resent hole 3, reached
    // hole 20 and named it in a NAK.
    let base = wire::psn::add(Cfg::default().psn_a, 32);
    let at = |i: u32| wire::psn::add(base, i);
    let resent = |p: u32| {
        log.iter()
            .enumerate()
            .filter(|(_, &(a, q, _))| a && q == p)
            .nth(1)
            .map(|(i, _)| i)
            .expect("resent")
    };
    let nak20 = log
        .iter()
        .position(|&(a, q, nak)| !a && nak && q == at(20))
        .unwrap_or(usize::MAX);
    assert!(resent(at(20)) < nak20 && resent(at(40)) < nak20, "{log:?}");
    assert_eq!(
        sent.iter()
            .filter(|&&o| o == wire::ext::SACK_PERMIT)
            .count(),
        1
    );
    assert_eq!(b.nic.env.held_bytes, 0, "nothing stays held");
}

/// A peer that never held anything (an IBTA responder: here b, which cannot hold
/// before it learnt a's port) is never sent a SACK_PERMIT.
#[test]
fn no_sack_permit_to_a_peer_that_does_not_hold() {
    use wire::Headers;
    let cfg = Cfg::default();
    let (mut a, mut b) = pair(QpType::Rc, &cfg);
    let data = pattern(32 * 1024, 9);
    a.write(0, &data);
    let mut now = 0;
    let op = SendOp::Write {
        remote_addr: b.base,
        rkey: b.rkey,
    };
    a.send(now, 1, op, vec![a.sge(0, data.len())]).unwrap();
    let mut vendor = 0;
    let mut lost = false;
    pump(&mut a, &mut b, &mut now, |from_a, t| {
        vendor += usize::from(wire::ext::is_vendor(wire::Opcode(t.data[0])));
        let lose = from_a && !lost && Headers::parse(&t.data).unwrap().0.bth.psn == cfg.psn_a;
        lost |= lose;
        lose
    });
    assert!(lost);
    assert_eq!(b.read(0, data.len()), data);
    assert_eq!(a.nic.qps[&a.qpn].req.rec.peer_holds(), Some(false));
    assert_eq!(vendor, 0, "no extension message either way");
}

/// SACKs that are stale, claim packets never sent, or come from another port change
/// nothing: no completion, no resend, no error.
#[test]
fn forged_or_stale_sacks_change_nothing() {
    let cfg = Cfg::default();
    let (mut a, mut b) = pair(QpType::Rc, &cfg);
    let (out, data) = write_sent_undelivered(&mut a, &b, 3, 8);
    let b_port = wire::udp_src_port(b.qpn);
    let high = wire::psn::add(cfg.psn_a, 8);
    let mut now = 0;
    let before = a.nic.stats().clone();
    let none: Vec<u32> = Vec::new();
    // Expected PSN past everything sent (a forged "all received").
    assert_eq!(inject_sack(&mut a, &b, b_port, now, high, &[]), none);
    // Before the oldest outstanding PSN.
    let stale = wire::psn::sub(cfg.psn_a, 1);
    assert_eq!(
        inject_sack(&mut a, &b, b_port, now, stale, &[2, 3, 4, 5]),
        none
    );
    // Holding packets never sent.
    assert_eq!(
        inject_sack(&mut a, &b, b_port, now, cfg.psn_a, &[7, 8, 9, 10]),
        none
    );
    // A valid-looking SACK from another port.
    let all = [1, 2, 3, 4, 5, 6, 7];
    assert_eq!(
        inject_sack(&mut a, &b, b_port ^ 1, now, cfg.psn_a, &all),
        none
    );
    let s = a.nic.stats();
    assert_eq!(s.sacks_rcvd, before.sacks_rcvd);
    assert_eq!(s.retransmits, before.retransmits);
    assert_eq!(s.dropped, before.dropped + 1, "the wrong port is counted");
    assert!(a.wcs().is_empty(), "nothing completed");
    // A genuine-looking one inside the window only resends the hole: still nothing
    // completes until b really acknowledges.
    let resent = inject_sack(&mut a, &b, b_port, now, cfg.psn_a, &all);
    assert_eq!(resent, vec![cfg.psn_a]);
    assert_eq!(a.nic.stats().sack_resends, before.sack_resends + 1);
    assert!(a.wcs().is_empty());
    // Deliver everything for real: the WRITE completes once.
    for t in out {
        b.nic.handle_datagram(now, t.src, t.dst, &t.data);
    }
    pump(&mut a, &mut b, &mut now, |_, _| false);
    assert_eq!(b.read(0, data.len()), data);
    let w = a.wcs();
    assert_eq!(w.len(), 1);
    assert_eq!(w[0].status, WcStatus::Success);
}

/// A connection whose first packet was lost took its peer for one that does not hold;
/// after `SR_RETRY_AFTER` go-back-N recoveries it tries a selective resend again, and
/// finds out that the peer (which has since learnt the requester's port) does hold.
#[test]
fn a_peer_taken_for_one_that_does_not_hold_is_asked_again() {
    use wire::Headers;
    let cfg = Cfg::default();
    let (mut a, mut b) = pair(QpType::Rc, &cfg);
    let mut now = 0;
    let mut next = cfg.psn_a;
    for round in 0..=u32::from(crate::recovery::SR_RETRY_AFTER) + 1 {
        let data = pattern(16 * 1024, round as u8);
        a.write(0, &data);
        let op = SendOp::Write {
            remote_addr: b.base,
            rkey: b.rkey,
        };
        a.send(now, u64::from(round), op, vec![a.sge(0, data.len())])
            .unwrap();
        // The first round loses its first packet, the others their sixth.
        let hole = wire::psn::add(next, if round == 0 { 0 } else { 5 });
        let mut lost = false;
        pump(&mut a, &mut b, &mut now, |from_a, t| {
            let Ok((h, _)) = Headers::parse(&t.data) else {
                return false;
            };
            let lose = from_a && !lost && h.bth.psn == hole;
            lost |= lose;
            lose
        });
        assert!(lost);
        assert_eq!(b.read(0, data.len()), data, "round {round}");
        let w = a.wcs();
        assert_eq!(w.len(), 1);
        assert_eq!(w[0].status, WcStatus::Success);
        let holds = a.nic.qps[&a.qpn].req.rec.peer_holds();
        if round == 0 {
            assert_eq!(holds, Some(false), "the first loss looks like rxe");
        } else if round <= u32::from(crate::recovery::SR_RETRY_AFTER) {
            assert_eq!(holds, Some(false), "round {round}: still going back N");
        } else {
            assert_eq!(holds, Some(true), "asked again, the peer holds");
        }
        next = wire::psn::add(next, 16);
    }
}

/// A READ followed by a WRITE on a QP with `retry_cnt = 1`, over a link that loses the
/// packets `lose` picks (it sees whether a sent the packet, its opcode and how many of
/// that opcode went before in that direction). Returns the requester's completions
/// and its counters.
fn read_then_write_losing(
    lose: impl Fn(bool, wire::Opcode, usize) -> bool,
) -> (Vec<(u64, WcStatus)>, Vec<u8>, Stats) {
    let cfg = Cfg {
        retry: 1,
        ..Default::default()
    };
    let (mut a, mut b) = pair(QpType::Rc, &cfg);
    b.write(4096, &pattern(100, 2));
    a.write(0, &pattern(64, 1));
    let mut now = 0;
    let read = SendOp::Read {
        remote_addr: b.base + 4096,
        rkey: b.rkey,
    };
    a.send(now, 1, read, vec![a.sge(8192, 100)]).unwrap();
    let write = SendOp::Write {
        remote_addr: b.base,
        rkey: b.rkey,
    };
    a.send(now, 2, write, vec![a.sge(0, 64)]).unwrap();
    let mut seen: std::collections::HashMap<(bool, u8), usize> = Default::default();
    pump(&mut a, &mut b, &mut now, |from_a, t| {
        let (h, _) = wire::Headers::parse(&t.data).unwrap();
        let n = seen.entry((from_a, h.bth.opcode.0)).or_default();
        *n += 1;
        lose(from_a, h.bth.opcode, *n - 1)
    });
    let got = a.wcs().iter().map(|c| (c.wr_id, c.status)).collect();
    (got, a.read(8192, 100), a.nic.stats().clone())
}

/// An ACK past a READ whose response was lost acknowledges the READ request, which was
/// the packet being timed: it measures the round trip. Before, only the oldest
/// unacknowledged PSN moving past the timed packet did, and a READ without its response
/// holds that PSN; the go-back-N the ACK starts then dropped the timing (Karn). With no
/// round trip measured there is no round-trip timer, so when the resent READ's response
/// was lost too, nothing resent it before the local ACK timeout, which spent the last
/// retry: RETRY_EXC_ERR after two lost responses, where the round-trip timer resends
/// without spending one. Under 20% corruption each way a READ's round trip fails 42% of
/// the time, and a connection whose first round trips all saw a loss never measured one:
/// seven failed rounds at the ACK timeout's pace ended it early in one run in six.
#[test]
fn an_ack_past_a_lost_read_response_measures_the_round_trip() {
    use wire::Opcode;
    let (got, data, s) = read_then_write_losing(|from_a, op, n| {
        !from_a && op == Opcode::RC_RDMA_READ_RESPONSE_ONLY && n < 2
    });
    assert_eq!(got, vec![(1, WcStatus::Success), (2, WcStatus::Success)]);
    assert_eq!(data, pattern(100, 2), "READ data");
    // The second lost response was recovered by the round-trip timer, not the local ACK
    // timeout.
    assert_eq!(s.timeouts, 0);
    assert!(s.rtt_timeouts >= 1);
}

/// Before the first round-trip sample, a go-back-N keeps timing the packet being timed
/// from its first transmission: an answer to its second copy measures more than the
/// round trip, never less, and without a measure every later loss waits for the local
/// ACK timeout. Here the READ request is lost (the sequence NAK for it starts a
/// go-back-N, which spends the only retry), then the response to its resend: the ACK
/// past it measures the round trip, and the round-trip timer asks again.
#[test]
fn a_go_back_n_before_the_first_sample_keeps_timing_the_first_copy() {
    use wire::Opcode;
    let (got, data, s) = read_then_write_losing(|from_a, op, n| {
        if from_a {
            op == Opcode::RC_RDMA_READ_REQUEST && n == 0
        } else {
            op == Opcode::RC_RDMA_READ_RESPONSE_ONLY && n == 0
        }
    });
    assert_eq!(got, vec![(1, WcStatus::Success), (2, WcStatus::Success)]);
    assert_eq!(data, pattern(100, 2), "READ data");
    assert_eq!(s.naks_rcvd_seq, 1);
    assert_eq!(s.timeouts, 0);
    assert!(s.rtt_timeouts >= 1);
}

/// With the round trip measured, the round-trip timer keeps resending between local ACK
/// timeouts instead of backing off past them: it stops doubling at half the ACK
/// timeout. Here the ACK timeout is about 1 ms (code 8), the measured RTO 250 µs, and
/// `retry_cnt = 1`; the READ's response is lost four times. Backed off past the ACK
/// timeout, the timer resent twice before the first ACK timeout and never after it:
/// the fourth loss ended the READ in RETRY_EXC_ERR.
#[test]
fn the_round_trip_timer_still_fires_between_local_ack_timeouts() {
    use wire::Opcode;
    let cfg = Cfg {
        retry: 1,
        timeout: 8,
        ..Default::default()
    };
    let (mut a, mut b) = pair(QpType::Rc, &cfg);
    b.write(4096, &pattern(100, 2));
    a.write(0, &pattern(64, 1));
    let mut now = 0;
    let write = SendOp::Write {
        remote_addr: b.base,
        rkey: b.rkey,
    };
    // A clean WRITE first: it measures the round trip.
    a.send(now, 1, write, vec![a.sge(0, 64)]).unwrap();
    pump(&mut a, &mut b, &mut now, |_, _| false);
    let read = SendOp::Read {
        remote_addr: b.base + 4096,
        rkey: b.rkey,
    };
    a.send(now, 2, read, vec![a.sge(8192, 100)]).unwrap();
    let mut lost = 0;
    pump(&mut a, &mut b, &mut now, |from_a, t| {
        let (h, _) = wire::Headers::parse(&t.data).unwrap();
        let lose = !from_a && h.bth.opcode == Opcode::RC_RDMA_READ_RESPONSE_ONLY && lost < 4;
        lost += usize::from(lose);
        lose
    });
    assert_eq!(lost, 4);
    let got: Vec<(u64, WcStatus)> = a.wcs().iter().map(|c| (c.wr_id, c.status)).collect();
    assert_eq!(got, vec![(1, WcStatus::Success), (2, WcStatus::Success)]);
    assert_eq!(a.read(8192, 100), pattern(100, 2), "READ data");
    let s = a.nic.stats();
    assert_eq!(s.timeouts, 1, "one local ACK timeout, the only retry");
    assert!(s.rtt_timeouts >= 3);
}

/// RACK's rule on SACKs: a hole resent, then a later hole resent, and a SACK showing the
/// later resend arrived but not the earlier: the earlier resend was lost, and the hole is
/// resent again at once, though a round trip has not passed since its first resend.
#[test]
fn a_resend_overtaken_by_a_later_one_is_resent_again() {
    let cfg = Cfg::default();
    let (mut a, b) = pair(QpType::Rc, &cfg);
    write_sent_undelivered(&mut a, &b, 5, 8);
    let b_port = wire::udp_src_port(b.qpn);
    let p = cfg.psn_a;
    let mut sack = |now: u64, held: &[u32]| inject_sack(&mut a, &b, b_port, now, p, held);
    // The first packet is missing, three after it held: resend it.
    assert_eq!(sack(0, &[1, 2, 3]), vec![p]);
    // A second hole at p + 4: resent; the first, resent 10 µs ago, is not.
    assert_eq!(
        sack(10_000, &[1, 2, 3, 5, 6, 7]),
        vec![wire::psn::add(p, 4)]
    );
    // The second resend arrived, the first did not: resent again.
    assert_eq!(sack(20_000, &[1, 2, 3, 4, 5, 6, 7]), vec![p]);
    // The same SACK again: nothing newer arrived since, the guard holds.
    assert_eq!(sack(30_000, &[1, 2, 3, 4, 5, 6, 7]), Vec::<u32>::new());
    assert_eq!(a.nic.stats().sack_resends, 3);
    assert!(a.wcs().is_empty(), "a SACK completes nothing");
}

/// The round-trip timer expiring while nothing was lost (the round trip stretched, as a
/// descheduled peer makes it) toward a peer not known to hold: only the oldest packet is
/// resent, not the whole window, and nothing is learnt about the peer.
#[test]
fn a_spurious_round_trip_timeout_resends_only_the_oldest() {
    use std::collections::HashMap;
    let cfg = Cfg::default();
    let (mut a, mut b) = pair(QpType::Rc, &cfg);
    let mut now = 0;
    let (b_base, b_rkey) = (b.base, b.rkey);
    let op = move || SendOp::Write {
        remote_addr: b_base,
        rkey: b_rkey,
    };
    // A first WRITE over a fast link measures the round trip (tens of µs).
    a.write(0, &pattern(4096, 1));
    a.send(now, 1, op(), vec![a.sge(0, 4096)]).unwrap();
    let fast = Faults {
        delay_ns: 10_000,
        ..Faults::default()
    };
    run(&mut a, &mut b, &mut now, Network::new(0, fast), |_, _| {
        false
    });
    assert_eq!(a.wcs().len(), 1);
    // The second crosses a link a hundred times slower: the timer fires, more than once.
    let data = pattern(32 * 1024, 2);
    a.write(0, &data);
    a.send(now, 2, op(), vec![a.sge(0, data.len())]).unwrap();
    let slow = Faults {
        delay_ns: 1_000_000,
        ..Faults::default()
    };
    let mut sent: HashMap<u32, u32> = HashMap::new();
    run(
        &mut a,
        &mut b,
        &mut now,
        Network::new(0, slow),
        |from_a, t| {
            if from_a {
                if let Ok((h, _)) = wire::Headers::parse(&t.data) {
                    *sent.entry(h.bth.psn).or_default() += 1;
                }
            }
            false
        },
    );
    assert_eq!(b.read(0, data.len()), data);
    let w = a.wcs();
    assert_eq!((w.len(), w[0].status), (1, WcStatus::Success));
    let s = a.nic.stats();
    assert!(s.rtt_timeouts >= 2, "{s:?}");
    let first = wire::psn::add(cfg.psn_a, 4);
    let resent: Vec<(u32, u32)> = sent.into_iter().filter(|&(_, n)| n > 1).collect();
    assert_eq!(resent.len(), 1, "only one PSN resent: {resent:?}");
    assert_eq!(resent[0].0, first);
    assert_eq!(
        a.nic.qps[&a.qpn].req.rec.peer_holds(),
        None,
        "nothing learnt"
    );
}

/// a sends a WRITE of `packets` KiB (as many packets at MTU 1024) to b, none delivered,
/// and its QP knows b's UDP port as it would from b's first genuine packet. Returns the
/// datagrams and the data.
fn write_sent_undelivered(
    a: &mut Node,
    b: &Node,
    seed: u8,
    packets: usize,
) -> (Vec<Transmit>, Vec<u8>) {
    let data = pattern(packets * 1024, seed);
    let out = write_unsent(a, b, &data);
    assert_eq!(out.len(), packets);
    (out, data)
}

/// a WRITEs `data` to the start of b's buffer and sends what its window lets it, none
/// delivered; its QP knows b's UDP port as it would from b's first genuine packet.
/// Returns the datagrams.
fn write_unsent(a: &mut Node, b: &Node, data: &[u8]) -> Vec<Transmit> {
    a.write(0, data);
    let op = SendOp::Write {
        remote_addr: b.base,
        rkey: b.rkey,
    };
    a.send(0, 1, op, vec![a.sge(0, data.len())]).unwrap();
    let mut out = Vec::new();
    while let Some(t) = a.nic.poll_transmit(0) {
        out.push(t);
    }
    let port = wire::udp_src_port(b.qpn);
    a.nic.qps.get_mut(&a.qpn).unwrap().peer_port = Some(port);
    out
}

/// Hand a, at `now`, a SACK from b's IP and UDP `port` saying b expects `e` and holds the
/// packets `held` past it; returns the PSNs a sends in answer.
fn inject_sack(a: &mut Node, b: &Node, port: u16, now: u64, e: u32, held: &[u32]) -> Vec<u32> {
    use wire::ext::{Ext, SackBitmap, SACK};
    let mut bits = SackBitmap::default();
    for &d in held {
        bits.set(d);
    }
    let m = Ext::Sack(wire::Bth::new(SACK, a.qpn, e), bits);
    let mut buf = vec![0; m.len()];
    m.emit(&mut buf).unwrap();
    let src = SocketAddr::new(b.nic.addr().ip(), port);
    let dst = a.nic.addr();
    wire::icrc::seal(&wire::Addrs::new(src, dst), &mut buf);
    a.nic.handle_datagram(now, src, dst, &buf);
    let mut sent = Vec::new();
    while let Some(t) = a.nic.poll_transmit(now) {
        sent.push(wire::Headers::parse(&t.data).unwrap().0.bth.psn);
    }
    sent
}

/// A SACK resends the holes below its highest held packet that have at least
/// `DUP_THRESH` held packets past them, each once, lowest first: a hole with fewer after
/// it may be a packet merely overtaken, while more were sent after the highest held.
#[test]
fn a_sack_resends_the_holes_with_enough_held_past_them() {
    // 96 packets of 512 bytes: the bitmap's first 64-bit word and part of the second.
    let cfg = Cfg {
        mtu: Mtu::Mtu512,
        ..Cfg::default()
    };
    let (mut a, b) = pair(QpType::Rc, &cfg);
    assert_eq!(write_unsent(&mut a, &b, &pattern(96 * 512, 5)).len(), 96);
    let b_port = wire::udp_src_port(b.qpn);
    // Holes on both sides of the boundary between the words, and one near the top.
    let holes = [0, 4, 20, 63, 64, 65, 88];
    let held: Vec<u32> = (1..=90).filter(|d| !holes.contains(d)).collect();
    let resent = inject_sack(&mut a, &b, b_port, 0, cfg.psn_a, &held);
    let want: Vec<u32> = [0, 4, 20, 63, 64, 65]
        .iter()
        .map(|&d| wire::psn::add(cfg.psn_a, d))
        .collect();
    assert_eq!(resent, want, "88 has only 89 and 90 held past it");
    // The same SACK again, within the round trip: nothing is resent twice.
    assert_eq!(inject_sack(&mut a, &b, b_port, 1, cfg.psn_a, &held), []);
}

/// Packets a SACK shows held leave the window at once: with a window of eight packets
/// full, a SACK holding seven past the first makes the requester resend the first and
/// send seven new ones, without waiting for an acknowledgement or a post.
#[test]
fn packets_a_sack_shows_held_leave_the_window_at_once() {
    let cfg = Cfg::default();
    let (mut a, b) = pair(QpType::Rc, &cfg);
    set_window(&mut a, 8);
    let sent = write_unsent(&mut a, &b, &pattern(32 * 1024, 8));
    assert_eq!(sent.len(), 8, "the window's worth");
    let b_port = wire::udp_src_port(b.qpn);
    let out = inject_sack(&mut a, &b, b_port, 0, cfg.psn_a, &[1, 2, 3, 4, 5, 6, 7]);
    let want: Vec<u32> = [0, 8, 9, 10, 11, 12, 13, 14]
        .iter()
        .map(|&d| wire::psn::add(cfg.psn_a, d))
        .collect();
    assert_eq!(out, want);
}

/// Runs of lost packets in a SACK cut the window (once per window of packets) when four
/// of the last sixteen holes are runs; isolated holes (random loss), or a run now and
/// then (which random loss makes by chance), leave it: they cost only their resends.
#[test]
fn runs_of_losses_cut_the_window_and_isolated_ones_do_not() {
    let cfg = Cfg::default();
    let runs: &[u32] = &[0, 1, 5, 6, 10, 11, 15, 16];
    for (holes, cut) in [
        (&[0, 5, 10, 15][..], false),
        (&runs[..2], false),
        (runs, true),
    ] {
        let (mut a, mut b) = pair(QpType::Rc, &cfg);
        let (out, data) = write_sent_undelivered(&mut a, &b, 5, 32);
        let b_port = wire::udp_src_port(b.qpn);
        let mut now = 0;
        let cwnd = a.nic.qps[&a.qpn].req.cc.window();
        let held: Vec<u32> = (1..32).filter(|d| !holes.contains(d)).collect();
        let resent = inject_sack(&mut a, &b, b_port, now, cfg.psn_a, &held);
        let want: Vec<u32> = holes
            .iter()
            .map(|&d| wire::psn::add(cfg.psn_a, d))
            .collect();
        assert_eq!(resent, want, "every hole resent at once");
        let after = a.nic.qps[&a.qpn].req.cc.window();
        if cut {
            assert!(
                after < cwnd,
                "four runs of two lost packets: {cwnd} -> {after}"
            );
        } else {
            assert_eq!(after, cwnd, "holes {holes:?} leave the window");
        }
        for t in out {
            b.nic.handle_datagram(now, t.src, t.dst, &t.data);
        }
        pump(&mut a, &mut b, &mut now, |_, _| false);
        assert_eq!(b.read(0, data.len()), data);
        assert_eq!(a.wcs()[0].status, WcStatus::Success);
    }
}

/// A hole at the oldest PSN does not stop the send at the window's ceiling past it: the
/// packets after it are held by the peer, which says so in the SACKs it sends in place
/// of the ACKs they ask for, and the requester goes on sending new ones meanwhile. Here
/// every copy of the hole is lost until the requester has sent well past that limit
/// (before `HOLD_SPAN` it never did, and the hole was lost until the retries ran out);
/// then every WRITE completes, once, with its data.
#[test]
fn a_hole_at_the_oldest_psn_does_not_stop_the_send() {
    // A pair whose requester knows its peer holds and sends SACKs.
    let (mut a, mut b, _, _) = write_twice_losing(&[3]);
    let data = pattern(BUF, 9);
    a.write(0, &data);
    let writes = 48u64;
    let (base, rkey) = (b.base, b.rkey);
    for id in 0..writes {
        let op = SendOp::Write {
            remote_addr: base,
            rkey,
        };
        a.send(0, 100 + id, op, vec![a.sge(0, BUF)]).unwrap();
    }
    let hole = wire::psn::add(a.nic.qps[&a.qpn].req.next_psn, 10);
    let far = a.nic.qps[&a.qpn].req.cc.window() as i32 + 64;
    let mut now = 1_000_000_000;
    let link = Faults {
        delay_ns: 20_000,
        ..Faults::default()
    };
    let (mut lost, mut newest, mut delivered) = (0, hole, false);
    run(
        &mut a,
        &mut b,
        &mut now,
        Network::new(0, link),
        |from_a, t| {
            let Ok((h, _)) = wire::Headers::parse(&t.data) else {
                return false;
            };
            if !from_a || h.bth.opcode.info().is_none() {
                return false;
            }
            let p = h.bth.psn;
            if wire::psn::gt(p, newest) {
                newest = p;
            }
            if p == hole && !delivered {
                delivered = wire::psn::diff(newest, hole) > far;
                lost += u32::from(!delivered);
                return !delivered;
            }
            false
        },
    );
    assert!(
        delivered,
        "the hole was lost until the end ({lost} copies): the send stopped {} PSNs past it",
        wire::psn::diff(newest, hole)
    );
    assert!(lost >= 2, "the hole was lost {lost} times");
    let w = a.wcs();
    assert_eq!(w.len(), writes as usize, "{w:?}");
    assert!(w.iter().all(|w| w.status == WcStatus::Success), "{w:?}");
    assert_eq!(b.read(0, BUF), data);
    assert_eq!(b.nic.env.held_bytes, 0, "nothing stays held");
}

/// A sequence NAK resends the hole it names either way, but cuts the window only for a
/// peer that sends no SACKs (and then by the round trip, here unmeasured: assume the
/// worst). A peer that sends them shows with them whether the loss was a run.
#[test]
fn a_sequence_nak_from_a_sack_peer_leaves_the_window_to_the_sacks() {
    let cfg = Cfg::default();
    for sacks in [false, true] {
        let (mut a, mut b) = pair(QpType::Rc, &cfg);
        let (out, data) = write_sent_undelivered(&mut a, &b, 6, 8);
        // b holds what follows the gap (it knows a's port) and, with `sacks`, was asked
        // for SACKs.
        let q = b.nic.qps.get_mut(&b.qpn).unwrap();
        q.peer_port = Some(out[0].src.port());
        q.resp.sack_peer = sacks;
        if sacks {
            a.nic.qps.get_mut(&a.qpn).unwrap().req.rec.sack_arrived();
        }
        let cwnd = a.nic.qps[&a.qpn].req.cc.window();
        let mut now = 0;
        for t in &out[1..] {
            b.nic.handle_datagram(now, t.src, t.dst, &t.data);
        }
        // Without `sacks`, b is a peer that never answers a SACK_PERMIT (one without the
        // extension): the permits are lost on the way.
        pump(&mut a, &mut b, &mut now, |from_a, t| {
            from_a
                && !sacks
                && matches!(
                    wire::ext::Ext::parse(&t.data),
                    Ok(wire::ext::Ext::SackPermit(_))
                )
        });
        assert_eq!(b.read(0, data.len()), data);
        let w = a.wcs();
        assert_eq!(w.len(), 1);
        assert_eq!(w[0].status, WcStatus::Success);
        let s = a.nic.stats();
        assert_eq!((s.naks_rcvd_seq, s.retransmits), (1, 1), "{s:?}");
        assert!(!sacks || b.nic.stats().sacks_sent > 0);
        let after = a.nic.qps[&a.qpn].req.cc.window();
        if sacks {
            assert_eq!(after, cwnd, "one isolated loss from a SACK peer");
        } else {
            assert!(after < cwnd, "no SACKs: the NAK cuts ({cwnd} -> {after})");
        }
    }
}

/// A READ that finishes while an earlier one still misses a response keeps its place in
/// the READ/atomic window until it completes, in order: the responder remembers only the
/// last `max_dest_rd_atomic` (4) READs, and a fifth one started meanwhile would make it
/// forget the one whose response is asked for again. Every READ completes with its bytes.
#[test]
fn reads_finished_behind_a_missing_response_hold_the_read_window() {
    use wire::{Headers, Opcode};
    let cfg = Cfg {
        mtu: Mtu::Mtu256,
        ..Default::default()
    };
    let (mut a, mut b) = pair(QpType::Rc, &cfg);
    let data = pattern(4096, 5);
    b.write(0, &data);
    let now = 0;
    // READ 0 of 4 packets, then seven of one packet each.
    let mut spans = vec![(0usize, 1024usize)];
    spans.extend((0..7).map(|i| (1024 + 256 * i, 256)));
    for (id, &(off, len)) in spans.iter().enumerate() {
        let op = SendOp::Read {
            remote_addr: b.base + off as u64,
            rkey: b.rkey,
        };
        a.send(now, id as u64, op, vec![a.sge(off, len)]).unwrap();
    }
    let first = cfg.psn_a;
    let (mut lost, mut started_before_repair, mut repaired) = (false, 0, false);
    let link = Faults {
        delay_ns: 20_000,
        ..Faults::default()
    };
    let mut now = now;
    run(
        &mut a,
        &mut b,
        &mut now,
        Network::new(0, link),
        |from_a, t| {
            let (h, _) = Headers::parse(&t.data).unwrap();
            let k = wire::psn::diff(h.bth.psn, first);
            if from_a && h.bth.opcode == Opcode::RC_RDMA_READ_REQUEST && k >= 4 && !repaired {
                // A first request of a later READ, sent while READ 0 misses its response.
                started_before_repair = started_before_repair.max(k - 3);
            }
            if !from_a && k == 2 {
                if !lost {
                    lost = true;
                    return true;
                }
                repaired = true;
            }
            false
        },
    );
    assert!(lost && repaired);
    assert!(
        started_before_repair <= 3,
        "{started_before_repair} READs started after READ 0 before its response came"
    );
    let w = a.wcs();
    assert_eq!(w.len(), spans.len(), "{w:?}");
    assert!(w.iter().all(|w| w.status == WcStatus::Success), "{w:?}");
    let end = 1024 + 256 * 7;
    assert!(a.read(0, end) == data[..end], "READ bytes");
    let s = b.nic.stats();
    assert_eq!((s.dropped, s.read_replays_refused), (0, 0), "{s:?}");
}

/// A READ response asked for again and lost again is asked for a third time as soon as
/// the response to a part asked after it arrives (the responder answers in the order it
/// was asked), not after a round-trip timer.
#[test]
fn a_read_part_lost_again_is_asked_again_when_a_later_part_arrives() {
    // Response 10 lost twice, response 200 once.
    let mut copies = [0u32; 2];
    let r = read_losing(4, |k| match k {
        10 => {
            copies[0] += 1;
            copies[0] <= 2
        }
        200 => {
            copies[1] += 1;
            copies[1] == 1
        }
        _ => false,
    });
    assert_eq!(copies, [3, 2]);
    let mut a = r.a;
    let w = a.wcs();
    assert_eq!((w.len(), w[0].status), (1, WcStatus::Success));
    assert!(a.read(0, BUF) == r.data, "READ bytes");
    assert_eq!(
        r.requests,
        vec![(0, BUF as u32), (10, 256), (200, 256), (10, 256)],
        "(first response asked, bytes asked) of each READ request"
    );
    let s = a.nic.stats();
    assert_eq!((s.timeouts, s.rtt_timeouts), (0, 0), "{s:?}");
}

/// Four READs of 4 KiB a ← b over a 20 µs link after a first READ measured the round
/// trip; the first of the four loses its request once. When `holds` is false, b forgets
/// a's port first, so that it drops the requests that follow the gap as an IBTA
/// responder does; when `lose_nak`, the sequence NAK b sends for the gap is lost too.
/// Returns the pair, the PSN of every READ request a sent, in order, and the first PSN
/// of the four.
fn reads_losing_a_request(holds: bool, lose_nak: bool) -> (Node, Node, Vec<u32>, u32) {
    use wire::{Headers, Opcode};
    let (mut a, mut b) = pair(QpType::Rc, &Cfg::default());
    let data = pattern(BUF, 5);
    b.write(0, &data);
    let mut now = 0;
    let link = Faults {
        delay_ns: 20_000,
        ..Faults::default()
    };
    let (base, rkey) = (b.base, b.rkey);
    let read = |off: usize| SendOp::Read {
        remote_addr: base + off as u64,
        rkey,
    };
    a.send(now, 0, read(0), vec![a.sge(0, 1024)]).unwrap();
    run(
        &mut a,
        &mut b,
        &mut now,
        Network::new(0, link.clone()),
        |_, _| false,
    );
    assert!(a.nic.qps[&a.qpn].req.rtt.has_sample());
    if !holds {
        b.nic.qps.get_mut(&b.qpn).unwrap().peer_port = None;
    }
    let first = a.nic.qps[&a.qpn].req.next_psn;
    for i in 1..=4usize {
        let sge = a.sge(i * 4096, 4096);
        a.send(now, i as u64, read(i * 4096), vec![sge]).unwrap();
    }
    let mut requests = Vec::new();
    let mut naks = 0;
    let nak = wire::Syndrome::Nak(wire::NakCode::PsnSequenceError);
    run(
        &mut a,
        &mut b,
        &mut now,
        Network::new(0, link),
        |from_a, t| {
            let Ok((h, _)) = Headers::parse(&t.data) else {
                return false;
            };
            if !from_a && h.aeth.is_some_and(|a| a.syndrome == nak) {
                naks += 1;
                return lose_nak && naks == 1;
            }
            if !(from_a && h.bth.opcode == Opcode::RC_RDMA_READ_REQUEST) {
                return false;
            }
            requests.push(h.bth.psn);
            requests.len() == 1
        },
    );
    let wcs = a.wcs();
    let mut ids: Vec<u64> = wcs.iter().map(|w| w.wr_id).collect();
    ids.sort_unstable();
    assert_eq!(ids, [0, 1, 2, 3, 4]);
    assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
    assert_eq!(a.read(4096, 4 * 4096), data[4096..5 * 4096]);
    (a, b, requests, first)
}

/// The first PSNs of the four READs of [`reads_losing_a_request`] at `idx`, in order.
fn psns(first: u32, idx: &[u32]) -> Vec<u32> {
    idx.iter().map(|&i| wire::psn::add(first, 4 * i)).collect()
}

/// A READ request lost before requests a peer holds past the gap: the sequence NAK
/// makes the requester send that request again alone, instead of going back N over the
/// READs after it, which the peer would then execute twice. The responses of those
/// READs, which follow the resent one's, show that the peer held them.
#[test]
fn a_lost_read_request_is_sent_again_alone_to_a_peer_that_holds() {
    let (a, b, requests, first) = reads_losing_a_request(true, false);
    assert_eq!(requests, psns(first, &[0, 1, 2, 3, 0]));
    let (sa, sb) = (a.nic.stats(), b.nic.stats());
    assert_eq!(sb.read_replays, 0, "no READ executed twice");
    assert_eq!(sa.duplicates, 0);
    assert_eq!((sa.naks_rcvd_seq, sa.timeouts, sa.rtt_timeouts), (1, 0, 0));
    assert_eq!(a.nic.qps[&a.qpn].req.rec.peer_holds(), Some(true));
}

/// The same to a peer that drops what follows a gap: the resent request's responses
/// come and nothing after them, so the round-trip timer finds the peer dropped the
/// rest; the requester goes back N over them and from then on goes back N at once.
#[test]
fn a_lost_read_request_to_a_peer_that_drops_then_goes_back_n() {
    let (a, _b, requests, first) = reads_losing_a_request(false, false);
    assert_eq!(requests, psns(first, &[0, 1, 2, 3, 0, 1, 2, 3]));
    let sa = a.nic.stats();
    assert_eq!((sa.naks_rcvd_seq, sa.timeouts, sa.rtt_timeouts), (1, 0, 1));
    assert_eq!(a.nic.qps[&a.qpn].req.rec.peer_holds(), Some(false));
}

/// The same with the sequence NAK lost too, so that only the round-trip timer finds
/// the loss: its resend is no question asked of the peer, so with a peer not known to
/// hold it goes back N rather than send each READ's request again alone, an expiry
/// each.
#[test]
fn a_lost_read_request_found_by_the_timer_goes_back_n_with_a_peer_not_known() {
    let (a, _b, requests, first) = reads_losing_a_request(false, true);
    assert_eq!(requests, psns(first, &[0, 1, 2, 3, 0, 1, 2, 3]));
    let sa = a.nic.stats();
    assert_eq!((sa.naks_rcvd_seq, sa.timeouts, sa.rtt_timeouts), (0, 0, 1));
}

/// Responses that arrived past a missing one are in flight no more: with a window of
/// eight packets and two READs of four in flight, the first READ's first response lost,
/// the requester sends the next two READs while the lost response is asked for again,
/// instead of waiting, its path empty, until it comes.
#[test]
fn read_responses_past_a_missing_one_leave_the_window() {
    use wire::{Headers, Opcode};
    let (mut a, mut b) = pair(QpType::Rc, &Cfg::default());
    let data = pattern(BUF, 6);
    b.write(0, &data);
    set_window(&mut a, 8);
    let mut now = 0;
    let first = a.nic.qps[&a.qpn].req.next_psn;
    for i in 0..4usize {
        let read = SendOp::Read {
            remote_addr: b.base + (i * 4096) as u64,
            rkey: b.rkey,
        };
        let sge = a.sge(i * 4096, 4096);
        a.send(now, i as u64, read, vec![sge]).unwrap();
    }
    let link = Faults {
        delay_ns: 20_000,
        ..Faults::default()
    };
    // (from a, opcode, PSN) of every packet, in the order the link took them.
    let mut log = Vec::new();
    let mut lost = false;
    run(
        &mut a,
        &mut b,
        &mut now,
        Network::new(0, link),
        |from_a, t| {
            let Ok((h, _)) = Headers::parse(&t.data) else {
                return false;
            };
            log.push((from_a, h.bth.opcode, h.bth.psn));
            let lose = !from_a && h.bth.psn == first && !lost;
            lost |= lose;
            lose
        },
    );
    assert!(lost);
    assert_eq!(a.wcs().len(), 4);
    assert_eq!(a.read(0, 4 * 4096), data[..4 * 4096]);
    let req = |i: u32| {
        log.iter()
            .position(|&(f, o, p)| {
                f && o == Opcode::RC_RDMA_READ_REQUEST && p == wire::psn::add(first, 4 * i)
            })
            .expect("request sent")
    };
    let repaired = log
        .iter()
        .enumerate()
        .filter(|&(_, &(f, _, p))| !f && p == first)
        .nth(1)
        .map(|(i, _)| i)
        .expect("the lost response sent again");
    assert!(req(2) < repaired && req(3) < repaired, "{log:?}");
}

/// A READ's lost responses tell congestion from random loss as a SACK's holes do:
/// isolated ones leave the window alone, runs of two cut it once four of the last
/// sixteen holes were runs.
#[test]
fn runs_of_lost_read_responses_cut_the_window_and_isolated_ones_do_not() {
    let cwnd_after = |lost: &[u32]| {
        let mut seen = Vec::new();
        let r = read_losing(4, |k| {
            let hit = lost.contains(&k) && !seen.contains(&k);
            if hit {
                seen.push(k);
            }
            hit
        });
        assert_eq!(r.a.read(0, BUF), r.data);
        let q = &r.a.nic.qps[&r.a.qpn];
        (q.req.cc.window(), r.a.nic.stats().rtt_timeouts)
    };
    let isolated: Vec<u32> = (1..=8).map(|i| i * 25).collect();
    // read_losing's path MTU is 256.
    let full = crate::cc::ceiling_for(256, crate::cc::DEFAULT_RX_BUFFER);
    assert_eq!(cwnd_after(&isolated), (full, 0));
    let runs: Vec<u32> = (1..=4).flat_map(|i| [i * 50, i * 50 + 1]).collect();
    let (cwnd, rtt_timeouts) = cwnd_after(&runs);
    assert_eq!(rtt_timeouts, 0);
    assert!(cwnd < full, "{cwnd}");
}

/// Run `a` and `b` on `link` until quiet, losing `a`'s packet `p` once; whether it was.
fn run_losing_once(a: &mut Node, b: &mut Node, now: &mut u64, link: &Faults, p: u32) -> bool {
    let mut lost = false;
    run(a, b, now, Network::new(0, link.clone()), |from_a, t| {
        let Ok((h, _)) = wire::Headers::parse(&t.data) else {
            return false;
        };
        let lose = from_a && h.bth.psn == p && !lost;
        lost |= lose;
        lose
    });
    lost
}

/// A go-back-N answers a loss like any other: on a path whose round trip shows no
/// queue (a constant 40 µs here) it leaves the window alone, as a selective repeat
/// does. A peer that drops what follows a gap (b, made to forget a's port before each
/// WRITE) costs a window's packets per loss, not a cut at every loss as well.
#[test]
fn a_go_back_n_on_a_path_without_a_queue_keeps_the_window() {
    let (mut a, mut b) = pair(QpType::Rc, &Cfg::default());
    let link = Faults {
        delay_ns: 20_000,
        ..Faults::default()
    };
    let mut now = 0;
    let data = pattern(32 * 1024, 8);
    a.write(0, &data);
    let op = SendOp::Write {
        remote_addr: b.base,
        rkey: b.rkey,
    };
    a.send(now, 1, op, vec![a.sge(0, 1024)]).unwrap();
    run(
        &mut a,
        &mut b,
        &mut now,
        Network::new(0, link.clone()),
        |_, _| false,
    );
    // The first loss teaches a that b drops (a selective resend, answered by an ACK of
    // the hole alone); at the second a goes back N at once, on the sequence NAK.
    for id in 2..4u64 {
        b.nic.qps.get_mut(&b.qpn).unwrap().peer_port = None;
        let first = a.nic.qps[&a.qpn].req.next_psn;
        a.send(now, id, op, vec![a.sge(0, data.len())]).unwrap();
        assert!(run_losing_once(&mut a, &mut b, &mut now, &link, first));
        assert_eq!(b.read(0, data.len()), data);
    }
    assert_eq!(a.wcs().len(), 3);
    let q = &a.nic.qps[&a.qpn];
    assert_eq!(
        q.req.rec.peer_holds(),
        Some(false),
        "b dropped what followed the gap"
    );
    assert_eq!(
        a.nic.stats().retransmits,
        64,
        "each time the hole and the 31 after it"
    );
    assert_eq!(
        q.req.cc.window(),
        crate::cc::ceiling_for(1024, crate::cc::DEFAULT_RX_BUFFER)
    );
}

/// The first loss between softrdma peers comes before any round trip was measured and
/// before the requester asked for SACKs, so only the round trip's rule judges it, and it
/// cuts (no sample: assume queueing). Once the peer's first SACK shows it sends them,
/// runs of losses decide, and that cut is undone: the window is whole again.
#[test]
fn the_first_sack_undoes_a_cut_the_round_trip_alone_made() {
    let (mut a, mut b) = pair(QpType::Rc, &Cfg::default());
    let link = Faults {
        delay_ns: 20_000,
        ..Faults::default()
    };
    let mut now = 0;
    let data = pattern(64 * 1024, 9);
    a.write(0, &data);
    let op = SendOp::Write {
        remote_addr: b.base,
        rkey: b.rkey,
    };
    let first = a.nic.qps[&a.qpn].req.next_psn;
    a.send(now, 1, op, vec![a.sge(0, data.len())]).unwrap();
    let tenth = wire::psn::add(first, 10);
    assert!(run_losing_once(&mut a, &mut b, &mut now, &link, tenth));
    assert_eq!(b.read(0, data.len()), data);
    assert_eq!(a.wcs().len(), 1);
    let q = &a.nic.qps[&a.qpn];
    assert_eq!(
        q.req.rec.peer_holds(),
        Some(true),
        "b held what followed the gap"
    );
    assert!(q.req.rec.peer_sacks(), "b answered the SACK_PERMIT");
    assert_eq!(a.nic.stats().retransmits, 1, "the hole alone");
    assert_eq!(
        q.req.cc.window(),
        crate::cc::ceiling_for(1024, crate::cc::DEFAULT_RX_BUFFER)
    );
}

/// Two responses lost in a row are asked for in one request; when the first of them
/// arrives, the second, asked with it, is no fresh hole and is not asked again.
#[test]
fn a_run_of_lost_responses_is_asked_for_once() {
    let mut lost = Vec::new();
    let r = read_losing(5, |k| {
        let hit = [10, 11].contains(&k) && !lost.contains(&k);
        if hit {
            lost.push(k);
        }
        hit
    });
    assert_eq!(r.a.read(0, BUF), r.data);
    assert_eq!(r.requests, vec![(0, BUF as u32), (10, 512)]);
    assert_eq!(r.responses, 256 + 2, "each lost response sent once more");
    assert_eq!(r.a.nic.stats().duplicates, 0);
}

/// A FETCH_ADD whose ACK is lost, then a 32-packet READ: the READ response that shows the
/// atomic ACK lost is kept all the same, so the go-back-N asks again for the atomic
/// (answered from the responder's replay cache, the add applied once) and for the READ
/// from past what arrived, not from its start. Before, every response past the missing
/// ACK was dropped and each go-back-N asked for the whole READ again: under heavy loss
/// its re-executions ran out of budget before one got through (RETRY_EXC_ERR).
#[test]
fn responses_past_a_lost_atomic_ack_are_kept() {
    use wire::{Headers, OpKind};
    let (mut a, mut b) = pair(QpType::Rc, &Cfg::default());
    b.write(64, &5u64.to_ne_bytes());
    let data = pattern(32 * 1024, 9);
    b.write(4096, &data);
    let mut now = 0;
    let fetch_add = SendOp::FetchAdd {
        remote_addr: b.base + 64,
        rkey: b.rkey,
        add: 10,
    };
    a.send(now, 1, fetch_add, vec![a.sge(0, 8)]).unwrap();
    let read = SendOp::Read {
        remote_addr: b.base + 4096,
        rkey: b.rkey,
    };
    a.send(now, 2, read, vec![a.sge(4096, data.len())]).unwrap();
    let (mut lost, mut read_requests) = (false, Vec::new());
    pump(&mut a, &mut b, &mut now, |from_a, t| {
        let Ok((h, _)) = Headers::parse(&t.data) else {
            return false;
        };
        let kind = h.bth.opcode.info().map(|i| i.kind);
        if from_a && kind == Some(OpKind::ReadRequest) {
            read_requests.push(h.bth.psn);
        }
        let lose = !from_a && kind == Some(OpKind::AtomicAcknowledge) && !lost;
        lost |= lose;
        lose
    });
    assert!(lost);
    let w = a.wcs();
    assert_eq!(w.len(), 2, "{w:?}");
    assert!(w.iter().all(|w| w.status == WcStatus::Success), "{w:?}");
    assert_eq!(a.read(0, 8), 5u64.to_ne_bytes(), "the original value");
    assert_eq!(b.read(64, 8), 15u64.to_ne_bytes(), "added once");
    assert_eq!(a.read(4096, data.len()), data);
    let first = wire::psn::add(Cfg::default().psn_a, 1);
    assert_eq!(read_requests.len(), 2, "{read_requests:?}");
    assert_eq!(read_requests[0], first);
    assert!(
        wire::psn::lt(first, read_requests[1]),
        "asked again from past the responses kept: {read_requests:?}"
    );
}

/// Keepalive settings for the tests: lost 1 s after the last word (250 ms idle, then
/// 5 probes 150 ms apart), whatever the peer's address.
const KA: Keepalive = Keepalive::LOCAL;

/// Two RC QPs connected with keepalive `KA` on both sides, one SEND exchanged (so the
/// connection has carried traffic), `b` with a receive posted for later.
fn keepalive_pair(now: &mut u64) -> (Node, Node) {
    let mut a = Node::new("10.0.0.1", 1);
    let mut b = Node::new("10.0.0.2", 2);
    for n in [&mut a, &mut b] {
        n.nic.set_keepalive(KeepalivePolicy {
            local: Some(KA),
            remote: Some(KA),
        });
        n.create(QpType::Rc);
    }
    let cfg = Cfg::default();
    connect(&mut a, &b, QpType::Rc, &cfg, cfg.psn_a, cfg.psn_b);
    connect(&mut b, &a, QpType::Rc, &cfg, cfg.psn_b, cfg.psn_a);
    b.post_recv(1, 0, 100);
    a.write(0, b"hello");
    a.send(*now, 1, SendOp::Send, vec![a.sge(0, 5)]).unwrap();
    run_for(&mut a, &mut b, now, 1_000_000, Faults::default(), 0, false);
    assert_eq!(a.wcs()[0].status, WcStatus::Success);
    assert_eq!(b.wcs()[0].status, WcStatus::Success);
    (a, b)
}

/// Run both nodes on a network with `faults` (seed `seed`) for `span` ns of virtual time,
/// or until `a`'s QP fails; with `b_dead`, nothing `b` sends arrives (the process is
/// gone). Returns whether `a`'s QP failed.
fn run_for(
    a: &mut Node,
    b: &mut Node,
    now: &mut u64,
    span: u64,
    faults: Faults,
    seed: u64,
    b_dead: bool,
) -> bool {
    let drop = RefCell::new(move |from_a: bool, _: &Transmit| b_dead && !from_a);
    let a_qpn = a.qpn;
    let mut sim = Sim::new(Network::new(seed, faults));
    sim.now = *now;
    sim.add(Side {
        node: a,
        is_a: true,
        drop: &drop,
    });
    sim.add(Side {
        node: b,
        is_a: false,
        drop: &drop,
    });
    let failed = sim.run_until(now.saturating_add(span), |s| {
        s.endpoints[0].node.nic.query_qp(a_qpn).unwrap().qp_state == verbs::QpState::Err
    });
    *now = sim.now;
    failed
}

/// A peer that dies (nothing it would send arrives any more) while its partner only
/// waits to receive is found lost within the keepalive's bound: the waiting receive
/// completes with WR_FLUSH_ERR, and the QP's fatal event is raised (no connection manager
/// takes the loss here). Before keepalive, the receive waited forever: nothing was in
/// flight, so no timer ran.
#[test]
fn a_silent_peer_is_lost_within_the_keepalive_bound() {
    let mut now = 0;
    let (mut a, mut b) = keepalive_pair(&mut now);
    a.post_recv(7, 0, 100);
    let died = now;
    let lost = run_for(
        &mut a,
        &mut b,
        &mut now,
        60 * KA.bound_ns(),
        Faults::default(),
        0,
        true,
    );
    assert!(lost, "the peer was never found lost");
    assert!(
        now - died <= KA.bound_ns(),
        "found lost {} ms after the last word, past the bound",
        (now - died) / 1_000_000
    );
    let w = a.wcs();
    assert_eq!(w.len(), 1, "{w:?}");
    assert_eq!((w[0].wr_id, w[0].status), (7, WcStatus::WrFlushErr));
    let s = a.nic.stats();
    assert_eq!(
        (s.keepalive_probes, s.keepalive_acks, s.peers_lost),
        (u64::from(KA.probes), 0, 1)
    );
    assert_eq!(a.nic.next_event(), Some(verbs::AsyncEvent::QpFatal(a.qpn)));
    assert_eq!(
        a.nic.take_lost_peer(),
        None,
        "no connection manager to tell"
    );
}

/// With a connection manager taking the GSI, a lost peer is reported to it (which ends
/// the connection) instead of as the QP's fatal event.
#[test]
fn a_lost_peer_is_told_to_the_connection_manager() {
    let mut now = 0;
    let (mut a, mut b) = keepalive_pair(&mut now);
    a.nic.set_gsi_consumer(true);
    assert!(run_for(
        &mut a,
        &mut b,
        &mut now,
        60 * KA.bound_ns(),
        Faults::default(),
        0,
        true
    ));
    assert!(a.nic.gsi_pending());
    assert_eq!(a.nic.take_lost_peer(), Some(a.qpn));
    assert_eq!(a.nic.take_lost_peer(), None);
    assert!(!a.nic.gsi_pending());
    assert_eq!(a.nic.next_event(), None);
}

/// A live peer that stays idle for ten minutes of virtual time answers every probe, over
/// a perfect link and over one that loses 3% of the packets (a probe or its answer lost
/// is made up by the next probe): never found lost. The probes change nothing on either
/// side: a SEND afterwards lands in the receive posted before the idle time.
#[test]
fn a_live_idle_peer_is_never_lost() {
    for (loss, seed) in [(0.0, 0), (0.03, 1), (0.03, 2)] {
        let mut now = 0;
        let (mut a, mut b) = keepalive_pair(&mut now);
        b.post_recv(2, 256, 100);
        let faults = Faults {
            loss,
            ..Faults::default()
        };
        let idle = 600_000_000_000;
        let failed = run_for(&mut a, &mut b, &mut now, idle, faults, seed, false);
        assert!(!failed, "loss {loss}: a live peer was found lost");
        for n in [&a, &b] {
            assert_eq!(n.nic.query_qp(n.qpn).unwrap().qp_state, verbs::QpState::Rts);
            let s = n.nic.stats();
            assert_eq!(s.peers_lost, 0, "loss {loss}: {s:?}");
            // About one probe per idle time, at least.
            assert!(
                s.keepalive_probes >= idle / KA.bound_ns(),
                "loss {loss}: {s:?}"
            );
            assert!(s.keepalive_acks > 0, "loss {loss}: {s:?}");
        }
        assert_eq!(a.wcs(), vec![], "the probes completed nothing");
        assert_eq!(b.wcs(), vec![], "the probes completed nothing");
        a.write(0, b"still here");
        a.send(now, 3, SendOp::Send, vec![a.sge(0, 10)]).unwrap();
        run_for(
            &mut a,
            &mut b,
            &mut now,
            10_000_000_000,
            Faults::default(),
            0,
            false,
        );
        assert_eq!(a.wcs()[0].status, WcStatus::Success);
        let w = b.wcs();
        assert_eq!(
            (w[0].wr_id, w[0].status, w[0].byte_len),
            (2, WcStatus::Success, 10)
        );
        assert_eq!(b.read(256, 10), b"still here");
    }
}

/// The probe is a duplicate the responder acknowledges without executing: a zero-length
/// RDMA WRITE ONLY with AckReq at the PSN before the next, answered by an ACK of that PSN,
/// which the prober takes as the answer and completes nothing with.
#[test]
fn the_probe_is_an_acknowledged_duplicate() {
    use wire::Headers;
    let mut now = 0;
    let (mut a, mut b) = keepalive_pair(&mut now);
    let next = a.nic.qps[&a.qpn].req.next_psn;
    now += KA.idle_ns;
    a.nic.handle_timeout(now);
    let t = a.nic.poll_transmit(now).expect("a probe");
    assert!(a.nic.poll_transmit(now).is_none());
    let (h, payload) = Headers::parse(&t.data).unwrap();
    assert_eq!(h.bth.opcode, wire::Opcode::RC_RDMA_WRITE_ONLY);
    assert_eq!(h.bth.psn, wire::psn::sub(next, 1));
    assert!(h.bth.ack_req);
    assert_eq!(h.reth.map(|r| r.dma_len), Some(0));
    assert!(payload.is_empty());
    let dup = b.nic.stats().duplicates;
    b.nic.handle_datagram(now, t.src, t.dst, &t.data);
    assert_eq!(b.nic.stats().duplicates, dup + 1);
    let ack = b.nic.poll_transmit(now).expect("an ACK");
    let (h, _) = Headers::parse(&ack.data).unwrap();
    assert_eq!(h.bth.opcode, wire::Opcode::RC_ACKNOWLEDGE);
    assert_eq!(h.bth.psn, wire::psn::sub(next, 1));
    a.nic.handle_datagram(now, ack.src, ack.dst, &ack.data);
    assert_eq!(a.nic.stats().keepalive_acks, 1);
    // Heard from: the next probe waits for another idle time.
    assert_eq!(a.nic.poll_timeout(), Some(now + KA.interval_ns));
    a.nic.handle_timeout(now + KA.interval_ns);
    assert!(a.nic.poll_transmit(now).is_none());
    assert_eq!(a.nic.poll_timeout(), Some(now + KA.idle_ns));
    assert_eq!((a.wcs(), b.wcs()), (vec![], vec![]));
}

mod placement;
