//! `ddlf.ops` index kernels: seeded permutations, partitions and row gathers, with the GIL released (the array
//! kernels are in [`crate::arrays`]).

use ddlf_core::{gather as core_gather, shuffle};
use numpy::{PyArray1, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

pub(crate) fn value_error(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
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
    if arr.getattr("size")?.extract::<usize>()? == 0 {
        return Ok(Vec::new()); // no rows, whatever the dtype (`[]` is float64 to numpy)
    }
    let kind: String = arr.getattr("dtype")?.getattr("kind")?.extract()?;
    if kind != "u" && kind != "i" {
        return Err(PyTypeError::new_err("indices must be integers"));
    }
    // Compared as Python ints (exact for every integer dtype): a cast first would wrap silently.
    let zero = 0i64.into_pyobject(obj.py())?;
    let min = arr.call_method0("min")?;
    if min.lt(&zero)? {
        return Err(PyValueError::new_err(format!("negative index {min}")));
    }
    let max = arr.call_method0("max")?;
    if max.gt(u32::MAX)? {
        return Err(PyValueError::new_err(format!(
            "index {max} is out of range: ddlf indexes at most {} rows",
            u32::MAX
        )));
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
// SAFETY: a `RowSource` only reads the array memory its buffer export (`_buf`) pins, from any thread, and never
// writes it; the Python handles it holds are only used with the GIL.
unsafe impl Send for RowSource {}
// SAFETY: as for `Send`: shared reads only.
unsafe impl Sync for RowSource {}

impl RowSource {
    pub(crate) fn new(array: &Bound<'_, PyAny>) -> PyResult<Self> {
        let np = array.py().import("numpy")?;
        // Before `ascontiguousarray`, which makes a 0-d array 1-d.
        if np.call_method1("ndim", (array,))?.extract::<usize>()? == 0 {
            return Err(PyValueError::new_err(
                "a dataset array needs at least one dimension (rows), not a 0-d array",
            ));
        }
        let arr = np.call_method1("ascontiguousarray", (array,))?;
        if arr
            .getattr("dtype")?
            .getattr("hasobject")?
            .extract::<bool>()?
        {
            // Rows are copied as bytes: references to Python objects cannot be (they would not be counted).
            return Err(PyTypeError::new_err(format!(
                "arrays of Python objects (dtype {}) cannot be batched: convert them to a numeric dtype first",
                arr.getattr("dtype")?.str()?
            )));
        }
        let untyped = arr.cast::<numpy::PyUntypedArray>()?;
        let Some((&rows, row_shape)) = untyped.shape().split_first() else {
            return Err(PyValueError::new_err(
                "a dataset array needs at least one dimension",
            ));
        };
        let row_shape = row_shape.to_vec();
        // A dtype the buffer protocol cannot describe (bfloat16 and float8 of ml_dtypes, datetime64, timedelta64)
        // is exported as the same memory's bytes: rows are copied as bytes, and viewed as `dtype` after.
        let buf = match PyUntypedBuffer::get(&arr) {
            Ok(buf) => buf,
            Err(_) => PyUntypedBuffer::get(
                &arr.call_method1("reshape", (-1,))?
                    .call_method1("view", (np.getattr("uint8")?,))?,
            )?,
        };
        let bytes = buf.len_bytes();
        let row_bytes = bytes.checked_div(rows).unwrap_or(0);
        Ok(RowSource {
            ptr: buf.buf_ptr() as *const u8,
            bytes,
            rows,
            row_bytes,
            row_shape,
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
        // SAFETY: `ptr` and `bytes` are the buffer and length of the export in `_buf` (of a C-contiguous copy made
        // by `ascontiguousarray`), which keeps that memory alive and unmoved while `self` lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.bytes) }
    }

    pub(crate) fn gather(&self, idx: &[u32]) -> Result<Vec<u8>, core_gather::GatherError> {
        let threads = ddlf_core::parallel::cores().min(8);
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
