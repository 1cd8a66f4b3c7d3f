//! The XDP fast path (`kr_xdp_lb`) on node uplinks: attached through a pinned BPF_XDP
//! bpf_link (`links/xdp_<interface>`), re-adopted on restart like the TC links, and removed
//! only by us. The link is made with our own `BPF_LINK_CREATE` call: aya would fall back to a
//! netlink attach, which can replace an XDP program someone else attached.
use std::{
    fs,
    os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd},
    path::{Path, PathBuf},
};

use anyhow::{anyhow, bail, Context, Result};
use aya::programs::{ProgramInfo, Xdp};
use kube_router_common::{map_names, xdp_stat};

use super::datapath::{same_program, AttachOutcome, Datapath};

pub const PROGRAM: &str = "kr_xdp_lb";
const PIN_PREFIX: &str = "xdp_";

/// The agent's `--xdp`: which XDP mode to attach in, or none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XdpSetting {
    /// Native (driver) mode where the interface's driver has it, generic elsewhere and on veths.
    Auto,
    Native,
    Generic,
    /// No XDP program of ours anywhere (any left by an earlier run is removed).
    Off,
}

impl std::str::FromStr for XdpSetting {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "native" => Ok(Self::Native),
            "generic" => Ok(Self::Generic),
            "off" => Ok(Self::Off),
            other => Err(format!("--xdp {other}: expected auto, native, generic or off")),
        }
    }
}

/// An XDP attachment mode (the kernel's `XDP_FLAGS_*_MODE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XdpMode {
    Native,
    Generic,
}

impl XdpMode {
    fn flags(self) -> u32 {
        match self {
            XdpMode::Generic => 1 << 1, // XDP_FLAGS_SKB_MODE
            XdpMode::Native => 1 << 2,  // XDP_FLAGS_DRV_MODE
        }
    }
}

impl XdpSetting {
    /// The modes to try, in order, on an interface of driver `driver`. `auto` takes a veth
    /// generically: native XDP_TX frames reach a veth's peer only if the peer runs NAPI (an XDP
    /// program or GRO of its own), which cannot be seen from this side, and are silently lost
    /// otherwise (a container-in-container node, kind, would black-hole its north-south flows).
    fn modes(self, driver: Option<&str>) -> &'static [XdpMode] {
        match self {
            XdpSetting::Auto if driver == Some("veth") => &[XdpMode::Generic],
            XdpSetting::Auto => &[XdpMode::Native, XdpMode::Generic],
            XdpSetting::Native => &[XdpMode::Native],
            XdpSetting::Generic => &[XdpMode::Generic],
            XdpSetting::Off => &[],
        }
    }
}

pub fn link_path(pin_dir: &Path, interface: &str) -> PathBuf {
    pin_dir.join("links").join(format!("{PIN_PREFIX}{interface}"))
}

/// The interface a pin file in `links/` stands for, if it is one of our XDP links.
pub fn interface_of_pin(name: &str) -> Option<&str> {
    name.strip_prefix(PIN_PREFIX)
}

/// What the kernel says of a pinned XDP link (from its fd's `/proc` info).
#[derive(Debug, PartialEq, Eq)]
struct LinkState {
    program_id: u32,
    /// 0 once the interface is gone.
    ifindex: u32,
}

/// Parses `/proc/<pid>/fdinfo/<fd>` of an XDP bpf_link.
fn parse_fdinfo(info: &str) -> Option<LinkState> {
    let field = |name: &str| info.lines().find_map(|l| l.strip_prefix(name).map(|v| v.trim().parse::<u32>().ok()))?;
    if !info.lines().any(|l| l.starts_with("link_type:") && l.contains("xdp")) {
        return None;
    }
    Some(LinkState { program_id: field("prog_id:")?, ifindex: field("ifindex:").unwrap_or(0) })
}

fn link_state(link: &OwnedFd) -> Option<LinkState> {
    parse_fdinfo(&fs::read_to_string(format!("/proc/self/fdinfo/{}", link.as_raw_fd())).ok()?)
}

/// `bpf(cmd, attr)` with a zeroed 128-byte `union bpf_attr` whose leading words are `words`.
fn bpf(cmd: libc::c_long, words: &[u64]) -> std::io::Result<i64> {
    let mut attr = [0u64; 16];
    attr[..words.len()].copy_from_slice(words);
    // SAFETY: attr is a valid, zero-padded bpf_attr for `cmd`; pointers in it outlive the call.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), 128u32) };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(rc)
}

/// Two u32 fields as one attribute word (first field in the low half, as laid out in memory).
fn pair(first: u32, second: u32) -> u64 {
    u64::from(first) | u64::from(second) << 32
}

const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_LINK_UPDATE: libc::c_long = 29;
const BPF_XDP: u32 = 37;

fn link_create(prog_fd: i32, ifindex: u32, mode: XdpMode) -> std::io::Result<OwnedFd> {
    // link_create: prog_fd, target_ifindex, attach_type, flags.
    let fd = bpf(BPF_LINK_CREATE, &[pair(prog_fd as u32, ifindex), pair(BPF_XDP, mode.flags())])?;
    // SAFETY: a new fd the kernel just returned, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

fn link_update(link: &OwnedFd, prog_fd: i32) -> std::io::Result<()> {
    // link_update: link_fd, new_prog_fd, flags, old_prog_fd.
    bpf(BPF_LINK_UPDATE, &[pair(link.as_raw_fd() as u32, prog_fd as u32)]).map(drop)
}

fn obj_get(path: &Path) -> std::io::Result<OwnedFd> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    let fd = bpf(BPF_OBJ_GET, &[c_path.as_ptr() as u64])?;
    // SAFETY: as in link_create.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

fn obj_pin(fd: &OwnedFd, path: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    bpf(BPF_OBJ_PIN, &[c_path.as_ptr() as u64, u64::from(fd.as_raw_fd() as u32)]).map(drop)
}

fn our_program(datapath: &mut Datapath) -> Result<(i32, ProgramInfo)> {
    let program: &mut Xdp = datapath.program_mut(PROGRAM)?;
    let info = program.info()?;
    let fd = program.fd()?.as_fd().as_raw_fd();
    Ok((fd, info))
}

/// Attaches `kr_xdp_lb` to `interface` in the first of the setting's modes the interface takes,
/// re-adopting the link a previous agent pinned when it is still attached, whatever its mode (a
/// link does not tell its mode; switching between native and generic takes a run with `off`).
/// An XDP program someone else attached is left alone (and reported as an error).
pub fn attach(
    datapath: &mut Datapath,
    interface: &str,
    setting: XdpSetting,
) -> Result<(AttachOutcome, Option<XdpMode>)> {
    let ifindex = crate::node::netif::interface_index(interface).ok_or_else(|| anyhow!("no interface {interface}"))?;
    let path = link_path(datapath.pin_dir(), interface);
    let (prog_fd, ours) = our_program(datapath)?;
    if path.exists() {
        match obj_get(&path).ok().and_then(|fd| Some((link_state(&fd)?, fd))) {
            Some((state, link)) if state.ifindex == ifindex => {
                let attached = aya::programs::loaded_programs()
                    .flatten()
                    .find(|p| p.id() == state.program_id)
                    .ok_or_else(|| anyhow!("program {} of {} not found", state.program_id, path.display()))?;
                if same_program(&attached, &ours, &datapath.pinned_map_ids())? {
                    return Ok((AttachOutcome::Adopted, None));
                }
                link_update(&link, prog_fd).context("bpf_link_update of the XDP link")?;
                return Ok((AttachOutcome::Updated, None));
            }
            _ => {
                tracing::info!(interface, "pinned XDP link is no longer attached; re-creating it");
                fs::remove_file(&path).with_context(|| format!("removing stale {}", path.display()))?;
            }
        }
    }
    let mut errors = Vec::new();
    for &mode in setting.modes(crate::node::netif::driver(interface).as_deref()) {
        match link_create(prog_fd, ifindex, mode) {
            Ok(link) => {
                obj_pin(&link, &path).with_context(|| format!("pinning {}", path.display()))?;
                return Ok((AttachOutcome::Created, Some(mode)));
            }
            // The interface runs an XDP program that is not ours: never replaced.
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) || e.raw_os_error() == Some(libc::EEXIST) => {
                bail!("{interface} already runs an XDP program we did not attach; leaving it ({e})")
            }
            Err(e) => errors.push(format!("{mode:?}: {e}")),
        }
    }
    bail!("cannot attach {PROGRAM} to {interface}: {}", errors.join("; "))
}

/// One of our pinned XDP links, as the kernel sees it (`kube-router interfaces`).
#[derive(Debug, PartialEq, Eq)]
pub struct XdpAttachment {
    pub interface: String,
    /// `None`: the pin is not an XDP link we can read.
    pub program_id: Option<u32>,
    /// The link is still on its interface (false once the interface went away).
    pub attached: bool,
}

/// Our pinned XDP links, by interface.
pub fn attachments(pin_dir: &Path) -> Vec<XdpAttachment> {
    let mut out: Vec<XdpAttachment> = fs::read_dir(pin_dir.join("links"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            let interface = interface_of_pin(&name)?.to_string();
            let state = obj_get(&entry.path()).ok().and_then(|fd| link_state(&fd));
            Some(XdpAttachment {
                interface,
                program_id: state.as_ref().map(|s| s.program_id),
                attached: state.is_some_and(|s| s.ifindex != 0),
            })
        })
        .collect();
    out.sort_by(|a, b| a.interface.cmp(&b.interface));
    out
}

/// Removes our XDP link from `interface`, if we attached one (its pin says so).
pub fn detach(pin_dir: &Path, interface: &str) -> Result<bool> {
    let path = link_path(pin_dir, interface);
    if !path.exists() {
        return Ok(false);
    }
    super::unpin_link(&path).with_context(|| format!("removing {}", path.display()))?;
    Ok(true)
}

/// The XDP program's fd (for BPF_PROG_TEST_RUN).
pub fn program_fd(datapath: &mut Datapath) -> Result<std::os::fd::RawFd> {
    Ok(our_program(datapath)?.0)
}

/// Sums the per-CPU counters of `xdp_stats`, in `xdp_stat` index order; `None` when the map was
/// never created (a datapath from before the XDP fast path).
pub fn read_stats(pin_dir: &Path) -> Result<Option<Vec<u64>>> {
    crate::pinned::counters::read_pinned_if_exists(pin_dir, map_names::XDP_STATS, xdp_stat::COUNT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fdinfo_of_an_xdp_link_names_its_program_and_interface() {
        let info = "pos:\t0\nflags:\t02000000\nmnt_id:\t15\nino:\t1\nlink_type:\txdp\nlink_id:\t7\nprog_tag:\tab\nprog_id:\t42\nattach_type:\t37\nifindex:\t3\n";
        assert_eq!(parse_fdinfo(info), Some(LinkState { program_id: 42, ifindex: 3 }));
        let detached = info.replace("ifindex:\t3", "ifindex:\t0");
        assert_eq!(parse_fdinfo(&detached).map(|s| s.ifindex), Some(0));
        assert_eq!(parse_fdinfo("link_type:\ttcx\nprog_id:\t42\n"), None, "not an XDP link");
    }

    #[test]
    fn settings_try_native_before_generic_and_off_tries_nothing() {
        let modes = |setting: &str, driver| setting.parse::<XdpSetting>().unwrap().modes(driver);
        assert_eq!(modes("auto", Some("ixgbe")), &[XdpMode::Native, XdpMode::Generic]);
        assert_eq!(modes("auto", None), &[XdpMode::Native, XdpMode::Generic]);
        assert_eq!(modes("auto", Some("veth")), &[XdpMode::Generic], "a veth's peer may not take native XDP_TX");
        assert_eq!(modes("native", Some("veth")), &[XdpMode::Native]);
        assert_eq!(modes("generic", Some("ixgbe")), &[XdpMode::Generic]);
        assert!(modes("off", None).is_empty());
        assert!("fast".parse::<XdpSetting>().is_err());
    }
}
