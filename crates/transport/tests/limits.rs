//! Bounded state against what a remote peer can send: READ responses paced through a
//! bounded outbox, responses kept in PSN order behind a READ stream, hostile packets
//! (forged with `Headers::emit` + `icrc::seal`) answered with the right error or dropped,
//! and the IP TOS of a UD datagram reported in its GRH.

use common::*;
use softrdma_testkit as common;

use std::net::SocketAddr;

use wire::{Aeth, AtomicEth, Bth, NakCode, Opcode as Op, Reth, Syndrome};

const LW: Access = Access::LOCAL_WRITE;

/// What a responder may hold queued: the outbox bound (256) plus a few single packets.
const QUEUE_BOUND: usize = 256 + 8;

fn all_remote() -> Access {
    Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC
}

/// Bytes cheap to make in bulk (64 MiB in a debug build) that differ packet to packet.
fn bulk(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ ((i >> 10) as u8) ^ ((i >> 18) as u8) ^ seed)
        .collect()
}

/// The address QP `qpn` of device `dev` sends from: the device's IP and the QP's UDP
/// source port. Packets a test forges for a connected peer come from there, since a QP
/// takes packets only from the port its peer sends from.
fn qp_src(dev: usize, qpn: Qpn) -> SocketAddr {
    SocketAddr::new(dev_addr(dev).ip(), wire::udp_src_port(qpn))
}

/// A sealed datagram from `src` to device `to`.
fn forge(h: &wire::Headers, payload: &[u8], src: SocketAddr, to: usize) -> Vec<u8> {
    let mut buf = vec![0u8; h.packet_len(payload.len())];
    h.emit(payload, &mut buf).expect("emit a forged packet");
    wire::icrc::seal(&wire::Addrs::new(src, dev_addr(to)), &mut buf);
    buf
}

/// Hand a forged datagram from `src` to device `to` directly.
fn inject(w: &mut World, src: SocketAddr, to: usize, data: &[u8]) {
    let now = w.now();
    w.nic(to).handle_datagram(now, src, dev_addr(to), data);
}

fn read_req(dest_qp: Qpn, psn: u32, va: u64, rkey: u32, len: u32) -> wire::Headers {
    let mut bth = Bth::new(Op::RC_RDMA_READ_REQUEST, dest_qp, psn);
    bth.ack_req = true;
    let mut h = wire::Headers::new(bth);
    h.reth = Some(Reth {
        va,
        rkey,
        dma_len: len,
    });
    h
}

fn max_queued(w: &World, d: usize) -> usize {
    w.sim.endpoints[d].max_queued
}

/// Response packets queued at device `d`, taken out of the engine (opcode, PSN, payload).
fn take_queued(w: &mut World, d: usize) -> Vec<(Op, u32, Vec<u8>)> {
    let now = w.now();
    let mut v = Vec::new();
    while let Some(t) = w.nic(d).poll_transmit(now) {
        let (h, p) = wire::Headers::parse(&t.data).expect("our own packet parses");
        v.push((h.bth.opcode, h.bth.psn, p.to_vec()));
    }
    v
}

#[test]
fn read_64mib_is_paced_and_correct() {
    const LEN: usize = 64 << 20;
    let mut w = World::two(501);
    let cfg = QpCfg::rc().with_mtu(Mtu::Mtu4096);
    let (a, b) = w.pair(&cfg);
    let data = bulk(LEN, 7);
    let src = w.mr(1, b.pd, LEN, all_remote(), 0);
    src.write(0, &data);
    let dst = w.mr(0, a.pd, LEN, LW, 0);
    w.post_send(
        &a,
        wr(
            1,
            SendOp::Read {
                remote_addr: src.va(0),
                rkey: src.rkey(),
            },
            vec![dst.sge(0, LEN)],
        ),
    );
    let c = w.expect_wc(0, a.scq);
    check_send_wc(&c, &send_wc(&a, 1, WcOpcode::RdmaRead, LEN), "64 MiB READ");
    assert!(dst.read_all() == data, "64 MiB READ: bytes differ");
    let q = max_queued(&w, 1);
    assert!(
        q <= QUEUE_BOUND,
        "responder queued {q} datagrams at once for a {} packet READ",
        LEN / 4096
    );
    assert_eq!(
        w.stats(1).tx_packets as usize,
        LEN / 4096,
        "one response per PSN"
    );
}

/// A READ streaming, then a SEND and a second READ behind it: every response in PSN
/// order, the ACK of the SEND after the first READ's last response.
#[test]
fn responses_stay_in_psn_order_behind_a_read_stream() {
    let mut w = World::two(502);
    let cfg = QpCfg::rc().with_mtu(Mtu::Mtu1024);
    let (a, b) = w.pair(&cfg);
    w.capture(1);
    let len = 1 << 20;
    let src = w.mr(1, b.pd, len, all_remote(), 0);
    src.write(0, &bulk(len, 3));
    let dst = w.mr(0, a.pd, 2 * len, LW, 0);
    let msg = w.mr(0, a.pd, 64, LW, 0x42);
    let rb = w.mr(1, b.pd, 64, LW, 0);
    w.post_recv(&b, rwr(9, vec![rb.sge(0, 64)]));
    let read = |id, off| {
        wr(
            id,
            SendOp::Read {
                remote_addr: src.va(0),
                rkey: src.rkey(),
            },
            vec![dst.sge(off, len)],
        )
    };
    w.post_send(&a, read(1, 0));
    w.post_send(&a, wr(2, SendOp::Send, vec![msg.sge(0, 64)]));
    w.post_send(&a, read(3, len));
    let c = w.expect_wcs(0, a.scq, 3);
    check_send_wc(&c[0], &send_wc(&a, 1, WcOpcode::RdmaRead, len), "READ 1");
    check_send_wc(&c[1], &send_wc(&a, 2, WcOpcode::Send, 64), "SEND");
    check_send_wc(&c[2], &send_wc(&a, 3, WcOpcode::RdmaRead, len), "READ 2");
    assert!(dst.read(0, len) == bulk(len, 3) && dst.read(len, len) == bulk(len, 3));
    assert_eq!(w.expect_wc(1, b.rcq).byte_len, 64);
    let psns: Vec<u32> = w
        .take_log(1)
        .iter()
        .filter(|c| c.dir == Dir::Tx)
        .map(|c| parse(&c.pkt).0.bth.psn)
        .collect();
    assert!(
        psns.windows(2).all(|p| wire::psn::le(p[0], p[1])),
        "responses out of PSN order"
    );
    assert!(max_queued(&w, 1) <= QUEUE_BOUND);
    assert_eq!(w.stats(0).retransmits, 0, "no loss, so no retry");
}

/// READs, SENDs and WRITEs interleaved under loss, duplication and reordering: the
/// requester retries, so the responder sees duplicate READs (re-executed from the PSN
/// asked, while other READs are being streamed); everything completes in order with the
/// right bytes, and the outbox stays bounded.
#[test]
fn read_send_and_duplicate_read_under_loss() {
    for seed in 0..4u64 {
        let faults = Faults {
            loss: 0.02,
            duplicate: 0.02,
            reorder: 0.02,
            ..Faults::default()
        };
        let mut w = World::new(2, 600 + seed, faults);
        let cfg = QpCfg::rc().with_mtu(Mtu::Mtu1024);
        let (a, b) = w.pair(&cfg);
        let len = 512 << 10;
        let src = w.mr(1, b.pd, len, all_remote(), 0);
        src.write(0, &bulk(len, seed as u8));
        let dst = w.mr(0, a.pd, 4 * len, LW, 0);
        let msg = w.mr(0, a.pd, 4096, LW, 0);
        msg.write(0, &bulk(4096, 99));
        let rb = w.mr(1, b.pd, 4 * 4096, LW, 0);
        let wt = w.mr(1, b.pd, 4096, all_remote(), 0);
        for i in 0..4 {
            w.post_recv(&b, rwr(100 + i, vec![rb.sge(i as usize * 4096, 4096)]));
        }
        let mut expect = Vec::new();
        for i in 0..4u64 {
            w.post_send(
                &a,
                wr(
                    10 * i + 1,
                    SendOp::Read {
                        remote_addr: src.va(0),
                        rkey: src.rkey(),
                    },
                    vec![dst.sge(i as usize * len, len)],
                ),
            );
            expect.push(send_wc(&a, 10 * i + 1, WcOpcode::RdmaRead, len));
            let send_len = 1000 + 1000 * i as usize;
            w.post_send(&a, wr(10 * i + 2, SendOp::Send, vec![msg.sge(0, send_len)]));
            expect.push(send_wc(&a, 10 * i + 2, WcOpcode::Send, send_len));
            if i == 1 {
                w.post_send(
                    &a,
                    wr(
                        10 * i + 3,
                        SendOp::Write {
                            remote_addr: wt.va(0),
                            rkey: wt.rkey(),
                        },
                        vec![msg.sge(0, 4096)],
                    ),
                );
                expect.push(send_wc(&a, 10 * i + 3, WcOpcode::RdmaWrite, 4096));
            }
        }
        let got = w.poll_within(0, a.scq, expect.len(), 20 * SEC);
        let ctx = format!("seed {}", w.seed);
        assert_eq!(got.len(), expect.len(), "{ctx}: completions {got:#?}");
        for (g, e) in got.iter().zip(&expect) {
            check_send_wc(g, e, &ctx);
        }
        for i in 0..4 {
            assert!(
                dst.read(i * len, len) == bulk(len, seed as u8),
                "{ctx}: READ {i} bytes"
            );
        }
        let r = w.poll_within(1, b.rcq, 4, 2 * SEC);
        assert_eq!(r.len(), 4, "{ctx}: receives");
        for (i, rc) in r.iter().enumerate() {
            assert_eq!(
                (rc.wr_id, rc.status, rc.byte_len as usize),
                (100 + i as u64, WcStatus::Success, 1000 + 1000 * i),
                "{ctx}"
            );
            assert_bytes(
                &rb.read(i * 4096, rc.byte_len as usize),
                &bulk(4096, 99)[..rc.byte_len as usize],
                &ctx,
            );
        }
        assert_bytes(&wt.read_all(), &bulk(4096, 99), &ctx);
        assert!(w.stats(1).duplicates > 0, "{ctx}: no duplicate seen");
        assert!(max_queued(&w, 1) <= QUEUE_BOUND, "{ctx}");
    }
}

/// A READ larger than the IBTA message limit: invalid request NAK, nothing streamed.
#[test]
fn hostile_read_with_huge_dma_len() {
    let mut w = World::two(503);
    let cfg = QpCfg::rc();
    let (a, b) = w.pair(&cfg);
    let t = w.mr(1, b.pd, 4096, all_remote(), 0);
    let pkt = forge(
        &read_req(b.qpn, 0x1000, t.va(0), t.rkey(), u32::MAX),
        &[],
        qp_src(0, a.qpn),
        1,
    );
    inject(&mut w, qp_src(0, a.qpn), 1, &pkt);
    let out = take_queued(&mut w, 1);
    assert_eq!(out.len(), 1, "one NAK, no responses: {out:?}");
    let (op, psn, _) = &out[0];
    assert_eq!((*op, *psn), (Op::RC_ACKNOWLEDGE, 0x1000));
    assert_eq!(w.stats(1).naks_sent_inv, 1);
    assert_eq!(w.qp_state(&b), QpState::Err);
    let _ = a;
}

/// A duplicate READ is answered from what the original request asked, never from the
/// duplicate's RETH (which could name more memory than was checked).
#[test]
fn duplicate_read_uses_the_original_request() {
    let mut w = World::two(504);
    let cfg = QpCfg::rc().with_mtu(Mtu::Mtu1024);
    let (a, b) = w.pair(&cfg);
    let t = w.mr(1, b.pd, 1 << 20, all_remote(), 0);
    t.write(0, &bulk(1 << 20, 5));
    let dst = w.mr(0, a.pd, 3000, LW, 0);
    w.post_send(
        &a,
        wr(
            1,
            SendOp::Read {
                remote_addr: t.va(4096),
                rkey: t.rkey(),
            },
            vec![dst.sge(0, 3000)],
        ),
    );
    assert_eq!(w.expect_wc(0, a.scq).status, WcStatus::Success);
    w.settle();
    // The READ used PSNs 0x1000..=0x1002. A duplicate of its second packet asking for
    // the whole region from elsewhere.
    let pkt = forge(
        &read_req(b.qpn, 0x1001, t.va(0), t.rkey(), 1 << 20),
        &[],
        qp_src(0, a.qpn),
        1,
    );
    inject(&mut w, qp_src(0, a.qpn), 1, &pkt);
    let out = take_queued(&mut w, 1);
    let got: Vec<(Op, u32, usize)> = out.iter().map(|(o, p, d)| (*o, *p, d.len())).collect();
    assert_eq!(
        got,
        vec![
            (Op::RC_RDMA_READ_RESPONSE_FIRST, 0x1001, 1024),
            (Op::RC_RDMA_READ_RESPONSE_LAST, 0x1002, 3000 - 2048),
        ],
        "responses for the rest of the original READ only"
    );
    assert_bytes(
        &out[0].2,
        &t.read(4096 + 1024, 1024),
        "re-read from the original va",
    );
    // A duplicate for a PSN no READ used: dropped.
    let d = w.stats(1).dropped;
    let pkt = forge(
        &read_req(b.qpn, 0xFFF, t.va(0), t.rkey(), 8),
        &[],
        qp_src(0, a.qpn),
        1,
    );
    inject(&mut w, qp_src(0, a.qpn), 1, &pkt);
    assert!(take_queued(&mut w, 1).is_empty());
    assert_eq!(w.stats(1).dropped, d + 1);
    assert_eq!(w.qp_state(&b), QpState::Rts);
}

/// While a READ is streaming, floods of duplicate READs, duplicate atomics and SENDs
/// without a receive WQE: the responder's queue stays bounded (each duplicate replaces
/// the response it asks again; NAKs waiting behind the stream collapse into one), and
/// the READ then completes correctly.
#[test]
fn duplicate_and_rnr_floods_behind_a_read_stream_stay_bounded() {
    let mut w = World::two(505);
    let cfg = QpCfg::rc().with_mtu(Mtu::Mtu1024);
    let (a, b) = w.pair(&cfg);
    let len = 4 << 20;
    let t = w.mr(1, b.pd, len, all_remote(), 0);
    t.write(0, &bulk(len, 9));
    let at = w.mr(1, b.pd, 8, all_remote(), 0);
    at.write_u64(0, 40);
    let dst = w.mr(0, a.pd, len, LW, 0);
    let r8 = w.mr(0, a.pd, 8, LW, 0);
    // An atomic first (PSN 0x1000), then the big READ (0x1001..).
    w.post_send(
        &a,
        wr(
            1,
            SendOp::FetchAdd {
                remote_addr: at.va(0),
                rkey: at.rkey(),
                add: 2,
            },
            vec![r8.sge(0, 8)],
        ),
    );
    w.run_until(SEC, |w| w.stats(1).tx_packets >= 1);
    w.post_send(
        &a,
        wr(
            2,
            SendOp::Read {
                remote_addr: t.va(0),
                rkey: t.rkey(),
            },
            vec![dst.sge(0, len)],
        ),
    );
    // Deliver the READ request, but let nothing leave B yet.
    let now = w.now();
    let req = w.nic(0).poll_transmit(now).expect("READ request");
    w.nic(1).handle_datagram(now, req.src, req.dst, &req.data);
    let base = w.nic(1).queued_packets();
    assert!(base <= QUEUE_BOUND, "{base} queued for one READ");
    let dup_read = forge(
        &read_req(b.qpn, 0x1001, t.va(0), t.rkey(), len as u32),
        &[],
        qp_src(0, a.qpn),
        1,
    );
    let mut bth = Bth::new(Op::RC_FETCH_ADD, b.qpn, 0x1000);
    bth.ack_req = true;
    let mut h = wire::Headers::new(bth);
    h.atomic_eth = Some(AtomicEth {
        va: at.va(0),
        rkey: at.rkey(),
        swap_add: 2,
        compare: 0,
    });
    let dup_atomic = forge(&h, &[], qp_src(0, a.qpn), 1);
    let epsn = wire::psn::add(0x1001, (len / 1024) as u32);
    let send = forge(
        &wire::Headers::new(Bth::new(Op::RC_SEND_ONLY, b.qpn, epsn)),
        &[1, 2, 3, 4],
        qp_src(0, a.qpn),
        1,
    );
    for _ in 0..3000 {
        inject(&mut w, qp_src(0, a.qpn), 1, &dup_read);
        inject(&mut w, qp_src(0, a.qpn), 1, &dup_atomic);
        inject(&mut w, qp_src(0, a.qpn), 1, &send);
    }
    let q = w.nic(1).queued_packets();
    assert_eq!(q, base, "queue grew from {base} to {q} under a flood");
    assert_eq!(
        at.read_u64(0),
        42,
        "a duplicate atomic is never applied again"
    );
    assert_eq!(w.stats(1).rnr_naks_sent, 3000);
    let c = w.expect_wcs(0, a.scq, 2);
    check_send_wc(&c[0], &send_wc(&a, 1, WcOpcode::FetchAdd, 8), "FAA");
    check_send_wc(&c[1], &send_wc(&a, 2, WcOpcode::RdmaRead, len), "READ");
    assert_eq!(r8.read_u64(0), 40);
    assert!(dst.read_all() == bulk(len, 9), "READ bytes after the flood");
    assert!(max_queued(&w, 1) <= QUEUE_BOUND);
    assert_eq!(w.qp_state(&b), QpState::Rts);
}

/// The atomic replay cache keeps its bound: a duplicate of an atomic evicted from it is
/// dropped (never executed again), a recent one is answered from the cache.
#[test]
fn atomic_replay_cache_is_bounded() {
    let mut w = World::two(506);
    let cfg = QpCfg {
        max_dest_rd_atomic: 1,
        ..QpCfg::rc()
    };
    let (a, b) = w.pair(&cfg);
    let at = w.mr(1, b.pd, 8, all_remote(), 0);
    let faa = |psn: u32| {
        let mut bth = Bth::new(Op::RC_FETCH_ADD, b.qpn, psn);
        bth.ack_req = true;
        let mut h = wire::Headers::new(bth);
        h.atomic_eth = Some(AtomicEth {
            va: at.va(0),
            rkey: at.rkey(),
            swap_add: 1,
            compare: 0,
        });
        forge(&h, &[], qp_src(0, a.qpn), 1)
    };
    for i in 0..100u32 {
        inject(&mut w, qp_src(0, a.qpn), 1, &faa(0x1000 + i));
    }
    assert_eq!(at.read_u64(0), 100);
    assert_eq!(take_queued(&mut w, 1).len(), 100, "one atomic ACK each");
    let d = w.stats(1).dropped;
    inject(&mut w, qp_src(0, a.qpn), 1, &faa(0x1000));
    assert!(take_queued(&mut w, 1).is_empty(), "evicted: no answer");
    assert_eq!(w.stats(1).dropped, d + 1);
    inject(&mut w, qp_src(0, a.qpn), 1, &faa(0x1000 + 99));
    let out = take_queued(&mut w, 1);
    assert_eq!(out.len(), 1);
    assert_eq!(
        (out[0].0, out[0].1),
        (Op::RC_ATOMIC_ACKNOWLEDGE, 0x1000 + 99)
    );
    assert_eq!(at.read_u64(0), 100, "never applied twice");
    let _ = a;
}

/// An error behind a READ stream: the READ's responses all go out first, then the NAK;
/// the READ completes, the bad WRITE fails with REM_ACCESS_ERR.
#[test]
fn fatal_nak_waits_behind_a_read_stream() {
    let mut w = World::two(507);
    let cfg = QpCfg::rc().with_mtu(Mtu::Mtu1024);
    let (a, b) = w.pair(&cfg);
    let len = 1 << 20;
    let t = w.mr(1, b.pd, len, all_remote(), 0);
    t.write(0, &bulk(len, 1));
    let dst = w.mr(0, a.pd, len, LW, 0);
    let src = w.mr(0, a.pd, 64, LW, 0);
    w.post_send(
        &a,
        wr(
            1,
            SendOp::Read {
                remote_addr: t.va(0),
                rkey: t.rkey(),
            },
            vec![dst.sge(0, len)],
        ),
    );
    w.post_send(
        &a,
        wr(
            2,
            SendOp::Write {
                remote_addr: t.va(0),
                rkey: t.rkey() ^ 0x100,
            },
            vec![src.sge(0, 64)],
        ),
    );
    let c = w.expect_wcs(0, a.scq, 2);
    check_send_wc(&c[0], &send_wc(&a, 1, WcOpcode::RdmaRead, len), "READ");
    check_err_wc(&c[1], 2, WcStatus::RemAccessErr, a.qpn, "bad WRITE");
    assert!(dst.read_all() == bulk(len, 1));
    assert_eq!(w.qp_state(&b), QpState::Err);
    assert_eq!(w.stats(0).retransmits, 0);
}

/// An ACK for PSNs assigned but never sent (forged, or from a confused peer) is
/// ignored: the WRITE does not complete before its data has left.
#[test]
fn ack_for_psns_never_sent_is_ignored() {
    let mut w = World::two(508);
    let cfg = QpCfg::rc().with_mtu(Mtu::Mtu1024);
    let (a, b) = w.pair(&cfg);
    let len = 4 << 20;
    let src = w.mr(0, a.pd, len, LW, 0);
    src.write(0, &bulk(len, 2));
    let t = w.mr(1, b.pd, len, all_remote(), 0);
    w.post_send(
        &a,
        wr(
            1,
            SendOp::Write {
                remote_addr: t.va(0),
                rkey: t.rkey(),
            },
            vec![src.sge(0, len)],
        ),
    );
    assert!(w.nic(0).queued_packets() <= 256);
    let last = wire::psn::add(0x1000, (len / 1024) as u32 - 1);
    let mut h = wire::Headers::new(Bth::new(Op::RC_ACKNOWLEDGE, a.qpn, last));
    h.aeth = Some(Aeth {
        syndrome: Syndrome::Ack { credits: 31 },
        msn: 1,
    });
    let dropped = w.stats(0).dropped;
    inject(
        &mut w,
        qp_src(1, b.qpn),
        0,
        &forge(&h, &[], qp_src(1, b.qpn), 0),
    );
    assert!(w.drain(0, a.scq).is_empty(), "completed on a forged ACK");
    assert_eq!(w.stats(0).dropped, dropped + 1);
    let c = w.expect_wc(0, a.scq);
    check_send_wc(&c, &send_wc(&a, 1, WcOpcode::RdmaWrite, len), "WRITE");
    assert!(t.read_all() == bulk(len, 2));
}

/// A storm of sequence NAKs for the same PSN costs one retry, not one per NAK; a storm
/// of RNR NAKs grows nothing. The transfer still completes.
#[test]
fn nak_storm_costs_one_retry() {
    let mut w = World::two(509);
    let cfg = QpCfg {
        retry_cnt: 2,
        ..QpCfg::rc().with_mtu(Mtu::Mtu1024)
    };
    let (a, b) = w.pair(&cfg);
    let len = 1 << 20;
    let src = w.mr(0, a.pd, len, LW, 0);
    src.write(0, &bulk(len, 4));
    let t = w.mr(1, b.pd, len, all_remote(), 0);
    w.post_send(
        &a,
        wr(
            1,
            SendOp::Write {
                remote_addr: t.va(0),
                rkey: t.rkey(),
            },
            vec![src.sge(0, len)],
        ),
    );
    let mut h = wire::Headers::new(Bth::new(Op::RC_ACKNOWLEDGE, a.qpn, 0x1000));
    h.aeth = Some(Aeth {
        syndrome: Syndrome::Nak(NakCode::PsnSequenceError),
        msn: 0,
    });
    let nak = forge(&h, &[], qp_src(1, b.qpn), 0);
    for _ in 0..10_000 {
        inject(&mut w, qp_src(1, b.qpn), 0, &nak);
        assert!(w.nic(0).queued_packets() <= QUEUE_BOUND);
    }
    assert_eq!(w.stats(0).naks_rcvd_seq, 10_000);
    assert_eq!(w.qp_state(&a), QpState::Rts, "one retry used, not 10000");
    let c = w.expect_wc(0, a.scq);
    check_send_wc(&c, &send_wc(&a, 1, WcOpcode::RdmaWrite, len), "WRITE");
    assert!(t.read_all() == bulk(len, 4));
}

/// A UD receive's GRH carries the traffic class the datagram arrived with.
#[test]
fn ud_grh_carries_the_received_tos() {
    let mut w = World::two(510);
    let cfg = QpCfg::ud();
    let a = w.new_ep(0, &cfg);
    let b = w.new_ep(1, &cfg);
    w.ud_ready(&a, &cfg, 0);
    w.ud_ready(&b, &cfg, 0);
    let rb = w.mr(1, b.pd, 2 * 256, LW, 0);
    w.post_recv(&b, rwr(1, vec![rb.sge(0, 256)]));
    w.post_recv(&b, rwr(2, vec![rb.sge(256, 256)]));
    // Through the sim with an AH of traffic class 0xB8 (the sim keeps the TOS).
    let mut av = w.av(1);
    av.grh.traffic_class = 0xB8;
    let ah = w.nic(0).create_ah(a.pd, &av).unwrap();
    let src = w.mr(0, a.pd, 64, LW, 0x33);
    let mut s = wr(1, SendOp::Send, vec![src.sge(0, 20)]);
    s.ud = Some(UdDest {
        ah,
        remote_qpn: b.qpn,
        remote_qkey: cfg.qkey,
    });
    w.post_send(&a, s);
    assert_eq!(w.expect_wc(1, b.rcq).status, WcStatus::Success);
    let grh = rb.read(0, 40);
    assert_eq!(grh[21], 0xB8, "IPv4 TOS in the GRH: {grh:02x?}");
    // handle_datagram_tos directly, and the checksum covers the TOS.
    let mut h = wire::Headers::new(Bth::new(Op::UD_SEND_ONLY, b.qpn, 7));
    h.deth = Some(wire::Deth {
        qkey: cfg.qkey,
        src_qp: a.qpn,
    });
    let pkt = forge(&h, &[9; 8], dev_addr(0), 1);
    let now = w.now();
    w.nic(1)
        .handle_datagram_tos(now, dev_addr(0), dev_addr(1), 0x2E, &pkt);
    assert_eq!(w.expect_wc(1, b.rcq).status, WcStatus::Success);
    let ip = rb.read(256 + 20, 20);
    assert_eq!(ip[1], 0x2E, "IPv4 TOS");
    let mut sum: u32 = 0;
    for c in ip.chunks(2) {
        sum += u32::from(u16::from_be_bytes([c[0], c[1]]));
    }
    while sum > 0xFFFF {
        sum = (sum & 0xFFFF) + (sum >> 16);
    }
    assert_eq!(sum, 0xFFFF, "IPv4 header checksum with the TOS");
}

/// A NAK aimed at a PSN the peer has already acknowledged (stale: a late copy, or forged
/// by someone who saw an old packet) is outside the outstanding window and ignored,
/// whatever its syndrome: the fatal ones (invalid request, remote access, remote
/// operational, invalid RD request) would end a working connection if acted on. So are
/// NAKs and ACKs for PSNs never sent. The transfer under way completes with its data.
#[test]
fn nak_outside_the_outstanding_window_is_ignored() {
    let mut w = World::two(511);
    let cfg = QpCfg::rc().with_mtu(Mtu::Mtu1024);
    let (a, b) = w.pair(&cfg);
    let len = 256 << 10;
    let src = w.mr(0, a.pd, len, LW, 0);
    src.write(0, &bulk(len, 6));
    let t = w.mr(1, b.pd, len, all_remote(), 0);
    let write = |id: u64, n: usize| {
        wr(
            id,
            SendOp::Write {
                remote_addr: t.va(0),
                rkey: t.rkey(),
            },
            vec![src.sge(0, n)],
        )
    };
    // A first WRITE of 4 packets (PSNs 0x1000..=0x1003), acknowledged.
    w.post_send(&a, write(1, 4096));
    check_send_wc(
        &w.expect_wc(0, a.scq),
        &send_wc(&a, 1, WcOpcode::RdmaWrite, 4096),
        "first WRITE",
    );
    w.settle();
    // The second is in flight from PSN 0x1004 on when the stale NAKs come.
    w.post_send(&a, write(2, len));
    let nak = |psn: u32, syndrome: Syndrome| {
        let mut h = wire::Headers::new(Bth::new(Op::RC_ACKNOWLEDGE, a.qpn, psn));
        h.aeth = Some(Aeth { syndrome, msn: 0 });
        forge(&h, &[], qp_src(1, b.qpn), 0)
    };
    let fatal = [
        NakCode::InvalidRequest,
        NakCode::RemoteAccessError,
        NakCode::RemoteOperationalError,
        NakCode::InvalidRdRequest,
    ];
    let mut rng = test_rng(511);
    let mut stale = vec![0x1000, 0x1003, 0x0FFF, 0x80_1004];
    // Far from the window both ways (the window is at most a few hundred PSNs wide).
    stale.extend(
        (0..2000).map(|_| wire::psn::add(0x1004 + 0x1_0000, rng.next_u64() as u32 % 0x7E_0000)),
    );
    for (i, &psn) in stale.iter().enumerate() {
        let syndrome = match i % 6 {
            4 => Syndrome::Nak(NakCode::PsnSequenceError),
            5 => Syndrome::RnrNak { timer: 31 },
            k => Syndrome::Nak(fatal[k]),
        };
        inject(&mut w, qp_src(1, b.qpn), 0, &nak(psn, syndrome));
        let mut ack = wire::Headers::new(Bth::new(Op::RC_ACKNOWLEDGE, a.qpn, psn));
        ack.aeth = Some(Aeth {
            syndrome: Syndrome::Ack { credits: 31 },
            msn: 0,
        });
        inject(
            &mut w,
            qp_src(1, b.qpn),
            0,
            &forge(&ack, &[], qp_src(1, b.qpn), 0),
        );
        assert_eq!(w.qp_state(&a), QpState::Rts, "after a NAK for {psn:#x}");
    }
    assert!(
        w.drain(0, a.scq).is_empty(),
        "nothing completed by stale responses"
    );
    let c = w.expect_wc(0, a.scq);
    check_send_wc(
        &c,
        &send_wc(&a, 2, WcOpcode::RdmaWrite, len),
        "second WRITE",
    );
    assert!(t.read_all() == bulk(len, 6));
    assert_eq!(
        w.stats(0).naks_rcvd_seq + w.stats(0).naks_rcvd_inv,
        0,
        "none acted on"
    );
    assert_eq!(w.stats(0).timeouts, 0, "no retry was spent on them either");
}

/// A forged ACK from the peer's IP but not from the UDP port the peer sends from, with
/// the right QPN and PSN, completes nothing: the SEND it claims to acknowledge was lost,
/// and completes only once the resend really arrived. A forged WRITE the same way writes
/// nothing, and the next real WRITE's data lands.
#[test]
fn forged_packets_from_another_port_are_dropped() {
    let mut w = World::two(512);
    let cfg = QpCfg::rc().with_mtu(Mtu::Mtu1024);
    let (a, b) = w.pair(&cfg);
    let sa = w.mr(0, a.pd, 4096, LW, 0);
    sa.write(0, &bulk(4096, 1));
    let rb = w.mr(1, b.pd, 4096, all_remote(), 0xEE);
    // Genuine traffic both ways first: each side learns the port its peer sends from.
    w.post_recv(&b, rwr(7, vec![rb.sge(0, 64)]));
    w.post_send(&a, wr(1, SendOp::Send, vec![sa.sge(0, 64)]));
    assert_eq!(w.expect_wc(0, a.scq).status, WcStatus::Success);
    assert_eq!(w.expect_wc(1, b.rcq).status, WcStatus::Success);
    w.settle();
    let sb = w.mr(1, b.pd, 64, LW, 0x11);
    let ra = w.mr(0, a.pd, 64, LW, 0);
    w.post_recv(&a, rwr(8, vec![ra.sge(0, 64)]));
    w.post_send(&b, wr(9, SendOp::Send, vec![sb.sge(0, 64)]));
    assert_eq!(w.expect_wc(1, b.scq).status, WcStatus::Success);
    assert_eq!(w.expect_wc(0, a.rcq).status, WcStatus::Success);
    w.settle();

    // A's next SEND (PSN 0x1001) is lost on the way.
    w.post_recv(&b, rwr(10, vec![rb.sge(64, 64)]));
    w.post_send(&a, wr(2, SendOp::Send, vec![sa.sge(64, 64)]));
    let now = w.now();
    let lost = w.nic(0).poll_transmit(now).expect("the SEND");
    assert_eq!(parse_psn(&lost.data), 0x1001);
    let other = SocketAddr::new(dev_addr(1).ip(), 4791);
    assert_ne!(other, qp_src(1, b.qpn));
    let mut h = wire::Headers::new(Bth::new(Op::RC_ACKNOWLEDGE, a.qpn, 0x1001));
    h.aeth = Some(Aeth {
        syndrome: Syndrome::Ack { credits: 31 },
        msn: 2,
    });
    let dropped = w.stats(0).dropped;
    inject(&mut w, other, 0, &forge(&h, &[], other, 0));
    assert_eq!(w.stats(0).dropped, dropped + 1);
    assert!(w.drain(0, a.scq).is_empty(), "completed on a forged ACK");
    // The resend after a timeout delivers it, and only then does it complete.
    assert_eq!(w.expect_wc(0, a.scq).status, WcStatus::Success);
    let rc = w.expect_wc(1, b.rcq);
    assert_eq!((rc.wr_id, rc.status), (10, WcStatus::Success));
    assert_bytes(&rb.read(64, 64), &bulk(4096, 1)[64..128], "resent SEND");
    // Resent by the round-trip timer, long before the local ACK timeout.
    assert_eq!((w.stats(0).rtt_timeouts, w.stats(0).timeouts), (1, 0));
    w.settle();

    // A forged WRITE at B's expected PSN (0x1002), from A's IP on another port.
    let mut bth = Bth::new(Op::RC_RDMA_WRITE_ONLY, b.qpn, 0x1002);
    bth.ack_req = true;
    let mut h = wire::Headers::new(bth);
    h.reth = Some(Reth {
        va: rb.va(1024),
        rkey: rb.rkey(),
        dma_len: 64,
    });
    let other = SocketAddr::new(dev_addr(0).ip(), 4791);
    inject(&mut w, other, 1, &forge(&h, &[0x66; 64], other, 1));
    assert_all(&rb.read(1024, 64), 0xEE, "memory after the forged WRITE");
    assert!(
        take_queued(&mut w, 1).is_empty(),
        "no answer to a forged request"
    );
    // The real WRITE with that PSN lands.
    w.post_send(
        &a,
        wr(
            3,
            SendOp::Write {
                remote_addr: rb.va(1024),
                rkey: rb.rkey(),
            },
            vec![sa.sge(1024, 64)],
        ),
    );
    assert_eq!(w.expect_wc(0, a.scq).status, WcStatus::Success);
    assert_bytes(
        &rb.read(1024, 64),
        &bulk(4096, 1)[1024..1088],
        "the real WRITE",
    );
}

fn parse_psn(data: &[u8]) -> u32 {
    wire::Headers::parse(data)
        .expect("our own packet")
        .0
        .bth
        .psn
}

/// Duplicate READs cannot make a responder reflect without bound: all re-executions of a
/// READ together send at most `READ_REPLAY_FACTOR` (8) times its packets plus 32, from
/// wherever they ask. Each refusal is counted; the connection carries on.
#[test]
fn duplicate_read_flood_reflects_a_bounded_amount() {
    let mut w = World::two(513);
    let cfg = QpCfg::rc().with_mtu(Mtu::Mtu1024);
    let (a, b) = w.pair(&cfg);
    const N: usize = 64; // response packets of the READ
    const CAP: usize = 8 * N + 32;
    let t = w.mr(1, b.pd, N * 1024, all_remote(), 0);
    t.write(0, &bulk(N * 1024, 8));
    let dst = w.mr(0, a.pd, N * 1024, LW, 0);
    let read = |id| {
        wr(
            id,
            SendOp::Read {
                remote_addr: t.va(0),
                rkey: t.rkey(),
            },
            vec![dst.sge(0, N * 1024)],
        )
    };
    w.post_send(&a, read(1));
    assert_eq!(w.expect_wc(0, a.scq).status, WcStatus::Success);
    w.settle();
    let dup = |psn: u32| {
        forge(
            &read_req(b.qpn, psn, t.va(0), t.rkey(), (N * 1024) as u32),
            &[],
            qp_src(0, a.qpn),
            1,
        )
    };
    // From its first PSN, over and over, then creeping forward and going back: re-executed
    // until the budget is spent (the last one cut short there), then refused.
    let mut sent = 0;
    for i in 0..400u32 {
        let p = if i % 3 == 2 { 0x1000 } else { 0x1000 + i / 8 };
        inject(&mut w, qp_src(0, a.qpn), 1, &dup(p));
        sent += take_queued(&mut w, 1).len();
    }
    assert_eq!(sent, CAP, "response packets reflected by one READ of {N}");
    let stats = w.stats(1);
    assert!(stats.read_replays > 0 && stats.read_replays_refused > 0);
    // Every duplicate was re-executed or refused; the one cut short counts as both.
    assert_eq!(stats.read_replays + stats.read_replays_refused, 401);
    let refused = w.stats(1).read_replays_refused;
    inject(&mut w, qp_src(0, a.qpn), 1, &dup(0x1000 + 3));
    assert!(take_queued(&mut w, 1).is_empty());
    assert_eq!(w.stats(1).read_replays_refused, refused + 1);
    // The connection carries on: a new READ is served in full.
    assert_eq!(w.qp_state(&b), QpState::Rts);
    dst.write(0, &[0; N * 1024]);
    w.post_send(&a, read(2));
    assert_eq!(w.expect_wc(0, a.scq).status, WcStatus::Success);
    assert!(dst.read_all() == bulk(N * 1024, 8));
}

/// One READ of 1 MiB asked for again 200 times (each duplicate a 32-byte packet, from the
/// READ's first PSN, its responses drained between them) reflects at most its
/// re-execution budget: 8 times its 1024 packets plus 32, about 8.5 MB on the wire, where
/// 64 times plus 1024 (the earlier budget) let it reflect 69 MB, over 10,000 times the
/// duplicates' bytes.
#[test]
fn duplicate_read_of_1mib_asked_200_times_reflects_at_most_its_budget() {
    const LEN: usize = 1 << 20;
    const N: usize = LEN / 1024;
    const CAP: usize = 8 * N + 32;
    let mut w = World::two(514);
    let cfg = QpCfg::rc().with_mtu(Mtu::Mtu1024);
    let (a, b) = w.pair(&cfg);
    let t = w.mr(1, b.pd, LEN, all_remote(), 0);
    t.write(0, &bulk(LEN, 9));
    let dst = w.mr(0, a.pd, LEN, LW, 0);
    w.post_send(
        &a,
        wr(
            1,
            SendOp::Read {
                remote_addr: t.va(0),
                rkey: t.rkey(),
            },
            vec![dst.sge(0, LEN)],
        ),
    );
    assert_eq!(w.expect_wc(0, a.scq).status, WcStatus::Success);
    w.settle();
    let dup = forge(
        &read_req(b.qpn, 0x1000, t.va(0), t.rkey(), LEN as u32),
        &[],
        qp_src(0, a.qpn),
        1,
    );
    let (mut asked, mut packets, mut wire_bytes, mut data) = (0usize, 0usize, 0usize, 0usize);
    for _ in 0..200 {
        inject(&mut w, qp_src(0, a.qpn), 1, &dup);
        asked += dup.len();
        let now = w.now();
        while let Some(tx) = w.nic(1).poll_transmit(now) {
            let (h, p) = wire::Headers::parse(&tx.data).expect("our own packet parses");
            assert!(
                (Op::RC_RDMA_READ_RESPONSE_FIRST.0..=Op::RC_RDMA_READ_RESPONSE_ONLY.0)
                    .contains(&h.bth.opcode.0),
                "{:?}",
                h.bth.opcode
            );
            packets += 1;
            wire_bytes += tx.data.len();
            data += p.len();
        }
    }
    assert!(
        packets <= CAP && data <= CAP * 1024,
        "{packets} response packets, {data} bytes of data ({wire_bytes} on the wire) for \
         {asked} bytes of duplicates"
    );
    // The budget, not the asking, is what stopped it; the refusals are counted.
    assert_eq!(packets, CAP);
    assert!(w.stats(1).read_replays_refused > 0);
    assert!(wire_bytes < 9 * LEN, "{wire_bytes} bytes on the wire");
}

/// A fenced atomic whose ACK is lost, with two READs posted after it: their responses
/// arrive, so they finish behind it and keep their places in the READ/atomic window,
/// and the requester goes back N for the atomic. The resent atomic passed its fence when
/// it was first sent; it must not wait now for the READs after it, which wait for it (a
/// deadlock the property tests under loss met).
#[test]
fn fenced_atomic_resent_ahead_of_reads_finished_behind_it() {
    let mut w = World::two(515);
    let cfg = QpCfg::rc().with_mtu(Mtu::Mtu1024);
    let (a, b) = w.pair(&cfg);
    let t = w.mr(1, b.pd, 4096, all_remote(), 0);
    t.write(0, &bulk(4096, 3));
    t.write_u64(0, 40);
    let la = w.mr(0, a.pd, 4096, LW, 0);
    w.post_send(
        &a,
        wr_flags(
            1,
            SendOp::FetchAdd {
                remote_addr: t.va(0),
                rkey: t.rkey(),
                add: 2,
            },
            SendFlags::SIGNALED | SendFlags::FENCE,
            vec![la.sge(0, 8)],
        ),
    );
    for (id, off) in [(2u64, 1024usize), (3, 2048)] {
        let op = SendOp::Read {
            remote_addr: t.va(off),
            rkey: t.rkey(),
        };
        w.post_send(&a, wr(id, op, vec![la.sge(off, 64)]));
    }
    // The three requests reach B by hand; B's answers come back but for the atomic's.
    let now = w.now();
    let mut reqs = Vec::new();
    while let Some(tx) = w.nic(0).poll_transmit(now) {
        reqs.push(tx);
    }
    assert_eq!(reqs.len(), 3, "the FAA and both READs go out at once");
    for tx in &reqs {
        w.nic(1).handle_datagram(now, tx.src, tx.dst, &tx.data);
    }
    let mut lost = 0;
    while let Some(tx) = w.nic(1).poll_transmit(now) {
        let (h, _) = wire::Headers::parse(&tx.data).expect("our own packet parses");
        if h.bth.opcode == Op::RC_ATOMIC_ACKNOWLEDGE {
            lost += 1;
            continue;
        }
        w.nic(0).handle_datagram(now, tx.src, tx.dst, &tx.data);
    }
    assert_eq!(lost, 1);
    let c = w.poll_within(0, a.scq, 3, 10 * SEC);
    assert_eq!(c.len(), 3, "all three complete: {c:?}");
    assert!(c.iter().all(|c| c.status == WcStatus::Success), "{c:?}");
    assert_eq!(la.read_u64(0), 40, "the FAA's original value");
    assert_eq!(t.read_u64(0), 42, "added once");
    assert_eq!(la.read(1024, 64), bulk(4096, 3)[1024..1088]);
    assert_eq!(w.qp_state(&a), QpState::Rts);
}
