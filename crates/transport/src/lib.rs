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

// The protocol core imports only downwards, never the crate root:
//   rtt, keepalive, stats, pool, transmit: nothing of the crate
//   cc, recovery: rtt
//   qp: cc, rtt, recovery, keepalive          device_ctx: keepalive, pool, stats, transmit
//   liveness: qp, keepalive, device_ctx      completion: qp, liveness, device_ctx
//   requester: qp, completion, device_ctx    sack: qp, cc, recovery, requester, device_ctx
//   responder: qp, completion, sack, ...     completer: qp, cc, recovery, completion,
//   timers: qp                                 requester, sack, liveness, device_ctx
// Above it, `Rnic`'s faces: objects, modify, receive, schedule, gsi.
mod cc;
mod completer;
mod completion;
mod device_ctx;
mod grants;
mod gsi;
mod keepalive;
mod liveness;
mod modify;
mod objects;
mod pool;
mod qp;
mod receive;
mod recovery;
mod requester;
mod responder;
mod rtt;
mod sack;
mod schedule;
mod stats;
#[cfg(test)]
mod tests;
mod timers;
mod transmit;

use std::collections::{BTreeMap, VecDeque};
use std::net::{IpAddr, SocketAddr};

use device_ctx::DeviceCtx;
use qp::{QpCtx, ReqState, RespState, SendWqe, UdTarget};
use softrdma_wire as wire;
use verbs::{QpState, QpType, SendFlags, WcStatus};

pub use cc::DEFAULT_RX_BUFFER;
pub use grants::{GrantSink, PlacedTrace, Placement, PLACED_TRACE_PAYLOAD};
pub use gsi::{GsiMad, GSI_INBOX_MAX};
pub use keepalive::{Keepalive, KeepalivePolicy};
pub use softrdma_verbs as verbs;
pub use stats::Stats;
pub use transmit::{Transmit, TransmitKind};

/// One RDMA device's engine: verbs objects plus RC/UC/UD protocol state. Sans-IO.
///
/// Deliberate difference from Linux rxe: `retry_cnt` 7 is a count of 7 retries, not
/// "retry forever", so a dead peer always ends in `RETRY_EXC_ERR`. `rnr_retry` 7 is
/// infinite, as the IBTA says.
pub struct Rnic {
    env: DeviceCtx,
    /// QP1: MADs received for the layer above, lost peers to report, the send PSN.
    gsi: gsi::Gsi,
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
            env: DeviceCtx {
                addr,
                alt,
                ctx,
                out: VecDeque::new(),
                stats: Stats::default(),
                ack_queue: VecDeque::new(),
                tx_wait: VecDeque::new(),
                resp_wait: VecDeque::new(),
                resp_first: false,
                pool: pool::BufPool::default(),
                ip_ids: wire::icrc::IpIdCache::default(),
                ip_id_guard: wire::icrc::IpIdGuard::default(),
                held_bytes: 0,
                rx_buffer: cc::DEFAULT_RX_BUFFER,
                keepalive: KeepalivePolicy::OFF,
                placement: None,
                grants: None,
                trace_placed: false,
                placed_traces: Vec::new(),
            },
            gsi: gsi::Gsi::default(),
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
            indexed: timers::Indexed::default(),
        };
        self.qps.insert(qpn, ctx);
        Ok(qpn)
    }

    /// Destroy a QP. Queued WRs vanish without completions, as `ibv_destroy_qp` does.
    pub fn destroy_qp(&mut self, qpn: verbs::Qpn) -> verbs::Result<()> {
        if let Some(sink) = self.env.grants.as_mut() {
            sink.qp(qpn, None);
        }
        let r = self.env.ctx.destroy_qp(qpn);
        if r.is_err() {
            self.publish_qp(qpn);
        }
        r?;
        if let Some(mut qp) = self.qps.remove(&qpn) {
            qp.resp.held.clear(&mut self.env.held_bytes);
            self.timers.set(qpn, &mut qp.indexed.req, None);
            self.ka_timers.set(qpn, &mut qp.indexed.ka, None);
        }
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
                if completer::on_timers(qp, &mut self.env, now) {
                    gsi::peer_lost(&mut self.gsi, &mut self.env, qpn);
                }
            }
            self.sync_timer(qpn);
        }
    }

    /// Re-read QP `qpn`'s timer deadlines into the index (after anything that may have
    /// armed, moved or cleared them).
    fn sync_timer(&mut self, qpn: verbs::Qpn) {
        // A QP no longer in the table left both indexes when it was destroyed.
        if let Some(qp) = self.qps.get_mut(&qpn) {
            let d = timers::deadline(qp);
            self.timers.set(qpn, &mut qp.indexed.req, d);
            let k = qp.ka.deadline;
            self.ka_timers.set(qpn, &mut qp.indexed.ka, k);
        }
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
