//! The kernel side of the agent: loading the datapath, pinned maps and links, map writes.
pub mod datapath;
pub mod layout;
pub mod migrate;
pub mod policy_maps;
pub mod service_maps;
pub mod socket_lb;
pub mod svc_stats;
pub mod test_run;

/// The datapath object built by build.rs (aya-build) from the kube-router-ebpf crate.
pub static DATAPATH_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/kube-router"));

use std::path::{Path, PathBuf};

/// Where this layout's maps are pinned: `<bpf root>/v<LAYOUT_VERSION>/`.
pub fn maps_dir(pin_dir: &Path) -> PathBuf {
    pin_dir.join(format!("v{}", kube_router_common::LAYOUT_VERSION))
}

/// The pin path of one of this layout's maps.
pub fn pinned_map(pin_dir: &Path, name: &str) -> PathBuf {
    maps_dir(pin_dir).join(name)
}
