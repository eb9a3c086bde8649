//! The rdma_cm model: CM ids in port spaces, bound to IP addresses and ports, resolving,
//! listening, connecting, accepting, rejecting and disconnecting, with the events a
//! program sees — what the Linux kernel's rdma_cm (`cma.c`, `ucma.c`) does under
//! librdmacm. Sans-IO over one device's [`IbCm`]: commands and MADs in, MADs and events
//! out, time as an argument.
//!
//! As under librdmacm, the QP is the face's business: the model says which attributes a
//! QP needs for INIT, RTR and RTS ([`Cma::init_qp_attr`]) from what the REQ and REP
//! carried, and a face moves its QP with them (the C face does it where librdmacm does).
//! Likewise for multicast: [`Cma::join_multicast`] reports MULTICAST_JOIN with the group's
//! address vector, and the face attaches its QP to the group's MGID on that event (and
//! detaches it on [`Cma::leave_multicast`]), as librdmacm does.
//!
//! A connection request lives only as long as an id holds it: a REQ refused at once
//! (nobody listens, the rdma_cm header does not parse, names no listener, or names a
//! source IP other than the packet's — REJ 8 or 28), over the listener's backlog
//! (dropped, so the peer retries), rejected, timed out or unreachable leaves nothing in
//! the protocol's tables; an id that saw REJECTED or UNREACHABLE no longer names a
//! connection. The header's port cannot be checked (nothing on the wire carries it).
//!
//! Ports are reserved host-wide through a [`Ports`] (the device's registry in a real
//! process, an in-memory one in tests), so that a server bound to the wildcard address
//! in one process is found by a client in another at 127.0.0.1 or at the host's own
//! addresses, and two servers on one port conflict with the errno Linux gives
//! (`EADDRNOTAVAIL` when either bound a wildcard or loopback address, `EADDRINUSE` for
//! the same address).

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use softrdma_device::ports::PortSpace;
use softrdma_verbs::{self as verbs, Access, QpAttr, QpAttrMask, QpState};
use softrdma_wire::cm::{
    port_space, private_len, rej_reason, service_id, CmPath, CmaHeader, Rep, Req, SidrRep, SidrReq,
    CMA_HEADER_LEN,
};
use softrdma_wire::{KeyRng, Seed};

use crate::ib::{self, zero_padded, CommId, EventKind, IbCm, Peer, MRA_FLAG_DELAY};

/// Errno values the model returns (Linux's numbers, which the C face passes on).
pub mod errno {
    /// Out of memory / no room.
    pub const ENOMEM: i32 = 12;
    /// Busy.
    pub const EBUSY: i32 = 16;
    /// No such device.
    pub const ENODEV: i32 = 19;
    /// Invalid argument or state.
    pub const EINVAL: i32 = 22;
    /// Not supported.
    pub const ENOSYS: i32 = 38;
    /// Operation not supported.
    pub const EOPNOTSUPP: i32 = 95;
    /// Address family not supported.
    pub const EAFNOSUPPORT: i32 = 97;
    /// Address in use.
    pub const EADDRINUSE: i32 = 98;
    /// Address not available.
    pub const EADDRNOTAVAIL: i32 = 99;
    /// Already connected.
    pub const EISCONN: i32 = 106;
    /// Not connected.
    pub const ENOTCONN: i32 = 107;
    /// Timed out.
    pub const ETIMEDOUT: i32 = 110;
    /// No such entry.
    pub const ENOENT: i32 = 2;
}

/// An error of a CM call: an errno and what went wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CmaError {
    /// The errno (Linux numbering).
    pub errno: i32,
    /// What went wrong.
    pub msg: &'static str,
}

impl From<CmaError> for std::io::Error {
    /// The errno's kind, with the CM's message.
    fn from(e: CmaError) -> std::io::Error {
        std::io::Error::new(
            std::io::Error::from_raw_os_error(e.errno).kind(),
            e.to_string(),
        )
    }
}

impl std::fmt::Display for CmaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (errno {})", self.msg, self.errno)
    }
}

impl std::error::Error for CmaError {}

pub(crate) fn err(errno: i32, msg: &'static str) -> CmaError {
    CmaError { errno, msg }
}

/// Result of a CM call.
pub type Result<T> = std::result::Result<T, CmaError>;

/// A CM id's handle.
pub type IdHandle = u32;

/// The rdma_cm event types, with librdmacm's numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum EventType {
    /// Address resolved.
    AddrResolved = 0,
    /// Address resolution failed.
    AddrError = 1,
    /// Route resolved.
    RouteResolved = 2,
    /// Route resolution failed.
    RouteError = 3,
    /// A connection request for a listener.
    ConnectRequest = 4,
    /// The passive side accepted (ids without a QP complete with `accept`).
    ConnectResponse = 5,
    /// Connecting failed locally.
    ConnectError = 6,
    /// The peer never answered.
    Unreachable = 7,
    /// The peer rejected.
    Rejected = 8,
    /// Connected.
    Established = 9,
    /// Disconnected.
    Disconnected = 10,
    /// The device went away.
    DeviceRemoval = 11,
    /// Joined a multicast group.
    MulticastJoin = 12,
    /// Multicast error.
    MulticastError = 13,
    /// Address changed.
    AddrChange = 14,
    /// Timewait is over: the QP may be reused.
    TimewaitExit = 15,
}

/// What a connection request or response carried (`rdma_conn_param`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConnParam {
    /// The consumer's private data.
    pub private_data: Vec<u8>,
    /// Outstanding READ/atomic requests the sender accepts.
    pub responder_resources: u8,
    /// Outstanding READ/atomic requests the sender issues.
    pub initiator_depth: u8,
    /// End-to-end flow control.
    pub flow_control: u8,
    /// Transport retry count.
    pub retry_count: u8,
    /// RNR retry count.
    pub rnr_retry_count: u8,
    /// Whether the sender's QP uses an SRQ.
    pub srq: u8,
    /// The sender's QP number.
    pub qp_num: u32,
}

/// What a UD exchange carried (`rdma_ud_param`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UdParam {
    /// The consumer's private data.
    pub private_data: Vec<u8>,
    /// Address vector to reach the peer.
    pub ah_attr: verbs::AhAttr,
    /// The peer's QP number.
    pub qp_num: u32,
    /// The peer's Q_Key.
    pub qkey: u32,
}

/// An event's parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventParam {
    /// None.
    None,
    /// Connected service.
    Conn(ConnParam),
    /// UD.
    Ud(UdParam),
}

/// An event for a program.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CmaEvent {
    /// The channel it is delivered on.
    pub channel: u32,
    /// The id it is about (for a connection request: the new id).
    pub id: IdHandle,
    /// For a connection request: the listener.
    pub listen_id: Option<IdHandle>,
    /// What happened.
    pub event: EventType,
    /// 0, a REJ reason (REJECTED), or a negative errno.
    pub status: i32,
    /// Parameters.
    pub param: EventParam,
    /// For MULTICAST_JOIN: which join it answers (None for every other event).
    pub mc: Option<McastJoin>,
}

/// A multicast join of an id, as [`Cma::join_multicast`] took it: what a MULTICAST_JOIN
/// event names, so that a face finds its own record of the join (librdmacm hands the
/// context back in `param.ud.private_data`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct McastJoin {
    /// The group's address, as given.
    pub addr: SocketAddr,
    /// The caller's context, as given.
    pub context: u64,
    /// A send-only join: the face must not attach its QP to the group.
    pub send_only: bool,
}

/// The rdma_cm id state (the kernel's `rdma_cm_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdState {
    /// Created.
    Idle,
    /// Bound to an address.
    AddrBound,
    /// Address resolved.
    AddrResolved,
    /// Route resolved.
    RouteResolved,
    /// Connecting or connected.
    Connect,
    /// Disconnected.
    Disconnect,
    /// Listening.
    Listen,
}

/// The QP service an id carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Service {
    /// Reliable connected.
    Rc,
    /// Unreliable connected.
    Uc,
    /// Unreliable datagram.
    Ud,
}

/// Options of `rdma_set_option`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdOption {
    /// IP type of service of the connection's packets.
    Tos(u8),
    /// Allow binding a port others have bound with the same option.
    ReuseAddr(bool),
    /// Bind IPv6 wildcard addresses to IPv6 only.
    AfOnly(bool),
    /// The QP's local ACK timeout exponent.
    AckTimeout(u8),
}

/// A port reservation in a [`Ports`]; dropping it releases the port.
pub trait Reservation: Send {
    /// The reserved port.
    fn port(&self) -> u16;
    /// Start or stop being found by [`Ports::lookup`] (listen); Linux's conflict
    /// rules are checked again when listening starts.
    fn set_listening(&mut self, on: bool) -> std::io::Result<()>;
    /// REUSEADDR set on the bound id: later binds and listens on the port count it. A
    /// port space that does not keep the flag (a test double) ignores it.
    fn set_reuse_addr(&mut self, _on: bool) -> std::io::Result<()> {
        Ok(())
    }
    /// AFONLY set on the bound id: as [`Reservation::set_reuse_addr`].
    fn set_af_only(&mut self, _on: bool) -> std::io::Result<()> {
        Ok(())
    }
}

/// The host's rdma_cm port table, every port space of it (the device's registry, or a
/// [`softrdma_device::ports::PortTable`] in memory for tests): the rules of
/// [`softrdma_device::ports`] applied to the bindings of every process on the host.
pub trait Ports: Send {
    /// Reserve `addr` (IP may be the wildcard, port 0 picks one) in port space `ps` for
    /// a device at `device`.
    fn bind(
        &mut self,
        ps: PortSpace,
        addr: SocketAddr,
        device: SocketAddr,
        reuse: bool,
        afonly: bool,
    ) -> std::io::Result<Box<dyn Reservation>>;
    /// The device of the listener that serves `dst` in `ps`, if `dst` is this host's and
    /// someone listens there.
    fn lookup(&self, ps: PortSpace, dst: SocketAddr) -> Option<SocketAddr>;
    /// Whether `ip` is one of this host's addresses.
    fn is_local(&self, ip: IpAddr) -> bool;
    /// Whether a device (its CM) serves at `ip` on this host.
    fn has_device(&self, ip: IpAddr) -> bool;
    /// Whether a listener known to be alive, on the device at `device`, still serves
    /// `dst` in `ps`: a cheaper yes than [`Ports::lookup`] for a listener found before;
    /// false when not known.
    fn listener_alive(&self, ps: PortSpace, dst: SocketAddr, device: IpAddr) -> bool {
        self.lookup(ps, dst).is_some_and(|d| d.ip() == device)
    }
}

/// How long a CM waits for answers (IBTA exponents and retries, as the Linux rdma_cm
/// sets them: a REQ is tried 16 times, 4.6 s apart, before UNREACHABLE).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// CM response timeout exponent sent in REQs (Linux: 20).
    pub cm_response: u8,
    /// Retries of REQ, REP, DREQ (Linux: 15).
    pub max_retries: u8,
    /// Packet lifetime exponent of a RoCE path (Linux: 16).
    pub packet_life_time: u8,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            cm_response: 20,
            max_retries: 15,
            packet_life_time: 16,
        }
    }
}

/// The Q_Key rdma_cm gives UDP port space ids.
pub const UDP_QKEY: u32 = 0x0123_4567;
/// The most a REQ's private data may carry after the CMA header (TCP port space).
pub const MAX_CONNECT_PRIVATE: usize = private_len::REQ - CMA_HEADER_LEN;
/// The most a REP's private data may carry.
pub const MAX_ACCEPT_PRIVATE: usize = private_len::REP;
/// The most a REJ's private data may carry.
pub const MAX_REJECT_PRIVATE: usize = private_len::REJ;
/// The most a SIDR_REQ's private data may carry after the CMA header.
pub const MAX_UD_CONNECT_PRIVATE: usize = private_len::SIDR_REQ - CMA_HEADER_LEN;
/// The most a SIDR_REP's private data may carry.
pub const MAX_UD_ACCEPT_PRIVATE: usize = private_len::SIDR_REP;
/// The local CA ACK delay exponent the device reports (rxe's), which goes into path ACK
/// timeouts.
const CA_ACK_DELAY: u8 = 15;
/// Delayed MRA service timeout rdma_cm sends for REQs and REPs (2^24 × 4.096 µs ≈ 68 s).
const MRA_SETTING: u8 = MRA_FLAG_DELAY | 24;

struct Id {
    channel: u32,
    ps: u16,
    service: Service,
    state: IdState,
    src: Option<SocketAddr>,
    dst: Option<SocketAddr>,
    reservation: Option<Box<dyn Reservation>>,
    /// The device the peer's CM runs on.
    peer_dev: Option<IpAddr>,
    /// `peer_dev` is a listener's, found in the host's port space: no need to look again.
    peer_is_listener: bool,
    comm: Option<CommId>,
    listen: Option<ListenState>,
    /// The listener a connection request arrived on (until accepted or rejected).
    parent: Option<IdHandle>,
    tos: u8,
    reuse: bool,
    afonly: bool,
    ack_timeout: Option<u8>,
    // What the QP needs (init_qp_attr).
    remote_qpn: u32,
    remote_qkey: u32,
    rq_psn: u32,
    sq_psn: u32,
    responder_resources: u8,
    initiator_depth: u8,
    retry_count: u8,
    rnr_retry_count: u8,
    /// The path's ACK timeout exponent.
    path_timeout: u8,
    /// The path MTU: the device's for an active id, the REQ's for a passive one.
    path_mtu: verbs::Mtu,
    /// Whether DISCONNECTED was reported.
    disconnected: bool,
    /// Multicast joins, oldest first.
    mc: Vec<McastJoin>,
}

struct ListenState {
    backlog: usize,
    /// Connection requests not yet accepted or rejected.
    pending: usize,
}

impl Id {
    fn new(channel: u32, ps: u16, service: Service) -> Id {
        Id {
            channel,
            ps,
            service,
            state: IdState::Idle,
            src: None,
            dst: None,
            reservation: None,
            peer_dev: None,
            peer_is_listener: false,
            comm: None,
            listen: None,
            parent: None,
            tos: 0,
            reuse: false,
            afonly: false,
            ack_timeout: None,
            remote_qpn: 0,
            remote_qkey: 0,
            rq_psn: 0,
            sq_psn: 0,
            responder_resources: 0,
            initiator_depth: 0,
            retry_count: 0,
            rnr_retry_count: 0,
            path_timeout: 0,
            path_mtu: verbs::Mtu::Mtu1024,
            disconnected: false,
            mc: Vec::new(),
        }
    }
}

/// The rdma_cm of one device.
pub struct Cma {
    dev: SocketAddr,
    /// The MTU of the paths this device's ids resolve (see [`Cma::set_path_mtu`]).
    path_mtu: verbs::Mtu,
    ib: IbCm,
    ports: Box<dyn Ports>,
    timeouts: Timeouts,
    ids: HashMap<IdHandle, Id>,
    by_comm: HashMap<CommId, IdHandle>,
    next_handle: IdHandle,
    rng: KeyRng,
    events: VecDeque<CmaEvent>,
}

fn service_of(ps: u16, qp_type: Option<Service>) -> Result<Service> {
    match ps {
        port_space::TCP => Ok(Service::Rc),
        port_space::UDP | port_space::IPOIB => Ok(Service::Ud),
        port_space::IB => Ok(qp_type.unwrap_or(Service::Rc)),
        _ => Err(err(errno::EINVAL, "unknown port space")),
    }
}

/// The port space of an id's `ps`, which [`service_of`] vetted when the id was made.
fn port_space_of(ps: u16) -> Result<PortSpace> {
    PortSpace::from_raw(u32::from(ps)).ok_or_else(|| err(errno::EINVAL, "unknown port space"))
}

fn io_errno(e: &std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(errno::EINVAL)
}

impl Cma {
    /// The CM of the device at `dev` (its UDP endpoint; the IP is its GID),
    /// `ca_guid` its node GUID, `seed` for IDs and starting PSNs, `ports` the host's port
    /// space.
    pub fn new(dev: SocketAddr, ca_guid: u64, seed: impl Into<Seed>, ports: Box<dyn Ports>) -> Cma {
        let mut rng = KeyRng::new(seed);
        let ib_seed = rng.fork();
        Cma {
            dev,
            path_mtu: verbs::Mtu::Mtu1024,
            ib: IbCm::new(ca_guid, CA_ACK_DELAY, ib_seed),
            ports,
            timeouts: Timeouts::default(),
            ids: HashMap::new(),
            by_comm: HashMap::new(),
            next_handle: 1,
            rng,
            events: VecDeque::new(),
        }
    }

    /// The path MTU of the routes this device resolves from now on: what the REQ of an
    /// active id carries and its QP gets (a passive id takes the REQ's). 1024 bytes until
    /// set, which every Ethernet link carries; see [`softrdma_device::netdev::roce_mtu`].
    pub fn set_path_mtu(&mut self, mtu: verbs::Mtu) {
        self.path_mtu = mtu;
    }

    /// The path MTU of the id's route (`route.path_rec->mtu`).
    pub fn path_mtu(&self, id: IdHandle) -> Result<verbs::Mtu> {
        Ok(self.id(id)?.path_mtu)
    }

    /// Use other CM timeouts (tests, impatient programs).
    pub fn set_timeouts(&mut self, t: Timeouts) {
        self.timeouts = t;
    }

    /// The device's address.
    pub fn device_addr(&self) -> SocketAddr {
        self.dev
    }

    /// The protocol engine (counters, states).
    pub fn ib(&self) -> &IbCm {
        &self.ib
    }

    /// Hold at most `n` half-open connections ([`IbCm::set_max_half_open`]).
    pub fn set_max_half_open(&mut self, n: usize) {
        self.ib.set_max_half_open(n);
    }

    /// Number of ids (the program's, and those connection requests made).
    pub fn id_count(&self) -> usize {
        self.ids.len()
    }

    fn id(&self, h: IdHandle) -> Result<&Id> {
        self.ids.get(&h).ok_or(err(errno::EINVAL, "no such CM id"))
    }

    fn id_mut(&mut self, h: IdHandle) -> Result<&mut Id> {
        self.ids
            .get_mut(&h)
            .ok_or(err(errno::EINVAL, "no such CM id"))
    }

    fn push(&mut self, id: IdHandle, event: EventType, status: i32, param: EventParam) {
        let Some(i) = self.ids.get(&id) else { return };
        self.events.push_back(CmaEvent {
            channel: i.channel,
            id,
            listen_id: None,
            event,
            status,
            param,
            mc: None,
        });
    }

    /// A new id in port space `ps` (for `RDMA_PS_IB`, `qp_type` says the service), whose
    /// events go to `channel`.
    pub fn create_id(
        &mut self,
        channel: u32,
        ps: u16,
        qp_type: Option<Service>,
    ) -> Result<IdHandle> {
        let service = service_of(ps, qp_type)?;
        let h = self.alloc_handle();
        self.ids.insert(h, Id::new(channel, ps, service));
        Ok(h)
    }

    fn alloc_handle(&mut self) -> IdHandle {
        loop {
            let h = self.next_handle;
            self.next_handle = self.next_handle.wrapping_add(1).max(1);
            if !self.ids.contains_key(&h) {
                return h;
            }
        }
    }

    /// The id's state.
    pub fn state(&self, id: IdHandle) -> Result<IdState> {
        Ok(self.id(id)?.state)
    }

    /// The id's port space and service.
    pub fn kind(&self, id: IdHandle) -> Result<(u16, Service)> {
        let i = self.id(id)?;
        Ok((i.ps, i.service))
    }

    /// The id's source and destination addresses (what `rdma_get_local_addr` and
    /// `rdma_get_peer_addr` report).
    pub fn addrs(&self, id: IdHandle) -> Result<(Option<SocketAddr>, Option<SocketAddr>)> {
        let i = self.id(id)?;
        Ok((i.src, i.dst))
    }

    /// The IP address of the device the id's peer is on (its GID), once the address is
    /// resolved or a request came; the route's destination GID.
    pub fn peer_device(&self, id: IdHandle) -> Result<Option<IpAddr>> {
        Ok(self.id(id)?.peer_dev)
    }

    /// The id's type of service: what `RDMA_OPTION_ID_TOS` set, or for an id a
    /// connection request made, the traffic class of the REQ's path. It is the route's
    /// traffic class and the address vector's.
    pub fn tos(&self, id: IdHandle) -> Result<u8> {
        Ok(self.id(id)?.tos)
    }

    /// Whether the id is bound to this device (a wildcard bind is not, until it resolves
    /// or a connection arrives), so that it has a `verbs` context.
    pub fn has_device(&self, id: IdHandle) -> Result<bool> {
        let i = self.id(id)?;
        Ok(i.src.is_some_and(|s| !s.ip().is_unspecified()))
    }

    /// Move an id's events to another channel.
    pub fn migrate(&mut self, id: IdHandle, channel: u32) -> Result<()> {
        self.id_mut(id)?.channel = channel;
        for e in self.events.iter_mut().filter(|e| e.id == id) {
            e.channel = channel;
        }
        Ok(())
    }

    /// `rdma_set_option`.
    pub fn set_option(&mut self, id: IdHandle, opt: IdOption) -> Result<()> {
        let i = self.id_mut(id)?;
        match opt {
            IdOption::Tos(t) => i.tos = t,
            IdOption::ReuseAddr(r) => {
                // Linux's rdma_set_reuseaddr: either way before bind; after bind only
                // turning it on, until the id listens.
                if i.state != IdState::Idle && !(r && i.state != IdState::Listen) {
                    return Err(err(errno::EINVAL, "REUSEADDR off after bind, or listening"));
                }
                if let Some(res) = i.reservation.as_mut() {
                    res.set_reuse_addr(r)
                        .map_err(|e| err(io_errno(&e), "port registry"))?;
                }
                i.reuse = r;
            }
            IdOption::AfOnly(a) => {
                // Linux's rdma_set_afonly: while the id is idle or bound.
                if !matches!(i.state, IdState::Idle | IdState::AddrBound) {
                    return Err(err(errno::EINVAL, "AFONLY after resolving or listening"));
                }
                if let Some(res) = i.reservation.as_mut() {
                    res.set_af_only(a)
                        .map_err(|e| err(io_errno(&e), "port registry"))?;
                }
                i.afonly = a;
            }
            IdOption::AckTimeout(t) => {
                // Linux's rdma_set_ack_timeout: for RC (and XRC initiator) ids only.
                if i.service != Service::Rc {
                    return Err(err(errno::EINVAL, "ACK_TIMEOUT on an id that is not RC"));
                }
                i.ack_timeout = Some(t.min(31));
            }
        }
        Ok(())
    }

    /// `rdma_bind_addr`: reserve `addr` (wildcard IP and port 0 allowed) for the id.
    pub fn bind(&mut self, id: IdHandle, addr: SocketAddr) -> Result<()> {
        let dev = self.dev;
        let i = self.id(id)?;
        if i.state != IdState::Idle {
            return Err(err(errno::EINVAL, "id already bound"));
        }
        let ip = addr.ip().to_canonical();
        if !ip.is_unspecified() && !self.ports.is_local(ip) {
            return Err(err(errno::EADDRNOTAVAIL, "address is not this host's"));
        }
        let (ps, reuse, afonly) = (port_space_of(i.ps)?, i.reuse, i.afonly);
        let r = self
            .ports
            .bind(ps, SocketAddr::new(ip, addr.port()), dev, reuse, afonly)
            .map_err(|e| err(io_errno(&e), "port is taken"))?;
        let i = self.id_mut(id)?;
        i.src = Some(SocketAddr::new(ip, r.port()));
        i.reservation = Some(r);
        i.state = IdState::AddrBound;
        Ok(())
    }

    /// `rdma_resolve_addr`: bind if needed (to `src`, else an ephemeral port), find the
    /// device that serves `dst` and report ADDR_RESOLVED (or ADDR_ERROR).
    pub fn resolve_addr(
        &mut self,
        id: IdHandle,
        src: Option<SocketAddr>,
        dst: SocketAddr,
    ) -> Result<()> {
        let i = self.id(id)?;
        if !matches!(
            i.state,
            IdState::Idle | IdState::AddrBound | IdState::AddrResolved
        ) {
            return Err(err(errno::EINVAL, "id is not idle or bound"));
        }
        if i.state == IdState::Idle {
            let any = match dst {
                SocketAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
                SocketAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
            };
            let s = src.unwrap_or(SocketAddr::new(any, 0));
            self.bind(id, s)?;
        }
        let dst_ip = dst.ip().to_canonical();
        let ps = self.id(id)?.ps;
        let (peer_dev, found) = self.peer_device_for(ps, SocketAddr::new(dst_ip, dst.port()));
        let dev_ip = self.dev.ip();
        let i = self.id_mut(id)?;
        if let Some(s) = i.src {
            if s.ip().is_unspecified() {
                // The source is the device that sends.
                i.src = Some(SocketAddr::new(dev_ip, s.port()));
            }
        }
        i.dst = Some(SocketAddr::new(dst_ip, dst.port()));
        i.peer_dev = Some(peer_dev);
        i.peer_is_listener = found;
        i.state = IdState::AddrResolved;
        self.push(id, EventType::AddrResolved, 0, EventParam::None);
        Ok(())
    }

    /// The device that serves `dst`: for an address of this host, the device of the
    /// process listening there (a listener found by the host's port space; `true`), else
    /// the address's own device (`false`).
    fn peer_device_for(&self, ps: u16, dst: SocketAddr) -> (IpAddr, bool) {
        let ip = dst.ip();
        if ip.is_loopback() || self.ports.is_local(ip) {
            if let Some(d) =
                PortSpace::from_raw(u32::from(ps)).and_then(|s| self.ports.lookup(s, dst))
            {
                return (d.ip(), true);
            }
        }
        (ip, false)
    }

    /// Look for the listener of a local destination again. On Linux one CM serves every
    /// address of the host and finds the listener when the REQ arrives, so a client may
    /// resolve the address before the server listens; here each process is its own
    /// device, and the listener may have appeared (or gone) since `rdma_resolve_addr`.
    /// A listener found once is kept: the port-space lookup reads the host's registry
    /// files, which would cost every connection of a busy client (cmtime) twice more.
    fn refresh_peer_device(&mut self, id: IdHandle) -> Result<()> {
        let i = self.id(id)?;
        let (ps, dst) = (i.ps, i.dst);
        if i.peer_is_listener {
            return Ok(());
        }
        if let Some(dst) = dst {
            let (peer, found) = self.peer_device_for(ps, dst);
            let i = self.id_mut(id)?;
            i.peer_dev = Some(peer);
            i.peer_is_listener = found;
        }
        Ok(())
    }

    /// `rdma_resolve_route`: RoCE paths need no query; ROUTE_RESOLVED at once, with the
    /// device now serving the destination.
    pub fn resolve_route(&mut self, id: IdHandle) -> Result<()> {
        let lt = self.timeouts.packet_life_time;
        if self.id(id)?.state != IdState::AddrResolved {
            return Err(err(errno::EINVAL, "address not resolved"));
        }
        self.refresh_peer_device(id)?;
        let mtu = self.path_mtu;
        let i = self.id_mut(id)?;
        i.state = IdState::RouteResolved;
        i.path_timeout = ib::ack_timeout(CA_ACK_DELAY, lt);
        i.path_mtu = mtu;
        self.push(id, EventType::RouteResolved, 0, EventParam::None);
        Ok(())
    }

    /// `rdma_listen`: take connection requests for the id's port (backlog: most
    /// requests not yet accepted or rejected; more are dropped, so their senders retry).
    pub fn listen(&mut self, id: IdHandle, backlog: i32) -> Result<()> {
        let i = self.id(id)?;
        match i.state {
            IdState::Listen => {
                let i = self.id_mut(id)?;
                if let Some(l) = i.listen.as_mut() {
                    l.backlog = backlog_of(backlog);
                }
                return Ok(());
            }
            IdState::Idle => {
                let any = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0);
                self.bind(id, any)?;
            }
            IdState::AddrBound => {}
            _ => return Err(err(errno::EINVAL, "id is not bound")),
        }
        let i = self.id_mut(id)?;
        let (ps, port) = (i.ps, i.src.map_or(0, |s| s.port()));
        if let Some(r) = i.reservation.as_mut() {
            r.set_listening(true)
                .map_err(|e| err(io_errno(&e), "port is taken"))?;
        }
        i.state = IdState::Listen;
        i.listen = Some(ListenState {
            backlog: backlog_of(backlog),
            pending: 0,
        });
        // Several ids may listen on one port (different addresses): one service.
        let _ = self.ib.listen(service_id(ps, port));
        Ok(())
    }

    fn req_for(&mut self, id: IdHandle, p: &ConnParam) -> Result<(Peer, Req)> {
        let psn = (self.rng.next_u64() as u32) & 0xFF_FFFF;
        let t = self.timeouts;
        let dev_ip = self.dev.ip();
        let i = self.id_mut(id)?;
        let (Some(src), Some(dst), Some(peer_dev)) = (i.src, i.dst, i.peer_dev) else {
            return Err(err(errno::EINVAL, "route not resolved"));
        };
        let mut private_data = [0u8; private_len::REQ];
        // The header's source is the device's address, which the REQ comes from (a peer
        // refuses a header that names another): the same as the id's source unless the
        // id was bound to another of the host's addresses (127.0.0.1 while the device
        // took 127.0.0.2).
        let (hsrc, hdst) = same_family(dev_ip, dst.ip());
        CmaHeader {
            src_port: src.port(),
            src: hsrc,
            dst: hdst,
        }
        .emit(&mut private_data)
        .map_err(|_| err(errno::EAFNOSUPPORT, "address family"))?;
        // A UD id's private data goes into the SIDR_REQ (`connect`), which has room for
        // more than a REQ.
        if i.service != Service::Ud {
            private_data[CMA_HEADER_LEN..CMA_HEADER_LEN + p.private_data.len()]
                .copy_from_slice(&p.private_data);
        }
        // A REQ's starting PSN is the one its sender's receive queue expects (the
        // IB CM's rq_psn); the REP's says where the active side sends from.
        i.rq_psn = psn;
        i.initiator_depth = p.initiator_depth;
        i.responder_resources = p.responder_resources;
        i.retry_count = p.retry_count.min(7);
        i.rnr_retry_count = p.rnr_retry_count.min(7);
        let gid = |ip: IpAddr| verbs::Gid::from_ip(ip).0;
        let primary = CmPath {
            local_lid: 0xFFFF,
            remote_lid: 0xFFFF,
            local_gid: gid(dev_ip),
            remote_gid: gid(peer_dev),
            flow_label: 0,
            packet_rate: 0,
            traffic_class: i.tos,
            hop_limit: 64,
            sl: 0,
            subnet_local: false,
            local_ack_timeout: 0,
        };
        let req = Req {
            local_comm_id: 0,
            service_id: service_id(i.ps, dst.port()),
            local_ca_guid: 0,
            local_qkey: 0,
            local_qpn: p.qp_num & 0xFF_FFFF,
            responder_resources: p.responder_resources,
            local_eecn: 0,
            initiator_depth: p.initiator_depth,
            remote_eecn: 0,
            remote_cm_response_timeout: t.cm_response,
            transport_service_type: if i.service == Service::Uc { 1 } else { 0 },
            e2e_flow_control: p.flow_control != 0,
            starting_psn: psn,
            local_cm_response_timeout: t.cm_response,
            retry_count: p.retry_count.min(7),
            pkey: 0xFFFF,
            path_mtu: i.path_mtu as u8,
            rdc_exists: false,
            rnr_retry_count: p.rnr_retry_count.min(7),
            max_cm_retries: t.max_retries,
            srq: p.srq != 0,
            extended_transport_type: 0,
            primary,
            alternate: CmPath::default(),
            sap_supported: false,
            private_data,
        };
        Ok((Peer::gsi(peer_dev), req))
    }

    /// `rdma_connect`: send the REQ (connected ids) or SIDR_REQ (UD ids). Private data
    /// is limited as on Linux (56 bytes in a REQ, 180 in a SIDR_REQ).
    pub fn connect(&mut self, now: u64, id: IdHandle, p: &ConnParam) -> Result<()> {
        let i = self.id(id)?;
        if i.state != IdState::RouteResolved {
            return Err(err(errno::EINVAL, "route not resolved"));
        }
        let ud = i.service == Service::Ud;
        let max = if ud {
            MAX_UD_CONNECT_PRIVATE
        } else {
            MAX_CONNECT_PRIVATE
        };
        if p.private_data.len() > max {
            return Err(err(errno::EINVAL, "private data too long"));
        }
        let (ps, dst) = (i.ps, i.dst);
        self.refresh_peer_device(id)?;
        let listener_found = self.id(id)?.peer_is_listener;
        let (peer, req) = self.req_for(id, p)?;
        // A destination on this host that no listener and no device serves: the host's CM
        // rejects at once ("invalid service ID"), as Linux's does.
        if let Some(dst) = dst {
            // The REQ goes to the device of the listener found before (which rejects it
            // if the listener has gone since): only that device's being gone matters, and
            // asking the port space again cost every connection a directory read.
            let unserved = if listener_found {
                let alive =
                    port_space_of(ps).is_ok_and(|s| self.ports.listener_alive(s, dst, peer.ip));
                !alive && !self.ports.has_device(peer.ip)
            } else {
                let local = dst.ip().is_loopback() || self.ports.is_local(dst.ip());
                let listener = port_space_of(ps).map(|s| self.ports.lookup(s, dst));
                local && matches!(listener, Ok(None)) && !self.ports.has_device(peer.ip)
            };
            if unserved {
                // For a UD id it is the SIDR_REP "unsupported" a Linux host would send.
                let (event, status, param) = if ud {
                    let param = UdParam {
                        private_data: vec![0; private_len::SIDR_REP],
                        ..UdParam::default()
                    };
                    let status = i32::from(ib::sidr_status::UNSUPPORTED);
                    (EventType::Unreachable, status, EventParam::Ud(param))
                } else {
                    let status = i32::from(rej_reason::INVALID_SERVICE_ID);
                    let param = EventParam::Conn(ConnParam::default());
                    (EventType::Rejected, status, param)
                };
                self.push(id, event, status, param);
                return Ok(());
            }
        }
        let comm = if ud {
            let mut private_data = [0u8; private_len::SIDR_REQ];
            private_data[..CMA_HEADER_LEN].copy_from_slice(&req.private_data[..CMA_HEADER_LEN]);
            private_data[CMA_HEADER_LEN..CMA_HEADER_LEN + p.private_data.len()]
                .copy_from_slice(&p.private_data);
            let sidr = SidrReq {
                request_id: 0,
                pkey: 0xFFFF,
                service_id: req.service_id,
                private_data,
            };
            let timeout_ms = ib::iba_time_ms(self.timeouts.cm_response);
            self.ib
                .send_sidr_req(now, peer, sidr, timeout_ms, self.timeouts.max_retries)
        } else {
            self.ib
                .send_req(now, peer, req, self.timeouts.packet_life_time)
        };
        self.by_comm.insert(comm, id);
        let i = self.id_mut(id)?;
        i.comm = Some(comm);
        i.state = IdState::Connect;
        self.drain_ib(now);
        Ok(())
    }

    /// `rdma_accept`. Passive side: send the REP (or the SIDR_REP for UD) with `p`'s QP
    /// number and resources; the RTU then reports ESTABLISHED. Active side, after
    /// CONNECT_RESPONSE: send the RTU (the id is established).
    ///
    /// A request the passive side fails to accept (too much private data) is rejected
    /// (REJ "consumer reject", 28, without private data; a SIDR_REP "rejected" for UD)
    /// and the error returned, as Linux's `rdma_accept` does: the peer learns at once
    /// instead of waiting out the MRA's service timeout.
    pub fn accept(&mut self, now: u64, id: IdHandle, p: &ConnParam) -> Result<()> {
        let r = self.try_accept(now, id, p);
        if let Err(e) = r {
            let passive = self.id(id).ok().and_then(|i| i.comm).is_some_and(|c| {
                matches!(
                    self.ib.state(c),
                    Some(ib::State::SidrReqRcvd | ib::State::ReqRcvd | ib::State::MraReqSent)
                )
            });
            if passive {
                let _ = self.reject(now, id, &[]);
            }
            return Err(e);
        }
        r
    }

    fn try_accept(&mut self, now: u64, id: IdHandle, p: &ConnParam) -> Result<()> {
        let i = self.id(id)?;
        // The port space decides the Q_Key a SIDR_REP names, as the kernel's
        // `cma_set_qkey` does for an IP-addressed id (only AF_IB ids take the caller's).
        let qkey = ud_qkey(i.ps);
        let Some(comm) = i.comm else {
            return Err(err(errno::EINVAL, "no connection request to accept"));
        };
        if i.state != IdState::Connect {
            return Err(err(errno::EINVAL, "id is not connecting"));
        }
        let parent = i.parent;
        match self.ib.state(comm) {
            Some(ib::State::SidrReqRcvd) => {
                if p.private_data.len() > MAX_UD_ACCEPT_PRIVATE {
                    return Err(err(errno::EINVAL, "private data too long"));
                }
                let rep = SidrRep::new(
                    ib::sidr_status::SUCCESS,
                    p.qp_num & 0xFF_FFFF,
                    qkey,
                    &p.private_data,
                );
                self.ib
                    .send_sidr_rep(now, comm, rep)
                    .map_err(|_| err(errno::EINVAL, "bad CM state"))?;
                self.by_comm.remove(&comm);
                self.id_mut(id)?.comm = None;
            }
            Some(ib::State::ReqRcvd | ib::State::MraReqSent) => {
                if p.private_data.len() > MAX_ACCEPT_PRIVATE {
                    return Err(err(errno::EINVAL, "private data too long"));
                }
                let i = self.id_mut(id)?;
                // Chosen when the request came, so that the QP's RTR (which librdmacm
                // does before it accepts) already expects it.
                let psn = i.rq_psn;
                i.initiator_depth = p.initiator_depth;
                i.responder_resources = p.responder_resources;
                let rep = Rep {
                    local_comm_id: 0,
                    remote_comm_id: 0,
                    local_qkey: 0,
                    local_qpn: p.qp_num & 0xFF_FFFF,
                    local_eecn: 0,
                    starting_psn: psn,
                    responder_resources: p.responder_resources,
                    initiator_depth: p.initiator_depth,
                    target_ack_delay: 0,
                    failover_accepted: 0,
                    e2e_flow_control: p.flow_control != 0,
                    rnr_retry_count: p.rnr_retry_count.min(7),
                    srq: p.srq != 0,
                    local_ca_guid: 0,
                    private_data: zero_padded(&p.private_data),
                };
                self.ib
                    .send_rep(now, comm, rep)
                    .map_err(|_| err(errno::EINVAL, "bad CM state"))?;
            }
            Some(ib::State::RepRcvd | ib::State::MraRepSent) => {
                self.ib
                    .send_rtu(now, comm, &[])
                    .map_err(|_| err(errno::EINVAL, "bad CM state"))?;
            }
            _ => return Err(err(errno::EINVAL, "nothing to accept")),
        }
        self.settle_parent(parent, id);
        self.drain_ib(now);
        Ok(())
    }

    fn settle_parent(&mut self, parent: Option<IdHandle>, id: IdHandle) {
        if let Some(p) = parent {
            if let Some(l) = self.ids.get_mut(&p).and_then(|i| i.listen.as_mut()) {
                l.pending = l.pending.saturating_sub(1);
            }
            if let Some(i) = self.ids.get_mut(&id) {
                i.parent = None;
            }
        }
    }

    /// `rdma_reject`: refuse a connection request with private data (REJ reason 28,
    /// "consumer reject"; a UD request gets a SIDR_REP "rejected").
    pub fn reject(&mut self, now: u64, id: IdHandle, private: &[u8]) -> Result<()> {
        self.reject_with_reason(now, id, rej_reason::CONSUMER_REJECT, private)
    }

    /// [`Cma::reject`] with another REJ reason (`rdma_reject_ece` sends 35, "vendor
    /// option not supported").
    pub fn reject_with_reason(
        &mut self,
        now: u64,
        id: IdHandle,
        reason: u16,
        private: &[u8],
    ) -> Result<()> {
        let i = self.id(id)?;
        let (Some(comm), parent) = (i.comm, i.parent) else {
            return Err(err(errno::EINVAL, "no connection request to reject"));
        };
        if private.len() > MAX_REJECT_PRIVATE {
            return Err(err(errno::EINVAL, "private data too long"));
        }
        match self.ib.state(comm) {
            Some(ib::State::SidrReqRcvd) => {
                let rep = SidrRep::new(ib::sidr_status::REJECT, 0, 0, private);
                let _ = self.ib.send_sidr_rep(now, comm, rep);
            }
            _ => {
                self.ib
                    .send_rej(now, comm, reason, &[], private)
                    .map_err(|_| err(errno::EINVAL, "nothing to reject"))?;
            }
        }
        // The REJ is out; the id keeps nothing of the connection, nor does the protocol.
        self.ib.forget(comm);
        self.by_comm.remove(&comm);
        self.id_mut(id)?.comm = None;
        self.settle_parent(parent, id);
        self.drain_ib(now);
        Ok(())
    }

    /// `rdma_disconnect`: send the DREQ (or, when the peer asked first, the DREP). The
    /// face moves the QP to ERR, which flushes it.
    pub fn disconnect(&mut self, now: u64, id: IdHandle) -> Result<()> {
        let i = self.id(id)?;
        let Some(comm) = i.comm else {
            // A second disconnect of a connection that is going or gone succeeds, as on
            // Linux (programs disconnect after the peer's DISCONNECTED too).
            if i.state == IdState::Disconnect {
                return Ok(());
            }
            return Err(err(errno::EINVAL, "not connected"));
        };
        match self.ib.state(comm) {
            Some(ib::State::Established) => {
                let _ = self.ib.send_dreq(now, comm, &[]);
            }
            Some(ib::State::DreqRcvd) => {
                let _ = self.ib.send_drep(now, comm, &[]);
            }
            Some(
                ib::State::RepSent | ib::State::MraRepRcvd, // the RTU may still come
            ) => {
                let _ = self.ib.establish(comm);
                let _ = self.ib.send_dreq(now, comm, &[]);
            }
            // Disconnecting already (DREQ sent, timewait): nothing more to send.
            Some(ib::State::DreqSent | ib::State::Timewait | ib::State::Idle) => {}
            _ => return Err(err(errno::EINVAL, "not connected")),
        }
        self.drain_ib(now);
        Ok(())
    }

    /// The device found local QP `qpn`'s peer lost: its keepalive probes went
    /// unanswered (the peer process died without a word, or the path is gone), and the
    /// QP is in ERR. The connection the QP serves ends as the peer's DREQ would have
    /// ended it, as Linux ends it when a dead process's rdma_cm file closes: its id gets
    /// DISCONNECTED (status 0), and a DREQ goes out (a peer alive after all learns the
    /// connection is over; unanswered, it times out into timewait). Returns whether a
    /// connection of this CM uses the QP.
    pub fn peer_lost(&mut self, now: u64, qpn: u32) -> bool {
        let comms = self.ib.conns_of_qp(qpn & 0xFF_FFFF);
        let mut found = false;
        for comm in comms {
            let Some(&id) = self.by_comm.get(&comm) else {
                continue;
            };
            found = true;
            match self.ib.state(comm) {
                Some(ib::State::RepSent | ib::State::MraRepRcvd) => {
                    let _ = self.ib.establish(comm);
                    let _ = self.ib.send_dreq(now, comm, &[]);
                }
                Some(ib::State::Established) => {
                    let _ = self.ib.send_dreq(now, comm, &[]);
                }
                _ => {}
            }
            // What establishing queued (ESTABLISHED) is reported before DISCONNECTED.
            self.drain_ib(now);
            let Some(i) = self.ids.get_mut(&id) else {
                continue;
            };
            if i.disconnected {
                continue;
            }
            i.disconnected = true;
            i.state = IdState::Disconnect;
            self.push(
                id,
                EventType::Disconnected,
                0,
                EventParam::Conn(ConnParam::default()),
            );
        }
        found
    }

    /// The QP saw its first packet before the RTU (the QP's COMM_EST event): the
    /// connection is established.
    pub fn establish(&mut self, now: u64, id: IdHandle) -> Result<()> {
        let comm = self
            .id(id)?
            .comm
            .ok_or(err(errno::EINVAL, "not connecting"))?;
        self.ib.establish(comm).map_err(|e| match e {
            ib::CmError::AlreadyConnected => err(errno::EISCONN, "already established"),
            _ => err(errno::EINVAL, "not connecting"),
        })?;
        self.drain_ib(now);
        Ok(())
    }

    /// `rdma_destroy_id`: what the connection's state needs goes out (REJ, DREQ, DREP),
    /// the port is released, pending events for the id are dropped.
    pub fn destroy_id(&mut self, now: u64, id: IdHandle) -> Result<()> {
        let i = self
            .ids
            .remove(&id)
            .ok_or(err(errno::EINVAL, "no such CM id"))?;
        if let Some(comm) = i.comm {
            self.ib.destroy(now, comm);
            self.by_comm.remove(&comm);
        }
        if i.state == IdState::Listen {
            let port = i.src.map_or(0, |s| s.port());
            let still = self.ids.values().any(|o| {
                o.state == IdState::Listen && o.ps == i.ps && o.src.map_or(0, |s| s.port()) == port
            });
            if !still {
                self.ib.unlisten(service_id(i.ps, port));
            }
        }
        self.settle_parent(i.parent, id);
        self.events.retain(|e| e.id != id);
        drop(i.reservation);
        Ok(())
    }

    /// Destroy every id, as the kernel does when a process's rdma_cm file closes: peers
    /// of connected ids get a DREQ, pending requests a REJ, so they learn at once that
    /// this side is gone.
    pub fn shutdown(&mut self, now: u64) {
        let mut ids: Vec<IdHandle> = self.ids.keys().copied().collect();
        ids.sort_unstable();
        for id in ids {
            let _ = self.destroy_id(now, id);
        }
    }

    /// `rdma_join_multicast` (`rdma_join_multicast_ex` with a full or send-only full
    /// member join when `send_only`): join the group at `addr` (IPv4 or IPv6) for UD id
    /// `id`, and report MULTICAST_JOIN. As the kernel's `rdma_join_multicast` /
    /// `cma_iboe_join_multicast`: EINVAL unless the id carries UD (UDP and IPoIB port
    /// spaces, or IB with a UD QP), is bound to this device (not a wildcard address) and
    /// is ADDR_BOUND or ADDR_RESOLVED, and unless `addr` is a non-zero address. The event
    /// ([`CmaEvent::mc`] names the join, `context` as given) carries in its UD parameters
    /// the group's address vector as `cma_make_mc_event` builds it (`ah_attr` global, the
    /// MGID as `grh.dgid` — `::ffff:a.b.c.d` for an IPv4 group, the address itself for
    /// IPv6 —, GID index 0, hop limit 64, traffic class, flow label, SL and DLID 0, port 1),
    /// QPN 0xFFFFFF and the id's Q_Key ([`UDP_QKEY`]). The model attaches no QP: the face
    /// does, on the event, unless the join is send-only (as librdmacm's
    /// `ucma_process_join`).
    ///
    /// Deliberate difference: Linux refuses IPv6 groups on RoCEv2 (`ENOTSUPP`); softrdma
    /// joins them, MGID the IPv6 address, since its devices send IPv6 multicast as they
    /// send IPv4.
    pub fn join_multicast(
        &mut self,
        id: IdHandle,
        addr: SocketAddr,
        send_only: bool,
        context: u64,
    ) -> Result<()> {
        let i = self.id(id)?;
        if i.service != Service::Ud {
            return Err(err(errno::EINVAL, "multicast needs a UD id"));
        }
        if !matches!(i.state, IdState::AddrBound | IdState::AddrResolved) || !self.has_device(id)? {
            return Err(err(
                errno::EINVAL,
                "the id is not bound or resolved to this device",
            ));
        }
        if addr.ip().is_unspecified() {
            return Err(err(errno::EINVAL, "no group address"));
        }
        let qkey = ud_qkey(i.ps);
        let join = McastJoin {
            addr,
            context,
            send_only,
        };
        let channel = i.channel;
        self.id_mut(id)?.mc.push(join);
        let param = UdParam {
            private_data: Vec::new(),
            ah_attr: mcast_ah(addr.ip()),
            qp_num: softrdma_wire::MULTICAST_QPN,
            qkey,
        };
        self.events.push_back(CmaEvent {
            channel,
            id,
            listen_id: None,
            event: EventType::MulticastJoin,
            status: 0,
            param: EventParam::Ud(param),
            mc: Some(join),
        });
        Ok(())
    }

    /// `rdma_leave_multicast`: forget the id's oldest join of `addr` (compared as given,
    /// port included, as librdmacm compares the sockaddr); its MULTICAST_JOIN event, if
    /// not taken yet, goes too (ucma's `ucma_cleanup_mc_events`). EADDRNOTAVAIL when the
    /// id has no such join (librdmacm's answer). The face detaches its QP from the group
    /// first, unless the join was send-only. Returns the join it forgot (an agent withdraws
    /// its event from the id's channel with it: [`crate::agent::Agent::leave_multicast`]).
    pub fn leave_multicast(&mut self, id: IdHandle, addr: SocketAddr) -> Result<McastJoin> {
        let i = self.id_mut(id)?;
        let Some(at) = i.mc.iter().position(|m| m.addr == addr) else {
            return Err(err(
                errno::EADDRNOTAVAIL,
                "the id has not joined that group",
            ));
        };
        let join = i.mc.remove(at);
        if let Some(e) = self
            .events
            .iter()
            .position(|e| e.id == id && e.mc == Some(join))
        {
            self.events.remove(e);
        }
        Ok(join)
    }

    /// The id's multicast joins, oldest first.
    pub fn multicast_joins(&self, id: IdHandle) -> Result<&[McastJoin]> {
        Ok(&self.id(id)?.mc)
    }

    /// Attributes (and mask) that move the id's QP to `state` (INIT, RTR or RTS), as
    /// `rdma_init_qp_attr` gives them.
    pub fn init_qp_attr(&self, id: IdHandle, state: QpState) -> Result<(QpAttr, QpAttrMask)> {
        use QpAttrMask as M;
        let i = self.id(id)?;
        let mut a = QpAttr {
            qp_state: state,
            port_num: 1,
            ..QpAttr::default()
        };
        let connected = i.comm.is_some() || i.remote_qpn != 0;
        match state {
            QpState::Init => {
                let mut m = M::STATE | M::PKEY_INDEX | M::PORT;
                if i.service == Service::Ud {
                    a.qkey = ud_qkey(i.ps);
                    m |= M::QKEY;
                } else {
                    a.qp_access_flags = if connected {
                        let mut f = Access::REMOTE_WRITE;
                        // UC carries no READs or atomics: a UC QP may not be granted them.
                        if i.service == Service::Rc && i.responder_resources > 0 {
                            f |= Access::REMOTE_READ | Access::REMOTE_ATOMIC;
                        }
                        f
                    } else {
                        Access::empty()
                    };
                    m |= M::ACCESS_FLAGS;
                }
                Ok((a, m))
            }
            QpState::Rtr if i.service != Service::Ud => {
                if !connected {
                    return Err(err(errno::EINVAL, "no connection yet"));
                }
                let Some(peer) = i.peer_dev else {
                    return Err(err(errno::EINVAL, "no peer"));
                };
                a.ah_attr = ah_to(peer, i.tos);
                a.path_mtu = i.path_mtu;
                a.dest_qp_num = i.remote_qpn;
                a.rq_psn = i.rq_psn;
                let mut m = M::STATE | M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN;
                if i.service == Service::Rc {
                    a.max_dest_rd_atomic = i.responder_resources;
                    a.min_rnr_timer = 0;
                    m |= M::MAX_DEST_RD_ATOMIC | M::MIN_RNR_TIMER;
                }
                Ok((a, m))
            }
            QpState::Rts if i.service != Service::Ud => {
                if !connected {
                    return Err(err(errno::EINVAL, "no connection yet"));
                }
                a.sq_psn = i.sq_psn;
                let mut m = M::STATE | M::SQ_PSN;
                if i.service == Service::Rc {
                    a.retry_cnt = i.retry_count;
                    a.rnr_retry = i.rnr_retry_count;
                    a.max_rd_atomic = i.initiator_depth;
                    a.timeout = i.ack_timeout.unwrap_or(i.path_timeout);
                    m |= M::RETRY_CNT | M::RNR_RETRY | M::MAX_QP_RD_ATOMIC | M::TIMEOUT;
                }
                Ok((a, m))
            }
            QpState::Rtr => Ok((a, M::STATE)),
            QpState::Rts => {
                a.sq_psn = i.sq_psn;
                Ok((a, M::STATE | M::SQ_PSN))
            }
            _ => Err(err(errno::EINVAL, "only INIT, RTR and RTS")),
        }
    }

    /// Next event for a program.
    pub fn poll_event(&mut self) -> Option<CmaEvent> {
        self.events.pop_front()
    }

    /// Next MAD to send.
    pub fn poll_transmit(&mut self) -> Option<(Peer, ib::Mad)> {
        self.ib.poll_transmit()
    }

    /// Earliest timer.
    pub fn poll_timeout(&self) -> Option<u64> {
        self.ib.poll_timeout()
    }

    /// Fire due timers.
    pub fn handle_timeout(&mut self, now: u64) {
        self.ib.handle_timeout(now);
        self.drain_ib(now);
    }

    /// A MAD arrived.
    pub fn handle_mad(&mut self, now: u64, from: Peer, mad: &[u8]) {
        self.ib.handle_mad(now, from, mad);
        self.drain_ib(now);
    }

    /// Turn the protocol's events into rdma_cm events.
    fn drain_ib(&mut self, now: u64) {
        while let Some(ev) = self.ib.poll_event() {
            let comm = ev.id;
            match ev.kind {
                EventKind::ReqReceived { req, peer } => self.on_req(now, comm, *req, peer),
                EventKind::SidrReqReceived { req, peer } => self.on_sidr_req(now, comm, *req, peer),
                other => {
                    let Some(&id) = self.by_comm.get(&comm) else {
                        continue;
                    };
                    self.on_conn_event(now, id, comm, other);
                }
            }
        }
    }

    /// The listener for a request to `dst` in `ps`: one bound to that address, else a
    /// wildcard one.
    fn find_listener(&self, ps: u16, dst: SocketAddr) -> Option<IdHandle> {
        let mut wildcard = None;
        for (h, i) in &self.ids {
            if i.state != IdState::Listen || i.ps != ps {
                continue;
            }
            let Some(src) = i.src else { continue };
            if src.port() != dst.port() {
                continue;
            }
            if src.ip().to_canonical() == dst.ip().to_canonical() {
                return Some(*h);
            }
            if src.ip().is_unspecified() {
                wildcard = Some(*h);
            }
        }
        wildcard
    }

    fn new_child(
        &mut self,
        listener: IdHandle,
        comm: CommId,
        src: SocketAddr,
        dst: SocketAddr,
        peer: Peer,
    ) -> Option<IdHandle> {
        let l = self.ids.get_mut(&listener)?;
        let ls = l.listen.as_mut()?;
        if ls.pending >= ls.backlog {
            return None;
        }
        ls.pending += 1;
        let (channel, ps, service, tos, path_timeout) =
            (l.channel, l.ps, l.service, l.tos, l.path_timeout);
        let h = self.alloc_handle();
        let mut c = Id::new(channel, ps, service);
        c.state = IdState::Connect;
        c.src = Some(src);
        c.dst = Some(dst);
        c.peer_dev = Some(peer.ip);
        c.comm = Some(comm);
        c.parent = Some(listener);
        c.tos = tos;
        c.path_timeout = if path_timeout == 0 {
            ib::ack_timeout(CA_ACK_DELAY, self.timeouts.packet_life_time)
        } else {
            path_timeout
        };
        self.ids.insert(h, c);
        self.by_comm.insert(comm, h);
        Some(h)
    }

    /// Refuse a request no id will take: the REJ goes out and nothing of it is kept.
    fn refuse(&mut self, now: u64, comm: CommId, reason: u16) {
        let _ = self.ib.send_rej(now, comm, reason, &[], &[]);
        self.ib.forget(comm);
    }

    fn on_req(&mut self, now: u64, comm: CommId, req: Req, peer: Peer) {
        let Some((ps, port)) = softrdma_wire::cm::split_service_id(req.service_id) else {
            return self.refuse(now, comm, rej_reason::INVALID_SERVICE_ID);
        };
        let Ok(h) = CmaHeader::parse(&req.private_data) else {
            return self.refuse(now, comm, rej_reason::CONSUMER_REJECT);
        };
        // The peer's address a program is told is the header's, so its IP must be the
        // one the REQ came from (the header's port has no counterpart on the wire and is
        // taken as it is). A header that names another source is refused like one that
        // does not parse (REJ 28, what Linux's rdma_cm answers a request it cannot
        // take): a genuine peer learns at once rather than retrying for a minute, and a
        // forger learns nothing new.
        if h.src.to_canonical() != peer.ip.to_canonical() {
            return self.refuse(now, comm, rej_reason::CONSUMER_REJECT);
        }
        let local = SocketAddr::new(h.dst.to_canonical(), port);
        let remote = SocketAddr::new(h.src.to_canonical(), h.src_port);
        let Some(listener) = self.find_listener(ps, local) else {
            return self.refuse(now, comm, rej_reason::CONSUMER_REJECT);
        };
        let Some(id) = self.new_child(listener, comm, local, remote, peer) else {
            // Over the backlog: drop it quietly; the peer's retry may find room.
            self.ib.forget(comm);
            return;
        };
        let psn = (self.rng.next_u64() as u32) & 0xFF_FFFF;
        if let Some(i) = self.ids.get_mut(&id) {
            i.remote_qpn = req.local_qpn;
            // The active side expects our sends at its REQ's PSN; ours is the REP's.
            i.sq_psn = req.starting_psn;
            i.rq_psn = psn;
            // The passive side's path, and so its address vector, is the REQ's primary
            // path, with its traffic class (Linux's cm_format_paths_from_req).
            i.tos = req.primary.traffic_class;
            // Our resources mirror the peer's.
            i.responder_resources = req.initiator_depth;
            i.initiator_depth = req.responder_resources;
            i.retry_count = req.retry_count;
            i.rnr_retry_count = req.rnr_retry_count;
            i.path_timeout = req.primary.local_ack_timeout.max(1);
            // Both ends must split messages at the same size: the REQ's MTU is the
            // path's (Linux's passive side takes it as it is). A value that names no IB
            // MTU gets the 1024 bytes every RoCE link carries.
            i.path_mtu =
                verbs::Mtu::from_raw(u32::from(req.path_mtu)).unwrap_or(verbs::Mtu::Mtu1024);
        }
        let _ = self.ib.send_mra(now, comm, MRA_SETTING, &[]);
        let param = ConnParam {
            private_data: req.private_data[CMA_HEADER_LEN..].to_vec(),
            responder_resources: req.initiator_depth,
            initiator_depth: req.responder_resources,
            flow_control: u8::from(req.e2e_flow_control),
            retry_count: req.retry_count,
            rnr_retry_count: req.rnr_retry_count,
            srq: u8::from(req.srq),
            qp_num: req.local_qpn,
        };
        let channel = self.ids.get(&id).map_or(0, |i| i.channel);
        self.events.push_back(CmaEvent {
            channel,
            id,
            listen_id: Some(listener),
            event: EventType::ConnectRequest,
            status: 0,
            param: EventParam::Conn(param),
            mc: None,
        });
    }

    fn on_sidr_req(&mut self, now: u64, comm: CommId, req: SidrReq, peer: Peer) {
        let reject = |cma: &mut Cma| {
            let rep = SidrRep::new(ib::sidr_status::UNSUPPORTED, 0, 0, &[]);
            let _ = cma.ib.send_sidr_rep(now, comm, rep);
        };
        let Some((ps, port)) = softrdma_wire::cm::split_service_id(req.service_id) else {
            return reject(self);
        };
        let Ok(h) = CmaHeader::parse(&req.private_data) else {
            return reject(self);
        };
        // As for a REQ: the source the program is told must be the packet's.
        if h.src.to_canonical() != peer.ip.to_canonical() {
            return reject(self);
        }
        let local = SocketAddr::new(h.dst.to_canonical(), port);
        let remote = SocketAddr::new(h.src.to_canonical(), h.src_port);
        let Some(listener) = self.find_listener(ps, local) else {
            return reject(self);
        };
        let Some(id) = self.new_child(listener, comm, local, remote, peer) else {
            self.ib.forget(comm);
            return;
        };
        let channel = self.ids.get(&id).map_or(0, |i| i.channel);
        let tos = self.ids.get(&id).map_or(0, |i| i.tos);
        self.events.push_back(CmaEvent {
            channel,
            id,
            listen_id: Some(listener),
            event: EventType::ConnectRequest,
            status: 0,
            param: EventParam::Ud(UdParam {
                private_data: req.private_data[CMA_HEADER_LEN..].to_vec(),
                ah_attr: ah_to(peer.ip, tos),
                qp_num: 0,
                qkey: 0,
            }),
            mc: None,
        });
    }

    fn on_conn_event(&mut self, now: u64, id: IdHandle, comm: CommId, kind: EventKind) {
        let tos = self.ids.get(&id).map_or(0, |i| i.tos);
        match kind {
            EventKind::RepReceived(rep) => {
                if let Some(i) = self.ids.get_mut(&id) {
                    i.remote_qpn = rep.local_qpn;
                    i.sq_psn = rep.starting_psn;
                    i.responder_resources = i.responder_resources.min(rep.initiator_depth);
                    i.initiator_depth = i.initiator_depth.min(rep.responder_resources);
                    i.rnr_retry_count = rep.rnr_retry_count;
                    i.path_timeout = i.path_timeout.max(1);
                }
                let _ = self.ib.send_mra(now, comm, MRA_SETTING, &[]);
                let param = ConnParam {
                    private_data: rep.private_data.to_vec(),
                    responder_resources: rep.initiator_depth,
                    initiator_depth: rep.responder_resources,
                    flow_control: u8::from(rep.e2e_flow_control),
                    retry_count: 0,
                    rnr_retry_count: rep.rnr_retry_count,
                    srq: u8::from(rep.srq),
                    qp_num: rep.local_qpn,
                };
                self.push(id, EventType::ConnectResponse, 0, EventParam::Conn(param));
            }
            EventKind::RtuReceived(_) | EventKind::UserEstablished => {
                self.push(
                    id,
                    EventType::Established,
                    0,
                    EventParam::Conn(ConnParam::default()),
                );
            }
            EventKind::RejReceived(rej) => {
                if let Some(i) = self.ids.get_mut(&id) {
                    i.state = IdState::RouteResolved;
                    i.comm = None;
                }
                // The id lets go of the connection: the protocol keeps nothing of it.
                self.by_comm.remove(&comm);
                self.ib.forget(comm);
                let param = ConnParam {
                    private_data: rej.private_data.to_vec(),
                    ..ConnParam::default()
                };
                self.push(
                    id,
                    EventType::Rejected,
                    i32::from(rej.reason),
                    EventParam::Conn(param),
                );
            }
            EventKind::ReqError | EventKind::RepError | EventKind::SidrReqError => {
                if let Some(i) = self.ids.get_mut(&id) {
                    i.comm = None;
                }
                self.by_comm.remove(&comm);
                self.ib.forget(comm);
                self.push(
                    id,
                    EventType::Unreachable,
                    -errno::ETIMEDOUT,
                    EventParam::None,
                );
            }
            EventKind::DreqReceived(_) | EventKind::DrepReceived(_) | EventKind::DreqError => {
                let status = if matches!(kind, EventKind::DreqError) {
                    -errno::ETIMEDOUT
                } else {
                    0
                };
                let Some(i) = self.ids.get_mut(&id) else {
                    return;
                };
                if i.disconnected {
                    return;
                }
                i.disconnected = true;
                i.state = IdState::Disconnect;
                self.push(
                    id,
                    EventType::Disconnected,
                    status,
                    EventParam::Conn(ConnParam::default()),
                );
            }
            EventKind::TimewaitExit => {
                self.push(id, EventType::TimewaitExit, 0, EventParam::None);
            }
            EventKind::SidrRepReceived(rep) => {
                if let Some(i) = self.ids.get_mut(&id) {
                    i.comm = None;
                }
                self.by_comm.remove(&comm);
                self.ib.forget(comm);
                if rep.status != ib::sidr_status::SUCCESS {
                    // Linux passes a refusal's private data on in the event's UD
                    // parameters (cma_sidr_rep_handler), the rest zero.
                    let param = UdParam {
                        private_data: rep.private_data.to_vec(),
                        ..UdParam::default()
                    };
                    self.push(
                        id,
                        EventType::Unreachable,
                        i32::from(rep.status),
                        EventParam::Ud(param),
                    );
                    return;
                }
                let Some(i) = self.ids.get_mut(&id) else {
                    return;
                };
                i.remote_qpn = rep.qpn;
                i.remote_qkey = rep.qkey;
                let peer = i.peer_dev.unwrap_or(self.dev.ip());
                let param = UdParam {
                    private_data: rep.private_data.to_vec(),
                    ah_attr: ah_to(peer, tos),
                    qp_num: rep.qpn,
                    qkey: rep.qkey,
                };
                self.push(id, EventType::Established, 0, EventParam::Ud(param));
            }
            EventKind::ReqReceived { .. } | EventKind::SidrReqReceived { .. } => {}
        }
    }
}

/// `a` and `b` in one family: both as they are when they share one, else both IPv6 (an
/// IPv4 address IPv4-mapped), which the peer reads back as IPv4.
fn same_family(a: IpAddr, b: IpAddr) -> (IpAddr, IpAddr) {
    let v6 = |x: IpAddr| match x {
        IpAddr::V4(v4) => IpAddr::V6(v4.to_ipv6_mapped()),
        v6 => v6,
    };
    if a.is_ipv4() == b.is_ipv4() {
        (a, b)
    } else {
        (v6(a), v6(b))
    }
}

fn backlog_of(b: i32) -> usize {
    // Linux: a backlog of 0 or less means the default.
    if b <= 0 {
        1024
    } else {
        b as usize
    }
}

/// An address vector to the device at `ip`.
fn ah_to(ip: IpAddr, tos: u8) -> verbs::AhAttr {
    verbs::AhAttr {
        grh: verbs::GlobalRoute {
            dgid: verbs::Gid::from_ip(ip),
            flow_label: 0,
            sgid_index: 0,
            hop_limit: 64,
            traffic_class: tos,
        },
        is_global: true,
        port_num: 1,
        ..verbs::AhAttr::default()
    }
}

/// The Q_Key of a UD id's QP and of its multicast groups: RDMA_UDP_QKEY, as the kernel's
/// `cma_set_default_qkey` gives UDP and IB port space ids (an IPoIB id would take the
/// broadcast group's from the SA, which RoCE does not have; it gets the same).
fn ud_qkey(ps: u16) -> u32 {
    match ps {
        port_space::UDP | port_space::IPOIB | port_space::IB => UDP_QKEY,
        _ => 0,
    }
}

/// The address vector of a multicast group, as `cma_iboe_join_multicast` and
/// `ib_init_ah_from_mcmember` make it for RoCEv2: the MGID (`cma_iboe_set_mgid`: the
/// IPv4-mapped form of an IPv4 group, an IPv6 group as it is), hop limit 64
/// (`IPV6_DEFAULT_HOPLIMIT`), traffic class, flow label, SL, DLID and rate 0, GID index 0
/// (the device's address, `rdma_ip2gid` of the id's source), port 1.
fn mcast_ah(group: IpAddr) -> verbs::AhAttr {
    verbs::AhAttr {
        grh: verbs::GlobalRoute {
            dgid: verbs::Gid::from_ip(group),
            flow_label: 0,
            sgid_index: 0,
            hop_limit: 64,
            traffic_class: 0,
        },
        is_global: true,
        port_num: 1,
        ..verbs::AhAttr::default()
    }
}
