//! The IB CM state machine between two devices on the `sim` network, under loss,
//! duplication and reordering, with seeds: every connection is established on both sides
//! exactly once and disconnected on both sides exactly once, whatever is lost (a lost
//! RTU or DREP included); a REQ to a service nobody listens on is rejected with reason 8;
//! a peer that never answers gives ReqError after the retries.

mod common;

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};

use proptest::prelude::*;
use softrdma_cm::ib::{CommId, EventKind, IbCm, Peer, State, MRA_FLAG_DELAY};
use softrdma_net::sim::{Endpoint, Faults, Network, Packet, Sim};
use softrdma_wire::cm::{rej_reason, Rep};

use common::ip;
use softrdma_testkit::cm::{self, cma_req};

/// A REP whose private data the requester checks.
fn rep(qpn: u32, psn: u32) -> Rep {
    Rep {
        private_data: [0xAB; 196],
        ..cm::rep(qpn, psn)
    }
}

const SERVICE: u64 = 0x0106_0000_0000_1234;
const PORT: u16 = 4791;
const SEC: u64 = 1_000_000_000;

/// What one side saw of one connection.
#[derive(Debug, Default, Clone)]
struct Seen {
    established: u32,
    disconnected: u32,
    rejected: Vec<u16>,
    errors: u32,
    timewait_exit: u32,
    /// The peer's QPN as the handshake told us.
    peer_qpn: u32,
}

/// A device's CM plus a consumer that behaves as rdma_cm does: MRA (delayed) every REQ
/// and REP, accept every REQ, RTU every REP, DREP every DREQ.
struct Node {
    ip: IpAddr,
    cm: IbCm,
    seen: HashMap<CommId, Seen>,
    /// QPN of the first QP; each accepted connection takes the next.
    qpn: u32,
    accepted: u32,
}

impl Node {
    fn new(x: u8, seed: u64) -> Node {
        Node {
            ip: ip(x),
            cm: IbCm::new(0x0002_c9ff_fe00_0000 | u64::from(x), 15, seed),
            seen: HashMap::new(),
            qpn: 0x100 * u32::from(x),
            accepted: 0,
        }
    }

    fn react(&mut self, now: u64) {
        while let Some(ev) = self.cm.poll_event() {
            let s = self.seen.entry(ev.id).or_default();
            match ev.kind {
                EventKind::ReqReceived { req, .. } => {
                    s.peer_qpn = req.local_qpn;
                    self.cm
                        .send_mra(now, ev.id, MRA_FLAG_DELAY | 24, &[])
                        .unwrap();
                    let qpn = self.qpn + self.accepted;
                    self.accepted += 1;
                    self.cm.send_rep(now, ev.id, rep(qpn, 0x55)).unwrap();
                }
                EventKind::RepReceived(r) => {
                    s.peer_qpn = r.local_qpn;
                    assert_eq!(r.private_data, [0xAB; 196]);
                    self.cm
                        .send_mra(now, ev.id, MRA_FLAG_DELAY | 24, &[])
                        .unwrap();
                    self.cm.send_rtu(now, ev.id, &[]).unwrap();
                    s.established += 1;
                }
                EventKind::RtuReceived(_) | EventKind::UserEstablished => s.established += 1,
                EventKind::DreqReceived(_) => {
                    s.disconnected += 1;
                    self.cm.send_drep(now, ev.id, &[]).unwrap();
                }
                EventKind::DrepReceived(_) | EventKind::DreqError => s.disconnected += 1,
                EventKind::RejReceived(r) => s.rejected.push(r.reason),
                EventKind::ReqError | EventKind::RepError | EventKind::SidrReqError => {
                    s.errors += 1
                }
                EventKind::TimewaitExit => s.timewait_exit += 1,
                EventKind::SidrReqReceived { .. } | EventKind::SidrRepReceived(_) => {}
            }
        }
    }
}

impl Endpoint for Node {
    fn addr(&self) -> SocketAddr {
        SocketAddr::new(self.ip, PORT)
    }
    fn handle_packet(&mut self, now: u64, pkt: Packet) {
        self.cm.handle_mad(now, Peer::gsi(pkt.src.ip()), &pkt.data);
        self.react(now);
    }
    fn poll_transmit(&mut self, _now: u64) -> Option<Packet> {
        let (to, mad) = self.cm.poll_transmit()?;
        Some(Packet {
            src: SocketAddr::new(self.ip, PORT),
            dst: SocketAddr::new(to.ip, PORT),
            tos: 0,
            data: mad.to_vec(),
        })
    }
    fn poll_timeout(&self) -> Option<u64> {
        self.cm.poll_timeout()
    }
    fn handle_timeout(&mut self, now: u64) {
        self.cm.handle_timeout(now);
        self.react(now);
    }
}

fn faults(loss: f64, dup: f64, reorder: f64) -> Faults {
    Faults {
        loss,
        duplicate: dup,
        reorder,
        delay_ns: 50_000,
        jitter_ns: 20_000,
        reorder_extra_ns: 2_000_000,
        ..Faults::default()
    }
}

/// Connect `n` times from node 0 to node 1, then disconnect every connection from
/// `disconnect_from_passive` ? node 1 : node 0, and check what both sides saw.
fn connect_and_disconnect(seed: u64, f: Faults, n: usize, from_passive: bool) {
    let mut sim = Sim::new(Network::new(seed, f));
    sim.add(Node::new(1, seed ^ 1));
    sim.add(Node::new(2, seed ^ 2));
    sim.endpoints[1].cm.listen(SERVICE).unwrap();
    let mut ids = Vec::new();
    for i in 0..n {
        let now = sim.now;
        let a = &mut sim.endpoints[0];
        let r = cma_req(SERVICE, a.qpn + i as u32, 0x1000, ip(1), ip(2));
        ids.push(a.cm.send_req(now, Peer::gsi(ip(2)), r, 16));
    }
    let all_established = |s: &mut Sim<Node>| {
        let a: u32 = s.endpoints[0].seen.values().map(|x| x.established).sum();
        let b: u32 = s.endpoints[1].seen.values().map(|x| x.established).sum();
        a as usize == n && b as usize == n
    };
    assert!(
        sim.run_until(3600 * SEC, all_established),
        "seed {seed:#x}: not every connection established: {:?} / {:?}",
        sim.endpoints[0].seen,
        sim.endpoints[1].seen
    );
    // Each active connection knows the passive QPN and the other way round.
    let b = &sim.endpoints[1];
    for id in &ids {
        let qpn = sim.endpoints[0].seen[id].peer_qpn;
        assert!((b.qpn..b.qpn + n as u32).contains(&qpn));
        assert_eq!(sim.endpoints[0].cm.state(*id), Some(State::Established));
    }
    let who = usize::from(from_passive);
    let now = sim.now;
    let targets: Vec<CommId> = sim.endpoints[who].seen.keys().copied().collect();
    for id in targets {
        // The passive side may not have the RTU yet (REP_SENT): only established ones
        // may send a DREQ, so wait for that first.
        let _ = sim.endpoints[who].cm.send_dreq(now, id, &[]);
    }
    let all_disconnected = |s: &mut Sim<Node>| {
        let a: u32 = s.endpoints[0].seen.values().map(|x| x.disconnected).sum();
        let b: u32 = s.endpoints[1].seen.values().map(|x| x.disconnected).sum();
        a as usize == n && b as usize == n
    };
    assert!(
        sim.run_until(3600 * SEC, all_disconnected),
        "seed {seed:#x}: not every connection disconnected: {:?} / {:?}",
        sim.endpoints[0].seen,
        sim.endpoints[1].seen
    );
    // Timewait ends and nothing is left pending.
    assert!(sim.run_to_idle(7200 * SEC), "seed {seed:#x}: never idle");
    for node in &sim.endpoints {
        for (id, s) in &node.seen {
            assert_eq!(s.established, 1, "seed {seed:#x} id {id:#x}: {s:?}");
            assert_eq!(s.disconnected, 1, "seed {seed:#x} id {id:#x}: {s:?}");
            assert!(
                s.rejected.is_empty() && s.errors == 0,
                "seed {seed:#x}: {s:?}"
            );
            assert_eq!(s.timewait_exit, 1, "seed {seed:#x} id {id:#x}: {s:?}");
            assert_eq!(node.cm.state(*id), Some(State::Idle));
        }
    }
}

/// Node 0 (127.0.0.1) has sent a REQ to node 1 (127.0.0.2), which listens: the start of
/// the handshake tests on a perfect link. Returns the simulation and the REQ's connection.
fn req_sent(seed: u64) -> (Sim<Node>, CommId) {
    let mut sim = Sim::new(Network::new(seed, faults(0.0, 0.0, 0.0)));
    sim.add(Node::new(1, seed ^ 1));
    sim.add(Node::new(2, seed ^ 2));
    sim.endpoints[1].cm.listen(SERVICE).unwrap();
    let r = cma_req(SERVICE, 0x100, 1, ip(1), ip(2));
    let id = sim.endpoints[0].cm.send_req(0, Peer::gsi(ip(2)), r, 16);
    (sim, id)
}

#[test]
fn connect_and_disconnect_on_a_perfect_link() {
    connect_and_disconnect(1, faults(0.0, 0.0, 0.0), 3, false);
    connect_and_disconnect(2, faults(0.0, 0.0, 0.0), 3, true);
}

#[test]
fn lossless_handshake_is_three_mads_and_disconnect_two() {
    let (mut sim, id) = req_sent(7);
    sim.run_until(SEC, |s| {
        s.endpoints[1].seen.values().any(|x| x.established == 1)
    });
    let now = sim.now;
    sim.endpoints[0].cm.send_dreq(now, id, b"bye").unwrap();
    assert!(sim.run_to_idle(100 * SEC));
    // REQ, REP, RTU, DREQ, DREP: a held MRA is never sent on a clean link.
    assert_eq!(sim.endpoints[0].cm.stats().tx, 3);
    assert_eq!(sim.endpoints[1].cm.stats().tx, 2);
    assert_eq!(sim.endpoints[0].cm.stats().retransmits, 0);
}

#[test]
fn a_lost_rtu_is_recovered_by_the_rep_retransmission() {
    let (mut sim, _) = req_sent(3);
    // Cut the link from the active side once its RTU is queued: step until the active
    // side is established, then drop what it sends next (the RTU).
    sim.run_until(SEC, |s| {
        s.endpoints[0].seen.values().any(|x| x.established == 1)
    });
    sim.net.partition(ip(1), ip(2));
    sim.step();
    sim.net.heal_all();
    assert!(sim.run_until(3600 * SEC, |s| s.endpoints[1]
        .seen
        .values()
        .any(|x| x.established == 1)));
    // The passive side sent its REP again and the active side answered with the RTU.
    assert!(sim.endpoints[1].cm.stats().retransmits >= 1);
    assert!(sim.endpoints[0].cm.stats().duplicates >= 1);
}

#[test]
fn a_lost_drep_does_not_leave_the_requester_waiting_out_its_retries() {
    let (mut sim, id) = req_sent(4);
    sim.run_until(SEC, |s| {
        s.endpoints[1].seen.values().any(|x| x.established == 1)
    });
    let now = sim.now;
    sim.endpoints[0].cm.send_dreq(now, id, &[]).unwrap();
    // Deliver the DREQ, lose the DREP.
    sim.run_until(SEC + now, |s| {
        s.endpoints[1].seen.values().any(|x| x.disconnected == 1)
    });
    sim.net.partition(ip(1), ip(2));
    sim.step();
    sim.net.heal_all();
    // The passive side may even forget the connection: a DREQ it no longer knows still
    // gets a DREP.
    let pid = *sim.endpoints[1].seen.keys().next().unwrap();
    let now = sim.now;
    sim.endpoints[1].cm.destroy(now, pid);
    assert!(sim.run_until(3600 * SEC, |s| s.endpoints[0].seen[&id].disconnected == 1));
    // One DREQ retransmission, not fifteen.
    assert_eq!(sim.endpoints[0].cm.stats().retransmits, 1);
    assert!(sim.endpoints[0].seen[&id].errors == 0);
}

#[test]
fn nobody_listening_is_reject_reason_8() {
    let mut sim = Sim::new(Network::new(5, faults(0.0, 0.0, 0.0)));
    sim.add(Node::new(1, 41));
    sim.add(Node::new(2, 42));
    let r = cma_req(SERVICE, 0x100, 1, ip(1), ip(2));
    let id = sim.endpoints[0].cm.send_req(0, Peer::gsi(ip(2)), r, 16);
    assert!(sim.run_to_idle(100 * SEC));
    assert_eq!(
        sim.endpoints[0].seen[&id].rejected,
        vec![rej_reason::INVALID_SERVICE_ID]
    );
    assert_eq!(sim.endpoints[0].cm.state(id), Some(State::Idle));
}

#[test]
fn consumer_reject_carries_private_data() {
    let mut sim = Sim::new(Network::new(6, faults(0.0, 0.0, 0.0)));
    sim.add(Node::new(1, 51));
    sim.add(Node::new(2, 52));
    sim.endpoints[1].cm.listen(SERVICE).unwrap();
    let r = cma_req(SERVICE, 0x100, 1, ip(1), ip(2));
    let id = sim.endpoints[0].cm.send_req(0, Peer::gsi(ip(2)), r, 16);
    // Deliver the REQ to node 1 without its automatic accept: take the event by hand.
    sim.net.send(
        0,
        Endpoint::poll_transmit(&mut sim.endpoints[0], 0).unwrap(),
    );
    let pkt = sim.net.pop_due(SEC).unwrap();
    let b = &mut sim.endpoints[1];
    b.cm.handle_mad(SEC, Peer::gsi(ip(1)), &pkt.data);
    let ev = b.cm.poll_event().unwrap();
    assert!(matches!(ev.kind, EventKind::ReqReceived { .. }));
    b.cm.send_rej(SEC, ev.id, rej_reason::CONSUMER_REJECT, &[], b"not today")
        .unwrap();
    assert_eq!(b.cm.state(ev.id), Some(State::Idle));
    assert!(sim.run_to_idle(100 * SEC));
    let s = &sim.endpoints[0].seen[&id];
    assert_eq!(s.rejected, vec![rej_reason::CONSUMER_REJECT]);
}

#[test]
fn an_unanswered_req_ends_in_req_error_after_every_retry() {
    let mut sim = Sim::new(Network::new(8, faults(0.0, 0.0, 0.0)));
    sim.add(Node::new(1, 61));
    // Nothing at 127.0.0.9.
    let mut r = cma_req(SERVICE, 0x100, 1, ip(1), ip(9));
    r.max_cm_retries = 3;
    r.remote_cm_response_timeout = 12; // 16 ms
    let id = sim.endpoints[0].cm.send_req(0, Peer::gsi(ip(9)), r, 10); // 4 ms lifetime
    assert!(sim.run_to_idle(100 * SEC));
    assert_eq!(sim.endpoints[0].seen[&id].errors, 1);
    assert_eq!(sim.endpoints[0].cm.stats().tx, 4);
    // Response timeout 2 × 4 + 16 = 24 ms, four tries.
    assert_eq!(sim.now, 4 * 24_000_000);
}

#[test]
fn mra_extends_the_wait_for_a_slow_consumer() {
    let mut sim = Sim::new(Network::new(9, faults(0.0, 0.0, 0.0)));
    sim.add(Node::new(1, 71));
    sim.add(Node::new(2, 72));
    sim.endpoints[1].cm.listen(SERVICE).unwrap();
    let mut r = cma_req(SERVICE, 0x100, 1, ip(1), ip(2));
    r.max_cm_retries = 2;
    let id = sim.endpoints[0].cm.send_req(0, Peer::gsi(ip(2)), r, 16);
    // Node 1 gets the REQ but its consumer holds it (a delayed MRA, no REP yet).
    let pkt = Endpoint::poll_transmit(&mut sim.endpoints[0], 0).unwrap();
    let b = &mut sim.endpoints[1];
    b.cm.handle_mad(0, Peer::gsi(ip(1)), &pkt.data);
    let ev = b.cm.poll_event().unwrap();
    b.cm.send_mra(0, ev.id, MRA_FLAG_DELAY | 24, &[]).unwrap();
    // Run 60 s: the REQ is retransmitted once, answered with the MRA, and the active side
    // then waits 2^16 ms instead of giving up after its remaining retry.
    sim.run_until(60 * SEC, |_| false);
    assert_eq!(sim.endpoints[0].cm.state(id), Some(State::MraReqRcvd));
    assert!(sim.endpoints[0].seen.get(&id).is_none_or(|s| s.errors == 0));
    let now = sim.now;
    sim.endpoints[1]
        .cm
        .send_rep(now, ev.id, rep(0x200, 9))
        .unwrap();
    assert!(sim.run_until(120 * SEC, |s| s.endpoints[0]
        .seen
        .get(&id)
        .is_some_and(|x| x.established == 1)));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("SOFTRDMA_PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(24)
    ))]
    /// Under loss, duplication and reordering, every connection is set up and torn down
    /// exactly once on each side, from either side.
    #[test]
    fn handshakes_survive_faults(
        seed in any::<u64>(),
        loss in 0.0f64..0.3,
        dup in 0.0f64..0.3,
        reorder in 0.0f64..0.3,
        n in 1usize..6,
        from_passive in any::<bool>(),
    ) {
        connect_and_disconnect(seed, faults(loss, dup, reorder), n, from_passive);
    }
}
