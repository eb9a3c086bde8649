//! The engine fuzz harness (`engine_harness`, shared with `fuzz/fuzz_targets/engine.rs`)
//! over seeded random scripts: RC, UC and UD traffic between two engines on a lossy,
//! duplicating, reordering network, genuine replays and forged packets from other
//! addresses, every invariant checked after every step, and each script run without and
//! with its forged packets to show they change nothing.
//!
//! The default run puts 10^6 packets through the engines in a few seconds of the debug
//! build; scripts/test runs 10^7 more in a release build (`SOFTRDMA_FUZZ_PACKETS`, with
//! `SOFTRDMA_FUZZ_FIRST` the first seed). `SOFTRDMA_FUZZ_SEED=<n>` runs one script of the default size from seed n;
//! `SOFTRDMA_FUZZ_INPUT=<hex>` runs one input (a failure prints its smallest one), and
//! `SOFTRDMA_FUZZ_LOG=1` prints every injected packet.

mod engine_harness;

use engine_harness::{run, run_once, Counts, Mode, Script};
use softrdma_wire::SplitMix64;

/// Random bytes make a script (any bytes do): the first ones pick the network's fault
/// rates, the rest the actions.
fn script(seed: u64, actions: usize) -> Script {
    let mut r = SplitMix64::new(seed);
    let mut data: Vec<u8> = (0..actions * 6).map(|_| r.next_u64() as u8).collect();
    data[..8].copy_from_slice(&seed.to_le_bytes());
    Script::decode(&data, actions)
}

fn run_seeds(first: u64, scripts: u64, actions: usize, min_packets: u64) -> Counts {
    let mut total = Counts::default();
    if let Ok(hex) = std::env::var("SOFTRDMA_FUZZ_INPUT") {
        let bytes: Vec<u8> = (0..hex.len() / 2)
            .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("hex input"))
            .collect();
        let s = Script::decode(&bytes, usize::MAX);
        eprintln!("{}", s.describe());
        total.add(&run(&s));
        return total;
    }
    let (first, scripts, min_packets) = match std::env::var("SOFTRDMA_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
    {
        Some(seed) => (seed, 1, 0),
        None => (first, scripts, min_packets),
    };
    let mut seed = first;
    while total.scripts < scripts || total.packets() < min_packets {
        let s = script(seed, actions);
        match std::panic::catch_unwind(|| run(&s)) {
            Ok(c) => total.add(&c),
            Err(e) => {
                // The shrinking runs fail many times: keep their panics quiet.
                let hook = std::panic::take_hook();
                std::panic::set_hook(Box::new(|_| {}));
                let fails = |s: &Script| std::panic::catch_unwind(|| run(s)).is_err();
                let min = s.minimize(fails);
                std::panic::set_hook(hook);
                eprintln!(
                    "seed {seed} fails; a smaller script that fails the same way:\n{}",
                    min.describe()
                );
                let _ = std::panic::catch_unwind(|| run(&min));
                std::panic::resume_unwind(e);
            }
        }
        seed += 1;
    }
    println!("engine fuzz, seeds {first}..{seed}: {total}");
    total
}

/// Packets the default run puts through the engines at least: 10^6, a few seconds in the
/// debug build; `SOFTRDMA_FUZZ_PACKETS` asks for more (scripts/test: 10^7 in release).
fn packets_wanted() -> u64 {
    std::env::var("SOFTRDMA_FUZZ_PACKETS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1_000_000)
}

/// At least 10^6 packets (genuine, replayed and injected) through the engines.
#[test]
fn engine_fuzz() {
    let first = std::env::var("SOFTRDMA_FUZZ_FIRST")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    let c = run_seeds(first, 1, 4000, packets_wanted());
    assert!(c.genuine > 0 && c.injected.iter().all(|&n| n > 0), "{c}");
}

/// The engines are deterministic given their seeds (what the comparison of the runs
/// without and with attacks rests on).
#[test]
fn engine_fuzz_is_deterministic() {
    for seed in [7, 8] {
        let s = script(seed, 1500);
        for mode in [Mode::Baseline, Mode::Attacked, Mode::Spoofed] {
            assert!(
                run_once(&s, mode).0 == run_once(&s, mode).0,
                "seed {seed} {mode:?}"
            );
        }
    }
}
