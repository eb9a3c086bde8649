//! rsockets over real devices on loopback UDP: a listener and a connecting socket on two
//! devices of this process, the CM's REQ/REP/RTU carrying the connection data, bytes
//! checked at the far end.

use std::sync::Arc;
use std::time::Duration;

use softrdma_device::{Device, DeviceConfig};
use softrdma_rsocket::{Config, Listener, Phase, Shutdown, Socket};

fn device() -> Arc<Device> {
    let list = softrdma_device::devices().expect("device list");
    let e = list.first().expect("a default device");
    Arc::new(Device::open(&DeviceConfig::from_entry(e)).expect("open"))
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

const T: Option<Duration> = Some(Duration::from_secs(20));

fn pair() -> (Socket, Socket, Listener) {
    pair_with(Config::RSOCKETS)
}

fn pair_with(cfg: Config) -> (Socket, Socket, Listener) {
    let (a, b) = (device(), device());
    let l = Listener::bind(&a, "0.0.0.0:0".parse().unwrap(), 0, cfg).expect("bind");
    let port = l.local_addr().expect("bound").port();
    let dst = format!("127.0.0.1:{port}").parse().unwrap();
    let t = std::thread::spawn(move || Socket::connect(&b, dst, cfg, T));
    let server = l.accept(T).expect("accept");
    let client = t.join().unwrap().expect("connect");
    (client, server, l)
}

#[test]
fn a_stream_both_ways_over_the_cm() {
    let (client, server, _l) = pair();
    assert_eq!(client.phase(), Phase::Connected);
    let up = pattern(1, 1 << 20);
    let down = pattern(2, 300_001);
    let (c, s) = (Arc::new(client), Arc::new(server));
    let (c2, s2) = (Arc::clone(&c), Arc::clone(&s));
    let up2 = up.clone();
    let w = std::thread::spawn(move || c2.send(&up2, false));
    let down2 = down.clone();
    let w2 = std::thread::spawn(move || s2.send(&down2, false));
    let read_all = |sock: &Socket, n: usize| {
        let mut got = Vec::new();
        let mut buf = vec![0u8; 10_000];
        while got.len() < n {
            let k = sock.recv(&mut buf, false, false).expect("recv");
            assert!(k > 0, "end of stream after {} of {n}", got.len());
            got.extend_from_slice(&buf[..k]);
        }
        got
    };
    assert_eq!(read_all(&s, up.len()), up);
    assert_eq!(read_all(&c, down.len()), down);
    assert_eq!(w.join().unwrap().expect("send"), up.len());
    assert_eq!(w2.join().unwrap().expect("send"), down.len());
}

#[test]
fn shutdown_ends_the_peers_stream_and_a_dropped_socket_its_connection() {
    let (client, server, _l) = pair();
    assert_eq!(client.send(b"last words", false).unwrap(), 10);
    client.shutdown(Shutdown::Write).unwrap();
    let mut buf = [0u8; 64];
    let mut got = Vec::new();
    loop {
        let n = server.recv(&mut buf, false, false).unwrap();
        if n == 0 {
            break;
        }
        got.extend_from_slice(&buf[..n]);
    }
    assert_eq!(got, b"last words");
    // The other way is still open.
    assert_eq!(server.send(b"reply", false).unwrap(), 5);
    let n = client.recv(&mut buf, false, false).unwrap();
    assert_eq!(&buf[..n], b"reply");
    assert!(matches!(
        client.send(b"x", false).map_err(|e| e.raw_os_error()),
        Err(Some(libc::ECONNRESET))
    ));
    drop(server);
    // The peer's close reaches the client: its reads end.
    assert_eq!(client.recv(&mut buf, false, false).unwrap(), 0);
    assert_ne!(client.phase(), Phase::Connected);
}

#[test]
fn nonblocking_calls_say_eagain_and_nobody_listening_is_refused() {
    let (client, server, _l) = pair();
    let mut buf = [0u8; 8];
    let e = server.recv(&mut buf, false, true).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EAGAIN));
    // A port nobody listens on.
    let dev = device();
    let l = Listener::bind(&dev, "0.0.0.0:0".parse().unwrap(), 0, Config::RSOCKETS).unwrap();
    let port = l.local_addr().unwrap().port();
    drop(l);
    let dst = format!("127.0.0.1:{port}").parse().unwrap();
    let e = Socket::connect(&dev, dst, Config::RSOCKETS, T).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ECONNREFUSED));
    drop(client);
}

/// rstream's ping-pong: a 16-byte sync each way, then each side in turn sends a transfer
/// the other echoes, many more times than the receive queue is deep.
#[test]
fn ping_pong_past_many_credit_rounds() {
    let (client, server, _l) = pair();
    let server = Arc::new(server);
    let s2 = Arc::clone(&server);
    let echo = std::thread::spawn(move || {
        let mut buf = vec![0u8; 65536];
        let mut total = 0usize;
        loop {
            let n = s2.recv(&mut buf, false, false).expect("echo recv");
            if n == 0 {
                return total;
            }
            assert_eq!(s2.send(&buf[..n], false).expect("echo send"), n);
            total += n;
        }
    });
    const N: usize = 65536;
    let mut buf = vec![0u8; N];
    for round in 0..300u32 {
        let msg = pattern(round as u8, N);
        assert_eq!(client.send(&msg, false).unwrap(), N);
        let mut got = 0;
        while got < N {
            let n = client.recv(&mut buf[got..], false, false).unwrap();
            assert!(n > 0, "round {round}: end of stream");
            got += n;
        }
        assert!(buf == msg, "round {round}");
    }
    client.shutdown(Shutdown::Write).unwrap();
    assert_eq!(echo.join().unwrap(), N * 300);
}

/// A connect taken step by step without blocking, from a socket bound first: its
/// descriptor stays the one it had unbound, and the source is the bound address.
#[test]
fn a_bound_socket_connects_step_by_step_on_its_own_descriptor() {
    use softrdma_rsocket::Unconnected;
    use std::os::fd::AsRawFd;
    let (a, b) = (device(), device());
    let l = Listener::bind(&a, "0.0.0.0:0".parse().unwrap(), 0, Config::RSOCKETS).expect("bind");
    let port = l.local_addr().expect("bound").port();
    let u = Unconnected::new(&b).expect("socket");
    let fd = u.fd().as_raw_fd();
    u.bind("127.0.0.1:0".parse().unwrap())
        .expect("bind the client");
    let src = u.addrs().0.expect("bound address");
    assert_ne!(src.port(), 0);
    let mut c = u.connect(
        format!("127.0.0.1:{port}").parse().unwrap(),
        Config::RSOCKETS,
    );
    assert_eq!(c.fd().map(|f| f.as_raw_fd()), Some(fd));
    let mut client = None;
    let mut server = None;
    let mut under_way = 0;
    for _ in 0..4000 {
        if server.is_none() {
            server = l.poll_accept();
        }
        if client.is_none() {
            match c.poll().expect("connect") {
                Some(s) => client = Some(s),
                None => under_way += 1,
            }
        }
        if client.is_some() && server.is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let (client, server) = (client.expect("connected"), server.expect("accepted"));
    assert!(
        under_way > 0,
        "the reply needs the server's answer: never at once"
    );
    assert_eq!(c.poll().unwrap_err().raw_os_error(), Some(libc::EISCONN));
    assert_eq!(client.fds()[1].as_raw_fd(), fd);
    assert_eq!(client.addrs().0, Some(src));
    assert_eq!(server.addrs().1.map(|a| a.port()), Some(src.port()));
    assert_eq!(client.send(b"stepwise", false).unwrap(), 8);
    let mut buf = [0u8; 16];
    assert_eq!(server.recv(&mut buf, false, false).unwrap(), 8);
    assert_eq!(&buf[..8], b"stepwise");
}

/// A refused step-by-step connect says so, and says it again.
#[test]
fn a_refused_stepwise_connect_keeps_its_error() {
    use softrdma_rsocket::Unconnected;
    let d = device();
    let l = Listener::bind(&d, "0.0.0.0:0".parse().unwrap(), 0, Config::RSOCKETS).expect("bind");
    let port = l.local_addr().unwrap().port();
    drop(l);
    let mut c = Unconnected::new(&d).unwrap().connect(
        format!("127.0.0.1:{port}").parse().unwrap(),
        Config::RSOCKETS,
    );
    let mut err = None;
    for _ in 0..4000 {
        match c.poll() {
            Ok(None) => std::thread::sleep(Duration::from_millis(5)),
            Ok(Some(_)) => panic!("connected to nobody"),
            Err(e) => {
                err = Some(e);
                break;
            }
        }
    }
    let e = err.expect("a verdict");
    assert_eq!(e.raw_os_error(), Some(libc::ECONNREFUSED), "{e}");
    assert_eq!(
        c.poll().unwrap_err().raw_os_error(),
        Some(libc::ECONNREFUSED)
    );
    assert!(c.fd().is_none());
}

/// `riomap`/`riowrite`: the server maps a buffer; the client's direct write lands in it
/// with no receive, past the mapping's end it stops short, and unmapped it is gone.
#[test]
fn direct_writes_land_in_the_peers_mapping() {
    let (client, server, _l) = pair_with(Config {
        iomap_size: 4,
        ..Config::RSOCKETS
    });
    let mut target = vec![0u8; 8192];
    // SAFETY: `target` outlives the mapping (unmapped below, before it is dropped).
    let off = unsafe { server.iomap(target.as_mut_ptr(), target.len(), Some(4096), true) }
        .expect("iomap");
    assert_eq!(off, 4096);
    // The offer goes with the server's next send.
    assert_eq!(server.send(b"x", false).unwrap(), 1);
    let mut one = [0u8; 1];
    assert_eq!(client.recv(&mut one, false, false).unwrap(), 1);
    let data = pattern(9, 6000);
    assert_eq!(client.iowrite(&data, 4096 + 100, false).unwrap(), 6000);
    // Past the end of the mapping: short.
    assert_eq!(client.iowrite(&data, 4096 + 8000, false).unwrap(), 192);
    // Outside any mapping: nothing.
    assert_eq!(client.iowrite(&data, 100, false).unwrap(), 0);
    // The writes complete in order before a later send arrives.
    assert_eq!(client.send(b"y", false).unwrap(), 1);
    assert_eq!(server.recv(&mut one, false, false).unwrap(), 1);
    assert_eq!(&target[100..6100], &data[..]);
    assert_eq!(&target[8000..], &data[..192]);
    assert!(target[..100].iter().all(|&b| b == 0));
    server
        .iounmap(target.as_mut_ptr(), target.len())
        .expect("unmap");
    assert_eq!(
        server
            .iounmap(target.as_mut_ptr(), target.len())
            .unwrap_err()
            .raw_os_error(),
        Some(libc::EINVAL)
    );
}

/// A peer that ignores its receive credits: the client writes 40 data messages (empty
/// WRITEs WITH IMMEDIATE, straight on its QP) to a server whose receive queue, and so
/// its credits, are 16 and which reads none. The connection fails with EPROTO (as a
/// reset would end a TCP connection), where an unchecked ring would be overrun.
#[test]
fn a_peer_past_its_credits_fails_the_connection() {
    use softrdma_device::verbs::{SendFlags, SendOp, SendWr};
    let (client, server, _l) = pair_with(Config {
        rq_size: 16,
        ..Config::RSOCKETS
    });
    let wr = SendWr {
        wr_id: 0,
        op: SendOp::WriteWithImm {
            remote_addr: 0,
            rkey: 0,
            imm: 0,
        },
        flags: SendFlags::SIGNALED,
        sg_list: Vec::new(),
        inline_data: None,
        ud: None,
    };
    for i in 0..40 {
        let r = client.device().post_send(client.qpn(), wr.clone());
        assert!(r.is_ok(), "message {i}: {r:?}");
    }
    let mut failed = false;
    for _ in 0..400 {
        if server.readiness().2 {
            failed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(failed, "the server never saw the peer exceed its credits");
    assert_eq!(server.phase(), Phase::Failed(libc::EPROTO));
    assert_eq!(server.error(), Some(libc::EPROTO));
}

/// A shutdown that has to wait for the peer, without waiting: the server has `R`
/// receives and grants `R` credits, the client sends `R` one-byte messages it does not
/// read, so the client's SHUTDOWN is refused (RNR) until the server reads. Until then
/// `try_shutdown` says WouldBlock, however often it is asked; once the server has read,
/// it completes, and the server has every byte and then the end of the stream. Only
/// writing closed: the other way still carries data.
#[test]
fn try_shutdown_waits_for_the_peer_without_blocking() {
    const R: u16 = 32;
    let (client, server, _l) = pair_with(Config {
        rq_size: R,
        ..Config::RSOCKETS
    });
    let sent = pattern(3, usize::from(R));
    for b in &sent {
        assert_eq!(client.send(std::slice::from_ref(b), true).unwrap(), 1);
    }
    for _ in 0..5 {
        let e = client.try_shutdown(Shutdown::Write).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock);
    }
    let e = client.send(b"x", true).unwrap_err();
    assert_eq!(
        e.raw_os_error(),
        Some(libc::ECONNRESET),
        "writing is closed"
    );
    let mut got = Vec::new();
    let mut buf = [0u8; 64];
    loop {
        let n = server.recv(&mut buf, false, false).unwrap();
        if n == 0 {
            break;
        }
        got.extend_from_slice(&buf[..n]);
    }
    assert_eq!(got, sent, "every byte, then the end of the stream");
    let mut done = false;
    for _ in 0..600 {
        match client.try_shutdown(Shutdown::Write) {
            Ok(()) => {
                done = true;
                break;
            }
            Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock),
        }
        if client.arm() {
            let fds = client.fds();
            let _ = softrdma_device::poll_readable(&fds, Some(Duration::from_millis(50)));
            client.take_events();
        }
    }
    assert!(done, "the shutdown completed once the server read");
    client.shutdown(Shutdown::Write).unwrap();
    assert_eq!(server.send(b"reply", false).unwrap(), 5);
    let n = client.recv(&mut buf, false, false).unwrap();
    assert_eq!(&buf[..n], b"reply");
}

/// The listener's one descriptor wakes a waiter for a request and again for the RTU that
/// establishes the connection it answered: an event loop waiting on `fd` alone, then
/// calling `poll_accept`, gets the connection (its wait passing without the fd readable
/// fails the test).
#[test]
fn the_listeners_fd_wakes_for_the_request_and_for_the_rtu() {
    let (a, b) = (device(), device());
    let l = Listener::bind(&a, "0.0.0.0:0".parse().unwrap(), 0, Config::RSOCKETS).expect("bind");
    let port = l.local_addr().expect("bound").port();
    let dst = format!("127.0.0.1:{port}").parse().unwrap();
    let t = std::thread::spawn(move || Socket::connect(&b, dst, Config::RSOCKETS, T));
    let mut wakes = 0;
    let server = loop {
        let r = softrdma_device::poll_readable(&[l.fd()], T).expect("poll");
        assert!(r[0], "the listener's fd woke (after {wakes} wakes)");
        wakes += 1;
        if let Some(s) = l.poll_accept() {
            break s;
        }
    };
    let client = t.join().unwrap().expect("connect");
    assert_eq!(client.send(b"hello", false).unwrap(), 5);
    let mut buf = [0u8; 8];
    let n = server.recv(&mut buf, false, false).unwrap();
    assert_eq!(&buf[..n], b"hello");
}
