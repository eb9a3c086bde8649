//! `icrc::verify_unknown_ip_id`: recovering the IPv4 ID a packet was sent with
//! from its ICRC, for receivers on a UDP socket (which hides the IP header).
//!
//! The expected answers come from real IP headers: frames are built with
//! `frame::emit_ip_udp`, their ID patched, and the ICRC recomputed over the whole
//! frame with `icrc::compute_frame` — a code path that never uses the linear
//! algebra under test. The last tests use packets Linux rxe itself sent (captured
//! on tap0 in ../shared/rxe-vm; pcapng in tests-ext/rxe/vectors/).

use softrdma_wire::{frame, icrc, Addrs, SplitMix64};

/// Random bytes from a fixed-seed generator, so every run checks the same cases.
fn bytes(rng: &mut SplitMix64, n: usize) -> Vec<u8> {
    (0..n).map(|_| rng.next_u64() as u8).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn v4_addrs(rng: &mut SplitMix64) -> Addrs {
    let ip = |r: &mut SplitMix64| std::net::Ipv4Addr::from(r.next_u64() as u32);
    let src = std::net::SocketAddr::new(ip(rng).into(), rng.next_u64() as u16);
    let dst = std::net::SocketAddr::new(ip(rng).into(), 4791);
    Addrs::new(src, dst)
}

/// RFC 1071 header checksum, to keep patched headers realistic (the ICRC masks it).
fn fix_ip_checksum(f: &mut [u8]) {
    f[10] = 0;
    f[11] = 0;
    let mut sum: u32 = f[..20]
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], c[1]])))
        .sum();
    while sum > 0xFFFF {
        sum = (sum & 0xFFFF) + (sum >> 16);
    }
    f[10..12].copy_from_slice(&(!(sum as u16)).to_be_bytes());
}

/// An IPv4 frame around `udp_payload` with IP ID `id` and a correct ICRC for that
/// ID, computed from the real header.
fn frame_with_id(addrs: &Addrs, udp_payload: &[u8], id: u16) -> Vec<u8> {
    let mut f = frame::emit_ip_udp(addrs, 0, udp_payload);
    f[4..6].copy_from_slice(&id.to_be_bytes());
    fix_ip_checksum(&mut f);
    let crc = icrc::compute_frame(&f).unwrap();
    let n = f.len();
    f[n - 4..].copy_from_slice(&crc.to_le_bytes());
    assert!(icrc::verify_frame(&f));
    f
}

#[test]
fn random_ids_are_recovered_exactly() {
    let mut rng = SplitMix64::new(0x005e_ed1d);
    for case in 0..2000 {
        let addrs = v4_addrs(&mut rng);
        let len = 16 + rng.below(if case % 10 == 0 { 9000 } else { 1100 }) as usize;
        let id = match case {
            0 => 0,
            1 => 0xFFFF,
            2..=17 => 1 << (case - 2),
            _ => rng.next_u64() as u16,
        };
        let f = frame_with_id(&addrs, &bytes(&mut rng, len), id);
        let udp_payload = &f[28..];
        assert_eq!(
            icrc::verify_unknown_ip_id(&addrs, udp_payload),
            Some(id),
            "case {case} len {len} id {id:#06x}"
        );
        // with a non-zero ID the plain (ID 0) check must fail
        assert_eq!(icrc::verify(&addrs, udp_payload), id == 0, "case {case}");
    }
}

#[test]
fn corrupted_packets_are_rejected() {
    // One wrong packet in 2^16 passes (some ID always may match); with these fixed
    // seeds none of the cases does.
    let mut rng = SplitMix64::new(0xbad_c0de);
    for case in 0..2000 {
        let addrs = v4_addrs(&mut rng);
        let len = 16 + rng.below(1500) as usize;
        let id = rng.next_u64() as u16;
        let mut f = frame_with_id(&addrs, &bytes(&mut rng, len), id);
        // any UDP payload byte except BTH byte 4 (FECN/BECN/reserved: masked)
        let at = loop {
            let at = rng.below(len as u64) as usize;
            if at != 4 {
                break at;
            }
        };
        f[28 + at] ^= 1 << rng.below(8);
        assert_eq!(
            icrc::verify_unknown_ip_id(&addrs, &f[28..]),
            None,
            "case {case} len {len} byte {at}"
        );
    }
}

#[test]
fn wrong_addresses_or_ports_are_rejected() {
    let mut rng = SplitMix64::new(7);
    for case in 0..500 {
        let addrs = v4_addrs(&mut rng);
        let id = rng.next_u64() as u16;
        let len = 16 + rng.below(600) as usize;
        let f = frame_with_id(&addrs, &bytes(&mut rng, len), id);
        let mut other = addrs;
        match case % 3 {
            0 => other.src.set_port(addrs.src.port() ^ 1),
            1 => other = addrs.reversed(),
            _ => other
                .dst
                .set_ip(std::net::Ipv4Addr::from(rng.next_u64() as u32).into()),
        }
        assert_eq!(
            icrc::verify_unknown_ip_id(&other, &f[28..]),
            None,
            "case {case}"
        );
    }
}

#[test]
fn id_zero_fast_path_and_short_packets() {
    let addrs = Addrs::new(
        "10.47.91.1:49370".parse().unwrap(),
        "10.47.91.2:4791".parse().unwrap(),
    );
    let mut pkt = vec![
        0x04, 0, 0xFF, 0xFF, 0, 0, 0, 0x11, 0, 0, 0, 1, 9, 9, 9, 9, 0, 0, 0, 0,
    ];
    icrc::seal(&addrs, &mut pkt);
    assert_eq!(icrc::verify_unknown_ip_id(&addrs, &pkt), Some(0));
    // shorter than BTH + ICRC: never verifies, as with icrc::verify
    for n in 0..16 {
        assert_eq!(icrc::verify_unknown_ip_id(&addrs, &pkt[..n]), None);
    }
}

#[test]
fn ipv6_is_plain_verify() {
    let mut rng = SplitMix64::new(0x6);
    let addrs = Addrs::new(
        "[fd00::1]:49152".parse().unwrap(),
        "[fd00::2]:4791".parse().unwrap(),
    );
    for case in 0..500 {
        let len = 16 + rng.below(1200) as usize;
        let mut pkt = bytes(&mut rng, len);
        icrc::seal(&addrs, &mut pkt);
        assert!(icrc::verify(&addrs, &pkt));
        assert_eq!(
            icrc::verify_unknown_ip_id(&addrs, &pkt),
            Some(0),
            "case {case}"
        );
        let at = 5 + rng.below(pkt.len() as u64 - 5) as usize;
        pkt[at] ^= 0x10;
        assert!(!icrc::verify(&addrs, &pkt));
        assert_eq!(
            icrc::verify_unknown_ip_id(&addrs, &pkt),
            None,
            "case {case}"
        );
    }
}

/// Packets Linux rxe (Debian kernel 6.1.0-56, in ../shared/rxe-vm) sent during
/// `ibv_rc_pingpong` against rc_pingpong_peer.py: frames 1, 4 and 26 of
/// tests-ext/rxe/vectors/rxe-pingpong-host-peer.pcapng (IPv4 header onwards).
/// rxe sets DF and counts the ID up per packet (0x84db, 0x84dc, ... 0x855b).
fn rxe_frames() -> Vec<(Vec<u8>, u16)> {
    let send_only_64 = unhex(concat!(
        "4500006c84db40004011eb440a2f5b020a2f5b01c9d612b7005800000400ffff000badc080d1a6247b7b7b7b7b7b7b7b",
        "7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b",
        "7b7b7b7b7b7b7b7ba858b3d6",
    ));
    let ack = unhex("4500003084dc40004011eb7f0a2f5b020a2f5b01c9d612b7001c00001100ffff000badc000873a841f00000122be55b1");
    // SEND_MIDDLE of a 3000-byte message: 1024 zero payload bytes, elided here
    let mut send_middle =
        unhex("4500042c855b40004011e7040a2f5b020a2f5b01f78512b7041800000100ffff000badc000bfa7cc");
    send_middle.extend_from_slice(&[0u8; 1024]);
    send_middle.extend_from_slice(&unhex("7935529f"));
    assert_eq!(send_middle.len(), 1068);
    vec![(send_only_64, 0x84db), (ack, 0x84dc), (send_middle, 0x855b)]
}

#[test]
fn rxe_sent_packets_verify_with_their_ip_id() {
    for (f, id) in rxe_frames() {
        assert_eq!(u16::from_be_bytes([f[4], f[5]]), id);
        assert_eq!(f[6] & 0x40, 0x40, "rxe sets DF");
        assert!(icrc::verify_frame(&f), "full frame, id {id:#06x}");
        let (addrs, _tos, udp_payload) = frame::parse_ip_udp(&f).unwrap();
        assert_eq!(addrs.dst.port(), 4791);
        assert!(addrs.src.port() >= 0xC000);
        // what a UDP socket receiver sees: addresses, ports and the UDP payload
        assert!(!icrc::verify(&addrs, udp_payload));
        assert_eq!(icrc::verify_unknown_ip_id(&addrs, udp_payload), Some(id));
        let mut bad = udp_payload.to_vec();
        let n = bad.len();
        bad[n - 5] ^= 0x01;
        assert_eq!(icrc::verify_unknown_ip_id(&addrs, &bad), None);
    }
}
