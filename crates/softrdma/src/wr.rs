//! Builders for the common work requests. Every send built here is SIGNALED.

use softrdma_transport::verbs::{RecvWr, SendFlags, SendOp, SendWr, Sge, UdDest};

use crate::RemoteMemory;

fn signaled(wr_id: u64, op: SendOp, sg: impl Into<Vec<Sge>>) -> SendWr {
    SendWr {
        wr_id,
        op,
        flags: SendFlags::SIGNALED,
        sg_list: sg.into(),
        inline_data: None,
        ud: None,
    }
}

/// SEND.
pub fn send(wr_id: u64, sg: impl Into<Vec<Sge>>) -> SendWr {
    signaled(wr_id, SendOp::Send, sg)
}
/// SEND with immediate data.
pub fn send_with_imm(wr_id: u64, sg: impl Into<Vec<Sge>>, imm: u32) -> SendWr {
    signaled(wr_id, SendOp::SendWithImm { imm }, sg)
}
/// SEND that invalidates `rkey` at the responder.
pub fn send_with_inv(wr_id: u64, sg: impl Into<Vec<Sge>>, rkey: u32) -> SendWr {
    signaled(
        wr_id,
        SendOp::SendWithInv {
            invalidate_rkey: rkey,
        },
        sg,
    )
}
/// RDMA WRITE to `remote` + `offset`.
pub fn write(wr_id: u64, sg: impl Into<Vec<Sge>>, remote: &RemoteMemory, offset: u64) -> SendWr {
    signaled(
        wr_id,
        SendOp::Write {
            remote_addr: remote.at(offset),
            rkey: remote.rkey,
        },
        sg,
    )
}
/// RDMA WRITE with immediate data (consumes a receive WR at the peer).
pub fn write_with_imm(
    wr_id: u64,
    sg: impl Into<Vec<Sge>>,
    remote: &RemoteMemory,
    offset: u64,
    imm: u32,
) -> SendWr {
    signaled(
        wr_id,
        SendOp::WriteWithImm {
            remote_addr: remote.at(offset),
            rkey: remote.rkey,
            imm,
        },
        sg,
    )
}
/// RDMA READ from `remote` + `offset` into `sg`.
pub fn read(wr_id: u64, sg: impl Into<Vec<Sge>>, remote: &RemoteMemory, offset: u64) -> SendWr {
    signaled(
        wr_id,
        SendOp::Read {
            remote_addr: remote.at(offset),
            rkey: remote.rkey,
        },
        sg,
    )
}
/// 64-bit compare-and-swap at `remote` + `offset`; the old value lands in `result` (8 bytes).
pub fn compare_swap(
    wr_id: u64,
    result: Sge,
    remote: &RemoteMemory,
    offset: u64,
    compare: u64,
    swap: u64,
) -> SendWr {
    signaled(
        wr_id,
        SendOp::CompareSwap {
            remote_addr: remote.at(offset),
            rkey: remote.rkey,
            compare,
            swap,
        },
        [result],
    )
}
/// 64-bit fetch-and-add at `remote` + `offset`; the old value lands in `result` (8 bytes).
pub fn fetch_add(wr_id: u64, result: Sge, remote: &RemoteMemory, offset: u64, add: u64) -> SendWr {
    signaled(
        wr_id,
        SendOp::FetchAdd {
            remote_addr: remote.at(offset),
            rkey: remote.rkey,
            add,
        },
        [result],
    )
}
/// UD SEND to `dest` (see [`crate::AddressHandle::dest`]).
pub fn ud_send(wr_id: u64, sg: impl Into<Vec<Sge>>, dest: UdDest) -> SendWr {
    let mut w = signaled(wr_id, SendOp::Send, sg);
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
