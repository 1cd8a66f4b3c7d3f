//! Watching the API server with kube-rs, outage-proof.
//!
//! Each watcher runs forever with capped exponential backoff (kube-rs `default_backoff`: jittered,
//! capped); errors are reported, never acted on. What the watchers deliver goes through
//! [`ObjectStore`](super::store::ObjectStore), which only changes on real events or complete
//! relists, so an outage leaves the desired state — and therefore the maps — as they were.
use std::{path::PathBuf, time::Duration};

use anyhow::{Context, Result};
use futures_util::StreamExt;
use kube::{
    config::{KubeConfigOptions, Kubeconfig},
    runtime::{watcher, WatchStreamExt},
    Api, Client, Config,
};
use tokio::sync::mpsc;

use super::{
    checkpoint::Checkpoint,
    kinds::Watched,
    store::{Feed, ObjectKey, ObjectStore},
};

/// How to reach the API server (kube-router's `--kubeconfig` / `--master`).
#[derive(Clone, Debug, Default)]
pub struct ApiOptions {
    pub kubeconfig: Option<PathBuf>,
    pub master: Option<String>,
}

pub async fn client(options: &ApiOptions) -> Result<Client> {
    let mut config = config(options).await?;
    // Bounded reads so a black-holed API server is noticed and retried instead of hanging.
    config.read_timeout = Some(Duration::from_secs(30));
    config.connect_timeout = Some(Duration::from_secs(10));
    Ok(Client::try_from(config)?)
}

/// The addresses the agent reaches the API server at (`--kubeconfig`/`--master`, else the
/// in-cluster config), a host name resolved once. No Service may capture them.
pub async fn api_server_addresses(options: &ApiOptions) -> std::collections::BTreeSet<std::net::IpAddr> {
    let Ok(config) = config(options).await else { return Default::default() };
    let url = &config.cluster_url;
    let Some(host) = url.host() else { return Default::default() };
    let host = host.trim_start_matches('[').trim_end_matches(']').to_string();
    if let Ok(ip) = host.parse() {
        return [ip].into();
    }
    let port = url.port_u16().unwrap_or(443);
    // Bounded: a resolver that does not answer must not hold the agent's start (an outage of the
    // name service changes nothing either).
    let lookup = tokio::net::lookup_host(format!("{host}:{port}"));
    let resolved = match tokio::time::timeout(std::time::Duration::from_secs(2), lookup).await {
        Ok(resolved) => resolved,
        Err(_) => Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer within 2 s")),
    };
    match resolved {
        Ok(addrs) => addrs.map(|a| a.ip()).collect(),
        Err(error) => {
            tracing::warn!(%host, %error, "cannot resolve the API server's name; its endpoints still protect it");
            Default::default()
        }
    }
}

async fn config(options: &ApiOptions) -> Result<Config> {
    let mut config = match (&options.kubeconfig, &options.master) {
        (Some(path), _) => {
            let kubeconfig =
                Kubeconfig::read_from(path).with_context(|| format!("reading kubeconfig {}", path.display()))?;
            Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?
        }
        (None, Some(master)) => {
            Config::new(master.parse().with_context(|| format!("--master {master:?} is not a URL"))?)
        }
        (None, None) => Config::infer().await.context("no --kubeconfig/--master and no in-cluster config")?,
    };
    if let (Some(_), Some(master)) = (&options.kubeconfig, &options.master) {
        config.cluster_url = master.parse().with_context(|| format!("--master {master:?} is not a URL"))?;
    }
    Ok(config)
}

/// Generates, from [`watched_kinds!`](crate::watched_kinds), everything that lists the
/// watched kinds: the kind enum, the watch updates, the stores, the watchers, the RBAC list and
/// the checkpoint snapshot.
macro_rules! cluster_objects {
    ($($variant:ident, $field:ident, $ty:ty;)*) => {
        /// The watched kinds.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum Kind {
            $($variant,)*
        }

        impl Kind {
            pub const ALL: &'static [Kind] = &[$(Kind::$variant,)*];

            /// Its place in per-kind tables.
            pub fn index(self) -> usize {
                self as usize
            }

            /// Its name in the checkpoint and in `kube-router checkpoint -o json`.
            pub fn field(self) -> &'static str {
                match self {
                    $(Kind::$variant => stringify!($field),)*
                }
            }

            /// The resource's plural name, as the API, RBAC and `kube-router checkpoint` spell it.
            pub fn resource(self) -> &'static str {
                match self {
                    $(Kind::$variant => <$ty as k8s_openapi::Resource>::URL_PATH_SEGMENT,)*
                }
            }
        }

        /// (API group, resource) of everything the agent lists and watches; the RBAC in
        /// manifests/ grants exactly these (checked by a test).
        pub const WATCHED_RESOURCES: [(&str, &str); Kind::ALL.len()] =
            [$((<$ty as k8s_openapi::Resource>::GROUP, <$ty as k8s_openapi::Resource>::URL_PATH_SEGMENT),)*];

        /// One watcher's news for the agent loop.
        // Moved once through a channel, never stored in bulk: boxing would only add an allocation.
        #[allow(clippy::large_enum_variant)]
        pub enum WatchUpdate {
            $($variant(watcher::Event<$ty>),)*
            /// A watch or list failed; the watcher backs off and retries by itself.
            Error {
                resource: &'static str,
                message: String,
            },
            /// Result of the periodic reachability probe (`GET /version`). Watches can be quiet for
            /// long stretches and only fail after their read timeout; the probe notices a dead API
            /// server within seconds. Any HTTP answer, even an error status, counts as reachable.
            Probe {
                reachable: bool,
                message: String,
            },
        }

        impl WatchUpdate {
            /// Whether the update carries an answer of the API server. A watcher's `Init` only marks
            /// the start of a relist (kube-runtime emits it before sending the list request), so it
            /// says nothing about reachability.
            pub fn is_api_answer(&self) -> bool {
                match self {
                    $(WatchUpdate::$variant(event) => !matches!(event, watcher::Event::Init),)*
                    WatchUpdate::Error { .. } => false,
                    WatchUpdate::Probe { reachable, .. } => *reachable,
                }
            }
        }

        fn spawn_kinds(client: &Client, config: &watcher::Config, updates: &mpsc::Sender<WatchUpdate>) {
            $(spawn_one(
                Api::<$ty>::all(client.clone()),
                config.clone(),
                updates.clone(),
                <$ty as k8s_openapi::Resource>::URL_PATH_SEGMENT,
                WatchUpdate::$variant,
            );)*
        }

        /// Every watched object, as last seen, each kind kept as its [`Watched`] implementation
        /// says (k8s::kinds).
        ///
        /// Readers that take what changed each have their own feed of a store
        /// ([`ObjectStore::subscribe`]): the services controller or the service view (Services
        /// and EndpointSlices), the policy controller (Pods, Namespaces, NetworkPolicies). The
        /// journaled kinds (Nodes), read under the shared lock by several controllers, are
        /// followed with a cursor each ([`ObjectStore::changed_since`]).
        pub struct ClusterObjects {
            $(pub $field: ObjectStore<$ty, <$ty as Watched>::Held>,)*
        }

        impl Default for ClusterObjects {
            fn default() -> Self {
                Self {
                    $($field: if <$ty as Watched>::JOURNALED { ObjectStore::journaled() } else { ObjectStore::default() },)*
                }
            }
        }

        impl ClusterObjects {
            /// Applies a watcher update; returns the kind whose visible contents changed, if any.
            pub fn apply_kind(&mut self, update: WatchUpdate) -> Option<Kind> {
                let (kind, changed) = match update {
                    $(WatchUpdate::$variant(event) => (Kind::$variant, self.$field.apply(event)),)*
                    WatchUpdate::Error { .. } | WatchUpdate::Probe { .. } => return None,
                };
                changed.then_some(kind)
            }

            /// `kind` has been listed completely since start.
            pub fn listed(&self, kind: Kind) -> bool {
                match kind {
                    $(Kind::$variant => self.$field.synced(),)*
                }
            }

            /// Every object, shared, for the checkpoint to be written off the agent's loop.
            pub fn snapshot(&self) -> CheckpointSnapshot {
                CheckpointSnapshot {
                    written_unix: crate::metrics::unix_now(),
                    $($field: self.$field.snapshot(),)*
                }
            }

            /// A feed of every store for the checkpoint's journal ([`Self::checkpoint_changes`]).
            pub fn subscribe_checkpoint(&mut self) -> CheckpointFeeds {
                CheckpointFeeds { $($field: self.$field.subscribe(),)* }
            }

            /// The objects changed since `feeds` were last taken, each shared with its store
            /// (`None`: deleted). `None` when a feed cannot tell (its first take, or after a
            /// restore): only a whole snapshot records the state then. Every feed is taken either
            /// way.
            pub fn checkpoint_changes(&mut self, feeds: &CheckpointFeeds) -> Option<CheckpointChanges> {
                let mut told = true;
                let changes = CheckpointChanges {
                    written_unix: crate::metrics::unix_now(),
                    $($field: match self.$field.take_changes(feeds.$field) {
                        Some(keys) => keys
                            .into_iter()
                            .map(|key| {
                                let held = self.$field.get_held(&key).cloned();
                                (key, held)
                            })
                            .collect(),
                        None => {
                            told = false;
                            Vec::new()
                        }
                    },)*
                };
                told.then_some(changes)
            }

            /// Every object in the checkpoint's form (a copy: tests and tooling).
            pub fn checkpoint(&self) -> Checkpoint {
                Checkpoint {
                    written_unix: crate::metrics::unix_now(),
                    $($field: self.$field.held().map(<$ty as Watched>::saved).collect(),)*
                }
            }

            /// Seeds every store from a checkpoint; each stays unsynced until the API lists it.
            pub fn restore(&mut self, checkpoint: Checkpoint) {
                $(self.$field.restore_held(checkpoint.$field.into_iter().map(<$ty as Watched>::restored));)*
            }

            /// [`Self::restore`] from a checkpoint read in the stores' form
            /// ([`read_for_restore`](super::checkpoint::read_for_restore)).
            pub fn restore_from(&mut self, restored: super::checkpoint::Restored) {
                $(self.$field.restore_by_key(restored.$field);)*
            }
        }

        /// Every object at one moment, shared with the stores.
        pub struct CheckpointSnapshot {
            pub(crate) written_unix: f64,
            $($field: Vec<<$ty as Watched>::Held>,)*
        }

        /// The checkpoint writer's feed of every store.
        pub struct CheckpointFeeds {
            $($field: Feed,)*
        }

        /// What changed between two takes of the [`CheckpointFeeds`], shared with the stores.
        pub struct CheckpointChanges {
            pub(crate) written_unix: f64,
            $($field: Vec<(ObjectKey, Option<<$ty as Watched>::Held>)>,)*
        }

        impl CheckpointChanges {
            /// How many objects changed or went.
            pub fn len(&self) -> usize {
                0 $(+ self.$field.len())*
            }

            pub fn is_empty(&self) -> bool {
                self.len() == 0
            }
        }

        /// Serialises as a [`JournalBatch`](super::checkpoint::JournalBatch) of the same
        /// objects, read in place like [`CheckpointSnapshot`]'s.
        impl serde::Serialize for CheckpointChanges {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                use serde::ser::SerializeStruct;
                let mut batch = serializer.serialize_struct("JournalBatch", 1 + Kind::ALL.len())?;
                batch.serialize_field("written_unix", &self.written_unix)?;
                $(batch.serialize_field(stringify!($field), &WrittenChanges::<$ty>(&self.$field))?;)*
                batch.end()
            }
        }

        /// Serialises as the [`Checkpoint`] of the same objects, read in place (no copy of them
        /// where the kind's form allows: see [`Watched::write_saved`]).
        impl serde::Serialize for CheckpointSnapshot {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                use serde::ser::SerializeStruct;
                let mut checkpoint = serializer.serialize_struct("Checkpoint", 1 + Kind::ALL.len())?;
                checkpoint.serialize_field("written_unix", &self.written_unix)?;
                $(checkpoint.serialize_field(stringify!($field), &Written::<$ty>(&self.$field))?;)*
                checkpoint.end()
            }
        }
    };
}

crate::watched_kinds!(cluster_objects);

/// A kind's held objects, serialised in the checkpoint's form.
struct Written<'a, K: Watched>(&'a [K::Held]);

impl<K: Watched> serde::Serialize for Written<'_, K> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        struct One<'a, K: Watched>(&'a K::Held);
        impl<K: Watched> serde::Serialize for One<'_, K> {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                K::write_saved(self.0, serializer)
            }
        }
        serializer.collect_seq(self.0.iter().map(One::<K>))
    }
}

/// A kind's changed objects, serialised as `[key, object]` pairs in the checkpoint's form
/// (`null` for a deleted one).
struct WrittenChanges<'a, K: Watched>(&'a [(ObjectKey, Option<K::Held>)]);

impl<K: Watched> serde::Serialize for WrittenChanges<'_, K> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        struct One<'a, K: Watched>(&'a ObjectKey, Option<&'a K::Held>);
        impl<K: Watched> serde::Serialize for One<'_, K> {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                use serde::ser::SerializeTuple;
                struct Object<'a, K: Watched>(&'a K::Held);
                impl<K: Watched> serde::Serialize for Object<'_, K> {
                    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                        K::write_saved(self.0, serializer)
                    }
                }
                let mut pair = serializer.serialize_tuple(2)?;
                pair.serialize_element(self.0)?;
                pair.serialize_element(&self.1.map(Object::<K>))?;
                pair.end()
            }
        }
        serializer.collect_seq(self.0.iter().map(|(key, held)| One::<K>(key, held.as_ref())))
    }
}

impl ClusterObjects {
    /// Every kind has been listed completely since start: the checkpoint is a whole picture.
    pub fn all_synced(&self) -> bool {
        Kind::ALL.iter().all(|kind| self.listed(*kind))
    }
}

/// How often, and how patiently, the API server's reachability is probed.
pub const PROBE_INTERVAL: Duration = Duration::from_secs(5);
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

fn spawn_probe(client: Client, updates: mpsc::Sender<WatchUpdate>) {
    tokio::spawn(async move {
        loop {
            let update = match tokio::time::timeout(PROBE_TIMEOUT, client.apiserver_version()).await {
                Ok(Ok(_)) => WatchUpdate::Probe { reachable: true, message: String::new() },
                Ok(Err(kube::Error::Api(status))) => {
                    WatchUpdate::Probe { reachable: true, message: status.to_string() }
                }
                Ok(Err(e)) => WatchUpdate::Probe { reachable: false, message: e.to_string() },
                Err(_) => WatchUpdate::Probe {
                    reachable: false,
                    message: format!("no answer to GET /version within {PROBE_TIMEOUT:?}"),
                },
            };
            if updates.send(update).await.is_err() {
                return;
            }
            tokio::time::sleep(PROBE_INTERVAL).await;
        }
    });
}

/// Starts the watchers; they run until the receiver is dropped.
pub fn spawn_watchers(client: Client, updates: mpsc::Sender<WatchUpdate>) {
    // Watch requests time out server-side after this; shorter than any client read timeout.
    let config = watcher::Config::default().timeout(20);
    spawn_kinds(&client, &config, &updates);
    spawn_probe(client, updates);
}

fn spawn_one<K>(
    api: Api<K>,
    config: watcher::Config,
    updates: mpsc::Sender<WatchUpdate>,
    resource: &'static str,
    wrap: fn(watcher::Event<K>) -> WatchUpdate,
) where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + 'static,
    K::DynamicType: Default,
{
    tokio::spawn(async move {
        let mut stream = watcher(api, config).default_backoff().boxed();
        while let Some(item) = stream.next().await {
            let update = match item {
                Ok(event) => wrap(event),
                Err(e) => WatchUpdate::Error { resource, message: e.to_string() },
            };
            if updates.send(update).await.is_err() {
                return;
            }
        }
    });
}
