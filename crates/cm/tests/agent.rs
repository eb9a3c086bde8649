//! The CM agent on two real devices over loopback, in one process: a server bound to the
//! wildcard address is found at 127.0.0.1 through the host registry whatever 127.0.0.x
//! its device took; the REQ / REP / RTU and DREQ / DREP travel as MADs between the
//! devices' QP1s; events arrive on pollable channels; a second wildcard bind of the port
//! gets EADDRNOTAVAIL as on Linux; a port nobody serves is rejected with reason 8.

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use common::{agent, device, next};
use softrdma_cm::agent::{Agent, EventChannel};
use softrdma_cm::cma::{errno, ConnParam, EventParam, EventType};
use softrdma_device::registry::Registry;
use softrdma_wire::cm::{port_space, rej_reason};

/// Devices of this test share a UDP port of their own, away from other tests' devices.
const DEV_PORT: u16 = 24_791;

fn conn(qpn: u32, data: &[u8]) -> ConnParam {
    ConnParam {
        private_data: data.to_vec(),
        responder_resources: 1,
        initiator_depth: 1,
        retry_count: 7,
        rnr_retry_count: 7,
        qp_num: qpn,
        ..ConnParam::default()
    }
}

#[test]
fn connect_accept_disconnect_between_two_devices() {
    let dir = std::env::temp_dir().join(format!("softrdma-cm-agent-{}", std::process::id()));
    let reg = Registry::open(&dir).unwrap();
    let (da, db) = (device("cma", DEV_PORT), device("cmb", DEV_PORT));
    assert_ne!(da.addr().ip(), db.addr().ip());
    let (a, b) = (agent(&da, &reg, DEV_PORT, 7), agent(&db, &reg, DEV_PORT, 7));
    let (cha, chb) = (EventChannel::new().unwrap(), EventChannel::new().unwrap());
    a.attach(&cha);
    b.attach(&chb);
    let port = 20_000 + (std::process::id() % 10_000) as u16;
    let any = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port);

    // Server: wildcard bind and listen on device B.
    let l = b.call(|c, _| {
        let l = c.create_id(chb.id(), port_space::TCP, None)?;
        c.bind(l, any)?;
        c.listen(l, 4)?;
        Ok::<_, softrdma_cm::cma::CmaError>(l)
    });
    let l = l.unwrap();
    // A second server on the port: refused, as on Linux.
    let e = a.call(|c, _| {
        let x = c.create_id(cha.id(), port_space::TCP, None).unwrap();
        c.bind(x, any)
    });
    // Linux's cma_check_port: a wildcard on either side is EADDRNOTAVAIL.
    assert_eq!(e.map_err(|e| e.errno), Err(errno::EADDRNOTAVAIL));

    // Client on device A dials 127.0.0.1.
    let id = a.call(|c, _| {
        let id = c.create_id(cha.id(), port_space::TCP, None).unwrap();
        c.resolve_addr(
            id,
            None,
            SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port),
        )
        .unwrap();
        id
    });
    next(&cha, EventType::AddrResolved);
    a.call(|c, _| c.resolve_route(id)).unwrap();
    next(&cha, EventType::RouteResolved);
    a.call(|c, now| c.connect(now, id, &conn(0x1234, b"ping")))
        .unwrap();

    let req = next(&chb, EventType::ConnectRequest);
    assert_eq!(req.listen_id, Some(l));
    let EventParam::Conn(p) = &req.param else {
        panic!("{req:?}")
    };
    assert_eq!(&p.private_data[..4], b"ping");
    assert_eq!(p.qp_num, 0x1234);
    // librdmacm moves the QP to RTS before rdma_accept: its send PSN is known already.
    let (srv_rts, _) = b
        .call(|c, _| c.init_qp_attr(req.id, softrdma_verbs::QpState::Rts))
        .unwrap();
    b.call(|c, now| c.accept(now, req.id, &conn(0x5678, b"pong")))
        .unwrap();

    let resp = next(&cha, EventType::ConnectResponse);
    let EventParam::Conn(p) = &resp.param else {
        panic!("{resp:?}")
    };
    assert_eq!(&p.private_data[..4], b"pong");
    assert_eq!(p.qp_num, 0x5678);
    // The client's QP would go to the server's device.
    let (rtr, _) = a
        .call(|c, _| c.init_qp_attr(id, softrdma_verbs::QpState::Rtr))
        .unwrap();
    assert_eq!(rtr.ah_attr.grh.dgid.to_ip(), db.addr().ip());
    // Both QPs get the MTU of the link the devices are on (loopback: 4096 unless its MTU
    // was lowered), as Linux's rdma_cm gives a RoCE route its netdev's.
    let want = softrdma_device::netdev::roce_mtu_at(da.addr().ip())
        .unwrap_or(softrdma_verbs::Mtu::Mtu1024);
    assert_eq!(rtr.path_mtu, want);
    let (srv_rtr, _) = b
        .call(|c, _| c.init_qp_attr(req.id, softrdma_verbs::QpState::Rtr))
        .unwrap();
    assert_eq!(srv_rtr.path_mtu, want);
    // …and it is the PSN the REP announced.
    assert_eq!(rtr.rq_psn, srv_rts.sq_psn);
    a.call(|c, now| c.accept(now, id, &ConnParam::default()))
        .unwrap();
    next(&chb, EventType::Established);

    // Disconnect from the client: both sides hear it.
    a.call(|c, now| c.disconnect(now, id)).unwrap();
    next(&chb, EventType::Disconnected);
    b.call(|c, now| c.disconnect(now, req.id)).unwrap();
    next(&cha, EventType::Disconnected);

    // A port nobody listens on: rejected with "invalid service ID".
    let id2 = a.call(|c, _| {
        let id = c.create_id(cha.id(), port_space::TCP, None).unwrap();
        c.resolve_addr(id, None, SocketAddr::new(db.addr().ip(), port + 1))
            .unwrap();
        c.resolve_route(id).unwrap();
        id
    });
    next(&cha, EventType::AddrResolved);
    next(&cha, EventType::RouteResolved);
    a.call(|c, now| c.connect(now, id2, &conn(1, b""))).unwrap();
    let rej = next(&cha, EventType::Rejected);
    assert_eq!(rej.status, i32::from(rej_reason::INVALID_SERVICE_ID));
    drop((a, b));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A device's agent going away leaves the device's MADs to the agent that is still there:
/// [`Agent::for_device`] starts a device's next agent as soon as the last reference to the
/// one before is gone, while that one's drop still runs, and a drop that then turned off
/// the device's MAD delivery left every connection of the new agent without its CM
/// (all connects in a process timed out). Two agents of one device are the state that
/// race leaves: the first one dropped, the second still connects.
#[test]
fn a_dropped_agent_leaves_the_mads_to_the_devices_next() {
    let (da, db) = (device("cmnext-a", DEV_PORT), device("cmnext-b", DEV_PORT));
    let dir = std::env::temp_dir().join(format!("softrdma-cm-next-{}", std::process::id()));
    let reg = Registry::open(&dir).unwrap();
    let server = Agent::for_device(&db).expect("server agent");
    let old = agent(&da, &reg, DEV_PORT, 7);
    let client = Agent::for_device(&da).expect("client agent");
    drop(old);

    let (chc, chs) = (EventChannel::new().unwrap(), EventChannel::new().unwrap());
    client.attach(&chc);
    server.attach(&chs);
    let any = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0);
    let (l, port) = server
        .call(|c, _| {
            let l = c.create_id(chs.id(), port_space::TCP, None)?;
            c.bind(l, any)?;
            c.listen(l, 4)?;
            let port = c.addrs(l)?.0.map_or(0, |a| a.port());
            Ok::<_, softrdma_cm::cma::CmaError>((l, port))
        })
        .unwrap();
    let dst = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port);
    let id = client
        .call(|c, _| {
            let id = c.create_id(chc.id(), port_space::TCP, None)?;
            c.resolve_addr(id, None, dst).map(|()| id)
        })
        .unwrap();
    next(&chc, EventType::AddrResolved);
    client.call(|c, _| c.resolve_route(id)).unwrap();
    next(&chc, EventType::RouteResolved);
    client
        .call(|c, now| c.connect(now, id, &conn(0x1234, b"ping")))
        .unwrap();
    let req = next(&chs, EventType::ConnectRequest);
    assert_eq!(req.listen_id, Some(l));
    server
        .call(|c, now| c.accept(now, req.id, &conn(0x5678, b"pong")))
        .unwrap();
    // The REP comes to the client's device: its agent has it.
    next(&chc, EventType::ConnectResponse);
}
