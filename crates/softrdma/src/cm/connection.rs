//! A connection the helpers made, and what its set-up and teardown share: waiting for
//! one id's events, and the error an unexpected event stands for.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use softrdma_wire::cm::rej_reason;

use super::{CmId, ConnParam, Event, EventChannel, EventType, UdParam};
use crate::error::Rejection;
use crate::{Error, ErrorKind, QueuePair, Result};

/// SIDR_REP statuses (IBTA 12.11.2): nobody serves the service ID; the server refused.
const SIDR_UNSUPPORTED: i32 = 1;
const SIDR_REJECT: i32 = 2;

/// The name of a REJ reason, for messages.
fn reason_name(r: u16) -> &'static str {
    match r {
        rej_reason::NO_QP => "no QP",
        rej_reason::TIMEOUT => "timeout",
        rej_reason::INVALID_SERVICE_ID => "invalid service ID: nothing listens there",
        rej_reason::STALE_CONN => "stale connection",
        rej_reason::CONSUMER_REJECT => "consumer reject: the server refused",
        _ => "see the IBTA REJ reasons",
    }
}

pub(super) fn deadline_of(timeout: Option<Duration>) -> Option<Instant> {
    timeout.map(|t| Instant::now() + t)
}

/// The next event of id `h` on `ch` before `deadline` (events of other ids are
/// dropped: the helpers' channels carry one id).
pub(super) fn next_of(
    ch: &EventChannel,
    h: u32,
    deadline: Option<Instant>,
    what: &str,
) -> Result<Event> {
    loop {
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        match ch.next_event(left) {
            Ok(ev) if ev.id == h => return Ok(ev),
            Ok(_) => continue,
            Err(e) if e.is_timeout() => {
                return Err(Error::timed_out(format!("no answer while {what}")))
            }
            Err(e) => return Err(e),
        }
    }
}

/// The error an unexpected event stands for, while `what`, towards `peer`.
pub(super) fn event_error(ev: &Event, what: &str, peer: SocketAddr) -> Error {
    match ev.kind {
        EventType::Rejected => {
            let reason = u16::try_from(ev.status).unwrap_or(0);
            Error::rejected(
                format!(
                    "connection to {peer} rejected: reason {reason} ({})",
                    reason_name(reason)
                ),
                Rejection {
                    reason,
                    private_data: ev.private_data().to_vec(),
                },
            )
        }
        EventType::Unreachable if ev.status > 0 => {
            // A SIDR_REP's status, as the REJ reason of the same meaning, so that UD and
            // connected clients tell "nobody listens" and "refused" apart alike.
            let reason = match ev.status {
                SIDR_UNSUPPORTED => rej_reason::INVALID_SERVICE_ID,
                SIDR_REJECT => rej_reason::CONSUMER_REJECT,
                s => u16::try_from(s).unwrap_or(0),
            };
            Error::rejected(
                format!(
                    "UD service at {peer} refused: SIDR status {} (reason {reason}: {})",
                    ev.status,
                    reason_name(reason)
                ),
                Rejection {
                    reason,
                    private_data: ev.private_data().to_vec(),
                },
            )
        }
        EventType::Unreachable => Error::new(
            libc::ETIMEDOUT,
            format!("{peer} unreachable: its CM never answered (UNREACHABLE)"),
        )
        .with_kind(ErrorKind::Unreachable),
        EventType::AddrError | EventType::RouteError | EventType::ConnectError => {
            let errno = if ev.status < 0 { -ev.status } else { libc::EIO };
            Error::new(errno, format!("{:?} while {what} ({peer})", ev.kind))
        }
        other => Error::new(
            libc::EPROTO,
            format!("unexpected {other:?} while {what} ({peer})"),
        ),
    }
}

pub(super) fn conn_param(qp: &QueuePair, private_data: &[u8], rr: u8, id: u8) -> ConnParam {
    ConnParam {
        private_data: private_data.to_vec(),
        responder_resources: rr,
        initiator_depth: id,
        qp_num: qp.qpn(),
        ..ConnParam::default()
    }
}

/// A connected QP and the CM id it was connected through. Dropping it disconnects
/// (`rdma_destroy_id` sends the DREQ) and destroys the QP.
pub struct Connection {
    // Declared first so it drops first: the peer hears of the end before the QP goes.
    pub(super) id: CmId,
    qp: QueuePair,
    private_data: Vec<u8>,
    pub(super) ud: Option<UdParam>,
    /// This side disconnected (QP in ERR, DREQ or DREP sent).
    closed: AtomicBool,
    /// The DISCONNECTED event came.
    pub(super) peer_gone: AtomicBool,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("id", &self.id)
            .field("qp", &self.qp)
            .finish()
    }
}

impl Connection {
    pub(super) fn new(
        id: CmId,
        qp: QueuePair,
        private_data: Vec<u8>,
        ud: Option<UdParam>,
    ) -> Connection {
        Connection {
            id,
            qp,
            private_data,
            ud,
            closed: AtomicBool::new(false),
            peer_gone: AtomicBool::new(false),
        }
    }

    /// The connected QP.
    pub fn qp(&self) -> &QueuePair {
        &self.qp
    }
    /// The CM id (its channel carries the connection's later events).
    pub fn id(&self) -> &CmId {
        &self.id
    }
    /// The peer's private data: the server's REP for a client, the client's REQ for a
    /// server, zero-padded to the message's size (196 and 56 bytes) as rdma_cm delivers
    /// it.
    pub fn private_data(&self) -> &[u8] {
        &self.private_data
    }
    /// For UD: a client's [`UdParam`] holds the server's QPN, Q_Key and the address vector
    /// to it (for [`ProtectionDomain::create_ah`](crate::ProtectionDomain::create_ah)); a
    /// server's holds the address vector to the client (its QPN comes with its first
    /// datagram).
    pub fn ud_param(&self) -> Option<&UdParam> {
        self.ud.as_ref()
    }
    /// The local address.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.id.local_addr()
    }
    /// The peer's address.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.id.peer_addr()
    }

    /// `rdma_disconnect`: move the QP to ERR (outstanding work requests complete with
    /// `WR_FLUSH_ERR`) and tell the peer (DREQ, or DREP when it asked first). Both sides
    /// then see DISCONNECTED ([`Connection::wait_disconnected`]). Doing it again does
    /// nothing.
    pub fn disconnect(&self) -> Result<()> {
        if self.ud.is_some() {
            return Err(Error::invalid("a UD endpoint has no connection to close"));
        }
        if self.closed.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        self.qp.to_error()?;
        match self.id.disconnect() {
            // The CM may have finished with the connection already (the peer's DREQ
            // went unanswered long enough): nothing is left to tell.
            Err(e) if e.errno() == libc::EINVAL => Ok(()),
            r => r,
        }
    }

    /// Wait until the connection is over (the DISCONNECTED event: the peer's DREQ, or
    /// its DREP to ours); `None` waits without limit. When the peer ended it, this side
    /// then disconnects too (QP to ERR, DREP), as a closed connection needs. ETIMEDOUT
    /// when the connection still stands at the deadline.
    pub fn wait_disconnected(&self, timeout: Option<Duration>) -> Result<()> {
        if self.ud.is_some() {
            return Err(Error::invalid("a UD endpoint has no connection to close"));
        }
        let deadline = deadline_of(timeout);
        while !self.peer_gone.load(Ordering::SeqCst) {
            let ev = next_of(
                &self.id.chan,
                self.id.handle,
                deadline,
                "waiting for DISCONNECTED",
            )?;
            if ev.kind == EventType::Disconnected {
                self.peer_gone.store(true, Ordering::SeqCst);
            }
        }
        self.disconnect()
    }

    /// Whether the DISCONNECTED event has been seen.
    pub fn is_disconnected(&self) -> bool {
        self.peer_gone.load(Ordering::SeqCst)
    }

    /// The QP and the id, to manage by hand (dropping the id still disconnects).
    pub fn into_parts(self) -> (QueuePair, CmId) {
        (self.qp, self.id)
    }
}
