//! The host's rdma_cm port space for a real device: the device crate's file registry,
//! shared by every process of the user on this host.

use std::io;
use std::net::{IpAddr, SocketAddr, UdpSocket};

use softrdma_device::registry::{BindOptions, Binding, PortSpace, Registry};

use crate::cma::{Ports, Reservation};

/// [`Ports`] over the device registry, for the device whose CM listens on UDP port
/// `device_port` (the port every softrdma device on the host shares).
#[derive(Debug, Clone)]
pub struct HostPorts {
    reg: Registry,
    device_port: u16,
}

impl HostPorts {
    /// The registry in `reg`, for devices on UDP port `device_port`.
    pub fn new(reg: Registry, device_port: u16) -> HostPorts {
        HostPorts { reg, device_port }
    }
}

impl Reservation for Binding {
    fn port(&self) -> u16 {
        Binding::port(self)
    }
    fn set_listening(&mut self, on: bool) -> io::Result<()> {
        Binding::set_listening(self, on)
    }
    fn set_reuse_addr(&mut self, on: bool) -> io::Result<()> {
        Binding::set_reuse_addr(self, on)
    }
    fn set_af_only(&mut self, on: bool) -> io::Result<()> {
        Binding::set_af_only(self, on)
    }
}

impl Ports for HostPorts {
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
        Ok(Box::new(self.reg.bind(ps, addr, device, opts)?))
    }

    fn lookup(&self, ps: PortSpace, dst: SocketAddr) -> Option<SocketAddr> {
        self.reg.lookup(ps, dst).map(|l| l.device)
    }

    fn is_local(&self, ip: IpAddr) -> bool {
        // An address this host owns is one a socket can bind.
        ip.is_loopback() || UdpSocket::bind(SocketAddr::new(ip, 0)).is_ok()
    }

    fn listener_alive(&self, ps: PortSpace, dst: SocketAddr, device: IpAddr) -> bool {
        // A lock probe of the listener's record, kept from the lookup that found it,
        // where has_device makes and binds a socket.
        self.reg.listener_known(ps, dst, |d| d.ip() == device)
    }

    fn has_device(&self, ip: IpAddr) -> bool {
        // A device holds its address's RoCE port: if we can bind it, nobody serves there.
        match UdpSocket::bind(SocketAddr::new(ip, self.device_port)) {
            Ok(_) => false,
            Err(e) => e.kind() == io::ErrorKind::AddrInUse,
        }
    }
}
