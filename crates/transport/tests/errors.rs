//! Error scenarios: statuses on both sides, QP states, flushes in order, and nothing
//! written at the target.

use common::*;
use softrdma_testkit as common;

const LW: Access = Access::LOCAL_WRITE;

fn all_remote() -> Access {
    Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC
}

/// Post `bad`, then a valid WRITE and a SEND behind it (B has a receive posted); expect
/// REM_ACCESS_ERR for `bad`, the two behind it flushed in order, both QPs in ERR, B's
/// receive flushed, a WR posted afterwards flushed too, and every guarded buffer
/// unchanged.
fn remote_access_error(w: &mut World, a: &Ep, b: &Ep, bad: SendWr, guard: &[&Mr], what: &str) {
    let ok_target = w.mr(1, b.pd, 64, all_remote(), 0xEE);
    let src = w.mr(0, a.pd, 64, LW, 0x11);
    let rb = w.mr(1, b.pd, 64, LW, 0xEE);
    w.post_recv(b, rwr(900, vec![rb.sge(0, 64)]));
    let snaps: Vec<Vec<u8>> = guard.iter().map(|m| m.mem.read_all()).collect();
    let bad_id = bad.wr_id;
    w.post_send(a, bad);
    w.post_send(
        a,
        wr(
            bad_id + 1,
            SendOp::Write {
                remote_addr: ok_target.va(0),
                rkey: ok_target.rkey(),
            },
            vec![src.sge(0, 64)],
        ),
    );
    w.post_send(a, wr(bad_id + 2, SendOp::Send, vec![src.sge(0, 8)]));
    let c = w.expect_wcs(0, a.scq, 3);
    check_err_wc(&c[0], bad_id, WcStatus::RemAccessErr, a.qpn, what);
    check_err_wc(
        &c[1],
        bad_id + 1,
        WcStatus::WrFlushErr,
        a.qpn,
        &format!("{what}: WR behind the error"),
    );
    check_err_wc(
        &c[2],
        bad_id + 2,
        WcStatus::WrFlushErr,
        a.qpn,
        &format!("{what}: 2nd WR behind the error"),
    );
    assert_eq!(w.qp_state(a), QpState::Err, "{what}: requester QP state");
    // Responder: class C error puts its QP in ERR too, flushing its receive.
    let r = w.expect_wc(1, b.rcq);
    check_err_wc(
        &r,
        900,
        WcStatus::WrFlushErr,
        b.qpn,
        &format!("{what}: responder's receive"),
    );
    assert_eq!(w.qp_state(b), QpState::Err, "{what}: responder QP state");
    // A WR posted in ERR is flushed.
    w.post_send(a, wr(bad_id + 3, SendOp::Send, vec![src.sge(0, 8)]));
    let c = w.expect_wc(0, a.scq);
    check_err_wc(
        &c,
        bad_id + 3,
        WcStatus::WrFlushErr,
        a.qpn,
        &format!("{what}: WR posted in ERR"),
    );
    w.expect_no_wc(0, a.scq, what);
    w.expect_no_wc(1, b.rcq, what);
    for (m, s) in guard.iter().zip(&snaps) {
        assert_bytes(
            &m.mem.read_all(),
            s,
            &format!("{what}: guarded memory changed"),
        );
    }
    assert_all(
        &ok_target.read_all(),
        0xEE,
        &format!("{what}: flushed WRITE must not land"),
    );
    assert_all(
        &rb.read_all(),
        0xEE,
        &format!("{what}: flushed SEND must not land"),
    );
}

#[test]
fn err_write_bad_rkey() {
    let mut w = World::two(41);
    let (a, b) = w.pair(&QpCfg::rc());
    let t = w.mr(1, b.pd, 256, all_remote(), 0x5A);
    let src = w.mr(0, a.pd, 64, LW, 1);
    let bad = wr(
        1,
        SendOp::Write {
            remote_addr: t.va(0),
            rkey: t.rkey() ^ 0x8000_0100,
        },
        vec![src.sge(0, 64)],
    );
    remote_access_error(&mut w, &a, &b, bad, &[&t], "WRITE with a bad rkey");
}

#[test]
fn err_write_out_of_bounds() {
    let mut w = World::two(42);
    let (a, b) = w.pair(&QpCfg::rc());
    // Register 256 bytes of a 512-byte buffer: the WRITE runs 4 bytes past the region.
    let mem = w.mem(512);
    mem.fill(0x5A);
    let t = w.reg(1, b.pd, &mem, 0, 256, all_remote());
    let src = w.mr(0, a.pd, 64, LW, 1);
    let bad = wr(
        1,
        SendOp::Write {
            remote_addr: t.va(256 - 4),
            rkey: t.rkey(),
        },
        vec![src.sge(0, 8)],
    );
    remote_access_error(&mut w, &a, &b, bad, &[&t], "WRITE out of bounds");
}

#[test]
fn err_read_out_of_bounds_before_region() {
    let mut w = World::two(43);
    let (a, b) = w.pair(&QpCfg::rc());
    let mem = w.mem(512);
    mem.fill(0x5A);
    let t = w.reg(1, b.pd, &mem, 256, 256, all_remote());
    let local = w.mr(0, a.pd, 64, LW, 0xEE);
    let bad = wr(
        1,
        SendOp::Read {
            remote_addr: t.va(0) - 8,
            rkey: t.rkey(),
        },
        vec![local.sge(0, 16)],
    );
    remote_access_error(
        &mut w,
        &a,
        &b,
        bad,
        &[&t, &local],
        "READ starting before the region",
    );
}

#[test]
fn err_write_mr_without_remote_write() {
    let mut w = World::two(44);
    let (a, b) = w.pair(&QpCfg::rc());
    let t = w.mr(1, b.pd, 256, LW | Access::REMOTE_READ, 0x5A);
    let src = w.mr(0, a.pd, 64, LW, 1);
    let bad = wr(
        1,
        SendOp::Write {
            remote_addr: t.va(0),
            rkey: t.rkey(),
        },
        vec![src.sge(0, 64)],
    );
    remote_access_error(
        &mut w,
        &a,
        &b,
        bad,
        &[&t],
        "WRITE to an MR without REMOTE_WRITE",
    );
}

#[test]
fn err_atomic_mr_without_remote_atomic() {
    let mut w = World::two(45);
    let (a, b) = w.pair(&QpCfg::rc());
    let t = w.mr(
        1,
        b.pd,
        64,
        LW | Access::REMOTE_WRITE | Access::REMOTE_READ,
        0x5A,
    );
    let res = w.mr(0, a.pd, 8, LW, 0xEE);
    let bad = wr(
        1,
        SendOp::FetchAdd {
            remote_addr: t.va(0),
            rkey: t.rkey(),
            add: 1,
        },
        vec![res.sge(0, 8)],
    );
    remote_access_error(
        &mut w,
        &a,
        &b,
        bad,
        &[&t, &res],
        "FAA on an MR without REMOTE_ATOMIC",
    );
}

#[test]
fn err_read_qp_without_remote_read() {
    let mut w = World::two(46);
    let acfg = QpCfg::rc();
    let bcfg = QpCfg {
        access: Access::REMOTE_WRITE | Access::REMOTE_ATOMIC,
        ..QpCfg::rc()
    };
    let (a, b) = w.pair_psn(&acfg, &bcfg, 5, 6);
    let t = w.mr(1, b.pd, 256, all_remote(), 0x5A);
    let local = w.mr(0, a.pd, 256, LW, 0xEE);
    let bad = wr(
        1,
        SendOp::Read {
            remote_addr: t.va(0),
            rkey: t.rkey(),
        },
        vec![local.sge(0, 256)],
    );
    remote_access_error(
        &mut w,
        &a,
        &b,
        bad,
        &[&t, &local],
        "READ on a QP without REMOTE_READ",
    );
}

#[test]
fn err_write_mr_of_another_pd() {
    let mut w = World::two(47);
    let (a, b) = w.pair(&QpCfg::rc());
    let other = w.pd(1);
    let t = w.mr(1, other, 256, all_remote(), 0x5A);
    let src = w.mr(0, a.pd, 64, LW, 1);
    let bad = wr(
        1,
        SendOp::Write {
            remote_addr: t.va(0),
            rkey: t.rkey(),
        },
        vec![src.sge(0, 64)],
    );
    remote_access_error(&mut w, &a, &b, bad, &[&t], "WRITE to an MR of another PD");
}

#[test]
fn err_write_invalidated_rkey() {
    let mut w = World::two(48);
    let (a, b) = w.pair(&QpCfg::rc());
    let mr = w.mr(1, b.pd, 512, LW | Access::MW_BIND, 0x5A);
    let mw = w.nic(1).alloc_mw(b.pd, 2).unwrap();
    let rkey = verbs::inc_rkey(w.nic(1).mw_rkey(mw).unwrap());
    let bind = MwBind {
        mw,
        rkey,
        mr_lkey: mr.lkey(),
        addr: mr.va(0),
        length: 512,
        access: Access::REMOTE_WRITE,
    };
    w.post_send(&b, wr(1, SendOp::BindMw(bind), vec![]));
    check_send_wc(
        &w.expect_wc(1, b.scq),
        &send_wc(&b, 1, WcOpcode::BindMw, 0),
        "bind",
    );
    w.post_send(&b, wr(2, SendOp::LocalInv { rkey }, vec![]));
    check_send_wc(
        &w.expect_wc(1, b.scq),
        &send_wc(&b, 2, WcOpcode::LocalInv, 0),
        "invalidate",
    );
    let src = w.mr(0, a.pd, 64, LW, 1);
    let bad = wr(
        10,
        SendOp::Write {
            remote_addr: mr.va(0),
            rkey,
        },
        vec![src.sge(0, 64)],
    );
    remote_access_error(
        &mut w,
        &a,
        &b,
        bad,
        &[&mr],
        "WRITE with an invalidated rkey",
    );
}

#[test]
fn err_ud_qkey_mismatch_dropped() {
    let mut w = World::two(49);
    let cfg = QpCfg::ud();
    let a = w.new_ep(0, &cfg);
    let b = w.new_ep(1, &cfg);
    w.ud_ready(&a, &cfg, 1);
    w.ud_ready(&b, &cfg, 2);
    let ah = w.ah(0, a.pd, 1);
    let src = w.mr(0, a.pd, 64, LW, 0);
    src.write(0, &pattern(1, 64));
    let rb = w.mr(1, b.pd, 2 * 128, LW, 0xEE);
    w.post_recv(&b, rwr(100, vec![rb.sge(0, 128)]));
    w.post_recv(&b, rwr(101, vec![rb.sge(128, 128)]));
    let mut s = wr(1, SendOp::Send, vec![src.sge(0, 64)]);
    s.ud = Some(UdDest {
        ah,
        remote_qpn: b.qpn,
        remote_qkey: cfg.qkey ^ 0x0F0F,
    });
    w.post_send(&a, s);
    // The sender completes (UD is unacknowledged); the receiver drops it.
    check_send_wc(
        &w.expect_wc(0, a.scq),
        &send_wc(&a, 1, WcOpcode::Send, 64),
        "UD send, wrong Q_Key",
    );
    w.expect_no_wc(1, b.rcq, "a Q_Key mismatch must be dropped");
    assert_all(
        &rb.read_all(),
        0xEE,
        "nothing written by the dropped datagram",
    );
    // The dropped datagram consumed no receive: the next one takes WR 100.
    let mut s = wr(2, SendOp::Send, vec![src.sge(0, 10)]);
    s.ud = Some(UdDest {
        ah,
        remote_qpn: b.qpn,
        remote_qkey: cfg.qkey,
    });
    w.post_send(&a, s);
    check_send_wc(
        &w.expect_wc(0, a.scq),
        &send_wc(&a, 2, WcOpcode::Send, 10),
        "UD send",
    );
    let r = w.expect_wc(1, b.rcq);
    assert_eq!(
        (r.wr_id, r.status, r.byte_len),
        (100, WcStatus::Success, 50),
        "first receive after the drop: {r:#?}"
    );
    assert_bytes(&rb.read(40, 10), &pattern(1, 64)[..10], "datagram bytes");
}

/// Transmissions of the packet with opcode `op` and PSN `psn`.
fn count_tx_psn(log: &[Cap], op: wire::Opcode, psn: u32) -> usize {
    log.iter()
        .filter(|c| c.dir == Dir::Tx)
        .filter_map(|c| wire::Headers::parse(&c.pkt.data).ok())
        .filter(|(h, _)| h.bth.opcode == op && h.bth.psn == psn)
        .count()
}

#[test]
fn err_rnr_retry_exhausted() {
    for rnr_retry in 0..=6u8 {
        let what = format!("rnr_retry {rnr_retry}");
        let mut w = World::two(50 + u64::from(rnr_retry));
        let cfg = QpCfg {
            rnr_retry,
            min_rnr_timer: 1,
            ..QpCfg::rc()
        };
        let (a, b) = w.pair(&cfg);
        w.capture(0);
        let src = w.mr(0, a.pd, 64, LW, 1);
        w.post_send(&a, wr(1, SendOp::Send, vec![src.sge(0, 64)]));
        let c = w.expect_wc(0, a.scq);
        check_err_wc(&c, 1, WcStatus::RnrRetryExcErr, a.qpn, &what);
        assert_eq!(w.qp_state(&a), QpState::Err, "{what}: requester state");
        w.post_send(&a, wr(2, SendOp::Send, vec![src.sge(0, 64)]));
        check_err_wc(
            &w.expect_wc(0, a.scq),
            2,
            WcStatus::WrFlushErr,
            a.qpn,
            &what,
        );
        let log = w.take_log(0);
        assert_eq!(
            count_tx_psn(&log, wire::Opcode::RC_SEND_ONLY, 0x1000),
            1 + usize::from(rnr_retry),
            "{what}: the first SEND is sent once and retried rnr_retry times"
        );
        assert_eq!(
            w.stats(1).rnr_naks_sent,
            1 + u64::from(rnr_retry),
            "{what}: RNR NAKs sent by the responder"
        );
        assert_eq!(
            w.stats(0).rnr_naks_rcvd,
            1 + u64::from(rnr_retry),
            "{what}: RNR NAKs received"
        );
        w.expect_no_wc(1, b.rcq, &what);
    }
}

#[test]
fn err_rnr_then_success_once_receive_posted() {
    let mut w = World::two(60);
    let cfg = QpCfg {
        rnr_retry: 6,
        min_rnr_timer: 14, // 1.28 ms
        ..QpCfg::rc()
    };
    let (a, b) = w.pair(&cfg);
    let src = w.mr(0, a.pd, 300, LW, 0);
    let data = pattern(2, 300);
    src.write(0, &data);
    w.post_send(&a, wr(1, SendOp::Send, vec![src.sge(0, 300)]));
    let nakked = w.run_until(WAIT, |w| w.stats(1).rnr_naks_sent >= 2);
    assert!(
        nakked,
        "two RNR NAKs expected with no receive posted: {:?}",
        w.stats(1)
    );
    assert!(
        w.drain(0, a.scq).is_empty(),
        "no completion while RNR retries remain"
    );
    let rb = w.mr(1, b.pd, 512, LW, 0xEE);
    w.post_recv(&b, rwr(7, vec![rb.sge(0, 512)]));
    check_send_wc(
        &w.expect_wc(0, a.scq),
        &send_wc(&a, 1, WcOpcode::Send, 300),
        "SEND after RNR",
    );
    let r = w.expect_wc(1, b.rcq);
    check_recv_wc(
        &r,
        &recv_wc(&b, 7, WcOpcode::Recv, 300, None, None),
        a.qpn,
        "receive after RNR",
    );
    assert_bytes(&rb.read(0, 300), &data, "bytes after RNR");
    assert_all(&rb.read(300, 212), 0xEE, "after the message");
    assert_eq!(w.qp_state(&a), QpState::Rts);
}

#[test]
fn err_retry_exhausted_across_partition() {
    for retry_cnt in [0u8, 1, 3, 6, 7] {
        let what = format!("retry_cnt {retry_cnt}");
        let mut w = World::two(70 + u64::from(retry_cnt));
        let cfg = QpCfg {
            retry_cnt,
            timeout: 8, // ~1 ms
            ..QpCfg::rc()
        };
        let (a, b) = w.pair(&cfg);
        let t = w.mr(1, b.pd, 64, all_remote(), 0xEE);
        let src = w.mr(0, a.pd, 64, LW, 1);
        w.capture(0);
        w.sim.net.partition(dev_addr(0).ip(), dev_addr(1).ip());
        w.post_send(
            &a,
            wr(
                1,
                SendOp::Write {
                    remote_addr: t.va(0),
                    rkey: t.rkey(),
                },
                vec![src.sge(0, 64)],
            ),
        );
        w.post_send(
            &a,
            wr(
                2,
                SendOp::Write {
                    remote_addr: t.va(0),
                    rkey: t.rkey(),
                },
                vec![src.sge(0, 64)],
            ),
        );
        let c = w.poll_within(0, a.scq, 2, 60 * SEC);
        assert_eq!(
            c.len(),
            2,
            "{what}: retries across a partition must end (got {c:#?})"
        );
        check_err_wc(&c[0], 1, WcStatus::RetryExcErr, a.qpn, &what);
        check_err_wc(&c[1], 2, WcStatus::WrFlushErr, a.qpn, &what);
        assert_eq!(w.qp_state(&a), QpState::Err, "{what}: requester state");
        let log = w.take_log(0);
        let sent = count_tx_psn(&log, wire::Opcode::RC_RDMA_WRITE_ONLY, 0x1000);
        if retry_cnt < 7 {
            assert_eq!(
                sent,
                1 + usize::from(retry_cnt),
                "{what}: first WRITE sent once plus retry_cnt retries"
            );
        } else {
            assert!(
                sent >= 8,
                "{what}: at least 7 retries before giving up, got {sent} transmissions"
            );
        }
        w.sim.net.heal(dev_addr(0).ip(), dev_addr(1).ip());
        w.settle();
        assert_all(&t.read_all(), 0xEE, &format!("{what}: nothing written"));
        w.post_send(&a, wr(3, SendOp::Send, vec![src.sge(0, 8)]));
        check_err_wc(
            &w.expect_wc(0, a.scq),
            3,
            WcStatus::WrFlushErr,
            a.qpn,
            &format!("{what}: after ERR"),
        );
    }
}

#[test]
fn err_modify_to_err_flushes_in_order() {
    let mut w = World::two(80);
    let cfg = QpCfg {
        timeout: 14, // ~67 ms: nothing times out during the test
        ..QpCfg::rc()
    };
    let (a, b) = w.pair(&cfg);
    let t = w.mr(1, b.pd, 64, all_remote(), 0xEE);
    let buf = w.mr(0, a.pd, 256, LW, 0);
    for i in 0..3u64 {
        w.post_recv(&a, rwr(500 + i, vec![buf.sge(128, 64)]));
    }
    w.sim.net.partition(dev_addr(0).ip(), dev_addr(1).ip());
    let ops = [
        SendOp::Send,
        SendOp::Write {
            remote_addr: t.va(0),
            rkey: t.rkey(),
        },
        SendOp::Read {
            remote_addr: t.va(0),
            rkey: t.rkey(),
        },
        SendOp::FetchAdd {
            remote_addr: t.va(0),
            rkey: t.rkey(),
            add: 1,
        },
    ];
    for (i, op) in ops.into_iter().enumerate() {
        w.post_send(&a, wr(i as u64, op, vec![buf.sge(i * 8, 8)]));
    }
    w.run_for(MS);
    assert!(
        w.drain(0, a.scq).is_empty(),
        "nothing completes across the partition"
    );
    let attr = QpAttr {
        qp_state: QpState::Err,
        ..Default::default()
    };
    w.modify(&a, &attr, QpAttrMask::STATE)
        .expect("modify to ERR");
    assert_eq!(w.qp_state(&a), QpState::Err);
    let s = w.expect_wcs(0, a.scq, 4);
    for (i, c) in s.iter().enumerate() {
        check_err_wc(
            c,
            i as u64,
            WcStatus::WrFlushErr,
            a.qpn,
            &format!("send {i} flushed in order"),
        );
    }
    let r = w.expect_wcs(0, a.rcq, 3);
    for (i, c) in r.iter().enumerate() {
        check_err_wc(
            c,
            500 + i as u64,
            WcStatus::WrFlushErr,
            a.qpn,
            &format!("receive {i} flushed in order"),
        );
    }
    // Posting in ERR: accepted and flushed.
    w.post_recv(&a, rwr(600, vec![buf.sge(128, 64)]));
    check_err_wc(
        &w.expect_wc(0, a.rcq),
        600,
        WcStatus::WrFlushErr,
        a.qpn,
        "receive posted in ERR",
    );
    w.post_send(&a, wr(10, SendOp::Send, vec![buf.sge(0, 8)]));
    check_err_wc(
        &w.expect_wc(0, a.scq),
        10,
        WcStatus::WrFlushErr,
        a.qpn,
        "send posted in ERR",
    );
    w.sim.net.heal(dev_addr(0).ip(), dev_addr(1).ip());
    w.expect_no_wc(0, a.scq, "after the flush");
    w.expect_no_wc(0, a.rcq, "after the flush");
    assert_all(&t.read_all(), 0xEE, "flushed WRs must not reach the target");
}

#[test]
fn err_receive_buffer_too_small() {
    let mut w = World::two(81);
    let (a, b) = w.pair(&QpCfg::rc());
    let mem = w.mem(64);
    mem.fill(0xEE);
    let rb = w.reg(1, b.pd, &mem, 0, 64, LW);
    w.post_recv(&b, rwr(7, vec![rb.sge(0, 16)]));
    let src = w.mr(0, a.pd, 64, LW, 1);
    w.post_send(&a, wr(1, SendOp::Send, vec![src.sge(0, 64)]));
    let c = w.expect_wc(0, a.scq);
    check_err_wc(
        &c,
        1,
        WcStatus::RemInvReqErr,
        a.qpn,
        "requester of a SEND too big for the receive",
    );
    let r = w.expect_wc(1, b.rcq);
    check_err_wc(
        &r,
        7,
        WcStatus::LocLenErr,
        b.qpn,
        "responder receive too small",
    );
    assert_all(
        &mem.read(16, 48),
        0xEE,
        "nothing written past the receive buffer",
    );
    assert_eq!(w.qp_state(&a), QpState::Err, "requester state");
    assert_eq!(w.qp_state(&b), QpState::Err, "responder state");
}

#[test]
fn err_cq_overflow() {
    let mut w = World::two(82);
    let cfg = QpCfg::rc();
    let a = w.new_ep(0, &cfg);
    let bpd = w.pd(1);
    let bscq = w.cq(1, 64);
    let (brcq, cap) = w.nic(1).create_cq(4, None, false).unwrap();
    assert!(cap >= 4);
    let b = w.create_qp(1, bpd, bscq, brcq, None, &cfg);
    w.connect(&a, &cfg, 1, &b, &cfg, 2);
    let n = cap as usize + 2;
    let rb = w.mr(1, bpd, 16 * n, LW, 0);
    for i in 0..n {
        w.post_recv(&b, rwr(i as u64, vec![rb.sge(16 * i, 16)]));
    }
    w.events(1);
    let src = w.mr(0, a.pd, 16, LW, 1);
    for i in 0..n {
        w.post_send(&a, wr(i as u64, SendOp::Send, vec![src.sge(0, 16)]));
    }
    w.settle();
    let ev = w.events(1);
    assert!(
        ev.contains(&AsyncEvent::CqErr(brcq)),
        "CQ overflow must raise CqErr; events {ev:?}"
    );
    let mut out = [WorkCompletion::default(); 4];
    assert!(
        w.nic(1).poll_cq(brcq, &mut out).is_err(),
        "polling an overflowed CQ is an error"
    );
}

#[test]
fn err_corrupted_packets_counted_then_recovered() {
    let mut w = World::new(
        2,
        83,
        Faults {
            corrupt: 1.0,
            ..Faults::default()
        },
    );
    let cfg = QpCfg {
        timeout: 10, // ~4 ms
        retry_cnt: 7,
        ..QpCfg::rc()
    };
    let (a, b) = w.pair(&cfg);
    let rb = w.mr(1, b.pd, 128, LW, 0xEE);
    w.post_recv(&b, rwr(9, vec![rb.sge(0, 128)]));
    let src = w.mr(0, a.pd, 100, LW, 0);
    let data = pattern(3, 100);
    src.write(0, &data);
    w.post_send(&a, wr(1, SendOp::Send, vec![src.sge(0, 100)]));
    w.run_for(6 * MS);
    assert!(
        w.drain(1, b.rcq).is_empty(),
        "a corrupted SEND must not be delivered"
    );
    assert!(
        w.drain(0, a.scq).is_empty(),
        "nothing completes while every packet is corrupted"
    );
    assert_all(&rb.read_all(), 0xEE, "corrupted packets write nothing");
    let ns = w.sim.net.stats().clone();
    let delivered_corrupt = ns.corrupted - w.sim.net.in_flight() as u64;
    let (s0, s1) = (w.stats(0), w.stats(1));
    assert!(
        s1.icrc_errors >= 1,
        "the responder counts ICRC errors: {s1:?}"
    );
    assert_eq!(
        s0.icrc_errors + s1.icrc_errors + s0.malformed + s1.malformed,
        delivered_corrupt,
        "every corrupted packet delivered is dropped as a bad ICRC (or malformed): {s0:?} {s1:?} {ns:?}"
    );
    w.sim.net.set_faults(Faults::default());
    check_send_wc(
        &w.expect_wc(0, a.scq),
        &send_wc(&a, 1, WcOpcode::Send, 100),
        "SEND after corruption stops",
    );
    let r = w.expect_wc(1, b.rcq);
    check_recv_wc(
        &r,
        &recv_wc(&b, 9, WcOpcode::Recv, 100, None, None),
        a.qpn,
        "receive after corruption",
    );
    assert_bytes(&rb.read(0, 100), &data, "bytes after corruption");
}

#[test]
fn too_many_sges_is_einval_in_every_state_error_included() {
    let mut w = World::two(41);
    let (a, _b) = w.pair(&QpCfg::rc());
    let m = w.mr(0, a.pd, 64, Access::LOCAL_WRITE, 0);
    let max = w.nic(0).qp_init_attr(a.qpn).unwrap().cap.max_send_sge as usize;
    let too_many = || wr(1, SendOp::Send, vec![m.sge(0, 1); max + 1]);
    let e = w.try_post_send(&a, too_many()).expect_err("RTS");
    assert_eq!(e.errno, verbs::Errno::EINVAL, "RTS: {e}");
    let attr = QpAttr {
        qp_state: QpState::Err,
        ..Default::default()
    };
    w.modify(&a, &attr, QpAttrMask::STATE).expect("to ERR");
    let e = w.try_post_send(&a, too_many()).expect_err("ERR");
    assert_eq!(e.errno, verbs::Errno::EINVAL, "ERR: {e}");
    w.expect_no_wc(0, a.scq, "a refused post in ERR is not flushed");
    // Within the limit, a post in ERR is accepted and flushed.
    w.post_send(&a, wr(2, SendOp::Send, vec![m.sge(0, 1); max]));
    let c = w.expect_wc(0, a.scq);
    assert_eq!((c.wr_id, c.status), (2, WcStatus::WrFlushErr));
}
