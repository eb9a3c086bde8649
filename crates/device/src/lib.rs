//! softrdma device runtime: the "NIC". Binds a protocol engine ([`Rnic`]) to a UDP driver.
//!
//! - One progress thread per device receives datagram batches, runs the responder and
//!   completer ([`Rnic::handle_datagram`]), fires timers at [`Rnic::poll_timeout`] and
//!   sends what the engine produced.
//! - Posting runs the requester in the caller's thread: [`Device::with`] locks the engine,
//!   runs the caller's closure (post, poll, modify…), then sends what it produced.
//! - Waiting is adaptive: the progress thread spins on non-blocking receives for a short
//!   while after activity, then blocks in `ppoll(2)` on the socket and a wake eventfd with
//!   the next timer deadline as timeout. A cross-core wake-up costs tens of microseconds on
//!   small machines, a busy-polled receive about one, so neither pure blocking nor pure
//!   spinning is acceptable. Busy polling is opt-in ([`DeviceConfig::busy_poll`],
//!   `SOFTRDMA_BUSY_POLL=1`).
//! - Completion channels and async events are real file descriptors (eventfds), readable
//!   while events are pending, so they work with poll/epoll.
//! - Time is nanoseconds since the device opened, from a monotonic clock.
//! - `SOFTRDMA_PCAP=FILE` (or [`DeviceConfig::pcap`]) traces every datagram sent and
//!   received as a pcap file.

#![warn(missing_docs)]

pub mod config;
mod sys;

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io::{self, BufWriter};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use softrdma_net::udp;
pub use softrdma_net::udp::Stats as DriverStats;
use softrdma_transport::verbs::{AsyncEvent, ChannelId, Gid};
pub use softrdma_transport::{verbs, Rnic, Stats as EngineStats, Transmit};
use softrdma_wire::{frame, icrc, pcap::PcapWriter, Addrs};

pub use config::{devices, DeviceAddr, DeviceEntry};
pub use sys::EventFd;

/// The RoCEv2 UDP port.
pub const ROCE_PORT: u16 = 4791;
/// Default spin time of the progress thread after activity, before it blocks.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);
/// Datagrams per receive batch.
const RX_BATCH: usize = 32;
/// Receive buffer size per datagram: a 4096-byte MTU packet with all its headers, with room
/// to spare (GRO stays off: its 64 KiB slots cost more memory than they save here).
const RX_BUF: usize = 9216;
/// Times a full socket send buffer is retried before the rest of a burst is dropped.
const TX_FULL_RETRIES: u32 = 64;

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
}

impl DeviceConfig {
    /// A configuration for `name` at `addr`, with `SOFTRDMA_BUSY_POLL` and `SOFTRDMA_PCAP`
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

/// Everything behind the engine lock.
struct Core {
    rnic: Rnic,
    link: udp::Driver,
    pcap: Option<PcapWriter<BufWriter<File>>>,
    channels: HashMap<ChannelId, Chan>,
    async_q: VecDeque<AsyncEvent>,
    async_signaled: bool,
    stats: LinkStats,
    /// Set while the progress thread blocks: the deadline it sleeps until (u64::MAX: none).
    sleeping_until: Option<u64>,
    txq: Vec<Transmit>,
}

struct Shared {
    name: String,
    addr: SocketAddr,
    start: Instant,
    core: Mutex<Core>,
    wake: EventFd,
    async_fd: EventFd,
    sock_fd: RawFd,
    stop: AtomicBool,
    busy_poll: bool,
    spin: Duration,
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
}

fn wall_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

impl Core {
    /// After every engine step: send what it produced, signal channel and async fds, and
    /// wake the progress thread if the next timer moved earlier than its sleep.
    fn after_step(&mut self, sh: &Shared, now: u64) {
        self.flush_tx(sh.addr, now);
        let ctx = self.rnic.ctx_mut();
        while let Some(ev) = ctx.next_event() {
            self.async_q.push_back(ev);
        }
        let ctx = self.rnic.ctx();
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
        if let (Some(sleep), Some(t)) = (self.sleeping_until, self.rnic.poll_timeout()) {
            if t < sleep {
                self.sleeping_until = None;
                self.stats.wakeups += 1;
                sh.wake.set();
            }
        }
    }

    fn flush_tx(&mut self, local: SocketAddr, now: u64) {
        while let Some(mut t) = self.rnic.poll_transmit(now) {
            // The engine seals for a per-QP source port (as rxe), but the socket sends from
            // its bound port, and the ICRC covers the UDP header the receiver sees: reseal.
            if t.src != local {
                icrc::seal(&Addrs::new(local, t.dst), &mut t.data);
                t.src = local;
            }
            self.txq.push(t);
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
        let out: Vec<udp::OutDatagram<'_>> = self
            .txq
            .iter()
            .map(|t| udp::OutDatagram {
                dst: t.dst,
                tos: t.tos,
                data: &t.data,
            })
            .collect();
        let mut at = 0;
        let mut full = 0;
        while at < out.len() {
            self.stats.tx_batches += 1;
            match self.link.send_batch(&out[at..]) {
                Ok(0) if full < TX_FULL_RETRIES => {
                    // Socket buffer full: the kernel drains it within microseconds.
                    full += 1;
                    std::thread::yield_now();
                }
                Ok(0) => {
                    // Still full: lose the rest as a congested network would; the
                    // transport's retransmissions recover.
                    self.stats.tx_dropped += (out.len() - at) as u64;
                    break;
                }
                Err(_) => {
                    // This datagram is refused (too big, bad address): lost like one the
                    // network drops.
                    self.stats.tx_dropped += 1;
                    at += 1;
                }
                Ok(n) => {
                    for t in &self.txq[at..at + n] {
                        self.stats.tx_datagrams += 1;
                        self.stats.tx_bytes += t.data.len() as u64;
                    }
                    at += n;
                }
            }
        }
        drop(out);
        self.txq.clear();
    }
}

/// An open device: the engine, its socket and its progress thread. Dropping it stops the
/// thread and closes the socket.
pub struct Device {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
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
        let link = match cfg.addr {
            DeviceAddr::Fixed(a) => udp::Driver::bind(a)?,
            DeviceAddr::AutoLoopback(port) => udp::bind_first_free_loopback(port)?,
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
                pcap,
                channels: HashMap::new(),
                async_q: VecDeque::new(),
                async_signaled: false,
                stats: LinkStats::default(),
                sleeping_until: None,
                txq: Vec::new(),
            }),
            wake: EventFd::new()?,
            async_fd: EventFd::new()?,
            sock_fd,
            stop: AtomicBool::new(false),
            busy_poll: cfg.busy_poll,
            spin: cfg.spin,
        });
        let sh = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name(format!("{}-progress", cfg.name))
            .spawn(move || progress(&sh))?;
        Ok(Device {
            shared,
            thread: Some(thread),
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

    /// Run `f` on the engine (with the current device time), then send what it produced and
    /// update the channel and async-event fds. Posting, polling and modifying go through
    /// here, so the requester runs in the caller's thread.
    pub fn with<R>(&self, f: impl FnOnce(&mut Rnic, u64) -> R) -> R {
        let sh = &*self.shared;
        let mut core = sh.lock();
        let now = sh.now();
        let r = f(&mut core.rnic, now);
        core.after_step(sh, now);
        r
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
        core.after_step(sh, now);
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
        core.after_step(sh, now);
        ev
    }

    /// Engine and runtime counters.
    pub fn stats(&self) -> DeviceStats {
        let core = self.shared.lock();
        DeviceStats {
            engine: core.rnic.stats().clone(),
            link: core.stats.clone(),
            driver: core.link.stats(),
        }
    }
}

impl Drop for Device {
    fn drop(&mut self) {
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

/// The progress thread: receive, handle, fire timers, send; spin a while after activity,
/// then block until a datagram, a wake-up or the next timer.
fn progress(sh: &Shared) {
    let mut batch = udp::RecvBatch::new(RX_BATCH, RX_BUF);
    let mut active_at = Instant::now();
    while !sh.stop.load(Ordering::Relaxed) {
        let got = {
            let mut core = sh.lock();
            let now = sh.now();
            let core = &mut *core;
            let n = match core.link.recv_batch(&mut batch) {
                Ok(n) => n,
                Err(_) => {
                    core.stats.rx_errors += 1;
                    0
                }
            };
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
                    core.rnic.handle_datagram(now, d.src, d.dst, d.data);
                }
            }
            if core.rnic.poll_timeout().is_some_and(|t| t <= now) {
                core.rnic.handle_timeout(now);
            }
            core.after_step(sh, now);
            n
        };
        if got > 0 {
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
