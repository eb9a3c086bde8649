//! Loss response of an RC requester: a congestion window that backs off on loss and grows
//! back as acknowledgements come (TCP's rules counted in packets, with CUBIC's gentler
//! cut). The round trip it reads is measured apart ([`crate::rtt`]).
//!
//! Why: go-back-N resends everything in flight from a loss, so with a fixed window of
//! [`MAX_INFLIGHT_PSNS`] packets a lossy path resends hundreds of packets per loss, many
//! of them lost again. With the window cut on each loss a go-back-N costs about what is
//! really in flight. Against a peer that holds what follows a gap
//! (`qp::Held`), the completer resends the lost packet alone; such a loss cuts the window
//! once per window of packets, and only when it shows congestion: from a peer that sends
//! SACKs, a run of lost packets ([`Cc::on_congestion_loss`]); from one that does not, a
//! round trip grown past twice its minimum ([`Cc::on_loss_of`]).

use softrdma_wire::psn;

use crate::qp::{HOLD_SPAN, MAX_INFLIGHT_PSNS};
use crate::rtt::{RttEstimator, RTO_MIN_NS};

/// The window never shrinks below this many packets: go-back-N needs a few in flight to
/// make progress, and a sequence NAK needs a packet after the lost one to be sent.
pub(crate) const MIN_CWND: u32 = 4;
/// The window's ceiling at path MTU 4096 with a full-size receive buffer (see
/// [`MAX_INFLIGHT_PSNS`]); [`ceiling_for`] gives it for other MTUs and buffers.
pub(crate) const MAX_CWND: u32 = MAX_INFLIGHT_PSNS as u32;

/// The receive buffer the engine assumes until the device says (`Rnic::set_rx_buffer`):
/// the 4 MiB a device asks for, doubled as the kernel reports it.
pub const DEFAULT_RX_BUFFER: usize = 8 << 20;

/// Payload bytes in flight past which a larger window gains nothing: [`MAX_CWND`]
/// packets of 4 KiB.
const INFLIGHT_BYTES: u64 = MAX_CWND as u64 * 4096;

/// The smallest ceiling, whatever the buffer.
const MIN_CEILING: u64 = 16;

/// The window's ceiling for a path MTU of `mtu` bytes and a receive buffer of
/// `rx_buffer` bytes: the packets the buffer holds, and no more than
/// [`INFLIGHT_BYTES`] of payload; at least [`MIN_CEILING`], at most half of
/// [`HOLD_SPAN`].
///
/// Why the buffer: a window it cannot hold overflows it whenever the receiver falls
/// behind, and every datagram dropped there costs a sequence NAK and a resend. Linux
/// charges a datagram about 2·size + 256 bytes of it (the data rounded up to a power of
/// two, plus the buffer's header). A process that is not root gets at most twice
/// `rmem_max` (Debian's default: 416 KiB, 50 datagrams of 4 KiB). The peer's buffer is
/// not known; the device's own is what a peer set up like it got.
///
/// Why the bytes: payload in flight past what the caches hold costs more than the
/// deeper pipe gains on a host (the 8 MiB a device gets as root holds 993 packets of
/// 4 KiB, and those move no more than 512 do on loopback). At MTU 1024 the same bytes
/// are 2,048 packets, which the buffer holds. Never past half of [`HOLD_SPAN`], so that
/// the send goes on for another window past a hole before the span stops it.
pub(crate) fn ceiling_for(mtu: usize, rx_buffer: usize) -> u32 {
    let mtu = mtu.max(1) as u64;
    let held = rx_buffer as u64 / (2 * mtu + 256);
    held.min(INFLIGHT_BYTES / mtu)
        .clamp(MIN_CEILING, HOLD_SPAN as u64 / 2) as u32
}
/// What a loss leaves of the window, in percent. Reno halves; on a lossy path where loss
/// is not congestion (the case a software RoCE meets: a shared NIC, a VM, a tunnel), a
/// gentler cut keeps more in flight, as CUBIC's 0.7 does.
pub(crate) const BETA_PERCENT: u32 = 70;
/// Round-trip growth over twice the minimum that still counts as no queue: a software
/// peer's round trip varies with its scheduling by about this much.
pub(crate) const QUEUE_SLACK_NS: u64 = 20_000;
/// A loss never cuts the window below this multiple of the path's measured
/// bandwidth-delay product (BBR's cwnd gain): random loss on a path that delivers at a
/// high rate leaves the window able to keep that rate, while a queue, which raises the
/// round trip but not the delivery rate, is still bounded to about one BDP.
pub(crate) const BDP_GAIN: u32 = 2;
/// Delivery-rate samples the bandwidth-delay product takes the largest of.
const RATE_SAMPLES: usize = 8;
/// A delivery-rate sample spans a smoothed round trip, and at least this long.
const RATE_SPAN_MIN_NS: u64 = 100_000;

/// One requester's congestion window.
#[derive(Debug, Clone)]
pub(crate) struct Cc {
    /// Packets that may be in flight (unacknowledged) at once.
    pub cwnd: u32,
    /// What `cwnd` never grows past ([`ceiling_for`] the path MTU).
    pub ceiling: u32,
    /// Slow start below it (the window doubles per round trip), linear growth above.
    pub ssthresh: u32,
    /// Packets acknowledged toward the next increment in linear growth.
    acc: u32,
    /// The oldest unacknowledged PSN as of the last acknowledgement, to count what the
    /// next one acknowledges.
    pub una: u32,
    /// One past the highest PSN sent when the window was last cut by a selective
    /// repeat: losses of packets sent before it belong to the same episode.
    recover: Option<u32>,
    /// Packets acknowledged so far, and (time, that count) where the delivery-rate
    /// sample under way began.
    delivered: u64,
    rate_from: Option<(u64, u64)>,
    /// The latest delivery-rate samples, packets per second, each over at least a round
    /// trip; the largest is the path's rate (BBR's windowed maximum).
    rates: [u64; RATE_SAMPLES],
    rates_at: usize,
    /// The window and threshold before the last cut that only the round trip judged
    /// ([`Cc::on_loss_of`]), while no cut with other evidence came after it: what
    /// [`Cc::undo_rtt_cut`] restores.
    rtt_cut: Option<(u32, u32)>,
}

impl Default for Cc {
    /// A new connection sends at the full window, as an RDMA NIC does: the window only
    /// matters once the path has shown loss.
    fn default() -> Self {
        Cc {
            cwnd: MAX_CWND,
            ceiling: MAX_CWND,
            ssthresh: MAX_CWND,
            acc: 0,
            una: 0,
            recover: None,
            delivered: 0,
            rate_from: None,
            rates: [0; RATE_SAMPLES],
            rates_at: 0,
            rtt_cut: None,
        }
    }
}

impl Cc {
    /// The path MTU is (now) `mtu`, the receive buffer `rx_buffer` bytes: the ceiling
    /// follows them ([`ceiling_for`]). A window at the old ceiling moves to the new one,
    /// as a new connection starts at the full window; one cut by loss stays where it is,
    /// under the new ceiling.
    pub fn set_mtu(&mut self, mtu: usize, rx_buffer: usize) {
        let c = ceiling_for(mtu, rx_buffer);
        if self.cwnd >= self.ceiling {
            self.cwnd = c;
        }
        if self.ssthresh >= self.ceiling {
            self.ssthresh = c;
        }
        self.ceiling = c;
        self.cwnd = self.cwnd.min(c);
        self.ssthresh = self.ssthresh.min(c);
    }

    /// `n` more packets were acknowledged: the window grows (by `n` in slow start, by one
    /// per window's worth above `ssthresh`).
    pub fn on_acked(&mut self, n: u32) {
        if n == 0 {
            return;
        }
        if self.cwnd < self.ssthresh {
            self.cwnd = self.cwnd.saturating_add(n).min(self.ssthresh);
            return;
        }
        self.acc = self.acc.saturating_add(n);
        while self.acc >= self.cwnd && self.cwnd < self.ceiling {
            self.acc -= self.cwnd;
            self.cwnd += 1;
        }
        if self.cwnd >= self.ceiling {
            self.acc = 0;
        }
    }

    /// A loss: the window shrinks to [`BETA_PERCENT`] of itself, not below the
    /// bandwidth-delay floor.
    fn cut(&mut self, rtt: &RttEstimator) {
        self.rtt_cut = None;
        self.ssthresh = (self.cwnd * BETA_PERCENT / 100)
            .max(self.bdp_floor(rtt))
            .clamp(MIN_CWND, self.ceiling);
        self.cwnd = self.cwnd.min(self.ssthresh);
        self.acc = 0;
    }

    /// The loss of packet `p`, shown while the packets before `high` had been sent: the
    /// window is cut once per window of packets, as NewReno's recovery point does: the
    /// losses of packets sent before the last cut are the same episode, which that cut
    /// answered already. Returns whether it cut.
    ///
    /// A loss while the round trip is near its minimum is not congestion (nothing is
    /// queueing on the path: a lossy link, a busy host dropping at random) and cuts
    /// nothing; with a selective repeat it costs one packet. Congestion shows as a round
    /// trip grown past twice its minimum (plus [`QUEUE_SLACK_NS`]), and that loss cuts.
    pub fn on_loss_of(&mut self, p: u32, high: u32, rtt: &RttEstimator) -> bool {
        if self.recover.is_some_and(|r| psn::lt(p, r)) || !queueing(rtt) {
            return false;
        }
        let before = (self.cwnd, self.ssthresh);
        self.cut(rtt);
        self.recover = Some(high);
        self.rtt_cut = Some(before);
        true
    }

    /// The peer turned out to send SACKs: a cut that only the round trip judged is
    /// undone. Its SACKs show whether losses come in runs, the sign of congestion that
    /// `sack::on_sack` cuts on; the round trip on a host queues a window's worth whether
    /// or not anything overflows, so such a cut would hit the first random loss of every
    /// connection between softrdma peers (made before the SACKs were asked for), and the
    /// window would then regrow one packet per round trip.
    pub fn undo_rtt_cut(&mut self) {
        if let Some((cwnd, ssthresh)) = self.rtt_cut.take() {
            self.cwnd = self.cwnd.max(cwnd);
            self.ssthresh = self.ssthresh.max(ssthresh);
            self.acc = 0;
            self.recover = None;
        }
    }

    /// The round-trip timer expired at `now`. Returns whether that cut the window.
    ///
    /// When an answer from the peer arrived within the timer's interval (before any
    /// backoff), the path is carrying the rest: the expiry is one lost packet (a resent
    /// one, the tail of what was sent, a READ's request for some of its responses, or
    /// their answer), which the caller resends, and nothing says the path is congested
    /// (runs of losses do: see `sack::on_sack` and `completer::ask_read_holes`), so the
    /// window stays. Otherwise the path has gone quiet: a loss.
    pub fn on_rtt_timeout(&mut self, now: u64, rtt: &RttEstimator) -> bool {
        let interval = rtt.rto_base().unwrap_or(RTO_MIN_NS);
        if rtt.answered_within(now, interval) {
            return false;
        }
        self.cut(rtt);
        true
    }

    /// Nothing came back for a whole local ACK timeout: start again from the smallest
    /// window.
    pub fn on_timeout(&mut self) {
        self.ssthresh = (self.cwnd * BETA_PERCENT / 100).max(MIN_CWND);
        self.cwnd = MIN_CWND;
        self.acc = 0;
    }

    /// A loss that shows an overflowing queue (a run of lost packets, see
    /// `sack::on_sack`): the window is cut whatever the round trip, once per window of
    /// packets as in [`Cc::on_loss_of`]. Returns whether it cut.
    pub fn on_congestion_loss(&mut self, p: u32, high: u32, rtt: &RttEstimator) -> bool {
        if self.recover.is_some_and(|r| psn::lt(p, r)) {
            return false;
        }
        self.cut(rtt);
        self.recover = Some(high);
        true
    }

    /// What a loss leaves of the window at least: [`BDP_GAIN`] times the largest recent
    /// delivery rate over the smallest round trip, in packets.
    fn bdp_floor(&self, rtt: &RttEstimator) -> u32 {
        let rate = self.rates.iter().max().copied().unwrap_or(0);
        let bdp = u128::from(rate) * u128::from(rtt.min()) / 1_000_000_000;
        (bdp.min(u128::from(self.ceiling)) as u32).saturating_mul(BDP_GAIN)
    }

    /// The oldest unacknowledged PSN is now `una`: the packets before it were
    /// acknowledged at `now`, a delivery-rate sample over the smoothed round trip.
    /// Returns how many.
    pub fn advance(&mut self, una: u32, now: u64, rtt: &RttEstimator) -> u32 {
        let n = psn::diff(una, self.una);
        if n <= 0 {
            return 0;
        }
        self.una = una;
        self.delivered += n as u64;
        let (t0, d0) = *self.rate_from.get_or_insert((now, self.delivered));
        let span = now.saturating_sub(t0);
        if span >= rtt.smoothed().max(RATE_SPAN_MIN_NS) {
            let rate = u128::from(self.delivered - d0) * 1_000_000_000 / u128::from(span);
            self.rates[self.rates_at] = rate.min(u128::from(u64::MAX)) as u64;
            self.rates_at = (self.rates_at + 1) % RATE_SAMPLES;
            self.rate_from = Some((now, self.delivered));
        }
        n as u32
    }
}

/// Whether the latest round trip shows packets queueing on the path: past twice the
/// smallest seen plus [`QUEUE_SLACK_NS`], or no sample yet (assume the worst).
fn queueing(rtt: &RttEstimator) -> bool {
    rtt.min() == 0 || rtt.latest() > rtt.min().saturating_mul(2).saturating_add(QUEUE_SLACK_NS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ceiling_is_what_the_receive_buffer_holds_up_to_2_mib_of_payload() {
        let buf = DEFAULT_RX_BUFFER;
        // A full-size buffer: 2 MiB of payload.
        assert_eq!(ceiling_for(4096, buf), MAX_CWND);
        assert_eq!(ceiling_for(2048, buf), 1024);
        assert_eq!(ceiling_for(1024, buf), 2048);
        assert_eq!(
            ceiling_for(512, buf),
            HOLD_SPAN as u32 / 2,
            "capped by the span"
        );
        assert_eq!(
            ceiling_for(4096, usize::MAX),
            MAX_CWND,
            "capped by the bytes"
        );
        // A process that is not root, with Debian's rmem_max: what its buffer holds.
        assert_eq!(ceiling_for(4096, 2 * 212_992), 50);
        assert_eq!(ceiling_for(1024, 2 * 212_992), 184);
        assert_eq!(ceiling_for(1024, 0), 16, "never below the least");

        // A fresh window takes the path's ceiling, and grows no further.
        let mut c = Cc::default();
        let r = RttEstimator::default();
        c.set_mtu(1024, buf);
        assert_eq!((c.cwnd, c.ssthresh, c.ceiling), (2048, 2048, 2048));
        c.on_acked(5000);
        assert_eq!(c.cwnd, 2048);
        // A window cut by loss stays where it was when the MTU changes; one above the new
        // ceiling comes down to it.
        c.cut(&r);
        let cut = 2048 * BETA_PERCENT / 100;
        assert_eq!(c.cwnd, cut);
        c.set_mtu(1024, buf);
        assert_eq!((c.cwnd, c.ssthresh, c.ceiling), (cut, cut, 2048));
        c.set_mtu(2048, buf);
        assert_eq!((c.cwnd, c.ssthresh, c.ceiling), (1024, 1024, 1024));
        // It grows back to the ceiling, one packet per window.
        c.set_mtu(1024, buf);
        c.cut(&r);
        for _ in 0..2000 {
            c.on_acked(c.cwnd);
        }
        assert_eq!(c.cwnd, 2048);
    }

    #[test]
    fn window_shrinks_on_loss_and_grows_back() {
        let mut c = Cc::default();
        let r = RttEstimator::default();
        assert_eq!(c.cwnd, MAX_CWND);
        c.cut(&r);
        let w = MAX_CWND * BETA_PERCENT / 100;
        assert_eq!((c.cwnd, c.ssthresh), (w, w));
        // Linear growth above ssthresh: one packet per window acknowledged.
        c.on_acked(w);
        assert_eq!(c.cwnd, w + 1);
        c.on_timeout();
        assert_eq!(c.cwnd, MIN_CWND);
        assert_eq!(c.ssthresh, (w + 1) * BETA_PERCENT / 100);
        // Slow start up to ssthresh.
        c.on_acked(MIN_CWND);
        assert_eq!(c.cwnd, 2 * MIN_CWND);
        c.on_acked(10_000);
        assert_eq!(c.cwnd, c.ssthresh);
        // A round-trip timer expiry on a path gone quiet is a loss, not a collapse.
        let before = c.cwnd;
        assert!(c.on_rtt_timeout(1_000_000, &r));
        assert_eq!(c.cwnd, (before * BETA_PERCENT / 100).max(MIN_CWND));
        for _ in 0..40 {
            c.cut(&r);
        }
        assert_eq!(c.cwnd, MIN_CWND);
        for _ in 0..100_000 {
            c.on_acked(64);
        }
        assert_eq!(c.cwnd, MAX_CWND, "never past the ceiling");
    }

    #[test]
    fn a_selective_repeat_cuts_only_under_queueing_and_once_per_window() {
        let mut c = Cc::default();
        let mut r = RttEstimator::default();
        // No sample yet: assume the worst.
        c.on_loss_of(10, 100, &r);
        let w = MAX_CWND * BETA_PERCENT / 100;
        assert_eq!(c.cwnd, w);
        // A loss of a packet sent before that cut: the same episode.
        c.on_loss_of(99, 200, &r);
        assert_eq!(c.cwnd, w);
        // Round trips near their minimum: a random loss, no cut.
        r.on_sample(100_000);
        r.on_sample(110_000);
        c.on_loss_of(150, 300, &r);
        assert_eq!(c.cwnd, w);
        // A round trip past twice the minimum plus the slack: queueing, a cut.
        r.on_sample(100_000 * 2 + QUEUE_SLACK_NS + 1);
        c.on_loss_of(300, 400, &r);
        assert_eq!(c.cwnd, w * BETA_PERCENT / 100);
    }

    #[test]
    fn a_cut_only_the_round_trip_judged_is_undone_once_sacks_come() {
        let mut c = Cc::default();
        let r = RttEstimator::default();
        c.on_loss_of(10, 100, &r);
        c.on_loss_of(150, 300, &r);
        let w = MAX_CWND * BETA_PERCENT / 100;
        assert_eq!(c.cwnd, w * BETA_PERCENT / 100);
        c.undo_rtt_cut();
        assert_eq!(
            (c.cwnd, c.ssthresh),
            (w, w),
            "back to before the last such cut"
        );
        // Undone once: nothing more to restore.
        c.undo_rtt_cut();
        assert_eq!(c.cwnd, w);
        // The episode is over: a loss of a packet sent before it may cut again.
        c.on_loss_of(200, 400, &r);
        assert_eq!(c.cwnd, w * BETA_PERCENT / 100);

        // A cut with other evidence after it (a run of losses, a silent timer) stays.
        let mut c = Cc::default();
        let r = RttEstimator::default();
        c.on_loss_of(10, 100, &r);
        c.on_congestion_loss(120, 200, &r);
        let cut = c.cwnd;
        c.undo_rtt_cut();
        assert_eq!(c.cwnd, cut);
        let mut c = Cc::default();
        let r = RttEstimator::default();
        c.on_loss_of(10, 100, &r);
        assert!(c.on_rtt_timeout(u64::MAX / 2, &r));
        let cut = c.cwnd;
        c.undo_rtt_cut();
        assert_eq!(c.cwnd, cut);
        // Nothing cut: nothing to undo.
        let mut c = Cc::default();
        c.undo_rtt_cut();
        assert_eq!((c.cwnd, c.ssthresh), (MAX_CWND, MAX_CWND));
    }

    #[test]
    fn a_loss_leaves_twice_the_measured_bdp() {
        let mut c = Cc::default();
        let mut r = RttEstimator::default();
        // A 100 µs round trip, and 100 packets acknowledged every 100 µs for a while: a
        // delivery rate of 10^6 packets per second, a BDP of 100 packets.
        r.time(0, 0, false);
        let mut t = 0;
        let mut una = 0;
        for _ in 0..=RATE_SAMPLES {
            t += 100_000;
            una += 100;
            c.advance(una, t, &r);
            r.on_acked_below(una, t);
        }
        let floor = 100 * BDP_GAIN;
        assert!(floor < MAX_CWND * BETA_PERCENT / 100 * BETA_PERCENT / 100);
        for _ in 0..20 {
            c.cut(&r);
        }
        assert_eq!((c.cwnd, c.ssthresh), (floor, floor));
        // A stall and then a burst (a gap that fills acknowledges what was held behind
        // it at once): the largest sample still stands.
        t += 100_000;
        c.advance(una, t, &r);
        t += 100_000;
        una += 100;
        c.advance(una, t, &r);
        c.cut(&r);
        assert_eq!(c.cwnd, floor);
        // The rate falls to a tenth (a queue, or a slower path): so does the floor.
        for _ in 0..RATE_SAMPLES {
            t += 100_000;
            una += 10;
            c.advance(una, t, &r);
        }
        for _ in 0..20 {
            c.cut(&r);
        }
        assert_eq!(c.cwnd, 10 * BDP_GAIN);
        // A timeout still collapses the window.
        c.on_timeout();
        assert_eq!(c.cwnd, MIN_CWND);
    }

    /// An expiry while answers keep arriving is one lost packet on a path carrying the
    /// rest: neither the window nor the timer changes. One after a quiet interval cuts.
    #[test]
    fn an_expiry_cuts_only_a_path_gone_quiet() {
        let mut c = Cc::default();
        let mut r = RttEstimator::default();
        r.on_sample(1_000_000);
        // SRTT 1 ms, RTTVAR 0.5 ms: the timer's interval is 3 ms.
        assert_eq!(r.rto(None), Some(3_000_000));
        r.on_answer(0, true, 10_000_000);
        assert!(
            !c.on_rtt_timeout(12_999_999, &r),
            "answered 3 ms ago, less a nanosecond"
        );
        assert_eq!(c.cwnd, MAX_CWND);
        assert!(
            c.on_rtt_timeout(13_000_000, &r),
            "nothing for a whole interval"
        );
        assert_eq!(c.cwnd, MAX_CWND * BETA_PERCENT / 100);
        // The quiet interval is the one before any backoff: an answer stops the cuts.
        r.on_answer(0, true, 20_000_000);
        assert!(!c.on_rtt_timeout(22_000_000, &r));
    }
}
