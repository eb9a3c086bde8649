//! Connecting queue pairs through the connection manager (rdma_cm), as librdmacm
//! programs do: a server listens on an IP port, a client connects to it, and the two
//! exchange QP numbers, starting PSNs and up to 56 / 196 bytes of private data in the IB
//! CM's REQ / REP / RTU handshake over QP1 — the same MADs Linux's rdma_cm sends over
//! RoCE — instead of over a side channel of their own.
//!
//! Every device runs its own CM (a thread, started by the first CM object made on the
//! device). Port numbers are reserved host-wide, so a server bound to the wildcard
//! address in one process is found at 127.0.0.1 by a client in another.
//!
//! Two levels:
//!
//! - [`Listener`], [`connect`] and [`Connection`]: a connected
//!   [`QueuePair`](crate::QueuePair) in one call on each side, with the QP moved INIT →
//!   RTR → RTS where librdmacm moves it.
//! - [`EventChannel`], [`CmId`] and [`Event`]: the rdma_cm calls and events one by one,
//!   for programs that drive their own state machine (and poll the channel's fd).
//!
//! A server and a client, here two devices and two threads of one process (usually two
//! processes, or two hosts):
//!
//! ```
//! use std::time::Duration;
//! use softrdma::cm::{self, AcceptOptions, ConnectOptions, Listener};
//! use softrdma::{wr, Access, Device, QpInit, QpType};
//! # fn main() -> softrdma::Result<()> {
//! let t = Duration::from_secs(10);
//! // Server: port 0 picks a free port; the wildcard address is found at 127.0.0.1.
//! let dev = Device::open_default()?;
//! let listener = Listener::bind(&dev, "0.0.0.0:0".parse().unwrap())?;
//! let port = listener.local_addr().port();
//! let server = std::thread::spawn(move || -> softrdma::Result<Vec<u8>> {
//!     let pd = dev.alloc_pd()?;
//!     let cq = dev.create_cq(128, None)?; // room for the QP's 64 + 64 WRs
//!     let mem = pd.register(4096, Access::LOCAL_WRITE)?;
//!     let init = QpInit::new(QpType::Rc, &cq);
//!     // The `_with` variant runs the closure on the QP in INIT, before the client can
//!     // send: the place to post receives.
//!     let conn = listener.accept_with(&pd, &init, &AcceptOptions::new(b"welcome"), |qp| {
//!         qp.post_recv(wr::recv(1, [mem.sge(0..64)?]))
//!     })?;
//!     assert_eq!(&conn.private_data()[..5], b"hello"); // the client's REQ
//!     let wc = cq.wait(t)?;
//!     wc.result()?;
//!     conn.wait_disconnected(Some(t))?; // the client ends it
//!     mem.to_vec(0, wc.byte_len as usize)
//! });
//!
//! // Client: a connected RC QP in one call.
//! let dev = Device::open_default()?;
//! let pd = dev.alloc_pd()?;
//! let cq = dev.create_cq(128, None)?;
//! let mem = pd.register(4096, Access::LOCAL_WRITE)?;
//! let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
//! let opts = ConnectOptions::new(b"hello");
//! let conn = cm::connect(&pd, &QpInit::new(QpType::Rc, &cq), addr, &opts)?;
//! assert_eq!(&conn.private_data()[..7], b"welcome"); // the server's REP
//! mem.write(0, b"over the CM")?;
//! conn.qp().post_send(wr::send(2, [mem.sge(0..11)?]))?;
//! cq.wait(t)?.result()?;
//! conn.disconnect()?; // both sides see the connection close
//! assert_eq!(server.join().unwrap()?, b"over the CM");
//! # Ok(()) }
//! ```

use std::sync::Arc;

use softrdma_cm::agent::Agent;

use crate::{Device, Error, Result};

#[cfg(feature = "tokio")]
mod async_cm;
mod client;
mod connection;
mod id;
mod options;
mod server;

#[cfg(feature = "tokio")]
pub use async_cm::{connect_async, connect_with_async, AsyncEventChannel, AsyncListener};
pub use client::{connect, connect_with};
pub use connection::Connection;
pub use id::{CmId, Event, EventChannel, PortSpace};
pub use options::{AcceptOptions, ConnectOptions};
pub use server::{ConnectRequest, Listener};
pub use softrdma_cm::cma::{
    CmaError, ConnParam, EventType, IdOption, IdState, Timeouts, UdParam, MAX_ACCEPT_PRIVATE,
    MAX_CONNECT_PRIVATE, MAX_REJECT_PRIVATE, MAX_UD_ACCEPT_PRIVATE, MAX_UD_CONNECT_PRIVATE,
    UDP_QKEY,
};

/// The device's CM ([`Agent::for_device`]: one per device, whichever face asks).
fn agent_of(dev: &Device) -> Result<Arc<Agent>> {
    let mut slot = dev.inner.cm.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(a) = slot.as_ref() {
        return Ok(Arc::clone(a));
    }
    let a = Agent::for_device(&dev.inner.dev).map_err(|e| {
        let msg = format!("starting the CM of {}: {e}", dev.name());
        Error::io(e, libc::EIO, msg)
    })?;
    *slot = Some(Arc::clone(&a));
    Ok(a)
}

/// Make the CM of `dev` wait for answers as `t` says, for the requests, replies and
/// disconnects it sends from now on. The default is Linux's (a request is tried 16
/// times, about 4.6 s apart, before UNREACHABLE); shorter suits tests and programs that
/// would rather fail fast.
pub fn set_timeouts(dev: &Device, t: Timeouts) -> Result<()> {
    agent_of(dev)?.call(|c, _| c.set_timeouts(t));
    Ok(())
}
