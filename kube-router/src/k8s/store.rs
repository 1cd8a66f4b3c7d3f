//! What the watchers have seen of each resource kind, built from watcher events alone.
//!
//! The store never forgets an object because of an error: only an `Apply`/`Delete` or a
//! completed relist changes it. A relist (`Init` .. `InitDone`) is noted beside the objects and
//! applied only at `InitDone`, so a list that breaks halfway (API outage) removes nothing — an
//! empty or failed list is not "no services".
use std::{
    collections::{BTreeMap, BTreeSet},
    marker::PhantomData,
    sync::Arc,
};

use kube::{runtime::watcher::Event, Resource, ResourceExt};
use serde::{de::DeserializeOwned, Deserialize, Serialize};

use super::{intern, slim::Slim};

/// An object's (namespace, name); the namespace is "" for cluster-scoped kinds. Ordered as
/// that pair. The namespace is the shared copy (`k8s::intern`: a few thousand name 150,000
/// objects) and a Pod's or Namespace's name is the one its slimmed object holds, so their keys
/// allocate nothing: two `String`s were 48 bytes and two allocations a key, in the stores, their
/// feeds and the journal (issue 29).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjectKey {
    pub namespace: Arc<str>,
    pub name: Arc<str>,
}

impl ObjectKey {
    pub fn new(namespace: &str, name: &str) -> Self {
        Self { namespace: intern::string(namespace), name: Arc::from(name) }
    }
}

/// As the `[namespace, name]` pair the checkpoint's journal has always written.
impl Serialize for ObjectKey {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        (&*self.namespace, &*self.name).serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for ObjectKey {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let (namespace, name) = <(String, String)>::deserialize(deserializer)?;
        Ok(Self::new(&namespace, &name))
    }
}

/// How a store keeps its objects: decoded and shared ([`Arc`]), or [`Packed`]. Either way a
/// snapshot for the checkpoint costs a pointer per object on the agent's loop.
pub trait Held<K>: Clone + PartialEq {
    fn hold(object: K) -> Self;
    /// The object held, with its key; overridden where the held form's names can be the key's.
    fn keyed(object: K) -> (ObjectKey, Self)
    where
        K: Resource,
    {
        (key_of(&object), Self::hold(object))
    }
    /// The object's resourceVersion as a number (see [`version_of`]).
    fn version(&self) -> Option<u64>;
    /// Equal but for the resourceVersion: an update of nothing the agent keeps.
    fn same_apart_from_version(&self, other: &Self) -> bool;
}

impl<K: Resource + Clone> Held<K> for Arc<K>
where
    K: PartialEq,
{
    fn hold(object: K) -> Self {
        Arc::new(object)
    }
    fn version(&self) -> Option<u64> {
        version_of(&**self)
    }
    fn same_apart_from_version(&self, other: &Self) -> bool {
        // A slimmed object is small: one copy to compare is cheaper than waking a controller.
        let mut mine = (**self).clone();
        mine.meta_mut().resource_version = other.meta().resource_version.clone();
        mine == **other
    }
}

/// An object kept as its JSON text, decoded when read. For the kinds of which the agent keeps
/// many and reads few at a time: an EndpointSlice of 10 endpoints is ~1 KiB of JSON, and
/// ~5.5 KiB decoded (a k8s-openapi `Endpoint` is 352 bytes before its strings).
pub struct Packed<K> {
    json: Arc<[u8]>,
    version: Option<u64>,
    /// The length of the resourceVersion's text, when there is one.
    version_len: Option<u32>,
    kind: PhantomData<fn() -> K>,
}

impl<K> Clone for Packed<K> {
    fn clone(&self) -> Self {
        Self { json: self.json.clone(), version: self.version, version_len: self.version_len, kind: PhantomData }
    }
}

/// The same text is the same object: serialisation is deterministic (fields in declaration
/// order, maps sorted).
impl<K> PartialEq for Packed<K> {
    fn eq(&self, other: &Self) -> bool {
        self.json == other.json
    }
}

impl<K: Resource + Serialize> Held<K> for Packed<K> {
    fn hold(object: K) -> Self {
        let json = serde_json::to_vec(&object).expect("a Kubernetes object serialises");
        let version_len = object.meta().resource_version.as_ref().and_then(|v| u32::try_from(v.len()).ok());
        Self { json: json.into(), version: version_of(&object), version_len, kind: PhantomData }
    }
    fn version(&self) -> Option<u64> {
        self.version
    }
    fn same_apart_from_version(&self, other: &Self) -> bool {
        // Serialisation is deterministic: two texts of objects equal but for their versions are
        // byte for byte the same around the version's text. Wider differences (nearly every
        // real update) are found without parsing either text.
        if let (Some(mine), Some(theirs)) = (self.version_len, other.version_len) {
            if differs_beyond(&self.json, &other.json, mine, theirs) {
                return false;
            }
        }
        let without_version = |json: &[u8]| {
            let mut value: serde_json::Value = serde_json::from_slice(json).ok()?;
            value.pointer_mut("/metadata")?.as_object_mut()?.remove("resourceVersion");
            Some(value)
        };
        matches!((without_version(&self.json), without_version(&other.json)), (Some(a), Some(b)) if a == b)
    }
}

/// `a` and `b` differ outside a stretch of at most `room_a` bytes of `a` (`room_b` of `b`)
/// in the same place: what is left of each once their common start and end are taken off is
/// longer than that.
fn differs_beyond(a: &[u8], b: &[u8], room_a: u32, room_b: u32) -> bool {
    let start = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    let (a, b) = (&a[start..], &b[start..]);
    let end = a.iter().rev().zip(b.iter().rev()).take_while(|(x, y)| x == y).count();
    let wider = |rest: usize, room: u32| u32::try_from(rest).map_or(true, |rest| rest > room);
    wider(a.len() - end, room_a) || wider(b.len() - end, room_b)
}

impl<K> Packed<K> {
    /// The JSON text (as `Debug` shows it).
    pub fn text(&self) -> &str {
        std::str::from_utf8(&self.json).unwrap_or("<not UTF-8>")
    }
}

impl<K: DeserializeOwned> Packed<K> {
    pub fn decode(&self) -> K {
        serde_json::from_slice(&self.json).expect("the text was serialised from this type")
    }

    /// Part of the object (a struct of some of its fields), without decoding the rest.
    pub fn decode_as<T: DeserializeOwned>(&self) -> Option<T> {
        serde_json::from_slice(&self.json).ok()
    }
}

/// Serialises as the object it holds: its text is passed on as it is (it is that object's own
/// serialisation), so writing a checkpoint does not decode and re-encode 100,000 endpoints.
impl<K> Serialize for Packed<K> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::Error;
        let text = std::str::from_utf8(&self.json).map_err(S::Error::custom)?;
        let raw: &serde_json::value::RawValue = serde_json::from_str(text).map_err(S::Error::custom)?;
        raw.serialize(serializer)
    }
}

pub struct ObjectStore<K, H = Arc<K>> {
    objects: BTreeMap<ObjectKey, H>,
    /// The newer versions of held objects that were updated in nothing but their version (a
    /// readiness flip, a heartbeat): the store keeps the copy it holds, which readers that saw
    /// no change share, and only the number, for the staleness checks. Replacing the copy left
    /// two of every such Pod, the store's and the policy compiler's (issue 29).
    newer_versions: BTreeMap<ObjectKey, Option<u64>>,
    relist: Option<Relist<H>>,
    synced: bool,
    /// Each subscriber's keys whose object changed since it last took them
    /// ([`ObjectStore::take_changes`]); `None`: that reader reads everything next time.
    feeds: Vec<Option<BTreeSet<ObjectKey>>>,
    /// Every change numbered, for readers that each keep their place ([`ObjectStore::changed_since`]);
    /// `None` for the kinds with one reader of changes (it costs two entries per object).
    journal: Option<Journal>,
    kind: PhantomData<fn() -> K>,
}

impl<K, H> Default for ObjectStore<K, H> {
    fn default() -> Self {
        Self {
            objects: BTreeMap::new(),
            newer_versions: BTreeMap::new(),
            relist: None,
            synced: false,
            feeds: Vec::new(),
            journal: None,
            kind: PhantomData,
        }
    }
}

/// A relist under way (`Init` .. `InitDone`), kept beside the objects rather than as a second
/// map of everything listed: after a start from the checkpoint nearly every object is listed
/// unchanged, and a map of 150,000 Pods' keys built in key order (half-full B-tree nodes), then
/// rebuilt through a `Vec` and a sort, was the agent's high-water mark (issue 29). What the
/// listing says of a key held, as the whole buffered listing said it before:
/// * in [`Self::differing`]: listed as that object (new, changed, or applied during the relist);
/// * else at or before [`Self::furthest`] and not in [`Self::unlisted`]: listed as the copy held;
/// * else not listed: gone at `InitDone`.
///
/// A listing in key order (the API server lists in its storage's key order) leaves `unlisted`
/// with only what it no longer has; another order puts the keys it skips there until it lists
/// them.
struct Relist<H> {
    differing: BTreeMap<ObjectKey, H>,
    /// The greatest key listed so far.
    furthest: Option<ObjectKey>,
    /// Keys held at or before `furthest` that were not listed (or were deleted since).
    unlisted: BTreeSet<ObjectKey>,
}

impl<H> Default for Relist<H> {
    fn default() -> Self {
        Self { differing: BTreeMap::new(), furthest: None, unlisted: BTreeSet::new() }
    }
}

impl<H: Clone> Relist<H> {
    /// `key` listed (as the copy held or as an object in `differing`): the held keys between
    /// the furthest listed and it were skipped.
    fn listed(&mut self, key: &ObjectKey, objects: &BTreeMap<ObjectKey, H>) {
        use std::ops::Bound::{Excluded, Unbounded};
        match &self.furthest {
            Some(furthest) if key <= furthest => {
                self.unlisted.remove(key);
            }
            furthest => {
                let from = furthest.as_ref().map_or(Unbounded, Excluded);
                self.unlisted.extend(objects.range::<ObjectKey, _>((from, Excluded(key))).map(|(k, _)| k.clone()));
                self.furthest = Some(key.clone());
            }
        }
    }

    /// `key` deleted during the relist: not listed, whatever the listing said of it before.
    fn deleted(&mut self, key: &ObjectKey) {
        self.differing.remove(key);
        if self.furthest.as_ref().is_some_and(|furthest| key <= furthest) {
            self.unlisted.insert(key.clone());
        }
    }

    /// Whether the listing has `key`, held and not in `differing`, as the copy held.
    fn lists_held(&self, key: &ObjectKey) -> bool {
        self.furthest.as_ref().is_some_and(|furthest| key <= furthest) && !self.unlisted.contains(key)
    }

    /// The objects are about to be replaced (a restore): what the listing said by reference to
    /// the copies held is kept as those copies, and nothing is held any more.
    fn detach(&mut self, objects: &BTreeMap<ObjectKey, H>) {
        for (key, held) in objects {
            if !self.differing.contains_key(key) && self.lists_held(key) {
                self.differing.insert(key.clone(), held.clone());
            }
        }
        self.furthest = None;
        self.unlisted.clear();
    }
}

/// One reader's own set of a store's changes ([`ObjectStore::subscribe`]): readers that take
/// what changed each have theirs, so none takes another's changes (kube-rs's shared reflector
/// gives each subscriber its own stream in the same way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Feed(usize);

/// A place in a store's changes: what a reader has seen ([`ObjectStore::changed_since`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Cursor(u64);

/// What changed since a [`Cursor`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Changes {
    /// The reader has seen nothing yet, or fell behind what the store remembers: read everything.
    All,
    /// The keys whose object was added, changed or removed since.
    Keys(Vec<ObjectKey>),
}

/// Each key's last change, numbered. Several readers of one kind take what changed since their
/// own cursor, without a walk of the objects. Keys of deleted objects stay as entries until
/// there are twice as many entries as objects (at least [`Journal::MIN_KEPT`]); then the oldest
/// go and a reader from before them reads everything again.
#[derive(Debug, Default)]
struct Journal {
    /// The number of the next change.
    next: u64,
    by_key: BTreeMap<ObjectKey, u64>,
    by_number: BTreeMap<u64, ObjectKey>,
    /// The changes before it are forgotten.
    horizon: u64,
}

impl Journal {
    const MIN_KEPT: usize = 1024;

    fn record(&mut self, key: ObjectKey, objects: usize) {
        if let Some(old) = self.by_key.insert(key.clone(), self.next) {
            self.by_number.remove(&old);
        }
        self.by_number.insert(self.next, key);
        self.next += 1;
        while self.by_number.len() > 2 * objects.max(Self::MIN_KEPT) {
            let Some((number, key)) = self.by_number.pop_first() else { break };
            self.by_key.remove(&key);
            self.horizon = number + 1;
        }
    }

    /// Every reader reads everything next time (the objects were replaced wholesale).
    fn forget(&mut self) {
        self.by_key.clear();
        self.by_number.clear();
        // A change of its own: a reader that had seen everything before it reads everything.
        self.next += 1;
        self.horizon = self.next;
    }

    fn since(&self, cursor: Option<Cursor>) -> (Changes, Cursor) {
        let now = Cursor(self.next);
        match cursor {
            Some(Cursor(from)) if from >= self.horizon => {
                (Changes::Keys(self.by_number.range(from..).map(|(_, key)| key.clone()).collect()), now)
            }
            _ => (Changes::All, now),
        }
    }
}

fn key_of<K: Resource>(object: &K) -> ObjectKey {
    ObjectKey::new(object.meta().namespace.as_deref().unwrap_or_default(), &object.name_any())
}

/// An object slimmed and held as a store keeps it, with its key.
pub fn keyed_hold<K: Slim, H: Held<K>>(object: K) -> (ObjectKey, H) {
    H::keyed(object.slim())
}

/// resourceVersions are opaque to clients, but every real API server issues integers
/// (etcd revisions); comparing them lets us ignore an older copy that arrives late.
fn version_of<K: Resource>(object: &K) -> Option<u64> {
    object.meta().resource_version.as_deref().and_then(|v| v.parse().ok())
}

impl<K, H> ObjectStore<K, H> {
    /// A store that numbers its changes for several readers ([`Self::changed_since`]).
    pub fn journaled() -> Self {
        Self { journal: Some(Journal::default()), ..Self::default() }
    }

    /// What changed since `cursor` (`None`: the reader has read nothing yet), and the cursor
    /// to pass next time. Unlike [`Self::take_changes`] it takes nothing away: any number of
    /// readers each keep their own cursor.
    /// Without a journal ([`Self::journaled`]) every read is [`Changes::All`].
    pub fn changed_since(&self, cursor: Option<Cursor>) -> (Changes, Cursor) {
        match &self.journal {
            Some(journal) => journal.since(cursor),
            None => (Changes::All, Cursor(0)),
        }
    }
}

impl<K: Slim, H: Held<K>> ObjectStore<K, H> {
    /// Applies one watcher event; returns whether the visible contents changed.
    pub fn apply(&mut self, event: Event<K>) -> bool {
        match event {
            Event::Init => {
                self.relist = Some(Relist::default());
                false
            }
            Event::InitApply(object) => {
                let (key, object) = keyed_hold::<K, H>(object);
                let relist = self.relist.get_or_insert_with(Relist::default);
                relist.listed(&key, &self.objects);
                // Listed unchanged: nothing kept but the mark, and the listed copy goes now.
                if self.objects.get(&key) == Some(&object) {
                    relist.differing.remove(&key);
                } else {
                    relist.differing.insert(key, object);
                }
                false
            }
            Event::InitDone => self.relisted(),
            Event::Apply(object) => self.upsert(object),
            Event::Delete(object) => {
                let key = key_of(&object);
                if let Some(relist) = self.relist.as_mut() {
                    relist.deleted(&key);
                }
                let stale = matches!((self.version(&key), version_of(&object)), (Some(have), Some(got)) if got < have);
                let removed = !stale && self.objects.remove(&key).is_some();
                if removed {
                    self.newer_versions.remove(&key);
                }
                if let (true, Some(journal)) = (removed, self.journal.as_mut()) {
                    journal.record(key.clone(), self.objects.len());
                }
                if removed {
                    for changed in self.feeds.iter_mut().flatten() {
                        changed.insert(key.clone());
                    }
                }
                removed
            }
        }
    }

    /// The version of the object held under `key`: the newer one it was updated to, if any.
    fn version(&self, key: &ObjectKey) -> Option<u64> {
        match self.newer_versions.get(key) {
            Some(newer) => *newer,
            None => self.objects.get(key).and_then(H::version),
        }
    }

    /// `InitDone`: the listing becomes the store's contents, in place. An object listed again
    /// unchanged stays the copy held (with its key): readers that saw no change (the policy
    /// compiler's pods) still share that one, and replacing it left two copies of every object
    /// after each relist (issue 29, heap profile). Unchanged is equal to the held copy, or to it
    /// at the newer version it was last updated to in nothing else.
    fn relisted(&mut self) -> bool {
        use std::ops::Bound::{Excluded, Unbounded};
        let relist = self.relist.take().unwrap_or_default();
        // The keys that moved, for the readers of changes (none before a reader has read).
        let tracked = self.feeds.iter().any(Option::is_some) || self.journal.is_some();
        let mut moved = BTreeSet::new();
        let mut changed = false;
        let mut newer_versions = BTreeMap::new();
        if self.objects.is_empty() {
            // The first list: everything is new. Rebuilt at once with full B-tree nodes: inserted
            // one by one in the listing's (key) order, the nodes split about half full (issue 29,
            // heap profile).
            self.objects = relist.differing.into_iter().collect();
            changed = !self.objects.is_empty();
            if tracked {
                moved.extend(self.objects.keys().cloned());
            }
        } else {
            let unlisted = relist.unlisted.iter();
            let after = relist.furthest.as_ref().map_or(Unbounded, Excluded);
            let beyond = self.objects.range::<ObjectKey, _>((after, Unbounded)).map(|(key, _)| key);
            let gone: Vec<ObjectKey> =
                unlisted.chain(beyond).filter(|key| !relist.differing.contains_key(*key)).cloned().collect();
            let mut moves = |key: ObjectKey| {
                changed = true;
                if tracked {
                    moved.insert(key);
                }
            };
            for key in gone {
                if self.objects.remove(&key).is_some() {
                    moves(key);
                }
            }
            for (key, object) in relist.differing {
                if let Some((held_key, held)) = self.objects.get_key_value(&key) {
                    if *held == object {
                        continue;
                    }
                    match self.newer_versions.get(&key) {
                        Some(newer) if *newer == object.version() && held.same_apart_from_version(&object) => {
                            newer_versions.insert(held_key.clone(), *newer);
                            continue;
                        }
                        // The listed object under its own key (a Pod's key is its names).
                        _ => self.objects.remove(&key),
                    };
                }
                self.objects.insert(key.clone(), object);
                moves(key);
            }
        }
        if let Some(journal) = self.journal.as_mut() {
            for key in &moved {
                journal.record(key.clone(), self.objects.len());
            }
        }
        for feed in self.feeds.iter_mut().flatten() {
            feed.extend(moved.iter().cloned());
        }
        self.newer_versions = newer_versions;
        // The first complete list always counts: it is what allows deletions at all.
        let changed = changed || !self.synced;
        self.synced = true;
        changed
    }

    fn upsert(&mut self, object: K) -> bool {
        let (key, object) = keyed_hold::<K, H>(object);
        if let Some(relist) = self.relist.as_mut() {
            relist.listed(&key, &self.objects);
            relist.differing.insert(key.clone(), object.clone());
        }
        if let (Some(have), Some(got)) = (self.version(&key), object.version()) {
            if got < have {
                return false;
            }
        }
        if let Some(have) = self.objects.get(&key) {
            if *have == object {
                // Back to the held copy's own version (a duplicate of what it was).
                self.newer_versions.remove(&key);
                return false;
            }
            if have.same_apart_from_version(&object) {
                // Its newer version kept (staleness checks), the copy kept, announced to no one.
                self.newer_versions.insert(key, object.version());
                return false;
            }
        }
        self.newer_versions.remove(&key);
        for changed in self.feeds.iter_mut().flatten() {
            changed.insert(key.clone());
        }
        if let Some(journal) = self.journal.as_mut() {
            journal.record(key.clone(), self.objects.len());
        }
        self.objects.insert(key, object);
        true
    }

    /// A new reader of this store's changes, with its own set of them ([`Self::take_changes`]).
    pub fn subscribe(&mut self) -> Feed {
        self.feeds.push(None);
        Feed(self.feeds.len() - 1)
    }

    /// The keys whose object changed (added, modified, removed) since `feed` last took them;
    /// `None` the first time (and after a restore): everything may have. Other feeds keep theirs.
    /// `feed` must come from this store's [`Self::subscribe`].
    pub fn take_changes(&mut self, feed: Feed) -> Option<BTreeSet<ObjectKey>> {
        self.feeds[feed.0].replace(BTreeSet::new())
    }

    pub fn keys(&self) -> impl Iterator<Item = &ObjectKey> {
        self.objects.keys()
    }

    /// One object as the store keeps it.
    pub fn get_held(&self, key: &ObjectKey) -> Option<&H> {
        self.objects.get(key)
    }

    /// Every object as the store keeps it.
    pub fn held(&self) -> impl Iterator<Item = &H> {
        self.objects.values()
    }

    /// Every object, shared: for a copy made elsewhere.
    pub fn snapshot(&self) -> Vec<H> {
        self.held().cloned().collect()
    }

    /// A complete list has been seen at least once.
    pub fn synced(&self) -> bool {
        self.synced
    }

    pub fn len(&self) -> usize {
        self.objects.len()
    }

    pub fn is_empty(&self) -> bool {
        self.objects.is_empty()
    }

    /// Seeds the store from a checkpoint; it stays unsynced until the API lists it.
    pub fn restore(&mut self, objects: impl IntoIterator<Item = K>) {
        self.restore_held(objects.into_iter().map(keyed_hold));
    }

    /// [`Self::restore`] from objects already in the form the store keeps them.
    pub fn restore_held(&mut self, objects: impl IntoIterator<Item = (ObjectKey, H)>) {
        self.restore_by_key(objects.into_iter().collect());
    }

    /// [`Self::restore_held`] from objects already by key (the checkpoint read for a restore).
    pub fn restore_by_key(&mut self, objects: BTreeMap<ObjectKey, H>) {
        if let Some(relist) = self.relist.as_mut() {
            relist.detach(&self.objects);
        }
        self.objects = objects;
        self.newer_versions.clear();
        self.feeds.iter_mut().for_each(|changed| *changed = None);
        if let Some(journal) = self.journal.as_mut() {
            journal.forget();
        }
    }
}

/// Stores whose objects are kept decoded and shared: the watched kind itself (`Arc<K>`), or a
/// compact form of it (`Arc<SlimPod>` for Pods).
impl<K, T> ObjectStore<K, Arc<T>> {
    pub fn get(&self, key: &ObjectKey) -> Option<&T> {
        self.objects.get(key).map(|o| &**o)
    }

    pub fn objects(&self) -> impl Iterator<Item = &T> {
        self.objects.values().map(|o| &**o)
    }

    /// The object, shared: for a reader that uses it outside the lock.
    pub fn shared(&self, key: &ObjectKey) -> Option<Arc<T>> {
        self.objects.get(key).cloned()
    }

    /// What changed since `cursor` ([`Self::changed_since`]) as the objects themselves, shared,
    /// and the cursor to pass next time.
    pub fn follow(&self, cursor: Option<Cursor>) -> (Followed<T>, Cursor) {
        let (changes, cursor) = self.changed_since(cursor);
        let followed = match changes {
            Changes::All => Followed::All(self.objects.values().cloned().collect()),
            Changes::Keys(keys) => Followed::Changed(
                keys.into_iter()
                    .map(|key| {
                        let object = self.shared(&key);
                        (key, object)
                    })
                    .collect(),
            ),
        };
        (followed, cursor)
    }
}

/// What a reader following a store with its own cursor reads ([`ObjectStore::follow`]).
#[derive(Debug, Clone)]
pub enum Followed<K> {
    /// Every object: the first read, after a restore, or a reader that fell behind.
    All(Vec<Arc<K>>),
    /// The objects changed since the cursor, by key: `None`, gone.
    Changed(Vec<(ObjectKey, Option<Arc<K>>)>),
}

impl<K: DeserializeOwned> ObjectStore<K, Packed<K>> {
    /// The object, decoded.
    pub fn get(&self, key: &ObjectKey) -> Option<K> {
        self.objects.get(key).map(Packed::decode)
    }

    /// Every object, decoded one at a time.
    pub fn objects(&self) -> impl Iterator<Item = K> + '_ {
        self.objects.values().map(Packed::decode)
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
    use kube::api::ObjectMeta;

    use super::*;

    fn svc(name: &str, rv: u64) -> Service {
        Service {
            metadata: ObjectMeta {
                namespace: Some("default".into()),
                name: Some(name.into()),
                resource_version: Some(rv.to_string()),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn names(store: &ObjectStore<Service>) -> Vec<String> {
        store.objects().map(|s| s.name_any()).collect()
    }

    /// The comparison without the byte check: both texts parsed, the versions removed.
    fn same_by_parsing(a: &[u8], b: &[u8]) -> bool {
        let without_version = |json: &[u8]| {
            let mut value: serde_json::Value = serde_json::from_slice(json).ok()?;
            value.pointer_mut("/metadata")?.as_object_mut()?.remove("resourceVersion");
            Some(value)
        };
        matches!((without_version(a), without_version(b)), (Some(a), Some(b)) if a == b)
    }

    fn endpoint_slice(rv: Option<String>, label: &str, endpoints: &[(u8, bool)]) -> EndpointSlice {
        serde_json::from_value(serde_json::json!({
            "addressType": "IPv4",
            "metadata": {"name": "web-1", "namespace": "shop", "resourceVersion": rv,
                "labels": {"kubernetes.io/service-name": "web", "x": label}},
            "endpoints": endpoints.iter().map(|(ip, ready)| serde_json::json!({
                "addresses": [format!("10.0.0.{ip}")], "conditions": {"ready": ready}})).collect::<Vec<_>>(),
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        }))
        .unwrap()
    }

    proptest::proptest! {
        /// The byte check before the parse never changes the answer: versions of any length,
        /// missing ones, and changes next to the version or anywhere else.
        #[test]
        fn the_byte_check_answers_as_the_parse_does(
            rv_a in proptest::option::weighted(0.9, "[0-9]{1,12}"),
            rv_b in proptest::option::weighted(0.9, "[0-9]{1,12}"),
            label_a in "[a-c]{0,3}",
            label_b in "[a-c]{0,3}",
            endpoints_a in proptest::collection::vec((0u8..4, proptest::bool::ANY), 0..4),
            endpoints_b in proptest::collection::vec((0u8..4, proptest::bool::ANY), 0..4),
            same_label in proptest::bool::ANY,
            same_endpoints in proptest::bool::ANY,
        ) {
            let label_b = if same_label { label_a.clone() } else { label_b };
            let endpoints_b = if same_endpoints { endpoints_a.clone() } else { endpoints_b };
            let a: Packed<EndpointSlice> = Held::hold(endpoint_slice(rv_a, &label_a, &endpoints_a));
            let b: Packed<EndpointSlice> = Held::hold(endpoint_slice(rv_b, &label_b, &endpoints_b));
            proptest::prop_assert_eq!(a.same_apart_from_version(&b), same_by_parsing(&a.json, &b.json));
            proptest::prop_assert_eq!(b.same_apart_from_version(&a), same_by_parsing(&b.json, &a.json));
        }
    }

    #[test]
    fn initial_list_is_applied_at_init_done_only() {
        let mut store = ObjectStore::<Service>::default();
        assert!(!store.apply(Event::Init));
        assert!(!store.apply(Event::InitApply(svc("a", 1))));
        assert!(store.is_empty() && !store.synced());
        assert!(store.apply(Event::InitDone));
        assert!(store.synced());
        assert_eq!(names(&store), ["a"]);
    }

    #[test]
    fn an_interrupted_relist_removes_nothing() {
        let mut store = ObjectStore::<Service>::default();
        for e in [Event::Init, Event::InitApply(svc("a", 1)), Event::InitApply(svc("b", 2)), Event::InitDone] {
            store.apply(e);
        }
        // The API goes away during the next relist: one page arrived, then nothing.
        store.apply(Event::Init);
        store.apply(Event::InitApply(svc("a", 1)));
        assert_eq!(names(&store), ["a", "b"]);
        // When the relist does complete, the real difference is applied.
        store.apply(Event::Init);
        store.apply(Event::InitApply(svc("b", 2)));
        assert!(store.apply(Event::InitDone));
        assert_eq!(names(&store), ["b"]);
    }

    #[test]
    fn a_relist_with_the_same_objects_is_no_change() {
        let mut store = ObjectStore::<Service>::default();
        for e in [Event::Init, Event::InitApply(svc("a", 1)), Event::InitDone] {
            store.apply(e);
        }
        for e in [Event::Init, Event::InitApply(svc("a", 1))] {
            assert!(!store.apply(e));
        }
        assert!(!store.apply(Event::InitDone));
    }

    /// A reader that saw no change keeps sharing the store's copy: the relisted equal object is
    /// dropped, not the one held (else every object is held twice after a relist).
    #[test]
    fn a_relist_keeps_the_held_copy_of_an_unchanged_object() {
        let mut store = ObjectStore::<Service>::default();
        for e in [Event::Init, Event::InitApply(svc("a", 1)), Event::InitApply(svc("b", 1)), Event::InitDone] {
            store.apply(e);
        }
        let before = store.snapshot();
        for e in [Event::Init, Event::InitApply(svc("a", 1)), Event::InitApply(svc("b", 2))] {
            store.apply(e);
        }
        assert!(store.apply(Event::InitDone), "b moved");
        let after = store.snapshot();
        assert!(Arc::ptr_eq(&before[0], &after[0]), "a unchanged: the same copy");
        assert!(!Arc::ptr_eq(&before[1], &after[1]));
        assert_eq!(after[1].metadata.resource_version.as_deref(), Some("2"), "b is the listed one");
    }

    /// A relisted object equal to the held one leaves only its mark as it arrives: the listed
    /// copy is not kept until the relist completes; a changed one is kept as listed.
    #[test]
    fn a_relist_keeps_nothing_of_an_unchanged_object_as_it_arrives() {
        let mut store = ObjectStore::<Service>::default();
        store.restore([svc("a", 1), svc("b", 1)]);
        let held = store.snapshot();
        store.apply(Event::Init);
        store.apply(Event::InitApply(svc("a", 1)));
        store.apply(Event::InitApply(svc("b", 2)));
        let relist = store.relist.as_ref().unwrap();
        let kept: Vec<_> = relist.differing.keys().map(|key| key.name.to_string()).collect();
        assert_eq!(kept, ["b"], "a: nothing but the mark; b moved: the listed copy");
        assert!(relist.unlisted.is_empty());
        assert!(store.apply(Event::InitDone));
        assert!(Arc::ptr_eq(&store.snapshot()[0], &held[0]));
    }

    #[test]
    fn duplicate_and_out_of_order_events_are_ignored() {
        let mut store = ObjectStore::<Service>::default();
        store.apply(Event::InitDone);
        assert!(store.apply(Event::Apply(svc("a", 5))));
        assert!(!store.apply(Event::Apply(svc("a", 5))), "duplicate");
        assert!(!store.apply(Event::Apply(svc("a", 3))), "older copy arriving late");
        assert_eq!(store.objects().next().unwrap().metadata.resource_version.as_deref(), Some("5"));
        assert!(!store.apply(Event::Delete(svc("a", 4))), "delete older than what we have");
        assert!(store.apply(Event::Delete(svc("a", 6))));
        assert!(!store.apply(Event::Delete(svc("a", 6))), "duplicate delete");
        assert!(store.is_empty());
    }

    #[test]
    fn an_update_of_nothing_kept_wakes_nobody_but_keeps_its_version() {
        let mut store = ObjectStore::<Service>::default();
        for e in [Event::Init, Event::InitApply(svc("a", 1)), Event::InitDone] {
            store.apply(e);
        }
        let feed = store.subscribe();
        store.take_changes(feed);
        let mut managed = svc("a", 5);
        managed.metadata.managed_fields = Some(vec![Default::default()]);
        assert!(!store.apply(Event::Apply(managed)), "only the version and dropped fields changed");
        assert_eq!(store.take_changes(feed), Some(BTreeSet::new()));
        // The newer version was kept: a delete older than it is stale.
        assert!(!store.apply(Event::Delete(svc("a", 4))));
        assert!(store.apply(Event::Delete(svc("a", 5))));
    }

    /// An update of nothing but the version keeps the copy held (readers that saw no change
    /// share it; a second copy per such Pod is what the heap profile found) and only the newer
    /// number, which the staleness checks and a relist read as the object's version.
    #[test]
    fn an_update_of_nothing_kept_keeps_the_held_copy_and_the_newer_version() {
        let mut store = ObjectStore::<Service>::default();
        for e in [Event::Init, Event::InitApply(labeled(svc("a", 1), "red")), Event::InitDone] {
            store.apply(e);
        }
        let feed = store.subscribe();
        store.take_changes(feed);
        let held = store.snapshot().remove(0);
        assert!(!store.apply(Event::Apply(labeled(svc("a", 5), "red"))));
        assert!(Arc::ptr_eq(&held, &store.snapshot()[0]), "the held copy stays");
        assert!(!store.apply(Event::Apply(labeled(svc("a", 3), "blue"))), "older than the newer version");
        assert!(!store.apply(Event::Delete(svc("a", 4))), "a delete older than the newer version");
        // A relist at the newer version is no change, and keeps the copy.
        for e in [Event::Init, Event::InitApply(labeled(svc("a", 5), "red"))] {
            store.apply(e);
        }
        assert!(!store.apply(Event::InitDone));
        assert!(Arc::ptr_eq(&held, &store.snapshot()[0]));
        assert_eq!(store.take_changes(feed), Some(BTreeSet::new()));
        assert!(!store.apply(Event::Apply(labeled(svc("a", 4), "blue"))), "still older after the relist");
        // A relist at another version is the listed object, as a relist always was.
        for e in [Event::Init, Event::InitApply(labeled(svc("a", 6), "red"))] {
            store.apply(e);
        }
        assert!(store.apply(Event::InitDone));
        assert_eq!(store.snapshot()[0].metadata.resource_version.as_deref(), Some("6"));
        // A real change replaces the copy and forgets the number.
        assert!(!store.apply(Event::Apply(labeled(svc("a", 8), "red"))));
        assert!(store.apply(Event::Apply(labeled(svc("a", 9), "blue"))));
        assert!(store.newer_versions.is_empty());
        assert!(store.apply(Event::Delete(svc("a", 9))));
    }

    /// A Pod's key is the pod's own shared namespace and name: no allocation of its own.
    #[test]
    fn a_pods_key_shares_the_pods_names() {
        use crate::k8s::pod::{PodFields, SlimPod};
        let mut store = ObjectStore::<PodFields, Arc<SlimPod>>::default();
        let pod: PodFields =
            serde_json::from_value(serde_json::json!({"metadata": {"namespace": "shop", "name": "web-1"}})).unwrap();
        store.apply(Event::Apply(pod));
        let key = store.keys().next().unwrap().clone();
        let held = store.shared(&key).unwrap();
        assert_eq!(key, ObjectKey::new("shop", "web-1"));
        assert!(Arc::ptr_eq(&key.namespace, &held.namespace) && Arc::ptr_eq(&key.name, &held.name));
        assert_eq!(serde_json::to_string(&key).unwrap(), r#"["shop","web-1"]"#, "the journal's form");
        assert_eq!(serde_json::from_str::<ObjectKey>(r#"["shop","web-1"]"#).unwrap(), key);
    }

    /// Two readers of one store each take their own changes; a restore has both read everything.
    #[test]
    fn each_feed_takes_its_own_changes() {
        let mut store = ObjectStore::<Service>::default();
        let (first, second) = (store.subscribe(), store.subscribe());
        assert_eq!(store.take_changes(first), None, "a new reader reads everything");
        store.apply(Event::Apply(svc("a", 1)));
        let a: BTreeSet<ObjectKey> = [ObjectKey::new("default", "a")].into();
        assert_eq!(store.take_changes(first), Some(a.clone()));
        assert_eq!(store.take_changes(first), Some(BTreeSet::new()));
        assert_eq!(store.take_changes(second), None, "the second reader has not read yet");
        store.apply(Event::Apply(svc("b", 2)));
        let b: BTreeSet<ObjectKey> = [ObjectKey::new("default", "b")].into();
        assert_eq!(store.take_changes(second), Some(b.clone()));
        assert_eq!(store.take_changes(first), Some(b), "taken by the second, still the first's");
        store.restore([svc("b", 3)]);
        assert_eq!((store.take_changes(first), store.take_changes(second)), (None, None));
    }

    #[test]
    fn events_during_a_relist_also_land_in_the_new_list() {
        let mut store = ObjectStore::<Service>::default();
        store.apply(Event::Init);
        store.apply(Event::InitApply(svc("a", 1)));
        store.apply(Event::Apply(svc("b", 2)));
        store.apply(Event::Delete(svc("a", 3)));
        store.apply(Event::InitDone);
        assert_eq!(names(&store), ["b"]);
    }

    #[test]
    fn a_packed_store_sees_the_same_changes_and_objects_as_a_shared_one() {
        let mut shared = ObjectStore::<Service>::default();
        let mut packed = ObjectStore::<Service, Packed<Service>>::default();
        let mut annotated = svc("c", 7);
        annotated.metadata.annotations = Some([("k".to_string(), "v \"quoted\"".to_string())].into());
        let events = || {
            [
                Event::Init,
                Event::InitApply(svc("a", 1)),
                Event::InitApply(svc("b", 2)),
                Event::InitDone,
                Event::Apply(svc("a", 1)),
                Event::Apply(svc("a", 5)),
                Event::Apply(svc("a", 3)),
                Event::Delete(svc("b", 1)),
                Event::Apply(annotated.clone()),
                Event::Init,
                Event::InitApply(svc("a", 5)),
                Event::InitApply(annotated.clone()),
                Event::InitDone,
                Event::Delete(svc("a", 6)),
            ]
        };
        let (shared_feed, packed_feed) = (shared.subscribe(), packed.subscribe());
        shared.take_changes(shared_feed);
        packed.take_changes(packed_feed);
        for (a, b) in events().into_iter().zip(events()) {
            assert_eq!(shared.apply(a), packed.apply(b));
            assert_eq!(shared.take_changes(shared_feed), packed.take_changes(packed_feed));
            let decoded: Vec<Service> = packed.objects().collect();
            assert_eq!(shared.objects().cloned().collect::<Vec<_>>(), decoded);
        }
        assert_eq!(packed.get(&ObjectKey::new("default", "c")), Some(annotated));
    }

    #[test]
    fn restored_objects_survive_until_a_complete_list() {
        let mut store = ObjectStore::<Service>::default();
        store.restore([svc("a", 1), svc("b", 1)]);
        assert!(!store.synced());
        store.apply(Event::Init);
        assert_eq!(names(&store), ["a", "b"]);
        store.apply(Event::InitApply(svc("a", 1)));
        store.apply(Event::InitDone);
        assert_eq!(names(&store), ["a"]);
    }

    /// The relist as it was before it was kept in place: every listed object buffered in a
    /// second map, the map swapped in at `InitDone`. The reference for the in-place relist.
    #[derive(Default)]
    struct BufferedStore {
        objects: BTreeMap<ObjectKey, Arc<Service>>,
        newer_versions: BTreeMap<ObjectKey, Option<u64>>,
        relist: Option<BTreeMap<ObjectKey, Arc<Service>>>,
        synced: bool,
        /// The keys that moved since last taken (the store's feed).
        moved: BTreeSet<ObjectKey>,
    }

    impl BufferedStore {
        fn version(&self, key: &ObjectKey) -> Option<u64> {
            match self.newer_versions.get(key) {
                Some(newer) => *newer,
                None => self.objects.get(key).and_then(|o| version_of(&**o)),
            }
        }

        fn apply(&mut self, event: Event<Service>) -> bool {
            match event {
                Event::Init => {
                    self.relist = Some(BTreeMap::new());
                    false
                }
                Event::InitApply(object) => {
                    let (mut key, mut object) = keyed_hold::<Service, Arc<Service>>(object);
                    if let Some((k, held)) = self.objects.get_key_value(&key).filter(|(_, held)| **held == object) {
                        (key, object) = (k.clone(), held.clone());
                    }
                    self.relist.get_or_insert_with(BTreeMap::new).insert(key, object);
                    false
                }
                Event::InitDone => {
                    let mut newer_versions = BTreeMap::new();
                    let listed: BTreeMap<ObjectKey, Arc<Service>> = self
                        .relist
                        .take()
                        .unwrap_or_default()
                        .into_iter()
                        .map(|(key, object)| {
                            let Some((k, held)) = self.objects.get_key_value(&key) else { return (key, object) };
                            if *held == object {
                                return (k.clone(), held.clone());
                            }
                            match self.newer_versions.get(&key) {
                                Some(newer) if *newer == object.version() && held.same_apart_from_version(&object) => {
                                    newer_versions.insert(k.clone(), *newer);
                                    (k.clone(), held.clone())
                                }
                                _ => (key, object),
                            }
                        })
                        .collect();
                    let differs = |key: &&ObjectKey| listed.get(*key) != self.objects.get(*key);
                    let moved: Vec<ObjectKey> =
                        listed.keys().chain(self.objects.keys()).filter(differs).cloned().collect();
                    self.moved.extend(moved);
                    let changed = listed != self.objects || !self.synced;
                    self.objects = listed;
                    self.newer_versions = newer_versions;
                    self.synced = true;
                    changed
                }
                Event::Apply(object) => {
                    let (key, object) = keyed_hold::<Service, Arc<Service>>(object);
                    if let Some(buffer) = self.relist.as_mut() {
                        buffer.insert(key.clone(), object.clone());
                    }
                    if let (Some(have), Some(got)) = (self.version(&key), object.version()) {
                        if got < have {
                            return false;
                        }
                    }
                    if let Some(have) = self.objects.get(&key) {
                        if *have == object {
                            self.newer_versions.remove(&key);
                            return false;
                        }
                        if have.same_apart_from_version(&object) {
                            self.newer_versions.insert(key, object.version());
                            return false;
                        }
                    }
                    self.newer_versions.remove(&key);
                    self.moved.insert(key.clone());
                    self.objects.insert(key, object);
                    true
                }
                Event::Delete(object) => {
                    let key = key_of(&object);
                    if let Some(buffer) = self.relist.as_mut() {
                        buffer.remove(&key);
                    }
                    let stale =
                        matches!((self.version(&key), version_of(&object)), (Some(have), Some(got)) if got < have);
                    let removed = !stale && self.objects.remove(&key).is_some();
                    if removed {
                        self.newer_versions.remove(&key);
                        self.moved.insert(key);
                    }
                    removed
                }
            }
        }

        fn restore(&mut self, objects: Vec<Service>) {
            self.objects = objects.into_iter().map(keyed_hold).collect();
            self.newer_versions.clear();
        }
    }

    /// The relist kept in place gives what the buffered one gave, event for event: the objects
    /// (deletions of what the new list lacks included), their newer versions, what changed and
    /// for whom, through listings in key order, in reverse, shuffled, with duplicates, with
    /// updates, deletions (stale ones too) and restores in the middle, and relists broken off.
    #[test]
    fn a_relist_in_place_does_what_the_buffered_relist_did() {
        let mut lcg: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = |n: u64| {
            lcg = lcg.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            (lcg >> 33) % n
        };
        for round in 0..300 {
            let mut store = ObjectStore::<Service>::journaled();
            let feed = store.subscribe();
            store.take_changes(feed);
            let mut reference = BufferedStore::default();
            let mut version = 10;
            let mut cursor = None;
            let names = 2 + next(14);
            for step in 0..60 {
                version += 1;
                let mut events = Vec::new();
                let colour = |n: u64| ["red", "green"][(n % 2) as usize];
                match next(10) {
                    // A relist: a subset of the names, in some order, maybe cut off.
                    0..=3 => {
                        let mut listed: Vec<u64> = (0..names).filter(|_| next(5) != 0).collect();
                        match next(4) {
                            0 => listed.reverse(),
                            1 => {
                                for i in (1..listed.len()).rev() {
                                    listed.swap(i, next(i as u64 + 1) as usize);
                                }
                            }
                            _ => {}
                        }
                        events.push(Event::Init);
                        for i in listed {
                            // Mostly as held (same version and labels), sometimes changed or
                            // at another version only.
                            let rv = if next(3) == 0 { version } else { 10 + i };
                            events.push(Event::InitApply(labeled(svc(&format!("s{i:02}"), rv), colour(next(4) / 3))));
                            if next(12) == 0 {
                                let j = next(names);
                                let event = if next(2) == 0 {
                                    Event::Apply(labeled(svc(&format!("s{j:02}"), version + next(3)), colour(j)))
                                } else {
                                    Event::Delete(svc(&format!("s{j:02}"), version.saturating_sub(next(20))))
                                };
                                events.push(event);
                            }
                            if next(40) == 0 {
                                events.push(Event::InitApply(labeled(svc(&format!("s{i:02}"), 10 + i), "red")));
                            }
                        }
                        if next(6) != 0 {
                            events.push(Event::InitDone);
                        }
                    }
                    4..=6 => {
                        let j = next(names);
                        events.push(Event::Apply(labeled(svc(&format!("s{j:02}"), version), colour(next(2)))));
                    }
                    7 => {
                        let j = next(names);
                        events.push(Event::Delete(svc(&format!("s{j:02}"), version - next(3))));
                    }
                    8 => events.push(Event::InitDone),
                    _ => {
                        let objects: Vec<Service> = (0..names)
                            .filter(|_| next(2) == 0)
                            .map(|i| labeled(svc(&format!("s{i:02}"), 10 + i), "red"))
                            .collect();
                        store.restore(objects.clone());
                        reference.restore(objects);
                        store.take_changes(feed);
                        reference.moved.clear();
                        cursor = None;
                        continue;
                    }
                }
                for event in events {
                    let described = format!("{event:?}").chars().take(60).collect::<String>();
                    let (a, b) = (store.apply(event.clone()), reference.apply(event));
                    assert_eq!(a, b, "round {round} step {step}: {described}");
                    assert_eq!(store.objects, reference.objects, "round {round} step {step}: {described}");
                    assert_eq!(store.newer_versions, reference.newer_versions, "round {round} step {step}");
                }
                let moved = std::mem::take(&mut reference.moved);
                assert_eq!(store.take_changes(feed).unwrap_or_default(), moved, "round {round} step {step}");
                let (changes, now) = store.changed_since(cursor);
                if let (Some(_), Changes::Keys(keys)) = (cursor, changes) {
                    assert_eq!(keys.into_iter().collect::<BTreeSet<_>>(), moved, "journal, round {round} step {step}");
                }
                cursor = Some(now);
            }
        }
    }

    /// Objects listed again unchanged stay the copies held, and what the list lacks goes, in
    /// whatever order the listing comes; a listing that breaks off removes nothing.
    #[test]
    fn a_relist_keeps_the_held_copies_and_drops_what_is_not_listed() {
        let mut store = ObjectStore::<Service>::default();
        let all = ["a", "b", "c", "d", "e"];
        store.apply(Event::Init);
        for name in all {
            store.apply(Event::InitApply(svc(name, 1)));
        }
        assert!(store.apply(Event::InitDone));
        let held = store.snapshot();
        for order in [["e", "c", "a"], ["a", "c", "e"], ["c", "a", "e"]] {
            let mut store = ObjectStore::<Service>::default();
            store.restore_held(held.iter().map(|o| (key_of(&**o), o.clone())));
            // Broken off: nothing goes.
            store.apply(Event::Init);
            store.apply(Event::InitApply(svc(order[0], 1)));
            store.apply(Event::Init);
            for name in order {
                store.apply(Event::InitApply(svc(name, 1)));
            }
            assert_eq!(names(&store), all, "nothing goes before InitDone");
            assert!(store.apply(Event::InitDone));
            assert_eq!(names(&store), ["a", "c", "e"], "{order:?}");
            for (kept, name) in store.snapshot().iter().zip(["a", "c", "e"]) {
                let before = held.iter().find(|o| o.name_any() == name).unwrap();
                assert!(Arc::ptr_eq(kept, before), "{name} is the copy held");
            }
            assert!(store.relist.is_none());
        }
    }

    fn labeled(mut service: Service, colour: &str) -> Service {
        service.metadata.labels = Some([("colour".to_string(), colour.to_string())].into());
        service
    }

    /// A reader's copy kept from [`ObjectStore::changed_since`] alone.
    #[derive(Default)]
    struct Follower {
        cursor: Option<Cursor>,
        copy: BTreeMap<ObjectKey, Service>,
        /// Objects read, for the cost of following.
        read: usize,
    }

    impl Follower {
        fn follow(&mut self, store: &ObjectStore<Service>) {
            let (changes, cursor) = store.changed_since(self.cursor);
            self.cursor = Some(cursor);
            match changes {
                Changes::All => {
                    self.copy = store.objects().map(|o| (key_of(o), o.clone())).collect();
                    self.read += self.copy.len();
                }
                Changes::Keys(keys) => {
                    for key in keys {
                        self.read += 1;
                        match store.get(&key) {
                            Some(object) => self.copy.insert(key, object.clone()),
                            None => self.copy.remove(&key),
                        };
                    }
                }
            }
        }
    }

    #[test]
    fn each_reader_takes_the_changes_since_its_own_cursor() {
        let mut store = ObjectStore::<Service>::journaled();
        for e in [Event::Init, Event::InitApply(svc("a", 1)), Event::InitApply(svc("b", 1)), Event::InitDone] {
            store.apply(e);
        }
        let (all, first) = store.changed_since(None);
        assert_eq!(all, Changes::All);
        store.apply(Event::Apply(labeled(svc("a", 2), "blue")));
        let (changes, second) = store.changed_since(Some(first));
        assert_eq!(changes, Changes::Keys(vec![ObjectKey::new("default", "a")]));
        // An update of nothing kept is no change; a deletion is one.
        store.apply(Event::Apply(labeled(svc("a", 3), "blue")));
        store.apply(Event::Delete(svc("b", 4)));
        assert_eq!(store.changed_since(Some(second)).0, Changes::Keys(vec![ObjectKey::new("default", "b")]));
        // The first reader, further behind, sees both, each key once.
        let keys = |changes| match changes {
            Changes::Keys(keys) => keys.into_iter().map(|key| key.name.to_string()).collect::<Vec<_>>(),
            Changes::All => panic!("everything"),
        };
        assert_eq!(keys(store.changed_since(Some(first)).0), ["a", "b"]);
        // A relist that brings back the same objects changes nothing; one that differs names
        // what differs.
        let (_, now) = store.changed_since(None);
        for e in [
            Event::Init,
            Event::InitApply(labeled(svc("a", 3), "blue")),
            Event::InitApply(svc("c", 5)),
            Event::InitDone,
        ] {
            store.apply(e);
        }
        assert_eq!(keys(store.changed_since(Some(now)).0), ["c"]);
        // A restore replaces everything: every reader reads everything.
        store.restore([svc("z", 1)]);
        assert_eq!(store.changed_since(Some(now)).0, Changes::All);
    }

    #[test]
    fn a_reader_behind_what_the_store_remembers_reads_everything() {
        let mut store = ObjectStore::<Service>::journaled();
        store.apply(Event::InitDone);
        let (_, behind) = store.changed_since(None);
        // Objects that come and go leave entries until there are twice as many as objects.
        for i in 0..=2 * Journal::MIN_KEPT as u64 {
            store.apply(Event::Apply(svc(&format!("gone-{i}"), 2 * i + 1)));
            store.apply(Event::Delete(svc(&format!("gone-{i}"), 2 * i + 2)));
        }
        assert_eq!(store.changed_since(Some(behind)).0, Changes::All);
        assert!(store.journal.as_ref().unwrap().by_number.len() <= 2 * Journal::MIN_KEPT);
    }

    /// Readers following at different paces, through updates, deletions, stale copies, relists
    /// (some broken off) and restores, always hold what the store holds; and following one
    /// update reads one object.
    #[test]
    fn followers_hold_what_the_store_holds() {
        let mut lcg: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = |n: u64| {
            lcg = lcg.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            (lcg >> 33) % n
        };
        for _ in 0..20 {
            let mut store = ObjectStore::<Service>::journaled();
            let mut followers: Vec<Follower> = (0..3).map(|_| Follower::default()).collect();
            let mut version = 0;
            for step in 0..400 {
                version += 1;
                let name = format!("s{}", next(12));
                // Stale copies arrive now and then: a lower version than the store's.
                let rv = if next(8) == 0 { version / 2 } else { version };
                let colour = ["red", "green", "blue"][next(3) as usize];
                let event = match next(20) {
                    0..=9 => Event::Apply(labeled(svc(&name, rv), colour)),
                    10..=13 => Event::Delete(svc(&name, rv)),
                    14 => Event::Init,
                    15..=17 => Event::InitApply(labeled(svc(&name, rv), colour)),
                    18 => Event::InitDone,
                    _ => {
                        if next(10) == 0 {
                            store.restore((0..next(5)).map(|i| svc(&format!("s{i}"), version)));
                        }
                        continue;
                    }
                };
                store.apply(event);
                for (i, follower) in followers.iter_mut().enumerate() {
                    if step % (i + 1) == 0 {
                        follower.follow(&store);
                        // An update of nothing but the version is no change to follow.
                        let versionless = |objects: &mut dyn Iterator<Item = &Service>| {
                            objects
                                .map(|o| {
                                    let mut o = o.clone();
                                    o.metadata.resource_version = None;
                                    (key_of(&o), o)
                                })
                                .collect::<BTreeMap<_, _>>()
                        };
                        assert_eq!(
                            versionless(&mut follower.copy.values()),
                            versionless(&mut store.objects()),
                            "follower {i} at step {step}"
                        );
                    }
                }
            }
        }
        let mut store = ObjectStore::<Service>::journaled();
        let mut follower = Follower::default();
        store.apply(Event::Init);
        for i in 0..5_000 {
            store.apply(Event::InitApply(svc(&format!("s{i}"), 1)));
        }
        store.apply(Event::InitDone);
        follower.follow(&store);
        let read = follower.read;
        store.apply(Event::Apply(labeled(svc("s42", 2), "red")));
        follower.follow(&store);
        assert_eq!(follower.read - read, 1, "one update, one object read of 5,000");
    }
}
