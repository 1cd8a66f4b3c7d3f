//! `kube-router conntrack`: the conntrack entries of both families.
use std::{net::SocketAddr, path::Path};

use anyhow::Result;
use kube_router_common::{CtKey, CtValue, CT_FLAG_FULL_NAT, CT_FLAG_REVERSE};
use serde::Serialize;

use super::socket_addr;
use crate::{
    services::family::{AddressFamily, V4, V6},
    services::maps::conntrack::FamilyConntrack,
};

#[derive(Serialize, Debug, Default)]
#[serde(transparent)]
pub struct ConntrackReport {
    pub entries: Vec<ConntrackEntry>,
}

#[derive(Serialize, Debug)]
pub struct ConntrackEntry {
    /// `forward` (client to Service) or `reverse` (the reply).
    pub direction: &'static str,
    /// Whether the source is translated too (SNAT).
    pub snat: bool,
    pub src: SocketAddr,
    pub dst: SocketAddr,
    pub nat_src: SocketAddr,
    pub nat_dst: SocketAddr,
    /// `CT_FLAG_*` (docs/maps.md).
    pub flags: u16,
    pub service_id: u32,
    pub backend_id: u32,
}

fn entries_of<F: AddressFamily>(pin_dir: &Path, out: &mut Vec<ConntrackEntry>) -> Result<()>
where
    CtKey<F::Words>: aya::Pod,
    CtValue<F::Words>: aya::Pod,
{
    for (k, v) in FamilyConntrack::<F>::open_pinned(pin_dir)?.entries()? {
        out.push(ConntrackEntry {
            direction: if v.flags & CT_FLAG_REVERSE != 0 { "reverse" } else { "forward" },
            snat: v.flags & CT_FLAG_FULL_NAT != 0,
            src: socket_addr::<F>(k.src_addr, k.src_port),
            dst: socket_addr::<F>(k.dst_addr, k.dst_port),
            nat_src: socket_addr::<F>(v.nat_src_addr, v.nat_src_port),
            nat_dst: socket_addr::<F>(v.nat_dst_addr, v.nat_dst_port),
            flags: v.flags,
            service_id: v.service_id,
            backend_id: v.backend_id,
        });
    }
    Ok(())
}

pub fn collect(pin_dir: &Path) -> Result<ConntrackReport> {
    let mut entries = Vec::new();
    entries_of::<V4>(pin_dir, &mut entries)?;
    entries_of::<V6>(pin_dir, &mut entries)?;
    Ok(ConntrackReport { entries })
}

impl super::Report for ConntrackReport {
    fn render_text(&self) -> String {
        self.entries
            .iter()
            .map(|e| {
                format!(
                    "{}{} {} -> {} becomes {} -> {} flags={:#x} service={} backend={}\n",
                    e.direction,
                    if e.snat { " snat" } else { "" },
                    e.src,
                    e.dst,
                    e.nat_src,
                    e.nat_dst,
                    e.flags,
                    e.service_id,
                    e.backend_id
                )
            })
            .collect()
    }
}
