//! How the C objects of this library are made, found and freed.
//!
//! Each C object this library hands out is a `#[repr(C)]` struct whose first field is the
//! C struct of `<infiniband/verbs.h>` (so the program's pointer is ours), followed by the
//! engine handle it stands for. Every object's `context` is set.

use std::ffi::c_int;

use softrdma_device::{verbs, Rnic};

use crate::device::Ctx;
use crate::{guard, sys};

pub(crate) fn errno(e: &verbs::Error) -> c_int {
    e.errno.code()
}

/// Box an object and hand out its address.
pub(crate) fn leak<T>(v: T) -> *mut T {
    Box::into_raw(Box::new(v))
}

/// Our object behind a C pointer of its first field.
///
/// # Safety
/// `p` is null or points at the first field of a live `T` this library allocated.
pub(crate) unsafe fn obj<'a, T, C>(p: *const C) -> Option<&'a T> {
    if p.is_null() {
        None
    } else {
        // SAFETY: per the contract, `p` is the address of a live `T` (first field at 0).
        Some(unsafe { &*p.cast::<T>() })
    }
}

/// Free an object made by [`leak`].
///
/// # Safety
/// `p` came from [`leak`] as a `T` and is freed once.
unsafe fn free<T, C>(p: *mut C) {
    // SAFETY: per the contract.
    drop(unsafe { Box::from_raw(p.cast::<T>()) });
}

/// Free the C object of an imported `T` (`ibv_unimport_pd`, `_mr`, `_dm`) without
/// touching the engine object, which the other handles on it keep using.
///
/// # Safety
/// `p` is null or the head of a live `T` made by [`leak`], not used again by the caller.
pub(crate) unsafe fn unimport<T: Destroy>(p: *mut T::C) {
    guard((), || {
        // SAFETY: per the contract.
        if let Some(o) = unsafe { obj::<T, _>(p) } {
            // SAFETY: the handle's PD is live while the handle is (it was held).
            unsafe { crate::pd::release(o.pd()) };
            // SAFETY: per the contract: made by `leak` as a `T`, freed once.
            unsafe { free::<T, _>(p) }
        }
    })
}

/// The context an object belongs to.
///
/// # Safety
/// `c` is null or a live context of this library.
pub(crate) unsafe fn ctx_of<'a>(c: *mut sys::ibv_context) -> Option<&'a Ctx> {
    // SAFETY: per the contract.
    unsafe { Ctx::from_ptr(c) }
}

/// A C object whose destroy verb has the common shape: the engine destroys the verbs
/// object, and only if it agrees (it refuses, say, a PD that still has MRs) does the C
/// object go: unregistered, then freed. A refusal leaves the program's handle valid.
pub(crate) trait Destroy {
    /// The C struct the destroy verb takes, at the head of `Self`.
    type C;
    /// The context the object belongs to.
    fn context(&self) -> *mut sys::ibv_context;
    /// Destroy the verbs object in the engine.
    fn destroy_verbs(&self, r: &mut Rnic) -> verbs::Result<()>;
    /// Forget what the context keeps of the object (lookups by engine id, fds), once the
    /// engine no longer has it.
    fn unregister(&self, _ctx: &Ctx) {}
    /// The PD the object was made in (held with `pd::hold`), if it has one.
    fn pd(&self) -> *mut sys::ibv_pd {
        std::ptr::null_mut()
    }
}

/// The destroy verb of a `T`: 0, or an errno with the object left as it was.
///
/// # Safety
/// `p` is null or the head of a live `T` made by [`leak`], not used by the caller again
/// once this returns 0.
pub(crate) unsafe fn destroy<T: Destroy>(p: *mut T::C) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: per the contract.
        let Some(o) = (unsafe { obj::<T, _>(p) }) else {
            return libc::EINVAL;
        };
        // SAFETY: an object's context is a live context.
        let Some(ctx) = (unsafe { ctx_of(o.context()) }) else {
            return libc::EINVAL;
        };
        match ctx.dev().objects(|r| o.destroy_verbs(r)) {
            Ok(()) => {
                o.unregister(ctx);
                // SAFETY: the object's PD is live while the object is (it was held).
                unsafe { crate::pd::release(o.pd()) };
                // SAFETY: made by `leak` as a `T` (per the contract); freed once, as the
                // engine object it stood for is gone.
                unsafe { free::<T, _>(p) };
                0
            }
            Err(e) => errno(&e),
        }
    })
}
