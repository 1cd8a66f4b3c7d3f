//! The edge of the legacy cleanup: lists the node's state, has `super` plan, removes what the
//! plan names. iptables, ipset, nft and ipvsadm are run as commands (a missing binary is a note
//! in the report, never a failure: the image from scratch has none of them); routes and links
//! go through rtnetlink. Every removal is tried on its own, so one failure leaves the rest done.
use std::{
    collections::BTreeSet,
    io::Write,
    net::IpAddr,
    path::Path,
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{bail, Context, Result};
use futures_util::TryStreamExt;
use ipnet::IpNet;
use rtnetlink::{
    packet_route::{
        address::AddressAttribute,
        link::{LinkAttribute, LinkInfo},
        route::{RouteAddress, RouteAttribute, RouteMessage},
    },
    Handle, RouteMessageBuilder,
};

use super::{
    plan_ipsets, plan_iptables, plan_ipvs, plan_links, plan_nft_tables, plan_routes, LinkEntry, Report, RouteEntry,
};
use crate::k8s::{checkpoint, watch::ApiOptions};

/// What the binary's absence means, said once per binary.
fn missing(binary: &str) -> String {
    format!(
        "{binary} not found: its leftovers were not checked (the kube-router image is built from scratch and has no \
         {binary}; run `kube-router cleanup --legacy` on the host, or from an image that has it)"
    )
}

/// Runs a command: its stdout, None if the binary does not exist.
fn output(binary: &str, args: &[&str]) -> Result<Option<String>> {
    match Command::new(binary).args(args).stdin(Stdio::null()).output() {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("running {binary}")),
        Ok(out) if out.status.success() => Ok(Some(String::from_utf8_lossy(&out.stdout).into_owned())),
        Ok(out) => bail!("{binary} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()),
    }
}

fn run_with_input(binary: &str, args: &[&str], input: &str) -> Result<()> {
    let mut child = Command::new(binary)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {binary}"))?;
    child.stdin.take().context("stdin")?.write_all(input.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!("{binary} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

/// The iptables backends to look at, per family: nf_tables always (where the binary exists),
/// legacy only where legacy tables are loaded in this namespace (listing them otherwise would
/// load the modules).
fn iptables_backends() -> Vec<(&'static str, &'static str, &'static str)> {
    let mut backends = Vec::new();
    for (family, nft_save, nft_restore, legacy_save, legacy_restore, loaded) in [
        (
            "iptables",
            "iptables-nft-save",
            "iptables-nft-restore",
            "iptables-legacy-save",
            "iptables-legacy-restore",
            "/proc/net/ip_tables_names",
        ),
        (
            "ip6tables",
            "ip6tables-nft-save",
            "ip6tables-nft-restore",
            "ip6tables-legacy-save",
            "ip6tables-legacy-restore",
            "/proc/net/ip6_tables_names",
        ),
    ] {
        backends.push((family, nft_save, nft_restore));
        if std::fs::read_to_string(loaded).is_ok_and(|t| !t.trim().is_empty()) {
            backends.push((family, legacy_save, legacy_restore));
        }
    }
    backends
}

fn clean_iptables(report: &mut Report) {
    for (family, save, restore) in iptables_backends() {
        // Distributions without the -nft/-legacy names ship only `iptables-save`.
        let (save, restore) = match output(save, &[]) {
            Ok(None) if save.contains("-nft-") => {
                let plain_save = if family == "iptables" { "iptables-save" } else { "ip6tables-save" };
                let plain_restore = if family == "iptables" { "iptables-restore" } else { "ip6tables-restore" };
                match output(plain_save, &[]) {
                    Ok(Some(text)) => ((plain_save, text), plain_restore),
                    Ok(None) => {
                        report.notes.push(missing(plain_save));
                        continue;
                    }
                    Err(e) => {
                        report.failed.push(format!("{e:#}"));
                        continue;
                    }
                }
            }
            Ok(None) => continue,
            Ok(Some(text)) => ((save, text), restore),
            Err(e) => {
                report.failed.push(format!("{e:#}"));
                continue;
            }
        };
        let (save_binary, text) = save;
        for plan in plan_iptables(family, &text) {
            match run_with_input(restore, &["--noflush"], &plan.restore_input()) {
                Ok(()) => {
                    for (chain, spec) in &plan.rules {
                        report.add("iptables_rules", format!("{family} -t {} -A {chain} {spec}", plan.table));
                    }
                    for chain in &plan.chains {
                        report.add("iptables_chains", format!("{family} -t {} {chain}", plan.table));
                    }
                }
                Err(e) => report.failed.push(format!("{family} table {} (from {save_binary}): {e:#}", plan.table)),
            }
        }
    }
}

fn clean_ipsets(report: &mut Report) {
    let list = match output("ipset", &["list", "-n"]) {
        Ok(Some(list)) => list,
        Ok(None) => return report.notes.push(missing("ipset")),
        // No ipset support in the kernel: nothing can be left.
        Err(e) => return report.notes.push(format!("ipset sets not listed: {e:#}")),
    };
    for name in plan_ipsets(&list) {
        match output("ipset", &["destroy", &name]) {
            Ok(_) => report.add("ipsets", name),
            Err(e) => report.failed.push(format!("{e:#}")),
        }
    }
}

fn clean_nft(report: &mut Report) {
    let list = match output("nft", &["list", "tables"]) {
        Ok(Some(list)) => list,
        Ok(None) => return report.notes.push(missing("nft")),
        Err(e) => return report.failed.push(format!("{e:#}")),
    };
    for (family, name) in plan_nft_tables(&list) {
        match output("nft", &["delete", "table", &family, &name]) {
            Ok(_) => report.add("nft_tables", format!("{family} {name}")),
            Err(e) => report.failed.push(format!("{e:#}")),
        }
    }
}

fn clean_ipvs(report: &mut Report, dummy_addresses: &BTreeSet<IpAddr>) {
    if !Path::new("/proc/net/ip_vs").exists() {
        return report.notes.push("IPVS is not in this kernel (no /proc/net/ip_vs): no IPVS services to remove".into());
    }
    let save = match output("ipvsadm", &["-Sn"]) {
        Ok(Some(save)) => save,
        Ok(None) => return report.notes.push(missing("ipvsadm")),
        Err(e) => return report.failed.push(format!("{e:#}")),
    };
    for service in plan_ipvs(&save, dummy_addresses) {
        let mut args = vec!["-D"];
        args.extend(service.iter().map(String::as_str));
        match output("ipvsadm", &args) {
            Ok(_) => report.add("ipvs_services", service.join(" ")),
            Err(e) => report.failed.push(format!("{e:#}")),
        }
    }
}

fn route_address(a: &RouteAddress) -> Option<IpAddr> {
    match a {
        RouteAddress::Inet(v4) => Some(IpAddr::V4(*v4)),
        RouteAddress::Inet6(v6) => Some(IpAddr::V6(*v6)),
        _ => None,
    }
}

fn route_entry(message: &RouteMessage) -> Option<RouteEntry> {
    let mut destination = None;
    let mut table = u32::from(message.header.table);
    for attribute in &message.attributes {
        match attribute {
            RouteAttribute::Destination(a) => destination = route_address(a),
            RouteAttribute::Table(t) => table = *t,
            _ => {}
        }
    }
    // A route without a destination is a default route, never a pod CIDR.
    let destination = IpNet::new(destination?, message.header.destination_prefix_length).ok()?;
    Some(RouteEntry { destination, protocol: u8::from(message.header.protocol), table })
}

async fn clean_routes(handle: &Handle, report: &mut Report, node_pod_cidrs: &BTreeSet<IpNet>) -> Result<()> {
    let mut listed = Vec::new();
    let queries = [
        RouteMessageBuilder::<std::net::Ipv4Addr>::new().build(),
        RouteMessageBuilder::<std::net::Ipv6Addr>::new().build(),
    ];
    for query in queries {
        let mut stream = handle.route().get(query).execute();
        while let Some(message) = stream.try_next().await.context("listing routes")? {
            if let Some(entry) = route_entry(&message) {
                listed.push((entry, message));
            }
        }
    }
    let entries: Vec<RouteEntry> = listed.iter().map(|(e, _)| e.clone()).collect();
    for planned in plan_routes(&entries, node_pod_cidrs) {
        // Deleted with the message the kernel listed: its protocol, table and next hops make
        // only that route match.
        for (_, message) in listed.iter().filter(|(e, _)| *e == planned) {
            match handle.route().del(message.clone()).execute().await {
                Ok(()) => report.add("routes", format!("{} proto {}", planned.destination, planned.protocol)),
                Err(e) => report.failed.push(format!("route {}: {e}", planned.destination)),
            }
        }
    }
    Ok(())
}

async fn list_links(handle: &Handle) -> Result<Vec<LinkEntry>> {
    let mut links = Vec::new();
    let mut stream = handle.link().get().execute();
    while let Some(message) = stream.try_next().await.context("listing links")? {
        let mut name = None;
        let mut kind = None;
        for attribute in &message.attributes {
            match attribute {
                LinkAttribute::IfName(n) => name = Some(n.clone()),
                LinkAttribute::LinkInfo(infos) => {
                    kind = infos.iter().find_map(|i| match i {
                        LinkInfo::Kind(k) => Some(k.to_string()),
                        _ => None,
                    })
                }
                _ => {}
            }
        }
        if let Some(name) = name {
            links.push(LinkEntry { index: message.header.index, name, kind });
        }
    }
    Ok(links)
}

async fn addresses_of(handle: &Handle, index: u32) -> Result<BTreeSet<IpAddr>> {
    let mut addresses = BTreeSet::new();
    let mut stream = handle.address().get().set_link_index_filter(index).execute();
    while let Some(message) = stream.try_next().await.context("listing addresses")? {
        addresses.extend(message.attributes.iter().find_map(|a| match a {
            AddressAttribute::Address(ip) => Some(*ip),
            _ => None,
        }));
    }
    Ok(addresses)
}

/// Removes upstream kube-router's and kube-proxy's leftovers from this network namespace.
/// Protocol-17 routes go only for prefixes in `node_pod_cidrs` (empty: none, said in a note).
pub async fn cleanup(node_pod_cidrs: &BTreeSet<IpNet>) -> Result<Report> {
    let mut report = Report::default();
    let (connection, handle, _) = rtnetlink::new_connection().context("opening rtnetlink")?;
    tokio::spawn(connection);

    // Rules first: a set still matched by a rule cannot be destroyed.
    clean_iptables(&mut report);
    clean_nft(&mut report);
    clean_ipsets(&mut report);

    let links = list_links(&handle).await?;
    let planned_links = plan_links(&links);
    // IPVS services are judged by the dummy's addresses, so before the dummy goes.
    let mut dummy_addresses = BTreeSet::new();
    for link in planned_links.iter().filter(|l| l.name == super::DUMMY_INTERFACE) {
        dummy_addresses.extend(addresses_of(&handle, link.index).await?);
    }
    clean_ipvs(&mut report, &dummy_addresses);

    if node_pod_cidrs.is_empty() {
        report.notes.push(
            "no node pod CIDRs known (no --node-pod-cidrs, API or checkpoint): protocol-17 routes were not checked"
                .into(),
        );
    } else {
        clean_routes(&handle, &mut report, node_pod_cidrs).await?;
    }
    for link in planned_links {
        match handle.link().del(link.index).execute().await {
            Ok(()) => report.add("links", format!("{} ({})", link.name, link.kind.as_deref().unwrap_or("?"))),
            Err(e) => report.failed.push(format!("link {}: {e}", link.name)),
        }
    }
    Ok(report)
}

/// Every Node's pod CIDRs: its `kube-router.io/pod-cidr(s)` annotations' (upstream routed
/// those) and its spec's.
fn pod_cidrs_of(nodes: &[k8s_openapi::api::core::v1::Node]) -> BTreeSet<IpNet> {
    nodes.iter().flat_map(crate::node::pod_cidrs::all_node_pod_cidrs).collect()
}

/// The cluster's node pod CIDRs: listed from the API server (bounded: `timeout`), else read from
/// the checkpoint in `state_dir`. Where each came from, or why neither answered, for the log.
pub async fn node_pod_cidrs(
    api: Option<&ApiOptions>,
    state_dir: &Path,
    timeout: Duration,
) -> (BTreeSet<IpNet>, String) {
    let mut why = Vec::new();
    if let Some(options) = api {
        let listed = tokio::time::timeout(timeout, async {
            let client = crate::k8s::watch::client(options).await?;
            let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(client);
            anyhow::Ok(nodes.list(&Default::default()).await?.items)
        })
        .await;
        match listed {
            Ok(Ok(nodes)) => return (pod_cidrs_of(&nodes), format!("the API server ({} nodes)", nodes.len())),
            Ok(Err(e)) => why.push(format!("API: {e:#}")),
            Err(_) => why.push(format!("API: no answer within {timeout:?}")),
        }
    }
    match checkpoint::read(state_dir) {
        Ok(saved) => (pod_cidrs_of(&saved.nodes), format!("the checkpoint ({} nodes)", saved.nodes.len())),
        Err(e) => {
            why.push(format!("checkpoint: {e}"));
            (BTreeSet::new(), why.join("; "))
        }
    }
}
