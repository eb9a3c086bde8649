//! Unreliable datagrams with address handles.
//!
//! The client sends numbered datagrams to the server's UD QP through an address handle;
//! the server reads the sender's address from each datagram's GRH and replies once.
//!
//! ```text
//! server:  cargo run --example ud
//! client:  cargo run --example ud -- SERVER_IP [--count N]
//! both on loopback, checked:  cargo run --example ud -- --self-test
//! ```
//! QP numbers and GIDs are exchanged over TCP port 18517 by `softrdma::tcp`, which also
//! brings the UD QP to RTS (a UD QP needs no peer for that; the peer's endpoint names the
//! destination of the address handle).

#[path = "common/mod.rs"]
mod common;

use std::net::Ipv4Addr;
use std::time::Duration;

use common::Role;
use softrdma::{tcp, wr, Access, Device, QpInit, QpType, WcFlags, WcStatus, DEFAULT_QKEY};

const PORT: u16 = 18517;
/// Every UD receive buffer starts with 40 bytes of GRH.
const GRH: usize = 40;
const SLOT: usize = 256;
type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn run(role: Role, count: u64) -> Res<()> {
    let server = role.is_server();
    let dev = Device::open_default()?;
    let pd = dev.alloc_pd()?;
    let cq = dev.create_cq(256, None)?;
    let mr = pd.register(SLOT * 64, Access::LOCAL_WRITE)?;
    let qp = pd.create_qp(&QpInit::new(QpType::Ud, &cq))?;
    // Receives go in while the QP is in INIT, before the peer knows where we are.
    let post_recvs = |qp: &softrdma::QueuePair| -> softrdma::Result<()> {
        for i in 0..32u64 {
            let o = 32 * SLOT + i as usize * SLOT;
            qp.post_recv(wr::recv(100 + i, [mr.sge(o..o + SLOT)?]))?;
        }
        Ok(())
    };
    let opts = tcp::Options::new(Access::empty());
    let mut link = match role {
        Role::Server(l) => tcp::accept_with(&l, &qp, &opts, post_recvs)?,
        Role::Client(addr) => tcp::connect_with(addr, &qp, &opts, post_recvs)?,
    };
    let remote = link.peer;
    let ah = pd.create_ah_to(remote.gid)?;
    println!(
        "{} at {}: UD QPN {:#x}; peer QPN {:#x} at {}",
        dev.name(),
        dev.addr(),
        qp.qpn(),
        remote.qpn,
        remote.gid.to_ip()
    );
    let t = Duration::from_secs(10);
    if server {
        for n in 0..count {
            let wc = cq.wait(t)?;
            if wc.status != WcStatus::Success || !wc.wc_flags.contains(WcFlags::GRH) {
                return Err(format!("bad receive {wc:?}").into());
            }
            let o = 32 * SLOT + (wc.wr_id - 100) as usize * SLOT;
            let buf = mr.to_vec(o, wc.byte_len as usize)?;
            // IPv4: the IP header sits in the GRH's last 20 bytes; source at 12..16 of it.
            let src = Ipv4Addr::new(buf[32], buf[33], buf[34], buf[35]);
            let text = String::from_utf8_lossy(&buf[GRH..]);
            println!("datagram {n} from {src} (QPN {:#x}): {text:?}", wc.src_qp);
            qp.post_recv(wr::recv(wc.wr_id, [mr.sge(o..o + SLOT)?]))?;
        }
        let reply = format!("got {count} datagrams");
        mr.write(0, reply.as_bytes())?;
        qp.post_send(wr::ud_send(
            1,
            [mr.sge(0..reply.len())?],
            ah.dest(remote.qpn, DEFAULT_QKEY),
        ))?;
        if cq.wait(t)?.status != WcStatus::Success {
            return Err("reply failed".into());
        }
    } else {
        for i in 0..count {
            let msg = format!("datagram number {i}");
            mr.write(0, msg.as_bytes())?;
            qp.post_send(wr::ud_send(
                i,
                [mr.sge(0..msg.len())?],
                ah.dest(remote.qpn, DEFAULT_QKEY),
            ))?;
            let wc = cq.wait(t)?;
            if wc.status != WcStatus::Success {
                return Err(format!("send {i}: {}", wc.status.as_str()).into());
            }
        }
        let wc = cq.wait(t)?;
        let o = 32 * SLOT + (wc.wr_id - 100) as usize * SLOT;
        let buf = mr.to_vec(o, wc.byte_len as usize)?;
        println!("server replied: {:?}", String::from_utf8_lossy(&buf[GRH..]));
    }
    link.barrier()?;
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    common::check_args(
        "ud",
        &args,
        &[
            ("--port", "TCP port of the side channel"),
            ("--count", "datagrams (at most 30)"),
        ],
    );
    if args.iter().any(|a| a == "--self-test") {
        let ok = common::self_test(&[], &[], 1, Duration::from_secs(60));
        println!("self-test {}", if ok { "passed" } else { "FAILED" });
        std::process::exit(if ok { 0 } else { 1 });
    }
    let get = |n: &str, d: u64| {
        common::arg_value(&args, n)
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let port = get("--port", PORT as u64) as u16;
    // On loopback with the receives posted first no datagram is lost; across hosts UD may
    // drop, and the server then waits out its timeout.
    let count = get("--count", 8).min(30);
    let r = common::role(&args, &["--port", "--count"], port).and_then(|role| run(role, count));
    if let Err(e) = r {
        eprintln!("ud: {e}");
        std::process::exit(1);
    }
}
