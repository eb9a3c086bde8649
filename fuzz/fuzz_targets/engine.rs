//! Fuzz the protocol engine: two engines connected by RC, UC and UD QPs exchange genuine
//! traffic of every kind over a lossy, duplicating, reordering network while forged
//! packets (sealed, from addresses that are not the genuine sender's) are injected; the
//! input is the script. Every invariant of the harness is checked after every step (no
//! write outside an MR, no completion for a PSN the peer never acknowledged, exactly-once
//! delivery and atomics, completions in order), and the script runs without and with its
//! forged packets, which must change nothing. The harness is shared with the stable test
//! `crates/transport/tests/engine_fuzz.rs`.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../crates/transport/tests/engine_harness/mod.rs"]
mod engine_harness;

/// Actions per input at most, so every input runs in bounded time.
const MAX_STEPS: usize = 2000;

fuzz_target!(|data: &[u8]| {
    let script = engine_harness::Script::decode(data, MAX_STEPS);
    engine_harness::run(&script);
});
