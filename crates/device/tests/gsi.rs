//! MADs between two devices over real loopback UDP: what one sends from QP1 lands in the
//! other's QP1 inbox, whose eventfd is readable exactly while MADs wait there.

use std::time::{Duration, Instant};

use softrdma_device::{poll_readable, Device, DeviceAddr, DeviceConfig, GsiMad};

const T: Duration = Duration::from_secs(10);

fn open(name: &str) -> Device {
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
