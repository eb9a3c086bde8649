//! softrdma transport layer: the RC / UC / UD protocol engine (requester, responder,
//! completer), sans-IO: datagrams and time come in as arguments, datagrams go out
//! through [`Rnic::poll_transmit`].

#![warn(missing_docs)]

use std::net::SocketAddr;

pub use softrdma_verbs as verbs;

/// Counters (for `softrdma stats`).
#[derive(Debug, Clone, Default)]
pub struct Stats {
    /// Datagrams produced.
    pub tx_packets: u64,
    /// Bytes of UDP payload produced.
    pub tx_bytes: u64,
    /// Datagrams received (before any check).
    pub rx_packets: u64,
    /// Bytes of UDP payload received.
    pub rx_bytes: u64,
    /// Request packets sent again (timeout, sequence NAK, RNR).
    pub retransmits: u64,
    /// Local ACK timeouts that fired.
    pub timeouts: u64,
    /// PSN sequence error NAKs sent.
    pub naks_sent_seq: u64,
    /// Invalid request NAKs sent.
    pub naks_sent_inv: u64,
    /// Remote access error NAKs sent.
    pub naks_sent_access: u64,
    /// Remote operational error NAKs sent.
    pub naks_sent_op: u64,
    /// PSN sequence error NAKs received.
    pub naks_rcvd_seq: u64,
    /// Invalid request NAKs received.
    pub naks_rcvd_inv: u64,
    /// Remote access error NAKs received.
    pub naks_rcvd_access: u64,
    /// Remote operational error NAKs received.
    pub naks_rcvd_op: u64,
    /// RNR NAKs sent.
    pub rnr_naks_sent: u64,
    /// RNR NAKs received.
    pub rnr_naks_rcvd: u64,
    /// Datagrams dropped for a bad ICRC.
    pub icrc_errors: u64,
    /// Datagrams dropped as unparseable.
    pub malformed: u64,
    /// Duplicate requests seen by the responder.
    pub duplicates: u64,
    /// Datagrams dropped: wrong peer, unknown QP, bad state.
    pub dropped: u64,
    /// Requests ahead of the expected PSN.
    pub out_of_sequence: u64,
}

/// A datagram to send: UDP payload (BTH..ICRC, ICRC already sealed) and addressing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transmit {
    /// Our address (source IP and UDP source port).
    pub src: SocketAddr,
    /// Destination IP and UDP port.
    pub dst: SocketAddr,
    /// IP TOS / traffic class byte.
    pub tos: u8,
    /// The UDP payload.
    pub data: Vec<u8>,
}

/// One RDMA device's engine: verbs objects plus RC/UC/UD protocol state. Sans-IO.
pub struct Rnic {
    addr: SocketAddr,
    ctx: verbs::Context,
    stats: Stats,
}

impl Rnic {
    /// Device bound to `addr` (its IP gives GID index 0 as the IPv4-mapped GID; the port is
    /// normally 4791). `seed` feeds key and PSN randomness.
    pub fn new(addr: SocketAddr, seed: u64) -> Rnic {
        let ctx = verbs::Context::new(vec![verbs::Gid::from_ip(addr.ip())], seed);
        Rnic {
            addr,
            ctx,
            stats: Stats::default(),
        }
    }
    /// Our address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
    /// The verbs objects (PDs, MRs, CQs, SRQs, AHs, MWs, DM are created through it).
    pub fn ctx(&self) -> &verbs::Context {
        &self.ctx
    }
    /// The verbs objects, mutably.
    pub fn ctx_mut(&mut self) -> &mut verbs::Context {
        &mut self.ctx
    }
    /// Create a QP (in RESET).
    pub fn create_qp(&mut self, init: verbs::QpInitAttr) -> verbs::Result<verbs::Qpn> {
        todo!("{init:?}")
    }
    /// Destroy a QP.
    pub fn destroy_qp(&mut self, qpn: verbs::Qpn) -> verbs::Result<()> {
        todo!("{qpn}")
    }
    /// Current attributes of a QP.
    pub fn query_qp(&self, qpn: verbs::Qpn) -> verbs::Result<verbs::QpAttr> {
        todo!("{qpn}")
    }
    /// verbs modify plus protocol side effects (RTR: expected PSN, RTS: send PSN, ERR: flush
    /// everything, RESET: clear).
    pub fn modify_qp(
        &mut self,
        now: u64,
        qpn: verbs::Qpn,
        attr: &verbs::QpAttr,
        mask: verbs::QpAttrMask,
    ) -> verbs::Result<()> {
        todo!("{now} {qpn} {attr:?} {mask:?}")
    }
    /// Post a send WR and run the requester.
    pub fn post_send(&mut self, now: u64, qpn: verbs::Qpn, wr: verbs::SendWr) -> verbs::Result<()> {
        todo!("{now} {qpn} {wr:?}")
    }
    /// Post a receive WR (flushed at once in ERR).
    pub fn post_recv(&mut self, now: u64, qpn: verbs::Qpn, wr: verbs::RecvWr) -> verbs::Result<()> {
        todo!("{now} {qpn} {wr:?}")
    }
    /// Post a receive WR to an SRQ.
    pub fn post_srq_recv(
        &mut self,
        now: u64,
        srq: verbs::SrqId,
        wr: verbs::RecvWr,
    ) -> verbs::Result<()> {
        todo!("{now} {srq:?} {wr:?}")
    }
    /// A UDP datagram arrived from `src` to `dst` (our address).
    pub fn handle_datagram(&mut self, now: u64, src: SocketAddr, dst: SocketAddr, data: &[u8]) {
        todo!("{now} {src} {dst} {}", data.len())
    }
    /// Next datagram to put on the wire.
    pub fn poll_transmit(&mut self, now: u64) -> Option<Transmit> {
        todo!("{now}")
    }
    /// Earliest timer deadline, if any.
    pub fn poll_timeout(&self) -> Option<u64> {
        todo!()
    }
    /// Fire the timers due at `now`.
    pub fn handle_timeout(&mut self, now: u64) {
        todo!("{now}")
    }
    /// Poll completions.
    pub fn poll_cq(
        &mut self,
        cq: verbs::CqId,
        out: &mut [verbs::WorkCompletion],
    ) -> verbs::Result<usize> {
        self.ctx.poll_cq(cq, out)
    }
    /// Counters.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }
}
