//! Memory regions: registration, the local and remote key checks, and the copies the
//! device makes through them.

use std::ptr::NonNull;

use super::fault;
use super::mem::{DmaPtr, MemSpan};
use super::table::IdMap;
use super::{ebusy, einval, enomem, missing, Context};
use crate::error::{Errno, Error, ErrorKind, Result};
use crate::types::{Access, DmId, PdId, Qpn, Sge, WcDetail, WcError, WcStatus};

/// What registering a memory region returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MrInfo {
    /// Local key.
    pub lkey: u32,
    /// Remote key.
    pub rkey: u32,
    /// First address of the region in its address space (the iova).
    pub addr: u64,
    /// Length.
    pub length: u64,
}

/// A region as a same-host peer may reach it ([`Context::mr_remote_view`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteView {
    /// Its protection domain.
    pub pd: PdId,
    /// Its remote key.
    pub rkey: u32,
    /// The first address peers name.
    pub iova: u64,
    /// Its length.
    pub len: u64,
    /// Where `iova` is in this process.
    pub host: u64,
    /// Its remote access rights (REMOTE_WRITE, REMOTE_READ).
    pub access: Access,
}

/// What a prefetch of on-demand memory asks for ([`Context::advise_mr`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Advice {
    /// Map the pages for reading.
    Prefetch,
    /// Map the pages for writing.
    PrefetchWrite,
    /// Map only pages already present. The device runs in the process's own address
    /// space, where a present page is already mapped for it: nothing to do.
    PrefetchNoFault,
}

/// Pages a checked prefetch faults in ([`Context::advise_mr`]).
#[derive(Debug)]
pub struct Prefetch {
    /// (address, length) of each range.
    ranges: Vec<(usize, usize)>,
    write: bool,
}

impl Prefetch {
    /// Fault the ranges in, as the device's accesses would (for writing when asked),
    /// without changing a byte. EFAULT when the process does not map part of them so.
    pub fn run(&self) -> Result<()> {
        for &(at, len) in &self.ranges {
            fault::check_backed(at as *mut u8, len, self.write)?;
        }
        Ok(())
    }
}

/// Why a remote key check failed; the transport maps this to a NAK.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoteKeyError {
    /// Unknown, invalidated, or other-PD key, missing access right or out of bounds:
    /// all are remote access errors.
    Access,
    /// A misaligned atomic address.
    Misaligned,
}

#[derive(Debug)]
pub(super) struct MrObj {
    pub(super) pd: PdId,
    key: u32,
    ptr: DmaPtr,
    len: usize,
    iova: u64,
    pub(super) access: Access,
    /// Addresses are offsets from 0 (ZERO_BASED or device memory).
    zero_based: bool,
    dm: Option<DmId>,
    /// An implicit on-demand region: every address of the process, as itself
    /// ([`Context::reg_mr`] with a null address and a length of `usize::MAX`).
    implicit: bool,
}

impl MrObj {
    /// First address of the region's address space.
    fn base(&self) -> u64 {
        if self.zero_based {
            0
        } else {
            self.iova
        }
    }
    /// Whether `va..va+len` lies inside the region.
    pub(super) fn contains(&self, va: u64, len: u64) -> bool {
        match va.checked_sub(self.base()) {
            Some(off) => matches!(off.checked_add(len), Some(end) if end <= self.len as u64),
            None => false,
        }
    }
    /// Host pointer of `va` once `contains(va, _)` holds.
    fn host(&self, va: u64) -> *mut u8 {
        if self.implicit {
            // The process's own address `va`: its memory, as the program gave it (no Rust
            // allocation); every access goes through the fault-safe copies.
            return va as usize as *mut u8;
        }
        let off = va.wrapping_sub(self.base()) as usize;
        self.ptr.offset(off).get()
    }
}

/// The memory regions by key index (key >> 8); windows share the index space (see
/// [`Context::alloc_key`]).
#[derive(Debug, Default)]
pub(super) struct MrTable {
    by_index: IdMap<u32, MrObj>,
}

impl MrTable {
    /// The region whose lkey (= rkey) is `key`.
    pub(super) fn by_key(&self, key: u32) -> Option<&MrObj> {
        self.by_index.get(&(key >> 8)).filter(|m| m.key == key)
    }
    /// Whether a region holds the key index `index`.
    pub(super) fn has_index(&self, index: u32) -> bool {
        self.by_index.contains_key(&index)
    }
    pub(super) fn uses_pd(&self, pd: PdId) -> bool {
        self.by_index.values().any(|m| m.pd == pd)
    }
    pub(super) fn uses_dm(&self, dm: DmId) -> bool {
        self.by_index.values().any(|m| m.dm == Some(dm))
    }
}

/// REMOTE_WRITE or REMOTE_ATOMIC need LOCAL_WRITE (IBTA o10-24 / `ib_check_mr_access`).
fn check_mr_access(access: Access) -> Result<()> {
    if access.intersects(Access::REMOTE_WRITE | Access::REMOTE_ATOMIC)
        && !access.contains(Access::LOCAL_WRITE)
    {
        return Err(einval("remote write or atomic access needs LOCAL_WRITE"));
    }
    Ok(())
}

/// Whether a region of `access` lets the device write its memory (the kernel pins such
/// pages with FOLL_WRITE).
fn device_writes(access: Access) -> bool {
    access.intersects(
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC | Access::MW_BIND,
    )
}

/// Whether `ptr`, `len` and `access` ask for an implicit on-demand region (the whole
/// address space, `ibv_reg_mr(pd, NULL, SIZE_MAX, IBV_ACCESS_ON_DEMAND | …)`).
fn implicit_request(ptr: *mut u8, len: usize, access: Access) -> bool {
    ptr.is_null() && len == usize::MAX && access.contains(Access::ON_DEMAND)
}

/// Host memory `ptr..ptr+len` as a region of `access` may take it (see
/// [`Context::reg_mr`]): a length of 0 at a page boundary is EINVAL; memory the process
/// does not back (or cannot write, where the device may) EFAULT, unless the region pages
/// on demand.
///
/// # Safety
/// The contract of [`Context::reg_mr`] for this range.
unsafe fn backed_memory(ptr: *mut u8, len: usize, access: Access) -> Result<DmaPtr> {
    if len == 0 && fault::page_aligned(ptr) {
        return Err(einval(
            "a zero-length region at a page boundary spans no page",
        ));
    }
    if !access.contains(Access::ON_DEMAND) {
        fault::check_backed(ptr, len, device_writes(access))?;
    }
    // A program may have put its own fault handler in front of ours since the last
    // registration; ours goes back in front (chaining to it) before the device may touch
    // this memory.
    fault::install_handler();
    // SAFETY: the caller's contract: the memory stays valid until deregistration, which
    // drops the region and its DmaPtr, and may be accessed from any thread meanwhile.
    Ok(unsafe { DmaPtr::new(ptr) })
}

/// The pointer a region of `len` bytes keeps: none for a zero-length one, which every
/// access reaches with a length of 0 and never reads through.
fn region_ptr(ptr: DmaPtr, len: usize) -> DmaPtr {
    if len == 0 {
        // SAFETY: addresses no memory: every access to a zero-length region is zero bytes
        // long, and such accesses get an empty span without reading the region's address.
        unsafe { DmaPtr::new(NonNull::<u8>::dangling().as_ptr()) }
    } else {
        ptr
    }
}

impl Context {
    /// Register `len` bytes at `ptr` as seen at address `iova`.
    /// REMOTE_WRITE or REMOTE_ATOMIC without LOCAL_WRITE is EINVAL.
    ///
    /// As a kernel driver pins the pages (rxe: `ib_umem_get`), the process's memory must
    /// back the range: every page mapped and readable, and writable when the access lets
    /// the device write (LOCAL_WRITE, REMOTE_WRITE, REMOTE_ATOMIC, MW_BIND); EFAULT
    /// otherwise. A length of 0 spans no page at a page-aligned address (EINVAL, the
    /// kernel's "no pages") and the page holding `ptr` otherwise, which must be backed.
    ///
    /// With [`Access::ON_DEMAND`] nothing is pinned or checked: the memory may be mapped
    /// later, and an access to a page that is not mapped (or not writable, for a write)
    /// when the device reaches it fails as for any region. A null `ptr` with `len`
    /// `usize::MAX` and `iova` 0 registers the implicit region, every address of the
    /// process (EINVAL with another `iova` or ZERO_BASED).
    ///
    /// # Safety
    /// The device reads and writes `ptr..ptr+len` at any time, from any thread, while the
    /// region is registered, and the caller accepts that. Its memory may be unmapped or
    /// protected later: device accesses to it then fail (error completions) instead of
    /// faulting, but it must not be replaced by memory the caller does not mean the device
    /// to reach.
    pub unsafe fn reg_mr(
        &mut self,
        pd: PdId,
        ptr: *mut u8,
        len: usize,
        iova: u64,
        access: Access,
    ) -> Result<MrInfo> {
        let zero_based = access.contains(Access::ZERO_BASED);
        if implicit_request(ptr, len, access) {
            if iova != 0 || zero_based {
                return Err(einval(
                    "an implicit on-demand region is addressed as the process's memory",
                ));
            }
            self.check_pd(pd)?;
            check_mr_access(access)?;
            fault::install_handler();
            // SAFETY: addresses no memory by itself: an implicit region reaches memory
            // through `MrObj::host`, which takes the address of each access.
            let ptr = unsafe { DmaPtr::new(NonNull::<u8>::dangling().as_ptr()) };
            return self.add_mr(MrObj {
                pd,
                key: 0,
                ptr,
                len,
                iova,
                access,
                zero_based: false,
                dm: None,
                implicit: true,
            });
        }
        if !zero_based && iova.checked_add(len as u64).is_none() {
            return Err(einval("iova + length overflows"));
        }
        self.check_pd(pd)?;
        check_mr_access(access)?;
        // SAFETY: `reg_mr`'s own contract.
        let ptr = unsafe { backed_memory(ptr, len, access) }?;
        self.insert_mr(pd, ptr, len, iova, access, zero_based, None)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn insert_mr(
        &mut self,
        pd: PdId,
        ptr: DmaPtr,
        len: usize,
        iova: u64,
        access: Access,
        zero_based: bool,
        dm: Option<DmId>,
    ) -> Result<MrInfo> {
        self.check_pd(pd)?;
        check_mr_access(access)?;
        if ptr.get().is_null() && len > 0 {
            return Err(Error::new(Errno::EFAULT, "null address"));
        }
        if (ptr.get() as usize).checked_add(len).is_none() || len > isize::MAX as usize {
            return Err(Error::new(Errno::EFAULT, "range wraps the address space"));
        }
        self.add_mr(MrObj {
            pd,
            key: 0,
            ptr,
            len,
            iova,
            access,
            zero_based,
            dm,
            implicit: false,
        })
    }

    /// Add a checked region under a fresh key (its `key` field is set here); ENOMEM past
    /// the device's limit.
    fn add_mr(&mut self, mut mr: MrObj) -> Result<MrInfo> {
        if self.mrs.by_index.len() >= self.dev.max_mr as usize {
            return Err(enomem("too many MRs"));
        }
        let key = self.alloc_key()?;
        mr.key = key;
        mr.ptr = region_ptr(mr.ptr, mr.len);
        let (addr, len) = (mr.base(), mr.len);
        self.mrs.by_index.insert(key >> 8, mr);
        Ok(MrInfo {
            lkey: key,
            rkey: key,
            addr,
            length: len as u64,
        })
    }
    /// The local keys of every region.
    pub fn mr_keys(&self) -> Vec<u32> {
        self.mrs.by_index.values().map(|m| m.key).collect()
    }

    /// What peers may reach of the region with local key `lkey` without the device (see
    /// the same-host path's grants): its PD, rkey, first address, length, where that
    /// address is in this process, and its remote access. None unless it is plain host
    /// memory the program registered whole (not device memory, not on-demand, not the
    /// implicit region) that allows remote writes or reads.
    pub fn mr_remote_view(&self, lkey: u32) -> Option<RemoteView> {
        let m = self.mrs.by_key(lkey)?;
        let remote = m.access & (Access::REMOTE_WRITE | Access::REMOTE_READ);
        if m.implicit || m.dm.is_some() || m.access.contains(Access::ON_DEMAND) || remote.is_empty()
        {
            return None;
        }
        Some(RemoteView {
            pd: m.pd,
            rkey: m.key,
            iova: m.base(),
            len: m.len as u64,
            host: m.host(m.base()) as usize as u64,
            access: remote,
        })
    }

    /// The PD and keys of the region with local key `lkey` (for importing it by handle);
    /// EINVAL if there is none.
    pub fn query_mr(&self, lkey: u32) -> Result<(PdId, MrInfo)> {
        let m = self.mrs.by_key(lkey).ok_or(missing("no such MR"))?;
        Ok((
            m.pd,
            MrInfo {
                lkey: m.key,
                rkey: m.key,
                addr: m.base(),
                length: m.len as u64,
            },
        ))
    }
    /// Re-register the region `lkey` in place (`ibv_rereg_mr`): each of `pd`, `memory`
    /// (`ptr`, `len`, `iova`) and `access` given replaces the region's, under the checks of
    /// [`Context::reg_mr`] (the new access against the region's memory as it will be:
    /// backed, and writable if the device may write it). The keys stay: peers that hold
    /// the rkey reach the region as it now is. Nothing changes unless everything checks
    /// out. EINVAL for nothing to change, or new memory for a region of device memory;
    /// EBUSY while windows are bound to it (they were checked against what it was);
    /// EOPNOTSUPP for an implicit on-demand region, or to make one.
    ///
    /// # Safety
    /// With `memory`, the contract of [`Context::reg_mr`] for the new range. The old range
    /// is no longer reached once this returns.
    pub unsafe fn rereg_mr(
        &mut self,
        lkey: u32,
        pd: Option<PdId>,
        memory: Option<(*mut u8, usize, u64)>,
        access: Option<Access>,
    ) -> Result<MrInfo> {
        let mr = self.mrs.by_key(lkey).ok_or(missing("no such MR"))?;
        if pd.is_none() && memory.is_none() && access.is_none() {
            return Err(einval("nothing to change"));
        }
        if mr.implicit {
            return Err(Error::new(
                Errno::EOPNOTSUPP,
                "an implicit on-demand region cannot be re-registered",
            ));
        }
        if self.mws.bound_to_mr(lkey) {
            return Err(ebusy("memory windows are bound to the MR"));
        }
        if memory.is_some() && mr.dm.is_some() {
            return Err(einval("a region of device memory cannot take other memory"));
        }
        let new_pd = pd.unwrap_or(mr.pd);
        let new_access = access.unwrap_or(mr.access);
        self.check_pd(new_pd)?;
        check_mr_access(new_access)?;
        let zero_based = new_access.contains(Access::ZERO_BASED) || mr.dm.is_some();
        let (ptr, len, iova) = match memory {
            Some((ptr, len, iova)) => {
                if implicit_request(ptr, len, new_access) {
                    return Err(Error::new(
                        Errno::EOPNOTSUPP,
                        "a region cannot become an implicit on-demand one",
                    ));
                }
                if !zero_based && iova.checked_add(len as u64).is_none() {
                    return Err(einval("iova + length overflows"));
                }
                // SAFETY: `rereg_mr`'s contract, as `reg_mr`'s for this range.
                let p = unsafe { backed_memory(ptr, len, new_access) }?;
                (region_ptr(p, len), len, iova)
            }
            None => {
                // The memory stays; a right to write it needs it writable now.
                if device_writes(new_access)
                    && !new_access.contains(Access::ON_DEMAND)
                    && mr.dm.is_none()
                    && mr.len > 0
                {
                    fault::check_backed(mr.ptr.get(), mr.len, true)?;
                }
                (mr.ptr, mr.len, mr.iova)
            }
        };
        let m = self
            .mrs
            .by_index
            .get_mut(&(lkey >> 8))
            .ok_or(missing("no such MR"))?;
        m.pd = new_pd;
        m.access = new_access;
        m.zero_based = zero_based;
        m.ptr = ptr;
        m.len = len;
        m.iova = iova;
        Ok(MrInfo {
            lkey: m.key,
            rkey: m.key,
            addr: m.base(),
            length: len as u64,
        })
    }

    /// Check a prefetch of on-demand memory (`ibv_advise_mr`) and say what it takes: each
    /// SGE of non-zero length must lie inside an on-demand region of `pd` named by its
    /// lkey, which grants LOCAL_WRITE for [`Advice::PrefetchWrite`]; EFAULT otherwise
    /// (the man page's answer for a bad lkey, range or write access), EINVAL for an empty
    /// list. The pages are faulted in by [`Prefetch::run`], outside the engine lock: a
    /// large range takes a while, and the device need not wait for it.
    pub fn advise_mr(&self, pd: PdId, advice: Advice, sg_list: &[Sge]) -> Result<Prefetch> {
        if sg_list.is_empty() {
            return Err(einval("no scatter/gather entry to prefetch"));
        }
        let write = advice == Advice::PrefetchWrite;
        let mut ranges = Vec::with_capacity(sg_list.len());
        let need = if write {
            Access::LOCAL_WRITE
        } else {
            Access::empty()
        };
        for sge in sg_list {
            let mr = self
                .sge_region(pd, sge, need)
                .map_err(|d| Error::new(Errno::EFAULT, d.as_str()))?;
            if !mr.access.contains(Access::ON_DEMAND) {
                return Err(Error::new(
                    Errno::EFAULT,
                    "memory region not registered on demand",
                ));
            }
            if sge.length > 0 && advice != Advice::PrefetchNoFault {
                ranges.push((mr.host(sge.addr) as usize, sge.length as usize));
            }
        }
        Ok(Prefetch { ranges, write })
    }

    /// Deregister by lkey; EBUSY while windows are bound to it.
    pub fn dereg_mr(&mut self, lkey: u32) -> Result<()> {
        if self.mrs.by_key(lkey).is_none() {
            return Err(missing("no such MR"));
        }
        if self.mws.bound_to_mr(lkey) {
            return Err(ebusy("memory windows are bound to the MR"));
        }
        self.mrs.by_index.remove(&(lkey >> 8));
        Ok(())
    }
    /// Check a local SGE for the QP's PD and the access needed (LOCAL_WRITE when the device
    /// writes it); LocProtErr on failure, with the check that failed as its detail.
    pub fn local_span(
        &self,
        pd: PdId,
        sge: &Sge,
        need: Access,
    ) -> core::result::Result<MemSpan<'_>, WcError> {
        if sge.length == 0 {
            return Ok(MemSpan::empty());
        }
        let mr = self
            .sge_region(pd, sge, need)
            .map_err(|d| WcError::new(WcStatus::LocProtErr, d))?;
        Ok(MemSpan::new(mr.host(sge.addr), sge.length as usize))
    }
    /// The region a local SGE names, checked in the order a NIC checks it: a live lkey, of
    /// `pd`, granting `need`, with the SGE inside it; which check failed, as a WcDetail.
    /// Each caller turns that into its own error ([`Context::local_span`],
    /// [`Context::check_sg_list`], [`Context::advise_mr`]).
    fn sge_region(
        &self,
        pd: PdId,
        sge: &Sge,
        need: Access,
    ) -> core::result::Result<&MrObj, WcDetail> {
        let mr = self.mrs.by_key(sge.lkey).ok_or(WcDetail::UnknownLkey)?;
        if mr.pd != pd {
            return Err(WcDetail::WrongPd);
        }
        if !mr.access.contains(need) {
            return Err(WcDetail::LocalAccess);
        }
        if !mr.contains(sge.addr, u64::from(sge.length)) {
            return Err(WcDetail::SgeOutOfBounds);
        }
        Ok(mr)
    }
    /// Check a scatter/gather list against the registered regions of `pd` before anything
    /// is queued, as slice indexing checks a range: every SGE of non-zero length names a
    /// live region of `pd` (NotFound for an unknown or deregistered lkey, ForeignObject for
    /// a region of another PD), which grants `need` (PermissionDenied), and lies inside it
    /// (OutOfBounds).
    ///
    /// A NIC makes these checks only when it executes the WR and completes it with
    /// LOC_PROT_ERR (see [`Context::local_span`]), which the C face keeps; this is for a
    /// face that refuses such a WR at the call instead, so that the QP does not go to ERROR.
    /// Zero-length SGEs name no memory and pass, as the device lets them.
    pub fn check_sg_list(&self, pd: PdId, sg_list: &[Sge], need: Access) -> Result<()> {
        for sge in sg_list.iter().filter(|s| s.length != 0) {
            self.sge_region(pd, sge, need).map_err(|d| match d {
                WcDetail::UnknownLkey => missing("lkey of no registered memory region"),
                WcDetail::WrongPd => einval("memory region of another protection domain")
                    .with_kind(ErrorKind::ForeignObject),
                WcDetail::LocalAccess => Error::new(
                    Errno::EACCES,
                    "memory region lacks the local access the work request needs",
                ),
                _ => Error::new(Errno::EFAULT, "SGE outside its memory region")
                    .with_kind(ErrorKind::OutOfBounds),
            })?;
        }
        Ok(())
    }
    /// Walk `len` bytes starting at message `offset` over `sg_list`, calling `f` with each
    /// piece's span and the position of the piece in the caller's buffer.
    fn walk_sgl(
        &self,
        pd: PdId,
        sg_list: &[Sge],
        offset: usize,
        len: usize,
        need: Access,
        mut f: impl FnMut(&MemSpan<'_>, usize, usize, usize) -> bool,
    ) -> core::result::Result<(), WcError> {
        let too_long = WcError::new(WcStatus::LocLenErr, WcDetail::MessageTooLong);
        let total: u64 = sg_list.iter().map(|s| s.length as u64).sum();
        let end = (offset as u64).checked_add(len as u64).ok_or(too_long)?;
        if end > total {
            return Err(too_long);
        }
        if len == 0 {
            return Ok(());
        }
        let mut skip = offset as u64; // bytes still to skip
        let mut done = 0usize;
        for sge in sg_list {
            let sl = sge.length as u64;
            if skip >= sl {
                skip -= sl;
                continue;
            }
            let span = self.local_span(pd, sge, need)?;
            let in_sge = skip as usize;
            let n = (sl - skip).min((len - done) as u64) as usize;
            if !f(&span, in_sge, done, n) {
                return Err(WcError::new(WcStatus::LocProtErr, WcDetail::MemoryFault));
            }
            done += n;
            skip = 0;
            if done == len {
                break;
            }
        }
        Ok(())
    }
    /// Where the `len` bytes of the message laid out over `sg_list` are in this process,
    /// as (address, length) pieces in order, after the checks [`Context::gather`] makes
    /// (`need` empty) or [`Context::scatter`] makes (`need` LOCAL_WRITE): for the kernel to
    /// copy them out of or into (cross-memory attach).
    pub fn local_iovecs(
        &self,
        pd: PdId,
        sg_list: &[Sge],
        len: usize,
        need: Access,
    ) -> core::result::Result<Vec<(u64, usize)>, WcError> {
        let mut v = Vec::with_capacity(sg_list.len());
        self.walk_sgl(pd, sg_list, 0, len, need, |span, at, _, n| {
            match span.addr_at(at, n) {
                Some(a) => {
                    v.push((a, n));
                    true
                }
                None => false,
            }
        })?;
        Ok(v)
    }
    /// Write `data` at byte `offset` of the message laid out over `sg_list`.
    /// LocLenErr if it runs past the list, LocProtErr if a key fails.
    pub fn scatter(
        &self,
        pd: PdId,
        sg_list: &[Sge],
        offset: usize,
        data: &[u8],
    ) -> core::result::Result<(), WcError> {
        self.walk_sgl(
            pd,
            sg_list,
            offset,
            data.len(),
            Access::LOCAL_WRITE,
            |span, at, pos, n| match data.get(pos..pos + n) {
                Some(chunk) => span.write(at, chunk),
                None => false,
            },
        )
    }
    /// Read the bytes `offset..offset+out.len()` of the message laid out over `sg_list`.
    pub fn gather(
        &self,
        pd: PdId,
        sg_list: &[Sge],
        offset: usize,
        out: &mut [u8],
    ) -> core::result::Result<(), WcError> {
        let len = out.len();
        self.walk_sgl(
            pd,
            sg_list,
            offset,
            len,
            Access::empty(),
            |span, at, pos, n| match out.get_mut(pos..pos + n) {
                Some(chunk) => span.read(at, chunk),
                None => false,
            },
        )
    }
    /// Check a remote key (MR or memory window) for a request arriving on `qpn` of `pd`:
    /// valid, same PD (type-2 windows: bound to this QP), the access right, bounds.
    ///
    /// As in rxe, a zero-length request checks no key and yields an empty span. Atomics
    /// (`need` containing REMOTE_ATOMIC) also need an 8-byte aligned address, both `va` and
    /// the host address it maps to: Misaligned otherwise.
    /// The QP's own `qp_access_flags` are the transport's to check.
    pub fn remote_span(
        &self,
        pd: PdId,
        qpn: Qpn,
        rkey: u32,
        va: u64,
        len: usize,
        need: Access,
    ) -> core::result::Result<MemSpan<'_>, RemoteKeyError> {
        use RemoteKeyError::Access as Denied;
        if len == 0 {
            return Ok(MemSpan::empty());
        }
        let len64 = len as u64;
        let (mr, mr_va) = if let Some(mr) = self.mrs.by_key(rkey) {
            if mr.pd != pd || !mr.access.contains(need) {
                return Err(Denied);
            }
            (mr, va)
        } else {
            let mw = self.mws.by_rkey(rkey).ok_or(Denied)?;
            let (mr_key, mr_va) = mw.reach(pd, qpn, va, len64, need).ok_or(Denied)?;
            (self.mrs.by_key(mr_key).ok_or(Denied)?, mr_va)
        };
        if !mr.contains(mr_va, len64) {
            return Err(Denied);
        }
        let host = mr.host(mr_va);
        if need.contains(Access::REMOTE_ATOMIC) && (va % 8 != 0 || (host as usize) % 8 != 0) {
            return Err(RemoteKeyError::Misaligned);
        }
        Ok(MemSpan::new(host, len))
    }
}
