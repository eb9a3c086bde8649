//! A fast hash for maps whose keys the engine and the device look up on every packet:
//! object ids, QP numbers, keys and peer addresses. SipHash's flood resistance buys
//! nothing there: a peer can make lookups but never choose the keys that are inserted
//! (objects are numbered by this process, peers are devices that connected). A
//! multiply-rotate hash (FxHash's) costs a few cycles per word instead.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// The multiply-rotate hasher (see the module).
#[derive(Default, Clone, Copy)]
pub struct IdHasher(u64);

impl IdHasher {
    #[inline]
    fn add(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

impl Hasher for IdHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(w));
        }
    }
    #[inline]
    fn write_u8(&mut self, v: u8) {
        self.add(u64::from(v));
    }
    #[inline]
    fn write_u16(&mut self, v: u16) {
        self.add(u64::from(v));
    }
    #[inline]
    fn write_u32(&mut self, v: u32) {
        self.add(u64::from(v));
    }
    #[inline]
    fn write_u64(&mut self, v: u64) {
        self.add(v);
    }
    #[inline]
    fn write_usize(&mut self, v: usize) {
        self.add(v as u64);
    }
    #[inline]
    fn finish(&self) -> u64 {
        // A product's high bits depend on every input bit, its low bits only on the low
        // ones; the map picks buckets by the low bits.
        self.0.rotate_left(26)
    }
}

/// What builds an [`IdHasher`].
pub type IdState = BuildHasherDefault<IdHasher>;

/// A map keyed by ids, keys or peer addresses (see the module).
pub type IdMap<K, V> = HashMap<K, V, IdState>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;

    #[test]
    fn addresses_and_ids_spread_over_buckets() {
        // Peer addresses that differ only in the last octet or the port, and QP numbers
        // that differ in one bit, must not share their low bits (the bucket index).
        let mut low = std::collections::HashSet::new();
        let h = |k: &dyn Fn(&mut IdHasher)| {
            let mut s = IdHasher::default();
            k(&mut s);
            s.finish() & 0xff
        };
        for i in 0..64u8 {
            let a: SocketAddr = ([127, 0, 0, i], 4791).into();
            low.insert(h(&|s| std::hash::Hash::hash(&a, s)));
        }
        assert!(low.len() > 40, "{} distinct of 64", low.len());
        low.clear();
        for i in 0..32u32 {
            low.insert(h(&|s| s.write_u32(0x100 << (i % 16) | i)));
        }
        assert!(low.len() > 20, "{} distinct of 32", low.len());
        let mut m: IdMap<SocketAddr, u32> = IdMap::default();
        m.insert(([127, 0, 0, 1], 4791).into(), 1);
        m.insert(([127, 0, 0, 1], 4792).into(), 2);
        assert_eq!(m.get(&([127, 0, 0, 1], 4792).into()), Some(&2));
    }
}
