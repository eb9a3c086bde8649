//! The engine's diagnostic events: real drops, a retry exhaustion and the QP state
//! changes each produce an event that names what happened.
//!
//! One test in this binary: a callsite first reached on another thread while no
//! subscriber is in scope can keep that "not interested" verdict, so a second test
//! driving the engine in parallel would make this one flaky.

mod rc;
mod support;

use std::net::SocketAddr;

use softrdma_device::verbs::{Access, Gid, SendFlags, SendOp, SendWr, Sge};
use softrdma_device::Rnic;
use support::{Collector, Ev};
use tracing::Level;
use tracing_subscriber::layer::SubscriberExt;

const PEER_QPN: u32 = 0x123;

/// A device at 10.0.0.1 with one RC QP in RTS towards QPN 0x123 at 10.0.0.2 (`retry_cnt`
/// 0: the first timeout fails it), its registered buffer, and that QP's number.
fn requester(buf: &mut [u8]) -> (Rnic, u32, Sge) {
    let addr: SocketAddr = "10.0.0.1:4791".parse().unwrap();
    let mut nic = Rnic::new(addr, 7);
    let pd = nic.alloc_pd().unwrap();
    let (cq, _) = nic.create_cq(16, None, false).unwrap();
    let ptr = buf.as_mut_ptr();
    // SAFETY: `buf` outlives the engine's use of it (the test's whole body).
    let mr = unsafe { nic.reg_mr(pd, ptr, buf.len(), ptr as u64, Access::LOCAL_WRITE) }.unwrap();
    let qpn = nic.create_qp(rc::rc_qp(pd, cq, 4)).unwrap();
    let cfg = rc::QpCfg {
        max_dest_rd_atomic: 1,
        max_rd_atomic: 1,
        retry_cnt: 0,
        rnr_retry: 0,
        ..rc::cfg()
    };
    let to = rc::Peer::at(Gid::from_ip("10.0.0.2".parse().unwrap()), PEER_QPN, 0);
    rc::connect(&mut nic, 0, qpn, &cfg, &to, 100);
    let sge = Sge {
        addr: ptr as u64,
        length: 64,
        lkey: mr.lkey,
    };
    (nic, qpn, sge)
}

fn find<'a>(evs: &'a [Ev], what: &str, f: impl Fn(&Ev) -> bool) -> &'a Ev {
    evs.iter()
        .find(|e| f(e))
        .unwrap_or_else(|| panic!("no event for {what} among {evs:#?}"))
}

#[test]
fn drops_timeouts_and_state_changes_are_logged() {
    let collector = Collector::default();
    let subscriber = tracing_subscriber::registry().with(collector.clone());
    let mut buf = vec![0u8; 4096];
    let receiver: SocketAddr = "10.0.0.2:4791".parse().unwrap();
    let (a_stats, b_stats) = tracing::subscriber::with_default(subscriber, || {
        let (mut a, qpn, sge) = requester(&mut buf);
        let wr = SendWr {
            wr_id: 1,
            op: SendOp::Send,
            flags: SendFlags::SIGNALED,
            sg_list: vec![sge],
            inline_data: None,
            ud: None,
        };
        a.post_send(0, qpn, wr).unwrap();
        let t = a.poll_transmit(0).expect("the SEND leaves at once");
        assert!(a.poll_transmit(0).is_none());

        // The receiving device has no QP 0x123: one datagram corrupted on the way (bad
        // ICRC), then the same datagram intact (unknown QP).
        let mut b = Rnic::new(receiver, 8);
        let mut bad = t.data.clone();
        let n = bad.len();
        bad[n - 8] ^= 0x40; // a payload byte: the ICRC no longer matches
        b.handle_datagram(0, t.src, t.dst, &bad);
        b.handle_datagram(0, t.src, t.dst, &t.data);

        // No ACK ever comes: the first ACK timeout exhausts retry_cnt 0.
        let deadline = a
            .poll_timeout()
            .expect("an RC SEND in flight arms the ACK timer");
        a.handle_timeout(deadline);
        (a.stats().clone(), b.stats().clone())
    });
    assert_eq!(b_stats.icrc_errors, 1);
    assert_eq!(b_stats.dropped, 1);
    assert_eq!(a_stats.timeouts, 1);

    let evs = collector.events();
    for e in &evs {
        assert!(
            e.target.starts_with("softrdma_transport"),
            "event outside the engine's targets: {e:?}"
        );
    }

    let icrc = find(&evs, "the bad ICRC", |e| {
        e.get("reason") == Some("bad ICRC")
    });
    assert_eq!(icrc.level, Level::DEBUG);
    assert_eq!(icrc.get("message"), Some("packet dropped"));
    assert_eq!(icrc.get("counter"), Some("icrc_errors"));
    assert!(icrc.get("peer").unwrap().starts_with("10.0.0.1:"));
    assert_eq!(icrc.get("qpn"), Some("0x123"));
    assert_eq!(icrc.get("psn"), Some("100"));
    assert_eq!(icrc.get("opcode"), Some("RC_SEND_ONLY"));

    let unknown = find(&evs, "the unknown QP", |e| {
        e.get("reason") == Some("unknown QP")
    });
    assert_eq!(unknown.level, Level::DEBUG);
    assert_eq!(unknown.get("counter"), Some("dropped"));
    assert_eq!(unknown.get("qpn"), Some("0x123"));
    assert_eq!(unknown.get("psn"), Some("100"));

    let timeout = find(&evs, "the ACK timeout", |e| {
        e.get("message") == Some("retransmission timeout")
    });
    assert_eq!(timeout.level, Level::DEBUG);
    assert_eq!(timeout.get("psn"), Some("100"));
    assert_eq!(timeout.get("retries_left"), Some("0"));

    let err = find(&evs, "the QP to ERROR", |e| {
        e.get("message") == Some("QP to ERROR")
    });
    assert_eq!(err.level, Level::WARN);
    assert_eq!(err.get("from"), Some("Rts"));
    assert_eq!(err.get("status"), Some("RetryExcErr"));
    assert_eq!(err.get("wr_id"), Some("1"));
    assert!(
        err.get("cause").unwrap().contains("retry count exceeded"),
        "{err:?}"
    );

    let changes: Vec<(&str, &str)> = evs
        .iter()
        .filter(|e| e.get("message") == Some("modify_qp"))
        .map(|e| (e.get("old").unwrap(), e.get("new").unwrap()))
        .collect();
    assert_eq!(
        changes,
        [("Reset", "Init"), ("Init", "Rtr"), ("Rtr", "Rts")],
        "state changes"
    );
}
