//! Extended verbs (milestone 3: not yet implemented).

use crate::{null_errno, sys};

pub(crate) fn init_ops(_v: &mut sys::verbs_context) {}

#[no_mangle]
pub extern "C" fn ibv_qp_to_qp_ex(_qp: *mut sys::ibv_qp) -> *mut sys::ibv_qp_ex {
    null_errno(libc::EOPNOTSUPP)
}
