//! The steps librdmacm takes around the CM's messages, written once for every face: the
//! READ/atomic depths a side offers and settles against its device's limits, the QP moved
//! to RTR and RTS from what the REQ and REP carried, and the RTU sent on the answer.
//!
//! The C face (`rdma_connect`, `rdma_accept`, CONNECT_RESPONSE in `rdma_get_cm_event`)
//! and the Rust face (`softrdma::cm`) call these with their own way of modifying a QP;
//! neither decides a depth or a QP attribute itself.

use softrdma_device::Device;
use softrdma_verbs::{QpAttr, QpAttrMask, QpState};

use crate::agent::Agent;
use crate::cma::{err, errno, CmaError, ConnParam, IdHandle};

/// librdmacm's `RDMA_MAX_RESP_RES` and `RDMA_MAX_INIT_DEPTH`: a depth field that asks
/// for as many as may be had.
pub const MOST: u8 = 0xFF;

/// How many outstanding READs and atomics one side asks for, in one direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Depth {
    /// As many as the device allows (and, when answering, as the peer offered):
    /// librdmacm's [`MOST`], and what a program that sets nothing gets.
    Most,
    /// Exactly this many, as librdmacm takes a number the program set: more than the
    /// device allows is EINVAL; an answer may grant more than the peer offered.
    Exactly(u8),
    /// At most this many: lowered to what the device allows and, when answering, to
    /// what the peer offered. The Rust face's options mean this.
    AtMost(u8),
}

impl Depth {
    /// A C `rdma_conn_param` depth field: [`MOST`] or a number.
    pub fn from_c(v: u8) -> Depth {
        if v == MOST {
            Depth::Most
        } else {
            Depth::Exactly(v)
        }
    }

    fn with(self, limit: u8, peer: Option<u8>) -> u8 {
        let cap = peer.map_or(limit, |p| p.min(limit));
        match self {
            Depth::Most => cap,
            Depth::Exactly(v) => v,
            Depth::AtMost(v) => v.min(cap),
        }
    }
}

/// A device's READ/atomic limits: `max_qp_rd_atom` (what one QP answers) and
/// `max_qp_init_rd_atom` (what one QP has outstanding).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RdLimits {
    /// The most READs and atomics a QP of the device answers at once.
    pub responder: u8,
    /// The most READs and atomics a QP of the device has outstanding.
    pub initiator: u8,
}

impl RdLimits {
    /// The limits of `dev`.
    pub fn of(dev: &Device) -> RdLimits {
        let a = dev.device_attr();
        let c = |v: u32| u8::try_from(v).unwrap_or(u8::MAX);
        RdLimits {
            responder: c(a.max_qp_rd_atom),
            initiator: c(a.max_qp_init_rd_atom),
        }
    }

    /// librdmacm's `ucma_valid_param`: an exact depth above the device's limit is EINVAL.
    pub fn check(&self, responder: Depth, initiator: Depth) -> Result<(), CmaError> {
        let over = |d: Depth, lim: u8| matches!(d, Depth::Exactly(v) if v > lim);
        if over(responder, self.responder) || over(initiator, self.initiator) {
            return Err(err(
                errno::EINVAL,
                "more READs/atomics asked than the device allows",
            ));
        }
        Ok(())
    }

    /// What the connecting side offers in its REQ: `(responder resources, initiator
    /// depth)`.
    pub fn offer(&self, responder: Depth, initiator: Depth) -> (u8, u8) {
        (
            responder.with(self.responder, None),
            initiator.with(self.initiator, None),
        )
    }

    /// What the accepting side settles on, given the request's offer seen from this side
    /// (`peer_responder`: the requester's initiator depth, which this side must answer;
    /// `peer_initiator`: the requester's responder resources), as the CONNECT_REQUEST
    /// event carries them. `(responder resources, initiator depth)`.
    pub fn settle(
        &self,
        responder: Depth,
        initiator: Depth,
        peer_responder: u8,
        peer_initiator: u8,
    ) -> (u8, u8) {
        (
            responder.with(self.responder, Some(peer_responder)),
            initiator.with(self.initiator, Some(peer_initiator)),
        )
    }
}

/// What a side sets on its QP beyond the CM's attributes when readying it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ready {
    /// The responder resources (`max_dest_rd_atomic`) instead of the CM's.
    pub responder: Option<u8>,
    /// The initiator depth (`max_rd_atomic`) instead of the CM's.
    pub initiator: Option<u8>,
    /// The RNR NAK timer code this side advertises instead of the CM's (0: 655 ms).
    pub min_rnr_timer: Option<u8>,
}

/// librdmacm's `ucma_modify_qp_rtr` and `ucma_modify_qp_rts`: the QP of `id` to INIT
/// again (its access depends on the resources known only now), then RTR and RTS with
/// the attributes the handshake settled, `ready`'s overrides applied. `modify` moves the
/// face's QP.
pub fn ready_qp<E: From<CmaError>>(
    agent: &Agent,
    id: IdHandle,
    ready: Ready,
    mut modify: impl FnMut(&QpAttr, QpAttrMask) -> Result<(), E>,
) -> Result<(), E> {
    let attr = |s| agent.call(|c, _| c.init_qp_attr(id, s));
    let (a, m) = attr(QpState::Init)?;
    modify(&a, m)?;
    let (mut a, m) = attr(QpState::Rtr)?;
    if let Some(r) = ready.responder {
        a.max_dest_rd_atomic = r;
    }
    if let Some(t) = ready.min_rnr_timer {
        a.min_rnr_timer = t.min(31);
    }
    modify(&a, m)?;
    let (mut a, m) = attr(QpState::Rts)?;
    if let Some(i) = ready.initiator {
        a.max_rd_atomic = i;
    }
    modify(&a, m)
}

/// librdmacm's `ucma_process_conn_resp` (and `rdma_establish`), the connecting side's
/// step on CONNECT_RESPONSE: ready the QP with what the REP carried (`ready`; None when
/// the program moves its own QP) and send the RTU. On failure the QP goes to ERR
/// (`to_error`) and the error is returned; the id is left for the caller to reject or
/// destroy.
pub fn complete_connect<E: From<CmaError>>(
    agent: &Agent,
    id: IdHandle,
    ready: Option<Ready>,
    modify: impl FnMut(&QpAttr, QpAttrMask) -> Result<(), E>,
    to_error: impl FnOnce(),
) -> Result<(), E> {
    let r = match ready {
        Some(ready) => ready_qp(agent, id, ready, modify),
        None => Ok(()),
    }
    .and_then(|()| Ok(agent.call(|c, now| c.accept(now, id, &ConnParam::default()))?));
    if r.is_err() {
        to_error();
    }
    r
}

/// librdmacm's `rdma_accept` after its checks: for a connected id with a QP, ready it
/// (`ready`, None for a UD id or one whose program moves its own QP), then send the REP
/// (or SIDR_REP) carrying `p`. When the CM refuses the answer the QP goes to ERR
/// (`to_error`), as librdmacm does; a failed QP move returns its error with the QP
/// left where it stopped.
pub fn accept<E: From<CmaError>>(
    agent: &Agent,
    id: IdHandle,
    ready: Option<Ready>,
    p: &ConnParam,
    modify: impl FnMut(&QpAttr, QpAttrMask) -> Result<(), E>,
    to_error: impl FnOnce(),
) -> Result<(), E> {
    if let Some(ready) = ready {
        ready_qp(agent, id, ready, modify)?;
    }
    let r = agent.call(|c, now| c.accept(now, id, p));
    if r.is_err() {
        to_error();
    }
    Ok(r?)
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEV: RdLimits = RdLimits {
        responder: 128,
        initiator: 16,
    };

    #[test]
    fn offer_takes_the_device_limit_for_most() {
        assert_eq!(DEV.offer(Depth::Most, Depth::Most), (128, 16));
        assert_eq!(DEV.offer(Depth::Exactly(3), Depth::Exactly(0)), (3, 0));
        assert_eq!(DEV.offer(Depth::AtMost(200), Depth::AtMost(4)), (128, 4));
    }

    #[test]
    fn check_refuses_exact_depths_over_the_device() {
        assert!(DEV.check(Depth::Exactly(128), Depth::Exactly(16)).is_ok());
        assert_eq!(
            DEV.check(Depth::Exactly(129), Depth::Most)
                .unwrap_err()
                .errno,
            22
        );
        assert!(DEV.check(Depth::Most, Depth::Exactly(17)).is_err());
        // AtMost is lowered, never refused.
        assert!(DEV.check(Depth::AtMost(255), Depth::AtMost(255)).is_ok());
    }

    #[test]
    fn settle_follows_librdmacm_for_most_and_exact() {
        // The peer offered 4 (this side answers 4 READs) and 2.
        assert_eq!(DEV.settle(Depth::Most, Depth::Most, 4, 2), (4, 2));
        // An exact number is taken as the program set it, as librdmacm does.
        assert_eq!(
            DEV.settle(Depth::Exactly(8), Depth::Exactly(8), 4, 2),
            (8, 8)
        );
        // AtMost is the lower of the three.
        assert_eq!(
            DEV.settle(Depth::AtMost(3), Depth::AtMost(16), 4, 200),
            (3, 16)
        );
    }

    #[test]
    fn from_c_reads_the_max_marker() {
        assert_eq!(Depth::from_c(MOST), Depth::Most);
        assert_eq!(Depth::from_c(7), Depth::Exactly(7));
    }
}
