//! The labels of a Pod or Namespace as the API layer keeps them (interned, `k8s::intern`), and
//! the L4 protocols a Kubernetes object names: what the slimmed Pods hold and NetworkPolicy reads.
use std::{collections::BTreeMap, fmt, sync::Arc};

use super::intern;

/// Labels of a pod or namespace: pairs sorted by key, each key once, kept as one text shared
/// with every object that has the same set (a workload's replicas; `k8s::intern`). A clone is
/// a reference count.
///
/// One text, not a list of shared strings: a set is nearly always its own (a pod's
/// `pod-template-hash`, a StatefulSet pod's name), and as a list of pairs of shared strings it
/// cost a pair of fat pointers per label besides the set, its unique strings and their table
/// entries (~270 bytes a pod, 36 MiB at 150,000 pods; issue 29). Each key and value is written
/// after its length in bytes and a colon (`3:app3:web`), so any text reads back exactly.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Labels(Arc<str>);

impl Labels {
    pub fn get(&self, key: &str) -> Option<&str> {
        for (k, v) in self.iter() {
            match k.cmp(key) {
                std::cmp::Ordering::Less => continue,
                std::cmp::Ordering::Equal => return Some(v),
                std::cmp::Ordering::Greater => return None,
            }
        }
        None
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        let mut rest: &str = &self.0;
        std::iter::from_fn(move || {
            let (key, after_key) = next_text(rest)?;
            let (value, after_value) = next_text(after_key)?;
            rest = after_value;
            Some((key, value))
        })
    }

    pub fn len(&self) -> usize {
        self.iter().count()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Both are the one shared copy of their set.
    pub fn same_set(&self, other: &Labels) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// The shared set of `pairs`, sorted by key with each key once.
    pub(super) fn of_sorted(pairs: &[(&str, &str)]) -> Self {
        thread_local! {
            /// The text of the set looked up: a set already kept (nearly every lookup: a pod
            /// updated, a replica) allocates nothing.
            static TEXT: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
        }
        TEXT.with_borrow_mut(|text| {
            text.clear();
            for (key, value) in pairs {
                for part in [key, value] {
                    use std::fmt::Write;
                    let _ = write!(text, "{}:{part}", part.len());
                }
            }
            Labels(intern::label_set(text))
        })
    }
}

/// The first text of an encoded set and what follows it; `None` at the end.
fn next_text(encoded: &str) -> Option<(&str, &str)> {
    let (len, rest) = encoded.split_once(':')?;
    let len: usize = len.parse().ok()?;
    // Always on a boundary: the length was written from this very text.
    Some((rest.get(..len)?, rest.get(len..)?))
}

impl Default for Labels {
    fn default() -> Self {
        Labels::of_sorted(&[])
    }
}

impl std::fmt::Debug for Labels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

/// Later pairs win over earlier ones with the same key.
impl<K: AsRef<str>, V: AsRef<str>> FromIterator<(K, V)> for Labels {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(pairs: I) -> Self {
        let pairs: Vec<(K, V)> = pairs.into_iter().collect();
        let mut sorted: BTreeMap<&str, &str> = BTreeMap::new();
        for (k, v) in &pairs {
            sorted.insert(k.as_ref(), v.as_ref());
        }
        let sorted: Vec<(&str, &str)> = sorted.into_iter().collect();
        Labels::of_sorted(&sorted)
    }
}

impl<K: AsRef<str>, V: AsRef<str>, const N: usize> From<[(K, V); N]> for Labels {
    fn from(pairs: [(K, V); N]) -> Self {
        pairs.into_iter().collect()
    }
}

impl From<&BTreeMap<String, String>> for Labels {
    fn from(map: &BTreeMap<String, String>) -> Self {
        // Sorted by key, each key once already.
        let pairs: Vec<(&str, &str)> = map.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        Labels::of_sorted(&pairs)
    }
}

/// L4 protocols a Kubernetes object can name (a container port, a NetworkPolicy port).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    /// Parses the Kubernetes spelling (case-sensitive, as the API server is).
    pub fn from_k8s(value: &str) -> Option<Protocol> {
        match value {
            "TCP" => Some(Protocol::Tcp),
            "UDP" => Some(Protocol::Udp),
            "SCTP" => Some(Protocol::Sctp),
            _ => None,
        }
    }

    /// IANA protocol number, as found in the IP header (what the datapath sees).
    pub fn ip_protocol_number(self) -> u8 {
        match self {
            Protocol::Tcp => 6,
            Protocol::Udp => 17,
            Protocol::Sctp => 132,
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// Any keys and values (colons, digits, the empty string, non-ASCII) read back as they
        /// were given, in key order, and equal sets are one shared copy.
        #[test]
        fn a_set_reads_back_as_given(map in proptest::collection::btree_map("[a-z0-9:é/]{0,6}", "[a-z0-9:é]{0,6}", 0..6)) {
            let labels = Labels::from(&map);
            let read: Vec<(&str, &str)> = labels.iter().collect();
            let given: Vec<(&str, &str)> = map.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            proptest::prop_assert_eq!(read, given);
            proptest::prop_assert_eq!(labels.len(), map.len());
            proptest::prop_assert_eq!(labels.is_empty(), map.is_empty());
            for (key, value) in &map {
                proptest::prop_assert_eq!(labels.get(key), Some(value.as_str()));
            }
            for absent in ["", "zz", "0", ":"] {
                proptest::prop_assert_eq!(labels.get(absent), map.get(absent).map(String::as_str));
            }
            let again: Labels = map.iter().rev().collect();
            proptest::prop_assert!(labels.same_set(&again));
        }
    }

    #[test]
    fn sets_that_differ_where_their_texts_meet_are_not_one_set() {
        let (ab, a_b) = (Labels::from([("ab", "")]), Labels::from([("a", "b")]));
        assert!(!ab.same_set(&a_b) && ab != a_b);
        assert_eq!(ab.get("ab"), Some(""));
        assert_eq!(a_b.get("a"), Some("b"));
        assert!(Labels::default().is_empty());
        assert_ne!(Labels::default(), Labels::from([("", "")]));
        assert_eq!(Labels::from([("", "")]).get(""), Some(""));
        // Later pairs win.
        assert_eq!(Labels::from([("app", "a"), ("app", "b")]).get("app"), Some("b"));
    }
}
