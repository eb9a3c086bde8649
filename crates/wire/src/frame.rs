//! IPv4/IPv6 + UDP framing around a RoCE packet (for pcap traces, tests and
//! raw sockets), and the GRH area of UD receive buffers.

use crate::headers::{be16, put16};
use crate::{Addrs, Error, IpPair, Result, GRH_LEN};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

const UDP_LEN: usize = 8;
const IPPROTO_UDP: u8 = 17;
/// TTL / hop limit of frames built here (Linux default).
pub const DEFAULT_TTL: u8 = 64;

pub(crate) struct IpHeaderParams {
    pub tos: u8,
    pub ttl: u8,
    pub ip_id: u16,
    pub udp_payload_len: usize,
}

/// RFC 1071 checksum of `data` (even length).
fn ip_checksum(data: &[u8]) -> u16 {
    let mut sum: u32 = data
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum();
    while sum > 0xFFFF {
        sum = (sum & 0xFFFF) + (sum >> 16);
    }
    !(sum as u16)
}

pub(crate) fn ipv4_header(src: Ipv4Addr, dst: Ipv4Addr, p: &IpHeaderParams) -> [u8; 20] {
    let mut h = [0u8; 20];
    h[0] = 0x45;
    h[1] = p.tos;
    put16(&mut h, 2, (20 + UDP_LEN + p.udp_payload_len) as u16);
    put16(&mut h, 4, p.ip_id);
    put16(&mut h, 6, 0x4000); // DF, fragment offset 0
    h[8] = p.ttl;
    h[9] = IPPROTO_UDP;
    h[12..16].copy_from_slice(&src.octets());
    h[16..20].copy_from_slice(&dst.octets());
    let csum = ip_checksum(&h);
    put16(&mut h, 10, csum);
    h
}

pub(crate) fn ipv6_header(src: Ipv6Addr, dst: Ipv6Addr, p: &IpHeaderParams) -> [u8; 40] {
    let mut h = [0u8; 40];
    h[0] = 0x60 | (p.tos >> 4);
    h[1] = p.tos << 4; // flow label 0
    put16(&mut h, 4, (UDP_LEN + p.udp_payload_len) as u16);
    h[6] = IPPROTO_UDP;
    h[7] = p.ttl;
    h[8..24].copy_from_slice(&src.octets());
    h[24..40].copy_from_slice(&dst.octets());
    h
}

pub(crate) fn udp_header(addrs: &Addrs, udp_payload_len: usize) -> [u8; 8] {
    let mut h = [0u8; 8];
    put16(&mut h, 0, addrs.src.port());
    put16(&mut h, 2, addrs.dst.port());
    put16(&mut h, 4, (UDP_LEN + udp_payload_len) as u16);
    h // checksum 0
}

/// A full IPv4 or IPv6 + UDP frame around a RoCE packet: IPv4 ID 0, DF, TTL 64,
/// correct header checksum; IPv6 flow label 0, hop limit 64; UDP checksum 0.
/// `tos` is the DSCP/ECN byte (IPv6: traffic class). Lengths wrap above 64 KiB.
pub fn emit_ip_udp(addrs: &Addrs, tos: u8, udp_payload: &[u8]) -> Vec<u8> {
    let p = IpHeaderParams {
        tos,
        ttl: DEFAULT_TTL,
        ip_id: 0,
        udp_payload_len: udp_payload.len(),
    };
    let mut out = Vec::with_capacity(40 + UDP_LEN + udp_payload.len());
    match addrs.ip_pair() {
        IpPair::V4(s, d) => out.extend_from_slice(&ipv4_header(s, d, &p)),
        IpPair::V6(s, d) => out.extend_from_slice(&ipv6_header(s, d, &p)),
    }
    out.extend_from_slice(&udp_header(addrs, udp_payload.len()));
    out.extend_from_slice(udp_payload);
    out
}

/// The 40-byte GRH area a UD receive buffer gets in front of the data. IPv4: the
/// 20-byte IPv4 header (as [`emit_ip_udp`] builds it) in the last 20 bytes, the
/// first 20 zero, as rxe does; IPv6: the IPv6 header.
pub fn ud_grh(addrs: &Addrs, tos: u8, udp_payload_len: usize) -> [u8; GRH_LEN] {
    let p = IpHeaderParams {
        tos,
        ttl: DEFAULT_TTL,
        ip_id: 0,
        udp_payload_len,
    };
    let mut g = [0u8; GRH_LEN];
    match addrs.ip_pair() {
        IpPair::V4(s, d) => g[20..].copy_from_slice(&ipv4_header(s, d, &p)),
        IpPair::V6(s, d) => g.copy_from_slice(&ipv6_header(s, d, &p)),
    }
    g
}

/// What a UD receive's completion reports in its `sl` field for a datagram between
/// `addrs`: the RoCE packet type as Mellanox devices put it there (bit 3: a UDP header,
/// i.e. RoCE v2; bits 2..0: the network header, 2 IPv4, 1 IPv6), since a RoCE packet
/// carries no service level. UCX's ud_verbs reads it to find the destination GID in the
/// GRH area ([`ud_grh`]): 4 bytes of an IPv4 header or the IPv6 header's 16.
pub fn ud_roce_pkt_type(addrs: &Addrs) -> u8 {
    const UDP: u8 = 0x8;
    match addrs.ip_pair() {
        IpPair::V4(..) => UDP | 0x2,
        IpPair::V6(..) => UDP | 0x1,
    }
}

/// Split an IP + UDP frame into (IP header length, UDP payload). Checks the IP
/// version, that the protocol is UDP (no IPv6 extension headers), and that the
/// IP and UDP length fields fit the frame; bytes after the UDP length are ignored.
pub fn split_ip_udp(frame: &[u8]) -> Result<(usize, &[u8])> {
    let (ip_len, ip_total) = match frame.first().map(|b| b >> 4) {
        Some(4) => {
            let ihl = usize::from(frame[0] & 0xF) * 4;
            if ihl < 20 || frame.len() < ihl || frame[9] != IPPROTO_UDP {
                return Err(Error::BadFrame);
            }
            (ihl, usize::from(be16(frame, 2)))
        }
        Some(6) => {
            if frame.len() < 40 || frame[6] != IPPROTO_UDP {
                return Err(Error::BadFrame);
            }
            (40, 40 + usize::from(be16(frame, 4)))
        }
        _ => return Err(Error::BadFrame),
    };
    if ip_total > frame.len() || ip_total < ip_len + UDP_LEN {
        return Err(Error::BadFrame);
    }
    let udp_len = usize::from(be16(frame, ip_len + 4));
    if udp_len < UDP_LEN || ip_len + udp_len > ip_total {
        return Err(Error::BadFrame);
    }
    Ok((ip_len, &frame[ip_len + UDP_LEN..ip_len + udp_len]))
}

/// Parse an IP + UDP frame: the endpoints, the TOS / traffic class byte and the UDP payload.
pub fn parse_ip_udp(frame: &[u8]) -> Result<(Addrs, u8, &[u8])> {
    let (ip_len, payload) = split_ip_udp(frame)?;
    let (src, dst, tos) = if ip_len == 40 && frame[0] >> 4 == 6 {
        let mut s = [0u8; 16];
        let mut d = [0u8; 16];
        s.copy_from_slice(&frame[8..24]);
        d.copy_from_slice(&frame[24..40]);
        (
            IpAddr::V6(Ipv6Addr::from(s)),
            IpAddr::V6(Ipv6Addr::from(d)),
            (frame[0] << 4) | (frame[1] >> 4),
        )
    } else {
        let s = Ipv4Addr::new(frame[12], frame[13], frame[14], frame[15]);
        let d = Ipv4Addr::new(frame[16], frame[17], frame[18], frame[19]);
        (IpAddr::V4(s), IpAddr::V4(d), frame[1])
    };
    let addrs = Addrs {
        src: SocketAddr::new(src, be16(frame, ip_len)),
        dst: SocketAddr::new(dst, be16(frame, ip_len + 2)),
    };
    Ok((addrs, tos, payload))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4() -> Addrs {
        Addrs::new(
            "10.47.91.1:49370".parse().unwrap(),
            "10.47.91.2:4791".parse().unwrap(),
        )
    }

    #[test]
    fn ipv4_frame_layout() {
        let f = emit_ip_udp(&v4(), 0x02, &[1, 2, 3, 4]);
        assert_eq!(f.len(), 20 + 8 + 4);
        assert_eq!(
            &f[..12],
            &[0x45, 0x02, 0, 32, 0, 0, 0x40, 0, 64, 17, f[10], f[11]]
        );
        assert_eq!(ip_checksum(&f[..20]), 0, "header checksum verifies");
        assert_eq!(&f[20..28], &[0xC0, 0xDA, 0x12, 0xB7, 0, 12, 0, 0]);
        let (a, tos, p) = parse_ip_udp(&f).unwrap();
        assert_eq!((a, tos, p), (v4(), 0x02, &[1u8, 2, 3, 4][..]));
    }

    #[test]
    fn ipv6_frame_layout() {
        let a = Addrs::new(
            "[fd00::1]:49152".parse().unwrap(),
            "[fd00::2]:4791".parse().unwrap(),
        );
        let f = emit_ip_udp(&a, 0xB8, &[9; 8]);
        assert_eq!(f.len(), 40 + 8 + 8);
        assert_eq!(&f[..8], &[0x6B, 0x80, 0, 0, 0, 16, 17, 64]);
        let (b, tos, p) = parse_ip_udp(&f).unwrap();
        assert_eq!((b, tos, p), (a, 0xB8, &[9u8; 8][..]));
        assert_eq!(&ud_grh(&a, 0xB8, 8)[..], &f[..40]);
        assert_eq!(ud_roce_pkt_type(&a), 0x9);
        assert_eq!(ud_roce_pkt_type(&v4()), 0xA);
    }

    #[test]
    fn grh_ipv4_in_last_20_bytes() {
        let g = ud_grh(&v4(), 0, 100);
        assert_eq!(g[..20], [0; 20]);
        assert_eq!(g[20], 0x45);
        assert_eq!(be16(&g, 22), 128);
        assert_eq!(&g[20..], &emit_ip_udp(&v4(), 0, &[0; 100])[..20]);
    }

    #[test]
    fn bad_frames() {
        assert_eq!(split_ip_udp(&[]), Err(Error::BadFrame));
        assert_eq!(split_ip_udp(&[0x45; 19]), Err(Error::BadFrame));
        let mut f = emit_ip_udp(&v4(), 0, &[0; 16]);
        f.truncate(30);
        assert_eq!(split_ip_udp(&f), Err(Error::BadFrame));
        let mut f = emit_ip_udp(&v4(), 0, &[0; 16]);
        f[9] = 6; // TCP
        assert_eq!(split_ip_udp(&f), Err(Error::BadFrame));
    }
}
