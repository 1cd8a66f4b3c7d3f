//! Our own BGP message model, deliberately independent of any codec crate so
//! the FSM and RIB can be tested (and the codec swapped) in isolation.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

pub const BGP_VERSION: u8 = 4;
/// RFC 6793: placeholder put in 2-octet AS fields when the real ASN needs 4.
pub const AS_TRANS: u16 = 23456;

/// Address Family Identifier (RFC 4760). Unknown values are kept, not
/// rejected, because a peer may legitimately offer families we ignore.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Afi {
    Ipv4,
    Ipv6,
    Other(u16),
}

impl Afi {
    pub fn from_u16(value: u16) -> Self {
        match value {
            1 => Afi::Ipv4,
            2 => Afi::Ipv6,
            other => Afi::Other(other),
        }
    }
    pub fn to_u16(self) -> u16 {
        match self {
            Afi::Ipv4 => 1,
            Afi::Ipv6 => 2,
            Afi::Other(v) => v,
        }
    }
}

/// Subsequent Address Family Identifier (RFC 4760).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Safi {
    Unicast,
    Multicast,
    Other(u8),
}

impl Safi {
    pub fn from_u8(value: u8) -> Self {
        match value {
            1 => Safi::Unicast,
            2 => Safi::Multicast,
            other => Safi::Other(other),
        }
    }
    pub fn to_u8(self) -> u8 {
        match self {
            Safi::Unicast => 1,
            Safi::Multicast => 2,
            Safi::Other(v) => v,
        }
    }
}

/// The address families this core actually routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    Ipv4Unicast,
    Ipv6Unicast,
}

impl Family {
    pub const ALL: [Family; 2] = [Family::Ipv4Unicast, Family::Ipv6Unicast];

    pub fn from_afi_safi(afi: Afi, safi: Safi) -> Option<Self> {
        match (afi, safi) {
            (Afi::Ipv4, Safi::Unicast) => Some(Family::Ipv4Unicast),
            (Afi::Ipv6, Safi::Unicast) => Some(Family::Ipv6Unicast),
            _ => None,
        }
    }
    pub fn afi(self) -> Afi {
        match self {
            Family::Ipv4Unicast => Afi::Ipv4,
            Family::Ipv6Unicast => Afi::Ipv6,
        }
    }
    pub fn safi(self) -> Safi {
        Safi::Unicast
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PrefixError {
    #[error("prefix length {len} exceeds {max}")]
    LengthTooLong { len: u8, max: u8 },
    #[error("cannot parse prefix {0:?}")]
    Syntax(String),
}

/// An IP prefix. Host bits are always zero (normalised on construction), so
/// equal networks compare equal regardless of how they were written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Prefix {
    V4 { addr: Ipv4Addr, len: u8 },
    V6 { addr: Ipv6Addr, len: u8 },
}

impl Prefix {
    pub fn new(addr: IpAddr, len: u8) -> Result<Self, PrefixError> {
        match addr {
            IpAddr::V4(a) => {
                if len > 32 {
                    return Err(PrefixError::LengthTooLong { len, max: 32 });
                }
                let mask = u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0);
                Ok(Prefix::V4 { addr: Ipv4Addr::from(u32::from(a) & mask), len })
            }
            IpAddr::V6(a) => {
                if len > 128 {
                    return Err(PrefixError::LengthTooLong { len, max: 128 });
                }
                let mask = u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0);
                Ok(Prefix::V6 { addr: Ipv6Addr::from(u128::from(a) & mask), len })
            }
        }
    }
    pub fn addr(&self) -> IpAddr {
        match *self {
            Prefix::V4 { addr, .. } => IpAddr::V4(addr),
            Prefix::V6 { addr, .. } => IpAddr::V6(addr),
        }
    }
    pub fn prefix_len(&self) -> u8 {
        match *self {
            Prefix::V4 { len, .. } | Prefix::V6 { len, .. } => len,
        }
    }
    pub fn family(&self) -> Family {
        match self {
            Prefix::V4 { .. } => Family::Ipv4Unicast,
            Prefix::V6 { .. } => Family::Ipv6Unicast,
        }
    }
}

impl fmt::Display for Prefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr(), self.prefix_len())
    }
}

impl FromStr for Prefix {
    type Err = PrefixError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let syntax = || PrefixError::Syntax(s.to_string());
        let (addr, len) = s.split_once('/').ok_or_else(syntax)?;
        let addr: IpAddr = addr.parse().map_err(|_| syntax())?;
        let len: u8 = len.parse().map_err(|_| syntax())?;
        Prefix::new(addr, len)
    }
}

/// Next hop of an announced prefix. IPv6 may carry a link-local address in
/// addition to the global one (RFC 2545).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum NextHop {
    V4(Ipv4Addr),
    V6 { global: Ipv6Addr, link_local: Option<Ipv6Addr> },
}

impl NextHop {
    pub fn addr(&self) -> IpAddr {
        match *self {
            NextHop::V4(a) => IpAddr::V4(a),
            NextHop::V6 { global, .. } => IpAddr::V6(global),
        }
    }
}

impl From<IpAddr> for NextHop {
    fn from(addr: IpAddr) -> Self {
        match addr {
            IpAddr::V4(a) => NextHop::V4(a),
            IpAddr::V6(global) => NextHop::V6 { global, link_local: None },
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GracefulRestartFamily {
    pub afi: Afi,
    pub safi: Safi,
    /// F-bit: forwarding state for this family survived the restart.
    pub forwarding_preserved: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GracefulRestartCapability {
    /// R-bit: the sender has just restarted (RFC 4724 §3).
    pub restart_state: bool,
    /// 12-bit field on the wire; larger values are clamped when encoding.
    pub restart_time_secs: u16,
    pub families: Vec<GracefulRestartFamily>,
}

pub const MAX_RESTART_TIME_SECS: u16 = 0x0fff;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Capability {
    MultiProtocol(Afi, Safi),
    FourOctetAs(u32),
    RouteRefresh,
    GracefulRestart(GracefulRestartCapability),
    /// Anything we do not interpret; kept so it is visible to the agent.
    Unknown {
        code: u8,
        value: Vec<u8>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Open {
    pub version: u8,
    /// The real (possibly 4-octet) ASN. On the wire the 2-octet field carries
    /// AS_TRANS when this exceeds 65535 and the FourOctetAs capability
    /// carries the real value.
    pub my_asn: u32,
    pub hold_time: u16,
    pub router_id: Ipv4Addr,
    pub capabilities: Vec<Capability>,
}

impl Open {
    /// Value for the 2-octet "My Autonomous System" field.
    pub fn two_octet_asn(&self) -> u16 {
        u16::try_from(self.my_asn).unwrap_or(AS_TRANS)
    }
    pub fn four_octet_asn_capability(&self) -> Option<u32> {
        self.capabilities.iter().find_map(|c| match c {
            Capability::FourOctetAs(asn) => Some(*asn),
            _ => None,
        })
    }
    pub fn graceful_restart(&self) -> Option<&GracefulRestartCapability> {
        self.capabilities.iter().find_map(|c| match c {
            Capability::GracefulRestart(gr) => Some(gr),
            _ => None,
        })
    }
    pub fn multiprotocol(&self) -> impl Iterator<Item = (Afi, Safi)> + '_ {
        self.capabilities.iter().filter_map(|c| match c {
            Capability::MultiProtocol(afi, safi) => Some((*afi, *safi)),
            _ => None,
        })
    }
    pub fn supports_route_refresh(&self) -> bool {
        self.capabilities.contains(&Capability::RouteRefresh)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum Origin {
    #[default]
    Igp = 0,
    Egp = 1,
    Incomplete = 2,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum AsPathSegment {
    Sequence(Vec<u32>),
    Set(Vec<u32>),
}

/// AS path length as used by best-path selection: an AS_SET counts as one
/// hop regardless of its size (RFC 4271 §9.1.2.2 a).
pub fn as_path_length(path: &[AsPathSegment]) -> usize {
    path.iter()
        .map(|s| match s {
            AsPathSegment::Sequence(asns) => asns.len(),
            AsPathSegment::Set(_) => 1,
        })
        .sum()
}

/// The AS we learned the route from (first AS of a leading AS_SEQUENCE), or
/// None for routes originated inside our own AS.
pub fn neighbour_as(path: &[AsPathSegment]) -> Option<u32> {
    match path.first() {
        Some(AsPathSegment::Sequence(asns)) => asns.first().copied(),
        _ => None,
    }
}

pub fn as_path_contains(path: &[AsPathSegment], asn: u32) -> bool {
    path.iter().any(|s| match s {
        AsPathSegment::Sequence(a) | AsPathSegment::Set(a) => a.contains(&asn),
    })
}

/// An optional attribute we do not understand but may have to pass on.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct UnknownAttribute {
    pub code: u8,
    pub transitive: bool,
    pub partial: bool,
    pub value: Vec<u8>,
}

/// Path attributes shared by all prefixes announced in one UPDATE. The next
/// hop is not here: it is per announced prefix (MP_REACH semantics).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct PathAttributes {
    pub origin: Origin,
    pub as_path: Vec<AsPathSegment>,
    pub med: Option<u32>,
    pub local_pref: Option<u32>,
    pub atomic_aggregate: bool,
    pub communities: Vec<u32>,
    /// RFC 4456 route-reflection attributes.
    pub originator_id: Option<Ipv4Addr>,
    pub cluster_list: Vec<Ipv4Addr>,
    pub unknown: Vec<UnknownAttribute>,
}

/// A reachability change. IPv4 and IPv6 are modelled identically (RFC 4760
/// semantics); the codec decides between classic NLRI and MP_REACH.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Update {
    pub withdrawn: Vec<Prefix>,
    pub announced: Vec<(Prefix, NextHop)>,
    /// Meaningful only when `announced` is non-empty.
    pub attributes: PathAttributes,
}

impl Update {
    pub fn is_empty(&self) -> bool {
        self.withdrawn.is_empty() && self.announced.is_empty()
    }
}

pub mod error_code {
    pub const MESSAGE_HEADER: u8 = 1;
    pub const OPEN_MESSAGE: u8 = 2;
    pub const UPDATE_MESSAGE: u8 = 3;
    pub const HOLD_TIMER_EXPIRED: u8 = 4;
    pub const FSM: u8 = 5;
    pub const CEASE: u8 = 6;
    pub const ROUTE_REFRESH: u8 = 7;
}

pub mod open_subcode {
    pub const UNSPECIFIC: u8 = 0;
    pub const UNSUPPORTED_VERSION: u8 = 1;
    pub const BAD_PEER_AS: u8 = 2;
    pub const BAD_BGP_IDENTIFIER: u8 = 3;
    pub const UNSUPPORTED_OPTIONAL_PARAMETER: u8 = 4;
    pub const UNACCEPTABLE_HOLD_TIME: u8 = 6;
    pub const UNSUPPORTED_CAPABILITY: u8 = 7;
}

pub mod fsm_subcode {
    pub const UNSPECIFIED: u8 = 0;
    pub const UNEXPECTED_IN_OPEN_SENT: u8 = 1;
    pub const UNEXPECTED_IN_OPEN_CONFIRM: u8 = 2;
    pub const UNEXPECTED_IN_ESTABLISHED: u8 = 3;
}

pub mod cease_subcode {
    pub const MAX_PREFIXES: u8 = 1;
    pub const ADMINISTRATIVE_SHUTDOWN: u8 = 2;
    pub const PEER_DECONFIGURED: u8 = 3;
    pub const ADMINISTRATIVE_RESET: u8 = 4;
    pub const CONNECTION_REJECTED: u8 = 5;
    pub const OTHER_CONFIGURATION_CHANGE: u8 = 6;
    pub const CONNECTION_COLLISION_RESOLUTION: u8 = 7;
    pub const OUT_OF_RESOURCES: u8 = 8;
    pub const HARD_RESET: u8 = 9;
    /// RFC 9384.
    pub const BFD_DOWN: u8 = 10;
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    pub code: u8,
    pub subcode: u8,
    pub data: Vec<u8>,
}

impl Notification {
    pub fn new(code: u8, subcode: u8, data: Vec<u8>) -> Self {
        Self { code, subcode, data }
    }
    pub fn hold_timer_expired() -> Self {
        Self::new(error_code::HOLD_TIMER_EXPIRED, 0, Vec::new())
    }
    pub fn open_error(subcode: u8, data: Vec<u8>) -> Self {
        Self::new(error_code::OPEN_MESSAGE, subcode, data)
    }
    pub fn fsm_error(subcode: u8) -> Self {
        Self::new(error_code::FSM, subcode, Vec::new())
    }
    pub fn cease(subcode: u8) -> Self {
        Self::new(error_code::CEASE, subcode, Vec::new())
    }
    /// RFC 4486 §4: Cease "Maximum Number of Prefixes Reached" with its optional data: AFI (2
    /// octets), SAFI (1) and the upper bound (4).
    pub fn max_prefixes(family: Family, limit: u32) -> Self {
        let mut data = Vec::with_capacity(7);
        data.extend_from_slice(&family.afi().to_u16().to_be_bytes());
        data.push(family.safi().to_u8());
        data.extend_from_slice(&limit.to_be_bytes());
        Self::new(error_code::CEASE, cease_subcode::MAX_PREFIXES, data)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    Open(Open),
    Update(Update),
    /// RFC 4724 End-of-RIB marker: an empty UPDATE for IPv4 unicast, an
    /// UPDATE with only an empty MP_UNREACH for every other family.
    EndOfRib(Afi, Safi),
    Notification(Notification),
    Keepalive,
    RouteRefresh(Afi, Safi),
}

impl Message {
    pub fn end_of_rib(family: Family) -> Self {
        Message::EndOfRib(family.afi(), family.safi())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_normalises_host_bits_and_rejects_long_lengths() {
        let p: Prefix = "10.1.2.3/16".parse().unwrap();
        assert_eq!(p.to_string(), "10.1.0.0/16");
        let p6: Prefix = "2001:db8::1/32".parse().unwrap();
        assert_eq!(p6.to_string(), "2001:db8::/32");
        assert_eq!("0.0.0.0/0".parse::<Prefix>().unwrap().prefix_len(), 0);
        assert!("10.0.0.0/33".parse::<Prefix>().is_err());
        assert!("::/129".parse::<Prefix>().is_err());
        assert!("garbage".parse::<Prefix>().is_err());
    }

    #[test]
    fn as_trans_used_for_large_asn() {
        let mut open = Open {
            version: 4,
            my_asn: 4_200_000_000,
            hold_time: 90,
            router_id: Ipv4Addr::new(1, 1, 1, 1),
            capabilities: vec![],
        };
        assert_eq!(open.two_octet_asn(), AS_TRANS);
        open.my_asn = 64512;
        assert_eq!(open.two_octet_asn(), 64512);
    }

    #[test]
    fn as_path_length_counts_set_as_one() {
        let path = vec![AsPathSegment::Sequence(vec![1, 2, 3]), AsPathSegment::Set(vec![4, 5, 6])];
        assert_eq!(as_path_length(&path), 4);
        assert_eq!(neighbour_as(&path), Some(1));
        assert!(as_path_contains(&path, 5));
        assert_eq!(neighbour_as(&[]), None);
    }
}
