//! The conntrack garbage collector on the real pinned maps (the load balancer's `ct_v4` and the
//! policy's `pol_ct_v4`): entries idle past their lifetime go, live ones stay. Needs root.
use std::path::PathBuf;

use aya::maps::{HashMap, Map, MapData};
use kube_router::bpf::datapath::{self, Datapath};
use kube_router::pinned::conntrack_gc::monotonic_now_ns;
use kube_router::policy::maps::PolicyConntrack;
use kube_router::services::maps::conntrack::Conntrack;
use kube_router_common::{
    map_names, CtKeyV4, CtValueV4, PolicyCtKeyV4, PolicyCtValue, CT_FLAG_CLOSING, CT_FLAG_FORWARD, CT_FLAG_SEEN_REPLY,
    CT_LIFETIME_CLOSING_SECS, CT_LIFETIME_NON_TCP_SECS, CT_LIFETIME_TCP_SECS, CT_LIFETIME_UNREPLIED_SECS, IPPROTO_TCP,
    IPPROTO_UDP, POLICY_CT_CLOSING,
};

const SEC: u64 = 1_000_000_000;

struct Loaded {
    _datapath: Datapath,
    pin_dir: PathBuf,
}

impl Drop for Loaded {
    fn drop(&mut self) {
        let _ = datapath::remove_all(&self.pin_dir);
    }
}

fn load(test: &str) -> Loaded {
    let pin_dir = PathBuf::from(format!("/sys/fs/bpf/krt-unit-gc-{test}"));
    let _ = datapath::remove_all(&pin_dir);
    Loaded { _datapath: Datapath::load(&pin_dir).expect("load datapath (run as root)"), pin_dir }
}

fn pinned<K: aya::Pod, V: aya::Pod>(pin_dir: &std::path::Path, name: &str) -> HashMap<MapData, K, V> {
    let data = MapData::from_pin(kube_router::pinned::pinned_map(pin_dir, name)).unwrap();
    HashMap::try_from(Map::LruHashMap(data)).unwrap()
}

/// (protocol, closing, idle seconds, expected to stay): each lifetime just passed, and not yet.
const CASES: [(u8, bool, u64, bool); 6] = [
    (IPPROTO_TCP, false, CT_LIFETIME_TCP_SECS - 60, true),
    (IPPROTO_TCP, false, CT_LIFETIME_TCP_SECS + 60, false),
    (IPPROTO_TCP, true, CT_LIFETIME_CLOSING_SECS - 5, true),
    (IPPROTO_TCP, true, CT_LIFETIME_CLOSING_SECS + 5, false),
    (IPPROTO_UDP, false, CT_LIFETIME_NON_TCP_SECS - 20, true),
    (IPPROTO_UDP, false, CT_LIFETIME_NON_TCP_SECS + 20, false),
];

/// A clock reading past every case's age, whatever the machine's uptime (a freshly booted
/// machine's monotonic clock is younger than the longest lifetime).
fn gc_clock() -> u64 {
    monotonic_now_ns() + (CT_LIFETIME_TCP_SECS + 3_600) * SEC
}

#[test]
fn service_conntrack_entries_past_their_lifetime_are_removed_and_live_ones_kept() {
    let loaded = load("lb");
    let mut map: HashMap<MapData, CtKeyV4, CtValueV4> = pinned(&loaded.pin_dir, map_names::CONNTRACK);
    let now = gc_clock();
    let key = |i: usize, proto: u8| CtKeyV4 {
        src_addr: u32::from_ne_bytes([10, 1, 0, 7]),
        dst_addr: u32::from_ne_bytes([10, 96, 0, 10]),
        src_port: (40_000 + i as u16).to_be(),
        dst_port: 80u16.to_be(),
        proto,
        pad: [0; 3],
    };
    for (i, (proto, closing, idle, _)) in CASES.iter().enumerate() {
        let flags = CT_FLAG_FORWARD | CT_FLAG_SEEN_REPLY | if *closing { CT_FLAG_CLOSING } else { 0 };
        let value = CtValueV4 {
            last_seen_ns: now - idle * SEC,
            nat_src_addr: 0,
            nat_dst_addr: u32::from_ne_bytes([10, 0, 0, 1]),
            nat_src_port: 0,
            nat_dst_port: 8080u16.to_be(),
            flags,
            pad: 0,
            service_id: 1,
            backend_id: 1,
        };
        map.insert(key(i, *proto), value, 0).unwrap();
    }
    // A TCP flow nothing answered (a SYN flood's) lives the unreplied lifetime, not the TCP one.
    for (i, (idle, _)) in UNREPLIED_TCP_CASES.iter().enumerate() {
        let value = CtValueV4 {
            last_seen_ns: now - idle * SEC,
            nat_src_addr: 0,
            nat_dst_addr: u32::from_ne_bytes([10, 0, 0, 1]),
            nat_src_port: 0,
            nat_dst_port: 8080u16.to_be(),
            flags: CT_FLAG_FORWARD,
            pad: 0,
            service_id: 1,
            backend_id: 1,
        };
        map.insert(key(CASES.len() + i, IPPROTO_TCP), value, 0).unwrap();
    }
    let (left, removed) = Conntrack::open_pinned(&loaded.pin_dir).unwrap().collect_garbage_at(now).unwrap();
    assert_eq!((left, removed), (4, 4));
    for (i, (proto, _, _, stays)) in CASES.iter().enumerate() {
        assert_eq!(map.get(&key(i, *proto), 0).is_ok(), *stays, "case {i}: {:?}", CASES[i]);
    }
    for (i, (idle, stays)) in UNREPLIED_TCP_CASES.iter().enumerate() {
        let present = map.get(&key(CASES.len() + i, IPPROTO_TCP), 0).is_ok();
        assert_eq!(present, *stays, "unreplied TCP, idle {idle} s");
    }
}

/// (idle seconds, expected to stay) of a TCP entry without a reply.
const UNREPLIED_TCP_CASES: [(u64, bool); 2] =
    [(CT_LIFETIME_UNREPLIED_SECS - 20, true), (CT_LIFETIME_UNREPLIED_SECS + 20, false)];

#[test]
fn policy_conntrack_entries_past_their_lifetime_are_removed_and_live_ones_kept() {
    let loaded = load("pol");
    let mut map: HashMap<MapData, PolicyCtKeyV4, PolicyCtValue> = pinned(&loaded.pin_dir, map_names::POLICY_CONNTRACK);
    let now = gc_clock();
    let key = |i: usize, proto: u8| PolicyCtKeyV4 {
        pod_addr: u32::from_ne_bytes([10, 244, 1, 2]),
        peer_addr: u32::from_ne_bytes([10, 244, 2, 2]),
        pod_port: 8080u16.to_be(),
        peer_port: (40_000 + i as u16).to_be(),
        proto,
        pad: [0; 3],
    };
    for (i, (proto, closing, idle, _)) in CASES.iter().enumerate() {
        let flags = if *closing { POLICY_CT_CLOSING } else { 0 };
        map.insert(key(i, *proto), PolicyCtValue { last_seen_ns: now - idle * SEC, flags, pad: [0; 7] }, 0).unwrap();
    }
    let (left, removed) = PolicyConntrack::open_pinned(&loaded.pin_dir).unwrap().collect_garbage_at(now).unwrap();
    assert_eq!((left, removed), (3, 3));
    for (i, (proto, _, _, stays)) in CASES.iter().enumerate() {
        assert_eq!(map.get(&key(i, *proto), 0).is_ok(), *stays, "case {i}: {:?}", CASES[i]);
    }
}
