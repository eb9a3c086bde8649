//! Exports softrdma does not support: they exist so that binaries linked against rdma-core
//! load, and fail the way libibverbs documents (`EOPNOTSUPP`, NULL or -1 with errno).

use std::ffi::c_int;

use crate::{null_errno, set_errno, sys};

#[no_mangle]
pub extern "C" fn ibv_resolve_eth_l2_from_gid(
    _context: *mut sys::ibv_context,
    _attr: *mut sys::ibv_ah_attr,
    _eth_mac: *mut u8,
    _vid: *mut u16,
) -> c_int {
    // softrdma rides on UDP: there is no Ethernet layer to resolve.
    set_errno(libc::EOPNOTSUPP);
    -1
}

#[no_mangle]
pub extern "C" fn ibv_query_ece(_qp: *mut sys::ibv_qp, _ece: *mut sys::ibv_ece) -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn ibv_set_ece(_qp: *mut sys::ibv_qp, _ece: *mut sys::ibv_ece) -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn ibv_reg_dmabuf_mr(
    _pd: *mut sys::ibv_pd,
    _offset: u64,
    _length: usize,
    _iova: u64,
    _fd: c_int,
    _access: c_int,
) -> *mut sys::ibv_mr {
    null_errno(libc::EOPNOTSUPP)
}

/// Data placement order is not guaranteed beyond what verbs promises: 0.
#[no_mangle]
pub extern "C" fn ibv_query_qp_data_in_order(
    _qp: *mut sys::ibv_qp,
    _op: u32,
    _flags: u32,
) -> c_int {
    0
}
