//! The merge kernels of [`crate::kernels`] split across threads for large arrays, with safe disjoint slices
//! (`chunks_mut`): no pointer arithmetic, so no `unsafe`.

use std::sync::OnceLock;

use crate::kernels::{self, Float, KernelError};

/// The cores this process may use (`std::thread::available_parallelism`, 1 when unknown), read once. Reading it
/// opens the cgroup's files on Linux: 30 µs a call on a 2-core VM, which every batch pipeline, gather and large
/// merge paid before it was kept.
pub fn cores() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Arrays with at least this many bytes are split across threads.
pub const PARALLEL_BYTES: usize = 1 << 20;

/// At most this many threads per kernel call.
const MAX_THREADS: usize = 8;

fn threads_for(len: usize, elem_bytes: usize) -> usize {
    if len * elem_bytes < PARALLEL_BYTES {
        return 1;
    }
    cores().min(MAX_THREADS)
}

/// Run `f(start, chunk)` over `out` cut into one contiguous chunk per thread (one chunk when it is small).
fn for_chunks<T: Send>(out: &mut [T], f: impl Fn(usize, &mut [T]) + Sync) {
    let threads = threads_for(out.len(), std::mem::size_of::<T>());
    if threads <= 1 {
        f(0, out);
        return;
    }
    let chunk = out.len().div_ceil(threads);
    std::thread::scope(|s| {
        for (i, part) in out.chunks_mut(chunk).enumerate() {
            let f = &f;
            s.spawn(move || f(i * chunk, part));
        }
    });
}

/// [`kernels::weighted_average`] over threads: `out = sum_i w_i * inputs[i]` (weights already normalized).
pub fn weighted_average<T: Float>(
    inputs: &[&[T]],
    w: &[f64],
    out: &mut [T],
) -> Result<(), KernelError> {
    if let Some(bad) = inputs.iter().find(|x| x.len() != out.len()) {
        return Err(KernelError::Length(out.len(), bad.len()));
    }
    for_chunks(out, |start, part| {
        let end = start + part.len();
        let parts: Vec<&[T]> = inputs.iter().map(|x| &x[start..end]).collect();
        // The lengths match (checked above), so the kernel cannot fail here.
        let _ = kernels::weighted_average(&parts, w, part);
    });
    Ok(())
}

/// [`kernels::axpy`] over threads: `w += alpha * delta`, in place.
pub fn axpy<T: Float>(w: &mut [T], alpha: f64, delta: &[T]) -> Result<(), KernelError> {
    if w.len() != delta.len() {
        return Err(KernelError::Length(w.len(), delta.len()));
    }
    for_chunks(w, |start, part| {
        let end = start + part.len();
        let _ = kernels::axpy(part, alpha, &delta[start..end]);
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_arrays_match_the_serial_kernel() {
        let n = (PARALLEL_BYTES / 4) * 3 + 17; // several chunks, an odd tail
        let a: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..n).map(|i| (n - i) as f32).collect();
        let w = kernels::normalize(&[1.0, 3.0]).unwrap();
        let (mut par, mut ser) = (vec![0f32; n], vec![0f32; n]);
        weighted_average(&[&a, &b], &w, &mut par).unwrap();
        kernels::weighted_average(&[&a, &b], &w, &mut ser).unwrap();
        assert_eq!(par, ser);
        let mut x = a.clone();
        axpy(&mut x, 0.5, &b).unwrap();
        let mut y = a.clone();
        kernels::axpy(&mut y, 0.5, &b).unwrap();
        assert_eq!(x, y);
    }

    #[test]
    fn lengths_are_checked_before_any_work() {
        let mut out = vec![0f64; 4];
        let short = [1.0f64; 3];
        assert!(weighted_average(&[&short[..]], &[1.0], &mut out).is_err());
        assert!(axpy(&mut out, 1.0, &short).is_err());
        assert!(weighted_average::<f64>(&[], &[], &mut []).is_ok());
    }
}
