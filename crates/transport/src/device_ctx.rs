//! The device-wide context of the protocol handlers ([`DeviceCtx`]): what a handler
//! reaches besides its own QP, and how it builds, seals and queues the datagrams it
//! sends.

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};

use softrdma_wire::{self as wire, Addrs, Headers};

use crate::keepalive::KeepalivePolicy;
use crate::pool::BufPool;
use crate::stats::Stats;
use crate::transmit::{Transmit, TransmitKind};
use crate::verbs;

/// A device's state that every QP's protocol handlers work with besides their QP: the
/// verbs objects, the outbox and its wait queues, the buffer pool, the counters. Split
/// from the QP table so a handler can hold `&mut QpCtx` and `&mut DeviceCtx` at once.
pub(crate) struct DeviceCtx {
    pub addr: SocketAddr,
    /// The device's address of the other IP version, if it has one (GID index 1).
    pub alt: Option<IpAddr>,
    pub ctx: verbs::Context,
    pub out: VecDeque<Transmit>,
    pub stats: Stats,
    /// QPs with a coalesced ACK waiting (sent when the outbox runs dry).
    pub ack_queue: VecDeque<verbs::Qpn>,
    /// QPs whose requester stopped at a full outbox, in the order they stopped.
    pub tx_wait: VecDeque<verbs::Qpn>,
    /// QPs whose responder has READ responses (and what waits behind them) to send once
    /// the outbox drains, in the order they stopped.
    pub resp_wait: VecDeque<verbs::Qpn>,
    /// Which of requesters and responders continues first at the next refill
    /// (alternating, so neither starves the other).
    pub resp_first: bool,
    /// Free packet buffers.
    pub pool: BufPool,
    /// Per-length work of the unknown-IP-ID ICRC check (packets sealed for ID k > 0:
    /// rxe's numbered packets, segments of a GSO send).
    pub ip_ids: wire::icrc::IpIdCache,
    /// Which of those IDs to believe from each sender (a corrupted packet matches some
    /// ID with probability about 2^-16).
    pub ip_id_guard: wire::icrc::IpIdGuard,
    /// Bytes of request packets all QPs' responders hold past a gap (see `qp::Held`).
    pub held_bytes: usize,
    /// Bytes of receive buffer the device's socket has (see [`Rnic::set_rx_buffer`]).
    pub rx_buffer: usize,
    /// Liveness checks of idle RC connections (see [`Rnic::set_keepalive`]).
    pub keepalive: KeepalivePolicy,
    /// Where RC WRITEs to same-host peers are copied straight into their memory
    /// ([`crate::Placement`]).
    pub placement: Option<Box<dyn crate::Placement>>,
    /// Where the engine publishes what same-host peers may reach ([`crate::GrantSink`]).
    pub grants: Option<Box<dyn crate::GrantSink>>,
    /// Whether one-sided operations placed without a packet are traced
    /// ([`crate::Rnic::set_trace_placed`]), and the packets that stand for them.
    pub trace_placed: bool,
    pub placed_traces: Vec<crate::PlacedTrace>,
}

impl DeviceCtx {
    /// The local address a packet to `dst` leaves from: the device's address of `dst`'s
    /// IP version.
    pub fn src_ip(&self, dst: IpAddr) -> IpAddr {
        match self.alt {
            Some(a) if a.is_ipv4() == dst.to_canonical().is_ipv4() => a,
            _ => self.addr.ip(),
        }
    }

    /// Build, seal and queue one packet from QP `src_qpn` to `dst`. Emission only fails
    /// on an internal inconsistency; such a packet is counted as dropped, never sent.
    pub fn send(&mut self, src_qpn: u32, dst: SocketAddr, tos: u8, h: &Headers, payload: &[u8]) {
        let _ = self.send_with(src_qpn, dst, tos, h, payload.len(), |_, b| {
            b.copy_from_slice(payload);
            Ok::<(), ()>(())
        });
    }

    /// Build, seal and queue one packet with `plen` bytes of payload that `fill` writes
    /// straight into the packet buffer (given the verbs context, to read registered memory).
    /// An error from `fill` sends nothing and is returned; an emission failure (internal
    /// inconsistency) is counted as dropped.
    pub fn send_with<E>(
        &mut self,
        src_qpn: u32,
        dst: SocketAddr,
        tos: u8,
        h: &Headers,
        plen: usize,
        fill: impl FnOnce(&verbs::Context, &mut [u8]) -> Result<(), E>,
    ) -> Result<(), E> {
        let total = h.packet_len(plen);
        let mut data = self.take_buf(total);
        let at = match h.emit_header(plen, &mut data) {
            Ok(n) => n,
            Err(_) => {
                tracing::warn!(
                    qpn = format_args!("{src_qpn:#x}"),
                    opcode = %h.bth.opcode,
                    psn = h.bth.psn,
                    counter = "dropped",
                    "packet not sent: headers do not fit their opcode (internal error)"
                );
                self.stats.dropped += 1;
                self.recycle(data);
                return Ok(());
            }
        };
        if let Err(e) = fill(&self.ctx, &mut data[at..at + plen]) {
            self.recycle(data);
            return Err(e);
        }
        data[at + plen..].fill(0); // pad and ICRC
        self.seal_and_queue(src_qpn, dst, tos, TransmitKind::of(h), data);
        Ok(())
    }

    /// Seal a built packet for QP `src_qpn`'s source port and `dst`, count it and queue it.
    fn seal_and_queue(
        &mut self,
        src_qpn: u32,
        dst: SocketAddr,
        tos: u8,
        kind: TransmitKind,
        mut data: Vec<u8>,
    ) {
        let src = SocketAddr::new(self.src_ip(dst.ip()), wire::udp_src_port(src_qpn));
        wire::icrc::seal(&Addrs::new(src, dst), &mut data);
        self.stats.tx_packets += 1;
        self.stats.tx_bytes += data.len() as u64;
        self.out.push_back(Transmit {
            src,
            dst,
            tos,
            kind,
            data,
        });
    }

    /// Keep, for the trace, the packet with headers `h` and `payload` that stands for a
    /// one-sided operation of QP `src_qpn` placed with no packet: from us to `peer`, or, if
    /// `inbound`, from `peer` (its QP `src_qpn`) to us.
    #[allow(clippy::too_many_arguments)]
    pub fn trace_placed_packet(
        &mut self,
        src_qpn: u32,
        peer: SocketAddr,
        tos: u8,
        h: &Headers,
        payload: &[u8],
        inbound: bool,
        note: String,
    ) {
        let mut data = vec![0u8; h.packet_len(payload.len())];
        let Ok(at) = h.emit_header(payload.len(), &mut data) else {
            return;
        };
        data[at..at + payload.len()].copy_from_slice(payload);
        let port = wire::udp_src_port(src_qpn);
        let (src, dst) = if inbound {
            (
                SocketAddr::new(peer.ip(), port),
                SocketAddr::new(self.src_ip(peer.ip()), peer.port()),
            )
        } else {
            (SocketAddr::new(self.src_ip(peer.ip()), port), peer)
        };
        wire::icrc::seal(&Addrs::new(src, dst), &mut data);
        self.placed_traces.push(crate::PlacedTrace {
            src,
            dst,
            tos,
            inbound,
            data,
            note,
        });
    }

    /// Build, seal and queue a placed WRITE ([`wire::ext::PLACED_WRITE`]): the headers `h`
    /// of an RC WRITE ONLY (with immediate), no payload, under the vendor opcode `op`.
    pub fn send_placed(
        &mut self,
        src_qpn: u32,
        dst: SocketAddr,
        tos: u8,
        h: &Headers,
        op: wire::Opcode,
    ) {
        let total = h.packet_len(0);
        let mut data = self.take_buf(total);
        match h.emit_header(0, &mut data) {
            Ok(at) => {
                data[at..].fill(0); // ICRC
                data[0] = op.0;
                self.seal_and_queue(src_qpn, dst, tos, TransmitKind::of(h), data);
            }
            Err(_) => {
                self.stats.dropped += 1;
                self.recycle(data);
            }
        }
    }

    /// Build, seal and queue one of softrdma's extension messages ([`wire::ext`]) from QP
    /// `src_qpn` to `dst`. They leave promptly, as a NAK does.
    pub fn send_ext(&mut self, src_qpn: u32, dst: SocketAddr, tos: u8, m: &wire::ext::Ext) {
        let mut data = self.take_buf(m.len());
        if m.emit(&mut data).is_err() {
            // The buffer is exactly the message's length: emission cannot fail.
            self.stats.dropped += 1;
            self.recycle(data);
            return;
        }
        self.seal_and_queue(src_qpn, dst, tos, TransmitKind::Nak, data);
    }

    /// A buffer of exactly `len` bytes (contents unspecified), from the pool when it can.
    pub fn take_buf(&mut self, len: usize) -> Vec<u8> {
        self.pool.take(len)
    }

    /// Keep a buffer for reuse.
    pub fn recycle(&mut self, b: Vec<u8>) {
        self.pool.recycle(b);
    }

    /// Queue a completion. A CQ overflow is the verbs layer's business (CQ error event).
    pub fn complete(
        &mut self,
        cq: verbs::CqId,
        wc: verbs::WorkCompletion,
        solicited: bool,
        now: u64,
    ) {
        let _ = self.ctx.push_completion(cq, wc, solicited, now);
    }
}
