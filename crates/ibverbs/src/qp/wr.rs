//! The `ibv_wr_*` API of `ibv_qp_ex`: a program builds send work requests field by field
//! between `ibv_wr_start` and `ibv_wr_complete`, which posts them as `ibv_post_send` does.

use std::ffi::{c_int, c_void};

use softrdma_device::verbs::{SendFlags, SendOp, SendWr, Sge, UdDest};

use super::post::post_sends;
use super::Qp;
use crate::ah::Ah;
use crate::mw::mw_bind;
use crate::object::obj;
use crate::{guard, sys};

/// The send WRs being built between `ibv_wr_start` and `ibv_wr_complete` (inline data
/// already copied into them).
#[derive(Default)]
pub(crate) struct WrBuild {
    pub(crate) wrs: Vec<SendWr>,
    err: c_int,
}

/// The `ibv_wr_*` API of a new QP.
pub(super) fn init_qp_ex(q: &mut sys::ibv_qp_ex) {
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
        let b = unsafe { &mut *q.wr.get() };
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
