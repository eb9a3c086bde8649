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
//!   missing one), then [`TAG`], then a [`SACK_BITMAP_LEN`]-byte bitmap: bit `i` (byte
//!   `i / 8`, least significant bit first) set when the request packet with PSN
//!   `expected + 1 + i` is held.

use crate::{psn, Bth, Error, Opcode, Result, BTH_LEN, ICRC_LEN};

/// Opcode of the requester's "send me SACKs" message.
pub const SACK_PERMIT: Opcode = Opcode(0xC0);
/// Opcode of the responder's selective acknowledgement.
pub const SACK: Opcode = Opcode(0xC1);
/// The body's first four bytes: "SR", version 1, zero. Another vendor's use of the same
/// opcodes does not carry it.
pub const TAG: [u8; 4] = [b'S', b'R', 1, 0];
/// PSNs past the expected one a SACK describes (the responder's hold window).
pub const SACK_SPAN: u32 = 512;
/// Bytes of the SACK bitmap.
pub const SACK_BITMAP_LEN: usize = SACK_SPAN as usize / 8;
/// UDP payload length of a SACK_PERMIT.
pub const SACK_PERMIT_LEN: usize = BTH_LEN + TAG.len() + ICRC_LEN;
/// UDP payload length of a SACK.
pub const SACK_LEN: usize = BTH_LEN + TAG.len() + SACK_BITMAP_LEN + ICRC_LEN;

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

    /// The largest `d` marked held, if any.
    pub fn highest(&self) -> Option<u32> {
        let (byte, v) = self.0.iter().enumerate().rev().find(|(_, v)| **v != 0)?;
        Some(byte as u32 * 8 + (7 - v.leading_zeros()) + 1)
    }

    /// How many are marked held at `d >= from`.
    pub fn count_from(&self, from: u32) -> u32 {
        let i = from.max(1) - 1;
        if i >= SACK_SPAN {
            return 0;
        }
        let byte = i as usize / 8;
        let rest: u32 = self.0[byte + 1..].iter().map(|b| b.count_ones()).sum();
        (self.0[byte] >> (i % 8)).count_ones() + rest
    }
}

/// A parsed extension message.
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
        let want = match bth.opcode {
            SACK_PERMIT => SACK_PERMIT_LEN,
            SACK => SACK_LEN,
            op => return Err(Error::UnknownOpcode(op.0)),
        };
        if udp_payload.len() != want {
            return Err(if udp_payload.len() < want {
                Error::Truncated
            } else {
                Error::BadLength
            });
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
        let mut bits = SackBitmap::default();
        bits.0
            .copy_from_slice(&udp_payload[at..at + SACK_BITMAP_LEN]);
        Ok(Ext::Sack(bth, bits))
    }

    /// The UDP payload length this message takes.
    pub fn len(&self) -> usize {
        match self {
            Ext::SackPermit(_) => SACK_PERMIT_LEN,
            Ext::Sack(..) => SACK_LEN,
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
            buf[at..at + SACK_BITMAP_LEN].copy_from_slice(&bits.0);
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
        assert_eq!(b.0[0], 0b0000_0011, "PSN expected+1 is bit 0 of byte 0");
        assert_eq!(b.0[1], 0b0000_0001);
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
        let mut sack = Bth::new(SACK, 0x12345, 0xFF_FFFF);
        sack.ack_req = true;
        let permit = Bth::new(SACK_PERMIT, 0x12345, 7);
        for m in [Ext::Sack(sack, bits), Ext::SackPermit(permit)] {
            let mut buf = vec![0xAA; m.len()];
            assert_eq!(m.emit(&mut buf).unwrap(), m.len());
            icrc::seal(&addrs, &mut buf);
            assert!(icrc::verify(&addrs, &buf));
            assert_eq!(Ext::parse(&buf).unwrap(), m);
        }
    }

    #[test]
    fn malformed_is_refused() {
        let mut buf = vec![0; SACK_LEN];
        Ext::Sack(Bth::new(SACK, 1, 1), SackBitmap::default())
            .emit(&mut buf)
            .unwrap();
        assert!(Ext::parse(&buf).is_ok());
        assert_eq!(Ext::parse(&buf[..SACK_LEN - 1]), Err(Error::Truncated));
        let mut long = buf.clone();
        long.extend_from_slice(&[0; 4]);
        assert_eq!(Ext::parse(&long), Err(Error::BadLength));
        let mut bad_tag = buf.clone();
        bad_tag[BTH_LEN] = b'X';
        assert!(Ext::parse(&bad_tag).is_err(), "another vendor's 0xC1");
        let mut other = buf.clone();
        other[0] = 0xC2;
        assert_eq!(Ext::parse(&other), Err(Error::UnknownOpcode(0xC2)));
        assert!(is_vendor(SACK) && is_vendor(SACK_PERMIT) && !is_vendor(Opcode(0x81)));
    }
}
