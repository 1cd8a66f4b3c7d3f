//! Service health checks for load balancers (`spec.healthCheckNodePort`), as kube-proxy serves
//! them: for every Service with `externalTrafficPolicy: Local`, an HTTP endpoint on that port of
//! the node answers 200 while the node has ready endpoints of the Service, 503 otherwise, so a
//! cloud load balancer sends traffic only to nodes that can serve it locally.
use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
};

use tokio::{net::TcpListener, sync::watch, task::JoinHandle};

use crate::{
    metrics::Metrics,
    services::{
        family::IpFamily,
        incremental::ServiceCatalog,
        model::{EndpointSlice, Service, ServiceName, ServiceState},
    },
};

/// What a health check port reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalEndpoints {
    pub service: ServiceName,
    /// Ready endpoints of the Service on this node.
    pub count: usize,
}

/// The health check ports this node must serve, with their Services' local ready endpoints.
pub fn health_checks(state: &ServiceState, node: &str) -> BTreeMap<u16, LocalEndpoints> {
    let slices = crate::services::compile::slices_by_service(state);
    let checks = state.services.values().filter_map(|service| {
        let slices = slices.get(&service.name).map(Vec::as_slice).unwrap_or_default();
        local_check(service, slices.iter().copied(), node)
    });
    // Two Services on one port (the API server never allows it): the last by name answers.
    checks.collect()
}

/// `service`'s health check port and its count of ready endpoints on `node`, if it has one.
fn local_check<'a>(
    service: &Service,
    slices: impl IntoIterator<Item = &'a EndpointSlice>,
    node: &str,
) -> Option<(u16, LocalEndpoints)> {
    let port = service.health_check_node_port?;
    // A dual-stack pod is one endpoint in each family's slice: count one family's, as each
    // of kube-proxy's per-family proxiers does (its primary family, `ipFamilies[0]`).
    let family = service.ip_families.first().copied().unwrap_or(IpFamily::IPv4);
    let mut local = BTreeSet::new();
    for slice in slices {
        for endpoint in slice.endpoints.iter().filter(|e| IpFamily::of(&e.addr) == family) {
            let ready = endpoint.ready || service.publish_not_ready;
            if ready && endpoint.node_name.as_deref() == Some(node) {
                local.insert(endpoint.addr);
            }
        }
    }
    Some((port, LocalEndpoints { service: service.name.clone(), count: local.len() }))
}

/// [`health_checks`] kept per Service, so that a sync after a change of a few Services counts
/// again only theirs, not every Service's endpoints.
#[derive(Debug, Default)]
pub struct HealthCheckIndex {
    by_service: BTreeMap<ServiceName, (u16, LocalEndpoints)>,
}

impl HealthCheckIndex {
    /// Counts again the Services `changed` names (`None`: every Service); returns whether any
    /// check changed.
    pub fn update(&mut self, catalog: &ServiceCatalog, changed: Option<&BTreeSet<ServiceName>>, node: &str) -> bool {
        let check = |service: &Service| local_check(service, catalog.slices_of(&service.name), node);
        let Some(changed) = changed else {
            let now: BTreeMap<ServiceName, (u16, LocalEndpoints)> = catalog
                .state
                .services
                .values()
                .filter_map(|service| Some((service.name.clone(), check(service)?)))
                .collect();
            let moved = now != self.by_service;
            self.by_service = now;
            return moved;
        };
        let mut moved = false;
        for name in changed {
            let now = catalog.state.services.get(name).and_then(check);
            let before = match &now {
                Some(now) => self.by_service.insert(name.clone(), now.clone()),
                None => self.by_service.remove(name),
            };
            moved |= before != now;
        }
        moved
    }

    /// The ports to serve, as [`health_checks`] gives them.
    pub fn checks(&self) -> BTreeMap<u16, LocalEndpoints> {
        self.by_service.values().cloned().collect()
    }
}

/// kube-proxy's response: status line and JSON body.
pub fn response(check: &LocalEndpoints) -> (&'static str, String) {
    let status = if check.count > 0 { "200 OK" } else { "503 Service Unavailable" };
    let body = serde_json::json!({
        "service": {"namespace": &*check.service.namespace, "name": &*check.service.name},
        "localEndpoints": check.count,
        "serviceProxyHealthy": true,
    })
    .to_string();
    (status, body)
}

/// Serves every port of the latest `checks`, opening and closing listeners as ports come and go.
/// Runs until the sender is dropped.
pub async fn serve(mut checks: watch::Receiver<BTreeMap<u16, LocalEndpoints>>, metrics: Metrics) {
    let mut listeners: BTreeMap<u16, JoinHandle<()>> = BTreeMap::new();
    // Ports that could not be bound, so a persistent failure is logged once.
    let mut failed: std::collections::BTreeSet<u16> = Default::default();
    loop {
        let wanted: Vec<u16> = checks.borrow_and_update().keys().copied().collect();
        for (port, task) in std::mem::take(&mut listeners) {
            if wanted.contains(&port) {
                listeners.insert(port, task);
            } else {
                task.abort();
            }
        }
        failed.retain(|p| wanted.contains(p));
        let missing: Vec<u16> = wanted.into_iter().filter(|p| !listeners.contains_key(p)).collect();
        for port in missing {
            match listen(port).await {
                Ok(listener) => {
                    failed.remove(&port);
                    listeners.insert(port, tokio::spawn(answer(listener, port, checks.clone(), metrics.clone())));
                }
                Err(e) => {
                    if failed.insert(port) {
                        tracing::error!(port, error = %e, "cannot serve a Service health check port");
                        metrics.of::<crate::metrics::AgentMetrics>().reject("HealthCheckNodePort");
                    }
                }
            }
        }
        if checks.changed().await.is_err() {
            break;
        }
    }
    for task in listeners.into_values() {
        task.abort();
    }
}

/// A listener on `port` of every node address of both families: one IPv6 socket taking IPv4
/// too (V6ONLY off, whatever `net.ipv6.bindv6only` says), so a dual-stack node's health check
/// answers on its IPv6 address as kube-proxy's does; IPv4 alone where IPv6 is disabled.
async fn listen(port: u16) -> std::io::Result<TcpListener> {
    use std::os::fd::AsRawFd;
    let Ok(socket) = tokio::net::TcpSocket::new_v6() else {
        return TcpListener::bind(("0.0.0.0", port)).await;
    };
    let off: libc::c_int = 0;
    // SAFETY: setsockopt on a socket we own, with a c_int option value of the right size.
    let set = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::IPPROTO_IPV6,
            libc::IPV6_V6ONLY,
            std::ptr::addr_of!(off).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if set != 0 {
        return Err(std::io::Error::last_os_error());
    }
    socket.set_reuseaddr(true)?;
    socket.bind((std::net::Ipv6Addr::UNSPECIFIED, port).into())?;
    socket.listen(1024)
}

/// Answers on `port` with the latest check, through the agent's hardened server (a load
/// balancer and every pod reach this port).
async fn answer(
    listener: TcpListener,
    port: u16,
    checks: watch::Receiver<BTreeMap<u16, LocalEndpoints>>,
    metrics: Metrics,
) {
    let checks = Arc::new(checks);
    let handler: crate::http::Handler = Arc::new(move |_path| {
        let check = checks.borrow().get(&port).cloned()?;
        let (status, body) = response(&check);
        Some(crate::http::Response::new(status, "application/json", body))
    });
    crate::http::serve(listener, "health_check_node_port", crate::http::Limits::default(), metrics, handler).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::services::source::parse_objects;

    const OBJECTS: &str = r#"
apiVersion: v1
kind: Service
metadata: {namespace: default, name: web}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.10
  externalTrafficPolicy: Local
  healthCheckNodePort: 32000
  ports: [{name: http, protocol: TCP, port: 80, nodePort: 30080}]
---
apiVersion: v1
kind: Service
metadata: {namespace: default, name: cluster}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.11
  healthCheckNodePort: 32001
  ports: [{name: http, protocol: TCP, port: 80, nodePort: 30081}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {namespace: default, name: web-1, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, protocol: TCP, port: 8080}]
endpoints:
- {addresses: [10.0.0.1], nodeName: node-a, conditions: {ready: true}}
- {addresses: [10.0.0.2], nodeName: node-a, conditions: {ready: false}}
- {addresses: [10.0.0.3], nodeName: node-b, conditions: {ready: true}}
"#;

    #[test]
    fn local_ready_endpoints_decide_the_answer() {
        let state = parse_objects(OBJECTS).unwrap().state;
        let on_a = health_checks(&state, "node-a");
        assert_eq!(on_a.len(), 1, "only externalTrafficPolicy: Local Services get a health check");
        assert_eq!(on_a[&32000].count, 1, "the not-ready local endpoint does not count");
        let (status, body) = response(&on_a[&32000]);
        assert_eq!(status, "200 OK");
        let body: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(body["service"]["name"], "web");
        assert_eq!(body["localEndpoints"], 1);
        assert_eq!(response(&health_checks(&state, "node-c")[&32000]).0, "503 Service Unavailable");
    }

    #[test]
    fn a_dual_stack_pod_counts_once() {
        let text = OBJECTS.replace(
            "  clusterIP: 10.96.0.10\n",
            "  clusterIP: 10.96.0.10\n  clusterIPs: [10.96.0.10, \"fd00:96::10\"]\n  ipFamilies: [IPv4, IPv6]\n",
        ) + r#"---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {namespace: default, name: web-v6, labels: {kubernetes.io/service-name: web}}
addressType: IPv6
ports: [{name: http, protocol: TCP, port: 8080}]
endpoints:
- {addresses: ["fd00::1"], nodeName: node-a, conditions: {ready: true}}
"#;
        let state = parse_objects(&text).unwrap().state;
        assert_eq!(health_checks(&state, "node-a")[&32000].count, 1);
    }

    /// One listener answers on both families' addresses (a dual-stack node's IPv6 address was
    /// never listened on).
    #[tokio::test]
    async fn the_listener_takes_ipv4_and_ipv6() {
        let listener = listen(0).await.unwrap();
        let port = listener.local_addr().unwrap().port();
        for addr in ["127.0.0.1", "::1"] {
            let connect = tokio::net::TcpStream::connect((addr.parse::<std::net::IpAddr>().unwrap(), port));
            let accepted = tokio::time::timeout(std::time::Duration::from_secs(5), listener.accept());
            let (connected, accepted) = tokio::join!(connect, accepted);
            connected.unwrap_or_else(|e| panic!("{addr}: {e}"));
            accepted.unwrap().unwrap();
        }
    }
}
