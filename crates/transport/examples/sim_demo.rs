//! A guided tour of RDMA over RoCEv2 with no network and no setup: two softrdma devices
//! on the in-memory `sim` network connect an RC queue pair, then SEND, WRITE with
//! immediate, READ and FETCH_AND_ADD. Every packet is printed as a decoder reads it, and
//! `--pcap FILE` writes them all to a capture that Wireshark opens.
//!
//! Run: `cargo run --example sim_demo [-- --pcap demo.pcap] [--loss 0.2]`

use std::net::{Ipv4Addr, SocketAddr};

use softrdma_net::sim::{Endpoint, Faults, Network, Packet, Sim};
use softrdma_transport::verbs::*;
use softrdma_transport::Rnic;
use softrdma_wire::{frame, pcap::PcapWriter, Addrs, Headers};

/// A device on the sim network that records what it sends.
struct Dev {
    nic: Rnic,
    sent: Vec<(u64, Packet)>,
}

impl Endpoint for Dev {
    fn addr(&self) -> SocketAddr {
        self.nic.addr()
    }
    fn handle_packet(&mut self, now: u64, pkt: Packet) {
        self.nic.handle_datagram(now, pkt.src, pkt.dst, &pkt.data);
    }
    fn poll_transmit(&mut self, now: u64) -> Option<Packet> {
        let t = self.nic.poll_transmit(now)?;
        let pkt = Packet {
            src: t.src,
            dst: t.dst,
            tos: t.tos,
            data: t.data,
        };
        self.sent.push((now, pkt.clone()));
        Some(pkt)
    }
    fn poll_timeout(&self) -> Option<u64> {
        self.nic.poll_timeout()
    }
    fn handle_timeout(&mut self, now: u64) {
        self.nic.handle_timeout(now)
    }
}

/// One side's objects.
struct Side {
    cq: CqId,
    qpn: Qpn,
    /// Owns the registered memory; after registration it is reached only through `ptr`,
    /// as a device reaches it, never through a Rust reference.
    _buf: Box<[u8]>,
    ptr: *mut u8,
    mr: MrInfo,
}

impl Side {
    /// Copies `data` into the registered buffer at `off`.
    fn put(&self, off: usize, data: &[u8]) {
        assert!(off + data.len() <= BUF);
        // SAFETY: the range lies inside the live allocation `_buf` (checked above), and the
        // device is not running concurrently: the simulation is single-threaded.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(off), data.len()) }
    }
    /// Copies `N` bytes out of the registered buffer at `off`.
    fn get<const N: usize>(&self, off: usize) -> [u8; N] {
        assert!(off + N <= BUF);
        let mut out = [0u8; N];
        // SAFETY: as in `put`.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(off), out.as_mut_ptr(), N) }
        out
    }
}

const BUF: usize = 8192;

fn setup(nic: &mut Rnic) -> Result<Side> {
    let ctx = &mut *nic;
    let pd = ctx.alloc_pd()?;
    let (cq, _) = ctx.create_cq(64, None, false)?;
    let mut buf = vec![0u8; BUF].into_boxed_slice();
    let access =
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
    let ptr = buf.as_mut_ptr();
    // SAFETY: `buf` is a heap allocation owned by the returned `Side`, which outlives every
    // use of the device in this program; nothing else reads it while the device may write.
    let mr = unsafe { ctx.reg_mr(pd, ptr, BUF, ptr as u64, access)? };
    let qpn = nic.create_qp(QpInitAttr {
        qp_type: QpType::Rc,
        pd,
        send_cq: cq,
        recv_cq: cq,
        srq: None,
        cap: QpCap {
            max_send_wr: 16,
            max_recv_wr: 16,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        sq_sig_all: true,
    })?;
    Ok(Side {
        cq,
        qpn,
        _buf: buf,
        ptr,
        mr,
    })
}

/// Walk a QP from RESET to RTS as every verbs program does: INIT (its port and the rights
/// a peer gets on this side's memory), RTR (the path to the peer, the peer's QPN and the
/// PSN it starts from, the READs/atomics this side serves at once, the RNR timer it
/// asks the peer to wait), RTS (the PSN this side starts from, its ACK timeout and
/// retries, the READs/atomics it has outstanding). Written out for the reader; the tests
/// take the same steps through `softrdma_testkit::QpCfg`.
fn connect(nic: &mut Rnic, me: &Side, peer_gid: Gid, peer_qpn: Qpn) -> Result<()> {
    let mut a = QpAttr {
        qp_state: QpState::Init,
        port_num: 1,
        qp_access_flags: Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC,
        ..Default::default()
    };
    nic.modify_qp(
        0,
        me.qpn,
        &a,
        QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS,
    )?;
    a.qp_state = QpState::Rtr;
    a.path_mtu = Mtu::Mtu1024;
    a.dest_qp_num = peer_qpn;
    a.rq_psn = 0;
    a.max_dest_rd_atomic = 4;
    a.min_rnr_timer = 12;
    a.ah_attr = AhAttr::roce(peer_gid, 0);
    nic.modify_qp(
        0,
        me.qpn,
        &a,
        QpAttrMask::STATE
            | QpAttrMask::AV
            | QpAttrMask::PATH_MTU
            | QpAttrMask::DEST_QPN
            | QpAttrMask::RQ_PSN
            | QpAttrMask::MAX_DEST_RD_ATOMIC
            | QpAttrMask::MIN_RNR_TIMER,
    )?;
    a.qp_state = QpState::Rts;
    a.sq_psn = 0;
    a.timeout = 14;
    a.retry_cnt = 7;
    a.rnr_retry = 7;
    a.max_rd_atomic = 4;
    nic.modify_qp(
        0,
        me.qpn,
        &a,
        QpAttrMask::STATE
            | QpAttrMask::SQ_PSN
            | QpAttrMask::TIMEOUT
            | QpAttrMask::RETRY_CNT
            | QpAttrMask::RNR_RETRY
            | QpAttrMask::MAX_QP_RD_ATOMIC,
    )?;
    Ok(())
}

/// Runs the network until `cq` of device `dev` yields a completion; returns it.
fn wait(sim: &mut Sim<Dev>, dev: usize, cq: CqId) -> Option<WorkCompletion> {
    let mut got = None;
    let deadline = sim.now + 5_000_000_000;
    sim.run_until(deadline, |s| {
        let mut wc = [WorkCompletion::default()];
        if let Ok(1) = s.endpoints[dev].nic.poll_cq(cq, &mut wc) {
            got = Some(wc[0]);
        }
        got.is_some()
    });
    got
}

fn show_wc(who: &str, wc: &WorkCompletion) {
    println!(
        "    {who} completion: wr_id={} status={:?} opcode={:?} byte_len={} imm=0x{:x} flags={:?}",
        wc.wr_id, wc.status, wc.opcode, wc.byte_len, wc.imm_data, wc.wc_flags
    );
}

fn print_packets(sim: &mut Sim<Dev>, printed: &mut [usize; 2], names: [&str; 2]) {
    let mut all: Vec<(u64, usize, Packet)> = Vec::new();
    for (i, dev) in sim.endpoints.iter().enumerate() {
        for (t, p) in &dev.sent[printed[i]..] {
            all.push((*t, i, p.clone()));
        }
        printed[i] = dev.sent.len();
    }
    all.sort_by_key(|(t, i, _)| (*t, *i));
    for (t, i, p) in all {
        let line = match Headers::parse(&p.data) {
            Ok((h, payload)) => {
                let mut s = format!(
                    "{:>9.3} µs  {} -> {}  {:<28} psn={:<3} dqp=0x{:06x}{}",
                    t as f64 / 1e3,
                    names[i],
                    names[1 - i],
                    h.bth.opcode.to_string(),
                    h.bth.psn,
                    h.bth.dest_qp,
                    if h.bth.ack_req { " ackreq" } else { "" }
                );
                if let Some(r) = h.reth {
                    s += &format!(" va=0x{:x} rkey=0x{:08x} len={}", r.va, r.rkey, r.dma_len);
                }
                if let Some(a) = h.aeth {
                    s += &format!(" {:?} msn={}", a.syndrome, a.msn);
                }
                if let Some(a) = h.atomic_eth {
                    s += &format!(" va=0x{:x} add={}", a.va, a.swap_add);
                }
                if let Some(a) = h.atomic_ack {
                    s += &format!(" orig={}", a.orig);
                }
                if let Some(imm) = h.imm {
                    s += &format!(" imm=0x{imm:08x}");
                }
                if !payload.is_empty() {
                    s += &format!(" payload={}B", payload.len());
                }
                s
            }
            Err(e) => format!("undecodable packet: {e}"),
        };
        println!("  {line}");
    }
}

fn main() {
    if let Err(e) = run() {
        eprintln!("sim_demo: {e}");
        std::process::exit(1);
    }
}

fn run() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let mut pcap_path = None;
    let mut loss = 0.0;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--pcap" => pcap_path = Some(args.next().ok_or("--pcap needs a file name")?),
            "--loss" => {
                loss = args
                    .next()
                    .ok_or("--loss needs a probability")?
                    .parse::<f64>()
                    .map_err(|_| "--loss needs a number between 0 and 1")?;
                if !(0.0..=0.9).contains(&loss) {
                    return Err("--loss must be between 0 and 0.9".into());
                }
            }
            "-h" | "--help" => {
                println!("usage: sim_demo [--pcap FILE] [--loss P]");
                return Ok(());
            }
            other => return Err(format!("unknown argument {other:?} (try --help)").into()),
        }
    }
    let faults = Faults {
        loss,
        ..Faults::default()
    };
    let mut sim = Sim::new(Network::new(1, faults));
    let addr = |n| SocketAddr::new(Ipv4Addr::new(10, 0, 0, n).into(), 4791);
    for (i, n) in [1u8, 2].into_iter().enumerate() {
        sim.add(Dev {
            nic: Rnic::new(addr(n), 100 + i as u64),
            sent: Vec::new(),
        });
    }
    let names = ["A", "B"];
    let a = setup(&mut sim.endpoints[0].nic)?;
    let b = setup(&mut sim.endpoints[1].nic)?;
    let gid = |i: usize, sim: &Sim<Dev>| sim.endpoints[i].nic.gid(0);
    let (ga, gb) = (gid(0, &sim)?, gid(1, &sim)?);
    println!(
        "device A 10.0.0.1 qpn 0x{:06x}, device B 10.0.0.2 qpn 0x{:06x}",
        a.qpn, b.qpn
    );
    connect(&mut sim.endpoints[0].nic, &a, gb, b.qpn)?;
    connect(&mut sim.endpoints[1].nic, &b, ga, a.qpn)?;
    let mut printed = [0usize; 2];

    println!("\n1. A SENDs 3000 bytes (three 1024-byte MTU packets) into a receive B posted");
    let pattern: Vec<u8> = (0..3000).map(|i| i as u8).collect();
    a.put(0, &pattern);
    let now = sim.now;
    sim.endpoints[1].nic.post_recv(
        now,
        b.qpn,
        RecvWr {
            wr_id: 1,
            sg_list: vec![Sge {
                addr: b.mr.addr,
                length: 4096,
                lkey: b.mr.lkey,
            }],
        },
    )?;
    sim.endpoints[0].nic.post_send(
        now,
        a.qpn,
        SendWr {
            wr_id: 10,
            op: SendOp::Send,
            flags: SendFlags::SIGNALED,
            sg_list: vec![Sge {
                addr: a.mr.addr,
                length: 3000,
                lkey: a.mr.lkey,
            }],
            inline_data: None,
            ud: None,
        },
    )?;
    let wb = wait(&mut sim, 1, b.cq).ok_or("B got no receive completion")?;
    let wa = wait(&mut sim, 0, a.cq).ok_or("A got no send completion")?;
    print_packets(&mut sim, &mut printed, names);
    show_wc("B", &wb);
    show_wc("A", &wa);

    println!("\n2. A WRITEs 16 bytes with immediate data into B's memory at offset 4096");
    a.put(0, b"written by A!!!!");
    let now = sim.now;
    sim.endpoints[1].nic.post_recv(
        now,
        b.qpn,
        RecvWr {
            wr_id: 2,
            sg_list: vec![],
        },
    )?;
    sim.endpoints[0].nic.post_send(
        now,
        a.qpn,
        SendWr {
            wr_id: 11,
            op: SendOp::WriteWithImm {
                remote_addr: b.mr.addr + 4096,
                rkey: b.mr.rkey,
                imm: 0xC0FFEE,
            },
            flags: SendFlags::SIGNALED,
            sg_list: vec![Sge {
                addr: a.mr.addr,
                length: 16,
                lkey: a.mr.lkey,
            }],
            inline_data: None,
            ud: None,
        },
    )?;
    let wb = wait(&mut sim, 1, b.cq).ok_or("B got no completion")?;
    let wa = wait(&mut sim, 0, a.cq).ok_or("A got no completion")?;
    print_packets(&mut sim, &mut printed, names);
    show_wc("B", &wb);
    show_wc("A", &wa);
    let seen: [u8; 16] = b.get(4096);
    println!(
        "    B's memory now holds {:?}",
        String::from_utf8_lossy(&seen)
    );

    println!(
        "\n3. A READs those 16 bytes back into its own memory at offset 5000 (B does nothing)"
    );
    let now = sim.now;
    sim.endpoints[0].nic.post_send(
        now,
        a.qpn,
        SendWr {
            wr_id: 12,
            op: SendOp::Read {
                remote_addr: b.mr.addr + 4096,
                rkey: b.mr.rkey,
            },
            flags: SendFlags::SIGNALED,
            sg_list: vec![Sge {
                addr: a.mr.addr + 5000,
                length: 16,
                lkey: a.mr.lkey,
            }],
            inline_data: None,
            ud: None,
        },
    )?;
    let wa = wait(&mut sim, 0, a.cq).ok_or("A got no completion")?;
    print_packets(&mut sim, &mut printed, names);
    show_wc("A", &wa);
    println!(
        "    A read back {:?}",
        String::from_utf8_lossy(&a.get::<16>(5000))
    );

    println!(
        "\n4. A atomically adds 5 to a counter in B's memory; the old value lands in A's buffer"
    );
    b.put(6000, &37u64.to_ne_bytes());
    let now = sim.now;
    sim.endpoints[0].nic.post_send(
        now,
        a.qpn,
        SendWr {
            wr_id: 13,
            op: SendOp::FetchAdd {
                remote_addr: b.mr.addr + 6000,
                rkey: b.mr.rkey,
                add: 5,
            },
            flags: SendFlags::SIGNALED,
            sg_list: vec![Sge {
                addr: a.mr.addr + 6000,
                length: 8,
                lkey: a.mr.lkey,
            }],
            inline_data: None,
            ud: None,
        },
    )?;
    let wa = wait(&mut sim, 0, a.cq).ok_or("A got no completion")?;
    print_packets(&mut sim, &mut printed, names);
    show_wc("A", &wa);
    println!(
        "    A fetched {}, B's counter is now {}",
        u64::from_ne_bytes(a.get(6000)),
        u64::from_ne_bytes(b.get(6000))
    );
    let stats = sim.net.stats().clone();
    println!(
        "\nnetwork: {} sent, {} delivered, {} lost; A retransmitted {} packets",
        stats.sent,
        stats.delivered,
        stats.dropped_loss,
        sim.endpoints[0].nic.stats().retransmits
    );
    if let Some(path) = pcap_path {
        let mut w = PcapWriter::new(std::io::BufWriter::new(std::fs::File::create(&path)?))?;
        let mut all: Vec<(u64, Packet)> = sim
            .endpoints
            .iter()
            .flat_map(|d| d.sent.iter().cloned())
            .collect();
        all.sort_by_key(|(t, _)| *t);
        for (t, p) in all {
            let f = frame::emit_ip_udp(&Addrs::new(p.src, p.dst), p.tos, &p.data);
            w.write_packet(t, &f)?;
        }
        w.flush()?;
        println!("wrote {path}");
    }
    Ok(())
}
