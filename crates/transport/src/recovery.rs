//! Loss recovery of an RC requester: what it knows of the peer and of its own resends,
//! and which packets to resend. It decides; the completer and the SACK handler carry the
//! decisions out through the requester (`requester::resend_one`, `resend_read_part`, a
//! go-back-N), and tell the congestion controller ([`crate::cc`]) what was lost.
//!
//! Three ways to repair a loss, cheapest first:
//! - a selective repeat: a sequence NAK names one missing packet, which is resent alone
//!   while new packets keep going out ([`Recovery::selective_repeat`]). Worth it only
//!   against a peer that holds what follows a gap (a softrdma responder, `qp::Held`);
//!   whether it does is learnt from the answer to the resend ([`Recovery::answered`]).
//! - SACKs: once the peer is known to hold, it is asked for selective acknowledgements
//!   ([`crate::sack`]), and every hole one shows is resent at once
//!   ([`Recovery::on_sack`]); a READ's missing responses are asked for the same way.
//! - a go-back-N from the oldest unacknowledged packet, as the IBTA requester does:
//!   against a peer that drops what follows a gap (rxe), and whenever nothing better is
//!   known.
//!
//! The round-trip timer ([`crate::rtt`]) resends what no evidence shows: the oldest
//! packet alone against a peer that may hold, else a go-back-N
//! ([`Recovery::on_rtt_timeout`]).

use std::collections::BTreeMap;

use softrdma_wire::ext::{SackBitmap, SACK_SPAN};
use softrdma_wire::psn;

use crate::rtt::RttEstimator;

/// Go-back-N recoveries between two tries of a selective resend on a peer that did not
/// hold the last time. Against rxe each try costs the resent packet and a round trip
/// before the go-back-N.
pub(crate) const SR_RETRY_AFTER: u8 = 16;
/// A hole is resent on a SACK only when this many held packets follow it (or nothing
/// more was sent after the highest held one): a packet merely overtaken by a few others
/// arrives by itself, as TCP's duplicate-ACK threshold assumes.
pub(crate) const DUP_THRESH: u32 = 3;
/// Holes resent for one SACK, at most.
pub(crate) const RESENDS_PER_SACK: usize = 128;
/// SACK_PERMITs one QP sends at most while no SACK answers (a softrdma peer without this
/// extension drops them).
const PERMITS_MAX: u8 = 8;
/// Fresh holes of which [`RUNS_FOR_CONGESTION`] or more being runs of two or more lost
/// packets makes a run a sign of congestion (see [`Recovery::on_sack`]).
const HOLE_HISTORY: u32 = 16;
const RUNS_FOR_CONGESTION: u32 = 4;
/// A hole resent less than this long ago is not resent again (before a round trip has
/// been measured).
const RESEND_GUARD_NS: u64 = 1_000_000;
/// PSNs a requester may have outstanding (see `qp::HOLD_SPAN`).
const HOLD_SPAN: i32 = SACK_SPAN as i32;

/// The packet a sequence NAK or the round-trip timer had resent alone, whose answer
/// shows whether the peer held what followed it.
#[derive(Debug, Clone, Copy)]
struct Hole {
    psn: u32,
    /// When it was resent.
    sent_at: u64,
    /// A sequence NAK named it, so the answer to its resend tells whether the peer holds
    /// what follows a gap. A resend by the round-trip timer teaches nothing: the packets
    /// after it may simply have arrived in order.
    from_nak: bool,
}

/// When a packet was resent, and in which order among resends.
#[derive(Debug, Clone, Copy)]
struct Resent {
    at: u64,
    seq: u64,
}

/// What a selective repeat of a packet a sequence NAK names comes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Repeat {
    /// Go back N instead: a go-back-N or an RNR wait is under way, or the peer drops
    /// what follows a gap.
    GoBackN,
    /// The packet was resent already and its resend is on its way (if that is lost too,
    /// the round-trip timer or a later SACK resends it).
    InFlight,
    /// Resend it alone, then report it ([`Recovery::hole_resent`]).
    Resend,
}

/// A hole a SACK shows, due to be resent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SackHole {
    pub psn: u32,
    /// The packet after it is missing too: a run of losses.
    pub run: bool,
}

/// One requester's loss recovery state.
#[derive(Debug, Default)]
pub(crate) struct Recovery {
    /// The round-trip timer's deadline: resends early, spends no retry.
    rtt_deadline: Option<u64>,
    /// A go-back-N started by a response is under way (cleared by progress).
    retrying: bool,
    /// The packet resent alone whose answer is awaited.
    hole: Option<Hole>,
    /// An answer past a READ that is missing some of its responses showed that all of
    /// them were sent: ask for the missing ones (see `completer::read::ask_read_holes`).
    read_repair_due: bool,
    /// Whether the peer holds packets past a gap: unknown until a selective resend is
    /// answered, then `Some(false)` (an IBTA responder, rxe: go back N at once) or
    /// `Some(true)` (a softrdma responder).
    peer_holds: Option<bool>,
    /// Losses to answer with a go-back-N before trying a selective resend again on a
    /// peer that did not hold: a softrdma responder cannot hold before it has learnt the
    /// requester's port (a loss of the connection's first packet looks like rxe), so
    /// the question is asked again now and then ([`SR_RETRY_AFTER`]).
    probe_in: u8,
    /// The oldest unacknowledged PSN as of the last acknowledgement, to count what the
    /// next one acknowledges.
    acked_to: u32,
    /// A SACK came from the peer: it sends one for every hole it holds packets past.
    peer_sacks: bool,
    /// SACK_PERMITs sent, and when the last one went.
    permits: u8,
    permit_at: u64,
    /// The latest SACK: the responder's expected PSN and the packets it holds past it.
    /// Boxed: it is half a KiB, and most QPs never see a SACK.
    board: Option<Box<(u32, SackBitmap)>>,
    /// Holes resent (by a SACK or a selective repeat, and the first PSNs of READ parts
    /// asked for again) and when: not again within a round trip, when the SACK that shows
    /// them still missing may predate their arrival.
    resent: BTreeMap<u32, Resent>,
    /// Resends noted so far: orders resends made at the same instant.
    seq: u64,
    /// The last [`HOLE_HISTORY`] fresh holes a SACK showed, newest in bit 0: set when
    /// the packet after the hole was missing too.
    hole_runs: u16,
}

impl Recovery {
    // The round-trip timer.

    /// When the round-trip timer fires, if it runs.
    pub fn rtt_deadline(&self) -> Option<u64> {
        self.rtt_deadline
    }

    /// Run the round-trip timer for `interval` from `now`, unless it runs already (or
    /// there is no interval: nothing measured yet).
    pub fn arm_rtt_timer(&mut self, now: u64, interval: Option<u64>) {
        if self.rtt_deadline.is_none() {
            self.rtt_deadline = interval.map(|t| now.saturating_add(t));
        }
    }

    /// Stop the round-trip timer (it is armed again for what is awaited next).
    pub fn disarm_rtt_timer(&mut self) {
        self.rtt_deadline = None;
    }

    /// Whether the round-trip timer is due at `now`, before the local ACK timeout
    /// (`ack_deadline`), which handles its own expiry. Stops it when due.
    pub fn take_rtt_expiry(&mut self, now: u64, ack_deadline: Option<u64>) -> bool {
        let due =
            self.rtt_deadline.is_some_and(|t| t <= now) && ack_deadline.map_or(true, |t| t > now);
        if due {
            self.rtt_deadline = None;
        }
        due
    }

    // Progress and go-back-N.

    /// The oldest unacknowledged PSN is `una` before anything is sent (the QP's send PSN).
    pub fn start_at(&mut self, una: u32) {
        self.acked_to = una;
    }

    /// The oldest unacknowledged PSN is now `una`: how many packets that acknowledges.
    pub fn advance(&mut self, una: u32) -> u32 {
        let n = psn::diff(una, self.acked_to);
        if n <= 0 {
            return 0;
        }
        self.acked_to = una;
        n as u32
    }

    /// Whether a go-back-N started by a response is under way.
    pub fn is_retrying(&self) -> bool {
        self.retrying
    }

    /// A go-back-N that a response started: further evidence of the same loss (the
    /// ACKs and NAKs already on their way) is ignored until progress is made.
    pub fn start_retry(&mut self) {
        self.retrying = true;
    }

    /// Progress: a later loss is a new one.
    pub fn on_progress(&mut self) {
        self.retrying = false;
    }

    /// Everything from the oldest unacknowledged packet is about to be resent: what the
    /// last SACK said no longer describes what is in flight, and no single resend is
    /// awaited.
    pub fn on_go_back_n(&mut self) {
        self.rtt_deadline = None;
        self.hole = None;
        self.board = None;
        self.resent.clear();
    }

    // What is known of the peer.

    /// Whether the peer holds packets past a gap, if known.
    #[cfg(test)]
    pub fn peer_holds(&self) -> Option<bool> {
        self.peer_holds
    }

    /// The peer turned out to drop what follows a gap: go back N from now on, and ask
    /// again after [`SR_RETRY_AFTER`] losses.
    pub fn learn_peer_drops(&mut self) {
        self.peer_holds = Some(false);
        self.probe_in = SR_RETRY_AFTER;
    }

    /// The packet resent alone whose answer is awaited, if any.
    pub fn hole(&self) -> Option<u32> {
        self.hole.map(|h| h.psn)
    }

    // Selective repeat.

    /// A sequence NAK (or the round-trip timer) shows packet `k` missing: whether to
    /// resend it alone. `rnr_wait`: the requester waits out an RNR NAK.
    pub fn selective_repeat(
        &mut self,
        k: u32,
        now: u64,
        rnr_wait: bool,
        rtt: &RttEstimator,
    ) -> Repeat {
        if self.retrying || rnr_wait {
            return Repeat::GoBackN;
        }
        if self.peer_holds == Some(false) {
            if self.probe_in > 0 {
                self.probe_in -= 1;
                return Repeat::GoBackN;
            }
            // Ask again (the answer to this resend decides, see `answered`).
            self.probe_in = SR_RETRY_AFTER;
        }
        if self.hole() == Some(k) || self.recently_resent(k, now, rtt) {
            return Repeat::InFlight;
        }
        Repeat::Resend
    }

    /// Whether the request of a READ none of whose responses arrived may be resent alone
    /// (see `completer::resend_lost_read_request`): against a peer known to hold, or when
    /// a sequence NAK (`from_nak`) asks once the round trip is measured.
    pub fn may_resend_read_request(&self, from_nak: bool, rtt: &RttEstimator) -> bool {
        self.peer_holds == Some(true) || (from_nak && rtt.has_sample())
    }

    /// Packet `k` was resent alone at `now`; `from_nak`: a sequence NAK named it. Its
    /// answer is awaited, and the round-trip timer waits for that answer rather than for
    /// progress that the hole held up. Returns whether the loss goes to the congestion
    /// controller: a peer that sends SACKs shows with them whether the loss was a run
    /// (see [`Recovery::on_sack`]); the round trip judges only for one that does not.
    pub fn hole_resent(&mut self, k: u32, now: u64, from_nak: bool) -> bool {
        self.hole = Some(Hole {
            psn: k,
            sent_at: now,
            from_nak,
        });
        self.note(k, now);
        self.rtt_deadline = None;
        from_nak && !self.peer_sacks
    }

    /// The peer's answer to the resend of the hole, if this response (an ACK of `p`, or
    /// a NAK at `p`, which acknowledges what precedes `p`) is it, with the packets before
    /// `high` sent. An ACK of the hole itself, with packets after it sent, says the peer
    /// kept none of them (an IBTA responder drops what follows a gap): returns true, and
    /// the caller goes back N from the packet after it. Anything further says it held
    /// them.
    ///
    /// Until the round trip has been measured, the answer measures it: under steady loss
    /// the timed packet rarely gets through without a hole before it, and without a
    /// measure a lost resend would wait for the local ACK timeout.
    pub fn answered(
        &mut self,
        p: u32,
        nak: bool,
        high: u32,
        now: u64,
        rtt: &mut RttEstimator,
    ) -> bool {
        let Some(h) = self.hole else {
            return false;
        };
        let k = h.psn;
        let filled = if nak { psn::lt(k, p) } else { psn::le(k, p) };
        if !filled {
            return false;
        }
        self.hole = None;
        if !rtt.has_sample() {
            rtt.on_sample(now.saturating_sub(h.sent_at));
        }
        let next = psn::add(k, 1);
        if !nak && p == k && psn::lt(next, high) {
            if h.from_nak && self.peer_holds != Some(true) {
                self.learn_peer_drops();
            }
            return true;
        }
        if h.from_nak && (!nak || p != next) {
            self.peer_holds = Some(true);
        }
        false
    }

    /// A response of the READ starting at `first` arrived while the resend of the hole
    /// awaits its answer. Past the hole, it shows that the peer executed what followed
    /// the gap without a resend: it held it (an IBTA responder drops what follows a gap,
    /// and the PSNs sent after the resend do not follow in order what it expects). The
    /// READ analogue of [`Recovery::answered`], which reads ACKs and NAKs.
    pub fn on_read_response(&mut self, first: u32) {
        let Some(h) = self.hole else {
            return;
        };
        if psn::lt(h.psn, first) {
            self.hole = None;
            if h.from_nak {
                self.peer_holds = Some(true);
            }
        }
    }

    /// The round-trip timer expired with `oldest` the oldest unacknowledged PSN: the PSN
    /// to resend alone, or None to go back N.
    ///
    /// A peer that holds packets past a gap most likely lost only the oldest one (or its
    /// answer): that is resent alone, and the answer says whether more is missing (see
    /// [`Recovery::answered`]). So is it to a peer not known yet: the expiry may be
    /// spurious (a round trip stretched by scheduling), and a go-back-N would resend a
    /// whole window the peer has. The expiry is the evidence that the last resend of
    /// that packet was lost too, so it is due again at once.
    pub fn on_rtt_timeout(&mut self, oldest: Option<u32>) -> Option<u32> {
        if let (Some(h), Some(o)) = (self.hole, oldest) {
            if psn::lt(h.psn, o) && h.from_nak && self.peer_holds != Some(true) {
                // The selective resend of the hole was answered (a READ's request: its
                // responses came), and nothing after it since: the peer dropped what
                // followed the gap. Go back N (and ask again now and then).
                self.learn_peer_drops();
            }
        }
        let holds = self.peer_holds != Some(false) && !self.retrying;
        let k = oldest.filter(|_| holds)?;
        self.hole = None;
        self.resent.remove(&k);
        Some(k)
    }

    // READ repair.

    /// An answer past a READ missing some of its responses showed that all were sent.
    pub fn read_repair_needed(&mut self) {
        self.read_repair_due = true;
    }

    /// Whether READs wait for their missing responses to be asked for (once).
    pub fn take_read_repair(&mut self) -> bool {
        std::mem::take(&mut self.read_repair_due)
    }

    /// Whether the response packet `q` of a READ, shown missing, may be asked for again
    /// at `now`: as a resent packet (see [`Recovery::on_sack`]), but with the round-trip
    /// timer's interval (SRTT + 4·RTTVAR) rather than a round trip and twice its
    /// variation as the time an earlier request for it is given. The answer to such a
    /// request queues behind every response already on its way, as much as the window
    /// lets through, which the round trips of fresh READ requests measure only on
    /// average: with the shorter guard about half the parts asked at 1% loss were asked
    /// twice, the second answer arriving after the READ completed. `newest`: from
    /// [`Recovery::newest_resend_arrived`].
    pub fn read_part_due(&self, q: u32, now: u64, newest: Option<u64>, rtt: &RttEstimator) -> bool {
        let guard = rtt.rto_base().unwrap_or(RESEND_GUARD_NS);
        self.due_after(q, now, newest, guard)
    }

    /// Response packets `q..q + n` of a READ were asked for again at `now`. Returns
    /// whether that is a sign of congestion: lost responses tell congestion from random
    /// loss as a SACK's holes do (a fresh run of two or more).
    pub fn read_part_asked(&mut self, q: u32, n: u32, now: u64) -> bool {
        let fresh = !self.resent.contains_key(&q);
        let congested = fresh && self.note_hole(n >= 2);
        // Every packet of the run: once its first arrives, the rest is no fresh hole.
        for i in 0..n {
            self.note(psn::add(q, i), now);
        }
        congested
    }

    /// Resends of packets before `oldest` were answered: forget them.
    pub fn forget_resent_before(&mut self, oldest: u32) {
        self.resent.retain(|&q, _| !psn::lt(q, oldest));
    }

    /// The order of the newest resend whose packet has `arrived`: a resend made before
    /// it whose packet is still missing was lost again (the path keeps order).
    pub fn newest_resend_arrived(&self, arrived: impl Fn(u32) -> bool) -> Option<u64> {
        self.resent
            .iter()
            .filter(|&(&q, _)| arrived(q))
            .map(|(_, r)| r.seq)
            .max()
    }

    // SACKs.

    /// Whether the peer sends SACKs.
    #[cfg(test)]
    pub fn peer_sacks(&self) -> bool {
        self.peer_sacks
    }

    /// A SACK arrived: the peer sends them. True the first time.
    pub fn sack_arrived(&mut self) -> bool {
        !std::mem::replace(&mut self.peer_sacks, true)
    }

    /// Whether to ask the peer for SACKs at `now`: it holds packets, sends none yet, and
    /// the last ask (at most [`PERMITS_MAX`] of them) is a round trip old.
    pub fn permit_due(&self, now: u64, rtt: &RttEstimator) -> bool {
        self.peer_holds == Some(true)
            && !self.peer_sacks
            && self.permits < PERMITS_MAX
            && (self.permits == 0 || now.saturating_sub(self.permit_at) >= resend_guard(rtt))
    }

    /// A SACK_PERMIT was sent at `now`.
    pub fn permit_sent(&mut self, now: u64) {
        self.permits += 1;
        self.permit_at = now;
    }

    /// Packets at or after `base` that the last SACK showed held: in flight no more, so
    /// the congestion window does not count them.
    pub fn sacked_from(&self, base: u32) -> u32 {
        let Some((e, bits)) = self.board.as_deref() else {
            return 0;
        };
        let from = psn::diff(base, *e);
        if from > SACK_SPAN as i32 {
            return 0;
        }
        bits.count_from(from.max(1) as u32)
    }

    /// A SACK from the peer saying it expects `e` and holds `bits` past it, with
    /// `oldest` the oldest unacknowledged PSN and the packets before `high` sent:
    /// Err(why) when it is ignored; else the holes it shows that are due to be resent, in
    /// PSN order: every packet missing below the highest held one (see [`DUP_THRESH`]),
    /// each at most once per round trip, unless a resend made after it has arrived: the
    /// path keeps order, so that one was lost again (RACK's rule), and it is resent at
    /// once instead of after the round-trip timer. None while a go-back-N or an RNR wait
    /// (`rnr_wait`) resends everything from the oldest anyway.
    ///
    /// Report each hole resent with [`Recovery::sack_hole_resent`], which tells whether
    /// the window is to be cut: only when a new hole is a run of two or more lost
    /// packets and at least [`RUNS_FOR_CONGESTION`] of the last [`HOLE_HISTORY`] holes
    /// were. An overflowing queue (a switch's, a socket buffer) drops what arrives while
    /// it is full, runs of the bursts, while random loss leaves mostly isolated holes (at
    /// 5% random loss one hole in twenty is a run by chance, and sixteen holes hold four
    /// runs with probability 0.7%), which a cut would not prevent and which cost only the
    /// resent packets here. The round trip cannot tell them apart on a host whose own
    /// scheduling queues a window's worth: it grows with the window whether or not
    /// anything overflows (see `cc::Loss::Packet`). A cut at every chance run lets the
    /// window sink to its floor at 5% loss whenever the floor is low (a small round trip
    /// measured early), and stay there.
    #[allow(clippy::too_many_arguments)]
    pub fn on_sack(
        &mut self,
        e: u32,
        bits: SackBitmap,
        oldest: u32,
        high: u32,
        now: u64,
        rnr_wait: bool,
        rtt: &RttEstimator,
    ) -> Result<Vec<SackHole>, &'static str> {
        // The responder expects `e`, so it has every packet before it: `e` lies in the
        // outstanding window (an ACK may have moved `oldest` past it since: then the SACK
        // is older than that ACK), and what it holds was sent.
        let span = psn::diff(high, e);
        if psn::lt(e, oldest) || span <= 0 || span > HOLD_SPAN {
            return Err("SACK outside the outstanding window ignored");
        }
        let top = bits.highest();
        if top.is_some_and(|d| d as i32 >= span) {
            return Err("SACK holding packets never sent ignored");
        }
        match &mut self.board {
            Some(b) => **b = (e, bits),
            none => *none = Some(Box::new((e, bits))),
        }
        self.resent
            .retain(|&q, _| !psn::lt(q, oldest) && psn::lt(q, high));
        let mut holes = Vec::new();
        let Some(top) = top else {
            return Ok(holes);
        };
        if self.retrying || rnr_wait {
            return Ok(holes);
        }
        // Nothing sent after the highest held packet: no later packet will show its holes.
        let tail = psn::add(e, top + 1) == high;
        // The newest resend that the peer now holds.
        let newest_arrived = self.newest_resend_arrived(|q| {
            let d = psn::diff(q, e);
            d > 0 && bits.get(d as u32)
        });
        // The holes below the highest held packet, from the expected PSN up: a word of the
        // bitmap at a time, as most of a deep window is held.
        let mut d = 0;
        // Held packets past the hole `d`: those between two holes are all held.
        let mut above = bits.count_from(1);
        while d < top {
            if !tail && above < DUP_THRESH {
                break;
            }
            let hole = d;
            d = bits.next_clear(d + 1);
            above -= d - hole - 1;
            let q = psn::add(e, hole);
            if !self.due_after(q, now, newest_arrived, resend_guard(rtt)) {
                continue;
            }
            holes.push(SackHole {
                psn: q,
                run: hole + 1 < top && !bits.get(hole + 1),
            });
        }
        Ok(holes)
    }

    /// The hole `h` a SACK showed was resent at `now`. Returns whether that is a sign of
    /// congestion (see [`Recovery::on_sack`]).
    pub fn sack_hole_resent(&mut self, h: SackHole, now: u64) -> bool {
        let congested = !self.resent.contains_key(&h.psn) && self.note_hole(h.run);
        self.note(h.psn, now);
        congested
    }

    /// Whether packet `q` was resent so recently that evidence of it missing may predate
    /// the resend's arrival.
    fn recently_resent(&self, q: u32, now: u64, rtt: &RttEstimator) -> bool {
        self.resent_within(q, now, resend_guard(rtt))
    }

    /// Whether packet `q` was resent less than `guard` before `now`.
    fn resent_within(&self, q: u32, now: u64, guard: u64) -> bool {
        self.resent
            .get(&q)
            .is_some_and(|r| now.saturating_sub(r.at) < guard)
    }

    /// RACK's rule with `guard` as the time a resend is given: `q` is due unless it was
    /// resent less than `guard` ago and no resend made after it has arrived (`newest`).
    fn due_after(&self, q: u32, now: u64, newest: Option<u64>, guard: u64) -> bool {
        let overtaken = match (self.resent.get(&q), newest) {
            (Some(r), Some(n)) => r.seq < n,
            _ => false,
        };
        overtaken || !self.resent_within(q, now, guard)
    }

    /// A fresh hole was found, a run of two or more lost packets when `run`: whether
    /// that is a sign of congestion (a run, and at least [`RUNS_FOR_CONGESTION`] of the
    /// last [`HOLE_HISTORY`] fresh holes were runs).
    fn note_hole(&mut self, run: bool) -> bool {
        self.hole_runs = (self.hole_runs << 1) | u16::from(run);
        let mask = u16::MAX >> (16 - HOLE_HISTORY);
        run && (self.hole_runs & mask).count_ones() >= RUNS_FOR_CONGESTION
    }

    /// Packet `q` was resent (or asked for again) at `now`.
    fn note(&mut self, q: u32, now: u64) {
        self.seq += 1;
        self.resent.insert(
            q,
            Resent {
                at: now,
                seq: self.seq,
            },
        );
    }
}

/// How long a resent hole is given before evidence that still shows it missing resends
/// it again: a round trip and its variation.
fn resend_guard(rtt: &RttEstimator) -> u64 {
    rtt.resend_guard().unwrap_or(RESEND_GUARD_NS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_are_congestion_only_when_they_are_common() {
        let mut r = Recovery::default();
        // Isolated holes: never.
        for i in 0..20 {
            assert!(!r.sack_hole_resent(SackHole { psn: i, run: false }, 0));
        }
        // Three runs among the last sixteen: not yet; the fourth is.
        for i in 0..3 {
            assert!(!r.sack_hole_resent(
                SackHole {
                    psn: 100 + i,
                    run: true
                },
                0
            ));
        }
        assert!(r.sack_hole_resent(
            SackHole {
                psn: 200,
                run: true
            },
            0
        ));
        // A hole resent before is no fresh one.
        assert!(!r.sack_hole_resent(
            SackHole {
                psn: 200,
                run: true
            },
            0
        ));
    }

    #[test]
    fn a_resend_is_due_again_after_a_round_trip_or_once_a_later_one_arrived() {
        let mut r = Recovery::default();
        let mut rtt = RttEstimator::default();
        rtt.on_sample(100_000);
        r.hole_resent(10, 0, true);
        r.hole_resent(20, 1_000, true);
        let guard = rtt.resend_guard().unwrap();
        assert!(!r.due_after(10, guard - 1, None, guard));
        assert!(r.due_after(10, guard, None, guard));
        // 20 was resent after 10 and has arrived: 10 was lost again.
        let newest = r.newest_resend_arrived(|q| q == 20);
        assert!(r.due_after(10, 1_000, newest, guard));
        assert!(!r.due_after(20, 1_000, newest, guard));
    }

    #[test]
    fn the_answer_to_a_resent_hole_tells_whether_the_peer_holds() {
        let mut rtt = RttEstimator::default();
        // An ACK of the hole itself, with more sent: the peer dropped the rest.
        let mut r = Recovery::default();
        assert_eq!(r.selective_repeat(5, 0, false, &rtt), Repeat::Resend);
        assert!(r.hole_resent(5, 0, true), "the loss goes to the controller");
        assert!(r.answered(5, false, 10, 50_000, &mut rtt));
        assert_eq!(r.peer_holds(), Some(false));
        assert_eq!(rtt.smoothed(), 50_000, "the answer measured the round trip");
        // Against such a peer, go back N for a while, then ask again.
        for _ in 0..SR_RETRY_AFTER {
            assert_eq!(r.selective_repeat(7, 0, false, &rtt), Repeat::GoBackN);
        }
        assert_eq!(r.selective_repeat(7, 0, false, &rtt), Repeat::Resend);
        // An ACK past the hole: the peer held what followed it.
        let mut r = Recovery::default();
        r.hole_resent(5, 0, true);
        assert!(!r.answered(8, false, 10, 0, &mut rtt));
        assert_eq!((r.peer_holds(), r.hole()), (Some(true), None));
        // A resend the timer made teaches nothing.
        let mut r = Recovery::default();
        r.hole_resent(5, 0, false);
        assert!(!r.answered(8, false, 10, 0, &mut rtt));
        assert_eq!(r.peer_holds(), None);
        // Once the peer sends SACKs, they judge the loss, not the round trip.
        let mut r = Recovery::default();
        assert!(r.sack_arrived() && !r.sack_arrived());
        assert!(!r.hole_resent(5, 0, true));
    }

    #[test]
    fn a_sack_shows_the_holes_below_its_highest_held_packet() {
        let mut r = Recovery::default();
        let rtt = RttEstimator::default();
        let mut bits = SackBitmap::default();
        // Expected 100; held 102..=106: holes 100 and 101 (a run), nothing sent past 106.
        for d in 2..=6 {
            bits.set(d);
        }
        let holes = r.on_sack(100, bits, 100, 107, 0, false, &rtt).unwrap();
        let want = [
            SackHole {
                psn: 100,
                run: true,
            },
            SackHole {
                psn: 101,
                run: false,
            },
        ];
        assert_eq!(holes, want);
        assert_eq!(r.sacked_from(100), 5);
        assert_eq!(r.sacked_from(105), 2);
        for h in holes {
            r.sack_hole_resent(h, 0);
        }
        // The same SACK within the round trip: nothing is due again.
        assert_eq!(r.on_sack(100, bits, 100, 107, 1, false, &rtt), Ok(vec![]));
        // Outside the outstanding window, or holding packets never sent: ignored.
        assert!(r.on_sack(99, bits, 100, 107, 1, false, &rtt).is_err());
        assert!(r.on_sack(100, bits, 100, 106, 1, false, &rtt).is_err());
        // A go-back-N forgets it all.
        r.on_go_back_n();
        assert_eq!(r.sacked_from(100), 0);
    }
}
