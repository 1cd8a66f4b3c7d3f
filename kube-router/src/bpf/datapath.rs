//! Loading the datapath over the pinned maps and attaching it: through pinned TCX links (Linux
//! 6.6 and later), or, on older kernels or when asked, as classic `cls_bpf` filters on a
//! `clsact` qdisc at priorities of our own (other filters are never touched).
use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
};

use anyhow::{anyhow, bail, Context, Result};
use aya::{
    maps::{Array, MapData},
    programs::{
        links::{FdLink, Link, LinkOrder, PinnedLink},
        tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions, TcError, TcHandle},
        Program, ProgramError, ProgramInfo, SchedClassifier, TcAttachType,
    },
    Ebpf, EbpfLoader,
};
use kube_router_common::{map_names, LAYOUT_VERSION, META_LAYOUT_VERSION};

use super::{layout, migrate, DATAPATH_OBJECT};
use crate::pinned::maps_dir;

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

/// How programs are attached to interfaces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttachMode {
    /// TCX, through pinned bpf_links (Linux 6.6 and later).
    Tcx,
    /// Classic tc: `cls_bpf` filters in direct-action mode on a `clsact` qdisc (any kernel this
    /// agent supports); the attached program is pinned where the link would be.
    Classic,
}

impl AttachMode {
    /// TCX where the kernel has it, classic tc elsewhere.
    pub fn detect() -> Self {
        let tcx =
            aya::util::KernelVersion::current().map(|v| v >= aya::util::KernelVersion::new(6, 6, 0)).unwrap_or(false);
        if tcx {
            AttachMode::Tcx
        } else {
            AttachMode::Classic
        }
    }
}

/// The `cls_bpf` handle of all our classic filters; the priority tells the hooks apart.
const CLASSIC_HANDLE: u32 = 0x4b52;

impl Hook {
    /// A classic filter's priority. Lower runs first: as with TCX's order, the load balancer's
    /// DNAT before the policy check on ingress, the policy check before its reverse NAT on egress.
    fn classic_priority(self) -> u16 {
        match self {
            // The overlay wraps the rest, as in TCX: decapsulation first, encapsulation last.
            Hook::OverlayDecap => 0x4aff,
            Hook::Ingress | Hook::PolicyEgress => 0x4b00,
            Hook::Egress | Hook::PolicyIngress => 0x4b01,
            Hook::OverlayEncap => 0x4b02,
        }
    }

    /// The hook and interface a pin file in `links/` stands for.
    pub fn from_pin_name(name: &str) -> Option<(Hook, &str)> {
        [
            ("tc_ingress_", Hook::Ingress),
            ("tc_egress_", Hook::Egress),
            ("pol_ingress_", Hook::PolicyIngress),
            ("pol_egress_", Hook::PolicyEgress),
            ("ovl_egress_", Hook::OverlayEncap),
            ("ovl_ingress_", Hook::OverlayDecap),
        ]
        .into_iter()
        .find_map(|(prefix, hook)| Some((hook, name.strip_prefix(prefix)?)))
    }

    /// Our classic filter of this hook on `interface`, as an aya link (detaching removes it).
    fn classic_link(self, interface: &str) -> std::io::Result<SchedClassifierLink> {
        SchedClassifierLink::attached(
            interface,
            self.attach_type(),
            self.classic_priority(),
            TcHandle::from(CLASSIC_HANDLE),
            None,
        )
    }
}

fn is_eexist(error: &ProgramError) -> bool {
    matches!(error, ProgramError::TcError(TcError::NetlinkError(e)) if e.raw_os_error() == Some(libc::EEXIST))
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
    /// Ids of the maps pinned in `pin_dir`: what makes an attached program "ours". Per-CPU
    /// scratch maps are not pinned; a re-attached instance may use other ones.
    pinned_map_ids: std::collections::BTreeSet<u32>,
    /// An upgrade from the previous map layout, finished once the links run our programs.
    upgrade: Option<migrate::Upgrade>,
    /// How pod veths are attached (the agent's `--tc-mode auto`: classic tc).
    pod_mode: AttachMode,
    /// Maps being re-created at a new size, finished with the upgrade.
    resize: Option<migrate::Resize>,
    mode: AttachMode,
    /// Programs of optional features the kernel refused (name -> error).
    unavailable: BTreeMap<String, String>,
}

/// A datapath whose maps are open and whose programs are yet to be verified
/// ([`Datapath::open_maps`]). [`Loading::verify`] changes nothing pinned (it may run on another
/// thread while the agent lists the cluster); [`Loading::finish`] records the layout and starts
/// an upgrade from the previous one.
pub struct Loading {
    ebpf: Ebpf,
    pin_dir: PathBuf,
    adopted: usize,
    resize: Option<migrate::Resize>,
    mode: AttachMode,
    unavailable: BTreeMap<String, String>,
}

impl Loading {
    /// Loads every program of the object: the kernel verifies each. A TC program the kernel
    /// refuses is an error; a program of an optional feature (see [`is_optional`]) is left out
    /// with a warning and reported by [`Datapath::unavailable`], so that feature alone is off.
    pub fn verify(&mut self) -> Result<()> {
        self.verify_only(|_| true)
    }

    /// [`Self::verify`] for the programs `needed` names: the verifier's time is most of a load's,
    /// and each loaded datapath attaches only its own hooks (the agent's never the overlay's,
    /// whose own load attaches nothing else). The others stay unloaded, reported as such by
    /// [`Datapath::program_mut`].
    pub fn verify_only(&mut self, needed: impl Fn(&str) -> bool) -> Result<()> {
        let started = std::time::Instant::now();
        let mut verified = 0;
        for (name, program) in self.ebpf.programs_mut() {
            if !needed(name) {
                self.unavailable.insert(name.to_string(), "not loaded by this datapath (not attached by it)".into());
                continue;
            }
            verified += 1;
            let one = std::time::Instant::now();
            let loaded = load_program(program);
            tracing::debug!(program = name, micros = one.elapsed().as_micros() as u64, "program verified");
            if let Err(e) = loaded {
                let error = anyhow::Error::from(e).context(format!("verifier rejected {name}"));
                if !is_optional(program) {
                    return Err(error);
                }
                tracing::warn!(program = name, error = format!("{error:#}"), "program not loaded; its feature is off");
                self.unavailable.insert(name.to_string(), format!("{error:#}"));
            }
        }
        tracing::info!(
            programs = verified,
            millis = started.elapsed().as_millis() as u64,
            "datapath programs verified"
        );
        Ok(())
    }

    /// The loaded datapath: the layout version recorded, an upgrade from the previous layout
    /// started if its maps are pinned (finished by [`Datapath::finish_upgrade`]).
    pub fn finish(self) -> Result<Datapath> {
        let Loading { ebpf, pin_dir, adopted, resize, mode, unavailable } = self;
        tracing::info!(pin_dir = %pin_dir.display(), adopted_maps = adopted, "datapath loaded");
        let pinned_map_ids = pinned_map_ids(&maps_dir(&pin_dir));
        let mut datapath =
            Datapath { ebpf, pin_dir, pinned_map_ids, upgrade: None, pod_mode: mode, resize, mode, unavailable };
        datapath.record_layout_version()?;
        datapath.upgrade = migrate::start(&datapath.pin_dir)?;
        Ok(datapath)
    }
}

/// Ids of the maps pinned directly in `pin_dir`.
fn pinned_map_ids(pin_dir: &Path) -> std::collections::BTreeSet<u32> {
    let Ok(entries) = fs::read_dir(pin_dir) else { return Default::default() };
    entries
        .flatten()
        .filter(|e| e.file_type().map(|t| t.is_file()).unwrap_or(false))
        .filter_map(|e| aya::maps::MapInfo::from_pin(e.path()).ok())
        .map(|info| info.id())
        .collect()
}

/// Loads one program of the object; each program type the object may hold has its arm here.
fn load_program(program: &mut Program) -> Result<(), ProgramError> {
    match program {
        Program::SchedClassifier(p) => p.load(),
        Program::CgroupSockAddr(p) => p.load(),
        Program::Xdp(p) => p.load(),
        // A new program type gets its arm above (and, if optional, in is_optional).
        _ => Err(ProgramError::UnexpectedProgramType),
    }
}

/// Programs the agent can run without: the socket load balancer needs kernel features newer than
/// the TC datapath's (see docs/maps.md), and the TC load balancer works without it; so does it
/// without the XDP fast path in front of it.
fn is_optional(program: &Program) -> bool {
    matches!(program, Program::CgroupSockAddr(_) | Program::Xdp(_))
}

pub fn ensure_bpffs(pin_dir: &Path) -> Result<()> {
    for dir in [pin_dir.join("links"), maps_dir(pin_dir)] {
        fs::create_dir_all(&dir)
            .with_context(|| format!("creating {} (is bpffs mounted at /sys/fs/bpf?)", dir.display()))?;
    }
    Ok(())
}

impl Datapath {
    /// Loads the programs, re-using every map already pinned in `pin_dir` (after checking its
    /// layout) and creating and pinning the missing ones.
    /// Maps of the previous layout are upgraded: their state is copied now, and the old maps go
    /// once the links run the new programs ([`Self::finish_upgrade`]). Maps of a newer layout
    /// make it refuse (a downgrade), leaving the running programs alone.
    ///
    /// Every program of the object is loaded. A TC program the kernel
    /// refuses is an error; a program of an optional feature (see [`is_optional`]) is left out
    /// with a warning and reported by [`Datapath::unavailable`], so that feature alone is off.
    pub fn load(pin_dir: &Path) -> Result<Self> {
        Self::load_with_mode(pin_dir, AttachMode::detect())
    }

    /// [`Self::load`], attaching in `mode`.
    pub fn load_with_mode(pin_dir: &Path, mode: AttachMode) -> Result<Self> {
        Self::load_sized(pin_dir, mode, None)
    }

    /// [`Self::load_with_mode`], with the sized maps at `sizes`: pinned maps of another size are
    /// re-created at it with their entries carried over, completed by [`Self::finish_upgrade`].
    /// Without `sizes`, pinned maps are adopted at whatever size they have.
    pub fn load_sized(pin_dir: &Path, mode: AttachMode, sizes: Option<layout::MapSizes>) -> Result<Self> {
        let mut loading = Self::open_maps(pin_dir, mode, sizes)?;
        loading.verify()?;
        loading.finish()
    }

    /// The overlay's own datapath: the maps shared with the agent's, and only the two programs it
    /// attaches verified (not the whole object a second time, the first time a tunnel is needed).
    pub fn load_overlay(pin_dir: &Path) -> Result<Self> {
        let mut loading = Self::open_maps(pin_dir, AttachMode::detect(), None)?;
        loading.verify_only(|name| Hook::OVERLAY.iter().any(|hook| hook.program() == name))?;
        loading.finish()
    }

    /// The first part of [`Self::load_sized`]: the pinned maps checked, adopted, created or set
    /// aside for a resize (entries carried over), the programs not loaded yet.
    pub fn open_maps(pin_dir: &Path, mode: AttachMode, sizes: Option<layout::MapSizes>) -> Result<Loading> {
        migrate::refuse_downgrade(pin_dir)?;
        ensure_bpffs(pin_dir)?;
        let pinned = layout::check_pinned(pin_dir, sizes.as_ref())?;
        let adopted = pinned.adopted;
        let mut resize = migrate::start_resize(pin_dir, &pinned.resize)?;
        let mut loader = EbpfLoader::new();
        loader.default_map_pin_directory(maps_dir(pin_dir));
        for (name, max_entries) in sizes.unwrap_or_default().all() {
            loader.map_max_entries(name, max_entries);
        }
        let ebpf = loader.load(DATAPATH_OBJECT).context("loading the datapath object")?;
        if let Some(resize) = resize.as_mut() {
            resize.copy().context("carrying entries over into the resized maps")?;
        }
        Ok(Loading { ebpf, pin_dir: pin_dir.to_path_buf(), adopted, resize, mode, unavailable: BTreeMap::new() })
    }
    /// Completes an upgrade from the previous layout, once every link has been re-attached to
    /// our programs: copies what the old programs wrote meanwhile and removes the old maps.
    pub fn finish_upgrade(&mut self) -> Result<()> {
        if let Some(upgrade) = self.upgrade.take() {
            upgrade.finish()?;
        }
        if let Some(resize) = self.resize.take() {
            resize.finish()?;
        }
        Ok(())
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

    pub fn mode(&self) -> AttachMode {
        self.mode
    }

    /// Takes the hook's program off `interface` if we attached it there (its pin says so):
    /// removing a TCX link's last reference detaches it; a classic filter is deleted.
    pub fn detach_hook(&mut self, hook: Hook, interface: &str) -> Result<bool> {
        let path = Self::link_path(&self.pin_dir, hook, interface);
        if !path.exists() {
            return Ok(false);
        }
        if pinned_kind(&path) == Some(PinnedKind::Program) {
            if let Ok(link) = hook.classic_link(interface) {
                let _ = link.detach();
            }
        }
        super::unpin_link(&path).with_context(|| format!("removing {}", path.display()))?;
        Ok(true)
    }

    /// Ids of the maps pinned for this datapath (see [`same_program`]).
    pub(crate) fn pinned_map_ids(&self) -> std::collections::BTreeSet<u32> {
        self.pinned_map_ids.clone()
    }

    /// Attaches the hook's program to `interface` (TCX or classic, see [`AttachMode`]),
    /// re-adopting what a previous agent left if it is still attached and the same.
    pub fn attach_hook(&mut self, hook: Hook, interface: &str) -> Result<AttachOutcome> {
        self.attach_hook_in(self.mode, hook, interface)
    }

    /// [`Self::attach_hook`] in `mode`. Switching an interface between modes attaches the new
    /// way before removing the old, so its packets are never without the program.
    pub fn attach_hook_in(&mut self, mode: AttachMode, hook: Hook, interface: &str) -> Result<AttachOutcome> {
        match mode {
            AttachMode::Tcx => {
                let outcome = self.attach_tcx(hook, interface)?;
                // A classic filter of ours from an earlier run in classic mode would run twice.
                if let Ok(link) = hook.classic_link(interface) {
                    let _ = link.detach();
                }
                Ok(outcome)
            }
            AttachMode::Classic => self.attach_classic(hook, interface),
        }
    }

    /// How pod veths are attached (see [`Self::set_pod_mode`]).
    pub fn pod_mode(&self) -> AttachMode {
        self.pod_mode
    }

    /// Pod veths attached in `mode` by [`Self::attach_pod`] and [`Self::attach_policy_pod`]:
    /// classic tc by default, because each TCX attachment waits for an RCU grace period in the
    /// kernel (12-16 ms here, four per pod) while a new pod runs without its programs.
    pub fn set_pod_mode(&mut self, mode: AttachMode) {
        self.pod_mode = mode;
    }

    /// Both load-balancer programs on a pod's veth, in the pod mode.
    pub fn attach_pod(&mut self, interface: &str) -> Result<[AttachOutcome; 2]> {
        let mode = self.pod_mode;
        Ok([self.attach_hook_in(mode, Hook::Ingress, interface)?, self.attach_hook_in(mode, Hook::Egress, interface)?])
    }

    /// Both NetworkPolicy programs on a pod's veth, in the pod mode.
    pub fn attach_policy_pod(&mut self, interface: &str) -> Result<[AttachOutcome; 2]> {
        let mode = self.pod_mode;
        Ok([
            self.attach_hook_in(mode, Hook::PolicyIngress, interface)?,
            self.attach_hook_in(mode, Hook::PolicyEgress, interface)?,
        ])
    }

    /// Our program ids and pinned map ids, to compare with what is attached.
    fn identity(&mut self, hook: Hook) -> Result<(ProgramInfo, Vec<u32>)> {
        let pinned_ids = self.pinned_map_ids.clone();
        let ours = self.classifier_mut(hook)?.info()?;
        let mut maps = ours.map_ids()?.unwrap_or_default();
        maps.retain(|id| pinned_ids.contains(id));
        maps.sort_unstable();
        Ok((ours, maps))
    }

    fn same_program(&self, attached: &ProgramInfo, ours: &(ProgramInfo, Vec<u32>)) -> Result<bool> {
        let mut maps = attached.map_ids()?.unwrap_or_default();
        maps.retain(|id| self.pinned_map_ids.contains(id));
        maps.sort_unstable();
        Ok(attached.tag() == ours.0.tag() && maps == ours.1)
    }

    /// A classic `cls_bpf` filter at our priority and handle; the program is pinned at the
    /// link path, so a restart can tell whether the filter still runs the same program.
    fn attach_classic(&mut self, hook: Hook, interface: &str) -> Result<AttachOutcome> {
        let pin_path = Self::link_path(&self.pin_dir, hook, interface);
        // A TCX link of ours from an earlier run in TCX mode stays until the filter is in place
        // (its pin is replaced by the program's below, which detaches it).
        match tc::qdisc_add_clsact(interface) {
            Err(TcError::NetlinkError(e)) if e.raw_os_error() == Some(libc::EEXIST) => {}
            other => other.with_context(|| format!("adding the clsact qdisc to {interface}"))?,
        }
        let ours = self.identity(hook)?;
        let options = || {
            TcAttachOptions::Netlink(NlOptions {
                priority: hook.classic_priority(),
                handle: TcHandle::from(CLASSIC_HANDLE),
                classid: None,
            })
        };
        let program = self.classifier_mut(hook)?;
        let outcome = match program.attach_with_options(interface, hook.attach_type(), options()) {
            Ok(id) => {
                // The filter outlives the agent: drop the handle without detaching.
                std::mem::forget(program.take_link(id)?);
                AttachOutcome::Created
            }
            Err(e) if is_eexist(&e) => {
                let pinned = ProgramInfo::from_pin(&pin_path).ok();
                if pinned.is_some_and(|p| self.same_program(&p, &ours).unwrap_or(false)) {
                    return Ok(AttachOutcome::Adopted);
                }
                // Replaced in place (same priority and handle): atomic for the packets.
                let program = self.classifier_mut(hook)?;
                let id = program.attach_to_link(hook.classic_link(interface)?).context("replacing the filter")?;
                std::mem::forget(program.take_link(id)?);
                AttachOutcome::Updated
            }
            Err(e) => return Err(e).with_context(|| format!("attaching {} to {interface}", hook.program())),
        };
        if pin_path.exists() {
            fs::remove_file(&pin_path).with_context(|| format!("removing stale {}", pin_path.display()))?;
        }
        self.classifier_mut(hook)?.pin(&pin_path).with_context(|| format!("pinning {}", pin_path.display()))?;
        Ok(outcome)
    }

    /// Attaches the hook's program through a pinned TCX link, re-adopting the link a previous
    /// agent left if it is still attached.
    fn attach_tcx(&mut self, hook: Hook, interface: &str) -> Result<AttachOutcome> {
        let link_path = Self::link_path(&self.pin_dir, hook, interface);
        let pinned_ids = self.pinned_map_ids.clone();
        let program = self.classifier_mut(hook)?;
        let ours = program.info()?;
        let mut our_maps = ours.map_ids()?.unwrap_or_default();
        our_maps.retain(|id| pinned_ids.contains(id));
        our_maps.sort_unstable();

        // A classic-mode run pinned the program there (its filter was detached above).
        if pinned_kind(&link_path) == Some(PinnedKind::Program) {
            fs::remove_file(&link_path).with_context(|| format!("removing {}", link_path.display()))?;
        }
        if link_path.exists() {
            match PinnedLink::from_pin(&link_path) {
                Ok(pinned) => {
                    let link: FdLink = pinned.into();
                    let attached_id = link.info()?.program_id();
                    let (_, on_interface) = SchedClassifier::query_tcx(interface, hook.attach_type())
                        .with_context(|| format!("querying TCX programs on {interface}"))?;
                    if let Some(attached) = on_interface.iter().find(|p| p.id() == attached_id) {
                        let mut their_maps = attached.map_ids()?.unwrap_or_default();
                        their_maps.retain(|id| pinned_ids.contains(id));
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

/// What a pin under `links/` holds: a TCX link, or (classic tc) the program itself. aya opens
/// either kind with either type, so ask the kernel (the fd's `/proc` info names its kind).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PinnedKind {
    Link,
    Program,
}

fn pinned_kind(path: &Path) -> Option<PinnedKind> {
    use std::os::{fd::FromRawFd, unix::ffi::OsStrExt};
    const BPF_OBJ_GET: libc::c_long = 7;
    #[repr(C)]
    struct ObjGet {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
    }
    let path = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let attr = ObjGet { pathname: path.as_ptr() as u64, bpf_fd: 0, file_flags: 0 };
    // SAFETY: attr is a valid BPF_OBJ_GET attribute whose path outlives the call.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_OBJ_GET, &attr, std::mem::size_of::<ObjGet>() as u32) };
    if fd < 0 {
        return None;
    }
    // SAFETY: the syscall returned a new fd that nothing else owns.
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) };
    let info = fs::read_to_string(format!("/proc/self/fdinfo/{}", std::os::fd::AsRawFd::as_raw_fd(&fd))).ok()?;
    if info.lines().any(|l| l.starts_with("link_type:")) {
        Some(PinnedKind::Link)
    } else if info.lines().any(|l| l.starts_with("prog_type:")) {
        Some(PinnedKind::Program)
    } else {
        None
    }
}

/// Whether an attached program is exactly `ours`: the same instructions (tag) over the same
/// pinned maps (per-CPU scratch maps are not pinned and differ between loads).
pub(crate) fn same_program(
    attached: &ProgramInfo,
    ours: &ProgramInfo,
    pinned: &std::collections::BTreeSet<u32>,
) -> Result<bool> {
    let sorted_maps = |info: &ProgramInfo| -> Result<Vec<u32>> {
        let mut ids = info.map_ids()?.unwrap_or_default();
        ids.retain(|id| pinned.contains(id));
        ids.sort_unstable();
        Ok(ids)
    };
    Ok(attached.tag() == ours.tag() && sorted_maps(attached)? == sorted_maps(ours)?)
}

/// Removes every pinned link and map under `pin_dir`, of every layout (uninstall). Detaches
/// the programs.
pub fn remove_all(pin_dir: &Path) -> Result<usize> {
    let mut removed = 0;
    if !pin_dir.exists() {
        return Ok(0);
    }
    // links/, every layout's v<N>/, and the root (layout 1's maps, the downgrade tombstone).
    let mut dirs: Vec<PathBuf> = fs::read_dir(pin_dir)?
        .flatten()
        .filter(|e| e.file_type().map(|t| t.is_dir()).unwrap_or(false))
        .map(|e| e.path())
        .collect();
    dirs.push(pin_dir.to_path_buf());
    // Classic filters are not held by their pins: detach them first.
    for entry in fs::read_dir(pin_dir.join("links")).into_iter().flatten().flatten() {
        let name = entry.file_name();
        let is_program = pinned_kind(&entry.path()) == Some(PinnedKind::Program);
        if let (true, Some((hook, interface))) = (is_program, name.to_str().and_then(Hook::from_pin_name)) {
            if let Ok(link) = hook.classic_link(interface) {
                let _ = link.detach();
            }
        }
    }
    let links = pin_dir.join("links");
    for dir in &dirs {
        let Ok(entries) = fs::read_dir(dir) else { continue };
        for entry in entries.flatten() {
            if entry.file_type().map(|t| t.is_file()).unwrap_or(false) {
                // Only links need detaching before the pin goes; maps just go.
                if *dir == links {
                    super::unpin_link(&entry.path())?;
                } else {
                    fs::remove_file(entry.path())?;
                }
                removed += 1;
            }
        }
        let _ = fs::remove_dir(dir);
    }
    Ok(removed)
}

/// One attachment of ours, as `kube-router interfaces` shows it (bpftool 7.1 cannot list TCX).
#[derive(Debug)]
pub struct Attachment {
    pub interface: String,
    pub hook: Hook,
    pub mode: AttachMode,
    /// The attached program's id, and whether it is (still) attached to the interface.
    pub program_id: Option<u32>,
    pub attached: bool,
}

/// Removes the TC pins of interfaces that no longer exist (`present` lists those that do): a
/// deleted interface took its TCX links and classic filters with it, and its pins would only
/// be replaced if an interface of the same name came back. Returns how many went.
pub fn prune_vanished(pin_dir: &Path, present: &std::collections::BTreeSet<String>) -> usize {
    let mut removed = 0;
    for entry in fs::read_dir(pin_dir.join("links")).into_iter().flatten().flatten() {
        let name = entry.file_name();
        let interface =
            name.to_str().and_then(|n| Hook::from_pin_name(n).map(|(_, i)| i).or(super::xdp::interface_of_pin(n)));
        let Some(interface) = interface else { continue };
        if !present.contains(interface) && fs::remove_file(entry.path()).is_ok() {
            tracing::info!(interface, pin = %entry.path().display(), "interface gone; its pin removed");
            removed += 1;
        }
    }
    removed
}

/// Every attachment pinned under `pin_dir/links`, checked against the interfaces.
pub fn attachments(pin_dir: &Path) -> Result<Vec<Attachment>> {
    let mut out = Vec::new();
    for entry in fs::read_dir(pin_dir.join("links")).with_context(|| format!("reading {}", pin_dir.display()))? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some((hook, interface)) = Hook::from_pin_name(&name) else { continue };
        let link = (pinned_kind(&entry.path()) == Some(PinnedKind::Link)).then(|| PinnedLink::from_pin(entry.path()));
        let attachment = if let Some(Ok(pinned)) = link {
            let link: FdLink = pinned.into();
            let program_id = link.info().ok().map(|i| i.program_id());
            let attached = SchedClassifier::query_tcx(interface, hook.attach_type())
                .map(|(_, programs)| programs.iter().any(|p| Some(p.id()) == program_id))
                .unwrap_or(false);
            Attachment { interface: interface.to_string(), hook, mode: AttachMode::Tcx, program_id, attached }
        } else {
            // Classic filters are not held by their pin; the pinned program is what we attached.
            let program_id = ProgramInfo::from_pin(entry.path()).ok().map(|p| p.id());
            let attached = crate::node::netif::interface_index(interface).is_some();
            Attachment { interface: interface.to_string(), hook, mode: AttachMode::Classic, program_id, attached }
        };
        out.push(attachment);
    }
    out.sort_by(|a, b| (&a.interface, a.hook.program()).cmp(&(&b.interface, b.hook.program())));
    Ok(out)
}
