//! The Rust face of the rdma_cm on two real devices over loopback, in one process: a
//! listener on the wildcard address found at 127.0.0.1, private data both ways, SEND and
//! RDMA WRITE checked in target memory, disconnects from either side flushing posted
//! receives, rejects with private data, a port nobody serves, port conflicts, UD by SIDR.
//!
//! The CM's port registry is a directory of this test run (`SOFTRDMA_CM_DIR`), and the
//! devices use a UDP port of their own, so other tests and programs on the host stay out.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::sync::Once;
use std::time::Duration;

use softrdma::cm::{
    self, AcceptOptions, CmId, ConnectOptions, EventChannel, EventType, Listener, PortSpace,
    MAX_ACCEPT_PRIVATE, MAX_CONNECT_PRIVATE, MAX_REJECT_PRIVATE,
};
use softrdma::*;

/// Devices of this test share a UDP port of their own.
const DEV_PORT: u16 = 25_791;
/// Upper bound of every wait (the CM answers on loopback in milliseconds).
const T: Duration = Duration::from_secs(20);
const BUF: usize = 4096;
/// Receive slots at the start of each side's buffer, 256 bytes each.
const RECVS: usize = 4;
const SLOT: usize = 256;
/// Where the peer's RDMA WRITE lands.
const WRITE_AT: usize = 2048;

static SETUP: Once = Once::new();

fn setup() {
    SETUP.call_once(|| {
        let dir = std::env::temp_dir().join(format!("softrdma-cm-rust-{}", std::process::id()));
        // Set once, first thing in every test and before any device or CM of ours reads
        // the environment.
        std::env::set_var("SOFTRDMA_CM_DIR", &dir);
    });
}

fn device(name: &str) -> Device {
    setup();
    let mut cfg = DeviceConfig::new(name, DeviceAddr::AutoLoopback(DEV_PORT));
    cfg.stats_dir = None;
    cfg.pcap = None;
    Device::open_with(&cfg).expect("open device")
}

fn any(port: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port)
}

fn localhost(port: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port)
}

/// One side's objects: a PD, a CQ, a buffer with receive slots and a WRITE target.
struct Side {
    dev: Device,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    mr: MemoryRegion,
}

impl Side {
    fn new(name: &str) -> Side {
        let dev = device(name);
        let pd = dev.alloc_pd().unwrap();
        let cq = dev.create_cq(128, None).unwrap();
        let mr = pd
            .register(
                BUF,
                Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
            )
            .unwrap();
        Side { dev, pd, cq, mr }
    }
    fn init(&self) -> QpInit<'_> {
        QpInit::new(QpType::Rc, &self.cq)
    }
    /// Post the receive slots (wr_id = slot index).
    fn post_recvs(&self, qp: &QueuePair) -> Result<()> {
        for i in 0..RECVS {
            qp.post_recv(wr::recv(
                i as u64,
                [self.mr.sge(i * SLOT..(i + 1) * SLOT).unwrap()],
            ))?;
        }
        Ok(())
    }
    /// Our memory as the peer addresses it, after a 4-byte tag: private data.
    fn private(&self, tag: &[u8; 4]) -> Vec<u8> {
        let mut v = tag.to_vec();
        v.extend_from_slice(&self.mr.remote().to_bytes());
        v
    }
}

fn remote_of(private: &[u8]) -> RemoteMemory {
    let mut b = [0u8; 20];
    b.copy_from_slice(&private[4..24]);
    RemoteMemory::from_bytes(&b)
}

fn wait_ok(cq: &CompletionQueue, op: WcOpcode) -> WorkCompletion {
    let wc = cq.wait(T).expect("completion");
    assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
    assert_eq!(wc.opcode, op, "{wc:?}");
    wc
}

/// A connected pair: (server side, server connection, client side, client connection).
fn connected(tag: &str) -> (Side, cm::Connection, Side, cm::Connection) {
    let (srv, cli) = (Side::new(&format!("{tag}s")), Side::new(&format!("{tag}c")));
    assert_ne!(srv.dev.addr().ip(), cli.dev.addr().ip());
    let l = Listener::bind(&srv.dev, any(0)).unwrap();
    let port = l.local_addr().port();
    assert_ne!(port, 0, "port 0 picks a port");
    let (sc, c) = std::thread::scope(|s| {
        let server = s.spawn(|| {
            let req = l.next_request(Some(T)).expect("request");
            assert_eq!(req.private_data().len(), MAX_CONNECT_PRIVATE);
            assert_eq!(&req.private_data()[..4], b"ping");
            let p = req.conn_param().expect("RC request").clone();
            assert_ne!(p.qp_num, 0);
            assert_eq!(req.local_addr().map(|a| a.port()), Some(port));
            let opts = AcceptOptions {
                timeout: Some(T),
                ..AcceptOptions::new(&srv.private(b"pong"))
            };
            req.accept_with(&srv.pd, &srv.init(), &opts, |qp| srv.post_recvs(qp))
                .expect("accept")
        });
        let opts = ConnectOptions {
            timeout: Some(T),
            ..ConnectOptions::new(&cli.private(b"ping"))
        };
        // The server's device took another 127.0.0.x: the registry finds it.
        let c = cm::connect_with(&cli.pd, &cli.init(), localhost(port), &opts, |qp| {
            cli.post_recvs(qp)
        })
        .expect("connect");
        let sc = server.join().expect("server thread");
        assert_eq!(c.private_data().len(), MAX_ACCEPT_PRIVATE);
        assert_eq!(&c.private_data()[..4], b"pong");
        assert_eq!(c.qp().state().unwrap(), QpState::Rts);
        assert_eq!(sc.qp().state().unwrap(), QpState::Rts);
        assert_eq!(c.peer_addr().map(|a| a.port()), Some(port));
        assert_eq!(sc.peer_addr(), c.local_addr());
        (sc, c)
    });
    drop(l);
    (srv, sc, cli, c)
}

/// `from` WRITEs a pattern into `to`'s memory (named in `to`'s private data), then SENDs
/// a message; `to` finds both in its memory.
fn write_then_send(from: &Side, fc: &cm::Connection, to: &Side, tc: &cm::Connection, seed: u8) {
    let pattern: Vec<u8> = (0..512u32)
        .map(|i| (i as u8).wrapping_mul(7) ^ seed)
        .collect();
    let msg: Vec<u8> = format!("message {seed}").into_bytes();
    from.mr.write(WRITE_AT, &pattern).unwrap();
    from.mr.write(WRITE_AT + 1024, &msg).unwrap();
    let target = remote_of(fc.private_data());
    assert_eq!(target.rkey, to.mr.rkey());
    let mut w = wr::write(
        10,
        [from.mr.sge(WRITE_AT..WRITE_AT + pattern.len()).unwrap()],
        &target,
        WRITE_AT as u64,
    )
    .unwrap();
    w.flags |= SendFlags::SIGNALED;
    fc.qp().post_send(w).unwrap();
    wait_ok(&from.cq, WcOpcode::RdmaWrite);
    let mut w = wr::send(
        11,
        [from
            .mr
            .sge(WRITE_AT + 1024..WRITE_AT + 1024 + msg.len())
            .unwrap()],
    );
    w.flags |= SendFlags::SIGNALED;
    fc.qp().post_send(w).unwrap();
    wait_ok(&from.cq, WcOpcode::Send);
    let wc = wait_ok(&to.cq, WcOpcode::Recv);
    assert_eq!(wc.byte_len as usize, msg.len());
    assert_eq!(wc.qp_num, tc.qp().qpn());
    let slot = wc.wr_id as usize * SLOT;
    assert_eq!(to.mr.to_vec(slot, msg.len()).unwrap(), msg);
    assert_eq!(to.mr.to_vec(WRITE_AT, pattern.len()).unwrap(), pattern);
}

#[test]
fn connect_accept_private_data_send_and_write() {
    let (srv, sc, cli, c) = connected("cm1");
    // The private data carried each side's memory: one-sided and two-sided both ways.
    write_then_send(&cli, &c, &srv, &sc, 0x11);
    write_then_send(&srv, &sc, &cli, &c, 0x22);
}

#[test]
fn a_loopback_route_has_loopbacks_mtu_and_a_write_spans_it() {
    let (srv, sc, cli, c) = connected("cm1m");
    // The MTU Linux's rdma_cm gives a RoCE route over lo (65536 bytes: 4096).
    let want = softrdma_device::netdev::roce_mtu_at(cli.dev.addr().ip()).unwrap_or(Mtu::Mtu1024);
    assert_eq!(c.qp().query().unwrap().path_mtu, want);
    assert_eq!(sc.qp().query().unwrap().path_mtu, want);
    // A WRITE of the whole buffer: one packet or several, it lands whole.
    let pattern: Vec<u8> = (0..BUF as u32).map(|i| (i % 251) as u8 ^ 0x5a).collect();
    cli.mr.write(0, &pattern).unwrap();
    let target = remote_of(c.private_data());
    let mut w = wr::write(20, [cli.mr.sge(0..BUF).unwrap()], &target, 0).unwrap();
    w.flags |= SendFlags::SIGNALED;
    c.qp().post_send(w).unwrap();
    wait_ok(&cli.cq, WcOpcode::RdmaWrite);
    assert_eq!(srv.mr.to_vec(0, BUF).unwrap(), pattern);
}

fn flushed(side: &Side, n: usize) {
    let wcs = side.cq.wait_n(n, T).expect("flush completions");
    for wc in &wcs {
        assert_eq!(wc.status, WcStatus::WrFlushErr, "{wc:?}");
    }
    assert!(side.cq.poll_one().unwrap().is_none(), "no more completions");
}

fn disconnect_from(server_first: bool) {
    let tag = if server_first { "cm2" } else { "cm3" };
    let (srv, sc, cli, c) = connected(tag);
    let ((first, fc), (second, scn)) = if server_first {
        ((&srv, &sc), (&cli, &c))
    } else {
        ((&cli, &c), (&srv, &sc))
    };
    fc.disconnect().unwrap();
    assert_eq!(fc.qp().state().unwrap(), QpState::Err);
    // The other side hears it and closes too (QP to ERR, DREP)…
    scn.wait_disconnected(Some(T))
        .expect("peer sees DISCONNECTED");
    assert!(scn.is_disconnected());
    assert_eq!(scn.qp().state().unwrap(), QpState::Err);
    // …and the DREP ends it for the first side.
    fc.wait_disconnected(Some(T))
        .expect("initiator sees DISCONNECTED");
    // The receives nobody used come back flushed, on both sides.
    flushed(first, RECVS);
    flushed(second, RECVS);
    // Once over, again is nothing.
    fc.disconnect().unwrap();
    scn.wait_disconnected(Some(Duration::ZERO)).unwrap();
}

#[test]
fn disconnect_from_client() {
    disconnect_from(false);
}

#[test]
fn disconnect_from_server() {
    disconnect_from(true);
}

#[test]
fn reject_with_private_data() {
    let (srv, cli) = (Side::new("cm4s"), Side::new("cm4c"));
    let l = Listener::bind(&srv.dev, any(0)).unwrap();
    let port = l.local_addr().port();
    std::thread::scope(|s| {
        let server = s.spawn(|| {
            let req = l.next_request(Some(T)).expect("request");
            assert_eq!(&req.private_data()[..5], b"knock");
            req.reject(b"go away").expect("reject");
        });
        let opts = ConnectOptions {
            timeout: Some(T),
            ..ConnectOptions::new(b"knock")
        };
        let e = cm::connect(&cli.pd, &cli.init(), localhost(port), &opts).unwrap_err();
        server.join().unwrap();
        assert_eq!(e.errno(), libc::ECONNREFUSED, "{e}");
        let r = e
            .rejection()
            .unwrap_or_else(|| panic!("no rejection in {e}"));
        assert_eq!(r.reason, 28, "consumer reject: {e}");
        assert_eq!(r.private_data.len(), MAX_REJECT_PRIVATE);
        assert_eq!(&r.private_data[..7], b"go away");
        assert!(r.private_data[7..].iter().all(|&b| b == 0));
        assert!(e.to_string().contains("reason 28"), "{e}");
    });
}

#[test]
fn nobody_listening_is_rejected_with_reason_8() {
    let (srv, cli) = (Side::new("cm5s"), Side::new("cm5c"));
    // A port that was free a moment ago and is free again.
    let port = {
        let l = Listener::bind(&srv.dev, any(0)).unwrap();
        l.local_addr().port()
    };
    let opts = ConnectOptions {
        timeout: Some(T),
        ..ConnectOptions::new(b"anyone?")
    };
    // At a loopback address no device holds (this host's CM answers at once) and at
    // the server's device (its CM answers). Not 127.0.0.1: a device of another test may
    // hold it without running a CM, and then nobody answers.
    for ip in [
        IpAddr::V4(Ipv4Addr::new(127, 0, 0, 254)),
        srv.dev.addr().ip(),
    ] {
        let addr = SocketAddr::new(ip, port);
        let e = cm::connect(&cli.pd, &cli.init(), addr, &opts).unwrap_err();
        let r = e
            .rejection()
            .unwrap_or_else(|| panic!("{addr}: no rejection in {e}"));
        assert_eq!(r.reason, 8, "{addr}: {e}");
        assert!(e.to_string().contains("nothing listens"), "{e}");
    }
}

/// A device on which nothing runs a CM (a process that uses verbs but not rdma_cm) is
/// still a host whose CM answers: the client is refused at once with reason 8, as by a
/// Linux host where nothing listens, instead of retrying its REQ for a minute.
#[test]
fn device_without_cm_refuses_at_once() {
    let cli = Side::new("cm9c");
    let bare = device("cm9b");
    let opts = ConnectOptions {
        timeout: Some(T),
        ..ConnectOptions::default()
    };
    let addr = SocketAddr::new(bare.addr().ip(), 4242);
    let e = cm::connect(&cli.pd, &cli.init(), addr, &opts).unwrap_err();
    let r = e
        .rejection()
        .unwrap_or_else(|| panic!("no rejection in {e}"));
    assert_eq!(r.reason, 8, "{e}");
    assert!(
        bare.stats().engine.gsi_unserved >= 1,
        "the bare device answered"
    );
}

/// A peer that never answers (a UDP socket holding a loopback address's RoCE port, the
/// devices' port here): the
/// client's CM retries the REQ as its timeouts say and then reports UNREACHABLE, an
/// ETIMEDOUT error; the socket saw every REQ.
#[test]
fn silent_peer_is_unreachable() {
    let cli = Side::new("cm9s");
    // 127.0.0.254 is left to nobody_listening_is_rejected_with_reason_8.
    let silent = (250..=253)
        .find_map(|i| UdpSocket::bind((Ipv4Addr::new(127, 0, 0, i), DEV_PORT)).ok())
        .expect("a free 127.0.0.25x RoCE port");
    cm::set_timeouts(
        &cli.dev,
        cm::Timeouts {
            cm_response: 8,
            max_retries: 2,
            packet_life_time: 8,
        },
    )
    .unwrap();
    let opts = ConnectOptions {
        timeout: Some(T),
        ..ConnectOptions::default()
    };
    let addr = SocketAddr::new(silent.local_addr().unwrap().ip(), 4242);
    let e = cm::connect(&cli.pd, &cli.init(), addr, &opts).unwrap_err();
    assert_eq!(e.errno(), libc::ETIMEDOUT, "{e}");
    assert!(e.rejection().is_none(), "{e}");
    assert!(
        e.message().contains("UNREACHABLE"),
        "the CM's verdict, not ours: {e}"
    );
    silent.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 512];
    let mut reqs = 0;
    while let Ok(n) = silent.recv(&mut buf) {
        // BTH (12) + DETH (8), then the MAD: attribute ID 0x0010 is a REQ.
        if n >= 20 + 24 && buf[20 + 16..20 + 18] == [0x00, 0x10] {
            reqs += 1;
        }
    }
    assert_eq!(reqs, 3, "the first REQ and its two retries");
}

/// A specific address of this host that is not loopback (Linux counts loopback
/// addresses as wildcards when ports conflict), if the host has one.
fn host_address() -> Option<IpAddr> {
    let s = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).ok()?;
    s.connect((Ipv4Addr::new(192, 0, 2, 1), 9)).ok()?;
    let ip = s.local_addr().ok()?.ip();
    (!ip.is_loopback() && !ip.is_unspecified()).then_some(ip)
}

#[test]
fn two_listeners_on_one_port() {
    let (a, b) = (device("cm6a"), device("cm6b"));
    let l = Listener::bind(&a, any(0)).unwrap();
    let port = l.local_addr().port();
    // Either address a wildcard: EADDRNOTAVAIL, from this process's other device too.
    for d in [&a, &b] {
        let e = Listener::bind(d, any(port)).unwrap_err();
        assert_eq!(e.errno(), libc::EADDRNOTAVAIL, "{e}");
        let e = Listener::bind(d, localhost(port)).unwrap_err();
        assert_eq!(e.errno(), libc::EADDRNOTAVAIL, "{e}");
    }
    drop(l);
    // Released with the listener.
    let l = Listener::bind(&b, any(port)).expect("port free again");
    drop(l);
    // The same specific address twice: EADDRINUSE.
    match host_address() {
        Some(ip) => {
            let at = SocketAddr::new(ip, port);
            let _l = Listener::bind(&a, at).unwrap();
            let e = Listener::bind(&b, at).unwrap_err();
            assert_eq!(e.errno(), libc::EADDRINUSE, "{e}");
        }
        None => eprintln!("no non-loopback address on this host: EADDRINUSE case skipped"),
    }
}

/// The low-level id and events: UD through SIDR, with the server's QPN, Q_Key and
/// address vector arriving on ESTABLISHED, and a datagram each way.
#[test]
fn ud_by_sidr_with_event_channel() {
    let (srv, cli) = (Side::new("cm7s"), Side::new("cm7c"));
    let l = Listener::bind_with(&srv.dev, any(0), PortSpace::Udp, 0).unwrap();
    let port = l.local_addr().port();
    let grh = 40;
    std::thread::scope(|s| {
        let server = s.spawn(|| {
            let req = l.next_request(Some(T)).expect("UD request");
            assert_eq!(&req.private_data()[..3], b"udp");
            assert!(req.conn_param().is_none());
            let init = QpInit::new(QpType::Ud, &srv.cq);
            let conn = req
                .accept_with(&srv.pd, &init, &AcceptOptions::new(b"sidr ok"), |qp| {
                    srv.post_recvs(qp)
                })
                .expect("accept UD");
            let ud = conn.ud_param().expect("UD peer").clone();
            assert_eq!(ud.ah_attr.grh.dgid, cli.dev.gid());
            // The client's datagram tells its QPN; answer it.
            let wc = wait_ok(&srv.cq, WcOpcode::Recv);
            let slot = wc.wr_id as usize * SLOT;
            assert_eq!(srv.mr.to_vec(slot + grh, 5).unwrap(), b"hello");
            let ah = srv.pd.create_ah(&ud.ah_attr).unwrap();
            srv.mr.write(WRITE_AT, b"world").unwrap();
            let mut w = wr::ud_send(
                2,
                [srv.mr.sge(WRITE_AT..WRITE_AT + 5).unwrap()],
                ah.dest(wc.src_qp, cm::UDP_QKEY),
            );
            w.flags |= SendFlags::SIGNALED;
            conn.qp().post_send(w).unwrap();
            wait_ok(&srv.cq, WcOpcode::Send);
            assert!(conn.disconnect().is_err(), "UD has no connection");
        });
        // By hand: channel, id, resolve, route, QP, connect, ESTABLISHED.
        let ch = EventChannel::new(&cli.dev).unwrap();
        let id = CmId::new(&ch, PortSpace::Udp).unwrap();
        id.resolve_addr(None, localhost(port)).unwrap();
        assert_eq!(
            ch.next_event(Some(T)).unwrap().kind(),
            EventType::AddrResolved
        );
        id.resolve_route().unwrap();
        assert_eq!(
            ch.next_event(Some(T)).unwrap().kind(),
            EventType::RouteResolved
        );
        let qp = id
            .create_qp(&cli.pd, &QpInit::new(QpType::Ud, &cli.cq))
            .unwrap();
        assert_eq!(qp.state().unwrap(), QpState::Rts, "UD QPs need no peer");
        cli.post_recvs(&qp).unwrap();
        id.connect(&cm::ConnParam {
            private_data: b"udp".to_vec(),
            qp_num: qp.qpn(),
            ..Default::default()
        })
        .unwrap();
        let ev = ch.next_event(Some(T)).unwrap();
        assert_eq!(ev.kind(), EventType::Established, "{ev:?}");
        assert_eq!(ev.id(), id.handle());
        let ud = ev.ud_param().expect("UD parameters").clone();
        assert_eq!(ud.qkey, cm::UDP_QKEY);
        assert_eq!(&ev.private_data()[..7], b"sidr ok");
        let ah = cli.pd.create_ah(&ud.ah_attr).unwrap();
        cli.mr.write(WRITE_AT, b"hello").unwrap();
        let mut w = wr::ud_send(
            1,
            [cli.mr.sge(WRITE_AT..WRITE_AT + 5).unwrap()],
            ah.dest(ud.qp_num, ud.qkey),
        );
        w.flags |= SendFlags::SIGNALED;
        qp.post_send(w).unwrap();
        wait_ok(&cli.cq, WcOpcode::Send);
        let wc = wait_ok(&cli.cq, WcOpcode::Recv);
        assert_eq!(wc.src_qp, ud.qp_num);
        let slot = wc.wr_id as usize * SLOT;
        assert_eq!(cli.mr.to_vec(slot + grh, 5).unwrap(), b"world");
        server.join().unwrap();
    });
}

/// The listener's fd is readable exactly while a request waits, for poll loops.
#[test]
fn listener_fd_is_pollable() {
    use std::os::fd::AsFd;
    let (srv, cli) = (Side::new("cm8s"), Side::new("cm8c"));
    let l = Listener::bind(&srv.dev, any(0)).unwrap();
    let port = l.local_addr().port();
    let readable = |ms: u64| {
        softrdma_device::poll_readable(&[l.as_fd()], Some(Duration::from_millis(ms)))
            .is_ok_and(|r| r[0])
    };
    assert!(!readable(0), "nothing waits yet");
    std::thread::scope(|s| {
        let client = s.spawn(|| {
            let opts = ConnectOptions {
                timeout: Some(T),
                ..ConnectOptions::default()
            };
            cm::connect(&cli.pd, &cli.init(), localhost(port), &opts)
        });
        assert!(readable(T.as_millis() as u64), "a request waits");
        let conn = l
            .next_request(Some(Duration::ZERO))
            .expect("request ready")
            .accept(&srv.pd, &srv.init(), &AcceptOptions::default())
            .expect("accept");
        assert!(!readable(0), "taken");
        let c = client.join().unwrap().expect("connect");
        drop(c);
        // Dropping the client's connection disconnects it.
        conn.wait_disconnected(Some(T))
            .expect("DISCONNECTED after drop");
    });
}

/// The CM objects may move to and be shared with other threads (a server thread per
/// connection, a poll loop beside the data path).
#[test]
fn cm_objects_are_send_and_sync() {
    fn both<T: Send + Sync>() {}
    both::<EventChannel>();
    both::<CmId>();
    both::<cm::Event>();
    both::<Listener>();
    both::<cm::ConnectRequest>();
    both::<cm::Connection>();
}
