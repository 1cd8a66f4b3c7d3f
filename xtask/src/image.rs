//! `cargo xtask image`: the agent as a static binary in a from-scratch OCI image, built without
//! a container daemon. buildah (vfs storage) commits it to local containers storage as
//! `localhost/kube-router:<version>` and writes the same image to target/image/kube-router.oci.tar.
//!
//! The image holds /usr/local/bin/kube-router (static, musl; the eBPF object is embedded),
//! /etc/ssl/certs/ca-certificates.crt and the CNI plugins `kube-router install-cni` copies onto
//! the host (/usr/lib/cni/{bridge,host-local,portmap,loopback}, Debian's
//! containernetworking-plugins from the build machine). Those plugins run on the host, never in
//! the image: Debian builds them against glibc (2.34 or later), so a host without one keeps its
//! own plugins (install-cni replaces none). The CA bundle is there because kube-rs
//! builds its TLS connector from the system trust store whenever the API config carries no CA of
//! its own (`--master` without a kubeconfig, even for http://) and fails without one; the
//! in-cluster config and the manifests' kubeconfig bring the cluster CA and do not use it. No
//! /etc/passwd (the agent runs as root and looks up no users), no shell, no libc.
use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{bail, ensure, Context, Result};
use kube_router_tests::image::{buildah, image_ref, podman, RUN_LIMITS};

use crate::{cargo, run, workspace_root};

const TARGET: &str = "x86_64-unknown-linux-musl";
/// Cargo profile of the image's binary (workspace Cargo.toml): release without symbols.
const PROFILE: &str = "image";
/// Debian's ca-certificates bundle on the build machine.
const CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";
/// Debian's containernetworking-plugins on the build machine; the same path in the image.
use kube_router_tests::image::CNI_PLUGIN_DIR;
const WORKING_CONTAINER: &str = "kube-router-image-build";

pub fn archive_path() -> PathBuf {
    workspace_root().join("target/image/kube-router.oci.tar")
}

pub fn build() -> Result<()> {
    let started = Instant::now();
    cargo(&["build", "--profile", PROFILE, "--target", TARGET, "--package", "kube-router", "--bin", "kube-router"])?;
    let binary = workspace_root().join("target").join(TARGET).join(PROFILE).join("kube-router");
    ensure_static(&binary)?;
    ensure!(Path::new(CA_BUNDLE).exists(), "{CA_BUNDLE} missing: install ca-certificates (scripts/setup.sh)");
    for plugin in kube_router_tests::image::CNI_PLUGINS {
        let path = Path::new(CNI_PLUGIN_DIR).join(plugin);
        ensure!(path.exists(), "{} missing: install containernetworking-plugins (scripts/setup.sh)", path.display());
    }
    let compiled = started.elapsed();

    let name = image_ref();
    let previous = output(buildah().args(["images", "--quiet", "--no-trunc", &name])).unwrap_or_default();
    // A working container left by an interrupted build would make `from --name` fail.
    let _ = buildah().args(["rm", WORKING_CONTAINER]).output();
    run(buildah().args(["from", "--name", WORKING_CONTAINER, "scratch"]))?;
    let assembled = assemble(&binary, &name);
    if assembled.is_err() {
        let _ = buildah().args(["rm", WORKING_CONTAINER]).output();
    }
    assembled?;
    let current = output(buildah().args(["images", "--quiet", "--no-trunc", &name]))?;
    if !previous.is_empty() && previous != current {
        // The replaced build, now untagged: vfs keeps a full copy of every image. Still used by a
        // container, it stays.
        let _ = buildah().args(["rmi", &previous]).output();
    }

    let archive = archive_path();
    std::fs::create_dir_all(archive.parent().expect("target/image"))?;
    let _ = std::fs::remove_file(&archive);
    let destination = format!("oci-archive:{}:{name}", archive.display());
    run(buildah().args(["push", "--quiet", &name, &destination]))?;

    // The image runs: its entrypoint is the agent, static in an empty filesystem. No network:
    // podman's default one would put a bridge and firewall rules on the host.
    let version =
        output(podman().args(["run", "--rm", "--network", "none"]).args(RUN_LIMITS).args([&name, "--version"]))?;
    ensure!(version == format!("kube-router {}", env!("CARGO_PKG_VERSION")), "{name} --version printed {version:?}");
    let size = std::fs::metadata(&archive)?.len();
    println!(
        "image {name} ({current}): {} ({:.1} MiB); binary built in {:.0?}, image in {:.1?}",
        archive.display(),
        size as f64 / (1 << 20) as f64,
        compiled,
        started.elapsed() - compiled
    );
    Ok(())
}

fn assemble(binary: &Path, name: &str) -> Result<()> {
    let c = WORKING_CONTAINER;
    run(buildah().args(["copy", "--quiet", "--chmod", "0755", c]).arg(binary).arg("/usr/local/bin/kube-router"))?;
    run(buildah().args(["copy", "--quiet", "--chmod", "0644", c, CA_BUNDLE, CA_BUNDLE]))?;
    for plugin in kube_router_tests::image::CNI_PLUGINS {
        let path = format!("{CNI_PLUGIN_DIR}/{plugin}");
        run(buildah().args(["copy", "--quiet", "--chmod", "0755", c, &path, &path]))?;
    }
    let version = env!("CARGO_PKG_VERSION");
    run(buildah().args(["config", "--entrypoint", r#"["/usr/local/bin/kube-router"]"#]).args([
        "--env",
        "PATH=/usr/local/bin",
        "--os",
        "linux",
        "--arch",
        "amd64",
        "--label",
        "org.opencontainers.image.title=kube-router",
        "--label",
        "org.opencontainers.image.description=Kubernetes service proxy, network policy and BGP routing on an eBPF datapath",
        "--label",
        &format!("org.opencontainers.image.version={version}"),
        "--label",
        "org.opencontainers.image.licenses=Apache-2.0",
        c,
    ]))?;
    // The commit's time, not now: the same sources give the same image config.
    let timestamp = output(Command::new("git").args(["log", "-1", "--format=%ct"])).unwrap_or_else(|_| "0".into());
    run(buildah().args(["commit", "--quiet", "--format", "oci", "--timestamp", &timestamp, "--rm", c, name]))
}

/// Refuses a dynamically linked binary (an ELF program interpreter): it would not start in an
/// image without a libc.
fn ensure_static(binary: &Path) -> Result<()> {
    let elf = std::fs::read(binary).with_context(|| format!("reading {}", binary.display()))?;
    ensure!(
        elf.len() > 64 && elf.starts_with(b"\x7fELF\x02\x01"),
        "{} is not a 64-bit little-endian ELF",
        binary.display()
    );
    let u16_at = |at: usize| u16::from_le_bytes([elf[at], elf[at + 1]]) as usize;
    let program_headers = u64::from_le_bytes(elf[0x20..0x28].try_into()?) as usize;
    let (entry_size, count) = (u16_at(0x36), u16_at(0x38));
    const PT_INTERP: u32 = 3;
    for i in 0..count {
        let at = program_headers + i * entry_size;
        let kind = elf.get(at..at + 4).context("truncated program header")?;
        if u32::from_le_bytes(kind.try_into()?) == PT_INTERP {
            bail!("{} is dynamically linked: the image has no libc", binary.display());
        }
    }
    Ok(())
}

/// Runs a command and returns its trimmed stdout.
fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd.current_dir(workspace_root()).output().with_context(|| format!("starting {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}
