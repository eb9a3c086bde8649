//! Responder: sequence checks, duplicate handling (re-ACK, READ re-execution, atomic
//! replay), rkey / access / bounds checks, execution of SEND / WRITE / READ / atomics,
//! receive completions, and ACK / NAK / READ response / atomic ACK generation.

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
        QpType::Rc => rc_request(qp, env, now, addrs.src.port(), h, payload),
    }
}

// ---------------------------------------------------------------- sending responses
//
// Responses leave in PSN order, as on rxe: the READ responses of a request go out a
// batch at a time (while the outbox holds fewer than OUTBOX_MAX datagrams, continuing
// from `Rnic::poll_transmit` as it drains), and an ACK, NAK or atomic ACK for a later
// PSN waits behind them in `RespState::pending` (an ACK past a READ whose responses the
// requester has not all seen would tell it they were lost). Later requests are still
// executed at once (without a fence, IBTA lets a later WRITE / SEND pass a READ).

/// Send an ACK / NAK / RNR NAK now.
fn emit_aeth(qp: &QpCtx, env: &mut DeviceCtx, psn: u32, msn: u32, syndrome: Syndrome) {
    let Some(dst) = qp.peer else { return };
    let mut h = Headers::new(Bth::new(Opcode::RC_ACKNOWLEDGE, qp.attr.dest_qp_num, psn));
    h.aeth = Some(Aeth { syndrome, msn });
    env.send(qp.qpn, dst, qp.attr.ah_attr.grh.traffic_class, &h, &[]);
}

fn emit_atomic_ack(qp: &QpCtx, env: &mut DeviceCtx, p: u32, orig: u64, msn: u32) {
    let Some(dst) = qp.peer else { return };
    let mut h = Headers::new(Bth::new(
        Opcode::RC_ATOMIC_ACKNOWLEDGE,
        qp.attr.dest_qp_num,
        p,
    ));
    h.aeth = Some(Aeth {
        syndrome: Syndrome::Ack {
            credits: AETH_CREDITS_INVALID,
        },
        msn,
    });
    h.atomic_ack = Some(AtomicAckEth { orig });
    env.send(qp.qpn, dst, qp.attr.ah_attr.grh.traffic_class, &h, &[]);
}

/// Queue a response in PSN order. An ACK / non-fatal NAK replaces any earlier one still
/// waiting (the newer acknowledges at least as much); an entry for a READ resource or an
/// atomic already waiting replaces it.
fn enqueue(qp: &mut QpCtx, e: Pending) {
    let pend = &mut qp.resp.pending;
    match e {
        Pending::Aeth { fatal: false, .. } => {
            pend.retain(|x| !matches!(x, Pending::Aeth { fatal: false, .. }));
        }
        // A READ asked again for exactly some of its packets (the missing ones) is sent
        // beside what is still being sent of it: the rest of the stream is not lost. Asked
        // again otherwise (for the rest, as an IBTA requester's go-back-N does), it
        // replaces every stream of that READ, so floods do not grow the queue.
        Pending::Read {
            first_psn: f,
            exact: true,
            start: s,
            ..
        } => {
            pend.retain(|x| {
                !matches!(*x, Pending::Read { first_psn, exact: true, start, .. }
                    if first_psn == f && start == s)
            });
        }
        Pending::Read { first_psn: f, .. } => {
            pend.retain(|x| !matches!(*x, Pending::Read { first_psn, .. } if first_psn == f));
        }
        Pending::AtomicAck { psn: p, .. } => {
            pend.retain(|x| !matches!(*x, Pending::AtomicAck { psn, .. } if psn == p));
        }
        Pending::Aeth { fatal: true, .. } => {}
    }
    let at = pend
        .iter()
        .position(|x| psn::lt(e.psn(), x.psn()))
        .unwrap_or(pend.len());
    pend.insert(at, e);
}

/// Give a response: sent now when nothing waits ahead of it, queued otherwise; then
/// send what the outbox has room for.
fn respond(qp: &mut QpCtx, env: &mut DeviceCtx, now: u64, e: Pending) {
    if qp.resp.pending.is_empty() {
        match e {
            Pending::Aeth {
                psn,
                msn,
                syndrome,
                fatal: false,
            } => {
                flush_ack(qp, env);
                emit_aeth(qp, env, psn, msn, syndrome);
                return;
            }
            Pending::AtomicAck { psn, orig, msn } => {
                flush_ack(qp, env);
                emit_atomic_ack(qp, env, psn, orig, msn);
                return;
            }
            _ => {}
        }
    }
    // The coalesced ACK takes its place in the order too.
    if let Some((p, msn)) = qp.resp.ack.take() {
        enqueue(
            qp,
            Pending::Aeth {
                psn: p,
                msn,
                syndrome: Syndrome::Ack {
                    credits: AETH_CREDITS_INVALID,
                },
                fatal: false,
            },
        );
    }
    enqueue(qp, e);
    send_waiting_responses(qp, env, now);
}

/// Send waiting responses in order while the outbox has room; if some remain, wait for
/// `Rnic::poll_transmit` to drain the outbox (meanwhile a duplicate request for a
/// waiting response replaces it, so floods do not grow the queue).
pub(crate) fn send_waiting_responses(qp: &mut QpCtx, env: &mut DeviceCtx, now: u64) {
    loop {
        let Some(front) = qp.resp.pending.front_mut() else {
            return;
        };
        if env.out.len() >= OUTBOX_MAX {
            break;
        }
        match *front {
            Pending::Read {
                first_psn,
                last_psn,
                va,
                rkey,
                len,
                start,
                next,
                msn,
                replay,
                ..
            } => {
                let mtu = qp.mtu();
                let n = psn::diff(last_psn, start) as u32 + 1;
                let i = psn::diff(next, start) as u32;
                let k = psn::diff(next, first_psn) as usize;
                let off = k.saturating_mul(mtu);
                let plen = (len as usize).saturating_sub(off).min(mtu);
                if replay && !spend_replayed(qp, first_psn) {
                    // The READ's budget for re-executions ran out mid-stream: the rest of
                    // this one is not sent (see `qp::READ_REPLAY_FACTOR`).
                    qp.resp.pending.pop_front();
                    env.stats.read_replays_refused += 1;
                    continue;
                }
                if !read_response(
                    qp,
                    env,
                    next,
                    read_resp_opcode(i, n),
                    msn,
                    va,
                    rkey,
                    off,
                    plen,
                ) {
                    // The key went away under the stream, or the memory behind it (unmapped
                    // since registration): stop it, remote access error.
                    qp.resp.pending.pop_front();
                    flush_ack(qp, env);
                    env.stats.naks_sent_access += 1;
                    debug!(
                        qpn = format_args!("{:#x}", qp.qpn),
                        psn = first_psn,
                        kind = ?NakCode::RemoteAccessError,
                        reason = "rkey invalidated or memory gone under a READ response stream",
                        "NAK sent"
                    );
                    let msn = qp.resp.msn;
                    emit_aeth(
                        qp,
                        env,
                        first_psn,
                        msn,
                        Syndrome::Nak(NakCode::RemoteAccessError),
                    );
                    completion::fail(
                        qp,
                        env,
                        now,
                        None,
                        "READ memory unreadable or rkey invalidated",
                    );
                    return;
                }
                if next == last_psn {
                    qp.resp.pending.pop_front();
                } else if let Some(Pending::Read { next: nx, .. }) = qp.resp.pending.front_mut() {
                    *nx = psn::add(next, 1);
                }
            }
            Pending::AtomicAck { psn, orig, msn } => {
                qp.resp.pending.pop_front();
                emit_atomic_ack(qp, env, psn, orig, msn);
            }
            Pending::Aeth {
                psn,
                msn,
                syndrome,
                fatal,
            } => {
                qp.resp.pending.pop_front();
                emit_aeth(qp, env, psn, msn, syndrome);
                if fatal {
                    completion::fail(qp, env, now, None, "fatal NAK sent");
                    return;
                }
            }
        }
    }
    if !qp.resp.tx_wait {
        qp.resp.tx_wait = true;
        env.resp_wait.push_back(qp.qpn);
    }
}

/// Send an ACK / NAK / RNR NAK with the current MSN (in order behind waiting responses).
fn send_aeth(qp: &mut QpCtx, env: &mut DeviceCtx, now: u64, psn: u32, syndrome: Syndrome) {
    let msn = qp.resp.msn;
    respond(
        qp,
        env,
        now,
        Pending::Aeth {
            psn,
            msn,
            syndrome,
            fatal: false,
        },
    );
}

/// Send the coalesced ACK now, if one waits (before any other response, to keep the
/// response stream in PSN order); behind the waiting responses if there are some.
pub(crate) fn flush_ack(qp: &mut QpCtx, env: &mut DeviceCtx) {
    if qp.resp.sack_due {
        crate::sack::send(qp, env);
    }
    if let Some((p, msn)) = qp.resp.ack.take() {
        let syndrome = Syndrome::Ack {
            credits: AETH_CREDITS_INVALID,
        };
        if qp.resp.pending.is_empty() {
            emit_aeth(qp, env, p, msn, syndrome);
        } else {
            enqueue(
                qp,
                Pending::Aeth {
                    psn: p,
                    msn,
                    syndrome,
                    fatal: false,
                },
            );
        }
    }
}

/// Ask for an ACK of everything up to `p` (a later ACK replaces an earlier one).
fn schedule_ack(qp: &mut QpCtx, env: &mut DeviceCtx, p: u32) {
    if qp.resp.ack.is_none() {
        env.ack_queue.push_back(qp.qpn);
    }
    qp.resp.ack = Some((p, qp.resp.msn));
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

/// Read-response opcode for packet `idx` of `n`.
fn read_resp_opcode(idx: u32, n: u32) -> Opcode {
    match (idx, n) {
        (_, 0 | 1) => Opcode::RC_RDMA_READ_RESPONSE_ONLY,
        (0, _) => Opcode::RC_RDMA_READ_RESPONSE_FIRST,
        (i, n) if i + 1 >= n => Opcode::RC_RDMA_READ_RESPONSE_LAST,
        _ => Opcode::RC_RDMA_READ_RESPONSE_MIDDLE,
    }
}

/// Send one READ response packet: `plen` bytes at `va + off`, read through a fresh key
/// check, so a key invalidated in between stops the stream (false) rather than reading
/// memory no longer registered.
#[allow(clippy::too_many_arguments)]
fn read_response(
    qp: &QpCtx,
    env: &mut DeviceCtx,
    p: u32,
    opcode: Opcode,
    msn: u32,
    va: u64,
    rkey: u32,
    off: usize,
    plen: usize,
) -> bool {
    let Some(dst) = qp.peer else { return false };
    let tos = qp.attr.ah_attr.grh.traffic_class;
    let mut h = Headers::new(Bth::new(opcode, qp.attr.dest_qp_num, p));
    if opcode != Opcode::RC_RDMA_READ_RESPONSE_MIDDLE {
        h.aeth = Some(Aeth {
            syndrome: Syndrome::Ack {
                credits: AETH_CREDITS_INVALID,
            },
            msn,
        });
    }
    let (pd, qpn) = (qp.pd, qp.qpn);
    env.send_with(qpn, dst, tos, &h, plen, |ctx, buf| {
        if plen == 0 {
            return Ok(());
        }
        let span = ctx.remote_span(
            pd,
            qpn,
            rkey,
            va.wrapping_add(off as u64),
            plen,
            Access::REMOTE_READ,
        );
        match span {
            Ok(s) if s.read(0, buf) => Ok(()),
            _ => Err(()),
        }
    })
    .is_ok()
}

// ---------------------------------------------------------------- RC

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

fn rc_request(
    qp: &mut QpCtx,
    env: &mut DeviceCtx,
    now: u64,
    src_port: u16,
    h: &Headers,
    payload: &[u8],
) {
    let in_order = h.bth.psn == qp.resp.epsn;
    rc_request_one(qp, env, now, src_port, h, payload);
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
        rc_request_one(qp, env, now, pkt.src_port, &pkt.h, &pkt.payload);
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
    if !length_ok(info.position, payload.len(), qp.mtu(), info.has_payload) {
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
            if rc_write(qp, env, now, h, info.position, payload) && h.bth.ack_req {
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
    let end = off + payload.len();
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
    if !payload.is_empty() {
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

/// The last PSN a duplicate READ from `p` is answered up to, and whether its RETH named
/// exactly that part. A requester resending after a loss may ask for only part of the
/// rest (softrdma asks for the missing packets, or a congestion window's worth): its RETH
/// is honoured when it names exactly the original's bytes from `p` on (same rkey, the
/// address of packet `p`, a length that ends on a packet boundary or at the original's
/// end, as rxe checks it against the original). Any other RETH is answered with the rest
/// of the original READ, never from the duplicate's own fields.
#[allow(clippy::too_many_arguments)]
fn replay_end(
    h: &Headers,
    p: u32,
    first_psn: u32,
    last_psn: u32,
    va: u64,
    rkey: u32,
    len: u32,
    mtu: usize,
) -> (u32, bool) {
    let Some(r) = h.reth else {
        return (last_psn, false);
    };
    let mtu = mtu.max(1) as u64;
    let off = (psn::diff(p, first_psn) as u64).saturating_mul(mtu);
    let (len, want) = (u64::from(len), u64::from(r.dma_len));
    let fits = off.checked_add(want).is_some_and(|end| end <= len);
    let boundary = want % mtu == 0 || off + want == len;
    if r.rkey != rkey || r.va != va.wrapping_add(off) || want == 0 || !fits || !boundary {
        return (last_psn, false);
    }
    let n = want.div_ceil(mtu) as u32;
    (psn::add(p, n - 1), true)
}

/// Whether a re-execution of the READ starting at `first_psn` may send one more response
/// packet: its resource's budget has one left (then it is counted), or the resource is
/// gone (nothing left to charge: the stream was dropped with it).
fn spend_replayed(qp: &mut QpCtx, first_psn: u32) -> bool {
    let mtu = qp.mtu();
    for r in qp.resp.reads.iter_mut() {
        if let Resource::Read {
            first_psn: f,
            len,
            replays,
            ..
        } = r
        {
            if *f == first_psn {
                let npkts = (*len as usize).div_ceil(mtu).max(1) as u32;
                return replays.spend(npkts);
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

/// A request with a PSN before the expected one (IBTA 9.7.5.1.4): SEND/WRITE are
/// re-ACKed and not executed again; a READ is executed again from the PSN asked, for
/// what the original request asked (its RETH was checked then; the duplicate's is not
/// used), replacing a transmission of that resource still under way; an atomic is
/// answered from the replay cache, never applied twice. Requests not found among the
/// resources are dropped. Nothing here grows state: a flood of duplicates costs
/// responses, not memory, and a READ's re-executions send at most its budget
/// (`qp::READ_REPLAY_FACTOR` times its packets, plus a few).
fn duplicate(qp: &mut QpCtx, env: &mut DeviceCtx, now: u64, h: &Headers, kind: OpKind) {
    let p = h.bth.psn;
    match kind {
        OpKind::Send | OpKind::Write => {
            let prev = psn::sub(qp.resp.epsn, 1);
            send_aeth(
                qp,
                env,
                now,
                prev,
                Syndrome::Ack {
                    credits: AETH_CREDITS_INVALID,
                },
            );
        }
        OpKind::ReadRequest => {
            if h.reth.is_none() {
                dropped!(
                    debug,
                    env,
                    qp,
                    h,
                    malformed,
                    "duplicate READ request without a RETH"
                );
                return;
            }
            let mtu = qp.mtu();
            let found = qp.resp.reads.iter_mut().find_map(|r| match r {
                Resource::Read {
                    first_psn,
                    last_psn,
                    va,
                    rkey,
                    len,
                    replays,
                } if psn::le(*first_psn, p) && psn::le(p, *last_psn) => {
                    let npkts = (*len as usize).div_ceil(mtu).max(1) as u32;
                    let (end, exact) =
                        replay_end(h, p, *first_psn, *last_psn, *va, *rkey, *len, mtu);
                    // Only a part that stops short of the READ's end is sent beside its
                    // other streams: asked for up to the end, it is a go-back-N (an IBTA
                    // requester's), which replaces them as before.
                    let exact = exact && end != *last_psn;
                    let taken = replays.take(npkts);
                    Some((*first_psn, *va, *rkey, *len, end, exact, taken))
                }
                _ => None,
            });
            let Some((first_psn, va, rkey, len, end_psn, exact, taken)) = found else {
                dropped!(
                    debug,
                    env,
                    qp,
                    h,
                    dropped,
                    "duplicate READ request no longer remembered"
                );
                return;
            };
            if let Err(why) = taken {
                dropped!(debug, env, qp, h, read_replays_refused, why; first_psn, end_psn);
                return;
            }
            let streams = qp
                .resp
                .pending
                .iter()
                .filter(|x| matches!(**x, Pending::Read { first_psn: f, .. } if f == first_psn))
                .count();
            if exact && streams >= READ_STREAMS_MAX {
                let why = "too many parts of this READ waiting to be sent again";
                dropped!(debug, env, qp, h, read_replays_refused, why; first_psn);
                return;
            }
            env.stats.read_replays += 1;
            let msn = qp.resp.msn;
            respond(
                qp,
                env,
                now,
                Pending::Read {
                    first_psn,
                    last_psn: end_psn,
                    va,
                    rkey,
                    len,
                    start: p,
                    next: p,
                    msn,
                    replay: true,
                    exact,
                },
            );
        }
        OpKind::Atomic => {
            let orig = qp.resp.atomics.iter().find_map(|r| match *r {
                Resource::Atomic { psn, orig } if psn == p => Some(orig),
                _ => None,
            });
            match orig {
                Some(orig) => {
                    let msn = qp.resp.msn;
                    respond(qp, env, now, Pending::AtomicAck { psn: p, orig, msn });
                }
                None => {
                    dropped!(
                        debug,
                        env,
                        qp,
                        h,
                        dropped,
                        "duplicate atomic not in the replay cache"
                    )
                }
            }
        }
        _ => {
            dropped!(
                debug,
                env,
                qp,
                h,
                dropped,
                "duplicate of an unexpected opcode"
            )
        }
    }
}

// ---------------------------------------------------------------- UC

/// UC: no ACKs. A gap abandons the message in progress; the next FIRST/ONLY resynchronises.
fn uc_request(qp: &mut QpCtx, env: &mut DeviceCtx, now: u64, h: &Headers, payload: &[u8]) {
    let Some(info) = h.bth.opcode.info() else {
        return;
    };
    let p = h.bth.psn;
    if p != qp.resp.epsn {
        debug!(
            qpn = format_args!("{:#x}", qp.qpn),
            psn = p,
            epsn = qp.resp.epsn,
            opcode = %h.bth.opcode,
            counter = "out_of_sequence",
            "UC PSN gap: message in progress abandoned"
        );
        env.stats.out_of_sequence += 1;
        qp.resp.in_msg = None;
        qp.resp.offset = 0;
    }
    qp.resp.epsn = psn::add(p, 1);
    let starts = matches!(info.position, Position::First | Position::Only);
    let cont = matches!(
        (qp.resp.in_msg, info.kind),
        (Some(InMsg::Send), OpKind::Send) | (Some(InMsg::Write { .. }), OpKind::Write)
    );
    if starts {
        // A new message abandons an unfinished one (its LAST was lost).
        qp.resp.in_msg = None;
        qp.resp.offset = 0;
    } else if !cont {
        qp.resp.in_msg = None;
        dropped!(
            debug,
            env,
            qp,
            h,
            dropped,
            "continues no message in progress"
        );
        return;
    }
    let need = kind_access(info.kind);
    if (!need.is_empty() && !qp.attr.qp_access_flags.contains(need))
        || !length_ok(info.position, payload.len(), qp.mtu(), info.has_payload)
    {
        qp.resp.in_msg = None;
        dropped!(
            debug,
            env,
            qp,
            h,
            dropped,
            if need.is_empty() || qp.attr.qp_access_flags.contains(need) {
                "payload length wrong for its position"
            } else {
                "operation not enabled in the QP's access flags"
            }
        );
        return;
    }
    let last = matches!(info.position, Position::Last | Position::Only);
    match info.kind {
        OpKind::Send => {
            if starts && qp.resp.recv.is_none() {
                match env.ctx.take_recv(qp.qpn) {
                    Some(r) => qp.resp.recv = Some(r),
                    None => {
                        dropped!(debug, env, qp, h, dropped, "no receive WQE posted");
                        return;
                    }
                }
            }
            let Some(r) = qp.resp.recv.as_ref() else {
                dropped!(debug, env, qp, h, dropped, "no receive WQE for the message");
                return;
            };
            if !payload.is_empty() {
                if let Err(s) = env.ctx.scatter(qp.pd, &r.sg_list, qp.resp.offset, payload) {
                    // The receive WQE completes in error; the rest of the message is dropped.
                    debug!(
                        qpn = format_args!("{:#x}", qp.qpn),
                        psn = p,
                        status = ?s,
                        "UC SEND not placed: receive WQE completed in error"
                    );
                    if let Some(r) = qp.resp.recv.take() {
                        let mut wc = recv_wc(qp, &r, s.status);
                        wc.vendor_err = s.detail.code();
                        env.complete(qp.recv_cq, wc, false, now);
                    }
                    qp.resp.in_msg = None;
                    return;
                }
            }
            qp.resp.offset += payload.len();
            if last {
                qp.resp.in_msg = None;
                qp.resp.msn = psn::add(qp.resp.msn, 1);
                if let Some(r) = qp.resp.recv.take() {
                    let len = qp.resp.offset;
                    complete_recv(qp, env, now, &r, h, WcOpcode::Recv, len);
                }
            } else {
                qp.resp.in_msg = Some(InMsg::Send);
            }
        }
        OpKind::Write => {
            if starts {
                let Some(reth) = h.reth else { return };
                qp.resp.in_msg = Some(InMsg::Write {
                    va: reth.va,
                    rkey: reth.rkey,
                    len: reth.dma_len,
                });
            }
            let Some(InMsg::Write { va, rkey, len }) = qp.resp.in_msg else {
                return;
            };
            let off = qp.resp.offset;
            let end = off + payload.len();
            let mut ok = end <= len as usize && (!last || end == len as usize);
            if ok && !payload.is_empty() {
                ok = match env.ctx.remote_span(
                    qp.pd,
                    qp.qpn,
                    rkey,
                    va.wrapping_add(off as u64),
                    payload.len(),
                    Access::REMOTE_WRITE,
                ) {
                    Ok(span) => span.write(0, payload),
                    Err(_) => false,
                };
            }
            if !ok {
                qp.resp.in_msg = None;
                dropped!(
                    debug,
                    env,
                    qp,
                    h,
                    dropped,
                    "UC WRITE outside its length or its rkey's bounds"
                );
                return;
            }
            qp.resp.offset = end;
            if last {
                qp.resp.in_msg = None;
                qp.resp.msn = psn::add(qp.resp.msn, 1);
                if h.imm.is_some() {
                    match env.ctx.take_recv(qp.qpn) {
                        Some(r) => complete_recv(
                            qp,
                            env,
                            now,
                            &r,
                            h,
                            WcOpcode::RecvRdmaWithImm,
                            len as usize,
                        ),
                        None => {
                            dropped!(
                                debug,
                                env,
                                qp,
                                h,
                                dropped,
                                "no receive WQE for the immediate"
                            )
                        }
                    }
                }
            } else {
                // keep the write state for the next MIDDLE/LAST
            }
        }
        _ => {
            dropped!(debug, env, qp, h, dropped, "not a UC request opcode")
        }
    }
}

// ---------------------------------------------------------------- UD

/// UD: Q_Key check (mismatch: silently dropped), then one receive WQE gets a 40-byte GRH
/// (carrying the datagram's traffic class `tos`) followed by the payload.
#[allow(clippy::too_many_arguments)]
fn ud_request(
    qp: &mut QpCtx,
    env: &mut DeviceCtx,
    now: u64,
    addrs: &Addrs,
    tos: u8,
    h: &Headers,
    payload: &[u8],
    udp_len: usize,
) {
    let Some(deth) = h.deth else {
        dropped!(debug, env, qp, h, malformed, "UD request without a DETH");
        return;
    };
    if deth.qkey != qp.attr.qkey {
        dropped!(debug, env, qp, h, dropped, "Q_Key mismatch";
            peer = %addrs.src,
            src_qpn = format_args!("{:#x}", deth.src_qp),
            qkey = format_args!("{:#x}", deth.qkey),
            expected = format_args!("{:#x}", qp.attr.qkey)
        );
        return;
    }
    let Some(r) = env.ctx.take_recv(qp.qpn) else {
        dropped!(debug, env, qp, h, dropped, "no receive WQE posted";
            peer = %addrs.src,
            src_qpn = format_args!("{:#x}", deth.src_qp)
        );
        return;
    };
    let grh = wire::frame::ud_grh(addrs, tos, udp_len);
    let res = env
        .ctx
        .scatter(qp.pd, &r.sg_list, 0, &grh)
        .and_then(|()| env.ctx.scatter(qp.pd, &r.sg_list, GRH_LEN, payload));
    let mut wc = recv_wc(qp, &r, WcStatus::Success);
    wc.src_qp = deth.src_qp;
    match res {
        Ok(()) => {
            wc.byte_len = (payload.len() + GRH_LEN) as u32;
            wc.wc_flags = WcFlags::GRH;
            wc.sl = wire::frame::ud_roce_pkt_type(addrs);
            if let Some(imm) = h.imm {
                wc.wc_flags |= WcFlags::WITH_IMM;
                wc.imm_data = imm;
            }
        }
        Err(s) => {
            wc.status = s.status;
            wc.vendor_err = s.detail.code();
        }
    }
    env.complete(qp.recv_cq, wc, h.bth.solicited, now);
}
