//! Tests for the simulated network and driver. Each asserts an observable effect, so
//! that a fault model that silently does nothing fails here.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::rc::Rc;

use proptest::prelude::*;

use super::*;

fn ip(last: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 0, 0, last))
}

fn sa(last: u8) -> SocketAddr {
    SocketAddr::new(ip(last), 4791)
}

/// A packet whose payload starts with its sequence number, so order is observable.
fn pkt(src: u8, dst: u8, seq: u32) -> Packet {
    let mut data = seq.to_be_bytes().to_vec();
    data.extend_from_slice(&[0xAB; 28]);
    Packet {
        src: sa(src),
        dst: sa(dst),
        tos: 0x02,
        data,
    }
}

fn seq_of(p: &Packet) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&p.data[..4]);
    u32::from_be_bytes(b)
}

/// Pop everything, in order, returning (delivery time, packet).
fn drain(net: &mut Network) -> Vec<(u64, Packet)> {
    let mut out = Vec::new();
    while let Some(t) = net.next_delivery() {
        while let Some(p) = net.pop_due(t) {
            out.push((t, p));
        }
    }
    out
}

fn conserved(s: &Stats, in_flight: usize) -> bool {
    s.delivered + s.dropped() + in_flight as u64 == s.sent + s.duplicated + s.multicast_copies
}

fn noisy() -> Faults {
    Faults {
        loss: 0.1,
        duplicate: 0.1,
        reorder: 0.2,
        corrupt: 0.05,
        delay_ns: 2_000,
        jitter_ns: 500,
        reorder_extra_ns: 10_000,
    }
}

fn noisy_run(seed: u64) -> (Vec<(u64, Packet)>, Stats) {
    let mut net = Network::new(seed, noisy());
    for i in 0..2_000u32 {
        net.send(u64::from(i) * 300, pkt(1, 2, i));
    }
    let out = drain(&mut net);
    (out, net.stats().clone())
}

#[test]
fn same_seed_same_run_different_seed_different_run() {
    let (a, sa_) = noisy_run(42);
    let (b, sb) = noisy_run(42);
    assert_eq!(a, b);
    assert_eq!(sa_, sb);
    let (c, _) = noisy_run(43);
    assert_ne!(a, c, "the seed must matter");
}

#[test]
fn perfect_link_delivers_everything_once_in_order() {
    let mut net = Network::new(1, Faults::default());
    let n = 1_000u32;
    // Several packets share a send time, so tie-breaking by send order is exercised.
    for i in 0..n {
        net.send(u64::from(i / 4) * 100, pkt(1, 2, i));
    }
    assert_eq!(net.in_flight(), n as usize);
    assert_eq!(net.next_delivery(), Some(1_000));
    let out = drain(&mut net);
    let seqs: Vec<u32> = out.iter().map(|(_, p)| seq_of(p)).collect();
    assert_eq!(seqs, (0..n).collect::<Vec<_>>());
    for (i, (t, p)) in out.iter().enumerate() {
        assert_eq!(*p, pkt(1, 2, i as u32), "payload and addressing untouched");
        assert_eq!(*t, (i as u64 / 4) * 100 + 1_000, "fixed 1 µs delay");
    }
    let s = net.stats();
    assert_eq!((s.sent, s.delivered), (u64::from(n), u64::from(n)));
    assert_eq!(
        (s.dropped(), s.duplicated, s.reordered, s.corrupted),
        (0, 0, 0, 0)
    );
    assert_eq!(net.in_flight(), 0);
    assert_eq!(net.next_delivery(), None);
}

#[test]
fn pop_due_holds_packets_until_their_time() {
    let mut net = Network::new(1, Faults::default());
    net.send(10, pkt(1, 2, 0));
    assert_eq!(net.pop_due(1_009), None);
    assert_eq!(net.in_flight(), 1);
    assert_eq!(net.pop_due(1_010).map(|p| seq_of(&p)), Some(0));
}

#[test]
fn loss_rate_is_close_to_configured() {
    let p = 0.1;
    let n = 10_000u32;
    let mut net = Network::new(
        7,
        Faults {
            loss: p,
            ..Faults::default()
        },
    );
    for i in 0..n {
        net.send(u64::from(i), pkt(1, 2, i));
    }
    let out = drain(&mut net);
    let s = net.stats();
    let rate = s.dropped_loss as f64 / f64::from(n);
    // Standard deviation is sqrt(p(1-p)/n) = 0.003; allow five of them.
    assert!((rate - p).abs() < 0.015, "loss rate {rate}");
    assert_eq!(out.len() as u64, u64::from(n) - s.dropped_loss);
    assert_eq!(s.delivered, out.len() as u64);
}

#[test]
fn duplicates_are_delivered_and_counted() {
    let n = 2_000u32;
    let mut net = Network::new(
        3,
        Faults {
            duplicate: 0.2,
            jitter_ns: 5_000,
            ..Faults::default()
        },
    );
    for i in 0..n {
        net.send(u64::from(i) * 10_000, pkt(1, 2, i));
    }
    let out = drain(&mut net);
    let s = net.stats().clone();
    assert!(s.duplicated > 300 && s.duplicated < 500, "{}", s.duplicated);
    assert_eq!(out.len() as u64, u64::from(n) + s.duplicated);
    let mut counts = vec![0u32; n as usize];
    for (_, p) in &out {
        counts[seq_of(p) as usize] += 1;
    }
    assert!(counts.iter().all(|&c| c == 1 || c == 2));
    assert_eq!(
        counts.iter().filter(|&&c| c == 2).count() as u64,
        s.duplicated
    );
    // Independent delays: with 5 µs of jitter, some copies must arrive at a different
    // time from their original.
    let mut times: Vec<Vec<u64>> = vec![Vec::new(); n as usize];
    for (t, p) in &out {
        times[seq_of(p) as usize].push(*t);
    }
    assert!(times.iter().any(|v| v.len() == 2 && v[0] != v[1]));
}

#[test]
fn reordering_lets_later_packets_overtake() {
    let n = 1_000u32;
    let mut net = Network::new(
        5,
        Faults {
            reorder: 0.1,
            reorder_extra_ns: 10_000,
            ..Faults::default()
        },
    );
    for i in 0..n {
        net.send(u64::from(i) * 1_000, pkt(1, 2, i));
    }
    let out = drain(&mut net);
    let seqs: Vec<u32> = out.iter().map(|(_, p)| seq_of(p)).collect();
    let inversions = seqs.windows(2).filter(|w| w[0] > w[1]).count();
    assert!(inversions > 20, "only {inversions} inversions");
    let s = net.stats();
    assert!(s.reordered > 50 && s.reordered < 150, "{}", s.reordered);
    let mut sorted = seqs.clone();
    sorted.sort_unstable();
    assert_eq!(
        sorted,
        (0..n).collect::<Vec<_>>(),
        "nothing lost or doubled"
    );
}

#[test]
fn jitter_stays_within_bounds() {
    let f = Faults {
        delay_ns: 1_000,
        jitter_ns: 400,
        ..Faults::default()
    };
    let mut net = Network::new(9, f);
    let mut delays = Vec::new();
    for i in 0..500u32 {
        let now = u64::from(i) * 1_000_000;
        net.send(now, pkt(1, 2, i));
        let t = net.next_delivery().unwrap_or(0);
        assert!(net.pop_due(t).is_some());
        delays.push(t - now);
    }
    assert!(delays.iter().all(|d| (1_000..=1_400).contains(d)));
    assert!(delays.iter().any(|&d| d < 1_100) && delays.iter().any(|&d| d > 1_300));
}

fn bit_diff(a: &[u8], b: &[u8]) -> u32 {
    a.iter().zip(b).map(|(x, y)| (x ^ y).count_ones()).sum()
}

#[test]
fn corruption_flips_one_to_three_bits_and_is_counted() {
    let n = 1_000u32;
    let mut net = Network::new(
        11,
        Faults {
            corrupt: 0.3,
            ..Faults::default()
        },
    );
    for i in 0..n {
        net.send(u64::from(i), pkt(1, 2, i));
    }
    let out = drain(&mut net);
    assert_eq!(out.len(), n as usize);
    let mut changed = 0u64;
    let mut seen = [false; 4];
    for (i, (_, p)) in out.iter().enumerate() {
        let orig = pkt(1, 2, i as u32);
        assert_eq!((p.src, p.dst, p.tos), (orig.src, orig.dst, orig.tos));
        assert_eq!(p.data.len(), orig.data.len());
        let d = bit_diff(&p.data, &orig.data);
        assert!(d <= 3);
        seen[d as usize] = true;
        if d > 0 {
            changed += 1;
        }
    }
    assert_eq!(changed, net.stats().corrupted);
    assert!(changed > 200 && changed < 400, "{changed}");
    assert!(
        seen[1] && seen[2] && seen[3],
        "1, 2 and 3 bit flips all occur"
    );
}

#[test]
fn corruption_reaches_the_whole_payload_and_skips_empty_ones() {
    let mut net = Network::new(
        13,
        Faults {
            corrupt: 1.0,
            ..Faults::default()
        },
    );
    let mut hit = [false; 32];
    for _ in 0..2_000 {
        net.send(0, pkt(1, 2, 0));
        let p = net.pop_due(u64::MAX).unwrap_or_else(|| pkt(1, 2, 0));
        let orig = pkt(1, 2, 0);
        for (k, (a, b)) in p.data.iter().zip(&orig.data).enumerate() {
            hit[k] |= a != b;
        }
    }
    assert!(
        hit.iter().all(|&h| h),
        "every byte position gets corrupted sometimes"
    );
    let before = net.stats().corrupted;
    net.send(
        0,
        Packet {
            data: Vec::new(),
            ..pkt(1, 2, 0)
        },
    );
    assert_eq!(net.pop_due(u64::MAX).map(|p| p.data.len()), Some(0));
    assert_eq!(net.stats().corrupted, before);
}

#[test]
fn corruption_always_changes_even_a_one_byte_payload() {
    // With 8 bits to choose from, repeated picks are common; flipping the same bit
    // twice would undo the damage while still counting it as corrupted.
    let mut net = Network::new(
        17,
        Faults {
            corrupt: 1.0,
            ..Faults::default()
        },
    );
    for _ in 0..1_000 {
        net.send(
            0,
            Packet {
                data: vec![0x5A],
                ..pkt(1, 2, 0)
            },
        );
        let d = net.pop_due(u64::MAX).map(|p| bit_diff(&p.data, &[0x5A]));
        assert!(matches!(d, Some(1..=3)), "{d:?}");
    }
    assert_eq!(net.stats().corrupted, 1_000);
}

#[test]
fn partition_cuts_both_directions_until_healed() {
    let mut net = Network::new(1, Faults::default());
    net.partition(ip(1), ip(2));
    assert!(net.is_partitioned(ip(2), ip(1)));
    net.send(0, pkt(1, 2, 0));
    net.send(0, pkt(2, 1, 1));
    net.send(0, pkt(1, 3, 2));
    let out = drain(&mut net);
    assert_eq!(out.iter().map(|(_, p)| seq_of(p)).collect::<Vec<_>>(), [2]);
    assert_eq!(net.stats().dropped_partition, 2);

    net.heal(ip(2), ip(1));
    net.send(10, pkt(1, 2, 3));
    net.send(10, pkt(2, 1, 4));
    let out = drain(&mut net);
    assert_eq!(
        out.iter().map(|(_, p)| seq_of(p)).collect::<Vec<_>>(),
        [3, 4]
    );

    // A cut drops what is already on the link; heal_all clears every cut.
    net.send(20, pkt(1, 2, 5));
    net.partition(ip(1), ip(2));
    net.partition(ip(1), ip(3));
    assert_eq!(net.pop_due(u64::MAX), None);
    assert_eq!(net.stats().dropped_partition, 3);
    net.heal_all();
    net.send(30, pkt(1, 3, 6));
    assert_eq!(net.pop_due(u64::MAX).map(|p| seq_of(&p)), Some(6));
    assert!(conserved(net.stats(), net.in_flight()));
}

#[test]
fn nonsense_configuration_does_not_panic() {
    let mut net = Network::new(
        0,
        Faults {
            loss: f64::NAN,
            duplicate: -3.0,
            reorder: 7.0,
            corrupt: f64::INFINITY,
            delay_ns: u64::MAX,
            jitter_ns: u64::MAX,
            reorder_extra_ns: u64::MAX,
        },
    );
    net.send(u64::MAX, pkt(1, 2, 0));
    net.send(
        u64::MAX,
        Packet {
            data: vec![],
            ..pkt(1, 2, 1)
        },
    );
    assert_eq!(net.next_delivery(), Some(u64::MAX));
    assert_eq!(drain(&mut net).len(), 2);
    assert_eq!(net.stats().dropped(), 0);
    assert_eq!(net.stats().corrupted, 1);
}

// ---- the driver ---------------------------------------------------------------

/// Shared log of (time, endpoint address, event) across endpoints.
type Log = Rc<RefCell<Vec<(u64, SocketAddr, &'static str)>>>;

/// A tiny endpoint: echoes packets whose first byte (a hop budget) is non-zero,
/// sends what is queued in `outbox`, and fires the timers in `timers`, optionally
/// re-arming every `period` ns.
struct TestEp {
    addr: SocketAddr,
    echo: bool,
    /// Echo even with no hop budget left (a deliberate livelock).
    forever: bool,
    /// Echoes this endpoint may still send. The hop cap alone does not bound a run:
    /// corruption can raise a budget back to the cap, and with heavy duplication
    /// that makes the echo tree grow without end (a property run found it).
    echoes_left: u32,
    outbox: VecDeque<Packet>,
    inbox: Vec<(u64, Packet)>,
    timers: Vec<u64>,
    period: Option<u64>,
    fired: Vec<u64>,
    log: Log,
}

impl TestEp {
    fn new(last: u8, log: &Log) -> Self {
        TestEp {
            addr: sa(last),
            echo: false,
            forever: false,
            echoes_left: MAX_ECHOES,
            outbox: VecDeque::new(),
            inbox: Vec::new(),
            timers: Vec::new(),
            period: None,
            fired: Vec::new(),
            log: Rc::clone(log),
        }
    }
}

impl Endpoint for TestEp {
    fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn handle_packet(&mut self, now: u64, pkt: Packet) {
        let group = pkt.dst.ip().is_multicast() && pkt.dst.port() == self.addr.port();
        assert!(
            pkt.dst == self.addr || group,
            "delivered to the wrong endpoint"
        );
        self.log.borrow_mut().push((now, self.addr, "rx"));
        let budget = pkt.data.first().is_some_and(|&h| h > 0);
        if self.echo && (budget || self.forever) && self.echoes_left > 0 {
            self.echoes_left -= 1;
            let mut data = pkt.data.clone();
            // Capped, because corruption can raise the budget and duplication
            // multiplies copies at every hop.
            if let Some(h) = data.first_mut() {
                *h = (*h).min(MAX_HOPS).saturating_sub(1);
            }
            self.outbox.push_back(Packet {
                src: self.addr,
                dst: pkt.src,
                tos: pkt.tos,
                data,
            });
        }
        self.inbox.push((now, pkt));
    }

    fn poll_transmit(&mut self, _now: u64) -> Option<Packet> {
        self.outbox.pop_front()
    }

    fn poll_timeout(&self) -> Option<u64> {
        self.timers.iter().copied().min()
    }

    fn handle_timeout(&mut self, now: u64) {
        self.log.borrow_mut().push((now, self.addr, "timer"));
        self.fired.push(now);
        self.timers.retain(|&t| t > now);
        if let Some(p) = self.period {
            self.timers.push(now + p);
        }
    }
}

/// Largest hop budget the test endpoint honours.
const MAX_HOPS: u8 = 8;

/// Echoes one test endpoint sends at most; far above what any test needs when
/// corruption leaves the hop budgets alone.
const MAX_ECHOES: u32 = 5_000;

fn hop_pkt(src: u8, dst: u8, hops: u8, seq: u32) -> Packet {
    let mut p = pkt(src, dst, seq);
    p.data.insert(0, hops);
    p
}

#[test]
fn sim_delivers_to_the_right_endpoint_and_counts_unknown() {
    let log = Log::default();
    let mut sim = Sim::new(Network::new(1, Faults::default()));
    let mut a = TestEp::new(1, &log);
    a.outbox.extend([
        hop_pkt(1, 2, 1, 0),
        hop_pkt(1, 3, 0, 1),
        hop_pkt(1, 9, 0, 2),
    ]);
    let a = sim.add(a);
    let mut b = TestEp::new(2, &log);
    b.echo = true;
    let b = sim.add(b);
    let c = sim.add(TestEp::new(3, &log));
    assert!(sim.run_to_idle(1_000_000));
    let ids =
        |i: usize| -> Vec<Packet> { sim.endpoints[i].inbox.iter().map(|x| x.1.clone()).collect() };
    assert_eq!(ids(b), [hop_pkt(1, 2, 1, 0)]);
    assert_eq!(ids(c), [hop_pkt(1, 3, 0, 1)]);
    assert_eq!(ids(a), [hop_pkt(2, 1, 0, 0)], "the echo came back");
    // Sent at 0, delivered at 1 µs, echoed at 1 µs, back at 2 µs.
    assert_eq!(sim.endpoints[a].inbox[0].0, 2_000);
    assert_eq!(sim.now, 2_000);
    let s = sim.net.stats();
    assert_eq!((s.sent, s.delivered, s.dropped_no_endpoint), (4, 3, 1));
    assert!(conserved(s, sim.net.in_flight()));
    assert!(!sim.step(), "quiescent");
}

#[test]
fn sim_floods_multicast_to_every_endpoint_on_the_port_sender_included() {
    let log = Log::default();
    let mut sim = Sim::new(Network::new(1, Faults::default()));
    let group = SocketAddr::from(([239, 1, 2, 3], 4791));
    let mut a = TestEp::new(1, &log);
    let mut p = pkt(1, 2, 7);
    p.dst = group;
    a.outbox.push_back(p.clone());
    // And one to a group port nobody listens on.
    let mut lost = pkt(1, 2, 8);
    lost.dst = SocketAddr::from(([239, 1, 2, 3], 9));
    a.outbox.push_back(lost);
    let a = sim.add(a);
    let b = sim.add(TestEp::new(2, &log));
    let c = sim.add(TestEp::new(3, &log));
    let mut other_port = TestEp::new(4, &log);
    other_port.addr = SocketAddr::new(other_port.addr.ip(), 1234);
    let d = sim.add(other_port);
    assert!(sim.run_to_idle(1_000_000));
    for i in [a, b, c] {
        let got: Vec<Packet> = sim.endpoints[i].inbox.iter().map(|x| x.1.clone()).collect();
        assert_eq!(got, [p.clone()], "endpoint {i}");
    }
    assert!(sim.endpoints[d].inbox.is_empty(), "another UDP port");
    let s = sim.net.stats();
    assert_eq!(
        (
            s.sent,
            s.delivered,
            s.multicast_copies,
            s.dropped_no_endpoint
        ),
        (2, 3, 2, 1)
    );
    assert!(conserved(s, sim.net.in_flight()));
}

#[test]
fn sim_fires_timeouts_in_time_order_at_their_time() {
    let log = Log::default();
    let mut sim = Sim::new(Network::new(1, Faults::default()));
    let mut x = TestEp::new(1, &log);
    x.timers = vec![50, 10];
    let mut y = TestEp::new(2, &log);
    y.timers = vec![30, 5, 70];
    let x = sim.add(x);
    let y = sim.add(y);
    assert!(sim.run_to_idle(1_000));
    let times: Vec<u64> = log.borrow().iter().map(|e| e.0).collect();
    assert_eq!(times, [5, 10, 30, 50, 70]);
    assert_eq!(sim.endpoints[x].fired, [10, 50]);
    assert_eq!(sim.endpoints[y].fired, [5, 30, 70]);
}

#[test]
fn sim_interleaves_deliveries_and_timeouts_by_time() {
    let log = Log::default();
    let mut sim = Sim::new(Network::new(1, Faults::default()));
    let mut x = TestEp::new(1, &log);
    x.outbox.push_back(hop_pkt(1, 2, 0, 0)); // arrives at 1_000
    let mut y = TestEp::new(2, &log);
    y.timers = vec![500, 1_500];
    sim.add(x);
    sim.add(y);
    assert!(sim.run_to_idle(10_000));
    let events: Vec<(u64, &str)> = log.borrow().iter().map(|e| (e.0, e.2)).collect();
    assert_eq!(events, [(500, "timer"), (1_000, "rx"), (1_500, "timer")]);
}

#[test]
fn run_until_respects_the_deadline() {
    let log = Log::default();
    let mut sim = Sim::new(Network::new(1, Faults::default()));
    let mut t = TestEp::new(1, &log);
    t.timers = vec![1_000];
    t.period = Some(1_000); // never quiescent
    sim.add(t);
    // The check inside `done` turns an overrun into a failure rather than a hang.
    assert!(!sim.run_until(10_000, |s| {
        assert!(s.now <= 10_000, "ran past the deadline");
        false
    }));
    assert_eq!(sim.now, 10_000);
    assert_eq!(
        sim.endpoints[0].fired,
        (1..=10).map(|k| k * 1_000).collect::<Vec<_>>()
    );
    assert!(!sim.run_to_idle(20_500), "a periodic timer never goes idle");
    assert_eq!(sim.endpoints[0].fired.len(), 20);
    assert_eq!(sim.now, 20_500);
}

#[test]
fn run_until_stops_when_done() {
    let log = Log::default();
    let mut sim = Sim::new(Network::new(1, Faults::default()));
    let mut a = TestEp::new(1, &log);
    a.echo = true;
    a.outbox.push_back(hop_pkt(1, 2, MAX_HOPS, 0));
    let mut b = TestEp::new(2, &log);
    b.echo = true;
    sim.add(a);
    sim.add(b);
    let done = sim.run_until(u64::MAX, |s| s.endpoints[0].inbox.len() >= 3);
    assert!(done);
    assert_eq!(sim.endpoints[0].inbox.len(), 3);
    assert_eq!(sim.now, 6_000, "three round trips of 2 µs");
}

#[test]
fn livelocks_in_frozen_time_are_bounded() {
    let log = Log::default();
    // Zero delay: a ping-pong that never lets time advance.
    let mut sim = Sim::new(Network::new(
        1,
        Faults {
            delay_ns: 0,
            ..Faults::default()
        },
    ));
    sim.set_stall_limit(1_000);
    let mut a = TestEp::new(1, &log);
    a.echo = true;
    a.forever = true;
    a.outbox.push_back(hop_pkt(1, 2, 0, 0));
    let mut b = TestEp::new(2, &log);
    b.echo = true;
    b.forever = true;
    // And a timer that is already due and never cleared.
    b.timers = vec![0];
    b.period = Some(0);
    sim.add(a);
    sim.add(b);
    // Counting calls turns a missing stall limit into a failure rather than a hang.
    let mut calls = 0u32;
    assert!(!sim.run_until(u64::MAX, |_| {
        calls += 1;
        assert!(calls < 100_000, "the stall limit did not stop the loop");
        false
    }));
    assert!(!sim.run_to_idle(u64::MAX));
    assert_eq!(sim.now, 0);
}

/// An endpoint that always has something to send.
struct Firehose(SocketAddr);

impl Endpoint for Firehose {
    fn addr(&self) -> SocketAddr {
        self.0
    }
    fn handle_packet(&mut self, _now: u64, _pkt: Packet) {}
    fn poll_transmit(&mut self, _now: u64) -> Option<Packet> {
        Some(pkt(1, 2, 0))
    }
    fn poll_timeout(&self) -> Option<u64> {
        None
    }
    fn handle_timeout(&mut self, _now: u64) {}
}

#[test]
fn an_endless_transmitter_cannot_hang_a_step() {
    let mut sim = Sim::new(Network::new(
        1,
        Faults {
            loss: 1.0,
            ..Faults::default()
        },
    ));
    sim.add(Firehose(sa(1)));
    // Everything is lost, yet the endpoint still has more to send: not quiescent.
    assert!(sim.step());
    assert_eq!(sim.net.stats().sent, 1 << 16);
    sim.set_stall_limit(3);
    assert!(!sim.run_until(5_000, |_| false));
    assert!(!sim.run_to_idle(5_000));
    assert_eq!(sim.now, 0);
}

fn sim_trace(seed: u64) -> (Vec<(u64, SocketAddr, &'static str)>, Stats) {
    let log = Log::default();
    let mut sim = Sim::new(Network::new(seed, noisy()));
    for i in 1..=3u8 {
        let mut e = TestEp::new(i, &log);
        e.echo = true;
        for k in 0..20u32 {
            e.outbox.push_back(hop_pkt(i, i % 3 + 1, 6, k));
        }
        e.timers = vec![u64::from(i) * 3_333];
        sim.add(e);
    }
    sim.run_to_idle(u64::MAX);
    let trace = log.borrow().clone();
    (trace, sim.net.stats().clone())
}

#[test]
fn sim_is_deterministic() {
    let (a, sa_) = sim_trace(99);
    let (b, sb) = sim_trace(99);
    assert!(a.len() > 60);
    assert_eq!(a, b);
    assert_eq!(sa_, sb);
    assert_ne!(sim_trace(100).0, a);
}

// ---- properties ---------------------------------------------------------------

fn arb_faults() -> impl Strategy<Value = Faults> {
    (
        0.0..0.5f64,
        0.0..0.5f64,
        0.0..0.5f64,
        0.0..0.5f64,
        0..5_000u64,
        0..5_000u64,
        0..50_000u64,
    )
        .prop_map(
            |(loss, duplicate, reorder, corrupt, delay_ns, jitter_ns, reorder_extra_ns)| Faults {
                loss,
                duplicate,
                reorder,
                corrupt,
                delay_ns,
                jitter_ns,
                reorder_extra_ns,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Every packet is accounted for at every moment: nothing vanishes or appears
    /// except through a counted duplicate, and once drained,
    /// delivered + dropped == sent + duplicated.
    #[test]
    fn network_conserves_packets(
        seed in any::<u64>(),
        faults in arb_faults(),
        ops in proptest::collection::vec((0u8..4, 1u8..4, 1u8..4, 0u64..3_000), 1..300),
    ) {
        let mut net = Network::new(seed, faults);
        let mut now = 0u64;
        for (i, (op, src, dst, dt)) in ops.into_iter().enumerate() {
            now += dt;
            match op {
                0 | 1 => net.send(now, pkt(src, dst, i as u32)),
                2 => { while net.pop_due(now).is_some() {} }
                _ => if dt % 2 == 0 { net.partition(ip(src), ip(dst)) } else { net.heal(ip(src), ip(dst)) },
            }
            prop_assert!(conserved(net.stats(), net.in_flight()), "{:?}", net.stats());
        }
        drain(&mut net);
        let s = net.stats();
        prop_assert_eq!(net.in_flight(), 0);
        prop_assert_eq!(s.delivered + s.dropped(), s.sent + s.duplicated);
    }

    /// The same holds through the driver, including packets to unknown endpoints.
    #[test]
    fn sim_conserves_packets(seed in any::<u64>(), faults in arb_faults(), hops in 0u8..8) {
        let log = Log::default();
        let mut sim = Sim::new(Network::new(seed, faults));
        for i in 1..=3u8 {
            let mut e = TestEp::new(i, &log);
            e.echo = true;
            for k in 0..10u32 {
                // Address 4 has no endpoint.
                e.outbox.push_back(hop_pkt(i, (i + k as u8) % 4 + 1, hops, k));
            }
            sim.add(e);
        }
        prop_assert!(sim.run_to_idle(u64::MAX));
        let s = sim.net.stats();
        prop_assert_eq!(sim.net.in_flight(), 0);
        prop_assert_eq!(s.delivered + s.dropped(), s.sent + s.duplicated);
        prop_assert_eq!(log.borrow().len() as u64, s.delivered);
    }
}

/// The worst corner of the property above, pinned: without loss, with heavy
/// duplication and corruption that keeps raising hop budgets, every seed once grew
/// an echo tree without end and ran the test out of memory.
#[test]
fn sim_conserves_packets_when_corruption_keeps_echoes_alive() {
    let faults = Faults {
        duplicate: 0.49,
        corrupt: 0.49,
        delay_ns: 1_000,
        ..Faults::default()
    };
    for seed in 0..8u64 {
        let log = Log::default();
        let mut sim = Sim::new(Network::new(seed, faults.clone()));
        for i in 1..=3u8 {
            let mut e = TestEp::new(i, &log);
            e.echo = true;
            for k in 0..10u32 {
                e.outbox.push_back(hop_pkt(i, (i + k as u8) % 4 + 1, 7, k));
            }
            sim.add(e);
        }
        assert!(sim.run_to_idle(u64::MAX), "seed {seed}");
        let s = sim.net.stats();
        assert!(s.corrupted > 0 && s.duplicated > 0);
        assert_eq!(s.delivered + s.dropped(), s.sent + s.duplicated);
        assert_eq!(log.borrow().len() as u64, s.delivered);
    }
}
