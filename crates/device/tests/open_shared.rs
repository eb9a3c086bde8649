//! A device opened twice in one process is one device ([`Device::open_shared`]), what
//! both faces rely on; [`Device::open`] makes a NIC of its own.

use std::sync::Arc;

use softrdma_device::{Device, DeviceAddr, DeviceConfig};

fn cfg(name: &str) -> DeviceConfig {
    let mut cfg = DeviceConfig::new(name, DeviceAddr::AutoLoopback(4791));
    cfg.stats_dir = None;
    cfg
}

#[test]
fn opening_a_name_twice_gives_one_device() {
    let a = Device::open_shared(&cfg("shared-a")).unwrap();
    let b = Device::open_shared(&cfg("shared-a")).unwrap();
    assert!(Arc::ptr_eq(&a, &b));
    let other = Device::open_shared(&cfg("shared-b")).unwrap();
    assert!(!Arc::ptr_eq(&a, &other));
    assert_ne!(a.addr(), other.addr());
    // A private open is a NIC of its own, whatever its name.
    let private = Device::open(&cfg("shared-a")).unwrap();
    assert_ne!(private.addr(), a.addr());
    // Once every handle is gone the name opens a new device.
    let weak = Arc::downgrade(&a);
    drop((a, b));
    assert!(weak.upgrade().is_none(), "the table holds no device alive");
    let again = Device::open_shared(&cfg("shared-a")).unwrap();
    assert_eq!(again.name(), "shared-a");
}
