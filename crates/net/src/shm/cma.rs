//! Cross-memory attach (`process_vm_readv` / `process_vm_writev`) between the processes of
//! two same-host devices: probed per peer with a real call, never assumed. It is refused
//! in places: Yama's `ptrace_scope` of 1 and up, container seccomp profiles, another user
//! or PID namespace.
//!
//! Each process has a cookie, a random word in its memory. A device tells its peers where
//! the cookie is and what it holds; a peer reads it with `process_vm_readv` and compares:
//! the same word at the same address means the call works and reaches that very process
//! (not one that reused its PID).

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};

/// This process's cookie (0 until first asked for).
static COOKIE: AtomicU64 = AtomicU64::new(0);

/// The address and value of this process's cookie.
pub(crate) fn cookie() -> (u64, u64) {
    let mut v = COOKIE.load(Ordering::Acquire);
    if v == 0 {
        let mut fresh = 0u64;
        while fresh == 0 {
            let mut b = [0u8; 8];
            // Best effort: a cookie only has to differ from what another process holds
            // at that address, which a PID reuse would make of it.
            // SAFETY: `b` is valid for 8 bytes of writes.
            let _ = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
            fresh = u64::from_ne_bytes(b) | 1;
        }
        v = match COOKIE.compare_exchange(0, fresh, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => fresh,
            Err(old) => old,
        };
    }
    (COOKIE.as_ptr() as u64, v)
}

/// Whether this process may copy into and out of process `pid` (in our PID namespace; 0
/// if it is in another one): `Ok` if reading 8 bytes at `addr` there gives `expect`,
/// else why not, in words for `softrdma stats`.
pub(crate) fn probe(pid: i32, addr: u64, expect: u64) -> Result<(), String> {
    if pid <= 0 {
        return Err("the device there is in another PID namespace".into());
    }
    let mut got = [0u8; 8];
    let local = libc::iovec {
        iov_base: got.as_mut_ptr().cast(),
        iov_len: got.len(),
    };
    let remote = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: 8,
    };
    // SAFETY: `local` describes our own 8-byte buffer, valid for writes for the call;
    // `remote` names memory of the other process, which the kernel checks (a wrong
    // address is EFAULT, never a write here beyond `got`).
    let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            Some(libc::EPERM) => match ptrace_scope() {
                Some(s) if s >= 1 => {
                    format!("cross-memory attach refused: Yama ptrace_scope is {s} (0 allows it)")
                }
                _ => "cross-memory attach refused (EPERM: a seccomp profile, or missing \
                      capabilities)"
                    .into(),
            },
            Some(libc::ENOSYS) => "process_vm_readv is not available (ENOSYS)".into(),
            Some(libc::ESRCH) => "the process of the device there is gone".into(),
            _ => format!("cross-memory attach failed: {e}"),
        });
    }
    if n != 8 || u64::from_ne_bytes(got) != expect {
        return Err("cross-memory attach reached another process (a reused PID?)".into());
    }
    Ok(())
}

/// Copy `data` into process `pid` at `remote`, all of it: one `process_vm_writev` (and
/// more if the kernel copied part). An error if the kernel refuses or the target's memory
/// is not there (EFAULT), with what was copied before unknown to the caller but harmless
/// (it is inside a region the caller holds).
pub fn write_to(pid: i32, remote: u64, data: &[u8]) -> io::Result<()> {
    // SAFETY: `data` is our own slice, readable for the call (the kernel only reads it).
    unsafe { writev_to(pid, remote, &[(data.as_ptr() as u64, data.len())]) }
}

/// Copy the pieces `src` of this process (address, length; in order) into process `pid`
/// from `remote` on, all of them: `process_vm_writev`, again past what a call copied.
///
/// # Safety
/// Every piece of `src` is memory of this process the caller may read for the call (the
/// kernel reads it; a piece that is not mapped fails the call with EFAULT instead).
pub unsafe fn writev_to(pid: i32, remote: u64, src: &[(u64, usize)]) -> io::Result<()> {
    // SAFETY: the caller's contract, for the pieces the kernel reads.
    unsafe { copy(pid, remote, src, Way::Out) }
}

/// Copy process `pid`'s memory from `remote` on into the pieces `dst` of this process
/// (address, length; in order), all of them: `process_vm_readv`, again past what a call
/// copied.
///
/// # Safety
/// Every piece of `dst` is memory of this process the caller may overwrite for the call,
/// with nothing else reading or writing it meanwhile (the kernel writes it; a piece that
/// is not mapped fails the call with EFAULT instead, after what it copied before).
pub unsafe fn readv_from(pid: i32, remote: u64, dst: &[(u64, usize)]) -> io::Result<()> {
    // SAFETY: the caller's contract, for the pieces the kernel writes.
    unsafe { copy(pid, remote, dst, Way::In) }
}

/// Most pieces one `process_vm_*` call takes (the kernel's UIO_MAXIOV).
const IOV_MAX: usize = 1024;
/// Pieces [`copy`] lists on the stack.
const IOV_ON_STACK: usize = 8;

/// Which way [`copy`] copies.
#[derive(Clone, Copy)]
enum Way {
    /// From our pieces into the other process.
    Out,
    /// From the other process into our pieces.
    In,
}

/// The loop of [`writev_to`] and [`readv_from`].
///
/// # Safety
/// Their contracts, for `Out` and `In`.
unsafe fn copy(pid: i32, remote: u64, local: &[(u64, usize)], way: Way) -> io::Result<()> {
    let total: usize = local.iter().map(|p| p.1).sum();
    let mut done = 0usize;
    // A few pieces (the usual case: one SGE) go on the stack, more in a vector: this is on
    // the path of every placed WRITE, a latency test's included.
    let empty = libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    };
    let mut stack = [empty; IOV_ON_STACK];
    let mut heap = Vec::new();
    let room = local.len().min(IOV_MAX);
    let buf: &mut [libc::iovec] = if room <= IOV_ON_STACK {
        &mut stack[..room]
    } else {
        heap.resize(room, empty);
        &mut heap
    };
    while done < total {
        // The pieces from `done` on (the first cut where a call stopped); at most
        // IOV_MAX, what one call takes: a longer list goes in several calls.
        let mut skip = done;
        let mut used = 0;
        for &(a, n) in local {
            if skip >= n {
                skip -= n;
                continue;
            }
            buf[used] = libc::iovec {
                iov_base: (a + skip as u64) as *mut libc::c_void,
                iov_len: n - skip,
            };
            skip = 0;
            used += 1;
            if used == buf.len() {
                break;
            }
        }
        let iov = &buf[..used];
        let want: usize = iov.iter().map(|v| v.iov_len).sum();
        let target = libc::iovec {
            iov_base: (remote + done as u64) as *mut libc::c_void,
            iov_len: want,
        };
        let (ptr, cnt) = (iov.as_ptr(), iov.len() as u64);
        let n = match way {
            // SAFETY: the local pieces are readable memory of this process (the caller's
            // contract); `target` names memory of the other process, checked by the kernel.
            Way::Out => unsafe { libc::process_vm_writev(pid, ptr, cnt, &target, 1, 0) },
            // SAFETY: the local pieces are memory of this process the caller lets the
            // kernel write (its contract); `target` is checked by the kernel as above.
            Way::In => unsafe { libc::process_vm_readv(pid, ptr, cnt, &target, 1, 0) },
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "nothing copied"));
        }
        done += n as usize;
    }
    Ok(())
}

/// Yama's `ptrace_scope`, if the module is there.
fn ptrace_scope() -> Option<u32> {
    std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .ok()?
        .trim()
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_reads_its_own_cookie_and_not_a_wrong_one() {
        let (addr, v) = cookie();
        assert_ne!(v, 0);
        assert_eq!(cookie(), (addr, v), "one cookie per process");
        let me = std::process::id() as i32;
        assert_eq!(probe(me, addr, v), Ok(()));
        assert!(probe(me, addr, v ^ 1)
            .unwrap_err()
            .contains("another process"));
        assert!(probe(0, addr, v).unwrap_err().contains("PID namespace"));
        // Memory that is not mapped: refused by the kernel, not a crash.
        assert!(probe(me, 8, v).is_err());
    }

    #[test]
    fn a_child_process_is_probed_through_the_kernel() {
        // Another program's process: whatever is at our cookie's address there (if
        // anything is mapped), it is not our cookie.
        let (addr, v) = cookie();
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let r = probe(child.id() as i32, addr, v);
        let _ = child.kill();
        let _ = child.wait();
        assert!(r.is_err(), "{r:?}");
    }
}
