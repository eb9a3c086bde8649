//! Object tables and the rules that govern them.
//!
//! Signatures here are the contract the transport layer codes against.

use std::collections::VecDeque;
use std::marker::PhantomData;

use crate::error::Result;
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
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Copy `data` in at `offset`; false (and nothing written) if it would not fit.
    pub fn write(&self, offset: usize, data: &[u8]) -> bool {
        todo!("{offset} {}", data.len())
    }
    /// Copy out from `offset`; false (and nothing read) if out of bounds.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> bool {
        todo!("{offset} {}", out.len())
    }
    /// Atomic compare-and-swap of the 8 bytes at `offset` (host byte order, 8-byte aligned); returns the original.
    pub fn compare_swap(&self, offset: usize, compare: u64, swap: u64) -> Option<u64> {
        todo!("{offset} {compare} {swap}")
    }
    /// Atomic fetch-and-add of the 8 bytes at `offset`; returns the original.
    pub fn fetch_add(&self, offset: usize, add: u64) -> Option<u64> {
        todo!("{offset} {add}")
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

/// One device's verbs objects.
#[derive(Debug)]
pub struct Context {
    _private: (),
}

impl Context {
    /// A context with default attributes, the given GID table (index 0 first), and a seed for
    /// key generation (so keys are unpredictable in production and reproducible in tests).
    pub fn new(gids: Vec<Gid>, seed: u64) -> Context {
        todo!("{gids:?} {seed}")
    }
    /// Device attributes.
    pub fn device_attr(&self) -> &DeviceAttr {
        todo!()
    }
    /// Port attributes (port 1 only).
    pub fn port_attr(&self, port: u8) -> Result<PortAttr> {
        todo!("{port}")
    }
    /// The GID table.
    pub fn gids(&self) -> &[Gid] {
        todo!()
    }
    /// GID at `index`.
    pub fn gid(&self, index: u8) -> Result<Gid> {
        todo!("{index}")
    }

    // ---- PD
    /// Allocate a protection domain.
    pub fn alloc_pd(&mut self) -> Result<PdId> {
        todo!()
    }
    /// Free a PD; EBUSY while objects use it.
    pub fn dealloc_pd(&mut self, pd: PdId) -> Result<()> {
        todo!("{pd:?}")
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
        todo!("{pd:?} {ptr:?} {len} {iova} {access:?}")
    }
    /// Deregister by lkey; EBUSY while windows are bound to it.
    pub fn dereg_mr(&mut self, lkey: u32) -> Result<()> {
        todo!("{lkey}")
    }
    /// Check a local SGE for the QP's PD and the access needed (LOCAL_WRITE when the device
    /// writes it); LocProtErr on failure.
    pub fn local_span(
        &self,
        pd: PdId,
        sge: &Sge,
        need: Access,
    ) -> core::result::Result<MemSpan<'_>, WcStatus> {
        todo!("{pd:?} {sge:?} {need:?}")
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
        todo!("{pd:?} {sg_list:?} {offset} {}", data.len())
    }
    /// Read the bytes `offset..offset+out.len()` of the message laid out over `sg_list`.
    pub fn gather(
        &self,
        pd: PdId,
        sg_list: &[Sge],
        offset: usize,
        out: &mut [u8],
    ) -> core::result::Result<(), WcStatus> {
        todo!("{pd:?} {sg_list:?} {offset} {}", out.len())
    }
    /// Check a remote key (MR or memory window) for a request arriving on `qpn` of `pd`:
    /// valid, same PD (type-2 windows: bound to this QP), the access right, bounds.
    pub fn remote_span(
        &self,
        pd: PdId,
        qpn: Qpn,
        rkey: u32,
        va: u64,
        len: usize,
        need: Access,
    ) -> core::result::Result<MemSpan<'_>, RemoteKeyError> {
        todo!("{pd:?} {qpn} {rkey} {va} {len} {need:?}")
    }
    /// Invalidate an rkey (SEND_WITH_INV at the responder, LOCAL_INV at the requester):
    /// MRs with MW_BIND-capable type-2 windows and fast-reg style keys.
    /// Returns the error status to report on failure.
    pub fn invalidate_rkey(&mut self, pd: PdId, rkey: u32) -> core::result::Result<(), WcStatus> {
        todo!("{pd:?} {rkey}")
    }

    // ---- MW
    /// Allocate a memory window of type 1 or 2.
    pub fn alloc_mw(&mut self, pd: PdId, mw_type: u8) -> Result<MwId> {
        todo!("{pd:?} {mw_type}")
    }
    /// Free a window.
    pub fn dealloc_mw(&mut self, mw: MwId) -> Result<()> {
        todo!("{mw:?}")
    }
    /// Current rkey of a window.
    pub fn mw_rkey(&self, mw: MwId) -> Result<u32> {
        todo!("{mw:?}")
    }
    /// Bind (executed in send-queue order by the transport). For type 1 the key byte is
    /// bumped and the new rkey returned; for type 2 `bind.rkey` becomes the key and the window
    /// is tied to `qpn`. MwBindErr on failure (MR without MW_BIND, bounds, PD, wrong type).
    pub fn bind_mw(
        &mut self,
        pd: PdId,
        qpn: Qpn,
        bind: &MwBind,
    ) -> core::result::Result<u32, WcStatus> {
        todo!("{pd:?} {qpn} {bind:?}")
    }

    // ---- DM
    /// Allocate device memory.
    pub fn alloc_dm(&mut self, len: usize) -> Result<DmId> {
        todo!("{len}")
    }
    /// Free device memory; EBUSY while registered.
    pub fn free_dm(&mut self, dm: DmId) -> Result<()> {
        todo!("{dm:?}")
    }
    /// Copy into device memory.
    pub fn dm_copy_to(&mut self, dm: DmId, offset: u64, data: &[u8]) -> Result<()> {
        todo!("{dm:?} {offset} {}", data.len())
    }
    /// Copy out of device memory.
    pub fn dm_copy_from(&self, dm: DmId, offset: u64, out: &mut [u8]) -> Result<()> {
        todo!("{dm:?} {offset} {}", out.len())
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
        todo!("{pd:?} {dm:?} {offset} {len} {access:?}")
    }

    // ---- CQ and channels
    /// Create a completion channel.
    pub fn create_channel(&mut self) -> Result<ChannelId> {
        todo!()
    }
    /// Destroy a channel; EBUSY while CQs use it.
    pub fn destroy_channel(&mut self, ch: ChannelId) -> Result<()> {
        todo!("{ch:?}")
    }
    /// Create a CQ of at least `cqe` entries; returns its id and actual capacity.
    pub fn create_cq(
        &mut self,
        cqe: u32,
        channel: Option<ChannelId>,
        timestamps: bool,
    ) -> Result<(CqId, u32)> {
        todo!("{cqe} {channel:?} {timestamps}")
    }
    /// Resize a CQ; EINVAL if smaller than its current contents.
    pub fn resize_cq(&mut self, cq: CqId, cqe: u32) -> Result<u32> {
        todo!("{cq:?} {cqe}")
    }
    /// Destroy a CQ; EBUSY while QPs use it or events are unacknowledged.
    pub fn destroy_cq(&mut self, cq: CqId) -> Result<()> {
        todo!("{cq:?}")
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
        todo!("{cq:?} {wc:?} {solicited} {now_ns}")
    }
    /// Poll up to `out.len()` completions, oldest first. EIO-like error (EINVAL) if overflowed.
    pub fn poll_cq(&mut self, cq: CqId, out: &mut [WorkCompletion]) -> Result<usize> {
        todo!("{cq:?} {}", out.len())
    }
    /// Number of completions waiting.
    pub fn cq_len(&self, cq: CqId) -> Result<usize> {
        todo!("{cq:?}")
    }
    /// Arm the CQ for one event.
    pub fn req_notify_cq(&mut self, cq: CqId, arm: Arm) -> Result<()> {
        todo!("{cq:?} {arm:?}")
    }
    /// Take the next CQ event from a channel, if any.
    pub fn get_cq_event(&mut self, ch: ChannelId) -> Option<CqId> {
        todo!("{ch:?}")
    }
    /// Number of events waiting on a channel.
    pub fn channel_pending(&self, ch: ChannelId) -> usize {
        todo!("{ch:?}")
    }
    /// Acknowledge `n` events of a CQ.
    pub fn ack_cq_events(&mut self, cq: CqId, n: u32) -> Result<()> {
        todo!("{cq:?} {n}")
    }

    // ---- SRQ
    /// Create an SRQ with `max_wr`, `max_sge` and a limit (0 = disarmed).
    pub fn create_srq(&mut self, pd: PdId, max_wr: u32, max_sge: u32, limit: u32) -> Result<SrqId> {
        todo!("{pd:?} {max_wr} {max_sge} {limit}")
    }
    /// Change max_wr (grow only) and/or arm the limit. EINVAL for a limit above max_wr.
    pub fn modify_srq(
        &mut self,
        srq: SrqId,
        max_wr: Option<u32>,
        limit: Option<u32>,
    ) -> Result<()> {
        todo!("{srq:?} {max_wr:?} {limit:?}")
    }
    /// (max_wr, max_sge, limit).
    pub fn query_srq(&self, srq: SrqId) -> Result<(u32, u32, u32)> {
        todo!("{srq:?}")
    }
    /// Destroy an SRQ; EBUSY while QPs use it.
    pub fn destroy_srq(&mut self, srq: SrqId) -> Result<()> {
        todo!("{srq:?}")
    }
    /// Post a receive WR to an SRQ (ENOMEM when full, EINVAL for too many SGEs).
    pub fn post_srq_recv(&mut self, srq: SrqId, wr: RecvWr) -> Result<()> {
        todo!("{srq:?} {wr:?}")
    }

    // ---- QP
    /// Create a QP in RESET; caps are checked against the device and rounded up.
    pub fn create_qp(&mut self, init: QpInitAttr) -> Result<Qpn> {
        todo!("{init:?}")
    }
    /// Destroy a QP.
    pub fn destroy_qp(&mut self, qpn: Qpn) -> Result<()> {
        todo!("{qpn}")
    }
    /// The QP.
    pub fn qp(&self, qpn: Qpn) -> Option<&Qp> {
        todo!("{qpn}")
    }
    /// The QP, mutably.
    pub fn qp_mut(&mut self, qpn: Qpn) -> Option<&mut Qp> {
        todo!("{qpn}")
    }
    /// Apply a modify as the IBTA state machine allows: the transition must be legal from the
    /// current state, every required attribute for it present and only allowed optional ones;
    /// EINVAL otherwise (nothing changes). Returns (old state, new state). Leaving for RESET
    /// clears the receive queue.
    pub fn modify_qp(
        &mut self,
        qpn: Qpn,
        attr: &QpAttr,
        mask: QpAttrMask,
    ) -> Result<(QpState, QpState)> {
        todo!("{qpn} {attr:?} {mask:?}")
    }
    /// Move a QP to ERR from inside the engine (no attribute checks).
    pub fn set_qp_error(&mut self, qpn: Qpn) {
        todo!("{qpn}")
    }
    /// Validate a send WR against the QP's type, state and caps (EINVAL: opcode not valid for
    /// the type, missing UD destination, too many SGEs, inline too long; ENOMEM is the
    /// transport's to return when the queue is full).
    pub fn check_send_wr(&self, qpn: Qpn, wr: &SendWr) -> Result<()> {
        todo!("{qpn} {wr:?}")
    }
    /// Post to the QP's receive queue (EINVAL in RESET or with an SRQ or too many SGEs,
    /// ENOMEM when full). Posting in ERR is allowed; the transport flushes.
    pub fn post_recv(&mut self, qpn: Qpn, wr: RecvWr) -> Result<()> {
        todo!("{qpn} {wr:?}")
    }
    /// Take the next receive WR for an incoming message: from the QP's SRQ (firing the limit
    /// event when the SRQ drops below its armed limit) or its own queue.
    pub fn take_recv(&mut self, qpn: Qpn) -> Option<RecvWr> {
        todo!("{qpn}")
    }
    /// Look at the next receive WR without taking it.
    pub fn peek_recv(&self, qpn: Qpn) -> Option<&RecvWr> {
        todo!("{qpn}")
    }

    // ---- AH
    /// Create an address handle; RoCE needs `is_global` and a valid sgid index.
    pub fn create_ah(&mut self, pd: PdId, attr: &AhAttr) -> Result<AhId> {
        todo!("{pd:?} {attr:?}")
    }
    /// The attributes of an AH.
    pub fn ah(&self, ah: AhId) -> Result<(PdId, AhAttr)> {
        todo!("{ah:?}")
    }
    /// Destroy an AH.
    pub fn destroy_ah(&mut self, ah: AhId) -> Result<()> {
        todo!("{ah:?}")
    }

    // ---- async events
    /// Queue an async event.
    pub fn push_event(&mut self, ev: AsyncEvent) {
        todo!("{ev:?}")
    }
    /// Take the next async event.
    pub fn next_event(&mut self) -> Option<AsyncEvent> {
        todo!()
    }
}
