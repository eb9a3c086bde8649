//! Device memory: buffers the context owns, copied to and from by the program and
//! registered as zero-based regions.

use super::mem::{DmaPtr, MemSpan};
use super::mr::MrInfo;
use super::table::IdMap;
use super::{ebusy, einval, enomem, missing, Context};
use crate::error::{ErrorKind, Result};
use crate::types::{Access, DmId, PdId};

/// The granularity of a program's copies to and from device memory. The devices that have
/// device memory (mlx5) reach it in 32-bit words and their provider refuses a copy at a
/// misaligned offset or length with EINVAL; programs are written to that, and rdma-core's
/// tests check that such a copy fails rather than touching neighbouring bytes.
const DM_COPY_ALIGN: usize = 4;

/// Memory registration backing: device memory owned by the context, freed on drop.
///
/// A raw allocation rather than a `Box`: moving a `Box` (as the table does when it grows)
/// asserts unique access to its contents, which the addresses the device and the program
/// keep into the buffer would violate.
#[derive(Debug)]
struct DmBuf {
    ptr: DmaPtr,
    len: usize,
}

impl DmBuf {
    fn new(len: usize) -> DmBuf {
        let b: Box<[u8]> = vec![0u8; len].into_boxed_slice();
        let len = b.len();
        // SAFETY: a heap allocation of our own, freed only in `Drop` (after every region on it
        // is gone: `free_dm` is EBUSY meanwhile); heap memory is not tied to a thread.
        let ptr = unsafe { DmaPtr::new(Box::into_raw(b).cast::<u8>()) };
        DmBuf { ptr, len }
    }
}

impl Drop for DmBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` came from `Box::<[u8]>::into_raw` in `DmBuf::new` and are
        // released exactly once, here; no MemSpan outlives the context that owns this buffer.
        unsafe {
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.ptr.get(),
                self.len,
            )))
        };
    }
}

/// The device memory buffers, and how many bytes they hold in all.
#[derive(Debug, Default)]
pub(super) struct DmTable {
    bufs: IdMap<DmId, DmBuf>,
    total: u64,
}

impl Context {
    /// Allocate device memory.
    pub fn alloc_dm(&mut self, len: usize) -> Result<DmId> {
        if len == 0 {
            return Err(einval("zero-length device memory"));
        }
        let total = self.dms.total.checked_add(len as u64);
        if !matches!(total, Some(t) if t <= self.dev.max_dm_size) {
            return Err(enomem("device memory exhausted"));
        }
        let id = DmId(self.new_id()?);
        self.dms.bufs.insert(id, DmBuf::new(len));
        self.dms.total += len as u64;
        Ok(id)
    }
    /// The length of device memory `dm` (for importing it by handle); EINVAL if there is
    /// none.
    pub fn dm_len(&self, dm: DmId) -> Result<usize> {
        self.dms
            .bufs
            .get(&dm)
            .map(|b| b.len)
            .ok_or(missing("no such device memory"))
    }
    /// Free device memory; EBUSY while registered.
    pub fn free_dm(&mut self, dm: DmId) -> Result<()> {
        if !self.dms.bufs.contains_key(&dm) {
            return Err(missing("no such device memory"));
        }
        if self.mrs.uses_dm(dm) {
            return Err(ebusy("device memory is registered"));
        }
        if let Some(buf) = self.dms.bufs.remove(&dm) {
            self.dms.total = self.dms.total.saturating_sub(buf.len as u64);
        }
        Ok(())
    }
    /// The address of `offset..offset+n` in device memory, once checked to lie inside it.
    fn dm_at(&self, dm: DmId, offset: u64, n: usize) -> Result<DmaPtr> {
        let buf = self
            .dms
            .bufs
            .get(&dm)
            .ok_or(missing("no such device memory"))?;
        let off = usize::try_from(offset)
            .map_err(|_| einval("offset out of range").with_kind(ErrorKind::OutOfBounds))?;
        match off.checked_add(n) {
            Some(end) if end <= buf.len => {}
            _ => {
                return Err(
                    einval("device memory access out of bounds").with_kind(ErrorKind::OutOfBounds)
                )
            }
        }
        Ok(buf.ptr.offset(off))
    }
    /// The device memory span `offset..offset+n`.
    fn dm_span(&self, dm: DmId, offset: u64, n: usize) -> Result<MemSpan<'_>> {
        Ok(MemSpan::new(self.dm_at(dm, offset, n)?.get(), n))
    }
    /// The device memory span `offset..offset+n` a program copies to or from: offset and
    /// length must be multiples of `DM_COPY_ALIGN`.
    fn dm_copy_span(&self, dm: DmId, offset: u64, n: usize) -> Result<MemSpan<'_>> {
        if offset % DM_COPY_ALIGN as u64 != 0 || n % DM_COPY_ALIGN != 0 {
            return Err(
                einval("device memory copies need 4-byte aligned offsets and lengths")
                    .with_kind(ErrorKind::Misaligned),
            );
        }
        self.dm_span(dm, offset, n)
    }
    /// Copy into device memory (offset and length multiples of 4, else EINVAL).
    pub fn dm_copy_to(&mut self, dm: DmId, offset: u64, data: &[u8]) -> Result<()> {
        let span = self.dm_copy_span(dm, offset, data.len())?;
        if span.write(0, data) {
            Ok(())
        } else {
            Err(einval("device memory access out of bounds").with_kind(ErrorKind::OutOfBounds))
        }
    }
    /// Copy out of device memory (offset and length multiples of 4, else EINVAL).
    pub fn dm_copy_from(&self, dm: DmId, offset: u64, out: &mut [u8]) -> Result<()> {
        let span = self.dm_copy_span(dm, offset, out.len())?;
        if span.read(0, out) {
            Ok(())
        } else {
            Err(einval("device memory access out of bounds").with_kind(ErrorKind::OutOfBounds))
        }
    }
    /// Register part of device memory as an MR (zero-based addresses, as `ibv_reg_dm_mr`).
    pub fn reg_dm_mr(
        &mut self,
        pd: PdId,
        dm: DmId,
        offset: u64,
        len: usize,
        access: Access,
    ) -> Result<MrInfo> {
        let ptr = self.dm_at(dm, offset, len)?;
        // The buffer is owned by the context and outlives the MR (free_dm is EBUSY meanwhile).
        self.insert_mr(pd, ptr, len, 0, access | Access::ZERO_BASED, true, Some(dm))
    }
}
