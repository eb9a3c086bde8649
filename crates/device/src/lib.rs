//! softrdma device runtime: the "NIC". Binds a protocol engine ([`Rnic`]) to a driver
//! ([`Link`]): the kernel's UDP ([`Device::open`]), or another network such as the `sim`
//! one in tests ([`Device::open_on`]). The second address, per-port send sockets and
//! multicast groups below are the UDP driver's.
//!
//! - Posting runs the requester in the caller's thread: [`Device::post_send`] locks the
//!   engine, posts, then sends what it produced. Every verb a face carries out is an
//!   operation of [`Device`] that ends its engine step as the verb needs (send now or
//!   hold back, wake waiters or not): see `ops`.
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
//!   while events are pending, so they work with poll/epoll. So is the inbox of QP1, the
//!   GSI, where the connection manager's MADs arrive ([`Device::mad_fd`]).
//! - UD multicast is IP multicast: while a QP is attached to a group, the device has a
//!   receive socket bound to the group's address and joined on its interface, polled
//!   beside the device socket ([`Device::attach_mcast`]; `mcast` says why this needs no
//!   setup between processes on one host).
//! - Time is nanoseconds since the device opened, from a monotonic clock.
//! - Idle RC connections check that their peer is alive ([`DeviceConfig::keepalive`],
//!   `SOFTRDMA_KEEPALIVE`): a peer killed without a word is found lost within about a
//!   second on this host, 20 s elsewhere; the QP fails and the connection manager hears
//!   of it ([`Device::take_lost_peer`]) to end the connection, as the peer's DREQ would.
//! - Between two devices of this host (and user, and network namespace), the datagrams go
//!   through shared-memory rings instead of loopback UDP ([`softrdma_net::shm`]): the same
//!   RoCEv2 packets, so every verbs semantic and every trace is the UDP path's. On by
//!   default; `SOFTRDMA_SHM=0` ([`DeviceConfig::shm`], or `shm=off` in the configuration
//!   file) keeps a device on UDP alone. A thread that blocks on the socket first tells the
//!   link ([`softrdma_net::SleepGate`]), so that a peer writes the ring's eventfd only
//!   while nobody polls. The driver counters say which path carried what
//!   (`shm_tx_datagrams`, `shm_rx_datagrams` in the stats file).
//! - `SOFTRDMA_PCAP=FILE` (or [`DeviceConfig::pcap`]) traces every datagram sent and
//!   received as a pcapng file: each packet marked sent or received, and those that went
//!   through a same-host ring commented so.
//! - Every open device publishes its counters for `softrdma stats` to a file ([`statsfile`]);
//!   `SOFTRDMA_STATS=0` (or [`DeviceConfig::stats_dir`] `None`) turns that off.
//!
//! The rooms: [`config`] (device names, addresses, [`DeviceConfig`]); `ops` (the verbs
//! the faces carry out, each ending its engine step as it needs); `runtime` (the state
//! the progress thread and application threads share, and one progress step); `tx` (the
//! send path: per-port sockets, hold-back, GSO); `pacing` (the pure decision of what the
//! progress thread does next, tested on virtual time) and `progress` (the thread that
//! carries it out); `mcast` (the multicast group sockets); `poller` ([`CqPoller`], the
//! CQ poll policy every face uses); `stats` and [`statsfile`] (counters); [`ports`] (the
//! rdma_cm port rules, pure) and [`registry`] (the host's rdma_cm port bindings in files,
//! so that a connecting process finds a listener's device); `sys` (eventfd, poll).

#![warn(missing_docs)]

pub mod config;
mod grants;
pub mod log;
mod mcast;
pub mod netdev;
mod ops;
mod pacing;
mod poller;
pub mod ports;
mod progress;
pub mod registry;
pub mod rundir;
mod runtime;
mod stats;
pub mod statsfile;
mod sys;
mod tx;

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io::{self, BufWriter};
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use softrdma_net::udp;
pub use softrdma_net::udp::Stats as DriverStats;
pub use softrdma_net::Link;
use softrdma_transport::verbs::{AsyncEvent, ChannelId, Gid};
pub use softrdma_transport::{
    verbs, GsiMad, Keepalive, KeepalivePolicy, Rnic, Stats as EngineStats, Transmit,
};
use softrdma_wire::cm::MAD_LEN;
use softrdma_wire::icrc::IpIdCache;
use softrdma_wire::pcapng::PcapngWriter;

pub use config::{devices, DeviceAddr, DeviceConfig, DeviceEntry};
pub use poller::CqPoller;
use runtime::{Chan, Engine, Runtime, Rx};
use stats::stats_of;
pub use stats::{DeviceStats, LinkStats};
pub use sys::{os_seed, poll_readable, random_seed, EventFd};
use tx::Flush;

/// The RoCEv2 UDP port.
pub use softrdma_wire::ROCEV2_UDP_PORT as ROCE_PORT;
/// Default spin time of the progress thread after activity, before it blocks.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);
/// Datagrams per receive batch.
const RX_BATCH: usize = 32;
/// headers, with room to spare.
const RX_BUF: usize = 9216;
/// Receive slots per batch with GRO, each [`udp::GRO_BUF_SIZE`] bytes (1 MiB in all).
const RX_BATCH_GRO: usize = 16;
/// Longest single block of a waiter that shares the wake-up fd with other blocked waiters
/// (one of them may clear it before another sees it).
const SHARED_BLOCK: Duration = Duration::from_millis(1);
/// An application thread's spin in [`Device::wait_for`] gives its core away
/// (`sched_yield`) on one empty turn in this many, not on every one: a wait drives
/// progress itself, so each yield is a system call between two looks at the socket that
/// delays seeing the datagram it waits for (on a ping-pong, 0.5 us of an 8.3 us half
/// round trip with a yield every turn), while a thread that needs the core still gets it
/// within a few microseconds.
const WAIT_YIELD_EVERY: u32 = 8;
/// And at most once in this long: a turn that finds nothing in a same-host ring makes no
/// system call and takes well under a microsecond, so eight turns were a yield every half
/// microsecond, most of the spin spent in `sched_yield`.
const WAIT_YIELD_GAP: Duration = Duration::from_micros(4);

/// A busy-polling wait reads the clock for its timeout on one empty turn in this many: a
/// timeout seen 16 receive calls late is a few microseconds late, and every read is
/// 25-30 ns more between two looks at the socket.
const BUSY_CLOCK_EVERY: u32 = 16;

/// An open device: the engine, its socket and its progress thread. Dropping it stops the
/// thread and closes the socket.
pub struct Device {
    shared: Arc<Runtime>,
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

/// The devices this process opened through [`Device::open_shared`], by name, each with
/// the process that opened it (a forked child opens its own: the parent's progress thread
/// did not survive the fork).
static SHARED: Mutex<Vec<(String, u32, std::sync::Weak<Device>)>> = Mutex::new(Vec::new());

impl Device {
    /// Open the device `cfg` names for this process: the one already open under that
    /// name if there is one, else a new one ([`Device::open`]).
    ///
    /// Opening a device twice in one process gives one device, as `ibv_open_device`
    /// twice on one kernel device gives two contexts of one NIC: the same address and
    /// GIDs, one engine, one progress thread, one stats file, and QPs of both opens reach
    /// each other as QPs of one NIC do. Every face opens devices here, so the C face's
    /// contexts and the Rust face's handles of one name, in one process, are one device.
    /// The configuration of the first open holds while the device lives; once the last
    /// handle is gone, the next open makes a new device (with a new automatic address).
    pub fn open_shared(cfg: &DeviceConfig) -> io::Result<Arc<Device>> {
        let me = std::process::id();
        let mut open = SHARED.lock().unwrap_or_else(|p| p.into_inner());
        open.retain(|(_, pid, w)| *pid == me && w.strong_count() > 0);
        if let Some(d) = open
            .iter()
            .find(|(n, _, _)| *n == cfg.name)
            .and_then(|(_, _, w)| w.upgrade())
        {
            return Ok(d);
        }
        let d = Arc::new(Device::open(cfg)?);
        open.push((cfg.name.clone(), me, Arc::downgrade(&d)));
        Ok(d)
    }

    /// Open a new device: bind its socket, start its progress thread. It is a NIC of its
    /// own whatever else is open under its name: for tests and tools that want exactly
    /// that; the faces open through [`Device::open_shared`].
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
        let addr = link.local_addr();
        let alt = if cfg.dual_stack {
            bind_alt(addr, link.gso_enabled())
        } else {
            None
        };
        // IPv6 multicast leaves from the interface that holds the device's address (an
        // IPv4 socket bound to its address needs no such choice).
        let mc_ifindex = match addr.ip() {
            IpAddr::V6(_) => udp::interface_index(addr.ip()),
            IpAddr::V4(_) => None,
        };
        if let Some(i) = mc_ifindex {
            link.set_multicast_interface(i)?;
        }
        let (link, same_host) = if cfg.shm {
            same_host(link)?
        } else {
            let why = "off (SOFTRDMA_SHM=0, or shm=off in the configuration file)";
            (Box::new(link) as Box<dyn Link>, why.to_string())
        };
        Device::start(cfg, link, alt, mc_ifindex, same_host)
    }

    /// Open a new device on `link`, a driver of the caller's (the `sim` network's
    /// [`softrdma_net::sim::SimLink`] in tests): the runtime, its progress thread and its
    /// waits as on UDP, with one address (no [`DeviceConfig::dual_stack`]).
    /// [`Device::attach_mcast`] still joins groups on the host's network.
    pub fn open_on(cfg: &DeviceConfig, link: Box<dyn Link>) -> io::Result<Device> {
        let same_host = "not a UDP device (a driver of the program's)".to_string();
        Device::start(cfg, link, None, None, same_host)
    }

    /// Start a device on `link` (and `alt`, the second address's send and receive halves
    /// and batch); `mc_ifindex` as [`Engine`]'s.
    fn start(
        cfg: &DeviceConfig,
        link: Box<dyn Link>,
        alt: Option<Halves>,
        mc_ifindex: Option<u32>,
        same_host: String,
    ) -> io::Result<Device> {
        let (rx_link, batch) = receive_half(&*link)?;
        let addr = link.local_addr();
        let pcap = match &cfg.pcap {
            Some(p) => Some(PcapngWriter::new(
                BufWriter::new(File::create(p)?),
                concat!("softrdma ", env!("CARGO_PKG_VERSION")),
                &cfg.name,
            )?),
            None => None,
        };
        let seed = match cfg.seed {
            Some(s) => softrdma_wire::Seed::from_u64(s),
            None => sys::os_seed()?,
        };
        let alt_addr = alt.as_ref().map(|(d, _, _)| d.local_addr());
        let mut rnic = Rnic::with_alt(addr, alt_addr.map(|a| a.ip()), seed);
        // RC windows grow to no more than the socket's buffer holds: a process that may
        // not raise it past rmem_max gets less than the 4 MiB asked for.
        if let Ok(b) = link.recv_buffer_size() {
            rnic.set_rx_buffer(b);
        }
        rnic.set_keepalive(cfg.keepalive);
        // Same-host peers check their one-sided operations against what the engine grants.
        if let Some(shared) = link.grants() {
            rnic.set_grant_sink(Box::new(grants::ShmGrants(shared)));
        }
        if let Some(p) = link.placer() {
            rnic.set_placement(Box::new(grants::ShmPlacement(p)));
        }
        rnic.set_trace_placed(pcap.is_some());
        // The port's active MTU is its link's, as rxe sets it from its netdev's: 4096 on
        // loopback, 1024 on a 1500-byte Ethernet (the engine's 1024 when the interface
        // is not found). It cannot exceed the port's maximum, 4096.
        let link_mtu = netdev::roce_mtu_at(addr.ip());
        if let Some(m) = link_mtu {
            rnic.set_active_mtu(m)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        }
        // A descriptor of the socket to wait on without holding the receive half.
        let sock_fd = link.readable_fd().try_clone_to_owned()?;
        let sleep_gate = link.sleep_gate();
        // The second address's socket is waited on through the same epoll set as the
        // multicast group sockets.
        let mc_poll = mcast::Groups::new_poll()?;
        let (alt_link, alt_rx) = match alt {
            Some((tx, rx, batch)) => {
                rustix::event::epoll::add(
                    &mc_poll,
                    rx.readable_fd(),
                    rustix::event::epoll::EventData::new_u64(0),
                    rustix::event::epoll::EventFlags::IN,
                )?;
                (Some(tx), Some((rx, batch)))
            }
            None => (None, None),
        };
        let shared = Arc::new(Runtime {
            name: cfg.name.clone(),
            same_host,
            addr,
            link_mtu,
            start: Instant::now(),
            start_wall_ns: runtime::wall_ns(),
            alt_addr,
            alt_ready: AtomicBool::new(false),
            alt_until: AtomicU64::new(0),
            alt_steps: AtomicU64::new(0),
            core: Mutex::new(Engine {
                rnic,
                link,
                alt_link,
                ports: HashMap::new(),
                ports_full_logged: false,
                ip_ids: IpIdCache::default(),
                pcap,
                channels: HashMap::new(),
                async_q: VecDeque::new(),
                async_signaled: false,
                mad_signaled: false,
                mc_seen: 0,
                mc_ifindex,
                stats: LinkStats::default(),
                sleeping_until: None,
                txq: Vec::new(),
                via: Vec::new(),
                deferred: Vec::new(),
                deferred_via: Vec::new(),
                held: tx::Held::new(cfg.shm_hold),
            }),
            rx: Mutex::new(Rx {
                link: rx_link,
                batch,
                errors: 0,
                mc_batches: Vec::new(),
                mc_counts: Vec::new(),
                alt: alt_rx,
                last_now: 0,
                quiet_steps: 0,
            }),
            wake: EventFd::new()?,
            notify: EventFd::new()?,
            async_fd: EventFd::new()?,
            mad_fd: EventFd::new()?,
            sock_fd,
            sleep_gate,
            groups: Mutex::new(mcast::Groups::new()),
            has_groups: AtomicBool::new(false),
            mc_poll,
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
            .spawn(move || progress::run(&sh))?;
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
    /// The RoCE MTU of the link the device's address was on when it opened (the port's
    /// first active MTU; see [`netdev::roce_mtu`]), if the interface and its MTU were found.
    pub fn link_mtu(&self) -> Option<softrdma_transport::verbs::Mtu> {
        self.shared.link_mtu
    }
    /// GID index 0: the IPv4-mapped form of the address (or the IPv6 address itself).
    pub fn gid(&self) -> Gid {
        Gid::from_ip(self.shared.addr.ip())
    }
    /// The device's address of the other IP version, GID index 1, if it serves one
    /// ([`DeviceConfig::dual_stack`]).
    pub fn alt_addr(&self) -> Option<SocketAddr> {
        self.shared.alt_addr
    }
    /// Device time: nanoseconds since the device opened.
    pub fn now(&self) -> u64 {
        self.shared.now()
    }
    /// Device time `t` as real time, nanoseconds since the Unix epoch: the real time at
    /// which the device opened plus `t`. The device clock is monotonic; a step of the
    /// system's real-time clock after the open (an NTP correction) is not followed.
    pub fn wallclock_ns(&self, t: u64) -> u64 {
        self.shared.start_wall_ns.saturating_add(t)
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

    /// Send the datagrams held back by earlier posts and polls now. For a caller about to
    /// wait where the device does not see it (arming a CQ, then blocking on its channel's
    /// fd with poll(2)): what it waits for may depend on them.
    pub fn flush(&self) {
        self.shared.flush_deferred();
    }

    /// Run `f` on the engine and nothing else: no send, no fd, no wake-up. For
    /// [`CqPoller`], whose policy is its own, and steps that end themselves.
    pub(crate) fn inspect<R>(&self, f: impl FnOnce(&mut Rnic) -> R) -> R {
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
        // The clock is read only once a look finds nothing: a poll whose completion is
        // there already (most of a stream's) costs no clock_gettime.
        let mut clock: Option<(Instant, Option<Instant>)> = None;
        let mut clock = move || {
            *clock.get_or_insert_with(|| {
                let start = Instant::now();
                (start, timeout.and_then(|t| start.checked_add(t)))
            })
        };
        sh.waiters.fetch_add(1, Ordering::SeqCst);
        struct Leave<'a>(&'a Runtime);
        impl Drop for Leave<'_> {
            fn drop(&mut self) {
                self.0.mark_app_active();
                self.0.waiters.fetch_sub(1, Ordering::SeqCst);
            }
        }
        let _leave = Leave(sh);
        let mut empty_turns = 0u32;
        // When this wait last gave its core away (see WAIT_YIELD_GAP).
        let mut yielded_at: Option<Instant> = None;
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
            let (start, deadline) = clock();
            if sh.busy_poll {
                // It never blocks: the clock only serves the timeout, read on one empty
                // turn in BUSY_CLOCK_EVERY (a turn is a receive call, under a
                // microsecond), not between every two looks at the socket.
                empty_turns = empty_turns.wrapping_add(1);
                if empty_turns % BUSY_CLOCK_EVERY == 0
                    && deadline.is_some_and(|d| Instant::now() >= d)
                {
                    return None;
                }
                progress::spin_pause(true);
                continue;
            }
            let now = Instant::now();
            let left = match deadline {
                Some(d) if now >= d => return None,
                Some(d) => Some(d - now),
                None => None,
            };
            if now.duration_since(start) < sh.spin {
                empty_turns = empty_turns.wrapping_add(1);
                let give = empty_turns % WAIT_YIELD_EVERY == 0
                    && match yielded_at {
                        Some(t) => now.duration_since(t) >= WAIT_YIELD_GAP,
                        None => true,
                    };
                if give {
                    yielded_at = Some(now);
                }
                progress::spin_pause(!give);
                continue;
            }
            // Block, with no ACK held back. Counting ourselves blocked before rereading
            // the generation pairs with `Engine::after_step`: a completion made from now on
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
            if !sh.sleep_begin(true) {
                // Datagrams came into a same-host ring meanwhile: take them.
                sh.blocked.fetch_sub(1, Ordering::SeqCst);
                continue;
            }
            let r = sys::poll_readable(
                &[sh.sock_fd.as_fd(), sh.mc_poll.as_fd(), sh.notify.as_fd()],
                t,
            );
            sh.sleep_end(true);
            if r.is_ok_and(|v| v.get(1).copied().unwrap_or(false)) {
                sh.extra_readable();
            }
            // The fd wakes every blocked waiter: only the last one to leave clears it, or a
            // waiter that blocked earlier (with no others, so with no time limit) would
            // sleep through a completion another waiter was woken for. A waiter that
            // blocked after the last left but before the clear is woken again.
            if sh.blocked.fetch_sub(1, Ordering::SeqCst) == 1 {
                sh.notify.clear();
                if sh.blocked.load(Ordering::SeqCst) > 0 {
                    sh.notify.set();
                }
            }
        }
    }

    /// `ibv_attach_mcast`: attach UD QP `qpn` to the multicast group `mgid` (the rules
    /// and errors are [`Rnic::attach_mcast`]'s; `mlid` is ignored on RoCE). When the group
    /// is new on this device, the device joins it on its interface before returning (see
    /// the crate's `mcast` module for how, and why that needs no setup on one host); if the
    /// kernel refuses (an IPv6 group on an IPv4 device, say), the attachment is undone
    /// and the error returned (EINVAL, or ENOMEM when out of memberships).
    pub fn attach_mcast(&self, qpn: verbs::Qpn, mgid: Gid, mlid: u16) -> verbs::Result<()> {
        let sh = &*self.shared;
        let mut core = sh.lock();
        let was_member = core.rnic.mcast_members(&mgid).contains(&qpn);
        core.rnic.attach_mcast(qpn, mgid, mlid)?;
        core.sync_groups(sh);
        let refused = sh.groups().join_error(mgid);
        let r = match refused {
            Some(e) if !was_member => {
                let _ = core.rnic.detach_mcast(qpn, mgid, mlid);
                Err(e)
            }
            _ => Ok(()),
        };
        let now = sh.now();
        core.after_step(sh, now, false);
        r
    }

    /// `ibv_detach_mcast`: detach UD QP `qpn` from the multicast group `mgid`
    /// ([`Rnic::detach_mcast`]); the device leaves the group with its last QP.
    pub fn detach_mcast(&self, qpn: verbs::Qpn, mgid: Gid, mlid: u16) -> verbs::Result<()> {
        self.step(false, Flush::Due, |rnic, _| {
            rnic.detach_mcast(qpn, mgid, mlid)
        })
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

    /// The async-event fd, borrowed for as long as the device: what a program hands to
    /// an event loop without trusting a raw number to stay open.
    pub fn async_event_borrowed_fd(&self) -> BorrowedFd<'_> {
        self.shared.async_fd.as_fd()
    }

    /// Wait until an async event is pending or `timeout` passes (None: forever); returns
    /// whether one is (a signal may end the wait early, with `false`).
    pub fn wait_async_event(&self, timeout: Option<Duration>) -> io::Result<bool> {
        Ok(poll_readable(&[self.shared.async_fd.as_fd()], timeout)?[0])
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

    /// Send a MAD from QP1, the GSI, to QP `dst_qpn` (1 for a connection manager) at
    /// `dst`, with IP TOS `tos`: how the connection manager talks to its peers. It leaves
    /// at once, as rxe's GSI QP would send it ([`Rnic::send_gsi`]).
    pub fn send_mad(&self, dst: IpAddr, dst_qpn: u32, tos: u8, mad: &[u8; MAD_LEN]) {
        self.step(false, Flush::Due, |rnic, _| {
            rnic.send_gsi(dst, dst_qpn, tos, mad)
        });
    }

    /// Whether a connection manager takes this device's MADs ([`Device::take_mad`]):
    /// the CM agent turns it on when it starts and off when it stops. While it is off,
    /// QP1 answers what needs an answer as a host whose CM has nothing open (a REQ gets
    /// REJ "invalid service ID", a SIDR_REQ "unsupported", a DREQ its DREP: see
    /// [`Rnic::set_gsi_consumer`]), so a peer connecting to a process that does not use
    /// rdma_cm is refused at once rather than after the CM's minute of retries.
    pub fn set_mad_consumer(&self, on: bool) {
        let sh = &*self.shared;
        let mut core = sh.lock();
        core.rnic.set_gsi_consumer(on);
        core.signal_mads(sh);
    }

    /// Take the oldest MAD that arrived on QP1, if any. The inbox holds a bounded number
    /// ([`softrdma_transport::GSI_INBOX_MAX`]); MADs past it are dropped and counted, so
    /// a connection manager should take them as [`Device::mad_fd`] signals them.
    pub fn take_mad(&self) -> Option<GsiMad> {
        let sh = &*self.shared;
        let mut core = sh.lock();
        let mad = core.rnic.take_gsi();
        core.signal_mads(sh);
        mad
    }

    /// Take the oldest QP whose peer the keepalive found lost while a connection manager
    /// takes this device's MADs ([`Rnic::take_lost_peer`]): the QP is in ERR, and the
    /// CM ends the connection it serves. [`Device::mad_fd`] is readable while one waits.
    pub fn take_lost_peer(&self) -> Option<verbs::Qpn> {
        let sh = &*self.shared;
        let mut core = sh.lock();
        let qpn = core.rnic.take_lost_peer();
        core.signal_mads(sh);
        qpn
    }

    /// Raise QP `qpn`'s fatal event (`IBV_EVENT_QP_FATAL`), for a lost peer no
    /// connection of the CM's was found for ([`Rnic::raise_qp_fatal`]).
    pub fn raise_qp_fatal(&self, qpn: verbs::Qpn) {
        self.step(true, Flush::Due, |rnic, _| rnic.raise_qp_fatal(qpn));
    }

    /// An eventfd readable while MADs (or lost-peer notices, [`Device::take_lost_peer`])
    /// wait in the QP1 inbox, for a connection manager thread to block on with poll(2) (the progress thread receives the MADs). Owned by
    /// the device.
    pub fn mad_fd(&self) -> BorrowedFd<'_> {
        self.shared.mad_fd.as_fd()
    }

    /// Wait until a MAD is waiting in the QP1 inbox or `timeout` passes (None: forever);
    /// returns whether one is (a signal may end the wait early, with `false`).
    pub fn wait_mad(&self, timeout: Option<Duration>) -> io::Result<bool> {
        Ok(poll_readable(&[self.shared.mad_fd.as_fd()], timeout)?[0])
    }

    /// Engine and runtime counters.
    pub fn stats(&self) -> DeviceStats {
        stats_of(&self.shared)
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

/// The device's socket with the same-host path beside it ([`softrdma_net::shm`]): its
/// rendezvous socket lives in the `shm` directory of the per-user run directory
/// ([`rundir`]). Without a usable run directory the device is reached by UDP alone (and
/// says why in the log). Returns the link and the path's state, for `softrdma stats`.
fn same_host(link: udp::Driver) -> io::Result<(Box<dyn Link>, String)> {
    let dir = match rundir::RunDir::open_default().and_then(|d| d.subdir("shm")) {
        Ok(d) => d,
        Err(e) => {
            tracing::info!(error = %e, "no same-host path: no run directory");
            return Ok((Box::new(link), format!("off: no run directory ({e})")));
        }
    };
    let host = softrdma_net::shm::HostLink::new(link, dir.as_fd())?;
    Ok((Box::new(host), "on".to_string()))
}

/// The receive half of a device socket (a duplicate descriptor) and its batch.
///
/// GRO: a GSO message from a local peer arrives whole rather than cut into one socket
/// buffer per datagram by the receiving socket, which costs per-datagram work and charges
/// each piece its own overhead against the receive buffer (a UC sender, which never
/// retransmits, overran it that way). The driver splits the buffers again.
fn receive_half(link: &dyn Link) -> io::Result<(Box<dyn Link>, udp::RecvBatch)> {
    let mut rx = link.clone_link()?;
    let batch = if rx.set_gro(true).unwrap_or(false) {
        udp::RecvBatch::new(RX_BATCH_GRO, udp::GRO_BUF_SIZE)
    } else {
        udp::RecvBatch::new(RX_BATCH, RX_BUF)
    };
    Ok((rx, batch))
}

/// Bind the device's second socket, on the interface's address of the other IP version
/// ([`netdev::other_version`]) and the device's port: the send half (GSO as the main
/// socket's), a receive half with GRO where the kernel has it, and its batch. None, with
/// the reason logged, when the interface has no such address or it is taken (another
/// device on this host serves it: the first device to open on `lo` gets `::1`).
type Halves = (Box<dyn Link>, Box<dyn Link>, udp::RecvBatch);

fn bind_alt(addr: SocketAddr, gso: bool) -> Option<Halves> {
    let ip = netdev::other_version(addr.ip())?;
    let at = SocketAddr::new(ip, addr.port());
    let bound = udp::Driver::bind(at).and_then(|mut tx| {
        tx.set_gso(gso);
        let (rx, batch) = receive_half(&tx)?;
        Ok((Box::new(tx) as Box<dyn Link>, rx, batch))
    });
    match bound {
        Ok(b) => Some(b),
        Err(e) => {
            tracing::debug!(%at, error = %e, "no second address: the GID table has one entry");
            None
        }
    }
}
