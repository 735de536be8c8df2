//! `ddlf.ops` array kernels: merge weight lists and convert precision, with the GIL released.
//!
//! Arrays are read through the buffer protocol (C-contiguous, aligned, any shape); every dtype is checked before
//! any memory is read, and results are returned as new numpy arrays built on Rust-allocated memory without a
//! further copy. The loops are `ddlf_core::kernels` (split across threads by `ddlf_core::parallel`).

use ddlf_core::{kernels, parallel};
use half::{bf16, f16};
use numpy::PyArray1;
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::ops::value_error;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum DType {
    F32,
    F64,
    F16,
    Bf16,
    /// Raw 16-bit words: bfloat16 bits viewed as uint16.
    U16,
}

impl DType {
    fn size(self) -> usize {
        match self {
            DType::F64 => 8,
            DType::F32 => 4,
            DType::F16 | DType::Bf16 | DType::U16 => 2,
        }
    }
}

/// A borrowed view of one array's memory, usable without the GIL while `_buf` lives.
struct View {
    ptr: *mut u8,
    len: usize,
    dtype: DType,
    shape: Vec<usize>,
    readonly: bool,
    _buf: PyUntypedBuffer,
}
// SAFETY: `View` only reads (or, for `axpy_`, writes) the exporter's memory, which `_buf` keeps alive and pinned
// whichever thread holds the view; the GIL is not needed for that. Callers that write check the view is writable
// and not aliased (see `axpy_`).
unsafe impl Send for View {}
// SAFETY: as for `Send`; concurrent readers of the same memory are fine, and writes go through disjoint slices.
unsafe impl Sync for View {}

/// The element types a `View` hands out as slices, each with the dtype that guarantees its layout.
trait Elem: Sized {
    const DTYPES: &'static [DType];
}
impl Elem for f32 {
    const DTYPES: &'static [DType] = &[DType::F32];
}
impl Elem for f64 {
    const DTYPES: &'static [DType] = &[DType::F64];
}
impl Elem for f16 {
    const DTYPES: &'static [DType] = &[DType::F16];
}
impl Elem for bf16 {
    const DTYPES: &'static [DType] = &[DType::Bf16, DType::U16];
}

impl View {
    fn new(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Self> {
        let buf = PyUntypedBuffer::get(obj)?;
        if !buf.is_c_contiguous() {
            return Err(PyValueError::new_err(format!(
                "{what}: arrays must be C-contiguous"
            )));
        }
        let format = buf.format().to_string_lossy().to_string();
        let dtype = match (format.trim_start_matches(['<', '=', '@']), buf.item_size()) {
            ("f", 4) => DType::F32,
            ("d", 8) => DType::F64,
            ("e", 2) => DType::F16,
            ("H", 2) => DType::U16,
            _ => {
                // numpy exports bfloat16 (ml_dtypes) as an opaque 2-byte type; accept it by dtype name.
                let name: String = obj
                    .getattr("dtype")
                    .and_then(|d| d.getattr("name"))
                    .and_then(|n| n.extract())
                    .unwrap_or_default();
                if name == "bfloat16" {
                    DType::Bf16
                } else {
                    return Err(PyTypeError::new_err(format!(
                        "{what}: unsupported dtype (buffer format {format:?}); expected float32 or float64"
                    )));
                }
            }
        };
        let ptr = buf.buf_ptr() as *mut u8;
        let item = buf.item_size();
        if buf.item_count() > 0 && !(ptr as usize).is_multiple_of(item) {
            return Err(PyValueError::new_err(format!(
                "{what}: the array's memory is not aligned to its {item}-byte elements; pass a copy"
            )));
        }
        if buf.item_count().checked_mul(item) != Some(buf.len_bytes()) {
            return Err(PyValueError::new_err(format!(
                "{what}: the buffer's length does not match its shape"
            )));
        }
        Ok(View {
            ptr,
            len: buf.item_count(),
            dtype,
            shape: if buf.dimensions() == 0 {
                vec![]
            } else {
                buf.shape().to_vec()
            },
            readonly: buf.readonly(),
            _buf: buf,
        })
    }

    /// The elements as `T`. Panics (a Python exception, never undefined behaviour) if the view's dtype is not
    /// `T`'s: every caller checks the dtype first and reports a `TypeError`.
    fn slice<T: Elem>(&self) -> &[T] {
        assert!(
            T::DTYPES.contains(&self.dtype),
            "{:?} viewed as {}",
            self.dtype,
            std::any::type_name::<T>()
        );
        if self.len == 0 {
            return &[];
        }
        // SAFETY: checked above and in `View::new`: the buffer holds `len` elements of `T`'s size and layout
        // (dtype), contiguous (C-contiguous export) and aligned; `_buf` keeps the memory alive while `self` lives.
        unsafe { std::slice::from_raw_parts(self.ptr as *const T, self.len) }
    }

    /// The elements as `T`, writable. Same checks as [`View::slice`], plus: the export is writable.
    #[allow(clippy::mut_from_ref)]
    fn slice_mut<T: Elem>(&self) -> &mut [T] {
        assert!(T::DTYPES.contains(&self.dtype) && !self.readonly);
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: as in `slice`, and the buffer was exported writable. Exclusive access: the one caller
        // (`axpy_`) takes one mutable slice per array, checks no other input overlaps it, and holds no other
        // reference to this memory while it writes.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut T, self.len) }
    }

    /// The byte range of the viewed memory.
    fn span(&self) -> std::ops::Range<usize> {
        let start = self.ptr as usize;
        start..start + self.len * self.dtype.size()
    }
}

/// Turn a Rust vector into a numpy array of `shape` (no copy).
fn into_numpy<'py, T: numpy::Element>(
    py: Python<'py>,
    data: Vec<T>,
    shape: &[usize],
) -> PyResult<Bound<'py, PyAny>> {
    let arr = PyArray1::from_vec(py, data).into_any();
    // numpy's own reshape: handles 0-d (scalar) shapes, which optimizer states contain.
    arr.call_method1("reshape", (PyTuple::new(py, shape)?,))
}

fn numpy_half<'py>(
    py: Python<'py>,
    data: Vec<u16>,
    shape: &[usize],
    dtype: DType,
) -> PyResult<Bound<'py, PyAny>> {
    let raw = into_numpy(py, data, shape)?;
    let dt = match dtype {
        DType::F16 => py.import("numpy")?.getattr("float16")?,
        _ => py.import("ml_dtypes")?.getattr("bfloat16")?,
    };
    raw.call_method1("view", (dt,))
}

fn views(list: &[Bound<'_, PyAny>], what: &str) -> PyResult<Vec<View>> {
    list.iter().map(|o| View::new(o, what)).collect()
}

/// Weighted average of N weight lists: `out[j] = sum_i w_i * lists[i][j] / sum_i w_i`.
#[pyfunction]
#[pyo3(signature = (lists, weights = None))]
pub fn weighted_average<'py>(
    py: Python<'py>,
    lists: Vec<Vec<Bound<'py, PyAny>>>,
    weights: Option<Vec<f64>>,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    if lists.is_empty() {
        return Err(PyValueError::new_err("nothing to average"));
    }
    let weights = weights.unwrap_or_else(|| vec![1.0; lists.len()]);
    if weights.len() != lists.len() {
        return Err(PyValueError::new_err(format!(
            "{} weights for {} weight lists",
            weights.len(),
            lists.len()
        )));
    }
    let w = kernels::normalize(&weights).map_err(value_error)?;
    let n_arrays = lists[0].len();
    let all: Vec<Vec<View>> = lists
        .iter()
        .map(|l| views(l, "weighted_average"))
        .collect::<PyResult<_>>()?;
    for (i, l) in all.iter().enumerate() {
        if l.len() != n_arrays {
            return Err(PyValueError::new_err(format!(
                "list {i} has {} arrays, list 0 has {n_arrays}",
                l.len()
            )));
        }
        for (j, v) in l.iter().enumerate() {
            let first = &all[0][j];
            if v.shape != first.shape || v.dtype != first.dtype {
                return Err(PyValueError::new_err(format!(
                    "array {j} of list {i} has shape {:?} {:?}, list 0 has {:?} {:?}",
                    v.shape, v.dtype, first.shape, first.dtype
                )));
            }
        }
    }
    for (j, v) in all[0].iter().enumerate() {
        if !matches!(v.dtype, DType::F32 | DType::F64) {
            return Err(PyTypeError::new_err(format!(
                "array {j}: weighted_average supports float32 and float64"
            )));
        }
    }
    enum Out {
        F32(Vec<f32>),
        F64(Vec<f64>),
    }
    let outs: Vec<Out> = py.detach(|| {
        (0..n_arrays)
            .map(|j| {
                let first = &all[0][j];
                match first.dtype {
                    DType::F64 => {
                        let mut out = vec![0f64; first.len];
                        average_into::<f64>(&all, j, &w, &mut out);
                        Out::F64(out)
                    }
                    _ => {
                        let mut out = vec![0f32; first.len];
                        average_into::<f32>(&all, j, &w, &mut out);
                        Out::F32(out)
                    }
                }
            })
            .collect()
    });
    outs.into_iter()
        .zip(&all[0])
        .map(|(o, v)| match o {
            Out::F32(d) => into_numpy(py, d, &v.shape),
            Out::F64(d) => into_numpy(py, d, &v.shape),
        })
        .collect()
}

fn average_into<T: kernels::Float + Elem>(all: &[Vec<View>], j: usize, w: &[f64], out: &mut [T]) {
    let inputs: Vec<&[T]> = all.iter().map(|l| l[j].slice::<T>()).collect();
    // Shapes and dtypes were checked equal: the lengths match, so this cannot fail.
    let _ = parallel::weighted_average(&inputs, w, out);
}

/// In place: `w[i] += alpha * delta[i]` for every array of the lists.
#[pyfunction]
#[pyo3(signature = (weights, delta, alpha = 1.0))]
pub fn axpy_(
    py: Python<'_>,
    weights: Vec<Bound<'_, PyAny>>,
    delta: Vec<Bound<'_, PyAny>>,
    alpha: f64,
) -> PyResult<()> {
    if weights.len() != delta.len() {
        return Err(PyValueError::new_err(format!(
            "{} weight arrays, {} delta arrays",
            weights.len(),
            delta.len()
        )));
    }
    let w = views(&weights, "axpy_ weights")?;
    let d = views(&delta, "axpy_ delta")?;
    for (i, (a, b)) in w.iter().zip(&d).enumerate() {
        if a.readonly {
            return Err(PyValueError::new_err(format!("array {i} is read-only")));
        }
        if a.len != b.len || a.dtype != b.dtype || !matches!(a.dtype, DType::F32 | DType::F64) {
            return Err(PyValueError::new_err(format!(
                "array {i}: weights {:?} {:?} and delta {:?} {:?} differ (float32/float64 only)",
                a.shape, a.dtype, b.shape, b.dtype
            )));
        }
    }
    for (i, a) in w.iter().enumerate() {
        if w[..i].iter().any(|x| {
            x.len > 0 && a.len > 0 && x.span().start < a.span().end && a.span().start < x.span().end
        }) {
            return Err(PyValueError::new_err(format!(
                "array {i} shares memory with an earlier weight array: pass distinct arrays"
            )));
        }
    }
    py.detach(|| {
        for (a, b) in w.iter().zip(&d) {
            match a.dtype {
                DType::F64 => axpy_one::<f64>(a, b, alpha),
                _ => axpy_one::<f32>(a, b, alpha),
            }
        }
    });
    Ok(())
}

fn axpy_one<T: kernels::Float + Elem>(a: &View, b: &View, alpha: f64) {
    let overlap = a.span().start < b.span().end && b.span().start < a.span().end;
    // A delta that shares memory with the weights (`axpy_(w, w)`) is read from a copy: never a `&[T]` and a
    // `&mut [T]` over the same bytes.
    let copy: Vec<T>;
    let d = if overlap {
        copy = b.slice::<T>().to_vec();
        &copy[..]
    } else {
        b.slice::<T>()
    };
    let _ = parallel::axpy(a.slice_mut::<T>(), alpha, d);
}

/// `new - old` for every array of two weight lists.
#[pyfunction]
pub fn delta<'py>(
    py: Python<'py>,
    new: Vec<Bound<'py, PyAny>>,
    old: Vec<Bound<'py, PyAny>>,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    if new.len() != old.len() {
        return Err(PyValueError::new_err(format!(
            "{} new arrays, {} old arrays",
            new.len(),
            old.len()
        )));
    }
    let n = views(&new, "delta new")?;
    let o = views(&old, "delta old")?;
    for (i, (a, b)) in n.iter().zip(&o).enumerate() {
        if a.shape != b.shape || a.dtype != b.dtype || !matches!(a.dtype, DType::F32 | DType::F64) {
            return Err(PyValueError::new_err(format!(
                "array {i}: {:?} {:?} vs {:?} {:?} (float32/float64 only)",
                a.shape, a.dtype, b.shape, b.dtype
            )));
        }
    }
    let mut out = Vec::with_capacity(n.len());
    for (a, b) in n.iter().zip(&o) {
        let arr = match a.dtype {
            DType::F64 => {
                let v = py.detach(|| {
                    let mut v = vec![0f64; a.len];
                    let _ = kernels::delta(a.slice(), b.slice(), &mut v);
                    v
                });
                into_numpy(py, v, &a.shape)?
            }
            _ => {
                let v = py.detach(|| {
                    let mut v = vec![0f32; a.len];
                    let _ = kernels::delta(a.slice(), b.slice(), &mut v);
                    v
                });
                into_numpy(py, v, &a.shape)?
            }
        };
        out.push(arr);
    }
    Ok(out)
}

/// float32 arrays to float16 (`"float16"`) or bfloat16 (`"bfloat16"`, needs ml_dtypes) arrays.
#[pyfunction]
#[pyo3(signature = (arrays, dtype = "float16"))]
pub fn to_half<'py>(
    py: Python<'py>,
    arrays: Vec<Bound<'py, PyAny>>,
    dtype: &str,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let target = match dtype {
        "float16" => DType::F16,
        "bfloat16" => DType::Bf16,
        other => {
            return Err(PyValueError::new_err(format!(
                "dtype must be 'float16' or 'bfloat16', not {other:?}"
            )))
        }
    };
    let vs = views(&arrays, "to_half")?;
    let mut out = Vec::with_capacity(vs.len());
    for (i, v) in vs.iter().enumerate() {
        if v.dtype != DType::F32 {
            return Err(PyTypeError::new_err(format!(
                "array {i}: to_half expects float32"
            )));
        }
        let bits: Vec<u16> = py.detach(|| {
            let src = v.slice::<f32>();
            match target {
                DType::F16 => {
                    let mut h = vec![f16::ZERO; v.len];
                    let _ = kernels::to_f16(src, &mut h);
                    h.into_iter().map(|x| x.to_bits()).collect()
                }
                _ => {
                    let mut h = vec![bf16::ZERO; v.len];
                    let _ = kernels::to_bf16(src, &mut h);
                    h.into_iter().map(|x| x.to_bits()).collect()
                }
            }
        });
        out.push(numpy_half(py, bits, &v.shape, target)?);
    }
    Ok(out)
}

/// float16 or bfloat16 arrays back to float32. bfloat16 arrays cannot export a buffer, so they arrive viewed
/// as uint16 with `bfloat16[i]` set.
#[pyfunction]
#[pyo3(signature = (arrays, bfloat16 = None))]
pub fn from_half<'py>(
    py: Python<'py>,
    arrays: Vec<Bound<'py, PyAny>>,
    bfloat16: Option<Vec<bool>>,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let mut vs = views(&arrays, "from_half")?;
    if let Some(flags) = bfloat16 {
        for (v, bf) in vs.iter_mut().zip(flags) {
            if bf && v.dtype == DType::U16 {
                v.dtype = DType::Bf16;
            }
        }
    }
    let mut out = Vec::with_capacity(vs.len());
    for (i, v) in vs.iter().enumerate() {
        let data = py.detach(|| -> Result<Vec<f32>, String> {
            let mut o = vec![0f32; v.len];
            match v.dtype {
                DType::F16 => {
                    let _ = kernels::from_f16(v.slice::<f16>(), &mut o);
                }
                DType::Bf16 => {
                    let _ = kernels::from_bf16(v.slice::<bf16>(), &mut o);
                }
                _ => return Err(format!("array {i}: from_half expects float16 or bfloat16")),
            }
            Ok(o)
        });
        out.push(into_numpy(
            py,
            data.map_err(PyTypeError::new_err)?,
            &v.shape,
        )?);
    }
    Ok(out)
}

/// One sparsified array: indices into the flattened array and their values.
type Sparse<'py> = (Bound<'py, PyArray1<u32>>, Bound<'py, PyArray1<f32>>);

/// Top-k sparsification: for each float32 array, the `ratio` share of entries of largest magnitude, as
/// `(indices uint32, values float32)` over the flattened array (at least one entry per non-empty array).
#[pyfunction]
pub fn topk<'py>(
    py: Python<'py>,
    arrays: Vec<Bound<'py, PyAny>>,
    ratio: f64,
) -> PyResult<Vec<Sparse<'py>>> {
    if !(ratio > 0.0 && ratio <= 1.0) {
        return Err(PyValueError::new_err(format!(
            "ratio must be in (0, 1], got {ratio}"
        )));
    }
    let vs = views(&arrays, "topk")?;
    let mut out = Vec::with_capacity(vs.len());
    for (i, v) in vs.iter().enumerate() {
        if v.dtype != DType::F32 {
            return Err(PyTypeError::new_err(format!(
                "array {i}: topk expects float32"
            )));
        }
        let k = ((v.len as f64 * ratio).ceil() as usize).max(usize::from(v.len > 0));
        let (idx, vals) = py.detach(|| kernels::top_k_abs(v.slice::<f32>(), k));
        out.push((PyArray1::from_vec(py, idx), PyArray1::from_vec(py, vals)));
    }
    Ok(out)
}
