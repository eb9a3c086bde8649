//! The server's side: a [`Listener`] takes connection requests, a [`ConnectRequest`]
//! is accepted (QP made, readied, answered, RTU awaited) or rejected.

use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use softrdma_cm::cma::EventParam;
use softrdma_cm::conn::{self, Depth, RdLimits, Ready};

use super::connection::{conn_param, deadline_of, event_error, next_of};
use super::{
    AcceptOptions, CmId, ConnParam, Connection, Event, EventChannel, EventType, PortSpace,
};
use crate::{Device, Error, ProtectionDomain, QpInit, QueuePair, Result};

/// What the server's wait for the RTU is called in errors.
pub(crate) const AWAITING_RTU: &str = "waiting for the client's RTU";

/// Where a server's answer to a request leaves the connection.
pub(crate) enum Answered {
    /// A UD id: connected once the answer went.
    Done(Connection),
    /// A connected id: the client's RTU is still to come.
    AwaitRtu(Connection),
}

impl ConnectRequest {
    /// The server's steps after the id moved to its own channel: the QP made and
    /// prepared, readied with the depths both sides allow, and the answer sent (shared
    /// by [`ConnectRequest::accept_with`] and its async form).
    pub(crate) fn answer(
        self,
        pd: &ProtectionDomain,
        init: &QpInit<'_>,
        opts: &AcceptOptions,
        prepare: impl FnOnce(&QueuePair) -> Result<()>,
    ) -> Result<Answered> {
        let id = self.id;
        let qp = id.create_qp(pd, init)?;
        prepare(&qp)?;
        let client = match self.param {
            EventParam::Conn(p) => p,
            EventParam::Ud(u) => {
                let p = conn_param(&qp, &opts.private_data, 0, 0);
                id.accept(&p)?;
                let conn = Connection::new(id, qp, u.private_data.clone(), Some(u));
                return Ok(Answered::Done(conn));
            }
            EventParam::None => return Err(Error::invalid("not a connection request")),
        };
        let (rr, depth) = RdLimits::of(&pd.device().inner.dev).settle(
            Depth::AtMost(opts.responder_resources),
            Depth::AtMost(opts.initiator_depth),
            client.responder_resources,
            client.initiator_depth,
        );
        let ready = Ready {
            responder: Some(rr),
            initiator: Some(depth),
            min_rnr_timer: Some(opts.min_rnr_timer),
        };
        let mut p = conn_param(&qp, &opts.private_data, rr, depth);
        p.rnr_retry_count = opts.rnr_retry_count.min(7);
        p.srq = u8::from(init.srq.is_some());
        conn::accept(
            &id.chan.agent,
            id.handle,
            Some(ready),
            &p,
            CmId::modifier(&qp),
            || {
                let _ = qp.to_error();
            },
        )?;
        Ok(Answered::AwaitRtu(Connection::new(
            id,
            qp,
            client.private_data,
            None,
        )))
    }
}

/// The server's last step, given the event after its answer: ESTABLISHED, or
/// DISCONNECTED at once (the RTU was lost, the DREQ was not), which still connected.
pub(crate) fn rtu(conn: Connection, ev: &Event, peer: SocketAddr) -> Result<Connection> {
    match ev.kind {
        EventType::Established => Ok(conn),
        EventType::Disconnected => {
            conn.peer_gone.store(true, Ordering::SeqCst);
            Ok(conn)
        }
        _ => Err(event_error(ev, AWAITING_RTU, peer)),
    }
}

/// A listening id (`rdma_listen`) with its own event channel: connection requests queue
/// on it until [`Listener::accept`] or [`Listener::next_request`] takes them. Its fd
/// ([`AsFd`]) is readable while a request waits.
#[derive(Debug)]
pub struct Listener {
    pub(super) id: CmId,
    addr: SocketAddr,
}

impl Listener {
    /// Listen for RC connections on `addr` (the wildcard IP and port 0 allowed) of `dev`.
    /// EADDRINUSE or EADDRNOTAVAIL when another listener holds the port, as Linux says.
    pub fn bind(dev: &Device, addr: SocketAddr) -> Result<Listener> {
        Listener::bind_with(dev, addr, PortSpace::Tcp, 0)
    }

    /// Listen in port space `ps` with `backlog` (0: the default, 1024) requests waiting
    /// at most.
    pub fn bind_with(
        dev: &Device,
        addr: SocketAddr,
        ps: PortSpace,
        backlog: i32,
    ) -> Result<Listener> {
        let ch = EventChannel::new(dev)?;
        let id = CmId::new(&ch, ps)?;
        id.bind(addr)?;
        id.listen(backlog)?;
        let addr = id
            .local_addr()
            .ok_or_else(|| Error::new(libc::EIO, "the listener has no address"))?;
        Ok(Listener { id, addr })
    }

    /// The address listened on; its port is the one chosen when bound to port 0.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The listening id (its channel carries the requests).
    pub fn id(&self) -> &CmId {
        &self.id
    }

    /// Wait for the next connection request; `None` waits forever. ETIMEDOUT when none
    /// came in time.
    pub fn next_request(&self, timeout: Option<Duration>) -> Result<ConnectRequest> {
        let deadline = deadline_of(timeout);
        loop {
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            let mut ev = match self.id.chan.next_event(left) {
                Ok(ev) => ev,
                Err(e) if e.is_timeout() => return Err(Error::timed_out("no connection request")),
                Err(e) => return Err(e),
            };
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

    /// Wait for a connection request (without limit, as `TcpListener::accept`) and
    /// accept it with a new QP of `init` ([`ConnectRequest::accept`]).
    pub fn accept(
        &self,
        pd: &ProtectionDomain,
        init: &QpInit<'_>,
        opts: &AcceptOptions,
    ) -> Result<Connection> {
        self.next_request(None)?.accept(pd, init, opts)
    }

    /// [`Listener::accept`] with a `prepare` step ([`ConnectRequest::accept_with`]).
    pub fn accept_with(
        &self,
        pd: &ProtectionDomain,
        init: &QpInit<'_>,
        opts: &AcceptOptions,
        prepare: impl FnOnce(&QueuePair) -> Result<()>,
    ) -> Result<Connection> {
        self.next_request(None)?
            .accept_with(pd, init, opts, prepare)
    }
}

impl AsFd for Listener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.id.chan.as_fd()
    }
}

/// A connection request a [`Listener`] received, to accept or reject. Dropping it
/// unanswered rejects it.
#[derive(Debug)]
pub struct ConnectRequest {
    pub(super) id: CmId,
    pub(super) param: EventParam,
}

impl ConnectRequest {
    /// The client's private data (56 bytes for RC, zero-padded as the REQ carries it;
    /// 180 for UD).
    pub fn private_data(&self) -> &[u8] {
        match &self.param {
            EventParam::Conn(p) => &p.private_data,
            EventParam::Ud(p) => &p.private_data,
            EventParam::None => &[],
        }
    }
    /// The client's request (QP number, resources, retry counts); None for UD.
    pub fn conn_param(&self) -> Option<&ConnParam> {
        match &self.param {
            EventParam::Conn(p) => Some(p),
            _ => None,
        }
    }
    /// The client's address.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.id.peer_addr()
    }
    /// The address the client connected to.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.id.local_addr()
    }

    /// Accept with a new QP of `init` (RC and UC: RTR and RTS before the REP goes, as
    /// librdmacm's `rdma_accept` does, then wait for the client's RTU; UD: answer with
    /// the QP's number and Q_Key). The connection gets its own event channel.
    pub fn accept(
        self,
        pd: &ProtectionDomain,
        init: &QpInit<'_>,
        opts: &AcceptOptions,
    ) -> Result<Connection> {
        self.accept_with(pd, init, opts, |_| Ok(()))
    }

    /// [`ConnectRequest::accept`], running `prepare` on the QP once it is in INIT and
    /// before the answer goes: post receives there, so that the client's first messages
    /// find them.
    pub fn accept_with(
        mut self,
        pd: &ProtectionDomain,
        init: &QpInit<'_>,
        opts: &AcceptOptions,
        prepare: impl FnOnce(&QueuePair) -> Result<()>,
    ) -> Result<Connection> {
        let ch = EventChannel::new(self.id.device())?;
        self.id.migrate(&ch)?;
        let peer = self
            .peer_addr()
            .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)));
        let conn = match self.answer(pd, init, opts, prepare)? {
            Answered::Done(conn) => return Ok(conn),
            Answered::AwaitRtu(conn) => conn,
        };
        let ev = next_of(&ch, conn.id.handle, deadline_of(opts.timeout), AWAITING_RTU)?;
        rtu(conn, &ev, peer)
    }

    /// Refuse the request (`rdma_reject`) with up to
    /// [`MAX_REJECT_PRIVATE`](super::MAX_REJECT_PRIVATE) bytes of private data, which the
    /// client sees in its [`Error::rejection`].
    pub fn reject(self, private_data: &[u8]) -> Result<()> {
        self.id.reject(private_data)
    }

    /// The request's id, to drive by hand.
    pub fn into_id(self) -> CmId {
        self.id
    }
}
