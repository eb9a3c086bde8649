//! The TCP address exchange of rdma-core's `ibv_*_pingpong` examples, in messages of
//! [`softrdma::pingpong`]. The client writes its message(s) first, the server connects its
//! QP(s), answers with its own, and the client ends with the 5 bytes `"done\0"`.
//! `ibv_srq_pingpong` sends 256 messages each way (its `MAX_QP`), the unused ones
//! addresses of all zeros.

use std::io::Write;
use std::net::TcpStream;

pub use softrdma::pingpong::{Address as Dest, DONE, MSG_LEN};

use crate::tcp::read_exact;
use crate::CmdResult;

/// Messages each way in `ibv_srq_pingpong` (its `MAX_QP`).
pub const SRQ_MAX_QP: usize = 256;

/// Parse a peer's message.
fn decode(m: &[u8]) -> CmdResult<Dest> {
    Dest::parse(m).map_err(|e| e.to_string())
}

fn write_all(s: &mut TcpStream, b: &[u8], what: &str) -> CmdResult {
    s.write_all(b)
        .map_err(|e| format!("couldn't send {what}: {e}"))
}

fn encode_all(mine: &[Dest], count: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(count * MSG_LEN);
    for i in 0..count {
        out.extend_from_slice(&mine.get(i).copied().unwrap_or_default().to_msg());
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
            &mine.get(i).copied().unwrap_or_default().to_msg(),
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
