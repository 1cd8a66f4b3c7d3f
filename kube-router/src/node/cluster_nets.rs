//! `cluster_nets_v4` / `cluster_nets_v6`: the networks inside the cluster (pod CIDRs, node
//! addresses, Service ranges, with `CLUSTER_NET_*` flags) that pod egress masquerade and the load
//! balancer's source NAT treat as inside. Written from the Node objects (`controllers::node_nets`).
use std::{collections::BTreeMap, path::Path};

use anyhow::Result;
use aya::maps::{Map, MapData};
use ipnet::Ipv4Net;

use crate::{
    pinned::open_pinned as open,
    services::family::{AddressFamily, V4},
};

/// Brings `cluster_nets_v4` to `desired` (prefix -> `CLUSTER_NET_*` flags), writing only the
/// differences; returns the number of writes.
pub fn sync_cluster_nets(pin_dir: &Path, desired: &BTreeMap<Ipv4Net, u32>) -> Result<usize> {
    sync_cluster_nets_of::<V4>(pin_dir, desired)
}

/// [`sync_cluster_nets`] for family `F` (`cluster_nets_v4` / `cluster_nets_v6`).
pub fn sync_cluster_nets_of<F: AddressFamily>(pin_dir: &Path, desired: &BTreeMap<F::Net, u32>) -> Result<usize>
where
    F::Words: aya::Pod,
{
    use aya::maps::lpm_trie::{Key, LpmTrie};
    let mut map: LpmTrie<MapData, F::Words, u32> =
        LpmTrie::try_from(Map::LpmTrie(open(pin_dir, F::MAPS.cluster_nets)?))?;
    let key = |net: &F::Net| Key::new(u32::from(F::net_prefix_len(*net)), F::words(F::net_addr(*net)));
    let current: BTreeMap<F::Net, u32> = map
        .iter()
        .filter_map(Result::ok)
        .filter_map(|(k, v)| {
            let addr: std::net::IpAddr = F::addr_from_words(k.data()).into();
            let net = ipnet::IpNet::new(addr, k.prefix_len() as u8).ok()?;
            F::net_of(net).map(|net| (net, v))
        })
        .collect();
    let mut writes = 0;
    let written = (|| -> Result<()> {
        for (net, flags) in desired {
            if current.get(net) != Some(flags) {
                writes += 1;
                map.insert(&key(net), flags, 0)?;
            }
        }
        for net in current.keys().filter(|net| !desired.contains_key(*net)) {
            writes += 1;
            map.remove(&key(net))?;
        }
        Ok(())
    })();
    // What is inside the cluster decides what the load balancer's gate lets pass, even after a
    // write that failed part way.
    if writes > 0 {
        crate::pinned::plain::forget_all(pin_dir);
    }
    written.map(|()| writes)
}

/// Writes `changes` (flags 0: no longer inside) into `cluster_nets_v4` / `cluster_nets_v6`,
/// without reading the map: for a writer that knows what it holds. Returns the writes.
pub fn write_cluster_nets_of<F: AddressFamily>(pin_dir: &Path, changes: &BTreeMap<F::Net, u32>) -> Result<usize>
where
    F::Words: aya::Pod,
{
    use aya::maps::lpm_trie::{Key, LpmTrie};
    if changes.is_empty() {
        return Ok(0);
    }
    let mut map: LpmTrie<MapData, F::Words, u32> =
        LpmTrie::try_from(Map::LpmTrie(open(pin_dir, F::MAPS.cluster_nets)?))?;
    let written = changes.iter().try_for_each(|(net, flags)| {
        let key = Key::new(u32::from(F::net_prefix_len(*net)), F::words(F::net_addr(*net)));
        match flags {
            0 => map.remove(&key),
            flags => map.insert(&key, flags, 0),
        }
    });
    crate::pinned::plain::forget_all(pin_dir);
    written?;
    Ok(changes.len())
}
