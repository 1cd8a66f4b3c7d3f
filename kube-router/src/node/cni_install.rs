//! `kube-router install-cni`: what upstream's `install-cni` init container does, without a
//! shell. It copies the CNI plugins kube-router's configuration uses (from the image) into the
//! host's plugin directory where they are missing, and writes kube-router's CNI configuration
//! template where there is none, so the kubelet sees a pod network before the agent fills in the
//! node's ranges (`node/cni.rs`).
//!
//! It never replaces what is there: a plugin already on the host (the distribution's, k3s's) is
//! kept, as is any file at the configuration path (the agent uses it as its template). Unlike
//! upstream, other CNIs' configurations are not deleted; one that sorts before ours (the
//! runtime uses the first) is reported.
use std::{
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};
use serde::Serialize;

/// The plugins kube-router's configuration runs (bridge, its IPAM, portmap) and the loopback one
/// every runtime calls.
pub const PLUGINS: &[&str] = &["bridge", "host-local", "portmap", "loopback"];
/// Where the image holds them (Debian's containernetworking-plugins path).
pub const IMAGE_PLUGIN_DIR: &str = "/usr/lib/cni";
pub const DEFAULT_BIN_DIR: &str = "/opt/cni/bin";

#[derive(Debug, Clone)]
pub struct InstallOptions {
    /// The plugins to copy from.
    pub plugin_source: PathBuf,
    /// The host's plugin directory.
    pub bin_dir: PathBuf,
    /// The configuration file the agent writes (`--cni-conf-file`).
    pub conf_file: PathBuf,
}

#[derive(Debug, Default, Serialize, PartialEq, Eq)]
pub struct InstallReport {
    /// Plugins copied into the host's directory.
    pub installed: Vec<String>,
    /// Plugins already there, left as they were.
    pub kept: Vec<String>,
    /// The configuration file was written (there was none).
    pub config_written: bool,
    /// Other CNI configurations that sort before ours: the runtime uses the first one.
    pub shadowing_configs: Vec<String>,
}

pub fn install(options: &InstallOptions) -> Result<InstallReport> {
    let mut report = InstallReport::default();
    std::fs::create_dir_all(&options.bin_dir).with_context(|| format!("creating {}", options.bin_dir.display()))?;
    for plugin in PLUGINS {
        let target = options.bin_dir.join(plugin);
        if is_executable_file(&target) {
            report.kept.push(plugin.to_string());
            continue;
        }
        let source = options.plugin_source.join(plugin);
        if !is_executable_file(&source) {
            bail!("the CNI plugin {} is missing from this image", source.display());
        }
        copy_atomically(&source, &target, 0o755)?;
        report.installed.push(plugin.to_string());
    }
    if !options.conf_file.exists() {
        crate::node::cni::write_if_changed(&options.conf_file, &crate::node::cni::default_template())?;
        report.config_written = true;
    }
    report.shadowing_configs = shadowing_configs(&options.conf_file);
    Ok(report)
}

/// The CNI configurations in our file's directory that a runtime would pick before it (it takes
/// the first `.conf`, `.conflist` or `.json` by name).
fn shadowing_configs(conf_file: &Path) -> Vec<String> {
    let (Some(dir), Some(ours)) = (conf_file.parent(), conf_file.file_name().and_then(|n| n.to_str())) else {
        return Vec::new();
    };
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| !n.starts_with('.') && [".conf", ".conflist", ".json"].iter().any(|ext| n.ends_with(ext)))
        .filter(|n| n.as_str() < ours)
        .collect();
    names.sort();
    names
}

fn is_executable_file(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Copies under a temporary name in the target's directory, then renames: the runtime never
/// executes a half-written plugin.
fn copy_atomically(source: &Path, target: &Path, mode: u32) -> Result<()> {
    let dir = target.parent().context("the plugin path has no directory")?;
    let name = target.file_name().and_then(|n| n.to_str()).context("plugin name")?;
    let tmp = dir.join(format!(".{name}.kube-router.tmp"));
    std::fs::copy(source, &tmp).with_context(|| format!("copying {} to {}", source.display(), tmp.display()))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))?;
    std::fs::rename(&tmp, target).with_context(|| format!("renaming {} to {}", tmp.display(), target.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Dirs {
        root: PathBuf,
        options: InstallOptions,
    }

    impl Drop for Dirs {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }

    fn dirs(name: &str) -> Dirs {
        let root = std::env::temp_dir().join(format!("krt-install-cni-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let source = root.join("image");
        std::fs::create_dir_all(&source).unwrap();
        for plugin in PLUGINS {
            std::fs::write(source.join(plugin), format!("image {plugin}")).unwrap();
            std::fs::set_permissions(source.join(plugin), std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let options = InstallOptions {
            plugin_source: source,
            bin_dir: root.join("opt/cni/bin"),
            conf_file: root.join("etc/cni/net.d/10-kuberouter.conflist"),
        };
        Dirs { root, options }
    }

    #[test]
    fn installs_missing_plugins_and_the_template_and_keeps_what_is_there() {
        let d = dirs("fresh");
        let o = &d.options;
        std::fs::create_dir_all(&o.bin_dir).unwrap();
        // The host's own portmap stays; a non-executable leftover is replaced.
        std::fs::write(o.bin_dir.join("portmap"), "host portmap").unwrap();
        std::fs::set_permissions(o.bin_dir.join("portmap"), std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(o.bin_dir.join("loopback"), "broken").unwrap();
        let report = install(o).unwrap();
        assert_eq!(report.installed, ["bridge", "host-local", "loopback"]);
        assert_eq!(report.kept, ["portmap"]);
        assert!(report.config_written);
        assert_eq!(std::fs::read_to_string(o.bin_dir.join("portmap")).unwrap(), "host portmap");
        assert_eq!(std::fs::read_to_string(o.bin_dir.join("loopback")).unwrap(), "image loopback");
        let mode = std::fs::metadata(o.bin_dir.join("bridge")).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o755);
        let written: serde_json::Value = serde_json::from_slice(&std::fs::read(&o.conf_file).unwrap()).unwrap();
        assert_eq!(written, crate::node::cni::default_template());

        // Again: nothing to do; the agent's filled-in configuration is not reset.
        std::fs::write(&o.conf_file, "{\"agent\": \"filled in\"}").unwrap();
        let again = install(o).unwrap();
        assert!(again.installed.is_empty() && !again.config_written);
        assert_eq!(again.kept.len(), PLUGINS.len());
        assert_eq!(std::fs::read_to_string(&o.conf_file).unwrap(), "{\"agent\": \"filled in\"}");
        let leftovers: Vec<_> = std::fs::read_dir(&o.bin_dir).unwrap().filter_map(|e| e.ok()).collect();
        assert_eq!(leftovers.len(), PLUGINS.len(), "no temporary files left");
    }

    #[test]
    fn another_cnis_config_is_reported_never_touched() {
        let d = dirs("other");
        let o = &d.options;
        let dir = o.conf_file.parent().unwrap();
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("05-cilium.conflist"), "cilium's").unwrap();
        std::fs::write(dir.join("99-loopback.conf"), "late").unwrap();
        let report = install(o).unwrap();
        assert_eq!(report.shadowing_configs, ["05-cilium.conflist"]);
        assert_eq!(std::fs::read_to_string(dir.join("05-cilium.conflist")).unwrap(), "cilium's");
        assert_eq!(std::fs::read_to_string(dir.join("99-loopback.conf")).unwrap(), "late");
    }

    #[test]
    fn a_plugin_missing_from_the_image_is_an_error_naming_it() {
        let d = dirs("missing");
        std::fs::remove_file(d.options.plugin_source.join("portmap")).unwrap();
        let error = format!("{:#}", install(&d.options).unwrap_err());
        assert!(error.contains("portmap is missing from this image"), "{error}");
    }
}
