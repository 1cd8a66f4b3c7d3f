//! The manifests (manifests/*.yaml, one per set of roles) are strictly valid Kubernetes objects,
//! run the image `cargo xtask image` builds, give each role the mounts it needs, reach the API
//! without a Service when the agent is the Service proxy, grant exactly what the agent reads, and
//! set only flags the agent accepts, with values it parses.
use std::{
    collections::{BTreeMap, BTreeSet},
    io::Write,
    path::Path,
    process::{Command, Stdio},
};

use k8s_openapi::{
    api::{
        apps::v1::DaemonSet,
        core::v1::{ConfigMap, Container, PodSpec, ServiceAccount, Volume},
        rbac::v1::{ClusterRole, ClusterRoleBinding},
    },
    apimachinery::pkg::util::intstr::IntOrString,
};
use kube_router::k8s::watch::WATCHED_RESOURCES;
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use serde_json::Value;

/// Which roles a manifest runs (its kube-router-config ConfigMap must say the same).
struct Variant {
    file: &'static str,
    service_proxy: bool,
    firewall: bool,
    router: bool,
    /// The host's CNI configuration and plugin directories.
    cni_dirs: [&'static str; 2],
}

const KUBEADM_CNI: [&str; 2] = ["/etc/cni/net.d", "/opt/cni/bin"];
const K3S_CNI: [&str; 2] = ["/var/lib/rancher/k3s/agent/etc/cni/net.d", "/var/lib/rancher/k3s/data/current/bin"];

const VARIANTS: [Variant; 4] = [
    Variant { file: "kube-router.yaml", service_proxy: true, firewall: true, router: true, cni_dirs: KUBEADM_CNI },
    Variant {
        file: "kube-router-service-proxy.yaml",
        service_proxy: true,
        firewall: false,
        router: false,
        cni_dirs: KUBEADM_CNI,
    },
    Variant {
        file: "kube-router-router-firewall.yaml",
        service_proxy: false,
        firewall: true,
        router: true,
        cni_dirs: KUBEADM_CNI,
    },
    Variant { file: "kube-router-k3s.yaml", service_proxy: true, firewall: true, router: true, cni_dirs: K3S_CNI },
];

/// kubeadm's kube-proxy ConfigMap, key kubeconfig.conf, as `kubeadm init` writes it (only the
/// server differs between clusters): the kubeadm manifests mount it as the agent's kubeconfig.
const KUBEADM_KUBE_PROXY_KUBECONFIG: &str = r#"apiVersion: v1
kind: Config
clusters:
- cluster:
    certificate-authority: /var/run/secrets/kubernetes.io/serviceaccount/ca.crt
    server: https://192.0.2.10:6443
  name: default
contexts:
- context:
    cluster: default
    namespace: default
    user: default
  name: default
current-context: default
users:
- name: default
  user:
    tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token
"#;

const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

#[derive(Default)]
struct Manifest {
    file: &'static str,
    /// Every document as written, for checks that compare them across files.
    documents: Vec<Value>,
    daemon_sets: Vec<DaemonSet>,
    roles: Vec<ClusterRole>,
    bindings: Vec<ClusterRoleBinding>,
    service_accounts: Vec<ServiceAccount>,
    config_maps: BTreeMap<String, BTreeMap<String, String>>,
}

impl Manifest {
    fn load(file: &'static str) -> Self {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests").join(file);
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let mut m = Manifest { file, ..Default::default() };
        for doc in serde_norway::Deserializer::from_str(&text) {
            let value = serde_json::to_value(serde_norway::Value::deserialize(doc).unwrap()).unwrap();
            let kind = value["kind"].as_str().unwrap_or_default().to_string();
            let what = format!("{file}: {kind} {}", value["metadata"]["name"]);
            match kind.as_str() {
                "DaemonSet" => m.daemon_sets.push(strict(&value, &what)),
                "ClusterRole" => m.roles.push(strict(&value, &what)),
                "ClusterRoleBinding" => m.bindings.push(strict(&value, &what)),
                "ServiceAccount" => m.service_accounts.push(strict(&value, &what)),
                "ConfigMap" => {
                    let map: ConfigMap = strict(&value, &what);
                    m.config_maps.insert(map.metadata.name.unwrap(), map.data.unwrap_or_default());
                }
                _ => panic!("{what}: unexpected kind"),
            }
            m.documents.push(value);
        }
        assert_eq!(m.daemon_sets.len(), 1, "{file}: one DaemonSet");
        m
    }

    fn pod(&self) -> &PodSpec {
        self.daemon_sets[0].spec.as_ref().unwrap().template.spec.as_ref().unwrap()
    }

    fn container(&self) -> &Container {
        &self.pod().containers[0]
    }

    /// The agent's flags as the container gets them: ConfigMaps from `envFrom`, then `env`
    /// (literal values; the node name stands in for its fieldRef).
    fn flags(&self) -> BTreeMap<String, String> {
        let mut flags = BTreeMap::new();
        for source in self.container().env_from.iter().flatten() {
            let name = &source.config_map_ref.as_ref().expect("configMapRef").name;
            let data = self.config_maps.get(name).unwrap_or_else(|| panic!("{}: no ConfigMap {name}", self.file));
            flags.extend(data.clone());
        }
        for var in self.container().env.iter().flatten() {
            flags.insert(var.name.clone(), var.value.clone().unwrap_or_else(|| "node-1".into()));
        }
        flags
    }

    fn flag(&self, name: &str) -> Option<String> {
        self.flags().get(name).cloned()
    }

    /// The volume mounted at `path` in the container.
    fn volume_at(&self, path: &str) -> Option<&Volume> {
        let mount = self.container().volume_mounts.iter().flatten().find(|m| m.mount_path == path)?;
        self.pod().volumes.iter().flatten().find(|v| v.name == mount.name)
    }

    fn host_path_at(&self, path: &str) -> Option<String> {
        Some(self.volume_at(path)?.host_path.as_ref()?.path.clone())
    }
}

/// Into the typed object and back: a field the type does not have (a typo, a field at the wrong
/// level) or a value of the wrong type fails here, as the API server's strict field validation
/// would fail it.
fn strict<T: DeserializeOwned + Serialize>(document: &Value, what: &str) -> T {
    let typed: T = serde_json::from_value(document.clone()).unwrap_or_else(|e| panic!("{what}: {e}"));
    let back = serde_json::to_value(&typed).unwrap();
    let mut lost = Vec::new();
    differences(document, &back, String::new(), &mut lost);
    assert!(lost.is_empty(), "{what}: not fields of the object (misspelt or misplaced?): {lost:?}");
    typed
}

fn differences(written: &Value, kept: &Value, path: String, out: &mut Vec<String>) {
    match (written, kept) {
        (Value::Object(a), Value::Object(b)) => {
            for (key, value) in a {
                differences(value, b.get(key).unwrap_or(&Value::Null), format!("{path}.{key}"), out);
            }
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                differences(x, y, format!("{path}[{i}]"), out);
            }
        }
        _ if written != kept => out.push(format!("{path}: {written} became {kept}")),
        _ => {}
    }
}

fn all() -> Vec<Manifest> {
    VARIANTS.iter().map(|v| Manifest::load(v.file)).collect()
}

#[test]
fn every_manifest_is_strictly_valid() {
    for m in all() {
        assert!(!m.documents.is_empty(), "{}", m.file);
        let pod = m.pod();
        // What the API server's pod validation would refuse, and what it would let through unused.
        let volumes: BTreeSet<&str> = pod.volumes.iter().flatten().map(|v| v.name.as_str()).collect();
        let mounted: BTreeSet<&str> = m.container().volume_mounts.iter().flatten().map(|v| v.name.as_str()).collect();
        assert_eq!(mounted, volumes, "{}: every mount has a volume, every volume is mounted", m.file);
        let account = pod.service_account_name.as_deref();
        assert_eq!(account, m.service_accounts[0].metadata.name.as_deref(), "{}", m.file);
        for volume in pod.volumes.iter().flatten() {
            if let Some(config) = &volume.config_map {
                // kubeadm's kube-proxy ConfigMap is the cluster's, not the manifest's.
                assert!(
                    m.config_maps.contains_key(&config.name) || config.name == "kube-proxy",
                    "{}: volume {} names no ConfigMap",
                    m.file,
                    volume.name
                );
            }
        }
    }
}

#[test]
fn the_manifests_run_the_image_xtask_builds() {
    let image = format!("localhost/kube-router:{}", env!("CARGO_PKG_VERSION"));
    for m in all() {
        for container in m.pod().containers.iter().chain(m.pod().init_containers.iter().flatten()) {
            assert_eq!(container.image.as_deref(), Some(image.as_str()), "{}: {}", m.file, container.name);
            // localhost/ names cannot be pulled: the image is loaded or pushed under another name.
            assert_eq!(container.image_pull_policy.as_deref(), Some("IfNotPresent"), "{}", m.file);
        }
    }
}

/// Where the CNI role runs, an init container installs the plugins and the configuration
/// template on the host, as upstream's install-cni does: the agent's own `install-cni`
/// subcommand (the image has no shell), into the same host directories the agent uses, with the
/// agent's flags (the same --cni-conf-file). Without the CNI role there is nothing to install.
#[test]
fn the_cni_role_installs_plugins_and_config_from_an_init_container() {
    for (variant, m) in VARIANTS.iter().zip(all()) {
        let file = m.file;
        let init = m.pod().init_containers.clone().unwrap_or_default();
        if !variant.router {
            assert!(init.is_empty(), "{file}: no CNI role, no init container");
            continue;
        }
        assert_eq!(m.flag("KUBE_ROUTER_ENABLE_CNI").as_deref().unwrap_or("true"), "true", "{file}");
        let [install] = init.as_slice() else { panic!("{file}: one init container, install-cni") };
        assert_eq!(install.name, "install-cni", "{file}");
        assert_eq!(install.command, None, "{file}: the image's entrypoint is the agent");
        assert_eq!(install.args.as_deref(), Some(&["install-cni".to_string()][..]), "{file}");
        assert_eq!(install.env_from, m.container().env_from, "{file}: the agent's flags");
        for dir in KUBEADM_CNI {
            let mount = install.volume_mounts.iter().flatten().find(|v| v.mount_path == dir);
            let mount = mount.unwrap_or_else(|| panic!("{file}: install-cni mounts nothing at {dir}"));
            let agents = m.container().volume_mounts.iter().flatten().find(|v| v.mount_path == dir);
            assert_eq!(Some(&mount.name), agents.map(|v| &v.name), "{file}: {dir} is the agent's volume");
            assert_ne!(mount.read_only, Some(true), "{file}: {dir} is written");
        }
    }
}

#[test]
fn rbac_grants_list_and_watch_on_exactly_the_watched_resources() {
    let manifests = all();
    for m in &manifests {
        assert_eq!(m.roles.len(), 1);
        let mut granted = BTreeSet::new();
        for rule in m.roles[0].rules.iter().flatten() {
            let verbs: BTreeSet<&str> = rule.verbs.iter().map(String::as_str).collect();
            assert_eq!(verbs, BTreeSet::from(["list", "watch"]), "{}: only read access: {rule:?}", m.file);
            for group in rule.api_groups.iter().flatten() {
                for resource in rule.resources.iter().flatten() {
                    granted.insert((group.clone(), resource.clone()));
                }
            }
        }
        let watched: BTreeSet<(String, String)> =
            WATCHED_RESOURCES.iter().map(|(g, r)| (g.to_string(), r.to_string())).collect();
        assert_eq!(granted, watched, "{}", m.file);
        let binding = &m.bindings[0];
        assert_eq!(binding.role_ref.name, "kube-router");
        let subject = &binding.subjects.as_ref().unwrap()[0];
        assert_eq!(Some(subject.name.as_str()), m.service_accounts[0].metadata.name.as_deref());
    }
    // The variants share their RBAC word for word: a change to one is a change to all.
    let shared = |m: &Manifest| -> Vec<Value> {
        let kinds = ["ServiceAccount", "ClusterRole", "ClusterRoleBinding"];
        m.documents.iter().filter(|d| kinds.contains(&d["kind"].as_str().unwrap_or_default())).cloned().collect()
    };
    for m in &manifests[1..] {
        assert_eq!(shared(m), shared(&manifests[0]), "{} and {} differ", m.file, manifests[0].file);
    }
}

#[test]
fn each_variant_runs_its_roles_with_the_mounts_they_need() {
    for (variant, m) in VARIANTS.iter().zip(all()) {
        let file = m.file;
        let on = |flag: &str| m.flag(flag).unwrap_or_else(|| panic!("{file}: {flag} not set")) == "true";
        assert_eq!(on("KUBE_ROUTER_RUN_SERVICE_PROXY"), variant.service_proxy, "{file}");
        assert_eq!(on("KUBE_ROUTER_RUN_FIREWALL"), variant.firewall, "{file}");
        assert_eq!(on("KUBE_ROUTER_RUN_ROUTER"), variant.router, "{file}");

        let pod = m.pod();
        assert_eq!(pod.host_network, Some(true), "{file}");
        assert!(pod.tolerations.iter().flatten().any(|t| t.operator.as_deref() == Some("Exists") && t.key.is_none()));
        let container = m.container();
        assert_eq!(container.security_context.as_ref().unwrap().privileged, Some(true), "{file}");
        let mounts = container.volume_mounts.as_ref().unwrap();
        let bpffs = mounts.iter().find(|v| v.mount_path == "/sys/fs/bpf").expect("bpffs mounted");
        assert_eq!(bpffs.mount_propagation.as_deref(), Some("Bidirectional"), "{file}: pins outlive the pod");
        assert_eq!(m.host_path_at("/sys/fs/bpf").as_deref(), Some("/sys/fs/bpf"), "{file}");
        assert_eq!(
            m.host_path_at("/var/lib/kube-router").as_deref(),
            Some("/var/lib/kube-router"),
            "{file}: checkpoint"
        );
        assert!(mounts.iter().any(|v| v.mount_path == "/lib/modules" && v.read_only == Some(true)), "{file}");
        let health_port = m.flag("KUBE_ROUTER_HEALTH_PORT").unwrap();
        let liveness = container.liveness_probe.as_ref().unwrap().http_get.as_ref().unwrap();
        assert_eq!(liveness.path.as_deref(), Some("/healthz"), "{file}");
        let port = match &liveness.port {
            IntOrString::Int(n) => n.to_string(),
            IntOrString::String(name) => name.clone(),
        };
        assert_eq!(port, health_port, "{file}: liveness asks the health port");

        // The socket load balancer attaches to the host's cgroup v2 root.
        let cgroup = mounts.iter().find(|v| v.mount_path == "/run/kube-router/cgroupv2");
        assert_eq!(cgroup.is_some(), variant.service_proxy, "{file}: cgroup v2 root");
        if variant.service_proxy {
            assert_eq!(m.host_path_at("/run/kube-router/cgroupv2").as_deref(), Some("/sys/fs/cgroup"), "{file}");
        }
        // The CNI role installs its config and plugin on the host.
        for (dir, host_dir) in KUBEADM_CNI.iter().zip(variant.cni_dirs) {
            let host = m.host_path_at(dir);
            assert_eq!(host.as_deref(), variant.router.then_some(host_dir), "{file}: {dir}");
        }
        if variant.service_proxy {
            assert_reaches_the_api_without_a_service(&m);
        } else {
            // kube-proxy stays: the in-cluster config (the `kubernetes` Service) works.
            assert_eq!(m.flag("KUBE_ROUTER_MASTER"), None, "{file}");
            assert_eq!(m.flag("KUBE_ROUTER_KUBECONFIG"), None, "{file}");
        }
    }
}

/// Without kube-proxy nothing programs the `kubernetes` Service before this agent does, so the
/// agent reaches the API server by its real address, unedited: on kubeadm from kube-proxy's own
/// kubeconfig (upstream's kubeadm manifests do the same), on k3s through the API load balancer
/// every k3s node runs on 127.0.0.1:6444. Either way the credentials are the pod's service
/// account token (re-read as it rotates) and CA.
fn assert_reaches_the_api_without_a_service(m: &Manifest) {
    let file = m.file;
    let path = m.flag("KUBE_ROUTER_KUBECONFIG").unwrap_or_else(|| panic!("{file}: KUBE_ROUTER_KUBECONFIG"));
    let (dir, key) = path.rsplit_once('/').unwrap();
    let volume = m.volume_at(dir).unwrap_or_else(|| panic!("{file}: nothing mounted at {dir}"));
    let config_map = volume.config_map.as_ref().expect("the kubeconfig comes from a ConfigMap");
    let text = if config_map.name == "kube-proxy" {
        let item = config_map.items.iter().flatten().find(|i| i.path == key);
        assert_eq!(item.map(|i| i.key.as_str()), Some("kubeconfig.conf"), "{file}: kubeadm's key");
        assert_eq!(m.flag("KUBE_ROUTER_MASTER"), None, "{file}: the kubeconfig's server is the real one");
        KUBEADM_KUBE_PROXY_KUBECONFIG
    } else {
        let master = m.flag("KUBE_ROUTER_MASTER").unwrap_or_else(|| panic!("{file}: KUBE_ROUTER_MASTER"));
        assert_eq!(master, "https://127.0.0.1:6444", "{file}: k3s's API load balancer");
        &m.config_maps[&config_map.name][key]
    };
    let kubeconfig = kube::config::Kubeconfig::from_yaml(text).unwrap_or_else(|e| panic!("{file}: {e}"));
    let cluster = kubeconfig.clusters[0].cluster.as_ref().unwrap();
    assert_eq!(cluster.certificate_authority.as_deref(), Some(format!("{SERVICE_ACCOUNT_DIR}/ca.crt").as_str()));
    let user = kubeconfig.auth_infos[0].auth_info.as_ref().unwrap();
    assert_eq!(user.token_file.as_deref(), Some(format!("{SERVICE_ACCOUNT_DIR}/token").as_str()));
    assert_ne!(m.pod().automount_service_account_token, Some(false), "{file}: the token must be mounted");
}

/// Upstream's DaemonSet labels and selector (a selector is immutable, so `kubectl apply` over an
/// upstream install needs the same one), and Prometheus' scrape annotations on the agent's port.
#[test]
fn labels_match_upstream_and_prometheus_scrapes_the_metrics_port() {
    let upstream = BTreeMap::from([("k8s-app".to_string(), "kube-router".to_string()), ("tier".into(), "node".into())]);
    for m in all() {
        let file = m.file;
        let ds = &m.daemon_sets[0];
        let spec = ds.spec.as_ref().unwrap();
        assert_eq!(spec.selector.match_labels.as_ref(), Some(&upstream), "{file}: selector");
        assert_eq!(ds.metadata.labels.as_ref(), Some(&upstream), "{file}: labels");
        let template = spec.template.metadata.as_ref().unwrap();
        assert_eq!(template.labels.as_ref(), Some(&upstream), "{file}: pod labels");
        let annotations = template.annotations.clone().unwrap_or_default();
        assert_eq!(annotations.get("prometheus.io/scrape").map(String::as_str), Some("true"), "{file}");
        assert_eq!(annotations.get("prometheus.io/port"), m.flag("KUBE_ROUTER_METRICS_PORT").as_ref(), "{file}");
        assert_eq!(annotations.get("prometheus.io/path").map(String::as_str), Some("/metrics"), "{file}");
    }
}

/// The kernel the manifests ask for is the one docs/requirements.md names.
#[test]
fn manifests_state_the_documented_kernel() {
    let requirements =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/requirements.md")).unwrap();
    let minimum =
        requirements.split("needs **Linux ").nth(1).and_then(|r| r.split(' ').next()).expect("requirements.md");
    for v in &VARIANTS {
        let text =
            std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests").join(v.file)).unwrap();
        assert!(text.contains(&format!("Linux >= {minimum} with BTF")), "{}: not Linux >= {minimum}", v.file);
    }
}

/// Every KUBE_ROUTER_* variable is one of the agent's flags (clap ignores unknown variables, so
/// a misspelt one would silently do nothing), and the agent parses every value.
#[test]
fn every_flag_in_the_manifests_is_one_the_agent_accepts() {
    let agent = env!("CARGO_BIN_EXE_kube-router");
    let help = Command::new(agent).arg("--help").output().unwrap();
    let help = String::from_utf8(help.stdout).unwrap();
    let known: BTreeSet<&str> = help.split("[env: ").skip(1).filter_map(|rest| rest.split(['=', ']']).next()).collect();
    assert!(known.contains("KUBE_ROUTER_RUN_SERVICE_PROXY"), "{help}");
    for m in all() {
        let flags = m.flags();
        for name in flags.keys() {
            assert!(known.contains(name.as_str()), "{}: {name} is not a flag of the agent", m.file);
        }
        // `checkpoint` parses every flag, then fails on the empty state directory: that failure
        // (exit 1, not clap's 2) means every value parsed.
        let state = std::env::temp_dir().join(format!("krt-manifest-flags-{}", std::process::id()));
        let out = Command::new(agent)
            .env_clear()
            .envs(&flags)
            .arg("--state-dir")
            .arg(&state)
            .arg("checkpoint")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("no checkpoint at"), "{}: the agent refused its flags: {stderr}", m.file);
        assert_eq!(out.status.code(), Some(1), "{}: {stderr}", m.file);
    }
}

include!("data/upstream_daemon_set_args.rs");

/// An upstream DaemonSet's container, its image swapped for ours, starts: the agent accepts
/// each of its args as the agent itself checks them at start (`check-flags`: clap's parse,
/// then the external peer lists and the upstream flags without effect here, which only warn).
#[test]
fn upstream_daemon_set_args_are_accepted_unchanged() {
    let agent = env!("CARGO_BIN_EXE_kube-router");
    for (files, args, peers) in UPSTREAM_DAEMON_SET_ARGS {
        let out = Command::new(agent).env_clear().args(*args).arg("check-flags").output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{files}: the agent refused {args:?}: {stderr}");
        assert!(stdout.contains(&format!("flags accepted ({peers} external peers)")), "{files}: {stdout}");
    }
    // The check can fail: peer lists of different lengths are refused, as at start.
    let out = Command::new(agent)
        .env_clear()
        .args(["--peer-router-ips=192.0.2.1,192.0.2.2", "--peer-router-asns=65000", "check-flags"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
}

/// kubectl decodes each DaemonSet into Kubernetes' own Go types, offline (`set env --local`
/// needs no server; `apply`/`create --dry-run=client` do: they ask it for the API's resources
/// and OpenAPI schema). This catches what serde accepts and Go does not, e.g. a malformed
/// resource quantity.
#[test]
fn kubectl_decodes_every_daemon_set_offline() {
    for m in all() {
        let daemon_set = m.documents.iter().find(|d| d["kind"] == "DaemonSet").unwrap();
        let mut child = Command::new("kubectl")
            .args(["set", "env", "--local", "--dry-run=client", "-o", "json", "-f", "-", "KRT_DECODED=1"])
            // No kubeconfig: nothing to contact even if kubectl wanted to.
            .env("KUBECONFIG", "/nonexistent")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kubectl (scripts/setup.sh installs it)");
        child.stdin.take().unwrap().write_all(serde_json::to_string(daemon_set).unwrap().as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{}: kubectl: {}", m.file, String::from_utf8_lossy(&out.stderr));
        let decoded: DaemonSet = serde_json::from_slice(&out.stdout).unwrap();
        let spec = decoded.spec.unwrap().template.spec.unwrap();
        let env = spec.containers[0].env.clone().unwrap_or_default();
        assert!(env.iter().any(|e| e.name == "KRT_DECODED"), "{}: kubectl did not process it", m.file);
        assert_eq!(spec.containers[0].image, m.container().image, "{}", m.file);
    }
}

/// A name the agent exports: its own and kube-router's, and the process families.
fn is_agent_metric(word: &str) -> bool {
    word.starts_with("kube_router_") || word.starts_with("process_")
}

/// The dashboard and alert rules in manifests/monitoring/ parse, the two rule files hold the same
/// rules, and every kube_router_* and process_* metric they query is one docs/metrics.md lists (which the
/// agent's own test holds to what it exports).
#[test]
fn monitoring_queries_only_documented_metrics() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let read = |p: &str| std::fs::read_to_string(root.join(p)).unwrap_or_else(|e| panic!("{p}: {e}"));
    let documented: BTreeSet<String> =
        read("docs/metrics.md").split('`').filter(|w| is_agent_metric(w)).map(str::to_string).collect();
    let dashboard: Value = serde_json::from_str(&read("manifests/monitoring/kube-router-dashboard.json")).unwrap();
    let mut exprs: Vec<String> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().unwrap().iter().map(|t| t["expr"].as_str().unwrap().to_string()))
        .collect();
    let plain: Value = serde_norway::from_str(&read("manifests/monitoring/kube-router-rules.yaml")).unwrap();
    let operator: Value =
        serde_norway::from_str(&read("manifests/monitoring/kube-router-prometheusrule.yaml")).unwrap();
    assert_eq!(operator["kind"], "PrometheusRule");
    assert_eq!(plain["groups"], operator["spec"]["groups"], "the two rule files differ");
    let rules = plain["groups"][0]["rules"].as_array().unwrap();
    for alert in [
        "KubeRouterAgentDown",
        "KubeRouterApiUnreachable",
        "KubeRouterBgpSessionDown",
        "KubeRouterMapFull",
        "KubeRouterConntrackNearFull",
        "KubeRouterSyncErrors",
        "KubeRouterHighMemory",
    ] {
        assert!(rules.iter().any(|r| r["alert"] == alert), "no alert {alert}");
    }
    exprs.extend(rules.iter().map(|r| r["expr"].as_str().unwrap().to_string()));
    let mut referenced = 0;
    for expr in &exprs {
        for word in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).filter(|w| is_agent_metric(w)) {
            let name = ["_bucket", "_sum", "_count"].iter().find_map(|s| word.strip_suffix(s)).unwrap_or(word);
            assert!(documented.contains(name), "{name} (in {expr}) is not in docs/metrics.md");
            referenced += 1;
        }
    }
    assert!(referenced > 20, "{referenced}");
}
