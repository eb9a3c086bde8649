//! UD multicast between two devices over real loopback UDP, with no setup: a UD QP of
//! device A attached to 239.1.2.3 (MGID ::ffff:239.1.2.3) receives the SENDs device B
//! posts to the group, payload and GRH checked; after detach it receives nothing more
//! and the device has left the group.
//!
//! Multicast is unreliable, so the tests send several datagrams and require at least one
//! (and count what arrived); every wait is bounded.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::{Duration, Instant};

use softrdma_device::verbs::{
    Access, AhAttr, CqId, Errno, Gid, GlobalRoute, PdId, QpAttr, QpAttrMask, QpCap, QpInitAttr,
    QpState, QpType, Qpn, RecvWr, SendFlags, SendOp, SendWr, Sge, UdDest, WcStatus, WorkCompletion,
};
use softrdma_device::{Device, DeviceAddr, DeviceConfig};

const QKEY: u32 = 0x0123_4567;
/// A GRH and up to 256 bytes.
const SLOT: usize = 40 + 256;
/// Receive slots per QP.
const SLOTS: usize = 16;
/// Datagrams sent per round.
const N: usize = 5;
const MULTICAST_QPN: u32 = 0xFF_FFFF;

fn open(name: &str) -> Device {
    let mut cfg = DeviceConfig::new(name, DeviceAddr::AutoLoopback(4791));
    cfg.stats_dir = None;
    Device::open(&cfg).expect("open device")
}

fn mgid(g: Ipv4Addr) -> Gid {
    Gid::from_ipv4(g)
}

/// A UD QP in RTS with Q_Key [`QKEY`], its CQ and registered memory for [`SLOTS`]
/// receive slots (filled with 0xEE) and a send area behind them.
struct Side {
    pd: PdId,
    cq: CqId,
    qpn: Qpn,
    mem: Box<[u8]>,
    lkey: u32,
}

impl Side {
    fn new(d: &Device) -> Side {
        let mut mem = vec![0xEE_u8; SLOT * (SLOTS + 1)].into_boxed_slice();
        let (pd, cq, qpn, lkey) = d.call(|r, now| {
            let pd = r.alloc_pd().unwrap();
            let (cq, _) = r.create_cq(64, None, false).unwrap();
            let ptr = mem.as_mut_ptr();
            // SAFETY: the boxed slice lives in `Side` as long as the device may touch it
            // (each test drops its devices first), and is read back only by copying.
            let mr =
                unsafe { r.reg_mr(pd, ptr, mem.len(), ptr as u64, Access::LOCAL_WRITE) }.unwrap();
            let qpn = r
                .create_qp(QpInitAttr {
                    qp_type: QpType::Ud,
                    pd,
                    send_cq: cq,
                    recv_cq: cq,
                    srq: None,
                    cap: QpCap {
                        max_send_wr: 32,
                        max_recv_wr: 32,
                        max_send_sge: 1,
                        max_recv_sge: 1,
                        max_inline_data: 0,
                    },
                    sq_sig_all: true,
                })
                .unwrap();
            let init = QpAttr {
                qp_state: QpState::Init,
                port_num: 1,
                qkey: QKEY,
                ..Default::default()
            };
            let m = QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT;
            r.modify_qp(now, qpn, &init, m | QpAttrMask::QKEY).unwrap();
            for s in [QpState::Rtr, QpState::Rts] {
                let a = QpAttr {
                    qp_state: s,
                    ..Default::default()
                };
                let m = if s == QpState::Rts {
                    QpAttrMask::STATE | QpAttrMask::SQ_PSN
                } else {
                    QpAttrMask::STATE
                };
                r.modify_qp(now, qpn, &a, m).unwrap();
            }
            (pd, cq, qpn, mr.lkey)
        });
        Side {
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
    /// Copy bytes out (the device may write the memory behind our back).
    fn read(&self, off: usize, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        // SAFETY: in bounds of the boxed slice (checked by the slice index below), read
        // through a raw pointer so no reference aliases the device's writes.
        unsafe {
            std::ptr::copy_nonoverlapping(self.mem[off..off + len].as_ptr(), v.as_mut_ptr(), len)
        };
        v
    }
    fn post_recvs(&self, d: &Device) {
        d.call(|r, now| {
            for k in 0..SLOTS {
                let wr = RecvWr {
                    wr_id: k as u64,
                    sg_list: vec![Sge {
                        addr: self.addr(k * SLOT),
                        length: SLOT as u32,
                        lkey: self.lkey,
                    }],
                };
                r.post_recv(now, self.qpn, wr).unwrap();
            }
        });
    }
    /// Send `N` datagrams of `len` bytes (byte `tag + i` each) to the group through an
    /// AH; returns their payloads.
    fn send_round(&mut self, d: &Device, group: Ipv4Addr, tag: u8, len: usize) -> Vec<Vec<u8>> {
        let at = SLOTS * SLOT;
        let mut sent = Vec::new();
        let av = AhAttr {
            grh: GlobalRoute {
                dgid: mgid(group),
                hop_limit: 64,
                ..Default::default()
            },
            is_global: true,
            port_num: 1,
            ..Default::default()
        };
        let ah = d
            .call(|r, _| r.create_ah(self.pd, &av))
            .expect("AH to the group");
        for i in 0..N {
            let data = vec![tag.wrapping_add(i as u8); len];
            self.mem[at..at + len].copy_from_slice(&data);
            let wr = SendWr {
                wr_id: 1000 + i as u64,
                op: SendOp::Send,
                flags: SendFlags::SIGNALED,
                sg_list: vec![Sge {
                    addr: self.addr(at),
                    length: len as u32,
                    lkey: self.lkey,
                }],
                inline_data: None,
                ud: Some(UdDest {
                    ah,
                    remote_qpn: MULTICAST_QPN,
                    remote_qkey: QKEY,
                }),
            };
            d.post(|r, now| r.post_send(now, self.qpn, wr))
                .expect("post");
            // One at a time: the send buffer is reused.
            let wc = wait_wcs(d, self.cq, 1, Duration::from_secs(10));
            assert_eq!(wc.len(), 1, "send completion {i}");
            assert_eq!(wc[0].status, WcStatus::Success);
            sent.push(data);
        }
        sent
    }
}

/// Up to `n` completions of `cq`, waiting at most `within`.
fn wait_wcs(d: &Device, cq: CqId, n: usize, within: Duration) -> Vec<WorkCompletion> {
    let mut got = Vec::new();
    let until = Instant::now() + within;
    while got.len() < n {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        let r = d.wait_for(Some(left), || {
            let mut buf = [WorkCompletion::default(); 16];
            let k = d.inspect(|r| r.poll_cq(cq, &mut buf)).unwrap();
            (k > 0).then(|| buf[..k].to_vec())
        });
        if let Some(v) = r {
            got.extend(v);
        }
    }
    got
}

/// Whether the kernel lists `group` as joined on some interface (`/proc/net/igmp`
/// writes IPv4 groups as the address's bytes in host order, in hex).
fn igmp_joined(group: Ipv4Addr) -> bool {
    let text = std::fs::read_to_string("/proc/net/igmp").unwrap_or_default();
    let want = format!("{:08X}", u32::from_ne_bytes(group.octets()));
    text.lines().any(|l| l.trim_start().starts_with(&want))
}

/// What a receiver holds after a round: the payloads of its successful receives, each
/// checked for its GRH (source the sender's device, destination the group).
fn received(
    d: &Device,
    side: &Side,
    src: IpAddr,
    group: Ipv4Addr,
    len: usize,
    wait: usize,
) -> Vec<Vec<u8>> {
    let wcs = wait_wcs(d, side.cq, wait, Duration::from_secs(3));
    wcs.iter()
        .map(|wc| {
            assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
            assert_eq!(wc.byte_len as usize, 40 + len);
            let slot = wc.wr_id as usize * SLOT;
            let ip = side.read(slot + 20, 20);
            assert_eq!(IpAddr::from(<[u8; 4]>::try_from(&ip[12..16]).unwrap()), src);
            assert_eq!(&ip[16..20], &group.octets(), "GRH destination is the group");
            side.read(slot + 40, len)
        })
        .collect()
}

#[test]
fn a_send_to_the_group_reaches_the_attached_qp_and_not_after_detach() {
    let group = Ipv4Addr::new(239, 1, 2, 3);
    let a = open("mc-a");
    let b = open("mc-b");
    let ra = Side::new(&a);
    let mut sb = Side::new(&b);
    ra.post_recvs(&a);
    sb.post_recvs(&b);
    a.attach_mcast(ra.qpn, mgid(group), 0).expect("attach");
    // Attached twice is fine, and the group is joined once.
    a.attach_mcast(ra.qpn, mgid(group), 0)
        .expect("attach again");
    assert!(igmp_joined(group), "A joined 239.1.2.3");

    let sent = sb.send_round(&b, group, 0x40, 100);
    let got = received(&a, &ra, b.addr().ip(), group, 100, 1);
    assert!(!got.is_empty(), "none of {N} datagrams arrived");
    let wcs_more = received(&a, &ra, b.addr().ip(), group, 100, N - got.len());
    let all: Vec<Vec<u8>> = got.into_iter().chain(wcs_more).collect();
    assert!(all.len() <= N);
    for p in &all {
        assert!(sent.contains(p), "a payload that was sent, whole");
    }
    // B's QP is not attached: its own datagrams did not come back to it.
    let own = wait_wcs(&b, sb.cq, 1, Duration::from_millis(200));
    assert!(own.is_empty(), "{own:?}");

    a.detach_mcast(ra.qpn, mgid(group), 0).expect("detach");
    let e = a.detach_mcast(ra.qpn, mgid(group), 0).unwrap_err();
    assert_eq!(e.errno, Errno::EINVAL, "not attached any more");
    let first_free = all.len();
    sb.send_round(&b, group, 0x80, 100);
    let late = wait_wcs(&a, ra.cq, 1, Duration::from_millis(500));
    assert!(late.is_empty(), "a detached QP got {late:?}");
    for k in first_free..SLOTS {
        assert_eq!(
            ra.read(k * SLOT, SLOT),
            vec![0xEE; SLOT],
            "slot {k} untouched"
        );
    }
    a.call(|r, _| r.destroy_qp(ra.qpn))
        .expect("destroy after detach");
    drop(a);
    drop(b);
}

#[test]
fn members_on_both_devices_the_senders_included_get_copies() {
    let group = Ipv4Addr::new(239, 77, 0, 2);
    let a = open("mc2-a");
    let b = open("mc2-b");
    let ra = Side::new(&a);
    let ra2 = Side::new(&a);
    let mut sb = Side::new(&b);
    let rb = Side::new(&b);
    for (d, s) in [(&a, &ra), (&a, &ra2), (&b, &rb)] {
        s.post_recvs(d);
        d.attach_mcast(s.qpn, mgid(group), 0).expect("attach");
    }
    let sent = sb.send_round(&b, group, 0x10, 33);
    for (name, d, s) in [("a1", &a, &ra), ("a2", &a, &ra2), ("b", &b, &rb)] {
        let got = received(d, s, b.addr().ip(), group, 33, 1);
        assert!(!got.is_empty(), "{name}: none of {N} arrived");
        assert!(got.iter().all(|p| sent.contains(p)), "{name}");
    }
    // Leaving with the last member: the group is no longer joined.
    for (d, s) in [(&a, &ra), (&a, &ra2), (&b, &rb)] {
        d.detach_mcast(s.qpn, mgid(group), 0).expect("detach");
    }
    assert!(!igmp_joined(group), "both devices left 239.77.0.2");
    drop(a);
    drop(b);
}

#[test]
fn attach_errors_are_the_kernels() {
    let a = open("mc3-a");
    let s = Side::new(&a);
    let inval = |r: Result<(), softrdma_device::verbs::Error>| {
        assert_eq!(r.unwrap_err().errno, Errno::EINVAL)
    };
    // A unicast GID, an unknown QP.
    inval(a.attach_mcast(s.qpn, Gid::from_ipv4(Ipv4Addr::new(10, 0, 0, 1)), 0));
    inval(a.attach_mcast(0xABCDE, mgid(Ipv4Addr::new(239, 77, 0, 3)), 0));
    // An IPv6 group on an IPv4 device cannot be joined: refused, and not left attached.
    let g6 = Gid(Ipv6Addr::new(0xff0e, 0, 0, 0, 0, 0, 0x77, 3).octets());
    inval(a.attach_mcast(s.qpn, g6, 0));
    inval(a.detach_mcast(s.qpn, g6, 0));
    assert!(a.inspect(|r| r.mcast_groups().count()) == 0);
    // Attached QPs cannot be destroyed.
    let g = mgid(Ipv4Addr::new(239, 77, 0, 3));
    a.attach_mcast(s.qpn, g, 0).unwrap();
    let e = a.call(|r, _| r.destroy_qp(s.qpn)).unwrap_err();
    assert_eq!(e.errno, Errno::EBUSY);
    a.detach_mcast(s.qpn, g, 0).unwrap();
    drop(a);
}
