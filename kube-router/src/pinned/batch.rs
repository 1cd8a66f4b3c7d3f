//! `BPF_MAP_UPDATE_BATCH` (Linux 5.6), which aya 0.14 does not wrap: many elements of one hash
//! map written with one `bpf()` call. A cold start writes some 250,000 entries into the service
//! maps; one syscall each was a sixth of the agent's start (docs/benchmarks.md).
//!
//! The kernel writes the elements in order and stops at the first it refuses: it reports how
//! many it wrote and that element's error, the same error a write of that element alone gives.
use std::{
    io,
    os::fd::{AsFd, AsRawFd},
};

use aya::maps::MapData;

/// `BPF_MAP_UPDATE_BATCH` in `enum bpf_cmd`.
const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
/// The kernel's internal "operation not supported" (`ENOTSUPP`), which the batch commands return
/// for a map type without them; not in libc.
const ENOTSUPP: i32 = 524;

/// The `batch` member of `union bpf_attr`.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// What a batch did.
#[derive(Debug)]
pub enum BatchWrite {
    /// The first `done` elements were written; the next one (if `done` < the batch's length)
    /// was refused with `error`, and none after it was tried.
    Written { done: usize, error: Option<io::Error> },
    /// The kernel (older than 5.6) or the map type has no batch update: nothing was written.
    Unsupported,
}

/// Writes `keys[i]` → `values[i]` into `map` in one call (flags 0: insert or replace). The
/// key and value types must be the map's (their sizes are its key and value sizes), and the
/// map not per-CPU (whose values are one per possible CPU).
pub fn update_batch<K: aya::Pod, V: aya::Pod>(map: &MapData, keys: &[K], values: &[V]) -> BatchWrite {
    assert_eq!(keys.len(), values.len(), "one value per key");
    if keys.is_empty() {
        return BatchWrite::Written { done: 0, error: None };
    }
    let mut attr = BatchAttr {
        keys: keys.as_ptr() as u64,
        values: values.as_ptr() as u64,
        count: u32::try_from(keys.len()).unwrap_or(u32::MAX),
        map_fd: map.fd().as_fd().as_raw_fd() as u32,
        ..Default::default()
    };
    // SAFETY: `attr` is the command's attribute (the kernel reads `size_of` bytes of it and
    // writes `count` back); `keys` and `values` outlive the call and hold `count` elements each,
    // laid out as the kernel reads them (key size and value size apart: `Pod` types are plain
    // `repr(C)` data whose size is the map's).
    let rc = unsafe {
        libc::syscall(libc::SYS_bpf, BPF_MAP_UPDATE_BATCH, &mut attr as *mut BatchAttr, size_of::<BatchAttr>())
    };
    let done = (attr.count as usize).min(keys.len());
    if rc == 0 {
        return BatchWrite::Written { done, error: None };
    }
    let error = io::Error::last_os_error();
    match error.raw_os_error() {
        // Before 5.6 an unknown command is EINVAL; a map type without batches EOPNOTSUPP or
        // ENOTSUPP. An element's own EINVAL (bad flags) cannot come from a write with flags 0
        // into a map of these key and value types.
        Some(libc::EINVAL | libc::EOPNOTSUPP | ENOTSUPP | libc::ENOSYS) if done == 0 => BatchWrite::Unsupported,
        _ => BatchWrite::Written { done, error: Some(error) },
    }
}
