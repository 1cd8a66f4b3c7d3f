//! The kernel side of the agent: loading and attaching the datapath (`datapath`, `xdp`,
//! `socket_lb`), the maps' layout and its checks (`layout`), upgrades of pinned maps (`migrate`).
//! Reading and writing the maps is each feature's (`services::maps`, `policy::maps`,
//! `node::pod_sources`, `routing::overlay::maps`), over the helpers in `crate::pinned`.
pub mod attach_metrics;
pub mod datapath;
pub mod layout;
#[cfg(test)]
mod layout_tests;
pub mod migrate;
pub mod socket_lb;
pub mod xdp;

/// The datapath object built by build.rs (aya-build) from the kube-router-ebpf crate.
pub static DATAPATH_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/kube-router"));

use std::path::Path;

/// Removes a pinned bpf_link and detaches it at once. Unpinning alone drops the last reference
/// from a kernel work queue, so the program stays attached for a moment after the pin is gone;
/// `BPF_LINK_DETACH` takes it off synchronously, so `cleanup` or a mode switch is done when it
/// returns. A pin that is not a link (a classic-tc program) is only removed.
pub fn unpin_link(path: &Path) -> std::io::Result<()> {
    if let Some(fd) = obj_get(path) {
        // Links that cannot be detached this way (EOPNOTSUPP) still go when the pin goes.
        let _ = link_detach(&fd);
    }
    std::fs::remove_file(path)
}

fn obj_get(path: &Path) -> Option<std::os::fd::OwnedFd> {
    use std::os::{fd::FromRawFd, unix::ffi::OsStrExt};
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // union bpf_attr, BPF_OBJ_GET member: pathname, bpf_fd, file_flags, path_fd.
    let mut attr = [0u64; 16];
    attr[0] = c_path.as_ptr() as u64;
    // SAFETY: attr is a zeroed bpf_attr holding a valid NUL-terminated path for the call.
    let fd = unsafe {
        libc::syscall(libc::SYS_bpf, 7 /* BPF_OBJ_GET */, attr.as_mut_ptr(), 128u32)
    };
    // SAFETY: on success the kernel returned a new file descriptor that we now own.
    (fd >= 0).then(|| unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) })
}

fn link_detach(link: &std::os::fd::OwnedFd) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // union bpf_attr, BPF_LINK_DETACH member: link_fd.
    let mut attr = [0u64; 16];
    attr[0] = link.as_raw_fd() as u32 as u64;
    // SAFETY: attr is a zeroed bpf_attr naming a link fd we hold.
    let rc = unsafe {
        libc::syscall(libc::SYS_bpf, 34 /* BPF_LINK_DETACH */, attr.as_mut_ptr(), 128u32)
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
