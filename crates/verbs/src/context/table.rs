//! The map every object table is built on.

use std::hash::Hash;

/// Object tables are keyed by small integers (ids, key indices, QP numbers) that the
/// packet path looks up several times per packet: see [`softrdma_wire::idhash`].
pub(super) use softrdma_wire::idhash::IdMap;

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
