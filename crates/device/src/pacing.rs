//! When the progress thread works, dozes, spins or blocks: a pure decision over device time
//! (nanoseconds since the device opened), what the application threads are doing and the
//! engine's deadlines. The progress thread ([`crate::progress`]) observes, asks, acts and
//! reports back; nothing here reads a clock or touches a socket, so the policy is tested
//! on virtual time.
//!
//! The policy: one spinning thread per process. While an application thread polls or
//! waits, it drives progress itself and the progress thread dozes out of its way (a
//! cross-core wake-up costs tens of microseconds on small machines, a busy-polled receive
//! about one). An application that stops calling in (it may spin on memory a peer WRITEs,
//! as ib_write_lat does) must not leave datagrams waiting, so after [`APP_IDLE`] the
//! progress thread also watches the socket and takes over when something arrives. With no
//! application driving, it polls the socket for the spin time after activity, then
//! blocks until a datagram, a wake-up or the next timer.

use std::time::Duration;

/// How long an application thread may stay away before the progress thread, while it
/// keeps out of the way, watches the socket again.
pub(crate) const APP_IDLE: Duration = Duration::from_micros(100);

/// An application that called in less than this long before a datagram woke the
/// progress thread is polling: it takes the datagram itself.
pub(crate) const APP_BUSY: Duration = Duration::from_micros(5);

/// How long the progress thread leaves the socket to a polling application before it
/// looks again.
pub(crate) const LEAVE: Duration = Duration::from_micros(10);

/// How long after an application thread last polled the progress thread keeps out of the
/// way (and how often it rechecks while an application thread waits).
pub(crate) const APP_WINDOW: Duration = Duration::from_millis(1);

const fn ns(d: Duration) -> u64 {
    d.as_nanos() as u64
}

/// What the progress thread sees when it decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Seen {
    /// Device time.
    pub now: u64,
    /// Device time of the last application poll or wait (0: never).
    pub app_active_at: u64,
    /// Whether application threads are inside `Device::wait_for` (they watch the socket
    /// themselves).
    pub waiters: bool,
    /// Device time by which held-back datagrams must leave (`u64::MAX`: none held).
    pub ack_due: u64,
}

impl Seen {
    /// Whether an application thread drives progress now (or did within [`APP_WINDOW`]).
    pub fn app_driving(&self) -> bool {
        self.waiters
            || (self.app_active_at != 0
                && self.now.saturating_sub(self.app_active_at) < ns(APP_WINDOW))
    }
    fn app_idle_for(&self) -> u64 {
        self.now.saturating_sub(self.app_active_at)
    }
}

/// What the progress thread does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decision {
    /// An application thread drives progress: sleep on the wake-up fd for `timeout` (zero:
    /// don't sleep), and on the socket too if `watch_socket`; then report with
    /// [`Pacer::woke`].
    Doze {
        /// How long.
        timeout: Duration,
        /// Whether a datagram arriving ends the doze.
        watch_socket: bool,
    },
    /// Receive and handle what is there without blocking; report with [`Pacer::polled`].
    Poll,
    /// Block until a datagram, a wake-up or the next timer; report with
    /// [`Pacer::unblocked`].
    Block,
}

/// After a doze that a datagram ended: whether the progress thread takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Leave it to the application thread.
    Leave,
    /// Receive it now (waiting for an application thread that is receiving), then report
    /// with [`Pacer::took`].
    Take,
}

/// Whether the progress thread watches the socket while an application thread also drives
/// progress. An application that spins on memory a peer writes leaves datagrams to the
/// progress thread even though it polls a CQ in between, so once it has done so the
/// progress thread keeps watching, each datagram waking it. An application that polls for
/// everything takes its datagrams itself and those wake-ups are wasted (and preempt it),
/// so watching stops when most of them find nothing.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct SocketWatch {
    pub watch: bool,
    useful: u32,
    wasted: u32,
}

impl SocketWatch {
    /// Wake-ups per verdict.
    const ROUND: u32 = 64;

    fn record(&mut self, got: bool) {
        if got {
            self.useful += 1;
        } else {
            self.wasted += 1;
        }
        if self.useful + self.wasted >= Self::ROUND {
            // Worth it while at least a quarter of the wake-ups find a datagram.
            self.watch = self.useful * 4 >= Self::ROUND;
            self.useful = 0;
            self.wasted = 0;
        }
    }
}

/// The progress thread's pacing state.
#[derive(Debug, Clone)]
pub(crate) struct Pacer {
    /// Never block (`DeviceConfig::busy_poll`).
    busy_poll: bool,
    /// How long to keep polling after activity before blocking, in ns.
    spin: u64,
    /// Device time of the last activity (a datagram handled, a doze or block ended).
    active_at: u64,
    /// The last poll found nothing.
    polled_empty: bool,
    /// How often to look whether an application thread that drives progress has stopped
    /// calling in. Every look is a wake-up that preempts a thread, so while the
    /// application keeps calling in, the looks back off (doubling up to [`APP_WINDOW`]);
    /// once it is found idle they start again at [`APP_IDLE`].
    look_every: u64,
    /// Device time until which the socket is left to a polling application.
    leave_until: u64,
    watch: SocketWatch,
}

impl Pacer {
    /// A pacer for a device opened at device time `now`.
    pub fn new(busy_poll: bool, spin: Duration, now: u64) -> Pacer {
        Pacer {
            busy_poll,
            spin: spin.as_nanos().min(u128::from(u64::MAX)) as u64,
            active_at: now,
            polled_empty: false,
            look_every: ns(APP_IDLE),
            leave_until: 0,
            watch: SocketWatch::default(),
        }
    }

    /// What to do next.
    pub fn decide(&mut self, s: &Seen) -> Decision {
        if s.app_driving() {
            return self.doze(s);
        }
        if self.polled_empty && !self.busy_poll && s.now.saturating_sub(self.active_at) >= self.spin
        {
            Decision::Block
        } else {
            Decision::Poll
        }
    }

    fn doze(&mut self, s: &Seen) -> Decision {
        let now = s.now;
        let until = s.app_active_at.saturating_add(ns(APP_WINDOW));
        let idle = s.app_idle_for();
        let app_idle = idle >= ns(APP_IDLE);
        // Blocked waiters watch the socket themselves.
        let watch_socket = !s.waiters && (app_idle || self.watch.watch) && now >= self.leave_until;
        let mut t = if s.waiters || until <= now {
            ns(APP_WINDOW)
        } else if watch_socket {
            self.look_every = ns(APP_IDLE);
            until - now
        } else if now < self.leave_until {
            // The socket was just left to the polling application: look again soon, in
            // case the datagram was not its after all.
            self.leave_until - now
        } else {
            let t = self.look_every.max(ns(APP_IDLE).saturating_sub(idle));
            self.look_every = (self.look_every * 2).min(ns(APP_WINDOW));
            t
        };
        // Datagrams an application thread held back leave with its next datagram or
        // step; if it has stopped calling in, they leave by their deadline from here.
        // (Not while it calls in: a wake-up per held ACK would cost more than it saves.)
        if s.ack_due != u64::MAX && app_idle {
            t = t.min(s.ack_due.saturating_sub(now));
        }
        Decision::Doze {
            timeout: Duration::from_nanos(t),
            watch_socket,
        }
    }

    /// A doze ended (`arrived`: a datagram ended it); `app_in_call`: an application
    /// thread is inside a device call right now.
    pub fn woke(&mut self, s: &Seen, arrived: bool, app_in_call: bool) -> Verdict {
        self.active_at = s.now;
        self.polled_empty = false;
        let idle = s.app_idle_for();
        let still_idle = idle >= ns(APP_IDLE);
        if !arrived || !(still_idle || self.watch.watch) {
            return Verdict::Leave;
        }
        if idle < ns(APP_BUSY) || app_in_call {
            // The application called in a moment ago, or is inside a call (this wake-up
            // may have preempted it there): it polls and will take the datagram itself,
            // without the wake-up and the preemption that taking it here costs it (a
            // ping-pong that polls its CQ doubles its round trip otherwise). Leave it, and
            // the socket, for LEAVE; count a wasted look. (One that spins on memory
            // between calls, as ib_write_lat does, last called a whole turn of its peer
            // ago.)
            self.watch.record(false);
            self.leave_until = s.now.saturating_add(ns(LEAVE));
            return Verdict::Leave;
        }
        if still_idle {
            // The application left a datagram to us: it does not poll for everything it
            // waits for.
            self.watch.watch = true;
        }
        Verdict::Take
    }

    /// A [`Verdict::Take`] receive found something (`got`) or not.
    pub fn took(&mut self, now: u64, got: bool) {
        self.watch.record(got);
        self.polled(now, got);
    }

    /// A [`Decision::Poll`] found something (`got`) or not.
    pub fn polled(&mut self, now: u64, got: bool) {
        if got {
            self.active_at = now;
        }
        self.polled_empty = !got;
    }

    /// A [`Decision::Block`] ended.
    pub fn unblocked(&mut self, now: u64) {
        self.active_at = now;
        self.polled_empty = false;
    }

    /// Whether the socket is watched while the application also drives progress.
    #[cfg(test)]
    fn watching(&self) -> bool {
        self.watch.watch
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: u64 = 1_000;
    const SPIN: Duration = Duration::from_micros(50);

    fn seen(now: u64, app_active_at: u64) -> Seen {
        Seen {
            now,
            app_active_at,
            waiters: false,
            ack_due: u64::MAX,
        }
    }

    fn doze(timeout_us: u64, watch_socket: bool) -> Decision {
        Decision::Doze {
            timeout: Duration::from_micros(timeout_us),
            watch_socket,
        }
    }

    #[test]
    fn alone_it_polls_for_the_spin_time_after_activity_then_blocks() {
        let mut p = Pacer::new(false, SPIN, 0);
        let mut now = 1_000 * US;
        assert_eq!(p.decide(&seen(now, 0)), Decision::Poll);
        p.polled(now, true);
        // Nothing more arrives: keep polling until SPIN has passed since the last datagram.
        for _ in 0..49 {
            now += US;
            assert_eq!(p.decide(&seen(now, 0)), Decision::Poll, "at {now}");
            p.polled(now, false);
        }
        now += US;
        assert_eq!(p.decide(&seen(now, 0)), Decision::Block);
        // A datagram or a wake-up ends the block: poll again, for a full spin.
        now += 5_000 * US;
        p.unblocked(now);
        assert_eq!(
            p.decide(&seen(now + SPIN.as_nanos() as u64, 0)),
            Decision::Poll
        );
    }

    #[test]
    fn busy_poll_never_blocks() {
        let mut p = Pacer::new(true, SPIN, 0);
        for k in 0..1_000u64 {
            let now = k * 100 * US;
            assert_eq!(p.decide(&seen(now, 0)), Decision::Poll);
            p.polled(now, false);
        }
    }

    #[test]
    fn a_polling_application_is_left_alone_with_looks_backing_off() {
        let mut p = Pacer::new(false, SPIN, 0);
        // The application calls in every microsecond: the progress thread dozes without
        // watching the socket, its looks doubling from APP_IDLE up to APP_WINDOW.
        let mut now = 10_000 * US;
        let mut looks = Vec::new();
        for _ in 0..6 {
            match p.decide(&seen(now, now - US)) {
                Decision::Doze {
                    timeout,
                    watch_socket: false,
                } => looks.push(timeout.as_micros() as u64),
                d => panic!("expected a doze off the socket, got {d:?}"),
            }
            now += 3 * US;
            assert_eq!(p.woke(&seen(now, now - US), false, false), Verdict::Leave);
        }
        assert_eq!(looks, [100, 200, 400, 800, 1000, 1000]);
    }

    #[test]
    fn an_idle_application_has_the_socket_watched_until_its_window_ends() {
        let mut p = Pacer::new(false, SPIN, 0);
        let now = 10_000 * US;
        let last = now - 150 * US;
        assert_eq!(p.decide(&seen(now, last)), doze(850, true));
        // A datagram arrives; the application is still away: take it, and from now on
        // keep watching the socket even while it calls in.
        let later = now + 20 * US;
        assert_eq!(p.woke(&seen(later, last), true, false), Verdict::Take);
        p.took(later, true);
        assert!(p.watching());
        let busy = seen(later + 30 * US, later + 29 * US);
        assert!(matches!(
            p.decide(&busy),
            Decision::Doze {
                watch_socket: true,
                ..
            }
        ));
        // Once the window has passed with no application call, poll and then block.
        let gone = later + 2_000 * US;
        assert_eq!(p.decide(&seen(gone, later)), Decision::Poll);
    }

    #[test]
    fn a_datagram_for_an_application_that_just_called_in_is_left_to_it() {
        let mut p = Pacer::new(false, SPIN, 0);
        p.watch.watch = true;
        let now = 10_000 * US;
        // It called in 2 us ago: leave the datagram and the socket for LEAVE.
        assert_eq!(
            p.woke(&seen(now, now - 2 * US), true, false),
            Verdict::Leave
        );
        assert_eq!(p.decide(&seen(now + 3 * US, now - US)), doze(7, false));
        // Inside a call right now (called in long ago): left to it as well.
        let later = now + 50 * US;
        assert_eq!(
            p.woke(&seen(later, now - 200 * US), true, true),
            Verdict::Leave
        );
        // Called in 6 us ago and not inside a call: it does not take it; we do.
        let then = later + 20 * US;
        assert_eq!(
            p.woke(&seen(then, then - 6 * US), true, false),
            Verdict::Take
        );
    }

    #[test]
    fn wasted_looks_stop_the_watch_and_useful_ones_keep_it() {
        let mut p = Pacer::new(false, SPIN, 0);
        p.watch.watch = true;
        for k in 0..64u64 {
            let now = (k + 1) * 1_000 * US;
            assert_eq!(p.woke(&seen(now, now - US), true, false), Verdict::Leave);
        }
        assert!(!p.watching(), "64 wasted looks in a row end the watch");
        p.watch.watch = true;
        for k in 0..64u64 {
            // One in four finds a datagram: still worth it.
            p.took(k, k % 4 == 0);
        }
        assert!(p.watching());
    }

    #[test]
    fn waiters_watch_the_socket_themselves() {
        let mut p = Pacer::new(false, SPIN, 0);
        let s = Seen {
            waiters: true,
            ..seen(10_000 * US, 0)
        };
        assert_eq!(p.decide(&s), doze(1000, false));
    }

    #[test]
    fn held_back_datagrams_of_an_idle_application_leave_by_their_deadline() {
        let mut p = Pacer::new(false, SPIN, 0);
        let now = 10_000 * US;
        let idle = Seen {
            ack_due: now + 12 * US,
            ..seen(now, now - 200 * US)
        };
        assert_eq!(p.decide(&idle), doze(12, true));
        // While it calls in, its own next call sends them: no wake-up for them.
        let busy = Seen {
            ack_due: now + 12 * US,
            ..seen(now, now - US)
        };
        assert_eq!(p.decide(&busy), doze(100, false));
    }
}
