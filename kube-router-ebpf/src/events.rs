//! Events for `kube-router monitor`: policy drops and new Service flows, written to the `events`
//! ring buffer only while a monitor holds the lease in `events_cfg` (one array lookup when off),
//! and at most `rate_per_cpu` per second per CPU (a token bucket), so a flood costs no more than
//! the limit and never fills the ring for long.
use aya_ebpf::{
    macros::map,
    maps::{Array, PerCpuArray, RingBuf},
};
use kube_router_common::*;

use crate::packet::Packet;

#[map(name = "events")]
static EVENTS: RingBuf = RingBuf::pinned(EVENTS_RING_BYTES, 0);

#[map(name = "events_cfg")]
static EVENTS_CONFIG: Array<MonitorConfig> = Array::pinned(1, 0);

#[map(name = "events_bucket")]
static EVENTS_BUCKET: PerCpuArray<TokenBucket> = PerCpuArray::pinned(1, 0);

#[map(name = "events_stats")]
static EVENTS_STATS: PerCpuArray<u64> = PerCpuArray::pinned(event_stat::COUNT, 0);

const NS_PER_S: u64 = 1_000_000_000;
const MAX_RATE: u64 = 1_000_000;

#[inline(always)]
fn count(stat: u32) {
    crate::maps::bump(&EVENTS_STATS, stat);
}

/// Whether a monitor is listening; the cost of the monitor when off.
#[inline(always)]
pub fn listening(now: u64) -> bool {
    EVENTS_CONFIG.get(0).is_some_and(|config| now < config.enabled_until_ns)
}

/// Takes a token from this CPU's bucket.
#[inline(always)]
fn admitted(now: u64) -> bool {
    let Some(config) = EVENTS_CONFIG.get(0) else { return false };
    let Some(bucket) = EVENTS_BUCKET.get_ptr_mut(0) else { return false };
    // SAFETY: per-CPU map memory, this run's alone.
    let bucket = unsafe { &mut *bucket };
    // No overflow checks (they would need 128-bit multiplies BPF lacks): the rate is capped at
    // MAX_RATE and the elapsed time at a second, so the products stay below 2^50.
    let rate = config.rate_per_cpu.min(MAX_RATE);
    let full = rate * NS_PER_S;
    let elapsed = now.saturating_sub(bucket.last_ns).min(NS_PER_S);
    bucket.scaled_tokens = (bucket.scaled_tokens + elapsed * rate).min(full);
    bucket.last_ns = now;
    if bucket.scaled_tokens < NS_PER_S {
        count(event_stat::RATE_LIMITED);
        return false;
    }
    bucket.scaled_tokens -= NS_PER_S;
    true
}

/// Writes an event if a monitor listens and the rate allows.
#[inline(always)]
pub fn emit<C: Packet>(ctx: &C, now: u64, event: impl FnOnce(u32) -> MonitorEvent) {
    if !listening(now) || !admitted(now) {
        return;
    }
    let Some(mut entry) = EVENTS.reserve::<MonitorEvent>(0) else {
        count(event_stat::LOST);
        return;
    };
    entry.write(event(ctx.ifindex()));
    entry.submit(0);
    count(event_stat::EMITTED);
}
