//! Backend choice for a new flow: ClientIP affinity, else a random slot of the service. Shared by
//! every hook that load-balances (TC today, socket and XDP hooks later), so they all choose alike.
use aya_ebpf::helpers::bpf_get_prandom_u32;
use kube_router_common::*;

use crate::maps::{count, AFFINITY, BACKENDS, BACKEND_SLOTS};

#[inline(always)]
pub fn backend_in_slot(service_id: u32, slot: u32) -> Option<(u32, BackendV4)> {
    let key = BackendSlotKey { service_id, slot };
    // SAFETY: read-only copies of map values.
    let backend_id = unsafe { BACKEND_SLOTS.get(key) }?.backend_id;
    let backend = unsafe { BACKENDS.get(backend_id) }?;
    Some((backend_id, *backend))
}

#[inline(always)]
pub fn select_backend(client_addr: u32, service: &ServiceValue, now: u64) -> Option<(u32, BackendV4)> {
    if service.backend_count == 0 {
        return None;
    }
    let affinity = service.flags & SVC_FLAG_AFFINITY != 0;
    let affinity_key = AffinityKeyV4 { client_addr, service_id: service.service_id };
    if affinity {
        if let Some(chosen) = affine_backend(&affinity_key, service, now) {
            count(lb_stat::AFFINITY_HIT);
            return Some(chosen);
        }
    }
    let slot = unsafe { bpf_get_prandom_u32() } % service.backend_count;
    let chosen = backend_in_slot(service.service_id, slot)?;
    if affinity {
        let value = AffinityValue { last_used_ns: now, backend_id: chosen.0, slot };
        let _ = AFFINITY.insert(affinity_key, value, 0);
    }
    Some(chosen)
}

/// The backend this client used last, if that was within the affinity timeout and the backend
/// still holds the same slot of this service (so a removed backend is never chosen again).
#[inline(always)]
fn affine_backend(key: &AffinityKeyV4, service: &ServiceValue, now: u64) -> Option<(u32, BackendV4)> {
    let entry = AFFINITY.get_ptr_mut(key)?;
    // SAFETY: pointer from a successful lookup, valid for this run.
    let entry = unsafe { &mut *entry };
    let timeout_ns = service.affinity_timeout_secs as u64 * 1_000_000_000;
    if now.saturating_sub(entry.last_used_ns) > timeout_ns {
        return None;
    }
    let (backend_id, backend) = backend_in_slot(service.service_id, entry.slot)?;
    if backend_id != entry.backend_id {
        return None;
    }
    entry.last_used_ns = now;
    Some((backend_id, backend))
}
