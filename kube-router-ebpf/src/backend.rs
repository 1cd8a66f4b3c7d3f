//! Backend choice for a new flow: ClientIP affinity, else a slot of the service: random, or the
//! client's hash into the service's Maglev table. Shared by every hook that load-balances (TC
//! today, socket and XDP hooks later), so they all choose alike.
use aya_ebpf::helpers::bpf_get_prandom_u32;
use kube_router_common::*;

use crate::{family::Family, maps::count};

#[inline(always)]
pub fn backend_in_slot<F: Family>(service_id: u32, slot: u32) -> Option<(u32, Backend<F::Addr>)> {
    let key = BackendSlotKey { service_id, slot };
    // SAFETY: read-only copies of map values.
    let backend_id = unsafe { F::slots().get(key) }?.backend_id;
    let backend = unsafe { F::backends().get(backend_id) }?;
    Some((backend_id, *backend))
}

#[inline(always)]
pub fn select_backend<F: Family>(
    client_addr: F::Addr,
    client_port: u16,
    service: &ServiceValue,
    now: u64,
) -> Option<(u32, Backend<F::Addr>)> {
    if service.backend_count == 0 {
        return None;
    }
    let affinity = service.flags & SVC_FLAG_AFFINITY != 0;
    let affinity_key = AffinityKey { client_addr, service_id: service.service_id };
    if affinity {
        if let Some(chosen) = affine_backend::<F>(&affinity_key, service, now) {
            count(lb_stat::AFFINITY_HIT);
            return Some(chosen);
        }
    }
    let pick = if service.flags & SVC_FLAG_MAGLEV != 0 {
        maglev_flow_hash(&client_addr, client_port, service.flags & SVC_FLAG_MAGLEV_PORT != 0)
    } else {
        unsafe { bpf_get_prandom_u32() }
    };
    let slot = pick % service.backend_count;
    let chosen = backend_in_slot::<F>(service.service_id, slot)?;
    if affinity {
        let value = AffinityValue { last_used_ns: now, backend_id: chosen.0, slot };
        let _ = F::affinity().insert(affinity_key, value, 0);
    }
    Some(chosen)
}

/// The backend this client used last, if that was within the affinity timeout and the backend
/// still holds the same slot of this service (so a removed backend is never chosen again).
#[inline(always)]
fn affine_backend<F: Family>(
    key: &AffinityKey<F::Addr>,
    service: &ServiceValue,
    now: u64,
) -> Option<(u32, Backend<F::Addr>)> {
    let entry = F::affinity().get_ptr_mut(key)?;
    // SAFETY: pointer from a successful lookup, valid for this run.
    let entry = unsafe { &mut *entry };
    let timeout_ns = service.affinity_timeout_secs as u64 * 1_000_000_000;
    if now.saturating_sub(entry.last_used_ns) > timeout_ns {
        return None;
    }
    let (backend_id, backend) = backend_in_slot::<F>(service.service_id, entry.slot)?;
    if backend_id != entry.backend_id {
        return None;
    }
    entry.last_used_ns = now;
    Some((backend_id, backend))
}
