//! Request handling: fault gate, routing, GET and LIST. WATCH lives in `super::watch`.

use std::collections::HashMap;
use std::io;
use std::sync::Arc;

use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{json, Value};

use super::fault::{wait_out_black_hole, FaultMode};
use super::resources::{self, ResourceType};
use super::selector::Selector;
use super::{watch, Shared};

pub type ResponseBody = BoxBody<Bytes, io::Error>;

/// Entry point for every request on every connection. An `Err` makes hyper abort the connection,
/// which is how a black-holed request is reset.
pub async fn handle(shared: Arc<Shared>, request: Request<Incoming>) -> Result<Response<ResponseBody>, io::Error> {
    let uri = request.uri().path_and_query().map_or_else(|| request.uri().path().to_string(), |pq| pq.to_string());
    shared.record_request(request.method().as_str(), &uri);
    tracing::trace!(method = %request.method(), %uri, "fake apiserver request");

    // Re-read the mode after a stall: the server may have moved on to another fault.
    loop {
        let mode = shared.modes.borrow().clone();
        match mode {
            FaultMode::BlackHole => {
                wait_out_black_hole(&shared.modes, || shared.stalled_release())
                    .await
                    .map_err(|_| io::Error::other("connection reset by fault injection"))?;
            }
            FaultMode::Errors500 => {
                return Ok(status_response(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "InternalError",
                    "fault injected: internal error",
                ));
            }
            FaultMode::Slow(delay) => {
                tokio::time::sleep(delay).await;
                break;
            }
            // Refuse closes connections; a request racing with that is simply served.
            FaultMode::Normal | FaultMode::Refuse => break,
        }
    }

    Ok(route(&shared, request.method(), request.uri().path(), request.uri().query()))
}

fn route(shared: &Arc<Shared>, method: &Method, path: &str, query: Option<&str>) -> Response<ResponseBody> {
    let segments: Vec<&str> = path.split('/').filter(|segment| !segment.is_empty()).collect();
    match segments.as_slice() {
        ["version"] => return json_response(StatusCode::OK, &version_info()),
        ["healthz" | "livez" | "readyz"] => return text_response(StatusCode::OK, "ok"),
        _ => {}
    }
    let Some(target) = parse_resource_path(&segments) else {
        return not_found(&format!("the server could not find the requested resource ({path})"));
    };
    if method != Method::GET {
        return status_response(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            &format!("the fake apiserver only serves GET, not {method}"),
        );
    }
    let query = parse_query(query.unwrap_or_default());
    match target.name {
        Some(name) => get_object(shared, target.resource, target.namespace, name),
        None if is_true(query.get("watch")) => match WatchQuery::parse(&query) {
            Ok(watch_query) => watch::respond(shared.clone(), target.resource, target.namespace, watch_query),
            Err(message) => bad_request(&message),
        },
        None => list_objects(shared, target.resource, target.namespace, &query),
    }
}

/// Which collection or object a path names.
struct ResourcePath<'a> {
    resource: &'static ResourceType,
    namespace: Option<&'a str>,
    name: Option<&'a str>,
}

/// Understands `/api/v1/...` and `/apis/GROUP/VERSION/...` followed by `PLURAL[/NAME]` or
/// `namespaces/NS/PLURAL[/NAME]`.
fn parse_resource_path<'a>(segments: &[&'a str]) -> Option<ResourcePath<'a>> {
    let (group, version, rest) = match segments {
        ["api", version, rest @ ..] => ("", *version, rest),
        ["apis", group, version, rest @ ..] => (*group, *version, rest),
        _ => return None,
    };
    let find = |plural: &str| resources::find_by_plural(group, version, plural);
    let path = match rest {
        ["namespaces", namespace, plural] => ResourcePath {
            resource: find(plural).filter(|resource| resource.namespaced)?,
            namespace: Some(namespace),
            name: None,
        },
        ["namespaces", namespace, plural, name] => ResourcePath {
            resource: find(plural).filter(|resource| resource.namespaced)?,
            namespace: Some(namespace),
            name: Some(name),
        },
        [plural] => ResourcePath { resource: find(plural)?, namespace: None, name: None },
        [plural, name] => ResourcePath {
            resource: find(plural).filter(|resource| !resource.namespaced)?,
            namespace: None,
            name: Some(name),
        },
        _ => return None,
    };
    Some(path)
}

fn get_object(
    shared: &Shared,
    resource: &'static ResourceType,
    namespace: Option<&str>,
    name: &str,
) -> Response<ResponseBody> {
    match shared.store().get(resource.kind, namespace, name) {
        Some(object) => json_response(StatusCode::OK, &object),
        None => not_found(&format!("{} \"{name}\" not found", resource.plural)),
    }
}

fn list_objects(
    shared: &Shared,
    resource: &'static ResourceType,
    namespace: Option<&str>,
    query: &HashMap<String, String>,
) -> Response<ResponseBody> {
    let selectors = match Selectors::parse(query) {
        Ok(selectors) => selectors,
        Err(message) => return bad_request(&message),
    };
    // 0 or absent means unpaginated, as in Kubernetes.
    let limit = match query.get("limit").map(|text| text.parse::<usize>()) {
        None => None,
        Some(Ok(0)) => None,
        Some(Ok(limit)) => Some(limit),
        Some(Err(_)) => return bad_request("limit must be a non-negative integer"),
    };
    let continuation = match query.get("continue").filter(|token| !token.is_empty()) {
        None => None,
        Some(token) => match ContinueToken::parse(token) {
            Some(continuation) => Some(continuation),
            None => return bad_request("invalid continue token"),
        },
    };

    let store = shared.store();
    // Later pages report the first page's revision: a watch from it then replays whatever
    // changed while paging, so the client converges even though pages are not a snapshot.
    let list_revision = match &continuation {
        Some(continuation) if !store.is_resumable(continuation.resource_version) => {
            return status_response(
                StatusCode::GONE,
                "Expired",
                "the provided continue parameter is too old to display a consistent list result",
            );
        }
        Some(continuation) => continuation.resource_version,
        None => store.resource_version(),
    };
    let after = continuation.as_ref().map(|continuation| (continuation.namespace.as_str(), continuation.name.as_str()));
    // The page is written from the objects' stored text (`store::Stored`): a copy of 500 Pods
    // as values, and of those again as the list's value, then their encoding on every page, were
    // most of this server's work at 150,000 Pods (docs/benchmarks.md). The text is what
    // serialising the list object gives (keys in the same sorted order).
    let mut body = format!("{{\"apiVersion\":{},\"items\":[", json!(resource.api_version())).into_bytes();
    let mut last = None;
    let mut matching = store.objects_of(resource, namespace, after).filter(|stored| selectors.matches(&stored.value));
    for (index, stored) in matching.by_ref().take(limit.unwrap_or(usize::MAX)).enumerate() {
        if index > 0 {
            body.push(b',');
        }
        body.extend_from_slice(&stored.text);
        last = Some(&stored.value);
    }
    let has_more = matching.next().is_some();
    let mut metadata = json!({"resourceVersion": list_revision.to_string()});
    if let (true, Some(last)) = (has_more, last) {
        let token = ContinueToken {
            resource_version: list_revision,
            namespace: text_at(last, "/metadata/namespace"),
            name: text_at(last, "/metadata/name"),
        };
        metadata["continue"] = json!(token.encode());
    }
    drop(matching);
    drop(store);
    body.extend_from_slice(format!("],\"kind\":{},\"metadata\":{metadata}}}", json!(resource.list_kind())).as_bytes());
    let mut response = Response::new(Full::new(Bytes::from(body)).map_err(|never| match never {}).boxed());
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// Label and field selectors of one request.
#[derive(Debug, Default)]
pub struct Selectors {
    labels: Selector,
    fields: Selector,
}

impl Selectors {
    fn parse(query: &HashMap<String, String>) -> Result<Self, String> {
        let parse = |key: &str| {
            Selector::parse(query.get(key).map(String::as_str).unwrap_or_default())
                .map_err(|error| format!("unable to parse {key}: {error}"))
        };
        Ok(Self { labels: parse("labelSelector")?, fields: parse("fieldSelector")? })
    }

    pub fn matches(&self, object: &Value) -> bool {
        self.labels.matches_labels(object) && self.fields.matches_fields(object)
    }
}

/// The parameters of a watch request.
#[derive(Debug)]
pub struct WatchQuery {
    /// `None` for "" or "0": start with the current objects as ADDED events.
    pub since: Option<u64>,
    pub selectors: Selectors,
    pub bookmarks: bool,
    /// After the initial ADDED events, send a bookmark annotated as their end (streaming lists).
    pub send_initial_events: bool,
    pub timeout: Option<std::time::Duration>,
}

impl WatchQuery {
    fn parse(query: &HashMap<String, String>) -> Result<Self, String> {
        let since = match query.get("resourceVersion").map(String::as_str) {
            None | Some("") | Some("0") => None,
            Some(text) => Some(text.parse::<u64>().map_err(|_| format!("invalid resourceVersion {text:?}"))?),
        };
        let timeout = match query.get("timeoutSeconds") {
            None => None,
            Some(text) => Some(std::time::Duration::from_secs(
                text.parse::<u64>().map_err(|_| format!("invalid timeoutSeconds {text:?}"))?,
            )),
        };
        Ok(Self {
            since,
            selectors: Selectors::parse(query)?,
            bookmarks: is_true(query.get("allowWatchBookmarks")),
            send_initial_events: is_true(query.get("sendInitialEvents")),
            timeout,
        })
    }
}

/// Where a paginated list continues: after (namespace, name), at the first page's revision.
struct ContinueToken {
    resource_version: u64,
    namespace: String,
    name: String,
}

impl ContinueToken {
    fn encode(&self) -> String {
        format!("{}/{}/{}", self.resource_version, self.namespace, self.name)
    }

    fn parse(token: &str) -> Option<Self> {
        let mut parts = token.splitn(3, '/');
        let resource_version = parts.next()?.parse().ok()?;
        let namespace = parts.next()?.to_string();
        let name = parts.next()?.to_string();
        Some(Self { resource_version, namespace, name })
    }
}

fn text_at(object: &Value, pointer: &str) -> String {
    object.pointer(pointer).and_then(Value::as_str).unwrap_or_default().to_string()
}

fn is_true(value: Option<&String>) -> bool {
    matches!(value.map(String::as_str), Some("true" | "1"))
}

/// Decodes `application/x-www-form-urlencoded` pairs; malformed escapes are kept literally
/// rather than rejected, and the last occurrence of a key wins.
fn parse_query(query: &str) -> HashMap<String, String> {
    query
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(key), percent_decode(value))
        })
        .collect()
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut index = 0;
    while index < bytes.len() {
        match bytes[index] {
            b'+' => decoded.push(b' '),
            b'%' => {
                let escaped = bytes
                    .get(index + 1..index + 3)
                    .and_then(|hex| std::str::from_utf8(hex).ok())
                    .and_then(|hex| u8::from_str_radix(hex, 16).ok());
                if let Some(byte) = escaped {
                    decoded.push(byte);
                    index += 2;
                } else {
                    decoded.push(b'%');
                }
            }
            byte => decoded.push(byte),
        }
        index += 1;
    }
    String::from_utf8_lossy(&decoded).into_owned()
}

fn version_info() -> Value {
    json!({
        "major": "1",
        "minor": "33",
        "gitVersion": "v1.33.0-fake",
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2025-01-01T00:00:00Z",
        "goVersion": "go1.24",
        "compiler": "gc",
        "platform": "linux/amd64",
    })
}

/// A `kind: Status` failure object, as Kubernetes returns for errors.
pub fn failure_status(code: StatusCode, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code.as_u16(),
    })
}

pub fn status_response(code: StatusCode, reason: &str, message: &str) -> Response<ResponseBody> {
    json_response(code, &failure_status(code, reason, message))
}

fn not_found(message: &str) -> Response<ResponseBody> {
    status_response(StatusCode::NOT_FOUND, "NotFound", message)
}

fn bad_request(message: &str) -> Response<ResponseBody> {
    status_response(StatusCode::BAD_REQUEST, "BadRequest", message)
}

fn json_response(code: StatusCode, body: &Value) -> Response<ResponseBody> {
    let mut response = Response::new(full_body(body.to_string()));
    *response.status_mut() = code;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

fn text_response(code: StatusCode, body: &'static str) -> Response<ResponseBody> {
    let mut response = Response::new(full_body(body.to_string()));
    *response.status_mut() = code;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    response
}

fn full_body(text: String) -> ResponseBody {
    Full::new(Bytes::from(text)).map_err(|never| match never {}).boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_decoding_survives_garbage() {
        let query = parse_query("labelSelector=a%3Db%2Cc%21%3Dd&x=%&y=%zz&&=&z&w=a+b&%E2%82");
        assert_eq!(query["labelSelector"], "a=b,c!=d");
        assert_eq!(query["x"], "%");
        assert_eq!(query["y"], "%zz");
        assert_eq!(query["z"], "");
        assert_eq!(query["w"], "a b");
        assert!(query.contains_key("\u{fffd}"));
    }

    #[test]
    fn resource_paths() {
        fn parse(path: &str) -> Option<(&'static str, Option<&str>, Option<&str>)> {
            let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
            parse_resource_path(&segments).map(|p| (p.resource.kind, p.namespace, p.name))
        }
        assert_eq!(parse("/api/v1/services"), Some(("Service", None, None)));
        assert_eq!(
            parse("/api/v1/namespaces/kube-system/services/dns"),
            Some(("Service", Some("kube-system"), Some("dns")))
        );
        assert_eq!(parse("/api/v1/namespaces"), Some(("Namespace", None, None)));
        assert_eq!(parse("/api/v1/namespaces/x"), Some(("Namespace", None, Some("x"))));
        assert_eq!(parse("/api/v1/nodes/n1"), Some(("Node", None, Some("n1"))));
        assert_eq!(
            parse("/apis/discovery.k8s.io/v1/namespaces/a/endpointslices"),
            Some(("EndpointSlice", Some("a"), None))
        );
        assert_eq!(parse("/api/v1/namespaces/a/nodes"), None);
        assert_eq!(parse("/api/v1/services/x"), None);
        assert_eq!(parse("/apis/networking.k8s.io/v2/networkpolicies"), None);
        assert_eq!(parse("/api"), None);
    }

    #[test]
    fn continue_tokens_round_trip() {
        let token = ContinueToken { resource_version: 7, namespace: String::new(), name: "n".into() };
        let parsed = ContinueToken::parse(&token.encode()).unwrap();
        assert_eq!((parsed.resource_version, parsed.namespace.as_str(), parsed.name.as_str()), (7, "", "n"));
        assert!(ContinueToken::parse("x/y").is_none());
    }
}

/// List pages are written from each object's stored text: byte for byte what serialising the
/// list object of the stored values gives, on every page, after updates and deletions too.
#[cfg(test)]
mod page_tests {
    use serde_json::{json, Value};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use crate::apiserver::{FakeApiServer, FakeApiServerConfig};

    async fn get(server: &FakeApiServer, path: &str) -> Vec<u8> {
        let address = server.url().trim_start_matches("http://").to_string();
        let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
        let request = format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await.unwrap();
        let start = response.windows(4).position(|w| w == b"\r\n\r\n").expect("a header") + 4;
        response.split_off(start)
    }

    fn service(name: &str, port: u16) -> Value {
        json!({"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": name, "namespace": "shop", "labels": {"z": "1", "a": "2"}},
               "spec": {"ports": [{"port": port, "protocol": "TCP"}], "clusterIP": "10.96.0.1"}})
    }

    #[tokio::test]
    async fn list_pages_are_the_serialised_list_of_what_is_stored() {
        let server = FakeApiServer::spawn(FakeApiServerConfig::default()).await.unwrap();
        for (name, port) in [("a", 80), ("b", 81), ("c", 82)] {
            server.apply(service(name, port)).unwrap();
        }
        // Replaced and deleted after being stored: the pages hold what is stored now.
        server.apply(service("b", 8081)).unwrap();
        server.apply(service("d", 83)).unwrap();
        server.delete("Service", Some("shop"), "c").unwrap();

        let mut pages = Vec::new();
        let mut path = "/api/v1/services?limit=2".to_string();
        loop {
            let body = get(&server, &path).await;
            let page: Value = serde_json::from_slice(&body).unwrap();
            let items: Vec<Value> = page["items"]
                .as_array()
                .unwrap()
                .iter()
                .map(|item| server.get("Service", Some("shop"), item["metadata"]["name"].as_str().unwrap()).unwrap())
                .collect();
            let expected =
                json!({"apiVersion": "v1", "items": items, "kind": "ServiceList", "metadata": page["metadata"]});
            assert_eq!(String::from_utf8(body).unwrap(), serde_json::to_string(&expected).unwrap());
            pages.push(items);
            match page["metadata"]["continue"].as_str() {
                Some(token) => path = format!("/api/v1/services?limit=2&continue={token}"),
                None => break,
            }
        }
        let names: Vec<Vec<&str>> = pages
            .iter()
            .map(|page| page.iter().map(|item| item["metadata"]["name"].as_str().unwrap()).collect())
            .collect();
        assert_eq!(names, [vec!["a", "b"], vec!["d"]]);
        assert_eq!(pages[0][1]["spec"]["ports"][0]["port"], 8081);
    }
}
