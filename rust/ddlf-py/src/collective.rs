//! `Ring`: one worker's membership in a ring all-reduce (`ddlf_collective`), built from a `ddlf.ring_spec.RingSpec`
//! (read by [`PySpec`], whose checks are the only ones a spec gets), reducing numpy arrays with
//! the GIL released.
//!
//! The arrays are copied into one contiguous buffer, reduced, and copied back only when the reduction succeeded:
//! a failed all-reduce leaves every array as it was (training redoes the round from them).

use std::sync::Mutex;
use std::time::Duration;

use ddlf_collective::{
    Bf16Wire, Codec, CollectiveError, Elem, F16Wire, Op, Plain, Request, RingSpec,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::arrays::{DType, View};
use crate::buffers::RecvBuffer;
use crate::errors::{build, ErrorClass};

/// One rank of a ring all-reduce among workers. Links open on the first reduction and stay open for the next.
#[pyclass(module = "ddlf._ddlf", frozen)]
pub struct Ring {
    inner: Mutex<ddlf_collective::Ring>,
    rank: usize,
    size: usize,
}

/// `ddlf.ring_spec.RingSpec` (a frozen dataclass), read attribute by attribute: what one member needs to join a
/// ring. Its checks live here, once: [`PySpec::into_spec`] runs when the spec is made on the master
/// (`check_ring_spec`) and again when a worker builds its [`Ring`] from it.
#[derive(FromPyObject)]
pub struct PySpec {
    group: String,
    rank: usize,
    addresses: Vec<String>,
    streams: usize,
    timeout: f64,
    liveness: f64,
    tls_ca: Option<Vec<u8>>,
    tls_domain: Option<String>,
    local: Option<PyLocal>,
}

/// `ddlf.ring_spec.LocalRing`: a member's place among the members on its host (a hierarchical ring).
#[derive(FromPyObject)]
pub struct PyLocal {
    index: usize,
    addresses: Vec<String>,
    total: usize,
}

impl PySpec {
    /// The Rust spec, or why this one cannot form a ring.
    fn into_spec(self) -> PyResult<RingSpec> {
        let group = u128::from_str_radix(&self.group, 16).map_err(|_| {
            PyValueError::new_err(format!(
                "group must be 32 hex digits (a uuid4 hex), not {:?}",
                self.group
            ))
        })?;
        for (what, v) in [("timeout", self.timeout), ("liveness", self.liveness)] {
            if !(v.is_finite() && v >= 1.0) {
                return Err(PyValueError::new_err(format!(
                    "{what} must be at least 1 second, not {v}"
                )));
            }
        }
        if !(1..=16).contains(&self.streams) {
            return Err(PyValueError::new_err(format!(
                "streams must be 1 to 16, not {}",
                self.streams
            )));
        }
        if self.addresses.is_empty() || self.rank >= self.addresses.len() {
            return Err(PyValueError::new_err(format!(
                "rank {} of a ring of {} addresses: a ring needs at least one address and a rank among them",
                self.rank,
                self.addresses.len()
            )));
        }
        let tls = match self.tls_ca {
            Some(ca) => Some(
                ddlf_collective::PeerTls::new(&ca, self.tls_domain)
                    .map_err(PyValueError::new_err)?,
            ),
            None => None,
        };
        let local = match self.local {
            None => None,
            Some(l) if l.index < l.addresses.len() && l.total >= l.addresses.len() => {
                Some(ddlf_collective::LocalSpec {
                    index: l.index,
                    addresses: l.addresses,
                    total: l.total,
                })
            }
            Some(l) => {
                return Err(PyValueError::new_err(format!(
                "local member {} of {} on its host, {} in all: not a place in a hierarchical ring",
                l.index,
                l.addresses.len(),
                l.total
            )))
            }
        };
        Ok(RingSpec {
            group,
            rank: self.rank,
            addresses: self.addresses,
            streams: self.streams,
            timeout: Duration::from_secs_f64(self.timeout.min(1e9)),
            liveness: Duration::from_secs_f64(self.liveness.min(1e6)),
            tls,
            local,
        })
    }
}

/// This worker is stopping: its daemon answers ring links and liveness probes with "stopping" from now on, so
/// the ranks of a ring waiting on it fail at their next probe ([`ddlf_collective::peer::leave`]).
#[pyfunction]
pub fn leave_rings() {
    ddlf_collective::peer::leave();
}

/// Check a `ddlf.ring_spec.RingSpec` where it is made (the master), with the checks a worker's [`Ring`] makes.
#[pyfunction]
pub fn check_ring_spec(spec: PySpec) -> PyResult<()> {
    spec.into_spec().map(|_| ())
}

/// Check a reduction's `op` ("sum" or "mean") and `wire` (None, "float16" or "bfloat16"), as
/// [`Ring::allreduce_`] does.
#[pyfunction]
#[pyo3(signature = (op, wire = None))]
pub fn check_reduction(op: &str, wire: Option<&str>) -> PyResult<()> {
    parse_op(op)?;
    parse_wire(wire)?;
    Ok(())
}

fn parse_wire(wire: Option<&str>) -> PyResult<Wire> {
    match wire {
        None => Ok(Wire::Plain),
        Some("float16") => Ok(Wire::F16),
        Some("bfloat16") => Ok(Wire::Bf16),
        Some(other) => Err(PyValueError::new_err(format!(
            "wire must be None, 'float16' or 'bfloat16', not {other:?}"
        ))),
    }
}

fn parse_op(op: &str) -> PyResult<Op> {
    match op {
        "sum" => Ok(Op::Sum),
        "mean" => Ok(Op::Mean),
        other => Err(PyValueError::new_err(format!(
            "op must be 'sum' or 'mean', not {other:?}"
        ))),
    }
}

#[pymethods]
impl Ring {
    /// This worker's rank in the ring `spec` describes (a `ddlf.ring_spec.RingSpec`). Links open on the first
    /// reduction.
    #[new]
    fn new(spec: PySpec) -> PyResult<Self> {
        let spec = spec.into_spec()?;
        let rank = spec.rank;
        let size = spec
            .local
            .as_ref()
            .map_or(spec.addresses.len(), |l| l.total);
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
    /// (the default) the arrays are then unchanged. A list costs what one array of the same bytes does.
    /// `atomic=False` with one array reduces it where it lies on every ring, with no copy, and leaves its
    /// contents undefined after a failure (for scratch buffers). `wire`: "float16" or
    /// "bfloat16" sends float32 elements at half precision (sums stay float32; every rank ends with the same
    /// bits); every rank must pass the same `wire`. `out`: arrays (writable, the same dtype, as many elements in
    /// all, cut as the caller likes) that receive the result, `arrays` then only read (they may be read-only): on
    /// a host's shared memory this adds no copy, so a framework's gradient buffers go in and its update reads
    /// the result where it lands; after a failure `out` holds nothing meaningful.
    #[pyo3(signature = (arrays, op = "mean", atomic = true, wire = None, out = None))]
    fn allreduce_(
        &self,
        py: Python<'_>,
        arrays: Vec<Bound<'_, PyAny>>,
        op: &str,
        atomic: bool,
        wire: Option<&str>,
        out: Option<Vec<Bound<'_, PyAny>>>,
    ) -> PyResult<()> {
        let wire = parse_wire(wire)?;
        let op = parse_op(op)?;
        let (views, dtype) = float_views(&arrays, "allreduce", out.is_none())?;
        if wire != Wire::Plain && dtype != DType::F32 {
            return Err(PyTypeError::new_err(
                "allreduce: half precision on the wire is for float32 arrays (sums stay float32)",
            ));
        }
        if let Some(out) = out {
            let outs = out_views(&out, &views, dtype)?;
            let result = py.detach(|| {
                let mut ring = self.inner.lock().unwrap_or_else(|e| e.into_inner());
                match (dtype, wire) {
                    (DType::F64, _) => reduce_into::<f64, Plain>(&mut ring, &views, &outs, op),
                    (_, Wire::F16) => reduce_into::<f32, F16Wire>(&mut ring, &views, &outs, op),
                    (_, Wire::Bf16) => reduce_into::<f32, Bf16Wire>(&mut ring, &views, &outs, op),
                    (_, Wire::Plain) => reduce_into::<f32, Plain>(&mut ring, &views, &outs, op),
                }
            });
            return result.map_err(|e| collective_error(py, &e));
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

    /// Whether `allreduce_shared_` can leave a result in shared memory: one host holds every rank.
    #[getter]
    fn shares_results(&self) -> bool {
        let ring = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        ring.shares_results()
    }

    /// Reduce `arrays` (C-contiguous, all float32 or all float64; only read, so they may be read-only and may
    /// share memory) with the other ranks and return the result's bytes where the host's shared memory holds
    /// it: a read-only buffer (the host's members share it), cache-line aligned (`numpy.frombuffer` makes the
    /// flat array), with no copy out. Only where `shares_results`; tags from 1 (0 is every other call's). The memory is rewritten by the next call with the same `tag` (every rank
    /// passes the same; other calls use none): read the result before making it. Raises
    /// `ddlf.errors.CollectiveError` like `allreduce_`.
    #[pyo3(signature = (arrays, op = "mean", tag = 1))]
    fn allreduce_shared_(
        &self,
        py: Python<'_>,
        arrays: Vec<Bound<'_, PyAny>>,
        op: &str,
        tag: u32,
    ) -> PyResult<RecvBuffer> {
        let op = parse_op(op)?;
        let (views, dtype) = float_views(&arrays, "allreduce_shared", false)?;
        let result = py.detach(|| {
            let mut ring = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            match dtype {
                DType::F64 => {
                    let parts: Vec<&[f64]> = views.iter().map(|v| v.slice::<f64>()).collect();
                    ring.run(Request::allreduce_shared(&parts, op, tag))
                }
                _ => {
                    let parts: Vec<&[f32]> = views.iter().map(|v| v.slice::<f32>()).collect();
                    ring.run(Request::allreduce_shared(&parts, op, tag))
                }
            }
        });
        let shared = result.map_err(|e| collective_error(py, &e))?;
        Ok(RecvBuffer::shared_result(
            shared.map,
            shared.start,
            shared.len,
        ))
    }

    /// `(start, stop)`: the elements of an array of `len` this rank owns between `reduce_scatter_` and
    /// `allgather_` (disjoint across ranks, covering the array, the same on every call of that length).
    fn shard(&self, len: usize) -> (usize, usize) {
        let ring = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let r = ring.shard(len);
        (r.start, r.end)
    }

    /// The first half of an all-reduce, in place: afterwards `array[start:stop]` (this rank's `shard`, returned)
    /// holds the sum or mean over the ranks, and the rest of the array means nothing. One C-contiguous,
    /// writable float32 or float64 array; `wire` as for `allreduce_`. Raises `ddlf.errors.CollectiveError`
    /// (the array then undefined).
    #[pyo3(signature = (array, op = "mean", wire = None))]
    fn reduce_scatter_(
        &self,
        py: Python<'_>,
        array: Bound<'_, PyAny>,
        op: &str,
        wire: Option<&str>,
    ) -> PyResult<(usize, usize)> {
        let (view, wire) = half_view(&array, wire, "reduce_scatter")?;
        let op = parse_op(op)?;
        let result = py.detach(|| {
            let mut ring = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            match (view.dtype, wire) {
                (DType::F64, _) => ring.run(Request::reduce_scatter(view.slice_mut::<f64>(), op)),
                (_, Wire::F16) => ring
                    .run(Request::reduce_scatter(view.slice_mut::<f32>(), op).codec::<F16Wire>()),
                (_, Wire::Bf16) => ring
                    .run(Request::reduce_scatter(view.slice_mut::<f32>(), op).codec::<Bf16Wire>()),
                (_, Wire::Plain) => ring.run(Request::reduce_scatter(view.slice_mut::<f32>(), op)),
            }
        });
        let r = result.map_err(|e| collective_error(py, &e))?;
        Ok((r.start, r.end))
    }

    /// The second half of an all-reduce, in place: every rank passes `array` with its `shard` filled in and
    /// ends with every rank's shard. `wire`: each shard travels rounded to half precision (its owner keeps the
    /// rounded value too). Raises `ddlf.errors.CollectiveError` (the array then undefined).
    #[pyo3(signature = (array, wire = None))]
    fn allgather_(
        &self,
        py: Python<'_>,
        array: Bound<'_, PyAny>,
        wire: Option<&str>,
    ) -> PyResult<()> {
        let (view, wire) = half_view(&array, wire, "allgather")?;
        let result = py.detach(|| {
            let mut ring = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            match (view.dtype, wire) {
                (DType::F64, _) => ring.run(Request::allgather(view.slice_mut::<f64>())),
                (_, Wire::F16) => {
                    ring.run(Request::allgather(view.slice_mut::<f32>()).codec::<F16Wire>())
                }
                (_, Wire::Bf16) => {
                    ring.run(Request::allgather(view.slice_mut::<f32>()).codec::<Bf16Wire>())
                }
                (_, Wire::Plain) => ring.run(Request::allgather(view.slice_mut::<f32>())),
            }
        });
        result.map_err(|e| collective_error(py, &e))
    }
}

/// One writable float32 or float64 array for a half of the ring, and its wire type (checked).
fn half_view(array: &Bound<'_, PyAny>, wire: Option<&str>, what: &str) -> PyResult<(View, Wire)> {
    let wire = parse_wire(wire)?;
    let view = View::new(array, what)?;
    if !matches!(view.dtype, DType::F32 | DType::F64) {
        return Err(PyTypeError::new_err(format!(
            "{what}: the array is {}, not float32 or float64",
            name(view.dtype)
        )));
    }
    if view.readonly {
        return Err(PyValueError::new_err(format!(
            "{what}: the array is read-only"
        )));
    }
    if wire != Wire::Plain && view.dtype != DType::F32 {
        return Err(PyTypeError::new_err(format!(
            "{what}: half precision on the wire is for float32 arrays"
        )));
    }
    Ok((view, wire))
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

/// The arrays of a reduction, all float32 or all float64 (that dtype returned). `written`: reduced where they lie,
/// so each must be writable and share memory with no other; arrays only read may be read-only and overlap (a
/// framework may hand the same buffer twice).
fn float_views(
    arrays: &[Bound<'_, PyAny>],
    what: &str,
    written: bool,
) -> PyResult<(Vec<View>, DType)> {
    let views = arrays
        .iter()
        .map(|a| View::new(a, what))
        .collect::<PyResult<Vec<_>>>()?;
    let dtype = views.first().map_or(DType::F32, |v| v.dtype);
    for (i, v) in views.iter().enumerate() {
        if !matches!(v.dtype, DType::F32 | DType::F64) {
            return Err(PyTypeError::new_err(format!(
                "{what}: array {i} is not float32 or float64"
            )));
        }
        if v.dtype != dtype {
            return Err(PyTypeError::new_err(format!(
                "{what}: array {i} is {} and array 0 {}: pass one dtype (cast first), so every element is \
                 reduced at the same precision",
                name(v.dtype),
                name(dtype)
            )));
        }
        if written && v.readonly {
            return Err(PyValueError::new_err(format!(
                "{what}: array {i} is read-only"
            )));
        }
        if written && views[..i].iter().any(|w| v.overlaps(w)) {
            return Err(PyValueError::new_err(format!(
                "{what}: array {i} shares memory with an earlier array: pass distinct arrays"
            )));
        }
    }
    Ok((views, dtype))
}

/// The `out` arrays of `allreduce_`: writable, `dtype`, as many elements as `sources`, and sharing memory with
/// none of them nor with each other (the sources are read while the results are written; the sources may share
/// memory among themselves).
fn out_views(out: &[Bound<'_, PyAny>], sources: &[View], dtype: DType) -> PyResult<Vec<View>> {
    let outs = out
        .iter()
        .map(|a| View::new(a, "allreduce"))
        .collect::<PyResult<Vec<_>>>()?;
    for (i, v) in outs.iter().enumerate() {
        if v.dtype != dtype {
            return Err(PyTypeError::new_err(format!(
                "allreduce: out[{i}] is {} and the arrays {}: pass one dtype",
                name(v.dtype),
                name(dtype)
            )));
        }
        if v.readonly {
            return Err(PyValueError::new_err(format!(
                "allreduce: out[{i}] is read-only"
            )));
        }
        if outs[..i].iter().chain(sources).any(|w| v.overlaps(w)) {
            return Err(PyValueError::new_err(format!(
                "allreduce: out[{i}] shares memory with another array: pass distinct arrays"
            )));
        }
    }
    let (from, to) = (
        sources.iter().map(|v| v.len).sum::<usize>(),
        outs.iter().map(|v| v.len).sum::<usize>(),
    );
    if from != to {
        return Err(PyValueError::new_err(format!(
            "allreduce: out holds {to} elements and the arrays {from}: pass as many"
        )));
    }
    Ok(outs)
}

/// Reduce the arrays into the `out` arrays (checked by `out_views`), the arrays only read.
fn reduce_into<T: Elem + crate::arrays::Elem, C: Codec<T>>(
    ring: &mut ddlf_collective::Ring,
    views: &[View],
    outs: &[View],
    op: Op,
) -> Result<(), CollectiveError> {
    let parts: Vec<&[T]> = views.iter().map(|v| v.slice::<T>()).collect();
    let mut into: Vec<&mut [T]> = outs.iter().map(|v| v.slice_mut::<T>()).collect();
    ring.run(Request::allreduce_into(&parts, &mut into, op).codec::<C>())
}

/// Reduce the arrays in place. A hierarchical rank (or a ring of one) writes them only after the last step that can
/// fail, and takes a list as it takes one array: each goes into shared memory and the result back into it, with no
/// buffer in between. A flat ring's pass reads several arrays where they lie and writes the results into the buffer
/// it keeps, copied back on success; one array it reduces where it lies, unless `atomic` asks for it to be
/// unchanged after a failure (then through that buffer too, since a pass in place writes as it goes; see
/// [`Request::atomic`]).
fn reduce<T: Elem + crate::arrays::Elem, C: Codec<T>>(
    ring: &mut ddlf_collective::Ring,
    views: &[View],
    op: Op,
    atomic: bool,
) -> Result<(), CollectiveError> {
    let mut parts: Vec<&mut [T]> = views.iter().map(|v| v.slice_mut::<T>()).collect();
    ring.run(
        Request::allreduce_parts(&mut parts, op)
            .codec::<C>()
            .atomic(atomic),
    )
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
