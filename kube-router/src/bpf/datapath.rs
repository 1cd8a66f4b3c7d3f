//! Loading the datapath over the pinned maps and attaching it through pinned TCX links.
use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
};

use anyhow::{anyhow, bail, Context, Result};
use aya::{
    maps::{Array, MapData},
    programs::{
        links::{FdLink, LinkOrder, PinnedLink},
        tc::{SchedClassifierLink, TcAttachOptions},
        Program, ProgramError, ProgramInfo, SchedClassifier, TcAttachType,
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
}

impl Hook {
    /// Every program of the object (all are loaded).
    pub const ALL: [Hook; 4] = [Hook::Ingress, Hook::Egress, Hook::PolicyIngress, Hook::PolicyEgress];
    pub const LOAD_BALANCER: [Hook; 2] = [Hook::Ingress, Hook::Egress];
    pub const POLICY: [Hook; 2] = [Hook::PolicyIngress, Hook::PolicyEgress];

    pub fn program(self) -> &'static str {
        match self {
            Hook::Ingress => "kr_lb_ingress",
            Hook::Egress => "kr_lb_egress",
            Hook::PolicyIngress => "kr_pol_ingress",
            Hook::PolicyEgress => "kr_pol_egress",
        }
    }

    fn attach_type(self) -> TcAttachType {
        match self {
            Hook::Ingress | Hook::PolicyIngress => TcAttachType::Ingress,
            Hook::Egress | Hook::PolicyEgress => TcAttachType::Egress,
        }
    }

    fn pin_name(self, interface: &str) -> String {
        match self {
            Hook::Ingress => format!("tc_ingress_{interface}"),
            Hook::Egress => format!("tc_egress_{interface}"),
            Hook::PolicyIngress => format!("pol_ingress_{interface}"),
            Hook::PolicyEgress => format!("pol_egress_{interface}"),
        }
    }

    /// Where a new link goes in the interface's TCX chain, so that policy always sees real pod
    /// addresses whichever program is attached first: on ingress the LB's DNAT runs before the
    /// policy check (which must judge the backend, not the ClusterIP); on egress the policy check
    /// runs before the LB's reverse NAT (whose rewritten source, the frontend, would miss the
    /// policy conntrack entry of the backend connection). Re-adopted or updated links keep
    /// their place.
    fn order(self) -> LinkOrder {
        match self {
            Hook::Ingress | Hook::PolicyEgress => LinkOrder::first(),
            Hook::Egress | Hook::PolicyIngress => LinkOrder::last(),
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
    unavailable: BTreeMap<String, String>,
}

/// Loads one program of the object; each program type the object may hold has its arm here.
fn load_program(program: &mut Program) -> Result<(), ProgramError> {
    match program {
        Program::SchedClassifier(p) => p.load(),
        Program::CgroupSockAddr(p) => p.load(),
        // A new program type gets its arm above (and, if optional, in is_optional).
        _ => Err(ProgramError::UnexpectedProgramType),
    }
}

/// Programs the agent can run without: the socket load balancer needs kernel features newer than
/// the TC datapath's (see docs/maps.md), and the TC load balancer works without it.
fn is_optional(program: &Program) -> bool {
    matches!(program, Program::CgroupSockAddr(_))
}

pub fn ensure_bpffs(pin_dir: &Path) -> Result<()> {
    fs::create_dir_all(pin_dir.join("links"))
        .with_context(|| format!("creating {} (is bpffs mounted at /sys/fs/bpf?)", pin_dir.display()))?;
    Ok(())
}

impl Datapath {
    /// Loads every program of the object, re-using every map already pinned in `pin_dir` (after
    /// checking its layout) and creating and pinning the missing ones. A TC program the kernel
    /// refuses is an error; a program of an optional feature (see [`is_optional`]) is left out
    /// with a warning and reported by [`Datapath::unavailable`], so that feature alone is off.
    pub fn load(pin_dir: &Path) -> Result<Self> {
        ensure_bpffs(pin_dir)?;
        let adopted = layout::check_pinned(pin_dir)?;
        let mut ebpf = EbpfLoader::new()
            .default_map_pin_directory(pin_dir)
            .load(DATAPATH_OBJECT)
            .context("loading the datapath object")?;
        let mut unavailable = BTreeMap::new();
        for (name, program) in ebpf.programs_mut() {
            if let Err(e) = load_program(program) {
                let error = anyhow::Error::from(e).context(format!("verifier rejected {name}"));
                if !is_optional(program) {
                    return Err(error);
                }
                tracing::warn!(program = name, error = format!("{error:#}"), "program not loaded; its feature is off");
                unavailable.insert(name.to_string(), format!("{error:#}"));
            }
        }
        tracing::info!(pin_dir = %pin_dir.display(), adopted_maps = adopted, "datapath loaded");
        let mut datapath = Self { ebpf, pin_dir: pin_dir.to_path_buf(), unavailable };
        datapath.record_layout_version()?;
        Ok(datapath)
    }

    /// Programs that failed to load (name -> verifier error), all of optional features.
    pub fn unavailable(&self) -> &BTreeMap<String, String> {
        &self.unavailable
    }

    /// A loaded program of type `P` (`SchedClassifier`, `CgroupSockAddr`, ...).
    pub fn program_mut<P>(&mut self, name: &str) -> Result<&mut P>
    where
        for<'a> &'a mut P: TryFrom<&'a mut Program, Error = ProgramError>,
    {
        if let Some(error) = self.unavailable.get(name) {
            bail!("program {name} is not loaded: {error}");
        }
        Ok(self.ebpf.program_mut(name).ok_or_else(|| anyhow!("program {name} missing from the object"))?.try_into()?)
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

    fn classifier_mut(&mut self, hook: Hook) -> Result<&mut SchedClassifier> {
        self.program_mut(hook.program())
    }

    /// Attaches both load-balancer programs to `interface`.
    pub fn attach(&mut self, interface: &str) -> Result<[AttachOutcome; 2]> {
        Ok([self.attach_hook(Hook::Ingress, interface)?, self.attach_hook(Hook::Egress, interface)?])
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
        let program = self.classifier_mut(hook)?;
        let ours = program.info()?;

        if link_path.exists() {
            match PinnedLink::from_pin(&link_path) {
                Ok(pinned) => {
                    let link: FdLink = pinned.into();
                    let attached_id = link.info()?.program_id();
                    let (_, on_interface) = SchedClassifier::query_tcx(interface, hook.attach_type())
                        .with_context(|| format!("querying TCX programs on {interface}"))?;
                    if let Some(attached) = on_interface.iter().find(|p| p.id() == attached_id) {
                        if same_program(attached, &ours)? {
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
        let id = program
            .attach_with_options(interface, hook.attach_type(), TcAttachOptions::TcxOrder(hook.order()))
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

/// Whether an attached program is exactly `ours`: the same instructions (tag) over the same maps.
pub(crate) fn same_program(attached: &ProgramInfo, ours: &ProgramInfo) -> Result<bool> {
    let sorted_maps = |info: &ProgramInfo| -> Result<Vec<u32>> {
        let mut ids = info.map_ids()?.unwrap_or_default();
        ids.sort_unstable();
        Ok(ids)
    };
    Ok(attached.tag() == ours.tag() && sorted_maps(attached)? == sorted_maps(ours)?)
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
