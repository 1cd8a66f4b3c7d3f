//! The agent's command line. `command_line` holds the commands and the run flags, grouped
//! per subsystem, each group in its own module with the conversion into that subsystem's
//! options (`api`, `node`, `service_proxy`, `policy`, `routing` with BFD and the overlay,
//! `datapath`, `metrics`, `upstream_only`).
//!
//! This module: compatibility with upstream kube-router's command line (its
//! `pkg/options/options.go`, Go's pflag): value syntaxes (Go durations and booleans), what each
//! upstream flag becomes here, the defaults that differ, and the generated flag reference
//! (`docs/flags.md`).
use std::{ffi::OsString, fmt::Write as _, net::IpAddr, path::PathBuf, time::Duration};

pub mod api;
pub mod command_line;
pub mod datapath;
pub mod metrics;
pub mod node;
pub mod policy;
pub mod routing;
pub mod service_proxy;
pub mod upstream_only;

/// A path, or empty (upstream's "unset"; dropped after parsing).
fn path_or_empty() -> impl clap::builder::TypedValueParser<Value = PathBuf> {
    clap::builder::TypedValueParser::map(clap::builder::OsStringValueParser::new(), PathBuf::from)
}

/// An empty value is how upstream's flags say "unset" (their defaults): read it so.
fn drop_if_empty<T: AsRef<std::ffi::OsStr>>(value: &mut Option<T>) {
    if value.as_ref().is_some_and(|v| v.as_ref().is_empty()) {
        *value = None;
    }
}

/// Every flag of upstream kube-router v2.x (`pkg/options/options.go`, `AddFlags`), by long name.
pub const UPSTREAM_FLAGS: &[&str] = &[
    "advertise-cluster-ip",
    "advertise-external-ip",
    "advertise-loadbalancer-ip",
    "advertise-pod-cidr",
    "auto-mtu",
    "bfd-desired-min-tx-interval",
    "bfd-detection-multiplier",
    "bfd-port",
    "bfd-required-min-rx-interval",
    "bgp-graceful-restart",
    "bgp-graceful-restart-deferral-time",
    "bgp-graceful-restart-time",
    "bgp-holdtime",
    "bgp-port",
    "cache-sync-timeout",
    "cleanup-config",
    "cluster-asn",
    "disable-source-dest-check",
    "enable-bfd",
    "enable-cni",
    "enable-ibgp",
    "enable-ipv4",
    "enable-ipv6",
    "enable-overlay",
    "enable-pod-egress",
    "enable-pprof",
    "excluded-cidrs",
    "hairpin-mode",
    "gobgp-admin-address",
    "gobgp-admin-port",
    "health-addr",
    "health-port",
    "help",
    "hostname-override",
    "injected-routes-sync-period",
    "iptables-sync-period",
    "ipvs-graceful-period",
    "ipvs-graceful-termination",
    "ipvs-permit-all",
    "ipvs-sync-period",
    "kubeconfig",
    "loadbalancer-default-class",
    "loadbalancer-ip-range",
    "loadbalancer-sync-period",
    "masquerade-all",
    "master",
    "metrics-path",
    "metrics-port",
    "metrics-addr",
    "netpol-default-deny",
    "nodeport-bindon-all-ip",
    "nodes-full-mesh",
    "overlay-encap",
    "overlay-encap-port",
    "overlay-type",
    "override-nexthop",
    "peer-router-asns",
    "peer-router-ips",
    "peer-router-multihop-ttl",
    "peer-router-passwords",
    "peer-router-passwords-file",
    "peer-router-ports",
    "router-id",
    "routes-sync-period",
    "run-firewall",
    "run-loadbalancer",
    "run-router",
    "run-service-proxy",
    "runtime-endpoint",
    "service-cluster-ip-range",
    "strict-external-ip-validation",
    "service-external-ip-range",
    "service-node-port-range",
    "service-tcp-timeout",
    "service-tcpfin-timeout",
    "service-udp-timeout",
    "v",
    "use-nftables-for-netpol",
    "version",
];

/// What an upstream flag does here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Upstream {
    /// Same meaning as upstream's.
    Honoured,
    /// Translated into this agent's equivalent (how: the text).
    Mapped(&'static str),
    /// Accepted; given with an effect upstream, it logs one warning at start saying why it has
    /// none here (the text).
    Obsolete(&'static str),
    /// Accepted when it asks for what upstream does by default; the value that enables the
    /// feature stops the agent with the text (why, and what to use instead).
    Refused(&'static str),
}

impl Upstream {
    pub fn label(self) -> &'static str {
        match self {
            Upstream::Honoured => "honoured",
            Upstream::Mapped(_) => "mapped",
            Upstream::Obsolete(_) => "accepted, no effect",
            Upstream::Refused(_) => "refused when enabled",
        }
    }
}

const NO_IPVS: &str = "there is no IPVS here: Services are compiled into eBPF maps on every change";
const NO_ALLOCATOR: &str = "it belongs to upstream's LoadBalancer address allocator (--run-loadbalancer), \
     which this agent does not have";

/// What each upstream flag becomes here; `None` for flags upstream does not have.
pub fn upstream_status(flag: &str) -> Option<Upstream> {
    use Upstream::*;
    if !UPSTREAM_FLAGS.contains(&flag) {
        return None;
    }
    Some(match flag {
        "v" => Mapped(
            "the log level when RUST_LOG is unset: 0-1 info for the agent and warn for its libraries, \
             2-3 info, 4-5 debug for the agent, 6 and more debug for everything",
        ),
        "enable-ipv4" | "enable-ipv6" => Mapped(
            "unset: the family is served where the node has an address of it. true: the agent refuses to \
             start if the node has no (global) address of that family. false: Services of that family \
             are not programmed (NetworkPolicy still enforces both families)",
        ),
        "cleanup-config" => Mapped(
            "runs `kube-router cleanup` (this agent's pinned maps and links, its kernel routes, the graceful \
             restart marker) and exits; there are no iptables, IPVS or ipset rules to remove",
        ),
        "cache-sync-timeout" => Obsolete(
            "there is no start deadline: the agent serves from its checkpoint while it lists the API \
             objects and becomes ready when the listing completes (docs/operations.md)",
        ),
        "disable-source-dest-check" => Obsolete(
            "the agent makes no cloud API calls: on AWS EC2 disable the instances' source/destination \
             check yourself (launch template or instance attribute)",
        ),
        "enable-pprof" => Obsolete("there is no Go runtime to profile: use perf on the agent, and its metrics"),
        "excluded-cidrs" => Obsolete("there is no IPVS here, so there are no IPVS services to keep from deletion"),
        "gobgp-admin-address" | "gobgp-admin-port" => Obsolete(
            "there is no GoBGP gRPC API: `kube-router bgp` and the /bgp page of the metrics listener \
             show the neighbours and routes",
        ),
        "injected-routes-sync-period" | "routes-sync-period" => Obsolete(
            "routes and advertisements follow each change (BGP updates, Node objects, Services) as it \
             happens; there is no periodic resync to tune",
        ),
        "iptables-sync-period" => {
            Obsolete("there are no iptables rules: NetworkPolicy is compiled into eBPF maps on every change")
        }
        "ipvs-sync-period" | "ipvs-permit-all" => Obsolete(NO_IPVS),
        "ipvs-graceful-period" | "ipvs-graceful-termination" => Obsolete(
            "there is no IPVS here: an established TCP connection always keeps its backend after the \
             endpoint goes until the connection ends, while new flows avoid it at once (docs/datapath.md)",
        ),
        "loadbalancer-default-class" | "loadbalancer-sync-period" => Obsolete(NO_ALLOCATOR),
        "runtime-endpoint" => Obsolete(
            "direct server return needs no container runtime here: the backend's node decapsulates in \
             its TC program, nothing is set up inside the pod",
        ),
        "service-node-port-range" => Obsolete(
            "upstream uses it for the node's iptables input rules; here NodePorts are what the Services \
             say and NetworkPolicy is enforced on pod interfaces only",
        ),
        "use-nftables-for-netpol" => {
            Obsolete("NetworkPolicy is enforced in eBPF; neither iptables nor nftables is used")
        }
        "run-loadbalancer" => Refused(
            "this agent does not allocate LoadBalancer addresses: run an allocator (MetalLB, kube-vip, a \
             cloud controller), keep --loadbalancer-ip-range to validate what it assigns and \
             --advertise-loadbalancer-ip to announce it",
        ),
        "netpol-default-deny" => Refused(
            "there is no default deny before a pod's policy is written: a new pod's traffic passes until \
             the agent has written its NetworkPolicy entries (milliseconds after its interface appears). \
             Remove the flag to run with that window",
        ),
        _ => Honoured,
    })
}

/// A default that differs from upstream's, and why.
pub struct DefaultDifference {
    pub flag: &'static str,
    pub upstream: &'static str,
    pub here: &'static str,
    pub why: &'static str,
}

pub const DEFAULT_DIFFERENCES: &[DefaultDifference] = &[
    DefaultDifference {
        flag: "bgp-graceful-restart",
        upstream: "false",
        here: "true",
        why: "peers keep the node's routes while the agent restarts or upgrades, so pod traffic across \
              nodes does not stop (tests/tests/upgrade.rs)",
    },
    DefaultDifference {
        flag: "hairpin-mode",
        upstream: "false",
        here: "true",
        why: "a backend reaching its own Service works as under kube-proxy; the datapath needs no \
              per-endpoint rules for it",
    },
    DefaultDifference {
        flag: "metrics-addr",
        upstream: "every address",
        here: "127.0.0.1",
        why: "safer: the metrics name every Service, VIP, BGP peer and route; pods must not read them",
    },
    DefaultDifference {
        flag: "health-addr",
        upstream: "every address (both families)",
        here: "0.0.0.0 (every IPv4 address)",
        why: "the kubelet probes the node's InternalIP; a node without IPv6 cannot bind `::`",
    },
    DefaultDifference {
        flag: "enable-ipv4",
        upstream: "true (refuses to start on a node without IPv4)",
        here: "unset: served where the node has an IPv4 address",
        why: "an IPv6-only node starts without a flag",
    },
    DefaultDifference {
        flag: "enable-ipv6",
        upstream: "false",
        here: "unset: served where the node has a global IPv6 address",
        why: "dual-stack clusters work without a flag (IPv6 Services, pod CIDRs and policy)",
    },
    DefaultDifference {
        flag: "nodeport-bindon-all-ip",
        upstream: "false (the node IP only)",
        here: "true (every node address)",
        why: "NodePorts answer on every node address, as under kube-proxy and earlier releases of this \
              agent; false narrows them to the node IP, --nodeport-addresses to a list",
    },
    DefaultDifference {
        flag: "disable-source-dest-check",
        upstream: "true (an AWS API call)",
        here: "no effect",
        why: "the agent makes no cloud API calls",
    },
    DefaultDifference {
        flag: "gobgp-admin-port",
        upstream: "50051 (GoBGP's gRPC API on 127.0.0.1)",
        here: "no effect",
        why: "there is no gRPC API; `kube-router bgp` shows the BGP state",
    },
    DefaultDifference {
        flag: "service-tcp-timeout",
        upstream: "0s: IPVS's own, 15m",
        here: "0s: 6h",
        why: "an idle connection (a connection pool, a websocket without keepalives) keeps its backend \
              for hours, as under kube-proxy, whose kernel conntrack keeps established TCP for a day; \
              the conntrack map is an LRU the agent's GC keeps clear, so long lifetimes cost no drops",
    },
    DefaultDifference {
        flag: "service-tcpfin-timeout",
        upstream: "0s: IPVS's own, 2m",
        here: "0s: 10s",
        why: "a closed flow's entries and its source-NAT port (--snat-port-range) are free again \
              seconds after the FIN or RST, so a busy NodePort does not run out of ports",
    },
    DefaultDifference {
        flag: "service-udp-timeout",
        upstream: "0s: IPVS's own, 5m",
        here: "0s: 60s",
        why: "request/response UDP (DNS) frees its entries and source-NAT port within a minute; a \
              flow idle that long is balanced again on its next datagram",
    },
    DefaultDifference {
        flag: "v",
        upstream: "0",
        here: "unset: RUST_LOG, else info",
        why: "RUST_LOG (tracing's filter syntax) wins when set",
    },
];

/// Go's `strconv.ParseBool`, as pflag reads a boolean's value.
pub fn parse_go_bool(text: &str) -> Result<bool, String> {
    match text {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Ok(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Ok(false),
        _ => Err(format!("{text:?} is not a boolean (true, false, 1, 0, t, f)")),
    }
}

/// A duration: Go's syntax (`1m30s`, `300ms`, `1.5h`, `2h45m`; units ns, us, µs, ms, s, m, h),
/// or a plain number of seconds (`90`), this agent's earlier form. Not negative.
/// The longest conntrack lifetime `--service-*-timeout` accepts: a week.
pub const MAX_CT_TIMEOUT: Duration = Duration::from_secs(7 * 24 * 3600);

/// `--service-tcp-timeout`, `--service-tcpfin-timeout`, `--service-udp-timeout`: a Go duration,
/// 0 (the built-in lifetime) or from 1 s to [`MAX_CT_TIMEOUT`]. Fractions of a second are
/// dropped (the datapath counts whole seconds, as IPVS does).
pub fn parse_ct_timeout(text: &str) -> Result<Duration, String> {
    let duration = parse_go_duration(text)?;
    if duration.is_zero() {
        return Ok(duration);
    }
    if duration < Duration::from_secs(1) {
        return Err(format!("{text:?} is under a second: a conntrack lifetime is 0s (the default) or at least 1s"));
    }
    if duration > MAX_CT_TIMEOUT {
        return Err(format!("{text:?} is longer than the 168h (7 days) a conntrack lifetime may be"));
    }
    Ok(Duration::from_secs(duration.as_secs()))
}

/// The `ct_cfg` entry for the three timeouts ([`parse_ct_timeout`]'s values; 0: the default).
pub fn ct_lifetimes(tcp: Duration, tcp_fin: Duration, udp: Duration) -> kube_router_common::CtLifetimes {
    let secs = |d: Duration| u32::try_from(d.as_secs()).unwrap_or(u32::MAX);
    kube_router_common::CtLifetimes { tcp_secs: secs(tcp), closing_secs: secs(tcp_fin), udp_secs: secs(udp), pad: 0 }
}

pub fn parse_go_duration(text: &str) -> Result<Duration, String> {
    let bad = || format!("{text:?} is not a duration like 90s, 1m30s, 300ms or 2h");
    let body = text.strip_prefix('+').unwrap_or(text);
    if body.is_empty() {
        return Err(bad());
    }
    if body.bytes().all(|b| b.is_ascii_digit()) {
        return body.parse::<u64>().map(Duration::from_secs).map_err(|_| bad());
    }
    let mut rest = body;
    let mut total = 0f64;
    while !rest.is_empty() {
        let number_end = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).ok_or_else(bad)?;
        let (number, tail) = rest.split_at(number_end);
        if number.is_empty() || number == "." {
            return Err(bad());
        }
        let value: f64 = number.parse().map_err(|_| bad())?;
        let unit_end = tail.find(|c: char| c.is_ascii_digit() || c == '.').unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_end);
        let scale = match unit {
            "ns" => 1e-9,
            "us" | "µs" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return Err(format!("{text:?}: unknown unit {unit:?} (ns, us, ms, s, m, h)")),
        };
        total += value * scale;
        rest = tail;
    }
    Duration::try_from_secs_f64(total).map_err(|_| bad())
}

/// `--router-id`: an IPv4 address, `generate`, or an IPv6 address (hashed to 32 bits).
pub fn parse_router_id(text: &str) -> Result<crate::routing::bgp::peers::RouterIdSetting, String> {
    use crate::routing::bgp::peers::RouterIdSetting;
    match text {
        // Upstream's default: the node's IPv4 address.
        "" => return Ok(RouterIdSetting::Auto),
        "generate" => return Ok(RouterIdSetting::Generate),
        _ => {}
    }
    match text.parse::<IpAddr>() {
        Ok(IpAddr::V4(v4)) if !v4.is_unspecified() => Ok(RouterIdSetting::Fixed(v4)),
        Ok(ip @ IpAddr::V6(_)) => Ok(RouterIdSetting::Fixed(crate::routing::bgp::peers::hashed_router_id(ip))),
        _ => Err(format!("{text:?} is not a router id: an IPv4 address, an IPv6 address (hashed) or \"generate\"")),
    }
}

/// The tracing filter for upstream's klog verbosity (`-v N`), used when RUST_LOG is unset.
pub fn log_filter_for_verbosity(level: u32) -> &'static str {
    match level {
        0..=1 => "warn,kube_router=info",
        2..=3 => "info",
        4..=5 => "info,kube_router=debug",
        _ => "debug",
    }
}

/// pflag gives a boolean its value only after `=`; `--flag true` is the flag and a stray word
/// (an error upstream). Here the word is taken as the value, the only reading that is not an
/// error, and the one this agent's earlier CLI had. Other words after a bare boolean stay
/// separate arguments (a subcommand).
pub fn join_bool_values(args: impl IntoIterator<Item = OsString>, bool_flags: &[String]) -> Vec<OsString> {
    let mut out: Vec<OsString> = Vec::new();
    for arg in args {
        let joined = match (out.last().and_then(|a| a.to_str()), arg.to_str()) {
            (Some(prev), Some(value @ ("true" | "false")))
                if prev.strip_prefix("--").is_some_and(|name| bool_flags.iter().any(|f| f == name)) =>
            {
                Some(OsString::from(format!("{prev}={value}")))
            }
            _ => None,
        };
        match joined {
            Some(j) => *out.last_mut().expect("joined with the previous argument") = j,
            None => out.push(arg),
        }
    }
    out
}

/// Gives every boolean flag of `command` pflag's syntax: bare (`--flag`) is true, `--flag=false`
/// false, and Go's spellings of either (`1`, `t`, `FALSE`...). Returns the long names changed.
pub fn go_bool_flags(command: clap::Command) -> (clap::Command, Vec<String>) {
    let mut names = Vec::new();
    let command = command.mut_args(|arg| {
        let is_bool = matches!(arg.get_action(), clap::ArgAction::Set)
            && arg.get_value_parser().type_id() == std::any::TypeId::of::<bool>();
        match arg.get_long() {
            Some(long) if is_bool => {
                names.push(long.to_string());
                arg.num_args(0..=1).require_equals(true).default_missing_value("true").value_parser(parse_go_bool)
            }
            _ => arg,
        }
    });
    (command, names)
}

fn cell(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ").replace('|', "\\|")
}

/// `docs/flags.md`, from the agent's command line (`kube-router flags-markdown`).
pub fn markdown(command: &clap::Command) -> String {
    let args: Vec<&clap::Arg> =
        command.get_arguments().filter(|a| a.get_long().is_some() && !a.is_hide_set()).collect();
    let long = |a: &clap::Arg| a.get_long().unwrap_or_default().to_string();
    let mut out = String::new();
    out.push_str(
        "# Flags\n\n\
         <!-- Generated by `kube-router flags-markdown > docs/flags.md`; `cargo test -p kube-router --lib flags` \
         fails when this file differs from the command line. -->\n\n\
         Every flag of upstream kube-router v2.x (`pkg/options/options.go`) parses, with Go's syntax: a \
         bare boolean (`--advertise-cluster-ip`) is true, `--flag=false` false; durations take Go's form \
         (`1m30s`, `300ms`, `2h`) or plain seconds. Each upstream flag is **honoured** (same meaning), \
         **mapped** (translated into this agent's equivalent), **accepted, no effect** (given with an \
         effect upstream, one warning at start says why it has none here) or **refused when enabled** \
         (the agent stops with why and what to use instead). The node name is `--hostname-override`, \
         else the `NODE_NAME` environment variable (set by upstream's manifests), else the hostname.\n\n",
    );
    let mut counts = std::collections::BTreeMap::<&str, Vec<&str>>::new();
    for flag in UPSTREAM_FLAGS {
        counts.entry(upstream_status(flag).expect("an upstream flag").label()).or_default().push(flag);
    }
    let _ = writeln!(out, "Of upstream's {} flags:\n", UPSTREAM_FLAGS.len());
    for label in ["honoured", "mapped", "accepted, no effect", "refused when enabled"] {
        let flags = counts.get(label).cloned().unwrap_or_default();
        let names: Vec<String> = flags.iter().map(|f| format!("`--{f}`")).collect();
        let _ = writeln!(out, "* {label}: {} ({})", flags.len(), names.join(", "));
    }
    out.push_str("\n## Defaults that differ from upstream's\n\n| flag | upstream | here | why |\n|---|---|---|---|\n");
    for d in DEFAULT_DIFFERENCES {
        let _ = writeln!(out, "| `--{}` | {} | {} | {} |", d.flag, cell(d.upstream), cell(d.here), cell(d.why));
    }
    out.push_str("\n## Upstream flags mapped, without effect or refused\n\n| flag | here |\n|---|---|\n");
    for flag in UPSTREAM_FLAGS {
        let status = upstream_status(flag).expect("an upstream flag");
        let text = match status {
            Upstream::Honoured => continue,
            Upstream::Mapped(t) | Upstream::Obsolete(t) | Upstream::Refused(t) => t,
        };
        let _ = writeln!(out, "| `--{flag}` | {}: {} |", status.label(), cell(text));
    }
    out.push_str(
        "\n## Reference\n\nEvery flag the agent takes (`kube-router --help`); `upstream` says what an upstream flag \
         is here, `-` marks this agent's own; grouped as `--help` groups them.\n",
    );
    let mut heading = None;
    for (i, arg) in args.into_iter().enumerate() {
        if i == 0 || arg.get_help_heading() != heading {
            heading = arg.get_help_heading();
            let _ = writeln!(
                out,
                "\n### {}\n\n| flag | environment | default | upstream | meaning |\n|---|---|---|---|---|",
                heading.unwrap_or("Options")
            );
        }
        let name = long(arg);
        let short = arg.get_short().map(|s| format!(", `-{s}`")).unwrap_or_default();
        let env = arg.get_env().map(|e| format!("`{}`", e.to_string_lossy())).unwrap_or_default();
        let defaults: Vec<String> = arg.get_default_values().iter().map(|v| v.to_string_lossy().into_owned()).collect();
        let default = if defaults.is_empty() { String::new() } else { format!("`{}`", defaults.join(",")) };
        let upstream = upstream_status(&name).map_or("-", Upstream::label);
        let help = arg.get_long_help().or(arg.get_help()).map(|h| h.to_string()).unwrap_or_default();
        let _ = writeln!(out, "| `--{name}`{short} | {env} | {default} | {upstream} | {} |", cell(&help));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations() {
        let ok = |t: &str| parse_go_duration(t).unwrap();
        assert_eq!(ok("90"), Duration::from_secs(90));
        assert_eq!(ok("90s"), Duration::from_secs(90));
        assert_eq!(ok("1m30s"), Duration::from_secs(90));
        assert_eq!(ok("300ms"), Duration::from_millis(300));
        assert_eq!(ok("2h"), Duration::from_secs(7200));
        assert_eq!(ok("1.5h"), Duration::from_secs(5400));
        assert_eq!(ok("2h45m0.5s"), Duration::from_millis((2 * 3600 + 45 * 60) * 1000 + 500));
        assert_eq!(ok("10us"), Duration::from_micros(10));
        assert_eq!(ok("10µs"), Duration::from_micros(10));
        assert_eq!(ok("0"), Duration::ZERO);
        assert_eq!(ok("0s"), Duration::ZERO);
        for bad in ["", "s", "5x", "-5s", "1.2.3s", "m5", ".s", "5 s"] {
            assert!(parse_go_duration(bad).is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn conntrack_timeouts_are_validated_and_zero_is_the_default() {
        let ok = |t: &str| parse_ct_timeout(t).unwrap();
        assert_eq!(ok("0s"), Duration::ZERO);
        assert_eq!(ok("0"), Duration::ZERO);
        assert_eq!(ok("1s"), Duration::from_secs(1));
        assert_eq!(ok("15m"), Duration::from_secs(900));
        assert_eq!(ok("2.5s"), Duration::from_secs(2), "whole seconds");
        assert_eq!(ok("168h"), MAX_CT_TIMEOUT);
        for (bad, says) in
            [("500ms", "under a second"), ("1ns", "under a second"), ("169h", "7 days"), ("5x", "unknown unit")]
        {
            let message = parse_ct_timeout(bad).unwrap_err();
            assert!(message.contains(says), "{bad}: {message}");
        }
        let lifetimes = ct_lifetimes(Duration::from_secs(900), Duration::ZERO, Duration::from_secs(5));
        assert_eq!(lifetimes, kube_router_common::CtLifetimes { tcp_secs: 900, closing_secs: 0, udp_secs: 5, pad: 0 });
    }

    #[test]
    fn go_bools() {
        for t in ["1", "t", "T", "TRUE", "true", "True"] {
            assert_eq!(parse_go_bool(t), Ok(true));
        }
        for f in ["0", "f", "F", "FALSE", "false", "False"] {
            assert_eq!(parse_go_bool(f), Ok(false));
        }
        assert!(parse_go_bool("yes").is_err());
    }

    #[test]
    fn router_ids() {
        use crate::routing::bgp::peers::RouterIdSetting;
        assert_eq!(parse_router_id("10.0.0.1"), Ok(RouterIdSetting::Fixed("10.0.0.1".parse().unwrap())));
        assert_eq!(parse_router_id("generate"), Ok(RouterIdSetting::Generate));
        assert_eq!(parse_router_id(""), Ok(RouterIdSetting::Auto));
        let RouterIdSetting::Fixed(hashed) = parse_router_id("2001:db8::1").unwrap() else { panic!() };
        assert_eq!(hashed, crate::routing::bgp::peers::hashed_router_id("2001:db8::1".parse().unwrap()));
        assert!(parse_router_id("0.0.0.0").is_err());
        assert!(parse_router_id("node-1").is_err());
    }

    #[test]
    fn verbosity() {
        assert_eq!(log_filter_for_verbosity(0), "warn,kube_router=info");
        assert_eq!(log_filter_for_verbosity(2), "info");
        assert_eq!(log_filter_for_verbosity(4), "info,kube_router=debug");
        assert_eq!(log_filter_for_verbosity(10), "debug");
    }

    #[test]
    fn bool_values_after_a_space_join_their_flag() {
        let args = |v: &[&str]| v.iter().map(OsString::from).collect::<Vec<_>>();
        let flags = vec!["enable-cni".to_string()];
        assert_eq!(
            join_bool_values(args(&["kr", "--enable-cni", "false", "--kubeconfig", "true"]), &flags),
            args(&["kr", "--enable-cni=false", "--kubeconfig", "true"])
        );
        assert_eq!(
            join_bool_values(args(&["kr", "--enable-cni", "checkpoint"]), &flags),
            args(&["kr", "--enable-cni", "checkpoint"])
        );
    }

    #[test]
    fn every_upstream_flag_has_a_status_and_no_duplicates() {
        let mut seen = std::collections::BTreeSet::new();
        for flag in UPSTREAM_FLAGS {
            assert!(seen.insert(flag), "{flag} twice");
            assert!(upstream_status(flag).is_some());
        }
        assert_eq!(UPSTREAM_FLAGS.len(), 79);
        // Issue 28: the conntrack timeouts set the datapath's lifetimes.
        for flag in ["service-tcp-timeout", "service-tcpfin-timeout", "service-udp-timeout"] {
            assert!(matches!(upstream_status(flag), Some(Upstream::Honoured)), "{flag}");
        }
        for d in DEFAULT_DIFFERENCES {
            assert!(UPSTREAM_FLAGS.contains(&d.flag), "{}", d.flag);
        }
    }
}
