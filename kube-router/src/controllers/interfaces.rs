//! Attaches the programs to interfaces as they appear (netlink link events, and a rescan as a
//! safety net), and tells the services controller when the node's addresses change.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::Arc,
    time::Duration,
};

use anyhow::Result;
use kube_router_common::{SOURCE_CHECK_BY_LB, SOURCE_CHECK_BY_POLICY};
use tokio::sync::watch;

use crate::node::pod_sources::{self, PodSourceCheck};
use crate::{
    bpf::{
        attach_metrics::AttachMetrics,
        datapath::{AttachOutcome, Datapath, Hook},
        socket_lb::SockHook,
        xdp::{self, XdpSetting},
    },
    k8s::{
        cache::{Cache, Subscription},
        store::{Feed, ObjectKey},
        watch::Kind,
    },
    metrics::Metrics,
    node::netif,
    runtime::{Action, Controller, Trigger},
};

/// How often interfaces are looked for without a link event.
const RESCAN_INTERVAL: Duration = Duration::from_secs(5);

/// Which of our programs go on interfaces.
#[derive(Clone, Copy)]
pub struct Programs {
    /// `--run-service-proxy`: the load balancer at TC on every interface.
    pub load_balancer: bool,
    /// `--run-firewall`: network policy at TC on pod interfaces.
    pub firewall: bool,
    /// `--xdp`: the fast path on uplinks.
    pub xdp: XdpSetting,
}

impl Programs {
    /// The object's programs an agent with these features (and the socket load balancer, if
    /// `socket_lb`) attaches: only those are verified at its start. Never the overlay's, which
    /// its own load verifies where a tunnel is needed.
    pub fn attached(self, socket_lb: bool) -> Vec<&'static str> {
        let mut names = Vec::new();
        if self.load_balancer {
            names.extend(Hook::LOAD_BALANCER.map(Hook::program));
            if self.xdp != XdpSetting::Off {
                names.push(xdp::PROGRAM);
            }
        }
        if self.firewall {
            names.extend(Hook::POLICY.map(Hook::program));
        }
        if socket_lb {
            names.extend(SockHook::ALL.map(SockHook::program));
        }
        names
    }
}

pub struct InterfacesController {
    datapath: Datapath,
    /// `--interfaces`: attached once at start; else every interface, as they come.
    wanted: Option<Vec<String>>,
    /// Interface name -> index it was attached at.
    attached: BTreeMap<String, u32>,
    programs: Programs,
    node_addresses: watch::Sender<Vec<IpAddr>>,
    /// `--enable-pod-source-check`: the pod veths' own addresses, written before they are attached.
    pod_sources: Option<PodSourceCheck>,
    /// The API server's and the configured BGP peer routers' addresses: the links the node
    /// reaches them by are uplinks, never pod veths.
    upstreams: Vec<IpAddr>,
    metrics: Metrics,
}

impl InterfacesController {
    /// Attaches to what is there now (before anything else runs: the upgrade of the pinned
    /// maps needs the links on the new programs).
    pub fn start(
        mut datapath: Datapath,
        wanted: Option<Vec<String>>,
        programs: Programs,
        pod_source_check: bool,
        upstreams: Vec<IpAddr>,
        metrics: Metrics,
    ) -> Self {
        let mut attached = BTreeMap::new();
        let mut pod_sources = open_pod_sources(&datapath, pod_source_check, programs.load_balancer);
        attach_all(
            &mut datapath,
            &wanted,
            &mut attached,
            programs,
            || uplinks(&upstreams),
            pod_sources.as_mut(),
            &metrics,
        );
        let node_addresses = watch::Sender::new(netif::node_addresses());
        let controller = Self { datapath, wanted, attached, programs, node_addresses, pod_sources, upstreams, metrics };
        controller.publish_pod_sources();
        controller
    }

    /// Shows the pod source check's state.
    fn publish_pod_sources(&self) {
        if let Some(sources) = &self.pod_sources {
            let counts = sources.counts();
            self.metrics.of::<super::datapath_stats::DatapathMetrics>().set_pod_source_veths(counts);
        }
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
                self.programs,
                || uplinks(&self.upstreams),
                self.pod_sources.as_mut(),
                &self.metrics,
            );
        }
        // A pod's addresses appear after its veth: read again until they are there (link
        // events, the pod's object getting its IPs and the rescan all bring us here).
        if let Some(sources) = self.pod_sources.as_mut() {
            let names = self.attached.iter().map(|(name, index)| (*index, name.clone())).collect();
            sources.refresh(&names);
        }
        self.publish_pod_sources();
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

/// The pod source check's map writer, or `None` when the check is off (its entries then
/// removed, so no veth stays checked by an earlier run's choice).
fn open_pod_sources(datapath: &Datapath, enabled: bool, load_balancer: bool) -> Option<PodSourceCheck> {
    if !enabled {
        if let Err(e) = pod_sources::clear(datapath.pin_dir()) {
            tracing::warn!(error = format!("{e:#}"), "cannot clear the pod source addresses");
        }
        return None;
    }
    // The load balancer runs first at a veth's TC ingress and may source-NAT: it checks when there.
    let checked_by = if load_balancer { SOURCE_CHECK_BY_LB } else { SOURCE_CHECK_BY_POLICY };
    match PodSourceCheck::open(datapath.pin_dir(), checked_by) {
        Ok(sources) => Some(sources),
        Err(e) => {
            tracing::error!(
                error = format!("{e:#}"),
                "pod source check unavailable: pod source addresses are not checked"
            );
            None
        }
    }
}

/// Changes of this node's Pod objects (none without the API server). Pods elsewhere in the
/// cluster change hundreds of times a second in a large one and concern no interface here: the
/// trigger takes the Pod store's changes on its own feed and wakes only when one of them is a
/// pod on this node, or one that was (deleted, or rescheduled away).
pub struct LocalPodsTrigger {
    cache: Arc<Cache>,
    changes: Subscription,
    node_name: String,
    feed: Option<Feed>,
    /// The Pods on this node as last seen, so a removal is known to be local.
    local: BTreeSet<ObjectKey>,
}

impl LocalPodsTrigger {
    pub fn new(cache: Arc<Cache>, node_name: String) -> Self {
        let changes = cache.subscribe(&[Kind::Pods]);
        Self { cache, changes, node_name, feed: None, local: BTreeSet::new() }
    }

    /// Takes the Pod store's changes since the last call: whether one is on this node or was.
    /// Before the Pods are listed every change counts (nothing tells them apart yet).
    fn local_pods_changed(&mut self) -> bool {
        let (feed, local, node) = (&mut self.feed, &mut self.local, self.node_name.as_str());
        let on_this_node =
            |pod: Option<&crate::k8s::pod::SlimPod>| pod.is_some_and(|pod| pod.node_name.as_deref() == Some(node));
        let listing = self.cache.update(&[Kind::Pods], |objects| {
            let pods = &mut objects.pods;
            let feed = *feed.get_or_insert_with(|| pods.subscribe());
            match pods.take_changes(feed) {
                // The first read, or after a restore: every Pod may have changed.
                None => {
                    *local = pods.keys().filter(|key| on_this_node(pods.get(key))).cloned().collect();
                    true
                }
                Some(keys) => {
                    let mut changed = false;
                    for key in keys {
                        changed |= if on_this_node(pods.get(&key)) {
                            local.insert(key);
                            true
                        } else {
                            local.remove(&key)
                        };
                    }
                    changed
                }
            }
        });
        listing.is_none_or(|listing| listing.objects)
    }
}

impl Trigger for LocalPodsTrigger {
    async fn changed(&mut self) -> bool {
        loop {
            if !self.changes.changed().await {
                return false;
            }
            if self.local_pods_changed() {
                return true;
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
    programs: Programs,
    uplinks: impl FnOnce() -> Vec<String>,
    mut pod_sources: Option<&mut PodSourceCheck>,
    metrics: &Metrics,
) {
    let Programs { load_balancer, firewall, xdp } = programs;
    let present: BTreeMap<String, u32> = netif::interfaces_with_index().into_iter().collect();
    attached.retain(|name, index| present.get(name) == Some(index));
    if let Some(sources) = pod_sources.as_deref_mut() {
        sources.retain(&present.values().copied().collect::<BTreeSet<u32>>());
    }
    crate::bpf::datapath::prune_vanished(datapath.pin_dir(), &present.keys().cloned().collect());
    let interfaces = wanted.clone().unwrap_or_else(|| present.keys().cloned().collect());
    let new: Vec<(String, u32)> = interfaces
        .into_iter()
        .filter(|interface| !attached.contains_key(interface))
        .filter_map(|interface| present.get(&interface).map(|&index| (interface, index)))
        .collect();
    if new.is_empty() {
        return;
    }
    // Only a new interface needs telling apart (a route dump: 5,000 routes on a large cluster).
    let uplinks = uplinks();
    for (interface, index) in new {
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
        // Before the programs: a pod veth is never attached unchecked.
        if let Some(sources) = pod_sources.as_deref_mut().filter(|_| pod) {
            sources.update(&interface, index);
        }
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
                    metrics.of::<AttachMetrics>().record("tc", &[ingress, egress]);
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
            apply_xdp(datapath, &interface, xdp != XdpSetting::Off && uplinks.contains(&interface), xdp, metrics);
        }
        if ok {
            attached.insert(interface, index);
        }
    }
}

/// Interfaces that carry the default route or the route to one of `upstreams` (the API server,
/// the peer routers): a node in a container or namespace may reach them over a veth, which
/// must then not be taken for a pod's.
fn uplinks(upstreams: &[IpAddr]) -> Vec<String> {
    let mut uplinks = netif::default_route_interfaces();
    if upstreams.is_empty() {
        return uplinks;
    }
    let mut resolver = match pod_sources::Resolver::open() {
        Ok(resolver) => resolver,
        Err(e) => {
            tracing::warn!(error = format!("{e:#}"), "cannot look up the routes to the API server and peers");
            return uplinks;
        }
    };
    for upstream in upstreams {
        if let Ok(Some(index)) = resolver.route_interface(*upstream) {
            uplinks.extend(netif::interface_name(index));
        }
    }
    uplinks.sort();
    uplinks.dedup();
    uplinks
}

/// Attaches (`wanted`) or removes our XDP link on `interface`; never touches another's.
fn apply_xdp(datapath: &mut Datapath, interface: &str, wanted: bool, setting: XdpSetting, metrics: &Metrics) {
    if !wanted {
        match xdp::detach(datapath.pin_dir(), interface) {
            Ok(true) => tracing::info!(interface, "XDP fast path detached"),
            Ok(false) => {}
            Err(e) => tracing::warn!(interface, error = format!("{e:#}"), "cannot detach the XDP fast path"),
        }
        return;
    }
    match xdp::attach(datapath, interface, setting) {
        Ok((outcome, mode)) => {
            metrics.of::<AttachMetrics>().record("xdp", &[outcome]);
            tracing::info!(interface, ?outcome, ?mode, "XDP fast path attached")
        }
        // Logged once: the interface is not retried until it is re-created or the agent restarts.
        Err(e) => tracing::error!(interface, error = format!("{e:#}"), "cannot attach the XDP fast path; TC serves it"),
    }
}

#[cfg(test)]
mod tests {
    use kube::runtime::watcher::Event;

    use super::*;
    use crate::k8s::{pod::PodFields, watch::ClusterObjects, watch::WatchUpdate};

    #[test]
    fn an_agent_verifies_only_the_programs_its_features_attach() {
        let all = Programs { load_balancer: true, firewall: true, xdp: XdpSetting::Auto };
        let names = all.attached(true);
        assert_eq!(names.len(), 13, "{names:?}");
        assert!(!names.iter().any(|n| n.starts_with("kr_ovl")), "the overlay verifies its own: {names:?}");
        let firewall_only = Programs { load_balancer: false, firewall: true, xdp: XdpSetting::Auto };
        assert_eq!(firewall_only.attached(false), ["kr_pol_ingress", "kr_pol_egress"]);
        let no_xdp = Programs { xdp: XdpSetting::Off, ..all };
        assert_eq!(no_xdp.attached(false), ["kr_lb_ingress", "kr_lb_egress", "kr_pol_ingress", "kr_pol_egress"]);
    }

    fn pod(name: &str, node: &str, ip: &str) -> PodFields {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "default", "resourceVersion": "1"},
            "spec": {"nodeName": node},
            "status": {"podIP": ip, "podIPs": [{"ip": ip}]}
        }))
        .unwrap()
    }

    /// Pods coming and going on other nodes wake nothing here; this node's own do, their
    /// removal too, and a pod rescheduled away from it (known only from what was seen before).
    #[test]
    fn only_this_nodes_pods_wake_the_interfaces() {
        let cache = Cache::new(ClusterObjects::default(), None);
        let mut trigger = LocalPodsTrigger::new(cache.clone(), "node-0".into());
        assert!(trigger.local_pods_changed(), "before the Pods are listed every change counts");
        cache.apply(WatchUpdate::Pods(Event::Init));
        cache.apply(WatchUpdate::Pods(Event::InitApply(pod("here", "node-0", "10.0.0.2"))));
        cache.apply(WatchUpdate::Pods(Event::InitApply(pod("there", "node-1", "10.0.1.2"))));
        cache.apply(WatchUpdate::Pods(Event::InitDone));
        assert!(trigger.local_pods_changed(), "the first read after the listing");
        assert!(!trigger.local_pods_changed(), "nothing changed since");

        cache.apply(WatchUpdate::Pods(Event::Apply(pod("there", "node-1", "10.0.1.3"))));
        cache.apply(WatchUpdate::Pods(Event::Apply(pod("new-there", "node-1", "10.0.1.4"))));
        cache.apply(WatchUpdate::Pods(Event::Delete(pod("there", "node-1", "10.0.1.3"))));
        assert!(!trigger.local_pods_changed(), "pods of another node woke this one");

        cache.apply(WatchUpdate::Pods(Event::Apply(pod("here", "node-0", "10.0.0.3"))));
        assert!(trigger.local_pods_changed(), "this node's pod changed");
        cache.apply(WatchUpdate::Pods(Event::Apply(pod("here", "node-1", "10.0.0.3"))));
        assert!(trigger.local_pods_changed(), "a pod that left this node");
        cache.apply(WatchUpdate::Pods(Event::Apply(pod("here", "node-1", "10.0.0.4"))));
        assert!(!trigger.local_pods_changed(), "once gone, it is another node's");
        cache.apply(WatchUpdate::Pods(Event::Apply(pod("back", "node-0", "10.0.0.5"))));
        cache.apply(WatchUpdate::Pods(Event::Delete(pod("back", "node-0", "10.0.0.5"))));
        // As if it never was: nothing of it is left for the source check (its veth, if it had
        // one, is gone with a link event of its own).
        assert!(!trigger.local_pods_changed(), "a pod added and deleted between reads");
        cache.apply(WatchUpdate::Pods(Event::Apply(pod("gone", "node-0", "10.0.0.6"))));
        assert!(trigger.local_pods_changed());
        cache.apply(WatchUpdate::Pods(Event::Delete(pod("gone", "node-0", "10.0.0.6"))));
        assert!(trigger.local_pods_changed(), "this node's pod deleted");
    }
}
