//! Opening and closing a context, and the function table verbs.h's inline calls reach
//! through it (`ibv_poll_cq`, `ibv_post_send`, `ibv_create_cq_ex`, …).
//!
//! The table names entry points of every object's module, so it is filled here, above
//! them: device.rs, where they all find `Ctx`, depends on none of them.

use std::ffi::{c_int, c_void};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, IntoRawFd, OwnedFd};
use std::sync::Arc;

use crate::device::{self, CmdFile, Ctx};
use crate::{cq, dm, mr, mw, pd, qp, srq};
use crate::{guard, null_errno, sys, zeroed};

fn init_ops(v: &mut sys::verbs_context) {
    v.query_port = Some(device::query_port_ex);
    v.query_device_ex = Some(device::query_device_ex);
    v.query_rt_values = Some(device::query_rt_values);
    v.create_cq_ex = Some(cq::create_cq_ex);
    v.create_qp_ex = Some(qp::create_qp_ex);
    v.alloc_dm = Some(dm::alloc_dm);
    v.free_dm = Some(dm::free_dm);
    v.reg_dm_mr = Some(dm::reg_dm_mr);
    v.advise_mr = Some(mr::advise_mr);
    v.alloc_td = Some(pd::alloc_td);
    v.dealloc_td = Some(pd::dealloc_td);
    v.alloc_parent_domain = Some(pd::alloc_parent_domain);
    let ops = &mut v.context.ops;
    ops.poll_cq = Some(cq::poll_cq);
    ops.req_notify_cq = Some(cq::req_notify_cq);
    ops.post_send = Some(qp::post_send);
    ops.post_recv = Some(qp::post_recv);
    ops.post_srq_recv = Some(srq::post_srq_recv);
    ops.alloc_mw = Some(mw::alloc_mw);
    ops.dealloc_mw = Some(mw::dealloc_mw);
    ops.bind_mw = Some(qp::bind_mw);
}

#[no_mangle]
pub unsafe extern "C" fn ibv_open_device(device: *mut sys::ibv_device) -> *mut sys::ibv_context {
    guard(std::ptr::null_mut(), || {
        // SAFETY: caller passes a device from our list.
        let Some(d) = (unsafe { device::dev_of(device) }) else {
            return null_errno(libc::EINVAL);
        };
        let (d, shared) = match device::open(d) {
            Ok(v) => v,
            Err(e) => return null_errno(e),
        };
        match device::new_cmd_file(d, shared) {
            Ok((cmd, fd)) => new_context(cmd, fd).unwrap_or_else(|(e, _)| null_errno(e)),
            Err(e) => null_errno(e),
        }
    })
}

/// A context on the command file `cmd`, owning the descriptor `cmd_fd` of it; on failure
/// the errno and the descriptor back.
fn new_context(
    cmd: Arc<CmdFile>,
    cmd_fd: OwnedFd,
) -> Result<*mut sys::ibv_context, (c_int, OwnedFd)> {
    let shared = Arc::clone(&cmd.shared);
    let asyn = match shared.new_ctx_async() {
        Ok(a) => a,
        Err(e) => return Err((e, cmd_fd)),
    };
    let mut vctx: sys::verbs_context = zeroed();
    vctx.sz = std::mem::size_of::<sys::verbs_context>();
    init_ops(&mut vctx);
    let c = &mut vctx.context;
    c.device = std::ptr::addr_of!(cmd.dev.dev).cast_mut();
    c.cmd_fd = cmd_fd.as_raw_fd();
    c.async_fd = asyn.fd();
    c.num_comp_vectors = 1;
    c.abi_compat = usize::MAX as *mut c_void; // __VERBS_ABI_IS_EXTENDED
    let b = Box::new(Ctx {
        vctx,
        shared: shared.clone(),
        dev: cmd.dev,
        asyn: asyn.clone(),
        cmd,
        cmd_fd,
    });
    // Routed to under the address objects' `context` fields hold, known once boxed.
    shared.add_ctx(b.c_ptr() as usize, asyn);
    Ok(b.into_raw())
}

/// A second context on the objects of the context whose `cmd_fd` this is a dup of (see
/// `device::CmdFile`); it owns `cmd_fd` from here on and closes it with
/// `ibv_close_device`. A descriptor that is no context's of this process is EOPNOTSUPP
/// (and stays the caller's, as on any failure).
#[no_mangle]
pub unsafe extern "C" fn ibv_import_device(cmd_fd: c_int) -> *mut sys::ibv_context {
    guard(std::ptr::null_mut(), || {
        if cmd_fd < 0 {
            return null_errno(libc::EBADF);
        }
        // SAFETY: only looked at (fstat) while the call lasts; a descriptor that is not
        // open fails that with EBADF.
        let borrowed = unsafe { BorrowedFd::borrow_raw(cmd_fd) };
        match device::find_cmd_file(borrowed) {
            // SAFETY: the program hands the descriptor over, as ibv_import_device documents
            // (the context closes it); on failure it goes back to the program unclosed.
            Ok(cmd) => match new_context(cmd, unsafe { OwnedFd::from_raw_fd(cmd_fd) }) {
                Ok(c) => c,
                Err((e, fd)) => {
                    let _ = fd.into_raw_fd();
                    null_errno(e)
                }
            },
            Err(e) => null_errno(e),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_close_device(context: *mut sys::ibv_context) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: caller passes a context from ibv_open_device.
        if unsafe { Ctx::from_ptr(context) }.is_none() {
            return libc::EINVAL;
        }
        // SAFETY: as above; the program closes a context once.
        let b = unsafe { Ctx::from_raw(context) };
        b.shared.remove_ctx(context as usize);
        // The command descriptor closes with it; the device (its thread and socket) closes
        // with its last context.
        drop(b);
        0
    })
}
