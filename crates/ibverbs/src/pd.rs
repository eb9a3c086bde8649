//! Protection domains, and the parent and thread domains of the extended verbs.
//!
//! A parent domain (`ibv_alloc_parent_domain`) stands wherever a PD may: it is another
//! `Pd` on its protection domain's engine PD, so every verb that takes a PD works with it
//! unchanged. Its thread domain and allocators are what a provider may use for memory and
//! locking of its own; softrdma keeps no memory that a QP, CQ or SRQ shares with the
//! program or a device (the queues live in the engine), so it never calls the allocators,
//! and it keeps its locks, which a thread domain only allows a provider to drop.

use std::ffi::c_int;
use std::sync::atomic::{AtomicU32, Ordering};

use softrdma_device::verbs::{self, Errno, PdId};
use softrdma_device::Rnic;

use crate::device::Ctx;
use crate::object::{ctx_of, destroy, errno, leak, obj, unimport, Destroy};
use crate::{guard, null_errno, sys, zeroed};

#[repr(C)]
pub(crate) struct Pd {
    pub(crate) c: sys::ibv_pd,
    pub(crate) id: PdId,
    /// For a parent domain: the protection domain it was made on.
    parent_of: Option<ParentOf>,
    /// Parent domains made on this PD: it is not deallocated before they are.
    parents: AtomicU32,
    /// For a parent domain, the objects made in it (MRs, MWs, AHs, SRQs, QPs, CQs): it is
    /// not deallocated before they are, as a PD is not before its objects (the engine
    /// counts those, on the protection domain's engine PD).
    users: AtomicU32,
}

/// What a parent domain was made of.
struct ParentOf {
    /// The protection domain, which outlives it (see `Pd::parents`).
    pd: *const Pd,
    /// Its thread domain, if any, which outlives it (see `Td::users`).
    td: *const Td,
}

impl Pd {
    fn new(c: sys::ibv_pd, id: PdId) -> Pd {
        Pd {
            c,
            id,
            parent_of: None,
            parents: AtomicU32::new(0),
            users: AtomicU32::new(0),
        }
    }
}

impl Destroy for Pd {
    type C = sys::ibv_pd;
    fn context(&self) -> *mut sys::ibv_context {
        self.c.context
    }
    fn destroy_verbs(&self, r: &mut Rnic) -> verbs::Result<()> {
        if let Some(p) = &self.parent_of {
            if self.users.load(Ordering::Acquire) > 0 {
                return Err(verbs::Error::new(
                    Errno::EBUSY,
                    "objects are made in this parent domain",
                ));
            }
            // SAFETY: a parent domain's protection domain and thread domain stay until
            // their counts of it are given back, here.
            unsafe {
                (*p.pd).parents.fetch_sub(1, Ordering::AcqRel);
                if let Some(td) = p.td.as_ref() {
                    td.users.fetch_sub(1, Ordering::AcqRel);
                }
            }
            return Ok(());
        }
        if self.parents.load(Ordering::Acquire) > 0 {
            return Err(verbs::Error::new(
                Errno::EBUSY,
                "parent domains are made on this protection domain",
            ));
        }
        r.dealloc_pd(self.id)
    }
}

/// Count an object made in `pd`, when it is a parent domain (see `Pd::users`).
///
/// # Safety
/// `pd` is null or a live PD of this library.
pub(crate) unsafe fn hold(pd: *mut sys::ibv_pd) {
    // SAFETY: per the contract.
    if let Some(p) = unsafe { obj::<Pd, _>(pd) }.filter(|p| p.parent_of.is_some()) {
        p.users.fetch_add(1, Ordering::AcqRel);
    }
}

/// An object made in `pd` (see [`hold`]) is gone.
///
/// # Safety
/// `pd` is null or a live PD of this library, held for that object.
pub(crate) unsafe fn release(pd: *mut sys::ibv_pd) {
    // SAFETY: per the contract.
    if let Some(p) = unsafe { obj::<Pd, _>(pd) }.filter(|p| p.parent_of.is_some()) {
        p.users.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Whether `pd` is a parent domain of `context` (what `ibv_create_cq_ex` takes with
/// IBV_CQ_INIT_ATTR_MASK_PD).
///
/// # Safety
/// `pd` is null or a PD of this library.
pub(crate) unsafe fn is_parent_domain(
    pd: *mut sys::ibv_pd,
    context: *mut sys::ibv_context,
) -> bool {
    // SAFETY: per the contract.
    unsafe { obj::<Pd, _>(pd) }.is_some_and(|p| p.parent_of.is_some() && p.c.context == context)
}

/// A thread domain (`ibv_alloc_td`): the program's promise that the objects of a parent
/// domain made with it are used by one thread at a time, which lets a provider drop locks.
/// softrdma keeps them; the promise costs nothing to accept.
#[repr(C)]
pub(crate) struct Td {
    c: sys::ibv_td,
    /// Parent domains made with it: it is not deallocated before they are.
    users: AtomicU32,
}

/// `verbs_context.alloc_td`: EINVAL for a `comp_mask` bit.
pub(crate) unsafe extern "C" fn alloc_td(
    context: *mut sys::ibv_context,
    init_attr: *mut sys::ibv_td_init_attr,
) -> *mut sys::ibv_td {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the caller passes a live context.
        if unsafe { ctx_of(context) }.is_none() || init_attr.is_null() {
            return null_errno(libc::EINVAL);
        }
        // SAFETY: `init_attr` points at the caller's attributes.
        if unsafe { (*init_attr).comp_mask } != 0 {
            return null_errno(libc::EINVAL);
        }
        leak(Td {
            c: sys::ibv_td { context },
            users: AtomicU32::new(0),
        })
        .cast()
    })
}

/// `verbs_context.dealloc_td`: EBUSY while a parent domain uses it.
pub(crate) unsafe extern "C" fn dealloc_td(td: *mut sys::ibv_td) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: the caller passes a thread domain of this library.
        let Some(t) = (unsafe { obj::<Td, _>(td) }) else {
            return libc::EINVAL;
        };
        if t.users.load(Ordering::Acquire) > 0 {
            return libc::EBUSY;
        }
        // SAFETY: made by `leak` as a `Td`; the caller does not use it again.
        drop(unsafe { Box::from_raw(td.cast::<Td>()) });
        0
    })
}

/// `verbs_context.alloc_parent_domain`: a parent domain on `attr.pd` (a protection
/// domain of this context), with `attr.td` if set (a thread domain of this context); the
/// allocators and `pd_context` `comp_mask` names are accepted and never called (see the
/// module's note). EINVAL for a missing or foreign PD, a PD that is itself a parent domain, a
/// foreign thread domain or an unknown `comp_mask` bit; `ibv_dealloc_pd` of the protection
/// domain is EBUSY while parent domains are made on it.
pub(crate) unsafe extern "C" fn alloc_parent_domain(
    context: *mut sys::ibv_context,
    attr: *mut sys::ibv_parent_domain_init_attr,
) -> *mut sys::ibv_pd {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the caller passes a live context.
        let Some(ctx) = (unsafe { ctx_of(context) }) else {
            return null_errno(libc::EINVAL);
        };
        if attr.is_null() {
            return null_errno(libc::EINVAL);
        }
        // SAFETY: `attr` points at the caller's attributes.
        let a = unsafe { &*attr };
        let known = sys::IBV_PARENT_DOMAIN_INIT_ATTR_ALLOCATORS
            | sys::IBV_PARENT_DOMAIN_INIT_ATTR_PD_CONTEXT;
        if a.comp_mask & !known != 0 {
            return null_errno(libc::EINVAL);
        }
        // SAFETY: the caller passes a PD of this library.
        let Some((pd, _)) = (unsafe { pd_ctx(a.pd) }) else {
            return null_errno(libc::EINVAL);
        };
        if pd.parent_of.is_some() || pd.c.context != context {
            return null_errno(libc::EINVAL);
        }
        // SAFETY: the caller passes null or a thread domain of this library.
        let td = unsafe { obj::<Td, _>(a.td) };
        if td.is_some_and(|t| t.c.context != context) {
            return null_errno(libc::EINVAL);
        }
        let id = pd.id;
        // Counted under the engine lock, which `ibv_dealloc_pd` of the protection domain
        // checks the count under.
        let live = ctx.dev().read(|r| {
            let live = r.pd_exists(id);
            if live {
                pd.parents.fetch_add(1, Ordering::AcqRel);
                if let Some(t) = td {
                    t.users.fetch_add(1, Ordering::AcqRel);
                }
            }
            live
        });
        if !live {
            return null_errno(libc::EINVAL);
        }
        let mut c: sys::ibv_pd = zeroed();
        c.context = context;
        c.handle = pd.c.handle;
        leak(Pd {
            parent_of: Some(ParentOf {
                pd: std::ptr::from_ref(pd),
                td: td.map_or(std::ptr::null(), std::ptr::from_ref),
            }),
            ..Pd::new(c, id)
        })
        .cast()
    })
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
        match ctx.dev().alloc_pd() {
            Ok(id) => {
                let mut c: sys::ibv_pd = zeroed();
                c.context = context;
                c.handle = id.0;
                leak(Pd::new(c, id)).cast()
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
        if !ctx.dev().pd_exists(id) {
            return null_errno(libc::EINVAL);
        }
        let mut c: sys::ibv_pd = zeroed();
        c.context = context;
        c.handle = pd_handle;
        leak(Pd::new(c, id)).cast()
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_unimport_pd(pd: *mut sys::ibv_pd) {
    // SAFETY: the caller passes an imported PD of this library and does not use it again.
    unsafe { unimport::<Pd>(pd) }
}
