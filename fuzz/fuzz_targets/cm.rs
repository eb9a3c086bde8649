//! Fuzz the connection manager: a client and a server rdma_cm (`softrdma_cm::cma::Cma`)
//! with an established connection take MADs of random bytes, mutated replays of genuine
//! ones and REQs for the listener, from the peer's address and from strangers, with time
//! passing; the input is the script. After every step the tables are bounded (half-open
//! cap, ids, timers) and nothing a stranger sent changed the established connection. The
//! harness is shared with the stable test `crates/cm/tests/cm_fuzz.rs`.
#![no_main]

use libfuzzer_sys::fuzz_target;

// The stable test sums its runs (`Counts::add`); a fuzz input is one run.
#[allow(dead_code)]
#[path = "../../crates/cm/tests/cm_harness/mod.rs"]
mod cm_harness;

/// Steps per input at most, so every input runs in bounded time.
const MAX_STEPS: usize = 2000;

fuzz_target!(|data: &[u8]| {
    cm_harness::run(data, MAX_STEPS);
});
