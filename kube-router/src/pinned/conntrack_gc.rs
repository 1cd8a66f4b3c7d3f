//! Conntrack garbage collection, one routine for every conntrack map (the load balancer's
//! `ct_v4`/`ct_v6`, the policy's `pol_ct_v4`/`pol_ct_v6`): entries idle past their lifetime are
//! removed, so the LRU never has to evict live flows to make room for new ones.
use aya::maps::{HashMap, MapData};

/// Removes the entries `expired` picks, given the clock reading `now` (the datapath's
/// `bpf_ktime_get_ns` time, `monotonic_now_ns`). Returns (entries left, entries removed).
pub fn collect_expired<K: aya::Pod, V: aya::Pod>(
    map: &mut HashMap<MapData, K, V>,
    now: u64,
    expired: impl Fn(&K, &V, u64) -> bool,
) -> (usize, usize) {
    // One pass over the map: count every entry and pick the expired ones.
    let mut total = 0;
    let mut gone = Vec::new();
    for (key, value) in map.iter().filter_map(Result::ok) {
        total += 1;
        if expired(&key, &value, now) {
            gone.push(key);
        }
    }
    let removed = gone.iter().filter(|key| map.remove(key).is_ok()).count();
    (total - removed, removed)
}

/// CLOCK_MONOTONIC in nanoseconds, the clock of `bpf_ktime_get_ns`.
pub fn monotonic_now_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes into the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
