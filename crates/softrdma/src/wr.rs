//! Builders for the common work requests. Every send built here is SIGNALED.
//!
//! The one-sided builders ([`write()`], [`read()`], the atomics) check what they can see
//! before anything is posted: the local SGEs' total length against the [`RemoteMemory`]
//! they target and the offset into it, and for atomics the 8-byte alignment. A mistake
//! is then an error of kind [`ErrorKind::OutOfBounds`] or [`ErrorKind::Misaligned`] at
//! the call, instead of a NAK from the peer that moves both QPs to ERROR.

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
