//! Device counters: printed in-process (`--stats`), listed for `softrdma stats`, and
//! `softrdma trace`.
//!
//! Every open device, whichever program opened it, publishes its counters to a stats file
//! (see `softrdma::statsfile`); `softrdma stats` lists the files whose process is alive.

use std::path::{Path, PathBuf};

use serde::{Serialize, Serializer};
use softrdma::statsfile::{self, Record};
use softrdma::Device;

use crate::output;
use crate::CmdResult;

fn record_of(dev: &Device) -> Record {
    Record::new(dev.name(), dev.addr(), &dev.stats())
}

/// A device's counters as `--json` shows them (`softrdma stats`, and `--stats` of the
/// other commands).
#[derive(Serialize)]
pub struct StatsJson {
    name: String,
    pid: u32,
    addr: String,
    gid: String,
    #[serde(serialize_with = "ordered_map")]
    counters: Vec<(String, u64)>,
    /// "on", or why the same-host path is off.
    same_host: String,
    peers: Vec<PeerJson>,
}

/// A peer's path in `--json`.
#[derive(Serialize)]
struct PeerJson {
    addr: String,
    /// "ring" or "udp".
    path: String,
    why: String,
}

impl From<Record> for StatsJson {
    fn from(r: Record) -> StatsJson {
        let peers = r
            .peer_paths()
            .map(|(addr, path, why)| PeerJson {
                addr: addr.to_string(),
                path: path.to_string(),
                why: why.to_string(),
            })
            .collect();
        StatsJson {
            name: r.name,
            pid: r.pid,
            addr: r.addr,
            gid: r.gid,
            counters: r.counters,
            peers,
            same_host: r.same_host,
        }
    }
}

/// The counters as one object in the record's order (serde_json's `Map` would sort them).
fn ordered_map<S: Serializer>(c: &[(String, u64)], s: S) -> Result<S::Ok, S::Error> {
    s.collect_map(c.iter().map(|(k, v)| (k, v)))
}

/// The counters of an open device, for `--json --stats`.
pub fn device_json(dev: &Device) -> StatsJson {
    record_of(dev).into()
}

#[derive(Serialize)]
struct StatsList {
    dir: String,
    devices: Vec<StatsJson>,
}

fn print_record(r: &Record) {
    outln!("{} (pid {}, {}, GID {})", r.name, r.pid, r.addr, r.gid);
    let get = |k: &str| r.counter(k).unwrap_or(0);
    outln!(
        "  packets   tx {:>12}  rx {:>12}",
        get("tx_packets"),
        get("rx_packets")
    );
    outln!(
        "  bytes     tx {:>12}  rx {:>12}",
        get("tx_bytes"),
        get("rx_bytes")
    );
    outln!(
        "  retransmits {}  timeouts {} (round-trip timer {})  duplicates {}  out-of-sequence {} (held {})",
        get("retransmits"),
        get("timeouts"),
        get("rtt_timeouts"),
        get("duplicates"),
        get("out_of_sequence"),
        get("held")
    );
    outln!(
        "  NAKs sent      seq {}  inv {}  access {}  op {}  rnr {}",
        get("naks_sent_seq"),
        get("naks_sent_inv"),
        get("naks_sent_access"),
        get("naks_sent_op"),
        get("rnr_naks_sent")
    );
    outln!(
        "  NAKs received  seq {}  inv {}  access {}  op {}  rnr {}",
        get("naks_rcvd_seq"),
        get("naks_rcvd_inv"),
        get("naks_rcvd_access"),
        get("naks_rcvd_op"),
        get("rnr_naks_rcvd")
    );
    outln!(
        "  SACKs sent {}  received {}  packets resent from them {}",
        get("sacks_sent"),
        get("sacks_rcvd"),
        get("sack_resends")
    );
    outln!(
        "  keepalive probes {}  answered {}  peers lost {}",
        get("keepalive_probes"),
        get("keepalive_acks"),
        get("peers_lost")
    );
    outln!(
        "  READ re-executions {}  refused {}",
        get("read_replays"),
        get("read_replays_refused")
    );

    outln!(
        "  ICRC errors {}  malformed {}  dropped {}  UDP send drops {} (too big for the route {})",
        get("icrc_errors"),
        get("malformed"),
        get("dropped"),
        get("udp_tx_dropped"),
        get("udp_tx_too_big")
    );
    outln!(
        "  UDP datagrams  tx {}  rx {}  (GSO messages {}, GRO segments {})",
        get("udp_tx_datagrams"),
        get("udp_rx_datagrams"),
        get("udp_tx_gso_messages"),
        get("udp_rx_gro_segments")
    );
    outln!(
        "    of those through same-host rings  tx {}  rx {}  (ring found full {}, datagrams held for room {}, dropped after waiting {})",
        get("shm_tx_datagrams"),
        get("shm_rx_datagrams"),
        get("shm_tx_full"),
        get("shm_tx_held"),
        get("shm_tx_held_expired")
    );
    outln!(
        "    one-sided, one copy into or out of a same-host peer's memory  WRITEs {}  READs {}  (placed WRITEs taken {})",
        get("placed_writes"),
        get("placed_reads"),
        get("placed_writes_taken")
    );
    if !r.same_host.is_empty() {
        outln!("  same-host path {}", r.same_host);
    }
    for (addr, path, why) in r.peer_paths() {
        let path = if path == "ring" {
            "same-host ring"
        } else {
            "UDP"
        };
        outln!("    peer {addr}: {path} ({why})");
    }
}

/// Print an open device's counters.
pub fn print_device(dev: &Device) {
    print_record(&record_of(dev));
}

/// `softrdma stats`.
pub fn show(json: bool, all: bool) -> CmdResult {
    let dir = statsfile::stats_dir();
    // A directory another user made in our place is refused, and says so.
    let recs = statsfile::read_all(&dir, all).map_err(|e| e.to_string())?;
    if json {
        return output::print_json(&StatsList {
            dir: dir.display().to_string(),
            devices: recs.into_iter().map(StatsJson::from).collect(),
        });
    }
    if recs.is_empty() {
        outln!(
            "no softrdma device is open on this host (stats files in {})",
            dir.display()
        );
        return Ok(());
    }
    for r in &recs {
        print_record(r);
    }
    Ok(())
}

/// Count the packets of a pcap or pcapng file (None if it is neither).
fn pcap_records(p: &Path) -> Option<usize> {
    let b = std::fs::read(p).ok()?;
    if b.len() < 24 {
        return None;
    }
    if b[..4] == [0x0a, 0x0d, 0x0d, 0x0a] {
        return pcapng_packets(&b);
    }
    let le = match b[..4] {
        [0xd4, 0xc3, 0xb2, 0xa1] | [0x4d, 0x3c, 0xb2, 0xa1] => true,
        [0xa1, 0xb2, 0xc3, 0xd4] | [0xa1, 0xb2, 0x3c, 0x4d] => false,
        _ => return None,
    };
    let mut at = 24;
    let mut n = 0;
    while at + 16 <= b.len() {
        let f = [b[at + 8], b[at + 9], b[at + 10], b[at + 11]];
        let incl = if le {
            u32::from_le_bytes(f)
        } else {
            u32::from_be_bytes(f)
        } as usize;
        at += 16 + incl;
        if at > b.len() {
            break;
        }
        n += 1;
    }
    Some(n)
}

/// Count the packet blocks (enhanced, simple and obsolete) of a pcapng file, walking the
/// blocks by their lengths; what follows a malformed length is not counted.
fn pcapng_packets(b: &[u8]) -> Option<usize> {
    let le = match b.get(8..12)? {
        [0x4d, 0x3c, 0x2b, 0x1a] => true,
        [0x1a, 0x2b, 0x3c, 0x4d] => false,
        _ => return None,
    };
    let word = |at: usize| -> Option<u32> {
        let f: [u8; 4] = b.get(at..at + 4)?.try_into().ok()?;
        Some(if le {
            u32::from_le_bytes(f)
        } else {
            u32::from_be_bytes(f)
        })
    };
    let (mut at, mut n) = (0, 0);
    while let (Some(kind), Some(len)) = (word(at), word(at + 4)) {
        let len = len as usize;
        if len < 12 || len % 4 != 0 || at + len > b.len() {
            break;
        }
        if matches!(kind, 2 | 3 | 6) {
            n += 1;
        }
        at += len;
    }
    Some(n)
}

/// `softrdma trace -o FILE -- COMMAND…`.
pub fn trace(out: &Path, cmd: &[String]) -> CmdResult {
    let (prog, args) = cmd.split_first().ok_or("no command to trace")?;
    // `softrdma` itself need not be on PATH (cargo run, a build directory).
    let exe = if prog == "softrdma" {
        std::env::current_exe().map_err(|e| format!("cannot find softrdma itself: {e}"))?
    } else {
        PathBuf::from(prog)
    };
    let _ = std::fs::remove_file(out);
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        if !parent.is_dir() {
            return Err(format!(
                "cannot write {}: no directory {}",
                out.display(),
                parent.display()
            ));
        }
    }
    let status = std::process::Command::new(&exe)
        .args(args)
        .env("SOFTRDMA_PCAP", out)
        .status()
        .map_err(|e| format!("cannot run {prog}: {e}"))?;
    let packets = pcap_records(out);
    match packets {
        Some(n) => errln!("softrdma: trace: {n} packets written to {}", out.display()),
        None => errln!(
            "softrdma: trace: {prog} opened no softrdma device; {} was not written",
            out.display()
        ),
    }
    if !status.success() {
        return Err(match status.code() {
            Some(c) => format!("{prog} exited with status {c}"),
            None => format!("{prog} was killed by a signal"),
        });
    }
    if packets.is_none() {
        return Err(format!("no trace written to {}", out.display()));
    }
    Ok(())
}
