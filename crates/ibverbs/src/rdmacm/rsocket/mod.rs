//! rsockets: librdmacm's socket calls over RDMA (`<rdma/rsocket.h>`): `rsocket`,
//! `rbind`, `rlisten`, `raccept`, `rconnect`, `rsend`/`rrecv` and their variants,
//! `rpoll`/`rselect`, `rshutdown`, `rclose`, socket options, `rfcntl`, and the direct
//! writes `riomap`/`riounmap`/`riowrite`. They let rdmacm-utils' `rstream`, `rcopy` and
//! `riostream`, and socket programs preloaded with rsockets, run on softrdma, and talk
//! to rdma-core's rsockets on another host.
//!
//! The protocol is the `softrdma-rsocket` crate's, which the Rust face uses too; this
//! face keeps the socket table, the options, the errno and the connection steps through
//! its own rdma_cm calls ([`stream`] drives the protocol over the socket's C objects).
//!
//! A stream rsocket is an RC connection made through this library's rdma_cm with a
//! synchronous id, as rdma-core makes it: the socket's number is the id's event channel
//! fd (a real descriptor, so it never collides with the program's others). Datagram
//! rsockets (`SOCK_DGRAM`, over UD with a UDP side channel) are not supported:
//! `rsocket` fails with ENOTSUP for them, as it does for any type it does not serve.
//!
//! Waiting: a blocking call polls the socket's completion channel and its CM channel
//! (a peer's disconnect wakes it); several threads may wait on one socket (each wait is
//! bounded, so none sleeps through an event another thread took).

mod poll;
mod stream;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::ffi::{c_int, c_void};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use self::stream::{Stage, Stream};
use super::abi;
use super::id as cmid;
use crate::{guard, minus_one, mr, sys};
use softrdma_rsocket::conn::{partial_result, Shutdown as How, TransferSizes};
use softrdma_rsocket::Config;

// The entry points `rpoll` and `rselect` live in `poll`.

/// `SOL_RDMA` and its options (`<rdma/rsocket.h>`).
const SOL_RDMA: c_int = 0x10000;
const RDMA_SQSIZE: c_int = 0;
const RDMA_RQSIZE: c_int = 1;
const RDMA_INLINE: c_int = 2;
const RDMA_IOMAPSIZE: c_int = 3;
const RDMA_ROUTE: c_int = 4;
/// How many times address and route resolution are retried after a timeout.
const CONN_RETRIES: u32 = 6;
/// The longest one wait sleeps before looking again (see the module comment): rsockets'
/// `wake_up_interval`, 500 ms unless set in their configuration directory.
fn wait_slice_ms() -> c_int {
    static V: std::sync::OnceLock<c_int> = std::sync::OnceLock::new();
    *V.get_or_init(|| {
        softrdma_rsocket::config::conf_value("wake_up_interval")
            .map_or(500, |v| v.clamp(1, 60_000) as c_int)
    })
}

/// How long a call polls before it sleeps: rsockets' `polling_time`, 10 µs unless set.
fn spin() -> Duration {
    static V: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *V.get_or_init(|| {
        Duration::from_micros(u64::from(
            softrdma_rsocket::config::conf_value("polling_time")
                .unwrap_or(10)
                .min(1_000_000),
        ))
    })
}

/// A listening socket's accept queue and the thread that accepts for it.
struct Listener {
    /// Accepted sockets' numbers, 4 bytes each: read by `raccept`, polled by `rpoll`.
    queue_rd: c_int,
    queue_wr: c_int,
    /// Written to stop the thread.
    stop_wr: c_int,
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

type Test = fn(&Stream) -> bool;

fn conn_have_rdata(s: &Stream) -> bool {
    s.have_rdata() || !s.readable()
}
fn conn_can_send(s: &Stream) -> bool {
    s.can_send() || !s.writable()
}
fn conn_can_send_ctrl(s: &Stream) -> bool {
    s.ctrl_avail() || !s.connected()
}
fn conn_all_sends_done(s: &Stream) -> bool {
    s.all_sends_done()
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

    /// rsockets' `rs_get_comp`: take completions (and send credits) until `test` holds,
    /// waiting unless `nonblock` (then EWOULDBLOCK).
    fn get_comp<'a>(
        &'a self,
        mut g: MutexGuard<'a, Stream>,
        nonblock: bool,
        test: Test,
    ) -> (MutexGuard<'a, Stream>, Result<(), c_int>) {
        let start = Instant::now();
        loop {
            g.update_credits();
            let r = g.poll_cq();
            g.update_credits();
            if test(&g) {
                return (g, Ok(()));
            }
            if let Err(e) = r {
                return (g, Err(e));
            }
            if nonblock {
                return (g, Err(libc::EWOULDBLOCK));
            }
            if start.elapsed() < spin() {
                continue;
            }
            if !g.has_ep() {
                return (g, Err(libc::ENOTCONN));
            }
            if !g.cq_armed {
                g.arm();
                continue;
            }
            let fds = [g.comp_fd().unwrap_or(-1), g.cm_fd()];
            drop(g);
            let ready = wait_readable(&fds, wait_slice_ms());
            g = self.lock();
            if g.closed() {
                // Another thread closed the socket while this one waited.
                return (g, Err(libc::EBADF));
            }
            if ready[0] {
                g.take_cq_event();
            }
            if ready[1] {
                g.take_cm_event();
            }
        }
    }
}

/// Resolve, route and connect (`rs_do_connect`), as far as the id's channel lets a
/// non-blocking socket go: Err(EINPROGRESS) while under way.
fn do_connect(s: &mut Stream, dst: Option<&[u8]>) -> Result<(), c_int> {
    let r = connect_steps(s, dst);
    match r {
        Ok(()) => Ok(()),
        Err(e) if e == libc::EAGAIN || e == libc::EWOULDBLOCK => Err(libc::EINPROGRESS),
        Err(e) if s.opening() || s.stage <= Stage::Bound => {
            s.stage = Stage::ConnectError;
            s.err = e;
            Err(e)
        }
        Err(e) => Err(e),
    }
}

fn errno_of(rc: c_int) -> Result<(), c_int> {
    if rc == 0 {
        Ok(())
    } else {
        Err(crate::errno_now())
    }
}

fn connect_steps(s: &mut Stream, dst: Option<&[u8]>) -> Result<(), c_int> {
    let id = s.id;
    loop {
        match s.stage {
            Stage::Init | Stage::Bound => {
                let Some(dst) = dst else {
                    return Err(libc::EINVAL);
                };
                s.stage = Stage::ResolvingAddr;
                let to = 1000 << s.retries.min(10);
                s.retries += 1;
                // SAFETY: the live id; `dst` holds a socket address (rconnect checked).
                let rc = unsafe {
                    cmid::rdma_resolve_addr(id, std::ptr::null_mut(), dst.as_ptr() as *mut _, to)
                };
                errno_of(rc)?;
                if start_route(s)? {
                    return finish_connect(s);
                }
            }
            Stage::ResolvingAddr => {
                // SAFETY: the live synchronous id.
                match errno_of(unsafe { cmid::complete(id) }) {
                    Ok(()) => {
                        if start_route(s)? {
                            return finish_connect(s);
                        }
                    }
                    Err(libc::ETIMEDOUT) if s.retries <= CONN_RETRIES => s.stage = Stage::Bound,
                    Err(e) => return Err(e),
                }
            }
            Stage::ResolvingRoute => {
                // SAFETY: the live synchronous id.
                errno_of(unsafe { cmid::complete(id) })?;
                send_request(s)?;
                return finish_connect(s);
            }
            Stage::Connecting => {
                // SAFETY: the live synchronous id.
                errno_of(unsafe { cmid::complete(id) })?;
                return finish_connect(s);
            }
            Stage::Accepting => {
                // SAFETY: as above.
                errno_of(unsafe { cmid::complete(id) })?;
                s.stage = Stage::Open;
                return Ok(());
            }
            Stage::ConnectError => return Err(libc::ENOTCONN),
            Stage::Open => {
                return if s.connected() {
                    Ok(())
                } else {
                    Err(libc::ENOTCONN)
                }
            }
            Stage::Listening => return Err(libc::EINVAL),
        }
    }
}

/// The address is resolved: resolve the route (or take the one RDMA_ROUTE gave), and
/// when that is done at once, send the request (true).
fn start_route(s: &mut Stream) -> Result<bool, c_int> {
    let id = s.id;
    s.retries = 0;
    s.stage = Stage::ResolvingRoute;
    if let Some(route) = s.route.take() {
        // SAFETY: the live id; `route` holds the program's path records.
        let rc = unsafe {
            cmid::rdma_set_option(
                id,
                abi::RDMA_OPTION_IB,
                abi::RDMA_OPTION_IB_PATH,
                route.as_ptr() as *mut c_void,
                route.len(),
            )
        };
        // The route's event comes as resolving one's does.
        return errno_of(rc).map(|()| false);
    }
    // SAFETY: the live id.
    errno_of(unsafe { cmid::rdma_resolve_route(id, 1000) })?;
    send_request(s).map(|()| true)
}

/// The route is resolved: make the QP and buffers and send the request with this side's
/// connection data.
fn send_request(s: &mut Stream) -> Result<(), c_int> {
    s.create_ep()?;
    let cd = s.format_conn_data();
    let mut p: abi::rdma_conn_param = crate::zeroed();
    p.private_data = cd.as_ptr().cast();
    p.private_data_len = cd.len() as u8;
    p.flow_control = softrdma_rsocket::config::CONNECT_FLOW_CONTROL;
    p.retry_count = softrdma_rsocket::config::CONNECT_RETRY;
    p.rnr_retry_count = softrdma_rsocket::config::CONNECT_RNR_RETRY;
    s.stage = Stage::Connecting;
    // SAFETY: the live id; `p` and `cd` live across the call.
    errno_of(unsafe { cmid::rdma_connect(s.id, &mut p) })?;
    Ok(())
}

/// The connection is established: take the peer's connection data.
fn finish_connect(s: &mut Stream) -> Result<(), c_int> {
    // SAFETY: the live synchronous id; its pending event is the ESTABLISHED that
    // `complete` took, whose private data lives until the event is acknowledged.
    let data = unsafe {
        let ev = (*s.id).event;
        if ev.is_null() {
            return Err(libc::EPROTO);
        }
        let c = (*ev).param.conn;
        if c.private_data.is_null() {
            Vec::new()
        } else {
            std::slice::from_raw_parts(c.private_data.cast::<u8>(), usize::from(c.private_data_len))
                .to_vec()
        }
    };
    s.save_conn_data(&data).map_err(|_| libc::ENOTSUP)?;
    s.stage = Stage::Open;
    // From here only this library reads the channel (disconnects), without blocking.
    set_nonblock(s.cm_fd(), true);
    Ok(())
}

/// Run an entry point: its value, or -1 with errno.
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
        let mut id = std::ptr::null_mut();
        // SAFETY: NULL channel: the id gets its own (synchronous), as rsockets use.
        let rc = unsafe {
            cmid::rdma_create_id(
                std::ptr::null_mut(),
                &mut id,
                std::ptr::null_mut(),
                abi::RDMA_PS_TCP,
            )
        };
        if rc != 0 {
            return -1;
        }
        let mut s = Stream::new(id, Config::default());
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
        // SAFETY: the id just made; its address family is what rsockets record.
        unsafe { (*id).route.addr.src.addr.sa_family = domain as libc::sa_family_t };
        let fd = s.cm_fd();
        if s.fs_flags & libc::O_NONBLOCK != 0 {
            set_nonblock(fd, true);
        }
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
unsafe fn sockaddr_bytes(
    addr: *const libc::sockaddr,
    len: libc::socklen_t,
) -> Result<Vec<u8>, c_int> {
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
    let mut v = vec![0u8; std::mem::size_of::<libc::sockaddr_storage>()];
    // SAFETY: `need` bytes are readable at `addr` (checked), `v` is larger.
    unsafe { std::ptr::copy_nonoverlapping(addr.cast::<u8>(), v.as_mut_ptr(), need) };
    Ok(v)
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
        let a = match unsafe { sockaddr_bytes(addr, addrlen) } {
            Ok(a) => a,
            Err(e) => return minus_one(e),
        };
        let mut g = match rs.open_lock() {
            Ok(g) => g,
            Err(e) => return minus_one(e),
        };
        // SAFETY: the socket's live id; `a` holds the address.
        let rc = unsafe { cmid::rdma_bind_addr(g.id, a.as_ptr() as *mut libc::sockaddr as *mut _) };
        if rc == 0 {
            g.stage = Stage::Bound;
        }
        rc
    })
}

#[no_mangle]
pub unsafe extern "C" fn rlisten(socket: c_int, backlog: c_int) -> c_int {
    guard(-1, || {
        let Some(rs) = lookup(socket) else {
            return minus_one(libc::EBADF);
        };
        let mut g = match rs.open_lock() {
            Ok(g) => g,
            Err(e) => return minus_one(e),
        };
        if g.stage == Stage::Listening {
            return 0;
        }
        // SAFETY: the socket's live id.
        if unsafe { cmid::rdma_listen(g.id, backlog) } != 0 {
            return -1;
        }
        let mut q = [0 as c_int; 2];
        let mut stop = [0 as c_int; 2];
        // SAFETY: arrays of two fds each.
        let ok = unsafe {
            libc::socketpair(
                libc::AF_UNIX,
                libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
                0,
                q.as_mut_ptr(),
            ) == 0
                && libc::pipe2(stop.as_mut_ptr(), libc::O_CLOEXEC) == 0
        };
        if !ok {
            return -1;
        }
        if g.fs_flags & libc::O_NONBLOCK != 0 {
            set_nonblock(q[0], true);
        }
        set_nonblock(g.cm_fd(), true);
        let job = AcceptJob {
            listen: g.id as usize,
            listen_fd: rs.fd,
            queue_wr: q[1],
            stop_rd: stop[0],
        };
        let thread = std::thread::Builder::new()
            .name("rsocket-accept".into())
            .spawn(move || job.run());
        let thread = match thread {
            Ok(t) => t,
            Err(_) => {
                // SAFETY: the fds just made.
                unsafe {
                    libc::close(q[0]);
                    libc::close(q[1]);
                    libc::close(stop[0]);
                    libc::close(stop[1]);
                }
                return minus_one(libc::EAGAIN);
            }
        };
        *rs.listener.lock().unwrap_or_else(|e| e.into_inner()) = Some(Listener {
            queue_rd: q[0],
            queue_wr: q[1],
            stop_wr: stop[1],
            thread: Some(thread),
        });
        g.stage = Stage::Listening;
        0
    })
}

/// Connections a listener has answered and waits to see established, at most, and how
/// long each may wait for its RTU: the rsockets layer's bounds, the same for every face.
const ACCEPT_PENDING_MAX: usize = softrdma_rsocket::Listener::MAX_ANSWERED;
const ACCEPT_WAIT: Duration = softrdma_rsocket::Listener::ANSWER_WAIT;

/// A connection the accept thread answered and waits for: it reaches `raccept` once the
/// CM says it is established.
struct Answered {
    s: Stream,
    since: Instant,
}

/// What a listener's accept thread needs (the listener's id is used by it alone; the
/// sizes and flags an accepted socket inherits are read from the listener at accept).
struct AcceptJob {
    listen: usize,
    listen_fd: c_int,
    queue_wr: c_int,
    stop_rd: c_int,
}

/// Refuse a connection the accept thread will not hand out and free it.
fn drop_answered(mut s: Stream) {
    // SAFETY: the socket's live id, never handed out (a REJ where the CM still can send
    // one; destroying the id ends the rest).
    unsafe { cmid::rdma_reject(s.id, std::ptr::null(), 0) };
    s.free();
}

impl AcceptJob {
    /// The accept thread: answer each request at once, and queue a connection for
    /// `raccept` when it is established. It never waits on one connection (rdma-core's
    /// waits in `rdma_accept` for the RTU, so one request that never completes its
    /// handshake stalls the listener until the REP times out, which its requester sets).
    fn run(self) {
        let lid = self.listen as *mut abi::rdma_cm_id;
        // SAFETY: the listener's id lives until this thread is joined (rclose).
        let chan = unsafe { (*(*lid).channel).fd };
        let mut answered: Vec<Answered> = Vec::new();
        loop {
            let mut fds = vec![chan, self.stop_rd];
            fds.extend(answered.iter().map(|a| a.s.cm_fd()));
            let wait = answered
                .iter()
                .map(|a| ACCEPT_WAIT.saturating_sub(a.since.elapsed()))
                .min()
                .map_or(-1, |d| d.as_millis().min(60_000) as c_int + 1);
            let r = wait_readable(&fds, wait);
            if r[1] {
                for a in answered.drain(..) {
                    drop_answered(a.s);
                }
                // SAFETY: our pipe end.
                unsafe { libc::close(self.stop_rd) };
                return;
            }
            // Established, refused or timed out: those whose channel has an event.
            let mut i = answered.len();
            while i > 0 {
                i -= 1;
                if r[2 + i] {
                    if let Some(s) = self.settle(&mut answered, i) {
                        self.queue(s);
                    }
                } else if answered[i].since.elapsed() >= ACCEPT_WAIT {
                    drop_answered(answered.swap_remove(i).s);
                }
            }
            if r[0] {
                // SAFETY: as above.
                if let Some(s) = unsafe { self.accept_one(lid) } {
                    if s.stage == Stage::Open {
                        self.queue(s);
                    } else {
                        if answered.len() >= ACCEPT_PENDING_MAX {
                            let oldest = (0..answered.len())
                                .min_by_key(|&k| answered[k].since)
                                .unwrap_or(0);
                            drop_answered(answered.swap_remove(oldest).s);
                        }
                        answered.push(Answered {
                            s,
                            since: Instant::now(),
                        });
                    }
                }
            }
        }
    }

    /// Take the event of answered connection `i`: Some(socket) once it is established
    /// (taken out of `answered`); a failure (REJECTED, UNREACHABLE, a timeout, a
    /// disconnect) frees it; no event yet leaves it.
    fn settle(&self, answered: &mut Vec<Answered>, i: usize) -> Option<Stream> {
        let id = answered[i].s.id;
        // SAFETY: the socket's live synchronous id; its channel is non-blocking.
        let rc = unsafe { cmid::complete(id) };
        if rc != 0 {
            let e = crate::errno_now();
            if e != libc::EAGAIN && e != libc::EWOULDBLOCK {
                drop_answered(answered.swap_remove(i).s);
            }
            return None;
        }
        // SAFETY: `complete` left the event it took on the id.
        let established = unsafe {
            let ev = (*id).event;
            !ev.is_null() && (*ev).event == abi::RDMA_CM_EVENT_ESTABLISHED
        };
        let mut a = answered.swap_remove(i);
        if !established {
            drop_answered(a.s);
            return None;
        }
        a.s.stage = Stage::Open;
        Some(a.s)
    }

    /// Hand an established socket to `raccept`.
    fn queue(&self, s: Stream) {
        let fd = s.cm_fd();
        insert(fd, s);
        let b = fd.to_ne_bytes();
        // SAFETY: our socket end; 4 bytes.
        let n = unsafe { libc::write(self.queue_wr, b.as_ptr().cast(), b.len()) };
        if n != b.len() as isize {
            close_socket(fd);
        }
    }

    /// rsockets' `rs_accept`: take a request, make the socket's QP and buffers, and
    /// answer with this side's connection data without waiting for the RTU: the socket,
    /// connected if its ESTABLISHED came already, else accepting.
    ///
    /// # Safety
    /// `lid` is the live listening id.
    unsafe fn accept_one(&self, lid: *mut abi::rdma_cm_id) -> Option<Stream> {
        let mut nid = std::ptr::null_mut();
        // SAFETY: per the contract; the listener's channel is non-blocking.
        if unsafe { super::qp::rdma_get_request(lid, &mut nid) } != 0 {
            return None;
        }
        let reject = |nid: *mut abi::rdma_cm_id| {
            // SAFETY: the new id, never handed out.
            unsafe {
                cmid::rdma_reject(nid, std::ptr::null(), 0);
            }
        };
        // SAFETY: the new id's pending event is its CONNECT_REQUEST.
        let (data, mut param) = unsafe {
            let c = (*(*nid).event).param.conn;
            let d = if c.private_data.is_null() {
                Vec::new()
            } else {
                std::slice::from_raw_parts(
                    c.private_data.cast::<u8>(),
                    usize::from(c.private_data_len),
                )
                .to_vec()
            };
            (d, c)
        };
        let Some(l) = lookup(self.listen_fd) else {
            reject(nid);
            // SAFETY: the new id, never handed out.
            unsafe { cmid::rdma_destroy_id(nid) };
            return None;
        };
        let (cfg, fs, fd_flags) = {
            let g = l.lock();
            (g.cfg, g.fs_flags, g.fd_flags)
        };
        let mut s = Stream::new(nid, cfg);
        (s.fs_flags, s.fd_flags) = (fs, fd_flags);
        if s.create_ep().is_err() || s.save_conn_data(&data).is_err() {
            reject(nid);
            s.free();
            return None;
        }
        let cd = s.format_conn_data();
        param.private_data = cd.as_ptr().cast();
        param.private_data_len = cd.len() as u8;
        // The accept sends the REP and looks once for the ESTABLISHED: its channel is
        // made non-blocking first, so that it does not wait for it.
        set_nonblock(s.cm_fd(), true);
        // SAFETY: the new id; `param` and `cd` live across the call.
        let rc = unsafe { cmid::rdma_accept(nid, &mut param) };
        // SAFETY: after a successful accept the id holds the event it took.
        if rc == 0 && unsafe { (*(*nid).event).event } == abi::RDMA_CM_EVENT_ESTABLISHED {
            s.stage = Stage::Open;
        } else if rc == 0 {
            reject(nid);
            s.free();
            return None;
        } else {
            let e = crate::errno_now();
            if e == libc::EAGAIN || e == libc::EWOULDBLOCK {
                s.stage = Stage::Accepting;
            } else {
                reject(nid);
                s.free();
                return None;
            }
        }
        Some(s)
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
        let a = match unsafe { sockaddr_bytes(addr, addrlen) } {
            Ok(a) => a,
            Err(e) => return minus_one(e),
        };
        let mut g = match rs.open_lock() {
            Ok(g) => g,
            Err(e) => return minus_one(e),
        };
        ret(do_connect(&mut g, Some(&a)).map(|()| 0))
    })
}

/// A call on a socket whose connect is under way drives it on first (EAGAIN while it is
/// not done, as rsockets answer).
fn drive_connect(g: &mut Stream) -> Result<(), c_int> {
    if g.opening() {
        do_connect(g, None).map_err(|e| {
            if e == libc::EINPROGRESS {
                libc::EAGAIN
            } else {
                e
            }
        })?;
    }
    Ok(())
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

/// Wait (unless non-blocking) until a send may go: ECONNRESET once the socket cannot
/// send any more.
fn wait_send<'a>(
    rs: &'a Rsock,
    g: MutexGuard<'a, Stream>,
    flags: c_int,
) -> (MutexGuard<'a, Stream>, Result<(), c_int>) {
    if g.can_send() {
        return (g, Ok(()));
    }
    let nb = nonblocking(&g, flags);
    let (g, r) = rs.get_comp(g, nb, conn_can_send);
    if r.is_ok() && !g.writable() {
        return (g, Err(libc::ECONNRESET));
    }
    (g, r)
}

/// Send any `riomap` offers not yet sent.
fn send_iomaps<'a>(
    rs: &'a Rsock,
    mut g: MutexGuard<'a, Stream>,
    flags: c_int,
) -> (MutexGuard<'a, Stream>, Result<(), c_int>) {
    while let Some(k) = g.iomap_to_send() {
        let (g2, r) = wait_send(rs, g, flags);
        g = g2;
        if let Err(e) = r {
            return (g, Err(e));
        }
        g.send_iomap(k);
        if let Some(e) = g.failed().then_some(g.err).filter(|&e| e != 0) {
            return (g, Err(e));
        }
    }
    (g, Ok(()))
}

/// `rsend`/`rsendv`: the bytes of `iov` as data messages.
fn sendv(socket: c_int, iov: &[libc::iovec], flags: c_int) -> Result<isize, c_int> {
    let rs = lookup(socket).ok_or(libc::EBADF)?;
    let mut g = rs.open_lock()?;
    drive_connect(&mut g)?;
    let (g2, r) = send_iomaps(&rs, g, flags);
    g = g2;
    r?;
    let total: usize = iov.iter().map(|v| v.iov_len).sum();
    let mut src = Source { iov, i: 0, off: 0 };
    let mut left = total;
    let mut sizes = TransferSizes::default();
    let mut err = None;
    while left > 0 {
        let (g2, r) = wait_send(&rs, g, flags);
        g = g2;
        if let Err(e) = r {
            err = Some(e);
            break;
        }
        let want = sizes.next(left);
        let mut fill = |dst: &mut [u8]| src.copy_to(dst.as_mut_ptr(), dst.len());
        let x = g.write_data(want, &mut fill);
        if x == 0 {
            err = Some(if g.err != 0 { g.err } else { libc::ECONNRESET });
            break;
        }
        left -= x as usize;
    }
    let sent = total - left;
    partial_result(sent, err).map(|n| n as isize)
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
/// is read.
fn recv(socket: c_int, buf: *mut u8, len: usize, flags: c_int) -> Result<isize, c_int> {
    let rs = lookup(socket).ok_or(libc::EBADF)?;
    let mut g = rs.open_lock()?;
    drive_connect(&mut g)?;
    let mut left = len;
    let mut err = None;
    loop {
        if !g.have_rdata() {
            let nb = nonblocking(&g, flags);
            let (g2, r) = rs.get_comp(g, nb, conn_have_rdata);
            g = g2;
            if let Err(e) = r {
                err = Some(e);
                break;
            }
        }
        // SAFETY: the caller's buffer of `len` bytes, of which the last `left` are not
        // filled yet; nothing else uses it during the call.
        let dst = unsafe { std::slice::from_raw_parts_mut(buf.add(len - left), left) };
        if flags & libc::MSG_PEEK != 0 {
            left -= g.read_data(dst, true);
            break;
        }
        left -= g.read_data(dst, false);
        if !(left > 0 && flags & libc::MSG_WAITALL != 0 && g.readable()) {
            break;
        }
    }
    g.update_credits();
    partial_result(len - left, err).map(|n| n as isize)
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
    let mut g = rs.open_lock()?;
    let mut res = Ok(());
    if g.connected() {
        let how = match how {
            libc::SHUT_RDWR => How::Both,
            libc::SHUT_WR => How::Write,
            _ => How::Read,
        };
        let Some(ctrl) = g.shutdown(how) else {
            return Ok(());
        };
        if !g.ctrl_avail() {
            let (g2, r) = rs.get_comp(g, false, conn_can_send_ctrl);
            g = g2;
            res = r;
        }
        if res.is_ok() && g.connected() && g.ctrl_avail() {
            g.send_ctrl(ctrl);
        }
    }
    if g.connected() {
        let (g2, _) = rs.get_comp(g, false, conn_all_sends_done);
        g = g2;
    }
    if g.disconnected() {
        // Flushing the receives wakes whoever polls the socket.
        g.flush();
    }
    res
}

/// Close a socket: shut a connection down, stop a listener, free everything.
fn close_socket(fd: c_int) -> bool {
    let Some(rs) = lookup(fd) else { return false };
    let connected = rs.lock().connected();
    if connected {
        let _ = shutdown(&rs, libc::SHUT_RDWR);
    }
    keepalive_remove(fd);
    let l = rs.listener.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Some(mut l) = l {
        // SAFETY: our pipe end; one byte.
        unsafe { libc::write(l.stop_wr, [1u8].as_ptr().cast(), 1) };
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
            libc::close(l.stop_wr);
        }
    }
    table().remove(&fd);
    let mut g = rs.lock();
    if g.has_ep() && (g.connected() || g.disconnected()) {
        // The CM's DREQ: a peer that still waits learns the connection is gone.
        // SAFETY: the live id (its channel is non-blocking: this does not wait).
        unsafe { cmid::rdma_disconnect(g.id) };
    }
    g.free();
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
    // SAFETY: the socket's live id; the caller's buffer and length.
    unsafe {
        let a = &(*g.id).route.addr;
        copy_addr(if peer { &a.dst } else { &a.src }, addr, len);
    }
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
            // SAFETY: the live id; `v` is an int.
            let rc = unsafe {
                cmid::rdma_set_option(
                    g.id,
                    abi::RDMA_OPTION_ID,
                    abi::RDMA_OPTION_ID_REUSEADDR,
                    (&v as *const c_int).cast_mut().cast(),
                    std::mem::size_of::<c_int>(),
                )
            };
            // Once bound, a RoCE id's reuse cannot change; rsockets accept that quietly.
            if rc != 0 && g.stage == Stage::Init {
                return Err(crate::errno_now());
            }
            bit(&mut g.so_opts, v != 0);
        }
        (libc::SOL_SOCKET, libc::SO_RCVBUF) => {
            let v = int()?;
            if !g.has_ep() && v > 0 {
                g.cfg.rbuf_size = (v as u32).saturating_mul(2).min(1 << 28);
            }
        }
        (libc::SOL_SOCKET, libc::SO_SNDBUF) => {
            let v = int()?;
            if !g.has_ep() && v > 0 {
                g.cfg.sbuf_size = (v as u32)
                    .saturating_mul(2)
                    .clamp(softrdma_rsocket::config::SNDLOWAT << 1, 1 << 28);
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
            let tos = v as u8;
            // SAFETY: the live id; a one-byte value.
            let rc = unsafe {
                cmid::rdma_set_option(
                    g.id,
                    abi::RDMA_OPTION_ID,
                    abi::RDMA_OPTION_ID_TOS,
                    (&tos as *const u8).cast_mut().cast(),
                    1,
                )
            };
            errno_of(rc)?;
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
            // SAFETY: the live id; `v` is an int.
            let rc = unsafe {
                cmid::rdma_set_option(
                    g.id,
                    abi::RDMA_OPTION_ID,
                    abi::RDMA_OPTION_ID_AFONLY,
                    (&v as *const c_int).cast_mut().cast(),
                    std::mem::size_of::<c_int>(),
                )
            };
            errno_of(rc)?;
            bit(&mut g.ipv6_opts, v != 0);
        }
        (SOL_RDMA, _) => {
            if g.stage >= Stage::ResolvingAddr {
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
        (libc::SOL_SOCKET, libc::SO_ERROR) => {
            let e = g.err;
            g.err = 0;
            put_int(e)
        }
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
            // SAFETY: the live id; its path record when it has one.
            let mss = unsafe {
                let r = &(*g.id).route;
                if r.num_paths > 0 && !r.path_rec.is_null() {
                    1 << (7 + c_int::from((*r.path_rec).mtu))
                } else {
                    2048
                }
            };
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
                    if g.stage == Stage::Listening {
                        if let Some(l) = rs
                            .listener
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .as_ref()
                        {
                            set_nonblock(l.queue_rd, on);
                        }
                    } else if g.stage < Stage::Open {
                        set_nonblock(g.cm_fd(), on);
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
        let mut g = rs.lock();
        if !g.has_ep() || prot & !(libc::PROT_WRITE | libc::PROT_NONE) != 0 {
            return minus_one(libc::EINVAL) as libc::off_t;
        }
        let remote = prot & libc::PROT_WRITE != 0;
        let mut access = sys::IBV_ACCESS_LOCAL_WRITE;
        if remote {
            access |= sys::IBV_ACCESS_REMOTE_WRITE;
        }
        // SAFETY: the socket's live id and PD; the program's buffer of `len` bytes.
        let m = unsafe { mr::ibv_reg_mr((*g.id).pd, buf, len, access as c_int) };
        if m.is_null() {
            return -1;
        }
        let off = if offset == -1 {
            buf as libc::off_t
        } else {
            offset
        };
        if let Err(e) = g.map_iomap(m, off as u64, remote) {
            // SAFETY: registered above, used by nothing.
            unsafe { mr::ibv_dereg_mr(m) };
            return minus_one(e) as libc::off_t;
        }
        off
    })
}

#[no_mangle]
pub unsafe extern "C" fn riounmap(socket: c_int, buf: *mut c_void, len: usize) -> c_int {
    guard(-1, || {
        let Some(rs) = lookup(socket) else {
            return minus_one(libc::EBADF);
        };
        let mut g = rs.lock();
        let Some(m) = g.unmap_iomap(buf, len) else {
            return minus_one(libc::EINVAL);
        };
        // SAFETY: registered by riomap, removed from the socket.
        unsafe { mr::ibv_dereg_mr(m) };
        0
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
        match iowrite(socket, buf.cast(), count, offset as u64, flags) {
            Ok(n) => n,
            Err(e) => minus_one(e) as usize,
        }
    })
}

fn iowrite(
    socket: c_int,
    buf: *const u8,
    count: usize,
    mut offset: u64,
    flags: c_int,
) -> Result<usize, c_int> {
    let rs = lookup(socket).ok_or(libc::EBADF)?;
    let g = rs.open_lock()?;
    let (mut g, r) = send_iomaps(&rs, g, flags);
    r?;
    let mut left = count;
    let mut sizes = TransferSizes::default();
    let mut err = None;
    while left > 0 {
        if g.peer_iomap(offset).is_none() {
            break;
        }
        let (g2, r) = wait_send(&rs, g, flags);
        g = g2;
        if let Err(e) = r {
            err = Some(e);
            break;
        }
        let want = sizes.next(left);
        // SAFETY: within the caller's buffer of `count` bytes.
        let src = unsafe { buf.add(count - left) };
        let mut copied = 0usize;
        let mut fill = |dst: &mut [u8]| {
            // SAFETY: the next `dst.len()` bytes of the caller's buffer (the transfer's
            // pieces, in order, within `left`).
            unsafe { std::ptr::copy_nonoverlapping(src.add(copied), dst.as_mut_ptr(), dst.len()) };
            copied += dst.len();
        };
        match g.write_direct(offset, want, &mut fill) {
            Some(0) => {
                err = Some(if g.err != 0 { g.err } else { libc::ECONNRESET });
                break;
            }
            Some(x) => {
                left -= x as usize;
                offset += u64::from(x);
            }
            None => break,
        }
    }
    let done = count - left;
    partial_result(done, err)
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
            if let Some(rs) = lookup(fd) {
                let mut g = rs.lock();
                if g.closed() {
                    continue;
                }
                g.poll_cq().ok();
                g.send_keepalive();
            }
        }
        std::thread::sleep(
            next.saturating_duration_since(Instant::now())
                .min(Duration::from_secs(1)),
        );
    }
}
