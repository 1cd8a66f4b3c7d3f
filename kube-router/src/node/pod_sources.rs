//! `pod_src`: each pod veth's own addresses, which the datapath allows as the source of the
//! pod's packets (`kube-router-ebpf/src/source_check.rs`, docs/security/spoof.md).
//!
//! The addresses are read from the pod's own network namespace, which a pod without
//! CAP_NET_ADMIN cannot change: the host-side veth names its peer (IFLA_LINK) and the peer's
//! namespace (IFLA_LINK_NETNSID), and RTM_GETADDR with IFA_TARGET_NETNSID (Linux 4.20) dumps that
//! namespace's addresses. Two netlink requests per veth, no namespace switch.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    path::Path,
};

use anyhow::{bail, Context, Result};
use aya::maps::{HashMap, Map, MapData};
use kube_router_common::{source_check_map_names, Ipv6Words, PodSources, POD_SOURCE_ADDRS};
use rtnetlink::{
    packet_core::{NetlinkMessage, NetlinkPayload, NLM_F_DUMP, NLM_F_REQUEST},
    packet_route::{
        address::{AddressAttribute, AddressMessage},
        link::{LinkAttribute, LinkMessage},
        RouteNetlinkMessage,
    },
    sys::{protocols::NETLINK_ROUTE, Socket},
};

/// The addresses a veth's pod has, as read from its namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodAddresses(pub BTreeSet<IpAddr>);

impl PodAddresses {
    /// A global (not link-local) address of either family: the CNI's IPAM has run.
    pub fn assigned(&self) -> bool {
        self.0.iter().any(|a| match a {
            IpAddr::V4(a) => !a.is_link_local(),
            IpAddr::V6(a) => a.segments()[0] & 0xffc0 != 0xfe80,
        })
    }

    /// The `pod_src` value holding these addresses.
    pub fn entry(&self, checked_by: u8) -> PodSources {
        let mut entry = PodSources { checked_by, ..PodSources::default() };
        for addr in &self.0 {
            match addr {
                IpAddr::V4(a) if (entry.v4_count as usize) < POD_SOURCE_ADDRS => {
                    entry.v4[entry.v4_count as usize] = u32::from_ne_bytes(a.octets());
                    entry.v4_count += 1;
                }
                IpAddr::V6(a) if (entry.v6_count as usize) < POD_SOURCE_ADDRS => {
                    let o = a.octets();
                    entry.v6[entry.v6_count as usize] =
                        Ipv6Words(std::array::from_fn(|i| u32::from_ne_bytes(o[i * 4..i * 4 + 4].try_into().unwrap())));
                    entry.v6_count += 1;
                }
                // More than the entry holds: the rest are refused (a pod has one or two).
                _ => {}
            }
        }
        entry
    }
}

/// Synchronous rtnetlink requests (a reply or a dump), answered within a second.
pub struct Resolver {
    socket: Socket,
    sequence: u32,
}

impl Resolver {
    pub fn open() -> Result<Self> {
        let mut socket = Socket::new(NETLINK_ROUTE).context("opening rtnetlink")?;
        socket.bind_auto().context("binding rtnetlink")?;
        // The kernel filters address dumps by interface index.
        socket.set_netlink_get_strict_chk(true).context("netlink strict checking")?;
        let timeout = libc::timeval { tv_sec: 1, tv_usec: 0 };
        // SAFETY: a valid timeval of the size passed, on a socket we own.
        let rc = unsafe {
            use std::os::fd::AsRawFd;
            libc::setsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                std::ptr::addr_of!(timeout).cast(),
                size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error()).context("netlink receive timeout");
        }
        Ok(Self { socket, sequence: 0 })
    }

    fn exchange(&mut self, message: RouteNetlinkMessage, dump: bool) -> Result<Vec<RouteNetlinkMessage>> {
        self.sequence = self.sequence.wrapping_add(1);
        let mut request = NetlinkMessage::from(message);
        request.header.flags = NLM_F_REQUEST | if dump { NLM_F_DUMP } else { 0 };
        request.header.sequence_number = self.sequence;
        request.finalize();
        let mut buf = vec![0; request.buffer_len()];
        request.serialize(&mut buf);
        self.socket.send(&buf, 0).context("netlink send")?;
        let mut replies = Vec::new();
        loop {
            let (data, _) = self.socket.recv_from_full().context("netlink receive")?;
            let mut offset = 0;
            while offset < data.len() {
                let reply = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&data[offset..])
                    .context("decoding a netlink reply")?;
                offset += (reply.header.length as usize).max(16);
                if reply.header.sequence_number != self.sequence {
                    continue;
                }
                match reply.payload {
                    NetlinkPayload::Done(_) => return Ok(replies),
                    NetlinkPayload::Error(e) if e.code.is_some() => return Err(e.to_io().into()),
                    NetlinkPayload::Error(_) => return Ok(replies),
                    NetlinkPayload::InnerMessage(m) => {
                        replies.push(m);
                        if !dump {
                            return Ok(replies);
                        }
                    }
                    _ => {}
                }
            }
        }
    }

    /// The interface the kernel's route to `destination` leaves by (RTM_GETROUTE, as `ip route
    /// get`), if there is a route.
    pub fn route_interface(&mut self, destination: IpAddr) -> Result<Option<u32>> {
        use rtnetlink::packet_route::route::{RouteAddress, RouteAttribute, RouteMessage};
        let mut request = RouteMessage::default();
        let (family, address, prefix) = match destination {
            IpAddr::V4(a) => (rtnetlink::packet_route::AddressFamily::Inet, RouteAddress::Inet(a), 32),
            IpAddr::V6(a) => (rtnetlink::packet_route::AddressFamily::Inet6, RouteAddress::Inet6(a), 128),
        };
        request.header.address_family = family;
        request.header.destination_prefix_length = prefix;
        request.attributes.push(RouteAttribute::Destination(address));
        let replies = match self.exchange(RouteNetlinkMessage::GetRoute(request), false) {
            Ok(replies) => replies,
            // No route (ENETUNREACH, EHOSTUNREACH): nothing leaves by any interface.
            Err(e)
                if matches!(
                    e.downcast_ref::<std::io::Error>().and_then(|e| e.raw_os_error()),
                    Some(libc::ENETUNREACH | libc::EHOSTUNREACH)
                ) =>
            {
                return Ok(None)
            }
            Err(e) => return Err(e),
        };
        Ok(replies.into_iter().find_map(|reply| match reply {
            RouteNetlinkMessage::NewRoute(route) => route.attributes.iter().find_map(|a| match a {
                RouteAttribute::Oif(index) => Some(*index),
                _ => None,
            }),
            _ => None,
        }))
    }

    /// The addresses of the other end of veth `ifindex`, in whichever namespace it is.
    pub fn peer_addresses(&mut self, ifindex: u32) -> Result<PodAddresses> {
        let mut link = LinkMessage::default();
        link.header.index = ifindex;
        let replies = self.exchange(RouteNetlinkMessage::GetLink(link), false)?;
        let Some(RouteNetlinkMessage::NewLink(link)) = replies.into_iter().next() else {
            bail!("no link {ifindex}");
        };
        let mut peer = None;
        let mut netns = None;
        for attribute in &link.attributes {
            match attribute {
                LinkAttribute::Link(index) => peer = Some(*index),
                LinkAttribute::LinkNetNsId(id) => netns = Some(*id),
                _ => {}
            }
        }
        let Some(peer) = peer else { bail!("veth {ifindex} names no peer") };
        let mut request = AddressMessage::default();
        request.header.index = peer;
        if let Some(netns) = netns {
            request.attributes.push(AddressAttribute::TargetNetNsId(netns));
        }
        let mut addresses = BTreeSet::new();
        for reply in self.exchange(RouteNetlinkMessage::GetAddress(request), true)? {
            let RouteNetlinkMessage::NewAddress(address) = reply else { continue };
            if address.header.index != peer {
                continue;
            }
            // IFA_LOCAL is an IPv4 interface's own address (IFA_ADDRESS the peer's on a
            // point-to-point link); IPv6 has IFA_ADDRESS alone.
            let local = address.attributes.iter().find_map(|a| match a {
                AddressAttribute::Local(a) => Some(*a),
                _ => None,
            });
            let any = address.attributes.iter().find_map(|a| match a {
                AddressAttribute::Address(a) => Some(*a),
                _ => None,
            });
            if let Some(addr) = local.or(any) {
                addresses.insert(addr);
            }
        }
        Ok(PodAddresses(addresses))
    }
}

/// One veth's state: what its entry holds and whether that can still change.
struct Veth {
    addresses: PodAddresses,
    /// When `addresses` were first read as they are.
    since: std::time::Instant,
    /// Read alike, with an address assigned, [`SETTLE_TIME`] apart: the CNI plugin is done with
    /// the namespace.
    settled: bool,
}

/// How long a veth's addresses must stay as they are before it is read no more. A CNI plugin
/// adds a dual-stack pod's addresses one after the other, milliseconds apart: two reads that
/// close (its link event, then its Pod's) saw only the IPv4 one, alike, and the pod's IPv6
/// traffic was dropped until the agent restarted.
const SETTLE_TIME: std::time::Duration = std::time::Duration::from_secs(2);

impl Veth {
    /// The state after reading `addresses` at `now`.
    fn after_read(previous: Option<&Veth>, addresses: PodAddresses, now: std::time::Instant) -> Veth {
        let since = match previous {
            Some(previous) if previous.addresses == addresses => previous.since,
            _ => now,
        };
        let settled = addresses.assigned() && now.duration_since(since) >= SETTLE_TIME;
        Veth { addresses, since, settled }
    }
}

/// Writes `pod_src` for the pod veths the interfaces controller attaches to.
pub struct PodSourceCheck {
    map: HashMap<MapData, u32, PodSources>,
    /// Changed after every write: a tuple remembered as plain traffic passed the old check.
    plain: crate::pinned::plain::PlainGeneration,
    resolver: Resolver,
    checked_by: u8,
    veths: BTreeMap<u32, Veth>,
    /// Veths whose resolution failed, so the error is logged once.
    failed: BTreeSet<u32>,
}

impl PodSourceCheck {
    /// `checked_by`: the first of our programs at the veths' TC ingress.
    pub fn open(pin_dir: &Path, checked_by: u8) -> Result<Self> {
        let map = open_map(pin_dir)?;
        // Entries of an earlier run: kept until the veths are seen again (or found gone).
        let veths = map
            .keys()
            .flatten()
            .map(|ifindex| (ifindex, Veth::after_read(None, PodAddresses::default(), std::time::Instant::now())))
            .collect();
        let plain = crate::pinned::plain::PlainGeneration::open(pin_dir);
        Ok(Self { map, plain, resolver: Resolver::open()?, checked_by, veths, failed: BTreeSet::new() })
    }

    /// Reads veth `ifindex`'s pod addresses and writes its entry if they changed. Called before
    /// the veth's programs are attached, so a pod veth is never unchecked: until the CNI has
    /// assigned the pod's addresses the entry is empty and the pod's IP traffic dropped.
    pub fn update(&mut self, interface: &str, ifindex: u32) {
        let started = std::time::Instant::now();
        let addresses = match self.resolver.peer_addresses(ifindex) {
            Ok(addresses) => {
                self.failed.remove(&ifindex);
                addresses
            }
            Err(e) => {
                if self.failed.insert(ifindex) {
                    tracing::warn!(
                        interface,
                        error = format!("{e:#}"),
                        "cannot read the pod's addresses; its IP traffic is dropped until they are known"
                    );
                }
                PodAddresses::default()
            }
        };
        let previous = self.veths.get(&ifindex);
        if previous.map(|v| &v.addresses) != Some(&addresses) {
            let written = self.map.insert(ifindex, addresses.entry(self.checked_by), 0);
            self.plain.forget_all();
            if let Err(e) = written {
                tracing::error!(interface, error = %e, "cannot write the pod's source addresses");
                return;
            }
            let micros = started.elapsed().as_micros() as u64;
            tracing::info!(interface, addresses = ?addresses.0, micros, "pod source addresses");
        }
        let veth = Veth::after_read(previous, addresses, std::time::Instant::now());
        self.veths.insert(ifindex, veth);
    }

    /// Re-reads the veths whose pod may still be getting its addresses.
    pub fn refresh(&mut self, names: &BTreeMap<u32, String>) {
        let unsettled: Vec<u32> = self.veths.iter().filter(|(_, v)| !v.settled).map(|(i, _)| *i).collect();
        for ifindex in unsettled {
            if let Some(name) = names.get(&ifindex) {
                self.update(name, ifindex);
            }
        }
    }

    /// Forgets the veths that are gone (their index may be reused by another interface).
    pub fn retain(&mut self, present: &BTreeSet<u32>) {
        let gone: Vec<u32> = self.veths.keys().filter(|i| !present.contains(i)).copied().collect();
        for ifindex in gone {
            self.veths.remove(&ifindex);
            self.failed.remove(&ifindex);
            let _ = self.map.remove(&ifindex);
            // Its index may come back on another veth, under another pod's addresses.
            self.plain.forget_all();
        }
    }

    /// Veths with an entry, and of those the ones without an assigned address.
    pub fn counts(&self) -> (usize, usize) {
        (self.veths.len(), self.veths.values().filter(|v| !v.addresses.assigned()).count())
    }
}

fn open_map(pin_dir: &Path) -> Result<HashMap<MapData, u32, PodSources>> {
    let path = crate::pinned::pinned_map(pin_dir, source_check_map_names::POD_SOURCES);
    let data = MapData::from_pin(&path).with_context(|| format!("opening pinned map {}", path.display()))?;
    Ok(HashMap::try_from(Map::HashMap(data))?)
}

/// `--enable-pod-source-check=false`: removes every entry, so no veth is checked.
pub fn clear(pin_dir: &Path) -> Result<()> {
    let mut map = open_map(pin_dir)?;
    let keys: Vec<u32> = map.keys().flatten().collect();
    let removed = keys.iter().try_for_each(|key| map.remove(key));
    crate::pinned::plain::forget_all(pin_dir);
    Ok(removed?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_veth_settles_only_once_its_addresses_stay_alike_for_the_settle_time() {
        let addresses = |list: &[&str]| PodAddresses(list.iter().map(|a| a.parse().unwrap()).collect());
        let start = std::time::Instant::now();
        let at = |ms: u64| start + std::time::Duration::from_millis(ms);
        let v4 = addresses(&["10.244.1.2", "fe80::1"]);
        let dual = addresses(&["10.244.1.2", "fd00:10:244:1::2", "fe80::1"]);

        let first = Veth::after_read(None, v4.clone(), at(0));
        // The race: read again a few milliseconds later, before the CNI added the IPv6 address.
        let again = Veth::after_read(Some(&first), v4.clone(), at(3));
        assert!(!again.settled, "two reads milliseconds apart settled the veth");
        let grown = Veth::after_read(Some(&again), dual.clone(), at(5));
        assert!(!grown.settled);
        assert!(!Veth::after_read(Some(&grown), dual.clone(), at(1_000)).settled);
        let settled = Veth::after_read(Some(&grown), dual.clone(), at(2_005));
        assert!(settled.settled, "alike for the settle time");
        assert_eq!(settled.since, at(5));

        // No global address yet (link-local only): never settled, however long.
        let bare = Veth::after_read(None, addresses(&["fe80::1"]), at(0));
        assert!(!Veth::after_read(Some(&bare), addresses(&["fe80::1"]), at(60_000)).settled);
    }

    /// Needs no privilege: route lookups are open to every user.
    #[test]
    fn the_route_to_a_local_address_leaves_by_loopback_and_a_global_one_by_the_default_route() {
        let mut resolver = Resolver::open().unwrap();
        let lo = crate::node::netif::interface_index("lo").unwrap();
        assert_eq!(resolver.route_interface("127.0.0.1".parse().unwrap()).unwrap(), Some(lo));
        assert_eq!(resolver.route_interface("::1".parse().unwrap()).unwrap(), Some(lo));
        // A global address leaves by the default route's interface, if there is one.
        let by_default = resolver.route_interface("192.0.2.1".parse().unwrap()).unwrap();
        let default_interfaces = crate::node::netif::default_route_interfaces();
        match by_default {
            Some(index) => assert!(default_interfaces.contains(&crate::node::netif::interface_name(index).unwrap())),
            None => assert!(default_interfaces.is_empty()),
        }
    }
}
