//! Kubernetes NetworkPolicy (networking.k8s.io/v1) compiler.
//!
//! Pure and I/O free: feed it `Pod`, `Namespace` and `NetworkPolicy`
//! objects, get a [`CompiledModel`] keyed by pod IP, with per-direction
//! [`Isolation`] and rules of (peer set x port ranges), plus a flattening
//! into BPF-map-shaped entries ([`flatten`], documented in docs/policy-layout.md).
//!
//! * [`compile`] compiles a full snapshot; [`PolicyCompiler`] does the same
//!   incrementally from watch events and returns a [`Delta`] per event.
//! * [`allows`] is the reference decision for a new connection: egress of
//!   the source AND ingress of the destination (only the pod sides that exist).
//! * Reply packets of an allowed connection are not policy-checked: the
//!   datapath must admit them via conntrack (established/related state), so
//!   nothing for them is compiled here.
//! * Traffic between a pod and its own node, and hostNetwork pods, are outside
//!   NetworkPolicy; hostNetwork pods are ignored (their IP is the node's).

mod compile;
pub mod engine;
mod error;
mod eval;
pub mod flatten;
mod incremental;
mod inputs;
pub mod maps;
mod model;
pub(crate) mod parse;
mod selector;

#[cfg(test)]
mod tests;

pub use compile::{compile, CompileOutput};
pub use error::{PolicyError, PolicyErrorKind};
pub use eval::{allows, side_allows};
pub use incremental::{Delta, PodSetChange, PolicyCompiler};
pub use model::{
    CidrBlock, CompiledModel, Direction, Isolation, NamedPortFilter, NamespaceScope, PeerSet, PodRef, PodRules,
    PodSetKey, PortRange, Ports, Protocol, Rule,
};
pub use parse::NAMESPACE_NAME_LABEL;
pub use selector::{Labels, Operator, Requirement, Selector};
