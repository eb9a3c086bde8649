//! Posting to a QP: `ibv_post_send`, `ibv_post_recv` and `ibv_bind_mw`, static inline
//! calls of verbs.h through `ctx->ops`.

use std::ffi::c_int;

use softrdma_device::verbs::{self, QpType, SendFlags, SendOp, SendWr, Sge, UdDest};

use super::Qp;
use crate::ah::Ah;
use crate::mw::{mw_bind, Mw};
use crate::object::{errno, obj};
use crate::wr_list::{finish, recv_wr, sges, walk};
use crate::{guard, set_errno, sys};

/// Translate one `ibv_send_wr`.
///
/// # Safety
/// `wr` is a valid work request whose pointers (SGEs, AH, MW, MR) are valid.
unsafe fn send_wr(qp: &Qp, wr: &sys::ibv_send_wr) -> Result<SendWr, c_int> {
    // SAFETY: per the contract.
    let sg_list = unsafe { sges(wr.sg_list, wr.num_sge) }?;
    // SAFETY: the unions are read as the opcode says the caller filled them; every bit
    // pattern of their integer fields is valid.
    let op = unsafe {
        let rdma = wr.wr.rdma;
        let at = wr.wr.atomic;
        let imm = u32::from_be(wr.__bindgen_anon_1.imm_data);
        match wr.opcode {
            sys::IBV_WR_RDMA_WRITE => SendOp::Write {
                remote_addr: rdma.remote_addr,
                rkey: rdma.rkey,
            },
            sys::IBV_WR_RDMA_WRITE_WITH_IMM => SendOp::WriteWithImm {
                remote_addr: rdma.remote_addr,
                rkey: rdma.rkey,
                imm,
            },
            sys::IBV_WR_SEND => SendOp::Send,
            sys::IBV_WR_SEND_WITH_IMM => SendOp::SendWithImm { imm },
            sys::IBV_WR_RDMA_READ => SendOp::Read {
                remote_addr: rdma.remote_addr,
                rkey: rdma.rkey,
            },
            sys::IBV_WR_ATOMIC_CMP_AND_SWP => SendOp::CompareSwap {
                remote_addr: at.remote_addr,
                rkey: at.rkey,
                compare: at.compare_add,
                swap: at.swap,
            },
            sys::IBV_WR_ATOMIC_FETCH_AND_ADD => SendOp::FetchAdd {
                remote_addr: at.remote_addr,
                rkey: at.rkey,
                add: at.compare_add,
            },
            sys::IBV_WR_LOCAL_INV => SendOp::LocalInv {
                rkey: wr.__bindgen_anon_1.invalidate_rkey,
            },
            sys::IBV_WR_SEND_WITH_INV => SendOp::SendWithInv {
                invalidate_rkey: wr.__bindgen_anon_1.invalidate_rkey,
            },
            sys::IBV_WR_BIND_MW => {
                let b = wr.__bindgen_anon_2.bind_mw;
                SendOp::BindMw(mw_bind(b.mw, b.rkey, &b.bind_info)?)
            }
            _ => return Err(libc::EINVAL),
        }
    };
    let ud = if qp.qp_type == QpType::Ud {
        // SAFETY: UD work requests fill the `ud` member.
        let u = unsafe { wr.wr.ud };
        // SAFETY: the AH is null or one of this library.
        let ah = unsafe { obj::<Ah, _>(u.ah) }.ok_or(libc::EINVAL)?;
        Some(UdDest {
            ah: ah.id,
            remote_qpn: u.remote_qpn,
            remote_qkey: u.remote_qkey,
        })
    } else {
        None
    };
    let flags = SendFlags::from_bits_truncate(wr.send_flags);
    let inline_data = if flags.contains(SendFlags::INLINE) {
        // SAFETY: for IBV_SEND_INLINE the SGE addresses are the program's buffers, readable
        // for their lengths during the call (verbs.h); the engine gets a copy, never them.
        Some(unsafe { copy_inline(&sg_list) }?)
    } else {
        None
    };
    Ok(SendWr {
        wr_id: wr.wr_id,
        op,
        flags,
        sg_list,
        inline_data,
        ud,
    })
}

/// Copy the bytes an inline work request's SGEs point at.
///
/// # Safety
/// Each SGE's `addr` is readable for `length` bytes.
unsafe fn copy_inline(sg_list: &[Sge]) -> Result<Vec<u8>, c_int> {
    let total: u64 = sg_list.iter().map(|s| u64::from(s.length)).sum();
    // The device's inline limit is far below this; the engine checks the QP's own.
    if total > u64::from(u16::MAX) {
        return Err(libc::EINVAL);
    }
    let mut out = Vec::with_capacity(total as usize);
    for s in sg_list.iter().filter(|s| s.length > 0) {
        if s.addr == 0 {
            return Err(libc::EFAULT);
        }
        // SAFETY: per the contract.
        out.extend_from_slice(unsafe {
            std::slice::from_raw_parts(s.addr as usize as *const u8, s.length as usize)
        });
    }
    Ok(out)
}

/// Post translated WRs in order under one engine lock; on failure, the index that failed
/// and its errno.
pub(crate) fn post_sends(
    qp: &Qp,
    wrs: impl IntoIterator<Item = SendWr>,
) -> Result<(), (usize, c_int)> {
    let Some(ctx) = qp.ctx() else {
        return Err((0, libc::EINVAL));
    };
    let qpn = qp.qpn;
    ctx.dev()
        .post_sends(qpn, wrs)
        .map_err(|(i, e)| (i, errno(&e)))
}

pub(crate) unsafe extern "C" fn post_send(
    qp: *mut sys::ibv_qp,
    wr: *mut sys::ibv_send_wr,
    bad: *mut *mut sys::ibv_send_wr,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: the caller passes a QP of this library.
        let Some(q) = (unsafe { obj::<Qp, _>(qp) }) else {
            return libc::EINVAL;
        };
        // SAFETY: `wr` is null or the caller's valid work request.
        if let Some(one) = unsafe { wr.as_ref() }.filter(|w| w.next.is_null()) {
            // One request, the usual case (a latency test's every post): no lists.
            // SAFETY: the caller's request and the objects it names are valid.
            let (posted, conv_err) = match unsafe { send_wr(q, one) } {
                Ok(w) => (post_sends(q, [w]), None),
                Err(e) => (Ok(()), Some(e)),
            };
            // SAFETY: `bad` is the caller's out pointer.
            return unsafe { finish(&[wr], conv_err, posted, bad) };
        }
        // SAFETY: the caller's list and the objects it names are valid.
        let (wrs, ptrs, conv_err) = unsafe { walk(wr, |w| w.next, |w| send_wr(q, w)) };
        let posted = post_sends(q, wrs);
        // SAFETY: `bad` is the caller's out pointer.
        unsafe { finish(&ptrs, conv_err, posted, bad) }
    })
}

pub(crate) unsafe extern "C" fn post_recv(
    qp: *mut sys::ibv_qp,
    wr: *mut sys::ibv_recv_wr,
    bad: *mut *mut sys::ibv_recv_wr,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: the caller passes a QP of this library.
        let Some(q) = (unsafe { obj::<Qp, _>(qp) }) else {
            return libc::EINVAL;
        };
        let Some(ctx) = q.ctx() else {
            return libc::EINVAL;
        };
        // SAFETY: the caller's list is valid.
        let (wrs, ptrs, conv_err) = unsafe { walk(wr, |w| w.next, recv_wr) };
        let qpn = q.qpn;
        let posted = ctx
            .dev()
            .post_recvs(qpn, wrs)
            .map_err(|(i, e)| (i, errno(&e)));
        // SAFETY: `bad` is the caller's out pointer.
        unsafe { finish(&ptrs, conv_err, posted, bad) }
    })
}

/// `ibv_bind_mw` (type 1): a BIND_MW work request on the send queue. The window's new
/// rkey is known when the bind executes, in send-queue order; `mw->rkey` gets it then
/// being the next key byte, which is the engine's rule for type-1 binds.
pub(crate) unsafe extern "C" fn bind_mw(
    qp: *mut sys::ibv_qp,
    mw: *mut sys::ibv_mw,
    bind: *mut sys::ibv_mw_bind,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: the caller passes objects of this library and its bind description.
        let (Some(q), Some(w)) = (unsafe { obj::<Qp, _>(qp) }, unsafe { obj::<Mw, _>(mw) }) else {
            return libc::EINVAL;
        };
        if bind.is_null() || w.c.type_ != sys::IBV_MW_TYPE_1 {
            return libc::EINVAL;
        }
        // SAFETY: as above.
        let b = unsafe { *bind };
        let new_rkey = verbs::inc_rkey(w.c.rkey);
        // SAFETY: as above.
        let mb = match unsafe { mw_bind(mw, new_rkey, &b.bind_info) } {
            Ok(m) => m,
            Err(e) => return e,
        };
        let wr = SendWr {
            wr_id: b.wr_id,
            op: SendOp::BindMw(mb),
            flags: SendFlags::from_bits_truncate(b.send_flags),
            sg_list: Vec::new(),
            inline_data: None,
            ud: None,
        };
        match post_sends(q, vec![wr]) {
            Ok(()) => {
                // SAFETY: `mw` is live; rkey is the program-visible key.
                unsafe { (*mw).rkey = new_rkey };
                0
            }
            Err((_, e)) => {
                set_errno(e);
                e
            }
        }
    })
}
