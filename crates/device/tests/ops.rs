//! The device's typed operations end their engine steps as their verbs need, whichever
//! face calls them: reads and object management leave the generation (waiters are not
//! woken), steps that may add completions or events move it.

mod rc;

use softrdma_device::verbs::{Access, Arm, QpAttr, QpAttrMask, QpState};

#[test]
fn reads_and_object_changes_wake_nobody_modifies_and_arms_do() {
    let h = rc::Host::new("ops", 4096, 0, 16, Access::LOCAL_WRITE);
    let dev = &h.dev;
    let qpn = h.rc_qp(4);
    let g = dev.generation();
    // Reads.
    assert_eq!(dev.query_qp(qpn).unwrap().qp_state, QpState::Reset);
    dev.qp_init_attr(qpn).unwrap();
    dev.port_attr(1).unwrap();
    dev.query_gid(0).unwrap();
    dev.cq_len(h.cq.cq()).unwrap();
    assert!(dev.read(|r| r.pd_exists(h.pd)));
    // Object management.
    let pd = dev.alloc_pd().unwrap();
    let (cq, _) = dev.create_cq(8, None, false).unwrap();
    dev.destroy_cq(cq).unwrap();
    dev.dealloc_pd(pd).unwrap();
    assert_eq!(
        dev.generation(),
        g,
        "a read or an object change woke waiters"
    );
    // A modify may flush work requests into a CQ: it moves the generation.
    let init = QpAttr {
        qp_state: QpState::Init,
        port_num: 1,
        ..Default::default()
    };
    let m =
        QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS;
    dev.modify_qp(qpn, &init, m).unwrap();
    let g2 = dev.generation();
    assert_ne!(g2, g, "a modify did not move the generation");
    // So may an arm (a CQ event at once).
    dev.req_notify_cq(h.cq.cq(), Arm::Next).unwrap();
    assert_ne!(dev.generation(), g2, "an arm did not move the generation");
}

/// An async event of a QP destroyed before the program read it goes with the QP, as the
/// kernel drops it: a program tearing down is never handed events of objects it no longer
/// has. Events of live objects stay.
#[test]
fn a_destroyed_qps_unread_events_go_with_it() {
    let h = rc::Host::new("ops-events", 4096, 0, 16, Access::LOCAL_WRITE);
    let dev = &h.dev;
    let (gone, kept) = (h.rc_qp(4), h.rc_qp(4));
    dev.objects(|r| {
        r.raise_qp_fatal(gone);
        r.raise_qp_fatal(kept);
    });
    dev.destroy_qp(gone).unwrap();
    assert_eq!(
        dev.next_async_event(),
        Some(softrdma_device::verbs::AsyncEvent::QpFatal(kept))
    );
    assert_eq!(dev.next_async_event(), None);
}
