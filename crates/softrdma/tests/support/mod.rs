//! What the softrdma test crates share: the access rights the tests grant, a device on
//! loopback, and one side of a connection.

// Each test crate uses part of this.
#![allow(dead_code)]

use softrdma::{
    Access, CompletionQueue, Device, DeviceAddr, DeviceConfig, MemoryRegion, ProtectionDomain,
    QueuePair,
};

/// Every access right a test region or QP grants.
pub const ALL: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_READ)
    .union(Access::REMOTE_ATOMIC);

/// A device named `name` on the first free loopback address, port 4791.
pub fn open(name: &str) -> Device {
    let cfg = DeviceConfig::new(name, DeviceAddr::AutoLoopback(4791));
    Device::open_with(&cfg).expect("open device")
}

/// One side of a connection: a QP on its own device, its CQ, and a region of its PD.
pub struct Side {
    pub dev: Device,
    pub pd: ProtectionDomain,
    pub cq: CompletionQueue,
    pub qp: QueuePair,
    pub mr: MemoryRegion,
}
