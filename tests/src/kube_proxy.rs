//! `n` single-endpoint Services (TCP 80 → 8080 and UDP 53 → 5353 each) in several forms, for the
//! benchmarks that compare this datapath with kube-proxy on the same Services: Kubernetes
//! objects for the agent (YAML, or kubectl's JSON), kube-proxy's iptables-mode rules (KUBE-SERVICES → KUBE-SVC-* →
//! KUBE-SEP-* DNAT, for iptables-restore) and its nftables-mode table (a `service-ips` verdict
//! map, per-service chains with `numgen random`, endpoint chains with `dnat`, for `nft -f`).
//! The measured Service is generated last (the worst place in a rule chain) and its endpoint is
//! `backend`; the others point at made-up addresses.
use std::fmt::Write as _;

/// The ports: (protocol, Service port, endpoint port).
pub const PORTS: [(&str, u16, u16); 2] = [("tcp", 80, 8080), ("udp", 53, 5353)];

/// Service `i`'s ClusterIP (10.100.0.0 + 1 + i).
pub fn vip(i: usize) -> String {
    let base = u32::from(std::net::Ipv4Addr::new(10, 100, 0, 0));
    std::net::Ipv4Addr::from(base + 1 + i as u32).to_string()
}

/// The endpoint of Service `i` of `n`: `backend` for the measured (last) one.
pub fn endpoint(i: usize, n: usize, backend: &str) -> String {
    if i + 1 == n {
        backend.to_string()
    } else {
        let base = u32::from(std::net::Ipv4Addr::new(10, 200, 0, 0));
        std::net::Ipv4Addr::from(base + 1 + i as u32).to_string()
    }
}

/// The Services and their EndpointSlices as a YAML stream (`--service-file`).
pub fn service_yaml(n: usize, backend: &str) -> String {
    let mut out = String::new();
    for i in 0..n {
        let _ = write!(
            out,
            "---\napiVersion: v1\nkind: Service\nmetadata: {{namespace: bench, name: s{i}}}\nspec:\n  clusterIP: {}\n  ports:\n  - {{name: http, protocol: TCP, port: 80}}\n  - {{name: dns, protocol: UDP, port: 53}}\n\
             ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  namespace: bench\n  name: s{i}-1\n  labels: {{kubernetes.io/service-name: s{i}}}\naddressType: IPv4\n\
             ports:\n- {{name: http, protocol: TCP, port: 8080}}\n- {{name: dns, protocol: UDP, port: 5353}}\nendpoints:\n- addresses: [\"{}\"]\n  conditions: {{ready: true}}\n",
            vip(i),
            endpoint(i, n, backend)
        );
    }
    out
}

/// The objects of [`service_yaml`] as kubectl prints them (`-o json`): one indented List.
pub fn service_json(n: usize, backend: &str) -> String {
    let mut items = Vec::new();
    for i in 0..n {
        items.push(serde_json::json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"namespace": "bench", "name": format!("s{i}")},
            "spec": {"clusterIP": vip(i), "ports": [
                {"name": "http", "protocol": "TCP", "port": 80},
                {"name": "dns", "protocol": "UDP", "port": 53}]}
        }));
        items.push(serde_json::json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"namespace": "bench", "name": format!("s{i}-1"),
                         "labels": {"kubernetes.io/service-name": format!("s{i}")}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "protocol": "TCP", "port": 8080},
                      {"name": "dns", "protocol": "UDP", "port": 5353}],
            "endpoints": [{"addresses": [endpoint(i, n, backend)], "conditions": {"ready": true}}]
        }));
    }
    serde_json::to_string_pretty(&serde_json::json!({"apiVersion": "v1", "kind": "List", "items": items})).unwrap()
}

/// kube-proxy's iptables-mode rules (the nat table, for iptables-restore).
pub fn iptables_rules(n: usize, backend: &str) -> String {
    let mut chains = String::from("*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n");
    let mut rules =
        String::from("-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n");
    for i in 0..n {
        let endpoint = endpoint(i, n, backend);
        for (proto, port, target) in PORTS {
            let (svc, sep) = (format!("KUBE-SVC-{i:07}{proto}"), format!("KUBE-SEP-{i:07}{proto}"));
            let _ = writeln!(chains, ":{svc} - [0:0]\n:{sep} - [0:0]");
            let _ = writeln!(
                rules,
                "-A KUBE-SERVICES -d {}/32 -p {proto} -m comment --comment \"bench/s{i}:{proto} cluster IP\" -m {proto} --dport {port} -j {svc}",
                vip(i)
            );
            let _ =
                writeln!(rules, "-A {svc} -m comment --comment \"bench/s{i}:{proto} -> {endpoint}:{target}\" -j {sep}");
            let _ = writeln!(rules, "-A {sep} -p {proto} -m {proto} -j DNAT --to-destination {endpoint}:{target}");
        }
    }
    format!("{chains}{rules}COMMIT\n")
}

/// kube-proxy's nftables-mode table (for `nft -f`).
pub fn nftables_rules(n: usize, backend: &str) -> String {
    let mut out = String::from(
        "table ip kube-proxy {\n  map service-ips { type ipv4_addr . inet_proto . inet_service : verdict; }\n  \
         chain nat-prerouting { type nat hook prerouting priority dstnat; policy accept; jump services; }\n  \
         chain services { ip daddr . meta l4proto . th dport vmap @service-ips; }\n",
    );
    let mut elements = Vec::new();
    for i in 0..n {
        let endpoint = endpoint(i, n, backend);
        for (proto, port, target) in PORTS {
            let (svc, ep) = (format!("service-{i}-{proto}"), format!("endpoint-{i}-{proto}"));
            let _ = writeln!(out, "  chain {svc} {{ numgen random mod 1 vmap {{ 0 : goto {ep} }}; }}");
            let _ = writeln!(out, "  chain {ep} {{ meta l4proto {proto} dnat to {endpoint}:{target}; }}");
            elements.push(format!("{} . {proto} . {port} : goto {svc}", vip(i)));
        }
    }
    out.push_str("}\n");
    for chunk in elements.chunks(2000) {
        let _ = writeln!(out, "add element ip kube-proxy service-ips {{ {} }}", chunk.join(", "));
    }
    out
}
