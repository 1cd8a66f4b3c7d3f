//! The two address families the Service maps exist for. The compiler, differ and sync run once
//! per family over the same model; each family has its own maps, so its own service and backend
//! IDs (a dual-stack Service has one id in each).
use std::{
    fmt::{Debug, Display},
    hash::Hash,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use kube_router_common::{map_names, svc_stats_map_names, Ipv6Words};
use serde::{Deserialize, Serialize};

/// An IP family as a Service's `spec.ipFamilies` names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum IpFamily {
    IPv4,
    IPv6,
}

impl IpFamily {
    pub fn of(addr: &IpAddr) -> Self {
        if addr.is_ipv4() {
            IpFamily::IPv4
        } else {
            IpFamily::IPv6
        }
    }

    pub fn from_k8s(name: &str) -> Option<Self> {
        match name {
            "IPv4" => Some(IpFamily::IPv4),
            "IPv6" => Some(IpFamily::IPv6),
            _ => None,
        }
    }
}

/// A map address's bytes as in packets (what Maglev hashes and orders backends by).
pub trait AddrBytes {
    fn packet_bytes(&self) -> Vec<u8>;
}

impl AddrBytes for u32 {
    fn packet_bytes(&self) -> Vec<u8> {
        self.to_ne_bytes().to_vec()
    }
}

impl AddrBytes for Ipv6Words {
    fn packet_bytes(&self) -> Vec<u8> {
        self.octets().to_vec()
    }
}

/// The names of one family's Service maps.
#[derive(Clone, Copy, Debug)]
pub struct FamilyMaps {
    pub services: &'static str,
    pub slots: &'static str,
    pub backends: &'static str,
    pub source_ranges: &'static str,
    pub stats: &'static str,
    pub conntrack: &'static str,
    pub cluster_nets: &'static str,
}

/// One address family: its addresses, prefixes, their map encoding (network byte order words)
/// and its maps.
pub trait AddressFamily: Copy + Debug + Default + PartialEq + Eq + PartialOrd + Ord + Hash + 'static {
    type Addr: Copy + Ord + Debug + Display + Into<IpAddr>;
    /// The address as the maps hold it: `u32` or [`Ipv6Words`].
    type Words: Copy + Ord + Hash + Debug + Default + AddrBytes + 'static;
    type Net: Copy + Ord + Debug + Display + Default;
    const FAMILY: IpFamily;
    const UNSPECIFIED: Self::Addr;
    /// The greatest value of [`Self::Words`] (the upper end of a key range).
    const WORDS_MAX: Self::Words;
    const MAPS: FamilyMaps;
    fn addr_of(addr: IpAddr) -> Option<Self::Addr>;
    fn net_of(net: IpNet) -> Option<Self::Net>;
    fn words(addr: Self::Addr) -> Self::Words;
    fn addr_from_words(words: Self::Words) -> Self::Addr;
    fn net_addr(net: Self::Net) -> Self::Addr;
    fn net_prefix_len(net: Self::Net) -> u8;
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct V4;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct V6;

impl AddressFamily for V4 {
    type Addr = Ipv4Addr;
    type Words = u32;
    type Net = Ipv4Net;
    const FAMILY: IpFamily = IpFamily::IPv4;
    const UNSPECIFIED: Ipv4Addr = Ipv4Addr::UNSPECIFIED;
    const WORDS_MAX: u32 = u32::MAX;
    const MAPS: FamilyMaps = FamilyMaps {
        services: map_names::SERVICES,
        slots: map_names::BACKEND_SLOTS,
        backends: map_names::BACKENDS,
        source_ranges: map_names::SOURCE_RANGES,
        stats: svc_stats_map_names::SVC_STATS,
        conntrack: map_names::CONNTRACK,
        cluster_nets: map_names::CLUSTER_NETS,
    };
    fn addr_of(addr: IpAddr) -> Option<Ipv4Addr> {
        match addr {
            IpAddr::V4(v4) => Some(v4),
            IpAddr::V6(_) => None,
        }
    }
    fn net_of(net: IpNet) -> Option<Ipv4Net> {
        match net {
            IpNet::V4(v4) => Some(v4),
            IpNet::V6(_) => None,
        }
    }
    fn words(addr: Ipv4Addr) -> u32 {
        u32::from_ne_bytes(addr.octets())
    }
    fn addr_from_words(words: u32) -> Ipv4Addr {
        Ipv4Addr::from(words.to_ne_bytes())
    }
    fn net_addr(net: Ipv4Net) -> Ipv4Addr {
        net.network()
    }
    fn net_prefix_len(net: Ipv4Net) -> u8 {
        net.prefix_len()
    }
}

impl AddressFamily for V6 {
    type Addr = Ipv6Addr;
    type Words = Ipv6Words;
    type Net = Ipv6Net;
    const FAMILY: IpFamily = IpFamily::IPv6;
    const UNSPECIFIED: Ipv6Addr = Ipv6Addr::UNSPECIFIED;
    const WORDS_MAX: Ipv6Words = Ipv6Words([u32::MAX; 4]);
    const MAPS: FamilyMaps = FamilyMaps {
        services: map_names::SERVICES_V6,
        slots: map_names::BACKEND_SLOTS_V6,
        backends: map_names::BACKENDS_V6,
        source_ranges: map_names::SOURCE_RANGES_V6,
        stats: svc_stats_map_names::SVC_STATS_V6,
        conntrack: map_names::CONNTRACK_V6,
        cluster_nets: map_names::CLUSTER_NETS_V6,
    };
    fn addr_of(addr: IpAddr) -> Option<Ipv6Addr> {
        match addr {
            IpAddr::V6(v6) => Some(v6),
            IpAddr::V4(_) => None,
        }
    }
    fn net_of(net: IpNet) -> Option<Ipv6Net> {
        match net {
            IpNet::V6(v6) => Some(v6),
            IpNet::V4(_) => None,
        }
    }
    fn words(addr: Ipv6Addr) -> Ipv6Words {
        Ipv6Words::from_octets(addr.octets())
    }
    fn addr_from_words(words: Ipv6Words) -> Ipv6Addr {
        Ipv6Addr::from(words.octets())
    }
    fn net_addr(net: Ipv6Net) -> Ipv6Addr {
        net.network()
    }
    fn net_prefix_len(net: Ipv6Net) -> u8 {
        net.prefix_len()
    }
}
