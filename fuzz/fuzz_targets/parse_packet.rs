//! Fuzz the packet parser and the ICRC check: no input may panic, and anything
//! that parses must re-emit to the same headers and payload.
#![no_main]

use libfuzzer_sys::fuzz_target;
use softrdma_wire::{frame, icrc, Addrs, BthView, Headers};

fuzz_target!(|data: &[u8]| {
    let addrs = Addrs::new(
        "10.0.0.1:49152".parse().unwrap(),
        "10.0.0.2:4791".parse().unwrap(),
    );
    let _ = icrc::verify(&addrs, data);
    let _ = icrc::verify(&addrs.reversed(), data);
    let _ = icrc::verify_frame(data);
    let _ = frame::parse_ip_udp(data);
    if let Ok(v) = BthView::new_checked(data) {
        let _ = v.to_repr();
    }
    if let Ok((h, payload)) = Headers::parse(data) {
        let mut buf = vec![0u8; h.packet_len(payload.len())];
        let n = h.emit(payload, &mut buf).expect("parsed headers re-emit");
        assert_eq!(n, data.len());
        let (h2, p2) = Headers::parse(&buf).expect("re-emitted packet parses");
        assert_eq!(h2, h);
        assert_eq!(p2, payload);
    }
});
