//! Rust errors to `ddlf.errors` exceptions, by type.
//!
//! Every variant of each crate's error enum maps to an [`ErrorClass`] through an exhaustive `match` (a new
//! variant does not compile until it is mapped). The Python classes live in `ddlf.errors` (they carry attributes,
//! several bases and docstrings); its `_CLASSES` table maps each `ErrorClass` to its class, and a unit test checks
//! that the table is complete.

use ddlf_net::pool::PoolError;
use ddlf_net::NetError;
use ddlf_proto::ErrorKind;
use ddlf_worker::DaemonError;
use pyo3::exceptions::{PyIndexError, PyKeyboardInterrupt, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyDict;

/// The Python exception classes that Rust errors become (`ddlf.errors._CLASSES` maps each to its class).
#[pyclass(eq, eq_int, frozen, hash, module = "ddlf._ddlf")]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorClass {
    WorkerUnavailable,
    DeadlineExceeded,
    WorkerRestarted,
    AuthenticationError,
    ProtocolError,
    RequestRejected,
    RemoteError,
    NotFoundError,
    SerializationError,
    WorkerStartError,
    InsecureConfiguration,
    CollectiveError,
    MemoryBudgetExceeded,
}

static CLASSES: PyOnceLock<Py<PyDict>> = PyOnceLock::new();

/// Build (not raise) an exception of `class` with `message` and keyword attributes.
pub(crate) fn build<'py>(
    py: Python<'py>,
    class: ErrorClass,
    message: String,
    kwargs: &Bound<'py, PyDict>,
) -> PyResult<Bound<'py, PyAny>> {
    let table = CLASSES.get_or_try_init(py, || -> PyResult<Py<PyDict>> {
        let table = py.import("ddlf.errors")?.getattr("_CLASSES")?;
        Ok(table.cast_into::<PyDict>()?.unbind())
    })?;
    let cls = table.bind(py).get_item(class)?.ok_or_else(|| {
        PyRuntimeError::new_err(format!("ddlf.errors._CLASSES has no class for {class:?}"))
    })?;
    cls.call((message,), Some(kwargs))
}

/// The class and attributes for a network error.
fn classify<'py>(err: &NetError, kwargs: &Bound<'py, PyDict>) -> PyResult<ErrorClass> {
    Ok(match err {
        NetError::Unavailable { reason, .. } => {
            kwargs.set_item("reason", reason)?;
            ErrorClass::WorkerUnavailable
        }
        NetError::Interrupted { .. } => {
            kwargs.set_item("reason", "the call was interrupted")?;
            ErrorClass::WorkerUnavailable
        }
        NetError::DeadlineExceeded { after, .. } => {
            let reason = format!("no answer within {:.3} s", after.as_secs_f64());
            kwargs.set_item("reason", reason)?;
            ErrorClass::DeadlineExceeded
        }
        NetError::Restarted { .. } => {
            kwargs.set_item("reason", "the daemon restarted")?;
            ErrorClass::WorkerRestarted
        }
        NetError::Unauthenticated { .. } => ErrorClass::AuthenticationError,
        NetError::ProtocolMismatch { .. }
        | NetError::InvalidAddress { .. }
        | NetError::InvalidReply { .. } => ErrorClass::ProtocolError,
        NetError::Refused { refusal, .. } => {
            kwargs.set_item("code", ddlf_net::refusal::name(*refusal))?;
            ErrorClass::RequestRejected
        }
    })
}

/// Build (not raise) the `ddlf.errors` exception for a network error.
pub fn net_error_instance<'py>(
    py: Python<'py>,
    err: &NetError,
    worker_id: Option<usize>,
) -> PyResult<Bound<'py, PyAny>> {
    let kwargs = PyDict::new(py);
    kwargs.set_item("address", err.address())?;
    kwargs.set_item("worker_id", worker_id)?;
    let class = classify(err, &kwargs)?;
    build(py, class, err.to_string(), &kwargs)
}

/// What a worker said about a call it could not complete: the exception the master raises for it.
pub struct RemoteFailure<'a> {
    pub worker: usize,
    pub address: &'a str,
    pub name: &'a str,
    pub kind: ErrorKind,
    pub type_name: &'a str,
    pub message: &'a str,
    pub traceback: &'a str,
    pub request_id: u64,
}

/// Build (not raise) the exception for a call that a worker answered with an error.
pub fn remote_error_instance<'py>(
    py: Python<'py>,
    f: &RemoteFailure<'_>,
) -> PyResult<Bound<'py, PyAny>> {
    let kwargs = PyDict::new(py);
    kwargs.set_item("address", f.address)?;
    kwargs.set_item("worker_id", f.worker)?;
    let place = format!("worker {} ({})", f.worker, f.address);
    let (class, message) = match f.kind {
        ErrorKind::NotFound | ErrorKind::MissingFunction => {
            kwargs.set_item("name", f.name)?;
            (ErrorClass::NotFoundError, format!("{place}: {}", f.message))
        }
        ErrorKind::Serialization => (
            ErrorClass::SerializationError,
            format!("{place}: {}", f.message),
        ),
        ErrorKind::ResourceExhausted => (
            ErrorClass::MemoryBudgetExceeded,
            format!("{place}: {}", f.message),
        ),
        ErrorKind::User | ErrorKind::BadRequest | ErrorKind::None => {
            kwargs.set_item("remote_type", f.type_name)?;
            kwargs.set_item("remote_message", f.message)?;
            kwargs.set_item("remote_traceback", f.traceback)?;
            kwargs.set_item("request_id", f.request_id)?;
            let kind = f.kind.as_str_name().trim_start_matches("ERROR_KIND_");
            kwargs.set_item("kind", kind.to_ascii_lowercase())?;
            let message = format!("{place} raised {}: {}", f.type_name, f.message);
            (ErrorClass::RemoteError, message)
        }
    };
    build(py, class, message, &kwargs)
}

/// The `ddlf.errors` exception for a network error, ready to raise.
pub fn net_error(py: Python<'_>, err: &NetError, worker_id: Option<usize>) -> PyErr {
    match net_error_instance(py, err, worker_id) {
        Ok(exc) => PyErr::from_value(exc),
        Err(e) => e,
    }
}

/// The exception for a pool operation that failed as a whole; `interrupted` is what ended an interrupted wait.
pub fn pool_error(py: Python<'_>, err: PoolError, interrupted: Option<PyErr>) -> PyErr {
    match err {
        PoolError::NoWorkers | PoolError::ValueCount { .. } => {
            PyValueError::new_err(err.to_string())
        }
        PoolError::NoSuchWorker { .. } => PyIndexError::new_err(err.to_string()),
        PoolError::Connect { index, source } => net_error(py, &source, Some(index)),
        PoolError::Interrupted => {
            interrupted.unwrap_or_else(|| PyKeyboardInterrupt::new_err("interrupted"))
        }
        PoolError::Runtime(_) => PyRuntimeError::new_err(err.to_string()),
    }
}

/// The exception for a daemon that cannot start.
pub fn daemon_error(py: Python<'_>, err: &DaemonError) -> PyErr {
    let class = match err {
        DaemonError::InsecureRefused { .. } => ErrorClass::InsecureConfiguration,
        DaemonError::Bind { .. } | DaemonError::Runtime(_) | DaemonError::Tls(_) => {
            ErrorClass::WorkerStartError
        }
    };
    match build(py, class, err.to_string(), &PyDict::new(py)) {
        Ok(exc) => PyErr::from_value(exc),
        Err(e) => e,
    }
}
