//! The `tokio` feature on two real devices over loopback, in one process and on one
//! thread: thousands of awaited operations while a timer task keeps ticking (so the
//! waits never blocked the runtime's only thread), the bytes checked in target memory;
//! a device async event awaited; the connection manager's accept and connect awaited.
#![cfg(feature = "tokio")]

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::rc::Rc;
use std::sync::Once;
use std::time::Duration;

use softrdma::cm::{self, AcceptOptions, AsyncListener, ConnectOptions, EventType};
use softrdma::*;

mod support;
use support::{Side, ALL};

/// Upper bound of every wait: a test that hangs fails instead.
const T: Duration = Duration::from_secs(30);
/// The CM test's devices use a UDP port of their own, away from tests/cm.rs's.
const CM_DEV_PORT: u16 = 25_891;

static SETUP: Once = Once::new();

fn open(name: &str, port: u16) -> Device {
    SETUP.call_once(|| {
        let dir = std::env::temp_dir().join(format!("softrdma-cm-tokio-{}", std::process::id()));
        // Set once, before any device or CM of this process reads the environment.
        std::env::set_var("SOFTRDMA_CM_DIR", &dir);
    });
    let mut cfg = DeviceConfig::new(name, DeviceAddr::AutoLoopback(port));
    cfg.stats_dir = None;
    cfg.pcap = None;
    Device::open_with(&cfg).expect("open device")
}

fn side(name: &str, mr_len: usize) -> Side {
    let dev = open(name, 4791);
    let pd = dev.alloc_pd().unwrap();
    let ch = dev.create_channel().unwrap();
    let cq = dev.create_cq(128, Some(&ch)).unwrap();
    let qp = pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap();
    let mr = pd.register(mr_len, ALL).unwrap();
    Side {
        dev,
        pd,
        cq,
        qp,
        mr,
    }
}

fn pair(mr_len: usize) -> (Side, Side) {
    let a = side("tokio-a", mr_len);
    let b = side("tokio-b", mr_len);
    // Each QP chose its PSN; its endpoint carries it to the peer.
    a.qp.connect_to(&b.qp.endpoint(), ALL).unwrap();
    b.qp.connect_to(&a.qp.endpoint(), ALL).unwrap();
    (a, b)
}

/// A timer task on the current thread; returns its tick count. It can only tick while
/// the task awaiting completions yields the thread.
fn ticker() -> (Rc<std::cell::Cell<u32>>, tokio::task::JoinHandle<()>) {
    let ticks = Rc::new(std::cell::Cell::new(0u32));
    let t = Rc::clone(&ticks);
    let h = tokio::task::spawn_local(async move {
        let mut iv = tokio::time::interval(Duration::from_millis(1));
        // Skip, not the default Burst: ticks missed while the thread was held are not
        // made up afterwards, so the count is of times the timer really got the thread.
        iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            iv.tick().await;
            t.set(t.get() + 1);
        }
    });
    (ticks, h)
}

/// On a current-thread runtime (with a LocalSet for the Rc-counting ticker).
fn run<F: std::future::Future<Output = ()>>(f: F) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async {
        tokio::time::timeout(Duration::from_secs(120), f)
            .await
            .expect("the test finished in time");
    });
}

/// 2000 RDMA WRITEs, each posted and its completion awaited before the next, while a
/// 1 ms interval runs on the same thread; every written byte is then checked.
#[test]
fn two_thousand_awaited_writes_leave_the_runtime_free() {
    const N: usize = 2000;
    const LEN: usize = 64;
    run(async {
        let (a, b) = pair(N * LEN);
        let (ticks, timer) = ticker();
        let mut cq = a.cq.clone().into_async().unwrap();
        let remote = b.mr.remote();
        for i in 0..N {
            let off = i * LEN;
            let chunk: Vec<u8> = (0..LEN).map(|j| (i * 31 + j) as u8).collect();
            a.mr.write(off, &chunk).unwrap();
            let w = wr::write(
                i as u64,
                [a.mr.sge(off..off + LEN).unwrap()],
                &remote,
                off as u64,
            )
            .unwrap();
            a.qp.post_send(w).unwrap();
            let wc = cq.completion().await.unwrap();
            assert_eq!(wc.wr_id, i as u64);
            wc.result().unwrap();
            assert_eq!(wc.opcode, WcOpcode::RdmaWrite);
        }
        timer.abort();
        let want: Vec<u8> = (0..N)
            .flat_map(|i| (0..LEN).map(move |j| (i * 31 + j) as u8))
            .collect();
        assert_eq!(b.mr.to_vec(0, N * LEN).unwrap(), want);
        // Not a duration check: only that the timer got the thread at all while 2000
        // completions were awaited.
        assert!(
            ticks.get() >= 3,
            "the timer ticked {} times: the awaits blocked the thread",
            ticks.get()
        );
        drop(cq);
        drop((a.pd, b.dev));
    });
}

/// A pipeline: 4000 WRITEs then READs of them back, 32 in flight, completions awaited
/// in batches; the READ-back bytes match what was written, and the timer ticked.
#[test]
fn pipelined_writes_and_reads_in_flight() {
    const N: usize = 4000;
    const LEN: usize = 32;
    const DEPTH: usize = 32;
    run(async {
        let (a, b) = pair(2 * N * LEN);
        let (ticks, timer) = ticker();
        let mut cq = a.cq.clone().into_async().unwrap();
        let remote = b.mr.remote();
        let pattern = |i: usize| -> Vec<u8> { (0..LEN).map(|j| (i ^ (j * 7)) as u8).collect() };
        for i in 0..N {
            a.mr.write(i * LEN, &pattern(i)).unwrap();
        }
        // WRITE slot i of A's first half to slot i of B; then READ it into A's second half.
        for read in [false, true] {
            let mut posted = 0;
            let mut done = 0;
            while done < N {
                while posted < N && posted - done < DEPTH {
                    let i = posted;
                    let w = if read {
                        let at = N * LEN + i * LEN;
                        wr::read(
                            i as u64,
                            [a.mr.sge(at..at + LEN).unwrap()],
                            &remote,
                            (i * LEN) as u64,
                        )
                    } else {
                        wr::write(
                            i as u64,
                            [a.mr.sge(i * LEN..(i + 1) * LEN).unwrap()],
                            &remote,
                            (i * LEN) as u64,
                        )
                    }
                    .unwrap();
                    a.qp.post_send(w).unwrap();
                    posted += 1;
                }
                let wc = cq.completion().await.unwrap();
                wc.result().unwrap();
                // RC completes in order.
                assert_eq!(wc.wr_id, done as u64);
                done += 1;
            }
        }
        timer.abort();
        for i in 0..N {
            assert_eq!(
                b.mr.to_vec(i * LEN, LEN).unwrap(),
                pattern(i),
                "slot {i} at B"
            );
            assert_eq!(
                a.mr.to_vec(N * LEN + i * LEN, LEN).unwrap(),
                pattern(i),
                "slot {i} read back"
            );
        }
        assert!(ticks.get() >= 3, "the timer ticked {} times", ticks.get());
    });
}

/// A CQ without a channel cannot be awaited, and no async type is made outside a
/// runtime: both are errors, not panics.
#[test]
fn misuse_is_an_error() {
    let dev = open("tokio-m", 4791);
    let cq = dev.create_cq(4, None).unwrap();
    let e = cq.into_async().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    let ch = dev.create_channel().unwrap();
    let cq = dev.create_cq(4, Some(&ch)).unwrap();
    let e = cq.clone().into_async().unwrap_err();
    assert_eq!(
        e.kind(),
        ErrorKind::InvalidArgument,
        "outside a runtime: {e}"
    );
    let e = dev.async_events().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    // A runtime without I/O: tokio would panic; we say why.
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(async {
        let e = cq.clone().into_async().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "no I/O driver: {e}");
    });
    run(async move {
        let first = cq.clone().into_async().unwrap();
        let e = cq.clone().into_async().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Busy, "registered twice: {e}");
        drop(first);
        cq.into_async().expect("free again once the first is gone");
    });
}

/// A CQ overflow's async event (CQ_ERR) arrives through `next_event().await`, and the
/// async CQ yields the overflow error once, then ends.
#[test]
fn device_async_event_is_awaited() {
    run(async {
        let a = {
            let dev = open("tokio-e", 4791);
            let pd = dev.alloc_pd().unwrap();
            let ch = dev.create_channel().unwrap();
            let cq = dev.create_cq(2, Some(&ch)).unwrap();
            let qp = pd
                .create_qp(&QpInit::new(QpType::Rc, &cq).depth(1, 1))
                .unwrap();
            let mr = pd.register(8192, ALL).unwrap();
            Side {
                dev,
                pd,
                cq,
                qp,
                mr,
            }
        };
        let b = side("tokio-f", 8192);
        a.qp.connect_to(&b.qp.endpoint(), ALL).unwrap();
        b.qp.connect_to(&a.qp.endpoint(), ALL).unwrap();
        let events = a.dev.async_events().unwrap();
        // Nothing polls A's CQ while more WRITEs complete than it holds.
        let waiter = async {
            tokio::time::timeout(T, events.next_event())
                .await
                .expect("an event in time")
                .unwrap()
        };
        let poster = async {
            for i in 0..=u64::from(a.cq.capacity()) {
                loop {
                    let w = wr::write(i, [a.mr.sge(0..8).unwrap()], &b.mr.remote(), 0).unwrap();
                    match a.qp.post_send(w) {
                        Err(e) if e.kind() == ErrorKind::QueueFull => {
                            tokio::time::sleep(Duration::from_millis(1)).await
                        }
                        r => break r.unwrap(),
                    }
                }
            }
        };
        let (ev, ()) = tokio::join!(waiter, poster);
        assert_eq!(ev, AsyncEvent::CqErr(a.cq.id()));
        let mut cq = a.cq.clone().into_async().unwrap();
        let mut items = Vec::new();
        while let Some(r) = cq.next().await {
            items.push(r);
        }
        match items.last() {
            Some(Err(e)) => assert_eq!(e.kind(), ErrorKind::CqOverflow, "{e}"),
            other => panic!("expected the overflow error last, got {other:?}"),
        }
        assert!(cq.next().await.is_none(), "ended");
        assert_eq!(
            cq.completion().await.unwrap_err().kind(),
            ErrorKind::CqOverflow
        );
        drop(b.pd);
    });
}

fn any(port: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port)
}

/// The connection manager awaited: an AsyncListener accepts while connect_async
/// connects, on one thread; private data both ways; a SEND and a WRITE over the
/// connection awaited on both sides' async CQs; a disconnect seen by the other side.
#[test]
fn cm_accept_and_connect_are_awaited() {
    run(async {
        let srv_dev = open("tokio-cms", CM_DEV_PORT);
        let cli_dev = open("tokio-cmc", CM_DEV_PORT);
        let mk = |dev: &Device| {
            let pd = dev.alloc_pd().unwrap();
            let ch = dev.create_channel().unwrap();
            let cq = dev.create_cq(128, Some(&ch)).unwrap();
            let mr = pd.register(4096, ALL).unwrap();
            (pd, cq, mr)
        };
        let (spd, scq, smr) = mk(&srv_dev);
        let (cpd, ccq, cmr) = mk(&cli_dev);
        let listener = AsyncListener::bind(&srv_dev, any(0)).unwrap();
        let port = listener.local_addr().port();
        let server = async {
            let sinit = QpInit::new(QpType::Rc, &scq);
            let mut private = b"pong".to_vec();
            private.extend_from_slice(&smr.remote().to_bytes());
            listener
                .accept_with(&spd, &sinit, &AcceptOptions::new(&private), |qp| {
                    qp.post_recv(wr::recv(7, [smr.sge(0..256)?]))
                })
                .await
        };
        let client = async {
            let cinit = QpInit::new(QpType::Rc, &ccq);
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            cm::connect_async(&cpd, &cinit, addr, &ConnectOptions::new(b"ping")).await
        };
        let (sc, cc) = tokio::join!(server, client);
        let (sc, cc) = (sc.expect("accept"), cc.expect("connect"));
        assert_eq!(&cc.private_data()[..4], b"pong");
        assert_eq!(&sc.private_data()[..4], b"ping");
        assert_eq!(cc.qp().state().unwrap(), QpState::Rts);
        let mut rb = [0u8; 20];
        rb.copy_from_slice(&cc.private_data()[4..24]);
        let remote = RemoteMemory::from_bytes(&rb);
        let mut scq = scq.into_async().unwrap();
        let mut ccq = ccq.into_async().unwrap();
        // WRITE into the server's memory, then SEND; the server awaits its receive.
        cmr.write(0, b"written by the client").unwrap();
        cc.qp()
            .post_send(wr::write(1, [cmr.sge(0..21).unwrap()], &remote, 1024).unwrap())
            .unwrap();
        cmr.write(100, b"hello").unwrap();
        cc.qp()
            .post_send(wr::send(2, [cmr.sge(100..105).unwrap()]))
            .unwrap();
        let got = ccq.completions(2).await.unwrap();
        assert!(got.iter().all(|wc| wc.result().is_ok()), "{got:?}");
        let wc = scq.completion().await.unwrap();
        wc.result().unwrap();
        assert_eq!((wc.wr_id, wc.opcode, wc.byte_len), (7, WcOpcode::Recv, 5));
        assert_eq!(smr.to_vec(0, 5).unwrap(), b"hello");
        assert_eq!(smr.to_vec(1024, 21).unwrap(), b"written by the client");
        // The client ends it; the server awaits DISCONNECTED.
        cc.disconnect().unwrap();
        tokio::time::timeout(T, sc.disconnected())
            .await
            .expect("DISCONNECTED in time")
            .unwrap();
        assert!(sc.is_disconnected());
        // A raw async event channel: a connect to a port nobody serves is rejected.
        let ch = cm::EventChannel::new(&cli_dev).unwrap();
        let id = cm::CmId::new(&ch, cm::PortSpace::Tcp).unwrap();
        let ach = ch.into_async().unwrap();
        id.resolve_addr(None, SocketAddr::from(([127, 0, 0, 1], 9)))
            .unwrap();
        let ev = ach.next_event().await.unwrap();
        assert_eq!(ev.kind(), EventType::AddrResolved, "{ev:?}");
    });
}

/// The async key-value example (examples/async_kv.rs) runs to its own checks: `cargo
/// test --features tokio` builds it beside this test.
#[test]
fn async_kv_example_checks_itself() {
    let exe = std::env::current_exe().expect("test binary path");
    // target/<profile>/deps/tokio-<hash> -> target/<profile>/examples/async_kv
    let path = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target profile directory")
        .join("examples")
        .join("async_kv");
    assert!(
        path.exists(),
        "{} not built; run `cargo build -p softrdma --features tokio --examples`",
        path.display()
    );
    let out = std::process::Command::new(&path)
        .args(["--keys", "200"])
        .output()
        .expect("run async_kv");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "async_kv failed: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.lines().any(|l| l == "ok"), "{stdout}");
}

/// The async types and their futures may move to other threads, as a multi-threaded
/// runtime's `tokio::spawn` needs.
#[test]
fn async_types_and_futures_are_send() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>(_: &T) {}
    send_sync::<AsyncCompletionQueue>();
    send_sync::<AsyncDeviceEvents>();
    send_sync::<cm::AsyncEventChannel>();
    send_sync::<AsyncListener>();
    // Futures are only built here, never polled.
    fn futures(
        cq: &mut AsyncCompletionQueue,
        ev: &AsyncDeviceEvents,
        l: &AsyncListener,
        pd: &ProtectionDomain,
        init: &QpInit<'_>,
        addr: SocketAddr,
    ) {
        send(&cq.next());
        send(&ev.next_event());
        send(&l.next_request());
        send(&l.accept(pd, init, &AcceptOptions::default()));
        send(&cm::connect_async(
            pd,
            init,
            addr,
            &ConnectOptions::default(),
        ));
    }
    let _ = futures;
}
