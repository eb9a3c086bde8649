//! softrdma `verbs` layer: the RDMA objects and their rules, with no I/O, threads or clocks.
//!
//! A [`Context`] is one device's object tables: protection domains, memory regions and
//! windows, completion queues and channels, shared receive queues, queue pairs (their
//! state machine and receive queues), address handles and device memory. The transport
//! layer drives it; the faces (Rust API, C ABI) call it through the device.

#![warn(missing_docs)]

mod context;
mod error;
mod qp_table;
#[cfg(test)]
mod tests;
mod types;

pub use context::*;
pub use error::{Errno, Error, ErrorKind, Result};
pub use types::*;
