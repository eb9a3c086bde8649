//! Every open device publishes its counters to a stats file, and removes it when closed.

use std::net::UdpSocket;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[allow(dead_code)]
mod support;

use softrdma_device::statsfile::{self, Record};
use softrdma_device::{Device, DeviceAddr, DeviceConfig, DeviceStats};
use support::Collector;
use tracing_subscriber::layer::SubscriberExt;

/// A fresh directory of this test, so no other process's files are seen.
fn test_dir(what: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "softrdma-device-statsfile-{what}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// This process's record of device `name` in `dir`, once `ok` accepts it (bounded wait).
fn wait_record(dir: &Path, name: &str, ok: impl Fn(&Record) -> bool) -> Record {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let all = statsfile::read_all(dir, false).unwrap();
        if let Some(r) = all
            .iter()
            .find(|r| r.pid == std::process::id() && r.name == name && ok(r))
        {
            return r.clone();
        }
        assert!(
            Instant::now() < until,
            "no record of {name} in {dir:?}: {all:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn open_device_publishes_and_drop_removes() {
    let dir = test_dir("publish");
    // A UDP port no other test's device uses: the datagram counted below is the only
    // one that can reach this device (a stray one from another device at 4791 did).
    let mut cfg = DeviceConfig::new("statstest", DeviceAddr::AutoLoopback(24_817));
    cfg.stats_dir = Some(dir.clone());
    let dev = Device::open(&cfg).expect("open device");
    let file = dev.stats_file().expect("publishing").to_path_buf();
    assert_eq!(file.parent(), Some(dir.as_path()));
    assert_eq!(file.extension().and_then(|e| e.to_str()), Some("stats"));

    let r = wait_record(&dir, "statstest", |_| true);
    assert_eq!(r.addr, dev.addr().to_string());
    assert_eq!(r.gid, format!("::ffff:{}", dev.addr().ip()));
    let keys: Vec<&str> = r.counters.iter().map(|(k, _)| k.as_str()).collect();
    let want: Vec<&str> = statsfile::counters(&DeviceStats::default())
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(keys, want);
    let text = std::fs::read_to_string(&file).expect("stats file");
    assert_eq!(Record::parse(&text).as_ref(), Some(&r));

    // The file follows the counters: a datagram (not even a valid packet) is counted.
    let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
    sock.send_to(b"not a RoCE packet", dev.addr()).unwrap();
    let r = wait_record(&dir, "statstest", |r| {
        r.counter("udp_rx_datagrams").unwrap_or(0) >= 1
    });
    assert_eq!(r.counter("udp_rx_datagrams"), Some(1));
    assert_eq!(r.counter("udp_rx_bytes"), Some(17));

    drop(dev);
    assert!(!file.exists(), "{file:?} is removed when the device closes");
    assert!(statsfile::read_all(&dir, true).unwrap().is_empty());
    // No temporary file is left behind either.
    let left: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
    assert!(left.is_empty(), "{left:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn two_devices_of_one_name_have_their_own_files() {
    let dir = test_dir("two");
    let mut cfg = DeviceConfig::new("twin", DeviceAddr::AutoLoopback(4791));
    cfg.stats_dir = Some(dir.clone());
    let a = Device::open(&cfg).expect("open a");
    let b = Device::open(&cfg).expect("open b");
    assert_ne!(a.stats_file(), b.stats_file());
    let addr_b = b.addr().to_string();
    wait_record(&dir, "twin", |r| r.addr == addr_b);
    let addr_a = a.addr().to_string();
    wait_record(&dir, "twin", |r| r.addr == addr_a);
    drop(a);
    let left = statsfile::read_all(&dir, true).unwrap();
    assert_eq!(left.len(), 1, "{left:?}");
    assert_eq!(left[0].addr, addr_b);
    drop(b);
    assert!(statsfile::read_all(&dir, true).unwrap().is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn publishing_can_be_turned_off() {
    let mut cfg = DeviceConfig::new("quiet", DeviceAddr::AutoLoopback(4791));
    cfg.stats_dir = None;
    let dev = Device::open(&cfg).expect("open device");
    assert!(dev.stats_file().is_none());
}

/// The publisher of a device whose stats directory cannot be made says so, writes
/// nothing elsewhere, and publishes once the directory can be made (it tries again every
/// period), all while the device works.
#[test]
fn unwritable_directory_is_retried() {
    // This test's own subscriber sees the publisher's warning (the only one in this
    // binary that sets one).
    let collector = Collector::default();
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(collector.clone()))
        .unwrap();
    // A regular file where the directory's parent should be: making it fails.
    let dir = test_dir("blocked");
    std::fs::create_dir_all(&dir).unwrap();
    let blocker = dir.join("not-a-dir");
    std::fs::write(&blocker, "x").unwrap();
    let stats_dir = blocker.join("sub");
    let mut cfg = DeviceConfig::new("blocked", DeviceAddr::AutoLoopback(4791));
    cfg.stats_dir = Some(stats_dir.clone());
    let dev = Device::open(&cfg).expect("open device despite the directory");
    assert!(dev.stats_file().is_some());
    let until = Instant::now() + Duration::from_secs(10);
    while !collector
        .events()
        .iter()
        .any(|e| e.get("message") == Some("device counters not published"))
    {
        assert!(
            Instant::now() < until,
            "the refused directory was never reported"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(std::fs::read_to_string(&blocker).unwrap(), "x");
    let names: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
    assert_eq!(names.len(), 1, "{names:?}");
    // The way clear, a later period makes the directory and publishes there.
    std::fs::remove_file(&blocker).unwrap();
    let r = wait_record(&stats_dir, "blocked", |_| true);
    assert_eq!(r.addr, dev.addr().to_string());
    drop(dev);
    assert!(statsfile::read_all(&stats_dir, true).unwrap().is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}
