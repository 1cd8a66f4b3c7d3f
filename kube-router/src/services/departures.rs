//! UDP flows the datapath would keep on a backend that left their frontend.
//!
//! The datapath moves a flow only when its backend id no longer names the backend's address and
//! port (`backend_gone` in `kube-router-ebpf/src/lb.rs`). Backend ids are shared by every Service
//! using one `address:port`, so a backend removed from one Service but still backing another keeps
//! its id: a UDP client that never changes its source port (a DNS forwarder) would stay on it. As
//! kube-proxy deletes the conntrack entries of a UDP Service's removed endpoint, the services
//! controller removes those flows' entries after the maps changed; the next datagram is balanced
//! again. Computed from map contents alone, before and after a write, so the incremental compiler
//! looks at the changed Services' frontends only.
use std::collections::{BTreeMap, BTreeSet};

use kube_router_common::*;

use super::{compile::MapContents, family::AddressFamily};

/// A backend that left a UDP frontend while its id still names it (the datapath would keep the
/// frontend's flows on it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Departure<W> {
    pub frontend: ServiceKey<W>,
    /// The backend's address and port, network byte order (as `CtValue::nat_dst_*`).
    pub addr: W,
    pub port: u16,
}

/// The backends (`address:port` -> id) of the frontend whose value is `value`: slots
/// `0..backend_count` only, as the datapath reads them (slots past it may linger before a complete
/// listing allows deletes).
fn members<F: AddressFamily>(contents: &MapContents<F>, value: &ServiceValue) -> BTreeMap<(F::Words, u16), u32> {
    let range = BackendSlotKey { service_id: value.service_id, slot: 0 }..BackendSlotKey {
        service_id: value.service_id,
        slot: value.backend_count,
    };
    // A Maglev table names each backend many times.
    let ids: BTreeSet<u32> = contents.slots.range(range).map(|(_, slot)| slot.backend_id).collect();
    ids.into_iter()
        .filter_map(|id| contents.backends.get(&id).map(|backend| ((backend.addr, backend.port), id)))
        .collect()
}

/// Every backend that leaves one of `before`'s UDP frontends in `after` while keeping its id.
/// `before` may hold only the entries a write touched (an increment's `before`); `after` is looked
/// up, never walked. A backend deleted or whose id now names another address is left out: the
/// datapath moves those flows by itself. Membership is by address and port, not by ids, so a
/// frontend given a new service id over the same backends (a Maglev table rebuilt) moves nothing.
pub fn udp_departures<F: AddressFamily>(
    before: &MapContents<F>,
    after: &MapContents<F>,
) -> BTreeSet<Departure<F::Words>> {
    let mut departures = BTreeSet::new();
    for (frontend, value) in before.services.iter().filter(|(key, _)| key.proto == IPPROTO_UDP) {
        let old = members(before, value);
        if old.is_empty() {
            continue;
        }
        let new = after.services.get(frontend).map(|value| members(after, value)).unwrap_or_default();
        for ((addr, port), id) in old {
            let kept = after.backends.get(&id).is_some_and(|b| b.addr == addr && b.port == port);
            if kept && !new.contains_key(&(addr, port)) {
                departures.insert(Departure { frontend: *frontend, addr, port });
            }
        }
    }
    departures
}

/// Whether a conntrack entry is the forward entry of a flow `departures` moves: client to one of
/// the frontends, translated to the backend that left it.
pub fn departed<W: Copy + Ord>(key: &CtKey<W>, value: &CtValue<W>, departures: &BTreeSet<Departure<W>>) -> bool {
    // Masqueraded pod flows and untranslated direct flows are no Service's.
    let forward = value.flags & (CT_FLAG_FORWARD | CT_FLAG_EGRESS | CT_FLAG_UNTRANSLATED) == CT_FLAG_FORWARD;
    forward
        && key.proto == IPPROTO_UDP
        && departures.contains(&Departure {
            frontend: ServiceKey { addr: key.dst_addr, port: key.dst_port, proto: key.proto, pad: 0 },
            addr: value.nat_dst_addr,
            port: value.nat_dst_port,
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::services::family::V4;

    const A: u32 = 0x0a60_000a;
    const B: u32 = 0x0a60_000b;
    const X: u32 = 0x0a00_0001;
    const Y: u32 = 0x0a00_0002;
    const DNS: u16 = 5353u16.to_be();

    fn frontend(addr: u32, proto: u8) -> ServiceKey<u32> {
        ServiceKey { addr, port: 53u16.to_be(), proto, pad: 0 }
    }

    /// Frontends (address, protocol, service id, backend ids) over backends X (id 1) and Y (id 2).
    fn contents(frontends: &[(u32, u8, u32, &[u32])]) -> MapContents<V4> {
        let mut c = MapContents::<V4>::default();
        c.backends.insert(1, Backend { addr: X, port: DNS, flags: 0 });
        c.backends.insert(2, Backend { addr: Y, port: DNS, flags: 0 });
        for &(addr, proto, service_id, ids) in frontends {
            let value =
                ServiceValue { service_id, backend_count: ids.len() as u32, flags: 0, affinity_timeout_secs: 0 };
            c.services.insert(frontend(addr, proto), value);
            for (slot, id) in ids.iter().enumerate() {
                c.slots.insert(BackendSlotKey { service_id, slot: slot as u32 }, BackendSlotValue { backend_id: *id });
            }
        }
        c
    }

    fn departure(frontend_addr: u32, addr: u32) -> Departure<u32> {
        Departure { frontend: frontend(frontend_addr, IPPROTO_UDP), addr, port: DNS }
    }

    #[test]
    fn a_backend_leaving_one_udp_service_while_backing_another_departs_from_that_one_only() {
        let before = contents(&[(A, IPPROTO_UDP, 1, &[1, 2]), (B, IPPROTO_UDP, 2, &[1, 2])]);
        let after = contents(&[(A, IPPROTO_UDP, 1, &[2]), (B, IPPROTO_UDP, 2, &[1, 2])]);
        assert_eq!(udp_departures(&before, &after), BTreeSet::from([departure(A, X)]));
        // The Service deleted while X still backs B: its flows leave X too.
        let after = contents(&[(B, IPPROTO_UDP, 2, &[1, 2])]);
        assert_eq!(udp_departures(&before, &after), BTreeSet::from([departure(A, X), departure(A, Y)]));
    }

    #[test]
    fn nothing_departs_without_a_udp_backend_leaving_while_programmed() {
        let before = contents(&[(A, IPPROTO_UDP, 1, &[1, 2]), (B, IPPROTO_TCP, 2, &[1, 2])]);
        // TCP: established flows keep their backend (draining).
        let after = contents(&[(A, IPPROTO_UDP, 1, &[1, 2]), (B, IPPROTO_TCP, 2, &[2])]);
        assert!(udp_departures(&before, &after).is_empty());
        // X deleted outright: the datapath sees its id gone and moves the flows itself.
        let mut after = contents(&[(A, IPPROTO_UDP, 1, &[2]), (B, IPPROTO_TCP, 2, &[2])]);
        after.backends.remove(&1);
        assert!(udp_departures(&before, &after).is_empty());
        // X's id now names another endpoint: `backend_gone` again.
        after.backends.insert(1, Backend { addr: 0x0a00_0009, port: DNS, flags: 0 });
        assert!(udp_departures(&before, &after).is_empty());
        // A new service id over the same backends (a rebuilt Maglev table), slots reordered.
        let after = contents(&[(A, IPPROTO_UDP, 7, &[2, 1, 2]), (B, IPPROTO_TCP, 2, &[1, 2])]);
        assert!(udp_departures(&before, &after).is_empty());
        // A backend added.
        let before = contents(&[(A, IPPROTO_UDP, 1, &[2])]);
        let after = contents(&[(A, IPPROTO_UDP, 1, &[2, 1])]);
        assert!(udp_departures(&before, &after).is_empty());
    }

    #[test]
    fn slots_past_the_backend_count_are_not_members() {
        // Before a complete listing the slot past the new count stays: X is out all the same.
        let before = contents(&[(A, IPPROTO_UDP, 1, &[1, 2]), (B, IPPROTO_UDP, 2, &[1])]);
        let mut after = before.clone();
        after.slots.insert(BackendSlotKey { service_id: 1, slot: 0 }, BackendSlotValue { backend_id: 2 });
        after.services.get_mut(&frontend(A, IPPROTO_UDP)).unwrap().backend_count = 1;
        assert_eq!(udp_departures(&before, &after), BTreeSet::from([departure(A, X)]));
    }

    #[test]
    fn only_forward_udp_entries_to_the_frontend_translated_to_that_backend_are_departed() {
        let departures = BTreeSet::from([departure(A, X)]);
        let client = 0x0a00_0102;
        let key = |dst: u32, proto: u8| CtKey {
            src_addr: client,
            dst_addr: dst,
            src_port: 40053u16.to_be(),
            dst_port: 53u16.to_be(),
            proto,
            pad: [0; 3],
        };
        let value = |nat_dst: u32, flags: u16| CtValue {
            last_seen_ns: 0,
            nat_src_addr: client,
            nat_dst_addr: nat_dst,
            nat_src_port: 40053u16.to_be(),
            nat_dst_port: DNS,
            flags,
            pad: 0,
            service_id: 1,
            backend_id: 1,
        };
        assert!(departed(&key(A, IPPROTO_UDP), &value(X, CT_FLAG_FORWARD), &departures));
        assert!(departed(&key(A, IPPROTO_UDP), &value(X, CT_FLAG_FORWARD | CT_FLAG_SEEN_REPLY), &departures));
        // B's flow to X, A's flow to Y, a TCP flow, a reply entry, a masqueraded flow: kept.
        assert!(!departed(&key(B, IPPROTO_UDP), &value(X, CT_FLAG_FORWARD), &departures));
        assert!(!departed(&key(A, IPPROTO_UDP), &value(Y, CT_FLAG_FORWARD), &departures));
        assert!(!departed(&key(A, IPPROTO_TCP), &value(X, CT_FLAG_FORWARD), &departures));
        assert!(!departed(&key(A, IPPROTO_UDP), &value(X, CT_FLAG_REVERSE), &departures));
        assert!(!departed(&key(A, IPPROTO_UDP), &value(X, CT_FLAG_FORWARD | CT_FLAG_EGRESS), &departures));
    }
}
