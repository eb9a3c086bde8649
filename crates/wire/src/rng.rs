//! A small seeded PRNG (SplitMix64), so that randomness is reproducible from a seed
//! without an external crate or OS entropy. It lives in `wire`, the crate every other
//! one already depends on, so that the `sim` network, the verbs key allocator and the
//! tests all draw from one generator.

/// SplitMix64: tiny, fast, and good enough statistically for fault injection and test
/// workloads; every seed (including 0) gives a full-period stream. Not cryptographic.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator whose whole stream derives from `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        Self::mix(self.state)
    }

    /// SplitMix64's output function, also a good 64-bit hash of a counter or a seed.
    pub fn mix(mut z: u64) -> u64 {
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1) with 53 bits of precision.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// True with probability `p`. Out-of-range and NaN probabilities are clamped
    /// (NaN counts as 0) rather than rejected, so bad configuration cannot panic.
    /// Certain outcomes consume no randomness, so a fault that is switched off does
    /// not perturb the stream the other faults see.
    pub fn chance(&mut self, p: f64) -> bool {
        if p.is_nan() || p <= 0.0 {
            false
        } else if p >= 1.0 {
            true
        } else {
            self.next_f64() < p
        }
    }

    /// Uniform in [0, n); 0 when `n == 0`. Uses the multiply-high reduction; its bias
    /// (at most n / 2^64) is irrelevant for fault injection.
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Uniform in [0, max] inclusive, without overflowing at `u64::MAX`.
    pub fn up_to(&mut self, max: u64) -> u64 {
        match max.checked_add(1) {
            Some(n) => self.below(n),
            None => self.next_u64(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::SplitMix64;

    #[test]
    fn reference_stream() {
        // The reference splitmix64.c from state 0: a seed names the same stream here as
        // in any other implementation.
        let mut r = SplitMix64::new(0);
        let got = [r.next_u64(), r.next_u64(), r.next_u64()];
        assert_eq!(
            got,
            [
                0xE220_A839_7B1D_CDAF,
                0x6E78_9E6A_A1B9_65F4,
                0x06C4_5D18_8009_454F
            ]
        );
    }

    #[test]
    fn same_seed_same_stream_different_seed_different_stream() {
        let mut a = SplitMix64::new(7);
        let mut b = SplitMix64::new(7);
        let mut c = SplitMix64::new(8);
        let xa: Vec<u64> = (0..16).map(|_| a.next_u64()).collect();
        let xb: Vec<u64> = (0..16).map(|_| b.next_u64()).collect();
        let xc: Vec<u64> = (0..16).map(|_| c.next_u64()).collect();
        assert_eq!(xa, xb);
        assert_ne!(xa, xc);
    }

    #[test]
    fn ranges_are_respected() {
        let mut r = SplitMix64::new(1);
        for _ in 0..10_000 {
            assert!(r.below(10) < 10);
            assert!(r.up_to(3) <= 3);
            let f = r.next_f64();
            assert!((0.0..1.0).contains(&f));
        }
        assert_eq!(r.below(0), 0);
        assert_eq!(r.up_to(0), 0);
        let _ = r.up_to(u64::MAX);
    }

    #[test]
    fn chance_edge_cases() {
        let mut r = SplitMix64::new(3);
        assert!(!r.chance(0.0));
        assert!(!r.chance(-1.0));
        assert!(!r.chance(f64::NAN));
        assert!(r.chance(1.0));
        assert!(r.chance(5.0));
    }

    #[test]
    fn up_to_reaches_both_ends() {
        let mut r = SplitMix64::new(11);
        let v: Vec<u64> = (0..1000).map(|_| r.up_to(2)).collect();
        assert!(v.contains(&0) && v.contains(&1) && v.contains(&2));
    }
}
