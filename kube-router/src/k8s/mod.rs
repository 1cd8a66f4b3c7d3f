//! The Kubernetes API side: client setup, watchers, the stores they fill, the checkpoint.
pub mod cache;
pub mod checkpoint;
pub mod intern;
pub mod kinds;
pub mod namespace;
pub mod pod;
pub mod slim;
pub mod store;
pub mod watch;
