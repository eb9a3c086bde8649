//! The engine fuzz harness, shared by the cargo-fuzz target `fuzz/fuzz_targets/engine.rs`
//! and the seeded stable test `tests/engine_fuzz.rs` (both include this file as a module).
//!
//! It lives here, outside the library, so the engine ships no test code and no feature
//! flag: it uses only the public API of `softrdma-transport` and `softrdma-wire`, and the
//! test kit (`softrdma-testkit`: device addresses, buffers, the QP walk to RTS), which
//! both the test and the fuzz crate depend on. Its network is its own, not the kit's
//! `sim`: replays, forged packets and the recorded findings' inputs depend on its
//! schedule, draw for draw.
//!
//! An input is a script: a seed, the network's loss/duplication/reordering rates, then
//! actions (post a work request, let time pass, replay a genuine packet, inject a forged
//! one). Two engines A and B are connected by RC, UC and UD QPs and exchange genuine
//! traffic of every kind; every step is followed by invariant checks:
//!
//! - no panic; no byte outside an MR changes, nor any byte of the READ-only MR;
//! - send completions come in posting order, and an RC one only once the genuine peer's
//!   responses delivered to the QP acknowledge its last PSN;
//! - an RC receive is the peer's next SEND / WRITE_WITH_IMM, exactly once, with its bytes;
//!   UC and UD receives are messages the peer genuinely sent, with their bytes;
//! - RC WRITE data, fetch-add and compare-swap are applied exactly once (counter values,
//!   returned originals, slots rewritten by later WRITEs never reverted);
//! - errors: only RETRY_EXC_ERR (loss can exhaust retries) and the flushes after it;
//! - after a quiet end every work request of a healthy connection has completed.
//!
//! Who may cause what: replays of genuine packets from the genuine address are genuine
//! bytes (a network duplicate, late), so they run in both runs below and must be
//! harmless under the checks above. Forged packets ("attacks") come from an address that
//! is not the genuine sender's (IP, UDP port) pair of the QP they aim at: the peer's IP on
//! another port, another IP, the receiver's own IP. The script runs twice, without and
//! with the attacks, and the two runs must end with identical memory, completions, QP
//! states and genuine packet streams: a packet from a non-genuine address must change
//! nothing. Three things an attacker may legitimately do are kept out of the attacks:
//! spoofing the exact genuine (IP, port) (indistinguishable from the peer on the wire),
//! sending a UD datagram with the right Q_Key (a UD QP takes datagrams from anyone
//! holding its Q_Key, so the forged ones get a wrong Q_Key), and sending from port 4791
//! of a device's IP (QP1 answers its MADs to that IP's port 4791, which would put
//! attacker-caused packets on the genuine link). QP1's own traffic is left out of the
//! comparison, and attacks start after each RC/UC QP has taken a genuine packet (a QP
//! learns its peer's port from the first one, trust on first use).

#![allow(dead_code)]

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashSet, VecDeque};
use std::fmt;
use std::hash::{Hash, Hasher};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use softrdma_testkit::{dev_addr, Mem, Peer, QpCfg};
use softrdma_transport::verbs::{
    Access, AhAttr, AhId, CqId, Gid, MrInfo, Mtu, PdId, QpCap, QpState, QpType, Qpn, RecvWr,
    SendFlags, SendOp, SendWr, Sge, UdDest, WcFlags, WcOpcode, WcStatus, WorkCompletion,
};
use softrdma_transport::Rnic;
use softrdma_wire::{
    self as wire, ext, psn, Aeth, AtomicAckEth, AtomicEth, Deth, Headers, Opcode, Reth, SplitMix64,
    Syndrome,
};

// ---- layout

const MTU: usize = 256;
/// Work requests in flight per QP at most, and slots of each kind per QP.
const SLOTS: usize = 8;
const MAX_MSG: usize = 1024;
const UD_MAX: usize = 256;
const GRH: usize = 40;
const GUARD: usize = 256;
const RSLOT: usize = MAX_MSG + GRH + 24;
/// Per QP type in the local MR: receive, send, READ destination and atomic result slots.
const L_RECV: usize = 0;
const L_SEND: usize = L_RECV + SLOTS * RSLOT;
const L_READ: usize = L_SEND + SLOTS * MAX_MSG;
const L_ATOM: usize = L_READ + SLOTS * MAX_MSG;
const L_PER_T: usize = L_ATOM + SLOTS * 8;
const L_LEN: usize = 3 * L_PER_T;
/// The remote MR: WRITE slots of the RC and the UC peer, then the atomic words.
const R_ATOM: usize = 2 * SLOTS * MAX_MSG;
const R_LEN: usize = R_ATOM + 64;
const RO_LEN: usize = 4096;
const L_OFF: usize = GUARD;
const R_OFF: usize = L_OFF + L_LEN + GUARD;
const RO_OFF: usize = R_OFF + R_LEN + GUARD;
const TOTAL: usize = RO_OFF + RO_LEN + GUARD;

const QKEY: u32 = 0x1111_2222;
/// Where the buffer starts in the I/O address space of its engine.
const IOVA: u64 = 0x7f00_0000_0000;
const RC: usize = 0;
const UC: usize = 1;
const UD: usize = 2;
/// Bound of events one `Tick` processes.
const TICK_EVENTS: usize = 4096;

fn mix(x: u64) -> u64 {
    SplitMix64::new(x).next_u64()
}

/// The bytes of message `key`: distinct for every message the harness sends.
fn pat(key: u64, len: usize) -> Vec<u8> {
    let mut r = SplitMix64::new(key ^ 0x9E37_79B9_7F4A_7C15);
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        v.extend_from_slice(&r.next_u64().to_le_bytes());
    }
    v.truncate(len);
    v
}

/// The compare-swap chain: CAS number k turns `chain(k)` into `chain(k + 1)`.
fn chain(side: usize, k: u64) -> u64 {
    mix((side as u64) << 48 | k | 0xC0DE << 32)
}

fn h64(parts: &[&[u8]]) -> u64 {
    let mut h = DefaultHasher::new();
    for p in parts {
        p.hash(&mut h);
    }
    h.finish()
}

// ---- memory

/// The I/O virtual address of byte `off` of a side's buffer: the same in every run
/// (unlike the heap address), so packets carrying addresses are the same bytes run to run.
fn iova(off: usize) -> u64 {
    IOVA + off as u64
}

// ---- input

/// Reads an input as a stream of bytes, zeros once it runs out.
struct Bytes<'a> {
    data: &'a [u8],
    pos: usize,
}

impl Bytes<'_> {
    fn u8(&mut self) -> u8 {
        let b = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos += 1;
        b
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }
    fn u64(&mut self) -> u64 {
        (0..8).fold(0, |a, i| a | (u64::from(self.u8()) << (8 * i)))
    }
    fn done(&self) -> bool {
        self.pos >= self.data.len()
    }
}

const ATTACK_BYTES: usize = 24;

#[derive(Debug, Clone)]
enum Action {
    Post {
        side: usize,
        t: usize,
        op: u8,
        len: u16,
    },
    Tick {
        kind: u8,
        amount: u8,
    },
    Replay {
        idx: u16,
    },
    Attack([u8; ATTACK_BYTES]),
}

impl Action {
    /// The bytes that decode to this action.
    fn encode(&self, out: &mut Vec<u8>) {
        match *self {
            Action::Post { side, t, op, len } => {
                out.push(((t as u8) << 5) | ((side as u8) << 4));
                out.push(op);
                out.extend_from_slice(&len.to_le_bytes());
            }
            Action::Tick { kind, amount } => out.extend_from_slice(&[5, kind, amount]),
            Action::Replay { idx } => {
                out.push(9);
                out.extend_from_slice(&idx.to_le_bytes());
            }
            Action::Attack(a) => {
                out.push(10);
                out.extend_from_slice(&a);
            }
        }
    }
}

/// A decoded input.
#[derive(Debug, Clone)]
pub struct Script {
    seed: u64,
    fault_bytes: [u8; 3],
    /// Receive buffers kept posted per QP (1..=SLOTS): few make RNR NAKs common.
    recv_depth: usize,
    loss: f64,
    dup: f64,
    reorder: f64,
    actions: Vec<Action>,
}

impl Script {
    /// Decode an input: any bytes make a script of at most `max_steps` actions.
    pub fn decode(data: &[u8], max_steps: usize) -> Script {
        let mut b = Bytes { data, pos: 0 };
        let seed = b.u64();
        let fault_bytes = [b.u8() % 64, b.u8() % 64, b.u8() % 64];
        let loss = f64::from(fault_bytes[0]) / 320.0;
        let dup = f64::from(fault_bytes[1]) / 320.0;
        let reorder = f64::from(fault_bytes[2]) / 200.0;
        let mut actions = Vec::new();
        while !b.done() && actions.len() < max_steps {
            let op = b.u8();
            let a = match op % 16 {
                0..=4 => Action::Post {
                    side: usize::from(op >> 4 & 1),
                    t: usize::from(op >> 5) % 3,
                    op: b.u8(),
                    len: b.u16(),
                },
                5..=8 => Action::Tick {
                    kind: b.u8(),
                    amount: b.u8(),
                },
                9 => Action::Replay { idx: b.u16() },
                _ => {
                    let mut a = [0u8; ATTACK_BYTES];
                    for x in a.iter_mut() {
                        *x = b.u8();
                    }
                    Action::Attack(a)
                }
            };
            actions.push(a);
        }
        Script {
            seed,
            fault_bytes,
            recv_depth: 1 + (mix(seed ^ 0xDE97) % SLOTS as u64) as usize,
            loss,
            dup,
            reorder,
            actions,
        }
    }
    /// Actions in the script.
    pub fn len(&self) -> usize {
        self.actions.len()
    }

    /// A smaller script that still fails under `fails`: the shortest failing prefix,
    /// then without every run of actions (halves, quarters, ... single ones) that is not
    /// needed for the failure, within a bounded number of tries.
    pub fn minimize(&self, fails: impl Fn(&Script) -> bool) -> Script {
        let with = |actions: Vec<Action>| Script {
            actions,
            ..self.clone()
        };
        let tries = std::cell::Cell::new(0u32);
        let fails = |s: &Script| {
            tries.set(tries.get() + 1);
            tries.get() <= 400 && fails(s)
        };
        let (mut lo, mut hi) = (0, self.actions.len());
        while lo < hi {
            let mid = (lo + hi) / 2;
            if fails(&with(self.actions[..mid].to_vec())) {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        let mut cur = self.actions[..hi].to_vec();
        let mut chunk = cur.len().div_ceil(2);
        while chunk >= 1 {
            let mut i = 0;
            while i < cur.len() {
                let mut c = cur.clone();
                c.drain(i..(i + chunk).min(cur.len()));
                if fails(&with(c.clone())) {
                    cur = c;
                } else {
                    i += chunk;
                }
            }
            if chunk == 1 {
                break;
            }
            chunk = chunk.div_ceil(2);
        }
        with(cur)
    }

    /// An input that decodes to this script (for a reproduction or a fuzz corpus).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = self.seed.to_le_bytes().to_vec();
        out.push(self.fault_bytes[0]);
        out.push(self.fault_bytes[1]);
        out.push(self.fault_bytes[2]);
        for a in &self.actions {
            a.encode(&mut out);
        }
        out
    }

    /// The actions, one a line, for a report.
    pub fn describe(&self) -> String {
        let mut out = format!(
            "seed {:#x}, loss {:.3}, duplication {:.3}, reordering {:.3}\n",
            self.seed, self.loss, self.dup, self.reorder
        );
        for (i, a) in self.actions.iter().enumerate() {
            out += &format!("  step {}: {a:?}\n", i + 1);
        }
        let hex: String = self.encode().iter().map(|b| format!("{b:02x}")).collect();
        out += &format!("  input (hex): {hex}\n");
        out
    }
}

// ---- counts

/// What a run did, for a reader to see that it did real work.
#[derive(Debug, Clone, Default)]
pub struct Counts {
    /// Scripts run (each twice: without and with attacks).
    pub scripts: u64,
    /// Actions executed in the attacked runs.
    pub steps: u64,
    /// Work requests posted.
    pub posted: u64,
    /// Completions checked (send and receive).
    pub completions: u64,
    /// Genuine datagrams the engines sent to each other.
    pub genuine: u64,
    /// ... of which the network dropped.
    pub lost: u64,
    /// ... of which the network duplicated.
    pub duplicated: u64,
    /// ... of which the network delayed past later ones.
    pub reordered: u64,
    /// Old genuine datagrams replayed from their genuine address.
    pub replayed: u64,
    /// Forged datagrams injected from non-genuine addresses, by method: from scratch,
    /// mutated genuine headers, genuine bytes from another address, flipped genuine bytes.
    pub injected: [u64; 4],
    /// Datagrams the engines sent to attacker addresses (QP1 answers).
    pub to_attacker: u64,
    /// Forged datagrams in the spoofed runs (a fifth from the genuine address).
    pub spoofed: u64,
    /// Engine counters, both engines, attacked runs: dropped (peer, port, state, QP).
    pub eng_dropped: u64,
    /// Engine: malformed.
    pub eng_malformed: u64,
    /// Engine: duplicates seen by a responder.
    pub eng_duplicates: u64,
    /// Engine: requests ahead of the expected PSN.
    pub eng_out_of_sequence: u64,
    /// Engine: QP1 datagrams dropped or answered.
    pub eng_gsi: u64,
    /// Engine: NAKs sent (sequence, invalid, access, operational, RNR).
    pub eng_naks_sent: u64,
    /// Engine: retransmitted requests.
    pub eng_retransmits: u64,
    /// Engine: local ACK timeouts.
    pub eng_timeouts: u64,
    /// Times a side held its receive buffers back.
    pub holds: u64,
    /// Connections that ended in RETRY_EXC_ERR.
    pub retry_exceeded: u64,
}

impl Counts {
    /// Datagrams handed to an engine: genuine ones sent, replays and injections.
    pub fn packets(&self) -> u64 {
        self.genuine + self.replayed + self.injected.iter().sum::<u64>() + self.spoofed
    }
    /// Add another run's counts.
    pub fn add(&mut self, o: &Counts) {
        self.scripts += o.scripts;
        self.steps += o.steps;
        self.posted += o.posted;
        self.completions += o.completions;
        self.genuine += o.genuine;
        self.lost += o.lost;
        self.duplicated += o.duplicated;
        self.reordered += o.reordered;
        self.replayed += o.replayed;
        for i in 0..4 {
            self.injected[i] += o.injected[i];
        }
        self.to_attacker += o.to_attacker;
        self.spoofed += o.spoofed;
        self.eng_dropped += o.eng_dropped;
        self.eng_malformed += o.eng_malformed;
        self.eng_duplicates += o.eng_duplicates;
        self.eng_out_of_sequence += o.eng_out_of_sequence;
        self.eng_gsi += o.eng_gsi;
        self.eng_naks_sent += o.eng_naks_sent;
        self.eng_retransmits += o.eng_retransmits;
        self.eng_timeouts += o.eng_timeouts;
        self.retry_exceeded += o.retry_exceeded;
        self.holds += o.holds;
    }
}

impl fmt::Display for Counts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inj: u64 = self.injected.iter().sum();
        writeln!(
            f,
            "{} scripts, {} steps, {} WRs posted, {} completions checked",
            self.scripts, self.steps, self.posted, self.completions
        )?;
        writeln!(
            f,
            "{} packets: {} genuine (lost {}, duplicated {}, reordered {}), {} genuine replays, \
             {} injected (scratch {}, mutated {}, re-sourced {}, bit-flipped {}), {} answers to attackers, \
             {} more injected in the spoofed runs",
            self.packets(),
            self.genuine,
            self.lost,
            self.duplicated,
            self.reordered,
            self.replayed,
            inj,
            self.injected[0],
            self.injected[1],
            self.injected[2],
            self.injected[3],
            self.to_attacker,
            self.spoofed
        )?;
        write!(
            f,
            "engines dropped {} (peer/port/state/QP), malformed {}, duplicates {}, out of \
             sequence {}, QP1 {}, NAKs sent {}, retransmits {}, timeouts {}; receive buffers \
             held back {} times; {} connections ran out of retries",
            self.eng_dropped,
            self.eng_malformed,
            self.eng_duplicates,
            self.eng_out_of_sequence,
            self.eng_gsi,
            self.eng_naks_sent,
            self.eng_retransmits,
            self.eng_timeouts,
            self.holds,
            self.retry_exceeded
        )
    }
}

// ---- models

#[derive(Debug, Clone, Copy)]
enum Op {
    Send { key: u64, imm: Option<u32> },
    Write { slot: usize, key: u64 },
    WriteImm { slot: usize, key: u64, imm: u32 },
    Read { slot: usize, off: usize },
    FetchAdd { slot: usize },
    Cas { slot: usize },
}

#[derive(Debug, Clone, Copy)]
struct Posted {
    wr_id: u64,
    op: Op,
    len: usize,
    last_psn: u32,
}

/// A message that consumes a receive WR at the peer.
#[derive(Debug, Clone, Copy)]
struct Msg {
    key: u64,
    len: usize,
    imm: Option<u32>,
    /// WRITE_WITH_IMM: the peer's WRITE slot.
    slot: Option<usize>,
    /// Index of the WRITE in the slot's history.
    write_no: u64,
}

/// One QP's requester and its peer's view of the messages.
#[derive(Debug, Default)]
struct Model {
    next_wr: u64,
    next_psn: u32,
    outstanding: VecDeque<Posted>,
    /// Highest PSN the genuine peer's responses delivered to this QP acknowledge.
    acked: u32,
    /// Messages consuming a receive WR, in posting order.
    msgs: Vec<Msg>,
    /// RC: index in `msgs` of the next receive expected at the peer.
    next_recv: usize,
    /// UC/UD: hashes of messages sent, for receives (which loss and replays reorder).
    sent: HashSet<u64>,
    /// WRITEs posted per peer slot, and the key of the last one.
    slot_writes: [u64; SLOTS],
    slot_key: [Option<(u64, usize)>; SLOTS],
    /// Successful WRITE to each slot last completed (RC).
    slot_done: [Option<(u64, usize)>; SLOTS],
    fa_posted: u64,
    fa_done: u64,
    cas_posted: u64,
    cas_done: u64,
    /// Receive slots posted at this QP.
    recv_posted: [bool; SLOTS],
    /// The QP is failing or failed (completed in error).
    failed: bool,
}

struct Side {
    nic: Rnic,
    pd: PdId,
    qpn: [Qpn; 3],
    scq: [CqId; 3],
    rcq: [CqId; 3],
    l: MrInfo,
    r: MrInfo,
    ro: MrInfo,
    ah: AhId,
    sq_psn: [u32; 3],
}

/// How a run treats the script's attacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Without them: the genuine scenario (with its replays) alone.
    Baseline,
    /// With them, from non-genuine addresses: must end exactly as the baseline.
    Attacked,
    /// With a fifth of them from the genuine sender's exact (IP, port), which the engine
    /// cannot tell from the peer: only what no peer can cause is checked (no panic, no
    /// byte outside an MR, in the READ-only MR or in a send buffer changed, every call
    /// returns), not completions or delivery.
    Spoofed,
}

/// What a run ends with, compared between the runs without and with attacks.
#[derive(Debug, PartialEq)]
pub struct Outcome {
    mem: [Vec<u8>; 2],
    wcs: Vec<(usize, usize, bool, WorkCompletion)>,
    states: Vec<QpState>,
    trace: u64,
    genuine: u64,
}

struct Flight {
    src: SocketAddr,
    dst: SocketAddr,
    data: Vec<u8>,
}

/// One run of a script. Field order: the engines drop before the buffers they write.
struct Run<'s> {
    sides: [Side; 2],
    bufs: [Mem; 2],
    /// Initial contents, for the guards and the READ-only MR.
    init: [Vec<u8>; 2],
    models: [[Model; 3]; 2],
    script: &'s Script,
    mode: Mode,
    /// What the harness last wrote to each QP's send slots (nothing remote may change them).
    send_img: [[Vec<u8>; 3]; 2],
    /// Receive buffers of each side held back instead of posted again.
    rq_hold: [bool; 2],
    /// Print every genuine datagram delivered (`SOFTRDMA_FUZZ_TRACE`).
    trace_packets: bool,
    now: u64,
    seq: u64,
    net: BTreeMap<(u64, u64), Flight>,
    rng: SplitMix64,
    /// Recent genuine datagrams, for replays and mutations.
    ring: VecDeque<Flight>,
    /// PSN of the last genuine datagram delivered to each QP.
    last_psn: [[u32; 3]; 2],
    /// Whether each pair (RC, UC, UD) still runs: posting stops once a side failed.
    pair_failed: [bool; 3],
    trace: DefaultHasher,
    wcs: Vec<(usize, usize, bool, WorkCompletion)>,
    counts: Counts,
    step: usize,
    faults: (f64, f64, f64),
    ops: Vec<Opcode>,
}

/// Every IBTA opcode softrdma implements, and its SACK extension's two.
fn opcodes() -> Vec<Opcode> {
    (0..=255u8)
        .map(Opcode)
        .filter(|&o| o.info().is_some() || o == ext::SACK || o == ext::SACK_PERMIT)
        .collect()
}

fn av(to: usize) -> AhAttr {
    AhAttr::roce(Gid::from_ip(dev_addr(to).ip()), 0)
}

/// The RC, UC and UD QPs: path MTU 256; RC with every remote right, a ~1 ms local ACK
/// timeout, 7 retries and infinite RNR retries; UC with REMOTE_WRITE.
fn qp_cfgs() -> [QpCfg; 3] {
    let rc = QpCfg {
        mtu: Mtu::Mtu256,
        timeout: 8,
        cap: QpCap {
            max_send_wr: 64,
            max_recv_wr: 64,
            max_send_sge: 2,
            max_recv_sge: 2,
            max_inline_data: 64,
        },
        qkey: QKEY,
        ..QpCfg::rc()
    };
    [
        rc,
        QpCfg {
            qp_type: QpType::Uc,
            access: Access::REMOTE_WRITE,
            ..rc
        },
        QpCfg {
            qp_type: QpType::Ud,
            access: Access::empty(),
            ..rc
        },
    ]
}

impl<'s> Run<'s> {
    fn new(script: &'s Script, mode: Mode) -> Run<'s> {
        let seed = script.seed;
        let bufs = [Mem::new(TOTAL), Mem::new(TOTAL)];
        let mut init = [Vec::new(), Vec::new()];
        for (s, b) in bufs.iter().enumerate() {
            let mut bytes = pat(mix(seed ^ (s as u64 + 1)), TOTAL);
            // Atomic words start known: fetch-add counters at 0, compare-swap at chain(0)
            // (the words for the peer of side s sit in side s's memory).
            bytes[R_OFF + R_ATOM..R_OFF + R_ATOM + 8].fill(0);
            bytes[R_OFF + R_ATOM + 8..R_OFF + R_ATOM + 16]
                .copy_from_slice(&chain(1 - s, 0).to_ne_bytes());
            b.write(0, &bytes);
            init[s] = bytes;
        }
        let mut sides: Vec<Side> = Vec::new();
        for (s, buf) in bufs.iter().enumerate() {
            let mut nic = Rnic::new(dev_addr(s), mix(seed ^ 0x5151 ^ s as u64));
            nic.set_active_mtu(Mtu::Mtu1024).expect("port MTU");
            let pd = nic.alloc_pd().expect("pd");
            let reg = |nic: &mut Rnic, off: usize, len: usize, acc: Access| {
                // SAFETY: `buf` outlives the engine (field order of `Run`) and is only
                // accessed by copying; the range is inside it.
                unsafe {
                    nic.reg_mr(pd, buf.ptr().add(off), len, iova(off), acc)
                        .expect("reg_mr")
                }
            };
            let l = reg(&mut nic, L_OFF, L_LEN, Access::LOCAL_WRITE);
            let r = reg(
                &mut nic,
                R_OFF,
                R_LEN,
                Access::LOCAL_WRITE
                    | Access::REMOTE_WRITE
                    | Access::REMOTE_READ
                    | Access::REMOTE_ATOMIC,
            );
            let ro = reg(&mut nic, RO_OFF, RO_LEN, Access::REMOTE_READ);
            let mut qpn = [0; 3];
            let scq: [CqId; 3] =
                std::array::from_fn(|_| nic.create_cq(512, None, false).expect("cq").0);
            let rcq: [CqId; 3] =
                std::array::from_fn(|_| nic.create_cq(512, None, false).expect("cq").0);
            for (t, cfg) in qp_cfgs().iter().enumerate() {
                qpn[t] = nic
                    .create_qp(cfg.create_attr(pd, scq[t], rcq[t], None))
                    .expect("create_qp");
            }
            let ah = nic.create_ah(pd, &av(1 - s)).expect("ah");
            // Start PSNs near the 24-bit wrap now and then.
            let mut sq_psn = [0; 3];
            for (t, p) in sq_psn.iter_mut().enumerate() {
                let r = mix(seed ^ 0x9999 ^ ((s * 3 + t) as u64));
                *p = if r & 1 == 0 {
                    (r >> 8) as u32 & psn::MASK
                } else {
                    psn::MASK - (r >> 8) as u32 % 40
                };
            }
            sides.push(Side {
                nic,
                pd,
                qpn,
                scq,
                rcq,
                l,
                r,
                ro,
                ah,
                sq_psn,
            });
        }
        let sides: [Side; 2] = match sides.try_into() {
            Ok(s) => s,
            Err(_) => unreachable!("two sides"),
        };
        let mut run = Run {
            sides,
            bufs,
            init,
            models: Default::default(),
            script,
            mode,
            send_img: Default::default(),
            rq_hold: [false; 2],
            trace_packets: std::env::var_os("SOFTRDMA_FUZZ_TRACE").is_some(),
            now: 0,
            seq: 0,
            net: BTreeMap::new(),
            rng: SplitMix64::new(mix(seed ^ 0x7777)),
            ring: VecDeque::new(),
            last_psn: [[0; 3]; 2],
            pair_failed: [false; 3],
            trace: DefaultHasher::new(),
            wcs: Vec::new(),
            counts: Counts::default(),
            step: 0,
            faults: (0.0, 0.0, 0.0),
            ops: opcodes(),
        };
        run.connect();
        run
    }

    fn connect(&mut self) {
        for (t, cfg) in qp_cfgs().iter().enumerate() {
            for s in 0..2 {
                let p = 1 - s;
                let peer = (t != UD).then(|| Peer {
                    av: av(p),
                    qpn: self.sides[p].qpn[t],
                    psn: self.sides[p].sq_psn[t],
                });
                let (now, qpn, sq_psn) = (self.now, self.sides[s].qpn[t], self.sides[s].sq_psn[t]);
                let nic = &mut self.sides[s].nic;
                cfg.walk_to_rts(peer.as_ref(), sq_psn, |a, m| nic.modify_qp(now, qpn, a, m));
                let m = &mut self.models[s][t];
                m.next_psn = sq_psn;
                m.acked = psn::sub(m.next_psn, 1);
                self.last_psn[p][t] = m.next_psn;
            }
        }
        for s in 0..2 {
            self.refill_recvs(s);
        }
    }

    fn violation(&self, msg: String) -> ! {
        panic!(
            "engine fuzz invariant broken (seed {:#x}, {}, {:?} run): {msg}",
            self.script.seed,
            match self.step {
                0 => "warm-up".to_string(),
                usize::MAX => "after the last step".to_string(),
                n => format!("step {n}"),
            },
            self.mode
        )
    }

    fn l_off(t: usize, area: usize, slot: usize) -> usize {
        let size = if area == L_RECV {
            RSLOT
        } else if area == L_ATOM {
            8
        } else {
            MAX_MSG
        };
        L_OFF + t * L_PER_T + area + slot * size
    }

    fn sge(&self, s: usize, off: usize, len: usize) -> Vec<Sge> {
        if len == 0 {
            return Vec::new();
        }
        vec![Sge {
            addr: iova(off),
            length: len as u32,
            lkey: self.sides[s].l.lkey,
        }]
    }

    fn post_recv(&mut self, s: usize, t: usize, k: usize) {
        let off = Self::l_off(t, L_RECV, k);
        // A marker, so a receive never passes with bytes left from an earlier one.
        self.bufs[s].write(off, &[0xEE; RSLOT]);
        let wr = RecvWr {
            wr_id: k as u64,
            sg_list: self.sge(s, off, RSLOT),
        };
        let (now, qpn) = (self.now, self.sides[s].qpn[t]);
        self.sides[s]
            .nic
            .post_recv(now, qpn, wr)
            .unwrap_or_else(|e| panic!("post_recv: {e}"));
        self.models[s][t].recv_posted[k] = true;
    }

    // ---- actions

    fn post(&mut self, s: usize, t: usize, op: u8, len: u16) {
        let p = 1 - s;
        if self.pair_failed[t] || self.models[s][t].outstanding.len() >= SLOTS {
            return;
        }
        let m = &self.models[s][t];
        let idx = m.next_wr;
        let slot = (idx % SLOTS as u64) as usize;
        let key = mix(self.script.seed ^ ((s as u64) << 60 | (t as u64) << 56 | idx));
        let imm = (key as u32) | 1;
        let mut len = usize::from(len) % (MAX_MSG + 1);
        let kinds = [7u8, 4, 2][t];
        let r_base = self.sides[p].r.addr;
        let r_rkey = self.sides[p].r.rkey;
        let wslot = |m: &Model| (m.slot_writes.iter().sum::<u64>() % SLOTS as u64) as usize;
        let (op, send_op) = match op % kinds {
            0 | 1 => {
                if t == UD {
                    len %= UD_MAX + 1;
                }
                let imm = (op % kinds == 1).then_some(imm);
                let sop = match imm {
                    Some(imm) => SendOp::SendWithImm { imm },
                    None => SendOp::Send,
                };
                (Op::Send { key, imm }, sop)
            }
            2 => {
                let ws = wslot(m);
                (
                    Op::Write { slot: ws, key },
                    SendOp::Write {
                        remote_addr: r_base + (t * SLOTS * MAX_MSG + ws * MAX_MSG) as u64,
                        rkey: r_rkey,
                    },
                )
            }
            3 => {
                let ws = wslot(m);
                (
                    Op::WriteImm { slot: ws, key, imm },
                    SendOp::WriteWithImm {
                        remote_addr: r_base + (t * SLOTS * MAX_MSG + ws * MAX_MSG) as u64,
                        rkey: r_rkey,
                        imm,
                    },
                )
            }
            4 => {
                let off = usize::from(op >> 3) * 8 % RO_LEN;
                len = len.min(RO_LEN - off);
                (
                    Op::Read { slot, off },
                    SendOp::Read {
                        remote_addr: self.sides[p].ro.addr + off as u64,
                        rkey: self.sides[p].ro.rkey,
                    },
                )
            }
            5 => {
                len = 8;
                (
                    Op::FetchAdd { slot },
                    SendOp::FetchAdd {
                        remote_addr: r_base + R_ATOM as u64,
                        rkey: r_rkey,
                        add: 1,
                    },
                )
            }
            _ => {
                len = 8;
                let k = m.cas_posted;
                (
                    Op::Cas { slot },
                    SendOp::CompareSwap {
                        remote_addr: r_base + R_ATOM as u64 + 8,
                        rkey: r_rkey,
                        compare: chain(s, k),
                        swap: chain(s, k + 1),
                    },
                )
            }
        };
        let sg_list = match op {
            Op::Send { key, .. } | Op::Write { key, .. } | Op::WriteImm { key, .. } => {
                let off = Self::l_off(t, L_SEND, slot);
                let data = pat(key, len);
                self.bufs[s].write(off, &data);
                let img = &mut self.send_img[s][t];
                if img.is_empty() {
                    *img = self.init[s][Self::l_off(t, L_SEND, 0)..][..SLOTS * MAX_MSG].to_vec();
                }
                img[slot * MAX_MSG..][..len].copy_from_slice(&data);
                self.sge(s, off, len)
            }
            Op::Read { slot, .. } => {
                let off = Self::l_off(t, L_READ, slot);
                self.bufs[s].write(off, &vec![0xDD; MAX_MSG]);
                self.sge(s, off, len)
            }
            Op::FetchAdd { slot } | Op::Cas { slot } => {
                let off = Self::l_off(t, L_ATOM, slot);
                self.bufs[s].write(off, &[0xDD; 8]);
                self.sge(s, off, 8)
            }
        };
        let ud = (t == UD).then(|| UdDest {
            ah: self.sides[s].ah,
            remote_qpn: self.sides[p].qpn[UD],
            remote_qkey: QKEY,
        });
        let wr = SendWr {
            wr_id: idx,
            op: send_op,
            flags: SendFlags::SIGNALED,
            sg_list,
            inline_data: None,
            ud,
        };
        let (now, qpn) = (self.now, self.sides[s].qpn[t]);
        if let Err(e) = self.sides[s].nic.post_send(now, qpn, wr) {
            self.violation(format!("post_send side {s} type {t} refused: {e}"));
        }
        self.counts.posted += 1;
        let m = &mut self.models[s][t];
        m.next_wr += 1;
        let npkts = match op {
            Op::FetchAdd { .. } | Op::Cas { .. } => 1,
            _ => len.div_ceil(MTU).max(1) as u32,
        };
        let last_psn = psn::add(m.next_psn, npkts - 1);
        if t != UD {
            m.next_psn = psn::add(m.next_psn, npkts);
        }
        m.outstanding.push_back(Posted {
            wr_id: idx,
            op,
            len,
            last_psn,
        });
        match op {
            Op::Send { key, imm } => {
                m.msgs.push(Msg {
                    key,
                    len,
                    imm,
                    slot: None,
                    write_no: 0,
                });
                m.sent
                    .insert(h64(&[&pat(key, len), &imm.unwrap_or(0).to_le_bytes()]));
            }
            Op::Write { slot, key } | Op::WriteImm { slot, key, .. } => {
                m.slot_writes[slot] += 1;
                m.slot_key[slot] = Some((key, len));
                if let Op::WriteImm { imm, .. } = op {
                    m.msgs.push(Msg {
                        key,
                        len,
                        imm: Some(imm),
                        slot: Some(slot),
                        write_no: m.slot_writes[slot],
                    });
                    m.sent.insert(h64(&[&imm.to_le_bytes()]));
                }
            }
            Op::FetchAdd { .. } => m.fa_posted += 1,
            Op::Cas { .. } => m.cas_posted += 1,
            Op::Read { .. } => {}
        }
    }

    /// Let time pass by the action's amount, delivering datagrams and firing timers in
    /// time order.
    fn tick(&mut self, kind: u8, amount: u8) {
        if kind & 0xF0 == 0xF0 {
            // Hold back (or give back) a side's receive buffers, so senders meet RNR NAKs
            // (RC) and drops (UC, UD).
            let s = usize::from(kind >> 2 & 1);
            self.rq_hold[s] = !self.rq_hold[s];
            self.counts.holds += u64::from(self.rq_hold[s]);
            if !self.rq_hold[s] {
                self.refill_recvs(s);
            }
        }
        let target = match kind % 4 {
            0 => self.now,
            1 => self.now + u64::from(amount) * 100,
            2 => self.now + u64::from(amount) * 10_000,
            _ => self.next_event().unwrap_or(self.now),
        };
        self.run_until(target);
    }

    fn next_event(&self) -> Option<u64> {
        let f = self.net.keys().next().map(|k| k.0);
        let t = self.sides.iter().filter_map(|s| s.nic.poll_timeout()).min();
        match (f, t) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn run_until(&mut self, target: u64) {
        for _ in 0..TICK_EVENTS {
            let Some(at) = self.next_event() else { break };
            if at > target {
                break;
            }
            self.now = self.now.max(at);
            let due_flight = self.net.keys().next().is_some_and(|k| k.0 <= self.now);
            if due_flight {
                let (_, f) = self.net.pop_first().expect("a flight");
                self.deliver_genuine(f);
            } else {
                for s in 0..2 {
                    if self.sides[s]
                        .nic
                        .poll_timeout()
                        .is_some_and(|d| d <= self.now)
                    {
                        let now = self.now;
                        self.sides[s].nic.handle_timeout(now);
                    }
                }
            }
            self.collect();
        }
        self.now = self.now.max(target);
    }

    fn side_of(addr: SocketAddr) -> Option<usize> {
        (0..2).find(|&s| dev_addr(s) == addr)
    }

    /// Deliver a genuine datagram (sent by an engine, or replayed from its sender).
    fn deliver_genuine(&mut self, f: Flight) {
        let Some(d) = Self::side_of(f.dst) else {
            return;
        };
        if let Ok((h, _)) = Headers::parse(&f.data) {
            if h.bth.dest_qp != wire::cm::GSI_QPN {
                self.trace.write_u64(self.now);
                self.trace.write(&f.data);
                if let Some(t) = self.sides[d].qpn.iter().position(|&q| q == h.bth.dest_qp) {
                    self.last_psn[d][t] = h.bth.psn;
                    if t == RC {
                        self.note_ack(d, &h);
                    }
                }
            }
        }
        if self.trace_packets {
            if let Ok((h, p)) = Headers::parse(&f.data) {
                eprintln!(
                    "t={} step {} -> side {d} {}: psn {:#x} qp {:#x} ack_req {} aeth {:?} reth {:?} len {}",
                    self.now,
                    self.step,
                    h.bth.opcode,
                    h.bth.psn,
                    h.bth.dest_qp,
                    h.bth.ack_req,
                    h.aeth,
                    h.reth.map(|r| r.dma_len),
                    p.len()
                );
            }
        }
        let now = self.now;
        self.sides[d]
            .nic
            .handle_datagram(now, f.src, f.dst, &f.data);
    }

    /// A genuine response to side `d`'s RC requester: what it acknowledges.
    fn note_ack(&mut self, d: usize, h: &Headers) {
        let op = h.bth.opcode;
        let upto = if op == Opcode::RC_ACKNOWLEDGE {
            match h.aeth.map(|a| a.syndrome) {
                Some(Syndrome::Ack { .. }) => h.bth.psn,
                Some(_) => psn::sub(h.bth.psn, 1),
                None => return,
            }
        } else if op == Opcode::RC_ATOMIC_ACKNOWLEDGE
            || op == Opcode::RC_RDMA_READ_RESPONSE_FIRST
            || op == Opcode::RC_RDMA_READ_RESPONSE_MIDDLE
            || op == Opcode::RC_RDMA_READ_RESPONSE_LAST
            || op == Opcode::RC_RDMA_READ_RESPONSE_ONLY
        {
            h.bth.psn
        } else {
            return;
        };
        let m = &mut self.models[d][RC];
        // Only acknowledgements inside what was sent count (a stale one says nothing).
        if psn::gt(upto, m.acked) && psn::lt(upto, m.next_psn) {
            m.acked = upto;
        }
    }

    /// Take what the engines want to send and put it on the network.
    fn collect(&mut self) {
        for s in 0..2 {
            for _ in 0..100_000 {
                let now = self.now;
                let Some(t) = self.sides[s].nic.poll_transmit(now) else {
                    break;
                };
                if Self::side_of(t.dst).is_none() {
                    self.counts.to_attacker += 1;
                    continue;
                }
                let gsi = Headers::parse(&t.data)
                    .map(|(h, _)| h.bth.dest_qp == wire::cm::GSI_QPN)
                    .unwrap_or(false);
                let f = Flight {
                    src: t.src,
                    dst: t.dst,
                    data: t.data,
                };
                if gsi {
                    // QP1 traffic is the attacker's doing (answers to forged MADs sent from
                    // a device's IP): the genuine scenario has none, so it never reaches
                    // the other engine, where it would take network fates and time.
                    self.counts.to_attacker += 1;
                    continue;
                }
                self.counts.genuine += 1;
                self.ring.push_back(Flight {
                    src: f.src,
                    dst: f.dst,
                    data: f.data.clone(),
                });
                if self.ring.len() > 512 {
                    self.ring.pop_front();
                }
                let (loss, dup, reorder) = self.faults;
                if self.rng.chance(loss) {
                    self.counts.lost += 1;
                    continue;
                }
                let copies = if self.rng.chance(dup) {
                    self.counts.duplicated += 1;
                    2
                } else {
                    1
                };
                for _ in 0..copies {
                    let mut delay = 1_000 + self.rng.up_to(500);
                    if self.rng.chance(reorder) {
                        self.counts.reordered += 1;
                        delay += 5_000 + self.rng.up_to(50_000);
                    }
                    let copy = Flight {
                        src: f.src,
                        dst: f.dst,
                        data: f.data.clone(),
                    };
                    self.send_at(self.now + delay, copy);
                }
            }
        }
    }

    fn send_at(&mut self, at: u64, f: Flight) {
        self.seq += 1;
        self.net.insert((at, self.seq), f);
    }

    fn replay(&mut self, idx: u16) {
        if self.ring.is_empty() {
            return;
        }
        let i = usize::from(idx) % self.ring.len();
        let f = &self.ring[i];
        let f = Flight {
            src: f.src,
            dst: f.dst,
            data: f.data.clone(),
        };
        self.counts.replayed += 1;
        self.deliver_genuine(f);
    }

    // ---- the attacker

    fn pick_va(&self, d: usize, b: u8) -> u64 {
        let sd = &self.sides[d];
        let base = match b % 8 {
            0 => sd.l.addr,
            1 | 2 => sd.r.addr,
            3 => sd.ro.addr,
            4 => iova(0),
            5 => sd.r.addr + R_LEN as u64,
            6 => sd.ro.addr + RO_LEN as u64,
            _ => self.sides[1 - d].r.addr,
        };
        base.wrapping_add(u64::from(b >> 3) * 8).wrapping_sub(64)
    }

    fn pick_rkey(&self, d: usize, b: u8, rnd: u32) -> u32 {
        let sd = &self.sides[d];
        match b % 6 {
            0 => sd.l.rkey,
            1 | 2 => sd.r.rkey,
            3 => sd.ro.rkey,
            4 => self.sides[1 - d].r.rkey,
            _ => rnd,
        }
    }

    /// Give `h` exactly the extension headers its opcode carries, filled from `a`.
    fn fit(&self, h: &mut Headers, d: usize, a: &[u8; ATTACK_BYTES]) {
        let Some(info) = h.bth.opcode.info() else {
            return;
        };
        let rnd = u32::from_le_bytes([a[16], a[17], a[18], a[19]]);
        if info.has_reth != h.reth.is_some() {
            h.reth = info.has_reth.then(|| Reth {
                va: self.pick_va(d, a[12]),
                rkey: self.pick_rkey(d, a[13], rnd),
                dma_len: u32::from(a[14]) * 8,
            });
        }
        if info.has_atomic_eth != h.atomic_eth.is_some() {
            h.atomic_eth = info.has_atomic_eth.then(|| AtomicEth {
                va: self.pick_va(d, a[12]) & !7,
                rkey: self.pick_rkey(d, a[13], rnd),
                swap_add: u64::from(rnd),
                compare: chain(1 - d, u64::from(a[15] % 4)),
            });
        }
        if info.has_aeth != h.aeth.is_some() {
            h.aeth = info.has_aeth.then(|| Aeth {
                syndrome: Syndrome::from_byte(a[14]).unwrap_or(Syndrome::Ack { credits: 31 }),
                msn: u32::from(a[15]),
            });
        }
        if info.has_atomic_ack_eth != h.atomic_ack.is_some() {
            h.atomic_ack = info.has_atomic_ack_eth.then_some(AtomicAckEth {
                orig: u64::from(rnd),
            });
        }
        if info.has_immdt != h.imm.is_some() {
            h.imm = info.has_immdt.then_some(rnd);
        }
        if info.has_ieth != h.ieth.is_some() {
            h.ieth = info.has_ieth.then(|| self.pick_rkey(d, a[13], rnd));
        }
        if info.has_deth != h.deth.is_some() {
            h.deth = info.has_deth.then(|| Deth {
                qkey: rnd,
                src_qp: self.sides[1 - d].qpn[UD],
            });
        }
    }

    /// Emit, sealed for `src` -> `dst`, trimming the payload until the opcode takes it.
    fn emit(h: &Headers, payload: &[u8], src: SocketAddr, dst: SocketAddr) -> Option<Vec<u8>> {
        let mut plen = payload.len();
        loop {
            let mut buf = vec![0u8; h.packet_len(plen)];
            match h.emit(&payload[..plen], &mut buf) {
                Ok(n) => {
                    buf.truncate(n);
                    wire::icrc::seal(&wire::Addrs::new(src, dst), &mut buf);
                    return Some(buf);
                }
                Err(wire::Error::BadPad) if plen % 4 != 0 => plen -= plen % 4,
                Err(wire::Error::BadLength) if plen > 0 => plen = 0,
                Err(_) => return None,
            }
        }
    }

    fn attack(&mut self, a: &[u8; ATTACK_BYTES]) {
        let mut method = usize::from(a[5] % 4);
        let mut d = usize::from(a[0] & 1);
        let genuine = if method > 0 && !self.ring.is_empty() {
            let i = usize::from(u16::from_le_bytes([a[6], a[7]])) % self.ring.len();
            let f = &self.ring[i];
            d = Self::side_of(f.dst).unwrap_or(d);
            Some(f.data.clone())
        } else {
            method = 0;
            None
        };
        let rnd = u32::from_le_bytes([a[16], a[17], a[18], a[19]]);
        let delta = a[10] as i8;
        let near = |x: u32| {
            if delta >= 0 {
                psn::add(x, delta as u32)
            } else {
                psn::sub(x, u32::from(delta.unsigned_abs()))
            }
        };
        match (method, genuine) {
            (1, Some(g)) => {
                let Ok((mut h, pl)) = Headers::parse(&g) else {
                    return;
                };
                let mut pl = pl.to_vec();
                match a[9] % 11 {
                    0 => h.bth.psn = near(h.bth.psn),
                    1 => h.bth.dest_qp = self.sides[d].qpn[usize::from(a[2] % 3)],
                    2 => h.bth.opcode = self.ops[usize::from(a[12]) % self.ops.len()],
                    3 => {
                        if let Some(r) = h.reth.as_mut() {
                            r.va = self.pick_va(d, a[12]);
                        }
                    }
                    4 => {
                        if let Some(r) = h.reth.as_mut() {
                            r.rkey = self.pick_rkey(d, a[13], rnd);
                        }
                    }
                    5 => {
                        if let Some(r) = h.reth.as_mut() {
                            r.dma_len = r
                                .dma_len
                                .wrapping_add(u32::from(a[14]) * 4)
                                .wrapping_sub(256);
                        }
                    }
                    6 => {
                        if let Some(x) = h.aeth.as_mut() {
                            x.syndrome = Syndrome::from_byte(a[14]).unwrap_or(x.syndrome);
                        }
                    }
                    7 => {
                        if let Some(x) = h.aeth.as_mut() {
                            x.msn = near(x.msn) & psn::MASK;
                        }
                    }
                    8 => pl.resize(usize::from(a[4]) * 4, 0x5A),
                    9 => {
                        if let Some(x) = h.atomic_eth.as_mut() {
                            x.va = self.pick_va(d, a[12]) & !7;
                            x.swap_add = u64::from(rnd);
                        }
                        if let Some(x) = h.atomic_ack.as_mut() {
                            x.orig ^= u64::from(rnd);
                        }
                    }
                    _ => {
                        h.bth.psn = near(h.bth.psn);
                        h.bth.opcode = self.ops[usize::from(a[12]) % self.ops.len()];
                    }
                }
                self.fit(&mut h, d, a);
                self.send_forged(d, h, &pl, a, 1);
            }
            (2 | 3, Some(mut g)) => {
                // Genuine bytes from another address: as they are, or with bits flipped.
                if method == 3 && g.len() > 4 {
                    for i in 0..3 {
                        let pos = usize::from(u16::from_le_bytes([a[9 + 2 * i], a[10 + 2 * i]]));
                        let at = pos % (g.len() - 4);
                        g[at] ^= 1 << (a[15 + i] % 8);
                    }
                }
                if let Ok((h, pl)) = Headers::parse(&g) {
                    if h.deth.is_some_and(|x| x.qkey == QKEY) {
                        let pl = pl.to_vec();
                        self.send_forged(d, h, &pl, a, method);
                        return;
                    }
                }
                let dest = wire::BthView::new_checked(&g)
                    .map(|v| v.dest_qp())
                    .unwrap_or(0);
                let (src, dst) = self.attacker_addrs(d, dest, a);
                wire::icrc::seal(&wire::Addrs::new(src, dst), &mut g);
                self.inject(d, src, g, method);
            }
            _ => {
                let p = 1 - d;
                let dest = match a[1] % 8 {
                    t @ 0..=2 => self.sides[d].qpn[usize::from(t)],
                    3 => self.sides[d].qpn[RC],
                    4 => rnd & psn::MASK,
                    5 => wire::cm::GSI_QPN,
                    6 => self.sides[d].qpn[usize::from(a[2] % 3)] ^ 1,
                    _ => self.sides[p].qpn[usize::from(a[2] % 3)],
                };
                let base = self.sides[d]
                    .qpn
                    .iter()
                    .position(|&q| q == dest)
                    .map_or(rnd >> 8, |t| self.last_psn[d][t]);
                let op = self.ops[usize::from(a[9]) % self.ops.len()];
                let mut bth = wire::Bth::new(op, dest, near(base) & psn::MASK);
                bth.ack_req = a[11] & 1 != 0;
                bth.solicited = a[11] & 2 != 0;
                if a[11] & 0x80 != 0 {
                    bth.pkey = rnd as u16;
                }
                let mut h = Headers::new(bth);
                self.fit(&mut h, d, a);
                let plen = match a[3] % 4 {
                    0 => 0,
                    1 => usize::from(a[4]) * 4 % (MTU + 4),
                    2 => MTU,
                    _ => usize::from(a[4]) * 8,
                };
                self.send_forged(d, h, &pat(u64::from(rnd), plen), a, 0);
            }
        }
    }

    fn send_forged(
        &mut self,
        d: usize,
        mut h: Headers,
        payload: &[u8],
        a: &[u8; ATTACK_BYTES],
        method: usize,
    ) {
        let (src, dst) = self.attacker_addrs(d, h.bth.dest_qp, a);
        if ext::is_vendor(h.bth.opcode) {
            // A SACK (its bitmap from the payload) or SACK_PERMIT, sealed like any packet.
            let m = if h.bth.opcode == ext::SACK {
                let mut bits = ext::SackBitmap::default();
                for (x, y) in bits.0.iter_mut().zip(payload) {
                    *x = *y;
                }
                ext::Ext::Sack(h.bth, bits)
            } else {
                ext::Ext::SackPermit(h.bth)
            };
            let mut buf = vec![0u8; m.len()];
            if m.emit(&mut buf).is_ok() {
                wire::icrc::seal(&wire::Addrs::new(src, dst), &mut buf);
                self.inject(d, src, buf, method);
            }
            return;
        }
        Self::deny_qkey(&mut h);
        if let Some(b) = Self::emit(&h, payload, src, dst) {
            self.inject(d, src, b, method);
        }
    }

    /// A UD QP takes a datagram from anyone holding its Q_Key: forged ones get another.
    fn deny_qkey(h: &mut Headers) {
        if let Some(x) = h.deth.as_mut() {
            if x.qkey == QKEY {
                x.qkey ^= 1;
            }
        }
    }

    /// A source that is not the genuine sender's (IP, port) for QP `dest` of side `d`,
    /// and not port 4791 of a device's IP.
    fn attacker_addrs(
        &self,
        d: usize,
        dest: u32,
        a: &[u8; ATTACK_BYTES],
    ) -> (SocketAddr, SocketAddr) {
        let p = 1 - d;
        let port = u16::from_le_bytes([a[20], a[21]]);
        let peer_ip = dev_addr(p).ip();
        let mut src = match a[8] % 5 {
            0 | 1 => SocketAddr::new(peer_ip, port),
            2 => SocketAddr::new(
                peer_ip,
                wire::udp_src_port(self.sides[p].qpn[usize::from(a[22] % 3)]),
            ),
            3 => SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 3 + a[22] % 200)), port),
            _ => SocketAddr::new(dev_addr(d).ip(), port),
        };
        let genuine = self.sides[d]
            .qpn
            .iter()
            .position(|&q| q == dest)
            .filter(|&t| t != UD)
            .map(|t| SocketAddr::new(peer_ip, wire::udp_src_port(self.sides[p].qpn[t])));
        if self.mode == Mode::Spoofed && a[23] % 5 == 0 {
            if let Some(g) = genuine {
                return (g, dev_addr(d));
            }
        }
        if Some(src) == genuine || src.port() == 4791 {
            src.set_port(src.port().wrapping_add(1).max(1024));
            if Some(src) == genuine || src.port() == 4791 {
                src.set_port(src.port() + 1);
            }
        }
        (src, dev_addr(d))
    }

    fn inject(&mut self, d: usize, src: SocketAddr, data: Vec<u8>, method: usize) {
        if self.mode == Mode::Baseline {
            return;
        }
        if std::env::var_os("SOFTRDMA_FUZZ_LOG").is_some() {
            eprintln!(
                "step {} t={}: inject (method {method}) {src} -> side {d}: {:?}",
                self.step,
                self.now,
                Headers::parse(&data).map(|(h, p)| (h, p.len()))
            );
        }
        self.counts.injected[method] += 1;
        let now = self.now;
        self.sides[d]
            .nic
            .handle_datagram(now, src, dev_addr(d), &data);
    }

    // ---- checks

    fn poll_all(&mut self) {
        for s in 0..2 {
            for t in 0..3 {
                for recv in [false, true] {
                    let cq = if recv {
                        self.sides[s].rcq[t]
                    } else {
                        self.sides[s].scq[t]
                    };
                    let mut buf = [WorkCompletion::default(); 32];
                    loop {
                        let n = self.sides[s].nic.poll_cq(cq, &mut buf).expect("poll_cq");
                        for wc in &buf[..n] {
                            self.counts.completions += 1;
                            self.wcs.push((s, t, recv, *wc));
                            if self.mode == Mode::Spoofed {
                                self.absorb(s, t, recv, wc);
                            } else if recv {
                                self.check_recv(s, t, wc);
                            } else {
                                self.check_send(s, t, wc);
                            }
                        }
                        if n < buf.len() {
                            break;
                        }
                    }
                }
            }
        }
    }

    /// Spoofed run: a completion is whatever forged packets made it; keep the receive
    /// queues full and stop posting where the QP failed.
    fn absorb(&mut self, s: usize, t: usize, recv: bool, wc: &WorkCompletion) {
        if wc.status != WcStatus::Success {
            self.models[s][t].failed = true;
            self.pair_failed[t] = true;
        }
        if recv {
            let k = wc.wr_id as usize;
            if k < SLOTS {
                self.models[s][t].recv_posted[k] = false;
                if !self.models[s][t].failed && !self.rq_hold[s] {
                    self.post_recv(s, t, k);
                }
            }
        } else {
            self.models[s][t].outstanding.pop_front();
        }
    }

    fn fail_pair(&mut self, s: usize, t: usize) {
        if !self.models[s][t].failed {
            self.models[s][t].failed = true;
            if !self.pair_failed[t] {
                self.counts.retry_exceeded += 1;
            }
            self.pair_failed[t] = true;
        }
    }

    fn check_send(&mut self, s: usize, t: usize, wc: &WorkCompletion) {
        let p = 1 - s;
        let qpn = self.sides[s].qpn[t];
        let Some(w) = self.models[s][t].outstanding.pop_front() else {
            self.violation(format!(
                "side {s} type {t}: send completion with nothing outstanding: {wc:?}"
            ));
        };
        if wc.wr_id != w.wr_id || wc.qp_num != qpn {
            self.violation(format!(
                "side {s} type {t}: send completion out of posting order: expected wr {} got {wc:?}",
                w.wr_id
            ));
        }
        match wc.status {
            WcStatus::Success => {}
            WcStatus::RetryExcErr if t == RC && !self.models[s][t].failed => {
                self.fail_pair(s, t);
                return;
            }
            WcStatus::WrFlushErr if self.models[s][t].failed => return,
            st => self.violation(format!(
                "side {s} type {t}: send completion with {st:?} (wr {}, {:?}), which neither \
                 loss nor a replay can cause: {wc:?}",
                w.wr_id, w.op
            )),
        }
        if self.models[s][t].failed {
            self.violation(format!(
                "side {s} type {t}: success after the QP failed: {wc:?}"
            ));
        }
        let m = &self.models[s][t];
        if t == RC && !psn::le(w.last_psn, m.acked) {
            self.violation(format!(
                "side {s} RC: wr {} ({:?}) completed but the peer's genuine responses delivered \
                 acknowledge only up to PSN {:#x}, not its last PSN {:#x}",
                w.wr_id, w.op, m.acked, w.last_psn
            ));
        }
        let (op, len) = match w.op {
            Op::Send { .. } => (WcOpcode::Send, w.len),
            Op::Write { .. } | Op::WriteImm { .. } => (WcOpcode::RdmaWrite, w.len),
            Op::Read { .. } => (WcOpcode::RdmaRead, w.len),
            Op::FetchAdd { .. } => (WcOpcode::FetchAdd, 8),
            Op::Cas { .. } => (WcOpcode::CompSwap, 8),
        };
        if wc.opcode != op || wc.byte_len as usize != len {
            self.violation(format!(
                "side {s} type {t}: completion {wc:?} for {:?} of {len} bytes",
                w.op
            ));
        }
        if t != RC {
            return;
        }
        let rbase = R_OFF + t * SLOTS * MAX_MSG;
        match w.op {
            Op::Write { slot, key } | Op::WriteImm { slot, key, .. } => {
                let got = self.bufs[p].read(rbase + slot * MAX_MSG, w.len);
                if got != pat(key, w.len) {
                    self.violation(format!(
                        "side {s} RC: WRITE wr {} completed but the peer's slot {slot} does not hold its bytes",
                        w.wr_id
                    ));
                }
                self.models[s][t].slot_done[slot] = Some((key, w.len));
            }
            Op::Read { slot, off } => {
                let got = self.bufs[s].read(Self::l_off(t, L_READ, slot), w.len);
                if got != self.init[p][RO_OFF + off..RO_OFF + off + w.len] {
                    self.violation(format!(
                        "side {s} RC: READ wr {} returned other bytes than the peer's",
                        w.wr_id
                    ));
                }
            }
            Op::FetchAdd { slot } => {
                let orig = self.bufs[s].read_u64(Self::l_off(t, L_ATOM, slot));
                let m = &mut self.models[s][t];
                if orig != m.fa_done {
                    let n = m.fa_done;
                    self.violation(format!(
                        "side {s} RC: fetch-add wr {} returned {orig}, expected {n} (applied other than exactly once)",
                        w.wr_id
                    ));
                }
                m.fa_done += 1;
            }
            Op::Cas { slot } => {
                let orig = self.bufs[s].read_u64(Self::l_off(t, L_ATOM, slot));
                let m = &mut self.models[s][t];
                let exp = chain(s, m.cas_done);
                if orig != exp {
                    self.violation(format!(
                        "side {s} RC: compare-swap wr {} returned {orig:#x}, expected {exp:#x} (applied other than exactly once)",
                        w.wr_id
                    ));
                }
                m.cas_done += 1;
            }
            Op::Send { .. } => {}
        }
    }

    fn check_recv(&mut self, s: usize, t: usize, wc: &WorkCompletion) {
        let p = 1 - s;
        let k = wc.wr_id as usize;
        if k >= SLOTS || !self.models[s][t].recv_posted[k] || wc.qp_num != self.sides[s].qpn[t] {
            self.violation(format!(
                "side {s} type {t}: receive completion for no posted receive: {wc:?}"
            ));
        }
        self.models[s][t].recv_posted[k] = false;
        match wc.status {
            WcStatus::Success => {}
            WcStatus::WrFlushErr if self.models[s][t].failed => return,
            st => self.violation(format!(
                "side {s} type {t}: receive completion with {st:?}: {wc:?}"
            )),
        }
        let off = Self::l_off(t, L_RECV, k);
        let imm = wc
            .wc_flags
            .contains(WcFlags::WITH_IMM)
            .then_some(wc.imm_data);
        let len = wc.byte_len as usize;
        match t {
            RC => {
                let m = &self.models[p][t];
                let Some(&msg) = m.msgs.get(m.next_recv) else {
                    self.violation(format!("side {s} RC: a receive completion beyond every message the peer posted: {wc:?}"));
                };
                let exp_op = if msg.slot.is_some() {
                    WcOpcode::RecvRdmaWithImm
                } else {
                    WcOpcode::Recv
                };
                if wc.opcode != exp_op || len != msg.len || imm != msg.imm {
                    self.violation(format!(
                        "side {s} RC: receive {wc:?} is not the peer's next message (number {}, {msg:?})",
                        m.next_recv
                    ));
                }
                let got = match msg.slot {
                    None => self.bufs[s].read(off, len),
                    Some(slot) => self.bufs[s].read(R_OFF + slot * MAX_MSG, len),
                };
                let fresh = msg
                    .slot
                    .map_or(true, |slot| m.slot_writes[slot] == msg.write_no);
                if fresh && got != pat(msg.key, len) {
                    self.violation(format!(
                        "side {s} RC: receive of message {} holds other bytes",
                        m.next_recv
                    ));
                }
                self.models[p][t].next_recv += 1;
            }
            UC => {
                let m = &self.models[p][t];
                let h = if wc.opcode == WcOpcode::RecvRdmaWithImm {
                    h64(&[&imm.unwrap_or(0).to_le_bytes()])
                } else {
                    h64(&[
                        &self.bufs[s].read(off, len),
                        &imm.unwrap_or(0).to_le_bytes(),
                    ])
                };
                if !m.sent.contains(&h) {
                    self.violation(format!(
                        "side {s} UC: received a message the peer never sent: {wc:?}"
                    ));
                }
            }
            _ => {
                let m = &self.models[p][t];
                let h = len.checked_sub(GRH).map(|l| {
                    h64(&[
                        &self.bufs[s].read(off + GRH, l),
                        &imm.unwrap_or(0).to_le_bytes(),
                    ])
                });
                if wc.opcode != WcOpcode::Recv || !h.is_some_and(|h| m.sent.contains(&h)) {
                    self.violation(format!(
                        "side {s} UD: received a datagram the peer never sent: {wc:?}"
                    ));
                }
            }
        }
        if !self.models[s][t].failed && !self.rq_hold[s] {
            self.post_recv(s, t, k);
        }
    }

    fn refill_recvs(&mut self, s: usize) {
        for t in 0..3 {
            for k in 0..self.script.recv_depth {
                if !self.models[s][t].failed && !self.models[s][t].recv_posted[k] {
                    self.post_recv(s, t, k);
                }
            }
        }
    }

    /// Bytes outside the MRs, and the READ-only MR, as they started.
    fn check_memory(&self) {
        for s in 0..2 {
            for (from, to, what) in [
                (0, L_OFF, "guard before the local MR"),
                (
                    L_OFF + L_LEN,
                    R_OFF,
                    "guard between the local and the remote MR",
                ),
                (
                    R_OFF + R_LEN,
                    RO_OFF,
                    "guard between the remote and the READ-only MR",
                ),
                (RO_OFF, RO_OFF + RO_LEN, "READ-only MR"),
                (RO_OFF + RO_LEN, TOTAL, "guard after the READ-only MR"),
            ] {
                let got = self.bufs[s].read(from, to - from);
                if got[..] != self.init[s][from..to] {
                    let i = got
                        .iter()
                        .zip(&self.init[s][from..to])
                        .position(|(a, b)| a != b)
                        .unwrap_or(0);
                    self.violation(format!("side {s}: the {what} changed (byte {i} of it)"));
                }
            }
            for t in 0..3 {
                let img = &self.send_img[s][t];
                let off = Self::l_off(t, L_SEND, 0);
                if !img.is_empty() && self.bufs[s].read(off, img.len()) != *img {
                    self.violation(format!("side {s} type {t}: a send buffer changed"));
                }
            }
            // Nothing genuine writes the spare atomic words (a spoofed WRITE may).
            let spare = R_OFF + R_ATOM + 16;
            if self.mode != Mode::Spoofed
                && self.bufs[s].read(spare, 48)[..] != self.init[s][spare..spare + 48]
            {
                self.violation(format!(
                    "side {s}: bytes of the remote MR no operation targets changed"
                ));
            }
        }
    }

    /// With no loss and nothing injected, let everything finish, then check the totals.
    fn quiesce(&mut self) {
        self.faults = (0.0, 0.0, 0.0);
        for s in 0..2 {
            self.rq_hold[s] = false;
            self.refill_recvs(s);
        }
        for _ in 0..200 {
            let Some(at) = self.next_event() else { break };
            self.run_until(at.max(self.now) + 1_000_000);
            self.poll_all();
        }
        self.poll_all();
        if self.mode == Mode::Spoofed {
            return;
        }
        for s in 0..2 {
            for t in 0..3 {
                let m = &self.models[s][t];
                if self.pair_failed[t] {
                    continue;
                }
                if !m.outstanding.is_empty() {
                    self.violation(format!(
                        "side {s} type {t}: {} work requests never completed on a healthy connection (first {:?})",
                        m.outstanding.len(),
                        m.outstanding.front()
                    ));
                }
                if t != RC {
                    continue;
                }
                let p = 1 - s;
                let fa = self.bufs[p].read_u64(R_OFF + R_ATOM);
                let cas = self.bufs[p].read_u64(R_OFF + R_ATOM + 8);
                if fa != m.fa_posted || cas != chain(s, m.cas_posted) {
                    self.violation(format!(
                        "side {s} RC: after {} fetch-adds and {} compare-swaps the peer holds {fa} and {cas:#x}",
                        m.fa_posted, m.cas_posted
                    ));
                }
                for slot in 0..SLOTS {
                    if let Some((key, len)) = m.slot_key[slot] {
                        if self.bufs[p].read(R_OFF + slot * MAX_MSG, len) != pat(key, len) {
                            self.violation(format!(
                                "side {s} RC: the peer's WRITE slot {slot} lost its last WRITE"
                            ));
                        }
                    }
                }
            }
        }
        for t in [RC] {
            for s in 0..2 {
                if !self.pair_failed[t]
                    && self.models[s][t].next_recv != self.models[s][t].msgs.len()
                {
                    self.violation(format!(
                        "side {} RC: received {} of the {} messages the peer sent",
                        1 - s,
                        self.models[s][t].next_recv,
                        self.models[s][t].msgs.len()
                    ));
                }
            }
        }
    }

    fn execute(mut self) -> (Outcome, Counts) {
        // Warm-up: each RC and UC QP takes a genuine packet, so it knows its peer's port
        // before anything is injected.
        for s in 0..2 {
            self.post(s, RC, 0, 8);
            self.post(s, UC, 0, 8);
        }
        self.collect();
        self.run_until(self.now + 100_000);
        self.poll_all();
        self.faults = (self.script.loss, self.script.dup, self.script.reorder);
        for (i, a) in self.script.actions.iter().enumerate() {
            self.step = i + 1;
            match *a {
                Action::Post { side, t, op, len } => self.post(side, t, op, len),
                Action::Tick { kind, amount } => self.tick(kind, amount),
                Action::Replay { idx } => self.replay(idx),
                Action::Attack(ref b) => self.attack(b),
            }
            // Whatever the engines queued goes on the wire now, in both runs alike.
            self.collect();
            self.poll_all();
            // Holds stay short: with loss, each RNR round trip risks a transport retry,
            // and a long hold ends connections in RETRY_EXC_ERR, after which little is
            // left to check.
            if i % 32 == 31 {
                for s in 0..2 {
                    if std::mem::take(&mut self.rq_hold[s]) {
                        self.refill_recvs(s);
                    }
                }
            }
            self.check_memory();
        }
        self.step = usize::MAX;
        self.quiesce();
        self.check_memory();
        let mut states = Vec::new();
        for s in 0..2 {
            for t in 0..3 {
                states.push(
                    self.sides[s]
                        .nic
                        .query_qp(self.sides[s].qpn[t])
                        .expect("query_qp")
                        .qp_state,
                );
            }
            let st = self.sides[s].nic.stats();
            let c = &mut self.counts;
            c.eng_dropped += st.dropped;
            c.eng_malformed += st.malformed;
            c.eng_duplicates += st.duplicates;
            c.eng_out_of_sequence += st.out_of_sequence;
            c.eng_gsi += st.gsi_dropped + st.gsi_unserved;
            c.eng_naks_sent += st.naks_sent_seq
                + st.naks_sent_inv
                + st.naks_sent_access
                + st.naks_sent_op
                + st.rnr_naks_sent;
            c.eng_retransmits += st.retransmits;
            c.eng_timeouts += st.timeouts;
        }
        self.counts.steps = self.script.actions.len() as u64;
        self.counts.scripts = 1;
        let out = Outcome {
            mem: [self.bufs[0].read(0, TOTAL), self.bufs[1].read(0, TOTAL)],
            wcs: std::mem::take(&mut self.wcs),
            states,
            trace: self.trace.finish(),
            genuine: self.counts.genuine,
        };
        (out, self.counts.clone())
    }
}

/// Run `script` once, with or without its attacks; panics when an invariant breaks.
pub fn run_once(script: &Script, mode: Mode) -> (Outcome, Counts) {
    Run::new(script, mode).execute()
}

/// Run `script` without and with its attacks, check the invariants in both, and require
/// that the attacks changed nothing. Returns the counts of the attacked run.
pub fn run(script: &Script) -> Counts {
    let (base, _) = run_once(script, Mode::Baseline);
    let (attacked, mut counts) = run_once(script, Mode::Attacked);
    let (_, spoofed) = run_once(script, Mode::Spoofed);
    counts.spoofed = spoofed.injected.iter().sum();
    if base != attacked {
        let what = if base.mem != attacked.mem {
            let s = usize::from(base.mem[0] == attacked.mem[0]);
            let i = base.mem[s]
                .iter()
                .zip(&attacked.mem[s])
                .position(|(a, b)| a != b)
                .unwrap_or(0);
            format!("memory of side {s} at offset {i}")
        } else if base.wcs != attacked.wcs {
            let i = base
                .wcs
                .iter()
                .zip(&attacked.wcs)
                .position(|(a, b)| a != b)
                .unwrap_or(base.wcs.len().min(attacked.wcs.len()));
            format!(
                "completion {i}: without attacks {:?}, with {:?}",
                base.wcs.get(i),
                attacked.wcs.get(i)
            )
        } else if base.states != attacked.states {
            format!(
                "QP states: without attacks {:?}, with {:?}",
                base.states, attacked.states
            )
        } else {
            format!(
                "the genuine packet stream ({} vs {} packets)",
                base.genuine, attacked.genuine
            )
        };
        panic!(
            "engine fuzz invariant broken (seed {:#x}): packets from non-genuine addresses changed {what}",
            script.seed
        );
    }
    counts
}
