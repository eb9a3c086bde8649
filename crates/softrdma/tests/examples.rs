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

/// `--help` prints the usage and exits 0 at once (it does not start a server and wait);
/// an unknown option is one line and status 2.
#[test]
fn help_prints_usage_and_bad_options_fail() {
    for name in [
        "tutorial",
        "rc_pingpong",
        "ud",
        "atomic_counter",
        "cm_pingpong",
        "rc_bw",
    ] {
        for help in ["--help", "-h"] {
            let mut child = Command::new(example(name))
                .arg(help)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap_or_else(|e| panic!("cannot start example {name}: {e}"));
            let deadline = Instant::now() + Duration::from_secs(10);
            while child.try_wait().expect("wait").is_none() {
                if Instant::now() > deadline {
                    let _ = child.kill();
                    panic!("{name} {help} still running: it did not print its usage");
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let o = child.wait_with_output().expect("output");
            assert!(o.status.success(), "{name} {help}: {}", o.status);
            let out = String::from_utf8_lossy(&o.stdout);
            assert!(out.starts_with(&format!("Usage: {name}")), "{name}: {out}");
            assert!(out.contains("--self-test"), "{name}: {out}");
        }
        let o = Command::new(example(name))
            .arg("--bogus")
            .output()
            .expect("run");
        assert_eq!(o.status.code(), Some(2), "{name} --bogus");
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(e.contains("unknown option --bogus"), "{name}: {e}");
    }
}
