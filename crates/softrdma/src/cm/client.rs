//! The client's one call: [`connect`] resolves, creates the QP, sends the request and
//! completes the connection on the server's answer, as librdmacm does.

use std::net::SocketAddr;

use softrdma_cm::conn::{self, Depth, RdLimits, Ready};
use softrdma_transport::verbs::QpType;

use super::connection::{conn_param, deadline_of, event_error, next_of};
use super::{CmId, ConnectOptions, Connection, Event, EventChannel, EventType, PortSpace};
use crate::{ProtectionDomain, QpInit, QueuePair, Result};

/// Connect a new QP of `init`'s type to the server at `addr` (`rdma_resolve_addr`,
/// `rdma_resolve_route`, `rdma_create_qp`, `rdma_connect`, and on the server's answer
/// RTR, RTS and the RTU, as librdmacm does). The QP is ready to post on when this
/// returns; [`Connection::private_data`] holds what the server answered.
///
/// A refused request is an ECONNREFUSED error whose
/// [`Error::rejection`](crate::Error::rejection) gives the reason (8 when nothing listens
/// on the port, 28 when the server rejected) and the server's private data; a server that
/// never answers is ETIMEDOUT.
pub fn connect(
    pd: &ProtectionDomain,
    init: &QpInit<'_>,
    addr: SocketAddr,
    opts: &ConnectOptions,
) -> Result<Connection> {
    connect_with(pd, init, addr, opts, |_| Ok(()))
}

/// [`connect`], running `prepare` on the QP once it is in INIT and before the request
/// goes: post receives there, so that the server's first messages find them.
pub fn connect_with(
    pd: &ProtectionDomain,
    init: &QpInit<'_>,
    addr: SocketAddr,
    opts: &ConnectOptions,
    prepare: impl FnOnce(&QueuePair) -> Result<()>,
) -> Result<Connection> {
    let dev = pd.device();
    let ps = opts
        .port_space
        .unwrap_or_else(|| PortSpace::for_qp_type(init.qp_type));
    let deadline = deadline_of(opts.timeout);
    let ch = EventChannel::new(dev)?;
    let id = CmId::new(&ch, ps)?;
    let h = id.handle;
    id.resolve_addr(opts.src, addr)?;
    let ev = next_of(&ch, h, deadline, "resolving the address")?;
    if ev.kind != EventType::AddrResolved {
        return Err(event_error(&ev, "resolving the address", addr));
    }
    id.resolve_route()?;
    let ev = next_of(&ch, h, deadline, "resolving the route")?;
    if ev.kind != EventType::RouteResolved {
        return Err(event_error(&ev, "resolving the route", addr));
    }
    let qp = send_connect(&id, pd, init, opts, prepare)?;
    let ev = next_of(&ch, h, deadline, CONNECTING)?;
    connected(id, qp, &ev, ps, opts, addr)
}

/// What the wait for the server's answer is called in errors.
pub(crate) const CONNECTING: &str = "connecting";

/// The client's steps once the route is resolved: the QP made and prepared, the request
/// sent (shared by [`connect_with`] and its async form).
pub(crate) fn send_connect(
    id: &CmId,
    pd: &ProtectionDomain,
    init: &QpInit<'_>,
    opts: &ConnectOptions,
    prepare: impl FnOnce(&QueuePair) -> Result<()>,
) -> Result<QueuePair> {
    let qp = id.create_qp(pd, init)?;
    prepare(&qp)?;
    let (rr, depth) = RdLimits::of(&pd.device().inner.dev).offer(
        Depth::AtMost(opts.responder_resources),
        Depth::AtMost(opts.initiator_depth),
    );
    let mut p = conn_param(&qp, &opts.private_data, rr, depth);
    p.retry_count = opts.retry_count.min(7);
    p.rnr_retry_count = opts.rnr_retry_count.min(7);
    p.srq = u8::from(init.srq.is_some());
    id.connect(&p)?;
    Ok(qp)
}

/// The client's last step, given the server's answer `ev`: a UD id is ESTABLISHED; a
/// connected one gets a CONNECT_RESPONSE, readies its QP and sends the RTU.
pub(crate) fn connected(
    id: CmId,
    qp: QueuePair,
    ev: &Event,
    ps: PortSpace,
    opts: &ConnectOptions,
    addr: SocketAddr,
) -> Result<Connection> {
    match (ev.kind, ps.qp_type()) {
        (EventType::Established, QpType::Ud) => {
            let ud = ev.ud_param().cloned();
            Ok(Connection::new(id, qp, ev.private_data().to_vec(), ud))
        }
        (EventType::ConnectResponse, t) if t != QpType::Ud => {
            // The depths the CM gives are already the lower of both sides'.
            let ready = Ready {
                min_rnr_timer: Some(opts.min_rnr_timer),
                ..Ready::default()
            };
            let agent = &id.chan.agent;
            conn::complete_connect(agent, id.handle, Some(ready), CmId::modifier(&qp), || {
                let _ = qp.to_error();
            })
            .map_err(|e| {
                let msg = format!("completing the connection to {addr}: {}", e.message());
                e.with_message(msg)
            })?;
            Ok(Connection::new(id, qp, ev.private_data().to_vec(), None))
        }
        _ => Err(event_error(ev, CONNECTING, addr)),
    }
}
