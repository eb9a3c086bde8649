//! `softrdma::rsocket` on two real devices over loopback: a stream both ways through
//! `Read`/`Write` on two threads, shutdown and close as a reader sees them, refusals as
//! errors; and under the `tokio` feature the same stream through `AsyncRead`/`AsyncWrite`
//! on one runtime thread while a timer task keeps ticking, and a shutdown that has to wait
//! for the peer leaving the runtime's thread to the peer.

use std::io::{Read, Write};
use std::net::Shutdown;
use std::time::Duration;

use softrdma::rsocket::{RListener, RStream, RsocketConfig, RsocketOptions};
use softrdma::Device;

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed))
        .collect()
}

fn pair() -> (RStream, RStream) {
    pair_with(RsocketConfig::from_system())
}

/// A client and the server's stream, the server's made with `server`.
fn pair_with(server: RsocketConfig) -> (RStream, RStream) {
    let sdev = Device::open_default().expect("device");
    let l = RListener::bind_with(&sdev, "0.0.0.0:0".parse().unwrap(), server).expect("bind");
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

/// A write shutdown that must wait for the peer does not hold the runtime's thread. The
/// server's stream has `R` receives and grants `R` credits; the client sends `R` one-byte
/// messages (and a credit grant of its own) that the server does not read, so its
/// receive queue is used up and the client's SHUTDOWN is refused (RNR) until the server
/// reads. Polled once then, the shutdown is Pending (a blocking one would return only
/// after its wait gave up); the server's reader, another task on the same thread, then
/// runs, makes room, and the shutdown completes; the reader has every byte, then the end.
#[cfg(feature = "tokio")]
#[test]
fn async_shutdown_waiting_for_the_peer_leaves_the_thread_to_it() {
    use std::future::Future;
    use std::task::Poll;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const R: u16 = 64;
    let mut cfg = RsocketConfig::from_system();
    cfg.rq_size = R;
    let (c, s) = pair_with(cfg);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async move {
        let mut c = c.into_async().unwrap();
        let mut s = s.into_async().unwrap();
        let sent = pattern(4, usize::from(R));
        for b in &sent {
            c.write_all(std::slice::from_ref(b)).await.unwrap();
        }
        let mut shutdown = Box::pin(c.shutdown());
        let first = std::future::poll_fn(|cx| Poll::Ready(shutdown.as_mut().poll(cx))).await;
        assert!(
            first.is_pending(),
            "the shutdown waits for the server to make room without blocking: {first:?}"
        );
        let reader = tokio::task::spawn_local(async move {
            let mut got = Vec::new();
            s.read_to_end(&mut got).await.map(|_| got)
        });
        tokio::time::timeout(Duration::from_secs(30), shutdown)
            .await
            .expect("the shutdown completed once the server read")
            .unwrap();
        let got = tokio::time::timeout(Duration::from_secs(30), reader)
            .await
            .expect("the server's reads ended")
            .unwrap()
            .unwrap();
        assert!(got == sent, "every byte, then the end of the stream");
    });
}

/// Dropping an async stream whose last sends wait for the peer holds neither the runtime's
/// thread nor the bytes back. The client takes one of the server's receives with a credit
/// grant of its own (a read that finds nothing) and then sends `R` one-byte messages, so
/// its last byte and its DISCONNECT wait (RNR) for the server to read. A drop that waited
/// on the runtime's thread would give up, and flush them, before the server, on that same
/// thread, read: the server would miss the last byte.
#[cfg(feature = "tokio")]
#[test]
fn async_drop_waiting_for_the_peer_loses_nothing() {
    use std::task::Poll;
    use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, ReadBuf};
    const R: u16 = 64;
    let mut cfg = RsocketConfig::from_system();
    cfg.rq_size = R;
    let (c, s) = pair_with(cfg);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async move {
        let mut c = c.into_async().unwrap();
        let mut s = s.into_async().unwrap();
        let mut b = [0u8; 1];
        let read = std::future::poll_fn(|cx| {
            let mut buf = ReadBuf::new(&mut b);
            Poll::Ready(std::pin::Pin::new(&mut c).poll_read(cx, &mut buf))
        })
        .await;
        assert!(read.is_pending(), "nothing to read yet: {read:?}");
        let sent = pattern(5, usize::from(R));
        for b in &sent {
            c.write_all(std::slice::from_ref(b)).await.unwrap();
        }
        drop(c);
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut got))
            .await
            .expect("the server's reads ended")
            .unwrap();
        assert!(
            got == sent,
            "every byte, then the end of the stream: {} of {}",
            got.len(),
            sent.len()
        );
    });
}

/// An awaited connect leaves the runtime's thread free: the server accepts only when a
/// task on that thread, polled after the connect began, says so. A connect that waited
/// for the server's answer on the thread would never let it, and time out.
#[cfg(feature = "tokio")]
#[test]
fn async_connect_leaves_the_thread_to_other_tasks() {
    use softrdma::rsocket::AsyncRStream;
    use tokio::io::AsyncWriteExt;
    let sdev = Device::open_default().expect("device");
    let l = RListener::bind(&sdev, "0.0.0.0:0".parse().unwrap()).expect("bind");
    let port = l.local_addr().unwrap().port();
    let (go, gone) = std::sync::mpsc::channel::<()>();
    let server = std::thread::spawn(move || {
        gone.recv().expect("told to accept");
        let (mut s, _) = l.accept_timeout(Some(Duration::from_secs(20)))?;
        let mut got = Vec::new();
        s.read_to_end(&mut got)?;
        Ok::<_, std::io::Error>(got)
    });
    let dev = Device::open_default().expect("device");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async move {
        let opts = RsocketOptions {
            timeout: Some(Duration::from_secs(10)),
            ..RsocketOptions::default()
        };
        let addr = ([127, 0, 0, 1], port).into();
        let connect =
            tokio::task::spawn_local(
                async move { AsyncRStream::connect_with(&dev, addr, &opts).await },
            );
        tokio::task::yield_now().await;
        go.send(()).unwrap();
        let mut c = connect.await.unwrap().expect("connected");
        c.write_all(b"connected without blocking").await.unwrap();
        c.shutdown().await.unwrap();
    });
    assert_eq!(
        server.join().unwrap().unwrap(),
        b"connected without blocking"
    );
}

/// An awaited accept leaves the runtime's thread free: the client connects only when a
/// task on that thread, polled after the accept began, says so; the accepted stream then
/// reads what the client wrote. An accept that waited on the thread would wait forever
/// (the runtime runs on a thread of its own, so the test fails instead of hanging).
#[cfg(feature = "tokio")]
#[test]
fn async_accept_leaves_the_thread_to_other_tasks() {
    use softrdma::rsocket::AsyncRListener;
    use tokio::io::AsyncReadExt;
    let (done, finished) = std::sync::mpsc::channel();
    let (go, gone) = std::sync::mpsc::channel::<u16>();
    let client = std::thread::spawn(move || -> std::io::Result<()> {
        let port = gone.recv().expect("told to connect");
        let dev = Device::open_default().expect("device");
        let opts = RsocketOptions {
            timeout: Some(Duration::from_secs(20)),
            ..RsocketOptions::default()
        };
        let mut c = RStream::connect_with(&dev, ([127, 0, 0, 1], port).into(), &opts)
            .map_err(std::io::Error::from)?;
        c.write_all(b"accepted without blocking")?;
        c.shutdown(Shutdown::Write)
    });
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let local = tokio::task::LocalSet::new();
        let got = local.block_on(&rt, async move {
            let dev = Device::open_default().expect("device");
            let l = AsyncRListener::bind(&dev, "0.0.0.0:0".parse().unwrap()).expect("bind");
            let port = l.local_addr().unwrap().port();
            let accept = tokio::task::spawn_local(async move { l.accept().await });
            tokio::task::yield_now().await;
            go.send(port).unwrap();
            let (mut s, peer) = accept.await.unwrap().expect("accepted");
            assert_eq!(peer.ip(), std::net::Ipv4Addr::LOCALHOST);
            let mut got = Vec::new();
            s.read_to_end(&mut got).await.map(|_| got)
        });
        let _ = done.send(got);
    });
    let got = finished
        .recv_timeout(Duration::from_secs(30))
        .expect("the accept completed while another task ran on its thread")
        .unwrap();
    assert_eq!(got, b"accepted without blocking");
    client.join().unwrap().unwrap();
}
