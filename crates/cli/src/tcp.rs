//! The TCP side channel the pingpong and perf commands exchange their QP details over
//! (as rdma-core's examples and perftest do).

use std::io::Read;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::CmdResult;

/// How long a client tries to reach the server's TCP port.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a side-channel read may wait for the peer.
pub const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(30);

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
    SocketAddr::new(a.ip().to_canonical(), a.port())
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
