//! Drives the fake apiserver with the real kube-rs client, watcher and reflector.

use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{ListParams, WatchEvent, WatchParams};
use kube::runtime::watcher::Event;
use kube::runtime::{reflector, watcher, WatchStreamExt};
use kube::{Api, Client, ResourceExt};
use kube_router_tests::apiserver::{FakeApiServer, FakeApiServerConfig, FaultMode, StalledRelease};
use serde_json::json;
use tokio::sync::mpsc;

/// Watcher output, as delivered by a task that keeps polling the watcher the way an agent's
/// event loop does (an unpolled watcher makes no requests at all).
type WatchStream<K> = mpsc::UnboundedReceiver<Result<Event<K>, watcher::Error>>;

fn drive<K: Send + 'static>(
    stream: impl Stream<Item = Result<Event<K>, watcher::Error>> + Send + 'static,
) -> WatchStream<K> {
    let (sender, receiver) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(item) = stream.next().await {
            if sender.send(item).is_err() {
                break;
            }
        }
    });
    receiver
}

/// How tests point kube-rs at the fake server: a plain-HTTP cluster URL, no credentials.
fn client_for(server: &FakeApiServer, read_timeout: Option<Duration>) -> Client {
    let mut config = kube::Config::new(server.url().parse().expect("server URL parses"));
    config.read_timeout = read_timeout;
    Client::try_from(config).expect("kube client builds")
}

async fn spawn_server(config: FakeApiServerConfig) -> (FakeApiServer, Client) {
    let server = FakeApiServer::spawn(config).await.expect("server starts");
    let client = client_for(&server, None);
    (server, client)
}

fn service(namespace: &str, name: &str, labels: serde_json::Value) -> serde_json::Value {
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {"clusterIP": "10.0.0.1", "ports": [{"port": 80}]},
    })
}

fn resource_version_of(object: &serde_json::Value) -> String {
    object["metadata"]["resourceVersion"].as_str().expect("stored objects have a resourceVersion").to_string()
}

/// Next successful watcher event, skipping (and logging) errors, within `timeout`.
async fn next_event<K: std::fmt::Debug>(
    stream: &mut WatchStream<K>,
    timeout: Duration,
    errors: &mut Vec<String>,
) -> Event<K> {
    let deadline = Instant::now() + timeout;
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(remaining, stream.recv()).await {
            Err(_) => panic!("no watcher event within {timeout:?}; errors so far: {errors:#?}"),
            Ok(None) => panic!("watcher stream ended"),
            Ok(Some(Ok(event))) => return event,
            Ok(Some(Err(error))) => errors.push(format!("{error}")),
        }
    }
}

/// Reads a full Init, InitApply…, InitDone cycle and returns the names listed.
async fn expect_initial_list<K: kube::Resource + std::fmt::Debug>(
    stream: &mut WatchStream<K>,
    timeout: Duration,
    errors: &mut Vec<String>,
) -> Vec<String> {
    match next_event(stream, timeout, errors).await {
        Event::Init => {}
        other => panic!("expected Init, got {other:?}"),
    }
    collect_initial_list(stream, timeout, errors).await
}

/// Like `expect_initial_list`, but first skips live changes still in flight before the relist.
async fn expect_relist<K: kube::Resource + std::fmt::Debug>(
    stream: &mut WatchStream<K>,
    timeout: Duration,
    errors: &mut Vec<String>,
) -> Vec<String> {
    loop {
        match next_event(stream, timeout, errors).await {
            Event::Init => return collect_initial_list(stream, timeout, errors).await,
            Event::Apply(_) | Event::Delete(_) => {}
            other => panic!("expected Init, got {other:?}"),
        }
    }
}

async fn collect_initial_list<K: kube::Resource + std::fmt::Debug>(
    stream: &mut WatchStream<K>,
    timeout: Duration,
    errors: &mut Vec<String>,
) -> Vec<String> {
    let mut names = Vec::new();
    loop {
        match next_event(stream, timeout, errors).await {
            Event::InitApply(object) => names.push(object.name_any()),
            Event::InitDone => return names,
            other => panic!("expected InitApply or InitDone, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn list_sees_applied_objects_and_honours_selectors_and_pages() {
    let (server, client) = spawn_server(FakeApiServerConfig::default()).await;
    server.apply(service("default", "web", json!({"app": "web", "tier": "front"}))).unwrap();
    server.apply(service("default", "db", json!({"app": "db"}))).unwrap();
    server.apply(service("other", "cache", json!({"app": "cache", "tier": "back"}))).unwrap();
    server.apply(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-1"}})).unwrap();

    let all: Api<Service> = Api::all(client.clone());
    let names =
        |list: kube::core::ObjectList<Service>| list.items.iter().map(ResourceExt::name_any).collect::<Vec<_>>();
    let everything = all.list(&ListParams::default()).await.unwrap();
    assert_eq!(everything.metadata.resource_version.as_deref(), Some("4"));
    assert_eq!(names(everything), ["db", "web", "cache"]);
    let selected = |selector: &str| ListParams::default().labels(selector);
    assert_eq!(names(all.list(&selected("app=web")).await.unwrap()), ["web"]);
    assert_eq!(names(all.list(&selected("tier!=front")).await.unwrap()), ["db", "cache"]);
    assert_eq!(names(all.list(&selected("tier")).await.unwrap()), ["web", "cache"]);
    assert_eq!(names(all.list(&selected("app in (db,cache),!tier")).await.unwrap()), ["db"]);

    let in_default: Api<Service> = Api::namespaced(client.clone(), "default");
    assert_eq!(names(in_default.list(&ListParams::default()).await.unwrap()), ["db", "web"]);
    assert_eq!(in_default.get("web").await.unwrap().name_any(), "web");
    match in_default.get("missing").await {
        Err(kube::Error::Api(status)) => assert_eq!(status.code, 404),
        other => panic!("expected a 404 Status, got {other:?}"),
    }
    let by_field = ListParams::default().fields("metadata.namespace=other");
    assert_eq!(names(all.list(&by_field).await.unwrap()), ["cache"]);

    // Pagination: three objects in pages of two.
    let first = all.list(&ListParams::default().limit(2)).await.unwrap();
    let token = first.metadata.continue_.clone().expect("a continue token");
    assert_eq!(names(first), ["db", "web"]);
    let second = all.list(&ListParams::default().limit(2).continue_token(&token)).await.unwrap();
    assert!(second.metadata.continue_.as_deref().unwrap_or_default().is_empty());
    assert_eq!(names(second), ["cache"]);

    let nodes: Api<Node> = Api::all(client.clone());
    assert_eq!(nodes.get("node-1").await.unwrap().name_any(), "node-1");
    let slices: Api<EndpointSlice> = Api::all(client);
    assert!(slices.list(&ListParams::default()).await.unwrap().items.is_empty());
}

#[tokio::test]
async fn watcher_lists_then_streams_changes_with_resource_versions() {
    let (server, client) = spawn_server(FakeApiServerConfig::default()).await;
    server.apply(service("default", "a", json!({}))).unwrap();
    server.apply(service("default", "b", json!({}))).unwrap();
    let api: Api<Service> = Api::all(client);
    let mut stream: WatchStream<Service> = drive(watcher(api, watcher::Config::default()));
    let mut errors = Vec::new();
    let timeout = Duration::from_secs(5);

    assert_eq!(expect_initial_list(&mut stream, timeout, &mut errors).await, ["a", "b"]);
    assert!(server.wait_for_open_watches(1, timeout).await);

    let created = server.apply(service("default", "c", json!({}))).unwrap();
    match next_event(&mut stream, timeout, &mut errors).await {
        Event::Apply(svc) => {
            assert_eq!(svc.name_any(), "c");
            assert_eq!(svc.resource_version(), Some(resource_version_of(&created)));
        }
        other => panic!("expected Apply(c), got {other:?}"),
    }
    let deleted = server.delete("Service", Some("default"), "a").unwrap().unwrap();
    match next_event(&mut stream, timeout, &mut errors).await {
        Event::Delete(svc) => {
            assert_eq!(svc.name_any(), "a");
            assert_eq!(svc.resource_version(), Some(resource_version_of(&deleted)));
            assert_eq!(resource_version_of(&deleted), server.resource_version().to_string());
        }
        other => panic!("expected Delete(a), got {other:?}"),
    }
    assert!(errors.is_empty(), "unexpected errors: {errors:?}");

    let watch_requests = server.requests().into_iter().filter(|request| request.uri.contains("watch=true")).count();
    assert_eq!(watch_requests, 1, "no reconnects expected");
}

#[tokio::test]
async fn resume_replays_history_and_compaction_forces_a_relist() {
    // No periodic bookmarks: one arriving after compact() would hand the watcher a fresh,
    // resumable revision and legitimately spare it the relist.
    let config = FakeApiServerConfig { bookmark_interval: None, ..Default::default() };
    let (server, client) = spawn_server(config).await;
    server.apply(service("default", "kept", json!({}))).unwrap();
    server.apply(service("default", "doomed", json!({}))).unwrap();
    let (reader, writer) = reflector::store::<Service>();
    let api: Api<Service> = Api::all(client);
    let mut stream: WatchStream<Service> = drive(reflector(writer, watcher(api, watcher::Config::default())));
    let mut errors = Vec::new();
    let timeout = Duration::from_secs(5);
    expect_initial_list(&mut stream, timeout, &mut errors).await;
    assert!(server.wait_for_open_watches(1, timeout).await);

    // A plain reconnect resumes from the last revision: no relist, nothing missed.
    server.close_watches();
    server.apply(service("default", "while-reconnecting", json!({}))).unwrap();
    match next_event(&mut stream, timeout, &mut errors).await {
        Event::Apply(svc) => assert_eq!(svc.name_any(), "while-reconnecting"),
        other => panic!("expected Apply after resume, got {other:?}"),
    }
    assert!(server.wait_for_open_watches(1, timeout).await);

    // Changes whose events are then compacted away are only learnt through a relist.
    server.delete("Service", Some("default"), "doomed").unwrap();
    server.apply(service("default", "late", json!({}))).unwrap();
    server.compact();
    server.close_watches();
    // The open stream may still deliver those two changes before it is closed; the resume
    // fails either way, because compaction took a revision of its own.
    let relisted = expect_relist(&mut stream, timeout, &mut errors).await;
    assert_eq!(relisted, ["kept", "late", "while-reconnecting"]);
    assert!(
        errors.iter().any(|error| error.contains("too old resource version")),
        "expected an in-stream 410 before the relist, got {errors:?}"
    );
    let mut cached: Vec<String> = reader.state().iter().map(|svc| svc.name_any()).collect();
    cached.sort();
    assert_eq!(cached, ["kept", "late", "while-reconnecting"]);
}

#[tokio::test]
async fn server_side_watch_timeout_makes_the_watcher_reconnect() {
    let config = FakeApiServerConfig {
        max_watch_duration: Some(Duration::from_millis(300)),
        bookmark_interval: None,
        ..Default::default()
    };
    let (server, client) = spawn_server(config).await;
    let api: Api<Service> = Api::all(client);
    let mut stream: WatchStream<Service> = drive(watcher(api, watcher::Config::default()));
    let mut errors = Vec::new();
    let timeout = Duration::from_secs(5);
    expect_initial_list(&mut stream, timeout, &mut errors).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    server.apply(service("default", "after-reconnects", json!({}))).unwrap();
    match next_event(&mut stream, timeout, &mut errors).await {
        Event::Apply(svc) => assert_eq!(svc.name_any(), "after-reconnects"),
        other => panic!("expected Apply, got {other:?}"),
    }
    let watches = server.requests().iter().filter(|r| r.uri.contains("watch=true")).count();
    assert!(watches >= 3, "expected several watch reconnects, saw {watches}");
    assert!(errors.is_empty(), "reconnects at timeout are silent: {errors:?}");
}

/// One fault-injection scenario for a watcher with the default backoff.
struct Outage {
    fault: FaultMode,
    duration: Duration,
    watcher_config: watcher::Config,
    /// kube-rs `Config::read_timeout` (kube-rs default: none).
    read_timeout: Option<Duration>,
    stalled_release: StalledRelease,
}

impl Outage {
    fn of(fault: FaultMode, duration: Duration) -> Self {
        Self {
            fault,
            duration,
            watcher_config: watcher::Config::default(),
            read_timeout: None,
            stalled_release: StalledRelease::KeepStalled,
        }
    }
}

/// Starts a backed-off watcher, injects the fault, changes an object meanwhile, returns to
/// Normal, and reports how long after that the change was seen, plus the errors observed.
async fn recover_from(outage: Outage) -> (Duration, Vec<String>, FakeApiServer) {
    let Outage { fault, duration, watcher_config, read_timeout, stalled_release } = outage;
    let config = FakeApiServerConfig { stalled_release, ..Default::default() };
    let server = FakeApiServer::spawn(config).await.unwrap();
    let client = client_for(&server, read_timeout);
    server.apply(service("default", "before", json!({}))).unwrap();
    let api: Api<Service> = Api::all(client);
    let mut stream: WatchStream<Service> = drive(watcher(api, watcher_config).default_backoff());
    let mut errors = Vec::new();
    expect_initial_list(&mut stream, Duration::from_secs(5), &mut errors).await;
    assert!(server.wait_for_open_watches(1, Duration::from_secs(5)).await);

    server.set_mode(fault.clone()).await.unwrap();
    server.apply(service("default", "during", json!({}))).unwrap();
    // Keep polling the watcher during the outage so its retries actually happen.
    let outage_end = tokio::time::Instant::now() + duration;
    while let Ok(item) = tokio::time::timeout_at(outage_end, stream.recv()).await {
        match item {
            Some(Err(error)) => errors.push(format!("{error}")),
            Some(Ok(event)) => panic!("no event expected during {fault:?}, got {event:?}"),
            None => panic!("watcher ended"),
        }
    }
    server.set_mode(FaultMode::Normal).await.unwrap();
    let recovered_from = Instant::now();
    loop {
        match next_event(&mut stream, Duration::from_secs(30), &mut errors).await {
            Event::Apply(svc) if svc.name_any() == "during" => break,
            // A relist is an acceptable way to recover too.
            Event::Init | Event::InitDone => {}
            Event::InitApply(svc) if svc.name_any() == "during" => break,
            Event::InitApply(_) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    (recovered_from.elapsed(), errors, server)
}

fn report(fault: &str, recovery: Duration, errors: &[String], server: &FakeApiServer) {
    eprintln!("--- {fault}: change seen {recovery:?} after returning to Normal");
    for error in errors {
        eprintln!("    watcher error: {error}");
    }
    for request in server.requests() {
        eprintln!("    {:>8.3}s {:?} {} {}", request.at.as_secs_f64(), request.mode, request.method, request.uri);
    }
}

#[tokio::test]
async fn watcher_recovers_from_a_black_hole() {
    // The stalled stream is only noticed by the watcher's idle timeout (timeout + 5 s), and
    // silently: the watcher reports no error, it just reconnects.
    let (recovery, errors, server) = recover_from(Outage {
        watcher_config: watcher::Config::default().timeout(2),
        ..Outage::of(FaultMode::BlackHole, Duration::from_secs(3))
    })
    .await;
    report("BlackHole 3s, watcher timeout 2s", recovery, &errors, &server);
    assert!(errors.is_empty(), "{errors:?}");
    assert!(recovery < Duration::from_secs(10), "took {recovery:?}");
}

#[tokio::test]
async fn watcher_recovers_from_a_long_black_hole_with_a_read_timeout() {
    // Outage longer than the idle timeout: the reconnect itself lands in the black hole, and
    // only a client read timeout gets it out (kube-rs has none by default).
    let (recovery, errors, server) = recover_from(Outage {
        watcher_config: watcher::Config::default().timeout(1),
        read_timeout: Some(Duration::from_secs(2)),
        ..Outage::of(FaultMode::BlackHole, Duration::from_secs(9))
    })
    .await;
    report("BlackHole 9s, watcher timeout 1s, read_timeout 2s", recovery, &errors, &server);
    assert!(!errors.is_empty());
    assert!(recovery < Duration::from_secs(15), "took {recovery:?}");
}

#[tokio::test]
async fn black_holed_watches_can_resume_or_be_reset_on_release() {
    for release in [StalledRelease::Resume, StalledRelease::Reset] {
        let (recovery, errors, server) = recover_from(Outage {
            stalled_release: release,
            ..Outage::of(FaultMode::BlackHole, Duration::from_secs(1))
        })
        .await;
        report(&format!("BlackHole 1s, {release:?}"), recovery, &errors, &server);
        // Default watcher timeout (290 s): only the release policy can make this quick.
        assert!(recovery < Duration::from_secs(5), "{release:?} took {recovery:?}");
    }
}

#[tokio::test]
async fn watcher_recovers_from_refused_connections() {
    let (recovery, errors, server) = recover_from(Outage::of(FaultMode::Refuse, Duration::from_secs(3))).await;
    report("Refuse 3s", recovery, &errors, &server);
    assert!(!errors.is_empty(), "refused connections surface as watcher errors");
    assert!(recovery < Duration::from_secs(10), "took {recovery:?}");
}

#[tokio::test]
async fn watcher_recovers_from_internal_errors() {
    let (recovery, errors, server) = recover_from(Outage::of(FaultMode::Errors500, Duration::from_secs(3))).await;
    report("Errors500 3s", recovery, &errors, &server);
    assert!(errors.iter().any(|error| error.contains("fault injected")));
    assert!(recovery < Duration::from_secs(10), "took {recovery:?}");
}

#[tokio::test]
async fn streaming_list_watcher_gets_initial_events_and_their_end_bookmark() {
    let (server, client) = spawn_server(FakeApiServerConfig::default()).await;
    server.apply(service("default", "a", json!({}))).unwrap();
    let api: Api<Service> = Api::all(client);
    let mut stream = drive(watcher(api, watcher::Config::default().streaming_lists()));
    let mut errors = Vec::new();
    let timeout = Duration::from_secs(5);
    assert_eq!(expect_initial_list(&mut stream, timeout, &mut errors).await, ["a"]);
    server.apply(service("default", "b", json!({}))).unwrap();
    match next_event(&mut stream, timeout, &mut errors).await {
        Event::Apply(svc) => assert_eq!(svc.name_any(), "b"),
        other => panic!("expected Apply(b), got {other:?}"),
    }
    assert!(errors.is_empty(), "{errors:?}");
}

#[tokio::test]
async fn stop_and_start_keep_the_port_and_the_objects() {
    let (server, client) = spawn_server(FakeApiServerConfig::default()).await;
    server.apply(service("default", "a", json!({}))).unwrap();
    let api: Api<Service> = Api::all(client);
    server.stop().await;
    assert!(api.list(&ListParams::default()).await.is_err());
    server.start().await.unwrap();
    assert_eq!(api.list(&ListParams::default()).await.unwrap().items.len(), 1);

    server.set_mode(FaultMode::Slow(Duration::from_millis(300))).await.unwrap();
    let started = Instant::now();
    api.list(&ListParams::default()).await.unwrap();
    assert!(started.elapsed() >= Duration::from_millis(300));
    server.set_mode(FaultMode::Normal).await.unwrap();
}

#[tokio::test]
async fn bookmarks_are_delivered_and_harmless() {
    let config = FakeApiServerConfig { bookmark_interval: Some(Duration::from_millis(100)), ..Default::default() };
    let (server, client) = spawn_server(config).await;
    let applied = server.apply(service("default", "a", json!({}))).unwrap();
    let api: Api<Service> = Api::all(client);

    // Raw watch: bookmarks arrive with the current revision.
    let params = WatchParams::default().timeout(5);
    let mut raw = api.watch(&params, &resource_version_of(&applied)).await.unwrap().boxed();
    let bookmark = tokio::time::timeout(Duration::from_secs(2), raw.next()).await.unwrap();
    match bookmark {
        Some(Ok(WatchEvent::Bookmark(bookmark))) => {
            assert_eq!(bookmark.metadata.resource_version, server.resource_version().to_string());
            assert_eq!(bookmark.types.kind, "Service");
        }
        other => panic!("expected a bookmark, got {other:?}"),
    }

    // The watcher asks for bookmarks by default and keeps working through many of them.
    let mut stream: WatchStream<Service> = drive(watcher(api, watcher::Config::default()));
    let mut errors = Vec::new();
    let timeout = Duration::from_secs(5);
    expect_initial_list(&mut stream, timeout, &mut errors).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    server.apply(service("default", "b", json!({}))).unwrap();
    match next_event(&mut stream, timeout, &mut errors).await {
        Event::Apply(svc) => assert_eq!(svc.name_any(), "b"),
        other => panic!("expected Apply(b), got {other:?}"),
    }
    assert!(errors.is_empty(), "{errors:?}");
    assert!(server.requests().iter().any(|request| request.uri.contains("allowWatchBookmarks=true")));
}

#[tokio::test]
async fn odd_requests_get_status_errors_not_panics() {
    let server = FakeApiServer::spawn(FakeApiServerConfig::default()).await.unwrap();
    let address = server.address();
    for target in [
        "/nope",
        "/api/v1/widgets",
        "/api/v1/services?labelSelector=%ZZ%&limit=abc",
        "/api/v1/services?labelSelector=a%20b",
        "/api/v1/services?watch=true&resourceVersion=banana",
        "/api/v1/services?continue=garbage&limit=1",
        "/api/v1/services?watch=1&timeoutSeconds=-1",
    ] {
        let response = raw_get(address, target).await;
        let status_line = response.lines().next().unwrap_or_default();
        assert!(status_line.starts_with("HTTP/1.1 4"), "{target}: {status_line}");
        assert!(response.contains("\"kind\":\"Status\""), "{target}: {response}");
    }
    for target in [
        "/api/v1/services?&&==&%",
        "/api/v1/services?watch=true&resourceVersion=99999",
        "/api/v1/services?watch=true&timeoutSeconds=18446744073709551615",
        "/api/v1/services?limit=18446744073709551615",
        "/version",
    ] {
        let response = raw_get(address, target).await;
        assert!(response.starts_with("HTTP/1.1 200"), "{target}: {response}");
    }
}

/// A bare HTTP/1.1 GET with `Connection: close`, returning the whole response text.
async fn raw_get(address: std::net::SocketAddr, target: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
    let request = format!("GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    // Watches stay open; a short read window is enough to see the status line.
    let _ = tokio::time::timeout(Duration::from_millis(500), stream.read_to_end(&mut response)).await;
    String::from_utf8_lossy(&response).into_owned()
}
