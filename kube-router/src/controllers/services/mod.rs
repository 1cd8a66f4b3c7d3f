//! The service load balancer's controller: converts the Services and EndpointSlices that
//! changed, compiles just them when it can, and writes only the differences to the pinned maps.
//! Deletions need a complete listing; failed writes are retried by the runner with backoff.
//!
//! `programmer`: one sync (the node's context, both families, warnings, metrics); `pass`: one
//! family's pass (the changed Services alone, or all of them, and why); `api` and `file`: the
//! controller tasks that feed it from the API server or a service file; `metrics`: what it counts.
mod api;
mod file;
mod metrics;
mod pass;
mod programmer;
mod warnings;

pub(crate) use api::ClusterAddressFollower;
pub use api::{ClusterAddresses, ServicesFromApi, SERVICE_KINDS, SERVICE_TRIGGER_KINDS};
pub use file::{FileEvents, ServicesFromFile};
pub use metrics::ServiceMetrics;
pub(crate) use programmer::report_catalog_problems;
pub use programmer::{HealthChecks, ServiceProgrammer};
