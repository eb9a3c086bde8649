//! `rdma_getaddrinfo` and `rdma_freeaddrinfo`: name and service resolution for the
//! CM, through the C library's `getaddrinfo`, with librdmacm's mapping between the two
//! (QP type ↔ socket type, port space ↔ protocol, `RAI_*` ↔ `AI_*` flags) and its
//! results: one `rdma_addrinfo` for the first address found, the address in `ai_src_addr`
//! when the caller asked for a passive (listening) address, else in `ai_dst_addr`.
//!
//! Errors follow librdmacm: -1 with `errno` for its own failures (EINVAL when node,
//! service and hints are all missing, ENODEV when there is no RDMA device, ENOMEM),
//! getaddrinfo's `EAI_*` value, unchanged, when the resolution fails.
//!
//! librdmacm asks the IB address and route service (ibacm) for routes when that service
//! runs; softrdma has no such service, so results carry no `ai_route` and `RAI_NOROUTE`
//! has nothing to suppress, as with librdmacm on a host without ibacm.
//!
//! Every block of memory in a result comes from `malloc`, as in librdmacm, so a program
//! that edits a result (replacing an address with its own malloc'd one) and then calls
//! `rdma_freeaddrinfo` behaves the same on both.

use std::ffi::{c_char, c_int, c_void};

use libc::{addrinfo, sockaddr, sockaddr_in6, socklen_t};

use super::abi::{self, rdma_addrinfo, sockaddr_ib};
use super::devices;
use crate::{guard, minus_one, sys, zeroed};

/// glibc's `EAI_ADDRFAMILY` (a GNU extension the libc crate does not define).
const EAI_ADDRFAMILY: c_int = -9;

/// librdmacm's result for a failed step: -1 with errno, or an `EAI_*` value.
type Ret = Result<(), c_int>;

/// A malloc'd copy of `len` bytes of a socket address.
///
/// # Safety
/// `src` is null or points at `len` readable bytes.
unsafe fn copy_addr(src: *const sockaddr, len: socklen_t) -> Result<*mut sockaddr, c_int> {
    if src.is_null() {
        return Err(minus_one(libc::EINVAL));
    }
    let n = len as usize;
    // SAFETY: malloc of any size; the result is checked.
    let p = unsafe { libc::malloc(n.max(1)) }.cast::<sockaddr>();
    if p.is_null() {
        return Err(minus_one(libc::ENOMEM));
    }
    // SAFETY: `src` has `n` readable bytes (contract), `p` has room for `n`.
    unsafe { std::ptr::copy_nonoverlapping(src.cast::<u8>(), p.cast::<u8>(), n) };
    Ok(p)
}

/// A malloc'd copy of a C string, or NULL (as librdmacm, which does not check strdup).
///
/// # Safety
/// `s` is null or a NUL-terminated string.
unsafe fn dup(s: *const c_char) -> *mut c_char {
    if s.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: per the contract.
    unsafe { libc::strdup(s) }
}

/// getaddrinfo's hints for an `rdma_addrinfo`'s: the flags it shares, the family unless
/// AF_IB (which getaddrinfo does not know), the socket type of the QP type and the
/// protocol of the port space.
fn to_ai_hints(h: &rdma_addrinfo) -> addrinfo {
    // SAFETY: `addrinfo` is integers and raw pointers, for which all-zero bytes are
    // valid (C's `memset(&hints, 0, ...)`).
    let mut ai: addrinfo = unsafe { std::mem::zeroed() };
    if h.ai_flags & abi::RAI_PASSIVE != 0 {
        ai.ai_flags = libc::AI_PASSIVE;
    }
    if h.ai_flags & abi::RAI_NUMERICHOST != 0 {
        ai.ai_flags |= libc::AI_NUMERICHOST;
    }
    if h.ai_family != abi::AF_IB {
        ai.ai_family = h.ai_family;
    }
    ai.ai_socktype = match h.ai_qp_type as sys::ibv_qp_type {
        sys::IBV_QPT_RC | sys::IBV_QPT_UC | sys::IBV_QPT_XRC_SEND | sys::IBV_QPT_XRC_RECV => {
            libc::SOCK_STREAM
        }
        sys::IBV_QPT_UD => libc::SOCK_DGRAM,
        _ => 0,
    };
    ai.ai_protocol = match h.ai_port_space as abi::rdma_port_space {
        abi::RDMA_PS_TCP => libc::IPPROTO_TCP,
        abi::RDMA_PS_IPOIB | abi::RDMA_PS_UDP => libc::IPPROTO_UDP,
        abi::RDMA_PS_IB => match ai.ai_socktype {
            libc::SOCK_STREAM => libc::IPPROTO_TCP,
            libc::SOCK_DGRAM => libc::IPPROTO_UDP,
            _ => 0,
        },
        _ => 0,
    };
    ai
}

/// The AF_IB form of an IPv6 address (the GID in its 16 bytes), with the service ID of
/// port space `ps` and the address's port, as librdmacm builds it for `RAI_FAMILY` with
/// `AF_IB`.
fn to_ib(ps: c_int, sin6: &sockaddr_in6) -> sockaddr_ib {
    let mut sib: sockaddr_ib = zeroed();
    sib.sib_family = abi::AF_IB as u16;
    sib.sib_pkey = 0xFFFFu16.to_be();
    sib.sib_flowinfo = sin6.sin6_flowinfo;
    sib.sib_addr.ib_u.uib_addr8 = sin6.sin6_addr.s6_addr;
    let port = u16::from_be(sin6.sin6_port);
    // C: (uint64_t)ps << 16, sign-extending a (nonsensical) negative port space.
    sib.sib_sid = ((ps as u64) << 16).wrapping_add(u64::from(port)).to_be();
    if ps != 0 {
        sib.sib_sid_mask = abi::RDMA_IB_IP_PS_MASK.to_be();
    }
    if port != 0 {
        sib.sib_sid_mask |= abi::RDMA_IB_IP_PORT_MASK.to_be();
    }
    sib.sib_scope_id = u64::from(sin6.sin6_scope_id);
    sib
}

/// Fill `rai` from getaddrinfo's first result.
///
/// # Safety
/// `ai` is a result of getaddrinfo (its address valid for `ai_addrlen` bytes).
unsafe fn from_ai(rai: &mut rdma_addrinfo, h: &rdma_addrinfo, ai: &addrinfo) -> Ret {
    rai.ai_qp_type = if h.ai_qp_type != 0 {
        h.ai_qp_type
    } else {
        match ai.ai_socktype {
            libc::SOCK_STREAM => sys::IBV_QPT_RC as c_int,
            libc::SOCK_DGRAM => sys::IBV_QPT_UD as c_int,
            _ => 0,
        }
    };
    rai.ai_port_space = if h.ai_port_space != 0 {
        h.ai_port_space
    } else {
        match ai.ai_protocol {
            libc::IPPROTO_TCP => abi::RDMA_PS_TCP as c_int,
            libc::IPPROTO_UDP => abi::RDMA_PS_UDP as c_int,
            _ => 0,
        }
    };
    let passive = ai.ai_flags & libc::AI_PASSIVE != 0;
    if passive {
        rai.ai_flags = abi::RAI_PASSIVE;
    }
    // SAFETY: getaddrinfo's canonical name is null or a C string.
    let canon = unsafe { dup(ai.ai_canonname) };
    let want_ib = h.ai_flags & abi::RAI_FAMILY != 0
        && h.ai_family == abi::AF_IB
        && h.ai_flags & abi::RAI_NUMERICHOST != 0;
    let (addr, len) = if want_ib {
        // librdmacm reads the result as an IPv6 address whatever its family; an IPv4
        // result has no GID form, so it is refused as an address of the wrong family.
        if ai.ai_family != libc::AF_INET6
            || (ai.ai_addrlen as usize) < std::mem::size_of::<sockaddr_in6>()
        {
            // SAFETY: `canon` is null or our malloc'd copy, not yet stored anywhere.
            unsafe { libc::free(canon.cast::<c_void>()) };
            return Err(EAI_ADDRFAMILY);
        }
        // SAFETY: an AF_INET6 result of getaddrinfo is a sockaddr_in6 (length checked).
        let sib = to_ib(rai.ai_port_space, unsafe {
            &*ai.ai_addr.cast::<sockaddr_in6>()
        });
        rai.ai_family = abi::AF_IB;
        let len = std::mem::size_of::<sockaddr_ib>() as socklen_t;
        // SAFETY: `sib` is a live sockaddr_ib of `len` bytes.
        (
            unsafe { copy_addr(std::ptr::addr_of!(sib).cast::<sockaddr>(), len) },
            len,
        )
    } else {
        rai.ai_family = ai.ai_family;
        // SAFETY: getaddrinfo's address has `ai_addrlen` bytes (contract).
        (
            unsafe { copy_addr(ai.ai_addr, ai.ai_addrlen) },
            ai.ai_addrlen,
        )
    };
    if passive {
        rai.ai_src_canonname = canon;
    } else {
        rai.ai_dst_canonname = canon;
    }
    let addr = addr?;
    if passive {
        rai.ai_src_addr = addr;
        rai.ai_src_len = len;
    } else {
        rai.ai_dst_addr = addr;
        rai.ai_dst_len = len;
    }
    Ok(())
}

/// Resolve `node`/`service` through getaddrinfo into `rai`.
///
/// # Safety
/// `node` and `service` are null or C strings; `user_hints` says whether the caller gave
/// hints (without them getaddrinfo gets none either, as in librdmacm).
unsafe fn resolve(
    rai: &mut rdma_addrinfo,
    node: *const c_char,
    service: *const c_char,
    h: &rdma_addrinfo,
    user_hints: bool,
) -> Ret {
    let ai_hints = to_ai_hints(h);
    let hp: *const addrinfo = if user_hints {
        &ai_hints
    } else {
        std::ptr::null()
    };
    let mut res: *mut addrinfo = std::ptr::null_mut();
    // SAFETY: C strings or null (contract), hints null or a live addrinfo, `res` an
    // out-pointer; the result list is freed below.
    let ret = unsafe { libc::getaddrinfo(node, service, hp, &mut res) };
    if ret != 0 {
        return Err(ret);
    }
    // SAFETY: on success getaddrinfo returns at least one result, valid until freed.
    let r = unsafe { from_ai(rai, h, &*res) };
    // SAFETY: `res` came from getaddrinfo and is freed once.
    unsafe { libc::freeaddrinfo(res) };
    r
}

/// Fill `rai` from the hints alone (no node, no service): librdmacm copies the flags,
/// family, QP type, port space and destination address.
///
/// # Safety
/// `h.ai_dst_addr` is null or has `h.ai_dst_len` readable bytes.
unsafe fn from_hints(rai: &mut rdma_addrinfo, h: &rdma_addrinfo) -> Ret {
    rai.ai_flags = h.ai_flags;
    rai.ai_family = h.ai_family;
    rai.ai_qp_type = h.ai_qp_type;
    rai.ai_port_space = h.ai_port_space;
    if h.ai_dst_len != 0 {
        // SAFETY: per the contract.
        rai.ai_dst_addr = unsafe { copy_addr(h.ai_dst_addr, h.ai_dst_len) }?;
        rai.ai_dst_len = h.ai_dst_len;
    }
    Ok(())
}

/// Resolve a node and service for the CM (see the module documentation).
#[no_mangle]
pub unsafe extern "C" fn rdma_getaddrinfo(
    node: *const c_char,
    service: *const c_char,
    hints: *const rdma_addrinfo,
    res: *mut *mut rdma_addrinfo,
) -> c_int {
    guard(-1, || {
        if (node.is_null() && service.is_null() && hints.is_null()) || res.is_null() {
            return minus_one(libc::EINVAL);
        }
        if let Err(e) = devices::check() {
            return minus_one(e);
        }
        let nohints: rdma_addrinfo = zeroed();
        // SAFETY: `hints` is null or the caller's rdma_addrinfo.
        let h = unsafe { hints.as_ref() }.unwrap_or(&nohints);
        // SAFETY: calloc of one struct; the result is checked.
        let rai = unsafe { libc::calloc(1, std::mem::size_of::<rdma_addrinfo>()) }
            .cast::<rdma_addrinfo>();
        if rai.is_null() {
            return minus_one(libc::ENOMEM);
        }
        // SAFETY: `rai` is a zeroed (valid) rdma_addrinfo we own until it is returned.
        let r = unsafe { &mut *rai };
        let done = if !node.is_null() || !service.is_null() {
            // SAFETY: the caller passes C strings or null.
            unsafe { resolve(r, node, service, h, !hints.is_null()) }
        } else {
            // SAFETY: the caller's hints hold addresses of the lengths they state.
            unsafe { from_hints(r, h) }
        }
        .and_then(|()| {
            if r.ai_src_len == 0 && h.ai_src_len != 0 {
                // SAFETY: as above, for the source address.
                r.ai_src_addr = unsafe { copy_addr(h.ai_src_addr, h.ai_src_len) }?;
                r.ai_src_len = h.ai_src_len;
            }
            Ok(())
        });
        match done {
            Ok(()) => {
                // SAFETY: `res` is the caller's out-pointer (checked non-null).
                unsafe { *res = rai };
                0
            }
            Err(e) => {
                // SAFETY: `rai` is ours, made above, and freed once.
                unsafe { rdma_freeaddrinfo(rai) };
                e
            }
        }
    })
}

/// Free a list from `rdma_getaddrinfo`: every entry and every block it points at.
#[no_mangle]
pub unsafe extern "C" fn rdma_freeaddrinfo(res: *mut rdma_addrinfo) {
    guard((), || {
        let mut p = res;
        while !p.is_null() {
            // SAFETY: `p` is an entry of a list rdma_getaddrinfo made (malloc'd, as are
            // the blocks it points at); each is freed once.
            unsafe {
                let next = (*p).ai_next;
                libc::free((*p).ai_connect);
                libc::free((*p).ai_route);
                libc::free((*p).ai_src_canonname.cast::<c_void>());
                libc::free((*p).ai_dst_canonname.cast::<c_void>());
                libc::free((*p).ai_src_addr.cast::<c_void>());
                libc::free((*p).ai_dst_addr.cast::<c_void>());
                libc::free(p.cast::<c_void>());
                p = next;
            }
        }
    })
}
