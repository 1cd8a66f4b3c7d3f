//! The agent's Prometheus metrics, scraped from inside its network namespace: what the
//! end-to-end tests wait on (syncs done, entries written, objects rejected) instead of its log.
//!
//! The agent records a sync's writes, its count and its completeness under one lock, so one
//! scrape holds whole syncs: [`ServiceSyncs::since`] between two scrapes is exactly what the
//! syncs in between did.
use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use kube_router_common::map_names;

use crate::Agent;

/// The maps a Service sync writes (`kube_router_map_writes_total{map=...}`).
const SERVICE_MAPS: [&str; 8] = [
    map_names::SERVICES,
    map_names::BACKEND_SLOTS,
    map_names::BACKENDS,
    map_names::SOURCE_RANGES,
    map_names::SERVICES_V6,
    map_names::BACKEND_SLOTS_V6,
    map_names::BACKENDS_V6,
    map_names::SOURCE_RANGES_V6,
];

/// The maps a policy sync writes.
const POLICY_MAPS: [&str; 5] = [
    map_names::POLICY_PODS,
    map_names::POLICY_PODS_V6,
    map_names::POLICY_PORTS,
    map_names::POLICY_PEERS,
    map_names::POLICY_PEERS_V6,
];

/// What the attaches of one attachment point did to its pinned links.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LinkAttaches {
    /// Found running our program: left as they were.
    pub adopted: u64,
    pub updated: u64,
    pub created: u64,
}

/// One scrape of `/metrics`.
pub struct Scrape(pub String);

impl Scrape {
    /// The sum of the samples of `name` that carry every one of `labels` (0 when none does:
    /// a labelled counter appears with its first increment).
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.0
            .lines()
            // Cheap before the label parsing: a test polls this many times a second.
            .filter(|line| line.starts_with(name))
            .filter_map(|line| {
                let (series, value) = line.rsplit_once(' ')?;
                let (sample, label_text) = match series.split_once('{') {
                    Some((sample, rest)) => (sample, rest.strip_suffix('}')?),
                    None => (series, ""),
                };
                let carried = parse_labels(label_text);
                let matches =
                    sample == name && labels.iter().all(|(k, v)| carried.iter().any(|(ck, cv)| ck == k && cv == v));
                matches.then(|| value.parse::<f64>().ok()).flatten()
            })
            .sum()
    }

    /// A counter's value as a whole number.
    pub fn count(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        self.value(name, labels) as u64
    }

    /// Program links attached at `attachment` (`tc`, `cgroup`, `xdp`) since the agent started.
    pub fn link_attaches(&self, attachment: &str) -> LinkAttaches {
        let n = |outcome| {
            self.count("kube_router_bpf_link_attaches_total", &[("attachment", attachment), ("outcome", outcome)])
        };
        LinkAttaches { adopted: n("adopted"), updated: n("updated"), created: n("created") }
    }

    /// Writes to `maps`, by operation.
    fn writes(&self, maps: &[&str]) -> Writes {
        let op = |op: &str| {
            maps.iter().map(|map| self.count("kube_router_map_writes_total", &[("map", map), ("op", op)])).sum()
        };
        Writes { inserts: op("insert"), updates: op("update"), deletes: op("delete"), errors: op("error") }
    }

    pub fn service_syncs(&self) -> ServiceSyncs {
        ServiceSyncs {
            syncs: self.count("kube_router_sync_duration_seconds_count", &[]),
            complete: self.count("kube_router_service_complete_syncs_total", &[]),
            writes: self.writes(&SERVICE_MAPS),
        }
    }

    pub fn policy_syncs(&self) -> PolicySyncs {
        PolicySyncs {
            syncs: self.count("kube_router_controller_iptables_sync_time_count", &[]),
            writes: self.writes(&POLICY_MAPS),
        }
    }

    /// `kube_router_rejected_objects_total{kind}`.
    pub fn rejected(&self, kind: &str) -> u64 {
        self.count("kube_router_rejected_objects_total", &[("kind", kind)])
    }
}

/// `k="v",k2="v2"` (values with `\"`, `\\` and `\n` escaped, as the text format has them).
fn parse_labels(text: &str) -> Vec<(String, String)> {
    let mut labels = Vec::new();
    let mut rest = text;
    while let Some((key, after)) = rest.split_once("=\"") {
        let mut value = String::new();
        let mut chars = after.char_indices();
        let mut end = after.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, escaped)) => value.push(escaped),
                    None => {}
                },
                '"' => {
                    end = i + 1;
                    break;
                }
                c => value.push(c),
            }
        }
        labels.push((key.trim_start_matches(',').trim().to_string(), value));
        rest = &after[end..];
    }
    labels
}

/// Map writes by operation, summed over a set of maps (`errors` includes writes refused by a
/// full map).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Writes {
    pub inserts: u64,
    pub updates: u64,
    pub deletes: u64,
    pub errors: u64,
}

impl Writes {
    pub fn total(&self) -> u64 {
        self.inserts + self.updates + self.deletes + self.errors
    }

    fn minus(&self, earlier: &Writes) -> Writes {
        Writes {
            inserts: self.inserts - earlier.inserts,
            updates: self.updates - earlier.updates,
            deletes: self.deletes - earlier.deletes,
            errors: self.errors - earlier.errors,
        }
    }
}

/// The Service syncs an agent made and what they wrote to the service maps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceSyncs {
    pub syncs: u64,
    /// Of those, the syncs from a complete desired state (not a checkpoint).
    pub complete: u64,
    pub writes: Writes,
}

impl ServiceSyncs {
    /// What the syncs after `earlier` did.
    pub fn since(&self, earlier: &ServiceSyncs) -> ServiceSyncs {
        ServiceSyncs {
            syncs: self.syncs - earlier.syncs,
            complete: self.complete - earlier.complete,
            writes: self.writes.minus(&earlier.writes),
        }
    }
}

/// The policy syncs an agent made and what they wrote to the policy maps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PolicySyncs {
    pub syncs: u64,
    pub writes: Writes,
}

/// `GET /metrics` on `127.0.0.1:port` from a thread in the network namespace at `netns`.
fn scrape_in(netns: &str, port: u16) -> Result<Scrape> {
    let path = netns.to_string();
    let mut stream = thread::spawn(move || -> Result<TcpStream> {
        let ns = std::fs::File::open(&path).with_context(|| format!("opening {path}"))?;
        // SAFETY: setns on this short-lived thread only, with a valid namespace fd; the socket
        // it opens stays in that namespace wherever it is used.
        if unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&ns), libc::CLONE_NEWNET) } != 0 {
            bail!("setns {path}: {}", std::io::Error::last_os_error());
        }
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        Ok(TcpStream::connect_timeout(&addr, Duration::from_secs(2))?)
    })
    .join()
    .map_err(|_| anyhow::anyhow!("scrape thread panicked"))??;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, body) = response.split_once("\r\n\r\n").context("no end of the response head")?;
    if head.split_whitespace().nth(1) != Some("200") {
        bail!("metrics answered {head:?}");
    }
    Ok(Scrape(body.to_string()))
}

impl Agent {
    /// One scrape of the agent's `/metrics` (it must have been started with `--metrics-port`).
    pub fn scrape(&self) -> Result<Scrape> {
        let port = self.metrics_port.context("the agent was started without --metrics-port")?;
        scrape_in(&self.netns, port)
    }

    /// Scrapes until `ready` returns something, and returns that. Fails when the agent exits
    /// or `timeout` passes; a scrape that fails (the listener not up yet) counts as "not yet".
    pub fn wait_for_metrics<T>(
        &mut self,
        what: &str,
        timeout: Duration,
        mut ready: impl FnMut(&Scrape) -> Option<T>,
    ) -> Result<T> {
        let deadline = Instant::now() + timeout;
        loop {
            let last = match self.scrape() {
                Ok(scrape) => match ready(&scrape) {
                    Some(found) => return Ok(found),
                    None => Ok(scrape),
                },
                Err(e) => Err(e),
            };
            let exited = self.child.try_wait()?;
            if exited.is_some() || Instant::now() > deadline {
                // What the last scrape said, for the error.
                let last = match last {
                    Ok(scrape) => format!("{:?} / {:?}", scrape.service_syncs(), scrape.policy_syncs()),
                    Err(e) => format!("{e:#}"),
                };
                match exited {
                    Some(status) => bail!("agent exited ({status}) while waiting for {what}; last: {last}"),
                    None => bail!("timed out after {timeout:?} waiting for {what}; last: {last}"),
                }
            }
            // Not faster: each scrape costs the agent a render, and a starting agent (loading
            // its programs on a busy machine) is measurably slower when scraped 20 times a second.
            thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn service_syncs(&self) -> Result<ServiceSyncs> {
        Ok(self.scrape()?.service_syncs())
    }

    /// Waits until the agent has made `n` Service syncs in all; returns the counters then.
    pub fn wait_for_service_syncs(&mut self, n: u64, timeout: Duration) -> Result<ServiceSyncs> {
        self.wait_for_metrics(&format!("{n} service sync(s)"), timeout, |s| {
            (s.service_syncs().syncs >= n).then_some(())
        })?;
        self.service_syncs_after_a_count()
    }

    /// The counters from a fresh scrape, once one scrape has counted the sync waited for. Each
    /// counter is its own atomic and one scrape reads them one by one, so it may count a sync
    /// whose writes it read just before they were recorded; the agent records a sync's writes
    /// before counting it, so every scrape that starts after that one sees them.
    fn service_syncs_after_a_count(&self) -> Result<ServiceSyncs> {
        self.service_syncs()
    }

    /// Waits for a Service sync after `earlier`; returns what the syncs since then did.
    pub fn wait_for_service_sync_after(&mut self, earlier: &ServiceSyncs, timeout: Duration) -> Result<ServiceSyncs> {
        let now = self.wait_for_service_syncs(earlier.syncs + 1, timeout)?;
        Ok(now.since(earlier))
    }

    /// Waits for the first Service sync from a complete desired state; returns the counters then.
    pub fn wait_for_complete_service_sync(&mut self, timeout: Duration) -> Result<ServiceSyncs> {
        self.wait_for_metrics("a service sync from a complete listing", timeout, |s| {
            (s.service_syncs().complete >= 1).then_some(())
        })?;
        self.service_syncs_after_a_count()
    }

    /// Waits until the syncs after `earlier` have written exactly `expected`, then checks for a
    /// second that nothing more is written. A change can arrive in several syncs (a Service and
    /// its EndpointSlice are separate watch events); what counts is the total.
    pub fn wait_for_service_writes(
        &mut self,
        earlier: &ServiceSyncs,
        expected: Writes,
        timeout: Duration,
    ) -> Result<()> {
        let written = self.wait_for_metrics(&format!("service writes {expected:?}"), timeout, |s| {
            let written = s.service_syncs().since(earlier).writes;
            let over = written.inserts > expected.inserts
                || written.updates > expected.updates
                || written.deletes > expected.deletes
                || written.errors > expected.errors;
            (written == expected || over).then_some(written)
        })?;
        if written != expected {
            bail!("expected {expected:?}, {written:?} were written");
        }
        thread::sleep(Duration::from_secs(1));
        let after = self.service_syncs()?.since(earlier).writes;
        if after != expected {
            bail!("expected {expected:?}, then {after:?} were written");
        }
        Ok(())
    }

    /// Waits until the agent has made `n` policy syncs in all; returns the counters then.
    pub fn wait_for_policy_syncs(&mut self, n: u64, timeout: Duration) -> Result<PolicySyncs> {
        self.wait_for_metrics(&format!("{n} policy sync(s)"), timeout, |s| {
            (s.policy_syncs().syncs >= n).then_some(())
        })?;
        // As for Service syncs: a fresh scrape sees the counted sync's writes.
        Ok(self.scrape()?.policy_syncs())
    }

    /// Waits until `kube_router_rejected_objects_total{kind}` reaches `n`.
    pub fn wait_for_rejected(&mut self, kind: &str, n: u64, timeout: Duration) -> Result<()> {
        self.wait_for_metrics(&format!("{n} rejected {kind}"), timeout, |s| (s.rejected(kind) >= n).then_some(()))
    }
}
