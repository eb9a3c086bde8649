//! softrdma's C face: a drop-in `libibverbs.so.1`.
//!
//! Unmodified programs written against rdma-core's `<infiniband/verbs.h>` (ibverbs-utils,
//! perftest, tutorial code) load this library instead of rdma-core's and drive a softrdma
//! device: every exported function has rdma-core 44's name and symbol version
//! (`exports.txt`), and every object handed out has the exact C layout of the installed
//! headers (`src/sys.rs`, generated once by `tools/gen-bindings.sh`, with compile-time
//! layout assertions).
//!
//! The library is a thin face: it translates C structures to the engine's verbs types
//! (`softrdma_device::verbs`) and back, and calls the device. It decides nothing of its own.
//!
//! Rules every entry point follows:
//! - nothing panics across the C ABI: each entry runs inside `guard`, which turns a
//!   panic into the documented failure value (NULL / errno);
//! - failures return what libibverbs documents: an errno value, or -1 / NULL with `errno`
//!   set; `EOPNOTSUPP` for what softrdma does not support;
//! - the library never aborts the program.
//!
//! All exported functions are `unsafe extern "C"`: their safety contract is the one
//! `<infiniband/verbs.h>` states for the same function (valid, live object pointers of
//! this library, buffers of the documented sizes).

#![allow(clippy::missing_safety_doc)]

mod ah;
mod context;
mod cq;
mod device;
mod dm;
mod enums;
mod marshall;
mod mr;
mod mw;
mod object;
mod pd;
mod qp;
pub mod rdmacm;
mod srq;
mod stubs;
#[allow(unsafe_code)]
pub mod sys;
mod wr_list;

use std::ffi::c_int;
use std::panic::AssertUnwindSafe;

// `name@@IBVERBS_x.y` for every export (see build.rs). Not in unit-test executables,
// which are linked without the version script.
#[cfg(not(test))]
include!(concat!(env!("OUT_DIR"), "/symver.rs"));

/// This process's id, which the library's process-wide state (the open devices, the CM)
/// records. A child made by `fork()` inherits that state from its parent but not the
/// threads that serve it (each device's progress thread, the CM's thread) and shares the
/// parent's sockets, so the child must not use it: it opens devices and starts a CM of
/// its own, as a child of a kernel RDMA process opens its own context. The parent's state
/// is left alone in the child (neither used nor dropped: dropping it would wait for
/// threads that are not there).
pub(crate) fn this_process() -> u32 {
    std::process::id()
}

/// Run `f`, turning a panic into `fail` (with errno EIO) so that no unwind crosses the C ABI.
pub(crate) fn guard<R>(fail: R, f: impl FnOnce() -> R) -> R {
    match std::panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(_) => {
            set_errno(libc::EIO);
            fail
        }
    }
}

/// Set the calling thread's `errno`.
pub(crate) fn set_errno(e: i32) {
    // SAFETY: __errno_location returns the calling thread's errno slot, valid for the
    // thread's lifetime.
    unsafe { *libc::__errno_location() = e };
}

/// The calling thread's `errno` (after a call of this library that failed).
pub(crate) fn errno_now() -> i32 {
    // SAFETY: as in `set_errno`.
    let e = unsafe { *libc::__errno_location() };
    if e == 0 {
        libc::EIO
    } else {
        e
    }
}

/// Set errno and return NULL.
pub(crate) fn null_errno<T>(e: i32) -> *mut T {
    set_errno(e);
    std::ptr::null_mut()
}

/// Hand an fd of the device to the program as a blocking fd, as a kernel driver's channel
/// fds are, so that a program setting O_NONBLOCK on it is visible to
/// [`fd_nonblocking`]. (The device reads these eventfds only when they poll readable.)
pub(crate) fn make_fd_blocking(fd: c_int) {
    // SAFETY: fcntl on a descriptor the device owns; no pointers.
    unsafe {
        let fl = libc::fcntl(fd, libc::F_GETFL);
        if fl >= 0 && fl & libc::O_NONBLOCK != 0 {
            libc::fcntl(fd, libc::F_SETFL, fl & !libc::O_NONBLOCK);
        }
    }
}

/// Whether the program set O_NONBLOCK on `fd` (a channel or async-event fd).
pub(crate) fn fd_nonblocking(fd: c_int) -> bool {
    // SAFETY: fcntl F_GETFL takes no pointers.
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    fl >= 0 && fl & libc::O_NONBLOCK != 0
}

/// Set errno and return -1.
pub(crate) fn minus_one(e: i32) -> i32 {
    set_errno(e);
    -1
}

/// An all-zero value of a generated C type.
pub(crate) fn zeroed<T: Zeroable>() -> T {
    // SAFETY: `Zeroable` is implemented only for the generated C structs and unions
    // (integers, raw pointers, optional function pointers, arrays and nested such
    // structs), for which all-zero bytes are a valid value, as in C.
    unsafe { std::mem::zeroed() }
}

/// Marker for C types whose all-zero bit pattern is valid.
pub(crate) trait Zeroable {}

macro_rules! zeroable {
    ($($t:ty),* $(,)?) => { $(impl Zeroable for $t {})* };
}
zeroable!(
    sys::ibv_device,
    sys::verbs_context,
    sys::ibv_device_attr,
    sys::ibv_device_attr_ex,
    sys::ibv_odp_caps,
    sys::ibv_port_attr,
    sys::ibv_gid_entry,
    sys::ibv_pd,
    sys::ibv_mr,
    sys::ibv_cq_ex,
    sys::ibv_comp_channel,
    sys::ibv_srq,
    sys::ibv_ah,
    sys::ibv_qp_ex,
    sys::ibv_mw,
    sys::ibv_dm,
    sys::ibv_wc,
    sys::ibv_qp_attr,
    sys::ibv_qp_init_attr,
    sys::ibv_ah_attr,
    sys::ibv_async_event,
    sys::ibv_qp_init_attr_ex,
    sys::ibv_srq_init_attr,
    sys::ibv_srq_init_attr_ex,
    sys::ibv_send_wr,
    sys::ibv_recv_wr,
);

/// Copy `src` into `dst`, at most `len` bytes (extended calls pass the size of the struct
/// the caller was compiled with, which may be older and smaller than ours).
pub(crate) unsafe fn copy_prefix<T>(src: &T, dst: *mut T, len: usize) {
    let n = len.min(std::mem::size_of::<T>());
    // SAFETY: the caller guarantees `dst` points at `len` writable bytes; we write
    // at most that many, from a live `T`.
    unsafe { std::ptr::copy_nonoverlapping((src as *const T).cast::<u8>(), dst.cast::<u8>(), n) };
}
