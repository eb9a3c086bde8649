//! The same-host path: between two softrdma devices of one host (and one user and network
//! namespace), datagrams go through shared-memory rings instead of the kernel's UDP
//! stack on loopback. They are the same RoCEv2 packets the transport makes for UDP, so
//! every verbs semantic is the UDP path's by construction, and a trace shows them alike.
//!
//! - [`ring`]: a single-producer single-consumer ring of packet slots in a sealed memfd.
//! - [`HostLink`]: a [`crate::Link`] that combines a UDP socket and the rings: a datagram
//!   for a device of this host whose rendezvous socket it finds goes into the ring to it,
//!   anything else by UDP; receiving drains the rings and the socket.
//!
//! Rendezvous. Each device listens on a Unix socket in the per-user run directory (the
//! caller passes its descriptor; names are made relative to it and never followed),
//! named after the network namespace and the device's address and port. The first
//! datagram for a device of this host connects to its socket, checks with `SO_PEERCRED`
//! that the listener is this user's, makes a ring and passes its memfd over the socket
//! (`SCM_RIGHTS`); the receiver checks the peer's credentials too, maps the ring (only a
//! memfd of the exact size, sealed against resizing), and answers with an eventfd it made,
//! which the sender writes to wake it. Each direction's ring is made by its sender. The
//! connection stays open while the ring is used: its end (the peer exited, even by
//! SIGKILL) drops the ring on both sides, and the next datagram connects again, to a
//! restarted peer if there is one. Nothing outlives the processes but the socket's name,
//! removed when the link is dropped and replaced when stale.
//!
//! Another user's devices are not reached this way: the run directory is per user, and
//! a peer with another uid on either end of a connection is refused (its traffic stays on
//! UDP).

pub mod cma;
pub mod grants;
mod map;
pub mod ring;

mod host;

pub use host::{HostLink, Placer};
