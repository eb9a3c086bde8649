//! Memory regions, memory windows and device memory.

use std::ops::{Bound, RangeBounds};
use std::sync::Arc;

use softrdma_transport::verbs::{self, Access, DmId, MrInfo, MwId, PdId, Sge};

use crate::pd::{PdInner, ProtectionDomain};
use crate::{Device, Error, ErrorKind, Result};

/// The memory a safe registration owns: a vector, a length of zeroed bytes, or a copy.
#[derive(Debug)]
pub struct MrBuffer(Box<[u8]>);

impl From<Vec<u8>> for MrBuffer {
    fn from(v: Vec<u8>) -> MrBuffer {
        MrBuffer(v.into_boxed_slice())
    }
}
impl From<Box<[u8]>> for MrBuffer {
    fn from(b: Box<[u8]>) -> MrBuffer {
        MrBuffer(b)
    }
}
impl From<usize> for MrBuffer {
    /// `len` zeroed bytes.
    fn from(len: usize) -> MrBuffer {
        MrBuffer(vec![0u8; len].into_boxed_slice())
    }
}
impl From<&[u8]> for MrBuffer {
    fn from(s: &[u8]) -> MrBuffer {
        MrBuffer(s.into())
    }
}

impl ProtectionDomain {
    /// Register memory the region owns (a `Vec<u8>`, a `Box<[u8]>`, a byte count of zeroed
    /// memory, or a copied slice). Its contents are reachable only by copying
    /// ([`MemoryRegion::read`], [`MemoryRegion::write`]) and atomics, so the device may write
    /// it at any time without aliasing a Rust reference.
    ///
    /// An empty buffer is EINVAL: it spans no page, which a kernel driver refuses too.
    pub fn register(&self, buf: impl Into<MrBuffer>, access: Access) -> Result<MemoryRegion> {
        let MrBuffer(b) = buf.into();
        let len = b.len();
        if len == 0 {
            return Err(Error::invalid("an empty buffer spans no page to register"));
        }
        let raw: *mut [u8] = Box::into_raw(b);
        let ptr = raw.cast::<u8>();
        let pd = self.inner.id;
        // SAFETY: `raw` is a live heap allocation of `len` bytes that the returned region
        // owns and frees only after deregistering it (see `Drop for MemoryRegion`); from now
        // on it is reached only through the device under the engine lock, never through a
        // Rust reference.
        let r = self
            .inner
            .dev
            .call(|rn, _| unsafe { rn.reg_mr(pd, ptr, len, ptr as u64, access) });
        match r {
            Ok(info) => Ok(MemoryRegion {
                pd: Arc::clone(&self.inner),
                info,
                access,
                backing: Backing::Owned(raw),
            }),
            Err(e) => {
                // SAFETY: registration failed, so the device never saw `raw`; it came from
                // `Box::into_raw` above and is released exactly once, here.
                drop(unsafe { Box::from_raw(raw) });
                Err(e)
            }
        }
    }

    /// Register memory the caller owns (`ibv_reg_mr`), addressed by its host address.
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay valid for reads and writes until the returned region is
    /// dropped. The device reads and writes that memory at any time while it is registered,
    /// from another thread: the caller must not hold Rust references (`&`/`&mut`) to any
    /// part of it that a peer or a posted operation may write meanwhile, and must accept
    /// that its own plain accesses race with the device's (as with DMA on a real NIC).
    ///
    /// As a kernel driver pinning the pages, the process's memory must back the range:
    /// mapped and readable, and writable when `access` lets the device write; EFAULT
    /// otherwise (a length of 0 at a page boundary is EINVAL). Memory unmapped or
    /// protected later makes the device's accesses fail (error completions, EFAULT from
    /// [`MemoryRegion::read`] and the like) rather than crash the process.
    pub unsafe fn register_raw(
        &self,
        ptr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion> {
        let pd = self.inner.id;
        // SAFETY: the caller's contract above is exactly `reg_mr`'s.
        let info = self
            .inner
            .dev
            .call(|rn, _| unsafe { rn.reg_mr(pd, ptr, len, ptr as u64, access) })?;
        Ok(MemoryRegion {
            pd: Arc::clone(&self.inner),
            info,
            access,
            backing: Backing::Raw,
        })
    }

    /// Register `len` bytes of device memory at `offset` (`ibv_reg_dm_mr`; zero-based).
    pub fn register_dm(
        &self,
        dm: &DeviceMemory,
        offset: u64,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion> {
        let (pd, id) = (self.inner.id, dm.inner.id);
        let info = self
            .inner
            .dev
            .call(|rn, _| rn.reg_dm_mr(pd, id, offset, len, access))?;
        Ok(MemoryRegion {
            pd: Arc::clone(&self.inner),
            info,
            access,
            backing: Backing::Dm(Arc::clone(&dm.inner)),
        })
    }

    /// Allocate a memory window of type 1 or 2.
    pub fn alloc_mw(&self, mw_type: u8) -> Result<MemoryWindow> {
        let pd = self.inner.id;
        let id = self.inner.dev.call(|r, _| r.alloc_mw(pd, mw_type))?;
        Ok(MemoryWindow {
            pd: Arc::clone(&self.inner),
            id,
        })
    }
}

/// What a region's memory is, and who frees it.
enum Backing {
    /// Heap memory from `Box::into_raw`, freed after deregistration.
    Owned(*mut [u8]),
    /// The caller's memory (`register_raw`): nothing to free.
    Raw,
    /// Device memory, kept allocated while registered.
    Dm(#[allow(dead_code)] Arc<DmInner>),
}

/// A registered memory region. The device reads and writes it asynchronously (as a NIC
/// does by DMA); the API reaches its contents only by copying under the device's engine
/// lock, so no Rust reference ever aliases a device write.
///
/// Work requests name it by scatter/gather elements ([`MemoryRegion::sge`], with its
/// lkey); a peer names it by [`MemoryRegion::remote`] (address, rkey and length), which
/// the program sends it. What a peer may do is what the region was registered with
/// ([`Access`]) and what the QP grants.
///
/// ```
/// use softrdma::{Access, Device, ErrorKind, RemoteMemory};
/// # fn main() -> softrdma::Result<()> {
/// let dev = Device::open_default()?;
/// let pd = dev.alloc_pd()?;
/// let mr = pd.register(4096, Access::LOCAL_WRITE | Access::REMOTE_READ)?;
/// mr.write(0, b"hello")?; // copies in; `read`, `to_vec` copy out
/// assert_eq!(mr.to_vec(0, 5)?, b"hello");
///
/// // For a local work request: an SGE over bytes 0..5 of the region.
/// let sge = mr.sge(0..5)?;
/// assert_eq!((sge.addr, sge.length, sge.lkey), (mr.addr(), 5, mr.lkey()));
/// // Ranges are checked as slice indexing checks them, at the call.
/// assert_eq!(mr.sge(4000..5000).unwrap_err().kind(), ErrorKind::OutOfBounds);
///
/// // For the peer: 20 bytes to send it over a socket of the program's own.
/// let wire = mr.remote().to_bytes();
/// assert_eq!(RemoteMemory::from_bytes(&wire), mr.remote());
///
/// // A registered Vec comes back when the region is deregistered.
/// let owned = pd.register(vec![7u8; 16], Access::LOCAL_WRITE)?;
/// assert_eq!(owned.into_vec()?, vec![7u8; 16]);
/// # Ok(()) }
/// ```
///
/// # Dropping
///
/// Dropping the region deregisters it at once, whatever is still outstanding, and only
/// then frees an owned buffer, so the device never touches freed memory. Work that still
/// needs the region fails instead: a work request of this side that names its lkey fails
/// when the device next reads or writes it (LOC_PROT_ERR, detail
/// [`WcDetail::UnknownLkey`](crate::WcDetail::UnknownLkey)) and moves this side's QP to
/// ERROR; a peer's WRITE, READ or atomic on its rkey is refused with a NAK, which moves
/// both QPs to ERROR (REM_ACCESS_ERR at the peer). Keep a region until the work requests that use it have completed and the peer
/// is done with it. A region with a memory window bound to it cannot be deregistered:
/// dropping it then leaks its buffer rather than free memory the device may still write.
pub struct MemoryRegion {
    pd: Arc<PdInner>,
    info: MrInfo,
    access: Access,
    backing: Backing,
}

// SAFETY: the raw pointers in `Backing` are owned (Owned) or promised valid by the caller
// of `register_raw` for any thread (its contract); every access to the memory through this
// type happens under the device's engine mutex, so moving the handle between threads or
// sharing it cannot create unsynchronized access.
unsafe impl Send for MemoryRegion {}
// SAFETY: as for Send: `&MemoryRegion` only permits copies and atomics under the engine lock.
unsafe impl Sync for MemoryRegion {}

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &format_args!("{:#x}", self.info.addr))
            .field("len", &self.info.length)
            .field("lkey", &format_args!("{:#x}", self.info.lkey))
            .field("rkey", &format_args!("{:#x}", self.info.rkey))
            .finish()
    }
}

/// Where a peer's memory is: what an RDMA WRITE, READ or atomic needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RemoteMemory {
    /// First address.
    pub addr: u64,
    /// Remote key.
    pub rkey: u32,
    /// Length in bytes.
    pub len: u64,
}

impl RemoteMemory {
    /// Wire form for exchanging over a side channel: addr, rkey, len, big-endian (20 bytes).
    pub fn to_bytes(&self) -> [u8; 20] {
        let mut b = [0u8; 20];
        b[..8].copy_from_slice(&self.addr.to_be_bytes());
        b[8..12].copy_from_slice(&self.rkey.to_be_bytes());
        b[12..].copy_from_slice(&self.len.to_be_bytes());
        b
    }
    /// Parse [`RemoteMemory::to_bytes`].
    pub fn from_bytes(b: &[u8; 20]) -> RemoteMemory {
        let mut a = [0u8; 8];
        let mut k = [0u8; 4];
        let mut l = [0u8; 8];
        a.copy_from_slice(&b[..8]);
        k.copy_from_slice(&b[8..12]);
        l.copy_from_slice(&b[12..]);
        RemoteMemory {
            addr: u64::from_be_bytes(a),
            rkey: u32::from_be_bytes(k),
            len: u64::from_be_bytes(l),
        }
    }
    /// The address `offset` bytes in.
    pub fn at(&self, offset: u64) -> u64 {
        self.addr.wrapping_add(offset)
    }
    /// The address of `len` bytes at `offset`, checked against the descriptor as slice
    /// indexing checks a range: [`ErrorKind::OutOfBounds`] when they reach past its end,
    /// since the peer would refuse the access and break the connection. The builders of
    /// [`crate::wr`] use it; a program filling a `SendWr` by hand can too.
    pub fn checked_at(&self, offset: u64, len: u64) -> Result<u64> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len && self.addr.checked_add(end).is_some() => {
                Ok(self.addr + offset)
            }
            _ => Err(
                Error::new(libc::EFAULT, "access outside the remote memory's bounds")
                    .with_kind(ErrorKind::OutOfBounds),
            ),
        }
    }
}

/// `range` as (start, length) inside `len` bytes, or None where slice indexing would
/// panic (start past end, end past `len`).
fn range_of(r: impl RangeBounds<usize>, len: usize) -> Option<(usize, usize)> {
    let start = match r.start_bound() {
        Bound::Included(&s) => s,
        Bound::Excluded(&s) => s.checked_add(1)?,
        Bound::Unbounded => 0,
    };
    let end = match r.end_bound() {
        Bound::Included(&e) => e.checked_add(1)?,
        Bound::Excluded(&e) => e,
        Bound::Unbounded => len,
    };
    if start <= end && end <= len {
        Some((start, end - start))
    } else {
        None
    }
}

impl MemoryRegion {
    /// First address of the region (its host address; 0 for device memory).
    pub fn addr(&self) -> u64 {
        self.info.addr
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.info.length as usize
    }
    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.info.length == 0
    }
    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.info.lkey
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.info.rkey
    }
    /// Access rights it was registered with.
    pub fn access(&self) -> Access {
        self.access
    }
    /// The PD it belongs to.
    pub fn pd_id(&self) -> PdId {
        self.pd.id
    }
    /// A scatter/gather element over `range` (byte offsets into the region), checked as
    /// slice indexing checks a range: a range reaching past the region's end or ending
    /// before it starts is an error of kind [`ErrorKind::OutOfBounds`], so that it is
    /// refused here rather than failing the work request (and its QP) at the device. It is
    /// a `Result` rather than a panic because the range often comes from a peer's message.
    /// A range longer than 4 GiB, the most one SGE carries, is
    /// [`ErrorKind::InvalidArgument`].
    ///
    /// ```
    /// # fn main() -> softrdma::Result<()> {
    /// # let dev = softrdma::Device::open_default()?;
    /// # let mr = dev.alloc_pd()?.register(4096, softrdma::Access::LOCAL_WRITE)?;
    /// let head = mr.sge(..64)?;
    /// assert_eq!(head.length, 64);
    /// assert!(mr.sge(..mr.len() + 1).is_err());
    /// # Ok(()) }
    /// ```
    pub fn sge(&self, range: impl RangeBounds<usize>) -> Result<Sge> {
        let (start, n) = range_of(range, self.len()).ok_or_else(|| {
            Error::new(libc::EFAULT, "SGE range outside the memory region")
                .with_kind(ErrorKind::OutOfBounds)
        })?;
        Ok(Sge {
            addr: self.info.addr.wrapping_add(start as u64),
            length: u32::try_from(n)
                .map_err(|_| Error::invalid("an SGE carries at most 4 GiB - 1 bytes"))?,
            lkey: self.info.lkey,
        })
    }
    /// What a peer needs to access the region remotely.
    pub fn remote(&self) -> RemoteMemory {
        RemoteMemory {
            addr: self.info.addr,
            rkey: self.info.rkey,
            len: self.info.length,
        }
    }

    /// Run `f` with a checked span of `n` bytes at `offset`, under the engine lock; `f`
    /// answering None is `failed()`.
    fn span<R>(
        &self,
        offset: usize,
        n: usize,
        f: impl FnOnce(&verbs::MemSpan<'_>) -> Option<R>,
        failed: impl FnOnce(&verbs::MemSpan<'_>) -> Error,
    ) -> Result<R> {
        match offset.checked_add(n) {
            Some(end) if end <= self.len() => {}
            _ => {
                return Err(Error::new(libc::EFAULT, "out of the region's bounds")
                    .with_kind(ErrorKind::OutOfBounds))
            }
        }
        let pd = self.pd.id;
        let sge = Sge {
            addr: self.info.addr.wrapping_add(offset as u64),
            length: u32::try_from(n).map_err(|_| {
                Error::invalid("access longer than 4 GiB").with_kind(ErrorKind::OutOfBounds)
            })?,
            lkey: self.info.lkey,
        };
        // Under the engine lock, which orders these copies with the device's own accesses
        // to the region, but without an engine step: touching local memory adds no
        // completion, so CQ pollers are not sent to look again (a loop watching a byte
        // would otherwise make every poll of every CQ take the lock).
        self.pd
            .dev
            .inner
            .dev
            .inspect(|r| match r.local_span(pd, &sge, Access::empty()) {
                Ok(span) => f(&span).ok_or_else(|| failed(&span)),
                Err(_) => Err(Error::new(libc::EFAULT, "region not accessible")),
            })
    }

    /// Copy `out.len()` bytes out from `offset`.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.span(offset, out.len(), |s| s.read(0, out).then_some(()), gone)
    }
    /// Copy `data` in at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.span(offset, data.len(), |s| s.write(0, data).then_some(()), gone)
    }
    /// A copy of `len` bytes at `offset`.
    pub fn to_vec(&self, offset: usize, len: usize) -> Result<Vec<u8>> {
        let mut v = vec![0u8; len];
        self.read(offset, &mut v)?;
        Ok(v)
    }
    /// Atomically read the native-endian u64 at `offset` (8-byte aligned address): the
    /// word a peer's atomic works on, or the old value an atomic of this side wrote here
    /// (both in host byte order). [`ErrorKind::Misaligned`] for an unaligned address.
    pub fn read_u64(&self, offset: usize) -> Result<u64> {
        self.span(offset, 8, |s| s.fetch_add(0, 0), misaligned_or_gone)
    }
    /// Atomically store a native-endian u64 at `offset` (8-byte aligned address).
    pub fn write_u64(&self, offset: usize, v: u64) -> Result<()> {
        self.span(
            offset,
            8,
            |s| {
                let mut cur = s.fetch_add(0, 0)?;
                loop {
                    let was = s.compare_swap(0, cur, v)?;
                    if was == cur {
                        return Some(());
                    }
                    cur = was;
                }
            },
            misaligned_or_gone,
        )
    }
    /// Atomic fetch-and-add on the u64 at `offset`, as a remote FETCH_AND_ADD would do it;
    /// returns the old value.
    pub fn fetch_add_u64(&self, offset: usize, add: u64) -> Result<u64> {
        self.span(offset, 8, |s| s.fetch_add(0, add), misaligned_or_gone)
    }
    /// Atomic compare-and-swap on the u64 at `offset`; returns the old value.
    pub fn compare_swap_u64(&self, offset: usize, compare: u64, swap: u64) -> Result<u64> {
        self.span(
            offset,
            8,
            |s| s.compare_swap(0, compare, swap),
            misaligned_or_gone,
        )
    }

    /// Deregister and return the buffer (a copy of it for raw and device memory).
    pub fn into_vec(self) -> Result<Vec<u8>> {
        if let Backing::Owned(_) = self.backing {
            let mut me = std::mem::ManuallyDrop::new(self);
            match me.deregister() {
                Ok(()) => {
                    if let Backing::Owned(raw) = me.backing {
                        // SAFETY: deregistered, so the device no longer touches `raw`; it came
                        // from `Box::into_raw` in `register` and is reclaimed exactly once:
                        // `me` is ManuallyDrop and its other fields are dropped below.
                        let b = unsafe { Box::from_raw(raw) };
                        // SAFETY: each field is dropped once; `me` is never used again.
                        unsafe { std::ptr::drop_in_place(&mut me.pd) };
                        return Ok(b.into_vec());
                    }
                    Err(Error::invalid("unreachable backing"))
                }
                Err(e) => {
                    // Still registered: keep the buffer alive forever (leak) rather than free
                    // memory the device may still write.
                    // SAFETY: drop only the PD handle; the buffer is deliberately leaked.
                    unsafe { std::ptr::drop_in_place(&mut me.pd) };
                    Err(e)
                }
            }
        } else {
            self.to_vec(0, self.len())
        }
    }

    fn deregister(&mut self) -> Result<()> {
        let lkey = self.info.lkey;
        self.pd.dev.call(|r, _| r.dereg_mr(lkey))
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        let ok = self.deregister().is_ok();
        if let Backing::Owned(raw) = self.backing {
            if ok {
                // SAFETY: deregistered under the engine lock, so no device access to `raw`
                // can follow; it came from `Box::into_raw` in `register` and is freed once.
                drop(unsafe { Box::from_raw(raw) });
            }
            // If deregistration failed (a memory window still bound) the buffer is leaked:
            // freeing memory the device may still write would be unsound.
        }
    }
}

/// A memory window (`ibv_alloc_mw`). Bind it with a `SendOp::BindMw` work request.
pub struct MemoryWindow {
    pd: Arc<PdInner>,
    id: MwId,
}

impl MemoryWindow {
    /// The verbs handle (for `MwBind::mw`).
    pub fn id(&self) -> MwId {
        self.id
    }
    /// Its current rkey.
    pub fn rkey(&self) -> Result<u32> {
        let id = self.id;
        self.pd.dev.call(|r, _| r.mw_rkey(id))
    }
}

impl Drop for MemoryWindow {
    fn drop(&mut self) {
        let id = self.id;
        let _ = self.pd.dev.call(|r, _| r.dealloc_mw(id));
    }
}

pub(crate) struct DmInner {
    pub(crate) dev: Device,
    pub(crate) id: DmId,
    pub(crate) len: usize,
}

impl Drop for DmInner {
    fn drop(&mut self) {
        let id = self.id;
        let _ = self.dev.call(|r, _| r.free_dm(id));
    }
}

/// Device memory (`ibv_alloc_dm`): memory owned by the device, reached by copying.
pub struct DeviceMemory {
    pub(crate) inner: Arc<DmInner>,
}

impl DeviceMemory {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }
    /// Whether empty (never: zero-length allocations are refused).
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }
    /// Copy `data` in at `offset`; the offset and the length are multiples of 4
    /// (`EINVAL` otherwise), as on the devices that have device memory.
    pub fn copy_to(&self, offset: u64, data: &[u8]) -> Result<()> {
        let id = self.inner.id;
        self.inner.dev.call(|r, _| r.dm_copy_to(id, offset, data))
    }
    /// Copy out from `offset`; the offset and the length are multiples of 4 (`EINVAL`
    /// otherwise).
    pub fn copy_from(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        let id = self.inner.id;
        self.inner.dev.call(|r, _| r.dm_copy_from(id, offset, out))
    }
}

/// A copy stopped by memory the owner of a raw registration unmapped or protected since.
fn gone(_: &verbs::MemSpan<'_>) -> Error {
    Error::new(
        libc::EFAULT,
        "memory unmapped or protected since registration",
    )
}

/// An atomic that did not run: misaligned (EINVAL), or memory gone as for [`gone`].
fn misaligned_or_gone(s: &verbs::MemSpan<'_>) -> Error {
    if s.word_aligned(0) {
        gone(s)
    } else {
        Error::invalid("misaligned address").with_kind(ErrorKind::Misaligned)
    }
}
