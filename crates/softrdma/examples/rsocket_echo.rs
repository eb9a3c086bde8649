//! An rsockets echo server from Rust: every byte a client sends comes back. rdma-core's
//! `rstream` in ping-pong iterations (`-C 1 -I N`, `-T v` to verify the bytes) is such a
//! client, on this host through softrdma's drop-in librdmacm or from another host over
//! Linux's Soft-RoCE:
//!
//! ```text
//! cargo run --example rsocket_echo -- 7471                        # serves until stopped
//! softrdma run -- rstream -s 127.0.0.1 -p 7471 -S 65536 -C 1 -I 300 -T v
//! ```
//!
//! An echo answers while the client still sends: a transfer larger than the two sides'
//! buffers (128 KiB each by default) leaves both waiting to send, as it would over TCP.
//! `--once` serves one connection and exits; the bytes echoed are printed on stderr.

use std::io::{Read, Write};

use softrdma::rsocket::RListener;
use softrdma::Device;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut port = 7471u16;
    let mut once = false;
    for a in std::env::args().skip(1) {
        match a.as_str() {
            "--once" => once = true,
            p => port = p.parse().map_err(|_| format!("not a port: {p:?}"))?,
        }
    }
    let dev = Device::open_default()?;
    let listener = RListener::bind(&dev, ([0, 0, 0, 0], port).into())?;
    eprintln!("rsocket echo on {}", listener.local_addr()?);
    loop {
        let (mut s, peer) = listener.accept()?;
        let mut buf = vec![0u8; 1 << 16];
        let mut total = 0u64;
        loop {
            let n = s.read(&mut buf)?;
            if n == 0 {
                break;
            }
            s.write_all(&buf[..n])?;
            total += n as u64;
        }
        eprintln!("{peer}: {total} bytes echoed");
        if once {
            return Ok(());
        }
    }
}
