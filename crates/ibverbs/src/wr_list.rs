//! The linked lists of work requests that `ibv_post_send`, `ibv_post_recv` and
//! `ibv_post_srq_recv` take: walking them, translating their SGEs, and naming the first
//! one that failed in `bad_wr`.

use std::ffi::c_int;

use softrdma_device::verbs::{RecvWr, Sge};

use crate::sys;

/// The scatter/gather list of a C work request.
///
/// # Safety
/// `sg` points at `n` SGEs (or `n` is 0).
pub(crate) unsafe fn sges(sg: *const sys::ibv_sge, n: c_int) -> Result<Vec<Sge>, c_int> {
    if n < 0 || (n > 0 && sg.is_null()) {
        return Err(libc::EINVAL);
    }
    if n == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: per the contract.
    let s = unsafe { std::slice::from_raw_parts(sg, n as usize) };
    Ok(s.iter()
        .map(|e| Sge {
            addr: e.addr,
            length: e.length,
            lkey: e.lkey,
        })
        .collect())
}

/// Walk a C list, translating each element until one fails.
///
/// # Safety
/// `first` is null or a valid list whose `next` pointers are valid.
pub(crate) unsafe fn walk<C, T>(
    first: *mut C,
    next: impl Fn(&C) -> *mut C,
    mut conv: impl FnMut(&C) -> Result<T, c_int>,
) -> (Vec<T>, Vec<*mut C>, Option<c_int>) {
    let mut out = Vec::new();
    let mut ptrs = Vec::new();
    let mut p = first;
    while !p.is_null() {
        // SAFETY: per the contract.
        let c = unsafe { &*p };
        ptrs.push(p);
        match conv(c) {
            Ok(t) => out.push(t),
            Err(e) => return (out, ptrs, Some(e)),
        }
        p = next(c);
    }
    (out, ptrs, None)
}

/// Finish a post: report the first failing WR through `bad`.
///
/// # Safety
/// `bad` is null or a valid out pointer.
pub(crate) unsafe fn finish<C>(
    ptrs: &[*mut C],
    conv_err: Option<c_int>,
    posted: Result<(), (usize, c_int)>,
    bad: *mut *mut C,
) -> c_int {
    let fail = match posted {
        Err((i, e)) => Some((i, e)),
        Ok(()) => conv_err.map(|e| (ptrs.len() - 1, e)),
    };
    match fail {
        None => 0,
        Some((i, e)) => {
            if !bad.is_null() {
                // SAFETY: per the contract.
                unsafe { *bad = ptrs.get(i).copied().unwrap_or(std::ptr::null_mut()) };
            }
            e
        }
    }
}

/// Translate one `ibv_recv_wr`: QPs and SRQs take the same.
pub(crate) fn recv_wr(w: &sys::ibv_recv_wr) -> Result<RecvWr, c_int> {
    Ok(RecvWr {
        wr_id: w.wr_id,
        // SAFETY: the caller's WR names `num_sge` valid SGEs.
        sg_list: unsafe { sges(w.sg_list, w.num_sge) }?,
    })
}
