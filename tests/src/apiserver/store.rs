//! In-memory object storage with an etcd-like global revision counter and a bounded event
//! history, which is what makes watch resumption (and its failure, 410 Gone) possible.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Context};
use serde_json::{json, Value};
use tokio::sync::broadcast;

use super::resources::{self, ResourceType};

/// How many undelivered notices a watch may fall behind before it is told its
/// resource version is too old (the stream then gets an in-stream 410).
const NOTICE_BUFFER: usize = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    Added,
    Modified,
    Deleted,
}

/// One committed change, as kept in history and fanned out to watches.
#[derive(Debug)]
pub struct ChangeEvent {
    pub resource_version: u64,
    pub resource: &'static ResourceType,
    pub namespace: String,
    pub event_type: EventType,
    /// The object after the change (for deletions: its last state, with the deletion's RV).
    pub object: Value,
    /// The object before a modification; lets selector-filtered watches turn a modification
    /// into ADDED or DELETED when the object enters or leaves the selection.
    pub previous: Option<Value>,
}

/// What live watches receive, in commit order.
#[derive(Debug, Clone)]
pub enum Notice {
    Change(Arc<ChangeEvent>),
    /// "Everything up to this revision has been sent": the bookmark ticker's heartbeat.
    Bookmark(u64),
}

/// Why a watch or paginated list cannot continue from the requested revision.
#[derive(Debug)]
pub struct Expired;

/// A watch attached to the store: what to send first, then the live feed.
pub struct Subscription {
    /// Events to send before anything live (history replay, or synthetic ADDED on a fresh watch).
    pub backlog: Vec<Arc<ChangeEvent>>,
    /// The store revision when the subscription was taken.
    pub resource_version: u64,
    pub notices: broadcast::Receiver<Notice>,
}

type ObjectKey = (&'static str, String, String);

/// An object as stored, with its JSON text: what serialising the value gives, encoded once when
/// it is stored rather than again for every list page that holds it. The server shares the
/// machine's cores with the agent under test (a real API server does not), so its encoding of
/// 150,000 Pods on every start was the agent's start too (docs/benchmarks.md).
pub struct Stored {
    pub value: Value,
    pub text: Box<[u8]>,
}

impl Stored {
    fn new(value: Value) -> Self {
        let text = serde_json::to_vec(&value).expect("a JSON value serialises").into_boxed_slice();
        Self { value, text }
    }
}

pub struct Store {
    objects: BTreeMap<ObjectKey, Stored>,
    resource_version: u64,
    history: VecDeque<Arc<ChangeEvent>>,
    history_limit: usize,
    /// Events with a revision at or below this are gone; resuming from below it is impossible.
    compacted_through: u64,
    notices: broadcast::Sender<Notice>,
    uid_seed: u32,
    uid_counter: u64,
}

impl Store {
    pub fn new(history_limit: usize) -> Self {
        let (notices, _) = broadcast::channel(NOTICE_BUFFER);
        let uid_seed = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|elapsed| elapsed.subsec_nanos() ^ (elapsed.as_secs() as u32))
            .unwrap_or(0);
        Self {
            objects: BTreeMap::new(),
            resource_version: 0,
            history: VecDeque::new(),
            history_limit: history_limit.max(1),
            compacted_through: 0,
            notices,
            uid_seed,
            uid_counter: 0,
        }
    }

    pub fn resource_version(&self) -> u64 {
        self.resource_version
    }

    /// Creates or replaces an object, returning it as stored.
    pub fn apply(&mut self, mut object: Value) -> anyhow::Result<Value> {
        let api_version =
            object.get("apiVersion").and_then(Value::as_str).context("object has no apiVersion")?.to_string();
        let kind = object.get("kind").and_then(Value::as_str).context("object has no kind")?.to_string();
        let resource = resources::find_by_api_version_kind(&api_version, &kind)
            .ok_or_else(|| anyhow!("resource type {api_version}/{kind} is not served"))?;
        let metadata = object.get_mut("metadata").and_then(Value::as_object_mut).context("object has no metadata")?;
        let name = metadata
            .get("name")
            .and_then(Value::as_str)
            .filter(|name| !name.is_empty())
            .context("object has no metadata.name")?
            .to_string();
        let namespace = if resource.namespaced {
            let namespace = metadata
                .get("namespace")
                .and_then(Value::as_str)
                .filter(|namespace| !namespace.is_empty())
                .unwrap_or("default")
                .to_string();
            metadata.insert("namespace".into(), json!(namespace));
            namespace
        } else {
            metadata.remove("namespace");
            String::new()
        };

        let key = (resource.kind, namespace.clone(), name);
        let previous = self.objects.get(&key).map(|stored| stored.value.clone());
        // Identity and birth time survive replacement, as they would on a real update.
        let inherited =
            |field: &str| previous.as_ref().and_then(|old| old.pointer(&format!("/metadata/{field}"))).cloned();
        if !metadata.contains_key("uid") {
            let uid = inherited("uid").unwrap_or_else(|| json!(self.next_uid()));
            metadata.insert("uid".into(), uid);
        }
        if !metadata.contains_key("creationTimestamp") {
            let created = inherited("creationTimestamp").unwrap_or_else(|| json!(rfc3339_now()));
            metadata.insert("creationTimestamp".into(), created);
        }

        self.resource_version += 1;
        let resource_version = self.resource_version;
        metadata.insert("resourceVersion".into(), json!(resource_version.to_string()));
        self.objects.insert(key, Stored::new(object.clone()));

        let event_type = if previous.is_some() { EventType::Modified } else { EventType::Added };
        self.commit(ChangeEvent {
            resource_version,
            resource,
            namespace,
            event_type,
            object: object.clone(),
            previous,
        });
        Ok(object)
    }

    /// Removes an object; `Ok(None)` when it did not exist.
    pub fn delete(&mut self, kind: &str, namespace: Option<&str>, name: &str) -> anyhow::Result<Option<Value>> {
        let resource = resources::find_by_kind(kind).ok_or_else(|| anyhow!("kind {kind} is not served"))?;
        let namespace = match (resource.namespaced, namespace) {
            (true, Some(namespace)) => namespace.to_string(),
            (true, None) => bail!("{kind} is namespaced: a namespace is required"),
            (false, _) => String::new(),
        };
        let Some(Stored { value: mut object, .. }) =
            self.objects.remove(&(resource.kind, namespace.clone(), name.to_string()))
        else {
            return Ok(None);
        };
        // The deletion is a revision of its own, carried by the DELETED event's object.
        self.resource_version += 1;
        let resource_version = self.resource_version;
        if let Some(metadata) = object.get_mut("metadata").and_then(Value::as_object_mut) {
            metadata.insert("resourceVersion".into(), json!(resource_version.to_string()));
        }
        self.commit(ChangeEvent {
            resource_version,
            resource,
            namespace,
            event_type: EventType::Deleted,
            object: object.clone(),
            previous: None,
        });
        Ok(Some(object))
    }

    /// Forgets all history, so any watch resuming from a revision seen before this call gets
    /// 410 Gone. Compaction takes a revision of its own: that gives clients a fresh revision to
    /// list at which is resumable, instead of one that is expired on arrival.
    pub fn compact(&mut self) {
        self.resource_version += 1;
        self.compacted_through = self.resource_version;
        self.history.clear();
    }

    pub fn get(&self, kind: &str, namespace: Option<&str>, name: &str) -> Option<Value> {
        let resource = resources::find_by_kind(kind)?;
        let namespace = if resource.namespaced { namespace? } else { "" };
        self.objects.get(&(resource.kind, namespace.to_string(), name.to_string())).map(|stored| stored.value.clone())
    }

    /// Objects of one type, in (namespace, name) order, optionally restricted to one namespace
    /// and starting after `after` (a (namespace, name) pair, for pagination).
    pub fn objects_of<'a>(
        &'a self,
        resource: &'static ResourceType,
        namespace: Option<&'a str>,
        after: Option<(&'a str, &'a str)>,
    ) -> impl Iterator<Item = &'a Stored> + 'a {
        let lower = match after {
            Some((namespace, name)) => {
                std::ops::Bound::Excluded((resource.kind, namespace.to_string(), name.to_string()))
            }
            None => std::ops::Bound::Included((resource.kind, String::new(), String::new())),
        };
        self.objects
            .range((lower, std::ops::Bound::Unbounded))
            .take_while(move |((kind, _, _), _)| *kind == resource.kind)
            .filter(move |((_, object_namespace, _), _)| namespace.is_none_or(|wanted| wanted == object_namespace))
            .map(|(_, object)| object)
    }

    /// Whether a list or watch may continue from `resource_version`.
    pub fn is_resumable(&self, resource_version: u64) -> bool {
        resource_version >= self.compacted_through
    }

    /// Attaches a watch. `since: None` starts with the current objects as synthetic ADDED
    /// events (like resourceVersion "" or "0"); `Some(rv)` replays history after `rv`.
    pub fn subscribe(&self, resource: &'static ResourceType, since: Option<u64>) -> Result<Subscription, Expired> {
        let backlog = match since {
            Some(since) if !self.is_resumable(since) => return Err(Expired),
            Some(since) => self
                .history
                .iter()
                .filter(|event| event.resource_version > since && event.resource == resource)
                .cloned()
                .collect(),
            None => self
                .objects_of(resource, None, None)
                .map(|Stored { value: object, .. }| {
                    Arc::new(ChangeEvent {
                        resource_version: self.resource_version,
                        resource,
                        namespace: object
                            .pointer("/metadata/namespace")
                            .and_then(Value::as_str)
                            .unwrap_or_default()
                            .to_string(),
                        event_type: EventType::Added,
                        object: object.clone(),
                        previous: None,
                    })
                })
                .collect(),
        };
        // Subscribing while holding `&self` (under the server's lock) means no commit can slip
        // between the backlog and the live feed.
        Ok(Subscription { backlog, resource_version: self.resource_version, notices: self.notices.subscribe() })
    }

    /// Sends a bookmark at the current revision to every live watch.
    pub fn broadcast_bookmark(&self) {
        // No receivers is normal (no open watches).
        let _ = self.notices.send(Notice::Bookmark(self.resource_version));
    }

    fn commit(&mut self, event: ChangeEvent) {
        let event = Arc::new(event);
        self.history.push_back(event.clone());
        while self.history.len() > self.history_limit {
            if let Some(dropped) = self.history.pop_front() {
                self.compacted_through = self.compacted_through.max(dropped.resource_version);
            }
        }
        let _ = self.notices.send(Notice::Change(event));
    }

    fn next_uid(&mut self) -> String {
        self.uid_counter += 1;
        format!("{:08x}-0000-4000-8000-{:012x}", self.uid_seed, self.uid_counter)
    }
}

/// Current UTC time as `YYYY-MM-DDTHH:MM:SSZ`, the form Kubernetes uses for timestamps.
pub fn rfc3339_now() -> String {
    let seconds = SystemTime::now().duration_since(UNIX_EPOCH).map(|elapsed| elapsed.as_secs()).unwrap_or(0);
    let days = (seconds / 86_400) as i64;
    let second_of_day = seconds % 86_400;
    let (year, month, day) = civil_date_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        second_of_day / 3600,
        second_of_day / 60 % 60,
        second_of_day % 60
    )
}

/// Gregorian (year, month, day) for a count of days since 1970-01-01, via 400-year eras.
fn civil_date_from_days(days_since_epoch: i64) -> (i64, u32, u32) {
    let shifted = days_since_epoch + 719_468; // days since 0000-03-01
    let era = shifted.div_euclid(146_097);
    let day_of_era = shifted.rem_euclid(146_097);
    let year_of_era = (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * month_from_march + 2) / 5 + 1) as u32;
    let month = if month_from_march < 10 { month_from_march + 3 } else { month_from_march - 9 } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service(name: &str) -> Value {
        json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name}})
    }

    #[test]
    fn dates() {
        assert_eq!(civil_date_from_days(0), (1970, 1, 1));
        assert_eq!(civil_date_from_days(19_782), (2024, 2, 29));
        assert_eq!(civil_date_from_days(20_000), (2024, 10, 4));
    }

    #[test]
    fn apply_fills_metadata_and_keeps_identity() {
        let mut store = Store::new(10);
        let first = store.apply(service("a")).unwrap();
        assert_eq!(first["metadata"]["namespace"], "default");
        assert_eq!(first["metadata"]["resourceVersion"], "1");
        let second = store.apply(service("a")).unwrap();
        assert_eq!(second["metadata"]["resourceVersion"], "2");
        assert_eq!(second["metadata"]["uid"], first["metadata"]["uid"]);
        assert!(store.apply(json!({"kind": "Service"})).is_err());
        assert!(store.apply(json!({"apiVersion": "v9", "kind": "Service", "metadata": {"name": "x"}})).is_err());
    }

    #[test]
    fn history_overflow_and_compaction_expire_old_revisions() {
        let mut store = Store::new(2);
        let resource = resources::find_by_kind("Service").unwrap();
        for name in ["a", "b", "c"] {
            store.apply(service(name)).unwrap();
        }
        assert!(store.subscribe(resource, Some(0)).is_err());
        assert_eq!(store.subscribe(resource, Some(1)).unwrap().backlog.len(), 2);
        store.compact();
        assert!(store.subscribe(resource, Some(3)).is_err());
        assert!(store.subscribe(resource, Some(4)).is_ok());
        assert_eq!(store.subscribe(resource, None).unwrap().backlog.len(), 3);
    }
}
