//! Shared helpers: opening devices, TCP side channels, randomness, polling, formatting.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use serde::Serialize;
use softrdma::{CompletionQueue, Device, DeviceAddr, DeviceConfig, Mtu, WcStatus, WorkCompletion};

use crate::{CmdResult, DevOpts};

/// How long a client tries to reach the server's TCP port.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a side-channel read may wait for the peer.
pub const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(30);

pub fn flush_stdout() {
    let _ = std::io::stdout().flush();
}

/// Print `v` as one line of JSON, the form of every `--json` output.
pub fn print_json(v: &impl Serialize) -> CmdResult {
    let s = serde_json::to_string(v).map_err(|e| format!("cannot write JSON: {e}"))?;
    println!("{s}");
    Ok(())
}

/// The configuration of device `name` (or the default one) with the command's options.
pub fn device_config(opts: &DevOpts) -> CmdResult<DeviceConfig> {
    let list = softrdma::devices().map_err(|e| format!("device configuration: {e}"))?;
    let info = match &opts.device {
        Some(n) => list.iter().find(|d| &d.name == n).ok_or_else(|| {
            let names: Vec<&str> = list.iter().map(|d| d.name.as_str()).collect();
            format!("no device named {n:?} (configured: {})", names.join(", "))
        })?,
        None => list.first().ok_or("no device configured")?,
    };
    let addr = if info.auto {
        DeviceAddr::AutoLoopback(info.addr.port())
    } else {
        DeviceAddr::Fixed(info.addr)
    };
    let mut cfg = DeviceConfig::new(&info.name, addr);
    if let Some(p) = &opts.pcap {
        cfg.pcap = Some(p.clone());
    }
    if opts.busy_poll {
        cfg.busy_poll = true;
    }
    Ok(cfg)
}

/// Open the device the options name.
pub fn open_device(opts: &DevOpts) -> CmdResult<Device> {
    let cfg = device_config(opts)?;
    Device::open_with(&cfg).map_err(|e| format!("cannot open device {}: {e}", cfg.name))
}

/// 32 random bits (from the kernel; the clock if that fails).
pub fn random_u32() -> u32 {
    let mut b = [0u8; 4];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .is_ok()
    {
        return u32::from_ne_bytes(b);
    }
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos() ^ (d.as_secs() as u32))
        .unwrap_or(0);
    t ^ std::process::id().rotate_left(16)
}

/// A random 24-bit PSN, as the pingpong examples draw it.
pub fn random_psn() -> u32 {
    random_u32() & 0xff_ffff
}

/// `host` or `host:port` (IPv6 in brackets with a port) with `port` as the default.
pub fn resolve(peer: &str, port: u16) -> CmdResult<Vec<SocketAddr>> {
    let with_port = if peer.parse::<IpAddr>().is_ok() {
        // A bare IPv6 address has colons of its own.
        vec![SocketAddr::new(
            peer.parse().map_err(|_| "bad address")?,
            port,
        )]
    } else if let Ok(list) = peer.to_socket_addrs() {
        list.collect()
    } else {
        (peer, port)
            .to_socket_addrs()
            .map_err(|e| format!("cannot resolve {peer:?}: {e}"))?
            .collect()
    };
    if with_port.is_empty() {
        return Err(format!("cannot resolve {peer:?}: no address"));
    }
    Ok(with_port)
}

/// Connect to the server's side channel within [`CONNECT_TIMEOUT`]: a refused connection
/// is tried again (the server may be starting), anything else fails at once.
pub fn connect(peer: &str, port: u16) -> CmdResult<TcpStream> {
    let addrs = resolve(peer, port)?;
    let deadline = Instant::now() + CONNECT_TIMEOUT;
    loop {
        let mut last = None;
        for a in &addrs {
            let left = deadline.saturating_duration_since(Instant::now());
            match TcpStream::connect_timeout(a, left.max(Duration::from_millis(10))) {
                Ok(s) => {
                    let _ = s.set_read_timeout(Some(EXCHANGE_TIMEOUT));
                    let _ = s.set_write_timeout(Some(EXCHANGE_TIMEOUT));
                    let _ = s.set_nodelay(true);
                    return Ok(s);
                }
                Err(e) => last = Some(e),
            }
        }
        let e = last.map_or_else(|| "no address".to_string(), |e| e.to_string());
        let refused = e.contains("refused");
        if !refused || Instant::now() + Duration::from_millis(100) >= deadline {
            return Err(format!("couldn't connect to {peer} port {port}: {e}"));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Listen on `port` (IPv6 dual-stack if possible, else IPv4), as the examples do.
pub fn listen(port: u16) -> CmdResult<TcpListener> {
    TcpListener::bind(("::", port))
        .or_else(|_| TcpListener::bind(("0.0.0.0", port)))
        .map_err(|e| format!("couldn't listen on port {port}: {e}"))
}

/// Accept one client and give it the exchange timeouts.
pub fn accept(l: &TcpListener) -> CmdResult<(TcpStream, SocketAddr)> {
    let (s, a) = l.accept().map_err(|e| format!("accept failed: {e}"))?;
    let _ = s.set_read_timeout(Some(EXCHANGE_TIMEOUT));
    let _ = s.set_write_timeout(Some(EXCHANGE_TIMEOUT));
    let _ = s.set_nodelay(true);
    Ok((s, canonical(a)))
}

/// An IPv4-mapped IPv6 socket address as plain IPv4.
pub fn canonical(a: SocketAddr) -> SocketAddr {
    match a.ip() {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), a.port()),
            None => a,
        },
        IpAddr::V4(_) => a,
    }
}

/// Read exactly `buf.len()` bytes; a clear message on EOF or timeout.
pub fn read_exact(s: &mut TcpStream, buf: &mut [u8], what: &str) -> CmdResult {
    let mut n = 0;
    while n < buf.len() {
        match s.read(&mut buf[n..]) {
            Ok(0) => {
                return Err(format!(
                    "{n}/{}: couldn't read {what}: peer closed the connection",
                    buf.len()
                ))
            }
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Err(format!("{n}/{}: timed out reading {what}", buf.len()))
            }
            Err(e) => return Err(format!("{n}/{}: couldn't read {what}: {e}", buf.len())),
        }
    }
    Ok(())
}

/// Path MTU from its byte count.
pub fn mtu_of(bytes: u32) -> CmdResult<Mtu> {
    Ok(match bytes {
        256 => Mtu::Mtu256,
        512 => Mtu::Mtu512,
        1024 => Mtu::Mtu1024,
        2048 => Mtu::Mtu2048,
        4096 => Mtu::Mtu4096,
        _ => {
            return Err(format!(
                "invalid MTU {bytes} (256, 512, 1024, 2048 or 4096)"
            ))
        }
    })
}

/// An error line for a failed completion.
pub fn wc_error(wc: &WorkCompletion) -> String {
    let hint = match wc.status {
        WcStatus::RetryExcErr => " (the peer stopped answering)",
        WcStatus::RnrRetryExcErr => " (the peer posted no receive)",
        _ => "",
    };
    format!(
        "failed status {} ({}) for wr_id {}{hint}",
        wc.status.as_str(),
        wc.status as u32,
        wc.wr_id
    )
}

/// Poll loop with a back-off: spin briefly, then yield, then nap — and a deadline that
/// is pushed forward by every completion.
pub struct Poller {
    idle_since: Instant,
    timeout: Duration,
}

impl Poller {
    pub fn new(timeout: Duration) -> Poller {
        Poller {
            idle_since: Instant::now(),
            timeout,
        }
    }
    /// Poll `cq` into `wcs`; waits (with back-off) until at least one completion or the
    /// idle timeout.
    pub fn poll(&mut self, cq: &CompletionQueue, wcs: &mut [WorkCompletion]) -> CmdResult<usize> {
        loop {
            let n = cq.poll(wcs).map_err(|e| format!("poll CQ failed: {e}"))?;
            if n > 0 {
                self.idle_since = Instant::now();
                return Ok(n);
            }
            self.idle()?;
        }
    }
    /// One back-off step; an error once idle for longer than the timeout.
    pub fn idle(&mut self) -> CmdResult {
        self.check_timeout()?;
        let e = self.idle_since.elapsed();
        if e < Duration::from_micros(100) {
            std::hint::spin_loop();
        } else if e < Duration::from_millis(5) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
        Ok(())
    }
    /// An error once idle for longer than the timeout (no back-off).
    pub fn check_timeout(&self) -> CmdResult {
        if self.idle_since.elapsed() > self.timeout {
            return Err(format!(
                "no completion for {} s: the peer is gone or unreachable",
                self.timeout.as_secs()
            ));
        }
        Ok(())
    }
    /// Note progress made outside `poll`.
    pub fn progress(&mut self) {
        self.idle_since = Instant::now();
    }
}

/// Whether stderr is a terminal (for progress displays).
pub fn stderr_is_tty() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal()
}
