//! The "not supported" answers every stand-in returns, shared by the four libraries
//! (each includes this file as its `unsupported` module; their generated `exports.rs`
//! uses what it needs).

// Not every library has functions of every return type (libmana returns no pointers).
#![allow(dead_code)]

use std::ffi::c_int;

pub(crate) const EOPNOTSUPP: c_int = 95;

extern "C" {
    fn __errno_location() -> *mut c_int;
}

/// Sets the calling thread's errno to `EOPNOTSUPP` and returns `EOPNOTSUPP`.
pub(crate) fn unsupported_errno() -> c_int {
    // SAFETY: __errno_location returns the address of the calling thread's errno, valid
    // for the thread's lifetime.
    unsafe { *__errno_location() = EOPNOTSUPP };
    EOPNOTSUPP
}

/// NULL, with errno `EOPNOTSUPP`.
pub(crate) fn unsupported_null<T>() -> *mut T {
    unsupported_errno();
    std::ptr::null_mut()
}

/// -1, with errno `EOPNOTSUPP`.
pub(crate) fn unsupported_minus_one<T: From<i8>>() -> T {
    unsupported_errno();
    T::from(-1)
}
