//! Protection domains.

use std::ffi::c_int;

use softrdma_device::verbs::{self, PdId};
use softrdma_device::Rnic;

use crate::device::Ctx;
use crate::object::{ctx_of, destroy, errno, leak, obj, unimport, Destroy};
use crate::{guard, null_errno, sys, zeroed};

#[repr(C)]
pub(crate) struct Pd {
    pub(crate) c: sys::ibv_pd,
    pub(crate) id: PdId,
}

impl Destroy for Pd {
    type C = sys::ibv_pd;
    fn context(&self) -> *mut sys::ibv_context {
        self.c.context
    }
    fn destroy_verbs(&self, r: &mut Rnic) -> verbs::Result<()> {
        r.dealloc_pd(self.id)
    }
}

/// The PD and its context behind an `ibv_pd *`.
pub(crate) unsafe fn pd_ctx<'a>(pd: *mut sys::ibv_pd) -> Option<(&'a Pd, &'a Ctx)> {
    // SAFETY: the caller passes a PD of this library.
    let pd: &Pd = unsafe { obj(pd) }?;
    // SAFETY: a PD's context is a live context.
    let ctx = unsafe { ctx_of(pd.c.context) }?;
    Some((pd, ctx))
}

#[no_mangle]
pub unsafe extern "C" fn ibv_alloc_pd(context: *mut sys::ibv_context) -> *mut sys::ibv_pd {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the caller passes a live context.
        let Some(ctx) = (unsafe { ctx_of(context) }) else {
            return null_errno(libc::EINVAL);
        };
        match ctx.dev().call(|r, _| r.alloc_pd()) {
            Ok(id) => {
                let mut c: sys::ibv_pd = zeroed();
                c.context = context;
                c.handle = id.0;
                leak(Pd { c, id }).cast()
            }
            Err(e) => null_errno(errno(&e)),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_dealloc_pd(pd: *mut sys::ibv_pd) -> c_int {
    // SAFETY: the caller passes a PD of this library and does not use it once destroyed.
    unsafe { destroy::<Pd>(pd) }
}

/// Another handle on the PD `pd_handle` (an `ibv_pd::handle`) of the objects `context`
/// shares with the context it was imported from or into (see `ibv_import_device`).
/// `ibv_dealloc_pd` of it frees the PD; `ibv_unimport_pd` only the handle. EINVAL when no
/// such PD exists.
#[no_mangle]
pub unsafe extern "C" fn ibv_import_pd(
    context: *mut sys::ibv_context,
    pd_handle: u32,
) -> *mut sys::ibv_pd {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the caller passes a live context.
        let Some(ctx) = (unsafe { ctx_of(context) }) else {
            return null_errno(libc::EINVAL);
        };
        let id = PdId(pd_handle);
        if !ctx.dev().inspect(|r| r.pd_exists(id)) {
            return null_errno(libc::EINVAL);
        }
        let mut c: sys::ibv_pd = zeroed();
        c.context = context;
        c.handle = pd_handle;
        leak(Pd { c, id }).cast()
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_unimport_pd(pd: *mut sys::ibv_pd) {
    // SAFETY: the caller passes an imported PD of this library and does not use it again.
    unsafe { unimport::<Pd>(pd) }
}
