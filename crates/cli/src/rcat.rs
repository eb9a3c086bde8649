//! `softrdma rsocket`: a byte stream over rsockets from the command line, as `nc` is over
//! TCP. It speaks rdma-core's rsockets protocol, so the peer may be `rstream`, a program
//! preloaded with `librspreload.so`, or another `softrdma rsocket`, on this host or on
//! one running Linux's Soft-RoCE.
//!
//! - `connect HOST:PORT`: standard input to the peer, the peer's bytes to standard
//!   output; standard input's end shuts the writing side down, and the command ends when
//!   the peer's stream ends too.
//! - `listen [ADDR:]PORT`: the same for the first connection (each, with `--keep`);
//!   `--echo` sends every byte back instead (a peer for `rstream`'s ping-pong runs).

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, ToSocketAddrs};
use std::time::Duration;

use clap::{Args, Subcommand};
use softrdma::rsocket::{RListener, RStream, RsocketOptions};

use crate::session::open_device;
use crate::{CmdResult, DevOpts};

/// `softrdma rsocket` arguments.
#[derive(Args, Debug)]
pub struct RsocketArgs {
    #[command(subcommand)]
    mode: Mode,
    #[command(flatten)]
    dev: DevOpts,
}

#[derive(Subcommand, Debug)]
enum Mode {
    /// Connect to an rsockets server and copy standard input to it and it to standard output
    Connect {
        /// The server, HOST:PORT
        #[arg(value_name = "HOST:PORT")]
        peer: String,
        /// Give up connecting after this many seconds
        #[arg(long, default_value_t = 30)]
        timeout: u64,
    },
    /// Accept rsockets connections and copy each to standard output (and standard input to it)
    Listen {
        /// [ADDR:]PORT to listen on (the wildcard address by default)
        #[arg(value_name = "[ADDR:]PORT")]
        addr: String,
        /// Send every byte received back to its sender
        #[arg(long)]
        echo: bool,
        /// Serve connection after connection instead of exiting after the first
        #[arg(long)]
        keep: bool,
    },
}

fn listen_addr(s: &str) -> CmdResult<SocketAddr> {
    if let Ok(p) = s.parse::<u16>() {
        return Ok(SocketAddr::from(([0, 0, 0, 0], p)));
    }
    s.parse()
        .map_err(|_| format!("not [ADDR:]PORT: {s:?} (e.g. 7471 or 0.0.0.0:7471)"))
}

fn peer_addr(s: &str) -> CmdResult<SocketAddr> {
    s.to_socket_addrs()
        .map_err(|e| format!("not HOST:PORT: {s:?} ({e})"))?
        .find(|a| a.is_ipv4())
        .or_else(|| s.to_socket_addrs().ok().and_then(|mut i| i.next()))
        .ok_or_else(|| format!("{s:?} names no address"))
}

/// Copy `src` to `dst` until `src` ends; the bytes copied.
fn pump(mut src: impl Read, mut dst: impl Write) -> std::io::Result<u64> {
    let mut buf = vec![0u8; 1 << 16];
    let mut total = 0u64;
    loop {
        let n = match src.read(&mut buf) {
            Ok(0) => return Ok(total),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        dst.write_all(&buf[..n])?;
        dst.flush()?;
        total += n as u64;
    }
}

/// Both directions of a connection with the terminal: the stream to standard output on a
/// thread, standard input to the stream here (its end shuts the stream's writing down).
fn relay(s: &RStream) -> CmdResult<(u64, u64)> {
    std::thread::scope(|sc| {
        let out = sc.spawn(|| pump(s, std::io::stdout().lock()));
        let sent = pump(std::io::stdin().lock(), s).map_err(|e| format!("sending: {e}"));
        let _ = s.shutdown(Shutdown::Write);
        let got = out
            .join()
            .map_err(|_| "the receiving thread failed".to_string())?
            .map_err(|e| format!("receiving: {e}"))?;
        Ok((sent?, got))
    })
}

/// Run `softrdma rsocket`.
pub fn run(a: &RsocketArgs) -> CmdResult {
    let dev = open_device(&a.dev)?;
    match &a.mode {
        Mode::Connect { peer, timeout } => {
            let addr = peer_addr(peer)?;
            let opts = RsocketOptions {
                timeout: Some(Duration::from_secs(*timeout)),
                ..RsocketOptions::default()
            };
            let s = RStream::connect_with(&dev, addr, &opts).map_err(|e| e.to_string())?;
            let (sent, got) = relay(&s)?;
            errln!("{addr}: {sent} bytes sent, {got} received");
            Ok(())
        }
        Mode::Listen { addr, echo, keep } => {
            let addr = listen_addr(addr)?;
            let l = RListener::bind(&dev, addr).map_err(|e| e.to_string())?;
            let local = l.local_addr().map_err(|e| e.to_string())?;
            errln!("rsocket listening on {local}");
            loop {
                let (s, peer) = l.accept().map_err(|e| format!("accept: {e}"))?;
                if *echo {
                    let n = pump(&s, &s).map_err(|e| format!("{peer}: {e}"))?;
                    let _ = s.shutdown(Shutdown::Write);
                    errln!("{peer}: {n} bytes echoed");
                } else {
                    let (sent, got) = relay(&s)?;
                    errln!("{peer}: {got} bytes received, {sent} sent");
                }
                if !keep {
                    return Ok(());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse_or_say_why_not() {
        assert_eq!(
            listen_addr("7471").unwrap(),
            "0.0.0.0:7471".parse().unwrap()
        );
        assert_eq!(
            listen_addr("127.0.0.1:9").unwrap(),
            "127.0.0.1:9".parse().unwrap()
        );
        assert!(listen_addr("x").unwrap_err().contains("[ADDR:]PORT"));
        assert_eq!(
            peer_addr("127.0.0.1:7").unwrap(),
            "127.0.0.1:7".parse().unwrap()
        );
        assert!(peer_addr("nohost").is_err());
    }
}
