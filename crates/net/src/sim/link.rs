//! The `sim` network as a [`Link`] in real time, so that a device runtime (its threads,
//! its blocking waits) can run on it in a test: [`SimNet`] is the network shared by the
//! endpoints, [`SimNet::attach`] gives a device its endpoint.
//!
//! Time here is the network's own: every datagram a send hands over is decided by the
//! seeded [`Network`] (loss, duplication, corruption, partitions) and delivered at once,
//! in the order the network's delays put the packets in flight. The delays themselves are
//! not waited out: a device's clock is real, and a packet due later than "now" would need
//! someone to wake for it.

use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex, MutexGuard};

use super::{Faults, Network, Packet, Stats as NetStats};
use crate::udp::{InDatagram, OutDatagram, RecvBatch, Stats};
use crate::Link;

/// Bytes the endpoint reports as its receive buffer (what a UDP socket asks for).
const RECV_BUFFER: usize = 4 << 20;

/// What an endpoint has waiting, and the pair of sockets that makes that visible to
/// poll(2): one byte sits in `signal` while `queue` is not empty.
#[derive(Debug)]
struct Inbox {
    queue: VecDeque<Packet>,
    /// The end poll(2) watches.
    wait: Arc<UnixStream>,
    /// The end a byte is written to.
    signal: UnixStream,
    signaled: bool,
}

#[derive(Debug)]
struct Hub {
    net: Network,
    inboxes: HashMap<SocketAddr, Inbox>,
}

impl Hub {
    /// Hand every packet in flight to its endpoint's inbox.
    fn pump(&mut self) {
        while let Some(p) = self.net.pop_due(u64::MAX) {
            let Some(inbox) = self.inboxes.get_mut(&p.dst) else {
                continue;
            };
            inbox.queue.push_back(p);
            if !inbox.signaled {
                // One byte in a fresh socket buffer cannot block.
                if inbox.signal.write_all(&[1]).is_ok() {
                    inbox.signaled = true;
                }
            }
        }
    }
}

/// A `sim` [`Network`] shared by endpoints in real time. Cheap to clone (shared).
#[derive(Debug, Clone)]
pub struct SimNet {
    hub: Arc<Mutex<Hub>>,
}

impl SimNet {
    /// A network whose random decisions derive from `seed`.
    pub fn new(seed: u64, faults: Faults) -> SimNet {
        SimNet {
            hub: Arc::new(Mutex::new(Hub {
                net: Network::new(seed, faults),
                inboxes: HashMap::new(),
            })),
        }
    }

    fn hub(&self) -> MutexGuard<'_, Hub> {
        self.hub.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The endpoint at `addr`, which receives what is sent to that address and port.
    /// `AddrInUse` if another endpoint has it; an address stays taken while the network
    /// lives.
    pub fn attach(&self, addr: SocketAddr) -> io::Result<SimLink> {
        let mut hub = self.hub();
        if hub.inboxes.contains_key(&addr) {
            return Err(io::ErrorKind::AddrInUse.into());
        }
        let (wait, signal) = UnixStream::pair()?;
        wait.set_nonblocking(true)?;
        signal.set_nonblocking(true)?;
        let wait = Arc::new(wait);
        hub.inboxes.insert(
            addr,
            Inbox {
                queue: VecDeque::new(),
                wait: Arc::clone(&wait),
                signal,
                signaled: false,
            },
        );
        Ok(SimLink {
            net: self.clone(),
            addr,
            wait,
            quiet: None,
            stats: Stats::default(),
        })
    }

    /// Change the fault model for packets sent from now on.
    pub fn set_faults(&self, f: Faults) {
        self.hub().net.set_faults(f);
    }

    /// What the network has done so far.
    pub fn stats(&self) -> NetStats {
        self.hub().net.stats().clone()
    }
}

/// One endpoint of a [`SimNet`]: a [`Link`] a device runs on.
#[derive(Debug)]
pub struct SimLink {
    net: SimNet,
    addr: SocketAddr,
    /// The readiness end of the inbox (of a send-only endpoint: of a pair nobody writes).
    wait: Arc<UnixStream>,
    /// A send-only endpoint's other end of `wait`, kept open so that `wait` never reads
    /// as closed.
    quiet: Option<Arc<UnixStream>>,
    stats: Stats,
}

impl Link for SimLink {
    fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    fn send_batch(&mut self, pkts: &[OutDatagram<'_>]) -> io::Result<usize> {
        let mut hub = self.net.hub();
        for p in pkts {
            // Addresses written as IPv4-mapped IPv6 (GIDs) are IPv4 ones.
            let dst = SocketAddr::new(p.dst.ip().to_canonical(), p.dst.port());
            hub.net.send(
                0,
                Packet {
                    src: self.addr,
                    dst,
                    tos: p.tos,
                    data: p.data.to_vec(),
                },
            );
        }
        hub.pump();
        if !pkts.is_empty() {
            self.stats.sent_datagrams += pkts.len() as u64;
            self.stats.sent_batches += 1;
        }
        Ok(pkts.len())
    }

    fn recv_batch(&mut self, out: &mut RecvBatch) -> io::Result<usize> {
        let mut hub = self.net.hub();
        hub.pump();
        let Some(inbox) = hub.inboxes.get_mut(&self.addr) else {
            return Ok(out.fill(std::iter::empty()));
        };
        let k = out.capacity().min(inbox.queue.len());
        let taken: Vec<Packet> = inbox.queue.drain(..k).collect();
        if inbox.queue.is_empty() && inbox.signaled {
            let mut b = [0u8; 16];
            while matches!((&*inbox.wait).read(&mut b), Ok(n) if n > 0) {}
            inbox.signaled = false;
        }
        drop(hub);
        let n = out.fill(taken.iter().map(|p| InDatagram {
            src: p.src,
            dst: p.dst,
            tos: p.tos,
            data: &p.data,
            shm: false,
        }));
        if n > 0 {
            self.stats.recv_datagrams += n as u64;
            self.stats.recv_batches += 1;
        }
        Ok(n)
    }

    fn readable_fd(&self) -> BorrowedFd<'_> {
        self.wait.as_fd()
    }

    fn clone_link(&self) -> io::Result<Box<dyn Link>> {
        Ok(Box::new(SimLink {
            net: self.net.clone(),
            addr: self.addr,
            wait: Arc::clone(&self.wait),
            quiet: self.quiet.clone(),
            stats: Stats::default(),
        }))
    }

    fn send_only_at(&self, src: SocketAddr) -> io::Result<Box<dyn Link>> {
        let (wait, quiet) = UnixStream::pair()?;
        Ok(Box::new(SimLink {
            net: self.net.clone(),
            addr: src,
            wait: Arc::new(wait),
            quiet: Some(Arc::new(quiet)),
            stats: Stats::default(),
        }))
    }

    fn stats(&self) -> Stats {
        self.stats
    }

    fn recv_buffer_size(&self) -> io::Result<usize> {
        Ok(RECV_BUFFER)
    }
}
