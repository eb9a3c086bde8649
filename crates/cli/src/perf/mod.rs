//! `softrdma perf`: perftest-like bandwidth and latency benchmarks over one RC QP.
//!
//! Two ways of setting a session up: a side channel of our own (TCP, port 18516 by default,
//! one text line each way: [`line`]), or with `--cm` the rdma_cm, the request and the
//! answer in its private data ([`cm_data`]).
//!
//! Each side registers one buffer of 2×M bytes (M: the largest size, at least 64): the
//! first half receives (the peer WRITEs, SENDs and atomics land there), the second half is
//! what this side sends from. The server "just serves": for WRITE, READ and atomics it
//! posts nothing and waits for "done"; for SEND bandwidth it keeps receives posted; for
//! SEND latency it echoes every message; for WRITE latency it answers each write with one
//! of its own once it sees the last byte change.
//!
//! With `--cm` there is no side channel: the client's disconnect says "done".
//!
//! The rooms: [`side`] (one side's buffer, CQ and QP, and its waits), [`line`] and
//! [`cm_data`] (the two set-up protocols), [`server`], [`client`] and [`report`] (tables
//! and JSON).

mod client;
mod cm_data;
mod line;
mod report;
mod server;
mod side;

pub use client::client_session;
pub use report::Rows;
pub use server::serve_session;
pub use side::Side;

use std::net::TcpListener;
use std::time::Duration;

use softrdma::{Device, QpType};

use crate::session;
use crate::{cmconn, output, tcp};
use crate::{CmdResult, PerfArgs, PerfTest};

const MAX_SIZE: u32 = 8 << 20;
const SQ_DEPTH: u32 = 512;
const RQ_DEPTH: u32 = 512;

/// What a session runs: a benchmark, or the demo's round trips.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Test {
    Perf(PerfTest),
    Demo,
}

impl Test {
    pub fn name(self) -> &'static str {
        match self {
            Test::Demo => "demo",
            Test::Perf(t) => match t {
                PerfTest::WriteBw => "write-bw",
                PerfTest::ReadBw => "read-bw",
                PerfTest::SendBw => "send-bw",
                PerfTest::AtomicBw => "atomic-bw",
                PerfTest::WriteLat => "write-lat",
                PerfTest::ReadLat => "read-lat",
                PerfTest::SendLat => "send-lat",
                PerfTest::AtomicLat => "atomic-lat",
            },
        }
    }
    fn parse(s: &str) -> Option<Test> {
        use PerfTest::*;
        Some(match s {
            "demo" => Test::Demo,
            "write-bw" => Test::Perf(WriteBw),
            "read-bw" => Test::Perf(ReadBw),
            "send-bw" => Test::Perf(SendBw),
            "atomic-bw" => Test::Perf(AtomicBw),
            "write-lat" => Test::Perf(WriteLat),
            "read-lat" => Test::Perf(ReadLat),
            "send-lat" => Test::Perf(SendLat),
            "atomic-lat" => Test::Perf(AtomicLat),
            _ => return None,
        })
    }
    /// The receive side consumes receive WRs.
    fn uses_recv(self) -> bool {
        matches!(
            self,
            Test::Demo | Test::Perf(PerfTest::SendBw) | Test::Perf(PerfTest::SendLat)
        )
    }
    fn is_lat(self) -> bool {
        matches!(
            self,
            Test::Perf(PerfTest::WriteLat)
                | Test::Perf(PerfTest::ReadLat)
                | Test::Perf(PerfTest::SendLat)
                | Test::Perf(PerfTest::AtomicLat)
        )
    }
    fn is_atomic(self) -> bool {
        matches!(
            self,
            Test::Perf(PerfTest::AtomicBw) | Test::Perf(PerfTest::AtomicLat)
        )
    }
    fn title(self) -> &'static str {
        match self {
            Test::Demo => "Demo",
            Test::Perf(t) => match t {
                PerfTest::WriteBw => "RDMA_Write BW Test",
                PerfTest::ReadBw => "RDMA_Read BW Test",
                PerfTest::SendBw => "Send BW Test",
                PerfTest::AtomicBw => "Atomic FETCH_AND_ADD BW Test",
                PerfTest::WriteLat => "RDMA_Write Latency Test",
                PerfTest::ReadLat => "RDMA_Read Latency Test",
                PerfTest::SendLat => "Send Latency Test",
                PerfTest::AtomicLat => "Atomic FETCH_AND_ADD Latency Test",
            },
        }
    }
}

/// The sizes a run covers.
pub fn sizes_of(test: PerfTest, size: Option<u32>, all: bool) -> CmdResult<Vec<u32>> {
    let t = Test::Perf(test);
    if t.is_atomic() {
        if size.is_some_and(|s| s != 8) {
            return Err("atomics are 8 bytes: -s must be 8".into());
        }
        return Ok(vec![8]);
    }
    if all {
        return Ok((1..=23).map(|p| 1u32 << p).collect());
    }
    let s = size.unwrap_or(if t.is_lat() { 2 } else { 65536 });
    if !(1..=MAX_SIZE).contains(&s) {
        return Err(format!("size {s} out of range (1..={MAX_SIZE})"));
    }
    Ok(vec![s])
}

/// `softrdma perf`.
pub fn run(a: &PerfArgs) -> CmdResult {
    let sizes = sizes_of(a.test, a.size, a.all)?;
    let test = Test::Perf(a.test);
    let iters = a.iters.unwrap_or(if test.is_lat() { 1000 } else { 5000 });
    if iters == 0 {
        return Err("iters must be at least 1".into());
    }
    if a.tx_depth == 0 || a.tx_depth > SQ_DEPTH {
        return Err(format!("tx-depth must be 1..={SQ_DEPTH}"));
    }
    session::mtu_of(a.mtu.unwrap_or(cmconn::DEFAULT_MTU))?;
    if a.memory_wait && a.test != PerfTest::WriteLat {
        return Err("--memory-wait applies to write-lat only".into());
    }
    let timeout = Duration::from_secs(a.timeout.max(1));
    if a.cm {
        cmconn::check_mtu(a.mtu)?;
    }

    if a.loopback && a.cm {
        // The server's device and listener first, so the client knows the port.
        let cfg =
            softrdma::DeviceConfig::new("softrdma-lo", softrdma::DeviceAddr::AutoLoopback(4791));
        let sdev = Device::open_with(&cfg)
            .map_err(|e| format!("cannot open the loopback server's device: {e}"))?;
        let l = cmconn::listen(&sdev, 0, QpType::Rc)?;
        let port = l.local_addr().port();
        let server = std::thread::spawn(move || server::serve_cm(&sdev, &l, timeout).map(|_| ()));
        let mut opts = a.dev.clone();
        opts.device = None;
        let mut cfg = session::device_config(&opts)?;
        cfg.addr = softrdma::DeviceAddr::AutoLoopback(4791);
        let dev = Device::open_with(&cfg).map_err(|e| format!("cannot open device: {e}"))?;
        let res = client::run_cm(a, &dev, "127.0.0.1", port, a.test, &sizes, iters, timeout);
        let srv = server
            .join()
            .unwrap_or_else(|_| Err("the loopback server failed".into()));
        report::client(a, &dev, test, &res?)?;
        return srv;
    }

    if a.loopback {
        let l = TcpListener::bind(("127.0.0.1", 0))
            .map_err(|e| format!("couldn't listen on loopback: {e}"))?;
        let port = l.local_addr().map_err(|e| e.to_string())?.port();
        let server = std::thread::spawn(move || -> CmdResult {
            let mut cfg = softrdma::DeviceConfig::new(
                "softrdma-lo",
                softrdma::DeviceAddr::AutoLoopback(4791),
            );
            // The client's device traces both directions; one writer per file.
            cfg.pcap = None;
            let dev = Device::open_with(&cfg)
                .map_err(|e| format!("cannot open the loopback server's device: {e}"))?;
            let (s, peer) = tcp::accept(&l)?;
            serve_session(&dev, s, peer, timeout).map(|_| ())
        });
        let mut opts = a.dev.clone();
        opts.device = None;
        let mut cfg = session::device_config(&opts)?;
        cfg.addr = softrdma::DeviceAddr::AutoLoopback(4791);
        let dev = Device::open_with(&cfg).map_err(|e| format!("cannot open device: {e}"))?;
        let res = client::run_tcp(a, &dev, "127.0.0.1", port, test, &sizes, iters, timeout);
        let srv = server
            .join()
            .unwrap_or_else(|_| Err("the loopback server failed".into()));
        res?;
        return srv;
    }

    let dev = session::open_device(&a.dev)?;
    match &a.peer {
        Some(host) if a.cm => {
            let run = client::run_cm(a, &dev, host, a.port, a.test, &sizes, iters, timeout)?;
            report::client(a, &dev, test, &run)
        }
        Some(host) => client::run_tcp(a, &dev, host, a.port, test, &sizes, iters, timeout),
        None => {
            let waiting = || {
                if !a.json {
                    outln!(
                        "************************************\n* Waiting for client to connect... *\n************************************"
                    );
                    output::flush_stdout();
                }
            };
            let sv = if a.cm {
                let l = cmconn::listen(&dev, a.port, QpType::Rc)?;
                waiting();
                server::serve_cm(&dev, &l, timeout)?
            } else {
                let l = tcp::listen(a.port)?;
                waiting();
                let (s, peer) = tcp::accept(&l)?;
                drop(l);
                serve_session(&dev, s, peer, timeout)?
            };
            report::served(a, &dev, &sv)?;
            Ok(())
        }
    }
}
