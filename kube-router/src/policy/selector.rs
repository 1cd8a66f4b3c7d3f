//! Label selectors (matchLabels + matchExpressions), validated and normalised
//! so that equal selectors compare equal and can key shared peer sets.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use crate::k8s::intern::{self, LabelPairs};

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

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Operator {
    In,
    NotIn,
    Exists,
    DoesNotExist,
}

/// One matchExpressions entry.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Requirement {
    pub key: String,
    pub operator: Operator,
    pub values: BTreeSet<String>,
}

impl Requirement {
    fn matches(&self, labels: &Labels) -> bool {
        let value = labels.get(&self.key);
        let contains = |v: &str| self.values.contains(v);
        match self.operator {
            Operator::In => value.is_some_and(contains),
            // Absent labels satisfy NotIn, as in Kubernetes.
            Operator::NotIn => value.is_none_or(|v| !contains(v)),
            Operator::Exists => value.is_some(),
            Operator::DoesNotExist => value.is_none(),
        }
    }
}

/// A validated label selector; all parts are ANDed. The empty selector
/// matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Selector {
    pub match_labels: BTreeMap<String, String>,
    /// Sorted and deduplicated.
    pub expressions: Vec<Requirement>,
}

impl Selector {
    pub fn everything() -> Selector {
        Selector::default()
    }

    pub fn matches(&self, labels: &Labels) -> bool {
        self.match_labels.iter().all(|(key, value)| labels.get(key) == Some(value.as_str()))
            && self.expressions.iter().all(|req| req.matches(labels))
    }

    /// Validates a Kubernetes selector. The error is a human readable reason.
    pub fn from_k8s(selector: &LabelSelector) -> Result<Selector, String> {
        let match_labels = selector.match_labels.clone().unwrap_or_default();
        let mut expressions = Vec::new();
        for (index, expr) in selector.match_expressions.iter().flatten().enumerate() {
            let operator = match expr.operator.as_str() {
                "In" => Operator::In,
                "NotIn" => Operator::NotIn,
                "Exists" => Operator::Exists,
                "DoesNotExist" => Operator::DoesNotExist,
                other => {
                    return Err(format!(
                        "matchExpressions[{index}]: unknown operator {other:?} \
                         (expected In, NotIn, Exists or DoesNotExist)"
                    ))
                }
            };
            let values: BTreeSet<String> = expr.values.iter().flatten().cloned().collect();
            let wants_values = matches!(operator, Operator::In | Operator::NotIn);
            if wants_values && values.is_empty() {
                return Err(format!("matchExpressions[{index}]: operator {operator:?} needs at least one value"));
            }
            if !wants_values && !values.is_empty() {
                return Err(format!("matchExpressions[{index}]: operator {operator:?} takes no values"));
            }
            if expr.key.is_empty() {
                return Err(format!("matchExpressions[{index}]: empty key"));
            }
            expressions.push(Requirement { key: expr.key.clone(), operator, values });
        }
        expressions.sort();
        expressions.dedup();
        Ok(Selector { match_labels, expressions })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn expr(key: &str, op: &str, values: &[&str]) -> LabelSelector {
        LabelSelector {
            match_labels: None,
            match_expressions: Some(vec![LabelSelectorRequirement {
                key: key.into(),
                operator: op.into(),
                values: if values.is_empty() { None } else { Some(values.iter().map(|v| v.to_string()).collect()) },
            }]),
        }
    }

    #[test]
    fn empty_selector_matches_everything() {
        let sel = Selector::from_k8s(&LabelSelector::default()).unwrap();
        assert!(sel.matches(&labels(&[])));
        assert!(sel.matches(&labels(&[("a", "b")])));
    }

    #[test]
    fn match_labels_require_every_pair() {
        let sel = Selector::from_k8s(&LabelSelector {
            match_labels: Some([("app", "web"), ("tier", "fe")].map(|(k, v)| (k.to_string(), v.to_string())).into()),
            match_expressions: None,
        })
        .unwrap();
        assert!(sel.matches(&labels(&[("app", "web"), ("tier", "fe"), ("x", "y")])));
        assert!(!sel.matches(&labels(&[("app", "web")])));
        assert!(!sel.matches(&labels(&[("app", "web"), ("tier", "be")])));
    }

    #[test]
    fn in_and_not_in() {
        let in_sel = Selector::from_k8s(&expr("env", "In", &["prod", "stage"])).unwrap();
        assert!(in_sel.matches(&labels(&[("env", "prod")])));
        assert!(!in_sel.matches(&labels(&[("env", "dev")])));
        assert!(!in_sel.matches(&labels(&[])));

        let not_in = Selector::from_k8s(&expr("env", "NotIn", &["prod"])).unwrap();
        assert!(not_in.matches(&labels(&[("env", "dev")])));
        assert!(!not_in.matches(&labels(&[("env", "prod")])));
        assert!(not_in.matches(&labels(&[])), "absent label satisfies NotIn");
    }

    #[test]
    fn exists_and_does_not_exist() {
        let exists = Selector::from_k8s(&expr("env", "Exists", &[])).unwrap();
        assert!(exists.matches(&labels(&[("env", "")])));
        assert!(!exists.matches(&labels(&[])));
        let absent = Selector::from_k8s(&expr("env", "DoesNotExist", &[])).unwrap();
        assert!(absent.matches(&labels(&[])));
        assert!(!absent.matches(&labels(&[("env", "x")])));
    }

    #[test]
    fn invalid_expressions_are_rejected() {
        assert!(Selector::from_k8s(&expr("env", "Like", &["x"])).is_err());
        assert!(Selector::from_k8s(&expr("env", "In", &[])).is_err());
        assert!(Selector::from_k8s(&expr("env", "Exists", &["x"])).is_err());
        assert!(Selector::from_k8s(&expr("", "Exists", &[])).is_err());
    }

    #[test]
    fn equivalent_selectors_normalise_equal() {
        let mut a = expr("k", "In", &["b", "a"]);
        let b = expr("k", "In", &["a", "b", "a"]);
        let sa = Selector::from_k8s(&a).unwrap();
        assert_eq!(sa, Selector::from_k8s(&b).unwrap());
        let duplicate = a.match_expressions.as_ref().unwrap()[0].clone();
        a.match_expressions.as_mut().unwrap().push(duplicate);
        assert_eq!(sa, Selector::from_k8s(&a).unwrap());
    }
}
