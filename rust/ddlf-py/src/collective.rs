//! `Ring`: one worker's membership in a ring all-reduce (`ddlf_collective`), reducing numpy arrays with
//! the GIL released.
//!
//! The arrays are copied into one contiguous buffer, reduced, and copied back only when the reduction succeeded:
//! a failed all-reduce leaves every array as it was (training redoes the round from them).

use std::sync::Mutex;
use std::time::Duration;

use ddlf_collective::{Bf16Wire, Codec, CollectiveError, Elem, F16Wire, Op, Plain, RingSpec};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::arrays::{DType, View};
use crate::errors::{build, ErrorClass};

/// One rank of a ring all-reduce among workers. Links open on the first reduction and stay open for the next.
#[pyclass(module = "ddlf._ddlf", frozen)]
pub struct Ring {
    inner: Mutex<ddlf_collective::Ring>,
    rank: usize,
    size: usize,
}

#[pymethods]
impl Ring {
    #[new]
    #[pyo3(signature = (group, rank, addresses, streams = 1, timeout = 300.0, liveness = 10.0, tls_ca = None, tls_domain = None, local_index = None, local_addresses = None, total = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        group: &str,
        rank: usize,
        addresses: Vec<String>,
        streams: usize,
        timeout: f64,
        liveness: f64,
        tls_ca: Option<&[u8]>,
        tls_domain: Option<String>,
        local_index: Option<usize>,
        local_addresses: Option<Vec<String>>,
        total: Option<usize>,
    ) -> PyResult<Self> {
        let group = u128::from_str_radix(group, 16).map_err(|_| {
            PyValueError::new_err(format!(
                "group must be 32 hex digits (a uuid4 hex), not {group:?}"
            ))
        })?;
        for (what, v) in [("timeout", timeout), ("liveness", liveness)] {
            if !(v.is_finite() && v >= 1.0) {
                return Err(PyValueError::new_err(format!(
                    "{what} must be at least 1 second, not {v}"
                )));
            }
        }
        let tls = match tls_ca {
            Some(ca) => {
                Some(ddlf_collective::PeerTls::new(ca, tls_domain).map_err(PyValueError::new_err)?)
            }
            None => None,
        };
        let local = match (local_index, local_addresses, total) {
            (None, None, None) => None,
            (Some(index), Some(addresses), Some(total)) => Some(ddlf_collective::LocalSpec {
                index,
                addresses,
                total,
            }),
            _ => {
                return Err(PyValueError::new_err(
                    "a hierarchical ring needs local_index, local_addresses and total together",
                ))
            }
        };
        let size = local.as_ref().map_or(addresses.len(), |l| l.total);
        let spec = RingSpec {
            group,
            rank,
            addresses,
            streams,
            timeout: Duration::from_secs_f64(timeout.min(1e9)),
            liveness: Duration::from_secs_f64(liveness.min(1e6)),
            tls,
            local,
        };
        let ring = ddlf_collective::Ring::new(spec, ddlf_collective::local_token().cloned())
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(Ring {
            inner: Mutex::new(ring),
            rank,
            size,
        })
    }

    /// This worker's rank.
    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }

    /// How many ranks the ring has.
    #[getter]
    fn size(&self) -> usize {
        self.size
    }

    /// Reduce `arrays` (C-contiguous, writable, all float32 or all float64) with the other ranks, in place.
    /// `op`: "sum" or "mean". Raises `ddlf.errors.CollectiveError` naming the neighbour at fault; with `atomic`
    /// (the default) the arrays are then unchanged. `atomic=False` with one array reduces it where it lies, with
    /// no copy, and leaves its contents undefined after a failure (for scratch buffers). `wire`: "float16" or
    /// "bfloat16" sends float32 elements at half precision (sums stay float32; every rank ends with the same
    /// bits); every rank must pass the same `wire`.
    #[pyo3(signature = (arrays, op = "mean", atomic = true, wire = None))]
    fn allreduce_(
        &self,
        py: Python<'_>,
        arrays: Vec<Bound<'_, PyAny>>,
        op: &str,
        atomic: bool,
        wire: Option<&str>,
    ) -> PyResult<()> {
        let wire = match wire {
            None => Wire::Plain,
            Some("float16") => Wire::F16,
            Some("bfloat16") => Wire::Bf16,
            Some(other) => {
                return Err(PyValueError::new_err(format!(
                    "wire must be None, 'float16' or 'bfloat16', not {other:?}"
                )))
            }
        };
        let op = match op {
            "sum" => Op::Sum,
            "mean" => Op::Mean,
            other => {
                return Err(PyValueError::new_err(format!(
                    "op must be 'sum' or 'mean', not {other:?}"
                )))
            }
        };
        let views = arrays
            .iter()
            .map(|a| View::new(a, "allreduce"))
            .collect::<PyResult<Vec<_>>>()?;
        let dtype = views.first().map_or(DType::F32, |v| v.dtype);
        for (i, v) in views.iter().enumerate() {
            if !matches!(v.dtype, DType::F32 | DType::F64) {
                return Err(PyTypeError::new_err(format!(
                    "allreduce: array {i} is not float32 or float64"
                )));
            }
            if v.dtype != dtype {
                return Err(PyTypeError::new_err(format!(
                    "allreduce: array {i} is {} and array 0 {}: pass one dtype (cast first), so every element \
                     is reduced at the same precision",
                    name(v.dtype),
                    name(dtype)
                )));
            }
            if v.readonly {
                return Err(PyValueError::new_err(format!(
                    "allreduce: array {i} is read-only"
                )));
            }
            if views[..i].iter().any(|w| v.overlaps(w)) {
                return Err(PyValueError::new_err(format!(
                    "allreduce: array {i} shares memory with an earlier array: pass distinct arrays"
                )));
            }
        }
        if wire != Wire::Plain && dtype != DType::F32 {
            return Err(PyTypeError::new_err(
                "allreduce: half precision on the wire is for float32 arrays (sums stay float32)",
            ));
        }
        let result = py.detach(|| {
            let mut ring = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            match (dtype, wire) {
                (DType::F64, _) => reduce::<f64, Plain>(&mut ring, &views, op, atomic),
                (_, Wire::F16) => reduce::<f32, F16Wire>(&mut ring, &views, op, atomic),
                (_, Wire::Bf16) => reduce::<f32, Bf16Wire>(&mut ring, &views, op, atomic),
                (_, Wire::Plain) => reduce::<f32, Plain>(&mut ring, &views, op, atomic),
            }
        });
        result.map_err(|e| collective_error(py, &e))
    }
}

fn name(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "float32",
        DType::F64 => "float64",
        DType::F16 => "float16",
        DType::Bf16 => "bfloat16",
        DType::U16 => "uint16",
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Wire {
    Plain,
    F16,
    Bf16,
}

/// Gather, reduce, scatter back (only on success); one array is reduced where it lies when `atomic` is off or
/// the ring leaves its data untouched on failure anyway (a hierarchical rank: two copies fewer).
fn reduce<T: Elem + crate::arrays::Elem, C: Codec<T>>(
    ring: &mut ddlf_collective::Ring,
    views: &[View],
    op: Op,
    atomic: bool,
) -> Result<(), CollectiveError> {
    if let ([one], false) = (views, atomic && !ring.leaves_data_on_failure()) {
        return ring.allreduce_over::<T, C>(one.slice_mut::<T>(), op);
    }
    let total = views.iter().map(|v| v.len).sum();
    let mut flat: Vec<T> = Vec::with_capacity(total);
    for v in views {
        flat.extend_from_slice(v.slice::<T>());
    }
    ring.allreduce_over::<T, C>(&mut flat, op)?;
    let mut at = 0;
    for v in views {
        v.slice_mut::<T>().copy_from_slice(&flat[at..at + v.len]);
        at += v.len;
    }
    Ok(())
}

fn collective_error(py: Python<'_>, err: &CollectiveError) -> PyErr {
    let kwargs = PyDict::new(py);
    let peer = match err {
        CollectiveError::Resolve { rank, address }
        | CollectiveError::Open { rank, address, .. }
        | CollectiveError::NoLink { rank, address, .. }
        | CollectiveError::Ring { rank, address, .. }
        | CollectiveError::Local { rank, address, .. } => Some((*rank, address.clone())),
        CollectiveError::Invalid(_) | CollectiveError::Spent(_) => None,
    };
    let built = kwargs
        .set_item("peer_rank", peer.as_ref().map(|p| p.0))
        .and_then(|_| kwargs.set_item("peer_address", peer.map(|p| p.1)))
        .and_then(|_| build(py, ErrorClass::CollectiveError, err.to_string(), &kwargs));
    match built {
        Ok(exc) => PyErr::from_value(exc),
        Err(e) => e,
    }
}
