//! `Client`: Python's handle on a [`ddlf_net::Pool`], and `Reply`, one worker's answer to a call.
//!
//! Only conversions live here: Python buffers to [`Outgoing`] values (borrowed, not copied), answers to `Reply`
//! objects and exceptions. The dispatch policy is the pool's; every wait goes through [`detached`].

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use ddlf_core::auth::Token;
use ddlf_net::pool::{Call, Outcome};
use ddlf_net::{Answer, ClientConfig, ClientTls, NetError, Outgoing, Pool, WorkerConn};
use ddlf_proto::{StacksReply, StatusReply};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::buffers::{borrow_buffers, export, value_buffers, RecvBuffer};
use crate::errors::{net_error_instance, remote_error_instance, RemoteFailure};
use crate::wait::detached;

fn seconds(s: Option<f64>) -> PyResult<Option<Duration>> {
    match s {
        None => Ok(None),
        Some(v) if v.is_finite() && v > 0.0 => Ok(Some(Duration::from_secs_f64(v))),
        Some(v) => Err(PyValueError::new_err(format!(
            "timeout must be a positive number of seconds, got {v}"
        ))),
    }
}

/// One worker's answer to a call: a value (`pickle` and `buffers`) or an `error` (an exception instance).
#[pyclass(frozen, module = "ddlf._ddlf")]
pub struct Reply {
    /// The worker's index.
    #[pyo3(get)]
    worker: usize,
    #[pyo3(get)]
    pickle: Option<Py<PyBytes>>,
    #[pyo3(get)]
    buffers: Vec<Py<RecvBuffer>>,
    /// The exception for this worker (remote, network or refusal), or None.
    #[pyo3(get)]
    error: Option<Py<PyAny>>,
    /// Seconds the worker's interpreter spent on the call.
    #[pyo3(get)]
    worker_seconds: f64,
    /// Seconds from sending the request to having the whole reply.
    #[pyo3(get)]
    call_seconds: f64,
    #[pyo3(get)]
    request_id: u64,
}

#[pymethods]
impl Reply {
    fn __repr__(&self) -> String {
        let what = if self.error.is_some() {
            "error"
        } else {
            "value"
        };
        format!(
            "<Reply worker={} {what} request_id={}>",
            self.worker, self.request_id
        )
    }
}

impl Reply {
    fn new(py: Python<'_>, a: Answer, address: &str, name: &str) -> PyResult<Self> {
        let (mut pickle, mut buffers, mut error) = (None, vec![], None);
        match a.outcome {
            Outcome::Reply(value) => {
                pickle = Some(PyBytes::new(py, &value.pickle).unbind());
                buffers = value_buffers(py, value, true)?;
            }
            Outcome::Remote {
                kind,
                type_name,
                message,
                traceback,
            } => {
                let f = RemoteFailure {
                    worker: a.worker,
                    address,
                    name,
                    kind,
                    type_name: &type_name,
                    message: &message,
                    traceback: &traceback,
                    request_id: a.request_id,
                };
                error = Some(remote_error_instance(py, &f)?.unbind());
            }
            Outcome::Failed(e) => {
                error = Some(net_error_instance(py, &e, Some(a.worker))?.unbind())
            }
        }
        Ok(Reply {
            worker: a.worker,
            pickle,
            buffers,
            error,
            worker_seconds: a.worker_seconds,
            call_seconds: a.call_seconds,
            request_id: a.request_id,
        })
    }
}

/// What a worker said about itself in its hello.
fn info_dict<'py>(py: Python<'py>, c: &WorkerConn) -> PyResult<Bound<'py, PyDict>> {
    let h = c.hello();
    let d = PyDict::new(py);
    d.set_item("address", c.address())?;
    d.set_item("version", &h.worker_version)?;
    d.set_item("protocol_version", h.protocol_version)?;
    d.set_item("name", &h.worker_name)?;
    d.set_item("pid", h.pid)?;
    d.set_item("hostname", &h.hostname)?;
    d.set_item("shared_memory", c.shared_memory())?;
    d.set_item("instance", h.instance)?;
    d.set_item("direct_lane", c.has_lane())?;
    d.set_item("ping_lane", c.has_ping_lane())?;
    Ok(d)
}

fn status_dict<'py>(py: Python<'py>, address: &str, s: StatusReply) -> PyResult<Bound<'py, PyAny>> {
    let d = PyDict::new(py);
    d.set_item("address", address)?;
    d.set_item("version", s.worker_version)?;
    d.set_item("hostname", s.hostname)?;
    d.set_item("pid", s.pid)?;
    d.set_item("uptime_s", s.uptime_ms as f64 / 1000.0)?;
    d.set_item("rss_bytes", s.rss_bytes)?;
    let running = (!s.running.is_empty()).then_some(s.running);
    d.set_item("running", running)?;
    d.set_item("running_for_s", s.running_for_ms as f64 / 1000.0)?;
    d.set_item("runs", s.runs)?;
    d.set_item("requests_served", s.requests_served)?;
    d.set_item("requests_rejected", s.requests_rejected)?;
    d.set_item("queue_depth", s.queue_depth)?;
    d.set_item("instance", s.instance)?;
    d.set_item("connections_open", s.connections_open)?;
    d.set_item("connections_refused", s.connections_refused)?;
    d.set_item("lane_pings", s.lane_pings)?;
    Ok(d.into_any())
}

fn stacks_dict<'py>(py: Python<'py>, address: &str, s: StacksReply) -> PyResult<Bound<'py, PyAny>> {
    let d = PyDict::new(py);
    d.set_item("address", address)?;
    d.set_item("name", s.name)?;
    d.set_item("hostname", s.hostname)?;
    d.set_item("pid", s.pid)?;
    d.set_item("python", (!s.python.is_empty()).then_some(s.python))?;
    d.set_item("error", (!s.error.is_empty()).then_some(s.error))?;
    d.set_item("running", (!s.running.is_empty()).then_some(s.running))?;
    d.set_item("running_for_s", s.running_for_ms as f64 / 1000.0)?;
    d.set_item("queue_depth", s.queue_depth)?;
    d.set_item("runs", s.runs)?;
    d.set_item("connections_open", s.connections_open)?;
    d.set_item("collectives", s.collectives)?;
    Ok(d.into_any())
}

/// Per target: the converted value, or the exception instance of a worker that did not answer.
fn per_target<T>(
    py: Python<'_>,
    targets: &[usize],
    results: Vec<Result<T, NetError>>,
    convert: impl Fn(Python<'_>, usize, T) -> PyResult<Py<PyAny>>,
) -> PyResult<Vec<Py<PyAny>>> {
    results
        .into_iter()
        .zip(targets)
        .map(|(r, &i)| match r {
            Ok(v) => convert(py, i, v),
            Err(e) => Ok(net_error_instance(py, &e, Some(i))?.unbind()),
        })
        .collect()
}

/// Connections to a list of worker daemons. Every method releases the GIL while it waits and is interruptible.
#[pyclass(frozen, module = "ddlf._ddlf")]
pub struct Client {
    pool: Arc<Pool>,
}

impl Client {
    fn outgoing(pickle: Bytes, buffers: &[Bound<'_, PyAny>]) -> PyResult<Outgoing> {
        Ok(Outgoing::new(pickle, borrow_buffers(export(buffers)?)))
    }

    #[allow(clippy::too_many_arguments)]
    fn call_values(
        &self,
        py: Python<'_>,
        targets: Vec<usize>,
        op: i32,
        name: String,
        digest: String,
        values: Vec<Outgoing>,
        which: Vec<usize>,
        timeout: Option<f64>,
    ) -> PyResult<Vec<Reply>> {
        let timeout = seconds(timeout)?;
        let call = Call { op, name, digest };
        let pool = &self.pool;
        let answers = detached(py, |interrupt| {
            pool.call(&targets, &call, values, &which, timeout, interrupt)
        })?;
        // Addresses name the workers in error messages: looked up only when a call failed somewhere.
        let failed = answers
            .iter()
            .any(|a| !matches!(a.outcome, Outcome::Reply(_)));
        let addresses: Vec<String> = match failed {
            true => {
                let conns = pool.connections();
                conns.iter().map(|c| c.address().to_string()).collect()
            }
            false => vec![],
        };
        answers
            .into_iter()
            .map(|a| {
                let address = addresses.get(a.worker).map_or("", String::as_str);
                Reply::new(py, a, address, &call.name)
            })
            .collect()
    }
}

#[pymethods]
impl Client {
    /// Connect to every address concurrently and check versions. Raises the first failure.
    #[new]
    #[pyo3(signature = (addresses, token = None, connect_timeout = 10.0, keepalive_interval = 5.0, keepalive_timeout = 10.0, shared_memory = false, tls_ca = None, tls_domain = None, direct_lane = true, lane_spin_us = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        addresses: Vec<String>,
        token: Option<String>,
        connect_timeout: f64,
        keepalive_interval: f64,
        keepalive_timeout: f64,
        shared_memory: bool,
        tls_ca: Option<&[u8]>,
        tls_domain: Option<String>,
        direct_lane: bool,
        lane_spin_us: Option<u64>,
    ) -> PyResult<Self> {
        let token = match token {
            Some(t) => Some(
                Token::new(t)
                    .ok_or_else(|| PyValueError::new_err("the token must not be empty"))?,
            ),
            None => None,
        };
        let config = ClientConfig {
            connect_timeout: seconds(Some(connect_timeout))?.unwrap_or_default(),
            keepalive_interval: seconds(Some(keepalive_interval))?.unwrap_or_default(),
            keepalive_timeout: seconds(Some(keepalive_timeout))?.unwrap_or_default(),
            token,
            shared_memory,
            tls: tls_ca.map(|ca| ClientTls {
                ca_pem: ca.to_vec(),
                domain: tls_domain,
            }),
            direct_lane,
            lane_spin: lane_spin_us
                .map(Duration::from_micros)
                .unwrap_or_else(ddlf_net::lane::default_spin),
            ..Default::default()
        };
        let pool = detached(py, |interrupt| Pool::connect(&addresses, config, interrupt))?;
        Ok(Client {
            pool: Arc::new(pool),
        })
    }

    /// The worker addresses, in worker order.
    #[getter]
    fn addresses(&self) -> Vec<String> {
        let conns = self.pool.connections();
        conns.iter().map(|c| c.address().to_string()).collect()
    }

    fn __len__(&self) -> usize {
        self.pool.len()
    }

    /// What each worker said about itself when last connected.
    fn worker_info<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let conns = self.pool.connections();
        conns.iter().map(|c| info_dict(py, c)).collect()
    }

    /// Replace worker `index`'s connection with a fresh one to the same address. Returns the worker's info.
    #[pyo3(signature = (index, timeout = None))]
    fn reconnect<'py>(
        &self,
        py: Python<'py>,
        index: usize,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let timeout = seconds(timeout)?;
        let pool = &self.pool;
        let conn = detached(py, |i| pool.reconnect(index, timeout, i))?;
        info_dict(py, &conn)
    }

    /// Connect to one more worker; it becomes the last one. Returns its index.
    #[pyo3(signature = (address, timeout = None))]
    fn add(&self, py: Python<'_>, address: String, timeout: Option<f64>) -> PyResult<usize> {
        let timeout = seconds(timeout)?;
        let pool = &self.pool;
        detached(py, |i| pool.add(address, timeout, i))
    }

    /// Drop worker `index`'s connection; the workers after it move down by one. Returns its address.
    fn remove(&self, py: Python<'_>, index: usize) -> PyResult<String> {
        let pool = &self.pool;
        detached(py, |_| pool.remove(index))
    }

    /// Run one operation on each target with the same value: the same bytes go to every worker concurrently.
    #[pyo3(signature = (targets, op, name, digest, pickle, buffers, timeout = None))]
    #[allow(clippy::too_many_arguments)]
    fn call(
        &self,
        py: Python<'_>,
        targets: Vec<usize>,
        op: i32,
        name: String,
        digest: String,
        pickle: &[u8],
        buffers: Vec<Bound<'_, PyAny>>,
        timeout: Option<f64>,
    ) -> PyResult<Vec<Reply>> {
        let value = Self::outgoing(Bytes::copy_from_slice(pickle), &buffers)?;
        let which = vec![0; targets.len()];
        self.call_values(py, targets, op, name, digest, vec![value], which, timeout)
    }

    /// Like `call`, with one `(pickle, buffers)` value per target.
    #[pyo3(signature = (targets, op, name, digest, values, timeout = None))]
    #[allow(clippy::too_many_arguments)]
    fn call_each(
        &self,
        py: Python<'_>,
        targets: Vec<usize>,
        op: i32,
        name: String,
        digest: String,
        values: Vec<(Vec<u8>, Vec<Bound<'_, PyAny>>)>,
        timeout: Option<f64>,
    ) -> PyResult<Vec<Reply>> {
        let values = values
            .into_iter()
            .map(|(p, b)| Self::outgoing(Bytes::from(p), &b))
            .collect::<PyResult<Vec<_>>>()?;
        let which = (0..values.len()).collect();
        self.call_values(py, targets, op, name, digest, values, which, timeout)
    }

    /// `(round-trip seconds, instance id)` per target, or an exception instance for a worker that did not
    /// answer. An instance id that differs from the one in `worker_info` means the daemon restarted.
    #[pyo3(signature = (targets, timeout = None))]
    fn heartbeat(
        &self,
        py: Python<'_>,
        targets: Vec<usize>,
        timeout: Option<f64>,
    ) -> PyResult<Vec<Py<PyAny>>> {
        let timeout = seconds(timeout)?;
        let pool = &self.pool;
        let results = detached(py, |i| pool.heartbeat(&targets, timeout, i))?;
        per_target(py, &targets, results, |py, _, (rtt, instance)| {
            Ok((rtt.as_secs_f64(), instance)
                .into_pyobject(py)?
                .into_any()
                .unbind())
        })
    }

    /// Status dict per target (or an exception instance).
    #[pyo3(signature = (targets, timeout = None))]
    fn status(
        &self,
        py: Python<'_>,
        targets: Vec<usize>,
        timeout: Option<f64>,
    ) -> PyResult<Vec<Py<PyAny>>> {
        let timeout = seconds(timeout)?;
        let pool = &self.pool;
        let results = detached(py, |i| pool.status(&targets, timeout, i))?;
        let addresses = self.addresses();
        per_target(py, &targets, results, |py, w, s| {
            let address = addresses.get(w).map_or("", String::as_str);
            Ok(status_dict(py, address, s)?.unbind())
        })
    }

    /// `(lines, dropped)` per target: the daemon's last `lines` log lines (0: all it keeps), oldest first, and
    /// how many lines fell out of its buffer; or an exception instance for a worker that did not answer.
    #[pyo3(signature = (targets, lines = 100, timeout = None))]
    fn logs(
        &self,
        py: Python<'_>,
        targets: Vec<usize>,
        lines: u32,
        timeout: Option<f64>,
    ) -> PyResult<Vec<Py<PyAny>>> {
        let timeout = seconds(timeout)?;
        let pool = &self.pool;
        let results = detached(py, |i| pool.logs(&targets, lines, timeout, i))?;
        per_target(py, &targets, results, |py, _, (lines, dropped)| {
            Ok((lines, dropped).into_pyobject(py)?.into_any().unbind())
        })
    }

    /// Stacks dict per target (or an exception instance): every Python thread's stack and what the
    /// interpreter thread serves, answered without the worker's interpreter.
    #[pyo3(signature = (targets, timeout = None))]
    fn stacks(
        &self,
        py: Python<'_>,
        targets: Vec<usize>,
        timeout: Option<f64>,
    ) -> PyResult<Vec<Py<PyAny>>> {
        let timeout = seconds(timeout)?;
        let pool = &self.pool;
        let results = detached(py, |i| pool.stacks(&targets, timeout, i))?;
        let addresses = self.addresses();
        per_target(py, &targets, results, |py, w, s| {
            let address = addresses.get(w).map_or("", String::as_str);
            Ok(stacks_dict(py, address, s)?.unbind())
        })
    }

    /// Ask each target daemon to exit. Returns None per target, or an exception instance.
    #[pyo3(signature = (targets, timeout = None))]
    fn shutdown(
        &self,
        py: Python<'_>,
        targets: Vec<usize>,
        timeout: Option<f64>,
    ) -> PyResult<Vec<Py<PyAny>>> {
        let timeout = seconds(timeout)?;
        let pool = &self.pool;
        let results = detached(py, |i| pool.shutdown(&targets, timeout, i))?;
        per_target(py, &targets, results, |py, _, ()| Ok(py.None()))
    }
}
