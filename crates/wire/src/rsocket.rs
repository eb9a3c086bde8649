//! rsockets' wire formats (rdma-core's `librdmacm/rsocket.c`, protocol version 1): the
//! 40-byte connection data in the CM's private data, the `op << 29 | data` immediates,
//! and the 16-byte buffer offers and 24-byte iomap entries one side writes into the
//! other's memory.
//!
//! The connection data is big-endian. Offers and iomap entries are in the *reader's*
//! byte order: the writer swaps them when the reader's connection data said it is
//! big-endian and the writer is not (or the other way round), so [`Order`] names the
//! reader's order.

use thiserror::Error;

/// The length of the connection data (`struct rs_conn_data`).
pub const CONN_DATA_LEN: usize = 40;
/// The protocol version this module speaks.
pub const VERSION: u8 = 1;
/// The length of a buffer offer (`struct rs_sge`).
pub const SGE_LEN: usize = 16;
/// The length of an iomap entry (`struct rs_iomap`).
pub const IOMAP_LEN: usize = 24;
/// The largest length a data or write immediate carries (29 bits).
pub const MAX_MSG_DATA: u32 = 0x1FFF_FFFF;

/// What can be wrong with rsockets' bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum Error {
    /// Fewer bytes than the format needs.
    #[error("rsockets: {0} bytes where {1} are needed")]
    Short(usize, usize),
    /// A connection data version other than [`VERSION`].
    #[error("rsockets: connection data version {0}, not 1")]
    Version(u8),
    /// Connection data that offers no target SGL entries, where the peer's offers go.
    #[error("rsockets: the connection data offers no target SGL")]
    NoTargetSgl,
}

/// A byte order of offers and iomap entries (the reader's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// Little-endian (x86, most ARM).
    Little,
    /// Big-endian; a connection data with [`ConnData::net_order`] set.
    Big,
}

impl Order {
    /// This machine's order.
    pub const NATIVE: Order = if cfg!(target_endian = "big") {
        Order::Big
    } else {
        Order::Little
    };

    fn u64(self, v: u64) -> [u8; 8] {
        match self {
            Order::Little => v.to_le_bytes(),
            Order::Big => v.to_be_bytes(),
        }
    }
    fn u32(self, v: u32) -> [u8; 4] {
        match self {
            Order::Little => v.to_le_bytes(),
            Order::Big => v.to_be_bytes(),
        }
    }
    fn get64(self, b: &[u8]) -> u64 {
        let a: [u8; 8] = b[..8].try_into().unwrap_or([0; 8]);
        match self {
            Order::Little => u64::from_le_bytes(a),
            Order::Big => u64::from_be_bytes(a),
        }
    }
    fn get32(self, b: &[u8]) -> u32 {
        let a: [u8; 4] = b[..4].try_into().unwrap_or([0; 4]);
        match self {
            Order::Little => u32::from_le_bytes(a),
            Order::Big => u32::from_be_bytes(a),
        }
    }
}

/// Where a peer may write (`struct rs_sge`): an address, its rkey and a length (in the
/// connection data's target SGL: a number of entries).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sge {
    /// The address the peer writes at.
    pub addr: u64,
    /// Its remote key.
    pub key: u32,
    /// Bytes (entries for a target SGL).
    pub length: u32,
}

impl Sge {
    /// The 16 bytes of the offer in `order`.
    pub fn emit(&self, order: Order) -> [u8; SGE_LEN] {
        let mut b = [0u8; SGE_LEN];
        b[0..8].copy_from_slice(&order.u64(self.addr));
        b[8..12].copy_from_slice(&order.u32(self.key));
        b[12..16].copy_from_slice(&order.u32(self.length));
        b
    }

    /// An offer read from `b` in `order`.
    pub fn parse(b: &[u8], order: Order) -> Result<Sge, Error> {
        if b.len() < SGE_LEN {
            return Err(Error::Short(b.len(), SGE_LEN));
        }
        Ok(Sge {
            addr: order.get64(&b[0..8]),
            key: order.get32(&b[8..12]),
            length: order.get32(&b[12..16]),
        })
    }

    fn emit_be(&self, b: &mut [u8]) {
        b.copy_from_slice(&self.emit(Order::Big));
    }
}

/// A region offered for direct writes (`riomap`; `struct rs_iomap`): the offset the
/// writer names and where it lies.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IomapEntry {
    /// The offset a `riowrite` names.
    pub offset: u64,
    /// The region.
    pub sge: Sge,
}

impl IomapEntry {
    /// The 24 bytes of the entry in `order`.
    pub fn emit(&self, order: Order) -> [u8; IOMAP_LEN] {
        let mut b = [0u8; IOMAP_LEN];
        b[0..8].copy_from_slice(&order.u64(self.offset));
        b[8..24].copy_from_slice(&self.sge.emit(order));
        b
    }

    /// An entry read from `b` in `order`.
    pub fn parse(b: &[u8], order: Order) -> Result<IomapEntry, Error> {
        if b.len() < IOMAP_LEN {
            return Err(Error::Short(b.len(), IOMAP_LEN));
        }
        Ok(IomapEntry {
            offset: order.get64(&b[0..8]),
            sge: Sge::parse(&b[8..], order)?,
        })
    }
}

/// `value` in `bits` bits: exact up to 2^(bits-1), above that in units of 2^bits with
/// the top bit set (how the connection data carries the iomap size in one byte).
pub fn value_to_scale(value: u32, bits: u32) -> u32 {
    let half = 1 << (bits - 1);
    if value <= half {
        value
    } else {
        half | (value >> bits)
    }
}

/// The value [`value_to_scale`] encoded.
pub fn scale_to_value(value: u32, bits: u32) -> u32 {
    let half = 1 << (bits - 1);
    if value <= half {
        value
    } else {
        (value & !half) << bits
    }
}

/// The connection data each side puts first in its CM private data
/// (`struct rs_conn_data`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConnData {
    /// The sender's offers and iomap entries are to be written big-endian.
    pub net_order: bool,
    /// The sender has an iomap table after its target SGL.
    pub iomap: bool,
    /// Receive credits: the messages the sender can take before it grants more.
    pub credits: u16,
    /// Entries of the sender's iomap table.
    pub iomap_size: u32,
    /// Where the peer writes its buffer offers (length: the number of entries).
    pub target_sgl: Sge,
    /// The first half of the sender's receive buffer, offered for data.
    pub data_buf: Sge,
}

impl ConnData {
    /// The byte order the sender reads its offers and iomap entries in.
    pub fn order(&self) -> Order {
        if self.net_order {
            Order::Big
        } else {
            Order::Little
        }
    }

    /// The 40 bytes.
    pub fn emit(&self) -> [u8; CONN_DATA_LEN] {
        let mut d = [0u8; CONN_DATA_LEN];
        d[0] = VERSION;
        d[1] = u8::from(self.net_order) | u8::from(self.iomap) << 1;
        d[2..4].copy_from_slice(&self.credits.to_be_bytes());
        d[7] = value_to_scale(self.iomap_size.min(0xFFFF), 8) as u8;
        self.target_sgl.emit_be(&mut d[8..24]);
        self.data_buf.emit_be(&mut d[24..40]);
        d
    }

    /// Connection data read from private data (which may carry more after it).
    pub fn parse(d: &[u8]) -> Result<ConnData, Error> {
        if d.len() < CONN_DATA_LEN {
            return Err(Error::Short(d.len(), CONN_DATA_LEN));
        }
        if d[0] != VERSION {
            return Err(Error::Version(d[0]));
        }
        let target_sgl = Sge::parse(&d[8..24], Order::Big)?;
        if target_sgl.length == 0 {
            return Err(Error::NoTargetSgl);
        }
        Ok(ConnData {
            net_order: d[1] & 1 != 0,
            iomap: d[1] & 2 != 0,
            credits: u16::from_be_bytes([d[2], d[3]]),
            iomap_size: scale_to_value(u32::from(d[7]), 8),
            target_sgl,
            data_buf: Sge::parse(&d[24..40], Order::Big)?,
        })
    }
}

/// The control messages ([`Msg::Ctrl`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ctrl {
    /// The sender closes the connection.
    Disconnect,
    /// A keepalive (sent as a zero-length RDMA WRITE; never as an immediate).
    Keepalive,
    /// The sender sends no more data.
    Shutdown,
    /// A code this side does not know (ignored).
    Other(u32),
}

impl Ctrl {
    fn code(self) -> u32 {
        match self {
            Ctrl::Disconnect => 0,
            Ctrl::Keepalive => 1,
            Ctrl::Shutdown => 2,
            Ctrl::Other(c) => c,
        }
    }
}

/// An rsockets message: what the top three bits of an immediate (or of a work
/// request's id, for messages without one) say, and the 29 bits below.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Msg {
    /// Data (op 0): this many bytes were written into the current offer.
    Data(u32),
    /// A direct write (op 2, `riowrite`): this many bytes; it has no immediate.
    Write(u32),
    /// Credits (op 4): the sender may have messages up to this sequence number; when
    /// the WRITE carried 16 bytes, they are a new offer.
    Sgl(u16),
    /// An iomap entry was written at this index (op 6).
    IomapSgl(u32),
    /// A control message (op 7).
    Ctrl(Ctrl),
    /// Ops 1, 3 and 5, reserved: (op, data).
    Reserved(u8, u32),
}

impl Msg {
    /// The 32-bit immediate (or work request id) of the message.
    pub fn to_imm(self) -> u32 {
        let (op, data) = match self {
            Msg::Data(n) => (0, n),
            Msg::Write(n) => (2, n),
            Msg::Sgl(s) => (4, u32::from(s)),
            Msg::IomapSgl(i) => (6, i),
            Msg::Ctrl(c) => (7, c.code()),
            Msg::Reserved(op, d) => (u32::from(op & 7), d),
        };
        (op << 29) | (data & MAX_MSG_DATA)
    }

    /// The message an immediate (or work request id) carries.
    pub fn from_imm(m: u32) -> Msg {
        let data = m & MAX_MSG_DATA;
        match m >> 29 {
            0 => Msg::Data(data),
            2 => Msg::Write(data),
            4 => Msg::Sgl(data as u16),
            6 => Msg::IomapSgl(data),
            7 => Msg::Ctrl(match data {
                0 => Ctrl::Disconnect,
                1 => Ctrl::Keepalive,
                2 => Ctrl::Shutdown,
                c => Ctrl::Other(c),
            }),
            op => Msg::Reserved(op as u8, data),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conn_data_bytes_as_rdma_core_lays_them_out() {
        let c = ConnData {
            net_order: false,
            iomap: true,
            credits: 384,
            iomap_size: 0,
            target_sgl: Sge {
                addr: 0x1122_3344_5566_7788,
                key: 0xAABB_CCDD,
                length: 2,
            },
            data_buf: Sge {
                addr: 0x0102_0304_0506_0708,
                key: 0x0A0B_0C0D,
                length: 65536,
            },
        };
        let d = c.emit();
        assert_eq!(&d[..8], &[1, 2, 0x01, 0x80, 0, 0, 0, 0]);
        assert_eq!(&d[8..16], &0x1122_3344_5566_7788u64.to_be_bytes());
        assert_eq!(&d[16..24], &[0xAA, 0xBB, 0xCC, 0xDD, 0, 0, 0, 2]);
        assert_eq!(&d[24..32], &0x0102_0304_0506_0708u64.to_be_bytes());
        assert_eq!(&d[32..40], &[0x0A, 0x0B, 0x0C, 0x0D, 0, 1, 0, 0]);
        assert_eq!(ConnData::parse(&d), Ok(c));
        // Private data goes on after it; it is not the connection data's.
        let mut more = d.to_vec();
        more.extend_from_slice(&[9; 16]);
        assert_eq!(ConnData::parse(&more), Ok(c));
    }

    #[test]
    fn bad_conn_data_is_an_error() {
        let good = ConnData {
            target_sgl: Sge {
                length: 2,
                ..Sge::default()
            },
            ..ConnData::default()
        }
        .emit();
        assert_eq!(ConnData::parse(&good[..39]), Err(Error::Short(39, 40)));
        let mut v2 = good;
        v2[0] = 2;
        assert_eq!(ConnData::parse(&v2), Err(Error::Version(2)));
        let mut none = good;
        none[20..24].fill(0);
        assert_eq!(ConnData::parse(&none), Err(Error::NoTargetSgl));
        assert!(ConnData::parse(&[]).is_err());
    }

    #[test]
    fn iomap_size_scales_into_one_byte() {
        for v in 0..=128 {
            assert_eq!(scale_to_value(value_to_scale(v, 8), 8), v);
        }
        assert_eq!(value_to_scale(1024, 8), 0x84);
        assert_eq!(scale_to_value(0x84, 8), 1024);
        let c = ConnData {
            iomap_size: 1024,
            target_sgl: Sge {
                length: 2,
                ..Sge::default()
            },
            ..ConnData::default()
        };
        assert_eq!(c.emit()[7], 0x84);
        assert_eq!(ConnData::parse(&c.emit()).map(|c| c.iomap_size), Ok(1024));
    }

    #[test]
    fn offers_are_in_the_readers_order() {
        let s = Sge {
            addr: 0x1000,
            key: 0x42,
            length: 0x10000,
        };
        let le = s.emit(Order::Little);
        assert_eq!(
            &le[..],
            &[0, 0x10, 0, 0, 0, 0, 0, 0, 0x42, 0, 0, 0, 0, 0, 1, 0]
        );
        let be = s.emit(Order::Big);
        assert_eq!(&be[8..12], &[0, 0, 0, 0x42]);
        assert_eq!(Sge::parse(&le, Order::Little), Ok(s));
        assert_eq!(Sge::parse(&be, Order::Big), Ok(s));
        assert_ne!(Sge::parse(&be, Order::Little), Ok(s));
        assert_eq!(
            Sge::parse(&le[..15], Order::Little),
            Err(Error::Short(15, 16))
        );
        let e = IomapEntry { offset: 7, sge: s };
        assert_eq!(IomapEntry::parse(&e.emit(Order::Big), Order::Big), Ok(e));
        assert_eq!(&e.emit(Order::Little)[..8], &[7, 0, 0, 0, 0, 0, 0, 0]);
        assert!(IomapEntry::parse(&[0; 23], Order::Big).is_err());
    }

    #[test]
    fn immediates_pack_op_and_data() {
        assert_eq!(Msg::Sgl(0x1234).to_imm(), 0x8000_1234);
        assert_eq!(Msg::Ctrl(Ctrl::Shutdown).to_imm(), 0xE000_0002);
        assert_eq!(Msg::Data(65536).to_imm(), 65536);
        assert_eq!(Msg::Write(5).to_imm(), 0x4000_0005);
        assert_eq!(Msg::IomapSgl(3).to_imm(), 0xC000_0003);
        for m in [
            Msg::Data(0),
            Msg::Data(MAX_MSG_DATA),
            Msg::Write(1),
            Msg::Sgl(u16::MAX),
            Msg::IomapSgl(9),
            Msg::Ctrl(Ctrl::Disconnect),
            Msg::Ctrl(Ctrl::Keepalive),
            Msg::Ctrl(Ctrl::Other(77)),
            Msg::Reserved(1, 5),
            Msg::Reserved(3, 0),
            Msg::Reserved(5, 1),
        ] {
            assert_eq!(Msg::from_imm(m.to_imm()), m, "{m:?}");
        }
    }
}
