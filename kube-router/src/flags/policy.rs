//! NetworkPolicy enforcement and the pod source check.
use crate::config::PolicyOptions;

/// `--run-firewall`, `--enable-pod-source-check`.
#[derive(clap::Args, Debug, Clone)]
#[command(next_help_heading = "Network policy")]
pub struct PolicyFlags {
    /// Enforce Kubernetes NetworkPolicy in the eBPF datapath (needs the API server).
    #[arg(long, env = "KUBE_ROUTER_RUN_FIREWALL", default_value_t = true, action = clap::ArgAction::Set)]
    pub run_firewall: bool,
    /// Drop packets from a pod whose source address is not one of that pod's own (read from its
    /// network namespace), as Cilium's source IP verification and Calico's RPF check on workload
    /// interfaces do. Checked on pod veths the agent finds itself (not an --interfaces list).
    #[arg(long, env = "KUBE_ROUTER_ENABLE_POD_SOURCE_CHECK", default_value_t = true, action = clap::ArgAction::Set)]
    pub enable_pod_source_check: bool,
}

impl From<&PolicyFlags> for PolicyOptions {
    fn from(flags: &PolicyFlags) -> Self {
        PolicyOptions { run: flags.run_firewall, pod_source_check: flags.enable_pod_source_check }
    }
}
