//! The RoCEv2 invariant CRC.
//!
//! CRC-32 (zlib polynomial, reflected, init `0xFFFFFFFF`, final inversion) over
//! 8 bytes of `0xFF` (stand-in for the LRH), the IP header with the variant fields
//! set to ones (IPv4: TOS, TTL, header checksum; IPv6: traffic class, flow label,
//! hop limit), the UDP header with checksum `0xFFFF`, the BTH with byte 4
//! (FECN, BECN, reserved) `0xFF`, and the rest of the packet up to the ICRC.
//! The ICRC is appended little-endian (as Linux rxe does).
//!
//! [`compute`] reconstructs the IP header from [`Addrs`] the way a Linux UDP
//! socket with DF set sends it: IPv4 ID 0, flags DF. Packets from a sender that
//! uses other IP IDs (Linux rxe itself picks varying IDs) can only be checked
//! with the real IP header: see [`compute_frame`].

use crate::frame::{self, IpHeaderParams};
use crate::{Addrs, Error, IpPair, Result, BTH_LEN, ICRC_LEN};
use crc32fast::Hasher;

fn hash_rest(h: &mut Hasher, udp_header: &[u8; 8], udp_payload: &[u8]) {
    let mut udp = *udp_header;
    udp[6] = 0xFF;
    udp[7] = 0xFF;
    h.update(&udp);
    let body = &udp_payload[..udp_payload.len().saturating_sub(ICRC_LEN)];
    if body.len() > 4 {
        h.update(&body[..4]);
        h.update(&[0xFF]);
        h.update(&body[5..]);
    } else {
        h.update(body);
    }
}

fn mask_ip(ip: &mut [u8]) {
    match ip.first().map(|b| b >> 4) {
        Some(4) if ip.len() >= 20 => {
            ip[1] = 0xFF; // TOS
            ip[8] = 0xFF; // TTL
            ip[10] = 0xFF; // header checksum
            ip[11] = 0xFF;
        }
        Some(6) if ip.len() >= 40 => {
            ip[0] |= 0x0F; // traffic class (high nibble)
            ip[1] = 0xFF; // traffic class (low nibble), flow label
            ip[2] = 0xFF;
            ip[3] = 0xFF;
            ip[7] = 0xFF; // hop limit
        }
        _ => {}
    }
}

/// ICRC of a packet travelling between `addrs` (IPv4 ID 0 with DF, as a Linux UDP
/// socket with `IP_PMTUDISC_DO` sends). `udp_payload` includes the 4 trailing ICRC
/// bytes, which are ignored (a payload shorter than 4 bytes is hashed as is).
pub fn compute(addrs: &Addrs, udp_payload: &[u8]) -> u32 {
    let params = IpHeaderParams {
        tos: 0,
        ttl: 0,
        ip_id: 0,
        udp_payload_len: udp_payload.len(),
    };
    let mut h = Hasher::new();
    h.update(&[0xFF; 8]);
    match addrs.ip_pair() {
        IpPair::V4(s, d) => {
            let mut ip = frame::ipv4_header(s, d, &params);
            mask_ip(&mut ip);
            h.update(&ip);
        }
        IpPair::V6(s, d) => {
            let mut ip = frame::ipv6_header(s, d, &params);
            mask_ip(&mut ip);
            h.update(&ip);
        }
    }
    hash_rest(
        &mut h,
        &frame::udp_header(addrs, udp_payload.len()),
        udp_payload,
    );
    h.finalize()
}

/// Compute the ICRC and write it little-endian into the last 4 bytes of `udp_payload`.
/// Does nothing if the buffer is shorter than 4 bytes.
pub fn seal(addrs: &Addrs, udp_payload: &mut [u8]) {
    let crc = compute(addrs, udp_payload);
    if let Some(start) = udp_payload.len().checked_sub(ICRC_LEN) {
        udp_payload[start..].copy_from_slice(&crc.to_le_bytes());
    }
}

/// The ICRC stored in the last 4 bytes (little-endian), if there are 4 bytes.
pub fn stored(udp_payload: &[u8]) -> Option<u32> {
    let start = udp_payload.len().checked_sub(ICRC_LEN)?;
    let s = &udp_payload[start..];
    Some(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

/// True if the last 4 bytes hold the ICRC [`compute`] gives. False for packets
/// shorter than a BTH plus ICRC.
pub fn verify(addrs: &Addrs, udp_payload: &[u8]) -> bool {
    udp_payload.len() >= BTH_LEN + ICRC_LEN
        && stored(udp_payload) == Some(compute(addrs, udp_payload))
}

/// ICRC of a full IPv4 or IPv6 + UDP frame (as captured on the wire, IP header first),
/// using the frame's real IP header (ID, flags, options). The last 4 bytes of the
/// frame are the ICRC and are ignored.
pub fn compute_frame(ip_frame: &[u8]) -> Result<u32> {
    let (ip_len, udp_payload) = frame::split_ip_udp(ip_frame)?;
    let mut h = Hasher::new();
    h.update(&[0xFF; 8]);
    let mut ip = [0u8; 60];
    let ip = ip.get_mut(..ip_len).ok_or(Error::BadFrame)?;
    ip.copy_from_slice(&ip_frame[..ip_len]);
    mask_ip(ip);
    h.update(ip);
    let mut udp = [0u8; 8];
    udp.copy_from_slice(&ip_frame[ip_len..ip_len + 8]);
    hash_rest(&mut h, &udp, udp_payload);
    Ok(h.finalize())
}

/// True if a full IP + UDP frame carries a correct ICRC (see [`compute_frame`]).
pub fn verify_frame(ip_frame: &[u8]) -> bool {
    match (compute_frame(ip_frame), frame::split_ip_udp(ip_frame)) {
        (Ok(crc), Ok((_, udp_payload))) => {
            udp_payload.len() >= BTH_LEN + ICRC_LEN && stored(udp_payload) == Some(crc)
        }
        _ => false,
    }
}
