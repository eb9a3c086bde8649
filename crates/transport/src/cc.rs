//! Loss response of an RC requester: a congestion window that backs off on loss and grows
//! back as acknowledgements come (TCP's rules counted in packets, with CUBIC's gentler
//! cut). The round trip it reads is measured apart ([`crate::rtt`]).
//!
//! Why: go-back-N resends everything in flight from a loss, so with a fixed window of
//! [`MAX_CWND`] packets a lossy path resends hundreds of packets per loss, many
//! of them lost again. With the window cut on each loss a go-back-N costs about what is
//! really in flight. Against a peer that holds what follows a gap
//! (`qp::Held`), the completer resends the lost packet alone; such a loss cuts the window
//! once per window of packets, and only when it shows congestion: from a peer that sends
//! SACKs, a run of lost packets ([`Loss::Run`]); from one that does not, a round trip
//! grown past twice its minimum ([`Loss::Packet`]).

use softrdma_wire::psn;

use crate::rtt::{RttEstimator, RTO_MIN_NS};

/// The window never shrinks below this many packets: go-back-N needs a few in flight to
/// make progress, and a sequence NAK needs a packet after the lost one to be sent.
pub(crate) const MIN_CWND: u32 = 4;
/// The window's ceiling at path MTU 4096 with a full-size receive buffer; [`ceiling_for`]
/// gives it for other MTUs and buffers. 512 full-MTU packets are about what a 4 MiB
/// socket receive buffer holds (each 4 KiB datagram costs 6-8 KiB of it): with more in
/// flight the receiver's buffer overflows, and every drop costs a sequence NAK and a
/// resend.
pub(crate) const MAX_CWND: u32 = 512;

/// PSNs past the oldest unacknowledged one a requester may have sent (see
/// `qp::HOLD_SPAN`).
const HOLD_SPAN: u32 = softrdma_wire::ext::SACK_SPAN;

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
        .clamp(MIN_CEILING, u64::from(HOLD_SPAN) / 2) as u32
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

/// A loss, as the requester tells its congestion controller about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Loss {
    /// The packet with this PSN was lost (a sequence NAK, a response past a lost one, a
    /// go-back-N): nothing but the round trip tells whether the path is congested.
    Packet(u32),
    /// A run of lost packets from this PSN (a SACK's holes, a READ's missing responses):
    /// an overflowing queue drops what arrives while it is full.
    Run(u32),
    /// The round-trip timer expired at this time (ns).
    RttTimeout(u64),
    /// Nothing came back for a whole local ACK timeout.
    AckTimeout,
}

/// A congestion controller: told what the requester sends, what is acknowledged and
/// what is lost, it says how many packets may be in flight.
pub(crate) trait Controller: std::fmt::Debug + Send {
    /// Every request packet before `high` has been handed to the wire.
    fn on_sent(&mut self, high: u32);
    /// `n` more packets were acknowledged at `now` (ns).
    fn on_acked(&mut self, now: u64, n: u32, rtt: &RttEstimator);
    /// A loss. Returns whether the window was cut.
    fn on_loss(&mut self, loss: Loss, rtt: &RttEstimator) -> bool;
    /// The peer turned out to send SACKs: from now on they show whether losses come in
    /// runs.
    fn on_peer_sacks(&mut self);
    /// The path MTU is (now) `mtu` bytes and the device's receive buffer `rx_buffer`.
    fn on_path(&mut self, mtu: usize, rx_buffer: usize);
    /// Packets that may be in flight (sent, neither acknowledged nor known held) at once.
    fn window(&self) -> u32;
}

impl Default for Box<dyn Controller> {
    fn default() -> Self {
        Box::new(Reno::default())
    }
}

/// The requester's controller: TCP Reno's window counted in packets, with CUBIC's
/// gentler cut, a floor at twice the measured bandwidth-delay product, and a cut on a
/// single loss only when the round trip shows a queue.
#[derive(Debug, Clone)]
pub(crate) struct Reno {
    /// Packets that may be in flight (unacknowledged) at once.
    cwnd: u32,
    /// What `cwnd` never grows past ([`ceiling_for`] the path MTU).
    ceiling: u32,
    /// Slow start below it (the window doubles per round trip), linear growth above.
    ssthresh: u32,
    /// Packets acknowledged toward the next increment in linear growth.
    acc: u32,
    /// One past the highest PSN sent.
    high: u32,
    /// `high` when the window was last cut by a single loss or a run: losses of packets
    /// sent before it belong to the same episode.
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
    /// ([`Loss::Packet`]), while no cut with other evidence came after it: what
    /// [`Controller::on_peer_sacks`] restores.
    rtt_cut: Option<(u32, u32)>,
}

impl Default for Reno {
    /// A new connection sends at the full window, as an RDMA NIC does: the window only
    /// matters once the path has shown loss.
    fn default() -> Self {
        Reno::with_window(MAX_CWND)
    }
}

impl Reno {
    /// A controller whose window and slow-start threshold start at `cwnd` packets (at
    /// most [`MAX_CWND`], the ceiling until [`Controller::on_path`] says).
    pub fn with_window(cwnd: u32) -> Reno {
        let cwnd = cwnd.clamp(MIN_CWND, MAX_CWND);
        Reno {
            cwnd,
            ceiling: MAX_CWND,
            ssthresh: cwnd,
            acc: 0,
            high: 0,
            recover: None,
            delivered: 0,
            rate_from: None,
            rates: [0; RATE_SAMPLES],
            rates_at: 0,
            rtt_cut: None,
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

    /// The loss of packet `p`: the window is cut once per window of packets, as
    /// NewReno's recovery point does: the losses of packets sent before the last cut
    /// are the same episode, which that cut answered already.
    ///
    /// A loss while the round trip is near its minimum is not congestion (nothing is
    /// queueing on the path: a lossy link, a busy host dropping at random) and cuts
    /// nothing; with a selective repeat it costs one packet. Congestion shows as a round
    /// trip grown past twice its minimum (plus [`QUEUE_SLACK_NS`]), and that loss cuts.
    fn packet_lost(&mut self, p: u32, rtt: &RttEstimator) -> bool {
        if self.same_episode(p) || !queueing(rtt) {
            return false;
        }
        let before = (self.cwnd, self.ssthresh);
        self.cut(rtt);
        self.recover = Some(self.high);
        self.rtt_cut = Some(before);
        true
    }

    /// A run of losses from `p` (see `Recovery::on_sack`): the window is cut whatever the
    /// round trip, once per window of packets as for a single loss.
    fn run_lost(&mut self, p: u32, rtt: &RttEstimator) -> bool {
        if self.same_episode(p) {
            return false;
        }
        self.cut(rtt);
        self.recover = Some(self.high);
        true
    }

    /// Whether packet `p` was sent before the last cut.
    fn same_episode(&self, p: u32) -> bool {
        self.recover.is_some_and(|r| psn::lt(p, r))
    }

    /// The round-trip timer expired at `now`.
    ///
    /// When an answer from the peer arrived within the timer's interval (before any
    /// backoff), the path is carrying the rest: the expiry is one lost packet (a resent
    /// one, the tail of what was sent, a READ's request for some of its responses, or
    /// their answer), which the caller resends, and nothing says the path is congested
    /// (runs of losses do: see `Recovery::on_sack` and `completer::read`), so the
    /// window stays. Otherwise the path has gone quiet: a loss.
    fn rtt_timeout(&mut self, now: u64, rtt: &RttEstimator) -> bool {
        let interval = rtt.rto_base().unwrap_or(RTO_MIN_NS);
        if rtt.answered_within(now, interval) {
            return false;
        }
        self.cut(rtt);
        true
    }

    /// What a loss leaves of the window at least: [`BDP_GAIN`] times the largest recent
    /// delivery rate over the smallest round trip, in packets.
    fn bdp_floor(&self, rtt: &RttEstimator) -> u32 {
        let rate = self.rates.iter().max().copied().unwrap_or(0);
        let bdp = u128::from(rate) * u128::from(rtt.min()) / 1_000_000_000;
        (bdp.min(u128::from(self.ceiling)) as u32).saturating_mul(BDP_GAIN)
    }
}

impl Controller for Reno {
    fn on_sent(&mut self, high: u32) {
        self.high = high;
    }

    /// The window grows (by `n` in slow start, by one per window's worth above
    /// `ssthresh`), and `n` packets over the smoothed round trip make a delivery-rate
    /// sample.
    fn on_acked(&mut self, now: u64, n: u32, rtt: &RttEstimator) {
        if n == 0 {
            return;
        }
        self.delivered += u64::from(n);
        let (t0, d0) = *self.rate_from.get_or_insert((now, self.delivered));
        let span = now.saturating_sub(t0);
        if span >= rtt.smoothed().max(RATE_SPAN_MIN_NS) {
            let rate = u128::from(self.delivered - d0) * 1_000_000_000 / u128::from(span);
            self.rates[self.rates_at] = rate.min(u128::from(u64::MAX)) as u64;
            self.rates_at = (self.rates_at + 1) % RATE_SAMPLES;
            self.rate_from = Some((now, self.delivered));
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

    fn on_loss(&mut self, loss: Loss, rtt: &RttEstimator) -> bool {
        match loss {
            Loss::Packet(p) => self.packet_lost(p, rtt),
            Loss::Run(p) => self.run_lost(p, rtt),
            Loss::RttTimeout(now) => self.rtt_timeout(now, rtt),
            Loss::AckTimeout => {
                // Start again from the smallest window.
                self.ssthresh = (self.cwnd * BETA_PERCENT / 100).max(MIN_CWND);
                self.cwnd = MIN_CWND;
                self.acc = 0;
                true
            }
        }
    }

    /// A cut that only the round trip judged is undone. The peer's SACKs show whether
    /// losses come in runs, the sign of congestion that `Recovery::on_sack` cuts on; the
    /// round trip on a host queues a window's worth whether or not anything overflows,
    /// so such a cut would hit the first random loss of every connection between
    /// softrdma peers (made before the SACKs were asked for), and the window would then
    /// regrow one packet per round trip.
    fn on_peer_sacks(&mut self) {
        if let Some((cwnd, ssthresh)) = self.rtt_cut.take() {
            self.cwnd = self.cwnd.max(cwnd);
            self.ssthresh = self.ssthresh.max(ssthresh);
            self.acc = 0;
            self.recover = None;
        }
    }

    /// The ceiling follows the path ([`ceiling_for`]). A window at the old ceiling moves
    /// to the new one, as a new connection starts at the full window; one cut by loss
    /// stays where it is, under the new ceiling.
    fn on_path(&mut self, mtu: usize, rx_buffer: usize) {
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

    fn window(&self) -> u32 {
        self.cwnd
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

    /// The loss `l`, with the packets before `high` sent.
    fn lose(c: &mut Reno, l: Loss, high: u32, r: &RttEstimator) -> bool {
        c.on_sent(high);
        c.on_loss(l, r)
    }

    #[test]
    fn the_ceiling_is_what_the_receive_buffer_holds_up_to_2_mib_of_payload() {
        let buf = DEFAULT_RX_BUFFER;
        // A full-size buffer: 2 MiB of payload.
        assert_eq!(ceiling_for(4096, buf), MAX_CWND);
        assert_eq!(ceiling_for(2048, buf), 1024);
        assert_eq!(ceiling_for(1024, buf), 2048);
        assert_eq!(ceiling_for(512, buf), HOLD_SPAN / 2, "capped by the span");
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
        let mut c = Reno::default();
        let r = RttEstimator::default();
        c.on_path(1024, buf);
        assert_eq!((c.cwnd, c.ssthresh, c.ceiling), (2048, 2048, 2048));
        c.on_acked(0, 5000, &r);
        assert_eq!(c.cwnd, 2048);
        // A window cut by loss stays where it was when the MTU changes; one above the new
        // ceiling comes down to it.
        c.cut(&r);
        let cut = 2048 * BETA_PERCENT / 100;
        assert_eq!(c.cwnd, cut);
        c.on_path(1024, buf);
        assert_eq!((c.cwnd, c.ssthresh, c.ceiling), (cut, cut, 2048));
        c.on_path(2048, buf);
        assert_eq!((c.cwnd, c.ssthresh, c.ceiling), (1024, 1024, 1024));
        // It grows back to the ceiling, one packet per window.
        c.on_path(1024, buf);
        c.cut(&r);
        for _ in 0..2000 {
            c.on_acked(0, c.cwnd, &r);
        }
        assert_eq!(c.cwnd, 2048);
    }

    #[test]
    fn window_shrinks_on_loss_and_grows_back() {
        let mut c = Reno::default();
        let r = RttEstimator::default();
        assert_eq!(c.cwnd, MAX_CWND);
        c.cut(&r);
        let w = MAX_CWND * BETA_PERCENT / 100;
        assert_eq!((c.cwnd, c.ssthresh), (w, w));
        // Linear growth above ssthresh: one packet per window acknowledged.
        c.on_acked(0, w, &r);
        assert_eq!(c.cwnd, w + 1);
        c.on_loss(Loss::AckTimeout, &r);
        assert_eq!(c.cwnd, MIN_CWND);
        assert_eq!(c.ssthresh, (w + 1) * BETA_PERCENT / 100);
        // Slow start up to ssthresh.
        c.on_acked(0, MIN_CWND, &r);
        assert_eq!(c.cwnd, 2 * MIN_CWND);
        c.on_acked(0, 10_000, &r);
        assert_eq!(c.cwnd, c.ssthresh);
        // A round-trip timer expiry on a path gone quiet is a loss, not a collapse.
        let before = c.cwnd;
        assert!(c.on_loss(Loss::RttTimeout(1_000_000), &r));
        assert_eq!(c.cwnd, (before * BETA_PERCENT / 100).max(MIN_CWND));
        for _ in 0..40 {
            c.cut(&r);
        }
        assert_eq!(c.cwnd, MIN_CWND);
        for _ in 0..100_000 {
            c.on_acked(0, 64, &r);
        }
        assert_eq!(c.cwnd, MAX_CWND, "never past the ceiling");
    }

    #[test]
    fn a_selective_repeat_cuts_only_under_queueing_and_once_per_window() {
        let mut c = Reno::default();
        let mut r = RttEstimator::default();
        // No sample yet: assume the worst.
        lose(&mut c, Loss::Packet(10), 100, &r);
        let w = MAX_CWND * BETA_PERCENT / 100;
        assert_eq!(c.cwnd, w);
        // A loss of a packet sent before that cut: the same episode.
        lose(&mut c, Loss::Packet(99), 200, &r);
        assert_eq!(c.cwnd, w);
        // Round trips near their minimum: a random loss, no cut.
        r.on_sample(100_000);
        r.on_sample(110_000);
        lose(&mut c, Loss::Packet(150), 300, &r);
        assert_eq!(c.cwnd, w);
        // A round trip past twice the minimum plus the slack: queueing, a cut.
        r.on_sample(100_000 * 2 + QUEUE_SLACK_NS + 1);
        lose(&mut c, Loss::Packet(300), 400, &r);
        assert_eq!(c.cwnd, w * BETA_PERCENT / 100);
    }

    #[test]
    fn a_cut_only_the_round_trip_judged_is_undone_once_sacks_come() {
        let mut c = Reno::default();
        let r = RttEstimator::default();
        lose(&mut c, Loss::Packet(10), 100, &r);
        lose(&mut c, Loss::Packet(150), 300, &r);
        let w = MAX_CWND * BETA_PERCENT / 100;
        assert_eq!(c.cwnd, w * BETA_PERCENT / 100);
        c.on_peer_sacks();
        assert_eq!(
            (c.cwnd, c.ssthresh),
            (w, w),
            "back to before the last such cut"
        );
        // Undone once: nothing more to restore.
        c.on_peer_sacks();
        assert_eq!(c.cwnd, w);
        // The episode is over: a loss of a packet sent before it may cut again.
        lose(&mut c, Loss::Packet(200), 400, &r);
        assert_eq!(c.cwnd, w * BETA_PERCENT / 100);

        // A cut with other evidence after it (a run of losses, a silent timer) stays.
        let mut c = Reno::default();
        let r = RttEstimator::default();
        lose(&mut c, Loss::Packet(10), 100, &r);
        lose(&mut c, Loss::Run(120), 200, &r);
        let cut = c.cwnd;
        c.on_peer_sacks();
        assert_eq!(c.cwnd, cut);
        let mut c = Reno::default();
        let r = RttEstimator::default();
        lose(&mut c, Loss::Packet(10), 100, &r);
        assert!(c.on_loss(Loss::RttTimeout(u64::MAX / 2), &r));
        let cut = c.cwnd;
        c.on_peer_sacks();
        assert_eq!(c.cwnd, cut);
        // Nothing cut: nothing to undo.
        let mut c = Reno::default();
        c.on_peer_sacks();
        assert_eq!((c.cwnd, c.ssthresh), (MAX_CWND, MAX_CWND));
    }

    #[test]
    fn a_loss_leaves_twice_the_measured_bdp() {
        let mut c = Reno::default();
        let mut r = RttEstimator::default();
        // A 100 µs round trip, and 100 packets acknowledged every 100 µs for a while: a
        // delivery rate of 10^6 packets per second, a BDP of 100 packets.
        r.time(0, 0, false);
        let mut t = 0;
        for _ in 0..=RATE_SAMPLES {
            t += 100_000;
            c.on_acked(t, 100, &r);
            r.on_acked_below(100, t);
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
        c.on_acked(t, 0, &r);
        t += 100_000;
        c.on_acked(t, 100, &r);
        c.cut(&r);
        assert_eq!(c.cwnd, floor);
        // The rate falls to a tenth (a queue, or a slower path): so does the floor.
        for _ in 0..RATE_SAMPLES {
            t += 100_000;
            c.on_acked(t, 10, &r);
        }
        for _ in 0..20 {
            c.cut(&r);
        }
        assert_eq!(c.cwnd, 10 * BDP_GAIN);
        // A timeout still collapses the window.
        c.on_loss(Loss::AckTimeout, &r);
        assert_eq!(c.cwnd, MIN_CWND);
    }

    /// An expiry while answers keep arriving is one lost packet on a path carrying the
    /// rest: neither the window nor the timer changes. One after a quiet interval cuts.
    #[test]
    fn an_expiry_cuts_only_a_path_gone_quiet() {
        let mut c = Reno::default();
        let mut r = RttEstimator::default();
        r.on_sample(1_000_000);
        // SRTT 1 ms, RTTVAR 0.5 ms: the timer's interval is 3 ms.
        assert_eq!(r.rto(None), Some(3_000_000));
        r.on_answer(0, true, 10_000_000);
        assert!(
            !c.on_loss(Loss::RttTimeout(12_999_999), &r),
            "answered 3 ms ago, less a nanosecond"
        );
        assert_eq!(c.cwnd, MAX_CWND);
        assert!(
            c.on_loss(Loss::RttTimeout(13_000_000), &r),
            "nothing for a whole interval"
        );
        assert_eq!(c.cwnd, MAX_CWND * BETA_PERCENT / 100);
        // The quiet interval is the one before any backoff: an answer stops the cuts.
        r.on_answer(0, true, 20_000_000);
        assert!(!c.on_loss(Loss::RttTimeout(22_000_000), &r));
    }
}
