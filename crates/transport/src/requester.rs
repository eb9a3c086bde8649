//! Requester: turns send WQEs into request packets — PSN assignment, MTU segmentation,
//! the outstanding READ/atomic window, fences, and in-order execution of local
//! operations (LOCAL_INV, BIND_MW).

use softrdma_wire::{psn, AtomicEth, Bth, Deth, Headers, Opcode, Reth};

use crate::completion;
use crate::device_ctx::DeviceCtx;
use crate::qp::{QpCtx, SendWqe, HOLD_SPAN, MAX_PKT_PER_ACK, OUTBOX_MAX};
use crate::verbs::{Access, PdId, QpState, QpType, SendFlags, SendOp, WcDetail, WcError, WcStatus};

/// Position of packet `idx` among `n`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pos {
    First,
    Middle,
    Last,
    Only,
}

fn pos(idx: u32, n: u32) -> Pos {
    match (idx, n) {
        (_, 0 | 1) => Pos::Only,
        (0, _) => Pos::First,
        (i, n) if i + 1 >= n => Pos::Last,
        _ => Pos::Middle,
    }
}

/// The opcode of a SEND / WRITE data packet. None for an op the service cannot carry
/// (check_send_wr rejects those at post).
fn data_opcode(t: QpType, op: &SendOp, p: Pos) -> Option<Opcode> {
    use Pos::*;
    let rc = match (op, p) {
        (SendOp::Send | SendOp::SendWithImm { .. } | SendOp::SendWithInv { .. }, First) => 0x00,
        (SendOp::Send | SendOp::SendWithImm { .. } | SendOp::SendWithInv { .. }, Middle) => 0x01,
        (SendOp::Send, Last) => 0x02,
        (SendOp::SendWithImm { .. }, Last) => 0x03,
        (SendOp::Send, Only) => 0x04,
        (SendOp::SendWithImm { .. }, Only) => 0x05,
        (SendOp::SendWithInv { .. }, Last) => 0x16,
        (SendOp::SendWithInv { .. }, Only) => 0x17,
        (SendOp::Write { .. } | SendOp::WriteWithImm { .. }, First) => 0x06,
        (SendOp::Write { .. } | SendOp::WriteWithImm { .. }, Middle) => 0x07,
        (SendOp::Write { .. }, Last) => 0x08,
        (SendOp::WriteWithImm { .. }, Last) => 0x09,
        (SendOp::Write { .. }, Only) => 0x0A,
        (SendOp::WriteWithImm { .. }, Only) => 0x0B,
        _ => return None,
    };
    match t {
        QpType::Rc => Some(Opcode(rc)),
        QpType::Uc if rc <= 0x0B => Some(Opcode(rc + 0x20)),
        QpType::Ud => match (op, p) {
            (SendOp::Send, Only) => Some(Opcode::UD_SEND_ONLY),
            (SendOp::SendWithImm { .. }, Only) => Some(Opcode::UD_SEND_ONLY_IMM),
            _ => None,
        },
        _ => None,
    }
}

fn npkts(len: usize, mtu: usize) -> u32 {
    (len.div_ceil(mtu.max(1))).max(1) as u32
}

/// Run the requester: send as much of the SQ as the rules allow. Every iteration either
/// sends a packet, executes a local op, or advances past a WQE, and the budget bounds it.
pub(crate) fn run(qp: &mut QpCtx, env: &mut DeviceCtx, now: u64) {
    let mut budget: usize = 1 << 22;
    let mut in_wqe = qp.req.offset > 0;
    // Packets past the oldest unacknowledged one that are in flight no more (held by
    // the peer, as its last SACK showed, or READ responses here), for that oldest one:
    // nothing is acknowledged or arrives while this sends, so it is counted once.
    let mut arrived: Option<(u32, i32)> = None;
    while budget > 0 {
        budget -= 1;
        if !matches!(qp.state, QpState::Rts | QpState::Sqd) || qp.req.rnr_until.is_some() {
            break;
        }
        if env.out.len() >= OUTBOX_MAX {
            // Continue once the driver has taken what is queued (Rnic::poll_transmit).
            if !qp.req.tx_wait {
                qp.req.tx_wait = true;
                env.tx_wait.push_back(qp.qpn);
            }
            break;
        }
        let cur = qp.req.cur;
        let mtu = if qp.qp_type == QpType::Ud {
            usize::MAX >> 1
        } else {
            qp.mtu()
        };
        let max_rd = u32::from(qp.attr.max_rd_atomic.max(1));
        let rd_atomic = qp.req.rd_atomic;
        // RC pacing: stop while the PSN about to go out is too far past the oldest
        // unacknowledged one; ACK progress runs the requester again.
        let paced = qp
            .sq
            .get(cur)
            .filter(|w| qp.qp_type == QpType::Rc && !w.done && !w.is_local());
        if let (Some(w), Some(base)) = (paced, qp.oldest_unacked()) {
            let next = if w.started {
                psn::add(w.first_psn, (qp.req.offset / mtu.max(1)) as u32)
            } else {
                qp.req.next_psn
            };
            // The peer's hold window bounds what may be outstanding; the congestion
            // window, what is in flight (packets a SACK showed held are not; counted
            // only when it matters, as this runs for every packet).
            let out = psn::diff(next, base);
            let cwnd = qp.req.cc.window() as i32;
            if out >= HOLD_SPAN {
                break;
            }
            if out >= cwnd {
                let gone = match arrived {
                    Some((b, n)) if b == base => n,
                    _ => {
                        let n =
                            qp.req.rec.sacked_from(base) as i32 + qp.read_arrived_from(base) as i32;
                        arrived = Some((base, n));
                        n
                    }
                };
                if out - gone >= cwnd {
                    break;
                }
            }
        }
        let placeable = match if in_wqe {
            Place::No
        } else {
            may_place(qp, env, cur, now)
        } {
            Place::Now => true,
            Place::No => false,
            // Continue once the WQEs before it are finished (completer progress runs the
            // requester again): placing it is worth a round trip, and sending its packets
            // would keep every WRITE after it from being placed while they are in flight.
            Place::Wait => break,
        };
        let Some(w) = qp.sq.get_mut(cur) else {
            break;
        };
        if w.done {
            // A local op executed, or a WQE acknowledged, before a rewind: skip it.
            qp.req.cur += 1;
            qp.req.offset = 0;
            in_wqe = false;
            continue;
        }
        if !in_wqe {
            if qp.state == QpState::Sqd && !w.started {
                break;
            }
            // A WQE sent before (resent after a go-back-N) passed both checks then: the
            // READs and atomics still counted in the window now are ones after it that
            // finished first (see `completion::release_rd`), which it must not wait for.
            if !w.started && w.wr.flags.contains(SendFlags::FENCE) && rd_atomic > 0 {
                break;
            }
            if !w.started && w.is_rd_atomic() && rd_atomic >= max_rd {
                break;
            }
        }
        match w.wr.op {
            SendOp::LocalInv { rkey } => {
                let r = env.ctx.invalidate_rkey(qp.pd, rkey);
                w.done = true;
                w.started = true;
                qp.req.cur += 1;
                if let Err(s) = r {
                    w.status = Some(s);
                    completion::fail(qp, env, now, None, "local invalidate failed");
                    return;
                }
                continue;
            }
            SendOp::BindMw(ref b) => {
                let r = env.ctx.bind_mw(qp.pd, qp.qpn, b);
                w.done = true;
                w.started = true;
                qp.req.cur += 1;
                if let Err(s) = r {
                    w.status = Some(s);
                    completion::fail(qp, env, now, None, "memory window bind failed");
                    return;
                }
                continue;
            }
            _ => {}
        }
        if !w.started {
            w.started = true;
            w.first_psn = qp.req.next_psn;
            // Placed only behind WQEs whose effects are all in the peer's memory already
            // (finished, or placed themselves): a WRITE placed now would otherwise land
            // before the packets of an earlier one, which a peer polling its memory sees.
            w.placed = placeable && place(env, w, qp.pd, qp.peer, qp.attr.dest_qp_num);
            if w.placed && !matches!(w.wr.op, SendOp::WriteWithImm { .. }) {
                // One-sided indeed: the bytes are where they belong, nothing tells the
                // peer (it has nothing to do), and the WQE is finished as a local
                // operation is, taking no PSN.
                match w.wr.op {
                    SendOp::Read { .. } => env.stats.placed_reads += 1,
                    _ => env.stats.placed_writes += 1,
                }
                if env.trace_placed {
                    trace_placed(env, qp, cur);
                }
                let w = &mut qp.sq[cur];
                w.npkts = 0;
                w.last_psn = psn::add(w.first_psn, psn::MASK);
                w.done = true;
                qp.req.cur += 1;
                continue;
            }
            if w.placed {
                env.stats.placed_writes += 1;
            }
            w.npkts = if w.is_atomic() || w.placed {
                1
            } else {
                npkts(w.len, mtu)
            };
            w.last_psn = psn::add(w.first_psn, w.npkts - 1);
            qp.req.next_psn = psn::add(w.last_psn, 1);
        }
        let dst_tos = match (&w.ud, qp.peer) {
            (Some(u), _) => Some((u.dst, u.tos, u.qpn)),
            (None, Some(p)) => Some((p, qp.attr.ah_attr.grh.traffic_class, qp.attr.dest_qp_num)),
            (None, None) => None,
        };
        let Some((dst, tos, dqpn)) = dst_tos else {
            w.status = Some(WcStatus::LocQpOpErr);
            completion::fail(qp, env, now, None, "no destination for the work request");
            return;
        };
        let is_rc = qp.qp_type == QpType::Rc;
        let (pkt_psn, end_psn);
        // Whether this packet asks for an ACK (READ and atomic requests always do).
        let mut asks_ack = true;
        match w.wr.op {
            SendOp::Read { remote_addr, rkey } => {
                let k = w.acked_pkts.min(w.npkts.saturating_sub(1));
                w.read_req_k = k;
                let skip = (k as usize).saturating_mul(mtu).min(w.len);
                pkt_psn = psn::add(w.first_psn, k);
                // A request asks for everything until a response shows the responder has
                // the READ (before that, a resent request may be the first it sees, and
                // must say the READ's whole length, which its PSNs follow); after that, a
                // resent one asks for a window's worth (see `SendWqe::read_req_end`).
                let end = if k > 0 && psn::lt(pkt_psn, qp.req.high_psn) {
                    k.saturating_add(qp.req.cc.window().max(1)).min(w.npkts)
                } else {
                    w.npkts
                };
                // Nor past responses that arrived already (see `completer`'s `read_response`):
                // a request for exactly the missing ones is answered with just them.
                let end = w
                    .read_ooo
                    .range(k..)
                    .next()
                    .map_or(end, |&r| end.min(r.max(k + 1)));
                w.read_req_end = end;
                end_psn = w.last_psn;
                let dma_len = ((end - k) as usize).saturating_mul(mtu).min(w.len - skip);
                let h = read_request(dqpn, pkt_psn, remote_addr, rkey, skip, dma_len);
                env.send(qp.qpn, dst, tos, &h, &[]);
                w.sent_all = true;
                w.in_rd_window = true;
                qp.req.rd_atomic += 1;
                qp.req.cur += 1;
                qp.req.offset = 0;
                in_wqe = false;
            }
            SendOp::CompareSwap {
                remote_addr,
                rkey,
                compare,
                swap,
            } => {
                pkt_psn = w.first_psn;
                end_psn = pkt_psn;
                let mut bth = Bth::new(Opcode::RC_COMPARE_SWAP, dqpn, pkt_psn);
                bth.ack_req = true;
                let mut h = Headers::new(bth);
                h.atomic_eth = Some(AtomicEth {
                    va: remote_addr,
                    rkey,
                    swap_add: swap,
                    compare,
                });
                env.send(qp.qpn, dst, tos, &h, &[]);
                w.sent_all = true;
                w.in_rd_window = true;
                qp.req.rd_atomic += 1;
                qp.req.cur += 1;
                qp.req.offset = 0;
                in_wqe = false;
            }
            SendOp::FetchAdd {
                remote_addr,
                rkey,
                add,
            } => {
                pkt_psn = w.first_psn;
                end_psn = pkt_psn;
                let mut bth = Bth::new(Opcode::RC_FETCH_ADD, dqpn, pkt_psn);
                bth.ack_req = true;
                let mut h = Headers::new(bth);
                h.atomic_eth = Some(AtomicEth {
                    va: remote_addr,
                    rkey,
                    swap_add: add,
                    compare: 0,
                });
                env.send(qp.qpn, dst, tos, &h, &[]);
                w.sent_all = true;
                w.in_rd_window = true;
                qp.req.rd_atomic += 1;
                qp.req.cur += 1;
                qp.req.offset = 0;
                in_wqe = false;
            }
            SendOp::Write { remote_addr, rkey }
            | SendOp::WriteWithImm {
                remote_addr, rkey, ..
            } if w.placed => {
                pkt_psn = w.first_psn;
                end_psn = pkt_psn;
                send_placed(env, qp.qpn, dst, tos, dqpn, w, remote_addr, rkey);
                qp.req.noack_pkts = 0;
                w.sent_all = true;
                qp.req.cur += 1;
                qp.req.offset = 0;
                in_wqe = false;
            }
            _ => {
                // SEND / WRITE data packet at the current offset.
                let offset = qp.req.offset.min(w.len);
                let idx = (offset / mtu.max(1)) as u32;
                let plen = (w.len - offset).min(mtu);
                let p = pos(idx, w.npkts);
                let Some(opcode) = data_opcode(qp.qp_type, &w.wr.op, p) else {
                    w.status = Some(WcStatus::LocQpOpErr);
                    completion::fail(qp, env, now, None, "operation not valid for the QP type");
                    return;
                };
                pkt_psn = psn::add(w.first_psn, idx);
                end_psn = pkt_psn;
                let last = matches!(p, Pos::Last | Pos::Only);
                let mut bth = Bth::new(opcode, dqpn, pkt_psn);
                bth.solicited = last && w.wr.flags.contains(SendFlags::SOLICITED);
                if is_rc {
                    qp.req.noack_pkts += 1;
                    // The responder ACKs only what asks for it: ask at least four times
                    // per window, or a window smaller than MAX_PKT_PER_ACK (after loss)
                    // would stall, full of packets no ACK will answer until a timeout.
                    let every = MAX_PKT_PER_ACK.min((qp.req.cc.window() / 4).max(1));
                    bth.ack_req = last || qp.req.noack_pkts >= every;
                    if bth.ack_req {
                        qp.req.noack_pkts = 0;
                    }
                    asks_ack = bth.ack_req;
                }
                let pd = qp.pd;
                let sent = send_data(env, qp.qpn, dst, tos, bth, w, pd, offset, plen, p);
                if let Err(s) = sent {
                    w.set_error(s);
                    completion::fail(qp, env, now, None, "send data not read from local memory");
                    return;
                }
                qp.req.offset = offset + plen;
                in_wqe = true;
                if last {
                    w.sent_all = true;
                    if !is_rc {
                        w.done = true;
                    }
                    qp.req.cur += 1;
                    qp.req.offset = 0;
                    in_wqe = false;
                }
            }
        }
        // Count packets below the highest PSN ever sent as retransmissions.
        let resend = psn::lt(pkt_psn, qp.req.high_psn);
        if resend {
            env.stats.retransmits += 1;
        }
        if psn::ge(end_psn, qp.req.high_psn) {
            qp.req.high_psn = psn::add(end_psn, 1);
            qp.req.cc.on_sent(qp.req.high_psn);
        }
        if is_rc {
            if asks_ack {
                // A READ is timed to its first response: a round trip, not the transfer.
                qp.req.rtt.time(pkt_psn, now, resend);
            }
            qp.arm_timers(now);
        }
    }
    // UC/UD sends and local ops finish without a response: report them now.
    completion::complete_front(qp, env, now);
}

/// Below this many bytes a WRITE in a stream goes as packets while the peer's device polls
/// ([`may_place`]): a cross-memory copy is a system call, about 1.5 µs, where the packets
/// of a small WRITE cost a peer that polls less.
const PLACE_SMALL: usize = 4096;

/// Small WRITEs that start closer together than this are a stream ([`may_place`]): a
/// latency test's WRITEs are a round trip apart, a few microseconds at least.
const STREAM_GAP_NS: u64 = 3_000;

/// What the requester does with a WQE it has not started ([`may_place`]).
enum Place {
    /// Send its packets.
    No,
    /// Try to place it ([`place`]).
    Now,
    /// Wait for the WQEs before it to finish, then place it.
    Wait,
}

/// Whether WQE `cur`, not started, may be placed ([`place`]): an RC WRITE or READ with
/// data, to a peer the device may place into, behind WQEs that are all finished or placed
/// (else it waits for them, if the peer's grants would take it).
fn may_place(qp: &mut QpCtx, env: &mut DeviceCtx, cur: usize, now: u64) -> Place {
    let (Some(p), Some(peer)) = (env.placement.as_mut(), qp.peer) else {
        return Place::No;
    };
    let Some(w) = qp.sq.get(cur) else {
        return Place::No;
    };
    if qp.qp_type != QpType::Rc || w.started || w.len == 0 || w.len > u32::MAX as usize {
        return Place::No;
    }
    let (remote_addr, rkey, write) = match w.wr.op {
        SendOp::Write { remote_addr, rkey } => (remote_addr, rkey, true),
        // Its placed WRITE wakes the peer anyway: a small one goes as its packet alone.
        SendOp::WriteWithImm {
            remote_addr, rkey, ..
        } if w.len >= PLACE_SMALL => (remote_addr, rkey, true),
        SendOp::Read { remote_addr, rkey } => (remote_addr, rkey, false),
        _ => return Place::No,
    };
    // A small WRITE in a stream of them (started within STREAM_GAP_NS of the last, with
    // nothing from the peer in between) to a peer whose device polls goes as packets: it
    // takes them as they come, and they cost less than a cross-memory copy each, a
    // system call. A lone one is placed, as is one the peer answered since the last (a
    // request to this QP, or a WRITE it placed in our memory: a ping-pong), and one to a
    // peer whose device threads all sleep: its program may be watching its memory (a
    // latency test, or a consumer spinning on a ring the stream fills) on the core its
    // device's thread would need, and sees a placed WRITE with none of them having to
    // run. (A packet would wake that thread to take the core from it.)
    //
    // The mark is taken when the WQE's way is settled (not while it waits, or it would
    // be a stream with itself when it comes back). The peer's count is asked for only
    // when the last small WRITE was recent (it takes locks, on a latency test's path):
    // u64::MAX, unknown, makes the next one lone.
    let small = write && w.len < PLACE_SMALL;
    let last = qp
        .req
        .small_write_at
        .filter(|m| small && now.saturating_sub(m.0) < STREAM_GAP_NS);
    let wrote = if last.is_some() {
        p.peer_wrote(peer)
    } else {
        u64::MAX
    };
    let mark = small.then_some((now, qp.resp.epsn, wrote));
    let streaming = matches!((mark, last), (Some(m), Some((_, epsn, was)))
        if was != u64::MAX && (epsn, was) == (m.1, m.2));
    let place = if streaming && p.peer_polls(peer) {
        Place::No
    } else if qp.sq.range(..cur).all(|e| e.done || e.placed) {
        Place::Now
    } else if p.reachable(peer, qp.attr.dest_qp_num, rkey, remote_addr, w.len, write) {
        return Place::Wait;
    } else {
        Place::No
    };
    if mark.is_some() {
        qp.req.small_write_at = mark;
    }
    place
}

/// Copy WRITE `w`'s payload straight into the peer's memory, or READ `w`'s out of it into
/// its scatter list, if the device's [`crate::Placement`] can (a same-host peer whose
/// grants allow it): true if every byte is there.
fn place(
    env: &mut DeviceCtx,
    w: &SendWqe,
    pd: PdId,
    peer: Option<std::net::SocketAddr>,
    dqpn: u32,
) -> bool {
    let (Some(p), Some(peer)) = (env.placement.as_mut(), peer) else {
        return false;
    };
    if w.len == 0 || w.len > u32::MAX as usize {
        return false;
    }
    match w.wr.op {
        SendOp::Write { remote_addr, rkey }
        | SendOp::WriteWithImm {
            remote_addr, rkey, ..
        } => {
            let gathered;
            let inline;
            let src: &[(u64, usize)] = match &w.inline {
                Some(d) => {
                    inline = [(d.as_ptr() as u64, d.len())];
                    &inline
                }
                None => match env
                    .ctx
                    .local_iovecs(pd, &w.wr.sg_list, w.len, Access::empty())
                {
                    Ok(v) => {
                        gathered = v;
                        &gathered
                    }
                    // The packets' path reports the error, in the WR's completion.
                    Err(_) => return false,
                },
            };
            p.write(peer, dqpn, rkey, remote_addr, src)
        }
        SendOp::Read { remote_addr, rkey } => {
            match env
                .ctx
                .local_iovecs(pd, &w.wr.sg_list, w.len, Access::LOCAL_WRITE)
            {
                // A failed copy may have written part of the scatter list: the READ's
                // responses overwrite it all.
                Ok(dst) => p.read(peer, dqpn, rkey, remote_addr, &dst),
                Err(_) => false,
            }
        }
        _ => false,
    }
}

/// Queue the packets that stand for WQE `cur`, placed with no packet, for the trace: the
/// WRITE ONLY it would have been, or the READ request and its READ RESPONSE ONLY (both
/// with the PSN the next request takes, since it took none), their payload cut to
/// [`crate::grants::PLACED_TRACE_PAYLOAD`] bytes and read back from this process's memory.
fn trace_placed(env: &mut DeviceCtx, qp: &QpCtx, cur: usize) {
    let (Some(w), Some(peer)) = (qp.sq.get(cur), qp.peer) else {
        return;
    };
    let dqpn = qp.attr.dest_qp_num;
    let tos = qp.attr.ah_attr.grh.traffic_class;
    let shown = w.len.min(crate::grants::PLACED_TRACE_PAYLOAD);
    let mut payload = vec![0u8; shown];
    let got = match &w.inline {
        Some(d) => {
            payload.copy_from_slice(&d[..shown]);
            true
        }
        None => env
            .ctx
            .gather(qp.pd, &w.wr.sg_list, 0, &mut payload)
            .is_ok(),
    };
    if !got {
        payload.clear();
    }
    let (opcode, remote_addr, rkey, how) = match w.wr.op {
        SendOp::Write { remote_addr, rkey } => (
            Opcode::RC_RDMA_WRITE_ONLY,
            remote_addr,
            rkey,
            "written into the responder's memory by the requester itself (process_vm_writev)",
        ),
        SendOp::Read { remote_addr, rkey } => (
            Opcode::RC_RDMA_READ_REQUEST,
            remote_addr,
            rkey,
            "read out of the responder's memory by the requester itself (process_vm_readv)",
        ),
        _ => return,
    };
    let note = format!(
        "softrdma: a one-sided {} of {} bytes between same-host devices, {how} after the \
         responder's checks, with no packet and no PSN; this packet stands for it{}",
        if opcode == Opcode::RC_RDMA_READ_REQUEST {
            "READ"
        } else {
            "WRITE"
        },
        w.len,
        if shown < w.len && opcode != Opcode::RC_RDMA_READ_REQUEST {
            format!(" (its first {shown} bytes shown)")
        } else {
            String::new()
        },
    );
    let mut bth = Bth::new(opcode, dqpn, qp.req.next_psn);
    bth.ack_req = true;
    let mut h = Headers::new(bth);
    h.reth = Some(Reth {
        va: remote_addr,
        rkey,
        dma_len: w.len as u32,
    });
    let request: &[u8] = if opcode == Opcode::RC_RDMA_READ_REQUEST {
        &[]
    } else {
        &payload
    };
    env.trace_placed_packet(qp.qpn, peer, tos, &h, request, false, note.clone());
    if opcode == Opcode::RC_RDMA_READ_REQUEST {
        let mut h = Headers::new(Bth::new(
            Opcode::RC_RDMA_READ_RESPONSE_ONLY,
            qp.qpn,
            qp.req.next_psn,
        ));
        h.aeth = Some(softrdma_wire::Aeth {
            syndrome: softrdma_wire::Syndrome::Ack { credits: 31 },
            msn: 0,
        });
        let note = if shown < w.len {
            format!("{note} (its first {shown} bytes shown)")
        } else {
            note
        };
        env.trace_placed_packet(dqpn, peer, tos, &h, &payload, true, note);
    }
}

/// Queue the placed WRITE that stands for `w` (its payload already in the peer): the
/// headers of an RC WRITE ONLY (with immediate), asking for an ACK.
#[allow(clippy::too_many_arguments)]
fn send_placed(
    env: &mut DeviceCtx,
    qpn: u32,
    dst: std::net::SocketAddr,
    tos: u8,
    dqpn: u32,
    w: &SendWqe,
    remote_addr: u64,
    rkey: u32,
) {
    let imm = match w.wr.op {
        SendOp::WriteWithImm { imm, .. } => Some(imm),
        _ => None,
    };
    let (as_op, op) = match imm {
        Some(_) => (
            Opcode::RC_RDMA_WRITE_ONLY_IMM,
            softrdma_wire::ext::PLACED_WRITE_IMM,
        ),
        None => (Opcode::RC_RDMA_WRITE_ONLY, softrdma_wire::ext::PLACED_WRITE),
    };
    let mut bth = Bth::new(as_op, dqpn, w.first_psn);
    bth.ack_req = true;
    bth.solicited = w.wr.flags.contains(SendFlags::SOLICITED);
    let mut h = Headers::new(bth);
    h.reth = Some(Reth {
        va: remote_addr,
        rkey,
        dma_len: w.len as u32,
    });
    h.imm = imm;
    env.send_placed(qpn, dst, tos, &h, op);
}

/// Build and queue the SEND / WRITE data packet of `w` at byte `offset` (`plen` bytes, at
/// position `p` of the message), with the BTH the caller decided (opcode, PSN, AckReq,
/// solicited): the extension headers its position needs and its payload from the WQE's
/// inline data or its gather list.
#[allow(clippy::too_many_arguments)]
fn send_data(
    env: &mut DeviceCtx,
    qpn: u32,
    dst: std::net::SocketAddr,
    tos: u8,
    bth: Bth,
    w: &SendWqe,
    pd: PdId,
    offset: usize,
    plen: usize,
    p: Pos,
) -> Result<(), WcError> {
    let mut h = Headers::new(bth);
    if let Some(u) = &w.ud {
        h.deth = Some(Deth {
            qkey: u.qkey,
            src_qp: qpn,
        });
    }
    if matches!(p, Pos::First | Pos::Only) {
        if let SendOp::Write { remote_addr, rkey }
        | SendOp::WriteWithImm {
            remote_addr, rkey, ..
        } = w.wr.op
        {
            h.reth = Some(Reth {
                va: remote_addr,
                rkey,
                dma_len: w.len as u32,
            });
        }
    }
    if matches!(p, Pos::Last | Pos::Only) {
        match w.wr.op {
            SendOp::SendWithImm { imm } | SendOp::WriteWithImm { imm, .. } => h.imm = Some(imm),
            SendOp::SendWithInv { invalidate_rkey } => h.ieth = Some(invalidate_rkey),
            _ => {}
        }
    }
    env.send_with(qpn, dst, tos, &h, plen, |ctx, slot| match &w.inline {
        Some(data) => match data.get(offset..offset + plen) {
            Some(s) => {
                slot.copy_from_slice(s);
                Ok(())
            }
            None => Err(WcError::new(WcStatus::LocLenErr, WcDetail::MessageTooLong)),
        },
        None if plen == 0 => Ok(()),
        None => ctx.gather(pd, &w.wr.sg_list, offset, slot),
    })
}

/// A READ request at PSN `p` (asking for an ACK, as every READ does) for `dma_len`
/// bytes of the READ's remote buffer at `remote_addr`, from byte `skip` on: the first
/// request, one resent by a go-back-N, and one asking again for some responses alike.
fn read_request(
    dqpn: u32,
    p: u32,
    remote_addr: u64,
    rkey: u32,
    skip: usize,
    dma_len: usize,
) -> Headers {
    let mut bth = Bth::new(Opcode::RC_RDMA_READ_REQUEST, dqpn, p);
    bth.ack_req = true;
    let mut h = Headers::new(bth);
    h.reth = Some(Reth {
        va: remote_addr.wrapping_add(skip as u64),
        rkey,
        dma_len: dma_len as u32,
    });
    h
}

/// Where an RC QP's packets go: the peer's address, the traffic class, the peer's QPN.
fn rc_dest(qp: &QpCtx) -> Option<(std::net::SocketAddr, u8, u32)> {
    qp.peer
        .map(|p| (p, qp.attr.ah_attr.grh.traffic_class, qp.attr.dest_qp_num))
}

/// Resend the one request packet with PSN `k` (a SEND or WRITE packet the peer reported
/// missing), asking for an ACK, without moving the requester from where it is: the
/// selective repeat of `crate::completer`. False, with nothing sent, when `k` is not a
/// data packet of a WQE in flight (a READ or atomic request, or nothing); the caller
/// then goes back N.
pub(crate) fn resend_one(qp: &mut QpCtx, env: &mut DeviceCtx, now: u64, k: u32) -> bool {
    let mtu = qp.mtu();
    let Some((dst, tos, dqpn)) = rc_dest(qp) else {
        return false;
    };
    let Some(w) = qp
        .sq
        .iter_mut()
        .find(|w| w.started && !w.done && psn::le(w.first_psn, k) && psn::le(k, w.last_psn))
    else {
        return false;
    };
    if w.is_rd_atomic() || w.is_local() || qp.qp_type != QpType::Rc {
        return false;
    }
    if w.placed {
        // Its payload is in the peer already: the placed WRITE again, nothing copied.
        if let SendOp::Write { remote_addr, rkey }
        | SendOp::WriteWithImm {
            remote_addr, rkey, ..
        } = w.wr.op
        {
            send_placed(env, qp.qpn, dst, tos, dqpn, w, remote_addr, rkey);
            env.stats.retransmits += 1;
            qp.arm_timers(now);
            return true;
        }
        return false;
    }
    let idx = psn::diff(k, w.first_psn) as u32;
    let offset = (idx as usize).saturating_mul(mtu);
    if offset > w.len || (offset == w.len && w.len > 0) {
        return false;
    }
    let plen = (w.len - offset).min(mtu);
    let p = pos(idx, w.npkts);
    let Some(opcode) = data_opcode(qp.qp_type, &w.wr.op, p) else {
        return false;
    };
    let mut bth = Bth::new(opcode, dqpn, k);
    bth.solicited = matches!(p, Pos::Last | Pos::Only) && w.wr.flags.contains(SendFlags::SOLICITED);
    bth.ack_req = true;
    let pd = qp.pd;
    if let Err(s) = send_data(env, qp.qpn, dst, tos, bth, w, pd, offset, plen, p) {
        w.set_error(s);
        completion::fail(qp, env, now, None, "send data not read from local memory");
        return true;
    }
    env.stats.retransmits += 1;
    qp.arm_timers(now);
    true
}

/// Ask again for response packets `k..k + n` of the started READ whose first PSN is
/// `first`: a READ request at the PSN of packet `k` whose RETH names exactly those bytes,
/// which a responder answers with just them (see `responder::replay_end`; rxe checks a
/// duplicate against the original the same way). False when there is no such READ.
pub(crate) fn resend_read_part(
    qp: &mut QpCtx,
    env: &mut DeviceCtx,
    now: u64,
    first: u32,
    k: u32,
    n: u32,
) -> bool {
    let mtu = qp.mtu();
    let Some((dst, tos, dqpn)) = rc_dest(qp) else {
        return false;
    };
    let Some(w) = qp.unfinished_at(first) else {
        return false;
    };
    let SendOp::Read { remote_addr, rkey } = w.wr.op else {
        return false;
    };
    let skip = (k as usize).saturating_mul(mtu);
    if n == 0 || k.saturating_add(n) > w.npkts || skip >= w.len.max(1) {
        return false;
    }
    let dma_len = (n as usize).saturating_mul(mtu).min(w.len - skip);
    let h = read_request(dqpn, psn::add(first, k), remote_addr, rkey, skip, dma_len);
    env.send(qp.qpn, dst, tos, &h, &[]);
    env.stats.retransmits += 1;
    qp.arm_timers(now);
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_and_opcodes() {
        assert!(pos(0, 1) == Pos::Only);
        assert!(pos(0, 3) == Pos::First);
        assert!(pos(1, 3) == Pos::Middle);
        assert!(pos(2, 3) == Pos::Last);
        assert_eq!(npkts(0, 256), 1);
        assert_eq!(npkts(256, 256), 1);
        assert_eq!(npkts(257, 256), 2);
        assert_eq!(
            data_opcode(QpType::Uc, &SendOp::Send, Pos::Only),
            Some(Opcode::UC_SEND_ONLY)
        );
        assert_eq!(
            data_opcode(
                QpType::Rc,
                &SendOp::SendWithInv { invalidate_rkey: 1 },
                Pos::Last
            ),
            Some(Opcode::RC_SEND_LAST_INV)
        );
        assert_eq!(
            data_opcode(
                QpType::Uc,
                &SendOp::SendWithInv { invalidate_rkey: 1 },
                Pos::Last
            ),
            None
        );
        assert_eq!(
            data_opcode(
                QpType::Rc,
                &SendOp::WriteWithImm {
                    remote_addr: 0,
                    rkey: 0,
                    imm: 0
                },
                Pos::Only
            ),
            Some(Opcode::RC_RDMA_WRITE_ONLY_IMM)
        );
    }
}
