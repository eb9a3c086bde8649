//! `softrdma demo`: with no setup, a server process (this program re-executed) and this
//! client, each its own RDMA device on a loopback address, do SEND / WRITE / READ /
//! FETCH_ADD round trips and then short benchmarks.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;
use softrdma::{wr, Device, DeviceAddr, DeviceConfig, WcOpcode, WcStatus, WorkCompletion};

use crate::perf::{self, Rows, Side, Test};
use crate::session::{self, Poller};
use crate::{output, tcp};
use crate::{CmdResult, PerfTest};

const TIMEOUT: Duration = Duration::from_secs(10);

/// The benchmarks of the demo: (test, size, iterations).
const BENCH: &[(PerfTest, u32, u32)] = &[
    (PerfTest::WriteBw, 65536, 2000),
    (PerfTest::ReadBw, 65536, 1000),
    (PerfTest::SendBw, 4096, 2000),
    (PerfTest::SendLat, 2, 1000),
    (PerfTest::WriteLat, 2, 1000),
    (PerfTest::ReadLat, 2, 1000),
    (PerfTest::AtomicLat, 8, 500),
];

fn loopback_device(name: &str) -> CmdResult<Device> {
    // Both processes take automatic loopback addresses, whatever the configuration says,
    // so they never collide.
    let cfg = DeviceConfig::new(name, DeviceAddr::AutoLoopback(softrdma_port()));
    Device::open_with(&cfg).map_err(|e| format!("cannot open a loopback device: {e}"))
}

fn softrdma_port() -> u16 {
    4791
}

fn describe(dev: &Device) -> String {
    format!(
        "device {} at {}, GID {}",
        dev.name(),
        dev.addr(),
        std::net::Ipv6Addr::from(dev.gid().0)
    )
}

/// The hidden server half: serve `sessions` clients, then exit.
pub fn serve(sessions: u32) -> CmdResult {
    let l = std::net::TcpListener::bind(("127.0.0.1", 0))
        .map_err(|e| format!("couldn't listen on loopback: {e}"))?;
    let port = l.local_addr().map_err(|e| e.to_string())?.port();
    let dev = loopback_device("softrdma0")?;
    outln!(
        "ready port={port} pid={} {}",
        std::process::id(),
        describe(&dev)
    );
    output::flush_stdout();
    for _ in 0..sessions {
        let (s, peer) = tcp::accept(&l)?;
        perf::serve_session(&dev, s, peer, TIMEOUT)?;
    }
    Ok(())
}

struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        // Reap the server; kill it only if it is still running after a grace period.
        let until = Instant::now() + Duration::from_secs(5);
        loop {
            match self.0.try_wait() {
                Ok(Some(_)) | Err(_) => return,
                Ok(None) if Instant::now() >= until => {
                    let _ = self.0.kill();
                    let _ = self.0.wait();
                    return;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}

fn wait_one(side: &Side, poller: &Poller, want: WcOpcode) -> CmdResult<WorkCompletion> {
    let mut wcs = [WorkCompletion::default(); 1];
    loop {
        poller.poll(&side.cq, &mut wcs)?;
        let wc = wcs[0];
        if wc.status != WcStatus::Success {
            return Err(session::wc_error(&wc));
        }
        if wc.opcode == want {
            return Ok(wc);
        }
    }
}

/// One round trip of `softrdma demo --json`.
#[derive(Serialize)]
struct TripJson<'a> {
    op: &'static str,
    bytes: usize,
    usec: f64,
    note: &'a str,
}

/// One short benchmark of `softrdma demo --json`.
#[derive(Serialize)]
struct BenchJson {
    test: &'static str,
    results: Rows,
}

/// `softrdma demo --json`.
#[derive(Serialize)]
struct DemoJson<'a> {
    round_trips: Vec<TripJson<'a>>,
    benchmarks: Vec<BenchJson>,
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// `softrdma demo`.
pub fn run(json: bool) -> CmdResult {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find softrdma itself: {e}"))?;
    let sessions = 1 + BENCH.len() as u32;
    let mut child = Command::new(exe)
        .args(["__serve", "--sessions", &sessions.to_string()])
        .env_remove("SOFTRDMA_PCAP")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("cannot start the server process: {e}"))?;
    let out = child.stdout.take().ok_or("no pipe to the server process")?;
    let child = ChildGuard(child);
    let mut line = String::new();
    BufReader::new(out)
        .read_line(&mut line)
        .map_err(|e| format!("the server process did not start: {e}"))?;
    let rest = line
        .trim()
        .strip_prefix("ready port=")
        .ok_or("the server process did not start")?;
    let (port, server_desc) = rest.split_once(' ').unwrap_or((rest, ""));
    let port: u16 = port
        .parse()
        .map_err(|_| "the server process did not start")?;

    let dev = loopback_device("softrdma0")?;
    if !json {
        outln!("softrdma demo: two processes, each its own RDMA device speaking RoCEv2 over UDP on loopback\n");
        outln!("  server: {server_desc}");
        outln!("  client: pid={} {}", std::process::id(), describe(&dev));
    }

    // Round trips on one RC QP.
    let s = tcp::connect("127.0.0.1", port)?;
    let (run, side, ch) = perf::client_session(
        &dev,
        s,
        Test::Demo,
        &[4096],
        1,
        1,
        1024,
        TIMEOUT,
        false,
        false,
    )?;
    if !json {
        outln!(
            "  connected: RC QP 0x{:06x} (client) <-> QP 0x{:06x} (server)\n",
            run.local.qp.qpn,
            run.remote.qp.qpn
        );
    }
    let poller = Poller::new(TIMEOUT);
    let mut trips = Vec::new();
    let half = side.half;
    let buf_err = |e: softrdma::Error| format!("buffer access: {e}");

    let msg = b"hello over RoCEv2, from the client";
    side.mr.write(half, msg).map_err(buf_err)?;
    let t0 = Instant::now();
    side.qp
        .post_send(wr::send(
            1,
            [side.mr.sge(half..half + msg.len()).map_err(buf_err)?],
        ))
        .map_err(|e| format!("couldn't post send: {e}"))?;
    let wc = wait_one(&side, &poller, WcOpcode::Recv)?;
    let t_send = us(t0.elapsed());
    let echoed = side.mr.to_vec(0, wc.byte_len as usize).map_err(buf_err)?;
    if echoed != msg {
        return Err("SEND: the echo differs from what was sent".into());
    }
    trips.push((
        "SEND",
        msg.len(),
        t_send,
        "echoed back by the server's receive".to_string(),
    ));

    let data = b"written into the server's memory by RDMA WRITE";
    side.mr.write(half + 64, data).map_err(buf_err)?;
    let t0 = Instant::now();
    wr::write(
        2,
        [side
            .mr
            .sge(half + 64..half + 64 + data.len())
            .map_err(buf_err)?],
        &run.remote.mem,
        1024,
    )
    .and_then(|w| side.qp.post_send(w))
    .map_err(|e| format!("couldn't post write: {e}"))?;
    wait_one(&side, &poller, WcOpcode::RdmaWrite)?;
    let t_write = us(t0.elapsed());
    trips.push((
        "WRITE",
        data.len(),
        t_write,
        "no receive, no CPU on the server side".to_string(),
    ));

    let t0 = Instant::now();
    wr::read(
        3,
        [side.mr.sge(2048..2048 + data.len()).map_err(buf_err)?],
        &run.remote.mem,
        1024,
    )
    .and_then(|w| side.qp.post_send(w))
    .map_err(|e| format!("couldn't post read: {e}"))?;
    wait_one(&side, &poller, WcOpcode::RdmaRead)?;
    let t_read = us(t0.elapsed());
    let back = side.mr.to_vec(2048, data.len()).map_err(buf_err)?;
    if back != data {
        return Err("READ: the bytes read back differ from the bytes written".into());
    }
    trips.push((
        "READ",
        data.len(),
        t_read,
        format!("\"{}\"", String::from_utf8_lossy(&back)),
    ));

    let t0 = Instant::now();
    wr::fetch_add(
        4,
        side.mr.sge(half + 256..half + 264).map_err(buf_err)?,
        &run.remote.mem,
        3072,
        5,
    )
    .and_then(|w| side.qp.post_send(w))
    .map_err(|e| format!("couldn't post atomic: {e}"))?;
    wait_one(&side, &poller, WcOpcode::FetchAdd)?;
    let t_fa = us(t0.elapsed());
    let old = side.mr.read_u64(half + 256).map_err(buf_err)?;
    trips.push((
        "FETCH_ADD",
        8,
        t_fa,
        format!("+5 on a server counter; it held {old}"),
    ));
    ch.finish();
    drop(side);

    if !json {
        for (op, n, t, note) in &trips {
            outln!("  {op:<10} {n:>3} bytes  {t:>9.1} us  {note}");
        }
        outln!("\n  short benchmarks (see `softrdma perf --help` for real runs):");
    }

    let mut bw_rows = Vec::new();
    let mut lat_rows = Vec::new();
    let mut results = Vec::new();
    for &(t, size, iters) in BENCH {
        let s = tcp::connect("127.0.0.1", port)?;
        let (r, _side, ch) = perf::client_session(
            &dev,
            s,
            Test::Perf(t),
            &[size],
            iters,
            128,
            1024,
            TIMEOUT,
            false,
            false,
        )?;
        ch.finish();
        let name = Test::Perf(t).name();
        match &r.rows {
            Rows::Bw(v) => bw_rows.extend(v.iter().map(|x| (name, *x))),
            Rows::Lat(v) => lat_rows.extend(v.iter().map(|x| (name, *x))),
        }
        results.push(BenchJson {
            test: name,
            results: r.rows,
        });
    }
    drop(child);

    if json {
        return output::print_json(&DemoJson {
            round_trips: trips
                .iter()
                .map(|(op, n, t, note)| TripJson {
                    op,
                    bytes: *n,
                    usec: *t,
                    note,
                })
                .collect(),
            benchmarks: results,
        });
    }
    outln!(
        "  {:<11} {:>8} {:>8} {:>20} {:>15}",
        "test",
        "#bytes",
        "#iters",
        "BW average[MB/sec]",
        "MsgRate[Mpps]"
    );
    for (n, r) in &bw_rows {
        outln!(
            "  {:<11} {:>8} {:>8} {:>20.2} {:>15.6}",
            n,
            r.bytes,
            r.iters,
            r.avg_mb,
            r.mpps
        );
    }
    outln!();
    outln!(
        "  {:<11} {:>8} {:>8} {:>16} {:>12} {:>21}",
        "test",
        "#bytes",
        "#iters",
        "t_typical[usec]",
        "t_avg[usec]",
        "99% percentile[usec]"
    );
    for (n, r) in &lat_rows {
        outln!(
            "  {:<11} {:>8} {:>8} {:>16.2} {:>12.2} {:>21.2}",
            n,
            r.bytes,
            r.iters,
            r.typical,
            r.avg,
            r.p99
        );
    }
    outln!("\n  (write/send latencies are half a round trip, read/atomic a full one, as perftest reports them)");
    Ok(())
}
