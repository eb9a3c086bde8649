//! Misuse the API can see is refused at the call, with an error kind to match on, and
//! leaves the QP usable: SGE and remote ranges, the lkeys and PDs of every post, CQ depth
//! against the queues reporting into it; a QP in ERROR is reset and connected again.

use std::time::Duration;

use softrdma::*;

mod support;
use support::{connect, Side, ALL};

const T: Duration = Duration::from_secs(10);
const LEN: usize = 8192;

fn side() -> Side {
    let dev = support::open("misuse");
    let pd = dev.alloc_pd().unwrap();
    let cq = dev.create_cq(128, None).unwrap();
    let qp = pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap();
    let mr = pd.register(LEN, ALL).unwrap();
    Side {
        dev,
        pd,
        cq,
        qp,
        mr,
    }
}

fn rc_pair() -> (Side, Side) {
    support::pair_of(side)
}

fn kind<T: std::fmt::Debug>(r: Result<T>) -> ErrorKind {
    r.expect_err("the misuse is refused").kind()
}

/// The QP is still connected and moves data: WRITE `data` from `a` into `b` at `at`, and
/// the bytes arrive.
fn still_works(a: &Side, b: &Side, at: usize, data: &[u8]) {
    assert_eq!(a.qp.state().unwrap(), QpState::Rts);
    assert!(a.cq.is_empty().unwrap(), "a refused post completes nothing");
    a.mr.write(0, data).unwrap();
    let w = wr::write(
        9,
        [a.mr.sge(..data.len()).unwrap()],
        &b.mr.remote(),
        at as u64,
    );
    a.qp.post_send(w.unwrap()).unwrap();
    let wc = a.cq.wait(T).unwrap();
    assert_eq!((wc.wr_id, wc.result()), (9, Ok(())));
    assert_eq!(b.mr.to_vec(at, data.len()).unwrap(), data);
}

#[test]
fn sge_ranges_are_checked_like_slices() {
    let s = side();
    let mr = &s.mr;
    for (sge, want) in [
        (mr.sge(..), Some((0, LEN))),
        (mr.sge(..=LEN - 1), Some((0, LEN))),
        (mr.sge(LEN - 8..), Some((LEN - 8, 8))),
        (mr.sge(LEN..), Some((LEN, 0))),
        (mr.sge(0..LEN + 1), None),
        (mr.sge(..=LEN), None),
        (mr.sge(LEN + 1..), None),
        (mr.sge(std::ops::Range { start: 10, end: 5 }), None), // ends before it starts
        (mr.sge(usize::MAX..), None),
    ] {
        match (sge, want) {
            (Ok(sge), Some((at, n))) => {
                assert_eq!(sge.addr, mr.addr() + at as u64);
                assert_eq!(sge.length as usize, n);
                assert_eq!(sge.lkey, mr.lkey());
            }
            (Err(e), None) => {
                assert_eq!(e.kind(), ErrorKind::OutOfBounds, "{e}");
                assert_eq!(e.errno(), 14, "EFAULT, as the C face's range errors: {e}");
            }
            (got, want) => panic!("got {got:?}, expected {want:?}"),
        }
    }
}

#[test]
fn remote_ranges_are_checked_when_the_request_is_built() {
    let (a, b) = rc_pair();
    let remote = b.mr.remote();
    let sg = |n: usize| [a.mr.sge(..n).unwrap()];
    // Past the end of the peer's memory, by offset or by length.
    assert_eq!(
        kind(wr::write(1, sg(64), &remote, LEN as u64 - 32)),
        ErrorKind::OutOfBounds
    );
    assert_eq!(
        kind(wr::read(1, sg(64), &remote, LEN as u64)),
        ErrorKind::OutOfBounds
    );
    assert_eq!(
        kind(wr::write_with_imm(1, sg(64), &remote, u64::MAX, 5)),
        ErrorKind::OutOfBounds
    );
    // Several SGEs together longer than the remote memory.
    let two = [a.mr.sge(..LEN).unwrap(), a.mr.sge(..1).unwrap()];
    assert_eq!(kind(wr::write(1, two, &remote, 0)), ErrorKind::OutOfBounds);
    // A window into the peer's region is its own descriptor.
    let window = RemoteMemory {
        addr: remote.addr + 64,
        len: 64,
        ..remote
    };
    assert_eq!(
        kind(wr::read(1, sg(65), &window, 0)),
        ErrorKind::OutOfBounds
    );
    assert!(wr::read(1, sg(64), &window, 0).is_ok());
    assert!(wr::write(1, sg(0), &window, 64).is_ok(), "empty at the end");
    // Atomics: the word inside the descriptor and 8-byte aligned.
    let res = a.mr.sge(64..72).unwrap();
    assert_eq!(
        kind(wr::fetch_add(1, res, &remote, 4, 1)),
        ErrorKind::Misaligned
    );
    assert_eq!(
        kind(wr::compare_swap(1, res, &remote, LEN as u64 - 4, 0, 1)),
        ErrorKind::OutOfBounds
    );
    assert_eq!(
        kind(wr::fetch_add(1, res, &window, 64, 1)),
        ErrorKind::OutOfBounds
    );
    assert_eq!(remote.checked_at(8, 8).unwrap(), remote.addr + 8);
    // The last word is in reach, and the QP was never touched by the refusals.
    b.mr.write_u64(LEN - 8, 41).unwrap();
    a.qp.post_send(wr::fetch_add(2, res, &remote, LEN as u64 - 8, 1).unwrap())
        .unwrap();
    let wc = a.cq.wait(T).unwrap();
    assert_eq!((wc.wr_id, wc.result()), (2, Ok(())));
    assert_eq!(b.mr.read_u64(LEN - 8).unwrap(), 42);
    still_works(&a, &b, 128, b"still connected after the refusals");
}

#[test]
fn every_post_checks_its_sges() {
    let (a, b) = rc_pair();
    let remote = b.mr.remote();
    // A region of another PD of the same device.
    let foreign = a.dev.alloc_pd().unwrap().register(64, ALL).unwrap();
    let w = wr::write(1, [foreign.sge(..).unwrap()], &remote, 0).unwrap();
    let e = a.qp.post_send(w).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ForeignObject, "{e}");
    // The lkey of a region dropped since the SGE was made.
    let gone = a.pd.register(64, ALL).unwrap();
    let stale = gone.sge(..).unwrap();
    drop(gone);
    let e = a.qp.post_send(wr::send(1, [stale])).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    // An SGE made by hand that reaches past its region; the bad one is the second.
    let past_end = Sge {
        addr: a.mr.addr() + LEN as u64 - 32,
        length: 64,
        lkey: a.mr.lkey(),
    };
    let w = wr::write(1, [a.mr.sge(..8).unwrap(), past_end], &remote, 0).unwrap();
    let e = a.qp.post_send(w).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfBounds, "{e}");
    // A READ lands in memory the device may not write.
    let read_only = a.pd.register(64, Access::empty()).unwrap();
    let w = wr::read(1, [read_only.sge(..).unwrap()], &remote, 0).unwrap();
    assert_eq!(kind(a.qp.post_send(w)), ErrorKind::PermissionDenied);
    // ... which a WRITE may read from.
    let w = wr::write(3, [read_only.sge(..).unwrap()], &remote, 0).unwrap();
    a.qp.post_send(w).unwrap();
    assert_eq!(a.cq.wait(T).unwrap().result(), Ok(()));
    // Receives: the device writes them.
    let b_foreign = b.dev.alloc_pd().unwrap().register(64, ALL).unwrap();
    let e =
        b.qp.post_recv(wr::recv(1, [b_foreign.sge(..).unwrap()]))
            .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ForeignObject, "{e}");
    let recv_past_end = Sge {
        addr: b.mr.addr() + LEN as u64 - 8,
        length: 64,
        lkey: b.mr.lkey(),
    };
    let e = b.qp.post_recv(wr::recv(1, [recv_past_end])).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfBounds, "{e}");
    let b_read_only = b.pd.register(64, Access::empty()).unwrap();
    let e =
        b.qp.post_recv(wr::recv(1, [b_read_only.sge(..).unwrap()]))
            .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{e}");
    // Zero-length SGEs name no memory.
    let empty = Sge {
        addr: 0,
        length: 0,
        lkey: 0xdead_beef,
    };
    b.qp.post_recv(wr::recv(5, [b.mr.sge(..64).unwrap(), empty]))
        .unwrap();
    // Nothing was queued and both QPs are connected: a SEND meets the one good receive.
    assert!(b.cq.is_empty().unwrap());
    a.mr.write(0, b"hello").unwrap();
    a.qp.post_send(wr::send(4, [a.mr.sge(..5).unwrap()]))
        .unwrap();
    let wc = b.cq.wait(T).unwrap();
    assert_eq!((wc.wr_id, wc.result(), wc.byte_len), (5, Ok(()), 5));
    assert_eq!(b.mr.to_vec(0, 5).unwrap(), b"hello");
    assert_eq!(a.cq.wait(T).unwrap().wr_id, 4);
    still_works(&a, &b, 256, b"every post was checked");
}

#[test]
fn srq_receives_are_checked_against_its_pd() {
    let dev = support::open("misuse");
    let pd = dev.alloc_pd().unwrap();
    let srq = pd.create_srq(8, 1).unwrap();
    let mine = pd.register(64, ALL).unwrap();
    let theirs = dev.alloc_pd().unwrap().register(64, ALL).unwrap();
    let e = srq
        .post_recv(wr::recv(1, [theirs.sge(..).unwrap()]))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ForeignObject, "{e}");
    srq.post_recv(wr::recv(2, [mine.sge(..).unwrap()])).unwrap();
    srq.post_recv_unvalidated(wr::recv(3, [theirs.sge(..).unwrap()]))
        .unwrap();
    assert_eq!(srq.len().unwrap(), 2);
}

#[test]
fn cq_depth_is_checked_against_the_queues_reporting_into_it() {
    let dev = support::open("misuse");
    let pd = dev.alloc_pd().unwrap();
    // One CQ for both queues: 64 + 64 fill 128 entries.
    let cq = dev.create_cq(128, None).unwrap();
    let q1 = pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap();
    let e = pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert_eq!(e.errno(), 22);
    drop(q1);
    let q2 = pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap();
    drop(q2);
    // A small CQ takes a QP sized for it, and the refused QP was destroyed.
    let small = dev.create_cq(2, None).unwrap();
    let e = pd.create_qp(&QpInit::new(QpType::Rc, &small)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    let _q3 = pd
        .create_qp(&QpInit::new(QpType::Rc, &small).depth(1, 1))
        .unwrap();
    // Separate CQs: each counts only its side.
    let (send_cq, recv_cq) = (
        dev.create_cq(64, None).unwrap(),
        dev.create_cq(96, None).unwrap(),
    );
    let split = |send: u32, recv: u32| QpInit {
        send_cq: &send_cq,
        recv_cq: &recv_cq,
        ..QpInit::new(QpType::Rc, &send_cq).depth(send, recv)
    };
    let _q4 = pd.create_qp(&split(32, 64)).unwrap();
    let _q5 = pd.create_qp(&split(32, 32)).unwrap();
    assert_eq!(
        pd.create_qp(&split(1, 0)).unwrap_err().kind(),
        ErrorKind::InvalidArgument,
        "the send CQ is full"
    );
    // QPs on an SRQ: its max_wr counts once against their receive CQ.
    let srq = pd.create_srq(32, 1).unwrap();
    let cq = dev.create_cq(64, None).unwrap();
    let on_srq = || {
        let mut init = QpInit::new(QpType::Rc, &cq).depth(8, 0);
        init.srq = Some(&srq);
        pd.create_qp(&init)
    };
    let qps: Vec<QueuePair> = (0..4).map(|_| on_srq().unwrap()).collect(); // 32 + 4 × 8
    assert_eq!(on_srq().unwrap_err().kind(), ErrorKind::InvalidArgument);
    // Growing the SRQ must still fit the CQ.
    let e = srq.modify(Some(40), None).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert_eq!(
        srq.query().unwrap().0,
        32,
        "the refused growth did not happen"
    );
    drop(qps);
    srq.modify(Some(40), None).unwrap();
    let _q6 = on_srq().unwrap(); // 40 + 8
}

#[test]
fn a_qp_in_error_is_reset_and_connected_again() {
    let (a, b) = rc_pair();
    // A WRITE the peer refuses (an rkey it never gave) sends both QPs to ERROR.
    let bad = RemoteMemory {
        rkey: b.mr.rkey() ^ 0x5a5a_5a00,
        ..b.mr.remote()
    };
    b.qp.post_recv(wr::recv(70, [b.mr.sge(..64).unwrap()]))
        .unwrap();
    let w = wr::write(1, [a.mr.sge(..64).unwrap()], &bad, 0).unwrap();
    a.qp.post_send(w).unwrap();
    let wc = a.cq.wait(T).unwrap();
    assert_eq!(wc.status, WcStatus::RemAccessErr);
    assert_eq!(a.qp.state().unwrap(), QpState::Err);
    // Connecting again without a reset is no transition of the state machine.
    let e = a.qp.connect_to(&b.qp.endpoint(), ALL).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidTransition, "{e}");
    // In ERROR b's receive completes (flushed), it does not vanish; then both reset.
    let flushed = b.cq.wait(T).unwrap();
    assert_eq!((flushed.wr_id, flushed.status), (70, WcStatus::WrFlushErr));
    a.qp.reset().unwrap();
    b.qp.reset().unwrap();
    assert_eq!(a.qp.state().unwrap(), QpState::Reset);
    assert_eq!(b.qp.state().unwrap(), QpState::Reset);
    assert!(a.cq.is_empty().unwrap());
    // Connected again (reset chose new PSNs): WRITE and SEND move data both ways.
    connect(&a, &b);
    still_works(&a, &b, 512, b"after the reset");
    a.qp.post_recv(wr::recv(80, [a.mr.sge(1024..1088).unwrap()]))
        .unwrap();
    b.mr.write(2048, b"and back").unwrap();
    b.qp.post_send(wr::send(81, [b.mr.sge(2048..2056).unwrap()]))
        .unwrap();
    assert_eq!(b.cq.wait(T).unwrap().result(), Ok(()));
    let wc = a.cq.wait(T).unwrap();
    assert_eq!((wc.wr_id, wc.result(), wc.byte_len), (80, Ok(()), 8));
    assert_eq!(a.mr.to_vec(1024, 8).unwrap(), b"and back");
    // Reset from RTS goes through ERROR, which flushes the posted receive; its
    // completion is cleaned out of the CQ with the QP's others, as on a NIC.
    a.qp.post_recv(wr::recv(90, [a.mr.sge(..64).unwrap()]))
        .unwrap();
    a.qp.reset().unwrap();
    assert_eq!(a.qp.state().unwrap(), QpState::Reset);
    assert!(a.cq.is_empty().unwrap());
}
