//! kube-router agent library: the pure control-plane logic and the kernel edges it drives.
pub mod agent;
pub mod bpf;
pub mod cli;
pub mod config;
pub mod controllers;
pub mod exposition;
pub mod flags;
pub mod health;
pub mod http;
pub mod k8s;
pub mod kr_metrics;
pub mod launch;
pub mod legacy;
pub mod map_writes;
pub mod metrics;
pub mod monitor;
pub mod node;
pub mod policy;
pub mod process_metrics;
pub mod routing;
pub mod runtime;
pub mod services;
pub mod status_socket;

// Old paths of moved modules, still named by files other branches are changing now (`k8s/`,
// `controllers/services.rs`): delete these once those are merged and their paths rewritten
// (the sed is in DEVELOPERS.md's Layout). `tests/module_cycles.rs` resolves them to their targets.
pub(crate) use node::netif;
#[cfg(test)]
pub(crate) use node::{egress, pod_cidrs};
pub(crate) use routing::bgp;
pub(crate) use services::healthcheck;
