//! softrdma: RDMA verbs over RoCEv2 in user space — the Rust API.
//!
//! Every process is its own NIC: a [`Device`] is one UDP endpoint (port 4791) with its own
//! protocol engine and progress thread. The objects follow the verbs model:
//!
//! ```no_run
//! use softrdma::{wr, Access, Device, QpInit, QpType};
//! # fn main() -> softrdma::Result<()> {
//! let dev = Device::open_default()?;
//! let pd = dev.alloc_pd()?;
//! let cq = dev.create_cq(128, None)?; // room for the QP's 64 send and 64 receive WRs
//! let mr = pd.register(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
//! let qp = pd.create_qp(&QpInit::new(QpType::Rc, &cq))?;
//! // send qp.endpoint().with_memory(mr.remote()) to the peer, receive its endpoint, then:
//! # let peer = qp.endpoint();
//! qp.connect_to(&peer, Access::REMOTE_WRITE)?;
//! qp.post_send(wr::send(1, [mr.sge(0..64)?]))?;
//! let wc = cq.wait(std::time::Duration::from_secs(5))?;
//! # Ok(()) }
//! ```
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
//! free their verbs object on drop.

#![warn(missing_docs)]

mod ah;
pub mod cm;
mod cq;
mod device;
mod endpoint;
mod error;
mod mr;
mod pd;
mod qp;
pub mod tcp;
pub mod wr;

pub use ah::{ah_attr, AddressHandle};
pub use cq::{CompletionChannel, CompletionQueue, PollIter};
pub use device::{
    devices, Device, DeviceAddr, DeviceConfig, DeviceInfo, DeviceStats, DriverStats, LinkStats,
};
pub use endpoint::{Endpoint, ENDPOINT_VERSION, PINGPONG_MSG_LEN};
pub use error::{Error, ErrorKind, Rejection, Result};
pub use mr::{DeviceMemory, MemoryRegion, MemoryWindow, MrBuffer, RemoteMemory};
pub use pd::ProtectionDomain;
pub use qp::{PathOptions, QpInit, QueuePair, RemoteQp, SharedReceiveQueue, DEFAULT_QKEY};
pub use softrdma_device::statsfile;
pub use softrdma_transport::verbs;
pub use softrdma_transport::verbs::{
    Access, AhAttr, AsyncEvent, CqId, DeviceAttr, Gid, GlobalRoute, Mtu, MwBind, PortAttr, QpAttr,
    QpAttrMask, QpCap, QpState, QpType, Qpn, RecvWr, SendFlags, SendOp, SendWr, Sge, UdDest,
    WcDetail, WcError, WcFlags, WcOpcode, WcStatus, WorkCompletion,
};
