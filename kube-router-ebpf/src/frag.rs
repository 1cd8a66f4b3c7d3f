//! Fragments of translated datagrams. Only the first fragment carries the ports, so they are
//! remembered per datagram (source, destination, id, protocol, as the fragments arrive) for the
//! later fragments, which are then translated like the first (addresses only).
use kube_router_common::*;

use crate::{
    family::Family,
    maps::count,
    parsing::{Fragment, LbFlow},
};

#[inline(always)]
fn key<A: Copy>(flow: &LbFlow<A>) -> FragKey<A> {
    FragKey { src_addr: flow.src_addr, dst_addr: flow.dst_addr, id: flow.frag_id, proto: flow.proto, pad: [0; 3] }
}

/// Completes `flow` for the translation: a first fragment's ports are remembered, a later
/// fragment gets them. `false`: a later fragment whose first fragment was not seen (reordered,
/// or sent before we were attached); it can only pass untranslated.
#[inline(always)]
pub fn resolve_ports<F: Family>(flow: &mut LbFlow<F::Addr>) -> bool {
    match flow.fragment {
        Fragment::Whole => true,
        Fragment::First => {
            let ports = FragPorts { src_port: flow.src_port, dst_port: flow.dst_port };
            let _ = F::fragments().insert(key(flow), ports, 0);
            true
        }
        Fragment::Later => {
            // SAFETY: read-only copy of a map value.
            match unsafe { F::fragments().get(key(flow)) } {
                Some(ports) => {
                    flow.src_port = ports.src_port;
                    flow.dst_port = ports.dst_port;
                    true
                }
                None => {
                    count(lb_stat::FRAGMENT_PASS);
                    false
                }
            }
        }
    }
}
