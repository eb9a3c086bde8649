//! QPs and SRQs of CM ids (`rdma_create_qp`, `rdma_create_srq`, …), the QP moves the CM
//! makes (INIT at creation; RTR and RTS from what the REQ and REP carried; ERR on
//! reject and disconnect), `rdma_init_qp_attr` for programs that move their QPs
//! themselves, and the endpoint calls of `<rdma/rdma_cma.h>`'s synchronous API
//! (`rdma_create_ep`, `rdma_destroy_ep`, `rdma_get_request`).

use std::ffi::{c_int, c_void};

use softrdma_cm::cma::CmaError;
use softrdma_cm::conn::Ready;
use softrdma_device::verbs::{QpAttr, QpAttrMask, QpState};

use super::abi;
use super::event;
use super::id::{self, id_of, CmId};
use crate::ah::ah_to_c;
use crate::{cq, guard, minus_one, qp as vqp, srq, sys, zeroed};

/// The C attributes of the model's.
fn qp_attr_to_c(a: &QpAttr) -> sys::ibv_qp_attr {
    let mut o: sys::ibv_qp_attr = zeroed();
    o.qp_state = a.qp_state as u32;
    o.cur_qp_state = a.cur_qp_state as u32;
    o.path_mtu = a.path_mtu as u32;
    o.qkey = a.qkey;
    o.rq_psn = a.rq_psn;
    o.sq_psn = a.sq_psn;
    o.dest_qp_num = a.dest_qp_num;
    o.qp_access_flags = a.qp_access_flags.bits();
    o.ah_attr = ah_to_c(&a.ah_attr);
    o.pkey_index = a.pkey_index;
    o.max_rd_atomic = a.max_rd_atomic;
    o.max_dest_rd_atomic = a.max_dest_rd_atomic;
    o.min_rnr_timer = a.min_rnr_timer;
    o.port_num = a.port_num;
    o.timeout = a.timeout;
    o.retry_cnt = a.retry_cnt;
    o.rnr_retry = a.rnr_retry;
    o
}

fn state_of(s: u32) -> Option<QpState> {
    Some(match s {
        sys::IBV_QPS_RESET => QpState::Reset,
        sys::IBV_QPS_INIT => QpState::Init,
        sys::IBV_QPS_RTR => QpState::Rtr,
        sys::IBV_QPS_RTS => QpState::Rts,
        sys::IBV_QPS_SQD => QpState::Sqd,
        sys::IBV_QPS_SQE => QpState::Sqe,
        sys::IBV_QPS_ERR => QpState::Err,
        _ => return None,
    })
}

/// What moves the id's QP to `state`, from the model.
fn attr_for(me: &CmId, state: QpState) -> Result<(sys::ibv_qp_attr, c_int), c_int> {
    let (a, m): (QpAttr, QpAttrMask) = me.model(|c, _, h| c.init_qp_attr(h, state))?;
    Ok((qp_attr_to_c(&a), m.bits() as c_int))
}

/// `ibv_modify_qp` on `qp`, as an errno.
fn modify(qp: *mut sys::ibv_qp, a: &mut sys::ibv_qp_attr, mask: c_int) -> Result<(), c_int> {
    // SAFETY: `qp` is a live QP of this library; `a` a valid attribute struct.
    match unsafe { vqp::ibv_modify_qp(qp, a, mask) } {
        0 => Ok(()),
        e => Err(e),
    }
}

/// An errno from a step of the CM layer ([`softrdma_cm::conn`]).
pub(crate) struct Errno(pub(crate) c_int);

impl From<CmaError> for Errno {
    fn from(e: CmaError) -> Errno {
        Errno(e.errno)
    }
}

/// `ibv_modify_qp` on the id's QP with the CM layer's attributes, for its steps. Only
/// for an id with a QP.
pub(crate) fn modifier(me: &CmId) -> impl FnMut(&QpAttr, QpAttrMask) -> Result<(), Errno> + '_ {
    move |a, m| {
        let mut c = qp_attr_to_c(a);
        modify(me.c.qp, &mut c, m.bits() as c_int).map_err(Errno)
    }
}

/// `ready` for an id with a QP; None for one whose program moves its own QP.
pub(crate) fn ready_if_qp(me: &CmId, ready: Ready) -> Option<Ready> {
    (!me.c.qp.is_null()).then_some(ready)
}

/// Move the id's QP to ERR (it flushes its work requests).
pub(crate) fn modify_qp_err(me: &CmId) -> Result<(), c_int> {
    let qp = me.c.qp;
    if qp.is_null() {
        return Ok(());
    }
    let mut a: sys::ibv_qp_attr = zeroed();
    a.qp_state = sys::IBV_QPS_ERR;
    modify(qp, &mut a, sys::IBV_QP_STATE as c_int)
}

/// The attributes that move the id's QP to `qp_attr->qp_state` (INIT, RTR or RTS), for
/// programs that move their QP themselves.
#[no_mangle]
pub unsafe extern "C" fn rdma_init_qp_attr(
    id: *mut abi::rdma_cm_id,
    qp_attr: *mut sys::ibv_qp_attr,
    qp_attr_mask: *mut c_int,
) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live id.
        let Some(me) = (unsafe { id_of(id) }) else {
            return minus_one(libc::EINVAL);
        };
        if qp_attr.is_null() || qp_attr_mask.is_null() {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: `qp_attr` points at the caller's struct.
        let Some(state) = state_of(unsafe { (*qp_attr).qp_state }) else {
            return minus_one(libc::EINVAL);
        };
        match attr_for(me, state) {
            Ok((a, m)) => {
                // SAFETY: both point at the caller's storage.
                unsafe {
                    qp_attr.write(a);
                    qp_attr_mask.write(m);
                }
                0
            }
            Err(e) => minus_one(e),
        }
    })
}

/// librdmacm's `ucma_destroy_cqs`: the CQs and channels the CM made for the id.
///
/// # Safety
/// `id` is a live id; its CQ and channel fields are null or objects this library made.
unsafe fn destroy_cqs(id: *mut abi::rdma_cm_id) {
    // SAFETY: per the contract.
    unsafe {
        let c = &mut *id;
        if !c.recv_cq.is_null() {
            cq::ibv_destroy_cq(c.recv_cq);
            if !c.send_cq.is_null() && c.send_cq != c.recv_cq {
                cq::ibv_destroy_cq(c.send_cq);
            }
            c.send_cq = std::ptr::null_mut();
            c.recv_cq = std::ptr::null_mut();
        } else if !c.send_cq.is_null() {
            cq::ibv_destroy_cq(c.send_cq);
            c.send_cq = std::ptr::null_mut();
        }
        if !c.recv_cq_channel.is_null() {
            cq::ibv_destroy_comp_channel(c.recv_cq_channel);
            if !c.send_cq_channel.is_null() && c.send_cq_channel != c.recv_cq_channel {
                cq::ibv_destroy_comp_channel(c.send_cq_channel);
            }
            c.send_cq_channel = std::ptr::null_mut();
            c.recv_cq_channel = std::ptr::null_mut();
        } else if !c.send_cq_channel.is_null() {
            cq::ibv_destroy_comp_channel(c.send_cq_channel);
            c.send_cq_channel = std::ptr::null_mut();
        }
    }
}

/// One CQ with its completion channel on the id's context, its `cq_context` the id.
///
/// # Safety
/// `id` is a live id with a context.
unsafe fn make_cq(
    id: *mut abi::rdma_cm_id,
    size: u32,
) -> Result<(*mut sys::ibv_comp_channel, *mut sys::ibv_cq), c_int> {
    // SAFETY: per the contract.
    unsafe {
        let verbs = (*id).verbs;
        let ch = cq::ibv_create_comp_channel(verbs);
        if ch.is_null() {
            return Err(crate::errno_now());
        }
        let size = c_int::try_from(size).unwrap_or(c_int::MAX);
        let q = cq::ibv_create_cq(verbs, size, id.cast::<c_void>(), ch, 0);
        if q.is_null() {
            let e = crate::errno_now();
            cq::ibv_destroy_comp_channel(ch);
            return Err(e);
        }
        Ok((ch, q))
    }
}

/// librdmacm's `ucma_create_cqs`.
///
/// # Safety
/// `id` is a live id with a context.
unsafe fn create_cqs(id: *mut abi::rdma_cm_id, send: u32, recv: u32) -> Result<(), c_int> {
    // SAFETY: per the contract.
    unsafe {
        if recv > 0 {
            match make_cq(id, recv) {
                Ok((ch, q)) => {
                    (*id).recv_cq_channel = ch;
                    (*id).recv_cq = q;
                }
                Err(e) => {
                    destroy_cqs(id);
                    return Err(e);
                }
            }
        }
        if send > 0 {
            match make_cq(id, send) {
                Ok((ch, q)) => {
                    (*id).send_cq_channel = ch;
                    (*id).send_cq = q;
                }
                Err(e) => {
                    destroy_cqs(id);
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}

/// Bring a new QP of the id to where librdmacm leaves it: INIT for connected QPs; INIT,
/// RTR and RTS (send PSN 0) for UD QPs.
fn init_qp(me: &CmId, qp: *mut sys::ibv_qp) -> Result<(), c_int> {
    let (mut a, m) = attr_for(me, QpState::Init)?;
    modify(qp, &mut a, m)?;
    if me.c.qp_type != sys::IBV_QPT_UD {
        return Ok(());
    }
    let mut a: sys::ibv_qp_attr = zeroed();
    a.qp_state = sys::IBV_QPS_RTR;
    modify(qp, &mut a, sys::IBV_QP_STATE as c_int)?;
    a.qp_state = sys::IBV_QPS_RTS;
    a.sq_psn = 0;
    modify(
        qp,
        &mut a,
        (sys::IBV_QP_STATE | sys::IBV_QP_SQ_PSN) as c_int,
    )
}

/// See [`rdma_create_qp_ex`].
///
/// # Safety
/// `id` is a live id; `attr` points at the caller's attributes.
unsafe fn create_qp_ex(
    id: *mut abi::rdma_cm_id,
    attr: *mut sys::ibv_qp_init_attr_ex,
) -> Result<(), c_int> {
    // SAFETY: per the contract.
    let me = unsafe { id_of(id) }.ok_or(libc::EINVAL)?;
    if attr.is_null() || !me.c.qp.is_null() || me.c.verbs.is_null() {
        return Err(libc::EINVAL);
    }
    // SAFETY: per the contract.
    let a = unsafe { &mut *attr };
    if a.comp_mask & sys::IBV_QP_INIT_ATTR_PD == 0 || a.pd.is_null() {
        a.comp_mask |= sys::IBV_QP_INIT_ATTR_PD;
        a.pd = me.c.pd;
    } else {
        // SAFETY: the caller's PD is a live PD of this library.
        if unsafe { (*a.pd).context } != me.c.verbs {
            return Err(libc::EINVAL);
        }
    }
    let c = &me.c;
    if (!c.recv_cq.is_null() && !a.recv_cq.is_null() && c.recv_cq != a.recv_cq)
        || (!c.send_cq.is_null() && !a.send_cq.is_null() && c.send_cq != a.send_cq)
    {
        return Err(libc::EINVAL);
    }
    let send = if a.send_cq.is_null() && c.send_cq.is_null() {
        a.cap.max_send_wr
    } else {
        0
    };
    let recv = if a.recv_cq.is_null() && c.recv_cq.is_null() {
        a.cap.max_recv_wr
    } else {
        0
    };
    // SAFETY: the id is live and has a context.
    unsafe { create_cqs(id, send, recv)? };
    // SAFETY: the id is live.
    let c = unsafe { &mut *id };
    if a.send_cq.is_null() {
        a.send_cq = c.send_cq;
    }
    if a.recv_cq.is_null() {
        a.recv_cq = c.recv_cq;
    }
    if !c.srq.is_null() && a.srq.is_null() {
        a.srq = c.srq;
    }
    // SAFETY: the id's context is live; `a` is the caller's attributes.
    let qp = unsafe { vqp::create_qp_ex(c.verbs, a) };
    if qp.is_null() {
        let e = crate::errno_now();
        // SAFETY: the id is live.
        unsafe { destroy_cqs(id) };
        return Err(e);
    }
    if let Err(e) = init_qp(me, qp) {
        // SAFETY: the QP just made, not handed out; the id is live.
        unsafe {
            vqp::ibv_destroy_qp(qp);
            destroy_cqs(id);
        }
        return Err(e);
    }
    // SAFETY: `qp` is live.
    c.pd = unsafe { (*qp).pd };
    c.qp = qp;
    Ok(())
}

/// A QP for the id, on its context, moved to INIT (RTS for UD); CQs with completion
/// channels are made for the queues the attributes give none.
#[no_mangle]
pub unsafe extern "C" fn rdma_create_qp_ex(
    id: *mut abi::rdma_cm_id,
    attr: *mut sys::ibv_qp_init_attr_ex,
) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live id and its attributes.
        match unsafe { create_qp_ex(id, attr) } {
            Ok(()) => 0,
            Err(e) => minus_one(e),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn rdma_create_qp(
    id: *mut abi::rdma_cm_id,
    pd: *mut sys::ibv_pd,
    qp_init_attr: *mut sys::ibv_qp_init_attr,
) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live id.
        let Some(me) = (unsafe { id_of(id) }) else {
            return minus_one(libc::EINVAL);
        };
        if qp_init_attr.is_null() {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: `qp_init_attr` points at the caller's attributes.
        let ia = unsafe { &mut *qp_init_attr };
        let mut ex: sys::ibv_qp_init_attr_ex = zeroed();
        ex.qp_context = ia.qp_context;
        ex.send_cq = ia.send_cq;
        ex.recv_cq = ia.recv_cq;
        ex.srq = ia.srq;
        ex.cap = ia.cap;
        ex.qp_type = ia.qp_type;
        ex.sq_sig_all = ia.sq_sig_all;
        ex.comp_mask = sys::IBV_QP_INIT_ATTR_PD;
        ex.pd = if pd.is_null() { me.c.pd } else { pd };
        // SAFETY: the id is live; `ex` is ours.
        let r = unsafe { create_qp_ex(id, &mut ex) };
        ia.send_cq = ex.send_cq;
        ia.recv_cq = ex.recv_cq;
        ia.srq = ex.srq;
        ia.cap = ex.cap;
        match r {
            Ok(()) => 0,
            Err(e) => minus_one(e),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn rdma_destroy_qp(id: *mut abi::rdma_cm_id) {
    guard((), || {
        // SAFETY: the caller passes a live id.
        if unsafe { id_of(id) }.is_none() {
            return;
        }
        // SAFETY: the id is live; its QP and CQs are this library's or null.
        unsafe {
            if !(*id).qp.is_null() {
                vqp::ibv_destroy_qp((*id).qp);
            }
            (*id).qp = std::ptr::null_mut();
            destroy_cqs(id);
        }
    })
}

/// See [`rdma_create_srq_ex`].
///
/// # Safety
/// `id` is a live id; `attr` the caller's attributes.
unsafe fn create_srq_ex(
    id: *mut abi::rdma_cm_id,
    attr: *mut sys::ibv_srq_init_attr_ex,
) -> Result<(), c_int> {
    // SAFETY: per the contract.
    let me = unsafe { id_of(id) }.ok_or(libc::EINVAL)?;
    if attr.is_null() {
        return Err(libc::EINVAL);
    }
    // SAFETY: per the contract.
    let a = unsafe { &mut *attr };
    if a.comp_mask & sys::IBV_SRQ_INIT_ATTR_TYPE == 0 {
        return Err(libc::EINVAL);
    }
    if a.comp_mask & sys::IBV_SRQ_INIT_ATTR_PD == 0 || a.pd.is_null() {
        a.pd = me.c.pd;
        a.comp_mask |= sys::IBV_SRQ_INIT_ATTR_PD;
    }
    // XRC SRQs (and tag matching) are not supported by softrdma's devices.
    if a.srq_type != sys::IBV_SRQT_BASIC
        || a.comp_mask & !(sys::IBV_SRQ_INIT_ATTR_TYPE | sys::IBV_SRQ_INIT_ATTR_PD) != 0
    {
        return Err(libc::EOPNOTSUPP);
    }
    let mut basic = sys::ibv_srq_init_attr {
        srq_context: a.srq_context,
        attr: a.attr,
    };
    // SAFETY: the PD is the caller's or the id's, live; `basic` is ours.
    let s = unsafe { srq::ibv_create_srq(a.pd, &mut basic) };
    if s.is_null() {
        return Err(crate::errno_now());
    }
    a.attr = basic.attr;
    // SAFETY: the id is live.
    unsafe {
        if (*id).pd.is_null() {
            (*id).pd = a.pd;
        }
        (*id).srq = s;
    }
    Ok(())
}

/// An SRQ for the id's QP (basic SRQs; XRC is EOPNOTSUPP).
#[no_mangle]
pub unsafe extern "C" fn rdma_create_srq_ex(
    id: *mut abi::rdma_cm_id,
    attr: *mut sys::ibv_srq_init_attr_ex,
) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live id and its attributes.
        match unsafe { create_srq_ex(id, attr) } {
            Ok(()) => 0,
            Err(e) => minus_one(e),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn rdma_create_srq(
    id: *mut abi::rdma_cm_id,
    pd: *mut sys::ibv_pd,
    attr: *mut sys::ibv_srq_init_attr,
) -> c_int {
    guard(-1, || {
        if attr.is_null() {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: `attr` points at the caller's attributes.
        let a = unsafe { &mut *attr };
        let mut ex: sys::ibv_srq_init_attr_ex = zeroed();
        ex.srq_context = a.srq_context;
        ex.attr = a.attr;
        ex.comp_mask = sys::IBV_SRQ_INIT_ATTR_TYPE | sys::IBV_SRQ_INIT_ATTR_PD;
        ex.srq_type = sys::IBV_SRQT_BASIC;
        ex.pd = pd;
        // SAFETY: the caller passes a live id; `ex` is ours.
        let r = unsafe { create_srq_ex(id, &mut ex) };
        a.attr = ex.attr;
        match r {
            Ok(()) => 0,
            Err(e) => minus_one(e),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn rdma_destroy_srq(id: *mut abi::rdma_cm_id) {
    guard((), || {
        // SAFETY: the caller passes a live id.
        if unsafe { id_of(id) }.is_none() {
            return;
        }
        // SAFETY: the id is live; its SRQ and CQs are this library's or null.
        unsafe {
            if !(*id).srq.is_null() {
                srq::ibv_destroy_srq((*id).srq);
            }
            (*id).srq = std::ptr::null_mut();
            destroy_cqs(id);
        }
    })
}

/// See [`rdma_create_ep`].
///
/// # Safety
/// `res` points at an `rdma_addrinfo`; `pd` and `qp_init_attr` null or the caller's.
unsafe fn create_ep(
    res: &abi::rdma_addrinfo,
    pd: *mut sys::ibv_pd,
    qp_init_attr: *mut sys::ibv_qp_init_attr,
) -> Result<*mut abi::rdma_cm_id, c_int> {
    let ps = abi::rdma_port_space::try_from(res.ai_port_space).map_err(|_| libc::EINVAL)?;
    let qp_type = sys::ibv_qp_type::try_from(res.ai_qp_type).map_err(|_| libc::EINVAL)?;
    let cm_id = id::create_id(std::ptr::null_mut(), std::ptr::null_mut(), ps, qp_type)?
        .cast::<abi::rdma_cm_id>();
    // SAFETY: `cm_id` is live; the addresses are the caller's.
    let r = unsafe { setup_ep(cm_id, res, pd, qp_init_attr) };
    match r {
        Ok(()) => Ok(cm_id),
        Err(e) => {
            // SAFETY: the id made above, not handed out.
            unsafe { destroy_ep(cm_id) };
            Err(e)
        }
    }
}

/// What `rdma_create_ep` does with its new id: passive (bind, keep the PD and QP
/// attributes for `rdma_get_request`) or active (resolve address and route, make the QP,
/// keep `ai_connect` for the connect).
///
/// # Safety
/// As [`create_ep`]; `cm_id` is live.
unsafe fn setup_ep(
    cm_id: *mut abi::rdma_cm_id,
    res: &abi::rdma_addrinfo,
    pd: *mut sys::ibv_pd,
    qp_init_attr: *mut sys::ibv_qp_init_attr,
) -> Result<(), c_int> {
    let check = |r: c_int| {
        if r == 0 {
            Ok(())
        } else {
            Err(crate::errno_now())
        }
    };
    // SAFETY: per the contract.
    unsafe {
        let me = id_of(cm_id).ok_or(libc::EINVAL)?;
        if res.ai_flags & abi::RAI_PASSIVE != 0 {
            check(id::rdma_bind_addr(cm_id, res.ai_src_addr))?;
            if !pd.is_null() {
                (*cm_id).pd = pd;
            }
            if let Some(qia) = qp_init_attr.as_ref() {
                let mut a = *qia;
                a.qp_type = res.ai_qp_type as sys::ibv_qp_type;
                me.lock().qp_init_attr = Some(a);
            }
            return Ok(());
        }
        check(id::rdma_resolve_addr(
            cm_id,
            res.ai_src_addr,
            res.ai_dst_addr,
            2000,
        ))?;
        if res.ai_route_len > 0 {
            check(id::rdma_set_option(
                cm_id,
                abi::RDMA_OPTION_IB,
                abi::RDMA_OPTION_IB_PATH,
                res.ai_route,
                res.ai_route_len,
            ))?;
            check(id::complete(cm_id))?;
        } else {
            check(id::rdma_resolve_route(cm_id, 2000))?;
        }
        if let Some(qia) = qp_init_attr.as_mut() {
            qia.qp_type = res.ai_qp_type as sys::ibv_qp_type;
            check(rdma_create_qp(cm_id, pd, qia))?;
        }
        if res.ai_connect_len > 0 && !res.ai_connect.is_null() {
            let pd = std::slice::from_raw_parts(res.ai_connect.cast::<u8>(), res.ai_connect_len);
            me.lock().connect = pd.to_vec();
        }
    }
    Ok(())
}

/// A synchronous id from `rdma_getaddrinfo`'s answer: bound (passive) or with its route
/// resolved and its QP made (active).
#[no_mangle]
pub unsafe extern "C" fn rdma_create_ep(
    id: *mut *mut abi::rdma_cm_id,
    res: *mut abi::rdma_addrinfo,
    pd: *mut sys::ibv_pd,
    qp_init_attr: *mut sys::ibv_qp_init_attr,
) -> c_int {
    guard(-1, || {
        if id.is_null() || res.is_null() {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: the caller passes an addrinfo and null or its PD and attributes.
        match unsafe { create_ep(&*res, pd, qp_init_attr) } {
            Ok(p) => {
                // SAFETY: `id` is the caller's out-pointer.
                unsafe { *id = p };
                0
            }
            Err(e) => minus_one(e),
        }
    })
}

/// See [`rdma_destroy_ep`].
///
/// # Safety
/// `id` is a live id, not used again.
unsafe fn destroy_ep(id: *mut abi::rdma_cm_id) {
    // SAFETY: per the contract.
    unsafe {
        if !(*id).qp.is_null() {
            rdma_destroy_qp(id);
        }
        if !(*id).srq.is_null() {
            rdma_destroy_srq(id);
        }
        id::destroy_id(id);
    }
}

/// Destroy an endpoint: its QP, its SRQ and the id.
#[no_mangle]
pub unsafe extern "C" fn rdma_destroy_ep(id: *mut abi::rdma_cm_id) {
    guard((), || {
        // SAFETY: the caller passes a live id and does not use it again.
        if unsafe { id_of(id) }.is_some() {
            // SAFETY: as above.
            unsafe { destroy_ep(id) };
        }
    })
}

/// The next connection request of a synchronous listener, as a new id (with a QP when
/// the listener came from `rdma_create_ep` with QP attributes).
#[no_mangle]
pub unsafe extern "C" fn rdma_get_request(
    listen: *mut abi::rdma_cm_id,
    id: *mut *mut abi::rdma_cm_id,
) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live id.
        let Some(l) = (unsafe { id_of(listen) }) else {
            return minus_one(libc::EINVAL);
        };
        if id.is_null() || !l.lock().sync {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: the listener is live; its pending event and channel are this library's.
        unsafe {
            if !(*listen).event.is_null() {
                event::rdma_ack_cm_event((*listen).event);
                (*listen).event = std::ptr::null_mut();
            }
            let mut ev = std::ptr::null_mut();
            if event::rdma_get_cm_event((*listen).channel, &mut ev) != 0 {
                return -1;
            }
            let e = &*ev;
            let fail = |errno: c_int| {
                (*listen).event = ev;
                minus_one(errno)
            };
            if e.event == abi::RDMA_CM_EVENT_REJECTED {
                return fail(libc::ECONNREFUSED);
            }
            if e.status != 0 {
                return fail(e.status.saturating_abs());
            }
            if e.event != abi::RDMA_CM_EVENT_CONNECT_REQUEST {
                return fail(libc::EINVAL);
            }
            let qia = l.lock().qp_init_attr;
            if let Some(mut a) = qia {
                if rdma_create_qp(e.id, (*listen).pd, &mut a) != 0 {
                    let err = crate::errno_now();
                    return fail(err);
                }
            }
            *id = e.id;
            (*e.id).event = ev;
        }
        0
    })
}
