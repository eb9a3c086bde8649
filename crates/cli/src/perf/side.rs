//! One side of a session: its buffer, CQ and QP, what it tells the peer, and its waits for
//! completions and for the peer's writes.

use std::time::Instant;

use softrdma::cm::Connection;
use softrdma::{
    wr, Access, CompletionQueue, Device, MemoryRegion, PathOptions, ProtectionDomain, QpCap,
    QpInit, QpType, QueuePair, RemoteMemory, RemoteQp, WcOpcode, WcStatus, WorkCompletion,
};

use crate::session::{self, Poller};
use crate::CmdResult;

use super::{RQ_DEPTH, SQ_DEPTH};

/// A side's QP: its own (connected after the TCP exchange), or the one of its rdma_cm
/// connection (`--cm`). Either way the session posts on it as on a plain QP.
pub enum SideQp {
    Own(QueuePair),
    Cm(Connection),
}

impl std::ops::Deref for SideQp {
    type Target = QueuePair;
    fn deref(&self) -> &QueuePair {
        match self {
            SideQp::Own(q) => q,
            SideQp::Cm(c) => c.qp(),
        }
    }
}

/// What a side registers before it has a QP: its PD, buffer and CQ.
pub struct Resources {
    pub(super) pd: ProtectionDomain,
    pub(super) cq: CompletionQueue,
    pub(super) mr: MemoryRegion,
    pub(super) half: usize,
}

impl Resources {
    pub fn new(dev: &Device, max_size: u32) -> CmdResult<Resources> {
        let half = (max_size.max(64) as usize).next_multiple_of(64);
        let pd = dev
            .alloc_pd()
            .map_err(|e| format!("couldn't allocate PD: {e}"))?;
        let mr = pd
            .register(
                2 * half,
                Access::LOCAL_WRITE
                    | Access::REMOTE_WRITE
                    | Access::REMOTE_READ
                    | Access::REMOTE_ATOMIC,
            )
            .map_err(|e| format!("couldn't register {} bytes: {e}", 2 * half))?;
        let cq = dev
            .create_cq(SQ_DEPTH + RQ_DEPTH, None)
            .map_err(|e| format!("couldn't create CQ: {e}"))?;
        Ok(Resources { pd, cq, mr, half })
    }
    pub(super) fn qp_init(&self) -> QpInit<'_> {
        let mut init = QpInit::new(QpType::Rc, &self.cq);
        init.cap = QpCap {
            max_send_wr: SQ_DEPTH,
            max_recv_wr: RQ_DEPTH,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 64,
        };
        init
    }
    /// The receive area as the peer addresses it.
    pub(super) fn remote(&self) -> RemoteMemory {
        RemoteMemory {
            addr: self.mr.addr(),
            rkey: self.mr.rkey(),
            len: self.half as u64,
        }
    }
    pub(super) fn post_recvs(&self, qp: &QueuePair, n: u32) -> CmdResult {
        for _ in 0..n {
            qp.post_recv(wr::recv(0, [self.mr.sge(0..self.half).map_err(range_err)?]))
                .map_err(|e| format!("couldn't post receive: {e}"))?;
        }
        Ok(())
    }
    /// A side around the QP of an rdma_cm connection (its send PSN is the CM's).
    pub(super) fn into_side(self, conn: Connection) -> CmdResult<Side> {
        let psn = conn
            .qp()
            .query()
            .map_err(|e| format!("couldn't query the QP: {e}"))?
            .sq_psn;
        Ok(Side {
            qp: SideQp::Cm(conn),
            cq: self.cq,
            mr: self.mr,
            half: self.half,
            psn,
            memory_wait: false,
        })
    }
}

/// One side's resources: buffer, CQ, QP.
pub struct Side {
    pub qp: SideQp,
    pub cq: CompletionQueue,
    pub mr: MemoryRegion,
    /// Half the buffer: the receive area is `0..half`, the send area `half..2*half`.
    pub half: usize,
    pub psn: u32,
    /// write-lat: wait for the peer's WRITE by watching memory only (`--memory-wait`).
    pub memory_wait: bool,
}

impl Side {
    pub fn new(dev: &Device, max_size: u32) -> CmdResult<Side> {
        let r = Resources::new(dev, max_size)?;
        let qp =
            r.pd.create_qp(&r.qp_init())
                .map_err(|e| format!("couldn't create QP: {e}"))?;
        // INIT now, so receives can be posted before the peer is known.
        qp.to_init(Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC)
            .map_err(|e| format!("failed to modify QP to INIT: {e}"))?;
        // The first PSN the engine drew for the QP (DESIGN decision 7).
        let psn = qp.endpoint().psn;
        Ok(Side {
            qp: SideQp::Own(qp),
            cq: r.cq,
            mr: r.mr,
            half: r.half,
            psn,
            memory_wait: false,
        })
    }
    pub(super) fn local(&self) -> Peer {
        Peer {
            // The PSN the side sends from: the engine's draw for its own QP, the CM's
            // for a connected one.
            qp: RemoteQp {
                psn: self.psn,
                ..self.qp.endpoint().remote_qp()
            },
            mem: RemoteMemory {
                addr: self.mr.addr(),
                rkey: self.mr.rkey(),
                len: self.half as u64,
            },
        }
    }
    pub(super) fn post_recvs(&self, n: u32) -> CmdResult {
        for _ in 0..n {
            self.qp
                .post_recv(wr::recv(0, [self.mr.sge(0..self.half).map_err(range_err)?]))
                .map_err(|e| format!("couldn't post receive: {e}"))?;
        }
        Ok(())
    }
    pub(super) fn connect(&self, peer: &Peer, mtu: softrdma::Mtu) -> CmdResult {
        let o = PathOptions {
            mtu,
            ..Default::default()
        };
        self.qp
            .to_rtr_with(&peer.qp, &o)
            .and_then(|()| self.qp.to_rts_with(self.psn, &o))
            .map_err(|e| format!("couldn't connect the QP: {e}"))
    }
    pub(super) fn send_sge(&self, size: usize) -> CmdResult<softrdma::Sge> {
        self.mr.sge(self.half..self.half + size).map_err(range_err)
    }
    fn read_byte(&self, at: usize) -> CmdResult<u8> {
        let mut b = [0u8];
        self.mr
            .read(at, &mut b)
            .map_err(|e| format!("reading the buffer: {e}"))?;
        Ok(b[0])
    }
}

/// What one side tells the other.
#[derive(Debug, Clone, Copy)]
pub struct Peer {
    pub qp: RemoteQp,
    pub mem: RemoteMemory,
}

/// A buffer range refused by [`softrdma::MemoryRegion::sge`].
pub(super) fn range_err(e: softrdma::Error) -> String {
    format!("buffer range: {e}")
}

/// Wait until `side`'s byte at `at` equals `v`, draining send completions meanwhile
/// (each one taken off `outstanding`).
pub(super) fn wait_byte(
    side: &Side,
    at: usize,
    v: u8,
    poller: &Poller,
    outstanding: &mut u32,
) -> CmdResult {
    if side.memory_wait {
        // As perftest's ib_write_lat: collect the send completions first (polling the CQ),
        // then watch nothing but the byte, so the device's progress thread alone delivers
        // the peer's WRITE.
        while *outstanding > 0 {
            wait_wc(side, poller, false, outstanding)?;
        }
        let deadline = Instant::now() + poller.timeout();
        let mut spins = 0u32;
        loop {
            if side.read_byte(at)? == v {
                return Ok(());
            }
            spins = spins.wrapping_add(1);
            if spins % 4096 == 0 && Instant::now() > deadline {
                return Err(format!(
                    "the peer's write did not arrive within {} s: the peer is gone or unreachable",
                    poller.timeout().as_secs()
                ));
            }
            std::hint::spin_loop();
        }
    }
    let mut wcs = [WorkCompletion::default(); 16];
    loop {
        // The peer's WRITE completes nothing here: wait for the byte or a send completion.
        let n = poller.poll_or(&side.cq, &mut wcs, || Ok(side.read_byte(at)? == v))?;
        if n == 0 {
            return Ok(());
        }
        for wc in &wcs[..n] {
            if wc.status != WcStatus::Success {
                return Err(session::wc_error(wc));
            }
            *outstanding = outstanding.saturating_sub(1);
        }
    }
}

pub(super) fn lat_value(seq: u64) -> u8 {
    (seq % 255) as u8 + 1
}

/// Wait for a receive completion (`want_recv`) or a send-side one, checking status; every
/// send-side completion seen is taken off `outstanding`.
pub(super) fn wait_wc(
    side: &Side,
    poller: &Poller,
    want_recv: bool,
    outstanding: &mut u32,
) -> CmdResult<WorkCompletion> {
    let mut wcs = [WorkCompletion::default(); 1];
    loop {
        poller.poll(&side.cq, &mut wcs)?;
        let wc = wcs[0];
        if wc.status != WcStatus::Success {
            return Err(session::wc_error(&wc));
        }
        let is_recv = matches!(wc.opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm);
        if !is_recv {
            *outstanding = outstanding.saturating_sub(1);
        }
        if is_recv == want_recv {
            return Ok(wc);
        }
        if is_recv {
            // An unexpected receive: keep the queue full anyway.
            side.post_recvs(1)?;
        }
    }
}

/// The peer of a connected QP as the CM set it up, with its memory.
pub(super) fn cm_peer(qp: &QueuePair, mem: RemoteMemory) -> CmdResult<Peer> {
    let a = qp
        .query()
        .map_err(|e| format!("couldn't query the QP: {e}"))?;
    Ok(Peer {
        qp: RemoteQp {
            gid: a.ah_attr.grh.dgid,
            qpn: a.dest_qp_num,
            psn: a.rq_psn,
        },
        mem,
    })
}

/// A `prepare` step's error as the CM helpers take it.
pub(super) fn cm_err(msg: String) -> softrdma::Error {
    softrdma::Error::new(12, msg)
}
