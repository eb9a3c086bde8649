//! Responder: sequence checks, duplicate handling (re-ACK, READ re-execution, atomic
//! replay), rkey / access / bounds checks, execution of SEND / WRITE / READ / atomics,
//! receive completions, and ACK / NAK / READ response / atomic ACK generation.

use softrdma_wire::{
    self as wire, psn, Addrs, Aeth, AtomicAckEth, Bth, Headers, NakCode, OpKind, Opcode, Position,
    Syndrome, AETH_CREDITS_INVALID, GRH_LEN,
};

use crate::completer;
use crate::qp::{InMsg, QpCtx, Resource, ATOMIC_REPLAY_MIN};
use crate::verbs::{
    Access, QpType, RecvWr, RemoteKeyError, WcFlags, WcOpcode, WcStatus, WorkCompletion,
};
use crate::Env;

/// A request packet for this QP (service type, state and peer already checked).
pub(crate) fn handle_request(
    qp: &mut QpCtx,
    env: &mut Env,
    now: u64,
    addrs: &Addrs,
    h: &Headers,
    payload: &[u8],
    udp_len: usize,
) {
    match qp.qp_type {
        QpType::Ud => ud_request(qp, env, now, addrs, h, payload, udp_len),
        QpType::Uc => uc_request(qp, env, now, h, payload),
        QpType::Rc => rc_request(qp, env, now, h, payload),
    }
}

// ---------------------------------------------------------------- sending responses

/// Send an ACK / NAK / RNR NAK with the current MSN.
fn send_aeth(qp: &QpCtx, env: &mut Env, psn: u32, syndrome: Syndrome) {
    let Some(dst) = qp.peer else { return };
    let mut h = Headers::new(Bth::new(Opcode::RC_ACKNOWLEDGE, qp.attr.dest_qp_num, psn));
    h.aeth = Some(Aeth {
        syndrome,
        msn: qp.resp.msn,
    });
    env.send(qp.qpn, dst, qp.attr.ah_attr.grh.traffic_class, &h, &[]);
}

/// Send the coalesced ACK now, if one waits (before any other response, to keep the
/// response stream in PSN order).
pub(crate) fn flush_ack(qp: &mut QpCtx, env: &mut Env) {
    if let Some((p, msn)) = qp.resp.ack.take() {
        let Some(dst) = qp.peer else { return };
        let mut h = Headers::new(Bth::new(Opcode::RC_ACKNOWLEDGE, qp.attr.dest_qp_num, p));
        h.aeth = Some(Aeth {
            syndrome: Syndrome::Ack {
                credits: AETH_CREDITS_INVALID,
            },
            msn,
        });
        env.send(qp.qpn, dst, qp.attr.ah_attr.grh.traffic_class, &h, &[]);
    }
}

/// Ask for an ACK of everything up to `p` (a later ACK replaces an earlier one).
fn schedule_ack(qp: &mut QpCtx, env: &mut Env, p: u32) {
    if qp.resp.ack.is_none() {
        env.ack_queue.push_back(qp.qpn);
    }
    qp.resp.ack = Some((p, qp.resp.msn));
}

/// A class A/C error (IBTA 9.9.3): NAK `p`, complete a held receive WQE with `recv_status`,
/// and the responder QP goes to ERR.
fn fatal_nak(
    qp: &mut QpCtx,
    env: &mut Env,
    now: u64,
    code: NakCode,
    p: u32,
    recv_status: Option<WcStatus>,
) {
    flush_ack(qp, env);
    match code {
        NakCode::PsnSequenceError => env.stats.naks_sent_seq += 1,
        NakCode::InvalidRequest | NakCode::InvalidRdRequest => env.stats.naks_sent_inv += 1,
        NakCode::RemoteAccessError => env.stats.naks_sent_access += 1,
        NakCode::RemoteOperationalError => env.stats.naks_sent_op += 1,
    }
    send_aeth(qp, env, p, Syndrome::Nak(code));
    if let (Some(s), Some(r)) = (recv_status, qp.resp.recv.take()) {
        let wc = recv_wc(qp, &r, s);
        env.complete(qp.recv_cq, wc, false, now);
    }
    completer::fail(qp, env, now, None);
}

fn rnr_nak(qp: &mut QpCtx, env: &mut Env, p: u32) {
    flush_ack(qp, env);
    env.stats.rnr_naks_sent += 1;
    let timer = qp.attr.min_rnr_timer & 0x1F;
    send_aeth(qp, env, p, Syndrome::RnrNak { timer });
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

/// Send READ response packets for `len` bytes at `va`, PSNs from `first`. Memory is
/// re-read per packet through a fresh key check, so a key invalidated in between stops
/// the stream (returns false) rather than reading memory no longer registered.
fn read_responses(qp: &QpCtx, env: &mut Env, first: u32, va: u64, rkey: u32, len: usize) -> bool {
    let Some(dst) = qp.peer else { return false };
    let mtu = qp.mtu();
    let n = (len.div_ceil(mtu)).max(1) as u32;
    let tos = qp.attr.ah_attr.grh.traffic_class;
    for i in 0..n {
        let off = (i as usize) * mtu;
        let plen = len.saturating_sub(off).min(mtu);
        let opcode = read_resp_opcode(i, n);
        let mut h = Headers::new(Bth::new(opcode, qp.attr.dest_qp_num, psn::add(first, i)));
        if opcode != Opcode::RC_RDMA_READ_RESPONSE_MIDDLE {
            h.aeth = Some(Aeth {
                syndrome: Syndrome::Ack {
                    credits: AETH_CREDITS_INVALID,
                },
                msn: qp.resp.msn,
            });
        }
        let (pd, qpn) = (qp.pd, qp.qpn);
        let sent = env.send_with(qpn, dst, tos, &h, plen, |ctx, buf| {
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
        });
        if sent.is_err() {
            return false;
        }
    }
    true
}

fn send_atomic_ack(qp: &QpCtx, env: &mut Env, p: u32, orig: u64) {
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
        msn: qp.resp.msn,
    });
    h.atomic_ack = Some(AtomicAckEth { orig });
    env.send(qp.qpn, dst, qp.attr.ah_attr.grh.traffic_class, &h, &[]);
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

fn rc_request(qp: &mut QpCtx, env: &mut Env, now: u64, h: &Headers, payload: &[u8]) {
    let Some(info) = h.bth.opcode.info() else {
        return;
    };
    let p = h.bth.psn;
    let d = psn::diff(p, qp.resp.epsn);
    if d > 0 {
        env.stats.out_of_sequence += 1;
        if !qp.resp.nak_sent {
            qp.resp.nak_sent = true;
            flush_ack(qp, env);
            env.stats.naks_sent_seq += 1;
            let e = qp.resp.epsn;
            send_aeth(qp, env, e, Syndrome::Nak(NakCode::PsnSequenceError));
        }
        return;
    }
    if d < 0 {
        env.stats.duplicates += 1;
        duplicate(qp, env, h, info.kind);
        return;
    }
    qp.resp.nak_sent = false;

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
            Some(WcStatus::RemInvReqErr),
        );
        return;
    }
    // A QP not enabled for the operation: remote access error, as hardware reports it
    // (rxe answers invalid request here).
    let need = kind_access(info.kind);
    if !need.is_empty() && !qp.attr.qp_access_flags.contains(need) {
        fatal_nak(qp, env, now, NakCode::RemoteAccessError, p, None);
        return;
    }
    if !length_ok(info.position, payload.len(), qp.mtu(), info.has_payload) {
        fatal_nak(
            qp,
            env,
            now,
            NakCode::InvalidRequest,
            p,
            Some(WcStatus::RemInvReqErr),
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
        _ => env.stats.dropped += 1,
    }
}

/// Complete a receive WQE for a finished SEND (or WRITE with immediate).
fn complete_recv(
    qp: &QpCtx,
    env: &mut Env,
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
    env: &mut Env,
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
                    rnr_nak(qp, env, p);
                    return false;
                }
            }
        }
        qp.resp.offset = 0;
    }
    let Some(r) = qp.resp.recv.as_ref() else {
        fatal_nak(qp, env, now, NakCode::InvalidRequest, p, None);
        return false;
    };
    if !payload.is_empty() {
        if let Err(s) = env.ctx.scatter(qp.pd, &r.sg_list, qp.resp.offset, payload) {
            let (code, status) = if s == WcStatus::LocLenErr {
                (NakCode::InvalidRequest, WcStatus::LocLenErr)
            } else {
                (NakCode::RemoteOperationalError, s)
            };
            fatal_nak(qp, env, now, code, p, Some(status));
            return false;
        }
    }
    qp.resp.offset += payload.len();
    qp.resp.epsn = psn::add(p, 1);
    if matches!(position, Position::Last | Position::Only) {
        if let Some(rkey) = h.ieth {
            if let Err(s) = env.ctx.invalidate_rkey(qp.pd, rkey) {
                fatal_nak(qp, env, now, NakCode::InvalidRequest, p, Some(s));
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
    env: &mut Env,
    now: u64,
    h: &Headers,
    position: Position,
    payload: &[u8],
) -> bool {
    let p = h.bth.psn;
    let last = matches!(position, Position::Last | Position::Only);
    // WRITE with immediate consumes a receive WQE: without one, RNR before touching memory.
    if last && h.imm.is_some() && env.ctx.peek_recv(qp.qpn).is_none() {
        rnr_nak(qp, env, p);
        return false;
    }
    if matches!(position, Position::First | Position::Only) {
        let Some(reth) = h.reth else {
            fatal_nak(qp, env, now, NakCode::InvalidRequest, p, None);
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
                fatal_nak(qp, env, now, remote_error(e), p, None);
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
        fatal_nak(qp, env, now, NakCode::InvalidRequest, p, None);
        return false;
    };
    let off = qp.resp.offset;
    let end = off + payload.len();
    if end > len as usize || (last && end != len as usize) {
        fatal_nak(qp, env, now, NakCode::InvalidRequest, p, None);
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
                fatal_nak(qp, env, now, NakCode::RemoteAccessError, p, None);
                return false;
            }
            Err(e) => {
                fatal_nak(qp, env, now, remote_error(e), p, None);
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

fn push_read_resource(qp: &mut QpCtx, r: Resource) {
    let cap = usize::from(qp.attr.max_dest_rd_atomic).max(1);
    while qp.resp.reads.len() >= cap {
        qp.resp.reads.pop_front();
    }
    qp.resp.reads.push_back(r);
}

fn rc_read(qp: &mut QpCtx, env: &mut Env, now: u64, h: &Headers) {
    let p = h.bth.psn;
    let Some(reth) = h.reth else {
        fatal_nak(qp, env, now, NakCode::InvalidRequest, p, None);
        return;
    };
    // A responder that accepts no READ/atomic resources treats one as an invalid request.
    if qp.attr.max_dest_rd_atomic == 0 {
        fatal_nak(qp, env, now, NakCode::InvalidRequest, p, None);
        return;
    }
    let len = reth.dma_len as usize;
    if len > 0 {
        if let Err(e) =
            env.ctx
                .remote_span(qp.pd, qp.qpn, reth.rkey, reth.va, len, Access::REMOTE_READ)
        {
            fatal_nak(qp, env, now, remote_error(e), p, None);
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
        },
    );
    qp.resp.epsn = psn::add(last, 1);
    qp.resp.msn = psn::add(qp.resp.msn, 1);
    flush_ack(qp, env);
    if !read_responses(qp, env, p, reth.va, reth.rkey, len) {
        fatal_nak(qp, env, now, NakCode::RemoteAccessError, p, None);
    }
}

fn rc_atomic(qp: &mut QpCtx, env: &mut Env, now: u64, h: &Headers) {
    let p = h.bth.psn;
    let Some(a) = h.atomic_eth else {
        fatal_nak(qp, env, now, NakCode::InvalidRequest, p, None);
        return;
    };
    if qp.attr.max_dest_rd_atomic == 0 {
        fatal_nak(qp, env, now, NakCode::InvalidRequest, p, None);
        return;
    }
    let res = match env
        .ctx
        .remote_span(qp.pd, qp.qpn, a.rkey, a.va, 8, Access::REMOTE_ATOMIC)
    {
        Ok(span) => {
            if h.bth.opcode == Opcode::RC_COMPARE_SWAP {
                span.compare_swap(0, a.compare, a.swap_add)
                    .ok_or(NakCode::InvalidRequest)
            } else {
                span.fetch_add(0, a.swap_add).ok_or(NakCode::InvalidRequest)
            }
        }
        Err(e) => Err(remote_error(e)),
    };
    let orig = match res {
        Ok(v) => v,
        Err(code) => {
            fatal_nak(qp, env, now, code, p, None);
            return;
        }
    };
    let cap = usize::from(qp.attr.max_dest_rd_atomic).max(ATOMIC_REPLAY_MIN);
    while qp.resp.atomics.len() >= cap {
        qp.resp.atomics.pop_front();
    }
    qp.resp.atomics.push_back(Resource::Atomic { psn: p, orig });
    qp.resp.epsn = psn::add(p, 1);
    qp.resp.msn = psn::add(qp.resp.msn, 1);
    flush_ack(qp, env);
    send_atomic_ack(qp, env, p, orig);
}

/// A request with a PSN before the expected one (IBTA 9.7.5.1.4): SEND/WRITE are
/// re-ACKed and not executed again; a READ is executed again for the range asked; an
/// atomic is answered from the replay cache, never applied twice. Requests not found
/// among the resources are dropped.
fn duplicate(qp: &mut QpCtx, env: &mut Env, h: &Headers, kind: OpKind) {
    let p = h.bth.psn;
    match kind {
        OpKind::Send | OpKind::Write => {
            flush_ack(qp, env);
            let prev = psn::sub(qp.resp.epsn, 1);
            send_aeth(
                qp,
                env,
                prev,
                Syndrome::Ack {
                    credits: AETH_CREDITS_INVALID,
                },
            );
        }
        OpKind::ReadRequest => {
            let Some(reth) = h.reth else { return };
            let found = qp.resp.reads.iter().any(|r| match *r {
                Resource::Read {
                    first_psn,
                    last_psn,
                } => psn::le(first_psn, p) && psn::le(p, last_psn),
                _ => false,
            });
            if !found {
                env.stats.dropped += 1;
                return;
            }
            flush_ack(qp, env);
            read_responses(qp, env, p, reth.va, reth.rkey, reth.dma_len as usize);
        }
        OpKind::Atomic => {
            let orig = qp.resp.atomics.iter().find_map(|r| match *r {
                Resource::Atomic { psn, orig } if psn == p => Some(orig),
                _ => None,
            });
            match orig {
                Some(o) => {
                    flush_ack(qp, env);
                    send_atomic_ack(qp, env, p, o);
                }
                None => env.stats.dropped += 1,
            }
        }
        _ => env.stats.dropped += 1,
    }
}

// ---------------------------------------------------------------- UC

/// UC: no ACKs. A gap abandons the message in progress; the next FIRST/ONLY resynchronises.
fn uc_request(qp: &mut QpCtx, env: &mut Env, now: u64, h: &Headers, payload: &[u8]) {
    let Some(info) = h.bth.opcode.info() else {
        return;
    };
    let p = h.bth.psn;
    if p != qp.resp.epsn {
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
        env.stats.dropped += 1;
        return;
    }
    let need = kind_access(info.kind);
    if (!need.is_empty() && !qp.attr.qp_access_flags.contains(need))
        || !length_ok(info.position, payload.len(), qp.mtu(), info.has_payload)
    {
        qp.resp.in_msg = None;
        env.stats.dropped += 1;
        return;
    }
    let last = matches!(info.position, Position::Last | Position::Only);
    match info.kind {
        OpKind::Send => {
            if starts && qp.resp.recv.is_none() {
                match env.ctx.take_recv(qp.qpn) {
                    Some(r) => qp.resp.recv = Some(r),
                    None => {
                        env.stats.dropped += 1;
                        return;
                    }
                }
            }
            let Some(r) = qp.resp.recv.as_ref() else {
                env.stats.dropped += 1;
                return;
            };
            if !payload.is_empty() {
                if let Err(s) = env.ctx.scatter(qp.pd, &r.sg_list, qp.resp.offset, payload) {
                    // The receive WQE completes in error; the rest of the message is dropped.
                    if let Some(r) = qp.resp.recv.take() {
                        let wc = recv_wc(qp, &r, s);
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
                env.stats.dropped += 1;
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
                        None => env.stats.dropped += 1,
                    }
                }
            } else {
                // keep the write state for the next MIDDLE/LAST
            }
        }
        _ => env.stats.dropped += 1,
    }
}

// ---------------------------------------------------------------- UD

/// UD: Q_Key check (mismatch: silently dropped), then one receive WQE gets a 40-byte GRH
/// followed by the payload.
fn ud_request(
    qp: &mut QpCtx,
    env: &mut Env,
    now: u64,
    addrs: &Addrs,
    h: &Headers,
    payload: &[u8],
    udp_len: usize,
) {
    let Some(deth) = h.deth else {
        env.stats.malformed += 1;
        return;
    };
    if deth.qkey != qp.attr.qkey {
        env.stats.dropped += 1;
        return;
    }
    let Some(r) = env.ctx.take_recv(qp.qpn) else {
        env.stats.dropped += 1;
        return;
    };
    let grh = wire::frame::ud_grh(addrs, 0, udp_len);
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
            if let Some(imm) = h.imm {
                wc.wc_flags |= WcFlags::WITH_IMM;
                wc.imm_data = imm;
            }
        }
        Err(s) => wc.status = s,
    }
    env.complete(qp.recv_cq, wc, h.bth.solicited, now);
}
