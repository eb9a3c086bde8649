//! Work requests keep the memory regions they name registered until their completion is
//! polled: a region whose handles are all dropped while a READ, a RECV or an SRQ receive
//! is outstanding still takes the bytes (Success, not LOC_PROT_ERR), and is deregistered
//! only once the completion that retires its request is polled, or its QP is destroyed.

use std::time::Duration;

use softrdma::*;

mod support;
use support::{connect, Side, ALL};

const T: Duration = Duration::from_secs(10);
const LEN: usize = 4096;

fn side_with(srq: Option<&SharedReceiveQueue>, dev: Device, pd: ProtectionDomain) -> Side {
    let cq = dev.create_cq(256, None).unwrap();
    let init = QpInit {
        srq,
        ..QpInit::new(QpType::Rc, &cq)
    };
    let qp = pd.create_qp(&init).unwrap();
    let mr = pd.register(LEN, ALL).unwrap();
    Side {
        dev,
        pd,
        cq,
        qp,
        mr,
    }
}

fn side() -> Side {
    let dev = support::open("wrmem");
    let pd = dev.alloc_pd().unwrap();
    side_with(None, dev, pd)
}

fn rc_pair() -> (Side, Side) {
    support::pair_of(side)
}

/// Memory of the test's own, registered raw, so that its bytes can be read after every
/// handle of the region is gone. Boxed: its address must not move.
struct Raw(Box<[u8]>);

impl Raw {
    fn new() -> Raw {
        Raw(vec![0u8; LEN].into_boxed_slice())
    }
    fn register(&mut self, pd: &ProtectionDomain) -> MemoryRegion {
        // SAFETY: the buffer outlives the region and every request naming it (each test
        // polls their completions, which deregister it, before reading the buffer), and
        // no reference to it is held while the device may write it.
        unsafe { pd.register_raw(self.0.as_mut_ptr(), LEN, ALL) }.unwrap()
    }
}

/// `stale` (an SGE of a region whose handles are gone) is refused at the post: the region
/// was deregistered.
fn deregistered(s: &Side, stale: Sge) {
    let e = s.qp.post_send(wr::send(99, [stale])).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
}

#[test]
fn a_read_into_a_dropped_region_completes_and_lands() {
    let (a, b) = rc_pair();
    b.mr.write(0, b"fetched by READ").unwrap();
    let mut raw = Raw::new();
    let mr = raw.register(&a.pd);
    let stale = mr.sge(0..15).unwrap();
    let w = wr::read(1, [mr.sge(0..15).unwrap()], &b.mr.remote(), 0).unwrap();
    a.qp.post_send(w).unwrap();
    drop(mr);
    // Before the completion is polled the READ holds the registration: an SGE copied
    // from the dropped handle still posts (a WRITE of the same bytes back to b).
    let again = wr::write(2, [stale], &b.mr.remote(), 100).unwrap();
    a.qp.post_send(again).unwrap();
    let wcs = a.cq.wait_n(2, T).unwrap();
    for wc in &wcs {
        assert_eq!(wc.result(), Ok(()), "{wc:?}");
    }
    // Polled: released, deregistered, and the bytes are the caller's to read.
    deregistered(&a, stale);
    assert_eq!(&raw.0[..15], b"fetched by READ");
}

#[test]
fn a_recv_into_a_dropped_region_receives() {
    let (a, b) = rc_pair();
    let mut raw = Raw::new();
    let mr = raw.register(&b.pd);
    let stale = mr.sge(0..64).unwrap();
    b.qp.post_recv(wr::recv(7, [mr.sge(0..64).unwrap()]))
        .unwrap();
    drop(mr);
    a.mr.write(0, b"into a dropped handle").unwrap();
    a.qp.post_send(wr::send(1, [a.mr.sge(0..21).unwrap()]))
        .unwrap();
    assert_eq!(a.cq.wait(T).unwrap().result(), Ok(()));
    let wc = b.cq.wait(T).unwrap();
    assert_eq!((wc.wr_id, wc.byte_len, wc.result()), (7, 21, Ok(())));
    deregistered(&b, stale);
    assert_eq!(&raw.0[..21], b"into a dropped handle");
}

#[test]
fn an_srq_receive_into_a_dropped_region_receives() {
    let dev = support::open("wrmem");
    let pd = dev.alloc_pd().unwrap();
    let srq = pd.create_srq(16, 1).unwrap();
    let b = side_with(Some(&srq), dev, pd);
    let a = side();
    connect(&a, &b);
    let mut raw = Raw::new();
    let mr = raw.register(&b.pd);
    let stale = mr.sge(0..64).unwrap();
    // Two receives with one wr_id: released together, once both completed.
    srq.post_recv(wr::recv(5, [mr.sge(0..32).unwrap()]))
        .unwrap();
    srq.post_recv(wr::recv(5, [mr.sge(32..64).unwrap()]))
        .unwrap();
    drop(mr);
    for (i, m) in [b"first", b"secnd"].iter().enumerate() {
        a.mr.write(0, *m).unwrap();
        a.qp.post_send(wr::send(i as u64, [a.mr.sge(0..5).unwrap()]))
            .unwrap();
        assert_eq!(a.cq.wait(T).unwrap().result(), Ok(()));
        let wc = b.cq.wait(T).unwrap();
        assert_eq!((wc.wr_id, wc.byte_len, wc.result()), (5, 5, Ok(())));
        if i == 0 {
            // One of the two is still posted and holds the region.
            let w = wr::write(8, [stale], &a.mr.remote(), 1024).unwrap();
            b.qp.post_send(w).unwrap();
            assert_eq!(b.cq.wait(T).unwrap().result(), Ok(()));
        }
    }
    deregistered(&b, stale);
    assert_eq!(&raw.0[..5], b"first");
    assert_eq!(&raw.0[32..37], b"secnd");
}

#[test]
fn a_signaled_send_retires_the_unsignaled_ones_before_it() {
    let (a, b) = rc_pair();
    let first = a.pd.register(LEN, ALL).unwrap();
    first.write(0, b"unsignaled").unwrap();
    let stale = first.sge(0..10).unwrap();
    let mut w = wr::write(1, [first.sge(0..10).unwrap()], &b.mr.remote(), 0).unwrap();
    w.flags = SendFlags::empty();
    a.qp.post_send(w).unwrap();
    drop(first);
    let w = wr::write(2, [a.mr.sge(0..4).unwrap()], &b.mr.remote(), 64).unwrap();
    a.qp.post_send(w).unwrap();
    let wc = a.cq.wait(T).unwrap();
    assert_eq!((wc.wr_id, wc.result()), (2, Ok(())));
    deregistered(&a, stale);
    assert_eq!(b.mr.to_vec(0, 10).unwrap(), b"unsignaled");
}

#[test]
fn flushes_and_destroyed_qps_release_their_regions() {
    let (a, b) = rc_pair();
    // Flushed in ERROR: released when the flush completion is polled.
    let mr = b.pd.register(LEN, ALL).unwrap();
    let stale = mr.sge(0..64).unwrap();
    b.qp.post_recv(wr::recv(3, [mr.sge(0..64).unwrap()]))
        .unwrap();
    drop(mr);
    b.qp.to_error().unwrap();
    let wc = b.cq.wait(T).unwrap();
    assert_eq!((wc.wr_id, wc.status), (3, WcStatus::WrFlushErr));
    b.qp.reset().unwrap();
    b.qp.to_init(ALL).unwrap();
    let e = b.qp.post_recv(wr::recv(4, [stale])).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    // Flushed and cleaned out of the CQ by a reset, never polled: released all the same.
    let mr = b.pd.register(LEN, ALL).unwrap();
    let stale = mr.sge(0..64).unwrap();
    b.qp.post_recv(wr::recv(5, [mr.sge(0..64).unwrap()]))
        .unwrap();
    drop(mr);
    b.qp.reset().unwrap();
    assert!(b.cq.is_empty().unwrap());
    b.qp.to_init(ALL).unwrap();
    let e = b.qp.post_recv(wr::recv(6, [stale])).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    drop(a);
    // Outstanding when the QP is dropped: released with it.
    let c = side();
    let other = c.pd.create_qp(&QpInit::new(QpType::Rc, &c.cq)).unwrap();
    let mr = c.pd.register(LEN, ALL).unwrap();
    let stale = mr.sge(0..64).unwrap();
    c.qp.to_init(ALL).unwrap();
    c.qp.post_recv(wr::recv(4, [mr.sge(0..64).unwrap()]))
        .unwrap();
    drop(mr);
    let Side { qp, .. } = c;
    drop(qp);
    other.to_init(ALL).unwrap();
    let e = other.post_recv(wr::recv(5, [stale])).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
}

#[test]
fn a_region_is_shared_by_its_clones() {
    let s = side();
    let view = s.mr.clone();
    s.mr.write(0, b"shared").unwrap();
    assert_eq!(view.lkey(), s.mr.lkey());
    // Not the last handle: into_vec copies and leaves the registration to the others.
    assert_eq!(&view.into_vec().unwrap()[..6], b"shared");
    assert_eq!(s.mr.to_vec(0, 6).unwrap(), b"shared");
    s.qp.to_init(ALL).unwrap();
    s.qp.post_recv(wr::recv(1, [s.mr.sge(0..8).unwrap()]))
        .unwrap();
}

/// A region a memory window is bound to stays registered after its last handle is
/// dropped, and a peer reaches it through the window, until the window is dropped; then
/// it is deregistered: a peer's WRITE with the region's rkey is refused, and its lkey at a
/// post. (The verbs refuse to deregister a region a window is bound to: without the
/// window keeping it, the region would stay registered for good.)
#[test]
fn a_bound_window_keeps_its_region_until_the_window_goes() {
    let (a, b) = rc_pair();
    let mut raw = Raw::new();
    // SAFETY: as in `Raw::register`; the buffer is read only once the region is gone.
    let mr = unsafe {
        b.pd.register_raw(raw.0.as_mut_ptr(), LEN, ALL | Access::MW_BIND)
    }
    .unwrap();
    let (stale, region) = (mr.sge(0..8).unwrap(), mr.remote());
    let mw = b.pd.alloc_mw(2).unwrap();
    let old = mw.rkey().unwrap();
    let rkey = (old & !0xff) | (old.wrapping_add(1) & 0xff);
    let bind = SendWr {
        wr_id: 5,
        op: SendOp::BindMw(MwBind {
            mw: mw.id(),
            rkey,
            mr_lkey: mr.lkey(),
            addr: mr.addr(),
            length: LEN as u64,
            access: Access::REMOTE_WRITE,
        }),
        flags: SendFlags::SIGNALED,
        sg_list: vec![],
        inline_data: None,
        ud: None,
    };
    b.qp.post_send(bind).unwrap();
    assert_eq!(b.cq.wait(T).unwrap().result(), Ok(()));
    drop(mr);
    let window = RemoteMemory { rkey, ..region };
    a.mr.write(0, b"through the window").unwrap();
    let w = wr::write(1, [a.mr.sge(0..18).unwrap()], &window, 0).unwrap();
    a.qp.post_send(w).unwrap();
    assert_eq!(a.cq.wait(T).unwrap().result(), Ok(()));
    drop(mw);
    deregistered(&b, stale);
    let w = wr::write(2, [a.mr.sge(0..4).unwrap()], &region, 100).unwrap();
    a.qp.post_send(w).unwrap();
    let wc = a.cq.wait(T).unwrap();
    assert_eq!(wc.status, WcStatus::RemAccessErr, "{wc:?}");
    assert_eq!(&raw.0[..18], b"through the window");
    assert_eq!(
        &raw.0[100..104],
        [0; 4],
        "nothing written after deregistration"
    );
}
