//! Memory regions, and fork support (which in rdma-core exists for registered memory).

use std::ffi::{c_int, c_void};

use softrdma_device::verbs::{self, Access};
use softrdma_device::Rnic;

use crate::object::{ctx_of, destroy, errno, leak, unimport, Destroy};
use crate::pd::pd_ctx;
use crate::{guard, null_errno, set_errno, sys, zeroed};

/// `IBV_ADVISE_MR_FLAG_FLUSH` (`IB_UVERBS_ADVISE_MR_FLAG_FLUSH` of
/// <infiniband/ib_user_ioctl_verbs.h>, outside the bindings' allowlist): the prefetch is
/// done when the call returns.
const ADVISE_MR_FLAG_FLUSH: u32 = 1;

/// Access bits rdma-core lets a provider ignore (`IBV_ACCESS_OPTIONAL_RANGE`).
const ACCESS_OPTIONAL_RANGE: u32 = 0x3ff0_0000;

#[repr(C)]
pub(crate) struct Mr {
    pub(crate) c: sys::ibv_mr,
    pub(crate) lkey: u32,
    /// What kind of region this handle is (rereg takes only plain ones, as rdma-core).
    pub(crate) kind: MrKind,
}

/// The kinds of `ibv_mr` rdma-core tells apart (`enum ibv_mr_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MrKind {
    /// `ibv_reg_mr` and its variants.
    Plain,
    /// `ibv_import_mr`: another handle on a region of a shared context.
    Imported,
    /// `ibv_reg_dm_mr`: device memory.
    Dm,
}

impl Destroy for Mr {
    type C = sys::ibv_mr;
    fn context(&self) -> *mut sys::ibv_context {
        self.c.context
    }
    fn destroy_verbs(&self, r: &mut Rnic) -> verbs::Result<()> {
        r.dereg_mr(self.lkey)
    }
    fn pd(&self) -> *mut sys::ibv_pd {
        self.c.pd
    }
}

/// Translate `IBV_ACCESS_*` (the engine's bits are the same): optional bits and HUGETLB
/// (a hint about the pages, which a device that does not pin them has no use for) are
/// dropped; an unknown bit is EINVAL.
pub(crate) fn access_flags(access: u32) -> Result<Access, c_int> {
    let a = access & !ACCESS_OPTIONAL_RANGE & !sys::IBV_ACCESS_HUGETLB;
    Access::from_bits(a).ok_or(libc::EINVAL)
}

unsafe fn reg_mr_common(
    pd: *mut sys::ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: u32,
) -> *mut sys::ibv_mr {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the caller passes a PD of this library.
        let Some((p, ctx)) = (unsafe { pd_ctx(pd) }) else {
            return null_errno(libc::EINVAL);
        };
        let acc = match access_flags(access) {
            Ok(a) => a,
            Err(e) => return null_errno(e),
        };
        let id = p.id;
        // SAFETY: the verbs contract of ibv_reg_mr: the program keeps `addr..addr+length`
        // valid until ibv_dereg_mr and accepts that the device reads and writes it at any
        // time meanwhile.
        let r = unsafe { ctx.dev().reg_mr(id, addr.cast(), length, iova, acc) };
        match r {
            Ok(info) => {
                let mut c: sys::ibv_mr = zeroed();
                c.context = p.c.context;
                c.pd = pd;
                c.addr = addr;
                c.length = length;
                c.handle = info.lkey;
                c.lkey = info.lkey;
                c.rkey = info.rkey;
                // SAFETY: `pd` is the live PD the region was made in.
                unsafe { crate::pd::hold(pd) };
                leak(Mr {
                    c,
                    lkey: info.lkey,
                    kind: MrKind::Plain,
                })
                .cast()
            }
            Err(e) => null_errno(errno(&e)),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr(
    pd: *mut sys::ibv_pd,
    addr: *mut c_void,
    length: usize,
    access: c_int,
) -> *mut sys::ibv_mr {
    // SAFETY: forwarded under the caller's contract.
    unsafe { reg_mr_common(pd, addr, length, addr as u64, access as u32) }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr_iova(
    pd: *mut sys::ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: c_int,
) -> *mut sys::ibv_mr {
    // SAFETY: forwarded under the caller's contract.
    unsafe { reg_mr_common(pd, addr, length, iova, access as u32) }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr_iova2(
    pd: *mut sys::ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: u32,
) -> *mut sys::ibv_mr {
    // SAFETY: forwarded under the caller's contract.
    unsafe { reg_mr_common(pd, addr, length, iova, access) }
}

/// Change a region in place: its PD, its memory (`addr`, `length`, addressed as `addr`) or
/// its access, as `flags` say (`IBV_REREG_MR_CHANGE_*`). The keys stay. On an input error
/// `IBV_REREG_MR_ERR_INPUT` with errno EINVAL (flags, arguments or region kind as
/// libibverbs checks them); when the device refuses, `IBV_REREG_MR_ERR_CMD` with its errno
/// (EINVAL, EFAULT for memory that is not backed, EBUSY while windows are bound), and the
/// region is as it was.
#[no_mangle]
pub unsafe extern "C" fn ibv_rereg_mr(
    mr: *mut sys::ibv_mr,
    flags: c_int,
    pd: *mut sys::ibv_pd,
    addr: *mut c_void,
    length: usize,
    access: c_int,
) -> c_int {
    let input = || {
        set_errno(libc::EINVAL);
        sys::IBV_REREG_MR_ERR_INPUT
    };
    guard(sys::IBV_REREG_MR_ERR_INPUT, || {
        if mr.is_null() {
            return input();
        }
        // SAFETY: the caller passes an MR of this library, which no other call uses
        // meanwhile (the verbs' rule for an object being modified).
        let m = unsafe { &mut *mr.cast::<Mr>() };
        let flags = flags as u32;
        if m.kind != MrKind::Plain
            || flags & !sys::IBV_REREG_MR_FLAGS_SUPPORTED != 0
            || (flags & sys::IBV_REREG_MR_CHANGE_TRANSLATION != 0
                && (length == 0 || addr.is_null()))
            || (access != 0 && flags & sys::IBV_REREG_MR_CHANGE_ACCESS == 0)
        {
            return input();
        }
        // SAFETY: an MR's context is a live context.
        let Some(ctx) = (unsafe { ctx_of(m.c.context) }) else {
            return input();
        };
        let new_pd = if flags & sys::IBV_REREG_MR_CHANGE_PD != 0 {
            // SAFETY: the caller passes a PD of this library.
            match unsafe { pd_ctx(pd) } {
                Some((p, _)) if p.c.context == m.c.context => Some(p.id),
                _ => {
                    set_errno(libc::EINVAL);
                    return sys::IBV_REREG_MR_ERR_CMD;
                }
            }
        } else {
            None
        };
        let new_access = if flags & sys::IBV_REREG_MR_CHANGE_ACCESS != 0 {
            match access_flags(access as u32) {
                Ok(a) => Some(a),
                Err(e) => {
                    set_errno(e);
                    return sys::IBV_REREG_MR_ERR_CMD;
                }
            }
        } else {
            None
        };
        let memory = (flags & sys::IBV_REREG_MR_CHANGE_TRANSLATION != 0).then_some((
            addr.cast::<u8>(),
            length,
            addr as u64,
        ));
        let lkey = m.lkey;
        // SAFETY: with new memory, the verbs contract of ibv_rereg_mr: as ibv_reg_mr's for
        // `addr..addr+length`, which the program keeps valid until the region goes.
        let r = unsafe { ctx.dev().rereg_mr(lkey, new_pd, memory, new_access) };
        match r {
            Ok(info) => {
                if flags & sys::IBV_REREG_MR_CHANGE_PD != 0 {
                    // SAFETY: both PDs are live: the new one checked above, the old one
                    // held for this region until now.
                    unsafe {
                        crate::pd::hold(pd);
                        crate::pd::release(m.c.pd);
                    }
                    m.c.pd = pd;
                }
                if flags & sys::IBV_REREG_MR_CHANGE_TRANSLATION != 0 {
                    m.c.addr = addr;
                    m.c.length = length;
                }
                m.c.lkey = info.lkey;
                m.c.rkey = info.rkey;
                0
            }
            Err(e) => {
                set_errno(errno(&e));
                sys::IBV_REREG_MR_ERR_CMD
            }
        }
    })
}

/// `verbs_context.advise_mr`, what the inline `ibv_advise_mr` calls: prefetch the pages
/// of on-demand regions (`IB_UVERBS_ADVISE_MR_ADVICE_PREFETCH`, `_WRITE`, `_NO_FAULT`).
/// With or without `IBV_ADVISE_MR_FLAG_FLUSH` the pages are in when it returns. EINVAL for
/// a bad PD, unknown flags or no SGE; EOPNOTSUPP for another advice; EFAULT for an lkey of
/// no on-demand region of the PD, a range outside its region, a write prefetch without
/// LOCAL_WRITE, or memory the process does not map as asked.
pub(crate) unsafe extern "C" fn advise_mr(
    pd: *mut sys::ibv_pd,
    advice: sys::ib_uverbs_advise_mr_advice,
    flags: u32,
    sg_list: *mut sys::ibv_sge,
    num_sge: u32,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: the caller passes a PD of this library.
        let Some((p, ctx)) = (unsafe { pd_ctx(pd) }) else {
            return libc::EINVAL;
        };
        if flags & !ADVISE_MR_FLAG_FLUSH != 0 || num_sge == 0 || sg_list.is_null() {
            return libc::EINVAL;
        }
        let advice = match advice {
            sys::IB_UVERBS_ADVISE_MR_ADVICE_PREFETCH => verbs::Advice::Prefetch,
            sys::IB_UVERBS_ADVISE_MR_ADVICE_PREFETCH_WRITE => verbs::Advice::PrefetchWrite,
            sys::IB_UVERBS_ADVISE_MR_ADVICE_PREFETCH_NO_FAULT => verbs::Advice::PrefetchNoFault,
            _ => return libc::EOPNOTSUPP,
        };
        // SAFETY: the caller passes `num_sge` SGEs at `sg_list`.
        let c_sges = unsafe { std::slice::from_raw_parts(sg_list, num_sge as usize) };
        let sges: Vec<verbs::Sge> = c_sges
            .iter()
            .map(|s| verbs::Sge {
                addr: s.addr,
                length: s.length,
                lkey: s.lkey,
            })
            .collect();
        let id = p.id;
        let r = ctx
            .dev()
            .read(|r| r.advise_mr(id, advice, &sges))
            .and_then(|prefetch| prefetch.run());
        match r {
            Ok(()) => 0,
            Err(e) => errno(&e),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_dereg_mr(mr: *mut sys::ibv_mr) -> c_int {
    // SAFETY: the caller passes an MR of this library and does not use it once destroyed.
    unsafe { destroy::<Mr>(mr) }
}

// ------------------------------------------------------------------ fork

/// Registered memory is plain process memory read by the device thread; fork needs no
/// special care (a child simply does not see the parent's device).
#[no_mangle]
pub extern "C" fn ibv_fork_init() -> c_int {
    0
}

#[no_mangle]
pub extern "C" fn ibv_is_fork_initialized() -> c_int {
    2 // IBV_FORK_UNNEEDED
}

#[no_mangle]
pub extern "C" fn ibv_dontfork_range(_base: *mut c_void, _size: usize) -> c_int {
    0
}

#[no_mangle]
pub extern "C" fn ibv_dofork_range(_base: *mut c_void, _size: usize) -> c_int {
    0
}

/// Another handle on the MR `mr_handle` (an `ibv_mr::handle`) of `pd`, through a context
/// sharing the MR's objects (see `ibv_import_device`): the keys and length of the MR, and
/// `addr` NULL, as ibv_import_mr(3) says. EINVAL when no such MR exists or it belongs to
/// another PD.
#[no_mangle]
pub unsafe extern "C" fn ibv_import_mr(pd: *mut sys::ibv_pd, mr_handle: u32) -> *mut sys::ibv_mr {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the caller passes a PD of this library.
        let Some((p, ctx)) = (unsafe { pd_ctx(pd) }) else {
            return null_errno(libc::EINVAL);
        };
        let (mr_pd, info) = match ctx.dev().query_mr(mr_handle) {
            Ok(v) => v,
            Err(e) => return null_errno(errno(&e)),
        };
        if mr_pd != p.id {
            return null_errno(libc::EINVAL);
        }
        let mut c: sys::ibv_mr = zeroed();
        c.context = p.c.context;
        c.pd = pd;
        c.addr = std::ptr::null_mut();
        c.length = info.length as usize;
        c.handle = info.lkey;
        c.lkey = info.lkey;
        c.rkey = info.rkey;
        // SAFETY: `pd` is the live PD the handle is made in.
        unsafe { crate::pd::hold(pd) };
        leak(Mr {
            c,
            lkey: info.lkey,
            kind: MrKind::Imported,
        })
        .cast()
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_unimport_mr(mr: *mut sys::ibv_mr) {
    // SAFETY: the caller passes an imported MR of this library and does not use it again.
    unsafe { unimport::<Mr>(mr) }
}
