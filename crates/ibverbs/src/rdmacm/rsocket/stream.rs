//! A stream rsocket of the C face: where it is in its life (the rsockets layer's
//! [`Unconnected`], [`Connecting`], [`Socket`] or [`Listener`]), and what only a C socket
//! has: its flags, its options and SO_ERROR. The protocol, the connection steps and the
//! device objects are the rsockets layer's.

use std::ffi::c_int;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

use softrdma_rsocket::{Config, Connecting, Listener, Socket, Unconnected};

/// Where a socket is in its life.
pub(super) enum Life {
    /// Made, perhaps bound.
    Fresh(Unconnected),
    /// `rconnect` under way.
    Connecting(Connecting),
    /// Connected (the connection itself says whether it still is).
    Open(Arc<Socket>),
    /// Listening (its accept thread answers requests).
    Listening(Arc<Listener>),
    /// The connect failed (the error is in SO_ERROR).
    Failed,
    /// `rclose` freed it (a thread that was waiting in it must not go on).
    Closed,
}

/// One stream rsocket.
pub(super) struct Stream {
    pub life: Life,
    /// `rbind` succeeded.
    pub bound: bool,
    /// SO_ERROR.
    pub err: c_int,
    /// The connection's failure was given to SO_ERROR already.
    err_taken: bool,
    pub fs_flags: c_int,
    pub fd_flags: c_int,
    pub cfg: Config,
    pub so_opts: u64,
    pub tcp_opts: u64,
    pub ipv6_opts: u64,
    pub ipv4_tos: c_int,
    pub keepalive_time: u32,
    /// A route given with RDMA_ROUTE, checked by the next connect.
    pub route: Option<Vec<u8>>,
}

impl Stream {
    /// A socket in `life` with `cfg`'s sizes.
    pub(super) fn new(life: Life, cfg: Config) -> Stream {
        Stream {
            life,
            bound: false,
            err: 0,
            err_taken: false,
            fs_flags: 0,
            fd_flags: 0,
            cfg,
            so_opts: 0,
            tcp_opts: 0,
            ipv6_opts: 0,
            ipv4_tos: 0,
            keepalive_time: 0,
            route: None,
        }
    }

    /// `rclose` freed it.
    pub(super) fn closed(&self) -> bool {
        matches!(self.life, Life::Closed)
    }

    /// Its connect is under way.
    pub(super) fn opening(&self) -> bool {
        matches!(self.life, Life::Connecting(_))
    }

    /// Not connecting or connected yet: the sizes may still change.
    pub(super) fn before_connect(&self) -> bool {
        matches!(self.life, Life::Fresh(_) | Life::Listening(_))
    }

    /// Its connection, once connected.
    pub(super) fn socket(&self) -> Option<&Arc<Socket>> {
        match &self.life {
            Life::Open(s) => Some(s),
            _ => None,
        }
    }

    /// Connected and neither side has closed.
    pub(super) fn connected(&self) -> bool {
        self.socket()
            .is_some_and(|s| s.phase() == softrdma_rsocket::Phase::Connected)
    }

    /// The CM channel's descriptor: the socket's number.
    pub(super) fn cm_fd(&self) -> Option<RawFd> {
        match &self.life {
            Life::Fresh(u) => Some(u.fd().as_raw_fd()),
            Life::Connecting(c) => c.fd().map(|f| f.as_raw_fd()),
            Life::Open(s) => Some(s.fds()[1].as_raw_fd()),
            Life::Listening(l) => Some(l.fd().as_raw_fd()),
            Life::Failed | Life::Closed => None,
        }
    }

    /// This side's and the peer's addresses.
    pub(super) fn addrs(&self) -> (Option<SocketAddr>, Option<SocketAddr>) {
        match &self.life {
            Life::Fresh(u) => u.addrs(),
            Life::Connecting(c) => c.addrs(),
            Life::Open(s) => s.addrs(),
            Life::Listening(l) => (l.local_addr(), None),
            Life::Failed | Life::Closed => (None, None),
        }
    }

    /// SO_ERROR, taken: the error recorded, else the connection's failure, once.
    pub(super) fn take_error(&mut self) -> c_int {
        if self.err == 0 && !self.err_taken {
            if let Some(e) = self.socket().and_then(|s| s.error()) {
                self.err_taken = true;
                self.err = e;
            }
        }
        std::mem::take(&mut self.err)
    }
}
