//! The round trip of an RC requester's path and its retransmission timer (RFC 6298): a
//! smoothed round trip and its mean deviation, the smallest and the latest sample, the
//! one packet being timed, and the timer's backoff.
//!
//! The estimate serves more than the congestion window: the round-trip timer resends a
//! lost tail after about a round trip instead of the QP's local ACK timeout, and the
//! loss recovery gives a resent packet a round trip to arrive before evidence that it is
//! still missing counts. So it stands alone, and the congestion controller reads it.
//!
//! The QP's timeout attribute keeps its IBTA meaning: the round-trip timer resends early
//! but spends no retry; `retry_cnt` retries are counted only against the local ACK
//! timeout, run from the last progress, so a peer that is gone still ends in
//! RETRY_EXC_ERR after the QP's timeout.

use softrdma_wire::psn;

/// The round-trip timer never fires sooner than this: a software peer's round trip
/// includes its scheduling, and a spurious resend costs a window of packets.
pub(crate) const RTO_MIN_NS: u64 = 250_000;
/// Backing off doubles the round-trip timer up to this many times (×64).
const MAX_BACKOFF: u8 = 6;

/// One requester's round-trip estimate and retransmission timer interval.
#[derive(Debug, Clone, Default)]
pub(crate) struct RttEstimator {
    /// Smoothed round trip and its mean deviation, ns; `srtt` 0 until the first sample.
    srtt: u64,
    rttvar: u64,
    /// The smallest and the latest sample, ns (0 before the first).
    min: u64,
    latest: u64,
    /// A packet being timed: (its PSN, when it was sent). Never a resent one (Karn).
    probe: Option<(u32, u64)>,
    /// When the latest answer from the peer arrived (any response inside the window), ns;
    /// None before the first.
    answered_at: Option<u64>,
    /// Consecutive round-trip timer expiries without progress (each doubles the timer).
    backoff: u8,
}

impl RttEstimator {
    /// A round-trip sample (RFC 6298 2.2–2.3).
    pub fn on_sample(&mut self, rtt: u64) {
        let rtt = rtt.max(1);
        self.latest = rtt;
        if self.min == 0 || rtt < self.min {
            self.min = rtt;
        }
        if self.srtt == 0 {
            self.srtt = rtt.max(1);
            self.rttvar = rtt / 2;
        } else {
            let err = self.srtt.abs_diff(rtt);
            self.rttvar = (3 * self.rttvar + err) / 4;
            self.srtt = ((7 * self.srtt + rtt) / 8).max(1);
        }
    }

    /// Whether the round trip has been measured.
    pub fn has_sample(&self) -> bool {
        self.srtt != 0
    }

    /// The smoothed round trip, ns (0 before the first sample).
    pub fn smoothed(&self) -> u64 {
        self.srtt
    }

    /// The smallest sample, ns (0 before the first).
    pub fn min(&self) -> u64 {
        self.min
    }

    /// The latest sample, ns (0 before the first).
    pub fn latest(&self) -> u64 {
        self.latest
    }

    /// Consecutive expiries of the round-trip timer without progress.
    pub fn backoff(&self) -> u8 {
        self.backoff
    }

    /// The round-trip timer expired, or the local ACK timeout did, with the path quiet:
    /// the next interval doubles (RFC 6298 5.5), up to ×64.
    pub fn back_off(&mut self) {
        self.backoff = (self.backoff + 1).min(MAX_BACKOFF);
    }

    /// Packets were acknowledged: the timer's backoff ends.
    pub fn on_progress(&mut self) {
        self.backoff = 0;
    }

    /// The round-trip timer's interval: SRTT + 4·RTTVAR, at least [`RTO_MIN_NS`], doubled
    /// per backoff, and never past `limit` (the QP's local ACK timeout, when it has one).
    /// None before the first sample.
    ///
    /// Backing off stops at half of `limit` (or at the interval itself when that is
    /// longer): the local ACK timeout runs from the last progress and spends a retry each
    /// time, and a round-trip timer backed off to it would never fire first. So between
    /// two local ACK timeouts the round-trip timer still resends once without spending
    /// one; otherwise a round trip measured at a few milliseconds (a reordering path)
    /// backs off past the ACK timeout after a single expiry, and a READ whose request or
    /// response is lost seven more times in a row ends in RETRY_EXC_ERR.
    pub fn rto(&self, limit: Option<u64>) -> Option<u64> {
        let base = self.rto_base()?;
        let t = base.saturating_mul(1 << self.backoff);
        Some(limit.map_or(t, |l| t.min((l / 2).max(base)).min(l)))
    }

    /// The round-trip timer's interval before any backoff: SRTT + 4·RTTVAR, at least
    /// [`RTO_MIN_NS`]. None before the first sample.
    pub fn rto_base(&self) -> Option<u64> {
        (self.srtt != 0).then(|| {
            self.srtt
                .saturating_add(self.rttvar.saturating_mul(4))
                .max(RTO_MIN_NS)
        })
    }

    /// How long a resent packet is given to arrive before evidence that it is still
    /// missing counts: a round trip and twice its variation. None before the first sample.
    pub fn resend_guard(&self) -> Option<u64> {
        (self.srtt != 0).then(|| self.srtt.saturating_add(self.rttvar.saturating_mul(2)))
    }

    /// Whether an answer from the peer arrived less than `interval` before `now`.
    pub fn answered_within(&self, now: u64, interval: u64) -> bool {
        self.answered_at
            .is_some_and(|t| now.saturating_sub(t) < interval)
    }

    /// Time the packet `p` sent at `now` unless one is being timed already; `resend`
    /// packets are never timed (their acknowledgement may answer the first copy).
    pub fn time(&mut self, p: u32, now: u64, resend: bool) {
        if self.probe.is_none() && !resend {
            self.probe = Some((p, now));
        }
    }

    /// Time nothing: what is answered next measures something other than the round trip
    /// (a wait for the RNR timer, a local ACK timeout).
    pub fn stop_timing(&mut self) {
        self.probe = None;
    }

    /// The packet being timed, if any: (its PSN, when it was sent).
    #[cfg(test)]
    pub fn timed(&self) -> Option<(u32, u64)> {
        self.probe
    }

    /// Packets are about to be sent again (a go-back-N, a selective repeat): an answer
    /// covering the timed packet may then answer its second copy, so it is no longer
    /// timed (Karn) — unless nothing has been measured yet. Then it keeps its first send
    /// time: an answer to the second copy measures more than the round trip, never less,
    /// and the round-trip timer that estimate gives still fires no later than the local
    /// ACK timeout. Dropping it instead leaves a connection that loses a packet every
    /// round trip from the start with no estimate at all (only never-sent packets are
    /// timed), so every loss whose evidence is missing too waits for the local ACK
    /// timeout and spends a retry.
    pub fn on_resend(&mut self) {
        if self.has_sample() {
            self.probe = None;
        }
    }

    /// An answer from the peer covering the request packets before `p` (and `p` itself
    /// when `inclusive`: an ACK of `p`, a READ response or atomic ACK at `p`) arrived at
    /// `now`. If it covers the timed packet, that is a round-trip sample, whether or not
    /// the oldest unacknowledged PSN moves past it: a READ or atomic whose response was
    /// lost holds that PSN, and the ACKs past it still answer the packets they cover.
    pub fn on_answer(&mut self, p: u32, inclusive: bool, now: u64) {
        self.answered_at = Some(now);
        if let Some((q, t)) = self.probe {
            if psn::lt(q, p) || (inclusive && q == p) {
                self.probe = None;
                self.on_sample(now.saturating_sub(t));
            }
        }
    }

    /// The oldest unacknowledged PSN moved to `una` at `now`: a timed packet before it
    /// gives a sample.
    pub fn on_acked_below(&mut self, una: u32, now: u64) {
        if let Some((p, t)) = self.probe {
            if psn::lt(p, una) {
                self.probe = None;
                self.on_sample(now.saturating_sub(t));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rto_follows_the_samples_within_its_bounds() {
        let mut r = RttEstimator::default();
        assert_eq!(r.rto(Some(1 << 30)), None, "no sample yet");
        r.time(100, 1_000, false);
        r.time(101, 2_000, false);
        assert_eq!(r.timed(), Some((100, 1_000)), "one packet timed at a time");
        r.on_acked_below(101, 3_001_000);
        assert_eq!(r.timed(), None);
        // 3 ms: SRTT 3 ms, RTTVAR 1.5 ms, RTO 9 ms.
        assert_eq!(r.rto(None), Some(9_000_000));
        assert_eq!(
            r.rto(Some(5_000_000)),
            Some(5_000_000),
            "capped by the QP timeout"
        );
        r.back_off();
        assert_eq!(r.rto(None), Some(18_000_000), "backed off");
        assert_eq!(
            r.rto(Some(20_000_000)),
            Some(10_000_000),
            "backed off to half the QP timeout at most"
        );
        assert_eq!(
            r.rto(Some(12_000_000)),
            Some(9_000_000),
            "not below the interval itself"
        );
        r.on_progress();
        assert_eq!(r.rto(None), Some(9_000_000));
        for _ in 0..10 {
            r.back_off();
        }
        assert_eq!(r.rto(None), Some(9_000_000 << MAX_BACKOFF), "at most ×64");
        r.on_progress();
        // Tiny samples: the floor.
        for _ in 0..50 {
            r.on_sample(10_000);
        }
        assert_eq!(r.rto(None), Some(RTO_MIN_NS));
        // A resent packet is not timed.
        r.time(200, 0, true);
        assert_eq!(r.timed(), None);
        // Across the PSN wrap.
        r.time(0xFF_FFFE, 0, false);
        r.on_acked_below(1, 500_000);
        assert_eq!((r.timed(), r.latest()), (None, 500_000));
    }

    #[test]
    fn an_answer_covering_the_timed_packet_measures_and_karn_waits_for_a_first_sample() {
        let mut r = RttEstimator::default();
        r.time(10, 1_000, false);
        // A go-back-N before any sample keeps the first send time.
        r.on_resend();
        assert_eq!(r.timed(), Some((10, 1_000)));
        // A NAK at the timed PSN does not cover it; an ACK past it does, though the
        // oldest unacknowledged PSN never moved.
        r.on_answer(10, false, 2_000);
        assert_eq!(r.timed(), Some((10, 1_000)));
        r.on_answer(12, true, 401_000);
        assert_eq!(r.timed(), None);
        // 400 µs: SRTT 400 µs, RTTVAR 200 µs.
        assert_eq!(r.rto(None), Some(1_200_000));
        assert_eq!(r.resend_guard(), Some(800_000));
        // With a sample, Karn: a resend ends the timing.
        r.time(20, 500_000, false);
        r.on_resend();
        assert_eq!(r.timed(), None);
        r.time(30, 600_000, false);
        r.on_answer(30, true, 700_000);
        assert_eq!(r.timed(), None);
        assert!(r.answered_within(1_000_000, 300_001));
        assert!(!r.answered_within(1_000_000, 300_000));
    }

    #[test]
    fn the_smallest_and_latest_samples_are_kept() {
        let mut r = RttEstimator::default();
        assert_eq!((r.min(), r.latest(), r.smoothed()), (0, 0, 0));
        r.on_sample(100);
        r.on_sample(50);
        r.on_sample(80);
        assert_eq!((r.min(), r.latest()), (50, 80));
        assert!(r.has_sample());
    }
}
