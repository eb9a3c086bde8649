//! What the same-host path's shared memory is made of: memfds sealed against resizing,
//! and shared mappings of them reached only through atomics and plain copies.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};

/// The seals a shared memfd must carry: its size can never change, so a peer cannot
/// truncate it under our mapping (which would turn our reads into SIGBUS).
pub(crate) const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// A fresh memfd of `len` zero bytes named `name`, sealed against resizing.
pub(crate) fn sealed_memfd(name: &std::ffi::CStr, len: usize) -> io::Result<OwnedFd> {
    // SAFETY: a valid C string; the flags are plain constants.
    let fd =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a descriptor we just got and own.
    let memfd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: plain calls on our descriptor.
    if unsafe { libc::ftruncate(memfd.as_raw_fd(), len as libc::off_t) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(memfd.as_raw_fd(), libc::F_ADD_SEALS, SEALS) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(memfd)
}

/// Refuse a peer's descriptor unless it is a memfd of exactly `len` bytes sealed against
/// shrinking and further seals, so that it stays backed for as long as we map it whatever
/// the peer does. `what` names it in the error.
pub(crate) fn check_sealed_memfd(fd: BorrowedFd<'_>, len: usize, what: &str) -> io::Result<()> {
    // SAFETY: F_GET_SEALS on a descriptor we hold; fails (EINVAL) on anything but a
    // memfd or a shmem file.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{what} descriptor is not a sealable memfd"),
        ));
    }
    if seals & (libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL)
        != (libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL)
    {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{what} memfd is not sealed against shrinking"),
        ));
    }
    // SAFETY: a zeroed stat buffer for fstat to fill.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a valid buffer for the call.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } < 0 {
        return Err(io::Error::last_os_error());
    }
    if st.st_size as u64 != len as u64 || st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{what} memfd has the wrong size"),
        ));
    }
    Ok(())
}

/// A shared read-write mapping of a whole sealed memfd.
#[derive(Debug)]
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is process-shared memory reached only through atomics and raw
// copies (see `Mapping`'s methods); it has no thread affinity.
unsafe impl Send for Mapping {}
// SAFETY: as above: every access through `&Mapping` is an atomic operation or a copy of
// plain bytes whose contents are never trusted.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Map the first `len` bytes of `fd` shared, read-write.
    pub(crate) fn map(fd: impl AsFd, len: usize) -> io::Result<Mapping> {
        // SAFETY: a fresh shared mapping chosen by the kernel (no fixed address), of a
        // memfd whose size is at least `len` and sealed against shrinking, so every byte
        // of it stays backed.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_fd().as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(p.cast::<u8>()).ok_or_else(|| io::Error::other("mmap at 0"))?;
        Ok(Mapping { ptr, len })
    }

    /// The aligned 32-bit word at `off` (panics if out of bounds or misaligned: offsets
    /// are the caller's constants, never a peer's).
    pub(crate) fn u32_at(&self, off: usize) -> &AtomicU32 {
        assert!(off % 4 == 0 && off + 4 <= self.len);
        // SAFETY: in bounds and aligned (the mapping is page-aligned), checked above;
        // AtomicU32 has the layout of u32 and any bit pattern is valid.
        unsafe { &*self.ptr.as_ptr().add(off).cast::<AtomicU32>() }
    }

    /// The aligned 64-bit word at `off`, as [`Mapping::u32_at`].
    pub(crate) fn u64_at(&self, off: usize) -> &AtomicU64 {
        assert!(off % 8 == 0 && off + 8 <= self.len);
        // SAFETY: as for `u32_at`.
        unsafe { &*self.ptr.as_ptr().add(off).cast::<AtomicU64>() }
    }

    /// The mapping's first byte.
    pub(crate) fn ptr(&self) -> NonNull<u8> {
        self.ptr
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once; no reference into it outlives
        // `self` (the atomics' lifetimes are tied to `&self`).
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}
