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

use crate::frame;
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
///
/// One pass: the masked IP, UDP and BTH headers are laid out in a small stack buffer
/// hashed with one update, then the hasher continues over the rest of the packet.
pub fn compute(addrs: &Addrs, udp_payload: &[u8]) -> u32 {
    let len = udp_payload.len();
    let body = &udp_payload[..len.saturating_sub(ICRC_LEN)];
    // 8 x 0xFF, IP header (20 or 40), UDP header (8), BTH (12).
    let mut pre = [0xFFu8; 8 + 40 + 8 + BTH_LEN];
    let mut at = 8;
    match addrs.ip_pair() {
        IpPair::V4(s, d) => {
            // As frame::ipv4_header builds it (ID 0, DF), then TOS, TTL and
            // checksum masked to ones.
            let ip = &mut pre[at..at + 20];
            ip[0] = 0x45;
            ip[1] = 0xFF; // TOS
            ip[2..4].copy_from_slice(&((20 + 8 + len) as u16).to_be_bytes());
            ip[4..6].copy_from_slice(&[0, 0]); // ID
            ip[6..8].copy_from_slice(&[0x40, 0]); // DF
            ip[8] = 0xFF; // TTL
            ip[9] = 17; // UDP
            ip[10..12].copy_from_slice(&[0xFF, 0xFF]); // checksum
            ip[12..16].copy_from_slice(&s.octets());
            ip[16..20].copy_from_slice(&d.octets());
            at += 20;
        }
        IpPair::V6(s, d) => {
            // Traffic class, flow label and hop limit masked to ones.
            let ip = &mut pre[at..at + 40];
            ip[0] = 0x6F;
            ip[1..4].copy_from_slice(&[0xFF, 0xFF, 0xFF]);
            ip[4..6].copy_from_slice(&((8 + len) as u16).to_be_bytes());
            ip[6] = 17;
            ip[7] = 0xFF;
            ip[8..24].copy_from_slice(&s.octets());
            ip[24..40].copy_from_slice(&d.octets());
            at += 40;
        }
    }
    let udp = frame::udp_header(addrs, len);
    pre[at..at + 6].copy_from_slice(&udp[..6]);
    pre[at + 6] = 0xFF; // UDP checksum
    pre[at + 7] = 0xFF;
    at += 8;
    let head = body.len().min(BTH_LEN);
    pre[at..at + head].copy_from_slice(&body[..head]);
    if body.len() > 4 {
        pre[at + 4] = 0xFF; // FECN, BECN, reserved
    }
    at += head;
    let mut h = Hasher::new();
    h.update(&pre[..at]);
    h.update(&body[head..]);
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

// ---------------------------------------------------------------------------
// Checking an IPv4 packet whose IP ID is unknown.
//
// A UDP socket does not show the receiver the IPv4 ID, yet the ICRC covers it,
// and Linux rxe sends varying IDs (a per-destination counter; DF set). CRC-32 is
// affine over GF(2): for a fixed message length n, crc(m ^ d) = crc(m) ^ L(d),
// where L(d) is the raw CRC register (init 0, no final inversion) of d. Flipping
// ID bit i therefore flips the ICRC by a fixed vector L_i that depends only on how
// many bytes follow the ID field, i.e. on the packet length. With c0 the ICRC for
// ID 0, the stored ICRC s is correct for ID x iff  sum_i x_i L_i = s ^ c0: a
// 32 x 16 linear system over GF(2), solved by elimination below.
//
// The L_i are computed per call in O(log n) (zlib's crc32_combine technique:
// multiply by x^(8k) mod P, with x^(2^j) mod P from a const table), so no scratch
// buffer and no second pass over the packet is needed.

/// The CRC-32 polynomial, reflected (bit 31 is the x^0 coefficient).
const POLY: u32 = 0xEDB8_8320;

/// a(x) * b(x) mod P(x), both reflected. Same as zlib's `multmodp`.
const fn multmodp(a: u32, mut b: u32) -> u32 {
    let mut m = 1u32 << 31;
    let mut p = 0u32;
    loop {
        if a & m != 0 {
            p ^= b;
            if a & (m - 1) == 0 {
                break;
            }
        }
        m >>= 1;
        b = if b & 1 != 0 { (b >> 1) ^ POLY } else { b >> 1 };
    }
    p
}

/// `X2N[j]` = x^(2^j) mod P (reflected), j = 0..32. x^1 is `1 << 30`.
const X2N: [u32; 32] = {
    let mut t = [0u32; 32];
    let mut p = 1u32 << 30;
    let mut j = 0;
    while j < 32 {
        t[j] = p;
        p = multmodp(p, p);
        j += 1;
    }
    t
};

/// x^(8 * n_bytes) mod P: the operator that runs a raw CRC register through
/// `n_bytes` zero bytes. At most 64 multiplications (usize is at most 64 bits;
/// x^(2^j) cycles with period dividing 2^32 - 1, but exponents here stay small).
fn zeros_operator(n_bytes: usize) -> u32 {
    let mut p = 1u32 << 31; // x^0
    let mut n = n_bytes as u64;
    let mut j = 3; // n * 2^3 bits
    while n != 0 {
        if n & 1 != 0 {
            p = multmodp(X2N[j & 31], p);
        }
        n >>= 1;
        j += 1;
    }
    p
}

/// Raw CRC register (init 0, no final inversion) after one byte `b`.
const fn raw_crc_byte(b: u8) -> u32 {
    let mut c = b as u32;
    let mut i = 0;
    while i < 8 {
        c = if c & 1 != 0 { (c >> 1) ^ POLY } else { c >> 1 };
        i += 1;
    }
    c
}

/// The 16 ICRC difference vectors L_i (bit i of the IPv4 ID flipped) for an IPv4
/// packet whose UDP payload (ICRC included) is `udp_payload_len` bytes long.
fn ip_id_basis(udp_payload_len: usize) -> [u32; 16] {
    // The hashed message: 8 x 0xFF, IPv4 header (20), UDP header (8), payload
    // without the ICRC. The ID is at IP header bytes 4 (high) and 5 (low), message
    // offsets 12 and 13; after byte 13 come 20 - 6 + 8 + (len - 4) = len + 18 bytes.
    let after_low = udp_payload_len + 18;
    let shift_low = zeros_operator(after_low);
    // The high byte is followed by one more byte: one more factor x^8.
    let shift_high = multmodp(X2N[3], shift_low);
    let mut basis = [0u32; 16];
    for (i, l) in basis.iter_mut().enumerate() {
        *l = if i < 8 {
            multmodp(shift_low, raw_crc_byte(1 << i))
        } else {
            multmodp(shift_high, raw_crc_byte(1 << (i - 8)))
        };
    }
    basis
}

/// Echelon form of the 16 columns, built column by column: each row holds its pivot bit
/// (highest set bit), a reduced vector and which original columns it combines. A row
/// never contains the pivot bit of an earlier row, so reducing a target through the rows
/// in order clears every pivot bit. The columns are independent (CRC-32 detects every
/// burst of up to 32 bits, so no non-zero change confined to the 16 ID bits leaves the
/// CRC unchanged), so there are 16 rows.
fn echelon(basis: &[u32; 16]) -> ([(u32, u32, u16); 16], usize) {
    let mut rows: [(u32, u32, u16); 16] = [(0, 0, 0); 16];
    let mut n = 0;
    for (i, &col) in basis.iter().enumerate() {
        let mut v = col;
        let mut comb = 1u16 << i;
        for &(pivot, vec, c) in &rows[..n] {
            if v & pivot != 0 {
                v ^= vec;
                comb ^= c;
            }
        }
        if v != 0 {
            rows[n] = (1 << (31 - v.leading_zeros()), v, comb);
            n += 1;
        }
    }
    (rows, n)
}

/// Check a received packet whose IPv4 ID the receiver cannot see (a UDP socket
/// hides the IP header). Returns the IP ID for which the stored ICRC is correct,
/// or None if no ID makes it correct (or the packet is shorter than BTH + ICRC).
/// The rest of the IPv4 header is assumed as [`compute`] builds it (no options,
/// DF set, fragment offset 0: rxe sends with DF, as observed in the rxe-vm).
///
/// For IPv6 (no ID field) this is [`verify`]: `Some(0)` if it verifies, else None.
///
/// Cost: the fast path (a packet sent with ID 0, as softrdma and any DF-set Linux
/// UDP socket send) is exactly one [`compute`], the cost of [`verify`]. Otherwise
/// it adds O(log n) work independent of the payload bytes: about 50 32-step GF(2)
/// polynomial multiplications and a 32 x 16 elimination (0.6-0.75 us in release
/// builds on the development machine, for any length; `verify` itself took 50-150 ns
/// there for 32-4124 bytes), with no allocation and no second pass over the packet.
///
/// A wrong packet passes with probability about 2^-16 (any of the 2^16 IDs may
/// match), not 2^-32 as with a known ID; [`IpIdGuard`] checks the returned ID against
/// the IDs the sender plausibly used.
pub fn verify_unknown_ip_id(addrs: &Addrs, udp_payload: &[u8]) -> Option<u16> {
    verify_unknown_ip_id_with(&mut IpIdCache::default(), addrs, udp_payload)
}

/// [`verify_unknown_ip_id`] with the per-length work kept in `cache`: a receiver sees
/// few distinct lengths (full-MTU packets, ACKs), so after the first packet of a length
/// an unknown ID costs one [`compute`] and a 16-step reduction.
pub fn verify_unknown_ip_id_with(
    cache: &mut IpIdCache,
    addrs: &Addrs,
    udp_payload: &[u8],
) -> Option<u16> {
    if udp_payload.len() < BTH_LEN + ICRC_LEN {
        return None;
    }
    let stored = stored(udp_payload)?;
    let c0 = compute(addrs, udp_payload);
    if stored == c0 {
        return Some(0);
    }
    if !addrs.is_ipv4() {
        return None;
    }
    cache.get(udp_payload.len()).solve(stored ^ c0)
}

/// How the ICRC of an IPv4 RoCEv2 packet of one length depends on its IP ID. The ICRC
/// is affine in the message bits, so `ICRC(id) = ICRC(0) ^ delta(id)` with `delta`
/// linear in the 16 ID bits.
#[derive(Debug, Clone)]
pub struct IpIdEffect {
    len: usize,
    basis: [u32; 16],
    /// Echelon form of `basis` for [`IpIdEffect::solve`]: (pivot bit, vector, columns).
    rows: [(u32, u32, u16); 16],
    nrows: usize,
}

impl IpIdEffect {
    /// The effect for packets whose UDP payload (ICRC included) is `udp_payload_len`
    /// bytes. Costs about 50 GF(2) polynomial multiplications; keep it per length.
    pub fn new(udp_payload_len: usize) -> IpIdEffect {
        let basis = ip_id_basis(udp_payload_len);
        let (rows, nrows) = echelon(&basis);
        IpIdEffect {
            len: udp_payload_len,
            basis,
            rows,
            nrows,
        }
    }
    /// The UDP payload length this effect is for.
    pub fn payload_len(&self) -> usize {
        self.len
    }
    /// How the ICRC changes when the IP ID changes by `id_xor` (old ID XOR new ID).
    pub fn delta(&self, id_xor: u16) -> u32 {
        let mut d = 0;
        for (i, b) in self.basis.iter().enumerate() {
            if id_xor & (1 << i) != 0 {
                d ^= b;
            }
        }
        d
    }
    /// The ID change that explains an ICRC difference, if any.
    pub fn solve(&self, crc_xor: u32) -> Option<u16> {
        let mut t = crc_xor;
        let mut x = 0u16;
        for &(pivot, vec, c) in &self.rows[..self.nrows] {
            if t & pivot != 0 {
                t ^= vec;
                x ^= c;
            }
        }
        (t == 0).then_some(x)
    }
    /// Re-seal a packet sealed for IP ID `from` (by [`seal`]: 0) so that its ICRC is
    /// right when it leaves with ID `to`, without a pass over the payload. Does nothing
    /// if the packet is not `payload_len` bytes long.
    pub fn reseal(&self, udp_payload: &mut [u8], from: u16, to: u16) {
        if udp_payload.len() != self.len {
            return;
        }
        if let Some(crc) = stored(udp_payload) {
            let crc = crc ^ self.delta(from ^ to);
            udp_payload[self.len - ICRC_LEN..].copy_from_slice(&crc.to_le_bytes());
        }
    }
}

/// A few [`IpIdEffect`]s by length, replaced round-robin.
#[derive(Debug, Clone, Default)]
pub struct IpIdCache {
    slots: Vec<IpIdEffect>,
    next: usize,
}

impl IpIdCache {
    const SLOTS: usize = 4;

    /// The effect for `udp_payload_len`, computed on first use.
    pub fn get(&mut self, udp_payload_len: usize) -> &IpIdEffect {
        if let Some(i) = self.slots.iter().position(|e| e.len == udp_payload_len) {
            return &self.slots[i];
        }
        let e = IpIdEffect::new(udp_payload_len);
        let i = if self.slots.len() < Self::SLOTS {
            self.slots.push(e);
            self.slots.len() - 1
        } else {
            let i = self.next;
            self.slots[i] = e;
            self.next = (i + 1) % Self::SLOTS;
            i
        };
        &self.slots[i]
    }
}

/// Which IPv4 IDs a receiver believes from each sender.
///
/// [`verify_unknown_ip_id_with`] accepts a packet when *any* of the 2^16 IDs makes its
/// ICRC right, so a corrupted packet passes with probability 2^-16: one in about
/// 65,000 corrupted packets reached the application with its damage. Real senders use
/// far fewer IDs. softrdma sends ID 0, and the kernel numbers the segments of a UDP GSO
/// message 0, 1, 2 ... (below [`IpIdGuard::GSO_IDS`]); Linux rxe and connected UDP
/// sockets count up per destination. So an ID below `GSO_IDS` is always believed, and
/// a higher one only when it continues the sender's count (at most
/// [`IpIdGuard::AHEAD`] ahead or [`IpIdGuard::BEHIND`] behind the last one believed).
/// A corrupted packet then passes with probability about 2^-20 (4,416 of the 2^32
/// ICRC values) while its sender's count is known, and 2^-26 from a sender that only
/// uses low IDs.
///
/// A count can jump (the kernel adds a random step after idle time, and other traffic
/// to the same host shares the counter). A sender silent for [`IpIdGuard::IDLE_NS`]
/// starts afresh: its first ID is believed, so a peer's first packet (a connection
/// request) is never lost to this check. While a counting sender is active, an ID off
/// its count is refused and remembered, and a packet just past it (at most
/// [`IpIdGuard::CONFIRM`]) confirms the jump: a real jump costs one packet, which the
/// transport resends. A sender that has used only low IDs is not believed with a high
/// one until it has been silent for `IDLE_NS`.
#[derive(Debug, Default, Clone)]
pub struct IpIdGuard {
    senders: std::collections::HashMap<std::net::Ipv4Addr, IpIdSender>,
    /// The sender whose low-ID packet last updated its entry, and when: most packets
    /// come from one peer with ID 0, and its `seen` need not be more exact than this.
    recent: Option<(std::net::Ipv4Addr, u64)>,
}

#[derive(Debug, Clone, Copy)]
struct IpIdSender {
    /// When a packet from this sender was last believed (ns).
    seen: u64,
    /// The sender's count: the latest ID at or above `GSO_IDS` believed.
    count: Option<u16>,
    /// An ID off the count, refused; a packet continuing from it confirms a jump.
    jump: Option<u16>,
}

impl IpIdGuard {
    /// IDs below this are always believed: softrdma's ID 0 and its GSO segments
    /// (at most 64 per message, the kernel's limit before Linux 6.9).
    pub const GSO_IDS: u16 = 64;
    /// A sender silent this long (ns) starts a fresh count.
    pub const IDLE_NS: u64 = 1_000_000_000;
    /// How far ahead of a sender's count an ID may be: packets sent to this host and
    /// lost, and other traffic sharing the kernel's counter, advance it.
    pub const AHEAD: u16 = 4096;
    /// How far behind: packets reordered on the way.
    pub const BEHIND: u16 = 256;
    /// How far past a refused ID the next one may be and confirm a jump of the count.
    pub const CONFIRM: u16 = 64;
    /// Senders tracked at once; beyond this, senders idle for `IDLE_NS` are forgotten,
    /// and a new sender with no room is believed as if it were fresh.
    pub const MAX_SENDERS: usize = 4096;

    /// Whether to believe that the packet from `src` received at `now` (ns, any
    /// monotonic origin) was sent with IPv4 ID `id`, the ID its ICRC was solved for.
    /// Records what it believes.
    pub fn admit(&mut self, now: u64, src: std::net::Ipv4Addr, id: u16) -> bool {
        if id < Self::GSO_IDS {
            if let Some((ip, at)) = self.recent {
                if ip == src && now.saturating_sub(at) < Self::IDLE_NS / 1024 {
                    return true;
                }
            }
            self.recent = Some((src, now));
        }
        let Some(s) = self.senders.get_mut(&src) else {
            if self.senders.len() >= Self::MAX_SENDERS {
                self.recent = None;
                self.senders
                    .retain(|_, s| now.saturating_sub(s.seen) < Self::IDLE_NS);
            }
            if self.senders.len() < Self::MAX_SENDERS {
                let count = (id >= Self::GSO_IDS).then_some(id);
                self.senders.insert(
                    src,
                    IpIdSender {
                        seen: now,
                        count,
                        jump: None,
                    },
                );
            }
            return true;
        };
        if id < Self::GSO_IDS {
            s.seen = now;
            return true;
        }
        let fresh = now.saturating_sub(s.seen) >= Self::IDLE_NS;
        // How far `id` is past `from`, when it is within the window around it.
        let step = |from: Option<u16>| {
            let d = id.wrapping_sub(from?) as i16;
            (-(Self::BEHIND as i16)..=Self::AHEAD as i16)
                .contains(&d)
                .then_some(d)
        };
        let on_count = step(s.count);
        // A jump is confirmed only on a count (a sender that used low IDs alone does not
        // start counting while active), and only by an ID just past the refused one:
        // which IDs explain a corruption depends on nothing but where the bytes changed
        // and how, so corruptions repeat IDs and land near each other.
        let confirms_jump = s.count.is_some()
            && s.jump
                .is_some_and(|j| (1..=Self::CONFIRM).contains(&id.wrapping_sub(j)));
        if fresh || on_count.is_some() || confirms_jump {
            // A reordered packet (behind the count) leaves the count where it is.
            if fresh || on_count.map_or(true, |d| d > 0) {
                s.count = Some(id);
            }
            s.jump = None;
            s.seen = now;
            true
        } else {
            s.jump = Some(id);
            false
        }
    }
}

#[cfg(test)]
mod ip_id_tests {
    use super::*;

    /// Raw CRC (init 0, no final xor) of `data`, from crc32fast: crc(d) ^ crc(0^n).
    fn raw(data: &[u8]) -> u32 {
        crc32fast::hash(data) ^ crc32fast::hash(&vec![0u8; data.len()])
    }

    #[test]
    fn x2n_table_starts_right() {
        assert_eq!(X2N[0], 1 << 30); // x
        assert_eq!(X2N[1], 1 << 29); // x^2
        assert_eq!(X2N[3], 1 << 23); // x^8
        assert_eq!(X2N[5], POLY); // x^32 = P - x^32
    }

    #[test]
    fn single_bit_difference_matches_crc32fast() {
        for len in [1usize, 2, 3, 14, 15, 100, 1027, 4096 + 13] {
            for pos in [0, len / 2, len - 1] {
                for bit in [0u8, 3, 7] {
                    let mut d = vec![0u8; len];
                    d[pos] = 1 << bit;
                    let ours = multmodp(zeros_operator(len - pos - 1), raw_crc_byte(1 << bit));
                    assert_eq!(ours, raw(&d), "len {len} pos {pos} bit {bit}");
                }
            }
        }
    }

    #[test]
    fn basis_is_independent_for_all_small_lengths() {
        for len in 16..2000 {
            let e = IpIdEffect::new(len);
            for i in 0..16 {
                assert_eq!(e.solve(e.basis[i]), Some(1 << i), "len {len} bit {i}");
            }
        }
    }

    /// A frame as the wire carries it, with IP ID `id` (the ICRC ignores the header
    /// checksum, so it is left as it was).
    fn frame_with_id(addrs: &Addrs, payload: &[u8], id: u16) -> Vec<u8> {
        let mut f = frame::emit_ip_udp(addrs, 0, payload);
        f[4..6].copy_from_slice(&id.to_be_bytes());
        f
    }

    #[test]
    fn reseal_matches_a_frame_with_that_id() {
        let addrs = Addrs::new(
            "10.0.0.1:49152".parse().unwrap(),
            "10.0.0.2:4791".parse().unwrap(),
        );
        for len in [BTH_LEN + ICRC_LEN, 64, 1052, 4124] {
            let mut p: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
            seal(&addrs, &mut p);
            let e = IpIdEffect::new(len);
            for id in [1u16, 2, 3, 63, 0x8001, 0xFFFF] {
                let mut q = p.clone();
                e.reseal(&mut q, 0, id);
                // The independent check: the ICRC of the whole frame with its real header.
                let f = frame_with_id(&addrs, &q, id);
                assert!(verify_frame(&f), "len {len} id {id}");
                assert_eq!(verify_unknown_ip_id(&addrs, &q), Some(id));
                // And back.
                e.reseal(&mut q, id, 0);
                assert_eq!(q, p);
            }
        }
    }

    const T0: u64 = 5_000_000_000;
    const MS: u64 = 1_000_000;

    fn ip(s: &str) -> std::net::Ipv4Addr {
        s.parse().unwrap()
    }

    #[test]
    fn guard_believes_low_ids_and_a_new_senders_first_id() {
        let mut g = IpIdGuard::default();
        let a = ip("10.0.0.1");
        for id in [0, 1, 63, 0, 5] {
            assert!(g.admit(T0, a, id));
        }
        // A new sender's first ID, whatever it is (an rxe peer's connection request).
        assert!(g.admit(T0, ip("10.0.0.2"), 40_000));
        assert!(g.admit(T0 + MS, ip("10.0.0.2"), 40_001));
    }

    #[test]
    fn guard_follows_a_count_with_gaps_reordering_and_wrap() {
        let mut g = IpIdGuard::default();
        let a = ip("10.0.0.1");
        let mut t = T0;
        let mut id: u16 = 60_000;
        assert!(g.admit(t, a, id));
        for step in [1u16, 1, 7, IpIdGuard::AHEAD, 300, 2000, 1, 1] {
            t += MS;
            id = id.wrapping_add(step);
            assert!(g.admit(t, a, id), "step {step} to {id}");
        }
        // Past the wrap, through the low IDs and on.
        assert!(id < 10_000, "the count wrapped: {id}");
        // Reordered: behind the count, believed, and the count stays.
        assert!(g.admit(t, a, id.wrapping_sub(IpIdGuard::BEHIND)));
        assert!(g.admit(t, a, id.wrapping_add(1)));
        // Too far either way.
        assert!(!g.admit(t, a, id.wrapping_add(1 + IpIdGuard::AHEAD + 1)));
        assert!(!g.admit(t, a, id.wrapping_sub(IpIdGuard::BEHIND + 1)));
    }

    #[test]
    fn guard_refuses_a_high_id_from_an_active_low_id_sender() {
        let mut g = IpIdGuard::default();
        let a = ip("10.0.0.1");
        assert!(g.admit(T0, a, 0));
        assert!(g.admit(T0 + MS, a, 3));
        assert!(!g.admit(T0 + 2 * MS, a, 31_337));
        // An unrelated high ID does not confirm the first, nor does the same one again
        // or one just past it: such a sender does not start counting while active.
        assert!(!g.admit(T0 + 3 * MS, a, 9_000));
        assert!(!g.admit(T0 + 4 * MS, a, 9_000));
        assert!(!g.admit(T0 + 5 * MS, a, 9_001));
        // Low IDs go on being believed.
        assert!(g.admit(T0 + 6 * MS, a, 0));
    }

    #[test]
    fn guard_confirms_a_jump_with_the_next_packet_and_starts_afresh_after_idle() {
        let mut g = IpIdGuard::default();
        let a = ip("10.0.0.1");
        assert!(g.admit(T0, a, 1000));
        assert!(g.admit(T0 + MS, a, 1001));
        // The counter jumped (other traffic, a random step): one packet is refused...
        assert!(!g.admit(T0 + 2 * MS, a, 30_000));
        // ...the same ID again does not confirm it (a corruption repeats its ID)...
        assert!(!g.admit(T0 + 3 * MS, a, 30_000));
        // ...and the next one, just past it, is believed and moves the count.
        assert!(g.admit(T0 + 3 * MS, a, 30_002));
        assert!(g.admit(T0 + 4 * MS, a, 30_003));
        assert!(!g.admit(T0 + 5 * MS, a, 1002));
        // Silent for IDLE_NS: any ID starts a fresh count.
        let later = T0 + 5 * MS + IpIdGuard::IDLE_NS;
        assert!(g.admit(later, a, 50_000));
        assert!(g.admit(later + MS, a, 50_001));
    }

    #[test]
    fn guard_stays_bounded_under_many_senders() {
        let mut g = IpIdGuard::default();
        let n = IpIdGuard::MAX_SENDERS as u32 + 100;
        for i in 0..n {
            assert!(g.admit(T0, std::net::Ipv4Addr::from(0x0A00_0000 + i), 1000));
        }
        assert_eq!(g.senders.len(), IpIdGuard::MAX_SENDERS);
        // Once they are idle, new senders take their place.
        let later = T0 + IpIdGuard::IDLE_NS;
        assert!(g.admit(later, ip("192.168.0.1"), 7000));
        assert!(g.senders.contains_key(&ip("192.168.0.1")));
        assert_eq!(g.senders.len(), 1);
    }

    /// The reason for the guard. Every one-byte corruption of a full-MTU packet, checked
    /// as a receiver checks a packet from an active softrdma peer: solving for any ID
    /// lets a few of them through (which ones depends only on where the byte is and how
    /// it changed, not on the data); with the guard none pass.
    #[test]
    fn guard_stops_the_corruptions_that_some_id_explains() {
        let addrs = Addrs::new(
            "10.0.0.1:49152".parse().unwrap(),
            "10.0.0.2:4791".parse().unwrap(),
        );
        let src = ip("10.0.0.1");
        let len = 1024 + 28; // payload, BTH, RETH, ICRC
        let mut rng = crate::SplitMix64::new(0x1C2C);
        let mut p: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
        seal(&addrs, &mut p);
        let effect = &IpIdEffect::new(len);
        // The hashed message is 8 + 20 + 8 bytes of headers, then the payload without
        // its ICRC; a byte at payload offset `at` is followed by len - 4 - at - 1 bytes.
        let explained: Vec<(usize, u8)> = (0..len - ICRC_LEN)
            .filter(|&at| at != 4) // the byte the ICRC leaves out
            .flat_map(|at| {
                let shift = zeros_operator(len - ICRC_LEN - at - 1);
                (1..=255u8)
                    .filter(move |&m| effect.solve(multmodp(shift, raw_crc_byte(m))).is_some())
                    .map(move |m| (at, m))
            })
            .collect();
        assert!(
            !explained.is_empty(),
            "no one-byte corruption matches an ID: the test shows nothing"
        );
        let mut cache = IpIdCache::default();
        let mut g = IpIdGuard::default();
        // Twice through: the same change explained by the same ID again, and changes
        // whose IDs are near each other, must not confirm one another.
        for (n, &(at, m)) in explained.iter().chain(&explained).enumerate() {
            let now = T0 + n as u64 * MS;
            assert!(g.admit(now, src, 0), "the sender's good packets");
            let mut q = p.clone();
            q[at] ^= m;
            let id = verify_unknown_ip_id_with(&mut cache, &addrs, &q)
                .unwrap_or_else(|| panic!("byte {at} ^ {m:#x} is explained by some ID"));
            assert!(!g.admit(now, src, id), "byte {at} ^ {m:#x} as ID {id}");
        }
    }

    #[test]
    fn cache_gives_the_same_answers() {
        let addrs = Addrs::new(
            "10.0.0.1:49152".parse().unwrap(),
            "10.0.0.2:4791".parse().unwrap(),
        );
        let mut cache = IpIdCache::default();
        for round in 0..3 {
            for len in [40usize, 60, 1052, 2000, 4124, 4128] {
                let mut p = vec![round as u8; len];
                seal(&addrs, &mut p);
                let id = (len as u16).wrapping_mul(31);
                IpIdEffect::new(len).reseal(&mut p, 0, id);
                assert_eq!(verify_unknown_ip_id_with(&mut cache, &addrs, &p), Some(id));
                p[len / 2] ^= 1;
                assert_eq!(
                    verify_unknown_ip_id_with(&mut cache, &addrs, &p).is_some(),
                    verify_unknown_ip_id(&addrs, &p).is_some()
                );
            }
        }
        assert!(cache.slots.len() <= IpIdCache::SLOTS);
    }
}
