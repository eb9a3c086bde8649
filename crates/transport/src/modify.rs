//! Modifying a QP: the verbs state change, and what it means for the protocol (the
//! expected and send PSNs, the path MTU and the window, retry counts, the keepalive,
//! flushing on ERR, clearing on RESET).

use crate::qp::{ReqState, RespState};
use std::net::SocketAddr;

use crate::verbs::{self, QpState, QpType};
use crate::{completion, liveness, requester, same_ip, wire, Rnic};

impl Rnic {
    /// verbs modify plus protocol side effects (RTR: expected PSN, RTS: send PSN, ERR: flush
    /// everything, RESET: clear).
    pub fn modify_qp(
        &mut self,
        now: u64,
        qpn: verbs::Qpn,
        attr: &verbs::QpAttr,
        mask: verbs::QpAttrMask,
    ) -> verbs::Result<()> {
        let r = self.modify_qp_inner(now, qpn, attr, mask);
        self.sync_timer(qpn);
        self.publish_qp(qpn);
        r
    }

    fn modify_qp_inner(
        &mut self,
        now: u64,
        qpn: verbs::Qpn,
        attr: &verbs::QpAttr,
        mask: verbs::QpAttrMask,
    ) -> verbs::Result<()> {
        use verbs::QpAttrMask as M;
        let (old, new) = self.env.ctx.modify_qp(qpn, attr, mask)?;
        tracing::debug!(
            qpn = format_args!("{qpn:#x}"),
            ?old,
            ?new,
            ?mask,
            "modify_qp"
        );
        let Some(qp) = self.qps.get_mut(&qpn) else {
            return Ok(());
        };
        if let Some(q) = self.env.ctx.qp(qpn) {
            qp.attr = q.attr;
        }
        qp.state = new;
        let peer = match qp.qp_type {
            QpType::Ud => None,
            _ => Some(SocketAddr::new(
                qp.attr.ah_attr.grh.dgid.to_ip(),
                self.env.addr.port(),
            )),
        };
        // A new connection (or a new peer) has its source port to learn again.
        if peer != qp.peer || new == QpState::Reset || (old == QpState::Init && new == QpState::Rtr)
        {
            qp.peer_port = None;
        }
        qp.peer = peer;
        if new == QpState::Reset {
            liveness::disarm(qp);
            qp.sq.clear();
            qp.req = ReqState::default();
            qp.resp.held.clear(&mut self.env.held_bytes);
            qp.resp = RespState::default();
            return Ok(());
        }
        if new == QpState::Err {
            if old != QpState::Err {
                completion::flush(qp, &mut self.env, now);
            }
            return Ok(());
        }
        if mask.contains(M::RQ_PSN) {
            qp.resp.epsn = qp.attr.rq_psn & wire::psn::MASK;
            qp.resp.nak_sent = false;
            qp.resp.held.clear(&mut self.env.held_bytes);
        }
        if mask.contains(M::SQ_PSN) && !qp.sq.iter().any(|w| w.started) {
            qp.req.next_psn = qp.attr.sq_psn & wire::psn::MASK;
            qp.req.high_psn = qp.req.next_psn;
            qp.req.rec.start_at(qp.req.next_psn);
        }
        if mask.contains(M::PATH_MTU) {
            qp.req.cc.on_path(qp.mtu(), self.env.rx_buffer);
        }
        if mask.contains(M::RETRY_CNT) || (new == QpState::Rts && old == QpState::Rtr) {
            qp.req.retry_left = qp.attr.retry_cnt;
        }
        if mask.contains(M::RNR_RETRY) || (new == QpState::Rts && old == QpState::Rtr) {
            qp.req.rnr_left = qp.attr.rnr_retry;
        }
        if new == QpState::Sqd && old != QpState::Sqd {
            qp.req.sqd_notified = false;
            completion::check_drained(qp, &mut self.env);
        }
        if new == QpState::Rts && old == QpState::Rtr {
            let local = qp.peer.is_some_and(|p| {
                let ip = p.ip().to_canonical();
                ip.is_loopback()
                    || same_ip(ip, self.env.addr.ip())
                    || self.env.alt.is_some_and(|a| same_ip(a, ip))
            });
            let policy = self.env.keepalive;
            let cfg = if local { policy.local } else { policy.remote };
            liveness::arm(qp, cfg, now);
        }
        if new == QpState::Rts {
            requester::run(qp, &mut self.env, now);
        }
        Ok(())
    }
}
