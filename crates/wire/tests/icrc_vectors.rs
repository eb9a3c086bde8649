//! ICRC known-good vectors, produced independently:
//! IPv4 with the host peer from ../shared/rxe-vm/rc_pingpong_peer.py (whose ICRC
//! Linux rxe accepted in the rxe-vm selftest), IPv6 with scapy.contrib.roce.

use softrdma_wire::{frame, icrc, Addrs, Headers, Opcode};

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn ipv4_send_only_vector() {
    let addrs = Addrs::new(
        "10.47.91.1:49370".parse().unwrap(),
        "10.47.91.2:4791".parse().unwrap(),
    );
    let pkt = unhex("04b0ffff000000118012345668656c6c6f000000e13c3b3c");
    assert!(icrc::verify(&addrs, &pkt));
    assert_eq!(icrc::compute(&addrs, &pkt), 0x3c3b3ce1);
    let (h, payload) = Headers::parse(&pkt).unwrap();
    assert_eq!(h.bth.opcode, Opcode::RC_SEND_ONLY);
    assert_eq!(payload, b"hello");
    // our emit + seal produce the same bytes
    let mut buf = vec![0u8; h.packet_len(5)];
    h.emit(b"hello", &mut buf).unwrap();
    icrc::seal(&addrs, &mut buf);
    assert_eq!(buf, pkt);
    // through a full frame as well
    let f = frame::emit_ip_udp(&addrs, 0, &pkt);
    assert_eq!(icrc::compute_frame(&f), Ok(0x3c3b3ce1));
    assert!(icrc::verify_frame(&f));
    // TOS, TTL, FECN/BECN are not covered ...
    let mut f2 = frame::emit_ip_udp(&addrs, 0xFF, &pkt);
    f2[8] = 1;
    f2[28 + 4] |= 0xC0;
    assert!(icrc::verify_frame(&f2));
    // ... but the IP ID, addresses, ports, PSN and payload are
    for at in [5usize, 15, 21, 28 + 11, 28 + 13] {
        let mut f3 = f.clone();
        f3[at] ^= 1;
        assert!(!icrc::verify_frame(&f3), "byte {at}");
    }
    let mut bad = pkt.clone();
    bad[13] ^= 0x20;
    assert!(!icrc::verify(&addrs, &bad));
    assert!(!icrc::verify(&addrs.reversed(), &pkt));
}

#[test]
fn ipv4_ack_vector() {
    let addrs = Addrs::new(
        "10.47.91.2:51670".parse().unwrap(),
        "10.47.91.1:4791".parse().unwrap(),
    );
    let pkt = unhex("1100ffff00abcdef001234561f00000559ca7ee6");
    assert!(icrc::verify(&addrs, &pkt));
    // an IPv4-mapped IPv6 socket address is the same IPv4 packet
    let mapped = Addrs::new(
        "[::ffff:10.47.91.2]:51670".parse().unwrap(),
        "[::ffff:10.47.91.1]:4791".parse().unwrap(),
    );
    assert!(icrc::verify(&mapped, &pkt));
}

#[test]
fn ipv6_vector_from_scapy() {
    let addrs = Addrs::new(
        "[fd00::1]:49443".parse().unwrap(),
        "[fd00::2]:4791".parse().unwrap(),
    );
    let pkt = unhex("0400ffff00000012800000076162636465666768" /* + ICRC */);
    let mut full = pkt.clone();
    full.extend_from_slice(&unhex("5a98b17e"));
    assert!(icrc::verify(&addrs, &full));
    let mut f = frame::emit_ip_udp(&addrs, 0x12, &full);
    assert!(icrc::verify_frame(&f));
    f[7] = 3; // hop limit is masked
    assert!(icrc::verify_frame(&f));
    f[5] ^= 1; // payload length is not
    assert!(!icrc::verify_frame(&f));
}

#[test]
fn short_inputs_do_not_panic() {
    let addrs = Addrs::new("1.2.3.4:1".parse().unwrap(), "5.6.7.8:2".parse().unwrap());
    for n in 0..20 {
        let mut v = vec![0u8; n];
        let _ = icrc::compute(&addrs, &v);
        icrc::seal(&addrs, &mut v);
        assert_eq!(icrc::verify(&addrs, &v), n >= 16);
        let _ = icrc::compute_frame(&v);
        assert!(!icrc::verify_frame(&v));
    }
}

#[test]
fn compute_agrees_with_compute_frame_of_the_reconstructed_frame() {
    // `compute` lays the masked headers out itself; `compute_frame` masks a real IP
    // header: both must give the same ICRC for the frame a Linux DF socket sends.
    let pairs = [
        ("10.0.0.1:49152", "10.0.0.2:4791"),
        ("[fe80::1]:49153", "[fe80::2]:4791"),
        ("[::ffff:10.0.0.1]:1", "10.0.0.2:4791"),
        ("[fe80::1]:1", "10.0.0.2:4791"),
    ];
    let data: Vec<u8> = (0..5000u32).map(|i| (i * 7 + 3) as u8).collect();
    for (a, b) in pairs {
        let addrs = Addrs::new(a.parse().unwrap(), b.parse().unwrap());
        for len in (0..40).chain([63, 64, 65, 127, 128, 129, 1000, 4096, 4124, 5000]) {
            let p = &data[..len];
            let f = frame::emit_ip_udp(&addrs, 0x2E, p);
            assert_eq!(
                Ok(icrc::compute(&addrs, p)),
                icrc::compute_frame(&f),
                "{a} -> {b}, {len} bytes"
            );
        }
    }
}
