//! softrdma's connection manager.
//!
//! - [`cma`]: the rdma_cm model (ids, port spaces, resolve / listen / connect / accept /
//!   reject / disconnect and their events) over the protocol, sans-IO like it.
//! - [`ib`]: the IB CM protocol (REQ / REP / RTU / DREQ / DREP / REJ / MRA and SIDR)
//!   that rdma_cm speaks over RoCEv2 between the QP1s of two devices, as a sans-IO state
//!   machine driven by MADs and explicit time.
//! - [`agent`]: a device's CM with its thread (MADs from the device's QP1, timers) and
//!   the event channels programs wait on.
//! - [`conn`]: librdmacm's steps around the CM's messages (READ/atomic depths against
//!   the device's limits, the QP readied from the REQ/REP, the RTU), for every face.
//! - [`host`]: the host-wide port space of a real device, over the device registry.

#![warn(missing_docs)]

pub mod agent;
pub mod cma;
pub mod conn;
pub mod host;
pub mod ib;

/// The REJ reasons a CM consumer may name (IBTA's numbers, as `softrdma_wire` defines them).
pub use softrdma_wire::cm::rej_reason;
