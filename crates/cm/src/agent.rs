//! The CM agent of a device: the [`Cma`] of one open device, driven by a thread that
//! takes the MADs arriving on the device's QP1 and fires the CM's timers, and event
//! channels that programs wait on — what the kernel's rdma_cm and its `rdma_cm` character
//! device are under librdmacm.
//!
//! Calls run on the caller's thread under the agent's lock ([`Agent::call`]); what they
//! produce (MADs, events) leaves before the call returns, so a REQ is on the wire when
//! `connect` returns. The thread only handles what arrives and what times out, and the
//! peers the device's keepalive found lost ([`Cma::peer_lost`]).
//!
//! Each MAD reaches the CM with the IP address and QP it came from: the CM takes a message
//! for a connection only from that connection's peer ([`crate::ib`]).

use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use rustix::event::EventfdFlags;
use softrdma_device::{poll_readable, Device, EventFd};

use crate::cma::{self, Cma, CmaEvent, IdHandle, McastJoin, Ports, Timeouts};
use crate::ib::Peer;

/// Where a CM delivers events for the ids that name it: a queue and a file descriptor
/// readable while events wait (`rdma_event_channel`'s fd). Each queued event adds one to
/// a semaphore eventfd and each taken event reads one, so the fd can be polled, and a
/// program that leaves it blocking blocks in [`EventChannel::get`] until an event comes.
#[derive(Clone)]
pub struct EventChannel {
    inner: Arc<ChanInner>,
}

struct ChanInner {
    id: u32,
    q: Mutex<VecDeque<CmaEvent>>,
    fd: OwnedFd,
}

static NEXT_CHANNEL: AtomicU32 = AtomicU32::new(1);

impl EventChannel {
    /// A new channel with no ids.
    pub fn new() -> io::Result<EventChannel> {
        let fd = rustix::event::eventfd(0, EventfdFlags::SEMAPHORE | EventfdFlags::CLOEXEC)?;
        Ok(EventChannel {
            inner: Arc::new(ChanInner {
                id: NEXT_CHANNEL.fetch_add(1, Ordering::Relaxed),
                q: Mutex::new(VecDeque::new()),
                fd,
            }),
        })
    }

    /// The channel's number, which ids name ([`Cma::create_id`]).
    pub fn id(&self) -> u32 {
        self.inner.id
    }

    fn queue(&self) -> MutexGuard<'_, VecDeque<CmaEvent>> {
        self.inner.q.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queue an event taken from another channel ([`EventChannel::withdraw_if`]) when
    /// its id moves here.
    pub fn deliver(&self, ev: CmaEvent) {
        self.queue().push_back(ev);
        // A full counter (2^64 - 2 events) cannot happen before memory runs out.
        let _ = rustix::io::write(&self.inner.fd, &1u64.to_ne_bytes());
    }

    /// Take the next event, waiting for one as the fd's blocking mode says: a blocking fd
    /// waits, a non-blocking one gives `WouldBlock`.
    pub fn get(&self) -> io::Result<CmaEvent> {
        loop {
            let mut v = [0u8; 8];
            rustix::io::read(&self.inner.fd, &mut v)?;
            if let Some(ev) = self.queue().pop_front() {
                return Ok(ev);
            }
            // The event was withdrawn (its id destroyed) after it was counted: wait again.
        }
    }

    /// Take the next event, waiting at most `timeout` (None: forever); `Ok(None)` on
    /// timeout.
    pub fn get_timeout(&self, timeout: Option<Duration>) -> io::Result<Option<CmaEvent>> {
        // A look that does not wait and finds the queue empty needs no system call: an
        // event is queued before the fd counts it. rsockets look once per call (a
        // non-blocking rrecv in a loop), and a poll of the fd was half of such a call.
        if timeout == Some(Duration::ZERO) && self.queue().is_empty() {
            return Ok(None);
        }
        let deadline = timeout.map(|t| std::time::Instant::now() + t);
        loop {
            let left = deadline.map(|d| d.saturating_duration_since(std::time::Instant::now()));
            if !poll_readable(&[self.inner.fd.as_fd()], left)?[0] {
                if left.is_some_and(|l| l.is_zero()) {
                    return Ok(None);
                }
                continue;
            }
            let mut v = [0u8; 8];
            match rustix::io::read(&self.inner.fd, &mut v) {
                Ok(_) => {}
                Err(rustix::io::Errno::AGAIN) => continue,
                Err(e) => return Err(e.into()),
            }
            if let Some(ev) = self.queue().pop_front() {
                return Ok(Some(ev));
            }
        }
    }

    /// Drop the queued events of `id` (it is being destroyed), keeping the fd's count
    /// equal to the queue's length.
    pub fn withdraw(&self, id: u32) {
        self.withdraw_if(|e| e.id == id);
    }

    /// Take the queued events `f` selects out of the queue (an id destroyed or moved to
    /// another channel), in order, keeping the fd's count equal to the queue's length.
    pub fn withdraw_if(&self, mut f: impl FnMut(&CmaEvent) -> bool) -> Vec<CmaEvent> {
        let mut q = self.queue();
        let mut out = Vec::new();
        let mut keep = VecDeque::with_capacity(q.len());
        for e in q.drain(..) {
            if f(&e) {
                out.push(e);
            } else {
                keep.push_back(e);
            }
        }
        *q = keep;
        for _ in 0..out.len() {
            if poll_readable(&[self.inner.fd.as_fd()], Some(Duration::ZERO)).is_ok_and(|r| r[0]) {
                let mut v = [0u8; 8];
                let _ = rustix::io::read(&self.inner.fd, &mut v);
            }
        }
        out
    }

    /// Drop the queued MULTICAST_JOIN event of `id` that answers `join` (the join was
    /// left before the program took it, as ucma's `ucma_cleanup_mc_events`), keeping the
    /// fd's count equal to the queue's length. Returns whether there was one.
    pub fn withdraw_multicast(&self, id: u32, join: &McastJoin) -> bool {
        let mut q = self.queue();
        let Some(at) = q
            .iter()
            .position(|e| e.id == id && e.mc.as_ref() == Some(join))
        else {
            return false;
        };
        q.remove(at);
        if poll_readable(&[self.inner.fd.as_fd()], Some(Duration::ZERO)).is_ok_and(|r| r[0]) {
            let mut v = [0u8; 8];
            let _ = rustix::io::read(&self.inner.fd, &mut v);
        }
        true
    }

    /// Events waiting.
    pub fn pending(&self) -> usize {
        self.queue().len()
    }
}

impl AsFd for EventChannel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.inner.fd.as_fd()
    }
}

impl AsRawFd for EventChannel {
    fn as_raw_fd(&self) -> RawFd {
        self.inner.fd.as_raw_fd()
    }
}

impl std::fmt::Debug for EventChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventChannel")
            .field("id", &self.inner.id)
            .finish()
    }
}

struct Shared {
    dev: Arc<Device>,
    /// The process that started the agent: a child forked from it holds a copy of the
    /// agent but not its thread.
    pid: u32,
    cma: Mutex<Cma>,
    channels: Mutex<HashMap<u32, Weak<ChanInner>>>,
    wake: EventFd,
    /// The CM timer the thread sleeps towards (device time; `u64::MAX`: none), written
    /// under the CM's lock before it sleeps: a call wakes it only for an earlier timer.
    /// Waking it for every call cost a context switch per call, on the caller's core
    /// when the two share one (cmtime's 100 connections: 500 calls, 500 switches).
    sleeps_until: AtomicU64,
    stop: AtomicBool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Cma> {
        self.cma.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Send what the CM produced and hand its events to their channels.
    fn pump(&self, cma: &mut Cma) {
        while let Some((to, mad)) = cma.poll_transmit() {
            self.dev.send_mad(to.ip, to.qpn, 0, &mad);
        }
        let chans = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        while let Some(ev) = cma.poll_event() {
            match chans.get(&ev.channel).and_then(Weak::upgrade) {
                Some(inner) => EventChannel { inner }.deliver(ev),
                None => {
                    tracing::debug!(channel = ev.channel, event = ?ev.event, "CM event for a closed channel dropped")
                }
            }
        }
    }
}

/// The agents [`Agent::for_device`] started, by device.
static AGENTS: Mutex<Vec<Running>> = Mutex::new(Vec::new());

/// An agent [`Agent::for_device`] started: its device (by address) and process.
struct Running {
    dev: usize,
    pid: u32,
    agent: Weak<Agent>,
}

/// A device's CM with its thread. Dropping it stops the thread.
pub struct Agent {
    sh: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("device", &self.sh.dev.addr())
            .finish()
    }
}

impl Agent {
    /// Start the CM of `dev`, reserving ports in `ports`, with randomness from `seed`.
    pub fn start(
        dev: Arc<Device>,
        ports: Box<dyn Ports>,
        seed: impl Into<softrdma_wire::Seed>,
    ) -> io::Result<Agent> {
        let addr = dev.addr();
        // The node GUID of a RoCE device is derived from its MAC; ours from its address.
        let guid = match addr.ip() {
            std::net::IpAddr::V4(v4) => {
                0x0002_c9ff_fe00_0000 | u64::from(u32::from(v4)) & 0xFF_FFFF
            }
            std::net::IpAddr::V6(v6) => {
                u64::from_be_bytes(v6.octets()[8..].try_into().unwrap_or([0; 8]))
            }
        };
        let mut cma = Cma::new(addr, guid, seed, ports);
        // Routes get the MTU of the interface the device's address is on (read when the
        // device opened), as Linux's rdma_cm gives a RoCE route its netdev's (4096 on
        // loopback, 1024 on a 1500-byte Ethernet); 1024 when it was not found.
        if let Some(m) = dev.link_mtu() {
            cma.set_path_mtu(m);
        }
        let sh = Arc::new(Shared {
            cma: Mutex::new(cma),
            dev,
            channels: Mutex::new(HashMap::new()),
            wake: EventFd::new()?,
            sleeps_until: AtomicU64::new(u64::MAX),
            stop: AtomicBool::new(false),
            pid: std::process::id(),
        });
        sh.dev.set_mad_consumer(true);
        let t = Arc::clone(&sh);
        let thread = std::thread::Builder::new()
            .name(format!("{}-cm", sh.dev.name()))
            .spawn(move || run(&t))?;
        Ok(Agent {
            sh,
            thread: Some(thread),
        })
    }

    /// The CM of `dev`, one per device in a process whichever face asks: the running
    /// one, or one started now over the host's port registry, with the timeouts of
    /// [`timeouts_from_env`]. Every face gets its CM here, so a device has one CM with
    /// one policy.
    pub fn for_device(dev: &Arc<Device>) -> io::Result<Arc<Agent>> {
        let mut all = AGENTS.lock().unwrap_or_else(|p| p.into_inner());
        all.retain(|e| e.agent.strong_count() > 0);
        let key = Arc::as_ptr(dev) as usize;
        let pid = std::process::id();
        // Only this device's entry is upgraded: an Arc of another upgraded here could be
        // its last and drop it under this lock, which its drop takes.
        let found = all
            .iter()
            .filter(|e| e.dev == key && e.pid == pid)
            .find_map(|e| e.agent.upgrade());
        if let Some(a) = found {
            return Ok(a);
        }
        let reg = softrdma_device::registry::Registry::open_default()
            .map_err(|e| io::Error::new(e.kind(), format!("the rdma_cm port registry: {e}")))?;
        let ports = crate::host::HostPorts::new(reg, dev.addr().port());
        let a = Agent::start(
            Arc::clone(dev),
            Box::new(ports),
            softrdma_device::os_seed()?,
        )?;
        let t = timeouts_from_env();
        a.call(|c, _| c.set_timeouts(t));
        let a = Arc::new(a);
        all.push(Running {
            dev: key,
            pid,
            agent: Arc::downgrade(&a),
        });
        Ok(a)
    }

    /// The device.
    pub fn device(&self) -> &Arc<Device> {
        &self.sh.dev
    }

    /// Let `ch` receive the events of ids that name it.
    pub fn attach(&self, ch: &EventChannel) {
        let mut chans = self.sh.channels.lock().unwrap_or_else(|p| p.into_inner());
        chans.retain(|_, w| w.strong_count() > 0);
        chans.insert(ch.id(), Arc::downgrade(&ch.inner));
    }

    /// Run `f` on the CM with the device's time; what it produced is sent and delivered
    /// before this returns.
    pub fn call<R>(&self, f: impl FnOnce(&mut Cma, u64) -> R) -> R {
        let mut cma = self.sh.lock();
        let now = self.sh.dev.now();
        let r = f(&mut cma, now);
        self.sh.pump(&mut cma);
        // A new timer may be earlier than the one the thread sleeps towards.
        let earlier = cma
            .poll_timeout()
            .is_some_and(|t| t < self.sh.sleeps_until.load(Ordering::SeqCst));
        drop(cma);
        if earlier {
            self.sh.wake.set();
        }
        r
    }
}

impl Agent {
    /// [`Cma::leave_multicast`], and the join's MULTICAST_JOIN event goes from its
    /// channel too if the program has not taken it (the agent delivers events as they
    /// happen, so it is there rather than in the CM's queue). Returns the join left.
    pub fn leave_multicast(
        &self,
        id: IdHandle,
        addr: std::net::SocketAddr,
    ) -> cma::Result<McastJoin> {
        let join = self.call(|c, _| c.leave_multicast(id, addr))?;
        let chans: Vec<Arc<ChanInner>> = {
            let chans = self.sh.channels.lock().unwrap_or_else(|p| p.into_inner());
            chans.values().filter_map(Weak::upgrade).collect()
        };
        for inner in chans {
            if (EventChannel { inner }).withdraw_multicast(id, &join) {
                break;
            }
        }
        Ok(join)
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if self.sh.pid != std::process::id() {
            // Inherited by fork: the thread is not in this process, and joining it would
            // wait forever. The parent's agent is left as it is.
            if let Some(t) = self.thread.take() {
                std::mem::forget(t);
            }
            return;
        }
        self.sh.stop.store(true, Ordering::SeqCst);
        self.sh.wake.set();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // The device's next agent may have started while this one went (its last
        // reference gone, for_device starts another): the MADs are that one's now.
        let all = AGENTS.lock().unwrap_or_else(|p| p.into_inner());
        let key = Arc::as_ptr(&self.sh.dev) as usize;
        let next = all
            .iter()
            .any(|e| e.dev == key && e.pid == self.sh.pid && e.agent.strong_count() > 0);
        if !next {
            self.sh.dev.set_mad_consumer(false);
        }
    }
}

/// The CM timeouts a device's CM starts with: the defaults (Linux's), changed by
/// `SOFTRDMA_CM_RETRIES` (0-15, how often a REQ, REP or DREQ is sent again; Linux: 15)
/// and `SOFTRDMA_CM_RESPONSE_TIMEOUT` (8-31, the IBTA exponent of the wait for an
/// answer, 4.096 µs × 2^t; Linux: 20), so that a program or test can learn that a peer
/// is unreachable in well under Linux's minute. A value out of range is reported on
/// stderr and ignored.
pub fn timeouts_from_env() -> Timeouts {
    let mut t = Timeouts::default();
    let read = |name: &str, lo: u8, hi: u8| -> Option<u8> {
        let v = std::env::var(name).ok()?;
        match v.trim().parse::<u8>() {
            Ok(n) if (lo..=hi).contains(&n) => Some(n),
            _ => {
                eprintln!("softrdma: {name}={v:?} is not in {lo}..={hi}; ignored");
                None
            }
        }
    };
    if let Some(r) = read("SOFTRDMA_CM_RETRIES", 0, 15) {
        t.max_retries = r;
    }
    if let Some(r) = read("SOFTRDMA_CM_RESPONSE_TIMEOUT", 8, 31) {
        t.cm_response = r;
    }
    t
}

/// The agent's thread: wait for a MAD, a wake-up or the next CM timer; handle it.
fn run(sh: &Shared) {
    while !sh.stop.load(Ordering::SeqCst) {
        let next = {
            let cma = sh.lock();
            let next = cma.poll_timeout();
            sh.sleeps_until
                .store(next.unwrap_or(u64::MAX), Ordering::SeqCst);
            next
        };
        let now = sh.dev.now();
        let timeout = next.map(|t| Duration::from_nanos(t.saturating_sub(now)));
        let _ = poll_readable(&[sh.dev.mad_fd(), sh.wake.as_fd()], timeout);
        sh.wake.clear();
        let mut cma = sh.lock();
        while let Some(m) = sh.dev.take_mad() {
            let now = sh.dev.now();
            let from = Peer {
                ip: m.src,
                qpn: m.src_qpn,
            };
            cma.handle_mad(now, from, &m.mad);
        }
        // Peers the device's keepalive found lost: their connections end as if the
        // peer had disconnected; a QP no connection uses gets its fatal event instead.
        while let Some(qpn) = sh.dev.take_lost_peer() {
            if !cma.peer_lost(sh.dev.now(), qpn) {
                sh.dev.raise_qp_fatal(qpn);
            }
        }
        let now = sh.dev.now();
        if cma.poll_timeout().is_some_and(|t| t <= now) {
            cma.handle_timeout(now);
        }
        sh.pump(&mut cma);
    }
}
