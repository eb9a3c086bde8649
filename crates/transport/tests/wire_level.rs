//! Wire-level checks through the sim: every packet parses, carries the ICRC, the
//! default P_Key, the rxe UDP source port of its QP; AckReq on the last packet of each
//! request; PSNs consecutive across the 24-bit wrap.

use common::*;
use softrdma_testkit as common;

use wire::Opcode as Op;

const LW: Access = Access::LOCAL_WRITE;

fn all_remote() -> Access {
    Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC
}

/// Every captured Tx packet of device `d`: parsed, with the generic checks applied.
fn parsed_tx(
    log: &[Cap],
    from_qpn: Qpn,
    to_qpn: Qpn,
    src: SocketAddrPair,
) -> Vec<(wire::Headers, Vec<u8>)> {
    log.iter()
        .filter(|c| c.dir == Dir::Tx)
        .map(|c| {
            let p = &c.pkt;
            assert_eq!(p.src.ip(), src.0.ip(), "source IP");
            assert_eq!(p.dst, src.1, "destination address and port 4791");
            assert_eq!(
                p.src.port(),
                wire::udp_src_port(from_qpn),
                "UDP source port of QP {from_qpn:#x}"
            );
            assert!(
                wire::icrc::verify(&wire::Addrs::new(p.src, p.dst), &p.data),
                "ICRC of a packet from QP {from_qpn:#x}"
            );
            let (h, payload) = parse(p);
            assert_eq!(h.bth.pkey, 0xFFFF, "P_Key");
            assert_eq!(h.bth.tver, 0, "transport version");
            assert_eq!(h.bth.dest_qp, to_qpn, "destination QP");
            (h, payload)
        })
        .collect()
}

type SocketAddrPair = (std::net::SocketAddr, std::net::SocketAddr);

fn is_last(op: Op) -> bool {
    matches!(
        op.info().map(|i| i.position),
        Some(wire::Position::Last) | Some(wire::Position::Only)
    )
}

#[test]
fn wire_rc_requests_and_responses() {
    let mut w = World::two(91);
    let cfg = QpCfg::rc().with_mtu(Mtu::Mtu256);
    let start = 0xFF_FFFC;
    let (a, b) = w.pair_psn(&cfg, &cfg, start, 0x77);
    w.capture(0);
    w.capture(1);
    let src = w.mr(0, a.pd, 4096, all_remote(), 0);
    src.write(0, &pattern(1, 4096));
    let t = w.mr(1, b.pd, 4096, all_remote(), 0);
    let rb = w.mr(1, b.pd, 1024, LW, 0);
    w.post_recv(&b, rwr(1, vec![rb.sge(0, 1024)]));
    w.post_recv(&b, rwr(2, vec![rb.sge(0, 1024)]));
    // SEND 600 (3 packets), WRITE 512 (2), READ 700 (3 response PSNs), FAA, SEND_IMM 10.
    w.post_send(&a, wr(1, SendOp::Send, vec![src.sge(0, 600)]));
    w.post_send(
        &a,
        wr(
            2,
            SendOp::Write {
                remote_addr: t.va(0),
                rkey: t.rkey(),
            },
            vec![src.sge(0, 512)],
        ),
    );
    w.post_send(
        &a,
        wr(
            3,
            SendOp::Read {
                remote_addr: t.va(0),
                rkey: t.rkey(),
            },
            vec![src.sge(1024, 700)],
        ),
    );
    w.post_send(
        &a,
        wr(
            4,
            SendOp::FetchAdd {
                remote_addr: t.va(2048),
                rkey: t.rkey(),
                add: 3,
            },
            vec![src.sge(2048, 8)],
        ),
    );
    w.post_send(
        &a,
        wr(
            5,
            SendOp::SendWithImm { imm: 0x0102_0304 },
            vec![src.sge(0, 10)],
        ),
    );
    let c = w.expect_wcs(0, a.scq, 5);
    assert!(c.iter().all(|c| c.status == WcStatus::Success), "{c:#?}");
    w.settle();
    let a_tx = parsed_tx(&w.take_log(0), a.qpn, b.qpn, (dev_addr(0), dev_addr(1)));
    let b_tx = parsed_tx(&w.take_log(1), b.qpn, a.qpn, (dev_addr(1), dev_addr(0)));
    let p = |n: u32| wire::psn::add(start, n);
    let expected: Vec<(Op, u32, usize)> = vec![
        (Op::RC_SEND_FIRST, p(0), 256),
        (Op::RC_SEND_MIDDLE, p(1), 256),
        (Op::RC_SEND_LAST, p(2), 88),
        (Op::RC_RDMA_WRITE_FIRST, p(3), 256),
        (Op::RC_RDMA_WRITE_LAST, p(4), 256),
        (Op::RC_RDMA_READ_REQUEST, p(5), 0),
        (Op::RC_FETCH_ADD, p(8), 0),
        (Op::RC_SEND_ONLY_IMM, p(9), 10),
    ];
    let got: Vec<(Op, u32, usize)> = a_tx
        .iter()
        .map(|(h, pl)| (h.bth.opcode, h.bth.psn, pl.len()))
        .collect();
    assert_eq!(got, expected, "requester packets (opcode, PSN across the wrap, payload length), no faults so no retransmission");
    for (h, _) in &a_tx {
        if is_last(h.bth.opcode) {
            assert!(
                h.bth.ack_req,
                "AckReq on the last packet of a request: {h:?}"
            );
        }
    }
    let (hw, _) = &a_tx[3];
    let reth = hw.reth.expect("WRITE_FIRST carries a RETH");
    assert_eq!(
        (reth.va, reth.rkey, reth.dma_len),
        (t.va(0), t.rkey(), 512),
        "RETH of the WRITE"
    );
    let (hr, _) = &a_tx[5];
    let reth = hr.reth.expect("READ request carries a RETH");
    assert_eq!(
        (reth.va, reth.rkey, reth.dma_len),
        (t.va(0), t.rkey(), 700),
        "RETH of the READ"
    );
    let (hf, _) = &a_tx[6];
    let at = hf.atomic_eth.expect("FETCH_ADD carries an AtomicETH");
    assert_eq!(
        (at.va, at.rkey, at.swap_add),
        (t.va(2048), t.rkey(), 3),
        "AtomicETH"
    );
    assert_eq!(
        a_tx[7].0.imm,
        Some(0x0102_0304),
        "ImmDt on the wire (big-endian of the host value)"
    );
    // Responses: READ responses at the READ's PSNs, the atomic ACK at its PSN, ACKs
    // never beyond the last request PSN.
    let reads: Vec<(Op, u32, usize)> = b_tx
        .iter()
        .filter(|(h, _)| {
            h.bth
                .opcode
                .info()
                .is_some_and(|i| i.kind == wire::OpKind::ReadResponse)
        })
        .map(|(h, pl)| (h.bth.opcode, h.bth.psn, pl.len()))
        .collect();
    assert_eq!(
        reads,
        vec![
            (Op::RC_RDMA_READ_RESPONSE_FIRST, p(5), 256),
            (Op::RC_RDMA_READ_RESPONSE_MIDDLE, p(6), 256),
            (Op::RC_RDMA_READ_RESPONSE_LAST, p(7), 188),
        ],
        "READ responses"
    );
    let atomic: Vec<u32> = b_tx
        .iter()
        .filter(|(h, _)| h.bth.opcode == Op::RC_ATOMIC_ACKNOWLEDGE)
        .map(|(h, _)| h.bth.psn)
        .collect();
    assert_eq!(atomic, vec![p(8)], "one atomic ACK at the FAA's PSN");
    for (h, _) in &b_tx {
        assert!(
            !h.bth.opcode.info().unwrap().is_request,
            "B only responds: {h:?}"
        );
        assert!(
            wire::psn::le(h.bth.psn, p(9)),
            "response PSN beyond the last request: {h:?}"
        );
        if h.bth.opcode == Op::RC_ACKNOWLEDGE {
            let aeth = h.aeth.expect("ACK carries an AETH");
            assert!(
                matches!(aeth.syndrome, wire::Syndrome::Ack { .. }),
                "only positive ACKs: {h:?}"
            );
        }
    }
    assert!(
        b_tx.iter()
            .any(|(h, _)| h.bth.opcode == Op::RC_ACKNOWLEDGE && h.bth.psn == p(9)),
        "the last SEND is acknowledged"
    );
}

#[test]
fn wire_uc_and_ud_packets() {
    let mut w = World::two(92);
    let cfg = QpCfg::uc().with_mtu(Mtu::Mtu256);
    let (a, b) = w.pair_psn(&cfg, &cfg, 0xFF_FFFF, 3);
    w.capture(0);
    let src = w.mr(0, a.pd, 1024, LW, 0);
    let t = w.mr(1, b.pd, 1024, LW | Access::REMOTE_WRITE, 0);
    w.post_send(
        &a,
        wr(
            1,
            SendOp::Write {
                remote_addr: t.va(0),
                rkey: t.rkey(),
            },
            vec![src.sge(0, 300)],
        ),
    );
    assert_eq!(w.expect_wc(0, a.scq).status, WcStatus::Success);
    w.settle();
    let tx = parsed_tx(&w.take_log(0), a.qpn, b.qpn, (dev_addr(0), dev_addr(1)));
    let got: Vec<(Op, u32, bool)> = tx
        .iter()
        .map(|(h, _)| (h.bth.opcode, h.bth.psn, h.bth.ack_req))
        .collect();
    assert_eq!(
        got.iter().map(|g| (g.0, g.1)).collect::<Vec<_>>(),
        vec![
            (Op::UC_RDMA_WRITE_FIRST, 0xFF_FFFF),
            (Op::UC_RDMA_WRITE_LAST, 0)
        ],
        "UC WRITE packets across the wrap"
    );

    let cfg = QpCfg::ud();
    let mut w = World::two(93);
    let a = w.new_ep(0, &cfg);
    let b = w.new_ep(1, &cfg);
    w.ud_ready(&a, &cfg, 0xFF_FFFF);
    w.ud_ready(&b, &cfg, 0);
    let ah = w.ah(0, a.pd, 1);
    w.capture(0);
    let src = w.mr(0, a.pd, 64, LW, 0);
    let rb = w.mr(1, b.pd, 256, LW, 0);
    for i in 0..2u64 {
        w.post_recv(&b, rwr(i, vec![rb.sge(0, 256)]));
        let mut s = wr(i, SendOp::SendWithImm { imm: 9 }, vec![src.sge(0, 33)]);
        s.ud = Some(UdDest {
            ah,
            remote_qpn: b.qpn,
            remote_qkey: cfg.qkey,
        });
        w.post_send(&a, s);
        assert_eq!(w.expect_wc(0, a.scq).status, WcStatus::Success);
        assert_eq!(w.expect_wc(1, b.rcq).status, WcStatus::Success);
    }
    let tx = parsed_tx(&w.take_log(0), a.qpn, b.qpn, (dev_addr(0), dev_addr(1)));
    assert_eq!(tx.len(), 2, "two datagrams");
    for (i, (h, pl)) in tx.iter().enumerate() {
        assert_eq!(h.bth.opcode, Op::UD_SEND_ONLY_IMM);
        assert_eq!(
            h.bth.psn,
            wire::psn::add(0xFF_FFFF, i as u32),
            "UD PSNs increment and wrap"
        );
        let deth = h.deth.expect("UD carries a DETH");
        assert_eq!((deth.qkey, deth.src_qp), (cfg.qkey, a.qpn), "DETH");
        assert_eq!(pl.len(), 33);
        assert_eq!(h.imm, Some(9));
    }
}
