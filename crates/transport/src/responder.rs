//! Responder: sequence checks, duplicate handling (re-ACK, READ re-execution, atomic
//! replay), rkey / access / bounds checks, execution of SEND / WRITE / READ / atomics,
//! receive completions, and ACK / NAK / READ response / atomic ACK generation.
//!
//! This module runs the RC request path; [`respond`] sends what it answers,
//! [`duplicate`] answers requests it executed before, and [`unreliable`] serves UC and
//! UD.

mod duplicate;
mod respond;
mod unreliable;

use duplicate::{duplicate, spend_replayed};
use respond::{emit_aeth, respond, schedule_ack, send_aeth};
pub(crate) use respond::{flush_ack, send_waiting_responses};
use unreliable::{uc_request, ud_request};

use softrdma_wire::{
    self as wire, psn, Addrs, Aeth, AtomicAckEth, Bth, Headers, NakCode, OpKind, Opcode, Position,
    Syndrome, AETH_CREDITS_INVALID, GRH_LEN,
};

use crate::completion;
use crate::device_ctx::DeviceCtx;
use crate::qp::{
    HeldPkt, InMsg, Pending, QpCtx, ReplayBudget, Resource, ATOMIC_REPLAY_MIN, HOLD_SPAN,
    OUTBOX_MAX, READ_STREAMS_MAX,
};
use crate::verbs::{
    Access, QpType, RecvWr, RemoteKeyError, WcError, WcFlags, WcOpcode, WcStatus, WorkCompletion,
};
use tracing::{debug, trace};

/// A request packet for this QP (service type, state and peer already checked), that
/// came with IP TOS `tos`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn handle_request(
    qp: &mut QpCtx,
    env: &mut DeviceCtx,
    now: u64,
    addrs: &Addrs,
    tos: u8,
    h: &Headers,
    payload: &[u8],
    udp_len: usize,
    placed: bool,
) {
    match qp.qp_type {
        QpType::Ud => ud_request(qp, env, now, addrs, tos, h, payload, udp_len),
        QpType::Uc => {
            // UC takes any PSN, but only the peer knows the expected one: a packet
            // carrying it names the port.
            if h.bth.psn == qp.resp.epsn {
                qp.learn_peer_port(addrs.src.port());
            }
            uc_request(qp, env, now, h, payload)
        }
        QpType::Rc => rc_request(qp, env, now, addrs.src.port(), h, payload, placed),
    }
}

/// A class A/C error (IBTA 9.9.3): NAK `p`, complete a held receive WQE with `recv_status`,
/// and the responder QP goes to ERR — once the responses owed before it are sent (new
/// requests are dropped meanwhile). `reason` says what was wrong, for the log.
fn fatal_nak(
    qp: &mut QpCtx,
    env: &mut DeviceCtx,
    now: u64,
    code: NakCode,
    p: u32,
    recv_status: Option<WcError>,
    reason: &'static str,
) {
    match code {
        NakCode::PsnSequenceError => env.stats.naks_sent_seq += 1,
        NakCode::InvalidRequest | NakCode::InvalidRdRequest => env.stats.naks_sent_inv += 1,
        NakCode::RemoteAccessError => env.stats.naks_sent_access += 1,
        NakCode::RemoteOperationalError => env.stats.naks_sent_op += 1,
    }
    debug!(
        qpn = format_args!("{:#x}", qp.qpn),
        psn = p,
        kind = ?code,
        recv_status = recv_status.map(tracing::field::debug),
        reason,
        "NAK sent"
    );
    if let (Some(s), Some(r)) = (recv_status, qp.resp.recv.take()) {
        let mut wc = recv_wc(qp, &r, s.status);
        wc.vendor_err = s.detail.code();
        env.complete(qp.recv_cq, wc, false, now);
    }
    if qp.resp.pending.is_empty() {
        flush_ack(qp, env);
        let msn = qp.resp.msn;
        emit_aeth(qp, env, p, msn, Syndrome::Nak(code));
        completion::fail(qp, env, now, None, reason);
    } else {
        qp.resp.fatal = true;
        let msn = qp.resp.msn;
        respond(
            qp,
            env,
            now,
            Pending::Aeth {
                psn: p,
                msn,
                syndrome: Syndrome::Nak(code),
                fatal: true,
            },
        );
    }
}

fn rnr_nak(qp: &mut QpCtx, env: &mut DeviceCtx, now: u64, p: u32) {
    env.stats.rnr_naks_sent += 1;
    let timer = qp.attr.min_rnr_timer & 0x1F;
    debug!(
        qpn = format_args!("{:#x}", qp.qpn),
        psn = p,
        timer,
        "RNR NAK sent: no receive WQE posted"
    );
    send_aeth(qp, env, now, p, Syndrome::RnrNak { timer });
}

fn recv_wc(qp: &QpCtx, r: &RecvWr, status: WcStatus) -> WorkCompletion {
    WorkCompletion {
        wr_id: r.wr_id,
        status,
        opcode: WcOpcode::Recv,
        qp_num: qp.qpn,
        src_qp: if qp.qp_type == QpType::Ud {
            0
        } else {
            qp.attr.dest_qp_num
        },
        ..Default::default()
    }
}

fn kind_access(kind: OpKind) -> Access {
    match kind {
        OpKind::Write => Access::REMOTE_WRITE,
        OpKind::ReadRequest => Access::REMOTE_READ,
        OpKind::Atomic => Access::REMOTE_ATOMIC,
        _ => Access::empty(),
    }
}

/// Payload length rules per position (IBTA 9.7.7 / rxe check_length).
fn length_ok(position: Position, plen: usize, mtu: usize, has_payload: bool) -> bool {
    if !has_payload {
        return plen == 0;
    }
    match position {
        Position::First | Position::Middle => plen == mtu,
        Position::Last => plen > 0 && plen <= mtu,
        Position::Only => plen <= mtu,
    }
}

/// `placed`: a placed WRITE, whose payload is in our memory already (see
/// [`softrdma_wire::ext::PLACED_WRITE`]).
fn rc_request(
    qp: &mut QpCtx,
    env: &mut DeviceCtx,
    now: u64,
    src_port: u16,
    h: &Headers,
    payload: &[u8],
    placed: bool,
) {
    let in_order = h.bth.psn == qp.resp.epsn;
    rc_request_one(qp, env, now, src_port, h, payload, placed);
    if in_order && !qp.resp.held.is_empty() {
        drain_held(qp, env, now);
    }
}

/// Execute the held packets that now follow in order (see [`crate::qp::Held`]), then
/// report where the next gap is: a NAK when packets past it are held (they show it is a
/// loss, and the requester resends the missing one at once), an ACK of the last one
/// executed otherwise.
fn drain_held(qp: &mut QpCtx, env: &mut DeviceCtx, now: u64) {
    let mut last = None;
    while let Some(pkt) = qp.resp.held.take(qp.resp.epsn, &mut env.held_bytes) {
        let before = qp.resp.epsn;
        rc_request_one(qp, env, now, pkt.src_port, &pkt.h, &pkt.payload, pkt.placed);
        let (psn, kind) = (pkt.h.bth.psn, pkt.h.bth.opcode.info().map(|i| i.kind));
        env.recycle(pkt.payload);
        if qp.resp.epsn == before || qp.resp.fatal || qp.state == crate::verbs::QpState::Err {
            // Not executed (no receive WQE, an error): the requester resends from there.
            qp.resp.held.clear(&mut env.held_bytes);
            return;
        }
        last = Some((psn, kind));
    }
    let epsn = qp.resp.epsn;
    qp.resp.held.purge_before(epsn, &mut env.held_bytes);
    if !qp.resp.held.is_empty() {
        // The NAK acknowledges everything before it, the coalesced ACK included.
        qp.resp.ack = None;
        qp.resp.nak_sent = true;
        env.stats.naks_sent_seq += 1;
        debug!(
            qpn = format_args!("{:#x}", qp.qpn),
            psn = epsn,
            kind = ?NakCode::PsnSequenceError,
            "NAK sent (packets past the gap held)"
        );
        // No SACK beside it: the SACKs that showed the holes still describe what is
        // held past this one, and the NAK says how far the hold drained.
        send_aeth(qp, env, now, epsn, Syndrome::Nak(NakCode::PsnSequenceError));
    } else if let Some((p, Some(OpKind::Send | OpKind::Write))) = last {
        // Held packets asked for no ACK of their own: acknowledge the last, so that the
        // requester sees at once how far the filled gap took it.
        schedule_ack(qp, env, p);
    }
}

fn rc_request_one(
    qp: &mut QpCtx,
    env: &mut DeviceCtx,
    now: u64,
    src_port: u16,
    h: &Headers,
    payload: &[u8],
    placed: bool,
) {
    let Some(info) = h.bth.opcode.info() else {
        return;
    };
    if qp.resp.fatal {
        // A fatal NAK waits behind READ responses: the QP is failing.
        dropped!(
            debug,
            env,
            qp,
            h,
            dropped,
            "QP failing: a fatal NAK waits to be sent"
        );
        return;
    }
    let p = h.bth.psn;
    let d = psn::diff(p, qp.resp.epsn);
    if d > 0 {
        // Only the first packet past a loss gets a NAK; the rest of the burst is routine.
        let epsn = qp.resp.epsn;
        // Held only from the port the peer was learnt on: holding takes a packet for
        // genuine later, as the in-order path does.
        let held = d < HOLD_SPAN && qp.peer_port == Some(src_port) && {
            // A buffer from the transmit pool, which the drain gives back: on a lossy
            // path most packets pass through here.
            let mut copy = env.take_buf(payload.len());
            copy.copy_from_slice(payload);
            let pkt = HeldPkt {
                h: *h,
                payload: copy,
                src_port,
                placed,
            };
            qp.resp.held.insert(p, pkt, &mut env.held_bytes)
        };
        if held {
            env.stats.held += 1;
            crate::sack::on_held(qp, env, p, h.bth.ack_req);
        }
        if qp.resp.nak_sent {
            let why = "PSN ahead of the expected one (NAK already sent)";
            dropped!(trace, env, qp, h, out_of_sequence, why; epsn);
        } else {
            dropped!(debug, env, qp, h, out_of_sequence, "PSN ahead of the expected one"; epsn);
        }
        if !qp.resp.nak_sent {
            qp.resp.nak_sent = true;
            env.stats.naks_sent_seq += 1;
            debug!(
                qpn = format_args!("{:#x}", qp.qpn),
                psn = qp.resp.epsn,
                kind = ?NakCode::PsnSequenceError,
                "NAK sent"
            );
            let e = qp.resp.epsn;
            send_aeth(qp, env, now, e, Syndrome::Nak(NakCode::PsnSequenceError));
        }
        return;
    }
    if d < 0 {
        trace!(
            qpn = format_args!("{:#x}", qp.qpn),
            psn = p,
            epsn = qp.resp.epsn,
            opcode = %h.bth.opcode,
            counter = "duplicates",
            "duplicate request"
        );
        env.stats.duplicates += 1;
        duplicate(qp, env, now, h, info.kind);
        return;
    }
    qp.resp.nak_sent = false;
    // The expected PSN, which only the peer (or someone who sees its traffic) knows.
    qp.learn_peer_port(src_port);

    // Opcode sequence: FIRST opens a message that only MIDDLE/LAST of its kind continue.
    let seq_ok = matches!(
        (qp.resp.in_msg, info.kind, info.position),
        (None, _, Position::First | Position::Only)
            | (
                Some(InMsg::Send),
                OpKind::Send,
                Position::Middle | Position::Last
            )
            | (
                Some(InMsg::Write { .. }),
                OpKind::Write,
                Position::Middle | Position::Last
            )
    );
    if !seq_ok {
        fatal_nak(
            qp,
            env,
            now,
            NakCode::InvalidRequest,
            p,
            Some(WcStatus::RemInvReqErr.into()),
            "opcode out of sequence within a message",
        );
        return;
    }
    // A QP not enabled for the operation: remote access error, as hardware reports it
    // (rxe answers invalid request here).
    let need = kind_access(info.kind);
    if !need.is_empty() && !qp.attr.qp_access_flags.contains(need) {
        fatal_nak(
            qp,
            env,
            now,
            NakCode::RemoteAccessError,
            p,
            None,
            "operation not enabled in the QP's access flags",
        );
        return;
    }
    if !placed && !length_ok(info.position, payload.len(), qp.mtu(), info.has_payload) {
        fatal_nak(
            qp,
            env,
            now,
            NakCode::InvalidRequest,
            p,
            Some(WcStatus::RemInvReqErr.into()),
            "payload length wrong for its position",
        );
        return;
    }
    match info.kind {
        OpKind::Send => {
            if rc_send(qp, env, now, h, info.position, payload) && h.bth.ack_req {
                schedule_ack(qp, env, p);
            }
        }
        OpKind::Write => {
            if rc_write(qp, env, now, h, info.position, payload, placed) && h.bth.ack_req {
                schedule_ack(qp, env, p);
            }
        }
        OpKind::ReadRequest => rc_read(qp, env, now, h),
        OpKind::Atomic => rc_atomic(qp, env, now, h),
        _ => {
            dropped!(debug, env, qp, h, dropped, "not a request opcode")
        }
    }
}

/// Complete a receive WQE for a finished SEND (or WRITE with immediate).
fn complete_recv(
    qp: &QpCtx,
    env: &mut DeviceCtx,
    now: u64,
    r: &RecvWr,
    h: &Headers,
    opcode: WcOpcode,
    byte_len: usize,
) {
    let mut wc = recv_wc(qp, r, WcStatus::Success);
    wc.opcode = opcode;
    wc.byte_len = byte_len as u32;
    if let Some(imm) = h.imm {
        wc.wc_flags |= WcFlags::WITH_IMM;
        wc.imm_data = imm;
    }
    if let Some(rkey) = h.ieth {
        wc.wc_flags |= WcFlags::WITH_INV;
        wc.imm_data = rkey;
    }
    env.complete(qp.recv_cq, wc, h.bth.solicited, now);
}

/// SEND packet in sequence. Returns true if accepted (epsn advanced).
fn rc_send(
    qp: &mut QpCtx,
    env: &mut DeviceCtx,
    now: u64,
    h: &Headers,
    position: Position,
    payload: &[u8],
) -> bool {
    let p = h.bth.psn;
    if matches!(position, Position::First | Position::Only) {
        if qp.resp.recv.is_none() {
            match env.ctx.take_recv(qp.qpn) {
                Some(r) => qp.resp.recv = Some(r),
                None => {
                    rnr_nak(qp, env, now, p);
                    return false;
                }
            }
        }
        qp.resp.offset = 0;
    }
    let Some(r) = qp.resp.recv.as_ref() else {
        fatal_nak(
            qp,
            env,
            now,
            NakCode::InvalidRequest,
            p,
            None,
            "SEND continues no message with a receive WQE",
        );
        return false;
    };
    if !payload.is_empty() {
        if let Err(s) = env.ctx.scatter(qp.pd, &r.sg_list, qp.resp.offset, payload) {
            let code = if s.status == WcStatus::LocLenErr {
                NakCode::InvalidRequest
            } else {
                NakCode::RemoteOperationalError
            };
            fatal_nak(
                qp,
                env,
                now,
                code,
                p,
                Some(s),
                "SEND not placed in the receive WQE",
            );
            return false;
        }
    }
    qp.resp.offset += payload.len();
    qp.resp.epsn = psn::add(p, 1);
    if matches!(position, Position::Last | Position::Only) {
        if let Some(rkey) = h.ieth {
            if let Err(s) = env.ctx.invalidate_rkey(qp.pd, rkey) {
                fatal_nak(
                    qp,
                    env,
                    now,
                    NakCode::InvalidRequest,
                    p,
                    Some(s.into()),
                    "SEND with invalidate of an rkey it may not invalidate",
                );
                return false;
            }
        }
        qp.resp.msn = psn::add(qp.resp.msn, 1);
        qp.resp.in_msg = None;
        if let Some(r) = qp.resp.recv.take() {
            let len = qp.resp.offset;
            complete_recv(qp, env, now, &r, h, WcOpcode::Recv, len);
        }
    } else {
        qp.resp.in_msg = Some(InMsg::Send);
    }
    true
}

fn remote_error(e: RemoteKeyError) -> NakCode {
    match e {
        RemoteKeyError::Access => NakCode::RemoteAccessError,
        RemoteKeyError::Misaligned => NakCode::InvalidRequest,
    }
}

/// WRITE packet in sequence. Returns true if accepted.
fn rc_write(
    qp: &mut QpCtx,
    env: &mut DeviceCtx,
    now: u64,
    h: &Headers,
    position: Position,
    payload: &[u8],
    placed: bool,
) -> bool {
    let p = h.bth.psn;
    let last = matches!(position, Position::Last | Position::Only);
    // WRITE with immediate consumes a receive WQE: without one, RNR before touching memory.
    if last && h.imm.is_some() && env.ctx.peek_recv(qp.qpn).is_none() {
        rnr_nak(qp, env, now, p);
        return false;
    }
    if matches!(position, Position::First | Position::Only) {
        let Some(reth) = h.reth else {
            fatal_nak(
                qp,
                env,
                now,
                NakCode::InvalidRequest,
                p,
                None,
                "WRITE without a RETH",
            );
            return false;
        };
        if reth.dma_len > 0 {
            if let Err(e) = env.ctx.remote_span(
                qp.pd,
                qp.qpn,
                reth.rkey,
                reth.va,
                reth.dma_len as usize,
                Access::REMOTE_WRITE,
            ) {
                fatal_nak(
                    qp,
                    env,
                    now,
                    remote_error(e),
                    p,
                    None,
                    "WRITE refused by its rkey check",
                );
                return false;
            }
        }
        qp.resp.in_msg = Some(InMsg::Write {
            va: reth.va,
            rkey: reth.rkey,
            len: reth.dma_len,
        });
        qp.resp.offset = 0;
    }
    let Some(InMsg::Write { va, rkey, len }) = qp.resp.in_msg else {
        fatal_nak(
            qp,
            env,
            now,
            NakCode::InvalidRequest,
            p,
            None,
            "WRITE continues no WRITE in progress",
        );
        return false;
    };
    let off = qp.resp.offset;
    // A placed WRITE (a WRITE ONLY) says the whole message is in place.
    let end = if placed {
        env.stats.placed_writes_taken += 1;
        len as usize
    } else {
        off + payload.len()
    };
    if end > len as usize || (last && end != len as usize) {
        fatal_nak(
            qp,
            env,
            now,
            NakCode::InvalidRequest,
            p,
            None,
            "WRITE past or short of its RETH length",
        );
        return false;
    }
    if !payload.is_empty() && !placed {
        let wrote = match env.ctx.remote_span(
            qp.pd,
            qp.qpn,
            rkey,
            va.wrapping_add(off as u64),
            payload.len(),
            Access::REMOTE_WRITE,
        ) {
            Ok(span) => Ok(span.write(0, payload)),
            Err(e) => Err(e),
        };
        match wrote {
            Ok(true) => {}
            Ok(false) => {
                fatal_nak(
                    qp,
                    env,
                    now,
                    NakCode::RemoteAccessError,
                    p,
                    None,
                    "WRITE not placed: memory not writable",
                );
                return false;
            }
            Err(e) => {
                fatal_nak(
                    qp,
                    env,
                    now,
                    remote_error(e),
                    p,
                    None,
                    "WRITE refused by its rkey check",
                );
                return false;
            }
        }
    }
    qp.resp.offset = end;
    qp.resp.epsn = psn::add(p, 1);
    if last {
        qp.resp.msn = psn::add(qp.resp.msn, 1);
        qp.resp.in_msg = None;
        if h.imm.is_some() {
            if let Some(r) = env.ctx.take_recv(qp.qpn) {
                complete_recv(qp, env, now, &r, h, WcOpcode::RecvRdmaWithImm, len as usize);
            }
        }
    }
    true
}

/// Keep a READ resource in the ring of max_dest_rd_atomic; an evicted one's responses
/// still waiting are dropped with it (only a requester exceeding the limit sees that).
fn push_read_resource(qp: &mut QpCtx, r: Resource) {
    let cap = usize::from(qp.attr.max_dest_rd_atomic).max(1);
    while qp.resp.reads.len() >= cap {
        if let Some(Resource::Read { first_psn: f, .. }) = qp.resp.reads.pop_front() {
            qp.resp
                .pending
                .retain(|x| !matches!(*x, Pending::Read { first_psn, .. } if first_psn == f));
        }
    }
    qp.resp.reads.push_back(r);
}

/// The IBTA's largest message (2^31 bytes).
const MAX_MSG_LEN: usize = 1 << 31;

/// Largest READ accepted: the IBTA message limit, and fewer packets than half the PSN
/// space (PSN comparisons must stay unambiguous across the response range).
fn read_len_ok(len: usize, mtu: usize) -> bool {
    len <= MAX_MSG_LEN && len.div_ceil(mtu.max(1)) < (1 << 22)
}

fn rc_read(qp: &mut QpCtx, env: &mut DeviceCtx, now: u64, h: &Headers) {
    let p = h.bth.psn;
    let Some(reth) = h.reth else {
        fatal_nak(
            qp,
            env,
            now,
            NakCode::InvalidRequest,
            p,
            None,
            "READ without a RETH",
        );
        return;
    };
    // A responder that accepts no READ/atomic resources treats one as an invalid request.
    if qp.attr.max_dest_rd_atomic == 0 {
        fatal_nak(
            qp,
            env,
            now,
            NakCode::InvalidRequest,
            p,
            None,
            "READ while max_dest_rd_atomic is 0",
        );
        return;
    }
    let len = reth.dma_len as usize;
    if !read_len_ok(len, qp.mtu()) {
        fatal_nak(
            qp,
            env,
            now,
            NakCode::InvalidRequest,
            p,
            None,
            "READ longer than the IBTA allows",
        );
        return;
    }
    if len > 0 {
        if let Err(e) =
            env.ctx
                .remote_span(qp.pd, qp.qpn, reth.rkey, reth.va, len, Access::REMOTE_READ)
        {
            fatal_nak(
                qp,
                env,
                now,
                remote_error(e),
                p,
                None,
                "READ refused by its rkey check",
            );
            return;
        }
    }
    let n = (len.div_ceil(qp.mtu())).max(1) as u32;
    let last = psn::add(p, n - 1);
    push_read_resource(
        qp,
        Resource::Read {
            first_psn: p,
            last_psn: last,
            va: reth.va,
            rkey: reth.rkey,
            len: reth.dma_len,
            replays: ReplayBudget::default(),
        },
    );
    qp.resp.epsn = psn::add(last, 1);
    qp.resp.msn = psn::add(qp.resp.msn, 1);
    let msn = qp.resp.msn;
    // The responses go out a batch at a time (see `send_waiting_responses`).
    respond(
        qp,
        env,
        now,
        Pending::Read {
            first_psn: p,
            last_psn: last,
            va: reth.va,
            rkey: reth.rkey,
            len: reth.dma_len,
            start: p,
            next: p,
            msn,
            replay: false,
            exact: false,
        },
    );
}

fn rc_atomic(qp: &mut QpCtx, env: &mut DeviceCtx, now: u64, h: &Headers) {
    let p = h.bth.psn;
    let Some(a) = h.atomic_eth else {
        fatal_nak(
            qp,
            env,
            now,
            NakCode::InvalidRequest,
            p,
            None,
            "atomic without an AtomicETH",
        );
        return;
    };
    if qp.attr.max_dest_rd_atomic == 0 {
        fatal_nak(
            qp,
            env,
            now,
            NakCode::InvalidRequest,
            p,
            None,
            "atomic while max_dest_rd_atomic is 0",
        );
        return;
    }
    let res = match env
        .ctx
        .remote_span(qp.pd, qp.qpn, a.rkey, a.va, 8, Access::REMOTE_ATOMIC)
    {
        // The rkey check settled bounds and alignment: what fails now is the memory itself
        // (unmapped or write-protected since registration), a remote access error.
        Ok(span) => {
            if h.bth.opcode == Opcode::RC_COMPARE_SWAP {
                span.compare_swap(0, a.compare, a.swap_add)
                    .ok_or(NakCode::RemoteAccessError)
            } else {
                span.fetch_add(0, a.swap_add)
                    .ok_or(NakCode::RemoteAccessError)
            }
        }
        Err(e) => Err(remote_error(e)),
    };
    let orig = match res {
        Ok(v) => v,
        Err(code) => {
            fatal_nak(
                qp,
                env,
                now,
                code,
                p,
                None,
                "atomic refused: rkey check, misaligned address or memory gone",
            );
            return;
        }
    };
    let cap = usize::from(qp.attr.max_dest_rd_atomic).max(ATOMIC_REPLAY_MIN);
    while qp.resp.atomics.len() >= cap {
        if let Some(Resource::Atomic { psn: a, .. }) = qp.resp.atomics.pop_front() {
            qp.resp
                .pending
                .retain(|x| !matches!(*x, Pending::AtomicAck { psn, .. } if psn == a));
        }
    }
    qp.resp.atomics.push_back(Resource::Atomic { psn: p, orig });
    qp.resp.epsn = psn::add(p, 1);
    qp.resp.msn = psn::add(qp.resp.msn, 1);
    let msn = qp.resp.msn;
    respond(qp, env, now, Pending::AtomicAck { psn: p, orig, msn });
}
