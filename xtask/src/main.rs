//! Developer tasks: `cargo xtask build-ebpf | image | test | bench | demo`.
use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

mod demo;
mod image;
mod test_runner;

#[derive(Parser)]
#[command(name = "xtask")]
struct Cli {
    #[command(subcommand)]
    command: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Build the eBPF datapath object (kube-router-ebpf) into target/bpf/kube-router.bpf.o.
    BuildEbpf,
    /// The container image: a static (musl) agent in a from-scratch OCI image, committed to local
    /// containers storage as localhost/kube-router:<version> and written to
    /// target/image/kube-router.oci.tar (buildah, no daemon; root).
    Image,
    /// Everything CI checks: fmt, clippy, unit tests, in-kernel datapath tests, end-to-end tests (root).
    Test,
    /// Benchmarks: per-packet cost (BPF_PROG_TEST_RUN), socket LB per call, map sync time, policy sync against iptables (root).
    Bench,
    /// One agent among a 5,000-node cluster's objects (root; ~10 minutes): cold start, checkpoint,
    /// churn, BGP. `KRT_SCALE=0.05` for a quick look (tests/benches/cluster_scale.rs).
    Scale,
    /// Bring up a small cluster in network namespaces and show the datapath at work (root).
    Demo,
}

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf()
}

fn cargo(args: &[&str]) -> Result<()> {
    run(Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())).args(args))
}

fn run(cmd: &mut Command) -> Result<()> {
    eprintln!("xtask: {cmd:?}");
    let status = cmd.current_dir(workspace_root()).status().with_context(|| format!("starting {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed with {status}");
    }
    Ok(())
}

/// The same build kube-router's build.rs runs through aya-build, with its output kept in
/// target/ for inspection (`llvm-objdump`, `bpftool btf dump file`).
fn build_ebpf() -> Result<()> {
    let root = workspace_root();
    run(Command::new("rustup")
        .args(["run", "nightly", "cargo", "build", "--package", "kube-router-ebpf", "--bins", "--release"])
        .args(["--target", "bpfel-unknown-none", "-Z", "build-std=core"])
        .env("CARGO_ENCODED_RUSTFLAGS", "--cfg=bpf_target_arch=\"x86_64\"\x1f-Cdebuginfo=2\x1f-Clink-arg=--btf")
        .env_remove("RUSTC")
        .env_remove("RUSTC_WORKSPACE_WRAPPER"))?;
    let built = root.join("target/bpfel-unknown-none/release/kube-router");
    let out_dir = root.join("target/bpf");
    std::fs::create_dir_all(&out_dir)?;
    let out = out_dir.join("kube-router.bpf.o");
    std::fs::copy(&built, &out).with_context(|| format!("copying {}", built.display()))?;
    println!("{}", out.display());
    Ok(())
}

fn require_root() -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("this task loads BPF programs and creates network namespaces: run it as root");
    }
    Ok(())
}

fn test() -> Result<()> {
    require_root()?;
    // A developer's shortcut, never CI's: only the test binaries whose names contain one of
    // these words (comma-separated), without the checks and the image before them.
    let only: Vec<String> = std::env::var("KRT_TEST_ONLY")
        .map(|words| words.split(',').filter(|w| !w.is_empty()).map(String::from).collect())
        .unwrap_or_default();
    if only.is_empty() {
        cargo(&["fmt", "--all", "--check"])?;
        cargo(&["clippy", "--all-targets", "--", "-D", "warnings"])?;
        run(Command::new("rustup")
            .args(["run", "nightly", "cargo", "clippy", "--package", "kube-router-ebpf", "--release"])
            .args(["--target", "bpfel-unknown-none", "-Z", "build-std=core", "--", "-D", "warnings"])
            .env_remove("RUSTC")
            .env_remove("RUSTC_WORKSPACE_WRAPPER"))?;
        // The image smoke test (tests/tests/image_smoke.rs) runs the image this builds.
        image::build()?;
    }
    // The end-to-end tests start this binary.
    cargo(&["build", "-p", "kube-router", "--bins"])?;
    // Unit, in-kernel and end-to-end tests: each binary in its own mount namespace, several
    // binaries at once (KRT_TEST_JOBS, default 2), the tests inside one binary one at a time.
    let root = workspace_root();
    let mut jobs = test_runner::build_jobs(&root, &["--lib", "--bins", "--tests"])?;
    if !only.is_empty() {
        jobs.retain(|job| only.iter().any(|word| job.name.contains(word.as_str())));
    }
    // Longest first (LONGEST_FIRST), so that the last job to finish is a short one; the rest
    // keep cargo's order.
    jobs.sort_by_key(|job| LONGEST_FIRST.iter().position(|name| *name == job.name).unwrap_or(LONGEST_FIRST.len()));
    // Kernels before 6.6 attach through classic tc: the tests that attach, re-adopt after a
    // restart and detach, again with every agent forced onto that path (the environment
    // reaches the agents they start). DEVELOPERS.md says what this covers and why.
    let mut classic = Vec::new();
    for (suite, tests) in CLASSIC_TC_PASS {
        let job = jobs.iter().find(|job| job.target == *suite && job.name.ends_with(&format!("/{suite}")));
        let Some(job) = job else {
            if only.is_empty() {
                bail!("CLASSIC_TC_PASS names {suite}, which is no test suite");
            }
            continue;
        };
        let mut args = vec!["--exact"];
        args.extend(tests.iter().copied());
        classic.push(job.rerun("classic-tc", &args, &[("KUBE_ROUTER_TC_MODE", "classic")]));
    }
    jobs.extend(classic);
    let workers = std::env::var("KRT_TEST_JOBS").ok().and_then(|n| n.parse().ok()).unwrap_or(2);
    let results = test_runner::run_jobs(&root, jobs, workers)?;
    let (mut passed, mut failed) = (0, 0);
    let mut classic_passed = 0;
    println!("== test binaries by time:");
    let mut by_time: Vec<_> = results.iter().collect();
    by_time.sort_by_key(|result| std::cmp::Reverse(result.elapsed));
    for result in &by_time {
        let verdict = if result.ok { "ok" } else { "FAILED" };
        println!(
            "{:>6.0} s  {verdict:6}  {} ({} passed, {} failed)",
            result.elapsed.as_secs_f64(),
            result.name,
            result.passed,
            result.failed
        );
        passed += result.passed;
        // A binary that died without a summary (a crash, a timeout) counts as one failure.
        failed += if result.ok { result.failed } else { result.failed.max(1) };
        if result.name.ends_with("+classic-tc") {
            classic_passed += result.passed;
        }
    }
    let listed = CLASSIC_TC_PASS.iter().map(|(_, tests)| tests.len() as u64).sum::<u64>();
    if only.is_empty() && failed == 0 && classic_passed != listed {
        bail!("the classic tc pass ran {classic_passed} tests where CLASSIC_TC_PASS lists {listed}: one was renamed or removed");
    }
    // One closing line for the whole run (cargo prints one per test binary).
    println!("all tests: {passed} passed, {failed} failed");
    if failed > 0 || passed == 0 {
        bail!("{failed} tests failed, {passed} passed");
    }
    Ok(())
}

/// Test binaries that take longest, longest first: a run on 2026-12-06 (the 16 over 35 s; the
/// table `== test binaries by time` that closes a run gives the figures to update this from).
const LONGEST_FIRST: &[&str] = &[
    // Builds the last release from git first: minutes on a clean checkout (20 s when cached).
    "tests/upgrade",
    "tests/api_outage",
    "tests/cluster_paths",
    "tests/dual_stack",
    "tests/bgp_interop",
    "tests/hostile_lbflows",
    "tests/bgp_fabric",
    "tests/bgp_mesh",
    "tests/cluster_dsr",
    "tests/service_lb",
    "kube-router/datapath_nat",
    "kube-router/policy_datapath",
    "tests/bgp_overlay",
    "tests/node_integration",
    "tests/hostile_policy",
    "tests/network_policy",
];

/// The classic tc pass of `cargo xtask test`: per suite, the tests run again with every agent on
/// classic tc. Pod veths are on classic tc in every mode (`--tc-mode auto`), so this pass is
/// about node interfaces: serving through them, re-adopting their filters after a restart,
/// attaching and detaching as they come and go (DEVELOPERS.md, the test suite).
const CLASSIC_TC_PASS: &[(&str, &[&str])] = &[
    (
        "service_lb",
        &[
            "cluster_ip_node_port_spread_and_affinity",
            "restart_reuses_pinned_state_and_traffic_flows_without_the_agent",
            "interfaces_are_attached_as_they_appear_and_their_pins_go_with_them",
        ],
    ),
    ("service_lb_v6", &["restart_with_unchanged_state_writes_nothing_and_ipv6_flows_while_the_agent_is_down"]),
    (
        "cluster_paths",
        &[
            "north_south_to_a_backend_on_the_other_node_is_source_natted",
            "local_backends_keep_the_client_address_and_traffic_policy_local_stays_on_the_node",
        ],
    ),
    ("node_integration", &["pods_reach_the_internet_through_the_node_masquerade"]),
    ("dual_stack", &["a_dual_stack_service_answers_on_both_cluster_ips_and_its_ipv6_node_port_from_the_same_backend"]),
];

fn bench() -> Result<()> {
    require_root()?;
    cargo(&["bench", "-p", "kube-router", "--bench", "datapath"])?;
    // Packets per second one CPU forwards: XDP fast path vs TC vs kernel routing (live frames).
    cargo(&["bench", "-p", "kube-router", "--bench", "xdp_rate"])?;
    // New flows per second through a ClusterIP on one core: the node's datapath alone, ours
    // against kube-proxy's iptables and nftables rules.
    cargo(&["bench", "-p", "kube-router", "--bench", "new_flow_rate"])?;
    cargo(&["bench", "-p", "kube-router", "--bench", "policy_datapath"])?;
    // connect()/sendto() with and without the socket load balancer (own netns and cgroups).
    cargo(&["bench", "-p", "kube-router", "--bench", "socket_lb"])?;
    // Compile + map writes against ipset/iptables-restore in a private network namespace.
    cargo(&["bench", "-p", "kube-router", "--bench", "policy_compile"])?;
    // Decoding a 10,000-Service --service-file (YAML and kubectl's JSON) against generic trees.
    cargo(&["bench", "-p", "kube-router", "--bench", "service_file"])?;
    // The API benchmark runs the agent as a process: measure the optimised build.
    cargo(&["build", "--release", "-p", "kube-router"])?;
    let agent = workspace_root().join("target/release/kube-router");
    run(Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["bench", "-p", "kube-router-tests", "--bench", "api_sync"])
        .env("KUBE_ROUTER_BIN", &agent))?;
    run(Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["bench", "-p", "kube-router-tests", "--bench", "attach_latency"])
        .env("KUBE_ROUTER_BIN", &agent))?;
    // Real packets through a Service: this datapath against kube-proxy's iptables and nftables.
    run(Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["bench", "-p", "kube-router-tests", "--bench", "service_datapath"])
        .env("KUBE_ROUTER_BIN", &agent))?;
    // North-south through a NodePort with the XDP fast path against TC alone.
    run(Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["bench", "-p", "kube-router-tests", "--bench", "xdp_north_south"])
        .env("KUBE_ROUTER_BIN", &agent))?;
    // Sustained new connections on a small SNAT range with the conntrack GC lagging vs running.
    run(Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["bench", "-p", "kube-router-tests", "--bench", "snat_churn"])
        .env("KUBE_ROUTER_BIN", &agent))?;
    run(Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["bench", "-p", "kube-router-tests", "--bench", "bgp_convergence"])
        .env("KUBE_ROUTER_BIN", &agent))
}

fn scale() -> Result<()> {
    require_root()?;
    cargo(&["build", "--release", "-p", "kube-router", "-p", "kube-router-tests", "--bins"])?;
    run(Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["bench", "-p", "kube-router-tests", "--bench", "cluster_scale"])
        .env("KUBE_ROUTER_BIN", workspace_root().join("target/release/kube-router")))
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Task::BuildEbpf => build_ebpf(),
        Task::Image => {
            require_root()?;
            image::build()
        }
        Task::Test => test(),
        Task::Bench => bench(),
        Task::Scale => scale(),
        Task::Demo => {
            require_root()?;
            cargo(&["build", "-p", "kube-router", "-p", "kube-router-tests", "--bins"])?;
            demo::run()
        }
    }
}
