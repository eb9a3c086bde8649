//! The rdma_cm model between devices on the `sim` network: a wildcard listener found at
//! 127.0.0.1 whatever address its device has, connect / accept / establish with the QP
//! attributes each side needs, private data both ways, reject with private data, a
//! destination nobody serves, disconnect from either side, port conflicts, UD (SIDR),
//! multicast join and leave, and the same handshakes under loss, duplication and
//! reordering.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

mod common;

use common::{ip, OneHost};
use proptest::prelude::*;
use softrdma_cm::cma::{
    errno, Cma, CmaEvent, ConnParam, EventParam, EventType, IdHandle, IdOption, McastJoin, Service,
    UDP_QKEY,
};
use softrdma_cm::ib::Peer;
use softrdma_net::sim::{Endpoint, Faults, Network, Packet, Sim};
use softrdma_verbs::{Access, AhAttr, Gid, GlobalRoute, Mtu, QpAttrMask, QpState};
use softrdma_wire::cm::{port_space, rej_reason, CmMsg};

const SEC: u64 = 1_000_000_000;
const PORT: u16 = 4791;

struct Node {
    ip: IpAddr,
    cma: Cma,
    events: Vec<CmaEvent>,
}

impl Node {
    fn new(x: u8, host: &OneHost, seed: u64) -> Node {
        let dev = SocketAddr::new(ip(x), PORT);
        Node {
            ip: ip(x),
            cma: Cma::new(dev, 0x1000 + u64::from(x), seed, Box::new(host.clone())),
            events: Vec::new(),
        }
    }
    fn collect(&mut self) {
        while let Some(e) = self.cma.poll_event() {
            self.events.push(e);
        }
    }
    fn take(&mut self, t: EventType) -> Option<CmaEvent> {
        self.collect();
        let at = self.events.iter().position(|e| e.event == t)?;
        Some(self.events.remove(at))
    }
}

impl Endpoint for Node {
    fn addr(&self) -> SocketAddr {
        SocketAddr::new(self.ip, PORT)
    }
    fn handle_packet(&mut self, now: u64, pkt: Packet) {
        self.cma.handle_mad(now, Peer::gsi(pkt.src.ip()), &pkt.data);
    }
    fn poll_transmit(&mut self, _now: u64) -> Option<Packet> {
        let (to, mad) = self.cma.poll_transmit()?;
        Some(Packet {
            src: SocketAddr::new(self.ip, PORT),
            dst: SocketAddr::new(to.ip, PORT),
            tos: 0,
            data: mad.to_vec(),
        })
    }
    fn poll_timeout(&self) -> Option<u64> {
        self.cma.poll_timeout()
    }
    fn handle_timeout(&mut self, now: u64) {
        self.cma.handle_timeout(now);
    }
}

fn faults(loss: f64, dup: f64, reorder: f64) -> Faults {
    Faults {
        loss,
        duplicate: dup,
        reorder,
        delay_ns: 30_000,
        jitter_ns: 10_000,
        reorder_extra_ns: 1_000_000,
        ..Faults::default()
    }
}

/// Client node 0 (127.0.0.3), server node 1 (127.0.0.7), both on one host.
fn pair(seed: u64, f: Faults) -> Sim<Node> {
    let host = OneHost::with_devices(vec![ip(3), ip(7)]);
    let mut sim = Sim::new(Network::new(seed, f));
    sim.add(Node::new(3, &host, seed ^ 0x33));
    sim.add(Node::new(7, &host, seed ^ 0x77));
    sim
}

fn wait_for(sim: &mut Sim<Node>, node: usize, t: EventType) -> CmaEvent {
    let mut got = None;
    let ok = sim.run_until(3600 * SEC, |s| {
        got = s.endpoints[node].take(t);
        got.is_some()
    });
    assert!(
        ok,
        "node {node}: no {t:?} event; has {:?}",
        sim.endpoints[node].events
    );
    got.unwrap()
}

fn param(qpn: u32, data: &[u8]) -> ConnParam {
    ConnParam {
        private_data: data.to_vec(),
        responder_resources: 4,
        initiator_depth: 4,
        retry_count: 7,
        rnr_retry_count: 7,
        qp_num: qpn,
        ..ConnParam::default()
    }
}

/// Server listening on the wildcard address at `port`; returns the listener.
fn serve(sim: &mut Sim<Node>, port: u16) -> IdHandle {
    let s = &mut sim.endpoints[1].cma;
    let l = s.create_id(1, port_space::TCP, None).unwrap();
    s.bind(l, SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port))
        .unwrap();
    s.listen(l, 8).unwrap();
    l
}

/// Client id resolved to 127.0.0.1:`port`.
fn client(sim: &mut Sim<Node>, port: u16) -> IdHandle {
    let c = &mut sim.endpoints[0].cma;
    let id = c.create_id(1, port_space::TCP, None).unwrap();
    c.resolve_addr(id, None, SocketAddr::new(ip(1), port))
        .unwrap();
    assert!(sim.endpoints[0].take(EventType::AddrResolved).is_some());
    sim.endpoints[0].cma.resolve_route(id).unwrap();
    assert!(sim.endpoints[0].take(EventType::RouteResolved).is_some());
    id
}

/// Connect and establish; returns (client id, server id).
fn establish(sim: &mut Sim<Node>, port: u16) -> (IdHandle, IdHandle) {
    let id = client(sim, port);
    let now = sim.now;
    sim.endpoints[0]
        .cma
        .connect(now, id, &param(0x111, b"hello server"))
        .unwrap();
    let req = wait_for(sim, 1, EventType::ConnectRequest);
    let EventParam::Conn(cp) = &req.param else {
        panic!("{req:?}")
    };
    assert_eq!(&cp.private_data[..12], b"hello server");
    assert_eq!(cp.qp_num, 0x111);
    let sid = req.id;
    // The child id carries the addresses: the one the client dialled, and the client's.
    let (src, dst) = sim.endpoints[1].cma.addrs(sid).unwrap();
    assert_eq!(src.unwrap(), SocketAddr::new(ip(1), port));
    assert_eq!(dst.unwrap().ip(), ip(3));
    // librdmacm moves the passive QP to RTR and RTS before it sends the REP: what the
    // model says then must be what the REP promises.
    let (srtr, _) = sim.endpoints[1]
        .cma
        .init_qp_attr(sid, QpState::Rtr)
        .unwrap();
    let (srts, _) = sim.endpoints[1]
        .cma
        .init_qp_attr(sid, QpState::Rts)
        .unwrap();
    let now = sim.now;
    sim.endpoints[1]
        .cma
        .accept(now, sid, &param(0x222, b"welcome"))
        .unwrap();
    let resp = wait_for(sim, 0, EventType::ConnectResponse);
    let EventParam::Conn(rp) = &resp.param else {
        panic!()
    };
    assert_eq!(&rp.private_data[..7], b"welcome");
    assert_eq!(rp.qp_num, 0x222);
    // What each QP must be told agrees with what the other side said.
    let (crtr, cm) = sim.endpoints[0].cma.init_qp_attr(id, QpState::Rtr).unwrap();
    assert!(cm.contains(QpAttrMask::DEST_QPN | QpAttrMask::RQ_PSN | QpAttrMask::AV));
    assert_eq!(crtr.dest_qp_num, 0x222);
    assert_eq!(crtr.ah_attr.grh.dgid.to_ip(), ip(7));
    assert_eq!(srtr.dest_qp_num, 0x111);
    assert_eq!(srtr.ah_attr.grh.dgid.to_ip(), ip(3));
    let (crts, _) = sim.endpoints[0].cma.init_qp_attr(id, QpState::Rts).unwrap();
    assert_eq!(crtr.rq_psn, srts.sq_psn);
    assert_eq!(srtr.rq_psn, crts.sq_psn);
    assert_eq!(crts.retry_cnt, 7);
    assert!(crts.timeout > 0);
    let now = sim.now;
    sim.endpoints[0]
        .cma
        .accept(now, id, &ConnParam::default())
        .unwrap();
    wait_for(sim, 1, EventType::Established);
    (id, sid)
}

#[test]
fn wildcard_listener_is_found_at_127_0_0_1_and_connects() {
    let mut sim = pair(1, faults(0.0, 0.0, 0.0));
    serve(&mut sim, 7174);
    let (id, sid) = establish(&mut sim, 7174);
    // Disconnect from the client: both sides hear DISCONNECTED exactly once.
    let now = sim.now;
    sim.endpoints[0].cma.disconnect(now, id).unwrap();
    wait_for(&mut sim, 1, EventType::Disconnected);
    let now = sim.now;
    sim.endpoints[1].cma.disconnect(now, sid).unwrap();
    wait_for(&mut sim, 0, EventType::Disconnected);
    sim.run_to_idle(3600 * SEC);
    for n in &mut sim.endpoints {
        n.collect();
        assert!(
            n.events.iter().all(|e| e.event == EventType::TimewaitExit),
            "{:?}",
            n.events
        );
    }
}

/// The device found the client QP's peer lost (its keepalive probes unanswered): the
/// client's id gets DISCONNECTED at once, status 0, as the peer's DREQ would have given
/// it, and a DREQ goes out, from which a server alive after all learns that the
/// connection is over. A QP no connection uses is not the CM's.
#[test]
fn a_lost_peer_disconnects_its_connection() {
    let mut sim = pair(2, faults(0.0, 0.0, 0.0));
    serve(&mut sim, 7002);
    let (id, sid) = establish(&mut sim, 7002);
    let now = sim.now;
    assert!(!sim.endpoints[0].cma.peer_lost(now, 0x333));
    assert!(sim.endpoints[0].cma.peer_lost(now, 0x111));
    let ev = sim.endpoints[0]
        .take(EventType::Disconnected)
        .expect("DISCONNECTED at once");
    assert_eq!((ev.id, ev.status), (id, 0));
    let ev = wait_for(&mut sim, 1, EventType::Disconnected);
    assert_eq!(ev.id, sid);
    // Told again (a second notice), nothing more happens.
    let now = sim.now;
    sim.endpoints[0].cma.peer_lost(now, 0x111);
    let now = sim.now;
    sim.endpoints[0].cma.disconnect(now, id).unwrap();
    sim.endpoints[1].cma.disconnect(now, sid).unwrap();
    sim.run_to_idle(3600 * SEC);
    for n in &mut sim.endpoints {
        n.collect();
        assert!(
            n.events.iter().all(|e| e.event == EventType::TimewaitExit),
            "{:?}",
            n.events
        );
    }
}

#[test]
fn disconnect_from_the_server_side() {
    let mut sim = pair(2, faults(0.0, 0.0, 0.0));
    serve(&mut sim, 7000);
    let (id, sid) = establish(&mut sim, 7000);
    let now = sim.now;
    sim.endpoints[1].cma.disconnect(now, sid).unwrap();
    wait_for(&mut sim, 0, EventType::Disconnected);
    let now = sim.now;
    sim.endpoints[0].cma.disconnect(now, id).unwrap();
    wait_for(&mut sim, 1, EventType::Disconnected);
}

#[test]
fn reject_carries_private_data_and_reason_28() {
    let mut sim = pair(3, faults(0.0, 0.0, 0.0));
    serve(&mut sim, 7001);
    let id = client(&mut sim, 7001);
    sim.endpoints[0]
        .cma
        .connect(0, id, &param(0x111, b"let me in"))
        .unwrap();
    let req = wait_for(&mut sim, 1, EventType::ConnectRequest);
    let now = sim.now;
    sim.endpoints[1]
        .cma
        .reject(now, req.id, b"go away")
        .unwrap();
    let rej = wait_for(&mut sim, 0, EventType::Rejected);
    assert_eq!(rej.status, i32::from(rej_reason::CONSUMER_REJECT));
    let EventParam::Conn(p) = rej.param else {
        panic!()
    };
    assert_eq!(&p.private_data[..7], b"go away");
}

#[test]
fn a_client_that_resolves_before_the_server_listens_finds_it_at_connect() {
    // Linux's one CM finds the listener when the REQ arrives, so clients may resolve
    // (even the route) before the server listens; rdma-core's tests do.
    for route_first in [false, true] {
        let mut sim = pair(5, faults(0.0, 0.0, 0.0));
        let port = 7005;
        let c = &mut sim.endpoints[0].cma;
        let id = c.create_id(1, port_space::TCP, None).unwrap();
        c.resolve_addr(id, None, SocketAddr::new(ip(1), port))
            .unwrap();
        if route_first {
            c.resolve_route(id).unwrap();
        }
        serve(&mut sim, port);
        let c = &mut sim.endpoints[0].cma;
        if !route_first {
            c.resolve_route(id).unwrap();
            assert_eq!(c.peer_device(id).unwrap(), Some(ip(7)), "the route");
        }
        c.connect(0, id, &param(0x111, b"late")).unwrap();
        let req = wait_for(&mut sim, 1, EventType::ConnectRequest);
        let EventParam::Conn(cp) = &req.param else {
            panic!("{req:?}")
        };
        assert_eq!(&cp.private_data[..4], b"late");
        assert_eq!(sim.endpoints[0].cma.peer_device(id).unwrap(), Some(ip(7)));
    }
}

#[test]
fn nobody_serving_the_destination_is_rejected_with_reason_8() {
    let mut sim = pair(4, faults(0.0, 0.0, 0.0));
    // No listener and no device at 127.0.0.1: the host rejects.
    let id = client(&mut sim, 7002);
    sim.endpoints[0].cma.connect(0, id, &param(1, b"")).unwrap();
    let rej = wait_for(&mut sim, 0, EventType::Rejected);
    assert_eq!(rej.status, i32::from(rej_reason::INVALID_SERVICE_ID));
    // A device there but no listener: its CM rejects, the same way.
    let c = &mut sim.endpoints[0].cma;
    let id = c.create_id(1, port_space::TCP, None).unwrap();
    c.resolve_addr(id, None, SocketAddr::new(ip(7), 7003))
        .unwrap();
    c.resolve_route(id).unwrap();
    c.connect(0, id, &param(1, b"")).unwrap();
    let rej = wait_for(&mut sim, 0, EventType::Rejected);
    assert_eq!(rej.status, i32::from(rej_reason::INVALID_SERVICE_ID));
}

#[test]
fn two_listeners_on_one_port_conflict_and_private_data_is_limited() {
    let mut sim = pair(5, faults(0.0, 0.0, 0.0));
    serve(&mut sim, 7004);
    let c = &mut sim.endpoints[0].cma;
    let other = c.create_id(1, port_space::TCP, None).unwrap();
    let e = c
        .bind(
            other,
            SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 7004),
        )
        .unwrap_err();
    assert_eq!(e.errno, errno::EADDRNOTAVAIL);
    let id = client(&mut sim, 7004);
    let e = sim.endpoints[0]
        .cma
        .connect(0, id, &param(1, &[0; 57]))
        .unwrap_err();
    assert_eq!(e.errno, errno::EINVAL);
    sim.endpoints[0]
        .cma
        .connect(0, id, &param(1, &[7; 56]))
        .unwrap();
    let req = wait_for(&mut sim, 1, EventType::ConnectRequest);
    let e = sim.endpoints[1]
        .cma
        .accept(sim.now, req.id, &param(2, &[0; 197]))
        .unwrap_err();
    assert_eq!(e.errno, errno::EINVAL);
    // Linux's rdma_accept rejects a request it fails to accept: the client hears at once
    // (reason 28, no private data) instead of waiting out the MRA's service timeout.
    let rej = wait_for(&mut sim, 0, EventType::Rejected);
    assert_eq!(rej.status, i32::from(rej_reason::CONSUMER_REJECT));
    let EventParam::Conn(p) = rej.param else {
        panic!()
    };
    assert!(p.private_data.iter().all(|&b| b == 0));
}

#[test]
fn a_peer_that_never_answers_is_unreachable() {
    let host = OneHost::with_devices(vec![ip(3), ip(9)]);
    let mut sim = Sim::new(Network::new(6, faults(0.0, 0.0, 0.0)));
    sim.add(Node::new(3, &host, 1));
    // 127.0.0.9 has a device (so the host does not reject) that never answers.
    let c = &mut sim.endpoints[0].cma;
    let id = c.create_id(1, port_space::TCP, None).unwrap();
    c.resolve_addr(id, None, SocketAddr::new(ip(9), 7005))
        .unwrap();
    c.resolve_route(id).unwrap();
    c.connect(0, id, &param(1, b"")).unwrap();
    let ev = wait_for(&mut sim, 0, EventType::Unreachable);
    assert_eq!(ev.status, -errno::ETIMEDOUT);
    // Linux's timeouts: 16 tries of 2 × 2^8 + 2^12 ms.
    assert_eq!(sim.now, 16 * 4608 * 1_000_000);
}

#[test]
fn ud_ids_resolve_the_peer_qp_with_sidr() {
    let mut sim = pair(7, faults(0.0, 0.0, 0.0));
    let s = &mut sim.endpoints[1].cma;
    let l = s.create_id(1, port_space::UDP, None).unwrap();
    assert_eq!(s.kind(l).unwrap().1, Service::Ud);
    s.bind(l, SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 7006))
        .unwrap();
    s.listen(l, 4).unwrap();
    let c = &mut sim.endpoints[0].cma;
    let id = c.create_id(1, port_space::UDP, None).unwrap();
    c.resolve_addr(id, None, SocketAddr::new(ip(1), 7006))
        .unwrap();
    c.resolve_route(id).unwrap();
    let (init, m) = c.init_qp_attr(id, QpState::Init).unwrap();
    assert!(m.contains(QpAttrMask::QKEY));
    assert_eq!(init.qkey, UDP_QKEY);
    // A SIDR_REQ carries 180 bytes after the CMA header (a REQ only 56): 181 is EINVAL.
    let e = c.connect(0, id, &param(0x333, &[1; 181])).unwrap_err();
    assert_eq!(e.errno, errno::EINVAL);
    let mut data = [0u8; 180];
    data[..8].copy_from_slice(b"ud hello");
    data[179] = 0xAB;
    c.connect(0, id, &param(0x333, &data)).unwrap();
    let req = wait_for(&mut sim, 1, EventType::ConnectRequest);
    let EventParam::Ud(up) = &req.param else {
        panic!("{req:?}")
    };
    assert_eq!(up.private_data, data);
    let now = sim.now;
    sim.endpoints[1]
        .cma
        .accept(now, req.id, &param(0x444, b"ud welcome"))
        .unwrap();
    let est = wait_for(&mut sim, 0, EventType::Established);
    let EventParam::Ud(up) = est.param else {
        panic!()
    };
    assert_eq!(up.qp_num, 0x444);
    assert_eq!(up.qkey, UDP_QKEY);
    assert_eq!(up.ah_attr.grh.dgid.to_ip(), ip(7));
    assert_eq!(&up.private_data[..10], b"ud welcome");
}

/// A refused UD request: UNREACHABLE with the SIDR_REP's status (2, rejected) and the
/// server's private data in the event's UD parameters, as Linux's cma_sidr_rep_handler
/// passes them; nothing listening gives status 1.
#[test]
fn ud_refusals_carry_status_and_private_data() {
    let mut sim = pair(8, faults(0.0, 0.0, 0.0));
    let s = &mut sim.endpoints[1].cma;
    let l = s.create_id(1, port_space::UDP, None).unwrap();
    s.bind(l, SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 7007))
        .unwrap();
    s.listen(l, 4).unwrap();
    let ud_client = |sim: &mut Sim<Node>, port: u16| {
        let c = &mut sim.endpoints[0].cma;
        let id = c.create_id(1, port_space::UDP, None).unwrap();
        c.resolve_addr(id, None, SocketAddr::new(ip(1), port))
            .unwrap();
        c.resolve_route(id).unwrap();
        c.connect(0, id, &param(0x333, b"let me in")).unwrap();
        id
    };
    let id = ud_client(&mut sim, 7007);
    let req = wait_for(&mut sim, 1, EventType::ConnectRequest);
    let now = sim.now;
    sim.endpoints[1]
        .cma
        .reject(now, req.id, b"not today")
        .unwrap();
    let ev = wait_for(&mut sim, 0, EventType::Unreachable);
    assert_eq!((ev.id, ev.status), (id, 2));
    let EventParam::Ud(up) = &ev.param else {
        panic!("{ev:?}")
    };
    assert_eq!(&up.private_data[..9], b"not today");
    assert_eq!(up.private_data.len(), 136, "a SIDR_REP's private data");
    assert_eq!((up.qp_num, up.qkey), (0, 0));

    let id = ud_client(&mut sim, 7017);
    let ev = wait_for(&mut sim, 0, EventType::Unreachable);
    assert_eq!((ev.id, ev.status), (id, 1));
}

#[test]
fn ack_timeout_is_for_rc_ids() {
    let mut sim = pair(9, faults(0.0, 0.0, 0.0));
    let c = &mut sim.endpoints[0].cma;
    let ud = c.create_id(1, port_space::UDP, None).unwrap();
    let e = c.set_option(ud, IdOption::AckTimeout(18)).unwrap_err();
    assert_eq!(e.errno, errno::EINVAL);
    let uc = c.create_id(1, port_space::IB, Some(Service::Uc)).unwrap();
    let e = c.set_option(uc, IdOption::AckTimeout(18)).unwrap_err();
    assert_eq!(e.errno, errno::EINVAL);
    // An RC id's RTS timeout is the option's.
    serve(&mut sim, 7008);
    let id = client(&mut sim, 7008);
    let c = &mut sim.endpoints[0].cma;
    c.set_option(id, IdOption::AckTimeout(18)).unwrap();
    sim.endpoints[0].cma.connect(0, id, &param(1, b"")).unwrap();
    let req = wait_for(&mut sim, 1, EventType::ConnectRequest);
    let now = sim.now;
    sim.endpoints[1]
        .cma
        .accept(now, req.id, &param(2, b""))
        .unwrap();
    wait_for(&mut sim, 0, EventType::ConnectResponse);
    let (rts, m) = sim.endpoints[0].cma.init_qp_attr(id, QpState::Rts).unwrap();
    assert!(m.contains(QpAttrMask::TIMEOUT));
    assert_eq!(rts.timeout, 18);
}

#[test]
fn the_clients_tos_is_the_traffic_class_of_both_address_vectors() {
    let mut sim = pair(11, faults(0.0, 0.0, 0.0));
    let l = serve(&mut sim, 7010);
    sim.endpoints[1]
        .cma
        .set_option(l, IdOption::Tos(64))
        .unwrap();
    let c = &mut sim.endpoints[0].cma;
    let id = c.create_id(1, port_space::TCP, None).unwrap();
    c.set_option(id, IdOption::Tos(32)).unwrap();
    c.resolve_addr(id, None, SocketAddr::new(ip(1), 7010))
        .unwrap();
    c.resolve_route(id).unwrap();
    assert_eq!(c.tos(id).unwrap(), 32);
    c.connect(0, id, &param(1, b"")).unwrap();
    let req = wait_for(&mut sim, 1, EventType::ConnectRequest);
    // The passive side's path is the REQ's: the client's TOS, not the listener's.
    let s = &mut sim.endpoints[1].cma;
    assert_eq!(s.tos(req.id).unwrap(), 32);
    let (srtr, _) = s.init_qp_attr(req.id, QpState::Rtr).unwrap();
    assert_eq!(srtr.ah_attr.grh.traffic_class, 32);
    let now = sim.now;
    s.accept(now, req.id, &param(2, b"")).unwrap();
    wait_for(&mut sim, 0, EventType::ConnectResponse);
    let (crtr, _) = sim.endpoints[0].cma.init_qp_attr(id, QpState::Rtr).unwrap();
    assert_eq!(crtr.ah_attr.grh.traffic_class, 32);
}

#[test]
fn the_clients_path_mtu_is_both_qps_path_mtu() {
    let mut sim = pair(12, faults(0.0, 0.0, 0.0));
    serve(&mut sim, 7011);
    // The server's device sits on a smaller link: the REQ's MTU still rules both ends,
    // or they would split messages at different sizes.
    sim.endpoints[0].cma.set_path_mtu(Mtu::Mtu4096);
    sim.endpoints[1].cma.set_path_mtu(Mtu::Mtu1024);
    let id = client(&mut sim, 7011);
    let c = &mut sim.endpoints[0].cma;
    assert_eq!(c.path_mtu(id).unwrap(), Mtu::Mtu4096);
    c.connect(0, id, &param(1, b"")).unwrap();
    let req = wait_for(&mut sim, 1, EventType::ConnectRequest);
    let s = &mut sim.endpoints[1].cma;
    assert_eq!(s.path_mtu(req.id).unwrap(), Mtu::Mtu4096);
    let (srtr, sm) = s.init_qp_attr(req.id, QpState::Rtr).unwrap();
    assert!(sm.contains(QpAttrMask::PATH_MTU));
    assert_eq!(srtr.path_mtu, Mtu::Mtu4096);
    let now = sim.now;
    s.accept(now, req.id, &param(2, b"")).unwrap();
    wait_for(&mut sim, 0, EventType::ConnectResponse);
    let (crtr, _) = sim.endpoints[0].cma.init_qp_attr(id, QpState::Rtr).unwrap();
    assert_eq!(crtr.path_mtu, Mtu::Mtu4096);

    // An MTU set later applies to routes resolved later; one resolved keeps its own.
    sim.endpoints[0].cma.set_path_mtu(Mtu::Mtu2048);
    assert_eq!(sim.endpoints[0].cma.path_mtu(id).unwrap(), Mtu::Mtu4096);
    let id2 = client(&mut sim, 7011);
    assert_eq!(sim.endpoints[0].cma.path_mtu(id2).unwrap(), Mtu::Mtu2048);
}

#[test]
fn a_req_naming_no_ib_mtu_gets_1024() {
    let mut sim = pair(13, faults(0.0, 0.0, 0.0));
    serve(&mut sim, 7012);
    sim.endpoints[0].cma.set_path_mtu(Mtu::Mtu4096);
    let id = client(&mut sim, 7012);
    sim.endpoints[0].cma.connect(0, id, &param(1, b"")).unwrap();
    // The REQ as the client sent it, its MTU field rewritten to 7 (no IB MTU).
    let (_, mad) = sim.endpoints[0].cma.poll_transmit().expect("the REQ");
    let (h, msg) = CmMsg::parse(&mad).unwrap();
    let CmMsg::Req(mut req) = msg else {
        panic!("{msg:?}")
    };
    assert_eq!(req.path_mtu, Mtu::Mtu4096 as u8);
    req.path_mtu = 7;
    let forged = CmMsg::Req(req).emit(h.tid);
    let s = &mut sim.endpoints[1].cma;
    s.handle_mad(0, Peer::gsi(ip(3)), &forged);
    let ev = s.poll_event().expect("a connection request");
    assert_eq!(ev.event, EventType::ConnectRequest);
    assert_eq!(s.path_mtu(ev.id).unwrap(), Mtu::Mtu1024);
    let (srtr, _) = s.init_qp_attr(ev.id, QpState::Rtr).unwrap();
    assert_eq!(srtr.path_mtu, Mtu::Mtu1024);
}

#[test]
fn reuseaddr_and_afonly_follow_linux_state_rules() {
    let mut sim = pair(10, faults(0.0, 0.0, 0.0));
    let s = &mut sim.endpoints[1].cma;
    let l = s.create_id(1, port_space::TCP, None).unwrap();
    // rdma_set_reuseaddr: either way while idle; after bind only on, until listening.
    s.set_option(l, IdOption::ReuseAddr(false)).unwrap();
    s.set_option(l, IdOption::AfOnly(false)).unwrap();
    s.bind(l, SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 7009))
        .unwrap();
    let e = s.set_option(l, IdOption::ReuseAddr(false)).unwrap_err();
    assert_eq!(e.errno, errno::EINVAL);
    s.set_option(l, IdOption::ReuseAddr(true)).unwrap();
    // rdma_set_afonly: while idle or bound.
    s.set_option(l, IdOption::AfOnly(true)).unwrap();
    s.listen(l, 4).unwrap();
    for o in [IdOption::ReuseAddr(true), IdOption::AfOnly(true)] {
        assert_eq!(
            s.set_option(l, o).unwrap_err().errno,
            errno::EINVAL,
            "{o:?}"
        );
    }
    // A resolved active-side id may still turn REUSEADDR on, not set AFONLY.
    let id = client(&mut sim, 7009);
    let c = &mut sim.endpoints[0].cma;
    c.set_option(id, IdOption::ReuseAddr(true)).unwrap();
    let e = c.set_option(id, IdOption::AfOnly(true)).unwrap_err();
    assert_eq!(e.errno, errno::EINVAL);
}

#[test]
fn backlog_holds_requests_back_until_there_is_room() {
    let mut sim = pair(8, faults(0.0, 0.0, 0.0));
    let s = &mut sim.endpoints[1].cma;
    let l = s.create_id(1, port_space::TCP, None).unwrap();
    s.bind(l, SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 7007))
        .unwrap();
    s.listen(l, 1).unwrap();
    let a = client(&mut sim, 7007);
    let b = client(&mut sim, 7007);
    sim.endpoints[0].cma.connect(0, a, &param(1, b"")).unwrap();
    sim.endpoints[0].cma.connect(0, b, &param(2, b"")).unwrap();
    let first = wait_for(&mut sim, 1, EventType::ConnectRequest);
    // The second waits (its REQ was dropped); accepting the first makes room, and the
    // retransmitted REQ gets in.
    sim.run_until(SEC, |_| false);
    assert!(sim.endpoints[1].take(EventType::ConnectRequest).is_none());
    let now = sim.now;
    sim.endpoints[1]
        .cma
        .accept(now, first.id, &param(10, b""))
        .unwrap();
    let second = wait_for(&mut sim, 1, EventType::ConnectRequest);
    let qpn = |e: &CmaEvent| match &e.param {
        EventParam::Conn(p) => p.qp_num,
        _ => 0,
    };
    let mut both = [qpn(&first), qpn(&second)];
    both.sort();
    assert_eq!(both, [1, 2]);
}

/// Node 0's id in port space `ps` (UD), bound to its own address 127.0.0.3 at `port`.
fn bound_ud(sim: &mut Sim<Node>, ps: u16, port: u16) -> IdHandle {
    let c = &mut sim.endpoints[0].cma;
    let id = c.create_id(5, ps, Some(Service::Ud)).unwrap();
    c.bind(id, SocketAddr::new(ip(3), port)).unwrap();
    id
}

fn group(a: u8, b: u8, c: u8, d: u8) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Ipv4Addr::new(a, b, c, d)), 0)
}

#[test]
fn a_multicast_join_reports_the_groups_address_vector() {
    let mut sim = pair(11, faults(0.0, 0.0, 0.0));
    let id = bound_ud(&mut sim, port_space::UDP, 7201);
    let g = group(239, 1, 2, 3);
    let c = &mut sim.endpoints[0].cma;
    c.join_multicast(id, g, false, 0xC0FFEE).unwrap();
    let ev = sim.endpoints[0]
        .take(EventType::MulticastJoin)
        .expect("MULTICAST_JOIN at once");
    assert_eq!(
        (ev.channel, ev.id, ev.listen_id, ev.status),
        (5, id, None, 0)
    );
    assert_eq!(
        ev.mc,
        Some(McastJoin {
            addr: g,
            context: 0xC0FFEE,
            send_only: false
        })
    );
    let EventParam::Ud(up) = &ev.param else {
        panic!("{ev:?}")
    };
    // As cma_make_mc_event / ib_init_ah_from_mcmember give it for RoCEv2.
    let want = AhAttr {
        grh: GlobalRoute {
            dgid: Gid::from_ipv4(Ipv4Addr::new(239, 1, 2, 3)),
            flow_label: 0,
            sgid_index: 0,
            hop_limit: 64,
            traffic_class: 0,
        },
        dlid: 0,
        sl: 0,
        src_path_bits: 0,
        static_rate: 0,
        is_global: true,
        port_num: 1,
    };
    assert_eq!(up.ah_attr, want);
    assert_eq!(
        up.ah_attr.grh.dgid.0,
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 239, 1, 2, 3],
        "MGID ::ffff:239.1.2.3"
    );
    assert_eq!((up.qp_num, up.qkey), (0xFF_FFFF, UDP_QKEY));
    assert!(up.private_data.is_empty());
    let c = &mut sim.endpoints[0].cma;
    // The Q_Key is the one the id's QP gets.
    let (init, _) = c.init_qp_attr(id, QpState::Init).unwrap();
    assert_eq!(init.qkey, up.qkey);
    assert_eq!(c.multicast_joins(id).unwrap(), &[ev.mc.unwrap()]);

    // A send-only join says so; an IPv6 group is its own MGID.
    let v6 = SocketAddr::new(IpAddr::V6("ff0e::1:2:3".parse().unwrap()), 0);
    c.join_multicast(id, v6, true, 7).unwrap();
    let ev = sim.endpoints[0].take(EventType::MulticastJoin).unwrap();
    assert!(ev.mc.unwrap().send_only);
    let EventParam::Ud(up) = &ev.param else {
        panic!("{ev:?}")
    };
    assert_eq!(up.ah_attr.grh.dgid.to_ip(), v6.ip());
    assert_eq!(sim.endpoints[0].cma.multicast_joins(id).unwrap().len(), 2);
}

#[test]
fn multicast_join_preconditions_are_the_kernels() {
    let mut sim = pair(12, faults(0.0, 0.0, 0.0));
    let g = group(239, 1, 2, 3);
    let einval = |r: softrdma_cm::cma::Result<()>| {
        assert_eq!(r.unwrap_err().errno, errno::EINVAL);
    };
    let c = &mut sim.endpoints[0].cma;
    // Not UD: TCP, or IB with an RC QP.
    let tcp = c.create_id(1, port_space::TCP, None).unwrap();
    c.bind(tcp, SocketAddr::new(ip(3), 7202)).unwrap();
    einval(c.join_multicast(tcp, g, false, 0));
    let ib_rc = c.create_id(1, port_space::IB, Some(Service::Rc)).unwrap();
    c.bind(ib_rc, SocketAddr::new(ip(3), 7203)).unwrap();
    einval(c.join_multicast(ib_rc, g, false, 0));
    // Idle, bound to the wildcard address (no device), no such id.
    let idle = c.create_id(1, port_space::UDP, None).unwrap();
    einval(c.join_multicast(idle, g, false, 0));
    let any = c.create_id(1, port_space::UDP, None).unwrap();
    c.bind(
        any,
        SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 7204),
    )
    .unwrap();
    einval(c.join_multicast(any, g, false, 0));
    einval(c.join_multicast(9999, g, false, 0));
    // The zero address.
    let ud = c.create_id(1, port_space::UDP, None).unwrap();
    c.bind(ud, SocketAddr::new(ip(3), 7205)).unwrap();
    einval(c.join_multicast(ud, group(0, 0, 0, 0), false, 0));
    // Resolved (the wildcard bind now has the device): fine; route resolved: too late.
    c.resolve_addr(any, None, SocketAddr::new(ip(7), 7206))
        .unwrap();
    c.join_multicast(any, g, false, 1).unwrap();
    c.resolve_route(any).unwrap();
    einval(c.join_multicast(any, g, false, 2));
    // IPoIB and IB-with-UD ids join.
    for ps in [port_space::IPOIB, port_space::IB] {
        let id = c.create_id(1, ps, Some(Service::Ud)).unwrap();
        c.bind(id, SocketAddr::new(ip(3), 0)).unwrap();
        c.join_multicast(id, g, false, 3).unwrap();
    }
    let n = &mut sim.endpoints[0];
    n.collect();
    let joins: Vec<&CmaEvent> = n
        .events
        .iter()
        .filter(|e| e.event == EventType::MulticastJoin)
        .collect();
    assert_eq!(joins.len(), 3, "only the accepted joins report: {joins:?}");
    assert!(joins.iter().all(|e| e.status == 0 && e.mc.is_some()));
}

#[test]
fn leave_forgets_the_join_and_its_pending_event() {
    let mut sim = pair(13, faults(0.0, 0.0, 0.0));
    let id = bound_ud(&mut sim, port_space::UDP, 7210);
    let (g1, g2) = (group(239, 1, 2, 3), group(239, 1, 2, 4));
    let c = &mut sim.endpoints[0].cma;
    let e = c.leave_multicast(id, g1).unwrap_err();
    assert_eq!(e.errno, errno::EADDRNOTAVAIL, "not joined");
    c.join_multicast(id, g1, false, 1).unwrap();
    c.join_multicast(id, g2, false, 2).unwrap();
    c.join_multicast(id, g1, false, 3).unwrap();
    // Leaving g1 drops its oldest join, whose event was not taken yet.
    c.leave_multicast(id, g1).unwrap();
    let left: Vec<u64> = c
        .multicast_joins(id)
        .unwrap()
        .iter()
        .map(|m| m.context)
        .collect();
    assert_eq!(left, [2, 3]);
    // The port is part of the address, as librdmacm compares it.
    let e = c
        .leave_multicast(id, SocketAddr::new(g1.ip(), 9))
        .unwrap_err();
    assert_eq!(e.errno, errno::EADDRNOTAVAIL);
    sim.endpoints[0].collect();
    let ctx: Vec<u64> = sim.endpoints[0]
        .events
        .iter()
        .filter_map(|e| e.mc.map(|m| m.context))
        .collect();
    assert_eq!(
        ctx,
        [2, 3],
        "the left join's event is gone, the others stay in order"
    );
    // Destroying the id forgets its joins (and any events).
    let c = &mut sim.endpoints[0].cma;
    c.join_multicast(id, g2, false, 4).unwrap();
    c.destroy_id(0, id).unwrap();
    assert!(c.poll_event().is_none());
    assert_eq!(c.multicast_joins(id).unwrap_err().errno, errno::EINVAL);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("SOFTRDMA_PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(16)
    ))]
    /// The whole rdma_cm exchange — connect, accept, establish, disconnect from either
    /// side — survives loss, duplication and reordering.
    #[test]
    fn rdma_cm_exchange_survives_faults(
        seed in any::<u64>(),
        loss in 0.0f64..0.25,
        dup in 0.0f64..0.25,
        reorder in 0.0f64..0.25,
        server_disconnects in any::<bool>(),
    ) {
        let mut sim = pair(seed, faults(loss, dup, reorder));
        serve(&mut sim, 7100);
        let (id, sid) = establish(&mut sim, 7100);
        let (a, ida, b, idb) = if server_disconnects { (1, sid, 0, id) } else { (0, id, 1, sid) };
        let now = sim.now;
        sim.endpoints[a].cma.disconnect(now, ida).unwrap();
        wait_for(&mut sim, b, EventType::Disconnected);
        let now = sim.now;
        sim.endpoints[b].cma.disconnect(now, idb).unwrap();
        wait_for(&mut sim, a, EventType::Disconnected);
        prop_assert!(sim.run_to_idle(7200 * SEC));
        let mut seen: HashMap<usize, usize> = HashMap::new();
        for (k, n) in sim.endpoints.iter_mut().enumerate() {
            n.collect();
            *seen.entry(k).or_default() += n.events.iter().filter(|e| e.event == EventType::Disconnected).count();
        }
        prop_assert_eq!(seen[&0], 0, "a second DISCONNECTED");
        prop_assert_eq!(seen[&1], 0, "a second DISCONNECTED");
    }
}

/// A UC QP carries no READs or atomics: whatever responder resources a UC connection
/// names, the CM grants its QP remote writes only; an RC QP with responder resources
/// gets READ and atomic access too.
#[test]
fn only_rc_qps_are_granted_read_and_atomic_access() {
    for (service, port) in [(Service::Uc, 7201u16), (Service::Rc, 7202)] {
        let mut sim = pair(21, faults(0.0, 0.0, 0.0));
        let s = &mut sim.endpoints[1].cma;
        let l = s.create_id(1, port_space::IB, Some(service)).unwrap();
        s.bind(l, SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port))
            .unwrap();
        s.listen(l, 8).unwrap();
        let c = &mut sim.endpoints[0].cma;
        let id = c.create_id(1, port_space::IB, Some(service)).unwrap();
        c.resolve_addr(id, None, SocketAddr::new(ip(1), port))
            .unwrap();
        assert!(sim.endpoints[0].take(EventType::AddrResolved).is_some());
        sim.endpoints[0].cma.resolve_route(id).unwrap();
        assert!(sim.endpoints[0].take(EventType::RouteResolved).is_some());
        let mut p = param(0x111, b"");
        p.responder_resources = 4;
        p.initiator_depth = 4;
        let now = sim.now;
        sim.endpoints[0].cma.connect(now, id, &p).unwrap();
        let req = wait_for(&mut sim, 1, EventType::ConnectRequest);
        let mut a = param(0x222, b"");
        a.responder_resources = 4;
        a.initiator_depth = 4;
        let now = sim.now;
        sim.endpoints[1].cma.accept(now, req.id, &a).unwrap();
        wait_for(&mut sim, 0, EventType::ConnectResponse);
        for (node, h) in [(0, id), (1, req.id)] {
            let (init, m) = sim.endpoints[node]
                .cma
                .init_qp_attr(h, QpState::Init)
                .unwrap();
            assert!(m.contains(QpAttrMask::ACCESS_FLAGS));
            let rc = Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
            let want = if service == Service::Rc {
                rc
            } else {
                Access::REMOTE_WRITE
            };
            assert_eq!(init.qp_access_flags, want, "{service:?} node {node}");
        }
    }
}
