//! Independent validation of the CM MADs: REQ (with the rdma_cm header in its private
//! data), REP, REJ, RTU and DREQ, emitted by us as rdma_cm sends them over RoCEv2 (UD
//! SEND to QP1, Q_Key 0x80010000) and decoded by Wireshark's InfiniBand dissector
//! (tshark). Fails when tshark is missing, unless `SOFTRDMA_SKIP_EXTERNAL=1` is set;
//! `tests-ext/install.sh` installs it.

use std::process::Command;

use softrdma_wire::cm::{self, CmMsg, CmPath, CmaHeader, Dreq, Ids, Rej, Rep, Req};
use softrdma_wire::{frame, icrc, pcap::PcapWriter, Addrs, Bth, Deth, Headers, Opcode};

fn skip() -> bool {
    if std::env::var("SOFTRDMA_SKIP_EXTERNAL").is_ok_and(|v| v == "1") {
        eprintln!("SOFTRDMA_SKIP_EXTERNAL=1: external validators skipped");
        return true;
    }
    false
}

/// A RoCEv2 UD SEND of `mad` from QP1 to QP1, as an IP/UDP frame.
fn gsi_frame(addrs: &Addrs, psn: u32, mad: &[u8]) -> Vec<u8> {
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

fn req() -> Req {
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
        (a, CmMsg::Req(Box::new(req()))),
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
    let dir = std::env::temp_dir().join(format!("softrdma-wire-cm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("cm.pcap");
    {
        let f = std::fs::File::create(&path).unwrap();
        let mut w = PcapWriter::new(std::io::BufWriter::new(f)).unwrap();
        for (n, (addrs, m)) in msgs.iter().enumerate() {
            let mad = m.emit(0x100 + n as u64);
            w.write_packet(
                1_700_000_000_000_000_000 + n as u64 * 1000,
                &gsi_frame(addrs, n as u32, &mad),
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
        let v = rows[row].get(i).copied().unwrap_or("").trim();
        let n = match v.strip_prefix("0x") {
            Some(h) => u64::from_str_radix(h, 16),
            None => v.parse(),
        };
        n.unwrap_or_else(|_| panic!("packet {row}: {name} = {v:?}:\n{text}"))
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
    let r = req();
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
