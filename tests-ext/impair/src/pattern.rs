//! The soak checker's schedule and data: both sides derive, from the seed and the
//! operation count alone, which operation comes n-th, how long it is and every byte it
//! carries, so each side checks what it sees without being told what to expect.

use softrdma_wire::SplitMix64;

/// One step of the schedule. A WRITE step is followed by a READ of the same bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// RDMA WRITE of `len` bytes into target slot `slot`, then READ them back.
    WriteRead {
        /// Target slot.
        slot: usize,
        /// Bytes.
        len: usize,
    },
    /// SEND (with immediate data when `imm`) of `len` bytes.
    Send {
        /// Bytes.
        len: usize,
        /// SEND with immediate (the low 32 bits of the op number).
        imm: bool,
    },
    /// FETCH_AND_ADD 1 on the first counter.
    FetchAdd,
    /// COMPARE_AND_SWAP on the second counter from its expected value to one more.
    CompareSwap,
}

impl Step {
    /// Work requests this step posts.
    pub fn wrs(&self) -> u64 {
        match self {
            Step::WriteRead { .. } => 2,
            _ => 1,
        }
    }
}

/// Bytes every pattern starts with: the op number, so a wrong buffer names its origin.
pub const TAG: usize = 8;

/// The schedule's generator: steps in order, for `ops` work requests in all.
#[derive(Debug, Clone)]
pub struct Schedule {
    rng: SplitMix64,
    slots: usize,
    max_len: usize,
    next_slot: usize,
}

impl Schedule {
    /// Steps with lengths in `TAG..=max_len` (at least [`TAG`]) and WRITEs spread over
    /// `slots` target slots in turn.
    pub fn new(seed: u64, slots: usize, max_len: usize) -> Schedule {
        Schedule {
            rng: SplitMix64::new(SplitMix64::mix(seed ^ 0x5CED_u64)),
            slots: slots.max(1),
            max_len: max_len.max(TAG),
            next_slot: 0,
        }
    }

    fn len(&mut self) -> usize {
        // Mostly short (one packet), a third up to the maximum (several packets).
        let cap = if self.rng.chance(0.66) {
            self.max_len.min(256)
        } else {
            self.max_len
        };
        TAG + self.rng.below((cap - TAG + 1) as u64) as usize
    }

    /// The next step.
    pub fn next_step(&mut self) -> Step {
        let k = self.rng.below(10);
        match k {
            0..=2 => {
                let slot = self.next_slot;
                self.next_slot = (self.next_slot + 1) % self.slots;
                Step::WriteRead {
                    slot,
                    len: self.len(),
                }
            }
            3..=5 => {
                let imm = self.rng.chance(0.5);
                Step::Send {
                    len: self.len(),
                    imm,
                }
            }
            6..=7 => Step::FetchAdd,
            _ => Step::CompareSwap,
        }
    }
}

/// Fill `out` with the pattern of operation `op`: its number (little-endian), then bytes
/// that depend on the seed, the op and the position.
pub fn fill(seed: u64, op: u64, out: &mut [u8]) {
    let tag = op.to_le_bytes();
    let n = out.len().min(TAG);
    out[..n].copy_from_slice(&tag[..n]);
    let base = SplitMix64::mix(seed ^ SplitMix64::mix(op));
    for (i, chunk) in out[n..].chunks_mut(8).enumerate() {
        let w = SplitMix64::mix(base.wrapping_add(i as u64)).to_le_bytes();
        chunk.copy_from_slice(&w[..chunk.len()]);
    }
}

/// The pattern of `op` as a vector of `len` bytes.
pub fn pattern(seed: u64, op: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill(seed, op, &mut v);
    v
}

/// Explain how `got` differs from the pattern of `op` (`None` if it does not): which op
/// it carries instead and the first differing byte.
pub fn mismatch(seed: u64, op: u64, got: &[u8], want_len: usize) -> Option<String> {
    let want = pattern(seed, op, want_len);
    if got == want.as_slice() {
        return None;
    }
    let carried = got
        .get(..TAG)
        .map(|t| u64::from_le_bytes(t.try_into().unwrap_or([0; 8])));
    let first = got.iter().zip(&want).position(|(a, b)| a != b);
    Some(format!(
        "expected the {want_len} bytes of op {op}, got {} bytes tagged {} (first difference at \
         byte {})",
        got.len(),
        carried.map_or("(short)".to_string(), |c| format!("op {c}")),
        first.map_or("-".to_string(), |f| f.to_string()),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_sides_derive_the_same_schedule() {
        let mut a = Schedule::new(3, 16, 4096);
        let mut b = Schedule::new(3, 16, 4096);
        let mut seen = [0usize; 4];
        for _ in 0..10_000 {
            let (x, y) = (a.next_step(), b.next_step());
            assert_eq!(x, y);
            match x {
                Step::WriteRead { slot, len } => {
                    assert!(slot < 16 && (TAG..=4096).contains(&len));
                    seen[0] += 1;
                }
                Step::Send { len, .. } => {
                    assert!((TAG..=4096).contains(&len));
                    seen[1] += 1;
                }
                Step::FetchAdd => seen[2] += 1,
                Step::CompareSwap => seen[3] += 1,
            }
        }
        assert!(seen.iter().all(|&n| n > 1000), "{seen:?}");
    }

    #[test]
    fn patterns_differ_by_op_and_name_their_op() {
        let a = pattern(1, 10, 100);
        assert_eq!(&a[..8], &10u64.to_le_bytes());
        assert_ne!(a, pattern(1, 11, 100));
        assert_ne!(a, pattern(2, 10, 100));
        assert_eq!(mismatch(1, 10, &a, 100), None);
        let m = mismatch(1, 10, &pattern(1, 9, 100), 100).unwrap();
        assert!(m.contains("tagged op 9"), "{m}");
        assert!(mismatch(1, 10, &a[..50], 100).is_some());
        assert!(mismatch(1, 10, &[1, 2], 100).unwrap().contains("(short)"));
        // Short patterns are a prefix of the tag.
        assert_eq!(pattern(1, 0x0102, 2), vec![2, 1]);
    }
}
