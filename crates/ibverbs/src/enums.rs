//! What the verbs enums mean: their names (`ibv_*_str`) and the link rates.

use std::ffi::{c_char, c_int, CStr};

fn static_str(s: &'static CStr) -> *const c_char {
    s.as_ptr()
}

#[no_mangle]
pub extern "C" fn ibv_node_type_str(node_type: c_int) -> *const c_char {
    static_str(match node_type {
        1 => c"InfiniBand channel adapter",
        2 => c"InfiniBand switch",
        3 => c"InfiniBand router",
        4 => c"iWARP NIC",
        5 => c"usNIC",
        6 => c"usNIC UDP",
        7 => c"unspecified",
        _ => c"unknown",
    })
}

#[no_mangle]
pub extern "C" fn ibv_port_state_str(port_state: c_int) -> *const c_char {
    static_str(match port_state {
        0 => c"no state change (NOP)",
        1 => c"down",
        2 => c"init",
        3 => c"armed",
        4 => c"active",
        5 => c"active defer",
        _ => c"unknown",
    })
}

#[no_mangle]
pub extern "C" fn ibv_event_type_str(event: c_int) -> *const c_char {
    static_str(match event {
        0 => c"CQ error",
        1 => c"local work queue catastrophic error",
        2 => c"invalid request local work queue error",
        3 => c"local access violation work queue error",
        4 => c"communication established",
        5 => c"send queue drained",
        6 => c"path migrated",
        7 => c"path migration request error",
        8 => c"local catastrophic error",
        9 => c"port active",
        10 => c"port error",
        11 => c"LID change",
        12 => c"P_Key change",
        13 => c"SM change",
        14 => c"SRQ catastrophic error",
        15 => c"SRQ limit reached",
        16 => c"last WQE reached",
        17 => c"client reregistration",
        18 => c"GID table change",
        // rdma-core 44 has "WQ fatal" in its table but range-checks against
        // IBV_EVENT_GID_CHANGE, so IBV_EVENT_WQ_FATAL gives "unknown" there too.
        _ => c"unknown",
    })
}

#[no_mangle]
pub extern "C" fn ibv_wc_status_str(status: c_int) -> *const c_char {
    static_str(match status {
        0 => c"success",
        1 => c"local length error",
        2 => c"local QP operation error",
        3 => c"local EE context operation error",
        4 => c"local protection error",
        5 => c"Work Request Flushed Error",
        6 => c"memory management operation error",
        7 => c"bad response error",
        8 => c"local access error",
        9 => c"remote invalid request error",
        10 => c"remote access error",
        11 => c"remote operation error",
        12 => c"transport retry counter exceeded",
        13 => c"RNR retry counter exceeded",
        14 => c"local RDD violation error",
        15 => c"remote invalid RD request",
        16 => c"aborted error",
        17 => c"invalid EE context number",
        18 => c"invalid EE context state",
        19 => c"fatal error",
        20 => c"response timeout error",
        21 => c"general error",
        22 => c"TM error",
        23 => c"TM software rendezvous",
        _ => c"unknown",
    })
}

/// (IBV_RATE_* value, multiple of 2.5 Gb/s, Mb/s), as rdma-core's tables.
const RATES: &[(c_int, c_int, c_int)] = &[
    (2, 1, 2500),
    (5, 2, 5000),
    (3, 4, 10000),
    (6, 8, 20000),
    (7, 12, 30000),
    (8, 16, 40000),
    (9, 24, 60000),
    (4, 32, 80000),
    (10, 48, 120000),
    (11, 0, 14062),
    (12, 0, 56250),
    (13, 0, 112500),
    (14, 0, 168750),
    (15, 0, 25781),
    (16, 0, 103125),
    (17, 0, 206250),
    (18, 0, 309375),
    (19, 0, 50000),
    (20, 0, 400000),
    (21, 0, 600000),
    (22, 0, 50000),
    (23, 0, 100000),
    (24, 0, 200000),
    (25, 0, 400000),
    (26, 0, 800000),
    (27, 0, 1200000),
];

#[no_mangle]
pub extern "C" fn ibv_rate_to_mult(rate: c_int) -> c_int {
    RATES
        .iter()
        .find(|r| r.0 == rate)
        .map_or(-1, |r| if r.1 == 0 { -1 } else { r.1 })
}

#[no_mangle]
pub extern "C" fn mult_to_ibv_rate(mult: c_int) -> c_int {
    RATES
        .iter()
        .find(|r| r.1 == mult && mult != 0)
        .map_or(0, |r| r.0)
}

#[no_mangle]
pub extern "C" fn ibv_rate_to_mbps(rate: c_int) -> c_int {
    RATES.iter().find(|r| r.0 == rate).map_or(-1, |r| r.2)
}

#[no_mangle]
pub extern "C" fn mbps_to_ibv_rate(mbps: c_int) -> c_int {
    RATES.iter().find(|r| r.2 == mbps).map_or(0, |r| r.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_round_trip() {
        assert_eq!(ibv_rate_to_mult(3), 4);
        assert_eq!(mult_to_ibv_rate(4), 3);
        assert_eq!(ibv_rate_to_mbps(7), 30000);
        assert_eq!(mbps_to_ibv_rate(100000), 23);
    }

    #[test]
    fn strings() {
        // SAFETY: the functions return static NUL-terminated strings.
        let s = |p: *const c_char| unsafe { CStr::from_ptr(p) }.to_str().unwrap().to_string();
        assert_eq!(s(ibv_wc_status_str(5)), "Work Request Flushed Error");
        assert_eq!(s(ibv_port_state_str(4)), "active");
        assert_eq!(s(ibv_wc_status_str(23)), "TM software rendezvous");
        assert_eq!(s(ibv_node_type_str(1)), "InfiniBand channel adapter");
        assert_eq!(s(ibv_event_type_str(99)), "unknown");
    }
}
