//! Connections: `rdma_listen`, `rdma_connect`, `rdma_accept`, `rdma_reject` (with ECE),
//! `rdma_disconnect`, `rdma_establish` and `rdma_notify`, checking the program's
//! `rdma_conn_param` and taking the READ/atomic depths from the CM layer's rules.

use std::ffi::{c_int, c_void};

use softrdma_cm::cma::ConnParam;
use softrdma_cm::conn::{self, Depth, RdLimits, Ready};
use softrdma_cm::rej_reason;

use super::{complete, done, id_of, query_route, with_id, CmId, Priv};
use crate::rdmacm::cm::{self, Cm};
use crate::rdmacm::{abi, event, qp};
use crate::{guard, minus_one, sys};

#[no_mangle]
pub unsafe extern "C" fn rdma_listen(id: *mut abi::rdma_cm_id, backlog: c_int) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live id.
        let r = unsafe { with_id(id, |me| me.model(|c, _, h| c.listen(h, backlog))) };
        done(r.map(|()| {
            // SAFETY: as above.
            unsafe { query_route(id) };
            0
        }))
    })
}

/// The device's READ/atomic limits, for the CM layer's depth rules.
fn limits(cm: &Cm) -> RdLimits {
    RdLimits::of(cm.agent().device())
}

/// A depth field of the program's `rdma_conn_param` (none: as much as may be had).
fn depth(v: Option<u8>) -> Depth {
    v.map_or(Depth::Most, Depth::from_c)
}

/// librdmacm's `ucma_valid_param`: in the TCP port space an id without a QP needs
/// parameters, and the depths asked must fit the device ([`RdLimits::check`]).
fn valid_param(
    me: &CmId,
    param: Option<&abi::rdma_conn_param>,
    lim: RdLimits,
) -> Result<(), c_int> {
    if me.c.ps != abi::RDMA_PS_TCP {
        return Ok(());
    }
    let Some(p) = param else {
        return if me.c.qp.is_null() {
            Err(libc::EINVAL)
        } else {
            Ok(())
        };
    };
    lim.check(
        Depth::from_c(p.responder_resources),
        Depth::from_c(p.initiator_depth),
    )
    .map_err(cm::errno)
}

/// The model's parameters from the program's and the id's, as
/// `ucma_copy_conn_param_to_kern` builds them.
///
/// # Safety
/// `param`'s private data pointer is valid for its length.
unsafe fn to_model(
    g: &Priv,
    param: Option<&abi::rdma_conn_param>,
    qp_num: u32,
    srq: u8,
) -> ConnParam {
    let mut out = ConnParam {
        private_data: g.connect.clone(),
        responder_resources: g.responder_resources,
        initiator_depth: g.initiator_depth,
        qp_num,
        srq,
        ..ConnParam::default()
    };
    match param {
        Some(p) => {
            out.flow_control = p.flow_control;
            out.retry_count = p.retry_count;
            out.rnr_retry_count = p.rnr_retry_count;
            if !p.private_data.is_null() && p.private_data_len > 0 {
                // SAFETY: per the contract.
                let pd = unsafe {
                    std::slice::from_raw_parts(
                        p.private_data.cast::<u8>(),
                        usize::from(p.private_data_len),
                    )
                };
                out.private_data.extend_from_slice(pd);
            }
        }
        None => {
            out.retry_count = 7;
            out.rnr_retry_count = 7;
        }
    }
    out
}

/// The QP number and SRQ flag of the id's QP, else the parameters'.
///
/// # Safety
/// `me.c.qp` is null or a live QP.
unsafe fn qp_of(me: &CmId, param: Option<&abi::rdma_conn_param>) -> (u32, u8) {
    if me.c.qp.is_null() {
        param.map_or((0, 0), |p| (p.qp_num, p.srq))
    } else {
        // SAFETY: per the contract.
        let q = unsafe { &*me.c.qp };
        (q.qp_num, u8::from(!q.srq.is_null()))
    }
}

#[no_mangle]
pub unsafe extern "C" fn rdma_connect(
    id: *mut abi::rdma_cm_id,
    conn_param: *mut abi::rdma_conn_param,
) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live id and null or valid parameters.
        let r = unsafe {
            with_id(id, |me| {
                let param = conn_param.as_ref();
                let lim = limits(&me.cm);
                valid_param(me, param, lim)?;
                let (qp_num, srq) = qp_of(me, param);
                let cp = {
                    let mut g = me.lock();
                    (g.responder_resources, g.initiator_depth) = lim.offer(
                        depth(param.map(|p| p.responder_resources)),
                        depth(param.map(|p| p.initiator_depth)),
                    );
                    let cp = to_model(&g, param, qp_num, srq);
                    g.connect.clear();
                    cp
                };
                me.model(|c, now, h| c.connect(now, h, &cp))
            })
        };
        // SAFETY: as above.
        done(r.map(|()| unsafe { complete(id) }))
    })
}

#[no_mangle]
pub unsafe extern "C" fn rdma_accept(
    id: *mut abi::rdma_cm_id,
    conn_param: *mut abi::rdma_conn_param,
) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live id and null or valid parameters.
        let r = unsafe {
            with_id(id, |me| {
                let param = conn_param.as_ref();
                let lim = limits(&me.cm);
                valid_param(me, param, lim)?;
                if me.c.qp.is_null() && param.is_none() {
                    return Err(libc::EINVAL);
                }
                let (resp_res, init_depth) = {
                    let mut g = me.lock();
                    // What the request offered, seen from this side (set with its event).
                    let settled = lim.settle(
                        depth(param.map(|p| p.responder_resources)),
                        depth(param.map(|p| p.initiator_depth)),
                        g.responder_resources,
                        g.initiator_depth,
                    );
                    (g.responder_resources, g.initiator_depth) = settled;
                    settled
                };
                let ready = (me.c.qp_type != sys::IBV_QPT_UD).then_some(Ready {
                    responder: Some(resp_res),
                    initiator: Some(init_depth),
                    min_rnr_timer: None,
                });
                let ready = ready.and_then(|r| qp::ready_if_qp(me, r));
                let (qp_num, srq) = qp_of(me, param);
                let cp = to_model(&me.lock(), param, qp_num, srq);
                conn::accept(
                    me.cm.agent(),
                    me.handle,
                    ready,
                    &cp,
                    qp::modifier(me),
                    || {
                        let _ = qp::modify_qp_err(me);
                    },
                )
                .map_err(|qp::Errno(e)| e)
            })
        };
        done(r.map(|()| {
            // SAFETY: as above.
            unsafe {
                if (*id).qp_type == sys::IBV_QPT_UD {
                    // A UD accept completes at once; a sync id's request event is done.
                    let me = id_of(id).expect("checked");
                    if me.lock().sync && !(*id).event.is_null() {
                        event::rdma_ack_cm_event((*id).event);
                        (*id).event = std::ptr::null_mut();
                    }
                    0
                } else {
                    complete(id)
                }
            }
        }))
    })
}

/// `rdma_reject` with private data (REJ "consumer reject").
#[no_mangle]
pub unsafe extern "C" fn rdma_reject(
    id: *mut abi::rdma_cm_id,
    private_data: *const c_void,
    private_data_len: u8,
) -> c_int {
    // SAFETY: as the caller's contract.
    unsafe {
        reject_with(
            id,
            private_data,
            private_data_len,
            rej_reason::CONSUMER_REJECT,
        )
    }
}

/// `rdma_reject_ece`: reject because the requested ECE options are not supported (REJ
/// reason 35).
#[no_mangle]
pub unsafe extern "C" fn rdma_reject_ece(
    id: *mut abi::rdma_cm_id,
    private_data: *const c_void,
    private_data_len: u8,
) -> c_int {
    // SAFETY: as the caller's contract.
    unsafe {
        reject_with(
            id,
            private_data,
            private_data_len,
            rej_reason::VENDOR_OPTION_NOT_SUPPORTED,
        )
    }
}

/// ECE (vendor options negotiated in the REQ and REP) needs device options softrdma's
/// devices do not have: `rdma_set_local_ece` is EOPNOTSUPP (after librdmacm's own
/// argument checks), so a program learns it rather than believing options were sent.
#[no_mangle]
pub unsafe extern "C" fn rdma_set_local_ece(
    id: *mut abi::rdma_cm_id,
    ece: *mut sys::ibv_ece,
) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live id and null or its ECE struct.
        let bad = unsafe {
            id_of(id).is_none() || ece.is_null() || (*ece).vendor_id == 0 || (*ece).comp_mask != 0
        };
        minus_one(if bad { libc::EINVAL } else { libc::EOPNOTSUPP })
    })
}

/// The peer's ECE options: EOPNOTSUPP (see [`rdma_set_local_ece`]); EINVAL for an id
/// with a QP, as librdmacm.
#[no_mangle]
pub unsafe extern "C" fn rdma_get_remote_ece(
    id: *mut abi::rdma_cm_id,
    ece: *mut sys::ibv_ece,
) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live id and null or its ECE struct.
        let bad = unsafe { id_of(id) }.map_or(true, |me| !me.c.qp.is_null()) || ece.is_null();
        minus_one(if bad { libc::EINVAL } else { libc::EOPNOTSUPP })
    })
}

/// Reject a connection request with `reason`.
///
/// # Safety
/// `id` is a live id; `private_data` points at `private_data_len` bytes (or is null).
unsafe fn reject_with(
    id: *mut abi::rdma_cm_id,
    private_data: *const c_void,
    private_data_len: u8,
    reason: u16,
) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live id and private data of the given length.
        done(
            unsafe {
                with_id(id, |me| {
                    let pd = if private_data.is_null() || private_data_len == 0 {
                        &[][..]
                    } else {
                        std::slice::from_raw_parts(
                            private_data.cast::<u8>(),
                            usize::from(private_data_len),
                        )
                    };
                    me.model(|c, now, h| c.reject_with_reason(now, h, reason, pd))
                })
            }
            .map(|()| 0),
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn rdma_disconnect(id: *mut abi::rdma_cm_id) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live id.
        let r = unsafe {
            with_id(id, |me| {
                if me.c.verbs.is_null() {
                    return Err(libc::EINVAL);
                }
                // The QP stops first (it flushes), then the DREQ (or DREP) goes out.
                qp::modify_qp_err(me)?;
                me.model(|c, now, h| c.disconnect(now, h))
            })
        };
        // SAFETY: as above.
        done(r.map(|()| unsafe { complete(id) }))
    })
}

/// The active side completes a connection whose QP the program drives itself: the RTU
/// goes out (`rdma_establish`, for ids without a QP after CONNECT_RESPONSE).
#[no_mangle]
pub unsafe extern "C" fn rdma_establish(id: *mut abi::rdma_cm_id) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live id.
        done(
            unsafe {
                with_id(id, |me| {
                    if !me.c.qp.is_null() {
                        return Err(libc::EINVAL);
                    }
                    conn::complete_connect(me.cm.agent(), me.handle, None, qp::modifier(me), || {})
                        .map_err(|qp::Errno(e)| e)
                })
            }
            .map(|()| 0),
        )
    })
}

/// `rdma_notify`: the QP's COMM_EST event (a packet arrived before the RTU) establishes
/// the connection; other events are not the CM's (EINVAL, as Linux's `ib_cm_notify`
/// answers all but path migration, and there are no alternate paths here).
#[no_mangle]
pub unsafe extern "C" fn rdma_notify(
    id: *mut abi::rdma_cm_id,
    event: sys::ibv_event_type,
) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live id.
        done(
            unsafe {
                with_id(id, |me| {
                    if event != sys::IBV_EVENT_COMM_EST {
                        return Err(libc::EINVAL);
                    }
                    me.model(|c, now, h| c.establish(now, h))
                })
            }
            .map(|()| 0),
        )
    })
}
