//! [`HostLink`]: UDP plus the shared-memory rings to the devices of this host, and the
//! rendezvous thread that sets the rings up and tears them down (see the module docs of
//! [`crate::shm`]).

use std::collections::HashMap;
use std::io;
use std::mem;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::grants::{Grants, PeerGrants};
use super::ring::{self, Consumer, Producer, PushError};
use crate::link::{PeerPath, SleepGate};
use crate::udp::{Driver, OutDatagram, RecvBatch, Stats};
use crate::Link;
use softrdma_wire::idhash::IdMap;

/// How long a destination of this host with no rendezvous socket (or a stale one) is
/// sent to by UDP before we look for its socket again: a look costs a `statat` or a
/// refused `connect`, and a restarted peer gets its ring this soon.
const RETRY_AFTER: Duration = Duration::from_millis(100);
/// How long a peer that took a ring and dropped it without an answer (it refuses rings:
/// another user's, an older version) is sent to by UDP before we offer one again.
const REFUSED_RETRY: Duration = Duration::from_secs(5);
/// Why a peer that took our ring and dropped it unanswered is reached by UDP.
const REFUSED: &str = "the device there refused a ring (another version, or its limit)";
/// While rings are connected and the UDP socket has been quiet, a receive reads the
/// socket only every this many calls (and always after a sleep, and whenever no ring is
/// connected): a busy-polling thread then makes almost no system call between the looks
/// at its rings, and a datagram waits a few microseconds at most.
const UDP_EVERY: u32 = 1024;
/// After the UDP socket gave a datagram, it is read on every call for this many calls
/// (peers reached by UDP and by rings at once keep UDP's latency).
const UDP_HOT_CALLS: u32 = 4096;
/// First bytes of the message that passes a ring.
const HELLO_MAGIC: [u8; 8] = *b"SRSHMv1\0";
const HELLO_LEN: usize = 40;
/// Incoming connections that have not passed their ring yet, at most.
const PENDING_MAX: usize = 64;

/// epoll tokens of the rendezvous thread.
const TOK_STOP: u64 = 0;
const TOK_LISTEN: u64 = 1;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// The canonical form of a destination: IPv4-mapped IPv6 as IPv4.
fn canonical(a: SocketAddr) -> SocketAddr {
    match a {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), v6.port()),
            None => a,
        },
        a => a,
    }
}

/// The network namespace's inode: devices of two namespaces may have the same address,
/// and share a run directory. The calling thread's (a thread may have a namespace of its
/// own; the device's socket was made by the thread that opens it).
fn netns_id() -> u64 {
    std::fs::metadata("/proc/thread-self/ns/net")
        .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
        .unwrap_or(0)
}

/// The rendezvous socket name of the device at `addr`.
fn sock_name(netns: u64, addr: SocketAddr) -> String {
    format!("shm-{netns}-{}-{}", addr.ip(), addr.port())
}

/// `name` in the directory `dir`, as a Unix socket address: bind(2) and connect(2) have
/// no `*at` forms, so the directory is reached through its descriptor's `/proc` link,
/// which names the checked directory whatever happened to its path since.
fn unix_addr(dir: BorrowedFd<'_>, name: &str) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    let path = format!("/proc/self/fd/{}/{}", dir.as_raw_fd(), name);
    // SAFETY: sockaddr_un is plain integers; all-zero is valid.
    let mut sa: libc::sockaddr_un = unsafe { mem::zeroed() };
    sa.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let b = path.as_bytes();
    if b.len() >= sa.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "socket path too long",
        ));
    }
    for (d, s) in sa.sun_path.iter_mut().zip(b) {
        *d = *s as libc::c_char;
    }
    let len = mem::size_of::<libc::sa_family_t>() + b.len() + 1;
    Ok((sa, len as libc::socklen_t))
}

fn unix_socket() -> io::Result<OwnedFd> {
    // SAFETY: plain call; the descriptor is ours on success.
    let fd = cvt(unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    })?;
    // SAFETY: just made, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The uid of the process at the other end of the Unix socket `fd`.
fn peer_uid(fd: BorrowedFd<'_>) -> io::Result<u32> {
    peer_cred(fd).map(|c| c.uid)
}

/// The peer's credentials, its PID as our PID namespace sees it (0: another one).
fn peer_cred(fd: BorrowedFd<'_>) -> io::Result<libc::ucred> {
    // SAFETY: ucred is plain integers.
    let mut cred: libc::ucred = unsafe { mem::zeroed() };
    let mut len = mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for the kernel to write, `len` its size.
    cvt(unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    })?;
    Ok(cred)
}

fn my_uid() -> u32 {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() }
}

fn new_eventfd() -> io::Result<OwnedFd> {
    Ok(rustix::event::eventfd(
        0,
        rustix::event::EventfdFlags::NONBLOCK | rustix::event::EventfdFlags::CLOEXEC,
    )?)
}

/// Whether `fd` is a non-blocking eventfd: what we write to wake a peer must never block
/// us (a peer could pass a pipe nobody reads).
fn is_eventfd(fd: &OwnedFd) -> bool {
    let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()));
    // SAFETY: F_GETFL on a descriptor we own.
    let fl = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    link.is_ok_and(|l| l.as_os_str() == "anon_inode:[eventfd]")
        && fl >= 0
        && fl & libc::O_NONBLOCK != 0
}

fn eventfd_write(fd: BorrowedFd<'_>) {
    // EAGAIN (counter saturated) leaves it readable, which is the point.
    let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
}

fn eventfd_clear(fd: BorrowedFd<'_>) {
    let mut v = [0u8; 8];
    let _ = rustix::io::read(fd, &mut v);
}

/// Room for the control message of up to two descriptors.
#[repr(C, align(8))]
struct FdCmsg([u8; 64]);

/// Send one message with `payload` and the descriptors `fds` (at most two).
fn send_with_fds(sock: BorrowedFd<'_>, payload: &[u8], fds: &[RawFd]) -> io::Result<()> {
    let mut ctrl = FdCmsg([0; 64]);
    let data_len = mem::size_of_val(fds);
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE(data_len as u32) } as usize;
    if fds.len() > 2 || space > ctrl.0.len() {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    let mut iov = libc::iovec {
        iov_base: payload.as_ptr() as *mut libc::c_void,
        iov_len: payload.len(),
    };
    // SAFETY: msghdr is plain integers and pointers; all-zero is valid.
    let mut msg: libc::msghdr = unsafe { mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = ctrl.0.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: `msg` points at `ctrl`, which has room for one header with `data_len`
        // bytes of data (checked above), so CMSG_FIRSTHDR is non-null and the writes stay
        // inside `ctrl`.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(data_len as u32) as _;
            std::ptr::copy_nonoverlapping(fds.as_ptr().cast::<u8>(), libc::CMSG_DATA(c), data_len);
        }
    }
    // SAFETY: `msg` points at `iov` (our payload, only read) and `ctrl`, both alive.
    let n = unsafe {
        libc::sendmsg(
            sock.as_raw_fd(),
            &msg,
            libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n as usize != payload.len() {
        return Err(io::Error::from(io::ErrorKind::WriteZero));
    }
    Ok(())
}

/// Receive one message into `buf`: its length (0 at end of stream) and the descriptors
/// that came with it (every one received is owned, so none leaks, however many a peer
/// sent).
fn recv_with_fds(sock: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut ctrl = FdCmsg([0; 64]);
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: as in `send_with_fds`.
    let mut msg: libc::msghdr = unsafe { mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = ctrl.0.as_mut_ptr().cast();
    msg.msg_controllen = ctrl.0.len() as _;
    // SAFETY: `msg` points at `buf` and `ctrl`, alive and writable, with their sizes.
    let n = unsafe {
        libc::recvmsg(
            sock.as_raw_fd(),
            &mut msg,
            libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: the kernel filled `msg_controllen` bytes of `ctrl`; the CMSG macros stay
    // within it, and each descriptor is read unaligned from inside its message's data.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c);
                let dlen = ((*c).cmsg_len as usize).saturating_sub(data as usize - c as usize);
                for k in 0..dlen / mem::size_of::<RawFd>() {
                    let fd = std::ptr::read_unaligned(data.cast::<RawFd>().add(k));
                    if fd >= 0 {
                        fds.push(OwnedFd::from_raw_fd(fd));
                    }
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "message cut short",
        ));
    }
    Ok((n as usize, fds))
}

fn epoll_new() -> io::Result<OwnedFd> {
    // SAFETY: plain call; the descriptor is ours on success.
    let fd = cvt(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) })?;
    // SAFETY: just made.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn epoll_add(ep: BorrowedFd<'_>, fd: BorrowedFd<'_>, token: u64) -> io::Result<()> {
    let mut ev = libc::epoll_event {
        events: (libc::EPOLLIN | libc::EPOLLRDHUP) as u32,
        u64: token,
    };
    // SAFETY: valid descriptors and an event struct alive for the call.
    cvt(unsafe { libc::epoll_ctl(ep.as_raw_fd(), libc::EPOLL_CTL_ADD, fd.as_raw_fd(), &mut ev) })
        .map(|_| ())
}

fn epoll_del(ep: BorrowedFd<'_>, fd: BorrowedFd<'_>) {
    // SAFETY: as above; a null event is allowed for DEL.
    unsafe {
        libc::epoll_ctl(
            ep.as_raw_fd(),
            libc::EPOLL_CTL_DEL,
            fd.as_raw_fd(),
            std::ptr::null_mut(),
        );
    }
}

/// The message that passes a ring: magic, the sender's device address, the ring's shape.
fn hello(from: SocketAddr) -> [u8; HELLO_LEN] {
    let mut m = [0u8; HELLO_LEN];
    m[..8].copy_from_slice(&HELLO_MAGIC);
    let ip = match from.ip() {
        IpAddr::V4(a) => {
            m[8] = 4;
            a.to_ipv6_mapped().octets()
        }
        IpAddr::V6(a) => {
            m[8] = 6;
            a.octets()
        }
    };
    m[12..28].copy_from_slice(&ip);
    m[28..30].copy_from_slice(&from.port().to_le_bytes());
    m[32..36].copy_from_slice(&ring::SLOTS.to_le_bytes());
    m[36..40].copy_from_slice(&(ring::SLOT_SIZE as u32).to_le_bytes());
    m
}

/// Length of the answer to a hello: `ok`, then where this process's cookie is and what
/// it holds (see `cma`), so that the peer can probe cross-memory attach to us.
/// Then the slot of our grants the peer may hold regions in (255: none; the grants'
/// memfd comes with the answer when there is one).
const ANSWER_LEN: usize = 19;
const NO_SLOT: u8 = 255;

fn answer(slot: Option<usize>) -> [u8; ANSWER_LEN] {
    let (addr, value) = super::cma::cookie();
    let mut m = [0u8; ANSWER_LEN];
    m[..2].copy_from_slice(b"ok");
    m[2..10].copy_from_slice(&addr.to_le_bytes());
    m[10..18].copy_from_slice(&value.to_le_bytes());
    m[18] = slot.and_then(|s| u8::try_from(s).ok()).unwrap_or(NO_SLOT);
    m
}

/// The cookie's address and value and the grants slot from an answer, if it is one.
fn parse_answer(m: &[u8]) -> Option<(u64, u64, Option<usize>)> {
    if m.len() != ANSWER_LEN || &m[..2] != b"ok" {
        return None;
    }
    let word = |at: usize| u64::from_le_bytes(m[at..at + 8].try_into().unwrap_or([0; 8]));
    let slot = (m[18] != NO_SLOT).then_some(usize::from(m[18]));
    Some((word(2), word(10), slot))
}

/// The sender's device address from a hello, if it is one of ours in every other field.
fn parse_hello(m: &[u8]) -> Option<SocketAddr> {
    if m.len() != HELLO_LEN || m[..8] != HELLO_MAGIC {
        return None;
    }
    let word = |at: usize| u32::from_le_bytes([m[at], m[at + 1], m[at + 2], m[at + 3]]);
    if word(32) != ring::SLOTS || word(36) != ring::SLOT_SIZE as u32 {
        return None;
    }
    let mut ip = [0u8; 16];
    ip.copy_from_slice(&m[12..28]);
    let ip6 = std::net::Ipv6Addr::from(ip);
    let ip = match m[8] {
        4 => IpAddr::V4(ip6.to_ipv4_mapped()?),
        6 => IpAddr::V6(ip6),
        _ => return None,
    };
    let port = u16::from_le_bytes([m[28], m[29]]);
    (port != 0).then_some(SocketAddr::new(ip, port))
}

/// A ring we write, to one peer device.
#[derive(Debug)]
struct OutRing {
    prod: Mutex<Producer>,
    /// The connection the ring was passed over; closing it tells the peer to drop it.
    conn: OwnedFd,
    /// The peer's wake-up eventfd, from its answer.
    wake: OnceLock<OwnedFd>,
    /// The connection ended (the peer is gone): stop using the ring.
    dead: AtomicBool,
    /// Whether we can copy into and out of the peer's process (set with its answer), and
    /// its PID.
    cma: OnceLock<Result<i32, String>>,
    /// The peer's grants (see `grants`), with the slot it gave us, from its answer.
    grants: OnceLock<Mutex<PeerGrants>>,
}

impl OutRing {
    fn wake(&self) {
        if let Some(w) = self.wake.get() {
            eventfd_write(w.as_fd());
        }
    }
}

/// How datagrams to one destination go.
#[derive(Debug)]
enum Route {
    /// Not a device of this host: UDP, for good.
    Remote,
    /// A device of this host without a usable rendezvous socket: UDP until then, and why.
    Udp(Instant, String),
    Ring(Arc<OutRing>),
}

/// A ring a peer writes to us.
#[derive(Debug)]
struct InRing {
    /// The peer's device address: its datagrams' source address.
    peer: SocketAddr,
    cons: Mutex<Consumer>,
    /// Our wake-up eventfd, in the device's epoll set; the peer writes it.
    wake: OwnedFd,
    /// The connection the ring came over; dropping it tells the peer.
    _conn: OwnedFd,
    /// The connection ended or a newer ring from the same peer replaced this one:
    /// drain it and drop it.
    closed: AtomicBool,
    /// The slot of our grants this peer holds regions in, released with the ring.
    slot: Option<(usize, Arc<Mutex<Grants>>)>,
}

impl Drop for InRing {
    fn drop(&mut self) {
        if let Some((s, g)) = &self.slot {
            lock(g).release_slot(*s);
        }
    }
}

/// What the rendezvous thread watches, by epoll token.
#[derive(Debug)]
enum Conn {
    /// Accepted, its ring not passed yet.
    Pending(OwnedFd),
    /// A peer's ring to us.
    In(Weak<InRing>),
    /// Our ring to a peer.
    Out(Weak<OutRing>),
}

/// The rings of the device, shared by its link handles and the rendezvous thread.
#[derive(Debug)]
struct Inner {
    /// The device's address.
    local: SocketAddr,
    netns: u64,
    dir: OwnedFd,
    /// The addresses of this host (loopback aside): a destination at one is a device of
    /// this host if it has a rendezvous socket.
    host_ips: Vec<IpAddr>,
    /// The device's readable set: the UDP socket and every incoming ring's eventfd.
    epoll: OwnedFd,
    /// The rendezvous thread's set: stop, listener, connections.
    ctl_epoll: OwnedFd,
    stop: OwnedFd,
    conns: Mutex<HashMap<u64, Conn>>,
    next_token: AtomicU64,
    routes: Mutex<IdMap<SocketAddr, Route>>,
    rings_in: Mutex<InRings>,
    /// Bumped whenever `rings_in` changes, so receive handles refresh their copy.
    rings_gen: AtomicU64,
    /// A waiter slept: the next receive reads the UDP socket too.
    udp_due: AtomicBool,
    /// What this device lets its peers copy into and out of (None: the table could not
    /// be made, and peers copy through the rings only).
    grants: Option<Arc<Mutex<Grants>>>,
}

#[derive(Debug, Default)]
struct InRings {
    rings: Vec<Arc<InRing>>,
    /// Threads blocked on the device's readable set (see [`SleepGate`]): while any is,
    /// every ring's consumer is marked asleep.
    sleepers: usize,
    /// Of those, the ones to be woken for nudges too (their memory changed).
    nudge_sleepers: usize,
}

impl InRings {
    /// What a ring's `asleep` word says while the sleepers are as counted.
    fn asleep_bits(&self) -> u32 {
        if self.nudge_sleepers > 0 {
            ring::ASLEEP_NUDGE
        } else {
            0
        }
    }
}

/// The listener and what owns the rendezvous thread: dropped with the last link handle.
#[derive(Debug)]
struct Host {
    inner: Arc<Inner>,
    listener: Option<Listener>,
    thread: Option<JoinHandle<()>>,
}

#[derive(Debug)]
struct Listener {
    name: String,
    /// Device and inode of the socket file we bound, so only ours is removed.
    id: (u64, u64),
}

impl Drop for Host {
    fn drop(&mut self) {
        eventfd_write(self.inner.stop.as_fd());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if let Some(l) = &self.listener {
            let dir = self.inner.dir.as_fd();
            if rustix::fs::statat(dir, l.name.as_str(), rustix::fs::AtFlags::SYMLINK_NOFOLLOW)
                .is_ok_and(|st| (st.st_dev, st.st_ino) == l.id)
            {
                let _ = rustix::fs::unlinkat(dir, l.name.as_str(), rustix::fs::AtFlags::empty());
            }
        }
    }
}

/// A [`Link`] that sends to the devices of this host through shared-memory rings and to
/// everything else by UDP (see [`crate::shm`]). Counters: [`Stats::shm_sent_datagrams`]
/// and [`Stats::shm_recv_datagrams`] count the rings' datagrams, the others UDP's.
#[derive(Debug)]
pub struct HostLink {
    udp: Driver,
    host: Arc<Host>,
    /// Whether this handle's datagrams may take a ring: its source address is the
    /// device's (the rings carry the device's address as source).
    rings_ok: bool,
    /// This handle's copy of the incoming rings, and the generation it was taken at.
    rings: Vec<Arc<InRing>>,
    rings_gen: u64,
    next_ring: usize,
    calls: u32,
    /// Calls left during which the UDP socket is read every time ([`UDP_HOT_CALLS`]).
    udp_hot: u32,
    stats: Stats,
    /// A ring's producer nudged since the last [`Link::take_nudged`].
    nudged: bool,
}

impl HostLink {
    /// The device at `udp`'s address, with its rendezvous socket in the run directory
    /// `dir` (a descriptor of it, checked by the caller as decision 13 says). A stale
    /// socket of that name (its device is gone) is replaced; one whose device still
    /// answers is left alone, and this device then sends through rings but receives by
    /// UDP alone.
    pub fn new(udp: Driver, dir: BorrowedFd<'_>) -> io::Result<HostLink> {
        let local = canonical(udp.local_addr());
        let inner = Arc::new(Inner::new(local, dir)?);
        epoll_add(inner.epoll.as_fd(), udp.as_fd(), 0)?;
        let (listen_fd, listener) = match listen(&inner) {
            Ok((fd, l)) => (Some(fd), Some(l)),
            Err(e) => {
                tracing::debug!(addr = %local, error = %e, "no same-host rendezvous socket: peers reach this device by UDP");
                (None, None)
            }
        };
        if let Some(fd) = &listen_fd {
            epoll_add(inner.ctl_epoll.as_fd(), fd.as_fd(), TOK_LISTEN)?;
        }
        let t_inner = Arc::clone(&inner);
        let thread = std::thread::Builder::new()
            .name("softrdma-shm".into())
            .spawn(move || rendezvous(&t_inner, listen_fd))?;
        let host = Arc::new(Host {
            inner,
            listener,
            thread: Some(thread),
        });
        Ok(HostLink::handle(udp, host, true))
    }

    fn handle(udp: Driver, host: Arc<Host>, rings_ok: bool) -> HostLink {
        HostLink {
            udp,
            host,
            rings_ok,
            rings: Vec::new(),
            rings_gen: u64::MAX,
            next_ring: 0,
            calls: 0,
            udp_hot: 0,
            nudged: false,
            stats: Stats::default(),
        }
    }

    /// The UDP driver under the link.
    pub fn udp(&mut self) -> &mut Driver {
        &mut self.udp
    }

    /// Connected rings: to peers (that we write) and from peers (that we read).
    pub fn ring_count(&self) -> (usize, usize) {
        let inner = &self.host.inner;
        let out = lock(&inner.routes)
            .values()
            .filter(|r| matches!(r, Route::Ring(o) if !o.dead.load(Ordering::Acquire)))
            .count();
        let inn = lock(&inner.rings_in).rings.len();
        (out, inn)
    }

    fn send_rings(&mut self, pkts: &[OutDatagram<'_>]) -> io::Result<usize> {
        let inner = Arc::clone(&self.host.inner);
        let mut routes = lock(&inner.routes);
        let mut done = 0;
        let src_port = self.udp.local_addr().port();
        while done < pkts.len() {
            let dst = canonical(pkts[done].dst);
            match route(&inner, &mut routes, dst) {
                Some(ring) => {
                    let mut prod = lock(&ring.prod);
                    let mut k = done;
                    let mut too_big = false;
                    while k < pkts.len() && canonical(pkts[k].dst) == dst {
                        match prod.push(src_port, pkts[k].tos, pkts[k].data) {
                            Ok(()) => k += 1,
                            Err(PushError::Full) => {
                                self.stats.shm_full += 1;
                                break;
                            }
                            Err(PushError::TooBig) => {
                                too_big = true;
                                break;
                            }
                        }
                    }
                    if prod.publish() {
                        ring.wake();
                    }
                    drop(prod);
                    self.stats.shm_sent_datagrams += (k - done) as u64;
                    done = k;
                    if too_big {
                        // Not a packet the device makes (a slot holds the largest MTU's):
                        // by UDP, like a datagram to anyone else.
                        match self.udp.send_batch(&pkts[done..done + 1]) {
                            Ok(1) => done += 1,
                            Ok(_) => return Ok(done),
                            Err(e) if done == 0 => return Err(e),
                            Err(_) => return Ok(done),
                        }
                    } else if k < pkts.len() && canonical(pkts[k].dst) == dst {
                        // Full: as a full socket buffer, the caller retries the rest.
                        return Ok(done);
                    }
                }
                None => {
                    let mut end = done + 1;
                    while end < pkts.len() {
                        let d = canonical(pkts[end].dst);
                        if route(&inner, &mut routes, d).is_some() {
                            break;
                        }
                        end += 1;
                    }
                    match self.udp.send_batch(&pkts[done..end]) {
                        Ok(n) => {
                            done += n;
                            if done < end {
                                return Ok(done);
                            }
                        }
                        Err(e) if done == 0 => return Err(e),
                        Err(_) => return Ok(done),
                    }
                }
            }
        }
        Ok(done)
    }
}

/// The ring to `dst`, if its datagrams go through one (connecting on first use).
fn route(
    inner: &Inner,
    routes: &mut IdMap<SocketAddr, Route>,
    dst: SocketAddr,
) -> Option<Arc<OutRing>> {
    match routes.get(&dst) {
        Some(Route::Remote) => return None,
        Some(Route::Ring(r)) if !r.dead.load(Ordering::Acquire) => return Some(Arc::clone(r)),
        Some(Route::Udp(at, _)) if Instant::now() < *at => return None,
        Some(Route::Ring(r)) if r.wake.get().is_none() => {
            // The peer took the connection and dropped it without answering: it does not
            // take rings (an older version, or it refused us). Not again for a while.
            routes.insert(
                dst,
                Route::Udp(Instant::now() + REFUSED_RETRY, REFUSED.to_string()),
            );
            return None;
        }
        Some(_) => {}
        None => {
            let ip = dst.ip();
            let local = ip.is_loopback() || inner.host_ips.contains(&ip);
            if !local || ip.is_multicast() || dst.port() == 0 {
                routes.insert(dst, Route::Remote);
                return None;
            }
        }
    }
    match connect(inner, dst) {
        Ok(r) => {
            routes.insert(dst, Route::Ring(Arc::clone(&r)));
            Some(r)
        }
        Err(e) => {
            tracing::trace!(%dst, error = %e, "no same-host ring: by UDP");
            let why = match e.kind() {
                io::ErrorKind::NotFound => {
                    "no softrdma device with the same-host path on listens for rings there"
                        .to_string()
                }
                io::ErrorKind::PermissionDenied => format!("{e}: another user's device"),
                _ => format!("no ring: {e}"),
            };
            routes.insert(dst, Route::Udp(Instant::now() + RETRY_AFTER, why));
            None
        }
    }
}

/// Connect to the rendezvous socket of the device at `dst` and pass it a new ring.
fn connect(inner: &Inner, dst: SocketAddr) -> io::Result<Arc<OutRing>> {
    let name = sock_name(inner.netns, dst);
    let st = rustix::fs::statat(
        inner.dir.as_fd(),
        name.as_str(),
        rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
    )?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::Socket {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "not a socket"));
    }
    let (sa, len) = unix_addr(inner.dir.as_fd(), &name)?;
    let sock = unix_socket()?;
    // SAFETY: `sa` is a valid sockaddr_un of length `len`.
    cvt(unsafe {
        libc::connect(
            sock.as_raw_fd(),
            (&sa as *const libc::sockaddr_un).cast(),
            len,
        )
    })?;
    let uid = peer_uid(sock.as_fd())?;
    if uid != my_uid() {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("rendezvous socket served by uid {uid}"),
        ));
    }
    let prod = Producer::create()?;
    send_with_fds(
        sock.as_fd(),
        &hello(inner.local),
        &[prod.memfd().as_raw_fd()],
    )?;
    let ring = Arc::new(OutRing {
        prod: Mutex::new(prod),
        conn: sock,
        wake: OnceLock::new(),
        dead: AtomicBool::new(false),
        cma: OnceLock::new(),
        grants: OnceLock::new(),
    });
    let token = inner.next_token.fetch_add(1, Ordering::Relaxed);
    lock(&inner.conns).insert(token, Conn::Out(Arc::downgrade(&ring)));
    epoll_add(inner.ctl_epoll.as_fd(), ring.conn.as_fd(), token)?;
    tracing::debug!(%dst, "same-host ring connected");
    Ok(ring)
}

/// Bind the device's rendezvous socket, replacing a stale one.
fn listen(inner: &Inner) -> io::Result<(OwnedFd, Listener)> {
    let name = sock_name(inner.netns, inner.local);
    let (sa, len) = unix_addr(inner.dir.as_fd(), &name)?;
    let sock = unix_socket()?;
    let bind = || {
        // SAFETY: `sa` is a valid sockaddr_un of length `len`.
        cvt(unsafe {
            libc::bind(
                sock.as_raw_fd(),
                (&sa as *const libc::sockaddr_un).cast(),
                len,
            )
        })
    };
    if let Err(e) = bind() {
        if e.raw_os_error() != Some(libc::EADDRINUSE) {
            return Err(e);
        }
        // A socket of that name: stale if nobody answers on it (its device is gone; we
        // hold the device's UDP address, so no live device of this namespace has it).
        let probe = unix_socket()?;
        // SAFETY: as above.
        let r = cvt(unsafe {
            libc::connect(
                probe.as_raw_fd(),
                (&sa as *const libc::sockaddr_un).cast(),
                len,
            )
        });
        match r {
            Err(e) if e.raw_os_error() == Some(libc::ECONNREFUSED) => {}
            Err(e) => return Err(e),
            Ok(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    "another device answers on this rendezvous socket",
                ))
            }
        }
        rustix::fs::unlinkat(
            inner.dir.as_fd(),
            name.as_str(),
            rustix::fs::AtFlags::empty(),
        )?;
        bind()?;
    }
    // SAFETY: a bound socket of ours.
    cvt(unsafe { libc::listen(sock.as_raw_fd(), 64) })?;
    let st = rustix::fs::statat(
        inner.dir.as_fd(),
        name.as_str(),
        rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
    )?;
    Ok((
        sock,
        Listener {
            name,
            id: (st.st_dev, st.st_ino),
        },
    ))
}

/// The rendezvous thread: accept connections, take the rings passed over them, answer
/// with our eventfd, take peers' answers, and drop rings whose connection ends.
fn rendezvous(inner: &Inner, listener: Option<OwnedFd>) {
    // SAFETY: epoll_event is plain integers.
    let mut evs: [libc::epoll_event; 16] = unsafe { mem::zeroed() };
    loop {
        // SAFETY: `evs` is writable for its length.
        let n = unsafe {
            libc::epoll_wait(
                inner.ctl_epoll.as_raw_fd(),
                evs.as_mut_ptr(),
                evs.len() as libc::c_int,
                -1,
            )
        };
        if n < 0 {
            if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            tracing::warn!(error = %io::Error::last_os_error(), "same-host rendezvous stopped");
            return;
        }
        for ev in &evs[..n as usize] {
            let (token, flags) = (ev.u64, ev.events);
            match token {
                TOK_STOP => return,
                TOK_LISTEN => {
                    if let Some(l) = &listener {
                        accept_all(inner, l.as_fd());
                    }
                }
                t => on_conn(inner, t, flags),
            }
        }
    }
}

fn accept_all(inner: &Inner, listener: BorrowedFd<'_>) {
    loop {
        // SAFETY: no address wanted; flags are constants.
        let fd = unsafe {
            libc::accept4(
                listener.as_raw_fd(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            )
        };
        if fd < 0 {
            return;
        }
        // SAFETY: a descriptor accept just gave us.
        let conn = unsafe { OwnedFd::from_raw_fd(fd) };
        match peer_uid(conn.as_fd()) {
            Ok(uid) if uid == my_uid() => {}
            other => {
                tracing::debug!(?other, "same-host ring refused: another user's process");
                continue;
            }
        }
        let mut conns = lock(&inner.conns);
        if conns
            .values()
            .filter(|c| matches!(c, Conn::Pending(_)))
            .count()
            >= PENDING_MAX
        {
            continue;
        }
        let token = inner.next_token.fetch_add(1, Ordering::Relaxed);
        if epoll_add(inner.ctl_epoll.as_fd(), conn.as_fd(), token).is_ok() {
            conns.insert(token, Conn::Pending(conn));
        }
    }
}

fn on_conn(inner: &Inner, token: u64, flags: u32) {
    let mut conns = lock(&inner.conns);
    let Some(conn) = conns.remove(&token) else {
        return;
    };
    let hup = flags & (libc::EPOLLHUP | libc::EPOLLRDHUP | libc::EPOLLERR) as u32 != 0;
    match conn {
        Conn::Pending(fd) => {
            drop(conns);
            let mut buf = [0u8; HELLO_LEN + 1];
            match recv_with_fds(fd.as_fd(), &mut buf) {
                Ok((n, fds)) if n > 0 => {
                    if let Err(e) = take_ring(inner, token, fd, &buf[..n], fds) {
                        tracing::debug!(error = %e, "same-host ring refused");
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && !hup => {
                    lock(&inner.conns).insert(token, Conn::Pending(fd));
                }
                // End of stream or an error: dropping it closes it (and its epoll entry).
                _ => {}
            }
        }
        Conn::In(w) => {
            // A peer's ring connection carries nothing after the hello: readable means it
            // ended.
            if let Some(r) = w.upgrade() {
                r.closed.store(true, Ordering::Release);
                epoll_del(inner.ctl_epoll.as_fd(), r._conn.as_fd());
                // Wake the device to drain and drop it.
                eventfd_write(r.wake.as_fd());
            }
        }
        Conn::Out(w) => {
            let Some(r) = w.upgrade() else { return };
            let mut buf = [0u8; ANSWER_LEN + 1];
            match recv_with_fds(r.conn.as_fd(), &mut buf) {
                Ok((n, mut fds))
                    if n > 0
                        && r.wake.get().is_none()
                        && matches!(fds.len(), 1 | 2)
                        && is_eventfd(&fds[0]) =>
                {
                    let grants_fd = (fds.len() == 2).then(|| fds.pop()).flatten();
                    if let Some(w) = fds.pop() {
                        let _ = r.wake.set(w);
                    }
                    let answer = parse_answer(&buf[..n]);
                    let cma = match (answer, peer_cred(r.conn.as_fd())) {
                        (Some((addr, value, _)), Ok(c)) => {
                            super::cma::probe(c.pid, addr, value).map(|()| c.pid)
                        }
                        (None, _) => Err("the device there did not say where to probe".into()),
                        (_, Err(e)) => Err(format!("no peer credentials: {e}")),
                    };
                    if let (Some((_, _, Some(slot))), Some(fd)) = (answer, grants_fd) {
                        match PeerGrants::open(fd.as_fd(), slot) {
                            Ok(g) => {
                                let _ = r.grants.set(Mutex::new(g));
                            }
                            Err(e) => tracing::debug!(error = %e, "peer's grants refused"),
                        }
                    }
                    let _ = r.cma.set(cma);
                    // Packets published before the answer came could not wake the peer.
                    fence(Ordering::SeqCst);
                    r.wake();
                    conns.insert(token, Conn::Out(Arc::downgrade(&r)));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && !hup => {
                    conns.insert(token, Conn::Out(Arc::downgrade(&r)));
                }
                _ => {
                    r.dead.store(true, Ordering::Release);
                    epoll_del(inner.ctl_epoll.as_fd(), r.conn.as_fd());
                    // Unmap it now rather than at the next datagram to that peer, which
                    // may never come (the lock order is routes, then conns).
                    drop(conns);
                    let mut routes = lock(&inner.routes);
                    let dst = routes
                        .iter()
                        .find(|(_, v)| matches!(v, Route::Ring(o) if Arc::ptr_eq(o, &r)))
                        .map(|(k, _)| *k);
                    if let Some(dst) = dst {
                        if r.wake.get().is_none() {
                            // It took the ring and never answered: it refuses them.
                            routes.insert(
                                dst,
                                Route::Udp(Instant::now() + REFUSED_RETRY, REFUSED.to_string()),
                            );
                        } else {
                            // It went away: the next datagram looks for it afresh.
                            routes.remove(&dst);
                        }
                    }
                }
            }
        }
    }
}

/// Take the ring a peer passed with its hello: map it, put it in the device's receive set,
/// answer with our eventfd.
fn take_ring(
    inner: &Inner,
    token: u64,
    conn: OwnedFd,
    msg: &[u8],
    mut fds: Vec<OwnedFd>,
) -> io::Result<()> {
    let peer =
        parse_hello(msg).ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "bad hello"))?;
    if fds.len() != 1 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "one memfd expected",
        ));
    }
    let memfd = fds
        .pop()
        .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidData))?;
    let cons = Consumer::open(memfd.as_fd())?;
    drop(memfd);
    let wake = new_eventfd()?;
    epoll_add(inner.epoll.as_fd(), wake.as_fd(), 0)?;
    let slot = inner
        .grants
        .as_ref()
        .and_then(|g| lock(g).claim_slot().map(|s| (s, Arc::clone(g))));
    let sent = match &slot {
        Some((s, g)) => {
            let g = lock(g);
            send_with_fds(
                conn.as_fd(),
                &answer(Some(*s)),
                &[wake.as_raw_fd(), g.memfd().as_raw_fd()],
            )
        }
        None => send_with_fds(conn.as_fd(), &answer(None), &[wake.as_raw_fd()]),
    };
    if let Err(e) = sent {
        if let Some((s, g)) = &slot {
            lock(g).release_slot(*s);
        }
        return Err(e);
    }
    let ring = Arc::new(InRing {
        peer: canonical(peer),
        cons: Mutex::new(cons),
        wake,
        _conn: conn,
        closed: AtomicBool::new(false),
        slot,
    });
    {
        let mut rin = lock(&inner.rings_in);
        for old in rin.rings.iter().filter(|r| r.peer == ring.peer) {
            // The peer restarted, or reconnected after we dropped it: its old ring has
            // nothing more coming.
            old.closed.store(true, Ordering::Release);
        }
        if rin.sleepers > 0 {
            let _ = lock(&ring.cons).sleep_begin(rin.asleep_bits());
        }
        rin.rings.push(Arc::clone(&ring));
        inner.rings_gen.fetch_add(1, Ordering::Release);
    }
    // The connection stays in the thread's set under its token: its end drops the ring.
    lock(&inner.conns).insert(token, Conn::In(Arc::downgrade(&ring)));
    // Whatever the peer wrote before we mapped the ring: the device drains it now.
    eventfd_write(ring.wake.as_fd());
    tracing::debug!(peer = %ring.peer, "same-host ring accepted");
    Ok(())
}

impl Inner {
    fn new(local: SocketAddr, dir: BorrowedFd<'_>) -> io::Result<Inner> {
        let ctl_epoll = epoll_new()?;
        let stop = new_eventfd()?;
        epoll_add(ctl_epoll.as_fd(), stop.as_fd(), TOK_STOP)?;
        let host_ips = crate::ifaddrs::interface_addrs()
            .into_iter()
            .map(|a| a.addr)
            .filter(|a| !a.is_loopback())
            .collect();
        Ok(Inner {
            local,
            netns: netns_id(),
            dir: dir.try_clone_to_owned()?,
            host_ips,
            epoll: epoll_new()?,
            ctl_epoll,
            stop,
            conns: Mutex::new(HashMap::new()),
            next_token: AtomicU64::new(2),
            routes: Mutex::new(IdMap::default()),
            rings_in: Mutex::new(InRings::default()),
            rings_gen: AtomicU64::new(0),
            udp_due: AtomicBool::new(false),
            grants: match Grants::create() {
                Ok(g) => Some(Arc::new(Mutex::new(g))),
                Err(e) => {
                    tracing::debug!(error = %e, "no grants table: peers copy through the rings");
                    None
                }
            },
        })
    }

    /// Drop the incoming rings in `gone` (closed and drained).
    fn drop_rings(&self, gone: &[Arc<InRing>]) {
        let mut rin = lock(&self.rings_in);
        rin.rings
            .retain(|r| !gone.iter().any(|g| Arc::ptr_eq(g, r)));
        for g in gone {
            epoll_del(self.epoll.as_fd(), g.wake.as_fd());
        }
        self.rings_gen.fetch_add(1, Ordering::Release);
    }
}

impl SleepGate for Host {
    fn prepare_sleep(&self, nudges: bool) -> bool {
        let inner = &self.inner;
        let mut rin = lock(&inner.rings_in);
        inner.udp_due.store(true, Ordering::Relaxed);
        rin.sleepers += 1;
        rin.nudge_sleepers += usize::from(nudges);
        let bits = rin.asleep_bits();
        let mut empty = true;
        for r in &rin.rings {
            // Readable only for what comes after this: a wake-up already consumed (we are
            // about to look at the ring) must not end the sleep at once.
            eventfd_clear(r.wake.as_fd());
            // Every sleeper marks the ring asleep again: a producer that woke an earlier
            // one marked it awake, and would not wake this one.
            empty &= lock(&r.cons).sleep_begin(bits);
        }
        if !empty {
            end_sleep(&mut rin, nudges);
        }
        empty
    }

    fn end_sleep(&self, nudges: bool) {
        end_sleep(&mut lock(&self.inner.rings_in), nudges);
    }
}

fn end_sleep(rin: &mut InRings, nudges: bool) {
    rin.sleepers = rin.sleepers.saturating_sub(1);
    rin.nudge_sleepers = rin.nudge_sleepers.saturating_sub(usize::from(nudges));
    if rin.sleepers == 0 {
        for r in &rin.rings {
            lock(&r.cons).sleep_end();
        }
    }
}

/// Copies into same-host peers' memory under their grants, for the device's requester
/// (a handle on the link's peers, independent of any one link handle).
#[derive(Debug, Clone)]
pub struct Placer {
    inner: Arc<Inner>,
}

impl Placer {
    /// Copy `src` (this process's pieces, in order) into the region `ask` names at the
    /// device `dst`, if its ring is up, cross-memory attach to it works and its grants
    /// allow `ask` (a write): true if every byte is there.
    ///
    /// # Safety
    /// Every piece of `src` is memory of this process the caller may read for the call.
    pub unsafe fn write(
        &self,
        dst: SocketAddr,
        ask: &super::grants::Ask,
        src: &[(u64, usize)],
    ) -> bool {
        // SAFETY: the caller's contract for `src`; the target range is inside the region
        // the hold keeps granted until after the copy.
        let ring = self.under_hold(dst, ask, |pid, host| unsafe {
            super::cma::writev_to(pid, host, src)
        });
        let Some(ring) = ring else {
            return false;
        };
        // Its threads that wait for their memory to change look again.
        if lock(&ring.prod).nudge() {
            ring.wake();
        }
        true
    }

    /// Copy the region `ask` names at the device `dst` (a read) into `dst_pieces` (this
    /// process's, in order), under the same conditions as [`Placer::write`]: true if every
    /// byte is here. False may leave part of the pieces overwritten.
    ///
    /// # Safety
    /// Every piece of `dst_pieces` is memory of this process the caller may overwrite for
    /// the call, with nothing else using it meanwhile.
    pub unsafe fn read(
        &self,
        dst: SocketAddr,
        ask: &super::grants::Ask,
        dst_pieces: &[(u64, usize)],
    ) -> bool {
        // SAFETY: the caller's contract for `dst_pieces`; the source range is inside the
        // region the hold keeps granted until after the copy.
        self.under_hold(dst, ask, |pid, host| unsafe {
            super::cma::readv_from(pid, host, dst_pieces)
        })
        .is_some()
    }

    /// Whether a thread of the device at `dst` polls its rings now (none of its threads is
    /// blocked waiting for a packet); false if there is no ring to it.
    pub fn peer_polls(&self, dst: SocketAddr) -> bool {
        match lock(&self.inner.routes).get(&canonical(dst)) {
            Some(Route::Ring(r)) => !lock(&r.prod).consumer_asleep(),
            _ => false,
        }
    }

    /// How many one-sided operations the device at `dst` has placed in this device's
    /// memory, as its ring to us says (0 with no ring from it): a count that moves with
    /// each (see [`Producer::nudge`]).
    pub fn peer_wrote(&self, dst: SocketAddr) -> u64 {
        let dst = canonical(dst);
        let rin = lock(&self.inner.rings_in);
        rin.rings
            .iter()
            .rev()
            .find(|r| r.peer == dst)
            .map_or(0, |r| u64::from(lock(&r.cons).nudges()))
    }

    /// Whether [`Placer::write`] or [`Placer::read`] of `ask` could copy now (copying
    /// nothing).
    pub fn check(&self, dst: SocketAddr, ask: &super::grants::Ask) -> bool {
        self.under_hold(dst, ask, |_, _| Ok(())).is_some()
    }

    /// Run `copy(pid, host address)` while the peer at `dst` holds the region of `ask`
    /// granted: its ring if the ring is up, cross-memory attach works, the grants allow
    /// `ask` and the copy succeeded.
    fn under_hold(
        &self,
        dst: SocketAddr,
        ask: &super::grants::Ask,
        copy: impl FnOnce(i32, u64) -> io::Result<()>,
    ) -> Option<Arc<OutRing>> {
        let ring = match lock(&self.inner.routes).get(&canonical(dst)) {
            Some(Route::Ring(r)) if !r.dead.load(Ordering::Acquire) => Arc::clone(r),
            _ => return None,
        };
        let pid = *ring.cma.get()?.as_ref().ok()?;
        let r = {
            let mut g = lock(ring.grants.get()?);
            let hold = g.hold(ask).ok()?;
            let r = copy(pid, hold.host());
            drop(hold);
            r
        };
        r.ok().map(|()| ring)
    }
}

impl HostLink {
    /// The placer of this link's device ([`Placer`]).
    pub fn placer(&self) -> Placer {
        Placer {
            inner: Arc::clone(&self.host.inner),
        }
    }

    /// This device's grants, which the device keeps equal to what its peers may reach
    /// (None: the table could not be made).
    pub fn grants(&self) -> Option<Arc<Mutex<Grants>>> {
        self.host.inner.grants.clone()
    }

    /// Whether the peer given grants slot `slot` is still connected: a revocation waits
    /// for its holds only while it is.
    pub fn slot_alive(&self, slot: usize) -> bool {
        lock(&self.host.inner.rings_in).rings.iter().any(|r| {
            !r.closed.load(Ordering::Acquire) && r.slot.as_ref().is_some_and(|(s, _)| *s == slot)
        })
    }

    /// Run `f` with the grants of the device at `dst` and its process's PID, if its ring
    /// is up, cross-memory attach to it works and it gave us its grants.
    pub fn with_peer_grants<R>(
        &self,
        dst: SocketAddr,
        f: impl FnOnce(&mut PeerGrants, i32) -> R,
    ) -> Option<R> {
        let ring = match lock(&self.host.inner.routes).get(&canonical(dst)) {
            Some(Route::Ring(r)) if !r.dead.load(Ordering::Acquire) => Arc::clone(r),
            _ => return None,
        };
        let pid = *ring.cma.get()?.as_ref().ok()?;
        let mut g = lock(ring.grants.get()?);
        Some(f(&mut g, pid))
    }
}

impl Link for HostLink {
    fn local_addr(&self) -> SocketAddr {
        self.udp.local_addr()
    }

    fn send_batch(&mut self, pkts: &[OutDatagram<'_>]) -> io::Result<usize> {
        if !self.rings_ok {
            return self.udp.send_batch(pkts);
        }
        self.send_rings(pkts)
    }

    fn recv_batch(&mut self, out: &mut RecvBatch) -> io::Result<usize> {
        out.clear();
        let inner = &*self.host.inner;
        let g = inner.rings_gen.load(Ordering::Acquire);
        if g != self.rings_gen {
            self.rings_gen = g;
            self.rings = lock(&inner.rings_in).rings.clone();
        }
        let mut from_rings = 0;
        let mut gone: Vec<Arc<InRing>> = Vec::new();
        let local = inner.local;
        let nr = self.rings.len();
        for k in 0..nr {
            let r = &self.rings[(self.next_ring + k) % nr];
            let closed = r.closed.load(Ordering::Acquire);
            let mut c = lock(&r.cons);
            let mut corrupt = false;
            while let Some(slot) = out.free_slot() {
                match c.pop(slot) {
                    Ok(Some((n, port, tos))) => {
                        out.commit_slot(n, SocketAddr::new(r.peer.ip(), port), local, tos);
                        from_rings += 1;
                    }
                    Ok(None) => break,
                    Err(ring::Corrupt) => {
                        corrupt = true;
                        break;
                    }
                }
            }
            c.commit();
            self.nudged |= c.take_nudge();
            if corrupt {
                tracing::warn!(peer = %r.peer, "same-host ring from this peer corrupt: dropped");
                self.stats.errors += 1;
                gone.push(Arc::clone(r));
            } else if closed && c.is_empty() {
                gone.push(Arc::clone(r));
            }
        }
        if nr > 0 {
            self.next_ring = (self.next_ring + 1) % nr;
        }
        if !gone.is_empty() {
            inner.drop_rings(&gone);
        }
        self.stats.shm_recv_datagrams += from_rings as u64;
        self.calls = self.calls.wrapping_add(1);
        self.udp_hot = self.udp_hot.saturating_sub(1);
        let udp = nr == 0
            || self.udp_hot > 0
            || self.calls % UDP_EVERY == 0
            || inner.udp_due.load(Ordering::Relaxed)
                && inner.udp_due.swap(false, Ordering::Relaxed);
        if udp {
            // The rings were read first and the socket after, but the socket's datagrams
            // go first: when a peer's traffic moves from UDP to a new ring, what it sent
            // by UDP is older than anything in the ring (on loopback a datagram is in our
            // socket when its send returns). Only within this call: a socket read skipped
            // on an earlier call can still put one behind the ring's, which RC recovers
            // from like any reordering.
            let r = self.udp.recv_append(out);
            if out.len() > from_rings {
                self.udp_hot = UDP_HOT_CALLS;
            }
            out.rotate_front(from_rings);
            if let Err(e) = r {
                if from_rings == 0 {
                    return Err(e);
                }
            }
        }
        Ok(out.len())
    }

    fn readable_fd(&self) -> BorrowedFd<'_> {
        self.host.inner.epoll.as_fd()
    }

    fn take_nudged(&mut self) -> bool {
        std::mem::take(&mut self.nudged)
    }

    fn clone_link(&self) -> io::Result<Box<dyn Link>> {
        Ok(Box::new(HostLink::handle(
            self.udp.try_clone()?,
            Arc::clone(&self.host),
            self.rings_ok,
        )))
    }

    fn send_only_at(&self, src: SocketAddr) -> io::Result<Box<dyn Link>> {
        let mut d = Driver::bind_send_only(src)?;
        d.set_gso(self.udp.gso_enabled());
        let ok = canonical(src).ip() == self.host.inner.local.ip();
        Ok(Box::new(HostLink::handle(d, Arc::clone(&self.host), ok)))
    }

    fn stats(&self) -> Stats {
        let u = self.udp.stats();
        Stats {
            shm_sent_datagrams: self.stats.shm_sent_datagrams,
            shm_recv_datagrams: self.stats.shm_recv_datagrams,
            shm_full: self.stats.shm_full,
            errors: u.errors + self.stats.errors,
            ..u
        }
    }

    fn recv_buffer_size(&self) -> io::Result<usize> {
        // The RC window must fit the ring as it fits the socket buffer (the engine
        // assumes a packet of 2 MTUs and overhead per slot of buffer).
        let ring_bytes = ring::SLOTS as usize * (2 * 4096 + 256);
        Ok(self.udp.recv_buffer_size()?.min(ring_bytes))
    }

    fn gso_enabled(&self) -> bool {
        self.udp.gso_enabled()
    }

    fn same_host_ring(&self, dst: SocketAddr) -> bool {
        if !self.rings_ok {
            return false;
        }
        let inner = &self.host.inner;
        let mut routes = lock(&inner.routes);
        route(inner, &mut routes, canonical(dst)).is_some()
    }

    fn peer_paths(&self) -> Vec<PeerPath> {
        let mut v: Vec<PeerPath> = lock(&self.host.inner.routes)
            .iter()
            .map(|(dst, r)| PeerPath {
                peer: *dst,
                ring: matches!(r, Route::Ring(o) if !o.dead.load(Ordering::Acquire)),
                why: match r {
                    Route::Remote if dst.ip().is_multicast() => "multicast group".to_string(),
                    Route::Remote => "not an address of this host".to_string(),
                    Route::Udp(_, why) => why.clone(),
                    Route::Ring(o) if o.dead.load(Ordering::Acquire) => {
                        "its ring ended (the device there went away)".to_string()
                    }
                    Route::Ring(o) if o.wake.get().is_none() => {
                        "ring offered, not yet answered".to_string()
                    }
                    Route::Ring(o) => match o.cma.get() {
                        Some(Ok(_)) => {
                            "a device of this host, same user; cross-memory attach works".into()
                        }
                        Some(Err(why)) => format!("a device of this host, same user; {why}"),
                        None => "a device of this host, same user".to_string(),
                    },
                },
            })
            .collect();
        v.sort_by_key(|p| p.peer);
        v
    }

    fn placer(&self) -> Option<Placer> {
        Some(HostLink::placer(self))
    }

    fn grants(&self) -> Option<super::grants::Shared> {
        let grants = self.host.inner.grants.clone()?;
        let inner = Arc::downgrade(&self.host.inner);
        Some(super::grants::Shared {
            grants,
            alive: Arc::new(move |slot| {
                inner.upgrade().is_some_and(|i| {
                    lock(&i.rings_in).rings.iter().any(|r| {
                        !r.closed.load(Ordering::Acquire)
                            && r.slot.as_ref().is_some_and(|(s, _)| *s == slot)
                    })
                })
            }),
        })
    }

    fn holds_back(&self, dst: SocketAddr) -> bool {
        self.rings_ok
            && matches!(lock(&self.host.inner.routes).get(&canonical(dst)),
                Some(Route::Ring(r)) if !r.dead.load(Ordering::Acquire))
    }

    fn gso_run_len(&self, pkts: &[OutDatagram<'_>]) -> usize {
        if self.rings_ok && !pkts.is_empty() {
            let dst = canonical(pkts[0].dst);
            let inner = &self.host.inner;
            if matches!(lock(&inner.routes).get(&dst), Some(Route::Ring(r)) if !r.dead.load(Ordering::Acquire))
            {
                // Into a ring one by one: no IP ID to seal for.
                return 1;
            }
        }
        self.udp.gso_run_len(pkts)
    }

    fn set_gro(&mut self, on: bool) -> io::Result<bool> {
        self.udp.set_gro(on)
    }

    fn set_multicast_interface(&self, ifindex: u32) -> io::Result<()> {
        self.udp.set_multicast_interface(ifindex)
    }

    fn sleep_gate(&self) -> Option<Arc<dyn SleepGate>> {
        Some(Arc::clone(&self.host) as Arc<dyn SleepGate>)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::DirBuilderExt;

    /// A fresh run directory of our own, removed at the end.
    struct TmpDir(std::path::PathBuf, std::fs::File);
    impl TmpDir {
        fn new(tag: &str) -> TmpDir {
            static N: AtomicU64 = AtomicU64::new(0);
            let p = std::env::temp_dir().join(format!(
                "softrdma-shm-{tag}-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::DirBuilder::new().mode(0o700).create(&p).unwrap();
            let f = std::fs::File::open(&p).unwrap();
            TmpDir(p, f)
        }
        fn fd(&self) -> BorrowedFd<'_> {
            self.1.as_fd()
        }
    }
    impl Drop for TmpDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn link_at(dir: &TmpDir, addr: SocketAddr) -> HostLink {
        HostLink::new(Driver::bind(addr).unwrap(), dir.fd()).unwrap()
    }

    fn link(dir: &TmpDir) -> HostLink {
        link_at(dir, "127.0.0.1:0".parse().unwrap())
    }

    /// Receive on `l` until `want` datagrams came or the bounded loop ends: their
    /// sources, TOS and payloads.
    fn recv_n(l: &mut HostLink, want: usize) -> Vec<(SocketAddr, SocketAddr, u8, Vec<u8>)> {
        let mut batch = RecvBatch::new(32, 9216);
        let mut got = Vec::new();
        for _ in 0..20_000 {
            if got.len() >= want {
                break;
            }
            if l.recv_batch(&mut batch).unwrap() == 0 {
                std::thread::sleep(Duration::from_micros(100));
                continue;
            }
            for d in batch.iter() {
                got.push((d.src, d.dst, d.tos, d.data.to_vec()));
            }
        }
        got
    }

    /// One datagram of TOS 0 to `dst`, through [`send_all`].
    fn send_one(l: &mut HostLink, dst: SocketAddr, data: &[u8]) {
        send_all(l, &[OutDatagram { dst, tos: 0, data }]);
    }

    fn send_all(l: &mut HostLink, pkts: &[OutDatagram<'_>]) {
        let mut at = 0;
        for _ in 0..20_000 {
            if at == pkts.len() {
                return;
            }
            at += l.send_batch(&pkts[at..]).unwrap();
            if at < pkts.len() {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        panic!("sent only {at} of {}", pkts.len());
    }

    fn payload(i: usize, len: usize) -> Vec<u8> {
        (0..len).map(|k| (k * 7 + i) as u8).collect()
    }

    #[test]
    fn a_peer_copies_into_granted_memory_and_not_after_the_revocation() {
        use crate::shm::grants::{Ask, QpGrant, Refusal, RegionGrant, REMOTE_WRITE};
        let dir = TmpDir::new("grants");
        let a = link(&dir);
        let mut b = link(&dir);
        let ba = b.local_addr();
        // One datagram from a to b sets up a's ring to b; b's answer brings its grants.
        let one = [OutDatagram {
            dst: ba,
            tos: 0,
            data: b"x",
        }];
        let mut a = a;
        assert_eq!(a.send_batch(&one).unwrap(), 1);
        assert_eq!(recv_n(&mut b, 1).len(), 1);
        // The peer writes it through the kernel: its address comes from a mutable borrow.
        let mut target = vec![0u8; 4096];
        let target_host = target.as_mut_ptr() as u64;
        let grants = b.grants().expect("a grants table");
        assert!(lock(&grants).grant_qp(&QpGrant {
            qpn: 7,
            access: REMOTE_WRITE,
            pd: 1
        }));
        let region = RegionGrant {
            rkey: 0x1234,
            iova: 0x10_0000,
            len: 4096,
            host: target_host,
            access: REMOTE_WRITE,
            pd: 1,
        };
        assert!(lock(&grants).grant_region(&region, |s| b.slot_alive(s)));
        let ask = Ask {
            qpn: 7,
            rkey: 0x1234,
            va: 0x10_0100,
            len: 5,
            access: REMOTE_WRITE,
        };
        // The answer is taken by a's rendezvous thread: wait for it, bounded.
        let deadline = Instant::now() + Duration::from_secs(5);
        let written = loop {
            let r = a.with_peer_grants(ba, |g, pid| {
                let h = g.hold(&ask).map_err(|e| format!("{e:?}"))?;
                crate::shm::cma::write_to(pid, h.host(), b"hello").map_err(|e| e.to_string())
            });
            match r {
                Some(r) => break r,
                None => {
                    assert!(Instant::now() < deadline, "no grants from the peer");
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        };
        assert_eq!(written, Ok(()));
        assert_eq!(&target[0x100..0x105], b"hello");
        lock(&grants).revoke_region(0x1234, |s| b.slot_alive(s));
        let refused = a.with_peer_grants(ba, |g, _| g.hold(&ask).map(|_| ()));
        assert_eq!(refused, Some(Err(Refusal::NoRegion)));
        assert_eq!(&target[0x105..0x10a], &[0; 5]);
    }

    /// A WRITE placed by cross-memory attach sends no datagram, yet a thread of the target
    /// blocked on its device (through the sleep gate, as a program waiting for its memory
    /// to change is) wakes, and the next receive reports the change.
    #[test]
    fn a_placed_write_wakes_a_sleeping_target() {
        use crate::shm::grants::{Ask, QpGrant, RegionGrant, REMOTE_WRITE};
        let dir = TmpDir::new("nudge");
        let mut a = link(&dir);
        let mut b = link(&dir);
        let ba = b.local_addr();
        send_one(&mut a, ba, b"x");
        assert_eq!(recv_n(&mut b, 1).len(), 1);
        assert!(!b.take_nudged(), "a datagram is no nudge");
        let mut target = vec![0u8; 64];
        let grants = b.grants().expect("a grants table");
        assert!(lock(&grants).grant_qp(&QpGrant {
            qpn: 3,
            access: REMOTE_WRITE,
            pd: 1
        }));
        let region = RegionGrant {
            rkey: 0x77,
            iova: 0,
            len: 64,
            host: target.as_mut_ptr() as u64,
            access: REMOTE_WRITE,
            pd: 1,
        };
        assert!(lock(&grants).grant_region(&region, |s| b.slot_alive(s)));
        let ask = Ask {
            qpn: 3,
            rkey: 0x77,
            va: 8,
            len: 4,
            access: REMOTE_WRITE,
        };
        let placer = a.placer();
        let data = *b"wake";
        let src = [(data.as_ptr() as u64, data.len())];
        // The answer with b's grants reaches a's rendezvous thread: wait for it, bounded.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !placer.check(ba, &ask) {
            assert!(Instant::now() < deadline, "no grants from the peer");
            std::thread::sleep(Duration::from_millis(1));
        }
        let gate = b.sleep_gate().expect("a sleep gate");
        let readable_within = |b: &HostLink, secs: i64, nsecs: i64| {
            let fd = b.readable_fd();
            let mut p = [rustix::event::PollFd::new(
                &fd,
                rustix::event::PollFlags::IN,
            )];
            let t = rustix::event::Timespec {
                tv_sec: secs,
                tv_nsec: nsecs,
            };
            rustix::event::poll(&mut p, Some(&t)).unwrap() > 0
        };
        // A thread that sleeps waiting for packets alone is not woken by a placed WRITE
        // (a stream of them into an idle device would wake it for every one).
        assert!(gate.prepare_sleep(false), "nothing waits: b may block");
        // SAFETY: `src` is our own `data`, alive and unchanged for the call.
        assert!(unsafe { placer.write(ba, &ask, &src) });
        assert!(
            !readable_within(&b, 0, 50_000_000),
            "a placed WRITE woke a thread that waits for packets"
        );
        gate.end_sleep(false);
        let mut batch = RecvBatch::new(8, 9216);
        assert_eq!(b.recv_batch(&mut batch).unwrap(), 0, "no datagram");
        assert!(b.take_nudged(), "the receive saw the nudge");
        // One that waits for its memory to change is.
        assert!(gate.prepare_sleep(true), "nothing waits: b may block");
        // SAFETY: as above.
        assert!(unsafe { placer.write(ba, &ask, &src) });
        let woken = readable_within(&b, 10, 0);
        gate.end_sleep(true);
        assert!(woken, "the placed WRITE woke the sleeper");
        assert_eq!(&target[8..12], b"wake");
        assert_eq!(b.recv_batch(&mut batch).unwrap(), 0, "no datagram");
        assert!(b.take_nudged(), "the receive saw the nudge");
        assert!(!b.take_nudged(), "once");
        // One that comes before the sleep keeps the sleeper from blocking at all.
        // SAFETY: as above.
        assert!(unsafe { placer.write(ba, &ask, &src) });
        assert!(!gate.prepare_sleep(true), "a nudge waits: do not block");
        assert_eq!(b.recv_batch(&mut batch).unwrap(), 0);
        assert!(b.take_nudged());
    }

    #[test]
    fn datagrams_both_ways_through_rings_up_to_a_slot() {
        let dir = TmpDir::new("both");
        let mut a = link(&dir);
        let mut b = link(&dir);
        let (aa, ba) = (a.local_addr(), b.local_addr());
        let sizes = [0, 1, 60, 1500, 4096 + 60, ring::MAX_PACKET];
        let datas: Vec<Vec<u8>> = (0..ring::SLOTS as usize * 2 + 100)
            .map(|i| payload(i, sizes[i % sizes.len()]))
            .collect();
        for dir_ab in [true, false] {
            let (from, to, dst) = if dir_ab {
                (&mut a, &mut b, ba)
            } else {
                (&mut b, &mut a, aa)
            };
            let pkts: Vec<OutDatagram<'_>> = datas
                .iter()
                .enumerate()
                .map(|(i, d)| OutDatagram {
                    dst,
                    tos: i as u8,
                    data: d,
                })
                .collect();
            // More than a ring holds: the sender is told to retry, as on a full socket.
            let mut at = 0;
            let mut got = Vec::new();
            for _ in 0..20_000 {
                if got.len() == datas.len() {
                    break;
                }
                if at < pkts.len() {
                    at += from.send_batch(&pkts[at..]).unwrap();
                }
                got.extend(recv_n(to, 1));
            }
            assert_eq!(got.len(), datas.len());
            let src = from.local_addr();
            for (i, (s, d, tos, data)) in got.iter().enumerate() {
                assert_eq!((*s, *d, *tos), (src, dst, i as u8), "datagram {i}");
                assert_eq!(data, &datas[i], "datagram {i}");
            }
            assert_eq!(from.stats().shm_sent_datagrams, datas.len() as u64);
            assert!(
                from.stats().shm_full > 0,
                "more datagrams than a ring holds"
            );
            assert_eq!(to.stats().shm_recv_datagrams, datas.len() as u64);
            assert_eq!(from.stats().sent_datagrams, 0, "nothing went by UDP");
        }
        assert_eq!(a.ring_count(), (1, 1));
        assert_eq!(b.ring_count(), (1, 1));
        // Each probed cross-memory attach to the other (this very process: it works), and
        // says so with the peer's path.
        for (l, peer) in [(&a, ba), (&b, aa)] {
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                let p = l.peer_paths();
                let why = p.iter().find(|x| x.peer == peer).map(|x| x.why.clone());
                if why
                    .as_deref()
                    .is_some_and(|w| w.ends_with("cross-memory attach works"))
                {
                    break;
                }
                assert!(Instant::now() < deadline, "{p:?}");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    #[test]
    fn a_packet_larger_than_a_slot_goes_by_udp() {
        let dir = TmpDir::new("big");
        let mut a = link(&dir);
        let mut b = link(&dir);
        let big = payload(1, ring::MAX_PACKET + 1);
        let small = payload(2, 10);
        let dst = b.local_addr();
        send_all(
            &mut a,
            &[
                OutDatagram {
                    dst,
                    tos: 0,
                    data: &small,
                },
                OutDatagram {
                    dst,
                    tos: 0,
                    data: &big,
                },
            ],
        );
        let got = recv_n(&mut b, 2);
        assert_eq!(got.len(), 2);
        let s = a.stats();
        assert_eq!((s.shm_sent_datagrams, s.sent_datagrams), (1, 1));
    }

    #[test]
    fn a_sleeping_receiver_is_woken_through_its_readable_fd() {
        let dir = TmpDir::new("wake");
        let mut a = link(&dir);
        let mut b = link(&dir);
        let dst = b.local_addr();
        send_one(&mut a, dst, b"first");
        assert_eq!(recv_n(&mut b, 1).len(), 1);
        let gate = b.sleep_gate().unwrap();
        let readable = |l: &HostLink, ms: i64| {
            let fd = l.readable_fd();
            let mut p = [rustix::event::PollFd::new(
                &fd,
                rustix::event::PollFlags::IN,
            )];
            let t = rustix::event::Timespec {
                tv_sec: 0,
                tv_nsec: ms * 1_000_000,
            };
            rustix::event::poll(&mut p, Some(&t)).unwrap() > 0
        };
        // The ring's set-up is over once a has b's answer (it wakes b once then).
        for _ in 0..2000 {
            if matches!(lock(&a.host.inner.routes).get(&dst), Some(Route::Ring(r)) if r.wake.get().is_some())
            {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        // Its wake-ups are cleared as b goes to sleep: once the set-up's own wake-up (which
        // a's rendezvous thread writes just after it takes the answer) is past, a sleep
        // with nothing arriving is not woken.
        let mut quiet = false;
        for _ in 0..50 {
            assert!(gate.prepare_sleep(false));
            if !readable(&b, 20) {
                quiet = true;
                break;
            }
            gate.end_sleep(false);
        }
        assert!(quiet, "nothing arrived: nothing to wake for");
        send_one(&mut a, dst, b"second");
        assert!(
            readable(&b, 900),
            "a datagram into the ring wakes the sleeper"
        );
        gate.end_sleep(false);
        let got = recv_n(&mut b, 1);
        assert_eq!(got[0].3, b"second");
        // While nobody sleeps, the sender writes no eventfd: after a sleep's stale wake-up
        // is cleared, a datagram leaves the fd unreadable.
        assert!(gate.prepare_sleep(false));
        gate.end_sleep(false);
        send_one(&mut a, dst, b"third");
        assert!(!readable(&b, 20), "a polling receiver is not woken");
        assert_eq!(recv_n(&mut b, 1)[0].3, b"third");
        // A sleep that starts with a datagram waiting is refused.
        send_one(&mut a, dst, b"fourth");
        assert!(!gate.prepare_sleep(false));
    }

    #[test]
    fn a_dropped_peer_falls_back_to_udp_and_a_restarted_one_gets_a_ring_at_once() {
        let dir = TmpDir::new("restart");
        let mut a = link(&dir);
        let mut b = link(&dir);
        let dst = b.local_addr();
        send_one(&mut a, dst, b"one");
        assert_eq!(recv_n(&mut b, 1).len(), 1);
        let name = sock_name(netns_id(), dst);
        drop(b);
        assert!(
            rustix::fs::statat(
                dir.fd(),
                name.as_str(),
                rustix::fs::AtFlags::SYMLINK_NOFOLLOW
            )
            .is_err(),
            "the rendezvous socket goes with its device"
        );
        // The connection's end reaches a's rendezvous thread: its ring is dropped.
        for _ in 0..2000 {
            if a.ring_count().0 == 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(a.ring_count(), (0, 0));
        for _ in 0..2000 {
            if lock(&a.host.inner.routes).get(&dst).is_none() {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(
            lock(&a.host.inner.routes).get(&dst).is_none(),
            "the dead ring is unmapped without waiting for another datagram"
        );
        // Nobody at that address: by UDP (the kernel takes it, nobody reads it).
        send_one(&mut a, dst, b"lost");
        assert_eq!(a.stats().sent_datagrams, 1);
        assert_eq!(a.stats().shm_sent_datagrams, 1);
        // A new device at the same address: it gets every datagram (by UDP while the
        // failed look-up of a moment ago holds, RETRY_AFTER), then a ring.
        let mut b2 = link_at(&dir, dst);
        for _ in 0..1000 {
            send_all(
                &mut a,
                &[OutDatagram {
                    dst,
                    tos: 3,
                    data: b"two",
                }],
            );
            let got = recv_n(&mut b2, 1);
            assert_eq!(got[0].3, b"two");
            if b2.stats().shm_recv_datagrams > 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(
            b2.stats().shm_recv_datagrams > 0,
            "the restarted peer got a ring"
        );
    }

    #[test]
    fn a_restarted_peer_replaces_a_ring_that_was_not_yet_seen_dead() {
        let dir = TmpDir::new("replace");
        let mut a = link(&dir);
        let dst = a.local_addr();
        let mut b = link(&dir);
        let baddr = b.local_addr();
        send_one(&mut b, dst, b"x");
        assert_eq!(recv_n(&mut a, 1).len(), 1);
        // b's process "restarts": its link goes, a new one at the same address connects.
        drop(b);
        let mut b2 = link_at(&dir, baddr);
        send_one(&mut b2, dst, b"y");
        let got = recv_n(&mut a, 1);
        assert_eq!((got[0].0, got[0].3.as_slice()), (baddr, &b"y"[..]));
        for _ in 0..2000 {
            if a.ring_count().1 == 1 {
                break;
            }
            let _ = recv_n(&mut a, 0);
            let mut batch = RecvBatch::new(4, 9216);
            let _ = a.recv_batch(&mut batch);
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(a.ring_count().1, 1, "the old ring is dropped once drained");
    }

    #[test]
    fn a_destination_without_a_rendezvous_socket_gets_udp() {
        let dir = TmpDir::new("udp");
        let mut a = link(&dir);
        let mut plain = Driver::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let dst = plain.local_addr();
        send_one(&mut a, dst, b"hello");
        let mut batch = RecvBatch::new(4, 9216);
        let mut n = 0;
        for _ in 0..2000 {
            n = plain.recv_batch(&mut batch).unwrap();
            if n > 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(n, 1);
        assert_eq!(batch.iter().next().unwrap().data, b"hello");
        assert_eq!(
            (a.stats().sent_datagrams, a.stats().shm_sent_datagrams),
            (1, 0)
        );
        // And the plain socket's datagrams reach the host link by UDP.
        plain
            .send_batch(&[OutDatagram {
                dst: a.local_addr(),
                tos: 0,
                data: b"back",
            }])
            .unwrap();
        assert_eq!(recv_n(&mut a, 1)[0].3, b"back");
    }

    #[test]
    fn a_batch_for_a_ring_peer_and_a_udp_peer_reaches_both_in_order() {
        let dir = TmpDir::new("mixed");
        let mut a = link(&dir);
        let mut b = link(&dir);
        let mut plain = Driver::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let (bd, pd) = (b.local_addr(), plain.local_addr());
        let datas: Vec<Vec<u8>> = (0..40).map(|i| payload(i, 100 + i)).collect();
        // Runs of each: 3 to b, 2 to the plain socket, ...
        let pkts: Vec<OutDatagram<'_>> = datas
            .iter()
            .enumerate()
            .map(|(i, d)| OutDatagram {
                dst: if i % 5 < 3 { bd } else { pd },
                tos: 0,
                data: d,
            })
            .collect();
        send_all(&mut a, &pkts);
        let got = recv_n(&mut b, 24);
        let want: Vec<&Vec<u8>> = datas
            .iter()
            .enumerate()
            .filter(|(i, _)| i % 5 < 3)
            .map(|(_, d)| d)
            .collect();
        assert_eq!(got.iter().map(|g| &g.3).collect::<Vec<_>>(), want);
        let mut batch = RecvBatch::new(32, 9216);
        let mut by_udp = Vec::new();
        for _ in 0..2000 {
            if by_udp.len() == 16 {
                break;
            }
            plain.recv_batch(&mut batch).unwrap();
            by_udp.extend(batch.iter().map(|d| d.data.to_vec()));
            std::thread::sleep(Duration::from_micros(200));
        }
        let want: Vec<Vec<u8>> = datas
            .iter()
            .enumerate()
            .filter(|(i, _)| i % 5 >= 3)
            .map(|(_, d)| d.clone())
            .collect();
        assert_eq!(by_udp, want);
        let s = a.stats();
        assert_eq!((s.shm_sent_datagrams, s.sent_datagrams), (24, 16));
    }

    #[test]
    fn only_a_non_blocking_eventfd_is_taken_as_a_wake_up() {
        assert!(is_eventfd(&new_eventfd().unwrap()));
        let blocking = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).unwrap();
        assert!(!is_eventfd(&blocking));
        let f = std::fs::File::open("/proc/self/status").unwrap();
        assert!(!is_eventfd(&OwnedFd::from(f)));
    }

    #[test]
    fn a_stale_socket_is_replaced_and_a_live_one_kept() {
        let dir = TmpDir::new("stale");
        let udp = Driver::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = udp.local_addr();
        let name = sock_name(netns_id(), addr);
        {
            // A socket file left by a device that died.
            let (sa, len) = unix_addr(dir.fd(), &name).unwrap();
            let s = unix_socket().unwrap();
            // SAFETY: valid address of that length.
            cvt(unsafe {
                libc::bind(s.as_raw_fd(), (&sa as *const libc::sockaddr_un).cast(), len)
            })
            .unwrap();
        }
        let mut b = HostLink::new(udp, dir.fd()).unwrap();
        assert!(b.host.listener.is_some(), "the stale socket was replaced");
        let mut a = link(&dir);
        send_one(&mut a, addr, b"z");
        assert_eq!(recv_n(&mut b, 1).len(), 1);
        assert_eq!(b.stats().shm_recv_datagrams, 1);
        // A second device claiming the same name while the first answers leaves it alone.
        let inner = Inner::new(addr, dir.fd()).unwrap();
        assert_eq!(listen(&inner).unwrap_err().kind(), io::ErrorKind::AddrInUse);
    }
}
