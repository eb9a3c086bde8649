//! An in-memory datagram network for deterministic tests.
//!
//! [`Network`] holds packets in flight and decides their fate with a seeded PRNG:
//! loss, duplication, reordering, bit corruption, delay with jitter, and partitions
//! between IP addresses. Time is virtual: every call takes `now` in nanoseconds and
//! nothing reads a real clock, so the same seed and the same sequence of calls always
//! give the same result. [`Sim`] is a discrete-event driver that joins a `Network`
//! with a set of sans-IO [`Endpoint`]s.
//!
//! The network moves opaque UDP payloads; it knows nothing about what they carry.

mod driver;
#[cfg(target_os = "linux")]
mod link;
#[cfg(test)]
mod tests;

use std::cmp::Ordering;
use std::collections::{BTreeSet, BinaryHeap};
use std::net::{IpAddr, SocketAddr};

pub use driver::{Endpoint, Sim};
#[cfg(target_os = "linux")]
pub use link::{SimLink, SimNet};
use softrdma_wire::SplitMix64;

/// A datagram in flight: UDP payload plus its addressing and IP TOS byte (the ICRC
/// covers the addresses and ports).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packet {
    /// Sender's address and UDP source port.
    pub src: SocketAddr,
    /// Receiver's address and UDP destination port; routes the packet.
    pub dst: SocketAddr,
    /// IP type-of-service byte, carried through untouched.
    pub tos: u8,
    /// UDP payload.
    pub data: Vec<u8>,
}

/// Fault model applied to every packet handed to [`Network::send`].
///
/// Probabilities are per packet and clamped to [0, 1] (NaN counts as 0).
#[derive(Debug, Clone)]
pub struct Faults {
    /// Probability a packet is silently dropped.
    pub loss: f64,
    /// Probability a surviving packet is delivered twice; the copy gets its own delay,
    /// reordering and corruption decisions.
    pub duplicate: f64,
    /// Probability a packet is held back by extra delay so that later packets overtake it.
    pub reorder: f64,
    /// Probability 1..=3 distinct bits of the payload are flipped.
    pub corrupt: f64,
    /// Base one-way delay.
    pub delay_ns: u64,
    /// Added to the delay, uniformly in [0, jitter_ns]. Non-zero jitter can itself reorder.
    pub jitter_ns: u64,
    /// Upper bound of the extra delay given to a reordered packet; the extra is uniform
    /// in [reorder_extra_ns / 2, reorder_extra_ns] (at least 1 ns) so that it really
    /// is held back rather than nudged by a nanosecond.
    pub reorder_extra_ns: u64,
}

impl Default for Faults {
    /// A perfect link with a fixed 1 µs delay. `reorder_extra_ns` is preset (20 µs) so
    /// that setting only `reorder` has a visible effect.
    fn default() -> Self {
        Faults {
            loss: 0.0,
            duplicate: 0.0,
            reorder: 0.0,
            corrupt: 0.0,
            delay_ns: 1_000,
            jitter_ns: 0,
            reorder_extra_ns: 20_000,
        }
    }
}

/// Counters of what the network did. Once nothing is in flight,
/// `delivered + dropped() == sent + duplicated + multicast_copies`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// Packets handed to [`Network::send`].
    pub sent: u64,
    /// Packets handed out (by [`Network::pop_due`], or to an endpoint by [`Sim`]).
    pub delivered: u64,
    /// Packets dropped by random loss.
    pub dropped_loss: u64,
    /// Packets dropped because source and destination were partitioned, at send time
    /// or while in flight.
    pub dropped_partition: u64,
    /// Packets [`Sim`] could not deliver because no endpoint has the destination address.
    pub dropped_no_endpoint: u64,
    /// Extra copies created by duplication.
    pub duplicated: u64,
    /// Packet copies held back by reordering.
    pub reordered: u64,
    /// Packet copies whose payload had bits flipped.
    pub corrupted: u64,
    /// Extra copies [`Sim`] made to deliver a packet sent to a multicast address to
    /// several endpoints (one less than the endpoints that got it).
    pub multicast_copies: u64,
}

impl Stats {
    /// All drops, whatever the cause.
    pub fn dropped(&self) -> u64 {
        self.dropped_loss
            .saturating_add(self.dropped_partition)
            .saturating_add(self.dropped_no_endpoint)
    }
}

/// A packet waiting in the network, ordered by (delivery time, send order).
#[derive(Debug)]
struct InFlight {
    at: u64,
    seq: u64,
    pkt: Packet,
}

impl PartialEq for InFlight {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}

impl Eq for InFlight {}

impl PartialOrd for InFlight {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for InFlight {
    // Reversed so that `BinaryHeap` (a max-heap) pops the earliest packet first; `seq`
    // is unique, so ties in time fall back to send order and the order is total.
    fn cmp(&self, other: &Self) -> Ordering {
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

/// An in-memory network with seeded faults on a virtual clock.
#[derive(Debug)]
pub struct Network {
    faults: Faults,
    rng: SplitMix64,
    queue: BinaryHeap<InFlight>,
    /// Cut IP pairs, stored with the smaller address first so one entry covers both
    /// directions. A `BTreeSet` keeps iteration order deterministic.
    partitions: BTreeSet<(IpAddr, IpAddr)>,
    next_seq: u64,
    stats: Stats,
}

fn ip_pair(a: IpAddr, b: IpAddr) -> (IpAddr, IpAddr) {
    if a <= b {
        (a, b)
    } else {
        (b, a)
    }
}

impl Network {
    /// A network whose every random decision derives from `seed`.
    pub fn new(seed: u64, faults: Faults) -> Self {
        Network {
            faults,
            rng: SplitMix64::new(seed),
            queue: BinaryHeap::new(),
            partitions: BTreeSet::new(),
            next_seq: 0,
            stats: Stats::default(),
        }
    }

    /// Replace the fault model; applies to packets sent from now on (packets already in
    /// flight keep their fate).
    pub fn set_faults(&mut self, f: Faults) {
        self.faults = f;
    }

    /// The current fault model.
    pub fn faults(&self) -> &Faults {
        &self.faults
    }

    /// Cut traffic between two IPs (both directions) until `heal`. Packets already in
    /// flight between them are dropped when they come due, as on a cut link.
    pub fn partition(&mut self, a: IpAddr, b: IpAddr) {
        self.partitions.insert(ip_pair(a, b));
    }

    /// Restore traffic between two IPs (both directions).
    pub fn heal(&mut self, a: IpAddr, b: IpAddr) {
        self.partitions.remove(&ip_pair(a, b));
    }

    /// Remove every partition.
    pub fn heal_all(&mut self) {
        self.partitions.clear();
    }

    /// Whether traffic between `a` and `b` is currently cut.
    pub fn is_partitioned(&self, a: IpAddr, b: IpAddr) -> bool {
        !self.partitions.is_empty() && self.partitions.contains(&ip_pair(a, b))
    }

    /// Hand a packet to the network at virtual time `now`; faults decide its fate.
    /// Corruption flips 1..=3 distinct random bits anywhere in `data` (so a checksum
    /// must catch it); an empty payload cannot be corrupted.
    pub fn send(&mut self, now: u64, pkt: Packet) {
        self.stats.sent = self.stats.sent.saturating_add(1);
        if self.is_partitioned(pkt.src.ip(), pkt.dst.ip()) {
            self.stats.dropped_partition = self.stats.dropped_partition.saturating_add(1);
            return;
        }
        if self.rng.chance(self.faults.loss) {
            self.stats.dropped_loss = self.stats.dropped_loss.saturating_add(1);
            return;
        }
        if self.rng.chance(self.faults.duplicate) {
            self.stats.duplicated = self.stats.duplicated.saturating_add(1);
            // The original is enqueued first, so on a delay tie it still arrives first.
            let copy = pkt.clone();
            self.enqueue(now, pkt);
            self.enqueue(now, copy);
        } else {
            self.enqueue(now, pkt);
        }
    }

    /// Decide delay, reordering and corruption for one copy and put it in flight.
    fn enqueue(&mut self, now: u64, mut pkt: Packet) {
        let f = &self.faults;
        let mut delay = f.delay_ns.saturating_add(self.rng.up_to(f.jitter_ns));
        if f.reorder_extra_ns > 0 && self.rng.chance(f.reorder) {
            let hi = f.reorder_extra_ns;
            let lo = (hi / 2).max(1);
            let extra = lo.saturating_add(self.rng.up_to(hi - lo));
            delay = delay.saturating_add(extra);
            self.stats.reordered = self.stats.reordered.saturating_add(1);
        }
        if !pkt.data.is_empty() && self.rng.chance(f.corrupt) {
            self.flip_bits(&mut pkt.data);
            self.stats.corrupted = self.stats.corrupted.saturating_add(1);
        }
        let seq = self.next_seq;
        self.next_seq = self.next_seq.wrapping_add(1);
        self.queue.push(InFlight {
            at: now.saturating_add(delay),
            seq,
            pkt,
        });
    }

    /// Flip 1..=3 distinct bits of a non-empty buffer. Distinct, because flipping the
    /// same bit twice would undo the corruption while still counting it.
    fn flip_bits(&mut self, data: &mut [u8]) {
        let nbits = (data.len() as u64).saturating_mul(8);
        if nbits == 0 {
            return;
        }
        let count = 1 + self.rng.below(3);
        let mut chosen: [Option<u64>; 3] = [None; 3];
        for slot in 0..count as usize {
            let mut bit = self.rng.below(nbits);
            // Linear probing instead of redrawing keeps this loop bounded; a non-empty
            // buffer has at least 8 bits, so 3 distinct ones always exist.
            while chosen.contains(&Some(bit)) {
                bit = (bit + 1) % nbits;
            }
            if let Some(s) = chosen.get_mut(slot) {
                *s = Some(bit);
            }
            let byte = usize::try_from(bit / 8).unwrap_or(usize::MAX);
            if let Some(b) = data.get_mut(byte) {
                *b ^= 1 << (bit % 8);
            }
        }
    }

    /// Earliest time a packet becomes deliverable. A packet whose path has since been
    /// partitioned still counts here; it is dropped when it comes due.
    pub fn next_delivery(&self) -> Option<u64> {
        self.queue.peek().map(|p| p.at)
    }

    /// Pop the next packet due at or before `now` (in delivery-time order; ties broken
    /// by send order), and count it delivered.
    pub fn pop_due(&mut self, now: u64) -> Option<Packet> {
        let pkt = self.pop_due_uncounted(now)?;
        self.stats.delivered = self.stats.delivered.saturating_add(1);
        Some(pkt)
    }

    /// Like `pop_due` but leaves the delivered/no-endpoint decision to the caller
    /// ([`Sim`] counts it once it knows whether the destination exists).
    fn pop_due_uncounted(&mut self, now: u64) -> Option<Packet> {
        loop {
            if self.queue.peek()?.at > now {
                return None;
            }
            let InFlight { pkt, .. } = self.queue.pop()?;
            if self.is_partitioned(pkt.src.ip(), pkt.dst.ip()) {
                self.stats.dropped_partition = self.stats.dropped_partition.saturating_add(1);
                continue;
            }
            return Some(pkt);
        }
    }

    /// What the network has done so far.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Packets (copies included) currently in the network.
    pub fn in_flight(&self) -> usize {
        self.queue.len()
    }
}
