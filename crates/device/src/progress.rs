//! The progress thread: it observes the runtime, asks the [`Pacer`] what to do, does it
//! (receive and handle, doze out of an application's way, or block until a datagram, a
//! wake-up or the next timer) and reports back. The decisions themselves are in
//! [`crate::pacing`].

use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::pacing::{Decision, Pacer, Verdict};
use crate::runtime::Runtime;
use crate::sys;
use crate::tx::{Flush, HELD_RETRY};

/// Run the progress thread until the device stops.
pub(crate) fn run(rt: &Runtime) {
    // The progress thread dozes for a few microseconds at a time (LEAVE): with the default
    // 50 us timer slack those sleeps would last ten times as long.
    sys::set_timer_slack(Duration::from_micros(1));
    let mut pacer = Pacer::new(rt.busy_poll, rt.spin, rt.now());
    while !rt.stop.load(Ordering::Relaxed) {
        match pacer.decide(&rt.seen()) {
            Decision::Doze {
                timeout,
                watch_socket,
            } => {
                let arrived = doze(rt, timeout, watch_socket);
                if rt.ack_due.load(Ordering::Acquire) <= rt.now() {
                    rt.flush_deferred();
                }
                let app_in_call = rt.app_in_progress.load(Ordering::Relaxed) > 0;
                if pacer.woke(&rt.seen(), arrived, app_in_call) == Verdict::Take {
                    // Wait out an application thread that is receiving (it holds the lock
                    // for one step), so that one arrival is one verdict, not a spin.
                    let mut rx = rt.rx.lock().unwrap_or_else(|e| e.into_inner());
                    let got = rt.step(&mut rx, false);
                    pacer.took(rt.now(), got);
                }
            }
            Decision::Poll => {
                let got = match rt.try_rx() {
                    Some(mut rx) => rt.step(&mut rx, false),
                    None => false,
                };
                pacer.polled(rt.now(), got);
                if !got {
                    spin_pause(rt.busy_poll);
                }
            }
            Decision::Block => {
                block(rt);
                pacer.unblocked(rt.now());
            }
        }
    }
}

/// Sleep on the wake-up fd (and the socket, if `watch_socket`) for `timeout`. Returns
/// whether a datagram arrived.
fn doze(rt: &Runtime, timeout: Duration, watch_socket: bool) -> bool {
    if timeout.is_zero() {
        return false;
    }
    let arrived = if watch_socket {
        if !rt.sleep_begin(false) {
            return true;
        }
        let r = sys::poll_readable(
            &[rt.wake.as_fd(), rt.sock_fd.as_fd(), rt.mc_poll.as_fd()],
            Some(timeout),
        );
        rt.sleep_end(false);
        if r.as_ref().is_ok_and(|v| v.get(2).copied().unwrap_or(false)) {
            rt.extra_readable();
        }
        r.is_ok_and(|v| v.iter().skip(1).any(|&b| b))
    } else {
        let _ = sys::poll_readable(&[rt.wake.as_fd()], Some(timeout));
        false
    };
    rt.wake.clear();
    arrived
}

/// Block until a datagram, a wake-up or the next timer. The deadline is published under
/// the engine lock so a poster that creates an earlier timer sees it and wakes us (see
/// `Engine::after_step`).
fn block(rt: &Runtime) {
    let timeout = {
        let mut engine = rt.lock();
        let now = rt.now();
        engine.after_step_with(rt, now, false, Flush::All);
        let deadline = engine.rnic.poll_timeout();
        engine.sleeping_until = Some(deadline.unwrap_or(u64::MAX));
        engine.stats.sleeps += 1;
        if let Some(p) = engine.pcap.as_mut() {
            let _ = p.flush();
        }
        let timeout = deadline.map(|d| Duration::from_nanos(d.saturating_sub(now)));
        if engine.held.is_empty() {
            timeout
        } else {
            // Datagrams wait for room in a ring, whose reader does not say when it frees
            // some: look again soon.
            Some(timeout.map_or(HELD_RETRY, |t| t.min(HELD_RETRY)))
        }
    };
    if !rt.sleep_begin(false) {
        // Datagrams came into a same-host ring meanwhile: receive them.
        rt.lock().sleeping_until = None;
        return;
    }
    let r = sys::poll_readable(
        &[rt.sock_fd.as_fd(), rt.mc_poll.as_fd(), rt.wake.as_fd()],
        timeout,
    );
    rt.sleep_end(false);
    if r.is_ok_and(|v| v.get(1).copied().unwrap_or(false)) {
        rt.extra_readable();
    }
    rt.wake.clear();
    rt.lock().sleeping_until = None;
}

/// One turn of a spin that found nothing to receive. Unless `keep_core` (busy polling was
/// asked for, a core given over to it, or a wait's turn that does not yield, see
/// `WAIT_YIELD_EVERY`), the turn gives the core to any thread that waits for it:
/// on a machine with more busy threads than cores (two processes, each with an
/// application thread and a progress thread, on two cores) a spinning thread otherwise
/// takes its turns from the threads that make the datagrams it waits for. With nothing
/// else runnable, `sched_yield` returns at once and the spin stays as quick.
pub(crate) fn spin_pause(keep_core: bool) {
    if keep_core {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}
