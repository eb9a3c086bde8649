//! The API's error reporting: error kinds to match on, completion errors with their detail
//! codes, `poll_iter` after an overflow, and the fds as `AsFd`.

use std::time::Duration;

use softrdma::*;

mod support;
use support::{connect, Side, ALL};

const T: Duration = Duration::from_secs(10);

/// A QP on its own device with a CQ of `cq_depth` (at least 2) split between its send and
/// receive queues, and an MR of its PD.
fn side(t: QpType, cq_depth: u32) -> Side {
    let dev = support::open("api");
    let pd = dev.alloc_pd().unwrap();
    let cq = dev.create_cq(cq_depth, None).unwrap();
    let send = cq_depth / 2;
    let qp = pd
        .create_qp(&QpInit::new(t, &cq).depth(send, cq_depth - send))
        .unwrap();
    let mr = pd.register(8192, ALL).unwrap();
    Side {
        dev,
        pd,
        cq,
        qp,
        mr,
    }
}

/// Post `wr`, waiting while the send queue is full (the CQ is not polled meanwhile).
fn post_when_room(qp: &QueuePair, wr: SendWr) {
    let deadline = std::time::Instant::now() + T;
    loop {
        match qp.post_send(wr.clone()) {
            Err(e) if e.kind() == ErrorKind::QueueFull && std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(1))
            }
            r => return r.unwrap(),
        }
    }
}

#[test]
fn the_einval_family_has_distinct_kinds() {
    let a = side(QpType::Rc, 2);
    let b = side(QpType::Rc, 64);
    // Sending before the QP is ready.
    let not_ready =
        a.qp.post_send(wr::send(1, [a.mr.sge(0..8).unwrap()]))
            .unwrap_err();
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
    // More completions than the CQ holds: the send queue fits the CQ, but nothing polls.
    let cap = a.cq.capacity() as u64;
    for i in 0..=cap {
        let w = wr::write(i, [a.mr.sge(0..8).unwrap()], &b.mr.remote(), 0).unwrap();
        post_when_room(&a.qp, w);
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
    let a = support::open("api");
    let b = support::open("api");
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

#[test]
fn poll_iter_yields_the_overflow_error() {
    let a = side(QpType::Rc, 2);
    let b = side(QpType::Rc, 64);
    connect(&a, &b);
    a.qp.post_send(wr::write(1, [a.mr.sge(0..8).unwrap()], &b.mr.remote(), 0).unwrap())
        .unwrap();
    assert_eq!(a.cq.wait(T).unwrap().wr_id, 1);
    assert!(
        a.cq.poll_iter().next().is_none(),
        "an idle CQ yields nothing"
    );
    for i in 0..=a.cq.capacity() as u64 {
        let w = wr::write(10 + i, [a.mr.sge(0..8).unwrap()], &b.mr.remote(), 0).unwrap();
        post_when_room(&a.qp, w);
    }
    assert_eq!(
        a.dev.wait_async_event(Some(T)).unwrap(),
        AsyncEvent::CqErr(a.cq.id())
    );
    let items: Vec<Result<WorkCompletion>> = a.cq.poll_iter().collect();
    match items.as_slice() {
        [Err(e)] => assert_eq!(e.kind(), ErrorKind::CqOverflow, "{e}"),
        other => panic!("expected one overflow error, got {other:?}"),
    }
}

/// Whether `fd` becomes readable within `ms`, by poll(2) through the device crate.
fn readable(fd: std::os::fd::BorrowedFd<'_>, ms: u64) -> bool {
    softrdma_device::poll_readable(&[fd], Some(Duration::from_millis(ms))).is_ok_and(|r| r[0])
}

#[test]
fn fds_are_borrowed_from_their_owners() {
    use std::os::fd::{AsFd, AsRawFd};
    let a = side(QpType::Rc, 16);
    let dev_b = support::open("api");
    let pd_b = dev_b.alloc_pd().unwrap();
    let ch = dev_b.create_channel().unwrap();
    let cq_b = dev_b.create_cq(16, Some(&ch)).unwrap();
    let qp_b = pd_b
        .create_qp(&QpInit::new(QpType::Rc, &cq_b).depth(8, 8))
        .unwrap();
    let mr_b = pd_b.register(4096, ALL).unwrap();
    a.qp.connect_to(&qp_b.endpoint(), ALL).unwrap();
    qp_b.connect_to(&a.qp.endpoint(), ALL).unwrap();
    assert_eq!(ch.as_fd().as_raw_fd(), ch.as_raw_fd());
    // An owned duplicate of the channel's fd sees the same eventfd.
    let dup = ch.as_fd().try_clone_to_owned().unwrap();
    assert!(!readable(dup.as_fd(), 0), "no event yet");
    qp_b.post_recv(wr::recv(1, [mr_b.sge(0..64).unwrap()]))
        .unwrap();
    cq_b.req_notify(false).unwrap();
    a.qp.post_send(wr::send(1, [a.mr.sge(0..7).unwrap()]))
        .unwrap();
    assert!(
        (0..100).any(|_| readable(dup.as_fd(), 100)),
        "channel fd never became readable"
    );
    assert!(readable(ch.as_fd(), 0));
    assert_eq!(ch.try_get().unwrap(), Some(cq_b.id()));
    ch.ack(&cq_b, 1).unwrap();
    assert_eq!(cq_b.wait(T).unwrap().wr_id, 1);
    // The device's async-event fd, by accessor and by AsFd.
    assert_eq!(
        dev_b.async_event_fd().as_raw_fd(),
        dev_b.as_fd().as_raw_fd()
    );
    assert!(!readable(dev_b.as_fd(), 0), "no async event yet");
    qp_b.to_error().unwrap();
    let ev = dev_b.async_event_fd().try_clone_to_owned().unwrap();
    drop(dup);
    // A QP moved to ERROR by the program raises no event, except one that takes its
    // receives from an SRQ: it is told that its last WQE was reached.
    assert!(!readable(ev.as_fd(), 0));
    let srq = pd_b.create_srq(4, 1).unwrap();
    let cq_s = dev_b.create_cq(8, None).unwrap();
    let qp_s = pd_b
        .create_qp(&QpInit {
            srq: Some(&srq),
            ..QpInit::new(QpType::Rc, &cq_s).depth(1, 0)
        })
        .unwrap();
    qp_s.to_init(ALL).unwrap();
    qp_s.to_error().unwrap();
    assert!(
        (0..100).any(|_| readable(ev.as_fd(), 100)),
        "async-event fd never became readable"
    );
    assert_eq!(
        dev_b.next_async_event(),
        Some(AsyncEvent::QpLastWqeReached(qp_s.qpn()))
    );
    drop(qp_s);
    drop(qp_b);
    drop(cq_b);
}

#[test]
fn reset_cleans_the_qps_completions_out_of_its_cq() {
    let dev = support::open("api-reset");
    let pd = dev.alloc_pd().unwrap();
    let mr = pd.register(64, ALL).unwrap();
    let cq = dev.create_cq(8, None).unwrap();
    let other = pd
        .create_qp(&QpInit::new(QpType::Rc, &cq).depth(2, 2))
        .unwrap();
    let qp = pd
        .create_qp(&QpInit::new(QpType::Rc, &cq).depth(2, 2))
        .unwrap();
    for q in [&other, &qp] {
        q.to_init(ALL).unwrap();
    }
    other
        .post_recv(wr::recv(7, [mr.sge(0..8).unwrap()]))
        .unwrap();
    qp.post_recv(wr::recv(1, [mr.sge(0..8).unwrap()])).unwrap();
    qp.post_recv(wr::recv(2, [mr.sge(8..16).unwrap()])).unwrap();
    // In ERR the flushed receives are there to poll, in order.
    qp.to_error().unwrap();
    let wc = cq.poll_one().unwrap().expect("a flushed receive");
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::WrFlushErr));
    // On the way to RESET the one not polled goes; another QP's completions stay.
    other.to_error().unwrap();
    qp.reset().unwrap();
    let wc = cq
        .poll_one()
        .unwrap()
        .expect("the other QP's flushed receive");
    assert_eq!((wc.wr_id, wc.qp_num), (7, other.qpn()));
    assert!(cq.poll_one().unwrap().is_none());
}

fn rc_pair() -> (Side, Side) {
    support::pair_of(|| side(QpType::Rc, 64))
}

/// WRITE 64 bytes from `sge` to the peer, checked only by the device as on a NIC, and
/// return the completion.
fn write_from(a: &Side, b: &Side, sge: Sge) -> WorkCompletion {
    a.qp.post_send_unvalidated(wr::write(1, [sge], &b.mr.remote(), 0).unwrap())
        .unwrap();
    a.cq.wait(T).unwrap()
}

fn failed(status: WcStatus, detail: WcDetail) -> std::result::Result<(), WcError> {
    Err(WcError::new(status, detail))
}

#[test]
fn completion_errors_carry_their_detail() {
    use WcStatus::*;
    // A memory region of another PD of the same device.
    let (a, b) = rc_pair();
    let other = a.dev.alloc_pd().unwrap().register(64, ALL).unwrap();
    let wc = write_from(&a, &b, other.sge(0..64).unwrap());
    assert_eq!(wc.result(), failed(LocProtErr, WcDetail::WrongPd));
    assert_eq!(wc.vendor_err, 2);
    // An SGE reaching past its region's end.
    let (a, b) = rc_pair();
    let past_end = Sge {
        addr: a.mr.addr() + 8192 - 32,
        length: 64,
        lkey: a.mr.lkey(),
    };
    let wc = write_from(&a, &b, past_end);
    assert_eq!(wc.result(), failed(LocProtErr, WcDetail::SgeOutOfBounds));
    assert_eq!(wc.vendor_err, 3);
    // The lkey of a region deregistered (dropped) before the post.
    let (a, b) = rc_pair();
    let gone = a.pd.register(64, ALL).unwrap();
    let stale = gone.sge(0..64).unwrap();
    drop(gone);
    let wc = write_from(&a, &b, stale);
    assert_eq!(wc.result(), failed(LocProtErr, WcDetail::UnknownLkey));
    assert_eq!(wc.vendor_err, 1);
    let e = wc.result().unwrap_err();
    assert_eq!(
        e.to_string(),
        "local protection error (lkey of no registered memory region)"
    );
    // `?` turns it into an Error of kind Completion, whose source is the WcError.
    let err: Error = e.into();
    assert_eq!(err.kind(), ErrorKind::Completion);
    let src = std::error::Error::source(&err).and_then(|s| s.downcast_ref::<WcError>());
    assert_eq!(src, Some(&e));
    // A receive whose buffer fails the responder's check: the receiver's completion says
    // which check, the sender's what the peer answered.
    let (a, b) = rc_pair();
    let recv_past_end = Sge {
        addr: b.mr.addr() + 8192 - 8,
        length: 64,
        lkey: b.mr.lkey(),
    };
    b.qp.post_recv_unvalidated(wr::recv(7, [recv_past_end]))
        .unwrap();
    a.qp.post_send(wr::send(2, [a.mr.sge(0..32).unwrap()]))
        .unwrap();
    let rwc = b.cq.wait(T).unwrap();
    assert_eq!(rwc.wr_id, 7);
    assert_eq!(rwc.result(), failed(LocProtErr, WcDetail::SgeOutOfBounds));
    let swc = a.cq.wait(T).unwrap();
    assert_eq!(swc.result(), failed(RemOpErr, WcDetail::RemoteOperational));
    // Success has no error and no detail; flushed requests have no detail.
    let (a, b) = rc_pair();
    let ok = write_from(&a, &b, a.mr.sge(0..64).unwrap());
    assert_eq!((ok.result(), ok.vendor_err), (Ok(()), 0));
    let other = a.dev.alloc_pd().unwrap().register(64, ALL).unwrap();
    a.qp.post_send_unvalidated(
        wr::write(3, [other.sge(0..64).unwrap()], &b.mr.remote(), 0).unwrap(),
    )
    .unwrap();
    a.qp.post_send(wr::write(4, [a.mr.sge(0..64).unwrap()], &b.mr.remote(), 0).unwrap())
        .unwrap();
    let wcs = a.cq.wait_n(2, T).unwrap();
    assert_eq!(wcs[0].result(), failed(LocProtErr, WcDetail::WrongPd));
    assert_eq!(wcs[1].result(), failed(WrFlushErr, WcDetail::Unspecified));
    assert_eq!(
        WcStatus::WrFlushErr.to_string(),
        "Work Request Flushed Error"
    );
}

#[test]
fn the_ports_active_mtu_is_its_links() {
    let d = support::open("apimtu");
    let p = d.query_port(1).unwrap();
    // As rxe sets it from its netdev: loopback (65536 bytes unless lowered) gives 4096.
    let want = softrdma_device::netdev::roce_mtu_at(d.addr().ip()).unwrap_or(Mtu::Mtu1024);
    assert_eq!(p.active_mtu, want);
    assert_eq!(p.max_mtu, Mtu::Mtu4096);
    if std::fs::read_to_string("/sys/class/net/lo/mtu").is_ok_and(|s| s.trim() == "65536") {
        assert_eq!(p.active_mtu, Mtu::Mtu4096);
    }
    // set_port_mtu still lowers (and raises) it.
    d.set_port_mtu(Mtu::Mtu512).unwrap();
    assert_eq!(d.query_port(1).unwrap().active_mtu, Mtu::Mtu512);
}

#[test]
fn set_access_changes_what_peers_may_do_and_keeps_the_keys() {
    use WcStatus::*;
    let (a, b) = rc_pair();
    b.mr.write(0, &[5u8; 64]).unwrap();
    let (lkey, rkey) = (b.mr.lkey(), b.mr.rkey());
    // Refused changes leave the region as it was.
    let e = b.mr.set_access(Access::REMOTE_WRITE).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "{e}");
    assert_eq!(b.mr.access(), ALL);
    // Without REMOTE_WRITE, a peer's WRITE is a remote access error, and nothing lands.
    b.mr.set_access(Access::LOCAL_WRITE | Access::REMOTE_READ)
        .unwrap();
    assert_eq!(b.mr.access(), Access::LOCAL_WRITE | Access::REMOTE_READ);
    assert_eq!((b.mr.lkey(), b.mr.rkey()), (lkey, rkey));
    a.mr.write(0, &[9u8; 64]).unwrap();
    let wc = write_from(&a, &b, a.mr.sge(0..64).unwrap());
    assert_eq!(wc.result(), failed(RemAccessErr, WcDetail::RemoteAccess));
    assert_eq!(b.mr.to_vec(0, 64).unwrap(), vec![5u8; 64]);
    // Given back, the same rkey takes a WRITE again (the failed pair is in ERROR: a new
    // QP of b's PD, from a new peer).
    b.mr.set_access(ALL).unwrap();
    let d = side(QpType::Rc, 64);
    let cq2 = b.dev.create_cq(64, None).unwrap();
    let qp2 =
        b.pd.create_qp(&QpInit::new(QpType::Rc, &cq2).depth(32, 32))
            .unwrap();
    d.qp.connect_to(&qp2.endpoint(), ALL).unwrap();
    qp2.connect_to(&d.qp.endpoint(), ALL).unwrap();
    d.mr.write(0, &[7u8; 64]).unwrap();
    let wc = write_from(&d, &b, d.mr.sge(0..64).unwrap());
    assert_eq!(wc.result(), Ok(()));
    assert_eq!(b.mr.to_vec(0, 64).unwrap(), vec![7u8; 64]);
}

/// The PSNs a QP sends from come from the device's key generator, as its keys and QP
/// numbers do (DESIGN decision 7): a device opened with a seed draws the same ones again,
/// and a reset draws a new one from the same stream.
#[test]
fn first_psns_come_from_the_devices_key_generator() {
    let draws = || {
        let mut cfg = DeviceConfig::new("api-seed", DeviceAddr::AutoLoopback(4791));
        cfg.seed = Some(0x5eed);
        let dev = Device::open_with(&cfg).unwrap();
        let pd = dev.alloc_pd().unwrap();
        let cq = dev.create_cq(8, None).unwrap();
        let qp = pd
            .create_qp(&QpInit::new(QpType::Rc, &cq).depth(4, 4))
            .unwrap();
        let first = qp.endpoint();
        qp.to_init(ALL).unwrap();
        qp.reset().unwrap();
        (first.qpn, first.psn, qp.endpoint().psn)
    };
    let (qpn, psn, after_reset) = draws();
    assert_eq!(draws(), (qpn, psn, after_reset));
    assert!(psn <= 0xff_ffff && after_reset <= 0xff_ffff);
    assert_ne!(psn, after_reset, "a reset draws a new first PSN");
}

/// `wait_or` ends when the watched condition holds (here a peer's WRITE, which completes
/// nothing on its target), with completions when they come first, and at the timeout.
#[test]
fn wait_or_ends_on_the_condition_a_completion_or_the_timeout() {
    let (a, b) = rc_pair();
    let mut wcs = [WorkCompletion::default(); 4];
    let e =
        b.cq.wait_or(&mut wcs, Duration::from_millis(20), || false)
            .unwrap_err();
    assert!(e.is_timeout(), "{e}");
    a.mr.write(8, &[7]).unwrap();
    let w = wr::write(1, [a.mr.sge(8..9).unwrap()], &b.mr.remote(), 8).unwrap();
    a.qp.post_send(w).unwrap();
    let mut seen = [0u8];
    let n =
        b.cq.wait_or(&mut wcs, T, || {
            b.mr.read(8, &mut seen).unwrap();
            seen[0] == 7
        })
        .unwrap();
    assert_eq!((n, seen[0]), (0, 7));
    let n = a.cq.wait_or(&mut wcs, T, || false).unwrap();
    assert_eq!((n, wcs[0].opcode), (1, WcOpcode::RdmaWrite));
    assert!(b.cq.is_empty().unwrap());
}
