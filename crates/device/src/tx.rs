//! The send path: what the engine produced leaves from the socket of its UDP source port,
//! in `sendmmsg` batches and UDP GSO messages, with plain ACKs (and, for posts into a busy
//! pipe, everything) held back to leave with the next datagrams.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use softrdma_net::{udp, Link};
use softrdma_transport::{Transmit, TransmitKind};
use softrdma_wire::icrc::IpIdCache;
use softrdma_wire::pcapng::Direction;
use softrdma_wire::{frame, Addrs};

use crate::runtime::{wall_ns, Engine, Runtime};
use crate::LinkStats;

/// Times a full socket send buffer is retried before the rest of a burst is dropped.
const TX_FULL_RETRIES: u32 = 64;
/// The trace's comment on a datagram that went through a same-host ring (the packet is the
/// RoCEv2 packet it stands for, as on UDP).
pub(crate) const RING_NOTE: &str = "softrdma: through a same-host ring, not UDP";
/// The trace's comment on a placed WRITE (`wire::ext::PLACED_WRITE`).
pub(crate) const PLACED_NOTE: &str = "softrdma: a WRITE between same-host devices whose \
     payload the requester copied into the responder's memory itself (process_vm_writev) \
     after the responder's checks; this packet, its RDMA WRITE ONLY headers without the \
     payload, is what went through the ring (under a softrdma opcode, shown here as the \
     IBTA opcode it stands for)";

/// The frame the trace shows for datagram `data` (UDP payload) between `addrs`, which went
/// through a same-host ring if `ring`, and its comment: a placed WRITE shows as the RDMA
/// WRITE ONLY (with immediate) it stands for, so that the trace reads as RoCEv2.
pub(crate) fn trace_frame(
    addrs: &Addrs,
    tos: u8,
    data: &[u8],
    ring: bool,
) -> (Vec<u8>, Option<&'static str>) {
    let placed = data
        .first()
        .and_then(|&op| softrdma_wire::ext::placed_as(softrdma_wire::Opcode(op)));
    match placed {
        Some(op) => {
            let mut d = data.to_vec();
            d[0] = op.0;
            softrdma_wire::icrc::seal(addrs, &mut d);
            (frame::emit_ip_udp(addrs, tos, &d), Some(PLACED_NOTE))
        }
        None => (
            frame::emit_ip_udp(addrs, tos, data),
            ring.then_some(RING_NOTE),
        ),
    }
}
/// Datagrams handed to the driver per send call.
pub(crate) const TX_CHUNK: usize = 256;
/// Longest an ACK produced while an application thread drives progress waits to leave
/// with the next request while that thread keeps calling in (see [`Engine::flush_tx`]); if
/// it stops, the progress thread sends it when it next looks.
pub(crate) const ACK_DEFER: Duration = Duration::from_micros(20);

/// Send-only sockets for per-QP UDP source ports kept at most. Each costs a descriptor and
/// about 20 KiB (its `sendmmsg` scratch), and a device with thousands of QPs would have
/// thousands of ports (0xC000 + a 14-bit hash of the QPN): past this many, a QP whose
/// port has no socket sends from the device socket, its ICRC resealed for that port.
pub(crate) const SEND_PORTS_MAX: usize = 64;

/// Datagrams held back at most (see [`Held`]): while this many wait, the engine's own
/// output stays in it (its outbox is bounded, and requesters and responders make more only
/// as it drains), so a reader that stops cannot make the device buffer without bound.
/// 4096 of the largest are 17 MiB, four rings' worth.
const HELD_MAX: usize = 4096;
/// How soon the progress thread offers held datagrams again when it has nothing else to
/// do (a ring's reader frees slots as it runs; it does not tell the writer).
pub(crate) const HELD_RETRY: Duration = Duration::from_micros(20);

/// Datagrams a link did not take and holds back ([`Link::holds_back`]: a same-host ring
/// with no free slot), oldest first. They are offered again before anything new, and a
/// new datagram to a destination that still has held ones waits behind them, so each
/// destination's datagrams leave in the order the engine made them.
#[derive(Default)]
pub(crate) struct Held {
    pkts: Vec<Transmit>,
    via: Vec<SendSocket>,
    /// Device time each was first refused.
    since: Vec<u64>,
    /// Destinations refused at the last offer.
    blocked: Vec<SocketAddr>,
    /// Scratch: positions that [`send_run`] kept.
    keep: Vec<usize>,
    /// When a ring with held datagrams last took some, per destination.
    moved: Vec<(SocketAddr, u64)>,
    /// How long a datagram waits while its ring's reader frees no slot, in nanoseconds
    /// ([`crate::DeviceConfig::shm_hold`]): a reader this late has stopped, and the
    /// transport's retries take over from a drop.
    hold_max_ns: u64,
}

impl Held {
    /// Nothing held; datagrams wait at most `hold_max` for a reader that reads none.
    pub(crate) fn new(hold_max: Duration) -> Held {
        Held {
            hold_max_ns: u64::try_from(hold_max.as_nanos()).unwrap_or(u64::MAX),
            ..Held::default()
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.pkts.is_empty()
    }
}

/// Where a datagram leaves from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SendSocket {
    /// The device socket (port 4791).
    Main,
    /// The socket of the device's second address (port 4791).
    Alt,
    /// The send-only socket of this source address (a device address, another port).
    Port(SocketAddr),
}

/// What [`Engine::flush_tx`] does with held-back ACKs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Flush {
    /// Send everything now.
    All,
    /// Send held-back ACKs with other datagrams, or once due; otherwise keep them.
    Due,
    /// Like `Due`, and hold back new ACKs too when they are all there is to send.
    Defer,
    /// Hold back everything (a post into a busy pipe), up to a send batch.
    Hold,
}

impl Engine {
    /// Send what the engine produced. ACKs made while an application thread drives
    /// progress (`Flush::Defer`) are held back when they are all there is, so the
    /// application sees its completion without waiting for a send system call; they go
    /// out in the same `sendmmsg` as the next datagram (typically the application's next
    /// request), or by themselves once [`ACK_DEFER`] has passed, or before any thread
    /// blocks. The peer gets them at most that much later, far inside its ACK timeout.
    pub(crate) fn flush_tx(&mut self, sh: &Runtime, now: u64, flush: Flush) {
        if !self.held.is_empty() {
            self.send_held(now);
            if self.held.pkts.len() >= HELD_MAX {
                return;
            }
        }
        let local = sh.addr;
        let alt = sh.alt_addr;
        let mut alt_sent = false;
        while let Some(mut t) = self.rnic.poll_transmit(now) {
            // From the second address (which has a socket whenever the device has one).
            let on_alt = alt.filter(|a| a.ip() == t.src.ip());
            let via = if t.src == local {
                SendSocket::Main
            } else if Some(t.src) == alt {
                SendSocket::Alt
            } else if (t.src.ip() == local.ip() || on_alt.is_some()) && self.port_socket(t.src) {
                SendSocket::Port(t.src)
            } else if let Some(a) = on_alt {
                // No socket for that source port: send from the device socket of the
                // address, and reseal, since the ICRC covers the UDP header the receiver
                // sees.
                t.resend_from(a);
                SendSocket::Alt
            } else {
                t.resend_from(local);
                SendSocket::Main
            };
            alt_sent |= on_alt.is_some();
            self.txq.push(t);
            self.via.push(via);
        }
        if alt_sent {
            // Its answers will come to the second address: read that socket every step.
            sh.alt_used(now);
        }
        self.trace_placed();
        if !self.deferred.is_empty() || matches!(flush, Flush::Defer | Flush::Hold) {
            let due = sh.ack_due.load(Ordering::Relaxed);
            let hold = match flush {
                Flush::All => false,
                _ if now >= due => false,
                Flush::Due => self.txq.is_empty(),
                Flush::Defer => self.txq.iter().all(|t| t.kind == TransmitKind::Ack),
                Flush::Hold => self.deferred.len() + self.txq.len() < TX_CHUNK,
            };
            if hold {
                if self.deferred.is_empty() && !self.txq.is_empty() {
                    let due = now.saturating_add(ACK_DEFER.as_nanos() as u64);
                    sh.ack_due.store(due, Ordering::Release);
                }
                if self.txq.iter().any(|t| t.kind != TransmitKind::Ack) {
                    sh.data_held.store(true, Ordering::Release);
                }
                self.deferred.append(&mut self.txq);
                self.deferred_via.append(&mut self.via);
                return;
            }
            if !self.deferred.is_empty() {
                // Held-back ACKs first, in the order they were made. Sending them after
                // the new datagrams would take one datagram off the critical path of a
                // ping-pong (on loopback each delivery runs inside this system call), but
                // a peer would then see our reply before the ACK of its request: its
                // receive completion before its send completion, an order no hardware
                // RNIC produces and that sequential verbs programs rely on.
                self.deferred.append(&mut self.txq);
                self.deferred_via.append(&mut self.via);
                std::mem::swap(&mut self.deferred, &mut self.txq);
                std::mem::swap(&mut self.deferred_via, &mut self.via);
                sh.ack_due.store(u64::MAX, Ordering::Release);
                sh.data_held.store(false, Ordering::Release);
            }
        }
        if self.txq.is_empty() {
            return;
        }
        self.held.keep.clear();
        self.send_all(false);
        // The buffers go back to the engine, which builds later packets in them: the
        // packet path allocates nothing in the steady state.
        let mut kept = self.held.keep.iter().copied().peekable();
        for (i, t) in self.txq.drain(..).enumerate() {
            if kept.next_if_eq(&i).is_some() {
                self.stats.tx_held += 1;
                self.held.pkts.push(t);
                self.held.via.push(self.via[i]);
                self.held.since.push(now);
            } else {
                self.rnic.recycle(t.data);
            }
        }
        self.via.clear();
    }

    /// Write the packets that stand for one-sided operations placed with no packet into the
    /// trace (the engine makes them only while there is one).
    fn trace_placed(&mut self) {
        let Some(p) = self.pcap.as_mut() else {
            return;
        };
        let placed = self.rnic.take_placed_traces();
        if placed.is_empty() {
            return;
        }
        let ts = wall_ns();
        for t in placed {
            let f = frame::emit_ip_udp(&Addrs::new(t.src, t.dst), t.tos, &t.data);
            let dir = if t.inbound {
                Direction::Inbound
            } else {
                Direction::Outbound
            };
            if p.write_packet(ts, &f, Some(dir), Some(&t.note)).is_err() {
                self.stats.pcap_errors += 1;
            }
        }
    }

    /// Send `txq` (or, if `held`, the held datagrams), one `sendmmsg` batch per run of
    /// datagrams leaving from the same socket; the positions a link held back go into
    /// `held.keep`. The trace gets `txq`'s datagrams (held ones are in it already).
    fn send_all(&mut self, held: bool) {
        let ts = if self.pcap.is_some() && !held {
            wall_ns()
        } else {
            0
        };
        let (txq, via) = if held {
            (&mut self.held.pkts, &self.held.via)
        } else {
            (&mut self.txq, &self.via)
        };
        let mut at = 0;
        while at < txq.len() {
            let v = via[at];
            let end = via[at..]
                .iter()
                .position(|x| *x != v)
                .map_or(txq.len(), |k| at + k);
            let link = match v {
                SendSocket::Main => &mut self.link,
                SendSocket::Alt => self.alt_link.as_mut().unwrap_or(&mut self.link),
                SendSocket::Port(p) => match self.ports.get_mut(&p) {
                    Some(Some(d)) => d,
                    _ => &mut self.link,
                },
            };
            if let (Some(p), false) = (self.pcap.as_mut(), held) {
                for t in &txq[at..end] {
                    let addrs = Addrs::new(t.src, t.dst);
                    let ring = link.same_host_ring(t.dst);
                    let (f, note) = trace_frame(&addrs, t.tos, &t.data, ring);
                    if p.write_packet(ts, &f, Some(Direction::Outbound), note)
                        .is_err()
                    {
                        self.stats.pcap_errors += 1;
                    }
                }
            }
            send_run(
                &mut **link,
                &mut txq[at..end],
                at,
                &mut self.stats,
                &mut self.ip_ids,
                &mut self.held.blocked,
                &mut self.held.keep,
            );
            at = end;
        }
    }

    /// Offer the held datagrams again; those still refused stay held unless they have
    /// waited `hold_max_ns` with no progress.
    fn send_held(&mut self, now: u64) {
        self.held.blocked.clear();
        self.held.keep.clear();
        self.send_all(true);
        let pkts = std::mem::take(&mut self.held.pkts);
        let via = std::mem::take(&mut self.held.via);
        let since = std::mem::take(&mut self.held.since);
        let mut kept = self.held.keep.iter().copied().peekable();
        let moved = &mut self.held.moved;
        for (i, t) in pkts.into_iter().enumerate() {
            let last_moved = moved.iter().find(|m| m.0 == t.dst).map(|m| m.1);
            if kept.next_if_eq(&i).is_none() {
                match moved.iter_mut().find(|m| m.0 == t.dst) {
                    Some(m) => m.1 = now,
                    None => moved.push((t.dst, now)),
                }
                self.rnic.recycle(t.data);
            } else if now.saturating_sub(since[i].max(last_moved.unwrap_or(0)))
                > self.held.hold_max_ns
            {
                self.stats.tx_dropped += 1;
                self.stats.tx_held_expired += 1;
                if self.stats.tx_held_expired == 1 {
                    tracing::warn!(dst = %t.dst, hold_ms = self.held.hold_max_ns / 1_000_000,
                        "a same-host peer has not read its ring for the hold time: datagrams \
                         to it are dropped as a congested network's (counted as \
                         tx_held_expired)");
                }
                self.rnic.recycle(t.data);
            } else {
                self.held.pkts.push(t);
                self.held.via.push(via[i]);
                self.held.since.push(since[i]);
            }
        }
        let held = &self.held.pkts;
        self.held
            .moved
            .retain(|m| held.iter().any(|t| t.dst == m.0));
    }

    /// Whether a send-only socket for source address `src` exists (binding it on first use,
    /// while fewer than [`SEND_PORTS_MAX`] source addresses have been tried).
    fn port_socket(&mut self, src: SocketAddr) -> bool {
        if let Some(s) = self.ports.get(&src) {
            return s.is_some();
        }
        if self.ports.len() >= SEND_PORTS_MAX {
            if !self.ports_full_logged {
                self.ports_full_logged = true;
                tracing::debug!(
                    %src,
                    max = SEND_PORTS_MAX,
                    "no more source-port sockets: datagrams of further ports leave from the device port"
                );
            }
            return false;
        }
        let mc_ifindex = self.mc_ifindex;
        let made = self.link.send_only_at(src);
        self.ports
            .entry(src)
            .or_insert_with(|| match made {
                Ok(d) => {
                    if let Some(i) = mc_ifindex {
                        // Best effort: without it IPv6 multicast follows the routes.
                        let _ = d.set_multicast_interface(i);
                    }
                    Some(d)
                }
                Err(e) => {
                    tracing::debug!(
                        %src, error = %e,
                        "no socket for this source port: its datagrams leave from the device port"
                    );
                    None
                }
            })
            .is_some()
    }
}

/// Re-seal the datagrams of `chunk` that `link` will send as segments of a GSO message:
/// the kernel gives segment *k* IPv4 ID *k* (see [`udp::Driver::gso_run_len`]), and the
/// ICRC, sealed by the engine for ID 0, covers it. A receiver that sees the IP header
/// (Linux rxe) checks exactly that; a UDP-socket receiver solves for the ID and believes
/// one below `IpIdGuard::GSO_IDS`.
fn seal_gso_segments(link: &dyn Link, chunk: &mut [Transmit], ip_ids: &mut IpIdCache) {
    // A run is a datagram followed by ones no longer, to the same destination with the
    // same class: without such a pair (a reply after a shorter ACK, say) there is none.
    if !chunk
        .windows(2)
        .any(|w| w[0].dst == w[1].dst && w[0].tos == w[1].tos && w[1].data.len() <= w[0].data.len())
    {
        return;
    }
    // (start, length) of each run of more than one datagram, planned as the driver will
    // send them.
    let runs = with_views(chunk, |out| {
        let mut runs: Vec<(usize, usize)> = Vec::new();
        let mut at = 0;
        while at < out.len() {
            let n = link.gso_run_len(&out[at..]).max(1);
            if n > 1 && out[at].dst.is_ipv4() {
                runs.push((at, n));
            }
            at += n;
        }
        runs
    });
    for (start, n) in runs {
        for (k, t) in chunk[start + 1..start + n].iter_mut().enumerate() {
            // The last segment may be shorter: its own length, its own effect.
            t.reseal_for_ip_id((k + 1) as u16, ip_ids);
        }
    }
}

/// Chunks of at most this many datagrams get the driver's views of them on the stack,
/// longer ones in a vector: an array for a whole [`TX_CHUNK`] is 14 KiB to fill on every
/// send, most of what sending a ping-pong's reply and ACK cost before the system call.
const VIEWS_ON_STACK: usize = 8;

/// Run `f` on the driver's views of `chunk` (destination, traffic class, bytes).
fn with_views<R>(chunk: &[Transmit], f: impl FnOnce(&[udp::OutDatagram<'_>]) -> R) -> R {
    fn view(t: &Transmit) -> udp::OutDatagram<'_> {
        udp::OutDatagram {
            dst: t.dst,
            tos: t.tos,
            data: &t.data,
        }
    }
    if chunk.len() <= VIEWS_ON_STACK {
        let mut out = [udp::OutDatagram {
            dst: SocketAddr::from(([0, 0, 0, 0], 0)),
            tos: 0,
            data: &[],
        }; VIEWS_ON_STACK];
        for (o, t) in out.iter_mut().zip(chunk) {
            *o = view(t);
        }
        f(&out[..chunk.len()])
    } else {
        let out: Vec<udp::OutDatagram<'_>> = chunk.iter().map(view).collect();
        f(&out)
    }
}

/// Send `txq` from `link`: retry a full socket buffer a few times, then drop the rest as a
/// congested network would (the transport's retransmissions recover). A datagram the link
/// holds back ([`Link::holds_back`]) is kept instead: its position (plus `base`) goes into
/// `keep`, its destination into `blocked`, and every later datagram to a destination in
/// `blocked` is kept without being offered, so that none overtakes it.
fn send_run(
    link: &mut dyn Link,
    txq: &mut [Transmit],
    base: usize,
    stats: &mut LinkStats,
    ip_ids: &mut IpIdCache,
    blocked: &mut Vec<SocketAddr>,
    keep: &mut Vec<usize>,
) {
    for (c, chunk) in txq.chunks_mut(TX_CHUNK).enumerate() {
        let base = base + c * TX_CHUNK;
        if link.gso_enabled() {
            seal_gso_segments(link, chunk, ip_ids);
        }
        with_views(chunk, |out| {
            send_chunk(link, out, base, stats, blocked, keep)
        });
    }
}

/// [`send_run`] of one chunk, `out` being its datagrams and `base` the position of its
/// first.
fn send_chunk(
    link: &mut dyn Link,
    out: &[udp::OutDatagram<'_>],
    base: usize,
    stats: &mut LinkStats,
    blocked: &mut Vec<SocketAddr>,
    keep: &mut Vec<usize>,
) {
    let mut at = 0;
    let mut full = 0;
    while at < out.len() {
        if blocked.contains(&out[at].dst) {
            keep.push(base + at);
            at += 1;
            continue;
        }
        // Up to the next datagram that must wait: a GSO run never spans one (a run is
        // of one destination), so the messages the driver makes are the ones sealed for.
        let end = if blocked.is_empty() {
            out.len()
        } else {
            out[at..]
                .iter()
                .position(|o| blocked.contains(&o.dst))
                .map_or(out.len(), |k| at + k)
        };
        stats.tx_batches += 1;
        match link.send_batch(&out[at..end]) {
            Ok(0) if link.holds_back(out[at].dst) => blocked.push(out[at].dst),
            Ok(0) if full < TX_FULL_RETRIES => {
                // Socket buffer full: the kernel drains it within microseconds.
                full += 1;
                std::thread::yield_now();
            }
            Ok(0) => {
                stats.tx_dropped += (end - at) as u64;
                tracing::debug!(
                    dropped = end - at,
                    "datagrams dropped: the socket send buffer stayed full"
                );
                at = end;
            }
            Err(e) => {
                // This datagram is refused (too big, bad address): lost like one the
                // network drops.
                stats.tx_dropped += 1;
                if e.raw_os_error() == Some(libc::EMSGSIZE) {
                    stats.tx_too_big += 1;
                    if stats.tx_too_big == 1 {
                        // Every resend will be refused the same way, so say it once.
                        tracing::warn!(dst = %out[at].dst, len = out[at].data.len(),
                            "datagram larger than the route to its destination carries \
                             (EMSGSIZE): a path MTU above the link's; the QP will end in \
                             a retry error (counted as udp_tx_too_big)");
                    }
                }
                tracing::debug!(dst = %out[at].dst, len = out[at].data.len(), error = %e,
                    "datagram refused by the socket, dropped");
                at += 1;
            }
            Ok(n) => {
                for t in &out[at..at + n] {
                    stats.tx_datagrams += 1;
                    stats.tx_bytes += t.data.len() as u64;
                }
                at += n;
            }
        }
    }
}
