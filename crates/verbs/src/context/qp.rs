//! Queue pairs: creation and caps, the state machine, send WR checks and the receive queue.

use std::collections::VecDeque;

use super::table::Table;
use super::{ebusy, einval, enomem, limits, missing, Context};
use crate::error::{ErrorKind, Result};
use crate::qp_table;
use crate::types::{
    CqId, PdId, QpAttr, QpAttrMask, QpCap, QpInitAttr, QpState, QpType, Qpn, RecvWr, SendFlags,
    SendOp, SendWr, SrqId,
};

/// A queue pair's verbs-visible part: identity, bindings, state machine, attributes and
/// receive queue. The send queue and protocol state live in the transport.
#[derive(Debug)]
pub struct Qp {
    /// QP number.
    pub qpn: Qpn,
    /// Creation attributes (with the actual caps).
    pub init: QpInitAttr,
    /// Current state.
    pub state: QpState,
    /// Current attribute values (state included).
    pub attr: QpAttr,
    /// Posted receive WRs (unused when the QP has an SRQ).
    pub rq: VecDeque<RecvWr>,
}

/// The queue pairs by number.
pub(super) type QpTable = Table<Qpn, Qp>;

impl QpTable {
    pub(super) fn uses_pd(&self, pd: PdId) -> bool {
        self.values().any(|q| q.init.pd == pd)
    }
    pub(super) fn uses_cq(&self, cq: CqId) -> bool {
        self.values()
            .any(|q| q.init.send_cq == cq || q.init.recv_cq == cq)
    }
    pub(super) fn uses_srq(&self, srq: SrqId) -> bool {
        self.values().any(|q| q.init.srq == Some(srq))
    }
}

impl Context {
    /// Create a QP in RESET; caps are checked against the device and rounded up.
    ///
    /// Rounding: queue depths and SGE counts are at least 1 (receive caps are 0 with an
    /// SRQ); inline data and send SGEs share a WQE's room of 16 bytes per SGE, so
    /// `max_inline_data` is at least `16 × max_send_sge` and `max_send_sge` at least
    /// `max_inline_data / 16`, as rxe reports them.
    pub fn create_qp(&mut self, init: QpInitAttr) -> Result<Qpn> {
        self.check_pd(init.pd)?;
        if !self.cqs.contains(init.send_cq) || !self.cqs.contains(init.recv_cq) {
            return Err(missing("no such CQ"));
        }
        if let Some(srq) = init.srq {
            if !self.srqs.contains(srq) {
                return Err(missing("no such SRQ"));
            }
        }
        let d = &self.dev;
        let c = init.cap;
        if c.max_send_wr > d.max_qp_wr
            || c.max_send_sge > d.max_sge
            || c.max_inline_data > d.max_inline_data
            || (init.srq.is_none() && (c.max_recv_wr > d.max_qp_wr || c.max_recv_sge > d.max_sge))
        {
            return Err(einval("QP caps above device limits"));
        }
        if self.qps.len() >= d.max_qp as usize {
            return Err(enomem("too many QPs"));
        }
        let send_sge = c.max_send_sge.max(1);
        let room = (send_sge * limits::SGE_BYTES)
            .max(c.max_inline_data)
            .min(d.max_inline_data);
        let cap = QpCap {
            max_send_wr: c.max_send_wr.max(1),
            max_send_sge: (room / limits::SGE_BYTES).max(send_sge),
            max_inline_data: room,
            max_recv_wr: if init.srq.is_some() {
                0
            } else {
                c.max_recv_wr.max(1)
            },
            max_recv_sge: if init.srq.is_some() {
                0
            } else {
                c.max_recv_sge.max(1)
            },
        };
        let qpn = self.alloc_qpn()?;
        let init = QpInitAttr { cap, ..init };
        self.qps.insert(
            qpn,
            Qp {
                qpn,
                init,
                state: QpState::Reset,
                attr: Self::reset_attr(cap),
                rq: VecDeque::new(),
            },
        );
        Ok(qpn)
    }
    fn reset_attr(cap: QpCap) -> QpAttr {
        QpAttr {
            cap,
            port_num: 1,
            ..QpAttr::default()
        }
    }
    fn alloc_qpn(&mut self) -> Result<Qpn> {
        for _ in 0..256 {
            let q = (self.rng.next_u64() as u32) & limits::MASK24;
            if qpn_usable(q) && !self.qps.contains(q) {
                return Ok(q);
            }
        }
        Err(enomem("no free QP number"))
    }
    /// Destroy a QP. Type-2 windows bound to it become free (unbound). EBUSY while it is
    /// attached to a multicast group: uverbs refuses to destroy such a QP until the
    /// program detaches it.
    pub fn destroy_qp(&mut self, qpn: Qpn) -> Result<()> {
        if !self.qps.contains(qpn) {
            return Err(missing("no such QP"));
        }
        if self.mcast.has_qp(qpn) {
            return Err(ebusy("the QP is still attached to a multicast group"));
        }
        self.qps.remove(qpn);
        self.mws.unbind_qp(qpn);
        Ok(())
    }
    /// Take the completions of QP `qpn` out of its CQs, as mlx4 and mlx5 do when a QP is
    /// reset (every face does it then): a QP brought from ERROR back to RTS must not have
    /// the WRs flushed in its old life polled as if they came from its new one. Receive
    /// completions of an SRQ stay, as each holds a buffer taken from the SRQ. Returns how
    /// many were taken; an error for no such QP.
    pub fn discard_completions(&mut self, qpn: Qpn) -> Result<usize> {
        let qp = self.qps.get(qpn).ok_or(missing("no such QP"))?;
        let (send_cq, recv_cq, srq) = (qp.init.send_cq, qp.init.recv_cq, qp.init.srq);
        let keep_recvs = srq.is_some();
        let mut n = self.cqs.clean(send_cq, qpn, keep_recvs);
        if recv_cq != send_cq {
            n += self.cqs.clean(recv_cq, qpn, keep_recvs);
        }
        Ok(n)
    }
    /// The QP.
    pub fn qp(&self, qpn: Qpn) -> Option<&Qp> {
        self.qps.get(qpn)
    }
    /// The QP, mutably.
    pub fn qp_mut(&mut self, qpn: Qpn) -> Option<&mut Qp> {
        self.qps.get_mut(qpn)
    }
    /// Check the values of the attributes present in `mask`.
    fn check_qp_values(&self, a: &QpAttr, mask: QpAttrMask) -> Result<()> {
        use QpAttrMask as M;
        if mask.contains(M::PKEY_INDEX) && a.pkey_index >= self.port.pkey_tbl_len {
            return Err(einval("pkey index out of range"));
        }
        if mask.contains(M::PORT) && a.port_num != 1 {
            return Err(einval("no such port"));
        }
        if mask.contains(M::AV) {
            self.check_ah_attr(&a.ah_attr)?;
        }
        if mask.contains(M::PATH_MTU) && a.path_mtu > self.port.max_mtu {
            return Err(einval("path MTU above the port maximum"));
        }
        if mask.contains(M::TIMEOUT) && a.timeout > 31 {
            return Err(einval("timeout above 31"));
        }
        if mask.contains(M::RETRY_CNT) && a.retry_cnt > 7 {
            return Err(einval("retry_cnt above 7"));
        }
        if mask.contains(M::RNR_RETRY) && a.rnr_retry > 7 {
            return Err(einval("rnr_retry above 7"));
        }
        if mask.contains(M::MIN_RNR_TIMER) && a.min_rnr_timer > 31 {
            return Err(einval("min_rnr_timer above 31"));
        }
        if mask.contains(M::MAX_QP_RD_ATOMIC)
            && a.max_rd_atomic as u32 > self.dev.max_qp_init_rd_atom
        {
            return Err(einval("max_rd_atomic above the device limit"));
        }
        if mask.contains(M::MAX_DEST_RD_ATOMIC)
            && a.max_dest_rd_atomic as u32 > self.dev.max_qp_rd_atom
        {
            return Err(einval("max_dest_rd_atomic above the device limit"));
        }
        if mask.contains(M::DEST_QPN) && a.dest_qp_num > limits::MASK24 {
            return Err(einval("dest QPN is 24 bits"));
        }
        Ok(())
    }
    /// Apply a modify as the IBTA state machine allows: the transition must be legal from the
    /// current state, every required attribute for it present and only allowed optional ones;
    /// EINVAL otherwise (nothing changes). Returns (old state, new state). Leaving for RESET
    /// clears the receive queue.
    ///
    /// Without `STATE` in the mask the target is the current state. With `CUR_STATE`,
    /// `cur_qp_state` must equal the current state. PSNs are masked to 24 bits. Going to RESET
    /// also resets the attributes (the caps stay).
    pub fn modify_qp(
        &mut self,
        qpn: Qpn,
        attr: &QpAttr,
        mask: QpAttrMask,
    ) -> Result<(QpState, QpState)> {
        use QpAttrMask as M;
        let qp = self.qps.get(qpn).ok_or(missing("no such QP"))?;
        let cur = qp.state;
        let next = if mask.contains(M::STATE) {
            attr.qp_state
        } else {
            cur
        };
        if mask.contains(M::CUR_STATE) {
            if !matches!(
                cur,
                QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe
            ) {
                return Err(einval("CUR_STATE not allowed from this state")
                    .with_kind(ErrorKind::InvalidTransition));
            }
            if attr.cur_qp_state != cur {
                return Err(einval("cur_qp_state does not match the QP's state")
                    .with_kind(ErrorKind::InvalidTransition));
            }
        }
        let (req, opt) = qp_table::transition(cur, next, qp.init.qp_type)
            .ok_or(einval("illegal QP state transition").with_kind(ErrorKind::InvalidTransition))?;
        if !mask.contains(req) {
            return Err(einval("a required attribute is missing"));
        }
        if !(req | opt | M::STATE).contains(mask) {
            return Err(einval("an attribute not allowed in this transition"));
        }
        self.check_qp_values(attr, mask)?;
        let Some(qp) = self.qps.get_mut(qpn) else {
            return Err(missing("no such QP"));
        };
        if next == QpState::Reset {
            qp.rq.clear();
            qp.attr = Self::reset_attr(qp.init.cap);
        } else {
            let q = &mut qp.attr;
            if mask.contains(M::EN_SQD_ASYNC_NOTIFY) {
                q.en_sqd_async_notify = attr.en_sqd_async_notify;
            }
            if mask.contains(M::ACCESS_FLAGS) {
                q.qp_access_flags = attr.qp_access_flags;
            }
            if mask.contains(M::PKEY_INDEX) {
                q.pkey_index = attr.pkey_index;
            }
            if mask.contains(M::PORT) {
                q.port_num = attr.port_num;
            }
            if mask.contains(M::QKEY) {
                q.qkey = attr.qkey;
            }
            if mask.contains(M::AV) {
                q.ah_attr = attr.ah_attr;
                if q.ah_attr.port_num == 0 {
                    q.ah_attr.port_num = 1;
                }
            }
            if mask.contains(M::PATH_MTU) {
                q.path_mtu = attr.path_mtu;
            }
            if mask.contains(M::TIMEOUT) {
                q.timeout = attr.timeout;
            }
            if mask.contains(M::RETRY_CNT) {
                q.retry_cnt = attr.retry_cnt;
            }
            if mask.contains(M::RNR_RETRY) {
                q.rnr_retry = attr.rnr_retry;
            }
            if mask.contains(M::RQ_PSN) {
                q.rq_psn = attr.rq_psn & limits::MASK24;
            }
            if mask.contains(M::MAX_QP_RD_ATOMIC) {
                q.max_rd_atomic = attr.max_rd_atomic;
            }
            if mask.contains(M::MIN_RNR_TIMER) {
                q.min_rnr_timer = attr.min_rnr_timer;
            }
            if mask.contains(M::SQ_PSN) {
                q.sq_psn = attr.sq_psn & limits::MASK24;
            }
            if mask.contains(M::MAX_DEST_RD_ATOMIC) {
                q.max_dest_rd_atomic = attr.max_dest_rd_atomic;
            }
            if mask.contains(M::DEST_QPN) {
                q.dest_qp_num = attr.dest_qp_num;
            }
        }
        qp.state = next;
        qp.attr.qp_state = next;
        qp.attr.cur_qp_state = next;
        Ok((cur, next))
    }
    /// Move a QP to ERR from inside the engine (no attribute checks).
    pub fn set_qp_error(&mut self, qpn: Qpn) {
        if let Some(qp) = self.qps.get_mut(qpn) {
            qp.state = QpState::Err;
            qp.attr.qp_state = QpState::Err;
            qp.attr.cur_qp_state = QpState::Err;
        }
    }
    /// Validate a send WR against the QP's type, state and caps (EINVAL: opcode not valid for
    /// the type, missing UD destination, too many SGEs, inline too long; ENOMEM is the
    /// transport's to return when the queue is full).
    ///
    /// Also EINVAL: posting in RESET, INIT or RTR; a UD AH of another PD; INLINE on READ,
    /// atomics, LOCAL_INV or BIND_MW; atomics whose SGEs hold fewer than 8 bytes.
    ///
    /// More SGEs than `max_send_sge` is EINVAL in every state, ERR included, where it is the
    /// only check: the program learns of a WR its QP could never hold at post, not from a
    /// flush. Anything else posted in ERR is accepted, for the transport to complete with
    /// WR_FLUSH_ERR.
    pub fn check_send_wr(&self, qpn: Qpn, wr: &SendWr) -> Result<()> {
        let qp = self.qps.get(qpn).ok_or(missing("no such QP"))?;
        if wr.sg_list.len() > qp.init.cap.max_send_sge as usize {
            return Err(einval("too many SGEs"));
        }
        match qp.state {
            QpState::Reset | QpState::Init | QpState::Rtr => {
                return Err(einval("QP not ready to send").with_kind(ErrorKind::QpState))
            }
            QpState::Err => return Ok(()),
            QpState::Rts | QpState::Sqd | QpState::Sqe => {}
        }
        let t = qp.init.qp_type;
        let op_ok = match wr.op {
            SendOp::Send | SendOp::SendWithImm { .. } => true,
            SendOp::Write { .. }
            | SendOp::WriteWithImm { .. }
            | SendOp::LocalInv { .. }
            | SendOp::BindMw(_) => t != QpType::Ud,
            SendOp::SendWithInv { .. }
            | SendOp::Read { .. }
            | SendOp::CompareSwap { .. }
            | SendOp::FetchAdd { .. } => t == QpType::Rc,
        };
        if !op_ok {
            return Err(einval("opcode not valid for the QP type"));
        }
        if t == QpType::Ud {
            let ud = wr
                .ud
                .as_ref()
                .ok_or(einval("UD send without a destination"))?;
            match self.ahs.get(ud.ah) {
                Some((pd, _)) if *pd == qp.init.pd => {}
                Some(_) => {
                    return Err(
                        einval("address handle of another PD").with_kind(ErrorKind::ForeignObject)
                    )
                }
                None => return Err(missing("invalid address handle")),
            }
            if ud.remote_qpn > limits::MASK24 {
                return Err(einval("remote QPN is 24 bits"));
            }
        }
        let total: u64 = wr.sg_list.iter().map(|s| s.length as u64).sum();
        let atomic = matches!(wr.op, SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. });
        if wr.flags.contains(SendFlags::INLINE) {
            let data_op = matches!(
                wr.op,
                SendOp::Send
                    | SendOp::SendWithImm { .. }
                    | SendOp::SendWithInv { .. }
                    | SendOp::Write { .. }
                    | SendOp::WriteWithImm { .. }
            );
            if !data_op {
                return Err(einval("INLINE only applies to sends and writes"));
            }
            if total > qp.init.cap.max_inline_data as u64 {
                return Err(einval("inline data too long"));
            }
        }
        if atomic && total < 8 {
            return Err(einval("atomics need an 8-byte result buffer"));
        }
        Ok(())
    }
    /// Post to the QP's receive queue (EINVAL in RESET or with an SRQ, EINVAL for more SGEs
    /// than `max_recv_sge` in every state, ENOMEM when full). Posting in ERR is allowed; the
    /// transport flushes.
    pub fn post_recv(&mut self, qpn: Qpn, wr: RecvWr) -> Result<()> {
        let qp = self.qps.get_mut(qpn).ok_or(missing("no such QP"))?;
        if qp.state == QpState::Reset {
            return Err(einval("QP in RESET").with_kind(ErrorKind::QpState));
        }
        if qp.init.srq.is_some() {
            return Err(einval("QP receives from an SRQ"));
        }
        if wr.sg_list.len() > qp.init.cap.max_recv_sge as usize {
            return Err(einval("too many SGEs"));
        }
        if qp.rq.len() >= qp.init.cap.max_recv_wr as usize {
            return Err(enomem("receive queue full").with_kind(ErrorKind::QueueFull));
        }
        qp.rq.push_back(wr);
        Ok(())
    }
    /// Take the next receive WR for an incoming message: from the QP's SRQ (firing the limit
    /// event when the SRQ drops below its armed limit) or its own queue.
    pub fn take_recv(&mut self, qpn: Qpn) -> Option<RecvWr> {
        let qp = self.qps.get_mut(qpn)?;
        match qp.init.srq {
            Some(srq) => self.take_srq_recv(srq),
            None => qp.rq.pop_front(),
        }
    }
    /// Look at the next receive WR without taking it.
    pub fn peek_recv(&self, qpn: Qpn) -> Option<&RecvWr> {
        let qp = self.qps.get(qpn)?;
        match qp.init.srq {
            Some(srq) => self.peek_srq_recv(srq),
            None => qp.rq.front(),
        }
    }
}

/// Whether a QPN may name a new QP. Below [`limits::MIN_QPN`] are the special QPs, which
/// the engine serves itself (0, the SMI, does not exist on RoCE; 1 is the GSI, where the
/// connection manager's MADs arrive): a verbs QP numbered so would never see its packets.
/// Nor may 0xFFFFFF, the QPN a datagram names to reach every QP attached to a multicast
/// group.
fn qpn_usable(q: u32) -> bool {
    (limits::MIN_QPN..softrdma_wire::MULTICAST_QPN).contains(&q)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn special_qpns_are_not_usable() {
        assert!(!qpn_usable(0), "SMI");
        assert!(!qpn_usable(1), "GSI");
        assert!((0..limits::MIN_QPN).all(|q| !qpn_usable(q)));
        assert!(qpn_usable(limits::MIN_QPN));
        assert!(qpn_usable(limits::MASK24 - 1));
        assert!(!qpn_usable(limits::MASK24), "the multicast QPN");
        assert!(!qpn_usable(limits::MASK24 + 1));
    }
}
