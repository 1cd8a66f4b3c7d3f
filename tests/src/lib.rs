//! Test hosts as network namespaces, joined by veths, and the processes running in them.
//!
//! Everything created here is torn down on drop. The agent runs with `nsenter --net` (not
//! `ip netns exec`, which remounts /sys and would hide the host's bpffs at /sys/fs/bpf).
use std::{
    collections::BTreeMap,
    fs,
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

pub use agent_metrics::{LinkAttaches, PolicySyncs, Scrape, ServiceSyncs, Writes};

pub mod agent_metrics;
pub mod apiserver;
pub mod cluster;
pub mod gobgp;
pub mod image;
pub mod kube_proxy;
pub mod raw_bgp;

pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"))
}

/// The binaries under test: `KUBE_ROUTER_BIN` or the workspace's debug build.
pub fn kube_router_bin() -> PathBuf {
    std::env::var_os("KUBE_ROUTER_BIN").map(PathBuf::from).unwrap_or_else(|| target_dir().join("debug/kube-router"))
}

/// Cargo puts the package's binaries in the profile folder: beside a binary that uses this
/// library, or one above a test executable (which lives in `deps/`).
pub fn netprobe_bin() -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_default();
    let exe_dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    [exe_dir.clone(), exe_dir.parent().map(Path::to_path_buf).unwrap_or_default()]
        .into_iter()
        .map(|dir| dir.join("krt-netprobe"))
        .find(|p| p.exists())
        .unwrap_or_else(|| target_dir().join("debug/krt-netprobe"))
}

pub fn sh(args: &[&str]) -> Result<String> {
    let out = Command::new(args[0]).args(&args[1..]).output().with_context(|| format!("running {args:?}"))?;
    if !out.status.success() {
        bail!("{args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub struct Netns {
    pub name: String,
    children: Mutex<Vec<Child>>,
}

impl Netns {
    pub fn new(name: &str) -> Result<Self> {
        let _ = Command::new("ip").args(["netns", "delete", name]).output();
        sh(&["ip", "netns", "add", name])?;
        let ns = Self { name: name.to_string(), children: Mutex::new(Vec::new()) };
        ns.run(&["ip", "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    pub fn path(&self) -> String {
        format!("/run/netns/{}", self.name)
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net={}", self.path())).args(args);
        cmd
    }

    /// Runs a command inside the namespace and returns its stdout.
    pub fn run(&self, args: &[&str]) -> Result<String> {
        let out = self.command(args).output().with_context(|| format!("running {args:?} in {}", self.name))?;
        if !out.status.success() {
            bail!("{args:?} in {} failed: {}", self.name, String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The agent's `/metrics` text, served on 127.0.0.1:`port` inside the namespace.
    pub fn scrape_metrics(&self, port: impl std::fmt::Display) -> Result<String> {
        self.run(&[netprobe_bin().to_str().unwrap(), "http", &format!("127.0.0.1:{port}"), "/metrics"])
    }

    /// Starts a long-running process in the namespace; it is killed when the namespace drops.
    pub fn spawn(&self, args: &[&str]) -> Result<()> {
        let child = self.command(args).stdout(Stdio::null()).stderr(Stdio::null()).spawn()?;
        self.children.lock().unwrap().push(child);
        Ok(())
    }

    /// Starts a process whose stdout lines are collected into the returned buffer.
    pub fn spawn_collecting(&self, args: &[&str]) -> Result<Arc<Mutex<Vec<String>>>> {
        let mut child = self.command(args).stdout(Stdio::piped()).stderr(Stdio::null()).spawn()?;
        let lines = Arc::new(Mutex::new(Vec::new()));
        let stdout = child.stdout.take().context("stdout")?;
        let sink = lines.clone();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                sink.lock().unwrap().push(line);
            }
        });
        self.children.lock().unwrap().push(child);
        Ok(lines)
    }

    pub fn sysctl(&self, key: &str, value: &str) -> Result<()> {
        self.run(&["sysctl", "-qw", &format!("{key}={value}")]).map(|_| ())
    }

    /// Waits until the kernel has finished IPv6 duplicate address detection on every link, so
    /// the link-local addresses and their `local` routes exist. Before that the route table is
    /// still changing by itself, which would make a before/after comparison meaningless.
    pub fn wait_addresses_settled(&self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let tentative = self.run(&["ip", "-6", "addr", "show", "tentative"])?;
            let links_up = self.run(&["ip", "-o", "link", "show", "up"])?.lines().count();
            let link_locals = self.run(&["ip", "-6", "-o", "addr", "show", "scope", "link"])?.lines().count();
            // lo has no link-local address; every other up link gets one.
            if tentative.trim().is_empty() && link_locals + 1 >= links_up {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("addresses in {} still tentative after 15 s: {tentative}", self.name);
            }
            thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for child in self.children.lock().unwrap().iter_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = Command::new("ip").args(["netns", "delete", &self.name]).output();
    }
}

/// A veth pair between two namespaces with an address (CIDR) on each end.
pub fn veth(a: &Netns, a_if: &str, a_addr: &str, b: &Netns, b_if: &str, b_addr: &str) -> Result<()> {
    a.run(&["ip", "link", "add", a_if, "type", "veth", "peer", "name", b_if, "netns", &b.path()])?;
    for (ns, ifname, addr) in [(a, a_if, a_addr), (b, b_if, b_addr)] {
        ns.run(&["ip", "addr", "add", addr, "dev", ifname])?;
        ns.run(&["ip", "link", "set", ifname, "up"])?;
    }
    Ok(())
}

/// client --- node --- backend-1..n, IPv4 and IPv6 on every link. The node routes; the agent
/// runs in it.
pub struct Topology {
    pub prefix: String,
    pub client: Netns,
    pub node: Netns,
    pub backends: Vec<Netns>,
}

pub const CLIENT_ADDR: &str = "10.0.1.2";
pub const NODE_ADDR: &str = "10.0.1.1";
/// The IPv6 twins of the addresses above (each link also has a /64; DAD off).
pub const CLIENT_ADDR6: &str = "fd00:1::2";
pub const NODE_ADDR6: &str = "fd00:1::1";

pub fn backend_addr(i: usize) -> String {
    format!("10.0.{}.2", 10 + i)
}

/// Backend `i`'s IPv6 address.
pub fn backend_addr6(i: usize) -> String {
    format!("fd00:{}::2", 10 + i)
}

/// IPv6 addresses of the first `n` backends.
pub fn backend_addrs6(n: usize) -> Vec<String> {
    (0..n).map(backend_addr6).collect()
}

/// Adds an IPv6 address without duplicate address detection (usable at once).
fn add_addr6(ns: &Netns, dev: &str, addr: &str) -> Result<()> {
    ns.run(&["ip", "-6", "addr", "add", addr, "dev", dev, "nodad"]).map(|_| ())
}

/// Addresses of the first `n` backends.
pub fn backend_addrs(n: usize) -> Vec<String> {
    (0..n).map(backend_addr).collect()
}

pub const VIP: &str = "10.96.0.10";
pub const STICKY_VIP: &str = "10.96.0.11";

/// The tests' two Services: `web` (ClusterIP [`VIP`], NodePort 30080) over `web_backends`, and
/// `sticky` (ClusterIP [`STICKY_VIP`], ClientIP affinity) over backends 1-3.
pub fn web_and_sticky(web_backends: &[String]) -> String {
    let web = service_objects(&ServiceSpec {
        name: "web",
        cluster_ip: VIP,
        node_port: Some(30080),
        affinity: false,
        backends: web_backends,
    });
    let all = backend_addrs(3);
    let sticky = service_objects(&ServiceSpec {
        name: "sticky",
        cluster_ip: STICKY_VIP,
        node_port: None,
        affinity: true,
        backends: &all,
    });
    format!("{web}{sticky}")
}

impl Topology {
    pub fn new(prefix: &str, backends: usize) -> Result<Self> {
        let client = Netns::new(&format!("{prefix}-client"))?;
        let node = Netns::new(&format!("{prefix}-node"))?;
        node.sysctl("net.ipv4.ip_forward", "1")?;
        node.sysctl("net.ipv6.conf.all.forwarding", "1")?;
        veth(&node, "to-client", &format!("{NODE_ADDR}/24"), &client, "eth0", &format!("{CLIENT_ADDR}/24"))?;
        client.run(&["ip", "route", "add", "default", "via", NODE_ADDR])?;
        add_addr6(&node, "to-client", &format!("{NODE_ADDR6}/64"))?;
        add_addr6(&client, "eth0", &format!("{CLIENT_ADDR6}/64"))?;
        client.run(&["ip", "-6", "route", "add", "default", "via", NODE_ADDR6])?;
        let mut list = Vec::new();
        for i in 0..backends {
            let ns = Netns::new(&format!("{prefix}-b{}", i + 1))?;
            let net = 10 + i;
            veth(
                &node,
                &format!("to-b{}", i + 1),
                &format!("10.0.{net}.1/24"),
                &ns,
                "eth0",
                &format!("10.0.{net}.2/24"),
            )?;
            ns.run(&["ip", "route", "add", "default", "via", &format!("10.0.{net}.1")])?;
            add_addr6(&node, &format!("to-b{}", i + 1), &format!("fd00:{net}::1/64"))?;
            add_addr6(&ns, "eth0", &format!("fd00:{net}::2/64"))?;
            ns.run(&["ip", "-6", "route", "add", "default", "via", &format!("fd00:{net}::1")])?;
            let name = format!("backend-{}", i + 1);
            for port in ["8080", "5353"] {
                ns.spawn(&[netprobe_bin().to_str().unwrap(), "serve", &name, port])?;
            }
            list.push(ns);
        }
        // Give the servers a moment to bind.
        thread::sleep(Duration::from_millis(300));
        Ok(Self { prefix: prefix.to_string(), client, node, backends: list })
    }

    pub fn bpf_root(&self) -> PathBuf {
        PathBuf::from(format!("/sys/fs/bpf/{}", self.prefix))
    }

    /// `count` requests from the client; returns the replies (backend names or "ERR ...").
    pub fn request(&self, proto: &str, addr: &str, count: usize) -> Result<Vec<String>> {
        let out = self.client.run(&[netprobe_bin().to_str().unwrap(), "request", proto, addr, &count.to_string()])?;
        Ok(out.lines().map(str::to_string).collect())
    }
}

pub fn tally(replies: &[String]) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for r in replies {
        *counts.entry(r.clone()).or_insert(0) += 1;
    }
    counts
}

/// A kube-router agent process running in a namespace, with its log captured.
pub struct Agent {
    child: Child,
    pub log: Arc<Mutex<Vec<String>>>,
    /// The network namespace it runs in, and its `--metrics-port` there (`agent_metrics`).
    netns: String,
    metrics_port: Option<u16>,
}

impl Agent {
    /// Starts the agent in `ns`. The socket load balancer stays off unless `args` name a
    /// `--cgroup-root` (or set `--bpf-lb-sock`): its default target is the machine's cgroup v2
    /// root, which a test must never touch.
    pub fn start(ns: &Netns, bpf_root: &Path, args: &[&str]) -> Result<Self> {
        Self::spawn(ns, None, bpf_root, args, &[])
    }

    /// As [`Agent::start`], with environment variables besides (as a DaemonSet's `env`).
    pub fn start_with_env(ns: &Netns, bpf_root: &Path, args: &[&str], env: &[(&str, &str)]) -> Result<Self> {
        Self::spawn(ns, None, bpf_root, args, env)
    }

    /// As [`Agent::start`], the agent a process of `cgroup` (a [`TestCgroup`] or a child) from
    /// its first instruction, as a DaemonSet's container is.
    pub fn start_in_cgroup(ns: &Netns, cgroup: &Path, bpf_root: &Path, args: &[&str]) -> Result<Self> {
        Self::spawn(ns, Some(cgroup), bpf_root, args, &[])
    }

    fn spawn(ns: &Netns, cgroup: Option<&Path>, bpf_root: &Path, args: &[&str], env: &[(&str, &str)]) -> Result<Self> {
        let socket_lb_chosen = args.iter().any(|a| a.starts_with("--cgroup-root") || a.starts_with("--bpf-lb-sock"));
        let socket_lb_off: &[&str] = if socket_lb_chosen { &[] } else { &["--bpf-lb-sock", "false"] };
        let mut command = Command::new("nsenter");
        command.arg(format!("--net={}", ns.path()));
        if let Some(cgroup) = cgroup {
            // The shell moves itself in, then becomes the agent (same pid).
            command.args(["sh", "-c", "echo $$ > \"$0/cgroup.procs\" && exec \"$@\""]).arg(cgroup);
        }
        // A profiler's wrapper (`scripts/heaptrack-exec.sh`), which must exec the agent so the
        // pid, /proc figures and kill stay the agent's.
        if let Some(wrapper) = std::env::var_os("KRT_AGENT_WRAPPER") {
            command.arg(wrapper);
        }
        let mut child = command
            .arg(kube_router_bin())
            .arg("--bpf-root")
            .arg(bpf_root)
            .args(socket_lb_off)
            .args(args)
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting kube-router")?;
        let log = Arc::new(Mutex::new(Vec::new()));
        let sink = log.clone();
        let stderr = child.stderr.take().context("stderr")?;
        thread::spawn(move || {
            let quiet = std::env::var_os("KRT_QUIET_AGENT").is_some();
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if !quiet {
                    eprintln!("    agent: {line}");
                }
                sink.lock().unwrap().push(line);
            }
        });
        let metrics_port = args
            .iter()
            .zip(args.iter().skip(1))
            .find_map(|(flag, value)| (*flag == "--metrics-port").then_some(*value))
            .or_else(|| args.iter().find_map(|a| a.strip_prefix("--metrics-port=")))
            .and_then(|port| port.parse().ok())
            .filter(|port| *port != 0);
        Ok(Self { child, log, netns: ns.path(), metrics_port })
    }

    /// Waits until the log has `n` lines containing `needle`; returns the last of them.
    pub fn wait_for_log(&mut self, needle: &str, n: usize, timeout: Duration) -> Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let matching: Vec<String> =
                self.log.lock().unwrap().iter().filter(|l| l.contains(needle)).cloned().collect();
            if matching.len() >= n {
                return Ok(matching[n - 1].clone());
            }
            if let Some(status) = self.child.try_wait()? {
                bail!("agent exited ({status}) before logging {needle:?}");
            }
            if Instant::now() > deadline {
                bail!("agent did not log {needle:?} {n} time(s) within {timeout:?}");
            }
            thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Peak resident memory (VmHWM) of the agent process, in KiB.
    pub fn peak_rss_kib(&self) -> Option<u64> {
        let status = fs::read_to_string(format!("/proc/{}/status", self.child.id())).ok()?;
        status.lines().find(|l| l.starts_with("VmHWM:"))?.split_whitespace().nth(1)?.parse().ok()
    }

    /// Resident memory now (`VmRSS`), KiB.
    pub fn rss_kib(&self) -> Option<u64> {
        let status = fs::read_to_string(format!("/proc/{}/status", self.child.id())).ok()?;
        status.lines().find(|l| l.starts_with("VmRSS:"))?.split_whitespace().nth(1)?.parse().ok()
    }

    pub fn log_count(&self, needle: &str) -> usize {
        self.log.lock().unwrap().iter().filter(|l| l.contains(needle)).count()
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Whether the agent handles SIGTERM yet (`SigCgt` in its /proc status): before, the
    /// signal's default action would kill it.
    pub fn catches_sigterm(&self) -> bool {
        let status = fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap_or_default();
        // Until nsenter has executed the agent, the process is nsenter.
        if status.lines().next() != Some("Name:\tkube-router") {
            return false;
        }
        let caught = status.lines().find_map(|l| l.strip_prefix("SigCgt:")).map(str::trim);
        caught.and_then(|mask| u64::from_str_radix(mask, 16).ok()).is_some_and(|mask| mask & (1 << (15 - 1)) != 0)
    }

    /// Sends SIGTERM without waiting ([`Agent::wait_exit`]).
    pub fn sigterm(&self) -> Result<()> {
        sh(&["kill", "-TERM", &self.child.id().to_string()]).map(drop)
    }

    /// Waits at most `timeout` for the agent to exit; its status.
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            if Instant::now() > deadline {
                bail!("agent still running {timeout:?} after it was told to stop");
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM and wait: the graceful stop.
    pub fn stop(mut self) -> Result<()> {
        sh(&["kill", "-TERM", &self.child.id().to_string()])?;
        let status = self.child.wait()?;
        if !status.success() {
            bail!("agent exited with {status} on SIGTERM");
        }
        Ok(())
    }

    /// SIGKILL: a crash.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls `check` until it says true; an error counts as "not yet" and is reported on timeout.
pub fn wait_until(what: &str, timeout: Duration, mut check: impl FnMut() -> Result<bool>) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let mut last_error = String::new();
    loop {
        match check() {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(e) => last_error = format!("{e:#}"),
        }
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what} {last_error}");
        }
        thread::sleep(Duration::from_millis(50));
    }
}

/// The agent's BGP status as `kube-router bgp -o json` prints it (`routing/bgp/report.rs`), asked
/// over its metrics port from inside `ns`. `running` is false until the speaker has started.
pub fn bgp_status(ns: &Netns, metrics_port: &str) -> Result<serde_json::Value> {
    let out = ns.run(&[kube_router_bin().to_str().unwrap(), "--metrics-port", metrics_port, "bgp", "-o", "json"])?;
    serde_json::from_str(&out).with_context(|| format!("bgp -o json printed {out:?}"))
}

/// One neighbor of a [`bgp_status`] report, by address (`Null` if it has none).
pub fn bgp_neighbor(status: &serde_json::Value, address: &str) -> serde_json::Value {
    let neighbors = status["neighbors"].as_array().map(Vec::as_slice).unwrap_or_default();
    neighbors.iter().find(|n| n["address"] == address).cloned().unwrap_or_default()
}

/// Where the agent pins its maps under its bpf root: the map layout's directory.
pub fn maps_dir(root: &Path) -> PathBuf {
    root.join(format!("v{}", kube_router_common::LAYOUT_VERSION))
}

/// `bpftool map dump` of every map the agent pinned under `root`, by map name.
pub fn dump_maps(root: &Path) -> Result<BTreeMap<String, String>> {
    let mut dumps = BTreeMap::new();
    for entry in fs::read_dir(maps_dir(root))? {
        let entry = entry?;
        // bpftool cannot dump a ring buffer (`events`: `kube-router monitor`'s, never state).
        if entry.file_type()?.is_file() && entry.file_name() != "events" {
            let path = entry.path();
            let dump = sh(&["bpftool", "map", "dump", "pinned", path.to_str().unwrap()])?;
            dumps.insert(entry.file_name().to_string_lossy().into_owned(), dump);
        }
    }
    Ok(dumps)
}

/// Removes a test's pinned objects.
pub fn remove_bpf_root(root: &Path) {
    let _ = Command::new(kube_router_bin()).arg("--bpf-root").arg(root).arg("cleanup").output();
}

/// A services file the test rewrites to change desired state.
pub struct ServiceFile {
    pub path: PathBuf,
}

impl ServiceFile {
    pub fn new(name: &str) -> Self {
        let path = std::env::temp_dir().join(format!("{name}-services.yaml"));
        Self { path }
    }
    pub fn write(&self, text: &str) -> Result<()> {
        // Write-then-rename so the agent never reads half a file.
        let tmp = self.path.with_extension("tmp");
        fs::write(&tmp, text)?;
        fs::rename(&tmp, &self.path)?;
        Ok(())
    }
    pub fn arg(&self) -> String {
        self.path.display().to_string()
    }
}

/// Kubernetes objects for one service with the given backends.
pub struct ServiceSpec<'a> {
    pub name: &'a str,
    pub cluster_ip: &'a str,
    pub node_port: Option<u16>,
    pub affinity: bool,
    pub backends: &'a [String],
}

pub fn service_objects(spec: &ServiceSpec) -> String {
    let (kind, node_port) = match spec.node_port {
        Some(p) => ("NodePort", format!(", nodePort: {p}")),
        None => ("ClusterIP", String::new()),
    };
    let affinity = if spec.affinity { "  sessionAffinity: ClientIP\n" } else { "" };
    let endpoints: String = spec
        .backends
        .iter()
        .map(|b| format!("- addresses: [\"{b}\"]\n  conditions: {{ready: true, serving: true, terminating: false}}\n"))
        .collect();
    let endpoints = if endpoints.is_empty() { "[]\n".to_string() } else { format!("\n{endpoints}") };
    format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{namespace: default, name: {name}}}\nspec:\n  type: {kind}\n  clusterIP: {ip}\n{affinity}  ports:\n  - {{name: http, protocol: TCP, port: 80, targetPort: 8080{node_port}}}\n  - {{name: dns, protocol: UDP, port: 53, targetPort: 5353}}\n\
         ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  namespace: default\n  name: {name}-x1\n  labels: {{kubernetes.io/service-name: {name}}}\naddressType: IPv4\nports:\n- {{name: http, protocol: TCP, port: 8080}}\n- {{name: dns, protocol: UDP, port: 5353}}\nendpoints: {endpoints}",
        name = spec.name,
        ip = spec.cluster_ip,
    )
}

/// A cgroup v2 directory of a test's own under /sys/fs/cgroup/unified (this host's cgroup2
/// mount): the socket load balancer attaches there instead of the machine's root cgroup, and
/// only processes the test starts through [`TestCgroup::run`] / [`TestCgroup::spawn_collecting`]
/// join it. Removed (children first) on drop, after those processes have ended.
pub struct TestCgroup {
    pub path: PathBuf,
    children: Vec<PathBuf>,
}

impl TestCgroup {
    pub fn new(name: &str) -> Result<Self> {
        let base = ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"]
            .into_iter()
            .map(Path::new)
            .find(|p| p.join("cgroup.procs").exists() && p.join("cgroup.controllers").exists())
            .context("no cgroup v2 hierarchy at /sys/fs/cgroup/unified or /sys/fs/cgroup")?;
        let path = base.join(format!("{name}-{}", std::process::id()));
        let _ = fs::remove_dir(&path);
        fs::create_dir(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(Self { path, children: Vec::new() })
    }

    /// A child cgroup (a pod's cgroup below the node's), removed with this one.
    pub fn child(&mut self, name: &str) -> Result<PathBuf> {
        let mut path = self.path.clone();
        for part in Path::new(name).components() {
            path.push(part);
            if !self.children.contains(&path) {
                fs::create_dir(&path).with_context(|| format!("creating {}", path.display()))?;
                self.children.push(path.clone());
            }
        }
        Ok(path)
    }

    /// `args`, run in `ns` as a process of `cgroup` (this one or a child): it moves itself in
    /// before exec, so nothing it does happens outside.
    fn command(ns: &Netns, cgroup: &Path, args: &[&str]) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net={}", ns.path()))
            .args(["sh", "-c", "echo $$ > \"$0/cgroup.procs\" && exec \"$@\""])
            .arg(cgroup)
            .args(args);
        cmd
    }

    /// Runs `args` in `ns` inside `cgroup` and returns its stdout.
    pub fn run(ns: &Netns, cgroup: &Path, args: &[&str]) -> Result<String> {
        let out = Self::command(ns, cgroup, args).output().with_context(|| format!("running {args:?}"))?;
        if !out.status.success() {
            bail!("{args:?} in {} failed: {}", cgroup.display(), String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The programs attached to this cgroup itself, as `bpftool cgroup show` lists them:
    /// (program id, attach type, e.g. "cgroup_inet4_connect", program name), in that order.
    pub fn programs(&self) -> Result<Vec<(u32, String, String)>> {
        let out = sh(&["bpftool", "-j", "cgroup", "show", self.path.to_str().unwrap()])?;
        let list: Vec<serde_json::Value> = if out.trim().is_empty() { Vec::new() } else { serde_json::from_str(&out)? };
        let text = |v: &serde_json::Value| v.as_str().unwrap_or("").to_string();
        Ok(list
            .iter()
            .map(|p| (p["id"].as_u64().unwrap_or(0) as u32, text(&p["attach_type"]), text(&p["name"])))
            .collect())
    }
}

/// Attaches a program that is not ours to `cgroup`'s connect4 hook, the legacy way
/// (BPF_PROG_ATTACH, multi): `r0 = 1; exit`, named `krt_foreign`. It stays attached until the
/// cgroup is removed; the agent must never replace or remove it.
pub fn attach_foreign_connect4(cgroup: &Path) -> Result<()> {
    const BPF_PROG_LOAD: libc::c_long = 5;
    const BPF_PROG_ATTACH: libc::c_long = 8;
    const BPF_PROG_TYPE_CGROUP_SOCK_ADDR: u32 = 18;
    const BPF_CGROUP_INET4_CONNECT: u32 = 10;
    const BPF_F_ALLOW_MULTI: u32 = 2;
    #[repr(C)]
    struct LoadAttr {
        prog_type: u32,
        insn_cnt: u32,
        insns: u64,
        license: u64,
        log_level: u32,
        log_size: u32,
        log_buf: u64,
        kern_version: u32,
        prog_flags: u32,
        prog_name: [u8; 16],
        prog_ifindex: u32,
        expected_attach_type: u32,
    }
    #[repr(C)]
    struct AttachAttr {
        target_fd: u32,
        attach_bpf_fd: u32,
        attach_type: u32,
        attach_flags: u32,
        replace_bpf_fd: u32,
    }
    fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> Result<i64> {
        // SAFETY: attr is a bpf_attr prefix laid out for `cmd`, valid for the call.
        let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *mut T, std::mem::size_of::<T>() as u32) };
        if rc < 0 {
            bail!("bpf({cmd}): {}", std::io::Error::last_os_error());
        }
        Ok(rc)
    }
    // mov64 r0, 1; exit
    let insns: [u64; 2] =
        [u64::from_le_bytes([0xb7, 0, 0, 0, 1, 0, 0, 0]), u64::from_le_bytes([0x95, 0, 0, 0, 0, 0, 0, 0])];
    let mut name = [0u8; 16];
    name[..11].copy_from_slice(b"krt_foreign");
    let mut load = LoadAttr {
        prog_type: BPF_PROG_TYPE_CGROUP_SOCK_ADDR,
        insn_cnt: 2,
        insns: insns.as_ptr() as u64,
        license: c"GPL".as_ptr() as u64,
        log_level: 0,
        log_size: 0,
        log_buf: 0,
        kern_version: 0,
        prog_flags: 0,
        prog_name: name,
        prog_ifindex: 0,
        expected_attach_type: BPF_CGROUP_INET4_CONNECT,
    };
    let program = bpf(BPF_PROG_LOAD, &mut load)?;
    let cgroup_dir = fs::File::open(cgroup)?;
    let mut attach = AttachAttr {
        target_fd: std::os::fd::AsRawFd::as_raw_fd(&cgroup_dir) as u32,
        attach_bpf_fd: program as u32,
        attach_type: BPF_CGROUP_INET4_CONNECT,
        attach_flags: BPF_F_ALLOW_MULTI,
        replace_bpf_fd: 0,
    };
    let attached = bpf(BPF_PROG_ATTACH, &mut attach);
    // SAFETY: our own descriptor from BPF_PROG_LOAD; the attachment holds its own reference.
    unsafe { libc::close(program as i32) };
    attached.map(|_| ())
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        for dir in self.children.iter().rev().chain([&self.path]) {
            // Processes leave a cgroup when they exit; give the last ones a moment.
            for _ in 0..50 {
                if fs::remove_dir(dir).is_ok() || !dir.exists() {
                    break;
                }
                thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// A tokio runtime whose threads live in a network namespace: sockets it opens (a fake API
/// server's listener, say) are in that namespace, while the test drives it from outside.
pub struct NetnsRuntime {
    runtime: Option<tokio::runtime::Runtime>,
}

impl NetnsRuntime {
    pub fn new(ns: &Netns) -> Result<Self> {
        let path = ns.path();
        // Namespaces are per thread and inherited by threads it creates: enter the namespace on
        // a fresh thread and build the runtime (and so its workers) there.
        let runtime = thread::spawn(move || -> Result<tokio::runtime::Runtime> {
            let file = fs::File::open(&path).with_context(|| format!("opening {path}"))?;
            // SAFETY: setns on this thread only, with a valid namespace fd.
            if unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&file), libc::CLONE_NEWNET) } != 0 {
                bail!("setns {path}: {}", std::io::Error::last_os_error());
            }
            Ok(tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?)
        })
        .join()
        .map_err(|_| anyhow::anyhow!("netns thread panicked"))??;
        Ok(Self { runtime: Some(runtime) })
    }

    /// Runs `future` on the namespace's worker threads and waits for it.
    pub fn run<F>(&self, future: F) -> F::Output
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let runtime = self.runtime.as_ref().expect("runtime");
        runtime.block_on(runtime.spawn(future)).expect("task panicked")
    }
}

impl Drop for NetnsRuntime {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_timeout(Duration::from_secs(2));
        }
    }
}

/// The value of the first series of a Prometheus text scrape that starts with `series`.
pub fn metric(scrape: &str, series: &str) -> f64 {
    scrape
        .lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit_once(' '))
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or_else(|| panic!("no {series} in:\n{scrape}"))
}
