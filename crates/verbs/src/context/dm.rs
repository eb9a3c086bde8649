//! Device memory: buffers the context owns, copied to and from by the program and
//! registered as zero-based regions.

use super::mem::MemSpan;
use super::mr::MrInfo;
use super::table::IdMap;
use super::{ebusy, einval, enomem, Context};
use crate::error::Result;
use crate::types::{Access, DmId, PdId};

/// Memory registration backing: device memory owned by the context, freed on drop.
#[derive(Debug)]
struct DmBuf {
    ptr: *mut u8,
    len: usize,
}

impl DmBuf {
    fn new(len: usize) -> DmBuf {
        let b: Box<[u8]> = vec![0u8; len].into_boxed_slice();
        let len = b.len();
        DmBuf {
            ptr: Box::into_raw(b).cast::<u8>(),
            len,
        }
    }
}

impl Drop for DmBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` came from `Box::<[u8]>::into_raw` in `DmBuf::new` and are
        // released exactly once, here; no MemSpan outlives the context that owns this buffer.
        unsafe {
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.ptr, self.len,
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
    /// Free device memory; EBUSY while registered.
    pub fn free_dm(&mut self, dm: DmId) -> Result<()> {
        if !self.dms.bufs.contains_key(&dm) {
            return Err(einval("no such device memory"));
        }
        if self.mrs.uses_dm(dm) {
            return Err(ebusy("device memory is registered"));
        }
        if let Some(buf) = self.dms.bufs.remove(&dm) {
            self.dms.total = self.dms.total.saturating_sub(buf.len as u64);
        }
        Ok(())
    }
    /// The device memory span `offset..offset+n`.
    fn dm_span(&self, dm: DmId, offset: u64, n: usize) -> Result<MemSpan<'_>> {
        let buf = self
            .dms
            .bufs
            .get(&dm)
            .ok_or(einval("no such device memory"))?;
        let off = usize::try_from(offset).map_err(|_| einval("offset out of range"))?;
        match off.checked_add(n) {
            Some(end) if end <= buf.len => {}
            _ => return Err(einval("device memory access out of bounds")),
        }
        Ok(MemSpan::new(buf.ptr.wrapping_add(off), n))
    }
    /// Copy into device memory.
    pub fn dm_copy_to(&mut self, dm: DmId, offset: u64, data: &[u8]) -> Result<()> {
        let span = self.dm_span(dm, offset, data.len())?;
        if span.write(0, data) {
            Ok(())
        } else {
            Err(einval("device memory access out of bounds"))
        }
    }
    /// Copy out of device memory.
    pub fn dm_copy_from(&self, dm: DmId, offset: u64, out: &mut [u8]) -> Result<()> {
        let span = self.dm_span(dm, offset, out.len())?;
        if span.read(0, out) {
            Ok(())
        } else {
            Err(einval("device memory access out of bounds"))
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
        let ptr = self.dm_span(dm, offset, len)?.as_ptr();
        // The buffer is owned by the context and outlives the MR (free_dm is EBUSY meanwhile).
        self.insert_mr(pd, ptr, len, 0, access | Access::ZERO_BASED, true, Some(dm))
    }
}
