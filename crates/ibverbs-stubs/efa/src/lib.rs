//! Stand-in `libefa.so.1`: the EFA direct-verbs entry points perftest imports. No softrdma
//! device is an EFA device, so each one fails with `EOPNOTSUPP`, never a crash.

use std::ffi::{c_int, c_void};

const EOPNOTSUPP: c_int = 95;

extern "C" {
    #[link_name = "__errno_location"]
    fn libc_errno() -> *mut c_int;
}

#[cfg(not(test))]
core::arch::global_asm!(
    ".symver efadv_create_qp_ex, efadv_create_qp_ex@@EFA_1.1",
    ".symver efadv_query_device, efadv_query_device@@EFA_1.1",
    ".symver efadv_create_driver_qp, efadv_create_driver_qp@@EFA_1.1",
);

#[no_mangle]
pub extern "C" fn efadv_query_device(_ctx: *mut c_void, _attr: *mut c_void, _inlen: u32) -> c_int {
    EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn efadv_create_qp_ex(
    _ctx: *mut c_void,
    _attr: *mut c_void,
    _efa_attr: *mut c_void,
    _inlen: u32,
) -> *mut c_void {
    // SAFETY: __errno_location returns the calling thread's errno slot.
    unsafe { *libc_errno() = EOPNOTSUPP };
    std::ptr::null_mut()
}

#[no_mangle]
pub extern "C" fn efadv_create_driver_qp(
    _pd: *mut c_void,
    _attr: *mut c_void,
    _driver_qp_type: u32,
) -> *mut c_void {
    // SAFETY: __errno_location returns the calling thread's errno slot.
    unsafe { *libc_errno() = EOPNOTSUPP };
    std::ptr::null_mut()
}
