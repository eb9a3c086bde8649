//! softrdma's connection manager.
//!
//! - [`ib`]: the IB CM protocol (REQ / REP / RTU / DREQ / DREP / REJ / MRA and SIDR)
//!   that rdma_cm speaks over RoCEv2 between the QP1s of two devices, as a sans-IO state
//!   machine driven by MADs and explicit time.

#![warn(missing_docs)]

pub mod ib;
