//! The pinned maps under the bpffs directory, as every feature opens them: their paths
//! (`<bpf root>/v<LAYOUT_VERSION>/<name>`), opening one, a write error as the map writer reports
//! it, per-CPU counter arrays (`counters`), the one conntrack garbage collector
//! (`conntrack_gc`), the API-state stamps in `meta` (`stamps`) and the plain-traffic cache's
//! generation (`plain`).
pub mod batch;
pub mod conntrack_gc;
pub mod counters;
pub mod plain;
pub mod stamps;

use std::path::{Path, PathBuf};

/// Where this layout's maps are pinned: `<bpf root>/v<LAYOUT_VERSION>/`.
pub fn maps_dir(pin_dir: &Path) -> PathBuf {
    pin_dir.join(format!("v{}", kube_router_common::LAYOUT_VERSION))
}

/// The pin path of one of this layout's maps.
pub fn pinned_map(pin_dir: &Path, name: &str) -> PathBuf {
    maps_dir(pin_dir).join(name)
}

/// One of this layout's pinned maps, opened.
pub fn open_pinned(pin_dir: &Path, name: &str) -> anyhow::Result<aya::maps::MapData> {
    use anyhow::Context;
    let path = pinned_map(pin_dir, name);
    aya::maps::MapData::from_pin(&path).with_context(|| format!("opening pinned map {}", path.display()))
}

/// A failed map operation as the map writer reports it; `full` when the kernel refused for
/// want of room (E2BIG, ENOMEM), which the writer tries once per pass.
pub(crate) fn write_error(map: &'static str, error: aya::maps::MapError) -> crate::map_writes::MapWriteError {
    let full = matches!(&error, aya::maps::MapError::SyscallError(e) if matches!(e.io_error.raw_os_error(), Some(libc::E2BIG) | Some(libc::ENOMEM)));
    crate::map_writes::MapWriteError { map, message: error.to_string(), full }
}
