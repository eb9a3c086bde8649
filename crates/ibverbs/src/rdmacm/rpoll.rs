//! `rpoll`: librdmacm's poll() over rsockets and ordinary descriptors alike. Programs of
//! rdmacm-utils (rping, ucmatose, udaddy, mckey, cmtime) wait on their event channel's
//! fd with it. softrdma's library makes no rsockets, so every descriptor a program can
//! pass is an ordinary one, and `rpoll` is poll(2) on it.

use std::ffi::c_int;

use crate::guard;

#[no_mangle]
pub unsafe extern "C" fn rpoll(
    fds: *mut libc::pollfd,
    nfds: libc::nfds_t,
    timeout: c_int,
) -> c_int {
    // SAFETY: the caller passes `nfds` pollfd entries at `fds`, as poll(2) requires.
    guard(-1, || unsafe { libc::poll(fds, nfds, timeout) })
}
