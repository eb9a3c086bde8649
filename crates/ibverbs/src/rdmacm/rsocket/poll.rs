//! `rpoll` and `rselect`: poll(2) and select(2) over rsockets and ordinary descriptors
//! alike. An rsocket is ready as a socket would be: readable with data (or at the end of
//! its stream), writable when a send would not wait, HUP once disconnected, ERR after a
//! failed connect or a broken connection; a listener is readable with a connection to
//! accept. Waiting, an rsocket stands for the descriptors its progress comes from (its
//! completion channel and CM channel, or its accept queue).

use std::ffi::c_int;
use std::os::fd::AsRawFd;
use std::time::Instant;

use softrdma_rsocket::Phase;

use super::stream::Life;
use super::{drive, lookup, wait_slice_ms, Rsock};
use crate::{guard, minus_one};

/// The events of `rs` now (rsockets' `rs_poll_rs`, without waiting).
fn poll_rs(rs: &Rsock, events: i16) -> i16 {
    let mut g = rs.lock();
    if g.closed() {
        return libc::POLLNVAL;
    }
    if g.opening() {
        if let Err(libc::EINPROGRESS) = drive(&mut g) {
            return 0;
        }
    }
    match &g.life {
        Life::Open(sock) => {
            let sock = sock.clone();
            drop(g);
            let (readable, writable, _) = sock.readiness();
            let mut r = 0;
            if events & libc::POLLIN != 0 && readable {
                r |= libc::POLLIN;
            }
            if events & libc::POLLOUT != 0 && writable {
                r |= libc::POLLOUT;
            }
            // Hung up once the peer's data is all read: a reader that stops at POLLHUP
            // (as rdma-core's examples do) still gets every byte sent before the
            // disconnect. rdma-core's rsockets report POLLHUP at once.
            match sock.phase() {
                Phase::Disconnected if !sock.has_data() => r |= libc::POLLHUP,
                Phase::Failed(_) => r |= libc::POLLERR,
                _ => {}
            }
            r
        }
        Life::Listening(_) => {
            drop(g);
            let q = rs
                .listener
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_ref()
                .map(|l| l.queue_rd);
            let Some(q) = q else { return 0 };
            let mut p = libc::pollfd {
                fd: q,
                events,
                revents: 0,
            };
            // SAFETY: one pollfd.
            unsafe { libc::poll(&mut p, 1, 0) };
            p.revents
        }
        Life::Failed => (events & (libc::POLLIN | libc::POLLOUT)) | libc::POLLERR,
        _ => 0,
    }
}

/// The descriptors `rs`'s next event comes from, with the completion queue armed.
fn wait_fds(rs: &Rsock, out: &mut Vec<c_int>) {
    let g = rs.lock();
    match &g.life {
        Life::Listening(_) => {
            drop(g);
            if let Some(l) = rs
                .listener
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_ref()
            {
                out.push(l.queue_rd);
            }
        }
        Life::Open(sock) => {
            let sock = sock.clone();
            drop(g);
            // A completion found while arming is seen by the next look (`check`).
            sock.arm();
            out.extend(sock.fds().iter().map(|f| f.as_raw_fd()));
        }
        _ => out.extend(g.cm_fd()),
    }
}

/// Take the events that woke a wait, so the next look sees their effect.
fn take_events(rs: &Rsock, ready: &[c_int]) {
    let Some(sock) = rs.lock().socket().cloned() else {
        return;
    };
    if ready.contains(&sock.fds()[0].as_raw_fd()) {
        sock.take_events();
    }
}

/// Look at every descriptor once: how many have events.
///
/// # Safety
/// `fds` holds the program's entries.
unsafe fn check(fds: &mut [libc::pollfd]) -> c_int {
    let mut n = 0;
    for p in fds.iter_mut() {
        if let Some(rs) = lookup(p.fd) {
            p.revents = poll_rs(&rs, p.events);
        } else {
            p.revents = 0;
            // SAFETY: one pollfd of the program's.
            unsafe { libc::poll(p, 1, 0) };
        }
        if p.revents != 0 {
            n += 1;
        }
    }
    n
}

#[no_mangle]
pub unsafe extern "C" fn rpoll(
    fds: *mut libc::pollfd,
    nfds: libc::nfds_t,
    timeout: c_int,
) -> c_int {
    guard(-1, || {
        if fds.is_null() && nfds > 0 {
            return minus_one(libc::EFAULT);
        }
        let fds: &mut [libc::pollfd] = if nfds == 0 {
            &mut []
        } else {
            // SAFETY: the caller passes `nfds` entries at `fds`.
            unsafe { std::slice::from_raw_parts_mut(fds, nfds as usize) }
        };
        let start = Instant::now();
        loop {
            // SAFETY: the program's entries.
            let n = unsafe { check(fds) };
            if n > 0 || timeout == 0 {
                return n;
            }
            let left = if timeout < 0 {
                wait_slice_ms()
            } else {
                let spent = start.elapsed().as_millis().min(c_int::MAX as u128) as c_int;
                if spent >= timeout {
                    return 0;
                }
                (timeout - spent).min(wait_slice_ms())
            };
            // What to wait on: each rsocket's descriptors, each other descriptor itself.
            let mut w: Vec<libc::pollfd> = Vec::with_capacity(fds.len() * 2);
            let mut owners: Vec<Option<usize>> = Vec::new();
            for (i, p) in fds.iter().enumerate() {
                if let Some(rs) = lookup(p.fd) {
                    let mut mine = Vec::new();
                    wait_fds(&rs, &mut mine);
                    for fd in mine {
                        w.push(libc::pollfd {
                            fd,
                            events: libc::POLLIN,
                            revents: 0,
                        });
                        owners.push(Some(i));
                    }
                } else {
                    w.push(*p);
                    owners.push(None);
                }
            }
            // Arming may have found events: look again before sleeping.
            // SAFETY: the program's entries.
            let n = unsafe { check(fds) };
            if n > 0 {
                return n;
            }
            // SAFETY: `w` holds `w.len()` entries.
            let r = unsafe { libc::poll(w.as_mut_ptr(), w.len() as libc::nfds_t, left) };
            if r < 0 {
                return -1;
            }
            for (i, p) in fds.iter().enumerate() {
                let ready: Vec<c_int> = w
                    .iter()
                    .zip(&owners)
                    .filter(|(x, o)| **o == Some(i) && x.revents != 0)
                    .map(|(x, _)| x.fd)
                    .collect();
                if !ready.is_empty() {
                    if let Some(rs) = lookup(p.fd) {
                        take_events(&rs, &ready);
                    }
                }
            }
        }
    })
}

/// select(2) over rsockets, by way of `rpoll`.
#[no_mangle]
pub unsafe extern "C" fn rselect(
    nfds: c_int,
    readfds: *mut libc::fd_set,
    writefds: *mut libc::fd_set,
    exceptfds: *mut libc::fd_set,
    timeout: *mut libc::timeval,
) -> c_int {
    guard(-1, || {
        if !(0..=libc::FD_SETSIZE as c_int).contains(&nfds) {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: the caller's sets, each null or valid.
        let isset =
            |s: *mut libc::fd_set, fd: c_int| !s.is_null() && unsafe { libc::FD_ISSET(fd, s) };
        let mut p = Vec::new();
        for fd in 0..nfds {
            let mut ev = 0;
            if isset(readfds, fd) {
                ev |= libc::POLLIN;
            }
            if isset(writefds, fd) {
                ev |= libc::POLLOUT;
            }
            if ev != 0 || isset(exceptfds, fd) {
                p.push(libc::pollfd {
                    fd,
                    events: ev,
                    revents: 0,
                });
            }
        }
        let ms = if timeout.is_null() {
            -1
        } else {
            // SAFETY: the caller's timeout.
            let t = unsafe { *timeout };
            if t.tv_sec < 0 || t.tv_usec < 0 {
                return minus_one(libc::EINVAL);
            }
            (t.tv_sec.saturating_mul(1000) + t.tv_usec / 1000).min(c_int::MAX as i64) as c_int
        };
        // SAFETY: `p` holds `p.len()` entries.
        let n = unsafe { rpoll(p.as_mut_ptr(), p.len() as libc::nfds_t, ms) };
        if n < 0 {
            return n;
        }
        let mut count = 0;
        // SAFETY: the caller's sets, each null or valid.
        unsafe {
            for s in [readfds, writefds, exceptfds] {
                if !s.is_null() {
                    libc::FD_ZERO(s);
                }
            }
            for x in &p {
                if x.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0
                    && !readfds.is_null()
                    && x.events & libc::POLLIN != 0
                {
                    libc::FD_SET(x.fd, readfds);
                    count += 1;
                }
                if x.revents & (libc::POLLOUT | libc::POLLERR) != 0
                    && !writefds.is_null()
                    && x.events & libc::POLLOUT != 0
                {
                    libc::FD_SET(x.fd, writefds);
                    count += 1;
                }
                if x.revents & (libc::POLLERR | libc::POLLPRI) != 0 && !exceptfds.is_null() {
                    libc::FD_SET(x.fd, exceptfds);
                    count += 1;
                }
            }
        }
        count
    })
}
