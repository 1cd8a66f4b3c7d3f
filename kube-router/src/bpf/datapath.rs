//! Loading the datapath over the pinned maps and attaching it through pinned TCX links.
use std::{
    fs,
    path::{Path, PathBuf},
};

use anyhow::{anyhow, Context, Result};
use aya::{
    maps::{Array, MapData},
    programs::{
        links::{FdLink, LinkOrder, PinnedLink},
        tc::{SchedClassifierLink, TcAttachOptions},
        SchedClassifier, TcAttachType,
    },
    Ebpf, EbpfLoader,
};
use kube_router_common::{map_names, LAYOUT_VERSION, META_LAYOUT_VERSION};

use super::{layout, DATAPATH_OBJECT};

/// A TC hook and the program that runs there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hook {
    /// Load balancer, TC ingress of node interfaces: DNAT to a backend.
    Ingress,
    /// Load balancer, TC egress: reverse NAT of replies.
    Egress,
    /// NetworkPolicy, TC ingress of a pod veth's host side: packets *from* the pod (its egress policy).
    PolicyIngress,
    /// NetworkPolicy, TC egress of a pod veth's host side: packets *to* the pod (its ingress policy).
    PolicyEgress,
    /// Pod overlay, TC egress towards tunnel endpoints: IPIP/FOU encapsulation.
    OverlayEncap,
    /// Pod overlay, TC ingress: decapsulation of tunnelled packets from known nodes.
    OverlayDecap,
}

impl Hook {
    /// Every program of the object (all are loaded).
    pub const ALL: [Hook; 6] =
        [Hook::Ingress, Hook::Egress, Hook::PolicyIngress, Hook::PolicyEgress, Hook::OverlayEncap, Hook::OverlayDecap];
    pub const LOAD_BALANCER: [Hook; 2] = [Hook::Ingress, Hook::Egress];
    pub const POLICY: [Hook; 2] = [Hook::PolicyIngress, Hook::PolicyEgress];
    pub const OVERLAY: [Hook; 2] = [Hook::OverlayEncap, Hook::OverlayDecap];

    pub fn program(self) -> &'static str {
        match self {
            Hook::Ingress => "kr_lb_ingress",
            Hook::Egress => "kr_lb_egress",
            Hook::PolicyIngress => "kr_pol_ingress",
            Hook::PolicyEgress => "kr_pol_egress",
            Hook::OverlayEncap => "kr_ovl_encap",
            Hook::OverlayDecap => "kr_ovl_decap",
        }
    }

    fn attach_type(self) -> TcAttachType {
        match self {
            Hook::Ingress | Hook::PolicyIngress | Hook::OverlayDecap => TcAttachType::Ingress,
            Hook::Egress | Hook::PolicyEgress | Hook::OverlayEncap => TcAttachType::Egress,
        }
    }

    fn pin_name(self, interface: &str) -> String {
        match self {
            Hook::Ingress => format!("tc_ingress_{interface}"),
            Hook::Egress => format!("tc_egress_{interface}"),
            Hook::PolicyIngress => format!("pol_ingress_{interface}"),
            Hook::PolicyEgress => format!("pol_egress_{interface}"),
            Hook::OverlayEncap => format!("ovl_egress_{interface}"),
            Hook::OverlayDecap => format!("ovl_ingress_{interface}"),
        }
    }

    /// Where a new link goes in the interface's TCX chain, so that policy always sees real pod
    /// addresses whichever program is attached first: on ingress the LB's DNAT runs before the
    /// policy check (which must judge the backend, not the ClusterIP); on egress the policy check
    /// runs before the LB's reverse NAT (whose rewritten source, the frontend, would miss the
    /// policy conntrack entry of the backend connection). The overlay wraps everything: its
    /// decapsulation runs first on ingress (the others see the inner packet) and its
    /// encapsulation last on egress (after every rewrite). `chain` is what the interface runs
    /// already; re-adopted or updated links keep their place.
    fn order(self, chain: &[aya::programs::ProgramInfo]) -> LinkOrder {
        let find = |hook: Hook| {
            chain
                .iter()
                .find(|p| p.name_as_str().is_some_and(|n| !n.is_empty() && hook.program().starts_with(n)))
                // SAFETY: the id comes from the kernel's own list of attached programs.
                .map(|p| unsafe { aya::programs::ProgramId::new(p.id()) })
        };
        match self {
            Hook::Ingress => find(Hook::OverlayDecap).map_or_else(LinkOrder::first, LinkOrder::after_program_id),
            Hook::Egress => find(Hook::OverlayEncap).map_or_else(LinkOrder::last, LinkOrder::before_program_id),
            Hook::PolicyEgress => find(Hook::OverlayDecap).map_or_else(LinkOrder::first, LinkOrder::after_program_id),
            Hook::PolicyIngress => find(Hook::OverlayEncap).map_or_else(LinkOrder::last, LinkOrder::before_program_id),
            Hook::OverlayDecap => LinkOrder::first(),
            Hook::OverlayEncap => LinkOrder::last(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttachOutcome {
    /// The pinned link already runs this exact program over these maps: nothing was touched.
    Adopted,
    /// The pinned link ran another program; it now runs ours (atomic bpf_link_update).
    Updated,
    /// No live link: a new one was created and pinned.
    Created,
}

pub struct Datapath {
    ebpf: Ebpf,
    pin_dir: PathBuf,
}

pub fn ensure_bpffs(pin_dir: &Path) -> Result<()> {
    fs::create_dir_all(pin_dir.join("links"))
        .with_context(|| format!("creating {} (is bpffs mounted at /sys/fs/bpf?)", pin_dir.display()))?;
    Ok(())
}

impl Datapath {
    /// Loads the programs, re-using every map already pinned in `pin_dir` (after checking its
    /// layout) and creating and pinning the missing ones.
    pub fn load(pin_dir: &Path) -> Result<Self> {
        ensure_bpffs(pin_dir)?;
        let adopted = layout::check_pinned(pin_dir)?;
        let mut ebpf = EbpfLoader::new()
            .default_map_pin_directory(pin_dir)
            .load(DATAPATH_OBJECT)
            .context("loading the datapath object")?;
        for hook in Hook::ALL {
            let name = hook.program();
            let program: &mut SchedClassifier =
                ebpf.program_mut(name).ok_or_else(|| anyhow!("program {name} missing from the object"))?.try_into()?;
            program.load().with_context(|| format!("verifier rejected {name}"))?;
        }
        tracing::info!(pin_dir = %pin_dir.display(), adopted_maps = adopted, "datapath loaded");
        let mut datapath = Self { ebpf, pin_dir: pin_dir.to_path_buf() };
        datapath.record_layout_version()?;
        Ok(datapath)
    }

    fn record_layout_version(&mut self) -> Result<()> {
        let mut meta: Array<&mut MapData, u32> =
            Array::try_from(self.ebpf.map_mut(map_names::META).ok_or_else(|| anyhow!("meta map missing"))?)?;
        if meta.get(&META_LAYOUT_VERSION, 0)? != LAYOUT_VERSION {
            meta.set(META_LAYOUT_VERSION, LAYOUT_VERSION, 0)?;
        }
        Ok(())
    }

    pub fn pin_dir(&self) -> &Path {
        &self.pin_dir
    }

    pub fn link_path(pin_dir: &Path, hook: Hook, interface: &str) -> PathBuf {
        pin_dir.join("links").join(hook.pin_name(interface))
    }

    fn program_mut(&mut self, hook: Hook) -> Result<&mut SchedClassifier> {
        let name = hook.program();
        Ok(self.ebpf.program_mut(name).ok_or_else(|| anyhow!("program {name} missing"))?.try_into()?)
    }

    /// Attaches both load-balancer programs to `interface`.
    pub fn attach(&mut self, interface: &str) -> Result<[AttachOutcome; 2]> {
        Ok([self.attach_hook(Hook::Ingress, interface)?, self.attach_hook(Hook::Egress, interface)?])
    }

    /// Attaches the overlay's encapsulation (egress) and decapsulation (ingress) to `interface`,
    /// an interface towards tunnel endpoints. Links: `links/ovl_egress_<if>`, `links/ovl_ingress_<if>`.
    pub fn attach_overlay(&mut self, interface: &str) -> Result<[AttachOutcome; 2]> {
        Ok([self.attach_hook(Hook::OverlayEncap, interface)?, self.attach_hook(Hook::OverlayDecap, interface)?])
    }

    /// Attaches both NetworkPolicy programs to `interface`, the host side of a pod's veth.
    /// Links are pinned as `links/pol_ingress_<if>` and `links/pol_egress_<if>`.
    pub fn attach_policy(&mut self, interface: &str) -> Result<[AttachOutcome; 2]> {
        Ok([self.attach_hook(Hook::PolicyIngress, interface)?, self.attach_hook(Hook::PolicyEgress, interface)?])
    }

    /// Attaches the hook's program through a pinned TCX link, re-adopting the link a previous
    /// agent left if it is still attached.
    pub fn attach_hook(&mut self, hook: Hook, interface: &str) -> Result<AttachOutcome> {
        let link_path = Self::link_path(&self.pin_dir, hook, interface);
        let program = self.program_mut(hook)?;
        let ours = program.info()?;
        let mut our_maps = ours.map_ids()?.unwrap_or_default();
        our_maps.sort_unstable();

        if link_path.exists() {
            match PinnedLink::from_pin(&link_path) {
                Ok(pinned) => {
                    let link: FdLink = pinned.into();
                    let attached_id = link.info()?.program_id();
                    let (_, on_interface) = SchedClassifier::query_tcx(interface, hook.attach_type())
                        .with_context(|| format!("querying TCX programs on {interface}"))?;
                    if let Some(attached) = on_interface.iter().find(|p| p.id() == attached_id) {
                        let mut their_maps = attached.map_ids()?.unwrap_or_default();
                        their_maps.sort_unstable();
                        if attached.tag() == ours.tag() && their_maps == our_maps {
                            return Ok(AttachOutcome::Adopted);
                        }
                        let link = SchedClassifierLink::try_from(link)?;
                        program.attach_to_link(link).context("bpf_link_update")?;
                        return Ok(AttachOutcome::Updated);
                    }
                    // The interface went away (or was re-created) since: the link is defunct.
                    tracing::info!(interface, "pinned link is no longer attached; re-creating it");
                }
                Err(e) => tracing::warn!(interface, error = %e, "unreadable pinned link; re-creating it"),
            }
            fs::remove_file(&link_path).with_context(|| format!("removing stale {}", link_path.display()))?;
        }
        let (_, chain) = SchedClassifier::query_tcx(interface, hook.attach_type())
            .with_context(|| format!("querying TCX programs on {interface}"))?;
        let id = program
            .attach_with_options(interface, hook.attach_type(), TcAttachOptions::TcxOrder(hook.order(&chain)))
            .with_context(|| format!("attaching {} to {interface}", hook.program()))?;
        let link: FdLink = program.take_link(id)?.try_into()?;
        link.pin(&link_path).with_context(|| format!("pinning {}", link_path.display()))?;
        Ok(AttachOutcome::Created)
    }

    pub fn program_fd(&self, hook: Hook) -> Result<std::os::fd::RawFd> {
        use std::os::fd::{AsFd, AsRawFd};
        let name = hook.program();
        let program: &SchedClassifier =
            self.ebpf.program(name).ok_or_else(|| anyhow!("program {name} missing"))?.try_into()?;
        Ok(program.fd()?.as_fd().as_raw_fd())
    }
}

/// Removes every pinned link and map under `pin_dir` (uninstall). Detaches the programs.
pub fn remove_all(pin_dir: &Path) -> Result<usize> {
    let mut removed = 0;
    if !pin_dir.exists() {
        return Ok(0);
    }
    let links = pin_dir.join("links");
    for dir in [links.as_path(), pin_dir] {
        let Ok(entries) = fs::read_dir(dir) else { continue };
        for entry in entries.flatten() {
            if entry.file_type().map(|t| t.is_file()).unwrap_or(false) {
                fs::remove_file(entry.path())?;
                removed += 1;
            }
        }
    }
    let _ = fs::remove_dir(&links);
    let _ = fs::remove_dir(pin_dir);
    Ok(removed)
}
