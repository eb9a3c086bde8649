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
}

/// Engine and runtime counters ([`Device::stats`]); also the stats publisher's snapshot,
/// which has the shared state but not the device.
pub(crate) fn stats_of(sh: &Runtime) -> DeviceStats {
    let (rx_driver, rx_errors) = {
        let rx = sh.rx.lock().unwrap_or_else(|e| e.into_inner());
        (rx.link.stats(), rx.errors)
    };
    let core = sh.lock();
    let mut link = core.stats.clone();
    link.rx_errors += rx_errors;
    let mut driver = core.link.stats();
    for d in core.ports.values().flatten() {
        let s = d.stats();
        driver.sent_datagrams += s.sent_datagrams;
        driver.sent_batches += s.sent_batches;
        driver.gso_batches += s.gso_batches;
        driver.errors += s.errors;
    }
    driver.recv_datagrams += rx_driver.recv_datagrams;
    driver.recv_batches += rx_driver.recv_batches;
    driver.gro_segments += rx_driver.gro_segments;
    driver.errors += rx_driver.errors;
    DeviceStats {
        engine: core.rnic.stats().clone(),
        link,
        driver,
    }
}
