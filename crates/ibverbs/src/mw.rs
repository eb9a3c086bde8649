//! Memory windows. Binding one is a work request on a send queue: `ibv_bind_mw` and the
//! `IBV_WR_BIND_MW` paths live with the QP and use [`mw_bind`].

use std::ffi::c_int;

use softrdma_device::verbs::{self, Access, MwBind, MwId};

use crate::mr::Mr;
use crate::object::{ctx_of, errno, free, leak, obj};
use crate::pd::pd_ctx;
use crate::{guard, null_errno, sys, zeroed};

/// A memory window.
#[repr(C)]
pub(crate) struct Mw {
    pub(crate) c: sys::ibv_mw,
    pub(crate) id: MwId,
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
        let r = ctx.dev().call(|r, _| {
            let c = r;
            let id = c.alloc_mw(pid, t)?;
            Ok::<_, verbs::Error>((id, c.mw_rkey(id)?))
        });
        match r {
            Ok((id, rkey)) => {
                let mut c: sys::ibv_mw = zeroed();
                c.context = p.c.context;
                c.pd = pd;
                c.rkey = rkey;
                c.handle = id.0;
                c.type_ = mw_type;
                leak(Mw { c, id }).cast()
            }
            Err(e) => null_errno(errno(&e)),
        }
    })
}

pub(crate) unsafe extern "C" fn dealloc_mw(mw: *mut sys::ibv_mw) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: the caller passes an MW of this library.
        let Some(w) = (unsafe { obj::<Mw, _>(mw) }) else {
            return libc::EINVAL;
        };
        // SAFETY: an MW's context is a live context.
        let Some(ctx) = (unsafe { ctx_of(w.c.context) }) else {
            return libc::EINVAL;
        };
        let id = w.id;
        match ctx.dev().call(|r, _| r.dealloc_mw(id)) {
            Ok(()) => {
                // SAFETY: allocated by alloc_mw as an Mw, freed once.
                unsafe { free::<Mw, _>(mw) };
                0
            }
            Err(e) => errno(&e),
        }
    })
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
