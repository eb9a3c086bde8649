//! Address and route: `rdma_bind_addr`, `rdma_resolve_addr`, `rdma_resolve_route`, and
//! what the program reads of them in the id (its addresses, device, GIDs and path record).

use std::ffi::c_int;

use super::{complete, done, id_of, with_id};
use crate::rdmacm::abi;
use crate::rdmacm::cm::{gid_of, sockaddr_from_c, sockaddr_to_c};
use crate::{guard, zeroed};

/// Refresh what the program reads of the id from the model: its addresses, its device
/// (`verbs`, `pd`, `port_num`) once bound to it, and the GIDs of the route.
///
/// # Safety
/// `p` is a live id of this library.
pub(crate) unsafe fn query_route(p: *mut abi::rdma_cm_id) {
    // SAFETY: per the contract.
    let Some(me) = (unsafe { id_of(p) }) else {
        return;
    };
    let h = me.handle;
    let (addrs, has_dev, peer) = me.cm.call(|c, _| {
        (
            c.addrs(h).unwrap_or((None, None)),
            c.has_device(h).unwrap_or(false),
            c.peer_device(h).ok().flatten(),
        )
    });
    let dev_ip = me.cm.device_ip();
    // SAFETY: the id is live; the program reads these fields only between calls, as
    // librdmacm's own updates of them assume.
    unsafe {
        let c = &mut *p;
        if let Some(s) = addrs.0 {
            c.route.addr.src = sockaddr_to_c(s);
        }
        if let Some(d) = addrs.1 {
            c.route.addr.dst = sockaddr_to_c(d);
        }
        let ib = &mut c.route.addr.addr.ibaddr;
        if has_dev || peer.is_some() {
            ib.sgid = gid_of(dev_ip);
            ib.pkey = 0xFFFFu16.to_be();
        }
        if let Some(peer) = peer {
            ib.dgid = gid_of(peer);
        }
        if has_dev && c.verbs.is_null() {
            c.verbs = me.cm.ctx();
            c.pd = me.cm.pd();
            c.port_num = 1;
        }
    }
}

/// Give the id its one RoCE path record (`route.path_rec`), as the kernel reports it once
/// the route is resolved: its traffic class is the id's type of service (what
/// `RDMA_OPTION_ID_TOS` set; for a connection request's id, the REQ path's), its MTU the
/// route's (for a connection request's id, the REQ's).
///
/// # Safety
/// `p` is a live id of this library.
pub(crate) unsafe fn set_path(p: *mut abi::rdma_cm_id) {
    // SAFETY: per the contract.
    let Some(me) = (unsafe { id_of(p) }) else {
        return;
    };
    let h = me.handle;
    let tos = me.cm.call(|c, _| c.tos(h)).unwrap_or(0);
    let mtu = me.cm.call(|c, _| c.path_mtu(h)).map_or(3, |m| m as u8);
    // SAFETY: the id is live.
    let ib = unsafe { (*p).route.addr.addr.ibaddr };
    let mut r: abi::ibv_sa_path_rec = zeroed();
    r.dgid = ib.dgid;
    r.sgid = ib.sgid;
    r.hop_limit = 64;
    r.traffic_class = tos;
    r.reversible = 1;
    r.numb_path = 1;
    r.pkey = 0xFFFFu16.to_be();
    // IBA "exactly" selectors (2), the route's MTU, 10 Gb/s (3) and the packet lifetime
    // RoCE paths get.
    r.mtu_selector = 2;
    r.mtu = mtu;
    r.rate_selector = 2;
    r.rate = 3;
    r.packet_life_time_selector = 2;
    r.packet_life_time = 16;
    let mut g = me.lock();
    let b = g.path.insert(Box::new(r));
    let ptr: *mut abi::ibv_sa_path_rec = &mut **b;
    // SAFETY: the id is live; the record lives as long as the id.
    unsafe {
        (*p).route.path_rec = ptr;
        (*p).route.num_paths = 1;
    }
}

#[no_mangle]
pub unsafe extern "C" fn rdma_bind_addr(
    id: *mut abi::rdma_cm_id,
    addr: *mut libc::sockaddr,
) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live id and a socket address (or null).
        done(
            unsafe {
                with_id(id, |me| {
                    let a = sockaddr_from_c(addr)?.ok_or(libc::EINVAL)?;
                    me.model(|c, _, h| c.bind(h, a))
                })
            }
            .map(|()| {
                // SAFETY: as above.
                unsafe { query_route(id) };
                0
            }),
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn rdma_resolve_addr(
    id: *mut abi::rdma_cm_id,
    src_addr: *mut libc::sockaddr,
    dst_addr: *mut libc::sockaddr,
    _timeout_ms: c_int,
) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live id and socket addresses (src may be null).
        let r = unsafe {
            with_id(id, |me| {
                let dst = sockaddr_from_c(dst_addr)?.ok_or(libc::EINVAL)?;
                let src = sockaddr_from_c(src_addr)?;
                (*id).route.addr.dst = sockaddr_to_c(dst);
                me.model(|c, _, h| c.resolve_addr(h, src, dst))
            })
        };
        // SAFETY: as above.
        done(r.map(|()| unsafe { complete(id) }))
    })
}

#[no_mangle]
pub unsafe extern "C" fn rdma_resolve_route(id: *mut abi::rdma_cm_id, _timeout_ms: c_int) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live id.
        let r = unsafe { with_id(id, |me| me.model(|c, _, h| c.resolve_route(h))) };
        // SAFETY: as above.
        done(r.map(|()| unsafe { complete(id) }))
    })
}
