//! Property tests over seeds: under loss, reordering, duplication and corruption at
//! once, RC delivers every operation exactly once and in order, applies every atomic
//! once, and leaves target memory equal to a model the test keeps.
//!
//! Each case prints its seed first. Reproduce one with
//! `SOFTRDMA_PROPTEST_SEED=<seed> SOFTRDMA_PROPTEST_CASES=1 cargo test -p softrdma-transport --test property`.
//! `SOFTRDMA_PROPTEST_CASES` raises the number of cases, `SOFTRDMA_PROPTEST_OPS` the
//! operations per case.

use common::*;
use softrdma_testkit as common;

use common::Rng;
use proptest::prelude::*;

fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => {
            let v = v.trim();
            let parsed = if let Some(hex) = v.strip_prefix("0x") {
                u64::from_str_radix(hex, 16)
            } else {
                v.parse()
            };
            parsed.unwrap_or_else(|_| panic!("{name}={v} is not a number"))
        }
        Err(_) => default,
    }
}

const LW: Access = Access::LOCAL_WRITE;
const BATCH: usize = 32;
const SRC_LEN: usize = 64 * 1024;
const TGT_LEN: usize = 16 * 1024;
/// FAA-only counter and CAS-only word, at the end of the target, out of reach of WRITEs.
const COUNTER: usize = TGT_LEN - 64;
const CASWORD: usize = TGT_LEN - 56;

#[derive(Debug, Clone)]
enum Kind {
    Send {
        imm: Option<u32>,
    },
    Write {
        dst: usize,
        imm: Option<u32>,
    },
    Read {
        off: usize,
        expect: Vec<u8>,
    },
    Cas {
        off: usize,
        compare: u64,
        swap: u64,
        orig: u64,
    },
    Faa {
        off: usize,
        add: u64,
        orig: u64,
    },
}

#[derive(Debug, Clone)]
struct Op {
    id: u64,
    kind: Kind,
    src: usize,
    len: usize,
    fence: bool,
}

impl Op {
    fn consumes_recv(&self) -> bool {
        matches!(
            self.kind,
            Kind::Send { .. } | Kind::Write { imm: Some(_), .. }
        )
    }
    fn short(&self) -> String {
        let k = match &self.kind {
            Kind::Send { imm } => format!("SEND imm={imm:?}"),
            Kind::Write { dst, imm } => format!("WRITE dst={dst} imm={imm:?}"),
            Kind::Read { off, .. } => format!("READ off={off}"),
            Kind::Cas {
                off,
                compare,
                swap,
                orig,
            } => {
                format!("CAS off={off} cmp={compare:#x} swap={swap:#x} orig={orig:#x}")
            }
            Kind::Faa { off, add, orig } => format!("FAA off={off} add={add:#x} orig={orig:#x}"),
        };
        format!("op {} {k} len={} fence={}", self.id, self.len, self.fence)
    }
}

/// Uniform in `0..=max`.
fn up_to(rng: &mut Rng, max: usize) -> usize {
    rng.up_to(max as u64) as usize
}

fn gen_len(rng: &mut Rng, mtu: usize) -> usize {
    let max = 3 * mtu + 1;
    if rng.chance(0.35) {
        let k = up_to(rng, 3) * mtu;
        let d = up_to(rng, 2);
        (k + d).saturating_sub(1).min(max)
    } else {
        up_to(rng, max)
    }
}

fn word(model: &[u8], off: usize) -> u64 {
    u64::from_ne_bytes(model[off..off + 8].try_into().unwrap())
}

fn set_word(model: &mut [u8], off: usize, v: u64) {
    model[off..off + 8].copy_from_slice(&v.to_ne_bytes());
}

/// Generate one op, apply it to the model, and decide its FENCE: a modifying op that
/// overlaps a READ posted since the last fence must wait for it (a retried READ is
/// executed again, and may otherwise see the later write — allowed by the spec).
#[allow(clippy::too_many_arguments)]
fn gen_op(
    rng: &mut Rng,
    id: u64,
    mtu: usize,
    src: &[u8],
    model: &mut [u8],
    reads: &mut Vec<(usize, usize)>,
    faa_sum: &mut u64,
) -> Op {
    let len = gen_len(rng, mtu);
    let src_off = up_to(rng, SRC_LEN - len);
    let pick = rng.below(100);
    let overlaps = |reads: &Vec<(usize, usize)>, lo: usize, hi: usize| {
        reads.iter().any(|&(a, b)| lo < b && a < hi)
    };
    let rand_word = |rng: &mut Rng| up_to(rng, COUNTER / 8 - 1) * 8;
    let (kind, len, lo_hi) = if pick < 20 {
        (Kind::Send { imm: None }, len, None)
    } else if pick < 30 {
        (
            Kind::Send {
                imm: Some(rng.next_u64() as u32),
            },
            len,
            None,
        )
    } else if pick < 55 {
        let imm = if pick < 45 {
            None
        } else {
            Some(rng.next_u64() as u32)
        };
        let dst = up_to(rng, COUNTER - len);
        model[dst..dst + len].copy_from_slice(&src[src_off..src_off + len]);
        (Kind::Write { dst, imm }, len, Some((dst, dst + len)))
    } else if pick < 75 {
        let off = up_to(rng, TGT_LEN - len);
        let expect = model[off..off + len].to_vec();
        reads.push((off, off + len));
        (Kind::Read { off, expect }, len, None)
    } else if pick < 87 {
        let off = if rng.chance(0.7) {
            CASWORD
        } else {
            rand_word(rng)
        };
        let orig = word(model, off);
        let compare = if rng.chance(0.6) {
            orig
        } else {
            rng.next_u64()
        };
        let swap = rng.next_u64();
        if orig == compare {
            set_word(model, off, swap);
        }
        (
            Kind::Cas {
                off,
                compare,
                swap,
                orig,
            },
            8,
            Some((off, off + 8)),
        )
    } else {
        let off = if rng.chance(0.7) {
            COUNTER
        } else {
            rand_word(rng)
        };
        let add = if rng.chance(0.5) {
            rng.below(1000)
        } else {
            rng.next_u64()
        };
        let orig = word(model, off);
        set_word(model, off, orig.wrapping_add(add));
        if off == COUNTER {
            *faa_sum = faa_sum.wrapping_add(add);
        }
        (Kind::Faa { off, add, orig }, 8, Some((off, off + 8)))
    };
    let mut fence = false;
    if let Some((lo, hi)) = lo_hi {
        // The READs are checked against the model before this op applied to it: the
        // model was updated above already, but `reads` only holds earlier READs.
        if overlaps(reads, lo, hi) {
            fence = true;
            reads.clear();
        }
    }
    Op {
        id,
        kind,
        src: src_off,
        len,
        fence,
    }
}

fn run_case(seed: u64, n_ops: usize) {
    let mut rng = test_rng(seed);
    let mtu = if rng.chance(0.5) {
        Mtu::Mtu256
    } else {
        Mtu::Mtu1024
    };
    let m = mtu.bytes();
    let max_len = 3 * m + 1;
    let faults = Faults {
        loss: 0.10,
        duplicate: 0.05,
        reorder: 0.10,
        corrupt: 0.02,
        delay_ns: 1_000,
        jitter_ns: 2_000,
        reorder_extra_ns: 20_000,
    };
    let mut w = World::new(2, seed, faults);
    let cfg = QpCfg {
        mtu,
        timeout: 8, // ~1 ms
        retry_cnt: 7,
        rnr_retry: 7,
        max_rd_atomic: 8,
        max_dest_rd_atomic: 8,
        cap: QpCap {
            max_send_wr: 64,
            max_recv_wr: 64,
            max_send_sge: 2,
            max_recv_sge: 2,
            max_inline_data: 0,
        },
        ..QpCfg::rc()
    };
    let psn = |rng: &mut Rng| {
        if rng.chance(0.5) {
            0xFF_FFFF - rng.below(3000) as u32
        } else {
            rng.below(1 << 24) as u32
        }
    };
    let (a_psn, b_psn) = (psn(&mut rng), psn(&mut rng));
    let (a, b) = w.pair_psn(&cfg, &cfg, a_psn, b_psn);
    let tag = format!("seed {seed:#x} (mtu {m}, psn a {a_psn:#x} b {b_psn:#x})");

    let src_data = pattern(seed ^ 1, SRC_LEN);
    let src = w.mr(0, a.pd, SRC_LEN, LW, 0);
    src.write(0, &src_data);
    let all = LW | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
    let tgt = w.mr(1, b.pd, TGT_LEN, all, 0);
    let mut model = pattern(seed ^ 2, TGT_LEN);
    tgt.write(0, &model);
    let counter0 = word(&model, COUNTER);
    let rdst = w.mr(0, a.pd, BATCH * max_len, LW, 0);
    let ares = w.mr(0, a.pd, BATCH * 8, LW, 0);
    let rq = w.mr(1, b.pd, BATCH * max_len, LW, 0);

    let mut faa_sum = 0u64;
    let mut next_id = 0u64;
    let mut kinds = [0usize; 5];
    while (next_id as usize) < n_ops {
        let n = BATCH.min(n_ops - next_id as usize);
        let mut reads = Vec::new();
        let ops: Vec<Op> = (0..n)
            .map(|_| {
                next_id += 1;
                gen_op(
                    &mut rng,
                    next_id,
                    m,
                    &src_data,
                    &mut model,
                    &mut reads,
                    &mut faa_sum,
                )
            })
            .collect();
        // Receives first, in op order, one slot each.
        let mut n_recv = 0;
        for op in ops.iter().filter(|o| o.consumes_recv()) {
            w.post_recv(&b, rwr(op.id, vec![rq.sge(n_recv * max_len, max_len)]));
            n_recv += 1;
        }
        for (slot, op) in ops.iter().enumerate() {
            let sg = sgl(&src, op.src, op.len);
            let (sop, sg) = match op.kind {
                Kind::Send { imm: None } => {
                    kinds[0] += 1;
                    (SendOp::Send, sg)
                }
                Kind::Send { imm: Some(imm) } => {
                    kinds[0] += 1;
                    (SendOp::SendWithImm { imm }, sg)
                }
                Kind::Write { dst, imm } => {
                    kinds[1] += 1;
                    let remote_addr = tgt.va(dst);
                    let rkey = tgt.rkey();
                    match imm {
                        None => (SendOp::Write { remote_addr, rkey }, sg),
                        Some(imm) => (
                            SendOp::WriteWithImm {
                                remote_addr,
                                rkey,
                                imm,
                            },
                            sg,
                        ),
                    }
                }
                Kind::Read { off, .. } => {
                    kinds[2] += 1;
                    let r = SendOp::Read {
                        remote_addr: tgt.va(off),
                        rkey: tgt.rkey(),
                    };
                    (r, sgl(&rdst, slot * max_len, op.len))
                }
                Kind::Cas {
                    off, compare, swap, ..
                } => {
                    kinds[3] += 1;
                    let c = SendOp::CompareSwap {
                        remote_addr: tgt.va(off),
                        rkey: tgt.rkey(),
                        compare,
                        swap,
                    };
                    (c, vec![ares.sge(slot * 8, 8)])
                }
                Kind::Faa { off, add, .. } => {
                    kinds[4] += 1;
                    (
                        SendOp::FetchAdd {
                            remote_addr: tgt.va(off),
                            rkey: tgt.rkey(),
                            add,
                        },
                        vec![ares.sge(slot * 8, 8)],
                    )
                }
            };
            let mut flags = SendFlags::SIGNALED;
            if op.fence {
                flags |= SendFlags::FENCE;
            }
            w.post_send(&a, wr_flags(op.id, sop, flags, sg));
        }
        let mut sc: Vec<WorkCompletion> = Vec::new();
        let mut rc: Vec<WorkCompletion> = Vec::new();
        let done = w.run_until(60 * SEC, |w| {
            sc.extend(w.drain(0, a.scq));
            rc.extend(w.drain(1, b.rcq));
            sc.len() >= n && rc.len() >= n_recv
        });
        let first = ops[0].id;
        if !done {
            let (sa, sb) = (w.stats(0), w.stats(1));
            let (qa, qb) = (w.qp_state(&a), w.qp_state(&b));
            panic!(
                "{tag}: batch from op {first}: {} of {n} send and {} of {n_recv} receive completions \
                 within 60 s of virtual time; QP states {qa:?}/{qb:?}\nA {sa:?}\nB {sb:?}\nnet {:?}\nlast send wcs {:#?}",
                sc.len(),
                rc.len(),
                w.sim.net.stats(),
                sc.iter().rev().take(3).collect::<Vec<_>>()
            );
        }
        assert_eq!(sc.len(), n, "{tag}: more send completions than WRs");
        assert_eq!(
            rc.len(),
            n_recv,
            "{tag}: more receive completions than receives"
        );
        // Send completions: one per WR, in posting order, every field.
        for (slot, (op, c)) in ops.iter().zip(&sc).enumerate() {
            let ctx = format!("{tag}: {}", op.short());
            let opc = match op.kind {
                Kind::Send { .. } => WcOpcode::Send,
                Kind::Write { .. } => WcOpcode::RdmaWrite,
                Kind::Read { .. } => WcOpcode::RdmaRead,
                Kind::Cas { .. } => WcOpcode::CompSwap,
                Kind::Faa { .. } => WcOpcode::FetchAdd,
            };
            check_send_wc(c, &send_wc(&a, op.id, opc, op.len), &ctx);
            match &op.kind {
                Kind::Read { expect, .. } => assert_bytes(
                    &rdst.read(slot * max_len, op.len),
                    expect,
                    &format!("{ctx}: READ data"),
                ),
                Kind::Cas { orig, .. } | Kind::Faa { orig, .. } => {
                    assert_eq!(
                        ares.read_u64(slot * 8),
                        *orig,
                        "{ctx}: atomic original value"
                    )
                }
                _ => {}
            }
        }
        // Receive completions: in posting order, right bytes.
        for (k, (op, c)) in ops
            .iter()
            .filter(|o| o.consumes_recv())
            .zip(&rc)
            .enumerate()
        {
            let ctx = format!("{tag}: receive {k} of batch, {}", op.short());
            let (opc, imm) = match op.kind {
                Kind::Send { imm } => (WcOpcode::Recv, imm),
                Kind::Write { imm, .. } => (WcOpcode::RecvRdmaWithImm, imm),
                _ => unreachable!(),
            };
            check_recv_wc(c, &recv_wc(&b, op.id, opc, op.len, imm, None), a.qpn, &ctx);
            if let Kind::Send { .. } = op.kind {
                assert_bytes(
                    &rq.read(k * max_len, op.len),
                    &src_data[op.src..op.src + op.len],
                    &format!("{ctx}: received bytes"),
                );
            }
        }
        assert_bytes(
            &tgt.read_all(),
            &model,
            &format!("{tag}: target memory after batch from op {first}"),
        );
    }
    assert_eq!(
        tgt.read_u64(COUNTER),
        counter0.wrapping_add(faa_sum),
        "{tag}: FAA counter is the sum of the adds"
    );
    assert_eq!(
        tgt.read_u64(CASWORD),
        word(&model, CASWORD),
        "{tag}: CAS word"
    );
    w.expect_no_wc(0, a.scq, &tag);
    w.expect_no_wc(1, b.rcq, &tag);
    assert_bytes(
        &tgt.read_all(),
        &model,
        &format!("{tag}: final target memory"),
    );
    let ns = w.sim.net.stats().clone();
    assert!(
        ns.dropped_loss > 0 && ns.duplicated > 0 && ns.reordered > 0 && ns.corrupted > 0,
        "{tag}: the faults must have happened: {ns:?}"
    );
    eprintln!(
        "{tag}: ok, {n_ops} ops (send {} write {} read {} cas {} faa {}); net {ns:?}; A retransmits {} timeouts {}",
        kinds[0],
        kinds[1],
        kinds[2],
        kinds[3],
        kinds[4],
        w.stats(0).retransmits,
        w.stats(0).timeouts
    );
}

#[test]
fn rc_exactly_once_in_order_under_faults() {
    let cases = env_u64("SOFTRDMA_PROPTEST_CASES", 3);
    let base = env_u64("SOFTRDMA_PROPTEST_SEED", 0x5EED_0000_0001);
    let ops = env_u64("SOFTRDMA_PROPTEST_OPS", 2000) as usize;
    for case in 0..cases {
        let seed = base.wrapping_add(case.wrapping_mul(0x9E37_79B9));
        eprintln!(
            "property case {case}/{cases}: seed {seed:#x} \
             (reproduce: SOFTRDMA_PROPTEST_SEED={seed:#x} SOFTRDMA_PROPTEST_CASES=1)"
        );
        run_case(seed, ops);
    }
}

fn proptest_cases() -> u32 {
    env_u64("SOFTRDMA_PROPTEST_CASES", 3).saturating_mul(8) as u32
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: proptest_cases(),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// WRITE then READ back any length at any offset, on a lossy, reordering link:
    /// the target holds exactly the written bytes and the READ returns them.
    #[test]
    fn write_then_read_roundtrip(
        seed in any::<u64>(),
        mtu_big in any::<bool>(),
        len_sel in 0usize..10_000,
        off in 0usize..512,
    ) {
        eprintln!("write_then_read_roundtrip seed {seed:#x}");
        let mtu = if mtu_big { Mtu::Mtu4096 } else { Mtu::Mtu256 };
        let max = 3 * mtu.bytes() + 1;
        let len = len_sel % (max + 1);
        let faults = Faults { loss: 0.05, reorder: 0.05, duplicate: 0.05, ..Faults::default() };
        let mut w = World::new(2, seed, faults);
        let (a, b) = w.pair(&QpCfg::rc().with_mtu(mtu));
        let src = w.mr(0, a.pd, max, LW, 0);
        let data = pattern(seed, len);
        src.write(0, &data);
        let t = w.mr(1, b.pd, max + 512, LW | Access::REMOTE_WRITE | Access::REMOTE_READ, 0xEE);
        let back = w.mr(0, a.pd, max, LW, 0xEE);
        w.post_send(&a, wr(1, SendOp::Write { remote_addr: t.va(off), rkey: t.rkey() }, sgl(&src, 0, len)));
        w.post_send(&a, wr(2, SendOp::Read { remote_addr: t.va(off), rkey: t.rkey() }, sgl(&back, 0, len)));
        let c = w.expect_wcs(0, a.scq, 2);
        check_send_wc(&c[0], &send_wc(&a, 1, WcOpcode::RdmaWrite, len), &format!("seed {seed:#x} WRITE"));
        check_send_wc(&c[1], &send_wc(&a, 2, WcOpcode::RdmaRead, len), &format!("seed {seed:#x} READ"));
        assert_all(&t.read(0, off), 0xEE, &format!("seed {seed:#x}: before"));
        assert_bytes(&t.read(off, len), &data, &format!("seed {seed:#x}: target"));
        assert_all(&t.read(off + len, max + 512 - off - len), 0xEE, &format!("seed {seed:#x}: after"));
        assert_bytes(&back.read(0, len), &data, &format!("seed {seed:#x}: READ back"));
    }
}
