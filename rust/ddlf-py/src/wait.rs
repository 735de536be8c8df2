//! The one way the bindings wait: with the GIL released, interruptible by Ctrl-C.
//!
//! Every blocking call of `Client` runs through [`detached`]: the closure runs without the GIL and gets an
//! [`Interrupt`] that takes the GIL briefly to ask Python whether a signal arrived (Python's own handler, so
//! Ctrl-C raises `KeyboardInterrupt` as it would in pure Python). The pool polls it while it waits.

use std::io;
use std::sync::Mutex;

use ddlf_net::pool::{Interrupt, PoolError};
use pyo3::prelude::*;

use crate::errors::pool_error;

/// Run `f` with the GIL released; a signal that arrives meanwhile is raised once `f` returns.
pub fn detached<T, F>(py: Python<'_>, f: F) -> PyResult<T>
where
    T: Send,
    F: for<'a> FnOnce(Interrupt<'a>) -> Result<T, PoolError> + Send,
{
    let slot: Mutex<Option<PyErr>> = Mutex::new(None);
    let check = || signalled(&slot);
    let result = py.detach(|| f(&check));
    let interrupted = slot.into_inner().unwrap_or_else(|e| e.into_inner());
    match (result, interrupted) {
        (Ok(v), None) => Ok(v),
        // A signal handler that raised wins, even if the call finished meanwhile.
        (Ok(_), Some(e)) => Err(e),
        (Err(e), interrupted) => Err(pool_error(py, e, interrupted)),
    }
}

/// Whether Ctrl-C (or any signal whose handler raises) arrived; the first error is kept in `slot`.
fn signalled(slot: &Mutex<Option<PyErr>>) -> io::Result<()> {
    let mut slot = slot.lock().unwrap_or_else(|e| e.into_inner());
    if slot.is_none() {
        if let Err(e) = Python::attach(|py| py.check_signals()) {
            *slot = Some(e);
        }
    }
    match *slot {
        Some(_) => Err(io::ErrorKind::Interrupted.into()),
        None => Ok(()),
    }
}
