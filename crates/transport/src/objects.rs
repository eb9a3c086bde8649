//! The verbs operations the faces need on a device's objects (PDs, MRs, MWs, CQs and
//! channels, SRQs, AHs, device memory, attributes), offered by the engine itself so that
//! no face reaches into the verbs tables behind the protocol state: the verbs rules are
//! applied once, in `verbs`, and what the transport tracks per QP cannot drift from them.

use crate::verbs::{
    self, Access, Advice, AhAttr, AhId, Arm, AsyncEvent, ChannelId, CqId, DeviceAttr, DmId, Gid,
    MemSpan, MrInfo, Mtu, MwId, PdId, PortAttr, Prefetch, QpInitAttr, Qpn, RecvWr, SendOp, SendWr,
    Sge, SrqId, WcError,
};
use crate::Rnic;

/// `pub fn name(&mut self, args…) -> ret` on [`Rnic`], carried out by the verbs context.
macro_rules! delegate_mut {
    ($($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty;)*) => {
        impl Rnic {
            $($(#[$doc])* pub fn $name(&mut self, $($arg: $ty),*) -> $ret {
                self.env.ctx.$name($($arg),*)
            })*
        }
    };
}

/// `pub fn name(&self, args…) -> ret` on [`Rnic`], answered by the verbs context.
macro_rules! delegate_ref {
    ($($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty;)*) => {
        impl Rnic {
            $($(#[$doc])* pub fn $name(&self, $($arg: $ty),*) -> $ret {
                self.env.ctx.$name($($arg),*)
            })*
        }
    };
}

delegate_mut! {
    /// A random 24-bit first PSN from the key generator, for every face (DESIGN decision 7).
    fn random_psn() -> u32;
    /// Set port 1's active MTU, the largest UD message (EINVAL above its `max_mtu`).
    fn set_active_mtu(mtu: Mtu) -> verbs::Result<()>;
    /// Allocate a protection domain.
    fn alloc_pd() -> verbs::Result<PdId>;
    /// Free a protection domain (EBUSY while objects use it).
    fn dealloc_pd(pd: PdId) -> verbs::Result<()>;
    /// Register `len` bytes of device memory `dm` at `offset` as an MR of `pd`.
    fn reg_dm_mr(pd: PdId, dm: DmId, offset: u64, len: usize, access: Access) -> verbs::Result<MrInfo>;
    /// Allocate a memory window of type 1 or 2 in `pd`.
    fn alloc_mw(pd: PdId, mw_type: u8) -> verbs::Result<MwId>;
    /// Free a memory window.
    fn dealloc_mw(mw: MwId) -> verbs::Result<()>;
    /// Allocate `len` bytes of device memory.
    fn alloc_dm(len: usize) -> verbs::Result<DmId>;
    /// Free device memory (EBUSY while an MR covers it).
    fn free_dm(dm: DmId) -> verbs::Result<()>;
    /// Copy `data` into device memory at `offset`.
    fn dm_copy_to(dm: DmId, offset: u64, data: &[u8]) -> verbs::Result<()>;
    /// Create a completion channel.
    fn create_channel() -> verbs::Result<ChannelId>;
    /// Destroy a completion channel (EBUSY while CQs use it).
    fn destroy_channel(ch: ChannelId) -> verbs::Result<()>;
    /// Create a CQ of at least `cqe` entries; returns its id and actual size.
    fn create_cq(cqe: u32, channel: Option<ChannelId>, timestamps: bool) -> verbs::Result<(CqId, u32)>;
    /// Resize a CQ; returns the actual size.
    fn resize_cq(cq: CqId, cqe: u32) -> verbs::Result<u32>;
    /// Destroy a CQ (EBUSY while QPs or SRQs use it).
    fn destroy_cq(cq: CqId) -> verbs::Result<()>;
    /// Arm a CQ for its channel's next (solicited) completion.
    fn req_notify_cq(cq: CqId, arm: Arm) -> verbs::Result<()>;
    /// Take the next CQ event of a channel.
    fn get_cq_event(ch: ChannelId) -> Option<CqId>;
    /// Acknowledge `n` events of a CQ.
    fn ack_cq_events(cq: CqId, n: u32) -> verbs::Result<()>;
    /// Take the next asynchronous event.
    fn next_event() -> Option<AsyncEvent>;
    /// Create an SRQ in `pd`.
    fn create_srq(pd: PdId, max_wr: u32, max_sge: u32, limit: u32) -> verbs::Result<SrqId>;
    /// Change an SRQ's size or limit.
    fn modify_srq(srq: SrqId, max_wr: Option<u32>, limit: Option<u32>) -> verbs::Result<()>;
    /// Destroy an SRQ (EBUSY while QPs use it).
    fn destroy_srq(srq: SrqId) -> verbs::Result<()>;
    /// Create an address handle in `pd`.
    fn create_ah(pd: PdId, attr: &AhAttr) -> verbs::Result<AhId>;
    /// Destroy an address handle.
    fn destroy_ah(ah: AhId) -> verbs::Result<()>;
}

delegate_ref! {
    /// Device attributes.
    fn device_attr() -> &DeviceAttr;
    /// Attributes of port `port` (there is one, port 1).
    fn port_attr(port: u8) -> verbs::Result<PortAttr>;
    /// The P_Key at `index` of port 1.
    fn pkey(index: u16) -> verbs::Result<u16>;
    /// The GID table of port 1.
    fn gids() -> &[Gid];
    /// The GID at `index`.
    fn gid(index: u8) -> verbs::Result<Gid>;
    /// Whether `pd` is a live protection domain.
    fn pd_exists(pd: PdId) -> bool;
    /// The PD and keys of the MR with local key `lkey`.
    fn query_mr(lkey: u32) -> verbs::Result<(PdId, MrInfo)>;
    /// Check a prefetch of on-demand memory; what it faults in, to run unlocked.
    fn advise_mr(pd: PdId, advice: Advice, sg_list: &[Sge]) -> verbs::Result<Prefetch>;
    /// The length of device memory `dm`.
    fn dm_len(dm: DmId) -> verbs::Result<usize>;
    /// Copy device memory at `offset` out.
    fn dm_copy_from(dm: DmId, offset: u64, out: &mut [u8]) -> verbs::Result<()>;
    /// An SRQ's `(max_wr, max_sge, limit)`.
    fn query_srq(srq: SrqId) -> verbs::Result<(u32, u32, u32)>;
    /// Receive WRs queued on an SRQ.
    fn srq_len(srq: SrqId) -> verbs::Result<usize>;
    /// Completions queued on a CQ.
    fn cq_len(cq: CqId) -> verbs::Result<usize>;
    /// CQ events a channel has pending.
    fn channel_pending(ch: ChannelId) -> usize;
    /// A memory window's current rkey.
    fn mw_rkey(mw: MwId) -> verbs::Result<u32>;
    /// The registered memory an SGE names in `pd`, with the local access `need`.
    fn local_span(pd: PdId, sge: &Sge, need: Access) -> Result<MemSpan<'_>, WcError>;
}

impl Rnic {
    /// Take QP `qpn`'s completions out of its CQs
    /// ([`verbs::Context::discard_completions`]); how many.
    pub fn discard_completions(&mut self, qpn: Qpn) -> verbs::Result<usize> {
        self.env.ctx.discard_completions(qpn)
    }

    /// Refuse a send WR whose SGEs do not name memory of the QP's PD, with the access the
    /// operation needs and inside its region ([`verbs::Context::check_sg_list`]), before
    /// anything is queued. [`Rnic::post_send`] does not call this: as on a NIC, it fails such
    /// a WR in its completion (the C face's behaviour); a face that refuses at the call runs
    /// this first, under the same lock. A WR carrying its inline data names no memory.
    pub fn check_send_sges(&self, qpn: Qpn, wr: &SendWr) -> verbs::Result<()> {
        if wr.inline_data.is_some() {
            return Ok(());
        }
        let pd = self.qp_init_attr(qpn)?.pd;
        // The device writes the result of a READ or an atomic into the local SGEs.
        let need = match wr.op {
            SendOp::Read { .. } | SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. } => {
                Access::LOCAL_WRITE
            }
            _ => Access::empty(),
        };
        self.env.ctx.check_sg_list(pd, &wr.sg_list, need)
    }

    /// [`Rnic::check_send_sges`] for a receive WR of QP `qpn` (the device writes it).
    pub fn check_recv_sges(&self, qpn: Qpn, wr: &RecvWr) -> verbs::Result<()> {
        let pd = self.qp_init_attr(qpn)?.pd;
        self.env
            .ctx
            .check_sg_list(pd, &wr.sg_list, Access::LOCAL_WRITE)
    }

    /// [`Rnic::check_recv_sges`] for a receive WR of SRQ `srq`, against the SRQ's PD.
    pub fn check_srq_recv_sges(&self, srq: SrqId, wr: &RecvWr) -> verbs::Result<()> {
        let pd = self.env.ctx.srq_pd(srq)?;
        self.env
            .ctx
            .check_sg_list(pd, &wr.sg_list, Access::LOCAL_WRITE)
    }

    /// How a QP was created, with the actual queue sizes (at least what was asked for).
    pub fn qp_init_attr(&self, qpn: Qpn) -> verbs::Result<QpInitAttr> {
        self.env
            .ctx
            .qp(qpn)
            .map(|q| q.init)
            .ok_or(verbs::Error::new(verbs::Errno::ENOENT, "no such QP"))
    }

    /// Attach UD QP `qpn` to the multicast group `mgid` (the rules and errors are
    /// [`verbs::Context::attach_mcast`]'s): it receives a copy of every UD SEND to the
    /// group that reaches this engine. When the group is new here,
    /// [`Rnic::mcast_generation`] changes, so that a runtime starts receiving the group's
    /// datagrams ([`Rnic::mcast_groups`]).
    pub fn attach_mcast(&mut self, qpn: Qpn, mgid: Gid, mlid: u16) -> verbs::Result<()> {
        if self.env.ctx.attach_mcast(qpn, mgid, mlid)? {
            self.mcast_generation += 1;
        }
        Ok(())
    }

    /// Detach UD QP `qpn` from the multicast group `mgid`
    /// ([`verbs::Context::detach_mcast`]); when it was the group's last QP here,
    /// [`Rnic::mcast_generation`] changes.
    pub fn detach_mcast(&mut self, qpn: Qpn, mgid: Gid, mlid: u16) -> verbs::Result<()> {
        if self.env.ctx.detach_mcast(qpn, mgid, mlid)? {
            self.mcast_generation += 1;
        }
        Ok(())
    }

    /// The multicast groups with at least one QP of this engine attached.
    pub fn mcast_groups(&self) -> impl Iterator<Item = Gid> + '_ {
        self.env.ctx.mcast_groups()
    }

    /// The QPs attached to multicast group `mgid`.
    pub fn mcast_members(&self, mgid: &Gid) -> &[Qpn] {
        self.env.ctx.mcast_members(mgid)
    }

    /// A number that changes whenever the set of [`Rnic::mcast_groups`] does.
    pub fn mcast_generation(&self) -> u64 {
        self.mcast_generation
    }
}
