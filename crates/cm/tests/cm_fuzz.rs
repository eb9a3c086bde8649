//! The CM fuzz harness (`cm_harness`, shared with `fuzz/fuzz_targets/cm.rs`) over seeded
//! random inputs: MADs of random bytes, mutated replays of genuine ones and REQs for the
//! listener, from the peer's address and from strangers, into a client and a server
//! rdma_cm with an established connection between them, with time passing; after every
//! step the tables are bounded and nothing a stranger sent changed the connection.
//!
//! The default run injects 10^6 MADs in the debug build (a few seconds); scripts/test runs more in a
//! release build (`SOFTRDMA_CM_FUZZ_MADS`, with `SOFTRDMA_CM_FUZZ_FIRST` the first seed).
//! `SOFTRDMA_CM_FUZZ_SEED=<n>` runs the one input of seed n; a failure prints its seed.

mod cm_harness;

use softrdma_wire::SplitMix64;

/// Steps of one input.
const STEPS: usize = 2000;

/// The input of seed `seed`: its first 8 bytes are the seed, the rest random.
fn input(seed: u64) -> Vec<u8> {
    let mut r = SplitMix64::new(seed);
    let mut data: Vec<u8> = (0..STEPS * 8).map(|_| r.next_u64() as u8).collect();
    data[..8].copy_from_slice(&seed.to_be_bytes());
    data
}

fn env(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

#[test]
fn cm_fuzz() {
    let (first, want) = match env("SOFTRDMA_CM_FUZZ_SEED") {
        Some(seed) => (seed, 1),
        None => (
            env("SOFTRDMA_CM_FUZZ_FIRST").unwrap_or(1),
            env("SOFTRDMA_CM_FUZZ_MADS").unwrap_or(1_000_000),
        ),
    };
    let mut total = cm_harness::Counts::default();
    let mut seed = first;
    while total.injected() < want {
        let data = input(seed);
        match std::panic::catch_unwind(|| cm_harness::run(&data, STEPS)) {
            Ok(c) => total.add(&c),
            Err(e) => {
                eprintln!(
                    "CM fuzz: seed {seed} fails (SOFTRDMA_CM_FUZZ_SEED={seed} runs it again)"
                );
                std::panic::resume_unwind(e);
            }
        }
        seed += 1;
    }
    println!("CM fuzz, seeds {first}..{seed}: {total}");
    assert!(
        total.from_peer > 0 && total.checked > 0 && total.requests > 0,
        "{total}"
    );
}

/// The inputs reach what they are for: the half-open cap, and connections that live
/// through strangers' MADs for whole runs (only MADs from the peer's address may end
/// them).
#[test]
fn cm_fuzz_reaches_the_cap() {
    let mut total = cm_harness::Counts::default();
    for seed in 1000..1008 {
        total.add(&cm_harness::run(&input(seed), STEPS));
    }
    assert!(total.refused > 0 && total.checked > 0, "{total}");
}
