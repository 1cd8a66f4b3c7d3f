//! The container image end to end: the image `cargo xtask image` built (`cargo xtask test`
//! builds it first) run by podman with runc, configured as manifests/kube-router.yaml's DaemonSet
//! configures it, in a node network namespace against the fake API server, after its
//! install-cni init container put the CNI plugins and configuration in the test's host
//! directories. As root.
use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use k8s_openapi::api::{apps::v1::DaemonSet, core::v1::ConfigMap};
use kube_router_tests::{
    apiserver::{FakeApiServer, FakeApiServerConfig},
    image::{image_ref, podman, CNI_PLUGIN_DIR, RUN_LIMITS},
    *,
};
use serde::Deserialize;

const MANIFEST: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../manifests/kube-router.yaml");
const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// How the kubelet would run the manifest's DaemonSet container, translated to `podman run`
/// flags for a node that is a network namespace: environment from `env` and the ConfigMaps in
/// `envFrom`, ConfigMap volumes as files, hostPath volumes as directories of the test (bpffs is
/// the real one, the test's pins go under its own --bpf-root), the service account's token and
/// CA, privileged, host network.
struct PodRun {
    image: String,
    env: BTreeMap<String, String>,
    volumes: Vec<String>,
    args: Vec<String>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Which {
    Agent,
    /// The init container.
    InstallCni,
}

impl PodRun {
    /// `cluster_config_maps`: ConfigMaps the cluster holds and the manifest reads (kubeadm's
    /// kube-proxy).
    fn from_manifest(
        node: &Netns,
        scratch: &Path,
        cluster_config_maps: BTreeMap<String, BTreeMap<String, String>>,
    ) -> Result<Self> {
        Self::container_from_manifest(node, scratch, cluster_config_maps, Which::Agent)
    }

    /// The same for one of the DaemonSet's containers; hostPath volumes are the same directories
    /// for each.
    fn container_from_manifest(
        node: &Netns,
        scratch: &Path,
        cluster_config_maps: BTreeMap<String, BTreeMap<String, String>>,
        which: Which,
    ) -> Result<Self> {
        let text = fs::read_to_string(MANIFEST)?;
        let mut config_maps = cluster_config_maps;
        let mut daemon_set = None;
        for doc in serde_norway::Deserializer::from_str(&text) {
            let value = serde_json::to_value(serde_norway::Value::deserialize(doc)?)?;
            match value["kind"].as_str() {
                Some("ConfigMap") => {
                    let map: ConfigMap = serde_json::from_value(value)?;
                    config_maps.insert(map.metadata.name.clone().unwrap_or_default(), map.data.unwrap_or_default());
                }
                Some("DaemonSet") => daemon_set = Some(serde_json::from_value::<DaemonSet>(value)?),
                _ => {}
            }
        }
        let pod = daemon_set.context("no DaemonSet")?.spec.context("spec")?.template.spec.context("pod spec")?;
        assert_eq!(pod.host_network, Some(true), "the agent runs in the node's network namespace");
        let container = match which {
            Which::Agent => &pod.containers[0],
            Which::InstallCni => pod.init_containers.iter().flatten().next().context("no init container")?,
        };
        let config_map =
            |name: &str| config_maps.get(name).with_context(|| format!("ConfigMap {name} not in the manifest"));

        let mut env = BTreeMap::new();
        for source in container.env_from.iter().flatten() {
            let name = &source.config_map_ref.as_ref().context("only configMapRef is supported")?.name;
            env.extend(config_map(name)?.clone());
        }
        for var in container.env.iter().flatten() {
            let value = match (&var.value, var.value_from.as_ref().and_then(|from| from.field_ref.as_ref())) {
                (Some(value), _) => value.clone(),
                (None, Some(field)) if field.field_path == "spec.nodeName" => node.name.clone(),
                _ => bail!("env {} has a source this test cannot provide", var.name),
            };
            env.insert(var.name.clone(), value);
        }

        let mut volumes = Vec::new();
        for mount in container.volume_mounts.iter().flatten() {
            let volume = pod.volumes.iter().flatten().find(|v| v.name == mount.name).context("mount without volume")?;
            let host_dir = scratch.join(&volume.name);
            let source = if let Some(config) = &volume.config_map {
                fs::create_dir_all(&host_dir)?;
                let data = config_map(&config.name)?;
                match &config.items {
                    Some(items) => {
                        for item in items {
                            let value = data.get(&item.key).with_context(|| format!("no key {}", item.key))?;
                            fs::write(host_dir.join(&item.path), value)?;
                        }
                    }
                    None => {
                        for (key, value) in data {
                            fs::write(host_dir.join(key), value)?;
                        }
                    }
                }
                host_dir
            } else if volume.host_path.as_ref().is_some_and(|h| h.path == "/sys/fs/bpf") {
                PathBuf::from("/sys/fs/bpf")
            } else if volume.host_path.as_ref().is_some_and(|h| h.path.starts_with("/sys/fs/cgroup")) {
                // The socket load balancer's cgroup: one of the test's own, never the machine's root.
                let cgroup = test_cgroup(node);
                fs::create_dir_all(&cgroup)?;
                cgroup
            } else if volume.host_path.is_some() {
                fs::create_dir_all(&host_dir)?;
                host_dir
            } else {
                bail!("volume {} is of a kind this test cannot provide", volume.name);
            };
            let options = if mount.read_only == Some(true) { ":ro" } else { "" };
            volumes.push(format!("{}:{}{options}", source.display(), mount.mount_path));
        }
        // The kubelet's projected service account volume. The fake API server ignores the
        // token; the CA must parse (any certificate does: the fake server speaks plain HTTP).
        let account = scratch.join("serviceaccount");
        fs::create_dir_all(&account)?;
        fs::write(account.join("token"), "image-smoke-test-token")?;
        fs::write(account.join("namespace"), "kube-system")?;
        fs::write(account.join("ca.crt"), first_pem_certificate("/etc/ssl/certs/ca-certificates.crt")?)?;
        volumes.push(format!("{}:{SERVICE_ACCOUNT_DIR}:ro", account.display()));

        if which == Which::Agent {
            assert_eq!(container.security_context.as_ref().and_then(|s| s.privileged), Some(true));
        }
        Ok(Self {
            image: container.image.clone().context("image")?,
            env,
            volumes,
            args: container.args.clone().unwrap_or_default(),
        })
    }
}

fn first_pem_certificate(bundle: &str) -> Result<String> {
    let text = fs::read_to_string(bundle).with_context(|| format!("reading {bundle}"))?;
    let end = "-----END CERTIFICATE-----";
    let start = text.find("-----BEGIN CERTIFICATE-----").context("no certificate")?;
    let stop = text[start..].find(end).context("unterminated certificate")? + start + end.len();
    Ok(format!("{}\n", &text[start..stop]))
}

/// A podman container, removed on drop (its log printed first if the test is failing).
struct Container {
    name: String,
}

impl Container {
    fn run(name: &str, node: &Netns, image: &str, env: &BTreeMap<String, String>, volumes: &[String]) -> Result<Self> {
        let _ = podman().args(["rm", "--force", "--time", "0", name]).output();
        let mut cmd = podman();
        cmd.args(["run", "--detach", "--name", name, "--privileged"])
            .arg(format!("--network=ns:{}", node.path()))
            .args(RUN_LIMITS);
        for (key, value) in env {
            cmd.arg("--env").arg(format!("{key}={value}"));
        }
        for volume in volumes {
            cmd.arg("--volume").arg(volume);
        }
        let out = cmd.arg(image).output().context("starting podman")?;
        if !out.status.success() {
            bail!("podman run {image} failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(Self { name: name.to_string() })
    }

    /// SIGTERM (the image sets no other stop signal), as the kubelet stops a pod; returns the
    /// agent's exit code.
    fn stop(&self) -> Result<i64> {
        output(podman().args(["stop", "--time", "20", &self.name]))?;
        let code = output(podman().args(["inspect", "--format", "{{.State.ExitCode}}", &self.name]))?;
        code.parse().with_context(|| format!("exit code {code:?}"))
    }

    fn is_running(&self) -> bool {
        output(podman().args(["inspect", "--format", "{{.State.Running}}", &self.name])).is_ok_and(|r| r == "true")
    }

    fn logs(&self) -> String {
        podman()
            .args(["logs", &self.name])
            .output()
            .map(|out| format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
            .unwrap_or_default()
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- podman logs {} ---\n{}", self.name, self.logs());
        }
        let _ = podman().args(["rm", "--force", "--time", "0", &self.name]).output();
    }
}

/// Runs `pod` to completion, as the kubelet runs an init container (no network needed).
fn run_to_completion(pod: &PodRun) -> Result<String> {
    let mut cmd = podman();
    cmd.args(["run", "--rm", "--network", "none"]).args(RUN_LIMITS);
    for (key, value) in &pod.env {
        cmd.arg("--env").arg(format!("{key}={value}"));
    }
    for volume in &pod.volumes {
        cmd.arg("--volume").arg(volume);
    }
    output(cmd.arg(&pod.image).args(&pod.args))
}

fn output(cmd: &mut std::process::Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// A node namespace with the fake API server on its loopback, holding the tests' two Services.
struct Lab {
    topo: Topology,
    // Runs the fake API server; dropped last.
    _runtime: NetnsRuntime,
    server: Arc<FakeApiServer>,
    scratch: PathBuf,
}

impl Lab {
    fn new(prefix: &str, backends: usize) -> Lab {
        let status = podman().args(["image", "exists", &image_ref()]).status().expect("podman");
        assert!(status.success(), "{} is not in local containers storage: run `cargo xtask image`", image_ref());
        let topo = Topology::new(prefix, backends).expect("topology");
        remove_bpf_root(&topo.bpf_root());
        let runtime = NetnsRuntime::new(&topo.node).unwrap();
        let server =
            Arc::new(runtime.run(async { FakeApiServer::spawn(FakeApiServerConfig::default()).await.unwrap() }));
        let scratch = std::env::temp_dir().join(format!("{prefix}-pod"));
        let _ = fs::remove_dir_all(&scratch);
        let lab = Lab { topo, _runtime: runtime, server, scratch };
        lab.apply(&web_and_sticky(&backend_addrs(backends)));
        lab
    }

    fn apply(&self, yaml: &str) {
        self.server.apply_yaml(yaml).unwrap();
    }

    fn scrape(&self, port: &str) -> String {
        self.topo.node.scrape_metrics(port).unwrap_or_default()
    }

    /// Polls the agent's metrics until `ready` holds for them; returns that scrape.
    fn wait_for_metrics(&self, agent: &Container, port: &str, what: &str, ready: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let scrape = self.scrape(port);
            if ready(&scrape) {
                return scrape;
            }
            // Nothing answers: fail now if the agent is gone, not at the deadline.
            if !scrape.starts_with("200") {
                assert!(agent.is_running(), "the agent exited waiting for {what}:\n{}", agent.logs());
            }
            assert!(Instant::now() < deadline, "timed out waiting for {what}; last scrape:\n{scrape}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The maps the agent writes (the datapath writes conntrack, affinity and stats).
    fn agent_maps(&self) -> Vec<String> {
        let dumps = dump_maps(&self.topo.bpf_root()).unwrap();
        ["svc_v4", "svc_slots_v4", "backends_v4", "meta"].iter().map(|n| dumps[*n].clone()).collect()
    }

    fn assert_traffic_flows(&self, backends: usize) {
        let replies = self.topo.request("tcp", &format!("{VIP}:80"), 30).unwrap();
        assert!(replies.iter().all(|r| r.starts_with("backend-")), "failed requests: {replies:?}");
        assert_eq!(tally(&replies).len(), backends, "{replies:?}");
        let replies = self.topo.request("udp", &format!("{VIP}:53"), 10).unwrap();
        assert!(replies.iter().all(|r| r.starts_with("backend-")), "failed datagrams: {replies:?}");
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        remove_bpf_root(&self.topo.bpf_root());
        let _ = fs::remove_dir_all(&self.scratch);
        // Empty once the links are unpinned (a cgroup directory is removed with rmdir).
        let _ = fs::remove_dir(test_cgroup(&self.topo.node));
    }
}

/// A cgroup v2 directory of this test, standing in for the host's cgroup root.
fn test_cgroup(node: &Netns) -> PathBuf {
    PathBuf::from(format!("/sys/fs/cgroup/unified/{}-sock", node.name))
}

/// The value of the sample whose name and labels are exactly `series`.
fn metric(scrape: &str, series: &str) -> Option<f64> {
    scrape.lines().find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// Every map write the agent counted, by `map/op`.
fn map_writes(scrape: &str) -> BTreeMap<String, f64> {
    scrape
        .lines()
        .filter_map(|line| line.strip_prefix("kube_router_map_writes_total{map=\""))
        .filter_map(|rest| {
            let (map, rest) = rest.split_once("\",op=\"")?;
            let (op, value) = rest.split_once("\"} ")?;
            Some((format!("{map}/{op}"), value.parse().ok()?))
        })
        .collect()
}

/// The API is reachable and the tests' Services are in the maps (3 backend addresses, each with
/// a TCP and a UDP port), after at least one sync of this agent.
fn programmed(scrape: &str) -> bool {
    metric(scrape, "kube_router_api_reachable") == Some(1.0)
        && metric(scrape, "kube_router_map_entries{map=\"backends_v4\"}") == Some(6.0)
        && metric(scrape, "kube_router_sync_duration_seconds_count").is_some_and(|n| n >= 1.0)
}

fn writes(entries: &[(&str, f64)]) -> BTreeMap<String, f64> {
    entries.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

/// Programmed from the API through the manifest's own API config, unedited (kubeadm's kube-proxy
/// kubeconfig: the API server's address, the service account's token and CA); stopped, the
/// datapath keeps forwarding; the same image started again adopts the pinned state and writes
/// nothing, then applies a real change as exactly its difference.
#[test]
fn the_image_runs_as_the_manifest_describes_and_a_restart_writes_nothing() {
    let lab = Lab::new("krt-img", 3);
    // kubeadm's kube-proxy ConfigMap as `kubeadm init` writes it, naming this test's API server.
    let kube_proxy_kubeconfig = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- cluster:\n    certificate-authority: \
         /var/run/secrets/kubernetes.io/serviceaccount/ca.crt\n    server: {}\n  name: default\ncontexts:\n- \
         context:\n    cluster: default\n    user: default\n  name: default\ncurrent-context: default\nusers:\n- \
         name: default\n  user:\n    tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token\n",
        lab.server.url()
    );
    let cluster = BTreeMap::from([(
        "kube-proxy".to_string(),
        BTreeMap::from([("kubeconfig.conf".to_string(), kube_proxy_kubeconfig)]),
    )]);
    install_cni_as_the_init_container_does(&lab, cluster.clone());
    let pod = PodRun::from_manifest(&lab.topo.node, &lab.scratch, cluster).unwrap();
    assert_eq!(pod.image, image_ref(), "the manifest runs the image `cargo xtask image` builds");
    let mut env = pod.env.clone();
    assert!(env.contains_key("KUBE_ROUTER_KUBECONFIG"), "the manifest reaches the API without a Service");
    assert!(!env.contains_key("KUBE_ROUTER_MASTER"), "the kubeconfig names the API server, unedited");
    env.insert("KUBE_ROUTER_BPF_ROOT".into(), lab.topo.bpf_root().display().to_string());
    let port = env.get("KUBE_ROUTER_METRICS_PORT").cloned().expect("the manifest serves metrics");

    let agent = Container::run("krt-img-agent", &lab.topo.node, &pod.image, &env, &pod.volumes).unwrap();
    let scrape = lab.wait_for_metrics(&agent, &port, "Services programmed from the API", programmed);
    // 2 Services: ClusterIP tcp + udp each, and web's NodePort on 4 node addresses (tcp) and
    // on the socket load balancer's wildcard (localhost:<nodePort>).
    assert_eq!(map_writes(&scrape).get("svc_v4/insert"), Some(&9.0), "{scrape}");
    lab.assert_traffic_flows(3);
    let maps = lab.agent_maps();

    assert_eq!(agent.stop().unwrap(), 0, "SIGTERM is a clean exit:\n{}", agent.logs());
    lab.assert_traffic_flows(3);
    assert_eq!(lab.agent_maps(), maps, "stopping the agent changed the maps");
    drop(agent);

    let agent = Container::run("krt-img-agent", &lab.topo.node, &pod.image, &env, &pod.volumes).unwrap();
    let scrape = lab.wait_for_metrics(&agent, &port, "the restarted agent's first sync", programmed);
    assert_eq!(map_writes(&scrape), BTreeMap::new(), "a restart rewrote maps:\n{scrape}");
    assert_eq!(lab.agent_maps(), maps);
    lab.assert_traffic_flows(3);

    // web loses backend-3: 2 slots deleted, its 7 frontends get a new count. Exactly that is
    // written, so the restart's own listing wrote nothing either.
    lab.apply(&web_and_sticky(&backend_addrs(2)));
    let expected = writes(&[("svc_v4/update", 7.0), ("svc_slots_v4/delete", 2.0)]);
    lab.wait_for_metrics(&agent, &port, "the change applied", |scrape| map_writes(scrape) == expected);
    let replies = lab.topo.request("tcp", &format!("{VIP}:80"), 30).unwrap();
    assert!(replies.iter().all(|r| r == "backend-1" || r == "backend-2"), "{replies:?}");
    assert_eq!(agent.stop().unwrap(), 0);
}

/// The manifest's init container, run from the image on the node's (the test's) CNI directories:
/// it installs the image's plugins (Debian's, byte for byte) where missing, keeps the host's own,
/// writes kube-router's configuration and leaves another CNI's alone; run again, it changes
/// nothing.
fn install_cni_as_the_init_container_does(lab: &Lab, cluster: BTreeMap<String, BTreeMap<String, String>>) {
    let init = PodRun::container_from_manifest(&lab.topo.node, &lab.scratch, cluster, Which::InstallCni).unwrap();
    let host_dir = |mount: &str| {
        let volume = init.volumes.iter().find(|v| v.ends_with(&format!(":{mount}"))).expect(mount);
        PathBuf::from(volume.split(':').next().unwrap())
    };
    let (bin, conf) = (host_dir("/opt/cni/bin"), host_dir("/etc/cni/net.d"));
    assert!(bin.starts_with(&lab.scratch) && conf.starts_with(&lab.scratch), "the test's own directories");
    fs::write(bin.join("loopback"), "#!/bin/sh\n# the host's own\n").unwrap();
    fs::set_permissions(bin.join("loopback"), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    fs::write(conf.join("05-other.conflist"), "another CNI's").unwrap();

    let report = run_to_completion(&init).unwrap();
    let report: serde_json::Value = serde_json::from_str(report.lines().last().unwrap_or_default()).unwrap();
    assert_eq!(report["installed"], serde_json::json!(["bridge", "host-local", "portmap"]), "{report}");
    assert_eq!(report["kept"], serde_json::json!(["loopback"]), "{report}");
    assert_eq!(report["shadowing_configs"], serde_json::json!(["05-other.conflist"]), "{report}");
    for plugin in ["bridge", "host-local", "portmap"] {
        let installed = fs::read(bin.join(plugin)).unwrap();
        assert!(installed == fs::read(Path::new(CNI_PLUGIN_DIR).join(plugin)).unwrap(), "{plugin} differs");
        let mode = std::os::unix::fs::PermissionsExt::mode(&fs::metadata(bin.join(plugin)).unwrap().permissions());
        assert_eq!(mode & 0o777, 0o755, "{plugin}");
    }
    assert_eq!(fs::read_to_string(bin.join("loopback")).unwrap(), "#!/bin/sh\n# the host's own\n");
    assert_eq!(fs::read_to_string(conf.join("05-other.conflist")).unwrap(), "another CNI's");
    let config: serde_json::Value =
        serde_json::from_slice(&fs::read(conf.join("10-kuberouter.conflist")).unwrap()).unwrap();
    assert_eq!(config["plugins"][0]["type"], "bridge", "{config}");
    assert_eq!(config["plugins"][0]["bridge"], "kube-bridge", "{config}");

    let again = run_to_completion(&init).unwrap();
    assert!(again.contains("\"installed\":[]") && again.contains("\"config_written\":false"), "{again}");
}

/// `--master` alone, no kubeconfig: kube-rs then builds its TLS connector from the system trust
/// store (even for http://) and fails without one, so the image carries the CA bundle.
#[test]
fn the_image_reaches_an_api_named_by_master_alone() {
    let lab = Lab::new("krt-img-m", 1);
    let env = BTreeMap::from([
        ("KUBE_ROUTER_MASTER".to_string(), lab.server.url()),
        ("KUBE_ROUTER_BPF_ROOT".to_string(), lab.topo.bpf_root().display().to_string()),
        ("KUBE_ROUTER_METRICS_PORT".to_string(), "20241".to_string()),
    ]);
    let state = lab.scratch.join("state");
    fs::create_dir_all(&state).unwrap();
    let volumes = ["/sys/fs/bpf:/sys/fs/bpf".to_string(), format!("{}:/var/lib/kube-router", state.display())];
    let agent = Container::run("krt-img-master", &lab.topo.node, &image_ref(), &env, &volumes).unwrap();
    lab.wait_for_metrics(&agent, "20241", "Services programmed from the API", programmed);
    lab.assert_traffic_flows(1);
    assert_eq!(agent.stop().unwrap(), 0);
}
