//! What a device lets its same-host peers reach without it: the engine tells a
//! [`GrantSink`] about every region registered for remote access and every QP ready to
//! be reached, as they change, and withdraws them before they stop being reachable (a
//! deregistration withdraws its region before the region is gone, and the sink returns
//! only once no peer copies into it any more). The device's sink keeps the shared table
//! its peers check one-sided operations against (`net::shm::grants`).

use crate::verbs::{self, Access, PdId, QpState, Qpn, RemoteView};
use crate::Rnic;

/// Where an engine publishes its grants (see the module docs).
pub trait GrantSink: Send + std::fmt::Debug {
    /// Region `r` may be reached remotely: publish it, replacing one of its rkey.
    fn region(&mut self, r: &RemoteView);
    /// Withdraw the region of `rkey`; return only once no peer copies under it.
    fn revoke_region(&mut self, rkey: u32);
    /// QP `qpn` takes remote operations with `access` on regions of `pd` (`Some`), or
    /// none any more (`None`).
    fn qp(&mut self, qpn: Qpn, ready: Option<(Access, PdId)>);
}

/// Copies a WRITE's payload straight into a same-host peer's memory, and a READ's out of
/// it, as the peer's grants allow (see the module docs); the device's is the same-host
/// path's.
pub trait Placement: Send + std::fmt::Debug {
    /// Copy the bytes at `src` (addresses of this process, in order) into the region
    /// `rkey` at `va` of the device at `dst`, reached through its QP `dqpn`. True only if
    /// every byte was copied under the peer's grant; false (nothing to rely on) when it
    /// cannot, and the caller sends the WRITE's packets.
    fn write(
        &mut self,
        dst: std::net::SocketAddr,
        dqpn: Qpn,
        rkey: u32,
        va: u64,
        src: &[(u64, usize)],
    ) -> bool;

    /// Whether the peer's grants would take a WRITE (`write`) or READ of `len` bytes at
    /// `va` of region `rkey` through its QP `dqpn` now (a check, copying nothing).
    fn reachable(
        &mut self,
        dst: std::net::SocketAddr,
        dqpn: Qpn,
        rkey: u32,
        va: u64,
        len: usize,
        write: bool,
    ) -> bool;

    /// Whether a thread of the device at `dst` polls for packets now (none is blocked
    /// waiting for one): packets then reach it at once, and for small payloads they cost
    /// less than a cross-memory copy, a system call each.
    fn peer_polls(&mut self, dst: std::net::SocketAddr) -> bool;

    /// A count that moves whenever the device at `dst` placed a one-sided operation into
    /// this device's memory: small WRITEs answered that way between them are a ping-pong
    /// (a latency test whose peer watches its memory), not a stream.
    fn peer_wrote(&mut self, dst: std::net::SocketAddr) -> u64;

    /// Copy the region `rkey` from `va` on of the device at `dst`, reached through its QP
    /// `dqpn`, into `dst_pieces` (addresses of this process, in order, which the engine
    /// lets the copy overwrite). True only if every byte was copied under the peer's grant;
    /// false when it cannot (the pieces may hold part of a copy), and the caller sends the
    /// READ request.
    fn read(
        &mut self,
        dst: std::net::SocketAddr,
        dqpn: Qpn,
        rkey: u32,
        va: u64,
        dst_pieces: &[(u64, usize)],
    ) -> bool;
}

/// A packet that stands, in a trace, for a one-sided operation placed with no packet
/// ([`Rnic::set_trace_placed`]): the RoCEv2 packet it would have been, sealed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlacedTrace {
    /// The requester's address (or the responder's, for a READ response).
    pub src: std::net::SocketAddr,
    /// Where it would have gone.
    pub dst: std::net::SocketAddr,
    /// Its traffic class.
    pub tos: u8,
    /// Whether it stands for a packet this device would have received (a READ response).
    pub inbound: bool,
    /// The packet: BTH to ICRC, its payload cut to [`PLACED_TRACE_PAYLOAD`] bytes.
    pub data: Vec<u8>,
    /// What happened instead, for the trace's comment.
    pub note: String,
}

/// At most this much of a placed operation's payload goes into the packet that stands for
/// it in a trace (a capture's packets stay under a datagram's size).
pub const PLACED_TRACE_PAYLOAD: usize = 4096;

impl Rnic {
    /// Let the requester copy RC WRITEs to same-host peers through `p` from now on.
    pub fn set_placement(&mut self, p: Box<dyn Placement>) {
        self.env.placement = Some(p);
    }

    /// Trace one-sided operations placed with no packet from now on ([`PlacedTrace`],
    /// taken with [`Rnic::take_placed_traces`]), or not.
    pub fn set_trace_placed(&mut self, on: bool) {
        self.env.trace_placed = on;
        if !on {
            self.env.placed_traces.clear();
        }
    }

    /// The packets that stand for the one-sided operations placed since the last call.
    pub fn take_placed_traces(&mut self) -> Vec<PlacedTrace> {
        std::mem::take(&mut self.env.placed_traces)
    }

    /// Publish this engine's grants to `sink` from now on (every region and QP already
    /// reachable at once).
    pub fn set_grant_sink(&mut self, mut sink: Box<dyn GrantSink>) {
        for lkey in self.env.ctx.mr_keys() {
            if let Some(v) = self.env.ctx.mr_remote_view(lkey) {
                sink.region(&v);
            }
        }
        let qpns: Vec<Qpn> = self.qps.keys().copied().collect();
        self.env.grants = Some(sink);
        for q in qpns {
            self.publish_qp(q);
        }
    }

    /// Tell the sink whether QP `qpn` may be reached now.
    pub(crate) fn publish_qp(&mut self, qpn: Qpn) {
        let Some(sink) = self.env.grants.as_mut() else {
            return;
        };
        let ready = self.env.ctx.qp(qpn).and_then(|q| {
            let remote = q.attr.qp_access_flags & (Access::REMOTE_WRITE | Access::REMOTE_READ);
            let up = matches!(q.state, QpState::Rtr | QpState::Rts | QpState::Sqd);
            (up && !remote.is_empty()).then_some((remote, q.init.pd))
        });
        sink.qp(qpn, ready);
    }

    /// Publish region `lkey` if peers may reach it.
    fn publish_region(&mut self, lkey: u32) {
        if let (Some(sink), Some(v)) = (self.env.grants.as_mut(), self.env.ctx.mr_remote_view(lkey))
        {
            sink.region(&v);
        }
    }

    fn revoke_region(&mut self, lkey: u32) {
        if let Some(sink) = self.env.grants.as_mut() {
            // A region's rkey is its lkey.
            sink.revoke_region(lkey);
        }
    }

    /// Register `len` bytes at `ptr` in `pd`, addressed by the peer as `iova`.
    ///
    /// # Safety
    /// The contract of `verbs::Context::reg_mr`: the memory stays valid (mapped, and not
    /// freed or reused for anything else) until the region is deregistered, and the
    /// program accepts that the device and peers read and write it at any time.
    pub unsafe fn reg_mr(
        &mut self,
        pd: PdId,
        ptr: *mut u8,
        len: usize,
        iova: u64,
        access: Access,
    ) -> verbs::Result<verbs::MrInfo> {
        // SAFETY: forwarded to the caller.
        let info = unsafe { self.env.ctx.reg_mr(pd, ptr, len, iova, access) }?;
        self.publish_region(info.lkey);
        Ok(info)
    }

    /// Re-register region `lkey` in place ([`verbs::Context::rereg_mr`]): the PD, the
    /// memory (`ptr`, `len`, `iova`) and the access given replace the region's; its keys
    /// stay. Peers stop reaching it as it was before it changes.
    ///
    /// # Safety
    /// With `memory`, the contract of [`Rnic::reg_mr`] for the new range.
    pub unsafe fn rereg_mr(
        &mut self,
        lkey: u32,
        pd: Option<PdId>,
        memory: Option<(*mut u8, usize, u64)>,
        access: Option<Access>,
    ) -> verbs::Result<verbs::MrInfo> {
        self.revoke_region(lkey);
        // SAFETY: forwarded to the caller.
        let r = unsafe { self.env.ctx.rereg_mr(lkey, pd, memory, access) };
        // Changed or not, what it is now is what peers may reach.
        self.publish_region(lkey);
        r
    }

    /// Deregister the MR with local key `lkey` (EBUSY while windows are bound to it).
    /// Peers stop reaching it first.
    pub fn dereg_mr(&mut self, lkey: u32) -> verbs::Result<()> {
        self.revoke_region(lkey);
        let r = self.env.ctx.dereg_mr(lkey);
        if r.is_err() {
            // Still registered: still reachable.
            self.publish_region(lkey);
        }
        r
    }
}
