//! `serve_worker`: run a worker daemon in this process. The network side runs on its own tokio threads; this
//! (the calling, main) thread becomes the interpreter thread that runs every job in request order, and releases
//! the GIL whenever it waits for the next one.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use ddlf_core::auth::Token;
use ddlf_net::{ServerConfig, ServerTls};
use ddlf_proto::{CallReply, CallRequest, ErrorKind, RemoteException, Value};
use ddlf_worker::state::WorkerState;
use ddlf_worker::{Daemon, DaemonConfig, Job, Next};
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use crate::buffers::{borrow_buffers, copy_buffers, export, total_bytes, value_buffers, write_shm};
use crate::errors::daemon_error;
use ddlf_net::pool::POOL_THRESHOLD;

/// The serving daemon, as its executor sees it: passed to `executor.on_listening(address, daemon)`, so the Python
/// side can report what the daemon's status requests answer without the interpreter (the runs it serves).
#[pyclass(module = "ddlf._ddlf", frozen)]
pub struct ServingDaemon {
    state: Arc<WorkerState>,
}

#[pymethods]
impl ServingDaemon {
    /// Replace the training runs this daemon reports in its status (`ddlf status`, `Cluster.status()`).
    fn set_runs(&self, runs: Vec<String>) {
        self.state.set_runs(runs);
    }

    /// The training runs this daemon reports.
    fn runs(&self) -> Vec<String> {
        self.state.runs()
    }

    /// Answer `Stacks` requests (`ddlf stacks`, `Cluster.stacks()`) by raising `signal`, on which Python's
    /// faulthandler is registered (all threads) to append to the file at `path`. Raises ValueError when the
    /// signal has no handler.
    fn set_stack_dumper(&self, signal: i32, path: std::path::PathBuf) -> PyResult<()> {
        self.state
            .stacks
            .install(ddlf_worker::stacks::StackDumper { signal, path })
            .map_err(|e| PyValueError::new_err(e.to_string()))
    }
}

/// How long the interpreter thread waits for a job before checking for signals (SIGINT/SIGTERM).
const IDLE_POLL: Duration = Duration::from_millis(100);

/// Serve worker requests until a shutdown request or a signal. `executor` is the Python object that runs the
/// operations (`ddlf._executor.Executor`): `executor.handle(op, name, digest, pickle, buffers)` returns
/// `(0, pickle, buffers)` or `(error_kind, (type_name, message, traceback))`.
/// `executor.on_listening(address, daemon)` is called once the port is bound, with a [`ServingDaemon`].
#[pyfunction]
#[pyo3(signature = (executor, listen, token = None, insecure = false, max_message_size = None, name = None, network_threads = 1, tls_cert = None, tls_key = None, max_connections = None, handshake_timeout = None, lane_spin_us = None, keepalive = None))]
#[allow(clippy::too_many_arguments)]
pub fn serve_worker(
    py: Python<'_>,
    executor: Bound<'_, PyAny>,
    listen: String,
    token: Option<String>,
    insecure: bool,
    max_message_size: Option<usize>,
    name: Option<String>,
    network_threads: usize,
    tls_cert: Option<&[u8]>,
    tls_key: Option<&[u8]>,
    max_connections: Option<u64>,
    handshake_timeout: Option<f64>,
    lane_spin_us: Option<u64>,
    keepalive: Option<(f64, f64)>,
) -> PyResult<()> {
    let token = match token {
        Some(t) => Some(Token::new(t).ok_or_else(|| PyValueError::new_err("the token is empty"))?),
        None => None,
    };
    let mut server = ServerConfig::default();
    if let Some(m) = max_message_size {
        server.max_message_size = m;
    }
    server.tls = match (tls_cert, tls_key) {
        (Some(cert), Some(key)) => Some(ServerTls {
            cert_pem: cert.to_vec(),
            key_pem: key.to_vec(),
        }),
        (None, None) => None,
        _ => {
            return Err(PyValueError::new_err(
                "TLS needs both a certificate and its key",
            ))
        }
    };
    if let Some(m) = max_connections {
        if m == 0 {
            return Err(PyValueError::new_err("max_connections must be at least 1"));
        }
        server.guard.max_connections = m;
    }
    if let Some(t) = handshake_timeout {
        if !(t.is_finite() && t > 0.0) {
            return Err(PyValueError::new_err(
                "handshake_timeout must be a positive number of seconds",
            ));
        }
        server.guard.handshake_timeout = Duration::from_secs_f64(t);
    }
    if let Some((interval, timeout)) = keepalive {
        for (what, v) in [("interval", interval), ("timeout", timeout)] {
            if !(v.is_finite() && v > 0.0) {
                return Err(PyValueError::new_err(format!(
                    "keepalive {what} must be a positive number of seconds"
                )));
            }
        }
        server.keepalive_interval = Duration::from_secs_f64(interval);
        server.keepalive_timeout = Duration::from_secs_f64(timeout);
    }
    let config = DaemonConfig {
        listen,
        token,
        insecure,
        server,
        name: name.unwrap_or_default(),
        runtime_threads: network_threads,
        lane_spin: lane_spin_us
            .map(Duration::from_micros)
            .unwrap_or_else(ddlf_net::lane::default_spin),
    };
    let (daemon, jobs) = py
        .detach(|| Daemon::start(config))
        .map_err(|e| daemon_error(py, &e))?;
    let stop = |daemon: Daemon| py.detach(|| daemon.stop(Duration::from_secs(2)));
    let serving = match Py::new(
        py,
        ServingDaemon {
            state: daemon.state().clone(),
        },
    ) {
        Ok(serving) => serving,
        Err(e) => {
            stop(daemon);
            return Err(e);
        }
    };
    if let Err(e) = executor.call_method1(
        intern!(py, "on_listening"),
        (daemon.local_addr().to_string(), serving),
    ) {
        stop(daemon);
        return Err(e);
    }
    loop {
        match py.detach(|| jobs.next(IDLE_POLL)) {
            Next::Idle => {
                if let Err(e) = py.check_signals() {
                    stop(daemon);
                    return Err(e);
                }
            }
            Next::Shutdown => break,
            Next::Job(job) => {
                if let Err(fatal) = run_job(py, &executor, job) {
                    // SystemExit / KeyboardInterrupt raised inside user code (a signal arrived): stop serving.
                    stop(daemon);
                    return Err(fatal);
                }
            }
        }
    }
    stop(daemon);
    Ok(())
}

fn remote_exception(kind: ErrorKind, type_name: &str, message: String) -> CallReply {
    CallReply {
        error: kind as i32,
        exception: Some(RemoteException {
            type_name: type_name.into(),
            message,
            traceback: String::new(),
        }),
        ..Default::default()
    }
}

/// Run one job on the executor and answer it. Returns Err only for exceptions that must stop the daemon.
fn run_job(py: Python<'_>, executor: &Bound<'_, PyAny>, mut job: Job) -> PyResult<()> {
    let queue_seconds = job.enqueued_at.elapsed().as_secs_f64();
    let start = Instant::now();
    // Lines logged while this job runs (Python `logging` records included) carry the request's id and op.
    let _span =
        tracing::info_span!("call", id = job.request.request_id, op = %job.label()).entered();
    let CallRequest {
        op,
        name,
        digest,
        value,
        reply_shm,
        ..
    } = std::mem::take(&mut job.request);
    let value = value.unwrap_or_default();
    let pickle = PyBytes::new(py, &value.pickle);
    let buffers = match value_buffers(py, value, false) {
        Ok(b) => b,
        Err(e) => {
            // The connect-time probe said we share /dev/shm with the master; the file is gone or unreadable now.
            respond(
                py,
                job,
                remote_exception(
                    ErrorKind::BadRequest,
                    "SharedMemoryUnavailable",
                    format!(
                        "cannot open the master's shared-memory file: {e} \
                     (connect with shared_memory=False to send everything over TCP)"
                    ),
                ),
            );
            return Ok(());
        }
    };
    let outcome = executor.call_method1(intern!(py, "handle"), (op, name, digest, pickle, buffers));
    let mut reply = match outcome {
        Ok(result) => match encode_result(py, &result, reply_shm, job.replies_in_place()) {
            Ok(reply) => reply,
            Err(e) => remote_exception(
                ErrorKind::Serialization,
                "SerializationError",
                format!("the worker could not encode its reply: {e}"),
            ),
        },
        Err(e) if !e.is_instance_of::<PyException>(py) => {
            let reply = remote_exception(
                ErrorKind::User,
                "WorkerStopping",
                format!("the worker is stopping: {e}"),
            );
            respond(py, job, reply);
            return Err(e);
        }
        // The executor catches user exceptions itself; anything reaching here is a bug in ddlf's own code.
        Err(e) => remote_exception(
            ErrorKind::User,
            "InternalError",
            format!("ddlf worker internal error: {e}"),
        ),
    };
    reply.compute_seconds = start.elapsed().as_secs_f64();
    reply.queue_seconds = queue_seconds;
    respond(py, job, reply);
    Ok(())
}

/// Answer `job` with the GIL released: a reply written to a lane may be large, and lent buffers are released
/// (briefly taking the GIL) only once written.
fn respond(py: Python<'_>, job: Job, reply: CallReply) {
    py.detach(|| job.respond(reply));
}

/// `(0, pickle, buffers)` or `(kind, (type_name, message, traceback))` to a reply.
/// With `shm` (the master shares this machine), large buffers are written once into a segment of this worker's
/// shared-memory pool that the master maps (or a one-off file it removes). With `lend` (the reply is written
/// before this thread runs anything else) buffers going over the socket are lent, not copied.
fn encode_result(
    py: Python<'_>,
    result: &Bound<'_, PyAny>,
    shm: bool,
    lend: bool,
) -> PyResult<CallReply> {
    let tuple = result.cast::<PyTuple>()?;
    let kind: i32 = tuple.get_item(0)?.extract()?;
    if kind == 0 {
        let pickle: Vec<u8> = tuple.get_item(1)?.extract()?;
        let bufs = export(&tuple.get_item(2)?.extract::<Vec<Bound<'_, PyAny>>>()?)?;
        let mut value = Value {
            pickle: Bytes::from(pickle),
            ..Default::default()
        };
        if shm && total_bytes(&bufs) >= POOL_THRESHOLD {
            match write_shm(py, &bufs, 1) {
                Ok(r) => value.shm = r,
                // A full or missing /dev/shm is no reason to fail the call: the bytes go over the socket.
                Err(e) => {
                    tracing::warn!(error = %e, "shared memory unavailable for a reply: sending it inline")
                }
            }
        }
        if value.shm.is_none() {
            value.buffers = if lend {
                borrow_buffers(bufs)
            } else {
                copy_buffers(py, &bufs)
            };
        }
        return Ok(CallReply {
            value: Some(value),
            ..Default::default()
        });
    }
    let (type_name, message, traceback): (String, String, String) = tuple.get_item(1)?.extract()?;
    Ok(CallReply {
        error: kind,
        exception: Some(RemoteException {
            type_name,
            message,
            traceback,
        }),
        ..Default::default()
    })
}
