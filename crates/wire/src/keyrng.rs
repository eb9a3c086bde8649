//! The generator of values a remote party must not predict: memory keys, QP numbers, the
//! connection manager's starting PSNs and communication IDs.
//!
//! RoCE has no authentication: an rkey and a QPN are all a packet needs to write into a
//! registered region. A generator whose state can be recovered from a few outputs
//! (SplitMix64 gives its whole state from two observed rkeys) lets anyone who saw one key
//! forge the next. ChaCha20 (RFC 8439) as a keystream is the standard answer: its outputs
//! reveal nothing of its 256-bit key. It is a few dozen lines, so it is written here rather
//! than pulled in; the block function is checked against the RFC's test vector.
//!
//! The key comes from outside: the OS's entropy in a device (`getrandom`), or a 64-bit
//! seed expanded deterministically ([`Seed::from_u64`]) so that tests and the `sim`
//! network replay exactly.

use crate::SplitMix64;

/// The 256-bit key of a [`KeyRng`].
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Seed(pub [u8; 32]);

impl std::fmt::Debug for Seed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // A seed is a secret: never printed.
        f.write_str("Seed(..)")
    }
}

impl Seed {
    /// A seed derived from 64 bits, for reproducible runs (tests, simulations): the same
    /// number always gives the same stream. Not secret beyond those 64 bits.
    pub fn from_u64(seed: u64) -> Seed {
        let mut r = SplitMix64::new(seed);
        let mut k = [0u8; 32];
        for c in k.chunks_exact_mut(8) {
            c.copy_from_slice(&r.next_u64().to_le_bytes());
        }
        Seed(k)
    }
}

impl From<u64> for Seed {
    fn from(seed: u64) -> Seed {
        Seed::from_u64(seed)
    }
}

/// ChaCha20 in counter mode as a random number generator (nonce 0, 64-bit block counter).
#[derive(Clone)]
pub struct KeyRng {
    key: [u32; 8],
    counter: u64,
    block: [u32; 16],
    /// Next unused word of `block` (16: none left).
    at: usize,
}

impl std::fmt::Debug for KeyRng {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeyRng(..)")
    }
}

/// "expand 32-byte k".
const SIGMA: [u32; 4] = [0x6170_7865, 0x3320_646e, 0x7962_2d32, 0x6b20_6574];

fn quarter(s: &mut [u32; 16], a: usize, b: usize, c: usize, d: usize) {
    s[a] = s[a].wrapping_add(s[b]);
    s[d] = (s[d] ^ s[a]).rotate_left(16);
    s[c] = s[c].wrapping_add(s[d]);
    s[b] = (s[b] ^ s[c]).rotate_left(12);
    s[a] = s[a].wrapping_add(s[b]);
    s[d] = (s[d] ^ s[a]).rotate_left(8);
    s[c] = s[c].wrapping_add(s[d]);
    s[b] = (s[b] ^ s[c]).rotate_left(7);
}

/// The ChaCha20 block function (RFC 8439 §2.3): 20 rounds over the state, added to it.
fn block(key: &[u32; 8], counter: u32, nonce: [u32; 3]) -> [u32; 16] {
    let mut init = [0u32; 16];
    init[..4].copy_from_slice(&SIGMA);
    init[4..12].copy_from_slice(key);
    init[12] = counter;
    init[13..].copy_from_slice(&nonce);
    let mut s = init;
    for _ in 0..10 {
        quarter(&mut s, 0, 4, 8, 12);
        quarter(&mut s, 1, 5, 9, 13);
        quarter(&mut s, 2, 6, 10, 14);
        quarter(&mut s, 3, 7, 11, 15);
        quarter(&mut s, 0, 5, 10, 15);
        quarter(&mut s, 1, 6, 11, 12);
        quarter(&mut s, 2, 7, 8, 13);
        quarter(&mut s, 3, 4, 9, 14);
    }
    for (w, i) in s.iter_mut().zip(init) {
        *w = w.wrapping_add(i);
    }
    s
}

impl KeyRng {
    /// A generator keyed by `seed`.
    pub fn new(seed: impl Into<Seed>) -> KeyRng {
        let Seed(k) = seed.into();
        let mut key = [0u32; 8];
        for (w, c) in key.iter_mut().zip(k.chunks_exact(4)) {
            *w = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
        KeyRng {
            key,
            counter: 0,
            block: [0; 16],
            at: 16,
        }
    }

    /// The next 32 random bits.
    pub fn next_u32(&mut self) -> u32 {
        if self.at == 16 {
            // The 64-bit counter spans the block counter word and the first nonce word,
            // so the stream does not repeat within 2^64 blocks.
            let c = self.counter;
            self.counter = c.wrapping_add(1);
            self.block = block(&self.key, c as u32, [(c >> 32) as u32, 0, 0]);
            self.at = 0;
        }
        let w = self.block[self.at];
        self.at += 1;
        w
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let lo = u64::from(self.next_u32());
        (u64::from(self.next_u32()) << 32) | lo
    }

    /// A seed for another generator, drawn from this one (a component with a stream of
    /// its own).
    pub fn fork(&mut self) -> Seed {
        let mut k = [0u8; 32];
        for c in k.chunks_exact_mut(4) {
            c.copy_from_slice(&self.next_u32().to_le_bytes());
        }
        Seed(k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_function_matches_rfc_8439() {
        // RFC 8439 §2.3.2: key 00 01 .. 1f, counter 1, nonce 00:00:00:09:00:00:00:4a:00:00:00:00.
        let mut key = [0u32; 8];
        for (i, w) in key.iter_mut().enumerate() {
            let b = (i * 4) as u8;
            *w = u32::from_le_bytes([b, b + 1, b + 2, b + 3]);
        }
        let out = block(&key, 1, [0x0900_0000, 0x4a00_0000, 0]);
        assert_eq!(
            out,
            [
                0xe4e7_f110,
                0x1559_3bd1,
                0x1fdd_0f50,
                0xc471_20a3,
                0xc7f4_d1c7,
                0x0368_c033,
                0x9aaa_2204,
                0x4e6c_d4c3,
                0x4664_82d2,
                0x09aa_9f07,
                0x05d7_c214,
                0xa202_8bd9,
                0xd19c_12b5,
                0xb94e_16de,
                0xe883_d0cb,
                0x4e3c_50a2,
            ]
        );
    }

    #[test]
    fn same_seed_same_stream_and_blocks_follow_each_other() {
        let mut a = KeyRng::new(7);
        let mut b = KeyRng::new(Seed::from_u64(7));
        let xa: Vec<u64> = (0..40).map(|_| a.next_u64()).collect();
        let xb: Vec<u64> = (0..40).map(|_| b.next_u64()).collect();
        assert_eq!(xa, xb);
        let mut c = KeyRng::new(8);
        assert_ne!(xa[0], c.next_u64());
        // 40 u64 span several blocks, none repeated.
        let mut sorted = xa.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), xa.len());
        // The first block is the block function's output at counter 0, nonce 0.
        let first = block(&KeyRng::new(7).key, 0, [0, 0, 0]);
        assert_eq!(xa[0], (u64::from(first[1]) << 32) | u64::from(first[0]));
    }

    #[test]
    fn a_seed_is_not_printed() {
        assert_eq!(format!("{:?}", Seed::from_u64(1)), "Seed(..)");
        assert_eq!(format!("{:?}", KeyRng::new(1)), "KeyRng(..)");
    }
}
