//! kube-router: service proxy, network policy and BGP routing for Kubernetes, on eBPF.
use std::{net::Ipv4Addr, path::PathBuf, process::ExitCode, time::Duration};

use anyhow::Result;
use clap::{Parser, Subcommand};
use kube_router::{
    agent::{self, AgentConfig, DesiredSource},
    bgp::peers::parse_external_peer_flags,
    bpf::{
        datapath,
        service_maps::{read_lb_stats, Conntrack},
        socket_lb::{read_sock_stats, SocketLbOptions},
    },
    k8s::watch::ApiOptions,
    router::{AdvertiseServices, RouterOptions},
    services::compile::Limits,
};
use kube_router_common::{lb_stat, sock_stat, DEFAULT_PIN_DIR};

#[derive(Parser)]
#[command(
    name = "kube-router",
    version,
    about = "Kubernetes service proxy, network policy and BGP routing on an eBPF datapath"
)]
struct Cli {
    /// bpffs directory holding the pinned maps and links.
    #[arg(long, env = "KUBE_ROUTER_BPF_ROOT", default_value = DEFAULT_PIN_DIR, global = true)]
    bpf_root: PathBuf,
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(clap::Args)]
struct RunArgs {
    /// Path to a kubeconfig file. Without it (and without --master) the in-cluster config is used.
    #[arg(long, env = "KUBE_ROUTER_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// The API server URL (overrides the kubeconfig's), e.g. https://10.0.0.1:6443.
    #[arg(long, env = "KUBE_ROUTER_MASTER")]
    master: Option<String>,
    /// Load Services and EndpointSlices from this YAML/JSON file of Kubernetes objects (re-read
    /// when it changes) instead of the API server.
    #[arg(long, env = "KUBE_ROUTER_SERVICE_FILE", conflicts_with_all = ["kubeconfig", "master"])]
    service_file: Option<PathBuf>,
    /// Directory for the checkpoint of the last synced desired state.
    #[arg(long, env = "KUBE_ROUTER_STATE_DIR", default_value = "/var/lib/kube-router")]
    state_dir: PathBuf,
    /// Warn (only warn) once the desired state is older than this many seconds because the API
    /// server is unreachable. Default: never.
    #[arg(long, env = "KUBE_ROUTER_MAX_STALE")]
    max_stale: Option<u64>,
    /// Interfaces to attach the load balancer to (comma-separated). Default: every interface
    /// but lo, re-scanned every 5 s.
    #[arg(long, env = "KUBE_ROUTER_INTERFACES", value_delimiter = ',')]
    interfaces: Option<Vec<String>>,
    /// Node name used for externalTrafficPolicy: Local. Default: the hostname.
    #[arg(long, env = "KUBE_ROUTER_HOSTNAME_OVERRIDE")]
    hostname_override: Option<String>,
    /// Addresses NodePorts listen on (comma-separated). Default: every IPv4 address of the node.
    #[arg(long, env = "KUBE_ROUTER_NODEPORT_ADDRESSES", value_delimiter = ',')]
    nodeport_addresses: Option<Vec<Ipv4Addr>>,
    /// Endpoints per service port beyond this are left out (the first N by address are kept).
    #[arg(long, env = "KUBE_ROUTER_MAX_BACKENDS_PER_SERVICE", default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..=65536))]
    max_backends_per_service: u32,
    /// Port for /metrics (0 disables).
    #[arg(long, env = "KUBE_ROUTER_METRICS_PORT", default_value_t = 0)]
    metrics_port: u16,
    /// Port for /healthz (0 disables).
    #[arg(long, env = "KUBE_ROUTER_HEALTH_PORT", default_value_t = 20244)]
    health_port: u16,
    /// Program the eBPF service load balancer (ClusterIP, NodePort, ExternalIP, LoadBalancer).
    #[arg(long, env = "KUBE_ROUTER_RUN_SERVICE_PROXY", default_value_t = true, action = clap::ArgAction::Set)]
    run_service_proxy: bool,
    /// Socket-level load balancing (cgroup connect/sendmsg/recvmsg/getpeername programs): the
    /// node and hostNetwork pods reach ClusterIPs, ExternalIPs, LoadBalancer IPs and
    /// localhost/node-IP NodePorts. Needs --run-service-proxy.
    #[arg(long, env = "KUBE_ROUTER_BPF_LB_SOCK", default_value_t = true, action = clap::ArgAction::Set)]
    bpf_lb_sock: bool,
    /// cgroup v2 directory the socket load balancer attaches to. Default: the cgroup v2 root
    /// (found in /proc/self/mountinfo), which covers every process on the node.
    #[arg(long, env = "KUBE_ROUTER_CGROUP_ROOT")]
    cgroup_root: Option<PathBuf>,
    /// Enforce Kubernetes NetworkPolicy in the eBPF datapath (needs the API server).
    #[arg(long, env = "KUBE_ROUTER_RUN_FIREWALL", default_value_t = true, action = clap::ArgAction::Set)]
    run_firewall: bool,
    /// Advertise this node's pod CIDR over BGP and install the routes learned from peers.
    #[arg(long, env = "KUBE_ROUTER_RUN_ROUTER", default_value_t = true, action = clap::ArgAction::Set)]
    run_router: bool,
    /// ASN of the cluster's nodes (a node's `kube-router.io/node.asn` annotation overrides it).
    #[arg(long, env = "KUBE_ROUTER_CLUSTER_ASN", default_value_t = 64512, value_parser = clap::value_parser!(u32).range(1..=4_294_967_294))]
    cluster_asn: u32,
    /// BGP router id. Default: the node's IPv4 InternalIP (needed without the API server).
    #[arg(long, env = "KUBE_ROUTER_ROUTER_ID")]
    router_id: Option<Ipv4Addr>,
    /// Prefixes to advertise instead of the Node's spec.podCIDRs (comma-separated).
    #[arg(long, env = "KUBE_ROUTER_POD_CIDRS", value_delimiter = ',')]
    pod_cidrs: Option<Vec<ipnet::IpNet>>,
    /// External BGP peers every node peers with (comma-separated addresses).
    #[arg(long, env = "KUBE_ROUTER_PEER_ROUTER_IPS", value_delimiter = ',')]
    peer_router_ips: Vec<String>,
    /// ASN of each --peer-router-ips entry, in the same order.
    #[arg(long, env = "KUBE_ROUTER_PEER_ROUTER_ASNS", value_delimiter = ',')]
    peer_router_asns: Vec<String>,
    /// Base64-encoded TCP MD5 password of each --peer-router-ips entry (empty for none).
    #[arg(long, env = "KUBE_ROUTER_PEER_ROUTER_PASSWORDS", value_delimiter = ',', hide_env_values = true)]
    peer_router_passwords: Vec<String>,
    /// Peer with every other node of the same ASN (iBGP full mesh).
    #[arg(long, env = "KUBE_ROUTER_NODES_FULL_MESH", default_value_t = true, action = clap::ArgAction::Set)]
    nodes_full_mesh: bool,
    /// TCP port for BGP, listened on and connected to.
    #[arg(long, env = "KUBE_ROUTER_BGP_PORT", default_value_t = 179, value_parser = clap::value_parser!(u16).range(1..))]
    bgp_port: u16,
    /// BGP hold time proposed to peers (e.g. 90s; 0 disables keepalives, else at least 3s).
    #[arg(long, env = "KUBE_ROUTER_BGP_HOLDTIME", default_value = "90s", value_parser = parse_hold_time)]
    bgp_holdtime: Duration,
    /// BGP graceful restart (RFC 4724): peers keep our routes while the agent restarts, and we
    /// keep theirs while they do.
    #[arg(long, env = "KUBE_ROUTER_BGP_GRACEFUL_RESTART", default_value_t = true, action = clap::ArgAction::Set)]
    bgp_graceful_restart: bool,
    /// Restart time advertised to peers: how long they keep our routes (at most 4095s).
    #[arg(long, env = "KUBE_ROUTER_BGP_GRACEFUL_RESTART_TIME", default_value = "90s", value_parser = parse_restart_time)]
    bgp_graceful_restart_time: Duration,
    /// After a start, the longest wait for peers' End-of-RIB before stale kernel routes go.
    #[arg(long, env = "KUBE_ROUTER_BGP_GRACEFUL_RESTART_DEFERRAL_TIME", default_value = "360s", value_parser = parse_duration)]
    bgp_graceful_restart_deferral_time: Duration,
    /// Advertise every Service's ClusterIP(s) over BGP as host routes.
    #[arg(long, env = "KUBE_ROUTER_ADVERTISE_CLUSTER_IP", default_value_t = false, action = clap::ArgAction::Set)]
    advertise_cluster_ip: bool,
    /// Advertise every Service's externalIPs over BGP as host routes.
    #[arg(long, env = "KUBE_ROUTER_ADVERTISE_EXTERNAL_IP", default_value_t = false, action = clap::ArgAction::Set)]
    advertise_external_ip: bool,
    /// Advertise every Service's LoadBalancer ingress IPs over BGP as host routes.
    #[arg(long, env = "KUBE_ROUTER_ADVERTISE_LOADBALANCER_IP", default_value_t = false, action = clap::ArgAction::Set)]
    advertise_loadbalancer_ip: bool,
    /// Routing protocol number on the kernel routes we install (`ip route show proto N`).
    #[arg(long, env = "KUBE_ROUTER_ROUTE_PROTOCOL", default_value_t = kube_router::fib::DEFAULT_ROUTE_PROTOCOL)]
    route_protocol: u8,
    /// Seconds between conntrack garbage collections.
    #[arg(long, env = "KUBE_ROUTER_CONNTRACK_GC_INTERVAL", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    conntrack_gc_interval: u64,
}

#[derive(Subcommand)]
enum Command {
    /// Run the agent (the default).
    Run,
    /// Show service frontends and their backends, read from the pinned maps.
    Services,
    /// Show conntrack entries.
    Conntrack,
    /// Show the datapath packet counters.
    Stats,
    /// Show BGP neighbors and routes of the running agent (asks its health port).
    Bgp,
    /// Show NetworkPolicy verdict counters and what the policy maps hold.
    Policy,
    /// Show the age and contents of the checkpoint in --state-dir.
    Checkpoint,
    /// Uninstall: remove every pinned map and link (TC and cgroup), the kernel routes of our
    /// protocol and the graceful-restart marker. Traffic to services and across nodes stops.
    Cleanup,
}

/// "90", "90s", "5m", "1h" -> Duration.
fn parse_duration(text: &str) -> Result<Duration, String> {
    let (number, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => text.split_at(i),
        None => (text, "s"),
    };
    let n: u64 = number.parse().map_err(|_| format!("{text:?} is not a duration like 90s, 5m or 1h"))?;
    let secs = match unit {
        "s" => n,
        "m" => n * 60,
        "h" => n * 3600,
        _ => return Err(format!("{text:?}: unknown unit {unit:?} (use s, m or h)")),
    };
    Ok(Duration::from_secs(secs))
}

fn parse_hold_time(text: &str) -> Result<Duration, String> {
    let d = parse_duration(text)?;
    match d.as_secs() {
        0 | 3..=65535 => Ok(d),
        _ => Err(format!("{text}: a BGP hold time is 0 or 3s to 65535s (RFC 4271)")),
    }
}

fn parse_restart_time(text: &str) -> Result<Duration, String> {
    let d = parse_duration(text)?;
    if d.as_secs() > 4095 {
        return Err(format!("{text}: the graceful restart time field holds at most 4095s (RFC 4724)"));
    }
    Ok(d)
}

/// Uninstall: pinned programs, links and maps, our kernel routes and the graceful-restart marker.
fn cleanup(cli: &Cli) -> Result<()> {
    let removed = datapath::remove_all(&cli.bpf_root)?;
    println!("removed {removed} pinned objects from {}", cli.bpf_root.display());
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let routes = runtime.block_on(async {
        let fib = kube_router::fib::netlink::NetlinkRoutes::connect(cli.run.route_protocol, 254)?;
        // Reconciling towards nothing deletes exactly our routes.
        let ops = kube_router::fib::reconcile(&fib.list().await?, &Default::default(), true);
        for op in &ops {
            fib.apply(*op).await?;
        }
        anyhow::Ok(ops.len())
    })?;
    println!("removed {routes} kernel routes with protocol {}", cli.run.route_protocol);
    let marker = cli.run.state_dir.join("bgp-graceful-restart");
    if std::fs::remove_file(&marker).is_ok() {
        println!("removed {}", marker.display());
    }
    Ok(())
}

fn show_policy(cli: &Cli) -> Result<()> {
    use kube_router::bpf::policy_maps::{decode, read_policy_stats, BpfPolicyMaps, PolicyMaps};
    use kube_router_common::pol_stat;
    for (name, n) in pol_stat::NAMES.iter().zip(read_policy_stats(&cli.bpf_root)?) {
        println!("{name} {n}");
    }
    let maps = BpfPolicyMaps::open_pinned(&cli.bpf_root)?;
    let contents = maps.read_all().map_err(|e| anyhow::anyhow!("{}: {}", e.map, e.message))?;
    let entries = decode(&contents)?;
    for (key, value) in &entries.pod_slots {
        println!(
            "pod {} {:?}: {} rule(s) in slot {}{}",
            key.pod_ip,
            key.direction,
            value.rule_count,
            value.slot.0,
            if value.rule_count == 0 { " (default deny)" } else { "" }
        );
    }
    println!(
        "{} isolated pod directions, {} rules, {} peer prefixes",
        entries.pod_slots.len(),
        entries.slot_rules.len(),
        entries.peer_prefixes.len()
    );
    Ok(())
}

fn show_checkpoint(cli: &Cli) -> Result<()> {
    let saved = kube_router::k8s::checkpoint::read(&cli.run.state_dir)?;
    let age = kube_router::metrics::unix_now() - saved.written_unix;
    println!("checkpoint in {}: written {:.0} s ago", cli.run.state_dir.display(), age);
    println!(
        "services {}  endpointslices {}  pods {}  namespaces {}  nodes {}  networkpolicies {}",
        saved.services.len(),
        saved.endpoint_slices.len(),
        saved.pods.len(),
        saved.namespaces.len(),
        saved.nodes.len(),
        saved.network_policies.len()
    );
    Ok(())
}

fn show_bgp(cli: &Cli) -> Result<()> {
    use std::io::{Read, Write};
    let port = cli.run.health_port;
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port))
        .map_err(|e| anyhow::anyhow!("cannot reach the agent on 127.0.0.1:{port} (--health-port): {e}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.write_all(b"GET /bgp HTTP/1.0\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let body = response.split_once("\r\n\r\n").map_or(response.as_str(), |(_, b)| b);
    print!("{body}");
    Ok(())
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

fn fmt_addr(addr_be: u32, port_be: u16) -> String {
    format!("{}:{}", Ipv4Addr::from(addr_be.to_ne_bytes()), u16::from_be(port_be))
}

fn show_services(cli: &Cli) -> Result<()> {
    let contents = agent::read_programmed(&cli.bpf_root)?;
    for (key, value) in &contents.services {
        let proto = if key.proto == 6 { "tcp" } else { "udp" };
        let backends: Vec<String> = (0..value.backend_count)
            .filter_map(|slot| {
                contents.slots.get(&kube_router_common::BackendSlotKey { service_id: value.service_id, slot })
            })
            .filter_map(|s| contents.backends.get(&s.backend_id))
            .map(|b| fmt_addr(b.addr, b.port))
            .collect();
        println!(
            "{proto} {} id={} flags={:#x} backends=[{}]",
            fmt_addr(key.addr, key.port),
            value.service_id,
            value.flags,
            backends.join(", ")
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let result = match cli.command.as_ref().unwrap_or(&Command::Run) {
        Command::Run => run(&cli),
        Command::Services => show_services(&cli),
        Command::Conntrack => Conntrack::open_pinned(&cli.bpf_root).and_then(|ct| {
            for (k, v) in ct.entries()? {
                let kind = if v.flags & kube_router_common::CT_FLAG_REVERSE != 0 { "reverse" } else { "forward" };
                println!(
                    "{} {} -> {} nat={} flags={:#x} service={} backend={}",
                    kind,
                    fmt_addr(k.src_addr, k.src_port),
                    fmt_addr(k.dst_addr, k.dst_port),
                    fmt_addr(v.nat_addr, v.nat_port),
                    v.flags,
                    v.service_id,
                    v.backend_id
                );
            }
            Ok(())
        }),
        Command::Bgp => show_bgp(&cli),
        Command::Policy => show_policy(&cli),
        Command::Checkpoint => show_checkpoint(&cli),
        Command::Stats => read_lb_stats(&cli.bpf_root).map(|stats| {
            for (name, n) in lb_stat::NAMES.iter().zip(stats) {
                println!("{name} {n}");
            }
            // The socket load balancer's counters, if it ever ran.
            for (name, n) in sock_stat::NAMES.iter().zip(read_sock_stats(&cli.bpf_root).unwrap_or_default()) {
                println!("sock_{name} {n}");
            }
        }),
        Command::Cleanup => cleanup(&cli),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: &Cli) -> Result<()> {
    let args = &cli.run;
    let external_peers =
        match parse_external_peer_flags(&args.peer_router_ips, &args.peer_router_asns, &args.peer_router_passwords) {
            Ok(peers) => peers,
            Err(e) => {
                use clap::CommandFactory;
                Cli::command().error(clap::error::ErrorKind::ValueValidation, e.to_string()).exit()
            }
        };
    let node_name = args.hostname_override.clone().unwrap_or_else(hostname);
    let router = args.run_router.then(|| RouterOptions {
        node_name: node_name.clone(),
        cluster_asn: args.cluster_asn,
        router_id: args.router_id,
        pod_cidrs: args.pod_cidrs.clone(),
        external_peers,
        ibgp_mesh: args.nodes_full_mesh,
        bgp_port: args.bgp_port,
        hold_time: args.bgp_holdtime,
        graceful_restart: args.bgp_graceful_restart,
        graceful_restart_time: args.bgp_graceful_restart_time,
        graceful_restart_deferral: args.bgp_graceful_restart_deferral_time,
        route_protocol: args.route_protocol,
        route_table: 254,
        state_dir: args.state_dir.clone(),
        advertise: AdvertiseServices {
            cluster_ip: args.advertise_cluster_ip,
            external_ip: args.advertise_external_ip,
            load_balancer_ip: args.advertise_loadbalancer_ip,
        },
    });
    let config = AgentConfig {
        pin_dir: cli.bpf_root.clone(),
        source: match &args.service_file {
            Some(path) => DesiredSource::File(path.clone()),
            None => DesiredSource::Api(ApiOptions { kubeconfig: args.kubeconfig.clone(), master: args.master.clone() }),
        },
        state_dir: args.state_dir.clone(),
        max_stale: args.max_stale.map(Duration::from_secs),
        interfaces: args.interfaces.clone(),
        node_name,
        nodeport_addresses: args.nodeport_addresses.clone(),
        limits: Limits { max_backends_per_service: args.max_backends_per_service as usize },
        metrics_port: args.metrics_port,
        health_port: args.health_port,
        conntrack_gc_interval: Duration::from_secs(args.conntrack_gc_interval),
        run_service_proxy: args.run_service_proxy,
        run_firewall: args.run_firewall,
        socket_lb: SocketLbOptions {
            enabled: args.bpf_lb_sock && args.run_service_proxy,
            cgroup_root: args.cgroup_root.clone(),
        },
        router,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(agent::run(config))
}
