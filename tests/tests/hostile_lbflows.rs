//! Attacks on the load balancer's conntrack and pod egress masquerade, on the two-node cluster
//! harness (`kube_router_tests::cluster`, pod egress masquerade on as the harness configures
//! it). Each test is one attack or failure with its expected outcome. As root, in network
//! namespaces. Threat model: docs/security/lbflows.md.
use kube_router_tests::cluster::{assert_all_from, netprobe, request, Cluster, CLIENT_ADDR, INTERNET_ADDR};

/// An outside client whose network routes the pod CIDR to the pod's node (an advertised pod
/// CIDR, a ToR) connects to a pod's own address, over TCP and UDP: the answers come from the
/// pod's address, not masqueraded to the node's (the client's connected UDP socket would drop
/// those, its TCP stack would never see a SYN-ACK). Guards: a reply never starts a masqueraded
/// flow (`LbFlow::opens_flow` in `lb::masquerade`), and ingress records such a flow untranslated
/// (`lb::record_if_outside_to_pod`, `CT_FLAG_UNTRANSLATED`), which UDP needs.
#[test]
fn an_outside_client_reaches_a_pod_by_its_own_address_over_tcp_and_udp() {
    let c = Cluster::builder("krt-hf-direct").build().unwrap();
    let pod = c.pod(0, 0);
    c.route_via(&pod.ip, 0).unwrap();
    let tcp = format!("{}:8080", pod.ip);
    let udp = format!("{}:5353", pod.ip);
    assert_all_from(&request(&c.client, "tcp", &tcp, 5), &pod.name);
    assert_all_from(&request(&c.client, "udp", &udp, 5), &pod.name);
    // The pod sees the client's own address, and the client the pod's.
    assert_eq!(netprobe(&c.client, &["ask", "tcp", &tcp, "who"]), format!("{} {CLIENT_ADDR}", pod.name));
    assert_eq!(netprobe(&c.client, &["ask", "udp", &udp, "who"]), format!("{} {CLIENT_ADDR}", pod.name));
    assert_eq!(c.node(0).stats().get("egress_masquerade_new_flow").copied().unwrap_or(0), 0, "no reply masqueraded");
    // The same pod's own flows to the internet are still masqueraded.
    assert_all_from(&pod.request("tcp", &format!("{INTERNET_ADDR}:8080"), 3), "internet");
    assert_all_from(&pod.request("udp", &format!("{INTERNET_ADDR}:5353"), 3), "internet");
    assert_eq!(c.node(0).stats()["egress_masquerade_new_flow"], 6);
}
