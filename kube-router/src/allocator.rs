//! The agent's allocator: mimalloc (the binary sets it as the global allocator).
//!
//! With glibc's malloc, a fifth of the agent's time in a 150,000-pod cluster's churn was the
//! allocator's own free-list upkeep (`malloc_consolidate`, `unlink_chunk`); musl's (the image)
//! is slower still. mimalloc keeps free lists per thread and page and does not coalesce on free
//! (docs/benchmarks.md, cluster scale).

/// `mi_option_purge_delay` in mimalloc's `mi_option_t` (v3, the bindings' default build) (the Rust bindings name only some
/// options; the test below holds the number to the option's documented default).
const PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

fn set_purge_delay(ms: std::os::raw::c_long) {
    // SAFETY: sets one of mimalloc's tunables; valid at any time.
    unsafe { libmimalloc_sys::mi_option_set(PURGE_DELAY, ms) };
}

/// mimalloc advises transparent huge pages on its arenas (`MADV_HUGEPAGE`), and the kernel
/// backs them with 2 MiB pages where THP is `madvise` or `always`: a huge page stays resident
/// while any of it is in use, so mimalloc's purges of freed 64 KiB pieces gave nothing back, and
/// khugepaged kept collapsing sparse ranges into whole huge pages as the agent ran. At 150,000
/// pods that was ~25 MiB of the peak and the steady RSS's rise during churn (issue 29;
/// docs/benchmarks.md). Off for the process unless the operator chose (`MIMALLOC_ALLOW_THP`).
fn disable_transparent_huge_pages() {
    if std::env::var_os("MIMALLOC_ALLOW_THP").is_some() {
        return;
    }
    // SAFETY: sets a flag of this process's memory map; no pointers passed.
    if unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) } != 0 {
        // Before logging is set up: said once on stderr, the agent runs as before.
        eprintln!("cannot disable transparent huge pages: {}", std::io::Error::last_os_error());
    }
}

/// Memory freed is given back to the OS at once (purge delay 0, mimalloc's default is 1 s),
/// unless the operator chose the delay (`MIMALLOC_PURGE_DELAY`, mimalloc's own variable): the
/// agent frees in bursts (the first compiles and syncs, a relist, a checkpoint write) and what a
/// delay keeps shows as peak RSS, which a DaemonSet's memory limit is set against. The start used
/// to keep freed memory 100 ms (pages a list page's decoding freed were faulted in again by the
/// next), but that held ~20 MiB at the start's peak, above the 250 MiB goal at 150,000 Pods, for
/// 0.4-1.9 s less CPU over a 3-4 s start (docs/benchmarks.md, issue 29, h5-mem). Transparent huge
/// pages are off ([`disable_transparent_huge_pages`]).
pub fn configure() {
    disable_transparent_huge_pages();
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        set_purge_delay(0);
    }
}

#[cfg(test)]
mod tests {
    use libmimalloc_sys::{mi_option_get, mi_option_use_numa_nodes};

    /// The process's memory gets no transparent huge pages once configured.
    #[test]
    fn transparent_huge_pages_are_off() {
        // SAFETY: reads a flag of this process's memory map.
        let disabled = || unsafe { libc::prctl(libc::PR_GET_THP_DISABLE, 0, 0, 0, 0) };
        if std::env::var_os("MIMALLOC_ALLOW_THP").is_none() {
            super::disable_transparent_huge_pages();
            assert_eq!(disabled(), 1);
        }
    }

    /// The option numbers are the header's: purge delay (default 1,000 ms) comes just before the
    /// NUMA node count, which the bindings name.
    #[test]
    fn the_purge_delay_option_is_mimallocs() {
        assert_eq!(super::PURGE_DELAY, mi_option_use_numa_nodes - 1);
        // SAFETY: reads a tunable.
        assert_eq!(unsafe { mi_option_get(super::PURGE_DELAY) }, 1000);
    }
}
