//! `BatchPipeline`: batches gathered in Rust by a background thread while Python trains on the previous ones.
//!
//! Given the dataset arrays (rows along the first axis), an index partition and a batch size, a prefetch thread
//! (`ddlf_core::prefetch`) gathers the rows of each batch into fresh contiguous buffers, up to `prefetch` batches
//! ahead. Python iterates the pipeline and receives numpy arrays built on those buffers without a copy.

use std::time::{Duration, Instant};

use ddlf_core::prefetch::{Batch, Prefetcher, Rows};
use pyo3::exceptions::{PyStopIteration, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::ops::{indices_u32, value_error, RowSource};

/// An iterator over batches of a dataset partition, prefetched by a Rust thread.
#[pyclass(module = "ddlf._ddlf")]
pub struct BatchPipeline {
    // Declared before `sources`: dropped first, so its thread is joined before the exports are released.
    prefetcher: Option<Prefetcher>,
    sources: Vec<RowSource>,
    served: usize,
    wait_seconds: f64,
    gather_seconds: f64,
    rows_served: usize,
}
#[pymethods]
impl BatchPipeline {
    /// `arrays`: dataset arrays with the same number of rows; `indices`: the rows to visit, in order;
    /// `batch_size`: rows per batch; `prefetch`: batches gathered ahead; `drop_last`: skip a short last batch.
    #[new]
    #[pyo3(signature = (arrays, indices, batch_size, prefetch = 2, drop_last = false))]
    fn new(
        arrays: Vec<Bound<'_, PyAny>>,
        indices: Bound<'_, PyAny>,
        batch_size: usize,
        prefetch: usize,
        drop_last: bool,
    ) -> PyResult<Self> {
        if arrays.is_empty() {
            return Err(PyValueError::new_err("at least one array is needed"));
        }
        if batch_size == 0 {
            return Err(PyValueError::new_err("batch_size must be at least 1"));
        }
        let sources: Vec<RowSource> = arrays.iter().map(RowSource::new).collect::<PyResult<_>>()?;
        let rows = sources[0].rows();
        for (i, s) in sources.iter().enumerate() {
            if s.rows() != rows {
                return Err(PyValueError::new_err(format!(
                    "array {i} has {} rows, array 0 has {rows}",
                    s.rows()
                )));
            }
        }
        let idx = indices_u32(&indices)?;
        if let Some(bad) = idx.iter().find(|&&i| i as usize >= rows) {
            return Err(PyValueError::new_err(format!(
                "index {bad} out of range for a dataset of {rows} rows"
            )));
        }
        let raw = sources
            .iter()
            // SAFETY: `sources` holds the arrays' buffer exports, which keep their memory alive and pinned; the
            // pipeline owns both and drops the prefetcher (which joins its thread) before the exports.
            .map(|s| unsafe { Rows::new(s.ptr(), s.bytes(), s.row_bytes()) })
            .collect();
        let prefetcher =
            Prefetcher::start(raw, idx, batch_size, prefetch, drop_last).map_err(value_error)?;
        Ok(BatchPipeline {
            prefetcher: Some(prefetcher),
            sources,
            served: 0,
            wait_seconds: 0.0,
            gather_seconds: 0.0,
            rows_served: 0,
        })
    }

    fn __len__(&self) -> usize {
        self.prefetcher.as_ref().map_or(0, Prefetcher::len)
    }

    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let Some(prefetcher) = self.prefetcher.as_ref() else {
            return Err(PyStopIteration::new_err(()));
        };
        if self.served >= prefetcher.len() {
            return Err(PyStopIteration::new_err(()));
        }
        let t0 = Instant::now();
        let batch = py.detach(|| prefetcher.next(Duration::from_secs(3600)));
        self.wait_seconds += t0.elapsed().as_secs_f64();
        let Batch {
            buffers: bufs,
            rows,
            gather_seconds,
        } = batch.map_err(value_error)?;
        self.gather_seconds += gather_seconds;
        self.served += 1;
        self.rows_served += rows;
        let arrays = bufs
            .into_iter()
            .zip(&self.sources)
            .map(|(b, s)| s.to_numpy(py, b, rows))
            .collect::<PyResult<Vec<_>>>()?;
        if arrays.len() == 1 {
            return Ok(arrays
                .into_iter()
                .next()
                .unwrap_or_else(|| py.None().into_bound(py)));
        }
        Ok(PyTuple::new(py, arrays)?.into_any())
    }

    /// Time the consumer spent blocked waiting for a batch, time the thread spent gathering, batches and rows
    /// served so far.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("wait_seconds", self.wait_seconds)?;
        d.set_item("gather_seconds", self.gather_seconds)?;
        d.set_item("batches", self.served)?;
        d.set_item("rows", self.rows_served)?;
        Ok(d)
    }
}
