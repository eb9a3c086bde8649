//! READ responses: each placed where it goes as it arrives, past a missing one too, and
//! the missing ones asked for again alone rather than by a go-back-N.

use super::*;

/// Runs of a READ's response packets asked for again at once, at most.
const READ_HOLES_PER_ASK: usize = 8;

/// Ask for the response packets the READ starting at `first` is missing before the last
/// one that arrived (and after it, when every response was sent: `read_whole_sent`),
/// each run of them in one request for exactly those packets, at most once per round
/// trip (see `Recovery::read_part_due`). Instead of a go-back-N from the first missing
/// one: the responses that arrived past it are in place already. A responder that drops
/// the rest of its stream on such a request (one that answers every duplicate with the
/// rest) is caught up by the round-trip timer, which goes back N.
pub(super) fn ask_read_holes(qp: &mut QpCtx, env: &mut DeviceCtx, now: u64, first: u32) {
    let Some(w) = qp.unfinished_at(first) else {
        return;
    };
    let mut runs = Vec::new();
    let mut k = w.acked_pkts;
    for &r in &w.read_ooo {
        if runs.len() >= READ_HOLES_PER_ASK {
            break;
        }
        if r > k {
            runs.push((k, r - k));
        }
        k = k.max(r + 1);
    }
    if w.read_whole_sent && k < w.npkts && runs.len() < READ_HOLES_PER_ASK {
        runs.push((k, w.npkts - k));
    }
    // The newest part asked again whose first response has arrived: a part asked before
    // it and still missing was lost again (the responder answers the requests in the
    // order they came), and is asked for at once rather than after a round trip (RACK's
    // rule, as `Recovery::on_sack` applies it to resent packets).
    let (acked, last) = (w.acked_pkts, w.last_psn);
    let arrived = |q: u32| {
        let i = psn::diff(q, first);
        i >= 0 && ((i as u32) < acked || w.read_ooo.contains(&(i as u32)))
    };
    let newest_arrived = qp
        .req
        .rec
        .newest_resend_arrived(|q| psn::le(first, q) && psn::le(q, last) && arrived(q));
    let mut asked = false;
    let mut congested = None;
    for (k, n) in runs {
        let q = psn::add(first, k);
        if !qp
            .req
            .rec
            .read_part_due(q, now, newest_arrived, &qp.req.rtt)
        {
            continue;
        }
        if !requester::resend_read_part(qp, env, now, first, k, n) {
            return;
        }
        if qp.req.rec.read_part_asked(q, n, now) {
            congested.get_or_insert(q);
        }
        debug!(
            qpn = format_args!("{:#x}", qp.qpn),
            psn = q,
            packets = n,
            "READ responses asked for again"
        );
        asked = true;
    }
    if asked {
        if let Some(oldest) = qp.oldest_unacked() {
            qp.req.rec.forget_resent_before(oldest);
        }
        if let Some(q) = congested {
            qp.req.lost(Loss::Run(q));
        }
        qp.req.rtt.on_resend();
        // The round-trip timer now waits for the answer to these requests.
        qp.req.rec.disarm_rtt_timer();
        qp.arm_timers(now);
    }
}

/// One READ response packet, for the started READ whose PSNs it falls in: placed where
/// it goes in local memory even past a missing one (noted in `read_ooo`), whose packets
/// are then asked for alone (see [`ask_read_holes`]). Returns progress.
pub(super) fn read_response(
    qp: &mut QpCtx,
    env: &mut DeviceCtx,
    now: u64,
    h: &Headers,
    position: Position,
    payload: &[u8],
) -> bool {
    let mtu = qp.mtu();
    let pd = qp.pd;
    let p = h.bth.psn;
    let Some(w) = qp
        .sq
        .iter_mut()
        .take_while(|w| w.started)
        .find(|w| !w.done && w.is_read() && psn::le(w.first_psn, p) && psn::le(p, w.last_psn))
    else {
        dropped!(
            trace,
            env,
            qp,
            h,
            duplicates,
            "READ response of no READ under way"
        );
        return false;
    };
    let k = psn::diff(p, w.first_psn) as u32;
    if k < w.acked_pkts || w.read_ooo.contains(&k) {
        let expected = psn::add(w.first_psn, w.acked_pkts);
        dropped!(trace, env, qp, h, duplicates, "READ response already in place"; expected);
        return false;
    }
    // Positions count from whichever request the responder answers (the original, or
    // one asking again for some packets), so only the last packet's is certain.
    let pos_ok = k + 1 < w.npkts || matches!(position, Position::Last | Position::Only);
    let offset = (k as usize).saturating_mul(mtu);
    let want_len = w.len.saturating_sub(offset).min(mtu);
    if !pos_ok || payload.len() != want_len {
        let why = "READ response of the wrong position or length";
        dropped!(debug, env, qp, h, malformed, why; len = payload.len(), want_len);
        return false;
    }
    if !payload.is_empty() {
        if let Err(s) = env.ctx.scatter(pd, &w.wr.sg_list, offset, payload) {
            w.set_error(s);
            fail(
                qp,
                env,
                now,
                None,
                "READ response not written to local memory",
            );
            return false;
        }
    }
    if k == w.acked_pkts {
        w.acked_pkts = k + 1;
        while w.read_ooo.remove(&w.acked_pkts) {
            w.acked_pkts += 1;
        }
    } else {
        w.read_ooo.insert(k);
    }
    let first = w.first_psn;
    if w.acked_pkts >= w.npkts {
        mark_done(w);
    } else if !w.read_ooo.is_empty() {
        ask_read_holes(qp, env, now, first);
    } else if w.acked_pkts >= w.read_req_end {
        // The part a resent request asked for has come: ask for the next part (from
        // the front, as a go-back-N does; no loss, so no retry is spent and the window
        // stays).
        rewind(qp);
    }
    qp.req.rec.on_read_response(first);
    true
}
