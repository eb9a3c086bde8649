//! IPv4/UDP edits on a queued packet (bytes from the IP header on).
//!
//! The RoCEv2 ICRC covers the IP header (but TOS, TTL and checksum) and the UDP header
//! (but its checksum), so the impairer may only ever change the UDP payload (to corrupt
//! it) and the two checksums (to keep a packet deliverable). Nothing here touches the IP
//! ID, addresses, lengths or ports.

use std::ops::Range;

/// Where a packet's UDP header and payload sit, when it is a whole IPv4/UDP datagram.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Udp4 {
    /// The IPv4 header's length.
    pub ihl: usize,
    /// The UDP payload's bytes within the packet.
    pub payload: Range<usize>,
}

/// Locate the UDP payload of an unfragmented IPv4/UDP packet; `None` for anything else
/// (IPv6, other protocols, fragments, inconsistent lengths).
pub fn udp4(p: &[u8]) -> Option<Udp4> {
    let b0 = *p.first()?;
    if b0 >> 4 != 4 {
        return None;
    }
    let ihl = usize::from(b0 & 0xF) * 4;
    let total = usize::from(u16::from_be_bytes([*p.get(2)?, *p.get(3)?]));
    let frag = u16::from_be_bytes([*p.get(6)?, *p.get(7)?]);
    // A fragment (MF set or an offset) carries no UDP header we may trust.
    if ihl < 20 || *p.get(9)? != 17 || frag & 0x3FFF != 0 || total > p.len() || total < ihl + 8 {
        return None;
    }
    let ulen = usize::from(u16::from_be_bytes([*p.get(ihl + 4)?, *p.get(ihl + 5)?]));
    if ulen < 8 || ihl + ulen > total {
        return None;
    }
    Some(Udp4 {
        ihl,
        payload: ihl + 8..ihl + ulen,
    })
}

/// The Internet checksum's one's-complement sum of `b` added to `sum` (not folded).
fn sum16(mut sum: u64, b: &[u8]) -> u64 {
    let mut it = b.chunks_exact(2);
    for w in &mut it {
        sum += u64::from(u16::from_be_bytes([w[0], w[1]]));
    }
    if let [last] = it.remainder() {
        sum += u64::from(*last) << 8;
    }
    sum
}

fn fold(mut sum: u64) -> u16 {
    while sum >> 16 != 0 {
        sum = (sum & 0xFFFF) + (sum >> 16);
    }
    !(sum as u16)
}

/// Recompute the IPv4 header checksum in place.
pub fn fix_ip_checksum(p: &mut [u8], u: &Udp4) {
    if p.len() < u.ihl {
        return;
    }
    p[10] = 0;
    p[11] = 0;
    let c = fold(sum16(0, &p[..u.ihl]));
    p[10..12].copy_from_slice(&c.to_be_bytes());
}

/// Recompute the UDP checksum in place, unless it is zero (the sender chose none, and
/// zero must stay zero for IPv4).
pub fn fix_udp_checksum(p: &mut [u8], u: &Udp4) {
    let (h, end) = (u.ihl, u.payload.end);
    if p.len() < end || end < h + 8 || p[h + 6..h + 8] == [0, 0] {
        return;
    }
    p[h + 6] = 0;
    p[h + 7] = 0;
    let mut s = sum16(0, &p[12..20]); // source and destination addresses
    s += 17 + (end - h) as u64;
    s = sum16(s, &p[h..end]);
    let c = match fold(s) {
        0 => 0xFFFF,
        c => c,
    };
    p[h + 6..h + 8].copy_from_slice(&c.to_be_bytes());
}

/// Flip bits of one UDP payload byte, chosen by `pick`, with `mask`; then make the UDP
/// checksum match the new bytes unless the kernel computes it later (`csum_not_ready`:
/// the field holds a partial sum that the stack finishes over the payload as it is when
/// the packet leaves). A receiver's UDP layer then delivers the packet and the damage is
/// left for the ICRC to find. Returns the changed offset, or `None` when there is no
/// payload to corrupt (the packet is left as it was).
pub fn corrupt(p: &mut [u8], pick: u64, mask: u8, csum_not_ready: bool) -> Option<usize> {
    let u = udp4(p)?;
    let n = u.payload.len();
    if n == 0 || mask == 0 {
        return None;
    }
    let at = u.payload.start + (pick % n as u64) as usize;
    p[at] ^= mask;
    if !csum_not_ready {
        fix_udp_checksum(p, &u);
    }
    Some(at)
}

/// The bytes a duplicate goes out with: the same packet with both checksums complete (a
/// queued packet may carry only a partial UDP sum, which a receiver would reject once the
/// copy leaves through a packet socket that no checksum offload finishes). `None` for a
/// packet that is not IPv4/UDP.
pub fn duplicate(p: &[u8]) -> Option<Vec<u8>> {
    let u = udp4(p)?;
    let mut d = p[..u.payload.end].to_vec();
    // Bytes past the UDP length (padding) are not part of the datagram; keep them anyway
    // so the copy is the original byte for byte.
    d.extend_from_slice(&p[u.payload.end..]);
    fix_ip_checksum(&mut d, &u);
    fix_udp_checksum(&mut d, &u);
    Some(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    const UDP_SUM: u16 = 0x147b;

    /// A RoCEv2-looking IPv4/UDP packet with correct checksums.
    fn packet(payload: &[u8], id: u16) -> Vec<u8> {
        let total = 20 + 8 + payload.len();
        let mut p = vec![
            0x45, 0x02, 0, 0, 0, 0, 0x40, 0, 64, 17, 0, 0, 10, 77, 0, 1, 10, 77, 0, 2,
        ];
        p[2..4].copy_from_slice(&(total as u16).to_be_bytes());
        p[4..6].copy_from_slice(&id.to_be_bytes());
        p.extend_from_slice(&0xC001u16.to_be_bytes());
        p.extend_from_slice(&4791u16.to_be_bytes());
        p.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
        p.extend_from_slice(&[0xAB, 0xCD]); // any nonzero: recomputed below
        p.extend_from_slice(payload);
        let u = udp4(&p).unwrap();
        fix_ip_checksum(&mut p, &u);
        fix_udp_checksum(&mut p, &u);
        p
    }

    fn verify(p: &[u8]) -> bool {
        let u = udp4(p).unwrap();
        let ip_ok = fold(sum16(0, &p[..u.ihl])) == 0;
        let mut s = sum16(0, &p[12..20]) + 17 + (u.payload.end - u.ihl) as u64;
        s = sum16(s, &p[u.ihl..u.payload.end]);
        ip_ok && fold(s) == 0
    }

    #[test]
    fn checksums_match_a_known_packet() {
        // 10.77.0.1 -> 10.77.0.2, ID 0, DF, TTL 64, TOS 2, 4-byte payload; the expected
        // sums were computed apart from this code (RFC 1071 in a few lines of Python).
        let p = packet(&[1, 2, 3, 4], 0);
        assert!(verify(&p));
        assert_eq!(&p[10..12], &[0x26, 0x2f]);
        assert_eq!(&p[26..28], &UDP_SUM.to_be_bytes());
    }

    #[test]
    fn corruption_changes_one_payload_byte_and_keeps_udp_valid() {
        let orig = packet(&(0..200u8).collect::<Vec<_>>(), 0x1234);
        for pick in [0u64, 1, 199, 200, 12345, u64::MAX] {
            let mut p = orig.clone();
            let at = corrupt(&mut p, pick, 0x5A, false).unwrap();
            assert!((28..228).contains(&at));
            let diff: Vec<usize> = (0..p.len()).filter(|&i| p[i] != orig[i]).collect();
            // The byte and, possibly, the UDP checksum (26, 27): nothing the ICRC covers
            // besides the payload byte.
            assert!(diff.contains(&at));
            assert!(
                diff.iter().all(|&i| i == at || i == 26 || i == 27),
                "{diff:?}"
            );
            assert!(verify(&p));
        }
        // Checksum left to the stack: only the payload byte changes.
        let mut p = orig.clone();
        let at = corrupt(&mut p, 3, 0xFF, true).unwrap();
        let diff: Vec<usize> = (0..p.len()).filter(|&i| p[i] != orig[i]).collect();
        assert_eq!(diff, vec![at]);
    }

    #[test]
    fn duplicate_is_the_same_bytes_with_complete_checksums() {
        let orig = packet(&[9; 33], 7);
        assert_eq!(duplicate(&orig).unwrap(), orig);
        // A partial sum in the UDP checksum field (as with CHECKSUM_PARTIAL) is completed,
        // and nothing else changes.
        let mut partial = orig.clone();
        partial[26] = 0x12;
        partial[27] = 0x34;
        assert_eq!(duplicate(&partial).unwrap(), orig);
        // A zero UDP checksum (none) stays zero.
        let mut none = orig.clone();
        none[26] = 0;
        none[27] = 0;
        assert_eq!(duplicate(&none).unwrap(), none);
    }

    #[test]
    fn odd_packets_are_refused_not_panicked_on() {
        let good = packet(&[1; 16], 1);
        assert!(udp4(&good).is_some());
        for cut in 0..good.len() {
            let mut p = good[..cut].to_vec();
            let _ = corrupt(&mut p, 5, 1, false);
            let _ = duplicate(&p);
        }
        let mut r = softrdma_wire::SplitMix64::new(3);
        for _ in 0..5000 {
            let mut p = good.clone();
            let i = r.below(p.len() as u64) as usize;
            p[i] = r.next_u64() as u8;
            let _ = corrupt(&mut p, r.next_u64(), 0x80, false);
            let _ = duplicate(&p);
        }
        let mut v6 = good.clone();
        v6[0] = 0x60;
        assert!(udp4(&v6).is_none());
        let mut tcp = good.clone();
        tcp[9] = 6;
        assert!(udp4(&tcp).is_none());
        let mut frag = good.clone();
        frag[6] = 0x20; // MF
        assert!(udp4(&frag).is_none());
        // No payload: nothing to corrupt.
        let mut empty = packet(&[], 1);
        let before = empty.clone();
        assert_eq!(corrupt(&mut empty, 0, 1, false), None);
        assert_eq!(empty, before);
    }
}
