//! The IB communication manager protocol (IBTA chapter 12) as rdma_cm uses it over
//! RoCEv2: REQ / MRA / REJ / REP / RTU / DREQ / DREP and SIDR_REQ / SIDR_REP MADs
//! exchanged between the QP1s of two devices, one state machine per connection.
//!
//! Sans-IO, like the transport: MADs come in through [`IbCm::handle_mad`], time through
//! `now` (nanoseconds) arguments and [`IbCm::handle_timeout`]; MADs leave through
//! [`IbCm::poll_transmit`] and what the consumer must hear through [`IbCm::poll_event`].
//!
//! The behaviour follows the Linux CM (`drivers/infiniband/core/cm.c`), which is what a
//! peer running rdma_cm on Linux expects:
//!
//! - A message that expects an answer (REQ, REP, DREQ, SIDR_REQ) is sent again after its
//!   response timeout, up to the connection's `max_cm_retries` times; when the retries
//!   run out the consumer gets the matching `*Error` event (REQ and REP: the connection
//!   is abandoned; DREQ: it enters timewait anyway).
//! - The response timeout of a REQ is twice the path's packet lifetime plus the remote
//!   CM response time; the passive side answers with the REQ's local CM response time.
//!   Times are IBTA exponents: 4.096 µs × 2^t, which the Linux CM rounds to
//!   2^(t-8) ms and so does this one.
//! - An MRA (message receipt acknowledgement) extends the wait for an answer by its
//!   service timeout. A consumer may "send" an MRA with the delay flag: nothing goes out
//!   until the peer retransmits, which then gets the MRA instead of silence.
//! - Duplicates: a retransmitted REQ gets the MRA again (if one was sent) and is
//!   otherwise ignored, even by a connection in timewait (the Linux CM answers it there
//!   with a REJ "stale connection", which would turn the peer's disconnect of that same
//!   connection into a reject; a REQ that only reuses the comm ID still gets it, and a
//!   REJ "stale connection" for a connection whose DREQ is out is ignored); a
//!   retransmitted REP gets the RTU again once established (so a lost RTU costs one REP
//!   timeout, never a stuck side); a retransmitted DREQ gets the DREP again, and a DREQ
//!   for a connection that no longer exists still gets a DREP (so a lost DREP never
//!   leaves the other side waiting out all its retries).
//! - A REQ for a service nobody listens on is rejected with reason 8 (invalid service
//!   ID); a REQ from a QP that already has a connection here is rejected "stale
//!   connection" and the old connection is disconnected.
//! - After a disconnect a connection waits in timewait for the path's ACK timeout before
//!   it reports [`EventKind::TimewaitExit`].
//!
//! Where it differs from the Linux CM, so that what anyone can send bounds what it costs:
//!
//! - A connection is found by its peer's address (the IP and QP its MADs come from,
//!   which the caller passes to [`IbCm::handle_mad`]) as well as by the IDs: a message
//!   from elsewhere matches nothing, whatever comm IDs, CA GUID or QPN it names. So a
//!   REJ, DREQ, DREP, MRA, REP or RTU from another address cannot end or move a
//!   connection (the comm IDs are no secret to an observer), and a REQ from another
//!   address that reuses a live connection's CA GUID and QPN is answered as one that
//!   matches nothing (REJ 8 when nobody listens): it disconnects nothing, and its answer
//!   does not tell a prober that the guess hit. (Answering it differently, or dropping
//!   it, would be that tell.) A DREQ from another address gets the DREP any DREQ for no
//!   connection gets. The peer itself keeps Linux's answers.
//! - What the peer asks is capped at what rdma_cm itself sends
//!   ([`MAX_PEER_CM_RESPONSE_TIMEOUT`], [`MAX_PEER_CM_RETRIES`],
//!   [`MAX_PEER_SERVICE_TIMEOUT`], [`MAX_PEER_ACK_TIMEOUT`]): a REP whose RTU never comes
//!   is given up after 16 × 4.1 s ≈ 65.5 s (≈ 18.6 min at most after an MRA), not after
//!   up to 16 × 2.3 h.
//! - At most [`MAX_HALF_OPEN`] passive connections ([`IbCm::set_max_half_open`]) wait for
//!   their consumer or their RTU; REQs and SIDR_REQs past that are dropped without an
//!   answer or state ([`Stats::refused`]), and the sender retries. Everything else a
//!   REQ leaves is the consumer's to end ([`IbCm::destroy`], [`IbCm::forget`]).
//! - Timers sit in a set ordered by deadline: a timer costs nothing to connections
//!   without one.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::net::IpAddr;

use softrdma_wire::cm::{
    self as wcm, rej_reason, CmMsg, Drep, Dreq, Ids, Mra, Rej, Rep, Req, Rtu, SidrRep, SidrReq,
    MAD_LEN,
};

/// A connection's local communication ID.
pub type CommId = u32;

/// How the peer's messages find a connection: the peer's address (where its MADs come
/// from), CA GUID and comm ID or QPN. The address is part of the key so that a message
/// from anywhere else matches nothing, whatever IDs it names.
type RemoteKey = (Peer, u64, u32);

/// A MAD as it travels.
pub type Mad = [u8; MAD_LEN];

/// The CM agent a MAD comes from or goes to: the device's IP address and its QP (the GSI,
/// QP 1, for every CM message rdma_cm sends).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Peer {
    /// IP address of the device.
    pub ip: IpAddr,
    /// QP number of its CM agent.
    pub qpn: u32,
}

impl Peer {
    /// The GSI (QP 1) at `ip`.
    pub fn gsi(ip: IpAddr) -> Peer {
        Peer {
            ip,
            qpn: wcm::GSI_QPN,
        }
    }
}

pub use softrdma_wire::cm::{msg_response, sidr_status};

/// The service timeout with this flag set asks [`IbCm::send_mra`] to hold the MRA until
/// the peer retransmits (as rdma_cm does for every REQ and REP it receives).
pub const MRA_FLAG_DELAY: u8 = 0x80;

/// Connection state (the Linux CM's `ib_cm_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// No exchange in progress.
    Idle,
    /// REQ sent, waiting for REP / REJ.
    ReqSent,
    /// REQ sent and MRAed by the peer.
    MraReqRcvd,
    /// REQ received, waiting for the consumer.
    ReqRcvd,
    /// REQ received and MRA sent (or held).
    MraReqSent,
    /// REP sent, waiting for RTU.
    RepSent,
    /// REP sent and MRAed by the peer.
    MraRepRcvd,
    /// REP received, waiting for the consumer to send RTU.
    RepRcvd,
    /// REP received and MRA sent (or held).
    MraRepSent,
    /// Connected.
    Established,
    /// DREQ sent, waiting for DREP.
    DreqSent,
    /// DREQ received, waiting for the consumer to send DREP.
    DreqRcvd,
    /// Disconnected, waiting before the QP may be reused.
    Timewait,
    /// SIDR_REQ sent, waiting for SIDR_REP.
    SidrReqSent,
    /// SIDR_REQ received, waiting for the consumer.
    SidrReqRcvd,
}

/// What happened to a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventKind {
    /// A REQ for a service we listen on created this connection (state `ReqRcvd`).
    ReqReceived {
        /// The REQ.
        req: Box<Req>,
        /// Where it came from.
        peer: Peer,
    },
    /// The passive side accepted (state `RepRcvd`).
    RepReceived(Box<Rep>),
    /// The active side completed the handshake (state `Established`).
    RtuReceived(Box<Rtu>),
    /// The consumer said the connection carries traffic before the RTU came
    /// ([`IbCm::establish`]): state `Established`.
    UserEstablished,
    /// The peer rejected; the connection is idle or in timewait.
    RejReceived(Box<Rej>),
    /// The peer asked to disconnect (state `DreqRcvd`).
    DreqReceived(Box<Dreq>),
    /// The peer confirmed the disconnect (state `Timewait`).
    DrepReceived(Box<Drep>),
    /// No answer to the REQ after every retry (state `Idle`).
    ReqError,
    /// No answer to the REP after every retry (state `Idle`).
    RepError,
    /// No answer to the DREQ after every retry (state `Timewait`).
    DreqError,
    /// Timewait is over (state `Idle`).
    TimewaitExit,
    /// A SIDR_REQ for a service we listen on created this exchange.
    SidrReqReceived {
        /// The request.
        req: Box<SidrReq>,
        /// Where it came from.
        peer: Peer,
    },
    /// The answer to our SIDR_REQ.
    SidrRepReceived(Box<SidrRep>),
    /// No answer to the SIDR_REQ after every retry.
    SidrReqError,
}

/// An event for the consumer of connection `id`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// The connection.
    pub id: CommId,
    /// What happened.
    pub kind: EventKind,
}

/// Why a call was refused: the state does not allow it, or no such connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CmError {
    /// No connection with that ID.
    NoSuchId,
    /// The connection's state does not allow this.
    BadState(State),
    /// A service with that ID is already listened on.
    Busy,
    /// `establish` on a connection that already is.
    AlreadyConnected,
}

impl std::fmt::Display for CmError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CmError::NoSuchId => write!(f, "no such CM connection"),
            CmError::BadState(s) => write!(f, "not allowed in CM state {s:?}"),
            CmError::Busy => write!(f, "service ID already listened on"),
            CmError::AlreadyConnected => write!(f, "connection already established"),
        }
    }
}

impl std::error::Error for CmError {}

/// Counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// MADs handed to [`IbCm::poll_transmit`] (retransmissions included).
    pub tx: u64,
    /// Of those, retransmissions.
    pub retransmits: u64,
    /// MADs received.
    pub rx: u64,
    /// Received duplicates (REQ, REP, RTU, DREQ, MRA, SIDR_REQ) that were answered or
    /// ignored as duplicates.
    pub duplicates: u64,
    /// Received MADs that matched no connection or state, or did not parse.
    pub dropped: u64,
    /// REQs and SIDR_REQs dropped without an answer because [`IbCm::max_half_open`]
    /// connections were already waiting for their consumer or their RTU.
    pub refused: u64,
}

/// Half-open connections (a REQ or SIDR_REQ taken, no RTU yet) a CM holds at most by
/// default ([`IbCm::set_max_half_open`]): like a SYN backlog, what bounds the memory a
/// flood of REQs for a listened service can take.
pub const MAX_HALF_OPEN: usize = 1024;

/// The largest CM response timeout exponent taken from a peer's REQ for our REP's
/// retransmissions: 2^(20-8) ms ≈ 4.1 s per try. The Linux CM takes the peer's value as
/// it comes (`cm_req_handler` in drivers/infiniband/core/cm.c: `timeout_ms =
/// cm_convert_to_ms(CM_REQ_LOCAL_CM_RESPONSE_TIMEOUT)`), bounded only by the 5-bit field
/// (31: 2^23 ms ≈ 2.3 h per try); what a Linux rdma_cm peer sends is `CMA_CM_RESPONSE_TIMEOUT`
/// (20, drivers/infiniband/core/cma.c), so that is the cap: a shorter wait only means an
/// earlier REP retransmission, which the peer answers like the first.
pub const MAX_PEER_CM_RESPONSE_TIMEOUT: u8 = 20;

/// The most retries taken from a peer's REQ: `CMA_MAX_CM_RETRIES` (15, cma.c), what
/// rdma_cm sends; the 4-bit field cannot say more. With
/// [`MAX_PEER_CM_RESPONSE_TIMEOUT`], a REP nobody answers is given up after 16 tries,
/// 16 × 4.096 s ≈ 65.5 s.
pub const MAX_PEER_CM_RETRIES: u8 = 15;

/// The largest MRA service timeout exponent a peer's MRA may stretch a wait by: 24
/// (2^16 ms ≈ 65.5 s), the one Linux's rdma_cm sends (`CMA_CM_MRA_SETTING`, cma.c); the
/// Linux CM takes any (`cm_mra_handler`: up to 2^23 ms). With an MRA a REP is given up
/// after at most 16 × (65.5 s + 4.1 s) ≈ 18.6 min.
pub const MAX_PEER_SERVICE_TIMEOUT: u8 = 24;

/// The largest path ACK timeout exponent a connection's timewait and MRA waits use:
/// 20 (4.1 s). The peer names it (the REQ's local ACK timeout, the REP's target ACK
/// delay) and Linux takes it up to 31 (2^23 ms); rdma_cm over RoCE sends 17-19.
pub const MAX_PEER_ACK_TIMEOUT: u8 = 20;

/// 4.096 µs × 2^`t`, as the Linux CM approximates it: 2^(t-8) ms (at least 1 ms).
pub fn iba_time_ms(t: u8) -> u64 {
    1u64 << u32::from(t.min(31)).saturating_sub(8)
}

/// The local ACK timeout exponent for a path: 4.096 µs × 2^t covers the CA's ACK delay
/// plus a round trip of packet lifetimes, rounded as the Linux CM rounds it.
pub fn ack_timeout(ca_ack_delay: u8, packet_life_time: u8) -> u8 {
    let mut t = packet_life_time.saturating_add(1);
    if t >= ca_ack_delay {
        t += u8::from(ca_ack_delay + 1 >= t);
    } else {
        t = ca_ack_delay + u8::from(t + 1 >= ca_ack_delay);
    }
    t.min(31)
}

const NS_PER_MS: u64 = 1_000_000;

/// A message waiting for its answer.
#[derive(Debug, Clone)]
struct Retx {
    mad: Mad,
    /// The state it was sent in: an answer or a state change makes it stale.
    sent_in: State,
    retries_left: u8,
    timeout_ms: u64,
    deadline: u64,
}

#[derive(Debug, Clone)]
struct Conn {
    state: State,
    local_id: CommId,
    /// The peer's communication ID, 0 until known.
    remote_id: CommId,
    peer: Peer,
    /// Transaction ID of the exchange (our REQ's, or the peer's REQ / DREQ).
    tid: u64,
    remote_ca_guid: u64,
    remote_qpn: u32,
    local_qpn: u32,
    /// Response timeout for what we send.
    timeout_ms: u64,
    max_retries: u8,
    /// The path's ACK timeout exponent (timewait lasts this long).
    av_timeout: u8,
    /// The service timeout of the MRA we sent (answered again to duplicates).
    service_timeout: u8,
    /// Private data of our last RTU / MRA / DREP, sent again to duplicates.
    private: Vec<u8>,
    retx: Option<Retx>,
    timewait_until: Option<u64>,
    /// Keys under which this connection is found by the peer's IDs.
    remote_key: Option<RemoteKey>,
    qp_key: Option<RemoteKey>,
    /// A SIDR_REQ we answer: its (peer, request ID).
    sidr_key: Option<(IpAddr, u32)>,
    service_id: u64,
    /// The REQ that made this (passive) connection: its TID, QPN and starting PSN. A
    /// late copy of it is this connection's own duplicate, not a stale connection.
    req_sig: Option<(u64, u32, u32)>,
    /// The deadline under which the connection sits in [`IbCm::timers`], if any.
    armed: Option<u64>,
}

impl Conn {
    fn new(local_id: CommId, peer: Peer) -> Conn {
        Conn {
            state: State::Idle,
            local_id,
            remote_id: 0,
            peer,
            tid: 0,
            remote_ca_guid: 0,
            remote_qpn: 0,
            local_qpn: 0,
            timeout_ms: 0,
            max_retries: 0,
            av_timeout: 0,
            service_timeout: 0,
            private: Vec::new(),
            retx: None,
            timewait_until: None,
            remote_key: None,
            qp_key: None,
            sidr_key: None,
            service_id: 0,
            req_sig: None,
            armed: None,
        }
    }
}

/// The CM of one device: its connections, listeners and what waits to be sent.
#[derive(Debug)]
pub struct IbCm {
    ca_guid: u64,
    ack_delay: u8,
    conns: HashMap<CommId, Conn>,
    next_id: u32,
    id_mask: u32,
    tid_hi: u64,
    listening: HashSet<u64>,
    /// (peer, peer CA GUID, peer comm ID) → our connection: finds duplicate REQs.
    remote_ids: HashMap<RemoteKey, CommId>,
    /// (peer, peer CA GUID, peer QPN) → our connection: finds stale connections.
    remote_qps: HashMap<RemoteKey, CommId>,
    /// Passive connections waiting for their consumer or their RTU.
    half_open: HashSet<CommId>,
    max_half_open: usize,
    /// (deadline, connection) of every pending retransmission and timewait, earliest
    /// first: the timers cost nothing for connections without one.
    timers: BTreeSet<(u64, CommId)>,
    /// SIDR_REQs being answered, by (peer IP, request ID).
    sidr_in: HashMap<(IpAddr, u32), CommId>,
    out: VecDeque<(Peer, Mad)>,
    events: VecDeque<Event>,
    stats: Stats,
}

/// Longest private data of each message (its field in the MAD).
pub use softrdma_wire::cm::private_len;

pub(crate) use softrdma_wire::cm::zero_padded;

/// A REJ of message `rejected` with `reason`, additional information `ari` (at most 72
/// bytes) and `private` data.
fn rej(
    local: CommId,
    remote: CommId,
    rejected: u8,
    reason: u16,
    ari: &[u8],
    private: &[u8],
) -> CmMsg {
    CmMsg::Rej(Box::new(Rej::new(
        local, remote, rejected, reason, ari, private,
    )))
}

impl IbCm {
    /// A CM for a device with node GUID `ca_guid` and local CA ACK delay exponent
    /// `ack_delay`; `seed` makes its communication IDs unpredictable.
    pub fn new(ca_guid: u64, ack_delay: u8, seed: impl Into<softrdma_wire::Seed>) -> IbCm {
        let mut rng = softrdma_wire::KeyRng::new(seed);
        let r = rng.next_u64();
        IbCm {
            ca_guid,
            ack_delay,
            conns: HashMap::new(),
            next_id: r as u32,
            id_mask: (r >> 32) as u32,
            tid_hi: rng.next_u64() & 0xFFFF_FFFF,
            listening: HashSet::new(),
            remote_ids: HashMap::new(),
            remote_qps: HashMap::new(),
            half_open: HashSet::new(),
            max_half_open: MAX_HALF_OPEN,
            timers: BTreeSet::new(),
            sidr_in: HashMap::new(),
            out: VecDeque::new(),
            events: VecDeque::new(),
            stats: Stats::default(),
        }
    }

    /// The device's node GUID, sent as the local CA GUID.
    pub fn ca_guid(&self) -> u64 {
        self.ca_guid
    }

    /// Counters.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// A connection's state.
    pub fn state(&self, id: CommId) -> Option<State> {
        self.conns.get(&id).map(|c| c.state)
    }

    /// A connection's peer.
    pub fn peer(&self, id: CommId) -> Option<Peer> {
        self.conns.get(&id).map(|c| c.peer)
    }

    /// The connections local QP `qpn` serves, from the REP until timewait (a QP number
    /// in timewait may already serve a new connection).
    pub fn conns_of_qp(&self, qpn: u32) -> Vec<CommId> {
        let mut v: Vec<CommId> = self
            .conns
            .values()
            .filter(|c| {
                c.local_qpn == qpn
                    && matches!(
                        c.state,
                        State::RepSent
                            | State::MraRepRcvd
                            | State::Established
                            | State::DreqSent
                            | State::DreqRcvd
                    )
            })
            .map(|c| c.local_id)
            .collect();
        v.sort_unstable();
        v
    }

    /// Number of connections (in any state, timewait included).
    pub fn len(&self) -> usize {
        self.conns.len()
    }

    /// Whether there are no connections.
    pub fn is_empty(&self) -> bool {
        self.conns.is_empty()
    }

    /// Passive connections waiting for their consumer (a REQ or SIDR_REQ not yet
    /// answered) or for their RTU (REP sent).
    pub fn half_open(&self) -> usize {
        self.half_open.len()
    }

    /// The most half-open connections held ([`MAX_HALF_OPEN`] unless set).
    pub fn max_half_open(&self) -> usize {
        self.max_half_open
    }

    /// Hold at most `n` half-open connections: further REQs and SIDR_REQs for a listened
    /// service are dropped without an answer or state until some complete or go, as
    /// Linux drops a REQ its rdma_cm has no room for (`cm_destroy_id` with `-ENOMEM`
    /// rejects nothing, "to allow future retries"): the sender retries, and a REJ would
    /// fail a genuine client at once during a flood.
    pub fn set_max_half_open(&mut self, n: usize) {
        self.max_half_open = n;
    }

    /// Connections with a pending timer (retransmission or timewait).
    pub fn timers(&self) -> usize {
        self.timers.len()
    }

    /// Put connection `id` in the timer set under its earliest deadline (or take it out),
    /// after its retransmission or timewait changed.
    fn rearm(&mut self, id: CommId) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        let next = [c.retx.as_ref().map(|r| r.deadline), c.timewait_until]
            .into_iter()
            .flatten()
            .min();
        if next == c.armed {
            return;
        }
        if let Some(old) = c.armed.take() {
            self.timers.remove(&(old, id));
        }
        if let Some(t) = next {
            c.armed = Some(t);
            self.timers.insert((t, id));
        }
    }

    /// Connection `id` is no longer half-open (established, gone, or ended).
    fn settle(&mut self, id: CommId) {
        self.half_open.remove(&id);
    }

    fn alloc_id(&mut self, peer: Peer) -> CommId {
        loop {
            self.next_id = self.next_id.wrapping_add(1);
            let id = self.next_id ^ self.id_mask;
            // 0 means "not known yet" on the wire.
            if id != 0 && !self.conns.contains_key(&id) {
                self.conns.insert(id, Conn::new(id, peer));
                return id;
            }
        }
    }

    fn form_tid(&self, id: CommId) -> u64 {
        self.tid_hi << 32 | u64::from(id)
    }

    fn conn(&mut self, id: CommId) -> Result<&mut Conn, CmError> {
        self.conns.get_mut(&id).ok_or(CmError::NoSuchId)
    }

    /// Receive REQs and SIDR_REQs for `service_id`.
    pub fn listen(&mut self, service_id: u64) -> Result<(), CmError> {
        if self.listening.insert(service_id) {
            Ok(())
        } else {
            Err(CmError::Busy)
        }
    }

    /// Stop receiving requests for `service_id` (later ones are rejected).
    pub fn unlisten(&mut self, service_id: u64) {
        self.listening.remove(&service_id);
    }

    fn emit(&mut self, to: Peer, msg: &CmMsg, tid: u64) -> Mad {
        let mad = msg.emit(tid);
        self.out.push_back((to, mad));
        self.stats.tx += 1;
        mad
    }

    fn event(&mut self, id: CommId, kind: EventKind) {
        self.events.push_back(Event { id, kind });
    }

    /// Send `msg` on connection `id`, expecting an answer: it is retransmitted until the
    /// state leaves `sent_in` or the retries run out.
    fn send_expecting(&mut self, now: u64, id: CommId, msg: &CmMsg, tid: u64, sent_in: State) {
        let Some(c) = self.conns.get(&id) else { return };
        let (peer, timeout_ms, retries) = (c.peer, c.timeout_ms, c.max_retries);
        let mad = self.emit(peer, msg, tid);
        if let Some(c) = self.conns.get_mut(&id) {
            c.retx = Some(Retx {
                mad,
                sent_in,
                retries_left: retries,
                timeout_ms,
                deadline: now.saturating_add(timeout_ms.saturating_mul(NS_PER_MS)),
            });
        }
        self.rearm(id);
    }

    /// Start a connection: send `req` to `peer`. The CM fills in the local communication
    /// ID, the CA GUID and the primary path's ACK timeout (from the CA's ACK delay and
    /// `packet_life_time`); the response timeout comes from `req.remote_cm_response_timeout`
    /// and the path's `packet_life_time` (exponents), the retries from
    /// `req.max_cm_retries`.
    pub fn send_req(&mut self, now: u64, peer: Peer, mut req: Req, packet_life_time: u8) -> CommId {
        let id = self.alloc_id(canonical(peer));
        req.local_comm_id = id;
        req.local_ca_guid = self.ca_guid;
        req.primary.local_ack_timeout = ack_timeout(self.ack_delay, packet_life_time);
        let tid = self.form_tid(id);
        let timeout_ms =
            2 * iba_time_ms(packet_life_time) + iba_time_ms(req.remote_cm_response_timeout);
        if let Some(c) = self.conns.get_mut(&id) {
            c.tid = tid;
            c.timeout_ms = timeout_ms;
            c.max_retries = req.max_cm_retries;
            c.av_timeout = packet_life_time.saturating_add(1).min(31);
            c.local_qpn = req.local_qpn;
            c.service_id = req.service_id;
            c.state = State::ReqSent;
        }
        self.send_expecting(now, id, &CmMsg::Req(Box::new(req)), tid, State::ReqSent);
        id
    }

    /// Accept a REQ: send `rep` (the CM fills in the communication IDs, the CA GUID and
    /// the target ACK delay).
    pub fn send_rep(&mut self, now: u64, id: CommId, mut rep: Rep) -> Result<(), CmError> {
        let (ca_guid, ack_delay) = (self.ca_guid, self.ack_delay);
        let c = self.conn(id)?;
        if !matches!(c.state, State::ReqRcvd | State::MraReqSent) {
            return Err(CmError::BadState(c.state));
        }
        rep.local_comm_id = c.local_id;
        rep.remote_comm_id = c.remote_id;
        rep.local_ca_guid = ca_guid;
        rep.target_ack_delay = ack_delay;
        c.local_qpn = rep.local_qpn;
        c.state = State::RepSent;
        let tid = c.tid;
        self.send_expecting(now, id, &CmMsg::Rep(Box::new(rep)), tid, State::RepSent);
        Ok(())
    }

    /// Complete the handshake on the active side: send the RTU (state `Established`).
    pub fn send_rtu(&mut self, _now: u64, id: CommId, private: &[u8]) -> Result<(), CmError> {
        let c = self.conn(id)?;
        if !matches!(c.state, State::RepRcvd | State::MraRepSent) {
            return Err(CmError::BadState(c.state));
        }
        c.state = State::Established;
        c.private = private.to_vec();
        let (peer, tid) = (c.peer, c.tid);
        let msg = CmMsg::Rtu(Box::new(Ids {
            local_comm_id: c.local_id,
            remote_comm_id: c.remote_id,
            private_data: zero_padded(private),
        }));
        self.emit(peer, &msg, tid);
        Ok(())
    }

    /// Tell the peer its REQ or REP will take a while to answer: `service_timeout` is the
    /// exponent of the extra wait; with [`MRA_FLAG_DELAY`] the MRA is only sent when the
    /// peer retransmits.
    pub fn send_mra(
        &mut self,
        _now: u64,
        id: CommId,
        service_timeout: u8,
        private: &[u8],
    ) -> Result<(), CmError> {
        let c = self.conn(id)?;
        let (next, mraed) = match c.state {
            State::ReqRcvd => (State::MraReqSent, msg_response::REQ),
            State::RepRcvd => (State::MraRepSent, msg_response::REP),
            s => return Err(CmError::BadState(s)),
        };
        c.state = next;
        c.service_timeout = service_timeout & 0x1F;
        c.private = private.to_vec();
        if service_timeout & MRA_FLAG_DELAY == 0 {
            let (peer, tid) = (c.peer, c.tid);
            let msg = mra_of(c, mraed);
            self.emit(peer, &msg, tid);
        }
        Ok(())
    }

    /// Refuse or abandon a connection: send a REJ with `reason`, additional information
    /// `ari` and `private` data. Allowed until the connection is established.
    pub fn send_rej(
        &mut self,
        now: u64,
        id: CommId,
        reason: u16,
        ari: &[u8],
        private: &[u8],
    ) -> Result<(), CmError> {
        let c = self.conn(id)?;
        let state = c.state;
        match state {
            State::ReqSent
            | State::MraReqRcvd
            | State::ReqRcvd
            | State::MraReqSent
            | State::RepRcvd
            | State::MraRepSent => self.reset_to_idle(id),
            State::RepSent | State::MraRepRcvd => self.enter_timewait(now, id),
            s => return Err(CmError::BadState(s)),
        }
        let Some(c) = self.conns.get(&id) else {
            return Ok(());
        };
        let (local, message_rejected) = match state {
            State::ReqRcvd => (0, msg_response::REQ),
            State::MraReqSent => (c.local_id, msg_response::REQ),
            State::RepRcvd | State::MraRepSent => (c.local_id, msg_response::REP),
            _ => (c.local_id, msg_response::OTHER),
        };
        let msg = rej(local, c.remote_id, message_rejected, reason, ari, private);
        let (peer, tid) = (c.peer, c.tid);
        self.emit(peer, &msg, tid);
        Ok(())
    }

    /// Disconnect an established connection: send a DREQ (state `DreqSent`).
    pub fn send_dreq(&mut self, now: u64, id: CommId, private: &[u8]) -> Result<(), CmError> {
        let tid = self.form_tid(id);
        let c = self.conn(id)?;
        if c.state != State::Established {
            return Err(CmError::BadState(c.state));
        }
        c.state = State::DreqSent;
        let msg = CmMsg::Dreq(Box::new(Dreq {
            ids: Ids {
                local_comm_id: c.local_id,
                remote_comm_id: c.remote_id,
                private_data: zero_padded(private),
            },
            remote_qpn: c.remote_qpn,
        }));
        self.send_expecting(now, id, &msg, tid, State::DreqSent);
        Ok(())
    }

    /// Answer a DREQ: send the DREP and enter timewait.
    pub fn send_drep(&mut self, now: u64, id: CommId, private: &[u8]) -> Result<(), CmError> {
        let c = self.conn(id)?;
        if c.state != State::DreqRcvd {
            return Err(CmError::BadState(c.state));
        }
        c.private = private.to_vec();
        let msg = drep_of(c);
        let (peer, tid) = (c.peer, c.tid);
        self.enter_timewait(now, id);
        self.emit(peer, &msg, tid);
        Ok(())
    }

    /// The consumer saw traffic on a connection whose RTU has not arrived (the QP's
    /// communication-established event): it is established now.
    pub fn establish(&mut self, id: CommId) -> Result<(), CmError> {
        let c = self.conn(id)?;
        match c.state {
            State::RepSent | State::MraRepRcvd => {
                c.state = State::Established;
                c.retx = None;
                self.rearm(id);
                self.settle(id);
                self.event(id, EventKind::UserEstablished);
                Ok(())
            }
            State::Established => Err(CmError::AlreadyConnected),
            s => Err(CmError::BadState(s)),
        }
    }

    /// Ask `peer` which QP serves `req.service_id` (UD). The CM fills in the request ID.
    pub fn send_sidr_req(
        &mut self,
        now: u64,
        peer: Peer,
        mut req: SidrReq,
        timeout_ms: u64,
        max_retries: u8,
    ) -> CommId {
        let id = self.alloc_id(canonical(peer));
        req.request_id = id;
        let tid = self.form_tid(id);
        if let Some(c) = self.conns.get_mut(&id) {
            c.tid = tid;
            c.timeout_ms = timeout_ms.max(1);
            c.max_retries = max_retries;
            c.service_id = req.service_id;
            c.state = State::SidrReqSent;
        }
        self.send_expecting(
            now,
            id,
            &CmMsg::SidrReq(Box::new(req)),
            tid,
            State::SidrReqSent,
        );
        id
    }

    /// Answer a SIDR_REQ with `rep` (the CM fills in the request and service IDs). The
    /// exchange is over: the connection is removed.
    pub fn send_sidr_rep(
        &mut self,
        _now: u64,
        id: CommId,
        mut rep: SidrRep,
    ) -> Result<(), CmError> {
        let c = self.conn(id)?;
        if c.state != State::SidrReqRcvd {
            return Err(CmError::BadState(c.state));
        }
        rep.request_id = c.remote_id;
        rep.service_id = c.service_id;
        let (peer, tid) = (c.peer, c.tid);
        self.emit(peer, &CmMsg::SidrRep(Box::new(rep)), tid);
        self.remove(id);
        Ok(())
    }

    /// Drop connection `id` as the Linux CM destroys an ID: whatever its state needs
    /// goes out first (a REJ while connecting, a DREQ when established, a DREP when
    /// asked to disconnect, a SIDR_REP "reject" to an unanswered SIDR_REQ), then it is
    /// forgotten; no more events for it.
    pub fn destroy(&mut self, now: u64, id: CommId) {
        let Some(c) = self.conns.get(&id) else { return };
        let guid = self.ca_guid.to_be_bytes();
        match c.state {
            State::SidrReqRcvd => {
                let _ = self.send_sidr_rep(now, id, SidrRep::new(sidr_status::REJECT, 0, 0, &[]));
            }
            State::ReqSent | State::MraReqRcvd => {
                let _ = self.send_rej(now, id, rej_reason::TIMEOUT, &guid, &[]);
            }
            State::ReqRcvd
            | State::MraReqSent
            | State::RepRcvd
            | State::MraRepSent
            | State::RepSent
            | State::MraRepRcvd => {
                let _ = self.send_rej(now, id, rej_reason::CONSUMER_REJECT, &[], &[]);
            }
            State::Established => {
                let _ = self.send_dreq(now, id, &[]);
            }
            State::DreqRcvd => {
                let _ = self.send_drep(now, id, &[]);
            }
            State::Idle | State::DreqSent | State::Timewait | State::SidrReqSent => {}
        }
        self.remove(id);
    }

    /// Drop connection `id` without a word to the peer (a request over a listener's
    /// backlog: the peer's retransmission may find room).
    pub fn forget(&mut self, id: CommId) {
        self.remove(id);
    }

    fn remove(&mut self, id: CommId) {
        if let Some(c) = self.conns.remove(&id) {
            self.unindex(&c);
            if let Some(t) = c.armed {
                self.timers.remove(&(t, id));
            }
        }
        self.settle(id);
        self.events.retain(|e| e.id != id);
    }

    fn unindex(&mut self, c: &Conn) {
        if let Some(k) = c.remote_key {
            if self.remote_ids.get(&k) == Some(&c.local_id) {
                self.remote_ids.remove(&k);
            }
        }
        if let Some(k) = c.qp_key {
            if self.remote_qps.get(&k) == Some(&c.local_id) {
                self.remote_qps.remove(&k);
            }
        }
        if let Some(k) = c.sidr_key {
            if self.sidr_in.get(&k) == Some(&c.local_id) {
                self.sidr_in.remove(&k);
            }
        }
    }

    fn reset_to_idle(&mut self, id: CommId) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        c.state = State::Idle;
        c.retx = None;
        let c = c.clone();
        self.unindex(&c);
        if let Some(c) = self.conns.get_mut(&id) {
            c.remote_key = None;
            c.qp_key = None;
        }
        self.rearm(id);
        self.settle(id);
    }

    fn enter_timewait(&mut self, now: u64, id: CommId) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        c.state = State::Timewait;
        c.retx = None;
        let wait = iba_time_ms(c.av_timeout.min(MAX_PEER_ACK_TIMEOUT));
        c.timewait_until = Some(now.saturating_add(wait * NS_PER_MS));
        self.rearm(id);
        self.settle(id);
    }

    /// Next MAD to send, and where.
    pub fn poll_transmit(&mut self) -> Option<(Peer, Mad)> {
        self.out.pop_front()
    }

    /// Next event for the consumer.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// Earliest retransmission or timewait deadline.
    pub fn poll_timeout(&self) -> Option<u64> {
        self.timers.first().map(|&(t, _)| t)
    }

    /// Fire the timers due at `now`: retransmit, give up (the `*Error` events), leave
    /// timewait.
    pub fn handle_timeout(&mut self, now: u64) {
        // Only the timers that are due: each is taken out and put back (by `rearm`) under
        // its next deadline, which is later than `now`, so the loop ends.
        while let Some(&(t, id)) = self.timers.first() {
            if t > now {
                break;
            }
            self.timers.remove(&(t, id));
            if let Some(c) = self.conns.get_mut(&id) {
                c.armed = None;
            }
            self.fire(now, id);
            self.rearm(id);
        }
    }

    /// The due timer of connection `id`.
    fn fire(&mut self, now: u64, id: CommId) {
        {
            let Some(c) = self.conns.get_mut(&id) else {
                return;
            };
            if c.timewait_until.is_some_and(|t| t <= now) {
                c.timewait_until = None;
                if c.state == State::Timewait {
                    c.state = State::Idle;
                    self.event(id, EventKind::TimewaitExit);
                }
                return;
            }
            let Some(r) = c.retx.as_mut() else { return };
            if r.deadline > now {
                return;
            }
            if r.sent_in != c.state {
                c.retx = None;
                return;
            }
            if r.retries_left > 0 {
                r.retries_left -= 1;
                r.deadline = now.saturating_add(r.timeout_ms.saturating_mul(NS_PER_MS).max(1));
                let (peer, mad) = (c.peer, r.mad);
                self.out.push_back((peer, mad));
                self.stats.tx += 1;
                self.stats.retransmits += 1;
                return;
            }
            c.retx = None;
            match c.state {
                State::ReqSent | State::MraReqRcvd => {
                    self.reset_to_idle(id);
                    self.event(id, EventKind::ReqError);
                }
                State::RepSent | State::MraRepRcvd => {
                    self.reset_to_idle(id);
                    self.event(id, EventKind::RepError);
                }
                State::DreqSent => {
                    self.enter_timewait(now, id);
                    self.event(id, EventKind::DreqError);
                }
                State::SidrReqSent => {
                    c.state = State::Idle;
                    self.event(id, EventKind::SidrReqError);
                }
                _ => {}
            }
        }
    }

    /// A MAD arrived from `from`. What does not parse, is not a CM message or matches no
    /// connection is counted and dropped.
    pub fn handle_mad(&mut self, now: u64, from: Peer, mad: &[u8]) {
        self.stats.rx += 1;
        let from = canonical(from);
        let Ok((hdr, msg)) = CmMsg::parse(mad) else {
            self.stats.dropped += 1;
            return;
        };
        let handled = match msg {
            CmMsg::Req(m) => self.on_req(now, from, hdr.tid, m),
            CmMsg::Mra(m) => self.on_mra(now, from, &m),
            CmMsg::Rej(m) => self.on_rej(now, from, m),
            CmMsg::Rep(m) => self.on_rep(now, from, m),
            CmMsg::Rtu(m) => self.on_rtu(from, m),
            CmMsg::Dreq(m) => self.on_dreq(from, hdr.tid, m),
            CmMsg::Drep(m) => self.on_drep(now, from, m),
            CmMsg::SidrReq(m) => self.on_sidr_req(from, hdr.tid, m),
            CmMsg::SidrRep(m) => self.on_sidr_rep(from, m),
        };
        if !handled {
            self.stats.dropped += 1;
        }
    }

    /// The connection `local` with peer `from` whose peer ID is `remote` (0: not known
    /// yet). A message from anyone but the connection's peer finds nothing: knowing (or
    /// having seen) the comm IDs is not enough to end someone else's connection.
    fn find(&self, from: Peer, local: CommId, remote: CommId) -> Option<CommId> {
        self.conns
            .get(&local)
            .filter(|c| c.remote_id == remote && c.peer == from)
            .map(|c| c.local_id)
    }

    /// A REJ for a message we never had a connection for.
    fn issue_rej(&mut self, to: Peer, tid: u64, remote_id: CommId, reason: u16, rejected: u8) {
        self.emit(to, &rej(0, remote_id, rejected, reason, &[], &[]), tid);
    }

    fn on_req(&mut self, now: u64, from: Peer, tid: u64, req: Box<Req>) -> bool {
        // Keyed by the sender's address too: a REQ from elsewhere that names a live
        // connection's CA GUID and comm ID or QPN matches nothing and is answered as any
        // other REQ is (REJ 8 when nobody listens), so it neither disturbs the connection
        // nor tells a prober that a guess hit.
        let key = (from, req.local_ca_guid, req.local_comm_id);
        if let Some(&id) = self.remote_ids.get(&key) {
            self.stats.duplicates += 1;
            let Some(c) = self.conns.get(&id) else {
                return true;
            };
            let (peer, ctid) = (c.peer, c.tid);
            match c.state {
                State::MraReqSent => {
                    let msg = mra_of(c, msg_response::REQ);
                    self.emit(peer, &msg, ctid);
                }
                // A copy of the REQ that made this very connection, overtaken by the
                // whole handshake and disconnect: the peer already has its answer. A
                // REJ "stale connection" would reach the peer's side of this same
                // connection (the REJ names both IDs) and turn its orderly disconnect
                // into a reject, so it is only counted. (The Linux CM answers every
                // duplicate in timewait with that REJ; softrdma keeps it for a REQ that
                // merely reuses the comm ID.)
                State::Timewait if c.req_sig == Some(req_sig(tid, &req)) => {}
                State::Timewait => {
                    let msg = rej(
                        c.local_id,
                        c.remote_id,
                        msg_response::OTHER,
                        rej_reason::STALE_CONN,
                        &[],
                        &[],
                    );
                    self.emit(peer, &msg, ctid);
                }
                _ => {}
            }
            return true;
        }
        let qp_key = (from, req.local_ca_guid, req.local_qpn);
        if let Some(&old) = self.remote_qps.get(&qp_key) {
            self.issue_rej(
                from,
                tid,
                req.local_comm_id,
                rej_reason::STALE_CONN,
                msg_response::REQ,
            );
            let _ = self.send_dreq(now, old, &[]);
            return true;
        }
        if !self.listening.contains(&req.service_id) {
            self.issue_rej(
                from,
                tid,
                req.local_comm_id,
                rej_reason::INVALID_SERVICE_ID,
                msg_response::REQ,
            );
            return true;
        }
        if self.half_open.len() >= self.max_half_open {
            self.stats.refused += 1;
            return true;
        }
        let id = self.alloc_id(from);
        self.half_open.insert(id);
        let ack = req.primary.local_ack_timeout;
        if let Some(c) = self.conns.get_mut(&id) {
            c.state = State::ReqRcvd;
            c.remote_id = req.local_comm_id;
            c.tid = tid;
            c.remote_ca_guid = req.local_ca_guid;
            c.remote_qpn = req.local_qpn;
            c.timeout_ms = iba_time_ms(
                req.local_cm_response_timeout
                    .min(MAX_PEER_CM_RESPONSE_TIMEOUT),
            );
            c.max_retries = req.max_cm_retries.min(MAX_PEER_CM_RETRIES);
            // The REQ's ACK timeout is the path's packet lifetime plus one.
            c.av_timeout = ack
                .saturating_sub(u8::from(ack > 0))
                .saturating_add(1)
                .min(31);
            c.service_id = req.service_id;
            c.remote_key = Some(key);
            c.qp_key = Some(qp_key);
            c.req_sig = Some(req_sig(tid, &req));
        }
        self.remote_ids.insert(key, id);
        self.remote_qps.insert(qp_key, id);
        self.event(id, EventKind::ReqReceived { req, peer: from });
        true
    }

    fn on_mra(&mut self, now: u64, from: Peer, m: &Mra) -> bool {
        let id = match m.message_mraed {
            msg_response::REQ => self.find(from, m.ids.remote_comm_id, 0),
            msg_response::REP | msg_response::OTHER => {
                self.find(from, m.ids.remote_comm_id, m.ids.local_comm_id)
            }
            _ => None,
        };
        let Some(c) = id.and_then(|id| self.conns.get_mut(&id)) else {
            return false;
        };
        let next = match (c.state, m.message_mraed) {
            (State::ReqSent, msg_response::REQ) => State::MraReqRcvd,
            (State::RepSent, msg_response::REP) => State::MraRepRcvd,
            (State::MraReqRcvd | State::MraRepRcvd, _) => {
                self.stats.duplicates += 1;
                return true;
            }
            _ => return false,
        };
        let timeout_ms = iba_time_ms(m.service_timeout.min(MAX_PEER_SERVICE_TIMEOUT))
            + iba_time_ms(c.av_timeout.min(MAX_PEER_ACK_TIMEOUT));
        c.state = next;
        if let Some(r) = c.retx.as_mut() {
            r.sent_in = next;
            r.timeout_ms = timeout_ms;
            r.deadline = now.saturating_add(timeout_ms * NS_PER_MS);
        }
        let id = c.local_id;
        self.rearm(id);
        true
    }

    fn on_rej(&mut self, now: u64, from: Peer, rej: Box<Rej>) -> bool {
        let remote = rej.local_comm_id;
        let id = if rej.reason == rej_reason::TIMEOUT {
            let guid = u64::from_be_bytes(zero_padded(&rej.ari[..8]));
            self.remote_ids.get(&(from, guid, remote)).copied()
        } else if rej.message_rejected == msg_response::REQ {
            self.find(from, rej.remote_comm_id, 0)
        } else {
            self.find(from, rej.remote_comm_id, remote)
        };
        let Some(id) = id else { return false };
        let Some(state) = self.state(id) else {
            return false;
        };
        match state {
            State::ReqSent
            | State::MraReqRcvd
            | State::RepSent
            | State::MraRepRcvd
            | State::ReqRcvd
            | State::MraReqSent => {
                if rej.reason == rej_reason::STALE_CONN {
                    self.enter_timewait(now, id);
                } else {
                    self.reset_to_idle(id);
                }
            }
            // A peer in timewait answers a late copy of our REQ with "stale connection"
            // (a Linux CM does, for every copy): that says the peer is done with this
            // connection, which the DREQ we are retransmitting asks anyway, and the DREP
            // it gets (from timewait, or for an unknown connection) ends the disconnect
            // as the consumer expects. Taking the REJ would report a reject instead.
            State::DreqSent if rej.reason == rej_reason::STALE_CONN => {
                self.stats.duplicates += 1;
                return true;
            }
            State::DreqSent | State::RepRcvd | State::MraRepSent | State::Established => {
                self.enter_timewait(now, id);
            }
            _ => return false,
        }
        self.event(id, EventKind::RejReceived(rej));
        true
    }

    fn on_rep(&mut self, now: u64, from: Peer, rep: Box<Rep>) -> bool {
        let Some(id) = self.find(from, rep.remote_comm_id, 0) else {
            return self.on_dup_rep(from, &rep);
        };
        let Some(c) = self.conns.get(&id) else {
            return false;
        };
        if !matches!(c.state, State::ReqSent | State::MraReqRcvd) {
            return false;
        }
        let key = (from, rep.local_ca_guid, rep.local_comm_id);
        if self.remote_ids.contains_key(&key) {
            return false;
        }
        let qp_key = (from, rep.local_ca_guid, rep.local_qpn);
        if let Some(&old) = self.remote_qps.get(&qp_key) {
            let tid = self.conns.get(&id).map_or(0, |c| c.tid);
            self.issue_rej(
                from,
                tid,
                rep.local_comm_id,
                rej_reason::STALE_CONN,
                msg_response::REP,
            );
            self.reset_to_idle(id);
            let _ = self.send_dreq(now, old, &[]);
            return true;
        }
        let ack_delay = rep.target_ack_delay;
        let Some(c) = self.conns.get_mut(&id) else {
            return false;
        };
        c.state = State::RepRcvd;
        c.remote_id = rep.local_comm_id;
        c.remote_ca_guid = rep.local_ca_guid;
        c.remote_qpn = rep.local_qpn;
        c.av_timeout = ack_timeout(ack_delay, c.av_timeout.saturating_sub(1));
        c.retx = None;
        c.remote_key = Some(key);
        c.qp_key = Some(qp_key);
        self.remote_ids.insert(key, id);
        self.remote_qps.insert(qp_key, id);
        self.rearm(id);
        self.event(id, EventKind::RepReceived(rep));
        true
    }

    fn on_dup_rep(&mut self, from: Peer, rep: &Rep) -> bool {
        let Some(id) = self.find(from, rep.remote_comm_id, rep.local_comm_id) else {
            return false;
        };
        self.stats.duplicates += 1;
        let Some(c) = self.conns.get(&id) else {
            return true;
        };
        let (peer, tid) = (c.peer, c.tid);
        let msg = match c.state {
            State::Established => CmMsg::Rtu(Box::new(Ids {
                local_comm_id: c.local_id,
                remote_comm_id: c.remote_id,
                private_data: zero_padded(&c.private),
            })),
            State::MraRepSent => mra_of(c, msg_response::REP),
            _ => return true,
        };
        self.emit(peer, &msg, tid);
        true
    }

    fn on_rtu(&mut self, from: Peer, rtu: Box<Rtu>) -> bool {
        let Some(id) = self.find(from, rtu.remote_comm_id, rtu.local_comm_id) else {
            return false;
        };
        let Some(c) = self.conns.get_mut(&id) else {
            return false;
        };
        if !matches!(c.state, State::RepSent | State::MraRepRcvd) {
            self.stats.duplicates += 1;
            return true;
        }
        c.state = State::Established;
        c.retx = None;
        self.rearm(id);
        self.settle(id);
        self.event(id, EventKind::RtuReceived(rtu));
        true
    }

    fn on_dreq(&mut self, from: Peer, tid: u64, dreq: Box<Dreq>) -> bool {
        let Some(id) = self.find(from, dreq.ids.remote_comm_id, dreq.ids.local_comm_id) else {
            // Gone already (or never known): answer anyway, so the peer stops asking. A
            // DREQ from anyone but the connection's peer gets the same answer (the DREP
            // echoes the IDs it named) and changes nothing.
            self.stats.duplicates += 1;
            self.emit(from, &CmMsg::Drep(Box::new(dreq.drep())), tid);
            return true;
        };
        let Some(c) = self.conns.get_mut(&id) else {
            return false;
        };
        if c.local_qpn != dreq.remote_qpn {
            return false;
        }
        match c.state {
            State::RepSent | State::DreqSent | State::Established | State::MraRepRcvd => {
                c.retx = None;
            }
            State::Timewait => {
                self.stats.duplicates += 1;
                let msg = drep_of(c);
                let (peer, ctid) = (c.peer, c.tid);
                self.emit(peer, &msg, ctid);
                return true;
            }
            State::DreqRcvd => {
                self.stats.duplicates += 1;
                return true;
            }
            _ => return false,
        }
        c.state = State::DreqRcvd;
        c.tid = tid;
        self.rearm(id);
        self.settle(id);
        self.event(id, EventKind::DreqReceived(dreq));
        true
    }

    fn on_drep(&mut self, now: u64, from: Peer, drep: Box<Drep>) -> bool {
        let Some(id) = self.find(from, drep.remote_comm_id, drep.local_comm_id) else {
            return false;
        };
        if !matches!(self.state(id), Some(State::DreqSent | State::DreqRcvd)) {
            return false;
        }
        self.enter_timewait(now, id);
        self.event(id, EventKind::DrepReceived(drep));
        true
    }

    fn on_sidr_req(&mut self, from: Peer, tid: u64, req: Box<SidrReq>) -> bool {
        let key = (from.ip, req.request_id);
        if self.sidr_in.contains_key(&key) {
            self.stats.duplicates += 1;
            return true;
        }
        if !self.listening.contains(&req.service_id) {
            let rep = SidrRep::unsupported(&req);
            self.emit(from, &CmMsg::SidrRep(Box::new(rep)), tid);
            return true;
        }
        if self.half_open.len() >= self.max_half_open {
            self.stats.refused += 1;
            return true;
        }
        let id = self.alloc_id(from);
        self.half_open.insert(id);
        if let Some(c) = self.conns.get_mut(&id) {
            c.state = State::SidrReqRcvd;
            c.remote_id = req.request_id;
            c.tid = tid;
            c.service_id = req.service_id;
            c.sidr_key = Some(key);
        }
        self.sidr_in.insert(key, id);
        self.event(id, EventKind::SidrReqReceived { req, peer: from });
        true
    }

    fn on_sidr_rep(&mut self, from: Peer, rep: Box<SidrRep>) -> bool {
        let Some(id) = self.find(from, rep.request_id, 0) else {
            return false;
        };
        let Some(c) = self.conns.get_mut(&id) else {
            return false;
        };
        if c.state != State::SidrReqSent {
            return false;
        }
        c.state = State::Idle;
        c.retx = None;
        self.rearm(id);
        self.event(id, EventKind::SidrRepReceived(rep));
        true
    }
}

/// `p` with its address in canonical form (an IPv4-mapped IPv6 address as IPv4), so
/// that a peer is one key however its address was written.
fn canonical(p: Peer) -> Peer {
    Peer {
        ip: p.ip.to_canonical(),
        qpn: p.qpn,
    }
}

/// What tells a REQ from another one with the same comm ID: a retransmission or a
/// duplicate carries the same TID, QPN and starting PSN.
fn req_sig(tid: u64, req: &Req) -> (u64, u32, u32) {
    (tid, req.local_qpn, req.starting_psn)
}

fn mra_of(c: &Conn, mraed: u8) -> CmMsg {
    CmMsg::Mra(Box::new(Mra {
        ids: Ids {
            local_comm_id: c.local_id,
            remote_comm_id: c.remote_id,
            private_data: zero_padded(&c.private),
        },
        message_mraed: mraed,
        service_timeout: c.service_timeout,
    }))
}

fn drep_of(c: &Conn) -> CmMsg {
    CmMsg::Drep(Box::new(Ids {
        local_comm_id: c.local_id,
        remote_comm_id: c.remote_id,
        private_data: zero_padded(&c.private),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use softrdma_testkit::cm;
    use std::net::Ipv4Addr;

    const SID: u64 = 0x0106_0000_0000_1b58;

    fn gsi(x: u8) -> Peer {
        Peer::gsi(IpAddr::V4(Ipv4Addr::new(127, 0, 0, x)))
    }

    /// The one MAD `cm` has to send.
    fn one(cm: &mut IbCm) -> Mad {
        let (_, mad) = cm.poll_transmit().expect("a MAD to send");
        assert!(cm.poll_transmit().is_none(), "more than one MAD to send");
        mad
    }

    fn parse(mad: &Mad) -> (u64, CmMsg) {
        let (hdr, msg) = CmMsg::parse(mad).unwrap();
        (hdr.tid, msg)
    }

    /// Active `a` (127.0.0.3, QP 0x111) and passive `b` (127.0.0.7, QP 0x222) established
    /// on a perfect link; also the REQ as it went out, for a late copy of it.
    fn established() -> (IbCm, CommId, IbCm, CommId, Mad) {
        let (pa, pb) = (gsi(3), gsi(7));
        let mut a = IbCm::new(0xA, 15, 1);
        let mut b = IbCm::new(0xB, 15, 2);
        b.listen(SID).unwrap();
        let ca = a.send_req(0, pb, cm::req(SID, 0x111, 100), 14);
        let req_mad = one(&mut a);
        b.handle_mad(1_000, pa, &req_mad);
        let Some(Event {
            id: cb,
            kind: EventKind::ReqReceived { .. },
        }) = b.poll_event()
        else {
            panic!("no REQ event")
        };
        b.send_rep(2_000, cb, cm::rep(0x222, 200)).unwrap();
        a.handle_mad(3_000, pb, &one(&mut b));
        assert!(matches!(
            a.poll_event().map(|e| e.kind),
            Some(EventKind::RepReceived(_))
        ));
        a.send_rtu(4_000, ca, &[]).unwrap();
        b.handle_mad(5_000, pa, &one(&mut a));
        assert!(matches!(
            b.poll_event().map(|e| e.kind),
            Some(EventKind::RtuReceived(_))
        ));
        (a, ca, b, cb, req_mad)
    }

    /// `a` disconnects and `b` answers; returns the DREP, not yet delivered.
    fn a_disconnects(a: &mut IbCm, ca: CommId, b: &mut IbCm, cb: CommId) -> Mad {
        a.send_dreq(6_000, ca, &[]).unwrap();
        b.handle_mad(7_000, gsi(3), &one(a));
        assert!(matches!(
            b.poll_event().map(|e| e.kind),
            Some(EventKind::DreqReceived(_))
        ));
        b.send_drep(8_000, cb, &[]).unwrap();
        assert_eq!(b.state(cb), Some(State::Timewait));
        one(b)
    }

    #[test]
    fn a_late_copy_of_the_req_does_not_reject_its_own_connection() {
        // REQ (a copy held back) → REP → RTU → DREQ → DREP (held back) → the REQ copy at
        // the passive side in timewait → the DREP at the active side.
        let (mut a, ca, mut b, cb, req_mad) = established();
        let drep = a_disconnects(&mut a, ca, &mut b, cb);
        let dups = b.stats().duplicates;
        b.handle_mad(9_000, gsi(3), &req_mad);
        assert!(b.poll_transmit().is_none(), "no REJ for the copy");
        assert_eq!(b.stats().duplicates, dups + 1);
        assert_eq!(b.state(cb), Some(State::Timewait));
        a.handle_mad(10_000, gsi(7), &drep);
        assert!(matches!(
            a.poll_event().map(|e| e.kind),
            Some(EventKind::DrepReceived(_))
        ));
        assert_eq!(a.state(ca), Some(State::Timewait));
        assert!(a.poll_event().is_none());
    }

    #[test]
    fn a_stale_reject_from_a_peer_in_timewait_does_not_end_our_disconnect() {
        // A peer whose CM answers every REQ copy in timewait with REJ "stale connection"
        // (as Linux's does): the REJ names both IDs and reaches our DreqSent side first.
        let (mut a, ca, mut b, cb, req_mad) = established();
        let drep = a_disconnects(&mut a, ca, &mut b, cb);
        let (tid, _) = parse(&req_mad);
        a.handle_mad(9_000, gsi(7), &stale_for(cb, ca, tid));
        assert!(a.poll_event().is_none(), "the REJ is not reported");
        assert_eq!(a.state(ca), Some(State::DreqSent));
        assert!(
            a.poll_timeout().is_some(),
            "the DREQ is still retransmitted"
        );
        a.handle_mad(10_000, gsi(7), &drep);
        assert!(matches!(
            a.poll_event().map(|e| e.kind),
            Some(EventKind::DrepReceived(_))
        ));
        // Established, the same REJ still ends the connection: the peer gave up on it.
        let (mut a, ca, _b, cb, _) = established();
        a.handle_mad(9_000, gsi(7), &stale_for(cb, ca, tid));
        let e = a.poll_event().map(|e| e.kind);
        assert!(
            matches!(&e, Some(EventKind::RejReceived(r)) if r.reason == rej_reason::STALE_CONN),
            "{e:?}"
        );
        assert_eq!(a.state(ca), Some(State::Timewait));
    }

    /// The REJ a Linux CM in timewait sends for a copy of the REQ of connection `to`.
    fn stale_for(from: CommId, to: CommId, tid: u64) -> Mad {
        rej(
            from,
            to,
            msg_response::OTHER,
            rej_reason::STALE_CONN,
            &[],
            &[],
        )
        .emit(tid)
    }

    #[test]
    fn a_req_reusing_the_comm_id_of_a_connection_in_timewait_is_stale() {
        let (mut a, ca, mut b, cb, req_mad) = established();
        a_disconnects(&mut a, ca, &mut b, cb);
        // Same CA GUID and comm ID, but another QP and PSN: not a copy of the REQ.
        let (tid, msg) = parse(&req_mad);
        let CmMsg::Req(mut other) = msg else { panic!() };
        other.local_qpn = 0x333;
        other.starting_psn = 300;
        b.handle_mad(9_000, gsi(3), &CmMsg::Req(other).emit(tid));
        let (_, msg) = parse(&one(&mut b));
        let CmMsg::Rej(r) = msg else {
            panic!("{msg:?}")
        };
        assert_eq!(r.reason, rej_reason::STALE_CONN);
        assert_eq!((r.local_comm_id, r.remote_comm_id), (cb, ca));
        assert!(b.poll_event().is_none());
    }

    #[test]
    fn a_new_req_from_a_qp_still_connected_is_stale_and_disconnects_the_old() {
        let (mut a, _ca, mut b, cb, _) = established();
        // The same QP asks again under a new comm ID: the old connection is stale.
        let ca2 = a.send_req(10_000, gsi(7), cm::req(SID, 0x111, 101), 14);
        b.handle_mad(11_000, gsi(3), &one(&mut a));
        let (_, first) = parse(&b.poll_transmit().unwrap().1);
        let (_, second) = parse(&b.poll_transmit().unwrap().1);
        let CmMsg::Rej(r) = first else {
            panic!("{first:?}")
        };
        assert_eq!(r.reason, rej_reason::STALE_CONN);
        assert_eq!(r.message_rejected, msg_response::REQ);
        assert_eq!(r.remote_comm_id, ca2);
        assert!(matches!(second, CmMsg::Dreq(_)), "{second:?}");
        assert_eq!(b.state(cb), Some(State::DreqSent));
        assert!(b.poll_event().is_none(), "no REQ event for the stale one");
        a.handle_mad(12_000, gsi(7), &CmMsg::Rej(r).emit(0));
        let e = a.poll_event().unwrap();
        assert_eq!(e.id, ca2);
        assert!(
            matches!(&e.kind, EventKind::RejReceived(r) if r.reason == rej_reason::STALE_CONN),
            "{e:?}"
        );
    }

    #[test]
    fn iba_times_round_like_linux() {
        assert_eq!(iba_time_ms(0), 1);
        assert_eq!(iba_time_ms(8), 1);
        assert_eq!(iba_time_ms(9), 2);
        assert_eq!(iba_time_ms(20), 4096);
        assert_eq!(iba_time_ms(24), 65536);
        // The larger of the ACK delay and lifetime + 1, one more when the other is close.
        assert_eq!(ack_timeout(15, 16), 17);
        assert_eq!(ack_timeout(16, 16), 18);
        assert_eq!(ack_timeout(20, 10), 20);
        assert_eq!(ack_timeout(12, 10), 13);
        assert_eq!(ack_timeout(0, 31), 31);
    }
}
