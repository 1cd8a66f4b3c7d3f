//! What upstream kube-router (v2.x) and kube-proxy leave on a node when their DaemonSets are
//! replaced, and the plan to remove exactly that (`kube-router cleanup --legacy`,
//! `--cleanup-legacy-on-start`). Left in place they keep applying: a stale `KUBE-POD-FW-*` chain
//! drops traffic to a new pod that reuses an old pod's address, kube-proxy's `KUBE-SERVICES`
//! DNATs Service traffic its own way, a protocol-17 route to another node's pod CIDR is a
//! foreign route our FIB never overrides.
//!
//! Pure: the plan is computed from listings (`iptables-save`, `ipset list -n`, `nft list tables`,
//! `ipvsadm -Sn`, links, routes) by known names only; anything else is never part of a plan
//! (other chains, sets, tables, routes and devices stay). The edge that lists and removes is
//! `exec`.
pub mod exec;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use ipnet::IpNet;
use serde::Serialize;

/// Upstream kube-router's route protocol (`RTPROT_ZEBRA`, `routes.ZebraOriginator`).
pub const UPSTREAM_ROUTE_PROTOCOL: u8 = 17;
/// The main routing table, where upstream installs pod routes.
pub const MAIN_TABLE: u32 = 254;
/// Upstream's dummy interface holding every Service VIP (IPVS mode).
pub const DUMMY_INTERFACE: &str = "kube-dummy-if";

/// kube-router's and kube-proxy's iptables chains, whole names.
const CHAIN_NAMES: [&str; 8] = [
    // kube-proxy, iptables mode.
    "KUBE-SERVICES",
    "KUBE-EXTERNAL-SERVICES",
    "KUBE-NODEPORTS",
    "KUBE-POSTROUTING",
    "KUBE-MARK-MASQ",
    "KUBE-FORWARD",
    "KUBE-PROXY-FIREWALL",
    "KUBE-PROXY-CANARY",
];

/// Chain name prefixes: upstream kube-router's (netpol: `KUBE-ROUTER-INPUT|FORWARD|OUTPUT`,
/// `KUBE-POD-FW-<hash>`, `KUBE-NWPLCY-<hash>|DEFAULT|COMMON|TAIL`; proxy:
/// `KUBE-ROUTER-SERVICES`, `KUBE-ROUTER-HAIRPIN`) and kube-proxy's per-Service chains.
/// kubelet's own chains (`KUBE-FIREWALL`, `KUBE-KUBELET-CANARY`, `KUBE-MARK-DROP`,
/// `KUBE-IPTABLES-HINT`) are not among them: kubelet stays on the node.
const CHAIN_PREFIXES: [&str; 9] = [
    "KUBE-ROUTER-",
    "KUBE-POD-FW-",
    "KUBE-NWPLCY-",
    "KUBE-SVC-",
    "KUBE-SVL-",
    "KUBE-SEP-",
    "KUBE-FW-",
    "KUBE-EXT-",
    "KUBE-XLB-",
];

/// Upstream's ipset name prefixes (IPv6 sets carry `inet6:` in front).
const IPSET_PREFIXES: [&str; 3] = ["kube-router-", "KUBE-SRC-", "KUBE-DST-"];

/// nftables tables: kube-proxy's nftables mode, upstream kube-router's nftables netpol mode.
const NFT_TABLES: [(&str, &str); 4] = [
    ("ip", "kube-proxy"),
    ("ip6", "kube-proxy"),
    ("ip", "kube-router-filter-ipv4"),
    ("ip6", "kube-router-filter-ipv6"),
];

pub fn is_legacy_chain(name: &str) -> bool {
    CHAIN_NAMES.contains(&name) || CHAIN_PREFIXES.iter().any(|p| name.starts_with(p))
}

pub fn is_legacy_ipset(name: &str) -> bool {
    let base = name.strip_prefix("inet6:").unwrap_or(name);
    IPSET_PREFIXES.iter().any(|p| base.starts_with(p))
}

pub fn is_legacy_nft_table(family: &str, name: &str) -> bool {
    NFT_TABLES.contains(&(family, name))
}

/// Upstream's overlay tunnels: `tun-` and the first 11 hex digits of a SHA-256 of the peer's
/// address (`tunnels.GenerateTunnelName`), IPIP or IPv6-in-IPv6 (with or without FoU).
pub fn is_legacy_tunnel(name: &str, kind: Option<&str>) -> bool {
    let hash_ok = name
        .strip_prefix("tun-")
        .is_some_and(|h| h.len() == 11 && h.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
    hash_ok && matches!(kind, Some("ipip" | "ip6tnl"))
}

/// A network interface as listed: name and kind (`dummy`, `ipip`, ...), index for deletion.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkEntry {
    pub index: u32,
    pub name: String,
    pub kind: Option<String>,
}

/// A route as listed (only what the plan judges by).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct RouteEntry {
    pub destination: IpNet,
    pub protocol: u8,
    pub table: u32,
}

/// One `iptables-save` table.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SavedTable {
    pub name: String,
    /// User-defined chains (policy `-`).
    pub chains: Vec<String>,
    /// `-A CHAIN SPEC` as (CHAIN, SPEC), in order.
    pub rules: Vec<(String, String)>,
}

/// Parses `iptables-save` output.
pub fn parse_iptables_save(text: &str) -> Vec<SavedTable> {
    let mut tables = Vec::new();
    let mut current: Option<SavedTable> = None;
    for line in text.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix('*') {
            current = Some(SavedTable { name: name.to_string(), ..Default::default() });
        } else if line == "COMMIT" {
            tables.extend(current.take());
        } else if let (Some(table), Some(decl)) = (current.as_mut(), line.strip_prefix(':')) {
            let mut words = decl.split_whitespace();
            if let (Some(chain), Some("-")) = (words.next(), words.next()) {
                table.chains.push(chain.to_string());
            }
        } else if let (Some(table), Some(rule)) = (current.as_mut(), line.strip_prefix("-A ")) {
            if let Some((chain, spec)) = rule.split_once(' ') {
                table.rules.push((chain.to_string(), spec.to_string()));
            }
        }
    }
    tables
}

/// Splits a rule spec as iptables-restore does: whitespace, double quotes with backslash escapes.
fn tokens(spec: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word = String::new();
    let (mut quoted, mut escaped, mut any) = (false, false, false);
    for c in spec.chars() {
        match c {
            _ if escaped => {
                word.push(c);
                escaped = false;
            }
            '\\' => escaped = true,
            '"' => {
                quoted = !quoted;
                any = true;
            }
            c if c.is_whitespace() && !quoted => {
                if any || !word.is_empty() {
                    out.push(std::mem::take(&mut word));
                }
                any = false;
            }
            c => word.push(c),
        }
    }
    if any || !word.is_empty() {
        out.push(word);
    }
    out
}

/// The removal of one table's leftovers: fed to `iptables-restore --noflush` as one transaction.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TablePlan {
    /// `iptables` or `ip6tables`.
    pub family: String,
    pub table: String,
    /// Rules in chains that are not ours that jump to a legacy chain or match a legacy ipset.
    pub rules: Vec<(String, String)>,
    /// Legacy chains: flushed, then deleted.
    pub chains: Vec<String>,
}

impl TablePlan {
    /// The `iptables-restore --noflush` input: delete the rules leading in, flush every chain
    /// (they jump to each other), then delete them.
    pub fn restore_input(&self) -> String {
        let mut out = format!("*{}\n", self.table);
        for (chain, spec) in &self.rules {
            out += &format!("-D {chain} {spec}\n");
        }
        for chain in &self.chains {
            out += &format!("-F {chain}\n");
        }
        for chain in &self.chains {
            out += &format!("-X {chain}\n");
        }
        out + "COMMIT\n"
    }
}

/// What one `iptables-save` listing asks to remove, per table with anything to remove.
pub fn plan_iptables(family: &str, save: &str) -> Vec<TablePlan> {
    let mut plans = Vec::new();
    for table in parse_iptables_save(save) {
        let chains: Vec<String> = table.chains.iter().filter(|c| is_legacy_chain(c)).cloned().collect();
        let rules: Vec<(String, String)> = table
            .rules
            .iter()
            .filter(|(chain, _)| !chains.contains(chain))
            .filter(|(_, spec)| {
                let words = tokens(spec);
                words.windows(2).any(|w| match w[0].as_str() {
                    "-j" | "--jump" | "-g" | "--goto" => chains.contains(&w[1]),
                    "--match-set" => is_legacy_ipset(&w[1]),
                    _ => false,
                })
            })
            .cloned()
            .collect();
        if !chains.is_empty() || !rules.is_empty() {
            plans.push(TablePlan { family: family.to_string(), table: table.name, rules, chains });
        }
    }
    plans
}

/// Legacy sets among `ipset list -n` output.
pub fn plan_ipsets(list: &str) -> Vec<String> {
    list.lines().map(str::trim).filter(|n| is_legacy_ipset(n)).map(str::to_string).collect()
}

/// Legacy tables among `nft list tables` output (`table <family> <name>`), as (family, name).
pub fn plan_nft_tables(list: &str) -> Vec<(String, String)> {
    list.lines()
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            match (words.next(), words.next(), words.next()) {
                (Some("table"), Some(family), Some(name)) if is_legacy_nft_table(family, name) => {
                    Some((family.to_string(), name.to_string()))
                }
                _ => None,
            }
        })
        .collect()
}

/// IPVS virtual services (`ipvsadm -Sn`: `-A -t 10.96.0.1:443 -s rr`) whose address is on
/// upstream's dummy interface (it puts every Service VIP there): their `ipvsadm -D` arguments.
/// Firewall-mark services cannot be attributed and stay.
pub fn plan_ipvs(save: &str, dummy_addresses: &BTreeSet<IpAddr>) -> Vec<Vec<String>> {
    save.lines()
        .filter_map(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            let (flag, address) = match words.as_slice() {
                ["-A", flag @ ("-t" | "-u" | "--tcp-service" | "--udp-service" | "--sctp-service"), address, ..] => {
                    (*flag, *address)
                }
                _ => return None,
            };
            let host = address.rsplit_once(':')?.0.trim_start_matches('[').trim_end_matches(']');
            let ip: IpAddr = host.parse().ok()?;
            dummy_addresses.contains(&ip).then(|| vec![flag.to_string(), address.to_string()])
        })
        .collect()
}

/// Upstream's pod routes: protocol 17 in the main table, to a prefix that is a pod CIDR of a
/// known node (the routes this agent's own BGP will install). Any other protocol-17 route (FRR's
/// zebra uses 17 too) stays.
pub fn plan_routes(routes: &[RouteEntry], node_pod_cidrs: &BTreeSet<IpNet>) -> Vec<RouteEntry> {
    routes
        .iter()
        .filter(|r| r.protocol == UPSTREAM_ROUTE_PROTOCOL && r.table == MAIN_TABLE)
        .filter(|r| node_pod_cidrs.contains(&r.destination.trunc()))
        .cloned()
        .collect()
}

/// `kube-dummy-if` (a dummy) and upstream's tunnels.
pub fn plan_links(links: &[LinkEntry]) -> Vec<LinkEntry> {
    links
        .iter()
        .filter(|l| {
            (l.name == DUMMY_INTERFACE && l.kind.as_deref() == Some("dummy"))
                || is_legacy_tunnel(&l.name, l.kind.as_deref())
        })
        .cloned()
        .collect()
}

/// What a cleanup did: per kind what was removed, what failed, what could not be looked at.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Report {
    /// Kind (`iptables_rules`, `iptables_chains`, `ipsets`, `nft_tables`, `ipvs_services`,
    /// `routes`, `links`) → what was removed, one entry each.
    pub removed: BTreeMap<&'static str, Vec<String>>,
    pub failed: Vec<String>,
    /// What was not checked, and why (a missing binary, no IPVS in the kernel).
    pub notes: Vec<String>,
}

pub const KINDS: [&str; 7] =
    ["iptables_rules", "iptables_chains", "ipsets", "nft_tables", "ipvs_services", "routes", "links"];

impl Report {
    pub fn add(&mut self, kind: &'static str, item: String) {
        self.removed.entry(kind).or_default().push(item);
    }

    pub fn count(&self, kind: &str) -> usize {
        self.removed.get(kind).map_or(0, Vec::len)
    }

    /// One line per kind ("removed N <kind>: a, b, ..."), then failures and notes.
    pub fn render_text(&self) -> String {
        let mut out = String::new();
        for kind in KINDS {
            let items = self.removed.get(kind).map(Vec::as_slice).unwrap_or_default();
            out += &format!("removed {} {}", items.len(), kind.replace('_', " "));
            if !items.is_empty() {
                out += &format!(": {}", items.join(", "));
            }
            out.push('\n');
        }
        for failure in &self.failed {
            out += &format!("FAILED: {failure}\n");
        }
        for note in &self.notes {
            out += &format!("note: {note}\n");
        }
        out
    }

    /// The JSON form (`-o json`): counts per kind beside the items.
    pub fn to_json(&self) -> serde_json::Value {
        let counts: BTreeMap<&str, usize> = KINDS.iter().map(|k| (*k, self.count(k))).collect();
        serde_json::json!({
            "counts": counts,
            "removed": self.removed,
            "failed": self.failed,
            "notes": self.notes,
        })
    }
}

#[cfg(test)]
mod tests;
