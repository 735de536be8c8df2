//! Merge kernels for weight lists: weighted averages, in-place updates, deltas, half-precision conversion.
//!
//! Written as plain loops over slices so that the compiler vectorizes them; callers split work across threads.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// Errors of kernel arguments.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum KernelError {
    /// Two arrays of different element counts.
    #[error("length mismatch: {0} vs {1} elements")]
    Length(usize, usize),
    /// Weights that cannot be normalized.
    #[error("weights must be finite, non-negative and not all zero")]
    Weights,
    /// No input arrays.
    #[error("nothing to average")]
    Empty,
}

/// Element type of a kernel: f32 or f64.
pub trait Float: Copy + Send + Sync + 'static {
    /// `v` rounded to this type.
    fn from_f64(v: f64) -> Self;
    /// `acc + x * w`.
    fn mul_add_acc(acc: Self, x: Self, w: Self) -> Self;
    /// `a - b`.
    fn sub(a: Self, b: Self) -> Self;
    /// Zero.
    fn zero() -> Self;
}

macro_rules! impl_float {
    ($t:ty) => {
        impl Float for $t {
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            #[inline(always)]
            fn mul_add_acc(acc: Self, x: Self, w: Self) -> Self {
                acc + x * w
            }
            #[inline(always)]
            fn sub(a: Self, b: Self) -> Self {
                a - b
            }
            fn zero() -> Self {
                0.0
            }
        }
    };
}

impl_float!(f32);
impl_float!(f64);

/// Normalized weights (summing to one).
pub fn normalize(weights: &[f64]) -> Result<Vec<f64>, KernelError> {
    let total: f64 = weights.iter().sum();
    if weights.iter().any(|w| !w.is_finite() || *w < 0.0) || total <= 0.0 || !total.is_finite() {
        return Err(KernelError::Weights);
    }
    Ok(weights.iter().map(|w| w / total).collect())
}

/// `out = sum_i weights[i] * inputs[i]`, with `weights` already normalized.
pub fn weighted_average<T: Float>(
    inputs: &[&[T]],
    weights: &[f64],
    out: &mut [T],
) -> Result<(), KernelError> {
    if inputs.is_empty() {
        return Err(KernelError::Empty);
    }
    if weights.len() != inputs.len() {
        return Err(KernelError::Length(weights.len(), inputs.len()));
    }
    for x in inputs {
        if x.len() != out.len() {
            return Err(KernelError::Length(x.len(), out.len()));
        }
    }
    // Blocked so that the output block stays in L1 while each input streams through it once.
    const BLOCK: usize = 4096;
    let w: Vec<T> = weights.iter().map(|&w| T::from_f64(w)).collect();
    for (b, out_block) in out.chunks_mut(BLOCK).enumerate() {
        let start = b * BLOCK;
        let end = start + out_block.len();
        let first = &inputs[0][start..end];
        for (o, &x) in out_block.iter_mut().zip(first) {
            *o = T::mul_add_acc(T::zero(), x, w[0]);
        }
        for (input, &wi) in inputs[1..].iter().zip(&w[1..]) {
            for (o, &x) in out_block.iter_mut().zip(&input[start..end]) {
                *o = T::mul_add_acc(*o, x, wi);
            }
        }
    }
    Ok(())
}

/// `w += alpha * delta`, in place.
pub fn axpy<T: Float>(w: &mut [T], alpha: f64, delta: &[T]) -> Result<(), KernelError> {
    if w.len() != delta.len() {
        return Err(KernelError::Length(w.len(), delta.len()));
    }
    let a = T::from_f64(alpha);
    for (x, &d) in w.iter_mut().zip(delta) {
        *x = T::mul_add_acc(*x, d, a);
    }
    Ok(())
}

/// `out = new - old`.
pub fn delta<T: Float>(new: &[T], old: &[T], out: &mut [T]) -> Result<(), KernelError> {
    if new.len() != old.len() || new.len() != out.len() {
        return Err(KernelError::Length(new.len(), old.len()));
    }
    for ((o, &a), &b) in out.iter_mut().zip(new).zip(old) {
        *o = T::sub(a, b);
    }
    Ok(())
}

/// f32 -> IEEE half precision.
pub fn to_f16(src: &[f32], out: &mut [f16]) -> Result<(), KernelError> {
    check(src.len(), out.len())?;
    out.convert_from_f32_slice(src);
    Ok(())
}

/// IEEE half precision -> f32.
pub fn from_f16(src: &[f16], out: &mut [f32]) -> Result<(), KernelError> {
    check(src.len(), out.len())?;
    src.convert_to_f32_slice(out);
    Ok(())
}

/// f32 -> bfloat16 (round to nearest even).
pub fn to_bf16(src: &[f32], out: &mut [bf16]) -> Result<(), KernelError> {
    check(src.len(), out.len())?;
    out.convert_from_f32_slice(src);
    Ok(())
}

/// bfloat16 -> f32.
pub fn from_bf16(src: &[bf16], out: &mut [f32]) -> Result<(), KernelError> {
    check(src.len(), out.len())?;
    src.convert_to_f32_slice(out);
    Ok(())
}

/// The `k` entries of largest magnitude: their indices (ascending) and values. Average O(n) selection.
pub fn top_k_abs(x: &[f32], k: usize) -> (Vec<u32>, Vec<f32>) {
    let k = k.min(x.len());
    if k == 0 {
        return (Vec::new(), Vec::new());
    }
    let mut idx: Vec<u32> = (0..x.len() as u32).collect();
    if k < x.len() {
        idx.select_nth_unstable_by(k - 1, |&a, &b| {
            x[b as usize]
                .abs()
                .partial_cmp(&x[a as usize].abs())
                .unwrap_or(std::cmp::Ordering::Equal)
        });
        idx.truncate(k);
    }
    idx.sort_unstable();
    let values = idx.iter().map(|&i| x[i as usize]).collect();
    (idx, values)
}

fn check(a: usize, b: usize) -> Result<(), KernelError> {
    if a != b {
        Err(KernelError::Length(a, b))
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn average_matches_the_formula() {
        let a = vec![1.0f32; 10_000];
        let b = vec![3.0f32; 10_000];
        let mut out = vec![0.0f32; 10_000];
        let w = normalize(&[1.0, 3.0]).unwrap();
        weighted_average(&[&a, &b], &w, &mut out).unwrap();
        assert!(out.iter().all(|&x| (x - 2.5).abs() < 1e-6));
    }

    #[test]
    fn axpy_and_delta_invert_each_other() {
        let old = vec![1.0f64, 2.0, 3.0];
        let new = vec![2.0f64, 0.0, 3.5];
        let mut d = vec![0.0; 3];
        delta(&new, &old, &mut d).unwrap();
        let mut w = old.clone();
        axpy(&mut w, 1.0, &d).unwrap();
        assert_eq!(w, new);
    }

    #[test]
    fn half_round_trips_within_precision() {
        let src: Vec<f32> = (0..1000).map(|i| i as f32 * 0.01 - 5.0).collect();
        let mut h = vec![f16::ZERO; 1000];
        let mut b = vec![bf16::ZERO; 1000];
        let mut back = vec![0.0f32; 1000];
        to_f16(&src, &mut h).unwrap();
        from_f16(&h, &mut back).unwrap();
        assert!(src.iter().zip(&back).all(|(a, b)| (a - b).abs() <= 5e-3));
        to_bf16(&src, &mut b).unwrap();
        from_bf16(&b, &mut back).unwrap();
        assert!(src.iter().zip(&back).all(|(a, b)| (a - b).abs() <= 4e-2));
    }

    #[test]
    fn top_k_keeps_the_largest_magnitudes() {
        let x = [0.1f32, -5.0, 2.0, 0.0, -0.3, 4.0];
        let (i, v) = top_k_abs(&x, 3);
        assert_eq!(i, vec![1, 2, 5]);
        assert_eq!(v, vec![-5.0, 2.0, 4.0]);
        assert_eq!(top_k_abs(&x, 0).0.len(), 0);
        assert_eq!(top_k_abs(&x, 99).0.len(), 6);
    }

    #[test]
    fn bad_arguments_are_errors() {
        let mut out = vec![0.0f32; 2];
        assert_eq!(
            weighted_average::<f32>(&[], &[], &mut out),
            Err(KernelError::Empty)
        );
        assert!(weighted_average(&[&[1.0f32][..]], &[1.0], &mut out).is_err());
        assert!(normalize(&[0.0, 0.0]).is_err());
        assert!(normalize(&[1.0, f64::INFINITY]).is_err());
        assert!(axpy(&mut out, 1.0, &[1.0]).is_err());
    }
}
