//! RC ping-pong connected through the rdma_cm (as librdmacm's `rping` is): no side
//! channel — the client's request carries the run's parameters as private data, the
//! server's answer carries where the client may RDMA WRITE, and the connection manager's
//! handshake moves both QPs to RTS.
//!
//! ```text
//! server:  cargo run --release --example cm_pingpong
//! client:  cargo run --release --example cm_pingpong -- SERVER_IP [--iters N] [--size BYTES]
//! both on loopback, checked:  cargo run --example cm_pingpong -- --self-test
//! ```
//! The server listens on rdma_cm port 18515 (TCP port space) of all addresses.

#[path = "common/mod.rs"]
mod common;

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use softrdma::cm::{self, AcceptOptions, ConnectOptions, Listener};
use softrdma::{
    wr, Access, CompletionQueue, Device, MemoryRegion, ProtectionDomain, QpInit, QpType, QueuePair,
    SendFlags, WcOpcode, WcStatus,
};

const PORT: u16 = 18515;
const TIMEOUT: Duration = Duration::from_secs(10);
/// Largest message; the RDMA WRITE target lies above the two message areas.
const MAX_SIZE: usize = 1 << 15;
const WRITE_AT: usize = 2 * MAX_SIZE;
const WRITTEN: &[u8] = b"written by the client with RDMA WRITE";
type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// One side's buffer: receive into `[0, size)`, send from `[size, 2 size)`, and the
/// RDMA WRITE target at `WRITE_AT`.
struct Side {
    pd: ProtectionDomain,
    cq: CompletionQueue,
    mr: MemoryRegion,
    size: usize,
}

impl Side {
    fn new(dev: &Device, size: usize) -> Res<Side> {
        let pd = dev.alloc_pd()?;
        let cq = dev.create_cq(128, None)?; // room for the QP's 64 + 64 WRs
        let mr = pd.register(
            WRITE_AT + WRITTEN.len(),
            Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        )?;
        Ok(Side { pd, cq, mr, size })
    }
    fn init(&self) -> QpInit<'_> {
        QpInit::new(QpType::Rc, &self.cq)
    }
    fn post_recv(&self, qp: &QueuePair) -> softrdma::Result<()> {
        qp.post_recv(wr::recv(2, [self.mr.sge(0..self.size)?]))
    }
    fn send(&self, qp: &QueuePair) -> softrdma::Result<()> {
        let mut w = wr::send(1, [self.mr.sge(self.size..2 * self.size)?]);
        w.flags |= SendFlags::SIGNALED;
        qp.post_send(w)
    }
    /// Wait for a receive, counting the send completions that come first in `sends`.
    fn wait_recv(&self, sends: &mut u64) -> Res<()> {
        loop {
            let wc = self.cq.wait(TIMEOUT)?;
            if wc.status != WcStatus::Success {
                let op = wc.opcode;
                return Err(format!("{op:?} completed with {}", wc.status.as_str()).into());
            }
            match wc.opcode {
                WcOpcode::Recv => return Ok(()),
                _ => *sends += 1,
            }
        }
    }
}

/// The client's request: "cm_pingpong ITERS SIZE".
fn parse_request(private: &[u8]) -> Option<(u64, usize)> {
    let end = private
        .iter()
        .position(|&b| b == 0)
        .unwrap_or(private.len());
    let text = std::str::from_utf8(&private[..end]).ok()?;
    let mut w = text.strip_prefix("cm_pingpong ")?.split(' ');
    let iters = w.next()?.parse().ok()?;
    let size = w
        .next()?
        .parse()
        .ok()
        .filter(|s| (1..=MAX_SIZE).contains(s))?;
    Some((iters, size))
}

fn server(port: u16) -> Res<()> {
    let dev = Device::open_default()?;
    let any = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port);
    let l = Listener::bind(&dev, any)?;
    println!("listening on {}", l.local_addr().port());
    std::io::stdout().flush()?;
    let req = l.next_request(None)?;
    let Some((iters, size)) = parse_request(req.private_data()) else {
        // The client finds these words in its error's rejection.
        req.reject(b"expected \"cm_pingpong ITERS SIZE\"")?;
        return Err("a client sent a request this server does not understand".into());
    };
    let peer = req.peer_addr().map_or("?".into(), |a| a.to_string());
    println!("request from {peer}: {iters} iterations of {size} bytes");
    let side = Side::new(&dev, size)?;
    // The answer tells the client where it may write.
    let opts = AcceptOptions {
        timeout: Some(TIMEOUT),
        ..AcceptOptions::default()
    }
    .with_memory(side.mr.remote());
    let conn = req.accept_with(&side.pd, &side.init(), &opts, |qp| side.post_recv(qp))?;
    let qp = conn.qp();
    let mut sends = 0;
    // Echo every message; one more for the client's closing note.
    for _ in 0..iters + 1 {
        side.wait_recv(&mut sends)?;
        side.post_recv(qp)?;
        side.send(qp)?;
    }
    let got = side.mr.to_vec(WRITE_AT, WRITTEN.len())?;
    println!(
        "my memory at {WRITE_AT:#x}: {:?}",
        String::from_utf8_lossy(&got)
    );
    if got != WRITTEN {
        return Err("the client's RDMA WRITE is not in memory".into());
    }
    conn.wait_disconnected(Some(TIMEOUT))?;
    println!("disconnected");
    Ok(())
}

fn client(host: &str, port: u16, iters: u64, size: usize) -> Res<()> {
    let ip: IpAddr = host
        .parse()
        .map_err(|_| format!("{host:?} is not an IP address"))?;
    if !(1..=MAX_SIZE).contains(&size) {
        return Err(format!("--size must be 1..={MAX_SIZE}").into());
    }
    let dev = Device::open_default()?;
    let side = Side::new(&dev, size)?;
    let opts = ConnectOptions {
        timeout: Some(TIMEOUT),
        ..ConnectOptions::new(format!("cm_pingpong {iters} {size}").as_bytes())
    };
    let addr = SocketAddr::new(ip, port);
    let conn = cm::connect_with(&side.pd, &side.init(), addr, &opts, |qp| side.post_recv(qp))
        .map_err(|e| match e.rejection() {
            // A server that refused says why in its private data.
            Some(r) if r.reason == 28 => {
                let end = r.private_data.iter().position(|&b| b == 0);
                let why =
                    String::from_utf8_lossy(&r.private_data[..end.unwrap_or(r.private_data.len())]);
                format!("{e}: the server says {why:?}")
            }
            _ => e.to_string(),
        })?;
    let qp = conn.qp();
    let server_mem = conn.peer_memory().ok_or("the server offered no memory")?;
    println!(
        "connected to {addr}: QPN {:#x} to the server's {}",
        qp.qpn(),
        conn.peer_endpoint()?
    );
    let start = Instant::now();
    let mut sends = 0;
    for _ in 0..iters {
        side.send(qp)?;
        side.wait_recv(&mut sends)?;
        side.post_recv(qp)?;
    }
    let el = start.elapsed();
    let rtt = el.as_secs_f64() / iters.max(1) as f64;
    println!(
        "{iters} iterations of {size} bytes in {:.3} s: round trip {:.2} us",
        el.as_secs_f64(),
        rtt * 1e6
    );
    // One-sided: into the server's memory, then a SEND that tells it to look (RC delivers
    // in order, so the WRITE is there when the SEND arrives).
    side.mr.write(WRITE_AT, WRITTEN)?;
    let w = wr::write(
        3,
        [side.mr.sge(WRITE_AT..WRITE_AT + WRITTEN.len())?],
        &server_mem,
        WRITE_AT as u64,
    )?;
    qp.post_send(w)?;
    side.send(qp)?;
    side.wait_recv(&mut sends)?;
    conn.disconnect()?;
    conn.wait_disconnected(Some(TIMEOUT))?;
    println!("disconnected");
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    common::check_args(
        "cm_pingpong",
        &args,
        &[
            ("--port", "rdma_cm port"),
            ("--iters", "client: round trips"),
            ("--size", "client: message size in bytes"),
        ],
    );
    if args.iter().any(|a| a == "--self-test") {
        let ok = common::self_test(&[], &["--iters", "200"], 1, Duration::from_secs(60));
        println!("self-test {}", if ok { "passed" } else { "FAILED" });
        std::process::exit(if ok { 0 } else { 1 });
    }
    let get = |n: &str, d: u64| {
        common::arg_value(&args, n)
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let port = get("--port", PORT as u64) as u16;
    let iters = get("--iters", 1000);
    let size = get("--size", 64) as usize;
    let r = match common::positional(&args, &["--port", "--iters", "--size"]) {
        None => server(port),
        Some(host) => client(&host, port, iters, size),
    };
    if let Err(e) = r {
        eprintln!("cm_pingpong: {e}");
        std::process::exit(1);
    }
}
