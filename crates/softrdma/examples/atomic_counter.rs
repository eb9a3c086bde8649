//! A shared counter in the server's memory, incremented with RDMA FETCH_AND_ADD by several
//! client threads (and processes) at once; the final value is checked.
//!
//! Each client thread has its own TCP connection and RC queue pair; the server accepts
//! `--expect` of them, then waits until each says it is done. The server's process takes no
//! part in the increments: they are one-sided.
//!
//! ```text
//! server:  cargo run --example atomic_counter -- [--expect 4] [--adds 1000]
//! client:  cargo run --example atomic_counter -- SERVER_IP [--threads 2] [--adds 1000]
//! checked on loopback (server + 2 client processes × 2 threads):
//!          cargo run --example atomic_counter -- --self-test
//! ```
//! TCP port 18518: each connection is one `softrdma::tcp` call on each side, the server
//! offering the counter's memory in its endpoint.

#[path = "common/mod.rs"]
mod common;

use std::io::{Read, Write};
use std::time::Duration;

use softrdma::{tcp, wr, Access, Device, QpInit, QpType, WcStatus};

const PORT: u16 = 18518;
/// FETCH_AND_ADDs a client thread keeps in flight.
const DEPTH: u64 = 8;
type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn server(port: u16, expect: u64, adds: u64) -> Res<()> {
    let dev = Device::open_default()?;
    let pd = dev.alloc_pd()?;
    // Each client's QP only serves as a target and posts nothing: one WR per queue
    // is enough, and the CQ must hold both queues of every QP.
    let cq = dev.create_cq(
        u32::try_from(expect.saturating_mul(2) + 2).unwrap_or(u32::MAX),
        None,
    )?;
    let access = Access::LOCAL_WRITE | Access::REMOTE_ATOMIC | Access::REMOTE_READ;
    let counter = pd.register(8, access)?;
    println!(
        "{} at {}: counter at {:#x}",
        dev.name(),
        dev.addr(),
        counter.addr()
    );
    let l = common::listen(port)?;
    let mut conns = Vec::new();
    let opts = tcp::Options::new(access).with_memory(counter.remote());
    for _ in 0..expect {
        let qp = pd.create_qp(&QpInit::new(QpType::Rc, &cq).depth(1, 1))?;
        let link = tcp::accept(&l, &qp, &opts)?;
        let s = link.stream;
        s.set_read_timeout(Some(Duration::from_secs(60)))?;
        println!(
            "client {} connected (QPN {:#x})",
            s.peer_addr()?,
            link.peer.qpn
        );
        conns.push((s, qp));
    }
    for (s, _) in conns.iter_mut() {
        let mut b = [0u8; 1];
        s.read_exact(&mut b)?;
    }
    let v = counter.read_u64(0)?;
    println!("counter = {v} (expected {})", expect * adds);
    for (s, _) in conns.iter_mut() {
        s.write_all(&v.to_le_bytes())?;
    }
    if v != expect * adds {
        return Err("counter mismatch".into());
    }
    Ok(())
}

fn client_thread(host: &str, port: u16, adds: u64, dev: &Device) -> Res<()> {
    let pd = dev.alloc_pd()?;
    let cq = dev.create_cq(128, None)?; // room for the QP's 64 + 64 WRs
    let res = pd.register(8 * DEPTH as usize, Access::LOCAL_WRITE)?;
    let qp = pd.create_qp(&QpInit::new(QpType::Rc, &cq))?;
    let link = tcp::connect((host, port), &qp, &tcp::Options::new(Access::empty()))?;
    let counter = link.peer.memory.ok_or("the server offered no counter")?;
    let mut s = link.stream;
    let (mut posted, mut done) = (0u64, 0u64);
    while done < adds {
        while posted < adds && posted - done < DEPTH {
            let slot = (posted % DEPTH) as usize * 8;
            qp.post_send(wr::fetch_add(
                posted,
                res.sge(slot..slot + 8)?,
                &counter,
                0,
                1,
            )?)?;
            posted += 1;
        }
        let wc = cq.wait(Duration::from_secs(10))?;
        if wc.status != WcStatus::Success {
            return Err(format!("FETCH_AND_ADD: {}", wc.status.as_str()).into());
        }
        done += 1;
    }
    s.write_all(b"d")?;
    let mut v = [0u8; 8];
    s.read_exact(&mut v)?;
    println!(
        "thread done after {adds} adds; final counter {}",
        u64::from_le_bytes(v)
    );
    Ok(())
}

fn client(host: &str, port: u16, threads: u64, adds: u64) -> Res<()> {
    // One device per process (every process is its own NIC), shared by the threads.
    let dev = Device::open_default()?;
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (h, d) = (host.to_string(), dev.clone());
            std::thread::spawn(move || client_thread(&h, port, adds, &d).map_err(|e| e.to_string()))
        })
        .collect();
    for h in handles {
        h.join().map_err(|_| "client thread panicked")??;
    }
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    common::check_args(
        "atomic_counter",
        &args,
        &[
            ("--port", "TCP port of the side channel"),
            ("--adds", "FETCH_AND_ADDs per client thread"),
            ("--expect", "server: client threads to wait for"),
            ("--threads", "client: threads"),
        ],
    );
    if args.iter().any(|a| a == "--self-test") {
        let ok = common::self_test(
            &["--expect", "4", "--adds", "500"],
            &["--threads", "2", "--adds", "500"],
            2,
            Duration::from_secs(120),
        );
        println!("self-test {}", if ok { "passed" } else { "FAILED" });
        std::process::exit(if ok { 0 } else { 1 });
    }
    let get = |n: &str, d: u64| {
        common::arg_value(&args, n)
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let port = get("--port", PORT as u64) as u16;
    let adds = get("--adds", 1000);
    let r = match common::positional(&args, &["--port", "--adds", "--expect", "--threads"]) {
        None => server(port, get("--expect", 4), adds),
        Some(host) => client(&host, port, get("--threads", 2), adds),
    };
    if let Err(e) = r {
        eprintln!("atomic_counter: {e}");
        std::process::exit(1);
    }
}
