//! Stats files: how open devices publish their counters for `softrdma stats`.
//!
//! Devices live inside the processes that open them, so every open device (unless told
//! not to, see [`crate::DeviceConfig::stats_dir`]) writes its counters once when it opens
//! and then every [`PERIOD`] to a file of its own in [`stats_dir`], and removes the file
//! when it closes. A file is replaced atomically (written under a temporary name, then
//! renamed), so readers never see half a record. The format is text, one `key value` per
//! line: `softrdma-stats 1`, then `name`, `pid`, `addr` and `gid`, then the counters of
//! [`counters`]. Publishing is best effort: a missing, refused or read-only directory costs
//! the listing, never the device.
//!
//! The directory is a [`RunDir`]: checked on its descriptor, files made in it exclusively
//! under unpredictable temporary names and never through a symbolic link, so another user
//! cannot turn a device's periodic write into a write to a file of their choosing.

use std::ffi::OsStr;
use std::io::{self, Read, Write};
use std::net::{Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use softrdma_transport::verbs::Gid;

use crate::rundir::{self, RunDir};
use crate::DeviceStats;

/// A record is a few kilobytes at most; a longer file is not one.
const MAX_FILE: u64 = 64 * 1024;

/// How often an open device rewrites its stats file.
pub const PERIOD: Duration = Duration::from_millis(250);

/// First line of a stats file: the format and its version.
const MAGIC: &str = "softrdma-stats 1";

/// The directory of stats files: the user's [`rundir::default_path`] (one per user, chosen
/// so that no other user can have made it first where that is possible).
pub fn stats_dir() -> PathBuf {
    rundir::default_path()
}

/// Where devices publish by default: [`stats_dir`], or None if `SOFTRDMA_STATS=0`.
pub fn default_dir() -> Option<PathBuf> {
    if std::env::var_os("SOFTRDMA_STATS").is_some_and(|v| v == "0") {
        return None;
    }
    Some(stats_dir())
}

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
        ("rtt_timeouts", e.rtt_timeouts),
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
        ("read_replays", e.read_replays),
        ("read_replays_refused", e.read_replays_refused),
        ("placed_writes", e.placed_writes),
        ("placed_reads", e.placed_reads),
        ("placed_writes_taken", e.placed_writes_taken),
        ("out_of_sequence", e.out_of_sequence),
        ("held", e.held),
        ("sacks_sent", e.sacks_sent),
        ("sacks_rcvd", e.sacks_rcvd),
        ("sack_resends", e.sack_resends),
        ("gsi_dropped", e.gsi_dropped),
        ("gsi_unserved", e.gsi_unserved),
        ("keepalive_probes", e.keepalive_probes),
        ("keepalive_acks", e.keepalive_acks),
        ("peers_lost", e.peers_lost),
        ("udp_tx_datagrams", l.tx_datagrams),
        ("udp_tx_bytes", l.tx_bytes),
        ("udp_tx_dropped", l.tx_dropped),
        ("udp_tx_too_big", l.tx_too_big),
        ("udp_rx_datagrams", l.rx_datagrams),
        ("udp_rx_bytes", l.rx_bytes),
        ("udp_rx_errors", l.rx_errors),
        ("pcap_errors", l.pcap_errors),
        ("udp_tx_gso_messages", s.driver.gso_batches),
        ("udp_rx_gro_segments", s.driver.gro_segments),
        ("shm_tx_datagrams", s.driver.shm_sent_datagrams),
        ("shm_rx_datagrams", s.driver.shm_recv_datagrams),
        ("shm_tx_full", s.driver.shm_full),
        ("shm_tx_held", l.tx_held),
        ("shm_tx_held_expired", l.tx_held_expired),
    ]
}

/// One device's published record.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Record {
    /// Device name.
    pub name: String,
    /// The process that has the device open.
    pub pid: u32,
    /// The UDP address the device is bound to.
    pub addr: String,
    /// GID index 0, as an IPv6 address.
    pub gid: String,
    /// The counters as (key, value), in [`counters`] order.
    pub counters: Vec<(String, u64)>,
    /// The same-host path: "on", or why it is off (empty: not said).
    pub same_host: String,
    /// One line per peer the device has sent to: its address, `ring` or `udp`, and why.
    pub peers: Vec<String>,
}

impl Record {
    /// The record of device `name` of this process, bound to `addr`, with counters `stats`.
    pub fn new(name: &str, addr: SocketAddr, stats: &DeviceStats) -> Record {
        Record {
            name: name.to_string(),
            pid: std::process::id(),
            addr: addr.to_string(),
            gid: Ipv6Addr::from(Gid::from_ip(addr.ip()).0).to_string(),
            counters: counters(stats)
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
            same_host: stats.same_host.clone(),
            peers: stats
                .peers
                .iter()
                .map(|p| {
                    let path = if p.ring { "ring" } else { "udp" };
                    // One line each: a reason never carries a line break into the file.
                    let why = p.why.replace(['\n', '\r'], " ");
                    format!("{} {path} {why}", p.peer)
                })
                .collect(),
        }
    }

    /// The value of counter `key`, if the record has it.
    pub fn counter(&self, key: &str) -> Option<u64> {
        self.counters
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| *v)
    }

    /// Each of [`Record::peers`] as (address, `ring` or `udp`, why).
    pub fn peer_paths(&self) -> impl Iterator<Item = (&str, &str, &str)> + '_ {
        self.peers.iter().map(|p| {
            let mut f = p.splitn(3, ' ');
            (
                f.next().unwrap_or(""),
                f.next().unwrap_or(""),
                f.next().unwrap_or(""),
            )
        })
    }

    /// The record as the text of a stats file.
    pub fn to_text(&self) -> String {
        let mut s = format!(
            "{MAGIC}\nname {}\npid {}\naddr {}\ngid {}\n",
            self.name, self.pid, self.addr, self.gid
        );
        for (k, v) in &self.counters {
            s.push_str(&format!("{k} {v}\n"));
        }
        if !self.same_host.is_empty() {
            s.push_str(&format!("same_host {}\n", self.same_host));
        }
        for p in &self.peers {
            s.push_str(&format!("peer {p}\n"));
        }
        s
    }

    /// Parse the text of a stats file (None if it is not a complete record).
    pub fn parse(text: &str) -> Option<Record> {
        let mut lines = text.lines();
        if lines.next()? != MAGIC {
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
                "same_host" => r.same_host = v.to_string(),
                "peer" => r.peers.push(v.to_string()),
                _ => r.counters.push((k.to_string(), v.parse().ok()?)),
            }
        }
        (!r.name.is_empty()).then_some(r)
    }
}

/// Write `r` to the file `name` of `dir` atomically: a new file under a temporary name
/// nobody can predict, then a rename over `name`.
pub fn publish(dir: &RunDir, name: &str, r: &Record) -> io::Result<()> {
    let tmp = rundir::tmp_name(name);
    let done = dir
        .create_new(&tmp, 0o600)
        .and_then(|mut f| f.write_all(r.to_text().as_bytes()))
        .and_then(|()| dir.rename(&tmp, name));
    if done.is_err() {
        let _ = dir.remove(&tmp);
    }
    done
}

/// Whether process `pid` is alive.
fn alive(pid: u32) -> bool {
    Path::new("/proc").join(pid.to_string()).exists()
}

/// The records of the stats files in `dir`, sorted by name, pid and address; none if the
/// directory does not exist, an error if it is refused ([`RunDir`]). The files of
/// processes that have exited are removed and skipped (a process that died without
/// cleaning up leaves its file behind), unless `include_stale`: then they are listed as
/// they are.
pub fn read_all(dir: &Path, include_stale: bool) -> io::Result<Vec<Record>> {
    let Some(dir) = RunDir::open_existing(dir)? else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for name in dir.files()? {
        if Path::new(&name).extension() != Some(OsStr::new("stats")) || name.starts_with('.') {
            continue;
        }
        let mut text = String::new();
        let Ok(mut f) = dir.open_read(&name) else {
            continue;
        };
        if (&mut f).take(MAX_FILE).read_to_string(&mut text).is_err() {
            continue;
        }
        let Some(r) = Record::parse(&text) else {
            continue;
        };
        if !include_stale && !alive(r.pid) {
            dir.remove_if_same(&name, &f);
            continue;
        }
        out.push(r);
    }
    out.sort_by(|a, b| (&a.name, a.pid, &a.addr).cmp(&(&b.name, b.pid, &b.addr)));
    Ok(out)
}

/// The file name of a new device named `name`: `<name>-<pid>-<n>.stats`, `n` counting the
/// devices this process opened, as one process may open several devices of one name.
fn new_file(name: &str) -> String {
    static OPENED: AtomicU64 = AtomicU64::new(0);
    let n = OPENED.fetch_add(1, Ordering::Relaxed);
    // Names come from configuration files: keep a stray `/` from escaping the directory.
    let safe: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    let safe = safe.trim_start_matches('.');
    format!("{safe}-{}-{n}.stats", std::process::id())
}

/// Publishes a device's record to its stats file from a thread of its own while alive;
/// on drop, stops the thread and removes the file.
pub struct Publisher {
    /// Set to stop the thread; the condition variable cuts its wait short.
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Option<JoinHandle<()>>,
    file: PathBuf,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("file", &self.file)
            .finish()
    }
}

impl Publisher {
    /// Publish `snapshot()` for device `name` to a new file in `dir`, now and then every
    /// [`PERIOD`]. Best effort: None if the thread cannot start; a directory that is
    /// refused or cannot be made is reported once and tried again at each period (it
    /// may be removed or made since), failed writes are retried at the next period.
    pub fn start(
        dir: &Path,
        name: &str,
        mut snapshot: impl FnMut() -> Record + Send + 'static,
    ) -> Option<Publisher> {
        let file = new_file(name);
        let path = dir.join(&file);
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let s = Arc::clone(&stop);
        let dir = dir.to_path_buf();
        let thread = std::thread::Builder::new()
            .name(format!("{name}-stats"))
            .spawn(move || {
                let mut open: Option<RunDir> = None;
                let mut warned = false;
                loop {
                    // Reopened by path if it was removed or replaced: the old descriptor
                    // would write where no reader looks.
                    if !open.as_ref().is_some_and(RunDir::is_current) {
                        open = match RunDir::open(&dir) {
                            Ok(d) => Some(d),
                            Err(e) => {
                                if !std::mem::replace(&mut warned, true) {
                                    tracing::warn!(error = %e, "device counters not published");
                                }
                                None
                            }
                        };
                    }
                    if let Some(d) = &open {
                        let _ = publish(d, &file, &snapshot());
                    }
                    let (m, cv) = &*s;
                    let g = m.lock().unwrap_or_else(PoisonError::into_inner);
                    let (g, _) = cv
                        .wait_timeout_while(g, PERIOD, |stop| !*stop)
                        .unwrap_or_else(PoisonError::into_inner);
                    if *g {
                        break;
                    }
                }
                // Removed here, after the last write, so that it cannot bring the file
                // back.
                if let Some(d) = &open {
                    let _ = d.remove(&file);
                }
            })
            .ok()?;
        Some(Publisher {
            stop,
            thread: Some(thread),
            file: path,
        })
    }

    /// The file this publisher writes.
    pub fn file(&self) -> &Path {
        &self.file
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        let (m, cv) = &*self.stop;
        *m.lock().unwrap_or_else(PoisonError::into_inner) = true;
        cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Record {
        Record {
            name: "softrdma0".into(),
            pid: 42,
            addr: "127.0.0.1:4791".into(),
            gid: "::ffff:127.0.0.1".into(),
            counters: vec![("tx_packets".into(), 7), ("rx_packets".into(), 9)],
            same_host: String::new(),
            peers: Vec::new(),
        }
    }

    #[test]
    fn record_round_trip() {
        let r = sample();
        assert_eq!(Record::parse(&r.to_text()), Some(r.clone()));
        assert_eq!(r.counter("rx_packets"), Some(9));
        assert_eq!(r.counter("nosuch"), None);
        assert!(Record::parse("nonsense").is_none());
        assert!(Record::parse("softrdma-stats 1\npid 3\n").is_none());
        assert!(Record::parse("softrdma-stats 1\nname a\ntx_packets x\n").is_none());
        let with_paths = Record {
            same_host: "on".into(),
            peers: vec![
                "127.0.0.2:4791 ring a device of this host, same user".into(),
                "10.0.0.9:4791 udp not an address of this host".into(),
            ],
            ..sample()
        };
        let text = with_paths.to_text();
        assert!(text.ends_with(
            "same_host on\npeer 127.0.0.2:4791 ring a device of this host, same user\n\
             peer 10.0.0.9:4791 udp not an address of this host\n"
        ));
        assert_eq!(Record::parse(&text), Some(with_paths));
    }

    #[test]
    fn text_format_is_stable() {
        // Other versions of softrdma read these files: the format must not drift.
        assert_eq!(
            sample().to_text(),
            "softrdma-stats 1\nname softrdma0\npid 42\naddr 127.0.0.1:4791\n\
             gid ::ffff:127.0.0.1\ntx_packets 7\nrx_packets 9\n"
        );
    }

    #[test]
    fn record_of_a_device() {
        let mut s = DeviceStats::default();
        s.engine.tx_packets = 5;
        s.link.rx_datagrams = 6;
        let r = Record::new("d", "127.0.0.2:4791".parse().unwrap(), &s);
        assert_eq!(r.pid, std::process::id());
        assert_eq!(r.gid, "::ffff:127.0.0.2");
        assert_eq!(r.counters.len(), counters(&s).len());
        assert_eq!(r.counter("tx_packets"), Some(5));
        assert_eq!(r.counter("udp_rx_datagrams"), Some(6));
    }

    #[test]
    fn file_names_stay_in_the_directory() {
        let a = new_file("../etc/a b");
        let b = new_file("../etc/a b");
        assert_ne!(a, b);
        assert!(!a.contains('/'), "{a}");
        // Not hidden: names starting with a dot are temporary files.
        assert!(a.starts_with("_etc_a_b-"), "{a}");
        assert!(a.ends_with(".stats"), "{a}");
    }

    #[test]
    fn publish_read_and_stale_files() {
        let dir = std::env::temp_dir().join(format!("softrdma-statsfile-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(read_all(&dir, true).unwrap(), vec![]);
        assert!(!dir.exists(), "reading makes no directory");
        let rd = RunDir::open(&dir).unwrap();
        let mine = Record {
            pid: std::process::id(),
            ..sample()
        };
        let file = new_file(&mine.name);
        publish(&rd, &file, &mine).unwrap();
        // No pid is this large (pid_max is at most 2^22), so this process is gone.
        let dead = Record {
            name: "gone".into(),
            pid: u32::MAX,
            ..sample()
        };
        publish(&rd, "gone-x.stats", &dead).unwrap();
        let dead_file = dir.join("gone-x.stats");
        std::fs::write(dir.join("junk.stats"), "not a record").unwrap();
        std::fs::write(dir.join("other.txt"), MAGIC).unwrap();

        let all = read_all(&dir, true).unwrap();
        assert_eq!(all, vec![dead.clone(), mine.clone()]);
        assert!(dead_file.exists());
        assert_eq!(read_all(&dir, false).unwrap(), vec![mine.clone()]);
        assert!(!dead_file.exists(), "stale file tidied");
        // No temporary file is left behind.
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(
            names,
            vec!["junk.stats".to_string(), "other.txt".into(), file.clone()]
        );
        rd.remove(&file).unwrap();
        assert!(read_all(&dir, true).unwrap().is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
