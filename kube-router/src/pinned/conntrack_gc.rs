//! Conntrack garbage collection, one routine for every conntrack map (the load balancer's
//! `ct_v4`/`ct_v6`, the policy's `pol_ct_v4`/`pol_ct_v6`): entries idle past their lifetime are
//! removed, so the LRU never has to evict live flows to make room for new ones.
use std::os::fd::{AsFd, AsRawFd};

use aya::maps::{HashMap, IterableMap, MapData};

/// Removes the entries `expired` picks, given the clock reading `now` (the datapath's
/// `bpf_ktime_get_ns` time, `monotonic_now_ns`). Returns (entries left, entries removed).
pub fn collect_expired<K: aya::Pod, V: aya::Pod>(
    map: &mut HashMap<MapData, K, V>,
    now: u64,
    expired: impl Fn(&K, &V, u64) -> bool,
) -> (usize, usize) {
    let (total, gone) = expired_keys(map, now, &expired);
    let removed = remove_expired(map, &gone, now, &expired);
    (total - removed, removed)
}

/// The GC's walk: every entry counted, the keys of those `expired` picks.
pub fn expired_keys<K: aya::Pod, V: aya::Pod>(
    map: &HashMap<MapData, K, V>,
    now: u64,
    expired: impl Fn(&K, &V, u64) -> bool,
) -> (usize, Vec<K>) {
    let mut total = 0;
    let mut gone = Vec::new();
    for (key, value) in map.iter().filter_map(Result::ok) {
        total += 1;
        if expired(&key, &value, now) {
            gone.push(key);
        }
    }
    (total, gone)
}

/// Removes the entries of `keys` (the walk's) that are still expired; returns how many.
///
/// The walk and the removals are apart in time (a walk of a large table takes a while), and
/// the datapath rewrites an expired entry in place when a new flow takes its tuple (a client
/// port reused). Removing by key what the walk saw would then remove the new flow's entries, a
/// pair one half at a time: a forward entry left without its reverse one translates every
/// packet of that tuple towards a backend whose answers are never translated back. So each
/// entry is taken out atomically with its value, and put back if it is not the expired one.
pub fn remove_expired<K: aya::Pod, V: aya::Pod>(
    map: &mut HashMap<MapData, K, V>,
    keys: &[K],
    now: u64,
    expired: impl Fn(&K, &V, u64) -> bool,
) -> usize {
    let (mut removed, mut renewed) = (0, 0);
    for key in keys {
        match take(map, key) {
            Taken::Value(value) if expired(key, &value, now) => removed += 1,
            Taken::Value(value) => {
                // Written since the walk: a new flow's. NOEXIST: one the datapath wrote in the
                // meantime is newer still.
                renewed += 1;
                let _ = map.insert(key, value, BPF_NOEXIST);
            }
            Taken::Absent => {}
            Taken::Unsupported => {
                // A kernel without lookup-and-delete for hash maps (before 5.14): read again,
                // then remove; only the moment between the two is left to a new flow.
                if map.get(key, 0).is_ok_and(|value| expired(key, &value, now)) && map.remove(key).is_ok() {
                    removed += 1;
                }
            }
        }
    }
    if renewed > 0 {
        tracing::debug!(renewed, "conntrack GC kept entries a new flow wrote after its walk");
    }
    removed
}

/// `BPF_NOEXIST` (linux/bpf.h).
const BPF_NOEXIST: u64 = 1;

enum Taken<V> {
    Value(V),
    Absent,
    Unsupported,
}

/// Removes `key` and returns the value removed (`BPF_MAP_LOOKUP_AND_DELETE_ELEM`: no update
/// between the read and the removal).
fn take<K: aya::Pod, V: aya::Pod>(map: &HashMap<MapData, K, V>, key: &K) -> Taken<V> {
    const BPF_MAP_LOOKUP_AND_DELETE_ELEM: libc::c_long = 21;
    // union bpf_attr, the element commands' member.
    #[repr(C)]
    struct ElemAttr {
        map_fd: u32,
        pad: u32,
        key: u64,
        value: u64,
        flags: u64,
    }
    let mut value = std::mem::MaybeUninit::<V>::zeroed();
    let attr = ElemAttr {
        map_fd: map.map().fd().as_fd().as_raw_fd() as u32,
        pad: 0,
        key: key as *const K as u64,
        value: value.as_mut_ptr() as u64,
        flags: 0,
    };
    // SAFETY: a valid attribute for the command; key and value point to buffers of the map's
    // key and value sizes (a plain, not per-CPU, hash map of K and V), live for the call.
    let rc =
        unsafe { libc::syscall(libc::SYS_bpf, BPF_MAP_LOOKUP_AND_DELETE_ELEM, &attr, size_of::<ElemAttr>() as u32) };
    if rc == 0 {
        // SAFETY: the kernel filled the whole value (V is Pod: any bytes are a value).
        return Taken::Value(unsafe { value.assume_init() });
    }
    match std::io::Error::last_os_error().raw_os_error() {
        Some(libc::ENOENT) => Taken::Absent,
        _ => Taken::Unsupported,
    }
}

/// CLOCK_MONOTONIC in nanoseconds, the clock of `bpf_ktime_get_ns`.
pub fn monotonic_now_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes into the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
