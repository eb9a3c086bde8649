//! Per-QP protocol state: the send queue of WQEs with their PSN ranges, the requester's
//! position and window, the completer's timers and retry counters, and the responder's
//! expected PSN, MSN, message in progress and READ/atomic resources.

use std::collections::VecDeque;
use std::net::SocketAddr;

use softrdma_wire::ext::{SackBitmap, SACK_SPAN};
use softrdma_wire::{psn, Headers};

use crate::cc::{Controller, Loss};
use crate::keepalive::KaState;
use crate::recovery::Recovery;
use crate::verbs::{QpAttr, QpState, QpType, RecvWr, SendOp, SendWr, WcDetail, WcError, WcStatus};

/// Packets sent without AckReq before the requester asks for an ACK anyway (rxe's
/// RXE_MAX_PKT_PER_ACK), so that long messages get acknowledged as they go.
pub(crate) const MAX_PKT_PER_ACK: u32 = 64;

/// PSNs past the oldest unacknowledged one a requester may have sent, and past the
/// expected one a responder holds (see [`Held`]); far inside the 2^23 PSN window.
///
/// Why more than the congestion window's ceiling (`cc::ceiling_for`): a lost packet
/// holds the oldest PSN for the round trip its repair takes, while the packets after it
/// leave the socket buffers for the responder's hold. Were the send bounded by the
/// window from the oldest PSN, a sender on a lossy path would stop at every loss for
/// that round trip, its pipe empty. Packets a SACK shows held are not in flight, so the
/// send goes on until this span.
pub(crate) const HOLD_SPAN: i32 = softrdma_wire::ext::SACK_SPAN as i32;

/// Datagrams the outbox holds before requesters stop producing more until it drains
/// (they continue from `poll_transmit`), so that a long message is built a batch at a
/// time, into buffers still in cache when the driver sends them, instead of a whole
/// window at post time.
pub(crate) const OUTBOX_MAX: usize = 256;

/// Atomic results remembered for duplicate detection, at least (more if
/// max_dest_rd_atomic is larger).
pub(crate) const ATOMIC_REPLAY_MIN: usize = 16;

/// Where a UD WQE goes (resolved from its AH at post time, so later AH changes don't
/// affect queued WRs, as on hardware).
#[derive(Debug, Clone, Copy)]
pub(crate) struct UdTarget {
    pub dst: SocketAddr,
    pub tos: u8,
    pub qpn: u32,
    pub qkey: u32,
}

/// One send work queue element and its protocol progress.
#[derive(Debug)]
pub(crate) struct SendWqe {
    pub wr: SendWr,
    /// INLINE payload copied at post time.
    pub inline: Option<Vec<u8>>,
    /// Message length in bytes.
    pub len: usize,
    /// Whether PSNs have been assigned (first transmission started).
    pub started: bool,
    pub first_psn: u32,
    pub last_psn: u32,
    /// Packets in the message (READ: response packets, which use request PSN space).
    pub npkts: u32,
    /// Every packet has been handed to the wire (since the last rewind).
    pub sent_all: bool,
    /// Packets known to have arrived (ACKed SEND/WRITE packets, received READ responses).
    pub acked_pkts: u32,
    /// Ready to complete (UC/UD sent, local op executed, RC acknowledged).
    pub done: bool,
    /// Completion status when not success.
    pub status: Option<WcStatus>,
    /// Why, for the completion's `vendor_err`.
    pub detail: WcDetail,
    /// READ: response packet index the last request sent asked from.
    pub read_req_k: u32,
    /// READ: response packet index the last request sent asked up to (exclusive). A
    /// request resent after a loss asks for at most a congestion window of responses, so
    /// go-back-N costs a window rather than the rest of a long READ; when those have come
    /// the requester asks for the next part.
    pub read_req_end: u32,
    /// Counted in the requester's outstanding READ/atomic window.
    pub in_rd_window: bool,
    /// READ: response packets past `acked_pkts` that arrived (and are in place) while an
    /// earlier one is missing; the missing ones are asked for alone.
    pub read_ooo: std::collections::BTreeSet<u32>,
    /// READ: an answer past its last PSN came, so every response was sent.
    pub read_whole_sent: bool,
    pub ud: Option<UdTarget>,
    /// An RC WRITE whose payload the requester copied into the peer itself: one packet,
    /// a placed WRITE ([`softrdma_wire::ext::PLACED_WRITE`]), stands for it.
    pub placed: bool,
}

impl SendWqe {
    pub fn new(wr: SendWr, inline: Option<Vec<u8>>, len: usize, ud: Option<UdTarget>) -> Self {
        SendWqe {
            wr,
            inline,
            len,
            started: false,
            first_psn: 0,
            last_psn: 0,
            npkts: 0,
            sent_all: false,
            acked_pkts: 0,
            read_req_k: 0,
            read_req_end: 0,
            done: false,
            status: None,
            detail: WcDetail::Unspecified,
            in_rd_window: false,
            read_ooo: Default::default(),
            read_whole_sent: false,
            ud,
            placed: false,
        }
    }
    /// Complete in error, with the status and the detail of `e`.
    pub fn set_error(&mut self, e: WcError) {
        self.status = Some(e.status);
        self.detail = e.detail;
    }
    /// READ or atomic: the responses, not ACKs, complete it.
    pub fn is_rd_atomic(&self) -> bool {
        matches!(
            self.wr.op,
            SendOp::Read { .. } | SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. }
        )
    }
    pub fn is_atomic(&self) -> bool {
        matches!(
            self.wr.op,
            SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. }
        )
    }
    /// An RDMA READ.
    pub fn is_read(&self) -> bool {
        matches!(self.wr.op, SendOp::Read { .. })
    }
    pub fn is_local(&self) -> bool {
        matches!(self.wr.op, SendOp::LocalInv { .. } | SendOp::BindMw(_))
    }
}

/// Requester and completer state.
#[derive(Debug, Default)]
pub(crate) struct ReqState {
    /// Index in the SQ of the WQE being transmitted.
    pub cur: usize,
    /// Byte offset within that WQE of the next packet.
    pub offset: usize,
    /// PSN the next new WQE starts at.
    pub next_psn: u32,
    /// One past the highest PSN ever sent (to count retransmissions).
    pub high_psn: u32,
    /// READ/atomic requests in flight.
    pub rd_atomic: u32,
    /// Packets since the last AckReq.
    pub noack_pkts: u32,
    /// Transport retries left (timeouts, sequence NAKs).
    pub retry_left: u8,
    /// RNR retries left (7 = infinite).
    pub rnr_left: u8,
    /// Local ACK timeout deadline (from the last progress; spends a retry when it fires).
    pub rto: Option<u64>,
    /// Congestion controller.
    pub cc: Box<dyn Controller>,
    /// Round-trip estimate and the round-trip timer's backoff.
    pub rtt: crate::rtt::RttEstimator,
    /// Waiting after an RNR NAK until then.
    pub rnr_until: Option<u64>,
    /// Loss recovery: the round-trip timer, selective repeat, SACKs, READ repair.
    pub rec: Recovery,
    /// SQ drained event already given for the current SQD period.
    pub sqd_notified: bool,
    /// Stopped at a full outbox; queued in `DeviceCtx::tx_wait` to continue when it drains.
    pub tx_wait: bool,
    /// When the last small WRITE started (see `requester::may_place`), if one did, with
    /// the responder's expected PSN and the peer's placement count then.
    pub small_write_at: Option<(u64, u32, u64)>,
}

impl ReqState {
    /// Tell the congestion controller of `loss`; returns whether it cut the window. A
    /// cut is followed by a resend, whose answer may answer the timed packet's second
    /// copy (Karn, `RttEstimator::on_resend`); a cut by the round-trip timer (a path
    /// gone quiet) and a local ACK timeout also back the timer off, and the latter ends
    /// the timing whatever was measured.
    pub fn lost(&mut self, loss: Loss) -> bool {
        let cut = self.cc.on_loss(loss, &self.rtt);
        match loss {
            Loss::AckTimeout => {
                self.rtt.stop_timing();
                self.rtt.back_off();
            }
            Loss::RttTimeout(_) if cut => {
                self.rtt.on_resend();
                self.rtt.back_off();
            }
            _ if cut => self.rtt.on_resend(),
            _ => {}
        }
        cut
    }

    /// The oldest unacknowledged PSN is now `una` (at `now`): the packets before it were
    /// acknowledged, which the controller counts, a timed one among them measures the
    /// round trip, and the timer's backoff ends.
    pub fn acked_to(&mut self, una: u32, now: u64) {
        let n = self.rec.advance(una);
        if n == 0 {
            return;
        }
        self.cc.on_acked(now, n, &self.rtt);
        self.rtt.on_acked_below(una, now);
        self.rtt.on_progress();
    }
}

/// A READ or atomic the responder executed, kept for duplicate requests. A READ keeps
/// what its request asked (checked when it arrived), so a duplicate is answered from
/// that, never from the duplicate's own RETH.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Resource {
    Read {
        first_psn: u32,
        last_psn: u32,
        va: u64,
        rkey: u32,
        len: u32,
        /// What re-executions of it cost so far.
        replays: ReplayBudget,
    },
    Atomic {
        psn: u32,
        orig: u64,
    },
}

/// Response packets the re-executions of one READ may send in all, as a multiple of the
/// READ's own packets (plus [`READ_REPLAY_SLACK`]).
///
/// The IBTA has a duplicate READ re-executed from the PSN it names, which makes a READ
/// resource a reflector: 32 bytes of request buy up to a whole READ's worth of responses,
/// as often as asked. A requester needs few: one that times out asks for the rest again
/// at most retry_cnt (7 at most) times before it gives up, each from where its responses
/// stopped, and its sequence-driven asks (a gap in the responses) are for the rest from
/// a later PSN, which replaces the stream still under way, or for exactly the missing
/// packets (a softrdma requester: they cost what they name). So 8 times a READ's packets
/// cover a go-back-N requester whose READ's responses are lost whole at every timeout it
/// may wait through, plus one READ's worth of sequence-driven resends. Random loss alone
/// costs far less: a long READ's re-executions at 5-10% loss come to about its own
/// packets again, and READs of a few packets, which every go-back-N asks for whole, stay
/// within the slack. Re-executions past the budget are refused, and one under way stops where the
/// budget ends (dropped and counted), so one READ reflects at most this multiple of what
/// its requester asked.
pub(crate) const READ_REPLAY_FACTOR: u32 = 8;
/// Response packets every READ's re-executions may send beyond the multiple: small READs
/// are asked for whole at each go-back-N, and a few packets are cheap.
pub(crate) const READ_REPLAY_SLACK: u32 = 32;
/// Parts of one READ waiting to be sent again at once (see `responder::enqueue`): a
/// requester asks for its holes a few at a time; more are refused, so a flood of exact
/// duplicates does not grow the queue.
pub(crate) const READ_STREAMS_MAX: usize = 16;

/// What re-executions of one READ resource have cost so far (see [`READ_REPLAY_FACTOR`]).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ReplayBudget {
    /// Response packets re-executions have sent.
    pub packets: u32,
}

impl ReplayBudget {
    /// The response packets re-executions of a READ of `npkts` packets may send in all.
    pub fn cap(npkts: u32) -> u32 {
        npkts
            .saturating_mul(READ_REPLAY_FACTOR)
            .saturating_add(READ_REPLAY_SLACK)
    }

    /// A duplicate asks to re-execute a READ of `npkts` packets: Ok if its budget has
    /// packets left, else why not.
    pub fn take(&self, npkts: u32) -> Result<(), &'static str> {
        if self.packets >= Self::cap(npkts) {
            return Err("re-executions of this READ sent their budget of responses");
        }
        Ok(())
    }

    /// One more response packet of a re-execution of a READ of `npkts` packets: false
    /// (and nothing counted) when the budget is spent, so the re-execution stops there.
    pub fn spend(&mut self, npkts: u32) -> bool {
        if self.packets >= Self::cap(npkts) {
            return false;
        }
        self.packets += 1;
        true
    }
}

/// A response the responder still owes, in PSN order behind the READ responses being
/// streamed ([`RespState::pending`]).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Pending {
    /// READ responses of the resource starting at `first_psn`: this transmission began
    /// at `start` (its FIRST), and `next` is the next PSN to send, up to `last_psn`.
    Read {
        first_psn: u32,
        last_psn: u32,
        va: u64,
        rkey: u32,
        len: u32,
        start: u32,
        next: u32,
        msn: u32,
        /// A re-execution for a duplicate request (its packets count against the
        /// resource's [`ReplayBudget`]).
        replay: bool,
        /// The duplicate named exactly the packets sent (see `responder::replay_end`):
        /// sent beside the READ's other streams rather than replacing them.
        exact: bool,
    },
    /// An atomic ACK.
    AtomicAck { psn: u32, orig: u64, msn: u32 },
    /// An ACK, or a NAK (sequence, RNR, or a fatal one after which the QP fails).
    Aeth {
        psn: u32,
        msn: u32,
        syndrome: softrdma_wire::Syndrome,
        fatal: bool,
    },
}

impl Pending {
    /// The PSN of the next packet this entry sends (its place in the order).
    pub fn psn(&self) -> u32 {
        match *self {
            Pending::Read { next, .. } => next,
            Pending::AtomicAck { psn, .. } | Pending::Aeth { psn, .. } => psn,
        }
    }
}

/// A multi-packet message in progress at the responder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum InMsg {
    Send,
    Write { va: u64, rkey: u32, len: u32 },
}

/// Bytes of held request packets (see [`Held`]) one device keeps at most, over all its
/// QPs: holding is an optimisation, and past this a packet ahead of the expected PSN is
/// dropped as the IBTA responder drops it.
pub(crate) const HELD_BYTES_MAX: usize = 32 << 20;

/// A request packet that arrived ahead of the expected PSN.
#[derive(Debug)]
pub(crate) struct HeldPkt {
    pub h: Headers,
    pub payload: Vec<u8>,
    pub src_port: u16,
    /// A placed WRITE (its payload in our memory already).
    pub placed: bool,
}

/// Request packets an RC responder holds past a gap, by PSN, to execute in order once
/// the gap fills.
///
/// Why: the IBTA responder drops everything after a lost packet, and its requester
/// resends all of it (go-back-N), so one loss costs a window of packets. Held packets
/// change nothing the peer can see: they are executed in PSN order, exactly when the
/// packets before them have been, as if they had just arrived. A requester that resends
/// everything finds them duplicates; softrdma's own requester resends only the missing
/// packet (see `completer`). Bounded per QP by [`HOLD_SPAN`] and per device by
/// [`HELD_BYTES_MAX`].
///
/// A ring indexed by PSN, not a map: on a lossy path most packets pass through here
/// (at 1% loss about nine in ten wait behind some hole), and each is looked up several
/// times (its neighbours for the SACK, the drain), so every lookup is an index. Beside it
/// a bitmap of what is held, by PSN: every SACK reports up to [`HOLD_SPAN`] PSNs, and a
/// walk over the slots themselves (the headers inline, some 150 bytes each) would read
/// hundreds of kilobytes per SACK, while boxing the slots to make them small costs more
/// in the allocator than that walk.
#[derive(Debug, Default)]
pub(crate) struct Held {
    /// PSN of `slots[0]`.
    base: u32,
    /// The packets from `base` on (None: not held); the first and the last are held.
    slots: VecDeque<Option<HeldPkt>>,
    /// Bit `p % OCC_BITS` is set while PSN `p` is held: the slots span less than
    /// [`HOLD_SPAN`], so no two held PSNs share a bit. Empty until something is held.
    occ: Vec<u64>,
    bytes: usize,
}

/// Bits of [`Held`]'s occupancy map: twice the span, a power of two that divides the PSN
/// space, so that a PSN's bit stays the same across the wrap.
const OCC_BITS: usize = 2 * HOLD_SPAN as usize;

impl Held {
    fn cost(pkt: &HeldPkt) -> usize {
        pkt.payload.len() + std::mem::size_of::<HeldPkt>()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The slot of PSN `p`, if it lies inside the ring.
    fn index(&self, p: u32) -> Option<usize> {
        usize::try_from(psn::diff(p, self.base))
            .ok()
            .filter(|&i| i < self.slots.len())
    }

    /// Hold `pkt` with PSN `p`, counting its bytes in the device's `total`. False (not
    /// held) when one with that PSN is held already, `p` lies [`HOLD_SPAN`] or more from
    /// what is held, or the device's budget is spent.
    pub fn insert(&mut self, p: u32, pkt: HeldPkt, total: &mut usize) -> bool {
        let c = Self::cost(&pkt);
        if total.saturating_add(c) > HELD_BYTES_MAX {
            return false;
        }
        if self.slots.is_empty() {
            self.base = p;
            self.slots.push_back(Some(pkt));
        } else {
            let d = psn::diff(p, self.base);
            let span = if d < 0 {
                self.slots.len() as i64 - i64::from(d)
            } else {
                i64::from(d) + 1
            };
            if span > i64::from(HOLD_SPAN) {
                return false;
            }
            if d < 0 {
                for _ in 0..d.unsigned_abs() {
                    self.slots.push_front(None);
                }
                self.base = p;
                self.slots[0] = Some(pkt);
            } else {
                let i = d as usize;
                if i >= self.slots.len() {
                    self.slots.resize_with(i + 1, || None);
                }
                if self.slots[i].is_some() {
                    return false;
                }
                self.slots[i] = Some(pkt);
            }
        }
        self.mark(p, true);
        *total += c;
        self.bytes += c;
        true
    }

    fn mark(&mut self, p: u32, held: bool) {
        if self.occ.is_empty() {
            self.occ = vec![0; OCC_BITS / 64];
        }
        let i = p as usize % OCC_BITS;
        if held {
            self.occ[i / 64] |= 1 << (i % 64);
        } else {
            self.occ[i / 64] &= !(1 << (i % 64));
        }
    }

    /// The 64 occupancy bits from PSN `p` on: bit `k` for `p + k`.
    fn occ_from(&self, p: u32) -> u64 {
        let i = p as usize % OCC_BITS;
        let (w, sh) = (i / 64, i % 64);
        let lo = self.occ[w] >> sh;
        if sh == 0 {
            lo
        } else {
            lo | self.occ[(w + 1) % self.occ.len()] << (64 - sh)
        }
    }

    /// Whether the packet with PSN `p` is held.
    pub fn contains(&self, p: u32) -> bool {
        self.index(p).is_some_and(|i| self.slots[i].is_some())
    }

    /// The PSNs held, in order.
    #[cfg(test)]
    pub fn psns(&self) -> impl Iterator<Item = u32> + '_ {
        let base = self.base;
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.is_some())
            .map(move |(i, _)| psn::add(base, i as u32))
    }

    /// What a SACK from expected PSN `e` reports: the packets held past it, up to
    /// [`SACK_SPAN`](softrdma_wire::ext::SACK_SPAN) of them.
    pub fn sack_bits(&self, e: u32) -> SackBitmap {
        let mut bits = SackBitmap::default();
        if self.slots.is_empty() {
            return bits;
        }
        // What is held lies in d = lo..=hi past `e`; the map is read only there, so a
        // bit never stands for a PSN a span away.
        let first = i64::from(psn::diff(self.base, e));
        let lo = first.max(1);
        let hi = (first + self.slots.len() as i64 - 1).min(i64::from(SACK_SPAN));
        if lo > hi {
            return bits;
        }
        // Word w of the SACK marks d = 64·w + 1 ..= 64·w + 64.
        for w in (lo - 1) / 64..=(hi - 1) / 64 {
            let d0 = 64 * w + 1;
            let keep = (u64::MAX << (lo - d0).max(0)) & (u64::MAX >> (d0 + 63 - hi).max(0));
            bits.set_word(w as usize, self.occ_from(psn::add(e, d0 as u32)) & keep);
        }
        bits
    }

    /// Take the packet with PSN `p`, if held.
    pub fn take(&mut self, p: u32, total: &mut usize) -> Option<HeldPkt> {
        let i = self.index(p)?;
        let pkt = self.slots[i].take()?;
        self.mark(p, false);
        let c = Self::cost(&pkt);
        self.bytes -= c;
        *total = total.saturating_sub(c);
        self.trim();
        Some(pkt)
    }

    /// Keep the first and the last slot held.
    fn trim(&mut self) {
        while self.slots.front().is_some_and(|s| s.is_none()) {
            self.slots.pop_front();
            self.base = psn::add(self.base, 1);
        }
        while self.slots.back().is_some_and(|s| s.is_none()) {
            self.slots.pop_back();
        }
    }

    /// Drop what is not ahead of `epsn` any more (a READ moves the expected PSN past
    /// its responses' PSNs, which no genuine request uses).
    pub fn purge_before(&mut self, epsn: u32, total: &mut usize) {
        while !self.slots.is_empty() && psn::diff(self.base, epsn) <= 0 {
            if let Some(pkt) = self.slots.pop_front().flatten() {
                let c = Self::cost(&pkt);
                self.bytes -= c;
                *total = total.saturating_sub(c);
                self.mark(self.base, false);
            }
            self.base = psn::add(self.base, 1);
        }
        self.trim();
    }

    /// Drop everything held.
    pub fn clear(&mut self, total: &mut usize) {
        *total = total.saturating_sub(self.bytes);
        self.bytes = 0;
        self.slots.clear();
        self.occ.fill(0);
    }
}

/// Responder state.
#[derive(Debug, Default)]
pub(crate) struct RespState {
    /// Expected PSN.
    pub epsn: u32,
    /// Messages completed (24 bits).
    pub msn: u32,
    /// Message in progress (after a FIRST, before its LAST).
    pub in_msg: Option<InMsg>,
    /// Bytes of the message in progress received so far.
    pub offset: usize,
    /// Receive WQE taken for the message in progress.
    pub recv: Option<RecvWr>,
    /// A sequence-error NAK was sent; no more until the expected PSN arrives (IBTA: one NAK
    /// per sequence error).
    pub nak_sent: bool,
    /// READ resources (ring of max_dest_rd_atomic).
    pub reads: VecDeque<Resource>,
    /// Atomic replay cache, keyed by PSN.
    pub atomics: VecDeque<Resource>,
    /// Coalesced ACK to send: (psn, msn).
    pub ack: Option<(u32, u32)>,
    /// Responses owed behind a READ response stream, in PSN order: READ streams continue
    /// from `Rnic::poll_transmit` as the outbox drains, and any ACK / NAK / atomic ACK
    /// of a later PSN waits behind them. At most one entry per READ resource in
    /// `reads` (an evicted resource's entry goes with it), one per atomic replay entry,
    /// one ACK/NAK and one fatal NAK: a remote peer cannot make it grow.
    pub pending: VecDeque<Pending>,
    /// Queued in `DeviceCtx::resp_wait` to continue `pending` when the outbox drains.
    pub tx_wait: bool,
    /// A fatal NAK waits in `pending`: requests are dropped until it is sent and the QP
    /// fails.
    pub fatal: bool,
    /// CommEst given.
    pub comm_est: bool,
    /// Request packets held past a gap.
    pub held: Held,
    /// The requester asked for SACKs ([`crate::sack`]): say which packets are held.
    pub sack_peer: bool,
    /// A SACK waits to go out with the coalesced ACK (see `sack::on_held`).
    pub sack_due: bool,
}

/// A QP's transport side.
#[derive(Debug)]
pub(crate) struct QpCtx {
    pub qpn: u32,
    pub qp_type: QpType,
    /// Cached from the verbs QP after each modify / error.
    pub state: QpState,
    pub attr: QpAttr,
    pub pd: crate::verbs::PdId,
    pub send_cq: crate::verbs::CqId,
    pub recv_cq: crate::verbs::CqId,
    pub has_srq: bool,
    pub sq_sig_all: bool,
    pub max_send_wr: u32,
    /// Peer of an RC/UC QP (dgid IP, our UDP port number).
    pub peer: Option<SocketAddr>,
    /// The UDP source port the connected peer sends from, learnt from the first packet
    /// the QP took as genuine (a request at the expected PSN, a response inside the
    /// outstanding window). RoCEv2 peers keep one source port per QP (softrdma and rxe
    /// send from 0xC000 + hash(QPN), so that a flow stays on one path), and RoCE has no
    /// authentication: once known, the port is the one thing besides the IP that tells
    /// the peer from someone forging its packets, so packets from any other are dropped.
    pub peer_port: Option<u16>,
    pub sq: VecDeque<SendWqe>,
    pub req: ReqState,
    pub resp: RespState,
    /// Liveness of the peer while the connection is idle ([`crate::keepalive`]).
    pub ka: KaState,
    /// The deadlines the device's timer indexes hold for this QP.
    pub indexed: crate::timers::Indexed,
}

impl QpCtx {
    /// Payload bytes per packet.
    pub fn mtu(&self) -> usize {
        self.attr.path_mtu.bytes()
    }
    /// A packet from UDP port `port` was taken as the connected peer's: from now on only
    /// that port is.
    pub fn learn_peer_port(&mut self, port: u16) {
        if self.peer.is_some() && self.peer_port.is_none() {
            self.peer_port = Some(port);
        }
    }
    /// Local ACK timeout in ns; None = wait forever (timeout 0).
    pub fn ack_timeout(&self) -> Option<u64> {
        ack_timeout_ns(self.attr.timeout)
    }
    /// PSN of the oldest request packet not yet acknowledged, if any is in flight. WQEs
    /// start in posting order, so only the first unfinished one can hold it.
    pub fn oldest_unacked(&self) -> Option<u32> {
        let w = self.sq.iter().find(|w| !w.done)?;
        w.started
            .then(|| softrdma_wire::psn::add(w.first_psn, w.acked_pkts))
    }
    /// The started, unfinished WQE whose first PSN is `first`.
    pub fn unfinished_at(&self, first: u32) -> Option<&SendWqe> {
        self.sq
            .iter()
            .find(|w| w.started && !w.done && w.first_psn == first)
    }
    /// Packets at or after `base` (the oldest unacknowledged PSN) that READs have
    /// answered: responses placed past a missing one, and every packet of a WQE finished
    /// behind an unfinished READ. In flight no more, so the congestion window does not
    /// count them, as it does not count request packets a SACK shows held: otherwise one
    /// missing response at the front keeps the PSNs of every READ after it in the
    /// window, and the send stops, the path empty, until that response is repaired.
    pub fn read_arrived_from(&self, base: u32) -> u32 {
        if self.req.rd_atomic == 0 {
            return 0;
        }
        let mut n = 0u32;
        for w in self.sq.iter().take_while(|w| w.started) {
            if w.is_local() || psn::lt(w.last_psn, base) {
                continue;
            }
            if w.done {
                n = n.saturating_add(w.npkts);
            } else if w.is_read() {
                let placed = w.read_ooo.len() as u32;
                let front = psn::le(w.first_psn, base);
                n = n.saturating_add(placed + if front { 0 } else { w.acked_pkts });
            }
        }
        n
    }
    /// Arm the local ACK timeout and the round-trip timer from `now`, each unless it is
    /// already running.
    pub fn arm_timers(&mut self, now: u64) {
        let limit = self.ack_timeout();
        if self.req.rto.is_none() {
            self.req.rto = limit.map(|t| now.saturating_add(t));
        }
        if self.req.rec.rtt_deadline().is_none() {
            let interval = self.req.rtt.rto(limit);
            self.req.rec.arm_rtt_timer(now, interval);
        }
    }
}

/// IBTA local ACK timeout: 4.096 µs × 2^timeout; 0 means infinite.
pub(crate) fn ack_timeout_ns(code: u8) -> Option<u64> {
    match code {
        0 => None,
        c => Some(4096u64 << u32::from(c.min(31))),
    }
}

/// IBTA RNR NAK timer table (9.7.5.2.8), code → nanoseconds. Code 0 is the longest.
pub(crate) fn rnr_timer_ns(code: u8) -> u64 {
    const US: [u64; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560,
        3_840, 5_120, 7_680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880,
        163_840, 245_760, 327_680, 491_520,
    ];
    US[usize::from(code & 0x1F)] * 1000
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timers() {
        assert_eq!(ack_timeout_ns(0), None);
        assert_eq!(ack_timeout_ns(1), Some(8192));
        assert_eq!(ack_timeout_ns(14), Some(4096 << 14));
        assert_eq!(rnr_timer_ns(0), 655_360_000);
        assert_eq!(rnr_timer_ns(1), 10_000);
        assert_eq!(rnr_timer_ns(31), 491_520_000);
        assert_eq!(rnr_timer_ns(12), 640_000);
    }

    fn pkt(p: u32, len: usize) -> HeldPkt {
        let h = Headers::new(softrdma_wire::Bth::new(
            softrdma_wire::Opcode::RC_RDMA_WRITE_MIDDLE,
            1,
            p,
        ));
        HeldPkt {
            h,
            payload: vec![p as u8; len],
            src_port: 4791,
            placed: false,
        }
    }

    #[test]
    fn held_ring_keeps_packets_by_psn_across_the_wrap() {
        let mut held = Held::default();
        let mut total = 0;
        let base = 0xFF_FFFE;
        let at = |d: u32| psn::add(base, d);
        for d in [5, 2, 9, 3] {
            assert!(held.insert(at(d), pkt(at(d), 100), &mut total));
        }
        assert!(
            !held.insert(at(3), pkt(at(3), 100), &mut total),
            "held already"
        );
        assert!(
            !held.insert(at(2 + HOLD_SPAN as u32), pkt(0, 100), &mut total),
            "past the span from what is held"
        );
        let psns: Vec<u32> = held.psns().collect();
        assert_eq!(psns, vec![at(2), at(3), at(5), at(9)]);
        assert!(held.contains(at(9)) && !held.contains(at(4)) && !held.contains(at(1)));
        let one = 100 + std::mem::size_of::<HeldPkt>();
        assert_eq!(total, 4 * one);
        // Below the first held one.
        assert!(held.insert(at(1), pkt(at(1), 100), &mut total));
        let t = held.take(at(1), &mut total).unwrap();
        assert_eq!((t.h.bth.psn, t.payload[0]), (at(1), at(1) as u8));
        assert!(held.take(at(1), &mut total).is_none());
        assert!(held.take(at(4), &mut total).is_none(), "a hole");
        assert_eq!(held.take(at(2), &mut total).unwrap().h.bth.psn, at(2));
        // The expected PSN moved past 5 (a READ's responses): 3 and 5 go.
        held.purge_before(at(5), &mut total);
        assert_eq!(held.psns().collect::<Vec<_>>(), vec![at(9)]);
        assert_eq!(total, one);
        assert!(held.take(at(9), &mut total).is_some());
        assert!(held.is_empty());
        assert_eq!(total, 0);
        // The budget is the device's.
        let mut full = HELD_BYTES_MAX - 10;
        assert!(!held.insert(at(1), pkt(at(1), 100), &mut full));
        assert!(held.is_empty());
        held.insert(at(3), pkt(at(3), 10), &mut total);
        held.clear(&mut total);
        assert!(held.is_empty() && total == 0 && !held.contains(at(3)));
    }

    #[test]
    fn sack_bits_mark_what_is_held_past_the_expected_psn_across_the_wrap() {
        let span = SACK_SPAN;
        let e = 0xFF_FFF0;
        let at = |d: u32| psn::add(e, d);
        let mut held = Held::default();
        let mut total = 0;
        for d in [2, 3, 64, 65, 200, span] {
            assert!(held.insert(at(d), pkt(at(d), 10), &mut total));
        }
        let marked = |bits: &SackBitmap| (1..=span).filter(|&d| bits.get(d)).collect::<Vec<_>>();
        assert_eq!(marked(&held.sack_bits(e)), vec![2, 3, 64, 65, 200, span]);
        // From a later expected PSN the same packets lie nearer; what is not past it
        // is not reported, and what lies past the span is left out.
        assert_eq!(marked(&held.sack_bits(at(3))), vec![61, 62, 197, span - 3]);
        assert_eq!(
            marked(&held.sack_bits(psn::sub(e, 8))),
            vec![10, 11, 72, 73, 208]
        );
        assert_eq!(marked(&Held::default().sack_bits(e)), Vec::<u32>::new());
    }

    /// The bitmap a SACK reads agrees with the slots through inserts, takes, purges and
    /// clears, across the PSN wrap and from every expected PSN near what is held.
    #[test]
    fn sack_bits_agree_with_the_slots_through_random_holding() {
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut rnd = |n: u32| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % u64::from(n)) as u32
        };
        let mut held = Held::default();
        let mut total = 0;
        let mut e = psn::MASK - 3000;
        for round in 0..3000 {
            match rnd(10) {
                0..=5 => {
                    let p = psn::add(e, 1 + rnd(HOLD_SPAN as u32 - 1));
                    held.insert(p, pkt(p, 8), &mut total);
                }
                6 | 7 => {
                    let p = psn::add(e, rnd(64));
                    held.take(p, &mut total);
                }
                8 => {
                    e = psn::add(e, rnd(200));
                    held.purge_before(e, &mut total);
                }
                _ if round % 500 == 0 => held.clear(&mut total),
                _ => {}
            }
            for from in [psn::sub(e, 5), e, psn::add(e, 7), psn::add(e, 100)] {
                let bits = held.sack_bits(from);
                for d in 1..=SACK_SPAN {
                    assert_eq!(
                        bits.get(d),
                        held.contains(psn::add(from, d)),
                        "round {round}, from {from}, d {d}"
                    );
                }
            }
        }
        assert!(total > 0 || held.is_empty());
    }
}
