//! The devices the connection manager uses: one context per device, opened through this
//! library's own `ibv_open_device` the first time it is needed and kept open while the
//! library is loaded, as librdmacm keeps its devices. `rdma_get_devices` hands these
//! contexts out; a CM id bound to a device is to use the same context (in librdmacm an
//! id's `verbs` is one of them), so that the program's PDs and CQs on it fit the id.

use std::ffi::{c_int, c_void};
use std::sync::Mutex;

use crate::{context, device, guard, null_errno, sys};

/// An opened context, by the address of the `ibv_device` it was opened on. Entries are
/// never removed: the contexts stay open for the life of the process. (Addresses are kept
/// as integers: they are only handed out, never dereferenced here.) `pid` is the process
/// that opened it: a forked child opens its own (see [`crate::this_process`]).
struct Open {
    dev: usize,
    ctx: usize,
    pid: u32,
}

static OPEN: Mutex<Vec<Open>> = Mutex::new(Vec::new());

/// Whether the CM can work at all: librdmacm fails its calls with ENODEV when no RDMA
/// device is listed (it checks this before anything else, without opening a device).
pub(crate) fn check() -> Result<(), c_int> {
    let mut n: c_int = 0;
    // SAFETY: `n` is a valid int; the list is freed below.
    let list = unsafe { device::ibv_get_device_list(&mut n) };
    if list.is_null() {
        return Err(libc::ENODEV);
    }
    // SAFETY: `list` came from ibv_get_device_list and is freed once.
    unsafe { device::ibv_free_device_list(list) };
    if n > 0 {
        Ok(())
    } else {
        Err(libc::ENODEV)
    }
}

/// The context of every device now listed, in list order, each opened once per process.
/// A device that fails to open is left out, as librdmacm leaves out a device it cannot
/// initialise; no device listed at all is `ENODEV`.
pub(crate) fn contexts() -> Result<Vec<*mut sys::ibv_context>, c_int> {
    let mut n: c_int = 0;
    // SAFETY: `n` is a valid int; the list is freed below.
    let list = unsafe { device::ibv_get_device_list(&mut n) };
    if list.is_null() {
        return Err(libc::ENODEV);
    }
    let n = usize::try_from(n).unwrap_or(0);
    let mut out = Vec::with_capacity(n);
    if n > 0 {
        let me = crate::this_process();
        let mut open = OPEN.lock().unwrap_or_else(|e| e.into_inner());
        // A parent's contexts are left open and unused (integers here: nothing is dropped).
        open.retain(|o| o.pid == me);
        for i in 0..n {
            // SAFETY: the list holds `n` device pointers before its NULL.
            let dev = unsafe { *list.add(i) };
            if let Some(o) = open.iter().find(|o| o.dev == dev as usize) {
                out.push(o.ctx as *mut sys::ibv_context);
                continue;
            }
            // SAFETY: `dev` is an entry of this library's device list.
            let ctx = unsafe { context::ibv_open_device(dev) };
            if ctx.is_null() {
                continue;
            }
            open.push(Open {
                dev: dev as usize,
                ctx: ctx as usize,
                pid: me,
            });
            out.push(ctx);
        }
    }
    // SAFETY: `list` came from ibv_get_device_list and is freed once.
    unsafe { device::ibv_free_device_list(list) };
    if n == 0 {
        return Err(libc::ENODEV);
    }
    Ok(out)
}

/// A NULL-terminated array of the CM's open contexts, one per device, for the program to
/// share resources (PDs, CQs) across its ids. The contexts stay open after
/// `rdma_free_devices`, which frees only the array.
#[no_mangle]
pub unsafe extern "C" fn rdma_get_devices(num_devices: *mut c_int) -> *mut *mut sys::ibv_context {
    let set_num = |v: c_int| {
        if !num_devices.is_null() {
            // SAFETY: the caller passes null or a valid int pointer.
            unsafe { *num_devices = v };
        }
    };
    set_num(0);
    guard(std::ptr::null_mut(), || {
        let ctxs = match contexts() {
            Ok(c) => c,
            Err(e) => return null_errno(e),
        };
        // malloc'd, for rdma_free_devices to free() as librdmacm does.
        let bytes = (ctxs.len() + 1) * std::mem::size_of::<*mut sys::ibv_context>();
        // SAFETY: malloc of a nonzero size; the result is checked.
        let p = unsafe { libc::malloc(bytes) }.cast::<*mut sys::ibv_context>();
        if p.is_null() {
            return null_errno(libc::ENOMEM);
        }
        // SAFETY: `p` has room for `ctxs.len() + 1` pointers.
        unsafe {
            std::ptr::copy_nonoverlapping(ctxs.as_ptr(), p, ctxs.len());
            *p.add(ctxs.len()) = std::ptr::null_mut();
        }
        set_num(c_int::try_from(ctxs.len()).unwrap_or(c_int::MAX));
        p
    })
}

/// Free an array from `rdma_get_devices` (the contexts in it stay open). NULL is ignored.
#[no_mangle]
pub unsafe extern "C" fn rdma_free_devices(list: *mut *mut sys::ibv_context) {
    guard((), || {
        // SAFETY: `list` is null or an array rdma_get_devices allocated with malloc.
        unsafe { libc::free(list.cast::<c_void>()) }
    })
}
