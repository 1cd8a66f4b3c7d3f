//! Service load-balancing control plane: objects -> model -> map contents -> map writes.
pub mod compile;
pub mod departures;
pub mod diff;
pub mod family;
pub mod from_k8s;
pub mod from_stores;
pub mod healthcheck;
pub mod incremental;
pub mod maglev;
pub mod maps;
pub mod model;
pub mod node_addresses;
pub mod source;
pub mod sync;
pub mod vips;

#[cfg(test)]
mod tests;
