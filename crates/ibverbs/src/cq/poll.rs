//! Taking completions: `ibv_poll_cq`, and the `ibv_start_poll` API of `ibv_cq_ex`, which
//! makes one completion current at a time for the program to read field by field
//! (completion timestamps among them).

use std::ffi::c_int;

use softrdma_device::verbs::{self, WcFlags, WorkCompletion};

use super::Cq;
use crate::object::{errno, obj};
use crate::{guard, sys, zeroed};

/// `ibv_wc` of an engine completion.
fn wc_to_c(w: &WorkCompletion) -> sys::ibv_wc {
    let mut o: sys::ibv_wc = zeroed();
    o.wr_id = w.wr_id;
    o.status = w.status as u32;
    o.opcode = w.opcode as u32;
    o.vendor_err = w.vendor_err;
    o.byte_len = w.byte_len;
    if w.wc_flags.contains(WcFlags::WITH_INV) {
        o.__bindgen_anon_1.invalidated_rkey = w.imm_data;
    } else {
        o.__bindgen_anon_1.imm_data = w.imm_data.to_be();
    }
    o.qp_num = w.qp_num;
    o.src_qp = w.src_qp;
    o.wc_flags = w.wc_flags.bits();
    o.pkey_index = w.pkey_index;
    o.slid = w.slid;
    o.sl = w.sl;
    o.dlid_path_bits = w.dlid_path_bits;
    o
}

/// Take completions without driving progress ([`softrdma_device::CqPoller::take`]).
fn poll_quick(cq: &Cq, out: &mut [WorkCompletion]) -> verbs::Result<usize> {
    let Some(ctx) = cq.ctx() else {
        return Err(verbs::Error::inval("CQ without context"));
    };
    cq.poller.take(ctx.dev(), out)
}

/// Poll, driving progress when the CQ is empty ([`softrdma_device::CqPoller::poll`]).
fn poll_progress(cq: &Cq, out: &mut [WorkCompletion]) -> verbs::Result<usize> {
    let Some(ctx) = cq.ctx() else {
        return Err(verbs::Error::inval("CQ without context"));
    };
    cq.poller.poll(ctx.dev(), out)
}

pub(crate) unsafe extern "C" fn poll_cq(
    cq: *mut sys::ibv_cq,
    num_entries: c_int,
    wc: *mut sys::ibv_wc,
) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a CQ of this library.
        let Some(q) = (unsafe { obj::<Cq, _>(cq) }) else {
            return -1;
        };
        if num_entries <= 0 {
            return 0;
        }
        if wc.is_null() {
            return -1;
        }
        let Some(ctx) = q.ctx() else {
            return -1;
        };
        let want = num_entries as usize;
        let polled = q.poller.poll_each(ctx.dev(), want, |i, w| {
            // SAFETY: `poll_each` hands out indices below `want`, and the caller's array
            // holds `num_entries` = `want` entries.
            unsafe { wc.add(i).write(wc_to_c(w)) }
        });
        match polled {
            Ok(n) => n as c_int,
            Err(_) => -1,
        }
    })
}

/// State of a CQ's `ibv_start_poll` API.
#[derive(Default)]
pub(crate) struct CqPoll {
    /// The completion `ibv_start_poll`/`ibv_next_poll` made current.
    pub(crate) cur: WorkCompletion,
}

/// The `ibv_start_poll` API of an `ibv_cq_ex`.
pub(super) fn init_cq_ex(c: &mut sys::ibv_cq_ex) {
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
    c.read_completion_wallclock_ns = Some(read_completion_wallclock_ns);
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
            // SAFETY: the `ibv_start_poll` API is single-threaded per CQ (verbs.h: the
            // program serialises start/next/end_poll and the readers on one CQ).
            unsafe {
                (*q.poll_state.get()).cur = w[0];
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
        Some(q) => wc_to_c(unsafe { &(*q.poll_state.get()).cur }),
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
/// The current completion's time as real time, nanoseconds since the Unix epoch (see
/// `Device::wallclock_ns`); 0 when the CQ records no times.
unsafe extern "C" fn read_completion_wallclock_ns(cq: *mut sys::ibv_cq_ex) -> u64 {
    guard(0, || {
        // SAFETY: as in `cur`.
        let Some(q) = (unsafe { obj::<Cq, _>(cq) }) else {
            return 0;
        };
        // SAFETY: as in `poll_next`.
        let ts = unsafe { (*q.poll_state.get()).cur.timestamp };
        match (ts, q.ctx()) {
            (Some(t), Some(ctx)) => ctx.dev().wallclock_ns(t),
            _ => 0,
        }
    })
}
unsafe extern "C" fn read_completion_ts(cq: *mut sys::ibv_cq_ex) -> u64 {
    guard(0, || {
        // SAFETY: as in `cur`.
        match unsafe { obj::<Cq, _>(cq) } {
            // SAFETY: as in `poll_next`.
            Some(q) => unsafe { (*q.poll_state.get()).cur.timestamp.unwrap_or(0) },
            None => 0,
        }
    })
}
