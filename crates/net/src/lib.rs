//! softrdma net layer: drivers that move datagrams.
//!
//! This crate knows nothing about queue pairs or RDMA semantics; it only moves UDP
//! payloads between addresses. [`sim`] is an in-memory, seeded, virtual-time network
//! for deterministic tests.

#![forbid(unsafe_code)]

pub mod sim;
