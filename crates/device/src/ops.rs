//! The verbs every face carries out on a device, each with its engine step chosen once.
//!
//! An engine step ends in one of four ways, and which one is the verb's property, not the
//! face's choice:
//!
//! - **post** ([`Device::post_send`]): the requester runs in the caller's thread and its
//!   datagrams leave now, or, when requests are already in flight, are held back to leave
//!   with the next posts' in one system call (see the crate docs).
//! - **wake**: the step may add a completion, a CQ event or an async event (receives
//!   posted into an RNR wait, a modify that flushes work requests, an arm that finds
//!   completions, an SRQ limit): what it produced is sent, the channel and async fds
//!   updated, and [`Device::generation`] moves so that waiters look again.
//! - **quiet**: the step adds none of those (object management, taking or acknowledging
//!   CQ events): what the engine produced is still sent and the fds updated, but waiters
//!   are not woken for nothing.
//! - **read**: the step only reads ([`Device::read`] and the queries below take the
//!   engine by shared reference, so the type says it changes nothing): no send, no fd,
//!   no wake-up.
//!
//! Polling a CQ has its own policy, [`crate::CqPoller`], which every face uses.

use softrdma_transport::verbs::{
    self, Access, AhAttr, AhId, Arm, ChannelId, CqId, DeviceAttr, DmId, MrInfo, Mtu, MwId, PdId,
    PortAttr, QpAttr, QpAttrMask, QpCap, QpInitAttr, QpState, Qpn, RecvWr, SendWr, SrqId,
};
use softrdma_transport::Rnic;

use crate::tx::Flush;
use crate::Device;

/// `pub fn name(&self, args…) -> ret` on [`Device`]: the engine's verb of that name, in
/// a quiet or a waking step.
macro_rules! step {
    ($($(#[$doc:meta])* $kind:ident fn $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty;)*) => {
        impl Device {
            $($(#[$doc])* pub fn $name(&self, $($arg: $ty),*) -> $ret {
                step!(@$kind self, $name($($arg),*))
            })*
        }
    };
    (@quiet $dev:ident, $name:ident($($arg:ident),*)) => {
        $dev.step(false, Flush::Due, |r: &mut Rnic, _| r.$name($($arg),*))
    };
    (@wake $dev:ident, $name:ident($($arg:ident),*)) => {
        $dev.step(true, Flush::Due, |r: &mut Rnic, _| r.$name($($arg),*))
    };
    (@read $dev:ident, $name:ident($($arg:ident),*)) => {
        $dev.read(|r: &Rnic| r.$name($($arg),*))
    };
}

impl Device {
    /// Lock the engine, run `f` with the device time, then end the step: send what it
    /// produced (as `flush` says), update the fds, and move the generation if `changed`.
    pub(crate) fn step<R>(
        &self,
        changed: bool,
        flush: Flush,
        f: impl FnOnce(&mut Rnic, u64) -> R,
    ) -> R {
        let sh = &*self.shared;
        let mut core = sh.lock();
        let now = sh.now();
        let r = f(&mut core.rnic, now);
        core.after_step_with(sh, now, changed, flush);
        r
    }

    /// Read engine state under its lock: queries that return borrowed data (the device
    /// attributes, the GID table, a registered span) or that must be atomic with the
    /// caller's own bookkeeping. Nothing is sent or signalled: the engine is only
    /// borrowed.
    pub fn read<R>(&self, f: impl FnOnce(&Rnic) -> R) -> R {
        let core = self.shared.lock();
        f(&core.rnic)
    }

    /// Change engine objects together with the caller's own bookkeeping, under one lock
    /// (a protection domain freed only while the caller counts no users of it, an access
    /// change stored where the engine's is): a quiet step. Not for work requests, modifies
    /// or CQ arming, which have their own operations because their steps wake waiters.
    pub fn objects<R>(&self, f: impl FnOnce(&mut Rnic) -> R) -> R {
        self.step(false, Flush::Due, |r, _| f(r))
    }

    /// `ibv_post_send` of one work request. When the device already has requests in
    /// flight, the datagrams it makes are held back to leave with those of the next posts
    /// in one system call (and one GSO message): a program that posts a burst and then
    /// polls pays one send for the burst. They leave once a send batch is full, when a
    /// thread next drives progress (polls an empty CQ, waits), before anyone blocks, or
    /// after `ACK_DEFER`. A post into an idle pipe (a ping-pong) is sent at once.
    pub fn post_send(&self, qpn: Qpn, wr: SendWr) -> verbs::Result<()> {
        self.post_sends(qpn, [wr]).map_err(|(_, e)| e)
    }

    /// [`Device::post_send`] that first checks the request's SGEs against registered
    /// memory ([`Rnic::check_send_sges`]) and refuses it at the call, where a NIC would
    /// only fail its completion: the Rust API's safe default.
    pub fn post_send_checked(&self, qpn: Qpn, wr: SendWr) -> verbs::Result<()> {
        self.post_sends_with(qpn, [wr], true).map_err(|(_, e)| e)
    }

    /// `ibv_post_send` of a list, in order under one lock, as [`Device::post_send`]; on
    /// failure, the index of the request that failed (those before it are posted).
    pub fn post_sends(
        &self,
        qpn: Qpn,
        wrs: impl IntoIterator<Item = SendWr>,
    ) -> Result<(), (usize, verbs::Error)> {
        self.post_sends_with(qpn, wrs, false)
    }

    fn post_sends_with(
        &self,
        qpn: Qpn,
        wrs: impl IntoIterator<Item = SendWr>,
        check: bool,
    ) -> Result<(), (usize, verbs::Error)> {
        let sh = &*self.shared;
        let mut core = sh.lock();
        let now = sh.now();
        let flush = if core.rnic.in_flight() {
            Flush::Hold
        } else {
            Flush::Due
        };
        let r = wrs.into_iter().enumerate().try_for_each(|(i, w)| {
            if check {
                core.rnic.check_send_sges(qpn, &w).map_err(|e| (i, e))?;
            }
            core.rnic.post_send(now, qpn, w).map_err(|e| (i, e))
        });
        core.after_step_with(sh, now, true, flush);
        r
    }

    /// `ibv_post_recv` of one work request (a waking step: a message waiting for a
    /// receive may complete now).
    pub fn post_recv(&self, qpn: Qpn, wr: RecvWr) -> verbs::Result<()> {
        self.post_recvs(qpn, [wr]).map_err(|(_, e)| e)
    }

    /// [`Device::post_recv`] that first checks the request's SGEs
    /// ([`Rnic::check_recv_sges`]), as [`Device::post_send_checked`].
    pub fn post_recv_checked(&self, qpn: Qpn, wr: RecvWr) -> verbs::Result<()> {
        self.step(true, Flush::Due, |r, now| {
            r.check_recv_sges(qpn, &wr)?;
            r.post_recv(now, qpn, wr)
        })
    }

    /// `ibv_post_recv` of a list, in order under one lock; on failure, the index of the
    /// request that failed.
    pub fn post_recvs(
        &self,
        qpn: Qpn,
        wrs: impl IntoIterator<Item = RecvWr>,
    ) -> Result<(), (usize, verbs::Error)> {
        self.step(true, Flush::Due, |r, now| {
            wrs.into_iter()
                .enumerate()
                .try_for_each(|(i, w)| r.post_recv(now, qpn, w).map_err(|e| (i, e)))
        })
    }

    /// `ibv_post_srq_recv` of one work request.
    pub fn post_srq_recv(&self, srq: SrqId, wr: RecvWr) -> verbs::Result<()> {
        self.post_srq_recvs(srq, [wr]).map_err(|(_, e)| e)
    }

    /// [`Device::post_srq_recv`] that first checks the request's SGEs
    /// ([`Rnic::check_srq_recv_sges`]), as [`Device::post_send_checked`].
    pub fn post_srq_recv_checked(&self, srq: SrqId, wr: RecvWr) -> verbs::Result<()> {
        self.step(true, Flush::Due, |r, now| {
            r.check_srq_recv_sges(srq, &wr)?;
            r.post_srq_recv(now, srq, wr)
        })
    }

    /// `ibv_post_srq_recv` of a list, in order under one lock; on failure, the index of
    /// the request that failed.
    pub fn post_srq_recvs(
        &self,
        srq: SrqId,
        wrs: impl IntoIterator<Item = RecvWr>,
    ) -> Result<(), (usize, verbs::Error)> {
        self.step(true, Flush::Due, |r, now| {
            wrs.into_iter()
                .enumerate()
                .try_for_each(|(i, w)| r.post_srq_recv(now, srq, w).map_err(|e| (i, e)))
        })
    }

    /// `ibv_create_qp`: the new QP and the capacities it got (at least those asked for).
    pub fn create_qp(&self, init: QpInitAttr) -> verbs::Result<(Qpn, QpCap)> {
        self.objects(|r| {
            let qpn = r.create_qp(init)?;
            let cap = r.qp_init_attr(qpn).map_or(init.cap, |i| i.cap);
            Ok((qpn, cap))
        })
    }

    /// A first PSN for a QP, from the engine's key generator (DESIGN decision 7: keys and
    /// PSNs come from one CSPRNG, never from a face or the clock): a quiet step.
    pub fn random_psn(&self) -> u32 {
        self.objects(|r| r.random_psn())
    }

    /// `ibv_modify_qp` (a waking step: to ERR, the queued work requests complete
    /// flushed). To RESET, the QP's completions still in its CQs go too, as mlx4 and
    /// mlx5 clean their CQs then: a QP brought back from ERR does not have the flushed
    /// work requests of its old life polled in its new one (rdma-core's tests count on
    /// it). One rule for every face.
    pub fn modify_qp(&self, qpn: Qpn, attr: &QpAttr, mask: QpAttrMask) -> verbs::Result<()> {
        let reset = mask.contains(QpAttrMask::STATE) && attr.qp_state == QpState::Reset;
        self.step(true, Flush::Due, |r, now| {
            r.modify_qp(now, qpn, attr, mask)?;
            if reset {
                r.discard_completions(qpn)?;
            }
            Ok(())
        })
    }

    /// `ibv_query_gid`: the GID at `index` ([`Device::gid`] is index 0's).
    pub fn query_gid(&self, index: u8) -> verbs::Result<verbs::Gid> {
        self.read(|r| r.gid(index))
    }

    /// The device attributes (`ibv_query_device`).
    pub fn device_attr(&self) -> DeviceAttr {
        self.read(|r| r.device_attr().clone())
    }
}

step! {
    /// `ibv_query_qp`: the QP's current attributes.
    read fn query_qp(qpn: Qpn) -> verbs::Result<QpAttr>;
    /// The attributes the QP was created with, with its actual capacities.
    read fn qp_init_attr(qpn: Qpn) -> verbs::Result<QpInitAttr>;
    /// `ibv_destroy_qp`: queued work requests vanish without completions.
    quiet fn destroy_qp(qpn: Qpn) -> verbs::Result<()>;

    /// `ibv_create_comp_channel`.
    quiet fn create_channel() -> verbs::Result<ChannelId>;
    /// `ibv_destroy_comp_channel` (EBUSY while CQs use it).
    quiet fn destroy_channel(ch: ChannelId) -> verbs::Result<()>;
    /// `ibv_create_cq`: a CQ of at least `cqe` entries; its id and actual size.
    quiet fn create_cq(cqe: u32, channel: Option<ChannelId>, timestamps: bool) -> verbs::Result<(CqId, u32)>;
    /// `ibv_resize_cq`: the actual size.
    quiet fn resize_cq(cq: CqId, cqe: u32) -> verbs::Result<u32>;
    /// `ibv_destroy_cq` (EBUSY while QPs or SRQs use it).
    quiet fn destroy_cq(cq: CqId) -> verbs::Result<()>;
    /// `ibv_req_notify_cq` (a waking step: the arm may raise a CQ event at once).
    wake fn req_notify_cq(cq: CqId, arm: Arm) -> verbs::Result<()>;
    /// `ibv_get_cq_event` without blocking: the next CQ event of channel `ch`.
    quiet fn get_cq_event(ch: ChannelId) -> Option<CqId>;
    /// `ibv_ack_cq_events`.
    quiet fn ack_cq_events(cq: CqId, n: u32) -> verbs::Result<()>;
    /// Completions queued on a CQ.
    read fn cq_len(cq: CqId) -> verbs::Result<usize>;

    /// `ibv_alloc_pd`.
    quiet fn alloc_pd() -> verbs::Result<PdId>;
    /// `ibv_dealloc_pd` (EBUSY while objects use it).
    quiet fn dealloc_pd(pd: PdId) -> verbs::Result<()>;
    /// Whether `pd` is a live protection domain.
    read fn pd_exists(pd: PdId) -> bool;

    /// `ibv_reg_dm_mr`: `len` bytes of device memory `dm` at `offset` as an MR of `pd`.
    quiet fn reg_dm_mr(pd: PdId, dm: DmId, offset: u64, len: usize, access: Access) -> verbs::Result<MrInfo>;
    /// `ibv_dereg_mr` (EBUSY while windows are bound to it).
    quiet fn dereg_mr(lkey: u32) -> verbs::Result<()>;
    /// `ibv_query_mr`-like: the PD and keys of the MR with local key `lkey`.
    read fn query_mr(lkey: u32) -> verbs::Result<(PdId, MrInfo)>;

    /// `ibv_alloc_mw` of type 1 or 2 in `pd`.
    quiet fn alloc_mw(pd: PdId, mw_type: u8) -> verbs::Result<MwId>;
    /// `ibv_dealloc_mw`.
    quiet fn dealloc_mw(mw: MwId) -> verbs::Result<()>;
    /// A memory window's current rkey.
    read fn mw_rkey(mw: MwId) -> verbs::Result<u32>;

    /// `ibv_alloc_dm`.
    quiet fn alloc_dm(len: usize) -> verbs::Result<DmId>;
    /// `ibv_free_dm` (EBUSY while an MR covers it).
    quiet fn free_dm(dm: DmId) -> verbs::Result<()>;
    /// `ibv_memcpy_to_dm`.
    quiet fn dm_copy_to(dm: DmId, offset: u64, data: &[u8]) -> verbs::Result<()>;
    /// `ibv_memcpy_from_dm`.
    read fn dm_copy_from(dm: DmId, offset: u64, out: &mut [u8]) -> verbs::Result<()>;
    /// The length of device memory `dm`.
    read fn dm_len(dm: DmId) -> verbs::Result<usize>;

    /// `ibv_create_ah` in `pd`.
    quiet fn create_ah(pd: PdId, attr: &AhAttr) -> verbs::Result<AhId>;
    /// `ibv_destroy_ah`.
    quiet fn destroy_ah(ah: AhId) -> verbs::Result<()>;

    /// `ibv_create_srq` in `pd`.
    quiet fn create_srq(pd: PdId, max_wr: u32, max_sge: u32, limit: u32) -> verbs::Result<SrqId>;
    /// `ibv_modify_srq` (a waking step: a new limit may raise SRQ_LIMIT_REACHED).
    wake fn modify_srq(srq: SrqId, max_wr: Option<u32>, limit: Option<u32>) -> verbs::Result<()>;
    /// `ibv_destroy_srq` (EBUSY while QPs use it).
    quiet fn destroy_srq(srq: SrqId) -> verbs::Result<()>;
    /// `ibv_query_srq`: `(max_wr, max_sge, limit)`.
    read fn query_srq(srq: SrqId) -> verbs::Result<(u32, u32, u32)>;
    /// Receive work requests queued on an SRQ.
    read fn srq_len(srq: SrqId) -> verbs::Result<usize>;

    /// Set port 1's active MTU, the largest UD message (EINVAL above its `max_mtu`).
    quiet fn set_active_mtu(mtu: Mtu) -> verbs::Result<()>;
    /// `ibv_query_port` (there is one port, 1).
    read fn port_attr(port: u8) -> verbs::Result<PortAttr>;
    /// `ibv_query_pkey`: the P_Key at `index`.
    read fn pkey(index: u16) -> verbs::Result<u16>;
}

impl Device {
    /// `ibv_reg_mr`: `len` bytes at `ptr` in `pd`, addressed by the peer as `iova`.
    ///
    /// # Safety
    /// The contract of [`Rnic::reg_mr`]: the memory stays valid until the region is
    /// deregistered, and the program accepts that the device and peers read and write it
    /// at any time.
    pub unsafe fn reg_mr(
        &self,
        pd: PdId,
        ptr: *mut u8,
        len: usize,
        iova: u64,
        access: Access,
    ) -> verbs::Result<MrInfo> {
        // SAFETY: forwarded to the caller.
        self.objects(|r| unsafe { r.reg_mr(pd, ptr, len, iova, access) })
    }

    /// `ibv_rereg_mr`: the PD, memory and access given replace the region's; its keys
    /// stay.
    ///
    /// # Safety
    /// With `memory`, the contract of [`Device::reg_mr`] for the new range.
    pub unsafe fn rereg_mr(
        &self,
        lkey: u32,
        pd: Option<PdId>,
        memory: Option<(*mut u8, usize, u64)>,
        access: Option<Access>,
    ) -> verbs::Result<MrInfo> {
        // SAFETY: forwarded to the caller.
        self.objects(|r| unsafe { r.rereg_mr(lkey, pd, memory, access) })
    }
}
