//! The TCP side channel's protocol, one text line each way:
//!
//! ```text
//! client: softrdma-perf 1 <test> sizes=<n,n,…> iters=<n> qpn=<hex> psn=<hex> gid=<32 hex> addr=<hex> rkey=<hex> len=<n> mtu=<n>
//! server: softrdma-perf 1 ok qpn=<hex> psn=<hex> gid=<32 hex> addr=<hex> rkey=<hex> len=<n>
//!         (or: softrdma-perf 1 error <message>)
//! …the test runs…
//! client: done
//! server: bye
//! ```

use std::io::{BufRead, BufReader, Read};
use std::net::TcpStream;

use softrdma::pingpong::{gid_from_hex, gid_to_hex};
use softrdma::{RemoteMemory, RemoteQp};

use crate::CmdResult;

use super::side::Peer;

pub(super) const MAGIC: &str = "softrdma-perf 1";

pub(super) fn peer_fields(p: &Peer) -> String {
    format!(
        "qpn={:x} psn={:x} gid={} addr={:x} rkey={:x} len={}",
        p.qp.qpn,
        p.qp.psn,
        gid_to_hex(&p.qp.gid),
        p.mem.addr,
        p.mem.rkey,
        p.mem.len
    )
}

pub(super) fn field<'a>(words: &[&'a str], key: &str) -> CmdResult<&'a str> {
    words
        .iter()
        .find_map(|w| w.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
        .ok_or_else(|| format!("peer's message lacks {key}"))
}

fn hex(words: &[&str], key: &str) -> CmdResult<u64> {
    u64::from_str_radix(field(words, key)?, 16).map_err(|_| format!("peer's {key} is not hex"))
}

pub(super) fn parse_peer(words: &[&str]) -> CmdResult<Peer> {
    let gid = gid_from_hex(field(words, "gid")?).ok_or("peer's gid is malformed")?;
    Ok(Peer {
        qp: RemoteQp {
            gid,
            qpn: hex(words, "qpn")? as u32,
            psn: hex(words, "psn")? as u32,
        },
        mem: RemoteMemory {
            addr: hex(words, "addr")?,
            rkey: hex(words, "rkey")? as u32,
            len: field(words, "len")?
                .parse()
                .map_err(|_| "peer's len is not a number")?,
        },
    })
}

pub(super) fn read_line(r: &mut BufReader<TcpStream>, what: &str) -> CmdResult<String> {
    let mut line = String::new();
    let n = r
        .by_ref()
        .take(4096)
        .read_line(&mut line)
        .map_err(|e| format!("couldn't read {what}: {e}"))?;
    if n == 0 {
        return Err(format!("couldn't read {what}: peer closed the connection"));
    }
    Ok(line.trim_end().to_string())
}

/// A refusal as the TCP path words it: "the server refused: MESSAGE".
pub(super) fn strip_magic(e: &str) -> String {
    match e.split_once(&format!("{MAGIC} error ")) {
        Some((head, msg)) => format!("{head}{msg}"),
        None => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_reads_as_over_tcp() {
        assert_eq!(
            strip_magic("the server refused: softrdma-perf 1 error bad iters"),
            "the server refused: bad iters"
        );
    }
}
