//! Moving bytes between Python and Rust.
//!
//! Received buffers become [`RecvBuffer`]s: Python objects that expose the received `Bytes` through the buffer
//! protocol, so `pickle.loads(..., buffers=...)` builds numpy arrays on the received memory without a copy.
//! Outgoing Python buffers (pickle protocol-5 `PickleBuffer`s, numpy arrays) are copied once into `Bytes`,
//! with the GIL released for large ones.

use std::ffi::c_int;

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
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

    pub fn mapped(map: Arc<MmapMut>, start: usize, len: usize) -> Self {
        RecvBuffer {
            data: Data::Mapped(map, start, len),
        }
    }

    fn as_slice(&self) -> &[u8] {
        match &self.data {
            Data::Bytes(b) => b,
            Data::Owned(b) => b,
            Data::Mapped(m, s, n) => &m[*s..*s + *n],
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
        let readonly = matches!(slf.get().data, Data::Bytes(_));
        if readonly && flags & pyo3::ffi::PyBUF_WRITABLE == pyo3::ffi::PyBUF_WRITABLE {
            return Err(PyBufferError::new_err(
                "this received buffer is shared and read-only; copy the array to get a writable one",
            ));
        }
        let (ptr, len) = {
            let data = slf.get().as_slice();
            (data.as_ptr(), data.len())
        };
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

/// A raw pointer that may cross into a GIL-free section. The buffer it points into is pinned by a live
/// `PyUntypedBuffer` for the whole section.
struct SendPtr(*const u8, usize);
unsafe impl Send for SendPtr {}

/// Above this size the copy runs with the GIL released.
const DETACH_COPY_BYTES: usize = 1 << 20;

/// Copy Python buffer-protocol objects (C-contiguous) into owned `Bytes`, one copy each.
pub fn copy_buffers(py: Python<'_>, objs: &[Bound<'_, PyAny>]) -> PyResult<Vec<Bytes>> {
    let mut held = Vec::with_capacity(objs.len());
    let mut total = 0usize;
    for obj in objs {
        let buf = PyUntypedBuffer::get(obj)?;
        if !buf.is_c_contiguous() {
            return Err(PyValueError::new_err(
                "out-of-band buffers must be C-contiguous",
            ));
        }
        total += buf.len_bytes();
        held.push(buf);
    }
    let ptrs: Vec<SendPtr> = held
        .iter()
        .map(|b| SendPtr(b.buf_ptr() as *const u8, b.len_bytes()))
        .collect();
    let copy = move || -> Vec<Bytes> {
        ptrs.into_iter()
            .map(|SendPtr(p, n)| {
                if n == 0 {
                    return Bytes::new();
                }
                // SAFETY: `held` keeps every exporter alive and its memory pinned until after this returns.
                Bytes::copy_from_slice(unsafe { std::slice::from_raw_parts(p, n) })
            })
            .collect()
    };
    let out = if total >= DETACH_COPY_BYTES {
        py.detach(copy)
    } else {
        copy()
    };
    drop(held);
    Ok(out)
}

/// A Python buffer that owns its export: the memory stays valid (and pinned) for as long as this lives.
struct Exported(PyUntypedBuffer);

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

/// Share Python buffer-protocol objects (C-contiguous) with Rust without copying: the `Bytes` keep the
/// buffer exported until the last slice is dropped (which takes the GIL briefly to release it). For the
/// master only: on a worker, dropping on the network thread would make it wait for the GIL.
pub fn borrow_buffers(objs: &[Bound<'_, PyAny>]) -> PyResult<Vec<Bytes>> {
    objs.iter()
        .map(|obj| {
            let buf = PyUntypedBuffer::get(obj)?;
            if !buf.is_c_contiguous() {
                return Err(PyValueError::new_err(
                    "out-of-band buffers must be C-contiguous",
                ));
            }
            Ok(Bytes::from_owner(Exported(buf)))
        })
        .collect()
}

/// Buffers at least this large (in total) go through shared memory between processes on one machine. Below
/// it, creating and freeing a file costs more than the socket (measured: 4 MB took 5.8 ms vs 3.7 ms over TCP).
pub const SHM_THRESHOLD: usize = 32 << 20;

/// Wrap received buffers for Python.
pub fn to_recv_buffers(py: Python<'_>, bufs: Vec<Bytes>) -> PyResult<Vec<Py<RecvBuffer>>> {
    bufs.into_iter()
        .map(|b| Py::new(py, RecvBuffer::new(b)))
        .collect()
}

/// Received buffers of a value: inline bytes, or ranges of a shared-memory file (mapped, then unlinked: the
/// mapping keeps the memory alive as long as any array uses it).
///
/// `unlink`: the receiver owns the file (a reply); a broadcast request's file is removed by its sender once every
/// worker has answered.
pub fn value_buffers(
    py: Python<'_>,
    value: ddlf_proto::Value,
    unlink: bool,
) -> PyResult<Vec<Py<RecvBuffer>>> {
    match value.shm {
        None => to_recv_buffers(py, value.buffers),
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

/// Write Python buffers into a new shared-memory file (one copy, GIL released).
pub fn write_shm(py: Python<'_>, objs: &[Bound<'_, PyAny>]) -> PyResult<ddlf_core::shm::Layout> {
    let held: Vec<PyUntypedBuffer> = objs
        .iter()
        .map(|o| {
            let b = PyUntypedBuffer::get(o)?;
            if !b.is_c_contiguous() {
                return Err(PyValueError::new_err(
                    "out-of-band buffers must be C-contiguous",
                ));
            }
            Ok(b)
        })
        .collect::<PyResult<_>>()?;
    let ptrs: Vec<SendPtr> = held
        .iter()
        .map(|b| SendPtr(b.buf_ptr() as *const u8, b.len_bytes()))
        .collect();
    let layout = py.detach(move || {
        let slices: Vec<&[u8]> = ptrs
            .iter()
            .map(|SendPtr(p, n)| {
                if *n == 0 {
                    &[][..]
                } else {
                    // SAFETY: `held` pins every exporter's memory until this returns.
                    unsafe { std::slice::from_raw_parts(*p, *n) }
                }
            })
            .collect();
        ddlf_core::shm::write(&slices)
    });
    drop(held);
    layout.map_err(|e| PyValueError::new_err(e.to_string()))
}

/// Total bytes of Python buffers (0 for objects that export none).
pub fn total_bytes(objs: &[Bound<'_, PyAny>]) -> usize {
    objs.iter()
        .filter_map(|o| PyUntypedBuffer::get(o).ok())
        .map(|b| b.len_bytes())
        .sum()
}
