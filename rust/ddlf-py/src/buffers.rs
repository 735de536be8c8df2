//! Moving bytes between Python and Rust.
//!
//! Received buffers become [`RecvBuffer`]s: Python objects that expose the received `Bytes` through the buffer
//! protocol, so `pickle.loads(..., buffers=...)` builds numpy arrays on the received memory without a copy.
//! Outgoing Python buffers (pickle protocol-5 `PickleBuffer`s, numpy arrays) are copied once into `Bytes`,
//! with the GIL released for large ones.

use std::ffi::c_int;

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use ddlf_core::shm_pool::{self, Lease, Pool};
use memmap2::MmapMut;
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyBufferError, PyValueError};
use pyo3::prelude::*;

/// Where received bytes live.
enum Data {
    /// A slice of a buffer shared with others (read-only).
    Bytes(Bytes),
    /// Memory this buffer alone owns (an assembled stream part): exported writable.
    Owned(BytesMut),
    /// A range of a private (copy-on-write) mapping of a shared-memory file: exported writable.
    Mapped(Arc<MmapMut>, usize, usize),
    /// A collective's result region in a host's shared mapping (`Ring.allreduce_shared_`, rewritten only by that
    /// ring's next call with the same tag): exported read-only, since every member of the host reads the same
    /// bytes.
    Shared(Arc<MmapMut>, usize, usize),
    /// A range of a pooled segment of the sender's (shared mapping): exported read-only; the sender may reuse
    /// the segment once every buffer of the transfer is dropped.
    Pooled(Arc<Lease>, usize, usize),
}

/// Read-only bytes received from a peer, shared with Python without a copy.
#[pyclass(frozen, module = "ddlf._ddlf")]
pub struct RecvBuffer {
    data: Data,
}

impl RecvBuffer {
    /// Received bytes: writable without a copy when nothing else shares them.
    pub fn new(data: Bytes) -> Self {
        let data = match data.try_into_mut() {
            Ok(owned) => Data::Owned(owned),
            Err(shared) => Data::Bytes(shared),
        };
        RecvBuffer { data }
    }

    pub fn pooled(lease: Arc<Lease>, start: usize, len: usize) -> Self {
        RecvBuffer {
            data: Data::Pooled(lease, start, len),
        }
    }

    /// A collective's result left in shared memory (read-only: the host's members share it).
    pub fn shared_result(map: Arc<MmapMut>, start: usize, len: usize) -> Self {
        RecvBuffer {
            data: Data::Shared(map, start, len),
        }
    }

    pub fn mapped(map: Arc<MmapMut>, start: usize, len: usize) -> Self {
        RecvBuffer {
            data: Data::Mapped(map, start, len),
        }
    }

    fn as_slice(&self) -> &[u8] {
        match &self.data {
            Data::Bytes(b) => b,
            Data::Owned(b) => b,
            Data::Mapped(m, s, n) | Data::Shared(m, s, n) => &m[*s..*s + *n],
            Data::Pooled(l, s, n) => &l.bytes()[*s..*s + *n],
        }
    }
}

#[pymethods]
impl RecvBuffer {
    fn __len__(&self) -> usize {
        self.as_slice().len()
    }

    fn __repr__(&self) -> String {
        let kind = match self.data {
            Data::Bytes(_) => "network, read-only",
            Data::Owned(_) => "network",
            Data::Mapped(..) => "shared memory",
            Data::Shared(..) => "a collective's result in shared memory, read-only",
            Data::Pooled(..) => "shared memory, read-only",
        };
        format!("<RecvBuffer {} bytes, {kind}>", self.as_slice().len())
    }

    /// # Safety
    /// Called by CPython with a valid `view`; the exported memory is owned by `slf`, which the view keeps alive.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let readonly = matches!(
            slf.get().data,
            Data::Bytes(_) | Data::Pooled(..) | Data::Shared(..)
        );
        if readonly && flags & pyo3::ffi::PyBUF_WRITABLE == pyo3::ffi::PyBUF_WRITABLE {
            return Err(PyBufferError::new_err(
                "this received buffer is shared and read-only; copy the array to get a writable one",
            ));
        }
        let (ptr, len) = {
            let data = slf.get().as_slice();
            (data.as_ptr(), data.len())
        };
        // SAFETY: `view` is the valid, writable `Py_buffer` CPython passes to `__getbuffer__`; `ptr` and `len`
        // describe memory `slf` owns (bytes, an owned buffer or a mapping held by an `Arc`), which stays put while
        // `slf` lives, and the view holds a reference to `slf` (its `obj`), so the memory outlives every export.
        // Writability was checked above: shared, pooled and collective-result memory is only ever exported
        // read-only.
        let rc = unsafe {
            pyo3::ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                ptr as *mut std::ffi::c_void,
                len as pyo3::ffi::Py_ssize_t,
                // Owned and privately mapped memory is this object's alone: Python may write to it (Rust never
                // reads it again), so received arrays are writable without a copy.
                readonly as std::ffi::c_int,
                flags,
            )
        };
        if rc == -1 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }
}

/// A Python buffer export: the exporter's memory stays valid and pinned for as long as this lives. Exported
/// once per outgoing value; copying, sharing and writing to shared memory all read through it.
pub struct Exported(PyUntypedBuffer);

impl AsRef<[u8]> for Exported {
    fn as_ref(&self) -> &[u8] {
        let n = self.0.len_bytes();
        if n == 0 {
            return &[];
        }
        // SAFETY: the export keeps the exporter's memory alive and pinned; it is C-contiguous (checked).
        unsafe { std::slice::from_raw_parts(self.0.buf_ptr() as *const u8, n) }
    }
}

/// Export Python buffer-protocol objects (pickle-5 `PickleBuffer`s, numpy arrays), C-contiguous only.
pub fn export(objs: &[Bound<'_, PyAny>]) -> PyResult<Vec<Exported>> {
    objs.iter()
        .map(|obj| {
            let buf = PyUntypedBuffer::get(obj)?;
            if !buf.is_c_contiguous() {
                return Err(PyValueError::new_err(
                    "out-of-band buffers must be C-contiguous",
                ));
            }
            Ok(Exported(buf))
        })
        .collect()
}

/// Total bytes of exported buffers.
pub fn total_bytes(bufs: &[impl AsRef<[u8]>]) -> usize {
    bufs.iter().map(|b| b.as_ref().len()).sum()
}

/// Above this size the copy runs with the GIL released.
const DETACH_COPY_BYTES: usize = 1 << 20;

/// Copy exported buffers into owned `Bytes`, one copy each (the worker's replies: its network thread must
/// never need the GIL to drop what it sends).
pub fn copy_buffers(py: Python<'_>, bufs: &[Exported]) -> Vec<Bytes> {
    let copy = || -> Vec<Bytes> {
        bufs.iter()
            .map(|b| Bytes::copy_from_slice(b.as_ref()))
            .collect()
    };
    if total_bytes(bufs) >= DETACH_COPY_BYTES {
        py.detach(copy)
    } else {
        copy()
    }
}

/// Share exported buffers as `Bytes` without copying: each keeps its export until the last slice is dropped
/// (which takes the GIL briefly to release it). For sends that finish before the calling thread runs more Python:
/// the master's calls, and a worker's reply written in place on a lane.
pub fn borrow_buffers(bufs: Vec<Exported>) -> Vec<Bytes> {
    bufs.into_iter().map(Bytes::from_owner).collect()
}

/// Wrap received buffers for Python.
pub fn to_recv_buffers(py: Python<'_>, bufs: Vec<Bytes>) -> PyResult<Vec<Py<RecvBuffer>>> {
    bufs.into_iter()
        .map(|b| Py::new(py, RecvBuffer::new(b)))
        .collect()
}

/// Received buffers of a value: inline bytes, a pooled segment of the sender's, or ranges of a one-off
/// shared-memory file (mapped, then unlinked: the mapping keeps the memory alive as long as any array uses it).
///
/// `unlink`: the receiver owns a one-off file (a reply); a broadcast request's file is removed by its sender once
/// every worker has answered. Pooled segments are never removed by a receiver.
pub fn value_buffers(
    py: Python<'_>,
    value: ddlf_proto::Value,
    unlink: bool,
) -> PyResult<Vec<Py<RecvBuffer>>> {
    match value.shm {
        None => to_recv_buffers(py, value.buffers),
        Some(r) if r.pooled => {
            let (lease, ranges) = py
                .detach(|| shm_pool::attach(&r.name, &r.offsets, &r.lengths))
                .map_err(|e| PyValueError::new_err(e.to_string()))?;
            let lease = Arc::new(lease);
            ranges
                .iter()
                .map(|&(s, n)| Py::new(py, RecvBuffer::pooled(lease.clone(), s, n)))
                .collect()
        }
        Some(r) => {
            let mapped = py.detach(|| ddlf_core::shm::map(&r.name, &r.offsets, &r.lengths));
            if unlink {
                ddlf_core::shm::unlink(&r.name);
            }
            let mapped = mapped.map_err(|e| PyValueError::new_err(e.to_string()))?;
            mapped
                .ranges
                .iter()
                .map(|&(s, n)| Py::new(py, RecvBuffer::mapped(mapped.map.clone(), s, n)))
                .collect()
        }
    }
}

/// Put buffers in shared memory for `readers` receivers (the policy is `ddlf_net::pool::write_shm`), with the
/// GIL released for the copy.
pub fn write_shm(
    py: Python<'_>,
    bufs: &[impl AsRef<[u8]> + Sync],
    readers: u64,
) -> Result<Option<ddlf_proto::ShmRef>, ddlf_core::shm::ShmError> {
    py.detach(|| ddlf_net::pool::write_shm(bufs, readers))
}

/// Remove this process's pooled shared-memory segments (at exit; receivers' mappings stay valid).
#[pyfunction]
pub fn release_shared_memory() {
    Pool::global().clear();
}

/// `(segments, bytes)` held in this process's shared-memory pool.
#[pyfunction]
pub fn shared_memory_usage() -> (usize, u64) {
    Pool::global().usage()
}
