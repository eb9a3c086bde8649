//! Flood a device's CM with REQs over loopback and report what it kept: a server device
//! whose CM listens on the wildcard address with a backlog of 3 (as `rping -s` does)
//! takes REQs from another device whose rdma_cm header does not parse, names a source
//! other than the packet's, or names a service nobody listens on (each refused with a
//! REJ), or that are valid requests the program never takes (the backlog holds three,
//! the rest are dropped). Prints the protocol's connections, its next timer and the
//! process's resident memory as it goes.
//!
//! `cargo run --release -p softrdma-cm --example cm_flood -- [REQS]` (default 200000).
//! At 2 × 10^5 REQs: 3 connections and 2.8 → 3.5 MB; before the CM let refused
//! requests go, 50,003 connections and 2.9 → 36 MB.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use softrdma_cm::agent::{Agent, EventChannel};
use softrdma_cm::host::HostPorts;
use softrdma_device::registry::Registry;
use softrdma_device::{Device, DeviceAddr, DeviceConfig};
use softrdma_testkit::cm;
use softrdma_wire::cm::{port_space, service_id, CmMsg, CmaHeader, Req};
use softrdma_wire::SplitMix64;

/// The devices' UDP port, away from other programs' devices.
const DEV_PORT: u16 = 24_797;
const PORT: u16 = 7471;

fn device(name: &str) -> Arc<Device> {
    let mut cfg = DeviceConfig::new(name, DeviceAddr::AutoLoopback(DEV_PORT));
    cfg.stats_dir = None;
    cfg.pcap = None;
    Arc::new(Device::open(&cfg).expect("open device"))
}

/// Resident memory of this process, in KiB.
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// REQ number `k`, from a client at `src` to the server at `dst`: refused one way or
/// another, or (one in four) a valid request.
fn junk(r: &mut SplitMix64, k: u64, src: IpAddr, dst: IpAddr) -> [u8; 256] {
    let mut private_data = [0u8; 92];
    let claimed = if k % 4 == 1 {
        IpAddr::V4(Ipv4Addr::new(10, 1, 2, 3))
    } else {
        src
    };
    let hdst = dst;
    let _ = CmaHeader {
        src_port: 22,
        src: claimed,
        dst: hdst,
    }
    .emit(&mut private_data);
    if k % 4 == 0 {
        private_data[0] = 1; // CMA version 1: does not parse
    }
    let port = if k % 4 == 2 { PORT + 1 } else { PORT };
    let req = Req {
        local_comm_id: r.next_u64() as u32,
        local_ca_guid: r.next_u64(),
        local_qpn: r.next_u64() as u32 & 0xFF_FFFF,
        private_data,
        ..cm::req(service_id(port_space::TCP, port), 0, 1)
    };
    CmMsg::Req(Box::new(req)).emit(r.next_u64())
}

fn main() {
    let n: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(200_000);
    let dir = std::env::temp_dir().join(format!("softrdma-cm-flood-{}", std::process::id()));
    let reg = Registry::open(&dir).expect("registry");
    let (server, client) = (device("flood-s"), device("flood-c"));
    let agent = Agent::start(
        Arc::clone(&server),
        Box::new(HostPorts::new(reg.clone(), DEV_PORT)),
        7,
    )
    .expect("CM agent");
    let ch = EventChannel::new().expect("event channel");
    agent.attach(&ch);
    let any = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), PORT);
    agent
        .call(|c, _| {
            let l = c.create_id(ch.id(), port_space::TCP, None)?;
            c.bind(l, any)?;
            c.listen(l, 3)
        })
        .expect("listen");
    let (src, dst) = (client.addr().ip(), server.addr().ip());
    let report = |what: &str| {
        let (len, timers, rx) =
            agent.call(|c, _| (c.ib().len(), c.poll_timeout(), c.ib().stats().rx));
        println!(
            "{what}: {rx} MADs taken, {len} CM connections, next timer {timers:?}, RSS {} KiB",
            rss_kib()
        );
    };
    report("before");
    let mut r = SplitMix64::new(1);
    let start = Instant::now();
    let batch = 512;
    let mut sent = 0;
    while sent < n {
        for _ in 0..batch.min(n - sent) {
            client.send_mad(dst, 1, 0, &junk(&mut r, sent, src, dst));
            sent += 1;
        }
        // Let the CM take the batch before the next (its inbox holds 1024).
        let deadline = Instant::now() + Duration::from_secs(5);
        while agent.call(|c, _| c.ib().stats().rx) < sent && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(200));
        }
        while client.take_mad().is_some() {}
        if sent % 50_000 < batch {
            report(&format!("after {sent}"));
        }
    }
    let secs = start.elapsed().as_secs_f64();
    report("after");
    println!(
        "{n} REQs in {secs:.1} s ({:.0}/s); events for the program: {}",
        n as f64 / secs,
        ch.pending()
    );
    drop(agent);
    let _ = std::fs::remove_dir_all(&dir);
}
