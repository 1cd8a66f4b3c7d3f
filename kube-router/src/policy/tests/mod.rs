//! Tests of the policy compiler. Fixtures are built from JSON/YAML in the
//! real Kubernetes object shapes.

mod fixtures;
mod incremental_tests;
mod map_tests;
mod properties;
mod semantics;
mod truth_table;
mod validation;
