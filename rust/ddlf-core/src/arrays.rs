//! Weight lists as typed arrays: the checks and the dtype dispatch of the `ddlf.ops` kernels, without Python.
//!
//! The bindings turn each numpy array into an [`ArrayRef`] (a typed slice and its shape) after checking its
//! buffer; everything else (list lengths, matching shapes and dtypes, which dtypes a kernel takes) is decided here,
//! before any element is read, and each kernel returns new [`Array`]s. Errors say which array, and are either a
//! wrong value ([`ArrayError::Value`]) or a wrong dtype ([`ArrayError::Type`]).

use half::{bf16, f16};

use crate::{kernels, parallel};

/// The elements of one array.
#[derive(Clone, Copy, Debug)]
pub enum Data<'a> {
    /// float32 elements.
    F32(&'a [f32]),
    /// float64 elements.
    F64(&'a [f64]),
    /// IEEE float16 elements.
    F16(&'a [f16]),
    /// bfloat16 elements.
    Bf16(&'a [bf16]),
    /// 16-bit words of unknown meaning (bfloat16 bits viewed as uint16 when not marked as such).
    U16(&'a [u16]),
}

impl Data<'_> {
    /// The dtype's numpy name.
    pub fn dtype(&self) -> &'static str {
        match self {
            Data::F32(_) => "float32",
            Data::F64(_) => "float64",
            Data::F16(_) => "float16",
            Data::Bf16(_) => "bfloat16",
            Data::U16(_) => "uint16",
        }
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        match self {
            Data::F32(x) => x.len(),
            Data::F64(x) => x.len(),
            Data::F16(x) => x.len(),
            Data::Bf16(x) => x.len(),
            Data::U16(x) => x.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One array of a weight list: its elements and its shape.
#[derive(Clone, Copy, Debug)]
pub struct ArrayRef<'a> {
    /// The elements, in C order.
    pub data: Data<'a>,
    /// The dimensions (their product is the element count).
    pub shape: &'a [usize],
}

/// A kernel's result: new elements.
#[derive(Debug, PartialEq)]
pub enum Owned {
    /// float32 elements.
    F32(Vec<f32>),
    /// float64 elements.
    F64(Vec<f64>),
    /// IEEE float16 elements.
    F16(Vec<f16>),
    /// bfloat16 elements.
    Bf16(Vec<bf16>),
}

/// A kernel's result array, shaped like its input.
#[derive(Debug, PartialEq)]
pub struct Array {
    /// The elements, in C order.
    pub data: Owned,
    /// The dimensions, the input's.
    pub shape: Vec<usize>,
}

/// Why a kernel refused its arguments (nothing was read).
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ArrayError {
    /// A wrong value: counts, shapes, weights (Python's `ValueError`).
    #[error("{0}")]
    Value(String),
    /// A dtype the kernel does not take (Python's `TypeError`).
    #[error("{0}")]
    Type(String),
}

fn value(msg: String) -> ArrayError {
    ArrayError::Value(msg)
}

fn same_kind(a: &Data<'_>, b: &Data<'_>) -> bool {
    a.dtype() == b.dtype()
}

/// Weighted average of N weight lists: `out[j] = sum_i w_i * lists[i][j] / sum_i w_i`, float32 or float64
/// (split across threads for large arrays).
pub fn weighted_average(
    lists: &[Vec<ArrayRef<'_>>],
    weights: &[f64],
) -> Result<Vec<Array>, ArrayError> {
    let first = lists
        .first()
        .ok_or_else(|| value("nothing to average".into()))?;
    if weights.len() != lists.len() {
        return Err(value(format!(
            "{} weights for {} weight lists",
            weights.len(),
            lists.len()
        )));
    }
    let w = kernels::normalize(weights).map_err(|e| value(e.to_string()))?;
    for (i, l) in lists.iter().enumerate() {
        if l.len() != first.len() {
            return Err(value(format!(
                "list {i} has {} arrays, list 0 has {}",
                l.len(),
                first.len()
            )));
        }
        for (j, (v, f)) in l.iter().zip(first).enumerate() {
            if v.shape != f.shape || !same_kind(&v.data, &f.data) {
                return Err(value(format!(
                    "array {j} of list {i} has shape {:?} {}, list 0 has {:?} {}",
                    v.shape,
                    v.data.dtype(),
                    f.shape,
                    f.data.dtype()
                )));
            }
        }
    }
    (0..first.len())
        .map(|j| {
            let data = match first[j].data {
                Data::F64(_) => Owned::F64(average::<f64>(lists, j, &w, as_f64)?),
                Data::F32(_) => Owned::F32(average::<f32>(lists, j, &w, as_f32)?),
                other => {
                    return Err(ArrayError::Type(format!(
                        "array {j}: weighted_average supports float32 and float64, not {}",
                        other.dtype()
                    )))
                }
            };
            Ok(Array {
                data,
                shape: first[j].shape.to_vec(),
            })
        })
        .collect()
}

/// Array `j` of every list averaged; every list's array `j` must be a `T` (checked above: an error, never zeros).
fn average<'a, T: kernels::Float>(
    lists: &[Vec<ArrayRef<'a>>],
    j: usize,
    w: &[f64],
    typed: fn(&Data<'a>) -> Option<&'a [T]>,
) -> Result<Vec<T>, ArrayError> {
    let inputs = lists
        .iter()
        .map(|l| typed(&l[j].data))
        .collect::<Option<Vec<&[T]>>>()
        .ok_or_else(|| value(format!("array {j}: the lists' dtypes differ")))?;
    let mut out = vec![T::zero(); inputs.first().map_or(0, |x| x.len())];
    parallel::weighted_average(&inputs, w, &mut out)
        .map_err(|e| value(format!("array {j}: {e}")))?;
    Ok(out)
}

fn as_f32<'a>(d: &Data<'a>) -> Option<&'a [f32]> {
    match d {
        Data::F32(x) => Some(x),
        _ => None,
    }
}

fn as_f64<'a>(d: &Data<'a>) -> Option<&'a [f64]> {
    match d {
        Data::F64(x) => Some(x),
        _ => None,
    }
}

/// Check `w += alpha * delta` before the bindings run it in place: same count, lengths and dtype, float32/64.
pub fn check_axpy(weights: &[ArrayRef<'_>], delta: &[ArrayRef<'_>]) -> Result<(), ArrayError> {
    if weights.len() != delta.len() {
        return Err(value(format!(
            "{} weight arrays, {} delta arrays",
            weights.len(),
            delta.len()
        )));
    }
    for (i, (a, b)) in weights.iter().zip(delta).enumerate() {
        if a.data.len() != b.data.len()
            || !same_kind(&a.data, &b.data)
            || !matches!(a.data, Data::F32(_) | Data::F64(_))
        {
            return Err(value(format!(
                "array {i}: weights {:?} {} and delta {:?} {} differ (float32/float64 only)",
                a.shape,
                a.data.dtype(),
                b.shape,
                b.data.dtype()
            )));
        }
    }
    Ok(())
}

/// `new - old` for every array of two weight lists (float32/float64, same shapes).
pub fn delta(new: &[ArrayRef<'_>], old: &[ArrayRef<'_>]) -> Result<Vec<Array>, ArrayError> {
    if new.len() != old.len() {
        return Err(value(format!(
            "{} new arrays, {} old arrays",
            new.len(),
            old.len()
        )));
    }
    new.iter()
        .zip(old)
        .enumerate()
        .map(|(i, (a, b))| {
            let data = match (a.data, b.data) {
                (Data::F32(x), Data::F32(y)) if a.shape == b.shape => {
                    let mut v = vec![0f32; x.len()];
                    let _ = kernels::delta(x, y, &mut v);
                    Owned::F32(v)
                }
                (Data::F64(x), Data::F64(y)) if a.shape == b.shape => {
                    let mut v = vec![0f64; x.len()];
                    let _ = kernels::delta(x, y, &mut v);
                    Owned::F64(v)
                }
                _ => {
                    return Err(value(format!(
                        "array {i}: {:?} {} vs {:?} {} (float32/float64 only)",
                        a.shape,
                        a.data.dtype(),
                        b.shape,
                        b.data.dtype()
                    )))
                }
            };
            Ok(Array {
                data,
                shape: a.shape.to_vec(),
            })
        })
        .collect()
}

/// float32 arrays to float16 (or bfloat16 with `bfloat16`).
pub fn to_half(arrays: &[ArrayRef<'_>], bfloat16: bool) -> Result<Vec<Array>, ArrayError> {
    let srcs = arrays
        .iter()
        .enumerate()
        .map(|(i, a)| match a.data {
            Data::F32(x) => Ok(x),
            _ => Err(ArrayError::Type(format!(
                "array {i}: to_half expects float32, not {}",
                a.data.dtype()
            ))),
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(srcs
        .into_iter()
        .zip(arrays)
        .map(|(x, a)| {
            let data = if bfloat16 {
                let mut h = vec![bf16::ZERO; x.len()];
                let _ = kernels::to_bf16(x, &mut h);
                Owned::Bf16(h)
            } else {
                let mut h = vec![f16::ZERO; x.len()];
                let _ = kernels::to_f16(x, &mut h);
                Owned::F16(h)
            };
            Array {
                data,
                shape: a.shape.to_vec(),
            }
        })
        .collect())
}

/// float16 or bfloat16 arrays back to float32.
pub fn from_half(arrays: &[ArrayRef<'_>]) -> Result<Vec<Array>, ArrayError> {
    arrays
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let mut o = vec![0f32; a.data.len()];
            match a.data {
                Data::F16(x) => {
                    let _ = kernels::from_f16(x, &mut o);
                }
                Data::Bf16(x) => {
                    let _ = kernels::from_bf16(x, &mut o);
                }
                other => {
                    return Err(ArrayError::Type(format!(
                        "array {i}: from_half expects float16 or bfloat16, not {}",
                        other.dtype()
                    )))
                }
            }
            Ok(Array {
                data: Owned::F32(o),
                shape: a.shape.to_vec(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s<'a>(x: &'a [f32], shape: &'a [usize]) -> ArrayRef<'a> {
        ArrayRef {
            data: Data::F32(x),
            shape,
        }
    }

    #[test]
    fn averages_are_weighted_and_shaped() {
        let (a, b) = ([1.0f32, 2.0], [3.0f32, 4.0]);
        let out =
            weighted_average(&[vec![f32s(&a, &[2])], vec![f32s(&b, &[2])]], &[1.0, 3.0]).unwrap();
        assert_eq!(
            out,
            vec![Array {
                data: Owned::F32(vec![2.5, 3.5]),
                shape: vec![2]
            }]
        );
    }

    #[test]
    fn every_mismatch_is_refused_before_reading() {
        let (a, b) = ([1.0f32, 2.0], [3.0f32]);
        let h = [f16::ONE, f16::ONE];
        assert!(
            matches!(weighted_average(&[], &[]), Err(ArrayError::Value(m)) if m == "nothing to average")
        );
        let shape = weighted_average(&[vec![f32s(&a, &[2])], vec![f32s(&b, &[1])]], &[1.0, 1.0]);
        assert!(matches!(shape, Err(ArrayError::Value(m)) if m.contains("shape")));
        let count = weighted_average(&[vec![f32s(&a, &[2])], vec![]], &[1.0, 1.0]);
        assert!(matches!(count, Err(ArrayError::Value(m)) if m.contains("arrays")));
        let weights = weighted_average(&[vec![f32s(&a, &[2])]], &[1.0, 2.0]);
        assert!(matches!(weights, Err(ArrayError::Value(m)) if m.contains("weights")));
        // float16 lists: a type error, not an average over twice the bytes.
        let half = ArrayRef {
            data: Data::F16(&h),
            shape: &[2],
        };
        let out = weighted_average(&[vec![half], vec![half]], &[1.0, 1.0]);
        assert!(matches!(out, Err(ArrayError::Type(m)) if m.contains("float16")));
        assert!(check_axpy(&[f32s(&a, &[2])], &[f32s(&b, &[1])]).is_err());
        assert!(delta(&[f32s(&a, &[2])], &[half]).is_err());
        assert!(matches!(to_half(&[half], false), Err(ArrayError::Type(_))));
        assert!(matches!(
            from_half(&[f32s(&a, &[2])]),
            Err(ArrayError::Type(_))
        ));
    }

    #[test]
    fn half_precision_round_trips() {
        let x = [0.5f32, -2.0, 1024.0];
        for bf in [false, true] {
            let h = to_half(&[f32s(&x, &[3])], bf).unwrap();
            let back = match &h[0].data {
                Owned::F16(v) => from_half(&[ArrayRef {
                    data: Data::F16(v),
                    shape: &[3],
                }]),
                Owned::Bf16(v) => from_half(&[ArrayRef {
                    data: Data::Bf16(v),
                    shape: &[3],
                }]),
                other => panic!("{other:?}"),
            }
            .unwrap();
            assert_eq!(back[0].data, Owned::F32(x.to_vec()));
        }
        let d = delta(&[f32s(&x, &[3])], &[f32s(&x, &[3])]).unwrap();
        assert_eq!(d[0].data, Owned::F32(vec![0.0; 3]));
    }
}
