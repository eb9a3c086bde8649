//! UD multicast over the sim network: attached QPs on every device get a copy of a SEND to
//! the group, others none; Q_Key and state are checked per QP; detach stops delivery; the
//! datagram on the wire is a RoCEv2 multicast UD SEND (DQPN 0xFFFFFF to the group's IP,
//! ICRC sealed for it).

use common::*;
use softrdma_testkit as common;
use std::net::SocketAddr;

const LW: Access = Access::LOCAL_WRITE;
/// The group of these tests, 239.1.2.3, and its MGID ::ffff:239.1.2.3.
const GROUP: [u8; 4] = [239, 1, 2, 3];
/// Receive buffer: a GRH and up to 256 bytes.
const SLOT: usize = 40 + 256;

fn mgid() -> Gid {
    Gid::from_ipv4(GROUP.into())
}

/// An address handle to the group on device `d`.
fn group_ah(w: &mut World, d: usize, pd: PdId) -> AhId {
    let mut av = w.av(0);
    av.grh.dgid = mgid();
    w.nic(d).create_ah(pd, &av).expect("create_ah to the group")
}

/// A UD SEND of `len` bytes of `src` to the group.
fn to_group(id: u64, src: &Mr, len: usize, ah: AhId, qkey: u32) -> SendWr {
    let mut s = wr(id, SendOp::Send, sgl(src, 0, len));
    s.ud = Some(UdDest {
        ah,
        remote_qpn: wire::MULTICAST_QPN,
        remote_qkey: qkey,
    });
    s
}

/// A ready UD QP on device `d` with a receive buffer, a receive posted, attached to the
/// group when `attach`.
fn member(w: &mut World, d: usize, cfg: &QpCfg, attach: bool) -> (Ep, Mr) {
    let ep = w.new_ep(d, cfg);
    w.ud_ready(&ep, cfg, 0);
    let buf = w.mr(d, ep.pd, SLOT, LW, 0xEE);
    w.post_recv(&ep, rwr(7, vec![buf.sge(0, SLOT)]));
    if attach {
        w.nic(d)
            .attach_mcast(ep.qpn, mgid(), 0)
            .expect("attach_mcast");
    }
    (ep, buf)
}

#[test]
fn every_attached_qp_on_every_device_gets_a_copy() {
    let mut w = World::new(3, 71, Faults::default());
    let cfg = QpCfg::ud();
    let s = w.new_ep(0, &cfg);
    w.ud_ready(&s, &cfg, 0x10);
    // The sender's own device has a member too: it gets the copy its host loops back.
    let own = member(&mut w, 0, &cfg, true);
    let b1 = member(&mut w, 1, &cfg, true);
    let b2 = member(&mut w, 1, &cfg, true);
    let c1 = member(&mut w, 2, &cfg, true);
    let outsider = member(&mut w, 2, &cfg, false);
    let ah = group_ah(&mut w, 0, s.pd);
    let src = w.mr(0, s.pd, 256, LW, 0);
    let data = pattern(5, 200);
    src.write(0, &data);
    w.post_send(&s, to_group(1, &src, data.len(), ah, cfg.qkey));
    check_send_wc(
        &w.expect_wc(0, s.scq),
        &send_wc(&s, 1, WcOpcode::Send, data.len()),
        "multicast sender",
    );
    for (name, (ep, buf)) in [("own", &own), ("b1", &b1), ("b2", &b2), ("c1", &c1)] {
        let r = w.expect_wc(ep.dev, ep.rcq);
        assert_eq!(r.status, WcStatus::Success, "{name}: {r:?}");
        assert_eq!(
            (r.wr_id, r.qp_num, r.src_qp, r.byte_len),
            (7, ep.qpn, s.qpn, 40 + data.len() as u32),
            "{name}: {r:?}"
        );
        assert!(r.wc_flags.contains(WcFlags::GRH), "{name}");
        assert_eq!(buf.read(40, data.len()), data, "{name}: payload");
        // The GRH is the IPv4 header: from the sender's device to the group.
        let ip = buf.read(20, 20);
        assert_eq!(&ip[12..16], &[10, 0, 0, 1], "{name}: source");
        assert_eq!(&ip[16..20], &GROUP, "{name}: destination is the group");
    }
    w.expect_no_wc(2, outsider.0.rcq, "a QP that is not attached");
    assert_eq!(
        w.stats(2).dropped,
        0,
        "nothing dropped where a member got it"
    );
}

#[test]
fn the_datagram_is_a_multicast_ud_send_with_a_good_icrc() {
    let mut w = World::two(72);
    let cfg = QpCfg::ud();
    let s = w.new_ep(0, &cfg);
    w.ud_ready(&s, &cfg, 0x77);
    let _m = member(&mut w, 1, &cfg, true);
    let ah = group_ah(&mut w, 0, s.pd);
    let src = w.mr(0, s.pd, 64, LW, 0x5A);
    w.capture(0);
    w.post_send(&s, to_group(1, &src, 33, ah, cfg.qkey));
    w.settle();
    let sent: Vec<Cap> = w
        .take_log(0)
        .into_iter()
        .filter(|c| c.dir == Dir::Tx)
        .collect();
    assert_eq!(sent.len(), 1, "{sent:?}");
    let p = &sent[0].pkt;
    assert_eq!(p.dst, SocketAddr::from((GROUP, 4791)), "to the group's IP");
    assert_eq!(p.src.ip(), dev_addr(0).ip());
    let addrs = wire::Addrs::new(p.src, p.dst);
    assert!(
        wire::icrc::verify(&addrs, &p.data),
        "ICRC sealed for the group"
    );
    let (h, payload) = wire::Headers::parse(&p.data).expect("parses");
    assert_eq!(h.bth.opcode, wire::Opcode::UD_SEND_ONLY);
    assert_eq!(h.bth.dest_qp, wire::MULTICAST_QPN);
    let deth = h.deth.expect("a DETH");
    assert_eq!((deth.qkey, deth.src_qp), (cfg.qkey, s.qpn));
    assert_eq!(payload, &[0x5A; 33][..]);
}

#[test]
fn q_key_and_state_are_checked_per_qp() {
    let mut w = World::two(73);
    let cfg = QpCfg::ud();
    let s = w.new_ep(0, &cfg);
    w.ud_ready(&s, &cfg, 0);
    let good = member(&mut w, 1, &cfg, true);
    let other_key = QpCfg {
        qkey: 0x0BAD_0BAD,
        ..cfg
    };
    let wrong_key = member(&mut w, 1, &other_key, true);
    // Attached in INIT: not ready to receive yet.
    let early = w.new_ep(1, &cfg);
    w.modify_to_init(&early, &cfg);
    let early_buf = w.mr(1, early.pd, SLOT, LW, 0xEE);
    w.post_recv(&early, rwr(9, vec![early_buf.sge(0, SLOT)]));
    w.nic(1).attach_mcast(early.qpn, mgid(), 0).unwrap();
    let ah = group_ah(&mut w, 0, s.pd);
    let src = w.mr(0, s.pd, 64, LW, 0x11);
    let dropped = w.stats(1).dropped;
    w.post_send(&s, to_group(1, &src, 16, ah, cfg.qkey));
    let r = w.expect_wc(1, good.0.rcq);
    assert_eq!((r.status, r.qp_num), (WcStatus::Success, good.0.qpn));
    assert_eq!(good.1.read(40, 16), vec![0x11; 16]);
    w.expect_no_wc(1, wrong_key.0.rcq, "a member with another Q_Key");
    w.expect_no_wc(1, early.rcq, "a member in INIT");
    assert_eq!(wrong_key.1.read(0, SLOT), vec![0xEE; SLOT]);
    assert_eq!(early_buf.read(0, SLOT), vec![0xEE; SLOT]);
    assert_eq!(
        w.stats(1).dropped,
        dropped + 2,
        "one drop per refusing member"
    );
}

#[test]
fn after_detach_nothing_arrives_and_the_group_is_gone() {
    let mut w = World::two(74);
    let cfg = QpCfg::ud();
    let s = w.new_ep(0, &cfg);
    w.ud_ready(&s, &cfg, 0);
    let (m, buf) = member(&mut w, 1, &cfg, true);
    let g0 = w.nic(1).mcast_generation();
    assert_eq!(w.nic(1).mcast_groups().collect::<Vec<_>>(), vec![mgid()]);
    let ah = group_ah(&mut w, 0, s.pd);
    let src = w.mr(0, s.pd, 64, LW, 0x22);
    w.post_send(&s, to_group(1, &src, 8, ah, cfg.qkey));
    assert_eq!(w.expect_wc(1, m.rcq).status, WcStatus::Success);
    assert_eq!(buf.read(40, 8), vec![0x22; 8]);
    // Detached: the next SEND is dropped at the device, the posted receive stays.
    w.post_recv(&m, rwr(8, vec![buf.sge(0, SLOT)]));
    w.nic(1).detach_mcast(m.qpn, mgid(), 0).unwrap();
    assert_ne!(w.nic(1).mcast_generation(), g0, "the group went away");
    assert_eq!(w.nic(1).mcast_groups().count(), 0);
    let dropped = w.stats(1).dropped;
    buf.write(0, &[0xEE; SLOT]);
    src.write(0, &[0x33; 8]);
    w.post_send(&s, to_group(2, &src, 8, ah, cfg.qkey));
    assert_eq!(w.expect_wc(0, s.scq).status, WcStatus::Success);
    w.expect_no_wc(1, m.rcq, "a detached QP");
    assert_eq!(buf.read(0, SLOT), vec![0xEE; SLOT]);
    assert_eq!(w.stats(1).dropped, dropped + 1);
    // Detaching again is EINVAL; destroying the QP is allowed now.
    let e = w.nic(1).detach_mcast(m.qpn, mgid(), 0).unwrap_err();
    assert_eq!(e.errno, Errno::EINVAL);
    w.nic(1).destroy_qp(m.qpn).unwrap();
}

#[test]
fn an_attached_qp_cannot_be_destroyed() {
    let mut w = World::two(75);
    let cfg = QpCfg::ud();
    let (m, _buf) = member(&mut w, 1, &cfg, true);
    let e = w.nic(1).destroy_qp(m.qpn).unwrap_err();
    assert_eq!(e.errno, Errno::EBUSY);
    w.nic(1).detach_mcast(m.qpn, mgid(), 0).unwrap();
    w.nic(1).destroy_qp(m.qpn).unwrap();
}

#[test]
fn the_multicast_qpn_to_a_unicast_address_is_dropped() {
    let mut w = World::two(76);
    let cfg = QpCfg::ud();
    let s = w.new_ep(0, &cfg);
    w.ud_ready(&s, &cfg, 0);
    let (m, buf) = member(&mut w, 1, &cfg, true);
    // An AH to device 1 itself, with the multicast QPN.
    let ah = w.ah(0, s.pd, 1);
    let src = w.mr(0, s.pd, 64, LW, 0x44);
    let dropped = w.stats(1).dropped;
    w.post_send(&s, to_group(1, &src, 8, ah, cfg.qkey));
    assert_eq!(w.expect_wc(0, s.scq).status, WcStatus::Success);
    w.expect_no_wc(1, m.rcq, "a unicast datagram to QPN 0xFFFFFF");
    assert_eq!(buf.read(0, SLOT), vec![0xEE; SLOT]);
    assert_eq!(w.stats(1).dropped, dropped + 1);
}

#[test]
fn each_member_takes_its_own_receive_and_an_empty_queue_drops_only_its_copy() {
    let mut w = World::two(77);
    let cfg = QpCfg::ud();
    let s = w.new_ep(0, &cfg);
    w.ud_ready(&s, &cfg, 0);
    let full = member(&mut w, 1, &cfg, true);
    // A member with no receive posted.
    let empty = w.new_ep(1, &cfg);
    w.ud_ready(&empty, &cfg, 0);
    w.nic(1).attach_mcast(empty.qpn, mgid(), 0).unwrap();
    let ah = group_ah(&mut w, 0, s.pd);
    let src = w.mr(0, s.pd, 64, LW, 0x66);
    w.post_send(&s, to_group(1, &src, 12, ah, cfg.qkey));
    let r = w.expect_wc(1, full.0.rcq);
    assert_eq!((r.status, r.byte_len), (WcStatus::Success, 52));
    assert_eq!(full.1.read(40, 12), vec![0x66; 12]);
    w.expect_no_wc(1, empty.rcq, "a member without a receive WQE");
}

#[test]
fn under_loss_each_copy_that_arrives_is_whole() {
    let faults = Faults {
        loss: 0.3,
        ..Faults::default()
    };
    let mut w = World::new(2, 78, faults);
    let cfg = QpCfg::ud();
    let s = w.new_ep(0, &cfg);
    w.ud_ready(&s, &cfg, 0);
    let m = w.new_ep(1, &cfg);
    w.ud_ready(&m, &cfg, 0);
    w.nic(1).attach_mcast(m.qpn, mgid(), 0).unwrap();
    const N: usize = 40;
    let bufs = w.mr(1, m.pd, SLOT * N, LW, 0xEE);
    for k in 0..N {
        w.post_recv(&m, rwr(k as u64, vec![bufs.sge(k * SLOT, SLOT)]));
    }
    let ah = group_ah(&mut w, 0, s.pd);
    let src = w.mr(0, s.pd, 64 * N, LW, 0);
    for k in 0..N {
        src.write(k * 64, &pattern(k as u64, 64));
        let mut wr = to_group(k as u64, &src, 64, ah, cfg.qkey);
        wr.sg_list = vec![src.sge(k * 64, 64)];
        w.post_send(&s, wr);
    }
    // UD completes every send whatever the network does.
    assert_eq!(w.expect_wcs(0, s.scq, N).len(), N);
    w.settle();
    let got = w.drain(1, m.rcq);
    let lost = w.sim.net.stats().dropped_loss as usize;
    assert_eq!(got.len(), N - lost, "every datagram not lost arrives once");
    assert!(!got.is_empty() && lost > 0, "seed 78 loses some, not all");
    // Receives complete in order, each with the payload of the send it carried.
    let sent_ids: Vec<u64> = (0..N as u64).collect();
    for (slot, r) in got.iter().enumerate() {
        assert_eq!(r.status, WcStatus::Success);
        assert_eq!(r.wr_id, slot as u64);
        let data = bufs.read(slot * SLOT + 40, 64);
        let k = sent_ids
            .iter()
            .find(|&&k| pattern(k, 64) == data)
            .unwrap_or_else(|| panic!("receive {slot} carries no payload that was sent"));
        assert!(*k as usize >= slot, "in order");
    }
}
