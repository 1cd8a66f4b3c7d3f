//! Shared copies of the strings and label sets many objects repeat.
//!
//! 150,000 Pods name a few thousand namespaces and nodes, and their labels are mostly the same
//! few keys with values shared by a workload's replicas. Each distinct string (and each
//! distinct label set) is kept once and shared by reference count; what no object uses any
//! more is dropped when the table has doubled since it was last swept, so the table stays
//! proportional to what is alive.
use std::{
    collections::{
        hash_map::{Entry, RandomState},
        HashMap, HashSet,
    },
    hash::{BuildHasher, Hash, Hasher},
    sync::{Arc, Mutex},
};

/// Values kept once: `intern` returns the shared copy of an equal value, or keeps this one.
struct Table<T: ?Sized> {
    values: HashSet<Arc<T>>,
    /// The size after the last sweep: the next sweep comes when the table has doubled.
    swept_at: usize,
}

impl<T: ?Sized + Hash + Eq> Table<T> {
    const MIN_SWEEP: usize = 4096;

    fn new() -> Self {
        Self { values: HashSet::new(), swept_at: 0 }
    }

    fn intern<Q>(&mut self, value: &Q, make: impl FnOnce(&Q) -> Arc<T>) -> Arc<T>
    where
        Arc<T>: std::borrow::Borrow<Q>,
        Q: ?Sized + Hash + Eq,
    {
        if let Some(shared) = self.values.get(value) {
            return shared.clone();
        }
        if self.values.len() >= (2 * self.swept_at).max(Self::MIN_SWEEP) {
            // Only this table holds them: nothing alive uses them.
            self.values.retain(|value| Arc::strong_count(value) > 1);
            self.swept_at = self.values.len();
        }
        let shared = make(value);
        self.values.insert(shared.clone());
        shared
    }
}

static STRINGS: Mutex<Option<Table<str>>> = Mutex::new(None);

/// The shared copy of `text`.
pub fn string(text: &str) -> Arc<str> {
    let mut table = STRINGS.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    table.get_or_insert_with(Table::new).intern(text, |text: &str| Arc::from(text))
}

/// A label set: (key, value) pairs sorted by key, each key once.
pub type LabelPairs = [(Arc<str>, Arc<str>)];

/// Label sets kept once, found by the hash of their text: a set already kept (a replica's,
/// a pod updated without a label change) is found from the borrowed strings, with no string
/// looked up, copied or counted; only a new set is made of shared strings.
struct SetTable {
    by_hash: HashMap<u64, Sets>,
    hasher: RandomState,
    len: usize,
    /// The size after the last sweep: the next sweep comes when the table has doubled.
    swept_at: usize,
}

impl SetTable {
    fn new() -> Self {
        Self { by_hash: HashMap::new(), hasher: RandomState::new(), len: 0, swept_at: 0 }
    }

    fn hash(&self, pairs: impl Iterator<Item = (impl AsRef<str>, impl AsRef<str>)>) -> u64 {
        let mut hasher = self.hasher.build_hasher();
        for (key, value) in pairs {
            key.as_ref().hash(&mut hasher);
            value.as_ref().hash(&mut hasher);
        }
        hasher.finish()
    }

    fn intern(&mut self, pairs: &[(&str, &str)]) -> Arc<LabelPairs> {
        let hash = self.hash(pairs.iter().copied());
        let same = |set: &&Arc<LabelPairs>| {
            set.len() == pairs.len()
                && set.iter().zip(pairs).all(|((k, v), (key, value))| **k == **key && **v == **value)
        };
        if let Some(shared) = self.by_hash.get(&hash).and_then(|sets| sets.as_slice().iter().find(same)) {
            return shared.clone();
        }
        if self.len >= (2 * self.swept_at).max(Table::<str>::MIN_SWEEP) {
            // Only this table holds them: nothing alive uses them.
            self.by_hash.retain(|_, sets| sets.retain_used());
            self.len = self.by_hash.values().map(|sets| sets.as_slice().len()).sum();
            self.swept_at = self.len;
        }
        let owned: Vec<(Arc<str>, Arc<str>)> = pairs.iter().map(|(k, v)| (string(k), string(v))).collect();
        let shared: Arc<LabelPairs> = Arc::from(owned);
        match self.by_hash.entry(hash) {
            Entry::Occupied(mut sets) => sets.get_mut().push(shared.clone()),
            Entry::Vacant(slot) => {
                slot.insert(Sets::One(shared.clone()));
            }
        }
        self.len += 1;
        shared
    }
}

/// The label sets of one hash: nearly always one, kept without a list (a `Vec` of one took 64
/// bytes more per label set, 10 MiB at 150,000 pods whose sets are each their own).
enum Sets {
    One(Arc<LabelPairs>),
    /// Sets whose hashes collide.
    Many(Vec<Arc<LabelPairs>>),
}

impl Sets {
    fn as_slice(&self) -> &[Arc<LabelPairs>] {
        match self {
            Sets::One(set) => std::slice::from_ref(set),
            Sets::Many(sets) => sets,
        }
    }

    fn push(&mut self, set: Arc<LabelPairs>) {
        match self {
            Sets::One(first) => *self = Sets::Many(vec![first.clone(), set]),
            Sets::Many(sets) => sets.push(set),
        }
    }

    /// Drops the sets only this table holds; whether any is left.
    fn retain_used(&mut self) -> bool {
        let used = |set: &Arc<LabelPairs>| Arc::strong_count(set) > 1;
        match self {
            Sets::One(set) => used(set),
            Sets::Many(sets) => {
                sets.retain(used);
                !sets.is_empty()
            }
        }
    }
}

static LABEL_SETS: Mutex<Option<SetTable>> = Mutex::new(None);

/// The shared copy of a label set (`pairs` sorted by key, keys unique), its strings shared too.
pub fn label_set(pairs: &[(&str, &str)]) -> Arc<LabelPairs> {
    let mut table = LABEL_SETS.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    table.get_or_insert_with(SetTable::new).intern(pairs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_strings_and_sets_are_one_copy_and_unused_ones_go() {
        let a = string("app");
        let b = string(&String::from("app"));
        assert!(Arc::ptr_eq(&a, &b));
        let one = label_set(&[("app", "web"), ("tier", "db")]);
        let two = label_set(&[("app", "web"), ("tier", "db")]);
        assert!(Arc::ptr_eq(&one, &two));
        assert!(Arc::ptr_eq(&one[0].0, &a), "the set's strings are the shared ones");

        // Strings nobody holds are swept once the table has doubled; held ones stay.
        let mut table = Table::<str>::new();
        let make = |text: &str| Arc::from(text);
        let kept = table.intern("kept", make);
        for i in 0..3 * Table::<str>::MIN_SWEEP {
            table.intern(format!("gone-{i}").as_str(), make);
        }
        assert!(table.values.len() < 2 * Table::<str>::MIN_SWEEP, "{} left", table.values.len());
        assert!(Arc::ptr_eq(&table.intern("kept", make), &kept));

        // The same for label sets, found again from their text.
        let mut sets = SetTable::new();
        let kept = sets.intern(&[("app", "kept")]);
        for i in 0..3 * Table::<str>::MIN_SWEEP {
            sets.intern(&[("app", format!("gone-{i}").as_str())]);
        }
        assert!(sets.len < 2 * Table::<str>::MIN_SWEEP, "{} left", sets.len);
        assert_eq!(sets.len, sets.by_hash.values().map(|sets| sets.as_slice().len()).sum::<usize>());
        assert!(Arc::ptr_eq(&sets.intern(&[("app", "kept")]), &kept));
        // Sets that differ only where their strings meet are not one set.
        let (ab, a_b) = (sets.intern(&[("ab", "")]), sets.intern(&[("a", "b")]));
        assert!(!Arc::ptr_eq(&ab, &a_b));
        assert_eq!((&*ab[0].0, &*a_b[0].0), ("ab", "a"));
        assert!(!Arc::ptr_eq(&sets.intern(&[]), &sets.intern(&[("", "")])));
    }

    /// Sets filed under one hash (a collision) are each found, and swept one by one.
    #[test]
    fn label_sets_under_one_hash_are_each_found_and_swept() {
        let mut sets = SetTable::new();
        let first = sets.intern(&[("app", "a")]);
        let hash = sets.hash([("app", "a")].into_iter());
        let other: Arc<LabelPairs> = Arc::from(vec![(string("app"), string("b"))]);
        sets.by_hash.get_mut(&hash).unwrap().push(other.clone());
        assert!(Arc::ptr_eq(&sets.intern(&[("app", "a")]), &first), "found beside another");
        let bucket = sets.by_hash.get_mut(&hash).unwrap();
        assert_eq!(bucket.as_slice().len(), 2);
        assert!(Arc::ptr_eq(&bucket.as_slice()[1], &other));
        drop(other);
        assert!(bucket.retain_used(), "the first is still held");
        assert_eq!(bucket.as_slice().len(), 1);
        assert!(Arc::ptr_eq(&bucket.as_slice()[0], &first));
        drop(first);
        assert!(!bucket.retain_used(), "nothing held: the hash goes");
    }
}
