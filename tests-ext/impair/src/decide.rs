//! What the impairer does to each packet: independent, seeded decisions.

use softrdma_wire::SplitMix64;

/// Probabilities of each impairment, each in [0, 1], applied independently per packet.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Rates {
    /// Drop the packet.
    pub loss: f64,
    /// Send the packet twice (the copy byte for byte).
    pub dup: f64,
    /// Hold the packet back and release it after later ones.
    pub reorder: f64,
    /// Flip one byte of the UDP payload.
    pub corrupt: f64,
}

impl Rates {
    /// The first rate outside [0, 1] (or NaN), by name, so a typo fails at start.
    pub fn invalid(&self) -> Option<(&'static str, f64)> {
        [
            ("loss", self.loss),
            ("dup", self.dup),
            ("reorder", self.reorder),
            ("corrupt", self.corrupt),
        ]
        .into_iter()
        .find(|(_, p)| !(0.0..=1.0).contains(p))
    }
}

/// One packet's fate. A dropped packet has no other impairment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Decision {
    /// Drop it.
    pub drop: bool,
    /// Also send a copy of it.
    pub dup: bool,
    /// Hold it back.
    pub reorder: bool,
    /// Flip a byte: (a random number that picks the byte, the nonzero XOR mask).
    pub corrupt: Option<(u64, u8)>,
}

/// The decision maker: one seeded stream, a fixed number of draws per packet, so that
/// the n-th packet's fate depends only on the seed and n, whatever the rates are.
#[derive(Debug, Clone)]
pub struct Decider {
    rates: Rates,
    rng: SplitMix64,
}

impl Decider {
    /// A decider for `rates` whose choices are fixed by `seed`.
    pub fn new(rates: Rates, seed: u64) -> Decider {
        Decider {
            rates,
            rng: SplitMix64::new(seed),
        }
    }

    /// The rates this decider applies.
    pub fn rates(&self) -> Rates {
        self.rates
    }

    /// The next packet's fate.
    pub fn decide(&mut self) -> Decision {
        // One draw per rate whatever the rate (`SplitMix64::chance` skips the draw for
        // a certain outcome), so the stream stays aligned.
        let mut draw = |p: f64| self.rng.next_f64() < p;
        let drop = draw(self.rates.loss);
        let dup = draw(self.rates.dup);
        let reorder = draw(self.rates.reorder);
        let corrupt = draw(self.rates.corrupt);
        let pick = self.rng.next_u64();
        // 1..=255: a zero mask would flip nothing.
        let mask = (self.rng.below(255) + 1) as u8;
        if drop {
            return Decision {
                drop: true,
                ..Decision::default()
            };
        }
        Decision {
            drop: false,
            dup,
            reorder,
            corrupt: corrupt.then_some((pick, mask)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count(rates: Rates, seed: u64, n: usize) -> [usize; 4] {
        let mut d = Decider::new(rates, seed);
        let mut c = [0usize; 4];
        for _ in 0..n {
            let x = d.decide();
            c[0] += x.drop as usize;
            c[1] += x.dup as usize;
            c[2] += x.reorder as usize;
            c[3] += x.corrupt.is_some() as usize;
            assert!(!(x.drop && (x.dup || x.reorder || x.corrupt.is_some())));
            if let Some((_, m)) = x.corrupt {
                assert_ne!(m, 0);
            }
        }
        c
    }

    #[test]
    fn rates_are_met_within_sampling_error() {
        let n = 200_000;
        let r = Rates {
            loss: 0.10,
            dup: 0.05,
            reorder: 0.02,
            corrupt: 0.01,
        };
        let c = count(r, 1, n);
        let near = |got: usize, p: f64, of: f64| {
            let want = p * of;
            // Five standard deviations of a binomial.
            let sd = (of * p * (1.0 - p)).sqrt();
            (got as f64 - want).abs() < 5.0 * sd
        };
        assert!(near(c[0], 0.10, n as f64), "loss {c:?}");
        // The others apply to the packets that were not dropped.
        let kept = (n - c[0]) as f64;
        assert!(near(c[1], 0.05, kept), "dup {c:?}");
        assert!(near(c[2], 0.02, kept), "reorder {c:?}");
        assert!(near(c[3], 0.01, kept), "corrupt {c:?}");
    }

    #[test]
    fn zero_rates_touch_nothing_and_one_drops_everything() {
        assert_eq!(count(Rates::default(), 9, 10_000), [0; 4]);
        let all = Rates {
            loss: 1.0,
            ..Rates::default()
        };
        assert_eq!(count(all, 9, 1000), [1000, 0, 0, 0]);
    }

    #[test]
    fn seed_reproduces_and_rates_do_not_shift_the_stream() {
        let r = Rates {
            loss: 0.3,
            ..Rates::default()
        };
        let a: Vec<Decision> = {
            let mut d = Decider::new(r, 5);
            (0..1000).map(|_| d.decide()).collect()
        };
        let b: Vec<Decision> = {
            let mut d = Decider::new(r, 5);
            (0..1000).map(|_| d.decide()).collect()
        };
        assert_eq!(a, b);
        // Adding duplication keeps the same packets dropped.
        let mut d = Decider::new(Rates { dup: 0.5, ..r }, 5);
        for x in &a {
            assert_eq!(d.decide().drop, x.drop);
        }
    }

    #[test]
    fn invalid_rates_are_named() {
        let r = Rates {
            dup: 1.5,
            ..Rates::default()
        };
        assert_eq!(r.invalid(), Some(("dup", 1.5)));
        let n = Rates {
            loss: f64::NAN,
            ..Rates::default()
        };
        assert_eq!(n.invalid().map(|x| x.0), Some("loss"));
        assert_eq!(Rates::default().invalid(), None);
    }
}
