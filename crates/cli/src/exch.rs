//! The TCP address exchange of rdma-core's `ibv_*_pingpong` examples.
//!
//! Each address is one fixed-size message: `sprintf("%04x:%06x:%06x:%s", lid, qpn, psn,
//! gid)` with the GID as 32 hex digits in wire byte order, sent as the whole
//! `char msg[sizeof "0000:000000:000000:00000000000000000000000000000000"]` buffer — 51
//! characters and the terminating NUL, 52 bytes. The client writes its message(s) first,
//! the server connects its QP(s), answers with its own, and the client ends with the 5
//! bytes `"done\0"`. `ibv_srq_pingpong` sends 256 messages each way (its `MAX_QP`), the
//! unused ones all zero.

use std::io::Write;
use std::net::TcpStream;

use softrdma::Gid;

use crate::tcp::read_exact;
use crate::CmdResult;

/// Bytes of one address message, NUL included.
pub const MSG_LEN: usize = 52;
/// Bytes of the client's closing `"done"`, NUL included.
pub const DONE: &[u8; 5] = b"done\0";
/// Messages each way in `ibv_srq_pingpong` (its `MAX_QP`).
pub const SRQ_MAX_QP: usize = 256;

/// One side's address: what `struct pingpong_dest` holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Dest {
    pub lid: u16,
    pub qpn: u32,
    pub psn: u32,
    pub gid: Gid,
}

/// The GID as 32 hex digits, bytes in wire order (what `gid_to_wire_gid` prints).
pub fn gid_to_wire(g: &Gid) -> String {
    g.0.iter().map(|b| format!("{b:02x}")).collect()
}

/// Parse [`gid_to_wire`] (what `wire_gid_to_gid` reads).
pub fn wire_to_gid(s: &str) -> Option<Gid> {
    if s.len() < 32 || !s.is_char_boundary(32) {
        return None;
    }
    let mut g = [0u8; 16];
    for (i, b) in g.iter_mut().enumerate() {
        *b = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(Gid(g))
}

/// The 52-byte message of `d`.
pub fn encode(d: &Dest) -> [u8; MSG_LEN] {
    let text = format!(
        "{:04x}:{:06x}:{:06x}:{}",
        d.lid,
        d.qpn & 0xff_ffff,
        d.psn & 0xff_ffff,
        gid_to_wire(&d.gid)
    );
    let mut m = [0u8; MSG_LEN];
    let n = text.len().min(MSG_LEN - 1);
    m[..n].copy_from_slice(&text.as_bytes()[..n]);
    m
}

/// Parse a message as `sscanf("%x:%x:%x:%s")` would.
pub fn decode(m: &[u8]) -> CmdResult<Dest> {
    let end = m.iter().position(|&b| b == 0).unwrap_or(m.len());
    let text = std::str::from_utf8(&m[..end]).map_err(|_| "peer's address is not text")?;
    let bad = || format!("malformed peer address {text:?}");
    let mut f = text.splitn(4, ':');
    let lid = u16::from_str_radix(f.next().ok_or_else(bad)?, 16).map_err(|_| bad())?;
    let qpn = u32::from_str_radix(f.next().ok_or_else(bad)?, 16).map_err(|_| bad())?;
    let psn = u32::from_str_radix(f.next().ok_or_else(bad)?, 16).map_err(|_| bad())?;
    let gid = wire_to_gid(f.next().ok_or_else(bad)?).ok_or_else(bad)?;
    Ok(Dest { lid, qpn, psn, gid })
}

fn write_all(s: &mut TcpStream, b: &[u8], what: &str) -> CmdResult {
    s.write_all(b)
        .map_err(|e| format!("couldn't send {what}: {e}"))
}

fn encode_all(mine: &[Dest], count: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(count * MSG_LEN);
    for i in 0..count {
        out.extend_from_slice(&encode(&mine.get(i).copied().unwrap_or_default()));
    }
    out
}

fn read_all(s: &mut TcpStream, count: usize) -> CmdResult<Vec<Dest>> {
    let mut out = Vec::with_capacity(count);
    let mut m = [0u8; MSG_LEN];
    for _ in 0..count {
        read_exact(s, &mut m, "remote address")?;
        out.push(decode(&m)?);
    }
    Ok(out)
}

/// The client's side: send `count` messages (ours, then zeros), read `count`, send "done".
pub fn client(s: &mut TcpStream, mine: &[Dest], count: usize) -> CmdResult<Vec<Dest>> {
    // One write per message, as the examples do: the rc server reads it with one read().
    for i in 0..count {
        write_all(
            s,
            &encode(&mine.get(i).copied().unwrap_or_default()),
            "local address",
        )?;
    }
    let theirs = read_all(s, count)?;
    write_all(s, DONE, "\"done\"")?;
    Ok(theirs)
}

/// The server's side, first half: read the client's `count` messages.
pub fn server_read(s: &mut TcpStream, count: usize) -> CmdResult<Vec<Dest>> {
    read_all(s, count)
}

/// The server's side, second half (after connecting its QPs): answer with ours and wait
/// for "done" (or the client closing).
pub fn server_answer(s: &mut TcpStream, mine: &[Dest], count: usize) -> CmdResult {
    write_all(s, &encode_all(mine, count), "local address")?;
    let mut d = [0u8; DONE.len()];
    // The examples only check the byte count of this read; accept an early close too.
    let _ = read_exact(s, &mut d, "\"done\"");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_bytes() {
        let d = Dest {
            lid: 0,
            qpn: 0x11,
            psn: 0xabcdef,
            gid: Gid::from_ip("127.0.0.2".parse().unwrap()),
        };
        let m = encode(&d);
        assert_eq!(
            &m[..51],
            b"0000:000011:abcdef:00000000000000000000ffff7f000002"
        );
        assert_eq!(m[51], 0);
        assert_eq!(decode(&m).unwrap(), d);
        assert!(decode(b"zz").is_err());
        assert!(decode(&[0u8; 52]).is_err());
    }
}
