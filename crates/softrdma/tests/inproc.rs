//! Two devices in one process over real loopback UDP: every opcode on RC, UC and UD.

use std::time::Duration;

use softrdma::*;

mod support;
use support::{Side, ALL};

const T: Duration = Duration::from_secs(10);

fn side(t: QpType) -> Side {
    let dev = support::open("test");
    let pd = dev.alloc_pd().unwrap();
    let cq = dev.create_cq(256, None).unwrap();
    let qp = pd.create_qp(&QpInit::new(t, &cq)).unwrap();
    let mr = pd.register(8192, ALL).unwrap();
    Side {
        dev,
        pd,
        cq,
        qp,
        mr,
    }
}

fn pair(t: QpType) -> (Side, Side) {
    let a = side(t);
    let b = side(t);
    let (pa, pb) = (a.qp.endpoint(), b.qp.endpoint());
    a.qp.connect_to(&pb, ALL).unwrap();
    b.qp.connect_to(&pa, ALL).unwrap();
    (a, b)
}

#[test]
fn rc_every_opcode() {
    let (a, b) = pair(QpType::Rc);
    assert_ne!(a.dev.addr(), b.dev.addr());
    // SEND
    a.mr.write(0, b"hello over RoCEv2").unwrap();
    b.qp.post_recv(wr::recv(7, [b.mr.sge(0..1024).unwrap()]))
        .unwrap();
    a.qp.post_send(wr::send(1, [a.mr.sge(0..17).unwrap()]))
        .unwrap();
    let wc = a.cq.wait(T).unwrap();
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode),
        (1, WcStatus::Success, WcOpcode::Send)
    );
    let wc = b.cq.wait(T).unwrap();
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode, wc.byte_len),
        (7, WcStatus::Success, WcOpcode::Recv, 17)
    );
    assert_eq!(b.mr.to_vec(0, 17).unwrap(), b"hello over RoCEv2");
    // SEND_WITH_IMM
    b.qp.post_recv(wr::recv(8, [b.mr.sge(0..1024).unwrap()]))
        .unwrap();
    a.qp.post_send(wr::send_with_imm(2, [a.mr.sge(0..5).unwrap()], 0xABCD))
        .unwrap();
    assert_eq!(a.cq.wait(T).unwrap().status, WcStatus::Success);
    let wc = b.cq.wait(T).unwrap();
    assert_eq!(wc.imm_data, 0xABCD);
    assert!(wc.wc_flags.contains(WcFlags::WITH_IMM));
    // WRITE of 3000 bytes (3 packets)
    let data: Vec<u8> = (0..3000u32).map(|i| (i * 7) as u8).collect();
    a.mr.write(1000, &data).unwrap();
    a.qp.post_send(wr::write(3, [a.mr.sge(1000..4000).unwrap()], &b.mr.remote(), 4096).unwrap())
        .unwrap();
    let wc = a.cq.wait(T).unwrap();
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode),
        (3, WcStatus::Success, WcOpcode::RdmaWrite)
    );
    assert_eq!(b.mr.to_vec(4096, 3000).unwrap(), data);
    // READ it back
    a.qp.post_send(wr::read(4, [a.mr.sge(5000..8000).unwrap()], &b.mr.remote(), 4096).unwrap())
        .unwrap();
    let wc = a.cq.wait(T).unwrap();
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode),
        (4, WcStatus::Success, WcOpcode::RdmaRead)
    );
    assert_eq!(a.mr.to_vec(5000, 3000).unwrap(), data);
    // WRITE_WITH_IMM
    b.qp.post_recv(wr::recv(9, [b.mr.sge(0..0).unwrap()]))
        .unwrap();
    a.qp.post_send(
        wr::write_with_imm(5, [a.mr.sge(0..4).unwrap()], &b.mr.remote(), 100, 77).unwrap(),
    )
    .unwrap();
    assert_eq!(a.cq.wait(T).unwrap().status, WcStatus::Success);
    let wc = b.cq.wait(T).unwrap();
    assert_eq!(
        (wc.wr_id, wc.opcode, wc.imm_data),
        (9, WcOpcode::RecvRdmaWithImm, 77)
    );
    assert_eq!(b.mr.to_vec(100, 4).unwrap(), b"hell");
    // FAA and CAS at offset 8000 (8-aligned)
    b.mr.write_u64(8000, 40).unwrap();
    a.qp.post_send(wr::fetch_add(6, a.mr.sge(0..8).unwrap(), &b.mr.remote(), 8000, 2).unwrap())
        .unwrap();
    let wc = a.cq.wait(T).unwrap();
    assert_eq!(
        (wc.status, wc.opcode),
        (WcStatus::Success, WcOpcode::FetchAdd)
    );
    assert_eq!(a.mr.read_u64(0).unwrap(), 40);
    assert_eq!(b.mr.read_u64(8000).unwrap(), 42);
    a.qp.post_send(
        wr::compare_swap(7, a.mr.sge(8..16).unwrap(), &b.mr.remote(), 8000, 42, 99).unwrap(),
    )
    .unwrap();
    let wc = a.cq.wait(T).unwrap();
    assert_eq!(
        (wc.status, wc.opcode),
        (WcStatus::Success, WcOpcode::CompSwap)
    );
    assert_eq!(a.mr.read_u64(8).unwrap(), 42);
    assert_eq!(b.mr.read_u64(8000).unwrap(), 99);
    let s = a.dev.stats();
    assert!(s.engine.tx_packets > 0 && s.link.tx_datagrams > 0);
    assert_eq!(s.engine.icrc_errors, 0);
    assert_eq!(b.dev.stats().engine.icrc_errors, 0);
    drop(b.pd);
}

fn readable(fd: std::os::fd::RawFd, ms: u64) -> bool {
    // SAFETY: the channel that owns `fd` outlives this call (the caller holds it).
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    softrdma_device::poll_readable(&[fd], Some(std::time::Duration::from_millis(ms)))
        .is_ok_and(|r| r[0])
}

#[test]
fn completion_channel_fd_works_with_poll() {
    use std::os::fd::AsRawFd;
    let a = side(QpType::Rc);
    let dev_b = support::open("test");
    let pd_b = dev_b.alloc_pd().unwrap();
    let ch = dev_b.create_channel().unwrap();
    let cq_b = dev_b.create_cq(16, Some(&ch)).unwrap();
    let qp_b = pd_b
        .create_qp(&QpInit::new(QpType::Rc, &cq_b).depth(8, 8))
        .unwrap();
    let mr_b = pd_b.register(4096, ALL).unwrap();
    a.qp.connect_to(&qp_b.endpoint(), ALL).unwrap();
    qp_b.connect_to(&a.qp.endpoint(), ALL).unwrap();
    qp_b.post_recv(wr::recv(1, [mr_b.sge(0..64).unwrap()]))
        .unwrap();
    cq_b.req_notify(false).unwrap();
    let fd = ch.as_raw_fd();
    assert!(!readable(fd, 0), "no event yet");
    assert_eq!(ch.try_get().unwrap(), None);
    a.mr.write(0, b"wake up").unwrap();
    a.qp.post_send(wr::send(1, [a.mr.sge(0..7).unwrap()]))
        .unwrap();
    // Bounded wait: poll(2) on the channel fd until the event arrives.
    let mut seen = false;
    for _ in 0..100 {
        if readable(fd, 100) {
            seen = true;
            break;
        }
    }
    assert!(seen, "channel fd never became readable");
    assert_eq!(ch.try_get().unwrap(), Some(cq_b.id()));
    assert!(!readable(fd, 0), "fd cleared once the event is taken");
    ch.ack(&cq_b, 1).unwrap();
    let wc = cq_b
        .poll_one()
        .unwrap()
        .expect("completion behind the event");
    assert_eq!((wc.wr_id, wc.byte_len), (1, 7));
    // Blocking wait through the channel, re-armed.
    cq_b.req_notify(false).unwrap();
    qp_b.post_recv(wr::recv(2, [mr_b.sge(0..64).unwrap()]))
        .unwrap();
    a.qp.post_send(wr::send(2, [a.mr.sge(0..7).unwrap()]))
        .unwrap();
    assert_eq!(ch.wait(Some(T)).unwrap(), cq_b.id());
    // Dropping the CQ with an unacknowledged event must not fail or leak the channel.
    drop(qp_b);
    drop(cq_b);
}

fn tmp(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("softrdma-{}-{name}", std::process::id()))
}

/// The trace tshark reads: every packet decoded as RoCEv2, with the traffic class on the
/// wire, marked sent or received, and commented as having gone through a same-host ring
/// exactly when it did.
#[test]
fn pcap_trace_is_readable_by_tshark() {
    pcap_trace(true);
}

/// The same over UDP alone: no packet carries the ring's comment.
#[test]
fn pcap_trace_over_udp_has_no_ring_comment() {
    pcap_trace(false);
}

fn pcap_trace(shm: bool) {
    let tag = if shm { "shm" } else { "udp" };
    let pa = tmp(&format!("a-{tag}.pcap"));
    let pb = tmp(&format!("b-{tag}.pcap"));
    // Two names: a device opened twice is one device, with one trace.
    let open_pcap = |p: &std::path::Path| {
        let name = p.file_stem().unwrap().to_string_lossy();
        let mut cfg = DeviceConfig::new(&format!("trace-{name}"), DeviceAddr::AutoLoopback(4791));
        cfg.pcap = Some(p.to_path_buf());
        cfg.shm = shm;
        Device::open_with(&cfg).unwrap()
    };
    let pattern: Vec<u8> = (0..6000u32).map(|i| (i * 7 + 3) as u8).collect();
    let qpns = {
        let (da, db) = (open_pcap(&pa), open_pcap(&pb));
        let (pda, pdb) = (da.alloc_pd().unwrap(), db.alloc_pd().unwrap());
        let (cqa, cqb) = (
            da.create_cq(16, None).unwrap(),
            db.create_cq(16, None).unwrap(),
        );
        let qa = pda
            .create_qp(&QpInit::new(QpType::Rc, &cqa).depth(8, 8))
            .unwrap();
        let qb = pdb
            .create_qp(&QpInit::new(QpType::Rc, &cqb).depth(8, 8))
            .unwrap();
        let (ma, mb) = (
            pda.register(16384, ALL).unwrap(),
            pdb.register(16384, ALL).unwrap(),
        );
        let o = PathOptions {
            traffic_class: 0x68, // DSCP 26 (AF31), ECN 0
            ..Default::default()
        };
        qa.connect_to_with(&qb.endpoint(), ALL, &o).unwrap();
        qb.connect_to_with(&qa.endpoint(), ALL, &o).unwrap();
        qb.post_recv(wr::recv(1, [mb.sge(0..64).unwrap()])).unwrap();
        qa.post_send(wr::send(1, [ma.sge(0..16).unwrap()])).unwrap();
        assert_eq!(cqa.wait(T).unwrap().status, WcStatus::Success);
        assert_eq!(cqb.wait(T).unwrap().status, WcStatus::Success);
        ma.write(0, &pattern).unwrap();
        qa.post_send(wr::write(2, [ma.sge(0..6000).unwrap()], &mb.remote(), 0).unwrap())
            .unwrap();
        assert_eq!(cqa.wait(T).unwrap().status, WcStatus::Success);
        // A READ back, and a WRITE with immediate (which the responder must see).
        qa.post_send(wr::read(3, [ma.sge(10000..10400).unwrap()], &mb.remote(), 100).unwrap())
            .unwrap();
        assert_eq!(cqa.wait(T).unwrap().status, WcStatus::Success);
        assert_eq!(ma.to_vec(10000, 400).unwrap(), pattern[100..500]);
        qb.post_recv(wr::recv(4, [])).unwrap();
        qa.post_send(
            wr::write_with_imm(4, [ma.sge(0..5000).unwrap()], &mb.remote(), 8000, 0xfeed).unwrap(),
        )
        .unwrap();
        assert_eq!(cqa.wait(T).unwrap().status, WcStatus::Success);
        let wc = cqb.wait(T).unwrap();
        assert_eq!(
            (wc.status, wc.imm_data, wc.byte_len),
            (WcStatus::Success, 0xfeed, 5000)
        );
        [qa.qpn(), qb.qpn()]
    }; // devices dropped: traces flushed
    for p in [&pa, &pb] {
        let bytes = std::fs::read(p).unwrap();
        assert!(bytes.len() > 100, "trace {p:?} has packets");
        // a pcapng section header block, little-endian
        assert_eq!(&bytes[..4], &[0x0A, 0x0D, 0x0D, 0x0A]);
        assert_eq!(&bytes[8..12], &[0x4D, 0x3C, 0x2B, 0x1A]);
    }
    let tshark = std::process::Command::new("tshark")
        .arg("--version")
        .output();
    if !matches!(tshark, Ok(ref o) if o.status.success()) {
        if std::env::var("SOFTRDMA_SKIP_EXTERNAL").is_ok_and(|v| v == "1") {
            eprintln!("tshark not found; SOFTRDMA_SKIP_EXTERNAL=1: tshark check skipped");
            return;
        }
        panic!("tshark not found (install it, or set SOFTRDMA_SKIP_EXTERNAL=1)");
    }
    for p in [&pa, &pb] {
        let out = std::process::Command::new("tshark")
            .arg("-r")
            .arg(p)
            .args([
                "-T",
                "fields",
                "-e",
                "infiniband.bth.opcode",
                "-e",
                "ip.dsfield",
                "-e",
                "frame.packet_flags_direction",
                "-e",
                "frame.comment",
                "-e",
                "infiniband.bth.destqp",
                "-e",
                "infiniband.reth.dmalen",
                "-e",
                "data.data",
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        // To our two QPs only: a stray datagram from a device of another test process (a
        // loopback address another process used a moment ago) is not ours to judge.
        let rows: Vec<&str> = text
            .lines()
            .filter(|r| {
                let f: Vec<&str> = r.split('\t').collect();
                let qp = f
                    .get(4)
                    .and_then(|q| u32::from_str_radix(q.trim_start_matches("0x"), 16).ok());
                qp.is_some_and(|q| qpns.contains(&q))
            })
            .collect();
        assert!(rows.len() >= 4, "{p:?}: {text}");
        let (mut sent, mut received) = (0, 0);
        // The one-sided WRITE and READ as the requester's trace shows them; the WRITE
        // with immediate as both show it.
        let mut one_sided = Vec::new();
        let mut with_imm = 0;
        for r in &rows {
            let f: Vec<&str> = r.split('\t').collect();
            assert!(!f[0].is_empty(), "tshark did not decode a BTH: {r:?}");
            assert_eq!(
                f.get(1).copied(),
                Some("0x68"),
                "traffic class on the wire: {r:?}"
            );
            match f.get(2).copied() {
                Some("0x00000002") => sent += 1,
                Some("0x00000001") => received += 1,
                d => panic!("no direction in the trace: {d:?} in {r:?}"),
            }
            let ring = "softrdma: through a same-host ring, not UDP";
            let comment = f.get(3).copied().unwrap_or("");
            // Every packet reads as RoCEv2: no softrdma opcode in the trace.
            let opcode: u8 = f[0].parse().unwrap();
            assert!(opcode < 0xC0, "a vendor opcode in the trace: {r:?}");
            if !shm {
                assert_eq!(comment, "", "{r:?}");
            } else if comment.contains("one-sided") {
                one_sided.push((opcode, f[2], f[5].to_string(), f[6].to_string()));
            } else if opcode == 11 {
                // WRITE ONLY with immediate: its payload went by cross-memory attach.
                assert!(comment.contains("process_vm_writev"), "{r:?}");
                assert_eq!(f[5], "5000", "{r:?}");
                with_imm += 1;
            } else {
                assert_eq!(comment, ring, "{r:?}");
            }
        }
        if shm {
            assert_eq!(with_imm, 1, "{p:?}: {text}");
            let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
            let expect = if p == &pa {
                vec![
                    // The WRITE: its RETH and its payload, sent.
                    (10, "0x00000002", "6000".to_string(), hex(&pattern[..4096])),
                    // The READ: its request sent, its response received with the data.
                    (12, "0x00000002", "400".to_string(), String::new()),
                    (16, "0x00000001", String::new(), hex(&pattern[100..500])),
                ]
            } else {
                // Nothing reached the responder for them.
                vec![]
            };
            assert_eq!(one_sided, expect, "{p:?}: {text}");
        }
        assert!(sent > 0 && received > 0, "{p:?}: {text}");
        let _ = std::fs::remove_file(p);
    }
}
