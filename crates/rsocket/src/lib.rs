//! rsockets, softrdma's layer for rdma-core's stream socket protocol over RDMA
//! (`<rdma/rsocket.h>`, protocol version 1), below the faces that offer it.
//!
//! - [`conn`]: one connected socket's protocol (buffers, credits, offers, control
//!   messages, direct writes) as a sans-IO state machine: it asks for work requests
//!   and is told of completions; its wire formats are `softrdma_wire::rsocket`.
//! - [`config`]: the sizes a socket is made with, from rsockets' defaults and rdma-core's
//!   configuration directory.
//! - [`region`]: the memory the RNIC reads and writes for a connection.
//! - [`socket`]: the driver: an [`Unconnected`] socket binds, then listens
//!   ([`Listener`]) or connects ([`Connecting`], step by step or waiting); a [`Socket`]
//!   runs a connection over a device's verbs and CM, posting, polling and waiting.
//!   Every face sits on it.
//!
//! The C face (`rsocket`, `rsend`, …: its fd table, flags, options and errno) and the
//! Rust face sit on the driver; tests also drive [`conn::Conn`] over the transport on
//! the `sim` network.

#![warn(missing_docs)]

pub mod config;
pub mod conn;
pub mod region;
pub mod socket;

pub use config::Config;
pub use conn::{Conn, Keys, Phase, Post, Shutdown};
pub use socket::{Connecting, Listener, Socket, Unconnected};
