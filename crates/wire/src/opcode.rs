//! The BTH opcode and the table of what each implemented opcode carries.

use crate::{
    AETH_LEN, ATOMIC_ACK_ETH_LEN, ATOMIC_ETH_LEN, BTH_LEN, DETH_LEN, IETH_LEN, IMMDT_LEN, RETH_LEN,
};
use core::fmt;

/// The BTH opcode byte: bits 7..5 the transport service, bits 4..0 the operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Opcode(pub u8);

/// Transport service of an opcode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ServiceType {
    /// Reliable Connected.
    Rc,
    /// Unreliable Connected.
    Uc,
    /// Unreliable Datagram.
    Ud,
}

/// Position of a packet within its message. Single-packet operations and
/// acknowledgements are [`Position::Only`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Position {
    /// First packet of a multi-packet message.
    First,
    /// Neither first nor last.
    Middle,
    /// Last packet of a multi-packet message.
    Last,
    /// The whole message in one packet.
    Only,
}

/// What an opcode does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// SEND (possibly with immediate or invalidate).
    Send,
    /// RDMA WRITE (possibly with immediate).
    Write,
    /// RDMA READ request.
    ReadRequest,
    /// RDMA READ response.
    ReadResponse,
    /// Compare-and-swap or fetch-and-add request.
    Atomic,
    /// ACK / NAK.
    Acknowledge,
    /// Atomic ACK (carries the original remote data).
    AtomicAcknowledge,
}

/// Everything the wire needs to know about one opcode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpcodeInfo {
    /// The opcode this entry describes.
    pub opcode: Opcode,
    /// Name as in the IBTA spec / rxe, e.g. `"RC_SEND_ONLY"`.
    pub name: &'static str,
    /// Transport service.
    pub service: ServiceType,
    /// Operation kind.
    pub kind: OpKind,
    /// Position in the message.
    pub position: Position,
    /// Carries a RETH.
    pub has_reth: bool,
    /// Carries an AETH.
    pub has_aeth: bool,
    /// Carries an AtomicETH.
    pub has_atomic_eth: bool,
    /// Carries an AtomicAckETH.
    pub has_atomic_ack_eth: bool,
    /// Carries immediate data.
    pub has_immdt: bool,
    /// Carries an IETH (the rkey to invalidate).
    pub has_ieth: bool,
    /// Carries a DETH.
    pub has_deth: bool,
    /// May carry payload (possibly zero bytes).
    pub has_payload: bool,
    /// Sent by the requester to the responder (false: responses and acknowledgements).
    pub is_request: bool,
    /// BTH plus all extension headers, in bytes.
    pub header_len: usize,
}

const RETH: u8 = 1;
const AETH: u8 = 2;
const ATMETH: u8 = 4;
const ATMACK: u8 = 8;
const IMM: u8 = 16;
const IETH: u8 = 32;
const DETH: u8 = 64;
const PAY: u8 = 128;

const fn mk(
    op: u8,
    name: &'static str,
    service: ServiceType,
    kind: OpKind,
    position: Position,
    flags: u8,
) -> OpcodeInfo {
    let mut len = BTH_LEN;
    if flags & RETH != 0 {
        len += RETH_LEN;
    }
    if flags & AETH != 0 {
        len += AETH_LEN;
    }
    if flags & ATMETH != 0 {
        len += ATOMIC_ETH_LEN;
    }
    if flags & ATMACK != 0 {
        len += ATOMIC_ACK_ETH_LEN;
    }
    if flags & IMM != 0 {
        len += IMMDT_LEN;
    }
    if flags & IETH != 0 {
        len += IETH_LEN;
    }
    if flags & DETH != 0 {
        len += DETH_LEN;
    }
    let is_request = !matches!(
        kind,
        OpKind::ReadResponse | OpKind::Acknowledge | OpKind::AtomicAcknowledge
    );
    OpcodeInfo {
        opcode: Opcode(op),
        name,
        service,
        kind,
        position,
        has_reth: flags & RETH != 0,
        has_aeth: flags & AETH != 0,
        has_atomic_eth: flags & ATMETH != 0,
        has_atomic_ack_eth: flags & ATMACK != 0,
        has_immdt: flags & IMM != 0,
        has_ieth: flags & IETH != 0,
        has_deth: flags & DETH != 0,
        has_payload: flags & PAY != 0,
        is_request,
        header_len: len,
    }
}

use OpKind::*;
use Position::*;
use ServiceType::*;

/// Every implemented opcode, in opcode order.
static TABLE: [OpcodeInfo; 37] = [
    mk(0x00, "RC_SEND_FIRST", Rc, Send, First, PAY),
    mk(0x01, "RC_SEND_MIDDLE", Rc, Send, Middle, PAY),
    mk(0x02, "RC_SEND_LAST", Rc, Send, Last, PAY),
    mk(0x03, "RC_SEND_LAST_IMM", Rc, Send, Last, PAY | IMM),
    mk(0x04, "RC_SEND_ONLY", Rc, Send, Only, PAY),
    mk(0x05, "RC_SEND_ONLY_IMM", Rc, Send, Only, PAY | IMM),
    mk(0x06, "RC_RDMA_WRITE_FIRST", Rc, Write, First, PAY | RETH),
    mk(0x07, "RC_RDMA_WRITE_MIDDLE", Rc, Write, Middle, PAY),
    mk(0x08, "RC_RDMA_WRITE_LAST", Rc, Write, Last, PAY),
    mk(0x09, "RC_RDMA_WRITE_LAST_IMM", Rc, Write, Last, PAY | IMM),
    mk(0x0A, "RC_RDMA_WRITE_ONLY", Rc, Write, Only, PAY | RETH),
    mk(
        0x0B,
        "RC_RDMA_WRITE_ONLY_IMM",
        Rc,
        Write,
        Only,
        PAY | RETH | IMM,
    ),
    mk(0x0C, "RC_RDMA_READ_REQUEST", Rc, ReadRequest, Only, RETH),
    mk(
        0x0D,
        "RC_RDMA_READ_RESPONSE_FIRST",
        Rc,
        ReadResponse,
        First,
        PAY | AETH,
    ),
    mk(
        0x0E,
        "RC_RDMA_READ_RESPONSE_MIDDLE",
        Rc,
        ReadResponse,
        Middle,
        PAY,
    ),
    mk(
        0x0F,
        "RC_RDMA_READ_RESPONSE_LAST",
        Rc,
        ReadResponse,
        Last,
        PAY | AETH,
    ),
    mk(
        0x10,
        "RC_RDMA_READ_RESPONSE_ONLY",
        Rc,
        ReadResponse,
        Only,
        PAY | AETH,
    ),
    mk(0x11, "RC_ACKNOWLEDGE", Rc, Acknowledge, Only, AETH),
    mk(
        0x12,
        "RC_ATOMIC_ACKNOWLEDGE",
        Rc,
        AtomicAcknowledge,
        Only,
        AETH | ATMACK,
    ),
    mk(0x13, "RC_COMPARE_SWAP", Rc, Atomic, Only, ATMETH),
    mk(0x14, "RC_FETCH_ADD", Rc, Atomic, Only, ATMETH),
    mk(0x16, "RC_SEND_LAST_INV", Rc, Send, Last, PAY | IETH),
    mk(0x17, "RC_SEND_ONLY_INV", Rc, Send, Only, PAY | IETH),
    mk(0x20, "UC_SEND_FIRST", Uc, Send, First, PAY),
    mk(0x21, "UC_SEND_MIDDLE", Uc, Send, Middle, PAY),
    mk(0x22, "UC_SEND_LAST", Uc, Send, Last, PAY),
    mk(0x23, "UC_SEND_LAST_IMM", Uc, Send, Last, PAY | IMM),
    mk(0x24, "UC_SEND_ONLY", Uc, Send, Only, PAY),
    mk(0x25, "UC_SEND_ONLY_IMM", Uc, Send, Only, PAY | IMM),
    mk(0x26, "UC_RDMA_WRITE_FIRST", Uc, Write, First, PAY | RETH),
    mk(0x27, "UC_RDMA_WRITE_MIDDLE", Uc, Write, Middle, PAY),
    mk(0x28, "UC_RDMA_WRITE_LAST", Uc, Write, Last, PAY),
    mk(0x29, "UC_RDMA_WRITE_LAST_IMM", Uc, Write, Last, PAY | IMM),
    mk(0x2A, "UC_RDMA_WRITE_ONLY", Uc, Write, Only, PAY | RETH),
    mk(
        0x2B,
        "UC_RDMA_WRITE_ONLY_IMM",
        Uc,
        Write,
        Only,
        PAY | RETH | IMM,
    ),
    mk(0x64, "UD_SEND_ONLY", Ud, Send, Only, PAY | DETH),
    mk(0x65, "UD_SEND_ONLY_IMM", Ud, Send, Only, PAY | DETH | IMM),
];

#[allow(missing_docs)]
impl Opcode {
    pub const RC_SEND_FIRST: Opcode = Opcode(0x00);
    pub const RC_SEND_MIDDLE: Opcode = Opcode(0x01);
    pub const RC_SEND_LAST: Opcode = Opcode(0x02);
    pub const RC_SEND_LAST_IMM: Opcode = Opcode(0x03);
    pub const RC_SEND_ONLY: Opcode = Opcode(0x04);
    pub const RC_SEND_ONLY_IMM: Opcode = Opcode(0x05);
    pub const RC_RDMA_WRITE_FIRST: Opcode = Opcode(0x06);
    pub const RC_RDMA_WRITE_MIDDLE: Opcode = Opcode(0x07);
    pub const RC_RDMA_WRITE_LAST: Opcode = Opcode(0x08);
    pub const RC_RDMA_WRITE_LAST_IMM: Opcode = Opcode(0x09);
    pub const RC_RDMA_WRITE_ONLY: Opcode = Opcode(0x0A);
    pub const RC_RDMA_WRITE_ONLY_IMM: Opcode = Opcode(0x0B);
    pub const RC_RDMA_READ_REQUEST: Opcode = Opcode(0x0C);
    pub const RC_RDMA_READ_RESPONSE_FIRST: Opcode = Opcode(0x0D);
    pub const RC_RDMA_READ_RESPONSE_MIDDLE: Opcode = Opcode(0x0E);
    pub const RC_RDMA_READ_RESPONSE_LAST: Opcode = Opcode(0x0F);
    pub const RC_RDMA_READ_RESPONSE_ONLY: Opcode = Opcode(0x10);
    pub const RC_ACKNOWLEDGE: Opcode = Opcode(0x11);
    pub const RC_ATOMIC_ACKNOWLEDGE: Opcode = Opcode(0x12);
    pub const RC_COMPARE_SWAP: Opcode = Opcode(0x13);
    pub const RC_FETCH_ADD: Opcode = Opcode(0x14);
    pub const RC_SEND_LAST_INV: Opcode = Opcode(0x16);
    pub const RC_SEND_ONLY_INV: Opcode = Opcode(0x17);
    pub const UC_SEND_FIRST: Opcode = Opcode(0x20);
    pub const UC_SEND_MIDDLE: Opcode = Opcode(0x21);
    pub const UC_SEND_LAST: Opcode = Opcode(0x22);
    pub const UC_SEND_LAST_IMM: Opcode = Opcode(0x23);
    pub const UC_SEND_ONLY: Opcode = Opcode(0x24);
    pub const UC_SEND_ONLY_IMM: Opcode = Opcode(0x25);
    pub const UC_RDMA_WRITE_FIRST: Opcode = Opcode(0x26);
    pub const UC_RDMA_WRITE_MIDDLE: Opcode = Opcode(0x27);
    pub const UC_RDMA_WRITE_LAST: Opcode = Opcode(0x28);
    pub const UC_RDMA_WRITE_LAST_IMM: Opcode = Opcode(0x29);
    pub const UC_RDMA_WRITE_ONLY: Opcode = Opcode(0x2A);
    pub const UC_RDMA_WRITE_ONLY_IMM: Opcode = Opcode(0x2B);
    pub const UD_SEND_ONLY: Opcode = Opcode(0x64);
    pub const UD_SEND_ONLY_IMM: Opcode = Opcode(0x65);
}

impl Opcode {
    /// The table entry of an implemented opcode; `None` for opcodes softrdma does
    /// not implement (RD, XRC, CNP, FLUSH, ATOMIC_WRITE, reserved values).
    pub fn info(self) -> Option<&'static OpcodeInfo> {
        let idx = match self.0 {
            0x00..=0x14 => self.0 as usize,
            0x16 | 0x17 => self.0 as usize - 1,
            0x20..=0x2B => self.0 as usize - 0x20 + 23,
            0x64 | 0x65 => self.0 as usize - 0x64 + 35,
            _ => return None,
        };
        TABLE.get(idx)
    }

    /// All implemented opcodes, in opcode order.
    pub fn all() -> impl Iterator<Item = &'static OpcodeInfo> {
        TABLE.iter()
    }

    /// The name (e.g. `"RC_SEND_ONLY"`), or `None` if not implemented.
    pub fn name(self) -> Option<&'static str> {
        self.info().map(|i| i.name)
    }
}

impl fmt::Display for Opcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) => f.write_str(n),
            None => write!(f, "OPCODE_{:#04x}", self.0),
        }
    }
}

impl From<u8> for Opcode {
    fn from(v: u8) -> Self {
        Opcode(v)
    }
}

impl From<Opcode> for u8 {
    fn from(o: Opcode) -> Self {
        o.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_indexed_by_opcode() {
        let mut n = 0;
        for v in 0..=255u8 {
            if let Some(i) = Opcode(v).info() {
                assert_eq!(i.opcode, Opcode(v), "{}", i.name);
                n += 1;
            }
        }
        assert_eq!(n, TABLE.len());
        assert_eq!(Opcode::all().count(), 37);
    }

    #[test]
    fn unimplemented_opcodes() {
        for v in [
            0x15u8, 0x18, 0x19, 0x1F, 0x2C, 0x40, 0x4C, 0x60, 0x63, 0x66, 0x81, 0xA0, 0xFF,
        ] {
            assert!(Opcode(v).info().is_none(), "{v:#x}");
        }
    }

    #[test]
    fn service_bits_match_table() {
        for i in Opcode::all() {
            let svc = match i.opcode.0 >> 5 {
                0 => Rc,
                1 => Uc,
                3 => Ud,
                _ => unreachable!(),
            };
            assert_eq!(i.service, svc, "{}", i.name);
            assert!(i.name.starts_with(match svc {
                Rc => "RC_",
                Uc => "UC_",
                Ud => "UD_",
            }));
        }
    }

    #[test]
    fn selected_header_lengths() {
        // from rxe_opcode.c lengths
        let len = |o: Opcode| o.info().unwrap().header_len;
        assert_eq!(len(Opcode::RC_SEND_FIRST), 12);
        assert_eq!(len(Opcode::RC_RDMA_WRITE_ONLY_IMM), 12 + 16 + 4);
        assert_eq!(len(Opcode::RC_RDMA_READ_REQUEST), 28);
        assert_eq!(len(Opcode::RC_ATOMIC_ACKNOWLEDGE), 12 + 4 + 8);
        assert_eq!(len(Opcode::RC_COMPARE_SWAP), 40);
        assert_eq!(len(Opcode::RC_SEND_ONLY_INV), 16);
        assert_eq!(len(Opcode::UD_SEND_ONLY_IMM), 12 + 8 + 4);
        assert!(
            !Opcode::RC_RDMA_READ_RESPONSE_MIDDLE
                .info()
                .unwrap()
                .has_aeth
        );
        assert!(
            !Opcode::RC_RDMA_READ_RESPONSE_ONLY
                .info()
                .unwrap()
                .is_request
        );
        assert!(Opcode::RC_FETCH_ADD.info().unwrap().is_request);
        assert!(!Opcode::RC_FETCH_ADD.info().unwrap().has_payload);
        assert_eq!(Opcode::RC_SEND_LAST_INV.to_string(), "RC_SEND_LAST_INV");
        assert_eq!(Opcode(0x81).to_string(), "OPCODE_0x81");
    }
}
