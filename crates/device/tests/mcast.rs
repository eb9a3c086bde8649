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
    Access, AhAttr, CqId, Errno, Gid, PdId, QpCap, QpInitAttr, QpType, Qpn, RecvWr, SendFlags,
    SendOp, SendWr, Sge, UdDest, WcStatus, WorkCompletion,
};
use softrdma_device::{CqPoller, Device, DeviceAddr, DeviceConfig};
use softrdma_testkit::QpCfg;

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
    qkey: u32,
    mem: Box<[u8]>,
    lkey: u32,
}

impl Side {
    fn new(d: &Device) -> Side {
        Side::with_qkey(d, QKEY)
    }
    /// With another Q_Key: tests that share a group keep each other's datagrams out.
    fn with_qkey(d: &Device, qkey: u32) -> Side {
        let mut mem = vec![0xEE_u8; SLOT * (SLOTS + 1)].into_boxed_slice();
        let (pd, cq, qpn, lkey) = {
            let pd = d.alloc_pd().unwrap();
            let (cq, _) = d.create_cq(64, None, false).unwrap();
            let ptr = mem.as_mut_ptr();
            // SAFETY: the boxed slice lives in `Side` as long as the device may touch it
            // (each test drops its devices first), and is read back only by copying.
            let mr =
                unsafe { d.reg_mr(pd, ptr, mem.len(), ptr as u64, Access::LOCAL_WRITE) }.unwrap();
            let qpn = d
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
                .unwrap()
                .0;
            let cfg = QpCfg {
                qkey,
                ..QpCfg::ud()
            };
            cfg.walk_to_rts(None, 0, |a, m| d.modify_qp(qpn, a, m));
            (pd, cq, qpn, mr.lkey)
        };
        Side {
            pd,
            cq,
            qpn,
            qkey,
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
        {
            for k in 0..SLOTS {
                let wr = RecvWr {
                    wr_id: k as u64,
                    sg_list: vec![Sge {
                        addr: self.addr(k * SLOT),
                        length: SLOT as u32,
                        lkey: self.lkey,
                    }],
                };
                d.post_recv(self.qpn, wr).unwrap();
            }
        };
    }
    /// Send `N` datagrams of `len` bytes (byte `tag + i` each) to the group through an
    /// AH; returns their payloads.
    fn send_round(
        &mut self,
        d: &Device,
        group: impl Into<IpAddr>,
        tag: u8,
        len: usize,
    ) -> Vec<Vec<u8>> {
        self.send_n(d, group.into(), MULTICAST_QPN, tag, len, N)
    }
    /// Send `n` datagrams of `len` bytes (byte `tag + i` each) to QP `remote_qpn` at
    /// `to` (a group with [`MULTICAST_QPN`], or a device).
    fn send_n(
        &mut self,
        d: &Device,
        to: IpAddr,
        remote_qpn: u32,
        tag: u8,
        len: usize,
        n: usize,
    ) -> Vec<Vec<u8>> {
        let at = SLOTS * SLOT;
        let mut sent = Vec::new();
        let av = AhAttr::roce(Gid::from_ip(to), 0);
        let ah = d.create_ah(self.pd, &av).expect("AH");
        for i in 0..n {
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
                    remote_qpn,
                    remote_qkey: self.qkey,
                }),
            };
            d.post_send(self.qpn, wr).expect("post");
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
            let k = CqPoller::new(cq).take(d, &mut buf).unwrap();
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
    a.destroy_qp(ra.qpn).expect("destroy after detach");
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
    assert!(a.read(|r| r.mcast_groups().count()) == 0);
    // Attached QPs cannot be destroyed.
    let g = mgid(Ipv4Addr::new(239, 77, 0, 3));
    a.attach_mcast(s.qpn, g, 0).unwrap();
    let e = a.destroy_qp(s.qpn).unwrap_err();
    assert_eq!(e.errno, Errno::EBUSY);
    a.detach_mcast(s.qpn, g, 0).unwrap();
    drop(a);
}

// ------------------------------------------------------------------ two processes

/// Environment variable that makes [`peer_process`] the peer of
/// [`two_processes_with_no_setup`].
const PEER_ENV: &str = "SOFTRDMA_MCAST_PEER";
/// The Q_Key of the two-process test: other tests' datagrams to 239.1.2.3 carry another
/// and are dropped by the receiver.
const PEER_QKEY: u32 = 0x5EED_0002;

/// The peer process (a no-op unless [`PEER_ENV`] is set): its own device, a UD QP
/// attached to 239.1.2.3 and a second one that is not. It prints `READY <ip> <qpn of the
/// second>`, then `GOT <hex payload>` for every datagram the first receives, `DETACHED`
/// once it has detached on a `DETACH` line from stdin, `MARK` when the second receives
/// (after the first's completions up to then), and exits on `EXIT` (or after 60 s).
#[test]
fn peer_process() {
    if std::env::var_os(PEER_ENV).is_none() {
        return;
    }
    use std::io::BufRead;
    let group = Ipv4Addr::new(239, 1, 2, 3);
    let d = open("mc-peer");
    let s = Side::with_qkey(&d, PEER_QKEY);
    s.post_recvs(&d);
    d.attach_mcast(s.qpn, mgid(group), 0).expect("attach");
    let marker = Side::with_qkey(&d, PEER_QKEY);
    marker.post_recvs(&d);
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    println!("READY {} {}", d.addr().ip(), marker.qpn);
    let report = |wcs: Vec<WorkCompletion>| {
        for wc in wcs {
            let slot = wc.wr_id as usize * SLOT;
            let len = (wc.byte_len as usize).saturating_sub(40).min(SLOT - 40);
            let hex: String = s
                .read(slot + 40, len)
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            println!("GOT {:?} {hex}", wc.status);
        }
    };
    let until = Instant::now() + Duration::from_secs(60);
    while Instant::now() < until {
        report(wait_wcs(&d, s.cq, SLOTS, Duration::from_millis(20)));
        if !wait_wcs(&d, marker.cq, SLOTS, Duration::from_millis(1)).is_empty() {
            // A step reads the device socket before the group sockets, so a group
            // datagram sent before the marker is in the CQ by now, if it came at all.
            report(wait_wcs(&d, s.cq, SLOTS, Duration::from_millis(1)));
            println!("MARK");
        }
        match rx.try_recv().as_deref() {
            Ok("DETACH") => {
                d.detach_mcast(s.qpn, mgid(group), 0).expect("detach");
                println!("DETACHED");
            }
            Ok("EXIT") | Err(std::sync::mpsc::TryRecvError::Disconnected) => break,
            _ => {}
        }
    }
    println!("BYE");
}

/// What the peer printed, line by line, as it comes.
fn peer_lines(child: &mut std::process::Child) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead;
    let out = child.stdout.take().expect("peer stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// The first of the peer's lines with `word`, from that word on, if one comes within
/// `within`.
fn line_with(
    rx: &std::sync::mpsc::Receiver<String>,
    word: &str,
    within: Duration,
) -> Option<String> {
    let end = Instant::now() + within;
    loop {
        let l = rx
            .recv_timeout(end.saturating_duration_since(Instant::now()))
            .ok()?;
        if let Some(at) = l.find(word) {
            return Some(l[at..].to_string());
        }
    }
}

/// The peer's lines starting with `prefix` until one starts with `until` (or `within`
/// passes). The test harness may print its own words before the peer's on a line
/// (`test peer_process ... READY`), so a line counts from the word it starts with.
fn lines_until(
    rx: &std::sync::mpsc::Receiver<String>,
    prefix: &str,
    until: &str,
    within: Duration,
) -> (Vec<String>, bool) {
    let end = Instant::now() + within;
    let mut got = Vec::new();
    loop {
        let left = end.saturating_duration_since(Instant::now());
        let Ok(l) = rx.recv_timeout(left) else {
            return (got, false);
        };
        let from = |w: &str| l.find(w).map(|at| l[at..].to_string());
        if from(until).is_some() {
            return (got, true);
        }
        if let Some(x) = from(prefix) {
            got.push(x);
        }
    }
}

/// Device A in another process (no setup between them: each takes its own 127.0.0.x)
/// attached to 239.1.2.3 receives the SENDs this process's device B posts to the group,
/// bytes checked; after A detaches, nothing more reaches it.
#[test]
fn two_processes_with_no_setup() {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let group = Ipv4Addr::new(239, 1, 2, 3);
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", "peer_process", "--nocapture", "--test-threads=1"])
        .env(PEER_ENV, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the peer");
    let rx = peer_lines(&mut child);
    let mut stdin = child.stdin.take().expect("peer stdin");
    let ready = line_with(&rx, "READY", Duration::from_secs(30)).expect("the peer's READY");
    let mut words = ready.split_whitespace().skip(1);
    let peer_ip: IpAddr = words.next().and_then(|w| w.parse().ok()).expect("peer ip");
    let marker_qpn: u32 = words
        .next()
        .and_then(|w| w.parse().ok())
        .expect("marker qpn");

    let b = open("mc-2p-b");
    let mut sb = Side::with_qkey(&b, PEER_QKEY);
    let sent = sb.send_round(&b, group, 0xA0, 77);
    let hex = |p: &Vec<u8>| p.iter().map(|b| format!("{b:02x}")).collect::<String>();
    let sent_hex: Vec<String> = sent.iter().map(hex).collect();
    // Wait for the first, then give the rest a moment.
    let (mut got, _) = lines_until(&rx, "GOT", "NONE", Duration::from_millis(500));
    writeln!(stdin, "DETACH").expect("to the peer");
    let (more, detached) = lines_until(&rx, "GOT", "DETACHED", Duration::from_secs(10));
    assert!(detached, "the peer did not detach");
    got.extend(more);
    assert!(
        !got.is_empty(),
        "none of {N} datagrams reached the other process"
    );
    assert!(got.len() <= N, "{got:?}");
    for l in &got {
        let mut w = l.split_whitespace().skip(1);
        assert_eq!(w.next(), Some("Success"), "{l}");
        let payload = w.next().unwrap_or_default();
        assert!(
            sent_hex.iter().any(|s| s == payload),
            "not a payload sent: {l}"
        );
    }

    // Detached: what B sends now reaches nobody. A datagram to the peer's other QP,
    // sent after them, marks when they would have arrived.
    sb.send_round(&b, group, 0xC0, 77);
    let (late, marked) = (0..N)
        .find_map(|_| {
            sb.send_n(&b, peer_ip, marker_qpn, 0xD0, 8, 1);
            let (late, marked) = lines_until(&rx, "GOT", "MARK", Duration::from_secs(2));
            marked.then_some((late, marked))
        })
        .unwrap_or_default();
    assert!(marked, "no marker reached the peer");
    assert!(late.is_empty(), "after detach the peer got {late:?}");
    writeln!(stdin, "EXIT").expect("to the peer");
    let (_, bye) = lines_until(&rx, "GOT", "BYE", Duration::from_secs(10));
    assert!(bye, "the peer did not finish");
    assert!(
        child.wait().expect("peer exit").success(),
        "the peer failed"
    );
}

/// An IPv6 group between two devices, which needs an interface with the MULTICAST flag
/// (`lo` has no IPv6 multicast route). Ignored by default; run it in a namespace that
/// has one, giving two of its addresses:
///
/// ```sh
/// unshare -rn sh -c 'ip link set lo up; ip link add v0 type veth peer name v1;
///   ip link set v1 up; ip link set v0 up;
///   ip addr add fd00::10/64 dev v0 nodad; ip addr add fd00::11/64 dev v0 nodad;
///   SOFTRDMA_MCAST_V6="fd00::10 fd00::11" target/debug/deps/mcast-… --ignored ipv6'
/// ```
#[test]
#[ignore = "needs two IPv6 addresses on a multicast-capable interface (SOFTRDMA_MCAST_V6)"]
fn ipv6_group_between_two_devices() {
    let addrs: Vec<IpAddr> = std::env::var("SOFTRDMA_MCAST_V6")
        .expect("SOFTRDMA_MCAST_V6=\"ADDR_A ADDR_B\"")
        .split_whitespace()
        .map(|a| a.parse().expect("an IPv6 address"))
        .collect();
    let open_at = |name: &str, ip: IpAddr| {
        let mut cfg =
            DeviceConfig::new(name, DeviceAddr::Fixed(std::net::SocketAddr::new(ip, 4791)));
        cfg.stats_dir = None;
        Device::open(&cfg).expect("open device")
    };
    let a = open_at("mc6-a", addrs[0]);
    let b = open_at("mc6-b", addrs[1]);
    let group: IpAddr = "ff0e::5eed:6".parse().unwrap();
    let ra = Side::new(&a);
    let mut sb = Side::new(&b);
    ra.post_recvs(&a);
    a.attach_mcast(ra.qpn, Gid::from_ip(group), 0)
        .expect("attach");
    let sent = sb.send_round(&b, group, 0x60, 50);
    let got = wait_wcs(&a, ra.cq, 1, Duration::from_secs(3));
    assert!(!got.is_empty(), "none of {N} datagrams arrived");
    for wc in &got {
        assert_eq!(wc.status, WcStatus::Success);
        let slot = wc.wr_id as usize * SLOT;
        // The GRH is the IPv6 header: destination the group.
        assert_eq!(ra.read(slot + 24, 16), Gid::from_ip(group).0.to_vec());
        assert!(sent.contains(&ra.read(slot + 40, 50)));
    }
    a.detach_mcast(ra.qpn, Gid::from_ip(group), 0)
        .expect("detach");
}
