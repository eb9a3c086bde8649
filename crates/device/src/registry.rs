//! The host-local registry of rdma_cm port bindings (DESIGN decision 9).
//!
//! On Linux the kernel holds the port spaces of rdma_cm, so a server that binds
//! `0.0.0.0:7174` is found by a client in any other process. softrdma has no kernel part:
//! every process is its own device on its own 127.0.0.x, so the port spaces live in files
//! instead, one directory per user ([`default_dir`]), and a connecting process finds the
//! device of a listener with [`Registry::lookup`].
//!
//! # Rules (Linux `drivers/infiniband/core/cma.c`)
//!
//! The rules are pure functions in [`crate::ports`], which this store applies to the
//! records it scans under its lock, and which [`crate::ports::PortTable`] applies in
//! memory (the CM's tests). The store adds what needs the host: the files, the owners'
//! liveness, reading `CAP_NET_BIND_SERVICE` and `bindv6only`, and whether a destination
//! is an address of this host.
//!
//! "Any" below is cma.c's `cma_any_addr`: the zero network 0.0.0.0/8 or `::`, *and* the
//! loopback addresses 127.0.0.0/8 and `::1` (`cma_zero_addr || cma_loopback_addr`). Two
//! addresses are "the same" as in `cma_addr_cmp`: same family and address, and for IPv6
//! link-local addresses the same scope id.
//!
//! - **Binding a port** (`cma_use_port` → `cma_check_port(.., reuseaddr)`): the other
//!   bindings on the port in the port space are visited newest first; one whose owner and
//!   the new binding both set REUSEADDR is skipped; one of the other address family is
//!   skipped if both are AFONLY; otherwise, if either address is any, the bind fails with
//!   `EADDRNOTAVAIL`, and if the two addresses are the same, with `EADDRINUSE`. Different
//!   specific addresses share a port. A port below 1024 needs `CAP_NET_BIND_SERVICE`
//!   (`EACCES`), as in `cma_use_port`.
//! - **Port 0** (`cma_alloc_any_port`): ports are tried from a random start in
//!   [`EPHEMERAL_PORTS`] (Linux's default `ip_local_port_range`), upwards with wrap-around,
//!   skipping the port this registry handed out last. A free port is taken; a used one is
//!   shared only if `cma_port_is_unique` holds against every binding on it: each differs
//!   in destination port, or both source addresses are specific and differ, or both
//!   destination addresses are specific and differ (destinations come from
//!   [`BindOptions::dst`]). REUSEADDR and AFONLY play no part. None left: `EADDRNOTAVAIL`.
//! - **Port leases** (softrdma's, not Linux's): a process takes its port-0 ports out of
//!   blocks of free ephemeral ports it leases (16 ports, each further lease held at once
//!   twice the last, up to 256; fewer when no such block is free), the search above run
//!   within a lease over the process's own bindings, onwards from the port the lease
//!   handed out last; only when no lease has room is another taken, and only when no
//!   block is free does the search above run over the whole range. To every other
//!   process each port of a lease is taken, as by a binding of any address of both
//!   families without REUSEADDR, whether or not an id holds it yet: a fixed bind there
//!   fails with `EADDRNOTAVAIL`, where Linux would let a bind share or take a port that
//!   no id holds. The process's own fixed binds see only its bindings. A lease goes when
//!   no binding of the process sits in it any more.
//! - **Listening** (`rdma_listen`): a binding made with REUSEADDR is checked again as by
//!   `cma_check_port` with REUSEADDR off for itself, so every other binding on the port
//!   counts (same errnos); on success it loses REUSEADDR for good, so later binds that
//!   overlap it fail too. A binding without REUSEADDR is not checked again. A binding
//!   made for a peer ([`BindOptions::dst`], an active-side id) cannot listen: `EINVAL`,
//!   as `rdma_listen` refuses an id past the bound state.
//! - **AFONLY** (`rdma_bind_addr`): unless set ([`BindOptions::af_only`]), IPv4 bindings
//!   are AFONLY and IPv6 ones follow `net.ipv6.bindv6only` (0 by default), so `[::]:P`
//!   conflicts with `0.0.0.0:P` unless made AFONLY.
//! - **IPv6 link-local** addresses without a scope id are refused with `EINVAL`
//!   (`cma_check_linklocal`).
//! - **Which listener a connection reaches** (`cma_match_private_data`): a listener on an
//!   any address that is not AFONLY takes destinations of both families; otherwise the
//!   families must match and the listener's address must be any or equal to the
//!   destination. Linux takes the first match; the rules above leave at most one listener
//!   matching a destination, and where hand-made records overlap [`Registry::lookup`]
//!   prefers an exact address, then the zero address, then a loopback one.
//!
//! What the registry does not check, because it belongs to the connection manager: that a
//! specific address is an address of this host (`cma_translate_addr`), and the state rules
//! of `rdma_set_reuseaddr` / `rdma_set_afonly`.
//!
//! # Files
//!
//! The directory ([`default_dir`]: `$SOFTRDMA_CM_DIR`, else `registry` under the user's
//! [`RunDir`]) is created mode 0700 and refused if it is a symbolic link, another user owns
//! it or others may write to it: a record names the device a client will connect to. It
//! is checked once, on its open descriptor, and every file in it is made, opened, renamed
//! and removed relative to that descriptor, never through a symbolic link (DESIGN decision
//! 13), so renaming the directory or planting links cannot redirect a bind or a lookup.
//!
//! - `lock`: the registry-wide lock. Bind and listen take `flock(LOCK_EX)` on it for the
//!   scan and the write, so two processes never both win a port. It also holds
//!   `last_port N`, the port `cma_alloc_any_port` handed out last.
//! - `PPPP-PORT-PID-RANDOM.bind` (port space in hex): one binding, as lines of text:
//!
//!   ```text
//!   softrdma-cm-binding 1
//!   ps 0x0106
//!   addr 0.0.0.0:7174
//!   device 127.0.0.3:4791
//!   dst -
//!   listening 1
//!   reuseaddr 0
//!   afonly 1
//!   seq 12
//!   pid 4242
//!   ```
//!
//!   `dst` is `-` or an address, flags are `0`/`1`, `seq` orders bindings (newest is
//!   highest). Unknown keys are ignored; a file missing a key, with a bad value or a wrong
//!   first line is not a record. A binding on a leased port has no record until it
//!   listens: lookups read listeners from the records.
//! - `PPPP-LOW-HIGH-PID-RANDOM.lease`: a port lease, the ports `LOW..=HIGH`:
//!
//!   ```text
//!   softrdma-cm-lease 1
//!   ps 0x0106
//!   ports 40000-40015
//!   seq 3
//!   pid 4242
//!   ```
//! - `.NAME.tmp`: a record being written; it is renamed over `NAME.bind` whole, so readers
//!   never see half a record.
//!
//! Liveness: the owner holds `flock(LOCK_EX)` on its record for as long as the [`Binding`]
//! lives (on its lease for as long as the lease lives), and the kernel drops the lock when
//! the process dies, however it dies. A scanner probes with `flock(LOCK_SH | LOCK_NB)`: if
//! it gets the lock nobody owns the record, and a bind or listen (which hold the registry
//! lock) removes it, as it removes unlocked files that are not records. Lookups take no
//! lock and only skip such files; they keep the live listener records of other processes
//! they read open, and read one again only once its lock is let go (a changed record is a
//! new file renamed over the old, whose lock then goes).

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV6, UdpSocket};
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rustix::fs::{flock, FlockOperation};
use rustix::io::Errno;

use crate::ports::{self, Bound, Ephemeral, HostFacts};
pub use crate::ports::{BindOptions, PortSpace, EPHEMERAL_PORTS};
use crate::rundir::{self, RunDir};
use crate::sys;

/// Environment variable naming the registry directory, so tests and unusual setups can
/// keep their bindings apart from the user's.
pub const CM_DIR_ENV: &str = "SOFTRDMA_CM_DIR";

/// First line of a record: the format and its version.
const MAGIC: &str = "softrdma-cm-binding 1";
/// First line of a port lease.
const LEASE_MAGIC: &str = "softrdma-cm-lease 1";
/// The ports of a process's first lease in a port space; each further lease it holds at
/// once doubles, up to [`MAX_LEASE`]: a program with one connection holds few ports, one
/// with hundreds takes few leases.
const FIRST_LEASE: u16 = 16;
/// The most ports one lease covers.
const MAX_LEASE: u16 = 256;
/// Name of the registry-wide lock file.
const LOCK_FILE: &str = "lock";
/// A record is a few hundred bytes; anything longer is not one of ours.
const MAX_RECORD: u64 = 4096;
/// How long bind and listen wait for the registry lock before giving up.
const LOCK_TIMEOUT: Duration = Duration::from_secs(10);
/// The capability bit of `CAP_NET_BIND_SERVICE`.
const CAP_NET_BIND_SERVICE: u32 = 10;

/// A listener that a connection to some local address reaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Listener {
    /// The UDP endpoint of the listener's device, where its CM receives requests.
    pub device: SocketAddr,
    /// The address the listener bound (possibly a wildcard).
    pub bound: SocketAddr,
}

/// The directory of the registry: `$SOFTRDMA_CM_DIR`, else `registry` under the user's
/// [`rundir::default_path`].
pub fn default_dir() -> PathBuf {
    if let Some(d) = std::env::var_os(CM_DIR_ENV).filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    rundir::default_path().join("registry")
}

/// A registry directory: where bindings are reserved and listeners looked up.
#[derive(Debug, Clone)]
pub struct Registry {
    dir: Arc<RunDir>,
    key: DirKey,
}

/// A directory as the file system names it (device, inode): the same registry opened
/// twice, or through two paths, is one key.
type DirKey = (u64, u64);

fn dir_key(dir: &RunDir) -> io::Result<DirKey> {
    let st = rustix::fs::fstat(dir)?;
    Ok((st.st_dev, st.st_ino))
}

/// The records this process holds, by directory and file name. A scan or a lookup takes
/// them from here instead of opening, probing and reading each file: their owner is alive
/// (it is this process, which holds their locks) and their contents are what it wrote.
/// A busy client's every bind and lookup used to read all of its own bindings again
/// (cmtime's 100 connections at once: 20,000 file opens).
static OWN: Mutex<BTreeMap<(DirKey, String), Record>> = Mutex::new(BTreeMap::new());

fn own() -> MutexGuard<'static, BTreeMap<(DirKey, String), Record>> {
    OWN.lock().unwrap_or_else(|e| e.into_inner())
}

/// This process's records in the registry `key`, with their names.
fn own_entries(key: DirKey) -> Vec<Entry> {
    own()
        .iter()
        .filter(|((k, _), _)| *k == key)
        .map(|((_, name), rec)| Entry {
            name: name.clone(),
            rec: rec.clone(),
        })
        .collect()
}

/// Other processes' listener records that lookups read, kept open by name. A record's
/// owner changes it only by renaming a new file over it and then closing the old one,
/// which lets the old file's lock go, and removes it while still holding the lock: while
/// the lock of the file read is held, the file is the record and says what it said. So a
/// lookup probes the lock of the file it holds instead of opening and reading the record
/// again (a client's every connection looked its server's listener up, twice).
static SEEN: Mutex<BTreeMap<(DirKey, String), (File, Record)>> = Mutex::new(BTreeMap::new());

fn seen_listeners() -> MutexGuard<'static, BTreeMap<(DirKey, String), (File, Record)>> {
    SEEN.lock().unwrap_or_else(|e| e.into_inner())
}

/// A port space as records and leases write it (`0x` and hex).
fn parse_port_space(v: &str) -> Option<PortSpace> {
    let hex = v.strip_prefix("0x")?;
    PortSpace::from_raw(u32::from_str_radix(hex, 16).ok()?)
}

/// The port leases this process holds (see [`Lease`]). Every bind, listen and flag change
/// of the process decides under this lock, taken before the registry's file lock: a
/// port-0 bind that takes a port from a lease reads no file, so the file lock alone would
/// not keep it from racing a bind of a fixed port in another thread.
static LEASES: Mutex<Vec<Lease>> = Mutex::new(Vec::new());

fn leases() -> MutexGuard<'static, Vec<Lease>> {
    LEASES.lock().unwrap_or_else(|e| e.into_inner())
}

/// A block of ephemeral ports that one process holds in one port space: its `.lease` file,
/// locked for as long as the lease lives, makes every port of the block taken for every
/// other process (as a binding of any address, see [`ports::leased`]), so the process's
/// port-0 binds take ports out of it in memory, with the rules applied to its own
/// bindings, and write nothing. The lease goes (its file removed) when no binding of the
/// process sits in it any more, and with the process, as records do.
struct Lease {
    key: DirKey,
    /// The process that took it: a child forked from it inherits the vector, not the lease.
    pid: u32,
    ps: PortSpace,
    ports: RangeInclusive<u16>,
    /// The port handed out last from this lease, which the next bind skips.
    last: Option<u16>,
    /// The file name.
    name: String,
    dir: Arc<RunDir>,
    /// The open lease file, locked exclusively.
    _file: File,
}

impl Drop for Lease {
    fn drop(&mut self) {
        // Removed while still locked, as a record is; only by the process that took it.
        if self.pid == std::process::id() {
            let _ = self.dir.remove(&self.name);
        }
    }
}

impl Lease {
    fn text(ps: PortSpace, ports: &RangeInclusive<u16>, seq: u64, pid: u32) -> String {
        format!(
            "{LEASE_MAGIC}\nps {:#06x}\nports {}-{}\nseq {seq}\npid {pid}\n",
            ps.raw(),
            ports.start(),
            ports.end()
        )
    }

    /// The port space, ports and seq of the lease in `text`; None unless well-formed.
    fn parse(text: &str) -> Option<(PortSpace, RangeInclusive<u16>, u64)> {
        let mut lines = text.lines();
        if lines.next()? != LEASE_MAGIC {
            return None;
        }
        let (mut ps, mut range, mut seq, mut pid) = (None, None, None, None::<u32>);
        for l in lines {
            let (k, v) = l.split_once(' ')?;
            match k {
                "ps" => ps = Some(parse_port_space(v)?),
                "ports" => {
                    let (lo, hi) = v.split_once('-')?;
                    let (lo, hi): (u16, u16) = (lo.parse().ok()?, hi.parse().ok()?);
                    if lo == 0 || lo > hi {
                        return None;
                    }
                    range = Some(lo..=hi);
                }
                "seq" => seq = Some(v.parse().ok()?),
                "pid" => pid = Some(v.parse().ok()?),
                _ => {}
            }
        }
        pid?;
        Some((ps?, range?, seq?))
    }
}

/// The file names of this process's leases in the registry `key`: a scan skips them
/// (they stand for this process's own bindings, which it knows).
fn own_lease_names(leases: &[Lease], key: DirKey) -> Vec<String> {
    let pid = std::process::id();
    leases
        .iter()
        .filter(|l| l.key == key && l.pid == pid)
        .map(|l| l.name.clone())
        .collect()
}

/// Let go of this process's leases in `key` and `ps` on which none of its bindings sits.
fn release_idle_leases(leases: &mut Vec<Lease>, key: DirKey, ps: PortSpace) {
    let pid = std::process::id();
    let used: Vec<u16> = own()
        .iter()
        .filter(|((k, _), r)| *k == key && r.b.ps == ps)
        .map(|(_, r)| r.b.addr.port())
        .collect();
    leases.retain(|l| {
        l.key != key || l.pid != pid || l.ps != ps || used.iter().any(|p| l.ports.contains(p))
    });
}

impl Registry {
    /// Use `dir` as the registry, creating it (mode 0700) if missing. Refused if it is not
    /// a directory, is a symbolic link, belongs to another user, or others may write to
    /// it: a planted record would send clients to a device of someone else's choosing.
    pub fn open(dir: impl Into<PathBuf>) -> io::Result<Registry> {
        let dir = RunDir::open(&dir.into())?;
        let key = dir_key(&dir)?;
        Ok(Registry {
            dir: Arc::new(dir),
            key,
        })
    }

    /// The registry at [`default_dir`]: the `registry` subdirectory is opened through the
    /// already checked user directory, so neither level can be swapped for another.
    pub fn open_default() -> io::Result<Registry> {
        if std::env::var_os(CM_DIR_ENV).is_some_and(|d| !d.is_empty()) {
            return Registry::open(default_dir());
        }
        let dir = RunDir::open_default()?.subdir("registry")?;
        let key = dir_key(&dir)?;
        Ok(Registry {
            dir: Arc::new(dir),
            key,
        })
    }

    /// The registry's directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Reserve `addr` in `ps` for this process, with the rules of `rdma_bind_addr` (see
    /// the module docs): the IP may be a wildcard, port 0 picks an ephemeral port.
    /// `device` is the UDP endpoint of the owning device's CM, what a lookup returns.
    /// Fails with the errno Linux gives (`EADDRINUSE`, `EADDRNOTAVAIL`, `EACCES`,
    /// `EINVAL`), or with an I/O error of the registry files.
    pub fn bind(
        &self,
        ps: PortSpace,
        addr: SocketAddr,
        device: SocketAddr,
        opts: BindOptions,
    ) -> io::Result<Binding> {
        let host = HostFacts {
            may_bind_service_ports: addr.port() == 0
                || addr.port() >= 1024
                || may_bind_service_ports(),
            bindv6only: addr.is_ipv6() && opts.af_only.is_none() && bindv6only(),
        };
        let mut leases = leases();
        if addr.port() == 0 {
            match self.bind_leased(&mut leases, ps, addr, device, opts, host) {
                Ok(b) => return Ok(b),
                // No block of free ports left: the search below may still share a port
                // (`cma_port_is_unique`).
                Err(e) if Errno::from_io_error(&e) == Some(Errno::ADDRNOTAVAIL) => {}
                Err(e) => return Err(e),
            }
        }
        let mut lock = RegistryLock::acquire(&self.dir)?;
        let live = scan(&self.dir, self.key, &own_lease_names(&leases, self.key))?;
        let bounds: Vec<&Bound> = live.iter().map(|e| &e.rec.b).collect();
        let eph = Ephemeral {
            range: EPHEMERAL_PORTS,
            last: if addr.port() == 0 {
                lock.last_port()
            } else {
                None
            },
            random: sys::random_seed(),
        };
        let b = ports::bind(ps, addr, opts, host, &bounds, eph)?;
        let ephemeral = addr.port() == 0;
        let rec = Record {
            b,
            device,
            pid: std::process::id(),
        };
        let stem = record_stem(&rec);
        let file = write_record(&self.dir, &stem, &rec)?;
        own().insert((self.key, format!("{stem}.bind")), rec.clone());
        if ephemeral {
            // Best effort, like the kernel's static: a lost note only risks handing the
            // port out twice in a row.
            let _ = lock.set_last_port(rec.b.addr.port());
        }
        Ok(Binding {
            dir: Arc::clone(&self.dir),
            key: self.key,
            stem,
            file: Some(file),
            rec,
        })
    }

    /// A port-0 bind out of this process's leases in `ps`, taking another lease when they
    /// are full: no file is written unless a lease is. `EADDRNOTAVAIL` when no block of
    /// free ports is left for a new lease.
    fn bind_leased(
        &self,
        leases: &mut Vec<Lease>,
        ps: PortSpace,
        addr: SocketAddr,
        device: SocketAddr,
        opts: BindOptions,
        host: HostFacts,
    ) -> io::Result<Binding> {
        let pid = std::process::id();
        // Only this process's bindings can sit on its leased ports.
        let own: Vec<Bound> = own()
            .iter()
            .filter(|((k, _), r)| *k == self.key && r.b.ps == ps)
            .map(|(_, r)| r.b.clone())
            .collect();
        let bounds: Vec<&Bound> = own.iter().collect();
        let mut held = 0u32;
        for l in leases
            .iter_mut()
            .filter(|l| l.key == self.key && l.pid == pid && l.ps == ps)
        {
            held += 1;
            // Onwards from the port handed out last, so that a port just released is
            // handed out again only after the rest of the lease, as a search from a random
            // point of the whole range would rarely hit it soon.
            let next = l.last.map_or(0, |p| p - l.ports.start() + 1);
            let eph = Ephemeral {
                range: l.ports.clone(),
                last: l.last,
                random: u64::from(next),
            };
            match ports::bind(ps, addr, opts, host, &bounds, eph) {
                Ok(b) => {
                    l.last = Some(b.addr.port());
                    return Ok(self.leased_binding(b, device));
                }
                Err(e) if e == Errno::ADDRNOTAVAIL => {}
                Err(e) => return Err(e.into()),
            }
        }
        let size = (u32::from(FIRST_LEASE) << held.min(8)).min(u32::from(MAX_LEASE)) as u16;
        let mut lease = self.take_lease(leases, ps, size)?;
        let eph = Ephemeral {
            range: lease.ports.clone(),
            last: None,
            random: sys::random_seed(),
        };
        // The block is free of every binding, this process's too; but the rules may still
        // refuse `addr` (a link-local address without a scope): the lease then goes.
        let b = ports::bind(ps, addr, opts, host, &bounds, eph)?;
        lease.last = Some(b.addr.port());
        leases.push(lease);
        Ok(self.leased_binding(b, device))
    }

    /// A binding on a leased port: known to this process only, until it listens.
    fn leased_binding(&self, b: Bound, device: SocketAddr) -> Binding {
        let rec = Record {
            b,
            device,
            pid: std::process::id(),
        };
        let stem = record_stem(&rec);
        own().insert((self.key, format!("{stem}.bind")), rec.clone());
        Binding {
            dir: Arc::clone(&self.dir),
            key: self.key,
            stem,
            file: None,
            rec,
        }
    }

    /// Take a lease of up to `size` free ports in `ps` (fewer when no block that long is
    /// free), under the registry lock: its file is written before the lock goes, so no
    /// other process can bind a port of the block in between.
    fn take_lease(&self, leases: &[Lease], ps: PortSpace, size: u16) -> io::Result<Lease> {
        let _lock = RegistryLock::acquire(&self.dir)?;
        let live = scan(&self.dir, self.key, &own_lease_names(leases, self.key))?;
        let pid = std::process::id();
        // This process's own leases are blocks taken too.
        let mine: Vec<Bound> = leases
            .iter()
            .filter(|l| l.key == self.key && l.pid == pid && l.ps == ps)
            .flat_map(|l| l.ports.clone().map(|p| ports::leased(ps, p, 0)))
            .collect();
        let bounds: Vec<&Bound> = live.iter().map(|e| &e.rec.b).chain(&mine).collect();
        let random = sys::random_seed();
        let mut size = size;
        let ports = loop {
            if let Some(p) = ports::free_block(ps, EPHEMERAL_PORTS, size, random, &bounds) {
                break p;
            }
            if size == 1 {
                return Err(Errno::ADDRNOTAVAIL.into());
            }
            size /= 2;
        };
        let seq = bounds
            .iter()
            .map(|b| b.seq)
            .max()
            .map_or(0, |s| s.saturating_add(1));
        let stem = format!(
            "{:04x}-{}-{}-{pid}-{:016x}",
            ps.raw(),
            ports.start(),
            ports.end(),
            sys::random_seed()
        );
        let name = format!("{stem}.lease");
        let file = write_file(&self.dir, &stem, &name, &Lease::text(ps, &ports, seq, pid))?;
        Ok(Lease {
            key: self.key,
            pid,
            ps,
            ports,
            last: None,
            name,
            dir: Arc::clone(&self.dir),
            _file: file,
        })
    }

    /// The live listener that a connection to `dst` in `ps` reaches, by the rules of
    /// `cma_match_private_data`; an exact address wins over a wildcard. None if `dst` is
    /// not an address of this host (loopback, unspecified, or one a UDP socket can bind),
    /// or if nothing listens there. Errors reading the registry count as nothing found.
    pub fn lookup(&self, ps: PortSpace, dst: SocketAddr) -> Option<Listener> {
        if dst.port() == 0 || !is_local(dst) {
            return None;
        }
        let names = self.dir.files().ok()?;
        let mut found: Vec<Record> = Vec::new();
        let mut seen = seen_listeners();
        // Records whose names are gone are forgotten (their files closed).
        let listed: std::collections::HashSet<&str> = names.iter().map(String::as_str).collect();
        seen.retain(|(k, n), _| *k != self.key || listed.contains(n.as_str()));
        for name in names {
            if !is_record_name(&name) {
                continue;
            }
            if let Some(rec) = own().get(&(self.key, name.clone())) {
                if ports::reaches(&rec.b, ps, dst) {
                    found.push(rec.clone());
                }
                continue;
            }
            let k = (self.key, name);
            if let Some((f, rec)) = seen.get(&k) {
                if matches!(owned(f), Ok(true)) {
                    if ports::reaches(&rec.b, ps, dst) {
                        found.push(rec.clone());
                    }
                    continue;
                }
                // Its owner let it go: gone, or replaced by a new file of that name.
                seen.remove(&k);
            }
            let Ok(mut f) = self.dir.open_read(&k.1) else {
                continue;
            };
            let Some(rec) = read_record(&mut f) else {
                continue;
            };
            // Only listeners are looked up, and only a live one is kept.
            if !rec.b.listening || !matches!(owned(&f), Ok(true)) {
                continue;
            }
            if ports::reaches(&rec.b, ps, dst) {
                found.push(rec.clone());
            }
            seen.insert(k, (f, rec));
        }
        let best = ports::lookup(found.iter().map(|r| &r.b), ps, dst)?;
        let rec = found.iter().find(|r| std::ptr::eq(&r.b, best))?;
        Some(Listener {
            device: rec.device,
            bound: rec.b.addr,
        })
    }
}

impl Registry {
    /// Whether a listener this process knows to be alive still takes connections to `dst`
    /// in `ps` on the device `device` says yes to: one of its own, or another process's
    /// that a [`Registry::lookup`] read and whose owner still holds it. Reads no directory
    /// (one lock probe per listener kept): for a client that found its listener before
    /// and asks whether it is still served. False says only "not known": look up.
    pub fn listener_known(
        &self,
        ps: PortSpace,
        dst: SocketAddr,
        device: impl Fn(SocketAddr) -> bool,
    ) -> bool {
        let mine = own()
            .iter()
            .any(|((k, _), r)| *k == self.key && ports::reaches(&r.b, ps, dst) && device(r.device));
        if mine {
            return true;
        }
        let mut seen = seen_listeners();
        let mut alive = false;
        seen.retain(|(k, _), (f, r)| {
            if alive || *k != self.key || !ports::reaches(&r.b, ps, dst) || !device(r.device) {
                return true;
            }
            // A probe that got the lock holds it: that file goes now, not at the next
            // lookup.
            alive = matches!(owned(f), Ok(true));
            alive
        });
        alive
    }
}

/// A reserved address and port, held by the CM id that bound it. Dropping it releases the
/// reservation; so does the death of the process.
pub struct Binding {
    dir: Arc<RunDir>,
    key: DirKey,
    /// The record's file name without `.bind`.
    stem: String,
    /// The open record, locked exclusively: the proof that the owner lives. None for a
    /// binding on a leased port that does not listen: the lease stands for it.
    file: Option<File>,
    rec: Record,
}

impl std::fmt::Debug for Binding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Binding")
            .field("ps", &self.rec.b.ps)
            .field("addr", &self.rec.b.addr)
            .field("device", &self.rec.device)
            .field("listening", &self.rec.b.listening)
            .finish()
    }
}

impl Binding {
    /// The bound port (the one picked, for port 0).
    pub fn port(&self) -> u16 {
        self.rec.b.addr.port()
    }
    /// The bound address with its port, as `rdma_get_local_addr` reports it.
    pub fn addr(&self) -> SocketAddr {
        self.rec.b.addr
    }
    /// The owning device's CM endpoint.
    pub fn device(&self) -> SocketAddr {
        self.rec.device
    }
    /// The port space of the binding.
    pub fn port_space(&self) -> PortSpace {
        self.rec.b.ps
    }
    /// Whether lookups find this binding.
    pub fn is_listening(&self) -> bool {
        self.rec.b.listening
    }
    /// Whether the binding shares its port with other REUSEADDR bindings.
    pub fn reuse_addr(&self) -> bool {
        self.rec.b.reuse
    }
    /// Whether the binding ignores bindings of the other address family.
    pub fn af_only(&self) -> bool {
        self.rec.b.afonly
    }

    /// REUSEADDR set on the bound id (`rdma_set_reuseaddr`, which Linux allows after bind
    /// until the id listens): later binds and listens on the port count the new flag;
    /// the binding itself is not checked again, as on Linux. The caller keeps the state
    /// rules (see the module docs).
    pub fn set_reuse_addr(&mut self, on: bool) -> io::Result<()> {
        self.rewrite(|r| r.b.reuse = on)
    }

    /// AFONLY set on the bound id (`rdma_set_afonly`, allowed until the id listens): as
    /// [`Binding::set_reuse_addr`].
    pub fn set_af_only(&mut self, on: bool) -> io::Result<()> {
        self.rewrite(|r| r.b.afonly = on)
    }

    fn rewrite(&mut self, f: impl FnOnce(&mut Record)) -> io::Result<()> {
        let mut rec = self.rec.clone();
        f(&mut rec);
        if rec == self.rec {
            return Ok(());
        }
        let _leases = leases();
        if self.file.is_some() {
            let _lock = RegistryLock::acquire(&self.dir)?;
            self.file = Some(write_record(&self.dir, &self.stem, &rec)?);
        }
        self.note_own(&rec);
        self.rec = rec;
        Ok(())
    }

    /// What [`OWN`] holds for this binding: `rec`, now in its file.
    fn note_own(&self, rec: &Record) {
        own().insert((self.key, format!("{}.bind", self.stem)), rec.clone());
    }

    /// Start or stop listening: only listeners are found by [`Registry::lookup`]. Starting
    /// re-checks a REUSEADDR binding as `rdma_listen` does and may fail with the same
    /// errnos as a bind, leaving the binding as it was; on success the binding stops
    /// sharing its port for good. A binding made for a peer ([`BindOptions::dst`]) cannot
    /// listen (`EINVAL`). Stopping is for a listen that failed further on (Linux returns
    /// the id to the bound state); setting the current state again does nothing.
    pub fn set_listening(&mut self, on: bool) -> io::Result<()> {
        if self.rec.b.listening == on {
            return Ok(());
        }
        if on && self.rec.b.dst.is_some() {
            return Err(Errno::INVAL.into());
        }
        let leases = leases();
        let _lock = RegistryLock::acquire(&self.dir)?;
        let mut rec = self.rec.clone();
        if on {
            // Only a REUSEADDR binding is checked again, so only it needs the others.
            let live = if rec.b.reuse {
                scan(&self.dir, self.key, &own_lease_names(&leases, self.key))?
            } else {
                Vec::new()
            };
            let own = format!("{}.bind", self.stem);
            let others: Vec<&Bound> = live
                .iter()
                .filter(|e| e.name != own)
                .map(|e| &e.rec.b)
                .collect();
            rec.b = ports::listen(&rec.b, &others)?;
        } else {
            rec.b.listening = false;
        }
        // The new record, locked, replaces the old one whole; the old file's lock goes
        // with its descriptor, after the rename. A binding on a leased port gets its
        // record here: other processes look listeners up in the files.
        self.file = Some(write_record(&self.dir, &self.stem, &rec)?);
        self.note_own(&rec);
        self.rec = rec;
        Ok(())
    }
}

impl Drop for Binding {
    fn drop(&mut self) {
        // Removed while still locked, so no scanner takes a half-released record for
        // stale and removes a successor of the same name.
        // Any binding may be the last on a leased port: a fixed bind of this process may
        // sit in one of its leases.
        let mut leases = leases();
        let name = format!("{}.bind", self.stem);
        if self.file.is_some() {
            let _ = self.dir.remove(&name);
        }
        own().remove(&(self.key, name));
        release_idle_leases(&mut leases, self.key, self.rec.b.ps);
    }
}

/// One binding as its file holds it: the rules' view and who owns it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Record {
    b: Bound,
    device: SocketAddr,
    pid: u32,
}

impl Record {
    fn to_text(&self) -> String {
        let b = &self.b;
        let dst = b.dst.map_or_else(|| "-".to_string(), |d| d.to_string());
        format!(
            "{MAGIC}\nps {:#06x}\naddr {}\ndevice {}\ndst {dst}\nlistening {}\nreuseaddr {}\n\
             afonly {}\nseq {}\npid {}\n",
            b.ps.raw(),
            b.addr,
            self.device,
            u8::from(b.listening),
            u8::from(b.reuse),
            u8::from(b.afonly),
            b.seq,
            self.pid,
        )
    }

    /// The record in `text`; None unless it is complete and well-formed.
    fn parse(text: &str) -> Option<Record> {
        let mut lines = text.lines();
        if lines.next()? != MAGIC {
            return None;
        }
        let flag = |v: &str| match v {
            "0" => Some(false),
            "1" => Some(true),
            _ => None,
        };
        let (mut ps, mut addr, mut device, mut dst) = (None, None, None, None);
        let (mut listening, mut reuse, mut afonly, mut seq, mut pid) =
            (None, None, None, None, None);
        for l in lines {
            let (k, v) = l.split_once(' ')?;
            match k {
                "ps" => ps = Some(parse_port_space(v)?),
                "addr" => addr = Some(v.parse::<SocketAddr>().ok()?),
                "device" => device = Some(v.parse::<SocketAddr>().ok()?),
                "dst" => {
                    dst = Some(match v {
                        "-" => None,
                        _ => Some(v.parse::<SocketAddr>().ok()?),
                    })
                }
                "listening" => listening = Some(flag(v)?),
                "reuseaddr" => reuse = Some(flag(v)?),
                "afonly" => afonly = Some(flag(v)?),
                "seq" => seq = Some(v.parse().ok()?),
                "pid" => pid = Some(v.parse().ok()?),
                _ => {}
            }
        }
        let addr: SocketAddr = addr?;
        if addr.port() == 0 {
            return None;
        }
        Some(Record {
            b: Bound {
                ps: ps?,
                addr,
                dst: dst?,
                listening: listening?,
                reuse: reuse?,
                afonly: afonly?,
                seq: seq?,
            },
            device: device?,
            pid: pid?,
        })
    }
}

/// A live record found by a scan, with its file name.
#[derive(Debug)]
struct Entry {
    name: String,
    rec: Record,
}

/// The registry-wide lock, held while alive.
struct RegistryLock {
    file: File,
}

impl RegistryLock {
    /// Take the lock, waiting at most [`LOCK_TIMEOUT`] (a process stopped while holding
    /// it must not hang every other one forever).
    fn acquire(dir: &RunDir) -> io::Result<RegistryLock> {
        let file = dir.open_rw(LOCK_FILE, 0o600)?;
        let deadline = Instant::now() + LOCK_TIMEOUT;
        let mut pause = Duration::from_micros(50);
        loop {
            match flock(&file, FlockOperation::NonBlockingLockExclusive) {
                Ok(()) => return Ok(RegistryLock { file }),
                Err(e) if e == Errno::WOULDBLOCK || e == Errno::INTR => {}
                Err(e) => return Err(e.into()),
            }
            if Instant::now() >= deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("{}: registry lock held too long", dir.path().display()),
                ));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(5));
        }
    }

    /// The port `cma_alloc_any_port` handed out last, if noted.
    fn last_port(&mut self) -> Option<u16> {
        let mut s = String::new();
        self.file.seek(SeekFrom::Start(0)).ok()?;
        (&mut self.file)
            .take(MAX_RECORD)
            .read_to_string(&mut s)
            .ok()?;
        s.lines()
            .find_map(|l| l.strip_prefix("last_port "))
            .and_then(|v| v.trim().parse().ok())
    }

    fn set_last_port(&mut self, port: u16) -> io::Result<()> {
        // Five digits, so that the note always has one length and is rewritten in place:
        // truncating the file first cost a journal commit on ext4, a third of a bind.
        let note = format!("last_port {port:05}\n");
        if self.file.metadata()?.len() != note.len() as u64 {
            self.file.set_len(0)?;
        }
        self.file.seek(SeekFrom::Start(0))?;
        self.file.write_all(note.as_bytes())
    }
}

fn is_record_name(name: &str) -> bool {
    name.ends_with(".bind") && !name.starts_with('.')
}

fn is_lease_name(name: &str) -> bool {
    name.ends_with(".lease") && !name.starts_with('.')
}

fn is_tmp_name(name: &str) -> bool {
    name.starts_with('.') && name.ends_with(".tmp")
}

/// Whether the record open as `f` has a living owner: true if its exclusive lock is
/// held. Probing with a shared lock keeps concurrent probes from mistaking each other for
/// owners.
fn owned(f: &File) -> io::Result<bool> {
    match flock(f, FlockOperation::NonBlockingLockShared) {
        Ok(()) => Ok(false),
        Err(e) if e == Errno::WOULDBLOCK => Ok(true),
        Err(e) => Err(e.into()),
    }
}

fn read_record(f: &mut File) -> Option<Record> {
    let mut s = String::new();
    f.take(MAX_RECORD).read_to_string(&mut s).ok()?;
    Record::parse(&s)
}

/// The live records of the registry (`key` names it in [`OWN`]), this process's first, and
/// every port of other processes' leases as a binding ([`ports::leased`]); removes records,
/// leases and other files that nobody holds. `own_leases` are this process's leases,
/// skipped: its bindings on their ports are among its records. Only under the registry
/// lock: an unlocked file is then certainly abandoned.
fn scan(dir: &RunDir, key: DirKey, own_leases: &[String]) -> io::Result<Vec<Entry>> {
    let mut out = own_entries(key);
    let mine = out.len();
    for name in dir.files()? {
        let record = is_record_name(&name);
        let lease = is_lease_name(&name);
        if !record && !lease && !is_tmp_name(&name) {
            continue;
        }
        if (lease && own_leases.contains(&name))
            || (record && out[..mine].iter().any(|e| e.name == name))
        {
            continue;
        }
        let Ok(mut f) = dir.open_read(&name) else {
            continue;
        };
        match owned(&f) {
            Ok(true) => {}
            Ok(false) => {
                dir.remove_if_same(&name, &f);
                continue;
            }
            Err(_) => continue,
        }
        // A live file that does not parse is someone else's business: skipped.
        if record {
            if let Some(rec) = read_record(&mut f) {
                out.push(Entry { name, rec });
            }
        } else if lease {
            let mut text = String::new();
            if f.take(MAX_RECORD).read_to_string(&mut text).is_err() {
                continue;
            }
            let Some((ps, ports, seq)) = Lease::parse(&text) else {
                continue;
            };
            for p in ports {
                out.push(Entry {
                    name: name.clone(),
                    rec: Record {
                        b: ports::leased(ps, p, seq),
                        device: SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0),
                        pid: 0,
                    },
                });
            }
        }
    }
    Ok(out)
}

/// The file name of `rec` without `.bind`: port space, port, owner and a random part.
fn record_stem(rec: &Record) -> String {
    format!(
        "{:04x}-{}-{}-{:016x}",
        rec.b.ps.raw(),
        rec.b.addr.port(),
        rec.pid,
        sys::random_seed()
    )
}

/// Write `rec` to `.stem.tmp`, lock it, and rename it to `stem.bind`. Returns the open,
/// locked file. Only under the registry lock: a scan would remove an unlocked
/// temporary file.
fn write_record(dir: &RunDir, stem: &str, rec: &Record) -> io::Result<File> {
    write_file(dir, stem, &format!("{stem}.bind"), &rec.to_text())
}

/// Write `text` to `.stem.tmp`, lock it, and rename it to `name`, as [`write_record`].
fn write_file(dir: &RunDir, stem: &str, name: &str, text: &str) -> io::Result<File> {
    // `stem` ends in a random number, so the temporary name is not predictable either.
    let tmp = format!(".{stem}.tmp");
    let mut f = dir.create_new(&tmp, 0o600)?;
    let done = flock(&f, FlockOperation::NonBlockingLockExclusive)
        .map_err(io::Error::from)
        .and_then(|()| f.write_all(text.as_bytes()))
        .and_then(|()| dir.rename(&tmp, name));
    match done {
        Ok(()) => Ok(f),
        Err(e) => {
            let _ = dir.remove(&tmp);
            Err(e)
        }
    }
}

/// Whether `dst` is an address of this host: loopback, unspecified (which reaches this
/// host), or one a UDP socket can bind.
fn is_local(dst: SocketAddr) -> bool {
    let ip = dst.ip().to_canonical();
    if ip.is_loopback() || ip.is_unspecified() {
        return true;
    }
    if ip.is_multicast() || ip == IpAddr::V4(Ipv4Addr::BROADCAST) {
        return false;
    }
    let probe = match (ip, dst) {
        (IpAddr::V6(a), SocketAddr::V6(d)) => {
            SocketAddr::V6(SocketAddrV6::new(a, 0, 0, d.scope_id()))
        }
        _ => SocketAddr::new(ip, 0),
    };
    UdpSocket::bind(probe).is_ok()
}

/// `net.ipv6.bindv6only`, the default AFONLY of IPv6 ids (0 if unreadable, its default).
fn bindv6only() -> bool {
    fs::read_to_string("/proc/sys/net/ipv6/bindv6only").is_ok_and(|s| s.trim() == "1")
}

/// Whether this process may bind ports below 1024. Unknown counts as yes: the registry
/// should not refuse what the kernel might allow.
fn may_bind_service_ports() -> bool {
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| status_allows_bind_service(&s))
        .unwrap_or(true)
}

/// `CAP_NET_BIND_SERVICE` in the `CapEff` line of a `/proc/PID/status` text.
fn status_allows_bind_service(status: &str) -> Option<bool> {
    let hex = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))?
        .trim();
    let caps = u64::from_str_radix(hex, 16).ok()?;
    Some(caps & (1 << CAP_NET_BIND_SERVICE) != 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader};
    use std::os::unix::fs::MetadataExt;
    use std::process::{Command, Stdio};
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::{Arc, Barrier};

    /// A fresh registry directory per test, removed afterwards.
    struct TempReg {
        reg: Registry,
    }

    impl TempReg {
        fn new(name: &str) -> TempReg {
            static N: AtomicU32 = AtomicU32::new(0);
            let dir = std::env::temp_dir().join(format!(
                "softrdma-registry-{}-{}-{name}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = fs::remove_dir_all(&dir);
            TempReg {
                reg: Registry::open(&dir).unwrap(),
            }
        }
        /// The ports of the leases in the directory.
        fn lease_ports(&self) -> Vec<u16> {
            self.files()
                .iter()
                .filter(|n| is_lease_name(n))
                .flat_map(|n| {
                    let text = fs::read_to_string(self.reg.dir().join(n)).unwrap();
                    Lease::parse(&text).unwrap().1
                })
                .collect()
        }
        fn files(&self) -> Vec<String> {
            let mut v: Vec<String> = fs::read_dir(self.reg.dir())
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .filter(|n| n != LOCK_FILE)
                .collect();
            v.sort();
            v
        }
    }

    impl Drop for TempReg {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(self.reg.dir());
        }
    }

    fn sa(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    const DEV: &str = "127.0.0.2:4791";
    const TCP: PortSpace = PortSpace::Tcp;

    fn bind(r: &Registry, addr: &str) -> io::Result<Binding> {
        r.bind(TCP, sa(addr), sa(DEV), BindOptions::default())
    }

    fn bind_reuse(r: &Registry, addr: &str) -> io::Result<Binding> {
        let opts = BindOptions {
            reuse_addr: true,
            ..BindOptions::default()
        };
        r.bind(TCP, sa(addr), sa(DEV), opts)
    }

    fn errno(r: io::Result<impl std::fmt::Debug>) -> Errno {
        let e = r.expect_err("expected a failure");
        Errno::from_io_error(&e).unwrap_or_else(|| panic!("not an errno: {e}"))
    }

    fn rec(addr: &str) -> Record {
        Record {
            b: Bound {
                ps: TCP,
                addr: sa(addr),
                dst: None,
                listening: false,
                reuse: false,
                afonly: sa(addr).is_ipv4(),
                seq: 0,
            },
            device: sa(DEV),
            pid: 1,
        }
    }

    #[test]
    fn record_text_round_trip_and_bad_records() {
        let mut r = rec("[fe80::1%3]:7174");
        r.b.dst = Some(sa("10.0.0.9:5000"));
        r.b.listening = true;
        r.b.seq = 12;
        assert_eq!(Record::parse(&r.to_text()), Some(r.clone()));
        let r = rec("0.0.0.0:7174");
        let text = r.to_text();
        assert_eq!(
            text,
            "softrdma-cm-binding 1\nps 0x0106\naddr 0.0.0.0:7174\ndevice 127.0.0.2:4791\n\
             dst -\nlistening 0\nreuseaddr 0\nafonly 1\nseq 0\npid 1\n"
        );
        // Unknown keys are ignored.
        assert_eq!(Record::parse(&format!("{text}later 5\n")), Some(r));
        for bad in [
            "",
            "nonsense",
            &text.replace("binding 1", "binding 2"),
            &text.replace("ps 0x0106", "ps 0x0107"),
            &text.replace("ps 0x0106", "ps 262"),
            &text.replace(":7174", ":0"),
            &text.replace("listening 0", "listening yes"),
            &text.replace("pid 1\n", ""),
            &text.replace("device 127.0.0.2:4791", "device 127.0.0.2"),
            &text.replace("dst -", "dst"),
            &text.replace("seq 0", "seq -1"),
        ] {
            assert_eq!(Record::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn capability_line() {
        let st = |caps: &str| format!("Name:\tx\nCapInh:\t0\nCapEff:\t{caps}\nCapBnd:\t0\n");
        assert_eq!(
            status_allows_bind_service(&st("000001fffeffffff")),
            Some(true)
        );
        assert_eq!(
            status_allows_bind_service(&st("0000000000000400")),
            Some(true)
        );
        assert_eq!(
            status_allows_bind_service(&st("0000000000000000")),
            Some(false)
        );
        assert_eq!(status_allows_bind_service(&st("zz")), None);
        assert_eq!(status_allows_bind_service("Name:\tx\n"), None);
    }

    #[test]
    fn low_ports_need_the_capability() {
        let t = TempReg::new("lowport");
        let r = bind(&t.reg, "0.0.0.0:1000");
        if may_bind_service_ports() {
            assert!(r.is_ok());
        } else {
            assert_eq!(errno(r), Errno::ACCESS);
        }
    }

    #[test]
    fn same_specific_address_twice_is_in_use() {
        let t = TempReg::new("inuse");
        let _a = bind(&t.reg, "192.0.2.1:7174").unwrap();
        assert_eq!(errno(bind(&t.reg, "192.0.2.1:7174")), Errno::ADDRINUSE);
        let _b = bind(&t.reg, "[2001:db8::1]:7174").unwrap();
        assert_eq!(errno(bind(&t.reg, "[2001:db8::1]:7174")), Errno::ADDRINUSE);
        // Another specific address, another port, another port space: all fine.
        let _c = bind(&t.reg, "192.0.2.2:7174").unwrap();
        let _d = bind(&t.reg, "192.0.2.1:7175").unwrap();
        let _e = t
            .reg
            .bind(
                PortSpace::Udp,
                sa("192.0.2.1:7174"),
                sa(DEV),
                BindOptions::default(),
            )
            .unwrap();
    }

    #[test]
    fn wildcards_and_loopback_conflict_as_not_available() {
        let t = TempReg::new("notavail");
        let _a = bind(&t.reg, "192.0.2.1:7174").unwrap();
        assert_eq!(errno(bind(&t.reg, "0.0.0.0:7174")), Errno::ADDRNOTAVAIL);
        let _b = bind(&t.reg, "0.0.0.0:7175").unwrap();
        assert_eq!(errno(bind(&t.reg, "192.0.2.1:7175")), Errno::ADDRNOTAVAIL);
        assert_eq!(errno(bind(&t.reg, "0.0.0.0:7175")), Errno::ADDRNOTAVAIL);
        // Loopback is "any" to cma.c, even twice the same address.
        let _c = bind(&t.reg, "127.0.0.1:7176").unwrap();
        assert_eq!(errno(bind(&t.reg, "127.0.0.1:7176")), Errno::ADDRNOTAVAIL);
        assert_eq!(errno(bind(&t.reg, "127.0.0.9:7176")), Errno::ADDRNOTAVAIL);
        assert_eq!(errno(bind(&t.reg, "192.0.2.1:7176")), Errno::ADDRNOTAVAIL);
    }

    #[test]
    fn afonly_separates_families() {
        let t = TempReg::new("afonly");
        let _v4 = bind(&t.reg, "0.0.0.0:7174").unwrap();
        let v6 = |af_only| {
            let opts = BindOptions {
                af_only,
                ..BindOptions::default()
            };
            t.reg.bind(TCP, sa("[::]:7174"), sa(DEV), opts)
        };
        assert_eq!(errno(v6(Some(false))), Errno::ADDRNOTAVAIL);
        // The default follows net.ipv6.bindv6only.
        match v6(None) {
            Ok(b) => {
                assert!(bindv6only());
                drop(b);
            }
            Err(e) => {
                assert!(!bindv6only());
                assert_eq!(Errno::from_io_error(&e), Some(Errno::ADDRNOTAVAIL));
            }
        }
        let _b = v6(Some(true)).unwrap();
        // An IPv4 binding that is not AFONLY meets the AFONLY IPv6 one.
        let opts = BindOptions {
            af_only: Some(false),
            ..BindOptions::default()
        };
        let r = t.reg.bind(TCP, sa("192.0.2.1:7174"), sa(DEV), opts);
        assert_eq!(errno(r), Errno::ADDRNOTAVAIL);
    }

    #[test]
    fn link_local_needs_a_scope() {
        let t = TempReg::new("linklocal");
        assert_eq!(errno(bind(&t.reg, "[fe80::1]:7174")), Errno::INVAL);
        let _a = bind(&t.reg, "[fe80::1%1]:7174").unwrap();
        let _b = bind(&t.reg, "[fe80::1%2]:7174").unwrap();
        assert_eq!(errno(bind(&t.reg, "[fe80::1%2]:7174")), Errno::ADDRINUSE);
    }

    #[test]
    fn port_zero_gives_distinct_ephemeral_ports() {
        let t = TempReg::new("ephemeral");
        let mut held = Vec::new();
        let mut ports = std::collections::HashSet::new();
        for i in 0..200 {
            let addr = if i % 2 == 0 {
                "0.0.0.0:0"
            } else {
                "127.0.0.1:0"
            };
            let b = bind(&t.reg, addr).unwrap();
            assert!(EPHEMERAL_PORTS.contains(&b.port()), "{}", b.port());
            assert_eq!(b.addr().port(), b.port());
            assert!(ports.insert(b.port()), "port {} twice", b.port());
            held.push(b);
        }
        // A fixed bind on a port handed out conflicts like any other.
        let p = held[0].port();
        assert_eq!(
            errno(bind(&t.reg, &format!("192.0.2.1:{p}"))),
            Errno::ADDRNOTAVAIL
        );
        // The port handed out last is not handed out again at once.
        let last = held.pop().unwrap();
        let lp = last.port();
        drop(last);
        for _ in 0..20 {
            let b = bind(&t.reg, "0.0.0.0:0").unwrap();
            assert_ne!(b.port(), lp);
        }
    }

    #[test]
    fn reuseaddr_shares_until_listening() {
        let t = TempReg::new("reuse");
        // Both must ask for it.
        let _plain = bind(&t.reg, "192.0.2.1:7000").unwrap();
        assert_eq!(
            errno(bind_reuse(&t.reg, "192.0.2.1:7000")),
            Errno::ADDRINUSE
        );
        let _r = bind_reuse(&t.reg, "192.0.2.1:7001").unwrap();
        assert_eq!(errno(bind(&t.reg, "192.0.2.1:7001")), Errno::ADDRINUSE);

        // Two REUSEADDR bindings share; listening on one re-checks without reuse.
        let mut a = bind_reuse(&t.reg, "192.0.2.1:7002").unwrap();
        let b = bind_reuse(&t.reg, "192.0.2.1:7002").unwrap();
        assert_eq!(errno(a.set_listening(true)), Errno::ADDRINUSE);
        assert!(!a.is_listening());
        drop(b);
        a.set_listening(true).unwrap();
        assert!(a.is_listening());
        // A listener no longer shares, REUSEADDR or not, and keeps that after stopping.
        assert_eq!(
            errno(bind_reuse(&t.reg, "192.0.2.1:7002")),
            Errno::ADDRINUSE
        );
        a.set_listening(false).unwrap();
        assert_eq!(
            errno(bind_reuse(&t.reg, "192.0.2.1:7002")),
            Errno::ADDRINUSE
        );

        // Wildcards with REUSEADDR share too, and listening then finds EADDRNOTAVAIL.
        let mut w1 = bind_reuse(&t.reg, "0.0.0.0:7003").unwrap();
        let w2 = bind_reuse(&t.reg, "0.0.0.0:7003").unwrap();
        let _s = bind_reuse(&t.reg, "192.0.2.1:7003").unwrap();
        assert_eq!(errno(w1.set_listening(true)), Errno::ADDRNOTAVAIL);
        drop(w2);
        assert_eq!(errno(w1.set_listening(true)), Errno::ADDRNOTAVAIL);
    }

    #[test]
    fn reuseaddr_and_afonly_set_after_bind_count_for_later_binds() {
        let t = TempReg::new("late");
        let mut a = bind(&t.reg, "192.0.2.1:7010").unwrap();
        assert_eq!(
            errno(bind_reuse(&t.reg, "192.0.2.1:7010")),
            Errno::ADDRINUSE
        );
        a.set_reuse_addr(true).unwrap();
        assert!(a.reuse_addr());
        let b = bind_reuse(&t.reg, "192.0.2.1:7010").unwrap();
        // And rdma_listen's re-check sees the other REUSEADDR binding.
        assert_eq!(errno(a.set_listening(true)), Errno::ADDRINUSE);
        drop(b);

        // An IPv6 wildcard that is not AFONLY takes the IPv4 port too, until it is.
        let opts = BindOptions {
            af_only: Some(false),
            ..BindOptions::default()
        };
        let mut v6 = t.reg.bind(TCP, sa("[::]:7011"), sa(DEV), opts).unwrap();
        assert_eq!(errno(bind(&t.reg, "0.0.0.0:7011")), Errno::ADDRNOTAVAIL);
        v6.set_af_only(true).unwrap();
        assert!(v6.af_only());
        let _v4 = bind(&t.reg, "0.0.0.0:7011").unwrap();
    }

    #[test]
    fn listening_without_reuse_is_not_checked_again() {
        let t = TempReg::new("listen");
        let mut a = bind(&t.reg, "0.0.0.0:7174").unwrap();
        a.set_listening(true).unwrap();
        a.set_listening(true).unwrap();
        assert!(a.is_listening());
        assert_eq!(errno(bind(&t.reg, "0.0.0.0:7174")), Errno::ADDRNOTAVAIL);
    }

    #[test]
    fn an_active_side_binding_cannot_listen() {
        let t = TempReg::new("active");
        let opts = BindOptions {
            dst: Some(sa("192.0.2.9:7174")),
            ..BindOptions::default()
        };
        let mut a = t.reg.bind(TCP, sa("0.0.0.0:0"), sa(DEV), opts).unwrap();
        assert_eq!(errno(a.set_listening(true)), Errno::INVAL);
        assert!(!a.is_listening());
    }

    #[test]
    fn drop_releases_the_port() {
        let t = TempReg::new("drop");
        let a = bind(&t.reg, "192.0.2.1:7174").unwrap();
        assert_eq!(t.files().len(), 1);
        drop(a);
        assert!(t.files().is_empty(), "{:?}", t.files());
        let _b = bind(&t.reg, "192.0.2.1:7174").unwrap();
    }

    /// A record file at `name` in the registry, as a process would have left it.
    fn plant(t: &TempReg, name: &str, r: &Record) -> PathBuf {
        let p = t.reg.dir().join(name);
        fs::write(&p, r.to_text()).unwrap();
        p
    }

    /// Hold the planted record as a living owner would: its own open file description
    /// with the exclusive lock.
    fn hold(p: &Path) -> File {
        let f = File::open(p).unwrap();
        flock(&f, FlockOperation::NonBlockingLockExclusive).unwrap();
        f
    }

    #[test]
    fn stale_and_foreign_files_are_reclaimed() {
        let t = TempReg::new("stale");
        let mut r = rec("0.0.0.0:7174");
        r.b.listening = true;
        r.b.seq = 99;
        let stale = plant(&t, "0106-7174-1-0.bind", &r);
        fs::write(t.reg.dir().join("junk.bind"), b"\xff\xfe not a record").unwrap();
        fs::write(t.reg.dir().join(".0106-7-1-0.tmp"), r.to_text()).unwrap();
        fs::write(t.reg.dir().join("notes.txt"), "left alone").unwrap();
        // A corrupt file that someone holds is skipped, not removed.
        let held = t.reg.dir().join("held.bind");
        fs::write(&held, "softrdma-cm-binding 1\nps garbage\n").unwrap();
        let _h = hold(&held);

        // Nobody holds the stale record's lock: lookups ignore it...
        assert_eq!(t.reg.lookup(TCP, sa("127.0.0.1:7174")), None);
        assert!(stale.exists());
        // ...and the next bind clears it away and takes the port.
        let b = bind(&t.reg, "0.0.0.0:7174").unwrap();
        assert!(!stale.exists());
        let mut files = t.files();
        files.retain(|n| !n.starts_with("0106-7174-"));
        assert_eq!(files, vec!["held.bind".to_string(), "notes.txt".into()]);
        // seq continues from live records only.
        assert_eq!(b.rec.b.seq, 0);
    }

    #[test]
    fn a_live_planted_record_counts() {
        let t = TempReg::new("planted");
        let p = plant(&t, "0106-7174-1-0.bind", &rec("192.0.2.1:7174"));
        let f = hold(&p);
        assert_eq!(errno(bind(&t.reg, "192.0.2.1:7174")), Errno::ADDRINUSE);
        drop(f);
        let _b = bind(&t.reg, "192.0.2.1:7174").unwrap();
        assert!(!p.exists());
    }

    #[test]
    fn last_port_note_is_rewritten_in_place() {
        let t = TempReg::new("lastport");
        let path = t.reg.dir().join(LOCK_FILE);
        // A note of another length (an older writer, or junk) is replaced whole.
        fs::write(&path, "last_port 7\nsomething else\n").unwrap();
        let mut l = RegistryLock::acquire(&t.reg.dir).unwrap();
        assert_eq!(l.last_port(), Some(7));
        l.set_last_port(1024).unwrap();
        assert_eq!(l.last_port(), Some(1024));
        l.set_last_port(60999).unwrap();
        assert_eq!(l.last_port(), Some(60999));
        drop(l);
        assert_eq!(fs::read_to_string(&path).unwrap(), "last_port 60999\n");
    }

    #[test]
    fn own_bindings_are_known_without_their_files() {
        // This process's bindings come from memory, not from rereading its own files: a
        // record file rewritten behind the registry's back changes what other processes
        // read, not what this one knows it holds. Another registry of the same directory
        // in this process knows them too.
        let t = TempReg::new("own");
        let dev = sa("127.0.0.3:4791");
        let mut l = t
            .reg
            .bind(TCP, sa("0.0.0.0:7300"), dev, BindOptions::default())
            .unwrap();
        l.set_listening(true).unwrap();
        let file = t
            .files()
            .into_iter()
            .find(|n| n.ends_with(".bind"))
            .unwrap();
        let path = t.reg.dir().join(&file);
        let text = fs::read_to_string(&path).unwrap();
        fs::write(&path, text.replace("listening 1", "listening 0")).unwrap();
        let again = Registry::open(t.reg.dir()).unwrap();
        for r in [&t.reg, &again] {
            assert_eq!(
                r.lookup(TCP, sa("127.0.0.1:7300")).map(|x| x.device),
                Some(dev)
            );
            assert_eq!(errno(bind(r, "0.0.0.0:7300")), Errno::ADDRNOTAVAIL);
        }
        drop(l);
        assert_eq!(again.lookup(TCP, sa("127.0.0.1:7300")), None);
        assert!(bind(&again, "0.0.0.0:7300").is_ok());
    }

    #[test]
    fn lookup_finds_listeners() {
        let t = TempReg::new("lookup");
        let dev = sa("127.0.0.3:4791");
        let mut l = t
            .reg
            .bind(TCP, sa("0.0.0.0:7174"), dev, BindOptions::default())
            .unwrap();
        // Not listening yet: nothing to find.
        assert_eq!(t.reg.lookup(TCP, sa("127.0.0.1:7174")), None);
        l.set_listening(true).unwrap();
        let want = Some(Listener {
            device: dev,
            bound: sa("0.0.0.0:7174"),
        });
        assert_eq!(t.reg.lookup(TCP, sa("127.0.0.1:7174")), want);
        assert_eq!(t.reg.lookup(TCP, sa("127.0.0.5:7174")), want);
        // Another port, another port space, another family (AFONLY IPv4): nothing.
        assert_eq!(t.reg.lookup(TCP, sa("127.0.0.1:7175")), None);
        assert_eq!(t.reg.lookup(PortSpace::Udp, sa("127.0.0.1:7174")), None);
        assert_eq!(t.reg.lookup(TCP, sa("[::1]:7174")), None);
        // Not an address of this host (TEST-NET-1), unless someone configured it.
        if UdpSocket::bind("192.0.2.1:0").is_err() {
            assert_eq!(t.reg.lookup(TCP, sa("192.0.2.1:7174")), None);
        }
        assert_eq!(t.reg.lookup(TCP, sa("224.0.0.1:7174")), None);
        l.set_listening(false).unwrap();
        assert_eq!(t.reg.lookup(TCP, sa("127.0.0.1:7174")), None);
        l.set_listening(true).unwrap();
        drop(l);
        assert_eq!(t.reg.lookup(TCP, sa("127.0.0.1:7174")), None);
    }

    #[test]
    fn another_process_listener_is_read_once_while_its_owner_holds_it() {
        let t = TempReg::new("seen");
        let mut r = rec("0.0.0.0:7180");
        r.b.listening = true;
        r.device = sa("127.0.0.8:4791");
        let name = "0106-7180-1-0.bind";
        let p = plant(&t, name, &r);
        let owner = hold(&p);
        let at = |d: &str| t.reg.lookup(TCP, sa(d)).map(|l| l.device);
        assert_eq!(at("127.0.0.1:7180"), Some(sa("127.0.0.8:4791")));
        // Written over in place behind its owner's back (no owner does that): the record
        // read before stands while the owner holds the file.
        let mut other = r.clone();
        other.device = sa("127.0.0.9:4791");
        fs::write(&p, other.to_text()).unwrap();
        assert_eq!(at("127.0.0.1:7180"), Some(sa("127.0.0.8:4791")));
        // The owner's way: a new file renamed over the name, then the old one closed.
        let tmp = t.reg.dir().join(".new.tmp");
        fs::write(&tmp, other.to_text()).unwrap();
        let new_owner = hold(&tmp);
        fs::rename(&tmp, &p).unwrap();
        drop(owner);
        assert_eq!(at("127.0.0.1:7180"), Some(sa("127.0.0.9:4791")));
        // Not listening any more, by the same way.
        other.b.listening = false;
        let tmp = t.reg.dir().join(".new2.tmp");
        fs::write(&tmp, other.to_text()).unwrap();
        let last_owner = hold(&tmp);
        fs::rename(&tmp, &p).unwrap();
        drop(new_owner);
        assert_eq!(at("127.0.0.1:7180"), None);
        // Removed, and its owner gone: nothing, and nothing kept open.
        drop(last_owner);
        fs::remove_file(&p).unwrap();
        assert_eq!(at("127.0.0.1:7180"), None);
        assert!(!seen_listeners().keys().any(|(k, _)| *k == t.reg.key));
    }

    #[test]
    fn a_listener_read_before_is_known_while_its_owner_holds_it() {
        let t = TempReg::new("known");
        let mut r = rec("0.0.0.0:7181");
        r.b.listening = true;
        r.device = sa("127.0.0.8:4791");
        let p = plant(&t, "0106-7181-1-0.bind", &r);
        let owner = hold(&p);
        let dev = |d: SocketAddr| d == sa("127.0.0.8:4791");
        let dst = sa("127.0.0.1:7181");
        // Not read yet: not known (a lookup would find it).
        assert!(!t.reg.listener_known(TCP, dst, dev));
        assert!(t.reg.lookup(TCP, dst).is_some());
        assert!(t.reg.listener_known(TCP, dst, dev));
        // Another device, port or port space: not this listener.
        assert!(!t
            .reg
            .listener_known(TCP, dst, |d| d == sa("127.0.0.9:4791")));
        assert!(!t.reg.listener_known(TCP, sa("127.0.0.1:7182"), dev));
        assert!(!t.reg.listener_known(PortSpace::Udp, dst, dev));
        // Its owner gone: no longer known, though nothing read the directory again, and
        // no longer kept open.
        drop(owner);
        assert!(!t.reg.listener_known(TCP, dst, dev));
        assert!(!seen_listeners().keys().any(|(k, _)| *k == t.reg.key));
        // This process's own listeners are known without a lookup.
        let mine = sa("127.0.0.3:4791");
        let mut l = t
            .reg
            .bind(TCP, sa("0.0.0.0:7183"), mine, BindOptions::default())
            .unwrap();
        let dst = sa("127.0.0.1:7183");
        assert!(!t.reg.listener_known(TCP, dst, |d| d == mine));
        l.set_listening(true).unwrap();
        assert!(t.reg.listener_known(TCP, dst, |d| d == mine));
        drop(l);
        assert!(!t.reg.listener_known(TCP, dst, |d| d == mine));
    }

    #[test]
    fn lookup_prefers_an_exact_address() {
        let t = TempReg::new("exact");
        let mut w = bind(&t.reg, "0.0.0.0:7174").unwrap();
        w.set_listening(true).unwrap();
        // The rules let no other listener overlap this one; plant one that does.
        let mut r = rec("127.0.0.5:7174");
        r.b.listening = true;
        r.device = sa("127.0.0.9:4791");
        let p = plant(&t, "0106-7174-1-0.bind", &r);
        let _h = hold(&p);
        let at = |d: &str| t.reg.lookup(TCP, sa(d)).map(|l| l.device);
        assert_eq!(at("127.0.0.5:7174"), Some(sa("127.0.0.9:4791")));
        assert_eq!(at("127.0.0.1:7174"), Some(sa(DEV)));
    }

    #[test]
    fn lookup_across_families() {
        let t = TempReg::new("families");
        let opts = |af_only| BindOptions {
            af_only: Some(af_only),
            ..BindOptions::default()
        };
        let dev6 = sa("127.0.0.6:4791");
        let mut l6 = t.reg.bind(TCP, sa("[::]:7174"), dev6, opts(false)).unwrap();
        l6.set_listening(true).unwrap();
        // An IPv6 wildcard that is not AFONLY takes IPv4 connections too.
        assert_eq!(
            t.reg.lookup(TCP, sa("127.0.0.1:7174")).map(|l| l.device),
            Some(dev6)
        );
        assert_eq!(
            t.reg.lookup(TCP, sa("[::1]:7174")).map(|l| l.device),
            Some(dev6)
        );
        drop(l6);
        let mut l6 = t.reg.bind(TCP, sa("[::]:7174"), dev6, opts(true)).unwrap();
        l6.set_listening(true).unwrap();
        assert_eq!(t.reg.lookup(TCP, sa("127.0.0.1:7174")), None);
        assert!(t.reg.lookup(TCP, sa("[::1]:7174")).is_some());
        // An AFONLY IPv4 wildcard beside it takes the IPv4 ones.
        let dev4 = sa("127.0.0.4:4791");
        let mut l4 = t
            .reg
            .bind(TCP, sa("0.0.0.0:7174"), dev4, opts(true))
            .unwrap();
        l4.set_listening(true).unwrap();
        assert_eq!(
            t.reg.lookup(TCP, sa("127.0.0.1:7174")).map(|l| l.device),
            Some(dev4)
        );
        assert_eq!(
            t.reg.lookup(TCP, sa("[::1]:7174")).map(|l| l.device),
            Some(dev6)
        );
    }

    #[test]
    fn concurrent_binders_do_not_both_win() {
        let t = TempReg::new("race");
        let n = 8;
        let go = Arc::new(Barrier::new(n));
        let results: Vec<io::Result<Binding>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..n)
                .map(|_| {
                    let (go, reg) = (Arc::clone(&go), &t.reg);
                    s.spawn(move || {
                        go.wait();
                        bind(reg, "192.0.2.1:7174")
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let won = results.iter().filter(|r| r.is_ok()).count();
        assert_eq!(won, 1);
        for r in results.into_iter().filter(|r| r.is_err()) {
            assert_eq!(errno(r), Errno::ADDRINUSE);
        }
    }

    #[test]
    fn directory_is_private() {
        let t = TempReg::new("perm");
        let md = fs::metadata(t.reg.dir()).unwrap();
        assert_eq!(md.mode() & 0o777, 0o700);
        let open = Registry::open(t.reg.dir().join("a/b")).unwrap();
        assert_eq!(fs::metadata(open.dir()).unwrap().mode() & 0o777, 0o700);
        // An existing private directory is fine, and stays as it is.
        Registry::open(open.dir()).unwrap();
        assert_eq!(fs::metadata(open.dir()).unwrap().mode() & 0o777, 0o700);
        use std::os::unix::fs::PermissionsExt;
        let loose = t.reg.dir().join("loose");
        fs::create_dir(&loose).unwrap();
        fs::set_permissions(&loose, fs::Permissions::from_mode(0o777)).unwrap();
        let e = Registry::open(&loose).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied);
        let file = t.reg.dir().join("file");
        fs::write(&file, "").unwrap();
        assert!(Registry::open(&file).is_err());
    }

    #[test]
    fn port_zero_binds_share_one_lease_file() {
        let t = TempReg::new("lease");
        let mut held: Vec<Binding> = (0..10)
            .map(|_| bind(&t.reg, "0.0.0.0:0").unwrap())
            .collect();
        // One lease stands for all ten: no record file per binding.
        let files = t.files();
        assert_eq!(files.len(), 1, "{files:?}");
        assert!(is_lease_name(&files[0]), "{files:?}");
        let leased = t.lease_ports();
        assert_eq!(leased.len(), usize::from(FIRST_LEASE));
        for b in &held {
            assert!(leased.contains(&b.port()));
        }
        // This process's own rules still hold on the leased ports...
        let p = held[3].port();
        assert_eq!(
            errno(bind(&t.reg, &format!("0.0.0.0:{p}"))),
            Errno::ADDRNOTAVAIL
        );
        // ...and a leased port nobody holds is free to a fixed bind of this process.
        let free = leased
            .iter()
            .copied()
            .find(|p| held.iter().all(|b| b.port() != *p))
            .unwrap();
        let fixed = bind(&t.reg, &format!("0.0.0.0:{free}")).unwrap();
        // A listener on a leased port gets its record, which other processes read.
        held[0].set_listening(true).unwrap();
        let port = held[0].port();
        let rec = t
            .files()
            .into_iter()
            .find(|n| n.starts_with(&format!("0106-{port}-")) && n.ends_with(".bind"))
            .expect("the listener's record");
        let text = fs::read_to_string(t.reg.dir().join(rec)).unwrap();
        assert!(text.contains("listening 1\n"), "{text}");
        // More bindings than the first lease holds take a second, larger one.
        held.extend((0..10).map(|_| bind(&t.reg, "0.0.0.0:0").unwrap()));
        let leases = t.files().iter().filter(|n| is_lease_name(n)).count();
        assert_eq!(leases, 2, "{:?}", t.files());
        assert_eq!(t.lease_ports().len(), usize::from(FIRST_LEASE) * 3);
        // The leases go with the last binding on their ports.
        drop(held);
        assert_eq!(t.lease_ports().len(), usize::from(FIRST_LEASE));
        drop(fixed);
        assert!(t.files().is_empty(), "{:?}", t.files());
    }

    #[test]
    fn another_process_lease_takes_its_ports() {
        let t = TempReg::new("foreign-lease");
        let text = Lease::text(TCP, &(40000..=40015), 7, 1);
        let p = t.reg.dir().join("0106-40000-40015-1-0.lease");
        fs::write(&p, text).unwrap();
        let f = hold(&p);
        for port in [40000, 40007, 40015] {
            assert_eq!(
                errno(bind(&t.reg, &format!("192.0.2.1:{port}"))),
                Errno::ADDRNOTAVAIL
            );
        }
        let _next = bind(&t.reg, "0.0.0.0:40016").unwrap();
        // Port-0 binds of this process lease around it.
        let held: Vec<Binding> = (0..300)
            .map(|_| bind(&t.reg, "0.0.0.0:0").unwrap())
            .collect();
        assert!(held.iter().all(|b| !(40000..=40015).contains(&b.port())));
        let mine: Vec<u16> = t
            .lease_ports()
            .into_iter()
            .filter(|p| !(40000..=40015).contains(p))
            .collect();
        assert!(
            mine.iter().all(|p| !(40000..=40016).contains(p)),
            "{:?}",
            t.files()
        );
        drop(f);
        // Its owner gone, the lease is reclaimed by the next bind that scans.
        let _b = bind(&t.reg, "192.0.2.1:40007").unwrap();
        assert!(!p.exists());
    }

    /// Set in the child process of `killed_owner_leaves_nothing_behind`: the registry
    /// directory it binds in.
    const CHILD_ENV: &str = "SOFTRDMA_REGISTRY_TEST_CHILD";
    const READY: &str = "registry-child-port ";

    #[test]
    #[ignore = "the child process of killed_owner_leaves_nothing_behind"]
    fn child_binds_listens_and_waits() {
        let Some(dir) = std::env::var_os(CHILD_ENV) else {
            return;
        };
        let reg = Registry::open(PathBuf::from(dir)).unwrap();
        let mut b = reg
            .bind(
                TCP,
                sa("0.0.0.0:0"),
                sa("127.0.0.7:4791"),
                BindOptions::default(),
            )
            .unwrap();
        b.set_listening(true).unwrap();
        println!("{READY}{}", b.port());
        io::stdout().flush().unwrap();
        // The parent kills us long before this.
        std::thread::sleep(Duration::from_secs(60));
    }

    #[test]
    fn killed_owner_leaves_nothing_behind() {
        let t = TempReg::new("kill");
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "registry::tests::child_binds_listens_and_waits",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, t.reg.dir())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        // Ends at the child's exit if it never gets ready.
        let port: Option<u16> = out.lines().map_while(Result::ok).find_map(|l| {
            // libtest prints the test's name on the same line first.
            let at = l.find(READY)? + READY.len();
            l[at..].trim().parse().ok()
        });
        let Some(port) = port else {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the child never bound");
        };
        let at = sa(&format!("127.0.0.1:{port}"));
        let found = t.reg.lookup(TCP, at);
        let taken = bind(&t.reg, &format!("0.0.0.0:{port}")).map(|_| ());
        // The child's port came from its lease, whose other ports are taken too.
        let leased = t.lease_ports();
        let other = leased.iter().copied().find(|&p| p != port);
        let other_taken = other.map(|p| bind(&t.reg, &format!("0.0.0.0:{p}")).map(|_| ()));
        child.kill().unwrap(); // SIGKILL: no destructor runs.
        child.wait().unwrap();
        assert_eq!(found.map(|l| l.device), Some(sa("127.0.0.7:4791")));
        assert_eq!(errno(taken), Errno::ADDRNOTAVAIL);
        assert!(leased.contains(&port), "{port} not in {leased:?}");
        assert_eq!(
            errno(other_taken.expect("a lease of one port")),
            Errno::ADDRNOTAVAIL
        );
        // The record and the lease are still there, but nobody holds them.
        assert_eq!(t.files().len(), 2, "{:?}", t.files());
        assert_eq!(t.reg.lookup(TCP, at), None);
        let _b = bind(&t.reg, &format!("0.0.0.0:{port}")).unwrap();
        assert_eq!(t.files().len(), 1, "{:?}", t.files());
        let _c = bind(&t.reg, &format!("0.0.0.0:{}", other.unwrap())).unwrap();
    }
}
