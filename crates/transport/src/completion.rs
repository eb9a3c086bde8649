//! Completion of send WQEs: in posting order as they finish, and all at once when the QP
//! fails (flushed, with the error of the first). Shared by the requester (local
//! operations, UC/UD sends, errors building a packet), the completer (acknowledged
//! requests, responses) and the responder (a fatal NAK it sends).

use tracing::warn;

use crate::device_ctx::DeviceCtx;
use crate::qp::{QpCtx, ReqState, SendWqe};
use crate::verbs::{
    AsyncEvent, QpState, SendFlags, WcDetail, WcError, WcOpcode, WcStatus, WorkCompletion,
};

/// The send completion of a WQE.
fn send_wc(qp: &QpCtx, w: &SendWqe, status: WcStatus) -> WorkCompletion {
    let failed = status != WcStatus::Success;
    let byte_len = if failed {
        0
    } else if w.is_atomic() {
        8
    } else {
        w.len as u32
    };
    // A flushed WQE has no error of its own, hence no detail.
    let detail = match w.status {
        Some(s) if s == status => w.detail,
        _ => WcDetail::Unspecified,
    };
    WorkCompletion {
        wr_id: w.wr.wr_id,
        status,
        opcode: w.wr.op.wc_opcode(),
        vendor_err: if failed { detail.code() } else { 0 },
        byte_len,
        qp_num: qp.qpn,
        ..Default::default()
    }
}

/// The WQE has finished. A READ or atomic keeps its place in the outstanding READ/atomic
/// window until it completes (see [`release_rd`]).
pub(crate) fn mark_done(w: &mut SendWqe) {
    w.done = true;
}

/// A completed WQE leaves the READ/atomic window. Not when it finishes: a READ after one
/// still missing responses can finish first (its responses are placed as they come),
/// and the responder remembers only the last `max_dest_rd_atomic` READs and atomics, so
/// the requester may not start another until the oldest has its responses, or the
/// responder would forget the one the requester still asks for again.
pub(crate) fn release_rd(req: &mut ReqState, w: &mut SendWqe) {
    if w.in_rd_window {
        w.in_rd_window = false;
        req.rd_atomic = req.rd_atomic.saturating_sub(1);
    }
}

/// Pop finished WQEs from the front of the SQ and report them, in posting order.
/// Successful ones only when signaled (or sq_sig_all); errors always.
pub(crate) fn complete_front(qp: &mut QpCtx, env: &mut DeviceCtx, now: u64) {
    let mut budget = qp.sq.len();
    while budget > 0 {
        budget -= 1;
        match qp.sq.front() {
            Some(w) if w.done => {}
            _ => break,
        }
        let Some(mut w) = qp.sq.pop_front() else {
            break;
        };
        if qp.req.cur == 0 {
            // The requester stood in this WQE (a rewind put it back there, and the window
            // or the outbox stopped it before it resent anything): the offset it kept
            // is this WQE's, not the next one's.
            qp.req.offset = 0;
        } else {
            qp.req.cur -= 1;
        }
        mark_done(&mut w);
        release_rd(&mut qp.req, &mut w);
        let status = w.status.unwrap_or(WcStatus::Success);
        if status != WcStatus::Success {
            // Errors are completed by `fail`, which also flushes; reaching here means a
            // WQE carries an error but the QP is not yet failed.
            qp.sq.push_front(w);
            qp.req.cur += 1;
            fail(qp, env, now, None, "a work request completed in error");
            return;
        }
        if qp.sq_sig_all || w.wr.flags.contains(SendFlags::SIGNALED) {
            let wc = send_wc(qp, &w, status);
            env.complete(qp.send_cq, wc, false, now);
        }
    }
    check_drained(qp, env);
}

/// In SQD, tell the consumer once the SQ has nothing in flight.
pub(crate) fn check_drained(qp: &mut QpCtx, env: &mut DeviceCtx) {
    if qp.state == QpState::Sqd
        && !qp.req.sqd_notified
        && !qp.sq.iter().any(|w| w.started && !w.done)
    {
        qp.req.sqd_notified = true;
        if qp.attr.en_sqd_async_notify {
            env.ctx.push_event(AsyncEvent::SqDrained(qp.qpn));
        }
    }
}

/// The QP fails: the first unfinished WQE gets `status` and its detail (if given), the QP
/// goes to ERR and everything outstanding and posted is flushed. `cause` says why, for the
/// log.
pub(crate) fn fail(
    qp: &mut QpCtx,
    env: &mut DeviceCtx,
    now: u64,
    status: Option<WcError>,
    cause: &'static str,
) {
    if let Some(s) = status {
        if let Some(w) = qp.sq.iter_mut().find(|w| !w.done || w.status.is_some()) {
            w.set_error(s);
        }
    }
    if qp.state != QpState::Err {
        warn!(
            qpn = format_args!("{:#x}", qp.qpn),
            from = ?qp.state,
            status = qp.sq.iter().find_map(|w| w.status).map(tracing::field::debug),
            wr_id = qp.sq.iter().find(|w| w.status.is_some()).map(|w| w.wr.wr_id),
            cause,
            "QP to ERROR"
        );
    }
    env.ctx.set_qp_error(qp.qpn);
    qp.state = QpState::Err;
    // Same-host peers stop reaching its memory through it, as packets would be refused.
    if let Some(sink) = env.grants.as_mut() {
        sink.qp(qp.qpn, None);
    }
    flush(qp, env, now);
}

/// Flush a QP in ERR: every SQ WQE completes (its own error status, else WR_FLUSH_ERR),
/// then the receive side (own RQ, and a receive WQE held for a message in progress; an
/// SRQ keeps its WQEs).
pub(crate) fn flush(qp: &mut QpCtx, env: &mut DeviceCtx, now: u64) {
    qp.state = QpState::Err;
    crate::liveness::disarm(qp);
    let sq = std::mem::take(&mut qp.sq);
    for w in &sq {
        let status = w.status.unwrap_or(WcStatus::WrFlushErr);
        let wc = send_wc(qp, w, status);
        env.complete(qp.send_cq, wc, false, now);
    }
    let next_psn = qp.req.next_psn;
    let high = qp.req.high_psn;
    qp.req = ReqState {
        next_psn,
        high_psn: high,
        ..Default::default()
    };
    if let Some(r) = qp.resp.recv.take() {
        let wc = WorkCompletion {
            wr_id: r.wr_id,
            status: WcStatus::WrFlushErr,
            opcode: WcOpcode::Recv,
            qp_num: qp.qpn,
            ..Default::default()
        };
        env.complete(qp.recv_cq, wc, false, now);
    }
    qp.resp.in_msg = None;
    qp.resp.ack = None;
    qp.resp.pending.clear();
    qp.resp.held.clear(&mut env.held_bytes);
    qp.resp.fatal = false;
    flush_rq(qp, env, now);
    if qp.has_srq {
        env.ctx.push_event(AsyncEvent::QpLastWqeReached(qp.qpn));
    }
}

/// Flush the QP's own receive queue with WR_FLUSH_ERR.
pub(crate) fn flush_rq(qp: &mut QpCtx, env: &mut DeviceCtx, now: u64) {
    if qp.has_srq {
        return;
    }
    let rq = match env.ctx.qp_mut(qp.qpn) {
        Some(q) => std::mem::take(&mut q.rq),
        None => return,
    };
    for r in rq {
        let wc = WorkCompletion {
            wr_id: r.wr_id,
            status: WcStatus::WrFlushErr,
            opcode: WcOpcode::Recv,
            qp_num: qp.qpn,
            ..Default::default()
        };
        env.complete(qp.recv_cq, wc, false, now);
    }
}
