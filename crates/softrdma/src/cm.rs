//! Connecting queue pairs through the connection manager (rdma_cm), as librdmacm
//! programs do: a server listens on an IP port, a client connects to it, and the two
//! exchange QP numbers, starting PSNs and up to 56 / 196 bytes of private data in the IB
//! CM's REQ / REP / RTU handshake over QP1 — the same MADs Linux's rdma_cm sends over
//! RoCE — instead of over a side channel of their own.
//!
//! Every device runs its own CM (a thread, started by the first CM object made on the
//! device). Port numbers are reserved host-wide, so a server bound to the wildcard
//! address in one process is found at 127.0.0.1 by a client in another.
//!
//! Two levels:
//!
//! - [`Listener`], [`connect`] and [`Connection`]: a connected [`QueuePair`] in one call
//!   on each side, with the QP moved INIT → RTR → RTS where librdmacm moves it.
//! - [`EventChannel`], [`CmId`] and [`Event`]: the rdma_cm calls and events one by one,
//!   for programs that drive their own state machine (and poll the channel's fd).
//!
//! A server and a client, here two devices and two threads of one process (usually two
//! processes, or two hosts):
//!
//! ```
//! use std::time::Duration;
//! use softrdma::cm::{self, AcceptOptions, ConnectOptions, Listener};
//! use softrdma::{wr, Access, Device, QpInit, QpType};
//! # fn main() -> softrdma::Result<()> {
//! let t = Duration::from_secs(10);
//! // Server: port 0 picks a free port; the wildcard address is found at 127.0.0.1.
//! let dev = Device::open_default()?;
//! let listener = Listener::bind(&dev, "0.0.0.0:0".parse().unwrap())?;
//! let port = listener.local_addr().port();
//! let server = std::thread::spawn(move || -> softrdma::Result<Vec<u8>> {
//!     let pd = dev.alloc_pd()?;
//!     let cq = dev.create_cq(128, None)?; // room for the QP's 64 + 64 WRs
//!     let mem = pd.register(4096, Access::LOCAL_WRITE)?;
//!     let init = QpInit::new(QpType::Rc, &cq);
//!     // The `_with` variant runs the closure on the QP in INIT, before the client can
//!     // send: the place to post receives.
//!     let conn = listener.accept_with(&pd, &init, &AcceptOptions::new(b"welcome"), |qp| {
//!         qp.post_recv(wr::recv(1, [mem.sge(0..64)?]))
//!     })?;
//!     assert_eq!(&conn.private_data()[..5], b"hello"); // the client's REQ
//!     let wc = cq.wait(t)?;
//!     wc.result()?;
//!     conn.wait_disconnected(Some(t))?; // the client ends it
//!     mem.to_vec(0, wc.byte_len as usize)
//! });
//!
//! // Client: a connected RC QP in one call.
//! let dev = Device::open_default()?;
//! let pd = dev.alloc_pd()?;
//! let cq = dev.create_cq(128, None)?;
//! let mem = pd.register(4096, Access::LOCAL_WRITE)?;
//! let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
//! let opts = ConnectOptions::new(b"hello");
//! let conn = cm::connect(&pd, &QpInit::new(QpType::Rc, &cq), addr, &opts)?;
//! assert_eq!(&conn.private_data()[..7], b"welcome"); // the server's REP
//! mem.write(0, b"over the CM")?;
//! conn.qp().post_send(wr::send(2, [mem.sge(0..11)?]))?;
//! cq.wait(t)?.result()?;
//! conn.disconnect()?; // both sides see the connection close
//! assert_eq!(server.join().unwrap()?, b"over the CM");
//! # Ok(()) }
//! ```

use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use softrdma_cm::agent::{self, Agent};
use softrdma_cm::cma::{CmaEvent, EventParam, Service};
use softrdma_cm::conn::{self, Depth, RdLimits, Ready};
use softrdma_transport::verbs::{QpAttr, QpAttrMask, QpState, QpType};
use softrdma_wire::cm::{port_space, rej_reason};

use crate::error::Rejection;
use crate::{Device, Error, ErrorKind, ProtectionDomain, QpInit, QueuePair, Result};

#[cfg(feature = "tokio")]
mod async_cm;
#[cfg(feature = "tokio")]
pub use async_cm::{connect_async, connect_with_async, AsyncEventChannel, AsyncListener};

pub use softrdma_cm::cma::{
    CmaError, ConnParam, EventType, IdOption, IdState, Timeouts, UdParam, MAX_ACCEPT_PRIVATE,
    MAX_CONNECT_PRIVATE, MAX_REJECT_PRIVATE, MAX_UD_ACCEPT_PRIVATE, MAX_UD_CONNECT_PRIVATE,
    UDP_QKEY,
};

/// Outstanding RDMA READs and atomics the helpers offer by default, each way.
const DEFAULT_RD_ATOMIC: u8 = 16;
/// The RNR NAK timer code the helpers advertise by default: 0.64 ms, as rdma-core's
/// pingpong examples use.
const DEFAULT_MIN_RNR_TIMER: u8 = 12;

/// The device's CM ([`Agent::for_device`]: one per device, whichever face asks).
fn agent_of(dev: &Device) -> Result<Arc<Agent>> {
    let mut slot = dev.inner.cm.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(a) = slot.as_ref() {
        return Ok(Arc::clone(a));
    }
    let a = Agent::for_device(&dev.inner.dev).map_err(|e| {
        let msg = format!("starting the CM of {}: {e}", dev.name());
        Error::io(e, libc::EIO, msg)
    })?;
    *slot = Some(Arc::clone(&a));
    Ok(a)
}

/// Make the CM of `dev` wait for answers as `t` says, for the requests, replies and
/// disconnects it sends from now on. The default is Linux's (a request is tried 16
/// times, about 4.6 s apart, before UNREACHABLE); shorter suits tests and programs that
/// would rather fail fast.
pub fn set_timeouts(dev: &Device, t: Timeouts) -> Result<()> {
    agent_of(dev)?.call(|c, _| c.set_timeouts(t));
    Ok(())
}

/// An rdma_cm port space: ports are only shared within one, and it fixes the QP type of
/// its ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PortSpace {
    /// `RDMA_PS_TCP`: reliable connected QPs.
    Tcp,
    /// `RDMA_PS_UDP`: unreliable datagram QPs, resolved by SIDR.
    Udp,
    /// `RDMA_PS_IB` with the QP type it carries (RC, UC or UD).
    Ib(QpType),
}

impl PortSpace {
    /// The port space a QP type is connected in by default: RC in TCP, UD in UDP, UC in
    /// IB (the only one that takes it).
    pub fn for_qp_type(t: QpType) -> PortSpace {
        match t {
            QpType::Rc => PortSpace::Tcp,
            QpType::Ud => PortSpace::Udp,
            QpType::Uc => PortSpace::Ib(QpType::Uc),
        }
    }

    /// The QP type of the space's ids.
    pub fn qp_type(self) -> QpType {
        match self {
            PortSpace::Tcp => QpType::Rc,
            PortSpace::Udp => QpType::Ud,
            PortSpace::Ib(t) => t,
        }
    }

    fn raw(self) -> (u16, Option<Service>) {
        match self {
            PortSpace::Tcp => (port_space::TCP, None),
            PortSpace::Udp => (port_space::UDP, None),
            PortSpace::Ib(t) => (
                port_space::IB,
                Some(match t {
                    QpType::Rc => Service::Rc,
                    QpType::Uc => Service::Uc,
                    QpType::Ud => Service::Ud,
                }),
            ),
        }
    }

    fn from_raw(ps: u16, s: Service) -> PortSpace {
        match ps {
            port_space::TCP => PortSpace::Tcp,
            port_space::UDP => PortSpace::Udp,
            _ => PortSpace::Ib(match s {
                Service::Rc => QpType::Rc,
                Service::Uc => QpType::Uc,
                Service::Ud => QpType::Ud,
            }),
        }
    }
}

/// Where the CM events of a device's ids arrive (`rdma_event_channel`). Its fd is
/// readable while events wait, so it fits poll/epoll loops. Cheap to clone (shared).
///
/// A channel belongs to one device: every device runs its own CM, whose ids it carries.
#[derive(Clone)]
pub struct EventChannel {
    dev: Device,
    agent: Arc<Agent>,
    ch: agent::EventChannel,
}

impl std::fmt::Debug for EventChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventChannel")
            .field("device", &self.dev.name())
            .field("id", &self.ch.id())
            .finish()
    }
}

impl EventChannel {
    /// A channel for ids of `dev` (starting the device's CM if this is its first CM
    /// object).
    pub fn new(dev: &Device) -> Result<EventChannel> {
        let agent = agent_of(dev)?;
        let ch = agent::EventChannel::new()?;
        agent.attach(&ch);
        Ok(EventChannel {
            dev: dev.clone(),
            agent,
            ch,
        })
    }

    /// The device whose ids report here.
    pub fn device(&self) -> &Device {
        &self.dev
    }

    /// Wait for the next event (`rdma_get_cm_event`); `None` waits forever. ETIMEDOUT
    /// when none came in time.
    pub fn next_event(&self, timeout: Option<Duration>) -> Result<Event> {
        match self.ch.get_timeout(timeout)? {
            Some(ev) => Ok(self.wrap(ev)),
            None => Err(Error::timed_out("no CM event")),
        }
    }

    /// The next event if one is waiting.
    pub fn try_next_event(&self) -> Result<Option<Event>> {
        Ok(self
            .ch
            .get_timeout(Some(Duration::ZERO))?
            .map(|e| self.wrap(e)))
    }

    /// Events waiting.
    pub fn pending(&self) -> usize {
        self.ch.pending()
    }

    fn wrap(&self, ev: CmaEvent) -> Event {
        let new_id = if ev.event == EventType::ConnectRequest {
            // The request's id inherits its listener's port space.
            let kind = self.agent.call(|c, _| c.kind(ev.id));
            kind.ok().map(|(ps, s)| CmId {
                chan: self.clone(),
                handle: ev.id,
                ps: PortSpace::from_raw(ps, s),
            })
        } else {
            None
        };
        Event {
            kind: ev.event,
            id: ev.id,
            listen_id: ev.listen_id,
            status: ev.status,
            param: ev.param,
            new_id,
        }
    }

    fn same_device(&self, other: &EventChannel) -> bool {
        Arc::ptr_eq(&self.agent, &other.agent)
    }
}

impl AsFd for EventChannel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.ch.as_fd()
    }
}

impl AsRawFd for EventChannel {
    fn as_raw_fd(&self) -> RawFd {
        self.ch.as_raw_fd()
    }
}

/// A CM event (`struct rdma_cm_event`).
#[derive(Debug)]
pub struct Event {
    kind: EventType,
    id: u32,
    listen_id: Option<u32>,
    status: i32,
    param: EventParam,
    new_id: Option<CmId>,
}

impl Event {
    /// What happened.
    pub fn kind(&self) -> EventType {
        self.kind
    }
    /// The handle ([`CmId::handle`]) of the id it is about; for a connection request,
    /// the new id's.
    pub fn id(&self) -> u32 {
        self.id
    }
    /// For a connection request: the listener's handle.
    pub fn listen_id(&self) -> Option<u32> {
        self.listen_id
    }
    /// 0; for REJECTED the REJ reason; for errors a negative errno (UNREACHABLE:
    /// `-ETIMEDOUT`).
    pub fn status(&self) -> i32 {
        self.status
    }
    /// The peer's private data, zero-padded to its message's size as the rdma_cm
    /// delivers it (56 bytes in a REQ, 196 in a REP, 148 in a REJ).
    pub fn private_data(&self) -> &[u8] {
        match &self.param {
            EventParam::Conn(p) => &p.private_data,
            EventParam::Ud(p) => &p.private_data,
            EventParam::None => &[],
        }
    }
    /// The connection parameters of a connected-service event.
    pub fn conn_param(&self) -> Option<&ConnParam> {
        match &self.param {
            EventParam::Conn(p) => Some(p),
            _ => None,
        }
    }
    /// The datagram parameters of a UD event (the peer's QPN, Q_Key and address vector
    /// on ESTABLISHED).
    pub fn ud_param(&self) -> Option<&UdParam> {
        match &self.param {
            EventParam::Ud(p) => Some(p),
            _ => None,
        }
    }
    /// For a connection request: the new id, to accept or reject. Dropping it unanswered
    /// destroys it, which rejects the request.
    pub fn take_id(&mut self) -> Option<CmId> {
        self.new_id.take()
    }
}

/// An rdma_cm identifier (`rdma_cm_id`): one endpoint — a listener, or one side of a
/// connection. Dropping it destroys it (`rdma_destroy_id`): a request it holds is
/// rejected, a connection is disconnected, its port is released.
pub struct CmId {
    chan: EventChannel,
    handle: u32,
    ps: PortSpace,
}

impl std::fmt::Debug for CmId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CmId")
            .field("handle", &self.handle)
            .field("port_space", &self.ps)
            .finish()
    }
}

impl CmId {
    /// A new id in `ps` whose events go to `channel` (`rdma_create_id`).
    pub fn new(channel: &EventChannel, ps: PortSpace) -> Result<CmId> {
        let (raw, service) = ps.raw();
        let ch = channel.ch.id();
        let handle = channel.agent.call(|c, _| c.create_id(ch, raw, service))?;
        Ok(CmId {
            chan: channel.clone(),
            handle,
            ps,
        })
    }

    fn call<R>(
        &self,
        f: impl FnOnce(&mut softrdma_cm::cma::Cma, u64, u32) -> softrdma_cm::cma::Result<R>,
    ) -> Result<R> {
        let h = self.handle;
        Ok(self.chan.agent.call(|c, now| f(c, now, h))?)
    }

    /// The id's number in events ([`Event::id`]).
    pub fn handle(&self) -> u32 {
        self.handle
    }
    /// Its port space.
    pub fn port_space(&self) -> PortSpace {
        self.ps
    }
    /// The channel its events go to.
    pub fn channel(&self) -> &EventChannel {
        &self.chan
    }
    /// Its device.
    pub fn device(&self) -> &Device {
        &self.chan.dev
    }
    /// Where it is in its life.
    pub fn state(&self) -> Result<IdState> {
        self.call(|c, _, h| c.state(h))
    }
    /// `rdma_set_option`: type of service, REUSEADDR, AFONLY (both before binding), ACK
    /// timeout.
    pub fn set_option(&self, opt: IdOption) -> Result<()> {
        self.call(|c, _, h| c.set_option(h, opt))
    }
    /// `rdma_bind_addr`: reserve `addr` host-wide (the wildcard IP and port 0 are
    /// allowed; [`CmId::local_addr`] then tells the port). EADDRINUSE or EADDRNOTAVAIL
    /// when another id holds it, with Linux's rules.
    pub fn bind(&self, addr: SocketAddr) -> Result<()> {
        self.call(|c, _, h| c.bind(h, addr))
    }
    /// The bound address (`rdma_get_local_addr`).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.call(|c, _, h| c.addrs(h)).ok().and_then(|a| a.0)
    }
    /// The peer's address (`rdma_get_peer_addr`).
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.call(|c, _, h| c.addrs(h)).ok().and_then(|a| a.1)
    }
    /// `rdma_resolve_addr`: bind (to `src` or an ephemeral port) if not bound, find the
    /// device serving `dst`; ADDR_RESOLVED follows.
    pub fn resolve_addr(&self, src: Option<SocketAddr>, dst: SocketAddr) -> Result<()> {
        self.call(|c, _, h| c.resolve_addr(h, src, dst))
    }
    /// `rdma_resolve_route`; ROUTE_RESOLVED follows (RoCE needs no path query).
    pub fn resolve_route(&self) -> Result<()> {
        self.call(|c, _, h| c.resolve_route(h))
    }
    /// `rdma_listen`: take connection requests (CONNECT_REQUEST events); `backlog` caps
    /// the requests not yet answered (0: the default, 1024).
    pub fn listen(&self, backlog: i32) -> Result<()> {
        self.call(|c, _, h| c.listen(h, backlog))
    }
    /// `rdma_connect`: send the connection request (a SIDR request for UD ids). `p`
    /// carries the QP number, resources and at most [`MAX_CONNECT_PRIVATE`] bytes of
    /// private data ([`MAX_UD_CONNECT_PRIVATE`] for UD).
    pub fn connect(&self, p: &ConnParam) -> Result<()> {
        self.call(|c, now, h| c.connect(now, h, p))
    }
    /// `rdma_accept`. On a connection request: answer with the REP (or SIDR_REP; UD ids
    /// answer with [`UDP_QKEY`] in the UDP port space). On the connecting side after
    /// CONNECT_RESPONSE: send the RTU.
    pub fn accept(&self, p: &ConnParam) -> Result<()> {
        self.call(|c, now, h| c.accept(now, h, p))
    }
    /// `rdma_reject`: refuse a connection request with up to [`MAX_REJECT_PRIVATE`] bytes
    /// of private data (REJ reason 28, consumer reject).
    pub fn reject(&self, private_data: &[u8]) -> Result<()> {
        self.call(|c, now, h| c.reject(now, h, private_data))
    }
    /// `rdma_disconnect`'s CM half: send the DREQ (or the DREP when the peer asked
    /// first). Move the QP to ERR too ([`CmId::modify_qp`] with [`QpState::Err`] or
    /// [`QueuePair::to_error`]); [`Connection::disconnect`] does both.
    pub fn disconnect(&self) -> Result<()> {
        self.call(|c, now, h| c.disconnect(now, h))
    }
    /// `rdma_establish`: the QP received before the RTU came; the connection is up.
    pub fn establish(&self) -> Result<()> {
        self.call(|c, now, h| c.establish(now, h))
    }
    /// `rdma_init_qp_attr`: the attributes and mask that move this id's QP to INIT, RTR
    /// or RTS from what the handshake carried.
    pub fn init_qp_attr(&self, state: QpState) -> Result<(QpAttr, QpAttrMask)> {
        self.call(|c, _, h| c.init_qp_attr(h, state))
    }
    /// `rdma_migrate_id`: send this id's future events to `channel` (of the same device).
    pub fn migrate(&mut self, channel: &EventChannel) -> Result<()> {
        if !self.chan.same_device(channel) {
            return Err(Error::invalid("the channel belongs to another device")
                .with_kind(ErrorKind::ForeignObject));
        }
        let ch = channel.ch.id();
        self.call(|c, _, h| c.migrate(h, ch))?;
        self.chan = channel.clone();
        Ok(())
    }

    /// `rdma_create_qp`: a QP of the id's type on `pd`, in INIT with the id's
    /// attributes (UD QPs go on to RTS: they need no peer).
    pub fn create_qp(&self, pd: &ProtectionDomain, init: &QpInit<'_>) -> Result<QueuePair> {
        if !Arc::ptr_eq(&pd.device().inner, &self.chan.dev.inner) {
            return Err(
                Error::invalid("the PD belongs to another device than the CM id")
                    .with_kind(ErrorKind::ForeignObject),
            );
        }
        if init.qp_type != self.ps.qp_type() {
            return Err(Error::invalid(format!(
                "a {:?} QP does not fit a CM id of port space {:?}",
                init.qp_type, self.ps
            )));
        }
        let qp = pd.create_qp(init)?;
        self.modify_qp(&qp, QpState::Init)?;
        if init.qp_type == QpType::Ud {
            self.modify_qp(&qp, QpState::Rtr)?;
            self.modify_qp(&qp, QpState::Rts)?;
        }
        Ok(qp)
    }

    /// Move `qp` to `state` with [`CmId::init_qp_attr`]'s attributes (ERR needs none).
    pub fn modify_qp(&self, qp: &QueuePair, state: QpState) -> Result<()> {
        if state == QpState::Err {
            return qp.to_error();
        }
        let (attr, mask) = self.init_qp_attr(state)?;
        qp.modify(&attr, mask)
    }

    /// Move `qp` with the CM layer's attributes, for its steps ([`conn`]).
    fn modifier<'a>(qp: &'a QueuePair) -> impl FnMut(&QpAttr, QpAttrMask) -> Result<()> + 'a {
        move |a, m| qp.modify(a, m)
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        let h = self.handle;
        let _ = self.chan.agent.call(|c, now| c.destroy_id(now, h));
        self.chan.ch.withdraw(h);
    }
}

/// What a client offers in [`connect`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectOptions {
    /// Private data for the server, at most [`MAX_CONNECT_PRIVATE`] bytes (56;
    /// [`MAX_UD_CONNECT_PRIVATE`] for UD).
    pub private_data: Vec<u8>,
    /// RDMA READs and atomics the server may have outstanding against us.
    pub responder_resources: u8,
    /// RDMA READs and atomics we may have outstanding against the server.
    pub initiator_depth: u8,
    /// Transport retries on timeouts and sequence errors (at most 7).
    pub retry_count: u8,
    /// Retries on RNR NAKs (7: forever).
    pub rnr_retry_count: u8,
    /// The RNR NAK timer code our receive side advertises (12: 0.64 ms). The rdma_cm
    /// gives 0 (655 ms), which makes a peer that sends before we posted a receive wait
    /// that long.
    pub min_rnr_timer: u8,
    /// The port space; None takes the QP type's ([`PortSpace::for_qp_type`]).
    pub port_space: Option<PortSpace>,
    /// The local address to bind; None: the device's, with an ephemeral port.
    pub src: Option<SocketAddr>,
    /// How long to wait for the whole exchange; None: until the CM's own verdict (it
    /// retries an unanswered request 15 times, about a minute, before UNREACHABLE).
    pub timeout: Option<Duration>,
}

impl ConnectOptions {
    /// Options with `private_data` and the defaults: 16 READs/atomics each way, 7
    /// retries, RNR retries forever.
    pub fn new(private_data: &[u8]) -> ConnectOptions {
        ConnectOptions {
            private_data: private_data.to_vec(),
            ..ConnectOptions::default()
        }
    }
}

impl Default for ConnectOptions {
    fn default() -> ConnectOptions {
        ConnectOptions {
            private_data: Vec::new(),
            responder_resources: DEFAULT_RD_ATOMIC,
            initiator_depth: DEFAULT_RD_ATOMIC,
            retry_count: 7,
            rnr_retry_count: 7,
            min_rnr_timer: DEFAULT_MIN_RNR_TIMER,
            port_space: None,
            src: None,
            timeout: None,
        }
    }
}

/// What a server answers with in [`ConnectRequest::accept`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcceptOptions {
    /// Private data for the client, at most [`MAX_ACCEPT_PRIVATE`] bytes (196;
    /// [`MAX_UD_ACCEPT_PRIVATE`] for UD).
    pub private_data: Vec<u8>,
    /// Most RDMA READs and atomics the client may have outstanding against us (the
    /// client's request lowers it).
    pub responder_resources: u8,
    /// Most RDMA READs and atomics we may have outstanding against the client (the
    /// client's request lowers it).
    pub initiator_depth: u8,
    /// Retries on RNR NAKs the client should make (7: forever).
    pub rnr_retry_count: u8,
    /// The RNR NAK timer code our receive side advertises (as
    /// [`ConnectOptions::min_rnr_timer`]).
    pub min_rnr_timer: u8,
    /// How long to wait for the client's RTU; None: until the CM's own verdict.
    pub timeout: Option<Duration>,
}

impl AcceptOptions {
    /// Options with `private_data` and the defaults (as [`ConnectOptions::new`]).
    pub fn new(private_data: &[u8]) -> AcceptOptions {
        AcceptOptions {
            private_data: private_data.to_vec(),
            ..AcceptOptions::default()
        }
    }
}

impl Default for AcceptOptions {
    fn default() -> AcceptOptions {
        AcceptOptions {
            private_data: Vec::new(),
            responder_resources: DEFAULT_RD_ATOMIC,
            initiator_depth: DEFAULT_RD_ATOMIC,
            rnr_retry_count: 7,
            min_rnr_timer: DEFAULT_MIN_RNR_TIMER,
            timeout: None,
        }
    }
}

/// SIDR_REP statuses (IBTA 12.11.2): nobody serves the service ID; the server refused.
const SIDR_UNSUPPORTED: i32 = 1;
const SIDR_REJECT: i32 = 2;

/// The name of a REJ reason, for messages.
fn reason_name(r: u16) -> &'static str {
    match r {
        rej_reason::NO_QP => "no QP",
        rej_reason::TIMEOUT => "timeout",
        rej_reason::INVALID_SERVICE_ID => "invalid service ID: nothing listens there",
        rej_reason::STALE_CONN => "stale connection",
        rej_reason::CONSUMER_REJECT => "consumer reject: the server refused",
        _ => "see the IBTA REJ reasons",
    }
}

fn deadline_of(timeout: Option<Duration>) -> Option<Instant> {
    timeout.map(|t| Instant::now() + t)
}

/// The next event of id `h` on `ch` before `deadline` (events of other ids are
/// dropped: the helpers' channels carry one id).
fn next_of(ch: &EventChannel, h: u32, deadline: Option<Instant>, what: &str) -> Result<Event> {
    loop {
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        match ch.next_event(left) {
            Ok(ev) if ev.id == h => return Ok(ev),
            Ok(_) => continue,
            Err(e) if e.is_timeout() => {
                return Err(Error::timed_out(format!("no answer while {what}")))
            }
            Err(e) => return Err(e),
        }
    }
}

/// The error an unexpected event stands for, while `what`, towards `peer`.
fn event_error(ev: &Event, what: &str, peer: SocketAddr) -> Error {
    match ev.kind {
        EventType::Rejected => {
            let reason = u16::try_from(ev.status).unwrap_or(0);
            Error::rejected(
                format!(
                    "connection to {peer} rejected: reason {reason} ({})",
                    reason_name(reason)
                ),
                Rejection {
                    reason,
                    private_data: ev.private_data().to_vec(),
                },
            )
        }
        EventType::Unreachable if ev.status > 0 => {
            // A SIDR_REP's status, as the REJ reason of the same meaning, so that UD and
            // connected clients tell "nobody listens" and "refused" apart alike.
            let reason = match ev.status {
                SIDR_UNSUPPORTED => rej_reason::INVALID_SERVICE_ID,
                SIDR_REJECT => rej_reason::CONSUMER_REJECT,
                s => u16::try_from(s).unwrap_or(0),
            };
            Error::rejected(
                format!(
                    "UD service at {peer} refused: SIDR status {} (reason {reason}: {})",
                    ev.status,
                    reason_name(reason)
                ),
                Rejection {
                    reason,
                    private_data: ev.private_data().to_vec(),
                },
            )
        }
        EventType::Unreachable => Error::new(
            libc::ETIMEDOUT,
            format!("{peer} unreachable: its CM never answered (UNREACHABLE)"),
        )
        .with_kind(ErrorKind::Unreachable),
        EventType::AddrError | EventType::RouteError | EventType::ConnectError => {
            let errno = if ev.status < 0 { -ev.status } else { libc::EIO };
            Error::new(errno, format!("{:?} while {what} ({peer})", ev.kind))
        }
        other => Error::new(
            libc::EPROTO,
            format!("unexpected {other:?} while {what} ({peer})"),
        ),
    }
}

fn conn_param(qp: &QueuePair, private_data: &[u8], rr: u8, id: u8) -> ConnParam {
    ConnParam {
        private_data: private_data.to_vec(),
        responder_resources: rr,
        initiator_depth: id,
        qp_num: qp.qpn(),
        ..ConnParam::default()
    }
}

/// Connect a new QP of `init`'s type to the server at `addr` (`rdma_resolve_addr`,
/// `rdma_resolve_route`, `rdma_create_qp`, `rdma_connect`, and on the server's answer
/// RTR, RTS and the RTU, as librdmacm does). The QP is ready to post on when this
/// returns; [`Connection::private_data`] holds what the server answered.
///
/// A refused request is an ECONNREFUSED error whose [`Error::rejection`] gives the
/// reason (8 when nothing listens on the port, 28 when the server rejected) and the
/// server's private data; a server that never answers is ETIMEDOUT.
pub fn connect(
    pd: &ProtectionDomain,
    init: &QpInit<'_>,
    addr: SocketAddr,
    opts: &ConnectOptions,
) -> Result<Connection> {
    connect_with(pd, init, addr, opts, |_| Ok(()))
}

/// [`connect`], running `prepare` on the QP once it is in INIT and before the request
/// goes: post receives there, so that the server's first messages find them.
pub fn connect_with(
    pd: &ProtectionDomain,
    init: &QpInit<'_>,
    addr: SocketAddr,
    opts: &ConnectOptions,
    prepare: impl FnOnce(&QueuePair) -> Result<()>,
) -> Result<Connection> {
    let dev = pd.device();
    let ps = opts
        .port_space
        .unwrap_or_else(|| PortSpace::for_qp_type(init.qp_type));
    let deadline = deadline_of(opts.timeout);
    let ch = EventChannel::new(dev)?;
    let id = CmId::new(&ch, ps)?;
    let h = id.handle;
    id.resolve_addr(opts.src, addr)?;
    let ev = next_of(&ch, h, deadline, "resolving the address")?;
    if ev.kind != EventType::AddrResolved {
        return Err(event_error(&ev, "resolving the address", addr));
    }
    id.resolve_route()?;
    let ev = next_of(&ch, h, deadline, "resolving the route")?;
    if ev.kind != EventType::RouteResolved {
        return Err(event_error(&ev, "resolving the route", addr));
    }
    let qp = send_connect(&id, pd, init, opts, prepare)?;
    let ev = next_of(&ch, h, deadline, CONNECTING)?;
    connected(id, qp, &ev, ps, opts, addr)
}

/// What the wait for the server's answer is called in errors.
pub(crate) const CONNECTING: &str = "connecting";

/// The client's steps once the route is resolved: the QP made and prepared, the request
/// sent (shared by [`connect_with`] and its async form).
pub(crate) fn send_connect(
    id: &CmId,
    pd: &ProtectionDomain,
    init: &QpInit<'_>,
    opts: &ConnectOptions,
    prepare: impl FnOnce(&QueuePair) -> Result<()>,
) -> Result<QueuePair> {
    let qp = id.create_qp(pd, init)?;
    prepare(&qp)?;
    let (rr, depth) = RdLimits::of(&pd.device().inner.dev).offer(
        Depth::AtMost(opts.responder_resources),
        Depth::AtMost(opts.initiator_depth),
    );
    let mut p = conn_param(&qp, &opts.private_data, rr, depth);
    p.retry_count = opts.retry_count.min(7);
    p.rnr_retry_count = opts.rnr_retry_count.min(7);
    p.srq = u8::from(init.srq.is_some());
    id.connect(&p)?;
    Ok(qp)
}

/// The client's last step, given the server's answer `ev`: a UD id is ESTABLISHED; a
/// connected one gets a CONNECT_RESPONSE, readies its QP and sends the RTU.
pub(crate) fn connected(
    id: CmId,
    qp: QueuePair,
    ev: &Event,
    ps: PortSpace,
    opts: &ConnectOptions,
    addr: SocketAddr,
) -> Result<Connection> {
    match (ev.kind, ps.qp_type()) {
        (EventType::Established, QpType::Ud) => {
            let ud = ev.ud_param().cloned();
            Ok(Connection::new(id, qp, ev.private_data().to_vec(), ud))
        }
        (EventType::ConnectResponse, t) if t != QpType::Ud => {
            // The depths the CM gives are already the lower of both sides'.
            let ready = Ready {
                min_rnr_timer: Some(opts.min_rnr_timer),
                ..Ready::default()
            };
            let agent = &id.chan.agent;
            conn::complete_connect(agent, id.handle, Some(ready), CmId::modifier(&qp), || {
                let _ = qp.to_error();
            })
            .map_err(|e| {
                let msg = format!("completing the connection to {addr}: {}", e.message());
                e.with_message(msg)
            })?;
            Ok(Connection::new(id, qp, ev.private_data().to_vec(), None))
        }
        _ => Err(event_error(ev, CONNECTING, addr)),
    }
}

/// What the server's wait for the RTU is called in errors.
pub(crate) const AWAITING_RTU: &str = "waiting for the client's RTU";

/// Where a server's answer to a request leaves the connection.
pub(crate) enum Answered {
    /// A UD id: connected once the answer went.
    Done(Connection),
    /// A connected id: the client's RTU is still to come.
    AwaitRtu(Connection),
}

impl ConnectRequest {
    /// The server's steps after the id moved to its own channel: the QP made and
    /// prepared, readied with the depths both sides allow, and the answer sent (shared
    /// by [`ConnectRequest::accept_with`] and its async form).
    pub(crate) fn answer(
        self,
        pd: &ProtectionDomain,
        init: &QpInit<'_>,
        opts: &AcceptOptions,
        prepare: impl FnOnce(&QueuePair) -> Result<()>,
    ) -> Result<Answered> {
        let id = self.id;
        let qp = id.create_qp(pd, init)?;
        prepare(&qp)?;
        let client = match self.param {
            EventParam::Conn(p) => p,
            EventParam::Ud(u) => {
                let p = conn_param(&qp, &opts.private_data, 0, 0);
                id.accept(&p)?;
                let conn = Connection::new(id, qp, u.private_data.clone(), Some(u));
                return Ok(Answered::Done(conn));
            }
            EventParam::None => return Err(Error::invalid("not a connection request")),
        };
        let (rr, depth) = RdLimits::of(&pd.device().inner.dev).settle(
            Depth::AtMost(opts.responder_resources),
            Depth::AtMost(opts.initiator_depth),
            client.responder_resources,
            client.initiator_depth,
        );
        let ready = Ready {
            responder: Some(rr),
            initiator: Some(depth),
            min_rnr_timer: Some(opts.min_rnr_timer),
        };
        let mut p = conn_param(&qp, &opts.private_data, rr, depth);
        p.rnr_retry_count = opts.rnr_retry_count.min(7);
        p.srq = u8::from(init.srq.is_some());
        conn::accept(
            &id.chan.agent,
            id.handle,
            Some(ready),
            &p,
            CmId::modifier(&qp),
            || {
                let _ = qp.to_error();
            },
        )?;
        Ok(Answered::AwaitRtu(Connection::new(
            id,
            qp,
            client.private_data,
            None,
        )))
    }
}

/// The server's last step, given the event after its answer: ESTABLISHED, or
/// DISCONNECTED at once (the RTU was lost, the DREQ was not), which still connected.
pub(crate) fn rtu(conn: Connection, ev: &Event, peer: SocketAddr) -> Result<Connection> {
    match ev.kind {
        EventType::Established => Ok(conn),
        EventType::Disconnected => {
            conn.peer_gone.store(true, Ordering::SeqCst);
            Ok(conn)
        }
        _ => Err(event_error(ev, AWAITING_RTU, peer)),
    }
}

/// A listening id (`rdma_listen`) with its own event channel: connection requests queue
/// on it until [`Listener::accept`] or [`Listener::next_request`] takes them. Its fd
/// ([`AsFd`]) is readable while a request waits.
#[derive(Debug)]
pub struct Listener {
    id: CmId,
    addr: SocketAddr,
}

impl Listener {
    /// Listen for RC connections on `addr` (the wildcard IP and port 0 allowed) of `dev`.
    /// EADDRINUSE or EADDRNOTAVAIL when another listener holds the port, as Linux says.
    pub fn bind(dev: &Device, addr: SocketAddr) -> Result<Listener> {
        Listener::bind_with(dev, addr, PortSpace::Tcp, 0)
    }

    /// Listen in port space `ps` with `backlog` (0: the default, 1024) requests waiting
    /// at most.
    pub fn bind_with(
        dev: &Device,
        addr: SocketAddr,
        ps: PortSpace,
        backlog: i32,
    ) -> Result<Listener> {
        let ch = EventChannel::new(dev)?;
        let id = CmId::new(&ch, ps)?;
        id.bind(addr)?;
        id.listen(backlog)?;
        let addr = id
            .local_addr()
            .ok_or_else(|| Error::new(libc::EIO, "the listener has no address"))?;
        Ok(Listener { id, addr })
    }

    /// The address listened on; its port is the one chosen when bound to port 0.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The listening id (its channel carries the requests).
    pub fn id(&self) -> &CmId {
        &self.id
    }

    /// Wait for the next connection request; `None` waits forever. ETIMEDOUT when none
    /// came in time.
    pub fn next_request(&self, timeout: Option<Duration>) -> Result<ConnectRequest> {
        let deadline = deadline_of(timeout);
        loop {
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            let mut ev = match self.id.chan.next_event(left) {
                Ok(ev) => ev,
                Err(e) if e.is_timeout() => return Err(Error::timed_out("no connection request")),
                Err(e) => return Err(e),
            };
            // Other events here are of requests that were answered or dropped already.
            if ev.kind != EventType::ConnectRequest {
                continue;
            }
            if let Some(id) = ev.take_id() {
                return Ok(ConnectRequest {
                    id,
                    param: std::mem::replace(&mut ev.param, EventParam::None),
                });
            }
        }
    }

    /// Wait for a connection request (without limit, as `TcpListener::accept`) and
    /// accept it with a new QP of `init` ([`ConnectRequest::accept`]).
    pub fn accept(
        &self,
        pd: &ProtectionDomain,
        init: &QpInit<'_>,
        opts: &AcceptOptions,
    ) -> Result<Connection> {
        self.next_request(None)?.accept(pd, init, opts)
    }

    /// [`Listener::accept`] with a `prepare` step ([`ConnectRequest::accept_with`]).
    pub fn accept_with(
        &self,
        pd: &ProtectionDomain,
        init: &QpInit<'_>,
        opts: &AcceptOptions,
        prepare: impl FnOnce(&QueuePair) -> Result<()>,
    ) -> Result<Connection> {
        self.next_request(None)?
            .accept_with(pd, init, opts, prepare)
    }
}

impl AsFd for Listener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.id.chan.as_fd()
    }
}

/// A connection request a [`Listener`] received, to accept or reject. Dropping it
/// unanswered rejects it.
#[derive(Debug)]
pub struct ConnectRequest {
    id: CmId,
    param: EventParam,
}

impl ConnectRequest {
    /// The client's private data (56 bytes for RC, zero-padded as the REQ carries it;
    /// 180 for UD).
    pub fn private_data(&self) -> &[u8] {
        match &self.param {
            EventParam::Conn(p) => &p.private_data,
            EventParam::Ud(p) => &p.private_data,
            EventParam::None => &[],
        }
    }
    /// The client's request (QP number, resources, retry counts); None for UD.
    pub fn conn_param(&self) -> Option<&ConnParam> {
        match &self.param {
            EventParam::Conn(p) => Some(p),
            _ => None,
        }
    }
    /// The client's address.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.id.peer_addr()
    }
    /// The address the client connected to.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.id.local_addr()
    }

    /// Accept with a new QP of `init` (RC and UC: RTR and RTS before the REP goes, as
    /// librdmacm's `rdma_accept` does, then wait for the client's RTU; UD: answer with
    /// the QP's number and Q_Key). The connection gets its own event channel.
    pub fn accept(
        self,
        pd: &ProtectionDomain,
        init: &QpInit<'_>,
        opts: &AcceptOptions,
    ) -> Result<Connection> {
        self.accept_with(pd, init, opts, |_| Ok(()))
    }

    /// [`ConnectRequest::accept`], running `prepare` on the QP once it is in INIT and
    /// before the answer goes: post receives there, so that the client's first messages
    /// find them.
    pub fn accept_with(
        mut self,
        pd: &ProtectionDomain,
        init: &QpInit<'_>,
        opts: &AcceptOptions,
        prepare: impl FnOnce(&QueuePair) -> Result<()>,
    ) -> Result<Connection> {
        let ch = EventChannel::new(self.id.device())?;
        self.id.migrate(&ch)?;
        let peer = self
            .peer_addr()
            .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)));
        let conn = match self.answer(pd, init, opts, prepare)? {
            Answered::Done(conn) => return Ok(conn),
            Answered::AwaitRtu(conn) => conn,
        };
        let ev = next_of(&ch, conn.id.handle, deadline_of(opts.timeout), AWAITING_RTU)?;
        rtu(conn, &ev, peer)
    }

    /// Refuse the request (`rdma_reject`) with up to [`MAX_REJECT_PRIVATE`] bytes of
    /// private data, which the client sees in its [`Error::rejection`].
    pub fn reject(self, private_data: &[u8]) -> Result<()> {
        self.id.reject(private_data)
    }

    /// The request's id, to drive by hand.
    pub fn into_id(self) -> CmId {
        self.id
    }
}

/// A connected QP and the CM id it was connected through. Dropping it disconnects
/// (`rdma_destroy_id` sends the DREQ) and destroys the QP.
pub struct Connection {
    // Declared first so it drops first: the peer hears of the end before the QP goes.
    id: CmId,
    qp: QueuePair,
    private_data: Vec<u8>,
    ud: Option<UdParam>,
    /// This side disconnected (QP in ERR, DREQ or DREP sent).
    closed: AtomicBool,
    /// The DISCONNECTED event came.
    peer_gone: AtomicBool,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("id", &self.id)
            .field("qp", &self.qp)
            .finish()
    }
}

impl Connection {
    fn new(id: CmId, qp: QueuePair, private_data: Vec<u8>, ud: Option<UdParam>) -> Connection {
        Connection {
            id,
            qp,
            private_data,
            ud,
            closed: AtomicBool::new(false),
            peer_gone: AtomicBool::new(false),
        }
    }

    /// The connected QP.
    pub fn qp(&self) -> &QueuePair {
        &self.qp
    }
    /// The CM id (its channel carries the connection's later events).
    pub fn id(&self) -> &CmId {
        &self.id
    }
    /// The peer's private data: the server's REP for a client, the client's REQ for a
    /// server, zero-padded to the message's size (196 and 56 bytes) as rdma_cm delivers
    /// it.
    pub fn private_data(&self) -> &[u8] {
        &self.private_data
    }
    /// For UD: a client's [`UdParam`] holds the server's QPN, Q_Key and the address
    /// vector to it (for [`ProtectionDomain::create_ah`]); a server's holds the address
    /// vector to the client (its QPN comes with its first datagram).
    pub fn ud_param(&self) -> Option<&UdParam> {
        self.ud.as_ref()
    }
    /// The local address.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.id.local_addr()
    }
    /// The peer's address.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.id.peer_addr()
    }

    /// `rdma_disconnect`: move the QP to ERR (outstanding work requests complete with
    /// `WR_FLUSH_ERR`) and tell the peer (DREQ, or DREP when it asked first). Both sides
    /// then see DISCONNECTED ([`Connection::wait_disconnected`]). Doing it again does
    /// nothing.
    pub fn disconnect(&self) -> Result<()> {
        if self.ud.is_some() {
            return Err(Error::invalid("a UD endpoint has no connection to close"));
        }
        if self.closed.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        self.qp.to_error()?;
        match self.id.disconnect() {
            // The CM may have finished with the connection already (the peer's DREQ
            // went unanswered long enough): nothing is left to tell.
            Err(e) if e.errno() == libc::EINVAL => Ok(()),
            r => r,
        }
    }

    /// Wait until the connection is over (the DISCONNECTED event: the peer's DREQ, or
    /// its DREP to ours); `None` waits without limit. When the peer ended it, this side
    /// then disconnects too (QP to ERR, DREP), as a closed connection needs. ETIMEDOUT
    /// when the connection still stands at the deadline.
    pub fn wait_disconnected(&self, timeout: Option<Duration>) -> Result<()> {
        if self.ud.is_some() {
            return Err(Error::invalid("a UD endpoint has no connection to close"));
        }
        let deadline = deadline_of(timeout);
        while !self.peer_gone.load(Ordering::SeqCst) {
            let ev = next_of(
                &self.id.chan,
                self.id.handle,
                deadline,
                "waiting for DISCONNECTED",
            )?;
            if ev.kind == EventType::Disconnected {
                self.peer_gone.store(true, Ordering::SeqCst);
            }
        }
        self.disconnect()
    }

    /// Whether the DISCONNECTED event has been seen.
    pub fn is_disconnected(&self) -> bool {
        self.peer_gone.load(Ordering::SeqCst)
    }

    /// The QP and the id, to manage by hand (dropping the id still disconnects).
    pub fn into_parts(self) -> (QueuePair, CmId) {
        (self.qp, self.id)
    }
}
