//! A program that installed its own global subscriber keeps it when `SOFTRDMA_LOG` is
//! set too, and gets the engine's events through it. Its own test binary, since the
//! environment and the global subscriber are per process.

mod support;

use softrdma_device::Rnic;
use support::Collector;
use tracing_subscriber::layer::SubscriberExt;

#[test]
fn own_subscriber_stays_and_gets_the_events() {
    let collector = Collector::default();
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(collector.clone()))
        .unwrap();
    std::env::set_var(softrdma_device::log::ENV_VAR, "trace");
    softrdma_device::log::init_from_env();

    let mut nic = Rnic::new("10.0.0.2:4791".parse().unwrap(), 1);
    // Shorter than a BTH and an ICRC.
    nic.handle_datagram(
        0,
        "10.0.0.1:49152".parse().unwrap(),
        "10.0.0.2:4791".parse().unwrap(),
        &[0u8; 8],
    );
    assert_eq!(nic.stats().malformed, 1);
    let evs = collector.events();
    let e = evs
        .iter()
        .find(|e| e.get("counter") == Some("malformed"))
        .unwrap_or_else(|| panic!("the program's subscriber saw only {evs:?}"));
    assert_eq!(e.level, tracing::Level::DEBUG);
    assert_eq!(e.target, "softrdma_transport::receive");
    assert_eq!(e.get("peer"), Some("10.0.0.1:49152"));
}
