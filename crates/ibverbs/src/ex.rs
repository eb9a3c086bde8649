//! Extended verbs: `ibv_query_device_ex`, `ibv_cq_ex` (the `ibv_start_poll` API with
//! completion timestamps), `ibv_qp_ex` (the `ibv_wr_*` send API), device memory and
//! memory windows. The inline wrappers of `<infiniband/verbs.h>` reach these through
//! `verbs_context` and the function pointers of the objects.

use std::ffi::{c_int, c_void};

use softrdma_device::verbs::{
    self, QpType, SendFlags, SendOp, SendWr, Sge, UdDest, WorkCompletion,
};

use crate::ah::Ah;
use crate::device::device_attr;
use crate::mw::{mw_bind, Mw};
use crate::object::{ctx_of, errno, obj};
use crate::objs::{create_cq_obj, create_qp_obj, Cq, Qp};
use crate::post::{poll_progress, poll_quick, post_sends, wc_to_c};
use crate::{copy_prefix, guard, null_errno, set_errno, sys, zeroed};

pub(crate) fn init_ops(v: &mut sys::verbs_context) {
    v.query_device_ex = Some(query_device_ex);
    v.create_cq_ex = Some(create_cq_ex);
    v.create_qp_ex = Some(create_qp_ex);
    v.alloc_dm = Some(crate::dm::alloc_dm);
    v.free_dm = Some(crate::dm::free_dm);
    v.reg_dm_mr = Some(crate::dm::reg_dm_mr);
    let ops = &mut v.context.ops;
    ops.alloc_mw = Some(crate::mw::alloc_mw);
    ops.dealloc_mw = Some(crate::mw::dealloc_mw);
    ops.bind_mw = Some(bind_mw);
}

// ------------------------------------------------------------------ query_device_ex

/// Completion timestamps are device-clock nanoseconds: a 1 GHz clock (in kHz).
const CORE_CLOCK_KHZ: u64 = 1_000_000;

unsafe extern "C" fn query_device_ex(
    context: *mut sys::ibv_context,
    input: *const sys::ibv_query_device_ex_input,
    attr: *mut sys::ibv_device_attr_ex,
    attr_size: usize,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: the caller passes a live context.
        let Some(ctx) = (unsafe { ctx_of(context) }) else {
            return libc::EINVAL;
        };
        // SAFETY: `input` is null or the caller's input struct.
        if attr.is_null() || (!input.is_null() && unsafe { (*input).comp_mask } != 0) {
            return libc::EINVAL;
        }
        if attr_size < std::mem::size_of::<sys::ibv_device_attr>() {
            return libc::EINVAL;
        }
        let mut o: sys::ibv_device_attr_ex = zeroed();
        o.orig_attr = device_attr(ctx);
        o.completion_timestamp_mask = u64::MAX;
        o.hca_core_clock = CORE_CLOCK_KHZ;
        o.max_dm_size = ctx.dev().inspect(|r| r.device_attr().max_dm_size);
        o.phys_port_cnt_ex = u32::from(o.orig_attr.phys_port_cnt);
        // SAFETY: `attr` has `attr_size` bytes (the caller's sizeof).
        unsafe { copy_prefix(&o, attr, attr_size) };
        0
    })
}

// ------------------------------------------------------------------ CQ ex

/// Extended polling state of a CQ.
#[derive(Default)]
pub(crate) struct CqPoll {
    /// The completion `ibv_start_poll`/`ibv_next_poll` made current.
    pub(crate) cur: WorkCompletion,
}

const WC_EX_SUPPORTED: u64 = (sys::IBV_WC_EX_WITH_BYTE_LEN
    | sys::IBV_WC_EX_WITH_IMM
    | sys::IBV_WC_EX_WITH_QP_NUM
    | sys::IBV_WC_EX_WITH_SRC_QP
    | sys::IBV_WC_EX_WITH_SLID
    | sys::IBV_WC_EX_WITH_SL
    | sys::IBV_WC_EX_WITH_DLID_PATH_BITS
    | sys::IBV_WC_EX_WITH_COMPLETION_TIMESTAMP) as u64;

unsafe extern "C" fn create_cq_ex(
    context: *mut sys::ibv_context,
    attr: *mut sys::ibv_cq_init_attr_ex,
) -> *mut sys::ibv_cq_ex {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the caller passes a live context.
        let Some(ctx) = (unsafe { ctx_of(context) }) else {
            return null_errno(libc::EINVAL);
        };
        if attr.is_null() {
            return null_errno(libc::EINVAL);
        }
        // SAFETY: `attr` points at the caller's attributes.
        let a = unsafe { &*attr };
        if a.wc_flags & !WC_EX_SUPPORTED != 0
            || a.comp_mask & !(sys::IBV_CQ_INIT_ATTR_MASK_FLAGS | sys::IBV_CQ_INIT_ATTR_MASK_PD)
                != 0
        {
            return null_errno(libc::EOPNOTSUPP);
        }
        let ts = a.wc_flags & u64::from(sys::IBV_WC_EX_WITH_COMPLETION_TIMESTAMP) != 0;
        let cqe = c_int::try_from(a.cqe).unwrap_or(c_int::MAX);
        match create_cq_obj(ctx, cqe, a.cq_context, a.channel, ts) {
            Ok(p) => {
                // SAFETY: `p` is the live CQ just made; nothing else uses it yet.
                let c = unsafe { &mut (*p).c };
                c.start_poll = Some(start_poll);
                c.next_poll = Some(next_poll);
                c.end_poll = Some(end_poll);
                c.read_opcode = Some(read_opcode);
                c.read_vendor_err = Some(read_vendor_err);
                c.read_byte_len = Some(read_byte_len);
                c.read_imm_data = Some(read_imm_data);
                c.read_qp_num = Some(read_qp_num);
                c.read_src_qp = Some(read_src_qp);
                c.read_wc_flags = Some(read_wc_flags);
                c.read_slid = Some(read_slid);
                c.read_sl = Some(read_sl);
                c.read_dlid_path_bits = Some(read_dlid_path_bits);
                c.read_completion_ts = Some(read_completion_ts);
                p.cast()
            }
            Err(e) => null_errno(e),
        }
    })
}

/// Make the next completion current: 0, ENOENT when empty, or an errno.
///
/// `ibv_start_poll` drives the device's progress when the CQ is empty (as `ibv_poll_cq`
/// does); `ibv_next_poll` only takes what is there. A batch that pulled in new
/// completions after the program re-armed the CQ would consume the completion of the
/// next CQ event, and programs such as `ibv_rc_pingpong -t -e` treat the empty
/// `ibv_start_poll` that follows that event as an error.
fn poll_next(cq: *mut sys::ibv_cq_ex, progress: bool) -> c_int {
    // SAFETY: the caller passes a CQ of this library.
    let Some(q) = (unsafe { obj::<Cq, _>(cq) }) else {
        return libc::EINVAL;
    };
    let mut w = [WorkCompletion::default()];
    let r = if progress {
        poll_progress(q, &mut w)
    } else {
        poll_quick(q, &mut w)
    };
    match r {
        Ok(0) => libc::ENOENT,
        Ok(_) => {
            // SAFETY: the extended poll API is single-threaded per CQ (verbs.h: the
            // program serialises start/next/end_poll and the readers on one CQ).
            unsafe {
                (*q.ex.get()).cur = w[0];
                (*cq).status = w[0].status as u32;
                (*cq).wr_id = w[0].wr_id;
            }
            0
        }
        Err(e) => errno(&e),
    }
}

unsafe extern "C" fn start_poll(
    cq: *mut sys::ibv_cq_ex,
    _attr: *mut sys::ibv_poll_cq_attr,
) -> c_int {
    guard(libc::EIO, || poll_next(cq, true))
}

unsafe extern "C" fn next_poll(cq: *mut sys::ibv_cq_ex) -> c_int {
    guard(libc::EIO, || poll_next(cq, false))
}

unsafe extern "C" fn end_poll(_cq: *mut sys::ibv_cq_ex) {}

/// The current completion of a CQ (see [`poll_next`]).
fn cur(cq: *mut sys::ibv_cq_ex) -> sys::ibv_wc {
    // SAFETY: the caller passes a CQ of this library, between start_poll and end_poll.
    match unsafe { obj::<Cq, _>(cq) } {
        // SAFETY: as in `poll_next`: single-threaded per CQ.
        Some(q) => wc_to_c(unsafe { &(*q.ex.get()).cur }),
        None => zeroed(),
    }
}

unsafe extern "C" fn read_opcode(cq: *mut sys::ibv_cq_ex) -> sys::ibv_wc_opcode {
    guard(0, || cur(cq).opcode)
}
unsafe extern "C" fn read_vendor_err(cq: *mut sys::ibv_cq_ex) -> u32 {
    guard(0, || cur(cq).vendor_err)
}
unsafe extern "C" fn read_byte_len(cq: *mut sys::ibv_cq_ex) -> u32 {
    guard(0, || cur(cq).byte_len)
}
unsafe extern "C" fn read_imm_data(cq: *mut sys::ibv_cq_ex) -> sys::__be32 {
    // SAFETY: both union members are plain u32.
    guard(0, || unsafe { cur(cq).__bindgen_anon_1.imm_data })
}
unsafe extern "C" fn read_qp_num(cq: *mut sys::ibv_cq_ex) -> u32 {
    guard(0, || cur(cq).qp_num)
}
unsafe extern "C" fn read_src_qp(cq: *mut sys::ibv_cq_ex) -> u32 {
    guard(0, || cur(cq).src_qp)
}
unsafe extern "C" fn read_wc_flags(cq: *mut sys::ibv_cq_ex) -> u32 {
    guard(0, || cur(cq).wc_flags)
}
unsafe extern "C" fn read_slid(cq: *mut sys::ibv_cq_ex) -> u32 {
    guard(0, || u32::from(cur(cq).slid))
}
unsafe extern "C" fn read_sl(cq: *mut sys::ibv_cq_ex) -> u8 {
    guard(0, || cur(cq).sl)
}
unsafe extern "C" fn read_dlid_path_bits(cq: *mut sys::ibv_cq_ex) -> u8 {
    guard(0, || cur(cq).dlid_path_bits)
}
unsafe extern "C" fn read_completion_ts(cq: *mut sys::ibv_cq_ex) -> u64 {
    guard(0, || {
        // SAFETY: as in `cur`.
        match unsafe { obj::<Cq, _>(cq) } {
            // SAFETY: as in `poll_next`.
            Some(q) => unsafe { (*q.ex.get()).cur.timestamp.unwrap_or(0) },
            None => 0,
        }
    })
}

// ------------------------------------------------------------------ QP ex

unsafe extern "C" fn create_qp_ex(
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
unsafe extern "C" fn bind_mw(
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
