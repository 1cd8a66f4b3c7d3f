//! The agent's allocator: mimalloc (the binary sets it as the global allocator).
//!
//! With glibc's malloc, a fifth of the agent's time in a 150,000-pod cluster's churn was the
//! allocator's own free-list upkeep (`malloc_consolidate`, `unlink_chunk`); musl's (the image)
//! is slower still. mimalloc keeps free lists per thread and page and does not coalesce on free
//! (docs/benchmarks.md, cluster scale).

/// `mi_option_purge_delay` in mimalloc's `mi_option_t` (v3, the bindings' default build) (the Rust bindings name only some
/// options; the test below holds the number to the option's documented default).
const PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Memory freed is given back to the OS at once, not a second later (v3's default): the agent frees in bursts (a
/// relist, a checkpoint restore) and a delay shows as peak RSS, which a DaemonSet's memory
/// limit is set against.
pub fn configure() {
    // SAFETY: sets one of mimalloc's tunables; valid at any time.
    unsafe { libmimalloc_sys::mi_option_set(PURGE_DELAY, 0) };
}

#[cfg(test)]
mod tests {
    use libmimalloc_sys::{mi_option_get, mi_option_use_numa_nodes};

    /// The option numbers are the header's: purge delay (default 1,000 ms) comes just before the
    /// NUMA node count, which the bindings name.
    #[test]
    fn the_purge_delay_option_is_mimallocs() {
        assert_eq!(super::PURGE_DELAY, mi_option_use_numa_nodes - 1);
        // SAFETY: reads a tunable.
        assert_eq!(unsafe { mi_option_get(super::PURGE_DELAY) }, 1000);
    }
}
