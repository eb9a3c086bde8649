//! A stream rsocket on a device: the driver of [`Conn`] over the device's verbs and its
//! CM. It makes the RC QP, CQ and registrations, runs rsockets' connection steps
//! (`rs_do_connect`, `rs_accept`), posts what the protocol asks, feeds it completions,
//! and waits. Every face sits on it: the C face's `rsocket`/`rsend`/…, the Rust face's
//! `softrdma::rsocket` streams.
//!
//! Waiting is one policy: poll the CQ (which drives the device's progress from the
//! waiting thread), then block on the device until something changes, in slices, so a
//! CM event (a DREQ from a peer that said nothing first) is seen within one slice. For
//! event loops, [`Socket::fds`] gives the completion channel's and the CM channel's
//! descriptors: arm with [`Socket::arm`], wait for either to be readable, then
//! [`Socket::take_events`]; the calls that never wait are the non-blocking `send` and
//! `recv`, [`Socket::readiness`] and [`Socket::try_shutdown`], [`Connecting::poll`], and
//! a [`Listener`]'s [`Listener::poll_accept`] with its one descriptor.

use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use softrdma_cm::agent::{Agent, EventChannel};
use softrdma_cm::cma::{CmaError, CmaEvent, ConnParam, EventParam, EventType, IdHandle, IdOption};
use softrdma_cm::conn::{self, Depth, RdLimits, Ready};
use softrdma_device::verbs::{
    self, Access, Arm, ChannelId, CqId, PdId, QpAttr, QpAttrMask, QpInitAttr, QpState, QpType, Qpn,
    WorkCompletion,
};
use softrdma_device::{CqPoller, Device};
use softrdma_wire::cm::port_space;
use softrdma_wire::rsocket::{ConnData, Ctrl};

use crate::config::Config;
use crate::conn::{partial_result, Conn, Keys, Phase, Post, Shutdown, TransferSizes};

/// The longest one blocking wait lasts before looking at the CM channel again.
const WAIT_SLICE: Duration = Duration::from_millis(50);
/// How long a close waits for the last sends to complete.
const CLOSE_WAIT: Duration = Duration::from_secs(2);

/// An errno as an `io::Error`.
fn errno(e: i32) -> io::Error {
    io::Error::from_raw_os_error(e)
}

fn cma(e: CmaError) -> io::Error {
    e.into()
}

fn verbs_err(e: verbs::Error) -> io::Error {
    io::Error::new(
        io::Error::from_raw_os_error(e.errno.code()).kind(),
        e.to_string(),
    )
}

/// The device objects of one socket.
struct Objects {
    pd: PdId,
    ch: ChannelId,
    cq: CqId,
    qp: Qpn,
    lkeys: [u32; 3],
}

/// A socket's place in the CM: its id on the device's CM agent and the channel its
/// events come on, whose descriptor is the socket's through its whole life (unbound,
/// connecting, connected). Dropping it destroys the id.
struct Endpoint {
    dev: Arc<Device>,
    agent: Arc<Agent>,
    chan: EventChannel,
    id: IdHandle,
    live: bool,
}

impl Endpoint {
    /// A new id of the TCP port space on `dev`'s CM, on a channel of its own.
    fn new(dev: &Arc<Device>) -> io::Result<Endpoint> {
        let agent = Agent::for_device(dev)?;
        let chan = EventChannel::new()?;
        agent.attach(&chan);
        let ch = chan.id();
        let id = agent
            .call(|c, _| c.create_id(ch, port_space::TCP, None))
            .map_err(cma)?;
        Ok(Endpoint {
            dev: Arc::clone(dev),
            agent,
            chan,
            id,
            live: true,
        })
    }

    fn call<R>(
        &self,
        f: impl FnOnce(&mut softrdma_cm::cma::Cma, u64, IdHandle) -> softrdma_cm::cma::Result<R>,
    ) -> io::Result<R> {
        let id = self.id;
        self.agent.call(|c, now| f(c, now, id)).map_err(cma)
    }

    fn addrs(&self) -> (Option<SocketAddr>, Option<SocketAddr>) {
        self.call(|c, _, id| c.addrs(id)).unwrap_or((None, None))
    }

    fn set_option(&self, opt: IdOption) -> io::Result<()> {
        self.call(|c, _, id| c.set_option(id, opt))
    }

    /// The next event, without waiting.
    fn event(&self) -> io::Result<Option<CmaEvent>> {
        self.chan.get_timeout(Some(Duration::ZERO))
    }

    /// Disconnect (a DREQ where connected) and destroy the id: once.
    fn close(&mut self) {
        if std::mem::take(&mut self.live) {
            let _ = self.call(|c, now, id| {
                let _ = c.disconnect(now, id);
                c.destroy_id(now, id)
            });
            self.chan.withdraw(self.id);
        }
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.close();
    }
}

struct Inner {
    conn: Conn,
    poller: CqPoller,
    armed: bool,
    /// Regions `iomap` registered: (address, length, lkey).
    iomap_mrs: Vec<(u64, usize, u32)>,
    closing: Closing,
}

/// The shutdowns asked of a socket so far. Kept between calls so that a shutdown that
/// has to wait (for a control slot, for its sends) continues on the next call instead
/// of telling the peer again.
#[derive(Debug, Default)]
struct Closing {
    /// The directions shutdowns closed (reading, writing).
    read: bool,
    write: bool,
    /// The control message decided and not yet posted (no control slot was free): the
    /// next progress pass with a free slot posts it.
    ctrl: Option<Ctrl>,
    /// A DISCONNECT was decided: the QP goes to ERR once the sends before it are done.
    disconnect: bool,
    /// A blocking shutdown waited its bounds for the directions closed so far: closing
    /// them again (a drop after a close that gave up on a gone peer) waits no more.
    waited: bool,
}

/// A stream rsocket: connected, or answered and waiting for its RTU ([`Listener`]).
pub struct Socket {
    ep: Endpoint,
    objs: Objects,
    comp_fd: RawFd,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for Socket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Socket")
            .field("id", &self.ep.id)
            .field("qp", &self.objs.qp)
            .field("phase", &self.lock().conn.phase())
            .finish()
    }
}

/// The next wait's length: a slice, shorter when `deadline` comes first; None once it
/// has passed.
fn slice_before(deadline: Option<Instant>) -> Option<Duration> {
    let now = Instant::now();
    match deadline {
        Some(d) if now >= d => None,
        Some(d) => Some((d - now).min(WAIT_SLICE)),
        None => Some(WAIT_SLICE),
    }
}

/// The error an unexpected CM event means while connecting.
fn event_error(ev: &CmaEvent) -> io::Error {
    match ev.event {
        EventType::Rejected => errno(libc::ECONNREFUSED),
        EventType::Unreachable | EventType::AddrError | EventType::RouteError => {
            errno(libc::EHOSTUNREACH)
        }
        EventType::Disconnected | EventType::TimewaitExit => errno(libc::ECONNRESET),
        _ => errno(libc::EPROTO),
    }
}

impl Socket {
    /// The objects of a socket on `ep`: PD, completion channel, CQ, the RC QP in INIT
    /// (as `rdma_create_qp` leaves it), the connection's buffers registered and its
    /// receives posted. On failure what was made is released and the endpoint handed back.
    fn make(ep: Endpoint, mut cfg: Config) -> Result<Socket, (io::Error, Endpoint)> {
        let dev = Arc::clone(&ep.dev);
        let max_wr = dev.device_attr().max_qp_wr;
        cfg.fit_device(max_wr);
        let conn = match Conn::new(cfg) {
            Ok(c) => c,
            Err(e) => return Err((errno(e), ep)),
        };
        let depth = cfg.cq_depth();
        let pd = match dev.alloc_pd() {
            Ok(pd) => pd,
            Err(e) => return Err((verbs_err(e), ep)),
        };
        let ch = match dev.create_channel() {
            Ok(ch) => ch,
            Err(e) => {
                let _ = dev.dealloc_pd(pd);
                return Err((verbs_err(e), ep));
            }
        };
        let cq = match dev.create_cq(depth, Some(ch), false) {
            Ok((cq, _)) => cq,
            Err(e) => {
                let _ = dev.destroy_channel(ch);
                let _ = dev.dealloc_pd(pd);
                return Err((verbs_err(e), ep));
            }
        };
        let mut objs = Objects {
            pd,
            ch,
            cq,
            qp: 0,
            lkeys: [0; 3],
        };
        let comp_fd = match dev.add_channel_fd(ch) {
            Ok(fd) => fd,
            Err(e) => {
                release(&dev, &objs, &[]);
                return Err((e, ep));
            }
        };
        let fail = |objs: &Objects, e: io::Error, ep: Endpoint| {
            release(&dev, objs, &[]);
            dev.remove_channel_fd(objs.ch);
            Err((e, ep))
        };
        let init = QpInitAttr {
            qp_type: QpType::Rc,
            pd,
            send_cq: cq,
            recv_cq: cq,
            srq: None,
            cap: cfg.qp_cap(),
            sq_sig_all: true,
        };
        objs.qp = match dev.create_qp(init) {
            Ok((q, _)) => q,
            Err(e) => return fail(&objs, verbs_err(e), ep),
        };
        let mut keys = [(0u32, 0u32); 3];
        for (k, region) in conn.regions().into_iter().enumerate() {
            let access = if k == 0 {
                Access::LOCAL_WRITE
            } else {
                Access::LOCAL_WRITE | Access::REMOTE_WRITE
            };
            let (p, len) = (region.as_ptr(), region.len());
            // SAFETY: the connection's regions live until the socket is dropped, which
            // destroys the QP and deregisters them first (`release`).
            let mr = unsafe { dev.reg_mr(pd, p, len, p as u64, access) };
            match mr {
                Ok(mr) => {
                    keys[k] = (mr.lkey, mr.rkey);
                    objs.lkeys[k] = mr.lkey;
                }
                Err(e) => return fail(&objs, verbs_err(e), ep),
            }
        }
        let mut conn = conn;
        conn.set_keys(Keys {
            send_lkey: keys[0].0,
            target_rkey: keys[1].1,
            recv_rkey: keys[2].1,
        });
        // INIT with the CM's attributes, as `rdma_create_qp` moves a CM id's QP.
        let init = ep.call(|c, _, id| c.init_qp_attr(id, QpState::Init));
        let s = Socket {
            ep,
            objs,
            comp_fd,
            inner: Mutex::new(Inner {
                conn,
                poller: CqPoller::new(cq),
                armed: false,
                iomap_mrs: Vec::new(),
                closing: Closing::default(),
            }),
        };
        let r = init.and_then(|(a, m)| s.modify(&a, m));
        if let Err(e) = r {
            return Err((e, s.into_endpoint()));
        }
        {
            let mut g = s.lock();
            s.flush_posts(&mut g);
        }
        Ok(s)
    }

    /// Release the device objects and hand back the endpoint (a socket that never ran).
    fn into_endpoint(self) -> Endpoint {
        let me = std::mem::ManuallyDrop::new(self);
        // SAFETY: `me` is never used or dropped again: each field is moved out exactly
        // once (the endpoint by read, the mutex by read and then dropped here).
        let (ep, inner) = unsafe { (std::ptr::read(&me.ep), std::ptr::read(&me.inner)) };
        release(&ep.dev, &me.objs, &[]);
        ep.dev.remove_channel_fd(me.objs.ch);
        drop(inner);
        ep
    }

    /// Send the connection request with this side's connection data.
    fn request(&self) -> io::Result<()> {
        let lim = RdLimits::of(&self.ep.dev);
        let (rr, depth) = lim.offer(Depth::Exactly(0), Depth::Exactly(0));
        let p = ConnParam {
            private_data: self.lock().conn.conn_data().emit().to_vec(),
            responder_resources: rr,
            initiator_depth: depth,
            flow_control: crate::config::CONNECT_FLOW_CONTROL,
            retry_count: crate::config::CONNECT_RETRY,
            rnr_retry_count: crate::config::CONNECT_RNR_RETRY,
            srq: 0,
            qp_num: self.objs.qp,
        };
        self.ep.call(|c, now, id| c.connect(now, id, &p))
    }

    /// The server's reply came: take its connection data, ready the QP and send the
    /// RTU. A reply without rsockets' data is refused as librdmacm refuses a failed
    /// response (the QP to ERR, a REJ): ENOTSUP.
    fn finish(&self, rep: &CmaEvent) -> io::Result<()> {
        let EventParam::Conn(rep) = &rep.param else {
            return Err(errno(libc::EPROTO));
        };
        let Ok(peer) = ConnData::parse(&rep.private_data) else {
            self.to_error();
            let _ = self.ep.call(|c, now, id| c.reject(now, id, &[]));
            return Err(errno(libc::ENOTSUP));
        };
        conn::complete_connect(
            &self.ep.agent,
            self.ep.id,
            Some(Ready::default()),
            |a: &QpAttr, m| self.modify(a, m),
            || self.to_error(),
        )?;
        self.lock().conn.start(&peer);
        Ok(())
    }

    fn modify(&self, a: &QpAttr, m: QpAttrMask) -> io::Result<()> {
        let qp = self.objs.qp;
        self.ep.dev.modify_qp(qp, a, m).map_err(verbs_err)
    }

    fn to_error(&self) {
        let a = QpAttr {
            qp_state: QpState::Err,
            ..QpAttr::default()
        };
        let _ = self.modify(&a, QpAttrMask::STATE);
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Connect to an rsockets server at `dst` (rsockets' `rs_do_connect`): resolve,
    /// make the QP and buffers, send the connection data in the REQ, and on the REP
    /// ready the QP, send the RTU and take the server's data. `timeout` bounds the whole
    /// exchange (None: the CM's own verdict). [`Unconnected::connect`] does the same
    /// step by step, for a socket bound first or a caller that must not block.
    pub fn connect(
        dev: &Arc<Device>,
        dst: SocketAddr,
        cfg: Config,
        timeout: Option<Duration>,
    ) -> io::Result<Socket> {
        let deadline = timeout.map(|t| Instant::now() + t);
        Unconnected::new(dev)?.connect(dst, cfg).wait(deadline)
    }

    /// The device it is on.
    pub fn device(&self) -> &Arc<Device> {
        &self.ep.dev
    }

    /// This side's and the peer's addresses.
    pub fn addrs(&self) -> (Option<SocketAddr>, Option<SocketAddr>) {
        self.ep.addrs()
    }

    /// Set an option of its CM id (what a connected id still takes, such as TOS).
    pub fn set_option(&self, opt: IdOption) -> io::Result<()> {
        self.ep.set_option(opt)
    }

    /// The RC QP the connection runs on.
    pub fn qpn(&self) -> Qpn {
        self.objs.qp
    }

    /// The path MTU the connection's QP was readied with.
    pub fn path_mtu(&self) -> Option<verbs::Mtu> {
        self.ep.dev.query_qp(self.objs.qp).ok().map(|a| a.path_mtu)
    }

    /// Received bytes wait to be read.
    pub fn has_data(&self) -> bool {
        self.lock().conn.have_rdata()
    }

    /// The sizes it was made with (the queue depths as the device allowed them).
    pub fn config(&self) -> Config {
        *self.lock().conn.config()
    }

    /// The completion channel's and the CM channel's descriptors: readable when a
    /// completion arrived after [`Socket::arm`], or a CM event waits.
    pub fn fds(&self) -> [BorrowedFd<'_>; 2] {
        // SAFETY: the device owns the completion channel's fd until `release` removes it,
        // which happens only when the socket is dropped, after every borrow of it.
        let comp = unsafe { BorrowedFd::borrow_raw(self.comp_fd) };
        [comp, self.ep.chan.as_fd()]
    }

    /// Post what the connection asks for; a refused post fails the connection.
    fn flush_posts(&self, g: &mut Inner) {
        let qp = self.objs.qp;
        while let Some(p) = g.conn.poll_post() {
            let r = match p {
                Post::Send(wr) => self.ep.dev.post_send(qp, wr),
                Post::Recv(wr) => self.ep.dev.post_recv(qp, wr),
            };
            if let Err(e) = r {
                g.conn.fail(e.errno.code());
            }
        }
    }

    /// rsockets' `rs_poll_cq` pass: completions in, credits out, CM events taken.
    /// Returns whether anything happened.
    fn progress(&self, g: &mut Inner) -> bool {
        let mut any = false;
        g.conn.update_credits();
        let mut wcs = [WorkCompletion::default(); 16];
        loop {
            let n = match g.poller.poll(&self.ep.dev, &mut wcs) {
                Ok(n) => n,
                Err(e) => {
                    g.conn.fail(e.errno.code());
                    break;
                }
            };
            if n == 0 {
                break;
            }
            any = true;
            if g.conn.on_completions(&wcs[..n]).is_err() {
                // The peer broke the protocol: end the connection as a reset would.
                self.to_error();
                let _ = self.ep.call(|c, now, id| c.disconnect(now, id));
            }
        }
        any |= self.post_close(g);
        g.conn.update_credits();
        self.flush_posts(g);
        while let Ok(Some(ev)) = self.ep.event() {
            any = true;
            if matches!(
                ev.event,
                EventType::Disconnected | EventType::TimewaitExit | EventType::DeviceRemoval
            ) {
                g.conn.disconnected();
            }
        }
        any
    }

    /// Wait until `test` holds (Ok(true)), `deadline` passes (Ok(false)), or forever.
    fn wait(&self, deadline: Option<Instant>, test: impl Fn(&Inner) -> bool) -> io::Result<bool> {
        loop {
            {
                let mut g = self.lock();
                self.progress(&mut g);
                if test(&g) {
                    return Ok(true);
                }
            }
            let now = Instant::now();
            let slice = match deadline {
                Some(d) if now >= d => return Ok(false),
                Some(d) => (d - now).min(WAIT_SLICE),
                None => WAIT_SLICE,
            };
            let dev = &self.ep.dev;
            let gen = dev.generation();
            dev.wait_for(Some(slice), || (dev.generation() != gen).then_some(()));
        }
    }

    /// Send `data` (rsockets' `rsend`): as much as fits now when `nonblocking` (EAGAIN
    /// when nothing does), else all of it, waiting for credits and offers. A short count
    /// when the connection fails part way; EPIPE/ECONNRESET when it cannot send.
    pub fn send(&self, data: &[u8], nonblocking: bool) -> io::Result<usize> {
        let mut at = 0;
        self.send_from(data.len(), nonblocking, &mut |dst: &mut [u8]| {
            dst.copy_from_slice(&data[at..at + dst.len()]);
            at += dst.len();
        })
    }

    /// [`Socket::send`] of `len` bytes that `fill` copies out, in order, piece by piece
    /// (a gather list's bytes, for instance). Mappings made with [`Socket::iomap`] and
    /// not yet offered go to the peer first.
    pub fn send_from(
        &self,
        len: usize,
        nonblocking: bool,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> io::Result<usize> {
        self.send_iomaps(nonblocking)?;
        let mut sizes = TransferSizes::new(len);
        let mut done = 0;
        let mut err = None;
        while done < len {
            match self.wait_send(nonblocking) {
                Ok(mut g) => {
                    let want = sizes.next(len - done);
                    let n = g.conn.send_data(want, fill) as usize;
                    self.flush_posts(&mut g);
                    if n == 0 {
                        err = Some(g.conn.error().unwrap_or(libc::ECONNRESET));
                        break;
                    }
                    done += n;
                }
                Err(e) => {
                    err = Some(e);
                    break;
                }
            }
        }
        partial_result(done, err).map_err(errno)
    }

    /// The socket locked once a send may go, waiting for that unless `nonblocking`
    /// (EAGAIN); the connection's error (or ECONNRESET) once it cannot send.
    fn wait_send(&self, nonblocking: bool) -> Result<MutexGuard<'_, Inner>, i32> {
        loop {
            {
                let mut g = self.lock();
                if !g.conn.can_send() {
                    self.progress(&mut g);
                }
                if !g.conn.writable() {
                    return Err(g.conn.error().unwrap_or(libc::ECONNRESET));
                }
                if g.conn.can_send() {
                    return Ok(g);
                }
                if nonblocking {
                    return Err(libc::EAGAIN);
                }
            }
            self.wait(None, |g| g.conn.can_send() || !g.conn.writable())
                .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
        }
    }

    /// Offer the peer the mappings not offered yet (rsockets' `rs_send_iomaps`).
    fn send_iomaps(&self, nonblocking: bool) -> io::Result<()> {
        loop {
            if self.lock().conn.iomap_to_send().is_none() {
                return Ok(());
            }
            let mut g = self.wait_send(nonblocking).map_err(errno)?;
            if let Some(k) = g.conn.iomap_to_send() {
                g.conn.send_iomap(k);
                self.flush_posts(&mut g);
            }
        }
    }

    /// `riomap`: register `len` bytes at `buf` so that the peer may write them directly
    /// ([`Socket::iowrite`]) at `offset` (None: the buffer's address), or, unless
    /// `writable`, for this side's own use only. The offer goes with the next send.
    /// Returns the offset. EINVAL when the socket is not connected, ENOMEM when the
    /// peer's table is full.
    ///
    /// # Safety
    /// The `len` bytes at `buf` stay valid, and are not moved, until
    /// [`Socket::iounmap`] or the socket is dropped: the device may write them.
    pub unsafe fn iomap(
        &self,
        buf: *mut u8,
        len: usize,
        offset: Option<u64>,
        writable: bool,
    ) -> io::Result<u64> {
        let mut g = self.lock();
        if !g.conn.is_connected() {
            return Err(errno(libc::EINVAL));
        }
        let access = if writable {
            Access::LOCAL_WRITE | Access::REMOTE_WRITE
        } else {
            Access::LOCAL_WRITE
        };
        let addr = buf as u64;
        // SAFETY: per this function's contract, the region outlives its registration,
        // which `iounmap` or the socket's drop removes.
        let mr = unsafe { self.ep.dev.reg_mr(self.objs.pd, buf, len, addr, access) }
            .map_err(verbs_err)?;
        let offset = offset.unwrap_or(addr);
        if writable {
            let sge = softrdma_wire::rsocket::Sge {
                addr,
                key: mr.rkey,
                length: len as u32,
            };
            if let Err(e) = g.conn.map_iomap(offset, sge, None) {
                let _ = self.ep.dev.dereg_mr(mr.lkey);
                return Err(errno(e));
            }
        }
        g.iomap_mrs.push((addr, len, mr.lkey));
        Ok(offset)
    }

    /// `riounmap`: withdraw the mapping of the `len` bytes at `buf` (EINVAL when there
    /// is none).
    pub fn iounmap(&self, buf: *mut u8, len: usize) -> io::Result<()> {
        let mut g = self.lock();
        let addr = buf as u64;
        let k = g
            .iomap_mrs
            .iter()
            .position(|m| m.0 == addr && m.1 == len)
            .ok_or_else(|| errno(libc::EINVAL))?;
        let (_, _, lkey) = g.iomap_mrs.remove(k);
        g.conn.unmap_iomap(addr);
        drop(g);
        self.ep.dev.dereg_mr(lkey).map_err(verbs_err)
    }

    /// `riowrite`: write `data` straight into the peer's mappings at `offset`, no
    /// receive on its side. The bytes written: short where the range leaves the
    /// peer's mappings (0 when `offset` is in none).
    pub fn iowrite(&self, data: &[u8], mut offset: u64, nonblocking: bool) -> io::Result<usize> {
        self.send_iomaps(nonblocking)?;
        let mut sizes = TransferSizes::new(data.len());
        let mut done = 0;
        let mut err = None;
        while done < data.len() {
            if self.lock().conn.peer_iomap(offset).is_none() {
                break;
            }
            let mut g = match self.wait_send(nonblocking) {
                Ok(g) => g,
                Err(e) => {
                    err = Some(e);
                    break;
                }
            };
            let want = sizes.next(data.len() - done);
            let src = &data[done..];
            let mut at = 0;
            let n = g.conn.write_direct(offset, want, &mut |dst: &mut [u8]| {
                dst.copy_from_slice(&src[at..at + dst.len()]);
                at += dst.len();
            });
            self.flush_posts(&mut g);
            match n {
                Some(0) => {
                    err = Some(g.conn.error().unwrap_or(libc::ECONNRESET));
                    break;
                }
                Some(x) => {
                    done += x as usize;
                    offset += u64::from(x);
                }
                None => break,
            }
        }
        partial_result(done, err).map_err(errno)
    }

    /// The connection's error, if it failed (SO_ERROR).
    pub fn error(&self) -> Option<i32> {
        self.lock().conn.error()
    }

    /// Receive into `buf` (rsockets' `rrecv`): what has arrived, waiting for something
    /// unless `nonblocking` (EAGAIN); 0 once the peer has shut down or gone and all is
    /// read. `peek` leaves the bytes to be read again.
    pub fn recv(&self, buf: &mut [u8], peek: bool, nonblocking: bool) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            {
                let mut g = self.lock();
                if !g.conn.have_rdata() {
                    self.progress(&mut g);
                }
                if g.conn.have_rdata() {
                    let n = g.conn.recv(buf, peek);
                    g.conn.update_credits();
                    self.flush_posts(&mut g);
                    return Ok(n);
                }
                if !g.conn.readable() {
                    return match g.conn.error() {
                        Some(e) if e != libc::EIO => Err(errno(e)),
                        _ => Ok(0),
                    };
                }
                if nonblocking {
                    return Err(errno(libc::EAGAIN));
                }
            }
            self.wait(None, |g| g.conn.have_rdata() || !g.conn.readable())?;
        }
    }

    /// What is possible now without waiting: (data to read or end of stream, a send
    /// would move data, the connection failed or closed). Drives progress once.
    pub fn readiness(&self) -> (bool, bool, bool) {
        let mut g = self.lock();
        self.progress(&mut g);
        let c = &g.conn;
        (
            c.have_rdata() || !c.readable(),
            c.can_send() || !c.writable(),
            !c.is_connected(),
        )
    }

    /// Arm the completion channel for the next completion (for waiting on
    /// [`Socket::fds`]). Returns false when there is work already (call
    /// [`Socket::readiness`] again rather than wait).
    pub fn arm(&self) -> bool {
        let mut g = self.lock();
        if self.progress(&mut g) {
            return false;
        }
        if !g.armed {
            let cq = self.objs.cq;
            if self.ep.dev.req_notify_cq(cq, Arm::Next).is_err() {
                return false;
            }
            g.armed = true;
        }
        // A completion between the poll and the arming is in the CQ, not signalled.
        !self.progress(&mut g)
    }

    /// Take the completion channel's events (after its fd was readable).
    pub fn take_events(&self) {
        let mut g = self.lock();
        let ch = self.objs.ch;
        while let Some(cq) = self.ep.dev.get_cq_event(ch) {
            let _ = self.ep.dev.ack_cq_events(cq, 1);
            g.armed = false;
        }
    }

    /// `rshutdown`: close reading, writing or both, telling the peer, and wait for the
    /// shutdown to be done ([`Socket::try_shutdown`]): at most two seconds for a control
    /// slot and as long again for the sends before it, so a peer that is gone does not
    /// hold a close for longer. A control message still unposted then goes with a
    /// later progress pass.
    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        {
            let mut g = self.lock();
            if !self.begin_shutdown(&mut g, how) && g.closing.waited {
                self.end_shutdown(&g);
                return Ok(());
            }
        }
        let staged = |g: &Inner| g.closing.ctrl.is_none() || !g.conn.is_connected();
        self.wait(Some(Instant::now() + CLOSE_WAIT), staged)?;
        self.wait(Some(Instant::now() + CLOSE_WAIT), shutdown_done)?;
        let mut g = self.lock();
        g.closing.waited = true;
        self.end_shutdown(&g);
        Ok(())
    }

    /// `rshutdown` without waiting: close the directions of `how`, telling the peer
    /// when a control slot is free. Ok once the shutdown is done: its control message
    /// posted and every send before it (and it) completed, or the connection down.
    /// `WouldBlock` until then: wait on [`Socket::fds`] (after [`Socket::arm`]) and call
    /// again. A call for directions already shut down continues that shutdown; the
    /// peer is told once.
    pub fn try_shutdown(&self, how: Shutdown) -> io::Result<()> {
        let mut g = self.lock();
        self.begin_shutdown(&mut g, how);
        self.progress(&mut g);
        if !shutdown_done(&g) {
            return Err(errno(libc::EAGAIN));
        }
        self.end_shutdown(&g);
        Ok(())
    }

    /// Close the directions of `how` not closed yet and decide what the peer is told
    /// (posted by [`Socket::post_close`]). Returns whether it closed any.
    fn begin_shutdown(&self, g: &mut Inner, how: Shutdown) -> bool {
        let (read, write) = match how {
            Shutdown::Read => (true, false),
            Shutdown::Write => (false, true),
            Shutdown::Both => (true, true),
        };
        let c = &mut g.closing;
        if c.disconnect || ((!read || c.read) && (!write || c.write)) {
            return false;
        }
        c.read |= read;
        c.write |= write;
        c.waited = false;
        if let Some(ctrl) = g.conn.shutdown(how) {
            // A DISCONNECT says what an unposted SHUTDOWN would have, and more.
            c.disconnect = ctrl == Ctrl::Disconnect;
            c.ctrl = Some(ctrl);
        }
        true
    }

    /// Post the shutdown's control message if one waits and a control slot is free (a
    /// connection that is down takes none). Returns whether it went.
    fn post_close(&self, g: &mut Inner) -> bool {
        let Some(ctrl) = g.closing.ctrl else {
            return false;
        };
        if g.conn.is_connected() && !g.conn.ctrl_avail() {
            return false;
        }
        g.closing.ctrl = None;
        g.conn.send_ctrl(ctrl)
    }

    /// The last step of a shutdown that is done (or gave up waiting).
    fn end_shutdown(&self, g: &Inner) {
        if g.closing.disconnect || g.conn.phase() == Phase::Disconnected {
            // Flushing the receives wakes whoever polls the socket.
            self.to_error();
        }
    }

    /// Send a keepalive (a zero-length RDMA WRITE a gone peer fails).
    pub fn keepalive(&self) {
        let mut g = self.lock();
        self.progress(&mut g);
        g.conn.send_keepalive();
        self.flush_posts(&mut g);
    }

    /// The connection's state.
    pub fn phase(&self) -> Phase {
        self.lock().conn.phase()
    }
}

/// The shutdown under way is done: its control message posted and every send completed
/// (or the connection is down).
fn shutdown_done(g: &Inner) -> bool {
    (g.closing.ctrl.is_none() || !g.conn.is_connected()) && g.conn.all_sends_done()
}

/// Destroy what `make` made on the device, QP first (it could still write the regions),
/// and the regions `extra` names.
fn release(dev: &Device, o: &Objects, extra: &[u32]) {
    if o.qp != 0 {
        let _ = dev.destroy_qp(o.qp);
    }
    for &k in o.lkeys.iter().chain(extra) {
        if k != 0 {
            let _ = dev.dereg_mr(k);
        }
    }
    let _ = dev.destroy_cq(o.cq);
    let _ = dev.destroy_channel(o.ch);
    let _ = dev.dealloc_pd(o.pd);
}

impl Drop for Socket {
    fn drop(&mut self) {
        if self.lock().conn.is_connected() {
            let _ = self.shutdown(Shutdown::Both);
        }
        self.ep.close();
        let iomaps: Vec<u32> = self.lock().iomap_mrs.iter().map(|m| m.2).collect();
        release(&self.ep.dev, &self.objs, &iomaps);
        self.ep.dev.remove_channel_fd(self.objs.ch);
    }
}

/// An rsocket neither connected nor listening (`rsocket`, `rbind`): its CM id, whose
/// channel's descriptor stays the socket's when it connects or listens.
pub struct Unconnected {
    ep: Endpoint,
}

impl std::fmt::Debug for Unconnected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Unconnected")
            .field("id", &self.ep.id)
            .finish()
    }
}

impl Unconnected {
    /// A new socket on `dev`'s CM.
    pub fn new(dev: &Arc<Device>) -> io::Result<Unconnected> {
        Ok(Unconnected {
            ep: Endpoint::new(dev)?,
        })
    }

    /// The CM channel's descriptor: the socket's through its life.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.ep.chan.as_fd()
    }

    /// `rbind`: reserve `addr` (the wildcard address and port 0 allowed).
    pub fn bind(&self, addr: SocketAddr) -> io::Result<()> {
        self.ep.call(|c, _, id| c.bind(id, addr))
    }

    /// The bound address and the peer's (none yet).
    pub fn addrs(&self) -> (Option<SocketAddr>, Option<SocketAddr>) {
        self.ep.addrs()
    }

    /// Set an option of its CM id (`rdma_set_option`: TOS, address reuse, IPv6 only).
    pub fn set_option(&self, opt: IdOption) -> io::Result<()> {
        self.ep.set_option(opt)
    }

    /// `rlisten`: take requests, at most `backlog` not yet answered (0: the CM's
    /// default); each accepted socket is made with `cfg`. On failure the socket comes back.
    pub fn listen(self, backlog: i32, cfg: Config) -> Result<Listener, (io::Error, Unconnected)> {
        if let Err(e) = self.ep.call(|c, _, id| c.listen(id, backlog)) {
            return Err((e, self));
        }
        Ok(Listener {
            ep: self.ep,
            cfg: Mutex::new(cfg),
            answered: Mutex::new(Vec::new()),
            ready: Mutex::new(std::collections::VecDeque::new()),
        })
    }

    /// `rconnect`: start connecting to `dst` with `cfg`'s sizes; [`Connecting::poll`]
    /// takes it on.
    pub fn connect(self, dst: SocketAddr, cfg: Config) -> Connecting {
        let step = match self.ep.call(|c, _, id| c.resolve_addr(id, None, dst)) {
            Ok(()) => Step::Addr(self.ep),
            Err(e) => Step::Failed(e.raw_os_error().unwrap_or(libc::EIO)),
        };
        Connecting { step, cfg }
    }
}

/// Where a connect is.
enum Step {
    /// Resolving the address.
    Addr(Endpoint),
    /// Resolving the route.
    Route(Endpoint),
    /// The request went with the socket's connection data: waiting for the reply.
    Reply(Box<Socket>),
    /// Failed with this errno.
    Failed(i32),
    /// Connected and handed out.
    Done,
}

/// A connect under way (rsockets' `rs_do_connect`), taken on by [`Connecting::poll`]
/// without blocking or by [`Connecting::wait`].
pub struct Connecting {
    step: Step,
    cfg: Config,
}

impl std::fmt::Debug for Connecting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let step = match &self.step {
            Step::Addr(_) => "resolving the address",
            Step::Route(_) => "resolving the route",
            Step::Reply(_) => "waiting for the reply",
            Step::Failed(_) => "failed",
            Step::Done => "connected",
        };
        f.debug_struct("Connecting").field("step", &step).finish()
    }
}

impl Connecting {
    fn endpoint(&self) -> Option<&Endpoint> {
        match &self.step {
            Step::Addr(ep) | Step::Route(ep) => Some(ep),
            Step::Reply(s) => Some(&s.ep),
            Step::Failed(_) | Step::Done => None,
        }
    }

    /// The CM channel's descriptor (the socket's), readable when the next step may go;
    /// None once failed or connected.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.endpoint().map(|ep| ep.chan.as_fd())
    }

    /// This side's and the peer's addresses as far as they are known.
    pub fn addrs(&self) -> (Option<SocketAddr>, Option<SocketAddr>) {
        self.endpoint().map_or((None, None), Endpoint::addrs)
    }

    /// Set an option of its CM id (EINVAL once failed or connected).
    pub fn set_option(&self, opt: IdOption) -> io::Result<()> {
        self.endpoint()
            .ok_or_else(|| errno(libc::EINVAL))?
            .set_option(opt)
    }

    /// Take every step the CM's events allow now: Ok(Some) once connected (later
    /// calls fail with EISCONN), Ok(None) while under way, the error once failed
    /// (ECONNREFUSED when rejected, EHOSTUNREACH when unreachable, ENOTSUP when the
    /// server is not rsockets, ...), and the same error on every later call.
    pub fn poll(&mut self) -> io::Result<Option<Socket>> {
        loop {
            let step = std::mem::replace(&mut self.step, Step::Done);
            let (next, out) = self.advance(step);
            self.step = next;
            match out {
                Advance::Again => continue,
                Advance::Wait => return Ok(None),
                Advance::Connected(s) => return Ok(Some(*s)),
                Advance::Failed(e) => return Err(errno(e)),
            }
        }
    }

    fn advance(&self, step: Step) -> (Step, Advance) {
        let fail = |e: io::Error| {
            let e = e.raw_os_error().unwrap_or(libc::EIO);
            (Step::Failed(e), Advance::Failed(e))
        };
        match step {
            Step::Failed(e) => (Step::Failed(e), Advance::Failed(e)),
            Step::Done => (Step::Done, Advance::Failed(libc::EISCONN)),
            Step::Addr(ep) => match ep.event() {
                Ok(None) => (Step::Addr(ep), Advance::Wait),
                Ok(Some(ev)) if ev.event == EventType::AddrResolved => {
                    match ep.call(|c, _, id| c.resolve_route(id)) {
                        Ok(()) => (Step::Route(ep), Advance::Again),
                        Err(e) => fail(e),
                    }
                }
                Ok(Some(ev)) => fail(event_error(&ev)),
                Err(e) => fail(e),
            },
            Step::Route(ep) => match ep.event() {
                Ok(None) => (Step::Route(ep), Advance::Wait),
                Ok(Some(ev)) if ev.event == EventType::RouteResolved => {
                    match Socket::make(ep, self.cfg) {
                        Ok(s) => match s.request() {
                            Ok(()) => (Step::Reply(Box::new(s)), Advance::Again),
                            Err(e) => fail(e),
                        },
                        Err((e, _)) => fail(e),
                    }
                }
                Ok(Some(ev)) => fail(event_error(&ev)),
                Err(e) => fail(e),
            },
            Step::Reply(s) => match s.ep.event() {
                Ok(None) => (Step::Reply(s), Advance::Wait),
                Ok(Some(ev)) if ev.event == EventType::ConnectResponse => match s.finish(&ev) {
                    Ok(()) => (Step::Done, Advance::Connected(s)),
                    Err(e) => fail(e),
                },
                Ok(Some(ev)) => fail(event_error(&ev)),
                Err(e) => fail(e),
            },
        }
    }

    /// Take the steps, waiting for the CM's events, until connected or failed, or
    /// `deadline` passes (ETIMEDOUT; None: the CM's own verdict).
    pub fn wait(mut self, deadline: Option<Instant>) -> io::Result<Socket> {
        loop {
            if let Some(s) = self.poll()? {
                return Ok(s);
            }
            let Some(slice) = slice_before(deadline) else {
                return Err(errno(libc::ETIMEDOUT));
            };
            if let Some(fd) = self.fd() {
                let _ = softrdma_device::poll_readable(&[fd], Some(slice));
            }
        }
    }
}

/// What one step of a connect came to.
enum Advance {
    Again,
    Wait,
    Connected(Box<Socket>),
    Failed(i32),
}

/// A listening rsocket: answers each request at once with its own QP and buffers, and
/// hands out a socket once the requester's RTU established it. Never waits on one
/// connection; answered connections that never complete are dropped after
/// [`Listener::ANSWER_WAIT`], and at most [`Listener::MAX_ANSWERED`] wait at once;
/// their requesters get a REJ.
///
/// An answered connection's CM events come to the listener's channel, as its request
/// did, until it is established: so the one descriptor [`Listener::fd`] wakes a waiter
/// for a request and for an RTU alike. Its socket is started (and its id moved to the
/// socket's own channel) only then, so one that never completes is dropped without a
/// close to wait for.
pub struct Listener {
    ep: Endpoint,
    cfg: Mutex<Config>,
    answered: Mutex<Vec<Answered>>,
    ready: Mutex<std::collections::VecDeque<Socket>>,
}

/// A connection answered and waiting for its RTU.
struct Answered {
    sock: Socket,
    /// The requester's connection data, taken when the connection is established.
    peer: ConnData,
    since: Instant,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener").field("id", &self.ep.id).finish()
    }
}

impl Listener {
    /// How long an answered connection may wait for its RTU: a legitimate one is
    /// established a round trip after the REP (or after its first retransmissions).
    pub const ANSWER_WAIT: Duration = Duration::from_secs(30);
    /// Answered connections waiting at once; past that the oldest is dropped, so
    /// requests that never complete hold a bounded amount and keep no newer one out.
    pub const MAX_ANSWERED: usize = 64;

    /// Listen on `addr` of `dev` (the wildcard address and port 0 allowed) with
    /// `backlog` requests not yet answered at most (0: the CM's default).
    pub fn bind(
        dev: &Arc<Device>,
        addr: SocketAddr,
        backlog: i32,
        cfg: Config,
    ) -> io::Result<Listener> {
        let u = Unconnected::new(dev)?;
        u.bind(addr)?;
        u.listen(backlog, cfg).map_err(|(e, _)| e)
    }

    /// The bound address (the port chosen when 0 was asked).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.ep.addrs().0
    }

    /// Set an option of its CM id.
    pub fn set_option(&self, opt: IdOption) -> io::Result<()> {
        self.ep.set_option(opt)
    }

    /// The sizes the connections accepted from now on are made with (a listening
    /// socket's options apply to what it accepts next, as in rsockets).
    pub fn set_config(&self, cfg: Config) {
        *self.cfg.lock().unwrap_or_else(|p| p.into_inner()) = cfg;
    }

    /// The CM channel's descriptor: readable while a request, or an answered
    /// connection's RTU (or its failure), waits for [`Listener::poll_accept`].
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.ep.chan.as_fd()
    }

    /// rsockets' `rs_accept` for one request: a socket with its receives posted,
    /// answered with this side's connection data. None when it was refused (not an
    /// rsockets request, or out of resources): the requester gets a REJ.
    fn answer(&self, ev: CmaEvent) -> Option<Answered> {
        let nid = ev.id;
        let agent = &self.ep.agent;
        let reject = || {
            let _ = agent.call(|c, now| {
                let _ = c.reject(now, nid, &[]);
                c.destroy_id(now, nid)
            });
            self.ep.chan.withdraw(nid);
        };
        let EventParam::Conn(req) = ev.param else {
            reject();
            return None;
        };
        let Ok(peer) = ConnData::parse(&req.private_data) else {
            reject();
            return None;
        };
        let Ok(chan) = EventChannel::new() else {
            reject();
            return None;
        };
        agent.attach(&chan);
        // The id's events stay on the listener's channel until it is established.
        let ep = Endpoint {
            dev: Arc::clone(&self.ep.dev),
            agent: Arc::clone(agent),
            chan,
            id: nid,
            live: true,
        };
        let cfg = *self.cfg.lock().unwrap_or_else(|p| p.into_inner());
        let s = match Socket::make(ep, cfg) {
            Ok(s) => s,
            Err((_, mut ep)) => {
                ep.live = false;
                reject();
                return None;
            }
        };
        let lim = RdLimits::of(&self.ep.dev);
        let (rr, depth) = lim.settle(
            Depth::Exactly(req.responder_resources),
            Depth::Exactly(req.initiator_depth),
            req.responder_resources,
            req.initiator_depth,
        );
        let p = ConnParam {
            private_data: s.lock().conn.conn_data().emit().to_vec(),
            responder_resources: rr,
            initiator_depth: depth,
            flow_control: req.flow_control,
            retry_count: req.retry_count,
            rnr_retry_count: req.rnr_retry_count,
            srq: 0,
            qp_num: s.objs.qp,
        };
        let ready = Ready {
            responder: Some(rr),
            initiator: Some(depth),
            min_rnr_timer: None,
        };
        let r = conn::accept(
            agent,
            nid,
            Some(ready),
            &p,
            |a: &QpAttr, m| s.modify(a, m),
            || s.to_error(),
        );
        if r.is_err() {
            // Its events came here; the socket's drop destroys the id.
            drop(s);
            self.ep.chan.withdraw(nid);
            return None;
        }
        Some(Answered {
            sock: s,
            peer,
            since: Instant::now(),
        })
    }

    /// An answered connection is established: start its socket, and move its id, with
    /// the events already queued for it, to the socket's own channel.
    fn establish(&self, a: Answered) -> Socket {
        let s = a.sock;
        s.lock().conn.start(&a.peer);
        let (id, to) = (s.ep.id, s.ep.chan.clone());
        let from = &self.ep.chan;
        // Under the CM's lock, which delivers events: none falls between the two.
        let moved = self.ep.agent.call(|c, _| {
            c.migrate(id, to.id())?;
            for mut e in from.withdraw_if(|e| e.id == id) {
                e.channel = to.id();
                to.deliver(e);
            }
            Ok::<(), CmaError>(())
        });
        if moved.is_err() {
            s.lock().conn.fail(libc::ECONNABORTED);
        }
        s
    }

    /// Give up on an answered connection that will not complete: a REJ tells its
    /// requester (where the CM can still send one), then it goes at once with its
    /// queued events (never started, it has no rsockets connection to shut down).
    fn discard(&self, a: Answered) {
        let id = a.sock.ep.id;
        let _ = a.sock.ep.call(|c, now, id| c.reject(now, id, &[]));
        drop(a);
        self.ep.chan.withdraw(id);
    }

    /// One step without waiting: answer the requests that came, and settle answered
    /// connections (established ones become ready; refused, failed or too old ones are
    /// dropped). Returns a ready socket if there is one.
    pub fn poll_accept(&self) -> Option<Socket> {
        while let Ok(Some(ev)) = self.ep.event() {
            if ev.event == EventType::ConnectRequest {
                let Some(new) = self.answer(ev) else {
                    continue;
                };
                let mut a = self.answered.lock().unwrap_or_else(|p| p.into_inner());
                if a.len() >= Listener::MAX_ANSWERED {
                    let oldest = (0..a.len()).min_by_key(|&k| a[k].since).unwrap_or(0);
                    let old = a.swap_remove(oldest);
                    self.discard(old);
                }
                a.push(new);
                continue;
            }
            let mut a = self.answered.lock().unwrap_or_else(|p| p.into_inner());
            let Some(k) = a.iter().position(|x| x.sock.ep.id == ev.id) else {
                continue; // an id already dropped
            };
            let this = a.swap_remove(k);
            drop(a);
            if ev.event == EventType::Established {
                let s = self.establish(this);
                self.ready
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push_back(s);
            } else {
                self.discard(this);
            }
        }
        let mut a = self.answered.lock().unwrap_or_else(|p| p.into_inner());
        let mut i = a.len();
        while i > 0 {
            i -= 1;
            if a[i].since.elapsed() >= Listener::ANSWER_WAIT {
                let old = a.swap_remove(i);
                self.discard(old);
            }
        }
        drop(a);
        self.ready
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop_front()
    }

    /// The next established connection, waiting at most `timeout` (None: forever;
    /// ETIMEDOUT when it passes).
    pub fn accept(&self, timeout: Option<Duration>) -> io::Result<Socket> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            if let Some(s) = self.poll_accept() {
                return Ok(s);
            }
            let Some(slice) = slice_before(deadline) else {
                return Err(errno(libc::ETIMEDOUT));
            };
            // In slices, so that answered connections past their wait go.
            let fds = [self.ep.chan.as_fd()];
            let _ = softrdma_device::poll_readable(&fds, Some(slice));
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        // The connections answered and never established are refused, and those
        // established and never accepted ended as a TCP listener resets them, by the
        // CM's DREQ without a close that waits for the peer, before the id that listened
        // goes.
        let answered =
            std::mem::take(&mut *self.answered.lock().unwrap_or_else(|p| p.into_inner()));
        for a in answered {
            self.discard(a);
        }
        let ready = std::mem::take(&mut *self.ready.lock().unwrap_or_else(|p| p.into_inner()));
        for s in ready {
            s.lock().conn.fail(libc::ECONNABORTED);
        }
    }
}
