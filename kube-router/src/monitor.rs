//! `kube-router monitor`: streams the datapath's policy drops and new Service flows with pod,
//! namespace and Service names, like `cilium monitor`. Events flow only while a monitor holds
//! the lease (`events_cfg`: an expiry it pushes forward every half second), so one that exits
//! or is killed turns them off within two seconds. Names come from the agent's checkpoint (no
//! API server needed, as during an outage), re-read every few seconds.
use std::{
    collections::HashMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::{Path, PathBuf},
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use aya::maps::{Array, Map, MapData, RingBuf};
use kube_router_common::*;

use crate::pinned::pinned_map;

const LEASE: Duration = Duration::from_secs(2);
const RENEW_EVERY: Duration = Duration::from_millis(500);
const NAMES_EVERY: Duration = Duration::from_secs(3);
/// At most this often when an event names an address the names lack (a Service or pod newer
/// than the checkpoint last read).
const NAMES_ON_MISS: Duration = Duration::from_millis(500);

/// Which events to print.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum EventFilter {
    Drop,
    Nat,
    All,
}

pub struct Options {
    pub pin_dir: PathBuf,
    pub state_dir: PathBuf,
    pub json: bool,
    pub filter: EventFilter,
    /// Events per second per CPU the datapath may write.
    pub rate_per_cpu: u64,
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn request_stop(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

/// CLOCK_MONOTONIC in nanoseconds: the datapath's `bpf_ktime_get_ns`.
fn monotonic_ns() -> u64 {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

fn open(pin_dir: &Path, name: &str) -> Result<MapData> {
    MapData::from_pin(pinned_map(pin_dir, name))
        .with_context(|| format!("opening {name} in {} (is the agent's datapath loaded?)", pin_dir.display()))
}

/// Addresses to "namespace/name" of pods and Services, from the checkpoint.
#[derive(Default)]
pub struct Names {
    pods: HashMap<IpAddr, String>,
    services: HashMap<IpAddr, String>,
}

impl Names {
    pub fn from_checkpoint(state_dir: &Path) -> Self {
        let mut names = Names::default();
        let Ok(saved) = crate::k8s::checkpoint::read(state_dir) else { return names };
        for pod in &saved.pods {
            let namespace = if pod.namespace.is_empty() { "default" } else { &pod.namespace };
            let name = format!("{namespace}/{}", if pod.name.is_empty() { "?" } else { &pod.name });
            // hostNetwork pods share the node's address: it is not theirs alone.
            if pod.host_network {
                continue;
            }
            for ip in pod.ips.iter() {
                names.pods.insert(*ip, name.clone());
            }
        }
        for service in saved.services.iter().map(|service| service.decode()) {
            let name = format!(
                "{}/{}",
                service.metadata.namespace.as_deref().unwrap_or("default"),
                service.metadata.name.as_deref().unwrap_or("?")
            );
            let spec = service.spec.clone().unwrap_or_default();
            let ingress =
                service.status.as_ref().and_then(|s| s.load_balancer.as_ref()).and_then(|l| l.ingress.clone());
            let addresses = spec
                .cluster_ips
                .unwrap_or_default()
                .into_iter()
                .chain(spec.cluster_ip)
                .chain(spec.external_ips.unwrap_or_default())
                .chain(ingress.unwrap_or_default().into_iter().filter_map(|i| i.ip));
            for ip in addresses {
                if let Ok(ip) = ip.parse() {
                    names.services.insert(ip, name.clone());
                }
            }
        }
        names
    }

    fn pod(&self, ip: IpAddr) -> Option<&str> {
        self.pods.get(&ip).map(String::as_str)
    }

    /// Every address `event` names is known: a policy drop's two pods, a new flow's Service and
    /// backend (its client may be outside the cluster).
    fn names_all_of(&self, event: &MonitorEvent) -> bool {
        let (src, dst) = (address(event.family, event.src), address(event.family, event.dst));
        match event.kind {
            EVENT_POLICY_DROP => self.pods.contains_key(&src) && self.pods.contains_key(&dst),
            EVENT_SERVICE_NAT => {
                self.services.contains_key(&dst) && self.pods.contains_key(&address(event.family, event.nat))
            }
            _ => true,
        }
    }

    fn service(&self, ip: IpAddr) -> Option<&str> {
        self.services.get(&ip).map(String::as_str)
    }
}

fn address(family: u8, words: [u32; 4]) -> IpAddr {
    if family == 6 {
        IpAddr::V6(Ipv6Addr::from(Ipv6Words(words).octets()))
    } else {
        IpAddr::V4(Ipv4Addr::from(words[0].to_ne_bytes()))
    }
}

fn proto_name(proto: u8) -> String {
    match proto {
        6 => "tcp".into(),
        17 => "udp".into(),
        1 => "icmp".into(),
        58 => "icmpv6".into(),
        other => other.to_string(),
    }
}

fn endpoint(ip: IpAddr, port_be: u16) -> String {
    match ip {
        IpAddr::V6(v6) => format!("[{v6}]:{}", u16::from_be(port_be)),
        IpAddr::V4(v4) => format!("{v4}:{}", u16::from_be(port_be)),
    }
}

/// The names, read again from the checkpoint when it has changed: every [`NAMES_EVERY`], and
/// sooner ([`NAMES_ON_MISS`]) for an event they cannot name. A monitor started just before a
/// new Service reached the checkpoint named its flows' Service only at the next periodic read.
struct NameSource<'a> {
    state_dir: &'a Path,
    names: Names,
    read_at: Instant,
    stamp: Option<(u64, std::time::SystemTime)>,
}

impl<'a> NameSource<'a> {
    fn new(state_dir: &'a Path) -> Self {
        let stamp = checkpoint_stamp(state_dir);
        Self { state_dir, names: Names::from_checkpoint(state_dir), read_at: Instant::now(), stamp }
    }

    /// The names for `event` (`None`: a periodic look).
    fn for_event(&mut self, event: Option<&MonitorEvent>) -> &Names {
        let due = match event {
            None => self.read_at.elapsed() >= NAMES_EVERY,
            Some(event) => !self.names.names_all_of(event) && self.read_at.elapsed() >= NAMES_ON_MISS,
        };
        if due {
            self.read_at = Instant::now();
            let stamp = checkpoint_stamp(self.state_dir);
            if stamp != self.stamp {
                self.stamp = stamp;
                self.names = Names::from_checkpoint(self.state_dir);
            }
        }
        &self.names
    }
}

/// The checkpoint file's size and modification time (a journal append changes both).
fn checkpoint_stamp(state_dir: &Path) -> Option<(u64, std::time::SystemTime)> {
    let meta = std::fs::metadata(crate::k8s::checkpoint::path_in(state_dir)).ok()?;
    Some((meta.len(), meta.modified().ok()?))
}

/// One event as a line of text or JSON; `None` if the filter leaves it out.
pub fn render(event: &MonitorEvent, names: &Names, json: bool, filter: EventFilter) -> Option<String> {
    let src = address(event.family, event.src);
    let dst = address(event.family, event.dst);
    let proto = proto_name(event.proto);
    let (src_at, dst_at) = (endpoint(src, event.src_port), endpoint(dst, event.dst_port));
    let line = match event.kind {
        EVENT_POLICY_DROP if filter != EventFilter::Nat => {
            let direction = if event.direction == POLICY_DIR_INGRESS { "ingress" } else { "egress" };
            if json {
                serde_json::json!({
                    "type": "drop", "direction": direction, "proto": proto, "ifindex": event.ifindex,
                    "src": src_at, "src_name": names.pod(src), "dst": dst_at, "dst_name": names.pod(dst),
                })
                .to_string()
            } else {
                format!(
                    "DROP {direction:<7} {proto} {} {src_at} -> {} {dst_at}",
                    names.pod(src).unwrap_or("-"),
                    names.pod(dst).unwrap_or("-")
                )
            }
        }
        EVENT_POLICY_FRAME_DROP if filter != EventFilter::Nat => {
            let direction = if event.direction == POLICY_DIR_INGRESS { "ingress" } else { "egress" };
            let reason = match event.proto {
                FRAME_DROP_UNKNOWN_L3 => "unknown-l3",
                FRAME_DROP_VLAN => "vlan",
                _ => "malformed",
            };
            let ether_type = format!("0x{:04x}", u16::from_be(event.src_port));
            if json {
                serde_json::json!({
                    "type": "drop", "direction": direction, "reason": reason, "ethertype": ether_type,
                    "ifindex": event.ifindex,
                })
                .to_string()
            } else {
                format!("DROP {direction:<7} frame {reason} ethertype {ether_type} ifindex {}", event.ifindex)
            }
        }
        EVENT_SERVICE_NAT if filter != EventFilter::Drop => {
            let backend = address(event.family, event.nat);
            let backend_at = endpoint(backend, event.nat_port);
            if json {
                serde_json::json!({
                    "type": "nat", "proto": proto, "ifindex": event.ifindex,
                    "src": src_at, "src_name": names.pod(src), "frontend": dst_at, "service": names.service(dst),
                    "backend": backend_at, "backend_name": names.pod(backend),
                })
                .to_string()
            } else {
                format!(
                    "NAT  {proto} {} {src_at} -> {} {dst_at} => {} {backend_at}",
                    names.pod(src).unwrap_or("-"),
                    names.service(dst).unwrap_or("-"),
                    names.pod(backend).unwrap_or("-")
                )
            }
        }
        _ => return None,
    };
    Some(line)
}

/// The `events_stats` counters summed over CPUs, in [`event_stat::NAMES`] order.
pub fn read_stats(pin_dir: &Path) -> Result<Vec<u64>> {
    crate::pinned::counters::read_pinned(pin_dir, monitor_map_names::EVENTS_STATS, event_stat::COUNT)
}

/// Runs until SIGINT or SIGTERM; turns events off on the way out.
pub fn run(options: &Options) -> Result<()> {
    let mut config: Array<MapData, MonitorConfig> =
        Array::try_from(Map::Array(open(&options.pin_dir, monitor_map_names::EVENTS_CONFIG)?))?;
    let mut ring = RingBuf::try_from(Map::RingBuf(open(&options.pin_dir, monitor_map_names::EVENTS)?))?;
    // SAFETY: installing a handler that only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, request_stop as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, request_stop as *const () as libc::sighandler_t);
    }
    let mut names = NameSource::new(&options.state_dir);
    let mut renewed = None::<Instant>;
    let result = (|| -> Result<()> {
        use std::io::Write;
        let stdout = std::io::stdout();
        while !STOP.load(Ordering::Relaxed) {
            if renewed.is_none_or(|at| at.elapsed() >= RENEW_EVERY) {
                let lease = MonitorConfig {
                    enabled_until_ns: monotonic_ns() + LEASE.as_nanos() as u64,
                    rate_per_cpu: options.rate_per_cpu,
                };
                config.set(0, lease, 0).context("renewing the monitor lease")?;
                renewed = Some(Instant::now());
            }
            names.for_event(None);
            let mut out = stdout.lock();
            let mut any = false;
            while let Some(item) = ring.next() {
                any = true;
                if item.len() < size_of::<MonitorEvent>() {
                    continue;
                }
                // SAFETY: the datapath writes whole MonitorEvents; read unaligned from the ring.
                let event = unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<MonitorEvent>()) };
                if let Some(line) = render(&event, names.for_event(Some(&event)), options.json, options.filter) {
                    writeln!(out, "{line}")?;
                }
            }
            out.flush()?;
            drop(out);
            if !any {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Ok(())
    })();
    // Off at once rather than when the lease runs out.
    let _ = config.set(0, MonitorConfig::default(), 0);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_service_that_reaches_the_checkpoint_after_the_monitor_started_is_named() {
        use crate::k8s::checkpoint::{self, Checkpoint};
        let dir = std::env::temp_dir().join(format!("krt-monitor-names-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        checkpoint::write(&dir, &Checkpoint::default()).unwrap();
        let mut source = NameSource::new(&dir);
        let words = |ip: [u8; 4]| [u32::from_ne_bytes(ip), 0, 0, 0];
        let nat = MonitorEvent {
            kind: EVENT_SERVICE_NAT,
            family: 4,
            dst: words([10, 96, 1, 140]),
            nat: words([10, 244, 2, 2]),
            ..Default::default()
        };
        assert_eq!(source.for_event(Some(&nat)).service("10.96.1.140".parse().unwrap()), None);

        let service: k8s_openapi::api::core::v1::Service = serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": "default", "name": "web", "resourceVersion": "3"},
            "spec": {"clusterIP": "10.96.1.140", "clusterIPs": ["10.96.1.140"], "ports": [{"port": 80}]}
        }))
        .unwrap();
        checkpoint::write(&dir, &Checkpoint { services: vec![service.into()], ..Default::default() }).unwrap();
        std::thread::sleep(NAMES_ON_MISS);
        assert_eq!(source.for_event(Some(&nat)).service("10.96.1.140".parse().unwrap()), Some("default/web"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn events_are_rendered_with_names_and_filtered() {
        let mut names = Names::default();
        names.pods.insert("10.244.1.5".parse().unwrap(), "default/client".into());
        names.pods.insert("10.244.2.7".parse().unwrap(), "shop/db".into());
        names.services.insert("10.96.0.10".parse().unwrap(), "shop/db".into());
        let words = |ip: [u8; 4]| [u32::from_ne_bytes(ip), 0, 0, 0];
        let drop = MonitorEvent {
            kind: EVENT_POLICY_DROP,
            family: 4,
            proto: 6,
            direction: POLICY_DIR_INGRESS,
            src: words([10, 244, 1, 5]),
            dst: words([10, 244, 2, 7]),
            src_port: 40000u16.to_be(),
            dst_port: 5432u16.to_be(),
            ..Default::default()
        };
        assert_eq!(
            render(&drop, &names, false, EventFilter::All).unwrap(),
            "DROP ingress tcp default/client 10.244.1.5:40000 -> shop/db 10.244.2.7:5432"
        );
        let json: serde_json::Value =
            serde_json::from_str(&render(&drop, &names, true, EventFilter::Drop).unwrap()).unwrap();
        assert_eq!((json["src_name"].as_str(), json["dst_name"].as_str()), (Some("default/client"), Some("shop/db")));
        assert!(render(&drop, &names, false, EventFilter::Nat).is_none());
        let nat = MonitorEvent {
            kind: EVENT_SERVICE_NAT,
            dst: words([10, 96, 0, 10]),
            dst_port: 5432u16.to_be(),
            nat: words([10, 244, 2, 7]),
            nat_port: 5432u16.to_be(),
            ..drop
        };
        assert_eq!(
            render(&nat, &names, false, EventFilter::Nat).unwrap(),
            "NAT  tcp default/client 10.244.1.5:40000 -> shop/db 10.96.0.10:5432 => shop/db 10.244.2.7:5432"
        );
        assert!(render(&nat, &names, false, EventFilter::Drop).is_none());
        let vlan = MonitorEvent {
            kind: EVENT_POLICY_FRAME_DROP,
            family: 0,
            proto: FRAME_DROP_VLAN,
            direction: POLICY_DIR_EGRESS,
            ifindex: 7,
            src_port: 0x8100u16.to_be(),
            ..Default::default()
        };
        assert_eq!(
            render(&vlan, &names, false, EventFilter::Drop).unwrap(),
            "DROP egress  frame vlan ethertype 0x8100 ifindex 7"
        );
    }
}
