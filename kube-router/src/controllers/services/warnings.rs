//! The compile warnings already reported, kept by Service, so that a warning that persists is
//! logged once and a pass compares only the warnings of the Services it planned again. Walking
//! every warning on every pass cost a large cluster's churn a quarter of the agent: 10,000
//! Services with a few thousand standing frontend conflicts, hashed and cloned 40 times a second.
use std::collections::HashMap;

use crate::services::{compile::CompileWarning, model::ServiceName};

#[derive(Debug, Default)]
pub(super) struct ReportedWarnings {
    by_service: HashMap<ServiceName, Vec<CompileWarning>>,
}

impl ReportedWarnings {
    /// After a pass that planned `services` again: each one's warnings now (`now`), replacing
    /// what was reported for it. Returns the warnings not reported before, each once.
    pub fn update<'a>(
        &mut self,
        services: impl IntoIterator<Item = &'a ServiceName>,
        now: impl Fn(&ServiceName) -> Vec<CompileWarning>,
    ) -> Vec<CompileWarning> {
        let mut new = Vec::new();
        for service in services {
            let mut warnings = now(service);
            warnings.dedup();
            let before = match warnings.is_empty() {
                true => self.by_service.remove(service),
                false => self.by_service.insert(service.clone(), warnings.clone()),
            }
            .unwrap_or_default();
            // A warning names its Service: only this one's may repeat (once per family).
            let own = new.len();
            for warning in warnings {
                if !before.contains(&warning) && !new[own..].contains(&warning) {
                    new.push(warning);
                }
            }
        }
        new
    }

    /// After a pass that planned every Service: `warned` are those with warnings now; the
    /// others' are forgotten (reported again if they come back).
    pub fn replace_all<'a>(
        &mut self,
        warned: impl IntoIterator<Item = &'a ServiceName>,
        now: impl Fn(&ServiceName) -> Vec<CompileWarning>,
    ) -> Vec<CompileWarning> {
        let warned: std::collections::BTreeSet<&ServiceName> = warned.into_iter().collect();
        self.by_service.retain(|service, _| warned.contains(service));
        self.update(warned, now)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet, HashSet};

    use proptest::prelude::*;

    use super::*;

    fn name(i: u8) -> ServiceName {
        ServiceName::new("ns", format!("svc-{i}"))
    }

    /// Warning `w` of Service `s` (a few distinct values per Service, as a compile makes them).
    fn warning(s: u8, w: u8) -> CompileWarning {
        CompileWarning::EndpointsTruncated { service: name(s), port_name: format!("p{}", w % 3), kept: 1, dropped: 1 }
    }

    proptest! {
        /// A pass replans some Services (or every one); their warnings change, the others' stay.
        /// Reporting by Service logs exactly what comparing every warning with the last pass's
        /// whole set does (the way before, which walked every warning on every pass).
        #[test]
        fn reporting_the_replanned_services_alone_logs_what_comparing_every_warning_does(
            passes in proptest::collection::vec(
                (any::<bool>(), proptest::collection::btree_map(0u8..6, proptest::collection::vec(0u8..4, 0..3), 0..4)),
                1..30,
            )
        ) {
            let mut warnings: BTreeMap<ServiceName, Vec<CompileWarning>> = BTreeMap::new();
            let mut whole_set: HashSet<CompileWarning> = HashSet::new();
            let mut reported = ReportedWarnings::default();
            for (full, replanned) in passes {
                for (s, ws) in &replanned {
                    let now: Vec<CompileWarning> = ws.iter().map(|w| warning(*s, *w)).collect();
                    match now.is_empty() {
                        true => warnings.remove(&name(*s)),
                        false => warnings.insert(name(*s), now),
                    };
                }
                let now = |service: &ServiceName| warnings.get(service).cloned().unwrap_or_default();
                let logged = if full {
                    reported.replace_all(warnings.keys(), now)
                } else {
                    let names: Vec<ServiceName> = replanned.keys().map(|s| name(*s)).collect();
                    reported.update(&names, now)
                };
                let current: HashSet<CompileWarning> = warnings.values().flatten().cloned().collect();
                let expected: BTreeSet<String> =
                    current.difference(&whole_set).map(|w| format!("{w:?}")).collect();
                whole_set = current;
                let logged_set: BTreeSet<String> = logged.iter().map(|w| format!("{w:?}")).collect();
                prop_assert_eq!(logged.len(), logged_set.len(), "a warning logged twice in one pass");
                prop_assert_eq!(logged_set, expected);
            }
        }
    }
}
