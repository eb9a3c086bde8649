//! A QP whose path MTU is above what the link carries: every datagram of a full-MTU packet
//! is refused by the socket (`EMSGSIZE`, the device sets DF), no resend can get through,
//! and the QP ends in a retry error. The device counts those datagrams apart from other
//! send drops (`udp_tx_too_big`), so that `softrdma stats` tells the cause.
//!
//! The link is the loopback device of a network namespace of this test's own, its MTU set
//! to 1500: as root the test thread unshares its network namespace; otherwise the test
//! runs itself again under `unshare -rn` (a user namespace, where it is root of its own
//! network namespace).

mod rc;

use std::io;
use std::process::Command;
use std::time::Duration;

use softrdma_device::verbs::{Access, Mtu, Qpn, SendFlags, SendOp, WcStatus, WorkCompletion};
use softrdma_device::{Device, DeviceAddr, DeviceConfig};

/// Marks the run of this test inside `unshare -rn`.
const IN_USERNS: &str = "SOFTRDMA_TEST_TOO_BIG_IN_USERNS";
/// The payload of the WRITE: one packet of path MTU 4096, a datagram of 4,128 bytes.
const LEN: usize = 4096;

/// Bring `lo` of this thread's network namespace up with MTU `mtu`.
fn loopback_up(mtu: i32) -> io::Result<()> {
    // SAFETY: a plain socket call; the descriptor is closed below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `ifreq` is plain data; all zeros is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *d = *s as libc::c_char;
    }
    req.ifr_ifru.ifru_mtu = mtu;
    // SAFETY: `fd` is open and `req` a valid ifreq naming `lo`, as SIOCSIFMTU reads it.
    let mut r = unsafe { libc::ioctl(fd, libc::SIOCSIFMTU, &req) };
    if r == 0 {
        req.ifr_ifru.ifru_flags = (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
        // SAFETY: as above; SIOCSIFFLAGS reads the name and the flags.
        r = unsafe { libc::ioctl(fd, libc::SIOCSIFFLAGS, &req) };
    }
    let e = io::Error::last_os_error();
    // SAFETY: `fd` is ours and closed once.
    unsafe { libc::close(fd) };
    if r == 0 {
        Ok(())
    } else {
        Err(e)
    }
}

/// A device with an RC QP and a registered buffer of `LEN` bytes of `fill`.
struct Side {
    host: rc::Host,
    qpn: Qpn,
}

impl Side {
    fn new(name: &str, fill: u8) -> Side {
        // The refusal is the UDP socket's: the same-host rings have no link MTU, so
        // these devices stay on UDP.
        let mut cfg = DeviceConfig::new(name, DeviceAddr::AutoLoopback(4791));
        cfg.stats_dir = None;
        cfg.shm = false;
        let host = rc::Host::on(
            Device::open(&cfg).expect("open device"),
            LEN,
            fill,
            16,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        );
        let qpn = host.rc_qp(4);
        Side { host, qpn }
    }

    /// Connect towards `peer` at path MTU 4096, with one retry after 2^10 × 4.096 µs, so
    /// that the failure comes quickly.
    fn connect(&self, peer: &Side) {
        let cfg = rc::QpCfg {
            access: Access::REMOTE_WRITE,
            retry_cnt: 1,
            mtu: Mtu::Mtu4096,
            timeout: 10,
            ..rc::cfg()
        };
        let to = rc::Peer::at(peer.host.dev.gid(), peer.qpn, 0);
        self.host.connect(self.qpn, &cfg, &to, 0);
    }

    /// Post a signaled WRITE of `len` bytes to the start of `peer`'s buffer.
    fn write(&self, peer: &Side, wr_id: u64, len: usize) {
        let op = SendOp::Write {
            remote_addr: peer.host.addr(0),
            rkey: peer.host.rkey,
        };
        let sge = self.host.sge(0, len);
        self.host
            .post_send(self.qpn, wr_id, op, SendFlags::SIGNALED, sge);
    }

    /// The next completion.
    fn next_wc(&self) -> WorkCompletion {
        let wcs = self.host.wait_wcs(1, Duration::from_secs(30));
        assert_eq!(wcs.len(), 1, "{wcs:?}");
        wcs[0]
    }

    fn too_big(&self) -> u64 {
        self.host.dev.stats().link.tx_too_big
    }
}

/// The test proper, on this thread's network namespace (lo at MTU 1500).
fn refused_datagrams_fail_the_qp_and_are_counted() {
    let a = Side::new("too-big-a", 0xa5);
    let b = Side::new("too-big-b", 0x5a);
    a.connect(&b);
    b.connect(&a);

    // A WRITE that fits one 1500-byte datagram gets through at path MTU 4096.
    a.write(&b, 1, 1024);
    let wc = a.next_wc();
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::Success));
    assert_eq!(a.too_big(), 0);
    let mem = b.host.contents();
    assert!(mem[..1024].iter().all(|&x| x == 0xa5), "the WRITE landed");
    assert!(
        mem[1024..].iter().all(|&x| x == 0x5a),
        "and nothing past it"
    );

    // One of a full path MTU cannot leave: the QP runs out of retries.
    a.write(&b, 2, LEN);
    let wc = a.next_wc();
    assert_eq!((wc.wr_id, wc.status), (2, WcStatus::RetryExcErr));
    let s = a.host.dev.stats().link;
    // The first try and one retry, each refused.
    assert!(s.tx_too_big >= 2, "{s:?}");
    assert!(s.tx_dropped >= s.tx_too_big, "{s:?}");
    assert_eq!(b.too_big(), 0);
    assert!(
        b.host.contents()[1024..].iter().all(|&x| x == 0x5a),
        "nothing of the refused WRITE arrived"
    );
}

#[test]
fn a_datagram_above_the_link_mtu_is_refused_and_counted() {
    let inside = std::env::var_os(IN_USERNS).is_some();
    let t = std::thread::spawn(move || {
        // SAFETY: unshare(CLONE_NEWNET) moves only this thread to a new network namespace;
        // the devices it opens (their sockets, their progress threads) live there.
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            let e = io::Error::last_os_error();
            assert!(!inside, "no network namespace inside unshare -rn: {e}");
            return false;
        }
        loopback_up(1500).expect("lo up at MTU 1500");
        refused_datagrams_fail_the_qp_and_are_counted();
        true
    });
    match t.join() {
        Ok(true) => {}
        Ok(false) => {
            // Not root: run this test again in a user namespace of its own.
            let exe = std::env::current_exe().unwrap();
            let out = Command::new("unshare")
                .args(["-rn", "--"])
                .arg(exe)
                .args([
                    "--exact",
                    "a_datagram_above_the_link_mtu_is_refused_and_counted",
                    "--nocapture",
                ])
                .env(IN_USERNS, "1")
                .output()
                .expect("unshare(1) (util-linux) to run this test in a user namespace");
            assert!(
                out.status.success() && String::from_utf8_lossy(&out.stdout).contains("1 passed"),
                "the test in `unshare -rn` (needs root or user namespaces): {}\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Err(p) => std::panic::resume_unwind(p),
    }
}
