//! The kernel side of the agent: loading the datapath, pinned maps and links, map writes.
pub mod datapath;
pub mod layout;
pub mod policy_maps;
pub mod service_maps;
pub mod socket_lb;
pub mod test_run;

/// The datapath object built by build.rs (aya-build) from the kube-router-ebpf crate.
pub static DATAPATH_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/kube-router"));
