//! Device memory (`ibv_alloc_dm`) and memory regions over it.

use std::ffi::{c_int, c_void};

use softrdma_device::verbs::{self, DmId};
use softrdma_device::Rnic;

use crate::device::Ctx;
use crate::mr::{access_flags, Mr, MrKind};
use crate::object::{ctx_of, destroy, errno, leak, obj, unimport, Destroy};
use crate::pd::pd_ctx;
use crate::{guard, null_errno, sys, zeroed};

#[repr(C)]
pub(crate) struct Dm {
    pub(crate) c: sys::ibv_dm,
    pub(crate) id: DmId,
}

impl Destroy for Dm {
    type C = sys::ibv_dm;
    fn context(&self) -> *mut sys::ibv_context {
        self.c.context
    }
    fn destroy_verbs(&self, r: &mut Rnic) -> verbs::Result<()> {
        r.free_dm(self.id)
    }
}

fn dm_parts<'a>(dm: *mut sys::ibv_dm) -> Option<(&'a Dm, &'a Ctx)> {
    // SAFETY: the caller passes a DM of this library.
    let d: &Dm = unsafe { obj(dm) }?;
    // SAFETY: a DM's context is a live context.
    let ctx = unsafe { ctx_of(d.c.context) }?;
    Some((d, ctx))
}

pub(crate) unsafe extern "C" fn alloc_dm(
    context: *mut sys::ibv_context,
    attr: *mut sys::ibv_alloc_dm_attr,
) -> *mut sys::ibv_dm {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the caller passes a live context.
        let Some(ctx) = (unsafe { ctx_of(context) }) else {
            return null_errno(libc::EINVAL);
        };
        if attr.is_null() {
            return null_errno(libc::EINVAL);
        }
        // SAFETY: `attr` points at the caller's attributes.
        let a = unsafe { *attr };
        if a.comp_mask != 0 {
            return null_errno(libc::EINVAL);
        }
        match ctx.dev().alloc_dm(a.length) {
            Ok(id) => new_dm(context, id),
            Err(e) => null_errno(errno(&e)),
        }
    })
}

fn new_dm(context: *mut sys::ibv_context, id: DmId) -> *mut sys::ibv_dm {
    let mut c: sys::ibv_dm = zeroed();
    c.context = context;
    c.memcpy_to_dm = Some(memcpy_to_dm);
    c.memcpy_from_dm = Some(memcpy_from_dm);
    c.handle = id.0;
    leak(Dm { c, id }).cast()
}

/// Another handle on the device memory `dm_handle` (an `ibv_dm::handle`) of the objects
/// `context` shares with the context it was imported from or into (see
/// `ibv_import_device`). EINVAL when no such device memory exists.
#[no_mangle]
pub unsafe extern "C" fn ibv_import_dm(
    context: *mut sys::ibv_context,
    dm_handle: u32,
) -> *mut sys::ibv_dm {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the caller passes a live context.
        let Some(ctx) = (unsafe { ctx_of(context) }) else {
            return null_errno(libc::EINVAL);
        };
        let id = DmId(dm_handle);
        match ctx.dev().dm_len(id) {
            Ok(_) => new_dm(context, id),
            Err(e) => null_errno(errno(&e)),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_unimport_dm(dm: *mut sys::ibv_dm) {
    // SAFETY: the caller passes an imported DM of this library and does not use it again.
    unsafe { unimport::<Dm>(dm) }
}

pub(crate) unsafe extern "C" fn free_dm(dm: *mut sys::ibv_dm) -> c_int {
    // SAFETY: the caller passes a DM of this library and does not use it once destroyed.
    unsafe { destroy::<Dm>(dm) }
}

unsafe extern "C" fn memcpy_to_dm(
    dm: *mut sys::ibv_dm,
    offset: u64,
    host: *const c_void,
    length: usize,
) -> c_int {
    guard(libc::EIO, || {
        let Some((d, ctx)) = dm_parts(dm) else {
            return libc::EINVAL;
        };
        if length > 0 && host.is_null() {
            return libc::EINVAL;
        }
        let data = if length == 0 {
            &[][..]
        } else {
            // SAFETY: the caller's buffer holds `length` readable bytes.
            unsafe { std::slice::from_raw_parts(host.cast::<u8>(), length) }
        };
        let id = d.id;
        match ctx.dev().dm_copy_to(id, offset, data) {
            Ok(()) => 0,
            Err(e) => errno(&e),
        }
    })
}

unsafe extern "C" fn memcpy_from_dm(
    host: *mut c_void,
    dm: *mut sys::ibv_dm,
    offset: u64,
    length: usize,
) -> c_int {
    guard(libc::EIO, || {
        let Some((d, ctx)) = dm_parts(dm) else {
            return libc::EINVAL;
        };
        if length > 0 && host.is_null() {
            return libc::EINVAL;
        }
        let mut buf = vec![0u8; length];
        let id = d.id;
        match ctx.dev().dm_copy_from(id, offset, &mut buf) {
            Ok(()) => {
                // SAFETY: the caller's buffer holds `length` writable bytes.
                unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr(), host.cast::<u8>(), length) };
                0
            }
            Err(e) => errno(&e),
        }
    })
}

pub(crate) unsafe extern "C" fn reg_dm_mr(
    pd: *mut sys::ibv_pd,
    dm: *mut sys::ibv_dm,
    offset: u64,
    length: usize,
    access: u32,
) -> *mut sys::ibv_mr {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the caller passes a PD of this library.
        let Some((p, ctx)) = (unsafe { pd_ctx(pd) }) else {
            return null_errno(libc::EINVAL);
        };
        let Some((d, _)) = dm_parts(dm) else {
            return null_errno(libc::EINVAL);
        };
        // verbs.h: device memory MRs are zero-based.
        if access & sys::IBV_ACCESS_ZERO_BASED == 0 {
            return null_errno(libc::EINVAL);
        }
        let acc = match access_flags(access) {
            Ok(a) => a,
            Err(e) => return null_errno(e),
        };
        let (pid, did) = (p.id, d.id);
        match ctx.dev().reg_dm_mr(pid, did, offset, length, acc) {
            Ok(info) => {
                let mut c: sys::ibv_mr = zeroed();
                c.context = p.c.context;
                c.pd = pd;
                c.addr = std::ptr::null_mut();
                c.length = length;
                c.handle = info.lkey;
                c.lkey = info.lkey;
                c.rkey = info.rkey;
                // SAFETY: `pd` is the live PD the region was made in.
                unsafe { crate::pd::hold(pd) };
                leak(Mr {
                    c,
                    lkey: info.lkey,
                    kind: MrKind::Dm,
                })
                .cast()
            }
            Err(e) => null_errno(errno(&e)),
        }
    })
}
