//! Access to registered memory and device memory: the one place the device reads and
//! writes memory it does not own as Rust values.

use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use super::Context;

/// The address of memory the device reads and writes on its own, from whichever thread runs
/// it: a registered region or a device-memory buffer. The context keeps addresses rather
/// than references because the program accesses that memory too (the DMA model); they are
/// dereferenced only through a [`MemSpan`], after a bounds check.
#[derive(Debug, Clone, Copy)]
pub(super) struct DmaPtr(*mut u8);

// SAFETY: every DmaPtr comes from `DmaPtr::new`, whose contract is that the memory may be
// read and written from any thread while the DmaPtr is in use (or that the pointer addresses
// no memory at all); moving the address to another thread is therefore no different from
// using it on this one.
unsafe impl Send for DmaPtr {}

impl DmaPtr {
    /// An address of memory the device may access.
    ///
    /// # Safety
    /// The memory at `ptr` must stay valid for reads and writes, from any thread, for as long
    /// as the DmaPtr (or one derived from it with [`DmaPtr::offset`]) is used to access it;
    /// a pointer to nothing (a dangling one, for zero bytes) is never used to access memory.
    pub(super) unsafe fn new(ptr: *mut u8) -> DmaPtr {
        DmaPtr(ptr)
    }
    /// The raw address.
    pub(super) fn get(self) -> *mut u8 {
        self.0
    }
    /// The address `n` bytes further on, in the same memory once the caller has checked
    /// the bounds.
    pub(super) fn offset(self, n: usize) -> DmaPtr {
        DmaPtr(self.0.wrapping_add(n))
    }
}

/// A checked window into registered memory, valid while the context is borrowed.
///
/// Made only by the context's key checks, so its pointer and length lie inside a live
/// registration whose owner promised (at registration) that the memory stays valid.
#[derive(Debug)]
pub struct MemSpan<'a> {
    ptr: *mut u8,
    len: usize,
    _ctx: PhantomData<&'a Context>,
}

impl MemSpan<'_> {
    /// A span over `len` bytes at `ptr`. Callers guarantee `ptr..ptr+len` lies inside a live
    /// registration (or `len` is 0 and `ptr` is non-null).
    pub(super) fn new(ptr: *mut u8, len: usize) -> Self {
        MemSpan {
            ptr,
            len,
            _ctx: PhantomData,
        }
    }
    /// An empty span (zero-length operations).
    pub(super) fn empty() -> Self {
        MemSpan::new(NonNull::<u8>::dangling().as_ptr(), 0)
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Whether `offset..offset+n` lies inside the span.
    fn fits(&self, offset: usize, n: usize) -> bool {
        matches!(offset.checked_add(n), Some(end) if end <= self.len)
    }
    /// Copy `data` in at `offset`; false (and nothing written) if it would not fit.
    pub fn write(&self, offset: usize, data: &[u8]) -> bool {
        if !self.fits(offset, data.len()) {
            return false;
        }
        if data.is_empty() {
            return true;
        }
        // SAFETY: `offset + data.len() <= self.len` (checked above) and the span lies inside
        // a live registration valid for writes (MemSpan invariant, kept while the context is
        // borrowed, so it cannot be deregistered). Raw copy, no reference to the registered
        // bytes is formed; `ptr::copy` tolerates overlap with `data`.
        unsafe { std::ptr::copy(data.as_ptr(), self.ptr.add(offset), data.len()) };
        true
    }
    /// Copy out from `offset`; false (and nothing read) if out of bounds.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> bool {
        if !self.fits(offset, out.len()) {
            return false;
        }
        if out.is_empty() {
            return true;
        }
        // SAFETY: bounds checked above; the span lies inside a live registration valid for
        // reads (MemSpan invariant). Raw copy into the caller's exclusive buffer.
        unsafe { std::ptr::copy(self.ptr.add(offset), out.as_mut_ptr(), out.len()) };
        true
    }
    /// The 8-byte atomic at `offset`, if in bounds and 8-byte aligned.
    fn atomic_at(&self, offset: usize) -> Option<&AtomicU64> {
        if !self.fits(offset, 8) {
            return None;
        }
        let p = self.ptr.wrapping_add(offset);
        if (p as usize) % 8 != 0 {
            return None;
        }
        // SAFETY: `p..p+8` lies inside the span (checked), is 8-byte aligned (checked) and
        // stays valid for reads and writes while the context is borrowed, which bounds the
        // returned reference's lifetime (elided to `&self`). All of the device's accesses to
        // registered memory are raw copies or atomics; concurrent plain access by the
        // application is the DMA contract it accepted at registration.
        Some(unsafe { AtomicU64::from_ptr(p.cast::<u64>()) })
    }
    /// Atomic compare-and-swap of the 8 bytes at `offset` (host byte order, 8-byte aligned); returns the original.
    pub fn compare_swap(&self, offset: usize, compare: u64, swap: u64) -> Option<u64> {
        let a = self.atomic_at(offset)?;
        Some(
            match a.compare_exchange(compare, swap, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(v) | Err(v) => v,
            },
        )
    }
    /// Atomic fetch-and-add of the 8 bytes at `offset`; returns the original.
    pub fn fetch_add(&self, offset: usize, add: u64) -> Option<u64> {
        Some(self.atomic_at(offset)?.fetch_add(add, Ordering::SeqCst))
    }
}
