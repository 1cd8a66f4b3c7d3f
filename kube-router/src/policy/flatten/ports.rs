//! Port prefixes: the LPM keys of `slot_ports`, and a slot's port index (the port space cut
//! where some rule's ranges begin or end, each piece pointing at the peers admitted there).
use std::collections::{BTreeMap, BTreeSet};

use crate::policy::model::{PortRange, Protocol};

/// The protocols and ports one `slot_ports` entry covers, as an LPM prefix:
/// every protocol, or the ports of one protocol sharing their first `bits` bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PortPrefix {
    AllProtocols,
    Ports { protocol: Protocol, start: u16, bits: u8 },
}

impl PortPrefix {
    pub fn contains(&self, protocol: Protocol, port: u16) -> bool {
        match *self {
            PortPrefix::AllProtocols => true,
            PortPrefix::Ports { protocol: p, start, bits } => p == protocol && port & port_mask(bits) == start,
        }
    }

    /// How many key bits after the slot it matches (the longest match wins).
    pub fn specificity(&self) -> u32 {
        match self {
            PortPrefix::AllProtocols => 0,
            PortPrefix::Ports { bits, .. } => 8 + u32::from(*bits),
        }
    }
}

fn port_mask(bits: u8) -> u16 {
    if bits == 0 {
        0
    } else {
        u16::MAX << (16 - u32::from(bits.min(16)))
    }
}

/// The fewest port prefixes covering `start..=end` exactly.
pub fn port_prefixes(protocol: Protocol, start: u16, end: u16) -> Vec<PortPrefix> {
    let mut out = Vec::new();
    let (mut low, high) = (u32::from(start), u32::from(end));
    while low <= high {
        // The biggest aligned block starting at `low` that ends within the range.
        let mut size = if low == 0 { 1u32 << 16 } else { 1u32 << low.trailing_zeros().min(16) };
        while low + size - 1 > high {
            size /= 2;
        }
        let bits = 16 - size.trailing_zeros() as u8;
        out.push(PortPrefix::Ports { protocol, start: low as u16, bits });
        low += size;
    }
    out
}

/// A slot's port index: for each port prefix, the members (rules' peer sets) admitted there.
/// Rules without ports give the slot-wide entry; the pieces of the port space where ranged
/// rules add peers give their own entries (which repeat the slot-wide members, because the
/// longest match hides the slot-wide entry). Pieces admitted by nothing get no entry.
pub fn port_index<M: Ord + Clone>(rules: &[(M, Option<&[PortRange]>)]) -> Vec<(PortPrefix, BTreeSet<M>)> {
    let everywhere: BTreeSet<M> = rules.iter().filter(|(_, ports)| ports.is_none()).map(|(m, _)| m.clone()).collect();
    let mut out = Vec::new();
    if !everywhere.is_empty() {
        out.push((PortPrefix::AllProtocols, everywhere.clone()));
    }
    for protocol in [Protocol::Tcp, Protocol::Udp, Protocol::Sctp] {
        // Sweep over the range boundaries, counting how many ranges of each member cover.
        let mut events: BTreeMap<u32, Vec<(&M, i32)>> = BTreeMap::new();
        for (member, ports) in rules {
            for range in ports.iter().flat_map(|ranges| ranges.iter()).filter(|r| r.protocol == protocol) {
                events.entry(u32::from(range.start)).or_default().push((member, 1));
                events.entry(u32::from(range.end) + 1).or_default().push((member, -1));
            }
        }
        let mut active: BTreeMap<&M, i32> = BTreeMap::new();
        // Maximal pieces with one member set: (start, end, members).
        let mut pieces: Vec<(u32, u32, BTreeSet<M>)> = Vec::new();
        let bounds: Vec<u32> = events.keys().copied().collect();
        for (index, at) in bounds.iter().enumerate() {
            for (member, change) in &events[at] {
                let count = active.entry(member).or_default();
                *count += change;
                if *count == 0 {
                    active.remove(member);
                }
            }
            let Some(next) = bounds.get(index + 1) else { break };
            if active.is_empty() {
                continue;
            }
            let mut members = everywhere.clone();
            members.extend(active.keys().map(|m| (*m).clone()));
            match pieces.last_mut() {
                Some((_, end, last)) if *end + 1 == *at && *last == members => *end = next - 1,
                _ => pieces.push((*at, next - 1, members)),
            }
        }
        for (start, end, members) in pieces {
            if members == everywhere {
                continue;
            }
            for prefix in port_prefixes(protocol, start as u16, end as u16) {
                out.push((prefix, members.clone()));
            }
        }
    }
    out
}
