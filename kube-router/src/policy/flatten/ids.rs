//! Ids that stay put while their definition is in use, so unchanged map entries stay
//! byte-identical across flattenings.
use std::collections::{BTreeMap, BTreeSet};

/// Allocates ids that stay put while their definition is in use. Released
/// ids are recycled only from the *next* flattening on, so an id is never
/// reused for a new definition in the same batch of writes that stops
/// using it for the old one.
#[derive(Debug, Clone)]
pub(super) struct StableIds<K: Ord> {
    pub(super) ids: BTreeMap<K, u32>,
    pub(super) free: Vec<u32>,
    /// Released during the current flattening: reusable from the next one.
    pub(super) pending: Vec<u32>,
    pub(super) next: u32,
}

impl<K: Ord + Clone> StableIds<K> {
    pub(super) fn new() -> Self {
        StableIds { ids: BTreeMap::new(), free: Vec::new(), pending: Vec::new(), next: 1 }
    }

    pub(super) fn get_or_allocate(&mut self, key: &K) -> u32 {
        if let Some(id) = self.ids.get(key) {
            return *id;
        }
        let id = self.free.pop().unwrap_or_else(|| {
            let id = self.next;
            self.next = self.next.saturating_add(1);
            id
        });
        self.ids.insert(key.clone(), id);
        id
    }

    /// Releases one id; it becomes reusable from the next flattening on ([`Self::commit`]).
    pub(super) fn release(&mut self, key: &K) {
        if let Some(id) = self.ids.remove(key) {
            self.pending.push(id);
        }
    }

    /// Makes the ids released so far reusable.
    pub(super) fn commit(&mut self) {
        self.free.append(&mut self.pending);
        self.free.sort_unstable_by(|a, b| b.cmp(a));
    }

    pub(super) fn release_unused(&mut self, used: &BTreeSet<K>) {
        let unused: Vec<K> = self.ids.keys().filter(|k| !used.contains(*k)).cloned().collect();
        for key in unused {
            if let Some(id) = self.ids.remove(&key) {
                self.free.push(id);
            }
        }
        // Pop smallest ids first to keep the id space compact.
        self.free.sort_unstable_by(|a, b| b.cmp(a));
    }
}
