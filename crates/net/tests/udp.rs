//! The UDP driver against the real kernel, over loopback.
//!
//! Every test binds its own addresses (port 0 unless the port is the point), so tests
//! can run in parallel with each other and with other programs on the host. Waits are
//! bounded: a lost datagram fails a test within seconds, it never hangs.
//!
//! UDP GSO, UDP GRO and `::1` are required: a kernel without them fails these tests
//! instead of passing them untested. The one check that needs root (a raw socket) is
//! `#[ignore]`d, so that it shows in the counts, and `scripts/test` runs it as root.
#![cfg(target_os = "linux")]

use std::io;
use std::mem;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use softrdma_net::udp::{
    bind_first_free_loopback, Driver, InDatagram, OutDatagram, RecvBatch, GRO_BUF_SIZE,
    MAX_PAYLOAD_V4, ROCE_PORT,
};

/// Owned copy of a received datagram, so batches can be reused.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Got {
    src: SocketAddr,
    dst: SocketAddr,
    tos: u8,
    data: Vec<u8>,
}

impl From<InDatagram<'_>> for Got {
    fn from(d: InDatagram<'_>) -> Self {
        Got {
            src: d.src,
            dst: d.dst,
            tos: d.tos,
            data: d.data.to_vec(),
        }
    }
}

/// Receive until `want` datagrams arrived or 5 s passed; returns what arrived.
fn recv_n(d: &mut Driver, batch: &mut RecvBatch, want: usize) -> Vec<Got> {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut got = Vec::new();
    while got.len() < want {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || !d.wait_readable(Some(left)).expect("poll") {
            break;
        }
        d.recv_batch(batch).expect("recv_batch");
        got.extend(batch.iter().map(Got::from));
    }
    got
}

/// Send all of `pkts`, retrying while the send buffer is full.
fn send_all(d: &mut Driver, pkts: &[OutDatagram<'_>]) {
    let mut done = 0;
    let deadline = Instant::now() + Duration::from_secs(5);
    while done < pkts.len() {
        done += d.send_batch(&pkts[done..]).expect("send_batch");
        assert!(Instant::now() < deadline, "send buffer stayed full");
    }
}

/// Distinct bytes for datagram `i` of length `len`.
fn payload(i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|k| (i * 31 + k * 7 + len) as u8).collect()
}

fn lo(host: u8) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, host], 0))
}

/// UDP GSO (Linux 4.18) is a requirement of these tests, not an option: a kernel
/// without it must fail them rather than pass them untested.
fn require_gso(d: &mut Driver) {
    assert!(
        d.set_gso(true),
        "this kernel has no UDP GSO (Linux >= 4.18 needed)"
    );
}

/// UDP GRO (Linux 5.0), likewise.
fn require_gro(d: &mut Driver) {
    assert!(
        d.set_gro(true).unwrap(),
        "this kernel has no UDP GRO (Linux >= 5.0 needed)"
    );
}

fn getsockopt_int(fd: i32, level: i32, name: i32) -> i32 {
    let mut v: libc::c_int = -1;
    let mut len = mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `v` and `len` are live and writable, `len` is the size of `v`.
    let r = unsafe {
        libc::getsockopt(
            fd,
            level,
            name,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    assert_eq!(r, 0, "getsockopt: {}", io::Error::last_os_error());
    v
}

#[test]
fn batch_of_64_mixed_sizes_and_tos_arrives_as_sent() {
    let mut a = Driver::bind(lo(11)).unwrap();
    let mut b = Driver::bind(lo(12)).unwrap();
    let tos = [0x00u8, 0x28, 0xb8, 0x02, 0x8a, 0x01];
    // Empty, tiny, MTU-ish and RoCE-MTU-4096-sized datagrams mixed.
    let sizes: Vec<usize> = (0..64)
        .map(|i| match i % 8 {
            0 => i / 8, // 0..=7, including an empty datagram
            1 => 1,
            2 => 64 + i,
            3 => 1024 + 28,
            4 => 1500,
            5 => 4096 + 28,
            6 => 300 * i,
            _ => 2048 + i,
        })
        .collect();
    let bodies: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| payload(i, n))
        .collect();
    let pkts: Vec<OutDatagram<'_>> = bodies
        .iter()
        .enumerate()
        .map(|(i, d)| OutDatagram {
            dst: b.local_addr(),
            tos: tos[i % tos.len()],
            data: d,
        })
        .collect();
    send_all(&mut a, &pkts);

    // Small batches so several receive calls are needed; slots hold the largest (18600).
    let mut batch = RecvBatch::new(16, 20_000);
    let got = recv_n(&mut b, &mut batch, 64);
    assert_eq!(got.len(), 64, "datagrams lost on loopback");
    // One sender, one receiver, loopback: the kernel keeps the order.
    for (i, g) in got.iter().enumerate() {
        assert_eq!(g.src, a.local_addr(), "source of #{i}");
        assert_eq!(g.dst, b.local_addr(), "destination of #{i}");
        assert_eq!(g.tos, tos[i % tos.len()], "TOS of #{i}");
        assert_eq!(g.data, bodies[i], "bytes of #{i}");
    }
    let (sa, sb) = (a.stats(), b.stats());
    assert_eq!(sa.sent_datagrams, 64);
    assert!(sa.sent_batches >= 1 && sa.sent_batches <= 2, "{sa:?}");
    assert_eq!(sa.gso_batches, 0, "GSO is off by default");
    assert_eq!(sb.recv_datagrams, 64);
    assert!(
        sb.recv_batches >= 4,
        "16-slot batches need at least 4 calls: {sb:?}"
    );
    assert_eq!(sa.errors + sb.errors, 0);
}

#[test]
fn wildcard_bound_socket_reports_the_real_destination() {
    let mut a = Driver::bind(lo(13)).unwrap();
    let mut b = Driver::bind(SocketAddr::from(([0, 0, 0, 0], 0))).unwrap();
    let port = b.local_addr().port();
    let to = [
        SocketAddr::from(([127, 0, 0, 14], port)),
        SocketAddr::from(([127, 0, 0, 15], port)),
    ];
    let pkts: Vec<_> = to
        .iter()
        .map(|&dst| OutDatagram {
            dst,
            tos: 0x28,
            data: b"hello",
        })
        .collect();
    send_all(&mut a, &pkts);
    let got = recv_n(&mut b, &mut RecvBatch::new(8, 2048), 2);
    let dsts: Vec<_> = got.iter().map(|g| g.dst).collect();
    assert_eq!(dsts, to);
}

#[test]
fn gso_run_arrives_as_separate_datagrams_with_and_without_gro() {
    for gro in [false, true] {
        let mut a = Driver::bind(lo(16)).unwrap();
        let mut b = Driver::bind(lo(17)).unwrap();
        require_gso(&mut a);
        if gro {
            require_gro(&mut b);
        }
        // 150 equal datagrams (several GSO runs, since a run holds at most 64), a
        // shorter one that must end its run (the kernel cuts a GSO buffer by size, so a
        // short datagram inside a run would shift every later one), 10 equal ones with
        // the same TOS, then 20 with another TOS, which must start a new message.
        let mut sizes = vec![1100usize; 150];
        sizes.push(333);
        sizes.extend([1100; 10]);
        sizes.extend([1100; 20]);
        let bodies: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| payload(i, n))
            .collect();
        let pkts: Vec<OutDatagram<'_>> = bodies
            .iter()
            .enumerate()
            .map(|(i, d)| OutDatagram {
                dst: b.local_addr(),
                tos: if i < 161 { 0xb8 } else { 0x28 },
                data: d,
            })
            .collect();
        // The runs a caller plans (to seal each segment for its IP ID) are the
        // messages sent: counted below as GSO batches.
        let mut plan = Vec::new();
        let mut at = 0;
        while at < pkts.len() {
            let n = a.gso_run_len(&pkts[at..]);
            plan.push(n);
            at += n;
        }
        assert_eq!(plan, [59, 59, 33, 10, 20]);
        send_all(&mut a, &pkts);
        let slot = if gro { GRO_BUF_SIZE } else { 2048 };
        let got = recv_n(&mut b, &mut RecvBatch::new(32, slot), pkts.len());
        assert_eq!(got.len(), pkts.len(), "gro={gro}: datagrams lost or merged");
        for (i, g) in got.iter().enumerate() {
            assert_eq!(g.data, bodies[i], "gro={gro}: bytes of #{i}");
            assert_eq!(g.tos, pkts[i].tos, "gro={gro}: TOS of #{i}");
            assert_eq!((g.src, g.dst), (a.local_addr(), b.local_addr()));
        }
        let (sa, sb) = (a.stats(), b.stats());
        println!("gro={gro}: sender {sa:?}\n         receiver {sb:?}");
        assert_eq!(sa.sent_datagrams, pkts.len() as u64);
        // Runs of <= 59 (64 KiB) ending at the short datagram make 3 GSO messages, the
        // 10 after it one more, the 20 after the TOS change one more.
        assert_eq!(sa.gso_batches, 5, "gro={gro}: {sa:?}");
        assert_eq!(sb.recv_datagrams, pkts.len() as u64);
        if gro {
            // Loopback hands a GSO message to a GRO socket whole: the split under test
            // really ran.
            assert!(sb.gro_segments > 0, "{sb:?}");
        } else {
            assert_eq!(sb.gro_segments, 0);
        }
        assert_eq!(sa.errors + sb.errors, 0);
    }
}

#[test]
fn a_reused_batch_takes_more_control_data_than_its_last_receive() {
    // A receive rearms only the headers the kernel wrote last time: one that came back
    // with little control data (a plain datagram) must be armed to its full room again
    // before a coalesced GRO buffer, whose segment size is one more control message,
    // lands in the same slot. Left as the kernel wrote it, the last control message
    // (the TOS, after the segment size and the destination) is cut off.
    let mut a = Driver::bind(lo(30)).unwrap();
    let mut b = Driver::bind(lo(31)).unwrap();
    require_gso(&mut a);
    require_gro(&mut b);
    let mut batch = RecvBatch::new(4, GRO_BUF_SIZE);
    let plain = payload(0, 100);
    send_all(
        &mut a,
        &[OutDatagram {
            dst: b.local_addr(),
            tos: 0,
            data: &plain,
        }],
    );
    let got = recv_n(&mut b, &mut batch, 1);
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].data, plain);
    // An empty receive in between, as a busy poll makes many of.
    assert_eq!(b.recv_batch(&mut batch).unwrap(), 0);
    let bodies: Vec<Vec<u8>> = (1..=10).map(|i| payload(i, 1000)).collect();
    let run: Vec<OutDatagram<'_>> = bodies
        .iter()
        .map(|d| OutDatagram {
            dst: b.local_addr(),
            tos: 0x28,
            data: d,
        })
        .collect();
    assert_eq!(a.gso_run_len(&run), 10, "one GSO message");
    send_all(&mut a, &run);
    let got = recv_n(&mut b, &mut batch, 10);
    assert_eq!(got.len(), 10, "the run's datagrams, split");
    for (i, g) in got.iter().enumerate() {
        assert_eq!(g.data, bodies[i], "bytes of #{i}");
        assert_eq!(g.tos, 0x28, "TOS of #{i}");
        assert_eq!((g.src, g.dst), (a.local_addr(), b.local_addr()));
    }
    assert!(b.stats().gro_segments > 0, "the run came coalesced");
    assert_eq!(a.stats().errors + b.stats().errors, 0);
}

#[test]
fn gso_runs_are_never_split_across_send_calls() {
    let mut a = Driver::bind(lo(19)).unwrap();
    let mut b = Driver::bind(lo(20)).unwrap();
    require_gso(&mut a);
    // 10 datagrams of growing size (a run each), then 300 equal ones (runs of 64, 64,
    // 64, 64, 44). One call takes 256 datagrams at most: 10 + 3 x 64 leaves room for 54
    // of the fourth run, which must then start whole in the next call instead of being
    // cut, so that the segment index a caller planned is the one the kernel numbers.
    let sizes: Vec<usize> = (100..110).chain(std::iter::repeat_n(700, 300)).collect();
    let bodies: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| payload(i, n))
        .collect();
    let pkts: Vec<OutDatagram<'_>> = bodies
        .iter()
        .map(|d| OutDatagram {
            dst: b.local_addr(),
            tos: 0,
            data: d,
        })
        .collect();
    let mut plan = Vec::new();
    let mut at = 0;
    while at < pkts.len() {
        let n = a.gso_run_len(&pkts[at..]);
        plan.push(n);
        at += n;
    }
    let mut want = vec![1; 10];
    want.extend([64, 64, 64, 64, 44]);
    assert_eq!(plan, want);
    send_all(&mut a, &pkts);
    let got = recv_n(&mut b, &mut RecvBatch::new(32, 2048), pkts.len());
    assert_eq!(got.len(), pkts.len());
    for (i, g) in got.iter().enumerate() {
        assert_eq!(g.data, bodies[i], "bytes of #{i}");
    }
    // Five GSO messages; a cut run would have made six.
    assert_eq!(a.stats().gso_batches, 5, "{:?}", a.stats());
}

#[test]
fn gro_refuses_slots_too_small_for_a_coalesced_buffer() {
    let mut b = Driver::bind(lo(18)).unwrap();
    require_gro(&mut b);
    let err = b.recv_batch(&mut RecvBatch::new(4, 2048)).unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    assert_eq!(
        b.recv_batch(&mut RecvBatch::new(4, GRO_BUF_SIZE)).unwrap(),
        0
    );
    assert!(!b.set_gro(false).unwrap());
    assert_eq!(b.recv_batch(&mut RecvBatch::new(4, 2048)).unwrap(), 0);
}

#[test]
fn bind_first_free_loopback_twice_gives_two_addresses_on_one_port() {
    let a = bind_first_free_loopback(ROCE_PORT).unwrap();
    let b = bind_first_free_loopback(ROCE_PORT).unwrap();
    let (la, lb) = (a.local_addr(), b.local_addr());
    assert_eq!((la.port(), lb.port()), (ROCE_PORT, ROCE_PORT));
    assert_ne!(la.ip(), lb.ip());
    for ip in [la.ip(), lb.ip()] {
        let IpAddr::V4(v4) = ip else {
            panic!("not IPv4: {ip}")
        };
        assert!(v4.is_loopback(), "{v4}");
    }
    // The address really is taken: no reuse options let a third socket share it.
    let e = Driver::bind(la).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::AddrInUse);
}

#[test]
fn df_is_set_and_oversize_datagrams_are_errors() {
    let mut a = Driver::bind(lo(19)).unwrap();
    let mut b = Driver::bind(lo(20)).unwrap();
    let fd = a.as_raw_fd();
    assert_eq!(
        getsockopt_int(fd, libc::IPPROTO_IP, libc::IP_MTU_DISCOVER),
        libc::IP_PMTUDISC_DO
    );
    let dst = b.local_addr();
    let big = vec![0x5a; MAX_PAYLOAD_V4 + 1];
    let max = payload(1, MAX_PAYLOAD_V4);
    let small = payload(2, 100);

    let e = a
        .send_batch(&[OutDatagram {
            dst,
            tos: 0,
            data: &big,
        }])
        .unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EMSGSIZE), "{e}");

    // The largest IPv4 datagram (65535 bytes) fits the 65536-byte loopback MTU.
    // An oversize one in the middle stops the batch there and is reported next call.
    let pkts = [
        OutDatagram {
            dst,
            tos: 0,
            data: &max,
        },
        OutDatagram {
            dst,
            tos: 0,
            data: &big,
        },
        OutDatagram {
            dst,
            tos: 0,
            data: &small,
        },
    ];
    assert_eq!(a.send_batch(&pkts).unwrap(), 1);
    assert!(a.send_batch(&pkts[1..]).is_err());
    assert_eq!(a.send_batch(&pkts[2..]).unwrap(), 1);

    // With GSO on, an oversize first datagram is still an error, not a panic.
    require_gso(&mut a);
    let e = a
        .send_batch(&[
            OutDatagram {
                dst,
                tos: 0,
                data: &big,
            },
            OutDatagram {
                dst,
                tos: 0,
                data: &big,
            },
        ])
        .unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EMSGSIZE), "{e}");

    let got = recv_n(&mut b, &mut RecvBatch::new(4, GRO_BUF_SIZE), 2);
    assert_eq!(got.len(), 2);
    assert_eq!(got[0].data, max);
    assert_eq!(got[1].data, small);
    assert!(a.stats().errors >= 2);
}

#[test]
fn family_mismatch_is_invalid_input_and_mapped_ipv4_works() {
    let mut a = Driver::bind(lo(21)).unwrap();
    let mut b = Driver::bind(lo(22)).unwrap();
    let v6 = SocketAddr::from((Ipv6Addr::LOCALHOST, b.local_addr().port()));
    let e = a
        .send_batch(&[OutDatagram {
            dst: v6,
            tos: 0,
            data: b"x",
        }])
        .unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    // A GID-style address (::ffff:127.0.0.22) goes out as IPv4.
    let mapped = SocketAddr::from((
        Ipv4Addr::new(127, 0, 0, 22).to_ipv6_mapped(),
        b.local_addr().port(),
    ));
    assert_eq!(
        a.send_batch(&[OutDatagram {
            dst: mapped,
            tos: 0x28,
            data: b"gid"
        }])
        .unwrap(),
        1
    );
    let got = recv_n(&mut b, &mut RecvBatch::new(4, 2048), 1);
    assert_eq!(got.len(), 1);
    assert_eq!((got[0].data.as_slice(), got[0].tos), (&b"gid"[..], 0x28));
}

#[test]
fn empty_receive_and_degenerate_batches_do_not_panic() {
    let mut b = Driver::bind(lo(23)).unwrap();
    let mut batch = RecvBatch::new(0, 0);
    assert_eq!((batch.capacity(), batch.buf_size()), (1, 1));
    assert_eq!(b.recv_batch(&mut batch).unwrap(), 0);
    assert!(batch.is_empty());
    assert_eq!(batch.iter().count(), 0);
    assert_eq!(b.send_batch(&[]).unwrap(), 0);
    let huge = RecvBatch::new(usize::MAX, usize::MAX);
    assert_eq!(huge.capacity(), softrdma_net::udp::MAX_RECV_BATCH);
    assert_eq!(huge.buf_size(), GRO_BUF_SIZE);
}

#[test]
fn truncated_datagram_is_dropped_and_counted() {
    let mut a = Driver::bind(lo(24)).unwrap();
    let mut b = Driver::bind(lo(25)).unwrap();
    let dst = b.local_addr();
    let long = payload(3, 600);
    let short = payload(4, 100);
    let pkts = [
        OutDatagram {
            dst,
            tos: 0,
            data: &long,
        },
        OutDatagram {
            dst,
            tos: 0,
            data: &short,
        },
    ];
    send_all(&mut a, &pkts);
    let mut batch = RecvBatch::new(4, 512);
    let got = recv_n(&mut b, &mut batch, 1);
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].data, short);
    assert_eq!(b.stats().errors, 1);
}

#[test]
fn wait_readable_times_out_then_wakes_for_data() {
    let mut a = Driver::bind(lo(26)).unwrap();
    let b = Driver::bind(lo(27)).unwrap();
    assert!(!b.wait_readable(Some(Duration::ZERO)).unwrap());
    let t = Instant::now();
    assert!(!b.wait_readable(Some(Duration::from_millis(50))).unwrap());
    // A timeout must not end early (poll's milliseconds are rounded up).
    assert!(
        t.elapsed() >= Duration::from_millis(50),
        "{:?}",
        t.elapsed()
    );

    let dst = b.local_addr();
    let sender = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        a.send_batch(&[OutDatagram {
            dst,
            tos: 0,
            data: b"wake",
        }])
        .unwrap()
    });
    assert!(b.wait_readable(Some(Duration::from_secs(10))).unwrap());
    assert_eq!(sender.join().unwrap(), 1);
    // Data waiting: an immediate check says so too.
    assert!(b.wait_readable(Some(Duration::ZERO)).unwrap());
}

/// Raw IPv4 UDP socket that sees every UDP packet on the host's loopback; needs root
/// (CAP_NET_RAW).
fn raw_udp_socket() -> std::os::fd::OwnedFd {
    use std::os::fd::FromRawFd;
    // SAFETY: plain syscall; the result is checked.
    let fd = unsafe {
        libc::socket(
            libc::AF_INET,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::IPPROTO_UDP,
        )
    };
    if fd < 0 {
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EPERM) | Some(libc::EACCES) => panic!(
                "cannot open a raw socket to read the IP header ({e}): run this test as root \
                 (sudo cargo test -p softrdma-net --test udp -- --ignored)"
            ),
            _ => panic!("raw socket: {e}"),
        }
    }
    // SAFETY: `fd` is a new descriptor nothing else owns.
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    // It sees every UDP datagram of the host: room for other tests' traffic too.
    let size: libc::c_int = 8 << 20;
    // SAFETY: `size` is live and its size is passed.
    unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUFFORCE,
            (&size as *const libc::c_int).cast(),
            mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    let tv = libc::timeval {
        tv_sec: 0,
        tv_usec: 200_000,
    };
    // SAFETY: `tv` is live and its size is passed.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&tv as *const libc::timeval).cast(),
            mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    assert_eq!(r, 0);
    fd
}

// Root only, so ignored by default; scripts/test runs it with `--ignored` as root.
#[test]
#[ignore = "needs root for a raw socket: sudo cargo test -p softrdma-net --test udp -- --ignored"]
fn ipv4_id_is_zero_and_df_set_on_the_wire() {
    let raw = raw_udp_socket();
    let mut a = Driver::bind(lo(28)).unwrap();
    let b = Driver::bind(lo(29)).unwrap();
    let (src, dst) = (a.local_addr(), b.local_addr());
    let bodies: Vec<Vec<u8>> = (0..10).map(|i| payload(i, 40 + i * 100)).collect();
    let tos = [0x00u8, 0x28, 0xb8];
    let pkts: Vec<_> = bodies
        .iter()
        .enumerate()
        .map(|(i, d)| OutDatagram {
            dst,
            tos: tos[i % 3],
            data: d,
        })
        .collect();
    send_all(&mut a, &pkts);

    let mut seen = 0;
    let mut buf = vec![0u8; 70_000];
    let deadline = Instant::now() + Duration::from_secs(5);
    while seen < pkts.len() && Instant::now() < deadline {
        // SAFETY: `buf` is writable for its length.
        let n = unsafe { libc::recv(raw.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            continue; // SO_RCVTIMEO expired; the deadline bounds the loop
        }
        let p = &buf[..n as usize];
        if p.len() < 28 || p[0] >> 4 != 4 {
            continue;
        }
        let ihl = usize::from(p[0] & 0x0f) * 4;
        let ip_src = Ipv4Addr::new(p[12], p[13], p[14], p[15]);
        let ip_dst = Ipv4Addr::new(p[16], p[17], p[18], p[19]);
        let sport = u16::from_be_bytes([p[ihl], p[ihl + 1]]);
        let dport = u16::from_be_bytes([p[ihl + 2], p[ihl + 3]]);
        if (
            SocketAddr::from((ip_src, sport)),
            SocketAddr::from((ip_dst, dport)),
        ) != (src, dst)
        {
            continue; // someone else's traffic
        }
        let id = u16::from_be_bytes([p[4], p[5]]);
        let frag = u16::from_be_bytes([p[6], p[7]]);
        assert_eq!(id, 0, "IP ID of datagram #{seen}");
        assert_ne!(frag & 0x4000, 0, "DF bit of datagram #{seen}");
        assert_eq!(p[1], pkts[seen].tos, "TOS byte of datagram #{seen}");
        assert_eq!(
            &p[ihl + 8..],
            pkts[seen].data,
            "payload of datagram #{seen}"
        );
        seen += 1;
    }
    assert_eq!(seen, pkts.len(), "raw socket did not see every datagram");
}

#[test]
fn ipv6_loopback_send_and_receive() {
    let any6 = SocketAddr::from((Ipv6Addr::LOCALHOST, 0));
    let mut a = Driver::bind(any6)
        .unwrap_or_else(|e| panic!("cannot bind ::1 ({e}): IPv6 loopback is required"));
    let mut b = Driver::bind(any6).unwrap();
    for (level, name, want) in [
        (
            libc::IPPROTO_IPV6,
            libc::IPV6_MTU_DISCOVER,
            libc::IPV6_PMTUDISC_DO,
        ),
        (libc::IPPROTO_IPV6, libc::IPV6_DONTFRAG, 1),
        (libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, 1),
    ] {
        assert_eq!(
            getsockopt_int(a.as_raw_fd(), level, name),
            want,
            "option {name}"
        );
    }
    let tos = [0x00u8, 0x28, 0xb8, 0x03];
    let bodies: Vec<Vec<u8>> = (0..16).map(|i| payload(i, 1 + i * 257)).collect();
    let pkts: Vec<_> = bodies
        .iter()
        .enumerate()
        .map(|(i, d)| OutDatagram {
            dst: b.local_addr(),
            tos: tos[i % tos.len()],
            data: d,
        })
        .collect();
    send_all(&mut a, &pkts);
    let got = recv_n(&mut b, &mut RecvBatch::new(8, 9000), pkts.len());
    assert_eq!(got.len(), pkts.len());
    for (i, g) in got.iter().enumerate() {
        assert_eq!(
            (g.src, g.dst, g.tos),
            (a.local_addr(), b.local_addr(), pkts[i].tos),
            "#{i}"
        );
        assert_eq!(g.data, bodies[i], "bytes of #{i}");
    }
    let big = vec![0u8; softrdma_net::udp::MAX_PAYLOAD_V6 + 1];
    assert!(a
        .send_batch(&[OutDatagram {
            dst: b.local_addr(),
            tos: 0,
            data: &big
        }])
        .is_err());
    // An IPv4 destination cannot leave an IPv6-only socket.
    let e = a
        .send_batch(&[OutDatagram {
            dst: SocketAddr::from(([127, 0, 0, 1], 9)),
            tos: 0,
            data: b"x",
        }])
        .unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
}

#[test]
fn multicast_reaches_every_joined_socket_on_loopback_until_it_leaves() {
    use softrdma_net::udp::interface_index;
    let group = IpAddr::V4(Ipv4Addr::new(239, 255, 77, 1));
    // Two "devices" at 127.0.0.71 and .72 join; the port is picked by the first.
    let mut a = Driver::bind_multicast(group, 0, lo(71).ip()).expect("join at .71");
    let port = a.local_addr().port();
    assert_eq!(a.local_addr(), SocketAddr::new(group, port));
    let mut b = Driver::bind_multicast(group, port, lo(72).ip()).expect("join at .72");
    // The sender is a plain device socket: its bound source picks the interface (lo).
    let mut tx = Driver::bind(lo(73)).expect("sender");
    let dst = SocketAddr::new(group, port);
    let data: Vec<Vec<u8>> = (0..4).map(|i| payload(i, 100 + i)).collect();
    let out: Vec<OutDatagram<'_>> = data
        .iter()
        .map(|d| OutDatagram {
            dst,
            tos: 0x08,
            data: d,
        })
        .collect();
    send_all(&mut tx, &out);
    let mut batch = RecvBatch::new(8, 2048);
    for (name, d) in [("a", &mut a), ("b", &mut b)] {
        let got = recv_n(d, &mut batch, out.len());
        let want: Vec<Got> = data
            .iter()
            .map(|d| Got {
                src: tx.local_addr(),
                dst,
                tos: 0x08,
                data: d.clone(),
            })
            .collect();
        assert_eq!(
            got, want,
            "socket {name}: every datagram once, to the group"
        );
    }
    // `a` leaves (closes): `b` still gets the next one, and only one copy.
    drop(a);
    send_all(&mut tx, &out[..1]);
    let got = recv_n(&mut b, &mut batch, 1);
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].data, data[0]);
    assert!(
        !b.wait_readable(Some(Duration::from_millis(200)))
            .expect("poll"),
        "no second copy"
    );
    // Family and address checks.
    let v6 = IpAddr::V6(Ipv6Addr::LOCALHOST);
    let e = Driver::bind_multicast(group, port, v6).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    let e = Driver::bind_multicast(lo(9).ip(), port, lo(71).ip()).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "not a group");
    assert_eq!(interface_index(lo(1).ip()), Some(1), "lo holds 127.0.0.1");
    assert_eq!(
        interface_index(IpAddr::V4(Ipv4Addr::new(203, 0, 113, 9))),
        None
    );
}

/// The receive buffer a driver reports is what the kernel gives the 4 MiB it asks for:
/// doubled, and capped by `rmem_max` for a process that may not force it.
#[test]
fn the_receive_buffer_is_what_the_kernel_gave() {
    let d = Driver::bind(lo(1)).unwrap();
    let got = d.recv_buffer_size().unwrap();
    let asked = 4 << 20;
    let rmem_max: usize = std::fs::read_to_string("/proc/sys/net/core/rmem_max")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(
        got == 2 * asked || got == 2 * rmem_max.min(asked),
        "{got} bytes (rmem_max {rmem_max})"
    );
}
