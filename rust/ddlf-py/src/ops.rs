//! `ddlf.ops` kernels: merge weight lists, convert precision, shuffle and gather, with the GIL released.
//!
//! Arrays are read through the buffer protocol (C-contiguous float32/float64, any shape) and results are
//! returned as new numpy arrays built on Rust-allocated memory without a further copy.

use ddlf_core::{gather as core_gather, kernels, shuffle};
use half::{bf16, f16};
use numpy::{PyArray1, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

/// Arrays larger than this are split across threads.
const PARALLEL_BYTES: usize = 1 << 20;

pub(crate) fn value_error(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum DType {
    F32,
    F64,
    F16,
    Bf16,
    /// Raw 16-bit words: bfloat16 bits viewed as uint16.
    U16,
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
unsafe impl Send for View {}
unsafe impl Sync for View {}

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
        Ok(View {
            ptr: buf.buf_ptr() as *mut u8,
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

    /// # Safety
    /// The dtype must be `T`'s.
    unsafe fn slice<T>(&self) -> &[T] {
        if self.len == 0 {
            return &[];
        }
        unsafe { std::slice::from_raw_parts(self.ptr as *const T, self.len) }
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

/// Run `f(start, end)` over `0..len` in parallel chunks when the work is large.
fn par_ranges(len: usize, elem_bytes: usize, f: impl Fn(usize, usize) + Sync) {
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .min(8);
    if threads <= 1 || len * elem_bytes < PARALLEL_BYTES {
        f(0, len);
        return;
    }
    let chunk = len.div_ceil(threads);
    std::thread::scope(|s| {
        for t in 0..threads {
            let start = t * chunk;
            let end = ((t + 1) * chunk).min(len);
            if start < end {
                let f = &f;
                s.spawn(move || f(start, end));
            }
        }
    });
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
    for (j, v) in all[0].iter().enumerate() {
        if !matches!(v.dtype, DType::F32 | DType::F64) {
            return Err(PyTypeError::new_err(format!(
                "array {j}: weighted_average supports float32 and float64"
            )));
        }
    }
    outs.into_iter()
        .zip(&all[0])
        .map(|(o, v)| match o {
            Out::F32(d) => into_numpy(py, d, &v.shape),
            Out::F64(d) => into_numpy(py, d, &v.shape),
        })
        .collect()
}

fn average_into<T: kernels::Float>(all: &[Vec<View>], j: usize, w: &[f64], out: &mut [T]) {
    let inputs: Vec<&[T]> = all.iter().map(|l| unsafe { l[j].slice::<T>() }).collect();
    let out_ptr = SyncPtr(out.as_mut_ptr());
    let len = out.len();
    par_ranges(len, std::mem::size_of::<T>(), |s, e| {
        let parts: Vec<&[T]> = inputs.iter().map(|x| &x[s..e]).collect();
        // SAFETY: the ranges are disjoint.
        let out = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(s), e - s) };
        let _ = kernels::weighted_average(&parts, w, out);
    });
}

struct SyncPtr<T>(*mut T);
unsafe impl<T> Send for SyncPtr<T> {}
unsafe impl<T> Sync for SyncPtr<T> {}
impl<T> SyncPtr<T> {
    fn get(&self) -> *mut T {
        self.0
    }
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
    py.detach(|| {
        for (a, b) in w.iter().zip(&d) {
            match a.dtype {
                DType::F64 => axpy_par::<f64>(a, b, alpha),
                _ => axpy_par::<f32>(a, b, alpha),
            }
        }
    });
    Ok(())
}

fn axpy_par<T: kernels::Float>(a: &View, b: &View, alpha: f64) {
    let wp = SyncPtr(a.ptr as *mut T);
    let dp = SyncPtr(b.ptr as *mut T);
    par_ranges(a.len, std::mem::size_of::<T>(), |s, e| unsafe {
        let w = std::slice::from_raw_parts_mut(wp.get().add(s), e - s);
        let d = std::slice::from_raw_parts(dp.get().add(s) as *const T, e - s);
        let _ = kernels::axpy(w, alpha, d);
    });
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
                    let _ = kernels::delta(unsafe { a.slice() }, unsafe { b.slice() }, &mut v);
                    v
                });
                into_numpy(py, v, &a.shape)?
            }
            _ => {
                let v = py.detach(|| {
                    let mut v = vec![0f32; a.len];
                    let _ = kernels::delta(unsafe { a.slice() }, unsafe { b.slice() }, &mut v);
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
            let src = unsafe { v.slice::<f32>() };
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
                    let _ = kernels::from_f16(unsafe { v.slice::<f16>() }, &mut o);
                }
                DType::Bf16 => {
                    let _ = kernels::from_bf16(unsafe { v.slice::<bf16>() }, &mut o);
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
        let (idx, vals) = py.detach(|| kernels::top_k_abs(unsafe { v.slice::<f32>() }, k));
        out.push((PyArray1::from_vec(py, idx), PyArray1::from_vec(py, vals)));
    }
    Ok(out)
}

/// The seeded permutation of `0..n` for `(seed, epoch)`, as uint32.
#[pyfunction]
pub fn permutation(
    py: Python<'_>,
    n: usize,
    seed: u64,
    epoch: u64,
) -> PyResult<Bound<'_, PyArray1<u32>>> {
    let p = py
        .detach(|| shuffle::permutation(n, seed, epoch))
        .map_err(value_error)?;
    Ok(PyArray1::from_vec(py, p))
}

/// Every worker's index partition for one epoch (balanced, or proportional to `shares`).
#[pyfunction]
#[pyo3(signature = (n, seed, epoch, shares))]
pub fn partitions(
    py: Python<'_>,
    n: usize,
    seed: u64,
    epoch: u64,
    shares: Vec<f64>,
) -> PyResult<Vec<Bound<'_, PyArray1<u32>>>> {
    let parts = py
        .detach(|| shuffle::partitions(n, seed, epoch, &shares))
        .map_err(value_error)?;
    Ok(parts
        .into_iter()
        .map(|p| PyArray1::from_vec(py, p))
        .collect())
}

/// Partition sizes for `n` samples and `shares` (what `partitions` produces, without the permutation).
#[pyfunction]
pub fn split_sizes(n: usize, shares: Vec<f64>) -> PyResult<Vec<usize>> {
    Ok(shuffle::split(n, &shares)
        .map_err(value_error)?
        .into_iter()
        .map(|r| r.len())
        .collect())
}

/// One worker's partition, regenerated from the inputs the master used (seeded mode).
#[pyfunction]
pub fn partition_for(
    py: Python<'_>,
    n: usize,
    seed: u64,
    epoch: u64,
    shares: Vec<f64>,
    worker: usize,
) -> PyResult<Bound<'_, PyArray1<u32>>> {
    let p = py
        .detach(|| shuffle::partition_for(n, seed, epoch, &shares, worker))
        .map_err(value_error)?;
    Ok(PyArray1::from_vec(py, p))
}

/// Rows `indices` of `array` (any dtype, C-contiguous, first axis = rows) as a new contiguous array.
#[pyfunction]
pub fn gather<'py>(
    py: Python<'py>,
    array: Bound<'py, PyAny>,
    indices: Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    let src = RowSource::new(&array)?;
    let idx = indices_u32(&indices)?;
    let out = py.detach(|| src.gather(&idx)).map_err(value_error)?;
    src.to_numpy(py, out, idx.len())
}

/// Index arrays arrive as any integer numpy array or sequence; they become u32.
pub(crate) fn indices_u32(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let np = obj.py().import("numpy")?;
    let arr = np.call_method1("ascontiguousarray", (obj,))?;
    let kind: String = arr.getattr("dtype")?.getattr("kind")?.extract()?;
    if kind != "u" && kind != "i" {
        return Err(PyTypeError::new_err("indices must be integers"));
    }
    if arr.getattr("size")?.extract::<usize>()? > 0 {
        let min: i64 = arr.call_method0("min")?.extract()?;
        if min < 0 {
            return Err(PyValueError::new_err(format!("negative index {min}")));
        }
    }
    let arr = arr
        .call_method1("astype", ("uint32",))?
        .call_method1("reshape", (-1,))?;
    let typed = arr.cast::<PyArray1<u32>>()?;
    Ok(typed.readonly().as_slice()?.to_vec())
}

/// A dataset array viewed as rows of bytes, readable from any thread while it lives.
pub(crate) struct RowSource {
    ptr: *const u8,
    bytes: usize,
    rows: usize,
    row_bytes: usize,
    row_shape: Vec<usize>,
    dtype: Py<PyAny>,
    _buf: PyUntypedBuffer,
    _owner: Py<PyAny>,
}
unsafe impl Send for RowSource {}
unsafe impl Sync for RowSource {}

impl RowSource {
    pub(crate) fn new(array: &Bound<'_, PyAny>) -> PyResult<Self> {
        let np = array.py().import("numpy")?;
        let arr = np.call_method1("ascontiguousarray", (array,))?;
        let untyped = arr.cast::<numpy::PyUntypedArray>()?;
        let shape = untyped.shape().to_vec();
        if shape.is_empty() {
            return Err(PyValueError::new_err(
                "a dataset array needs at least one dimension",
            ));
        }
        let buf = PyUntypedBuffer::get(&arr)?;
        let rows = shape[0];
        let bytes = buf.len_bytes();
        let row_bytes = bytes.checked_div(rows).unwrap_or(0);
        Ok(RowSource {
            ptr: buf.buf_ptr() as *const u8,
            bytes,
            rows,
            row_bytes,
            row_shape: shape[1..].to_vec(),
            dtype: arr.getattr("dtype")?.unbind(),
            _buf: buf,
            _owner: arr.unbind(),
        })
    }

    pub(crate) fn ptr(&self) -> *const u8 {
        self.ptr
    }

    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    pub(crate) fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    pub(crate) fn rows(&self) -> usize {
        self.rows
    }

    fn src(&self) -> &[u8] {
        if self.bytes == 0 {
            return &[];
        }
        unsafe { std::slice::from_raw_parts(self.ptr, self.bytes) }
    }

    pub(crate) fn gather(&self, idx: &[u32]) -> Result<Vec<u8>, core_gather::GatherError> {
        let threads = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
            .min(8);
        core_gather::gather_rows_to_vec(self.src(), self.row_bytes, idx, threads)
    }

    pub(crate) fn to_numpy<'py>(
        &self,
        py: Python<'py>,
        data: Vec<u8>,
        rows: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let raw = PyArray1::from_vec(py, data).into_any();
        let mut shape = vec![rows];
        shape.extend_from_slice(&self.row_shape);
        raw.call_method1("view", (self.dtype.bind(py),))?
            .call_method1("reshape", (shape,))
    }
}
