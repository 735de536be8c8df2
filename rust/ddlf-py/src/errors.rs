//! Rust errors to the exception classes of `ddlf.errors` (defined in Python, so they carry attributes and
//! docstrings; this is the one place that maps to them).

use ddlf_net::NetError;
use ddlf_worker::DaemonError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Build (not raise) the `ddlf.errors` exception for a network error.
pub fn net_error_instance<'py>(
    py: Python<'py>,
    err: &NetError,
    worker_id: Option<usize>,
) -> PyResult<Bound<'py, PyAny>> {
    let module = py.import("ddlf.errors")?;
    let kwargs = PyDict::new(py);
    kwargs.set_item("address", err.address())?;
    kwargs.set_item("worker_id", worker_id)?;
    let class = match err {
        NetError::Unavailable { reason, .. } => {
            kwargs.set_item("reason", reason)?;
            "WorkerUnavailable"
        }
        NetError::DeadlineExceeded { after, .. } => {
            kwargs.set_item(
                "reason",
                format!("no answer within {:.3} s", after.as_secs_f64()),
            )?;
            "DeadlineExceeded"
        }
        NetError::Restarted { .. } => {
            kwargs.set_item("reason", "the daemon restarted")?;
            "WorkerRestarted"
        }
        NetError::Unauthenticated { .. } => "AuthenticationError",
        NetError::ProtocolMismatch { .. } | NetError::InvalidAddress { .. } => "ProtocolError",
        NetError::Rejected { code, .. } => {
            kwargs.set_item("code", code)?;
            "RequestRejected"
        }
    };
    module
        .getattr(class)?
        .call((err.to_string(),), Some(&kwargs))
}

/// The `ddlf.errors` exception for a network error, ready to raise.
pub fn net_error(py: Python<'_>, err: &NetError, worker_id: Option<usize>) -> PyErr {
    match net_error_instance(py, err, worker_id) {
        Ok(exc) => PyErr::from_value(exc),
        Err(e) => e,
    }
}

/// The exception for a daemon that cannot start.
pub fn daemon_error(py: Python<'_>, err: &DaemonError) -> PyErr {
    let class = match err {
        DaemonError::InsecureRefused { .. } => "InsecureConfiguration",
        _ => "WorkerStartError",
    };
    match py
        .import("ddlf.errors")
        .and_then(|m| m.getattr(class))
        .and_then(|c| c.call1((err.to_string(),)))
    {
        Ok(exc) => PyErr::from_value(exc),
        Err(e) => e,
    }
}
