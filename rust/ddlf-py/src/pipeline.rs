//! `BatchPipeline`: batches gathered in Rust by a background thread while Python trains on the previous ones (or,
//! for a small partition in memory, gathered as Python asks for each).
//!
//! Given the dataset arrays (rows along the first axis), an index partition and a batch size, a prefetch thread
//! (`ddlf_core::prefetch`) gathers the rows of each batch into fresh contiguous buffers, up to `prefetch` batches
//! ahead; a small partition of rows in memory is gathered when asked, without the thread
//! (`ddlf_core::prefetch::INLINE_BYTES`). Python iterates the pipeline and receives numpy arrays built on those
//! buffers without a copy.
//!
//! An input that describes itself with `__ddlf_images__()` (`ddlf.datasets.EncodedImages`) is a dataset of
//! encoded JPEG/PNG files: its batches are decoded, resized and flipped on the prefetch side, on several threads,
//! and arrive as `uint8` arrays of shape `(rows, height, width, channels)`.

use std::time::{Duration, Instant};

use ddlf_core::images::ImageSpec;
use ddlf_core::prefetch::{Batch, EncodedRows, Gather, PrefetchError, Prefetcher, Rows, Source};
use numpy::PyArray1;
use pyo3::exceptions::{PyStopIteration, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::ops::{indices_u32, value_error, RowSource};

/// Threads that decode one batch of images: the process's thread budget when it has one (`DDLF_THREADS`, which a
/// worker started with `threads=` gets: local workers split the cores), otherwise the machine's cores; at most 8.
fn default_decode_threads() -> usize {
    let cores = ddlf_core::parallel::cores();
    let budget = std::env::var("DDLF_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0);
    budget.unwrap_or(cores).min(cores).min(8)
}

/// One input of a pipeline: an array whose rows are copied (`from_disk`: a `numpy.memmap` of a file outside
/// `/dev/shm`, never gathered inline: `ddlf_core::prefetch::Rows::from_disk`), or encoded images that are decoded.
pub(crate) enum Input {
    Array {
        rows: RowSource,
        from_disk: bool,
    },
    Images {
        data: RowSource,
        offsets: RowSource,
        spec: ImageSpec,
    },
}

impl Input {
    pub(crate) fn new(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        if !obj.hasattr("__ddlf_images__")? {
            return Ok(Input::Array {
                rows: RowSource::new(obj)?,
                from_disk: mapped_from_disk(obj)?,
            });
        }
        let (data, offsets, (height, width), channels, flip): (
            Bound<'_, PyAny>,
            Bound<'_, PyAny>,
            (usize, usize),
            usize,
            bool,
        ) = obj.call_method0("__ddlf_images__")?.extract()?;
        let np = obj.py().import("numpy")?;
        let flat = |a: Bound<'_, PyAny>, dtype: &str| -> PyResult<RowSource> {
            let a = np
                .call_method1("ascontiguousarray", (a,))?
                .call_method1("reshape", (-1,))?;
            let kind: String = a.getattr("dtype")?.getattr("str")?.extract()?;
            if kind != dtype {
                return Err(PyValueError::new_err(format!(
                    "encoded images need {dtype} arrays, not {kind}"
                )));
            }
            RowSource::new(&a)
        };
        let spec = ImageSpec::new(height, width, channels, flip).map_err(value_error)?;
        Ok(Input::Images {
            data: flat(data, "|u1")?,
            offsets: flat(offsets, "<u8")?,
            spec,
        })
    }

    /// How many rows (images) there are.
    pub(crate) fn rows(&self) -> usize {
        match self {
            Input::Array { rows, .. } => rows.rows(),
            Input::Images { offsets, .. } => offsets.rows().saturating_sub(1),
        }
    }

    /// The source the prefetcher reads.
    fn source(&self, threads: usize, seed: u64) -> PyResult<Source> {
        Ok(match self {
            Input::Array { rows: s, from_disk } => {
                // SAFETY: `self` holds the array's buffer export, which keeps its memory alive and pinned; every
                // owner of an `Input` drops the prefetcher (which joins its thread) before the `Input`.
                let rows = unsafe { Rows::new(s.ptr(), s.bytes(), s.row_bytes()) };
                Source::Rows(if *from_disk { rows.from_disk() } else { rows })
            }
            Input::Images {
                data,
                offsets,
                spec,
            } => {
                // SAFETY: as above, for both exports; `offsets` is a C-contiguous `<u8` array (checked in `new`),
                // and `EncodedRows::new` checks the pointer's alignment and every offset before any read.
                let rows = unsafe {
                    EncodedRows::new(
                        Rows::new(data.ptr(), data.bytes(), 1),
                        offsets.ptr() as *const u64,
                        offsets.rows(),
                        *spec,
                        threads,
                        seed,
                    )
                };
                Source::Images(rows.map_err(value_error)?)
            }
        })
    }

    fn to_numpy<'py>(
        &self,
        py: Python<'py>,
        data: Vec<u8>,
        rows: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        match self {
            Input::Array { rows: s, .. } => s.to_numpy(py, data, rows),
            Input::Images { spec, .. } => PyArray1::from_vec(py, data)
                .into_any()
                .call_method1("reshape", ((rows, spec.height, spec.width, spec.channels),)),
        }
    }
}

/// Whether `obj` is a `numpy.memmap` of a file that may be on disk: any but the host's copies under `/dev/shm`
/// (`ddlf.data.node_store`), a memmap without a file name included.
fn mapped_from_disk(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    let memmap = obj.py().import("numpy")?.getattr("memmap")?;
    if !obj.is_instance(&memmap)? {
        return Ok(false);
    }
    let name = obj.getattr("filename")?; // a str, a pathlib.Path (np.load of a Path), or None
    Ok(name.is_none() || !name.str()?.to_string_lossy().starts_with("/dev/shm/"))
}

/// Decodes the images at `indices` of an encoded-image dataset (no flips): `uint8`, `(len(indices), height,
/// width, channels)`. Without the GIL, on up to `threads` threads.
#[pyfunction]
#[pyo3(signature = (images, indices, threads = None))]
pub fn decode_images<'py>(
    py: Python<'py>,
    images: Bound<'py, PyAny>,
    indices: Bound<'py, PyAny>,
    threads: Option<usize>,
) -> PyResult<Bound<'py, PyAny>> {
    let mut input = Input::new(&images)?;
    let Input::Images { spec, .. } = &mut input else {
        return Err(PyValueError::new_err(
            "decode_images takes encoded images (ddlf.datasets.EncodedImages)",
        ));
    };
    spec.flip = false;
    let idx = indices_u32(&indices)?;
    // Declared after `input`, so dropped before it: the exports outlive every read.
    let Source::Images(rows) = input.source(threads.unwrap_or_else(default_decode_threads), 0)?
    else {
        return Err(PyValueError::new_err("not encoded images"));
    };
    let out = py.detach(|| rows.decode(&idx, 0)).map_err(value_error)?;
    input.to_numpy(py, out, idx.len())
}

/// An iterator over batches of a dataset partition, prefetched by a Rust thread (a small partition in memory:
/// gathered as each batch is asked for).
#[pyclass(module = "ddlf._ddlf")]
pub struct BatchPipeline {
    // Declared before `sources`: dropped first, so its thread is joined before the exports are released.
    prefetcher: Option<Prefetcher>,
    sources: Vec<Input>,
    served: usize,
    wait_seconds: f64,
    gather_seconds: f64,
    rows_served: usize,
}
#[pymethods]
impl BatchPipeline {
    /// `arrays`: dataset arrays (or encoded images) with the same number of rows; `indices`: the rows to visit, in
    /// order; `batch_size`: rows per batch; `prefetch`: batches gathered ahead; `drop_last`: skip a short last
    /// batch; `decode_threads`: threads decoding a batch of images (default: the worker's thread budget or the
    /// cores, at most 8); `seed`: seeds the images' random flips; `inline`: gather on the iterating thread (True;
    /// `prefetch` is then unused), on the prefetch thread (False), or on the iterating thread when the partition
    /// is at most 1 MiB of rows already in memory (None, the default).
    #[new]
    #[pyo3(signature = (arrays, indices, batch_size, prefetch = 2, drop_last = false, decode_threads = None, seed = 0, inline = None))]
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments
    fn new(
        arrays: Bound<'_, PyAny>,
        indices: Bound<'_, PyAny>,
        batch_size: i64,
        prefetch: i64,
        drop_last: bool,
        decode_threads: Option<usize>,
        seed: u64,
        inline: Option<bool>,
    ) -> PyResult<Self> {
        if arrays.hasattr("__array_interface__")? || arrays.hasattr("__ddlf_images__")? {
            return Err(PyTypeError::new_err(
                "arrays is a list of the dataset's arrays: pass one array as [array]",
            ));
        }
        let arrays: Vec<Bound<'_, PyAny>> = arrays.extract()?;
        if arrays.is_empty() {
            return Err(PyValueError::new_err("at least one array is needed"));
        }
        let Ok(batch_size @ 1..) = usize::try_from(batch_size) else {
            return Err(PyValueError::new_err(format!(
                "batch_size must be at least 1, not {batch_size}"
            )));
        };
        let Ok(prefetch) = usize::try_from(prefetch) else {
            return Err(PyValueError::new_err(format!(
                "prefetch must be 0 or more, not {prefetch}"
            )));
        };
        let sources: Vec<Input> = arrays.iter().map(Input::new).collect::<PyResult<_>>()?;
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
        // The pipeline owns both the inputs and the prefetcher, and drops the prefetcher first (field order).
        let threads = decode_threads.unwrap_or_else(default_decode_threads);
        let raw = sources
            .iter()
            .map(|s| s.source(threads, seed))
            .collect::<PyResult<_>>()?;
        let gather = match inline {
            None => Gather::Auto,
            Some(true) => Gather::Inline,
            Some(false) => Gather::Thread,
        };
        let prefetcher = Prefetcher::start(raw, idx, batch_size, prefetch, drop_last, gather)
            .map_err(value_error)?;
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

    /// Whether the batches are gathered on the iterating thread (no prefetch thread runs).
    #[getter]
    fn inline(&self) -> bool {
        self.prefetcher.as_ref().is_some_and(Prefetcher::is_inline)
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
        } = match batch {
            Ok(batch) => batch,
            Err(e) => {
                // A batch that failed is spent: the prefetcher has moved past it, so a loop that skips bad batches
                // still ends. A stopped stream has none left.
                self.served = match e {
                    PrefetchError::Gather(_) => self.served + 1,
                    PrefetchError::Stopped => prefetcher.len(),
                    PrefetchError::Timeout(_) => self.served,
                };
                return Err(value_error(e));
            }
        };
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

    /// Time the consumer spent blocked waiting for a batch (inline: gathering it), time spent gathering, batches
    /// and rows served so far.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("wait_seconds", self.wait_seconds)?;
        d.set_item("gather_seconds", self.gather_seconds)?;
        d.set_item("batches", self.served)?;
        d.set_item("rows", self.rows_served)?;
        Ok(d)
    }
}
