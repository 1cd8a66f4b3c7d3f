//! Shared copies of the strings and label sets many objects repeat.
//!
//! 150,000 Pods name a few thousand namespaces and nodes, and their labels are mostly the same
//! few keys with values shared by a workload's replicas. Each distinct string (and each
//! distinct label set) is kept once and shared by reference count; what no object uses any
//! more is dropped when the table has doubled since it was last swept, so the table stays
//! proportional to what is alive.
use std::{
    collections::HashSet,
    hash::Hash,
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

static LABEL_SETS: Mutex<Option<Table<str>>> = Mutex::new(None);

/// The shared copy of a label set's text (`k8s::labels::Labels`): a set kept apart from the
/// strings, so that a sweep of either looks only at its own.
pub fn label_set(text: &str) -> Arc<str> {
    let mut table = LABEL_SETS.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    table.get_or_insert_with(Table::new).intern(text, |text: &str| Arc::from(text))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_strings_and_sets_are_one_copy_and_unused_ones_go() {
        let a = string("app");
        let b = string(&String::from("app"));
        assert!(Arc::ptr_eq(&a, &b));
        let one = label_set("3:app3:web");
        assert!(Arc::ptr_eq(&one, &label_set(&String::from("3:app3:web"))));
        assert!(!Arc::ptr_eq(&one, &a), "sets are not the strings' table");

        // Strings nobody holds are swept once the table has doubled; held ones stay.
        let mut table = Table::<str>::new();
        let make = |text: &str| Arc::from(text);
        let kept = table.intern("kept", make);
        for i in 0..3 * Table::<str>::MIN_SWEEP {
            table.intern(format!("gone-{i}").as_str(), make);
        }
        assert!(table.values.len() < 2 * Table::<str>::MIN_SWEEP, "{} left", table.values.len());
        assert!(Arc::ptr_eq(&table.intern("kept", make), &kept));
    }
}
