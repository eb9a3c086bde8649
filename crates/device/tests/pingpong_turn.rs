//! A ping-pong turn leaves at once: what UCX's tag_lat (and every latency benchmark) does
//! over RC. Each side polls its CQ from the application thread until the peer's SEND has
//! arrived (the ACK it makes for it is held back, to leave with the next datagram), then
//! posts its reply. The reply goes into an idle pipe (its previous SEND was acknowledged
//! before the peer's reply arrived), so the post must send the reply and the held ACK
//! before it returns: nothing may wait for the ACK-deferral deadline, the progress thread
//! or the retransmission timer. Asserted with the device's datagram counter right after
//! each post, over real loopback UDP; no wait is timed.

mod rc;

use std::time::{Duration, Instant};

use softrdma_device::verbs::{
    Access, Qpn, RecvWr, SendFlags, SendOp, WcOpcode, WcStatus, WorkCompletion,
};

/// Bytes per message, as `ucx_perftest -t tag_lat -s 8` sends (with UCX's header).
const LEN: usize = 16;
/// Round trips.
const ROUNDS: u64 = 50;

/// An RC QP, its CQ (sends unsignaled, as UCX posts them) and a registered buffer: the
/// first half receives, the second half sends.
struct Side {
    host: rc::Host,
    qpn: Qpn,
}

impl Side {
    fn new(name: &str) -> Side {
        let host = rc::Host::new(name, 2 * LEN, 0, 64, Access::LOCAL_WRITE);
        let qpn = host.rc_qp(16);
        Side { host, qpn }
    }

    fn connect(&self, peer: &Side) {
        let to = rc::Peer::at(peer.host.dev.gid(), peer.qpn, 0);
        self.host.connect(self.qpn, &rc::cfg(), &to, 0);
    }

    fn post_recv(&self) {
        let wr = RecvWr {
            wr_id: 1,
            sg_list: vec![self.host.sge(0, LEN)],
        };
        let qpn = self.qpn;
        self.host.dev.post_recv(qpn, wr).unwrap();
    }

    /// Post one unsignaled SEND through the posting path (`Device::post_send`).
    fn post_send(&self) {
        let sge = self.host.sge(LEN, LEN);
        self.host
            .post_send(self.qpn, 2, SendOp::Send, SendFlags::empty(), sge);
    }

    /// Poll from this thread, as a busy-polling application does, until the peer's SEND
    /// is received. The bound only keeps a broken build from hanging.
    fn poll_recv(&self) -> WorkCompletion {
        let until = Instant::now() + Duration::from_secs(20);
        let mut wc = [WorkCompletion::default(); 4];
        loop {
            let n = self.host.cq.poll(&self.host.dev, &mut wc).unwrap();
            if n > 0 {
                assert_eq!(n, 1, "one completion per turn: {:?}", &wc[..n]);
                return wc[0];
            }
            assert!(Instant::now() < until, "the peer's SEND never arrived");
        }
    }

    fn sent(&self) -> u64 {
        self.host.dev.stats().link.tx_datagrams
    }
}

#[test]
fn each_turn_of_a_ping_pong_leaves_when_it_is_posted_with_the_held_ack() {
    let a = Side::new("turn-a");
    let b = Side::new("turn-b");
    a.connect(&b);
    b.connect(&a);
    a.post_recv();
    b.post_recv();
    // a's first request: a SEND into an idle pipe, nothing to acknowledge yet.
    a.post_send();
    assert_eq!(a.sent(), 1, "the first request left when it was posted");
    for k in 1..=ROUNDS {
        let wc = b.poll_recv();
        assert_eq!((wc.status, wc.opcode), (WcStatus::Success, WcOpcode::Recv));
        b.post_recv();
        b.post_send();
        // b has sent, per round, the ACK of a's request and its reply: all of them by
        // now, whether the ACK was held back for the reply or not.
        assert_eq!(
            b.sent(),
            2 * k,
            "round {k}: b's reply and ACK left with the post"
        );

        let wc = a.poll_recv();
        assert_eq!((wc.status, wc.opcode), (WcStatus::Success, WcOpcode::Recv));
        if k == ROUNDS {
            break;
        }
        a.post_recv();
        a.post_send();
        assert_eq!(
            a.sent(),
            2 * k + 1,
            "round {k}: a's request and ACK left with the post"
        );
    }
    // Nothing was lost or retransmitted on the way: every datagram counted above is one
    // the protocol needed.
    for s in [&a, &b] {
        let e = s.host.dev.stats().engine;
        assert_eq!(e.retransmits, 0, "{}: {e:?}", s.host.dev.name());
    }
}
