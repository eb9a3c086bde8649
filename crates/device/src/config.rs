//! Which devices exist: `SOFTRDMA_ADDR`, the configuration file, or one automatic device.
//!
//! - `SOFTRDMA_ADDR=IP[:PORT]` names the address of the default device `softrdma0`.
//! - The configuration file (`$SOFTRDMA_CONFIG`, else `/etc/softrdma.conf`) has lines
//!   `NAME IP[:PORT] [shm=off]`; `#` starts a comment; blank lines are ignored. `shm=off`
//!   keeps the device off the same-host path (`SOFTRDMA_SHM=0` does for every device).
//! - With neither, there is one device `softrdma0` that takes the first free 127.0.0.x
//!   on port 4791 when opened.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use softrdma_transport::{Keepalive, KeepalivePolicy};

use crate::{statsfile, DEFAULT_SPIN, ROCE_PORT};

/// Name of the default device.
pub const DEFAULT_NAME: &str = "softrdma0";
/// Configuration file read when `SOFTRDMA_CONFIG` is not set.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/softrdma.conf";

/// Where a device lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceAddr {
    /// A fixed address from the configuration.
    Fixed(SocketAddr),
    /// The first free 127.0.0.x on this port, chosen when the device opens.
    AutoLoopback(u16),
}

/// One configured device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceEntry {
    /// Device name (`softrdma0`, …).
    pub name: String,
    /// Its address.
    pub addr: DeviceAddr,
    /// Whether the same-host path may be used (`shm=off` in the file says no).
    pub shm: bool,
}

/// A configuration problem, with the place it was found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{origin}: {msg}")]
pub struct ConfigError {
    /// File and line, or the variable name.
    pub origin: String,
    /// What is wrong.
    pub msg: String,
}

/// Parse `IP` or `IP:PORT` (IPv6 with a port as `[IP]:PORT`); the port defaults to 4791.
pub fn parse_addr(s: &str) -> Option<SocketAddr> {
    let s = s.trim();
    if let Ok(sa) = s.parse::<SocketAddr>() {
        return Some(sa);
    }
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Some(SocketAddr::new(ip, ROCE_PORT));
    }
    // `[v6]` without a port.
    let inner = s.strip_prefix('[')?.strip_suffix(']')?;
    inner
        .parse::<IpAddr>()
        .ok()
        .map(|ip| SocketAddr::new(ip, ROCE_PORT))
}

/// Parse the text of a configuration file; `origin` names it in errors.
pub fn parse_config(text: &str, origin: &str) -> Result<Vec<DeviceEntry>, ConfigError> {
    let mut out: Vec<DeviceEntry> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let err = |msg: &str| ConfigError {
            origin: format!("{origin}:{}", i + 1),
            msg: msg.to_string(),
        };
        let mut words = line.split_whitespace();
        let (Some(name), Some(addr), opt, None) =
            (words.next(), words.next(), words.next(), words.next())
        else {
            return Err(err("expected `NAME IP[:PORT] [shm=on|off]`"));
        };
        let shm = match opt {
            None | Some("shm=on") => true,
            Some("shm=off") => false,
            Some(_) => return Err(err("expected `shm=on` or `shm=off` after the address")),
        };
        let addr = parse_addr(addr).ok_or_else(|| err("bad address (IP or IP:PORT)"))?;
        if out.iter().any(|e| e.name == name) {
            return Err(err("device named twice"));
        }
        if let Some((first, port)) = out.iter().find_map(|e| match e.addr {
            DeviceAddr::Fixed(a) => Some((&e.name, a.port())),
            DeviceAddr::AutoLoopback(_) => None,
        }) {
            if port != addr.port() {
                return Err(err(&format!(
                    "UDP port {} differs from {first}'s {port}: peers are addressed by GID, \
                     which carries no port, so every device must use the same one",
                    addr.port(),
                )));
            }
        }
        out.push(DeviceEntry {
            name: name.to_string(),
            addr: DeviceAddr::Fixed(addr),
            shm,
        });
    }
    Ok(out)
}

/// The configuration file in effect: `$SOFTRDMA_CONFIG` (must exist) or the default path
/// (may be absent).
fn config_file() -> (PathBuf, bool) {
    match std::env::var_os("SOFTRDMA_CONFIG") {
        Some(p) if !p.is_empty() => (PathBuf::from(p), true),
        _ => (PathBuf::from(DEFAULT_CONFIG_PATH), false),
    }
}

fn read_config(path: &Path, required: bool) -> Result<Vec<DeviceEntry>, ConfigError> {
    match std::fs::read_to_string(path) {
        Ok(text) => parse_config(&text, &path.display().to_string()),
        Err(e) if !required && e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(ConfigError {
            origin: path.display().to_string(),
            msg: e.to_string(),
        }),
    }
}

/// The devices the environment and configuration file define, the default one first.
///
/// `SOFTRDMA_ADDR` sets `softrdma0`'s address (replacing a file entry of that name); with
/// no configuration at all there is one automatic loopback device.
pub fn devices() -> Result<Vec<DeviceEntry>, ConfigError> {
    let (path, required) = config_file();
    let mut list = read_config(&path, required)?;
    if let Some(v) = std::env::var_os("SOFTRDMA_ADDR").filter(|v| !v.is_empty()) {
        let v = v.to_string_lossy();
        let addr = parse_addr(&v).ok_or_else(|| ConfigError {
            origin: "SOFTRDMA_ADDR".into(),
            msg: format!("bad address {v:?} (IP or IP:PORT)"),
        })?;
        // A device opens at an address of this host; say so now rather than when it opens.
        if let Err(e) = std::net::UdpSocket::bind(SocketAddr::new(addr.ip(), 0)) {
            if e.kind() == std::io::ErrorKind::AddrNotAvailable {
                return Err(ConfigError {
                    origin: "SOFTRDMA_ADDR".into(),
                    msg: format!("{} is not an address of this host", addr.ip()),
                });
            }
        }
        list.retain(|e| e.name != DEFAULT_NAME);
        if let Some(other) = list.iter().find_map(|e| match e.addr {
            DeviceAddr::Fixed(a) if a.port() != addr.port() => Some((e.name.clone(), a.port())),
            _ => None,
        }) {
            return Err(ConfigError {
                origin: "SOFTRDMA_ADDR".into(),
                msg: format!(
                    "UDP port {} differs from {}'s {} in {}: every device must use the same \
                     port",
                    addr.port(),
                    other.0,
                    other.1,
                    path.display()
                ),
            });
        }
        list.insert(
            0,
            DeviceEntry {
                name: DEFAULT_NAME.into(),
                addr: DeviceAddr::Fixed(addr),
                shm: true,
            },
        );
    }
    if list.is_empty() {
        list.push(DeviceEntry {
            name: DEFAULT_NAME.into(),
            addr: DeviceAddr::AutoLoopback(ROCE_PORT),
            shm: true,
        });
    }
    Ok(list)
}

/// The address an automatic loopback device would take now (first 127.0.0.x whose port
/// is free), found by binding and releasing; 127.0.0.1 if none is free.
pub fn probe_auto_loopback(port: u16) -> SocketAddr {
    for x in 1..=254u8 {
        let a = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(127, 0, 0, x)), port);
        if std::net::UdpSocket::bind(a).is_ok() {
            return a;
        }
    }
    SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port)
}

/// The second address a device at `addr` would serve if opened now (GID index 1): the
/// interface's address of the other IP version, if its port is free, and unless
/// `SOFTRDMA_DUAL_STACK=0`. Found by binding and releasing.
pub fn probe_alt(addr: SocketAddr) -> Option<IpAddr> {
    if !dual_stack_wanted() {
        return None;
    }
    let ip = crate::netdev::other_version(addr.ip())?;
    std::net::UdpSocket::bind(SocketAddr::new(ip, addr.port()))
        .is_ok()
        .then_some(ip)
}

/// Whether devices serve a second address: unless `SOFTRDMA_DUAL_STACK=0`.
fn dual_stack_wanted() -> bool {
    std::env::var("SOFTRDMA_DUAL_STACK").map_or(true, |v| v != "0")
}

/// How to open a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceConfig {
    /// Device name.
    pub name: String,
    /// Its address.
    pub addr: DeviceAddr,
    /// Never block: the progress thread polls continuously (lowest latency, one core).
    pub busy_poll: bool,
    /// How long the progress thread keeps spinning after activity before it blocks.
    pub spin: Duration,
    /// Write every datagram sent and received to this pcap file.
    pub pcap: Option<PathBuf>,
    /// Seed of the key generator (`KeyRng` of softrdma-wire) for reproducible runs; None:
    /// 256 bits from the OS (`os_seed`), as production wants.
    pub seed: Option<u64>,
    /// Publish the device's counters for `softrdma stats` to a file in this directory
    /// while it is open ([`statsfile`]); None: don't.
    pub stats_dir: Option<PathBuf>,
    /// Also serve the interface's address of the other IP version (`netdev::other_version`:
    /// `::1` beside 127.0.0.x), as GID index 1, when that address and port are free;
    /// `SOFTRDMA_DUAL_STACK=0` turns it off.
    pub dual_stack: bool,
    /// How idle RC connections check that their peer is alive, so that a peer killed
    /// without a word (SIGKILL, a crash) is noticed ([`KeepalivePolicy`]): by default a
    /// peer on this host within a second, one elsewhere within 20 s. From
    /// `SOFTRDMA_KEEPALIVE` and `SOFTRDMA_KEEPALIVE_LOCAL` ([`keepalive_from_env`]).
    pub keepalive: KeepalivePolicy,
    /// Reach the devices of this host through shared-memory rings rather than loopback
    /// UDP (`softrdma_net::shm`); `SOFTRDMA_SHM=0` or `shm=off` in the configuration file
    /// turns it off, and then the device is what it was before the path existed.
    pub shm: bool,
    /// How long datagrams wait for room in the ring of a same-host peer that reads none
    /// (a process stopped in a debugger, or hung) before they are dropped as a congested
    /// network's would be; a reader that reads keeps them however long. 100 ms by default.
    pub shm_hold: std::time::Duration,
}

/// Whether devices take the same-host path: unless `SOFTRDMA_SHM=0`.
pub fn shm_wanted() -> bool {
    std::env::var("SOFTRDMA_SHM").map_or(true, |v| v != "0")
}

/// The keepalive policy the environment asks for: `SOFTRDMA_KEEPALIVE=IDLE_MS,INTERVAL_MS,PROBES`
/// sets it for every peer (`0` turns it off), `SOFTRDMA_KEEPALIVE_LOCAL` (same form) then
/// for peers on this host alone; unset, [`KeepalivePolicy::DEFAULT`]. A malformed value
/// is ignored with a warning (the default stays).
pub fn keepalive_from_env() -> KeepalivePolicy {
    keepalive_from(
        std::env::var("SOFTRDMA_KEEPALIVE").ok().as_deref(),
        std::env::var("SOFTRDMA_KEEPALIVE_LOCAL").ok().as_deref(),
    )
}

fn keepalive_from(all: Option<&str>, local: Option<&str>) -> KeepalivePolicy {
    let mut p = KeepalivePolicy::DEFAULT;
    let parse = |var: &str, v: &str| match Keepalive::parse(v) {
        Ok(k) => Some(k),
        Err(e) => {
            tracing::warn!(variable = var, error = %e, "ignored");
            None
        }
    };
    if let Some(k) = all
        .filter(|v| !v.is_empty())
        .and_then(|v| parse("SOFTRDMA_KEEPALIVE", v))
    {
        p = KeepalivePolicy {
            local: k,
            remote: k,
        };
    }
    if let Some(k) = local
        .filter(|v| !v.is_empty())
        .and_then(|v| parse("SOFTRDMA_KEEPALIVE_LOCAL", v))
    {
        p.local = k;
    }
    p
}

impl DeviceConfig {
    /// A configuration for `name` at `addr`, with `SOFTRDMA_BUSY_POLL`, `SOFTRDMA_PCAP`,
    /// `SOFTRDMA_DUAL_STACK` and the stats directory ([`statsfile::default_dir`]: none if `SOFTRDMA_STATS=0`)
    /// taken from the environment.
    pub fn new(name: &str, addr: DeviceAddr) -> DeviceConfig {
        let busy_poll = std::env::var("SOFTRDMA_BUSY_POLL").is_ok_and(|v| v == "1");
        let pcap = std::env::var_os("SOFTRDMA_PCAP")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from);
        DeviceConfig {
            name: name.to_string(),
            addr,
            busy_poll,
            spin: DEFAULT_SPIN,
            pcap,
            seed: None,
            stats_dir: statsfile::default_dir(),
            dual_stack: dual_stack_wanted(),
            keepalive: keepalive_from_env(),
            shm: shm_wanted(),
            shm_hold: std::time::Duration::from_millis(100),
        }
    }
    /// The configuration of a configured device: an entry of the device list that
    /// `SOFTRDMA_ADDR`, `SOFTRDMA_CONFIG` or `/etc/softrdma.conf` gives.
    pub fn from_entry(e: &DeviceEntry) -> DeviceConfig {
        let mut c = DeviceConfig::new(&e.name, e.addr);
        c.shm &= e.shm;
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses() {
        assert_eq!(
            parse_addr("10.0.0.1"),
            Some("10.0.0.1:4791".parse().unwrap())
        );
        assert_eq!(
            parse_addr("10.0.0.1:5000"),
            Some("10.0.0.1:5000".parse().unwrap())
        );
        assert_eq!(parse_addr("::1"), Some("[::1]:4791".parse().unwrap()));
        assert_eq!(parse_addr("[::1]"), Some("[::1]:4791".parse().unwrap()));
        assert_eq!(parse_addr("[::1]:7"), Some("[::1]:7".parse().unwrap()));
        assert_eq!(parse_addr("nonsense"), None);
        assert_eq!(parse_addr("1.2.3.4:99999"), None);
    }

    #[test]
    fn file() {
        let text = "# devices\n\nrdma0 10.0.0.1   # first\n  rdma1 [fe80::1]:4791\n";
        let l = parse_config(text, "t").unwrap();
        assert_eq!(l.len(), 2);
        assert_eq!(l[0].name, "rdma0");
        assert_eq!(
            l[0].addr,
            DeviceAddr::Fixed("10.0.0.1:4791".parse().unwrap())
        );
        assert_eq!(
            l[1].addr,
            DeviceAddr::Fixed("[fe80::1]:4791".parse().unwrap())
        );
        let e = parse_config("a 1.2.3.4\nb\n", "f").unwrap_err();
        assert_eq!(e.origin, "f:2");
        assert!(parse_config("a 1.2.3.4\na 1.2.3.5\n", "f").is_err());
        assert!(parse_config("a 1.2.3.4 extra\n", "f").is_err());
        let e = parse_config("a 1.2.3.4:5000\nb 1.2.3.5\n", "f").unwrap_err();
        assert_eq!(e.origin, "f:2");
        assert!(e.msg.contains("4791 differs from a's 5000"), "{}", e.msg);
        assert!(parse_config("a 1.2.3.4:5000\nb 1.2.3.5:5000\n", "f").is_ok());
    }

    #[test]
    fn shm_setting() {
        let l = parse_config("a 1.2.3.4 shm=off\nb 1.2.3.5\nc 1.2.3.6 shm=on\n", "t").unwrap();
        assert_eq!(
            l.iter().map(|e| e.shm).collect::<Vec<_>>(),
            [false, true, true]
        );
        assert!(!DeviceConfig::from_entry(&l[0]).shm);
        assert!(parse_config("a 1.2.3.4 shm=maybe\n", "f").is_err());
        assert!(parse_config("a 1.2.3.4 shm=off extra\n", "f").is_err());
    }

    #[test]
    fn keepalive_settings() {
        let d = KeepalivePolicy::DEFAULT;
        assert_eq!(keepalive_from(None, None), d);
        assert_eq!(keepalive_from(Some(""), Some("")), d);
        assert_eq!(keepalive_from(Some("0"), None), KeepalivePolicy::OFF);
        let k = Keepalive {
            idle_ns: 1_000_000,
            interval_ns: 2_000_000,
            probes: 3,
        };
        assert_eq!(
            keepalive_from(Some("1,2,3"), None),
            KeepalivePolicy {
                local: Some(k),
                remote: Some(k)
            }
        );
        assert_eq!(
            keepalive_from(None, Some("off")),
            KeepalivePolicy {
                local: None,
                remote: d.remote
            }
        );
        assert_eq!(
            keepalive_from(Some("0"), Some("1,2,3")),
            KeepalivePolicy {
                local: Some(k),
                remote: None
            }
        );
        assert_eq!(keepalive_from(Some("bad"), Some("1,2")), d);
    }
}
