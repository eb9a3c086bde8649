//! UC and UD end to end over the sim network, and shared receive queues.

use common::*;
use softrdma_testkit as common;

const LW: Access = Access::LOCAL_WRITE;

#[test]
fn uc_send_and_send_with_imm() {
    let mut w = World::two(31);
    let cfg = QpCfg::uc().with_mtu(Mtu::Mtu256);
    let (a, b) = w.pair(&cfg);
    let src = w.mr(0, a.pd, 1024, LW, 0);
    let dst = w.mr(1, b.pd, 1024, LW, 0xEE);
    let mut id = 0u64;
    for with_imm in [false, true] {
        for len in [0usize, 1, 255, 256, 257, 700] {
            id += 1;
            let ctx = format!("UC SEND imm={with_imm} len {len}");
            let data = pattern(id, len);
            src.write(0, &data);
            dst.write(0, &[0xEE; 1024]);
            w.post_recv(&b, rwr(100 + id, vec![dst.sge(0, 1024)]));
            let imm = 0xCAFE_0000 | id as u32;
            let op = if with_imm {
                SendOp::SendWithImm { imm }
            } else {
                SendOp::Send
            };
            w.post_send(&a, wr(id, op, sgl(&src, 0, len)));
            check_send_wc(
                &w.expect_wc(0, a.scq),
                &send_wc(&a, id, WcOpcode::Send, len),
                &ctx,
            );
            let r = w.expect_wc(1, b.rcq);
            let exp = recv_wc(
                &b,
                100 + id,
                WcOpcode::Recv,
                len,
                with_imm.then_some(imm),
                None,
            );
            check_recv_wc(&r, &exp, a.qpn, &ctx);
            assert_bytes(&dst.read(0, len), &data, &ctx);
            assert_all(
                &dst.read(len, 1024 - len),
                0xEE,
                &format!("{ctx}: after the message"),
            );
        }
    }
    w.expect_no_wc(0, a.scq, "UC sender");
    w.expect_no_wc(1, b.rcq, "UC receiver");
}

#[test]
fn uc_write_and_write_with_imm() {
    let mut w = World::two(32);
    let cfg = QpCfg::uc().with_mtu(Mtu::Mtu256);
    let (a, b) = w.pair(&cfg);
    let src = w.mr(0, a.pd, 1024, LW, 0);
    let t = w.mr(1, b.pd, 1024, LW | Access::REMOTE_WRITE, 0xEE);
    let rb = w.mr(1, b.pd, 16, LW, 0xCC);
    let mut id = 0u64;
    for with_imm in [false, true] {
        for len in [0usize, 1, 256, 257, 700] {
            id += 1;
            let ctx = format!("UC WRITE imm={with_imm} len {len}");
            let data = pattern(id + 50, len);
            src.write(0, &data);
            t.write(0, &[0xEE; 1024]);
            let imm = 0x5151_0000 | id as u32;
            let op = if with_imm {
                w.post_recv(&b, rwr(100 + id, vec![rb.sge(0, 16)]));
                SendOp::WriteWithImm {
                    remote_addr: t.va(4),
                    rkey: t.rkey(),
                    imm,
                }
            } else {
                SendOp::Write {
                    remote_addr: t.va(4),
                    rkey: t.rkey(),
                }
            };
            w.post_send(&a, wr(id, op, sgl(&src, 0, len)));
            check_send_wc(
                &w.expect_wc(0, a.scq),
                &send_wc(&a, id, WcOpcode::RdmaWrite, len),
                &ctx,
            );
            if with_imm {
                let r = w.expect_wc(1, b.rcq);
                let exp = recv_wc(
                    &b,
                    100 + id,
                    WcOpcode::RecvRdmaWithImm,
                    len,
                    Some(imm),
                    None,
                );
                check_recv_wc(&r, &exp, a.qpn, &ctx);
                assert_all(
                    &rb.read_all(),
                    0xCC,
                    &format!("{ctx}: receive buffer untouched"),
                );
            } else {
                // A UC WRITE has no ACK: let it land.
                w.settle();
            }
            assert_all(&t.read(0, 4), 0xEE, &format!("{ctx}: before"));
            assert_bytes(&t.read(4, len), &data, &ctx);
            assert_all(&t.read(4 + len, 1020 - len), 0xEE, &format!("{ctx}: after"));
        }
    }
    w.expect_no_wc(0, a.scq, "UC writer");
    w.expect_no_wc(1, b.rcq, "UC target");
}

/// Check the 40-byte GRH area of a UD receive: the last 20 bytes are the IPv4 header.
fn check_ipv4_grh(grh: &[u8], src: [u8; 4], dst: [u8; 4], udp_payload_len: usize, ctx: &str) {
    let ip = &grh[20..40];
    assert_eq!(
        ip[0], 0x45,
        "{ctx}: IPv4 version/IHL in GRH bytes 20..40: {ip:02x?}"
    );
    assert_eq!(ip[9], 17, "{ctx}: IPv4 protocol UDP");
    assert_eq!(&ip[12..16], &src, "{ctx}: IPv4 source address");
    assert_eq!(&ip[16..20], &dst, "{ctx}: IPv4 destination address");
    let total = u16::from_be_bytes([ip[2], ip[3]]) as usize;
    assert_eq!(total, 20 + 8 + udp_payload_len, "{ctx}: IPv4 total length");
    let mut sum: u32 = 0;
    for c in ip.chunks(2) {
        sum += u32::from(u16::from_be_bytes([c[0], c[1]]));
    }
    while sum > 0xFFFF {
        sum = (sum & 0xFFFF) + (sum >> 16);
    }
    assert_eq!(sum, 0xFFFF, "{ctx}: IPv4 header checksum");
}

#[test]
fn ud_send_and_send_with_imm() {
    let mut w = World::two(33);
    let cfg = QpCfg::ud();
    let a = w.new_ep(0, &cfg);
    let b = w.new_ep(1, &cfg);
    w.ud_ready(&a, &cfg, 0x100);
    w.ud_ready(&b, &cfg, 0x200);
    let ah = w.ah(0, a.pd, 1);
    let port_mtu = w.nic(0).port_attr(1).unwrap().active_mtu.bytes();
    let src = w.mr(0, a.pd, port_mtu, LW, 0);
    let buf_len = 40 + port_mtu + 16;
    let dst = w.mr(1, b.pd, buf_len, LW, 0xEE);
    let mut id = 0u64;
    for with_imm in [false, true] {
        for len in [0usize, 1, 255, port_mtu] {
            for own_qkey in [false, true] {
                id += 1;
                let ctx = format!("UD SEND imm={with_imm} len {len} own_qkey={own_qkey}");
                let data = pattern(id + 300, len);
                src.write(0, &data);
                dst.write(0, &vec![0xEE; buf_len]);
                w.post_recv(&b, rwr(100 + id, vec![dst.sge(0, buf_len)]));
                let imm = 0x0D0D_0000 | id as u32;
                let op = if with_imm {
                    SendOp::SendWithImm { imm }
                } else {
                    SendOp::Send
                };
                let mut s = wr(id, op, sgl(&src, 0, len));
                // High bit set: the sending QP's own Q_Key is used (equal to B's here).
                let remote_qkey = if own_qkey { 0x8000_0000 } else { cfg.qkey };
                s.ud = Some(UdDest {
                    ah,
                    remote_qpn: b.qpn,
                    remote_qkey,
                });
                w.post_send(&a, s);
                check_send_wc(
                    &w.expect_wc(0, a.scq),
                    &send_wc(&a, id, WcOpcode::Send, len),
                    &ctx,
                );
                let r = w.expect_wc(1, b.rcq);
                let mut flags = WcFlags::GRH;
                if with_imm {
                    flags |= WcFlags::WITH_IMM;
                }
                let exp = WorkCompletion {
                    wr_id: 100 + id,
                    status: WcStatus::Success,
                    opcode: WcOpcode::Recv,
                    vendor_err: 0,
                    byte_len: (40 + len) as u32,
                    imm_data: if with_imm { imm } else { 0 },
                    qp_num: b.qpn,
                    src_qp: a.qpn,
                    wc_flags: flags,
                    pkey_index: 0,
                    slid: 0,
                    // RoCE v2 over IPv4, where Mellanox devices report the packet type.
                    sl: 0xA,
                    dlid_path_bits: 0,
                    timestamp: None,
                };
                assert_eq!(r, exp, "{ctx}: UD receive completion");
                let udp_len = 12 + 8 + if with_imm { 4 } else { 0 } + len + wire::pad_len(len) + 4;
                check_ipv4_grh(
                    &dst.read(0, 40),
                    [10, 0, 0, 1],
                    [10, 0, 0, 2],
                    udp_len,
                    &ctx,
                );
                assert_bytes(&dst.read(40, len), &data, &ctx);
                assert_all(
                    &dst.read(40 + len, buf_len - 40 - len),
                    0xEE,
                    &format!("{ctx}: after"),
                );
            }
        }
    }
    w.expect_no_wc(0, a.scq, "UD sender");
    w.expect_no_wc(1, b.rcq, "UD receiver");
}

#[test]
fn srq_shared_by_several_qps() {
    let mut w = World::two(34);
    let cfg = QpCfg::rc();
    let bpd = w.pd(1);
    let srq = w.nic(1).create_srq(bpd, 64, 2, 0).expect("create_srq");
    let bscq = w.cq(1, 64);
    let brcq = w.cq(1, 64);
    let b1 = w.create_qp(1, bpd, bscq, brcq, Some(srq), &cfg);
    let b2 = w.create_qp(1, bpd, bscq, brcq, Some(srq), &cfg);
    let a1 = w.new_ep(0, &cfg);
    let a2 = w.new_ep(0, &cfg);
    w.connect(&a1, &cfg, 0x10, &b1, &cfg, 0x20);
    w.connect(&a2, &cfg, 0x30, &b2, &cfg, 0x40);
    let slots = w.mr(1, bpd, 128 * 6, LW, 0xEE);
    for k in 0..6u64 {
        w.post_srq_recv(1, srq, rwr(100 + k, vec![slots.sge(k as usize * 128, 128)]));
    }
    let s1 = w.mr(0, a1.pd, 128, LW, 0);
    let s2 = w.mr(0, a2.pd, 128, LW, 0);
    for k in 0..6u64 {
        let (a, s, b) = if k % 2 == 0 {
            (&a1, &s1, &b1)
        } else {
            (&a2, &s2, &b2)
        };
        let len = 50 + k as usize;
        let data = pattern(k + 900, len);
        s.write(0, &data);
        w.post_send(a, wr(k, SendOp::Send, vec![s.sge(0, len)]));
        check_send_wc(
            &w.expect_wc(0, a.scq),
            &send_wc(a, k, WcOpcode::Send, len),
            "SRQ sender",
        );
        let r = w.expect_wc(1, brcq);
        let ctx = format!("SRQ receive {k}");
        check_recv_wc(
            &r,
            &recv_wc(b, 100 + k, WcOpcode::Recv, len, None, None),
            a.qpn,
            &ctx,
        );
        assert_bytes(&slots.read(k as usize * 128, len), &data, &ctx);
        assert_all(&slots.read(k as usize * 128 + len, 128 - len), 0xEE, &ctx);
    }
    w.expect_no_wc(1, brcq, "SRQ receiver");
}

#[test]
fn srq_limit_async_event() {
    let mut w = World::two(35);
    let cfg = QpCfg::rc();
    let bpd = w.pd(1);
    let srq = w.nic(1).create_srq(bpd, 16, 1, 0).expect("create_srq");
    let bscq = w.cq(1, 64);
    let brcq = w.cq(1, 64);
    let b = w.create_qp(1, bpd, bscq, brcq, Some(srq), &cfg);
    let a = w.new_ep(0, &cfg);
    w.connect(&a, &cfg, 1, &b, &cfg, 2);
    let slots = w.mr(1, bpd, 64 * 8, LW, 0);
    for k in 0..8u64 {
        w.post_srq_recv(1, srq, rwr(k, vec![slots.sge(k as usize * 64, 64)]));
    }
    w.nic(1)
        .modify_srq(srq, None, Some(6))
        .expect("arm the SRQ limit");
    w.events(1);
    let src = w.mr(0, a.pd, 64, LW, 0);
    for k in 0..4u64 {
        w.post_send(&a, wr(k, SendOp::Send, vec![src.sge(0, 4)]));
        check_send_wc(
            &w.expect_wc(0, a.scq),
            &send_wc(&a, k, WcOpcode::Send, 4),
            "sender",
        );
        let r = w.expect_wc(1, brcq);
        check_recv_wc(
            &r,
            &recv_wc(&b, k, WcOpcode::Recv, 4, None, None),
            a.qpn,
            "SRQ receive",
        );
        let left = 8 - (k + 1);
        let fired = w
            .events(1)
            .into_iter()
            .filter(|e| *e == AsyncEvent::SrqLimitReached(srq))
            .count();
        // Fires once, when fewer than `limit` (6) WRs are left, then disarms.
        let exp = usize::from(left == 5);
        assert_eq!(
            fired,
            exp,
            "SrqLimitReached events after {} receives ({left} left)",
            k + 1
        );
        if left <= 5 {
            assert_eq!(
                w.nic(1).query_srq(srq).unwrap().2,
                0,
                "the limit disarms after firing"
            );
        }
    }
}
