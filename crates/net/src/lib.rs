//! softrdma net layer: drivers that move datagrams.
//!
//! This crate knows nothing about queue pairs or RDMA semantics; it only moves UDP
//! payloads between addresses. [`sim`] is an in-memory, seeded, virtual-time network
//! for deterministic tests; `udp` (Linux) is the real UDP socket driver; `shm` (Linux)
//! adds shared-memory rings between the devices of one host to it. [`Link`] is the
//! interface a device runs on, which both offer (the `sim` one as `sim::SimLink`).

// `deny` rather than `forbid` so that the one module that must call the socket API
// can opt out below; everything else stays free of `unsafe`.
#![deny(unsafe_code)]
#![warn(missing_docs)]

#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
pub mod ifaddrs;
#[cfg(target_os = "linux")]
mod link;
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
pub mod shm;
pub mod sim;
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
pub mod udp;

#[cfg(target_os = "linux")]
pub use link::{Link, PeerPath, SleepGate};
