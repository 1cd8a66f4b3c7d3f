//! What the datapath tests share: one node's addresses and network namespace, and the datapath
//! loaded into that namespace with Services programmed as the agent would.
// Each test binary compiles this module on its own and uses only part of it.
#![allow(dead_code)]

use std::{
    net::Ipv4Addr,
    path::{Path, PathBuf},
};

pub mod test_run;

use kube_router::services::maps::{read_lb_stats, write_lb_config, BpfServiceMaps};
use kube_router::{
    bpf::datapath::{self, Datapath, Hook},
    services::{
        compile::{assign_ids, plan, Limits},
        model::NodeContext,
        source::parse_objects,
        sync::ServiceSync,
    },
};
use kube_router_common::LbConfig;
use test_run::{run_on, NodeNetns};

/// This node ("node-a") on the fabric, and a client beyond the fabric's router.
pub const NODE_IP: Ipv4Addr = Ipv4Addr::new(10, 100, 0, 1);
pub const CLIENT: Ipv4Addr = Ipv4Addr::new(192, 168, 100, 2);
/// A Service's ClusterIP, and its ExternalIP or LoadBalancer IP.
pub const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
pub const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);
/// A pod on this node and one on another node.
pub const LOCAL_POD: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 5);
pub const REMOTE_POD: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 5);

/// The node's network namespace: `up0` (NODE_IP/24) towards the fabric, the other node's pod
/// CIDR and the client's subnet routed via the fabric, this node's pods on `pod0`.
pub const NODE_NETNS: &[&[&str]] = &[
    &["link", "add", "up0", "type", "veth", "peer", "name", "up1"],
    &["addr", "add", "10.100.0.1/24", "dev", "up0"],
    &["link", "set", "up0", "up"],
    &["link", "set", "up1", "up"],
    &["route", "add", "10.244.2.0/24", "via", "10.100.0.2"],
    &["route", "add", "192.168.100.0/24", "via", "10.100.0.254"],
    &["link", "add", "pod0", "type", "veth", "peer", "name", "pod1"],
    &["addr", "add", "10.244.1.1/24", "dev", "pod0"],
    &["link", "set", "pod0", "up"],
    &["link", "set", "pod1", "up"],
];

/// The datapath loaded in the node's network namespace, its uplink `up0` at `ifindex`; its pins
/// and the namespace are removed on drop.
pub struct Loaded {
    pub datapath: Datapath,
    pub pin_dir: PathBuf,
    pub ifindex: u32,
    _node: NodeNetns,
}

impl Drop for Loaded {
    fn drop(&mut self) {
        let _ = datapath::remove_all(&self.pin_dir);
    }
}

/// Programs the Services (and EndpointSlices) in `yaml` as the agent does on the node `context`
/// describes; every map write must succeed.
pub fn program_services(pin_dir: &Path, yaml: &str, context: &NodeContext) {
    let mut maps = BpfServiceMaps::open_pinned(pin_dir).unwrap();
    let mut sync = ServiceSync::adopt(&maps).unwrap();
    let builder = parse_objects(yaml).unwrap();
    let desired = assign_ids(&plan(&builder.state, context, Limits::default()), sync.programmed());
    assert_eq!(sync.sync(&mut maps, desired, true).total().errors, 0);
}

/// The datapath loaded afresh in network namespace `name` ([`NODE_NETNS`], then
/// `extra_ip_commands`), pinned at /sys/fs/bpf/`name`, with `yaml` programmed for `context` and
/// `config` written.
pub fn load_node(
    name: &str,
    extra_ip_commands: &[&[&str]],
    yaml: &str,
    context: &NodeContext,
    config: &LbConfig,
) -> Loaded {
    let commands: Vec<&[&str]> = NODE_NETNS.iter().chain(extra_ip_commands).copied().collect();
    let node = NodeNetns::enter(name, &commands).expect("node netns");
    let ifindex = node.ifindex("up0");
    let pin_dir = PathBuf::from(format!("/sys/fs/bpf/{name}"));
    let _ = datapath::remove_all(&pin_dir);
    let datapath = Datapath::load(&pin_dir).expect("load datapath (run as root)");
    program_services(&pin_dir, yaml, context);
    write_lb_config(&pin_dir, config).unwrap();
    Loaded { datapath, pin_dir, ifindex, _node: node }
}

impl Loaded {
    /// One run of the TC program at `hook` on `frame`, arriving on the uplink: (verdict, packet).
    pub fn run(&self, hook: Hook, frame: &[u8]) -> (i32, Vec<u8>) {
        let out = run_on(self.datapath.program_fd(hook).unwrap(), frame, 1, Some(self.ifindex)).unwrap();
        (out.retval, out.packet)
    }
    pub fn ingress(&self, frame: &[u8]) -> (i32, Vec<u8>) {
        self.run(Hook::Ingress, frame)
    }
    pub fn egress(&self, frame: &[u8]) -> (i32, Vec<u8>) {
        self.run(Hook::Egress, frame)
    }
    /// The load balancer's counter `index` (`lb_stat`), summed over the CPUs.
    pub fn lb_stat(&self, index: u32) -> u64 {
        read_lb_stats(&self.pin_dir).unwrap()[index as usize]
    }
}

/// The IPv4 TTL of an Ethernet frame.
pub fn ttl(frame: &[u8]) -> u8 {
    frame[14 + 8]
}
