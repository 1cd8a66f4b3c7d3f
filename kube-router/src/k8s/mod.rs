//! The Kubernetes API side: client setup, watchers, the stores they fill, the checkpoint.
pub mod cache;
pub mod checkpoint;
pub mod intern;
pub mod kinds;
pub mod labels;
pub mod namespace;
pub mod node;
pub mod pod;
pub mod slim;
pub mod store;
pub mod watch;

/// A Node's zone (a well-known label): the slimmed Node keeps it, and topology-aware routing
/// serves this node's zone's hints.
pub const TOPOLOGY_ZONE_LABEL: &str = "topology.kubernetes.io/zone";
