//! kube-router agent library: the pure control-plane logic and the kernel edges it drives.
pub mod agent;
pub mod bgp;
pub mod bpf;
pub mod cni;
pub mod egress;
pub mod fib;
pub mod firewall;
pub mod healthcheck;
pub mod k8s;
pub mod kr_metrics;
pub mod metrics;
pub mod monitor;
pub mod netif;
pub mod overlay;
pub mod policy;
pub mod router;
pub mod services;
