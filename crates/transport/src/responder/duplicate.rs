//! Duplicate requests (a PSN before the expected one): re-acknowledged, a READ
//! re-executed from its remembered resource within its budget, an atomic answered from
//! the replay cache, never executed twice.

use super::*;

/// The last PSN a duplicate READ from `p` is answered up to, and whether its RETH named
/// exactly that part. A requester resending after a loss may ask for only part of the
/// rest (softrdma asks for the missing packets, or a congestion window's worth): its RETH
/// is honoured when it names exactly the original's bytes from `p` on (same rkey, the
/// address of packet `p`, a length that ends on a packet boundary or at the original's
/// end, as rxe checks it against the original). Any other RETH is answered with the rest
/// of the original READ, never from the duplicate's own fields.
#[allow(clippy::too_many_arguments)]
pub(super) fn replay_end(
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
pub(super) fn spend_replayed(qp: &mut QpCtx, first_psn: u32) -> bool {
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

/// A request with a PSN before the expected one (IBTA 9.7.5.1.4): SEND/WRITE are
/// re-ACKed and not executed again; a READ is executed again from the PSN asked, for
/// what the original request asked (its RETH was checked then; the duplicate's is not
/// used), replacing a transmission of that resource still under way; an atomic is
/// answered from the replay cache, never applied twice. Requests not found among the
/// resources are dropped. Nothing here grows state: a flood of duplicates costs
/// responses, not memory, and a READ's re-executions send at most its budget
/// (`qp::READ_REPLAY_FACTOR` times its packets, plus a few).
pub(super) fn duplicate(qp: &mut QpCtx, env: &mut DeviceCtx, now: u64, h: &Headers, kind: OpKind) {
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
                    // requester's), which replaces them.
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
