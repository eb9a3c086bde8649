//! Device counters: printed in-process (`--stats`), published to a per-process stats file
//! for `softrdma stats`, and `softrdma trace`.
//!
//! Stats files: devices live inside the processes that open them, so each device this
//! tool opens writes its counters every 250 ms (and at exit) to
//! `$SOFTRDMA_STATS_DIR`, else `$XDG_RUNTIME_DIR/softrdma`, else `/dev/shm/softrdma`, as
//! `<name>-<pid>.stats`, replaced atomically (write a temporary file, rename). The format
//! is text, one `key value` per line, starting with `softrdma-stats 1`; `softrdma stats`
//! lists the files whose process is still alive.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use softrdma::{Device, DeviceStats};

use crate::json::Json;
use crate::CmdResult;

/// The counters of a device as (key, value) pairs, in a stable order.
pub fn counters(s: &DeviceStats) -> Vec<(&'static str, u64)> {
    let e = &s.engine;
    let l = &s.link;
    vec![
        ("tx_packets", e.tx_packets),
        ("tx_bytes", e.tx_bytes),
        ("rx_packets", e.rx_packets),
        ("rx_bytes", e.rx_bytes),
        ("retransmits", e.retransmits),
        ("timeouts", e.timeouts),
        ("naks_sent_seq", e.naks_sent_seq),
        ("naks_sent_inv", e.naks_sent_inv),
        ("naks_sent_access", e.naks_sent_access),
        ("naks_sent_op", e.naks_sent_op),
        ("naks_rcvd_seq", e.naks_rcvd_seq),
        ("naks_rcvd_inv", e.naks_rcvd_inv),
        ("naks_rcvd_access", e.naks_rcvd_access),
        ("naks_rcvd_op", e.naks_rcvd_op),
        ("rnr_naks_sent", e.rnr_naks_sent),
        ("rnr_naks_rcvd", e.rnr_naks_rcvd),
        ("icrc_errors", e.icrc_errors),
        ("malformed", e.malformed),
        ("duplicates", e.duplicates),
        ("dropped", e.dropped),
        ("out_of_sequence", e.out_of_sequence),
        ("udp_tx_datagrams", l.tx_datagrams),
        ("udp_tx_bytes", l.tx_bytes),
        ("udp_tx_dropped", l.tx_dropped),
        ("udp_rx_datagrams", l.rx_datagrams),
        ("udp_rx_bytes", l.rx_bytes),
        ("udp_rx_errors", l.rx_errors),
        ("pcap_errors", l.pcap_errors),
    ]
}

/// One device's published record.
#[derive(Debug, Clone, Default)]
pub struct Record {
    pub name: String,
    pub pid: u32,
    pub addr: String,
    pub gid: String,
    pub counters: Vec<(String, u64)>,
}

fn record_of(dev: &Device) -> Record {
    Record {
        name: dev.name().to_string(),
        pid: std::process::id(),
        addr: dev.addr().to_string(),
        gid: std::net::Ipv6Addr::from(dev.gid().0).to_string(),
        counters: counters(&dev.stats())
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
    }
}

fn record_text(r: &Record) -> String {
    let mut s = format!(
        "softrdma-stats 1\nname {}\npid {}\naddr {}\ngid {}\n",
        r.name, r.pid, r.addr, r.gid
    );
    for (k, v) in &r.counters {
        s.push_str(&format!("{k} {v}\n"));
    }
    s
}

fn parse_record(text: &str) -> Option<Record> {
    let mut lines = text.lines();
    if lines.next()? != "softrdma-stats 1" {
        return None;
    }
    let mut r = Record::default();
    for l in lines {
        let (k, v) = l.split_once(' ')?;
        match k {
            "name" => r.name = v.to_string(),
            "pid" => r.pid = v.parse().ok()?,
            "addr" => r.addr = v.to_string(),
            "gid" => r.gid = v.to_string(),
            _ => r.counters.push((k.to_string(), v.parse().ok()?)),
        }
    }
    (!r.name.is_empty()).then_some(r)
}

fn record_json(r: &Record) -> Json {
    let mut c = Json::obj();
    for (k, v) in &r.counters {
        c.push(k, *v);
    }
    Json::obj()
        .set("name", r.name.as_str())
        .set("pid", r.pid)
        .set("addr", r.addr.as_str())
        .set("gid", r.gid.as_str())
        .set("counters", c)
}

/// The directory of stats files.
pub fn stats_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("SOFTRDMA_STATS_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("softrdma");
    }
    PathBuf::from("/dev/shm/softrdma")
}

fn publish(dir: &Path, file: &Path, r: &Record) {
    let tmp = dir.join(format!(".{}-{}.tmp", r.name, r.pid));
    if std::fs::write(&tmp, record_text(r)).is_ok() {
        let _ = std::fs::rename(&tmp, file);
    }
}

/// Publishes a device's counters to its stats file while alive; removes the file on drop.
pub struct Publisher {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    file: PathBuf,
}

impl Publisher {
    /// Start publishing (best effort: no directory, no file, no error).
    pub fn start(dev: &Device) -> Option<Publisher> {
        let dir = stats_dir();
        std::fs::create_dir_all(&dir).ok()?;
        let file = dir.join(format!("{}-{}.stats", dev.name(), std::process::id()));
        let stop = Arc::new(AtomicBool::new(false));
        let (d, f, s) = (dev.clone(), file.clone(), Arc::clone(&stop));
        let thread = std::thread::Builder::new()
            .name("stats".into())
            .spawn(move || {
                while !s.load(Ordering::Relaxed) {
                    publish(&dir, &f, &record_of(&d));
                    for _ in 0..25 {
                        if s.load(Ordering::Relaxed) {
                            break;
                        }
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
            })
            .ok()?;
        Some(Publisher {
            stop,
            thread: Some(thread),
            file,
        })
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.file);
    }
}

/// The counters of an open device as JSON.
pub fn device_json(dev: &Device) -> Json {
    record_json(&record_of(dev))
}

fn print_record(r: &Record) {
    println!("{} (pid {}, {}, GID {})", r.name, r.pid, r.addr, r.gid);
    let get = |k: &str| {
        r.counters
            .iter()
            .find(|(n, _)| n == k)
            .map_or(0, |(_, v)| *v)
    };
    println!(
        "  packets   tx {:>12}  rx {:>12}",
        get("tx_packets"),
        get("rx_packets")
    );
    println!(
        "  bytes     tx {:>12}  rx {:>12}",
        get("tx_bytes"),
        get("rx_bytes")
    );
    println!(
        "  retransmits {}  timeouts {}  duplicates {}  out-of-sequence {}",
        get("retransmits"),
        get("timeouts"),
        get("duplicates"),
        get("out_of_sequence")
    );
    println!(
        "  NAKs sent      seq {}  inv {}  access {}  op {}  rnr {}",
        get("naks_sent_seq"),
        get("naks_sent_inv"),
        get("naks_sent_access"),
        get("naks_sent_op"),
        get("rnr_naks_sent")
    );
    println!(
        "  NAKs received  seq {}  inv {}  access {}  op {}  rnr {}",
        get("naks_rcvd_seq"),
        get("naks_rcvd_inv"),
        get("naks_rcvd_access"),
        get("naks_rcvd_op"),
        get("rnr_naks_rcvd")
    );
    println!(
        "  ICRC errors {}  malformed {}  dropped {}  UDP send drops {}",
        get("icrc_errors"),
        get("malformed"),
        get("dropped"),
        get("udp_tx_dropped")
    );
}

/// Print an open device's counters.
pub fn print_device(dev: &Device) {
    print_record(&record_of(dev));
}

fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// `softrdma stats`.
pub fn show(json: bool, all: bool) -> CmdResult {
    let dir = stats_dir();
    let mut recs: BTreeMap<(String, u32), Record> = BTreeMap::new();
    if let Ok(rd) = std::fs::read_dir(&dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.extension().and_then(|x| x.to_str()) != Some("stats") {
                continue;
            }
            let Some(r) = std::fs::read_to_string(&p)
                .ok()
                .and_then(|t| parse_record(&t))
            else {
                continue;
            };
            if !alive(r.pid) && !all {
                // A process that died without cleaning up: tidy its file.
                let _ = std::fs::remove_file(&p);
                continue;
            }
            recs.insert((r.name.clone(), r.pid), r);
        }
    }
    if json {
        let list: Vec<Json> = recs.values().map(record_json).collect();
        println!(
            "{}",
            Json::obj()
                .set("dir", dir.display().to_string())
                .set("devices", list)
        );
        return Ok(());
    }
    if recs.is_empty() {
        println!(
            "no softrdma device is open on this host (stats files in {})",
            dir.display()
        );
        return Ok(());
    }
    for r in recs.values() {
        print_record(r);
    }
    Ok(())
}

/// Count the records of a pcap file (None if it is not one).
fn pcap_records(p: &Path) -> Option<usize> {
    let b = std::fs::read(p).ok()?;
    if b.len() < 24 {
        return None;
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
        Some(n) => eprintln!("softrdma: trace: {n} packets written to {}", out.display()),
        None => eprintln!(
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_round_trip() {
        let r = Record {
            name: "softrdma0".into(),
            pid: 42,
            addr: "127.0.0.1:4791".into(),
            gid: "::ffff:127.0.0.1".into(),
            counters: vec![("tx_packets".into(), 7), ("rx_packets".into(), 9)],
        };
        let p = parse_record(&record_text(&r)).unwrap();
        assert_eq!(p.name, r.name);
        assert_eq!(p.pid, 42);
        assert_eq!(p.counters, r.counters);
        assert!(parse_record("nonsense").is_none());
    }
}
