//! `--cm`: connecting through the rdma_cm instead of a TCP side channel. The client
//! retries while the server starts, as the TCP path does while its connection is
//! refused.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use softrdma::cm::{self, ConnectOptions, Connection, Listener, PortSpace};
use softrdma::{Device, ProtectionDomain, QpInit, QpType, QueuePair};

use crate::{tcp, CmdResult};

/// The longest one connection attempt may take. On loopback the CM answers in
/// milliseconds; a request that goes unanswered this long went to a device that runs no
/// CM (the server had not registered its port yet, so the client asked the device at
/// the address), and a fresh attempt finds the server once it listens.
const ATTEMPT: Duration = Duration::from_secs(2);
/// Pause between attempts while nobody listens.
const RETRY_PAUSE: Duration = Duration::from_millis(100);

/// The path MTU without `-m` (and the TCP exchange's, as `ibv_rc_pingpong`'s).
pub const DEFAULT_MTU: u32 = 1024;

/// Refuse `-m` with `--cm`: the connection manager sets the path MTU, from the link the
/// device is on as Linux's rdma_cm does (4096 bytes on loopback, 1024 on a 1500-byte
/// Ethernet).
pub fn check_mtu(mtu: Option<u32>) -> CmdResult {
    if let Some(m) = mtu {
        return Err(format!(
            "with --cm the connection manager sets the path MTU (its link's); -m {m} does not apply"
        ));
    }
    Ok(())
}

/// Listen on rdma_cm port `port` of every address of `dev`, in the port space of
/// `qp_type` (clients connect in the same one: [`PortSpace::for_qp_type`]).
pub fn listen(dev: &Device, port: u16, qp_type: QpType) -> CmdResult<Listener> {
    let any = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port);
    Listener::bind_with(dev, any, PortSpace::for_qp_type(qp_type), 0)
        .map_err(|e| format!("couldn't listen on rdma_cm port {port}: {e}"))
}

/// The text of a server's rejection (its REJ private data up to the first NUL).
pub fn rejection_text(e: &softrdma::Error) -> Option<String> {
    let r = e.rejection()?;
    let end = r
        .private_data
        .iter()
        .position(|&b| b == 0)
        .unwrap_or(r.private_data.len());
    (end > 0).then(|| String::from_utf8_lossy(&r.private_data[..end]).into_owned())
}

/// Connect a QP of `init` to `peer` (a host or IP) on rdma_cm port `port`, running
/// `prepare` on each attempt's QP before its request goes. Nobody listening (REJ reason
/// 8) or an unanswered attempt is tried again until [`tcp::CONNECT_TIMEOUT`]; anything
/// else fails at once, with the error as the CM gave it (a server's rejection included).
pub fn connect(
    pd: &ProtectionDomain,
    init: &QpInit<'_>,
    peer: &str,
    port: u16,
    opts: &ConnectOptions,
    mut prepare: impl FnMut(&QueuePair) -> softrdma::Result<()>,
) -> Result<Connection, String> {
    let addrs = tcp::resolve(peer, port)?;
    // The devices speak IPv4 unless configured otherwise: prefer an IPv4 answer.
    let addr = addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| format!("cannot resolve {peer:?}: no address"))?;
    let addr = tcp::canonical(addr);
    let deadline = Instant::now() + tcp::CONNECT_TIMEOUT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let o = ConnectOptions {
            timeout: Some(left.clamp(Duration::from_millis(100), ATTEMPT)),
            ..opts.clone()
        };
        let e = match cm::connect_with(pd, init, addr, &o, &mut prepare) {
            Ok(c) => return Ok(c),
            Err(e) => e,
        };
        let again = e.is_timeout() || e.rejection().is_some_and(|r| r.reason == 8);
        if !again || Instant::now() + RETRY_PAUSE >= deadline {
            return Err(match rejection_text(&e) {
                Some(t) if e.rejection().is_some_and(|r| r.reason != 8) => {
                    format!("the server refused: {t}")
                }
                _ if e.is_timeout() => format!(
                    "couldn't connect to {peer} port {port} through the rdma_cm: no connection manager answered (is a server running there with --cm?)"
                ),
                _ => format!("couldn't connect to {peer} port {port} through the rdma_cm: {e}"),
            });
        }
        std::thread::sleep(RETRY_PAUSE);
    }
}
