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
//! QP numbers and GIDs are exchanged over TCP port 18517.

#[path = "common/mod.rs"]
mod common;

use std::net::{Ipv4Addr, TcpStream};
use std::time::Duration;

use softrdma::{wr, Access, Device, QpInit, QpType, RemoteQp, WcFlags, WcStatus, DEFAULT_QKEY};

const PORT: u16 = 18517;
/// Every UD receive buffer starts with 40 bytes of GRH.
const GRH: usize = 40;
const SLOT: usize = 256;
type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn run(server: bool, tcp: &mut TcpStream, count: u64) -> Res<()> {
    let dev = Device::open_default()?;
    let pd = dev.alloc_pd()?;
    let cq = dev.create_cq(256, None)?;
    let mr = pd.register(SLOT * 64, Access::LOCAL_WRITE)?;
    let qp = pd.create_qp(&QpInit::new(QpType::Ud, &cq))?;
    // A UD QP goes to RTS with no peer: destinations come per send, from address handles.
    qp.to_init(Access::empty())?;
    for i in 0..32u64 {
        let o = 32 * SLOT + i as usize * SLOT;
        qp.post_recv(wr::recv(100 + i, [mr.sge(o..o + SLOT)?]))?;
    }
    qp.to_rtr(&RemoteQp::default())?;
    qp.to_rts(0)?;
    let peer = common::exchange(tcp, &qp.local(0).to_bytes())?;
    let mut b = [0u8; 24];
    b.copy_from_slice(&peer);
    let remote = RemoteQp::from_bytes(&b);
    let ah = pd.create_ah_to(remote.gid)?;
    println!(
        "{} at {}: UD QPN {:#x}; peer QPN {:#x} at {}",
        dev.name(),
        dev.addr(),
        qp.qpn(),
        remote.qpn,
        remote.gid.to_ip()
    );
    common::sync(tcp)?;
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
    common::sync(tcp)?;
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
    let r = match common::positional(&args, &["--port", "--count"]) {
        None => common::listen(port)
            .and_then(|l| l.accept())
            .map_err(|e| e.into())
            .and_then(|(mut s, _)| {
                s.set_read_timeout(Some(Duration::from_secs(30)))?;
                run(true, &mut s, count)
            }),
        Some(host) => common::connect(&host, port)
            .map_err(|e| e.into())
            .and_then(|mut s| run(false, &mut s, count)),
    };
    if let Err(e) = r {
        eprintln!("ud: {e}");
        std::process::exit(1);
    }
}
