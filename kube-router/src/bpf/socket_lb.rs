//! The socket load balancer's edge: attaching `kr_sk_*` to a cgroup v2 directory through pinned
//! bpf_links, re-adopting them on restart, and its configuration and counters.
//!
//! cgroup bpf_links always attach in multi mode: other programs on the same cgroup (another
//! CNI's, a security agent's) keep running, and we only ever replace or remove our own links,
//! found by their pin under `links/`.
use std::{
    fs, io,
    os::{
        fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd},
        unix::fs::MetadataExt,
    },
    path::{Component, Path, PathBuf},
};

use anyhow::{anyhow, bail, Context, Result};
use aya::{
    maps::{Array, Map, MapData, PerCpuHashMap, PerCpuValues},
    programs::{links::FdLink, loaded_programs, CgroupAttachMode, CgroupSockAddr},
};
use kube_router_common::{sock_map_names, sock_stat, SockLbConfig, SOCK_CONFIG_INDEX};

use super::datapath::{same_program, AttachOutcome, Datapath};
use crate::{
    exposition::{register, Counter, Family},
    metrics::{Labels, Metrics, Subsystem},
};

/// The socket load balancer's attach failures, and starts at which the agent's own cgroup
/// could not be exempted from it, by reason (`NotExempt`). Its per-call counters are read
/// with the datapath's (`controllers/datapath_stats.rs`).
#[derive(Debug, Default)]
pub struct SocketLbMetrics {
    pub errors: Counter,
    pub agent_not_exempt: Family<Labels<1>, Counter>,
}

impl Subsystem for SocketLbMetrics {
    fn register(this: &std::sync::Arc<Self>, registry: &mut prometheus_client::registry::Registry) {
        register(
            registry,
            "kube_router_socket_lb_errors_total",
            "Failures to attach the socket load balancer (cgroup programs).",
            this.errors.clone(),
        );
        register(
            registry,
            "kube_router_socket_lb_agent_not_exempt_total",
            "Starts at which the agent's own cgroup could not be exempted from the socket load balancer, by reason.",
            this.agent_not_exempt.clone(),
        );
    }
}

/// One cgroup sock_addr hook and the program that runs there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SockHook {
    Connect4,
    Sendmsg4,
    Recvmsg4,
    Getpeername4,
    Connect6,
    Sendmsg6,
    Recvmsg6,
    Getpeername6,
}

impl SockHook {
    pub const ALL: [SockHook; 8] = [
        SockHook::Connect4,
        SockHook::Sendmsg4,
        SockHook::Recvmsg4,
        SockHook::Getpeername4,
        SockHook::Connect6,
        SockHook::Sendmsg6,
        SockHook::Recvmsg6,
        SockHook::Getpeername6,
    ];

    pub fn program(self) -> &'static str {
        match self {
            SockHook::Connect4 => "kr_sk_connect4",
            SockHook::Sendmsg4 => "kr_sk_sendmsg4",
            SockHook::Recvmsg4 => "kr_sk_recvmsg4",
            SockHook::Getpeername4 => "kr_sk_getpeer4",
            SockHook::Connect6 => "kr_sk_connect6",
            SockHook::Sendmsg6 => "kr_sk_sendmsg6",
            SockHook::Recvmsg6 => "kr_sk_recvmsg6",
            SockHook::Getpeername6 => "kr_sk_getpeer6",
        }
    }

    fn pin_name(self) -> &'static str {
        match self {
            SockHook::Connect4 => "cgroup_connect4",
            SockHook::Sendmsg4 => "cgroup_sendmsg4",
            SockHook::Recvmsg4 => "cgroup_recvmsg4",
            SockHook::Getpeername4 => "cgroup_getpeername4",
            SockHook::Connect6 => "cgroup_connect6",
            SockHook::Sendmsg6 => "cgroup_sendmsg6",
            SockHook::Recvmsg6 => "cgroup_recvmsg6",
            SockHook::Getpeername6 => "cgroup_getpeername6",
        }
    }

    /// The kernel's `enum bpf_attach_type` value, as a cgroup link reports it.
    fn kernel_attach_type(self) -> u32 {
        match self {
            SockHook::Connect4 => 10,     // BPF_CGROUP_INET4_CONNECT
            SockHook::Sendmsg4 => 14,     // BPF_CGROUP_UDP4_SENDMSG
            SockHook::Recvmsg4 => 19,     // BPF_CGROUP_UDP4_RECVMSG
            SockHook::Getpeername4 => 29, // BPF_CGROUP_INET4_GETPEERNAME
            SockHook::Connect6 => 11,     // BPF_CGROUP_INET6_CONNECT
            SockHook::Sendmsg6 => 15,     // BPF_CGROUP_UDP6_SENDMSG
            SockHook::Recvmsg6 => 20,     // BPF_CGROUP_UDP6_RECVMSG
            SockHook::Getpeername6 => 30, // BPF_CGROUP_INET6_GETPEERNAME
        }
    }

    pub fn link_path(self, pin_dir: &Path) -> PathBuf {
        pin_dir.join("links").join(self.pin_name())
    }
}

/// `--bpf-lb-sock` and `--cgroup-root`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SocketLbOptions {
    pub enabled: bool,
    /// The cgroup v2 directory to attach to; `None`: the cgroup v2 root, found in mountinfo.
    pub cgroup_root: Option<PathBuf>,
}

/// The agent's one call: with the socket LB enabled, record the node's network namespace and
/// attach (or re-adopt) the eight programs; disabled, remove our links if a previous run left
/// them. Failures are logged and counted, never fatal: the TC load balancer works without it.
pub fn apply(datapath: &mut Datapath, options: &SocketLbOptions, metrics: &Metrics) {
    if !options.enabled {
        match detach(datapath.pin_dir()) {
            Ok(0) => {}
            Ok(removed) => tracing::info!(removed, "socket load balancer disabled: our cgroup links removed"),
            Err(e) => tracing::error!(error = format!("{e:#}"), "cannot remove the socket load balancer's links"),
        }
        return;
    }
    let attached = resolve_cgroup(options.cgroup_root.as_deref()).and_then(|cgroup| {
        write_host_netns(datapath.pin_dir())?;
        // Before the programs run: none of the agent's connects may be translated, not even once.
        exempt_own_cgroup(datapath.pin_dir(), metrics);
        let outcomes = attach(datapath, &cgroup)?;
        Ok((cgroup, outcomes))
    });
    match attached {
        Ok((cgroup, outcomes)) => {
            metrics.of::<super::attach_metrics::AttachMetrics>().record("cgroup", &outcomes);
            let [connect4, sendmsg4, recvmsg4, getpeername4, connect6, sendmsg6, recvmsg6, getpeername6] = outcomes;
            tracing::info!(
                cgroup = %cgroup.display(),
                ?connect4,
                ?sendmsg4,
                ?recvmsg4,
                ?getpeername4,
                ?connect6,
                ?sendmsg6,
                ?recvmsg6,
                ?getpeername6,
                "socket load balancer attached"
            );
        }
        Err(e) => {
            tracing::error!(
                error = format!("{e:#}"),
                "socket load balancer not attached; the node cannot reach Services"
            );
            metrics.of::<SocketLbMetrics>().errors.inc();
        }
    }
}

/// Attaches the eight programs to `cgroup` through pinned links (`links/cgroup_<hook>`).
pub fn attach(datapath: &mut Datapath, cgroup: &Path) -> Result<[AttachOutcome; 8]> {
    let cgroup_file = fs::File::open(cgroup).with_context(|| format!("opening cgroup {}", cgroup.display()))?;
    let cgroup_id = cgroup_file.metadata()?.ino();
    let mut outcomes = [AttachOutcome::Adopted; 8];
    for (outcome, hook) in outcomes.iter_mut().zip(SockHook::ALL) {
        *outcome = attach_hook(datapath, hook, &cgroup_file, cgroup_id)
            .with_context(|| format!("attaching {} to cgroup {}", hook.program(), cgroup.display()))?;
    }
    Ok(outcomes)
}

fn attach_hook(datapath: &mut Datapath, hook: SockHook, cgroup: &fs::File, cgroup_id: u64) -> Result<AttachOutcome> {
    let link_path = hook.link_path(datapath.pin_dir());
    let pinned = datapath.pinned_map_ids();
    let program: &mut CgroupSockAddr = datapath.program_mut(hook.program())?;
    let ours = program.info()?;

    if link_path.exists() {
        match sys::obj_get(&link_path).and_then(|link| Ok((sys::cgroup_link_info(link.as_fd())?, link))) {
            Ok((info, link)) => {
                if info.cgroup_id == cgroup_id && info.attach_type == hook.kernel_attach_type() {
                    let attached = loaded_programs().filter_map(Result::ok).find(|p| p.id() == info.program_id);
                    if let Some(attached) = attached {
                        if same_program(&attached, &ours, &pinned)? {
                            return Ok(AttachOutcome::Adopted);
                        }
                    }
                    // Our link, another build of the program: swap it in place, atomically.
                    sys::link_update(link.as_fd(), program.fd()?.as_fd()).context("bpf_link_update")?;
                    return Ok(AttachOutcome::Updated);
                }
                // A link to another cgroup (--cgroup-root changed) or one whose cgroup is gone
                // (id 0). Unpinning it below detaches it once `link` is dropped.
                tracing::info!(
                    hook = hook.program(),
                    linked_cgroup = info.cgroup_id,
                    "pinned cgroup link is elsewhere; re-creating it"
                );
            }
            Err(e) => {
                tracing::warn!(hook = hook.program(), error = %e, "unreadable pinned cgroup link; re-creating it")
            }
        }
        fs::remove_file(&link_path).with_context(|| format!("removing stale {}", link_path.display()))?;
    }
    // bpf_link_create on a cgroup: always multi-attach, never replaces another program.
    let id = program.attach(cgroup, CgroupAttachMode::Single)?;
    let link: FdLink = program
        .take_link(id)?
        .try_into()
        .map_err(|_| anyhow!("the kernel attached {} without a bpf_link (needs 5.7+)", hook.program()))?;
    link.pin(&link_path).with_context(|| format!("pinning {}", link_path.display()))?;
    Ok(AttachOutcome::Created)
}

/// Removes our pinned cgroup links (their programs leave the cgroup). Returns how many.
pub fn detach(pin_dir: &Path) -> Result<usize> {
    let mut removed = 0;
    for hook in SockHook::ALL {
        let path = hook.link_path(pin_dir);
        match super::unpin_link(&path) {
            Ok(()) => removed += 1,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("removing {}", path.display())),
        }
    }
    Ok(removed)
}

/// The cgroup to attach to: `configured`, which must be a cgroup v2 directory, or the cgroup v2
/// root found in /proc/self/mountinfo.
pub fn resolve_cgroup(configured: Option<&Path>) -> Result<PathBuf> {
    let cgroup = match configured {
        Some(path) => path.to_path_buf(),
        None => {
            let mountinfo = fs::read_to_string("/proc/self/mountinfo").context("reading /proc/self/mountinfo")?;
            let mounts = cgroup2_mounts(&mountinfo);
            // A cgroup namespace shows its own root as "/" too; only the real root has id 1.
            mounts.iter().find(|path| fs::metadata(path).is_ok_and(|m| m.ino() == ROOT_CGROUP_ID)).cloned().ok_or_else(
                || {
                    anyhow!(
                        "no cgroup v2 root mounted (cgroup2 mounts: {mounts:?}); mount one, e.g. \
                         `mount -t cgroup2 none /sys/fs/cgroup`, or pass --cgroup-root"
                    )
                },
            )?
        }
    };
    let stat = nix_statfs(&cgroup)?;
    if stat != CGROUP2_SUPER_MAGIC {
        bail!("{} is not a cgroup v2 directory (filesystem magic {stat:#x})", cgroup.display());
    }
    if fs::metadata(&cgroup)?.ino() != ROOT_CGROUP_ID {
        tracing::info!(cgroup = %cgroup.display(), "not the cgroup v2 root: only processes in this cgroup and below are load-balanced");
    }
    Ok(cgroup)
}

/// The kernel's id (and inode number) of the cgroup v2 root.
const ROOT_CGROUP_ID: u64 = 1;
const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;

fn nix_statfs(path: &Path) -> Result<i64> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes())?;
    // SAFETY: statfs writes into a zeroed local struct.
    let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(c_path.as_ptr(), &mut stat) } != 0 {
        return Err(io::Error::last_os_error()).with_context(|| format!("statfs {}", path.display()));
    }
    Ok(stat.f_type as i64)
}

/// Mount points of cgroup v2 filesystems, in mountinfo order.
pub fn cgroup2_mounts(mountinfo: &str) -> Vec<PathBuf> {
    cgroup2_mounts_with_roots(mountinfo).into_iter().map(|(_, mount_point)| mount_point).collect()
}

/// (root, mount point) of cgroup v2 filesystems, in mountinfo order (proc_pid_mountinfo(5): the
/// root inside the filesystem and the mount point are the fourth and fifth fields,
/// octal-escaped; the filesystem type follows the " - " separator). The root is relative to
/// the reader's cgroup namespace, as /proc/self/cgroup's paths are.
fn cgroup2_mounts_with_roots(mountinfo: &str) -> Vec<(PathBuf, PathBuf)> {
    mountinfo
        .lines()
        .filter_map(|line| {
            let (fields, rest) = line.split_once(" - ")?;
            (rest.split_whitespace().next()? == "cgroup2").then_some(())?;
            let mut fields = fields.split_whitespace().skip(3);
            let root = PathBuf::from(unescape_octal(fields.next()?));
            Some((root, PathBuf::from(unescape_octal(fields.next()?))))
        })
        .collect()
}

/// Why the agent's own sockets are not exempt from the socket load balancer: the `reason` of
/// `kube_router_socket_lb_agent_not_exempt_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotExempt {
    /// No cgroup v2 entry in /proc/self/cgroup, or its directory under no cgroup2 mount.
    CgroupNotFound,
    /// The agent runs in the root cgroup: exempting it would exempt every process left there.
    RootCgroup,
    MapWriteFailed,
}

impl NotExempt {
    pub fn reason(self) -> &'static str {
        match self {
            NotExempt::CgroupNotFound => "cgroup_not_found",
            NotExempt::RootCgroup => "root_cgroup",
            NotExempt::MapWriteFailed => "map_write_failed",
        }
    }
}

/// Makes `sock_exempt` hold the agent's own cgroup and nothing else (a previous agent's cgroup
/// is gone: ids are never reused), so that no frontend, however it got into the maps, translates
/// the agent's connections to the API server. When the cgroup cannot be exempted, says why once
/// and counts it; the agent runs on, its sockets balanced like any process's.
pub fn exempt_own_cgroup(pin_dir: &Path, metrics: &Metrics) {
    let (own, not_exempt) = match own_cgroup_id() {
        Ok(ROOT_CGROUP_ID) => (None, Some((NotExempt::RootCgroup, "the agent runs in the root cgroup".to_string()))),
        Ok(id) => (Some(id), None),
        Err(e) => (None, Some((NotExempt::CgroupNotFound, format!("{e:#}")))),
    };
    let not_exempt = match (write_exempt_cgroups(pin_dir, own), not_exempt) {
        (Err(e), _) => Some((NotExempt::MapWriteFailed, format!("{e:#}"))),
        (Ok(_), not_exempt) => not_exempt,
    };
    let Some((why, detail)) = not_exempt else {
        tracing::info!(cgroup_id = own, "the socket load balancer never translates the agent's own cgroup");
        return;
    };
    tracing::warn!(
        reason = why.reason(),
        error = detail,
        "the agent's own sockets are not exempt from the socket load balancer: a frontend on the API \
         server's address would capture them"
    );
    metrics.of::<SocketLbMetrics>().agent_not_exempt.get_or_create(&[("reason", why.reason())]).inc();
}

/// The cgroup v2 id of this process: the inode of its directory in a cgroup2 mount (the id
/// `bpf_get_current_cgroup_id` returns for its sockets).
pub fn own_cgroup_id() -> Result<u64> {
    let cgroups = fs::read_to_string("/proc/self/cgroup").context("reading /proc/self/cgroup")?;
    let mountinfo = fs::read_to_string("/proc/self/mountinfo").context("reading /proc/self/mountinfo")?;
    let own = unified_cgroup(&cgroups).context("no cgroup v2 entry (`0::`) in /proc/self/cgroup")?;
    let dirs = cgroup_dirs(&mountinfo, own);
    dirs.iter().find_map(|dir| fs::metadata(dir).ok().map(|m| m.ino())).ok_or_else(|| {
        anyhow!(
            "cgroup {own} is under no cgroup2 mount (tried {dirs:?}); mount the cgroup2 filesystem in the agent's view"
        )
    })
}

/// The path of the `0::<path>` line (cgroups(7): the cgroup v2 hierarchy), relative to the
/// process's cgroup namespace.
fn unified_cgroup(proc_cgroup: &str) -> Option<&str> {
    proc_cgroup.lines().find_map(|line| line.strip_prefix("0::")).filter(|path| path.starts_with('/'))
}

/// Where cgroup `path` (as /proc/self/cgroup shows it) is in each cgroup2 mount that holds it:
/// a mount shows the part of the hierarchy below its root. In a container with a cgroup
/// namespace both are `/`: its own cgroup mount's root is the container's cgroup.
fn cgroup_dirs(mountinfo: &str, path: &str) -> Vec<PathBuf> {
    cgroup2_mounts_with_roots(mountinfo)
        .into_iter()
        .filter_map(|(root, mount_point)| {
            let below = Path::new(path).strip_prefix(&root).ok()?;
            // `..` (a cgroup outside the namespace's root) would climb out of the mount.
            below.components().all(|c| matches!(c, Component::Normal(_))).then(|| mount_point.join(below))
        })
        .collect()
}

/// Writes `sock_exempt` to hold exactly `own` (with its count kept), or nothing. Returns
/// whether it changed.
pub fn write_exempt_cgroups(pin_dir: &Path, own: Option<u64>) -> Result<bool> {
    let data = crate::pinned::open_pinned(pin_dir, sock_map_names::SOCK_EXEMPT)?;
    let mut exempt: PerCpuHashMap<MapData, u64, u64> = PerCpuHashMap::try_from(Map::PerCpuHashMap(data))?;
    let stale: Vec<u64> = exempt.keys().filter_map(Result::ok).filter(|id| Some(*id) != own).collect();
    for id in &stale {
        exempt.remove(id)?;
    }
    let insert = own.filter(|id| exempt.get(id, 0).is_err());
    if let Some(id) = insert {
        let cpus = aya::util::nr_cpus().map_err(|(_, e)| e).context("counting the possible CPUs")?;
        exempt.insert(id, PerCpuValues::try_from(vec![0u64; cpus])?, 0)?;
    }
    Ok(!stale.is_empty() || insert.is_some())
}

/// `sock_exempt` opened for reading its counts.
pub struct ExemptCounts(PerCpuHashMap<MapData, u64, u64>);

impl ExemptCounts {
    /// The event name of [`ExemptCounts::untranslated`] beside `sock_stat::NAMES`.
    pub const EVENT: &'static str = "agent_untranslated";

    /// `None` without the map (the socket LB never ran, or a datapath from before it).
    pub fn open_pinned(pin_dir: &Path) -> Option<Self> {
        let data = MapData::from_pin(crate::pinned::pinned_map(pin_dir, sock_map_names::SOCK_EXEMPT)).ok()?;
        PerCpuHashMap::try_from(Map::PerCpuHashMap(data)).ok().map(Self)
    }

    /// Calls to a frontend left untranslated because an exempt cgroup (the agent's) made them.
    pub fn untranslated(&self) -> u64 {
        self.0.iter().filter_map(Result::ok).map(|(_, per_cpu)| per_cpu.iter().sum::<u64>()).sum()
    }
}

/// The socket counters by name: `sock_stats`, then the agent's untranslated calls.
pub fn sock_events(pin_dir: &Path) -> Vec<(&'static str, u64)> {
    let stats = read_sock_stats(pin_dir).unwrap_or_default();
    let exempt = ExemptCounts::open_pinned(pin_dir).map(|e| (ExemptCounts::EVENT, e.untranslated()));
    sock_stat::NAMES.iter().copied().zip(stats).chain(exempt).collect()
}

fn unescape_octal(text: &str) -> String {
    let mut out = Vec::with_capacity(text.len());
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match (bytes[i], octal) {
            (b'\\', Some(digits)) => {
                out.push(digits.iter().fold(0u8, |n, d| n.wrapping_mul(8) + (d - b'0')));
                i += 4;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Records the agent's network namespace (the node's) in `sock_cfg`, if it is not there yet.
/// Returns whether it wrote.
pub fn write_host_netns(pin_dir: &Path) -> Result<bool> {
    let cookie = netns_cookie()?;
    let data = crate::pinned::open_pinned(pin_dir, sock_map_names::SOCK_CONFIG)?;
    let mut config: Array<MapData, SockLbConfig> = Array::try_from(Map::Array(data))?;
    if config.get(&SOCK_CONFIG_INDEX, 0)?.host_netns_cookie == cookie {
        return Ok(false);
    }
    config.set(SOCK_CONFIG_INDEX, SockLbConfig { host_netns_cookie: cookie }, 0)?;
    Ok(true)
}

/// The cookie of the calling thread's network namespace (SO_NETNS_COOKIE, Linux 5.14+), the
/// value `bpf_get_netns_cookie` returns for sockets there.
pub fn netns_cookie() -> Result<u64> {
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").context("socket for SO_NETNS_COOKIE")?;
    let mut cookie = 0u64;
    let mut len = size_of::<u64>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cookie`.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_NETNS_COOKIE,
            (&mut cookie as *mut u64).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error()).context("getsockopt(SO_NETNS_COOKIE) (needs Linux 5.14)");
    }
    Ok(cookie)
}

/// Sums the per-CPU counters of `sock_stats`, in `sock_stat` index order.
pub fn read_sock_stats(pin_dir: &Path) -> Result<Vec<u64>> {
    crate::pinned::counters::read_pinned(pin_dir, sock_map_names::SOCK_STATS, sock_stat::COUNT)
}

/// The bpf(2) commands aya 0.14 does not expose for cgroup links.
mod sys {
    use super::*;

    const BPF_OBJ_GET: libc::c_long = 7;
    const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
    const BPF_LINK_UPDATE: libc::c_long = 29;
    const BPF_LINK_TYPE_CGROUP: u32 = 3;

    pub struct CgroupLinkInfo {
        pub program_id: u32,
        /// 0 once the cgroup is gone.
        pub cgroup_id: u64,
        pub attach_type: u32,
    }

    fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<()> {
        // SAFETY: attr is a properly laid out bpf_attr prefix for `cmd`, valid for the call.
        let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *mut T, size_of::<T>() as u32) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// `struct bpf_link_info` up to its cgroup member: type, id, prog_id, then (8-aligned) the
    /// union, whose cgroup variant is { cgroup_id: u64, attach_type: u32 }.
    #[repr(C)]
    #[derive(Default)]
    struct LinkInfo {
        link_type: u32,
        id: u32,
        prog_id: u32,
        pad: u32,
        cgroup_id: u64,
        attach_type: u32,
        pad2: u32,
    }

    pub fn cgroup_link_info(link: BorrowedFd<'_>) -> io::Result<CgroupLinkInfo> {
        let mut info = LinkInfo::default();
        #[repr(C)]
        struct InfoAttr {
            bpf_fd: u32,
            info_len: u32,
            info: u64,
        }
        let mut attr = InfoAttr {
            bpf_fd: link.as_raw_fd() as u32,
            info_len: size_of::<LinkInfo>() as u32,
            info: &mut info as *mut LinkInfo as u64,
        };
        bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
        if info.link_type != BPF_LINK_TYPE_CGROUP {
            return Err(io::Error::other(format!("link type {} is not a cgroup link", info.link_type)));
        }
        Ok(CgroupLinkInfo { program_id: info.prog_id, cgroup_id: info.cgroup_id, attach_type: info.attach_type })
    }

    /// BPF_OBJ_GET: a new fd for a pinned object.
    pub fn obj_get(path: &Path) -> io::Result<OwnedFd> {
        use std::os::unix::ffi::OsStrExt;
        let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
        #[repr(C)]
        struct ObjAttr {
            pathname: u64,
            bpf_fd: u32,
            file_flags: u32,
        }
        let mut attr = ObjAttr { pathname: c_path.as_ptr() as u64, bpf_fd: 0, file_flags: 0 };
        // SAFETY: attr holds a valid NUL-terminated path for the duration of the call.
        let fd = unsafe {
            libc::syscall(libc::SYS_bpf, BPF_OBJ_GET, &mut attr as *mut ObjAttr, size_of::<ObjAttr>() as u32)
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: BPF_OBJ_GET returned a new descriptor that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
    }

    pub fn link_update(link: BorrowedFd<'_>, program: BorrowedFd<'_>) -> io::Result<()> {
        #[repr(C)]
        struct UpdateAttr {
            link_fd: u32,
            new_prog_fd: u32,
            flags: u32,
            old_prog_fd: u32,
        }
        let mut attr = UpdateAttr {
            link_fd: link.as_raw_fd() as u32,
            new_prog_fd: program.as_raw_fd() as u32,
            flags: 0,
            old_prog_fd: 0,
        };
        bpf(BPF_LINK_UPDATE, &mut attr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_cgroup2_mounts_in_mountinfo() {
        let mountinfo = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
90 23 0:38 / /host/cgroup\\040v2 rw shared:5 - cgroup2 none rw,nsdelegate
";
        assert_eq!(
            cgroup2_mounts(mountinfo),
            [PathBuf::from("/sys/fs/cgroup/unified"), PathBuf::from("/host/cgroup v2")]
        );
        assert!(cgroup2_mounts("garbage\n\n1 2 3 - cgroup2").is_empty());
    }

    #[test]
    fn finds_the_agents_own_cgroup_directory() {
        // A hybrid host: cgroup v1 controllers, the v2 hierarchy at /sys/fs/cgroup/unified.
        let hybrid = "\
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";
        let proc_cgroup = "12:memory:/system.slice/kr.service\n1:name=systemd:/system.slice/kr.service\n0::/system.slice/kr.service\n";
        let own = unified_cgroup(proc_cgroup).unwrap();
        assert_eq!(cgroup_dirs(hybrid, own), [PathBuf::from("/sys/fs/cgroup/unified/system.slice/kr.service")]);

        // A container with a cgroup namespace: its own cgroup is `/`, the runtime's mount shows
        // it as the root; the host's hierarchy mounted beside it (for attaching) lies above the
        // namespace's root and never holds the agent's path.
        let container = "\
700 690 0:38 / /sys/fs/cgroup ro,nosuid - cgroup2 cgroup rw
701 690 0:38 /../../.. /run/kube-router/cgroupv2 ro - cgroup2 cgroup2 rw
";
        assert_eq!(cgroup_dirs(container, unified_cgroup("0::/\n").unwrap()), [PathBuf::from("/sys/fs/cgroup")]);

        // Moved out of its namespace's root after the namespace was made: nowhere below a mount.
        assert!(cgroup_dirs(container, "/../other").is_empty());
        // cgroup v1 only: no `0::` line.
        assert_eq!(unified_cgroup("4:memory:/x\n1:name=systemd:/x\n"), None);
    }

    #[test]
    fn rejects_a_directory_that_is_not_a_cgroup() {
        let error = resolve_cgroup(Some(Path::new("/proc"))).unwrap_err();
        assert!(format!("{error:#}").contains("/proc is not a cgroup v2 directory"), "{error:#}");
    }
}
