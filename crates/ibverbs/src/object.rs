//! How the C objects of this library are made, found and freed.
//!
//! Each C object this library hands out is a `#[repr(C)]` struct whose first field is the
//! C struct of `<infiniband/verbs.h>` (so the program's pointer is ours), followed by the
//! engine handle it stands for. Every object's `context` is set.

use std::ffi::c_int;

use softrdma_device::verbs;

use crate::device::Ctx;
use crate::sys;

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
pub(crate) unsafe fn free<T, C>(p: *mut C) {
    // SAFETY: per the contract.
    drop(unsafe { Box::from_raw(p.cast::<T>()) });
}

/// The context an object belongs to.
///
/// # Safety
/// `c` is null or a live context of this library.
pub(crate) unsafe fn ctx_of<'a>(c: *mut sys::ibv_context) -> Option<&'a Ctx> {
    // SAFETY: per the contract.
    unsafe { Ctx::from_ptr(c) }
}
