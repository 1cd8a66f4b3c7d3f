//! The agent's controllers, each run on its own task by [`crate::runtime`]: woken by the
//! changes of the kinds it reads (from [`crate::k8s::cache`]), retried with backoff on error.
pub mod checkpoint;
pub mod datapath_stats;
pub mod interfaces;
pub mod node_nets;
pub mod policy;
pub mod routing;
pub mod service_view;
pub mod services;
