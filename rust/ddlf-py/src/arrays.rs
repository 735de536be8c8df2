//! `ddlf.ops` array kernels: merge weight lists and convert precision, with the GIL released.
//!
//! Arrays are read through the buffer protocol (C-contiguous, aligned, any shape); every dtype is checked before
//! any memory is read, and results are returned as new numpy arrays built on Rust-allocated memory without a
//! further copy. The loops are `ddlf_core::kernels` (split across threads by `ddlf_core::parallel`).

use ddlf_core::arrays::{self, Array, ArrayError, ArrayRef, Data, Owned};
use ddlf_core::{kernels, parallel};
use half::{bf16, f16};
use numpy::PyArray1;
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum DType {
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
pub(crate) struct View {
    ptr: *mut u8,
    pub(crate) len: usize,
    pub(crate) dtype: DType,
    shape: Vec<usize>,
    pub(crate) readonly: bool,
    _buf: PyUntypedBuffer,
}
// SAFETY: `View` only reads (or, for `axpy_` and `Ring.allreduce_`, writes) the exporter's memory, which `_buf` keeps alive and pinned
// whichever thread holds the view; the GIL is not needed for that. Callers that write check the view is writable
// and not aliased (see `axpy_`).
unsafe impl Send for View {}
// SAFETY: as for `Send`; concurrent readers of the same memory are fine, and writes go through disjoint slices.
unsafe impl Sync for View {}

/// The element types a `View` hands out as slices, each with the dtype that guarantees its layout.
pub(crate) trait Elem: Sized {
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
    const DTYPES: &'static [DType] = &[DType::Bf16];
}
impl Elem for u16 {
    const DTYPES: &'static [DType] = &[DType::U16];
}

impl View {
    pub(crate) fn new(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Self> {
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
    pub(crate) fn slice<T: Elem>(&self) -> &[T] {
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
    pub(crate) fn slice_mut<T: Elem>(&self) -> &mut [T] {
        assert!(T::DTYPES.contains(&self.dtype) && !self.readonly);
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: as in `slice`, and the buffer was exported writable. Exclusive access: the callers (`axpy_`,
        // `Ring.allreduce_`) take at most one mutable slice per array, check that no other input overlaps it, and
        // hold no other reference to this memory while they write (`Ring.allreduce_` checks its arrays pairwise).
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut T, self.len) }
    }

    /// The typed elements and shape, for the kernels of `ddlf_core::arrays`.
    fn array(&self) -> ArrayRef<'_> {
        let data = match self.dtype {
            DType::F32 => Data::F32(self.slice()),
            DType::F64 => Data::F64(self.slice()),
            DType::F16 => Data::F16(self.slice()),
            DType::Bf16 => Data::Bf16(self.slice()),
            DType::U16 => Data::U16(self.slice()),
        };
        ArrayRef {
            data,
            shape: &self.shape,
        }
    }

    /// The byte range of the viewed memory.
    fn span(&self) -> std::ops::Range<usize> {
        let start = self.ptr as usize;
        start..start + self.len * self.dtype.size()
    }

    /// Whether two non-empty views share memory.
    pub(crate) fn overlaps(&self, other: &View) -> bool {
        let (a, b) = (self.span(), other.span());
        self.len > 0 && other.len > 0 && a.start < b.end && b.start < a.end
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

/// A kernel's result as a numpy array (half precision as numpy's float16 or ml_dtypes' bfloat16).
fn to_numpy(py: Python<'_>, a: Array) -> PyResult<Bound<'_, PyAny>> {
    let (bits, dtype): (Vec<u16>, _) = match a.data {
        Owned::F32(v) => return into_numpy(py, v, &a.shape),
        Owned::F64(v) => return into_numpy(py, v, &a.shape),
        Owned::F16(v) => (
            v.into_iter().map(f16::to_bits).collect(),
            py.import("numpy")?.getattr("float16")?,
        ),
        Owned::Bf16(v) => (
            v.into_iter().map(bf16::to_bits).collect(),
            py.import("ml_dtypes")?.getattr("bfloat16")?,
        ),
    };
    into_numpy(py, bits, &a.shape)?.call_method1("view", (dtype,))
}

fn views(list: &[Bound<'_, PyAny>], what: &str) -> PyResult<Vec<View>> {
    list.iter().map(|o| View::new(o, what)).collect()
}

fn refs(views: &[View]) -> Vec<ArrayRef<'_>> {
    views.iter().map(View::array).collect()
}

fn array_error(e: ArrayError) -> PyErr {
    match e {
        ArrayError::Value(m) => PyValueError::new_err(m),
        ArrayError::Type(m) => PyTypeError::new_err(m),
    }
}

/// Run a kernel over views with the GIL released, and hand its results to numpy.
fn results<'py>(
    py: Python<'py>,
    kernel: impl FnOnce() -> Result<Vec<Array>, ArrayError> + Send,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let out = py.detach(kernel).map_err(array_error)?;
    out.into_iter().map(|a| to_numpy(py, a)).collect()
}

/// Weighted average of N weight lists: `out[j] = sum_i w_i * lists[i][j] / sum_i w_i`.
#[pyfunction]
#[pyo3(signature = (lists, weights = None))]
pub fn weighted_average<'py>(
    py: Python<'py>,
    lists: Vec<Vec<Bound<'py, PyAny>>>,
    weights: Option<Vec<f64>>,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let weights = weights.unwrap_or_else(|| vec![1.0; lists.len()]);
    let all: Vec<Vec<View>> = lists
        .iter()
        .map(|l| views(l, "weighted_average"))
        .collect::<PyResult<_>>()?;
    let lists: Vec<Vec<ArrayRef<'_>>> = all.iter().map(|l| refs(l)).collect();
    results(py, || arrays::weighted_average(&lists, &weights))
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
    let w = views(&weights, "axpy_ weights")?;
    let d = views(&delta, "axpy_ delta")?;
    arrays::check_axpy(&refs(&w), &refs(&d)).map_err(array_error)?;
    for (i, a) in w.iter().enumerate() {
        if a.readonly {
            return Err(PyValueError::new_err(format!("array {i} is read-only")));
        }
        if w[..i].iter().any(|x| x.overlaps(a)) {
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
    let (n, o) = (views(&new, "delta new")?, views(&old, "delta old")?);
    let (n, o) = (refs(&n), refs(&o));
    results(py, || arrays::delta(&n, &o))
}

/// float32 arrays to float16 (`"float16"`) or bfloat16 (`"bfloat16"`, needs ml_dtypes) arrays.
#[pyfunction]
#[pyo3(signature = (arrays, dtype = "float16"))]
pub fn to_half<'py>(
    py: Python<'py>,
    arrays: Vec<Bound<'py, PyAny>>,
    dtype: &str,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let bf16 = match dtype {
        "float16" => false,
        "bfloat16" => true,
        other => {
            return Err(PyValueError::new_err(format!(
                "dtype must be 'float16' or 'bfloat16', not {other:?}"
            )))
        }
    };
    let vs = views(&arrays, "to_half")?;
    let refs = refs(&vs);
    results(py, || ddlf_core::arrays::to_half(&refs, bf16))
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
    for (v, bf) in vs.iter_mut().zip(bfloat16.unwrap_or_default()) {
        if bf && v.dtype == DType::U16 {
            v.dtype = DType::Bf16;
        }
    }
    let refs = refs(&vs);
    results(py, || ddlf_core::arrays::from_half(&refs))
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
