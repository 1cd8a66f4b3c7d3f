//! What each attach did to the pinned links: adopted as they were, updated to our program, or
//! created. A restart that changes nothing adopts every link; tests and operators read that
//! here instead of in the log.
use prometheus_client::registry::Registry;

use super::datapath::AttachOutcome;
use crate::{
    exposition::{register, Counter, Family},
    metrics::{Labels, Subsystem},
};

/// Where a link attaches: `tc` (load balancer and network policy at TC ingress and egress, one
/// per direction), `cgroup` (the socket load balancer's eight hooks), `xdp` (the uplinks' fast
/// path). The overlay's tunnel links are not counted here.
#[derive(Debug, Default)]
pub struct AttachMetrics {
    links: Family<Labels<2>, Counter>,
}

impl AttachOutcome {
    pub fn label(self) -> &'static str {
        match self {
            AttachOutcome::Adopted => "adopted",
            AttachOutcome::Updated => "updated",
            AttachOutcome::Created => "created",
        }
    }
}

impl AttachMetrics {
    pub fn record(&self, attachment: &'static str, outcomes: &[AttachOutcome]) {
        for outcome in outcomes {
            self.links.get_or_create(&[("attachment", attachment), ("outcome", outcome.label())]).inc();
        }
    }
}

impl Subsystem for AttachMetrics {
    fn register(this: &std::sync::Arc<Self>, registry: &mut Registry) {
        register(
            registry,
            "kube_router_bpf_link_attaches_total",
            "Program links attached, by attachment point and outcome (adopted unchanged, updated to this agent's program, created).",
            this.links.clone(),
        );
    }
}
