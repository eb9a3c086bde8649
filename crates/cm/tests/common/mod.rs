//! What the CM's integration tests and the CM fuzz harness build alike: loopback
//! addresses, the REQ and REP rdma_cm sends for an RC QP, and one host's port space in
//! memory. Each test binary uses part of it.
#![allow(dead_code)]

use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};

use softrdma_cm::cma::{PortSpace, Reservation};
use softrdma_wire::cm::{CmPath, CmaHeader, Rep, Req};

/// 127.0.0.`x`.
pub fn ip(x: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, x))
}

/// A REQ as rdma_cm sends it for an RC QP, its rdma_cm header naming `src` and `dst` (the
/// sender's CM fills in the comm ID and CA GUID; a forged one sets them itself).
pub fn req(service_id: u64, qpn: u32, psn: u32, src: IpAddr, dst: IpAddr) -> Req {
    let mut private_data = [0u8; 92];
    CmaHeader {
        src_port: 40000,
        src,
        dst,
    }
    .emit(&mut private_data)
    .unwrap();
    Req {
        local_comm_id: 0,
        service_id,
        local_ca_guid: 0,
        local_qkey: 0,
        local_qpn: qpn,
        responder_resources: 1,
        local_eecn: 0,
        initiator_depth: 1,
        remote_eecn: 0,
        remote_cm_response_timeout: 20,
        transport_service_type: 0,
        e2e_flow_control: false,
        starting_psn: psn,
        local_cm_response_timeout: 20,
        retry_count: 7,
        pkey: 0xFFFF,
        path_mtu: 3,
        rdc_exists: false,
        rnr_retry_count: 7,
        max_cm_retries: 15,
        srq: false,
        extended_transport_type: 0,
        primary: CmPath::default(),
        alternate: CmPath::default(),
        sap_supported: false,
        private_data,
    }
}

/// A REP for QP `qpn` starting at `psn`, with no private data.
pub fn rep(qpn: u32, psn: u32) -> Rep {
    Rep {
        local_comm_id: 0,
        remote_comm_id: 0,
        local_qkey: 0,
        local_qpn: qpn,
        local_eecn: 0,
        starting_psn: psn,
        responder_resources: 1,
        initiator_depth: 1,
        target_ack_delay: 0,
        failover_accepted: 0,
        e2e_flow_control: false,
        rnr_retry_count: 7,
        srq: false,
        local_ca_guid: 0,
        private_data: [0; 196],
    }
}

/// A port reservation: port space, address, device, listening.
type Bound = (u16, SocketAddr, SocketAddr, bool);

/// One host's port space in memory, for devices on one host: every loopback address is
/// the host's, a listener is found at its port, binds never conflict.
#[derive(Clone, Default)]
pub struct OneHost(Arc<Mutex<Vec<Bound>>>);

struct Res {
    host: OneHost,
    ps: u16,
    addr: SocketAddr,
}

impl Reservation for Res {
    fn port(&self) -> u16 {
        self.addr.port()
    }
    fn set_listening(&mut self, on: bool) -> io::Result<()> {
        let mut l = self.host.0.lock().unwrap_or_else(|p| p.into_inner());
        for b in l.iter_mut() {
            if b.0 == self.ps && b.1 == self.addr {
                b.3 = on;
            }
        }
        Ok(())
    }
}

impl PortSpace for OneHost {
    fn bind(
        &mut self,
        ps: u16,
        addr: SocketAddr,
        device: SocketAddr,
        _reuse: bool,
        _afonly: bool,
    ) -> io::Result<Box<dyn Reservation>> {
        let mut l = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let port = if addr.port() == 0 {
            40000 + (l.len() % 20000) as u16
        } else {
            addr.port()
        };
        let addr = SocketAddr::new(addr.ip(), port);
        l.push((ps, addr, device, false));
        Ok(Box::new(Res {
            host: self.clone(),
            ps,
            addr,
        }))
    }
    fn lookup(&self, ps: u16, dst: SocketAddr) -> Option<SocketAddr> {
        let l = self.0.lock().unwrap_or_else(|p| p.into_inner());
        l.iter()
            .find(|b| b.0 == ps && b.3 && b.1.port() == dst.port())
            .map(|b| b.2)
    }
    fn is_local(&self, ip: IpAddr) -> bool {
        ip.is_loopback()
    }
    fn has_device(&self, _ip: IpAddr) -> bool {
        true
    }
}
