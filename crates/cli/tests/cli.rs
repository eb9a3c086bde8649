//! End-to-end tests of the `softrdma` command: processes on loopback, bounded in time (a
//! process still running after its limit is killed and the test fails), no duration
//! assertions.

// The std macros are fine here: a test reports on stderr, where a failed write may panic.
#![allow(clippy::disallowed_macros)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_softrdma");
const LIMIT: Duration = Duration::from_secs(90);

/// A stats directory of this test run, so tests do not see other runs' devices.
fn stats_dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("softrdma-cli-test-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&d);
    d
}

fn cmd(args: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.args(args)
        .env("SOFTRDMA_STATS_DIR", stats_dir())
        .env_remove("SOFTRDMA_STATS")
        .env_remove("SOFTRDMA_ADDR")
        .env_remove("SOFTRDMA_PCAP")
        .env_remove("SOFTRDMA_CONFIG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

fn spawn(args: &[&str]) -> Child {
    cmd(args).spawn().expect("spawn softrdma")
}

/// Wait for a child with a deadline; kill it and fail if it overruns.
fn finish(mut c: Child, what: &str) -> Output {
    let until = Instant::now() + LIMIT;
    loop {
        match c.try_wait().expect("wait") {
            Some(_) => return c.wait_with_output().expect("output"),
            None if Instant::now() > until => {
                let _ = c.kill();
                let o = c.wait_with_output().expect("output");
                panic!(
                    "{what}: still running after {LIMIT:?}\nstdout:\n{}\nstderr:\n{}",
                    String::from_utf8_lossy(&o.stdout),
                    String::from_utf8_lossy(&o.stderr)
                );
            }
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

fn run(args: &[&str]) -> Output {
    finish(spawn(args), &args.join(" "))
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn assert_ok(o: &Output, what: &str) {
    assert!(
        o.status.success(),
        "{what} failed ({:?})\nstdout:\n{}\nstderr:\n{}",
        o.status,
        text(&o.stdout),
        text(&o.stderr)
    );
}

/// A TCP port free right now.
fn free_port() -> u16 {
    TcpListener::bind(("127.0.0.1", 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// Run a server and a client (the client gets `127.0.0.1` appended); both must succeed.
fn pair(server: &[&str], client: &[&str]) -> (Output, Output) {
    let s = spawn(server);
    let mut c_args: Vec<&str> = client.to_vec();
    c_args.push("127.0.0.1");
    let c = spawn(&c_args);
    let co = finish(c, &c_args.join(" "));
    let so = finish(s, &server.join(" "));
    assert_ok(&co, &format!("client {}", c_args.join(" ")));
    assert_ok(&so, &format!("server {}", server.join(" ")));
    (so, co)
}

fn one_line_error(o: &Output, what: &str) {
    assert!(!o.status.success(), "{what}: should fail");
    let e = text(&o.stderr);
    assert_eq!(
        e.trim_end().lines().count(),
        1,
        "{what}: want one line on stderr, got:\n{e}"
    );
    assert!(e.starts_with("softrdma: "), "{what}: {e}");
}

#[test]
fn help_for_every_subcommand() {
    let o = run(&["--help"]);
    assert_ok(&o, "--help");
    for sub in [
        "devices", "devinfo", "pingpong", "perf", "stats", "trace", "demo", "rsocket",
    ] {
        assert!(text(&o.stdout).contains(sub), "--help lists {sub}");
        let o = run(&[sub, "--help"]);
        assert_ok(&o, &format!("{sub} --help"));
        assert!(text(&o.stdout).contains("Usage"), "{sub} --help");
    }
}

#[test]
fn bad_arguments_give_one_line() {
    for args in [
        &["pingpong", "--bogus"][..],
        &["pingpong", "-t", "xx"],
        &["pingpong", "-m", "77", "127.0.0.1"],
        &["pingpong", "-s", "0", "127.0.0.1"],
        &["pingpong", "-s", "notanumber"],
        &["pingpong", "-t", "srq", "-q", "600", "127.0.0.1"],
        &["perf", "nosuch"],
        &["perf", "write-bw", "-s", "0", "127.0.0.1"],
        &["perf", "atomic-bw", "-s", "64", "127.0.0.1"],
        &["perf", "write-bw", "-s", "8", "-a"],
        &["perf", "write-bw", "--loopback", "127.0.0.1"],
        &["perf", "send-lat", "--memory-wait", "127.0.0.1"],
        &["trace", "-o", "x.pcap"],
        &["devinfo", "-d", "nosuchdevice"],
        &["nosuchcommand"],
    ] {
        let o = run(args);
        one_line_error(&o, &args.join(" "));
    }
}

#[test]
fn missing_arguments_are_named() {
    for (args, name) in [
        (&["trace", "-o", "x.pcap"][..], "<COMMAND>"),
        (&["run"], "<PROGRAM>"),
        (&["perf"], "<TEST>"),
        (&["trace", "--", "true"], "--output"),
    ] {
        let o = run(args);
        one_line_error(&o, &args.join(" "));
        let e = text(&o.stderr);
        assert!(e.contains(name), "{args:?}: want {name} in {e}");
    }
}

#[test]
fn address_in_use_names_the_address_once() {
    let taken = std::net::UdpSocket::bind("127.0.0.1:0").expect("udp");
    let addr = taken.local_addr().expect("addr").to_string();
    let p = free_port().to_string();
    let o = cmd(&["pingpong", "-p", &p])
        .env("SOFTRDMA_ADDR", &addr)
        .output()
        .expect("run");
    one_line_error(&o, "pingpong on a taken address");
    let e = text(&o.stderr);
    assert!(e.contains(&addr), "want {addr} in {e}");
    assert_eq!(e.matches("Address already in use").count(), 1, "{e}");
}

#[test]
fn unreachable_peer_fails_in_bounded_time() {
    // Nobody listens on this port: refused (retried for a few seconds), then one line.
    let p = free_port().to_string();
    let t = Instant::now();
    let o = run(&["pingpong", "-p", &p, "127.0.0.1"]);
    one_line_error(&o, "pingpong to a closed port");
    assert!(text(&o.stderr).contains("couldn't connect"));
    let o = run(&["perf", "write-bw", "-p", &p, "127.0.0.1"]);
    one_line_error(&o, "perf to a closed port");
    let o = run(&["pingpong", "no-such-host.invalid"]);
    one_line_error(&o, "pingpong to an unknown host");
    // The bound is LIMIT (enforced by `finish`); report, do not assert, the time taken.
    eprintln!("unreachable peers took {:?}", t.elapsed());
}

fn pingpong_matrix(ty: &str, sizes: &[u32]) {
    for &size in sizes {
        for events in [false, true] {
            let port = free_port().to_string();
            let s = size.to_string();
            let mut a = vec!["pingpong", "-t", ty, "-s", &s, "-n", "40", "-p", &port];
            if ty == "srq" {
                a.extend(["-q", "4"]);
            }
            if events {
                a.push("-e");
            }
            let (so, co) = pair(&a, &a);
            for o in [&so, &co] {
                let out = text(&o.stdout);
                assert!(
                    out.contains("  local address:  LID 0x0000, QPN 0x"),
                    "{out}"
                );
                assert!(
                    out.contains("  remote address: LID 0x0000, QPN 0x"),
                    "{out}"
                );
                let bytes = size as u64 * 40 * 2;
                assert!(
                    out.contains(&format!("{bytes} bytes in ")) && out.contains(" Mbit/sec"),
                    "{out}"
                );
                assert!(
                    out.contains("40 iters in ") && out.contains(" usec/iter"),
                    "{out}"
                );
            }
        }
    }
}

#[test]
fn pingpong_rc() {
    pingpong_matrix("rc", &[1, 64, 4096, 10000]);
}

#[test]
fn pingpong_uc() {
    pingpong_matrix("uc", &[1, 64, 4096, 10000]);
}

#[test]
fn pingpong_ud() {
    // UD messages must fit the port MTU (1024 here), as ibv_ud_pingpong checks.
    pingpong_matrix("ud", &[1, 64, 1024]);
    let o = run(&["pingpong", "-t", "ud", "-s", "4096", "127.0.0.1"]);
    one_line_error(&o, "ud larger than the MTU");
    assert!(text(&o.stderr).contains("(1024)"), "{}", text(&o.stderr));
}

/// `pingpong -t ud` with its own defaults, and `-m` raising the port MTU so that larger
/// messages fit (2048 by default, up to the MTU with `-s`).
#[test]
fn pingpong_ud_defaults_and_mtu() {
    for (extra, size) in [
        (&[][..], 1024u64),
        (&["-m", "4096"][..], 2048),
        (&["-m", "4096", "-s", "4096"][..], 4096),
        (&["-m", "2048", "-s", "2048"][..], 2048),
    ] {
        let port = free_port().to_string();
        let mut a = vec!["pingpong", "-t", "ud", "-n", "20", "-p", &port];
        a.extend_from_slice(extra);
        let (so, co) = pair(&a, &a);
        for o in [&so, &co] {
            let out = text(&o.stdout);
            assert!(
                out.contains(&format!("{} bytes in ", size * 20 * 2)),
                "{extra:?}: {out}"
            );
        }
    }
    let o = run(&[
        "pingpong",
        "-t",
        "ud",
        "-m",
        "2048",
        "-s",
        "4096",
        "127.0.0.1",
    ]);
    one_line_error(&o, "ud larger than -m");
    assert!(text(&o.stderr).contains("(2048)"), "{}", text(&o.stderr));
}

#[test]
fn pingpong_srq() {
    pingpong_matrix("srq", &[1, 64, 4096, 10000]);
}

fn is_hex(s: &[u8]) -> bool {
    s.iter()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b))
}

/// Check one address message byte for byte: "%04x:%06x:%06x:%s" + NUL, 52 bytes, the GID
/// as 32 hex digits in wire order (an IPv4-mapped loopback address here).
fn check_msg(m: &[u8]) {
    assert_eq!(m.len(), 52);
    assert!(is_hex(&m[0..4]), "{m:?}");
    assert_eq!(m[4], b':');
    assert!(is_hex(&m[5..11]), "{m:?}");
    assert_eq!(m[11], b':');
    assert!(is_hex(&m[12..18]), "{m:?}");
    assert_eq!(m[18], b':');
    assert!(is_hex(&m[19..51]), "{m:?}");
    assert_eq!(&m[0..4], b"0000", "RoCE LID is 0");
    assert_eq!(&m[19..45], b"00000000000000000000ffff7f");
    assert_eq!(m[51], 0, "NUL-terminated");
}

fn read_n(s: &mut TcpStream, n: usize) -> Vec<u8> {
    let mut b = vec![0u8; n];
    s.read_exact(&mut b).expect("read from the peer");
    b
}

/// A man in the middle between our pingpong client and server that checks the exchange
/// bytes and their order exactly as ibv_rc_pingpong defines them.
#[test]
fn pingpong_exchange_bytes() {
    let srv_port = free_port();
    let server = spawn(&[
        "pingpong",
        "-p",
        &srv_port.to_string(),
        "-s",
        "64",
        "-n",
        "20",
    ]);
    let l = TcpListener::bind(("127.0.0.1", 0)).unwrap();
    let mid_port = l.local_addr().unwrap().port().to_string();
    let client = spawn(&[
        "pingpong",
        "-p",
        &mid_port,
        "-s",
        "64",
        "-n",
        "20",
        "127.0.0.1",
    ]);
    let (mut c, _) = l.accept().unwrap();
    c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut s = {
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            match TcpStream::connect(("127.0.0.1", srv_port)) {
                Ok(s) => break s,
                Err(_) if Instant::now() < until => std::thread::sleep(Duration::from_millis(50)),
                Err(e) => panic!("server not listening: {e}"),
            }
        }
    };
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    // 1. The client speaks first: exactly one 52-byte message.
    let m = read_n(&mut c, 52);
    check_msg(&m);
    s.write_all(&m).unwrap();
    // 2. The server answers with its 52 bytes.
    let a = read_n(&mut s, 52);
    check_msg(&a);
    c.write_all(&a).unwrap();
    // 3. The client ends with "done" and its NUL, then closes.
    let d = read_n(&mut c, 5);
    assert_eq!(&d, b"done\0");
    s.write_all(&d).unwrap();
    let mut rest = Vec::new();
    c.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty(), "nothing after done: {rest:?}");
    let co = finish(client, "client");
    let so = finish(server, "server");
    assert_ok(&co, "client");
    assert_ok(&so, "server");
    // What the client printed as the remote address is what the server sent.
    let qpn = std::str::from_utf8(&a[5..11]).unwrap();
    assert!(
        text(&co.stdout).contains(&format!("remote address: LID 0x0000, QPN 0x{qpn}")),
        "{}",
        text(&co.stdout)
    );
}

/// A server speaking the exchange from a script: it answers with a zero GID (as
/// ibv_rc_pingpong run without -g does) and never connects a QP; the client must fall
/// back to the TCP address for the GID and then fail cleanly (no RDMA peer) in bounded
/// time with one line.
#[test]
fn pingpong_client_against_scripted_server() {
    let l = TcpListener::bind(("127.0.0.1", 0)).unwrap();
    let port = l.local_addr().unwrap().port().to_string();
    let client = spawn(&[
        "pingpong",
        "-p",
        &port,
        "-s",
        "64",
        "-n",
        "5",
        "--timeout",
        "2",
        "127.0.0.1",
    ]);
    let (mut c, _) = l.accept().unwrap();
    c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    check_msg(&read_n(&mut c, 52));
    let answer = *b"0000:000abc:123456:00000000000000000000000000000000\0";
    assert_eq!(answer.len(), 52);
    c.write_all(&answer).unwrap();
    assert_eq!(&read_n(&mut c, 5), b"done\0");
    let co = finish(client, "client");
    assert!(
        text(&co.stdout).contains(
            "remote address: LID 0x0000, QPN 0x000abc, PSN 0x123456, GID ::ffff:127.0.0.1\n"
        ),
        "{}",
        text(&co.stdout)
    );
    one_line_error(&co, "client against a server with no QP");
}

/// Parse a perftest-like table: the rows after the `#bytes` header.
fn table(out: &str, cols: usize) -> Vec<Vec<f64>> {
    let mut rows = Vec::new();
    let mut on = false;
    for l in out.lines() {
        if l.trim_start().starts_with("#bytes") {
            on = true;
            continue;
        }
        if on {
            if l.starts_with("---") {
                break;
            }
            let v: Vec<f64> = l
                .split_whitespace()
                .map(|w| w.parse().expect("number"))
                .collect();
            assert_eq!(v.len(), cols, "row {l:?}");
            rows.push(v);
        }
    }
    rows
}

fn perf_pair(test: &str, extra: &[&str]) -> String {
    let port = free_port().to_string();
    let mut a = vec!["perf", test, "-p", &port];
    a.extend_from_slice(extra);
    let (_, co) = pair(&a, &a);
    text(&co.stdout)
}

#[test]
fn perf_bandwidth_tests() {
    for t in ["write-bw", "read-bw", "send-bw", "atomic-bw"] {
        let args: &[&str] = if t == "atomic-bw" {
            &["-n", "200"]
        } else {
            &["-n", "200", "-s", "4096"]
        };
        let out = perf_pair(t, args);
        let rows = table(&out, 5);
        assert_eq!(rows.len(), 1, "{out}");
        let r = &rows[0];
        assert_eq!(r[0], if t == "atomic-bw" { 8.0 } else { 4096.0 });
        assert_eq!(r[1], 200.0);
        assert!(r[3] > 0.0 && r[2] >= r[3] && r[4] > 0.0, "{out}");
    }
}

#[test]
fn perf_latency_tests() {
    for t in ["write-lat", "read-lat", "send-lat", "atomic-lat"] {
        let out = perf_pair(t, &["-n", "100"]);
        let rows = table(&out, 9);
        assert_eq!(rows.len(), 1, "{out}");
        let r = &rows[0];
        assert_eq!(r[1], 100.0);
        assert!(
            r[2] > 0.0 && r[2] <= r[4] && r[4] <= r[3],
            "min <= typical <= max: {out}"
        );
        assert!(r[7] <= r[8] && r[8] <= r[3], "percentiles: {out}");
    }
}

#[test]
fn perf_write_lat_waiting_on_memory_only() {
    // Neither side calls into its device while it waits for the peer's WRITE: each one
    // lands through the progress thread alone, or the run stalls and fails.
    let out = perf_pair("write-lat", &["-n", "200", "-s", "64", "--memory-wait"]);
    let rows = table(&out, 9);
    assert_eq!(rows.len(), 1, "{out}");
    assert_eq!(rows[0][0], 64.0, "{out}");
    assert_eq!(rows[0][1], 200.0, "{out}");
}

#[test]
fn perf_several_sizes_and_json() {
    // Several sizes through -a would take long; check the -a size list through --json on
    // a latency test with few iterations instead.
    let out = perf_pair("write-lat", &["-a", "-n", "3", "--json"]);
    let j: serde_json::Value = serde_json::from_str(out.trim()).expect("json");
    let res = j["results"].as_array().expect("results");
    let sizes: Vec<u64> = res.iter().map(|r| r["bytes"].as_u64().unwrap()).collect();
    assert_eq!(sizes, (1..=23).map(|p| 1u64 << p).collect::<Vec<_>>());
    assert_eq!(j["role"], "client");
    assert_eq!(j["test"], "write-lat");
}

#[test]
fn perf_loopback_json_and_stats() {
    let o = run(&[
        "perf",
        "send-bw",
        "--loopback",
        "-n",
        "100",
        "--json",
        "--stats",
    ]);
    assert_ok(&o, "perf --loopback");
    let j: serde_json::Value = serde_json::from_str(text(&o.stdout).trim()).expect("json");
    assert_eq!(j["results"][0]["iterations"], 100);
    assert!(j["stats"]["counters"]["tx_packets"].as_u64().unwrap() >= 100);
    let o = run(&["perf", "read-lat", "--self", "-n", "50", "--stats"]);
    assert_ok(&o, "perf --self");
    let out = text(&o.stdout);
    assert_eq!(table(&out, 9).len(), 1, "{out}");
    assert!(out.contains("retransmits"), "{out}");
}

/// `pingpong --cm`: every QP type connected through the rdma_cm (one connection per QP
/// for srq), polling and with -e; the exchanges and the addresses as without it.
#[test]
fn pingpong_cm_every_type() {
    for ty in ["rc", "uc", "ud", "srq"] {
        for events in [false, true] {
            let port = free_port().to_string();
            let mut a = vec![
                "pingpong", "--cm", "-t", ty, "-s", "64", "-n", "40", "-p", &port,
            ];
            if ty == "srq" {
                a.extend(["-q", "3"]);
            }
            if events {
                a.push("-e");
            }
            let (so, co) = pair(&a, &a);
            let (sout, cout) = (text(&so.stdout), text(&co.stdout));
            for out in [&sout, &cout] {
                let nqp = if ty == "srq" { 3 } else { 1 };
                assert_eq!(
                    out.matches("  local address:  LID 0x0000, QPN 0x").count(),
                    nqp,
                    "{out}"
                );
                assert_eq!(
                    out.matches("  remote address: LID 0x0000, QPN 0x").count(),
                    nqp,
                    "{out}"
                );
                assert!(
                    out.contains(&format!("{} bytes in ", 64 * 40 * 2)),
                    "{ty}: {out}"
                );
                assert!(out.contains("40 iters in "), "{ty}: {out}");
            }
            // What one side calls its QP the other calls the remote one.
            let qpns = |out: &str, label: &str| -> Vec<String> {
                out.lines()
                    .filter_map(|l| l.split_once(label))
                    .map(|(_, r)| r[19..25].to_string())
                    .collect()
            };
            let (sl, sr) = (
                qpns(&sout, "local address:  "),
                qpns(&sout, "remote address: "),
            );
            let (cl, cr) = (
                qpns(&cout, "local address:  "),
                qpns(&cout, "remote address: "),
            );
            assert_eq!(sl, cr, "{ty}: server's QPs\n{sout}\n{cout}");
            assert_eq!(sr, cl, "{ty}: client's QPs\n{sout}\n{cout}");
        }
    }
}

#[test]
fn pingpong_cm_json() {
    let port = free_port().to_string();
    let a = [
        "pingpong", "--cm", "-s", "100", "-n", "25", "-p", &port, "--json",
    ];
    let (so, co) = pair(&a, &a);
    let s: serde_json::Value = serde_json::from_slice(&so.stdout).expect("server json");
    let c: serde_json::Value = serde_json::from_slice(&co.stdout).expect("client json");
    assert_eq!(s["role"], "server");
    assert_eq!(c["role"], "client");
    for j in [&s, &c] {
        assert_eq!(j["iters"], 25);
        assert_eq!(j["bytes"], 100 * 25 * 2);
    }
    assert_eq!(s["local"][0]["qpn"], c["remote"][0]["qpn"]);
    assert_eq!(s["remote"][0]["qpn"], c["local"][0]["qpn"]);
    // The PSN each side sends from is the one the other expects.
    assert_eq!(s["local"][0]["psn"], c["remote"][0]["psn"]);
    assert_eq!(s["remote"][0]["psn"], c["local"][0]["psn"]);
}

/// `perf --cm`: every benchmark with the request and the memory in the CM's private
/// data; the rows the client prints are the same as over the TCP exchange.
#[test]
fn perf_cm_every_test() {
    for t in [
        "write-bw",
        "read-bw",
        "send-bw",
        "atomic-bw",
        "write-lat",
        "read-lat",
        "send-lat",
        "atomic-lat",
    ] {
        let lat = t.ends_with("-lat");
        let mut extra = vec!["--cm", "-n", "100"];
        if !t.starts_with("atomic") {
            extra.extend(["-s", "512"]);
        }
        let port = free_port().to_string();
        let mut a = vec!["perf", t, "-p", &port];
        a.extend_from_slice(&extra);
        let (so, co) = pair(&a, &a);
        let out = text(&co.stdout);
        let rows = table(&out, if lat { 9 } else { 5 });
        assert_eq!(rows.len(), 1, "{t}: {out}");
        let want = if t.starts_with("atomic") { 8.0 } else { 512.0 };
        assert_eq!(rows[0][0], want, "{t}: {out}");
        assert_eq!(rows[0][1], 100.0, "{t}: {out}");
        assert!(
            text(&so.stdout).contains(&format!("served {t} to 127.0.0.")),
            "{t}: {}",
            text(&so.stdout)
        );
    }
}

#[test]
fn perf_cm_all_sizes_memory_wait_and_loopback() {
    let port = free_port().to_string();
    let a = [
        "perf",
        "write-lat",
        "--cm",
        "-a",
        "-n",
        "3",
        "--memory-wait",
        "--json",
        "-p",
        &port,
    ];
    let (so, co) = pair(&a, &a);
    let j: serde_json::Value = serde_json::from_slice(&co.stdout).expect("json");
    let sizes: Vec<u64> = j["results"]
        .as_array()
        .expect("results")
        .iter()
        .map(|r| r["bytes"].as_u64().unwrap())
        .collect();
    assert_eq!(sizes, (1..=23).map(|p| 1u64 << p).collect::<Vec<_>>());
    let s: serde_json::Value = serde_json::from_slice(&so.stdout).expect("server json");
    assert_eq!(s["test"], "write-lat");
    assert_eq!(s["local"]["rkey"], j["remote"]["rkey"]);
    assert_eq!(s["remote"]["addr"], j["local"]["addr"]);
    let o = run(&["perf", "send-lat", "--cm", "--loopback", "-n", "50"]);
    assert_ok(&o, "perf --cm --loopback");
    let out = text(&o.stdout);
    assert_eq!(table(&out, 9)[0][1], 50.0, "{out}");
}

#[test]
fn cm_bad_arguments_and_no_server() {
    for args in [
        &["pingpong", "--cm", "-m", "2048", "127.0.0.1"][..],
        &["perf", "write-bw", "--cm", "-m", "512", "127.0.0.1"],
        &["perf", "write-bw", "--cm", "-m", "1024", "127.0.0.1"],
        &["pingpong", "--cm", "--bogus"],
    ] {
        let o = run(args);
        one_line_error(&o, &args.join(" "));
    }
    // Nobody serves the port: retried while a server might be starting, then one line.
    let p = free_port().to_string();
    let o = run(&["pingpong", "--cm", "-p", &p, "127.0.0.1"]);
    one_line_error(&o, "pingpong --cm to a port nobody serves");
    assert!(
        text(&o.stderr).contains("through the rdma_cm"),
        "{}",
        text(&o.stderr)
    );
    let o = run(&["perf", "read-bw", "--cm", "-p", &p, "127.0.0.1"]);
    one_line_error(&o, "perf --cm to a port nobody serves");
}

#[test]
fn devices_and_devinfo() {
    let o = run(&["devices"]);
    assert_ok(&o, "devices");
    assert!(text(&o.stdout).contains("softrdma0"));
    let o = run(&["devices", "--json"]);
    assert_ok(&o, "devices --json");
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    assert_eq!(j["devices"][0]["name"], "softrdma0");
    assert!(j["devices"][0]["gid"]
        .as_str()
        .unwrap()
        .starts_with("::ffff:127.0.0."));
    let o = run(&["devinfo", "-v"]);
    assert_ok(&o, "devinfo -v");
    let out = text(&o.stdout);
    assert!(out.contains("hca_id:\tsoftrdma0"), "{out}");
    assert!(out.contains("PORT_ACTIVE"), "{out}");
    assert!(out.contains("GID[  0]:"), "{out}");
    let o = run(&["devinfo", "--json", "-v"]);
    assert_ok(&o, "devinfo --json");
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    assert_eq!(j["devices"][0]["gids"][0]["type"], "RoCE v2");
    // SOFTRDMA_ADDR names the default device's address (one of this host's).
    let o = finish(
        cmd(&["devices", "--json"])
            .env("SOFTRDMA_ADDR", "127.0.0.77")
            .spawn()
            .unwrap(),
        "devices with SOFTRDMA_ADDR",
    );
    assert_ok(&o, "devices with SOFTRDMA_ADDR");
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    assert_eq!(j["devices"][0]["addr"], "127.0.0.77:4791");
    assert_eq!(
        j["devices"][0]["gid_wire"],
        "00000000000000000000ffff7f00004d"
    );
    // An address this host does not have is refused at once, by name.
    let o = finish(
        cmd(&["devices"])
            .env("SOFTRDMA_ADDR", "192.0.2.77")
            .spawn()
            .unwrap(),
        "devices with a foreign SOFTRDMA_ADDR",
    );
    assert!(!o.status.success(), "accepted a foreign address");
    let e = text(&o.stderr);
    assert!(
        e.contains("SOFTRDMA_ADDR: 192.0.2.77 is not an address of this host"),
        "{e}"
    );
}

/// JSON read keeping each object's keys in order, rejecting an object that repeats a key
/// (`serde_json::Value` would keep the last one silently).
#[derive(Debug)]
enum Strict {
    Leaf,
    List(Vec<Strict>),
    Obj(Vec<(String, Strict)>),
}

impl Strict {
    fn parse(b: &[u8], what: &str) -> Strict {
        serde_json::from_slice(b)
            .unwrap_or_else(|e| panic!("{what}: {e}\n{}", String::from_utf8_lossy(b)))
    }

    fn get(&self, key: &str) -> &Strict {
        match self {
            Strict::Obj(m) => m
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v)
                .unwrap_or_else(|| panic!("no key {key:?} in {self:?}")),
            _ => panic!("not an object: {self:?}"),
        }
    }

    fn items(&self) -> &[Strict] {
        match self {
            Strict::List(v) => v,
            _ => panic!("not a list: {self:?}"),
        }
    }

    fn keys(&self) -> Vec<&str> {
        match self {
            Strict::Obj(m) => m.iter().map(|(k, _)| k.as_str()).collect(),
            _ => panic!("not an object: {self:?}"),
        }
    }
}

impl<'de> serde::Deserialize<'de> for Strict {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Strict, D::Error> {
        d.deserialize_any(StrictVisitor)
    }
}

struct StrictVisitor;

impl<'de> serde::de::Visitor<'de> for StrictVisitor {
    type Value = Strict;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, _: bool) -> Result<Strict, E> {
        Ok(Strict::Leaf)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Strict, E> {
        Ok(Strict::Leaf)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Strict, E> {
        Ok(Strict::Leaf)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Strict, E> {
        Ok(Strict::Leaf)
    }
    fn visit_str<E>(self, _: &str) -> Result<Strict, E> {
        Ok(Strict::Leaf)
    }
    fn visit_unit<E>(self) -> Result<Strict, E> {
        Ok(Strict::Leaf)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut s: A) -> Result<Strict, A::Error> {
        let mut v = Vec::new();
        while let Some(x) = s.next_element()? {
            v.push(x);
        }
        Ok(Strict::List(v))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut m: A) -> Result<Strict, A::Error> {
        let mut v: Vec<(String, Strict)> = Vec::new();
        while let Some(k) = m.next_key::<String>()? {
            if v.iter().any(|(seen, _)| *seen == k) {
                return Err(serde::de::Error::custom(format!("duplicate key {k:?}")));
            }
            v.push((k, m.next_value()?));
        }
        Ok(Strict::Obj(v))
    }
}

#[test]
fn devinfo_json_repeats_no_key() {
    // The check itself must catch a repeated key, at any depth.
    assert!(serde_json::from_str::<Strict>(r#"{"a":[{"b":1,"b":2}]}"#).is_err());
    for verbose in [false, true] {
        let args: &[&str] = if verbose {
            &["devinfo", "-v", "--json"]
        } else {
            &["devinfo", "--json"]
        };
        let o = run(args);
        assert_ok(&o, &args.join(" "));
        let j = Strict::parse(&o.stdout, &args.join(" "));
        let dev = &j.get("devices").items()[0];
        let mut want = vec![
            "name",
            "addr",
            "auto",
            "bound_addr",
            "fw_ver",
            "node_guid",
            "sys_image_guid",
            "vendor_id",
            "vendor_part_id",
            "hw_ver",
            "phys_port_cnt",
            "ports",
        ];
        if verbose {
            want.extend([
                "max_qp",
                "max_qp_wr",
                "max_sge",
                "max_cq",
                "max_cqe",
                "max_mr",
                "max_mr_size",
                "max_pd",
                "max_qp_rd_atom",
                "max_qp_init_rd_atom",
            ]);
        }
        want.push("gids");
        assert_eq!(dev.keys(), want, "{}", text(&o.stdout));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
        let bound = v["devices"][0]["bound_addr"].as_str().expect("bound_addr");
        assert!(
            bound.parse::<std::net::SocketAddr>().is_ok(),
            "{}",
            text(&o.stdout)
        );
    }
    // A device whose address another socket holds is described without being opened.
    let taken = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind a UDP port");
    let addr = taken.local_addr().unwrap().to_string();
    let o = finish(
        cmd(&["devinfo", "-v", "--json"])
            .env("SOFTRDMA_ADDR", &addr)
            .spawn()
            .unwrap(),
        "devinfo of a device not opened",
    );
    assert_ok(&o, "devinfo of a device not opened");
    let j = Strict::parse(&o.stdout, "devinfo of a device not opened");
    let dev = &j.get("devices").items()[0];
    assert_eq!(
        dev.keys(),
        ["name", "addr", "auto", "gids", "error"],
        "{}",
        text(&o.stdout)
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    assert_eq!(v["devices"][0]["addr"], addr.as_str());
}

#[test]
fn stats_lists_running_devices() {
    // A server waiting for its client has an open device that publishes its counters.
    let port = free_port().to_string();
    let server = spawn(&["pingpong", "-p", &port, "-n", "10", "-s", "64"]);
    let pid = server.id() as u64;
    let until = Instant::now() + Duration::from_secs(20);
    let found = loop {
        let o = run(&["stats", "--json"]);
        assert_ok(&o, "stats --json");
        let j: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
        let devs = j["devices"].as_array().unwrap().clone();
        if let Some(d) = devs.iter().find(|d| d["pid"].as_u64() == Some(pid)) {
            break d.clone();
        }
        assert!(Instant::now() < until, "no stats of the server: {j}");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(found["counters"]["tx_packets"].is_u64());
    assert!(found["counters"]["icrc_errors"].is_u64());
    let o = run(&["stats"]);
    assert_ok(&o, "stats");
    assert!(text(&o.stdout).contains("NAKs received"));
    // Let the server finish.
    let c = run(&["pingpong", "-p", &port, "-n", "10", "-s", "64", "127.0.0.1"]);
    assert_ok(&c, "client");
    assert_ok(&finish(server, "server"), "server");
}

#[test]
fn stats_lists_devices_of_library_users() {
    // A device opened through the library (here, by this test process), not by the CLI.
    let mut cfg = softrdma::DeviceConfig::new("libuser", softrdma::DeviceAddr::AutoLoopback(4791));
    cfg.stats_dir = Some(stats_dir());
    let dev = softrdma::Device::open_with(&cfg).expect("open device");
    let pid = u64::from(std::process::id());
    let mine = |j: &serde_json::Value| {
        j["devices"]
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["pid"].as_u64() == Some(pid) && d["name"] == "libuser")
            .cloned()
    };
    // The device writes its first record from a thread of its own: wait for it.
    let until = Instant::now() + Duration::from_secs(20);
    let d = loop {
        let o = run(&["stats", "--json"]);
        assert_ok(&o, "stats --json");
        let j: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
        assert_eq!(j["dir"], stats_dir().display().to_string());
        if let Some(d) = mine(&j) {
            break d;
        }
        assert!(
            Instant::now() < until,
            "no stats of the library's device: {j}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(d["addr"], dev.addr().to_string());
    assert_eq!(d["gid"], format!("::ffff:{}", dev.addr().ip()));
    let c = d["counters"].as_object().expect("counters");
    let mut keys: Vec<&str> = c.keys().map(String::as_str).collect();
    keys.sort_unstable();
    let mut want: Vec<&str> = softrdma::statsfile::counters(&Default::default())
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    want.sort_unstable();
    assert_eq!(keys, want, "{d}");
    assert_eq!(c["tx_packets"], 0);
    assert_eq!(c["udp_rx_datagrams"], 0);
    let o = run(&["stats"]);
    assert_ok(&o, "stats");
    let out = text(&o.stdout);
    assert!(
        out.contains(&format!("libuser (pid {pid}, {}, GID ", dev.addr())),
        "{out}"
    );
    // Closing the device takes it off the list.
    drop(dev);
    let o = run(&["stats", "--json"]);
    assert_ok(&o, "stats --json");
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    assert!(mine(&j).is_none(), "closed device still listed: {j}");
}

fn tshark() -> Option<PathBuf> {
    let p = Path::new("/usr/bin/tshark");
    if p.exists() {
        return Some(p.to_path_buf());
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("tshark"))
            .find(|p| p.exists())
    })
}

#[test]
fn trace_writes_a_pcap_tshark_decodes() {
    let dir = stats_dir();
    let file = dir.join("trace.pcap");
    let f = file.to_str().unwrap();
    let o = run(&[
        "trace",
        "-o",
        f,
        "--",
        "softrdma",
        "perf",
        "write-bw",
        "--loopback",
        "-n",
        "20",
        "-s",
        "2048",
    ]);
    assert_ok(&o, "trace");
    assert!(
        text(&o.stderr).contains("packets written"),
        "{}",
        text(&o.stderr)
    );
    // --pcap on pingpong writes one too.
    let port = free_port().to_string();
    let f2 = dir.join("pp.pcap");
    let f2s = f2.to_str().unwrap();
    pair(
        &[
            "pingpong", "-p", &port, "-n", "5", "-s", "100", "--pcap", f2s,
        ],
        &["pingpong", "-p", &port, "-n", "5", "-s", "100"],
    );
    assert!(std::fs::metadata(&f2).unwrap().len() > 24);

    let Some(ts) = tshark() else {
        if std::env::var("SOFTRDMA_SKIP_EXTERNAL").as_deref() == Ok("1") {
            eprintln!("tshark absent: skipped (SOFTRDMA_SKIP_EXTERNAL=1)");
            return;
        }
        panic!("tshark is not installed: install it (apt-get install tshark) or set SOFTRDMA_SKIP_EXTERNAL=1");
    };
    for (path, want) in [(f, "RDMA Write"), (f2s, "Send")] {
        let o = finish(
            Command::new(&ts)
                .args(["-r", path, "-o", "infiniband.dissect_eoib:FALSE"])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
            "tshark",
        );
        let o = if o.status.success() {
            o
        } else {
            // Older/newer tshark without that preference.
            finish(
                Command::new(&ts)
                    .args(["-r", path])
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap(),
                "tshark",
            )
        };
        assert_ok(&o, "tshark");
        let out = text(&o.stdout);
        assert!(out.contains("RoCE") || out.contains("InfiniBand"), "{out}");
        assert!(out.contains(want), "{want} in:\n{out}");
    }
}

#[test]
fn demo_runs() {
    let o = run(&["demo"]);
    assert_ok(&o, "demo");
    let out = text(&o.stdout);
    for w in ["SEND", "WRITE", "READ", "FETCH_ADD", "write-bw", "send-lat"] {
        assert!(out.contains(w), "{w} in:\n{out}");
    }
    let o = run(&["demo", "--json"]);
    assert_ok(&o, "demo --json");
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    assert_eq!(j["round_trips"].as_array().unwrap().len(), 4);
}

/// A shell script run under `softrdma run` that prints each thing a program would find
/// where RDMA software looks for a device, one `what=value` per line.
const VIEW_PROBE: &str = r#"
d=/sys/class/infiniband
echo "uid=$(id -u)"
echo "devices=$(ls $d | tr '\n' ' ')"
echo "verbs=$(ls /sys/class/infiniband_verbs | tr '\n' ' ')"
for dev in $(ls $d); do
  p=$d/$dev/ports/1
  echo "$dev.state=$(cat $p/state)"
  echo "$dev.phys_state=$(cat $p/phys_state)"
  echo "$dev.link_layer=$(cat $p/link_layer)"
  echo "$dev.rate=$(cat $p/rate)"
  echo "$dev.gid0=$(cat $p/gids/0)"
  echo "$dev.type0=$(cat $p/gid_attrs/types/0)"
  echo "$dev.ndev0=$(cat $p/gid_attrs/ndevs/0)"
  echo "$dev.net=$(ls $d/$dev/device/net)"
  echo "$dev.net_is_lo=$(test "$(readlink -f $d/$dev/device/net/lo)" = "$(readlink -f /sys/class/net/lo)" && echo yes)"
  echo "$dev.node_type=$(cat $d/$dev/node_type)"
  echo "$dev.pkey0=$(cat $p/pkeys/0)"
done
for u in /sys/class/infiniband_verbs/uverbs*; do
  n=$(basename $u)
  echo "$n.ibdev=$(cat $u/ibdev)"
  echo "$n.node=$(test -c /dev/infiniband/$n && test -r /dev/infiniband/$n && test -w /dev/infiniband/$n && echo chr-rw)"
done
echo "rdma_cm=$(test -c /dev/infiniband/rdma_cm && echo chr)"
echo "null=$(echo x > /dev/null && echo ok)"
echo "class_net=$(test -e /sys/class/net/lo && echo ok)"
echo "readonly=$(touch $d/x 2>/dev/null || echo yes)"
"#;

/// What exists on the host where the view goes, and this process's mounts.
fn host_state() -> (bool, bool, bool, String) {
    (
        Path::new("/sys/class/infiniband").exists(),
        Path::new("/sys/class/infiniband_verbs").exists(),
        Path::new("/dev/infiniband").exists(),
        std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default(),
    )
}

/// A library directory of empty stand-ins for `softrdma run` (the programs these tests
/// run load no verbs library), one per call; the caller removes it.
fn stand_in_lib_dir(tag: &str) -> PathBuf {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("softrdma-{tag}-test-{}-{n}", std::process::id()));
    std::fs::create_dir_all(dir.join("rdmacm")).unwrap();
    for f in [
        "libibverbs.so.1",
        "libmlx5.so.1",
        "libefa.so.1",
        "libmlx4.so.1",
        "libmana.so.1",
        "rdmacm/librdmacm.so.1",
    ] {
        std::fs::write(dir.join(f), b"").unwrap();
    }
    dir
}

/// `softrdma run -- sh -c VIEW_PROBE` (as `as_user` through setpriv when given), with a
/// stand-in library directory (sh loads no verbs library) and `config` as the devices.
fn view_probe(config: &str, as_user: Option<u32>) -> Output {
    let dir = stand_in_lib_dir("view");
    let conf = dir.join(format!("conf-{}", config.len()));
    std::fs::write(&conf, config).unwrap();
    let mut c = match as_user {
        Some(u) => {
            let mut c = Command::new("setpriv");
            c.args([
                &format!("--reuid={u}"),
                &format!("--regid={u}"),
                "--clear-groups",
                BIN,
            ]);
            c
        }
        None => Command::new(BIN),
    };
    c.args(["run", "--", "sh", "-c", VIEW_PROBE])
        .env("SOFTRDMA_LIB_DIR", &dir)
        .env("SOFTRDMA_CONFIG", &conf)
        .env_remove("SOFTRDMA_ADDR")
        .env_remove("SOFTRDMA_VIEW")
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let out = finish(c.spawn().expect("spawn"), "softrdma run -- sh (view)");
    let _ = std::fs::remove_dir_all(&dir);
    out
}

fn probe_values(o: &Output) -> std::collections::HashMap<String, String> {
    assert_ok(o, "softrdma run -- sh (view)");
    assert!(
        o.stderr.is_empty(),
        "the view is made without a word: {}",
        text(&o.stderr)
    );
    text(&o.stdout)
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.trim().to_string()))
        .collect()
}

fn check_view(as_user: Option<u32>) {
    let before = host_state();
    let o = view_probe("dev0 127.0.0.77\ndev1 [::1]:4791\n", as_user);
    let v = probe_values(&o);
    let get = |k: &str| v.get(k).map(String::as_str).unwrap_or("<missing>");
    let expect = [
        ("devices", "dev0 dev1"),
        ("verbs", "abi_version uverbs0 uverbs1"),
        ("dev0.state", "4: ACTIVE"),
        ("dev0.phys_state", "5: LinkUp"),
        ("dev0.link_layer", "Ethernet"),
        ("dev0.rate", "40 Gb/sec (4X FDR10)"),
        ("dev0.gid0", "0000:0000:0000:0000:0000:ffff:7f00:004d"),
        ("dev0.type0", "RoCE v2"),
        ("dev0.ndev0", "lo"),
        ("dev0.net", "lo"),
        ("dev0.net_is_lo", "yes"),
        ("dev0.node_type", "1: CA"),
        ("dev0.pkey0", "0xffff"),
        ("dev1.gid0", "0000:0000:0000:0000:0000:0000:0000:0001"),
        ("dev1.type0", "RoCE v2"),
        ("dev1.ndev0", "lo"),
        ("uverbs0.ibdev", "dev0"),
        ("uverbs1.ibdev", "dev1"),
        ("uverbs0.node", "chr-rw"),
        ("uverbs1.node", "chr-rw"),
        ("rdma_cm", "chr"),
        ("null", "ok"),
        ("class_net", "ok"),
        ("readonly", "yes"),
    ];
    for (k, want) in expect {
        assert_eq!(
            get(k),
            want,
            "{k} (as uid {as_user:?})\n{}",
            text(&o.stdout)
        );
    }
    if let Some(u) = as_user {
        assert_eq!(get("uid"), u.to_string(), "the program runs as the user");
    }
    // Nothing changed outside the program's namespace.
    assert_eq!(
        host_state(),
        before,
        "the host's /sys, /dev or mounts changed"
    );
}

/// `softrdma run` gives the program a /sys/class/infiniband, /sys/class/infiniband_verbs
/// and /dev/infiniband view of softrdma's devices, as root and as a regular user, and
/// leaves the host as it was.
#[test]
fn run_presents_the_device_view() {
    // Root checks both ways, anyone else as itself.
    let root = std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(2) == Some("0"));
    check_view(None);
    if root {
        if Command::new("setpriv").arg("--version").output().is_ok() {
            check_view(Some(65534));
        } else {
            eprintln!("setpriv missing: the view as a regular user is not checked");
        }
    }
}

/// `SOFTRDMA_VIEW=0` runs the program without the view.
#[test]
fn run_without_the_view() {
    let dir = stand_in_lib_dir("noview");
    let o = cmd(&["run", "--", "sh", "-c", "cat /proc/self/mountinfo"])
        .env("SOFTRDMA_LIB_DIR", &dir)
        .env("SOFTRDMA_VIEW", "0")
        .output()
        .expect("run");
    let _ = std::fs::remove_dir_all(&dir);
    assert_ok(&o, "softrdma run with SOFTRDMA_VIEW=0");
    assert_eq!(text(&o.stdout), host_state().3, "same mounts as the host");
}

/// The checkout the binary under test was built from.
fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("workspace")
        .to_path_buf()
}

#[test]
fn installed_binary_finds_or_names_the_build_of_the_libraries() {
    // A copy of the binary outside any target directory, as `cargo install` leaves it.
    let bin = std::env::temp_dir().join(format!("softrdma-cli-install-{}", std::process::id()));
    std::fs::create_dir_all(&bin).expect("mkdir");
    let exe = bin.join("softrdma");
    std::fs::copy(BIN, &exe).expect("copy softrdma");
    let o = Command::new(&exe)
        .args(["env", "--dir"])
        .env_remove("SOFTRDMA_LIB_DIR")
        .env("SOFTRDMA_BUILD", "0")
        .output()
        .expect("run the copy");
    let _ = std::fs::remove_dir_all(&bin);
    let ws = workspace();
    if o.status.success() {
        // Found in the checkout's target directory (either profile).
        let dir = text(&o.stdout);
        let dir = Path::new(dir.trim());
        assert!(
            dir.starts_with(ws.join("target")),
            "want a directory under {}/target, got {}",
            ws.display(),
            dir.display()
        );
        assert!(dir.join("libibverbs.so.1").exists(), "{}", dir.display());
    } else {
        // Not built: the error names the exact command that builds what is searched.
        one_line_error(&o, "env --dir of an installed copy");
        let e = text(&o.stderr);
        let want = format!(
            "cargo build --release --manifest-path {}",
            ws.join("Cargo.toml").display()
        );
        assert!(e.contains(&want), "want {want:?} in {e}");
        assert!(e.contains("-p softrdma-ibverbs"), "{e}");
    }
}

/// The status of a process that died of SIGPIPE, as coreutils do on a closed pipe.
fn died_of_sigpipe(o: &Output) -> bool {
    use std::os::unix::process::ExitStatusExt;
    o.status.signal() == Some(13)
}

#[test]
fn closed_pipe_ends_quietly_and_full_disk_is_one_line() {
    // `softrdma devices | head -0`: the reader is gone before anything is written.
    for args in [
        &["devices"][..],
        &["devinfo", "-v"],
        &["stats"],
        &["--help"],
    ] {
        let (r, w) = std::io::pipe().expect("pipe");
        drop(r);
        let mut c = cmd(args);
        c.stdout(w);
        let o = finish(c.spawn().expect("spawn"), &args.join(" "));
        assert!(
            died_of_sigpipe(&o) || o.status.success(),
            "{args:?}: {:?}\nstderr:\n{}",
            o.status,
            text(&o.stderr)
        );
        assert!(o.stderr.is_empty(), "{args:?}: {}", text(&o.stderr));
    }

    // `softrdma perf … | head -1`: the reader goes after the first line.
    let (r, w) = std::io::pipe().expect("pipe");
    let mut c = cmd(&["perf", "write-bw", "--loopback", "-a", "-n", "20"]);
    c.stdout(w);
    let child = c.spawn().expect("spawn");
    drop(c);
    let mut first = Vec::new();
    let mut r = std::io::BufReader::new(r);
    std::io::BufRead::read_until(&mut r, b'\n', &mut first).expect("first line");
    drop(r);
    let o = finish(child, "perf write-bw --loopback -a | head -1");
    assert!(!first.is_empty());
    assert!(
        died_of_sigpipe(&o),
        "{:?}\nstderr:\n{}",
        o.status,
        text(&o.stderr)
    );
    assert!(o.stderr.is_empty(), "{}", text(&o.stderr));

    // `softrdma stats > /dev/full` (and the others): one line, status 1, no panic.
    if Path::new("/dev/full").exists() {
        for args in [&["stats"][..], &["devices"], &["devinfo", "--json"]] {
            let full = std::fs::OpenOptions::new()
                .write(true)
                .open("/dev/full")
                .expect("/dev/full");
            let mut c = cmd(args);
            c.stdout(full);
            let o = finish(c.spawn().expect("spawn"), &args.join(" "));
            one_line_error(&o, &format!("{args:?} > /dev/full"));
            assert_eq!(o.status.code(), Some(1), "{args:?}");
            assert!(
                text(&o.stderr).contains("cannot write to standard output"),
                "{args:?}: {}",
                text(&o.stderr)
            );
        }
    }
}

/// `env --json` gives the same two variables as the shell form, as one JSON object.
#[test]
fn env_json_matches_the_shell_form() {
    let shell = run(&["env"]);
    assert_ok(&shell, "env");
    let json = run(&["env", "--json"]);
    assert_ok(&json, "env --json");
    let j: serde_json::Value = serde_json::from_slice(&json.stdout).expect("json");
    let obj = j.as_object().expect("an object");
    assert_eq!(obj.len(), 2, "{j}");
    let dir = j["SOFTRDMA_LIB_DIR"].as_str().expect("SOFTRDMA_LIB_DIR");
    let path = j["LD_LIBRARY_PATH"].as_str().expect("LD_LIBRARY_PATH");
    assert!(path.split(':').any(|p| p == dir), "{path} lacks {dir}");
    let shell = text(&shell.stdout);
    for (k, v) in [("SOFTRDMA_LIB_DIR", dir), ("LD_LIBRARY_PATH", path)] {
        assert!(
            shell
                .lines()
                .any(|l| l.starts_with(&format!("export {k}=")) && l.contains(v)),
            "{k}={v} not in {shell}"
        );
    }
    let both = run(&["env", "--json", "--dir"]);
    assert!(!both.status.success(), "--dir and --json together");
}

/// Without `$SOFTRDMA_STATS_DIR` and `$XDG_RUNTIME_DIR`, each user's devices publish to a
/// directory of their own: root's is `/run/softrdma`, which no other user can make first;
/// a regular user without a `/run/user/UID` reads (and its devices write)
/// `/dev/shm/softrdma-UID`, checked to be theirs. Needs root to run as another user.
#[test]
fn stats_dir_is_per_user_without_a_runtime_dir() {
    if euid() != 0 {
        return;
    }
    for (uid, dir) in [(0u32, "/run/softrdma"), (65534, "/dev/shm/softrdma-65534")] {
        let o = Command::new("setpriv")
            .args([
                &format!("--reuid={uid}"),
                &format!("--regid={uid}"),
                "--clear-groups",
                BIN,
                "stats",
                "--json",
            ])
            .env_remove("SOFTRDMA_STATS_DIR")
            .env_remove("XDG_RUNTIME_DIR")
            .current_dir("/")
            .output()
            .expect("setpriv softrdma stats");
        assert_ok(&o, "stats --json as another user");
        let j: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
        assert_eq!(j["dir"], dir, "uid {uid}");
    }
}

/// The effective uid of this test process.
fn euid() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2))
                .and_then(|u| u.parse().ok())
        })
        .unwrap_or(u32::MAX)
}

/// `softrdma rsocket`: a client's standard input reaches a listener's standard output
/// byte for byte over rsockets, and an echo listener sends a client's bytes back.
#[test]
fn rsocket_carries_stdin_to_the_listeners_stdout_and_echoes() {
    use std::io::Write;
    let data: Vec<u8> = (0..700_001u32).map(|i| (i * 7 + i / 3) as u8).collect();
    for echo in [false, true] {
        let port = free_port().to_string();
        let mut largs = vec!["rsocket", "listen", port.as_str()];
        if echo {
            largs.push("--echo");
        }
        let mut l = spawn(&largs);
        // The listener says where it listens once bound: the client starts then.
        let mut err = std::io::BufReader::new(l.stderr.take().expect("listener stderr"));
        let mut first = String::new();
        std::io::BufRead::read_line(&mut err, &mut first).expect("listener's first line");
        assert!(first.contains("rsocket listening on 0.0.0.0:"), "{first}");
        let drain =
            std::thread::spawn(move || std::io::Read::read_to_end(&mut err, &mut Vec::new()));
        let peer = format!("127.0.0.1:{port}");
        let mut c = cmd(&["rsocket", "connect", &peer])
            .stdin(Stdio::piped())
            .spawn()
            .expect("spawn client");
        let mut stdin = c.stdin.take().expect("stdin");
        let d2 = data.clone();
        let w = std::thread::spawn(move || stdin.write_all(&d2));
        // Both sides' output is read while they run: a pipe that fills would stop them.
        let read_all = |mut r: std::process::ChildStdout| {
            std::thread::spawn(move || {
                let mut v = Vec::new();
                std::io::Read::read_to_end(&mut r, &mut v).map(|_| v)
            })
        };
        let cr = read_all(c.stdout.take().expect("client stdout"));
        let lr = read_all(l.stdout.take().expect("listener stdout"));
        let co = finish(c, "rsocket connect");
        w.join().unwrap().expect("client stdin");
        let lo = finish(l, "rsocket listen");
        assert_ok(&co, "rsocket connect");
        assert_ok(&lo, "rsocket listen");
        let c_out = cr.join().unwrap().expect("client stdout");
        let l_out = lr.join().unwrap().expect("listener stdout");
        let (got, what) = if echo {
            (&c_out, "the echo the client printed")
        } else {
            (&l_out, "what the listener printed")
        };
        assert!(
            *got == data,
            "{what}: {} bytes, want {}",
            got.len(),
            data.len()
        );
        drain.join().unwrap().expect("listener stderr");
    }
    let o = run(&["rsocket", "connect", "127.0.0.1:1", "--timeout", "5"]);
    one_line_error(&o, "connect to nobody");
}
