//! The services layer's reading of the watched stores: Services and EndpointSlices converted
//! into the catalog, only the changed ones after the first time. It lives here, not in `k8s/`,
//! so the API layer knows nothing of Services' meaning.
use std::collections::BTreeSet;

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use kube::runtime::watcher;

use super::{
    incremental::{Changed, ServiceCatalog},
    model::ServiceName,
    source::StateBuilder,
};
use crate::k8s::{
    store::Feed,
    watch::{ClusterObjects, Kind, WatchUpdate},
};

/// One catalog's own feeds of the Service and EndpointSlice stores' changes.
#[derive(Debug, Clone, Copy)]
pub struct CatalogFeeds {
    services: Feed,
    slices: Feed,
}

impl ClusterObjects {
    /// Applies a watcher update; returns whether the service proxy's desired state may have
    /// changed. [`Self::apply_kind`] says which kind changed.
    pub fn apply(&mut self, update: WatchUpdate) -> bool {
        self.apply_kind(update).is_some_and(|kind| matches!(kind, Kind::Services | Kind::EndpointSlices))
    }

    /// A complete listing of Services and EndpointSlices, as the watchers deliver one (Init,
    /// one InitApply per object, InitDone).
    pub fn list_services(&mut self, services: Vec<Service>, slices: Vec<EndpointSlice>) {
        self.apply(WatchUpdate::Services(watcher::Event::Init));
        for s in services {
            self.apply(WatchUpdate::Services(watcher::Event::InitApply(s)));
        }
        self.apply(WatchUpdate::Services(watcher::Event::InitDone));
        self.apply(WatchUpdate::EndpointSlices(watcher::Event::Init));
        for s in slices {
            self.apply(WatchUpdate::EndpointSlices(watcher::Event::InitApply(s)));
        }
        self.apply(WatchUpdate::EndpointSlices(watcher::Event::InitDone));
    }

    /// Services and EndpointSlices have been listed completely since start: deletions of
    /// service map entries are safe.
    pub fn synced(&self) -> bool {
        self.services.synced() && self.endpoint_slices.synced()
    }

    /// Every Service and EndpointSlice converted (a full compile's input).
    pub fn state(&self) -> StateBuilder {
        let mut builder = StateBuilder::default();
        for service in self.services.objects() {
            builder.add_service(&service);
        }
        for slice in self.endpoint_slices.objects() {
            builder.add_endpoint_slice(&slice);
        }
        builder
    }

    /// Converts again the Services and EndpointSlices that changed since the last call with
    /// `feeds`, into `catalog`; returns the Services they concern. The first call (`feeds`
    /// `None`: it subscribes) converts everything. Each reader keeps its own `feeds`.
    pub fn update_catalog(&mut self, feeds: &mut Option<CatalogFeeds>, catalog: &mut ServiceCatalog) -> Changed {
        let feeds = *feeds.get_or_insert_with(|| CatalogFeeds {
            services: self.services.subscribe(),
            slices: self.endpoint_slices.subscribe(),
        });
        let changed = (self.services.take_changes(feeds.services), self.endpoint_slices.take_changes(feeds.slices));
        let (services, slices, all) = match changed {
            (Some(services), Some(slices)) => (services, slices, false),
            // Object by object all the same, so each one's problems are its own to clear.
            _ => {
                *catalog = ServiceCatalog::default();
                (self.services.keys().cloned().collect(), self.endpoint_slices.keys().cloned().collect(), true)
            }
        };
        let mut changed = BTreeSet::new();
        for key in services {
            let name = ServiceName { namespace: key.namespace.clone(), name: key.name.clone() };
            let converted = self.services.get(&key).map(|object| {
                let mut builder = StateBuilder::default();
                builder.add_service(&object);
                builder
            });
            catalog.set_service(&name, converted);
            changed.insert(name);
        }
        for key in slices {
            let converted = self.endpoint_slices.get(&key).map(|object| {
                let mut builder = StateBuilder::default();
                builder.add_endpoint_slice(&object);
                builder
            });
            changed.extend(catalog.set_slice(&(key.namespace.to_string(), key.name.to_string()), converted));
        }
        if all {
            catalog.compact();
            return Changed::All;
        }
        Changed::Services(changed)
    }
}

#[cfg(test)]
mod tests {
    use kube::runtime::watcher::Event;

    use super::*;
    use crate::k8s::checkpoint::{self, Checkpoint};
    use crate::services::{
        compile::{assign_ids, plan, Limits, MapContents},
        diff::diff,
        model::NodeContext,
    };

    fn service(name: &str, ip: &str, rv: u64) -> Service {
        serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": "default", "name": name, "resourceVersion": rv.to_string()},
            "spec": {"clusterIP": ip, "ports": [{"name": "http", "port": 80}]}
        }))
        .unwrap()
    }

    fn slice(service: &str, addr: &str, rv: u64) -> EndpointSlice {
        serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": "default", "name": format!("{service}-1"), "resourceVersion": rv.to_string(),
                         "labels": {"kubernetes.io/service-name": service}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080}],
            "endpoints": [{"addresses": [addr]}]
        }))
        .unwrap()
    }

    fn contents(objects: &ClusterObjects, current: &MapContents) -> MapContents {
        assign_ids(&plan(&objects.state().state, &NodeContext::default(), Limits::default()), current)
    }

    fn listed(objects: &mut ClusterObjects, services: Vec<Service>, slices: Vec<EndpointSlice>) {
        objects.list_services(services, slices);
    }

    #[test]
    fn errors_and_broken_relists_leave_the_desired_state_as_it_was() {
        let mut objects = ClusterObjects::default();
        listed(
            &mut objects,
            vec![service("a", "10.96.0.1", 1), service("b", "10.96.0.2", 2)],
            vec![slice("a", "10.0.0.1", 3)],
        );
        assert!(objects.synced());
        let programmed = contents(&objects, &MapContents::default());
        // Outage: errors, then a relist that never completes.
        assert!(!objects.apply(WatchUpdate::Error { resource: "services", message: "connection refused".into() }));
        objects.apply(WatchUpdate::Services(Event::Init));
        objects.apply(WatchUpdate::EndpointSlices(Event::Init));
        assert!(diff(&programmed, &contents(&objects, &programmed), true).is_empty());
    }

    #[test]
    fn a_completed_relist_yields_exactly_the_real_difference() {
        let mut objects = ClusterObjects::default();
        listed(
            &mut objects,
            vec![service("a", "10.96.0.1", 1), service("b", "10.96.0.2", 2)],
            vec![slice("a", "10.0.0.1", 3)],
        );
        let programmed = contents(&objects, &MapContents::default());
        // While we were away: b was deleted and a's endpoint changed.
        listed(&mut objects, vec![service("a", "10.96.0.1", 1)], vec![slice("a", "10.0.0.9", 7)]);
        let next = contents(&objects, &programmed);
        let ops = diff(&programmed, &next, true);
        // The new backend, a's slot pointing at it, b's frontend removed, the old backend removed.
        use crate::services::diff::MapOp::*;
        assert_eq!(next.services.len(), 1);
        assert!(matches!(ops.as_slice(), [PutBackend(..), PutSlot(..), DeleteService(_), DeleteBackend(_)]), "{ops:?}");
    }

    #[test]
    fn checkpoint_round_trip_restores_the_same_desired_state() {
        let mut objects = ClusterObjects::default();
        listed(&mut objects, vec![service("a", "10.96.0.1", 1)], vec![slice("a", "10.0.0.1", 3)]);
        let programmed = contents(&objects, &MapContents::default());
        let mut restored = ClusterObjects::default();
        restored.restore(objects.checkpoint());
        assert!(!restored.synced(), "a checkpoint is not a complete listing");
        assert_eq!(contents(&restored, &programmed), programmed);
    }

    #[test]
    fn the_streamed_snapshot_reads_back_as_the_checkpoint_of_the_same_objects() {
        let mut objects = ClusterObjects::default();
        let mut odd = service("a", "10.96.0.1", 1);
        // Quotes, backslashes, a control character and non-ASCII text inside the payload.
        odd.metadata.annotations =
            Some([("note".to_string(), "say \"hi\" \\ tab\there, ünïcødé \u{1}".to_string())].into());
        listed(&mut objects, vec![odd, service("b", "10.96.0.2", 2)], vec![slice("a", "10.0.0.1", 3)]);
        let dir = std::env::temp_dir().join(format!("krt-snapshot-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let snapshot = objects.snapshot();
        let written_unix = snapshot.written_unix;
        checkpoint::write_base(&dir, &snapshot).unwrap();
        let read = checkpoint::read(&dir).unwrap();
        // A float read back from JSON may differ in its last bit.
        assert!((read.written_unix - written_unix).abs() < 1e-3);
        assert_eq!(Checkpoint { written_unix: 0.0, ..read }, Checkpoint { written_unix: 0.0, ..objects.checkpoint() });
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_catalog_follows_each_change_and_names_the_services_it_concerns() {
        let mut objects = ClusterObjects::default();
        let mut catalog = ServiceCatalog::default();
        let mut feeds = None;
        objects.apply(WatchUpdate::Services(Event::Apply(service("d", "not an address", 1))));
        assert_eq!(
            objects.update_catalog(&mut feeds, &mut catalog),
            Changed::All,
            "the first call converts everything"
        );
        assert_eq!(catalog.problems().count(), 1);
        objects.apply(WatchUpdate::Services(Event::Delete(service("d", "not an address", 2))));
        objects.update_catalog(&mut feeds, &mut catalog);
        assert_eq!(catalog.problems().count(), 0);
        let names = |changed: Changed| match changed {
            Changed::Services(names) => names.into_iter().map(|n| n.name.to_string()).collect::<Vec<_>>(),
            Changed::All => vec!["*".to_string()],
        };
        let same_as_a_full_conversion = |objects: &ClusterObjects, catalog: &ServiceCatalog| {
            assert_eq!(catalog.state, objects.state().state);
            for name in catalog.state.services.keys() {
                let slices: Vec<&crate::services::model::EndpointSlice> =
                    catalog.state.slices.values().filter(|s| &s.service == name).collect();
                assert_eq!(catalog.slices_of(name), slices);
            }
        };
        listed(
            &mut objects,
            vec![service("a", "10.96.0.1", 1), service("b", "10.96.0.2", 2)],
            vec![slice("a", "10.0.0.1", 3)],
        );
        assert_eq!(names(objects.update_catalog(&mut feeds, &mut catalog)), ["a", "b"]);
        same_as_a_full_conversion(&objects, &catalog);

        objects.apply(WatchUpdate::EndpointSlices(Event::Apply(slice("a", "10.0.0.2", 4))));
        assert_eq!(names(objects.update_catalog(&mut feeds, &mut catalog)), ["a"]);
        same_as_a_full_conversion(&objects, &catalog);

        // A broken relist changes nothing; a complete one with a difference names it.
        objects.apply(WatchUpdate::Services(Event::Init));
        objects.apply(WatchUpdate::Services(Event::InitApply(service("a", "10.96.0.1", 1))));
        assert_eq!(names(objects.update_catalog(&mut feeds, &mut catalog)), Vec::<String>::new());
        objects.apply(WatchUpdate::Services(Event::Init));
        objects.apply(WatchUpdate::Services(Event::InitApply(service("a", "10.96.0.1", 1))));
        objects.apply(WatchUpdate::Services(Event::InitApply(service("c", "10.96.0.3", 5))));
        objects.apply(WatchUpdate::Services(Event::InitDone));
        assert_eq!(names(objects.update_catalog(&mut feeds, &mut catalog)), ["b", "c"]);
        same_as_a_full_conversion(&objects, &catalog);

        objects.apply(WatchUpdate::EndpointSlices(Event::Delete(slice("a", "10.0.0.2", 6))));
        objects.apply(WatchUpdate::Services(Event::Apply(service("a", "not an address", 7))));
        assert_eq!(names(objects.update_catalog(&mut feeds, &mut catalog)), ["a"]);
        same_as_a_full_conversion(&objects, &catalog);
        assert_eq!(catalog.problems().count(), 1);
        objects.apply(WatchUpdate::Services(Event::Apply(service("a", "10.96.0.1", 8))));
        objects.update_catalog(&mut feeds, &mut catalog);
        assert_eq!(catalog.problems().count(), 0);
    }
}
