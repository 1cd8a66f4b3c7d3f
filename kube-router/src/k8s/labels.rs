//! The labels of a Pod or Namespace as the API layer keeps them (interned, `k8s::intern`), and
//! the L4 protocols a Kubernetes object names: what the slimmed Pods hold and NetworkPolicy reads.
use std::{collections::BTreeMap, fmt, sync::Arc};

use super::intern::{self, LabelPairs};

/// Labels of a pod or namespace: pairs sorted by key, shared with every object that has the
/// same set (a workload's replicas) and their strings shared with every object that has them
/// (`k8s::intern`). A clone is a reference count.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Labels(Arc<LabelPairs>);

impl Labels {
    pub fn get(&self, key: &str) -> Option<&str> {
        let found = self.0.binary_search_by(|(k, _)| (**k).cmp(key)).ok()?;
        Some(&self.0[found].1)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(k, v)| (&**k, &**v))
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Both are the one shared copy of their set.
    pub fn same_set(&self, other: &Labels) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Default for Labels {
    fn default() -> Self {
        Labels::from_iter(std::iter::empty::<(&str, &str)>())
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
        Labels(intern::label_set(&sorted))
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
        Labels(intern::label_set(&pairs))
    }
}

impl Labels {
    /// The set of `pairs`, sorted by key and each key once already (a decoded label map's).
    pub(super) fn from_sorted_pairs(pairs: &[(&str, &str)]) -> Self {
        Labels(intern::label_set(pairs))
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
