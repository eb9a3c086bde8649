//! Two processes over real loopback UDP: this test binary spawns itself as the peer
//! (`SOFTRDMA_TEST_PEER=1`, test `peer_process`), which reports what it receives on
//! stdout and answers memory dumps. Every opcode and QP type, then RC exactly-once through
//! a lossy, reordering, duplicating relay.

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use softrdma::*;

mod support;
use support::Rng;

const T: Duration = Duration::from_secs(20);
const ALL: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_READ)
    .union(Access::REMOTE_ATOMIC)
    .union(Access::MW_BIND);
const MR_LEN: usize = 65536;
const RECVS: u64 = 64;
/// Receive buffers: RC at 16 KiB, UC at 32 KiB, UD at 48 KiB, 256 bytes each.
const RC_RECV: usize = 16384;
const UC_RECV: usize = 32768;
const UD_RECV: usize = 49152;
const SLOT: usize = 256;

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap_or(0))
        .collect()
}
fn gid_of(s: &str) -> Gid {
    let mut g = [0u8; 16];
    g.copy_from_slice(&unhex(s)[..16]);
    Gid(g)
}

/// One side's objects.
struct Side {
    dev: Device,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    rc: QueuePair,
    uc: QueuePair,
    ud: QueuePair,
    mr: MemoryRegion,
}

fn side(addr: Option<SocketAddr>) -> Side {
    let shm = DeviceConfig::new("test", DeviceAddr::AutoLoopback(4791)).shm;
    side_with("test", addr, shm)
}

/// A side whose device takes the same-host path to its peer if `shm`. Tests that run
/// side by side in this process use devices of different names (one name, one device).
fn side_with(name: &str, addr: Option<SocketAddr>, shm: bool) -> Side {
    let a = match addr {
        Some(a) => DeviceAddr::Fixed(a),
        None => DeviceAddr::AutoLoopback(4791),
    };
    let mut cfg = DeviceConfig::new(name, a);
    cfg.shm = shm;
    side_of(&cfg)
}

/// A side on a device that holds datagrams for a same-host peer that reads none for as
/// long as a test stops one (30 s), so that no drop depends on how fast a loaded machine
/// runs the test.
fn side_holding(name: &str) -> Side {
    let mut cfg = DeviceConfig::new(name, DeviceAddr::AutoLoopback(4791));
    cfg.shm = true;
    cfg.shm_hold = Duration::from_secs(30);
    side_of(&cfg)
}

fn side_of(cfg: &DeviceConfig) -> Side {
    let dev = Device::open_with(cfg).expect("open device");
    let pd = dev.alloc_pd().unwrap();
    // Room for the 512 + 512 WRs of each of the three QPs.
    let cq = dev.create_cq(3 * 1024, None).unwrap();
    let mut init = QpInit::new(QpType::Rc, &cq);
    init.cap.max_send_wr = 512;
    init.cap.max_recv_wr = 512;
    let rc = pd.create_qp(&init).unwrap();
    init.qp_type = QpType::Uc;
    let uc = pd.create_qp(&init).unwrap();
    init.qp_type = QpType::Ud;
    let ud = pd.create_qp(&init).unwrap();
    let mr = pd.register(MR_LEN, ALL).unwrap();
    Side {
        dev,
        pd,
        cq,
        rc,
        uc,
        ud,
        mr,
    }
}

fn fast_retry() -> PathOptions {
    PathOptions {
        // About 17 ms, seven retries: the lossy test still retransmits often, and a
        // machine loaded for tens of milliseconds (a 2-core CI runner building beside
        // it) does not exhaust the retries, as 1 ms timeouts did.
        timeout: 12,
        ..PathOptions::default()
    }
}

impl Side {
    fn connect(&self, peer_gid: Gid, rc: u32, uc: u32, psn: u32) {
        let o = fast_retry();
        self.rc
            .connect_with(
                &RemoteQp {
                    gid: peer_gid,
                    qpn: rc,
                    psn,
                },
                psn,
                ALL,
                &o,
            )
            .unwrap();
        self.uc
            .connect_with(
                &RemoteQp {
                    gid: peer_gid,
                    qpn: uc,
                    psn,
                },
                psn,
                ALL,
                &o,
            )
            .unwrap();
        self.ud.to_init(Access::empty()).unwrap();
        self.ud.to_rtr(&RemoteQp::default()).unwrap();
        self.ud.to_rts(psn).unwrap();
    }
}

/// The peer process: a passive target that reports every receive completion.
#[test]
fn peer_process() {
    if std::env::var("SOFTRDMA_TEST_PEER").as_deref() != Ok("1") {
        return;
    }
    let addr = std::env::var("SOFTRDMA_TEST_ADDR")
        .ok()
        .and_then(|a| a.parse().ok());
    if std::env::var("SOFTRDMA_TEST_NO_CMA").as_deref() == Ok("1") {
        refuse_cross_memory_attach();
    }
    let s = side(addr);
    // A second region, registered and deregistered on command (REG2, DEREG2); after its
    // deregistration its memory stays this process's, filled with a sentinel (CHECK2).
    let mut reg2: Option<MemoryRegion> = None;
    let mut freed2: Option<Vec<u8>> = None;
    let mw = s.pd.alloc_mw(2).unwrap();
    let mut out = std::io::stdout();
    let _ = writeln!(
        out,
        "INFO {} {} {} {} {} {} {}",
        hex(&s.dev.gid().0),
        s.rc.qpn(),
        s.uc.qpn(),
        s.ud.qpn(),
        s.mr.addr(),
        s.mr.rkey(),
        s.dev.addr()
    );
    let (tx, rx) = mpsc::channel::<String>();
    std::thread::spawn(move || {
        for l in std::io::stdin().lock().lines() {
            let Ok(l) = l else { break };
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(120);
    let peer = rx.recv_timeout(T).expect("PEER line");
    let f: Vec<&str> = peer.split_whitespace().collect();
    assert_eq!(f[0], "PEER");
    s.connect(
        gid_of(f[1]),
        f[2].parse().unwrap(),
        f[3].parse().unwrap(),
        f[4].parse().unwrap(),
    );
    for i in 0..RECVS {
        let o = (i as usize % 32) * SLOT;
        s.rc.post_recv(wr::recv(
            1000 + i,
            [s.mr.sge(RC_RECV + o..RC_RECV + o + SLOT).unwrap()],
        ))
        .unwrap();
        if i < 32 {
            s.uc.post_recv(wr::recv(
                2000 + i,
                [s.mr.sge(UC_RECV + o..UC_RECV + o + SLOT).unwrap()],
            ))
            .unwrap();
            s.ud.post_recv(wr::recv(
                3000 + i,
                [s.mr.sge(UD_RECV + o..UD_RECV + o + SLOT).unwrap()],
            ))
            .unwrap();
        }
    }
    // A type-2 window over the first 4 KiB, for SEND_WITH_INV.
    let rkey0 = mw.rkey().unwrap();
    let new_rkey = softrdma_transport::verbs::inc_rkey(rkey0);
    let bind = SendWr {
        wr_id: 9,
        op: SendOp::BindMw(MwBind {
            mw: mw.id(),
            rkey: new_rkey,
            mr_lkey: s.mr.lkey(),
            addr: s.mr.addr(),
            length: 4096,
            access: Access::REMOTE_WRITE | Access::REMOTE_READ,
        }),
        flags: SendFlags::SIGNALED,
        sg_list: vec![],
        inline_data: None,
        ud: None,
    };
    s.rc.post_send(bind).unwrap();
    let wc = s.cq.wait(T).unwrap();
    assert_eq!(wc.status, WcStatus::Success, "bind {wc:?}");
    let _ = writeln!(out, "READY {new_rkey}");
    let mut reposted = RECVS;
    loop {
        assert!(Instant::now() < deadline, "peer ran too long");
        for wc in s.cq.poll_iter() {
            let wc = wc.unwrap();
            let slot = (wc.wr_id % 1000) as usize % 32 * SLOT;
            let base = match wc.wr_id / 1000 {
                1 => RC_RECV,
                2 => UC_RECV,
                _ => UD_RECV,
            };
            let n = (wc.byte_len as usize).min(SLOT);
            let data = s.mr.to_vec(base + slot, n).unwrap();
            let _ = writeln!(
                out,
                "WC {} {} {} {} {} {} {} {}",
                wc.qp_num,
                wc.wr_id,
                wc.status as u32,
                wc.opcode as u32,
                wc.byte_len,
                wc.imm_data,
                wc.wc_flags.bits(),
                hex(&data)
            );
            // Keep the RC receive queue full for long runs (slots are reused mod 32, so
            // long tests only send one message in flight per slot).
            if wc.wr_id / 1000 == 1 {
                let i = reposted;
                reposted += 1;
                let o = (i as usize % 32) * SLOT;
                let _ = s.rc.post_recv(wr::recv(
                    1000 + i,
                    [s.mr.sge(RC_RECV + o..RC_RECV + o + SLOT).unwrap()],
                ));
            }
        }
        match rx.recv_timeout(Duration::from_micros(200)) {
            Ok(l) => {
                let f: Vec<&str> = l.split_whitespace().collect();
                match f.first().copied() {
                    Some("DUMP") => {
                        let off: usize = f[1].parse().unwrap();
                        let len: usize = f[2].parse().unwrap();
                        let _ = writeln!(out, "MEM {}", hex(&s.mr.to_vec(off, len).unwrap()));
                    }
                    Some("U64") => {
                        let off: usize = f[1].parse().unwrap();
                        let _ = writeln!(out, "U64 {}", s.mr.read_u64(off).unwrap());
                    }
                    Some("REG2") => {
                        let len: usize = f[1].parse().unwrap();
                        let mr = s.pd.register(len, ALL).unwrap();
                        let _ = writeln!(out, "REG2 {} {}", mr.addr(), mr.rkey());
                        reg2 = Some(mr);
                    }
                    Some("DEREG2") => {
                        let mr = reg2.take().expect("REG2 first");
                        let addr = mr.addr();
                        let mut v = mr.into_vec().unwrap();
                        assert_eq!(v.as_ptr() as u64, addr, "the region's own memory");
                        v.fill(0xEE);
                        freed2 = Some(v);
                        let _ = writeln!(out, "DEREGGED");
                    }
                    Some("CHECK2") => {
                        let v = freed2.as_ref().expect("DEREG2 first");
                        let bad = v.iter().filter(|&&b| b != 0xEE).count();
                        let _ = writeln!(out, "CHECK2 {bad}");
                    }
                    Some("PUT") => {
                        // An RC WRITE of our first LEN bytes to ADDR/RKEY of the test's
                        // device: its status, whether it was placed, and the path to it.
                        let remote = RemoteMemory {
                            addr: f[1].parse().unwrap(),
                            rkey: f[2].parse().unwrap(),
                            len: f[3].parse().unwrap(),
                        };
                        let len = remote.len as usize;
                        s.mr.write(0, &vec![0x3C; len]).unwrap();
                        let w = wr::write(77, [s.mr.sge(0..len).unwrap()], &remote, 0).unwrap();
                        s.rc.post_send(w).unwrap();
                        let wc = s.cq.wait(T).unwrap();
                        let st = s.dev.stats();
                        let why = st
                            .peers
                            .iter()
                            .map(|p| format!("{}: {}", p.peer, p.why))
                            .collect::<Vec<_>>()
                            .join("; ");
                        let _ = writeln!(
                            out,
                            "PUT {} {} {} {why}",
                            wc.wr_id, wc.status as u32, st.engine.placed_writes
                        );
                    }
                    Some("STATS") => {
                        let st = s.dev.stats();
                        let _ = writeln!(
                            out,
                            "STATS {} {} {}",
                            st.engine.icrc_errors,
                            st.driver.shm_sent_datagrams,
                            st.driver.shm_recv_datagrams
                        );
                    }
                    _ => return,
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(_) => return,
        }
    }
}

/// Make this process's `process_vm_readv` and `process_vm_writev` fail with EPERM, as a
/// container's seccomp profile may: a filter on this thread and the threads it starts
/// after (the device's), so that the same-host path finds cross-memory attach refused.
fn refuse_cross_memory_attach() {
    let errno = libc::SECCOMP_RET_ERRNO | libc::EPERM as u32;
    let stmt = |code: u32, k: u32| libc::sock_filter {
        code: code as u16,
        jt: 0,
        jf: 0,
        k,
    };
    let jeq = |k: u32, jt: u8| libc::sock_filter {
        code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
        jt,
        jf: 0,
        k,
    };
    let prog = [
        // The system call's number (offset 0 of `seccomp_data`).
        stmt(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, 0),
        jeq(libc::SYS_process_vm_readv as u32, 2),
        jeq(libc::SYS_process_vm_writev as u32, 1),
        stmt(libc::BPF_RET | libc::BPF_K, libc::SECCOMP_RET_ALLOW),
        stmt(libc::BPF_RET | libc::BPF_K, errno),
    ];
    let fprog = libc::sock_fprog {
        len: prog.len() as u16,
        filter: prog.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: prctl with integer arguments; no_new_privs only narrows what exec gives.
    let r = unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
    assert_eq!(r, 0, "PR_SET_NO_NEW_PRIVS");
    // SAFETY: `fprog` points at `prog`, a valid filter that outlives the call (the kernel
    // copies it).
    let r = unsafe {
        libc::prctl(
            libc::PR_SET_SECCOMP,
            libc::SECCOMP_MODE_FILTER,
            &fprog as *const libc::sock_fprog,
        )
    };
    assert_eq!(r, 0, "PR_SET_SECCOMP: {}", std::io::Error::last_os_error());
}

/// The spawned peer, seen from the test.
struct Peer {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
    gid: Gid,
    rc: u32,
    uc: u32,
    ud: u32,
    mem: RemoteMemory,
    mw_rkey: u32,
    addr: SocketAddr,
}

/// A peer outlives no test: one that panics while its peer is stopped (SIGSTOP) would
/// otherwise leave a stopped process holding a loopback address and its port, which every
/// later connection to that address waits on in vain.
impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Peer {
    fn spawn(addr: Option<SocketAddr>) -> Peer {
        Peer::spawn_with(addr, None)
    }
    /// The peer, with `SOFTRDMA_SHM` set to `shm` if given.
    fn spawn_with(addr: Option<SocketAddr>, shm: Option<&str>) -> Peer {
        Peer::spawn_env(addr, shm, &[])
    }
    /// The peer, with `SOFTRDMA_SHM` set to `shm` if given, and `env` besides.
    fn spawn_env(addr: Option<SocketAddr>, shm: Option<&str>, env: &[(&str, &str)]) -> Peer {
        let exe = std::env::current_exe().unwrap();
        let mut cmd = Command::new(exe);
        cmd.args([
            "--exact",
            "peer_process",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("SOFTRDMA_TEST_PEER", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
        if let Some(a) = addr {
            cmd.env("SOFTRDMA_TEST_ADDR", a.to_string());
        }
        if let Some(v) = shm {
            cmd.env("SOFTRDMA_SHM", v);
        }
        cmd.envs(env.iter().copied());
        let mut child = cmd.spawn().expect("spawn peer");
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(stdout).lines() {
                let Ok(l) = l else { break };
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let mut p = Peer {
            child,
            stdin,
            lines,
            gid: Gid::default(),
            rc: 0,
            uc: 0,
            ud: 0,
            mem: RemoteMemory::default(),
            mw_rkey: 0,
            addr: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
        };
        let info = p.expect("INFO");
        let f: Vec<&str> = info.split_whitespace().collect();
        p.gid = gid_of(f[1]);
        p.rc = f[2].parse().unwrap();
        p.uc = f[3].parse().unwrap();
        p.ud = f[4].parse().unwrap();
        p.mem = RemoteMemory {
            addr: f[5].parse().unwrap(),
            rkey: f[6].parse().unwrap(),
            len: MR_LEN as u64,
        };
        p.addr = f[7].parse().unwrap();
        p
    }
    /// Connect `me`'s RC and UC QPs and this peer's, both from `psn`: the peer's READY line.
    fn connect(&mut self, me: &Side, psn: u32) -> String {
        self.send(&format!(
            "PEER {} {} {} {psn}",
            hex(&me.dev.gid().0),
            me.rc.qpn(),
            me.uc.qpn()
        ));
        me.connect(self.gid, self.rc, self.uc, psn);
        self.expect("READY")
    }
    /// Send the peer process signal `sig` (`-STOP`, `-CONT`, `-KILL`).
    fn signal(&self, sig: &str) {
        let pid = self.child.id().to_string();
        let st = Command::new("kill").args([sig, &pid]).status().unwrap();
        assert!(st.success(), "kill {sig}");
    }
    fn send(&mut self, l: &str) {
        writeln!(self.stdin, "{l}").unwrap();
        self.stdin.flush().unwrap();
    }
    /// The next line starting with `prefix` (other lines are test-harness chatter).
    fn expect(&mut self, prefix: &str) -> String {
        let deadline = Instant::now() + T;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                // libtest may print "test peer_process ... " in front of the first line.
                Ok(l) => {
                    if let Some(i) = l.find(prefix) {
                        return l[i..].to_string();
                    }
                }
                Err(e) => panic!("peer: no {prefix} line: {e}"),
            }
        }
    }
    /// The next receive completion: (wr_id, status, opcode, byte_len, imm, flags, data).
    fn wc(&mut self) -> (u64, u32, u32, u32, u32, u32, Vec<u8>) {
        let l = self.expect("WC ");
        let f: Vec<&str> = l.split_whitespace().collect();
        (
            f[2].parse().unwrap(),
            f[3].parse().unwrap(),
            f[4].parse().unwrap(),
            f[5].parse().unwrap(),
            f[6].parse().unwrap(),
            f[7].parse().unwrap(),
            unhex(f.get(8).copied().unwrap_or("")),
        )
    }
    fn dump(&mut self, off: usize, len: usize) -> Vec<u8> {
        self.send(&format!("DUMP {off} {len}"));
        unhex(&self.expect("MEM ")[4..])
    }
    fn u64_at(&mut self, off: usize) -> u64 {
        self.send(&format!("U64 {off}"));
        self.expect("U64 ")[4..].parse().unwrap()
    }
    fn quit(mut self) {
        self.send("QUIT");
        let deadline = Instant::now() + T;
        loop {
            match self.child.try_wait() {
                Ok(Some(st)) => {
                    assert!(st.success(), "peer exited with {st}");
                    return;
                }
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                _ => {
                    let _ = self.child.kill();
                    panic!("peer did not exit");
                }
            }
        }
    }
}

fn ok(cq: &CompletionQueue, wr_id: u64, op: WcOpcode) -> WorkCompletion {
    let wc = cq.wait(T).expect("completion");
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode),
        (wr_id, WcStatus::Success, op),
        "{wc:?}"
    );
    wc
}

/// Every opcode and QP type between two processes of this host: through the same-host
/// rings (the default), every datagram both ways.
#[test]
fn every_opcode_and_qp_type() {
    if std::env::var("SOFTRDMA_TEST_PEER").is_ok() {
        return;
    }
    every_opcode(true);
}

/// The same with `SOFTRDMA_SHM=0`: by UDP, no datagram through a ring.
#[test]
fn every_opcode_and_qp_type_over_udp() {
    if std::env::var("SOFTRDMA_TEST_PEER").is_ok() {
        return;
    }
    every_opcode(false);
}

/// A ring whose reader stops (the peer process stopped, as in a debugger) loses nothing:
/// the sender holds what the ring has no room for and sends it, in order, once the reader
/// runs again. UC has no retransmission, so every byte landing shows that no datagram was
/// dropped.
#[test]
fn full_ring_holds_datagrams() {
    if std::env::var("SOFTRDMA_TEST_PEER").is_ok() {
        return;
    }
    let mut p = Peer::spawn_with(None, Some("1"));
    let me = side_holding("test-hold");
    let psn = 0x777;
    p.connect(&me, psn);
    // One SEND first, so that the ring exists before the peer stops.
    me.mr.write(0, b"hi").unwrap();
    me.rc
        .post_send(wr::send(1, [me.mr.sge(0..2).unwrap()]))
        .unwrap();
    ok(&me.cq, 1, WcOpcode::Send);
    assert_eq!(p.wc().6, b"hi");

    // 40 UC WRITEs of the whole 64 KiB window at MTU 1024: 2560 datagrams, more than
    // twice the ring's 1024 slots. Each message's bytes differ, so the last one's pattern
    // is what the peer must end with.
    const N: u64 = 40;
    let pattern = |k: u64| -> Vec<u8> {
        (0..MR_LEN)
            .map(|i| (i as u64 * 31 + k * 7 + (i as u64 >> 10)) as u8)
            .collect()
    };
    let mems: Vec<_> = (0..N)
        .map(|k| {
            let mr = me.pd.register(MR_LEN, ALL).unwrap();
            mr.write(0, &pattern(k)).unwrap();
            mr
        })
        .collect();
    p.signal("-STOP");
    for (k, mr) in mems.iter().enumerate() {
        me.uc
            .post_send(wr::write(100 + k as u64, [mr.sge(0..MR_LEN).unwrap()], &p.mem, 0).unwrap())
            .unwrap();
    }
    for k in 0..N {
        ok(&me.cq, 100 + k, WcOpcode::RdmaWrite);
    }
    let held = me.dev.stats().link.tx_held;
    p.signal("-CONT");
    assert!(held > 0, "the ring filled while its reader was stopped");
    let want = pattern(N - 1);
    let deadline = Instant::now() + T;
    while p.dump(0, MR_LEN) != want {
        assert!(
            Instant::now() < deadline,
            "the last UC WRITE did not land whole"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    p.send("STATS");
    let st = p.expect("STATS ");
    let f: Vec<u64> = st[6..]
        .split_whitespace()
        .map(|x| x.parse().unwrap())
        .collect();
    let s = me.dev.stats();
    assert_eq!(
        (s.link.tx_dropped, s.link.tx_held_expired),
        (0, 0),
        "{:?}",
        s.link
    );
    assert_eq!(
        f[2], s.driver.shm_sent_datagrams,
        "the peer took every datagram we sent"
    );
    assert_eq!(s.driver.sent_datagrams, 0, "nothing by UDP");
    p.quit();
}

/// A same-host peer killed (SIGKILL) in the middle of a transfer, while datagrams to it
/// wait for room in its ring: the survivor's QP ends in the error completions UDP would
/// give (retry exceeded, then flushes) in bounded time, and a peer restarted at the same
/// address works at once (by UDP while the last failed look for its ring holds, 100 ms)
/// and then through a ring.
#[test]
fn peer_killed_mid_transfer() {
    if std::env::var("SOFTRDMA_TEST_PEER").is_ok() {
        return;
    }
    // The peer at an address of its own, outside the 127.0.0.x that devices opened
    // anywhere on the host take first free: its restart below finds it still free.
    let addr = SocketAddr::from(([127, 0, 9, (std::process::id() % 250 + 1) as u8], 4791));
    let mut p = Peer::spawn_with(Some(addr), Some("1"));
    let me = side_holding("test-kill");
    let psn = 0x4242;
    p.connect(&me, psn);
    me.mr.write(0, b"hi").unwrap();
    me.rc
        .post_send(wr::send(1, [me.mr.sge(0..2).unwrap()]))
        .unwrap();
    ok(&me.cq, 1, WcOpcode::Send);
    assert_eq!(p.wc().6, b"hi");

    // Stopped first, so that its ring fills and what we send waits in our device for room:
    // UC WRITEs fill it (UC has no window: 2560 datagrams, more than twice its slots),
    // then RC SENDs queue behind them (RC WRITEs would not: they go straight into the
    // stopped process's memory, and finish).
    p.signal("-STOP");
    const UC: u64 = 40;
    for k in 0..UC {
        me.uc
            .post_send(wr::write(200 + k, [me.mr.sge(0..MR_LEN).unwrap()], &p.mem, 0).unwrap())
            .unwrap();
    }
    const N: u64 = 16;
    for k in 0..N {
        me.rc
            .post_send(wr::send(100 + k, [me.mr.sge(0..MR_LEN).unwrap()]))
            .unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while me.dev.stats().link.tx_held == 0 {
        assert!(
            Instant::now() < deadline,
            "the stopped peer's ring never filled"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    p.signal("-KILL");
    let _ = p.child.wait();
    // UC completes as it sends; RC ends in retry exceeded, then flushes, in order.
    let mut rc = Vec::new();
    let mut uc = 0;
    while rc.len() < N as usize || uc < UC {
        let wc = me.cq.wait(T).expect("every completion in bounded time");
        if wc.wr_id >= 200 {
            assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
            uc += 1;
        } else {
            rc.push((wc.wr_id, wc.status));
        }
    }
    let want: Vec<_> = (0..N)
        .map(|k| {
            let st = if k == 0 {
                WcStatus::RetryExcErr
            } else {
                WcStatus::WrFlushErr
            };
            (100 + k, st)
        })
        .collect();
    assert_eq!(rc, want);
    assert_eq!(
        me.dev.stats().link.tx_held_expired,
        0,
        "nothing waited 100 ms"
    );

    // A peer restarted at the same address works at once, and gets a ring.
    let mut p2 = Peer::spawn_with(Some(p.addr), Some("1"));
    assert_eq!(p2.addr, p.addr);
    let me2 = side_holding("test-kill");
    assert_eq!(me2.dev.addr(), me.dev.addr(), "one device, new QPs");
    p2.connect(&me2, psn);
    me2.mr.write(0, b"again").unwrap();
    me2.rc
        .post_send(wr::send(2, [me2.mr.sge(0..5).unwrap()]))
        .unwrap();
    ok(&me2.cq, 2, WcOpcode::Send);
    assert_eq!(p2.wc().6, b"again");
    // Its ring comes once the last failed look at the address (100 ms) has passed and the
    // rendezvous is made: bounded, as a loaded machine may take longer than that.
    let deadline = Instant::now() + Duration::from_secs(10);
    for k in 3.. {
        std::thread::sleep(Duration::from_millis(50));
        let sent = me2.dev.stats().driver.shm_sent_datagrams;
        me2.rc
            .post_send(wr::send(k, [me2.mr.sge(0..5).unwrap()]))
            .unwrap();
        ok(&me2.cq, k, WcOpcode::Send);
        assert_eq!(p2.wc().6, b"again");
        let st = me2.dev.stats();
        if st.driver.shm_sent_datagrams > sent {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "never through a ring: {:?}",
            st.driver
        );
    }
    let st = me2.dev.stats();
    assert!(
        st.peers.iter().any(|x| x.peer == p.addr && x.ring),
        "{:?}",
        st.peers
    );
    p2.quit();
}

fn every_opcode(shm: bool) {
    let mut p = Peer::spawn_with(None, Some(if shm { "1" } else { "0" }));
    let me = side_with(if shm { "test-shm" } else { "test-udp" }, None, shm);
    let psn = 0x12345;
    let r = p.connect(&me, psn);
    p.mw_rkey = r[6..].parse().unwrap();
    let mr = &me.mr;

    // RC SEND
    mr.write(0, b"rc send").unwrap();
    me.rc
        .post_send(wr::send(1, [mr.sge(0..7).unwrap()]))
        .unwrap();
    ok(&me.cq, 1, WcOpcode::Send);
    let w = p.wc();
    assert_eq!((w.1, w.2, w.3), (0, WcOpcode::Recv as u32, 7));
    assert_eq!(w.6, b"rc send");
    // RC SEND_WITH_IMM
    me.rc
        .post_send(wr::send_with_imm(2, [mr.sge(0..2).unwrap()], 0xBEEF))
        .unwrap();
    ok(&me.cq, 2, WcOpcode::Send);
    let w = p.wc();
    assert_eq!((w.2, w.4), (WcOpcode::Recv as u32, 0xBEEF));
    assert!(WcFlags::from_bits_truncate(w.5).contains(WcFlags::WITH_IMM));
    // RC SEND_WITH_INV: invalidates the peer's memory window
    me.rc
        .post_send(wr::send_with_inv(3, [mr.sge(0..3).unwrap()], p.mw_rkey))
        .unwrap();
    ok(&me.cq, 3, WcOpcode::Send);
    let w = p.wc();
    assert_eq!((w.1, w.4), (0, p.mw_rkey));
    assert!(WcFlags::from_bits_truncate(w.5).contains(WcFlags::WITH_INV));
    // RC WRITE, several packets
    let data: Vec<u8> = (0..5000u32).map(|i| (i * 13 + 7) as u8).collect();
    mr.write(1000, &data).unwrap();
    me.rc
        .post_send(wr::write(4, [mr.sge(1000..6000).unwrap()], &p.mem, 100).unwrap())
        .unwrap();
    ok(&me.cq, 4, WcOpcode::RdmaWrite);
    assert_eq!(p.dump(100, 5000), data);
    // RC READ back
    me.rc
        .post_send(wr::read(5, [mr.sge(8000..13000).unwrap()], &p.mem, 100).unwrap())
        .unwrap();
    ok(&me.cq, 5, WcOpcode::RdmaRead);
    assert_eq!(mr.to_vec(8000, 5000).unwrap(), data);
    // RC WRITE_WITH_IMM
    mr.write(0, b"imm").unwrap();
    me.rc
        .post_send(wr::write_with_imm(6, [mr.sge(0..3).unwrap()], &p.mem, 6000, 42).unwrap())
        .unwrap();
    ok(&me.cq, 6, WcOpcode::RdmaWrite);
    let w = p.wc();
    assert_eq!((w.2, w.4), (WcOpcode::RecvRdmaWithImm as u32, 42));
    assert_eq!(p.dump(6000, 3), b"imm");
    // RC FETCH_AND_ADD and COMPARE_AND_SWAP at an 8-aligned address
    let off = 8192u64;
    me.rc
        .post_send(wr::fetch_add(7, mr.sge(16..24).unwrap(), &p.mem, off, 5).unwrap())
        .unwrap();
    ok(&me.cq, 7, WcOpcode::FetchAdd);
    assert_eq!(mr.read_u64(16).unwrap(), 0);
    me.rc
        .post_send(wr::compare_swap(8, mr.sge(24..32).unwrap(), &p.mem, off, 5, 77).unwrap())
        .unwrap();
    ok(&me.cq, 8, WcOpcode::CompSwap);
    assert_eq!(mr.read_u64(24).unwrap(), 5);
    assert_eq!(p.u64_at(off as usize), 77);

    // UC SEND and WRITE
    mr.write(0, b"uc send").unwrap();
    me.uc
        .post_send(wr::send(10, [mr.sge(0..7).unwrap()]))
        .unwrap();
    ok(&me.cq, 10, WcOpcode::Send);
    let w = p.wc();
    assert_eq!((w.0 / 1000, w.1, w.6.as_slice()), (2, 0, &b"uc send"[..]));
    me.uc
        .post_send(wr::write(11, [mr.sge(1000..3000).unwrap()], &p.mem, 10000).unwrap())
        .unwrap();
    ok(&me.cq, 11, WcOpcode::RdmaWrite);
    // UC completes at the sender when sent: wait for the bytes to land.
    let deadline = Instant::now() + T;
    while p.dump(10000, 2000) != data[..2000] {
        assert!(Instant::now() < deadline, "UC WRITE did not land");
        std::thread::sleep(Duration::from_millis(5));
    }

    // UD SEND with GRH, through an address handle with a traffic class
    let ah = me.pd.create_ah(&ah_attr(p.gid, 0x10)).unwrap();
    mr.write(0, b"ud datagram").unwrap();
    me.ud
        .post_send(wr::ud_send(
            12,
            [mr.sge(0..11).unwrap()],
            ah.dest(p.ud, DEFAULT_QKEY),
        ))
        .unwrap();
    ok(&me.cq, 12, WcOpcode::Send);
    let w = p.wc();
    assert_eq!(w.0 / 1000, 3);
    assert_eq!(w.3, 40 + 11, "GRH + payload");
    assert!(WcFlags::from_bits_truncate(w.5).contains(WcFlags::GRH));
    assert_eq!(&w.6[40..], b"ud datagram");
    // IPv4 header in the GRH's last 20 bytes, source is us. (Its TOS byte is not checked:
    // `Rnic::handle_datagram` is not given the received TOS; the pcap test checks the
    // traffic class on the wire instead.)
    assert_eq!(w.6[20] >> 4, 4);
    assert_eq!(&w.6[32..36], &me.dev.gid().0[12..16]);

    p.send("STATS");
    let st = p.expect("STATS ");
    let f: Vec<u64> = st[6..]
        .split_whitespace()
        .map(|x| x.parse().unwrap())
        .collect();
    assert_eq!(f[0], 0, "peer saw ICRC errors");
    let mine = me.dev.stats();
    assert_eq!(mine.engine.icrc_errors, 0);
    let d = mine.driver;
    if shm {
        // Every datagram of ours went through the ring, and every one of the peer's
        // (its ACKs, READ responses and atomic ACKs) came through its ring to us.
        assert!(d.shm_sent_datagrams > 0, "{d:?}");
        assert_eq!(d.sent_datagrams, 0, "nothing by UDP: {d:?}");
        assert_eq!(d.recv_datagrams, 0, "nothing by UDP: {d:?}");
        assert_eq!(
            f[2], d.shm_sent_datagrams,
            "the peer took all of ours from the ring"
        );
        assert_eq!(f[1], d.shm_recv_datagrams, "and we took all of its");
        assert_eq!(mine.same_host, "on");
        let peer = mine.peers.iter().find(|x| x.peer == p.addr);
        assert!(
            peer.is_some_and(|x| x.ring && x.why.contains("this host")),
            "the peer's path, as `softrdma stats` shows it: {:?}",
            mine.peers
        );
    } else {
        assert!(mine.same_host.starts_with("off"), "{}", mine.same_host);
        assert_eq!(mine.peers, vec![], "no same-host path, no per-peer paths");
        assert_eq!(
            (d.shm_sent_datagrams, d.shm_recv_datagrams),
            (0, 0),
            "{d:?}"
        );
        assert_eq!((f[1], f[2]), (0, 0), "the peer used no ring");
        assert!(d.sent_datagrams > 0 && d.recv_datagrams > 0, "{d:?}");
    }
    p.quit();
}

// ------------------------------------------------------------------ lossy relay

/// Free 127.0.0.x addresses on port 4791: bound sockets (kept for the relay, or dropped
/// just before a device binds the address).
fn free_loopback(n: usize) -> Vec<UdpSocket> {
    let mut v = Vec::new();
    for x in 2..=254u8 {
        if v.len() == n {
            break;
        }
        let a = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(127, 0, 0, x)), 4791);
        if let Ok(s) = UdpSocket::bind(a) {
            v.push(s);
        }
    }
    assert_eq!(v.len(), n, "not enough free loopback addresses");
    v
}

/// Forward datagrams arriving on `from` (sent by `src_dev`) out of `to` towards `dst_dev`,
/// resealing the ICRC for the addresses the receiver sees, with seeded faults.
fn relay(from: UdpSocket, to: UdpSocket, dst_dev: SocketAddr, seed: u64, stop: Arc<AtomicBool>) {
    let mut rng = Rng(seed | 1);
    let _ = from.set_read_timeout(Some(Duration::from_millis(2)));
    let out_addr = to.local_addr().unwrap();
    let mut held: Vec<Vec<u8>> = Vec::new();
    let mut buf = vec![0u8; 9216];
    let addrs = softrdma_wire::Addrs::new(out_addr, dst_dev);
    while !stop.load(Ordering::Relaxed) {
        match from.recv_from(&mut buf) {
            Ok((n, _)) => {
                let mut d = buf[..n].to_vec();
                softrdma_wire::icrc::seal(&addrs, &mut d);
                if rng.chance(0.05) {
                    continue; // lost
                }
                if rng.chance(0.05) {
                    held.push(d); // overtaken by the next packets
                    continue;
                }
                let _ = to.send_to(&d, dst_dev);
                if rng.chance(0.03) {
                    let _ = to.send_to(&d, dst_dev); // duplicated
                }
                for h in held.drain(..) {
                    let _ = to.send_to(&h, dst_dev);
                }
            }
            Err(_) => {
                for h in held.drain(..) {
                    let _ = to.send_to(&h, dst_dev);
                }
            }
        }
    }
}

#[test]
fn rc_exactly_once_through_lossy_relay() {
    if std::env::var("SOFTRDMA_TEST_PEER").is_ok() {
        return;
    }
    let seed: u64 = std::env::var("SOFTRDMA_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5EED_1234);
    eprintln!("relay seed {seed} (SOFTRDMA_TEST_SEED to repeat)");
    // A = this process, B = the peer; RA is where B thinks A is, RB where A thinks B is.
    // Devices take free addresses atomically (auto loopback); the relay's stay bound.
    let mut socks = free_loopback(2);
    let (ra, rb) = (socks.remove(0), socks.remove(0));
    let (ra_addr, rb_addr) = (ra.local_addr().unwrap(), rb.local_addr().unwrap());
    let mut p = Peer::spawn(None);
    let me = side(None);
    let (a_addr, b_addr) = (me.dev.addr(), p.addr);
    let stop = Arc::new(AtomicBool::new(false));
    let (ra2, rb2) = (ra.try_clone().unwrap(), rb.try_clone().unwrap());
    let st = Arc::clone(&stop);
    // A -> RB -> (out of RA) -> B
    let t1 = std::thread::spawn(move || relay(rb, ra, b_addr, seed, st));
    let st = Arc::clone(&stop);
    // B -> RA -> (out of RB) -> A
    let t2 = std::thread::spawn(move || relay(ra2, rb2, a_addr, seed ^ 0xABCDEF, st));
    let ra_gid = Gid::from_ip(ra_addr.ip());
    let rb_gid = Gid::from_ip(rb_addr.ip());
    let psn = 0xFFFF00; // wraps the 24-bit PSN during the run
    p.send(&format!(
        "PEER {} {} {} {psn}",
        hex(&ra_gid.0),
        me.rc.qpn(),
        me.uc.qpn()
    ));
    me.connect(rb_gid, p.rc, p.uc, psn);
    p.expect("READY");
    let mr = &me.mr;

    // Rounds of: 4 SENDs (distinct contents), 4 WRITEs of 3000 bytes, a READ, 4 FAAs.
    const ROUNDS: u64 = 12;
    let mut wr_id = 0u64;
    let mut sends_expected = Vec::new();
    for round in 0..ROUNDS {
        let mut posted = 0;
        for k in 0..4u64 {
            let msg = format!("send {round}.{k}");
            let off = 100 + (k as usize) * 32;
            mr.write(off, msg.as_bytes()).unwrap();
            wr_id += 1;
            me.rc
                .post_send(wr::send(wr_id, [mr.sge(off..off + msg.len()).unwrap()]))
                .unwrap();
            sends_expected.push(msg.into_bytes());
            posted += 1;
        }
        for k in 0..4u64 {
            let chunk: Vec<u8> = (0..3000u64)
                .map(|i| (i + round * 31 + k * 7) as u8)
                .collect();
            let src = 1000 + (k as usize) * 3000;
            mr.write(src, &chunk).unwrap();
            wr_id += 1;
            me.rc
                .post_send(
                    wr::write(wr_id, [mr.sge(src..src + 3000).unwrap()], &p.mem, k * 3000).unwrap(),
                )
                .unwrap();
            posted += 1;
        }
        wr_id += 1;
        me.rc
            .post_send(wr::read(wr_id, [mr.sge(20000..32000).unwrap()], &p.mem, 0).unwrap())
            .unwrap();
        posted += 1;
        for _ in 0..4 {
            wr_id += 1;
            me.rc
                .post_send(
                    wr::fetch_add(wr_id, mr.sge(40000..40008).unwrap(), &p.mem, 40000, 1).unwrap(),
                )
                .unwrap();
            posted += 1;
        }
        let wcs = me.cq.wait_n(posted, Duration::from_secs(60)).unwrap();
        for wc in &wcs {
            assert_eq!(wc.status, WcStatus::Success, "{wc:?} (seed {seed})");
        }
        // The READ was posted after the WRITEs: it returns their bytes.
        for k in 0..4u64 {
            let chunk: Vec<u8> = (0..3000u64)
                .map(|i| (i + round * 31 + k * 7) as u8)
                .collect();
            let at = 20000 + (k as usize) * 3000;
            assert_eq!(
                mr.to_vec(at, 3000).unwrap(),
                chunk,
                "round {round} (seed {seed})"
            );
        }
        // Every SEND arrives exactly once, in order.
        for k in 0..4 {
            let w = p.wc();
            assert_eq!(w.1, 0, "seed {seed}");
            let i = (round * 4 + k) as usize;
            assert_eq!(w.6, sends_expected[i], "seed {seed}");
        }
    }
    // Each FAA applied exactly once despite duplicates and retries (atomic replay).
    assert_eq!(p.u64_at(40000), ROUNDS * 4, "seed {seed}");
    let s = me.dev.stats();
    eprintln!(
        "retransmits {} timeouts {} tx {} rx {}",
        s.engine.retransmits, s.engine.timeouts, s.engine.tx_packets, s.engine.rx_packets
    );
    assert!(
        s.engine.retransmits > 0,
        "the relay's faults were not exercised"
    );
    p.send("STATS");
    let st = p.expect("STATS ");
    assert!(
        st.starts_with("STATS 0 "),
        "ICRC errors after resealing: {st}"
    );
    p.quit();
    stop.store(true, Ordering::Relaxed);
    let _ = t1.join();
    let _ = t2.join();
}

/// A region deregistered while a same-host peer streams WRITEs into it is never written
/// after the deregistration returns: the requester's copies (cross-memory attach) stop
/// before it, and the WRITEs after it are refused as they are over the network.
#[test]
fn a_deregistered_region_is_never_written() {
    if std::env::var("SOFTRDMA_TEST_PEER").is_ok() {
        return;
    }
    let mut p = Peer::spawn_with(None, Some("1"));
    let me = side_with("test-dereg", None, true);
    p.connect(&me, 0x4242);
    const LEN: usize = 1 << 20;
    p.send(&format!("REG2 {LEN}"));
    let r = p.expect("REG2 ");
    let f: Vec<&str> = r.split_whitespace().collect();
    let target = RemoteMemory {
        addr: f[1].parse().unwrap(),
        rkey: f[2].parse().unwrap(),
        len: LEN as u64,
    };
    let src = me.pd.register(LEN, ALL).unwrap();
    src.write(0, &vec![0x11; LEN]).unwrap();
    // Keep WRITEs going (a few in flight) until one fails; the deregistration comes
    // while they go.
    let mut posted = 0u64;
    let mut done = 0u64;
    let mut dereg_sent = false;
    let mut failed = None;
    let deadline = Instant::now() + Duration::from_secs(60);
    while failed.is_none() {
        assert!(
            Instant::now() < deadline,
            "no WRITE failed after the deregistration"
        );
        while posted - done < 4 {
            let w = wr::write(posted, [src.sge(0..LEN).unwrap()], &target, 0).unwrap();
            if me.rc.post_send(w).is_err() {
                break;
            }
            posted += 1;
        }
        if posted >= 16 && !dereg_sent {
            p.send("DEREG2");
            dereg_sent = true;
        }
        let wc = me.cq.wait(T).expect("a completion");
        done += 1;
        if wc.status != WcStatus::Success {
            failed = Some(wc);
        }
    }
    p.expect("DEREGGED");
    let wc = failed.unwrap();
    assert_eq!(wc.status, WcStatus::RemAccessErr, "{wc:?}");
    // Whatever was in flight has finished (the QP is in error: the rest flush).
    while me.cq.wait(Duration::from_millis(200)).is_ok() {}
    p.send("CHECK2");
    assert_eq!(
        p.expect("CHECK2 "),
        "CHECK2 0",
        "written after its deregistration"
    );
    assert!(
        me.dev.stats().engine.placed_writes > 0,
        "the WRITEs before the deregistration went by cross-memory attach"
    );
}

/// Where cross-memory attach is refused (here a seccomp filter in the requester's process,
/// as a container profile may set), the same-host path still carries one-sided operations,
/// through the ring, and says why per peer.
#[test]
fn refused_cross_memory_attach_falls_back_to_the_ring() {
    if std::env::var("SOFTRDMA_TEST_PEER").is_ok() {
        return;
    }
    let mut p = Peer::spawn_env(None, Some("1"), &[("SOFTRDMA_TEST_NO_CMA", "1")]);
    let me = side_with("test-nocma", None, true);
    p.connect(&me, 0x99);
    // One SEND first, so that the ring exists.
    me.mr.write(0, b"hi").unwrap();
    me.rc
        .post_send(wr::send(9, [me.mr.sge(0..2).unwrap()]))
        .unwrap();
    ok(&me.cq, 9, WcOpcode::Send);
    assert_eq!(p.wc().6, b"hi");
    // Our WRITE to it: cross-memory attach into it works from here.
    // (8 KiB: a smaller one goes as packets while the peer's device polls.)
    me.mr.write(0, &[0x5A; 8192]).unwrap();
    me.rc
        .post_send(wr::write(1, [me.mr.sge(0..8192).unwrap()], &p.mem, 0).unwrap())
        .unwrap();
    ok(&me.cq, 1, WcOpcode::RdmaWrite);
    assert_eq!(p.dump(0, 8192), vec![0x5A; 8192]);
    assert_eq!(me.dev.stats().engine.placed_writes, 1);
    // Its WRITE to us: refused by its filter, so its packets go through the ring.
    p.send(&format!("PUT {} {} 3000", me.mr.addr(), me.mr.rkey()));
    let put = p.expect("PUT ");
    let f: Vec<&str> = put.splitn(5, ' ').collect();
    assert_eq!(
        f[1..4],
        ["77", &(WcStatus::Success as u32).to_string(), "0"],
        "{put}"
    );
    assert!(f[4].contains("cross-memory attach refused"), "{put}");
    assert_eq!(me.mr.to_vec(0, 3000).unwrap(), vec![0x3C; 3000]);
    let st = me.dev.stats();
    assert!(
        st.driver.shm_recv_datagrams >= 3,
        "through the ring: {st:?}"
    );
}
