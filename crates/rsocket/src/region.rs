//! Memory the RNIC reads and writes: page-aligned, zeroed, owned by a connection and
//! registered by its driver. A peer's RDMA WRITEs change it at any time, so it is never
//! handed out as a Rust reference; every access is a copy or a volatile read through a
//! raw pointer, bounds-checked here.

use std::ptr;

/// A page-aligned zeroed buffer of fixed length.
pub struct Region {
    ptr: *mut u8,
    len: usize,
    layout: std::alloc::Layout,
}

// SAFETY: the region is plain memory owned by one connection; every access goes through
// `&self`/`&mut self` methods that copy, and the RNIC's accesses are the protocol's to
// order (the connection only reads bytes a completion said are written).
unsafe impl Send for Region {}
// SAFETY: as above; shared access only reads.
unsafe impl Sync for Region {}

impl Region {
    /// `len` zeroed bytes (at least one), page-aligned; None when memory is short.
    pub fn new(len: usize) -> Option<Region> {
        let layout = std::alloc::Layout::from_size_align(len.max(1), 4096).ok()?;
        // SAFETY: the layout's size is not zero.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return None;
        }
        Some(Region { ptr, len, layout })
    }

    /// The address the RNIC uses (and the driver registers).
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }

    /// The raw pointer, for registration only.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Its length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty (never: a region has at least one byte).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn check(&self, off: usize, n: usize) {
        assert!(
            off.checked_add(n).is_some_and(|e| e <= self.len),
            "region access {off}+{n} past {}",
            self.len
        );
    }

    /// Copy `src` into the region at `off`.
    pub(crate) fn write(&mut self, off: usize, src: &[u8]) {
        self.check(off, src.len());
        // SAFETY: in bounds (checked); the region and `src` do not overlap (`src` is a
        // Rust slice, the region is never one).
        unsafe { ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(off), src.len()) };
    }

    /// Copy `dst.len()` bytes from the region at `off` into `dst`.
    pub(crate) fn read(&self, off: usize, dst: &mut [u8]) {
        self.check(off, dst.len());
        // SAFETY: in bounds (checked); no overlap, as above. The bytes were written by
        // the RNIC before the completion that made the caller read them.
        unsafe { ptr::copy_nonoverlapping(self.ptr.add(off), dst.as_mut_ptr(), dst.len()) };
    }

    /// Let `f` fill `n` bytes at `off` in place. Only for bytes no RNIC reads or writes
    /// now: free bytes of a send buffer, which the device reads only once a work request
    /// naming them is posted.
    pub(crate) fn fill(&mut self, off: usize, n: usize, f: impl FnOnce(&mut [u8])) {
        self.check(off, n);
        // SAFETY: in bounds (checked); per this function's contract nothing else reads
        // or writes these bytes while the slice lives, and the region outlives it.
        f(unsafe { std::slice::from_raw_parts_mut(self.ptr.add(off), n) });
    }

    /// `N` bytes at `off`, read volatile: a peer may be writing elsewhere in the region
    /// and the compiler must not cache these across completions.
    pub(crate) fn read_volatile<const N: usize>(&self, off: usize) -> [u8; N] {
        self.check(off, N);
        let mut out = [0u8; N];
        for (i, b) in out.iter_mut().enumerate() {
            // SAFETY: in bounds (checked).
            *b = unsafe { ptr::read_volatile(self.ptr.add(off + i)) };
        }
        out
    }

    /// Write `N` bytes at `off` volatile (an entry the peer also writes).
    pub(crate) fn write_volatile<const N: usize>(&mut self, off: usize, v: [u8; N]) {
        self.check(off, N);
        for (i, b) in v.iter().enumerate() {
            // SAFETY: in bounds (checked).
            unsafe { ptr::write_volatile(self.ptr.add(off + i), *b) };
        }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout; freed once. The driver deregisters
        // the region (and destroys the QP that could write it) before dropping it.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Region({:#x}, {})", self.addr(), self.len)
    }
}
