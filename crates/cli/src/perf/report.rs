//! What a run shows: the tables, the progress line, and the `--json` forms.

use std::io::Write;
use std::time::{Duration, Instant};

use serde::Serialize;
use softrdma::Device;

use crate::output;
use crate::{stats, CmdResult, PerfArgs};

use super::client::ClientRun;
use super::server::Served;
use super::side::Peer;
use super::Test;

/// One row of a bandwidth table; serialized with the names of its `--json` form.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct BwRow {
    pub bytes: u32,
    #[serde(rename = "iterations")]
    pub iters: u32,
    #[serde(rename = "bw_peak_mb_per_sec")]
    pub peak_mb: f64,
    #[serde(rename = "bw_avg_mb_per_sec")]
    pub avg_mb: f64,
    #[serde(rename = "msg_rate_mpps")]
    pub mpps: f64,
}

/// One row of a latency table (µs); serialized with the names of its `--json` form.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct LatRow {
    pub bytes: u32,
    #[serde(rename = "iterations")]
    pub iters: u32,
    #[serde(rename = "t_min_usec")]
    pub min: f64,
    #[serde(rename = "t_max_usec")]
    pub max: f64,
    #[serde(rename = "t_typical_usec")]
    pub typical: f64,
    #[serde(rename = "t_avg_usec")]
    pub avg: f64,
    #[serde(rename = "t_stdev_usec")]
    pub stdev: f64,
    #[serde(rename = "p99_usec")]
    pub p99: f64,
    #[serde(rename = "p999_usec")]
    pub p999: f64,
}

/// Results of a client run; serialized as the bare list of rows.
#[derive(Serialize)]
#[serde(untagged)]
pub enum Rows {
    Bw(Vec<BwRow>),
    Lat(Vec<LatRow>),
}

pub(super) struct Progress {
    on: bool,
    last: Instant,
}

impl Progress {
    pub(super) fn new() -> Progress {
        Progress {
            on: output::stderr_is_tty(),
            last: Instant::now(),
        }
    }
    pub(super) fn show(&mut self, size: u32, done: u64, iters: u32) {
        if self.on && self.last.elapsed() > Duration::from_millis(200) {
            self.last = Instant::now();
            errout!("\r  {size} bytes: {done}/{iters} ");
            let _ = std::io::stderr().flush();
        }
    }
    pub(super) fn clear(&self) {
        if self.on {
            errout!("\r\x1b[K");
        }
    }
}

pub(super) fn lat_row(size: u32, mut t: Vec<f64>) -> LatRow {
    t.sort_by(|a, b| a.total_cmp(b));
    let n = t.len().max(1);
    let avg = t.iter().sum::<f64>() / n as f64;
    let var = t.iter().map(|x| (x - avg) * (x - avg)).sum::<f64>() / n as f64;
    let pct = |p: f64| t[((p * n as f64).ceil() as usize).clamp(1, n) - 1];
    LatRow {
        bytes: size,
        iters: t.len() as u32,
        min: t[0],
        max: t[n - 1],
        typical: t[n / 2],
        avg,
        stdev: var.sqrt(),
        p99: pct(0.99),
        p999: pct(0.999),
    }
}

pub(super) fn print_addr(label: &str, p: &Peer) {
    outln!(
        " {label} QPN 0x{:06x} PSN 0x{:06x} RKey 0x{:08x} VAddr 0x{:016x} GID {}",
        p.qp.qpn,
        p.qp.psn,
        p.mem.rkey,
        p.mem.addr,
        std::net::Ipv6Addr::from(p.qp.gid.0)
    );
}

fn now_line() -> &'static str {
    "---------------------------------------------------------------------------------------"
}

pub fn print_rows(test: Test, rows: &Rows) {
    outln!("{}", now_line());
    outln!("                    {}", test.title());
    match rows {
        Rows::Bw(v) => {
            outln!(
                " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]"
            );
            for r in v {
                outln!(
                    " {:<10} {:<14} {:<18.2} {:<20.2} {:.6}",
                    r.bytes,
                    r.iters,
                    r.peak_mb,
                    r.avg_mb,
                    r.mpps
                );
            }
        }
        Rows::Lat(v) => {
            outln!(
                " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec]"
            );
            for r in v {
                outln!(
                    " {:<6} {:<14} {:<14.2} {:<12.2} {:<18.2} {:<14.2} {:<15.2} {:<22.2} {:.2}",
                    r.bytes,
                    r.iters,
                    r.min,
                    r.max,
                    r.typical,
                    r.avg,
                    r.stdev,
                    r.p99,
                    r.p999
                );
            }
        }
    }
    outln!("{}", now_line());
}

/// A QP and its buffer as `--json` shows them.
#[derive(Serialize)]
struct PeerJson {
    qpn: u32,
    psn: u32,
    gid: String,
    rkey: u32,
    addr: u64,
}

impl From<&Peer> for PeerJson {
    fn from(p: &Peer) -> PeerJson {
        PeerJson {
            qpn: p.qp.qpn,
            psn: p.qp.psn,
            gid: std::net::Ipv6Addr::from(p.qp.gid.0).to_string(),
            rkey: p.mem.rkey,
            addr: p.mem.addr,
        }
    }
}

/// `softrdma perf --json` on the server.
#[derive(Serialize)]
struct ServerJson {
    role: &'static str,
    test: &'static str,
    client: String,
    local: PeerJson,
    remote: PeerJson,
    #[serde(skip_serializing_if = "Option::is_none")]
    stats: Option<stats::StatsJson>,
}

/// `softrdma perf --json` on the client.
#[derive(Serialize)]
struct ClientJson<'a> {
    role: &'static str,
    test: &'static str,
    local: PeerJson,
    remote: PeerJson,
    results: &'a Rows,
    #[serde(skip_serializing_if = "Option::is_none")]
    stats: Option<stats::StatsJson>,
}

/// The client's output: the table, or its JSON.
pub(super) fn client(a: &PerfArgs, dev: &Device, test: Test, run: &ClientRun) -> CmdResult {
    if a.json {
        output::print_json(&ClientJson {
            role: "client",
            test: test.name(),
            local: (&run.local).into(),
            remote: (&run.remote).into(),
            results: &run.rows,
            stats: a.dev.stats.then(|| stats::device_json(dev)),
        })?;
    } else {
        print_rows(test, &run.rows);
        if a.dev.stats {
            stats::print_device(dev);
        }
    }
    Ok(())
}

/// The server's output once it served a client: the addresses, or their JSON.
pub(super) fn served(a: &PerfArgs, dev: &Device, sv: &Served) -> CmdResult {
    if a.json {
        output::print_json(&ServerJson {
            role: "server",
            test: sv.test.name(),
            client: sv.peer.to_string(),
            local: (&sv.local).into(),
            remote: (&sv.remote).into(),
            stats: a.dev.stats.then(|| stats::device_json(dev)),
        })?;
    } else {
        print_addr("local address: ", &sv.local);
        print_addr("remote address:", &sv.remote);
        outln!("served {} to {}", sv.test.name(), sv.peer.ip());
        if a.dev.stats {
            stats::print_device(dev);
        }
    }
    Ok(())
}
