//! The plain-traffic cache (see `kube_router_common::plain`). Most packets through a node are
//! plain traffic: no Service flow can hold them, their pod is isolated by no policy. Judging one
//! costs a handful of hash lookups per program (the load balancer's gate, the source check, the
//! policy's isolation), about 80 % of what the programs cost traffic that uses no Service. Each
//! program instead asks this per-CPU cache first, slots indexed by a hash of the IPv4 tuple (or a
//! pod's address and interface): one inlined array access, no helper call.
//!
//! A verdict is remembered with the generation read before it was found (`probe`), and trusted
//! while `plain_gen` still holds that generation. Whatever could make a plain tuple one that is
//! not changes the generation after it is written: the agent's writes of frontends, pods'
//! isolation and source addresses, the load balancer's settings (`pinned::plain`), and this
//! datapath's record of a new Service flow's endpoints (`conntrack::record_endpoints`). A
//! verdict is also trusted for `TTL_JIFFIES` at most, a bound on any write that missed its
//! change of generation, not a part of the protocol.
//!
//! IPv4 TCP and UDP without options or fragmentation only; anything else is judged in full.
use aya_ebpf::{
    helpers::bpf_jiffies64,
    macros::map,
    maps::{Array, PerCpuArray},
    programs::TcContext,
};
use kube_router_common::*;

use crate::packet;

/// The load balancer at TC ingress: not tracked. Says nothing of the source check, which is
/// the interface's (`SOURCE_OK_LB`).
pub const LB_INGRESS: u32 = 1 << 0;
/// The load balancer at TC egress: not tracked.
pub const LB_EGRESS: u32 = 1 << 1;
/// The policy at the pod veth's ingress (from the pod): isolated in neither direction, and
/// the source check (if it checks) passed.
pub const POLICY_FROM_POD: u32 = 1 << 2;
/// The policy at the pod veth's egress (to the pod): isolated in neither direction.
pub const POLICY_TO_POD: u32 = 1 << 3;
/// The source check counted the packet checked and passed, in the load balancer or the policy:
/// a hit counts it again, so the counters read as without the cache.
pub const SOURCE_COUNTED_BY_LB: u32 = 1 << 4;
pub const SOURCE_COUNTED_BY_POLICY: u32 = 1 << 5;
/// The source check of the load balancer / the policy passes the packet (or does not check it).
pub const SOURCE_OK_LB: u32 = 1 << 6;
pub const SOURCE_OK_POLICY: u32 = 1 << 7;

/// Verdicts on a tuple, whatever the interface; the others are on the pod's address at the
/// interface (the policy's isolation, the source check), whatever its peer and ports: a pod's
/// next connection finds them too.
const TUPLE_VERDICTS: u32 = LB_INGRESS | LB_EGRESS;

/// Slots per CPU (a power of two). A collision only costs the full judgement. The whole of a
/// CPU's slots is one per-CPU value, 32 KiB (the most a per-CPU value may be): one contiguous
/// block a CPU's caches hold, not a slot per allocation. With 4,096 slots, one per-CPU element
/// each (a pointer to load, then the slot, both on cold lines), reading a slot was the largest
/// part of our programs' samples in a profile of Service traffic, whose slots always miss.
const SLOTS: usize = 1024;
/// Slots a pair of addresses' tuples share (a power of two).
const WAYS: usize = 4;
/// At most a second at any HZ a kernel is built with (100 to 1000).
const TTL_JIFFIES: u32 = 100;

const ETH_P_IP_BE: u16 = 0x0800u16.to_be();
const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;
/// The IPv4 header's fragment field, less the DF bit: more fragments, or an offset.
const IP_FRAGMENTED: u16 = 0x3fff;

/// What a verdict is remembered under: a tuple's (`TUPLE_VERDICTS`), or a pod's address at an
/// interface, `{ src: pod, dst: ifindex, ports: 0, proto: 0 }` (no tuple has protocol 0).
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq)]
struct Key {
    src: u32,
    dst: u32,
    /// Source and destination ports, as in the packet.
    ports: u32,
    proto: u32,
}

impl Key {
    /// The key `verdict` is remembered under, from the packet's tuple and interface.
    #[inline(always)]
    fn for_verdict(&self, verdict: u32, ifindex: u32) -> Key {
        // The load balancer's verdicts do not depend on the interface: one remembered at
        // ingress serves the packet's egress from the node too.
        if verdict & TUPLE_VERDICTS != 0 {
            return *self;
        }
        let pod = if verdict & POLICY_TO_POD != 0 { self.dst } else { self.src };
        Key { src: pod, dst: ifindex, ports: 0, proto: 0 }
    }
}

/// 32 bytes: two to a cache line.
#[repr(C)]
struct Slot {
    key: Key,
    verdicts: u32,
    /// `bpf_jiffies64` when found, its low half: only `TTL_JIFFIES` apart matters. A slot left
    /// untouched for 2^32 jiffies (50 days at 1000 HZ) may look fresh again, which only matters
    /// if the generation is unchanged too, when its verdict still holds.
    since: u32,
    generation: u64,
}

/// A CPU's slots.
#[repr(C)]
struct Slots([Slot; SLOTS]);

/// What this program run's packet is, read before its judgement.
#[repr(C)]
struct Probe {
    key: Key,
    ifindex: u32,
    cacheable: u32,
    generation: u64,
    /// `SOURCE_COUNTED_*` noted during the judgement.
    noted: u32,
    pad: u32,
}

#[map(name = "plain_gen")]
static GENERATION: Array<u64> = Array::pinned(1, 0);

#[map(name = "plain_stats")]
static STATS: PerCpuArray<u64> = PerCpuArray::pinned(plain_stat::COUNT, 0);

// Not pinned: what a program remembered is only good for the programs loaded with it.
#[map(name = "plain_cache")]
static CACHE: PerCpuArray<Slots> = PerCpuArray::with_max_entries(1, 0);

#[map(name = "plain_probe")]
static PROBE: PerCpuArray<Probe> = PerCpuArray::with_max_entries(1, 0);

#[inline(always)]
fn count(stat: u32) {
    crate::maps::bump(&STATS, stat);
}

#[inline(always)]
fn generation() -> Option<u64> {
    let at = GENERATION.get_ptr(0)?;
    // Volatile: another CPU, or the agent, changes it.
    // SAFETY: map memory, valid for this run.
    Some(unsafe { core::ptr::read_volatile(at) })
}

/// The packet's tuple and interface, if it is one the cache holds.
#[inline(always)]
fn key_of(ctx: &TcContext) -> Option<(Key, u32)> {
    // SAFETY: reading fields of the context the program was called with.
    let (vlan, ifindex) = unsafe { ((*ctx.skb.skb).vlan_present, (*ctx.skb.skb).ifindex) };
    if vlan != 0 || packet::load::<u16>(ctx, 12).ok()? != ETH_P_IP_BE {
        return None;
    }
    let header = packet::load::<[u32; 5]>(ctx, 14).ok()?;
    let [version_ihl, _, _, _] = header[0].to_ne_bytes();
    let [_, _, frag_hi, frag_lo] = header[1].to_ne_bytes();
    let [_, proto, _, _] = header[2].to_ne_bytes();
    if version_ihl != 0x45
        || u16::from_be_bytes([frag_hi, frag_lo]) & IP_FRAGMENTED != 0
        || (proto != IPPROTO_TCP && proto != IPPROTO_UDP)
    {
        return None;
    }
    let ports = packet::load::<u32>(ctx, 34).ok()?;
    Some((Key { src: header[3], dst: header[4], ports, proto: proto as u32 }, ifindex))
}

/// This CPU's slot for `key`.
#[inline(always)]
fn slot_of(key: &Key) -> Option<*mut Slot> {
    let slots = CACHE.get_ptr_mut(0)?;
    // The addresses choose a set of `WAYS` adjacent slots, the ports one of them: a pair of
    // endpoints' flows share two cache lines, warm from its last packet.
    let set = fmix32(mix32(key.src, key.dst)) as usize * WAYS;
    let way = fmix32(mix32(key.ports, key.proto)) as usize & (WAYS - 1);
    let index = (set + way) & (SLOTS - 1);
    // SAFETY: per-CPU map memory, and `index` < SLOTS.
    Some(unsafe { (*slots).0.as_mut_ptr().add(index) })
}

/// The verdicts remembered for this packet if they include `verdict`, else 0. Also the probe a
/// judgement of this packet remembers its verdict from (`remember`): called first by every
/// program that uses the cache (or `probe`).
#[inline(always)]
pub fn known(ctx: &TcContext, verdict: u32) -> u32 {
    if !probe(ctx) {
        return 0;
    }
    known_again(verdict)
}

/// Reads the packet's tuple and the generation into this run's probe: whether the packet is one
/// the cache holds.
// Not inlined: a frame of its own, gone before the program's deeper calls.
#[inline(never)]
pub fn probe(ctx: &TcContext) -> bool {
    let Some(probe) = PROBE.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: per-CPU map memory, used by this program run only.
    let probe = unsafe { &mut *probe };
    probe.cacheable = 0;
    probe.noted = 0;
    let Some((key, ifindex)) = key_of(ctx) else {
        return false;
    };
    // Read before anything the judgement reads: a change after this read, of anything the
    // judgement found, changes the generation the verdict is remembered with.
    let Some(generation) = generation() else {
        return false;
    };
    probe.key = key;
    probe.ifindex = ifindex;
    probe.generation = generation;
    probe.cacheable = 1;
    true
}

/// The verdicts remembered for this run's packet if they include `verdict`, else 0, after
/// `known` or `probe` probed it.
#[inline(never)]
pub fn known_again(verdict: u32) -> u32 {
    let Some(probe) = PROBE.get_ptr(0) else {
        return 0;
    };
    // SAFETY: per-CPU map memory, written by this run's `known`.
    let probe = unsafe { &*probe };
    if probe.cacheable == 0 {
        return 0;
    }
    lookup(&probe.key.for_verdict(verdict, probe.ifindex), probe.generation, verdict)
}

#[inline(always)]
fn lookup(key: &Key, generation: u64, verdict: u32) -> u32 {
    let Some(slot) = slot_of(key) else {
        return 0;
    };
    // SAFETY: per-CPU map memory; only this CPU's runs write it, one at a time.
    let slot = unsafe { &*slot };
    if slot.verdicts & verdict == 0 || slot.key != *key || slot.generation != generation {
        return 0;
    }
    if jiffies().wrapping_sub(slot.since) >= TTL_JIFFIES {
        return 0;
    }
    count(plain_stat::HIT);
    slot.verdicts
}

/// The low half of `bpf_jiffies64` (see `Slot::since`).
#[inline(always)]
fn jiffies() -> u32 {
    unsafe { bpf_jiffies64() as u32 }
}

/// Notes `SOURCE_COUNTED_*` for the verdict this run remembers.
#[inline(always)]
pub fn note(what: u32) {
    if let Some(probe) = PROBE.get_ptr_mut(0) {
        // SAFETY: per-CPU map memory, used by this program run only.
        unsafe { (*probe).noted |= what };
    }
}

/// This run judged its packet plain for `verdict`: remembered under the generation `known` read.
// Not inlined: called deep in the load balancer's ingress, whose stack is at its limit.
#[inline(never)]
pub fn remember(verdict: u32) {
    let Some(probe) = PROBE.get_ptr(0) else {
        return;
    };
    // SAFETY: per-CPU map memory, written by this run's `known`.
    let probe = unsafe { &*probe };
    if probe.cacheable == 0 {
        return;
    }
    let key = probe.key.for_verdict(verdict, probe.ifindex);
    let Some(slot) = slot_of(&key) else {
        return;
    };
    // SAFETY: per-CPU map memory; only this CPU's runs write it, one at a time.
    let slot = unsafe { &mut *slot };
    let now = jiffies();
    // What the source check noted belongs to the interface's verdicts, not the tuple's.
    let verdicts = if verdict & TUPLE_VERDICTS != 0 { verdict } else { verdict | probe.noted };
    if slot.key == key && slot.generation == probe.generation && now.wrapping_sub(slot.since) < TTL_JIFFIES {
        slot.verdicts |= verdicts;
    } else {
        slot.key = key;
        slot.generation = probe.generation;
        slot.since = now;
        slot.verdicts = verdicts;
    }
    count(plain_stat::REMEMBERED);
}

/// `remember` for the reverse of this run's tuple (its replies'), `verdict` tuple verdicts.
#[inline(never)]
pub fn remember_reverse(verdict: u32) {
    if verdict == 0 {
        return;
    }
    let Some(probe) = PROBE.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: per-CPU map memory, written by this run's `known`; used by this run only.
    let probe = unsafe { &mut *probe };
    let key = probe.key;
    // The ports are two 16-bit halves: a rotation swaps them, whatever the byte order.
    probe.key = Key { src: key.dst, dst: key.src, ports: key.ports.rotate_left(16), ..key };
    remember(verdict);
    probe.key = key;
}

/// Something a remembered verdict may rest on changed (written before this): every verdict is
/// forgotten. `now`: `bpf_ktime_get_ns`.
///
/// The generation is not a counter (the BPF target has no atomic add in Rust's core, and two
/// CPUs adding at once would write one value twice): each writer writes a value no writer wrote
/// before, its clock with its tag below it (the CPU here, `0xff` for the agent), so that a
/// verdict remembered under any value overwritten since is never trusted again.
#[inline(always)]
pub fn forget_all(now: u64) {
    if let Some(at) = GENERATION.get_ptr_mut(0) {
        let cpu = unsafe { aya_ebpf::helpers::bpf_get_smp_processor_id() } as u64 & 0x7f;
        // SAFETY: map memory, valid for this run.
        unsafe { core::ptr::write_volatile(at, now << 8 | cpu) };
    }
}
