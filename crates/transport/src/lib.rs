//! softrdma transport layer: the RC / UC / UD protocol engine (requester, responder,
//! completer), sans-IO: datagrams and time come in as arguments, datagrams go out
//! through [`Rnic::poll_transmit`]. QP1, the GSI, is served by the engine itself: the
//! connection manager's MADs come out of [`Rnic::take_gsi`] and go in through
//! [`Rnic::send_gsi`].

#![warn(missing_docs)]

/// A packet a QP's protocol handler will not act on: raise `$env.stats.$counter` and say
/// why in one "packet dropped" event (at `$level`) with the QP, the packet's PSN and
/// opcode, the counter's name and any `extra` fields. The counter and its name are one
/// token, so the event always names the counter that moved.
macro_rules! dropped {
    ($level:ident, $env:expr, $qp:expr, $h:expr, $counter:ident, $reason:expr $(; $($extra:tt)+)?) => {{
        $env.stats.$counter += 1;
        tracing::$level!(
            qpn = format_args!("{:#x}", $qp.qpn),
            psn = $h.bth.psn,
            opcode = %$h.bth.opcode,
            $($($extra)+,)?
            counter = stringify!($counter),
            reason = $reason,
            "packet dropped"
        )
    }};
}

mod cc;
pub use cc::DEFAULT_RX_BUFFER;
mod completer;
mod completion;
mod gsi;
mod keepalive;
mod liveness;
mod objects;
mod qp;
mod recovery;
mod requester;
mod responder;
mod rtt;
mod sack;
#[cfg(test)]
mod tests;
mod timers;

use std::collections::{BTreeMap, VecDeque};
use std::net::{IpAddr, SocketAddr};

use qp::{QpCtx, ReqState, RespState, SendWqe, UdTarget};
use softrdma_wire::{self as wire, Addrs, Headers};
use verbs::{QpState, QpType, SendFlags, WcStatus};

pub use gsi::{GsiMad, GSI_INBOX_MAX};
pub use keepalive::{Keepalive, KeepalivePolicy};
pub use softrdma_verbs as verbs;

/// Counters (for `softrdma stats`).
#[derive(Debug, Clone, Default)]
pub struct Stats {
    /// Datagrams produced.
    pub tx_packets: u64,
    /// Bytes of UDP payload produced.
    pub tx_bytes: u64,
    /// Datagrams received (before any check).
    pub rx_packets: u64,
    /// Bytes of UDP payload received.
    pub rx_bytes: u64,
    /// Request packets sent again (timeout, sequence NAK, RNR).
    pub retransmits: u64,
    /// Local ACK timeouts that fired.
    pub timeouts: u64,
    /// Retransmission timer (from the measured round trip) expiries: a lost tail resent
    /// before the local ACK timeout, without spending a retry.
    pub rtt_timeouts: u64,
    /// PSN sequence error NAKs sent.
    pub naks_sent_seq: u64,
    /// Invalid request NAKs sent.
    pub naks_sent_inv: u64,
    /// Remote access error NAKs sent.
    pub naks_sent_access: u64,
    /// Remote operational error NAKs sent.
    pub naks_sent_op: u64,
    /// PSN sequence error NAKs received.
    pub naks_rcvd_seq: u64,
    /// Invalid request NAKs received.
    pub naks_rcvd_inv: u64,
    /// Remote access error NAKs received.
    pub naks_rcvd_access: u64,
    /// Remote operational error NAKs received.
    pub naks_rcvd_op: u64,
    /// RNR NAKs sent.
    pub rnr_naks_sent: u64,
    /// RNR NAKs received.
    pub rnr_naks_rcvd: u64,
    /// Datagrams dropped for a bad ICRC.
    pub icrc_errors: u64,
    /// Datagrams dropped as unparseable.
    pub malformed: u64,
    /// Duplicate requests seen by the responder.
    pub duplicates: u64,
    /// Datagrams dropped: wrong peer, unknown QP, bad state.
    pub dropped: u64,
    /// Duplicate READ requests re-executed (the responses sent again).
    pub read_replays: u64,
    /// Duplicate READ requests refused, or re-executions cut short: past the responses a
    /// READ's duplicates may cost (`READ_REPLAY_FACTOR`), which bounds what a READ can be
    /// made to reflect, or too many parts of one READ waiting to be sent again.
    pub read_replays_refused: u64,
    /// Requests ahead of the expected PSN.
    pub out_of_sequence: u64,
    /// Of those, RC requests held until the gap before them filled (`qp::Held`).
    pub held: u64,
    /// SACKs sent: a responder told a softrdma requester which packets past a gap it
    /// holds (softrdma's extension message, `softrdma_wire::ext`).
    pub sacks_sent: u64,
    /// SACKs received and acted on.
    pub sacks_rcvd: u64,
    /// Packets resent because a SACK showed them missing.
    pub sack_resends: u64,
    /// Datagrams to QP1 (the GSI) dropped: not a MAD as the GSI takes them (opcode,
    /// Q_Key, length, P_Key), or the inbox was full.
    pub gsi_dropped: u64,
    /// MADs to QP1 while no connection manager ran: requests answered as a CM with
    /// nothing open answers them (REJ "invalid service ID", SIDR_REP "unsupported",
    /// DREP), the rest dropped.
    pub gsi_unserved: u64,
    /// Keepalive probes sent on idle RC connections ([`Keepalive`]).
    pub keepalive_probes: u64,
    /// Acknowledgements of keepalive probes received.
    pub keepalive_acks: u64,
    /// RC connections whose peer left keepalive probes unanswered: failed, their peers
    /// taken for dead.
    pub peers_lost: u64,
}

/// What a datagram is, for a runtime deciding when to send it (it may hold plain ACKs
/// back to leave with the next datagram, but not requests or responses).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransmitKind {
    /// A request: SEND, WRITE, READ request, atomic.
    Request,
    /// A READ or atomic response.
    Response,
    /// A positive acknowledgement (RC ACKNOWLEDGE with an ACK syndrome).
    Ack,
    /// A NAK or RNR NAK.
    Nak,
}

impl TransmitKind {
    fn of(h: &Headers) -> TransmitKind {
        let is_request = h.bth.opcode.info().is_some_and(|i| i.is_request);
        match (is_request, h.aeth) {
            (true, _) => TransmitKind::Request,
            (false, Some(a)) if h.bth.opcode == wire::Opcode::RC_ACKNOWLEDGE => match a.syndrome {
                wire::Syndrome::Ack { .. } => TransmitKind::Ack,
                _ => TransmitKind::Nak,
            },
            (false, _) => TransmitKind::Response,
        }
    }
}

/// A datagram to send: UDP payload (BTH..ICRC, ICRC already sealed) and addressing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transmit {
    /// Our address (source IP and UDP source port).
    pub src: SocketAddr,
    /// Destination IP and UDP port.
    pub dst: SocketAddr,
    /// IP TOS / traffic class byte.
    pub tos: u8,
    /// What it is.
    pub kind: TransmitKind,
    /// The UDP payload.
    pub data: Vec<u8>,
}

impl Transmit {
    /// Send it from `src` instead (another UDP source port, say): the ICRC covers the UDP
    /// header, so it is sealed again for the new address.
    pub fn resend_from(&mut self, src: SocketAddr) {
        wire::icrc::seal(&Addrs::new(src, self.dst), &mut self.data);
        self.src = src;
    }

    /// Re-seal the ICRC, sealed for IPv4 ID 0, for the IPv4 ID `ip_id` the kernel will give
    /// this datagram (segment `ip_id` of a UDP GSO message); `cache` keeps the per-length
    /// work.
    pub fn reseal_for_ip_id(&mut self, ip_id: u16, cache: &mut wire::icrc::IpIdCache) {
        cache.get(self.data.len()).reseal(&mut self.data, 0, ip_id);
    }
}

/// Packets up to this size are built in "small" buffers, larger ones in "large" buffers,
/// so that recycling an ACK buffer never shrinks a buffer that will carry data again.
const SMALL_PKT: usize = 256;
/// Free buffers kept per size class (at most; the rest are freed).
const POOL_MAX: usize = 4096;

/// The NIC-wide state every protocol handler works with besides its QP: split from the QP
/// table so a handler can hold `&mut QpCtx` and `&mut Nic` at once.
pub(crate) struct Nic {
    pub addr: SocketAddr,
    /// The device's address of the other IP version, if it has one (GID index 1).
    pub alt: Option<IpAddr>,
    pub ctx: verbs::Context,
    pub out: VecDeque<Transmit>,
    pub stats: Stats,
    /// QPs with a coalesced ACK waiting (sent when the outbox runs dry).
    pub ack_queue: VecDeque<verbs::Qpn>,
    /// QPs whose requester stopped at a full outbox, in the order they stopped.
    pub tx_wait: VecDeque<verbs::Qpn>,
    /// QPs whose responder has READ responses (and what waits behind them) to send once
    /// the outbox drains, in the order they stopped.
    pub resp_wait: VecDeque<verbs::Qpn>,
    /// Which of requesters and responders continues first at the next refill
    /// (alternating, so neither starves the other).
    pub resp_first: bool,
    /// Free packet buffers up to [`SMALL_PKT`] bytes of capacity.
    pub pool_small: Vec<Vec<u8>>,
    /// Free packet buffers of more capacity.
    pub pool_large: Vec<Vec<u8>>,
    /// Per-length work of the unknown-IP-ID ICRC check (packets sealed for ID k > 0:
    /// rxe's numbered packets, segments of a GSO send).
    pub ip_ids: wire::icrc::IpIdCache,
    /// Which of those IDs to believe from each sender (a corrupted packet matches some
    /// ID with probability about 2^-16).
    pub ip_id_guard: wire::icrc::IpIdGuard,
    /// QP1: MADs received for the layer above, and the send PSN.
    pub gsi: gsi::Gsi,
    /// Bytes of request packets all QPs' responders hold past a gap (see `qp::Held`).
    pub held_bytes: usize,
    /// Bytes of receive buffer the device's socket has (see [`Rnic::set_rx_buffer`]).
    pub rx_buffer: usize,
    /// Liveness checks of idle RC connections (see [`Rnic::set_keepalive`]).
    pub keepalive: KeepalivePolicy,
}

impl Nic {
    /// The local address a packet to `dst` leaves from: the device's address of `dst`'s
    /// IP version.
    pub fn src_ip(&self, dst: IpAddr) -> IpAddr {
        match self.alt {
            Some(a) if a.is_ipv4() == dst.to_canonical().is_ipv4() => a,
            _ => self.addr.ip(),
        }
    }

    /// Build, seal and queue one packet from QP `src_qpn` to `dst`. Emission only fails
    /// on an internal inconsistency; such a packet is counted as dropped, never sent.
    pub fn send(&mut self, src_qpn: u32, dst: SocketAddr, tos: u8, h: &Headers, payload: &[u8]) {
        let _ = self.send_with(src_qpn, dst, tos, h, payload.len(), |_, b| {
            b.copy_from_slice(payload);
            Ok::<(), ()>(())
        });
    }

    /// Build, seal and queue one packet with `plen` bytes of payload that `fill` writes
    /// straight into the packet buffer (given the verbs context, to read registered memory).
    /// An error from `fill` sends nothing and is returned; an emission failure (internal
    /// inconsistency) is counted as dropped.
    pub fn send_with<E>(
        &mut self,
        src_qpn: u32,
        dst: SocketAddr,
        tos: u8,
        h: &Headers,
        plen: usize,
        fill: impl FnOnce(&verbs::Context, &mut [u8]) -> Result<(), E>,
    ) -> Result<(), E> {
        let total = h.packet_len(plen);
        let mut data = self.take_buf(total);
        let at = match h.emit_header(plen, &mut data) {
            Ok(n) => n,
            Err(_) => {
                tracing::warn!(
                    qpn = format_args!("{src_qpn:#x}"),
                    opcode = %h.bth.opcode,
                    psn = h.bth.psn,
                    counter = "dropped",
                    "packet not sent: headers do not fit their opcode (internal error)"
                );
                self.stats.dropped += 1;
                self.recycle(data);
                return Ok(());
            }
        };
        if let Err(e) = fill(&self.ctx, &mut data[at..at + plen]) {
            self.recycle(data);
            return Err(e);
        }
        data[at + plen..].fill(0); // pad and ICRC
        self.seal_and_queue(src_qpn, dst, tos, TransmitKind::of(h), data);
        Ok(())
    }

    /// Seal a built packet for QP `src_qpn`'s source port and `dst`, count it and queue it.
    fn seal_and_queue(
        &mut self,
        src_qpn: u32,
        dst: SocketAddr,
        tos: u8,
        kind: TransmitKind,
        mut data: Vec<u8>,
    ) {
        let src = SocketAddr::new(self.src_ip(dst.ip()), wire::udp_src_port(src_qpn));
        wire::icrc::seal(&Addrs::new(src, dst), &mut data);
        self.stats.tx_packets += 1;
        self.stats.tx_bytes += data.len() as u64;
        self.out.push_back(Transmit {
            src,
            dst,
            tos,
            kind,
            data,
        });
    }

    /// Build, seal and queue one of softrdma's extension messages ([`wire::ext`]) from QP
    /// `src_qpn` to `dst`. They leave promptly, as a NAK does.
    pub fn send_ext(&mut self, src_qpn: u32, dst: SocketAddr, tos: u8, m: &wire::ext::Ext) {
        let mut data = self.take_buf(m.len());
        if m.emit(&mut data).is_err() {
            // The buffer is exactly the message's length: emission cannot fail.
            self.stats.dropped += 1;
            self.recycle(data);
            return;
        }
        self.seal_and_queue(src_qpn, dst, tos, TransmitKind::Nak, data);
    }

    /// A buffer of exactly `len` bytes (contents unspecified), from the pool when it can.
    fn take_buf(&mut self, len: usize) -> Vec<u8> {
        let (pool, cap) = if len <= SMALL_PKT {
            (&mut self.pool_small, SMALL_PKT)
        } else {
            (&mut self.pool_large, len)
        };
        let mut b = pool.pop().unwrap_or_else(|| Vec::with_capacity(cap));
        // Recycled buffers keep their length, so this writes only past the old length.
        b.resize(len, 0);
        b
    }

    /// Keep a buffer for reuse.
    pub fn recycle(&mut self, b: Vec<u8>) {
        let pool = match b.capacity() {
            0 => return,
            c if c <= SMALL_PKT => &mut self.pool_small,
            _ => &mut self.pool_large,
        };
        if pool.len() < POOL_MAX {
            pool.push(b);
        }
    }

    /// Queue a completion. A CQ overflow is the verbs layer's business (CQ error event).
    pub fn complete(
        &mut self,
        cq: verbs::CqId,
        wc: verbs::WorkCompletion,
        solicited: bool,
        now: u64,
    ) {
        let _ = self.ctx.push_completion(cq, wc, solicited, now);
    }
}

/// One RDMA device's engine: verbs objects plus RC/UC/UD protocol state. Sans-IO.
///
/// Deliberate difference from Linux rxe: `retry_cnt` 7 is a count of 7 retries, not
/// "retry forever", so a dead peer always ends in `RETRY_EXC_ERR`. `rnr_retry` 7 is
/// infinite, as the IBTA says.
pub struct Rnic {
    env: Nic,
    qps: BTreeMap<verbs::Qpn, QpCtx>,
    /// The QPs' timer deadlines, kept in step with `qps` by [`Rnic::sync_timer`] after
    /// every call that may change them.
    timers: timers::Timers,
    /// The QPs' keepalive deadlines ([`keepalive`]), kept apart so that [`Rnic::in_flight`]
    /// still tells a device whether requests are in flight.
    ka_timers: timers::Timers,
    /// Bumped whenever a multicast group gains its first QP or loses its last one.
    mcast_generation: u64,
}

impl Rnic {
    /// Device bound to `addr` (its IP gives GID index 0 as the IPv4-mapped GID; the port is
    /// normally 4791). `seed` feeds key and PSN randomness.
    pub fn new(addr: SocketAddr, seed: impl Into<wire::Seed>) -> Rnic {
        Rnic::with_alt(addr, None, seed)
    }
    /// An engine whose device also has `alt`, an address of the other IP version (the
    /// IPv6 address of the interface beside its IPv4 one, say): GID index 1. Packets to
    /// an address of `alt`'s version leave from `alt`, as the kernel picks the source of
    /// a route; an `alt` of the same version as `addr` is ignored.
    pub fn with_alt(addr: SocketAddr, alt: Option<IpAddr>, seed: impl Into<wire::Seed>) -> Rnic {
        let alt = alt
            .map(|a| a.to_canonical())
            .filter(|a| a.is_ipv4() != addr.ip().to_canonical().is_ipv4());
        let mut gids = vec![verbs::Gid::from_ip(addr.ip())];
        gids.extend(alt.map(verbs::Gid::from_ip));
        let ctx = verbs::Context::new(gids, seed);
        Rnic {
            env: Nic {
                addr,
                alt,
                ctx,
                out: VecDeque::new(),
                stats: Stats::default(),
                ack_queue: VecDeque::new(),
                tx_wait: VecDeque::new(),
                resp_wait: VecDeque::new(),
                resp_first: false,
                pool_small: Vec::new(),
                pool_large: Vec::new(),
                ip_ids: wire::icrc::IpIdCache::default(),
                ip_id_guard: wire::icrc::IpIdGuard::default(),
                gsi: gsi::Gsi::default(),
                held_bytes: 0,
                rx_buffer: cc::DEFAULT_RX_BUFFER,
                keepalive: KeepalivePolicy::OFF,
            },
            qps: BTreeMap::new(),
            timers: timers::Timers::default(),
            ka_timers: timers::Timers::default(),
            mcast_generation: 0,
        }
    }
    /// Our address.
    pub fn addr(&self) -> SocketAddr {
        self.env.addr
    }
    /// The device's socket has `bytes` of receive buffer (as `SO_RCVBUF` reports it).
    /// An RC requester's window grows to no more than that holds at its path MTU (see
    /// `cc::ceiling_for`); QPs connected later take it. The engine assumes
    /// [`DEFAULT_RX_BUFFER`] until told.
    pub fn set_rx_buffer(&mut self, bytes: usize) {
        self.env.rx_buffer = bytes;
    }
    /// How idle RC connections check that their peer is alive ([`Keepalive`]): QPs take
    /// the policy's setting for their peer (same host: a loopback address or one of
    /// this device's; else remote) when they enter RTS. The engine starts with
    /// [`KeepalivePolicy::OFF`].
    pub fn set_keepalive(&mut self, policy: KeepalivePolicy) {
        self.env.keepalive = policy;
    }
    /// Our address of the other IP version, if the device has one (GID index 1).
    pub fn alt_addr(&self) -> Option<SocketAddr> {
        self.env
            .alt
            .map(|ip| SocketAddr::new(ip, self.env.addr.port()))
    }
    /// Create a QP (in RESET).
    pub fn create_qp(&mut self, init: verbs::QpInitAttr) -> verbs::Result<verbs::Qpn> {
        let qpn = self.env.ctx.create_qp(init)?;
        let Some(q) = self.env.ctx.qp(qpn) else {
            return Err(verbs::Error::inval("QP vanished after creation"));
        };
        let ctx = QpCtx {
            qpn,
            qp_type: q.init.qp_type,
            state: q.state,
            attr: q.attr,
            pd: q.init.pd,
            send_cq: q.init.send_cq,
            recv_cq: q.init.recv_cq,
            has_srq: q.init.srq.is_some(),
            sq_sig_all: q.init.sq_sig_all,
            max_send_wr: q.init.cap.max_send_wr,
            peer: None,
            peer_port: None,
            sq: VecDeque::new(),
            req: ReqState::default(),
            resp: RespState::default(),
            ka: keepalive::KaState::default(),
        };
        self.qps.insert(qpn, ctx);
        Ok(qpn)
    }

    /// Destroy a QP. Queued WRs vanish without completions, as `ibv_destroy_qp` does.
    pub fn destroy_qp(&mut self, qpn: verbs::Qpn) -> verbs::Result<()> {
        self.env.ctx.destroy_qp(qpn)?;
        if let Some(mut qp) = self.qps.remove(&qpn) {
            qp.resp.held.clear(&mut self.env.held_bytes);
        }
        self.timers.set(qpn, None);
        self.ka_timers.set(qpn, None);
        Ok(())
    }

    /// Current attributes of a QP (state, and `sq_draining` while SQD still has WRs in flight).
    pub fn query_qp(&self, qpn: verbs::Qpn) -> verbs::Result<verbs::QpAttr> {
        let q = self
            .env
            .ctx
            .qp(qpn)
            .ok_or(verbs::Error::new(verbs::Errno::ENOENT, "no such QP"))?;
        let mut attr = q.attr;
        attr.qp_state = q.state;
        attr.cur_qp_state = q.state;
        if let Some(t) = self.qps.get(&qpn) {
            attr.sq_draining = t.state == QpState::Sqd && t.sq.iter().any(|w| w.started && !w.done);
        }
        Ok(attr)
    }

    /// verbs modify plus protocol side effects (RTR: expected PSN, RTS: send PSN, ERR: flush
    /// everything, RESET: clear).
    pub fn modify_qp(
        &mut self,
        now: u64,
        qpn: verbs::Qpn,
        attr: &verbs::QpAttr,
        mask: verbs::QpAttrMask,
    ) -> verbs::Result<()> {
        let r = self.modify_qp_inner(now, qpn, attr, mask);
        self.sync_timer(qpn);
        r
    }

    fn modify_qp_inner(
        &mut self,
        now: u64,
        qpn: verbs::Qpn,
        attr: &verbs::QpAttr,
        mask: verbs::QpAttrMask,
    ) -> verbs::Result<()> {
        use verbs::QpAttrMask as M;
        let (old, new) = self.env.ctx.modify_qp(qpn, attr, mask)?;
        tracing::debug!(
            qpn = format_args!("{qpn:#x}"),
            ?old,
            ?new,
            ?mask,
            "modify_qp"
        );
        let Some(qp) = self.qps.get_mut(&qpn) else {
            return Ok(());
        };
        if let Some(q) = self.env.ctx.qp(qpn) {
            qp.attr = q.attr;
        }
        qp.state = new;
        let peer = match qp.qp_type {
            QpType::Ud => None,
            _ => Some(SocketAddr::new(
                qp.attr.ah_attr.grh.dgid.to_ip(),
                self.env.addr.port(),
            )),
        };
        // A new connection (or a new peer) has its source port to learn again.
        if peer != qp.peer || new == QpState::Reset || (old == QpState::Init && new == QpState::Rtr)
        {
            qp.peer_port = None;
        }
        qp.peer = peer;
        if new == QpState::Reset {
            liveness::disarm(qp);
            qp.sq.clear();
            qp.req = ReqState::default();
            qp.resp.held.clear(&mut self.env.held_bytes);
            qp.resp = RespState::default();
            return Ok(());
        }
        if new == QpState::Err {
            if old != QpState::Err {
                completion::flush(qp, &mut self.env, now);
            }
            return Ok(());
        }
        if mask.contains(M::RQ_PSN) {
            qp.resp.epsn = qp.attr.rq_psn & wire::psn::MASK;
            qp.resp.nak_sent = false;
            qp.resp.held.clear(&mut self.env.held_bytes);
        }
        if mask.contains(M::SQ_PSN) && !qp.sq.iter().any(|w| w.started) {
            qp.req.next_psn = qp.attr.sq_psn & wire::psn::MASK;
            qp.req.high_psn = qp.req.next_psn;
            qp.req.rec.start_at(qp.req.next_psn);
        }
        if mask.contains(M::PATH_MTU) {
            qp.req.cc.on_path(qp.mtu(), self.env.rx_buffer);
        }
        if mask.contains(M::RETRY_CNT) || (new == QpState::Rts && old == QpState::Rtr) {
            qp.req.retry_left = qp.attr.retry_cnt;
        }
        if mask.contains(M::RNR_RETRY) || (new == QpState::Rts && old == QpState::Rtr) {
            qp.req.rnr_left = qp.attr.rnr_retry;
        }
        if new == QpState::Sqd && old != QpState::Sqd {
            qp.req.sqd_notified = false;
            completion::check_drained(qp, &mut self.env);
        }
        if new == QpState::Rts && old == QpState::Rtr {
            let local = qp.peer.is_some_and(|p| {
                let ip = p.ip().to_canonical();
                ip.is_loopback()
                    || same_ip(ip, self.env.addr.ip())
                    || self.env.alt.is_some_and(|a| same_ip(a, ip))
            });
            let policy = self.env.keepalive;
            let cfg = if local { policy.local } else { policy.remote };
            liveness::arm(qp, cfg, now);
        }
        if new == QpState::Rts {
            requester::run(qp, &mut self.env, now);
        }
        Ok(())
    }

    /// Validate (`verbs::Context::check_send_wr`), ENOMEM when the SQ holds `max_send_wr`
    /// WRs, take the INLINE payload now, queue, and run the requester (which may produce
    /// packets at once). In ERR the WR is accepted and flushed with `WR_FLUSH_ERR` (more SGEs
    /// than `max_send_sge` is EINVAL in every state).
    ///
    /// INLINE: the payload is `wr.inline_data` when given (the bytes were copied by the
    /// face), else it is gathered at once from registered memory through the SGEs' lkeys
    /// (EFAULT when an SGE is not inside a region of the QP's PD). The engine reads no
    /// other memory.
    pub fn post_send(&mut self, now: u64, qpn: verbs::Qpn, wr: verbs::SendWr) -> verbs::Result<()> {
        let r = self.post_send_inner(now, qpn, wr);
        self.sync_timer(qpn);
        r
    }

    fn post_send_inner(
        &mut self,
        now: u64,
        qpn: verbs::Qpn,
        mut wr: verbs::SendWr,
    ) -> verbs::Result<()> {
        let Some(qp) = self.qps.get_mut(&qpn) else {
            return Err(verbs::Error::new(verbs::Errno::ENOENT, "no such QP"));
        };
        if wr.inline_data.is_some() {
            wr.flags |= SendFlags::INLINE;
        }
        // In ERR this checks only what is EINVAL in every state (too many SGEs).
        self.env.ctx.check_send_wr(qpn, &wr)?;
        if qp.state == QpState::Err {
            let wc = verbs::WorkCompletion {
                wr_id: wr.wr_id,
                status: WcStatus::WrFlushErr,
                opcode: wr.op.wc_opcode(),
                qp_num: qpn,
                ..Default::default()
            };
            self.env.complete(qp.send_cq, wc, false, now);
            return Ok(());
        }
        if qp.sq.len() >= qp.max_send_wr as usize {
            return Err(verbs::Error::new(verbs::Errno::ENOMEM, "send queue full")
                .with_kind(verbs::ErrorKind::QueueFull));
        }
        let len: u64 = wr.sg_list.iter().map(|s| u64::from(s.length)).sum();
        if len > u64::from(u32::MAX >> 1) {
            return Err(verbs::Error::inval("message longer than 2^31 bytes"));
        }
        let len = len as usize;
        let inline = match wr.inline_data.take() {
            Some(data) if data.len() != len => {
                return Err(verbs::Error::inval(
                    "inline data length differs from its SGE lengths",
                ))
            }
            Some(data) => Some(data),
            None if wr.flags.contains(SendFlags::INLINE) => {
                Some(gather_inline(&self.env.ctx, qp.pd, &wr.sg_list, len)?)
            }
            None => None,
        };
        let ud = if qp.qp_type == QpType::Ud {
            let Some(d) = wr.ud else {
                return Err(verbs::Error::inval("UD send without a destination"));
            };
            let (_, ah) = self.env.ctx.ah(d.ah)?;
            let mtu = self
                .env
                .ctx
                .port_attr(1)
                .map(|p| p.active_mtu.bytes())
                .unwrap_or(1024);
            if len > mtu {
                return Err(verbs::Error::inval("UD message larger than the path MTU"));
            }
            let qkey = if d.remote_qkey & 0x8000_0000 != 0 {
                qp.attr.qkey
            } else {
                d.remote_qkey
            };
            Some(UdTarget {
                dst: SocketAddr::new(ah.grh.dgid.to_ip(), self.env.addr.port()),
                tos: ah.grh.traffic_class,
                qpn: d.remote_qpn & wire::psn::MASK,
                qkey,
            })
        } else {
            None
        };
        qp.sq.push_back(SendWqe::new(wr, inline, len, ud));
        requester::run(qp, &mut self.env, now);
        Ok(())
    }

    /// Post a receive WR (flushed at once in ERR).
    pub fn post_recv(&mut self, now: u64, qpn: verbs::Qpn, wr: verbs::RecvWr) -> verbs::Result<()> {
        self.env.ctx.post_recv(qpn, wr)?;
        if let Some(qp) = self.qps.get_mut(&qpn) {
            if qp.state == QpState::Err {
                completion::flush_rq(qp, &mut self.env, now);
            }
        }
        self.sync_timer(qpn);
        Ok(())
    }

    /// Post a receive WR to an SRQ.
    pub fn post_srq_recv(
        &mut self,
        _now: u64,
        srq: verbs::SrqId,
        wr: verbs::RecvWr,
    ) -> verbs::Result<()> {
        self.env.ctx.post_srq_recv(srq, wr)
    }

    /// A UDP datagram arrived from `src` to `dst` (our address), with IP TOS 0: see
    /// [`Rnic::handle_datagram_tos`].
    pub fn handle_datagram(&mut self, now: u64, src: SocketAddr, dst: SocketAddr, data: &[u8]) {
        self.handle_datagram_tos(now, src, dst, 0, data)
    }

    /// A UDP datagram arrived from `src` to `dst` (our address) with IP TOS / traffic
    /// class `tos` (which a UD receive reports in the GRH it places before the payload).
    /// Checks the ICRC for any IPv4 ID (bad: counted, dropped), parses (malformed:
    /// counted, dropped) and dispatches to the responder (requests) or the completer
    /// (responses) of the destination QP, or to the GSI inbox ([`Rnic::take_gsi`]) when
    /// the destination is QP1.
    pub fn handle_datagram_tos(
        &mut self,
        now: u64,
        src: SocketAddr,
        dst: SocketAddr,
        tos: u8,
        data: &[u8],
    ) {
        let env = &mut self.env;
        env.stats.rx_packets += 1;
        env.stats.rx_bytes += data.len() as u64;
        if data.len() < wire::BTH_LEN + wire::ICRC_LEN {
            tracing::debug!(
                peer = %src,
                len = data.len(),
                counter = "malformed",
                reason = "shorter than a BTH and an ICRC",
                "packet dropped"
            );
            env.stats.malformed += 1;
            return;
        }
        let addrs = Addrs::new(src, dst);
        // The ICRC covers the IPv4 ID, which a UDP socket does not report. softrdma sends
        // ID 0 (the fast path) and numbers GSO segments from 0; Linux rxe numbers its
        // packets. Some ID makes the ICRC of a corrupted packet right with probability
        // about 2^-16, so the ID must also be one this sender plausibly used.
        let solved = wire::icrc::verify_unknown_ip_id_with(&mut env.ip_ids, &addrs, data);
        let believed = match (solved, src.ip().to_canonical()) {
            (Some(id), IpAddr::V4(ip)) => env.ip_id_guard.admit(now, ip, id),
            (solved, _) => solved.is_some(),
        };
        if !believed {
            // The header fields may be the corrupted ones: they are what the packet claims.
            // (The length was checked above, so the view always exists.)
            let claims = wire::BthView::new_checked(data).ok();
            tracing::debug!(
                peer = %src,
                len = data.len(),
                qpn = format_args!("{:#x}", claims.map_or(0, |b| b.dest_qp())),
                psn = claims.map_or(0, |b| b.psn()),
                opcode = %claims.map_or(wire::Opcode(0), |b| b.opcode()),
                ip_id = ?solved,
                counter = "icrc_errors",
                reason = if solved.is_some() {
                    "ICRC right only for an IPv4 ID off the sender's count"
                } else {
                    "bad ICRC"
                },
                "packet dropped"
            );
            env.stats.icrc_errors += 1;
            return;
        }
        if wire::ext::is_vendor(wire::Opcode(data[0])) {
            self.receive_ext(now, src, data);
            return;
        }
        let (h, payload) = match Headers::parse(data) {
            Ok(parsed) => parsed,
            Err(e) => return unparsed(env, src, data, e),
        };
        let Some(info) = h.bth.opcode.info() else {
            tracing::debug!(
                peer = %src,
                opcode = %h.bth.opcode,
                counter = "malformed",
                reason = "unknown opcode",
                "packet dropped"
            );
            env.stats.malformed += 1;
            return;
        };
        // QP1 is no verbs QP: its MADs go to the GSI inbox.
        if h.bth.dest_qp == wire::cm::GSI_QPN {
            gsi::receive(env, src, tos, &h, payload);
            return;
        }
        if !default_partition(h.bth.pkey) {
            tracing::debug!(
                peer = %src,
                qpn = format_args!("{:#x}", h.bth.dest_qp),
                psn = h.bth.psn,
                opcode = %h.bth.opcode,
                pkey = format_args!("{:#06x}", h.bth.pkey),
                counter = "dropped",
                reason = "P_Key not in the default partition",
                "packet dropped"
            );
            env.stats.dropped += 1;
            return;
        }
        if h.bth.dest_qp == wire::MULTICAST_QPN {
            self.receive_multicast(now, &addrs, tos, &h, payload, data.len(), info);
            return;
        }
        let Some(qp) = self.qps.get_mut(&h.bth.dest_qp) else {
            tracing::debug!(
                peer = %src,
                qpn = format_args!("{:#x}", h.bth.dest_qp),
                psn = h.bth.psn,
                opcode = %h.bth.opcode,
                counter = "dropped",
                reason = "unknown QP",
                "packet dropped"
            );
            env.stats.dropped += 1;
            return;
        };
        if !admit(qp, env, info, &h, src) {
            return;
        }
        liveness::heard(qp, now);
        if info.is_request {
            responder::handle_request(qp, env, now, &addrs, tos, &h, payload, data.len());
        } else {
            completer::handle_response(qp, env, now, src.port(), &h, payload);
        }
        self.sync_timer(h.bth.dest_qp);
    }

    /// One of softrdma's extension messages ([`wire::ext`]) with a good ICRC: taken only
    /// by an RC QP, in a state that speaks to its peer, from the connected peer's IP and
    /// the UDP port that peer was learnt to send from (counted and dropped otherwise).
    fn receive_ext(&mut self, now: u64, src: SocketAddr, data: &[u8]) {
        use wire::ext::Ext;
        let env = &mut self.env;
        let m = match Ext::parse(data) {
            Ok(m) => m,
            Err(e) => return unparsed(env, src, data, e),
        };
        let (Ext::SackPermit(bth) | Ext::Sack(bth, _)) = m;
        let qp = self.qps.get_mut(&bth.dest_qp);
        let ok = qp.as_ref().is_some_and(|qp| {
            let state_ok = match m {
                Ext::SackPermit(_) => matches!(
                    qp.state,
                    QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe
                ),
                Ext::Sack(..) => matches!(qp.state, QpState::Rts | QpState::Sqd),
            };
            qp.qp_type == QpType::Rc
                && state_ok
                && default_partition(bth.pkey)
                && qp.peer.is_some_and(|p| same_ip(p.ip(), src.ip()))
                && qp.peer_port == Some(src.port())
        });
        let Some(qp) = qp.filter(|_| ok) else {
            tracing::debug!(
                peer = %src,
                qpn = format_args!("{:#x}", bth.dest_qp),
                psn = bth.psn,
                opcode = %bth.opcode,
                counter = "dropped",
                reason = "no RC QP here takes it from that address and port",
                "packet dropped"
            );
            env.stats.dropped += 1;
            return;
        };
        liveness::heard(qp, now);
        match m {
            Ext::SackPermit(_) => sack::on_permit(qp, env),
            Ext::Sack(b, bits) => {
                sack::on_sack(qp, env, now, b.psn, bits);
                // Packets the SACK shows held are in flight no more: the window they
                // leave is used now, not at the next acknowledgement or post.
                requester::run(qp, env, now);
            }
        }
        self.sync_timer(bth.dest_qp);
    }

    /// A datagram to the multicast QPN: a copy for every QP attached to the group its
    /// destination IP names (rxe's `rxe_rcv_mcast_pkt`), each QP checked as for a unicast
    /// datagram (service, state, then Q_Key in the responder) and given its own receive
    /// WQE. Dropped when the destination is not a multicast address or no QP of this
    /// device is attached to the group.
    #[allow(clippy::too_many_arguments)]
    fn receive_multicast(
        &mut self,
        now: u64,
        addrs: &Addrs,
        tos: u8,
        h: &Headers,
        payload: &[u8],
        udp_len: usize,
        info: &wire::OpcodeInfo,
    ) {
        let env = &mut self.env;
        let mgid = verbs::Gid::from_ip(addrs.dst.ip());
        let reason = if !mgid.is_multicast() {
            Some("multicast QPN to a unicast address")
        } else if env.ctx.mcast_members(&mgid).is_empty() {
            Some("no QP attached to the multicast group")
        } else {
            None
        };
        if let Some(reason) = reason {
            tracing::debug!(
                peer = %addrs.src,
                group = %addrs.dst.ip(),
                psn = h.bth.psn,
                opcode = %h.bth.opcode,
                counter = "dropped",
                reason,
                "packet dropped"
            );
            env.stats.dropped += 1;
            return;
        }
        // Indexing rather than iterating: the responder needs the context mutably, and
        // nothing it does changes the group's members.
        for i in 0..self.env.ctx.mcast_members(&mgid).len() {
            let Some(&qpn) = self.env.ctx.mcast_members(&mgid).get(i) else {
                break;
            };
            let Some(qp) = self.qps.get_mut(&qpn) else {
                continue;
            };
            if admit(qp, &mut self.env, info, h, addrs.src) && info.is_request {
                responder::handle_request(qp, &mut self.env, now, addrs, tos, h, payload, udp_len);
            }
            self.sync_timer(qpn);
        }
    }

    /// Next datagram to put on the wire. Coalesced ACKs go out once the outbox is empty,
    /// so a burst of requests handled before polling gets one ACK.
    #[inline]
    pub fn poll_transmit(&mut self, now: u64) -> Option<Transmit> {
        if let Some(t) = self.env.out.pop_front() {
            return Some(t);
        }
        if self.env.tx_wait.is_empty()
            && self.env.ack_queue.is_empty()
            && self.env.resp_wait.is_empty()
        {
            return None;
        }
        self.poll_transmit_refill(now)
    }

    /// The outbox is empty: let stopped requesters and responders continue (taking turns
    /// at going first), then send coalesced ACKs.
    fn poll_transmit_refill(&mut self, now: u64) -> Option<Transmit> {
        self.env.resp_first = !self.env.resp_first;
        if self.env.resp_first {
            self.refill_responders(now);
            self.refill_requesters(now);
        } else {
            self.refill_requesters(now);
            self.refill_responders(now);
        }
        if let Some(t) = self.env.out.pop_front() {
            return Some(t);
        }
        let mut budget = self.env.ack_queue.len();
        while budget > 0 {
            budget -= 1;
            let Some(qpn) = self.env.ack_queue.pop_front() else {
                break;
            };
            if let Some(qp) = self.qps.get_mut(&qpn) {
                responder::flush_ack(qp, &mut self.env);
                self.sync_timer(qpn);
                if let Some(t) = self.env.out.pop_front() {
                    return Some(t);
                }
            }
        }
        None
    }

    /// Requesters that stopped at a full outbox continue, in the order they stopped.
    fn refill_requesters(&mut self, now: u64) {
        let mut budget = self.env.tx_wait.len();
        while budget > 0 && self.env.out.len() < qp::OUTBOX_MAX {
            budget -= 1;
            let Some(qpn) = self.env.tx_wait.pop_front() else {
                break;
            };
            if let Some(qp) = self.qps.get_mut(&qpn) {
                qp.req.tx_wait = false;
                requester::run(qp, &mut self.env, now);
                self.sync_timer(qpn);
            }
        }
    }

    /// Responders with READ responses left continue, in the order they stopped.
    fn refill_responders(&mut self, now: u64) {
        let mut budget = self.env.resp_wait.len();
        while budget > 0 && self.env.out.len() < qp::OUTBOX_MAX {
            budget -= 1;
            let Some(qpn) = self.env.resp_wait.pop_front() else {
                break;
            };
            if let Some(qp) = self.qps.get_mut(&qpn) {
                qp.resp.tx_wait = false;
                responder::send_waiting_responses(qp, &mut self.env, now);
                self.sync_timer(qpn);
            }
        }
    }

    /// Datagrams queued for [`Rnic::poll_transmit`] right now. Producers stop at a bound
    /// (a few hundred) and continue as the outbox drains, so this stays small whatever a
    /// peer asks for (a 1 GiB READ, say); one response per received packet may go past it.
    pub fn queued_packets(&self) -> usize {
        self.env.out.len()
    }

    /// Give a datagram buffer (for example a sent [`Transmit::data`]) back to the engine,
    /// which builds later packets in it instead of allocating.
    pub fn recycle(&mut self, buf: Vec<u8>) {
        self.env.recycle(buf);
    }

    /// Earliest timer deadline (retransmission, RNR wait, keepalive), if any. O(log QPs): the device
    /// asks after every step.
    pub fn poll_timeout(&self) -> Option<u64> {
        let first = self.timers.first();
        let ka = self.ka_timers.first();
        // The indexes must agree with a scan of every QP: debug builds (every test of the
        // engine and the device) check them on every call.
        #[cfg(debug_assertions)]
        {
            assert_eq!(
                first,
                self.qps.values().filter_map(timers::deadline).min(),
                "timer index out of step with the QPs"
            );
            assert_eq!(
                ka,
                self.qps.values().filter_map(|q| q.ka.deadline).min(),
                "keepalive index out of step with the QPs"
            );
        }
        [first, ka].into_iter().flatten().min()
    }

    /// Whether a QP has requests in flight or waits out an RNR NAK (a retransmission
    /// timer is armed): a device holds the datagrams of new posts back to leave together
    /// then. Keepalive timers, which idle connections have, do not count.
    pub fn in_flight(&self) -> bool {
        self.timers.first().is_some()
    }

    /// Fire the timers due at `now`: an RNR wait ends (resend), a local ACK timeout fires
    /// (go back to the oldest unacknowledged packet, or RETRY_EXC_ERR when out of retries).
    /// Only QPs with a due deadline are visited, in QP number order.
    pub fn handle_timeout(&mut self, now: u64) {
        let mut due = self.timers.due(now);
        due.extend(self.ka_timers.due(now));
        due.sort_unstable();
        due.dedup();
        for qpn in due {
            if let Some(qp) = self.qps.get_mut(&qpn) {
                completer::on_timers(qp, &mut self.env, now);
            }
            self.sync_timer(qpn);
        }
    }

    /// Re-read QP `qpn`'s timer deadlines into the index (after anything that may have
    /// armed, moved or cleared them).
    fn sync_timer(&mut self, qpn: verbs::Qpn) {
        let qp = self.qps.get(&qpn);
        self.timers.set(qpn, qp.and_then(timers::deadline));
        self.ka_timers.set(qpn, qp.and_then(|q| q.ka.deadline));
    }

    /// Poll completions.
    pub fn poll_cq(
        &mut self,
        cq: verbs::CqId,
        out: &mut [verbs::WorkCompletion],
    ) -> verbs::Result<usize> {
        self.env.ctx.poll_cq(cq, out)
    }

    /// Counters.
    pub fn stats(&self) -> &Stats {
        &self.env.stats
    }
}

/// Whether QP `qp` takes a packet `h` (of opcode `info`) from `src`: its transport service
/// is the QP's, the QP's state accepts it, and an RC/UC packet comes from the connected
/// peer: its IP, and its UDP source port once the QP knows it ([`QpCtx::peer_port`])
/// (counted and logged as dropped otherwise). The first packet a QP takes in RTR
/// raises COMM_EST.
fn admit(
    qp: &mut QpCtx,
    env: &mut Nic,
    info: &wire::OpcodeInfo,
    h: &Headers,
    src: SocketAddr,
) -> bool {
    let service_ok = matches!(
        (info.service, qp.qp_type),
        (wire::ServiceType::Rc, QpType::Rc)
            | (wire::ServiceType::Uc, QpType::Uc)
            | (wire::ServiceType::Ud, QpType::Ud)
    );
    let state_ok = if info.is_request {
        matches!(
            qp.state,
            QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe
        )
    } else {
        matches!(qp.state, QpState::Rts | QpState::Sqd)
    };
    // RC/UC accept packets only from the connected peer's address, as rxe does, and
    // from the port it sends from once known (which rxe does not check).
    let peer_ok = match qp.peer {
        Some(p) => same_ip(p.ip(), src.ip()),
        None => true,
    };
    let port_ok = qp.peer_port.map_or(true, |p| p == src.port());
    if !service_ok || !state_ok || !peer_ok || !port_ok {
        tracing::debug!(
            peer = %src,
            qpn = format_args!("{:#x}", qp.qpn),
            psn = h.bth.psn,
            opcode = %h.bth.opcode,
            state = ?qp.state,
            qp_type = ?qp.qp_type,
            connected_peer = ?qp.peer,
            peer_port = ?qp.peer_port,
            counter = "dropped",
            reason = if !service_ok {
                "transport service differs from the QP type"
            } else if !state_ok {
                "QP state does not accept it"
            } else if !peer_ok {
                "not from the connected peer"
            } else {
                "not from the UDP port the connected peer sends from"
            },
            "packet dropped"
        );
        env.stats.dropped += 1;
        return false;
    }
    if qp.state == QpState::Rtr && !qp.resp.comm_est {
        qp.resp.comm_est = true;
        env.ctx.push_event(verbs::AsyncEvent::CommEst(qp.qpn));
    }
    true
}

/// A datagram with a good ICRC that does not parse: logged with why, and counted.
fn unparsed(env: &mut Nic, src: SocketAddr, data: &[u8], e: wire::Error) {
    tracing::debug!(
        peer = %src,
        len = data.len(),
        opcode = %wire::Opcode(data[0]),
        counter = "malformed",
        reason = %e,
        "packet dropped"
    );
    env.stats.malformed += 1;
}

/// IP equality treating IPv4 and its IPv4-mapped IPv6 form as the same address.
pub(crate) fn same_ip(a: IpAddr, b: IpAddr) -> bool {
    a.to_canonical() == b.to_canonical()
}

/// Whether a BTH P_Key is a full or limited member of the default partition, the only
/// one we have (rxe accepts exactly these, on QP1 as on any other QP).
pub(crate) fn default_partition(pkey: u16) -> bool {
    pkey & 0x7FFF == wire::DEFAULT_PKEY & 0x7FFF
}

/// Gather an INLINE payload from registered memory at post time (see [`Rnic::post_send`]).
fn gather_inline(
    ctx: &verbs::Context,
    pd: verbs::PdId,
    sg_list: &[verbs::Sge],
    len: usize,
) -> verbs::Result<Vec<u8>> {
    use verbs::{ErrorKind, WcDetail};
    let mut out = vec![0u8; len];
    ctx.gather(pd, sg_list, 0, &mut out).map_err(|e| {
        // The check that failed, which a completion would have given as its detail.
        let kind = match e.detail {
            WcDetail::UnknownLkey => ErrorKind::NotFound,
            WcDetail::WrongPd => ErrorKind::ForeignObject,
            WcDetail::SgeOutOfBounds | WcDetail::MessageTooLong => ErrorKind::OutOfBounds,
            WcDetail::LocalAccess => ErrorKind::PermissionDenied,
            _ => ErrorKind::BadAddress,
        };
        verbs::Error::new(
            verbs::Errno::EFAULT,
            "inline SGE outside the PD's registered memory",
        )
        .with_kind(kind)
    })?;
    Ok(out)
}
