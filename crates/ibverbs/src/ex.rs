//! Extended verbs: `ibv_qp_ex` (the `ibv_wr_*` send API), `ibv_cq_ex` (the
//! `ibv_start_poll` API), device memory, memory windows, `ibv_query_device_ex`.

use softrdma_device::verbs::{MwId, SendWr, WorkCompletion};

use crate::{null_errno, sys};

/// Extended polling state of a CQ.
#[derive(Default)]
#[allow(dead_code)] // used by the extended poll API
pub(crate) struct CqPoll {
    /// The completion `ibv_start_poll`/`ibv_next_poll` made current.
    pub(crate) cur: WorkCompletion,
}

/// The send WRs being built between `ibv_wr_start` and `ibv_wr_complete`.
#[derive(Default)]
#[allow(dead_code)] // used by the ibv_wr_* API
pub(crate) struct WrBuild {
    pub(crate) wrs: Vec<SendWr>,
    pub(crate) err: i32,
}

/// A memory window.
#[repr(C)]
pub(crate) struct Mw {
    pub(crate) c: sys::ibv_mw,
    pub(crate) id: MwId,
}

pub(crate) fn init_ops(_v: &mut sys::verbs_context) {}

pub(crate) fn init_qp_ex(_q: &mut sys::ibv_qp_ex) {}

#[no_mangle]
pub extern "C" fn ibv_qp_to_qp_ex(_qp: *mut sys::ibv_qp) -> *mut sys::ibv_qp_ex {
    null_errno(libc::EOPNOTSUPP)
}
