//! softrdma wire layer: RoCEv2 transport headers, byte for byte.
//!
//! Everything here is pure: parse bytes into header representations ("reprs"),
//! emit reprs into caller-provided buffers, compute the invariant CRC. No I/O
//! (except the [`pcap`] writer over any `std::io::Write`), no allocation on the
//! hot path ([`frame`] helpers allocate and are meant for tests and traces).
//!
//! Header order on the wire (IBTA 9.2, Linux `rxe_opcode.c`):
//! `BTH, [DETH], [RETH], [AtomicETH], [AETH], [AtomicAckETH], [ImmDt], [IETH], payload, pad, ICRC`.
//!
//! ```
//! use softrdma_wire::{icrc, Addrs, Bth, Headers, Opcode, Reth};
//!
//! let addrs = Addrs::new("10.0.0.1:49152".parse().unwrap(), "10.0.0.2:4791".parse().unwrap());
//! let mut h = Headers::new(Bth::new(Opcode::RC_RDMA_WRITE_ONLY, 0x11, 100));
//! h.bth.ack_req = true;
//! h.reth = Some(Reth { va: 0x1000, rkey: 0x42, dma_len: 5 });
//! let mut buf = [0u8; 64];
//! let n = h.emit(b"hello", &mut buf).unwrap();
//! icrc::seal(&addrs, &mut buf[..n]);
//!
//! assert!(icrc::verify(&addrs, &buf[..n]));
//! let (parsed, payload) = Headers::parse(&buf[..n]).unwrap();
//! assert_eq!(payload, b"hello");
//! assert_eq!(parsed.reth, h.reth);
//! assert_eq!(parsed.bth.pad, 3);
//! ```
//!
//! ICRC and the IPv4 ID: the ICRC covers the IPv4 identification field.
//! [`icrc::compute`] assumes ID 0 with DF set, which is what a Linux UDP socket
//! with `IP_PMTUDISC_DO` sends. Linux rxe itself sends varying IDs, so a packet
//! from rxe received through a UDP socket (where the IP header is not visible)
//! cannot be checked with [`icrc::verify`]; with the real IP header (raw socket,
//! capture) use [`icrc::verify_frame`].

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod headers;
pub mod keyrng;
mod opcode;
mod rng;
mod view;

pub mod cm;
pub mod ext;
pub mod frame;
pub mod icrc;
pub mod idhash;
pub mod pcap;
pub mod pcapng;
pub mod psn;
pub mod rsocket;

pub use headers::{
    Aeth, AtomicAckEth, AtomicEth, Bth, Deth, Headers, NakCode, Reth, Syndrome,
    AETH_CREDITS_INVALID,
};
pub use keyrng::{KeyRng, Seed};
pub use opcode::{OpKind, Opcode, OpcodeInfo, Position, ServiceType};
pub use rng::SplitMix64;
pub use view::BthView;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// The IANA-assigned RoCEv2 UDP destination port.
pub const ROCEV2_UDP_PORT: u16 = 4791;
/// The default partition key (full membership, default partition).
pub const DEFAULT_PKEY: u16 = 0xFFFF;
/// The destination QP of a datagram sent to a multicast group (IBTA's permissive QPN
/// 0xFFFFFF): the receiving device gives a copy to every QP attached to the group.
pub const MULTICAST_QPN: u32 = 0xFF_FFFF;
/// Base Transport Header length.
pub const BTH_LEN: usize = 12;
/// RDMA Extended Transport Header length.
pub const RETH_LEN: usize = 16;
/// ACK Extended Transport Header length.
pub const AETH_LEN: usize = 4;
/// Atomic Extended Transport Header length.
pub const ATOMIC_ETH_LEN: usize = 28;
/// Atomic ACK Extended Transport Header length.
pub const ATOMIC_ACK_ETH_LEN: usize = 8;
/// Immediate data length.
pub const IMMDT_LEN: usize = 4;
/// Invalidate Extended Transport Header length.
pub const IETH_LEN: usize = 4;
/// Datagram Extended Transport Header length.
pub const DETH_LEN: usize = 8;
/// Invariant CRC length.
pub const ICRC_LEN: usize = 4;
/// Global Route Header length (also the size of the area a UD receive buffer reserves).
pub const GRH_LEN: usize = 40;
/// Base UDP source port rxe uses for RoCEv2 (see [`udp_src_port`]).
pub const ROCEV2_SRC_PORT_BASE: u16 = 0xC000;

/// Errors from parsing or emitting packets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The buffer is shorter than the headers (parse) or the packet (emit) need.
    #[error("buffer too short")]
    Truncated,
    /// Not a CM message this stack speaks (management class, class version, method or
    /// attribute), or an rdma_cm header of an unknown version or mixed address families.
    #[error("not a CM message")]
    NotCm,
    /// The BTH opcode is not one softrdma implements (RD, XRC, CNP, reserved ...).
    #[error("unknown or unsupported opcode {0:#04x}")]
    UnknownOpcode(u8),
    /// The BTH pad count is inconsistent with the payload.
    #[error("bad pad count")]
    BadPad,
    /// The packet length is not valid for its opcode (payload where none is allowed,
    /// not a multiple of 4 bytes, ...).
    #[error("bad packet length")]
    BadLength,
    /// The BTH transport header version is not 0.
    #[error("unsupported transport header version {0}")]
    BadVersion(u8),
    /// The ICRC does not match.
    #[error("bad ICRC")]
    BadIcrc,
    /// The AETH syndrome byte has a reserved type or NAK code.
    #[error("bad AETH syndrome {0:#04x}")]
    BadSyndrome(u8),
    /// `Headers::emit` was given extension headers that do not match the opcode
    /// (a required one missing or one the opcode does not carry present).
    #[error("extension headers do not match the opcode")]
    HeaderMismatch,
    /// A frame (IP/UDP around a RoCE packet) is malformed or not RoCEv2.
    #[error("malformed IP/UDP frame")]
    BadFrame,
}

/// Result alias for this crate.
pub type Result<T> = core::result::Result<T, Error>;

/// Where a packet travels: needed because the ICRC covers the IP and UDP headers.
///
/// Both addresses should be of the same family. An IPv4-mapped IPv6 address
/// (`::ffff:a.b.c.d`, what a dual-stack socket reports and what a RoCE GID holds)
/// counts as IPv4. If only one side is IPv4, both are treated as IPv6 (the IPv4
/// one in its mapped form).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Addrs {
    /// Source IP address and UDP port.
    pub src: SocketAddr,
    /// Destination IP address and UDP port.
    pub dst: SocketAddr,
}

/// The IP form of an [`Addrs`] pair, after resolving IPv4-mapped addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum IpPair {
    V4(Ipv4Addr, Ipv4Addr),
    V6(Ipv6Addr, Ipv6Addr),
}

fn as_v4(ip: IpAddr) -> Option<Ipv4Addr> {
    match ip {
        IpAddr::V4(a) => Some(a),
        IpAddr::V6(a) => a.to_ipv4_mapped(),
    }
}

fn as_v6(ip: IpAddr) -> Ipv6Addr {
    match ip {
        IpAddr::V4(a) => a.to_ipv6_mapped(),
        IpAddr::V6(a) => a,
    }
}

impl Addrs {
    /// A pair of endpoints.
    pub fn new(src: SocketAddr, dst: SocketAddr) -> Self {
        Addrs { src, dst }
    }

    /// The same pair, direction reversed (for replies).
    pub fn reversed(&self) -> Self {
        Addrs {
            src: self.dst,
            dst: self.src,
        }
    }

    /// True if the packet travels over IPv4 (see the type docs for mapped addresses).
    pub fn is_ipv4(&self) -> bool {
        matches!(self.ip_pair(), IpPair::V4(..))
    }

    pub(crate) fn ip_pair(&self) -> IpPair {
        match (as_v4(self.src.ip()), as_v4(self.dst.ip())) {
            (Some(s), Some(d)) => IpPair::V4(s, d),
            _ => IpPair::V6(as_v6(self.src.ip()), as_v6(self.dst.ip())),
        }
    }

    /// Length of the IP header this pair travels under (20 or 40).
    pub fn ip_header_len(&self) -> usize {
        if self.is_ipv4() {
            20
        } else {
            40
        }
    }
}

/// UDP source port of a QP, as rxe derives it:
/// `0xC000 + (hash_32(qpn, 14) & 0x3fff)` with `hash_32(v, b) = (v * 0x61C88647) >> (32 - b)`.
pub fn udp_src_port(qpn: u32) -> u16 {
    let hash = qpn.wrapping_mul(0x61C8_8647) >> (32 - 14);
    ROCEV2_SRC_PORT_BASE + (hash & 0x3fff) as u16
}

/// Pad bytes needed after `payload_len` bytes to reach a multiple of 4.
pub const fn pad_len(payload_len: usize) -> usize {
    (4 - payload_len % 4) % 4
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn src_port_matches_rxe_hash() {
        // hash_32(17, 14): 17 * 0x61C88647 mod 2^32 = 0x7E50EAB7, >> 18 = 0x1F94
        assert_eq!(udp_src_port(17), 0xC000 + 0x1F94);
        assert_eq!(udp_src_port(0), 0xC000);
        assert_eq!(udp_src_port(1), 0xC000 + (0x61C8_8647u32 >> 18) as u16);
        for q in [1u32, 17, 0xFF_FFFF, u32::MAX] {
            assert!(udp_src_port(q) >= 0xC000);
        }
    }

    #[test]
    fn mapped_addresses_are_ipv4() {
        let a = Addrs::new(
            "[::ffff:10.0.0.1]:1".parse().unwrap(),
            "10.0.0.2:4791".parse().unwrap(),
        );
        assert!(a.is_ipv4());
        let b = Addrs::new(
            "[fe80::1]:1".parse().unwrap(),
            "10.0.0.2:4791".parse().unwrap(),
        );
        assert!(!b.is_ipv4());
        assert_eq!(b.ip_header_len(), 40);
    }

    #[test]
    fn pad() {
        assert_eq!(pad_len(0), 0);
        assert_eq!(pad_len(1), 3);
        assert_eq!(pad_len(2), 2);
        assert_eq!(pad_len(3), 1);
        assert_eq!(pad_len(4), 0);
    }
}
