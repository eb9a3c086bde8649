//! rsockets: librdmacm's socket calls over RDMA (`<rdma/rsocket.h>`): `rsocket`,
//! `rbind`, `rlisten`, `raccept`, `rconnect`, `rsend`/`rrecv` and their variants,
//! `rpoll`/`rselect`, `rshutdown`, `rclose`, socket options, `rfcntl`, and the direct
//! writes `riomap`/`riounmap`/`riowrite`. They let rdmacm-utils' `rstream`, `rcopy` and
//! `riostream`, and socket programs preloaded with rsockets, run on softrdma, and talk
//! to rdma-core's rsockets on another host.
//!
//! The protocol, the connection steps and the waiting are the `softrdma-rsocket`
//! crate's, which the Rust face uses too; this face keeps the socket table, the C
//! flags and options, and the errno.
//!
//! A stream rsocket is an RC connection made through the device's rdma_cm, as rdma-core
//! makes it: the socket's number is its CM channel's fd (a real descriptor, so it never
//! collides with the program's others). Datagram rsockets (`SOCK_DGRAM`, over UD with a
//! UDP side channel) are not supported: `rsocket` fails with ENOTSUP for them, as it
//! does for any type it does not serve.

mod poll;
mod stream;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::ffi::{c_int, c_void};
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use self::stream::{Life, Stream};
use super::abi;
use super::cm::{sockaddr_from_c, sockaddr_to_c};
use crate::{guard, minus_one};
use softrdma_cm::cma::IdOption;
use softrdma_rsocket::conn::{partial_result, Shutdown as How};
use softrdma_rsocket::{Config, Listener as Accepting, Socket, Unconnected};

// The entry points `rpoll` and `rselect` live in `poll`.

/// `SOL_RDMA` and its options (`<rdma/rsocket.h>`).
const SOL_RDMA: c_int = 0x10000;
const RDMA_SQSIZE: c_int = 0;
const RDMA_RQSIZE: c_int = 1;
const RDMA_INLINE: c_int = 2;
const RDMA_IOMAPSIZE: c_int = 3;
const RDMA_ROUTE: c_int = 4;
/// The longest one wait sleeps before looking again: rsockets' `wake_up_interval`, 500
/// ms unless set in their configuration directory.
fn wait_slice_ms() -> c_int {
    static V: std::sync::OnceLock<c_int> = std::sync::OnceLock::new();
    *V.get_or_init(|| {
        softrdma_rsocket::config::conf_value("wake_up_interval")
            .map_or(500, |v| v.clamp(1, 60_000) as c_int)
    })
}

/// A listening socket's accept queue and the thread that accepts for it.
struct Listener {
    /// Accepted sockets' numbers, 4 bytes each: read by `raccept`, polled by `rpoll`.
    queue_rd: c_int,
    queue_wr: c_int,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

pub(crate) struct Rsock {
    fd: c_int,
    s: Mutex<Stream>,
    listener: Mutex<Option<Listener>>,
}

static TABLE: Mutex<BTreeMap<c_int, Arc<Rsock>>> = Mutex::new(BTreeMap::new());

fn table() -> MutexGuard<'static, BTreeMap<c_int, Arc<Rsock>>> {
    TABLE.lock().unwrap_or_else(|e| e.into_inner())
}

fn lookup(fd: c_int) -> Option<Arc<Rsock>> {
    table().get(&fd).cloned()
}

fn set_nonblock(fd: c_int, on: bool) -> c_int {
    // SAFETY: fcntl on a descriptor; no pointers.
    unsafe {
        let fl = libc::fcntl(fd, libc::F_GETFL);
        if fl < 0 {
            return -1;
        }
        let nf = if on {
            fl | libc::O_NONBLOCK
        } else {
            fl & !libc::O_NONBLOCK
        };
        libc::fcntl(fd, libc::F_SETFL, nf)
    }
}

/// Wait until one of `fds` is readable or `ms` pass: which are readable.
fn wait_readable(fds: &[c_int], ms: c_int) -> Vec<bool> {
    let mut p: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    // SAFETY: `p` holds `p.len()` pollfd entries.
    let n = unsafe { libc::poll(p.as_mut_ptr(), p.len() as libc::nfds_t, ms) };
    p.iter().map(|x| n > 0 && x.revents != 0).collect()
}

/// The errno of an error of the rsockets layer.
fn os(e: io::Error) -> c_int {
    e.raw_os_error().unwrap_or(libc::EIO)
}

impl Rsock {
    fn lock(&self) -> MutexGuard<'_, Stream> {
        self.s.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The socket, unless another thread closed it since it was looked up (EBADF).
    fn open_lock(&self) -> Result<MutexGuard<'_, Stream>, c_int> {
        let g = self.lock();
        if g.closed() {
            Err(libc::EBADF)
        } else {
            Ok(g)
        }
    }

    /// The connection, once a connect under way is taken on as far as it goes (EAGAIN
    /// while it is not done, as rsockets answer; ENOTCONN when there is none).
    fn conn(&self) -> Result<Arc<Socket>, c_int> {
        let mut g = self.open_lock()?;
        if g.opening() {
            drive(&mut g).map_err(|e| {
                if e == libc::EINPROGRESS {
                    libc::EAGAIN
                } else {
                    e
                }
            })?;
        }
        g.socket().cloned().ok_or(libc::ENOTCONN)
    }
}

/// Take a connect under way on as far as the CM's events allow: Err(EINPROGRESS) while
/// under way; a failure goes to SO_ERROR.
fn drive(s: &mut Stream) -> Result<(), c_int> {
    let Life::Connecting(c) = &mut s.life else {
        return Ok(());
    };
    match c.poll() {
        Ok(Some(sock)) => {
            s.life = Life::Open(Arc::new(sock));
            Ok(())
        }
        Ok(None) => Err(libc::EINPROGRESS),
        Err(e) => {
            let e = os(e);
            s.life = Life::Failed;
            s.err = e;
            Err(e)
        }
    }
}

/// `rconnect`: start the connect (from a fresh or bound socket), then take it on,
/// waiting for it unless the socket is non-blocking (EINPROGRESS).
fn connect(rs: &Rsock, dst: Option<std::net::SocketAddr>) -> Result<(), c_int> {
    let mut g = rs.open_lock()?;
    match &g.life {
        Life::Fresh(_) => {
            let dst = dst.ok_or(libc::EINVAL)?;
            if let Some(route) = g.route.take() {
                check_route(&route)?;
            }
            let Life::Fresh(u) = std::mem::replace(&mut g.life, Life::Failed) else {
                unreachable!("matched above")
            };
            g.life = Life::Connecting(u.connect(dst, g.cfg));
        }
        Life::Connecting(_) => {}
        Life::Open(_) => {
            return if g.connected() {
                Err(libc::EISCONN)
            } else {
                Err(libc::ENOTCONN)
            }
        }
        Life::Listening(_) => return Err(libc::EINVAL),
        Life::Failed => return Err(libc::ENOTCONN),
        Life::Closed => return Err(libc::EBADF),
    }
    loop {
        match drive(&mut g) {
            Err(libc::EINPROGRESS) if g.fs_flags & libc::O_NONBLOCK == 0 => {}
            r => return r,
        }
        let Some(fd) = g.cm_fd() else { continue };
        drop(g);
        wait_readable(&[fd], wait_slice_ms());
        g = rs.open_lock()?;
    }
}

/// `RDMA_ROUTE`: the program supplies the route; the RoCE path needs nothing from it
/// but a primary bidirectional record (EINVAL otherwise), as `rdma_set_option` checks.
fn check_route(route: &[u8]) -> Result<(), c_int> {
    const PRIMARY: u32 = 1 << 4;
    const GMP: u32 = 1 << 5;
    const BIDIRECTIONAL: u32 = (1 << 2) | (1 << 3);
    let n = std::mem::size_of::<abi::ibv_path_data>();
    if route.is_empty() || route.len() % n != 0 {
        return Err(libc::EINVAL);
    }
    let found = route.chunks_exact(n).any(|r| {
        // SAFETY: `r` holds one record's bytes; the read is unaligned.
        let d = unsafe { r.as_ptr().cast::<abi::ibv_path_data>().read_unaligned() };
        d.flags & (PRIMARY | GMP) == PRIMARY | GMP && d.flags & BIDIRECTIONAL == BIDIRECTIONAL
    });
    if found {
        Ok(())
    } else {
        Err(libc::EINVAL)
    }
}

fn ret(r: Result<c_int, c_int>) -> c_int {
    match r {
        Ok(v) => v,
        Err(e) => minus_one(e),
    }
}

fn ret_size(r: Result<isize, c_int>) -> isize {
    match r {
        Ok(v) => v,
        Err(e) => minus_one(e) as isize,
    }
}

/// The device rsockets run on: the rdma_cm's.
fn device() -> Result<Arc<softrdma_device::Device>, c_int> {
    Ok(Arc::clone(super::cm::get()?.agent().device()))
}

/// A new stream rsocket (`SOCK_STREAM`, protocol 0 or TCP, IPv4/IPv6/AF_IB).
#[no_mangle]
pub unsafe extern "C" fn rsocket(domain: c_int, type_: c_int, protocol: c_int) -> c_int {
    guard(-1, || {
        let ty = type_ & !(libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK);
        if (domain != libc::AF_INET && domain != libc::AF_INET6 && domain != abi::AF_IB)
            || ty != libc::SOCK_STREAM
            || (protocol != 0 && protocol != libc::IPPROTO_TCP)
        {
            return minus_one(libc::ENOTSUP);
        }
        let u = match device().and_then(|d| Unconnected::new(&d).map_err(os)) {
            Ok(u) => u,
            Err(e) => return minus_one(e),
        };
        let fd = u.fd().as_raw_fd();
        let mut s = Stream::new(Life::Fresh(u), Config::default());
        s.fd_flags = if type_ & libc::SOCK_CLOEXEC != 0 {
            libc::FD_CLOEXEC
        } else {
            0
        };
        s.fs_flags = if type_ & libc::SOCK_NONBLOCK != 0 {
            libc::O_NONBLOCK
        } else {
            0
        };
        insert(fd, s);
        fd
    })
}

fn insert(fd: c_int, s: Stream) {
    let r = Arc::new(Rsock {
        fd,
        s: Mutex::new(s),
        listener: Mutex::new(None),
    });
    table().insert(fd, r);
}

/// Check a socket address the program passed: its length covers its family's.
///
/// # Safety
/// `addr` points at `len` readable bytes or is null.
unsafe fn sockaddr_arg(
    addr: *const libc::sockaddr,
    len: libc::socklen_t,
) -> Result<std::net::SocketAddr, c_int> {
    if addr.is_null() || (len as usize) < std::mem::size_of::<libc::sa_family_t>() {
        return Err(libc::EINVAL);
    }
    // SAFETY: per the contract.
    let fam = c_int::from(unsafe { (*addr).sa_family });
    let need = match fam {
        libc::AF_INET => std::mem::size_of::<libc::sockaddr_in>(),
        libc::AF_INET6 => std::mem::size_of::<libc::sockaddr_in6>(),
        abi::AF_IB => std::mem::size_of::<abi::sockaddr_ib>(),
        _ => return Err(libc::EAFNOSUPPORT),
    };
    if (len as usize) < need {
        return Err(libc::EINVAL);
    }
    // SAFETY: `need` bytes of the family the address names are readable (checked).
    unsafe { sockaddr_from_c(addr) }?.ok_or(libc::EINVAL)
}

#[no_mangle]
pub unsafe extern "C" fn rbind(
    socket: c_int,
    addr: *const libc::sockaddr,
    addrlen: libc::socklen_t,
) -> c_int {
    guard(-1, || {
        let Some(rs) = lookup(socket) else {
            return minus_one(libc::EBADF);
        };
        // SAFETY: the caller passes `addrlen` bytes at `addr`.
        let a = match unsafe { sockaddr_arg(addr, addrlen) } {
            Ok(a) => a,
            Err(e) => return minus_one(e),
        };
        let mut g = match rs.open_lock() {
            Ok(g) => g,
            Err(e) => return minus_one(e),
        };
        let Life::Fresh(u) = &g.life else {
            return minus_one(libc::EINVAL);
        };
        match u.bind(a) {
            Ok(()) => {
                g.bound = true;
                0
            }
            Err(e) => minus_one(os(e)),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn rlisten(socket: c_int, backlog: c_int) -> c_int {
    guard(-1, || {
        let Some(rs) = lookup(socket) else {
            return minus_one(libc::EBADF);
        };
        ret(listen(&rs, backlog).map(|()| 0))
    })
}

fn listen(rs: &Arc<Rsock>, backlog: c_int) -> Result<(), c_int> {
    let mut g = rs.open_lock()?;
    match &g.life {
        Life::Listening(_) => return Ok(()),
        Life::Fresh(_) => {}
        _ => return Err(libc::EINVAL),
    }
    let mut q = [0 as c_int; 2];
    // SAFETY: an array of two fds.
    if unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
            0,
            q.as_mut_ptr(),
        )
    } != 0
    {
        return Err(crate::errno_now());
    }
    let close_q = || {
        // SAFETY: the fds just made, closed once.
        unsafe {
            libc::close(q[0]);
            libc::close(q[1]);
        }
    };
    let Life::Fresh(u) = std::mem::replace(&mut g.life, Life::Failed) else {
        unreachable!("matched above")
    };
    let l = match u.listen(backlog, g.cfg) {
        Ok(l) => Arc::new(l),
        Err((e, u)) => {
            g.life = Life::Fresh(u);
            close_q();
            return Err(os(e));
        }
    };
    if g.fs_flags & libc::O_NONBLOCK != 0 {
        set_nonblock(q[0], true);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let job = AcceptJob {
        listener: Arc::clone(&l),
        listen_fd: rs.fd,
        queue_wr: q[1],
        stop: Arc::clone(&stop),
    };
    let thread = std::thread::Builder::new()
        .name("rsocket-accept".into())
        .spawn(move || job.run());
    let Ok(thread) = thread else {
        close_q();
        // The listener goes; the socket is listening on nothing, as after a failure.
        return Err(libc::EAGAIN);
    };
    *rs.listener.lock().unwrap_or_else(|e| e.into_inner()) = Some(Listener {
        queue_rd: q[0],
        queue_wr: q[1],
        stop,
        thread: Some(thread),
    });
    g.life = Life::Listening(l);
    Ok(())
}

/// What a listener's accept thread needs (the sizes and flags an accepted socket
/// inherits are read from the listening socket at accept).
struct AcceptJob {
    listener: Arc<Accepting>,
    listen_fd: c_int,
    queue_wr: c_int,
    stop: Arc<AtomicBool>,
}

impl AcceptJob {
    /// The accept thread: the rsockets layer's listener answers each request at once
    /// and hands out a connection once it is established; each goes to the queue
    /// `raccept` reads. It never waits on one connection, so a request that never
    /// completes its handshake does not stall the others.
    fn run(self) {
        while !self.stop.load(Ordering::Acquire) {
            if let Ok(s) = self.listener.accept(Some(Duration::from_millis(50))) {
                self.queue(s);
            }
        }
    }

    /// Hand an established connection to `raccept`.
    fn queue(&self, sock: Socket) {
        let fd = sock.fds()[1].as_raw_fd();
        let (cfg, fs, fd_flags) = match lookup(self.listen_fd) {
            Some(l) => {
                let g = l.lock();
                (g.cfg, g.fs_flags, g.fd_flags)
            }
            None => return,
        };
        let mut s = Stream::new(Life::Open(Arc::new(sock)), cfg);
        (s.fs_flags, s.fd_flags) = (fs, fd_flags);
        insert(fd, s);
        let b = fd.to_ne_bytes();
        // SAFETY: our socket end; 4 bytes.
        let n = unsafe { libc::write(self.queue_wr, b.as_ptr().cast(), b.len()) };
        if n != b.len() as isize {
            close_socket(fd);
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn raccept(
    socket: c_int,
    addr: *mut libc::sockaddr,
    addrlen: *mut libc::socklen_t,
) -> c_int {
    guard(-1, || {
        let Some(rs) = lookup(socket) else {
            return minus_one(libc::EBADF);
        };
        let q = {
            let l = rs.listener.lock().unwrap_or_else(|e| e.into_inner());
            match l.as_ref() {
                Some(l) => l.queue_rd,
                None => return minus_one(libc::EBADF),
            }
        };
        let mut b = [0u8; 4];
        // SAFETY: our socket end, 4 bytes.
        let n = unsafe { libc::read(q, b.as_mut_ptr().cast(), 4) };
        if n != 4 {
            return if n < 0 { -1 } else { minus_one(libc::EBADF) };
        }
        let fd = c_int::from_ne_bytes(b);
        if !addr.is_null() && !addrlen.is_null() {
            // SAFETY: the caller's buffer and its length.
            unsafe { rgetpeername(fd, addr, addrlen) };
        }
        fd
    })
}

#[no_mangle]
pub unsafe extern "C" fn rconnect(
    socket: c_int,
    addr: *const libc::sockaddr,
    addrlen: libc::socklen_t,
) -> c_int {
    guard(-1, || {
        let Some(rs) = lookup(socket) else {
            return minus_one(libc::EBADF);
        };
        // SAFETY: the caller passes `addrlen` bytes at `addr`.
        let a = match unsafe { sockaddr_arg(addr, addrlen) } {
            Ok(a) => a,
            Err(e) => return minus_one(e),
        };
        ret(connect(&rs, Some(a)).map(|()| 0))
    })
}

fn nonblocking(s: &Stream, flags: c_int) -> bool {
    s.fs_flags & libc::O_NONBLOCK != 0 || flags & libc::MSG_DONTWAIT != 0
}

/// Where the bytes of a send come from: one buffer, or a list of them.
struct Source<'a> {
    iov: &'a [libc::iovec],
    i: usize,
    off: usize,
}

impl Source<'_> {
    /// Copy the next `n` bytes to `dst`.
    fn copy_to(&mut self, mut dst: *mut u8, mut n: usize) {
        while n > 0 && self.i < self.iov.len() {
            let v = &self.iov[self.i];
            let take = (v.iov_len - self.off).min(n);
            // SAFETY: the program's buffer holds `iov_len` bytes; `dst` has room for `n`.
            unsafe {
                std::ptr::copy_nonoverlapping(v.iov_base.cast::<u8>().add(self.off), dst, take);
                dst = dst.add(take);
            }
            n -= take;
            self.off += take;
            if self.off == v.iov_len {
                self.i += 1;
                self.off = 0;
            }
        }
    }
}

/// `rsend`/`rsendv`: the bytes of `iov` as data messages.
fn sendv(socket: c_int, iov: &[libc::iovec], flags: c_int) -> Result<isize, c_int> {
    let rs = lookup(socket).ok_or(libc::EBADF)?;
    let nb = nonblocking(&*rs.open_lock()?, flags);
    let sock = rs.conn()?;
    let total: usize = iov.iter().map(|v| v.iov_len).sum();
    let mut src = Source { iov, i: 0, off: 0 };
    let mut fill = |dst: &mut [u8]| src.copy_to(dst.as_mut_ptr(), dst.len());
    let n = sock.send_from(total, nb, &mut fill).map_err(os)?;
    Ok(n as isize)
}

#[no_mangle]
pub unsafe extern "C" fn rsend(
    socket: c_int,
    buf: *const c_void,
    len: usize,
    flags: c_int,
) -> isize {
    guard(-1, || {
        if buf.is_null() && len > 0 {
            return minus_one(libc::EFAULT) as isize;
        }
        let iov = [libc::iovec {
            iov_base: buf as *mut c_void,
            iov_len: len,
        }];
        ret_size(sendv(socket, &iov, flags))
    })
}

#[no_mangle]
pub unsafe extern "C" fn rwrite(socket: c_int, buf: *const c_void, count: usize) -> isize {
    // SAFETY: the caller's buffer, as for rsend.
    unsafe { rsend(socket, buf, count, 0) }
}

/// The program's iovec list as a slice.
///
/// # Safety
/// `iov` points at `n` iovecs (or `n` is 0).
unsafe fn iovecs<'a>(iov: *const libc::iovec, n: c_int) -> Result<&'a [libc::iovec], c_int> {
    if n < 0 || (n > 0 && iov.is_null()) {
        return Err(libc::EINVAL);
    }
    if n == 0 {
        return Ok(&[]);
    }
    // SAFETY: per the contract.
    Ok(unsafe { std::slice::from_raw_parts(iov, n as usize) })
}

#[no_mangle]
pub unsafe extern "C" fn rwritev(socket: c_int, iov: *const libc::iovec, iovcnt: c_int) -> isize {
    guard(-1, || {
        // SAFETY: the caller's list.
        let v = match unsafe { iovecs(iov, iovcnt) } {
            Ok(v) => v,
            Err(e) => return minus_one(e) as isize,
        };
        ret_size(sendv(socket, v, 0))
    })
}

#[no_mangle]
pub unsafe extern "C" fn rsendmsg(socket: c_int, msg: *const libc::msghdr, flags: c_int) -> isize {
    guard(-1, || {
        if msg.is_null() {
            return minus_one(libc::EINVAL) as isize;
        }
        // SAFETY: the caller's message header.
        let m = unsafe { &*msg };
        if !m.msg_control.is_null() && m.msg_controllen > 0 {
            return minus_one(libc::ENOTSUP) as isize;
        }
        // SAFETY: the header's list.
        let v = match unsafe { iovecs(m.msg_iov, m.msg_iovlen as c_int) } {
            Ok(v) => v,
            Err(e) => return minus_one(e) as isize,
        };
        ret_size(sendv(socket, v, flags))
    })
}

/// A stream socket has its peer: the address is ignored, as rsockets do.
#[no_mangle]
pub unsafe extern "C" fn rsendto(
    socket: c_int,
    buf: *const c_void,
    len: usize,
    flags: c_int,
    _dest: *const libc::sockaddr,
    _addrlen: libc::socklen_t,
) -> isize {
    // SAFETY: as for rsend.
    unsafe { rsend(socket, buf, len, flags) }
}

/// `rrecv`: the bytes received, in order; 0 once the peer has shut down or gone and all
/// is read. MSG_WAITALL waits for `len` bytes (fewer at the end of the stream).
fn recv(socket: c_int, buf: *mut u8, len: usize, flags: c_int) -> Result<isize, c_int> {
    let rs = lookup(socket).ok_or(libc::EBADF)?;
    let nb = nonblocking(&*rs.open_lock()?, flags);
    let sock = rs.conn()?;
    if len == 0 {
        return Ok(0);
    }
    // SAFETY: the caller's buffer of `len` bytes; nothing else uses it during the call.
    let dst = unsafe { std::slice::from_raw_parts_mut(buf, len) };
    let peek = flags & libc::MSG_PEEK != 0;
    let all = flags & libc::MSG_WAITALL != 0 && !peek;
    let mut got = 0;
    let mut err = None;
    while got < len {
        match sock.recv(&mut dst[got..], peek, nb) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) => {
                err = Some(os(e));
                break;
            }
        }
        if !all {
            break;
        }
    }
    partial_result(got, err).map(|n| n as isize)
}

#[no_mangle]
pub unsafe extern "C" fn rrecv(socket: c_int, buf: *mut c_void, len: usize, flags: c_int) -> isize {
    guard(-1, || {
        if buf.is_null() && len > 0 {
            return minus_one(libc::EFAULT) as isize;
        }
        ret_size(recv(socket, buf.cast(), len, flags))
    })
}

#[no_mangle]
pub unsafe extern "C" fn rread(socket: c_int, buf: *mut c_void, count: usize) -> isize {
    // SAFETY: as for rrecv.
    unsafe { rrecv(socket, buf, count, 0) }
}

/// Fills the first buffer only, as rsockets do.
#[no_mangle]
pub unsafe extern "C" fn rreadv(socket: c_int, iov: *const libc::iovec, iovcnt: c_int) -> isize {
    guard(-1, || {
        // SAFETY: the caller's list.
        let v = match unsafe { iovecs(iov, iovcnt) } {
            Ok(v) => v,
            Err(e) => return minus_one(e) as isize,
        };
        let Some(first) = v.first() else { return 0 };
        // SAFETY: the program's first buffer.
        unsafe { rrecv(socket, first.iov_base, first.iov_len, 0) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn rrecvmsg(socket: c_int, msg: *mut libc::msghdr, flags: c_int) -> isize {
    guard(-1, || {
        if msg.is_null() {
            return minus_one(libc::EINVAL) as isize;
        }
        // SAFETY: the caller's message header.
        let m = unsafe { &*msg };
        if !m.msg_control.is_null() && m.msg_controllen > 0 {
            return minus_one(libc::ENOTSUP) as isize;
        }
        // SAFETY: the header's list.
        let v = match unsafe { iovecs(m.msg_iov, m.msg_iovlen as c_int) } {
            Ok(v) => v,
            Err(e) => return minus_one(e) as isize,
        };
        let Some(first) = v.first() else { return 0 };
        // SAFETY: the program's first buffer.
        unsafe { rrecv(socket, first.iov_base, first.iov_len, flags) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn rrecvfrom(
    socket: c_int,
    buf: *mut c_void,
    len: usize,
    flags: c_int,
    src: *mut libc::sockaddr,
    addrlen: *mut libc::socklen_t,
) -> isize {
    // SAFETY: as for rrecv.
    let n = unsafe { rrecv(socket, buf, len, flags) };
    if n > 0 && !src.is_null() && !addrlen.is_null() {
        // SAFETY: the caller's buffer and its length.
        unsafe { rgetpeername(socket, src, addrlen) };
    }
    n
}

#[no_mangle]
pub unsafe extern "C" fn rshutdown(socket: c_int, how: c_int) -> c_int {
    guard(-1, || {
        let Some(rs) = lookup(socket) else {
            return minus_one(libc::EBADF);
        };
        ret(shutdown(&rs, how).map(|()| 0))
    })
}

fn shutdown(rs: &Rsock, how: c_int) -> Result<(), c_int> {
    if !(libc::SHUT_RD..=libc::SHUT_RDWR).contains(&how) {
        return Err(libc::EINVAL);
    }
    keepalive_remove(rs.fd);
    let Some(sock) = rs.open_lock()?.socket().cloned() else {
        return Ok(());
    };
    let how = match how {
        libc::SHUT_RDWR => How::Both,
        libc::SHUT_WR => How::Write,
        _ => How::Read,
    };
    sock.shutdown(how).map_err(os)
}

/// Close a socket: shut a connection down, stop a listener, free everything. A thread
/// still in a call on the socket holds its connection until that call returns; the
/// shutdown wakes it.
fn close_socket(fd: c_int) -> bool {
    let Some(rs) = lookup(fd) else { return false };
    if rs.lock().connected() {
        let _ = shutdown(&rs, libc::SHUT_RDWR);
    }
    keepalive_remove(fd);
    let l = rs.listener.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Some(mut l) = l {
        l.stop.store(true, Ordering::Release);
        if let Some(t) = l.thread.take() {
            let _ = t.join();
        }
        // Sockets accepted and never taken are closed with their listener.
        set_nonblock(l.queue_rd, true);
        let mut b = [0u8; 4];
        // SAFETY: our socket end, 4 bytes at a time.
        while unsafe { libc::read(l.queue_rd, b.as_mut_ptr().cast(), 4) } == 4 {
            close_socket(c_int::from_ne_bytes(b));
        }
        // SAFETY: our descriptors, closed once.
        unsafe {
            libc::close(l.queue_rd);
            libc::close(l.queue_wr);
        }
    }
    table().remove(&fd);
    let life = std::mem::replace(&mut rs.lock().life, Life::Closed);
    drop(life);
    true
}

#[no_mangle]
pub unsafe extern "C" fn rclose(socket: c_int) -> c_int {
    guard(-1, || {
        if close_socket(socket) {
            0
        } else {
            minus_one(libc::EBADF)
        }
    })
}

/// Copy a socket address out as getpeername(2) does (truncated to the caller's room).
///
/// # Safety
/// `addr` has `*len` writable bytes; `len` is valid.
unsafe fn copy_addr(
    src: &abi::rdma_sockaddr,
    addr: *mut libc::sockaddr,
    len: *mut libc::socklen_t,
) {
    // SAFETY: the union's family field is always initialised.
    let fam = c_int::from(unsafe { src.addr.sa_family });
    let size = if fam == libc::AF_INET {
        std::mem::size_of::<libc::sockaddr_in>()
    } else {
        std::mem::size_of::<libc::sockaddr_in6>()
    };
    // SAFETY: per the contract.
    unsafe {
        let n = size.min(*len as usize);
        std::ptr::copy_nonoverlapping(
            (src as *const abi::rdma_sockaddr).cast::<u8>(),
            addr.cast::<u8>(),
            n,
        );
        *len = size as libc::socklen_t;
    }
}

fn name(socket: c_int, addr: *mut libc::sockaddr, len: *mut libc::socklen_t, peer: bool) -> c_int {
    let Some(rs) = lookup(socket) else {
        return minus_one(libc::EBADF);
    };
    if addr.is_null() || len.is_null() {
        return minus_one(libc::EFAULT);
    }
    let g = match rs.open_lock() {
        Ok(g) => g,
        Err(e) => return minus_one(e),
    };
    let (src, dst) = g.addrs();
    let a = if peer { dst } else { src };
    let a = match a {
        Some(a) => a,
        None if peer => return minus_one(libc::ENOTCONN),
        // Not bound yet: the wildcard address, as getsockname(2) says.
        None => std::net::SocketAddr::from(([0, 0, 0, 0], 0)),
    };
    // SAFETY: the caller's buffer and length.
    unsafe { copy_addr(&sockaddr_to_c(a), addr, len) };
    0
}

#[no_mangle]
pub unsafe extern "C" fn rgetpeername(
    socket: c_int,
    addr: *mut libc::sockaddr,
    addrlen: *mut libc::socklen_t,
) -> c_int {
    guard(-1, || name(socket, addr, addrlen, true))
}

#[no_mangle]
pub unsafe extern "C" fn rgetsockname(
    socket: c_int,
    addr: *mut libc::sockaddr,
    addrlen: *mut libc::socklen_t,
) -> c_int {
    guard(-1, || name(socket, addr, addrlen, false))
}

/// Set an option of the socket's CM id, whatever its life (EINVAL when it has none).
fn set_id_option(g: &Stream, opt: IdOption) -> Result<(), c_int> {
    let r = match &g.life {
        Life::Fresh(u) => u.set_option(opt),
        Life::Connecting(c) => c.set_option(opt),
        Life::Open(s) => s.set_option(opt),
        Life::Listening(l) => l.set_option(opt),
        Life::Failed | Life::Closed => return Err(libc::EINVAL),
    };
    r.map_err(os)
}

/// A listener's sizes are those of the connections it accepts next.
fn listener_sizes(g: &Stream) {
    if let Life::Listening(l) = &g.life {
        l.set_config(g.cfg);
    }
}

/// Read an int option value.
///
/// # Safety
/// `v` points at `len` readable bytes.
unsafe fn opt_int(v: *const c_void, len: libc::socklen_t) -> Result<c_int, c_int> {
    if v.is_null() || (len as usize) < std::mem::size_of::<c_int>() {
        return Err(libc::EINVAL);
    }
    // SAFETY: per the contract.
    Ok(unsafe { v.cast::<c_int>().read_unaligned() })
}

#[no_mangle]
pub unsafe extern "C" fn rsetsockopt(
    socket: c_int,
    level: c_int,
    optname: c_int,
    optval: *const c_void,
    optlen: libc::socklen_t,
) -> c_int {
    guard(-1, || {
        let Some(rs) = lookup(socket) else {
            return minus_one(libc::EBADF);
        };
        // SAFETY: the caller passes `optlen` bytes at `optval`.
        ret(unsafe { setsockopt(&rs, level, optname, optval, optlen) }.map(|()| 0))
    })
}

/// # Safety
/// `optval` points at `optlen` readable bytes.
unsafe fn setsockopt(
    rs: &Rsock,
    level: c_int,
    optname: c_int,
    optval: *const c_void,
    optlen: libc::socklen_t,
) -> Result<(), c_int> {
    // SAFETY: per the contract.
    let int = || unsafe { opt_int(optval, optlen) };
    let mut g = rs.open_lock()?;
    let bit = |opts: &mut u64, on: bool| {
        if on {
            *opts |= 1 << optname;
        } else {
            *opts &= !(1 << optname);
        }
    };
    match (level, optname) {
        (libc::SOL_SOCKET, libc::SO_REUSEADDR) => {
            let v = int()?;
            // Once bound, a RoCE id's reuse cannot change; rsockets accept that quietly.
            let r = set_id_option(&g, IdOption::ReuseAddr(v != 0));
            if r.is_err() && matches!(g.life, Life::Fresh(_)) && !g.bound {
                return r;
            }
            bit(&mut g.so_opts, v != 0);
        }
        (libc::SOL_SOCKET, libc::SO_RCVBUF) => {
            let v = int()?;
            if g.before_connect() && v > 0 {
                g.cfg.rbuf_size = (v as u32).saturating_mul(2).min(1 << 28);
                listener_sizes(&g);
            }
        }
        (libc::SOL_SOCKET, libc::SO_SNDBUF) => {
            let v = int()?;
            if g.before_connect() && v > 0 {
                g.cfg.sbuf_size = (v as u32)
                    .saturating_mul(2)
                    .clamp(softrdma_rsocket::config::SNDLOWAT << 1, 1 << 28);
                listener_sizes(&g);
            }
        }
        (libc::SOL_SOCKET, libc::SO_LINGER) => {
            if optval.is_null() || (optlen as usize) < std::mem::size_of::<libc::linger>() {
                return Err(libc::EINVAL);
            }
            // SAFETY: checked above.
            let l = unsafe { optval.cast::<libc::linger>().read_unaligned() };
            // Stored inverted, so that the default (no bit) is on.
            bit(&mut g.so_opts, l.l_onoff == 0);
        }
        (libc::SOL_SOCKET, libc::SO_KEEPALIVE) => {
            let on = int()? != 0;
            if on && g.keepalive_time == 0 {
                g.keepalive_time = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_keepalive_time")
                    .ok()
                    .and_then(|s| s.trim().parse().ok())
                    .unwrap_or(7200);
            }
            bit(&mut g.so_opts, on);
            let t = g.keepalive_time;
            drop(g);
            if on {
                keepalive_add(rs.fd, t);
            } else {
                keepalive_remove(rs.fd);
            }
        }
        (libc::SOL_SOCKET, libc::SO_OOBINLINE) => {
            let v = int()?;
            bit(&mut g.so_opts, v != 0);
        }
        (libc::IPPROTO_IP, libc::IP_TOS) => {
            let v = int()?;
            set_id_option(&g, IdOption::Tos(v as u8))?;
            g.ipv4_tos = v;
        }
        (
            libc::IPPROTO_TCP,
            libc::TCP_KEEPCNT | libc::TCP_KEEPINTVL | libc::TCP_MAXSEG | libc::TCP_CONGESTION,
        ) => {
            // Not meaningful over a reliable connection; accepted as rsockets do.
        }
        (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE) => {
            let v = int()?;
            if v <= 0 {
                return Err(libc::EINVAL);
            }
            g.keepalive_time = v as u32;
            let on = g.so_opts & (1 << libc::SO_KEEPALIVE) != 0;
            drop(g);
            if on {
                keepalive_add(rs.fd, v as u32);
            }
        }
        (libc::IPPROTO_TCP, libc::TCP_NODELAY) => {
            // Every send goes out at once: there is no delay to turn off.
            let v = int()?;
            bit(&mut g.tcp_opts, v != 0);
        }
        (libc::IPPROTO_IPV6, libc::IPV6_V6ONLY) => {
            let v = int()?;
            set_id_option(&g, IdOption::AfOnly(v != 0))?;
            bit(&mut g.ipv6_opts, v != 0);
        }
        (SOL_RDMA, _) => {
            if !g.before_connect() {
                return Err(libc::EINVAL);
            }
            match optname {
                RDMA_SQSIZE => g.cfg.sq_size = int()?.clamp(0, 0xFFFE) as u16,
                RDMA_RQSIZE => g.cfg.rq_size = int()?.clamp(0, 0xFFFE) as u16,
                RDMA_INLINE => g.cfg.sq_inline = int()?.clamp(0, 0xFFFE) as u32,
                RDMA_IOMAPSIZE => {
                    let v = int()?.clamp(0, 1 << 16) as u32;
                    g.cfg.iomap_size = softrdma_rsocket::config::carried_iomap_size(v);
                }
                RDMA_ROUTE => {
                    if optval.is_null() || optlen == 0 {
                        return Err(libc::EINVAL);
                    }
                    // SAFETY: per the contract.
                    let v =
                        unsafe { std::slice::from_raw_parts(optval.cast::<u8>(), optlen as usize) };
                    g.route = Some(v.to_vec());
                }
                _ => return Err(libc::ENOTSUP),
            }
            listener_sizes(&g);
        }
        _ => return Err(libc::ENOTSUP),
    }
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn rgetsockopt(
    socket: c_int,
    level: c_int,
    optname: c_int,
    optval: *mut c_void,
    optlen: *mut libc::socklen_t,
) -> c_int {
    guard(-1, || {
        let Some(rs) = lookup(socket) else {
            return minus_one(libc::EBADF);
        };
        if optval.is_null() || optlen.is_null() {
            return minus_one(libc::EFAULT);
        }
        // SAFETY: the caller passes `*optlen` writable bytes at `optval`.
        ret(unsafe { getsockopt(&rs, level, optname, optval, optlen) }.map(|()| 0))
    })
}

/// # Safety
/// `optval` has `*optlen` writable bytes.
unsafe fn getsockopt(
    rs: &Rsock,
    level: c_int,
    optname: c_int,
    optval: *mut c_void,
    optlen: *mut libc::socklen_t,
) -> Result<(), c_int> {
    // SAFETY: per the contract.
    let room = unsafe { *optlen } as usize;
    let put_int = |v: c_int| -> Result<(), c_int> {
        if room < std::mem::size_of::<c_int>() {
            return Err(libc::EINVAL);
        }
        // SAFETY: room checked.
        unsafe {
            optval.cast::<c_int>().write_unaligned(v);
            *optlen = std::mem::size_of::<c_int>() as libc::socklen_t;
        }
        Ok(())
    };
    let mut g = rs.open_lock()?;
    let has = |opts: u64| c_int::from(opts & (1 << optname) != 0);
    match (level, optname) {
        (libc::SOL_SOCKET, libc::SO_REUSEADDR | libc::SO_KEEPALIVE | libc::SO_OOBINLINE) => {
            put_int(has(g.so_opts))
        }
        (libc::SOL_SOCKET, libc::SO_RCVBUF) => put_int(g.cfg.rbuf_size as c_int),
        (libc::SOL_SOCKET, libc::SO_SNDBUF) => put_int(g.cfg.sbuf_size as c_int),
        (libc::SOL_SOCKET, libc::SO_LINGER) => {
            if room < std::mem::size_of::<libc::linger>() {
                return Err(libc::EINVAL);
            }
            let l = libc::linger {
                l_onoff: 1 - has(g.so_opts),
                l_linger: 0,
            };
            // SAFETY: room checked.
            unsafe {
                optval.cast::<libc::linger>().write_unaligned(l);
                *optlen = std::mem::size_of::<libc::linger>() as libc::socklen_t;
            }
            Ok(())
        }
        (libc::SOL_SOCKET, libc::SO_ERROR) => put_int(g.take_error()),
        (libc::SOL_SOCKET, libc::SO_TYPE) => put_int(libc::SOCK_STREAM),
        (libc::IPPROTO_IP, libc::IP_TOS) => put_int(g.ipv4_tos),
        (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE) => put_int(g.keepalive_time as c_int),
        (libc::IPPROTO_TCP, libc::TCP_NODELAY) => put_int(has(g.tcp_opts)),
        // Not meaningful over a reliable connection: 1, as rsockets answer.
        (libc::IPPROTO_TCP, libc::TCP_KEEPCNT | libc::TCP_KEEPINTVL) => put_int(1),
        (libc::IPPROTO_TCP, libc::TCP_INFO) => {
            // Programs built against older headers pass a smaller struct: they get its
            // prefix, as from Linux.
            let n = std::mem::size_of::<libc::tcp_info>().min(room);
            // The connection's state and its send queue depth as the congestion window,
            // the rest zero, as rsockets report.
            // SAFETY: tcp_info is plain integers; all-zero is valid.
            let mut t: libc::tcp_info = unsafe { std::mem::zeroed() };
            t.tcpi_state = if g.connected() {
                1 // TCP_ESTABLISHED
            } else {
                7 // TCP_CLOSE
            };
            t.tcpi_snd_cwnd = u32::from(g.cfg.sq_size);
            // SAFETY: `n` is within both the caller's room and `t`.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (&t as *const libc::tcp_info).cast::<u8>(),
                    optval.cast::<u8>(),
                    n,
                );
                *optlen = n as libc::socklen_t;
            }
            Ok(())
        }
        (libc::IPPROTO_TCP, libc::TCP_MAXSEG) => {
            let mss = g
                .socket()
                .and_then(|s| s.path_mtu())
                .map_or(2048, |m| m.bytes() as c_int);
            put_int(mss)
        }
        (libc::IPPROTO_IPV6, libc::IPV6_V6ONLY) => put_int(has(g.ipv6_opts)),
        (SOL_RDMA, RDMA_SQSIZE) => put_int(c_int::from(g.cfg.sq_size)),
        (SOL_RDMA, RDMA_RQSIZE) => put_int(c_int::from(g.cfg.rq_size)),
        (SOL_RDMA, RDMA_INLINE) => put_int(g.cfg.sq_inline as c_int),
        (SOL_RDMA, RDMA_IOMAPSIZE) => put_int(c_int::from(g.cfg.iomap_size)),
        _ => Err(libc::ENOTSUP),
    }
}

/// `rfcntl(socket, cmd, ...)`: F_GETFL, F_SETFL (O_NONBLOCK), F_GETFD, F_SETFD.
///
/// C declares it variadic; Rust cannot define a variadic function on stable, so the
/// optional argument is taken as a third `int` parameter: on the x86-64 and AArch64
/// Linux calling conventions a variadic `int` arrives where a fixed one does, and the
/// commands that pass none never read it.
#[no_mangle]
pub unsafe extern "C" fn rfcntl(socket: c_int, cmd: c_int, arg: c_int) -> c_int {
    guard(-1, || {
        let Some(rs) = lookup(socket) else {
            return minus_one(libc::EBADF);
        };
        let mut g = match rs.open_lock() {
            Ok(g) => g,
            Err(e) => return minus_one(e),
        };
        match cmd {
            libc::F_GETFL => g.fs_flags,
            libc::F_SETFL => {
                let on = arg & libc::O_NONBLOCK != 0;
                if (g.fs_flags & libc::O_NONBLOCK != 0) != on {
                    if let Some(l) = rs
                        .listener
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .as_ref()
                    {
                        set_nonblock(l.queue_rd, on);
                    }
                }
                g.fs_flags = arg;
                0
            }
            libc::F_GETFD => g.fd_flags,
            libc::F_SETFD => {
                g.fd_flags = arg;
                0
            }
            _ => minus_one(libc::ENOTSUP),
        }
    })
}

/// Register `buf` for the peer's direct writes at `offset` (-1: the buffer's address),
/// or, without PROT_WRITE, for local use; the offer goes out with the next send.
#[no_mangle]
pub unsafe extern "C" fn riomap(
    socket: c_int,
    buf: *mut c_void,
    len: usize,
    prot: c_int,
    _flags: c_int,
    offset: libc::off_t,
) -> libc::off_t {
    guard(-1, || {
        let Some(rs) = lookup(socket) else {
            return minus_one(libc::EBADF) as libc::off_t;
        };
        let sock = match rs.lock().socket().cloned() {
            Some(s) if prot & !(libc::PROT_WRITE | libc::PROT_NONE) == 0 => s,
            _ => return minus_one(libc::EINVAL) as libc::off_t,
        };
        let at = (offset != -1).then_some(offset as u64);
        // SAFETY: `riomap`'s contract: the program keeps the buffer until `riounmap`
        // or `rclose`.
        match unsafe { sock.iomap(buf.cast(), len, at, prot & libc::PROT_WRITE != 0) } {
            Ok(off) => off as libc::off_t,
            Err(e) => minus_one(os(e)) as libc::off_t,
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn riounmap(socket: c_int, buf: *mut c_void, len: usize) -> c_int {
    guard(-1, || {
        let Some(rs) = lookup(socket) else {
            return minus_one(libc::EBADF);
        };
        let Some(sock) = rs.lock().socket().cloned() else {
            return minus_one(libc::EINVAL);
        };
        ret(sock.iounmap(buf.cast(), len).map(|()| 0).map_err(os))
    })
}

/// Write `count` bytes straight into the peer's region mapped at `offset`: no receive
/// on the peer's side. Returns the bytes written (short when the range leaves the
/// peer's mappings).
#[no_mangle]
pub unsafe extern "C" fn riowrite(
    socket: c_int,
    buf: *const c_void,
    count: usize,
    offset: libc::off_t,
    flags: c_int,
) -> usize {
    guard(usize::MAX, || {
        if buf.is_null() && count > 0 {
            return minus_one(libc::EFAULT) as usize;
        }
        let r = (|| {
            let rs = lookup(socket).ok_or(libc::EBADF)?;
            let nb = nonblocking(&*rs.open_lock()?, flags);
            let sock = rs.conn()?;
            let data: &[u8] = if count == 0 {
                &[]
            } else {
                // SAFETY: the caller's buffer of `count` bytes.
                unsafe { std::slice::from_raw_parts(buf.cast(), count) }
            };
            sock.iowrite(data, offset as u64, nb).map_err(os)
        })();
        match r {
            Ok(n) => n,
            Err(e) => minus_one(e) as usize,
        }
    })
}

/// Sockets with keepalives on: the next time each is due.
static KEEPALIVE: Mutex<BTreeMap<c_int, (Instant, u32)>> = Mutex::new(BTreeMap::new());
static KEEPALIVE_THREAD: Mutex<bool> = Mutex::new(false);

fn keepalives() -> MutexGuard<'static, BTreeMap<c_int, (Instant, u32)>> {
    KEEPALIVE.lock().unwrap_or_else(|e| e.into_inner())
}

fn keepalive_add(fd: c_int, secs: u32) {
    let secs = secs.max(1);
    keepalives().insert(
        fd,
        (Instant::now() + Duration::from_secs(u64::from(secs)), secs),
    );
    let mut running = KEEPALIVE_THREAD.lock().unwrap_or_else(|e| e.into_inner());
    if !*running {
        let ok = std::thread::Builder::new()
            .name("rsocket-keepalive".into())
            .spawn(keepalive_run)
            .is_ok();
        *running = ok;
    }
}

fn keepalive_remove(fd: c_int) {
    keepalives().remove(&fd);
}

/// Send each due socket a keepalive (a zero-length RDMA WRITE, which a peer that is
/// gone fails with an error completion); runs while any socket has keepalives on.
fn keepalive_run() {
    loop {
        let now = Instant::now();
        let mut due = Vec::new();
        let next = {
            let mut k = keepalives();
            if k.is_empty() {
                *KEEPALIVE_THREAD.lock().unwrap_or_else(|e| e.into_inner()) = false;
                return;
            }
            for (fd, (at, secs)) in k.iter_mut() {
                if *at <= now {
                    due.push(*fd);
                    *at = now + Duration::from_secs(u64::from(*secs));
                }
            }
            k.values()
                .map(|(at, _)| *at)
                .min()
                .unwrap_or(now + Duration::from_secs(1))
        };
        for fd in due {
            if let Some(sock) = lookup(fd).and_then(|rs| rs.lock().socket().cloned()) {
                sock.keepalive();
            }
        }
        std::thread::sleep(
            next.saturating_duration_since(Instant::now())
                .min(Duration::from_secs(1)),
        );
    }
}
