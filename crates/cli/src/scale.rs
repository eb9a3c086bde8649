//! `softrdma scale`: how many RC QPs one device carries, and what each costs.
//!
//! Both sides create N RC QPs on their device (one shared CQ, small queues), connect the N
//! pairs over a TCP exchange and move checked data on every pair: one 64-byte WRITE per
//! QP issued one at a time (a round trip each), then one 64-byte SEND per QP posted all
//! at once. Each side measures its own create and connect times and its memory before
//! creating and after connecting; the client prints both sides' figures.
//!
//! The side channel (TCP, port 18517 by default), text lines:
//!
//! ```text
//! client: softrdma-scale 1 n=<N> gid=<32 hex> addr=<hex> rkey=<hex>
//!         N lines: <qpn hex> <psn hex>
//! server: softrdma-scale 1 ok gid=… addr=… rkey=… create_ns=<n> rss0=<kB> rss1=<kB> anon0=<kB> anon1=<kB>
//!         N lines: <qpn hex> <psn hex>          (its receives are posted by then)
//! client: connected
//! server: connect_ns=<n> rss2=<kB> anon2=<kB>   (once its QPs are in RTS)
//! …client WRITEs on every QP, one at a time (the server's device answers alone)…
//! client: send
//! …client SENDs on every QP at once; the server polls its CQ…
//! client: check
//! server: ok fds=<n> rss3=<kB>  (or: bad <what>)
//! ```
//!
//! It is its own command rather than a `perf` test: `perf`'s options (sizes, iterations,
//! depth, `--cm`) and one-QP session do not apply, and its figures are of another kind.

use std::io::{BufRead, BufReader, BufWriter, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde::Serialize;
use softrdma::{
    wr, Access, CompletionQueue, Device, MemoryRegion, PathOptions, ProtectionDomain, QpCap,
    QpInit, QpType, QueuePair, RemoteMemory, RemoteQp, WcOpcode, WcStatus, WorkCompletion,
};

use crate::{output, session, tcp, CmdResult, ScaleArgs};
use softrdma::pingpong::{gid_from_hex, gid_to_hex};

const MAGIC: &str = "softrdma-scale 1";
/// Bytes each operation moves.
const MSG: usize = 64;

/// Memory of this process, in KiB: resident set (VmRSS) and anonymous resident memory
/// (smaps_rollup's Anonymous: the heap and stacks, without the binary's pages).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Mem {
    pub rss_kb: u64,
    pub anon_kb: u64,
}

fn kb_field(text: &str, key: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// This process's memory now.
pub fn mem_now() -> Mem {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let rollup = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap_or_default();
    Mem {
        rss_kb: kb_field(&status, "VmRSS:"),
        anon_kb: kb_field(&rollup, "Anonymous:"),
    }
}

/// Open file descriptors of this process (sockets included).
fn fds_now() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// The 64 bytes QP `i` moves in phase `phase` (0: WRITE, 1: SEND): distinct per QP and
/// phase, so a datagram landing on the wrong QP or offset shows.
fn pattern(i: usize, phase: u8) -> [u8; MSG] {
    let mut b = [0u8; MSG];
    let seed = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ u64::from(phase) << 56;
    for (k, x) in b.iter_mut().enumerate() {
        *x = (seed.rotate_left(k as u32 * 7) as u8) ^ k as u8;
    }
    b
}

/// One side: N QPs on one PD and one CQ, and a buffer of 2 × N × 64 bytes: WRITEs land in
/// the first half at 64 × i, SENDs in the second.
struct Side {
    // First, so that the QPs go before the buffer they may still be receiving into.
    qps: Vec<QueuePair>,
    _pd: ProtectionDomain,
    cq: CompletionQueue,
    mr: MemoryRegion,
    psns: Vec<u32>,
    n: usize,
    create: Duration,
    mem0: Mem,
    mem1: Mem,
}

impl Side {
    /// Create the PD, buffer and CQ, note the memory, then create the N QPs (to INIT).
    fn new(dev: &Device, n: usize) -> CmdResult<Side> {
        let pd = dev
            .alloc_pd()
            .map_err(|e| format!("couldn't allocate PD: {e}"))?;
        let mr = pd
            .register(
                2 * n * MSG,
                Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
            )
            .map_err(|e| format!("couldn't register {} bytes: {e}", 2 * n * MSG))?;
        let cq = dev
            .create_cq(2 * n as u32 + 16, None)
            .map_err(|e| format!("couldn't create a CQ of {} entries: {e}", 2 * n + 16))?;
        let mut init = QpInit::new(QpType::Rc, &cq);
        // One WR in flight per queue is all the run posts, and what the CQ has room for.
        init.cap = QpCap {
            max_send_wr: 1,
            max_recv_wr: 1,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        let mem0 = mem_now();
        let t = Instant::now();
        let mut qps = Vec::with_capacity(n);
        let mut psns = Vec::with_capacity(n);
        for i in 0..n {
            let qp = pd
                .create_qp(&init)
                .map_err(|e| format!("couldn't create QP {i} of {n}: {e}"))?;
            qp.to_init(Access::REMOTE_WRITE | Access::REMOTE_READ)
                .map_err(|e| format!("couldn't modify QP {i} to INIT: {e}"))?;
            psns.push(qp.endpoint().psn);
            qps.push(qp);
        }
        let create = t.elapsed();
        let mem1 = mem_now();
        Ok(Side {
            _pd: pd,
            cq,
            mr,
            qps,
            psns,
            n,
            create,
            mem0,
            mem1,
        })
    }

    fn remote(&self) -> RemoteMemory {
        self.mr.remote()
    }

    /// Our N QP numbers and PSNs, one line each.
    fn write_qps(&self, w: &mut impl Write) -> std::io::Result<()> {
        for (qp, psn) in self.qps.iter().zip(&self.psns) {
            writeln!(w, "{:x} {:x}", qp.qpn(), psn)?;
        }
        w.flush()
    }

    /// Read the peer's N lines and connect QP i to the peer's QP i (RTR, RTS).
    fn connect_all(&self, r: &mut BufReader<TcpStream>, gid: softrdma::Gid) -> CmdResult {
        let o = PathOptions {
            mtu: softrdma::Mtu::Mtu1024,
            ..Default::default()
        };
        let mut line = String::new();
        for (i, (qp, psn)) in self.qps.iter().zip(&self.psns).enumerate() {
            line.clear();
            read_line(r, &mut line, "the peer's QP list")?;
            let mut f = line.split_whitespace();
            let mut num = || {
                f.next()
                    .and_then(|v| u32::from_str_radix(v, 16).ok())
                    .ok_or_else(|| format!("malformed QP line {i}: {line:?}"))
            };
            let (qpn, rpsn) = (num()?, num()?);
            let remote = RemoteQp {
                gid,
                qpn,
                psn: rpsn,
            };
            qp.to_rtr_with(&remote, &o)
                .and_then(|()| qp.to_rts_with(*psn, &o))
                .map_err(|e| format!("couldn't connect QP {i}: {e}"))?;
        }
        Ok(())
    }

    /// Wait for `n` completions of `opcode`, each successful; returns them.
    fn reap(
        &self,
        n: usize,
        opcode: WcOpcode,
        timeout: Duration,
    ) -> CmdResult<Vec<WorkCompletion>> {
        let mut out = Vec::with_capacity(n);
        let mut buf = [WorkCompletion::default(); 64];
        let poller = session::Poller::new(timeout);
        while out.len() < n {
            let k = poller.poll(&self.cq, &mut buf)?;
            for wc in &buf[..k] {
                if wc.status != WcStatus::Success {
                    return Err(format!("QP {:#x}: {}", wc.qp_num, session::wc_error(wc)));
                }
                if wc.opcode != opcode {
                    return Err(format!("unexpected completion {:?}", wc.opcode));
                }
                out.push(*wc);
            }
        }
        Ok(out)
    }
}

fn read_line(r: &mut BufReader<TcpStream>, line: &mut String, what: &str) -> CmdResult {
    match r.read_line(line) {
        Ok(0) => Err(format!("couldn't read {what}: peer closed the connection")),
        Ok(_) => Ok(()),
        Err(e) => Err(format!("couldn't read {what}: {e}")),
    }
}

/// A buffer range refused by [`softrdma::MemoryRegion::sge`].
fn range_err(e: softrdma::Error) -> String {
    format!("buffer range: {e}")
}

fn field<'a>(line: &'a str, key: &str) -> CmdResult<&'a str> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
        .ok_or_else(|| format!("peer's line lacks {key}: {line:?}"))
}

fn num(line: &str, key: &str) -> CmdResult<u64> {
    field(line, key)?
        .parse()
        .map_err(|_| format!("peer's {key} is not a number: {line:?}"))
}

fn hex(line: &str, key: &str) -> CmdResult<u64> {
    u64::from_str_radix(field(line, key)?, 16)
        .map_err(|_| format!("peer's {key} is not hex: {line:?}"))
}

fn io_err(e: std::io::Error) -> String {
    format!("side channel: {e}")
}

/// One side's figures.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct SideFigures {
    /// Creating the N QPs and moving them to INIT, ms.
    pub create_ms: f64,
    /// Connecting them (RTR, RTS), ms: on the client from sending its QP list until all
    /// its QPs are in RTS (the server's connecting and answer included), on the server
    /// its own modifies only.
    pub connect_ms: f64,
    /// Memory before creating, after creating, after connecting, after the traffic.
    pub mem: [Mem; 4],
    /// (VmRSS after connecting − before creating) / N, bytes.
    pub rss_per_qp: f64,
    /// The same for anonymous memory, bytes.
    pub anon_per_qp: f64,
    /// Open file descriptors after the traffic.
    pub fds: usize,
}

impl SideFigures {
    fn finish(&mut self, n: usize) {
        let per = |a: u64, b: u64| (b as f64 - a as f64) * 1024.0 / n as f64;
        self.rss_per_qp = per(self.mem[0].rss_kb, self.mem[2].rss_kb);
        self.anon_per_qp = per(self.mem[0].anon_kb, self.mem[2].anon_kb);
    }
}

/// The client's report.
#[derive(Debug, Serialize)]
pub struct Report {
    pub qps: usize,
    pub client: SideFigures,
    pub server: SideFigures,
    /// One 64-byte WRITE per QP, one at a time (post, wait for its completion): average
    /// µs per QP.
    pub write_each_us: f64,
    /// One 64-byte SEND per QP, all posted at once, until the last completion: ms total.
    pub send_all_ms: f64,
    /// The same per QP, µs.
    pub send_all_per_qp_us: f64,
    /// Destroying the client's N QPs (then its CQ, buffer and PD), ms.
    pub destroy_ms: f64,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// `softrdma scale`.
pub fn run(a: &ScaleArgs) -> CmdResult {
    let n = a.qps as usize;
    if n == 0 {
        return Err("--qps must be at least 1".into());
    }
    let timeout = Duration::from_secs(a.timeout.max(1));
    let dev = session::open_device(&a.dev)?;
    match &a.peer {
        None => serve(a, &dev, n, timeout),
        Some(host) => {
            let r = client(a, &dev, host, n, timeout)?;
            if a.json {
                output::print_json(&r)
            } else {
                print_report(&r);
                Ok(())
            }
        }
    }
}

fn serve(a: &ScaleArgs, dev: &Device, n: usize, timeout: Duration) -> CmdResult {
    let l = tcp::listen(a.port)?;
    let side = Side::new(dev, n)?;
    if !a.json {
        outln!("{n} QPs created; waiting for the client on port {}", a.port);
        output::flush_stdout();
    }
    let (s, _) = tcp::accept(&l)?;
    drop(l);
    let mut r = BufReader::new(s.try_clone().map_err(io_err)?);
    let mut w = BufWriter::new(s);
    let mut line = String::new();
    read_line(&mut r, &mut line, "the client's request")?;
    let Some(rest) = line.strip_prefix(MAGIC) else {
        return Err(format!("not a softrdma scale client: {line:?}"));
    };
    let want = num(rest, "n")? as usize;
    if want != n {
        let _ = writeln!(w, "{MAGIC} error the server has {n} QPs, not {want}");
        let _ = w.flush();
        return Err(format!(
            "the client asked for {want} QPs; this server has {n}"
        ));
    }
    let gid = gid_from_hex(field(rest, "gid")?).ok_or("malformed gid")?;
    let t = Instant::now();
    side.connect_all(&mut r, gid)?;
    let connect = t.elapsed();
    let mem2 = mem_now();
    // Receives for the SEND phase, one per QP, after the idle measurement.
    for (i, qp) in side.qps.iter().enumerate() {
        let at = n * MSG + i * MSG;
        let sge = side.mr.sge(at..at + MSG).map_err(range_err)?;
        qp.post_recv(wr::recv(i as u64, [sge]))
            .map_err(|e| format!("couldn't post a receive on QP {i}: {e}"))?;
    }
    let m = side.remote();
    writeln!(
        w,
        "{MAGIC} ok gid={} addr={:x} rkey={:x} create_ns={} rss0={} rss1={} anon0={} anon1={}",
        gid_to_hex(&dev.gid()),
        m.addr,
        m.rkey,
        side.create.as_nanos(),
        side.mem0.rss_kb,
        side.mem1.rss_kb,
        side.mem0.anon_kb,
        side.mem1.anon_kb,
    )
    .map_err(io_err)?;
    side.write_qps(&mut w).map_err(io_err)?;
    line.clear();
    read_line(&mut r, &mut line, "the client's \"connected\"")?;
    writeln!(
        w,
        "connect_ns={} rss2={} anon2={}",
        connect.as_nanos(),
        mem2.rss_kb,
        mem2.anon_kb
    )
    .map_err(io_err)?;
    w.flush().map_err(io_err)?;
    // The WRITEs need nothing of this process (its device's progress thread answers
    // them): polling an idle CQ meanwhile would only add its back-off to their ACKs. They
    // may take longer than the side channel's usual timeout; a client that dies closes
    // the connection.
    r.get_ref().set_read_timeout(None).map_err(io_err)?;
    line.clear();
    read_line(&mut r, &mut line, "the client's \"send\"")?;
    // The SENDs arrive while the client waits; their completions are checked here.
    let verdict = check_server(&side, timeout);
    line.clear();
    read_line(&mut r, &mut line, "the client's \"check\"")?;
    let mem3 = mem_now();
    match &verdict {
        Ok(()) => writeln!(
            w,
            "ok fds={} rss3={} anon3={}",
            fds_now(),
            mem3.rss_kb,
            mem3.anon_kb
        ),
        Err(e) => writeln!(w, "bad {e}"),
    }
    .and_then(|()| w.flush())
    .map_err(io_err)?;
    verdict?;
    if !a.json {
        outln!("served {n} QPs: data checked on every one");
    }
    Ok(())
}

/// The server's check: a SEND completion on every QP with its pattern, and every WRITE's
/// pattern in place.
fn check_server(side: &Side, timeout: Duration) -> CmdResult {
    let n = side.n;
    let wcs = side.reap(n, WcOpcode::Recv, timeout)?;
    let mut seen = vec![false; n];
    let mut got = [0u8; MSG];
    for wc in &wcs {
        let i = wc.wr_id as usize;
        if i >= n || seen[i] || side.qps[i].qpn() != wc.qp_num || wc.byte_len as usize != MSG {
            return Err(format!(
                "receive completion wr_id {i} on QP {:#x}, {} bytes: not QP {i}'s one SEND",
                wc.qp_num, wc.byte_len
            ));
        }
        seen[i] = true;
        side.mr
            .read(n * MSG + i * MSG, &mut got)
            .map_err(|e| e.to_string())?;
        if got != pattern(i, 1) {
            return Err(format!("QP {i}: SEND data differs"));
        }
    }
    let mut all = vec![0u8; n * MSG];
    side.mr.read(0, &mut all).map_err(|e| e.to_string())?;
    for (i, c) in all.chunks(MSG).enumerate() {
        if c != pattern(i, 0) {
            return Err(format!("QP {i}: WRITE data differs"));
        }
    }
    Ok(())
}

fn client(
    a: &ScaleArgs,
    dev: &Device,
    host: &str,
    n: usize,
    timeout: Duration,
) -> CmdResult<Report> {
    let side = Side::new(dev, n)?;
    let mut cf = SideFigures {
        create_ms: ms(side.create),
        ..Default::default()
    };
    cf.mem[0] = side.mem0;
    cf.mem[1] = side.mem1;
    // What this side sends from: QP i's WRITE at 64 i, its SEND at 64 (N + i).
    for i in 0..n {
        side.mr
            .write(i * MSG, &pattern(i, 0))
            .and_then(|()| side.mr.write(n * MSG + i * MSG, &pattern(i, 1)))
            .map_err(|e| e.to_string())?;
    }
    let s = tcp::connect(host, a.port)?;
    let mut r = BufReader::new(s.try_clone().map_err(io_err)?);
    let mut w = BufWriter::new(s);
    let m = side.remote();
    let t = Instant::now();
    writeln!(
        w,
        "{MAGIC} n={n} gid={} addr={:x} rkey={:x}",
        gid_to_hex(&dev.gid()),
        m.addr,
        m.rkey
    )
    .map_err(io_err)?;
    side.write_qps(&mut w).map_err(io_err)?;
    let mut line = String::new();
    read_line(&mut r, &mut line, "the server's answer")?;
    let Some(rest) = line.strip_prefix(MAGIC) else {
        return Err(format!("not a softrdma scale server: {line:?}"));
    };
    if let Some(e) = rest.trim().strip_prefix("error ") {
        return Err(format!("server: {e}"));
    }
    let gid = gid_from_hex(field(rest, "gid")?).ok_or("malformed gid")?;
    let remote = RemoteMemory {
        addr: hex(rest, "addr")?,
        rkey: hex(rest, "rkey")? as u32,
        len: (2 * n * MSG) as u64,
    };
    let mut sf = SideFigures {
        create_ms: num(rest, "create_ns")? as f64 / 1e6,
        ..Default::default()
    };
    sf.mem[0] = Mem {
        rss_kb: num(rest, "rss0")?,
        anon_kb: num(rest, "anon0")?,
    };
    sf.mem[1] = Mem {
        rss_kb: num(rest, "rss1")?,
        anon_kb: num(rest, "anon1")?,
    };
    side.connect_all(&mut r, gid)?;
    cf.connect_ms = ms(t.elapsed());
    cf.mem[2] = mem_now();
    writeln!(w, "connected")
        .and_then(|()| w.flush())
        .map_err(io_err)?;
    line.clear();
    read_line(&mut r, &mut line, "the server's connect figures")?;
    sf.connect_ms = num(&line, "connect_ns")? as f64 / 1e6;
    sf.mem[2] = Mem {
        rss_kb: num(&line, "rss2")?,
        anon_kb: num(&line, "anon2")?,
    };

    // One WRITE per QP, one at a time: each QP's own round trip.
    let t = Instant::now();
    for (i, qp) in side.qps.iter().enumerate() {
        let sge = side.mr.sge(i * MSG..(i + 1) * MSG).map_err(range_err)?;
        wr::write(i as u64, [sge], &remote, (i * MSG) as u64)
            .and_then(|w| qp.post_send(w))
            .map_err(|e| format!("couldn't post a WRITE on QP {i}: {e}"))?;
        let wc = side.reap(1, WcOpcode::RdmaWrite, timeout)?;
        if wc[0].wr_id != i as u64 {
            return Err(format!(
                "WRITE completion for {} instead of {i}",
                wc[0].wr_id
            ));
        }
    }
    let write_each = t.elapsed();
    writeln!(w, "send")
        .and_then(|()| w.flush())
        .map_err(io_err)?;
    // One SEND per QP, all at once.
    let t = Instant::now();
    for (i, qp) in side.qps.iter().enumerate() {
        let at = n * MSG + i * MSG;
        let sge = side.mr.sge(at..at + MSG).map_err(range_err)?;
        qp.post_send(wr::send(i as u64, [sge]))
            .map_err(|e| format!("couldn't post a SEND on QP {i}: {e}"))?;
    }
    side.reap(n, WcOpcode::Send, timeout)?;
    let send_all = t.elapsed();
    cf.mem[3] = mem_now();
    cf.fds = fds_now();

    writeln!(w, "check")
        .and_then(|()| w.flush())
        .map_err(io_err)?;
    line.clear();
    read_line(&mut r, &mut line, "the server's check")?;
    if let Some(e) = line.trim().strip_prefix("bad ") {
        return Err(format!("the server found: {e}"));
    }
    let t = Instant::now();
    drop(side);
    let destroy = t.elapsed();
    sf.fds = num(&line, "fds")? as usize;
    sf.mem[3] = Mem {
        rss_kb: num(&line, "rss3")?,
        anon_kb: num(&line, "anon3")?,
    };
    cf.finish(n);
    sf.finish(n);
    Ok(Report {
        qps: n,
        client: cf,
        server: sf,
        write_each_us: write_each.as_secs_f64() * 1e6 / n as f64,
        send_all_ms: ms(send_all),
        send_all_per_qp_us: send_all.as_secs_f64() * 1e6 / n as f64,
        destroy_ms: ms(destroy),
    })
}

fn print_report(r: &Report) {
    outln!(
        "{} RC QP pairs, one shared CQ per side; data checked on every QP",
        r.qps
    );
    outln!("{:<44} {:>12} {:>12}", "", "client", "server");
    let row = |name: &str, c: String, s: String| outln!("{name:<44} {c:>12} {s:>12}");
    row(
        "create N QPs (to INIT), ms",
        format!("{:.1}", r.client.create_ms),
        format!("{:.1}", r.server.create_ms),
    );
    row(
        "connect N QPs (RTR+RTS; client: +exchange), ms",
        format!("{:.1}", r.client.connect_ms),
        format!("{:.1}", r.server.connect_ms),
    );
    row(
        "VmRSS per idle connected QP, bytes",
        format!("{:.0}", r.client.rss_per_qp),
        format!("{:.0}", r.server.rss_per_qp),
    );
    row(
        "anonymous memory per idle QP, bytes",
        format!("{:.0}", r.client.anon_per_qp),
        format!("{:.0}", r.server.anon_per_qp),
    );
    row(
        "VmRSS before / connected / after ops, KiB",
        format!(
            "{}/{}/{}",
            r.client.mem[0].rss_kb, r.client.mem[2].rss_kb, r.client.mem[3].rss_kb
        ),
        format!(
            "{}/{}/{}",
            r.server.mem[0].rss_kb, r.server.mem[2].rss_kb, r.server.mem[3].rss_kb
        ),
    );
    row(
        "open fds after ops",
        r.client.fds.to_string(),
        r.server.fds.to_string(),
    );
    outln!(
        "WRITE 64 B on each QP, one at a time: {:.2} us per QP ({:.1} ms in all)",
        r.write_each_us,
        r.write_each_us * r.qps as f64 / 1e3
    );
    outln!(
        "SEND 64 B on every QP at once: {:.1} ms in all, {:.2} us per QP",
        r.send_all_ms,
        r.send_all_per_qp_us
    );
    outln!("destroy N QPs (client): {:.1} ms", r.destroy_ms);
}
