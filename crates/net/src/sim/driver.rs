//! The discrete-event driver: a [`Network`], a virtual clock and a set of endpoints.

use std::net::SocketAddr;

use super::{Network, Packet, Stats};

/// Something attached to the network, driven by explicit time (sans-IO), e.g. an RDMA
/// device engine.
pub trait Endpoint {
    /// The address packets must be sent to for this endpoint to receive them.
    fn addr(&self) -> SocketAddr;
    /// A packet arrives.
    fn handle_packet(&mut self, now: u64, pkt: Packet);
    /// Next packet this endpoint wants to send, if any.
    fn poll_transmit(&mut self, now: u64) -> Option<Packet>;
    /// When the endpoint next needs `handle_timeout` (retransmission timers etc.).
    fn poll_timeout(&self) -> Option<u64>;
    /// The time returned by `poll_timeout` has been reached.
    fn handle_timeout(&mut self, now: u64);
}

/// Most packets taken from one endpoint in one step, so an endpoint that never stops
/// transmitting cannot hang a step; the rest are taken in later steps.
const MAX_TRANSMITS_PER_STEP: usize = 1 << 16;

/// Default for [`Sim::set_stall_limit`].
const DEFAULT_STALL_LIMIT: u64 = 1_000_000;

/// Outcome of one bounded step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StepResult {
    /// Events were processed.
    Progressed,
    /// Nothing is pending anywhere.
    Idle,
    /// The next event lies beyond the deadline; nothing was processed.
    Deadline,
}

/// Why a run loop stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RunEnd {
    Done,
    Idle,
    Deadline,
    Stalled,
}

/// A discrete-event driver: a Network, a virtual clock, and a set of endpoints.
pub struct Sim<E: Endpoint> {
    /// The network between the endpoints.
    pub net: Network,
    /// Virtual time in nanoseconds; only moves forward.
    pub now: u64,
    /// Attached endpoints, indexed by the value [`Sim::add`] returned.
    pub endpoints: Vec<E>,
    stall_limit: u64,
}

impl<E: Endpoint> Sim<E> {
    /// A simulation at time 0 with no endpoints.
    pub fn new(net: Network) -> Self {
        Sim {
            net,
            now: 0,
            endpoints: Vec::new(),
            stall_limit: DEFAULT_STALL_LIMIT,
        }
    }

    /// Attach an endpoint; returns its index in `endpoints`. If two endpoints share an
    /// address, the first one receives the packets.
    pub fn add(&mut self, e: E) -> usize {
        self.endpoints.push(e);
        self.endpoints.len() - 1
    }

    /// How many consecutive steps `run_until`/`run_to_idle` allow without virtual time
    /// advancing before giving up. This catches livelocks (a zero-delay ping-pong, a
    /// timeout that is never cleared) that a deadline alone cannot, since time stands
    /// still in them.
    pub fn set_stall_limit(&mut self, steps: u64) {
        self.stall_limit = steps;
    }

    /// Earliest pending event: a packet delivery or an endpoint timeout. Packets the
    /// endpoints have not yet transmitted are not seen here.
    pub fn next_event(&self) -> Option<u64> {
        let timeouts = self.endpoints.iter().filter_map(|e| e.poll_timeout());
        self.net.next_delivery().into_iter().chain(timeouts).min()
    }

    /// One step: drain every endpoint's poll_transmit into the network, then advance
    /// `now` to the earliest of (next delivery, endpoints' timeouts), deliver every due
    /// packet to the endpoint whose addr == pkt.dst (packets to unknown addresses are
    /// dropped and counted; a packet to a multicast IP address goes to every endpoint on
    /// its UDP port), fire due timeouts. Returns false when nothing is pending
    /// at all (quiescent). Time never moves backwards: a timeout in the past fires now.
    /// At most 65 536 packets are taken from each endpoint per step; the rest wait for
    /// the next step.
    pub fn step(&mut self) -> bool {
        self.step_bounded(u64::MAX) == StepResult::Progressed
    }

    fn step_bounded(&mut self, deadline: u64) -> StepResult {
        let now = self.now;
        let mut capped = false;
        for e in &mut self.endpoints {
            let mut sent = 0;
            while let Some(pkt) = e.poll_transmit(now) {
                self.net.send(now, pkt);
                sent += 1;
                if sent == MAX_TRANSMITS_PER_STEP {
                    capped = true;
                    break;
                }
            }
        }
        let Some(next) = self.next_event() else {
            // An endpoint cut off by the cap may still have packets to send.
            return if capped {
                StepResult::Progressed
            } else {
                StepResult::Idle
            };
        };
        let t = next.max(self.now);
        if t > deadline {
            return StepResult::Deadline;
        }
        self.now = t;

        // Delivery cannot add packets to the network (endpoints only transmit when
        // polled), so this loop ends once the due packets are gone.
        while let Some(pkt) = self.net.pop_due_uncounted(t) {
            let stats = &mut self.net.stats;
            if pkt.dst.ip().is_multicast() {
                deliver_multicast(&mut self.endpoints, stats, t, pkt);
                continue;
            }
            match self.endpoints.iter_mut().find(|e| e.addr() == pkt.dst) {
                Some(e) => {
                    stats.delivered = stats.delivered.saturating_add(1);
                    e.handle_packet(t, pkt);
                }
                None => {
                    stats.dropped_no_endpoint = stats.dropped_no_endpoint.saturating_add(1);
                }
            }
        }
        for e in &mut self.endpoints {
            if e.poll_timeout().is_some_and(|at| at <= t) {
                e.handle_timeout(t);
            }
        }
        StepResult::Progressed
    }

    /// Step until `done(self)` is true, nothing is pending, or virtual time passes
    /// `deadline`. Bounded: returns whether done. No event later than `deadline` is
    /// processed; if one is pending, `now` is left at `deadline`.
    pub fn run_until(&mut self, deadline: u64, mut done: impl FnMut(&mut Self) -> bool) -> bool {
        self.run(deadline, &mut done) == RunEnd::Done
    }

    /// Run until quiescent or deadline. Returns true if the simulation went quiescent
    /// (no packets in flight, nothing to transmit, no timers) by `deadline`.
    pub fn run_to_idle(&mut self, deadline: u64) -> bool {
        self.run(deadline, &mut |_: &mut Self| false) == RunEnd::Idle
    }

    /// The loop behind `run_until` and `run_to_idle`.
    fn run(&mut self, deadline: u64, done: &mut dyn FnMut(&mut Self) -> bool) -> RunEnd {
        let mut stalled: u64 = 0;
        loop {
            if done(self) {
                return RunEnd::Done;
            }
            let before = self.now;
            let end = match self.step_bounded(deadline) {
                StepResult::Progressed if self.now != before => {
                    stalled = 0;
                    continue;
                }
                StepResult::Progressed => {
                    stalled += 1;
                    if stalled <= self.stall_limit {
                        continue;
                    }
                    RunEnd::Stalled
                }
                StepResult::Deadline => {
                    self.now = self.now.max(deadline);
                    RunEnd::Deadline
                }
                StepResult::Idle => RunEnd::Idle,
            };
            // The last step may have completed the condition.
            return if done(self) { RunEnd::Done } else { end };
        }
    }
}

/// Deliver a packet sent to a multicast IP address: a copy to every endpoint on the
/// packet's UDP destination port, the sender included. The sim models a switch that
/// floods multicast (no IGMP snooping) and hosts that loop their own multicast back
/// (`IP_MULTICAST_LOOP`, on by default); deciding who is a member is the endpoints'
/// business, as it is a receiving NIC's.
fn deliver_multicast<E: Endpoint>(endpoints: &mut [E], stats: &mut Stats, t: u64, pkt: Packet) {
    let port = pkt.dst.port();
    let n = endpoints.iter().filter(|e| e.addr().port() == port).count();
    if n == 0 {
        stats.dropped_no_endpoint = stats.dropped_no_endpoint.saturating_add(1);
        return;
    }
    stats.multicast_copies = stats.multicast_copies.saturating_add(n as u64 - 1);
    let mut left = n;
    let mut pkt = Some(pkt);
    for e in endpoints.iter_mut().filter(|e| e.addr().port() == port) {
        left -= 1;
        // The last receiver gets the packet itself, the others a copy.
        let p = if left == 0 { pkt.take() } else { pkt.clone() };
        if let Some(p) = p {
            stats.delivered = stats.delivered.saturating_add(1);
            e.handle_packet(t, p);
        }
    }
}
