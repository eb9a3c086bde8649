//! Fault-safe access to registered memory.
//!
//! A program may unmap or write-protect memory it registered. A NIC has the pages pinned
//! and never notices; the device here reads and writes the program's own mappings, so a
//! plain copy from an unmapped page would kill the process with SIGSEGV (or SIGBUS past
//! the end of a mapped file). Every device access to registered memory therefore goes
//! through this module, which turns such a fault into an error the transport completes
//! as a verbs error (a local protection error, or a remote access NAK), as the spec asks.
//!
//! How (x86-64): the copy and the two 8-byte atomics are a handful of instructions in
//! `global_asm!`, each faulting instruction at a known address. A SIGSEGV/SIGBUS handler
//! looks at the faulting instruction pointer only: when it is one of those instructions,
//! it moves the instruction pointer to the routine's recovery exit, which returns "not
//! done"; any other fault goes to the handler that was there before (or the default
//! action), unchanged. This is the kernel's own exception-table technique for
//! `copy_from_user`. It keeps the fast path a plain `rep movsb`, as fast as `memcpy`, where
//! `process_vm_readv`/`process_vm_writev` on our own pid, also fault-safe, cost a system
//! call per copy, many times the copy itself at the sizes the transport moves.
//! No `setjmp`/`longjmp` is involved: the handler resumes the very routine that faulted,
//! which owns no Rust state.
//!
//! Elsewhere the copies use `process_vm_writev` on our own pid (the kernel reads and
//! writes both sides, answering EFAULT instead of a signal), and the atomics can only
//! check, just before they run, that the word is readable.
//!
//! At registration, [`check_backed`] asks the kernel to fault the range in as a pinning
//! registration does (`MADV_POPULATE_READ`, or `_WRITE` when the access lets the device
//! write), which fails where the memory is not mapped, not readable, or not writable.

use std::ffi::c_int;

use crate::error::{Errno, Error, ErrorKind};

type Result<T, E = Error> = std::result::Result<T, E>;

/// A device access stopped by a page fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Fault;

// ------------------------------------------------------------------ x86-64 routines

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod imp {
    use std::ffi::{c_int, c_void};
    use std::ptr::{addr_of, null_mut};
    use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
    use std::sync::Mutex;

    use super::Fault;

    // The symbols are hidden so that two copies of this code in one process (two shared
    // libraries that both link it) each keep their own and each handler recognizes only
    // its own instructions.
    std::arch::global_asm!(
        ".pushsection .text.softrdma_fsafe,\"ax\",@progbits",
        ".p2align 4",
        // usize softrdma_fsafe_copy(dst: rdi, src: rsi, n: rdx): bytes not copied (0: done).
        // memmove semantics: backwards when dst lies inside src..src+n.
        ".globl softrdma_fsafe_copy",
        ".hidden softrdma_fsafe_copy",
        ".type softrdma_fsafe_copy,@function",
        "softrdma_fsafe_copy:",
        "    mov rcx, rdx",
        "    mov rax, rdi",
        "    sub rax, rsi",
        "    cmp rax, rdx",
        "    jb 2f",
        ".globl softrdma_fsafe_copy_fwd",
        ".hidden softrdma_fsafe_copy_fwd",
        "softrdma_fsafe_copy_fwd:",
        "    rep movsb",
        "    xor eax, eax",
        "    ret",
        "2:",
        "    lea rsi, [rsi + rcx - 1]",
        "    lea rdi, [rdi + rcx - 1]",
        "    std",
        ".globl softrdma_fsafe_copy_bwd",
        ".hidden softrdma_fsafe_copy_bwd",
        "softrdma_fsafe_copy_bwd:",
        "    rep movsb",
        "    cld",
        "    xor eax, eax",
        "    ret",
        // Entered by the fault handler instead of resuming a faulting `rep movsb`: rcx
        // still counts the bytes left, at least the one that faulted.
        ".globl softrdma_fsafe_copy_fixup",
        ".hidden softrdma_fsafe_copy_fixup",
        "softrdma_fsafe_copy_fixup:",
        "    cld",
        "    mov rax, rcx",
        "    ret",
        ".size softrdma_fsafe_copy, . - softrdma_fsafe_copy",
        // u32 softrdma_fsafe_cas(p: rdi, expected: rsi, new: rdx, out: rcx): 0, *out = old.
        ".p2align 4",
        ".globl softrdma_fsafe_cas",
        ".hidden softrdma_fsafe_cas",
        ".type softrdma_fsafe_cas,@function",
        "softrdma_fsafe_cas:",
        "    mov rax, rsi",
        ".globl softrdma_fsafe_cas_insn",
        ".hidden softrdma_fsafe_cas_insn",
        "softrdma_fsafe_cas_insn:",
        "    lock cmpxchg qword ptr [rdi], rdx",
        "    mov qword ptr [rcx], rax",
        "    xor eax, eax",
        "    ret",
        ".size softrdma_fsafe_cas, . - softrdma_fsafe_cas",
        // u32 softrdma_fsafe_xadd(p: rdi, add: rsi, out: rdx): 0, *out = old.
        ".p2align 4",
        ".globl softrdma_fsafe_xadd",
        ".hidden softrdma_fsafe_xadd",
        ".type softrdma_fsafe_xadd,@function",
        "softrdma_fsafe_xadd:",
        "    mov rax, rsi",
        ".globl softrdma_fsafe_xadd_insn",
        ".hidden softrdma_fsafe_xadd_insn",
        "softrdma_fsafe_xadd_insn:",
        "    lock xadd qword ptr [rdi], rax",
        "    mov qword ptr [rdx], rax",
        "    xor eax, eax",
        "    ret",
        ".size softrdma_fsafe_xadd, . - softrdma_fsafe_xadd",
        // The atomics' recovery exit: 1, nothing stored.
        ".globl softrdma_fsafe_atomic_fixup",
        ".hidden softrdma_fsafe_atomic_fixup",
        "softrdma_fsafe_atomic_fixup:",
        "    mov eax, 1",
        "    ret",
        ".popsection",
    );

    extern "C" {
        fn softrdma_fsafe_copy(dst: *mut u8, src: *const u8, n: usize) -> usize;
        fn softrdma_fsafe_cas(p: *mut u64, expected: u64, new: u64, out: *mut u64) -> u32;
        fn softrdma_fsafe_xadd(p: *mut u64, add: u64, out: *mut u64) -> u32;
        // Labels, not data: only their addresses are used.
        static softrdma_fsafe_copy_fwd: u8;
        static softrdma_fsafe_copy_bwd: u8;
        static softrdma_fsafe_copy_fixup: u8;
        static softrdma_fsafe_cas_insn: u8;
        static softrdma_fsafe_xadd_insn: u8;
        static softrdma_fsafe_atomic_fixup: u8;
    }

    /// Where to resume after a fault at `pc`, if `pc` is one of our faulting instructions.
    fn recovery_for(pc: usize) -> Option<usize> {
        // Taking a label's address reads nothing.
        let a = |p: *const u8| p as usize;
        let (fwd, bwd, copy_fix) = (
            a(addr_of!(softrdma_fsafe_copy_fwd)),
            a(addr_of!(softrdma_fsafe_copy_bwd)),
            a(addr_of!(softrdma_fsafe_copy_fixup)),
        );
        let (cas, xadd, atomic_fix) = (
            a(addr_of!(softrdma_fsafe_cas_insn)),
            a(addr_of!(softrdma_fsafe_xadd_insn)),
            a(addr_of!(softrdma_fsafe_atomic_fixup)),
        );
        if pc == fwd || pc == bwd {
            Some(copy_fix)
        } else if pc == cas || pc == xadd {
            Some(atomic_fix)
        } else {
            None
        }
    }

    const SIGNALS: [c_int; 2] = [libc::SIGSEGV, libc::SIGBUS];
    /// The dispositions ours replaced, per entry of SIGNALS (null: none saved yet). Each
    /// replaced one is leaked rather than freed: a handler on another thread may be
    /// reading it.
    static PREVIOUS: [AtomicPtr<libc::sigaction>; 2] =
        [AtomicPtr::new(null_mut()), AtomicPtr::new(null_mut())];
    static INSTALLED: AtomicBool = AtomicBool::new(false);
    static INSTALL: Mutex<()> = Mutex::new(());

    fn handler_address() -> libc::sighandler_t {
        on_fault as *const () as libc::sighandler_t
    }

    /// Install the handler unless it is in place; also put it back in front when the
    /// program installed its own since (the program's then is the one chained to).
    pub(super) fn install() {
        let _g = INSTALL.lock().unwrap_or_else(|e| e.into_inner());
        for (i, &sig) in SIGNALS.iter().enumerate() {
            // SAFETY: sigaction with a null new action only reads the current one into
            // `cur`, a valid out-pointer.
            let mut cur: libc::sigaction = unsafe { std::mem::zeroed() };
            if unsafe { libc::sigaction(sig, std::ptr::null(), &mut cur) } != 0 {
                continue;
            }
            if cur.sa_sigaction == handler_address() {
                continue;
            }
            PREVIOUS[i].store(Box::into_raw(Box::new(cur)), Ordering::Release);
            // SAFETY: zeroed is a valid sigaction (empty mask, no flags); `act` is fully
            // set before use and `on_fault` has the SA_SIGINFO signature.
            let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
            act.sa_sigaction = handler_address();
            // SA_ONSTACK: a chained handler (the Rust runtime's stack-overflow report)
            // expects the alternate stack.
            act.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            // SAFETY: as above; `act` is a valid action for a synchronous fault signal.
            unsafe {
                libc::sigemptyset(&mut act.sa_mask);
                libc::sigaction(sig, &act, std::ptr::null_mut());
            }
        }
        INSTALLED.store(true, Ordering::Release);
    }

    /// The handler: recover our own faulting instructions, pass anything else on.
    extern "C" fn on_fault(sig: c_int, info: *mut libc::siginfo_t, ctx: *mut c_void) {
        // SAFETY: the kernel calls an SA_SIGINFO handler with valid `info` and a
        // `ucontext_t` at `ctx`, which the handler may modify to change where the
        // interrupted thread resumes.
        unsafe {
            // si_code > 0: raised by the kernel for a fault, not sent by kill().
            if (*info).si_code > 0 {
                let uc = ctx.cast::<libc::ucontext_t>();
                let pc = &mut (*uc).uc_mcontext.gregs[libc::REG_RIP as usize];
                if let Some(to) = recovery_for(*pc as usize) {
                    *pc = to as i64;
                    return;
                }
            }
            chain(sig, info, ctx);
        }
    }

    /// Hand a fault that is not ours to the previous disposition.
    ///
    /// # Safety
    /// Called from `on_fault` with its arguments.
    unsafe fn chain(sig: c_int, info: *mut libc::siginfo_t, ctx: *mut c_void) {
        let i = usize::from(sig == libc::SIGBUS);
        let prev = PREVIOUS[i].load(Ordering::Acquire);
        // SAFETY: a non-null PREVIOUS entry is a leaked Box, never freed.
        let prev = unsafe { prev.as_ref() };
        match prev {
            Some(p) if p.sa_sigaction != libc::SIG_DFL && p.sa_sigaction != libc::SIG_IGN => {
                if p.sa_flags & libc::SA_SIGINFO != 0 {
                    // SAFETY: an SA_SIGINFO disposition's handler has this signature.
                    let f: extern "C" fn(c_int, *mut libc::siginfo_t, *mut c_void) =
                        unsafe { std::mem::transmute(p.sa_sigaction) };
                    f(sig, info, ctx);
                } else {
                    // SAFETY: a plain disposition's handler takes the signal number.
                    let f: extern "C" fn(c_int) = unsafe { std::mem::transmute(p.sa_sigaction) };
                    f(sig);
                }
            }
            _ => {
                // The default action: restore it and let the faulting instruction run
                // again (a sent signal is raised again instead), so the process ends as
                // it would have without us.
                // SAFETY: zeroed with SIG_DFL is a valid default disposition.
                unsafe {
                    let mut dfl: libc::sigaction = std::mem::zeroed();
                    dfl.sa_sigaction = libc::SIG_DFL;
                    libc::sigaction(sig, &dfl, std::ptr::null_mut());
                    if (*info).si_code <= 0 {
                        libc::raise(sig);
                    }
                }
            }
        }
    }

    fn ready() {
        if !INSTALLED.load(Ordering::Acquire) {
            install();
        }
    }

    /// # Safety
    /// See [`super::copy`].
    pub(super) unsafe fn copy(dst: *mut u8, src: *const u8, n: usize) -> Result<(), Fault> {
        ready();
        // SAFETY: the caller's contract; a fault in the copy returns a nonzero count of
        // bytes left through the recovery exit instead of a signal.
        match unsafe { softrdma_fsafe_copy(dst, src, n) } {
            0 => Ok(()),
            _ => Err(Fault),
        }
    }

    /// # Safety
    /// See [`super::compare_swap`].
    pub(super) unsafe fn compare_swap(p: *mut u64, expected: u64, new: u64) -> Result<u64, Fault> {
        ready();
        let mut old = 0u64;
        // SAFETY: `p` is 8-byte aligned (caller); `old` is a valid out-pointer. A fault on
        // `p` returns 1 through the recovery exit.
        match unsafe { softrdma_fsafe_cas(p, expected, new, &mut old) } {
            0 => Ok(old),
            _ => Err(Fault),
        }
    }

    /// # Safety
    /// See [`super::fetch_add`].
    pub(super) unsafe fn fetch_add(p: *mut u64, add: u64) -> Result<u64, Fault> {
        ready();
        let mut old = 0u64;
        // SAFETY: as in `compare_swap`.
        match unsafe { softrdma_fsafe_xadd(p, add, &mut old) } {
            0 => Ok(old),
            _ => Err(Fault),
        }
    }
}

// ------------------------------------------------------------------ elsewhere

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
mod imp {
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::Fault;

    pub(super) fn install() {}

    /// The kernel copies both sides, answering EFAULT where a page is missing.
    unsafe fn kernel_copy(dst: *mut u8, src: *const u8, n: usize) -> Result<(), Fault> {
        let local = libc::iovec {
            iov_base: src as *mut libc::c_void,
            iov_len: n,
        };
        let remote = libc::iovec {
            iov_base: dst.cast(),
            iov_len: n,
        };
        // SAFETY: both iovecs describe the caller's ranges; the kernel validates them.
        let r = unsafe { libc::process_vm_writev(libc::getpid(), &local, 1, &remote, 1, 0) };
        if r == n as isize {
            Ok(())
        } else {
            Err(Fault)
        }
    }

    /// # Safety
    /// See [`super::copy`].
    pub(super) unsafe fn copy(dst: *mut u8, src: *const u8, n: usize) -> Result<(), Fault> {
        let overlap = (dst as usize).wrapping_sub(src as usize) < n
            || (src as usize).wrapping_sub(dst as usize) < n;
        if !overlap {
            // SAFETY: the caller's contract.
            return unsafe { kernel_copy(dst, src, n) };
        }
        // Overlapping ranges are never both registered memory the program can unmap
        // under us (device memory only); a bounce buffer keeps the kernel copy simple.
        let mut tmp = vec![0u8; n];
        // SAFETY: the caller's contract; `tmp` is our own buffer of `n` bytes.
        unsafe {
            kernel_copy(tmp.as_mut_ptr(), src, n)?;
            kernel_copy(dst, tmp.as_ptr(), n)
        }
    }

    /// Whether the word at `p` can be read now; the atomic right after is not protected
    /// against the page going away in between.
    unsafe fn probe(p: *mut u64) -> Result<(), Fault> {
        let mut v = 0u64;
        // SAFETY: reads 8 bytes at `p` through the kernel into `v`.
        unsafe { kernel_copy((&mut v as *mut u64).cast(), p.cast(), 8) }
    }

    /// # Safety
    /// See [`super::compare_swap`].
    pub(super) unsafe fn compare_swap(p: *mut u64, expected: u64, new: u64) -> Result<u64, Fault> {
        // SAFETY: the caller's contract; probed just before.
        unsafe {
            probe(p)?;
            Ok(
                match AtomicU64::from_ptr(p).compare_exchange(
                    expected,
                    new,
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                ) {
                    Ok(v) | Err(v) => v,
                },
            )
        }
    }

    /// # Safety
    /// See [`super::fetch_add`].
    pub(super) unsafe fn fetch_add(p: *mut u64, add: u64) -> Result<u64, Fault> {
        // SAFETY: as in `compare_swap`.
        unsafe {
            probe(p)?;
            Ok(AtomicU64::from_ptr(p).fetch_add(add, Ordering::SeqCst))
        }
    }
}

/// Copy `n` bytes from `src` to `dst` (the ranges may overlap); `Err(Fault)` when a page
/// of either is missing or lacks the access, in which case part of the bytes may have
/// been copied.
///
/// # Safety
/// Each range is either memory the device may access (registered memory, whose owner
/// accepted concurrent device access, or device memory), or a buffer the caller owns
/// exclusively; unmapped or protected pages are allowed.
pub(super) unsafe fn copy(dst: *mut u8, src: *const u8, n: usize) -> Result<(), Fault> {
    if n == 0 {
        return Ok(());
    }
    // SAFETY: forwarded.
    unsafe { imp::copy(dst, src, n) }
}

/// [`copy`], for the unit tests.
///
/// # Safety
/// As [`copy`].
#[cfg(test)]
pub(crate) unsafe fn copy_for_tests(dst: *mut u8, src: *const u8, n: usize) -> Result<(), Fault> {
    // SAFETY: forwarded.
    unsafe { copy(dst, src, n) }
}

/// Atomic compare-and-swap of the 8 bytes at `p` (sequentially consistent, as `lock
/// cmpxchg` is); the original value, or `Err(Fault)` with nothing changed.
///
/// # Safety
/// `p` is 8-byte aligned and lies in memory the device may access (see [`copy`]).
pub(super) unsafe fn compare_swap(p: *mut u64, expected: u64, new: u64) -> Result<u64, Fault> {
    // SAFETY: forwarded.
    unsafe { imp::compare_swap(p, expected, new) }
}

/// Atomic fetch-and-add of the 8 bytes at `p`; the original value, or `Err(Fault)`.
///
/// # Safety
/// As [`compare_swap`].
pub(super) unsafe fn fetch_add(p: *mut u64, add: u64) -> Result<u64, Fault> {
    // SAFETY: forwarded.
    unsafe { imp::fetch_add(p, add) }
}

/// Put the fault handler in front (again, when the program installed its own since).
pub(super) fn install_handler() {
    imp::install();
}

/// Whether `ptr` is at the start of a page.
pub(super) fn page_aligned(ptr: *mut u8) -> bool {
    ptr as usize % page_size() == 0
}

fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        n if n > 0 => n as usize,
        _ => 4096,
    }
}

/// Check that the process's memory backs `ptr..ptr+len` as a registration with this
/// access needs, as pinning it does for a kernel driver (`ib_umem_get`): every page
/// mapped and readable, and writable when `write` (the kernel pins with FOLL_WRITE for
/// LOCAL_WRITE, REMOTE_WRITE, REMOTE_ATOMIC and MW_BIND). The pages are faulted in, as
/// pinning does. EFAULT otherwise, the kernel's answer. A length of 0 covers the page
/// holding `ptr` (the kernel counts the pages spanned by `ptr..ptr+len` rounded out to
/// pages, which is one for an unaligned `ptr`); the caller refuses an aligned one first.
pub(super) fn check_backed(ptr: *mut u8, len: usize, write: bool) -> Result<()> {
    let page = page_size();
    let start = ptr as usize & !(page - 1);
    let end = match (ptr as usize).checked_add(len.max(1)) {
        Some(e) => match e.checked_add(page - 1) {
            Some(e) => e & !(page - 1),
            None => {
                return Err(Error::new(Errno::EINVAL, "range wraps the address space")
                    .with_kind(ErrorKind::BadAddress))
            }
        },
        None => {
            return Err(Error::new(Errno::EINVAL, "range wraps the address space")
                .with_kind(ErrorKind::BadAddress))
        }
    };
    let advice = if write {
        libc::MADV_POPULATE_WRITE
    } else {
        libc::MADV_POPULATE_READ
    };
    loop {
        // SAFETY: MADV_POPULATE_* only faults pages in as an access would (writing nothing),
        // reporting instead of signalling what would fault; it cannot change what any
        // readable byte holds.
        let r = unsafe { libc::madvise(start as *mut libc::c_void, end - start, advice) };
        if r == 0 {
            return Ok(());
        }
        match last_errno() {
            libc::EINTR | libc::EAGAIN => continue,
            // Kernels before 5.14 know no MADV_POPULATE_*.
            libc::EINVAL if !populate_supported() => return check_maps(start, end, write),
            _ => {
                return Err(Error::new(
                    Errno::EFAULT,
                    if write {
                        "memory not mapped writable by the process"
                    } else {
                        "memory not mapped readable by the process"
                    },
                ))
            }
        }
    }
}

fn last_errno() -> c_int {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// Whether the kernel has MADV_POPULATE_READ: try it on a page of our own stack.
fn populate_supported() -> bool {
    let probe = 0u8;
    let page = page_size();
    let at = (&probe as *const u8 as usize) & !(page - 1);
    // SAFETY: as in `check_backed`; the page is our stack, mapped and readable.
    unsafe { libc::madvise(at as *mut libc::c_void, page, libc::MADV_POPULATE_READ) == 0 }
}

/// The same check from /proc/self/maps, for kernels without MADV_POPULATE_*: the
/// mappings must cover `start..end` without a gap, readable (and writable when `write`).
fn check_maps(start: usize, end: usize, write: bool) -> Result<()> {
    let refused = || Error::new(Errno::EFAULT, "memory not mapped by the process as needed");
    let maps = std::fs::read_to_string("/proc/self/maps").map_err(|_| refused())?;
    let mut at = start;
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (Some(range), Some(perms)) = (f.next(), f.next()) else {
            continue;
        };
        let Some((a, b)) = range.split_once('-') else {
            continue;
        };
        let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) else {
            continue;
        };
        if b <= at {
            continue;
        }
        if a > at {
            break;
        }
        let p = perms.as_bytes();
        if p.first() != Some(&b'r') || (write && p.get(1) != Some(&b'w')) {
            break;
        }
        at = b;
        if at >= end {
            return Ok(());
        }
    }
    Err(refused())
}
