//! [`RouteSet`](super::RouteSet)s read from and written to the kernel with rtnetlink.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use anyhow::{Context, Result};
use futures_util::TryStreamExt;
use ipnet::IpNet;
use rtnetlink::{
    packet_route::route::{RouteAddress, RouteAttribute, RouteMessage, RouteProtocol},
    Handle, RouteMessageBuilder,
};

use super::{RouteOp, RouteSet};

/// Our routes in one table of the current network namespace.
pub struct NetlinkRoutes {
    handle: Handle,
    protocol: u8,
    table: u32,
}

impl NetlinkRoutes {
    /// Opens a netlink connection in the calling thread's network namespace (the connection
    /// task is spawned on the current tokio runtime).
    pub fn connect(protocol: u8, table: u32) -> Result<Self> {
        let (connection, handle, _) = rtnetlink::new_connection().context("opening rtnetlink")?;
        tokio::spawn(connection);
        Ok(Self { handle, protocol, table })
    }

    fn ours(&self, message: &RouteMessage) -> bool {
        let table = message
            .attributes
            .iter()
            .find_map(|a| match a {
                RouteAttribute::Table(t) => Some(*t),
                _ => None,
            })
            .unwrap_or(u32::from(message.header.table));
        u8::from(message.header.protocol) == self.protocol && table == self.table
    }

    /// Routes with our protocol in our table (the kernel lists every route: we filter).
    pub async fn list(&self) -> Result<RouteSet> {
        let mut routes = RouteSet::new();
        let queries = [RouteMessageBuilder::<Ipv4Addr>::new().build(), RouteMessageBuilder::<Ipv6Addr>::new().build()];
        for query in queries {
            let mut stream = self.handle.route().get(query).execute();
            while let Some(message) = stream.try_next().await.context("listing routes")? {
                if !self.ours(&message) {
                    continue;
                }
                let address = |a: &RouteAddress| match a {
                    RouteAddress::Inet(v4) => Some(IpAddr::V4(*v4)),
                    RouteAddress::Inet6(v6) => Some(IpAddr::V6(*v6)),
                    _ => None,
                };
                let mut destination = None;
                let mut gateway = None;
                for attribute in &message.attributes {
                    match attribute {
                        RouteAttribute::Destination(a) => destination = address(a),
                        RouteAttribute::Gateway(a) => gateway = address(a),
                        _ => {}
                    }
                }
                let (Some(destination), Some(gateway)) = (destination, gateway) else { continue };
                if let Ok(net) = IpNet::new(destination, message.header.destination_prefix_length) {
                    routes.insert(net, gateway);
                }
            }
        }
        Ok(routes)
    }

    fn message(&self, destination: IpNet, gateway: Option<IpAddr>) -> Result<RouteMessage> {
        let protocol = RouteProtocol::from(self.protocol);
        Ok(match (destination, gateway) {
            (IpNet::V4(net), gateway) => {
                let mut builder = RouteMessageBuilder::<Ipv4Addr>::new()
                    .destination_prefix(net.network(), net.prefix_len())
                    .protocol(protocol)
                    .table_id(self.table);
                if let Some(IpAddr::V4(gw)) = gateway {
                    builder = builder.gateway(gw);
                }
                builder.build()
            }
            (IpNet::V6(net), gateway) => {
                let mut builder = RouteMessageBuilder::<Ipv6Addr>::new()
                    .destination_prefix(net.network(), net.prefix_len())
                    .protocol(protocol)
                    .table_id(self.table);
                if let Some(IpAddr::V6(gw)) = gateway {
                    builder = builder.gateway(gw);
                }
                builder.build()
            }
        })
    }

    pub async fn apply(&self, op: RouteOp) -> Result<()> {
        match op {
            RouteOp::Replace(destination, gateway) => self
                .handle
                .route()
                .add(self.message(destination, Some(gateway))?)
                .replace()
                .execute()
                .await
                .with_context(|| format!("replacing route {destination} via {gateway}")),
            RouteOp::Delete(destination) => self
                .handle
                .route()
                .del(self.message(destination, None)?)
                .execute()
                .await
                .with_context(|| format!("deleting route {destination}")),
        }
    }
}
