//! Builders for the common work requests. Every send built here is SIGNALED.
//!
//! The one-sided builders ([`write()`], [`read()`], the atomics) check what they can see
//! before anything is posted: the local SGEs' total length against the [`RemoteMemory`]
//! they target and the offset into it, and for atomics the 8-byte alignment. A mistake
//! is then an error of kind [`ErrorKind::OutOfBounds`] or [`ErrorKind::Misaligned`] at
//! the call, instead of a NAK from the peer that moves both QPs to ERROR.
//!
//! For anything else (unsignaled sends, inline data, fences, memory window binds, UD
//! with options), fill a [`SendWr`] by hand, or change the fields of one built here.
//!
//! # Atomics
//!
//! [`compare_swap`] and [`fetch_add`] work on the 64-bit word at an 8-byte aligned
//! address of the peer's memory, a native-endian `u64` of the peer's host (what its
//! [`MemoryRegion::read_u64`](crate::MemoryRegion::read_u64) reads; on the wire the
//! operands travel big-endian). The word's old value lands in the 8-byte `result` SGE in
//! this host's byte order, as the C face (`ibv_post_send`) writes it too: read it with
//! [`MemoryRegion::read_u64`](crate::MemoryRegion::read_u64) or `u64::from_ne_bytes`.
//! The result region needs LOCAL_WRITE, the target region REMOTE_ATOMIC and the target
//! QP must grant it.
//!
//! ```
//! use std::time::Duration;
//! use softrdma::{wr, Access, Device, ErrorKind, QpInit, QpType};
//! # fn main() -> softrdma::Result<()> {
//! let t = Duration::from_secs(5);
//! let dev = Device::open_default()?;
//! let pd = dev.alloc_pd()?;
//! let cq = dev.create_cq(256, None)?;
//! let (a, b) = (
//!     pd.create_qp(&QpInit::new(QpType::Rc, &cq))?,
//!     pd.create_qp(&QpInit::new(QpType::Rc, &cq))?,
//! );
//! let grant = Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
//! a.connect(&b.local(0), 0, grant)?;
//! b.connect(&a.local(0), 0, grant)?;
//! let local = pd.register(4096, Access::LOCAL_WRITE)?;
//! let target = pd.register(4096, Access::LOCAL_WRITE | grant)?;
//! let remote = target.remote(); // what b's side would send a
//!
//! // WRITE 11 bytes at offset 100 of the target, READ them back to offset 500.
//! local.write(0, b"over RoCEv2")?;
//! a.post_send(wr::write(1, [local.sge(0..11)?], &remote, 100)?)?;
//! a.post_send(wr::read(2, [local.sge(500..511)?], &remote, 100)?)?;
//! for wc in cq.wait_n(2, t)? {
//!     wc.result()?;
//! }
//! assert_eq!(local.to_vec(500, 11)?, b"over RoCEv2");
//!
//! // FETCH_AND_ADD, then COMPARE_AND_SWAP, on the word at offset 8 of the target.
//! assert_eq!(target.addr() % 8, 0); // heap buffers are 8-byte aligned
//! target.write_u64(8, 40)?;
//! a.post_send(wr::fetch_add(3, local.sge(0..8)?, &remote, 8, 2)?)?;
//! cq.wait(t)?.result()?;
//! assert_eq!(local.read_u64(0)?, 40); // the old value, in host byte order
//! a.post_send(wr::compare_swap(4, local.sge(8..16)?, &remote, 8, 42, 7)?)?;
//! cq.wait(t)?.result()?;
//! assert_eq!(local.read_u64(8)?, 42); // it matched, so the swap happened
//! assert_eq!(target.read_u64(8)?, 7);
//!
//! // What the peer would refuse is refused here, before anything is posted.
//! let e = wr::write(5, [local.sge(0..64)?], &remote, 4090).unwrap_err();
//! assert_eq!(e.kind(), ErrorKind::OutOfBounds);
//! let e = wr::fetch_add(6, local.sge(0..8)?, &remote, 4, 1).unwrap_err();
//! assert_eq!(e.kind(), ErrorKind::Misaligned);
//! # Ok(()) }
//! ```

use softrdma_transport::verbs::{RecvWr, SendFlags, SendOp, SendWr, Sge, UdDest};

use crate::{Error, ErrorKind, RemoteMemory, Result};

fn signaled(wr_id: u64, op: SendOp, sg: Vec<Sge>) -> SendWr {
    SendWr {
        wr_id,
        op,
        flags: SendFlags::SIGNALED,
        sg_list: sg,
        inline_data: None,
        ud: None,
    }
}

/// The remote address of the message `sg` describes at `remote` + `offset`, checked
/// against the descriptor.
fn remote_for(sg: &[Sge], remote: &RemoteMemory, offset: u64) -> Result<u64> {
    let len: u64 = sg.iter().map(|s| u64::from(s.length)).sum();
    remote.checked_at(offset, len)
}

/// The remote address of the 8-byte word at `remote` + `offset`: inside the descriptor
/// and 8-byte aligned, as the responder requires of an atomic.
fn atomic_target(remote: &RemoteMemory, offset: u64) -> Result<u64> {
    let va = remote.checked_at(offset, 8)?;
    if va % 8 != 0 {
        return Err(
            Error::invalid("atomic target not 8-byte aligned").with_kind(ErrorKind::Misaligned)
        );
    }
    Ok(va)
}

/// SEND.
pub fn send(wr_id: u64, sg: impl Into<Vec<Sge>>) -> SendWr {
    signaled(wr_id, SendOp::Send, sg.into())
}
/// SEND with immediate data.
pub fn send_with_imm(wr_id: u64, sg: impl Into<Vec<Sge>>, imm: u32) -> SendWr {
    signaled(wr_id, SendOp::SendWithImm { imm }, sg.into())
}
/// SEND that invalidates `rkey` at the responder.
pub fn send_with_inv(wr_id: u64, sg: impl Into<Vec<Sge>>, rkey: u32) -> SendWr {
    signaled(
        wr_id,
        SendOp::SendWithInv {
            invalidate_rkey: rkey,
        },
        sg.into(),
    )
}
/// RDMA WRITE of `sg` to `remote` + `offset`; OutOfBounds if it would reach past `remote`.
pub fn write(
    wr_id: u64,
    sg: impl Into<Vec<Sge>>,
    remote: &RemoteMemory,
    offset: u64,
) -> Result<SendWr> {
    let sg = sg.into();
    let remote_addr = remote_for(&sg, remote, offset)?;
    Ok(signaled(
        wr_id,
        SendOp::Write {
            remote_addr,
            rkey: remote.rkey,
        },
        sg,
    ))
}
/// RDMA WRITE with immediate data (consumes a receive WR at the peer); OutOfBounds as
/// [`write()`].
pub fn write_with_imm(
    wr_id: u64,
    sg: impl Into<Vec<Sge>>,
    remote: &RemoteMemory,
    offset: u64,
    imm: u32,
) -> Result<SendWr> {
    let sg = sg.into();
    let remote_addr = remote_for(&sg, remote, offset)?;
    Ok(signaled(
        wr_id,
        SendOp::WriteWithImm {
            remote_addr,
            rkey: remote.rkey,
            imm,
        },
        sg,
    ))
}
/// RDMA READ from `remote` + `offset` into `sg`; OutOfBounds if `sg` holds more than
/// `remote` has from `offset` on.
pub fn read(
    wr_id: u64,
    sg: impl Into<Vec<Sge>>,
    remote: &RemoteMemory,
    offset: u64,
) -> Result<SendWr> {
    let sg = sg.into();
    let remote_addr = remote_for(&sg, remote, offset)?;
    Ok(signaled(
        wr_id,
        SendOp::Read {
            remote_addr,
            rkey: remote.rkey,
        },
        sg,
    ))
}
/// 64-bit compare-and-swap at `remote` + `offset`; the old value lands in `result` (8
/// bytes). The word must lie inside `remote` (OutOfBounds) at an 8-byte aligned address
/// (Misaligned).
pub fn compare_swap(
    wr_id: u64,
    result: Sge,
    remote: &RemoteMemory,
    offset: u64,
    compare: u64,
    swap: u64,
) -> Result<SendWr> {
    Ok(signaled(
        wr_id,
        SendOp::CompareSwap {
            remote_addr: atomic_target(remote, offset)?,
            rkey: remote.rkey,
            compare,
            swap,
        },
        vec![result],
    ))
}
/// 64-bit fetch-and-add at `remote` + `offset`; the old value lands in `result` (8
/// bytes). Checked as [`compare_swap`].
pub fn fetch_add(
    wr_id: u64,
    result: Sge,
    remote: &RemoteMemory,
    offset: u64,
    add: u64,
) -> Result<SendWr> {
    Ok(signaled(
        wr_id,
        SendOp::FetchAdd {
            remote_addr: atomic_target(remote, offset)?,
            rkey: remote.rkey,
            add,
        },
        vec![result],
    ))
}
/// UD SEND to `dest` (see [`crate::AddressHandle::dest`]).
pub fn ud_send(wr_id: u64, sg: impl Into<Vec<Sge>>, dest: UdDest) -> SendWr {
    let mut w = signaled(wr_id, SendOp::Send, sg.into());
    w.ud = Some(dest);
    w
}
/// A receive WR.
pub fn recv(wr_id: u64, sg: impl Into<Vec<Sge>>) -> RecvWr {
    RecvWr {
        wr_id,
        sg_list: sg.into(),
    }
}
