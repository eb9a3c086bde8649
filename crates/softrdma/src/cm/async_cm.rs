//! The connection manager on tokio (feature `tokio`): events, requests and connection
//! setup awaited on an event channel's fd registered with tokio's reactor, so that a
//! task accepting or connecting leaves its thread to the others.
//!
//! The steps are those of [`connect_with`](super::connect_with) and
//! [`ConnectRequest::accept_with`] (the same QP moves, the same private data, the same
//! errors), with each wait for a CM event an `.await`. The option structs'
//! `timeout` is not used here, since a timer would need tokio's time driver: wrap the
//! future in `tokio::time::timeout` instead. Dropping an unfinished future drops its
//! [`CmId`], which rejects, disconnects or abandons the exchange as `rdma_destroy_id`
//! does, so a timed-out connect leaves nothing behind.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::task::{ready, Context, Poll};

use ::tokio::io::unix::AsyncFd;

use softrdma_cm::cma::EventParam;

use super::client::{connected, send_connect};
use super::connection::event_error;
use super::server::{rtu, Answered};
use super::{
    AcceptOptions, CmId, ConnectOptions, ConnectRequest, Connection, Event, EventChannel,
    EventType, Listener, PortSpace,
};
use crate::tokio_support::register;
use crate::{Error, ProtectionDomain, QpInit, QueuePair, Result};

/// A CM [`EventChannel`] whose events are awaited on tokio: made by
/// [`EventChannel::into_async`].
///
/// The methods take `&self`, so tasks may share it; each event goes to one of them. The
/// channel stays usable through [`AsyncEventChannel::channel`] (to make ids on it).
pub struct AsyncEventChannel {
    fd: AsyncFd<EventChannel>,
}

impl std::fmt::Debug for AsyncEventChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncEventChannel")
            .field("channel", self.fd.get_ref())
            .finish()
    }
}

impl EventChannel {
    /// This channel with its events awaited on tokio ([`AsyncEventChannel`]). Call it
    /// inside a tokio runtime with I/O enabled; one at a time per channel (Busy while
    /// another lives).
    pub fn into_async(self) -> Result<AsyncEventChannel> {
        Ok(AsyncEventChannel {
            fd: register(self, "CM event channel")?,
        })
    }
}

impl AsyncEventChannel {
    /// The channel.
    pub fn channel(&self) -> &EventChannel {
        self.fd.get_ref()
    }

    /// Poll for the next event: `Ready(Ok(event))`, or `Pending` with the task's waker
    /// registered with the channel's fd. A channel's events end only with the channel,
    /// so there is no `None`.
    pub fn poll_next_event(&self, cx: &mut Context<'_>) -> Poll<Result<Event>> {
        loop {
            let mut guard = ready!(self.fd.poll_read_ready(cx))
                .map_err(|e| Error::io(e, libc::EIO, "waiting for a CM event"))?;
            if let Some(ev) = self.fd.get_ref().try_next_event()? {
                return Poll::Ready(Ok(ev));
            }
            // Empty: readiness goes unless an event was queued since it was reported.
            guard.clear_ready();
        }
    }

    /// The next event (`rdma_get_cm_event`), waiting without blocking the thread.
    /// Cancel-safe: an event is taken only when the future completes.
    pub async fn next_event(&self) -> Result<Event> {
        std::future::poll_fn(|cx| self.poll_next_event(cx)).await
    }

    /// The next event of id `h` (the helpers' channels carry one id; events of others
    /// are of requests answered or dropped already).
    async fn next_of(&self, h: u32) -> Result<Event> {
        loop {
            let ev = self.next_event().await?;
            if ev.id == h {
                return Ok(ev);
            }
        }
    }
}

/// A [`Listener`] whose connection requests are awaited on tokio: made by
/// [`Listener::into_async`] or [`AsyncListener::bind`].
pub struct AsyncListener {
    listener: Listener,
    ch: AsyncEventChannel,
}

impl std::fmt::Debug for AsyncListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncListener")
            .field("listener", &self.listener)
            .finish()
    }
}

impl Listener {
    /// This listener with its requests awaited on tokio ([`AsyncListener`]). Call it
    /// inside a tokio runtime with I/O enabled.
    pub fn into_async(self) -> Result<AsyncListener> {
        let ch = self.id.chan.clone().into_async()?;
        Ok(AsyncListener { listener: self, ch })
    }
}

impl AsyncListener {
    /// [`Listener::bind`], awaited on tokio: listen for RC connections on `addr`.
    pub fn bind(dev: &crate::Device, addr: SocketAddr) -> Result<AsyncListener> {
        Listener::bind(dev, addr)?.into_async()
    }

    /// [`Listener::bind_with`], awaited on tokio.
    pub fn bind_with(
        dev: &crate::Device,
        addr: SocketAddr,
        ps: PortSpace,
        backlog: i32,
    ) -> Result<AsyncListener> {
        Listener::bind_with(dev, addr, ps, backlog)?.into_async()
    }

    /// The listener.
    pub fn listener(&self) -> &Listener {
        &self.listener
    }

    /// The address listened on ([`Listener::local_addr`]).
    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr()
    }

    /// The next connection request, waiting without blocking the thread. Cancel-safe.
    pub async fn next_request(&self) -> Result<ConnectRequest> {
        loop {
            let mut ev = self.ch.next_event().await?;
            // Other events here are of requests that were answered or dropped already.
            if ev.kind != EventType::ConnectRequest {
                continue;
            }
            if let Some(id) = ev.take_id() {
                return Ok(ConnectRequest {
                    id,
                    param: std::mem::replace(&mut ev.param, EventParam::None),
                });
            }
        }
    }

    /// The next request, accepted with a new QP of `init`
    /// ([`ConnectRequest::accept_async`]).
    pub async fn accept(
        &self,
        pd: &ProtectionDomain,
        init: &QpInit<'_>,
        opts: &AcceptOptions,
    ) -> Result<Connection> {
        self.next_request()
            .await?
            .accept_async(pd, init, opts)
            .await
    }

    /// [`AsyncListener::accept`] with a `prepare` step
    /// ([`ConnectRequest::accept_with_async`]).
    pub async fn accept_with(
        &self,
        pd: &ProtectionDomain,
        init: &QpInit<'_>,
        opts: &AcceptOptions,
        prepare: impl FnOnce(&QueuePair) -> Result<()>,
    ) -> Result<Connection> {
        self.next_request()
            .await?
            .accept_with_async(pd, init, opts, prepare)
            .await
    }
}

impl ConnectRequest {
    /// [`ConnectRequest::accept`], with the wait for the client's RTU awaited (RC and
    /// UC; UD answers at once). `opts.timeout` is not used (see the module's
    /// documentation).
    pub async fn accept_async(
        self,
        pd: &ProtectionDomain,
        init: &QpInit<'_>,
        opts: &AcceptOptions,
    ) -> Result<Connection> {
        self.accept_with_async(pd, init, opts, |_| Ok(())).await
    }

    /// [`ConnectRequest::accept_with`], with the wait for the client's RTU awaited.
    pub async fn accept_with_async(
        mut self,
        pd: &ProtectionDomain,
        init: &QpInit<'_>,
        opts: &AcceptOptions,
        prepare: impl FnOnce(&QueuePair) -> Result<()>,
    ) -> Result<Connection> {
        // The same steps as the blocking accept_with, which see.
        let ch = EventChannel::new(self.id.device())?;
        self.id.migrate(&ch)?;
        let ach = ch.into_async()?;
        let peer = self
            .peer_addr()
            .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)));
        let conn = match self.answer(pd, init, opts, prepare)? {
            Answered::Done(conn) => return Ok(conn),
            Answered::AwaitRtu(conn) => conn,
        };
        let ev = ach.next_of(conn.id.handle).await?;
        rtu(conn, &ev, peer)
    }
}

/// [`connect`](super::connect), awaited on tokio: a new QP of `init`'s type connected to
/// the server at `addr`, each CM exchange an `.await`. `opts.timeout` is not used (see
/// the module's documentation); call it inside a tokio runtime with I/O enabled.
pub async fn connect_async(
    pd: &ProtectionDomain,
    init: &QpInit<'_>,
    addr: SocketAddr,
    opts: &ConnectOptions,
) -> Result<Connection> {
    connect_with_async(pd, init, addr, opts, |_| Ok(())).await
}

/// [`connect_with`](super::connect_with), awaited on tokio: `prepare` runs on the QP in
/// INIT before the request goes (post receives there).
pub async fn connect_with_async(
    pd: &ProtectionDomain,
    init: &QpInit<'_>,
    addr: SocketAddr,
    opts: &ConnectOptions,
    prepare: impl FnOnce(&QueuePair) -> Result<()>,
) -> Result<Connection> {
    // The same steps as the blocking connect_with, which see.
    let dev = pd.device();
    let ps = opts
        .port_space
        .unwrap_or_else(|| PortSpace::for_qp_type(init.qp_type));
    let ch = EventChannel::new(dev)?;
    let ach = ch.clone().into_async()?;
    let id = CmId::new(&ch, ps)?;
    let h = id.handle;
    id.resolve_addr(opts.src, addr)?;
    let ev = ach.next_of(h).await?;
    if ev.kind != EventType::AddrResolved {
        return Err(event_error(&ev, "resolving the address", addr));
    }
    id.resolve_route()?;
    let ev = ach.next_of(h).await?;
    if ev.kind != EventType::RouteResolved {
        return Err(event_error(&ev, "resolving the route", addr));
    }
    let qp = send_connect(&id, pd, init, opts, prepare)?;
    let ev = ach.next_of(h).await?;
    connected(id, qp, &ev, ps, opts, addr)
}

impl Connection {
    /// [`Connection::wait_disconnected`], awaited on tokio: until the DISCONNECTED event,
    /// then this side disconnects too. Call it inside a tokio runtime with I/O enabled.
    pub async fn disconnected(&self) -> Result<()> {
        if self.ud.is_some() {
            return Err(Error::invalid("a UD endpoint has no connection to close"));
        }
        if !self.peer_gone.load(Ordering::SeqCst) {
            let ach = self.id.chan.clone().into_async()?;
            while !self.peer_gone.load(Ordering::SeqCst) {
                let ev = ach.next_of(self.id.handle).await?;
                if ev.kind == EventType::Disconnected {
                    self.peer_gone.store(true, Ordering::SeqCst);
                }
            }
        }
        self.disconnect()
    }
}
