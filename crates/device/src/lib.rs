//! softrdma device runtime: the "NIC". Binds a protocol engine ([`Rnic`]) to a UDP driver.
//!
//! - Posting runs the requester in the caller's thread: [`Device::with`] locks the engine,
//!   runs the caller's closure (post, poll, modify…), then sends what it produced.
//! - A *progress step* receives a datagram batch from the socket (without holding the
//!   engine lock: the receive half is a duplicate of the socket with its own lock), then
//!   locks the engine, runs the responder and completer ([`Rnic::handle_datagram`]), fires
//!   due timers ([`Rnic::handle_timeout`]) and sends what the engine produced. Whoever
//!   holds the receive half runs it: the progress thread, or an application thread that
//!   polls or waits on a completion queue ([`Device::progress`], [`Device::wait_for`]).
//! - One spinning thread per process: while an application thread polls or waits, the
//!   progress thread backs off (it blocks on its wake-up eventfd, rechecking every
//!   millisecond) and the application thread drives progress itself, so a completion
//!   needs no cross-thread wake-up. With no application thread polling, the progress
//!   thread spins on non-blocking receives for a short while after activity, then blocks
//!   in `ppoll(2)` on the socket and the wake eventfd with the next timer deadline as
//!   timeout. A waiting application thread likewise spins (driving progress) for a short
//!   while and then blocks on the socket itself. A cross-core wake-up costs tens of
//!   microseconds on small machines, a busy-polled receive about one, so neither pure
//!   blocking nor pure spinning is acceptable. Busy polling is opt-in
//!   ([`DeviceConfig::busy_poll`], `SOFTRDMA_BUSY_POLL=1`): waiters never block.
//! - [`Device::generation`] changes after every engine step that may have added a
//!   completion, so an empty completion queue can be polled without the engine lock.
//! - Packets leave from rxe's per-QP UDP source port (`0xC000 + hash(QPN)`, which the
//!   engine seals the ICRC for): each source port gets a send-only socket bound to (device
//!   IP, that port), created on first use, so the wire carries exactly what rxe would send.
//!   If that bind fails (the port is taken, say by another device on the same IP), packets
//!   of that port leave from the device socket (port 4791) with the ICRC resealed for it.
//! - Runs of equal-size datagrams to one peer (the middle packets of a message) leave as
//!   one UDP GSO message; the kernel numbers the segments' IPv4 IDs 0, 1, 2, …, so
//!   segment *k*'s ICRC is re-sealed for ID *k* (an XOR, no second pass over the data).
//! - Completion channels and async events are real file descriptors (eventfds), readable
//!   while events are pending, so they work with poll/epoll.
//! - Time is nanoseconds since the device opened, from a monotonic clock.
//! - `SOFTRDMA_PCAP=FILE` (or [`DeviceConfig::pcap`]) traces every datagram sent and
//!   received as a pcap file.
//! - Every open device publishes its counters for `softrdma stats` to a file ([`statsfile`]);
//!   `SOFTRDMA_STATS=0` (or [`DeviceConfig::stats_dir`] `None`) turns that off.

#![warn(missing_docs)]

pub mod config;
pub mod log;
pub mod statsfile;
mod sys;

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io::{self, BufWriter};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use softrdma_net::udp;
pub use softrdma_net::udp::Stats as DriverStats;
use softrdma_transport::verbs::{AsyncEvent, ChannelId, Gid};
pub use softrdma_transport::{verbs, Rnic, Stats as EngineStats, Transmit};
use softrdma_wire::icrc::IpIdCache;
use softrdma_wire::{frame, icrc, pcap::PcapWriter, Addrs};

pub use config::{devices, DeviceAddr, DeviceEntry};
pub use sys::EventFd;

/// The RoCEv2 UDP port.
pub const ROCE_PORT: u16 = 4791;
/// Default spin time of the progress thread after activity, before it blocks.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);
/// Datagrams per receive batch.
const RX_BATCH: usize = 32;
/// Receive buffer size per datagram without GRO: a 4096-byte MTU packet with all its
/// headers, with room to spare.
const RX_BUF: usize = 9216;
/// Receive slots per batch with GRO, each [`udp::GRO_BUF_SIZE`] bytes (1 MiB in all).
const RX_BATCH_GRO: usize = 16;
/// Times a full socket send buffer is retried before the rest of a burst is dropped.
const TX_FULL_RETRIES: u32 = 64;
/// Datagrams handed to the driver per send call.
const TX_CHUNK: usize = 256;
/// Longest an ACK produced while an application thread drives progress waits to leave
/// with the next request while that thread keeps calling in (see [`Core::flush_tx`]); if
/// it stops, the progress thread sends it when it next looks (within [`APP_WINDOW`]).
const ACK_DEFER: Duration = Duration::from_micros(20);
/// BTH opcode of an RC ACKNOWLEDGE (ACK or NAK, told apart by the AETH syndrome).
const OP_RC_ACK: u8 = 0x11;

/// How to open a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceConfig {
    /// Device name.
    pub name: String,
    /// Its address.
    pub addr: DeviceAddr,
    /// Never block: the progress thread polls continuously (lowest latency, one core).
    pub busy_poll: bool,
    /// How long the progress thread keeps spinning after activity before it blocks.
    pub spin: Duration,
    /// Write every datagram sent and received to this pcap file.
    pub pcap: Option<PathBuf>,
    /// Seed of key and PSN randomness (random if None).
    pub seed: Option<u64>,
    /// Publish the device's counters for `softrdma stats` to a file in this directory
    /// while it is open ([`statsfile`]); None: don't.
    pub stats_dir: Option<PathBuf>,
}

impl DeviceConfig {
    /// A configuration for `name` at `addr`, with `SOFTRDMA_BUSY_POLL`, `SOFTRDMA_PCAP`
    /// and the stats directory ([`statsfile::default_dir`]: none if `SOFTRDMA_STATS=0`)
    /// taken from the environment.
    pub fn new(name: &str, addr: DeviceAddr) -> DeviceConfig {
        let busy_poll = std::env::var("SOFTRDMA_BUSY_POLL").is_ok_and(|v| v == "1");
        let pcap = std::env::var_os("SOFTRDMA_PCAP")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from);
        DeviceConfig {
            name: name.to_string(),
            addr,
            busy_poll,
            spin: DEFAULT_SPIN,
            pcap,
            seed: None,
            stats_dir: statsfile::default_dir(),
        }
    }
    /// The configuration of a configured device (see [`config::devices`]).
    pub fn from_entry(e: &DeviceEntry) -> DeviceConfig {
        DeviceConfig::new(&e.name, e.addr)
    }
}

/// Counters of the runtime (the engine's are in [`EngineStats`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LinkStats {
    /// Datagrams handed to the socket.
    pub tx_datagrams: u64,
    /// UDP payload bytes handed to the socket.
    pub tx_bytes: u64,
    /// Send batches (system calls).
    pub tx_batches: u64,
    /// Datagrams the socket refused (buffer full or error); the transport's retries cover them.
    pub tx_dropped: u64,
    /// Datagrams received.
    pub rx_datagrams: u64,
    /// UDP payload bytes received.
    pub rx_bytes: u64,
    /// Receive batches that returned data.
    pub rx_batches: u64,
    /// Receive errors other than "nothing there".
    pub rx_errors: u64,
    /// Times the progress thread blocked in poll(2).
    pub sleeps: u64,
    /// Times a poster woke the progress thread for an earlier timer.
    pub wakeups: u64,
    /// Trace records that could not be written.
    pub pcap_errors: u64,
}

/// Engine and runtime counters.
#[derive(Debug, Clone, Default)]
pub struct DeviceStats {
    /// The protocol engine's counters.
    pub engine: EngineStats,
    /// The runtime's counters.
    pub link: LinkStats,
    /// The UDP driver's counters.
    pub driver: DriverStats,
}

struct Chan {
    fd: EventFd,
    signaled: bool,
}

/// Where a datagram leaves from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Via {
    /// The device socket (port 4791).
    Main,
    /// The send-only socket of this source port.
    Port(u16),
}

/// Everything behind the engine lock.
struct Core {
    rnic: Rnic,
    /// The send half of the device socket.
    link: udp::Driver,
    /// Send-only sockets per UDP source port; `None`: the bind failed, use `link` and reseal.
    ports: HashMap<u16, Option<udp::Driver>>,
    /// Per-length ICRC work for sealing GSO segments ([`seal_gso_segments`]).
    ip_ids: IpIdCache,
    pcap: Option<PcapWriter<BufWriter<File>>>,
    channels: HashMap<ChannelId, Chan>,
    async_q: VecDeque<AsyncEvent>,
    async_signaled: bool,
    stats: LinkStats,
    /// Set while the progress thread blocks: the deadline it sleeps until (u64::MAX: none).
    sleeping_until: Option<u64>,
    txq: Vec<Transmit>,
    via: Vec<Via>,
    /// ACKs held back (oldest first) so that they leave in one system call with the next
    /// datagram, or once [`ACK_DEFER`] has passed since the first was held.
    deferred: Vec<Transmit>,
    /// Where each of `deferred` leaves from.
    deferred_via: Vec<Via>,
}

/// The receive half of the device socket (a duplicate descriptor) and its buffers.
struct Rx {
    link: udp::Driver,
    batch: udp::RecvBatch,
    errors: u64,
}

struct Shared {
    name: String,
    addr: SocketAddr,
    start: Instant,
    core: Mutex<Core>,
    rx: Mutex<Rx>,
    /// Wakes the progress thread.
    wake: EventFd,
    /// Wakes application threads blocked in [`Device::wait_for`].
    notify: EventFd,
    async_fd: EventFd,
    sock_fd: RawFd,
    stop: AtomicBool,
    busy_poll: bool,
    spin: Duration,
    /// Bumped after every engine step that may have added completions or events.
    generation: AtomicU64,
    /// Earliest timer deadline of the engine (u64::MAX: none), as of the last step.
    next_timer: AtomicU64,
    /// Application threads inside [`Device::wait_for`].
    waiters: AtomicUsize,
    /// Of those, how many block in ppoll.
    blocked: AtomicUsize,
    /// Device time of the last application poll or wait.
    app_active_at: AtomicU64,
    /// Application threads inside [`Device::progress`] right now.
    app_in_progress: AtomicUsize,
    /// Device time by which held-back ACKs must leave (u64::MAX: none held).
    ack_due: AtomicU64,
    /// Whether the held-back datagrams include requests or responses (not only ACKs):
    /// they leave as soon as an application thread drives progress.
    data_held: AtomicBool,
}

impl Shared {
    fn now(&self) -> u64 {
        self.start.elapsed().as_nanos().min(u64::MAX as u128) as u64
    }
    /// The engine lock. A panic while it was held (a bug) must not make every later call
    /// panic too, so poisoning is ignored: the engine's state is still memory-safe.
    fn lock(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(|e| e.into_inner())
    }
    /// The receive half, if no other thread is receiving.
    fn try_rx(&self) -> Option<MutexGuard<'_, Rx>> {
        match self.rx.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }
    /// Whether an application thread drives progress now (or did within [`APP_WINDOW`]),
    /// so the progress thread should stay out of its way.
    fn app_driving(&self, now: u64) -> bool {
        let last = self.app_active_at.load(Ordering::Relaxed);
        self.waiters.load(Ordering::SeqCst) > 0
            || (last != 0 && now.saturating_sub(last) < APP_WINDOW.as_nanos() as u64)
    }
    fn mark_app_active(&self) {
        // 0 means "never".
        self.app_active_at
            .store(self.now().max(1), Ordering::Relaxed);
    }

    /// One progress step: receive a batch (engine unlocked), then handle it and fire due
    /// timers under the engine lock. Returns whether anything happened. `app`: an
    /// application thread runs the step and will look at the completions it makes right
    /// after, so ACKs it produces are held back ([`Flush::Defer`]) rather than costing a
    /// system call before the application sees its completion.
    fn step(&self, rx: &mut Rx, app: bool) -> bool {
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
        } = rx;
        let n = match link.recv_batch(batch) {
            Ok(n) => n,
            Err(_) => {
                *errors += 1;
                0
            }
        };
        let now = self.now();
        if n == 0
            && now < self.next_timer.load(Ordering::Acquire)
            && now < self.ack_due.load(Ordering::Acquire)
        {
            return false;
        }
        let mut core = self.lock();
        let core = &mut *core;
        if n > 0 {
            core.stats.rx_batches += 1;
            let ts = if core.pcap.is_some() { wall_ns() } else { 0 };
            for d in batch.iter().take(n) {
                core.stats.rx_datagrams += 1;
                core.stats.rx_bytes += d.data.len() as u64;
                if let Some(p) = core.pcap.as_mut() {
                    let f = frame::emit_ip_udp(&Addrs::new(d.src, d.dst), d.tos, d.data);
                    if p.write_packet(ts, &f).is_err() {
                        core.stats.pcap_errors += 1;
                    }
                }
                core.rnic
                    .handle_datagram_tos(now, d.src, d.dst, d.tos, d.data);
            }
        }
        // A full batch means more may be waiting in the socket, perhaps the very ACK that
        // makes a due retransmission needless: fire timers once the socket is drained, or
        // when they are overdue by more than TIMER_GRACE (so a flood cannot starve them).
        let drained = n < batch.capacity();
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

    /// Send held-back ACKs now (before blocking, or once they are due).
    fn flush_deferred(&self) {
        if self.ack_due.load(Ordering::Acquire) == u64::MAX {
            return;
        }
        let mut core = self.lock();
        let now = self.now();
        core.after_step_with(self, now, false, Flush::All);
    }
}

/// Whether the progress thread watches the socket while an application thread also drives
/// progress. An application that spins on memory a peer writes (as ib_write_lat does)
/// leaves datagrams to the progress thread even though it polls a CQ in between, so once
/// it has done so the progress thread keeps watching, each datagram waking it. An
/// application that polls for everything takes its datagrams itself and those wake-ups
/// are wasted (and preempt it), so watching stops when most of them find nothing.
#[derive(Debug, Default)]
struct Share {
    watch: bool,
    useful: u32,
    wasted: u32,
}

impl Share {
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

/// How long an application thread may stay away before the progress thread, while it
/// keeps out of the way, watches the socket again.
const APP_IDLE: Duration = Duration::from_micros(100);

/// An application that called in less than this long before a datagram woke the
/// progress thread is polling: it takes the datagram itself.
const APP_BUSY: Duration = Duration::from_micros(5);

/// How long the progress thread leaves the socket to a polling application before it looks
/// again.
const LEAVE: Duration = Duration::from_micros(10);

/// How long a due timer may wait for the socket to be drained first, in nanoseconds.
const TIMER_GRACE_NS: u64 = 1_000_000;

/// How long after an application thread last polled the progress thread keeps out of the
/// way (and how often it rechecks while an application thread waits).
const APP_WINDOW: Duration = Duration::from_millis(1);
/// Longest single block of a waiter that shares the wake-up fd with other blocked waiters
/// (one of them may clear it before another sees it).
const SHARED_BLOCK: Duration = Duration::from_millis(1);

/// What [`Core::flush_tx`] does with held-back ACKs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flush {
    /// Send everything now.
    All,
    /// Send held-back ACKs with other datagrams, or once due; otherwise keep them.
    Due,
    /// Like `Due`, and hold back new ACKs too when they are all there is to send.
    Defer,
    /// Hold back everything (a post into a busy pipe), up to a send batch.
    Hold,
}

/// Whether a sealed RoCEv2 UDP payload is a positive RC ACK (not a NAK).
fn is_plain_ack(data: &[u8]) -> bool {
    // BTH (12 bytes), then the AETH whose syndrome bits 6:5 are 00 for an ACK.
    data.len() >= 16 && data[0] == OP_RC_ACK && data[12] & 0x60 == 0
}

fn wall_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

impl Core {
    /// After every engine step: send what it produced, signal channel and async fds, and
    /// wake the progress thread if the next timer moved earlier than its sleep. `changed`:
    /// the step may have added completions (bump the generation, wake blocked waiters).
    fn after_step(&mut self, sh: &Shared, now: u64, changed: bool) {
        self.after_step_with(sh, now, changed, Flush::Due);
    }

    fn after_step_with(&mut self, sh: &Shared, now: u64, changed: bool, flush: Flush) {
        self.flush_tx(sh, now, flush);
        while let Some(ev) = self.rnic.next_event() {
            self.async_q.push_back(ev);
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

    /// Send what the engine produced. ACKs made while an application thread drives
    /// progress (`Flush::Defer`) are held back when they are all there is, so the
    /// application sees its completion without waiting for a send system call; they go
    /// out in the same `sendmmsg` as the next datagram (typically the application's next
    /// request), or by themselves once [`ACK_DEFER`] has passed, or before any thread
    /// blocks. The peer gets them at most that much later, far inside its ACK timeout.
    fn flush_tx(&mut self, sh: &Shared, now: u64, flush: Flush) {
        let local = sh.addr;
        while let Some(mut t) = self.rnic.poll_transmit(now) {
            let via = if t.src == local {
                Via::Main
            } else if t.src.ip() == local.ip() && self.port_socket(t.src) {
                Via::Port(t.src.port())
            } else {
                // No socket for that source port: send from the device socket, and
                // reseal, since the ICRC covers the UDP header the receiver sees.
                icrc::seal(&Addrs::new(local, t.dst), &mut t.data);
                t.src = local;
                Via::Main
            };
            self.txq.push(t);
            self.via.push(via);
        }
        if !self.deferred.is_empty() || matches!(flush, Flush::Defer | Flush::Hold) {
            let due = sh.ack_due.load(Ordering::Relaxed);
            let hold = match flush {
                Flush::All => false,
                _ if now >= due => false,
                Flush::Due => self.txq.is_empty(),
                Flush::Defer => self.txq.iter().all(|t| is_plain_ack(&t.data)),
                Flush::Hold => self.deferred.len() + self.txq.len() < TX_CHUNK,
            };
            if hold {
                if self.deferred.is_empty() && !self.txq.is_empty() {
                    let due = now.saturating_add(ACK_DEFER.as_nanos() as u64);
                    sh.ack_due.store(due, Ordering::Release);
                }
                if self.txq.iter().any(|t| !is_plain_ack(&t.data)) {
                    sh.data_held.store(true, Ordering::Release);
                }
                self.deferred.append(&mut self.txq);
                self.deferred_via.append(&mut self.via);
                return;
            }
            if !self.deferred.is_empty() {
                // Held-back ACKs first, in the order they were made. Sending them after
                // the new datagrams would take one datagram off the critical path of a
                // ping-pong (on loopback each delivery runs inside this system call), but
                // a peer would then see our reply before the ACK of its request: its
                // receive completion before its send completion, an order no hardware
                // RNIC produces and that sequential verbs programs rely on.
                self.deferred.append(&mut self.txq);
                self.deferred_via.append(&mut self.via);
                std::mem::swap(&mut self.deferred, &mut self.txq);
                std::mem::swap(&mut self.deferred_via, &mut self.via);
                sh.ack_due.store(u64::MAX, Ordering::Release);
                sh.data_held.store(false, Ordering::Release);
            }
        }
        if self.txq.is_empty() {
            return;
        }
        if let Some(p) = self.pcap.as_mut() {
            let ts = wall_ns();
            for t in &self.txq {
                let f = frame::emit_ip_udp(&Addrs::new(t.src, t.dst), t.tos, &t.data);
                if p.write_packet(ts, &f).is_err() {
                    self.stats.pcap_errors += 1;
                }
            }
        }
        // One sendmmsg batch per run of datagrams leaving from the same socket.
        let mut at = 0;
        while at < self.txq.len() {
            let via = self.via[at];
            let end = self.via[at..]
                .iter()
                .position(|v| *v != via)
                .map_or(self.txq.len(), |k| at + k);
            let link = match via {
                Via::Main => &mut self.link,
                Via::Port(p) => match self.ports.get_mut(&p) {
                    Some(Some(d)) => d,
                    _ => &mut self.link,
                },
            };
            send_run(
                link,
                &mut self.txq[at..end],
                &mut self.stats,
                &mut self.ip_ids,
            );
            at = end;
        }
        // The buffers go back to the engine, which builds later packets in them: the
        // packet path allocates nothing in the steady state.
        for t in self.txq.drain(..) {
            self.rnic.recycle(t.data);
        }
        self.via.clear();
    }

    /// Whether a send-only socket for source address `src` exists (binding it on first use).
    fn port_socket(&mut self, src: SocketAddr) -> bool {
        let gso = self.link.gso_enabled();
        self.ports
            .entry(src.port())
            .or_insert_with(|| {
                let mut d = udp::Driver::bind_send_only(src).ok()?;
                d.set_gso(gso);
                Some(d)
            })
            .is_some()
    }
}

/// Re-seal the datagrams of `chunk` that `link` will send as segments of a GSO message:
/// the kernel gives segment *k* IPv4 ID *k* (see [`udp::Driver::gso_run_len`]), and the
/// ICRC, sealed by the engine for ID 0, covers it. A receiver that sees the IP header
/// (Linux rxe) checks exactly that; a UDP-socket receiver accepts any ID.
fn seal_gso_segments(link: &udp::Driver, chunk: &mut [Transmit], ip_ids: &mut IpIdCache) {
    // (start, length) of each run of more than one datagram, planned as the driver will
    // send them.
    let mut runs: Vec<(usize, usize)> = Vec::new();
    {
        let out: Vec<udp::OutDatagram<'_>> = chunk
            .iter()
            .map(|t| udp::OutDatagram {
                dst: t.dst,
                tos: t.tos,
                data: &t.data,
            })
            .collect();
        let mut at = 0;
        while at < out.len() {
            let n = link.gso_run_len(&out[at..]).max(1);
            if n > 1 && out[at].dst.is_ipv4() {
                runs.push((at, n));
            }
            at += n;
        }
    }
    for (start, n) in runs {
        for (k, t) in chunk[start + 1..start + n].iter_mut().enumerate() {
            // The last segment may be shorter: its own length, its own effect.
            ip_ids
                .get(t.data.len())
                .reseal(&mut t.data, 0, (k + 1) as u16);
        }
    }
}

/// Send `txq` from `link`: retry a full socket buffer a few times, then drop the rest as a
/// congested network would (the transport's retransmissions recover).
fn send_run(
    link: &mut udp::Driver,
    txq: &mut [Transmit],
    stats: &mut LinkStats,
    ip_ids: &mut IpIdCache,
) {
    let mut out: [udp::OutDatagram<'_>; TX_CHUNK] = [udp::OutDatagram {
        dst: SocketAddr::from(([0, 0, 0, 0], 0)),
        tos: 0,
        data: &[],
    }; TX_CHUNK];
    for chunk in txq.chunks_mut(TX_CHUNK) {
        if link.gso_enabled() {
            seal_gso_segments(link, chunk, ip_ids);
        }
        for (o, t) in out.iter_mut().zip(chunk.iter()) {
            *o = udp::OutDatagram {
                dst: t.dst,
                tos: t.tos,
                data: &t.data,
            };
        }
        let out = &out[..chunk.len()];
        let mut at = 0;
        let mut full = 0;
        while at < out.len() {
            stats.tx_batches += 1;
            match link.send_batch(&out[at..]) {
                Ok(0) if full < TX_FULL_RETRIES => {
                    // Socket buffer full: the kernel drains it within microseconds.
                    full += 1;
                    std::thread::yield_now();
                }
                Ok(0) => {
                    stats.tx_dropped += (out.len() - at) as u64;
                    break;
                }
                Err(_) => {
                    // This datagram is refused (too big, bad address): lost like one the
                    // network drops.
                    stats.tx_dropped += 1;
                    at += 1;
                }
                Ok(n) => {
                    for t in &out[at..at + n] {
                        stats.tx_datagrams += 1;
                        stats.tx_bytes += t.data.len() as u64;
                    }
                    at += n;
                }
            }
        }
    }
}

/// An open device: the engine, its socket and its progress thread. Dropping it stops the
/// thread and closes the socket.
pub struct Device {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    /// Publishes the counters to the stats file, if enabled and its thread started.
    publisher: Option<statsfile::Publisher>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("name", &self.shared.name)
            .field("addr", &self.shared.addr)
            .finish()
    }
}

impl Device {
    /// Open a device: bind its socket, start its progress thread.
    pub fn open(cfg: &DeviceConfig) -> io::Result<Device> {
        let mut link = match cfg.addr {
            DeviceAddr::Fixed(a) => udp::Driver::bind(a)?,
            DeviceAddr::AutoLoopback(port) => udp::bind_first_free_loopback(port)?,
        };
        // Runs of equal-size datagrams (a message's middle packets) leave as one GSO
        // message, segments re-sealed for their IP IDs (`seal_gso_segments`). Not while
        // tracing: the trace records each datagram as sealed before the kernel numbers it.
        // Should the kernel refuse GSO at run time, the driver resends that batch
        // datagram by datagram (each with ID 0, so the re-sealed ones fail a peer's ICRC
        // check once and are retransmitted) and stops using it.
        link.set_gso(cfg.pcap.is_none());
        let mut rx_link = link.try_clone()?;
        // GRO: a GSO message from a local peer arrives whole rather than cut into one
        // socket buffer per datagram by the receiving socket, which costs per-datagram
        // work and charges each piece its own overhead against the receive buffer (a UC
        // sender, which never retransmits, overran it that way). The driver splits the
        // buffers again.
        let gro = rx_link.set_gro(true).unwrap_or(false);
        let batch = if gro {
            udp::RecvBatch::new(RX_BATCH_GRO, udp::GRO_BUF_SIZE)
        } else {
            udp::RecvBatch::new(RX_BATCH, RX_BUF)
        };
        let addr = link.local_addr();
        let pcap = match &cfg.pcap {
            Some(p) => Some(PcapWriter::new(BufWriter::new(File::create(p)?))?),
            None => None,
        };
        let seed = cfg.seed.unwrap_or_else(sys::random_seed);
        let rnic = Rnic::new(addr, seed);
        let sock_fd = link.as_raw_fd();
        let shared = Arc::new(Shared {
            name: cfg.name.clone(),
            addr,
            start: Instant::now(),
            core: Mutex::new(Core {
                rnic,
                link,
                ports: HashMap::new(),
                ip_ids: IpIdCache::default(),
                pcap,
                channels: HashMap::new(),
                async_q: VecDeque::new(),
                async_signaled: false,
                stats: LinkStats::default(),
                sleeping_until: None,
                txq: Vec::new(),
                via: Vec::new(),
                deferred: Vec::new(),
                deferred_via: Vec::new(),
            }),
            rx: Mutex::new(Rx {
                link: rx_link,
                batch,
                errors: 0,
            }),
            wake: EventFd::new()?,
            notify: EventFd::new()?,
            async_fd: EventFd::new()?,
            sock_fd,
            stop: AtomicBool::new(false),
            busy_poll: cfg.busy_poll,
            spin: cfg.spin,
            generation: AtomicU64::new(0),
            next_timer: AtomicU64::new(u64::MAX),
            waiters: AtomicUsize::new(0),
            blocked: AtomicUsize::new(0),
            app_active_at: AtomicU64::new(0),
            app_in_progress: AtomicUsize::new(0),
            ack_due: AtomicU64::new(u64::MAX),
            data_held: AtomicBool::new(false),
        });
        let sh = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name(format!("{}-progress", cfg.name))
            .spawn(move || progress(&sh))?;
        // Best effort: a device whose counters cannot be published works all the same.
        let publisher = cfg.stats_dir.as_deref().and_then(|dir| {
            let sh = Arc::clone(&shared);
            statsfile::Publisher::start(dir, &cfg.name, move || {
                statsfile::Record::new(&sh.name, sh.addr, &stats_of(&sh))
            })
        });
        Ok(Device {
            shared,
            thread: Some(thread),
            publisher,
        })
    }

    /// Device name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }
    /// The address the device is bound to.
    pub fn addr(&self) -> SocketAddr {
        self.shared.addr
    }
    /// GID index 0: the IPv4-mapped form of the address (or the IPv6 address itself).
    pub fn gid(&self) -> Gid {
        Gid::from_ip(self.shared.addr.ip())
    }
    /// Device time: nanoseconds since the device opened.
    pub fn now(&self) -> u64 {
        self.shared.now()
    }
    /// Whether the device busy-polls ([`DeviceConfig::busy_poll`]).
    pub fn busy_poll(&self) -> bool {
        self.shared.busy_poll
    }
    /// The stats file the device publishes its counters to ([`DeviceConfig::stats_dir`]),
    /// if it does.
    pub fn stats_file(&self) -> Option<&std::path::Path> {
        self.publisher.as_ref().map(|p| p.file())
    }

    /// Run `f` on the engine (with the current device time), then send what it produced and
    /// update the channel and async-event fds. Posting, polling and modifying go through
    /// here, so the requester runs in the caller's thread.
    pub fn with<R>(&self, f: impl FnOnce(&mut Rnic, u64) -> R) -> R {
        let sh = &*self.shared;
        let mut core = sh.lock();
        let now = sh.now();
        let r = f(&mut core.rnic, now);
        core.after_step(sh, now, true);
        r
    }

    /// Send the datagrams held back by earlier posts and polls now. For a caller about to
    /// wait where the device does not see it (arming a CQ, then blocking on its channel's
    /// fd with poll(2)): what it waits for may depend on them.
    pub fn flush(&self) {
        self.shared.flush_deferred();
    }

    /// Like [`Device::with`] for posting send work requests. When the device already has
    /// requests in flight (a retransmission timer is armed), the datagrams the post makes
    /// are held back to leave with those of the next posts in one system call (and one
    /// GSO message): a program that posts a burst and then polls pays one send for the
    /// burst. They leave once a send batch is full, when a thread next drives progress
    /// (polls an empty CQ, waits), before anyone blocks, or after `ACK_DEFER`. A post into
    /// an idle pipe (a ping-pong) is sent at once.
    pub fn with_post<R>(&self, f: impl FnOnce(&mut Rnic, u64) -> R) -> R {
        let sh = &*self.shared;
        let mut core = sh.lock();
        let now = sh.now();
        let busy = core.rnic.poll_timeout().is_some();
        let r = f(&mut core.rnic, now);
        let flush = if busy { Flush::Hold } else { Flush::Due };
        core.after_step_with(sh, now, true, flush);
        r
    }

    /// Like [`Device::with`] for a closure that adds no completion, CQ event or async
    /// event (takes or acknowledges events, arms a CQ): [`Device::generation`] stays, so
    /// waiters are not woken for nothing; what the engine produced is still sent and the
    /// fds are updated.
    pub fn with_quiet<R>(&self, f: impl FnOnce(&mut Rnic, u64) -> R) -> R {
        let sh = &*self.shared;
        let mut core = sh.lock();
        let now = sh.now();
        let r = f(&mut core.rnic, now);
        core.after_step(sh, now, false);
        r
    }

    /// Like [`Device::with`] for a closure that only reads or removes state (polls a CQ,
    /// queries): it adds no completion, so [`Device::generation`] stays and nothing is
    /// sent or signalled.
    pub fn with_read<R>(&self, f: impl FnOnce(&mut Rnic) -> R) -> R {
        let mut core = self.shared.lock();
        f(&mut core.rnic)
    }

    /// A number that changes after every engine step that may have added a completion,
    /// a CQ event or an async event (it is read before polling: if it has not changed
    /// since a CQ was found empty, the CQ is still empty, no lock needed).
    pub fn generation(&self) -> u64 {
        self.shared.generation.load(Ordering::SeqCst)
    }

    /// Tell the device that an application thread just took completions from a CQ (found
    /// it non-empty, so it did not call [`Device::progress`]): it polls and will drive
    /// progress itself when the CQ runs dry, so the progress thread stays out of its way
    /// rather than compete with it for the core and the engine lock.
    pub fn note_poll(&self) {
        self.shared.mark_app_active();
    }

    /// Drive progress from the calling thread: if no other thread is receiving, receive a
    /// batch, handle it and fire due timers (one progress step). Returns whether anything
    /// happened. Also tells the progress thread that an application thread is polling, so
    /// it stays out of the way for a millisecond.
    pub fn progress(&self) -> bool {
        let sh = &*self.shared;
        sh.mark_app_active();
        sh.app_in_progress.fetch_add(1, Ordering::Relaxed);
        struct Out<'a>(&'a AtomicUsize);
        impl Drop for Out<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::Relaxed);
            }
        }
        let _out = Out(&sh.app_in_progress);
        match sh.try_rx() {
            Some(mut rx) => sh.step(&mut rx, true),
            None => {
                // Another thread (typically the progress thread) is receiving. A caller
                // that polls in a tight loop would spin on its core meanwhile, and when
                // that is the receiver's core too (a process pinned to one core, or more
                // threads than cores) it takes its turns from the thread doing the work.
                std::thread::yield_now();
                false
            }
        }
    }

    /// Wait until `check` returns `Some` or `timeout` passes (None: forever), driving
    /// progress from this thread: spin (receiving and handling datagrams here) for the
    /// configured spin time, then block in ppoll on the socket and a wake-up fd until a
    /// datagram, a completion made by another thread, or the next timer. With busy
    /// polling it never blocks. `check` runs again whenever the engine may have changed.
    /// Returns `None` on timeout.
    pub fn wait_for<R>(
        &self,
        timeout: Option<Duration>,
        mut check: impl FnMut() -> Option<R>,
    ) -> Option<R> {
        let sh = &*self.shared;
        let start = Instant::now();
        let deadline = timeout.and_then(|t| start.checked_add(t));
        sh.waiters.fetch_add(1, Ordering::SeqCst);
        struct Leave<'a>(&'a Shared);
        impl Drop for Leave<'_> {
            fn drop(&mut self) {
                self.0.mark_app_active();
                self.0.waiters.fetch_sub(1, Ordering::SeqCst);
            }
        }
        let _leave = Leave(sh);
        loop {
            let g = sh.generation.load(Ordering::SeqCst);
            if let Some(r) = check() {
                return Some(r);
            }
            let progressed = match sh.try_rx() {
                Some(mut rx) => sh.step(&mut rx, true),
                None => false,
            };
            if progressed || sh.generation.load(Ordering::SeqCst) != g {
                continue;
            }
            let now = Instant::now();
            let left = match deadline {
                Some(d) if now >= d => return None,
                Some(d) => Some(d - now),
                None => None,
            };
            if sh.busy_poll || now.duration_since(start) < sh.spin {
                std::hint::spin_loop();
                continue;
            }
            // Block, with no ACK held back. Counting ourselves blocked before rereading
            // the generation pairs with `Core::after_step`: a completion made from now on
            // wakes us.
            sh.flush_deferred();
            let others = sh.blocked.fetch_add(1, Ordering::SeqCst);
            if sh.generation.load(Ordering::SeqCst) != g {
                sh.blocked.fetch_sub(1, Ordering::SeqCst);
                continue;
            }
            let dnow = sh.now();
            let timer = sh.next_timer.load(Ordering::Acquire);
            let mut t = left;
            if timer != u64::MAX {
                let d = Duration::from_nanos(timer.saturating_sub(dnow));
                t = Some(t.map_or(d, |l| l.min(d)));
            }
            if others > 0 {
                t = Some(t.map_or(SHARED_BLOCK, |l| l.min(SHARED_BLOCK)));
            }
            let _ = sys::poll_readable(&[sh.sock_fd, sh.notify.as_raw_fd()], t);
            sh.blocked.fetch_sub(1, Ordering::SeqCst);
            sh.notify.clear();
        }
    }

    /// Give completion channel `ch` an eventfd, readable while the channel has events.
    /// Returns the fd, owned by the device until [`Device::remove_channel_fd`].
    pub fn add_channel_fd(&self, ch: ChannelId) -> io::Result<RawFd> {
        let fd = EventFd::new()?;
        let raw = fd.as_raw_fd();
        let sh = &*self.shared;
        let mut core = sh.lock();
        core.channels.insert(
            ch,
            Chan {
                fd,
                signaled: false,
            },
        );
        let now = sh.now();
        core.after_step(sh, now, true);
        Ok(raw)
    }

    /// Close the eventfd of channel `ch`.
    pub fn remove_channel_fd(&self, ch: ChannelId) {
        self.shared.lock().channels.remove(&ch);
    }

    /// The async-event fd: readable while async events are pending.
    pub fn async_event_fd(&self) -> RawFd {
        self.shared.async_fd.as_raw_fd()
    }

    /// Take the next async event, if any.
    pub fn next_async_event(&self) -> Option<AsyncEvent> {
        let sh = &*self.shared;
        let mut core = sh.lock();
        let ev = core.async_q.pop_front();
        let now = sh.now();
        core.after_step(sh, now, false);
        ev
    }

    /// Engine and runtime counters.
    pub fn stats(&self) -> DeviceStats {
        stats_of(&self.shared)
    }

    /// Source ports that have their own send-only socket (and those whose bind failed, so
    /// their packets leave from the device socket, resealed).
    pub fn source_ports(&self) -> (Vec<u16>, Vec<u16>) {
        let core = self.shared.lock();
        let mut ok = Vec::new();
        let mut failed = Vec::new();
        for (p, d) in &core.ports {
            if d.is_some() {
                ok.push(*p);
            } else {
                failed.push(*p);
            }
        }
        ok.sort_unstable();
        failed.sort_unstable();
        (ok, failed)
    }
}

/// Engine and runtime counters ([`Device::stats`]); also the stats publisher's snapshot,
/// which has the shared state but not the device.
fn stats_of(sh: &Shared) -> DeviceStats {
    let (rx_driver, rx_errors) = {
        let rx = sh.rx.lock().unwrap_or_else(|e| e.into_inner());
        (rx.link.stats(), rx.errors)
    };
    let core = sh.lock();
    let mut link = core.stats.clone();
    link.rx_errors += rx_errors;
    let mut driver = core.link.stats();
    for d in core.ports.values().flatten() {
        let s = d.stats();
        driver.sent_datagrams += s.sent_datagrams;
        driver.sent_batches += s.sent_batches;
        driver.gso_batches += s.gso_batches;
        driver.errors += s.errors;
    }
    driver.recv_datagrams += rx_driver.recv_datagrams;
    driver.recv_batches += rx_driver.recv_batches;
    driver.gro_segments += rx_driver.gro_segments;
    driver.errors += rx_driver.errors;
    DeviceStats {
        engine: core.rnic.stats().clone(),
        link,
        driver,
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // First, so that `softrdma stats` stops listing a device that is going away.
        drop(self.publisher.take());
        // ACKs held back for the application's next request must still reach the peer,
        // whose requester would otherwise retry into a closed port.
        self.shared.flush_deferred();
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.wake.set();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if let Some(p) = self.shared.lock().pcap.as_mut() {
            let _ = p.flush();
        }
    }
}

/// The progress thread: while an application thread drives progress, sleep on the wake
/// fd; otherwise receive, handle, fire timers, send; spin a while after activity, then
/// block until a datagram, a wake-up or the next timer.
fn progress(sh: &Shared) {
    // The progress thread sleeps for a few microseconds at a time (LEAVE): with the default
    // 50 us timer slack those sleeps would last ten times as long.
    sys::set_timer_slack(Duration::from_micros(1));
    let mut active_at = Instant::now();
    // How often to look whether an application thread that drives progress has stopped
    // calling in. Every look is a wake-up that preempts a thread, so while the application
    // keeps calling in, the looks back off (doubling up to APP_WINDOW); once it is found
    // idle they start again at APP_IDLE.
    let mut look_every = APP_IDLE;
    let mut share = Share::default();
    // Device time until which the socket is left to a polling application.
    let mut leave_until = 0u64;
    while !sh.stop.load(Ordering::Relaxed) {
        let now = sh.now();
        let mut watching = false;
        if sh.app_driving(now) {
            // An application thread polls or waits and drives progress itself: one
            // spinning thread per process. Recheck when its window ends.
            let last = sh.app_active_at.load(Ordering::Relaxed);
            let until = last.saturating_add(APP_WINDOW.as_nanos() as u64);
            let waiters = sh.waiters.load(Ordering::SeqCst) > 0;
            let idle = now.saturating_sub(last);
            let app_idle = idle >= APP_IDLE.as_nanos() as u64;
            // An application that stopped calling in (it may spin on memory a peer
            // WRITEs, as ib_write_lat does) must not leave packets waiting for the rest of
            // the window: once it has been idle for APP_IDLE, watch the socket too and take
            // over when something arrives; and once that has happened, keep watching the
            // socket while the application calls in (see [`Share`]). Blocked waiters
            // watch the socket themselves.
            let watch_sock = !waiters && (app_idle || share.watch) && now >= leave_until;
            let mut t = if waiters || until <= now {
                APP_WINDOW
            } else if watch_sock {
                look_every = APP_IDLE;
                Duration::from_nanos(until - now)
            } else if now < leave_until {
                // The socket was just left to the polling application: look again soon,
                // in case the datagram was not its after all.
                Duration::from_nanos(leave_until - now)
            } else {
                let t = look_every.max(Duration::from_nanos(
                    (APP_IDLE.as_nanos() as u64).saturating_sub(idle),
                ));
                look_every = (look_every * 2).min(APP_WINDOW);
                t
            };
            // ACKs an application thread held back leave with its next datagram or step;
            // if it has stopped calling in, they leave by their deadline from here. (Not
            // while it calls in: a wake-up per held ACK would cost more than it saves.)
            let due = sh.ack_due.load(Ordering::Acquire);
            if due != u64::MAX && app_idle {
                t = t.min(Duration::from_nanos(due.saturating_sub(now)));
            }
            let mut arrived = false;
            if !t.is_zero() {
                if watch_sock {
                    let r = sys::poll_readable(&[sh.wake.as_raw_fd(), sh.sock_fd], Some(t));
                    arrived = r.is_ok_and(|v| v.get(1).copied().unwrap_or(false));
                } else {
                    let _ = sys::poll_readable(&[sh.wake.as_raw_fd()], Some(t));
                }
                sh.wake.clear();
            }
            if sh.ack_due.load(Ordering::Acquire) <= sh.now() {
                sh.flush_deferred();
            }
            active_at = Instant::now();
            let still_idle = sh
                .now()
                .saturating_sub(sh.app_active_at.load(Ordering::Relaxed))
                >= APP_IDLE.as_nanos() as u64;
            if !arrived || !(still_idle || share.watch) {
                continue;
            }
            let age = sh
                .now()
                .saturating_sub(sh.app_active_at.load(Ordering::Relaxed));
            if age < APP_BUSY.as_nanos() as u64 || sh.app_in_progress.load(Ordering::Relaxed) > 0 {
                // The application called in a moment ago, or is inside a call (this
                // wake-up may have preempted it there): it polls and will take the
                // datagram itself, without the wake-up and the preemption that taking it
                // here costs it (a ping-pong that polls its CQ doubles its round trip
                // otherwise). Leave it, and the socket, for LEAVE; count a wasted look.
                // (One that spins on memory between calls, as ib_write_lat does, last
                // called a whole turn of its peer ago.)
                share.record(false);
                leave_until = sh.now().saturating_add(LEAVE.as_nanos() as u64);
                continue;
            }
            if still_idle {
                // The application left a datagram to us: it does not poll for everything
                // it waits for.
                share.watch = true;
            }
            watching = true;
        }
        let got = if watching {
            // Wait out an application thread that is receiving (it holds the lock for
            // one step), so that one arrival is one verdict, not a spin.
            let mut rx = sh.rx.lock().unwrap_or_else(|e| e.into_inner());
            let got = sh.step(&mut rx, false);
            share.record(got);
            got
        } else {
            match sh.try_rx() {
                Some(mut rx) => sh.step(&mut rx, false),
                None => false,
            }
        };
        if got {
            active_at = Instant::now();
            continue;
        }
        if sh.busy_poll || active_at.elapsed() < sh.spin {
            std::hint::spin_loop();
            continue;
        }
        // Block. The deadline is published under the lock so a poster that creates an
        // earlier timer sees it and wakes us (see `Core::after_step`).
        let timeout = {
            let mut core = sh.lock();
            let now = sh.now();
            core.after_step_with(sh, now, false, Flush::All);
            let deadline = core.rnic.poll_timeout();
            core.sleeping_until = Some(deadline.unwrap_or(u64::MAX));
            core.stats.sleeps += 1;
            if let Some(p) = core.pcap.as_mut() {
                let _ = p.flush();
            }
            deadline.map(|d| Duration::from_nanos(d.saturating_sub(now)))
        };
        let _ = sys::poll_readable(&[sh.sock_fd, sh.wake.as_raw_fd()], timeout);
        sh.wake.clear();
        sh.lock().sleeping_until = None;
        active_at = Instant::now();
    }
}
