//! Extended verbs: `ibv_query_device_ex`, `ibv_cq_ex` (the `ibv_start_poll` API with
//! completion timestamps), `ibv_qp_ex` (the `ibv_wr_*` send API), device memory and
//! memory windows. The inline wrappers of `<infiniband/verbs.h>` reach these through
//! `verbs_context` and the function pointers of the objects.

use std::ffi::{c_int, c_void};

use softrdma_device::verbs::{self, QpType, SendFlags, SendOp, SendWr, Sge, UdDest};

use crate::ah::Ah;
use crate::mw::{mw_bind, Mw};
use crate::object::{ctx_of, obj};
use crate::objs::{create_qp_obj, Qp};
use crate::post::post_sends;
use crate::{guard, null_errno, set_errno, sys};

// ------------------------------------------------------------------ QP ex

pub(crate) unsafe extern "C" fn create_qp_ex(
    context: *mut sys::ibv_context,
    attr: *mut sys::ibv_qp_init_attr_ex,
) -> *mut sys::ibv_qp {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the caller passes a live context.
        let Some(ctx) = (unsafe { ctx_of(context) }) else {
            return null_errno(libc::EINVAL);
        };
        if attr.is_null() {
            return null_errno(libc::EINVAL);
        }
        // SAFETY: `attr` points at the caller's attributes.
        let a = unsafe { &mut *attr };
        let known = sys::IBV_QP_INIT_ATTR_PD | sys::IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
        if a.comp_mask & !known != 0 {
            return null_errno(libc::EOPNOTSUPP);
        }
        if a.comp_mask & sys::IBV_QP_INIT_ATTR_PD == 0 || a.pd.is_null() {
            return null_errno(libc::EINVAL);
        }
        let ops_ok = (sys::IBV_QP_EX_WITH_ATOMIC_WRITE | sys::IBV_QP_EX_WITH_TSO) as u64;
        if a.comp_mask & sys::IBV_QP_INIT_ATTR_SEND_OPS_FLAGS != 0 && a.send_ops_flags & ops_ok != 0
        {
            return null_errno(libc::EOPNOTSUPP);
        }
        match create_qp_obj(
            ctx,
            a.pd,
            a.qp_context,
            a.send_cq,
            a.recv_cq,
            a.srq,
            &mut a.cap,
            a.qp_type,
            a.sq_sig_all != 0,
        ) {
            Ok(q) => q.cast(),
            Err(e) => null_errno(e),
        }
    })
}

/// The send WRs being built between `ibv_wr_start` and `ibv_wr_complete` (inline data
/// already copied into them).
#[derive(Default)]
pub(crate) struct WrBuild {
    pub(crate) wrs: Vec<SendWr>,
    err: c_int,
}

pub(crate) fn init_qp_ex(q: &mut sys::ibv_qp_ex) {
    q.wr_start = Some(wr_start);
    q.wr_complete = Some(wr_complete);
    q.wr_abort = Some(wr_abort);
    q.wr_send = Some(wr_send);
    q.wr_send_imm = Some(wr_send_imm);
    q.wr_send_inv = Some(wr_send_inv);
    q.wr_rdma_write = Some(wr_rdma_write);
    q.wr_rdma_write_imm = Some(wr_rdma_write_imm);
    q.wr_rdma_read = Some(wr_rdma_read);
    q.wr_atomic_cmp_swp = Some(wr_atomic_cmp_swp);
    q.wr_atomic_fetch_add = Some(wr_atomic_fetch_add);
    q.wr_local_inv = Some(wr_local_inv);
    q.wr_bind_mw = Some(wr_bind_mw);
    q.wr_set_sge = Some(wr_set_sge);
    q.wr_set_sge_list = Some(wr_set_sge_list);
    q.wr_set_inline_data = Some(wr_set_inline_data);
    q.wr_set_inline_data_list = Some(wr_set_inline_data_list);
    q.wr_set_ud_addr = Some(wr_set_ud_addr);
    q.wr_send_tso = Some(wr_send_tso);
    q.wr_set_xrc_srqn = Some(wr_set_xrc_srqn);
}

/// Run `f` on the QP and its build state.
fn with_build(qp: *mut sys::ibv_qp_ex, f: impl FnOnce(&Qp, &mut WrBuild)) {
    // SAFETY: the caller passes a QP of this library.
    if let Some(q) = unsafe { obj::<Qp, _>(qp) } {
        // SAFETY: verbs.h: the ibv_wr_* calls on one QP are serialised by the program
        // (between ibv_wr_start and ibv_wr_complete/abort, under its own lock if shared).
        let b = unsafe { &mut *q.ex.get() };
        f(q, b);
    }
}

/// Begin a WR with the QP's current `wr_id` and `wr_flags`.
fn begin(qp: *mut sys::ibv_qp_ex, op: SendOp) {
    with_build(qp, |q, b| {
        b.wrs.push(SendWr {
            wr_id: q.c.wr_id,
            op,
            flags: SendFlags::from_bits_truncate(q.c.wr_flags),
            sg_list: Vec::new(),
            inline_data: None,
            ud: None,
        })
    });
}

/// Change the WR being built (an error is kept for `ibv_wr_complete` if there is none).
fn last(qp: *mut sys::ibv_qp_ex, f: impl FnOnce(&mut SendWr) -> Result<(), c_int>) {
    with_build(qp, |_, b| {
        let r = match b.wrs.last_mut() {
            Some(w) => f(w),
            None => Err(libc::EINVAL),
        };
        if let Err(e) = r {
            if b.err == 0 {
                b.err = e;
            }
        }
    });
}

unsafe extern "C" fn wr_start(qp: *mut sys::ibv_qp_ex) {
    guard((), || {
        with_build(qp, |_, b| {
            b.wrs.clear();
            b.err = 0;
        })
    })
}

unsafe extern "C" fn wr_complete(qp: *mut sys::ibv_qp_ex) -> c_int {
    guard(libc::EIO, || {
        let mut ret = libc::EINVAL;
        with_build(qp, |q, b| {
            let wrs = std::mem::take(&mut b.wrs);
            ret = if b.err != 0 {
                b.err
            } else {
                match post_sends(q, wrs) {
                    Ok(()) => 0,
                    Err((_, e)) => e,
                }
            };
            b.err = 0;
        });
        ret
    })
}

unsafe extern "C" fn wr_abort(qp: *mut sys::ibv_qp_ex) {
    // SAFETY: forwarded.
    unsafe { wr_start(qp) }
}

unsafe extern "C" fn wr_send(qp: *mut sys::ibv_qp_ex) {
    guard((), || begin(qp, SendOp::Send))
}
unsafe extern "C" fn wr_send_imm(qp: *mut sys::ibv_qp_ex, imm: sys::__be32) {
    guard((), || {
        begin(
            qp,
            SendOp::SendWithImm {
                imm: u32::from_be(imm),
            },
        )
    })
}
unsafe extern "C" fn wr_send_inv(qp: *mut sys::ibv_qp_ex, rkey: u32) {
    guard((), || {
        begin(
            qp,
            SendOp::SendWithInv {
                invalidate_rkey: rkey,
            },
        )
    })
}
unsafe extern "C" fn wr_rdma_write(qp: *mut sys::ibv_qp_ex, rkey: u32, remote_addr: u64) {
    guard((), || begin(qp, SendOp::Write { remote_addr, rkey }))
}
unsafe extern "C" fn wr_rdma_write_imm(
    qp: *mut sys::ibv_qp_ex,
    rkey: u32,
    remote_addr: u64,
    imm: sys::__be32,
) {
    guard((), || {
        begin(
            qp,
            SendOp::WriteWithImm {
                remote_addr,
                rkey,
                imm: u32::from_be(imm),
            },
        )
    })
}
unsafe extern "C" fn wr_rdma_read(qp: *mut sys::ibv_qp_ex, rkey: u32, remote_addr: u64) {
    guard((), || begin(qp, SendOp::Read { remote_addr, rkey }))
}
unsafe extern "C" fn wr_atomic_cmp_swp(
    qp: *mut sys::ibv_qp_ex,
    rkey: u32,
    remote_addr: u64,
    compare: u64,
    swap: u64,
) {
    guard((), || {
        begin(
            qp,
            SendOp::CompareSwap {
                remote_addr,
                rkey,
                compare,
                swap,
            },
        )
    })
}
unsafe extern "C" fn wr_atomic_fetch_add(
    qp: *mut sys::ibv_qp_ex,
    rkey: u32,
    remote_addr: u64,
    add: u64,
) {
    guard((), || {
        begin(
            qp,
            SendOp::FetchAdd {
                remote_addr,
                rkey,
                add,
            },
        )
    })
}
unsafe extern "C" fn wr_local_inv(qp: *mut sys::ibv_qp_ex, rkey: u32) {
    guard((), || begin(qp, SendOp::LocalInv { rkey }))
}
unsafe extern "C" fn wr_bind_mw(
    qp: *mut sys::ibv_qp_ex,
    mw: *mut sys::ibv_mw,
    rkey: u32,
    info: *const sys::ibv_mw_bind_info,
) {
    guard((), || {
        if info.is_null() {
            begin(qp, SendOp::LocalInv { rkey: 0 });
            last(qp, |_| Err(libc::EINVAL));
            return;
        }
        // SAFETY: `info` is the caller's bind description; `mw` and its `mr` are objects
        // of this library.
        match unsafe { mw_bind(mw, rkey, &*info) } {
            Ok(b) => begin(qp, SendOp::BindMw(b)),
            Err(e) => {
                begin(qp, SendOp::LocalInv { rkey: 0 });
                last(qp, |_| Err(e));
            }
        }
    })
}
unsafe extern "C" fn wr_send_tso(
    qp: *mut sys::ibv_qp_ex,
    _hdr: *mut c_void,
    _hdr_sz: u16,
    _mss: u16,
) {
    guard((), || {
        begin(qp, SendOp::Send);
        last(qp, |_| Err(libc::EOPNOTSUPP));
    })
}
unsafe extern "C" fn wr_set_xrc_srqn(qp: *mut sys::ibv_qp_ex, _srqn: u32) {
    guard((), || last(qp, |_| Err(libc::EOPNOTSUPP)))
}

unsafe extern "C" fn wr_set_sge(qp: *mut sys::ibv_qp_ex, lkey: u32, addr: u64, length: u32) {
    guard((), || {
        last(qp, |w| {
            w.sg_list = vec![Sge { addr, length, lkey }];
            Ok(())
        })
    })
}
unsafe extern "C" fn wr_set_sge_list(qp: *mut sys::ibv_qp_ex, num: usize, sg: *const sys::ibv_sge) {
    guard((), || {
        last(qp, |w| {
            if num > 0 && sg.is_null() {
                return Err(libc::EINVAL);
            }
            w.sg_list = if num == 0 {
                Vec::new()
            } else {
                // SAFETY: the caller's array holds `num` SGEs.
                unsafe { std::slice::from_raw_parts(sg, num) }
                    .iter()
                    .map(|s| Sge {
                        addr: s.addr,
                        length: s.length,
                        lkey: s.lkey,
                    })
                    .collect()
            };
            Ok(())
        })
    })
}

/// Copy inline data now (the program may reuse its buffer once the call returns) into
/// the WR, flagged INLINE; its SGEs record the buffers' lengths, as `ibv_post_send` would.
fn set_inline(qp: *mut sys::ibv_qp_ex, bufs: &[(*const u8, usize)]) {
    with_build(qp, |_, b| {
        let mut data = Vec::new();
        let mut sg_list = Vec::with_capacity(bufs.len());
        for &(p, n) in bufs {
            let Ok(length) = u32::try_from(n) else {
                b.err = libc::EINVAL;
                return;
            };
            if n > 0 {
                if p.is_null() {
                    b.err = libc::EINVAL;
                    return;
                }
                // SAFETY: the caller's buffer holds `n` readable bytes.
                data.extend_from_slice(unsafe { std::slice::from_raw_parts(p, n) });
            }
            sg_list.push(Sge {
                addr: p as u64,
                length,
                lkey: 0,
            });
        }
        match b.wrs.last_mut() {
            Some(w) => {
                w.flags |= SendFlags::INLINE;
                w.sg_list = sg_list;
                w.inline_data = Some(data);
            }
            None => b.err = libc::EINVAL,
        }
    });
}

unsafe extern "C" fn wr_set_inline_data(qp: *mut sys::ibv_qp_ex, addr: *mut c_void, length: usize) {
    guard((), || set_inline(qp, &[(addr.cast_const().cast(), length)]))
}
unsafe extern "C" fn wr_set_inline_data_list(
    qp: *mut sys::ibv_qp_ex,
    num: usize,
    list: *const sys::ibv_data_buf,
) {
    guard((), || {
        if num > 0 && list.is_null() {
            last(qp, |_| Err(libc::EINVAL));
            return;
        }
        let bufs: Vec<(*const u8, usize)> = if num == 0 {
            Vec::new()
        } else {
            // SAFETY: the caller's array holds `num` buffers.
            unsafe { std::slice::from_raw_parts(list, num) }
                .iter()
                .map(|d| (d.addr.cast_const().cast(), d.length))
                .collect()
        };
        set_inline(qp, &bufs)
    })
}
unsafe extern "C" fn wr_set_ud_addr(
    qp: *mut sys::ibv_qp_ex,
    ah: *mut sys::ibv_ah,
    remote_qpn: u32,
    remote_qkey: u32,
) {
    guard((), || {
        // SAFETY: the caller passes an AH of this library.
        let ah = unsafe { obj::<Ah, _>(ah) }.map(|a| a.id);
        last(qp, |w| {
            let ah = ah.ok_or(libc::EINVAL)?;
            w.ud = Some(UdDest {
                ah,
                remote_qpn,
                remote_qkey,
            });
            Ok(())
        })
    })
}

/// Every QP is an `ibv_qp_ex` with the `ibv_wr_*` API set.
#[no_mangle]
pub unsafe extern "C" fn ibv_qp_to_qp_ex(qp: *mut sys::ibv_qp) -> *mut sys::ibv_qp_ex {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the caller passes a QP of this library.
        match unsafe { obj::<Qp, _>(qp) } {
            Some(q) if q.qp_type != QpType::Ud || !qp.is_null() => qp.cast(),
            _ => null_errno(libc::EINVAL),
        }
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
