//! The CNI role (kube-router's `--enable-cni`): the node's CNI configuration, written from its
//! Node object, so a new node gets a pod network without anything else installed.
//!
//! The configuration is kube-router's: a `bridge` plugin on `kube-bridge` (gateway for the pods,
//! hairpin mode) with `host-local` IPAM over the Node's `spec.podCIDRs`, then `portmap`. If a
//! file is already there (a DaemonSet's ConfigMap template, say), it is the template: only the
//! bridge plugin's IPAM ranges (and MTU, with `--auto-mtu`) are set, everything else is kept. The
//! file is written atomically and only when its contents change. The agent also creates
//! `kube-bridge` with the pods' gateway addresses, so it exists before the first pod.
use std::{
    net::IpAddr,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};
use ipnet::IpNet;
use serde_json::{json, Value};

pub const BRIDGE: &str = "kube-bridge";
pub const DEFAULT_CONF_FILE: &str = "/etc/cni/net.d/10-kuberouter.conflist";

/// kube-router's CNI configuration list, before the node's ranges are filled in.
pub fn default_template() -> Value {
    json!({
        "cniVersion": "0.3.0",
        "name": "mynet",
        "plugins": [
            {
                "name": "kubernetes",
                "type": "bridge",
                "bridge": BRIDGE,
                "isDefaultGateway": true,
                "hairpinMode": true,
                "ipam": {"type": "host-local"}
            },
            {"type": "portmap", "capabilities": {"snat": true, "portMappings": true}}
        ]
    })
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CniError {
    #[error("the Node has no spec.podCIDR(s): no pod network can be configured")]
    NoPodCidr,
    #[error("the CNI configuration has no bridge plugin to configure")]
    NoBridgePlugin,
}

/// The configuration for pods in `pod_cidrs`, from `template` (a single plugin configuration
/// is accepted and becomes a list). `mtu`: set on the bridge plugin when given.
pub fn conflist(template: &Value, pod_cidrs: &[IpNet], mtu: Option<u32>) -> Result<Value, CniError> {
    if pod_cidrs.is_empty() {
        return Err(CniError::NoPodCidr);
    }
    let mut list = if template.get("plugins").is_some() {
        template.clone()
    } else {
        let mut single = template.clone();
        let version = single.as_object_mut().and_then(|o| o.remove("cniVersion")).unwrap_or(json!("0.3.0"));
        let name = single.get("name").cloned().unwrap_or(json!("mynet"));
        json!({"cniVersion": version, "name": name, "plugins": [single]})
    };
    let bridge = list["plugins"]
        .as_array_mut()
        .and_then(|plugins| plugins.iter_mut().find(|p| p["type"] == "bridge"))
        .ok_or(CniError::NoBridgePlugin)?;
    let ranges: Vec<Value> = pod_cidrs.iter().map(|net| json!([{"subnet": net.trunc().to_string()}])).collect();
    if !bridge["ipam"].is_object() {
        bridge["ipam"] = json!({"type": "host-local"});
    }
    let ipam = bridge["ipam"].as_object_mut().expect("an object");
    ipam.remove("subnet");
    ipam.insert("ranges".into(), json!(ranges));
    if let Some(mtu) = mtu {
        bridge["mtu"] = json!(mtu);
    }
    Ok(list)
}

/// The pods' gateway on the bridge: the first address of each pod CIDR (what the bridge plugin
/// with `isDefaultGateway` assigns), with the CIDR's prefix length.
pub fn gateways(pod_cidrs: &[IpNet]) -> Vec<IpNet> {
    pod_cidrs
        .iter()
        .filter_map(|net| {
            let gateway: IpAddr = match net.trunc().network() {
                IpAddr::V4(a) => IpAddr::V4((u32::from(a) + 1).into()),
                IpAddr::V6(a) => IpAddr::V6((u128::from(a) + 1).into()),
            };
            IpNet::new(gateway, net.prefix_len()).ok()
        })
        .collect()
}

/// Writes `contents` to `path` atomically (a temporary file renamed over it), only if different.
/// Returns whether it wrote.
pub fn write_if_changed(path: &Path, contents: &Value) -> Result<bool> {
    let text = serde_json::to_string_pretty(contents)? + "\n";
    if std::fs::read_to_string(path).ok().as_deref() == Some(text.as_str()) {
        return Ok(false);
    }
    let dir = path.parent().context("the CNI configuration path has no directory")?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp: PathBuf = dir.join(format!(".{}.tmp", path.file_name().and_then(|n| n.to_str()).unwrap_or("conflist")));
    std::fs::write(&tmp, &text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))?;
    Ok(true)
}

/// The template for `path`: the file already there (if it parses), else kube-router's default.
pub fn template_at(path: &Path) -> Value {
    std::fs::read(path).ok().and_then(|bytes| serde_json::from_slice(&bytes).ok()).unwrap_or_else(default_template)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nets(list: &[&str]) -> Vec<IpNet> {
        list.iter().map(|n| n.parse().unwrap()).collect()
    }

    #[test]
    fn the_node_pod_cidrs_become_the_bridge_plugins_ranges() {
        let list = conflist(&default_template(), &nets(&["10.244.1.0/24", "fd00:244:1::/64"]), Some(1450)).unwrap();
        let bridge = &list["plugins"][0];
        assert_eq!(bridge["bridge"], "kube-bridge");
        assert_eq!(bridge["isDefaultGateway"], true);
        assert_eq!(bridge["ipam"]["ranges"], json!([[{"subnet": "10.244.1.0/24"}], [{"subnet": "fd00:244:1::/64"}]]));
        assert_eq!(bridge["mtu"], 1450);
        assert_eq!(list["plugins"][1]["type"], "portmap");
    }

    #[test]
    fn an_existing_template_keeps_everything_but_the_ranges() {
        // kube-router's ConfigMap shape: one bridge plugin, IPAM without a subnet.
        let template = json!({"cniVersion": "0.3.0", "name": "mynet", "plugins": [
            {"name": "kubernetes", "type": "bridge", "bridge": "kube-bridge", "isDefaultGateway": true,
             "hairpinMode": true, "ipam": {"type": "host-local", "subnet": "10.0.0.0/8", "dataDir": "/x"}},
            {"type": "bandwidth", "capabilities": {"bandwidth": true}}]});
        let list = conflist(&template, &nets(&["10.244.7.0/24"]), None).unwrap();
        assert_eq!(list["plugins"][1]["type"], "bandwidth");
        assert_eq!(
            list["plugins"][0]["ipam"],
            json!({"type": "host-local", "dataDir": "/x", "ranges": [[{"subnet": "10.244.7.0/24"}]]})
        );
        assert!(list["plugins"][0].get("mtu").is_none());
        // The same input gives the same output: rewriting an unchanged Node changes nothing.
        assert_eq!(conflist(&list, &nets(&["10.244.7.0/24"]), None).unwrap(), list);
    }

    #[test]
    fn a_single_plugin_template_becomes_a_list_and_bad_input_is_refused() {
        let single = json!({"cniVersion": "0.4.0", "name": "net", "type": "bridge", "bridge": "kube-bridge"});
        let list = conflist(&single, &nets(&["10.244.2.0/24"]), None).unwrap();
        assert_eq!(list["cniVersion"], "0.4.0");
        assert_eq!(list["plugins"][0]["type"], "bridge");
        assert_eq!(conflist(&default_template(), &[], None), Err(CniError::NoPodCidr));
        assert_eq!(
            conflist(&json!({"plugins": [{"type": "ptp"}]}), &nets(&["10.0.0.0/24"]), None),
            Err(CniError::NoBridgePlugin)
        );
    }

    #[test]
    fn gateways_are_the_first_address_of_each_pod_cidr() {
        let text: Vec<String> =
            gateways(&nets(&["10.244.1.0/24", "fd00:244:1::/64"])).iter().map(|n| n.to_string()).collect();
        assert_eq!(text, ["10.244.1.1/24", "fd00:244:1::1/64"]);
    }
}
