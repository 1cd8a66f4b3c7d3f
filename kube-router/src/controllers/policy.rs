//! NetworkPolicy enforcement as a controller, woken by Pods, Namespaces and NetworkPolicies.
use std::sync::Arc;

use anyhow::Result;

use crate::{
    firewall::FirewallController,
    k8s::{cache::Cache, watch::Kind},
    runtime::{Action, Controller},
};

pub const POLICY_KINDS: &[Kind] = &[Kind::Pods, Kind::Namespaces, Kind::NetworkPolicies];

pub struct PolicyController {
    firewall: FirewallController,
    cache: Arc<Cache>,
}

impl PolicyController {
    pub fn new(firewall: FirewallController, cache: Arc<Cache>) -> Self {
        Self { firewall, cache }
    }
}

impl Controller for PolicyController {
    fn name(&self) -> &'static str {
        "policy"
    }

    async fn reconcile(&mut self) -> Result<Action> {
        // Policy is only ever compiled from a complete picture (or its checkpoint): half a list
        // of pods would deny traffic that is allowed.
        let Some(listing) = self
            .cache
            .read(POLICY_KINDS, |o| (o.pods.snapshot(), o.namespaces.snapshot(), o.network_policies.snapshot()))
        else {
            return Ok(Action::AwaitChange);
        };
        let (pods, namespaces, policies) = listing.objects;
        let failed = self.firewall.apply(
            pods.iter().map(|p| &**p),
            namespaces.iter().map(|n| &**n),
            policies.iter().map(|p| &**p),
            listing.completeness.is_complete(),
        );
        if failed > 0 {
            anyhow::bail!("{failed} policy map writes failed");
        }
        Ok(Action::AwaitChange)
    }
}
