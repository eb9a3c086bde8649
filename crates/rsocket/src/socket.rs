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
//! [`Socket::take_events`].

use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use softrdma_cm::agent::{Agent, EventChannel};
use softrdma_cm::cma::{CmaError, CmaEvent, ConnParam, EventParam, EventType, IdHandle};
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

struct Inner {
    conn: Conn,
    poller: CqPoller,
    armed: bool,
}

/// A stream rsocket: connected, or answered and waiting for its RTU ([`Listener`]).
pub struct Socket {
    dev: Arc<Device>,
    agent: Arc<Agent>,
    chan: EventChannel,
    id: IdHandle,
    objs: Objects,
    comp_fd: RawFd,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for Socket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Socket")
            .field("id", &self.id)
            .field("qp", &self.objs.qp)
            .field("phase", &self.lock().conn.phase())
            .finish()
    }
}

/// Take the next event of `chan`, waiting at most until `deadline`.
fn next_event(chan: &EventChannel, deadline: Option<Instant>) -> io::Result<CmaEvent> {
    let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
    chan.get_timeout(left)?
        .ok_or_else(|| errno(libc::ETIMEDOUT))
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
    /// The objects of a socket on id `id` whose events go to `chan`: PD, completion
    /// channel, CQ, the RC QP in INIT (as `rdma_create_qp` leaves it), the connection's
    /// buffers registered and its receives posted.
    fn make(
        dev: &Arc<Device>,
        agent: &Arc<Agent>,
        chan: EventChannel,
        id: IdHandle,
        mut cfg: Config,
    ) -> io::Result<Socket> {
        let max_wr = dev.device_attr().max_qp_wr;
        cfg.fit_device(max_wr);
        let conn = Conn::new(cfg).map_err(errno)?;
        let depth = cfg.cq_depth();
        let pd = dev.alloc_pd().map_err(verbs_err)?;
        let ch = match dev.create_channel() {
            Ok(ch) => ch,
            Err(e) => {
                let _ = dev.dealloc_pd(pd);
                return Err(verbs_err(e));
            }
        };
        let cq = match dev.create_cq(depth, Some(ch), false) {
            Ok((cq, _)) => cq,
            Err(e) => {
                let _ = dev.destroy_channel(ch);
                let _ = dev.dealloc_pd(pd);
                return Err(verbs_err(e));
            }
        };
        let comp_fd = dev.add_channel_fd(ch)?;
        let init = QpInitAttr {
            qp_type: QpType::Rc,
            pd,
            send_cq: cq,
            recv_cq: cq,
            srq: None,
            cap: cfg.qp_cap(),
            sq_sig_all: true,
        };
        let qp = dev.create_qp(init).map(|(q, _)| q);
        let mut objs = Objects {
            pd,
            ch,
            cq,
            qp: 0,
            lkeys: [0; 3],
        };
        let fail = |objs: &Objects, e: io::Error| {
            release(dev, objs);
            dev.remove_channel_fd(objs.ch);
            e
        };
        objs.qp = match qp {
            Ok(q) => q,
            Err(e) => return Err(fail(&objs, verbs_err(e))),
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
                Err(e) => return Err(fail(&objs, verbs_err(e))),
            }
        }
        let mut conn = conn;
        conn.set_keys(Keys {
            send_lkey: keys[0].0,
            target_rkey: keys[1].1,
            recv_rkey: keys[2].1,
        });
        let s = Socket {
            dev: Arc::clone(dev),
            agent: Arc::clone(agent),
            chan,
            id,
            objs,
            comp_fd,
            inner: Mutex::new(Inner {
                conn,
                poller: CqPoller::new(cq),
                armed: false,
            }),
        };
        // INIT with the CM's attributes, as `rdma_create_qp` moves a CM id's QP.
        let (a, m) = agent
            .call(|c, _| c.init_qp_attr(id, QpState::Init))
            .map_err(cma)?;
        s.modify(&a, m)?;
        {
            let mut g = s.lock();
            s.flush_posts(&mut g);
        }
        Ok(s)
    }

    fn modify(&self, a: &QpAttr, m: QpAttrMask) -> io::Result<()> {
        let qp = self.objs.qp;
        self.dev.modify_qp(qp, a, m).map_err(verbs_err)
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
    /// exchange (None: the CM's own verdict).
    pub fn connect(
        dev: &Arc<Device>,
        dst: SocketAddr,
        cfg: Config,
        timeout: Option<Duration>,
    ) -> io::Result<Socket> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let agent = Agent::for_device(dev)?;
        let chan = EventChannel::new()?;
        agent.attach(&chan);
        let ch = chan.id();
        let id = agent
            .call(|c, _| c.create_id(ch, port_space::TCP, None))
            .map_err(cma)?;
        let undo = |e: io::Error| {
            let _ = agent.call(|c, now| c.destroy_id(now, id));
            chan.withdraw(id);
            e
        };
        let step = |call: &dyn Fn(&mut softrdma_cm::cma::Cma) -> softrdma_cm::cma::Result<()>,
                    want: EventType|
         -> io::Result<()> {
            agent.call(|c, _| call(c)).map_err(cma)?;
            let ev = next_event(&chan, deadline)?;
            if ev.event != want {
                return Err(event_error(&ev));
            }
            Ok(())
        };
        if let Err(e) = step(&|c| c.resolve_addr(id, None, dst), EventType::AddrResolved)
            .and_then(|()| step(&|c| c.resolve_route(id), EventType::RouteResolved))
        {
            return Err(undo(e));
        }
        let s = match Socket::make(dev, &agent, chan.clone(), id, cfg) {
            Ok(s) => s,
            Err(e) => return Err(undo(e)),
        };
        let lim = RdLimits::of(dev);
        let (rr, depth) = lim.offer(Depth::Exactly(0), Depth::Exactly(0));
        let p = ConnParam {
            private_data: s.lock().conn.conn_data().emit().to_vec(),
            responder_resources: rr,
            initiator_depth: depth,
            flow_control: crate::config::CONNECT_FLOW_CONTROL,
            retry_count: crate::config::CONNECT_RETRY,
            rnr_retry_count: crate::config::CONNECT_RNR_RETRY,
            srq: 0,
            qp_num: s.objs.qp,
        };
        agent.call(|c, now| c.connect(now, id, &p)).map_err(cma)?;
        let ev = next_event(&s.chan, deadline)?;
        if ev.event != EventType::ConnectResponse {
            return Err(event_error(&ev));
        }
        let EventParam::Conn(rep) = &ev.param else {
            return Err(errno(libc::EPROTO));
        };
        let peer = match ConnData::parse(&rep.private_data) {
            Ok(d) => d,
            Err(_) => {
                // Not an rsockets server: refuse its answer as librdmacm does a failed
                // response (the QP to ERR, a REJ).
                s.to_error();
                let _ = agent.call(|c, now| c.reject(now, id, &[]));
                return Err(errno(libc::ENOTSUP));
            }
        };
        conn::complete_connect(
            &agent,
            id,
            Some(Ready::default()),
            |a: &QpAttr, m| s.modify(a, m),
            || s.to_error(),
        )?;
        s.lock().conn.start(&peer);
        Ok(s)
    }

    /// The device it is on.
    pub fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    /// This side's and the peer's addresses.
    pub fn addrs(&self) -> (Option<SocketAddr>, Option<SocketAddr>) {
        self.agent
            .call(|c, _| c.addrs(self.id))
            .unwrap_or((None, None))
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
        [comp, self.chan.as_fd()]
    }

    /// Post what the connection asks for; a refused post fails the connection.
    fn flush_posts(&self, g: &mut Inner) {
        let qp = self.objs.qp;
        while let Some(p) = g.conn.poll_post() {
            let r = match p {
                Post::Send(wr) => self.dev.post_send(qp, wr),
                Post::Recv(wr) => self.dev.post_recv(qp, wr),
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
            let n = match g.poller.poll(&self.dev, &mut wcs) {
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
                let id = self.id;
                let _ = self.agent.call(|c, now| c.disconnect(now, id));
            }
        }
        g.conn.update_credits();
        self.flush_posts(g);
        while let Ok(Some(ev)) = self.chan.get_timeout(Some(Duration::ZERO)) {
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
    fn wait(&self, deadline: Option<Instant>, test: impl Fn(&Conn) -> bool) -> io::Result<bool> {
        loop {
            {
                let mut g = self.lock();
                self.progress(&mut g);
                if test(&g.conn) {
                    return Ok(true);
                }
            }
            let now = Instant::now();
            let slice = match deadline {
                Some(d) if now >= d => return Ok(false),
                Some(d) => (d - now).min(WAIT_SLICE),
                None => WAIT_SLICE,
            };
            let gen = self.dev.generation();
            self.dev
                .wait_for(Some(slice), || (self.dev.generation() != gen).then_some(()));
        }
    }

    /// Send `data` (rsockets' `rsend`): as much as fits now when `nonblocking` (EAGAIN
    /// when nothing does), else all of it, waiting for credits and offers. A short count
    /// when the connection fails part way; EPIPE/ECONNRESET when it cannot send.
    pub fn send(&self, data: &[u8], nonblocking: bool) -> io::Result<usize> {
        let mut sizes = TransferSizes::default();
        let mut done = 0;
        let mut err = None;
        while done < data.len() {
            {
                let mut g = self.lock();
                if !g.conn.can_send() {
                    self.progress(&mut g);
                }
                if !g.conn.writable() {
                    err = Some(g.conn.error().unwrap_or(libc::ECONNRESET));
                    break;
                }
                if g.conn.can_send() {
                    let want = sizes.next(data.len() - done);
                    let src = &data[done..];
                    let mut at = 0;
                    let n = g.conn.send_data(want, &mut |dst: &mut [u8]| {
                        dst.copy_from_slice(&src[at..at + dst.len()]);
                        at += dst.len();
                    });
                    done += n as usize;
                    self.flush_posts(&mut g);
                    continue;
                }
                if nonblocking {
                    err = Some(libc::EAGAIN);
                    break;
                }
            }
            self.wait(None, |c| c.can_send() || !c.writable())?;
        }
        partial_result(done, err).map_err(errno)
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
            self.wait(None, |c| c.have_rdata() || !c.readable())?;
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
            if self.dev.req_notify_cq(cq, Arm::Next).is_err() {
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
        while let Some(cq) = self.dev.get_cq_event(ch) {
            let _ = self.dev.ack_cq_events(cq, 1);
            g.armed = false;
        }
    }

    /// `rshutdown`: close reading, writing or both, telling the peer (waiting for a free
    /// control slot and for the sends before it to complete).
    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        let ctrl = self.lock().conn.shutdown(how);
        if let Some(ctrl) = ctrl {
            let deadline = Some(Instant::now() + CLOSE_WAIT);
            self.wait(deadline, |c| c.ctrl_avail() || !c.is_connected())?;
            let mut g = self.lock();
            if g.conn.send_ctrl(ctrl) {
                self.flush_posts(&mut g);
            }
        }
        let deadline = Some(Instant::now() + CLOSE_WAIT);
        self.wait(deadline, |c| c.all_sends_done())?;
        if self.lock().conn.phase() == Phase::Disconnected || ctrl == Some(Ctrl::Disconnect) {
            // Flushing the receives wakes whoever polls the socket.
            self.to_error();
        }
        Ok(())
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

/// Destroy what `make` made on the device, QP first (it could still write the regions).
fn release(dev: &Device, o: &Objects) {
    if o.qp != 0 {
        let _ = dev.destroy_qp(o.qp);
    }
    for &k in &o.lkeys {
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
        let id = self.id;
        let _ = self.agent.call(|c, now| {
            let _ = c.disconnect(now, id);
            c.destroy_id(now, id)
        });
        self.chan.withdraw(id);
        release(&self.dev, &self.objs);
        self.dev.remove_channel_fd(self.objs.ch);
    }
}

/// A listening rsocket: answers each request at once with its own QP and buffers, and
/// hands out a socket once the requester's RTU established it. Never waits on one
/// connection; answered connections that never complete are dropped after
/// [`Listener::ANSWER_WAIT`], and at most [`Listener::MAX_ANSWERED`] wait at once.
pub struct Listener {
    dev: Arc<Device>,
    agent: Arc<Agent>,
    chan: EventChannel,
    id: IdHandle,
    cfg: Config,
    answered: Mutex<Vec<(Socket, Instant)>>,
    ready: Mutex<std::collections::VecDeque<Socket>>,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener").field("id", &self.id).finish()
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
        let agent = Agent::for_device(dev)?;
        let chan = EventChannel::new()?;
        agent.attach(&chan);
        let ch = chan.id();
        let id = agent
            .call(|c, _| c.create_id(ch, port_space::TCP, None))
            .map_err(cma)?;
        let r = agent
            .call(|c, _| c.bind(id, addr).and_then(|()| c.listen(id, backlog)))
            .map_err(cma);
        if let Err(e) = r {
            let _ = agent.call(|c, now| c.destroy_id(now, id));
            return Err(e);
        }
        Ok(Listener {
            dev: Arc::clone(dev),
            agent,
            chan,
            id,
            cfg,
            answered: Mutex::new(Vec::new()),
            ready: Mutex::new(std::collections::VecDeque::new()),
        })
    }

    /// The bound address (the port chosen when 0 was asked).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.agent
            .call(|c, _| c.addrs(self.id))
            .ok()
            .and_then(|a| a.0)
    }

    /// The CM channel's descriptor: readable while a request waits. Answered sockets
    /// settle on their own channels: poll [`Listener::poll_accept`] now and then too.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.chan.as_fd()
    }

    /// rsockets' `rs_accept` for one request: a socket with the requester's connection
    /// data, its receives posted, answered with this side's. None when it was refused
    /// (not an rsockets request, or out of resources): the requester gets a REJ.
    fn answer(&self, ev: CmaEvent) -> Option<Socket> {
        let nid = ev.id;
        let reject = || {
            let _ = self.agent.call(|c, now| {
                let _ = c.reject(now, nid, &[]);
                c.destroy_id(now, nid)
            });
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
        self.agent.attach(&chan);
        let ch = chan.id();
        if self.agent.call(|c, _| c.migrate(nid, ch)).is_err() {
            reject();
            return None;
        }
        let s = match Socket::make(&self.dev, &self.agent, chan, nid, self.cfg) {
            Ok(s) => s,
            Err(_) => {
                reject();
                return None;
            }
        };
        s.lock().conn.start(&peer);
        let lim = RdLimits::of(&self.dev);
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
            &self.agent,
            nid,
            Some(ready),
            &p,
            |a: &QpAttr, m| s.modify(a, m),
            || s.to_error(),
        );
        r.ok().map(|()| s)
    }

    /// One step without waiting: answer the requests that came, and settle answered
    /// connections (established ones become ready; refused, failed or too old ones are
    /// dropped). Returns a ready socket if there is one.
    pub fn poll_accept(&self) -> Option<Socket> {
        while let Ok(Some(ev)) = self.chan.get_timeout(Some(Duration::ZERO)) {
            if ev.event != EventType::ConnectRequest {
                continue;
            }
            if let Some(s) = self.answer(ev) {
                let mut a = self.answered.lock().unwrap_or_else(|p| p.into_inner());
                if a.len() >= Listener::MAX_ANSWERED {
                    let oldest = (0..a.len()).min_by_key(|&k| a[k].1).unwrap_or(0);
                    drop(a.swap_remove(oldest));
                }
                a.push((s, Instant::now()));
            }
        }
        let mut a = self.answered.lock().unwrap_or_else(|p| p.into_inner());
        let mut i = a.len();
        while i > 0 {
            i -= 1;
            match a[i].0.chan.get_timeout(Some(Duration::ZERO)) {
                Ok(Some(ev)) if ev.event == EventType::Established => {
                    let (s, _) = a.swap_remove(i);
                    self.ready
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push_back(s);
                }
                Ok(Some(_)) | Err(_) => drop(a.swap_remove(i)),
                Ok(None) if a[i].1.elapsed() >= Listener::ANSWER_WAIT => {
                    drop(a.swap_remove(i));
                }
                Ok(None) => {}
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
            let now = Instant::now();
            let slice = match deadline {
                Some(d) if now >= d => return Err(errno(libc::ETIMEDOUT)),
                Some(d) => (d - now).min(WAIT_SLICE),
                None => WAIT_SLICE,
            };
            // Answered sockets settle on their own channels: look again soon while any
            // wait.
            let waiting = !self
                .answered
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_empty();
            let slice = if waiting {
                slice.min(Duration::from_millis(5))
            } else {
                slice
            };
            let fds = [self.chan.as_fd()];
            let _ = softrdma_device::poll_readable(&fds, Some(slice));
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.answered
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        self.ready.lock().unwrap_or_else(|p| p.into_inner()).clear();
        let id = self.id;
        let _ = self.agent.call(|c, now| c.destroy_id(now, id));
        self.chan.withdraw(id);
    }
}
