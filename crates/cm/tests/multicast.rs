//! rdma_cm multicast on two real devices over loopback, in one process, done the way
//! librdmacm does it: device A's UD id joins 239.1.2.3 and, on MULTICAST_JOIN, attaches
//! its QP to the event's MGID; device B's id joins send-only and sends through an AH made
//! from its event's address vector, to the event's QPN (0xFFFFFF) and Q_Key. A receives
//! the bytes; after detaching and leaving, nothing more. A join left before its event was
//! taken takes the event with it.
//!
//! Multicast is unreliable, so several datagrams are sent and at least one is required;
//! every wait is bounded.

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use common::{agent, device, next};
use softrdma_cm::agent::{Agent, EventChannel};
use softrdma_cm::cma::{CmaEvent, EventParam, EventType, UdParam};
use softrdma_device::registry::Registry;
use softrdma_device::verbs::{
    Access, CqId, PdId, QpAttr, QpCap, QpInitAttr, QpState, QpType, Qpn, RecvWr, SendFlags, SendOp,
    SendWr, Sge, UdDest, WcStatus, WorkCompletion,
};
use softrdma_device::{CqPoller, Device};
use softrdma_wire::cm::port_space;

/// Devices of this test share a UDP port of their own, away from other tests' devices
/// (and so do their multicast groups).
const DEV_PORT: u16 = 24_793;
const GROUP: Ipv4Addr = Ipv4Addr::new(239, 1, 2, 3);
const SLOT: usize = 40 + 256;
const SLOTS: usize = 8;
const N: usize = 4;

fn ud(ev: &CmaEvent) -> &UdParam {
    match &ev.param {
        EventParam::Ud(p) => p,
        p => panic!("not UD parameters: {p:?}"),
    }
}

/// A UD id of `a`'s CM on channel `ch`, bound to the device's own address.
fn ud_id(a: &Agent, ch: &EventChannel) -> u32 {
    let ip = a.device().addr().ip();
    a.call(|c, _| {
        let id = c.create_id(ch.id(), port_space::UDP, None)?;
        c.bind(id, SocketAddr::new(ip, 0))?;
        Ok::<_, softrdma_cm::cma::CmaError>(id)
    })
    .expect("UDP id")
}

/// A UD QP moved to RTS with the attributes the CM gives the id, its CQ, and registered
/// memory: [`SLOTS`] receive slots (0xEE) and a send area behind them.
struct Qp {
    pd: PdId,
    cq: CqId,
    qpn: Qpn,
    mem: Box<[u8]>,
    lkey: u32,
}

impl Qp {
    fn new(a: &Agent, id: u32) -> Qp {
        let d = a.device();
        let mut mem = vec![0xEE_u8; SLOT * (SLOTS + 1)].into_boxed_slice();
        let attrs: Vec<(QpAttr, _)> = [QpState::Init, QpState::Rtr, QpState::Rts]
            .into_iter()
            .map(|s| a.call(|c, _| c.init_qp_attr(id, s)).expect("init_qp_attr"))
            .collect();
        let (pd, cq, qpn, lkey) = {
            let pd = d.alloc_pd().unwrap();
            let (cq, _) = d.create_cq(64, None, false).unwrap();
            let ptr = mem.as_mut_ptr();
            // SAFETY: the boxed slice lives in `Qp`, which the test keeps until its
            // devices are gone, and is read back only by copying.
            let mr =
                unsafe { d.reg_mr(pd, ptr, mem.len(), ptr as u64, Access::LOCAL_WRITE) }.unwrap();
            let cap = QpCap {
                max_send_wr: 16,
                max_recv_wr: 16,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            };
            let qpn = d
                .create_qp(QpInitAttr {
                    qp_type: QpType::Ud,
                    pd,
                    send_cq: cq,
                    recv_cq: cq,
                    srq: None,
                    cap,
                    sq_sig_all: true,
                })
                .unwrap()
                .0;
            for (attr, mask) in &attrs {
                d.modify_qp(qpn, attr, *mask).unwrap();
            }
            (pd, cq, qpn, mr.lkey)
        };
        Qp {
            pd,
            cq,
            qpn,
            mem,
            lkey,
        }
    }
    fn addr(&self, off: usize) -> u64 {
        self.mem.as_ptr() as u64 + off as u64
    }
    fn read(&self, off: usize, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        // SAFETY: in bounds (the slice index checks it); copied through a raw pointer so
        // no reference aliases the device's writes.
        unsafe {
            std::ptr::copy_nonoverlapping(self.mem[off..off + len].as_ptr(), v.as_mut_ptr(), len)
        };
        v
    }
    fn post_recvs(&self, d: &Device) {
        {
            for k in 0..SLOTS {
                let sge = Sge {
                    addr: self.addr(k * SLOT),
                    length: SLOT as u32,
                    lkey: self.lkey,
                };
                d.post_recv(
                    self.qpn,
                    RecvWr {
                        wr_id: k as u64,
                        sg_list: vec![sge],
                    },
                )
                .unwrap();
            }
        };
    }
    /// Send [`N`] datagrams of 64 bytes (`tag + i` each) where a MULTICAST_JOIN's UD
    /// parameters say; returns them.
    fn send_to(&mut self, d: &Device, to: &UdParam, tag: u8) -> Vec<Vec<u8>> {
        let ah = d.create_ah(self.pd, &to.ah_attr).expect("AH");
        let at = SLOTS * SLOT;
        let mut sent = Vec::new();
        for i in 0..N {
            let data = vec![tag.wrapping_add(i as u8); 64];
            self.mem[at..at + 64].copy_from_slice(&data);
            let wr = SendWr {
                wr_id: i as u64,
                op: SendOp::Send,
                flags: SendFlags::SIGNALED,
                sg_list: vec![Sge {
                    addr: self.addr(at),
                    length: 64,
                    lkey: self.lkey,
                }],
                inline_data: None,
                ud: Some(UdDest {
                    ah,
                    remote_qpn: to.qp_num,
                    remote_qkey: to.qkey,
                }),
            };
            d.post_send(self.qpn, wr).expect("post");
            let wc = wcs(d, self.cq, 1, Duration::from_secs(10));
            assert_eq!(wc.len(), 1, "send completion {i}");
            assert_eq!(wc[0].status, WcStatus::Success);
            sent.push(data);
        }
        sent
    }
}

/// Up to `n` completions of `cq`, waiting at most `within`.
fn wcs(d: &Device, cq: CqId, n: usize, within: Duration) -> Vec<WorkCompletion> {
    let mut got = Vec::new();
    let until = Instant::now() + within;
    while got.len() < n {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        let r = d.wait_for(Some(left), || {
            let mut buf = [WorkCompletion::default(); 16];
            let k = CqPoller::new(cq).take(d, &mut buf).unwrap();
            (k > 0).then(|| buf[..k].to_vec())
        });
        got.extend(r.unwrap_or_default());
    }
    got
}

#[test]
fn join_attach_send_to_the_group_then_leave() {
    let dir = std::env::temp_dir().join(format!("softrdma-cm-mcast-{}", std::process::id()));
    let reg = Registry::open(&dir).unwrap();
    let (da, db) = (device("cmma", DEV_PORT), device("cmmb", DEV_PORT));
    let (a, b) = (agent(&da, &reg, DEV_PORT, 9), agent(&db, &reg, DEV_PORT, 9));
    let (cha, chb) = (EventChannel::new().unwrap(), EventChannel::new().unwrap());
    a.attach(&cha);
    b.attach(&chb);
    let group = SocketAddr::new(IpAddr::V4(GROUP), 0);

    // A joins as a full member and, as librdmacm's ucma_process_join, attaches its QP.
    let ida = ud_id(&a, &cha);
    let qa = Qp::new(&a, ida);
    qa.post_recvs(&da);
    a.call(|c, _| c.join_multicast(ida, group, false, 0xA))
        .expect("join");
    let ja = next(&cha, EventType::MulticastJoin);
    assert_eq!(
        ja.mc.map(|m| (m.addr, m.context, m.send_only)),
        Some((group, 0xA, false))
    );
    let pa = ud(&ja).clone();
    assert_eq!(pa.ah_attr.grh.dgid.to_ip(), IpAddr::V4(GROUP));
    da.attach_mcast(qa.qpn, pa.ah_attr.grh.dgid, pa.ah_attr.dlid)
        .expect("attach the QP on MULTICAST_JOIN");

    // B joins send-only (it attaches nothing) and sends where its event says.
    let idb = ud_id(&b, &chb);
    let mut qb = Qp::new(&b, idb);
    b.call(|c, _| c.join_multicast(idb, group, true, 0xB))
        .expect("send-only join");
    let jb = next(&chb, EventType::MulticastJoin);
    assert!(jb.mc.is_some_and(|m| m.send_only));
    let pb = ud(&jb).clone();
    assert_eq!((pb.qp_num, pb.qkey), (0xFF_FFFF, pa.qkey));
    let sent = qb.send_to(&db, &pb, 0x30);
    let got = wcs(&da, qa.cq, N, Duration::from_secs(3));
    assert!(!got.is_empty(), "none of {N} datagrams arrived");
    for wc in &got {
        assert_eq!(
            (wc.status, wc.src_qp),
            (WcStatus::Success, qb.qpn),
            "{wc:?}"
        );
        let slot = wc.wr_id as usize * SLOT;
        assert_eq!(&qa.read(slot + 20 + 16, 4), &GROUP.octets(), "to the group");
        assert!(
            sent.contains(&qa.read(slot + 40, 64)),
            "a payload that was sent"
        );
    }

    // Leave as librdmacm does: detach the QP, then leave.
    da.detach_mcast(qa.qpn, pa.ah_attr.grh.dgid, pa.ah_attr.dlid)
        .expect("detach");
    a.leave_multicast(ida, group).expect("leave");
    let e = a.leave_multicast(ida, group).unwrap_err();
    assert_eq!(e.errno, softrdma_cm::cma::errno::EADDRNOTAVAIL);
    qb.send_to(&db, &pb, 0x70);
    let late = wcs(&da, qa.cq, 1, Duration::from_millis(500));
    assert!(late.is_empty(), "after leaving: {late:?}");
    for k in got.len()..SLOTS {
        assert_eq!(qa.read(k * SLOT, SLOT), vec![0xEE; SLOT], "slot {k}");
    }

    // A join left before its event is taken leaves no event behind.
    a.call(|c, _| c.join_multicast(ida, group, false, 0xC))
        .unwrap();
    assert_eq!(cha.pending(), 1);
    a.leave_multicast(ida, group).unwrap();
    assert_eq!(cha.pending(), 0);
    assert!(cha.get_timeout(Some(Duration::ZERO)).unwrap().is_none());

    drop((a, b));
    drop((da, db));
    let _ = std::fs::remove_dir_all(&dir);
}
