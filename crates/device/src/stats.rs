//! The runtime's counters and the device's counter snapshot.

use crate::runtime::Runtime;
use crate::{DriverStats, EngineStats};

/// Counters of the runtime (the engine's are in [`EngineStats`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LinkStats {
    /// Datagrams handed to the socket.
    pub tx_datagrams: u64,
    /// UDP payload bytes handed to the socket.
    pub tx_bytes: u64,
    /// Send batches (system calls).
    pub tx_batches: u64,
    /// Datagrams the socket refused (buffer full or error); the transport's retries cover them.
    pub tx_dropped: u64,
    /// Of those, datagrams refused as larger than the route allows (`EMSGSIZE`): a QP's path
    /// MTU above what the link carries. Retries cannot cover these; the QP ends in a retry
    /// error unless its path MTU is lowered.
    pub tx_too_big: u64,
    /// Datagrams a same-host ring had no room for when first offered, kept and sent once
    /// its reader freed slots (see [`softrdma_net::Link::holds_back`]).
    pub tx_held: u64,
    /// Of those, datagrams dropped because the ring's reader freed no slot for
    /// [`crate::DeviceConfig::shm_hold`] (a stopped or hung process); counted in
    /// `tx_dropped` too.
    pub tx_held_expired: u64,
    /// Datagrams received.
    pub rx_datagrams: u64,
    /// UDP payload bytes received.
    pub rx_bytes: u64,
    /// Receive batches that returned data.
    pub rx_batches: u64,
    /// Receive errors other than "nothing there".
    pub rx_errors: u64,
    /// Times the progress thread blocked in poll(2).
    pub sleeps: u64,
    /// Times a poster woke the progress thread for an earlier timer.
    pub wakeups: u64,
    /// Trace records that could not be written.
    pub pcap_errors: u64,
}

/// Engine and runtime counters.
#[derive(Debug, Clone, Default)]
pub struct DeviceStats {
    /// The protocol engine's counters.
    pub engine: EngineStats,
    /// The runtime's counters.
    pub link: LinkStats,
    /// The UDP driver's counters.
    pub driver: DriverStats,
    /// The same-host path: "on", or why it is off.
    pub same_host: String,
    /// The peers the device has sent to, and which path each takes and why.
    pub peers: Vec<softrdma_net::PeerPath>,
}

/// Engine and runtime counters ([`Device::stats`]); also the stats publisher's snapshot,
/// which has the shared state but not the device.
pub(crate) fn stats_of(sh: &Runtime) -> DeviceStats {
    let (rx_drivers, rx_errors) = {
        let rx = sh.rx.lock().unwrap_or_else(|e| e.into_inner());
        let mut v = vec![rx.link.stats()];
        v.extend(rx.alt.as_ref().map(|(d, _)| d.stats()));
        (v, rx.errors)
    };
    let core = sh.lock();
    let mut link = core.stats.clone();
    link.rx_errors += rx_errors;
    let mut driver = core.link.stats();
    for d in core.ports.values().flatten().chain(core.alt_link.iter()) {
        let s = d.stats();
        driver.sent_datagrams += s.sent_datagrams;
        driver.sent_batches += s.sent_batches;
        driver.gso_batches += s.gso_batches;
        driver.errors += s.errors;
        driver.shm_sent_datagrams += s.shm_sent_datagrams;
        driver.shm_full += s.shm_full;
    }
    for r in rx_drivers {
        driver.recv_datagrams += r.recv_datagrams;
        driver.recv_batches += r.recv_batches;
        driver.gro_segments += r.gro_segments;
        driver.errors += r.errors;
        driver.shm_recv_datagrams += r.shm_recv_datagrams;
    }
    DeviceStats {
        engine: core.rnic.stats().clone(),
        link,
        driver,
        same_host: sh.same_host.clone(),
        peers: core.link.peer_paths(),
    }
}
