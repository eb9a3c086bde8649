//! The unreliable services: UC (any PSN, no acknowledgements, a lost packet drops its
//! message) and UD (one packet per message, a Q_Key, the GRH placed before the payload).

use super::*;

/// UC: no ACKs. A gap abandons the message in progress; the next FIRST/ONLY resynchronises.
pub(super) fn uc_request(
    qp: &mut QpCtx,
    env: &mut DeviceCtx,
    now: u64,
    h: &Headers,
    payload: &[u8],
) {
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

/// UD: Q_Key check (mismatch: silently dropped), then one receive WQE gets a 40-byte GRH
/// (carrying the datagram's traffic class `tos`) followed by the payload.
#[allow(clippy::too_many_arguments)]
pub(super) fn ud_request(
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
