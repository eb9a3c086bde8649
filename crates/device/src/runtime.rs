//! The state shared by the progress thread and the application threads: the engine behind
//! its lock with the send sockets and event fds ([`Engine`]), the receive half of the
//! socket ([`Rx`]), and the atomics that let threads decide without the lock.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io::BufWriter;
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use softrdma_net::{udp, Link};
use softrdma_transport::verbs::{AsyncEvent, ChannelId};
use softrdma_transport::{Rnic, Transmit};
use softrdma_wire::icrc::IpIdCache;
use softrdma_wire::pcapng::{Direction, PcapngWriter};
use softrdma_wire::Addrs;

use crate::mcast::{Groups, MC_BATCH};
use crate::pacing::Seen;
use crate::sys::EventFd;
use crate::tx::{Flush, SendSocket};
use crate::LinkStats;

/// How long a due timer may wait for the socket to be drained first, in nanoseconds.
const TIMER_GRACE_NS: u64 = 1_000_000;
/// How long after its last datagram the second address's socket is still read on every
/// step, in nanoseconds.
const ALT_WINDOW_NS: u64 = 100_000_000;
/// A quiet second address's socket is read on every this many steps.
const ALT_EVERY: u64 = 64;
/// Steps that receive nothing read the clock once in this many (see [`Runtime::step`]).
const CLOCK_EVERY: u32 = 8;

pub(crate) struct Chan {
    pub(crate) fd: EventFd,
    pub(crate) signaled: bool,
}

/// Everything behind the engine lock.
pub(crate) struct Engine {
    pub(crate) rnic: Rnic,
    /// The send half of the device's link (its socket, for the UDP driver).
    pub(crate) link: Box<dyn Link>,
    /// The send half of the socket on the device's second address ([`Runtime::alt_addr`]).
    pub(crate) alt_link: Option<Box<dyn Link>>,
    /// Send-only sockets per source address (one of the device's addresses with another
    /// UDP source port); `None`: the bind failed, use the device socket and reseal. At most
    /// [`crate::tx::SEND_PORTS_MAX`] entries; other source addresses use the device socket.
    pub(crate) ports: HashMap<SocketAddr, Option<Box<dyn Link>>>,
    /// Whether running out of [`crate::tx::SEND_PORTS_MAX`] has been logged.
    pub(crate) ports_full_logged: bool,
    /// Per-length ICRC work for sealing GSO segments ([`seal_gso_segments`]).
    pub(crate) ip_ids: IpIdCache,
    pub(crate) pcap: Option<PcapngWriter<BufWriter<File>>>,
    pub(crate) channels: HashMap<ChannelId, Chan>,
    pub(crate) async_q: VecDeque<AsyncEvent>,
    pub(crate) async_signaled: bool,
    /// Whether [`Runtime::mad_fd`] is set (MADs wait in the engine's GSI inbox).
    pub(crate) mad_signaled: bool,
    /// The engine's multicast generation the group sockets were last synced to.
    pub(crate) mc_seen: u64,
    /// The interface IPv6 multicast leaves from (the one holding the device's address).
    pub(crate) mc_ifindex: Option<u32>,
    pub(crate) stats: LinkStats,
    /// Set while the progress thread blocks: the deadline it sleeps until (u64::MAX: none).
    pub(crate) sleeping_until: Option<u64>,
    pub(crate) txq: Vec<Transmit>,
    pub(crate) via: Vec<SendSocket>,
    /// ACKs held back (oldest first) so that they leave in one system call with the next
    /// datagram, or once [`ACK_DEFER`] has passed since the first was held.
    pub(crate) deferred: Vec<Transmit>,
    /// Where each of `deferred` leaves from.
    pub(crate) deferred_via: Vec<SendSocket>,
    /// Datagrams a link held back (a same-host ring with no free slot: see
    /// [`softrdma_net::Link::holds_back`]), oldest first: offered again before anything
    /// new to their destination, see [`crate::tx::Held`].
    pub(crate) held: crate::tx::Held,
}

/// The receive half of the device's link (a duplicate descriptor of its socket) and its
/// buffers.
pub(crate) struct Rx {
    pub(crate) link: Box<dyn Link>,
    pub(crate) batch: udp::RecvBatch,
    pub(crate) errors: u64,
    /// One batch per multicast group socket, in the order of [`Groups::socks`].
    pub(crate) mc_batches: Vec<udp::RecvBatch>,
    /// How many datagrams each of `mc_batches` holds this step.
    pub(crate) mc_counts: Vec<usize>,
    /// The receive half of the second address's socket and its batch.
    pub(crate) alt: Option<(Box<dyn Link>, udp::RecvBatch)>,
    /// The device time the last step read.
    pub(crate) last_now: u64,
    /// Steps in a row that received nothing (see `CLOCK_EVERY`).
    pub(crate) quiet_steps: u32,
}

pub(crate) struct Runtime {
    pub(crate) name: String,
    /// The same-host path's state: "on", or why it is off.
    pub(crate) same_host: String,
    pub(crate) addr: SocketAddr,
    /// The RoCE MTU of the link the address was on when the device opened, if found
    /// (`netdev::roce_mtu_at`).
    pub(crate) link_mtu: Option<softrdma_transport::verbs::Mtu>,
    /// The device's address of the other IP version, GID index 1, if it has a socket.
    pub(crate) alt_addr: Option<SocketAddr>,
    /// Set when a wait saw the epoll set of extra sockets readable: the next step reads
    /// the second address's socket even if it has been quiet.
    pub(crate) alt_ready: AtomicBool,
    /// Device time until which every step reads the second address's socket (it carried
    /// traffic recently). Outside it, a step reads it only when a wait saw it readable
    /// (`alt_ready`), so a device used over one address pays no second receive call per
    /// step.
    pub(crate) alt_until: AtomicU64,
    /// Steps taken, for reading a quiet second socket every [`ALT_EVERY`] steps: threads
    /// that poll without ever waiting (busy polling) see it that way.
    pub(crate) alt_steps: AtomicU64,
    pub(crate) start: Instant,
    /// The real time (ns since the Unix epoch) at `start`: device times as wall-clock
    /// times ([`crate::Device::wallclock_ns`]).
    pub(crate) start_wall_ns: u64,
    pub(crate) core: Mutex<Engine>,
    pub(crate) rx: Mutex<Rx>,
    /// Wakes the progress thread.
    pub(crate) wake: EventFd,
    /// Wakes application threads blocked in [`Device::wait_for`].
    pub(crate) notify: EventFd,
    pub(crate) async_fd: EventFd,
    /// Readable while MADs wait in the engine's GSI inbox, for the connection manager.
    pub(crate) mad_fd: EventFd,
    pub(crate) sock_fd: OwnedFd,
    /// What a thread goes through to block on `sock_fd`, if the link has it (the
    /// same-host rings: their senders wake only a receiver that said it sleeps).
    pub(crate) sleep_gate: Option<std::sync::Arc<dyn softrdma_net::SleepGate>>,
    /// The receive sockets of the multicast groups the device's QPs are attached to.
    pub(crate) groups: Mutex<Groups>,
    /// Whether `groups` has any socket, read without its lock on every step.
    pub(crate) has_groups: AtomicBool,
    /// Readable while a group socket is (an epoll set of them): waiters poll it beside
    /// `sock_fd`.
    pub(crate) mc_poll: OwnedFd,
    pub(crate) stop: AtomicBool,
    pub(crate) busy_poll: bool,
    pub(crate) spin: Duration,
    /// Bumped after every engine step that may have added completions or events.
    pub(crate) generation: AtomicU64,
    /// Earliest timer deadline of the engine (u64::MAX: none), as of the last step.
    pub(crate) next_timer: AtomicU64,
    /// Application threads inside [`Device::wait_for`].
    pub(crate) waiters: AtomicUsize,
    /// Of those, how many block in ppoll.
    pub(crate) blocked: AtomicUsize,
    /// Device time of the last application poll or wait.
    pub(crate) app_active_at: AtomicU64,
    /// Application threads inside [`Device::progress`] right now.
    pub(crate) app_in_progress: AtomicUsize,
    /// Device time by which held-back ACKs must leave (u64::MAX: none held).
    pub(crate) ack_due: AtomicU64,
    /// Whether the held-back datagrams include requests or responses (not only ACKs):
    /// they leave as soon as an application thread drives progress.
    pub(crate) data_held: AtomicBool,
}

impl Runtime {
    pub(crate) fn now(&self) -> u64 {
        self.start.elapsed().as_nanos().min(u64::MAX as u128) as u64
    }
    /// The engine lock. A panic while it was held (a bug) must not make every later call
    /// panic too, so poisoning is ignored: the engine's state is still memory-safe.
    pub(crate) fn lock(&self) -> MutexGuard<'_, Engine> {
        self.core.lock().unwrap_or_else(|e| e.into_inner())
    }
    /// The group sockets. A panic while the lock was held leaves them usable.
    pub(crate) fn groups(&self) -> MutexGuard<'_, Groups> {
        self.groups.lock().unwrap_or_else(|e| e.into_inner())
    }
    /// About to block on `sock_fd`: `false` if datagrams wait already (take them, do
    /// not block; no [`Runtime::sleep_end`] then). `nudges`: the caller waits for memory
    /// that a same-host peer may write with no packet (an application thread in
    /// [`crate::Device::wait_for`]), so a placed WRITE must wake it too; the progress
    /// thread waits for packets and timers alone.
    pub(crate) fn sleep_begin(&self, nudges: bool) -> bool {
        match &self.sleep_gate {
            Some(g) => g.prepare_sleep(nudges),
            None => true,
        }
    }
    /// Done blocking on `sock_fd` (`nudges` as given to [`Runtime::sleep_begin`]).
    pub(crate) fn sleep_end(&self, nudges: bool) {
        if let Some(g) = &self.sleep_gate {
            g.end_sleep(nudges);
        }
    }
    /// The receive half, if no other thread is receiving.
    pub(crate) fn try_rx(&self) -> Option<MutexGuard<'_, Rx>> {
        match self.rx.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }
    /// What the progress thread's pacing decisions look at.
    pub(crate) fn seen(&self) -> Seen {
        Seen {
            now: self.now(),
            app_active_at: self.app_active_at.load(Ordering::Relaxed),
            waiters: self.waiters.load(Ordering::SeqCst) > 0,
            ack_due: self.ack_due.load(Ordering::Acquire),
        }
    }
    pub(crate) fn mark_app_active(&self) {
        // 0 means "never".
        self.app_active_at
            .store(self.now().max(1), Ordering::Relaxed);
    }

    /// One progress step: receive a batch (engine unlocked), then handle it and fire due
    /// timers under the engine lock. Returns whether anything happened. `app`: an
    /// application thread runs the step and will look at the completions it makes right
    /// after, so ACKs it produces are held back ([`Flush::Defer`]) rather than costing a
    /// system call before the application sees its completion.
    pub(crate) fn step(&self, rx: &mut Rx, app: bool) -> bool {
        if self.data_held.load(Ordering::Acquire) {
            // Posts held back their datagrams to leave together; whoever drives progress
            // next (the application, done posting for now and looking for completions)
            // sends them.
            self.flush_deferred();
        }
        let Rx {
            link,
            batch,
            errors,
            mc_batches,
            mc_counts,
            alt,
            last_now,
            quiet_steps,
        } = rx;
        let n = receive(&mut **link, batch, errors, "device");
        if link.take_nudged() {
            // A same-host peer wrote into our memory with no datagram: whoever waits for
            // memory to change looks again (see `after_step_with`).
            self.generation.fetch_add(1, Ordering::SeqCst);
            if self.blocked.load(Ordering::SeqCst) > 0 {
                self.notify.set();
            }
        }
        mc_counts.clear();
        let mut mc_full = false;
        if self.has_groups.load(Ordering::Acquire) {
            let mut groups = self.groups();
            for (i, (_, sock)) in groups.socks.iter_mut().enumerate() {
                if mc_batches.len() <= i {
                    mc_batches.push(udp::RecvBatch::new(MC_BATCH, crate::RX_BUF));
                }
                let k = receive(sock, &mut mc_batches[i], errors, "multicast group");
                mc_full |= k == MC_BATCH;
                mc_counts.push(k);
            }
        }
        let m: usize = mc_counts.iter().sum();
        // A busy-polling thread steps every hundred nanoseconds or so: on a step that found
        // nothing, the clock (for due timers) is read only every CLOCK_EVERY steps, a
        // microsecond late at most for timers of tens of microseconds and more.
        let quiet = n == 0 && m == 0;
        let fresh = !quiet || *quiet_steps % CLOCK_EVERY == 0;
        let mut now = if fresh { self.now() } else { *last_now };
        *last_now = now;
        *quiet_steps = if quiet {
            quiet_steps.wrapping_add(1)
        } else {
            0
        };
        let mut a = 0;
        if let Some((sock, abatch)) = alt.as_mut() {
            if self.alt_ready.swap(false, Ordering::AcqRel)
                || now < self.alt_until.load(Ordering::Relaxed)
                || self.alt_steps.fetch_add(1, Ordering::Relaxed) % ALT_EVERY == 0
            {
                a = receive(&mut **sock, abatch, errors, "second address");
                if a > 0 {
                    if !fresh {
                        now = self.now();
                        *last_now = now;
                    }
                    self.alt_used(now);
                }
                mc_full |= a == abatch.capacity();
            }
        }
        if n == 0
            && m == 0
            && a == 0
            && now < self.next_timer.load(Ordering::Acquire)
            && now < self.ack_due.load(Ordering::Acquire)
        {
            return false;
        }
        let mut core = self.lock();
        let core = &mut *core;
        if n + m + a > 0 {
            core.stats.rx_batches += 1;
            let ts = if core.pcap.is_some() { wall_ns() } else { 0 };
            let group_datagrams = mc_batches
                .iter()
                .zip(mc_counts.iter())
                .flat_map(|(b, &k)| b.iter().take(k));
            let alt_datagrams = alt.iter().flat_map(|(_, b)| b.iter().take(a));
            for d in batch
                .iter()
                .take(n)
                .chain(group_datagrams)
                .chain(alt_datagrams)
            {
                core.stats.rx_datagrams += 1;
                core.stats.rx_bytes += d.data.len() as u64;
                if let Some(p) = core.pcap.as_mut() {
                    let addrs = Addrs::new(d.src, d.dst);
                    let (f, note) = crate::tx::trace_frame(&addrs, d.tos, d.data, d.shm);
                    if p.write_packet(ts, &f, Some(Direction::Inbound), note)
                        .is_err()
                    {
                        core.stats.pcap_errors += 1;
                    }
                }
                if d.shm {
                    core.rnic
                        .handle_datagram_from_ring(now, d.src, d.dst, d.tos, d.data);
                } else {
                    core.rnic
                        .handle_datagram_tos(now, d.src, d.dst, d.tos, d.data);
                }
            }
        }
        // A full batch means more may be waiting in the socket, perhaps the very ACK that
        // makes a due retransmission needless: fire timers once the socket is drained, or
        // when they are overdue by more than TIMER_GRACE (so a flood cannot starve them).
        let drained = n < batch.capacity() && !mc_full;
        if core
            .rnic
            .poll_timeout()
            .is_some_and(|t| t <= now && (drained || now - t > TIMER_GRACE_NS))
        {
            core.rnic.handle_timeout(now);
        }
        let flush = if app { Flush::Defer } else { Flush::All };
        core.after_step_with(self, now, true, flush);
        true
    }

    /// The second address's socket carried a datagram at `now`: read it on every step
    /// for a while.
    pub(crate) fn alt_used(&self, now: u64) {
        self.alt_until
            .store(now.saturating_add(ALT_WINDOW_NS), Ordering::Relaxed);
    }

    /// A wait saw the extra sockets' epoll set readable ([`Runtime::alt_ready`]).
    pub(crate) fn extra_readable(&self) {
        if self.alt_addr.is_some() {
            self.alt_ready.store(true, Ordering::Release);
        }
    }

    /// Send held-back ACKs now (before blocking, or once they are due).
    pub(crate) fn flush_deferred(&self) {
        if self.ack_due.load(Ordering::Acquire) == u64::MAX {
            return;
        }
        let mut core = self.lock();
        let now = self.now();
        core.after_step_with(self, now, false, Flush::All);
    }
}

impl Engine {
    /// After every engine step: send what it produced, signal channel and async fds, and
    /// wake the progress thread if the next timer moved earlier than its sleep. `changed`:
    /// the step may have added completions (bump the generation, wake blocked waiters).
    pub(crate) fn after_step(&mut self, sh: &Runtime, now: u64, changed: bool) {
        self.after_step_with(sh, now, changed, Flush::Due);
    }

    pub(crate) fn after_step_with(&mut self, sh: &Runtime, now: u64, changed: bool, flush: Flush) {
        if self.rnic.mcast_generation() != self.mc_seen {
            self.sync_groups(sh);
        }
        self.flush_tx(sh, now, flush);
        while let Some(ev) = self.rnic.next_event() {
            self.async_q.push_back(ev);
        }
        if !self.async_q.is_empty() {
            // An event of an object destroyed before the program read it goes with the
            // object, as the kernel's uverbs drops it: a program that tears down must not
            // be handed events of QPs, CQs or SRQs it no longer has (UCX's handlers crash
            // on one).
            let rnic = &self.rnic;
            self.async_q.retain(|e| event_object_lives(rnic, e));
        }
        let ctx = &self.rnic;
        for (ch, c) in self.channels.iter_mut() {
            let pending = ctx.channel_pending(*ch) > 0;
            if pending != c.signaled {
                if pending {
                    c.fd.set();
                } else {
                    c.fd.clear();
                }
                c.signaled = pending;
            }
        }
        let pending = !self.async_q.is_empty();
        if pending != self.async_signaled {
            if pending {
                sh.async_fd.set();
            } else {
                sh.async_fd.clear();
            }
            self.async_signaled = pending;
        }
        self.signal_mads(sh);
        let next = self.rnic.poll_timeout();
        sh.next_timer
            .store(next.unwrap_or(u64::MAX), Ordering::Release);
        if let (Some(sleep), Some(t)) = (self.sleeping_until, next) {
            if t < sleep {
                self.sleeping_until = None;
                self.stats.wakeups += 1;
                sh.wake.set();
            }
        }
        if changed {
            // SeqCst pairs with `wait_for`: it counts itself blocked, then rereads the
            // generation; either it sees this bump or we see it blocked.
            sh.generation.fetch_add(1, Ordering::SeqCst);
            if sh.blocked.load(Ordering::SeqCst) > 0 {
                sh.notify.set();
            }
        }
    }

    /// Join the multicast groups the engine's QPs are attached to and leave the others
    /// (see [`crate::mcast`]). Runs after every engine step that changed them, so an
    /// attach has joined by the time the call that made it returns.
    pub(crate) fn sync_groups(&mut self, sh: &Runtime) {
        self.mc_seen = self.rnic.mcast_generation();
        let mut groups = sh.groups();
        groups.sync(&self.rnic, sh.addr, sh.mc_poll.as_fd());
        sh.has_groups
            .store(!groups.socks.is_empty(), Ordering::Release);
    }

    /// Make the MAD fd readable exactly while the GSI inbox has MADs.
    pub(crate) fn signal_mads(&mut self, sh: &Runtime) {
        let pending = self.rnic.gsi_pending();
        if pending != self.mad_signaled {
            if pending {
                sh.mad_fd.set();
            } else {
                sh.mad_fd.clear();
            }
            self.mad_signaled = pending;
        }
    }
}

/// Receive a batch from `sock`: how many datagrams, 0 on an error (counted in `errors`
/// and logged with which socket, `what`, failed).
fn receive(sock: &mut dyn Link, batch: &mut udp::RecvBatch, errors: &mut u64, what: &str) -> usize {
    sock.recv_batch(batch).unwrap_or_else(|e| {
        *errors += 1;
        tracing::debug!(error = %e, socket = what, "receive failed");
        0
    })
}

/// Whether the object async event `e` is about still exists.
fn event_object_lives(rnic: &Rnic, e: &AsyncEvent) -> bool {
    match *e {
        AsyncEvent::QpFatal(q)
        | AsyncEvent::QpReqErr(q)
        | AsyncEvent::QpAccessErr(q)
        | AsyncEvent::CommEst(q)
        | AsyncEvent::SqDrained(q)
        | AsyncEvent::QpLastWqeReached(q) => rnic.qp_init_attr(q).is_ok(),
        AsyncEvent::CqErr(c) => rnic.cq_len(c).is_ok(),
        AsyncEvent::SrqLimitReached(s) => rnic.query_srq(s).is_ok(),
        AsyncEvent::PortActive(_) | AsyncEvent::DeviceFatal => true,
    }
}

/// Wall-clock time for pcap records, in nanoseconds since the epoch.
pub(crate) fn wall_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}
