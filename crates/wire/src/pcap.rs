//! A classic pcap writer (nanosecond timestamps, LINKTYPE_RAW: each record is an
//! IPv4 or IPv6 packet, e.g. from [`crate::frame::emit_ip_udp`]).

use std::io::{self, Write};

/// LINKTYPE_RAW: the packet begins with an IPv4 or IPv6 header.
pub const LINKTYPE_RAW: u32 = 101;
/// Magic number of a little-endian, nanosecond-resolution pcap file.
pub const MAGIC_NANOS: u32 = 0xA1B2_3C4D;
/// Snapshot length written into the header.
pub const SNAPLEN: u32 = 262_144;

/// Writes a classic pcap stream into any [`Write`].
#[derive(Debug)]
pub struct PcapWriter<W: Write> {
    w: W,
}

impl<W: Write> PcapWriter<W> {
    /// Write the global header and return the writer.
    pub fn new(mut w: W) -> io::Result<Self> {
        let mut h = [0u8; 24];
        h[0..4].copy_from_slice(&MAGIC_NANOS.to_le_bytes());
        h[4..6].copy_from_slice(&2u16.to_le_bytes()); // version 2.4
        h[6..8].copy_from_slice(&4u16.to_le_bytes());
        // thiszone 0, sigfigs 0
        h[16..20].copy_from_slice(&SNAPLEN.to_le_bytes());
        h[20..24].copy_from_slice(&LINKTYPE_RAW.to_le_bytes());
        w.write_all(&h)?;
        Ok(PcapWriter { w })
    }

    /// Append one packet (an IP frame) with a timestamp in nanoseconds since the epoch.
    /// Frames longer than [`SNAPLEN`] are truncated in the capture (the original length is kept).
    pub fn write_packet(&mut self, ts_ns: u64, frame: &[u8]) -> io::Result<()> {
        let orig = u32::try_from(frame.len())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame too long for pcap"))?;
        let incl = orig.min(SNAPLEN);
        let secs = u32::try_from(ts_ns / 1_000_000_000)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "timestamp beyond 2106"))?;
        let nanos = (ts_ns % 1_000_000_000) as u32;
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&secs.to_le_bytes());
        h[4..8].copy_from_slice(&nanos.to_le_bytes());
        h[8..12].copy_from_slice(&incl.to_le_bytes());
        h[12..16].copy_from_slice(&orig.to_le_bytes());
        self.w.write_all(&h)?;
        self.w.write_all(&frame[..incl as usize])
    }

    /// Flush the underlying writer.
    pub fn flush(&mut self) -> io::Result<()> {
        self.w.flush()
    }

    /// The underlying writer.
    pub fn into_inner(self) -> W {
        self.w
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout() {
        let mut p = PcapWriter::new(Vec::new()).unwrap();
        p.write_packet(1_500_000_123, &[0x45, 0, 0, 1]).unwrap();
        let v = p.into_inner();
        assert_eq!(v.len(), 24 + 16 + 4);
        assert_eq!(&v[..4], &[0x4D, 0x3C, 0xB2, 0xA1]);
        assert_eq!(&v[20..24], &[101, 0, 0, 0]);
        assert_eq!(&v[24..28], &1u32.to_le_bytes());
        assert_eq!(&v[28..32], &500_000_123u32.to_le_bytes());
        assert_eq!(&v[32..36], &4u32.to_le_bytes());
        assert_eq!(&v[40..], &[0x45, 0, 0, 1]);
    }
}
