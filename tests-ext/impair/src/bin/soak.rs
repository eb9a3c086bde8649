//! `soak`: checks that RC delivers every operation exactly once and in order, with the
//! right bytes, over whatever link lies between the two sides (meant for a lossy one).
//!
//! The client runs `--ops` work requests on one RC queue pair, mixing RDMA WRITE (each
//! followed by a READ of the same bytes), SEND (half with immediate data), FETCH_AND_ADD
//! and COMPARE_AND_SWAP, up to `--depth` in flight. Both sides derive the whole schedule
//! and every byte from `--seed` (the client sends its parameters), so:
//!
//! - every completion must be a success, in the order posted (the wr_id is the op number);
//! - a READ returns exactly what the WRITE before it wrote;
//! - the server's n-th receive holds the n-th SEND's bytes, length and immediate data (a
//!   duplicate or a skipped SEND shows as the wrong op number);
//! - FETCH_AND_ADD returns the number of adds before it and COMPARE_AND_SWAP the number of
//!   swaps before it, so an atomic applied twice (or not at all) shows at once;
//! - at the end the server's counters equal the numbers of adds and swaps, and every
//!   target slot holds the last WRITE to it.
//!
//! ```text
//! server:  soak [--port 18519]
//! client:  soak SERVER_IP [--ops 100000] [--seed 1] [--depth 16] [--timeout 600]
//! ```
//! The device's address comes from `SOFTRDMA_ADDR` as for every softrdma program.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use clap::Parser;
use softrdma::{
    wr, Access, CompletionQueue, Device, MemoryRegion, Mtu, PathOptions, QpInit, QpType, QueuePair,
    RemoteMemory, RemoteQp, SendWr, WcOpcode, WcStatus, WorkCompletion,
};
use softrdma_impair::pattern::{self, Schedule, Step};

/// RC exactly-once, in-order soak test over softrdma.
#[derive(Parser, Debug)]
#[command(name = "soak")]
struct Args {
    /// Server to connect to; without it, serve one client.
    server: Option<String>,
    /// TCP port of the exchange.
    #[arg(long, default_value_t = 18519)]
    port: u16,
    /// Work requests to run (client; the server takes the client's); one more when the
    /// last is a WRITE, which its READ follows.
    #[arg(long, default_value_t = 100_000)]
    ops: u64,
    /// Seed of the schedule and the data.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Work requests in flight.
    #[arg(long, default_value_t = 16)]
    depth: u64,
    /// Longest WRITE or SEND in bytes.
    #[arg(long, default_value_t = 4096)]
    max_len: usize,
    /// Fail when the whole run takes longer than this many seconds.
    #[arg(long, default_value_t = 600)]
    timeout: u64,
    /// Path MTU: 256, 512, 1024, 2048 or 4096.
    #[arg(long, default_value_t = 1024)]
    mtu: u32,
    /// Local ACK timeout code (4.096 µs × 2^code); default: the library's.
    #[arg(long)]
    ack_timeout: Option<u8>,
    /// Retries on timeout or sequence NAK (7 is the most the verbs allow).
    #[arg(long, default_value_t = 7)]
    retry_cnt: u8,
    /// Print progress every this many seconds (0: never).
    #[arg(long, default_value_t = 10)]
    progress: u64,
}

type Res<T> = Result<T, String>;

/// Target slots and local buffers are rings as deep as the queue: a slot is reused only
/// once everything that touched it has completed (completions come in order).
fn ring(depth: u64) -> usize {
    depth as usize
}

/// The most memory the server registers for receive buffers, whatever a client asks.
const MAX_BUFFERS: u64 = 256 << 20;

/// Whether a run's depth and message size are within what either side will allocate.
fn sizes_ok(depth: u64, max_len: u64) -> bool {
    (2..=4096).contains(&depth)
        && (pattern::TAG as u64..=1 << 20).contains(&max_len)
        && (2 * depth + 16) * max_len <= MAX_BUFFERS
}

/// What the client tells the server: its QP and the run's parameters.
struct Hello {
    qp: RemoteQp,
    ops: u64,
    seed: u64,
    depth: u64,
    max_len: u64,
}

impl Hello {
    const LEN: usize = 24 + 32;
    fn to_bytes(&self) -> Vec<u8> {
        let mut v = self.qp.to_bytes().to_vec();
        for x in [self.ops, self.seed, self.depth, self.max_len] {
            v.extend_from_slice(&x.to_le_bytes());
        }
        v
    }
    fn from_bytes(b: &[u8]) -> Option<Hello> {
        let q: [u8; 24] = b.get(..24)?.try_into().ok()?;
        let word = |i: usize| -> Option<u64> {
            Some(u64::from_le_bytes(
                b.get(24 + 8 * i..32 + 8 * i)?.try_into().ok()?,
            ))
        };
        Some(Hello {
            qp: RemoteQp::from_bytes(&q),
            ops: word(0)?,
            seed: word(1)?,
            depth: word(2)?,
            max_len: word(3)?,
        })
    }
}

fn mtu_of(m: u32) -> Res<Mtu> {
    Ok(match m {
        256 => Mtu::Mtu256,
        512 => Mtu::Mtu512,
        1024 => Mtu::Mtu1024,
        2048 => Mtu::Mtu2048,
        4096 => Mtu::Mtu4096,
        _ => return Err(format!("--mtu {m}: not 256, 512, 1024, 2048 or 4096")),
    })
}

fn path(a: &Args) -> Res<PathOptions> {
    let mut p = PathOptions {
        mtu: mtu_of(a.mtu)?,
        retry_cnt: a.retry_cnt.min(7),
        ..PathOptions::default()
    };
    if let Some(t) = a.ack_timeout {
        p.timeout = t.min(31);
    }
    Ok(p)
}

fn e<E: std::fmt::Display>(what: &'static str) -> impl Fn(E) -> String {
    move |x| format!("{what}: {x}")
}

fn stats_line(dev: &Device) -> String {
    let s = dev.stats().engine;
    format!(
        "tx {} rx {} packets, {} retransmits, {} timeouts, seq NAKs {} sent {} received, RNR \
         NAKs {} sent {} received, {} ICRC errors, {} duplicates, {} out of sequence, {} \
         malformed, {} dropped, READ re-executions {} (refused {}), SACKs {} sent {} \
         received",
        s.tx_packets,
        s.rx_packets,
        s.retransmits,
        s.timeouts,
        s.naks_sent_seq,
        s.naks_rcvd_seq,
        s.rnr_naks_sent,
        s.rnr_naks_rcvd,
        s.icrc_errors,
        s.duplicates,
        s.out_of_sequence,
        s.malformed,
        s.dropped,
        s.read_replays,
        s.read_replays_refused,
        s.sacks_sent,
        s.sacks_rcvd
    )
}

/// Everything the server expects, derived from the schedule.
struct Expect {
    /// (op, len, imm) of every SEND, in order.
    sends: Vec<(u64, usize, bool)>,
    /// The last (op, len) written to each slot.
    slots: Vec<Option<(u64, usize)>>,
    adds: u64,
    swaps: u64,
}

fn expect(h: &Hello) -> Expect {
    let mut sched = Schedule::new(h.seed, ring(h.depth), h.max_len as usize);
    let mut x = Expect {
        sends: Vec::new(),
        slots: vec![None; ring(h.depth)],
        adds: 0,
        swaps: 0,
    };
    let mut op = 0u64;
    while op < h.ops {
        let s = sched.next_step();
        match s {
            Step::WriteRead { slot, len } => {
                x.slots[slot] = Some((op, len));
            }
            Step::Send { len, imm } => x.sends.push((op, len, imm)),
            Step::FetchAdd => x.adds += 1,
            Step::CompareSwap => x.swaps += 1,
        }
        op += s.wrs();
    }
    x
}

fn server(a: &Args) -> Res<()> {
    let dev = Device::open_default().map_err(e("open the device"))?;
    let l = TcpListener::bind(("0.0.0.0", a.port)).map_err(e("listen"))?;
    println!(
        "soak server: {} at {}, TCP port {}",
        dev.name(),
        dev.addr(),
        a.port
    );
    let (mut s, from) = l.accept().map_err(e("accept"))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))
        .map_err(e("socket"))?;
    let mut hb = [0u8; Hello::LEN];
    s.read_exact(&mut hb)
        .map_err(e("read the client's hello"))?;
    let h = Hello::from_bytes(&hb).ok_or("bad hello")?;
    if !sizes_ok(h.depth, h.max_len) {
        return Err(format!(
            "client parameters out of range: depth {} max_len {}",
            h.depth, h.max_len
        ));
    }
    let deadline = Instant::now() + Duration::from_secs(a.timeout);
    let max_len = h.max_len as usize;
    let slots = ring(h.depth);
    let recvs = 2 * slots + 16;
    let pd = dev.alloc_pd().map_err(e("alloc pd"))?;
    let cq = dev
        .create_cq(recvs as u32 + 16, None)
        .map_err(e("create cq"))?;
    let remote = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    let target = pd
        .register(slots * max_len, remote)
        .map_err(e("register the target"))?;
    let counters = pd
        .register(
            16,
            Access::LOCAL_WRITE | Access::REMOTE_ATOMIC | Access::REMOTE_READ,
        )
        .map_err(e("register the counters"))?;
    let rbuf = pd
        .register(recvs * max_len, Access::LOCAL_WRITE)
        .map_err(e("register the receive buffers"))?;
    // The server only receives: one send WR, and every receive the CQ has room for.
    let qp = pd
        .create_qp(&QpInit::new(QpType::Rc, &cq).depth(1, recvs as u32))
        .map_err(e("create qp"))?;
    // The PSN the QP chose, sent in the hello and sent from by connect_with.
    let me = qp.endpoint();
    let psn = me.psn;
    let mut msg = me.remote_qp().to_bytes().to_vec();
    msg.extend_from_slice(&target.remote().to_bytes());
    msg.extend_from_slice(&counters.remote().to_bytes());
    s.write_all(&msg).map_err(e("send the server's hello"))?;
    qp.connect_with(&h.qp, psn, remote | Access::REMOTE_ATOMIC, &path(a)?)
        .map_err(e("connect"))?;
    for i in 0..recvs {
        let sge = rbuf
            .sge(i * max_len..(i + 1) * max_len)
            .map_err(e("a receive buffer"))?;
        qp.post_recv(wr::recv(i as u64, [sge]))
            .map_err(e("post recv"))?;
    }
    s.write_all(b"r").map_err(e("ready"))?;
    println!(
        "soak server: client {from}: {} ops, seed {}, depth {}, max_len {}",
        h.ops, h.seed, h.depth, h.max_len
    );
    let x = expect(&h);
    let r = serve(&s, &qp, &cq, &rbuf, max_len, &x, h.seed, deadline).and_then(|()| {
        // The client says it is done once all its completions are in; only then is memory
        // final.
        let rest = deadline.saturating_duration_since(Instant::now());
        s.set_read_timeout(Some(rest.max(Duration::from_millis(1))))
            .map_err(e("socket"))?;
        let mut d = [0u8; 1];
        s.read_exact(&mut d)
            .map_err(e("wait for the client's end"))?;
        if d[0] != b'd' {
            return Err("the client failed (see its output)".into());
        }
        check_memory(&target, &counters, &x, h.seed, max_len)
    });
    let verdict = match &r {
        Ok(()) => "ok".to_string(),
        Err(m) => m.clone(),
    };
    let mut out = (verdict.len() as u32).to_le_bytes().to_vec();
    out.extend_from_slice(verdict.as_bytes());
    let _ = s.write_all(&out);
    println!("soak server: {}", stats_line(&dev));
    r.map(|()| {
        println!(
            "soak server: ok: {} SENDs in order, {} adds, {} swaps, {} slots as last written",
            x.sends.len(),
            x.adds,
            x.swaps,
            x.slots.iter().flatten().count()
        )
    })
}

/// Receive every SEND and check it, in order.
#[allow(clippy::too_many_arguments)]
fn serve(
    s: &TcpStream,
    qp: &QueuePair,
    cq: &CompletionQueue,
    rbuf: &MemoryRegion,
    max_len: usize,
    x: &Expect,
    seed: u64,
    deadline: Instant,
) -> Res<()> {
    let mut wcs = [WorkCompletion::default(); 32];
    let mut k = 0usize;
    let mut last_peek = Instant::now();
    let mut data = vec![0u8; max_len];
    while k < x.sends.len() {
        if Instant::now() > deadline {
            return Err(format!(
                "timed out: {k} of {} SENDs received",
                x.sends.len()
            ));
        }
        // A client that failed closes the connection: stop waiting for its SENDs.
        if last_peek.elapsed() > Duration::from_millis(200) {
            last_peek = Instant::now();
            s.set_nonblocking(true).map_err(e("socket"))?;
            let mut b = [0u8; 1];
            let gone = match s.peek(&mut b) {
                Ok(0) => true,
                Ok(_) => b[0] == b'f',
                Err(_) => false,
            };
            s.set_nonblocking(false).map_err(e("socket"))?;
            if gone {
                return Err(format!(
                    "the client stopped after {k} of {} SENDs (see its output)",
                    x.sends.len()
                ));
            }
        }
        let n = match cq.wait(Duration::from_millis(100)) {
            Ok(wc) => {
                wcs[0] = wc;
                1
            }
            Err(err) if err.is_timeout() => 0,
            Err(err) => return Err(format!("poll: {err}")),
        };
        let more = cq.poll(&mut wcs[n..]).map_err(e("poll"))?;
        for wc in &wcs[..n + more] {
            let (op, len, imm) = *x.sends.get(k).ok_or_else(|| {
                format!("a receive completion beyond the {} SENDs", x.sends.len())
            })?;
            if wc.status != WcStatus::Success {
                return Err(format!(
                    "receive {k} (SEND op {op}): status {} (vendor {:#x})",
                    wc.status.as_str(),
                    wc.vendor_err
                ));
            }
            if wc.opcode != WcOpcode::Recv {
                return Err(format!("receive {k}: opcode {:?}", wc.opcode));
            }
            let slot = wc.wr_id as usize;
            if wc.byte_len as usize != len {
                return Err(format!(
                    "receive {k}: {} bytes, expected the {len} of SEND op {op}",
                    wc.byte_len
                ));
            }
            let has_imm = wc.wc_flags.contains(softrdma::WcFlags::WITH_IMM);
            if has_imm != imm || (imm && wc.imm_data != op as u32) {
                return Err(format!(
                    "receive {k} (SEND op {op}): immediate {} {:#x}, expected {} {:#x}",
                    has_imm, wc.imm_data, imm, op as u32
                ));
            }
            rbuf.read(slot * max_len, &mut data[..len])
                .map_err(e("read a receive buffer"))?;
            if let Some(m) = pattern::mismatch(seed, op, &data[..len], len) {
                return Err(format!("receive {k} (SEND op {op}): {m}"));
            }
            let sge = rbuf
                .sge(slot * max_len..(slot + 1) * max_len)
                .map_err(e("a receive buffer"))?;
            qp.post_recv(wr::recv(slot as u64, [sge]))
                .map_err(e("post recv"))?;
            k += 1;
        }
    }
    Ok(())
}

fn check_memory(
    target: &MemoryRegion,
    counters: &MemoryRegion,
    x: &Expect,
    seed: u64,
    max_len: usize,
) -> Res<()> {
    let adds = counters.read_u64(0).map_err(e("read the counter"))?;
    let swaps = counters.read_u64(8).map_err(e("read the counter"))?;
    if adds != x.adds {
        return Err(format!(
            "FETCH_AND_ADD counter is {adds}, expected {} (an atomic applied {} times)",
            x.adds,
            if adds > x.adds {
                "twice or more"
            } else {
                "zero"
            }
        ));
    }
    if swaps != x.swaps {
        return Err(format!(
            "COMPARE_AND_SWAP counter is {swaps}, expected {}",
            x.swaps
        ));
    }
    for (i, last) in x.slots.iter().enumerate() {
        if let Some((op, len)) = *last {
            let got = target
                .to_vec(i * max_len, len)
                .map_err(e("read the target"))?;
            if let Some(m) = pattern::mismatch(seed, op, &got, len) {
                return Err(format!("target slot {i} (last WRITE op {op}): {m}"));
            }
        }
    }
    Ok(())
}

/// A posted work request and what its completion must show.
#[derive(Debug, Clone, Copy)]
enum Want {
    Write,
    Read { of: u64, len: usize, at: usize },
    Send,
    FetchAdd { old: u64, at: usize },
    CompareSwap { old: u64, at: usize },
}

struct Client<'a> {
    seed: u64,
    max_len: usize,
    data: &'a MemoryRegion,
    res: &'a MemoryRegion,
    target: RemoteMemory,
    counters: RemoteMemory,
    adds: u64,
    swaps: u64,
    counts: [u64; 5],
}

impl Client<'_> {
    /// The work requests of step `s` starting at op `op`, their local buffers filled.
    fn build(&mut self, s: Step, op: u64) -> Res<Vec<(SendWr, Want)>> {
        let ml = self.max_len;
        let local = |op: u64, depth: usize| (op as usize % depth) * ml;
        let depth = self.data.len() / ml;
        Ok(match s {
            Step::WriteRead { slot, len } => {
                let src = local(op, depth);
                let dst = local(op + 1, depth);
                self.data
                    .write(src, &pattern::pattern(self.seed, op, len))
                    .map_err(e("fill a buffer"))?;
                // Stale bytes in the READ's buffer must not pass for a correct READ.
                self.data
                    .write(dst, &vec![0xEE; len])
                    .map_err(e("clear a buffer"))?;
                let at = (slot * ml) as u64;
                self.counts[0] += 1;
                self.counts[1] += 1;
                vec![
                    (
                        wr::write(
                            op,
                            [self.data.sge(src..src + len).map_err(e("a buffer range"))?],
                            &self.target,
                            at,
                        )
                        .map_err(e("a target range"))?,
                        Want::Write,
                    ),
                    (
                        wr::read(
                            op + 1,
                            [self.data.sge(dst..dst + len).map_err(e("a buffer range"))?],
                            &self.target,
                            at,
                        )
                        .map_err(e("a target range"))?,
                        Want::Read {
                            of: op,
                            len,
                            at: dst,
                        },
                    ),
                ]
            }
            Step::Send { len, imm } => {
                let src = local(op, depth);
                self.data
                    .write(src, &pattern::pattern(self.seed, op, len))
                    .map_err(e("fill a buffer"))?;
                let sg = [self.data.sge(src..src + len).map_err(e("a buffer range"))?];
                self.counts[2] += 1;
                let w = if imm {
                    wr::send_with_imm(op, sg, op as u32)
                } else {
                    wr::send(op, sg)
                };
                vec![(w, Want::Send)]
            }
            Step::FetchAdd => {
                let at = (op as usize % depth) * 8;
                self.res
                    .write_u64(at, u64::MAX)
                    .map_err(e("clear a result"))?;
                let old = self.adds;
                self.adds += 1;
                self.counts[3] += 1;
                vec![(
                    wr::fetch_add(
                        op,
                        self.res.sge(at..at + 8).map_err(e("a result range"))?,
                        &self.counters,
                        0,
                        1,
                    )
                    .map_err(e("a counter"))?,
                    Want::FetchAdd { old, at },
                )]
            }
            Step::CompareSwap => {
                let at = (op as usize % depth) * 8;
                self.res
                    .write_u64(at, u64::MAX)
                    .map_err(e("clear a result"))?;
                let old = self.swaps;
                self.swaps += 1;
                self.counts[4] += 1;
                vec![(
                    wr::compare_swap(
                        op,
                        self.res.sge(at..at + 8).map_err(e("a result range"))?,
                        &self.counters,
                        8,
                        old,
                        old + 1,
                    )
                    .map_err(e("a counter"))?,
                    Want::CompareSwap { old, at },
                )]
            }
        })
    }

    fn check(&self, wc: &WorkCompletion, op: u64, want: Want) -> Res<()> {
        if wc.wr_id != op {
            return Err(format!(
                "completion out of order: wr_id {} where op {op} was next",
                wc.wr_id
            ));
        }
        if wc.status != WcStatus::Success {
            return Err(format!(
                "op {op} ({want:?}): status {} (vendor {:#x})",
                wc.status.as_str(),
                wc.vendor_err
            ));
        }
        let opcode = match want {
            Want::Write => WcOpcode::RdmaWrite,
            Want::Read { .. } => WcOpcode::RdmaRead,
            Want::Send => WcOpcode::Send,
            Want::FetchAdd { .. } => WcOpcode::FetchAdd,
            Want::CompareSwap { .. } => WcOpcode::CompSwap,
        };
        if wc.opcode != opcode {
            return Err(format!(
                "op {op}: completion opcode {:?}, expected {opcode:?}",
                wc.opcode
            ));
        }
        match want {
            Want::Read { of, len, at } => {
                let got = self.data.to_vec(at, len).map_err(e("read a buffer"))?;
                if let Some(m) = pattern::mismatch(self.seed, of, &got, len) {
                    return Err(format!("READ op {op} of WRITE op {of}: {m}"));
                }
            }
            Want::FetchAdd { old, at } => {
                let got = self.res.read_u64(at).map_err(e("read a result"))?;
                if got != old {
                    return Err(format!(
                        "FETCH_AND_ADD op {op} returned {got}, expected {old} ({})",
                        if got > old {
                            "an earlier add was applied more than once"
                        } else {
                            "an earlier add was lost, or this one was replayed wrongly"
                        }
                    ));
                }
            }
            Want::CompareSwap { old, at } => {
                let got = self.res.read_u64(at).map_err(e("read a result"))?;
                if got != old {
                    return Err(format!(
                        "COMPARE_AND_SWAP op {op} returned {got}, expected {old} (the swap \
                         was applied twice, lost, or replayed with the wrong value)"
                    ));
                }
            }
            _ => {}
        }
        Ok(())
    }
}

fn client(a: &Args, host: &str) -> Res<()> {
    if !sizes_ok(a.depth, a.max_len as u64) {
        return Err(format!(
            "--depth must be 2..=4096, --max-len 8..=1048576 and the server's buffers \
             ((2 × depth + 16) × max-len) at most {} MiB",
            MAX_BUFFERS >> 20
        ));
    }
    let start = Instant::now();
    let deadline = start + Duration::from_secs(a.timeout);
    let dev = Device::open_default().map_err(e("open the device"))?;
    let mut s = connect(host, a.port)?;
    let depth = ring(a.depth);
    let pd = dev.alloc_pd().map_err(e("alloc pd"))?;
    let cq = dev
        .create_cq(2 * depth as u32 + 16, None)
        .map_err(e("create cq"))?;
    let data = pd
        .register(depth * a.max_len, Access::LOCAL_WRITE)
        .map_err(e("register buffers"))?;
    let res = pd
        .register(depth * 8, Access::LOCAL_WRITE)
        .map_err(e("register results"))?;
    // The client only sends, up to `depth` WRs in flight.
    let qp = pd
        .create_qp(&QpInit::new(QpType::Rc, &cq).depth(depth as u32, 1))
        .map_err(e("create qp"))?;
    let me = qp.endpoint();
    let psn = me.psn;
    let hello = Hello {
        qp: me.remote_qp(),
        ops: a.ops,
        seed: a.seed,
        depth: a.depth,
        max_len: a.max_len as u64,
    };
    s.write_all(&hello.to_bytes()).map_err(e("send hello"))?;
    let mut reply = [0u8; 64];
    s.read_exact(&mut reply)
        .map_err(e("read the server's hello"))?;
    let rqp = RemoteQp::from_bytes(reply[..24].try_into().map_err(e("hello"))?);
    let target = RemoteMemory::from_bytes(reply[24..44].try_into().map_err(e("hello"))?);
    let counters = RemoteMemory::from_bytes(reply[44..64].try_into().map_err(e("hello"))?);
    qp.connect_with(&rqp, psn, Access::empty(), &path(a)?)
        .map_err(e("connect"))?;
    let mut ready = [0u8; 1];
    s.read_exact(&mut ready).map_err(e("wait for the server"))?;
    let r = run_client(
        a, &dev, &qp, &cq, &data, &res, target, counters, deadline, start,
    );
    match &r {
        Ok(_) => s.write_all(b"d").map_err(e("tell the server"))?,
        Err(_) => {
            let _ = s.write_all(b"f");
        }
    }
    println!("soak client: {}", stats_line(&dev));
    let counts = r?;
    // The server's verdict on its side (SENDs, memory, counters).
    s.set_read_timeout(Some(
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_secs(5)),
    ))
    .map_err(e("socket"))?;
    let mut l = [0u8; 4];
    s.read_exact(&mut l)
        .map_err(e("read the server's verdict"))?;
    let mut v = vec![0u8; (u32::from_le_bytes(l) as usize).min(1 << 16)];
    s.read_exact(&mut v)
        .map_err(e("read the server's verdict"))?;
    let v = String::from_utf8_lossy(&v);
    if v != "ok" {
        return Err(format!("server: {v}"));
    }
    let el = start.elapsed().as_secs_f64();
    println!(
        "soak client: ok: {} ops ({} WRITE, {} READ, {} SEND, {} FETCH_AND_ADD, {} \
         COMPARE_AND_SWAP) in {el:.2} s, {:.0} ops/s; server checked SENDs, memory and counters",
        counts.iter().sum::<u64>(),
        counts[0],
        counts[1],
        counts[2],
        counts[3],
        counts[4],
        counts.iter().sum::<u64>() as f64 / el
    );
    Ok(())
}

fn connect(host: &str, port: u16) -> Res<TcpStream> {
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        match TcpStream::connect((host, port)) {
            Ok(s) => {
                s.set_read_timeout(Some(Duration::from_secs(30)))
                    .map_err(e("socket"))?;
                return Ok(s);
            }
            Err(err) if Instant::now() > until => return Err(format!("connect: {err}")),
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn run_client(
    a: &Args,
    dev: &Device,
    qp: &QueuePair,
    cq: &CompletionQueue,
    data: &MemoryRegion,
    res: &MemoryRegion,
    target: RemoteMemory,
    counters: RemoteMemory,
    deadline: Instant,
    start: Instant,
) -> Res<[u64; 5]> {
    let depth = ring(a.depth);
    let mut c = Client {
        seed: a.seed,
        max_len: a.max_len,
        data,
        res,
        target,
        counters,
        adds: 0,
        swaps: 0,
        counts: [0; 5],
    };
    let mut sched = Schedule::new(a.seed, depth, a.max_len);
    // Built but not yet posted (a WRITE's READ may wait for room), and posted.
    let mut staged: VecDeque<(SendWr, Want)> = VecDeque::new();
    let mut pending: VecDeque<(u64, Want)> = VecDeque::new();
    let (mut next_op, mut done) = (0u64, 0u64);
    let mut wcs = [WorkCompletion::default(); 32];
    let mut last_report = Instant::now();
    let mut last_done_at = Instant::now();
    let mut peeked: Option<Step> = None;
    // The last step may be a WRITE and its READ that run one past --ops: wait for it too,
    // so nothing is in flight when the server is told the run is over.
    while next_op < a.ops || !staged.is_empty() || !pending.is_empty() {
        loop {
            if staged.is_empty() && next_op < a.ops {
                let step = *peeked.get_or_insert_with(|| sched.next_step());
                // A step is built only when all it posts fits in the window: its local
                // buffers are then free (the ops that used them last have completed).
                if pending.len() as u64 + step.wrs() > a.depth {
                    break;
                }
                peeked = None;
                staged.extend(c.build(step, next_op)?);
                next_op += step.wrs();
            }
            let Some((w, want)) = staged.pop_front() else {
                break;
            };
            let op = w.wr_id;
            qp.post_send(w)
                .map_err(|err| format!("post op {op}: {err}"))?;
            pending.push_back((op, want));
        }
        let n = cq.poll(&mut wcs).map_err(e("poll"))?;
        if n == 0 {
            let now = Instant::now();
            if now > deadline {
                return Err(format!(
                    "timed out after {:.1} s: {done} of {} ops done, {} in flight; last \
                     completion {:.1} s ago; {}",
                    start.elapsed().as_secs_f64(),
                    a.ops.max(next_op),
                    pending.len(),
                    last_done_at.elapsed().as_secs_f64(),
                    stats_line(dev)
                ));
            }
            if a.progress > 0 && last_report.elapsed() >= Duration::from_secs(a.progress) {
                last_report = now;
                println!(
                    "soak client: {done} of {} ops after {:.0} s ({:.0} ops/s); {}",
                    a.ops,
                    start.elapsed().as_secs_f64(),
                    done as f64 / start.elapsed().as_secs_f64(),
                    stats_line(dev)
                );
            }
            // Block briefly in the device rather than spin: the other side and the
            // impairer share the cores.
            match cq.wait(Duration::from_millis(50)) {
                Ok(wc) => {
                    let (op, want) = pending.pop_front().ok_or_else(|| {
                        format!("a completion (wr_id {}) with none posted", wc.wr_id)
                    })?;
                    c.check(&wc, op, want)?;
                    done += 1;
                    last_done_at = Instant::now();
                }
                Err(err) if err.is_timeout() => {}
                Err(err) => return Err(format!("wait: {err}")),
            }
            continue;
        }
        for wc in &wcs[..n] {
            let (op, want) = pending
                .pop_front()
                .ok_or_else(|| format!("a completion (wr_id {}) with none posted", wc.wr_id))?;
            c.check(wc, op, want)?;
            done += 1;
        }
        last_done_at = Instant::now();
    }
    Ok(c.counts)
}

fn main() {
    let a = Args::parse();
    let r = match &a.server {
        None => server(&a),
        Some(h) => client(&a, h),
    };
    if let Err(m) = r {
        let who = if a.server.is_some() {
            "client"
        } else {
            "server"
        };
        eprintln!("soak {who}: FAILED: {m}");
        std::process::exit(1);
    }
}
