//! What leaves the device: the datagrams ([`Transmit`]) and the order they go out in.
//! Producers stop at a full outbox ([`crate::qp::OUTBOX_MAX`]) and continue here as it
//! drains, requesters and responders taking turns, and coalesced ACKs go last.

use std::net::SocketAddr;

use softrdma_wire::{self as wire, Addrs, Headers};

use crate::{qp, requester, responder, Rnic};

/// What a datagram is, for a runtime deciding when to send it (it may hold plain ACKs
/// back to leave with the next datagram, but not requests or responses).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransmitKind {
    /// A request: SEND, WRITE, READ request, atomic.
    Request,
    /// A READ or atomic response.
    Response,
    /// A positive acknowledgement (RC ACKNOWLEDGE with an ACK syndrome).
    Ack,
    /// A NAK or RNR NAK.
    Nak,
}

impl TransmitKind {
    pub(crate) fn of(h: &Headers) -> TransmitKind {
        let is_request = h.bth.opcode.info().is_some_and(|i| i.is_request);
        match (is_request, h.aeth) {
            (true, _) => TransmitKind::Request,
            (false, Some(a)) if h.bth.opcode == wire::Opcode::RC_ACKNOWLEDGE => match a.syndrome {
                wire::Syndrome::Ack { .. } => TransmitKind::Ack,
                _ => TransmitKind::Nak,
            },
            (false, _) => TransmitKind::Response,
        }
    }
}

/// A datagram to send: UDP payload (BTH..ICRC, ICRC already sealed) and addressing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transmit {
    /// Our address (source IP and UDP source port).
    pub src: SocketAddr,
    /// Destination IP and UDP port.
    pub dst: SocketAddr,
    /// IP TOS / traffic class byte.
    pub tos: u8,
    /// What it is.
    pub kind: TransmitKind,
    /// The UDP payload.
    pub data: Vec<u8>,
}

impl Transmit {
    /// Send it from `src` instead (another UDP source port, say): the ICRC covers the UDP
    /// header, so it is sealed again for the new address.
    pub fn resend_from(&mut self, src: SocketAddr) {
        wire::icrc::seal(&Addrs::new(src, self.dst), &mut self.data);
        self.src = src;
    }

    /// Re-seal the ICRC, sealed for IPv4 ID 0, for the IPv4 ID `ip_id` the kernel will give
    /// this datagram (segment `ip_id` of a UDP GSO message); `cache` keeps the per-length
    /// work.
    pub fn reseal_for_ip_id(&mut self, ip_id: u16, cache: &mut wire::icrc::IpIdCache) {
        cache.get(self.data.len()).reseal(&mut self.data, 0, ip_id);
    }
}

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
