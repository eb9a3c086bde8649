//! Multicast on UD ids: `rdma_join_multicast`, `rdma_join_multicast_ex`,
//! `rdma_leave_multicast`. The CM reports MULTICAST_JOIN with the group's address vector
//! (the MGID is the group's IP address as a RoCE GID); as librdmacm does, the id's QP is
//! attached to the group when the event is taken (not for a send-only join), and detached
//! before the leave.

use std::ffi::{c_int, c_void};

use super::abi;
use super::cm::{self, sockaddr_from_c};
use super::id::{self, done, id_of, CmId};
use crate::{guard, minus_one, qp as vqp, sys};

/// Join `addr` for the id; a synchronous id waits for the MULTICAST_JOIN event.
///
/// # Safety
/// `id` is a live id of this library; `addr` null or a socket address.
unsafe fn join(
    id: *mut abi::rdma_cm_id,
    addr: *const libc::sockaddr,
    send_only: bool,
    context: *mut c_void,
) -> Result<c_int, c_int> {
    // SAFETY: per the contract.
    let me = unsafe { id_of(id) }.ok_or(libc::EINVAL)?;
    // SAFETY: per the contract.
    let a = unsafe { sockaddr_from_c(addr) }?.ok_or(libc::EINVAL)?;
    me.model(|c, _, h| c.join_multicast(h, a, send_only, context as u64))?;
    // SAFETY: the id is live.
    Ok(unsafe { id::complete(id) })
}

#[no_mangle]
pub unsafe extern "C" fn rdma_join_multicast(
    id: *mut abi::rdma_cm_id,
    addr: *mut libc::sockaddr,
    context: *mut c_void,
) -> c_int {
    // SAFETY: the caller passes a live id and a socket address.
    guard(-1, || done(unsafe { join(id, addr, false, context) }))
}

#[no_mangle]
pub unsafe extern "C" fn rdma_join_multicast_ex(
    id: *mut abi::rdma_cm_id,
    mc_join_attr: *mut abi::rdma_cm_join_mc_attr_ex,
    context: *mut c_void,
) -> c_int {
    guard(-1, || {
        if mc_join_attr.is_null() {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: the caller passes its join attributes.
        let a = unsafe { *mc_join_attr };
        if a.comp_mask >= abi::RDMA_CM_JOIN_MC_ATTR_RESERVED {
            return minus_one(libc::EOPNOTSUPP);
        }
        if a.comp_mask & abi::RDMA_CM_JOIN_MC_ATTR_ADDRESS == 0
            || a.comp_mask & abi::RDMA_CM_JOIN_MC_ATTR_JOIN_FLAGS == 0
            || a.join_flags >= abi::RDMA_MC_JOIN_FLAG_RESERVED
        {
            return minus_one(libc::EINVAL);
        }
        let send_only = a.join_flags == abi::RDMA_MC_JOIN_FLAG_SENDONLY_FULLMEMBER;
        // SAFETY: the caller passes a live id; the attributes name a socket address.
        done(unsafe { join(id, a.addr, send_only, context) })
    })
}

/// The MGID of a group address (its IP as a RoCE GID).
fn mgid_of(addr: std::net::SocketAddr) -> sys::ibv_gid {
    cm::gid_of(addr.ip())
}

/// Attach the id's QP to the group of a MULTICAST_JOIN event (`ucma_process_join`):
/// 0, or the errno of the attach.
pub(crate) fn attach_on_join(me: &CmId, ah: &sys::ibv_ah_attr, send_only: bool) -> c_int {
    if me.c.qp.is_null() || send_only {
        return 0;
    }
    let gid = ah.grh.dgid;
    // SAFETY: the id's QP is a live QP of this library; `gid` is ours.
    unsafe { vqp::ibv_attach_mcast(me.c.qp, &gid, ah.dlid) }
}

#[no_mangle]
pub unsafe extern "C" fn rdma_leave_multicast(
    id: *mut abi::rdma_cm_id,
    addr: *mut libc::sockaddr,
) -> c_int {
    guard(-1, || {
        let r = (|| {
            // SAFETY: the caller passes a live id and a socket address.
            let me = unsafe { id_of(id) }.ok_or(libc::EINVAL)?;
            // SAFETY: as above.
            let a = unsafe { sockaddr_from_c(addr) }?.ok_or(libc::EINVAL)?;
            let h = me.handle;
            // librdmacm compares the whole address, port included; the oldest join goes.
            let join = me
                .cm
                .call(|c, _| {
                    c.multicast_joins(h)
                        .ok()
                        .and_then(|js| js.iter().find(|j| j.addr == a).cloned())
                })
                .ok_or(libc::EADDRNOTAVAIL)?;
            if !me.c.qp.is_null() && !join.send_only {
                let gid = mgid_of(a);
                // SAFETY: the id's QP is live. A QP never attached (the join event not
                // yet taken) answers EINVAL, which the leave does not care about.
                let _ = unsafe { vqp::ibv_detach_mcast(me.c.qp, &gid, 0) };
            }
            me.cm.agent().leave_multicast(h, a).map_err(cm::errno)?;
            Ok(0)
        })();
        done(r)
    })
}
