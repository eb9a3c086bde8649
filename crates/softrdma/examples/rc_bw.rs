//! RC RDMA WRITE bandwidth (like perftest's `ib_write_bw`).
//!
//! ```text
//! server:  cargo run --release --example rc_bw
//! client:  cargo run --release --example rc_bw -- SERVER_IP [--iters N] [--size BYTES] [--depth N]
//! both on loopback, checked:  cargo run --example rc_bw -- --self-test
//! ```
//! The client keeps `--depth` WRITEs of `--size` bytes in flight (path MTU 4096) and
//! prints the goodput; the server only has to be there (one-sided operations complete
//! with no action by the target). The endpoints (QP number, GID, PSN, MTU and the target
//! buffer's address and rkey) are exchanged over TCP port 18517 by `softrdma::tcp`.

#[path = "common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::Role;
use softrdma::{
    tcp, wr, Access, Device, Mtu, PathOptions, QpInit, QpType, WcStatus, WorkCompletion,
};

const PORT: u16 = 18517;
type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn run(role: Role, iters: u64, size: usize, depth: u64) -> Res<()> {
    let server = role.is_server();
    let dev = Device::open_default()?;
    let pd = dev.alloc_pd()?;
    let cq = dev.create_cq(256, None)?;
    let mr = pd.register(size.max(1), Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    let qp = pd.create_qp(&QpInit::new(QpType::Rc, &cq))?;
    // Both sides offer path MTU 4096; the connection takes the lower of the two.
    let path = PathOptions {
        mtu: Mtu::Mtu4096,
        ..PathOptions::default()
    };
    let opts = tcp::Options::new(Access::REMOTE_WRITE)
        .with_memory(mr.remote())
        .with_path(path);
    let mut link = match role {
        Role::Server(l) => tcp::accept(&l, &qp, &opts)?,
        Role::Client(addr) => tcp::connect(addr, &qp, &opts)?,
    };
    let rmem = link.peer.memory.ok_or("the server offered no memory")?;
    if server {
        // Wait for the client to finish, however long it takes.
        link.stream.set_read_timeout(None)?;
        link.barrier()?;
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
    link.barrier()?;
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
    let r = common::role(&args, &["--port", "--iters", "--size", "--depth"], port)
        .and_then(|role| run(role, iters, size, depth));
    if let Err(e) = r {
        eprintln!("rc_bw: {e}");
        std::process::exit(1);
    }
}
