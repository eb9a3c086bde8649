//! Memory windows. Binding one is a work request on a send queue: `ibv_bind_mw` and the
//! `IBV_WR_BIND_MW` paths live with the QP and use [`mw_bind`].

use std::ffi::c_int;

use softrdma_device::verbs::{self, Access, MwBind, MwId};
use softrdma_device::Rnic;

use crate::mr::Mr;
use crate::object::{destroy, errno, leak, obj, Destroy};
use crate::pd::pd_ctx;
use crate::{guard, null_errno, sys, zeroed};

/// A memory window.
#[repr(C)]
pub(crate) struct Mw {
    pub(crate) c: sys::ibv_mw,
    pub(crate) id: MwId,
}

impl Destroy for Mw {
    type C = sys::ibv_mw;
    fn context(&self) -> *mut sys::ibv_context {
        self.c.context
    }
    fn destroy_verbs(&self, r: &mut Rnic) -> verbs::Result<()> {
        r.dealloc_mw(self.id)
    }
    fn pd(&self) -> *mut sys::ibv_pd {
        self.c.pd
    }
}

pub(crate) unsafe extern "C" fn alloc_mw(
    pd: *mut sys::ibv_pd,
    mw_type: sys::ibv_mw_type,
) -> *mut sys::ibv_mw {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the caller passes a PD of this library.
        let Some((p, ctx)) = (unsafe { pd_ctx(pd) }) else {
            return null_errno(libc::EINVAL);
        };
        let t = match mw_type {
            sys::IBV_MW_TYPE_1 => 1,
            sys::IBV_MW_TYPE_2 => 2,
            _ => return null_errno(libc::EINVAL),
        };
        let pid = p.id;
        let dev = ctx.dev();
        let r = dev
            .alloc_mw(pid, t)
            .and_then(|id| Ok((id, dev.mw_rkey(id)?)));
        match r {
            Ok((id, rkey)) => {
                let mut c: sys::ibv_mw = zeroed();
                c.context = p.c.context;
                c.pd = pd;
                c.rkey = rkey;
                c.handle = id.0;
                c.type_ = mw_type;
                // SAFETY: `pd` is the live PD the window was made in.
                unsafe { crate::pd::hold(pd) };
                leak(Mw { c, id }).cast()
            }
            Err(e) => null_errno(errno(&e)),
        }
    })
}

pub(crate) unsafe extern "C" fn dealloc_mw(mw: *mut sys::ibv_mw) -> c_int {
    // SAFETY: the caller passes an MW of this library and does not use it once destroyed.
    unsafe { destroy::<Mw>(mw) }
}

/// The window and region of a bind, as the engine names them.
///
/// # Safety
/// `mw` and `mr` are null or objects of this library.
pub(crate) unsafe fn mw_bind(
    mw: *mut sys::ibv_mw,
    rkey: u32,
    info: &sys::ibv_mw_bind_info,
) -> Result<MwBind, c_int> {
    // SAFETY: per the contract.
    let w = unsafe { obj::<Mw, _>(mw) }.ok_or(libc::EINVAL)?;
    let lkey = if info.mr.is_null() {
        0
    } else {
        // SAFETY: per the contract.
        unsafe { obj::<Mr, _>(info.mr) }.ok_or(libc::EINVAL)?.lkey
    };
    Ok(MwBind {
        mw: w.id,
        rkey,
        mr_lkey: lkey,
        addr: info.addr,
        length: info.length,
        access: Access::from_bits_truncate(info.mw_access_flags),
    })
}
