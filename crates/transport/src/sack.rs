//! Selective acknowledgement between softrdma peers ([`wire::ext`]).
//!
//! A softrdma responder holds the request packets that follow a gap (`qp::Held`); a
//! sequence NAK can name only the first missing packet, so without more a requester
//! repairs one hole per round trip. Once a requester knows its peer holds packets (see
//! `Recovery::answered`), it sends a SACK_PERMIT; from then on the responder sends a
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

use softrdma_wire::ext::{Ext, SackBitmap, SACK, SACK_PERMIT};
use softrdma_wire::{psn, Bth};
use tracing::{debug, trace};

use crate::cc::Loss;
use crate::device_ctx::DeviceCtx;
use crate::qp::QpCtx;
use crate::recovery::{DUP_THRESH, RESENDS_PER_SACK};
use crate::requester;
use crate::verbs::{QpState, QpType};

/// Requester: ask a peer that holds packets for SACKs, unless it sends them already
/// (again after a round trip's worth of time while none answers, a few times at most:
/// see `Recovery::permit_due`).
pub(crate) fn maybe_permit(qp: &mut QpCtx, env: &mut DeviceCtx, now: u64) {
    if qp.qp_type != QpType::Rc || !qp.req.rec.permit_due(now, &qp.req.rtt) {
        return;
    }
    let Some(dst) = qp.peer else { return };
    let at = qp.oldest_unacked().unwrap_or(qp.req.next_psn);
    let m = Ext::SackPermit(Bth::new(SACK_PERMIT, qp.attr.dest_qp_num, at));
    qp.req.rec.permit_sent(now);
    debug!(
        qpn = format_args!("{:#x}", qp.qpn),
        "SACK_PERMIT sent (the peer holds packets past a gap)"
    );
    env.send_ext(qp.qpn, dst, qp.attr.ah_attr.grh.traffic_class, &m);
}

/// Responder: the requester asked for SACKs. Answer with one at once, which also tells
/// it that this peer sends them.
pub(crate) fn on_permit(qp: &mut QpCtx, env: &mut DeviceCtx) {
    if qp.qp_type != QpType::Rc {
        return;
    }
    qp.resp.sack_peer = true;
    send(qp, env);
}

/// Responder: send a SACK (expected PSN, the packets held past it) to a requester that
/// asked for them.
pub(crate) fn send(qp: &mut QpCtx, env: &mut DeviceCtx) {
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
/// whatever forwards it; a SACK for each of the packets after a hole would tell the
/// requester nothing it acts on (it waits for [`DUP_THRESH`] of them).
pub(crate) fn on_held(qp: &mut QpCtx, env: &mut DeviceCtx, p: u32, ack_req: bool) {
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

/// Requester: a SACK from the peer saying it expects `e` and holds `bits` past it. The
/// loss recovery says which holes to resend (`Recovery::on_sack`); they are resent here,
/// at most [`RESENDS_PER_SACK`] of them, and a run of losses that shows congestion cuts
/// the window.
pub(crate) fn on_sack(qp: &mut QpCtx, env: &mut DeviceCtx, now: u64, e: u32, bits: SackBitmap) {
    if qp.qp_type != QpType::Rc || !matches!(qp.state, QpState::Rts | QpState::Sqd) {
        return;
    }
    // The answer to a SACK_PERMIT comes when nothing may be outstanding any more.
    if qp.req.rec.sack_arrived() {
        qp.req.cc.on_peer_sacks();
    }
    let Some(oldest) = qp.oldest_unacked() else {
        return;
    };
    let high = qp.req.high_psn;
    let rnr_wait = qp.req.rnr_until.is_some();
    let holes = match qp
        .req
        .rec
        .on_sack(e, bits, oldest, high, now, rnr_wait, &qp.req.rtt)
    {
        Ok(holes) => holes,
        Err(why) => {
            trace!(
                qpn = format_args!("{:#x}", qp.qpn),
                psn = e,
                oldest,
                high,
                "{why}"
            );
            return;
        }
    };
    env.stats.sacks_rcvd += 1;
    let mut resent = 0;
    let mut first = None;
    let mut burst = false;
    let mut congested = false;
    for h in holes {
        if resent >= RESENDS_PER_SACK {
            break;
        }
        if !requester::resend_one(qp, env, now, h.psn) {
            // A READ or atomic request (resent by a go-back-N), or nothing to resend.
            continue;
        }
        if qp.state == QpState::Err {
            return;
        }
        congested |= qp.req.rec.sack_hole_resent(h, now);
        burst |= h.run;
        env.stats.sack_resends += 1;
        first.get_or_insert(h.psn);
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
            qp.req.lost(Loss::Run(q));
        }
        // The round-trip timer now waits for the answer to these resends.
        qp.req.rec.disarm_rtt_timer();
        qp.arm_timers(now);
    }
}
