//! Completer: processes ACKs, NAKs, READ responses and atomic ACKs, finishes the WQEs
//! they answer (completed in order by [`crate::completion`]), and runs the
//! retransmission and RNR timers, carrying out what the loss recovery
//! ([`crate::recovery`]) decides.

mod read;

use read::{ask_read_holes, read_response};
use softrdma_wire::{psn, Headers, NakCode, OpKind, Position, Syndrome};
use tracing::{debug, trace};

use crate::cc::Loss;
use crate::completion::{complete_front, fail, mark_done};
use crate::device_ctx::DeviceCtx;
use crate::qp::{rnr_timer_ns, QpCtx};
use crate::recovery::Repeat;
use crate::requester;
use crate::verbs::{QpState, WcDetail, WcError, WcStatus};

/// Go back N: resend from the oldest unacknowledged packet (same PSNs, same segmentation).
pub(crate) fn rewind(qp: &mut QpCtx) {
    let mtu = qp.mtu();
    qp.req.cur = 0;
    qp.req.offset = 0;
    qp.req.noack_pkts = 0;
    qp.req.rto = None;
    qp.req.rec.on_go_back_n();
    // Karn: the resent packets' acknowledgements may answer the first copies.
    qp.req.rtt.on_resend();
    // Finished READs and atomics waiting behind an unfinished one keep their places
    // in the window (see `release_rd`); the others are counted again as they are resent.
    for w in qp.sq.iter_mut() {
        if !w.done {
            w.in_rd_window = false;
            w.sent_all = false;
        }
    }
    qp.req.rd_atomic = qp.sq.iter().filter(|w| w.in_rd_window).count() as u32;
    if let Some(w) = qp.sq.front() {
        if w.started && !w.done && !w.is_rd_atomic() && !w.is_local() {
            qp.req.offset = (w.acked_pkts as usize).saturating_mul(mtu).min(w.len);
        }
    }
}

/// Whether any WQE has packets in flight.
fn outstanding(qp: &QpCtx) -> bool {
    qp.oldest_unacked().is_some()
}

/// What an acknowledgement up to a PSN found.
enum Acked {
    /// Whether anything new was acknowledged.
    Ok(bool),
    /// It covers a READ/atomic whose response never came: those were lost. The flag says
    /// whether WQEs before that READ/atomic were newly acknowledged on the way (progress,
    /// which renews the retries as any other progress does).
    LostResponse(bool),
}

/// Apply an acknowledgement of every request packet before `p` (and `p` itself when
/// `inclusive`): SEND/WRITE WQEs it covers are done; a partly covered one records the
/// packets that arrived.
fn ack_upto(qp: &mut QpCtx, p: u32, inclusive: bool) -> Acked {
    let mut progress = false;
    let req = &mut qp.req;
    for w in qp.sq.iter_mut() {
        if w.done {
            continue;
        }
        if !w.started || w.is_local() {
            break;
        }
        let covered = if inclusive {
            psn::le(w.last_psn, p)
        } else {
            psn::lt(w.last_psn, p)
        };
        if w.is_rd_atomic() {
            let some = w.acked_pkts > 0 || !w.read_ooo.is_empty();
            if covered && some && w.is_read() {
                // A READ the responder executed, some of whose responses are missing:
                // those were lost, and are asked for alone (after the response at hand).
                w.read_whole_sent = true;
                req.rec.read_repair_needed();
                continue;
            }
            if covered {
                return Acked::LostResponse(progress);
            }
            break;
        }
        if covered {
            mark_done(w);
            progress = true;
            continue;
        }
        let d = psn::diff(p, w.first_psn) + i32::from(inclusive);
        if d > 0 && (d as u32) > w.acked_pkts {
            w.acked_pkts = (d as u32).min(w.npkts);
            progress = true;
        }
        break;
    }
    Acked::Ok(progress)
}

/// Count a transport retry; false (and the QP failed with RETRY_EXC_ERR) when none are left.
fn use_retry(qp: &mut QpCtx, env: &mut DeviceCtx, now: u64, cause: &'static str) -> bool {
    if qp.req.retry_left == 0 {
        let e = WcError::new(WcStatus::RetryExcErr, WcDetail::RetryExceeded);
        fail(qp, env, now, Some(e), cause);
        return false;
    }
    qp.req.retry_left -= 1;
    true
}

/// Progress: a later loss is a new one, with its own go-back-N and a fresh retry count.
fn renew_retries(qp: &mut QpCtx) {
    qp.req.rec.on_progress();
    qp.req.retry_left = qp.attr.retry_cnt;
    qp.req.rnr_left = qp.attr.rnr_retry;
}

/// A response arrived past a READ/atomic response that never did: keep the progress the
/// acknowledgement made (it renews the retries, as rxe does) and ask again from the lost one.
fn on_lost_response(qp: &mut QpCtx, env: &mut DeviceCtx, now: u64, progress: bool) {
    if progress {
        renew_retries(qp);
    }
    if retry_from_response(qp, env, now, "response past a lost READ/atomic response") {
        after_response(qp, env, now, false);
    }
}

/// Go back N because a response showed a loss (sequence NAK, or an ACK past a READ or
/// atomic that got no response). Once such a retry started, further evidence of the same
/// loss (the ACKs and NAKs already on their way) is ignored until progress is made, as
/// rxe does with `started_retry`; otherwise one loss would burn several retries. False if
/// the QP failed for lack of retries. `why` names the evidence, for the log.
fn retry_from_response(qp: &mut QpCtx, env: &mut DeviceCtx, now: u64, why: &'static str) -> bool {
    if qp.req.rec.is_retrying() {
        return true;
    }
    if !use_retry(qp, env, now, "retry count exceeded after a loss") {
        return false;
    }
    debug!(
        qpn = format_args!("{:#x}", qp.qpn),
        psn = qp.oldest_unacked(),
        retries_left = qp.req.retry_left,
        why,
        "go back N"
    );
    // Once per window of packets, and only while the round trip shows queueing, as for
    // a selective repeat: a go-back-N answers one lost packet (a READ's request, a
    // response) as often as a congested path, and a cut at each collapsed the window.
    if let Some(oldest) = qp.oldest_unacked() {
        qp.req.lost(Loss::Packet(oldest));
    }
    rewind(qp);
    qp.req.rec.start_retry();
    true
}

/// Selective repeat after a sequence NAK for `k`: resend only packet `k` and keep
/// sending new ones, unless the peer is known to drop what follows a gap (then go back
/// N, as the IBTA requester does). A softrdma responder holds the packets past a gap
/// (`qp::Held`), so one loss costs one packet instead of a window; whether the peer
/// does is learnt from the answer to this resend (see [`sr_answered`]). False when the
/// caller should go back N: the peer drops, a go-back-N or an RNR wait is under way,
/// nothing was sent after `k`, or `k` is a READ or atomic request. `cut`: the loss
/// counts against the window here (the round-trip timer counted it already).
fn selective_repeat(qp: &mut QpCtx, env: &mut DeviceCtx, now: u64, k: u32, cut: bool) -> bool {
    let rnr_wait = qp.req.rnr_until.is_some();
    match qp.req.rec.selective_repeat(k, now, rnr_wait, &qp.req.rtt) {
        Repeat::GoBackN => return false,
        Repeat::InFlight => {
            qp.arm_timers(now);
            return true;
        }
        Repeat::Resend => {}
    }
    let high = qp.req.high_psn;
    if !psn::lt(psn::add(k, 1), high)
        || !(requester::resend_one(qp, env, now, k)
            || resend_lost_read_request(qp, env, now, k, cut))
    {
        return false;
    }
    if qp.state == QpState::Err {
        return true;
    }
    // Like the round-trip timer's resend, this one spends no retry: the local ACK
    // timeout, run from the last progress, still ends a connection that makes none.
    debug!(
        qpn = format_args!("{:#x}", qp.qpn),
        psn = k,
        "selective repeat"
    );
    if qp.req.rec.hole_resent(k, now, cut) {
        qp.req.lost(Loss::Packet(k));
    }
    qp.arm_timers(now);
    true
}

/// Resend the request of the READ whose first PSN is `k` and of which no response has
/// arrived: its request was lost, and a peer that holds packets past a gap has the
/// requests after it. False for anything else, and, with a peer not known to hold,
/// unless a sequence NAK (`from_nak`) asks for it once the round trip is measured: the
/// answer to this resend (its READ's responses) cannot show that the peer dropped the
/// rest, as an ACK of a resent packet does (see [`sr_answered`]); only the round-trip
/// timer does, when nothing follows them (see [`on_timers`]). Without a measure that
/// would be the local ACK timeout, and a resend the timer made is not a question asked
/// (no sequence NAK named the packet), so nothing would be learnt from it.
fn resend_lost_read_request(
    qp: &mut QpCtx,
    env: &mut DeviceCtx,
    now: u64,
    k: u32,
    from_nak: bool,
) -> bool {
    if !qp.req.rec.may_resend_read_request(from_nak, &qp.req.rtt) {
        return false;
    }
    let Some(w) = qp.unfinished_at(k) else {
        return false;
    };
    if !w.is_read() || w.acked_pkts > 0 || !w.read_ooo.is_empty() {
        return false;
    }
    let n = w.npkts;
    requester::resend_read_part(qp, env, now, k, 0, n)
}

/// The peer's answer to the selective resend of the hole, if this response (an ACK of
/// `p`, or a NAK at `p`) is it: true when the peer kept nothing past the hole, and the
/// caller goes back N (see `Recovery::answered`).
fn sr_answered(qp: &mut QpCtx, now: u64, p: u32, nak: bool) -> bool {
    let high = qp.req.high_psn;
    qp.req.rec.answered(p, nak, high, now, &mut qp.req.rtt)
}

/// A response (ACK, NAK, READ response, atomic ACK) for an RC QP, from UDP port
/// `src_port` of the peer's address.
pub(crate) fn handle_response(
    qp: &mut QpCtx,
    env: &mut DeviceCtx,
    now: u64,
    src_port: u16,
    h: &Headers,
    payload: &[u8],
) {
    let Some(info) = h.bth.opcode.info() else {
        dropped!(debug, env, qp, h, malformed, "unknown opcode");
        return;
    };
    let p = h.bth.psn;
    // Only a response inside the outstanding window [oldest unacknowledged, highest
    // sent) can be the peer's answer to something in flight (IBTA 9.7.5.1: an ACK or NAK
    // outside it is ignored). Past the highest PSN handed to the wire (even if assigned to
    // a WQE still being segmented) it answers nothing we sent; before the oldest
    // unacknowledged one it is stale (a late duplicate) or forged, and acting on it, a
    // fatal NAK above all, would end a working connection.
    let Some(oldest) = qp.oldest_unacked() else {
        let ack = matches!(h.aeth.map(|a| a.syndrome), Some(Syndrome::Ack { .. }));
        if ack && crate::liveness::answers_probe(qp, p) {
            // The peer answered a keepalive probe (which the caller counted as hearing
            // from it): nothing to complete.
            env.stats.keepalive_acks += 1;
            trace!(
                qpn = format_args!("{:#x}", qp.qpn),
                psn = p,
                "keepalive probe answered"
            );
            return;
        }
        dropped!(
            trace,
            env,
            qp,
            h,
            duplicates,
            "response to no outstanding request"
        );
        return;
    };
    if !psn::lt(p, qp.req.high_psn) {
        let high = qp.req.high_psn;
        dropped!(debug, env, qp, h, dropped, "response to a PSN never sent"; high_psn = high);
        return;
    }
    if psn::lt(p, oldest) {
        dropped!(trace, env, qp, h, duplicates, "response older than the outstanding window"; oldest);
        return;
    }
    qp.learn_peer_port(src_port);
    // Whatever it then starts (a go-back-N above all), the answer first measures the
    // round trip of the packet being timed if it covers it. A NAK acknowledges only what
    // precedes its PSN; a READ response or atomic ACK answers its own PSN.
    let inclusive = !matches!(
        h.aeth.map(|a| a.syndrome),
        Some(Syndrome::Nak(_) | Syndrome::RnrNak { .. })
    );
    qp.req.rtt.on_answer(p, inclusive, now);
    let mut progress = false;
    match info.kind {
        OpKind::Acknowledge => {
            let Some(aeth) = h.aeth else {
                dropped!(debug, env, qp, h, malformed, "acknowledge without an AETH");
                return;
            };
            match aeth.syndrome {
                Syndrome::Ack { .. } => {
                    let dropped_rest = sr_answered(qp, now, p, false);
                    match ack_upto(qp, p, true) {
                        Acked::Ok(pr) => progress = pr,
                        Acked::LostResponse(pr) => {
                            if pr {
                                renew_retries(qp);
                            }
                            if !retry_from_response(
                                qp,
                                env,
                                now,
                                "ACK past a lost READ/atomic response",
                            ) {
                                return;
                            }
                        }
                    }
                    if dropped_rest && !qp.req.rec.is_retrying() {
                        // The resent hole arrived, nothing after it did: go back N from
                        // there (the retry was spent on the hole).
                        debug!(
                            qpn = format_args!("{:#x}", qp.qpn),
                            psn = psn::add(p, 1),
                            "peer kept nothing past the hole: go back N"
                        );
                        complete_front(qp, env, now);
                        if qp.state == QpState::Err {
                            return;
                        }
                        rewind(qp);
                        qp.req.rec.start_retry();
                    }
                }
                Syndrome::RnrNak { timer } => {
                    env.stats.rnr_naks_rcvd += 1;
                    if let Acked::Ok(true) | Acked::LostResponse(true) = ack_upto(qp, p, false) {
                        // Progress before the NAK'd packet renews the transport retries.
                        qp.req.retry_left = qp.attr.retry_cnt;
                    }
                    complete_front(qp, env, now);
                    if qp.state == QpState::Err {
                        return;
                    }
                    if qp.attr.rnr_retry != 7 {
                        if qp.req.rnr_left == 0 {
                            fail(
                                qp,
                                env,
                                now,
                                Some(WcError::new(
                                    WcStatus::RnrRetryExcErr,
                                    WcDetail::RnrRetryExceeded,
                                )),
                                "RNR retry count exceeded",
                            );
                            return;
                        }
                        qp.req.rnr_left -= 1;
                    }
                    debug!(
                        qpn = format_args!("{:#x}", qp.qpn),
                        psn = p,
                        timer,
                        wait_ns = rnr_timer_ns(timer),
                        rnr_retries_left = qp.req.rnr_left,
                        "RNR NAK received; waiting before resending"
                    );
                    rewind(qp);
                    // The resend waits for the RNR timer: an answer to it measures that
                    // wait, not the round trip.
                    qp.req.rtt.stop_timing();
                    qp.req.rnr_until = Some(now.saturating_add(rnr_timer_ns(timer)));
                    return;
                }
                Syndrome::Nak(code) => {
                    debug!(
                        qpn = format_args!("{:#x}", qp.qpn),
                        psn = p,
                        kind = ?code,
                        "NAK received"
                    );
                    match code {
                        NakCode::PsnSequenceError => env.stats.naks_rcvd_seq += 1,
                        NakCode::InvalidRequest | NakCode::InvalidRdRequest => {
                            env.stats.naks_rcvd_inv += 1
                        }
                        NakCode::RemoteAccessError => env.stats.naks_rcvd_access += 1,
                        NakCode::RemoteOperationalError => env.stats.naks_rcvd_op += 1,
                    }
                    let acked = ack_upto(qp, p, false);
                    let lost = matches!(acked, Acked::LostResponse(_));
                    if let Acked::Ok(true) | Acked::LostResponse(true) = acked {
                        // The NAK acknowledges everything before it: progress, so this is
                        // a new loss that deserves its own go-back-N and fresh retries,
                        // and the local ACK timeout starts over (a responder that holds
                        // packets past gaps may acknowledge for a long while by NAKs
                        // only).
                        renew_retries(qp);
                        progress = true;
                    }
                    complete_front(qp, env, now);
                    if qp.state == QpState::Err {
                        return;
                    }
                    let status = match code {
                        NakCode::PsnSequenceError => None,
                        NakCode::InvalidRequest => Some(WcError::new(
                            WcStatus::RemInvReqErr,
                            WcDetail::RemoteInvalidRequest,
                        )),
                        NakCode::RemoteAccessError => {
                            Some(WcError::new(WcStatus::RemAccessErr, WcDetail::RemoteAccess))
                        }
                        NakCode::RemoteOperationalError => Some(WcError::new(
                            WcStatus::RemOpErr,
                            WcDetail::RemoteOperational,
                        )),
                        NakCode::InvalidRdRequest => Some(WcError::new(
                            WcStatus::RemInvRdReqErr,
                            WcDetail::RemoteInvalidRdRequest,
                        )),
                    };
                    let selective = status.is_none() && !lost && {
                        sr_answered(qp, now, p, true);
                        selective_repeat(qp, env, now, p, true)
                    };
                    match status {
                        Some(s) if !lost => {
                            fail(qp, env, now, Some(s), "NAK received");
                            return;
                        }
                        _ if selective => {}
                        _ => {
                            let why = if lost {
                                "NAK past a lost READ/atomic response"
                            } else {
                                "PSN sequence error NAK"
                            };
                            if !retry_from_response(qp, env, now, why) {
                                return;
                            }
                        }
                    }
                }
            }
        }
        OpKind::ReadResponse => {
            let lost = match ack_upto(qp, p, false) {
                Acked::Ok(pr) => {
                    progress = pr;
                    None
                }
                Acked::LostResponse(pr) => Some(pr),
            };
            // When an earlier READ or atomic got no response (those were lost, and go
            // back N asks again), this response is good all the same: kept, or every
            // go-back-N would ask for its whole READ again, and under heavy loss the
            // responder's budget for re-executions (see `qp::READ_REPLAY_FACTOR`) would
            // run out before one got through.
            progress |= read_response(qp, env, now, h, info.position, payload);
            if qp.state == QpState::Err {
                return;
            }
            if let Some(pr) = lost {
                return on_lost_response(qp, env, now, pr);
            }
        }
        OpKind::AtomicAcknowledge => {
            match ack_upto(qp, p, false) {
                Acked::Ok(pr) => progress = pr,
                Acked::LostResponse(pr) => return on_lost_response(qp, env, now, pr),
            }
            let mtu_ok = h.atomic_ack.is_some();
            if let (true, Some(orig)) = (mtu_ok, h.atomic_ack.map(|a| a.orig)) {
                let pd = qp.pd;
                if let Some(w) = qp.sq.iter_mut().find(|w| !w.done) {
                    if w.started && w.is_atomic() && w.first_psn == p {
                        match env.ctx.scatter(pd, &w.wr.sg_list, 0, &orig.to_ne_bytes()) {
                            Ok(()) => {
                                mark_done(w);
                                progress = true;
                            }
                            Err(s) => {
                                w.set_error(s);
                                fail(
                                    qp,
                                    env,
                                    now,
                                    None,
                                    "atomic result not written to local memory",
                                );
                                return;
                            }
                        }
                    }
                }
            }
        }
        _ => {
            dropped!(debug, env, qp, h, dropped, "not a response opcode");
            return;
        }
    }
    after_response(qp, env, now, progress);
}

/// After a response: ask for what READs are missing, complete what finished, re-arm
/// the timer, keep sending.
fn after_response(qp: &mut QpCtx, env: &mut DeviceCtx, now: u64, progress: bool) {
    if qp.req.rec.take_read_repair() {
        let whole: Vec<u32> = qp
            .sq
            .iter()
            .take_while(|w| w.started)
            .filter(|w| !w.done && w.read_whole_sent)
            .map(|w| w.first_psn)
            .collect();
        for first in whole {
            ask_read_holes(qp, env, now, first);
            if qp.state == QpState::Err {
                return;
            }
        }
    }
    complete_front(qp, env, now);
    if qp.state == QpState::Err {
        return;
    }
    let una = qp.oldest_unacked().unwrap_or(qp.req.high_psn);
    qp.req.acked_to(una, now);
    if progress {
        renew_retries(qp);
        qp.req.rto = None;
        qp.req.rec.disarm_rtt_timer();
    }
    if !outstanding(qp) {
        qp.req.rto = None;
        qp.req.rec.disarm_rtt_timer();
    } else {
        qp.arm_timers(now);
    }
    crate::sack::maybe_permit(qp, env, now);
    requester::run(qp, env, now);
}

/// Fire due timers of one QP. Returns true when the keepalive found the peer lost (the
/// QP failed): the caller reports it.
pub(crate) fn on_timers(qp: &mut QpCtx, env: &mut DeviceCtx, now: u64) -> bool {
    if crate::liveness::on_timer(qp, env, now) {
        fail(qp, env, now, None, "peer lost: keepalive probes unanswered");
        return true;
    }
    if qp.req.rnr_until.is_some_and(|t| t <= now) {
        qp.req.rnr_until = None;
        trace!(qpn = format_args!("{:#x}", qp.qpn), "RNR wait over");
        if matches!(qp.state, QpState::Rts | QpState::Sqd) {
            requester::run(qp, env, now);
        }
    }
    let running = matches!(qp.state, QpState::Rts | QpState::Sqd) && outstanding(qp);
    if qp.req.rec.take_rtt_expiry(now, qp.req.rto) && running {
        env.stats.rtt_timeouts += 1;
        let rtt = &qp.req.rtt;
        let (srtt, min_rtt, backoff) = (rtt.smoothed(), rtt.min(), rtt.backoff());
        let cwnd = qp.req.cc.window();
        // Cut and backed off only when the path has gone quiet.
        let cut = qp.req.lost(Loss::RttTimeout(now));
        debug!(
            qpn = format_args!("{:#x}", qp.qpn),
            psn = qp.oldest_unacked(),
            cwnd,
            srtt_us = srtt / 1000,
            min_rtt_us = min_rtt / 1000,
            backoff,
            cut,
            "retransmission timer (round trip) expired; resending"
        );
        // The local ACK timeout keeps running from the last progress.
        let rto = qp.req.rto;
        let oldest = qp.oldest_unacked();
        if let Some(k) = qp.req.rec.on_rtt_timeout(oldest) {
            if selective_repeat(qp, env, now, k, false) {
                qp.req.rto = rto;
                if qp.state != QpState::Err {
                    requester::run(qp, env, now);
                }
                return false;
            }
        }
        rewind(qp);
        qp.req.rto = rto;
        qp.req.rec.start_retry();
        requester::run(qp, env, now);
    }
    if qp.req.rto.is_some_and(|t| t <= now) {
        qp.req.rto = None;
        qp.req.rec.disarm_rtt_timer();
        if !matches!(qp.state, QpState::Rts | QpState::Sqd) || !outstanding(qp) {
            return false;
        }
        env.stats.timeouts += 1;
        qp.req.lost(Loss::AckTimeout);
        debug!(
            qpn = format_args!("{:#x}", qp.qpn),
            psn = qp.oldest_unacked(),
            retries_left = qp.req.retry_left,
            "retransmission timeout"
        );
        if use_retry(
            qp,
            env,
            now,
            "retry count exceeded: no ACK before the timeout",
        ) {
            rewind(qp);
            qp.req.rec.start_retry();
            requester::run(qp, env, now);
        }
    }
    false
}
