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

/// A device of its own on the first free loopback address, port 4791, named `name` and a
/// number: a device opened twice under one name is one device, and the tests of a binary
/// run at once, each with devices of its own.
pub fn open(name: &str) -> Device {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let cfg = DeviceConfig::new(&format!("{name}{n}"), DeviceAddr::AutoLoopback(4791));
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

/// Connect `a` and `b` to each other (RC or UC), each granting every access right.
pub fn connect(a: &Side, b: &Side) {
    a.qp.connect_to(&b.qp.endpoint(), ALL).unwrap();
    b.qp.connect_to(&a.qp.endpoint(), ALL).unwrap();
}

/// Two sides made by `side`, connected.
pub fn pair_of(side: impl Fn() -> Side) -> (Side, Side) {
    let (a, b) = (side(), side());
    connect(&a, &b);
    (a, b)
}

/// Tiny seeded PRNG (xorshift64*), so a failing run can be repeated from its seed.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// A number below `n` (0 for `n` 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 > 1.0 - p
    }
}
