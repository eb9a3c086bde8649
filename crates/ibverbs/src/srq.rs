//! Shared receive queues and `ibv_post_srq_recv`.

use std::ffi::c_int;

use softrdma_device::verbs::{self, SrqId};
use softrdma_device::Rnic;

use crate::device::Ctx;
use crate::object::{ctx_of, destroy, errno, leak, obj, Destroy};
use crate::pd::pd_ctx;
use crate::wr_list::{finish, recv_wr, walk};
use crate::{guard, null_errno, sys, zeroed};

#[repr(C)]
pub(crate) struct Srq {
    pub(crate) c: sys::ibv_srq,
    pub(crate) id: SrqId,
}

impl Destroy for Srq {
    type C = sys::ibv_srq;
    fn context(&self) -> *mut sys::ibv_context {
        self.c.context
    }
    fn destroy_verbs(&self, r: &mut Rnic) -> verbs::Result<()> {
        r.destroy_srq(self.id)
    }
    fn pd(&self) -> *mut sys::ibv_pd {
        self.c.pd
    }
    fn unregister(&self, ctx: &Ctx) {
        ctx.shared.registry().srqs.remove(&self.id.0);
    }
}

impl Srq {
    pub(crate) fn ctx(&self) -> Option<&Ctx> {
        // SAFETY: an SRQ's context is a live context.
        unsafe { ctx_of(self.c.context) }
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_create_srq(
    pd: *mut sys::ibv_pd,
    init: *mut sys::ibv_srq_init_attr,
) -> *mut sys::ibv_srq {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the caller passes a PD of this library.
        let Some((p, ctx)) = (unsafe { pd_ctx(pd) }) else {
            return null_errno(libc::EINVAL);
        };
        if init.is_null() {
            return null_errno(libc::EINVAL);
        }
        // SAFETY: `init` points at the caller's attributes.
        let init = unsafe { &mut *init };
        let a = init.attr;
        let pid = p.id;
        let dev = ctx.dev();
        let r = dev
            .create_srq(pid, a.max_wr, a.max_sge, a.srq_limit)
            .and_then(|id| Ok((id, dev.query_srq(id)?)));
        match r {
            Ok((id, (max_wr, max_sge, _))) => {
                init.attr.max_wr = max_wr;
                init.attr.max_sge = max_sge;
                let mut c: sys::ibv_srq = zeroed();
                c.context = p.c.context;
                c.srq_context = init.srq_context;
                c.pd = pd;
                c.handle = id.0;
                // SAFETY: `pd` is the live PD the SRQ was made in.
                unsafe { crate::pd::hold(pd) };
                let s = leak(Srq { c, id });
                ctx.shared.registry().srqs.insert(id.0, s as usize);
                s.cast()
            }
            Err(e) => null_errno(errno(&e)),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_modify_srq(
    srq: *mut sys::ibv_srq,
    attr: *mut sys::ibv_srq_attr,
    mask: c_int,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: the caller passes an SRQ of this library.
        let Some(s) = (unsafe { obj::<Srq, _>(srq) }) else {
            return libc::EINVAL;
        };
        let Some(ctx) = s.ctx() else {
            return libc::EINVAL;
        };
        if attr.is_null() || mask as u32 & !(sys::IBV_SRQ_MAX_WR | sys::IBV_SRQ_LIMIT) != 0 {
            return libc::EINVAL;
        }
        // SAFETY: `attr` points at the caller's attributes.
        let a = unsafe { *attr };
        let max_wr = (mask as u32 & sys::IBV_SRQ_MAX_WR != 0).then_some(a.max_wr);
        let limit = (mask as u32 & sys::IBV_SRQ_LIMIT != 0).then_some(a.srq_limit);
        let id = s.id;
        match ctx.dev().modify_srq(id, max_wr, limit) {
            Ok(()) => 0,
            Err(e) => errno(&e),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_srq(
    srq: *mut sys::ibv_srq,
    attr: *mut sys::ibv_srq_attr,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: the caller passes an SRQ of this library.
        let Some(s) = (unsafe { obj::<Srq, _>(srq) }) else {
            return libc::EINVAL;
        };
        let Some(ctx) = s.ctx() else {
            return libc::EINVAL;
        };
        if attr.is_null() {
            return libc::EINVAL;
        }
        let id = s.id;
        match ctx.dev().query_srq(id) {
            Ok((max_wr, max_sge, limit)) => {
                // SAFETY: `attr` points at the caller's attributes.
                unsafe {
                    *attr = sys::ibv_srq_attr {
                        max_wr,
                        max_sge,
                        srq_limit: limit,
                    }
                };
                0
            }
            Err(e) => errno(&e),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_srq(srq: *mut sys::ibv_srq) -> c_int {
    // SAFETY: the caller passes an SRQ of this library and does not use it once destroyed.
    unsafe { destroy::<Srq>(srq) }
}

pub(crate) unsafe extern "C" fn post_srq_recv(
    srq: *mut sys::ibv_srq,
    wr: *mut sys::ibv_recv_wr,
    bad: *mut *mut sys::ibv_recv_wr,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: the caller passes an SRQ of this library.
        let Some(s) = (unsafe { obj::<Srq, _>(srq) }) else {
            return libc::EINVAL;
        };
        let Some(ctx) = s.ctx() else {
            return libc::EINVAL;
        };
        // SAFETY: the caller's list is valid.
        let (wrs, ptrs, conv_err) = unsafe { walk(wr, |w| w.next, recv_wr) };
        let id = s.id;
        let posted = ctx
            .dev()
            .post_srq_recvs(id, wrs)
            .map_err(|(i, e)| (i, errno(&e)));
        // SAFETY: `bad` is the caller's out pointer.
        unsafe { finish(&ptrs, conv_err, posted, bad) }
    })
}
