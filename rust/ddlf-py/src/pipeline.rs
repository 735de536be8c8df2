//! `BatchPipeline`: batches gathered in Rust by a background thread while Python trains on the previous ones.
//!
//! Given the dataset arrays (rows along the first axis), an index partition and a batch size, a prefetch thread
//! gathers the rows of each batch into fresh contiguous buffers (never holding the GIL), up to `prefetch` batches
//! ahead. Python iterates the pipeline and receives numpy arrays built on those buffers without a copy.

use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ddlf_core::gather::gather_rows_to_vec;
use pyo3::exceptions::{PyStopIteration, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::ops::{indices_u32, value_error, RowSource};

/// Rows of one array, as raw memory. Holds no Python reference: the pipeline object keeps the arrays alive and
/// joins the thread before letting them go.
struct RawRows {
    ptr: *const u8,
    bytes: usize,
    row_bytes: usize,
}
unsafe impl Send for RawRows {}
unsafe impl Sync for RawRows {}

type Batch = Result<(Vec<Vec<u8>>, usize, f64), String>;

/// An iterator over batches of a dataset partition, prefetched by a Rust thread.
#[pyclass(module = "ddlf._ddlf")]
pub struct BatchPipeline {
    sources: Vec<RowSource>,
    // A mutex only to make the receiver `Sync` for the GIL-free wait; there is one consumer.
    rx: Option<Mutex<Receiver<Batch>>>,
    thread: Option<JoinHandle<()>>,
    n_batches: usize,
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
        let n_batches = if drop_last {
            idx.len() / batch_size
        } else {
            idx.len().div_ceil(batch_size)
        };
        let raw: Arc<Vec<RawRows>> = Arc::new(
            sources
                .iter()
                .map(|s| RawRows {
                    ptr: s.ptr(),
                    bytes: s.bytes(),
                    row_bytes: s.row_bytes(),
                })
                .collect(),
        );
        let (tx, rx) = sync_channel::<Batch>(prefetch.max(1));
        let thread = std::thread::Builder::new()
            .name("ddlf-prefetch".into())
            .spawn(move || {
                for b in 0..n_batches {
                    let chunk = &idx[b * batch_size..((b + 1) * batch_size).min(idx.len())];
                    let t0 = Instant::now();
                    let mut out = Vec::with_capacity(raw.len());
                    let mut failed = None;
                    for r in raw.iter() {
                        let src: &[u8] = if r.bytes == 0 {
                            &[]
                        } else {
                            // SAFETY: the pipeline keeps the arrays alive until this thread is joined.
                            unsafe { std::slice::from_raw_parts(r.ptr, r.bytes) }
                        };
                        match gather_rows_to_vec(src, r.row_bytes, chunk, 1) {
                            Ok(buf) => out.push(buf),
                            Err(e) => {
                                failed = Some(e.to_string());
                                break;
                            }
                        }
                    }
                    let msg = match failed {
                        Some(e) => Err(e),
                        None => Ok((out, chunk.len(), t0.elapsed().as_secs_f64())),
                    };
                    if tx.send(msg).is_err() {
                        return; // the pipeline was dropped
                    }
                }
            })
            .map_err(value_error)?;
        Ok(BatchPipeline {
            sources,
            rx: Some(Mutex::new(rx)),
            thread: Some(thread),
            n_batches,
            served: 0,
            wait_seconds: 0.0,
            gather_seconds: 0.0,
            rows_served: 0,
        })
    }

    fn __len__(&self) -> usize {
        self.n_batches
    }

    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        if self.served >= self.n_batches {
            return Err(PyStopIteration::new_err(()));
        }
        let Some(rx) = self.rx.as_ref() else {
            return Err(PyStopIteration::new_err(()));
        };
        let t0 = Instant::now();
        let msg = py.detach(|| {
            rx.lock()
                .unwrap_or_else(|e| e.into_inner())
                .recv_timeout(Duration::from_secs(3600))
        });
        self.wait_seconds += t0.elapsed().as_secs_f64();
        let (bufs, rows, gather_s) = match msg {
            Ok(Ok(b)) => b,
            Ok(Err(e)) => return Err(PyValueError::new_err(e)),
            Err(_) => return Err(PyValueError::new_err("the prefetch thread stopped")),
        };
        self.gather_seconds += gather_s;
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

impl Drop for BatchPipeline {
    fn drop(&mut self) {
        // Unblock the thread (its send fails once the receiver is gone), then wait for it to let go of the
        // arrays' memory before they are released. It never needs the GIL, so joining cannot deadlock.
        self.rx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
