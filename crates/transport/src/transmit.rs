//! What leaves the device: a datagram ([`Transmit`]) and what kind it is.

use std::net::SocketAddr;

use softrdma_wire::{self as wire, Addrs, Headers};

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
