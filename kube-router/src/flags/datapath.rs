//! The eBPF datapath itself: where its programs attach and how, its maps' sizes, conntrack
//! garbage collection.
use std::time::Duration;

use super::parse_go_duration;
use crate::{
    bpf::{datapath::AttachMode, layout::MapSizes, xdp::XdpSetting},
    config::DatapathOptions,
};

/// Interfaces, attach modes, map sizes, conntrack GC.
#[derive(clap::Args, Debug, Clone)]
#[command(next_help_heading = "eBPF datapath")]
pub struct DatapathFlags {
    /// Interfaces to attach the load balancer to (comma-separated). Default: every interface
    /// but lo, re-scanned every 5 s.
    #[arg(long, env = "KUBE_ROUTER_INTERFACES", value_delimiter = ',')]
    pub interfaces: Option<Vec<String>>,
    /// Service frontends the load balancer's maps hold, per family (Cilium's flag name);
    /// backends and backend slots get four times as many. Changing it re-creates those maps at
    /// the new size on start, carrying their entries over.
    #[arg(long, env = "KUBE_ROUTER_BPF_LB_MAP_MAX", default_value_t = kube_router_common::SERVICES_MAX_ENTRIES)]
    pub bpf_lb_map_max: u32,
    /// Connections tracked per family, by the load balancer and by NetworkPolicy each. Changing
    /// it re-creates the conntrack maps at the new size on start, keeping every connection.
    #[arg(long, env = "KUBE_ROUTER_BPF_CT_GLOBAL_MAX", default_value_t = kube_router_common::CONNTRACK_MAX_ENTRIES)]
    pub bpf_ct_global_max: u32,
    /// How programs attach to interfaces: tcx (Linux 6.6+), classic (tc clsact + cls_bpf, any
    /// supported kernel), or auto (node interfaces through TCX where the kernel has it; pod veths
    /// through classic tc, which attaches in ~2 ms where TCX waits ~15 ms per program for an RCU
    /// grace period, so a new pod is policed and load-balanced sooner).
    #[arg(long, env = "KUBE_ROUTER_TC_MODE", default_value = "auto", value_parser = ["auto", "tcx", "classic"])]
    pub tc_mode: String,
    /// The XDP fast path on node uplinks for north-south Service flows to backends on other
    /// nodes: auto (native where the driver has it, else generic; generic on veths, whose peer
    /// must run NAPI to receive native XDP_TX frames), native, generic, or off (TC alone;
    /// removes the XDP program an earlier run attached, never another's).
    #[arg(long, env = "KUBE_ROUTER_XDP", default_value = "auto", value_parser = ["auto", "native", "generic", "off"])]
    pub xdp: String,
    /// Find new interfaces (pod veths) and node addresses through netlink notifications as they
    /// appear; false leaves only the 5 s rescan (a baseline for the attach-latency benchmark).
    #[arg(long, env = "KUBE_ROUTER_LINK_EVENTS", default_value_t = true, action = clap::ArgAction::Set, hide = true)]
    pub link_events: bool,
    /// Time between conntrack garbage collections (e.g. 30s, or seconds).
    #[arg(long, env = "KUBE_ROUTER_CONNTRACK_GC_INTERVAL", default_value = "30s", value_parser = parse_gc_interval)]
    pub conntrack_gc_interval: Duration,
}

impl DatapathFlags {
    /// `--bpf-lb-map-max`, `--bpf-ct-global-max`, checked.
    pub fn map_sizes(&self) -> Result<MapSizes, String> {
        let sizes = MapSizes { lb_frontends: self.bpf_lb_map_max, conntrack: self.bpf_ct_global_max };
        sizes.validate()?;
        Ok(sizes)
    }

    /// `--tc-mode` for node interfaces (`auto`: TCX where the kernel has it).
    pub fn attach_mode(&self) -> AttachMode {
        match self.tc_mode.as_str() {
            "tcx" => AttachMode::Tcx,
            "classic" => AttachMode::Classic,
            _ => AttachMode::detect(),
        }
    }

    /// `--tc-mode` for pod veths: classic unless TCX is asked for (`auto`'s reason is above).
    pub fn pod_attach_mode(&self) -> AttachMode {
        match self.tc_mode.as_str() {
            "tcx" => AttachMode::Tcx,
            _ => AttachMode::Classic,
        }
    }

    pub fn xdp(&self) -> Result<XdpSetting, String> {
        self.xdp.parse()
    }
}

/// The flags' values checked: a map size or `--xdp` mode that is not one is the error.
impl TryFrom<&DatapathFlags> for DatapathOptions {
    type Error = String;

    fn try_from(flags: &DatapathFlags) -> Result<Self, String> {
        Ok(DatapathOptions {
            interfaces: flags.interfaces.clone(),
            conntrack_gc_interval: flags.conntrack_gc_interval,
            attach_mode: flags.attach_mode(),
            pod_attach_mode: flags.pod_attach_mode(),
            xdp: flags.xdp()?,
            link_events: flags.link_events,
            map_sizes: flags.map_sizes()?,
        })
    }
}

fn parse_gc_interval(text: &str) -> Result<Duration, String> {
    match parse_go_duration(text)? {
        d if d.is_zero() => Err("the interval must be more than 0".to_string()),
        d => Ok(d),
    }
}
