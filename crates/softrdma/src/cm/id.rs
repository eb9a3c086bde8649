//! Ids and events, one rdma_cm call at a time: port spaces, event channels, the events
//! they carry and the ids that make them.

use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use softrdma_cm::agent::{self, Agent};
use softrdma_cm::cma::{CmaEvent, EventParam, Service};
use softrdma_transport::verbs::{QpAttr, QpAttrMask, QpState, QpType};
use softrdma_wire::cm::port_space;

use super::{agent_of, ConnParam, EventType, IdOption, IdState, UdParam};
use crate::{Device, Error, ErrorKind, ProtectionDomain, QpInit, QueuePair, Result};

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
    pub(super) dev: Device,
    pub(super) agent: Arc<Agent>,
    pub(super) ch: agent::EventChannel,
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
    pub(super) kind: EventType,
    pub(super) id: u32,
    listen_id: Option<u32>,
    pub(super) status: i32,
    pub(super) param: EventParam,
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
    pub(super) chan: EventChannel,
    pub(super) handle: u32,
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
    /// `rdma_connect`: send the connection request (a SIDR request for UD ids). `p` carries
    /// the QP number, resources and at most
    /// [`MAX_CONNECT_PRIVATE`](super::MAX_CONNECT_PRIVATE) bytes of private data
    /// ([`MAX_UD_CONNECT_PRIVATE`](super::MAX_UD_CONNECT_PRIVATE) for UD).
    pub fn connect(&self, p: &ConnParam) -> Result<()> {
        self.call(|c, now, h| c.connect(now, h, p))
    }
    /// `rdma_accept`. On a connection request: answer with the REP (or SIDR_REP; UD ids
    /// answer with [`UDP_QKEY`](super::UDP_QKEY) in the UDP port space). On the connecting
    /// side after CONNECT_RESPONSE: send the RTU.
    pub fn accept(&self, p: &ConnParam) -> Result<()> {
        self.call(|c, now, h| c.accept(now, h, p))
    }
    /// `rdma_reject`: refuse a connection request with up to
    /// [`MAX_REJECT_PRIVATE`](super::MAX_REJECT_PRIVATE) bytes of private data (REJ reason
    /// 28, consumer reject).
    pub fn reject(&self, private_data: &[u8]) -> Result<()> {
        self.call(|c, now, h| c.reject(now, h, private_data))
    }
    /// `rdma_disconnect`'s CM half: send the DREQ (or the DREP when the peer asked first).
    /// Move the QP to ERR too ([`CmId::modify_qp`] with [`QpState::Err`] or
    /// [`QueuePair::to_error`]); [`Connection::disconnect`](super::Connection::disconnect)
    /// does both.
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
    pub(super) fn modifier<'a>(
        qp: &'a QueuePair,
    ) -> impl FnMut(&QpAttr, QpAttrMask) -> Result<()> + 'a {
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
