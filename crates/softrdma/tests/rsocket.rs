//! `softrdma::rsocket` on two real devices over loopback: a stream both ways through
//! `Read`/`Write` on two threads, shutdown and close as a reader sees them, refusals as
//! errors; and under the `tokio` feature the same stream through `AsyncRead`/`AsyncWrite`
//! on one runtime thread while a timer task keeps ticking.

use std::io::{Read, Write};
use std::net::Shutdown;
use std::time::Duration;

use softrdma::rsocket::{RListener, RStream, RsocketOptions};
use softrdma::Device;

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed))
        .collect()
}

fn pair() -> (RStream, RStream) {
    let sdev = Device::open_default().expect("device");
    let l = RListener::bind(&sdev, "0.0.0.0:0".parse().unwrap()).expect("bind");
    let port = l.local_addr().unwrap().port();
    let t = std::thread::spawn(move || l.accept_timeout(Some(Duration::from_secs(20))));
    let dev = Device::open_default().expect("device");
    let opts = RsocketOptions {
        timeout: Some(Duration::from_secs(20)),
        ..RsocketOptions::default()
    };
    let c = RStream::connect_with(&dev, ([127, 0, 0, 1], port).into(), &opts).expect("connect");
    let (s, peer) = t.join().unwrap().expect("accept");
    assert_eq!(
        peer,
        c.local_addr().unwrap(),
        "the server sees the client's address"
    );
    assert_eq!(c.peer_addr().unwrap().port(), port);
    (c, s)
}

#[test]
fn read_and_write_both_ways_then_shutdown() {
    let (c, s) = pair();
    let up = pattern(1, 700_001);
    let down = pattern(2, 123_457);
    std::thread::scope(|sc| {
        let w1 = sc.spawn(|| (&c).write_all(&up));
        let w2 = sc.spawn(|| (&s).write_all(&down));
        let mut got_up = vec![0u8; up.len()];
        (&s).read_exact(&mut got_up).expect("server reads");
        let mut got_down = vec![0u8; down.len()];
        (&c).read_exact(&mut got_down).expect("client reads");
        assert!(got_up == up, "the server read what the client wrote");
        assert!(got_down == down, "the client read what the server wrote");
        w1.join().unwrap().unwrap();
        w2.join().unwrap().unwrap();
    });
    (&c).write_all(b"bye").unwrap();
    c.shutdown(Shutdown::Write).unwrap();
    let mut tail = Vec::new();
    (&s).read_to_end(&mut tail).unwrap();
    assert_eq!(tail, b"bye");
    let e = (&c).write(b"more").unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ECONNRESET));
    drop(s);
    let mut rest = Vec::new();
    (&c).read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty());
    assert!(!c.is_connected());
}

#[test]
fn nonblocking_reads_would_block_and_a_refused_connect_is_an_error() {
    let (mut c, s) = pair();
    c.set_nonblocking(true);
    let mut b = [0u8; 4];
    assert_eq!(
        (&c).read(&mut b).unwrap_err().kind(),
        std::io::ErrorKind::WouldBlock
    );
    (&s).write_all(b"ping").unwrap();
    let mut n = 0;
    for _ in 0..10_000 {
        match (&c).read(&mut b[n..]) {
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(1))
            }
            Err(e) => panic!("{e}"),
        }
        if n == 4 {
            break;
        }
    }
    assert_eq!(&b, b"ping");
    assert_eq!(
        c.peek(&mut b).unwrap_err().kind(),
        std::io::ErrorKind::WouldBlock
    );
    let dev = Device::open_default().unwrap();
    let l = RListener::bind(&dev, "0.0.0.0:0".parse().unwrap()).unwrap();
    let port = l.local_addr().unwrap().port();
    drop(l);
    let e = RStream::connect(&dev, ([127, 0, 0, 1], port).into()).unwrap_err();
    assert_eq!(e.errno(), libc::ECONNREFUSED, "{e}");
}

/// Both ends on one runtime thread: 2 MiB cannot pass the 128 KiB of buffers without the
/// writer and the reader taking turns, so a wait that blocked the thread would hang (the
/// timeout turns that into a failure).
#[cfg(feature = "tokio")]
#[test]
fn async_read_and_write_on_one_runtime_thread() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (c, s) = pair();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async move {
        let mut c = c.into_async().unwrap();
        let mut s = s.into_async().unwrap();
        let up = pattern(3, 2 << 20);
        let up2 = up.clone();
        let writer = tokio::task::spawn_local(async move {
            c.write_all(&up2).await.unwrap();
            c.shutdown().await.unwrap();
            c
        });
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut got))
            .await
            .expect("the stream moved with both ends on one thread")
            .unwrap();
        assert!(got == up, "the stream arrived whole and in order");
        writer.await.unwrap();
    });
}
