//! RC RDMA WRITE bandwidth (like perftest's `ib_write_bw`).
//!
//! ```text
//! server:  cargo run --release --example rc_bw
//! client:  cargo run --release --example rc_bw -- SERVER_IP [--iters N] [--size BYTES] [--depth N]
//! both on loopback, checked:  cargo run --example rc_bw -- --self-test
//! ```
//! The client keeps `--depth` WRITEs of `--size` bytes in flight (path MTU 4096) and
//! prints the goodput; the server only has to be there (one-sided operations complete
//! with no action by the target). QP number, GID, PSN and the target buffer's address
//! and rkey are exchanged over TCP port 18517.

#[path = "common/mod.rs"]
mod common;

use std::net::TcpStream;
use std::time::{Duration, Instant};

use softrdma::{
    wr, Access, Device, Mtu, PathOptions, QpInit, QpType, RemoteMemory, RemoteQp, WcStatus,
    WorkCompletion,
};

const PORT: u16 = 18517;
type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn run(server: bool, tcp: &mut TcpStream, iters: u64, size: usize, depth: u64) -> Res<()> {
    let dev = Device::open_default()?;
    let pd = dev.alloc_pd()?;
    let cq = dev.create_cq(256, None)?;
    let mr = pd.register(size.max(1), Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    let qp = pd.create_qp(&QpInit::new(QpType::Rc, &cq))?;
    let psn = std::process::id() & 0xFF_FFFF;
    let mut msg = qp.local(psn).to_bytes().to_vec();
    msg.extend_from_slice(&mr.remote().to_bytes());
    let peer = common::exchange(tcp, &msg)?;
    let mut q = [0u8; 24];
    q.copy_from_slice(&peer[..24]);
    let mut m = [0u8; 20];
    m.copy_from_slice(&peer[24..44]);
    let (remote, rmem) = (RemoteQp::from_bytes(&q), RemoteMemory::from_bytes(&m));
    let path = PathOptions {
        mtu: Mtu::Mtu4096,
        ..PathOptions::default()
    };
    qp.connect_with(&remote, psn, Access::REMOTE_WRITE, &path)?;
    common::sync(tcp)?;
    if server {
        // Wait for the client to finish.
        common::sync(tcp)?;
        let s = dev.stats();
        println!(
            "server link: rx {} datagrams in {} batches, {} errors; engine: {} out of sequence, {} duplicates, {} seq NAKs sent",
            s.link.rx_datagrams,
            s.link.rx_batches,
            s.link.rx_errors,
            s.engine.out_of_sequence,
            s.engine.duplicates,
            s.engine.naks_sent_seq
        );
        return Ok(());
    }
    let timeout = Duration::from_secs(10);
    let depth = depth.clamp(1, 32);
    let mut wcs = [WorkCompletion::default(); 16];
    let start = Instant::now();
    let (mut posted, mut done) = (0u64, 0u64);
    let mut idle = Instant::now();
    while done < iters {
        while posted < iters && posted - done < depth {
            qp.post_send(wr::write(posted, [mr.sge(..)?], &rmem, 0)?)?;
            posted += 1;
        }
        let n = cq.poll(&mut wcs)?;
        if n == 0 {
            if idle.elapsed() > timeout {
                return Err("no completion for 10 s".into());
            }
            std::hint::spin_loop();
            continue;
        }
        idle = Instant::now();
        for wc in &wcs[..n] {
            if wc.status != WcStatus::Success {
                return Err(format!("WRITE {}: {}", wc.wr_id, wc.status.as_str()).into());
            }
        }
        done += n as u64;
    }
    let el = start.elapsed().as_secs_f64();
    let bytes = iters as f64 * size as f64;
    println!(
        "{iters} WRITEs of {size} bytes (depth {depth}) in {el:.3} s: {:.3} GB/s, {:.0} msgs/s",
        bytes / el / 1e9,
        iters as f64 / el
    );
    let s = dev.stats();
    println!(
        "  link: tx {} datagrams in {} batches, {} dropped; rx {} datagrams; engine: {} retransmits, {} timeouts, {} seq NAKs received",
        s.link.tx_datagrams,
        s.link.tx_batches,
        s.link.tx_dropped,
        s.link.rx_datagrams,
        s.engine.retransmits,
        s.engine.timeouts,
        s.engine.naks_rcvd_seq
    );
    common::sync(tcp)?;
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    common::check_args(
        "rc_bw",
        &args,
        &[
            ("--port", "TCP port of the side channel"),
            ("--iters", "WRITEs"),
            ("--size", "bytes per WRITE"),
            ("--depth", "WRITEs in flight"),
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
    let iters = get("--iters", 2000);
    let size = get("--size", 1 << 20) as usize;
    let depth = get("--depth", 4);
    let r = match common::positional(&args, &["--port", "--iters", "--size", "--depth"]) {
        None => common::listen(port)
            .and_then(|l| l.accept())
            .map_err(|e| e.into())
            .and_then(|(mut s, _)| {
                s.set_read_timeout(None)?;
                run(true, &mut s, iters, size, depth)
            }),
        Some(host) => common::connect(&host, port)
            .map_err(|e| e.into())
            .and_then(|mut s| run(false, &mut s, iters, size, depth)),
    };
    if let Err(e) = r {
        eprintln!("rc_bw: {e}");
        std::process::exit(1);
    }
}
