//! The load balancer's gate in front of its conntrack lookup (`kube-router-ebpf/src/gate.rs`):
//! a packet none of whose endpoints is a frontend, a recorded Service endpoint (`ct_gate_v4/v6`),
//! the node's SNAT address or (with pod egress masquerade) outside the cluster passes without a
//! lookup. The datapath records a Service flow's endpoints before its entries; entries it did not
//! write (an older release's, before an upgrade) have none, so the agent keeps the gate closed
//! (`META_LB_GATE` = 0) from before it attaches its programs until it has recorded the endpoints
//! of every entry it finds once they all run ours.
use std::path::Path;

use anyhow::{Context, Result};
use aya::maps::{Array, HashMap, Map, MapData};
use kube_router_common::*;

use crate::pinned::open_pinned as open_map;

fn set(pin_dir: &Path, open: bool) -> Result<()> {
    let mut meta: Array<MapData, u32> = Array::try_from(Map::Array(open_map(pin_dir, map_names::META)?))?;
    meta.set(META_LB_GATE, u32::from(open), 0).context("writing the gate flag in meta")?;
    crate::pinned::plain::forget_all(pin_dir);
    Ok(())
}

/// Every packet takes the conntrack lookup again (the datapath before the gate).
pub fn close(pin_dir: &Path) -> Result<()> {
    set(pin_dir, false)
}

/// Records the endpoints of every Service flow in `ct_v4/v6` (frontend and backend), then opens
/// the gate. Call once every link runs this release's programs. Returns the endpoints added.
pub fn open(pin_dir: &Path) -> Result<usize> {
    let added = record_family::<u32>(pin_dir, map_names::CONNTRACK, map_names::CT_GATE)?
        + record_family::<Ipv6Words>(pin_dir, map_names::CONNTRACK_V6, map_names::CT_GATE_V6)?;
    set(pin_dir, true)?;
    Ok(added)
}

fn record_family<A>(pin_dir: &Path, conntrack: &str, gate: &str) -> Result<usize>
where
    A: Copy,
    CtKey<A>: aya::Pod,
    CtValue<A>: aya::Pod,
    ServiceKey<A>: aya::Pod,
{
    let entries: HashMap<MapData, CtKey<A>, CtValue<A>> =
        HashMap::try_from(Map::LruHashMap(open_map(pin_dir, conntrack)?))?;
    let mut gate: HashMap<MapData, ServiceKey<A>, u64> = HashMap::try_from(Map::LruHashMap(open_map(pin_dir, gate)?))?;
    let now = crate::pinned::conntrack_gc::monotonic_now_ns();
    let mut added = 0;
    for (key, value) in entries.iter().filter_map(Result::ok) {
        // Masqueraded and untranslated flows (service id 0) are gated by their addresses.
        if value.service_id == 0 {
            continue;
        }
        // A forward entry's key goes to the frontend, its translation to the backend; a reverse
        // entry's key comes from the backend, its translation from the frontend.
        let (frontend, backend) = if value.flags & CT_FLAG_FORWARD != 0 {
            ((key.dst_addr, key.dst_port), (value.nat_dst_addr, value.nat_dst_port))
        } else {
            ((value.nat_src_addr, value.nat_src_port), (key.src_addr, key.src_port))
        };
        for (addr, port) in [frontend, backend] {
            let endpoint = ServiceKey { addr, port, proto: key.proto, pad: 0 };
            // NOEXIST: an endpoint the datapath recorded meanwhile keeps its own record.
            if gate.insert(endpoint, now, BPF_NOEXIST_FLAG).is_ok() {
                added += 1;
            }
        }
    }
    Ok(added)
}

/// `BPF_NOEXIST` (linux/bpf.h).
const BPF_NOEXIST_FLAG: u64 = 1;
