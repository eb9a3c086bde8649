//! Queue pairs: creating, modifying, querying and destroying them. Posting to them is in
//! `post` (`ibv_post_send`, `ibv_post_recv`, and `ibv_bind_mw`, a work request on the send
//! queue) and `wr` (the `ibv_wr_*` API of `ibv_qp_ex`).

pub(crate) mod post;
mod wr;

pub(crate) use post::{bind_mw, post_recv, post_send};

use std::ffi::{c_int, c_void};

use softrdma_device::verbs::{
    self, Access, Mtu, QpAttr, QpAttrMask, QpCap, QpInitAttr, QpState, QpType,
};
use softrdma_device::Rnic;

use crate::ah::{ah_from_c, ah_to_c};
use crate::cq::Cq;
use crate::device::Ctx;
use crate::object::{ctx_of, destroy, errno, leak, obj, Destroy};
use crate::pd::{pd_ctx, Pd};
use crate::srq::Srq;
use crate::{guard, null_errno, sys, zeroed};

/// A QP. Always an `ibv_qp_ex` (whose head is `ibv_qp`), so `ibv_qp_to_qp_ex` returns
/// the same object.
#[repr(C)]
pub(crate) struct Qp {
    pub(crate) c: sys::ibv_qp_ex,
    pub(crate) qpn: u32,
    pub(crate) qp_type: QpType,
    /// The work request being built with the `ibv_wr_*` API.
    pub(crate) wr: std::cell::UnsafeCell<wr::WrBuild>,
}

impl Destroy for Qp {
    type C = sys::ibv_qp;
    fn context(&self) -> *mut sys::ibv_context {
        self.c.qp_base.context
    }
    fn destroy_verbs(&self, r: &mut Rnic) -> verbs::Result<()> {
        r.destroy_qp(self.qpn)
    }
    fn pd(&self) -> *mut sys::ibv_pd {
        self.c.qp_base.pd
    }
    fn unregister(&self, ctx: &Ctx) {
        ctx.shared.registry().qps.remove(&self.qpn);
    }
}

impl Qp {
    pub(crate) fn ctx(&self) -> Option<&Ctx> {
        // SAFETY: a QP's context is a live context.
        unsafe { ctx_of(self.c.qp_base.context) }
    }
}

fn qp_type(t: u32) -> Result<QpType, c_int> {
    match t {
        sys::IBV_QPT_RC => Ok(QpType::Rc),
        sys::IBV_QPT_UC => Ok(QpType::Uc),
        sys::IBV_QPT_UD => Ok(QpType::Ud),
        _ => Err(libc::EOPNOTSUPP),
    }
}

fn qp_state(s: u32) -> Result<QpState, c_int> {
    Ok(match s {
        0 => QpState::Reset,
        1 => QpState::Init,
        2 => QpState::Rtr,
        3 => QpState::Rts,
        4 => QpState::Sqd,
        5 => QpState::Sqe,
        6 => QpState::Err,
        _ => return Err(libc::EINVAL),
    })
}

fn cap_from_c(c: &sys::ibv_qp_cap) -> QpCap {
    QpCap {
        max_send_wr: c.max_send_wr,
        max_recv_wr: c.max_recv_wr,
        max_send_sge: c.max_send_sge,
        max_recv_sge: c.max_recv_sge,
        max_inline_data: c.max_inline_data,
    }
}

fn cap_to_c(c: &QpCap) -> sys::ibv_qp_cap {
    sys::ibv_qp_cap {
        max_send_wr: c.max_send_wr,
        max_recv_wr: c.max_recv_wr,
        max_send_sge: c.max_send_sge,
        max_recv_sge: c.max_recv_sge,
        max_inline_data: c.max_inline_data,
    }
}

/// Create a QP object (shared by `ibv_create_qp` and `ibv_create_qp_ex`).
#[allow(clippy::too_many_arguments)]
fn create_qp_obj(
    ctx: &Ctx,
    pd: *mut sys::ibv_pd,
    qp_context: *mut c_void,
    send_cq: *mut sys::ibv_cq,
    recv_cq: *mut sys::ibv_cq,
    srq: *mut sys::ibv_srq,
    cap: &mut sys::ibv_qp_cap,
    qp_type_raw: u32,
    sq_sig_all: bool,
) -> Result<*mut Qp, c_int> {
    // SAFETY: the caller passes objects of this library (or null where optional).
    let (p, scq, rcq) = unsafe {
        (
            obj::<Pd, _>(pd).ok_or(libc::EINVAL)?,
            obj::<Cq, _>(send_cq).ok_or(libc::EINVAL)?,
            obj::<Cq, _>(recv_cq).ok_or(libc::EINVAL)?,
        )
    };
    let srq_id = if srq.is_null() {
        None
    } else {
        // SAFETY: as above.
        Some(unsafe { obj::<Srq, _>(srq) }.ok_or(libc::EINVAL)?.id)
    };
    let t = qp_type(qp_type_raw)?;
    let init = QpInitAttr {
        qp_type: t,
        pd: p.id,
        send_cq: scq.id,
        recv_cq: rcq.id,
        srq: srq_id,
        cap: cap_from_c(cap),
        sq_sig_all,
    };
    let (qpn, actual) = ctx.dev().create_qp(init).map_err(|e| errno(&e))?;
    *cap = cap_to_c(&actual);
    let mut c: sys::ibv_qp_ex = zeroed();
    let b = &mut c.qp_base;
    b.context = ctx.c_ptr();
    b.qp_context = qp_context;
    b.pd = pd;
    b.send_cq = send_cq;
    b.recv_cq = recv_cq;
    b.srq = srq;
    b.handle = qpn;
    b.qp_num = qpn;
    b.state = sys::IBV_QPS_RESET;
    b.qp_type = qp_type_raw;
    wr::init_qp_ex(&mut c);
    // SAFETY: `pd` is the live PD the QP was made in.
    unsafe { crate::pd::hold(pd) };
    let q = leak(Qp {
        c,
        qpn,
        qp_type: t,
        wr: Default::default(),
    });
    ctx.shared.registry().qps.insert(qpn, q as usize);
    Ok(q)
}

#[no_mangle]
pub unsafe extern "C" fn ibv_create_qp(
    pd: *mut sys::ibv_pd,
    init: *mut sys::ibv_qp_init_attr,
) -> *mut sys::ibv_qp {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the caller passes a PD of this library.
        let Some((_, ctx)) = (unsafe { pd_ctx(pd) }) else {
            return null_errno(libc::EINVAL);
        };
        if init.is_null() {
            return null_errno(libc::EINVAL);
        }
        // SAFETY: `init` points at the caller's attributes.
        let i = unsafe { &mut *init };
        match create_qp_obj(
            ctx,
            pd,
            i.qp_context,
            i.send_cq,
            i.recv_cq,
            i.srq,
            &mut i.cap,
            i.qp_type,
            i.sq_sig_all != 0,
        ) {
            Ok(q) => q.cast(),
            Err(e) => null_errno(e),
        }
    })
}

/// `verbs_context.create_qp_ex`.
pub(crate) unsafe extern "C" fn create_qp_ex(
    context: *mut sys::ibv_context,
    attr: *mut sys::ibv_qp_init_attr_ex,
) -> *mut sys::ibv_qp {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the caller passes a live context.
        let Some(ctx) = (unsafe { ctx_of(context) }) else {
            return null_errno(libc::EINVAL);
        };
        if attr.is_null() {
            return null_errno(libc::EINVAL);
        }
        // SAFETY: `attr` points at the caller's attributes.
        let a = unsafe { &mut *attr };
        let known = sys::IBV_QP_INIT_ATTR_PD
            | sys::IBV_QP_INIT_ATTR_SEND_OPS_FLAGS
            | sys::IBV_QP_INIT_ATTR_CREATE_FLAGS;
        if a.comp_mask & !known != 0 {
            return null_errno(libc::EOPNOTSUPP);
        }
        // Creation flags ask for hardware behaviours (scatter FCS, VLAN stripping, a
        // source QPN, …) softrdma has none of; no flags asks for nothing, and is what a
        // program that always sets the mask bit passes by default.
        if a.comp_mask & sys::IBV_QP_INIT_ATTR_CREATE_FLAGS != 0 && a.create_flags != 0 {
            return null_errno(libc::EOPNOTSUPP);
        }
        if a.comp_mask & sys::IBV_QP_INIT_ATTR_PD == 0 || a.pd.is_null() {
            return null_errno(libc::EINVAL);
        }
        let ops_ok = (sys::IBV_QP_EX_WITH_ATOMIC_WRITE | sys::IBV_QP_EX_WITH_TSO) as u64;
        if a.comp_mask & sys::IBV_QP_INIT_ATTR_SEND_OPS_FLAGS != 0 && a.send_ops_flags & ops_ok != 0
        {
            return null_errno(libc::EOPNOTSUPP);
        }
        match create_qp_obj(
            ctx,
            a.pd,
            a.qp_context,
            a.send_cq,
            a.recv_cq,
            a.srq,
            &mut a.cap,
            a.qp_type,
            a.sq_sig_all != 0,
        ) {
            Ok(q) => q.cast(),
            Err(e) => null_errno(e),
        }
    })
}

/// Translate `ibv_qp_attr` for `mask`; enums are read only where the mask names them.
fn qp_attr_from_c(a: &sys::ibv_qp_attr, mask: QpAttrMask) -> Result<QpAttr, c_int> {
    let mut o = QpAttr {
        qkey: a.qkey,
        rq_psn: a.rq_psn,
        sq_psn: a.sq_psn,
        dest_qp_num: a.dest_qp_num,
        qp_access_flags: Access::from_bits_truncate(a.qp_access_flags),
        cap: cap_from_c(&a.cap),
        pkey_index: a.pkey_index,
        en_sqd_async_notify: a.en_sqd_async_notify != 0,
        max_rd_atomic: a.max_rd_atomic,
        max_dest_rd_atomic: a.max_dest_rd_atomic,
        min_rnr_timer: a.min_rnr_timer,
        port_num: a.port_num,
        timeout: a.timeout,
        retry_cnt: a.retry_cnt,
        rnr_retry: a.rnr_retry,
        ..Default::default()
    };
    if mask.contains(QpAttrMask::STATE) {
        o.qp_state = qp_state(a.qp_state)?;
    }
    if mask.contains(QpAttrMask::CUR_STATE) {
        o.cur_qp_state = qp_state(a.cur_qp_state)?;
    }
    if mask.contains(QpAttrMask::PATH_MTU) {
        o.path_mtu = Mtu::from_raw(a.path_mtu).ok_or(libc::EINVAL)?;
    }
    if mask.contains(QpAttrMask::AV) {
        o.ah_attr = ah_from_c(&a.ah_attr);
    }
    Ok(o)
}

#[no_mangle]
pub unsafe extern "C" fn ibv_modify_qp(
    qp: *mut sys::ibv_qp,
    attr: *mut sys::ibv_qp_attr,
    mask: c_int,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: the caller passes a QP of this library.
        let Some(q) = (unsafe { obj::<Qp, _>(qp) }) else {
            return libc::EINVAL;
        };
        let Some(ctx) = q.ctx() else {
            return libc::EINVAL;
        };
        if attr.is_null() {
            return libc::EINVAL;
        }
        let m = mask as u32;
        if m & sys::IBV_QP_RATE_LIMIT != 0 {
            return libc::EOPNOTSUPP;
        }
        let Some(vm) = QpAttrMask::from_bits(m) else {
            return libc::EINVAL;
        };
        // SAFETY: `attr` points at the caller's attributes.
        let a = match qp_attr_from_c(unsafe { &*attr }, vm) {
            Ok(a) => a,
            Err(e) => return e,
        };
        let qpn = q.qpn;
        let r = ctx.dev().modify_qp(qpn, &a, vm);
        match r {
            Ok(()) => {
                if vm.contains(QpAttrMask::STATE) {
                    // SAFETY: `qp` is live; `state` is the program-visible copy.
                    unsafe { (*qp).state = a.qp_state as u32 };
                }
                0
            }
            Err(e) => errno(&e),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_qp(
    qp: *mut sys::ibv_qp,
    attr: *mut sys::ibv_qp_attr,
    _mask: c_int,
    init: *mut sys::ibv_qp_init_attr,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: the caller passes a QP of this library.
        let Some(q) = (unsafe { obj::<Qp, _>(qp) }) else {
            return libc::EINVAL;
        };
        let Some(ctx) = q.ctx() else {
            return libc::EINVAL;
        };
        if attr.is_null() || init.is_null() {
            return libc::EINVAL;
        }
        let qpn = q.qpn;
        let r = ctx.dev().read(|r| {
            let a = r.query_qp(qpn)?;
            let i = r.qp_init_attr(qpn)?;
            Ok::<_, verbs::Error>((a, i))
        });
        let (a, i) = match r {
            Ok(v) => v,
            Err(e) => return errno(&e),
        };
        let mut o: sys::ibv_qp_attr = zeroed();
        o.qp_state = a.qp_state as u32;
        o.cur_qp_state = a.cur_qp_state as u32;
        o.path_mtu = a.path_mtu as u32;
        o.path_mig_state = sys::IBV_MIG_MIGRATED;
        o.qkey = a.qkey;
        o.rq_psn = a.rq_psn;
        o.sq_psn = a.sq_psn;
        o.dest_qp_num = a.dest_qp_num;
        o.qp_access_flags = a.qp_access_flags.bits();
        o.cap = cap_to_c(&i.cap);
        o.ah_attr = ah_to_c(&a.ah_attr);
        o.pkey_index = a.pkey_index;
        o.en_sqd_async_notify = a.en_sqd_async_notify as u8;
        o.sq_draining = a.sq_draining as u8;
        o.max_rd_atomic = a.max_rd_atomic;
        o.max_dest_rd_atomic = a.max_dest_rd_atomic;
        o.min_rnr_timer = a.min_rnr_timer;
        o.port_num = a.port_num;
        o.timeout = a.timeout;
        o.retry_cnt = a.retry_cnt;
        o.rnr_retry = a.rnr_retry;
        // SAFETY: `qp`, `attr` and `init` are live; the base fields are read as stored.
        unsafe {
            let b = &*qp;
            attr.write(o);
            let mut ia: sys::ibv_qp_init_attr = zeroed();
            ia.qp_context = b.qp_context;
            ia.send_cq = b.send_cq;
            ia.recv_cq = b.recv_cq;
            ia.srq = b.srq;
            ia.cap = cap_to_c(&i.cap);
            ia.qp_type = b.qp_type;
            ia.sq_sig_all = i.sq_sig_all as c_int;
            init.write(ia);
            (*qp).state = a.qp_state as u32;
        }
        0
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_qp(qp: *mut sys::ibv_qp) -> c_int {
    // SAFETY: the caller passes a QP of this library and does not use it once destroyed.
    unsafe { destroy::<Qp>(qp) }
}

/// The QP and the GID behind `ibv_attach_mcast` / `ibv_detach_mcast`'s pointers, or
/// EINVAL.
///
/// # Safety
/// `qp` is null or a live QP of this library; `gid` is null or points to an `ibv_gid`.
unsafe fn mcast_args<'a>(
    qp: *mut sys::ibv_qp,
    gid: *const sys::ibv_gid,
) -> Result<(&'a Qp, &'a Ctx, verbs::Gid), c_int> {
    // SAFETY: per the contract.
    let q = unsafe { obj::<Qp, _>(qp) }.ok_or(libc::EINVAL)?;
    let ctx = q.ctx().ok_or(libc::EINVAL)?;
    if gid.is_null() {
        return Err(libc::EINVAL);
    }
    // SAFETY: non-null (checked), and the caller's `ibv_gid` is 16 plain bytes, every
    // bit pattern a valid `raw`.
    let raw = unsafe { (*gid).raw };
    Ok((q, ctx, verbs::Gid(raw)))
}

/// `ibv_attach_mcast`: the UD QP receives a copy of every SEND to the multicast group
/// `gid` (`::ffff:a.b.c.d` for an IPv4 group); `lid` is ignored, as on any RoCE device.
/// The device joins the group on its interface before this returns. 0 or an errno:
/// EINVAL for a QP that is not UD, a GID that is not multicast, or a group the device
/// cannot join; ENOMEM past the device's `max_mcast_*` limits. Attaching twice is 0.
#[no_mangle]
pub unsafe extern "C" fn ibv_attach_mcast(
    qp: *mut sys::ibv_qp,
    gid: *const sys::ibv_gid,
    lid: u16,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: the caller passes a QP of this library and a GID.
        let (q, ctx, mgid) = match unsafe { mcast_args(qp, gid) } {
            Ok(v) => v,
            Err(e) => return e,
        };
        match ctx.dev().attach_mcast(q.qpn, mgid, lid) {
            Ok(()) => 0,
            Err(e) => errno(&e),
        }
    })
}

/// `ibv_detach_mcast`: undo `ibv_attach_mcast` (the device leaves the group with its
/// last QP). 0 or an errno: EINVAL when the QP is not attached to `gid`.
#[no_mangle]
pub unsafe extern "C" fn ibv_detach_mcast(
    qp: *mut sys::ibv_qp,
    gid: *const sys::ibv_gid,
    lid: u16,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: the caller passes a QP of this library and a GID.
        let (q, ctx, mgid) = match unsafe { mcast_args(qp, gid) } {
            Ok(v) => v,
            Err(e) => return e,
        };
        match ctx.dev().detach_mcast(q.qpn, mgid, lid) {
            Ok(()) => 0,
            Err(e) => errno(&e),
        }
    })
}

/// Every QP is an `ibv_qp_ex` with the `ibv_wr_*` API set.
#[no_mangle]
pub unsafe extern "C" fn ibv_qp_to_qp_ex(qp: *mut sys::ibv_qp) -> *mut sys::ibv_qp_ex {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the caller passes a QP of this library.
        match unsafe { obj::<Qp, _>(qp) } {
            Some(q) if q.qp_type != QpType::Ud || !qp.is_null() => qp.cast(),
            _ => null_errno(libc::EINVAL),
        }
    })
}
