//! Connection setup in one call: the `Endpoint` type (serde, byte and pingpong forms, bad
//! input refused with an error and no panic), `tcp::connect`/`accept` between two devices
//! of one process over loopback in both wire formats with the bytes checked in memory,
//! the connection manager offering memory in private data, and devices opened twice
//! having distinct names.

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::sync::Once;
use std::time::Duration;

use softrdma::cm::{self, AcceptOptions, ConnectOptions, Listener};
use softrdma::*;

/// Devices of this test use a UDP port of their own, so other tests stay out.
const DEV_PORT: u16 = 25_795;
const T: Duration = Duration::from_secs(20);
const ALL: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_READ)
    .union(Access::REMOTE_ATOMIC);

static SETUP: Once = Once::new();

fn device(name: &str) -> Device {
    SETUP.call_once(|| {
        // The CM's port registry of this run only (set before any CM object exists).
        let dir = std::env::temp_dir().join(format!("softrdma-connect-{}", std::process::id()));
        std::env::set_var("SOFTRDMA_CM_DIR", &dir);
    });
    let mut cfg = DeviceConfig::new(name, DeviceAddr::AutoLoopback(DEV_PORT));
    cfg.stats_dir = None;
    cfg.pcap = None;
    Device::open_with(&cfg).expect("open device")
}

fn sample() -> Endpoint {
    Endpoint::new(
        Gid::from_ipv4(Ipv4Addr::new(127, 0, 0, 7)),
        0xab_cdef,
        0x12_3456,
    )
}

fn memory() -> RemoteMemory {
    RemoteMemory {
        addr: 0x7f00_1234_5000,
        rkey: 0xdead_be01,
        len: 1 << 20,
    }
}

#[cfg(feature = "serde")]
#[test]
fn endpoint_serde_round_trip() {
    for ep in [
        sample(),
        sample().with_memory(memory()).with_mtu(Mtu::Mtu4096),
    ] {
        let json = serde_json::to_string(&ep).unwrap();
        let back: Endpoint = serde_json::from_str(&json).unwrap();
        assert_eq!(back, ep, "{json}");
    }
    // The JSON reads as what it means: the GID as an address, the MTU in bytes.
    let v = serde_json::to_value(sample().with_memory(memory())).unwrap();
    assert_eq!(v["gid"], "::ffff:127.0.0.7");
    assert_eq!(v["mtu"], 1024);
    assert_eq!(v["qpn"], 0xab_cdef);
    assert_eq!(v["memory"]["rkey"], 0xdead_be01u32);
    assert!(serde_json::to_value(sample())
        .unwrap()
        .get("memory")
        .is_none());
    // Out-of-range values are refused with a message, not accepted or panicking.
    let bad_mtu = r#"{"gid":"::1","qpn":1,"psn":2,"mtu":1000}"#;
    let e = serde_json::from_str::<Endpoint>(bad_mtu).unwrap_err();
    assert!(e.to_string().contains("MTU 1000"), "{e}");
    let wide = r#"{"gid":"::1","qpn":16777216,"psn":2,"mtu":1024}"#;
    assert!(serde_json::from_str::<Endpoint>(wide).is_err());
    let m: RemoteMemory = serde_json::from_str(&serde_json::to_string(&memory()).unwrap()).unwrap();
    assert_eq!(m, memory());
}

#[test]
fn endpoint_byte_form_round_trip_and_bad_input() {
    for ep in [
        sample(),
        sample().with_memory(memory()).with_mtu(Mtu::Mtu2048),
    ] {
        let b = ep.to_bytes();
        assert_eq!(&b[..4], b"SRep");
        assert_eq!(b[4], ENDPOINT_VERSION);
        assert_eq!(b.len(), if ep.memory.is_some() { 52 } else { 32 });
        assert_eq!(Endpoint::from_bytes(&b).unwrap(), ep);
        let mut r = std::io::Cursor::new([b.clone(), b"after".to_vec()].concat());
        assert_eq!(Endpoint::read_from(&mut r).unwrap(), ep);
        assert_eq!(r.position() as usize, b.len(), "nothing after it is read");

        // Every truncation and a trailing byte: an error, no panic.
        for n in 0..b.len() {
            let e = Endpoint::from_bytes(&b[..n]).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Protocol, "{n}: {e}");
        }
        let e = Endpoint::from_bytes(&[b.clone(), vec![0]].concat()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
        // Every byte flipped: either an endpoint or an error, never a panic.
        for i in 0..b.len() {
            for x in [0x01, 0x80, 0xff] {
                let mut c = b.clone();
                c[i] ^= x;
                let _ = Endpoint::from_bytes(&c);
                let _ = Endpoint::read_from(&mut std::io::Cursor::new(c));
            }
        }
    }
    let b = sample().to_bytes();
    // Another version says both versions.
    let mut v2 = b.clone();
    v2[4] = 2;
    let e = Endpoint::from_bytes(&v2).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotSupported);
    assert!(e.to_string().contains("version 2"), "{e}");
    assert!(
        e.to_string()
            .contains(&format!("reads version {ENDPOINT_VERSION}")),
        "{e}"
    );
    // Not ours at all.
    let e = Endpoint::from_bytes(b"GET / HTTP/1.1\r\n\r\n").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Protocol);
    assert!(e.to_string().contains("not a softrdma endpoint"), "{e}");
    // A bad MTU code, unknown flags.
    let mut m = b.clone();
    m[7] = 9;
    assert!(Endpoint::from_bytes(&m)
        .unwrap_err()
        .to_string()
        .contains("MTU"));
    let mut f = b.clone();
    f[6] = 0x80;
    assert!(Endpoint::from_bytes(&f)
        .unwrap_err()
        .to_string()
        .contains("flags"));
    // A stream that ends early.
    let e = Endpoint::read_from(&mut std::io::Cursor::new(&b[..10])).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Io, "{e}");
}

#[test]
fn pingpong_text_form() {
    let ep = sample();
    let s = ep.to_pingpong_string();
    assert_eq!(s, "0000:abcdef:123456:00000000000000000000ffff7f000007");
    let msg = ep.to_pingpong_msg();
    assert_eq!(msg.len(), PINGPONG_MSG_LEN);
    assert_eq!(msg[51], 0);
    assert_eq!(Endpoint::parse_pingpong(&msg).unwrap(), ep);
    assert_eq!(Endpoint::parse_pingpong(s.as_bytes()).unwrap(), ep);
    for bad in [
        &b""[..],
        b"0000:abcdef:123456",
        b"0000:abcdef:123456:00ff",
        b"zz00:abcdef:123456:00000000000000000000ffff7f000007",
        b"0000:1abcdef:123456:00000000000000000000ffff7f000007",
        b"0000:abcdef:123456:0000000000000000000\xc3\xa9ffff7f000007",
    ] {
        let e = Endpoint::parse_pingpong(bad).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Protocol, "{bad:?}");
    }
}

/// One side of a TCP test: device, PD, CQ, a 4 KiB region and an RC QP.
struct Side {
    _dev: Device,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    mr: MemoryRegion,
    qp: QueuePair,
}

fn side(name: &str) -> Side {
    let dev = device(name);
    let pd = dev.alloc_pd().unwrap();
    let cq = dev.create_cq(32, None).unwrap();
    let mr = pd.register(4096, ALL).unwrap();
    let qp = pd
        .create_qp(&QpInit::new(QpType::Rc, &cq).depth(8, 8))
        .unwrap();
    Side {
        _dev: dev,
        pd,
        cq,
        mr,
        qp,
    }
}

fn init(s: &Side) -> QpInit<'_> {
    QpInit::new(QpType::Rc, &s.cq).depth(8, 8)
}

fn wait_ok(cq: &CompletionQueue) -> WorkCompletion {
    let wc = cq.wait(T).expect("completion");
    assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
    wc
}

#[test]
fn endpoint_psn_is_the_one_the_qp_sends_from() {
    let (a, b) = (side("psna"), side("psnb"));
    let ea = a.qp.endpoint();
    assert_eq!(ea, a.qp.endpoint(), "chosen once");
    assert_eq!(ea.qpn, a.qp.qpn());
    assert!(ea.psn <= 0xff_ffff);
    a.qp.connect_to(&b.qp.endpoint(), ALL).unwrap();
    b.qp.connect_to(&ea, ALL).unwrap();
    assert_eq!(a.qp.query().unwrap().sq_psn, ea.psn);
    assert_eq!(b.qp.query().unwrap().rq_psn, ea.psn);
    // A reset chooses anew (2^-24 odds of the same PSN), for the next connection.
    a.qp.reset().unwrap();
    assert_ne!(a.qp.endpoint().psn, ea.psn);
    // The peer's MTU bounds the path: 4096 offered, 1024 taken by default.
    b.qp.reset().unwrap();
    let big = PathOptions {
        mtu: Mtu::Mtu4096,
        ..PathOptions::default()
    };
    a.qp.connect_to_with(&b.qp.endpoint(), ALL, &big).unwrap();
    assert_eq!(a.qp.query().unwrap().path_mtu, Mtu::Mtu1024);
}

/// `from` WRITEs a pattern into the memory `to` offered and SENDs a message; `to` finds
/// both in its memory.
fn write_then_send(from: &Side, peer: &Endpoint, to: &Side, seed: u8) {
    let target = peer.memory.expect("the peer offered memory");
    assert_eq!(target, to.mr.remote());
    let pattern: Vec<u8> = (0..512u32)
        .map(|i| (i as u8).wrapping_mul(13) ^ seed)
        .collect();
    from.mr.write(1024, &pattern).unwrap();
    let w = wr::write(1, [from.mr.sge(1024..1536).unwrap()], &target, 2048).unwrap();
    from.qp.post_send(w).unwrap();
    wait_ok(&from.cq);
    let msg = format!("hello {seed}");
    from.mr.write(0, msg.as_bytes()).unwrap();
    from.qp
        .post_send(wr::send(2, [from.mr.sge(0..msg.len()).unwrap()]))
        .unwrap();
    wait_ok(&from.cq);
    let wc = wait_ok(&to.cq);
    assert_eq!(wc.opcode, WcOpcode::Recv);
    assert_eq!(
        to.mr.to_vec(256, wc.byte_len as usize).unwrap(),
        msg.as_bytes()
    );
    assert_eq!(to.mr.to_vec(2048, 512).unwrap(), pattern);
}

fn post_recv(s: &Side) -> impl Fn(&QueuePair) -> Result<()> + '_ {
    move |qp| qp.post_recv(wr::recv(9, [s.mr.sge(256..512)?]))
}

#[test]
fn tcp_one_call_connect_moves_data() {
    let (srv, cli) = (side("tcps"), side("tcpc"));
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let port = l.local_addr().unwrap().port();
    let (mut sl, mut cl) = std::thread::scope(|s| {
        let server = s.spawn(|| {
            let opts = tcp::Options::new(ALL).with_memory(srv.mr.remote());
            tcp::accept_with(&l, &srv.qp, &opts, post_recv(&srv)).expect("accept")
        });
        let opts = tcp::Options::new(ALL).with_memory(cli.mr.remote());
        let cl = tcp::connect_with(("127.0.0.1", port), &cli.qp, &opts, post_recv(&cli))
            .expect("connect");
        (server.join().expect("server thread"), cl)
    });
    assert_eq!(cl.peer.qpn, srv.qp.qpn());
    assert_eq!(sl.peer.qpn, cli.qp.qpn());
    assert_eq!(cl.peer, srv.qp.endpoint().with_memory(srv.mr.remote()));
    assert_eq!(sl.peer.gid, cli.pd.device().gid());
    assert_eq!(cli.qp.state().unwrap(), QpState::Rts);
    assert_eq!(srv.qp.state().unwrap(), QpState::Rts);
    write_then_send(&cli, &cl.peer, &srv, 1);
    write_then_send(&srv, &sl.peer, &cli, 2);
    // The stream stays the program's: a barrier both ways.
    std::thread::scope(|s| {
        s.spawn(|| sl.barrier().unwrap());
        cl.barrier().unwrap();
    });
}

#[test]
fn tcp_pingpong_format_connects() {
    let (srv, cli) = (side("pps"), side("ppc"));
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let addr = l.local_addr().unwrap();
    let opts = tcp::Options::new(ALL).with_format(tcp::Format::Pingpong);
    let (sl, cl) = std::thread::scope(|s| {
        let server =
            s.spawn(|| tcp::accept_with(&l, &srv.qp, &opts, post_recv(&srv)).expect("accept"));
        let cl = tcp::connect_with(addr, &cli.qp, &opts, post_recv(&cli)).expect("connect");
        (server.join().expect("server thread"), cl)
    });
    assert_eq!(cl.peer.qpn, srv.qp.qpn());
    assert_eq!(cl.peer.psn, srv.qp.endpoint().psn);
    assert_eq!(sl.peer.qpn, cli.qp.qpn());
    // No memory travels in this format; the test hands it over itself.
    assert!(cl.peer.memory.is_none());
    write_then_send(&cli, &cl.peer.with_memory(srv.mr.remote()), &srv, 3);
    write_then_send(&srv, &sl.peer.with_memory(cli.mr.remote()), &cli, 4);
    // Offering memory in a format that cannot carry it is refused before any I/O.
    let q = cli
        .pd
        .create_qp(&QpInit::new(QpType::Rc, &cli.cq).depth(1, 1))
        .unwrap();
    let e = tcp::connect(addr, &q, &opts.clone().with_memory(cli.mr.remote())).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert_eq!(q.state().unwrap(), QpState::Reset);
}

#[test]
fn tcp_connect_to_nobody_times_out_with_an_error() {
    let s = side("nobody");
    // A port that was free a moment ago.
    let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let opts = tcp::Options {
        timeout: Some(Duration::from_millis(200)),
        ..tcp::Options::new(ALL)
    };
    let e = tcp::connect(("127.0.0.1", port), &s.qp, &opts).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Rejected, "{e}");
    assert_eq!(s.qp.state().unwrap(), QpState::Reset);
}

#[test]
fn cm_offers_memory_in_private_data() {
    let (srv, cli) = (side("cms"), side("cmc"));
    let l = Listener::bind(
        srv.pd.device(),
        SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)),
    )
    .unwrap();
    let port = l.local_addr().port();
    let (sc, cc) = std::thread::scope(|s| {
        let server = s.spawn(|| {
            let req = l.next_request(Some(T)).expect("request");
            assert_eq!(req.peer_memory(), Some(cli.mr.remote()));
            let opts = AcceptOptions {
                timeout: Some(T),
                ..AcceptOptions::default()
            }
            .with_memory(srv.mr.remote());
            req.accept_with(&srv.pd, &init(&srv), &opts, post_recv(&srv))
                .expect("accept")
        });
        let opts = ConnectOptions {
            timeout: Some(T),
            ..ConnectOptions::default()
        }
        .with_memory(cli.mr.remote());
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let cc =
            cm::connect_with(&cli.pd, &init(&cli), addr, &opts, post_recv(&cli)).expect("connect");
        (server.join().expect("server thread"), cc)
    });
    let peer = cc.peer_endpoint().unwrap();
    assert_eq!(peer.qpn, sc.qp().qpn());
    assert_eq!(peer.gid, srv.pd.device().gid());
    assert_eq!(peer.memory, Some(srv.mr.remote()));
    assert_eq!(sc.peer_memory(), Some(cli.mr.remote()));
    assert_eq!(sc.peer_endpoint().unwrap().qpn, cc.qp().qpn());
    // The connections' QPs move the data (the sides' own QPs are unused here).
    let (sv, cv) = (
        Side {
            qp: sc.into_parts().0,
            ..srv
        },
        Side {
            qp: cc.into_parts().0,
            ..cli
        },
    );
    write_then_send(&cv, &peer, &sv, 5);
}

#[test]
fn a_device_opened_twice_is_one_device() {
    let (a, b) = (side("twice"), side("twice"));
    let (da, db) = (a.pd.device(), b.pd.device());
    assert_eq!((da.name(), db.name()), ("twice", "twice"));
    assert_eq!(da.addr(), db.addr(), "one NIC, one address");
    // QPs of the two opens reach each other as QPs of one NIC do.
    let ea = a.qp.endpoint().with_memory(a.mr.remote());
    let eb = b.qp.endpoint().with_memory(b.mr.remote());
    a.qp.connect_to(&eb, ALL).unwrap();
    b.qp.connect_to(&ea, ALL).unwrap();
    post_recv(&b)(&b.qp).unwrap();
    write_then_send(&a, &eb, &b, 3);
    // Another name is another NIC.
    assert_ne!(device("twice-other").addr(), da.addr());
}

#[test]
fn the_default_device_opened_twice_is_one_device() {
    let a = Device::open_default().unwrap();
    let b = Device::open_default().unwrap();
    assert_eq!(a.name(), b.name());
    assert_eq!(a.addr(), b.addr());
}
