//! Property tests: parsing never panics; emit/parse round-trips for every opcode.

use proptest::prelude::*;
use softrdma_wire::*;

fn addrs_strategy() -> impl Strategy<Value = Addrs> {
    prop_oneof![
        (
            any::<[u8; 4]>(),
            any::<[u8; 4]>(),
            any::<u16>(),
            any::<u16>()
        )
            .prop_map(|(s, d, sp, dp)| {
                Addrs::new(
                    (std::net::Ipv4Addr::from(s), sp).into(),
                    (std::net::Ipv4Addr::from(d), dp).into(),
                )
            }),
        (any::<[u8; 16]>(), any::<[u8; 16]>(), any::<u16>()).prop_map(|(s, d, sp)| {
            Addrs::new(
                (std::net::Ipv6Addr::from(s), sp).into(),
                (std::net::Ipv6Addr::from(d), ROCEV2_UDP_PORT).into(),
            )
        }),
    ]
}

fn syndrome() -> impl Strategy<Value = Syndrome> {
    prop_oneof![
        (0u8..32).prop_map(|credits| Syndrome::Ack { credits }),
        (0u8..32).prop_map(|timer| Syndrome::RnrNak { timer }),
        prop_oneof![
            Just(NakCode::PsnSequenceError),
            Just(NakCode::InvalidRequest),
            Just(NakCode::RemoteAccessError),
            Just(NakCode::RemoteOperationalError),
            Just(NakCode::InvalidRdRequest),
        ]
        .prop_map(Syndrome::Nak),
    ]
}

prop_compose! {
    fn bth(op: Opcode)(se: bool, m: bool, pkey: u16, fecn: bool, becn: bool,
                       qp in 0u32..(1 << 24), ack: bool, psn in 0u32..(1 << 24)) -> Bth {
        Bth { opcode: op, solicited: se, mig_req: m, pad: 0, tver: 0, pkey, fecn, becn,
              dest_qp: qp, ack_req: ack, psn }
    }
}

prop_compose! {
    fn valid_packet()(
        idx in 0usize..37,
        bth0 in bth(Opcode::RC_SEND_ONLY),
        deth in (any::<u32>(), 0u32..(1 << 24)).prop_map(|(qkey, src_qp)| Deth { qkey, src_qp }),
        reth in any::<(u64, u32, u32)>().prop_map(|(va, rkey, dma_len)| Reth { va, rkey, dma_len }),
        at in any::<(u64, u32, u64, u64)>().prop_map(|(va, rkey, swap_add, compare)| AtomicEth { va, rkey, swap_add, compare }),
        aeth in (syndrome(), 0u32..(1 << 24)).prop_map(|(syndrome, msn)| Aeth { syndrome, msn }),
        orig in any::<u64>(), imm in any::<u32>(), ieth in any::<u32>(),
        payload in proptest::collection::vec(any::<u8>(), 0..300),
    ) -> (Headers, Vec<u8>) {
        let info = Opcode::all().nth(idx).unwrap();
        let mut h = Headers::new(Bth { opcode: info.opcode, ..bth0 });
        h.deth = info.has_deth.then_some(deth);
        h.reth = info.has_reth.then_some(reth);
        h.atomic_eth = info.has_atomic_eth.then_some(at);
        h.aeth = info.has_aeth.then_some(aeth);
        h.atomic_ack = info.has_atomic_ack_eth.then_some(AtomicAckEth { orig });
        h.imm = info.has_immdt.then_some(imm);
        h.ieth = info.has_ieth.then_some(ieth);
        let mut payload = if info.has_payload { payload } else { Vec::new() };
        if matches!(info.position, Position::First | Position::Middle) {
            let n = payload.len() / 4 * 4;
            payload.truncate(n);
        }
        h.bth.pad = pad_len(payload.len()) as u8;
        (h, payload)
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn parse_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200), a in addrs_strategy()) {
        let _ = Headers::parse(&bytes);
        let _ = icrc::verify(&a, &bytes);
        let _ = icrc::compute_frame(&bytes);
        let _ = frame::parse_ip_udp(&bytes);
        let _ = BthView::new_checked(&bytes[..]).map(|v| v.to_repr());
    }

    #[test]
    fn parse_never_panics_on_known_opcodes(idx in 0usize..37, flags: u8, len in 0usize..120, fill: u8) {
        // valid-looking BTH so that parsing gets past the opcode check
        let mut bytes = vec![fill; len];
        if len > 1 {
            bytes[0] = Opcode::all().nth(idx).unwrap().opcode.0;
            bytes[1] = flags & 0xF0;
        }
        if let Ok((h, payload)) = Headers::parse(&bytes) {
            prop_assert!(h.check_matches_opcode().is_ok());
            prop_assert_eq!(h.packet_len(payload.len()), bytes.len());
        }
    }

    #[test]
    fn roundtrip_every_opcode((h, payload) in valid_packet(), a in addrs_strategy()) {
        let mut buf = vec![0u8; h.packet_len(payload.len())];
        prop_assert_eq!(h.emit(&payload, &mut buf), Ok(buf.len()));
        prop_assert_eq!(buf.len() % 4, 0);
        icrc::seal(&a, &mut buf);
        prop_assert!(icrc::verify(&a, &buf));
        let (p, pl) = Headers::parse(&buf).unwrap();
        prop_assert_eq!(p, h);
        prop_assert_eq!(pl, &payload[..]);
        let f = frame::emit_ip_udp(&a, 0, &buf);
        prop_assert!(icrc::verify_frame(&f));
        let (a2, _, udp) = frame::parse_ip_udp(&f).unwrap();
        prop_assert_eq!(udp, &buf[..]);
        prop_assert_eq!(a2.is_ipv4(), a.is_ipv4());
        // a too-small buffer is an error, not a panic
        prop_assert_eq!(h.emit(&payload, &mut buf[..h.packet_len(payload.len()) - 1]), Err(Error::Truncated));
    }

    #[test]
    fn any_single_bit_flip_breaks_icrc((h, payload) in valid_packet(), a in addrs_strategy(), bit in any::<prop::sample::Index>()) {
        let mut buf = vec![0u8; h.packet_len(payload.len())];
        h.emit(&payload, &mut buf).unwrap();
        icrc::seal(&a, &mut buf);
        let i = bit.index(buf.len() * 8);
        // byte 4 bits 7..6 (FECN/BECN) and 5..0 (reserved) are masked out of the ICRC
        prop_assume!(i / 8 != 4);
        buf[i / 8] ^= 1 << (i % 8);
        prop_assert!(!icrc::verify(&a, &buf));
    }

    #[test]
    fn psn_arithmetic(a in 0u32..(1 << 24), n in 0u32..(1 << 23)) {
        prop_assert_eq!(psn::diff(psn::add(a, n), a), n as i32);
        prop_assert_eq!(psn::diff(a, psn::add(a, n)), -(n as i32));
        prop_assert!(psn::le(a, psn::add(a, n)));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// Any bytes: CM parsing never panics, and whatever parses emits back to a MAD that
    /// parses to the same message (reserved bits are the only thing emit may clear).
    #[test]
    fn cm_parse_never_panics_and_round_trips(
        body in proptest::collection::vec(any::<u8>(), 0..300),
        attr in 0x0010u16..=0x0018,
        tid in any::<u64>(),
    ) {
        let mut mad = body.clone();
        if mad.len() >= cm::MAD_LEN {
            // Make most inputs a CM Send, so the message parsers run.
            cm::MadHeader { attr_id: attr, ..cm::MadHeader::cm(cm::CmAttr::Req, tid) }
                .emit(&mut mad)
                .unwrap();
        }
        let _ = cm::CmaHeader::parse(&body);
        if let Ok((h, m)) = cm::CmMsg::parse(&mad) {
            prop_assert_eq!(h.attr_id, attr);
            let again = m.emit(h.tid);
            let (h2, m2) = cm::CmMsg::parse(&again).unwrap();
            prop_assert_eq!(h2.tid, tid);
            prop_assert_eq!(m2, m);
        } else {
            prop_assert!(mad.len() < cm::MAD_LEN);
        }
    }
}
