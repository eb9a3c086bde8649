//! What the CM's integration tests and the CM fuzz harness build alike: loopback
//! addresses, one host's port space in memory, and devices on loopback with their CM
//! agents (the REQ and REP they send are the test kit's, `softrdma_testkit::cm`). Each
//! test binary uses part of it.
#![allow(dead_code)]

use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use softrdma_cm::agent::{Agent, EventChannel};
use softrdma_cm::cma::{CmaEvent, EventType, Ports, Reservation};
use softrdma_cm::host::HostPorts;
use softrdma_device::ports::{BindOptions, HostFacts, Key, PortSpace, PortTable};
use softrdma_device::registry::Registry;
use softrdma_device::{Device, DeviceAddr, DeviceConfig};

/// 127.0.0.`x`.
pub fn ip(x: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, x))
}

/// A device on loopback at UDP port `dev_port` (each test binary its own, so that
/// binaries running at once keep apart) that writes no statistics file and no capture.
pub fn device(name: &str, dev_port: u16) -> Arc<Device> {
    let mut cfg = DeviceConfig::new(name, DeviceAddr::AutoLoopback(dev_port));
    cfg.stats_dir = None;
    cfg.pcap = None;
    Arc::new(Device::open(&cfg).expect("open device"))
}

/// The CM agent of `dev`, binding its ports in `reg` for devices at `dev_port`, seeded
/// with `seed`.
pub fn agent(dev: &Arc<Device>, reg: &Registry, dev_port: u16, seed: u64) -> Agent {
    let ports = HostPorts::new(reg.clone(), dev_port);
    Agent::start(Arc::clone(dev), Box::new(ports), seed).expect("start CM agent")
}

/// The next event of `ch`, which must be `want`, within 20 s.
pub fn next(ch: &EventChannel, want: EventType) -> CmaEvent {
    let ev = ch
        .get_timeout(Some(Duration::from_secs(20)))
        .expect("channel")
        .unwrap_or_else(|| panic!("no {want:?} within 20 s"));
    assert_eq!(ev.event, want, "{ev:?}");
    ev
}

/// One host's port table in memory, for devices on one host, under the registry's rules
/// ([`softrdma_device::ports`]): every loopback address is the host's and a listener is
/// found as the registry finds it. Cloning shares the table.
#[derive(Clone)]
pub struct OneHost {
    table: Arc<Mutex<PortTable<SocketAddr>>>,
    /// The addresses devices serve at; None: every address has one.
    devices: Option<Vec<IpAddr>>,
}

impl Default for OneHost {
    fn default() -> Self {
        OneHost {
            table: Arc::new(Mutex::new(PortTable::new(HostFacts::default(), 1))),
            devices: None,
        }
    }
}

impl OneHost {
    /// A host where devices serve only at `devices` (the rest reject at once).
    pub fn with_devices(devices: Vec<IpAddr>) -> OneHost {
        OneHost {
            devices: Some(devices),
            ..OneHost::default()
        }
    }

    fn table(&self) -> MutexGuard<'_, PortTable<SocketAddr>> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }
}

struct Res {
    host: OneHost,
    key: Key,
    port: u16,
}

impl Reservation for Res {
    fn port(&self) -> u16 {
        self.port
    }
    fn set_listening(&mut self, on: bool) -> io::Result<()> {
        Ok(self.host.table().set_listening(self.key, on)?)
    }
    fn set_reuse_addr(&mut self, on: bool) -> io::Result<()> {
        Ok(self.host.table().set_reuse_addr(self.key, on)?)
    }
    fn set_af_only(&mut self, on: bool) -> io::Result<()> {
        Ok(self.host.table().set_af_only(self.key, on)?)
    }
}

impl Drop for Res {
    fn drop(&mut self) {
        self.host.table().release(self.key);
    }
}

impl Ports for OneHost {
    fn bind(
        &mut self,
        ps: PortSpace,
        addr: SocketAddr,
        device: SocketAddr,
        reuse: bool,
        afonly: bool,
    ) -> io::Result<Box<dyn Reservation>> {
        let opts = BindOptions {
            reuse_addr: reuse,
            af_only: afonly.then_some(true),
            dst: None,
        };
        let (key, port) = {
            let mut t = self.table();
            let (key, b) = t.bind(ps, addr, opts, device)?;
            (key, b.addr.port())
        };
        Ok(Box::new(Res {
            host: self.clone(),
            key,
            port,
        }))
    }
    fn lookup(&self, ps: PortSpace, dst: SocketAddr) -> Option<SocketAddr> {
        self.table().lookup(ps, dst).map(|(_, d)| *d)
    }
    fn is_local(&self, ip: IpAddr) -> bool {
        ip.is_loopback()
    }
    fn has_device(&self, ip: IpAddr) -> bool {
        self.devices.as_ref().map_or(true, |d| d.contains(&ip))
    }
}
