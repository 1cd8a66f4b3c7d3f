// Data shared by the agent's flag unit tests (src/main.rs), tests/manifests.rs and the end-to-end
// suite tests/tests/upstream_daemonsets.rs (which starts agents with these args), by include!.
/// The `args` of upstream kube-router's DaemonSets (cloudnativelabs/kube-router v2.x,
/// daemonset/*.yaml), as written there; `<CHANGE ME>` placeholders filled with examples. With
/// the number of external peers each configures.
pub const UPSTREAM_DAEMON_SET_ARGS: &[(&str, &[&str], usize)] = &[
    (
        "generic-kuberouter-all-features.yaml, kubeadm-kuberouter-all-features.yaml, \
         kubeadm-kuberouter-all-features-hostport.yaml, kube-router-all-service-daemonset.yaml",
        &[
            "--run-router=true",
            "--run-firewall=true",
            "--run-service-proxy=true",
            "--bgp-graceful-restart=true",
            "--kubeconfig=/var/lib/kube-router/kubeconfig",
        ],
        0,
    ),
    (
        "kubeadm-kuberouter-all-features-dsr.yaml",
        &[
            "--run-router=true",
            "--run-firewall=true",
            "--run-service-proxy=true",
            "--bgp-graceful-restart=true",
            "--kubeconfig=/var/lib/kube-router/kubeconfig",
            "--runtime-endpoint=unix:///run/containerd/containerd.sock",
        ],
        0,
    ),
    (
        "generic-kuberouter-only-advertise-routes.yaml",
        &[
            "--run-router=true",
            "--run-firewall=false",
            "--run-service-proxy=false",
            "--bgp-graceful-restart=true",
            "--enable-cni=false",
            "--enable-ibgp=false",
            "--enable-overlay=false",
            "--peer-router-ips=192.0.2.254",
            "--peer-router-asns=65000",
            "--cluster-asn=65001",
            "--advertise-cluster-ip=true",
            "--advertise-external-ip=true",
            "--advertise-loadbalancer-ip=true",
        ],
        1,
    ),
    (
        "generic-kuberouter-all-features-advertise-routes.yaml",
        &[
            "--run-router=true",
            "--run-firewall=true",
            "--run-service-proxy=true",
            "--bgp-graceful-restart=true",
            "--kubeconfig=/var/lib/kube-router/kubeconfig",
            "--peer-router-ips=10.1.201.254",
            "--peer-router-asns=64512",
            "--cluster-asn=64512",
            "--advertise-cluster-ip=true",
        ],
        1,
    ),
    (
        "kube-router-all-service-daemonset-advertise-routes.yaml",
        &[
            "--run-router=true",
            "--run-firewall=true",
            "--run-service-proxy=true",
            "--bgp-graceful-restart=true",
            "--kubeconfig=/var/lib/kube-router/kubeconfig",
            "--advertise-cluster-ip=true",
            "--cluster-asn=64512",
            "--peer-router-ips=192.168.1.99",
            "--peer-router-asns=64513",
        ],
        1,
    ),
    (
        "kube-router-firewall-daemonset.yaml",
        &[
            "--run-router=false",
            "--run-firewall=true",
            "--run-service-proxy=false",
            "--kubeconfig=/var/lib/kube-router/kubeconfig",
        ],
        0,
    ),
    (
        "kube-router-proxy-daemonset.yaml",
        &[
            "--run-router=false",
            "--run-firewall=false",
            "--run-service-proxy=true",
            "--kubeconfig=/var/lib/kube-router/kubeconfig",
        ],
        0,
    ),
    (
        "generic-kuberouter.yaml, kubeadm-kuberouter.yaml",
        &["--run-router=true", "--run-firewall=true", "--run-service-proxy=false", "--bgp-graceful-restart=true"],
        0,
    ),
];
