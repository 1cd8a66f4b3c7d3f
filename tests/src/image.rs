//! The container image: its name, and buildah/podman invoked the way `cargo xtask image` builds
//! it and the image smoke test runs it.
use std::process::Command;

/// The repository `cargo xtask image` commits to; the manifests name it with the version.
pub const IMAGE_REPOSITORY: &str = "localhost/kube-router";

/// `localhost/kube-router:<workspace version>`, as built and as the manifests reference it.
pub fn image_ref() -> String {
    format!("{IMAGE_REPOSITORY}:{}", env!("CARGO_PKG_VERSION"))
}

/// Containers storage with the vfs driver: it makes no overlay mounts, which would exist only in
/// the mount namespace that made them (the tests run in private ones, see scripts/isolated.sh).
const STORAGE: [&str; 2] = ["--storage-driver", "vfs"];

pub fn buildah() -> Command {
    let mut cmd = Command::new("buildah");
    cmd.args(STORAGE);
    cmd
}

/// podman with runc: crun cannot set up containers on hosts with hybrid (v1 + v2) cgroups.
pub fn podman() -> Command {
    let mut cmd = Command::new("podman");
    cmd.args(["--runtime", "runc"]).args(STORAGE);
    cmd
}

/// Resource limits for `podman run`. Podman's defaults (1048576 open files and more processes)
/// are above the hard limits of a root without CAP_SYS_RESOURCE (a CI sandbox), where runc then
/// fails to start the container. RLIMIT_NPROC is not enforced for root.
pub const RUN_LIMITS: [&str; 4] = ["--ulimit", "nofile=10000:10000", "--ulimit", "nproc=1000:1000"];

/// The CNI plugins in the image and where (`kube_router::node::cni_install::{PLUGINS,
/// IMAGE_PLUGIN_DIR}`; `image_smoke` runs `install-cni` from the image, which fails on any
/// difference).
pub const CNI_PLUGINS: [&str; 4] = ["bridge", "host-local", "portmap", "loopback"];
pub use crate::cluster::CNI_PLUGIN_DIR;
