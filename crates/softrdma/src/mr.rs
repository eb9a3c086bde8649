//! Memory regions, memory windows and device memory.

use std::ops::{Bound, RangeBounds};
use std::sync::atomic::{AtomicU32, Ordering};
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
        let r = unsafe { self.inner.dev.rt().reg_mr(pd, ptr, len, ptr as u64, access) };
        match r {
            Ok(info) => Ok(MemoryRegion::new(MrReg {
                pd: Arc::clone(&self.inner),
                info,
                access: AtomicU32::new(access.bits()),
                backing: Backing::Owned(raw),
            })),
            Err(e) => {
                // SAFETY: registration failed, so the device never saw `raw`; it came from
                // `Box::into_raw` above and is released exactly once, here.
                drop(unsafe { Box::from_raw(raw) });
                Err(e.into())
            }
        }
    }

    /// Register memory the caller owns (`ibv_reg_mr`), addressed by its host address.
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay valid for reads and writes until the registration ends:
    /// until the returned region and all its clones are dropped, every work request
    /// that names it has had its completion polled (or its QP or SRQ was dropped), *and*
    /// every memory window bound to it is dropped, since posted requests and windows keep
    /// the registration alive (see
    /// [`MemoryRegion`#sharing-and-dropping](MemoryRegion#sharing-and-dropping)); once
    /// those completions are polled with no handle left, it is deregistered. The device reads and writes that memory at any time while it is registered,
    /// from another thread: the caller must not hold Rust references (`&`/`&mut`) to any
    /// part of it that a peer or a posted operation may write meanwhile, and must accept
    /// that its own plain accesses race with the device's (as with DMA on a real NIC).
    ///
    /// As a kernel driver pinning the pages, the process's memory must back the range:
    /// mapped and readable, and writable when `access` lets the device write; EFAULT
    /// otherwise (a length of 0 at a page boundary is EINVAL). Memory unmapped or
    /// protected later makes the device's accesses fail (error completions, EFAULT from
    /// [`MemoryRegion::read`] and the like) rather than crash the process. With
    /// [`Access::ON_DEMAND`] nothing is checked at registration: the range may be mapped
    /// later, and an access to a part not mapped when the device reaches it fails as
    /// above; a null `ptr` with `len` `usize::MAX` is then the implicit region, every
    /// address of the process (the contract above then covers whatever memory the program
    /// lets work requests and peers name through it).
    pub unsafe fn register_raw(
        &self,
        ptr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion> {
        let pd = self.inner.id;
        // SAFETY: the caller's contract above is exactly `reg_mr`'s.
        let info = unsafe { self.inner.dev.rt().reg_mr(pd, ptr, len, ptr as u64, access) }?;
        Ok(MemoryRegion::new(MrReg {
            pd: Arc::clone(&self.inner),
            info,
            access: AtomicU32::new(access.bits()),
            backing: Backing::Raw,
        }))
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
        let info = self.inner.dev.rt().reg_dm_mr(pd, id, offset, len, access)?;
        Ok(MemoryRegion::new(MrReg {
            pd: Arc::clone(&self.inner),
            info,
            access: AtomicU32::new(access.bits()),
            backing: Backing::Dm(Arc::clone(&dm.inner)),
        }))
    }

    /// Allocate a memory window of type 1 or 2.
    pub fn alloc_mw(&self, mw_type: u8) -> Result<MemoryWindow> {
        let pd = self.inner.id;
        let id = self.inner.dev.rt().alloc_mw(pd, mw_type)?;
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
/// # Sharing and dropping
///
/// A `MemoryRegion` is a handle of its registration, cheap to clone; the registration
/// lives while a handle or a work request holds it. Every post
/// ([`QueuePair::post_send`](crate::QueuePair::post_send),
/// [`QueuePair::post_recv`](crate::QueuePair::post_recv),
/// [`SharedReceiveQueue::post_recv`](crate::SharedReceiveQueue::post_recv) and their
/// `_unvalidated` forms) takes a share of each region its SGEs name, and keeps it until
/// the completion that retires the request is polled from its CQ: its own completion,
/// or for an unsignaled send the completion of a later send of its QP (a send queue
/// completes in order), or the flush completion when the QP goes to ERROR; dropping the
/// QP (or the SRQ) releases what its requests still hold. So dropping the last handle
/// while a request is outstanding does not break the request: it completes as it would
/// have, and the region is deregistered once that completion is polled.
///
/// Deregistering happens before an owned buffer is freed, so the device never touches
/// freed memory. Once it is deregistered, an SGE copied from it is refused at the post
/// ([`ErrorKind::NotFound`]). Not covered by the shares: a peer's WRITE, READ or atomic
/// on the rkey of a region whose handles and requests are all gone is refused with a
/// NAK, which moves both QPs to ERROR (REM_ACCESS_ERR at the peer), so keep a handle
/// while the peer may use it. A memory window keeps every region it was bound to (by a
/// `SendOp::BindMw` posted here) until the window is dropped: a region with a window
/// bound to it cannot be deregistered, and a peer may still reach it through the window.
///
/// ```
/// use std::time::Duration;
/// use softrdma::{wr, Access, Device, ErrorKind, QpInit, QpType};
/// # fn main() -> softrdma::Result<()> {
/// let dev = Device::open_default()?;
/// let pd = dev.alloc_pd()?;
/// let cq = dev.create_cq(128, None)?;
/// let (a, b) = (
///     pd.create_qp(&QpInit::new(QpType::Rc, &cq).depth(32, 32))?,
///     pd.create_qp(&QpInit::new(QpType::Rc, &cq).depth(32, 32))?,
/// );
/// a.connect_to(&b.endpoint(), Access::REMOTE_READ)?;
/// b.connect_to(&a.endpoint(), Access::REMOTE_READ)?;
/// let source = pd.register(&b"read me"[..], Access::REMOTE_READ)?;
/// let target = pd.register(64, Access::LOCAL_WRITE)?;
/// let view = target.clone(); // a second handle of the same registration
/// let stale = target.sge(0..7)?;
/// a.post_send(wr::read(1, [stale], &source.remote(), 0)?)?;
/// drop(target); // the READ holds the registration until its completion is polled
/// cq.wait(Duration::from_secs(5))?.result()?;
/// assert_eq!(view.to_vec(0, 7)?, b"read me");
/// drop(view); // the last share: deregistered now
/// let e = a.post_send(wr::send(2, [stale])).unwrap_err();
/// assert_eq!(e.kind(), ErrorKind::NotFound);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct MemoryRegion {
    reg: Arc<MrReg>,
}

/// One registration: what [`MemoryRegion`] handles share and posted work requests pin
/// (see `crate::pins`). Dropping the last `Arc` deregisters it and frees its buffer.
pub(crate) struct MrReg {
    pd: Arc<PdInner>,
    info: MrInfo,
    /// The `Access` bits it grants now ([`MemoryRegion::set_access`]).
    access: AtomicU32,
    backing: Backing,
}

// SAFETY: the raw pointers in `Backing` are owned (Owned) or promised valid by the caller
// of `register_raw` for any thread (its contract); every access to the memory through this
// type happens under the device's engine mutex, so moving the registration between threads
// or sharing it cannot create unsynchronized access.
unsafe impl Send for MrReg {}
// SAFETY: as for Send: `&MrReg` only permits copies and atomics under the engine lock.
unsafe impl Sync for MrReg {}

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &format_args!("{:#x}", self.reg.info.addr))
            .field("len", &self.reg.info.length)
            .field("lkey", &format_args!("{:#x}", self.reg.info.lkey))
            .field("rkey", &format_args!("{:#x}", self.reg.info.rkey))
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
        self.reg.info.addr
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.reg.info.length as usize
    }
    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.reg.info.length == 0
    }
    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.reg.info.lkey
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.reg.info.rkey
    }
    /// Access rights it grants (those it was registered with, or set since).
    pub fn access(&self) -> Access {
        Access::from_bits_truncate(self.reg.access.load(Ordering::Acquire))
    }

    /// Change the access rights the region grants, in place (`ibv_rereg_mr` with
    /// IBV_REREG_MR_CHANGE_ACCESS): its keys stay, so peers holding the rkey get the new
    /// rights from their next request on, and every handle on the registration sees them.
    /// Checked as at registration: REMOTE_WRITE or REMOTE_ATOMIC without LOCAL_WRITE is
    /// EINVAL; a right to write needs the memory writable (EFAULT otherwise, unless the
    /// region pages on demand). EBUSY while memory windows are bound to it. On an error
    /// nothing changes.
    pub fn set_access(&self, access: Access) -> Result<()> {
        let lkey = self.reg.info.lkey;
        // Stored under the engine lock, so that concurrent changes leave the value the
        // engine took last.
        self.reg.pd.dev.rt().objects(|rn| {
            // SAFETY: no new memory is given (`None`), so no range comes under the device
            // that the registration did not already cover.
            unsafe { rn.rereg_mr(lkey, None, None, Some(access)) }?;
            self.reg.access.store(access.bits(), Ordering::Release);
            Ok(())
        })
    }
    /// The PD it belongs to.
    pub fn pd_id(&self) -> PdId {
        self.reg.pd.id
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
            addr: self.reg.info.addr.wrapping_add(start as u64),
            length: u32::try_from(n)
                .map_err(|_| Error::invalid("an SGE carries at most 4 GiB - 1 bytes"))?,
            lkey: self.reg.info.lkey,
        })
    }
    /// What a peer needs to access the region remotely.
    pub fn remote(&self) -> RemoteMemory {
        RemoteMemory {
            addr: self.reg.info.addr,
            rkey: self.reg.info.rkey,
            len: self.reg.info.length,
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
        let pd = self.reg.pd.id;
        let sge = Sge {
            addr: self.reg.info.addr.wrapping_add(offset as u64),
            length: u32::try_from(n).map_err(|_| {
                Error::invalid("access longer than 4 GiB").with_kind(ErrorKind::OutOfBounds)
            })?,
            lkey: self.reg.info.lkey,
        };
        // Under the engine lock, which orders these copies with the device's own accesses
        // to the region, but without an engine step: touching local memory adds no
        // completion, so CQ pollers are not sent to look again (a loop watching a byte
        // would otherwise make every poll of every CQ take the lock).
        self.reg
            .pd
            .dev
            .inner
            .dev
            .read(|r| match r.local_span(pd, &sge, Access::empty()) {
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

    /// Deregister and return the buffer, if this is the last handle and no work request
    /// holds the region; otherwise (other clones, work requests not yet completed, raw
    /// and device memory) a copy of its contents, leaving the registration to the others.
    pub fn into_vec(self) -> Result<Vec<u8>> {
        match Arc::try_unwrap(self.reg) {
            Ok(reg) => reg.into_vec(),
            Err(reg) => MemoryRegion { reg }.to_vec_all(),
        }
    }

    fn to_vec_all(&self) -> Result<Vec<u8>> {
        self.to_vec(0, self.len())
    }

    /// A new handle of `reg`, entered in its device's registry so that posted work
    /// requests naming its lkey can find and pin it.
    fn new(reg: MrReg) -> MemoryRegion {
        let reg = Arc::new(reg);
        crate::pins::enter(&reg.pd.dev, reg.info.lkey, &reg);
        MemoryRegion { reg }
    }
}

impl MrReg {
    /// Deregister and return the buffer (a copy of it for raw and device memory).
    fn into_vec(self) -> Result<Vec<u8>> {
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
            MemoryRegion {
                reg: Arc::new(self),
            }
            .to_vec_all()
        }
    }

    /// Deregister, and leave the device's registry once deregistered. A registration that
    /// could not be deregistered (a window bound to it) stays there, dead, so that a post
    /// naming its lkey is refused rather than run unpinned.
    fn deregister(&mut self) -> Result<()> {
        let lkey = self.info.lkey;
        let r = self.pd.dev.rt().dereg_mr(lkey).map_err(Error::from);
        if r.is_ok() {
            crate::pins::leave(&self.pd.dev, lkey);
        }
        r
    }
}

impl Drop for MrReg {
    fn drop(&mut self) {
        let ok = self.deregister().is_ok();
        if let Backing::Owned(raw) = self.backing {
            if ok {
                // SAFETY: deregistered under the engine lock, so no device access to `raw`
                // can follow; it came from `Box::into_raw` in `register` and is freed once.
                drop(unsafe { Box::from_raw(raw) });
            }
            // If deregistration failed (a memory window still bound: one whose bind was
            // posted as this region's last handle went, so it could not pin it) the
            // buffer is leaked: freeing memory the device may still write would be unsound.
        }
    }
}

/// A memory window (`ibv_alloc_mw`). Bind it with a `SendOp::BindMw` work request; the
/// regions it is bound to stay registered until it is dropped (see
/// [`MemoryRegion`#sharing-and-dropping](MemoryRegion#sharing-and-dropping)).
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
        self.pd.dev.rt().mw_rkey(id).map_err(Error::from)
    }
}

impl Drop for MemoryWindow {
    fn drop(&mut self) {
        let id = self.id;
        if self.pd.dev.rt().dealloc_mw(id).is_ok() {
            // No longer bound: the regions it kept may go (deregistered here when this
            // was their last reference).
            drop(crate::pins::unpin_window(&self.pd.dev, id));
        }
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
        let _ = self.dev.rt().free_dm(id);
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
        self.inner
            .dev
            .rt()
            .dm_copy_to(id, offset, data)
            .map_err(Error::from)
    }
    /// Copy out from `offset`; the offset and the length are multiples of 4 (`EINVAL`
    /// otherwise).
    pub fn copy_from(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        let id = self.inner.id;
        self.inner
            .dev
            .rt()
            .dm_copy_from(id, offset, out)
            .map_err(Error::from)
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
