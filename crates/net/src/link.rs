//! The driver interface under a device: what moves its datagrams. The device runtime
//! sends, receives and blocks through it, so the same runtime runs on the kernel's UDP
//! ([`crate::udp::Driver`]) or on the in-memory `sim` network ([`crate::sim::SimLink`]),
//! and next on a same-host path.

use std::io;
use std::net::SocketAddr;
use std::os::fd::BorrowedFd;
use std::sync::Arc;

use crate::udp::{OutDatagram, RecvBatch, Stats};

/// One endpoint of a datagram network, at one address and UDP port.
pub trait Link: Send + std::fmt::Debug {
    /// The endpoint's address and port.
    fn local_addr(&self) -> SocketAddr;
    /// Send `pkts` in order; how many were taken (fewer when the network's buffer is
    /// full: the caller retries the rest), or the error of the first that failed.
    fn send_batch(&mut self, pkts: &[OutDatagram<'_>]) -> io::Result<usize>;
    /// Take the datagrams waiting, as many as `out` holds, without blocking; how many.
    fn recv_batch(&mut self, out: &mut RecvBatch) -> io::Result<usize>;
    /// Readable while datagrams wait: what a thread blocks on with poll(2).
    fn readable_fd(&self) -> BorrowedFd<'_>;
    /// A second handle on the same endpoint, so that one thread receives while another
    /// sends. Counters are the handle's own.
    fn clone_link(&self) -> io::Result<Box<dyn Link>>;
    /// A send-only endpoint at `src` (an address of this endpoint's host with another
    /// UDP source port), for datagrams that must leave from that port.
    fn send_only_at(&self, src: SocketAddr) -> io::Result<Box<dyn Link>>;
    /// This handle's counters.
    fn stats(&self) -> Stats;
    /// Bytes of datagrams the endpoint can hold before it drops (the RC window's bound).
    fn recv_buffer_size(&self) -> io::Result<usize>;
    /// Whether runs of equal-size datagrams leave as one UDP GSO message.
    fn gso_enabled(&self) -> bool {
        false
    }
    /// How many datagrams at the start of `pkts` would leave as one GSO message (1
    /// without GSO).
    fn gso_run_len(&self, _pkts: &[OutDatagram<'_>]) -> usize {
        1
    }
    /// Receive coalesced runs of datagrams (GRO) if the network offers it; whether it is
    /// on.
    fn set_gro(&mut self, _on: bool) -> io::Result<bool> {
        Ok(false)
    }
    /// The interface IPv6 multicast leaves from, on a network that has interfaces.
    fn set_multicast_interface(&self, _ifindex: u32) -> io::Result<()> {
        Ok(())
    }
    /// What a thread must go through to block on [`Link::readable_fd`], for a network
    /// whose senders only make it readable when told that the receiver sleeps (the
    /// same-host rings); `None`: block on it as on a socket.
    fn sleep_gate(&self) -> Option<Arc<dyn SleepGate>> {
        None
    }
    /// Whether a datagram to `dst` that [`Link::send_batch`] did not take is to be kept
    /// and offered again until it is taken, rather than dropped after a few tries as a
    /// full socket buffer's datagrams are. True for the same-host rings: their reader
    /// frees slots within microseconds of running, and a datagram dropped there is lost
    /// to a queue of this host, not to a network (a READ streaming megabytes would lose
    /// the same packets again on every retry).
    fn holds_back(&self, _dst: SocketAddr) -> bool {
        false
    }
    /// Whether, since the last call, a peer changed this endpoint's device's memory with no
    /// datagram (a one-sided WRITE by cross-memory attach, seen in
    /// [`Link::recv_batch`]): threads that wait for the device to change must look again.
    fn take_nudged(&mut self) -> bool {
        false
    }
    /// Whether datagrams to `dst` go through a same-host ring rather than the network
    /// (finding the ring on first use, as a send does), for a trace to say so.
    fn same_host_ring(&self, _dst: SocketAddr) -> bool {
        false
    }
    /// The peers this endpoint has sent to and how their datagrams go, for a network with
    /// more than one path (the same-host rings); empty otherwise.
    fn peer_paths(&self) -> Vec<PeerPath> {
        Vec::new()
    }
    /// The table through which same-host peers copy into and out of this endpoint's
    /// device's memory (`shm::grants`), if it has one.
    fn grants(&self) -> Option<crate::shm::grants::Shared> {
        None
    }
    /// What copies into same-host peers' memory for this endpoint's device, if its
    /// network has such peers.
    fn placer(&self) -> Option<crate::shm::Placer> {
        None
    }
}

/// How datagrams to one peer go ([`Link::peer_paths`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerPath {
    /// The peer's address and UDP port.
    pub peer: SocketAddr,
    /// Through a same-host ring (otherwise UDP).
    pub ring: bool,
    /// Why that path: what made it a ring, or what kept it on UDP.
    pub why: String,
}

/// The two steps around blocking on a link's readable descriptor (see
/// [`Link::sleep_gate`]).
pub trait SleepGate: Send + Sync + std::fmt::Debug {
    /// About to block: returns `false` if datagrams (or a nudge) wait already (receive
    /// them instead; [`SleepGate::end_sleep`] is not called then). After `true`, the
    /// descriptor becomes readable for any datagram that arrives, and, if `nudges`, for
    /// any nudge ([`Link::take_nudged`]), until [`SleepGate::end_sleep`].
    fn prepare_sleep(&self, nudges: bool) -> bool;
    /// Done blocking (woken or timed out); `nudges` as given to
    /// [`SleepGate::prepare_sleep`].
    fn end_sleep(&self, nudges: bool);
}

impl Link for crate::udp::Driver {
    fn local_addr(&self) -> SocketAddr {
        crate::udp::Driver::local_addr(self)
    }
    fn send_batch(&mut self, pkts: &[OutDatagram<'_>]) -> io::Result<usize> {
        crate::udp::Driver::send_batch(self, pkts)
    }
    fn recv_batch(&mut self, out: &mut RecvBatch) -> io::Result<usize> {
        crate::udp::Driver::recv_batch(self, out)
    }
    fn readable_fd(&self) -> BorrowedFd<'_> {
        std::os::fd::AsFd::as_fd(self)
    }
    fn clone_link(&self) -> io::Result<Box<dyn Link>> {
        Ok(Box::new(self.try_clone()?))
    }
    fn send_only_at(&self, src: SocketAddr) -> io::Result<Box<dyn Link>> {
        let mut d = crate::udp::Driver::bind_send_only(src)?;
        d.set_gso(self.gso_enabled());
        Ok(Box::new(d))
    }
    fn stats(&self) -> Stats {
        crate::udp::Driver::stats(self)
    }
    fn recv_buffer_size(&self) -> io::Result<usize> {
        crate::udp::Driver::recv_buffer_size(self)
    }
    fn gso_enabled(&self) -> bool {
        crate::udp::Driver::gso_enabled(self)
    }
    fn gso_run_len(&self, pkts: &[OutDatagram<'_>]) -> usize {
        crate::udp::Driver::gso_run_len(self, pkts)
    }
    fn set_gro(&mut self, on: bool) -> io::Result<bool> {
        crate::udp::Driver::set_gro(self, on)
    }
    fn set_multicast_interface(&self, ifindex: u32) -> io::Result<()> {
        crate::udp::Driver::set_multicast_interface(self, ifindex)
    }
}
