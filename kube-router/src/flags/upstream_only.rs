//! Upstream kube-router's flags that mean nothing here: parsed so that upstream's DaemonSets
//! run unchanged, each given with an effect upstream warned about once (docs/flags.md).
use std::time::Duration;

use super::{drop_if_empty, parse_go_duration, Upstream};

/// Upstream kube-router's flags that mean nothing here (docs/flags.md says why for each): they
/// parse so that upstream's DaemonSets run unchanged; given with an effect upstream, one warning
/// at start. `--run-loadbalancer` and `--netpol-default-deny` stop the agent when enabled.
#[derive(clap::Args)]
#[command(next_help_heading = "Upstream kube-router flags (no effect here, see docs/flags.md)")]
pub struct UpstreamOnlyFlags {
    /// Upstream: deadline for the informer caches' first sync.
    #[arg(long, value_parser = parse_go_duration)]
    pub cache_sync_timeout: Option<Duration>,
    /// Upstream: disable the AWS EC2 source/destination check through the AWS API.
    #[arg(long, action = clap::ArgAction::Set)]
    pub disable_source_dest_check: Option<bool>,
    /// Upstream: Go's pprof on port 6060.
    #[arg(long, action = clap::ArgAction::Set)]
    pub enable_pprof: Option<bool>,
    /// Upstream: CIDRs whose IPVS services are never deleted.
    #[arg(long, value_delimiter = ',')]
    pub excluded_cidrs: Option<Vec<String>>,
    /// Upstream: address of GoBGP's gRPC API.
    #[arg(long)]
    pub gobgp_admin_address: Option<String>,
    /// Upstream: port of GoBGP's gRPC API (0: off, which is what happens here).
    #[arg(long)]
    pub gobgp_admin_port: Option<u16>,
    /// Upstream: period of the injected routes' sync.
    #[arg(long, value_parser = parse_go_duration)]
    pub injected_routes_sync_period: Option<Duration>,
    /// Upstream: period of the iptables rules' sync.
    #[arg(long, value_parser = parse_go_duration)]
    pub iptables_sync_period: Option<Duration>,
    /// Upstream: how long IPVS keeps a removed destination.
    #[arg(long, value_parser = parse_go_duration)]
    pub ipvs_graceful_period: Option<Duration>,
    /// Upstream: IPVS graceful termination of removed destinations.
    #[arg(long, action = clap::ArgAction::Set)]
    pub ipvs_graceful_termination: Option<bool>,
    /// Upstream: an iptables rule accepting all traffic to Service addresses.
    #[arg(long, action = clap::ArgAction::Set)]
    pub ipvs_permit_all: Option<bool>,
    /// Upstream: period of the IPVS sync.
    #[arg(long, value_parser = parse_go_duration)]
    pub ipvs_sync_period: Option<Duration>,
    /// Upstream: the LoadBalancer address allocator takes Services without a class.
    #[arg(long, action = clap::ArgAction::Set)]
    pub loadbalancer_default_class: Option<bool>,
    /// Upstream: period of the LoadBalancer address allocator's check.
    #[arg(long, value_parser = parse_go_duration)]
    pub loadbalancer_sync_period: Option<Duration>,
    /// Upstream: pods without a policy applied yet are denied (refused when true).
    #[arg(long, action = clap::ArgAction::Set)]
    pub netpol_default_deny: Option<bool>,
    /// Upstream: period of the route and advertisement sync.
    #[arg(long, value_parser = parse_go_duration)]
    pub routes_sync_period: Option<Duration>,
    /// Upstream: the LoadBalancer address allocator (refused when true).
    #[arg(long, action = clap::ArgAction::Set)]
    pub run_loadbalancer: Option<bool>,
    /// Upstream: the container runtime's socket, for DSR.
    #[arg(long)]
    pub runtime_endpoint: Option<String>,
    /// Upstream: the NodePort range its iptables input rules admit.
    #[arg(long)]
    pub service_node_port_range: Option<String>,
    /// Upstream: nftables instead of iptables for NetworkPolicy.
    #[arg(long, action = clap::ArgAction::Set)]
    pub use_nftables_for_netpol: Option<bool>,
}

impl UpstreamOnlyFlags {
    /// The flags given with an effect upstream (so worth a warning here): set at all, except
    /// booleans and durations given their "off" value and the gRPC port given 0.
    pub fn given(&self) -> Vec<&'static str> {
        let on = |b: Option<bool>| b == Some(true);
        [
            ("cache-sync-timeout", self.cache_sync_timeout.is_some()),
            ("disable-source-dest-check", on(self.disable_source_dest_check)),
            ("enable-pprof", on(self.enable_pprof)),
            ("excluded-cidrs", self.excluded_cidrs.is_some()),
            ("gobgp-admin-address", self.gobgp_admin_address.is_some()),
            ("gobgp-admin-port", self.gobgp_admin_port.is_some_and(|p| p != 0)),
            ("injected-routes-sync-period", self.injected_routes_sync_period.is_some()),
            ("iptables-sync-period", self.iptables_sync_period.is_some()),
            ("ipvs-graceful-period", self.ipvs_graceful_period.is_some()),
            ("ipvs-graceful-termination", on(self.ipvs_graceful_termination)),
            ("ipvs-permit-all", self.ipvs_permit_all.is_some()),
            ("ipvs-sync-period", self.ipvs_sync_period.is_some()),
            ("loadbalancer-default-class", self.loadbalancer_default_class.is_some()),
            ("loadbalancer-sync-period", self.loadbalancer_sync_period.is_some()),
            ("netpol-default-deny", on(self.netpol_default_deny)),
            ("routes-sync-period", self.routes_sync_period.is_some()),
            ("run-loadbalancer", on(self.run_loadbalancer)),
            ("runtime-endpoint", self.runtime_endpoint.is_some()),
            ("service-node-port-range", self.service_node_port_range.is_some()),
            ("use-nftables-for-netpol", on(self.use_nftables_for_netpol)),
        ]
        .into_iter()
        .filter_map(|(flag, given)| given.then_some(flag))
        .collect()
    }

    /// Err: a refused flag was enabled (the message says why and what instead). Ok: the
    /// warnings to log, one per flag.
    pub fn check(&self) -> Result<Vec<String>, String> {
        let mut warnings = Vec::new();
        for flag in self.given() {
            match super::upstream_status(flag) {
                Some(Upstream::Refused(why)) => return Err(format!("--{flag}: {why}")),
                Some(Upstream::Obsolete(why)) => warnings.push(format!("--{flag} has no effect: {why}")),
                other => unreachable!("--{flag} is not an upstream-only flag: {other:?}"),
            }
        }
        Ok(warnings)
    }
}

impl UpstreamOnlyFlags {
    pub(super) fn drop_empty_values(&mut self) {
        drop_if_empty(&mut self.gobgp_admin_address);
        drop_if_empty(&mut self.runtime_endpoint);
        drop_if_empty(&mut self.service_node_port_range);
    }
}
