//! A peer process killed with SIGKILL (no DREQ, no goodbye of any kind) is noticed by the
//! survivor, which only waits for a receive: the device's keepalive finds the peer lost,
//! the receive completes with WR_FLUSH_ERR and the connection's event channel yields
//! DISCONNECTED, as on Linux when the kernel sends the dead process's DREQ. Before
//! keepalive the survivor waited forever.
//!
//! This test binary spawns itself as the peer (`SOFTRDMA_TEST_PEER_DEATH=1`, test
//! `peer_death_child`): a server that accepts one connection, says so, and then idles
//! until it is killed.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use softrdma::cm::{self, AcceptOptions, ConnectOptions, EventType, Listener};
use softrdma::*;

/// How long the survivor waits for each outcome before the test fails: the bound it
/// checks is the keepalive's (about a second on one host), far inside this.
const GIVE_UP: Duration = Duration::from_secs(10);

fn open_device() -> Device {
    let mut cfg = DeviceConfig::new("test", DeviceAddr::AutoLoopback(4791));
    // The defaults, whatever the environment says.
    cfg.keepalive = KeepalivePolicy::DEFAULT;
    Device::open_with(&cfg).expect("open device")
}

/// The peer: accept one RC connection, post a receive, report READY and idle.
#[test]
fn peer_death_child() {
    if std::env::var("SOFTRDMA_TEST_PEER_DEATH").as_deref() != Ok("1") {
        return;
    }
    let dev = open_device();
    let listener = Listener::bind(&dev, "0.0.0.0:0".parse().unwrap()).unwrap();
    println!("PORT {}", listener.local_addr().port());
    let pd = dev.alloc_pd().unwrap();
    let cq = dev.create_cq(128, None).unwrap();
    let mem = pd.register(4096, Access::LOCAL_WRITE).unwrap();
    let init = QpInit::new(QpType::Rc, &cq);
    let _conn = listener
        .accept_with(&pd, &init, &AcceptOptions::new(b""), |qp| {
            qp.post_recv(wr::recv(1, [mem.sge(0..64)?]))
        })
        .unwrap();
    println!("READY");
    // Idle, connection open, until killed (the parent's test fails long before this ends).
    std::thread::sleep(Duration::from_secs(120));
}

/// The peer process, killed when the test ends however it ends.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_killed_peer_is_seen_as_a_disconnect() {
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(exe)
        .args([
            "--exact",
            "peer_death_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("SOFTRDMA_TEST_PEER_DEATH", "1")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut child = KillOnDrop(child);
    let port: u16 = loop {
        let l = lines.next().expect("the peer said nothing").unwrap();
        // The harness may have begun the line ("test peer_death_child ... ").
        if let Some((_, p)) = l.split_once("PORT ") {
            break p.trim().parse().unwrap();
        }
    };

    let dev = open_device();
    let pd = dev.alloc_pd().unwrap();
    let cq = dev.create_cq(128, None).unwrap();
    let mem = pd.register(4096, Access::LOCAL_WRITE).unwrap();
    let init = QpInit::new(QpType::Rc, &cq);
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let conn = cm::connect_with(&pd, &init, addr, &ConnectOptions::new(b""), |qp| {
        qp.post_recv(wr::recv(7, [mem.sge(0..64).unwrap()]))
    })
    .unwrap();
    loop {
        let l = lines.next().expect("the peer ended early").unwrap();
        if l.contains("READY") {
            break;
        }
    }

    // Idle past the keepalive's bound, the peer alive: the probes are answered, and the
    // connection still carries a message (into the peer's receive).
    let bound = KeepalivePolicy::DEFAULT.local.unwrap().bound_ns();
    std::thread::sleep(Duration::from_nanos(2 * bound));
    mem.write(64, b"alive?").unwrap();
    conn.qp()
        .post_send(wr::send(2, [mem.sge(64..70).unwrap()]))
        .unwrap();
    let wc = cq.wait(GIVE_UP).expect("the SEND's completion");
    assert_eq!((wc.wr_id, wc.status), (2, WcStatus::Success), "{wc:?}");
    // Both sides have the same idle timer, so either may probe first, and a side that
    // hears the other's probe has no reason to probe itself: ours answered (each probe is
    // a duplicate to its responder, and no packet was resent), or the peer answered ours.
    let s = dev.stats().engine;
    let ours_answered = s.keepalive_probes > 0 && s.keepalive_acks > 0;
    let theirs_answered = s.retransmits == 0 && s.duplicates > 0;
    assert!(ours_answered || theirs_answered, "{s:?}");
    assert_eq!(s.peers_lost, 0, "{s:?}");

    // SIGKILL: the peer sends nothing more, no DREQ.
    child.0.kill().unwrap();
    child.0.wait().unwrap();

    let wc = cq
        .wait(GIVE_UP)
        .expect("the waiting receive never completed after the peer died");
    assert_eq!((wc.wr_id, wc.status), (7, WcStatus::WrFlushErr), "{wc:?}");
    let ev = conn
        .id()
        .channel()
        .next_event(Some(GIVE_UP))
        .expect("no CM event after the peer died");
    assert_eq!(ev.kind(), EventType::Disconnected);
    assert_eq!(dev.stats().engine.peers_lost, 1);
    // What a program does on DISCONNECTED works.
    conn.disconnect().unwrap();
}
