//! A pcapng writer (one section, one interface of LINKTYPE_RAW with nanosecond
//! timestamps), for traces that say more about a packet than its bytes: which way it went
//! and, in a comment, what carried it (Wireshark shows both, `frame.comment` and
//! `frame.p2p_dir`/`pkt_dir` filter on them). Block and option layouts are those of the
//! pcapng specification (draft-ietf-opsawg-pcapng).

use std::io::{self, Write};

use crate::pcap::{LINKTYPE_RAW, SNAPLEN};

const SHB: u32 = 0x0A0D_0D0A;
const IDB: u32 = 0x0000_0001;
const EPB: u32 = 0x0000_0006;
const BYTE_ORDER_MAGIC: u32 = 0x1A2B_3C4D;
const OPT_END: u16 = 0;
const OPT_COMMENT: u16 = 1;
const SHB_USERAPPL: u16 = 4;
const IF_NAME: u16 = 2;
const IF_TSRESOL: u16 = 9;
const EPB_FLAGS: u16 = 2;

/// Which way a packet went, as an enhanced packet block's flags say it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Received.
    Inbound,
    /// Sent.
    Outbound,
}

/// Writes a pcapng stream into any [`Write`]: the section and interface header first,
/// then one enhanced packet block per packet.
#[derive(Debug)]
pub struct PcapngWriter<W: Write> {
    w: W,
    /// Scratch for one block, so that each goes out in one write.
    block: Vec<u8>,
}

impl<W: Write> PcapngWriter<W> {
    /// Write the section header (naming `app` as the writer) and the one interface's
    /// description (named `interface`), and return the writer.
    pub fn new(w: W, app: &str, interface: &str) -> io::Result<Self> {
        let mut p = PcapngWriter {
            w,
            block: Vec::with_capacity(256),
        };
        p.begin(SHB);
        p.u32(BYTE_ORDER_MAGIC);
        p.u16(1); // major version
        p.u16(0); // minor version
        p.block.extend_from_slice(&(-1i64).to_le_bytes()); // section length: not given
        p.option(SHB_USERAPPL, app.as_bytes());
        p.option(OPT_END, &[]);
        p.end()?;
        p.begin(IDB);
        p.u16(LINKTYPE_RAW as u16);
        p.u16(0);
        p.u32(SNAPLEN);
        p.option(IF_NAME, interface.as_bytes());
        p.option(IF_TSRESOL, &[9]); // 10^-9 s
        p.option(OPT_END, &[]);
        p.end()?;
        Ok(p)
    }

    /// Append one packet (an IP frame) with a timestamp in nanoseconds since the epoch,
    /// its direction if known, and a comment if any. Frames longer than [`SNAPLEN`] are
    /// truncated in the capture (the original length is kept).
    pub fn write_packet(
        &mut self,
        ts_ns: u64,
        frame: &[u8],
        dir: Option<Direction>,
        comment: Option<&str>,
    ) -> io::Result<()> {
        let orig = u32::try_from(frame.len())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame too long for pcap"))?;
        let incl = orig.min(SNAPLEN);
        let comment = comment.map(str::as_bytes).filter(|c| !c.is_empty());
        if comment.is_some_and(|c| c.len() > usize::from(u16::MAX) - 3) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "packet comment longer than a pcapng option holds",
            ));
        }
        self.begin(EPB);
        self.u32(0); // interface 0
        self.u32((ts_ns >> 32) as u32);
        self.u32(ts_ns as u32);
        self.u32(incl);
        self.u32(orig);
        self.block.extend_from_slice(&frame[..incl as usize]);
        self.pad();
        if let Some(c) = comment {
            self.option(OPT_COMMENT, c);
        }
        if let Some(d) = dir {
            let bits: u32 = match d {
                Direction::Inbound => 1,
                Direction::Outbound => 2,
            };
            self.option(EPB_FLAGS, &bits.to_le_bytes());
        }
        if comment.is_some() || dir.is_some() {
            self.option(OPT_END, &[]);
        }
        self.end()
    }

    /// Flush the underlying writer.
    pub fn flush(&mut self) -> io::Result<()> {
        self.w.flush()
    }

    /// The underlying writer.
    pub fn into_inner(self) -> W {
        self.w
    }

    fn begin(&mut self, kind: u32) {
        self.block.clear();
        self.u32(kind);
        self.u32(0); // total length, set by `end`
    }

    /// Close the block with its total length (at both ends) and write it.
    fn end(&mut self) -> io::Result<()> {
        let total = (self.block.len() + 4) as u32;
        self.block[4..8].copy_from_slice(&total.to_le_bytes());
        self.u32(total);
        self.w.write_all(&self.block)
    }

    fn option(&mut self, code: u16, value: &[u8]) {
        self.u16(code);
        self.u16(value.len() as u16);
        self.block.extend_from_slice(value);
        self.pad();
    }

    fn pad(&mut self) {
        while self.block.len() % 4 != 0 {
            self.block.push(0);
        }
    }

    fn u16(&mut self, v: u16) {
        self.block.extend_from_slice(&v.to_le_bytes());
    }

    fn u32(&mut self, v: u32) {
        self.block.extend_from_slice(&v.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn u32_at(v: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(v[at..at + 4].try_into().unwrap())
    }

    /// Walks the blocks by their lengths: (type, body) of each, both length fields equal.
    fn blocks(v: &[u8]) -> Vec<(u32, Vec<u8>)> {
        let mut out = Vec::new();
        let mut at = 0;
        while at < v.len() {
            let len = u32_at(v, at + 4) as usize;
            assert_eq!(len % 4, 0);
            assert_eq!(u32_at(v, at + len - 4) as usize, len, "trailing length");
            out.push((u32_at(v, at), v[at + 8..at + len - 4].to_vec()));
            at += len;
        }
        assert_eq!(at, v.len());
        out
    }

    #[test]
    fn layout() {
        let mut p = PcapngWriter::new(Vec::new(), "softrdma", "dev0").unwrap();
        p.write_packet(
            0x1_0000_0002,
            &[0x45, 0, 0, 1, 9],
            Some(Direction::Outbound),
            Some("ring"),
        )
        .unwrap();
        p.write_packet(7, &[0x45], None, None).unwrap();
        let v = p.into_inner();
        let b = blocks(&v);
        assert_eq!(
            b.iter().map(|x| x.0).collect::<Vec<_>>(),
            [SHB, IDB, EPB, EPB]
        );
        assert_eq!(u32_at(&b[0].1, 0), BYTE_ORDER_MAGIC);
        // IDB: linktype, reserved, snaplen, then if_name "dev0", if_tsresol 9, end
        assert_eq!(&b[1].1[..2], &101u16.to_le_bytes());
        assert_eq!(u32_at(&b[1].1, 4), SNAPLEN);
        assert_eq!(&b[1].1[8..16], &[2, 0, 4, 0, b'd', b'e', b'v', b'0']);
        assert_eq!(&b[1].1[16..24], &[9, 0, 1, 0, 9, 0, 0, 0]);
        // EPB: interface, ts high/low, lengths, data padded, comment, flags, end
        let e = &b[2].1;
        assert_eq!(
            [0, 1, 2, 5, 5].to_vec(),
            (0..5).map(|k| u32_at(e, 4 * k)).collect::<Vec<_>>()
        );
        assert_eq!(&e[20..28], &[0x45, 0, 0, 1, 9, 0, 0, 0]);
        assert_eq!(&e[28..36], &[1, 0, 4, 0, b'r', b'i', b'n', b'g']);
        assert_eq!(&e[36..44], &[2, 0, 4, 0, 2, 0, 0, 0]);
        assert_eq!(&e[44..], &[0, 0, 0, 0]);
        // no options: no end-of-options either
        assert_eq!(b[3].1.len(), 20 + 4);
    }

    #[test]
    fn refuses_what_it_cannot_hold() {
        let mut p = PcapngWriter::new(Vec::new(), "softrdma", "dev0").unwrap();
        let long = "x".repeat(70_000);
        assert!(p.write_packet(1, &[0x45], None, Some(&long)).is_err());
    }
}
