//! The order datagrams leave in. Producers stop at a full outbox
//! ([`crate::qp::OUTBOX_MAX`]) and continue here as it drains, requesters and responders
//! taking turns, and coalesced ACKs go last.

use crate::transmit::Transmit;
use crate::{qp, requester, responder, Rnic};

impl Rnic {
    /// Next datagram to put on the wire. Coalesced ACKs go out once the outbox is empty,
    /// so a burst of requests handled before polling gets one ACK.
    #[inline]
    pub fn poll_transmit(&mut self, now: u64) -> Option<Transmit> {
        if let Some(t) = self.env.out.pop_front() {
            return Some(t);
        }
        if self.env.tx_wait.is_empty()
            && self.env.ack_queue.is_empty()
            && self.env.resp_wait.is_empty()
        {
            return None;
        }
        self.poll_transmit_refill(now)
    }

    /// The outbox is empty: let stopped requesters and responders continue (taking turns
    /// at going first), then send coalesced ACKs.
    fn poll_transmit_refill(&mut self, now: u64) -> Option<Transmit> {
        self.env.resp_first = !self.env.resp_first;
        if self.env.resp_first {
            self.refill_responders(now);
            self.refill_requesters(now);
        } else {
            self.refill_requesters(now);
            self.refill_responders(now);
        }
        if let Some(t) = self.env.out.pop_front() {
            return Some(t);
        }
        let mut budget = self.env.ack_queue.len();
        while budget > 0 {
            budget -= 1;
            let Some(qpn) = self.env.ack_queue.pop_front() else {
                break;
            };
            if let Some(qp) = self.qps.get_mut(&qpn) {
                responder::flush_ack(qp, &mut self.env);
                self.sync_timer(qpn);
                if let Some(t) = self.env.out.pop_front() {
                    return Some(t);
                }
            }
        }
        None
    }

    /// Requesters that stopped at a full outbox continue, in the order they stopped.
    fn refill_requesters(&mut self, now: u64) {
        let mut budget = self.env.tx_wait.len();
        while budget > 0 && self.env.out.len() < qp::OUTBOX_MAX {
            budget -= 1;
            let Some(qpn) = self.env.tx_wait.pop_front() else {
                break;
            };
            if let Some(qp) = self.qps.get_mut(&qpn) {
                qp.req.tx_wait = false;
                requester::run(qp, &mut self.env, now);
                self.sync_timer(qpn);
            }
        }
    }

    /// Responders with READ responses left continue, in the order they stopped.
    fn refill_responders(&mut self, now: u64) {
        let mut budget = self.env.resp_wait.len();
        while budget > 0 && self.env.out.len() < qp::OUTBOX_MAX {
            budget -= 1;
            let Some(qpn) = self.env.resp_wait.pop_front() else {
                break;
            };
            if let Some(qp) = self.qps.get_mut(&qpn) {
                qp.resp.tx_wait = false;
                responder::send_waiting_responses(qp, &mut self.env, now);
                self.sync_timer(qpn);
            }
        }
    }

    /// Datagrams queued for [`Rnic::poll_transmit`] right now. Producers stop at a bound
    /// (a few hundred) and continue as the outbox drains, so this stays small whatever a
    /// peer asks for (a 1 GiB READ, say); one response per received packet may go past it.
    pub fn queued_packets(&self) -> usize {
        self.env.out.len()
    }

    /// Give a datagram buffer (for example a sent [`Transmit::data`]) back to the engine,
    /// which builds later packets in it instead of allocating.
    pub fn recycle(&mut self, buf: Vec<u8>) {
        self.env.recycle(buf);
    }
}
