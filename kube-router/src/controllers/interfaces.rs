//! Attaches the programs to interfaces as they appear (netlink link events, and a rescan as a
//! safety net), and tells the services controller when the node's addresses change.
use std::{collections::BTreeMap, net::IpAddr, time::Duration};

use anyhow::Result;
use tokio::sync::watch;

use crate::{
    bpf::{
        datapath::{AttachOutcome, Datapath},
        xdp::{self, XdpSetting},
    },
    netif,
    runtime::{Action, Controller, Trigger},
};

/// How often interfaces are looked for without a link event.
const RESCAN_INTERVAL: Duration = Duration::from_secs(5);

pub struct InterfacesController {
    datapath: Datapath,
    /// `--interfaces`: attached once at start; else every interface, as they come.
    wanted: Option<Vec<String>>,
    /// Interface name -> index it was attached at.
    attached: BTreeMap<String, u32>,
    load_balancer: bool,
    firewall: bool,
    /// `--xdp`: the fast path on uplinks.
    xdp: XdpSetting,
    node_addresses: watch::Sender<Vec<IpAddr>>,
}

impl InterfacesController {
    /// Attaches to what is there now (before anything else runs: the upgrade of the pinned
    /// maps needs the links on the new programs).
    pub fn start(
        mut datapath: Datapath,
        wanted: Option<Vec<String>>,
        load_balancer: bool,
        firewall: bool,
        xdp: XdpSetting,
    ) -> Self {
        let mut attached = BTreeMap::new();
        attach_all(&mut datapath, &wanted, &mut attached, load_balancer, firewall, xdp);
        let node_addresses = watch::Sender::new(netif::node_addresses());
        Self { datapath, wanted, attached, load_balancer, firewall, xdp, node_addresses }
    }

    pub fn datapath(&mut self) -> &mut Datapath {
        &mut self.datapath
    }

    /// The node's addresses, updated on link and address events.
    pub fn node_addresses(&self) -> watch::Receiver<Vec<IpAddr>> {
        self.node_addresses.subscribe()
    }
}

impl Controller for InterfacesController {
    fn name(&self) -> &'static str {
        "interfaces"
    }

    async fn reconcile(&mut self) -> Result<Action> {
        if self.wanted.is_none() {
            attach_all(
                &mut self.datapath,
                &self.wanted,
                &mut self.attached,
                self.load_balancer,
                self.firewall,
                self.xdp,
            );
        }
        // NodePorts listen on the node's addresses: a changed set recompiles the Services.
        let now = netif::node_addresses();
        self.node_addresses.send_if_modified(|addresses| {
            let changed = *addresses != now;
            if changed {
                tracing::info!(addresses = ?now, "node addresses changed; recompiling Services");
                *addresses = now;
            }
            changed
        });
        Ok(if self.wanted.is_none() { Action::RequeueAfter(RESCAN_INTERVAL) } else { Action::AwaitChange })
    }
}

/// Netlink link and address events; none (the rescan only) when they cannot be had.
pub struct LinkTrigger(pub Option<netif::LinkEvents>);

impl Trigger for LinkTrigger {
    async fn changed(&mut self) -> bool {
        let Some(events) = self.0.as_mut() else { return false };
        match events.changed().await {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "link events failed; new interfaces are found by a 5 s rescan");
                self.0 = None;
                false
            }
        }
    }
}

/// Attaches one feature's ingress and egress programs to an interface.
type AttachFn = fn(&mut Datapath, &str) -> Result<[AttachOutcome; 2]>;

/// Attaches both features to every interface (or the `--interfaces` list) not yet attached.
/// `attached` maps names to the interface index they were attached at: an interface deleted
/// and re-created under the same name (a StatefulSet pod's veth) has a new index and is
/// attached again; vanished ones are forgotten.
fn attach_all(
    datapath: &mut Datapath,
    wanted: &Option<Vec<String>>,
    attached: &mut BTreeMap<String, u32>,
    load_balancer: bool,
    firewall: bool,
    xdp: XdpSetting,
) {
    let present: BTreeMap<String, u32> = netif::interfaces_with_index().into_iter().collect();
    attached.retain(|name, index| present.get(name) == Some(index));
    crate::bpf::datapath::prune_vanished(datapath.pin_dir(), &present.keys().cloned().collect());
    let interfaces = wanted.clone().unwrap_or_else(|| present.keys().cloned().collect());
    let uplinks = netif::default_route_interfaces();
    for interface in interfaces {
        let Some(&index) = present.get(&interface) else { continue };
        if attached.contains_key(&interface) {
            continue;
        }
        let mut ok = true;
        // Policy on pod veths only (docs/requirements.md), so host and transit flows never
        // fill its conntrack; an explicit --interfaces list gets both everywhere.
        let pod_side = wanted.is_some() || netif::is_pod_interface(&interface, &uplinks);
        if firewall && !pod_side {
            for hook in crate::bpf::datapath::Hook::POLICY {
                match datapath.detach_hook(hook, &interface) {
                    Ok(true) => {
                        tracing::info!(interface, program = hook.program(), "not a pod interface: policy detached")
                    }
                    Ok(false) => {}
                    Err(e) => tracing::warn!(interface, error = format!("{e:#}"), "cannot detach the policy"),
                }
            }
        }
        // Pod veths found by the agent itself are attached in the pod mode (fast); an explicit
        // --interfaces list in the node mode.
        let pod = wanted.is_none() && pod_side;
        let hooks: [(bool, &str, AttachFn); 2] = [
            (load_balancer, "load balancer", if pod { Datapath::attach_pod } else { Datapath::attach }),
            (
                firewall && pod_side,
                "network policy",
                if pod { Datapath::attach_policy_pod } else { Datapath::attach_policy },
            ),
        ];
        for (_, what, attach) in hooks.into_iter().filter(|(enabled, _, _)| *enabled) {
            match attach(datapath, &interface) {
                Ok([ingress, egress]) => {
                    tracing::info!(interface, ?ingress, ?egress, "{what} attached at TC ingress and egress")
                }
                Err(e) => {
                    tracing::error!(interface, error = format!("{e:#}"), "cannot attach the {what}");
                    ok = false;
                }
            }
        }
        // The XDP fast path sits in front of the load balancer on uplinks only (north-south
        // traffic arrives there); a failure leaves TC serving everything, as without it.
        if load_balancer {
            apply_xdp(datapath, &interface, xdp != XdpSetting::Off && uplinks.contains(&interface), xdp);
        }
        if ok {
            attached.insert(interface, index);
        }
    }
}

/// Attaches (`wanted`) or removes our XDP link on `interface`; never touches another's.
fn apply_xdp(datapath: &mut Datapath, interface: &str, wanted: bool, setting: XdpSetting) {
    if !wanted {
        match xdp::detach(datapath.pin_dir(), interface) {
            Ok(true) => tracing::info!(interface, "XDP fast path detached"),
            Ok(false) => {}
            Err(e) => tracing::warn!(interface, error = format!("{e:#}"), "cannot detach the XDP fast path"),
        }
        return;
    }
    match xdp::attach(datapath, interface, setting) {
        Ok((outcome, mode)) => tracing::info!(interface, ?outcome, ?mode, "XDP fast path attached"),
        // Logged once: the interface is not retried until it is re-created or the agent restarts.
        Err(e) => tracing::error!(interface, error = format!("{e:#}"), "cannot attach the XDP fast path; TC serves it"),
    }
}
