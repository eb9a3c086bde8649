//! `softrdma perf`: perftest-like bandwidth and latency benchmarks over one RC QP.
//!
//! The side channel (TCP, port 18516 by default) is ours, one text line each way:
//!
//! ```text
//! client: softrdma-perf 1 <test> sizes=<n,n,…> iters=<n> qpn=<hex> psn=<hex> gid=<32 hex> addr=<hex> rkey=<hex> len=<n> mtu=<n>
//! server: softrdma-perf 1 ok qpn=<hex> psn=<hex> gid=<32 hex> addr=<hex> rkey=<hex> len=<n>
//!         (or: softrdma-perf 1 error <message>)
//! …the test runs…
//! client: done
//! server: bye
//! ```
//!
//! Each side registers one buffer of 2×M bytes (M: the largest size, at least 64): the
//! first half receives (the peer WRITEs, SENDs and atomics land there), the second half is
//! what this side sends from. The server "just serves": for WRITE, READ and atomics it
//! posts nothing and waits for "done"; for SEND bandwidth it keeps receives posted; for
//! SEND latency it echoes every message; for WRITE latency it answers each write with one
//! of its own once it sees the last byte change.
//!
//! With `--cm` there is no side channel: the request and the answer ride in the rdma_cm's
//! private data (see "rdma_cm sessions" below) and the client's disconnect says "done".

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use serde::Serialize;
use softrdma::cm::{self, AcceptOptions, ConnectOptions, Connection, Listener};
use softrdma::{
    wr, Access, CompletionQueue, Device, MemoryRegion, PathOptions, ProtectionDomain, QpCap,
    QpInit, QpType, QueuePair, RemoteMemory, RemoteQp, SendFlags, SendOp, SendWr, WcOpcode,
    WcStatus, WorkCompletion,
};

use crate::session::{self, Poller};
use crate::{cmconn, output, tcp};
use crate::{stats, CmdResult, PerfArgs, PerfTest};
use softrdma::pingpong::{gid_from_hex, gid_to_hex};

const MAGIC: &str = "softrdma-perf 1";
const MAX_SIZE: u32 = 8 << 20;
const SQ_DEPTH: u32 = 512;
const RQ_DEPTH: u32 = 512;

/// What a session runs: a benchmark, or the demo's round trips.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Test {
    Perf(PerfTest),
    Demo,
}

impl Test {
    pub fn name(self) -> &'static str {
        match self {
            Test::Demo => "demo",
            Test::Perf(t) => match t {
                PerfTest::WriteBw => "write-bw",
                PerfTest::ReadBw => "read-bw",
                PerfTest::SendBw => "send-bw",
                PerfTest::AtomicBw => "atomic-bw",
                PerfTest::WriteLat => "write-lat",
                PerfTest::ReadLat => "read-lat",
                PerfTest::SendLat => "send-lat",
                PerfTest::AtomicLat => "atomic-lat",
            },
        }
    }
    fn parse(s: &str) -> Option<Test> {
        use PerfTest::*;
        Some(match s {
            "demo" => Test::Demo,
            "write-bw" => Test::Perf(WriteBw),
            "read-bw" => Test::Perf(ReadBw),
            "send-bw" => Test::Perf(SendBw),
            "atomic-bw" => Test::Perf(AtomicBw),
            "write-lat" => Test::Perf(WriteLat),
            "read-lat" => Test::Perf(ReadLat),
            "send-lat" => Test::Perf(SendLat),
            "atomic-lat" => Test::Perf(AtomicLat),
            _ => return None,
        })
    }
    /// The receive side consumes receive WRs.
    fn uses_recv(self) -> bool {
        matches!(
            self,
            Test::Demo | Test::Perf(PerfTest::SendBw) | Test::Perf(PerfTest::SendLat)
        )
    }
    fn is_lat(self) -> bool {
        matches!(
            self,
            Test::Perf(PerfTest::WriteLat)
                | Test::Perf(PerfTest::ReadLat)
                | Test::Perf(PerfTest::SendLat)
                | Test::Perf(PerfTest::AtomicLat)
        )
    }
    fn is_atomic(self) -> bool {
        matches!(
            self,
            Test::Perf(PerfTest::AtomicBw) | Test::Perf(PerfTest::AtomicLat)
        )
    }
    fn title(self) -> &'static str {
        match self {
            Test::Demo => "Demo",
            Test::Perf(t) => match t {
                PerfTest::WriteBw => "RDMA_Write BW Test",
                PerfTest::ReadBw => "RDMA_Read BW Test",
                PerfTest::SendBw => "Send BW Test",
                PerfTest::AtomicBw => "Atomic FETCH_AND_ADD BW Test",
                PerfTest::WriteLat => "RDMA_Write Latency Test",
                PerfTest::ReadLat => "RDMA_Read Latency Test",
                PerfTest::SendLat => "Send Latency Test",
                PerfTest::AtomicLat => "Atomic FETCH_AND_ADD Latency Test",
            },
        }
    }
}

/// A side's QP: its own (connected after the TCP exchange), or the one of its rdma_cm
/// connection (`--cm`). Either way the session posts on it as on a plain QP.
pub enum SideQp {
    Own(QueuePair),
    Cm(Connection),
}

impl std::ops::Deref for SideQp {
    type Target = QueuePair;
    fn deref(&self) -> &QueuePair {
        match self {
            SideQp::Own(q) => q,
            SideQp::Cm(c) => c.qp(),
        }
    }
}

/// What a side registers before it has a QP: its PD, buffer and CQ.
pub struct Resources {
    pd: ProtectionDomain,
    cq: CompletionQueue,
    mr: MemoryRegion,
    half: usize,
}

impl Resources {
    pub fn new(dev: &Device, max_size: u32) -> CmdResult<Resources> {
        let half = (max_size.max(64) as usize).next_multiple_of(64);
        let pd = dev
            .alloc_pd()
            .map_err(|e| format!("couldn't allocate PD: {e}"))?;
        let mr = pd
            .register(
                2 * half,
                Access::LOCAL_WRITE
                    | Access::REMOTE_WRITE
                    | Access::REMOTE_READ
                    | Access::REMOTE_ATOMIC,
            )
            .map_err(|e| format!("couldn't register {} bytes: {e}", 2 * half))?;
        let cq = dev
            .create_cq(SQ_DEPTH + RQ_DEPTH, None)
            .map_err(|e| format!("couldn't create CQ: {e}"))?;
        Ok(Resources { pd, cq, mr, half })
    }
    fn qp_init(&self) -> QpInit<'_> {
        let mut init = QpInit::new(QpType::Rc, &self.cq);
        init.cap = QpCap {
            max_send_wr: SQ_DEPTH,
            max_recv_wr: RQ_DEPTH,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 64,
        };
        init
    }
    /// The receive area as the peer addresses it.
    fn remote(&self) -> RemoteMemory {
        RemoteMemory {
            addr: self.mr.addr(),
            rkey: self.mr.rkey(),
            len: self.half as u64,
        }
    }
    fn post_recvs(&self, qp: &QueuePair, n: u32) -> CmdResult {
        for _ in 0..n {
            qp.post_recv(wr::recv(0, [self.mr.sge(0..self.half).map_err(range_err)?]))
                .map_err(|e| format!("couldn't post receive: {e}"))?;
        }
        Ok(())
    }
    /// A side around the QP of an rdma_cm connection (its send PSN is the CM's).
    fn into_side(self, conn: Connection) -> CmdResult<Side> {
        let psn = conn
            .qp()
            .query()
            .map_err(|e| format!("couldn't query the QP: {e}"))?
            .sq_psn;
        Ok(Side {
            qp: SideQp::Cm(conn),
            cq: self.cq,
            mr: self.mr,
            half: self.half,
            psn,
            memory_wait: false,
        })
    }
}

/// One side's resources: buffer, CQ, QP.
pub struct Side {
    pub qp: SideQp,
    pub cq: CompletionQueue,
    pub mr: MemoryRegion,
    /// Half the buffer: the receive area is `0..half`, the send area `half..2*half`.
    pub half: usize,
    pub psn: u32,
    /// write-lat: wait for the peer's WRITE by watching memory only (`--memory-wait`).
    pub memory_wait: bool,
}

impl Side {
    pub fn new(dev: &Device, max_size: u32) -> CmdResult<Side> {
        let r = Resources::new(dev, max_size)?;
        let qp =
            r.pd.create_qp(&r.qp_init())
                .map_err(|e| format!("couldn't create QP: {e}"))?;
        // INIT now, so receives can be posted before the peer is known.
        qp.to_init(Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC)
            .map_err(|e| format!("failed to modify QP to INIT: {e}"))?;
        // The first PSN the engine drew for the QP (DESIGN decision 7).
        let psn = qp.endpoint().psn;
        Ok(Side {
            qp: SideQp::Own(qp),
            cq: r.cq,
            mr: r.mr,
            half: r.half,
            psn,
            memory_wait: false,
        })
    }
    fn local(&self) -> Peer {
        Peer {
            // The PSN the side sends from: the engine's draw for its own QP, the CM's
            // for a connected one.
            qp: RemoteQp {
                psn: self.psn,
                ..self.qp.endpoint().remote_qp()
            },
            mem: RemoteMemory {
                addr: self.mr.addr(),
                rkey: self.mr.rkey(),
                len: self.half as u64,
            },
        }
    }
    fn post_recvs(&self, n: u32) -> CmdResult {
        for _ in 0..n {
            self.qp
                .post_recv(wr::recv(0, [self.mr.sge(0..self.half).map_err(range_err)?]))
                .map_err(|e| format!("couldn't post receive: {e}"))?;
        }
        Ok(())
    }
    fn connect(&self, peer: &Peer, mtu: softrdma::Mtu) -> CmdResult {
        let o = PathOptions {
            mtu,
            ..Default::default()
        };
        self.qp
            .to_rtr_with(&peer.qp, &o)
            .and_then(|()| self.qp.to_rts_with(self.psn, &o))
            .map_err(|e| format!("couldn't connect the QP: {e}"))
    }
    fn send_sge(&self, size: usize) -> CmdResult<softrdma::Sge> {
        self.mr.sge(self.half..self.half + size).map_err(range_err)
    }
    fn read_byte(&self, at: usize) -> CmdResult<u8> {
        let mut b = [0u8];
        self.mr
            .read(at, &mut b)
            .map_err(|e| format!("reading the buffer: {e}"))?;
        Ok(b[0])
    }
}

/// What one side tells the other.
#[derive(Debug, Clone, Copy)]
pub struct Peer {
    pub qp: RemoteQp,
    pub mem: RemoteMemory,
}

fn peer_fields(p: &Peer) -> String {
    format!(
        "qpn={:x} psn={:x} gid={} addr={:x} rkey={:x} len={}",
        p.qp.qpn,
        p.qp.psn,
        gid_to_hex(&p.qp.gid),
        p.mem.addr,
        p.mem.rkey,
        p.mem.len
    )
}

fn field<'a>(words: &[&'a str], key: &str) -> CmdResult<&'a str> {
    words
        .iter()
        .find_map(|w| w.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
        .ok_or_else(|| format!("peer's message lacks {key}"))
}

fn hex(words: &[&str], key: &str) -> CmdResult<u64> {
    u64::from_str_radix(field(words, key)?, 16).map_err(|_| format!("peer's {key} is not hex"))
}

fn parse_peer(words: &[&str]) -> CmdResult<Peer> {
    let gid = gid_from_hex(field(words, "gid")?).ok_or("peer's gid is malformed")?;
    Ok(Peer {
        qp: RemoteQp {
            gid,
            qpn: hex(words, "qpn")? as u32,
            psn: hex(words, "psn")? as u32,
        },
        mem: RemoteMemory {
            addr: hex(words, "addr")?,
            rkey: hex(words, "rkey")? as u32,
            len: field(words, "len")?
                .parse()
                .map_err(|_| "peer's len is not a number")?,
        },
    })
}

fn read_line(r: &mut BufReader<TcpStream>, what: &str) -> CmdResult<String> {
    let mut line = String::new();
    let n = r
        .by_ref()
        .take(4096)
        .read_line(&mut line)
        .map_err(|e| format!("couldn't read {what}: {e}"))?;
    if n == 0 {
        return Err(format!("couldn't read {what}: peer closed the connection"));
    }
    Ok(line.trim_end().to_string())
}

fn print_addr(label: &str, p: &Peer) {
    outln!(
        " {label} QPN 0x{:06x} PSN 0x{:06x} RKey 0x{:08x} VAddr 0x{:016x} GID {}",
        p.qp.qpn,
        p.qp.psn,
        p.mem.rkey,
        p.mem.addr,
        std::net::Ipv6Addr::from(p.qp.gid.0)
    );
}

fn now_line() -> &'static str {
    "---------------------------------------------------------------------------------------"
}

// ---------------------------------------------------------------------------------------
// Server

/// What a served session was.
pub struct Served {
    pub test: Test,
    pub peer: SocketAddr,
    pub local: Peer,
    pub remote: Peer,
}

/// Serve one client on `stream` with device `dev`.
pub fn serve_session(
    dev: &Device,
    stream: TcpStream,
    peer_addr: SocketAddr,
    timeout: Duration,
) -> CmdResult<Served> {
    let mut w = stream
        .try_clone()
        .map_err(|e| format!("side channel: {e}"))?;
    let mut r = BufReader::new(stream);
    let line = read_line(&mut r, "the client's request")?;
    let words: Vec<&str> = line.split_whitespace().collect();
    let reject = |w: &mut TcpStream, msg: String| -> CmdResult<Served> {
        let _ = writeln!(w, "{MAGIC} error {msg}");
        Err(msg)
    };
    if words.len() < 3 || format!("{} {}", words[0], words[1]) != MAGIC {
        return reject(&mut w, "not a softrdma perf client".into());
    }
    let Some(test) = Test::parse(words[2]) else {
        return reject(&mut w, format!("unknown test {:?}", words[2]));
    };
    let sizes: Vec<u32> = match field(&words, "sizes").map(|s| {
        s.split(',')
            .map(|x| x.parse::<u32>())
            .collect::<Result<Vec<_>, _>>()
    }) {
        Ok(Ok(v)) if !v.is_empty() && v.iter().all(|&s| (1..=MAX_SIZE).contains(&s)) => v,
        _ => return reject(&mut w, "bad sizes".into()),
    };
    let iters: u32 = match field(&words, "iters").map(|s| s.parse()) {
        Ok(Ok(n)) if n > 0 => n,
        _ => return reject(&mut w, "bad iters".into()),
    };
    let mtu = match field(&words, "mtu")
        .ok()
        .and_then(|m| m.parse().ok())
        .map(session::mtu_of)
    {
        Some(Ok(m)) => m,
        _ => return reject(&mut w, "bad mtu".into()),
    };
    let remote = match parse_peer(&words) {
        Ok(p) => p,
        Err(e) => return reject(&mut w, e),
    };
    let max = sizes.iter().copied().max().unwrap_or(64);
    let mut side = match Side::new(dev, max) {
        Ok(s) => s,
        Err(e) => return reject(&mut w, e),
    };
    side.memory_wait = match field(&words, "wait") {
        Err(_) | Ok("poll") => false,
        Ok("memory") => true,
        Ok(other) => return reject(&mut w, format!("unknown wait mode {other:?}")),
    };
    if test.uses_recv() {
        if let Err(e) = side.post_recvs(RQ_DEPTH) {
            return reject(&mut w, e);
        }
    }
    if let Err(e) = side.connect(&remote, mtu) {
        return reject(&mut w, e);
    }
    let local = side.local();
    writeln!(w, "{MAGIC} ok {}", peer_fields(&local))
        .map_err(|e| format!("couldn't answer the client: {e}"))?;

    serve_test(
        &side,
        &mut Ctl::Tcp(&mut r),
        test,
        &remote,
        &sizes,
        iters,
        timeout,
    )?;
    let _ = writeln!(w, "bye");
    Ok(Served {
        test,
        peer: peer_addr,
        local,
        remote,
    })
}

/// What the server does for each test once connected, until the client is done.
fn serve_test(
    side: &Side,
    ctl: &mut Ctl<'_>,
    test: Test,
    remote: &Peer,
    sizes: &[u32],
    iters: u32,
    timeout: Duration,
) -> CmdResult {
    match test {
        Test::Perf(PerfTest::SendBw) => serve_recv(side, ctl, false),
        Test::Perf(PerfTest::SendLat) | Test::Demo => serve_recv(side, ctl, true),
        Test::Perf(PerfTest::WriteLat) => {
            serve_write_lat(side, remote, sizes, iters, timeout)?;
            wait_done(side, ctl)
        }
        _ => wait_done(side, ctl),
    }
}

/// How the server learns that the client is done: "done" on the side channel, or the
/// client disconnecting its rdma_cm connection.
enum Ctl<'a> {
    Tcp(&'a mut BufReader<TcpStream>),
    Cm(CmCtl<'a>),
}

/// The rdma_cm end of a session. A killed client sends no DREQ, so while waiting the
/// server probes it now and then with an empty RDMA WRITE, whose failure (the client's
/// QP is gone: no ACK) ends the wait, as a closed TCP connection does.
struct CmCtl<'a> {
    conn: &'a Connection,
    client: RemoteMemory,
    last_probe: Instant,
}

/// How often a waiting `--cm` server probes its client.
const PROBE_EVERY: Duration = Duration::from_secs(5);
/// The probe's work request id.
const PROBE_WRID: u64 = u64::MAX;

impl CmCtl<'_> {
    /// Whether the client disconnected; probes it when due.
    fn done(&mut self) -> CmdResult<bool> {
        match self.conn.wait_disconnected(Some(Duration::ZERO)) {
            Ok(()) => return Ok(true),
            Err(e) if e.is_timeout() => {}
            Err(e) => return Err(format!("disconnecting: {e}")),
        }
        if self.last_probe.elapsed() >= PROBE_EVERY {
            self.last_probe = Instant::now();
            wr::write(PROBE_WRID, Vec::new(), &self.client, 0)
                .and_then(|w| self.conn.qp().post_send(w))
                .map_err(|e| format!("couldn't probe the client: {e}"))?;
        }
        Ok(false)
    }
}

fn wait_done(side: &Side, ctl: &mut Ctl<'_>) -> CmdResult {
    match ctl {
        Ctl::Tcp(r) => {
            // The run may be long: no timeout; a vanished client closes the connection.
            let _ = r.get_ref().set_read_timeout(None);
            let l = read_line(r, "the client's \"done\"")?;
            if l != "done" {
                return Err(format!("unexpected message from the client: {l:?}"));
            }
            Ok(())
        }
        Ctl::Cm(c) => {
            // The run may be long: no limit while the client answers the probes.
            let mut wcs = [WorkCompletion::default(); 16];
            loop {
                if c.done()? {
                    return Ok(());
                }
                // Drain what the server's sends left (write-lat) and the probes.
                let n = side
                    .cq
                    .poll(&mut wcs)
                    .map_err(|e| format!("poll CQ failed: {e}"))?;
                if let Some(wc) = wcs[..n].iter().find(|w| w.status != WcStatus::Success) {
                    return Err(gone(wc));
                }
                if n == 0 {
                    // Bounded: the probe ends the wait within its retries.
                    let _ = c.conn.wait_disconnected(Some(Duration::from_millis(50)));
                }
            }
        }
    }
}

/// The error line for a failed completion on a waiting server: a failed probe means the
/// client is gone.
fn gone(wc: &WorkCompletion) -> String {
    if wc.wr_id == PROBE_WRID {
        format!(
            "the client is gone: its QP stopped answering ({})",
            wc.status.as_str()
        )
    } else {
        session::wc_error(wc)
    }
}

/// Whether the client is done, without blocking.
fn done_arrived(ctl: &mut Ctl<'_>) -> CmdResult<bool> {
    let r = match ctl {
        Ctl::Tcp(r) => r,
        Ctl::Cm(c) => return c.done(),
    };
    let s = r.get_ref();
    s.set_nonblocking(true)
        .map_err(|e| format!("side channel: {e}"))?;
    let mut line = String::new();
    let res = r.read_line(&mut line);
    let _ = r.get_ref().set_nonblocking(false);
    match res {
        Ok(0) => Err("the client closed the connection before \"done\"".into()),
        Ok(_) if line.trim_end() == "done" => Ok(true),
        Ok(_) => Err(format!("unexpected message from the client: {line:?}")),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(false),
        Err(e) => Err(format!("side channel: {e}")),
    }
}

/// SEND bandwidth (count and re-post) or SEND latency / demo (echo every message back).
/// Ends at the client's "done" or disconnect (or with an error when the client vanishes).
fn serve_recv(side: &Side, ctl: &mut Ctl<'_>, echo: bool) -> CmdResult {
    let mut wcs = [WorkCompletion::default(); 64];
    loop {
        // Not after every completion: the check costs system calls, and a SEND arriving
        // meanwhile would wait for them.
        let n = session::poll_within(&side.cq, &mut wcs, DONE_CHECK)?;
        if n == 0 && done_arrived(ctl)? {
            return Ok(());
        }
        for wc in &wcs[..n] {
            if wc.status != WcStatus::Success {
                return Err(gone(wc));
            }
            if matches!(wc.opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm) {
                if echo {
                    let len = wc.byte_len as usize;
                    side.qp
                        .post_send(wr::send(1, [side.mr.sge(0..len).map_err(range_err)?]))
                        .map_err(|e| format!("couldn't post send: {e}"))?;
                }
                side.post_recvs(1)?;
            }
        }
    }
}

/// How long a serving loop waits for completions before it looks for the client's "done".
const DONE_CHECK: Duration = Duration::from_millis(20);

/// Wait until `side`'s byte at `at` equals `v`, draining send completions meanwhile
/// (each one taken off `outstanding`).
fn wait_byte(side: &Side, at: usize, v: u8, poller: &Poller, outstanding: &mut u32) -> CmdResult {
    if side.memory_wait {
        // As perftest's ib_write_lat: collect the send completions first (polling the CQ),
        // then watch nothing but the byte, so the device's progress thread alone delivers
        // the peer's WRITE.
        while *outstanding > 0 {
            wait_wc(side, poller, false, outstanding)?;
        }
        let deadline = Instant::now() + poller.timeout();
        let mut spins = 0u32;
        loop {
            if side.read_byte(at)? == v {
                return Ok(());
            }
            spins = spins.wrapping_add(1);
            if spins % 4096 == 0 && Instant::now() > deadline {
                return Err(format!(
                    "the peer's write did not arrive within {} s: the peer is gone or unreachable",
                    poller.timeout().as_secs()
                ));
            }
            std::hint::spin_loop();
        }
    }
    let mut wcs = [WorkCompletion::default(); 16];
    loop {
        // The peer's WRITE completes nothing here: wait for the byte or a send completion.
        let n = poller.poll_or(&side.cq, &mut wcs, || Ok(side.read_byte(at)? == v))?;
        if n == 0 {
            return Ok(());
        }
        for wc in &wcs[..n] {
            if wc.status != WcStatus::Success {
                return Err(session::wc_error(wc));
            }
            *outstanding = outstanding.saturating_sub(1);
        }
    }
}

fn lat_value(seq: u64) -> u8 {
    (seq % 255) as u8 + 1
}

fn serve_write_lat(
    side: &Side,
    remote: &Peer,
    sizes: &[u32],
    iters: u32,
    timeout: Duration,
) -> CmdResult {
    let poller = Poller::new(timeout);
    let mut seq = 0u64;
    let mut outstanding = 0u32;
    for &size in sizes {
        let size = size as usize;
        for _ in 0..iters {
            let v = lat_value(seq);
            seq += 1;
            while outstanding >= SQ_DEPTH / 2 {
                wait_wc(side, &poller, false, &mut outstanding)?;
            }
            wait_byte(side, size - 1, v, &poller, &mut outstanding)?;
            side.mr
                .write(side.half + size - 1, &[v])
                .map_err(|e| format!("writing the buffer: {e}"))?;
            wr::write(1, [side.send_sge(size)?], &remote.mem, 0)
                .and_then(|w| side.qp.post_send(w))
                .map_err(|e| format!("couldn't post write: {e}"))?;
            outstanding += 1;
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Client

/// One row of a bandwidth table; serialized with the names of its `--json` form.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct BwRow {
    pub bytes: u32,
    #[serde(rename = "iterations")]
    pub iters: u32,
    #[serde(rename = "bw_peak_mb_per_sec")]
    pub peak_mb: f64,
    #[serde(rename = "bw_avg_mb_per_sec")]
    pub avg_mb: f64,
    #[serde(rename = "msg_rate_mpps")]
    pub mpps: f64,
}

/// One row of a latency table (µs); serialized with the names of its `--json` form.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct LatRow {
    pub bytes: u32,
    #[serde(rename = "iterations")]
    pub iters: u32,
    #[serde(rename = "t_min_usec")]
    pub min: f64,
    #[serde(rename = "t_max_usec")]
    pub max: f64,
    #[serde(rename = "t_typical_usec")]
    pub typical: f64,
    #[serde(rename = "t_avg_usec")]
    pub avg: f64,
    #[serde(rename = "t_stdev_usec")]
    pub stdev: f64,
    #[serde(rename = "p99_usec")]
    pub p99: f64,
    #[serde(rename = "p999_usec")]
    pub p999: f64,
}

/// Results of a client run; serialized as the bare list of rows.
#[derive(Serialize)]
#[serde(untagged)]
pub enum Rows {
    Bw(Vec<BwRow>),
    Lat(Vec<LatRow>),
}

struct Progress {
    on: bool,
    last: Instant,
}

impl Progress {
    fn new() -> Progress {
        Progress {
            on: output::stderr_is_tty(),
            last: Instant::now(),
        }
    }
    fn show(&mut self, size: u32, done: u64, iters: u32) {
        if self.on && self.last.elapsed() > Duration::from_millis(200) {
            self.last = Instant::now();
            errout!("\r  {size} bytes: {done}/{iters} ");
            let _ = std::io::stderr().flush();
        }
    }
    fn clear(&self) {
        if self.on {
            errout!("\r\x1b[K");
        }
    }
}

/// A buffer range refused by [`softrdma::MemoryRegion::sge`].
fn range_err(e: softrdma::Error) -> String {
    format!("buffer range: {e}")
}

fn bw_wr(
    test: PerfTest,
    side: &Side,
    remote: &Peer,
    size: usize,
    id: u64,
    sig: bool,
) -> CmdResult<SendWr> {
    let flags = if sig {
        SendFlags::SIGNALED
    } else {
        SendFlags::empty()
    };
    let (op, sg) = match test {
        PerfTest::WriteBw => (
            SendOp::Write {
                remote_addr: remote.mem.addr,
                rkey: remote.mem.rkey,
            },
            side.send_sge(size)?,
        ),
        PerfTest::ReadBw => (
            SendOp::Read {
                remote_addr: remote.mem.addr,
                rkey: remote.mem.rkey,
            },
            side.mr.sge(0..size).map_err(range_err)?,
        ),
        PerfTest::AtomicBw => (
            SendOp::FetchAdd {
                remote_addr: remote.mem.addr,
                rkey: remote.mem.rkey,
                add: 1,
            },
            side.send_sge(8)?,
        ),
        _ => (SendOp::Send, side.send_sge(size)?),
    };
    Ok(SendWr {
        wr_id: id,
        op,
        flags,
        sg_list: vec![sg],
        inline_data: None,
        ud: None,
    })
}

fn run_bw(
    test: PerfTest,
    side: &Side,
    remote: &Peer,
    size: u32,
    iters: u32,
    tx_depth: u32,
    timeout: Duration,
) -> CmdResult<BwRow> {
    let tx_depth = tx_depth.clamp(1, SQ_DEPTH) as u64;
    let cq_mod = (tx_depth / 2).clamp(1, 64);
    let n = iters as u64;
    let mut posted = 0u64;
    let mut done = 0u64;
    let mut wcs = [WorkCompletion::default(); 64];
    let poller = Poller::new(timeout);
    let mut progress = Progress::new();
    // (time, completed) samples for the peak.
    let mut samples: Vec<(Instant, u64)> = Vec::new();
    let start = Instant::now();
    samples.push((start, 0));
    while done < n {
        while posted < n && posted - done < tx_depth {
            let sig = (posted + 1) % cq_mod == 0 || posted + 1 == n;
            side.qp
                .post_send(bw_wr(test, side, remote, size as usize, posted, sig)?)
                .map_err(|e| format!("couldn't post send: {e}"))?;
            posted += 1;
        }
        let k = poller.poll(&side.cq, &mut wcs)?;
        for wc in &wcs[..k] {
            if wc.status != WcStatus::Success {
                return Err(session::wc_error(wc));
            }
            done = done.max(wc.wr_id + 1);
        }
        samples.push((Instant::now(), done));
        progress.show(size, done, iters);
    }
    let secs = start.elapsed().as_secs_f64().max(1e-9);
    progress.clear();
    let bytes = size as f64 * n as f64;
    let mb = (1u64 << 20) as f64;
    let avg = bytes / secs / mb;
    // Peak: the best stretch of the run, each at least 1/8 of it and two windows long
    // (completions arrive in bursts of a window; shorter stretches would measure those).
    let chunk = (n / 8).max(2 * tx_depth);
    let mut peak: f64 = avg;
    let mut from = samples[0];
    for s in &samples[1..] {
        if s.1 - from.1 >= chunk {
            let dt = s.0.duration_since(from.0).as_secs_f64();
            if dt > 0.0 {
                peak = peak.max((s.1 - from.1) as f64 * size as f64 / dt / mb);
            }
            from = *s;
        }
    }
    Ok(BwRow {
        bytes: size,
        iters,
        peak_mb: peak,
        avg_mb: avg,
        mpps: n as f64 / secs / 1e6,
    })
}

fn lat_row(size: u32, mut t: Vec<f64>) -> LatRow {
    t.sort_by(|a, b| a.total_cmp(b));
    let n = t.len().max(1);
    let avg = t.iter().sum::<f64>() / n as f64;
    let var = t.iter().map(|x| (x - avg) * (x - avg)).sum::<f64>() / n as f64;
    let pct = |p: f64| t[((p * n as f64).ceil() as usize).clamp(1, n) - 1];
    LatRow {
        bytes: size,
        iters: t.len() as u32,
        min: t[0],
        max: t[n - 1],
        typical: t[n / 2],
        avg,
        stdev: var.sqrt(),
        p99: pct(0.99),
        p999: pct(0.999),
    }
}

/// Wait for a receive completion (`want_recv`) or a send-side one, checking status; every
/// send-side completion seen is taken off `outstanding`.
fn wait_wc(
    side: &Side,
    poller: &Poller,
    want_recv: bool,
    outstanding: &mut u32,
) -> CmdResult<WorkCompletion> {
    let mut wcs = [WorkCompletion::default(); 1];
    loop {
        poller.poll(&side.cq, &mut wcs)?;
        let wc = wcs[0];
        if wc.status != WcStatus::Success {
            return Err(session::wc_error(&wc));
        }
        let is_recv = matches!(wc.opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm);
        if !is_recv {
            *outstanding = outstanding.saturating_sub(1);
        }
        if is_recv == want_recv {
            return Ok(wc);
        }
        if is_recv {
            // An unexpected receive: keep the queue full anyway.
            side.post_recvs(1)?;
        }
    }
}

fn run_lat(
    test: PerfTest,
    side: &Side,
    remote: &Peer,
    size: u32,
    iters: u32,
    seq: &mut u64,
    timeout: Duration,
) -> CmdResult<LatRow> {
    let poller = Poller::new(timeout);
    let mut progress = Progress::new();
    let mut t = Vec::with_capacity(iters as usize);
    let sz = size as usize;
    let mut outstanding = 0u32;
    for i in 0..iters {
        let t0 = Instant::now();
        match test {
            PerfTest::WriteLat => {
                let v = lat_value(*seq);
                *seq += 1;
                side.mr
                    .write(side.half + sz - 1, &[v])
                    .map_err(|e| format!("writing the buffer: {e}"))?;
                wr::write(1, [side.send_sge(sz)?], &remote.mem, 0)
                    .and_then(|w| side.qp.post_send(w))
                    .map_err(|e| format!("couldn't post write: {e}"))?;
                outstanding += 1;
                wait_byte(side, sz - 1, v, &poller, &mut outstanding)?;
                t.push(t0.elapsed().as_secs_f64() * 1e6 / 2.0);
            }
            PerfTest::SendLat => {
                side.qp
                    .post_send(wr::send(1, [side.send_sge(sz)?]))
                    .map_err(|e| format!("couldn't post send: {e}"))?;
                outstanding += 1;
                wait_wc(side, &poller, true, &mut outstanding)?;
                t.push(t0.elapsed().as_secs_f64() * 1e6 / 2.0);
                side.post_recvs(1)?;
            }
            PerfTest::ReadLat => {
                wr::read(1, [side.mr.sge(0..sz).map_err(range_err)?], &remote.mem, 0)
                    .and_then(|w| side.qp.post_send(w))
                    .map_err(|e| format!("couldn't post read: {e}"))?;
                outstanding += 1;
                while outstanding > 0 {
                    wait_wc(side, &poller, false, &mut outstanding)?;
                }
                t.push(t0.elapsed().as_secs_f64() * 1e6);
            }
            _ => {
                wr::fetch_add(1, side.send_sge(8)?, &remote.mem, 0, 1)
                    .and_then(|w| side.qp.post_send(w))
                    .map_err(|e| format!("couldn't post atomic: {e}"))?;
                outstanding += 1;
                while outstanding > 0 {
                    wait_wc(side, &poller, false, &mut outstanding)?;
                }
                t.push(t0.elapsed().as_secs_f64() * 1e6);
            }
        }
        // Send completions of the ping-pong tests: collect them before the queue fills.
        while outstanding >= SQ_DEPTH / 2 {
            wait_wc(side, &poller, false, &mut outstanding)?;
        }
        progress.show(size, i as u64 + 1, iters);
    }
    progress.clear();
    Ok(lat_row(size, t))
}

/// The sizes a run covers.
pub fn sizes_of(test: PerfTest, size: Option<u32>, all: bool) -> CmdResult<Vec<u32>> {
    let t = Test::Perf(test);
    if t.is_atomic() {
        if size.is_some_and(|s| s != 8) {
            return Err("atomics are 8 bytes: -s must be 8".into());
        }
        return Ok(vec![8]);
    }
    if all {
        return Ok((1..=23).map(|p| 1u32 << p).collect());
    }
    let s = size.unwrap_or(if t.is_lat() { 2 } else { 65536 });
    if !(1..=MAX_SIZE).contains(&s) {
        return Err(format!("size {s} out of range (1..={MAX_SIZE})"));
    }
    Ok(vec![s])
}

/// Client: connect, run every size, say done.
pub struct ClientRun {
    pub local: Peer,
    pub remote: Peer,
    pub rows: Rows,
}

/// The side channel of a client session, for its closing "done".
pub struct Channel {
    pub w: TcpStream,
    pub r: BufReader<TcpStream>,
}

impl Channel {
    /// Say "done" and wait for "bye" (best effort: the results are already in).
    pub fn finish(mut self) {
        if writeln!(self.w, "done").is_ok() {
            let _ = read_line(&mut self.r, "bye");
        }
    }
}

#[allow(clippy::too_many_arguments)]
pub fn client_session(
    dev: &Device,
    mut stream: TcpStream,
    test: Test,
    sizes: &[u32],
    iters: u32,
    tx_depth: u32,
    mtu: u32,
    timeout: Duration,
    announce: bool,
    memory_wait: bool,
) -> CmdResult<(ClientRun, Side, Channel)> {
    let mtu_v = session::mtu_of(mtu)?;
    let max = sizes.iter().copied().max().unwrap_or(64);
    let mut side = Side::new(dev, max)?;
    side.memory_wait = memory_wait;
    if test.uses_recv() {
        side.post_recvs(RQ_DEPTH)?;
    }
    let local = side.local();
    let list: Vec<String> = sizes.iter().map(|s| s.to_string()).collect();
    writeln!(
        stream,
        "{MAGIC} {} sizes={} iters={iters} {} mtu={mtu}{}",
        test.name(),
        list.join(","),
        peer_fields(&local),
        if memory_wait { " wait=memory" } else { "" }
    )
    .map_err(|e| format!("couldn't send the request: {e}"))?;
    let mut r = BufReader::new(
        stream
            .try_clone()
            .map_err(|e| format!("side channel: {e}"))?,
    );
    let line = read_line(&mut r, "the server's answer")?;
    let words: Vec<&str> = line.split_whitespace().collect();
    if words.len() < 3 || format!("{} {}", words[0], words[1]) != MAGIC {
        return Err("the peer is not a softrdma perf server".into());
    }
    if words[2] == "error" {
        return Err(format!("the server refused: {}", words[3..].join(" ")));
    }
    let remote = parse_peer(&words)?;
    side.connect(&remote, mtu_v)?;
    if announce {
        print_addr("local address: ", &local);
        print_addr("remote address:", &remote);
    }
    let rows = run_rows(test, &side, &remote, sizes, iters, tx_depth, timeout)?;
    Ok((
        ClientRun {
            local,
            remote,
            rows,
        },
        side,
        Channel { w: stream, r },
    ))
}

/// The client's part: every size of `test` against `remote`.
fn run_rows(
    test: Test,
    side: &Side,
    remote: &Peer,
    sizes: &[u32],
    iters: u32,
    tx_depth: u32,
    timeout: Duration,
) -> CmdResult<Rows> {
    Ok(match test {
        Test::Demo => Rows::Bw(Vec::new()),
        Test::Perf(t) if test.is_lat() => {
            let mut seq = 0;
            let mut v = Vec::new();
            for &s in sizes {
                v.push(run_lat(t, side, remote, s, iters, &mut seq, timeout)?);
            }
            Rows::Lat(v)
        }
        Test::Perf(t) => {
            let mut v = Vec::new();
            for &s in sizes {
                v.push(run_bw(t, side, remote, s, iters, tx_depth, timeout)?);
            }
            Rows::Bw(v)
        }
    })
}

// ---------------------------------------------------------------------------------------
// rdma_cm sessions (--cm)
//
// The request and the answer ride in the CM's private data instead of the text lines of
// the side channel, big-endian:
//
//   REQ (36 of its 56 bytes): "SRP1", test (1), flags (1: bit 0 wait=memory, bit 1 -a),
//                             0 (2), size (4; with -a unused), iters (4),
//                             addr (8), rkey (4), len (8)
//   REP (24 of 196):          "SRP1", addr (8), rkey (4), len (8)
//
// QP numbers and PSNs are the CM's own. A request the server refuses is rejected with
// the reason as text in the REJ; the end of the run is the client's disconnect.

const CM_MAGIC: &[u8; 4] = b"SRP1";
const CM_REQ_LEN: usize = 36;
const CM_REP_LEN: usize = 24;
const CM_WAIT_MEMORY: u8 = 1;
const CM_ALL_SIZES: u8 = 2;
/// The tests in the order of their codes in a request.
const CM_TESTS: [PerfTest; 8] = [
    PerfTest::WriteBw,
    PerfTest::ReadBw,
    PerfTest::SendBw,
    PerfTest::AtomicBw,
    PerfTest::WriteLat,
    PerfTest::ReadLat,
    PerfTest::SendLat,
    PerfTest::AtomicLat,
];

/// What a `--cm` client asks for.
#[derive(Debug, Clone, PartialEq)]
struct CmRequest {
    test: PerfTest,
    /// None: every size (-a).
    size: Option<u32>,
    iters: u32,
    memory_wait: bool,
    mem: RemoteMemory,
}

fn put_mem(v: &mut Vec<u8>, m: &RemoteMemory) {
    v.extend_from_slice(&m.addr.to_be_bytes());
    v.extend_from_slice(&m.rkey.to_be_bytes());
    v.extend_from_slice(&m.len.to_be_bytes());
}

fn get_mem(b: &[u8]) -> RemoteMemory {
    let u64_at = |i: usize| u64::from_be_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]));
    RemoteMemory {
        addr: u64_at(0),
        rkey: u32::from_be_bytes(b[8..12].try_into().unwrap_or([0; 4])),
        len: u64_at(12),
    }
}

impl CmRequest {
    fn encode(&self) -> Vec<u8> {
        let code = CM_TESTS.iter().position(|&t| t == self.test).unwrap_or(0);
        let mut flags = 0;
        if self.memory_wait {
            flags |= CM_WAIT_MEMORY;
        }
        if self.size.is_none() {
            flags |= CM_ALL_SIZES;
        }
        let mut v = CM_MAGIC.to_vec();
        v.extend_from_slice(&[code as u8, flags, 0, 0]);
        v.extend_from_slice(&self.size.unwrap_or(0).to_be_bytes());
        v.extend_from_slice(&self.iters.to_be_bytes());
        put_mem(&mut v, &self.mem);
        v
    }

    fn decode(b: &[u8]) -> CmdResult<CmRequest> {
        if b.len() < CM_REQ_LEN || &b[..4] != CM_MAGIC {
            return Err("not a softrdma perf client".into());
        }
        let test = *CM_TESTS
            .get(usize::from(b[4]))
            .ok_or_else(|| format!("unknown test {}", b[4]))?;
        let u32_at = |i: usize| u32::from_be_bytes(b[i..i + 4].try_into().unwrap_or([0; 4]));
        let (flags, size, iters) = (b[5], u32_at(8), u32_at(12));
        let size = (flags & CM_ALL_SIZES == 0).then_some(size);
        if size.is_some_and(|s| !(1..=MAX_SIZE).contains(&s)) {
            return Err("bad sizes".into());
        }
        if iters == 0 {
            return Err("bad iters".into());
        }
        Ok(CmRequest {
            test,
            size,
            iters,
            memory_wait: flags & CM_WAIT_MEMORY != 0,
            mem: get_mem(&b[16..CM_REQ_LEN]),
        })
    }

    fn sizes(&self) -> CmdResult<Vec<u32>> {
        sizes_of(self.test, self.size, self.size.is_none())
    }
}

fn encode_answer(m: &RemoteMemory) -> Vec<u8> {
    let mut v = CM_MAGIC.to_vec();
    put_mem(&mut v, m);
    v
}

fn decode_answer(b: &[u8]) -> CmdResult<RemoteMemory> {
    if b.len() < CM_REP_LEN || &b[..4] != CM_MAGIC {
        return Err("the peer is not a softrdma perf server".into());
    }
    Ok(get_mem(&b[4..CM_REP_LEN]))
}

/// The peer of a connected QP as the CM set it up, with its memory.
fn cm_peer(qp: &QueuePair, mem: RemoteMemory) -> CmdResult<Peer> {
    let a = qp
        .query()
        .map_err(|e| format!("couldn't query the QP: {e}"))?;
    Ok(Peer {
        qp: RemoteQp {
            gid: a.ah_attr.grh.dgid,
            qpn: a.dest_qp_num,
            psn: a.rq_psn,
        },
        mem,
    })
}

/// A `prepare` step's error as the CM helpers take it.
fn cm_err(msg: String) -> softrdma::Error {
    softrdma::Error::new(12, msg)
}

/// Serve one `--cm` client from listener `l` of device `dev`.
pub fn serve_cm(dev: &Device, l: &Listener, timeout: Duration) -> CmdResult<Served> {
    let req = l
        .next_request(None)
        .map_err(|e| format!("waiting for a client: {e}"))?;
    let peer = req
        .peer_addr()
        .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)));
    let refuse = |req: cm::ConnectRequest, msg: String| -> CmdResult<Served> {
        let mut why = format!("{MAGIC} error {msg}").into_bytes();
        why.truncate(cm::MAX_REJECT_PRIVATE);
        let _ = req.reject(&why);
        Err(msg)
    };
    let q = match CmRequest::decode(req.private_data()) {
        Ok(q) => q,
        Err(e) => return refuse(req, e),
    };
    let sizes = match q.sizes() {
        Ok(s) => s,
        Err(e) => return refuse(req, e),
    };
    let test = Test::Perf(q.test);
    let max = sizes.iter().copied().max().unwrap_or(64);
    let r = match Resources::new(dev, max) {
        Ok(r) => r,
        Err(e) => return refuse(req, e),
    };
    let opts = AcceptOptions {
        timeout: Some(timeout),
        ..AcceptOptions::new(&encode_answer(&r.remote()))
    };
    let prepare = |qp: &QueuePair| {
        if test.uses_recv() {
            r.post_recvs(qp, RQ_DEPTH).map_err(cm_err)?;
        }
        Ok(())
    };
    let conn = req
        .accept_with(&r.pd, &r.qp_init(), &opts, prepare)
        .map_err(|e| format!("couldn't accept the client's connection: {e}"))?;
    let remote = cm_peer(conn.qp(), q.mem)?;
    let mut side = r.into_side(conn)?;
    side.memory_wait = q.memory_wait;
    let local = side.local();
    let SideQp::Cm(conn) = &side.qp else {
        return Err("the served QP lost its connection".into());
    };
    let mut ctl = Ctl::Cm(CmCtl {
        conn,
        client: q.mem,
        last_probe: Instant::now(),
    });
    serve_test(&side, &mut ctl, test, &remote, &sizes, q.iters, timeout)?;
    Ok(Served {
        test,
        peer,
        local,
        remote,
    })
}

/// A `--cm` client session: connect with the request in the private data, run, and
/// disconnect.
#[allow(clippy::too_many_arguments)]
fn client_cm(
    a: &PerfArgs,
    dev: &Device,
    host: &str,
    port: u16,
    test: PerfTest,
    sizes: &[u32],
    iters: u32,
    timeout: Duration,
) -> CmdResult<ClientRun> {
    let max = sizes.iter().copied().max().unwrap_or(64);
    let r = Resources::new(dev, max)?;
    let q = CmRequest {
        test,
        size: (!a.all).then(|| sizes.first().copied().unwrap_or(64)),
        iters,
        memory_wait: a.memory_wait,
        mem: r.remote(),
    };
    let opts = ConnectOptions {
        timeout: Some(timeout),
        ..ConnectOptions::new(&q.encode())
    };
    let prepare = |qp: &QueuePair| {
        if Test::Perf(test).uses_recv() {
            r.post_recvs(qp, RQ_DEPTH).map_err(cm_err)?;
        }
        Ok(())
    };
    let conn = cmconn::connect(&r.pd, &r.qp_init(), host, port, &opts, prepare)
        .map_err(|e| strip_magic(&e))?;
    let remote = cm_peer(conn.qp(), decode_answer(conn.private_data())?)?;
    let mut side = r.into_side(conn)?;
    side.memory_wait = a.memory_wait;
    let local = side.local();
    if !a.json {
        print_addr("local address: ", &local);
        print_addr("remote address:", &remote);
    }
    let rows = run_rows(
        Test::Perf(test),
        &side,
        &remote,
        sizes,
        iters,
        a.tx_depth,
        timeout,
    )?;
    // "done": the server ends when it hears the disconnect; best effort, the results are in.
    if let SideQp::Cm(c) = &side.qp {
        if c.disconnect().is_ok() {
            let _ = c.wait_disconnected(Some(timeout));
        }
    }
    Ok(ClientRun {
        local,
        remote,
        rows,
    })
}

/// A refusal as the TCP path words it: "the server refused: MESSAGE".
fn strip_magic(e: &str) -> String {
    match e.split_once(&format!("{MAGIC} error ")) {
        Some((head, msg)) => format!("{head}{msg}"),
        None => e.to_string(),
    }
}

pub fn print_rows(test: Test, rows: &Rows) {
    outln!("{}", now_line());
    outln!("                    {}", test.title());
    match rows {
        Rows::Bw(v) => {
            outln!(
                " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]"
            );
            for r in v {
                outln!(
                    " {:<10} {:<14} {:<18.2} {:<20.2} {:.6}",
                    r.bytes,
                    r.iters,
                    r.peak_mb,
                    r.avg_mb,
                    r.mpps
                );
            }
        }
        Rows::Lat(v) => {
            outln!(
                " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec]"
            );
            for r in v {
                outln!(
                    " {:<6} {:<14} {:<14.2} {:<12.2} {:<18.2} {:<14.2} {:<15.2} {:<22.2} {:.2}",
                    r.bytes,
                    r.iters,
                    r.min,
                    r.max,
                    r.typical,
                    r.avg,
                    r.stdev,
                    r.p99,
                    r.p999
                );
            }
        }
    }
    outln!("{}", now_line());
}

/// A QP and its buffer as `--json` shows them.
#[derive(Serialize)]
struct PeerJson {
    qpn: u32,
    psn: u32,
    gid: String,
    rkey: u32,
    addr: u64,
}

impl From<&Peer> for PeerJson {
    fn from(p: &Peer) -> PeerJson {
        PeerJson {
            qpn: p.qp.qpn,
            psn: p.qp.psn,
            gid: std::net::Ipv6Addr::from(p.qp.gid.0).to_string(),
            rkey: p.mem.rkey,
            addr: p.mem.addr,
        }
    }
}

/// `softrdma perf --json` on the server.
#[derive(Serialize)]
struct ServerJson {
    role: &'static str,
    test: &'static str,
    client: String,
    local: PeerJson,
    remote: PeerJson,
    #[serde(skip_serializing_if = "Option::is_none")]
    stats: Option<stats::StatsJson>,
}

/// `softrdma perf --json` on the client.
#[derive(Serialize)]
struct ClientJson<'a> {
    role: &'static str,
    test: &'static str,
    local: PeerJson,
    remote: PeerJson,
    results: &'a Rows,
    #[serde(skip_serializing_if = "Option::is_none")]
    stats: Option<stats::StatsJson>,
}

/// `softrdma perf`.
pub fn run(a: &PerfArgs) -> CmdResult {
    let sizes = sizes_of(a.test, a.size, a.all)?;
    let test = Test::Perf(a.test);
    let iters = a.iters.unwrap_or(if test.is_lat() { 1000 } else { 5000 });
    if iters == 0 {
        return Err("iters must be at least 1".into());
    }
    if a.tx_depth == 0 || a.tx_depth > SQ_DEPTH {
        return Err(format!("tx-depth must be 1..={SQ_DEPTH}"));
    }
    session::mtu_of(a.mtu.unwrap_or(cmconn::DEFAULT_MTU))?;
    if a.memory_wait && a.test != PerfTest::WriteLat {
        return Err("--memory-wait applies to write-lat only".into());
    }
    let timeout = Duration::from_secs(a.timeout.max(1));
    if a.cm {
        cmconn::check_mtu(a.mtu)?;
    }

    if a.loopback && a.cm {
        // The server's device and listener first, so the client knows the port.
        let cfg =
            softrdma::DeviceConfig::new("softrdma-lo", softrdma::DeviceAddr::AutoLoopback(4791));
        let sdev = Device::open_with(&cfg)
            .map_err(|e| format!("cannot open the loopback server's device: {e}"))?;
        let l = cmconn::listen(&sdev, 0, QpType::Rc)?;
        let port = l.local_addr().port();
        let server = std::thread::spawn(move || serve_cm(&sdev, &l, timeout).map(|_| ()));
        let mut opts = a.dev.clone();
        opts.device = None;
        let mut cfg = session::device_config(&opts)?;
        cfg.addr = softrdma::DeviceAddr::AutoLoopback(4791);
        let dev = Device::open_with(&cfg).map_err(|e| format!("cannot open device: {e}"))?;
        let res = client_cm(a, &dev, "127.0.0.1", port, a.test, &sizes, iters, timeout);
        let srv = server
            .join()
            .unwrap_or_else(|_| Err("the loopback server failed".into()));
        report(a, &dev, test, &res?)?;
        return srv;
    }

    if a.loopback {
        let l = TcpListener::bind(("127.0.0.1", 0))
            .map_err(|e| format!("couldn't listen on loopback: {e}"))?;
        let port = l.local_addr().map_err(|e| e.to_string())?.port();
        let server = std::thread::spawn(move || -> CmdResult {
            let mut cfg = softrdma::DeviceConfig::new(
                "softrdma-lo",
                softrdma::DeviceAddr::AutoLoopback(4791),
            );
            // The client's device traces both directions; one writer per file.
            cfg.pcap = None;
            let dev = Device::open_with(&cfg)
                .map_err(|e| format!("cannot open the loopback server's device: {e}"))?;
            let (s, peer) = tcp::accept(&l)?;
            serve_session(&dev, s, peer, timeout).map(|_| ())
        });
        let mut opts = a.dev.clone();
        opts.device = None;
        let mut cfg = session::device_config(&opts)?;
        cfg.addr = softrdma::DeviceAddr::AutoLoopback(4791);
        let dev = Device::open_with(&cfg).map_err(|e| format!("cannot open device: {e}"))?;
        let res = client(a, &dev, "127.0.0.1", port, test, &sizes, iters, timeout);
        let srv = server
            .join()
            .unwrap_or_else(|_| Err("the loopback server failed".into()));
        res?;
        return srv;
    }

    let dev = session::open_device(&a.dev)?;
    match &a.peer {
        Some(host) if a.cm => {
            let run = client_cm(a, &dev, host, a.port, a.test, &sizes, iters, timeout)?;
            report(a, &dev, test, &run)
        }
        Some(host) => client(a, &dev, host, a.port, test, &sizes, iters, timeout),
        None => {
            let waiting = || {
                if !a.json {
                    outln!(
                        "************************************\n* Waiting for client to connect... *\n************************************"
                    );
                    output::flush_stdout();
                }
            };
            let sv = if a.cm {
                let l = cmconn::listen(&dev, a.port, QpType::Rc)?;
                waiting();
                serve_cm(&dev, &l, timeout)?
            } else {
                let l = tcp::listen(a.port)?;
                waiting();
                let (s, peer) = tcp::accept(&l)?;
                drop(l);
                serve_session(&dev, s, peer, timeout)?
            };
            if a.json {
                output::print_json(&ServerJson {
                    role: "server",
                    test: sv.test.name(),
                    client: sv.peer.to_string(),
                    local: (&sv.local).into(),
                    remote: (&sv.remote).into(),
                    stats: a.dev.stats.then(|| stats::device_json(&dev)),
                })?;
            } else {
                print_addr("local address: ", &sv.local);
                print_addr("remote address:", &sv.remote);
                outln!("served {} to {}", sv.test.name(), sv.peer.ip());
                if a.dev.stats {
                    stats::print_device(&dev);
                }
            }
            Ok(())
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn client(
    a: &PerfArgs,
    dev: &Device,
    host: &str,
    port: u16,
    test: Test,
    sizes: &[u32],
    iters: u32,
    timeout: Duration,
) -> CmdResult {
    let s = tcp::connect(host, port)?;
    let (run, _side, ch) = client_session(
        dev,
        s,
        test,
        sizes,
        iters,
        a.tx_depth,
        a.mtu.unwrap_or(cmconn::DEFAULT_MTU),
        timeout,
        !a.json,
        a.memory_wait,
    )?;
    ch.finish();
    report(a, dev, test, &run)
}

/// The client's output: the table, or its JSON.
fn report(a: &PerfArgs, dev: &Device, test: Test, run: &ClientRun) -> CmdResult {
    if a.json {
        output::print_json(&ClientJson {
            role: "client",
            test: test.name(),
            local: (&run.local).into(),
            remote: (&run.remote).into(),
            results: &run.rows,
            stats: a.dev.stats.then(|| stats::device_json(dev)),
        })?;
    } else {
        print_rows(test, &run.rows);
        if a.dev.stats {
            stats::print_device(dev);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cm_request_and_answer_fit_and_round_trip() {
        let mem = RemoteMemory {
            addr: 0x7f00_1234_5678,
            rkey: 0xdead_beef,
            len: 1 << 23,
        };
        for (test, size) in [(PerfTest::WriteLat, None), (PerfTest::SendBw, Some(4096))] {
            let q = CmRequest {
                test,
                size,
                iters: 5000,
                memory_wait: size.is_none(),
                mem,
            };
            let b = q.encode();
            assert_eq!(b.len(), CM_REQ_LEN);
            assert!(b.len() <= cm::MAX_CONNECT_PRIVATE);
            // The REQ arrives zero-padded to its 56 bytes.
            let mut padded = b.clone();
            padded.resize(cm::MAX_CONNECT_PRIVATE, 0);
            assert_eq!(CmRequest::decode(&padded).unwrap(), q);
        }
        let a = encode_answer(&mem);
        assert_eq!(a.len(), CM_REP_LEN);
        assert_eq!(decode_answer(&a).unwrap(), mem);
        assert!(CmRequest::decode(b"SRP1").is_err());
        assert!(decode_answer(&[0; 24]).is_err());
        let mut bad = CmRequest {
            test: PerfTest::ReadBw,
            size: Some(MAX_SIZE + 1),
            iters: 1,
            memory_wait: false,
            mem,
        }
        .encode();
        assert!(CmRequest::decode(&bad).is_err(), "size out of range");
        bad[4] = 99;
        assert!(CmRequest::decode(&bad).is_err(), "unknown test");
    }

    #[test]
    fn a_refusal_reads_as_over_tcp() {
        assert_eq!(
            strip_magic("the server refused: softrdma-perf 1 error bad iters"),
            "the server refused: bad iters"
        );
    }
}
