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
    let (a, b) = (device(), device());
    let l = Listener::bind(&a, "0.0.0.0:0".parse().unwrap(), 0, Config::RSOCKETS).expect("bind");
    let port = l.local_addr().expect("bound").port();
    let dst = format!("127.0.0.1:{port}").parse().unwrap();
    let t = std::thread::spawn(move || Socket::connect(&b, dst, Config::RSOCKETS, T));
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
