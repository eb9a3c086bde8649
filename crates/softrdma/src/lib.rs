//! softrdma: RDMA verbs over RoCEv2 in user space — the Rust API.
//!
//! Every process is its own NIC: a [`Device`] is one UDP endpoint (port 4791) with its own
//! protocol engine and progress thread, so nothing here needs an RDMA NIC, a kernel module
//! or root. The objects follow the verbs model of libibverbs, and a softrdma device speaks
//! RoCEv2 on the wire, so its peer may be another softrdma process, a C verbs program on
//! softrdma's drop-in `libibverbs.so.1`, or Linux Soft-RoCE.
//!
//! The whole flow on one device, two RC queue pairs connected to each other (between two
//! processes, each side does its half and they exchange their [`Endpoint`]s
//! over a socket of their own, or connect through the connection manager, [`cm`]):
//!
//! ```
//! use std::time::Duration;
//! use softrdma::{wr, Access, Device, QpInit, QpType, WcOpcode};
//! # fn main() -> softrdma::Result<()> {
//! let t = Duration::from_secs(5);
//! // With no configuration, the default device takes the first free 127.0.0.x:4791.
//! let dev = Device::open_default()?;
//! let pd = dev.alloc_pd()?;
//! let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
//!
//! // Each side: a CQ with room for its QP's 64 send and 64 receive WRs, a QP, memory.
//! let (a_cq, b_cq) = (dev.create_cq(128, None)?, dev.create_cq(128, None)?);
//! let a = pd.create_qp(&QpInit::new(QpType::Rc, &a_cq))?;
//! let b = pd.create_qp(&QpInit::new(QpType::Rc, &b_cq))?;
//! let a_mem = pd.register(4096, access)?;
//! let b_mem = pd.register(4096, access)?;
//!
//! // Connect: each QP is given the other's endpoint (GID, QP number, the PSN it chose).
//! a.connect_to(&b.endpoint(), access)?;
//! b.connect_to(&a.endpoint(), access)?;
//!
//! // SEND / RECV: the receiver posts a buffer first.
//! b.post_recv(wr::recv(1, [b_mem.sge(0..64)?]))?;
//! a_mem.write(0, b"hello")?;
//! a.post_send(wr::send(2, [a_mem.sge(0..5)?]))?;
//! let wc = a_cq.wait(t)?;
//! wc.result()?; // a failed work request as an Error (status and detail)
//! assert_eq!(wc.opcode, WcOpcode::Send);
//! let wc = b_cq.wait(t)?;
//! wc.result()?;
//! assert_eq!((wc.wr_id, wc.byte_len), (1, 5));
//! assert_eq!(b_mem.to_vec(0, 5)?, b"hello");
//!
//! // RDMA WRITE into b's memory and READ it back: one-sided, b posts nothing.
//! a_mem.write(100, b"written")?;
//! a.post_send(wr::write(3, [a_mem.sge(100..107)?], &b_mem.remote(), 1000)?)?;
//! a_cq.wait(t)?.result()?;
//! assert_eq!(b_mem.to_vec(1000, 7)?, b"written");
//! a.post_send(wr::read(4, [a_mem.sge(200..207)?], &b_mem.remote(), 1000)?)?;
//! let wc = a_cq.wait(t)?;
//! assert_eq!((wc.wr_id, wc.opcode), (4, WcOpcode::RdmaRead));
//! wc.result()?;
//! assert_eq!(a_mem.to_vec(200, 7)?, b"written");
//! # Ok(()) }
//! ```
//!
//! Where to read on: [`Device`] (opening, attributes, async events), [`MemoryRegion`]
//! (registration and what the device may do with the memory), [`QueuePair`] (states,
//! connection, posting), [`wr`] (work requests, atomics), [`CompletionQueue`] (polling,
//! waiting, overflow) and [`CompletionChannel`] (waiting for events on a file
//! descriptor).
//!
//! An [`Endpoint`] carries what the peer needs (GID, QP number, the PSN the QP chose, the
//! memory it may access) in one value that serializes (serde, a versioned byte form, the
//! text of `ibv_rc_pingpong`); [`tcp::connect`] and [`tcp::accept`] exchange endpoints and
//! connect in one call, and a program can instead connect through the connection manager
//! as librdmacm programs do: see [`cm`].
//!
//! Misuse the API can see is refused at the call with an [`ErrorKind`] to match on, and
//! leaves the QP as it was, where a NIC would fail the work request in its completion and
//! move the QP to ERROR: SGE ranges ([`MemoryRegion::sge`]) and remote ranges ([`wr`])
//! are checked like slice indexing, every post checks its SGEs' lkeys, PD, access and
//! bounds ([`QueuePair::post_send`]), and a QP whose queues would overcommit a CQ is not
//! created ([`ProtectionDomain::create_qp`]). A QP in ERROR is brought back with
//! [`QueuePair::reset`] and connected again.
//!
//! Memory is DMA-like: a registered region is written by the device at any time. Safe
//! registration ([`ProtectionDomain::register`]) owns its buffer and exposes it only by
//! copying and atomics; [`ProtectionDomain::register_raw`] is `unsafe` with a written
//! contract. Objects keep their parents alive (a QP its PD and CQs, an MR its PD, …) and
//! free their verbs object on drop. A posted work request keeps the memory regions it
//! names registered until its completion is polled, so dropping a region's handle while
//! a request uses it is harmless (see [`MemoryRegion`'s dropping](MemoryRegion#sharing-and-dropping)).

#![warn(missing_docs)]

mod ah;
pub mod cm;
mod cq;
mod device;
mod endpoint;
mod error;
mod mr;
mod pd;
pub mod pingpong;
mod pins;
mod qp;
pub mod rsocket;
pub mod tcp;
#[cfg(feature = "tokio")]
pub mod tokio_support;
pub mod wr;

#[cfg(feature = "tokio")]
pub use crate::tokio_support::{AsyncCompletionQueue, AsyncDeviceEvents};
pub use ah::{ah_attr, AddressHandle};
pub use cq::{CompletionChannel, CompletionQueue, PollIter};
pub use device::{
    devices, Device, DeviceAddr, DeviceConfig, DeviceEntry, DeviceInfo, DeviceStats, DriverStats,
    EngineStats, LinkStats,
};
pub use endpoint::{Endpoint, ENDPOINT_VERSION, PINGPONG_MSG_LEN};
pub use error::{ConfigError, Error, ErrorKind, Rejection, Result};
pub use mr::{DeviceMemory, MemoryRegion, MemoryWindow, MrBuffer, RemoteMemory};
pub use pd::ProtectionDomain;
pub use qp::{PathOptions, QpInit, QueuePair, RemoteQp, SharedReceiveQueue, DEFAULT_QKEY};
pub use softrdma_device::statsfile;
pub use softrdma_transport::verbs;
pub use softrdma_transport::verbs::{
    Access, AhAttr, AhId, AsyncEvent, ChannelId, CqId, DeviceAttr, Gid, GlobalRoute, Mtu, MwBind,
    MwId, PdId, PortAttr, QpAttr, QpAttrMask, QpCap, QpState, QpType, Qpn, RecvWr, SendFlags,
    SendOp, SendWr, Sge, SrqId, UdDest, WcDetail, WcError, WcFlags, WcOpcode, WcStatus,
    WorkCompletion,
};
pub use softrdma_transport::{Keepalive, KeepalivePolicy};
