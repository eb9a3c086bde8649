//! The rdma_cm functions that only read what they are given: the name of an event type,
//! and the ports of an id's addresses.

use std::ffi::{c_char, c_uint};

use super::abi;
use crate::guard;

/// The name of an event type, with librdmacm's exact text: programs print it and tests
/// compare it.
#[no_mangle]
pub extern "C" fn rdma_event_str(event: abi::rdma_cm_event_type) -> *const c_char {
    event_name(event).as_ptr()
}

fn event_name(event: c_uint) -> &'static std::ffi::CStr {
    match event {
        abi::RDMA_CM_EVENT_ADDR_RESOLVED => c"RDMA_CM_EVENT_ADDR_RESOLVED",
        abi::RDMA_CM_EVENT_ADDR_ERROR => c"RDMA_CM_EVENT_ADDR_ERROR",
        abi::RDMA_CM_EVENT_ROUTE_RESOLVED => c"RDMA_CM_EVENT_ROUTE_RESOLVED",
        abi::RDMA_CM_EVENT_ROUTE_ERROR => c"RDMA_CM_EVENT_ROUTE_ERROR",
        abi::RDMA_CM_EVENT_CONNECT_REQUEST => c"RDMA_CM_EVENT_CONNECT_REQUEST",
        abi::RDMA_CM_EVENT_CONNECT_RESPONSE => c"RDMA_CM_EVENT_CONNECT_RESPONSE",
        abi::RDMA_CM_EVENT_CONNECT_ERROR => c"RDMA_CM_EVENT_CONNECT_ERROR",
        abi::RDMA_CM_EVENT_UNREACHABLE => c"RDMA_CM_EVENT_UNREACHABLE",
        abi::RDMA_CM_EVENT_REJECTED => c"RDMA_CM_EVENT_REJECTED",
        abi::RDMA_CM_EVENT_ESTABLISHED => c"RDMA_CM_EVENT_ESTABLISHED",
        abi::RDMA_CM_EVENT_DISCONNECTED => c"RDMA_CM_EVENT_DISCONNECTED",
        abi::RDMA_CM_EVENT_DEVICE_REMOVAL => c"RDMA_CM_EVENT_DEVICE_REMOVAL",
        abi::RDMA_CM_EVENT_MULTICAST_JOIN => c"RDMA_CM_EVENT_MULTICAST_JOIN",
        abi::RDMA_CM_EVENT_MULTICAST_ERROR => c"RDMA_CM_EVENT_MULTICAST_ERROR",
        abi::RDMA_CM_EVENT_ADDR_CHANGE => c"RDMA_CM_EVENT_ADDR_CHANGE",
        abi::RDMA_CM_EVENT_TIMEWAIT_EXIT => c"RDMA_CM_EVENT_TIMEWAIT_EXIT",
        _ => c"UNKNOWN EVENT",
    }
}

/// The port of an id's address, as librdmacm gives it: in network byte order (the
/// header's `__be16`), 0 for an address of no known family (an unbound id). For AF_IB
/// it is the low 16 bits of the service ID.
///
/// # Safety
/// `sa` points at a live `rdma_sockaddr` (a field of `struct rdma_addr`).
unsafe fn port_of(sa: *const abi::rdma_sockaddr) -> u16 {
    // SAFETY: per the contract; every member of the union is plain bytes (any bit
    // pattern is valid) with `sa_family` at offset 0, and `sockaddr_in`, `sockaddr_in6`
    // and `sockaddr_ib` all fit in its `sockaddr_storage` (128 bytes, 8-aligned).
    unsafe {
        match i32::from((*sa).addr.sa_family) {
            libc::AF_INET => (*sa).sin.sin_port,
            libc::AF_INET6 => (*sa).sin6.sin6_port,
            abi::AF_IB => {
                let sib = sa.cast::<abi::sockaddr_ib>();
                (u64::from_be((*sib).sib_sid) as u16).to_be()
            }
            _ => 0,
        }
    }
}

/// The local port of an id (see [`port_of`]).
#[no_mangle]
pub unsafe extern "C" fn rdma_get_src_port(id: *mut abi::rdma_cm_id) -> u16 {
    guard(0, || {
        if id.is_null() {
            return 0;
        }
        // SAFETY: the caller passes a live rdma_cm_id; its source address is a union of
        // socket addresses of sockaddr_storage size.
        unsafe { port_of(std::ptr::addr_of!((*id).route.addr.src)) }
    })
}

/// The peer's port of an id (see [`port_of`]).
#[no_mangle]
pub unsafe extern "C" fn rdma_get_dst_port(id: *mut abi::rdma_cm_id) -> u16 {
    guard(0, || {
        if id.is_null() {
            return 0;
        }
        // SAFETY: as in rdma_get_src_port, for the destination address.
        unsafe { port_of(std::ptr::addr_of!((*id).route.addr.dst)) }
    })
}
