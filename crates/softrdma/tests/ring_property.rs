//! Property test over seeds for the same-host path: two devices of this process joined by
//! same-host rings (and, for comparison, by loopback UDP) run random batches of RC SENDs,
//! WRITEs, READs and atomics, some large enough to fill a ring many times over (so its
//! sender holds datagrams and offers them again). Every operation completes once, in
//! order, with the bytes, immediates and atomic results a sequential model predicts, and
//! the target ends equal to the model.
//!
//! Each case prints its seed. Reproduce one with
//! `SOFTRDMA_PROPTEST_SEED=<seed> SOFTRDMA_PROPTEST_CASES=1 cargo test -p softrdma --test ring_property`.

use std::time::Duration;

use softrdma::*;

mod support;
use support::{Rng, ALL};

const T: Duration = Duration::from_secs(30);
const SRC_LEN: usize = 1 << 20;
const TGT_LEN: usize = 256 * 1024;
/// An atomics-only word, out of reach of WRITEs.
const COUNTER: usize = TGT_LEN - 64;
const BATCH: usize = 32;
/// Largest SEND or WRITE: 64 KiB, 64 packets at MTU 1024.
const MAX_LEN: usize = 64 * 1024;
/// Largest READ: 192 KiB. The responder streams the responses of 16 such READs at once,
/// three rings' worth at MTU 1024, so the target's ring to the requester fills.
const READ_MAX: usize = 192 * 1024;

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    let v = v.trim();
    let parsed = match v.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => v.parse(),
    };
    Some(parsed.unwrap_or_else(|_| panic!("{name}={v} is not a number")))
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut r = Rng(seed | 1);
    (0..len).map(|_| r.next() as u8).collect()
}

fn word(m: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(m[off..off + 8].try_into().unwrap())
}

enum Kind {
    Send { imm: Option<u32> },
    Write { dst: usize, imm: Option<u32> },
    Read { off: usize, expect: Vec<u8> },
    FetchAdd { add: u64, orig: u64 },
    CompareSwap { compare: u64, swap: u64, orig: u64 },
}

struct Op {
    kind: Kind,
    src: usize,
    len: usize,
    /// Waits for the READs before it: a READ's responses are read out of the target as
    /// they are sent, so a later WRITE to the same bytes may otherwise reach them first
    /// (as the IBTA allows; a fence is how a program orders them).
    fence: bool,
}

fn gen_len(rng: &mut Rng) -> usize {
    match rng.below(4) {
        0 => rng.below(64) as usize,
        1 => rng.below(4096) as usize,
        _ => (MAX_LEN / 2 + rng.below(MAX_LEN as u64 / 2 + 1) as usize).min(MAX_LEN),
    }
}

/// The next op; `reads` holds the byte ranges of the READs since the last fence.
fn gen_op(rng: &mut Rng, src: &[u8], model: &mut [u8], reads: &mut Vec<(usize, usize)>) -> Op {
    let len = gen_len(rng);
    let from = rng.below((SRC_LEN - len) as u64 + 1) as usize;
    let imm = rng.chance(0.3).then(|| rng.next() as u32);
    let kind = match rng.below(10) {
        0..=2 => Kind::Send { imm },
        3..=5 => {
            let dst = rng.below((COUNTER - len) as u64 + 1) as usize;
            model[dst..dst + len].copy_from_slice(&src[from..from + len]);
            Kind::Write { dst, imm }
        }
        6..=7 => {
            let len = if rng.chance(0.5) {
                len
            } else {
                READ_MAX / 2 + rng.below(READ_MAX as u64 / 2 + 1) as usize
            };
            let off = rng.below((COUNTER - len) as u64 + 1) as usize;
            reads.push((off, off + len));
            return Op {
                kind: Kind::Read {
                    off,
                    expect: model[off..off + len].to_vec(),
                },
                src: 0,
                len,
                fence: false,
            };
        }
        8 => {
            let add = rng.below(1000);
            let orig = word(model, COUNTER);
            model[COUNTER..COUNTER + 8].copy_from_slice(&orig.wrapping_add(add).to_le_bytes());
            Kind::FetchAdd { add, orig }
        }
        _ => {
            let orig = word(model, COUNTER);
            let compare = if rng.chance(0.5) { orig } else { orig ^ 1 };
            let swap = rng.next();
            if compare == orig {
                model[COUNTER..COUNTER + 8].copy_from_slice(&swap.to_le_bytes());
            }
            Kind::CompareSwap {
                compare,
                swap,
                orig,
            }
        }
    };
    let touched = match kind {
        Kind::Write { dst, .. } => Some((dst, dst + len)),
        Kind::FetchAdd { .. } | Kind::CompareSwap { .. } => Some((COUNTER, COUNTER + 8)),
        _ => None,
    };
    let fence = touched.is_some_and(|(lo, hi)| reads.iter().any(|&(a, b)| lo < b && a < hi));
    if fence {
        reads.clear();
    }
    let len = if matches!(kind, Kind::FetchAdd { .. } | Kind::CompareSwap { .. }) {
        8
    } else {
        len
    };
    Op {
        kind,
        src: from,
        len,
        fence,
    }
}

fn device(name: &str, shm: bool) -> Device {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut cfg = DeviceConfig::new(&format!("{name}{n}"), DeviceAddr::AutoLoopback(4791));
    cfg.shm = shm;
    cfg.stats_dir = None;
    Device::open_with(&cfg).expect("open device")
}

fn run_case(seed: u64, ops: usize, shm: bool) {
    let tag = format!(
        "seed {seed:#x} over {}",
        if shm { "same-host rings" } else { "UDP" }
    );
    eprintln!("case: {tag}");
    let mut rng = Rng(seed | 1);
    let (da, db) = (device("ring-prop-a", shm), device("ring-prop-b", shm));
    let (pa, pb) = (da.alloc_pd().unwrap(), db.alloc_pd().unwrap());
    let (cqa, cqb) = (
        da.create_cq(1024, None).unwrap(),
        db.create_cq(1024, None).unwrap(),
    );
    let depth = 2 * BATCH as u32;
    let qa = pa
        .create_qp(&QpInit::new(QpType::Rc, &cqa).depth(depth, depth))
        .unwrap();
    let qb = pb
        .create_qp(&QpInit::new(QpType::Rc, &cqb).depth(depth, depth))
        .unwrap();
    let o = PathOptions {
        mtu: if rng.chance(0.5) {
            Mtu::Mtu1024
        } else {
            Mtu::Mtu4096
        },
        max_rd_atomic: 16,
        max_dest_rd_atomic: 16,
        ..PathOptions::default()
    };
    qa.connect_to_with(&qb.endpoint(), ALL, &o).unwrap();
    qb.connect_to_with(&qa.endpoint(), ALL, &o).unwrap();

    let src_data = pattern(seed ^ 1, SRC_LEN);
    let src = pa.register(SRC_LEN, ALL).unwrap();
    src.write(0, &src_data).unwrap();
    let mut model = pattern(seed ^ 2, TGT_LEN);
    let tgt = pb.register(TGT_LEN, ALL).unwrap();
    tgt.write(0, &model).unwrap();
    let remote = tgt.remote();
    let rdst = pa.register(BATCH * READ_MAX, ALL).unwrap();
    let rq = pb.register(BATCH * MAX_LEN, ALL).unwrap();

    let mut done = 0;
    let mut reads = Vec::new();
    while done < ops {
        let n = BATCH.min(ops - done);
        let batch: Vec<Op> = (0..n)
            .map(|_| gen_op(&mut rng, &src_data, &mut model, &mut reads))
            .collect();
        let base = done as u64;
        // Receives first, one slot each, in the order the messages will come.
        let mut slots = Vec::new();
        for (k, op) in batch.iter().enumerate() {
            if matches!(
                op.kind,
                Kind::Send { .. } | Kind::Write { imm: Some(_), .. }
            ) {
                let s = slots.len();
                qb.post_recv(wr::recv(
                    base + k as u64,
                    [rq.sge(s * MAX_LEN..(s + 1) * MAX_LEN).unwrap()],
                ))
                .unwrap();
                slots.push(k);
            }
        }
        for (k, op) in batch.iter().enumerate() {
            let id = base + k as u64;
            let sg = src.sge(op.src..op.src + op.len).unwrap();
            let res = rdst.sge(k * READ_MAX..k * READ_MAX + op.len).unwrap();
            let mut w = match op.kind {
                Kind::Send { imm: None } => wr::send(id, [sg]),
                Kind::Send { imm: Some(i) } => wr::send_with_imm(id, [sg], i),
                Kind::Write { dst, imm: None } => wr::write(id, [sg], &remote, dst as u64).unwrap(),
                Kind::Write { dst, imm: Some(i) } => {
                    wr::write_with_imm(id, [sg], &remote, dst as u64, i).unwrap()
                }
                Kind::Read { off, .. } => wr::read(id, [res], &remote, off as u64).unwrap(),
                Kind::FetchAdd { add, .. } => {
                    wr::fetch_add(id, res, &remote, COUNTER as u64, add).unwrap()
                }
                Kind::CompareSwap { compare, swap, .. } => {
                    wr::compare_swap(id, res, &remote, COUNTER as u64, compare, swap).unwrap()
                }
            };
            if op.fence {
                w.flags |= SendFlags::FENCE;
            }
            qa.post_send(w).unwrap();
        }
        // The requester's completions: every one, once, in order.
        for (k, op) in batch.iter().enumerate() {
            let wc = cqa.wait(T).unwrap_or_else(|e| panic!("{tag}: op {k}: {e}"));
            assert_eq!(
                (wc.wr_id, wc.status),
                (base + k as u64, WcStatus::Success),
                "{tag}: {wc:?}"
            );
            let got = rdst.to_vec(k * READ_MAX, op.len).unwrap();
            match &op.kind {
                Kind::Read { expect, .. } => assert!(got == *expect, "{tag}: READ {k} bytes"),
                Kind::FetchAdd { orig, .. } | Kind::CompareSwap { orig, .. } => {
                    assert_eq!(word(&got, 0), *orig, "{tag}: atomic {k} result")
                }
                _ => {}
            }
        }
        // The target's receive completions: in order, with their bytes and immediates.
        for (s, &k) in slots.iter().enumerate() {
            let wc = cqb
                .wait(T)
                .unwrap_or_else(|e| panic!("{tag}: recv {s}: {e}"));
            let op = &batch[k];
            assert_eq!(
                (wc.wr_id, wc.status),
                (base + k as u64, WcStatus::Success),
                "{tag}: {wc:?}"
            );
            match op.kind {
                Kind::Send { imm } => {
                    assert_eq!(wc.byte_len as usize, op.len, "{tag}");
                    assert_eq!(wc.wc_flags.contains(WcFlags::WITH_IMM), imm.is_some());
                    if let Some(i) = imm {
                        assert_eq!(wc.imm_data, i, "{tag}");
                    }
                    let got = rq.to_vec(s * MAX_LEN, op.len).unwrap();
                    assert!(got == src_data[op.src..op.src + op.len], "{tag}: SEND {k}");
                }
                Kind::Write { imm: Some(i), .. } => {
                    assert_eq!(wc.opcode, WcOpcode::RecvRdmaWithImm, "{tag}");
                    assert_eq!(wc.imm_data, i, "{tag}");
                }
                _ => unreachable!(),
            }
        }
        done += n;
        // Every READ of the batch has completed.
        reads.clear();
    }
    assert!(
        tgt.to_vec(0, TGT_LEN).unwrap() == model,
        "{tag}: target memory differs from the model"
    );
    let (sa, sb) = (da.stats(), db.stats());
    eprintln!(
        "{tag}: ring datagrams {}+{}, held {}+{}, retransmits {}+{}, placed WRITEs {} (taken {}), READs {}",
        sa.driver.shm_sent_datagrams,
        sb.driver.shm_sent_datagrams,
        sa.link.tx_held,
        sb.link.tx_held,
        sa.engine.retransmits,
        sb.engine.retransmits,
        sa.engine.placed_writes,
        sb.engine.placed_writes_taken,
        sa.engine.placed_reads
    );
    if shm {
        // Everything went through the rings, and nothing waited so long it was dropped.
        assert_eq!(
            (sa.driver.sent_datagrams, sb.driver.sent_datagrams),
            (0, 0),
            "{tag}"
        );
        assert_eq!((sa.link.tx_held_expired, sb.link.tx_held_expired), (0, 0));
        // WRITEs went straight into the target's memory (those with immediate data with a
        // placed WRITE through the ring for the target to take), and READs out of it.
        assert!(sa.engine.placed_writes > 0, "{tag}: no WRITE was placed");
        assert!(sa.engine.placed_reads > 0, "{tag}: no READ was placed");
        assert!(
            sb.engine.placed_writes_taken <= sa.engine.placed_writes,
            "{tag}"
        );
    } else {
        assert_eq!(
            (sa.driver.shm_sent_datagrams, sb.driver.shm_sent_datagrams),
            (0, 0)
        );
    }
}

fn seeds(default_cases: u64) -> Vec<u64> {
    let cases = env_u64("SOFTRDMA_PROPTEST_CASES").unwrap_or(default_cases);
    let first = env_u64("SOFTRDMA_PROPTEST_SEED").unwrap_or_else(|| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap();
        t.as_nanos() as u64 ^ u64::from(std::process::id())
    });
    (0..cases)
        .map(|i| first.wrapping_add(i.wrapping_mul(0x9E37_79B9_7F4A_7C15)))
        .collect()
}

#[test]
fn rc_exactly_once_in_order_over_rings() {
    for seed in seeds(4) {
        run_case(seed, 192, true);
    }
}

#[test]
fn rc_exactly_once_in_order_over_udp() {
    for seed in seeds(1) {
        run_case(seed, 192, false);
    }
}
