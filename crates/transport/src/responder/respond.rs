//! Sending responses. They leave in PSN order, as on rxe: the READ responses of a
//! request go out a batch at a time (while the outbox holds fewer than OUTBOX_MAX
//! datagrams, continuing from `Rnic::poll_transmit` as it drains), and an ACK, NAK or
//! atomic ACK for a later PSN waits behind them in `RespState::pending` (an ACK past a
//! READ whose responses the requester has not all seen would tell it they were lost).
//! Later requests are still executed at once (without a fence, IBTA lets a later WRITE /
//! SEND pass a READ).

use super::*;

/// Send an ACK / NAK / RNR NAK now.
pub(super) fn emit_aeth(qp: &QpCtx, env: &mut DeviceCtx, psn: u32, msn: u32, syndrome: Syndrome) {
    let Some(dst) = qp.peer else { return };
    let mut h = Headers::new(Bth::new(Opcode::RC_ACKNOWLEDGE, qp.attr.dest_qp_num, psn));
    h.aeth = Some(Aeth { syndrome, msn });
    env.send(qp.qpn, dst, qp.attr.ah_attr.grh.traffic_class, &h, &[]);
}

pub(super) fn emit_atomic_ack(qp: &QpCtx, env: &mut DeviceCtx, p: u32, orig: u64, msn: u32) {
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
pub(super) fn respond(qp: &mut QpCtx, env: &mut DeviceCtx, now: u64, e: Pending) {
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
pub(super) fn send_aeth(
    qp: &mut QpCtx,
    env: &mut DeviceCtx,
    now: u64,
    psn: u32,
    syndrome: Syndrome,
) {
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
pub(super) fn schedule_ack(qp: &mut QpCtx, env: &mut DeviceCtx, p: u32) {
    if qp.resp.ack.is_none() {
        env.ack_queue.push_back(qp.qpn);
    }
    qp.resp.ack = Some((p, qp.resp.msn));
}

/// Read-response opcode for packet `idx` of `n`.
pub(super) fn read_resp_opcode(idx: u32, n: u32) -> Opcode {
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
pub(super) fn read_response(
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
