//! Runs every example's `--self-test` (server and clients as separate processes over
//! loopback UDP), so the examples the README points at keep working.
//!
//! The example binaries are expected in target/<profile>/examples, where `cargo build
//! --examples` puts them (scripts/test builds them first); if they are missing the test
//! says how to build them.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    // target/<profile>/deps/examples-<hash> -> target/<profile>/examples/<name>
    let dir = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target profile directory")
        .join("examples");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "example {name} not built at {}; run `cargo build --examples` first (scripts/test does)",
        path.display()
    );
    path
}

fn self_test(name: &str) {
    let mut child = Command::new(example(name))
        .arg("--self-test")
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start example {name}: {e}"));
    // The self-test bounds its own processes; this bound is a backstop against a hang.
    let deadline = Instant::now() + Duration::from_secs(180);
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait for example") {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("example {name} --self-test did not finish within 180 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        status.success(),
        "example {name} --self-test failed: {status}"
    );
}

#[test]
fn tutorial_self_test() {
    self_test("tutorial");
}

#[test]
fn rc_pingpong_self_test() {
    self_test("rc_pingpong");
}

#[test]
fn ud_self_test() {
    self_test("ud");
}

#[test]
fn atomic_counter_self_test() {
    self_test("atomic_counter");
}

#[test]
fn cm_pingpong_self_test() {
    self_test("cm_pingpong");
}
