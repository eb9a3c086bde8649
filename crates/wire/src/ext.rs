//! softrdma's selective acknowledgement, an extension between softrdma peers in the
//! IBTA's manufacturer-specific opcode range (0xC0–0xFF).
//!
//! Why: a RoCEv2 sequence NAK names one missing PSN, so a requester learns of one hole
//! per round trip, and on a lossy path with many packets in flight the holes are
//! repaired one round trip each. A softrdma responder holds the packets that follow a
//! hole; with this extension it also says which ones, so its requester resends every
//! missing packet at once, as TCP does with SACK.
//!
//! Negotiation: a requester that has seen its peer hold packets (which an IBTA
//! responder never does) sends [`SACK_PERMIT`]; only a responder that received one
//! sends [`SACK`]s to that QP. An IBTA peer therefore never receives either. Neither
//! message changes the meaning of any IBTA packet: a SACK acknowledges nothing and
//! completes nothing; it only tells the requester what it may resend early.
//!
//! Both are a BTH followed by a body, then the ICRC, like any RoCEv2 packet:
//!
//! - `SACK_PERMIT` (requester → responder): BTH (PSN: the requester's oldest
//!   unacknowledged PSN, for traces), then [`TAG`].
//! - `SACK` (responder → requester): BTH (PSN: the responder's expected PSN, the first
//!   missing one), then [`TAG`], then a bitmap of 0 to [`SACK_BITMAP_LEN`] bytes, a
//!   multiple of 8: bit `i` (byte `i / 8`, least significant bit first) set when the
//!   request packet with PSN `expected + 1 + i` is held. The sender stops after the last
//!   8-byte group with a bit set; bits past the end are clear.
//!
//! Version 2 (the tag's third byte) made the bitmap's length variable and its span
//! [`SACK_SPAN`] PSNs (version 1: exactly 64 bytes). A peer of the other version finds
//! the tag wrong and drops the message, so two such peers never negotiate SACKs.

use crate::{psn, Bth, Error, Opcode, Result, BTH_LEN, ICRC_LEN};

/// Opcode of the requester's "send me SACKs" message.
pub const SACK_PERMIT: Opcode = Opcode(0xC0);
/// Opcode of the responder's selective acknowledgement.
pub const SACK: Opcode = Opcode(0xC1);
/// Opcode of a WRITE whose payload the requester copied into the responder's memory
/// itself, between two softrdma devices of one host (cross-memory attach): the headers of
/// an RC RDMA WRITE ONLY (BTH, RETH naming the whole message) and no payload. A
/// responder takes it only from a same-host ring, never from the network.
pub const PLACED_WRITE: Opcode = Opcode(0xC2);
/// [`PLACED_WRITE`] with immediate data: the headers of an RC RDMA WRITE ONLY with
/// Immediate.
pub const PLACED_WRITE_IMM: Opcode = Opcode(0xC3);

/// The IBTA opcode whose headers a placed WRITE carries, if `op` is one.
pub fn placed_as(op: Opcode) -> Option<Opcode> {
    match op {
        PLACED_WRITE => Some(Opcode::RC_RDMA_WRITE_ONLY),
        PLACED_WRITE_IMM => Some(Opcode::RC_RDMA_WRITE_ONLY_IMM),
        _ => None,
    }
}

/// The body's first four bytes: "SR", version 2, zero. Another vendor's use of the same
/// opcodes does not carry it.
pub const TAG: [u8; 4] = [b'S', b'R', 2, 0];
/// PSNs past the expected one a SACK describes (the responder's hold window).
pub const SACK_SPAN: u32 = 4096;
/// Bytes of the SACK bitmap, at most.
pub const SACK_BITMAP_LEN: usize = SACK_SPAN as usize / 8;
/// UDP payload length of a SACK_PERMIT.
pub const SACK_PERMIT_LEN: usize = BTH_LEN + TAG.len() + ICRC_LEN;
/// UDP payload length of a SACK holding nothing (its bitmap empty).
pub const SACK_MIN_LEN: usize = BTH_LEN + TAG.len() + ICRC_LEN;
/// UDP payload length of a SACK with its whole bitmap.
pub const SACK_MAX_LEN: usize = SACK_MIN_LEN + SACK_BITMAP_LEN;

/// Whether an opcode is in the manufacturer-specific range, where these live.
pub fn is_vendor(op: Opcode) -> bool {
    op.0 >= 0xC0
}

/// Which request packets past the expected PSN a responder holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SackBitmap(pub [u8; SACK_BITMAP_LEN]);

impl Default for SackBitmap {
    fn default() -> Self {
        SackBitmap([0; SACK_BITMAP_LEN])
    }
}

impl SackBitmap {
    /// Mark the packet `d` PSNs past the expected one (`1..=SACK_SPAN`) as held; others
    /// are ignored.
    pub fn set(&mut self, d: u32) {
        if let Some(i) = d.checked_sub(1).filter(|&i| i < SACK_SPAN) {
            self.0[i as usize / 8] |= 1 << (i % 8);
        }
    }

    /// Whether the packet `d` PSNs past the expected one is held.
    pub fn get(&self, d: u32) -> bool {
        d.checked_sub(1)
            .filter(|&i| i < SACK_SPAN)
            .is_some_and(|i| self.0[i as usize / 8] & (1 << (i % 8)) != 0)
    }

    /// The bitmap as 64-bit words, bit `i` of word `w` for `d = 64·w + i + 1`.
    fn words(&self) -> impl DoubleEndedIterator<Item = u64> + ExactSizeIterator + '_ {
        self.0.chunks_exact(8).map(|c| {
            let mut w = [0; 8];
            w.copy_from_slice(c);
            u64::from_le_bytes(w)
        })
    }

    /// Replace 64-bit word `w` (`w < SACK_SPAN / 64`): bit `i` of `v` marks
    /// `d = 64·w + i + 1`, as [`SackBitmap::set`] does one at a time.
    pub fn set_word(&mut self, w: usize, v: u64) {
        self.0[8 * w..8 * w + 8].copy_from_slice(&v.to_le_bytes());
    }

    /// The largest `d` marked held, if any.
    pub fn highest(&self) -> Option<u32> {
        let (w, v) = self.words().enumerate().rev().find(|(_, v)| *v != 0)?;
        Some(w as u32 * 64 + (63 - v.leading_zeros()) + 1)
    }

    /// How many are marked held at `d >= from`.
    pub fn count_from(&self, from: u32) -> u32 {
        let i = from.max(1) - 1;
        if i >= SACK_SPAN {
            return 0;
        }
        let first = i as usize / 64;
        self.words()
            .enumerate()
            .skip(first)
            .map(|(w, v)| {
                let v = if w == first { v >> (i % 64) } else { v };
                v.count_ones()
            })
            .sum()
    }

    /// The smallest `d >= from` (and `>= 1`) not marked held: `SACK_SPAN + 1` when every
    /// one from there on is.
    pub fn next_clear(&self, from: u32) -> u32 {
        let i = from.max(1) - 1;
        if i >= SACK_SPAN {
            return i + 1;
        }
        let first = i as usize / 64;
        for (w, v) in self.words().enumerate().skip(first) {
            // Bits below `i` in the first word count as held, so that they are skipped.
            let v = if w == first {
                v | ((1u64 << (i % 64)) - 1)
            } else {
                v
            };
            if v != u64::MAX {
                return w as u32 * 64 + v.trailing_ones() + 1;
            }
        }
        SACK_SPAN + 1
    }

    /// The bytes a SACK carries: the bitmap up to its last 8-byte group with a bit set.
    pub fn wire_bytes(&self) -> &[u8] {
        let n = self.highest().map_or(0, |d| (d as usize - 1) / 64 + 1);
        &self.0[..n * 8]
    }
}

/// A parsed extension message.
// A value on the stack, parsed and consumed at once: boxing the 512-byte bitmap would
// allocate for every SACK.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ext {
    /// The requester asks for SACKs.
    SackPermit(Bth),
    /// The responder's expected PSN (`bth.psn`) and the packets it holds past it.
    Sack(Bth, SackBitmap),
}

impl Ext {
    /// Parse a UDP payload (BTH .. ICRC; the ICRC is checked by the caller).
    pub fn parse(udp_payload: &[u8]) -> Result<Ext> {
        let bth = Bth::parse(udp_payload)?;
        if bth.tver != 0 {
            return Err(Error::BadVersion(bth.tver));
        }
        let n = udp_payload.len();
        match bth.opcode {
            SACK_PERMIT if n < SACK_PERMIT_LEN => return Err(Error::Truncated),
            SACK_PERMIT if n > SACK_PERMIT_LEN => return Err(Error::BadLength),
            SACK if n < SACK_MIN_LEN => return Err(Error::Truncated),
            SACK if n > SACK_MAX_LEN || (n - SACK_MIN_LEN) % 8 != 0 => {
                return Err(Error::BadLength)
            }
            SACK_PERMIT | SACK => {}
            op => return Err(Error::UnknownOpcode(op.0)),
        }
        if bth.pad != 0 {
            return Err(Error::BadPad);
        }
        if udp_payload[BTH_LEN..BTH_LEN + TAG.len()] != TAG {
            return Err(Error::UnknownOpcode(bth.opcode.0));
        }
        if bth.opcode == SACK_PERMIT {
            return Ok(Ext::SackPermit(bth));
        }
        let at = BTH_LEN + TAG.len();
        let body = &udp_payload[at..n - ICRC_LEN];
        let mut bits = SackBitmap::default();
        bits.0[..body.len()].copy_from_slice(body);
        Ok(Ext::Sack(bth, bits))
    }

    /// The UDP payload length this message takes.
    pub fn len(&self) -> usize {
        match self {
            Ext::SackPermit(_) => SACK_PERMIT_LEN,
            Ext::Sack(_, bits) => SACK_MIN_LEN + bits.wire_bytes().len(),
        }
    }

    /// Never true: every message has at least a BTH.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Write BTH and body into `buf` (at least [`Ext::len`] bytes), the ICRC's four bytes
    /// zero for the caller to seal. The BTH's opcode is set from the message kind.
    /// Returns the length written.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        let n = self.len();
        if buf.len() < n {
            return Err(Error::Truncated);
        }
        let (mut bth, bits) = match *self {
            Ext::SackPermit(b) => (b, None),
            Ext::Sack(b, bits) => (b, Some(bits)),
        };
        bth.opcode = if bits.is_some() { SACK } else { SACK_PERMIT };
        bth.pad = 0;
        bth.tver = 0;
        bth.psn &= psn::MASK;
        bth.emit(buf)?;
        buf[BTH_LEN..BTH_LEN + TAG.len()].copy_from_slice(&TAG);
        if let Some(bits) = bits {
            let at = BTH_LEN + TAG.len();
            let b = bits.wire_bytes();
            buf[at..at + b.len()].copy_from_slice(b);
        }
        buf[n - ICRC_LEN..n].fill(0);
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{icrc, Addrs};

    #[test]
    fn bitmap_marks_and_counts() {
        let mut b = SackBitmap::default();
        assert_eq!(b.highest(), None);
        b.set(0); // the expected PSN itself is never held
        b.set(SACK_SPAN + 1);
        assert_eq!(b, SackBitmap::default());
        for d in [1, 2, 9, 100, SACK_SPAN] {
            b.set(d);
        }
        assert!(b.get(1) && b.get(9) && b.get(SACK_SPAN) && !b.get(3) && !b.get(0));
        assert_eq!(b.highest(), Some(SACK_SPAN));
        assert_eq!(b.count_from(0), 5);
        assert_eq!(b.count_from(3), 3);
        assert_eq!(b.count_from(SACK_SPAN + 1), 0);
        assert_eq!(b.count_from(101), 1);
        assert_eq!(b.count_from(65), 2);
        assert_eq!(b.0[0], 0b0000_0011, "PSN expected+1 is bit 0 of byte 0");
        assert_eq!(b.0[1], 0b0000_0001);
        assert_eq!(
            b.wire_bytes().len(),
            SACK_BITMAP_LEN,
            "up to the last group set"
        );
        let mut short = SackBitmap::default();
        assert!(short.wire_bytes().is_empty());
        short.set(64);
        assert_eq!(short.wire_bytes().len(), 8);
        short.set(65);
        assert_eq!(short.wire_bytes().len(), 16);
        assert_eq!(short.highest(), Some(65));
        // A word at a time marks what set marks one at a time.
        let mut by_word = SackBitmap::default();
        by_word.set_word(0, 1 | 1 << 63);
        by_word.set_word(1, 1);
        let mut by_bit = SackBitmap::default();
        for d in [1, 64, 65] {
            by_bit.set(d);
        }
        assert_eq!(by_word, by_bit);
        by_word.set_word(0, 0);
        assert_eq!((by_word.highest(), by_word.count_from(0)), (Some(65), 1));
    }

    #[test]
    fn next_clear_finds_what_get_does_not_mark() {
        let mut b = SackBitmap::default();
        assert_eq!(
            (b.next_clear(0), b.next_clear(1), b.next_clear(77)),
            (1, 1, 77)
        );
        for d in (1..=70).chain(128..=130).chain(SACK_SPAN - 1..=SACK_SPAN) {
            b.set(d);
        }
        for from in 0..=SACK_SPAN + 2 {
            let by_get = (from.max(1)..=SACK_SPAN)
                .find(|&d| !b.get(d))
                .unwrap_or(SACK_SPAN + 1)
                .max(from);
            assert_eq!(b.next_clear(from), by_get, "from {from}");
        }
        let full = SackBitmap([0xFF; SACK_BITMAP_LEN]);
        assert_eq!(
            (full.next_clear(0), full.next_clear(4000)),
            (SACK_SPAN + 1, SACK_SPAN + 1)
        );
    }

    #[test]
    fn round_trip_and_sealed() {
        let addrs = Addrs::new(
            "10.0.0.1:4791".parse().unwrap(),
            "10.0.0.2:49152".parse().unwrap(),
        );
        let mut bits = SackBitmap::default();
        bits.set(2);
        bits.set(40);
        let mut far = bits;
        far.set(SACK_SPAN - 1);
        let mut sack = Bth::new(SACK, 0x12345, 0xFF_FFFF);
        sack.ack_req = true;
        let permit = Bth::new(SACK_PERMIT, 0x12345, 7);
        let msgs = [
            Ext::Sack(sack, bits),
            Ext::Sack(sack, far),
            Ext::Sack(sack, SackBitmap::default()),
            Ext::SackPermit(permit),
        ];
        assert_eq!(msgs[0].len(), SACK_MIN_LEN + 8);
        assert_eq!(msgs[1].len(), SACK_MAX_LEN);
        assert_eq!(msgs[2].len(), SACK_MIN_LEN);
        for m in msgs {
            let mut buf = vec![0xAA; m.len()];
            assert_eq!(m.emit(&mut buf).unwrap(), m.len());
            icrc::seal(&addrs, &mut buf);
            assert!(icrc::verify(&addrs, &buf));
            assert_eq!(Ext::parse(&buf).unwrap(), m);
        }
    }

    #[test]
    fn malformed_is_refused() {
        let mut bits = SackBitmap::default();
        bits.set(1);
        let m = Ext::Sack(Bth::new(SACK, 1, 1), bits);
        let mut buf = vec![0; m.len()];
        m.emit(&mut buf).unwrap();
        assert_eq!(Ext::parse(&buf), Ok(m));
        assert_eq!(Ext::parse(&buf[..SACK_MIN_LEN - 1]), Err(Error::Truncated));
        let mut odd = buf.clone();
        odd.extend_from_slice(&[0; 4]);
        assert_eq!(
            Ext::parse(&odd),
            Err(Error::BadLength),
            "not a multiple of 8"
        );
        let mut long = vec![0; SACK_MAX_LEN + 8];
        long[..buf.len()].copy_from_slice(&buf);
        assert_eq!(Ext::parse(&long), Err(Error::BadLength), "past the span");
        let mut v1 = buf.clone();
        v1[BTH_LEN + 2] = 1;
        assert!(Ext::parse(&v1).is_err(), "version 1's tag");
        let mut bad_tag = buf.clone();
        bad_tag[BTH_LEN] = b'X';
        assert!(Ext::parse(&bad_tag).is_err(), "another vendor's 0xC1");
        let mut other = buf.clone();
        other[0] = 0xC2;
        assert_eq!(Ext::parse(&other), Err(Error::UnknownOpcode(0xC2)));
        assert!(is_vendor(SACK) && is_vendor(SACK_PERMIT) && !is_vendor(Opcode(0x81)));
    }
}
