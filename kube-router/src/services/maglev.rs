//! Maglev consistent hashing (Eisenbud et al., NSDI 2016): a lookup table of a prime size in
//! which every backend owns an almost equal share of the entries, built so that adding or removing
//! one backend moves few entries of the others. The datapath indexes it with the client's hash
//! (`kube_router_common::maglev_flow_hash`), so every node that builds the table from the same
//! backends sends a client to the same backend, whichever node its packets reach.
use kube_router_common::Backend;

use super::family::AddrBytes;

/// Table sizes (primes). The paper keeps the imbalance under 1 % with a table 100 times the
/// number of backends; the smallest size that allows it is used, up to the last.
pub const TABLE_SIZES: [u32; 7] = [251, 509, 1021, 2039, 4093, 8191, 16_381];

pub fn table_size(backends: usize) -> u32 {
    TABLE_SIZES.into_iter().find(|size| *size as usize >= backends.saturating_mul(100)).unwrap_or(TABLE_SIZES[6])
}

/// FNV-1a, 64-bit, from a given basis: two bases give the two independent hashes per backend.
fn fnv1a(basis: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(basis, |hash, byte| (hash ^ u64::from(*byte)).wrapping_mul(0x0000_0100_0000_01b3))
}

/// For each of the table's entries, the index (into `backends`) of the backend that owns it.
/// A backend is known by its address and port, never by a node-local id, and the result does not
/// depend on the order of `backends`, so every node computes the same table.
pub fn table<W: AddrBytes>(backends: &[Backend<W>], size: u32) -> Vec<usize> {
    if backends.is_empty() {
        return Vec::new();
    }
    let size = size as usize;
    let mut order: Vec<usize> = (0..backends.len()).collect();
    order.sort_by_key(|i| (backends[*i].addr.packet_bytes(), u16::from_be(backends[*i].port)));
    // Each backend's preference list is a permutation of the entries: offset + j * skip.
    let prefs: Vec<(usize, usize)> = order
        .iter()
        .map(|i| {
            let b = &backends[*i];
            let name = [b.addr.packet_bytes().as_slice(), b.port.to_ne_bytes().as_slice()].concat();
            let offset = (fnv1a(0xcbf2_9ce4_8422_2325, &name) % size as u64) as usize;
            let skip = (fnv1a(0x8422_2325_cbf2_9ce4, &name) % (size as u64 - 1) + 1) as usize;
            (offset, skip)
        })
        .collect();
    let mut next = vec![0usize; order.len()];
    let mut entries: Vec<Option<usize>> = vec![None; size];
    let mut filled = 0;
    // Backends take turns claiming their next preferred free entry until the table is full.
    loop {
        for (turn, (offset, skip)) in prefs.iter().enumerate() {
            let mut entry = (offset + next[turn] * skip) % size;
            while entries[entry].is_some() {
                next[turn] += 1;
                entry = (offset + next[turn] * skip) % size;
            }
            entries[entry] = Some(order[turn]);
            next[turn] += 1;
            filled += 1;
            if filled == size {
                return entries.into_iter().map(|e| e.expect("every entry filled")).collect();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube_router_common::BackendV4;

    fn backends(n: u32) -> Vec<BackendV4> {
        (1..=n)
            .map(|i| BackendV4 {
                addr: u32::from_ne_bytes([10, 0, (i >> 8) as u8, i as u8]),
                port: 8080u16.to_be(),
                flags: 0,
            })
            .collect()
    }

    fn owners(table: &[usize], backends: &[BackendV4]) -> Vec<BackendV4> {
        table.iter().map(|i| backends[*i]).collect()
    }

    #[test]
    fn sizes_grow_with_the_backends_and_stop_at_the_largest() {
        assert_eq!(table_size(1), 251);
        assert_eq!(table_size(3), 509);
        assert_eq!(table_size(10), 1021);
        assert_eq!(table_size(100), 16_381);
        assert_eq!(table_size(5000), 16_381);
    }

    #[test]
    fn every_backend_owns_an_almost_equal_share() {
        for n in [2u32, 3, 7, 10, 100, 300] {
            let set = backends(n);
            let size = table_size(set.len());
            let table = table(&set, size);
            assert_eq!(table.len(), size as usize);
            let mut counts = vec![0usize; set.len()];
            table.iter().for_each(|i| counts[*i] += 1);
            let (min, max) = (*counts.iter().min().unwrap(), *counts.iter().max().unwrap());
            let fair = size as f64 / n as f64;
            assert!(min as f64 >= fair * 0.9 && max as f64 <= fair * 1.1 + 1.0, "n={n}: {min}..{max} around {fair:.1}");
        }
    }

    #[test]
    fn the_table_depends_on_the_backends_not_on_their_order() {
        let set = backends(10);
        let mut reversed = set.clone();
        reversed.reverse();
        let size = table_size(10);
        assert_eq!(owners(&table(&set, size), &set), owners(&table(&reversed, size), &reversed));
    }

    #[test]
    fn removing_a_backend_moves_little_beyond_its_own_entries() {
        let set = backends(10);
        let size = table_size(10);
        let before = owners(&table(&set, size), &set);
        let fewer: Vec<BackendV4> = set.iter().copied().filter(|b| *b != set[4]).collect();
        let after = owners(&table(&fewer, size), &fewer);
        let kept = before.iter().filter(|b| **b != set[4]).count();
        let moved = before.iter().zip(&after).filter(|(b, a)| **b != set[4] && b != a).count();
        // A random table would move ~90 % of them; Maglev a few percent.
        assert!((moved as f64) < kept as f64 * 0.1, "{moved} of {kept} entries of the remaining backends moved");
    }
}
