//! Engine bugs the fuzz harness (`engine_fuzz`) found, each reproduced directly with
//! hand-driven packets, kept as regression tests.

use common::*;
use softrdma_testkit as common;

/// An RC requester retransmitting a multi-packet WQE stops in the middle of it (here at
/// the outbox bound; in the harness at an RNR wait), then an ACK from the first
/// transmission acknowledges that WQE whole and the completer retires it. The requester's
/// position was inside the retired WQE (`ReqState::cur` 0, `offset` past its start), and
/// `complete_front` lowered `cur` with a saturating subtraction that kept it at 0 but
/// left `offset`: the next WQE was resumed at that stale byte offset. A 223-byte WRITE
/// then left as a WRITE_ONLY whose RETH said 223 bytes but which carried none; the
/// responder answered NAK invalid request and the QP failed (REM_INV_REQ_ERR). A longer
/// next WQE would have skipped its first packets instead.
#[test]
fn retiring_the_wqe_being_retransmitted_resets_the_requester_offset() {
    const PKTS: usize = 300;
    const MTU: usize = 256;
    let mut w = World::two(941);
    let cfg = QpCfg::rc().with_mtu(Mtu::Mtu256);
    let (a, b) = w.pair(&cfg);
    let big = PKTS * MTU;
    let src = w.mr(0, a.pd, big, Access::LOCAL_WRITE, 7);
    let recv = w.mr(1, b.pd, big, Access::LOCAL_WRITE, 0);
    let target = w.mr(1, b.pd, 256, Access::LOCAL_WRITE | Access::REMOTE_WRITE, 0);
    w.post_recv(&b, rwr(1, vec![recv.sge(0, big)]));
    w.post_send(&a, wr(1, SendOp::Send, vec![src.sge(0, big)]));
    let write = SendOp::Write {
        remote_addr: target.va(0),
        rkey: target.rkey(),
    };
    w.post_send(&a, wr(2, write, vec![src.sge(0, 223)]));

    // The first transmission: the SEND reaches B, the WRITE is lost; B's ACKs are held.
    let mut now = 0;
    let mut sent = Vec::new();
    while let Some(t) = w.nic(0).poll_transmit(now) {
        sent.push(t);
    }
    assert_eq!(sent.len(), PKTS + 1, "the SEND's packets and the WRITE");
    let mut acks = Vec::new();
    for t in &sent[..PKTS] {
        w.nic(1).handle_datagram(now, t.src, t.dst, &t.data);
        while let Some(r) = w.nic(1).poll_transmit(now) {
            acks.push(r);
        }
    }
    assert!(!acks.is_empty(), "B acknowledges the SEND");

    // A's retransmission timer fires: it goes back to the SEND's first packet and stops
    // at the outbox bound, in the middle of the SEND (nothing is drained yet).
    now = w.nic(0).poll_timeout().expect("A's ACK timer");
    w.nic(0).handle_timeout(now);
    assert!(w.nic(0).queued_packets() > 0, "A retransmits the SEND");

    // The held ACKs arrive: they acknowledge the whole SEND, which completes.
    for r in &acks {
        w.nic(0).handle_datagram(now, r.src, r.dst, &r.data);
    }
    let mut wc = [WorkCompletion::default(); 4];
    let n = w.nic(0).poll_cq(a.scq, &mut wc).expect("poll_cq");
    assert!(
        n == 1 && wc[0].wr_id == 1 && wc[0].status == WcStatus::Success,
        "the SEND completes: {:?}",
        &wc[..n]
    );

    // What A sends next: the WRITE must carry its 223 bytes.
    let mut writes = 0;
    while let Some(t) = w.nic(0).poll_transmit(now) {
        let (h, payload) = parse(&Packet {
            src: t.src,
            dst: t.dst,
            tos: t.tos,
            data: t.data,
        });
        if h.bth.opcode == wire::Opcode::RC_RDMA_WRITE_ONLY {
            writes += 1;
            assert_eq!(
                (h.reth.map(|r| r.dma_len), payload.len()),
                (Some(223), 223),
                "the retransmitted WRITE_ONLY (PSN {:#x}) carries the bytes its RETH announces",
                h.bth.psn
            );
        }
    }
    assert_eq!(writes, 1, "A sends the WRITE once");
}
