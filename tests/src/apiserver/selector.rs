//! Label and field selectors in the Kubernetes string syntax.
//!
//! Supported: `k=v`, `k==v`, `k!=v`, `k` (exists), `!k` (does not exist),
//! `k in (a,b)`, `k notin (a,b)`, joined by commas.

use serde_json::Value;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Requirement {
    Equals(String, String),
    NotEquals(String, String),
    Exists(String),
    NotExists(String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

/// A parsed selector; the empty selector matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selector {
    requirements: Vec<Requirement>,
}

impl Selector {
    /// Parses the query-string form. Errors name the offending term so a 400 can explain itself.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut requirements = Vec::new();
        for term in split_top_level_commas(text) {
            let term = term.trim();
            if term.is_empty() {
                continue;
            }
            requirements.push(parse_requirement(term)?);
        }
        Ok(Self { requirements })
    }

    /// `lookup` returns the value under a key (a label, or a field path), if present.
    /// Negative requirements match absent keys, as in Kubernetes.
    pub fn matches(&self, lookup: impl Fn(&str) -> Option<String>) -> bool {
        self.requirements.iter().all(|requirement| match requirement {
            Requirement::Equals(key, value) => lookup(key).as_deref() == Some(value.as_str()),
            Requirement::NotEquals(key, value) => lookup(key).as_deref() != Some(value.as_str()),
            Requirement::Exists(key) => lookup(key).is_some(),
            Requirement::NotExists(key) => lookup(key).is_none(),
            Requirement::In(key, values) => lookup(key).is_some_and(|found| values.contains(&found)),
            Requirement::NotIn(key, values) => lookup(key).is_none_or(|found| !values.contains(&found)),
        })
    }

    pub fn matches_labels(&self, object: &Value) -> bool {
        let labels = object.pointer("/metadata/labels");
        self.matches(|key| labels.and_then(|labels| labels.get(key)).and_then(Value::as_str).map(str::to_string))
    }

    /// Field paths are dotted (`metadata.name`, `spec.nodeName`); scalars compare as text.
    pub fn matches_fields(&self, object: &Value) -> bool {
        self.matches(|path| {
            let mut current = object;
            for segment in path.split('.') {
                current = current.get(segment)?;
            }
            match current {
                Value::String(text) => Some(text.clone()),
                Value::Bool(_) | Value::Number(_) => Some(current.to_string()),
                _ => None,
            }
        })
    }
}

/// Splits on commas that are not inside `( … )`, so set values stay together.
fn split_top_level_commas(text: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (index, character) in text.char_indices() {
        match character {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                parts.push(&text[start..index]);
                start = index + 1;
            }
            _ => {}
        }
    }
    parts.push(&text[start..]);
    parts
}

fn parse_requirement(term: &str) -> Result<Requirement, String> {
    if let Some((key, value)) = term.split_once("!=") {
        return Ok(Requirement::NotEquals(checked_key(key, term)?, value.trim().to_string()));
    }
    if let Some((key, value)) = term.split_once("==").or_else(|| term.split_once('=')) {
        return Ok(Requirement::Equals(checked_key(key, term)?, value.trim().to_string()));
    }
    if let Some(key) = term.strip_prefix('!') {
        return Ok(Requirement::NotExists(checked_key(key, term)?));
    }
    if let Some(open) = term.find('(') {
        let head = term[..open].trim();
        let values_text = term[open + 1..]
            .strip_suffix(')')
            .ok_or_else(|| format!("unterminated value set in selector term {term:?}"))?;
        let values =
            values_text.split(',').map(|value| value.trim().to_string()).filter(|value| !value.is_empty()).collect();
        let mut words = head.split_whitespace();
        let (Some(key), Some(operator), None) = (words.next(), words.next(), words.next()) else {
            return Err(format!("malformed set selector term {term:?}"));
        };
        let key = checked_key(key, term)?;
        return match operator {
            "in" => Ok(Requirement::In(key, values)),
            "notin" => Ok(Requirement::NotIn(key, values)),
            _ => Err(format!("unknown operator {operator:?} in selector term {term:?}")),
        };
    }
    Ok(Requirement::Exists(checked_key(term, term)?))
}

fn checked_key(key: &str, term: &str) -> Result<String, String> {
    let key = key.trim();
    let valid = !key.is_empty() && key.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'));
    if valid {
        Ok(key.to_string())
    } else {
        Err(format!("invalid key {key:?} in selector term {term:?}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn labelled(labels: Value) -> Value {
        json!({"metadata": {"name": "x", "labels": labels}})
    }

    #[test]
    fn equality_inequality_and_existence() {
        let object = labelled(json!({"app": "web", "tier": "front"}));
        let matches = |text: &str| Selector::parse(text).unwrap().matches_labels(&object);
        assert!(matches(""));
        assert!(matches("app=web"));
        assert!(matches("app==web,tier!=back"));
        assert!(!matches("app=db"));
        assert!(matches("tier"));
        assert!(!matches("missing"));
        assert!(matches("!missing"));
        assert!(matches("missing!=x"));
        assert!(matches("app in (db, web)"));
        assert!(!matches("app notin (db,web)"));
        assert!(matches("missing notin (a)"));
    }

    #[test]
    fn field_paths() {
        let object = json!({"metadata": {"name": "a", "namespace": "n"}, "spec": {"x": 3}});
        let matches = |text: &str| Selector::parse(text).unwrap().matches_fields(&object);
        assert!(matches("metadata.name=a,metadata.namespace=n"));
        assert!(matches("spec.x=3"));
        assert!(!matches("metadata.name!=a"));
    }

    #[test]
    fn garbage_is_rejected_not_panicking() {
        for text in ["=x", "a b", "k in (a", "k foo (a)", "(", "!", "a=b,,=", "é=1"] {
            assert!(Selector::parse(text).is_err(), "{text:?} should not parse");
        }
    }
}
