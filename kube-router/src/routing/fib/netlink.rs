//! One routing table read from and written to the kernel with rtnetlink: our routes (any
//! destination, the default route included, single or multipath), everyone else's routes
//! (to stay off them and to resolve next hops) and the node's addresses.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use anyhow::{Context, Result};
use futures_util::{StreamExt, TryStreamExt};
use ipnet::IpNet;
use rtnetlink::{
    packet_core::{NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REPLACE, NLM_F_REQUEST},
    packet_route::{
        address::AddressAttribute,
        route::{
            RouteAddress, RouteAttribute, RouteMessage, RouteMetric, RouteNextHop, RouteNextHopFlags, RouteProtocol,
        },
        AddressFamily, RouteNetlinkMessage,
    },
    Handle, MulticastGroup, RouteMessageBuilder,
};

use super::{health::KernelError, ForeignRoute, Gateways, KernelRoute, KernelTable, LocalAddresses, RouteOp};

/// Our routes in one table of the current network namespace.
pub struct NetlinkRoutes {
    handle: Handle,
    protocol: u8,
    table: u32,
}

fn address(a: &RouteAddress) -> Option<IpAddr> {
    match a {
        RouteAddress::Inet(v4) => Some(IpAddr::V4(*v4)),
        RouteAddress::Inet6(v6) => Some(IpAddr::V6(*v6)),
        _ => None,
    }
}

fn table_of(message: &RouteMessage) -> u32 {
    message
        .attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Table(t) => Some(*t),
            _ => None,
        })
        .unwrap_or(u32::from(message.header.table))
}

/// The routing protocol of a route notification, if it is one.
pub fn route_protocol(message: &NetlinkMessage<RouteNetlinkMessage>) -> Option<u8> {
    match &message.payload {
        NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewRoute(m) | RouteNetlinkMessage::DelRoute(m)) => {
            Some(u8::from(m.header.protocol))
        }
        _ => None,
    }
}

/// A netlink socket subscribed to link, address and route changes (both families): the FIB
/// loop re-reads the table when the kernel's own routing changes, instead of waiting for its
/// periodic check.
pub fn watch_changes() -> Result<tokio::sync::mpsc::UnboundedReceiver<NetlinkMessage<RouteNetlinkMessage>>> {
    let groups = [
        MulticastGroup::Link,
        MulticastGroup::Ipv4Ifaddr,
        MulticastGroup::Ipv6Ifaddr,
        MulticastGroup::Ipv4Route,
        MulticastGroup::Ipv6Route,
    ];
    let (connection, _handle, messages) =
        rtnetlink::new_multicast_connection(&groups).context("subscribing to routing changes")?;
    tokio::spawn(connection);
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut messages = messages;
        while let Some((message, _)) = messages.next().await {
            if tx.send(message).is_err() {
                return;
            }
        }
    });
    Ok(rx)
}

fn errno(e: &rtnetlink::Error) -> Option<KernelError> {
    match e {
        rtnetlink::Error::NetlinkError(message) => message.code.map(|code| KernelError(-code.get())),
        _ => None,
    }
}

impl NetlinkRoutes {
    /// Opens a netlink connection in the calling thread's network namespace (the connection
    /// task is spawned on the current tokio runtime).
    pub fn connect(protocol: u8, table: u32) -> Result<Self> {
        let (connection, handle, _) = rtnetlink::new_connection().context("opening rtnetlink")?;
        tokio::spawn(connection);
        Ok(Self { handle, protocol, table })
    }

    pub fn protocol(&self) -> u8 {
        self.protocol
    }

    /// Every route of our table: ours by destination, and for every other destination the
    /// route the kernel prefers (lowest metric).
    pub async fn list(&self) -> Result<KernelTable> {
        let mut table = KernelTable::default();
        let queries = [RouteMessageBuilder::<Ipv4Addr>::new().build(), RouteMessageBuilder::<Ipv6Addr>::new().build()];
        for query in queries {
            let mut stream = self.handle.route().get(query).execute();
            while let Some(message) = stream.try_next().await.context("listing routes")? {
                if table_of(&message) != self.table {
                    continue;
                }
                let family_default = match message.header.address_family {
                    AddressFamily::Inet6 => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
                    _ => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
                };
                let mut destination = None;
                let mut gateways = Vec::new();
                let mut oif = None;
                let mut metric = 0;
                let mut mtu = None;
                for attribute in &message.attributes {
                    match attribute {
                        RouteAttribute::Destination(a) => destination = address(a),
                        RouteAttribute::Gateway(a) => gateways.extend(address(a)),
                        RouteAttribute::Oif(i) => oif = Some(*i),
                        RouteAttribute::Priority(p) => metric = *p,
                        RouteAttribute::Metrics(metrics) => {
                            mtu = metrics.iter().find_map(|m| match m {
                                RouteMetric::Mtu(v) => Some(*v),
                                _ => None,
                            })
                        }
                        RouteAttribute::MultiPath(hops) => {
                            for hop in hops {
                                oif = oif.or(Some(hop.interface_index));
                                gateways.extend(hop.attributes.iter().find_map(|a| match a {
                                    RouteAttribute::Gateway(g) => address(g),
                                    _ => None,
                                }));
                            }
                        }
                        _ => {}
                    }
                }
                // A route without RTA_DST is a default route (0.0.0.0/0, ::/0).
                let Ok(net) =
                    IpNet::new(destination.unwrap_or(family_default), message.header.destination_prefix_length)
                else {
                    continue;
                };
                if u8::from(message.header.protocol) == self.protocol {
                    if let Some(gateways) = Gateways::new(gateways) {
                        table.ours.insert(net.trunc(), KernelRoute { gateways, mtu });
                    }
                    continue;
                }
                let foreign = ForeignRoute {
                    protocol: u8::from(message.header.protocol),
                    kind: u8::from(message.header.kind),
                    gateway: gateways.first().copied(),
                    oif,
                    metric,
                    linkdown: message.header.flags.bits() & u32::from(RouteNextHopFlags::Linkdown.bits()) != 0,
                };
                match table.foreign.get(&net.trunc()) {
                    Some(existing) if existing.metric <= foreign.metric => {}
                    _ => {
                        table.foreign.insert(net.trunc(), foreign);
                    }
                }
            }
        }
        Ok(table)
    }

    /// The node's interfaces: index, name and MTU.
    pub async fn links(&self) -> Result<super::resolve::Links> {
        use rtnetlink::packet_route::link::LinkAttribute;
        let mut links = super::resolve::Links::new();
        let mut stream = self.handle.link().get().execute();
        while let Some(message) = stream.try_next().await.context("listing links")? {
            let mut name = None;
            let mut mtu = None;
            for attribute in &message.attributes {
                match attribute {
                    LinkAttribute::IfName(n) => name = Some(n.clone()),
                    LinkAttribute::Mtu(m) => mtu = Some(*m),
                    _ => {}
                }
            }
            if let (Some(name), Some(mtu)) = (name, mtu) {
                links.insert(message.header.index, super::resolve::Link { name, mtu });
            }
        }
        Ok(links)
    }

    /// Every address configured on the node's interfaces.
    pub async fn local_addresses(&self) -> Result<LocalAddresses> {
        let mut addresses = LocalAddresses::new();
        let mut stream = self.handle.address().get().execute();
        while let Some(message) = stream.try_next().await.context("listing addresses")? {
            for attribute in &message.attributes {
                if let AddressAttribute::Address(a) | AddressAttribute::Local(a) = attribute {
                    addresses.insert(*a);
                }
            }
        }
        Ok(addresses)
    }

    fn message(&self, destination: IpNet, route: Option<&KernelRoute>) -> RouteMessage {
        let protocol = RouteProtocol::from(self.protocol);
        let mut message = match destination {
            IpNet::V4(net) => RouteMessageBuilder::<Ipv4Addr>::new()
                .destination_prefix(net.network(), net.prefix_len())
                .protocol(protocol)
                .table_id(self.table)
                .build(),
            IpNet::V6(net) => RouteMessageBuilder::<Ipv6Addr>::new()
                .destination_prefix(net.network(), net.prefix_len())
                .protocol(protocol)
                .table_id(self.table)
                .build(),
        };
        let gateway_attribute = |gateway: &IpAddr| match gateway {
            IpAddr::V4(v4) => RouteAttribute::Gateway(RouteAddress::Inet(*v4)),
            IpAddr::V6(v6) => RouteAttribute::Gateway(RouteAddress::Inet6(*v6)),
        };
        if let Some(mtu) = route.and_then(|r| r.mtu) {
            message.attributes.push(RouteAttribute::Metrics(vec![RouteMetric::Mtu(mtu)]));
        }
        match route.map(|r| &r.gateways) {
            None => {}
            Some(Gateways::One(gateway)) => message.attributes.push(gateway_attribute(gateway)),
            Some(Gateways::Many(list)) => message.attributes.push(RouteAttribute::MultiPath(
                list.iter()
                    .map(|gateway| {
                        let mut hop = RouteNextHop::default();
                        hop.attributes = vec![gateway_attribute(gateway)];
                        hop
                    })
                    .collect(),
            )),
        }
        message
    }

    async fn send(&self, message: RouteNetlinkMessage, flags: u16) -> Result<(), rtnetlink::Error> {
        let mut request = NetlinkMessage::from(message);
        request.header.flags = NLM_F_REQUEST | NLM_F_ACK | flags;
        let mut handle = self.handle.clone();
        let mut response = handle.request(request)?;
        while let Some(message) = response.next().await {
            if let NetlinkPayload::Error(e) = message.payload {
                if e.code.is_some() {
                    return Err(rtnetlink::Error::NetlinkError(e));
                }
            }
        }
        Ok(())
    }

    /// Performs one write; Err carries the kernel's errno (or EIO for a transport failure).
    pub async fn apply(&self, op: &RouteOp) -> Result<(), KernelError> {
        let result = match op {
            RouteOp::Create(destination, route) => {
                let message = RouteNetlinkMessage::NewRoute(self.message(*destination, Some(route)));
                self.send(message, NLM_F_CREATE | NLM_F_EXCL).await
            }
            // Without NLM_F_CREATE: a replace never creates, so it can only land on the route
            // we listed (ours); if that is gone the next round creates it exclusively.
            RouteOp::Replace(destination, route) => {
                let message = RouteNetlinkMessage::NewRoute(self.message(*destination, Some(route)));
                self.send(message, NLM_F_REPLACE).await
            }
            // Protocol and table always, the gateway when there is one: only our route matches.
            RouteOp::Delete(destination, route) => {
                let single = match route.gateways {
                    Gateways::One(gateway) => Some(KernelRoute::from(Gateways::One(gateway))),
                    Gateways::Many(_) => None,
                };
                let single = single.as_ref();
                let message = RouteNetlinkMessage::DelRoute(self.message(*destination, single));
                self.send(message, 0).await
            }
        };
        result.map_err(|e| errno(&e).unwrap_or(KernelError(libc::EIO)))
    }
}
