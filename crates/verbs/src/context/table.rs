//! The map every object table is built on.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hash, Hasher};

/// Object tables are keyed by small integers (ids, key indices, QP numbers) that the
/// packet path looks up several times per packet. SipHash's flood resistance buys
/// nothing here (a peer can look keys up but never insert them), so a multiply-rotate
/// hash (FxHash's) is used instead.
#[derive(Default, Clone, Copy)]
pub(super) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u8(&mut self, v: u8) {
        self.write_u64(u64::from(v));
    }
    fn write_u16(&mut self, v: u16) {
        self.write_u64(u64::from(v));
    }
    fn write_u32(&mut self, v: u32) {
        self.write_u64(u64::from(v));
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
    fn write_usize(&mut self, v: usize) {
        self.write_u64(v as u64);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

/// A map keyed by small integers (see [`IdHasher`]).
pub(super) type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

/// One object family's objects by id. Each family's module adds the questions the other
/// families ask of it (does any object use this PD, this CQ, ...).
#[derive(Debug)]
pub(super) struct Table<K, V>(IdMap<K, V>);

impl<K, V> Default for Table<K, V> {
    fn default() -> Self {
        Table(IdMap::default())
    }
}

impl<K: Copy + Eq + Hash, V> Table<K, V> {
    pub(super) fn get(&self, id: K) -> Option<&V> {
        self.0.get(&id)
    }
    pub(super) fn get_mut(&mut self, id: K) -> Option<&mut V> {
        self.0.get_mut(&id)
    }
    pub(super) fn contains(&self, id: K) -> bool {
        self.0.contains_key(&id)
    }
    pub(super) fn insert(&mut self, id: K, obj: V) {
        self.0.insert(id, obj);
    }
    pub(super) fn remove(&mut self, id: K) -> Option<V> {
        self.0.remove(&id)
    }
    pub(super) fn len(&self) -> usize {
        self.0.len()
    }
    pub(super) fn values(&self) -> impl Iterator<Item = &V> {
        self.0.values()
    }
}
