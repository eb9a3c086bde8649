//! Selective acknowledgement between softrdma peers ([`wire::ext`]).
//!
//! A softrdma responder holds the request packets that follow a gap (`qp::Held`); a
//! sequence NAK can name only the first missing packet, so without more a requester
//! repairs one hole per round trip. Once a requester knows its peer holds packets (see
//! `completer::sr_answered`), it sends a SACK_PERMIT; from then on the responder sends a
//! SACK once a new hole has [`DUP_THRESH`] held packets past it, and the requester
//! resends every packet the SACK shows missing at once.
//!
//! A SACK acknowledges nothing and completes nothing: it is advice on what to resend
//! early, and the ACKs and NAKs keep their IBTA meaning. So a forged or stale SACK can
//! at worst make the requester resend packets (duplicates, which the responder
//! discards), and is accepted only inside the outstanding window, from the peer's UDP
//! port. An IBTA peer (rxe) never receives either message: it never holds packets, so
//! no SACK_PERMIT is sent to it, and a responder sends SACKs only to a requester that
//! asked.

use std::collections::BTreeMap;

use softrdma_wire::ext::{Ext, SackBitmap, SACK, SACK_PERMIT, SACK_SPAN};
use softrdma_wire::{psn, Bth};
use tracing::{debug, trace};

use crate::qp::{QpCtx, HOLD_SPAN};
use crate::requester;
use crate::verbs::{QpState, QpType};
use crate::Nic;

/// A hole is resent on a SACK only when this many held packets follow it (or nothing
/// more was sent after the highest held one): a packet merely overtaken by a few others
/// arrives by itself, as TCP's duplicate-ACK threshold assumes.
pub(crate) const DUP_THRESH: u32 = 3;
/// Holes resent for one SACK, at most.
const RESENDS_PER_SACK: usize = 128;
/// SACK_PERMITs one QP sends at most while no SACK answers (a softrdma peer without this
/// extension drops them).
const PERMITS_MAX: u8 = 8;
/// Fresh holes of which [`RUNS_FOR_CONGESTION`] or more being runs of two or more lost
/// packets makes a run a sign of congestion (see [`on_sack`]).
const HOLE_HISTORY: u32 = 16;
const RUNS_FOR_CONGESTION: u32 = 4;
/// A hole resent less than this long ago is not resent again (before a round trip has
/// been measured).
const RESEND_GUARD_NS: u64 = 1_000_000;

/// The requester's side: whether the peer sends SACKs, and what the last one said.
#[derive(Debug, Default)]
pub(crate) struct ReqSack {
    /// A SACK came from the peer: it sends one for every hole it holds packets past.
    pub peer_sacks: bool,
    /// SACK_PERMITs sent, and when the last one went.
    permits: u8,
    permit_at: u64,
    /// The latest SACK: the responder's expected PSN and the packets it holds past it.
    /// Boxed: it is half a KiB, and most QPs never see a SACK.
    pub board: Option<Box<(u32, SackBitmap)>>,
    /// Holes resent (by a SACK or a selective repeat, and the first PSNs of READ parts
    /// asked for again) and when: not again within a round trip, when the SACK that shows
    /// them still missing may predate their arrival.
    pub resent: BTreeMap<u32, Resent>,
    /// Resends noted so far: orders resends made at the same instant.
    seq: u64,
    /// The last [`HOLE_HISTORY`] fresh holes a SACK showed, newest in bit 0: set when
    /// the packet after the hole was missing too.
    hole_runs: u16,
}

/// When a packet was resent, and in which order among resends (see [`ReqSack::note`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Resent {
    pub at: u64,
    pub seq: u64,
}

impl ReqSack {
    /// A fresh hole was found, a run of two or more lost packets when `run`: whether
    /// that is a sign of congestion, as [`on_sack`] tells (a run, and at least
    /// [`RUNS_FOR_CONGESTION`] of the last [`HOLE_HISTORY`] fresh holes were runs).
    pub fn note_hole(&mut self, run: bool) -> bool {
        self.hole_runs = (self.hole_runs << 1) | u16::from(run);
        let mask = u16::MAX >> (16 - HOLE_HISTORY);
        run && (self.hole_runs & mask).count_ones() >= RUNS_FOR_CONGESTION
    }

    /// The order of the newest resend whose packet has `arrived` (see [`resend_due`]).
    pub fn newest_arrived(&self, arrived: impl Fn(u32) -> bool) -> Option<u64> {
        self.resent
            .iter()
            .filter(|&(&q, _)| arrived(q))
            .map(|(_, r)| r.seq)
            .max()
    }

    /// Packet `q` was resent (or asked for again) at `now`.
    pub fn note(&mut self, q: u32, now: u64) {
        self.seq += 1;
        self.resent.insert(
            q,
            Resent {
                at: now,
                seq: self.seq,
            },
        );
    }

    /// A go-back-N resends everything: what the last SACK said no longer describes what
    /// is in flight.
    pub fn forget(&mut self) {
        self.board = None;
        self.resent.clear();
    }
}

/// Packets at or after `base` that the last SACK showed held: in flight no more, so the
/// congestion window does not count them.
pub(crate) fn sacked_from(qp: &QpCtx, base: u32) -> u32 {
    let Some((e, bits)) = qp.req.sack.board.as_deref() else {
        return 0;
    };
    let from = psn::diff(base, *e);
    if from > SACK_SPAN as i32 {
        return 0;
    }
    bits.count_from(from.max(1) as u32)
}

/// Requester: ask a peer that holds packets for SACKs, unless it sends them already
/// (again after a round trip's worth of time while none answers, at most
/// [`PERMITS_MAX`] times).
pub(crate) fn maybe_permit(qp: &mut QpCtx, env: &mut Nic, now: u64) {
    let s = &qp.req.sack;
    if qp.qp_type != QpType::Rc
        || qp.req.peer_holds != Some(true)
        || s.peer_sacks
        || s.permits >= PERMITS_MAX
        || (s.permits > 0 && now.saturating_sub(s.permit_at) < resend_guard(qp))
    {
        return;
    }
    let Some(dst) = qp.peer else { return };
    let at = qp.oldest_unacked().unwrap_or(qp.req.next_psn);
    let m = Ext::SackPermit(Bth::new(SACK_PERMIT, qp.attr.dest_qp_num, at));
    qp.req.sack.permits += 1;
    qp.req.sack.permit_at = now;
    debug!(
        qpn = format_args!("{:#x}", qp.qpn),
        "SACK_PERMIT sent (the peer holds packets past a gap)"
    );
    env.send_ext(qp.qpn, dst, qp.attr.ah_attr.grh.traffic_class, &m);
}

/// How long a resent hole is given before a SACK that still shows it missing resends it
/// again: a round trip and its variation.
fn resend_guard(qp: &QpCtx) -> u64 {
    qp.req.rtt.resend_guard().unwrap_or(RESEND_GUARD_NS)
}

/// Whether packet `q` was resent so recently that evidence of it missing may predate
/// the resend's arrival.
pub(crate) fn recently_resent(qp: &QpCtx, q: u32, now: u64) -> bool {
    resent_within(qp, q, now, resend_guard(qp))
}

/// Whether packet `q` was resent less than `guard` before `now`.
fn resent_within(qp: &QpCtx, q: u32, now: u64, guard: u64) -> bool {
    qp.req
        .sack
        .resent
        .get(&q)
        .is_some_and(|r| now.saturating_sub(r.at) < guard)
}

/// Whether packet `q`, shown missing, may be resent at `now`: not when it was resent
/// within a round trip (the evidence may predate the resend's arrival), unless a resend
/// made after it has arrived (`newest`, from [`ReqSack::newest_arrived`]): the path keeps
/// order, so this one was lost again (RACK's rule).
pub(crate) fn resend_due(qp: &QpCtx, q: u32, now: u64, newest: Option<u64>) -> bool {
    due_after(qp, q, now, newest, resend_guard(qp))
}

/// Whether the response packet `q` of a READ, shown missing, may be asked for again at
/// `now`: as [`resend_due`] says of a resent packet, but with the round-trip timer's
/// interval (SRTT + 4·RTTVAR) rather than a round trip and twice its variation as the
/// time an earlier request for it is given. The answer to such a request queues behind
/// every response already on its way, as much as the window lets through, which the
/// round trips of fresh READ requests measure only on average: given a round trip and
/// twice its variation, half the parts asked at 1% loss were asked twice (2,388
/// responses received twice in one run, of 4,225 asked), the second answer arriving
/// after the READ completed.
pub(crate) fn read_part_due(qp: &QpCtx, q: u32, now: u64, newest: Option<u64>) -> bool {
    let guard = qp.req.rtt.rto_base().unwrap_or(RESEND_GUARD_NS);
    due_after(qp, q, now, newest, guard)
}

/// RACK's rule with `guard` as the time a resend is given: `q` is due unless it was
/// resent less than `guard` ago and no resend made after it has arrived (`newest`).
fn due_after(qp: &QpCtx, q: u32, now: u64, newest: Option<u64>, guard: u64) -> bool {
    let overtaken = match (qp.req.sack.resent.get(&q), newest) {
        (Some(r), Some(n)) => r.seq < n,
        _ => false,
    };
    overtaken || !resent_within(qp, q, now, guard)
}

/// Responder: the requester asked for SACKs. Answer with one at once, which also tells
/// it that this peer sends them.
pub(crate) fn on_permit(qp: &mut QpCtx, env: &mut Nic) {
    if qp.qp_type != QpType::Rc {
        return;
    }
    qp.resp.sack_peer = true;
    send(qp, env);
}

/// Responder: send a SACK (expected PSN, the packets held past it) to a requester that
/// asked for them.
pub(crate) fn send(qp: &mut QpCtx, env: &mut Nic) {
    qp.resp.sack_due = false;
    if !qp.resp.sack_peer {
        return;
    }
    let Some(dst) = qp.peer else { return };
    let e = qp.resp.epsn;
    let bits = qp.resp.held.sack_bits(e);
    env.stats.sacks_sent += 1;
    trace!(qpn = format_args!("{:#x}", qp.qpn), psn = e, "SACK sent");
    let m = Ext::Sack(Bth::new(SACK, qp.attr.dest_qp_num, e), bits);
    env.send_ext(qp.qpn, dst, qp.attr.ah_attr.grh.traffic_class, &m);
}

/// Responder: packet `p` was just held. A SACK goes out when `p` is the
/// [`DUP_THRESH`]th held packet past a hole (the one [`DUP_THRESH`] before it is missing,
/// those between are held): what makes the requester resend it, so a hole costs one
/// SACK. One goes out too when `p` fills a hole below held packets: a resend arrived,
/// and the requester learns from it whether a resend it made earlier was lost (see
/// [`on_sack`]). And one goes out in place of the ACK a held packet asks for: without it
/// the requester learns of the packets held after a hole only at the next hole, and
/// counts them in flight meanwhile, which stops its send while the path is empty.
///
/// Each of these costs a datagram on the return path and, on a host, a wake-up of
/// whatever forwards it; a SACK for each of the packets after a hole, sent before, told
/// the requester nothing it acts on (it waits for [`DUP_THRESH`] of them).
pub(crate) fn on_held(qp: &mut QpCtx, env: &mut Nic, p: u32, ack_req: bool) {
    if !qp.resp.sack_peer {
        return;
    }
    let e = qp.resp.epsn;
    let hole = psn::sub(p, DUP_THRESH);
    let threshold = !psn::lt(hole, e)
        && !qp.resp.held.contains(hole)
        && (1..DUP_THRESH).all(|k| qp.resp.held.contains(psn::sub(p, k)));
    if (threshold || ack_req || qp.resp.held.contains(psn::add(p, 1))) && !qp.resp.sack_due {
        // Sent with the coalesced ACK, once the datagrams at hand are handled: the
        // events of one receive batch make one SACK, which describes the hold as of the
        // last of them.
        qp.resp.sack_due = true;
        env.ack_queue.push_back(qp.qpn);
    }
}

/// Requester: a SACK from the peer saying it expects `e` and holds `bits` past it.
/// Resends every packet it shows missing below the highest held one (see
/// [`DUP_THRESH`]), each at most once per round trip, unless a resend made after it
/// has arrived: the path keeps order, so that one was lost again (RACK's rule), and it
/// is resent at once instead of after the round-trip timer.
///
/// The window is cut only when a new hole is a run of two or more lost packets and at
/// least [`RUNS_FOR_CONGESTION`] of the last [`HOLE_HISTORY`] holes were: an overflowing
/// queue (a switch's, a socket buffer) drops what arrives while it is full, runs of the
/// bursts, while random loss leaves mostly isolated holes (at 5% random loss one hole in
/// twenty is a run by chance, and sixteen holes hold four runs with probability 0.7%),
/// which a cut would not prevent and which cost only the resent packets here. The round
/// trip cannot tell them apart on a host whose own scheduling queues a window's worth:
/// it grows with the window whether or not anything overflows (see `Cc::on_loss_of`).
/// Cutting at every chance run let the window sink to its floor at 5% loss whenever the
/// floor was low (a small round trip measured early), and stay there.
pub(crate) fn on_sack(qp: &mut QpCtx, env: &mut Nic, now: u64, e: u32, bits: SackBitmap) {
    if qp.qp_type != QpType::Rc || !matches!(qp.state, QpState::Rts | QpState::Sqd) {
        return;
    }
    // The answer to a SACK_PERMIT comes when nothing may be outstanding any more.
    if !qp.req.sack.peer_sacks {
        qp.req.sack.peer_sacks = true;
        qp.req.cc.on_peer_sacks();
    }
    let Some(oldest) = qp.oldest_unacked() else {
        return;
    };
    let high = qp.req.high_psn;
    // The responder expects `e`, so it has every packet before it: `e` lies in the
    // outstanding window (an ACK may have moved `oldest` past it since: then the SACK
    // is older than that ACK), and what it holds was sent.
    let span = psn::diff(high, e);
    if psn::lt(e, oldest) || span <= 0 || span > HOLD_SPAN {
        trace!(
            qpn = format_args!("{:#x}", qp.qpn),
            psn = e,
            oldest,
            high,
            "SACK outside the outstanding window ignored"
        );
        return;
    }
    let top = bits.highest();
    if top.is_some_and(|d| d as i32 >= span) {
        trace!(
            qpn = format_args!("{:#x}", qp.qpn),
            psn = e,
            "SACK holding packets never sent ignored"
        );
        return;
    }
    env.stats.sacks_rcvd += 1;
    match &mut qp.req.sack.board {
        Some(b) => **b = (e, bits),
        none => *none = Some(Box::new((e, bits))),
    }
    qp.req
        .sack
        .resent
        .retain(|&q, _| !psn::lt(q, oldest) && psn::lt(q, high));
    let Some(top) = top else { return };
    if qp.req.retrying || qp.req.rnr_until.is_some() {
        // A go-back-N or an RNR wait resends everything from the oldest anyway.
        return;
    }
    // Nothing sent after the highest held packet: no later packet will show its holes.
    let tail = psn::add(e, top + 1) == high;
    // The newest resend that the peer now holds.
    let newest_arrived = qp.req.sack.newest_arrived(|q| {
        let d = psn::diff(q, e);
        d > 0 && bits.get(d as u32)
    });
    let mut resent = 0;
    let mut first = None;
    let mut burst = false;
    let mut congested = false;
    // The holes below the highest held packet, from the expected PSN up: a word of the
    // bitmap at a time, as most of a deep window is held.
    let mut d = 0;
    // Held packets past the hole `d`: those between two holes are all held.
    let mut above = bits.count_from(1);
    while d < top && resent < RESENDS_PER_SACK {
        if !tail && above < DUP_THRESH {
            break;
        }
        let hole = d;
        d = bits.next_clear(d + 1);
        above -= d - hole - 1;
        let q = psn::add(e, hole);
        if !resend_due(qp, q, now, newest_arrived) {
            continue;
        }
        if !requester::resend_one(qp, env, now, q) {
            // A READ or atomic request (resent by a go-back-N), or nothing to resend.
            continue;
        }
        if qp.state == QpState::Err {
            return;
        }
        if !qp.req.sack.resent.contains_key(&q) {
            // A fresh hole with the next packet missing too: a run of losses.
            let run = hole + 1 < top && !bits.get(hole + 1);
            congested |= qp.req.sack.note_hole(run);
            burst |= run;
        }
        qp.req.sack.note(q, now);
        env.stats.sack_resends += 1;
        first.get_or_insert(q);
        resent += 1;
    }
    if let Some(q) = first {
        debug!(
            qpn = format_args!("{:#x}", qp.qpn),
            from = q,
            resent,
            cwnd = qp.req.cc.window(),
            outstanding = psn::diff(high, oldest),
            burst,
            "holes resent from a SACK"
        );
        if congested {
            qp.req.lost(crate::cc::Loss::Run(q));
        }
        // The round-trip timer now waits for the answer to these resends.
        qp.req.rto_fast = None;
        qp.arm_timers(now);
    }
}
