//! MADs between two devices over real loopback UDP: what one sends from QP1 lands in the
//! other's QP1 inbox, whose eventfd is readable exactly while MADs wait there.

use std::time::{Duration, Instant};

use softrdma_device::{poll_readable, Device, DeviceAddr, DeviceConfig, GsiMad};

const T: Duration = Duration::from_secs(10);

/// A device whose MADs the test takes, as a connection manager would.
fn open(name: &str) -> Device {
    let d = open_plain(name);
    d.set_mad_consumer(true);
    d
}

fn open_plain(name: &str) -> Device {
    let mut cfg = DeviceConfig::new(name, DeviceAddr::AutoLoopback(4791));
    cfg.stats_dir = None;
    Device::open(&cfg).expect("open device")
}

fn mad(tag: u8) -> [u8; 256] {
    std::array::from_fn(|i| (i as u8).wrapping_mul(13).wrapping_add(tag))
}

/// Whether the device's MAD fd polls readable right now.
fn fd_readable(d: &Device) -> bool {
    poll_readable(&[d.mad_fd()], Some(Duration::ZERO)).expect("poll")[0]
}

/// The next `n` MADs of `d`, waiting on its MAD fd for each (bounded).
fn take(d: &Device, n: usize) -> Vec<GsiMad> {
    let until = Instant::now() + T;
    let mut out = Vec::new();
    while out.len() < n {
        let left = until.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "only {} of {n} MADs arrived", out.len());
        if d.wait_mad(Some(left)).expect("wait") {
            out.extend(d.take_mad());
        }
    }
    out
}

#[test]
fn mads_cross_between_devices_and_the_fd_follows_the_inbox() {
    let a = open("gsi-a");
    let b = open("gsi-b");
    assert_ne!(a.addr().ip(), b.addr().ip());
    assert!(!fd_readable(&b));
    assert!(b.take_mad().is_none());

    let m = mad(1);
    a.send_mad(b.addr().ip(), 1, 0, &m);
    assert!(b.wait_mad(Some(T)).expect("wait"), "no MAD arrived");
    assert!(fd_readable(&b), "poll(2) on the fd sees it too");
    let got = b.take_mad().expect("the MAD");
    assert_eq!(got.src, a.addr().ip());
    assert_eq!((got.src_qpn, got.tos, got.pkey), (1, 0, 0xFFFF));
    assert_eq!(got.mad, m);
    assert!(!fd_readable(&b), "cleared once the inbox is empty");
    assert!(b.take_mad().is_none());

    // The answer goes back to where the MAD came from.
    let r = mad(2);
    b.send_mad(got.src, got.src_qpn, got.tos, &r);
    let back = take(&a, 1);
    assert_eq!((back[0].src, back[0].src_qpn), (b.addr().ip(), 1));
    assert_eq!(back[0].mad, r);

    // Several: they come in order, and the fd stays readable until the last is taken.
    let before = b.stats().engine.rx_packets;
    for k in 10..13 {
        a.send_mad(b.addr().ip(), 1, 0, &mad(k));
    }
    let until = Instant::now() + T;
    while b.stats().engine.rx_packets < before + 3 {
        assert!(Instant::now() < until, "the MADs did not arrive");
        std::thread::sleep(Duration::from_millis(1));
    }
    for k in 10..13 {
        assert!(fd_readable(&b), "MAD {k} waits");
        assert_eq!(b.take_mad().map(|g| g.mad), Some(mad(k)));
    }
    assert!(!fd_readable(&b));
    assert!(b.take_mad().is_none());

    let (sa, sb) = (a.stats().engine, b.stats().engine);
    assert_eq!((sa.gsi_dropped, sb.gsi_dropped), (0, 0));
    assert_eq!((sa.dropped, sb.dropped), (0, 0));
}

/// A device nobody runs a CM on answers a REQ with REJ "invalid service ID" and a DREQ
/// with its DREP (a peer is refused at once, as by a Linux host with nothing listening),
/// drops other MADs, keeps none of them, and counts them all; once a consumer takes the
/// MADs they queue again, and stopping it empties the inbox.
#[test]
fn a_device_without_a_cm_refuses_requests_itself() {
    use softrdma_wire::cm::{
        msg_response, private_len, rej_reason, CmAttr, CmMsg, Dreq, Ids, MadHeader, Rtu,
        MAD_HEADER_LEN, MAD_LEN,
    };
    let a = open("gsi-cm-a");
    let b = open_plain("gsi-cm-b");
    // A REQ as bytes: its header and the local communication ID; the rest parses as zeros.
    let mut req_mad = [0u8; MAD_LEN];
    MadHeader::cm(CmAttr::Req, 0xAB)
        .emit(&mut req_mad)
        .expect("header");
    req_mad[MAD_HEADER_LEN..][..4].copy_from_slice(&0x1234_5678u32.to_be_bytes());
    let dreq = CmMsg::Dreq(Box::new(Dreq {
        ids: Ids {
            local_comm_id: 0x55,
            remote_comm_id: 0x66,
            private_data: [0; private_len::DREQ],
        },
        remote_qpn: 0x12,
    }));
    a.send_mad(b.addr().ip(), 1, 0, &req_mad);
    let got = take(&a, 1);
    assert_eq!((got[0].src, got[0].src_qpn), (b.addr().ip(), 1));
    let (h, msg) = CmMsg::parse(&got[0].mad).expect("a CM message");
    assert_eq!(h.tid, 0xAB);
    let CmMsg::Rej(rej) = msg else {
        panic!("not a REJ: {msg:?}")
    };
    assert_eq!(rej.remote_comm_id, 0x1234_5678);
    assert_eq!(
        (rej.message_rejected, rej.reason),
        (msg_response::REQ, rej_reason::INVALID_SERVICE_ID)
    );

    a.send_mad(b.addr().ip(), 1, 0, &dreq.emit(0xCD));
    let (h, msg) = CmMsg::parse(&take(&a, 1)[0].mad).expect("a CM message");
    let CmMsg::Drep(drep) = msg else {
        panic!("not a DREP: {msg:?}")
    };
    assert_eq!(
        (h.tid, drep.local_comm_id, drep.remote_comm_id),
        (0xCD, 0x66, 0x55)
    );

    // An RTU needs no answer: it is dropped; nothing waits in b's inbox.
    let rtu = CmMsg::Rtu(Box::new(Rtu {
        local_comm_id: 1,
        remote_comm_id: 2,
        private_data: [0; private_len::RTU],
    }));
    a.send_mad(b.addr().ip(), 1, 0, &rtu.emit(1));
    let until = Instant::now() + T;
    while b.stats().engine.gsi_unserved < 3 {
        assert!(Instant::now() < until, "the RTU did not arrive");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(!fd_readable(&b));
    assert!(b.take_mad().is_none());
    assert!(a.take_mad().is_none(), "nothing answers an RTU");

    // With a consumer, the same REQ queues for it instead.
    b.set_mad_consumer(true);
    a.send_mad(b.addr().ip(), 1, 0, &req_mad);
    assert_eq!(take(&b, 1)[0].mad, req_mad);
    a.send_mad(b.addr().ip(), 1, 0, &req_mad);
    let until = Instant::now() + T;
    while !fd_readable(&b) {
        assert!(Instant::now() < until, "the REQ did not arrive");
        std::thread::sleep(Duration::from_millis(1));
    }
    b.set_mad_consumer(false);
    assert!(
        !fd_readable(&b),
        "a consumer that stops leaves no MAD behind"
    );
    assert!(b.take_mad().is_none());
    assert_eq!(b.stats().engine.gsi_unserved, 3);
    assert_eq!(b.stats().engine.gsi_dropped, 0);
}
