//! Builds the eBPF datapath (kube-router-ebpf) for bpfel-unknown-none with the nightly
//! toolchain, as aya-template does; the object is embedded with include_bytes_aligned!.
use anyhow::{anyhow, Context as _};

fn main() -> anyhow::Result<()> {
    // `kube_router_build_info`'s `goversion` label carries the Rust compiler's version instead.
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let version = std::process::Command::new(rustc).arg("--version").output().context("rustc --version")?;
    let version = String::from_utf8_lossy(&version.stdout);
    let version = version.split_whitespace().nth(1).unwrap_or("unknown");
    println!("cargo:rustc-env=KUBE_ROUTER_RUSTC_VERSION=rust{version}");
    let cargo_metadata::Metadata { packages, .. } =
        cargo_metadata::MetadataCommand::new().no_deps().exec().context("MetadataCommand::exec")?;
    let ebpf_package = packages
        .into_iter()
        .find(|cargo_metadata::Package { name, .. }| name.as_str() == "kube-router-ebpf")
        .ok_or_else(|| anyhow!("kube-router-ebpf package not found"))?;
    let cargo_metadata::Package { name, manifest_path, .. } = ebpf_package;
    let root_dir = manifest_path.parent().ok_or_else(|| anyhow!("no parent for {manifest_path}"))?.as_str().to_string();
    let package = aya_build::Package { name: name.as_str(), root_dir: &root_dir, ..Default::default() };
    aya_build::build_ebpf([package], aya_build::Toolchain::default())
}
