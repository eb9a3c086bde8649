//! Object tables and the rules that govern them.
//!
//! [`Context`] owns one table per object family. Each family's module holds its table and
//! the `Context` methods that act on it, including the rules that reach into other
//! families (a PD still in use, a CQ a QP still names): `device` (attributes, GIDs,
//! P_Keys), `pd`, `mr` (regions and the key checks), `mw`, `dm`, `cq` (with channels),
//! `srq`, `qp`, `ah` and `mcast` (multicast attachments); `mem` is the raw access to registered memory.
//!
//! Signatures here are the contract the transport layer codes against.

mod ah;
mod cq;
mod device;
mod dm;
mod fault;
#[cfg(test)]
pub(crate) use fault::copy_for_tests as fault_copy_for_tests;
mod mcast;
mod mem;
mod mr;
mod mw;
mod pd;
mod qp;
mod srq;
mod table;

use std::collections::VecDeque;

pub use cq::Arm;
pub use device::{DeviceAttr, PortAttr};
pub use mem::MemSpan;
pub use mr::{Advice, MrInfo, Prefetch, RemoteKeyError, RemoteView};
pub use mw::inc_rkey;
pub use qp::Qp;

use crate::error::{Errno, Error, ErrorKind, Result};
use crate::types::{AsyncEvent, Gid};
use softrdma_wire::{KeyRng, Seed};

/// Default sizes, after rxe's `rxe_param.h` where that makes sense for a user-space device.
mod limits {
    /// Bytes of device memory in all.
    pub const MAX_DM_SIZE: u64 = 256 * 1024;
    /// P_Key table length.
    pub const PKEY_TBL_LEN: u16 = 64;
    /// Bytes an SGE occupies in a WQE (`struct ibv_sge`): inline data shares that room.
    pub const SGE_BYTES: u32 = 16;
    /// Lowest QPN handed out (0 and 1 are the special QPs; rxe starts at 16 + 1).
    pub const MIN_QPN: u32 = 0x11;
    /// Largest 24-bit number.
    pub const MASK24: u32 = 0x00FF_FFFF;
    /// Multicast groups (rxe's `RXE_MAX_MCAST_GRP`).
    pub const MAX_MCAST_GRP: u32 = 8192;
    /// QPs attached to one group (rxe's `RXE_MAX_MCAST_QP_ATTACH`).
    pub const MAX_MCAST_QP_ATTACH: u32 = 56;
    /// Attachments in all (rxe's `RXE_MAX_TOT_MCAST_QP_ATTACH`).
    pub const MAX_TOTAL_MCAST_QP_ATTACH: u32 = 0x70000;
}

fn einval(msg: &'static str) -> Error {
    Error::inval(msg)
}
/// EINVAL, as verbs answers a handle naming no live object.
fn missing(msg: &'static str) -> Error {
    Error::inval(msg).with_kind(ErrorKind::NotFound)
}
fn ebusy(msg: &'static str) -> Error {
    Error::new(Errno::EBUSY, msg)
}
fn enomem(msg: &'static str) -> Error {
    Error::new(Errno::ENOMEM, msg)
}

/// One device's verbs objects.
#[derive(Debug)]
pub struct Context {
    dev: DeviceAttr,
    port: PortAttr,
    gids: Vec<Gid>,
    pkeys: Vec<u16>,
    rng: KeyRng,
    next_id: u32,
    pds: pd::PdTable,
    mrs: mr::MrTable,
    mws: mw::MwTable,
    dms: dm::DmTable,
    cqs: cq::CqTable,
    channels: cq::ChannelTable,
    srqs: srq::SrqTable,
    qps: qp::QpTable,
    ahs: ah::AhTable,
    mcast: mcast::McastTable,
    events: VecDeque<AsyncEvent>,
}

// The device hands its Context to the progress thread (behind a mutex): it must stay Send,
// which it is through `DmaPtr`, the one holder of raw addresses.
const _: fn() = || {
    fn send<T: Send>() {}
    send::<Context>();
};

impl Context {
    /// A context with default attributes, the given GID table (index 0 first), and the seed
    /// of its key generator, a [`KeyRng`]: memory keys and QP numbers are what a remote
    /// party needs to act on this device, so they come from ChaCha20 keyed from the OS in
    /// production ([`Seed`]), and from a `u64` in tests so that runs replay.
    pub fn new(gids: Vec<Gid>, seed: impl Into<Seed>) -> Context {
        let mut gids = gids;
        gids.truncate(256);
        let g0 = gids.first().copied().unwrap_or_default().0;
        // An EUI-64 style GUID from the low bytes of GID 0, as rxe derives it from the MAC.
        let node_guid =
            u64::from_be_bytes([0x02, g0[13], g0[14], 0xFF, 0xFE, g0[15], g0[12], 0x01]);
        let port = PortAttr::softrdma(gids.len());
        let mut pkeys = vec![0u16; limits::PKEY_TBL_LEN as usize];
        pkeys[0] = 0xFFFF;
        Context {
            dev: DeviceAttr::softrdma(node_guid),
            port,
            gids,
            pkeys,
            rng: KeyRng::new(seed),
            next_id: 1,
            pds: Default::default(),
            mrs: Default::default(),
            mws: Default::default(),
            dms: Default::default(),
            cqs: Default::default(),
            channels: Default::default(),
            srqs: Default::default(),
            qps: Default::default(),
            ahs: Default::default(),
            mcast: Default::default(),
            events: VecDeque::new(),
        }
    }

    fn new_id(&mut self) -> Result<u32> {
        let id = self.next_id;
        self.next_id = id.checked_add(1).ok_or(enomem("object ids exhausted"))?;
        Ok(id)
    }
    /// A fresh key: a random, unused, nonzero 24-bit index and a random 8-bit key byte.
    /// Regions and windows share the index space, so a key names at most one of them.
    fn alloc_key(&mut self) -> Result<u32> {
        for _ in 0..256 {
            let r = self.rng.next_u64();
            let index = (r as u32) & limits::MASK24;
            if index == 0 || self.mrs.has_index(index) || self.mws.has_index(index) {
                continue;
            }
            return Ok((index << 8) | ((r >> 32) as u32 & 0xFF));
        }
        Err(enomem("no free key"))
    }

    /// A random 24-bit first PSN, drawn from the key generator. With the QPN it is what an
    /// off-path sender must guess to inject into a connection (DESIGN decision 7), so
    /// every face takes it from here, never from a generator or a clock of its own.
    pub fn random_psn(&mut self) -> u32 {
        self.rng.next_u32() & limits::MASK24
    }

    /// Queue an async event.
    pub fn push_event(&mut self, ev: AsyncEvent) {
        self.events.push_back(ev);
    }
    /// Take the next async event.
    pub fn next_event(&mut self) -> Option<AsyncEvent> {
        self.events.pop_front()
    }
}
