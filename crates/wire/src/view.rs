//! Typed views over byte buffers with checked construction (smoltcp style).

use crate::headers::{be16, be32, put16, put32, Bth};
use crate::{Error, Opcode, Result, BTH_LEN};

/// A view of a BTH at the start of a buffer. Construction checks the length, so
/// every accessor is infallible.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BthView<T: AsRef<[u8]>> {
    buf: T,
}

impl<T: AsRef<[u8]>> BthView<T> {
    /// Wrap `buf`, checking that it holds at least [`BTH_LEN`] bytes.
    pub fn new_checked(buf: T) -> Result<Self> {
        if buf.as_ref().len() < BTH_LEN {
            Err(Error::Truncated)
        } else {
            Ok(BthView { buf })
        }
    }

    /// The underlying buffer.
    pub fn into_inner(self) -> T {
        self.buf
    }

    fn b(&self) -> &[u8] {
        self.buf.as_ref()
    }

    /// Opcode.
    pub fn opcode(&self) -> Opcode {
        Opcode(self.b()[0])
    }
    /// Solicited event bit.
    pub fn solicited(&self) -> bool {
        self.b()[1] & 0x80 != 0
    }
    /// Migration request bit.
    pub fn mig_req(&self) -> bool {
        self.b()[1] & 0x40 != 0
    }
    /// Pad count.
    pub fn pad(&self) -> u8 {
        (self.b()[1] >> 4) & 3
    }
    /// Transport header version.
    pub fn tver(&self) -> u8 {
        self.b()[1] & 0xF
    }
    /// Partition key.
    pub fn pkey(&self) -> u16 {
        be16(self.b(), 2)
    }
    /// FECN bit.
    pub fn fecn(&self) -> bool {
        self.b()[4] & 0x80 != 0
    }
    /// BECN bit.
    pub fn becn(&self) -> bool {
        self.b()[4] & 0x40 != 0
    }
    /// Destination QP (24 bits).
    pub fn dest_qp(&self) -> u32 {
        be32(self.b(), 4) & 0xFF_FFFF
    }
    /// AckReq bit.
    pub fn ack_req(&self) -> bool {
        self.b()[8] & 0x80 != 0
    }
    /// PSN (24 bits).
    pub fn psn(&self) -> u32 {
        be32(self.b(), 8) & 0xFF_FFFF
    }
    /// The whole header as a repr.
    pub fn to_repr(&self) -> Bth {
        Bth {
            opcode: self.opcode(),
            solicited: self.solicited(),
            mig_req: self.mig_req(),
            pad: self.pad(),
            tver: self.tver(),
            pkey: self.pkey(),
            fecn: self.fecn(),
            becn: self.becn(),
            dest_qp: self.dest_qp(),
            ack_req: self.ack_req(),
            psn: self.psn(),
        }
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> BthView<T> {
    fn m(&mut self) -> &mut [u8] {
        self.buf.as_mut()
    }
    fn set_bit(&mut self, byte: usize, mask: u8, v: bool) {
        let b = &mut self.m()[byte];
        *b = if v { *b | mask } else { *b & !mask };
    }
    /// Set the opcode.
    pub fn set_opcode(&mut self, op: Opcode) {
        self.m()[0] = op.0;
    }
    /// Set the solicited event bit.
    pub fn set_solicited(&mut self, v: bool) {
        self.set_bit(1, 0x80, v)
    }
    /// Set the migration request bit.
    pub fn set_mig_req(&mut self, v: bool) {
        self.set_bit(1, 0x40, v)
    }
    /// Set the pad count (masked to 2 bits).
    pub fn set_pad(&mut self, pad: u8) {
        let b = &mut self.m()[1];
        *b = (*b & !0x30) | ((pad & 3) << 4);
    }
    /// Set the transport header version (masked to 4 bits).
    pub fn set_tver(&mut self, v: u8) {
        let b = &mut self.m()[1];
        *b = (*b & !0x0F) | (v & 0xF);
    }
    /// Set the partition key.
    pub fn set_pkey(&mut self, pkey: u16) {
        put16(self.m(), 2, pkey)
    }
    /// Set the FECN bit.
    pub fn set_fecn(&mut self, v: bool) {
        self.set_bit(4, 0x80, v)
    }
    /// Set the BECN bit.
    pub fn set_becn(&mut self, v: bool) {
        self.set_bit(4, 0x40, v)
    }
    /// Set the destination QP (masked to 24 bits; FECN/BECN/reserved kept).
    pub fn set_dest_qp(&mut self, qpn: u32) {
        let hi = u32::from(self.m()[4]) << 24;
        put32(self.m(), 4, hi | (qpn & 0xFF_FFFF))
    }
    /// Set the AckReq bit.
    pub fn set_ack_req(&mut self, v: bool) {
        self.set_bit(8, 0x80, v)
    }
    /// Set the PSN (masked to 24 bits; AckReq/reserved kept).
    pub fn set_psn(&mut self, psn: u32) {
        let hi = u32::from(self.m()[8]) << 24;
        put32(self.m(), 8, hi | (psn & 0xFF_FFFF))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn view_reads_and_writes() {
        assert_eq!(BthView::new_checked(&[0u8; 11][..]), Err(Error::Truncated));
        let mut buf = [0u8; 12];
        let mut v = BthView::new_checked(&mut buf[..]).unwrap();
        v.set_opcode(Opcode::RC_SEND_ONLY);
        v.set_solicited(true);
        v.set_pad(3);
        v.set_pkey(0xFFFF);
        v.set_becn(true);
        v.set_dest_qp(0x12_3456);
        v.set_ack_req(true);
        v.set_psn(0xAB_CDEF);
        v.set_tver(0);
        assert!(v.solicited() && !v.mig_req() && v.becn() && !v.fecn() && v.ack_req());
        assert_eq!(v.pad(), 3);
        assert_eq!(v.dest_qp(), 0x12_3456);
        assert_eq!(v.psn(), 0xAB_CDEF);
        let r = v.to_repr();
        assert_eq!(r.pad, 3);
        assert_eq!(
            buf,
            [0x04, 0xB0, 0xFF, 0xFF, 0x40, 0x12, 0x34, 0x56, 0x80, 0xAB, 0xCD, 0xEF]
        );
        let mut again = [0u8; 12];
        r.emit(&mut again).unwrap();
        assert_eq!(again, buf);
        let mut v = BthView::new_checked(&mut buf[..]).unwrap();
        v.set_solicited(false);
        v.set_psn(1);
        assert_eq!(v.into_inner()[1], 0x30);
    }
}
