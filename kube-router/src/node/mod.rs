//! This node's own plumbing: its pod CIDRs (`pod_cidrs`), the CNI configuration it writes
//! (`cni`) and installs (`cni_install`, the `install-cni` init container), pod egress
//! masquerading (`egress`) and the interface helpers the datapath attaches by (`netif`).
pub mod cluster_nets;
pub mod cni;
pub mod cni_install;
pub mod egress;
pub mod netif;
pub mod pod_cidrs;
pub mod pod_sources;
