//! Loss response of an RC requester: a congestion window that backs off on loss and grows
//! back as acknowledgements come (TCP's rules counted in packets, with CUBIC's gentler
//! cut), and a retransmission timer from the measured round-trip time (RFC 6298).
//!
//! Why: go-back-N resends everything in flight from a loss, so with a fixed window of
//! [`MAX_INFLIGHT_PSNS`] packets a lossy path resends hundreds of packets per loss, many
//! of them lost again; and a lost last packet waits for the QP's local ACK timeout (67 ms
//! at the usual `timeout` 14) before anything is resent. With the window cut on each
//! loss a go-back-N costs about what is really in flight, and the RTT timer resends a
//! lost tail after about a round trip. Against a peer that holds what follows a gap
//! (`qp::Held`), the completer resends the lost packet alone; such a loss cuts the window
//! once per window of packets, and only when it shows congestion: from a peer that sends
//! SACKs, a run of lost packets ([`Cc::on_congestion_loss`]); from one that does not, a
//! round trip grown past twice its minimum ([`Cc::on_loss_of`]).
//!
//! The QP's timeout attribute keeps its IBTA meaning: the RTT timer resends early but
//! spends no retry; `retry_cnt` retries are counted only against the local ACK timeout,
//! run from the last progress, so a peer that is gone still ends in RETRY_EXC_ERR after
//! the same time as before.

use softrdma_wire::psn;

use crate::qp::{HOLD_SPAN, MAX_INFLIGHT_PSNS};

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
/// behind. Linux charges a datagram about 2·size + 256 bytes of it (the data rounded up to
/// a power of two, plus the buffer's header). A process that is not root gets at most
/// twice `rmem_max` (Debian's default: 416 KiB, 50 datagrams of 4 KiB); with the fixed
/// 512 of before, such a process resent up to a sixth of its packets on loopback at MTU
/// 4096, and moved about 70% of what it moves with 50. The peer's buffer is not known;
/// the device's own is what a peer set up like it got.
///
/// Why the bytes: the 8 MiB a device gets as root holds 993 packets of 4 KiB, and 993 in
/// flight moved a few per cent less than 512 on loopback (more memory in flight than the
/// caches hold). At MTU 1024 the same bytes are 2,048 packets, which the buffer holds.
/// Never past half of [`HOLD_SPAN`], so that the send goes on for another window past a
/// hole before the span stops it.
pub(crate) fn ceiling_for(mtu: usize, rx_buffer: usize) -> u32 {
    let mtu = mtu.max(1) as u64;
    let held = rx_buffer as u64 / (2 * mtu + 256);
    held.min(INFLIGHT_BYTES / mtu)
        .clamp(MIN_CEILING, HOLD_SPAN as u64 / 2) as u32
}
/// The RTT timer never fires sooner than this: a software peer's round trip includes
/// its scheduling, and a spurious resend costs a window of packets.
pub(crate) const RTO_MIN_NS: u64 = 250_000;
/// What a loss leaves of the window, in percent. Reno halves; on a lossy path where loss
/// is not congestion (the case a software RoCE meets: a shared NIC, a VM, a tunnel), a
/// gentler cut keeps more in flight, as CUBIC's 0.7 does.
pub(crate) const BETA_PERCENT: u32 = 70;
/// Round-trip growth over twice the minimum that still counts as no queue: a software
/// peer's round trip varies with its scheduling by about this much.
pub(crate) const QUEUE_SLACK_NS: u64 = 20_000;
/// Backing off doubles the RTT timer up to this many times (×64).
const MAX_BACKOFF: u8 = 6;
/// A loss never cuts the window below this multiple of the path's measured
/// bandwidth-delay product (BBR's cwnd gain): random loss on a path that delivers at a
/// high rate leaves the window able to keep that rate, while a queue, which raises the
/// round trip but not the delivery rate, is still bounded to about one BDP.
pub(crate) const BDP_GAIN: u32 = 2;
/// Delivery-rate samples the bandwidth-delay product takes the largest of.
const RATE_SAMPLES: usize = 8;
/// A delivery-rate sample spans a smoothed round trip, and at least this long.
const RATE_SPAN_MIN_NS: u64 = 100_000;

/// One requester's window and round-trip estimate.
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
    /// Smoothed RTT and its mean deviation, ns; `srtt` 0 until the first sample.
    srtt: u64,
    rttvar: u64,
    /// A packet being timed: (its PSN, when it was sent). Never a resent one (Karn).
    pub probe: Option<(u32, u64)>,
    /// The oldest unacknowledged PSN as of the last acknowledgement, to count what the
    /// next one acknowledges.
    pub una: u32,
    /// Consecutive RTT timer expiries without progress (each doubles the timer).
    pub backoff: u8,
    /// The smallest and the latest round-trip sample, ns (0 before the first).
    min_rtt: u64,
    last_rtt: u64,
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
    /// When the latest answer from the peer arrived (any response inside the window), ns;
    /// None before the first.
    answered_at: Option<u64>,
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
            srtt: 0,
            rttvar: 0,
            probe: None,
            una: 0,
            backoff: 0,
            min_rtt: 0,
            last_rtt: 0,
            recover: None,
            delivered: 0,
            rate_from: None,
            rates: [0; RATE_SAMPLES],
            rates_at: 0,
            answered_at: None,
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
    /// per window's worth above `ssthresh`), and the timer's backoff ends.
    pub fn on_acked(&mut self, n: u32) {
        if n == 0 {
            return;
        }
        self.backoff = 0;
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

    /// A loss shown by the peer (sequence NAK, a response past a lost one), or a lost tail
    /// resent by the round-trip timer: the window shrinks to [`BETA_PERCENT`] of itself.
    pub fn on_loss(&mut self) {
        self.rtt_cut = None;
        self.ssthresh = (self.cwnd * BETA_PERCENT / 100)
            .max(self.bdp_floor())
            .clamp(MIN_CWND, self.ceiling);
        self.cwnd = self.cwnd.min(self.ssthresh);
        self.acc = 0;
        self.on_resend();
    }

    /// The loss of packet `p`, shown while the packets before `high` had been sent: the
    /// window is cut once per window of packets, as NewReno's recovery point does: the
    /// losses of packets sent before the last cut are the same episode, which that cut
    /// answered already.
    ///
    /// A loss while the round trip is near its minimum is not congestion (nothing is
    /// queueing on the path: a lossy link, a busy host dropping at random) and cuts
    /// nothing; with a selective repeat it costs one packet. Congestion shows as a round
    /// trip grown past twice its minimum (plus [`QUEUE_SLACK_NS`]), and that loss cuts.
    pub fn on_loss_of(&mut self, p: u32, high: u32) {
        if self.recover.is_some_and(|r| psn::lt(p, r)) || !self.queueing() {
            return;
        }
        let before = (self.cwnd, self.ssthresh);
        self.on_loss();
        self.recover = Some(high);
        self.rtt_cut = Some(before);
    }

    /// The peer turned out to send SACKs: a cut that only the round trip judged is
    /// undone. Its SACKs show whether losses come in runs, the sign of congestion that
    /// `sack::on_sack` cuts on; the round trip on a host queues a window's worth whether
    /// or not anything overflows, so it cut for the first random loss of every connection
    /// between softrdma peers (made before the SACKs were asked for), and the window then
    /// regrew one packet per round trip: at 1% loss, the first quarter of a 5,000-WRITE run
    /// spent below the full window.
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
    /// (runs of losses do: see `sack::on_sack` and `completer::ask_read_holes`), so
    /// neither the window nor the timer changes. Otherwise the path has gone quiet: a
    /// loss, and the timer backs off.
    pub fn on_rtt_timeout(&mut self, now: u64) -> bool {
        let interval = self.rto_base().unwrap_or(RTO_MIN_NS);
        if self
            .answered_at
            .is_some_and(|t| now.saturating_sub(t) < interval)
        {
            return false;
        }
        self.on_loss();
        self.backoff = (self.backoff + 1).min(MAX_BACKOFF);
        true
    }

    /// Nothing came back for a whole local ACK timeout: start again from the smallest
    /// window.
    pub fn on_timeout(&mut self) {
        self.ssthresh = (self.cwnd * BETA_PERCENT / 100).max(MIN_CWND);
        self.cwnd = MIN_CWND;
        self.acc = 0;
        self.probe = None;
        self.backoff = (self.backoff + 1).min(MAX_BACKOFF);
    }

    /// A loss that shows an overflowing queue (a run of lost packets, see
    /// `sack::on_sack`): the window is cut whatever the round trip, once per window of
    /// packets as in [`Cc::on_loss_of`].
    pub fn on_congestion_loss(&mut self, p: u32, high: u32) {
        if self.recover.is_some_and(|r| psn::lt(p, r)) {
            return;
        }
        self.on_loss();
        self.recover = Some(high);
    }

    /// Whether the latest round trip shows packets queueing on the path: past twice the
    /// smallest seen plus [`QUEUE_SLACK_NS`], or no sample yet (assume the worst).
    fn queueing(&self) -> bool {
        self.min_rtt == 0
            || self.last_rtt
                > self
                    .min_rtt
                    .saturating_mul(2)
                    .saturating_add(QUEUE_SLACK_NS)
    }

    /// What a loss leaves of the window at least: [`BDP_GAIN`] times the largest recent
    /// delivery rate over the smallest round trip, in packets.
    fn bdp_floor(&self) -> u32 {
        let rate = self.rates.iter().max().copied().unwrap_or(0);
        let bdp = u128::from(rate) * u128::from(self.min_rtt) / 1_000_000_000;
        (bdp.min(u128::from(self.ceiling)) as u32).saturating_mul(BDP_GAIN)
    }

    /// The smoothed round trip, its smallest sample and the timer's backoff, for logs.
    pub fn estimate(&self) -> (u64, u64, u8) {
        (self.srtt, self.min_rtt, self.backoff)
    }

    /// Whether the round trip has been measured.
    pub fn has_sample(&self) -> bool {
        self.srtt != 0
    }

    /// A round-trip sample (RFC 6298 2.2–2.3).
    pub fn on_rtt(&mut self, rtt: u64) {
        let rtt = rtt.max(1);
        self.last_rtt = rtt;
        if self.min_rtt == 0 || rtt < self.min_rtt {
            self.min_rtt = rtt;
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

    /// The RTT timer's interval: SRTT + 4·RTTVAR, at least [`RTO_MIN_NS`], doubled per
    /// backoff, and never past `limit` (the QP's local ACK timeout, when it has one).
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
                self.on_rtt(now.saturating_sub(t));
            }
        }
    }

    /// How long a resent packet is given to arrive before evidence that it is still
    /// missing counts: a round trip and twice its variation. None before the first sample.
    pub fn resend_guard(&self) -> Option<u64> {
        (self.srtt != 0).then(|| self.srtt.saturating_add(self.rttvar.saturating_mul(2)))
    }

    /// Time the packet `p` sent at `now` unless one is being timed already; `resend`
    /// packets are never timed (their acknowledgement may answer the first copy).
    pub fn maybe_probe(&mut self, p: u32, now: u64, resend: bool) {
        if self.probe.is_none() && !resend {
            self.probe = Some((p, now));
        }
    }

    /// The oldest unacknowledged PSN is now `una`: the packets before it were
    /// acknowledged; a timed one among them gives a sample. Returns how many.
    pub fn advance(&mut self, una: u32, now: u64) -> u32 {
        let n = psn::diff(una, self.una);
        if n <= 0 {
            return 0;
        }
        self.una = una;
        self.delivered += n as u64;
        let (t0, d0) = *self.rate_from.get_or_insert((now, self.delivered));
        let span = now.saturating_sub(t0);
        if span >= self.srtt.max(RATE_SPAN_MIN_NS) {
            let rate = u128::from(self.delivered - d0) * 1_000_000_000 / u128::from(span);
            self.rates[self.rates_at] = rate.min(u128::from(u64::MAX)) as u64;
            self.rates_at = (self.rates_at + 1) % RATE_SAMPLES;
            self.rate_from = Some((now, self.delivered));
        }
        if let Some((p, t)) = self.probe {
            if psn::lt(p, una) {
                self.probe = None;
                self.on_rtt(now.saturating_sub(t));
            }
        }
        n as u32
    }
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
        c.set_mtu(1024, buf);
        assert_eq!((c.cwnd, c.ssthresh, c.ceiling), (2048, 2048, 2048));
        c.on_acked(5000);
        assert_eq!(c.cwnd, 2048);
        // A window cut by loss stays where it was when the MTU changes; one above the new
        // ceiling comes down to it.
        c.on_loss();
        let cut = 2048 * BETA_PERCENT / 100;
        assert_eq!(c.cwnd, cut);
        c.set_mtu(1024, buf);
        assert_eq!((c.cwnd, c.ssthresh, c.ceiling), (cut, cut, 2048));
        c.set_mtu(2048, buf);
        assert_eq!((c.cwnd, c.ssthresh, c.ceiling), (1024, 1024, 1024));
        // It grows back to the ceiling, one packet per window.
        c.set_mtu(1024, buf);
        c.on_loss();
        for _ in 0..2000 {
            c.on_acked(c.cwnd);
        }
        assert_eq!(c.cwnd, 2048);
    }

    #[test]
    fn window_shrinks_on_loss_and_grows_back() {
        let mut c = Cc::default();
        assert_eq!(c.cwnd, MAX_CWND);
        c.on_loss();
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
        assert!(c.on_rtt_timeout(1_000_000));
        assert_eq!(c.cwnd, (before * BETA_PERCENT / 100).max(MIN_CWND));
        for _ in 0..40 {
            c.on_loss();
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
        // No sample yet: assume the worst.
        c.on_loss_of(10, 100);
        let w = MAX_CWND * BETA_PERCENT / 100;
        assert_eq!(c.cwnd, w);
        // A loss of a packet sent before that cut: the same episode.
        c.on_loss_of(99, 200);
        assert_eq!(c.cwnd, w);
        // Round trips near their minimum: a random loss, no cut.
        c.on_rtt(100_000);
        c.on_rtt(110_000);
        c.on_loss_of(150, 300);
        assert_eq!(c.cwnd, w);
        // A round trip past twice the minimum plus the slack: queueing, a cut.
        c.on_rtt(100_000 * 2 + QUEUE_SLACK_NS + 1);
        c.on_loss_of(300, 400);
        assert_eq!(c.cwnd, w * BETA_PERCENT / 100);
    }

    #[test]
    fn a_cut_only_the_round_trip_judged_is_undone_once_sacks_come() {
        let mut c = Cc::default();
        c.on_loss_of(10, 100);
        c.on_loss_of(150, 300);
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
        c.on_loss_of(200, 400);
        assert_eq!(c.cwnd, w * BETA_PERCENT / 100);

        // A cut with other evidence after it (a run of losses, a silent timer) stays.
        let mut c = Cc::default();
        c.on_loss_of(10, 100);
        c.on_congestion_loss(120, 200);
        let cut = c.cwnd;
        c.undo_rtt_cut();
        assert_eq!(c.cwnd, cut);
        let mut c = Cc::default();
        c.on_loss_of(10, 100);
        assert!(c.on_rtt_timeout(u64::MAX / 2));
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
        // A 100 µs round trip, and 100 packets acknowledged every 100 µs for a while: a
        // delivery rate of 10^6 packets per second, a BDP of 100 packets.
        c.maybe_probe(0, 0, false);
        let mut t = 0;
        let mut una = 0;
        for _ in 0..=RATE_SAMPLES {
            t += 100_000;
            una += 100;
            c.advance(una, t);
        }
        let floor = 100 * BDP_GAIN;
        assert!(floor < MAX_CWND * BETA_PERCENT / 100 * BETA_PERCENT / 100);
        for _ in 0..20 {
            c.on_loss();
        }
        assert_eq!((c.cwnd, c.ssthresh), (floor, floor));
        // A stall and then a burst (a gap that fills acknowledges what was held behind
        // it at once): the largest sample still stands.
        t += 100_000;
        c.advance(una, t);
        t += 100_000;
        una += 100;
        c.advance(una, t);
        c.on_loss();
        assert_eq!(c.cwnd, floor);
        // The rate falls to a tenth (a queue, or a slower path): so does the floor.
        for _ in 0..RATE_SAMPLES {
            t += 100_000;
            una += 10;
            c.advance(una, t);
        }
        for _ in 0..20 {
            c.on_loss();
        }
        assert_eq!(c.cwnd, 10 * BDP_GAIN);
        // A timeout still collapses the window.
        c.on_timeout();
        assert_eq!(c.cwnd, MIN_CWND);
    }

    #[test]
    fn rto_follows_the_samples_within_its_bounds() {
        let mut c = Cc::default();
        assert_eq!(c.rto(Some(1 << 30)), None, "no sample yet");
        c.una = 100;
        c.maybe_probe(100, 1_000, false);
        c.maybe_probe(101, 2_000, false);
        assert_eq!(c.probe, Some((100, 1_000)), "one packet timed at a time");
        assert_eq!(c.advance(101, 3_001_000), 1);
        assert_eq!(c.probe, None);
        // 3 ms: SRTT 3 ms, RTTVAR 1.5 ms, RTO 9 ms.
        assert_eq!(c.rto(None), Some(9_000_000));
        assert_eq!(
            c.rto(Some(5_000_000)),
            Some(5_000_000),
            "capped by the QP timeout"
        );
        assert!(c.on_rtt_timeout(20_000_000));
        assert_eq!(c.rto(None), Some(18_000_000), "backed off");
        assert_eq!(
            c.rto(Some(20_000_000)),
            Some(10_000_000),
            "backed off to half the QP timeout at most"
        );
        assert_eq!(
            c.rto(Some(12_000_000)),
            Some(9_000_000),
            "not below the interval itself"
        );
        c.on_acked(1);
        assert_eq!(c.rto(None), Some(9_000_000));
        // Tiny samples: the floor.
        for _ in 0..50 {
            c.on_rtt(10_000);
        }
        assert_eq!(c.rto(None), Some(RTO_MIN_NS));
        // A resent packet is not timed.
        c.maybe_probe(200, 0, true);
        assert_eq!(c.probe, None);
        // PSN wrap.
        c.una = 0xFF_FFFE;
        assert_eq!(c.advance(1, 0), 3);
    }

    #[test]
    fn an_answer_covering_the_timed_packet_measures_and_karn_waits_for_a_first_sample() {
        let mut c = Cc::default();
        c.maybe_probe(10, 1_000, false);
        // A go-back-N before any sample keeps the first send time.
        c.on_resend();
        c.on_loss();
        assert_eq!(c.probe, Some((10, 1_000)));
        // A NAK at the timed PSN does not cover it; an ACK past it does, though the
        // oldest unacknowledged PSN never moved.
        c.on_answer(10, false, 2_000);
        assert_eq!(c.probe, Some((10, 1_000)));
        c.on_answer(12, true, 401_000);
        assert_eq!(c.probe, None);
        // 400 µs: SRTT 400 µs, RTTVAR 200 µs.
        assert_eq!(c.rto(None), Some(1_200_000));
        // With a sample, Karn: a resend ends the timing.
        c.maybe_probe(20, 500_000, false);
        c.on_resend();
        assert_eq!(c.probe, None);
        c.maybe_probe(30, 600_000, false);
        c.on_answer(30, true, 700_000);
        assert_eq!(c.probe, None);
        c.maybe_probe(40, 800_000, false);
        c.on_timeout();
        assert_eq!(c.probe, None, "an ACK timeout always ends the timing");
    }

    /// An expiry while answers keep arriving is one lost packet on a path carrying the
    /// rest: neither the window nor the timer changes. One after a quiet interval cuts
    /// and backs off.
    #[test]
    fn an_expiry_cuts_only_a_path_gone_quiet() {
        let mut c = Cc::default();
        c.on_rtt(1_000_000);
        // SRTT 1 ms, RTTVAR 0.5 ms: the timer's interval is 3 ms.
        assert_eq!(c.rto(None), Some(3_000_000));
        c.on_answer(0, true, 10_000_000);
        assert!(
            !c.on_rtt_timeout(12_999_999),
            "answered 3 ms ago, less a nanosecond"
        );
        assert_eq!((c.cwnd, c.backoff), (MAX_CWND, 0));
        assert!(c.on_rtt_timeout(13_000_000), "nothing for a whole interval");
        assert_eq!(c.cwnd, MAX_CWND * BETA_PERCENT / 100);
        assert_eq!(c.backoff, 1);
        // The quiet interval is the one before any backoff: an answer stops the cuts.
        c.on_answer(0, true, 20_000_000);
        assert!(!c.on_rtt_timeout(22_000_000));
    }
}
