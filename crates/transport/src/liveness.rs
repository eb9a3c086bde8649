//! The keepalive's protocol side ([`crate::keepalive`] says why and how): a QP that
//! enters RTS arms it, every packet taken from the peer counts as hearing from it, and
//! the deadline sends probes and finally declares the peer lost.

use softrdma_wire::{psn, Bth, Headers, Opcode, Reth};
use tracing::{debug, trace, warn};

use crate::device_ctx::DeviceCtx;
use crate::keepalive::{KaState, Keepalive};
use crate::qp::QpCtx;
use crate::verbs::{QpState, QpType};

/// The QP entered RTS with settings `cfg`: the quiet time starts now.
pub(crate) fn arm(qp: &mut QpCtx, cfg: Option<Keepalive>, now: u64) {
    let cfg = cfg.filter(|_| qp.qp_type == QpType::Rc && qp.peer.is_some());
    qp.ka = KaState {
        cfg,
        heard: now,
        deadline: cfg.map(|c| now.saturating_add(c.idle_ns)),
        sent: 0,
    };
}

/// The QP left the states that probe (ERR, RESET): no more timer.
pub(crate) fn disarm(qp: &mut QpCtx) {
    qp.ka.deadline = None;
    qp.ka.sent = 0;
}

/// A packet from the peer was taken: it is alive.
#[inline]
pub(crate) fn heard(qp: &mut QpCtx, now: u64) {
    qp.ka.heard = now;
    qp.ka.sent = 0;
}

/// The keepalive deadline has come (or not yet: nothing happens then). Returns true
/// when the peer was declared lost: the caller fails the QP.
pub(crate) fn on_timer(qp: &mut QpCtx, env: &mut DeviceCtx, now: u64) -> bool {
    let Some(d) = qp.ka.deadline else {
        return false;
    };
    if d > now {
        return false;
    }
    let Some(cfg) = qp.ka.cfg else {
        disarm(qp);
        return false;
    };
    if !matches!(qp.state, QpState::Rts | QpState::Sqd) {
        disarm(qp);
        return false;
    }
    if qp.oldest_unacked().is_some() || qp.req.rnr_until.is_some() {
        // Requests in flight have their own timers: the local ACK timeout and its
        // retries end a connection whose peer stopped answering them.
        qp.ka.sent = 0;
        qp.ka.deadline = Some(now.saturating_add(cfg.idle_ns));
        return false;
    }
    if qp.ka.sent == 0 {
        let quiet_until = qp.ka.heard.saturating_add(cfg.idle_ns);
        if quiet_until > now {
            qp.ka.deadline = Some(quiet_until);
            return false;
        }
    }
    if qp.ka.sent >= cfg.probes {
        env.stats.peers_lost += 1;
        warn!(
            qpn = format_args!("{:#x}", qp.qpn),
            peer = ?qp.peer,
            probes = qp.ka.sent,
            silent_ms = now.saturating_sub(qp.ka.heard) / 1_000_000,
            "peer lost: keepalive probes unanswered"
        );
        disarm(qp);
        return true;
    }
    send_probe(qp, env);
    qp.ka.sent += 1;
    qp.ka.deadline = Some(now.saturating_add(cfg.interval_ns));
    false
}

/// Whether an acknowledgement at PSN `p`, arriving with nothing in flight, answers a probe.
pub(crate) fn answers_probe(qp: &QpCtx, p: u32) -> bool {
    qp.ka.cfg.is_some() && p == probe_psn(qp)
}

/// The probe's PSN: the one before the next, which the peer has executed already.
fn probe_psn(qp: &QpCtx) -> u32 {
    psn::sub(qp.req.next_psn, 1)
}

fn send_probe(qp: &mut QpCtx, env: &mut DeviceCtx) {
    let Some(dst) = qp.peer else {
        return;
    };
    let p = probe_psn(qp);
    let mut bth = Bth::new(Opcode::RC_RDMA_WRITE_ONLY, qp.attr.dest_qp_num, p);
    bth.ack_req = true;
    let mut h = Headers::new(bth);
    h.reth = Some(Reth {
        va: 0,
        rkey: 0,
        dma_len: 0,
    });
    env.stats.keepalive_probes += 1;
    let probe = qp.ka.sent + 1;
    if probe == 1 {
        trace!(
            qpn = format_args!("{:#x}", qp.qpn),
            psn = p,
            "keepalive probe"
        );
    } else {
        debug!(
            qpn = format_args!("{:#x}", qp.qpn),
            psn = p,
            probe,
            "keepalive probe (the last went unanswered)"
        );
    }
    env.send(qp.qpn, dst, qp.attr.ah_attr.grh.traffic_class, &h, &[]);
}
