//! RC end to end over the sim network: every opcode, bytes in target memory and every
//! field of every completion on both sides.

use common::*;
use softrdma_testkit as common;

const LW: Access = Access::LOCAL_WRITE;

fn all_remote() -> Access {
    Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC
}

/// 0, 1, MTU-1, MTU, MTU+1, several MTUs.
fn sizes(mtu: usize) -> Vec<usize> {
    vec![0, 1, mtu - 1, mtu, mtu + 1, 3 * mtu + 5]
}

const MTUS: [Mtu; 2] = [Mtu::Mtu256, Mtu::Mtu4096];

fn send_sizes(with_imm: bool) {
    for mtu in MTUS {
        let mut w = World::two(11);
        let cfg = QpCfg::rc().with_mtu(mtu);
        let (a, b) = w.pair(&cfg);
        let m = mtu.bytes();
        let max = 3 * m + 5;
        let src = w.mr(0, a.pd, max, LW, 0);
        let dst = w.mr(1, b.pd, max + 64, LW, 0xEE);
        for (i, &len) in sizes(m).iter().enumerate() {
            let i = i as u64;
            let ctx = format!("SEND imm={with_imm} mtu {m} len {len}");
            let data = pattern(i + 7, len);
            src.write(0, &data);
            dst.write(0, &vec![0xEE; dst.len()]);
            w.post_recv(&b, rwr(100 + i, vec![dst.sge(0, dst.len())]));
            let imm = 0xA0B0_C000 + i as u32;
            let op = if with_imm {
                SendOp::SendWithImm { imm }
            } else {
                SendOp::Send
            };
            w.post_send(&a, wr(i, op, sgl(&src, 0, len)));
            let swc = w.expect_wc(0, a.scq);
            check_send_wc(&swc, &send_wc(&a, i, WcOpcode::Send, len), &ctx);
            let rwc = w.expect_wc(1, b.rcq);
            let exp = recv_wc(
                &b,
                100 + i,
                WcOpcode::Recv,
                len,
                with_imm.then_some(imm),
                None,
            );
            check_recv_wc(&rwc, &exp, a.qpn, &ctx);
            assert_bytes(&dst.read(0, len), &data, &ctx);
            assert_all(
                &dst.read(len, dst.len() - len),
                0xEE,
                &format!("{ctx}: past the message"),
            );
        }
        w.expect_no_wc(0, a.scq, "sender after all sizes");
        w.expect_no_wc(1, b.rcq, "receiver after all sizes");
    }
}

#[test]
fn rc_send_all_sizes() {
    send_sizes(false);
}

#[test]
fn rc_send_with_imm_all_sizes() {
    send_sizes(true);
}

fn write_sizes(with_imm: bool) {
    for mtu in MTUS {
        let mut w = World::two(12);
        let cfg = QpCfg::rc().with_mtu(mtu);
        let (a, b) = w.pair(&cfg);
        let m = mtu.bytes();
        let max = 3 * m + 5;
        let src = w.mr(0, a.pd, max, LW, 0);
        let dst = w.mr(1, b.pd, max + 64, all_remote(), 0xEE);
        let rbuf = w.mr(1, b.pd, 64, LW, 0xCC);
        for (i, &len) in sizes(m).iter().enumerate() {
            let i = i as u64;
            let ctx = format!("WRITE imm={with_imm} mtu {m} len {len}");
            let data = pattern(i + 70, len);
            src.write(0, &data);
            dst.write(0, &vec![0xEE; dst.len()]);
            let imm = 0x0102_0300 + i as u32;
            let op = if with_imm {
                w.post_recv(&b, rwr(200 + i, vec![rbuf.sge(0, 64)]));
                SendOp::WriteWithImm {
                    remote_addr: dst.va(8),
                    rkey: dst.rkey(),
                    imm,
                }
            } else {
                SendOp::Write {
                    remote_addr: dst.va(8),
                    rkey: dst.rkey(),
                }
            };
            w.post_send(&a, wr(i, op, sgl(&src, 0, len)));
            let swc = w.expect_wc(0, a.scq);
            check_send_wc(&swc, &send_wc(&a, i, WcOpcode::RdmaWrite, len), &ctx);
            if with_imm {
                let rwc = w.expect_wc(1, b.rcq);
                let exp = recv_wc(&b, 200 + i, WcOpcode::RecvRdmaWithImm, len, Some(imm), None);
                check_recv_wc(&rwc, &exp, a.qpn, &ctx);
                assert_all(
                    &rbuf.read_all(),
                    0xCC,
                    &format!("{ctx}: receive buffer of a WRITE_WITH_IMM"),
                );
            }
            assert_all(&dst.read(0, 8), 0xEE, &format!("{ctx}: before the target"));
            assert_bytes(&dst.read(8, len), &data, &ctx);
            assert_all(
                &dst.read(8 + len, dst.len() - 8 - len),
                0xEE,
                &format!("{ctx}: after the target"),
            );
        }
        w.expect_no_wc(0, a.scq, "writer after all sizes");
        w.expect_no_wc(
            1,
            b.rcq,
            "target after all sizes (plain WRITE never completes there)",
        );
    }
}

#[test]
fn rc_write_all_sizes() {
    write_sizes(false);
}

#[test]
fn rc_write_with_imm_all_sizes() {
    write_sizes(true);
}

#[test]
fn rc_read_all_sizes() {
    for mtu in MTUS {
        let mut w = World::two(13);
        let cfg = QpCfg::rc().with_mtu(mtu);
        let (a, b) = w.pair(&cfg);
        let m = mtu.bytes();
        let max = 3 * m + 5;
        let local = w.mr(0, a.pd, max + 64, LW, 0xEE);
        let remote = w.mr(1, b.pd, max + 16, all_remote(), 0);
        for (i, &len) in sizes(m).iter().enumerate() {
            let i = i as u64;
            let ctx = format!("READ mtu {m} len {len}");
            let data = pattern(i + 700, len);
            remote.write(3, &data);
            local.write(0, &vec![0xEE; local.len()]);
            let before = remote.read_all();
            w.post_send(
                &a,
                wr(
                    i,
                    SendOp::Read {
                        remote_addr: remote.va(3),
                        rkey: remote.rkey(),
                    },
                    sgl(&local, 4, len),
                ),
            );
            let swc = w.expect_wc(0, a.scq);
            check_send_wc(&swc, &send_wc(&a, i, WcOpcode::RdmaRead, len), &ctx);
            assert_all(
                &local.read(0, 4),
                0xEE,
                &format!("{ctx}: before the local buffer"),
            );
            assert_bytes(&local.read(4, len), &data, &ctx);
            assert_all(
                &local.read(4 + len, local.len() - 4 - len),
                0xEE,
                &format!("{ctx}: after"),
            );
            assert_bytes(
                &remote.read_all(),
                &before,
                &format!("{ctx}: READ changed the target"),
            );
        }
        w.expect_no_wc(0, a.scq, "reader after all sizes");
        w.expect_no_wc(1, b.rcq, "target of READs");
    }
}

#[test]
fn rc_atomics_compare_swap_and_fetch_add() {
    let mut w = World::two(14);
    let (a, b) = w.pair(&QpCfg::rc());
    let target = w.mr(1, b.pd, 64, all_remote(), 0x77);
    target.write_u64(8, 0x1111_2222_3333_4444);
    target.write_u64(16, 1000);
    let res = w.mr(0, a.pd, 32, LW, 0xEE);
    let cas = |id, compare, swap, off| {
        wr(
            id,
            SendOp::CompareSwap {
                remote_addr: target.va(8),
                rkey: target.rkey(),
                compare,
                swap,
            },
            vec![res.sge(off, 8)],
        )
    };
    // Successful compare: swapped, original returned.
    w.post_send(&a, cas(1, 0x1111_2222_3333_4444, 0xDEAD_BEEF_0000_0001, 0));
    let c = w.expect_wc(0, a.scq);
    check_send_wc(&c, &send_wc(&a, 1, WcOpcode::CompSwap, 8), "CAS success");
    assert_eq!(
        res.read_u64(0),
        0x1111_2222_3333_4444,
        "CAS success returns the original"
    );
    assert_eq!(
        target.read_u64(8),
        0xDEAD_BEEF_0000_0001,
        "CAS success swapped"
    );
    // Failing compare: nothing changes, current value returned.
    w.post_send(&a, cas(2, 5, 7, 8));
    let c = w.expect_wc(0, a.scq);
    check_send_wc(
        &c,
        &send_wc(&a, 2, WcOpcode::CompSwap, 8),
        "CAS failing compare",
    );
    assert_eq!(
        res.read_u64(8),
        0xDEAD_BEEF_0000_0001,
        "failing CAS returns the current value"
    );
    assert_eq!(
        target.read_u64(8),
        0xDEAD_BEEF_0000_0001,
        "failing CAS must not swap"
    );
    // Fetch and add, then add -1 (wrapping).
    for (id, add, off, orig, after) in [
        (3u64, 16u64, 16usize, 1000u64, 1016u64),
        (4, u64::MAX, 24, 1016, 1015),
    ] {
        w.post_send(
            &a,
            wr(
                id,
                SendOp::FetchAdd {
                    remote_addr: target.va(16),
                    rkey: target.rkey(),
                    add,
                },
                vec![res.sge(off, 8)],
            ),
        );
        let c = w.expect_wc(0, a.scq);
        check_send_wc(&c, &send_wc(&a, id, WcOpcode::FetchAdd, 8), "FAA");
        assert_eq!(
            res.read_u64(off),
            orig,
            "FAA {id} returns the original into the local buffer"
        );
        assert_eq!(target.read_u64(16), after, "FAA {id} updated the remote");
    }
    assert_all(&target.read(0, 8), 0x77, "bytes before the atomic words");
    assert_all(&target.read(24, 40), 0x77, "bytes after the atomic words");
    w.expect_no_wc(0, a.scq, "after atomics");
    w.expect_no_wc(1, b.rcq, "atomic target");
}

/// B binds a type-2 window over `[off, off+len)` of `mr` on its QP; returns (mw, rkey).
fn bind_window(w: &mut World, b: &Ep, mr: &Mr, off: usize, len: usize, wr_id: u64) -> (MwId, u32) {
    let mw = w.nic(b.dev).alloc_mw(b.pd, 2).expect("alloc_mw type 2");
    let old = w.nic(b.dev).mw_rkey(mw).expect("mw_rkey");
    let rkey = verbs::inc_rkey(old);
    w.post_send(
        b,
        wr(
            wr_id,
            SendOp::BindMw(MwBind {
                mw,
                rkey,
                mr_lkey: mr.lkey(),
                addr: mr.va(off),
                length: len as u64,
                access: Access::REMOTE_WRITE | Access::REMOTE_READ,
            }),
            vec![],
        ),
    );
    let c = w.expect_wc(b.dev, b.scq);
    check_send_wc(&c, &send_wc(b, wr_id, WcOpcode::BindMw, 0), "BIND_MW");
    assert_eq!(
        w.nic(b.dev).mw_rkey(mw).unwrap(),
        rkey,
        "window rkey after bind"
    );
    (mw, rkey)
}

fn write_wr(id: u64, src: &Mr, soff: usize, len: usize, va: u64, rkey: u32) -> SendWr {
    wr(
        id,
        SendOp::Write {
            remote_addr: va,
            rkey,
        },
        sgl(src, soff, len),
    )
}

#[test]
fn rc_bind_mw_type2_write_inside_and_outside() {
    let mut w = World::two(15);
    let (a, b) = w.pair(&QpCfg::rc());
    // The region itself grants no remote right: only the window does.
    let mr = w.mr(1, b.pd, 4096, LW | Access::MW_BIND, 0xEE);
    let (_mw, rkey) = bind_window(&mut w, &b, &mr, 256, 512, 50);
    let src = w.mr(0, a.pd, 1024, LW, 0);
    let data = pattern(1, 1024);
    src.write(0, &data);
    w.post_send(&a, write_wr(1, &src, 0, 512, mr.va(256), rkey));
    let c = w.expect_wc(0, a.scq);
    check_send_wc(
        &c,
        &send_wc(&a, 1, WcOpcode::RdmaWrite, 512),
        "WRITE through the window",
    );
    assert_bytes(
        &mr.read(256, 512),
        &data[..512],
        "bytes written through the window",
    );
    let snap = mr.read_all();
    // Crossing the window's end by 4 bytes.
    w.post_send(&a, write_wr(2, &src, 0, 16, mr.va(256 + 500), rkey));
    let c = w.expect_wc(0, a.scq);
    check_err_wc(
        &c,
        2,
        WcStatus::RemAccessErr,
        a.qpn,
        "WRITE past the window",
    );
    assert_bytes(
        &mr.read_all(),
        &snap,
        "nothing written by the refused WRITE",
    );
    assert_eq!(
        w.qp_state(&a),
        QpState::Err,
        "requester QP after a remote access error"
    );
}

#[test]
fn rc_send_with_inv_invalidates_window() {
    let mut w = World::two(16);
    let (a, b) = w.pair(&QpCfg::rc());
    let mr = w.mr(1, b.pd, 1024, LW | Access::MW_BIND, 0xEE);
    let (_mw, rkey) = bind_window(&mut w, &b, &mr, 0, 512, 50);
    let src = w.mr(0, a.pd, 256, LW, 0);
    let data = pattern(2, 256);
    src.write(0, &data);
    w.post_send(&a, write_wr(1, &src, 0, 100, mr.va(0), rkey));
    let c = w.expect_wc(0, a.scq);
    check_send_wc(
        &c,
        &send_wc(&a, 1, WcOpcode::RdmaWrite, 100),
        "WRITE before invalidation",
    );
    assert_bytes(&mr.read(0, 100), &data[..100], "WRITE before invalidation");
    let rbuf = w.mr(1, b.pd, 64, LW, 0xEE);
    w.post_recv(&b, rwr(60, vec![rbuf.sge(0, 64)]));
    w.post_send(
        &a,
        wr(
            2,
            SendOp::SendWithInv {
                invalidate_rkey: rkey,
            },
            sgl(&src, 100, 32),
        ),
    );
    let c = w.expect_wc(0, a.scq);
    check_send_wc(&c, &send_wc(&a, 2, WcOpcode::Send, 32), "SEND_WITH_INV");
    let r = w.expect_wc(1, b.rcq);
    check_recv_wc(
        &r,
        &recv_wc(&b, 60, WcOpcode::Recv, 32, None, Some(rkey)),
        a.qpn,
        "SEND_WITH_INV receive",
    );
    assert_bytes(&rbuf.read(0, 32), &data[100..132], "SEND_WITH_INV payload");
    let snap = mr.read_all();
    w.post_send(&a, write_wr(3, &src, 0, 100, mr.va(200), rkey));
    let c = w.expect_wc(0, a.scq);
    check_err_wc(
        &c,
        3,
        WcStatus::RemAccessErr,
        a.qpn,
        "WRITE with the invalidated rkey",
    );
    assert_bytes(
        &mr.read_all(),
        &snap,
        "nothing written with the invalidated rkey",
    );
}

#[test]
fn rc_local_inv_invalidates_window() {
    let mut w = World::two(17);
    let (a, b) = w.pair(&QpCfg::rc());
    let mr = w.mr(1, b.pd, 1024, LW | Access::MW_BIND, 0xEE);
    let (_mw, rkey) = bind_window(&mut w, &b, &mr, 0, 1024, 50);
    let src = w.mr(0, a.pd, 256, LW, 0);
    src.write(0, &pattern(3, 256));
    w.post_send(&a, write_wr(1, &src, 0, 64, mr.va(0), rkey));
    let c = w.expect_wc(0, a.scq);
    check_send_wc(
        &c,
        &send_wc(&a, 1, WcOpcode::RdmaWrite, 64),
        "WRITE before LOCAL_INV",
    );
    w.post_send(&b, wr(51, SendOp::LocalInv { rkey }, vec![]));
    let c = w.expect_wc(1, b.scq);
    check_send_wc(&c, &send_wc(&b, 51, WcOpcode::LocalInv, 0), "LOCAL_INV");
    let snap = mr.read_all();
    w.post_send(&a, write_wr(2, &src, 0, 64, mr.va(128), rkey));
    let c = w.expect_wc(0, a.scq);
    check_err_wc(
        &c,
        2,
        WcStatus::RemAccessErr,
        a.qpn,
        "WRITE after LOCAL_INV",
    );
    assert_bytes(&mr.read_all(), &snap, "nothing written after LOCAL_INV");
}

#[test]
fn rc_multi_sge_send_write_read() {
    let mut w = World::two(18);
    let (a, b) = w.pair(&QpCfg::rc().with_mtu(Mtu::Mtu256));
    let s1 = w.mr(0, a.pd, 4096, LW, 0);
    let s2 = w.mr(0, a.pd, 512, LW, 0);
    s1.write(0, &pattern(4, 4096));
    s2.write(0, &pattern(5, 512));
    let gather = vec![s1.sge(0, 100), s2.sge(10, 300), s1.sge(2000, 1)];
    let mut msg = s1.read(0, 100);
    msg.extend(s2.read(10, 300));
    msg.extend(s1.read(2000, 1));
    assert_eq!(msg.len(), 401);
    // SEND: gather 3, scatter 2.
    let r1 = w.mr(1, b.pd, 200, LW, 0xEE);
    let r2 = w.mr(1, b.pd, 400, LW, 0xEE);
    w.post_recv(&b, rwr(10, vec![r1.sge(0, 200), r2.sge(50, 300)]));
    w.post_send(&a, wr(1, SendOp::Send, gather.clone()));
    check_send_wc(
        &w.expect_wc(0, a.scq),
        &send_wc(&a, 1, WcOpcode::Send, 401),
        "multi-SGE SEND",
    );
    let r = w.expect_wc(1, b.rcq);
    check_recv_wc(
        &r,
        &recv_wc(&b, 10, WcOpcode::Recv, 401, None, None),
        a.qpn,
        "multi-SGE receive",
    );
    assert_bytes(&r1.read_all(), &msg[..200], "first scatter element");
    assert_all(&r2.read(0, 50), 0xEE, "before the second scatter element");
    assert_bytes(&r2.read(50, 201), &msg[200..], "second scatter element");
    assert_all(&r2.read(251, 149), 0xEE, "after the message");
    // WRITE: gather 3 into one remote range.
    let t = w.mr(1, b.pd, 1024, all_remote(), 0xEE);
    w.post_send(
        &a,
        wr(
            2,
            SendOp::Write {
                remote_addr: t.va(16),
                rkey: t.rkey(),
            },
            gather,
        ),
    );
    check_send_wc(
        &w.expect_wc(0, a.scq),
        &send_wc(&a, 2, WcOpcode::RdmaWrite, 401),
        "multi-SGE WRITE",
    );
    assert_bytes(&t.read(16, 401), &msg, "multi-SGE WRITE bytes");
    assert_all(&t.read(417, 1024 - 417), 0xEE, "after multi-SGE WRITE");
    // READ: scatter the remote range into 3 local elements.
    let l1 = w.mr(0, a.pd, 300, LW, 0xEE);
    let l2 = w.mr(0, a.pd, 300, LW, 0xEE);
    w.post_send(
        &a,
        wr(
            3,
            SendOp::Read {
                remote_addr: t.va(16),
                rkey: t.rkey(),
            },
            vec![l1.sge(0, 150), l2.sge(0, 250), l1.sge(200, 1)],
        ),
    );
    check_send_wc(
        &w.expect_wc(0, a.scq),
        &send_wc(&a, 3, WcOpcode::RdmaRead, 401),
        "multi-SGE READ",
    );
    assert_bytes(&l1.read(0, 150), &msg[..150], "READ scatter 1");
    assert_bytes(&l2.read(0, 250), &msg[150..400], "READ scatter 2");
    assert_bytes(&l1.read(200, 1), &msg[400..], "READ scatter 3");
    assert_all(&l1.read(150, 50), 0xEE, "between READ scatter elements");
    assert_all(&l2.read(250, 50), 0xEE, "after READ scatter 2");
}

#[test]
fn rc_inline_send_and_write() {
    let mut w = World::two(19);
    let (a, b) = w.pair(&QpCfg::rc().with_mtu(Mtu::Mtu256));
    let data = pattern(6, 256);
    // INLINE through lkeys: gathered from registered memory at post time.
    let src = w.mr(0, a.pd, 256, Access::LOCAL_WRITE, 0);
    src.write(0, &data);
    let rb = w.mr(1, b.pd, 256, LW, 0xEE);
    w.post_recv(&b, rwr(10, vec![rb.sge(0, 256)]));
    let inl = SendFlags::SIGNALED | SendFlags::INLINE;
    w.post_send(&a, wr_flags(1, SendOp::Send, inl, vec![src.sge(0, 200)]));
    src.write(0, &[0u8; 256]); // must not matter any more
    check_send_wc(
        &w.expect_wc(0, a.scq),
        &send_wc(&a, 1, WcOpcode::Send, 200),
        "INLINE SEND",
    );
    let r = w.expect_wc(1, b.rcq);
    check_recv_wc(
        &r,
        &recv_wc(&b, 10, WcOpcode::Recv, 200, None, None),
        a.qpn,
        "INLINE receive",
    );
    assert_bytes(
        &rb.read(0, 200),
        &data[..200],
        "INLINE SEND bytes (copied at post time)",
    );
    // INLINE by value (what the C face passes): the SGEs give only the lengths; their
    // addresses are never read, so bogus ones change nothing.
    let t = w.mr(1, b.pd, 256, all_remote(), 0xEE);
    let bogus = |len: u32| Sge {
        addr: 0x10,
        length: len,
        lkey: 0xdead,
    };
    let mut exp = data[..50].to_vec();
    exp.extend_from_slice(&data[100..150]);
    let mut wr = wr_flags(
        2,
        SendOp::Write {
            remote_addr: t.va(0),
            rkey: t.rkey(),
        },
        SendFlags::SIGNALED,
        vec![bogus(50), bogus(50)],
    );
    wr.inline_data = Some(exp.clone());
    w.post_send(&a, wr);
    check_send_wc(
        &w.expect_wc(0, a.scq),
        &send_wc(&a, 2, WcOpcode::RdmaWrite, 100),
        "INLINE WRITE",
    );
    assert_bytes(&t.read(0, 100), &exp, "INLINE WRITE bytes");
    assert_all(&t.read(100, 156), 0xEE, "after INLINE WRITE");
}

#[test]
fn rc_inline_never_reads_unregistered_memory() {
    let mut w = World::two(23);
    let (a, b) = w.pair(&QpCfg::rc());
    let rb = w.mr(1, b.pd, 256, LW, 0xEE);
    w.post_recv(&b, rwr(10, vec![rb.sge(0, 256)]));
    // Process memory that no MR covers: an INLINE post must refuse it, not send it.
    let raw = w.mem(256);
    raw.fill(0x5A);
    let inl = SendFlags::SIGNALED | SendFlags::INLINE;
    let unregistered = Sge {
        addr: raw.addr(),
        length: 64,
        lkey: 0,
    };
    w.capture(0);
    let e = w
        .try_post_send(&a, wr_flags(1, SendOp::Send, inl, vec![unregistered]))
        .expect_err("INLINE from unregistered memory");
    assert_eq!(e.errno, verbs::Errno::EFAULT, "{e}");
    // By value, the data must match the SGE lengths.
    let mut wr = wr_flags(2, SendOp::Send, inl, vec![unregistered]);
    wr.inline_data = Some(vec![1; 63]);
    let e = w.try_post_send(&a, wr).expect_err("inline length mismatch");
    assert_eq!(e.errno, verbs::Errno::EINVAL, "{e}");
    w.expect_no_wc(0, a.scq, "refused INLINE posts");
    w.expect_no_wc(1, b.rcq, "refused INLINE posts");
    assert!(w.take_log(0).is_empty(), "a refused post sent packets");
    assert_all(&rb.read(0, 256), 0xEE, "receive buffer after refused posts");
}

#[test]
fn rc_unsignaled_then_signaled() {
    let mut w = World::two(20);
    let (a, b) = w.pair(&QpCfg::rc());
    let src = w.mr(0, a.pd, 4096, LW, 0);
    src.write(0, &pattern(7, 4096));
    let t = w.mr(1, b.pd, 4096, all_remote(), 0xEE);
    for i in 0..4u64 {
        let flags = if i == 3 {
            SendFlags::SIGNALED
        } else {
            SendFlags::empty()
        };
        let off = i as usize * 1024;
        w.post_send(
            &a,
            wr_flags(
                i,
                SendOp::Write {
                    remote_addr: t.va(off),
                    rkey: t.rkey(),
                },
                flags,
                vec![src.sge(off, 1000)],
            ),
        );
    }
    let c = w.expect_wc(0, a.scq);
    check_send_wc(
        &c,
        &send_wc(&a, 3, WcOpcode::RdmaWrite, 1000),
        "the only signaled WR",
    );
    w.expect_no_wc(0, a.scq, "unsignaled WRs must not complete");
    for i in 0..4 {
        assert_bytes(
            &t.read(i * 1024, 1000),
            &src.read(i * 1024, 1000),
            &format!("WRITE {i}"),
        );
    }
    // sq_sig_all: every WR completes whatever its flags.
    let mut w = World::two(21);
    let cfg = QpCfg {
        sq_sig_all: true,
        ..QpCfg::rc()
    };
    let (a, b) = w.pair(&cfg);
    let src = w.mr(0, a.pd, 64, LW, 0);
    let t = w.mr(1, b.pd, 64, all_remote(), 0xEE);
    w.post_send(
        &a,
        wr_flags(
            9,
            SendOp::Write {
                remote_addr: t.va(0),
                rkey: t.rkey(),
            },
            SendFlags::empty(),
            vec![src.sge(0, 64)],
        ),
    );
    check_send_wc(
        &w.expect_wc(0, a.scq),
        &send_wc(&a, 9, WcOpcode::RdmaWrite, 64),
        "sq_sig_all",
    );
}

#[test]
fn rc_solicited_event_on_channel() {
    let mut w = World::two(22);
    let cfg = QpCfg::rc();
    let a = w.new_ep(0, &cfg);
    let bpd = w.pd(1);
    let ch = w.nic(1).create_channel().unwrap();
    let bscq = w.cq(1, 64);
    let (brcq, _) = w.nic(1).create_cq(64, Some(ch), false).unwrap();
    let b = w.create_qp(1, bpd, bscq, brcq, None, &cfg);
    w.connect(&a, &cfg, 0x10, &b, &cfg, 0x20);
    let src = w.mr(0, a.pd, 64, LW, 0);
    let rb = w.mr(1, b.pd, 64 * 4, LW, 0);
    for i in 0..4u64 {
        w.post_recv(&b, rwr(i, vec![rb.sge(i as usize * 64, 64)]));
    }
    w.nic(1).req_notify_cq(brcq, Arm::Solicited).unwrap();
    // Unsolicited: completes, no event.
    w.post_send(&a, wr(100, SendOp::Send, vec![src.sge(0, 8)]));
    let r = w.expect_wc(1, brcq);
    check_recv_wc(
        &r,
        &recv_wc(&b, 0, WcOpcode::Recv, 8, None, None),
        a.qpn,
        "unsolicited",
    );
    w.settle();
    assert_eq!(
        w.nic(1).get_cq_event(ch),
        None,
        "an unsolicited receive must not fire a Solicited arm"
    );
    // Solicited: event.
    let sol = SendFlags::SIGNALED | SendFlags::SOLICITED;
    w.post_send(
        &a,
        wr_flags(
            101,
            SendOp::SendWithImm { imm: 5 },
            sol,
            vec![src.sge(0, 8)],
        ),
    );
    let r = w.expect_wc(1, brcq);
    check_recv_wc(
        &r,
        &recv_wc(&b, 1, WcOpcode::Recv, 8, Some(5), None),
        a.qpn,
        "solicited",
    );
    assert_eq!(
        w.nic(1).get_cq_event(ch),
        Some(brcq),
        "a solicited receive fires the armed CQ"
    );
    w.nic(1).ack_cq_events(brcq, 1).unwrap();
    // The arm is consumed: another solicited one fires nothing.
    w.post_send(&a, wr_flags(102, SendOp::Send, sol, vec![src.sge(0, 8)]));
    let r = w.expect_wc(1, brcq);
    check_recv_wc(
        &r,
        &recv_wc(&b, 2, WcOpcode::Recv, 8, None, None),
        a.qpn,
        "solicited, not armed",
    );
    assert_eq!(w.nic(1).get_cq_event(ch), None, "the arm is one-shot");
    // Armed for Next: any receive fires.
    w.nic(1).req_notify_cq(brcq, Arm::Next).unwrap();
    w.post_send(&a, wr(103, SendOp::Send, vec![src.sge(0, 8)]));
    let r = w.expect_wc(1, brcq);
    check_recv_wc(
        &r,
        &recv_wc(&b, 3, WcOpcode::Recv, 8, None, None),
        a.qpn,
        "armed Next",
    );
    assert_eq!(
        w.nic(1).get_cq_event(ch),
        Some(brcq),
        "Next arm fires on any completion"
    );
    w.nic(1).ack_cq_events(brcq, 1).unwrap();
    let sends = w.expect_wcs(0, a.scq, 4);
    for (i, c) in sends.iter().enumerate() {
        check_send_wc(c, &send_wc(&a, 100 + i as u64, WcOpcode::Send, 8), "sender");
    }
}

/// Index in the log of the first packet matching.
fn find(log: &[Cap], dir: Dir, pred: impl Fn(wire::Opcode) -> bool) -> Vec<usize> {
    log.iter()
        .enumerate()
        .filter(|(_, c)| c.dir == dir && opcode_of(&c.pkt).is_some_and(&pred))
        .map(|(i, _)| i)
        .collect()
}

fn fence_case(fence: bool) -> (usize, usize) {
    let mut w = World::two(23);
    let (a, b) = w.pair(&QpCfg::rc().with_mtu(Mtu::Mtu256));
    w.capture(0);
    let remote = w.mr(1, b.pd, 1024, all_remote(), 0);
    let old = pattern(8, 1024);
    remote.write(0, &old);
    let local = w.mr(0, a.pd, 1024, LW, 0xEE);
    let src = w.mr(0, a.pd, 1024, LW, 0);
    let new = pattern(9, 1024);
    src.write(0, &new);
    w.post_send(
        &a,
        wr(
            1,
            SendOp::Read {
                remote_addr: remote.va(0),
                rkey: remote.rkey(),
            },
            vec![local.sge(0, 1024)],
        ),
    );
    let flags = if fence {
        SendFlags::SIGNALED | SendFlags::FENCE
    } else {
        SendFlags::SIGNALED
    };
    w.post_send(
        &a,
        wr_flags(
            2,
            SendOp::Write {
                remote_addr: remote.va(0),
                rkey: remote.rkey(),
            },
            flags,
            vec![src.sge(0, 1024)],
        ),
    );
    let c = w.expect_wcs(0, a.scq, 2);
    check_send_wc(&c[0], &send_wc(&a, 1, WcOpcode::RdmaRead, 1024), "READ");
    check_send_wc(&c[1], &send_wc(&a, 2, WcOpcode::RdmaWrite, 1024), "WRITE");
    assert_bytes(
        &local.read_all(),
        &old,
        "the READ sees the memory before the WRITE",
    );
    assert_bytes(&remote.read_all(), &new, "the WRITE landed");
    let log = w.take_log(0);
    let last_resp = *find(&log, Dir::Rx, |o| {
        o == wire::Opcode::RC_RDMA_READ_RESPONSE_LAST
            || o == wire::Opcode::RC_RDMA_READ_RESPONSE_ONLY
    })
    .last()
    .expect("a READ response reached A");
    let first_write = find(&log, Dir::Tx, |o| {
        o == wire::Opcode::RC_RDMA_WRITE_FIRST || o == wire::Opcode::RC_RDMA_WRITE_ONLY
    })[0];
    (last_resp, first_write)
}

#[test]
fn rc_fence_write_waits_for_read() {
    let (last_resp, first_write) = fence_case(true);
    assert!(
        first_write > last_resp,
        "fenced WRITE went out (log index {first_write}) before the READ's last response arrived ({last_resp})"
    );
    // Control: without FENCE the WRITE is pipelined behind the READ request, which
    // shows the check above can tell the difference.
    let (last_resp, first_write) = fence_case(false);
    assert!(
        first_write < last_resp,
        "unfenced WRITE should be pipelined (log index {first_write}) before the READ completes ({last_resp})"
    );
}

#[test]
fn rc_psn_wraparound() {
    let mut w = World::two(24);
    let cfg = QpCfg::rc().with_mtu(Mtu::Mtu256);
    let (a, b) = w.pair_psn(&cfg, &cfg, 0xFF_FFFE, 0xFF_FFFD);
    let asrc = w.mr(0, a.pd, 4096, all_remote(), 0);
    asrc.write(0, &pattern(10, 4096));
    let bmem = w.mr(1, b.pd, 4096, all_remote(), 0xEE);
    let brecv = w.mr(1, b.pd, 2048, LW, 0xEE);
    let arecv = w.mr(0, a.pd, 2048, LW, 0xEE);
    // A -> B: SEND of 4 packets across the wrap, WRITE, READ, FAA.
    w.post_recv(&b, rwr(10, vec![brecv.sge(0, 2048)]));
    w.post_send(&a, wr(1, SendOp::Send, vec![asrc.sge(0, 3 * 256 + 1)]));
    w.post_send(
        &a,
        wr(
            2,
            SendOp::Write {
                remote_addr: bmem.va(0),
                rkey: bmem.rkey(),
            },
            vec![asrc.sge(1000, 700)],
        ),
    );
    w.post_send(
        &a,
        wr(
            3,
            SendOp::Read {
                remote_addr: bmem.va(0),
                rkey: bmem.rkey(),
            },
            vec![asrc.sge(2048, 700)],
        ),
    );
    bmem.write_u64(2048, 41);
    w.post_send(
        &a,
        wr(
            4,
            SendOp::FetchAdd {
                remote_addr: bmem.va(2048),
                rkey: bmem.rkey(),
                add: 1,
            },
            vec![asrc.sge(4000, 8)],
        ),
    );
    let c = w.expect_wcs(0, a.scq, 4);
    check_send_wc(
        &c[0],
        &send_wc(&a, 1, WcOpcode::Send, 769),
        "SEND across the wrap",
    );
    check_send_wc(
        &c[1],
        &send_wc(&a, 2, WcOpcode::RdmaWrite, 700),
        "WRITE across the wrap",
    );
    check_send_wc(
        &c[2],
        &send_wc(&a, 3, WcOpcode::RdmaRead, 700),
        "READ across the wrap",
    );
    check_send_wc(
        &c[3],
        &send_wc(&a, 4, WcOpcode::FetchAdd, 8),
        "FAA across the wrap",
    );
    let r = w.expect_wc(1, b.rcq);
    check_recv_wc(
        &r,
        &recv_wc(&b, 10, WcOpcode::Recv, 769, None, None),
        a.qpn,
        "receive across the wrap",
    );
    let src = pattern(10, 4096);
    assert_bytes(&brecv.read(0, 769), &src[..769], "SEND bytes");
    assert_bytes(&bmem.read(0, 700), &src[1000..1700], "WRITE bytes");
    assert_bytes(&asrc.read(2048, 700), &src[1000..1700], "READ bytes");
    assert_eq!(asrc.read_u64(4000), 41, "FAA original");
    assert_eq!(bmem.read_u64(2048), 42, "FAA result");
    // B -> A across its own wrap.
    w.post_recv(&a, rwr(20, vec![arecv.sge(0, 2048)]));
    let bsrc = w.mr(1, b.pd, 1024, LW, 0);
    bsrc.write(0, &pattern(11, 1024));
    w.post_send(
        &b,
        wr(5, SendOp::SendWithImm { imm: 77 }, vec![bsrc.sge(0, 1000)]),
    );
    check_send_wc(
        &w.expect_wc(1, b.scq),
        &send_wc(&b, 5, WcOpcode::Send, 1000),
        "B SEND across the wrap",
    );
    let r = w.expect_wc(0, a.rcq);
    check_recv_wc(
        &r,
        &recv_wc(&a, 20, WcOpcode::Recv, 1000, Some(77), None),
        b.qpn,
        "A receive",
    );
    assert_bytes(
        &arecv.read(0, 1000),
        &pattern(11, 1024)[..1000],
        "B->A bytes",
    );
}

#[test]
fn rc_completion_timestamps() {
    let mut w = World::two(25);
    let cfg = QpCfg::rc();
    let apd = w.pd(0);
    let (ascq, _) = w.nic(0).create_cq(64, None, true).unwrap();
    let arcq = w.cq(0, 64);
    let a = w.create_qp(0, apd, ascq, arcq, None, &cfg);
    let bpd = w.pd(1);
    let bscq = w.cq(1, 64);
    let (brcq, _) = w.nic(1).create_cq(64, None, true).unwrap();
    let b = w.create_qp(1, bpd, bscq, brcq, None, &cfg);
    w.connect(&a, &cfg, 1, &b, &cfg, 2);
    let src = w.mr(0, a.pd, 64, LW, 0);
    let rb = w.mr(1, b.pd, 64 * 3, LW, 0);
    let mut last_s = 0;
    let mut last_r = 0;
    for i in 0..3u64 {
        w.run_for(3 * MS);
        w.post_recv(&b, rwr(i, vec![rb.sge(i as usize * 64, 64)]));
        let posted = w.now();
        w.post_send(&a, wr(i, SendOp::Send, vec![src.sge(0, 16)]));
        let s = w.expect_wc(0, a.scq);
        let r = w.expect_wc(1, b.rcq);
        let now = w.now();
        for (c, last, side) in [(&s, &mut last_s, "send"), (&r, &mut last_r, "recv")] {
            let t = c.timestamp.unwrap_or_else(|| {
                panic!("{side} completion {i} on a timestamping CQ lacks a timestamp")
            });
            assert!(
                t >= posted && t <= now,
                "{side} timestamp {t} outside [{posted}, {now}]"
            );
            assert!(t >= *last, "{side} timestamps go backwards: {t} < {last}");
            *last = t;
        }
        let mut es = send_wc(&a, i, WcOpcode::Send, 16);
        es.timestamp = s.timestamp;
        check_send_wc(&s, &es, "timestamped send");
        let mut er = recv_wc(&b, i, WcOpcode::Recv, 16, None, None);
        er.timestamp = r.timestamp;
        check_recv_wc(&r, &er, a.qpn, "timestamped recv");
    }
}

#[test]
fn rc_device_memory_as_write_target() {
    let mut w = World::two(26);
    let (a, b) = w.pair(&QpCfg::rc().with_mtu(Mtu::Mtu256));
    let dm = w.nic(1).alloc_dm(4096).expect("alloc_dm");
    w.nic(1).dm_copy_to(dm, 0, &[0xAB; 4096]).unwrap();
    let info = w
        .nic(1)
        .reg_dm_mr(b.pd, dm, 0, 4096, all_remote())
        .expect("reg_dm_mr");
    assert_eq!(info.length, 4096);
    let src = w.mr(0, a.pd, 2048, LW, 0);
    let data = pattern(12, 1000);
    src.write(0, &data);
    w.post_send(
        &a,
        wr(
            1,
            SendOp::Write {
                remote_addr: info.addr + 100,
                rkey: info.rkey,
            },
            vec![src.sge(0, 1000)],
        ),
    );
    check_send_wc(
        &w.expect_wc(0, a.scq),
        &send_wc(&a, 1, WcOpcode::RdmaWrite, 1000),
        "WRITE into DM",
    );
    let mut out = vec![0u8; 4096];
    w.nic(1).dm_copy_from(dm, 0, &mut out).unwrap();
    assert_all(&out[..100], 0xAB, "DM before the WRITE");
    assert_bytes(&out[100..1100], &data, "DM bytes");
    assert_all(&out[1100..], 0xAB, "DM after the WRITE");
    // And read it back.
    w.post_send(
        &a,
        wr(
            2,
            SendOp::Read {
                remote_addr: info.addr + 100,
                rkey: info.rkey,
            },
            vec![src.sge(1024, 1000)],
        ),
    );
    check_send_wc(
        &w.expect_wc(0, a.scq),
        &send_wc(&a, 2, WcOpcode::RdmaRead, 1000),
        "READ from DM",
    );
    assert_bytes(&src.read(1024, 1000), &data, "READ back from DM");
}
