//! What a peer, or anyone who can send a MAD, can make the CM do: crafted MADs straight
//! into the protocol engine ([`IbCm`]) and the rdma_cm model ([`Cma`]).
//!
//! - A flood of REQs that do not parse, match no listener or lie about their source
//!   leaves no state behind, and a genuine client connects in the middle of it.
//! - Half-open connections (REQ taken, no RTU yet) are capped per device; REQs past the
//!   cap are dropped without state.
//! - Rejected, timed-out and refused connections leave the tables.
//! - A peer's CM response timeout, retry count and MRA service timeout are capped, so one
//!   REQ holds a server's accept for a bounded time.
//! - Only a connection's peer can end it: a REQ reusing its CA GUID and QPN, a REJ or a
//!   DREQ from another address changes nothing and is answered as one that matches no
//!   connection is.
//! - The source address in the rdma_cm header must be the packet's.

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use softrdma_cm::cma::{Cma, CmaEvent, ConnParam, EventType, IdHandle};
use softrdma_cm::ib::{self, CommId, EventKind, IbCm, Peer, State};
use softrdma_wire::cm::{
    msg_response, port_space, rej_reason, service_id, CmMsg, CmaHeader, Dreq, Ids, Mra, Rej,
};
use softrdma_wire::SplitMix64;

use common::{ip, OneHost};
use softrdma_testkit::cm::{cma_req, rep};

const SEC: u64 = 1_000_000_000;
const SID: u64 = 0x0106_0000_0000_1b58;

fn gsi(x: u8) -> Peer {
    Peer::gsi(ip(x))
}

fn parse(mad: &[u8]) -> CmMsg {
    CmMsg::parse(mad).unwrap().1
}

/// Everything `cm` has to send, parsed, with where it goes.
fn sent(cm: &mut IbCm) -> Vec<(Peer, CmMsg)> {
    std::iter::from_fn(|| cm.poll_transmit())
        .map(|(to, m)| (to, parse(&m)))
        .collect()
}

fn events(cm: &mut IbCm) -> Vec<EventKind> {
    std::iter::from_fn(|| cm.poll_event())
        .map(|e| e.kind)
        .collect()
}

/// Active `a` (127.0.0.3, CA GUID 0xA, QP 0x111) and passive `b` (127.0.0.7), listening on
/// `SID`, established.
fn established() -> (IbCm, CommId, IbCm, CommId) {
    let mut a = IbCm::new(0xA, 15, 1);
    let mut b = IbCm::new(0xB, 15, 2);
    b.listen(SID).unwrap();
    let ca = a.send_req(0, gsi(7), cma_req(SID, 0x111, 1, ip(3), ip(7)), 14);
    let (_, m) = a.poll_transmit().unwrap();
    b.handle_mad(1_000, gsi(3), &m);
    let Some(ib::Event {
        id: cb,
        kind: EventKind::ReqReceived { .. },
    }) = b.poll_event()
    else {
        panic!("no REQ event")
    };
    b.send_rep(2_000, cb, rep(0x222, 7)).unwrap();
    let (_, m) = b.poll_transmit().unwrap();
    a.handle_mad(3_000, gsi(7), &m);
    assert!(matches!(events(&mut a)[..], [EventKind::RepReceived(_)]));
    a.send_rtu(4_000, ca, &[]).unwrap();
    let (_, m) = a.poll_transmit().unwrap();
    b.handle_mad(5_000, gsi(3), &m);
    assert!(matches!(events(&mut b)[..], [EventKind::RtuReceived(_)]));
    (a, ca, b, cb)
}

/// A REQ that reuses `a`'s CA GUID and QPN (a stale-connection REQ if it comes from `a`)
/// for `service`.
fn stale_req(service: u64, qpn: u32) -> [u8; 256] {
    let mut r = cma_req(service, qpn, 1, ip(3), ip(7));
    r.local_comm_id = 0x5EED;
    r.local_ca_guid = 0xA;
    CmMsg::Req(Box::new(r)).emit(0x77)
}

/// The REJ reason of the one REJ in `out`, and whether a DREQ went too.
fn rej_and_dreq(out: &[(Peer, CmMsg)]) -> (Option<u16>, bool) {
    let rej = out.iter().find_map(|(_, m)| match m {
        CmMsg::Rej(r) => Some(r.reason),
        _ => None,
    });
    let dreq = out.iter().any(|(_, m)| matches!(m, CmMsg::Dreq(_)));
    (rej, dreq)
}

#[test]
fn a_stale_connection_req_from_another_address_is_answered_as_a_miss_and_changes_nothing() {
    let (_a, _ca, mut b, cb) = established();
    // A service nobody listens on: a REQ that matches no connection gets REJ 8.
    let other = service_id(port_space::TCP, 9);
    for x in [66, 99] {
        // The live connection's CA GUID and QPN, from another address...
        b.handle_mad(6_000, gsi(x), &stale_req(other, 0x111));
        let hit = sent(&mut b);
        // ...and a guess that misses.
        b.handle_mad(6_000, gsi(x), &stale_req(other, 0x112));
        let miss = sent(&mut b);
        assert_eq!(
            rej_and_dreq(&hit),
            (Some(rej_reason::INVALID_SERVICE_ID), false)
        );
        // Byte for byte the answer a miss gets.
        assert_eq!(hit, miss);
        assert_eq!(hit.len(), 1);
        assert_eq!(hit[0].0, gsi(x), "the answer goes to the sender");
        assert_eq!(b.state(cb), Some(State::Established));
        assert!(events(&mut b).is_empty());
    }
    // The peer itself keeps Linux's answer: REJ "stale connection" and a DREQ on the old
    // connection.
    b.handle_mad(7_000, gsi(3), &stale_req(other, 0x111));
    let out = sent(&mut b);
    assert_eq!(rej_and_dreq(&out), (Some(rej_reason::STALE_CONN), true));
    assert_eq!(b.state(cb), Some(State::DreqSent));
}

#[test]
fn a_reject_or_disconnect_request_from_another_address_changes_nothing() {
    let (mut a, ca, mut b, cb) = established();
    // REJ and DREQ naming both comm IDs (what an observer of the handshake knows).
    let rej = CmMsg::Rej(Box::new(Rej::new(
        cb,
        ca,
        msg_response::OTHER,
        rej_reason::CONSUMER_REJECT,
        &[],
        &[],
    )))
    .emit(1);
    let dreq = |local: CommId, remote: CommId, qpn: u32| {
        CmMsg::Dreq(Box::new(Dreq {
            ids: Ids {
                local_comm_id: local,
                remote_comm_id: remote,
                private_data: [0; 220],
            },
            remote_qpn: qpn,
        }))
        .emit(2)
    };
    a.handle_mad(10_000, gsi(66), &rej);
    a.handle_mad(10_000, gsi(66), &dreq(cb, ca, 0x111));
    assert_eq!(a.state(ca), Some(State::Established));
    assert!(events(&mut a).is_empty());
    // The forged DREQ got what a DREQ for no connection gets: a DREP to its sender.
    let out = sent(&mut a);
    assert_eq!(out.len(), 1, "{out:?}");
    assert_eq!(out[0].0, gsi(66));
    assert!(matches!(out[0].1, CmMsg::Drep(_)));
    a.handle_mad(11_000, gsi(66), &dreq(cb ^ 1, ca, 0x111));
    let miss = sent(&mut a);
    assert_eq!(miss.len(), 1);
    assert!(matches!(miss[0].1, CmMsg::Drep(_)));
    // Nor can a forged MRA or DREP from elsewhere touch the other side's connection.
    let mra = CmMsg::Mra(Box::new(Mra {
        ids: Ids {
            local_comm_id: ca,
            remote_comm_id: cb,
            private_data: [0; 222],
        },
        message_mraed: msg_response::OTHER,
        service_timeout: 31,
    }))
    .emit(3);
    b.handle_mad(12_000, gsi(66), &mra);
    b.handle_mad(12_000, gsi(66), &dreq(ca, cb, 0x222));
    assert_eq!(b.state(cb), Some(State::Established));
    // From the peer, the same DREQ is a disconnect.
    a.handle_mad(13_000, gsi(7), &dreq(cb, ca, 0x111));
    assert_eq!(a.state(ca), Some(State::DreqRcvd));
    // And the peer's REJ ends the other one.
    let rej = CmMsg::Rej(Box::new(Rej::new(
        ca,
        cb,
        msg_response::OTHER,
        rej_reason::CONSUMER_REJECT,
        &[],
        &[],
    )))
    .emit(4);
    b.handle_mad(14_000, gsi(3), &rej);
    assert_eq!(b.state(cb), Some(State::Timewait));
}

/// Run `cm`'s timers until `done` says so or an hour of its time passed; returns the time.
fn run_timers(cm: &mut IbCm, mut done: impl FnMut(&mut IbCm) -> bool) -> u64 {
    let mut now = 0;
    while let Some(t) = cm.poll_timeout() {
        if t > 3600 * SEC {
            break;
        }
        now = t;
        cm.handle_timeout(now);
        while cm.poll_transmit().is_some() {}
        if done(cm) {
            return now;
        }
    }
    panic!("still waiting after {now} ns");
}

#[test]
fn the_peers_response_timeout_and_retries_are_capped() {
    // The longest a REQ may ask: 4.096 µs × 2^31 per try, 15 retries (37 hours).
    let mut b = IbCm::new(0xB, 15, 2);
    b.listen(SID).unwrap();
    let mut r = cma_req(SID, 0x111, 1, ip(3), ip(7));
    r.local_cm_response_timeout = 31;
    r.remote_cm_response_timeout = 31;
    r.max_cm_retries = 15;
    r.primary.local_ack_timeout = 31;
    r.local_comm_id = 1;
    b.handle_mad(0, gsi(3), &CmMsg::Req(Box::new(r)).emit(1));
    let id = b.poll_event().unwrap().id;
    b.send_rep(0, id, rep(0x222, 7)).unwrap();
    while b.poll_transmit().is_some() {}
    let mut tries = 1;
    let gave_up = run_timers(&mut b, |cm| {
        tries += 1;
        events(cm).contains(&EventKind::RepError)
    });
    // Linux rdma_cm's own values are the cap: 2^(20-8) ms per try, 16 tries.
    assert_eq!(gave_up, 16 * 4096 * 1_000_000);
    assert_eq!(tries, 17);

    // An MRA for the REP stretches each wait by at most rdma_cm's own MRA service time
    // (2^24 × 4.096 µs) plus the path's ACK timeout, whatever it asks.
    let mut b = IbCm::new(0xB, 15, 2);
    b.listen(SID).unwrap();
    let mut r = cma_req(SID, 0x111, 1, ip(3), ip(7));
    r.local_cm_response_timeout = 31;
    r.primary.local_ack_timeout = 31;
    r.local_comm_id = 1;
    b.handle_mad(0, gsi(3), &CmMsg::Req(Box::new(r)).emit(1));
    let id = b.poll_event().unwrap().id;
    b.send_rep(0, id, rep(0x222, 7)).unwrap();
    while b.poll_transmit().is_some() {}
    let mra = CmMsg::Mra(Box::new(Mra {
        ids: Ids {
            local_comm_id: 1,
            remote_comm_id: id,
            private_data: [0; 222],
        },
        message_mraed: msg_response::REP,
        service_timeout: 31,
    }));
    b.handle_mad(0, gsi(3), &mra.emit(1));
    assert_eq!(b.state(id), Some(State::MraRepRcvd));
    let next = b.poll_timeout().unwrap();
    assert!(next <= (65_536 + 4096) * 1_000_000, "{next}");
    let gave_up = run_timers(&mut b, |cm| events(cm).contains(&EventKind::RepError));
    assert!(gave_up <= 16 * (65_536 + 4096) * 1_000_000, "{gave_up}");
    assert_eq!(b.len(), 1, "the consumer still holds the connection");

    // Timewait after the peer's DREQ lasts at most the capped ACK timeout.
    let (_a, ca, mut b, cb) = established();
    let dreq = CmMsg::Dreq(Box::new(Dreq {
        ids: Ids {
            local_comm_id: ca,
            remote_comm_id: cb,
            private_data: [0; 220],
        },
        remote_qpn: 0x222,
    }));
    b.handle_mad(0, gsi(3), &dreq.emit(9));
    b.send_drep(0, cb, &[]).unwrap();
    assert_eq!(b.state(cb), Some(State::Timewait));
    assert!(b.poll_timeout().unwrap() <= 4096 * 1_000_000);
}

#[test]
fn half_open_connections_are_capped_per_device() {
    // REQs for a listened service that nobody answers (a consumer that never accepts, a
    // peer that never sends the RTU): the table stops growing at the cap.
    let mut b = IbCm::new(0xB, 15, 2);
    b.listen(SID).unwrap();
    let mut r = SplitMix64::new(5);
    let flood = 100_000;
    for k in 0..flood {
        let mut q = cma_req(SID, r.next_u64() as u32 & 0xFF_FFFF, 1, ip(66), ip(7));
        q.local_comm_id = r.next_u64() as u32;
        q.local_ca_guid = r.next_u64();
        let from = Peer::gsi(IpAddr::V4(Ipv4Addr::from(r.next_u64() as u32)));
        b.handle_mad(k, from, &CmMsg::Req(Box::new(q)).emit(r.next_u64()));
        // A consumer that accepts every other one: REP sent, the RTU never comes.
        while let Some(e) = b.poll_event() {
            if k % 2 == 0 {
                let _ = b.send_rep(k, e.id, rep(0x300, 7));
            }
        }
        while b.poll_transmit().is_some() {}
        assert!(
            b.len() <= ib::MAX_HALF_OPEN,
            "{} connections after {k}",
            b.len()
        );
    }
    assert!(b.stats().refused > 0);
}

const PORT: u16 = 7471;

/// A server's CM at 127.0.0.7 with a listener on the wildcard address at `PORT`
/// (backlog 8), and a client's at 127.0.0.3 on the same host.
fn server_and_client() -> (Cma, IdHandle, Cma) {
    let host = OneHost::default();
    let mut s = Cma::new(SocketAddr::new(ip(7), 4791), 0xB, 7, Box::new(host.clone()));
    let l = s.create_id(1, port_space::TCP, None).unwrap();
    s.bind(l, SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), PORT))
        .unwrap();
    s.listen(l, 8).unwrap();
    let c = Cma::new(SocketAddr::new(ip(3), 4791), 0xA, 3, Box::new(host));
    (s, l, c)
}

/// Move what each CM sends to the other (MADs for anyone else are dropped) until both
/// are quiet; returns the events each had.
fn pump(now: u64, a: &mut Cma, b: &mut Cma) -> (Vec<CmaEvent>, Vec<CmaEvent>) {
    let (ai, bi) = (a.device_addr().ip(), b.device_addr().ip());
    let (mut ae, mut be) = (Vec::new(), Vec::new());
    loop {
        let mut moved = false;
        while let Some((to, m)) = a.poll_transmit() {
            if to.ip == bi {
                b.handle_mad(now, Peer::gsi(ai), &m);
                moved = true;
            }
        }
        while let Some((to, m)) = b.poll_transmit() {
            if to.ip == ai {
                a.handle_mad(now, Peer::gsi(bi), &m);
                moved = true;
            }
        }
        ae.extend(std::iter::from_fn(|| a.poll_event()));
        be.extend(std::iter::from_fn(|| b.poll_event()));
        if !moved {
            return (ae, be);
        }
    }
}

fn conn_param(qpn: u32) -> ConnParam {
    ConnParam {
        responder_resources: 1,
        initiator_depth: 1,
        retry_count: 7,
        rnr_retry_count: 7,
        qp_num: qpn,
        ..ConnParam::default()
    }
}

/// A client id of `c` connecting to 127.0.0.7:`PORT`.
fn connect(now: u64, c: &mut Cma, qpn: u32) -> IdHandle {
    let id = c.create_id(1, port_space::TCP, None).unwrap();
    c.resolve_addr(id, None, SocketAddr::new(ip(7), PORT))
        .unwrap();
    c.resolve_route(id).unwrap();
    while c.poll_event().is_some() {}
    c.connect(now, id, &conn_param(qpn)).unwrap();
    id
}

/// One REQ of a flood: the rdma_cm header does not parse, names an address nobody listens
/// at, or lies about its source; or the service is not listened on.
fn junk_req(r: &mut SplitMix64, k: u64) -> ([u8; 256], Peer) {
    let from_ip = IpAddr::V4(Ipv4Addr::from(
        0x0A00_0000 | (r.next_u64() as u32 & 0xFF_FFFF),
    ));
    let mut q = cma_req(
        service_id(port_space::TCP, PORT),
        r.next_u64() as u32 & 0xFF_FFFF,
        1,
        from_ip,
        ip(7),
    );
    q.local_comm_id = r.next_u64() as u32;
    q.local_ca_guid = r.next_u64();
    match k % 4 {
        0 => q.private_data[0] = 1, // CMA version 1: does not parse
        1 => {
            // Its source is not where it came from.
            CmaHeader {
                src_port: 22,
                src: IpAddr::V4(Ipv4Addr::new(10, 1, 2, 3)),
                dst: ip(7),
            }
            .emit(&mut q.private_data)
            .unwrap()
        }
        2 => q.service_id = service_id(port_space::TCP, PORT + 1),
        _ => q.service_id = service_id(0x0999, PORT),
    }
    (
        CmMsg::Req(Box::new(q)).emit(r.next_u64()),
        Peer::gsi(from_ip),
    )
}

#[test]
fn a_flood_of_refused_reqs_leaves_nothing_and_a_client_connects_in_it() {
    let (mut s, _l, mut c) = server_and_client();
    let mut r = SplitMix64::new(11);
    let flood: u64 = std::env::var("SOFTRDMA_CM_FLOOD")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let mut rejects = 0u64;
    let mut client = None;
    for k in 0..flood {
        let (mad, from) = junk_req(&mut r, k);
        s.handle_mad(k, from, &mad);
        while let Some((to, m)) = s.poll_transmit() {
            assert_eq!(to, from, "answers go to the sender only");
            assert!(matches!(parse(&m), CmMsg::Rej(_)));
            rejects += 1;
        }
        assert!(s.poll_event().is_none(), "no request reaches the program");
        // Nothing is kept for a refused REQ, and so nothing waits on a timer.
        assert_eq!(s.ib().len(), 0, "after {k} REQs");
        assert_eq!(s.poll_timeout(), None);
        if k == flood / 2 {
            client = Some(connect(k, &mut c, 0x111));
            let (_, se) = pump(k, &mut c, &mut s);
            let req = se
                .iter()
                .find(|e| e.event == EventType::ConnectRequest)
                .expect("the genuine REQ gets through");
            s.accept(k, req.id, &conn_param(0x222)).unwrap();
            let (ce, _) = pump(k, &mut c, &mut s);
            assert!(ce.iter().any(|e| e.event == EventType::ConnectResponse));
            c.accept(k, client.unwrap(), &ConnParam::default()).unwrap();
            let (_, se) = pump(k, &mut c, &mut s);
            assert!(se.iter().any(|e| e.event == EventType::Established));
            // The established connection is the only one left.
            assert_eq!(s.ib().len(), 1);
            s.destroy_id(k, req.id).unwrap();
            pump(k, &mut c, &mut s);
        }
    }
    assert_eq!(rejects, flood);
    assert!(client.is_some());
}

#[test]
fn the_source_in_the_rdma_cm_header_must_be_the_packets() {
    let (mut s, _l, _c) = server_and_client();
    // A REQ from 127.0.0.99 whose header says it is 10.1.2.3:22.
    let mut q = cma_req(
        service_id(port_space::TCP, PORT),
        0x111,
        1,
        IpAddr::V4(Ipv4Addr::new(10, 1, 2, 3)),
        ip(7),
    );
    q.private_data[2..4].copy_from_slice(&22u16.to_be_bytes());
    q.local_comm_id = 5;
    s.handle_mad(0, gsi(99), &CmMsg::Req(Box::new(q.clone())).emit(1));
    assert!(
        s.poll_event().is_none(),
        "no request with a made-up peer address"
    );
    let (to, m) = s.poll_transmit().unwrap();
    assert_eq!(to, gsi(99));
    let CmMsg::Rej(rej) = parse(&m) else { panic!() };
    assert_eq!(rej.reason, rej_reason::CONSUMER_REJECT);
    assert_eq!(s.ib().len(), 0);
    // The same REQ telling the truth (as rxe's does: its source IP is the packet's).
    CmaHeader {
        src_port: 22,
        src: ip(99),
        dst: ip(7),
    }
    .emit(&mut q.private_data)
    .unwrap();
    q.local_comm_id = 6;
    s.handle_mad(0, gsi(99), &CmMsg::Req(Box::new(q)).emit(2));
    let e = s.poll_event().unwrap();
    assert_eq!(e.event, EventType::ConnectRequest);
    assert_eq!(s.addrs(e.id).unwrap().1, Some(SocketAddr::new(ip(99), 22)));
}

#[test]
fn rejected_and_timed_out_connections_leave_the_tables() {
    // The server rejects: neither side keeps the connection.
    let (mut s, _l, mut c) = server_and_client();
    let id = connect(0, &mut c, 0x111);
    let (_, se) = pump(0, &mut c, &mut s);
    let req = se
        .iter()
        .find(|e| e.event == EventType::ConnectRequest)
        .unwrap();
    s.reject(0, req.id, b"no").unwrap();
    let (ce, _) = pump(0, &mut c, &mut s);
    assert!(ce.iter().any(|e| e.event == EventType::Rejected));
    assert_eq!(s.ib().len(), 0);
    assert_eq!(c.ib().len(), 0);
    c.destroy_id(0, id).unwrap();
    s.destroy_id(0, req.id).unwrap();

    // The server accepts and the client never answers the REP: when the REP's retries
    // run out the server keeps only the program's id (UNREACHABLE), not the connection.
    let _id = connect(0, &mut c, 0x111);
    let (_, se) = pump(0, &mut c, &mut s);
    let req = se
        .iter()
        .find(|e| e.event == EventType::ConnectRequest)
        .unwrap();
    s.accept(0, req.id, &conn_param(0x222)).unwrap();
    while s.poll_transmit().is_some() {}
    let mut unreachable = false;
    let mut tries = 0;
    while let Some(t) = s.poll_timeout() {
        tries += 1;
        assert!(tries < 1000, "timers never end");
        s.handle_timeout(t);
        while s.poll_transmit().is_some() {}
        unreachable |= std::iter::from_fn(|| s.poll_event())
            .any(|e| e.id == req.id && e.event == EventType::Unreachable);
    }
    assert!(unreachable);
    assert_eq!(s.ib().len(), 0);

    // The client's REQ to a server that never answers: UNREACHABLE, nothing kept.
    let (_s2, _l2, mut c2) = server_and_client();
    let id = connect(0, &mut c2, 0x333);
    while c2.poll_transmit().is_some() {}
    let mut unreachable = false;
    while let Some(t) = c2.poll_timeout() {
        c2.handle_timeout(t);
        while c2.poll_transmit().is_some() {}
        unreachable |= std::iter::from_fn(|| c2.poll_event())
            .any(|e| e.id == id && e.event == EventType::Unreachable);
    }
    assert!(unreachable);
    assert_eq!(c2.ib().len(), 0);
}
