//! The command line against upstream kube-router's: every upstream flag with its Go syntax and
//! default, upstream's DaemonSets' args, and the generated reference (docs/flags.md).
use std::{net::Ipv4Addr, time::Duration};

use super::*;
use crate::{
    flags::node::{hostname, node_name},
    routing::bgp::peers::{parse_external_peer_flags, RouterIdSetting},
};

fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
    parse_from(std::iter::once("kube-router").chain(args.iter().copied()).map(Into::into))
}

fn ok(args: &[&str]) -> Cli {
    parse(args).unwrap_or_else(|e| panic!("{args:?}: {e}"))
}

/// Upstream's flags with their Go type and default as its `--help` prints them, transcribed
/// from cloudnativelabs/kube-router `pkg/options/options.go` (v2.x, `AddFlags`). Slices get a
/// sample value (their default is empty).
const UPSTREAM_WITH_DEFAULTS: &[(&str, &str, &str)] = &[
    ("advertise-cluster-ip", "bool", "false"),
    ("advertise-external-ip", "bool", "false"),
    ("advertise-loadbalancer-ip", "bool", "false"),
    ("advertise-pod-cidr", "bool", "true"),
    ("auto-mtu", "bool", "true"),
    ("bfd-desired-min-tx-interval", "uint32", "1000"),
    ("bfd-detection-multiplier", "uint32", "3"),
    ("bfd-port", "uint32", "3784"),
    ("bfd-required-min-rx-interval", "uint32", "1000"),
    ("bgp-graceful-restart", "bool", "false"),
    ("bgp-graceful-restart-deferral-time", "duration", "6m0s"),
    ("bgp-graceful-restart-time", "duration", "1m30s"),
    ("bgp-holdtime", "duration", "1m30s"),
    ("bgp-port", "uint32", "179"),
    ("cache-sync-timeout", "duration", "1m0s"),
    ("cleanup-config", "bool", "false"),
    ("cluster-asn", "uint", "0"),
    ("disable-source-dest-check", "bool", "true"),
    ("enable-bfd", "bool", "false"),
    ("enable-cni", "bool", "true"),
    ("enable-ibgp", "bool", "true"),
    ("enable-ipv4", "bool", "true"),
    ("enable-ipv6", "bool", "false"),
    ("enable-overlay", "bool", "true"),
    ("enable-pod-egress", "bool", "true"),
    ("enable-pprof", "bool", "false"),
    ("excluded-cidrs", "strings", "10.0.0.0/8,192.168.0.0/16"),
    ("hairpin-mode", "bool", "false"),
    ("gobgp-admin-address", "string", "127.0.0.1"),
    ("gobgp-admin-port", "uint16", "50051"),
    ("health-addr", "string", ""),
    ("health-port", "uint16", "20244"),
    ("help", "bool", ""),
    ("hostname-override", "string", ""),
    ("injected-routes-sync-period", "duration", "1m0s"),
    ("iptables-sync-period", "duration", "5m0s"),
    ("ipvs-graceful-period", "duration", "30s"),
    ("ipvs-graceful-termination", "bool", "false"),
    ("ipvs-permit-all", "bool", "true"),
    ("ipvs-sync-period", "duration", "5m0s"),
    ("kubeconfig", "string", ""),
    ("loadbalancer-default-class", "bool", "true"),
    ("loadbalancer-ip-range", "strings", "192.0.2.0/24,2001:db8::/64"),
    ("loadbalancer-sync-period", "duration", "1m0s"),
    ("masquerade-all", "bool", "false"),
    ("master", "string", ""),
    ("metrics-path", "string", "/metrics"),
    ("metrics-port", "uint16", "0"),
    ("metrics-addr", "string", ""),
    ("netpol-default-deny", "bool", "false"),
    ("nodeport-bindon-all-ip", "bool", "false"),
    ("nodes-full-mesh", "bool", "true"),
    ("overlay-encap", "string", "ipip"),
    ("overlay-encap-port", "uint16", "5555"),
    ("overlay-type", "string", "subnet"),
    ("override-nexthop", "bool", "false"),
    ("peer-router-asns", "uints", "65000,65001"),
    ("peer-router-ips", "ipSlice", "192.0.2.1,192.0.2.2"),
    ("peer-router-multihop-ttl", "uint8", "0"),
    ("peer-router-passwords", "strings", "cGFzcw==,"),
    ("peer-router-passwords-file", "string", ""),
    ("peer-router-ports", "uints", "179,1179"),
    ("router-id", "string", ""),
    ("routes-sync-period", "duration", "5m0s"),
    ("run-firewall", "bool", "true"),
    ("run-loadbalancer", "bool", "false"),
    ("run-router", "bool", "true"),
    ("run-service-proxy", "bool", "true"),
    ("runtime-endpoint", "string", ""),
    ("service-cluster-ip-range", "strings", "10.96.0.0/12"),
    ("strict-external-ip-validation", "bool", "true"),
    ("service-external-ip-range", "strings", "198.51.100.0/24"),
    ("service-node-port-range", "string", "30000-32767"),
    ("service-tcp-timeout", "duration", "0s"),
    ("service-tcpfin-timeout", "duration", "0s"),
    ("service-udp-timeout", "duration", "0s"),
    ("v", "string", "0"),
    ("use-nftables-for-netpol", "bool", "false"),
    ("version", "bool", ""),
];

#[test]
fn every_upstream_flag_parses_with_its_default_and_bare() {
    let names: Vec<&str> = UPSTREAM_WITH_DEFAULTS.iter().map(|(n, _, _)| *n).collect();
    assert_eq!(names, crate::flags::UPSTREAM_FLAGS, "the transcription and the flags module disagree");
    for (name, kind, default) in UPSTREAM_WITH_DEFAULTS {
        if matches!(*name, "help" | "version") {
            let kind = parse(&[&format!("--{name}")]).err().map(|e| e.kind());
            assert!(matches!(kind, Some(clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion)));
            continue;
        }
        let with_value = format!("--{name}={default}");
        let cli = ok(&[&with_value]);
        // At its upstream default no flag refuses; one without effect here warns once.
        let warnings = cli.run.upstream.check().unwrap_or_else(|e| panic!("{with_value}: {e}"));
        assert!(warnings.len() <= 1, "{with_value}: {warnings:?}");
        if *kind == "bool" {
            ok(&[&format!("--{name}")]);
            ok(&[&format!("--{name}"), "--kubeconfig=/k"]);
            ok(&[&format!("--{name}=false")]);
        } else {
            // Go's flag package also takes the value as the next argument.
            ok(&[&format!("--{name}"), default]);
        }
    }
}

#[test]
fn bare_booleans_and_go_spellings() {
    let cli = ok(&["--advertise-cluster-ip", "--enable-cni=false", "--run-router=F", "--auto-mtu=0"]);
    assert!(cli.run.routing.advertise_cluster_ip);
    assert!(!cli.run.node.enable_cni && !cli.run.routing.run_router && !cli.run.node.auto_mtu);
    // The word after a space is the value (as this agent always read it)...
    assert!(!ok(&["--bpf-lb-sock", "false"]).run.service_proxy.bpf_lb_sock);
    // ...but a subcommand after a bare boolean stays a subcommand.
    let cli = ok(&["--enable-cni", "checkpoint"]);
    assert!(cli.run.node.enable_cni && matches!(cli.command, Some(Command::Checkpoint { .. })));
    assert!(parse(&["--enable-cni=maybe"]).is_err());
    // A repeated flag: the last wins; a repeated list appends.
    let cli = ok(&[
        "--run-firewall=false",
        "--run-firewall",
        "--service-cluster-ip-range=10.96.0.0/12",
        "--service-cluster-ip-range=fd00::/108",
    ]);
    assert!(cli.run.policy.run_firewall);
    assert_eq!(cli.run.node.service_cluster_ip_range.len(), 2);
}

#[test]
fn go_durations_everywhere_a_duration_is_taken() {
    let cli = ok(&[
        "--bgp-holdtime=1m30s",
        "--bgp-graceful-restart-time=2m",
        "--bgp-graceful-restart-deferral-time=2h",
        "--conntrack-gc-interval=300ms",
        "--max-stale=90",
    ]);
    assert_eq!(cli.run.routing.bgp_holdtime, Duration::from_secs(90));
    assert_eq!(cli.run.routing.bgp_graceful_restart_time, Duration::from_secs(120));
    assert_eq!(cli.run.routing.bgp_graceful_restart_deferral_time, Duration::from_secs(7200));
    assert_eq!(cli.run.datapath.conntrack_gc_interval, Duration::from_millis(300));
    assert_eq!(cli.run.api.max_stale, Some(Duration::from_secs(90)));
    assert_eq!(ok(&["--conntrack-gc-interval", "30"]).run.datapath.conntrack_gc_interval, Duration::from_secs(30));
    assert!(parse(&["--conntrack-gc-interval=0s"]).is_err());
    assert!(parse(&["--bgp-graceful-restart-time=2h"]).is_err(), "over RFC 4724's 4095 s");
}

#[test]
fn verbosity_forms() {
    for args in [&["-v", "3"][..], &["-v3"], &["-v=3"], &["--v=3"], &["--v", "3"], &["--v=1", "-v", "3"]] {
        assert_eq!(ok(args).run.v, Some(3), "{args:?}");
    }
    assert!(parse(&["--v=high"]).is_err());
}

#[test]
fn router_ids_and_node_names() {
    assert_eq!(ok(&["--router-id=generate"]).run.routing.router_id, Some(RouterIdSetting::Generate));
    assert_eq!(
        ok(&["--router-id=10.1.2.3"]).run.routing.router_id,
        Some(RouterIdSetting::Fixed(Ipv4Addr::new(10, 1, 2, 3)))
    );
    assert!(matches!(ok(&["--router-id=2001:db8::1"]).run.routing.router_id, Some(RouterIdSetting::Fixed(_))));
    assert_eq!(node_name(Some("a"), Some("b".into())), "a");
    assert_eq!(node_name(None, Some("b".into())), "b");
    assert_eq!(node_name(None, Some(String::new())), hostname());
    assert_eq!(ok(&["--hostname-override="]).run.node.hostname_override, None);
    assert_eq!(ok(&["--metrics-addr="]).run.metrics.metrics_addr, std::net::IpAddr::V4(Ipv4Addr::UNSPECIFIED));
}

#[test]
fn obsolete_flags_warn_once_each_and_refused_ones_refuse() {
    let cli = ok(&[
        "--iptables-sync-period=5m",
        "--ipvs-sync-period",
        "1m",
        "--service-tcp-timeout=0s",
        "--gobgp-admin-port=0",
        "--enable-pprof=false",
        "--runtime-endpoint=unix:///run/containerd/containerd.sock",
        "--run-loadbalancer=false",
    ]);
    let warnings = cli.run.upstream.check().unwrap();
    assert_eq!(warnings.len(), 3, "{warnings:#?}");
    assert!(warnings[0].starts_with("--iptables-sync-period has no effect: "), "{warnings:?}");
    assert!(warnings[2].starts_with("--runtime-endpoint has no effect: "), "{warnings:?}");
    // Honoured now (issue 28): no warning, and the value reaches the agent's settings.
    let udp = ok(&["--service-udp-timeout=5m"]);
    assert!(udp.run.upstream.check().unwrap().is_empty());
    assert_eq!(udp.run.service_proxy.service_udp_timeout, Duration::from_secs(300));
    assert_eq!(ok(&[]).run.service_proxy.service_tcp_timeout, Duration::ZERO, "0s: the built-in lifetime");
    for refused in ["--service-tcp-timeout=100ms", "--service-tcpfin-timeout=169h", "--service-udp-timeout=200h"] {
        assert!(parse(&[refused]).is_err(), "{refused} accepted");
    }
    for refused in ["--run-loadbalancer", "--netpol-default-deny=true"] {
        let message = ok(&[refused]).run.upstream.check().unwrap_err();
        assert!(message.starts_with(refused.split('=').next().unwrap()), "{message}");
    }
}

include!("../../tests/data/upstream_daemon_set_args.rs");

/// The args of the upstream DaemonSet file `file`.
fn upstream_args(file: &str) -> &'static [&'static str] {
    UPSTREAM_DAEMON_SET_ARGS.iter().find(|(files, ..)| files.contains(file)).map(|(_, args, _)| *args).unwrap()
}

#[test]
fn upstream_daemon_sets_run_unchanged() {
    // Every one is accepted as `run` checks flags at start, with the peers it names.
    for (files, args, peers) in UPSTREAM_DAEMON_SET_ARGS {
        let checked = ok(args).run.check().unwrap_or_else(|e| panic!("{files}: {e}"));
        assert_eq!(checked.external_peers.len(), *peers, "{files}");
    }
    let generic_all_features = upstream_args("generic-kuberouter-all-features.yaml");
    let kubeadm_all_features_dsr = upstream_args("kubeadm-kuberouter-all-features-dsr.yaml");
    for args in [generic_all_features, kubeadm_all_features_dsr] {
        let run = ok(args).run;
        assert!(
            run.routing.run_router
                && run.policy.run_firewall
                && run.service_proxy.run_service_proxy
                && run.routing.bgp_graceful_restart
        );
        assert_eq!(run.api.kubeconfig.as_deref(), Some(std::path::Path::new("/var/lib/kube-router/kubeconfig")));
        assert!(run.node.enable_cni && run.overlay.enable_overlay && run.service_proxy.strict_external_ip_validation);
        assert!(!run.cleanup_config && run.service_proxy.nodeport_bindon_all_ip);
        assert_eq!((run.node.enable_ipv4, run.node.enable_ipv6), (None, None));
    }
    assert_eq!(ok(generic_all_features).run.upstream.check(), Ok(vec![]));
    let dsr = ok(kubeadm_all_features_dsr).run;
    assert_eq!(dsr.upstream.runtime_endpoint.as_deref(), Some("unix:///run/containerd/containerd.sock"));
    let warnings = dsr.upstream.check().unwrap();
    assert_eq!(warnings.len(), 1);
    assert!(warnings[0].starts_with("--runtime-endpoint has no effect"), "{warnings:?}");

    let run = ok(upstream_args("generic-kuberouter-only-advertise-routes.yaml")).run;
    assert!(run.routing.run_router && !run.policy.run_firewall && !run.service_proxy.run_service_proxy);
    assert!(
        !run.node.enable_cni
            && !run.routing.enable_ibgp
            && !run.overlay.enable_overlay
            && run.routing.bgp_graceful_restart
    );
    assert!(
        run.routing.advertise_cluster_ip && run.routing.advertise_external_ip && run.routing.advertise_loadbalancer_ip
    );
    assert_eq!(run.routing.cluster_asn, 65001);
    let peers = parse_external_peer_flags(
        &run.routing.peer_router_ips,
        &run.routing.peer_router_asns,
        &run.routing.peer_router_passwords,
        &run.routing.peer_router_ports,
    )
    .unwrap();
    assert_eq!(peers.len(), 1);
    assert_eq!(run.upstream.check(), Ok(vec![]));
}

/// docs/flags.md is what `kube-router flags-markdown` prints.
#[test]
fn docs_flags_md_is_current() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/flags.md");
    let generated = crate::flags::markdown(&command().0);
    let written = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        written == generated,
        "docs/flags.md is out of date: run `cargo run -p kube-router -- flags-markdown > docs/flags.md`"
    );
}

/// Each group gives its subsystem's options from its own flags.
#[test]
fn each_group_converts_into_its_subsystems_options() {
    use std::{collections::BTreeSet, net::IpAddr};

    use crate::{
        bpf::{datapath::AttachMode, socket_lb::SocketLbOptions},
        config::ListenerOptions,
        flags::routing::RouterContext,
        routing::bgp::{bfd::BfdConfig, peers::DEFAULT_CLUSTER_ASN},
        routing::overlay::{Encap, OverlayConfig, OverlayType},
        services::family::IpFamily,
    };

    let context = || RouterContext {
        node_name: "node-1".into(),
        state_dir: "/state".into(),
        bpf_root: "/bpf".into(),
        external_peers: Vec::new(),
    };
    let run = ok(&[
        "--cluster-asn=0",
        "--enable-bfd",
        "--bfd-desired-min-tx-interval=300",
        "--overlay-type=full",
        "--overlay-encap=fou",
        "--overlay-encap-port=6000",
        "--bgp-max-prefixes=0",
        "--peer-router-multihop-ttl=0",
        "--advertise-external-ip",
    ])
    .run;
    let router = run.routing.router_options(&run.bfd, &run.overlay, context()).unwrap();
    assert_eq!(router.cluster_asn, DEFAULT_CLUSTER_ASN, "0 is upstream's unset");
    assert_eq!(
        router.bfd,
        Some(BfdConfig {
            desired_min_tx: Duration::from_millis(300),
            required_min_rx: Duration::from_millis(1000),
            multiplier: 3
        })
    );
    assert_eq!(
        router.overlay,
        Some(OverlayConfig { overlay_type: OverlayType::Full, encap: Encap::Fou { port: 6000 } })
    );
    assert_eq!((router.max_prefixes, router.multihop_ttl), (None, None), "0: no limit, no multihop");
    assert!(router.advertise.external_ip && !router.advertise.cluster_ip);
    assert_eq!((router.node_name.as_str(), router.bpf_root.to_str()), ("node-1", Some("/bpf")));
    let defaults = ok(&[]).run;
    let router = defaults.routing.router_options(&defaults.bfd, &defaults.overlay, context()).unwrap();
    assert_eq!((router.bfd, router.overlay.map(|o| o.encap)), (None, Some(Encap::Ipip)));
    let off = ok(&["--run-router=false"]).run;
    assert!(off.routing.router_options(&off.bfd, &off.overlay, context()).is_none());

    let proxy =
        ok(&["--bpf-lb-sock", "--run-service-proxy=false", "--bpf-lb-algorithm=maglev", "--service-udp-timeout=5m"])
            .run
            .service_proxy;
    assert!(!SocketLbOptions::from(&proxy).enabled, "no socket load balancer without the service proxy");
    assert!(proxy.maglev_all());
    assert_eq!(proxy.ct_lifetimes().udp_secs, 300);

    let (v4, v6): (IpAddr, IpAddr) = ("192.0.2.1".parse().unwrap(), "2001:db8::1".parse().unwrap());
    let proxy = ok(&["--nodeport-bindon-all-ip=false"]).run.service_proxy;
    assert_eq!(proxy.nodeport_addresses(|| vec![v4]), Some(vec![v4]));
    assert_eq!(proxy.nodeport_addresses(Vec::new), None, "no node IP yet: every address");
    assert_eq!(ok(&[]).run.service_proxy.nodeport_addresses(|| unreachable!("not asked")), None);

    let families = |args: &[&str], addresses: &[IpAddr]| ok(args).run.node.disabled_families(addresses);
    assert_eq!(families(&[], &[v4]), Ok(BTreeSet::new()));
    assert_eq!(families(&["--enable-ipv6=false"], &[v4, v6]), Ok([IpFamily::IPv6].into()));
    assert!(families(&["--enable-ipv6"], &[v4]).unwrap_err().starts_with("--enable-ipv6: this node has no IPv6"));
    assert!(families(&["--enable-ipv4=false", "--enable-ipv6=false"], &[v4, v6]).is_err());

    let node = ok(&["--enable-cni=false"]).run.node;
    assert!(node.cni_options().is_none());
    assert_eq!(ok(&["--auto-mtu=false"]).run.node.cni_options().map(|c| c.auto_mtu), Some(false));

    let datapath = ok(&["--tc-mode=classic", "--xdp=off"]).run.datapath;
    assert_eq!((datapath.attach_mode(), datapath.pod_attach_mode()), (AttachMode::Classic, AttachMode::Classic));
    assert_eq!(ok(&["--tc-mode=tcx"]).run.datapath.pod_attach_mode(), AttachMode::Tcx);
    assert!(datapath.xdp().is_ok());
    assert!(ok(&["--bpf-lb-map-max=1"]).run.datapath.map_sizes().unwrap_err().contains("--bpf-lb-map-max"));

    let listeners = ListenerOptions::from(&ok(&["--metrics-port=9100", "--health-port=0"]).run.metrics);
    assert_eq!((listeners.metrics_port, listeners.health_port, listeners.metrics_path.as_str()), (9100, 0, "/metrics"));

    let api = ok(&["--kubeconfig="]).run.api;
    assert!(api.api_options().is_none() && matches!(api.source(), crate::config::DesiredSource::Api(_)));
    let file = ok(&["--service-file=/services.yaml"]).run.api;
    assert!(
        matches!(file.source(), crate::config::DesiredSource::File(path) if path == std::path::Path::new("/services.yaml"))
    );
}
