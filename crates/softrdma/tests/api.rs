//! The API's error reporting: error kinds to match on, completion errors with their detail
//! codes, `poll_iter` after an overflow, and the fds as `AsFd`.

use std::time::Duration;

use softrdma::*;

const T: Duration = Duration::from_secs(10);
const ALL: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_READ)
    .union(Access::REMOTE_ATOMIC);

fn open() -> Device {
    let cfg = DeviceConfig::new("api", DeviceAddr::AutoLoopback(4791));
    Device::open_with(&cfg).expect("open device")
}

/// A QP on its own device with a CQ of `cq_depth`, and an MR of its PD.
struct Side {
    dev: Device,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    qp: QueuePair,
    mr: MemoryRegion,
}

fn side(t: QpType, cq_depth: u32) -> Side {
    let dev = open();
    let pd = dev.alloc_pd().unwrap();
    let cq = dev.create_cq(cq_depth, None).unwrap();
    let qp = pd.create_qp(&QpInit::new(t, &cq)).unwrap();
    let mr = pd.register(8192, ALL).unwrap();
    Side {
        dev,
        pd,
        cq,
        qp,
        mr,
    }
}

fn connect(a: &Side, b: &Side) {
    a.qp.connect(&b.qp.local(2000), 100, ALL).unwrap();
    b.qp.connect(&a.qp.local(100), 2000, ALL).unwrap();
}

#[test]
fn the_einval_family_has_distinct_kinds() {
    let a = side(QpType::Rc, 1);
    let b = side(QpType::Rc, 64);
    // Sending before the QP is ready.
    let not_ready = a.qp.post_send(wr::send(1, [a.mr.sge(0..8)])).unwrap_err();
    assert_eq!(not_ready.kind(), ErrorKind::QpState, "{not_ready}");
    connect(&a, &b);
    // RTS back to INIT is no transition of the state machine.
    let illegal = a.qp.to_init(ALL).unwrap_err();
    assert_eq!(illegal.kind(), ErrorKind::InvalidTransition, "{illegal}");
    // Local copies past the region's end, and a misaligned atomic.
    let oob = a.mr.write(8190, b"four").unwrap_err();
    assert_eq!(oob.kind(), ErrorKind::OutOfBounds, "{oob}");
    let misaligned = a.mr.fetch_add_u64(4, 1).unwrap_err();
    assert_eq!(misaligned.kind(), ErrorKind::Misaligned, "{misaligned}");
    // More completions than the CQ holds.
    let cap = a.cq.capacity() as u64;
    for i in 0..=cap {
        a.qp.post_send(wr::write(i, [a.mr.sge(0..8)], &b.mr.remote(), 0))
            .unwrap();
    }
    // Nothing polls until the device reports the overflow.
    assert_eq!(
        a.dev.wait_async_event(Some(T)).unwrap(),
        AsyncEvent::CqErr(a.cq.id())
    );
    let overflow = a.cq.poll_one().unwrap_err();
    assert_eq!(overflow.kind(), ErrorKind::CqOverflow, "{overflow}");
    // The C face's errnos are what they were.
    for e in [&not_ready, &illegal, &misaligned, &overflow] {
        assert_eq!(e.errno(), 22, "{e}");
    }
    assert_eq!(oob.errno(), 14, "{oob}");
    // The verbs error a kind came from is the source.
    let src = std::error::Error::source(&illegal).expect("a verbs error underneath");
    let verbs_err = src.downcast_ref::<verbs::Error>().expect("verbs::Error");
    assert_eq!(verbs_err.kind, ErrorKind::InvalidTransition);
    drop(b.dev);
    drop(a.pd);
}

#[test]
fn foreign_objects_and_config_errors_have_their_kinds() {
    let a = open();
    let b = open();
    let cq_b = b.create_cq(4, None).unwrap();
    let pd_a = a.alloc_pd().unwrap();
    let Err(e) = pd_a.create_qp(&QpInit::new(QpType::Rc, &cq_b)) else {
        panic!("a CQ of another device is refused");
    };
    assert_eq!(e.kind(), ErrorKind::ForeignObject, "{e}");
    let cfg = DeviceConfig::new(
        "api-bad",
        DeviceAddr::Fixed("192.0.2.1:4791".parse().unwrap()),
    );
    let Err(e) = Device::open_with(&cfg) else {
        panic!("not a local address");
    };
    assert_eq!(e.kind(), ErrorKind::AddrNotAvailable, "{e}");
    let io = std::error::Error::source(&e).expect("the OS error underneath");
    assert!(io.downcast_ref::<std::io::Error>().is_some(), "{io:?}");
    let io_err: std::io::Error = e.clone().into();
    assert_eq!(io_err.kind(), std::io::ErrorKind::AddrNotAvailable);
    let inner = io_err.get_ref().and_then(|i| i.downcast_ref::<Error>());
    assert_eq!(inner, Some(&e));
}
