//! Independent validation: every implemented opcode, emitted by us, decoded by
//! scapy (`scapy.contrib.roce`, tests/scapy_check.py) and by Wireshark's dissector
//! (tshark), and the CM MADs decoded by tshark. These tests FAIL when the tools are
//! missing, unless `SOFTRDMA_SKIP_EXTERNAL=1` is set; `tests-ext/install.sh` installs them.

use softrdma_wire::cm::{self, CmMsg, CmPath, CmaHeader, Dreq, Ids, Rej, Rep, Req};
use softrdma_wire::{
    frame, icrc, pcap::PcapWriter, Addrs, Aeth, AtomicAckEth, AtomicEth, Bth, Deth, Headers,
    NakCode, Opcode, Position, Reth, Syndrome,
};
use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

const INSTALL: &str = "install them with `sudo /work/main/tests-ext/install.sh` (Debian 12: \
     apt-get install -y tshark python3-pip; python3 -m pip install scapy), \
     or set SOFTRDMA_SKIP_EXTERNAL=1 to skip";

/// Syndromes used, with the byte the IBTA layout gives (type in bits 7..5:
/// 000 ACK, 001 RNR NAK, 011 NAK; value in bits 4..0), written out by hand.
const SYNDROMES: [(Syndrome, u8); 8] = [
    (Syndrome::Ack { credits: 0x1F }, 0x1F),
    (Syndrome::Ack { credits: 7 }, 0x07),
    (Syndrome::RnrNak { timer: 14 }, 0x2E),
    (Syndrome::Nak(NakCode::PsnSequenceError), 0x60),
    (Syndrome::Nak(NakCode::InvalidRequest), 0x61),
    (Syndrome::Nak(NakCode::RemoteAccessError), 0x62),
    (Syndrome::Nak(NakCode::RemoteOperationalError), 0x63),
    (Syndrome::Nak(NakCode::InvalidRdRequest), 0x64),
];

fn syndrome_byte(s: Syndrome) -> u8 {
    SYNDROMES.iter().find(|x| x.0 == s).unwrap().1
}

/// One emitted packet and what we put into it.
struct Case {
    addrs: Addrs,
    h: Headers,
    payload: Vec<u8>,
    /// UDP payload: BTH .. ICRC (sealed).
    udp: Vec<u8>,
    /// IP + UDP frame.
    frame: Vec<u8>,
}

fn cases() -> Vec<Case> {
    let v4 = Addrs::new(
        "10.47.91.1:49370".parse().unwrap(),
        "10.47.91.2:4791".parse().unwrap(),
    );
    let v6 = Addrs::new(
        "[fd47:91::1]:51670".parse().unwrap(),
        "[fd47:91::2]:4791".parse().unwrap(),
    );
    let syndromes: Vec<Syndrome> = SYNDROMES.iter().map(|s| s.0).collect();
    let mut out = Vec::new();
    for (n, info) in Opcode::all().enumerate() {
        for (k, addrs) in [v4, v6].into_iter().enumerate() {
            let i = (n * 2 + k) as u32;
            let bth = Bth {
                opcode: info.opcode,
                solicited: i % 2 == 1,
                mig_req: i % 3 == 0,
                pad: 0,
                tver: 0,
                pkey: 0x8000 | ((0x0101 * i as u16) & 0x7FFF),
                fecn: i % 4 == 1,
                becn: i % 5 == 2,
                dest_qp: 0x10_0000 + 0x1357 * i,
                ack_req: i % 2 == 0,
                psn: (0xFF_FFF0 + 0x3_1415 * i) & 0xFF_FFFF,
            };
            let mut h = Headers::new(bth);
            if info.has_deth {
                h.deth = Some(Deth {
                    qkey: 0x8001_0000 + i,
                    src_qp: 0xA_BC00 + i,
                });
            }
            if info.has_reth {
                h.reth = Some(Reth {
                    va: 0x0000_7F12_3456_7800 + u64::from(i),
                    rkey: 0x00AB_CD00 + i,
                    dma_len: 0x0001_0000 + i,
                });
            }
            if info.has_atomic_eth {
                h.atomic_eth = Some(AtomicEth {
                    va: 0x0000_7FFE_DCBA_9870 + 8 * u64::from(i),
                    rkey: 0x0012_3400 + i,
                    swap_add: 0x1111_2222_3333_4444 + u64::from(i),
                    compare: 0x5555_6666_7777_8888 + u64::from(i),
                });
            }
            if info.has_aeth {
                h.aeth = Some(Aeth {
                    syndrome: syndromes[i as usize % syndromes.len()],
                    msn: 0x00_4321 + i,
                });
            }
            if info.has_atomic_ack_eth {
                h.atomic_ack = Some(AtomicAckEth {
                    orig: 0x0123_4567_89AB_CDEF + u64::from(i),
                });
            }
            if info.has_immdt {
                h.imm = Some(0xC0DE_0000 + i);
            }
            if info.has_ieth {
                h.ieth = Some(0x0BAD_0000 + i);
            }
            let payload: Vec<u8> = if !info.has_payload {
                Vec::new()
            } else if matches!(info.position, Position::First | Position::Middle) {
                (0..64u8).map(|b| b ^ i as u8).collect()
            } else {
                // 1..=4 mod 4: exercises every pad count
                (0..(13 + i as u8))
                    .map(|b| b.wrapping_mul(7) ^ 0x5A)
                    .collect()
            };
            h.bth.pad = ((4 - payload.len() % 4) % 4) as u8;
            let mut udp = vec![0u8; h.packet_len(payload.len())];
            h.emit(&payload, &mut udp).unwrap();
            icrc::seal(&addrs, &mut udp);
            // our own parser agrees before anyone else looks
            assert_eq!(Headers::parse(&udp), Ok((h, &payload[..])));
            let tos = (i as u8) << 2;
            let frame = frame::emit_ip_udp(&addrs, tos, &udp);
            out.push(Case {
                addrs,
                h,
                payload,
                udp,
                frame,
            });
        }
    }
    out
}

fn skip() -> bool {
    if std::env::var("SOFTRDMA_SKIP_EXTERNAL").is_ok_and(|v| v == "1") {
        eprintln!("SOFTRDMA_SKIP_EXTERNAL=1: external validators skipped");
        return true;
    }
    false
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn tmp_path(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("softrdma-wire-ext-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn kv(line: &str) -> HashMap<String, String> {
    line.split_whitespace()
        .filter_map(|t| t.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// scapy_check.py's line for each frame (panics, saying how to install it, when scapy
/// is missing).
fn scapy(frames: &[&[u8]]) -> String {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/scapy_check.py");
    let probe = Command::new("python3")
        .args(["-c", "import scapy.contrib.roce"])
        .output();
    match probe {
        Ok(o) if o.status.success() => {}
        Ok(o) => panic!(
            "python3 cannot import scapy.contrib.roce ({}); {INSTALL}",
            String::from_utf8_lossy(&o.stderr).trim()
        ),
        Err(e) => panic!("python3 not found ({e}); {INSTALL}"),
    }
    let input: String = frames.iter().map(|f| hex(f) + "\n").collect();
    let mut child = Command::new("python3")
        .arg(&script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn python3");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "scapy_check.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn scapy_decodes_every_opcode() {
    if skip() {
        return;
    }
    let cases = cases();
    let frames: Vec<&[u8]> = cases.iter().map(|c| c.frame.as_slice()).collect();
    let text = scapy(&frames);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), cases.len(), "one line per packet:\n{text}");
    let mut aeth_checked = 0;
    for (c, line) in cases.iter().zip(lines) {
        let m = kv(line);
        let name = c.h.bth.opcode.to_string();
        let get = |k: &str| -> u64 {
            m.get(k)
                .unwrap_or_else(|| panic!("{name}: scapy gave no {k}: {line}"))
                .parse()
                .unwrap()
        };
        let b = &c.h.bth;
        assert_eq!(get("opcode"), u64::from(b.opcode.0), "{name}");
        assert_eq!(get("solicited"), u64::from(b.solicited), "{name}");
        assert_eq!(get("migreq"), u64::from(b.mig_req), "{name}");
        assert_eq!(get("padcount"), u64::from(b.pad), "{name}");
        assert_eq!(get("version"), 0, "{name}");
        assert_eq!(get("pkey"), u64::from(b.pkey), "{name}");
        assert_eq!(get("fecn"), u64::from(b.fecn), "{name}");
        assert_eq!(get("becn"), u64::from(b.becn), "{name}");
        assert_eq!(get("dqpn"), u64::from(b.dest_qp), "{name}");
        assert_eq!(get("ackreq"), u64::from(b.ack_req), "{name}");
        assert_eq!(get("psn"), u64::from(b.psn), "{name}");
        assert_eq!(get("sport"), u64::from(c.addrs.src.port()), "{name}");
        assert_eq!(get("dport"), 4791, "{name}");
        if let Some(a) = &c.h.aeth {
            if m.contains_key("aeth_syndrome") {
                assert_eq!(
                    get("aeth_syndrome"),
                    u64::from(syndrome_byte(a.syndrome)),
                    "{name}"
                );
                assert_eq!(get("aeth_msn"), u64::from(a.msn), "{name}");
                aeth_checked += 1;
            }
        }
        // headers scapy does not model: the raw bytes after the BTH, up to the ICRC
        let rest = &c.udp[12..c.udp.len() - 4];
        let want = if rest.is_empty() {
            "-".to_string()
        } else {
            hex(rest)
        };
        assert_eq!(m["rest"], want, "{name}");
        assert_eq!(m["icrc_stored"], hex(&c.udp[c.udp.len() - 4..]), "{name}");
        assert_eq!(
            m["icrc_scapy"], m["icrc_stored"],
            "{name}: scapy's ICRC differs from ours"
        );
        let _ = &c.payload;
    }
    assert!(aeth_checked >= 2, "scapy decoded the AETH of the ACKs");
}

/// Parse a tshark field value: decimal, 0x-hex, or a boolean.
fn num(v: &str) -> Option<u64> {
    let v = v.trim();
    match v {
        "" => None,
        "True" | "true" => Some(1),
        "False" | "false" => Some(0),
        _ => match v.strip_prefix("0x") {
            Some(h) => u64::from_str_radix(h, 16).ok(),
            None => v.parse().ok(),
        },
    }
}

fn bytes_field(v: &str) -> String {
    v.replace(':', "").to_ascii_lowercase()
}

#[test]
fn tshark_decodes_every_opcode() {
    if skip() {
        return;
    }
    match Command::new("tshark").arg("--version").output() {
        Ok(o) if o.status.success() => {}
        _ => panic!("tshark not found; {INSTALL}"),
    }
    let cases = cases();
    let path = tmp_path("all-opcodes.pcap");
    {
        let f = std::fs::File::create(&path).unwrap();
        let mut w = PcapWriter::new(std::io::BufWriter::new(f)).unwrap();
        for (n, c) in cases.iter().enumerate() {
            w.write_packet(1_700_000_000_000_000_000 + n as u64 * 1000, &c.frame)
                .unwrap();
        }
        w.flush().unwrap();
    }
    const FIELDS: &[&str] = &[
        "frame.number",
        "infiniband.bth.opcode",
        "infiniband.bth.se",
        "infiniband.bth.m",
        "infiniband.bth.padcnt",
        "infiniband.bth.tver",
        "infiniband.bth.p_key",
        "infiniband.bth.destqp",
        "infiniband.bth.a",
        "infiniband.bth.psn",
        "infiniband.deth.q_key",
        "infiniband.deth.srcqp",
        "infiniband.reth.va",
        "infiniband.reth.r_key",
        "infiniband.reth.dmalen",
        "infiniband.atomiceth.swapdt",
        "infiniband.atomiceth.cmpdt",
        "infiniband.aeth.syndrome",
        "infiniband.aeth.msn",
        "infiniband.aeth.syndrome.opcode",
        "infiniband.aeth.syndrome.credit_count",
        "infiniband.aeth.syndrome.timer",
        "infiniband.aeth.syndrome.error_code",
        "infiniband.atomicacketh.origremdt",
        "infiniband.immdt",
        "infiniband.ieth",
        "infiniband.invariant.crc",
        "udp.srcport",
        "udp.dstport",
        "ip.src",
        "ipv6.src",
    ];
    let mut cmd = Command::new("tshark");
    cmd.arg("-r")
        .arg(&path)
        .args(["-T", "fields", "-E", "separator=/t", "-E", "occurrence=f"]);
    for f in FIELDS {
        cmd.args(["-e", f]);
    }
    let out = cmd.output().expect("run tshark");
    assert!(
        out.status.success(),
        "tshark failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let rows: Vec<Vec<&str>> = text.lines().map(|l| l.split('\t').collect()).collect();
    assert_eq!(rows.len(), cases.len(), "one row per packet:\n{text}");
    for (c, row) in cases.iter().zip(&rows) {
        assert_eq!(row.len(), FIELDS.len(), "{row:?}");
        let f: HashMap<&str, &str> = FIELDS.iter().copied().zip(row.iter().copied()).collect();
        let name = c.h.bth.opcode.to_string();
        let n =
            |k: &str| num(f[k]).unwrap_or_else(|| panic!("{name}: tshark gave no {k}: {row:?}"));
        let b = &c.h.bth;
        assert_eq!(n("infiniband.bth.opcode"), u64::from(b.opcode.0), "{name}");
        assert_eq!(n("infiniband.bth.se"), u64::from(b.solicited), "{name}");
        assert_eq!(n("infiniband.bth.m"), u64::from(b.mig_req), "{name}");
        assert_eq!(n("infiniband.bth.padcnt"), u64::from(b.pad), "{name}");
        assert_eq!(n("infiniband.bth.tver"), 0, "{name}");
        assert_eq!(n("infiniband.bth.p_key"), u64::from(b.pkey), "{name}");
        assert_eq!(n("infiniband.bth.destqp"), u64::from(b.dest_qp), "{name}");
        assert_eq!(n("infiniband.bth.a"), u64::from(b.ack_req), "{name}");
        assert_eq!(n("infiniband.bth.psn"), u64::from(b.psn), "{name}");
        assert_eq!(n("udp.srcport"), u64::from(c.addrs.src.port()), "{name}");
        assert_eq!(n("udp.dstport"), 4791, "{name}");
        let opt = |k: &str| num(f[k]);
        match &c.h.deth {
            Some(d) => {
                assert_eq!(
                    opt("infiniband.deth.q_key"),
                    Some(u64::from(d.qkey)),
                    "{name}"
                );
                assert_eq!(
                    opt("infiniband.deth.srcqp"),
                    Some(u64::from(d.src_qp)),
                    "{name}"
                );
            }
            None => assert_eq!(f["infiniband.deth.q_key"], "", "{name}"),
        }
        match &c.h.reth {
            Some(r) => {
                assert_eq!(opt("infiniband.reth.va"), Some(r.va), "{name}");
                assert_eq!(
                    opt("infiniband.reth.r_key"),
                    Some(u64::from(r.rkey)),
                    "{name}"
                );
                assert_eq!(
                    opt("infiniband.reth.dmalen"),
                    Some(u64::from(r.dma_len)),
                    "{name}"
                );
            }
            None if c.h.atomic_eth.is_none() => {
                assert_eq!(f["infiniband.reth.va"], "", "{name}")
            }
            None => {}
        }
        match &c.h.atomic_eth {
            Some(a) => {
                assert_eq!(
                    opt("infiniband.atomiceth.swapdt"),
                    Some(a.swap_add),
                    "{name}"
                );
                assert_eq!(opt("infiniband.atomiceth.cmpdt"), Some(a.compare), "{name}");
                // Wireshark shows the AtomicETH VA and R_Key under the RETH field names
                assert_eq!(opt("infiniband.reth.va"), Some(a.va), "{name}");
                assert_eq!(
                    opt("infiniband.reth.r_key"),
                    Some(u64::from(a.rkey)),
                    "{name}"
                );
            }
            None => assert_eq!(f["infiniband.atomiceth.swapdt"], "", "{name}"),
        }
        match &c.h.aeth {
            Some(a) => {
                assert_eq!(
                    opt("infiniband.aeth.syndrome"),
                    Some(u64::from(syndrome_byte(a.syndrome))),
                    "{name}"
                );
                // Wireshark's own decoding of the syndrome bits
                let (ty, field, value) = match a.syndrome {
                    Syndrome::Ack { credits } => (0, "credit_count", credits),
                    Syndrome::RnrNak { timer } => (1, "timer", timer),
                    Syndrome::Nak(code) => (3, "error_code", code as u8),
                };
                assert_eq!(opt("infiniband.aeth.syndrome.opcode"), Some(ty), "{name}");
                assert_eq!(
                    opt(&format!("infiniband.aeth.syndrome.{field}")),
                    Some(u64::from(value)),
                    "{name}: {row:?}"
                );
                assert_eq!(opt("infiniband.aeth.msn"), Some(u64::from(a.msn)), "{name}");
            }
            None => assert_eq!(f["infiniband.aeth.syndrome"], "", "{name}"),
        }
        match &c.h.atomic_ack {
            Some(a) => assert_eq!(
                opt("infiniband.atomicacketh.origremdt"),
                Some(a.orig),
                "{name}"
            ),
            None => assert_eq!(f["infiniband.atomicacketh.origremdt"], "", "{name}"),
        }
        match c.h.imm {
            Some(i) => assert_eq!(
                bytes_field(f["infiniband.immdt"]),
                hex(&i.to_be_bytes()),
                "{name}"
            ),
            None => assert_eq!(f["infiniband.immdt"], "", "{name}"),
        }
        match c.h.ieth {
            Some(i) => assert_eq!(
                bytes_field(f["infiniband.ieth"]),
                hex(&i.to_be_bytes()),
                "{name}"
            ),
            None => assert_eq!(f["infiniband.ieth"], "", "{name}"),
        }
        // tshark shows the ICRC bytes as a big-endian number
        let stored = &c.udp[c.udp.len() - 4..];
        assert_eq!(
            opt("infiniband.invariant.crc"),
            Some(u64::from(u32::from_be_bytes([
                stored[0], stored[1], stored[2], stored[3]
            ]))),
            "{name}"
        );
    }
    let _ = std::fs::remove_file(&path);
}

// The CM MADs: REQ (with the rdma_cm header in its private data), REP, REJ, RTU and DREQ,
// emitted as rdma_cm sends them over RoCEv2 (UD SEND to QP1, Q_Key 0x80010000).

/// A RoCEv2 UD SEND of `mad` from QP1 to QP1, as an IP/UDP frame.
fn cm_gsi_frame(addrs: &Addrs, psn: u32, mad: &[u8]) -> Vec<u8> {
    let mut h = Headers::new(Bth::new(Opcode::UD_SEND_ONLY, cm::GSI_QPN, psn));
    h.deth = Some(Deth {
        qkey: cm::GSI_QKEY,
        src_qp: cm::GSI_QPN,
    });
    let mut udp = vec![0u8; h.packet_len(mad.len())];
    let at = h.emit_header(mad.len(), &mut udp).unwrap();
    udp[at..at + mad.len()].copy_from_slice(mad);
    icrc::seal(addrs, &mut udp);
    frame::emit_ip_udp(addrs, 0, &udp)
}

fn cm_req() -> Req {
    let mut private_data = [0u8; cm::private_len::REQ];
    CmaHeader {
        src_port: 0xC123,
        src: "10.47.91.1".parse().unwrap(),
        dst: "10.47.91.2".parse().unwrap(),
    }
    .emit(&mut private_data)
    .unwrap();
    private_data[cm::CMA_HEADER_LEN..cm::CMA_HEADER_LEN + 5].copy_from_slice(b"hello");
    let gid = |last: u8| [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xFF, 0xFF, 10, 47, 91, last];
    Req {
        local_comm_id: 0x1A2B_3C4D,
        service_id: cm::service_id(cm::port_space::TCP, 7174),
        local_ca_guid: 0x0002_C903_0011_2233,
        local_qkey: 0,
        local_qpn: 0x01_2345,
        responder_resources: 16,
        local_eecn: 0,
        initiator_depth: 8,
        remote_eecn: 0,
        remote_cm_response_timeout: 20,
        transport_service_type: 0,
        e2e_flow_control: true,
        starting_psn: 0x65_4321,
        local_cm_response_timeout: 20,
        retry_count: 7,
        pkey: 0xFFFF,
        path_mtu: 3,
        rdc_exists: false,
        rnr_retry_count: 7,
        max_cm_retries: 15,
        srq: false,
        extended_transport_type: 0,
        primary: CmPath {
            local_lid: 0xFFFF,
            remote_lid: 0xFFFF,
            local_gid: gid(1),
            remote_gid: gid(2),
            flow_label: 0,
            packet_rate: 0,
            traffic_class: 0,
            hop_limit: 64,
            sl: 0,
            subnet_local: false,
            local_ack_timeout: 18,
        },
        alternate: CmPath::default(),
        sap_supported: false,
        private_data,
    }
}

#[test]
fn tshark_decodes_cm_mads() {
    if skip() {
        return;
    }
    match Command::new("tshark").arg("--version").output() {
        Ok(o) if o.status.success() => {}
        _ => panic!(
            "tshark not found: install it (apt-get install tshark) or set SOFTRDMA_SKIP_EXTERNAL=1"
        ),
    }
    let a = Addrs::new(
        "10.47.91.1:49153".parse().unwrap(),
        "10.47.91.2:4791".parse().unwrap(),
    );
    let b = Addrs::new(
        "10.47.91.2:49153".parse().unwrap(),
        "10.47.91.1:4791".parse().unwrap(),
    );
    let mut rep_private = [0u8; cm::private_len::REP];
    rep_private[..3].copy_from_slice(b"rep");
    let msgs: Vec<(Addrs, CmMsg)> = vec![
        (a, CmMsg::Req(Box::new(cm_req()))),
        (
            b,
            CmMsg::Rep(Box::new(Rep {
                local_comm_id: 0x5E6F_7081,
                remote_comm_id: 0x1A2B_3C4D,
                local_qkey: 0,
                local_qpn: 0x05_4321,
                local_eecn: 0,
                starting_psn: 0x12_3456,
                responder_resources: 4,
                initiator_depth: 2,
                target_ack_delay: 15,
                failover_accepted: 0,
                e2e_flow_control: true,
                rnr_retry_count: 6,
                srq: true,
                local_ca_guid: 0x0002_C903_0044_5566,
                private_data: rep_private,
            })),
        ),
        (
            a,
            CmMsg::Rtu(Box::new(Ids {
                local_comm_id: 0x1A2B_3C4D,
                remote_comm_id: 0x5E6F_7081,
                private_data: [0; cm::private_len::RTU],
            })),
        ),
        (
            b,
            CmMsg::Dreq(Box::new(Dreq {
                ids: Ids {
                    local_comm_id: 0x5E6F_7081,
                    remote_comm_id: 0x1A2B_3C4D,
                    private_data: [0; cm::private_len::DREQ],
                },
                remote_qpn: 0x01_2345,
            })),
        ),
        (
            b,
            CmMsg::Rej(Box::new(Rej {
                local_comm_id: 0x0BAD_F00D,
                remote_comm_id: 0x1A2B_3C4D,
                message_rejected: 0,
                rejected_info_length: 0,
                reason: cm::rej_reason::CONSUMER_REJECT,
                ari: [0; 72],
                private_data: [0x42; cm::private_len::REJ],
            })),
        ),
    ];
    let path = tmp_path("cm.pcap");
    {
        let f = std::fs::File::create(&path).unwrap();
        let mut w = PcapWriter::new(std::io::BufWriter::new(f)).unwrap();
        for (n, (addrs, m)) in msgs.iter().enumerate() {
            let mad = m.emit(0x100 + n as u64);
            w.write_packet(
                1_700_000_000_000_000_000 + n as u64 * 1000,
                &cm_gsi_frame(addrs, n as u32, &mad),
            )
            .unwrap();
        }
        w.flush().unwrap();
    }
    const FIELDS: &[&str] = &[
        "infiniband.invariant.crc",
        "infiniband.deth.q_key",
        "infiniband.mad.mgmtclass",
        "infiniband.mad.classversion",
        "infiniband.mad.method",
        "infiniband.mad.transactionid",
        "infiniband.mad.attributeid",
        "infiniband.cm.req",
        "infiniband.cm.req.serviceid",
        "infiniband.cm.req.localqpn",
        "infiniband.cm.req.responderres",
        "infiniband.cm.req.initdepth",
        "infiniband.cm.req.remoteresptout",
        "infiniband.cm.req.e2eflowctrl",
        "infiniband.cm.req.startpsn",
        "infiniband.cm.req.localresptout",
        "infiniband.cm.req.retrcount",
        "infiniband.cm.req.pkey",
        "infiniband.cm.req.pppmtu",
        "infiniband.cm.req.rnrretrcount",
        "infiniband.cm.req.maxcmretr",
        "infiniband.cm.req.prim_hoplim",
        "infiniband.cm.req.prim_localacktout",
        "infiniband.cm.req.ip_cm.ipv",
        "infiniband.cm.req.ip_cm.sport",
        "infiniband.cm.req.ip_cm.sip4",
        "infiniband.cm.req.ip_cm.dip4",
        "infiniband.cm.rep",
        "infiniband.cm.rep.remotecommid",
        "infiniband.cm.rep.localqpn",
        "infiniband.cm.rep.startpsn",
        "infiniband.cm.rep.respres",
        "infiniband.cm.rep.initdepth",
        "infiniband.cm.rep.tgtackdelay",
        "infiniband.cm.rep.rnrretrcount",
        "infiniband.cm.rep.srq",
        "infiniband.cm.rtu.localcommid",
        "infiniband.cm.rtu.remotecommid",
        "infiniband.cm.dreq.localcommid",
        "infiniband.cm.dreq.remotecommid",
        "infiniband.cm.rej.localcommid",
        "infiniband.cm.rej.remotecommid",
        "infiniband.cm.rej.reason",
    ];
    let mut cmd = Command::new("tshark");
    cmd.arg("-r")
        .arg(&path)
        .args(["-T", "fields", "-E", "separator=/t", "-E", "occurrence=f"]);
    for f in FIELDS {
        cmd.args(["-e", f]);
    }
    let out = cmd.output().expect("run tshark");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "tshark failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<Vec<&str>> = text.lines().map(|l| l.split('\t').collect()).collect();
    assert_eq!(rows.len(), msgs.len(), "one row per packet:\n{text}");
    let field = |row: usize, name: &str| -> u64 {
        let i = FIELDS.iter().position(|f| *f == name).unwrap();
        let v = rows[row].get(i).copied().unwrap_or("");
        num(v).unwrap_or_else(|| panic!("packet {row}: {name} = {v:?}:\n{text}"))
    };
    let text_field = |row: usize, name: &str| -> String {
        let i = FIELDS.iter().position(|f| *f == name).unwrap();
        rows[row].get(i).copied().unwrap_or("").trim().to_string()
    };
    for (row, (_, m)) in msgs.iter().enumerate() {
        assert_eq!(field(row, "infiniband.deth.q_key"), 0x8001_0000);
        assert_eq!(field(row, "infiniband.mad.mgmtclass"), 0x07);
        assert_eq!(field(row, "infiniband.mad.classversion"), 2);
        assert_eq!(field(row, "infiniband.mad.method"), 0x03);
        assert_eq!(
            field(row, "infiniband.mad.transactionid"),
            0x100 + row as u64
        );
        assert_eq!(field(row, "infiniband.mad.attributeid"), m.attr() as u64);
        assert!(
            !text_field(row, "infiniband.invariant.crc").is_empty(),
            "packet {row}: no ICRC decoded"
        );
    }
    let r = cm_req();
    assert_eq!(field(0, "infiniband.cm.req"), u64::from(r.local_comm_id));
    assert_eq!(field(0, "infiniband.cm.req.serviceid"), r.service_id);
    assert_eq!(
        field(0, "infiniband.cm.req.localqpn"),
        u64::from(r.local_qpn)
    );
    assert_eq!(field(0, "infiniband.cm.req.responderres"), 16);
    assert_eq!(field(0, "infiniband.cm.req.initdepth"), 8);
    assert_eq!(field(0, "infiniband.cm.req.remoteresptout"), 20);
    assert_eq!(field(0, "infiniband.cm.req.e2eflowctrl"), 1);
    assert_eq!(field(0, "infiniband.cm.req.startpsn"), 0x65_4321);
    assert_eq!(field(0, "infiniband.cm.req.localresptout"), 20);
    assert_eq!(field(0, "infiniband.cm.req.retrcount"), 7);
    assert_eq!(field(0, "infiniband.cm.req.pkey"), 0xFFFF);
    assert_eq!(field(0, "infiniband.cm.req.pppmtu"), 3);
    assert_eq!(field(0, "infiniband.cm.req.rnrretrcount"), 7);
    assert_eq!(field(0, "infiniband.cm.req.maxcmretr"), 15);
    assert_eq!(field(0, "infiniband.cm.req.prim_hoplim"), 64);
    assert_eq!(field(0, "infiniband.cm.req.prim_localacktout"), 18);
    assert_eq!(field(0, "infiniband.cm.req.ip_cm.ipv"), 4);
    assert_eq!(field(0, "infiniband.cm.req.ip_cm.sport"), 0xC123);
    assert_eq!(text_field(0, "infiniband.cm.req.ip_cm.sip4"), "10.47.91.1");
    assert_eq!(text_field(0, "infiniband.cm.req.ip_cm.dip4"), "10.47.91.2");
    assert_eq!(field(1, "infiniband.cm.rep"), 0x5E6F_7081);
    assert_eq!(field(1, "infiniband.cm.rep.remotecommid"), 0x1A2B_3C4D);
    assert_eq!(field(1, "infiniband.cm.rep.localqpn"), 0x05_4321);
    assert_eq!(field(1, "infiniband.cm.rep.startpsn"), 0x12_3456);
    assert_eq!(field(1, "infiniband.cm.rep.respres"), 4);
    assert_eq!(field(1, "infiniband.cm.rep.initdepth"), 2);
    assert_eq!(field(1, "infiniband.cm.rep.tgtackdelay"), 15);
    assert_eq!(field(1, "infiniband.cm.rep.rnrretrcount"), 6);
    assert_eq!(field(1, "infiniband.cm.rep.srq"), 1);
    assert_eq!(field(2, "infiniband.cm.rtu.localcommid"), 0x1A2B_3C4D);
    assert_eq!(field(2, "infiniband.cm.rtu.remotecommid"), 0x5E6F_7081);
    assert_eq!(field(3, "infiniband.cm.dreq.localcommid"), 0x5E6F_7081);
    assert_eq!(field(3, "infiniband.cm.dreq.remotecommid"), 0x1A2B_3C4D);
    assert_eq!(field(4, "infiniband.cm.rej.localcommid"), 0x0BAD_F00D);
    assert_eq!(field(4, "infiniband.cm.rej.remotecommid"), 0x1A2B_3C4D);
    assert_eq!(field(4, "infiniband.cm.rej.reason"), 28);
}

/// softrdma's SACK extension (opcodes 0xC0 and 0xC1, `softrdma_wire::ext`), over IPv4 and
/// IPv6: scapy reads the BTH fields we wrote and the body that follows, and computes the
/// same ICRC; tshark reads the same BTH.
#[test]
fn decoders_read_the_sack_extension() {
    use softrdma_wire::ext::{Ext, SackBitmap, SACK, SACK_PERMIT, TAG};
    if skip() {
        return;
    }
    let v4 = Addrs::new(
        "10.47.91.2:49371".parse().unwrap(),
        "10.47.91.1:4791".parse().unwrap(),
    );
    let v6 = Addrs::new(
        "[fd47:91::2]:51671".parse().unwrap(),
        "[fd47:91::1]:4791".parse().unwrap(),
    );
    let mut bits = SackBitmap::default();
    for d in [1, 2, 3, 9, 200, 512, 3000] {
        bits.set(d);
    }
    let msgs = [
        Ext::SackPermit(Bth::new(SACK_PERMIT, 0x12_3456, 0xFF_FFFE)),
        Ext::Sack(Bth::new(SACK, 0xAB_CDEF, 77), bits),
    ];
    let mut frames = Vec::new();
    let mut udps = Vec::new();
    for addrs in [v4, v6] {
        for m in &msgs {
            let mut udp = vec![0u8; m.len()];
            m.emit(&mut udp).unwrap();
            icrc::seal(&addrs, &mut udp);
            frames.push(frame::emit_ip_udp(&addrs, 0, &udp));
            udps.push((addrs, *m, udp));
        }
    }
    let refs: Vec<&[u8]> = frames.iter().map(|f| f.as_slice()).collect();
    let text = scapy(&refs);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), udps.len(), "{text}");
    for ((addrs, m, udp), line) in udps.iter().zip(&lines) {
        let f = kv(line);
        let (Ext::SackPermit(b) | Ext::Sack(b, _)) = m;
        assert_eq!(f["opcode"], m_opcode(m).to_string(), "{line}");
        assert_eq!(f["dqpn"], b.dest_qp.to_string(), "{line}");
        assert_eq!(f["psn"], b.psn.to_string(), "{line}");
        assert_eq!(f["sport"], addrs.src.port().to_string(), "{line}");
        let mut body = TAG.to_vec();
        if let Ext::Sack(_, bits) = m {
            body.extend_from_slice(bits.wire_bytes());
        }
        assert_eq!(f["rest"], hex(&body), "{line}");
        assert_eq!(f["icrc_stored"], hex(&udp[udp.len() - 4..]), "{line}");
        assert_eq!(f["icrc_scapy"], f["icrc_stored"], "scapy's ICRC: {line}");
    }
    let path = tmp_path("sack.pcap");
    {
        let file = std::fs::File::create(&path).unwrap();
        let mut w = PcapWriter::new(std::io::BufWriter::new(file)).unwrap();
        for (n, fr) in frames.iter().enumerate() {
            w.write_packet(1_700_000_000_000_000_000 + n as u64 * 1000, fr)
                .unwrap();
        }
        w.flush().unwrap();
    }
    let out = Command::new("tshark")
        .arg("-r")
        .arg(&path)
        .args(["-T", "fields", "-E", "separator=/t", "-E", "occurrence=f"])
        .args(["-e", "infiniband.bth.opcode", "-e", "infiniband.bth.destqp"])
        .args(["-e", "infiniband.bth.psn"])
        .output()
        .unwrap_or_else(|e| panic!("tshark: {e}; {INSTALL}"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let rows: Vec<&str> = text.lines().collect();
    assert_eq!(rows.len(), udps.len(), "{text}");
    for ((_, m, _), row) in udps.iter().zip(rows) {
        let (Ext::SackPermit(b) | Ext::Sack(b, _)) = m;
        let v: Vec<u64> = row.split('\t').map(|x| num(x).unwrap()).collect();
        assert_eq!(v[0], u64::from(m_opcode(m)), "{row}");
        assert_eq!(v[1], u64::from(b.dest_qp), "{row}");
        assert_eq!(v[2], u64::from(b.psn), "{row}");
    }
}

/// The opcode byte an extension message goes out with.
fn m_opcode(m: &softrdma_wire::ext::Ext) -> u8 {
    use softrdma_wire::ext::{Ext, SACK, SACK_PERMIT};
    match m {
        Ext::Sack(..) => SACK.0,
        Ext::SackPermit(_) => SACK_PERMIT.0,
    }
}
