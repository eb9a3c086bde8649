//! Header representations (parse from bytes / emit into bytes) and whole packets.

use crate::opcode::{Opcode, Position};
use crate::view::BthView;
use crate::{
    pad_len, Error, Result, AETH_LEN, ATOMIC_ACK_ETH_LEN, ATOMIC_ETH_LEN, BTH_LEN, DEFAULT_PKEY,
    DETH_LEN, ICRC_LEN, IETH_LEN, IMMDT_LEN, RETH_LEN,
};

const MASK24: u32 = 0x00FF_FFFF;

// Big-endian accessors; callers guarantee the length (every call site is behind
// a length check), and a short slice yields zero rather than a panic.
pub(crate) fn be16(b: &[u8], at: usize) -> u16 {
    match b.get(at..at + 2) {
        Some(s) => u16::from_be_bytes([s[0], s[1]]),
        None => 0,
    }
}
pub(crate) fn be32(b: &[u8], at: usize) -> u32 {
    match b.get(at..at + 4) {
        Some(s) => u32::from_be_bytes([s[0], s[1], s[2], s[3]]),
        None => 0,
    }
}
pub(crate) fn be64(b: &[u8], at: usize) -> u64 {
    (u64::from(be32(b, at)) << 32) | u64::from(be32(b, at + 4))
}
pub(crate) fn put16(b: &mut [u8], at: usize, v: u16) {
    if let Some(s) = b.get_mut(at..at + 2) {
        s.copy_from_slice(&v.to_be_bytes());
    }
}
pub(crate) fn put32(b: &mut [u8], at: usize, v: u32) {
    if let Some(s) = b.get_mut(at..at + 4) {
        s.copy_from_slice(&v.to_be_bytes());
    }
}
pub(crate) fn put64(b: &mut [u8], at: usize, v: u64) {
    if let Some(s) = b.get_mut(at..at + 8) {
        s.copy_from_slice(&v.to_be_bytes());
    }
}

fn need(buf: &[u8], len: usize) -> Result<()> {
    if buf.len() < len {
        Err(Error::Truncated)
    } else {
        Ok(())
    }
}

/// Base Transport Header (12 bytes).
///
/// Layout: opcode(8) | SE(1) M(1) PadCnt(2) TVer(4) | P_Key(16) |
/// FECN(1) BECN(1) resv(6) | DestQP(24) | AckReq(1) resv(7) | PSN(24).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Bth {
    /// Opcode.
    pub opcode: Opcode,
    /// Solicited event.
    pub solicited: bool,
    /// Migration request.
    pub mig_req: bool,
    /// Pad count (0..=3). [`Headers::emit`] computes it from the payload length.
    pub pad: u8,
    /// Transport header version (0).
    pub tver: u8,
    /// Partition key.
    pub pkey: u16,
    /// Forward explicit congestion notification.
    pub fecn: bool,
    /// Backward explicit congestion notification.
    pub becn: bool,
    /// Destination QP number (24 bits).
    pub dest_qp: u32,
    /// Acknowledge request.
    pub ack_req: bool,
    /// Packet sequence number (24 bits).
    pub psn: u32,
}

impl Bth {
    /// A BTH with default pkey, version 0 and all flags clear.
    pub fn new(opcode: Opcode, dest_qp: u32, psn: u32) -> Self {
        Bth {
            opcode,
            solicited: false,
            mig_req: false,
            pad: 0,
            tver: 0,
            pkey: DEFAULT_PKEY,
            fecn: false,
            becn: false,
            dest_qp: dest_qp & MASK24,
            ack_req: false,
            psn: psn & MASK24,
        }
    }

    /// Parse the first 12 bytes of `buf`. Reserved bits are ignored; the version is not checked.
    /// (The bit layout is [`BthView`]'s, the one place that knows it.)
    pub fn parse(buf: &[u8]) -> Result<Self> {
        Ok(BthView::new_checked(buf)?.to_repr())
    }

    /// Write into the first 12 bytes of `buf`. Fields wider than their wire
    /// width are masked (pad to 2 bits, tver to 4, dest_qp and psn to 24); reserved bits are zero.
    pub fn emit(&self, buf: &mut [u8]) -> Result<()> {
        need(buf, BTH_LEN)?;
        buf[..BTH_LEN].fill(0);
        let mut v = BthView::new_checked(&mut buf[..BTH_LEN])?;
        v.set_opcode(self.opcode);
        v.set_solicited(self.solicited);
        v.set_mig_req(self.mig_req);
        v.set_pad(self.pad);
        v.set_tver(self.tver);
        v.set_pkey(self.pkey);
        v.set_fecn(self.fecn);
        v.set_becn(self.becn);
        v.set_dest_qp(self.dest_qp);
        v.set_ack_req(self.ack_req);
        v.set_psn(self.psn);
        Ok(())
    }
}

/// RDMA Extended Transport Header (16 bytes): VA(64) | R_Key(32) | DMA length(32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Reth {
    /// Remote virtual address.
    pub va: u64,
    /// Remote key.
    pub rkey: u32,
    /// Length of the whole RDMA operation in bytes.
    pub dma_len: u32,
}

impl Reth {
    /// Parse the first 16 bytes of `buf`.
    pub fn parse(buf: &[u8]) -> Result<Self> {
        need(buf, RETH_LEN)?;
        Ok(Reth {
            va: be64(buf, 0),
            rkey: be32(buf, 8),
            dma_len: be32(buf, 12),
        })
    }
    /// Write into the first 16 bytes of `buf`.
    pub fn emit(&self, buf: &mut [u8]) -> Result<()> {
        need(buf, RETH_LEN)?;
        put64(buf, 0, self.va);
        put32(buf, 8, self.rkey);
        put32(buf, 12, self.dma_len);
        Ok(())
    }
}

/// NAK codes (AETH syndrome type 011, value bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum NakCode {
    /// PSN sequence error.
    PsnSequenceError = 0,
    /// Invalid request.
    InvalidRequest = 1,
    /// Remote access error.
    RemoteAccessError = 2,
    /// Remote operational error.
    RemoteOperationalError = 3,
    /// Invalid RD request.
    InvalidRdRequest = 4,
}

/// The "no credit count" value rxe puts in the credits of every ACK (syndrome byte 0x1f).
pub const AETH_CREDITS_INVALID: u8 = 0x1F;

/// AETH syndrome: bits 7..5 the type (000 ACK, 001 RNR NAK, 011 NAK), bits 4..0 the value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Syndrome {
    /// Positive acknowledgement; `credits` is the 5-bit credit count
    /// ([`AETH_CREDITS_INVALID`] = no credit count, as rxe sends).
    Ack {
        /// 5-bit credit count.
        credits: u8,
    },
    /// Receiver not ready; `timer` is the 5-bit RNR timer code.
    RnrNak {
        /// 5-bit RNR NAK timer code.
        timer: u8,
    },
    /// Negative acknowledgement.
    Nak(NakCode),
}

impl Syndrome {
    /// The syndrome byte. Values wider than 5 bits are masked.
    pub fn to_byte(self) -> u8 {
        match self {
            Syndrome::Ack { credits } => credits & 0x1F,
            Syndrome::RnrNak { timer } => 0x20 | (timer & 0x1F),
            Syndrome::Nak(code) => 0x60 | code as u8,
        }
    }

    /// Decode a syndrome byte; reserved types (bit 7 set, type 010) and unknown
    /// NAK codes are [`Error::BadSyndrome`].
    pub fn from_byte(b: u8) -> Result<Self> {
        let value = b & 0x1F;
        match b >> 5 {
            0 => Ok(Syndrome::Ack { credits: value }),
            1 => Ok(Syndrome::RnrNak { timer: value }),
            3 => Ok(Syndrome::Nak(match value {
                0 => NakCode::PsnSequenceError,
                1 => NakCode::InvalidRequest,
                2 => NakCode::RemoteAccessError,
                3 => NakCode::RemoteOperationalError,
                4 => NakCode::InvalidRdRequest,
                _ => return Err(Error::BadSyndrome(b)),
            })),
            _ => Err(Error::BadSyndrome(b)),
        }
    }
}

/// ACK Extended Transport Header (4 bytes): syndrome(8) | MSN(24).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Aeth {
    /// Syndrome.
    pub syndrome: Syndrome,
    /// Message sequence number (24 bits).
    pub msn: u32,
}

impl Aeth {
    /// Parse the first 4 bytes of `buf`.
    pub fn parse(buf: &[u8]) -> Result<Self> {
        need(buf, AETH_LEN)?;
        Ok(Aeth {
            syndrome: Syndrome::from_byte(buf[0])?,
            msn: be32(buf, 0) & MASK24,
        })
    }
    /// Write into the first 4 bytes of `buf` (MSN masked to 24 bits).
    pub fn emit(&self, buf: &mut [u8]) -> Result<()> {
        need(buf, AETH_LEN)?;
        put32(
            buf,
            0,
            (u32::from(self.syndrome.to_byte()) << 24) | (self.msn & MASK24),
        );
        Ok(())
    }
}

/// Atomic Extended Transport Header (28 bytes):
/// VA(64) | R_Key(32) | Swap or Add data(64) | Compare data(64).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct AtomicEth {
    /// Remote virtual address (8-byte aligned for a valid request).
    pub va: u64,
    /// Remote key.
    pub rkey: u32,
    /// Swap value (compare-and-swap) or addend (fetch-and-add).
    pub swap_add: u64,
    /// Compare value (compare-and-swap; ignored for fetch-and-add).
    pub compare: u64,
}

impl AtomicEth {
    /// Parse the first 28 bytes of `buf`.
    pub fn parse(buf: &[u8]) -> Result<Self> {
        need(buf, ATOMIC_ETH_LEN)?;
        Ok(AtomicEth {
            va: be64(buf, 0),
            rkey: be32(buf, 8),
            swap_add: be64(buf, 12),
            compare: be64(buf, 20),
        })
    }
    /// Write into the first 28 bytes of `buf`.
    pub fn emit(&self, buf: &mut [u8]) -> Result<()> {
        need(buf, ATOMIC_ETH_LEN)?;
        put64(buf, 0, self.va);
        put32(buf, 8, self.rkey);
        put64(buf, 12, self.swap_add);
        put64(buf, 20, self.compare);
        Ok(())
    }
}

/// Atomic ACK Extended Transport Header (8 bytes): the original remote data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct AtomicAckEth {
    /// Value at the target address before the atomic operation.
    pub orig: u64,
}

impl AtomicAckEth {
    /// Parse the first 8 bytes of `buf`.
    pub fn parse(buf: &[u8]) -> Result<Self> {
        need(buf, ATOMIC_ACK_ETH_LEN)?;
        Ok(AtomicAckEth { orig: be64(buf, 0) })
    }
    /// Write into the first 8 bytes of `buf`.
    pub fn emit(&self, buf: &mut [u8]) -> Result<()> {
        need(buf, ATOMIC_ACK_ETH_LEN)?;
        put64(buf, 0, self.orig);
        Ok(())
    }
}

/// Datagram Extended Transport Header (8 bytes): Q_Key(32) | resv(8) | SrcQP(24).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Deth {
    /// Queue key.
    pub qkey: u32,
    /// Source QP number (24 bits).
    pub src_qp: u32,
}

impl Deth {
    /// Parse the first 8 bytes of `buf` (reserved byte ignored).
    pub fn parse(buf: &[u8]) -> Result<Self> {
        need(buf, DETH_LEN)?;
        Ok(Deth {
            qkey: be32(buf, 0),
            src_qp: be32(buf, 4) & MASK24,
        })
    }
    /// Write into the first 8 bytes of `buf` (src_qp masked to 24 bits).
    pub fn emit(&self, buf: &mut [u8]) -> Result<()> {
        need(buf, DETH_LEN)?;
        put32(buf, 0, self.qkey);
        put32(buf, 4, self.src_qp & MASK24);
        Ok(())
    }
}

/// The headers of a whole RoCE transport packet (the UDP payload, BTH to ICRC).
///
/// `imm` and `ieth` are the 4 wire bytes read big-endian (verbs' `imm_data` is
/// `__be32`: `imm.to_be_bytes()` are the bytes the application sees).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Headers {
    /// Base transport header.
    pub bth: Bth,
    /// Datagram extended transport header (UD).
    pub deth: Option<Deth>,
    /// RDMA extended transport header.
    pub reth: Option<Reth>,
    /// Atomic extended transport header.
    pub atomic_eth: Option<AtomicEth>,
    /// ACK extended transport header.
    pub aeth: Option<Aeth>,
    /// Atomic ACK extended transport header.
    pub atomic_ack: Option<AtomicAckEth>,
    /// Immediate data.
    pub imm: Option<u32>,
    /// Invalidate extended transport header (the rkey to invalidate).
    pub ieth: Option<u32>,
}

impl Headers {
    /// Headers with only a BTH; fill in the extension headers the opcode needs.
    pub fn new(bth: Bth) -> Self {
        Headers {
            bth,
            deth: None,
            reth: None,
            atomic_eth: None,
            aeth: None,
            atomic_ack: None,
            imm: None,
            ieth: None,
        }
    }

    /// Parse a UDP payload: checks that the opcode is implemented, the version is 0,
    /// the length covers headers and ICRC and is a multiple of 4, the pad count fits
    /// the payload (and is 0 on first/middle packets), and that opcodes without payload
    /// carry none. Does NOT check the ICRC (see [`crate::icrc::verify`]).
    ///
    /// Returns the headers and the payload (without pad and ICRC).
    pub fn parse(udp_payload: &[u8]) -> Result<(Headers, &[u8])> {
        let bth = Bth::parse(udp_payload)?;
        if bth.tver != 0 {
            return Err(Error::BadVersion(bth.tver));
        }
        let info = bth
            .opcode
            .info()
            .ok_or(Error::UnknownOpcode(bth.opcode.0))?;
        let total = udp_payload.len();
        if total < info.header_len + ICRC_LEN {
            return Err(Error::Truncated);
        }
        if total % 4 != 0 {
            return Err(Error::BadLength);
        }
        let body = &udp_payload[info.header_len..total - ICRC_LEN];
        let pad = usize::from(bth.pad);
        if !info.has_payload {
            if pad != 0 {
                return Err(Error::BadPad);
            }
            if !body.is_empty() {
                return Err(Error::BadLength);
            }
        } else if pad > body.len()
            || (pad != 0 && matches!(info.position, Position::First | Position::Middle))
        {
            return Err(Error::BadPad);
        }
        let payload = &body[..body.len() - pad];

        let mut h = Headers::new(bth);
        let mut at = BTH_LEN;
        let rest = |at: usize| &udp_payload[at..];
        if info.has_deth {
            h.deth = Some(Deth::parse(rest(at))?);
            at += DETH_LEN;
        }
        if info.has_reth {
            h.reth = Some(Reth::parse(rest(at))?);
            at += RETH_LEN;
        }
        if info.has_atomic_eth {
            h.atomic_eth = Some(AtomicEth::parse(rest(at))?);
            at += ATOMIC_ETH_LEN;
        }
        if info.has_aeth {
            h.aeth = Some(Aeth::parse(rest(at))?);
            at += AETH_LEN;
        }
        if info.has_atomic_ack_eth {
            h.atomic_ack = Some(AtomicAckEth::parse(rest(at))?);
            at += ATOMIC_ACK_ETH_LEN;
        }
        if info.has_immdt {
            need(rest(at), IMMDT_LEN)?;
            h.imm = Some(be32(udp_payload, at));
            at += IMMDT_LEN;
        }
        if info.has_ieth {
            need(rest(at), IETH_LEN)?;
            h.ieth = Some(be32(udp_payload, at));
            at += IETH_LEN;
        }
        debug_assert_eq!(at, info.header_len);
        Ok((h, payload))
    }

    /// BTH plus the extension headers present in `self`, in bytes.
    pub fn header_len(&self) -> usize {
        BTH_LEN
            + self.deth.map_or(0, |_| DETH_LEN)
            + self.reth.map_or(0, |_| RETH_LEN)
            + self.atomic_eth.map_or(0, |_| ATOMIC_ETH_LEN)
            + self.aeth.map_or(0, |_| AETH_LEN)
            + self.atomic_ack.map_or(0, |_| ATOMIC_ACK_ETH_LEN)
            + self.imm.map_or(0, |_| IMMDT_LEN)
            + self.ieth.map_or(0, |_| IETH_LEN)
    }

    /// Total UDP payload length for `payload_len` bytes of payload
    /// (headers + payload + pad + ICRC).
    pub fn packet_len(&self, payload_len: usize) -> usize {
        self.header_len()
            .saturating_add(payload_len)
            .saturating_add(pad_len(payload_len) + ICRC_LEN)
    }

    /// Check that the extension headers present are exactly those the opcode carries.
    pub fn check_matches_opcode(&self) -> Result<()> {
        let info = self
            .bth
            .opcode
            .info()
            .ok_or(Error::UnknownOpcode(self.bth.opcode.0))?;
        let ok = info.has_deth == self.deth.is_some()
            && info.has_reth == self.reth.is_some()
            && info.has_atomic_eth == self.atomic_eth.is_some()
            && info.has_aeth == self.aeth.is_some()
            && info.has_atomic_ack_eth == self.atomic_ack.is_some()
            && info.has_immdt == self.imm.is_some()
            && info.has_ieth == self.ieth.is_some();
        if ok {
            Ok(())
        } else {
            Err(Error::HeaderMismatch)
        }
    }

    /// Emit headers, payload, pad and a zero ICRC into `buf`; returns the number of
    /// bytes written ([`Headers::packet_len`]). The BTH pad count is computed from
    /// `payload.len()` (the `bth.pad` field is ignored).
    ///
    /// Errors: [`Error::UnknownOpcode`], [`Error::HeaderMismatch`] if the optional
    /// headers don't match the opcode, [`Error::BadLength`] for payload on an opcode
    /// without payload, [`Error::BadPad`] for a first/middle payload that is not a
    /// multiple of 4, [`Error::Truncated`] if `buf` is too small. Nothing is written on error.
    /// Seal the result with [`crate::icrc::seal`].
    pub fn emit(&self, payload: &[u8], buf: &mut [u8]) -> Result<usize> {
        let at = self.emit_header(payload.len(), buf)?;
        let total = self.packet_len(payload.len());
        buf[at..at + payload.len()].copy_from_slice(payload);
        buf[at + payload.len()..total].fill(0); // pad and ICRC
        Ok(total)
    }

    /// Emit only the headers of a packet that will carry `payload_len` bytes of payload
    /// (the BTH pad count computed from it); returns the header length. The caller then
    /// writes the payload at that offset, zeroes the pad and ICRC bytes up to
    /// [`Headers::packet_len`] and seals: what [`Headers::emit`] does, without needing
    /// the payload in a separate buffer first.
    ///
    /// Same checks and errors as [`Headers::emit`]; `buf` must hold the whole packet
    /// ([`Error::Truncated`] otherwise). Nothing is written on error.
    pub fn emit_header(&self, payload_len: usize, buf: &mut [u8]) -> Result<usize> {
        self.check_matches_opcode()?;
        let info = self
            .bth
            .opcode
            .info()
            .ok_or(Error::UnknownOpcode(self.bth.opcode.0))?;
        if !info.has_payload && payload_len != 0 {
            return Err(Error::BadLength);
        }
        let pad = pad_len(payload_len);
        if pad != 0 && matches!(info.position, Position::First | Position::Middle) {
            return Err(Error::BadPad);
        }
        let total = self.packet_len(payload_len);
        if buf.len() < total {
            return Err(Error::Truncated);
        }
        let buf = &mut buf[..total];
        let mut bth = self.bth;
        bth.pad = pad as u8;
        bth.emit(buf)?;
        let mut at = BTH_LEN;
        if let Some(d) = &self.deth {
            d.emit(&mut buf[at..])?;
            at += DETH_LEN;
        }
        if let Some(r) = &self.reth {
            r.emit(&mut buf[at..])?;
            at += RETH_LEN;
        }
        if let Some(a) = &self.atomic_eth {
            a.emit(&mut buf[at..])?;
            at += ATOMIC_ETH_LEN;
        }
        if let Some(a) = &self.aeth {
            a.emit(&mut buf[at..])?;
            at += AETH_LEN;
        }
        if let Some(a) = &self.atomic_ack {
            a.emit(&mut buf[at..])?;
            at += ATOMIC_ACK_ETH_LEN;
        }
        if let Some(i) = self.imm {
            put32(buf, at, i);
            at += IMMDT_LEN;
        }
        if let Some(i) = self.ieth {
            put32(buf, at, i);
            at += IETH_LEN;
        }
        Ok(at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip<T: PartialEq + core::fmt::Debug>(
        x: T,
        len: usize,
        emit: impl Fn(&T, &mut [u8]) -> Result<()>,
        parse: impl Fn(&[u8]) -> Result<T>,
        bytes: &[u8],
    ) {
        let mut buf = vec![0u8; len];
        emit(&x, &mut buf).unwrap();
        assert_eq!(buf, bytes);
        assert_eq!(parse(&buf).unwrap(), x);
        assert_eq!(parse(&buf[..len - 1]), Err(Error::Truncated));
        assert_eq!(emit(&x, &mut buf[..len - 1]), Err(Error::Truncated));
    }

    #[test]
    fn bth_bytes() {
        let b = Bth {
            opcode: Opcode::RC_RDMA_WRITE_ONLY,
            solicited: true,
            mig_req: true,
            pad: 2,
            tver: 0,
            pkey: 0x8001,
            fecn: true,
            becn: false,
            dest_qp: 0xABCDEF,
            ack_req: true,
            psn: 0x000102,
        };
        roundtrip(
            b,
            12,
            Bth::emit,
            Bth::parse,
            &[
                0x0A, 0xE0, 0x80, 0x01, 0x80, 0xAB, 0xCD, 0xEF, 0x80, 0x00, 0x01, 0x02,
            ],
        );
        // reserved bits are ignored on parse
        let p = Bth::parse(&[0x04, 0x00, 0xFF, 0xFF, 0x3F, 0, 0, 1, 0x7F, 0, 0, 2]).unwrap();
        assert!(!p.fecn && !p.becn && !p.ack_req);
        assert_eq!((p.dest_qp, p.psn), (1, 2));
    }

    #[test]
    fn reth_bytes() {
        roundtrip(
            Reth {
                va: 0x0102_0304_0506_0708,
                rkey: 0x1122_3344,
                dma_len: 0x5566_7788,
            },
            16,
            Reth::emit,
            Reth::parse,
            &[
                1, 2, 3, 4, 5, 6, 7, 8, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88,
            ],
        );
    }

    #[test]
    fn aeth_bytes_and_syndromes() {
        roundtrip(
            Aeth {
                syndrome: Syndrome::Ack {
                    credits: AETH_CREDITS_INVALID,
                },
                msn: 0x123456,
            },
            4,
            Aeth::emit,
            Aeth::parse,
            &[0x1F, 0x12, 0x34, 0x56],
        );
        roundtrip(
            Aeth {
                syndrome: Syndrome::Nak(NakCode::RemoteAccessError),
                msn: 1,
            },
            4,
            Aeth::emit,
            Aeth::parse,
            &[0x62, 0, 0, 1],
        );
        assert_eq!(Syndrome::RnrNak { timer: 14 }.to_byte(), 0x2E);
        assert_eq!(Syndrome::Nak(NakCode::PsnSequenceError).to_byte(), 0x60);
        assert_eq!(Syndrome::Nak(NakCode::InvalidRdRequest).to_byte(), 0x64);
        for b in 0..=255u8 {
            match Syndrome::from_byte(b) {
                Ok(s) => assert_eq!(s.to_byte(), b),
                Err(e) => {
                    assert_eq!(e, Error::BadSyndrome(b));
                    assert!(b >= 0x80 || (0x40..0x60).contains(&b) || b >= 0x65);
                }
            }
        }
        assert_eq!(Aeth::parse(&[0x40, 0, 0, 0]), Err(Error::BadSyndrome(0x40)));
    }

    #[test]
    fn atomic_bytes() {
        let mut bytes = vec![0, 0, 0, 0, 0, 0, 0x10, 0x08, 0xDE, 0xAD, 0xBE, 0xEF];
        bytes.extend_from_slice(&0x1111_2222_3333_4444u64.to_be_bytes());
        bytes.extend_from_slice(&0x5555_6666_7777_8888u64.to_be_bytes());
        roundtrip(
            AtomicEth {
                va: 0x1008,
                rkey: 0xDEAD_BEEF,
                swap_add: 0x1111_2222_3333_4444,
                compare: 0x5555_6666_7777_8888,
            },
            28,
            AtomicEth::emit,
            AtomicEth::parse,
            &bytes,
        );
        roundtrip(
            AtomicAckEth {
                orig: 0xFEDC_BA98_7654_3210,
            },
            8,
            AtomicAckEth::emit,
            AtomicAckEth::parse,
            &[0xFE, 0xDC, 0xBA, 0x98, 0x76, 0x54, 0x32, 0x10],
        );
    }

    #[test]
    fn deth_bytes() {
        roundtrip(
            Deth {
                qkey: 0x8001_0000,
                src_qp: 1,
            },
            8,
            Deth::emit,
            Deth::parse,
            &[0x80, 0x01, 0, 0, 0, 0, 0, 1],
        );
        // reserved byte ignored
        assert_eq!(
            Deth::parse(&[0, 0, 0, 1, 0xFF, 0, 0, 2]).unwrap(),
            Deth { qkey: 1, src_qp: 2 }
        );
    }

    fn send_only(payload_len: usize) -> (Headers, Vec<u8>) {
        let mut bth = Bth::new(Opcode::RC_SEND_ONLY, 0x11, 0x123456);
        bth.solicited = true;
        bth.ack_req = true;
        bth.pad = crate::pad_len(payload_len) as u8;
        let h = Headers::new(bth);
        let mut buf = vec![0xAAu8; h.packet_len(payload_len)];
        let payload: Vec<u8> = (0..payload_len as u8).collect();
        assert_eq!(h.emit(&payload, &mut buf), Ok(buf.len()));
        (h, buf)
    }

    #[test]
    fn emit_header_then_payload_equals_emit() {
        let mut h = Headers::new(Bth::new(Opcode::RC_RDMA_WRITE_ONLY_IMM, 7, 9));
        h.reth = Some(Reth {
            va: 0x1000,
            rkey: 0x42,
            dma_len: 6,
        });
        h.imm = Some(0xDEAD_BEEF);
        let payload = [1u8, 2, 3, 4, 5, 6];
        let mut a = vec![0x55u8; h.packet_len(payload.len())];
        assert_eq!(h.emit(&payload, &mut a), Ok(a.len()));
        let mut b = vec![0x55u8; a.len()];
        let at = h.emit_header(payload.len(), &mut b).unwrap();
        assert_eq!(at, h.header_len());
        b[at..at + payload.len()].copy_from_slice(&payload);
        b[at + payload.len()..].fill(0);
        assert_eq!(a, b);
        assert_eq!(
            h.emit_header(payload.len(), &mut b[..a.len() - 1]),
            Err(Error::Truncated)
        );
    }

    #[test]
    fn packet_send_only_bytes() {
        let (h, buf) = send_only(5);
        assert_eq!(
            buf,
            [
                4, 0xB0, 0xFF, 0xFF, 0, 0, 0, 0x11, 0x80, 0x12, 0x34, 0x56, 0, 1, 2, 3, 4, 0, 0, 0,
                0, 0, 0, 0
            ]
        );
        let (p, payload) = Headers::parse(&buf).unwrap();
        assert_eq!(p, h);
        assert_eq!(payload, &[0, 1, 2, 3, 4]);
    }

    #[test]
    fn packet_atomic_ack_order() {
        // AETH comes before AtomicAckETH (rxe_opcode.c offsets)
        let mut h = Headers::new(Bth::new(Opcode::RC_ATOMIC_ACKNOWLEDGE, 5, 6));
        h.aeth = Some(Aeth {
            syndrome: Syndrome::Ack { credits: 0x1F },
            msn: 9,
        });
        h.atomic_ack = Some(AtomicAckEth {
            orig: 0x0102_0304_0506_0708,
        });
        let mut buf = [0u8; 28];
        assert_eq!(h.emit(&[], &mut buf), Ok(28));
        assert_eq!(&buf[12..24], &[0x1F, 0, 0, 9, 1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(Headers::parse(&buf).unwrap(), (h, &[][..]));
    }

    #[test]
    fn packet_write_imm_order() {
        // RETH before ImmDt
        let mut h = Headers::new(Bth::new(Opcode::RC_RDMA_WRITE_ONLY_IMM, 5, 6));
        h.reth = Some(Reth {
            va: 1,
            rkey: 2,
            dma_len: 4,
        });
        h.imm = Some(0xCAFE_F00D);
        let mut buf = [0u8; 12 + 16 + 4 + 4 + 4];
        assert_eq!(h.emit(&[9, 9, 9, 9], &mut buf), Ok(buf.len()));
        assert_eq!(&buf[28..36], &[0xCA, 0xFE, 0xF0, 0x0D, 9, 9, 9, 9]);
        // UD: DETH before ImmDt
        let mut h = Headers::new(Bth::new(Opcode::UD_SEND_ONLY_IMM, 1, 0));
        h.deth = Some(Deth {
            qkey: 0x1111_1111,
            src_qp: 0x22,
        });
        h.imm = Some(0x3333_3333);
        let mut buf = [0u8; 28];
        assert_eq!(h.emit(&[], &mut buf), Ok(28));
        assert_eq!(
            &buf[12..24],
            &[0x11, 0x11, 0x11, 0x11, 0, 0, 0, 0x22, 0x33, 0x33, 0x33, 0x33]
        );
    }

    #[test]
    fn parse_rejects() {
        let (_, good) = send_only(5);
        assert_eq!(Headers::parse(&good[..11]), Err(Error::Truncated));
        assert_eq!(Headers::parse(&good[..15]), Err(Error::Truncated));
        assert_eq!(Headers::parse(&good[..18]), Err(Error::BadLength)); // not a multiple of 4
        let mut b = good.clone();
        b[0] = 0x15;
        assert_eq!(Headers::parse(&b), Err(Error::UnknownOpcode(0x15)));
        let mut b = good.clone();
        b[1] |= 0x01;
        assert_eq!(Headers::parse(&b), Err(Error::BadVersion(1)));
        // pad larger than the payload
        let mut b = good[..16].to_vec();
        b.extend_from_slice(&[0; 4]);
        assert_eq!(Headers::parse(&b).map(|x| x.1.len()), Ok(4 - 3));
        let b = [4, 0x30, 0xFF, 0xFF, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0];
        assert_eq!(Headers::parse(&b), Err(Error::BadPad));
        // pad on a first packet
        let mut b = good.clone();
        b[0] = Opcode::RC_SEND_FIRST.0;
        assert_eq!(Headers::parse(&b), Err(Error::BadPad));
        b[1] &= !0x30;
        assert!(Headers::parse(&b).is_ok());
        // payload on an ACK
        let mut b = vec![
            0x11, 0, 0xFF, 0xFF, 0, 0, 0, 1, 0, 0, 0, 1, 0x1F, 0, 0, 0, 0, 0, 0, 0,
        ];
        assert!(Headers::parse(&b).is_ok());
        b.extend_from_slice(&[0; 4]);
        assert_eq!(Headers::parse(&b), Err(Error::BadLength));
        b.truncate(20);
        b[1] = 0x10;
        assert_eq!(Headers::parse(&b), Err(Error::BadPad));
        b[1] = 0;
        b[12] = 0xE0;
        assert_eq!(Headers::parse(&b), Err(Error::BadSyndrome(0xE0)));
    }

    #[test]
    fn emit_rejects() {
        let mut buf = [0u8; 256];
        let h = Headers::new(Bth::new(Opcode::RC_RDMA_READ_REQUEST, 1, 1));
        assert_eq!(h.emit(&[], &mut buf), Err(Error::HeaderMismatch));
        let mut h2 = h;
        h2.reth = Some(Reth::default());
        assert_eq!(h2.emit(&[], &mut buf), Ok(32));
        assert_eq!(h2.emit(&[1], &mut buf), Err(Error::BadLength));
        assert_eq!(h2.emit(&[], &mut buf[..31]), Err(Error::Truncated));
        h2.imm = Some(1);
        assert_eq!(h2.emit(&[], &mut buf), Err(Error::HeaderMismatch));
        let h3 = Headers::new(Bth::new(Opcode::RC_SEND_MIDDLE, 1, 1));
        assert_eq!(h3.emit(&[1, 2], &mut buf), Err(Error::BadPad));
        assert_eq!(h3.emit(&[1, 2, 3, 4], &mut buf), Ok(20));
        let h4 = Headers::new(Bth::new(Opcode(0x81), 1, 1));
        assert_eq!(h4.emit(&[], &mut buf), Err(Error::UnknownOpcode(0x81)));
        // pad is computed, not taken from the bth
        let mut h5 = Headers::new(Bth::new(Opcode::RC_SEND_LAST, 1, 1));
        h5.bth.pad = 3;
        assert_eq!(h5.emit(&[1, 2, 3, 4], &mut buf), Ok(20));
        assert_eq!(buf[1] & 0x30, 0);
        assert_eq!(h5.packet_len(5), 12 + 5 + 3 + 4);
    }
}
