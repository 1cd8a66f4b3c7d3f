//! The metrics and health listeners.
use std::net::{IpAddr, Ipv4Addr};

use crate::config::ListenerOptions;

/// `--metrics-*` and `--health-*`.
#[derive(clap::Args, Debug, Clone)]
#[command(next_help_heading = "Metrics and health")]
pub struct MetricsFlags {
    /// Port of the metrics listener: Prometheus metrics at --metrics-path, the /bgp status page
    /// (`kube-router bgp` reads it) and the health endpoints (0 disables).
    #[arg(long, env = "KUBE_ROUTER_METRICS_PORT", default_value_t = 0)]
    pub metrics_port: u16,
    /// Address of the metrics listener. The default keeps the metrics (every Service, VIP, BGP
    /// peer and route) from the pods: set the node's InternalIP (or 0.0.0.0) to scrape it from
    /// elsewhere, behind a firewall rule or NetworkPolicy for the node.
    /// Empty: every address.
    #[arg(long, env = "KUBE_ROUTER_METRICS_ADDR", default_value = "127.0.0.1", value_parser = parse_listen_addr)]
    pub metrics_addr: std::net::IpAddr,
    /// Path of the Prometheus metrics on the metrics listener.
    #[arg(long, env = "KUBE_ROUTER_METRICS_PATH", default_value = "/metrics", value_parser = parse_metrics_path)]
    pub metrics_path: String,
    /// Port for the health endpoints /healthz, /livez and /readyz, on every address (0 disables).
    #[arg(long, env = "KUBE_ROUTER_HEALTH_PORT", default_value_t = 20244)]
    pub health_port: u16,
    /// Address of the health endpoints (empty or 0.0.0.0: every IPv4 address; the kubelet probes
    /// the node's, so a livenessProbe needs the same address).
    #[arg(long, env = "KUBE_ROUTER_HEALTH_ADDR", default_value = "0.0.0.0", value_parser = parse_listen_addr)]
    pub health_addr: std::net::IpAddr,
}

impl From<&MetricsFlags> for ListenerOptions {
    fn from(flags: &MetricsFlags) -> Self {
        ListenerOptions {
            metrics_port: flags.metrics_port,
            metrics_addr: flags.metrics_addr,
            metrics_path: flags.metrics_path.clone(),
            health_port: flags.health_port,
            health_addr: flags.health_addr,
        }
    }
}

/// A listening address; empty is upstream's "every address".
pub(super) fn parse_listen_addr(text: &str) -> Result<IpAddr, String> {
    if text.is_empty() {
        return Ok(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
    }
    text.parse().map_err(|_| format!("{text:?} is not an IP address"))
}

fn parse_metrics_path(path: &str) -> Result<String, String> {
    if path.starts_with('/') && !path.contains(char::is_whitespace) {
        Ok(path.to_string())
    } else {
        Err("a path starting with / without spaces".to_string())
    }
}
