//! The plain-traffic cache (`plain_gen`, `plain_stats`): the TC programs remember, per CPU, the
//! IPv4 tuples they found to be plain traffic (no Service flow can hold them, the source check
//! passed, the pod is isolated in neither direction), and skip the lookups for the tuple's next
//! packets. `plain_gen` is the generation each remembered verdict was found under: whatever
//! could turn a plain tuple into one that is not (a frontend, a pod's isolation or source
//! addresses, the load balancer's settings, an endpoint the datapath records for a new Service
//! flow) is written first and the generation changed after, which forgets every verdict.
//! Maps of their own, so the older maps keep their layout.

pub mod plain_map_names {
    /// `u32 -> u64` array of one entry: the generation.
    pub const PLAIN_GENERATION: &str = "plain_gen";
    pub const PLAIN_STATS: &str = "plain_stats";
}

/// Indices of the `plain_stats` per-CPU counters.
pub mod plain_stat {
    /// Verdicts found in the cache, their lookups not made (a packet at the load balancer's
    /// ingress may find two: its source's and its tuple's).
    pub const HIT: u32 = 0;
    /// Verdicts remembered (a tuple judged plain with the cache missing or out of date).
    pub const REMEMBERED: u32 = 1;
    pub const COUNT: u32 = 2;
    pub const NAMES: [&str; COUNT as usize] = ["hit", "remembered"];
}
