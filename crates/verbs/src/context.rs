//! Object tables and the rules that govern them.
//!
//! Signatures here are the contract the transport layer codes against.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Errno, Error, Result};
use crate::qp_table;
use crate::rng::SplitMix64;
use crate::types::*;

/// Device attributes (`ibv_device_attr`), with realistic values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceAttr {
    /// Firmware version string.
    pub fw_ver: String,
    /// Node GUID.
    pub node_guid: u64,
    /// System image GUID.
    pub sys_image_guid: u64,
    /// Largest MR.
    pub max_mr_size: u64,
    /// Supported page sizes.
    pub page_size_cap: u64,
    /// Vendor id.
    pub vendor_id: u32,
    /// Vendor part id.
    pub vendor_part_id: u32,
    /// Hardware version.
    pub hw_ver: u32,
    /// Max QPs.
    pub max_qp: u32,
    /// Max WRs per queue.
    pub max_qp_wr: u32,
    /// `IBV_DEVICE_*` capability flags.
    pub device_cap_flags: u32,
    /// Max SGEs per WR.
    pub max_sge: u32,
    /// Max SGEs per READ.
    pub max_sge_rd: u32,
    /// Max CQs.
    pub max_cq: u32,
    /// Max CQEs per CQ.
    pub max_cqe: u32,
    /// Max MRs.
    pub max_mr: u32,
    /// Max PDs.
    pub max_pd: u32,
    /// Max outstanding READ/atomic per QP as target.
    pub max_qp_rd_atom: u32,
    /// Max outstanding READ/atomic per EE.
    pub max_ee_rd_atom: u32,
    /// Max READ/atomic resources.
    pub max_res_rd_atom: u32,
    /// Max outstanding READ/atomic per QP as initiator.
    pub max_qp_init_rd_atom: u32,
    /// `IBV_ATOMIC_*` capability.
    pub atomic_cap: u32,
    /// Max memory windows.
    pub max_mw: u32,
    /// Max address handles.
    pub max_ah: u32,
    /// Max SRQs.
    pub max_srq: u32,
    /// Max WRs per SRQ.
    pub max_srq_wr: u32,
    /// Max SGEs per SRQ WR.
    pub max_srq_sge: u32,
    /// Max P_Keys.
    pub max_pkeys: u16,
    /// Local CA ACK delay.
    pub local_ca_ack_delay: u8,
    /// Number of ports.
    pub phys_port_cnt: u8,
    /// Max inline data.
    pub max_inline_data: u32,
    /// Max device memory bytes.
    pub max_dm_size: u64,
}

/// Port attributes (`ibv_port_attr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortAttr {
    /// `IBV_PORT_*` state (4 = ACTIVE).
    pub state: u32,
    /// Largest MTU.
    pub max_mtu: Mtu,
    /// Active MTU.
    pub active_mtu: Mtu,
    /// GID table length.
    pub gid_tbl_len: i32,
    /// Capability flags.
    pub port_cap_flags: u32,
    /// Largest message.
    pub max_msg_sz: u32,
    /// P_Key table length.
    pub pkey_tbl_len: u16,
    /// LID (0 on RoCE).
    pub lid: u16,
    /// SM LID.
    pub sm_lid: u16,
    /// Active width code.
    pub active_width: u8,
    /// Active speed code.
    pub active_speed: u8,
    /// Physical state (5 = LINK_UP).
    pub phys_state: u8,
    /// Link layer (2 = Ethernet).
    pub link_layer: u8,
}

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

/// Object tables are keyed by small integers (ids, key indices, QP numbers) that the
/// packet path looks up several times per packet. SipHash's flood resistance buys
/// nothing here (a peer can look keys up but never insert them), so a multiply-rotate
/// hash (FxHash's) is used instead.
#[derive(Default, Clone, Copy)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u8(&mut self, v: u8) {
        self.write_u64(u64::from(v));
    }
    fn write_u16(&mut self, v: u16) {
        self.write_u64(u64::from(v));
    }
    fn write_u32(&mut self, v: u32) {
        self.write_u64(u64::from(v));
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
    fn write_usize(&mut self, v: usize) {
        self.write_u64(v as u64);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

/// A table keyed by small integers (see [`IdHasher`]).
type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

/// How a CQ is armed for its next event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arm {
    /// Any next completion.
    Next,
    /// Only a completion of a received message with the solicited bit (or any error).
    Solicited,
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
    fn new(ptr: *mut u8, len: usize) -> Self {
        MemSpan {
            ptr,
            len,
            _ctx: PhantomData,
        }
    }
    /// An empty span (zero-length operations).
    fn empty() -> Self {
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

/// A queue pair's verbs-visible part: identity, bindings, state machine, attributes and
/// receive queue. The send queue and protocol state live in the transport.
#[derive(Debug)]
pub struct Qp {
    /// QP number.
    pub qpn: Qpn,
    /// Creation attributes (with the actual caps).
    pub init: QpInitAttr,
    /// Current state.
    pub state: QpState,
    /// Current attribute values (state included).
    pub attr: QpAttr,
    /// Posted receive WRs (unused when the QP has an SRQ).
    pub rq: VecDeque<RecvWr>,
}

// ---------------------------------------------------------------- internal objects

/// Default sizes, after rxe's `rxe_param.h` where that makes sense for a user-space device.
mod limits {
    /// Bytes of device memory in all.
    pub const MAX_DM_SIZE: u64 = 256 * 1024;
    /// P_Key table length.
    pub const PKEY_TBL_LEN: u16 = 64;
    /// Bytes an SGE occupies in a WQE (`struct ibv_sge`): inline data shares that room.
    pub const SGE_BYTES: u32 = 16;
    /// Lowest QPN handed out (0 and 1 are the special QPs; rxe starts at 16 + 1).
    pub const MIN_QPN: u32 = 0x11;
    /// Largest 24-bit number.
    pub const MASK24: u32 = 0x00FF_FFFF;
}

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

#[derive(Debug)]
struct DmObj {
    buf: DmBuf,
}

#[derive(Debug)]
struct MrObj {
    pd: PdId,
    key: u32,
    ptr: *mut u8,
    len: usize,
    iova: u64,
    access: Access,
    /// Addresses are offsets from 0 (ZERO_BASED or device memory).
    zero_based: bool,
    dm: Option<DmId>,
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
    fn contains(&self, va: u64, len: u64) -> bool {
        match va.checked_sub(self.base()) {
            Some(off) => matches!(off.checked_add(len), Some(end) if end <= self.len as u64),
            None => false,
        }
    }
    /// Host pointer of `va` once `contains(va, _)` holds.
    fn host(&self, va: u64) -> *mut u8 {
        let off = va.wrapping_sub(self.base()) as usize;
        self.ptr.wrapping_add(off)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MwState {
    /// Type 2 not bound (or invalidated).
    Free,
    /// Bound (type 1 windows are always valid, possibly with no region).
    Valid,
}

#[derive(Debug)]
struct MwObj {
    pd: PdId,
    mw_type: u8,
    rkey: u32,
    state: MwState,
    /// Key of the region the window is bound to.
    mr_key: Option<u32>,
    /// Window start in the region's address space.
    addr: u64,
    length: u64,
    access: Access,
    /// Type 2: the QP the window is bound to.
    qpn: Option<Qpn>,
}

#[derive(Debug)]
struct CqObj {
    cap: u32,
    q: VecDeque<WorkCompletion>,
    overflowed: bool,
    channel: Option<ChannelId>,
    timestamps: bool,
    arm: Option<Arm>,
    /// Events handed out by `get_cq_event` and not yet acknowledged.
    unacked: u64,
}

#[derive(Debug, Default)]
struct ChannelObj {
    events: VecDeque<CqId>,
}

#[derive(Debug)]
struct SrqObj {
    pd: PdId,
    max_wr: u32,
    max_sge: u32,
    limit: u32,
    q: VecDeque<RecvWr>,
}

fn einval(msg: &'static str) -> Error {
    Error::inval(msg)
}
fn ebusy(msg: &'static str) -> Error {
    Error::new(Errno::EBUSY, msg)
}
fn enomem(msg: &'static str) -> Error {
    Error::new(Errno::ENOMEM, msg)
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

/// One device's verbs objects.
#[derive(Debug)]
pub struct Context {
    dev: DeviceAttr,
    port: PortAttr,
    gids: Vec<Gid>,
    pkeys: Vec<u16>,
    rng: SplitMix64,
    next_id: u32,
    pds: IdMap<PdId, ()>,
    /// MRs by key index (key >> 8).
    mrs: IdMap<u32, MrObj>,
    mws: IdMap<MwId, MwObj>,
    /// Windows by rkey index (key >> 8); shares the index space with `mrs`.
    mw_index: IdMap<u32, MwId>,
    dms: IdMap<DmId, DmObj>,
    dm_total: u64,
    cqs: IdMap<CqId, CqObj>,
    channels: IdMap<ChannelId, ChannelObj>,
    srqs: IdMap<SrqId, SrqObj>,
    qps: IdMap<Qpn, Qp>,
    ahs: IdMap<AhId, (PdId, AhAttr)>,
    events: VecDeque<AsyncEvent>,
}

// SAFETY: the raw pointers a Context holds point either into memory whose registrant promised
// (in `reg_mr`'s contract) that it stays valid until deregistration and may be accessed by the
// device at any time from any thread, or into device-memory buffers the Context owns. Nothing
// in a Context is tied to the thread that created it.
unsafe impl Send for Context {}
// SAFETY: through `&Context` registered memory is only touched by raw copies and atomics in
// `MemSpan` (the DMA model the registrant accepted); all other state needs `&mut Context`.
unsafe impl Sync for Context {}

impl Context {
    /// A context with default attributes, the given GID table (index 0 first), and a seed for
    /// key generation (so keys are unpredictable in production and reproducible in tests).
    pub fn new(gids: Vec<Gid>, seed: u64) -> Context {
        let mut gids = gids;
        gids.truncate(256);
        let g0 = gids.first().copied().unwrap_or_default().0;
        // An EUI-64 style GUID from the low bytes of GID 0, as rxe derives it from the MAC.
        let node_guid =
            u64::from_be_bytes([0x02, g0[13], g0[14], 0xFF, 0xFE, g0[15], g0[12], 0x01]);
        let dev = DeviceAttr {
            fw_ver: concat!("softrdma ", env!("CARGO_PKG_VERSION")).to_string(),
            node_guid,
            sys_image_guid: node_guid,
            max_mr_size: u64::MAX,
            page_size_cap: 0xFFFF_F000,
            vendor_id: 0x00FF_FFFF,
            vendor_part_id: 0,
            hw_ver: 0,
            max_qp: 0x10000,
            max_qp_wr: 16384,
            // BAD_PKEY_CNTR | BAD_QKEY_CNTR | UD_AV_PORT_ENFORCE | PORT_ACTIVE_EVENT |
            // SYS_IMAGE_GUID | RC_RNR_NAK_GEN | SRQ_RESIZE | MEM_WINDOW | MEM_WINDOW_TYPE_2B
            device_cap_flags: 2 | 4 | 64 | 1024 | 2048 | 4096 | 8192 | (1 << 17) | (1 << 24),
            max_sge: 32,
            max_sge_rd: 32,
            max_cq: 0x10000,
            max_cqe: (1 << 15) - 1,
            max_mr: 0x10000,
            max_pd: 0x10000,
            max_qp_rd_atom: 128,
            max_ee_rd_atom: 0,
            max_res_rd_atom: 0x3F000,
            max_qp_init_rd_atom: 128,
            atomic_cap: 1,
            max_mw: 0x10000,
            max_ah: (1 << 15) - 1,
            max_srq: 0x10000,
            max_srq_wr: 16384,
            max_srq_sge: 27,
            max_pkeys: limits::PKEY_TBL_LEN,
            local_ca_ack_delay: 15,
            phys_port_cnt: 1,
            max_inline_data: 32 * limits::SGE_BYTES,
            max_dm_size: limits::MAX_DM_SIZE,
        };
        let port = PortAttr {
            state: 4,
            max_mtu: Mtu::Mtu4096,
            active_mtu: Mtu::Mtu1024,
            gid_tbl_len: gids.len() as i32,
            port_cap_flags: 1 << 16, // IB_PORT_CM_SUP, as rxe
            max_msg_sz: 0x8000_0000,
            pkey_tbl_len: limits::PKEY_TBL_LEN,
            lid: 0,
            sm_lid: 0,
            active_width: 2, // 4X
            active_speed: 8, // FDR10: 4X × 10 Gb/s
            phys_state: 5,
            link_layer: 2,
        };
        let mut pkeys = vec![0u16; limits::PKEY_TBL_LEN as usize];
        pkeys[0] = 0xFFFF;
        Context {
            dev,
            port,
            gids,
            pkeys,
            rng: SplitMix64::new(seed),
            next_id: 1,
            pds: IdMap::default(),
            mrs: IdMap::default(),
            mws: IdMap::default(),
            mw_index: IdMap::default(),
            dms: IdMap::default(),
            dm_total: 0,
            cqs: IdMap::default(),
            channels: IdMap::default(),
            srqs: IdMap::default(),
            qps: IdMap::default(),
            ahs: IdMap::default(),
            events: VecDeque::new(),
        }
    }
    /// Device attributes.
    pub fn device_attr(&self) -> &DeviceAttr {
        &self.dev
    }
    /// Port attributes (port 1 only).
    pub fn port_attr(&self, port: u8) -> Result<PortAttr> {
        if port != 1 {
            return Err(einval("no such port"));
        }
        Ok(self.port)
    }
    /// Set the port's active MTU (for example from the network MTU); EINVAL above `max_mtu`.
    pub fn set_active_mtu(&mut self, mtu: Mtu) -> Result<()> {
        if mtu > self.port.max_mtu {
            return Err(einval("MTU above the port maximum"));
        }
        self.port.active_mtu = mtu;
        Ok(())
    }
    /// The GID table.
    pub fn gids(&self) -> &[Gid] {
        &self.gids
    }
    /// GID at `index`.
    pub fn gid(&self, index: u8) -> Result<Gid> {
        self.gids
            .get(index as usize)
            .copied()
            .ok_or(einval("GID index out of range"))
    }
    /// P_Key at `index` (index 0 holds the default 0xFFFF).
    pub fn pkey(&self, index: u16) -> Result<u16> {
        self.pkeys
            .get(index as usize)
            .copied()
            .ok_or(einval("P_Key index out of range"))
    }

    fn new_id(&mut self) -> Result<u32> {
        let id = self.next_id;
        self.next_id = id.checked_add(1).ok_or(enomem("object ids exhausted"))?;
        Ok(id)
    }
    fn check_pd(&self, pd: PdId) -> Result<()> {
        if self.pds.contains_key(&pd) {
            Ok(())
        } else {
            Err(einval("no such PD"))
        }
    }
    /// A fresh key: a random, unused, nonzero 24-bit index and a random 8-bit key byte.
    fn alloc_key(&mut self) -> Result<u32> {
        for _ in 0..256 {
            let r = self.rng.next_u64();
            let index = (r as u32) & limits::MASK24;
            if index == 0 || self.mrs.contains_key(&index) || self.mw_index.contains_key(&index) {
                continue;
            }
            return Ok((index << 8) | ((r >> 32) as u32 & 0xFF));
        }
        Err(enomem("no free key"))
    }

    // ---- PD
    /// Allocate a protection domain.
    pub fn alloc_pd(&mut self) -> Result<PdId> {
        if self.pds.len() >= self.dev.max_pd as usize {
            return Err(enomem("too many PDs"));
        }
        let pd = PdId(self.new_id()?);
        self.pds.insert(pd, ());
        Ok(pd)
    }
    /// Free a PD; EBUSY while objects use it.
    pub fn dealloc_pd(&mut self, pd: PdId) -> Result<()> {
        self.check_pd(pd)?;
        let busy = self.mrs.values().any(|m| m.pd == pd)
            || self.mws.values().any(|w| w.pd == pd)
            || self.qps.values().any(|q| q.init.pd == pd)
            || self.ahs.values().any(|a| a.0 == pd)
            || self.srqs.values().any(|s| s.pd == pd);
        if busy {
            return Err(ebusy("PD in use"));
        }
        self.pds.remove(&pd);
        Ok(())
    }

    // ---- MR
    /// Register `len` bytes at `ptr` as seen at address `iova`.
    /// REMOTE_WRITE or REMOTE_ATOMIC without LOCAL_WRITE is EINVAL.
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay valid for reads and writes until the region is deregistered,
    /// and the caller accepts that the device writes it at any time while registered.
    pub unsafe fn reg_mr(
        &mut self,
        pd: PdId,
        ptr: *mut u8,
        len: usize,
        iova: u64,
        access: Access,
    ) -> Result<MrInfo> {
        let zero_based = access.contains(Access::ZERO_BASED);
        if !zero_based && iova.checked_add(len as u64).is_none() {
            return Err(einval("iova + length overflows"));
        }
        self.insert_mr(pd, ptr, len, iova, access, zero_based, None)
    }

    #[allow(clippy::too_many_arguments)]
    fn insert_mr(
        &mut self,
        pd: PdId,
        ptr: *mut u8,
        len: usize,
        iova: u64,
        access: Access,
        zero_based: bool,
        dm: Option<DmId>,
    ) -> Result<MrInfo> {
        self.check_pd(pd)?;
        check_mr_access(access)?;
        if ptr.is_null() && len > 0 {
            return Err(Error::new(Errno::EFAULT, "null address"));
        }
        if (ptr as usize).checked_add(len).is_none() || len > isize::MAX as usize {
            return Err(Error::new(Errno::EFAULT, "range wraps the address space"));
        }
        if self.mrs.len() >= self.dev.max_mr as usize {
            return Err(enomem("too many MRs"));
        }
        let key = self.alloc_key()?;
        let ptr = if len == 0 {
            NonNull::<u8>::dangling().as_ptr()
        } else {
            ptr
        };
        let mr = MrObj {
            pd,
            key,
            ptr,
            len,
            iova,
            access,
            zero_based,
            dm,
        };
        let addr = mr.base();
        self.mrs.insert(key >> 8, mr);
        Ok(MrInfo {
            lkey: key,
            rkey: key,
            addr,
            length: len as u64,
        })
    }
    fn mr_by_key(&self, key: u32) -> Option<&MrObj> {
        self.mrs.get(&(key >> 8)).filter(|m| m.key == key)
    }
    /// Deregister by lkey; EBUSY while windows are bound to it.
    pub fn dereg_mr(&mut self, lkey: u32) -> Result<()> {
        if self.mr_by_key(lkey).is_none() {
            return Err(einval("no such MR"));
        }
        if self
            .mws
            .values()
            .any(|w| w.state == MwState::Valid && w.mr_key == Some(lkey))
        {
            return Err(ebusy("memory windows are bound to the MR"));
        }
        self.mrs.remove(&(lkey >> 8));
        Ok(())
    }
    /// Check a local SGE for the QP's PD and the access needed (LOCAL_WRITE when the device
    /// writes it); LocProtErr on failure.
    pub fn local_span(
        &self,
        pd: PdId,
        sge: &Sge,
        need: Access,
    ) -> core::result::Result<MemSpan<'_>, WcStatus> {
        if sge.length == 0 {
            return Ok(MemSpan::empty());
        }
        let mr = self.mr_by_key(sge.lkey).ok_or(WcStatus::LocProtErr)?;
        if mr.pd != pd || !mr.access.contains(need) || !mr.contains(sge.addr, sge.length as u64) {
            return Err(WcStatus::LocProtErr);
        }
        Ok(MemSpan::new(mr.host(sge.addr), sge.length as usize))
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
    ) -> core::result::Result<(), WcStatus> {
        let total: u64 = sg_list.iter().map(|s| s.length as u64).sum();
        let end = (offset as u64)
            .checked_add(len as u64)
            .ok_or(WcStatus::LocLenErr)?;
        if end > total {
            return Err(WcStatus::LocLenErr);
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
                return Err(WcStatus::LocProtErr);
            }
            done += n;
            skip = 0;
            if done == len {
                break;
            }
        }
        Ok(())
    }
    /// Write `data` at byte `offset` of the message laid out over `sg_list`.
    /// LocLenErr if it runs past the list, LocProtErr if a key fails.
    pub fn scatter(
        &self,
        pd: PdId,
        sg_list: &[Sge],
        offset: usize,
        data: &[u8],
    ) -> core::result::Result<(), WcStatus> {
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
    ) -> core::result::Result<(), WcStatus> {
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
        let (mr, mr_va) = if let Some(mr) = self.mr_by_key(rkey) {
            if mr.pd != pd || !mr.access.contains(need) {
                return Err(Denied);
            }
            (mr, va)
        } else {
            let id = self.mw_index.get(&(rkey >> 8)).ok_or(Denied)?;
            let mw = self.mws.get(id).ok_or(Denied)?;
            if mw.rkey != rkey || mw.state != MwState::Valid || mw.pd != pd {
                return Err(Denied);
            }
            if mw.mw_type == 2 && mw.qpn != Some(qpn) {
                return Err(Denied);
            }
            if !mw.access.contains(need) {
                return Err(Denied);
            }
            let mr = mw.mr_key.and_then(|k| self.mr_by_key(k)).ok_or(Denied)?;
            // Window-relative offset of va.
            let off = if mw.access.contains(Access::ZERO_BASED) {
                va
            } else {
                va.checked_sub(mw.addr).ok_or(Denied)?
            };
            match off.checked_add(len64) {
                Some(end) if end <= mw.length => {}
                _ => return Err(Denied),
            }
            (mr, mw.addr.checked_add(off).ok_or(Denied)?)
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
    /// Invalidate an rkey (SEND_WITH_INV at the responder, LOCAL_INV at the requester):
    /// MRs with MW_BIND-capable type-2 windows and fast-reg style keys.
    /// Returns the error status to report on failure.
    ///
    /// Only bound type-2 windows of `pd` can be invalidated here: this layer has no
    /// fast-registration MRs, and, as in rxe, an ordinary MR's key cannot be invalidated.
    /// Any failure (unknown key, an MR key, a type-1 window, another PD, an unbound window)
    /// returns `MwBindErr` ("memory management operation error", the requester's status for
    /// a failed LOCAL_INV); a responder handling SEND_WITH_INV reports its invalid request
    /// error (`RemInvReqErr`) instead.
    pub fn invalidate_rkey(&mut self, pd: PdId, rkey: u32) -> core::result::Result<(), WcStatus> {
        let id = *self.mw_index.get(&(rkey >> 8)).ok_or(WcStatus::MwBindErr)?;
        let mw = self.mws.get_mut(&id).ok_or(WcStatus::MwBindErr)?;
        if mw.rkey != rkey || mw.mw_type != 2 || mw.pd != pd || mw.state != MwState::Valid {
            return Err(WcStatus::MwBindErr);
        }
        mw.state = MwState::Free;
        mw.mr_key = None;
        mw.qpn = None;
        Ok(())
    }

    // ---- MW
    /// Allocate a memory window of type 1 or 2.
    pub fn alloc_mw(&mut self, pd: PdId, mw_type: u8) -> Result<MwId> {
        self.check_pd(pd)?;
        if mw_type != 1 && mw_type != 2 {
            return Err(einval("memory window type must be 1 or 2"));
        }
        if self.mws.len() >= self.dev.max_mw as usize {
            return Err(enomem("too many memory windows"));
        }
        let rkey = self.alloc_key()?;
        let id = MwId(self.new_id()?);
        self.mws.insert(
            id,
            MwObj {
                pd,
                mw_type,
                rkey,
                state: if mw_type == 1 {
                    MwState::Valid
                } else {
                    MwState::Free
                },
                mr_key: None,
                addr: 0,
                length: 0,
                access: Access::empty(),
                qpn: None,
            },
        );
        self.mw_index.insert(rkey >> 8, id);
        Ok(id)
    }
    /// Free a window.
    pub fn dealloc_mw(&mut self, mw: MwId) -> Result<()> {
        let obj = self
            .mws
            .remove(&mw)
            .ok_or(einval("no such memory window"))?;
        self.mw_index.remove(&(obj.rkey >> 8));
        Ok(())
    }
    /// Current rkey of a window.
    pub fn mw_rkey(&self, mw: MwId) -> Result<u32> {
        self.mws
            .get(&mw)
            .map(|w| w.rkey)
            .ok_or(einval("no such memory window"))
    }
    /// Bind (executed in send-queue order by the transport). For type 1 the key byte is
    /// bumped and the new rkey returned; for type 2 `bind.rkey` becomes the key and the window
    /// is tied to `qpn`. MwBindErr on failure (MR without MW_BIND, bounds, PD, wrong type).
    ///
    /// Type 2: the window must be free (unbound or invalidated), `bind.rkey` must keep the
    /// window's index (upper 24 bits, as `ibv_inc_rkey` does) and `qpn` must exist. Type 1:
    /// ZERO_BASED is not allowed; a zero length unbinds. Remote write or atomic rights need
    /// LOCAL_WRITE on the region.
    pub fn bind_mw(
        &mut self,
        pd: PdId,
        qpn: Qpn,
        bind: &MwBind,
    ) -> core::result::Result<u32, WcStatus> {
        const E: WcStatus = WcStatus::MwBindErr;
        let mw = self.mws.get(&bind.mw).ok_or(E)?;
        if mw.pd != pd {
            return Err(E);
        }
        let t = mw.mw_type;
        let new_rkey = if t == 1 {
            if bind.access.contains(Access::ZERO_BASED) {
                return Err(E);
            }
            (mw.rkey & !0xFF) | (mw.rkey.wrapping_add(1) & 0xFF)
        } else {
            if mw.state != MwState::Free
                || (bind.rkey & !0xFF) != (mw.rkey & !0xFF)
                || !self.qps.contains_key(&qpn)
            {
                return Err(E);
            }
            bind.rkey
        };
        let unbind = t == 1 && bind.length == 0;
        if !unbind {
            let mr = self.mr_by_key(bind.mr_lkey).ok_or(E)?;
            if mr.pd != pd
                || !mr.access.contains(Access::MW_BIND)
                || !mr.contains(bind.addr, bind.length)
            {
                return Err(E);
            }
            if bind
                .access
                .intersects(Access::REMOTE_WRITE | Access::REMOTE_ATOMIC)
                && !mr.access.contains(Access::LOCAL_WRITE)
            {
                return Err(E);
            }
        }
        let Some(mw) = self.mws.get_mut(&bind.mw) else {
            return Err(E);
        };
        mw.rkey = new_rkey;
        mw.state = MwState::Valid;
        if unbind {
            mw.mr_key = None;
            mw.addr = 0;
            mw.length = 0;
            mw.access = Access::empty();
        } else {
            mw.mr_key = Some(bind.mr_lkey);
            mw.addr = bind.addr;
            mw.length = bind.length;
            mw.access = bind.access;
        }
        mw.qpn = if t == 2 { Some(qpn) } else { None };
        Ok(new_rkey)
    }

    // ---- DM
    /// Allocate device memory.
    pub fn alloc_dm(&mut self, len: usize) -> Result<DmId> {
        if len == 0 {
            return Err(einval("zero-length device memory"));
        }
        let total = self.dm_total.checked_add(len as u64);
        if !matches!(total, Some(t) if t <= self.dev.max_dm_size) {
            return Err(enomem("device memory exhausted"));
        }
        let id = DmId(self.new_id()?);
        self.dms.insert(
            id,
            DmObj {
                buf: DmBuf::new(len),
            },
        );
        self.dm_total += len as u64;
        Ok(id)
    }
    /// Free device memory; EBUSY while registered.
    pub fn free_dm(&mut self, dm: DmId) -> Result<()> {
        if !self.dms.contains_key(&dm) {
            return Err(einval("no such device memory"));
        }
        if self.mrs.values().any(|m| m.dm == Some(dm)) {
            return Err(ebusy("device memory is registered"));
        }
        if let Some(obj) = self.dms.remove(&dm) {
            self.dm_total = self.dm_total.saturating_sub(obj.buf.len as u64);
        }
        Ok(())
    }
    /// The device memory span `offset..offset+n`.
    fn dm_span(&self, dm: DmId, offset: u64, n: usize) -> Result<MemSpan<'_>> {
        let obj = self.dms.get(&dm).ok_or(einval("no such device memory"))?;
        let off = usize::try_from(offset).map_err(|_| einval("offset out of range"))?;
        match off.checked_add(n) {
            Some(end) if end <= obj.buf.len => {}
            _ => return Err(einval("device memory access out of bounds")),
        }
        Ok(MemSpan::new(obj.buf.ptr.wrapping_add(off), n))
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
        let ptr = self.dm_span(dm, offset, len)?.ptr;
        // The buffer is owned by the context and outlives the MR (free_dm is EBUSY meanwhile).
        self.insert_mr(pd, ptr, len, 0, access | Access::ZERO_BASED, true, Some(dm))
    }

    // ---- CQ and channels
    /// Create a completion channel.
    pub fn create_channel(&mut self) -> Result<ChannelId> {
        let ch = ChannelId(self.new_id()?);
        self.channels.insert(ch, ChannelObj::default());
        Ok(ch)
    }
    /// Destroy a channel; EBUSY while CQs use it.
    pub fn destroy_channel(&mut self, ch: ChannelId) -> Result<()> {
        if !self.channels.contains_key(&ch) {
            return Err(einval("no such channel"));
        }
        if self.cqs.values().any(|c| c.channel == Some(ch)) {
            return Err(ebusy("CQs use the channel"));
        }
        self.channels.remove(&ch);
        Ok(())
    }
    fn check_cqe(&self, cqe: u32) -> Result<()> {
        if cqe == 0 || cqe > self.dev.max_cqe {
            return Err(einval("CQ size out of range"));
        }
        Ok(())
    }
    /// Create a CQ of at least `cqe` entries; returns its id and actual capacity.
    pub fn create_cq(
        &mut self,
        cqe: u32,
        channel: Option<ChannelId>,
        timestamps: bool,
    ) -> Result<(CqId, u32)> {
        self.check_cqe(cqe)?;
        if let Some(ch) = channel {
            if !self.channels.contains_key(&ch) {
                return Err(einval("no such channel"));
            }
        }
        if self.cqs.len() >= self.dev.max_cq as usize {
            return Err(enomem("too many CQs"));
        }
        let id = CqId(self.new_id()?);
        self.cqs.insert(
            id,
            CqObj {
                cap: cqe,
                q: VecDeque::new(),
                overflowed: false,
                channel,
                timestamps,
                arm: None,
                unacked: 0,
            },
        );
        Ok((id, cqe))
    }
    /// Resize a CQ; EINVAL if smaller than its current contents.
    pub fn resize_cq(&mut self, cq: CqId, cqe: u32) -> Result<u32> {
        self.check_cqe(cqe)?;
        let c = self.cqs.get_mut(&cq).ok_or(einval("no such CQ"))?;
        if (cqe as usize) < c.q.len() {
            return Err(einval("CQ holds more completions than the new size"));
        }
        c.cap = cqe;
        Ok(cqe)
    }
    /// Destroy a CQ; EBUSY while QPs use it or events are unacknowledged.
    pub fn destroy_cq(&mut self, cq: CqId) -> Result<()> {
        let c = self.cqs.get(&cq).ok_or(einval("no such CQ"))?;
        if c.unacked > 0 {
            return Err(ebusy("CQ events not acknowledged"));
        }
        if self
            .qps
            .values()
            .any(|q| q.init.send_cq == cq || q.init.recv_cq == cq)
        {
            return Err(ebusy("QPs use the CQ"));
        }
        if let Some(ch) = c.channel.and_then(|ch| self.channels.get_mut(&ch)) {
            ch.events.retain(|&e| e != cq);
        }
        self.cqs.remove(&cq);
        Ok(())
    }
    /// Append a completion at time `now_ns`. If the CQ is full it overflows: the completion
    /// is lost, the CQ enters error and a `CqErr` async event is queued (the spec's behaviour).
    /// If armed (and for `Solicited` only when `solicited` or the status is an error), an
    /// event is queued on its channel and the arm is consumed. Returns false on overflow.
    pub fn push_completion(
        &mut self,
        cq: CqId,
        wc: WorkCompletion,
        solicited: bool,
        now_ns: u64,
    ) -> bool {
        let Some(c) = self.cqs.get_mut(&cq) else {
            return false;
        };
        if c.overflowed {
            return false;
        }
        if c.q.len() >= c.cap as usize {
            c.overflowed = true;
            self.events.push_back(AsyncEvent::CqErr(cq));
            return false;
        }
        let mut wc = wc;
        wc.timestamp = c.timestamps.then_some(now_ns);
        let status_err = wc.status != WcStatus::Success;
        c.q.push_back(wc);
        let fire = match c.arm {
            Some(Arm::Next) => true,
            Some(Arm::Solicited) => solicited || status_err,
            None => false,
        };
        if fire {
            c.arm = None;
            if let Some(ch) = c.channel.and_then(|ch| self.channels.get_mut(&ch)) {
                ch.events.push_back(cq);
            }
        }
        true
    }
    /// Poll up to `out.len()` completions, oldest first. EIO-like error (EINVAL) if overflowed.
    pub fn poll_cq(&mut self, cq: CqId, out: &mut [WorkCompletion]) -> Result<usize> {
        let c = self.cqs.get_mut(&cq).ok_or(einval("no such CQ"))?;
        if c.overflowed {
            return Err(einval("CQ overflowed"));
        }
        let mut n = 0;
        for slot in out.iter_mut() {
            match c.q.pop_front() {
                Some(wc) => {
                    *slot = wc;
                    n += 1;
                }
                None => break,
            }
        }
        Ok(n)
    }
    /// Number of completions waiting.
    pub fn cq_len(&self, cq: CqId) -> Result<usize> {
        self.cqs
            .get(&cq)
            .map(|c| c.q.len())
            .ok_or(einval("no such CQ"))
    }
    /// Arm the CQ for one event.
    pub fn req_notify_cq(&mut self, cq: CqId, arm: Arm) -> Result<()> {
        let c = self.cqs.get_mut(&cq).ok_or(einval("no such CQ"))?;
        // Next is the wider request: it is not narrowed by a later Solicited.
        if c.arm != Some(Arm::Next) {
            c.arm = Some(arm);
        }
        Ok(())
    }
    /// Take the next CQ event from a channel, if any.
    pub fn get_cq_event(&mut self, ch: ChannelId) -> Option<CqId> {
        let chan = self.channels.get_mut(&ch)?;
        let cq = chan.events.pop_front()?;
        if let Some(c) = self.cqs.get_mut(&cq) {
            c.unacked += 1;
        }
        Some(cq)
    }
    /// Number of events waiting on a channel.
    pub fn channel_pending(&self, ch: ChannelId) -> usize {
        self.channels.get(&ch).map_or(0, |c| c.events.len())
    }
    /// Acknowledge `n` events of a CQ. EINVAL if more than were taken with `get_cq_event`.
    pub fn ack_cq_events(&mut self, cq: CqId, n: u32) -> Result<()> {
        let c = self.cqs.get_mut(&cq).ok_or(einval("no such CQ"))?;
        if n as u64 > c.unacked {
            return Err(einval("more events acknowledged than received"));
        }
        c.unacked -= n as u64;
        Ok(())
    }

    // ---- SRQ
    /// Create an SRQ with `max_wr`, `max_sge` and a limit (0 = disarmed).
    /// `max_wr` and `max_sge` of 0 are rounded up to 1; EINVAL above the device limits or for
    /// a limit above `max_wr`.
    pub fn create_srq(&mut self, pd: PdId, max_wr: u32, max_sge: u32, limit: u32) -> Result<SrqId> {
        self.check_pd(pd)?;
        if max_wr > self.dev.max_srq_wr || max_sge > self.dev.max_srq_sge {
            return Err(einval("SRQ size above device limits"));
        }
        let max_wr = max_wr.max(1);
        let max_sge = max_sge.max(1);
        if limit > max_wr {
            return Err(einval("SRQ limit above max_wr"));
        }
        if self.srqs.len() >= self.dev.max_srq as usize {
            return Err(enomem("too many SRQs"));
        }
        let id = SrqId(self.new_id()?);
        self.srqs.insert(
            id,
            SrqObj {
                pd,
                max_wr,
                max_sge,
                limit,
                q: VecDeque::new(),
            },
        );
        Ok(id)
    }
    /// Change max_wr (grow only) and/or arm the limit. EINVAL for a limit above max_wr.
    pub fn modify_srq(
        &mut self,
        srq: SrqId,
        max_wr: Option<u32>,
        limit: Option<u32>,
    ) -> Result<()> {
        let dev_max = self.dev.max_srq_wr;
        let s = self.srqs.get_mut(&srq).ok_or(einval("no such SRQ"))?;
        let new_max = max_wr.unwrap_or(s.max_wr);
        if new_max < s.max_wr || new_max > dev_max {
            return Err(einval("SRQ max_wr may only grow, up to the device limit"));
        }
        let new_limit = limit.unwrap_or(s.limit);
        if new_limit > new_max {
            return Err(einval("SRQ limit above max_wr"));
        }
        s.max_wr = new_max;
        s.limit = new_limit;
        Ok(())
    }
    /// (max_wr, max_sge, limit).
    pub fn query_srq(&self, srq: SrqId) -> Result<(u32, u32, u32)> {
        self.srqs
            .get(&srq)
            .map(|s| (s.max_wr, s.max_sge, s.limit))
            .ok_or(einval("no such SRQ"))
    }
    /// Destroy an SRQ; EBUSY while QPs use it.
    pub fn destroy_srq(&mut self, srq: SrqId) -> Result<()> {
        if !self.srqs.contains_key(&srq) {
            return Err(einval("no such SRQ"));
        }
        if self.qps.values().any(|q| q.init.srq == Some(srq)) {
            return Err(ebusy("QPs use the SRQ"));
        }
        self.srqs.remove(&srq);
        Ok(())
    }
    /// Post a receive WR to an SRQ (ENOMEM when full, EINVAL for too many SGEs).
    pub fn post_srq_recv(&mut self, srq: SrqId, wr: RecvWr) -> Result<()> {
        let s = self.srqs.get_mut(&srq).ok_or(einval("no such SRQ"))?;
        if wr.sg_list.len() > s.max_sge as usize {
            return Err(einval("too many SGEs"));
        }
        if s.q.len() >= s.max_wr as usize {
            return Err(enomem("SRQ full"));
        }
        s.q.push_back(wr);
        Ok(())
    }
    /// Number of receive WRs posted to an SRQ.
    pub fn srq_len(&self, srq: SrqId) -> Result<usize> {
        self.srqs
            .get(&srq)
            .map(|s| s.q.len())
            .ok_or(einval("no such SRQ"))
    }

    // ---- QP
    /// Create a QP in RESET; caps are checked against the device and rounded up.
    ///
    /// Rounding: queue depths and SGE counts are at least 1 (receive caps are 0 with an
    /// SRQ); inline data and send SGEs share a WQE's room of 16 bytes per SGE, so
    /// `max_inline_data` is at least `16 × max_send_sge` and `max_send_sge` at least
    /// `max_inline_data / 16`, as rxe reports them.
    pub fn create_qp(&mut self, init: QpInitAttr) -> Result<Qpn> {
        self.check_pd(init.pd)?;
        if !self.cqs.contains_key(&init.send_cq) || !self.cqs.contains_key(&init.recv_cq) {
            return Err(einval("no such CQ"));
        }
        if let Some(srq) = init.srq {
            if !self.srqs.contains_key(&srq) {
                return Err(einval("no such SRQ"));
            }
        }
        let d = &self.dev;
        let c = init.cap;
        if c.max_send_wr > d.max_qp_wr
            || c.max_send_sge > d.max_sge
            || c.max_inline_data > d.max_inline_data
            || (init.srq.is_none() && (c.max_recv_wr > d.max_qp_wr || c.max_recv_sge > d.max_sge))
        {
            return Err(einval("QP caps above device limits"));
        }
        if self.qps.len() >= d.max_qp as usize {
            return Err(enomem("too many QPs"));
        }
        let send_sge = c.max_send_sge.max(1);
        let room = (send_sge * limits::SGE_BYTES)
            .max(c.max_inline_data)
            .min(d.max_inline_data);
        let cap = QpCap {
            max_send_wr: c.max_send_wr.max(1),
            max_send_sge: (room / limits::SGE_BYTES).max(send_sge),
            max_inline_data: room,
            max_recv_wr: if init.srq.is_some() {
                0
            } else {
                c.max_recv_wr.max(1)
            },
            max_recv_sge: if init.srq.is_some() {
                0
            } else {
                c.max_recv_sge.max(1)
            },
        };
        let qpn = self.alloc_qpn()?;
        let init = QpInitAttr { cap, ..init };
        self.qps.insert(
            qpn,
            Qp {
                qpn,
                init,
                state: QpState::Reset,
                attr: Self::reset_attr(cap),
                rq: VecDeque::new(),
            },
        );
        Ok(qpn)
    }
    fn reset_attr(cap: QpCap) -> QpAttr {
        QpAttr {
            cap,
            port_num: 1,
            ..QpAttr::default()
        }
    }
    fn alloc_qpn(&mut self) -> Result<Qpn> {
        for _ in 0..256 {
            let q = (self.rng.next_u64() as u32) & limits::MASK24;
            if q >= limits::MIN_QPN && !self.qps.contains_key(&q) {
                return Ok(q);
            }
        }
        Err(enomem("no free QP number"))
    }
    /// Destroy a QP. Type-2 windows bound to it become free (unbound).
    pub fn destroy_qp(&mut self, qpn: Qpn) -> Result<()> {
        if self.qps.remove(&qpn).is_none() {
            return Err(einval("no such QP"));
        }
        for mw in self.mws.values_mut() {
            if mw.mw_type == 2 && mw.qpn == Some(qpn) {
                mw.state = MwState::Free;
                mw.mr_key = None;
                mw.qpn = None;
            }
        }
        Ok(())
    }
    /// The QP.
    pub fn qp(&self, qpn: Qpn) -> Option<&Qp> {
        self.qps.get(&qpn)
    }
    /// The QP, mutably.
    pub fn qp_mut(&mut self, qpn: Qpn) -> Option<&mut Qp> {
        self.qps.get_mut(&qpn)
    }
    /// Check an address vector: RoCE needs `is_global`, a valid sgid index, port 1 (0 is
    /// taken as the default port 1).
    fn check_ah_attr(&self, a: &AhAttr) -> Result<()> {
        if !a.is_global {
            return Err(einval("RoCE address vectors need a GRH (is_global)"));
        }
        if a.grh.sgid_index as usize >= self.gids.len() {
            return Err(einval("sgid index out of range"));
        }
        if a.port_num > 1 {
            return Err(einval("no such port"));
        }
        Ok(())
    }
    /// Check the values of the attributes present in `mask`.
    fn check_qp_values(&self, a: &QpAttr, mask: QpAttrMask) -> Result<()> {
        use QpAttrMask as M;
        if mask.contains(M::PKEY_INDEX) && a.pkey_index >= self.port.pkey_tbl_len {
            return Err(einval("pkey index out of range"));
        }
        if mask.contains(M::PORT) && a.port_num != 1 {
            return Err(einval("no such port"));
        }
        if mask.contains(M::AV) {
            self.check_ah_attr(&a.ah_attr)?;
        }
        if mask.contains(M::PATH_MTU) && a.path_mtu > self.port.max_mtu {
            return Err(einval("path MTU above the port maximum"));
        }
        if mask.contains(M::TIMEOUT) && a.timeout > 31 {
            return Err(einval("timeout above 31"));
        }
        if mask.contains(M::RETRY_CNT) && a.retry_cnt > 7 {
            return Err(einval("retry_cnt above 7"));
        }
        if mask.contains(M::RNR_RETRY) && a.rnr_retry > 7 {
            return Err(einval("rnr_retry above 7"));
        }
        if mask.contains(M::MIN_RNR_TIMER) && a.min_rnr_timer > 31 {
            return Err(einval("min_rnr_timer above 31"));
        }
        if mask.contains(M::MAX_QP_RD_ATOMIC)
            && a.max_rd_atomic as u32 > self.dev.max_qp_init_rd_atom
        {
            return Err(einval("max_rd_atomic above the device limit"));
        }
        if mask.contains(M::MAX_DEST_RD_ATOMIC)
            && a.max_dest_rd_atomic as u32 > self.dev.max_qp_rd_atom
        {
            return Err(einval("max_dest_rd_atomic above the device limit"));
        }
        if mask.contains(M::DEST_QPN) && a.dest_qp_num > limits::MASK24 {
            return Err(einval("dest QPN is 24 bits"));
        }
        Ok(())
    }
    /// Apply a modify as the IBTA state machine allows: the transition must be legal from the
    /// current state, every required attribute for it present and only allowed optional ones;
    /// EINVAL otherwise (nothing changes). Returns (old state, new state). Leaving for RESET
    /// clears the receive queue.
    ///
    /// Without `STATE` in the mask the target is the current state. With `CUR_STATE`,
    /// `cur_qp_state` must equal the current state. PSNs are masked to 24 bits. Going to RESET
    /// also resets the attributes (the caps stay).
    pub fn modify_qp(
        &mut self,
        qpn: Qpn,
        attr: &QpAttr,
        mask: QpAttrMask,
    ) -> Result<(QpState, QpState)> {
        use QpAttrMask as M;
        let qp = self.qps.get(&qpn).ok_or(einval("no such QP"))?;
        let cur = qp.state;
        let next = if mask.contains(M::STATE) {
            attr.qp_state
        } else {
            cur
        };
        if mask.contains(M::CUR_STATE) {
            if !matches!(
                cur,
                QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe
            ) {
                return Err(einval("CUR_STATE not allowed from this state"));
            }
            if attr.cur_qp_state != cur {
                return Err(einval("cur_qp_state does not match the QP's state"));
            }
        }
        let (req, opt) = qp_table::transition(cur, next, qp.init.qp_type)
            .ok_or(einval("illegal QP state transition"))?;
        if !mask.contains(req) {
            return Err(einval("a required attribute is missing"));
        }
        if !(req | opt | M::STATE).contains(mask) {
            return Err(einval("an attribute not allowed in this transition"));
        }
        self.check_qp_values(attr, mask)?;
        let Some(qp) = self.qps.get_mut(&qpn) else {
            return Err(einval("no such QP"));
        };
        if next == QpState::Reset {
            qp.rq.clear();
            qp.attr = Self::reset_attr(qp.init.cap);
        } else {
            let q = &mut qp.attr;
            if mask.contains(M::EN_SQD_ASYNC_NOTIFY) {
                q.en_sqd_async_notify = attr.en_sqd_async_notify;
            }
            if mask.contains(M::ACCESS_FLAGS) {
                q.qp_access_flags = attr.qp_access_flags;
            }
            if mask.contains(M::PKEY_INDEX) {
                q.pkey_index = attr.pkey_index;
            }
            if mask.contains(M::PORT) {
                q.port_num = attr.port_num;
            }
            if mask.contains(M::QKEY) {
                q.qkey = attr.qkey;
            }
            if mask.contains(M::AV) {
                q.ah_attr = attr.ah_attr;
                if q.ah_attr.port_num == 0 {
                    q.ah_attr.port_num = 1;
                }
            }
            if mask.contains(M::PATH_MTU) {
                q.path_mtu = attr.path_mtu;
            }
            if mask.contains(M::TIMEOUT) {
                q.timeout = attr.timeout;
            }
            if mask.contains(M::RETRY_CNT) {
                q.retry_cnt = attr.retry_cnt;
            }
            if mask.contains(M::RNR_RETRY) {
                q.rnr_retry = attr.rnr_retry;
            }
            if mask.contains(M::RQ_PSN) {
                q.rq_psn = attr.rq_psn & limits::MASK24;
            }
            if mask.contains(M::MAX_QP_RD_ATOMIC) {
                q.max_rd_atomic = attr.max_rd_atomic;
            }
            if mask.contains(M::MIN_RNR_TIMER) {
                q.min_rnr_timer = attr.min_rnr_timer;
            }
            if mask.contains(M::SQ_PSN) {
                q.sq_psn = attr.sq_psn & limits::MASK24;
            }
            if mask.contains(M::MAX_DEST_RD_ATOMIC) {
                q.max_dest_rd_atomic = attr.max_dest_rd_atomic;
            }
            if mask.contains(M::DEST_QPN) {
                q.dest_qp_num = attr.dest_qp_num;
            }
        }
        qp.state = next;
        qp.attr.qp_state = next;
        qp.attr.cur_qp_state = next;
        Ok((cur, next))
    }
    /// Move a QP to ERR from inside the engine (no attribute checks).
    pub fn set_qp_error(&mut self, qpn: Qpn) {
        if let Some(qp) = self.qps.get_mut(&qpn) {
            qp.state = QpState::Err;
            qp.attr.qp_state = QpState::Err;
            qp.attr.cur_qp_state = QpState::Err;
        }
    }
    /// Validate a send WR against the QP's type, state and caps (EINVAL: opcode not valid for
    /// the type, missing UD destination, too many SGEs, inline too long; ENOMEM is the
    /// transport's to return when the queue is full).
    ///
    /// Also EINVAL: posting in RESET, INIT or RTR; a UD AH of another PD; INLINE on READ,
    /// atomics, LOCAL_INV or BIND_MW; atomics whose SGEs hold fewer than 8 bytes.
    pub fn check_send_wr(&self, qpn: Qpn, wr: &SendWr) -> Result<()> {
        let qp = self.qps.get(&qpn).ok_or(einval("no such QP"))?;
        if matches!(qp.state, QpState::Reset | QpState::Init | QpState::Rtr) {
            return Err(einval("QP not ready to send"));
        }
        let t = qp.init.qp_type;
        let op_ok = match wr.op {
            SendOp::Send | SendOp::SendWithImm { .. } => true,
            SendOp::Write { .. }
            | SendOp::WriteWithImm { .. }
            | SendOp::LocalInv { .. }
            | SendOp::BindMw(_) => t != QpType::Ud,
            SendOp::SendWithInv { .. }
            | SendOp::Read { .. }
            | SendOp::CompareSwap { .. }
            | SendOp::FetchAdd { .. } => t == QpType::Rc,
        };
        if !op_ok {
            return Err(einval("opcode not valid for the QP type"));
        }
        if t == QpType::Ud {
            let ud = wr
                .ud
                .as_ref()
                .ok_or(einval("UD send without a destination"))?;
            match self.ahs.get(&ud.ah) {
                Some((pd, _)) if *pd == qp.init.pd => {}
                _ => return Err(einval("invalid address handle")),
            }
            if ud.remote_qpn > limits::MASK24 {
                return Err(einval("remote QPN is 24 bits"));
            }
        }
        if wr.sg_list.len() > qp.init.cap.max_send_sge as usize {
            return Err(einval("too many SGEs"));
        }
        let total: u64 = wr.sg_list.iter().map(|s| s.length as u64).sum();
        let atomic = matches!(wr.op, SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. });
        if wr.flags.contains(SendFlags::INLINE) {
            let data_op = matches!(
                wr.op,
                SendOp::Send
                    | SendOp::SendWithImm { .. }
                    | SendOp::SendWithInv { .. }
                    | SendOp::Write { .. }
                    | SendOp::WriteWithImm { .. }
            );
            if !data_op {
                return Err(einval("INLINE only applies to sends and writes"));
            }
            if total > qp.init.cap.max_inline_data as u64 {
                return Err(einval("inline data too long"));
            }
        }
        if atomic && total < 8 {
            return Err(einval("atomics need an 8-byte result buffer"));
        }
        Ok(())
    }
    /// Post to the QP's receive queue (EINVAL in RESET or with an SRQ or too many SGEs,
    /// ENOMEM when full). Posting in ERR is allowed; the transport flushes.
    pub fn post_recv(&mut self, qpn: Qpn, wr: RecvWr) -> Result<()> {
        let qp = self.qps.get_mut(&qpn).ok_or(einval("no such QP"))?;
        if qp.state == QpState::Reset {
            return Err(einval("QP in RESET"));
        }
        if qp.init.srq.is_some() {
            return Err(einval("QP receives from an SRQ"));
        }
        if wr.sg_list.len() > qp.init.cap.max_recv_sge as usize {
            return Err(einval("too many SGEs"));
        }
        if qp.rq.len() >= qp.init.cap.max_recv_wr as usize {
            return Err(enomem("receive queue full"));
        }
        qp.rq.push_back(wr);
        Ok(())
    }
    /// Take the next receive WR for an incoming message: from the QP's SRQ (firing the limit
    /// event when the SRQ drops below its armed limit) or its own queue.
    pub fn take_recv(&mut self, qpn: Qpn) -> Option<RecvWr> {
        let qp = self.qps.get_mut(&qpn)?;
        let Some(srq) = qp.init.srq else {
            return qp.rq.pop_front();
        };
        let s = self.srqs.get_mut(&srq)?;
        let wr = s.q.pop_front()?;
        if s.limit > 0 && (s.q.len() as u64) < s.limit as u64 {
            s.limit = 0;
            self.events.push_back(AsyncEvent::SrqLimitReached(srq));
        }
        Some(wr)
    }
    /// Look at the next receive WR without taking it.
    pub fn peek_recv(&self, qpn: Qpn) -> Option<&RecvWr> {
        let qp = self.qps.get(&qpn)?;
        match qp.init.srq {
            Some(srq) => self.srqs.get(&srq)?.q.front(),
            None => qp.rq.front(),
        }
    }

    // ---- AH
    /// Create an address handle; RoCE needs `is_global` and a valid sgid index.
    /// `port_num` must be 1 (0 is taken as port 1).
    pub fn create_ah(&mut self, pd: PdId, attr: &AhAttr) -> Result<AhId> {
        self.check_pd(pd)?;
        self.check_ah_attr(attr)?;
        if self.ahs.len() >= self.dev.max_ah as usize {
            return Err(enomem("too many AHs"));
        }
        let id = AhId(self.new_id()?);
        let mut a = *attr;
        a.port_num = 1;
        self.ahs.insert(id, (pd, a));
        Ok(id)
    }
    /// The attributes of an AH.
    pub fn ah(&self, ah: AhId) -> Result<(PdId, AhAttr)> {
        self.ahs.get(&ah).copied().ok_or(einval("no such AH"))
    }
    /// Destroy an AH.
    pub fn destroy_ah(&mut self, ah: AhId) -> Result<()> {
        self.ahs.remove(&ah).map(|_| ()).ok_or(einval("no such AH"))
    }

    // ---- async events
    /// Queue an async event.
    pub fn push_event(&mut self, ev: AsyncEvent) {
        self.events.push_back(ev);
    }
    /// Take the next async event.
    pub fn next_event(&mut self) -> Option<AsyncEvent> {
        self.events.pop_front()
    }
}
