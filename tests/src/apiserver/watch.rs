//! WATCH responses: a chunked stream of newline-delimited JSON events fed by a per-watch task.

use std::io;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Bytes, Frame};
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Response, StatusCode};
use serde_json::{json, Value};
use tokio::sync::{broadcast, mpsc};
use tokio::time::Instant;

use super::fault::{wait_out_black_hole, FaultMode};
use super::http::{failure_status, ResponseBody, WatchQuery};
use super::resources::ResourceType;
use super::store::{ChangeEvent, EventType, Notice, Subscription};
use super::Shared;

/// Small, so that a stalled or slow client applies back-pressure instead of buffering.
const STREAM_BUFFER: usize = 16;

/// Starts a watch. Expired resource versions still get HTTP 200, with the 410 as an in-stream
/// ERROR event: kube-rs relists on that, whereas a plain HTTP 410 only makes it retry the watch.
pub fn respond(
    shared: Arc<Shared>,
    resource: &'static ResourceType,
    namespace: Option<&str>,
    query: WatchQuery,
) -> Response<ResponseBody> {
    let subscription = shared.store().subscribe(resource, query.since);
    let body = match subscription {
        Err(_expired) => {
            let line = event_line("ERROR", &expired_status());
            Full::new(line).map_err(|never| match never {}).boxed()
        }
        Ok(subscription) => {
            let (sender, receiver) = mpsc::channel(STREAM_BUFFER);
            let stream = WatchStream {
                _open: OpenWatch::register(shared.clone()),
                shared,
                resource,
                namespace: namespace.map(str::to_string),
                query,
                sender,
            };
            tokio::spawn(stream.run(subscription));
            ChannelBody { receiver }.boxed()
        }
    };
    let mut response = Response::new(body);
    *response.status_mut() = StatusCode::OK;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

fn expired_status() -> Value {
    failure_status(StatusCode::GONE, "Expired", "too old resource version")
}

fn event_line(event_type: &str, object: &Value) -> Bytes {
    Bytes::from(format!("{{\"type\":\"{event_type}\",\"object\":{object}}}\n"))
}

/// Counts a watch as open for as long as its producer lives (stalled ones included).
struct OpenWatch(Arc<Shared>);

impl OpenWatch {
    fn register(shared: Arc<Shared>) -> Self {
        shared.open_watches.fetch_add(1, Ordering::SeqCst);
        Self(shared)
    }
}

impl Drop for OpenWatch {
    fn drop(&mut self) {
        self.0.open_watches.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One watch's producer; ends when the client goes away, at the deadline, on `close_watches`,
/// or when a fault mode calls for it.
struct WatchStream {
    _open: OpenWatch,
    shared: Arc<Shared>,
    resource: &'static ResourceType,
    namespace: Option<String>,
    query: WatchQuery,
    sender: mpsc::Sender<Result<Bytes, io::Error>>,
}

impl WatchStream {
    async fn run(self, subscription: Subscription) {
        let lifetime = match (self.query.timeout, self.shared.max_watch_duration) {
            (Some(requested), Some(cap)) => Some(requested.min(cap)),
            (requested, cap) => requested.or(cap),
        };
        // A far-away deadline stands in for "none" (and for absurd client timeouts, which
        // would overflow `Instant`) so the select below stays uniform.
        let now = Instant::now();
        let far_future = now + Duration::from_secs(10 * 365 * 86_400);
        let deadline = lifetime
            .and_then(|lifetime| now.checked_add(lifetime))
            .map_or(far_future, |deadline| deadline.min(far_future));
        let mut modes = self.shared.modes.subscribe();
        modes.borrow_and_update();
        let mut generation = self.shared.watch_generation.subscribe();
        generation.borrow_and_update();

        for event in &subscription.backlog {
            if let Some(line) = self.render_change(event) {
                if !self.send(line).await {
                    return;
                }
            }
        }
        if self.query.since.is_none()
            && self.query.send_initial_events
            && !self.send(self.bookmark_line(subscription.resource_version, true)).await
        {
            return;
        }

        let mut notices = subscription.notices;
        let timeout = tokio::time::sleep_until(deadline);
        tokio::pin!(timeout);
        loop {
            tokio::select! {
                // Control signals first, so a fault takes effect before any further event.
                biased;
                _ = self.sender.closed() => return,
                _ = generation.changed() => return,
                changed = modes.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    let mode = modes.borrow_and_update().clone();
                    match mode {
                        FaultMode::BlackHole => {
                            let release = wait_out_black_hole(&self.shared.modes, || {
                                self.shared.stalled_release()
                            });
                            let released = tokio::select! {
                                released = release => released,
                                _ = self.sender.closed() => return,
                            };
                            if released.is_err() {
                                let reset = io::Error::other("watch reset by fault injection");
                                let _ = self.sender.send(Err(reset)).await;
                                return;
                            }
                            modes.borrow_and_update();
                        }
                        // End cleanly so the client reconnects straight into the errors.
                        FaultMode::Errors500 => return,
                        FaultMode::Normal | FaultMode::Refuse | FaultMode::Slow(_) => {}
                    }
                }
                _ = &mut timeout => return,
                notice = notices.recv() => {
                    let line = match notice {
                        Ok(Notice::Change(event)) => self.render_change(&event),
                        Ok(Notice::Bookmark(resource_version)) => self
                            .query
                            .bookmarks
                            .then(|| self.bookmark_line(resource_version, false)),
                        // Fell too far behind to be caught up: the client must relist.
                        Err(broadcast::error::RecvError::Lagged(_)) => {
                            let _ = self.send(event_line("ERROR", &expired_status())).await;
                            return;
                        }
                        Err(broadcast::error::RecvError::Closed) => return,
                    };
                    if let Some(line) = line {
                        if !self.send(line).await {
                            return;
                        }
                    }
                }
            }
        }
    }

    async fn send(&self, line: Bytes) -> bool {
        self.sender.send(Ok(line)).await.is_ok()
    }

    /// The line this watch sends for a change, if any. A modification moving an object into
    /// or out of the watch's selection is sent as ADDED or DELETED, as Kubernetes does.
    fn render_change(&self, event: &ChangeEvent) -> Option<Bytes> {
        if !std::ptr::eq(event.resource, self.resource) {
            return None;
        }
        if self.namespace.as_ref().is_some_and(|namespace| *namespace != event.namespace) {
            return None;
        }
        let selected_now = self.query.selectors.matches(&event.object);
        let selected_before = event.previous.as_ref().is_some_and(|previous| self.query.selectors.matches(previous));
        let wire_type = match (event.event_type, selected_before, selected_now) {
            (EventType::Added, _, true) => "ADDED",
            (EventType::Deleted, _, true) => "DELETED",
            (EventType::Modified, true, true) => "MODIFIED",
            (EventType::Modified, false, true) => "ADDED",
            (EventType::Modified, true, false) => "DELETED",
            _ => return None,
        };
        Some(event_line(wire_type, &event.object))
    }

    fn bookmark_line(&self, resource_version: u64, marks_initial_events_end: bool) -> Bytes {
        let mut metadata = json!({"resourceVersion": resource_version.to_string()});
        if marks_initial_events_end {
            metadata["annotations"] = json!({"k8s.io/initial-events-end": "true"});
        }
        let object = json!({
            "kind": self.resource.kind,
            "apiVersion": self.resource.api_version(),
            "metadata": metadata,
        });
        event_line("BOOKMARK", &object)
    }
}

/// Response body reading from the producer task; an `Err` item aborts the connection.
struct ChannelBody {
    receiver: mpsc::Receiver<Result<Bytes, io::Error>>,
}

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        self.receiver.poll_recv(context).map(|item| item.map(|result| result.map(Frame::data)))
    }
}
