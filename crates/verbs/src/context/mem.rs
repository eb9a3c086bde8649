//! Access to registered memory and device memory: the one place the device reads and
//! writes memory it does not own as Rust values.

use super::{fault, Context};
use std::marker::PhantomData;
use std::ptr::NonNull;

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
    /// The address of byte `offset` in this process, if `offset..offset+n` lies inside the
    /// span: for the kernel to copy from or into (cross-memory attach), never dereferenced
    /// here.
    pub fn addr_at(&self, offset: usize, n: usize) -> Option<u64> {
        self.fits(offset, n)
            .then(|| self.ptr.wrapping_add(offset) as usize as u64)
    }
    /// Whether `offset..offset+n` lies inside the span.
    fn fits(&self, offset: usize, n: usize) -> bool {
        matches!(offset.checked_add(n), Some(end) if end <= self.len)
    }
    /// Copy `data` in at `offset`; false if it would not fit (nothing written) or a page of
    /// the span is no longer mapped writable (part of it may have been written).
    pub fn write(&self, offset: usize, data: &[u8]) -> bool {
        if !self.fits(offset, data.len()) {
            return false;
        }
        // SAFETY: `offset + data.len() <= self.len` (checked above) and the span lies inside
        // a live registration whose owner accepted device writes (MemSpan invariant, kept
        // while the context is borrowed, so it cannot be deregistered). The copy is
        // fault-safe: pages the program unmapped or protected since make it fail instead of
        // raising a signal. No reference to the registered bytes is formed.
        unsafe { fault::copy(self.ptr.wrapping_add(offset), data.as_ptr(), data.len()) }.is_ok()
    }
    /// Copy out from `offset`; false if out of bounds (nothing read) or a page of the span
    /// is no longer mapped readable.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> bool {
        if !self.fits(offset, out.len()) {
            return false;
        }
        // SAFETY: bounds checked above; the span lies inside a live registration (MemSpan
        // invariant); fault-safe copy into the caller's exclusive buffer.
        unsafe { fault::copy(out.as_mut_ptr(), self.ptr.wrapping_add(offset), out.len()) }.is_ok()
    }
    /// Whether the 8 bytes at `offset` are in bounds and 8-byte aligned (what the atomics
    /// need).
    pub fn word_aligned(&self, offset: usize) -> bool {
        self.word_at(offset).is_some()
    }
    /// The address of the 8-byte word at `offset`, if in bounds and 8-byte aligned.
    fn word_at(&self, offset: usize) -> Option<*mut u64> {
        if !self.fits(offset, 8) {
            return None;
        }
        let p = self.ptr.wrapping_add(offset);
        if (p as usize) % 8 != 0 {
            return None;
        }
        Some(p.cast::<u64>())
    }
    /// Atomic compare-and-swap of the 8 bytes at `offset` (host byte order, 8-byte aligned);
    /// returns the original. None if out of bounds, misaligned, or the page is no longer
    /// mapped writable (nothing changed).
    pub fn compare_swap(&self, offset: usize, compare: u64, swap: u64) -> Option<u64> {
        let p = self.word_at(offset)?;
        // SAFETY: `p..p+8` lies inside the span (checked) and is 8-byte aligned (checked),
        // in a live registration (MemSpan invariant). The device's accesses to registered
        // memory are copies and atomics; concurrent plain access by the application is the
        // DMA contract it accepted at registration. Fault-safe.
        unsafe { fault::compare_swap(p, compare, swap) }.ok()
    }
    /// Atomic fetch-and-add of the 8 bytes at `offset`; returns the original. None as for
    /// [`MemSpan::compare_swap`].
    pub fn fetch_add(&self, offset: usize, add: u64) -> Option<u64> {
        let p = self.word_at(offset)?;
        // SAFETY: as in `compare_swap`.
        unsafe { fault::fetch_add(p, add) }.ok()
    }
}
