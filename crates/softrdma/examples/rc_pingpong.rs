//! RC ping-pong with a latency figure (like rdma-core's `ibv_rc_pingpong`).
//!
//! ```text
//! server:  cargo run --release --example rc_pingpong
//! client:  cargo run --release --example rc_pingpong -- SERVER_IP [--iters N] [--size BYTES]
//! both on loopback, checked:  cargo run --example rc_pingpong -- --self-test
//! ```
//! The endpoints (QP number, GID, PSN) are exchanged over TCP port 18515 by
//! `softrdma::tcp`, in one call on each side. For the lowest latency
//! set `SOFTRDMA_BUSY_POLL=1` (the progress thread then never sleeps).

#[path = "common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::Role;
use softrdma::{tcp, wr, Access, Device, QpInit, QpType, WcOpcode, WcStatus};

const PORT: u16 = 18515;
type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn run(role: Role, iters: u64, size: usize) -> Res<()> {
    let server = role.is_server();
    let dev = Device::open_default()?;
    let pd = dev.alloc_pd()?;
    let cq = dev.create_cq(128, None)?; // room for the QP's 64 + 64 WRs
    let mr = pd.register(2 * size.max(1), Access::LOCAL_WRITE)?;
    let qp = pd.create_qp(&QpInit::new(QpType::Rc, &cq))?;
    // Receive into the second half, send from the first.
    let recv = || qp.post_recv(wr::recv(2, [mr.sge(size..2 * size)?]));
    // One call: endpoints each way, INIT (where the first receive is posted), RTR, RTS.
    let opts = tcp::Options::new(Access::empty());
    let mut link = match role {
        Role::Server(l) => tcp::accept_with(&l, &qp, &opts, |_| recv())?,
        Role::Client(addr) => tcp::connect_with(addr, &qp, &opts, |_| recv())?,
    };
    let remote = link.peer;
    println!(
        "{} at {}: QPN {:#x} <-> peer QPN {:#x} at {}",
        dev.name(),
        dev.addr(),
        qp.qpn(),
        remote.qpn,
        remote.gid.to_ip()
    );
    let timeout = Duration::from_secs(10);
    let start = Instant::now();
    // Completions of the two directions may come in either order (the peer's next SEND
    // can overtake its ACK of ours), so count them rather than expect a sequence.
    let mut recvs = 0u64;
    let mut sends = 0u64;
    for i in 0..iters {
        if !server {
            mr.write(0, &i.to_le_bytes()[..size.min(8)])?;
            qp.post_send(wr::send(1, [mr.sge(0..size)?]))?;
        }
        // Wait for the peer's message (and, on the client, our own send's completion).
        let want_sends = if server { i } else { i + 1 };
        while recvs <= i || sends < want_sends {
            let wc = cq.wait(timeout)?;
            if wc.status != WcStatus::Success {
                return Err(format!("iteration {i}: {}", wc.status.as_str()).into());
            }
            match wc.opcode {
                WcOpcode::Recv => recvs += 1,
                _ => sends += 1,
            }
        }
        recv()?;
        if server {
            qp.post_send(wr::send(1, [mr.sge(0..size)?]))?;
        }
    }
    // The server's last send completes once the client has acknowledged it.
    while sends < iters {
        let wc = cq.wait(timeout)?;
        if wc.status != WcStatus::Success {
            return Err(format!("last send: {}", wc.status.as_str()).into());
        }
        sends += 1;
    }
    let el = start.elapsed();
    if !server {
        let rtt = el.as_secs_f64() / iters.max(1) as f64;
        println!(
            "{iters} iterations of {size} bytes in {:.3} s: round trip {:.2} us, latency (half) {:.2} us",
            el.as_secs_f64(),
            rtt * 1e6,
            rtt * 0.5e6
        );
    }
    link.barrier()?;
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    common::check_args(
        "rc_pingpong",
        &args,
        &[
            ("--port", "TCP port of the side channel"),
            ("--iters", "round trips"),
            ("--size", "message size in bytes"),
        ],
    );
    if args.iter().any(|a| a == "--self-test") {
        let ok = common::self_test(
            &["--iters", "200"],
            &["--iters", "200"],
            1,
            Duration::from_secs(60),
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
    let iters = get("--iters", 1000);
    let size = get("--size", 64) as usize;
    let r = common::role(&args, &["--port", "--iters", "--size"], port)
        .and_then(|role| run(role, iters, size));
    if let Err(e) = r {
        eprintln!("rc_pingpong: {e}");
        std::process::exit(1);
    }
}
