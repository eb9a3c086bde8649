//! The address message of rdma-core's `ibv_rc_pingpong` (and `ibv_uc_`, `ibv_ud_`,
//! `ibv_srq_` pingpong), which the [`tcp`](crate::tcp) exchange and the CLI's pingpong
//! commands speak, so that both say it the same way.
//!
//! Each address is one fixed-size message: `sprintf("%04x:%06x:%06x:%s", lid, qpn, psn,
//! gid)` with the GID as 32 hex digits in wire byte order, sent as the whole
//! `char msg[sizeof "0000:000000:000000:00000000000000000000000000000000"]` buffer: 51
//! characters and the terminating NUL, [`MSG_LEN`] bytes. The client writes first, the
//! server connects its QP and answers, and the client ends with [`DONE`].

use softrdma_transport::verbs::Gid;

use crate::{Error, ErrorKind, Result};

/// Bytes of one address message, NUL included.
pub const MSG_LEN: usize = 52;
/// The client's closing message, NUL included.
pub const DONE: &[u8; 5] = b"done\0";

/// One side's address: what the examples' `struct pingpong_dest` holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Address {
    /// The port's LID: 0 on RoCE, which has none.
    pub lid: u16,
    /// The QP number (24 bits).
    pub qpn: u32,
    /// The first PSN the side sends with (24 bits).
    pub psn: u32,
    /// The GID (index 0 unless the programs' `-g` says otherwise).
    pub gid: Gid,
}

impl Address {
    /// The message text, 51 characters: `lid:qpn:psn:gid`, QPN and PSN cut to 24 bits.
    pub fn to_text(&self) -> String {
        format!(
            "{:04x}:{:06x}:{:06x}:{}",
            self.lid,
            self.qpn & 0xff_ffff,
            self.psn & 0xff_ffff,
            gid_to_hex(&self.gid)
        )
    }

    /// The [`MSG_LEN`]-byte buffer the programs write: [`Address::to_text`] and a NUL.
    pub fn to_msg(&self) -> [u8; MSG_LEN] {
        let mut m = [0u8; MSG_LEN];
        let s = self.to_text();
        let n = s.len().min(MSG_LEN - 1);
        m[..n].copy_from_slice(&s.as_bytes()[..n]);
        m
    }

    /// Parse a message as `sscanf("%x:%x:%x:%s")` reads it. Text after a NUL is ignored,
    /// so the whole buffer can be given, and so is anything after the GID's 32 digits.
    /// A field that is missing or not hex, a QPN or PSN wider than 24 bits, a GID of
    /// fewer than 32 hex digits is [`ErrorKind::Protocol`] (EPROTO).
    pub fn parse(msg: &[u8]) -> Result<Address> {
        let end = msg.iter().position(|&b| b == 0).unwrap_or(msg.len());
        let text = std::str::from_utf8(&msg[..end])
            .map_err(|_| malformed("the pingpong address is not text".into()))?;
        let bad = || malformed(format!("malformed pingpong address {text:?}"));
        let mut f = text.splitn(4, ':');
        let mut field = || f.next().ok_or_else(bad);
        let lid = hex_field(field()?, 4).ok_or_else(bad)? as u16;
        let qpn = hex_field(field()?, 6).ok_or_else(bad)?;
        let psn = hex_field(field()?, 6).ok_or_else(bad)?;
        let gid = gid_from_hex(field()?).ok_or_else(bad)?;
        Ok(Address { lid, qpn, psn, gid })
    }
}

/// A field of at most `digits` hex digits (and at least one): no sign, no spaces.
fn hex_field(s: &str, digits: usize) -> Option<u32> {
    if s.is_empty() || s.len() > digits || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u32::from_str_radix(s, 16).ok()
}

fn malformed(what: String) -> Error {
    Error::new(libc::EPROTO, what).with_kind(ErrorKind::Protocol)
}

/// The GID as 32 hex digits, bytes in wire order (what the examples' `gid_to_wire_gid`
/// prints).
pub fn gid_to_hex(g: &Gid) -> String {
    g.0.iter().map(|b| format!("{b:02x}")).collect()
}

/// Parse the first 32 characters of `s` as [`gid_to_hex`] writes them (what
/// `wire_gid_to_gid` reads); None unless they are 32 hex digits.
pub fn gid_from_hex(s: &str) -> Option<Gid> {
    let digits = s.as_bytes().get(..32)?;
    if !digits.iter().all(u8::is_ascii_hexdigit) {
        return None;
    }
    let mut g = [0u8; 16];
    for (b, pair) in g.iter_mut().zip(digits.chunks_exact(2)) {
        // Two ASCII hex digits: valid UTF-8 and a valid byte.
        *b = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
    }
    Some(Gid(g))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Address {
        Address {
            lid: 0,
            qpn: 0x11,
            psn: 0xab_cdef,
            gid: Gid::from_ip("127.0.0.2".parse().unwrap()),
        }
    }

    #[test]
    fn the_message_is_the_examples_bytes_and_parses_back() {
        let m = sample().to_msg();
        assert_eq!(
            &m[..51],
            b"0000:000011:abcdef:00000000000000000000ffff7f000002"
        );
        assert_eq!(m[51], 0);
        assert_eq!(Address::parse(&m).unwrap(), sample());
        // Without the NUL, and with something after it or after the GID.
        assert_eq!(Address::parse(&m[..51]).unwrap(), sample());
        let mut tail = m.to_vec();
        tail.extend_from_slice(b"junk");
        assert_eq!(Address::parse(&tail).unwrap(), sample());
        let longer = format!("{}ff", sample().to_text());
        assert_eq!(Address::parse(longer.as_bytes()).unwrap(), sample());
        // Wider values are cut to the message's 24 bits.
        let wide = Address {
            qpn: 0x1ff_ffff,
            ..sample()
        };
        assert_eq!(Address::parse(&wide.to_msg()).unwrap().qpn, 0xff_ffff);
    }

    #[test]
    fn malformed_messages_are_protocol_errors() {
        let gid = "00000000000000000000ffff7f000002";
        let cases: Vec<Vec<u8>> = vec![
            vec![0; MSG_LEN],
            b"".to_vec(),
            b"zz".to_vec(),
            b"0000:000011:abcdef".to_vec(),
            format!("0000:000011:{gid}").into_bytes(),
            format!("0000:00z011:abcdef:{gid}").into_bytes(),
            format!("0000::abcdef:{gid}").into_bytes(),
            format!("0000:+00011:abcdef:{gid}").into_bytes(),
            format!("0000: 00011:abcdef:{gid}").into_bytes(),
            // Wider than 24 bits (QPN, PSN) or 16 (LID).
            format!("0000:1000000:abcdef:{gid}").into_bytes(),
            format!("0000:000011:1abcdef:{gid}").into_bytes(),
            format!("10000:000011:abcdef:{gid}").into_bytes(),
            // A GID short of 32 digits, or with a non-digit.
            format!("0000:000011:abcdef:{}", &gid[..31]).into_bytes(),
            format!("0000:000011:abcdef:+{}", &gid[1..]).into_bytes(),
            format!("0000:000011:abcdef:{}é", &gid[..30]).into_bytes(),
            b"0000:000011:abcdef:\xff\xfe".to_vec(),
        ];
        for c in cases {
            let e = Address::parse(&c).expect_err(&String::from_utf8_lossy(&c));
            assert_eq!(
                e.kind(),
                ErrorKind::Protocol,
                "{:?}",
                String::from_utf8_lossy(&c)
            );
            assert_eq!(e.errno(), libc::EPROTO);
        }
    }

    #[test]
    fn gid_hex_round_trips_and_refuses_short_or_non_hex_text() {
        let g = sample().gid;
        assert_eq!(gid_from_hex(&gid_to_hex(&g)), Some(g));
        assert_eq!(gid_from_hex(&gid_to_hex(&g)[..30]), None);
        assert_eq!(gid_from_hex(&"g".repeat(32)), None);
        assert_eq!(gid_from_hex(&"+f".repeat(16)), None);
    }
}
