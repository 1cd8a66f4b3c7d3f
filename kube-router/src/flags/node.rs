//! This node in the cluster's network: its name and addresses, the families it serves, its
//! CNI configuration, and what leaves the cluster masqueraded.
use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr},
    path::PathBuf,
};

use super::drop_if_empty;
use crate::{
    config::{CniOptions, NodeOptions},
    services::family::IpFamily,
};

/// The node's identity and addresses, `--enable-ipv4/6`, the CNI role, pod egress.
#[derive(clap::Args, Debug, Clone)]
#[command(next_help_heading = "Node networking and CNI")]
pub struct NodeFlags {
    /// This node's name (its Node object; externalTrafficPolicy: Local). Default: the NODE_NAME
    /// environment variable (upstream's manifests set it from spec.nodeName), else the hostname.
    #[arg(long, env = "KUBE_ROUTER_HOSTNAME_OVERRIDE")]
    pub hostname_override: Option<String>,
    /// Address source-NATed flows leave with. Default: the source address of the node's default
    /// route (else its first address).
    #[arg(long, env = "KUBE_ROUTER_NODE_IP")]
    pub node_ip: Option<Ipv4Addr>,
    /// Serve IPv4. Unset: wherever the node has an IPv4 address. true: refuse to start without
    /// one. false: IPv4 Services are not programmed.
    #[arg(long, env = "KUBE_ROUTER_ENABLE_IPV4", action = clap::ArgAction::Set)]
    pub enable_ipv4: Option<bool>,
    /// Serve IPv6. Unset: wherever the node has a global IPv6 address. true: refuse to start
    /// without one. false: IPv6 Services are not programmed.
    #[arg(long, env = "KUBE_ROUTER_ENABLE_IPV6", action = clap::ArgAction::Set)]
    pub enable_ipv6: Option<bool>,
    /// Write the node's CNI configuration from its Node object (pod CIDRs) and create the pod
    /// bridge, as kube-router's CNI role does.
    #[arg(long, env = "KUBE_ROUTER_ENABLE_CNI", default_value_t = true, action = clap::ArgAction::Set)]
    pub enable_cni: bool,
    /// Where the CNI configuration is written (an existing file there is the template).
    #[arg(long, env = "KUBE_ROUTER_CNI_CONF_FILE", default_value = crate::node::cni::DEFAULT_CONF_FILE)]
    pub cni_conf_file: PathBuf,
    /// Set the pod network's MTU from the node's uplink.
    #[arg(long, env = "KUBE_ROUTER_AUTO_MTU", default_value_t = true, action = clap::ArgAction::Set)]
    pub auto_mtu: bool,
    /// Masquerade pod traffic to destinations outside the cluster to the node address.
    #[arg(long, env = "KUBE_ROUTER_ENABLE_POD_EGRESS", default_value_t = true, action = clap::ArgAction::Set)]
    pub enable_pod_egress: bool,
    /// CIDR range(s) of the cluster's pods (comma-separated), besides every Node's podCIDRs:
    /// traffic to them is never masqueraded.
    #[arg(long, env = "KUBE_ROUTER_CLUSTER_CIDR", value_delimiter = ',')]
    pub cluster_cidr: Vec<ipnet::IpNet>,
    /// The Service ClusterIP range(s) (comma-separated): inside the cluster, never masqueraded.
    #[arg(long, env = "KUBE_ROUTER_SERVICE_CLUSTER_IP_RANGE", value_delimiter = ',', default_value = "10.96.0.0/12")]
    pub service_cluster_ip_range: Vec<ipnet::IpNet>,
}

impl NodeFlags {
    /// `--hostname-override`, else `NODE_NAME` (upstream's manifests set it), else the hostname.
    pub fn node_name(&self, node_name_env: Option<String>) -> String {
        node_name(self.hostname_override.as_deref(), node_name_env)
    }

    /// The families whose Services are not programmed (`--enable-ipv4=false`,
    /// `--enable-ipv6=false`); Err when a flag asks for a family `node_addresses` lacks, or
    /// both are off.
    pub fn disabled_families(&self, node_addresses: &[IpAddr]) -> Result<BTreeSet<IpFamily>, String> {
        let mut disabled = BTreeSet::new();
        for (flag, family, setting) in
            [("--enable-ipv4", IpFamily::IPv4, self.enable_ipv4), ("--enable-ipv6", IpFamily::IPv6, self.enable_ipv6)]
        {
            match setting {
                Some(true) if !node_addresses.iter().any(|a| IpFamily::of(a) == family) => {
                    return Err(format!(
                        "{flag}: this node has no {family:?} address (loopback and link-local ones do not count): \
                         give it one, or leave the flag out to serve only the families the node has"
                    ))
                }
                Some(false) => {
                    disabled.insert(family);
                }
                _ => {}
            }
        }
        if disabled.len() == 2 {
            return Err("--enable-ipv4=false and --enable-ipv6=false leave no address family to serve".to_string());
        }
        Ok(disabled)
    }

    /// `--enable-cni`: what the CNI configuration writer needs.
    pub fn cni_options(&self) -> Option<CniOptions> {
        self.enable_cni.then(|| CniOptions { conf_file: self.cni_conf_file.clone(), auto_mtu: self.auto_mtu })
    }

    pub(super) fn drop_empty_values(&mut self) {
        drop_if_empty(&mut self.hostname_override);
    }
}

impl From<&NodeFlags> for NodeOptions {
    fn from(flags: &NodeFlags) -> Self {
        NodeOptions {
            node_ip: flags.node_ip,
            cluster_cidrs: flags.cluster_cidr.clone(),
            service_ranges: flags.service_cluster_ip_range.clone(),
            pod_egress: flags.enable_pod_egress,
            cni: flags.cni_options(),
        }
    }
}

/// `--hostname-override`, else `NODE_NAME` (upstream's manifests set it), else the hostname.
pub fn node_name(hostname_override: Option<&str>, node_name_env: Option<String>) -> String {
    hostname_override.map(str::to_string).or_else(|| node_name_env.filter(|n| !n.is_empty())).unwrap_or_else(hostname)
}

pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}
