//! `Client`: the master's connections to its worker daemons.
//!
//! Every method releases the GIL while it waits, sends to many workers concurrently, and stays interruptible
//! with Ctrl-C. Per-worker outcomes come back as tuples that `ddlf.cluster` turns into values or exceptions, so a
//! failure of one worker never hides the answers of the others.

use std::future::Future;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use ddlf_core::auth::Token;
use ddlf_net::lane::{deadline_wait, fits_lane, LaneCall};
use ddlf_net::{ClientConfig, ClientTls, NetError, WorkerConn};
use ddlf_proto::{CallReply, CallRequest, ShmRef, Value};
use futures_util::future::join_all;
use pyo3::exceptions::{PyIndexError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::buffers::{
    borrow_buffers, export, total_bytes, value_buffers, write_shm, POOL_THRESHOLD,
};
use crate::errors::{net_error, net_error_instance};

/// Outcome codes of one worker's answer, as seen by `ddlf.cluster`.
const OK: u8 = 0;
const REMOTE_ERROR: u8 = 1;
const NET_ERROR: u8 = 2;

/// How often a waiting call checks for Ctrl-C.
const SIGNAL_POLL: Duration = Duration::from_millis(50);

/// Request ids, unique within this master process: the worker's log lines about a request carry its id, and
/// so does the error the master raises when the request fails.
static NEXT_REQUEST_ID: AtomicU64 = AtomicU64::new(1);

fn request(op: i32, name: &str, digest: &str, value: Value, reply_shm: bool) -> CallRequest {
    CallRequest {
        op,
        name: name.to_string(),
        digest: digest.to_string(),
        value: Some(value),
        request_id: NEXT_REQUEST_ID.fetch_add(1, Ordering::Relaxed),
        reply_shm,
        instance: 0, // set by the connection
    }
}

/// One value on its way out: its pickle and its buffers, exported from Python once and shared (not copied) by
/// every request that carries it; written to shared memory at most once.
struct Outgoing {
    pickle: Bytes,
    buffers: Vec<Bytes>,
    total: usize,
    shm: Option<ShmRef>,
    shm_failed: bool,
}

impl Outgoing {
    fn new(pickle: Bytes, buffers: &[Bound<'_, PyAny>]) -> PyResult<Self> {
        let buffers = borrow_buffers(export(buffers)?);
        Ok(Outgoing {
            total: total_bytes(&buffers),
            pickle,
            buffers,
            shm: None,
            shm_failed: false,
        })
    }

    /// The shared memory holding the buffers for `readers` workers, written on first use. None if there is no
    /// room or it cannot be written (a full or missing /dev/shm): the buffers then go over the socket.
    fn shared_memory(&mut self, py: Python<'_>, readers: u64) -> Option<ShmRef> {
        if self.shm.is_none() && !self.shm_failed {
            match write_shm(py, &self.buffers, readers) {
                Ok(Some(r)) => self.shm = Some(r),
                Ok(None) => self.shm_failed = true,
                Err(e) => {
                    tracing::warn!(error = %e, "shared memory unavailable: sending over the socket");
                    self.shm_failed = true;
                }
            }
        }
        self.shm.clone()
    }

    /// After the call: a one-off file is removed; a pooled segment stays in the pool unless a worker may not have
    /// taken it (`failed`), in which case it is retired rather than left waiting for that worker.
    fn finish(&self, failed: bool) {
        match &self.shm {
            Some(r) if !r.pooled => ddlf_core::shm::unlink(&r.name),
            Some(r) if failed => ddlf_core::shm_pool::Pool::global().retire(&r.name),
            _ => {}
        }
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
    Ok(d)
}

/// Chunk size of streamed values.
const CHUNK_BYTES: usize = 4 << 20;

/// Every call streams: request and reply of any size travel in chunks with bounded memory. Measured on
/// loopback, a streamed no-op call costs the same as a unary one (within noise: 90 vs 92 us).
async fn send(
    conn: &WorkerConn,
    req: CallRequest,
    timeout: Option<Duration>,
) -> Result<CallReply, NetError> {
    conn.call_stream(req, timeout, CHUNK_BYTES).await
}

/// One worker's answer to a call, with the seconds it took and the request's id.
struct Answer {
    result: Result<CallReply, NetError>,
    seconds: f64,
    id: u64,
}

impl Answer {
    /// The worker received the request's value (it answered, and not that the value was unreadable).
    fn took_value(&self) -> bool {
        self.result
            .as_ref()
            .is_ok_and(|r| r.error != ddlf_proto::ErrorKind::BadRequest as i32)
    }
}

/// Whether Ctrl-C arrived while waiting (checked at most once: the first error is kept in `slot`).
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

/// Connections to a list of worker daemons. Workers can be added, removed and reconnected (a daemon restarted
/// at the same address); the list is read under a lock and each call works on a snapshot of it.
#[pyclass(frozen, module = "ddlf._ddlf")]
pub struct Client {
    rt: tokio::runtime::Runtime,
    // Shared, not cloned per call: a call takes a snapshot of the list by bumping reference counts.
    conns: RwLock<Vec<Arc<WorkerConn>>>,
    config: ClientConfig,
}

fn seconds(s: Option<f64>) -> PyResult<Option<Duration>> {
    match s {
        None => Ok(None),
        Some(v) if v.is_finite() && v > 0.0 => Ok(Some(Duration::from_secs_f64(v))),
        Some(v) => Err(PyValueError::new_err(format!(
            "timeout must be a positive number of seconds, got {v}"
        ))),
    }
}

impl Client {
    /// Run `fut` on the client runtime with the GIL released, checking for Ctrl-C while it waits.
    fn wait<F>(&self, py: Python<'_>, fut: F) -> PyResult<F::Output>
    where
        F: Future + Send,
        F::Output: Send,
    {
        py.detach(|| {
            self.rt.block_on(async move {
                tokio::pin!(fut);
                loop {
                    tokio::select! {
                        out = &mut fut => return Ok(out),
                        _ = tokio::time::sleep(SIGNAL_POLL) => {
                            Python::attach(|py| py.check_signals())?;
                        }
                    }
                }
            })
        })
    }

    fn read(&self) -> RwLockReadGuard<'_, Vec<Arc<WorkerConn>>> {
        self.conns.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, Vec<Arc<WorkerConn>>> {
        self.conns.write().unwrap_or_else(|e| e.into_inner())
    }

    fn conns_for(&self, targets: &[usize]) -> PyResult<Vec<Arc<WorkerConn>>> {
        let conns = self.read();
        targets
            .iter()
            .map(|&i| {
                conns.get(i).cloned().ok_or_else(|| {
                    PyIndexError::new_err(format!(
                        "worker index {i} out of range: the cluster has {} workers",
                        conns.len()
                    ))
                })
            })
            .collect()
    }

    /// Connect to one address (a fresh connection: new handshake, new instance id).
    fn connect_one(
        &self,
        py: Python<'_>,
        address: String,
        timeout: Option<f64>,
    ) -> PyResult<Result<WorkerConn, NetError>> {
        let mut config = self.config.clone();
        if let Some(t) = seconds(timeout)? {
            config.connect_timeout = t;
        }
        self.wait(
            py,
            async move { WorkerConn::connect(&address, &config).await },
        )
    }

    /// Send one request per connection concurrently and wait for all answers; each with the seconds from
    /// sending to its complete reply (what the training report splits into computing and transfer).
    fn fan_out(
        &self,
        py: Python<'_>,
        conns: Vec<Arc<WorkerConn>>,
        requests: Vec<CallRequest>,
        timeout: Option<Duration>,
    ) -> PyResult<Vec<Answer>> {
        async fn timed(c: &WorkerConn, req: CallRequest, timeout: Option<Duration>) -> Answer {
            let id = req.request_id;
            let start = Instant::now();
            let result = send(c, req, timeout).await;
            Answer {
                result,
                seconds: start.elapsed().as_secs_f64(),
                id,
            }
        }
        if requests.iter().all(|r| fits_lane(r.value.as_ref())) {
            // Every target must have its lane free; otherwise the call goes over gRPC, all of it.
            let lanes: Vec<LaneCall<'_>> = conns.iter().map_while(|c| c.lane()).collect();
            if lanes.len() == conns.len() {
                return self.over_lanes(py, &conns, lanes, requests, timeout);
            }
        }
        self.wait(py, async move {
            let answers = if conns.len() == 1 {
                let req = requests.into_iter().next().unwrap_or_default();
                vec![timed(&conns[0], req, timeout).await]
            } else {
                join_all(
                    conns
                        .iter()
                        .zip(requests)
                        .map(|(c, req)| timed(c, req, timeout)),
                )
                .await
            };
            // A worker that answered is alive: a lane of its that broke earlier is worth opening again.
            for (c, a) in conns.iter().zip(&answers) {
                if a.result.is_ok() {
                    c.revive_lane().await;
                }
            }
            answers
        })
    }

    /// One call over the direct lanes of its targets, on this thread with the GIL released: every request is
    /// written, then every reply read. Waits wake every `MASTER_POLL` to check the deadline and for Ctrl-C, and
    /// every heartbeat interval ping the worker over gRPC (answered by its network thread even while its Python
    /// is busy), so a stopped or vanished worker is detected as the gRPC path's keepalive would.
    fn over_lanes(
        &self,
        py: Python<'_>,
        conns: &[Arc<WorkerConn>],
        mut lanes: Vec<LaneCall<'_>>,
        requests: Vec<CallRequest>,
        timeout: Option<Duration>,
    ) -> PyResult<Vec<Answer>> {
        let deadline = timeout.map(|t| (Instant::now() + t, t));
        let interrupted: Mutex<Option<PyErr>> = Mutex::new(None);
        let answers = py.detach(|| {
            let sent: Vec<_> = lanes
                .iter_mut()
                .zip(requests)
                .map(|(lane, req)| {
                    let (id, start) = (req.request_id, Instant::now());
                    let mut wait = deadline_wait(deadline, || signalled(&interrupted));
                    (id, start, lane.send(req, deadline, &mut wait))
                })
                .collect();
            lanes
                .iter_mut()
                .zip(conns)
                .zip(sent)
                .map(|((lane, conn), (id, start, sent))| {
                    let mut next_beat = Instant::now() + self.config.keepalive_interval;
                    let mut wait = deadline_wait(deadline, || {
                        signalled(&interrupted)?;
                        if Instant::now() >= next_beat {
                            self.alive(conn)?;
                            next_beat = Instant::now() + self.config.keepalive_interval;
                        }
                        Ok(())
                    });
                    Answer {
                        result: sent.and_then(|()| lane.receive(deadline, &mut wait)),
                        seconds: start.elapsed().as_secs_f64(),
                        id,
                    }
                })
                .collect::<Vec<_>>()
        });
        match interrupted.into_inner().unwrap_or_else(|e| e.into_inner()) {
            Some(e) => Err(e),
            None => Ok(answers),
        }
    }

    /// A heartbeat over gRPC within the keepalive timeout (called with the GIL released).
    fn alive(&self, conn: &WorkerConn) -> io::Result<()> {
        let t = self.config.keepalive_timeout;
        let aborted = |why: String| io::Error::new(io::ErrorKind::ConnectionAborted, why);
        match self.rt.block_on(conn.heartbeat(Some(t))) {
            Ok(_) => Ok(()),
            Err(NetError::DeadlineExceeded { .. }) => Err(aborted(format!(
                "no answer to a heartbeat within {:.1} s",
                t.as_secs_f64()
            ))),
            Err(e) => Err(aborted(format!("heartbeat failed: {e}"))),
        }
    }

    /// Send each target its value (`values[which[i]]` to target `i`). Large buffers for workers on this
    /// machine go through one shared-memory file per value, written once whatever the number of workers that
    /// map it; everyone else gets the buffers over the socket, borrowed from Python without a copy.
    #[allow(clippy::too_many_arguments)]
    fn call_values(
        &self,
        py: Python<'_>,
        targets: Vec<usize>,
        op: i32,
        name: String,
        digest: String,
        mut values: Vec<Outgoing>,
        which: Vec<usize>,
        timeout: Option<Duration>,
    ) -> PyResult<Vec<Py<PyAny>>> {
        let conns = self.conns_for(&targets)?;
        let via_shm =
            |conn: &WorkerConn, out: &Outgoing| conn.shared_memory() && out.total >= POOL_THRESHOLD;
        let mut readers = vec![0u64; values.len()];
        for (conn, &v) in conns.iter().zip(&which) {
            readers[v] += u64::from(via_shm(conn, &values[v]));
        }
        let mut requests = Vec::with_capacity(targets.len());
        for (conn, &v) in conns.iter().zip(&which) {
            let shm = if via_shm(conn, &values[v]) {
                values[v].shared_memory(py, readers[v])
            } else {
                None
            };
            let out = &values[v];
            let value = Value {
                pickle: out.pickle.clone(),
                buffers: if shm.is_some() {
                    vec![]
                } else {
                    out.buffers.clone()
                },
                shm,
            };
            requests.push(request(op, &name, &digest, value, conn.shared_memory()));
        }
        let results = self.fan_out(py, conns, requests, timeout);
        for (v, out) in values.iter().enumerate() {
            let failed = match &results {
                Err(_) => true, // interrupted: whether the workers took it is unknown
                Ok(answers) => answers
                    .iter()
                    .zip(&which)
                    .any(|(a, &w)| w == v && !a.took_value()),
            };
            out.finish(failed);
        }
        self.outcomes(py, &targets, results?)
    }

    /// Per target: `(status, a, b, worker_seconds, call_seconds, request_id)`.
    fn outcomes(
        &self,
        py: Python<'_>,
        targets: &[usize],
        answers: Vec<Answer>,
    ) -> PyResult<Vec<Py<PyAny>>> {
        answers
            .into_iter()
            .zip(targets)
            .map(|(answer, &id)| -> PyResult<Py<PyAny>> {
                let (seconds, request_id) = (answer.seconds, answer.id);
                let t = match answer.result {
                    Ok(reply) if reply.error == 0 => {
                        let value = reply.value.unwrap_or_default();
                        let pickle = PyBytes::new(py, &value.pickle);
                        let bufs = value_buffers(py, value, true)?;
                        (OK, pickle, bufs, reply.compute_seconds, seconds, request_id)
                            .into_pyobject(py)?
                    }
                    Ok(reply) => {
                        let e = reply.exception.unwrap_or_default();
                        (
                            REMOTE_ERROR,
                            reply.error,
                            (e.type_name, e.message, e.traceback),
                            reply.compute_seconds,
                            seconds,
                            request_id,
                        )
                            .into_pyobject(py)?
                    }
                    Err(e) => {
                        let exc = net_error_instance(py, &e, Some(id))?;
                        (NET_ERROR, exc, py.None(), 0.0f64, seconds, request_id)
                            .into_pyobject(py)?
                    }
                };
                Ok(t.into_any().unbind())
            })
            .collect()
    }

    fn simple<T, F, Fut>(
        &self,
        py: Python<'_>,
        targets: Vec<usize>,
        f: F,
        convert: impl Fn(Python<'_>, T) -> PyResult<Py<PyAny>>,
    ) -> PyResult<Vec<Py<PyAny>>>
    where
        T: Send,
        F: Fn(Arc<WorkerConn>) -> Fut + Send,
        Fut: Future<Output = Result<T, NetError>> + Send,
    {
        let conns = self.conns_for(&targets)?;
        let results = self.wait(py, async move { join_all(conns.into_iter().map(f)).await })?;
        results
            .into_iter()
            .zip(targets)
            .map(|(r, id)| match r {
                Ok(v) => convert(py, v),
                Err(e) => Ok(net_error_instance(py, &e, Some(id))?.unbind()),
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
        if addresses.is_empty() {
            return Err(PyValueError::new_err(
                "a cluster needs at least one worker address",
            ));
        }
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
        // The gRPC connections live on a runtime thread of their own, so they are serviced even while no call
        // is in flight: keepalive pings are answered and sent (the daemon drops a connection whose master stops
        // answering them; with small calls on the direct lanes, gRPC can sit unused for minutes). The calling
        // thread still polls its own call inside `block_on`; small calls skip this runtime altogether.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("ddlf-client")
            .enable_all()
            .build()
            .map_err(|e| PyValueError::new_err(format!("cannot start the client runtime: {e}")))?;
        let mut client = Client {
            rt,
            conns: RwLock::new(vec![]),
            config: config.clone(),
        };
        let results = client.wait(py, {
            let config = config.clone();
            let addresses = addresses.clone();
            async move { join_all(addresses.iter().map(|a| WorkerConn::connect(a, &config))).await }
        })?;
        let mut conns = Vec::with_capacity(results.len());
        for (i, r) in results.into_iter().enumerate() {
            match r {
                Ok(c) => conns.push(Arc::new(c)),
                Err(e) => return Err(net_error(py, &e, Some(i))),
            }
        }
        client.conns = RwLock::new(conns);
        Ok(client)
    }

    /// The worker addresses, in worker order.
    #[getter]
    fn addresses(&self) -> Vec<String> {
        self.read()
            .iter()
            .map(|c| c.address().to_string())
            .collect()
    }

    fn __len__(&self) -> usize {
        self.read().len()
    }

    /// What each worker said about itself when last connected.
    fn worker_info<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        self.read().iter().map(|c| info_dict(py, c)).collect()
    }

    /// Replace worker `index`'s connection with a fresh one to the same address (after its daemon restarted, or
    /// its link came back). Returns the worker's info; raises if it cannot be reached within `timeout`.
    #[pyo3(signature = (index, timeout = None))]
    fn reconnect<'py>(
        &self,
        py: Python<'py>,
        index: usize,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let address = self.conns_for(&[index])?[0].address().to_string();
        let conn = self
            .connect_one(py, address, timeout)?
            .map_err(|e| net_error(py, &e, Some(index)))?;
        let info = info_dict(py, &conn)?;
        let mut conns = self.write();
        if let Some(slot) = conns.get_mut(index) {
            *slot = Arc::new(conn);
        }
        Ok(info)
    }

    /// Connect to one more worker; it becomes the last one. Returns its index.
    #[pyo3(signature = (address, timeout = None))]
    fn add(&self, py: Python<'_>, address: String, timeout: Option<f64>) -> PyResult<usize> {
        let index = self.read().len();
        let conn = self
            .connect_one(py, address, timeout)?
            .map_err(|e| net_error(py, &e, Some(index)))?;
        let mut conns = self.write();
        conns.push(Arc::new(conn));
        Ok(conns.len() - 1)
    }

    /// Drop worker `index`'s connection; the workers after it move down by one. Returns its address.
    fn remove(&self, index: usize) -> PyResult<String> {
        let mut conns = self.write();
        if index >= conns.len() {
            return Err(PyIndexError::new_err(format!(
                "worker index {index} out of range: the cluster has {} workers",
                conns.len()
            )));
        }
        Ok(conns.remove(index).address().to_string())
    }

    /// Run one operation on each target with the same value: serialized once, the same bytes go to every
    /// worker concurrently. Returns one outcome tuple per target.
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
    ) -> PyResult<Vec<Py<PyAny>>> {
        let timeout = seconds(timeout)?;
        let value = Outgoing::new(Bytes::copy_from_slice(pickle), &buffers)?;
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
    ) -> PyResult<Vec<Py<PyAny>>> {
        if values.len() != targets.len() {
            return Err(PyValueError::new_err(format!(
                "{} values for {} workers",
                values.len(),
                targets.len()
            )));
        }
        let timeout = seconds(timeout)?;
        let values = values
            .into_iter()
            .map(|(p, b)| Outgoing::new(Bytes::from(p), &b))
            .collect::<PyResult<Vec<_>>>()?;
        let which = (0..targets.len()).collect();
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
        self.simple(
            py,
            targets,
            move |c| async move { c.heartbeat(timeout).await },
            |py, (d, instance): (Duration, u64)| {
                Ok((d.as_secs_f64(), instance)
                    .into_pyobject(py)?
                    .into_any()
                    .unbind())
            },
        )
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
        self.simple(
            py,
            targets,
            move |c| async move {
                c.status(timeout)
                    .await
                    .map(|s| (c.address().to_string(), s))
            },
            |py, (address, s)| {
                let d = PyDict::new(py);
                d.set_item("address", address)?;
                d.set_item("version", s.worker_version)?;
                d.set_item("hostname", s.hostname)?;
                d.set_item("pid", s.pid)?;
                d.set_item("uptime_s", s.uptime_ms as f64 / 1000.0)?;
                d.set_item("rss_bytes", s.rss_bytes)?;
                d.set_item(
                    "running",
                    if s.running.is_empty() {
                        None
                    } else {
                        Some(s.running)
                    },
                )?;
                d.set_item("running_for_s", s.running_for_ms as f64 / 1000.0)?;
                d.set_item("requests_served", s.requests_served)?;
                d.set_item("requests_rejected", s.requests_rejected)?;
                d.set_item("queue_depth", s.queue_depth)?;
                d.set_item("instance", s.instance)?;
                d.set_item("connections_open", s.connections_open)?;
                d.set_item("connections_refused", s.connections_refused)?;
                Ok(d.into_any().unbind())
            },
        )
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
        self.simple(
            py,
            targets,
            move |c| async move { c.logs(lines, timeout).await },
            |py, (lines, dropped): (Vec<String>, u64)| {
                Ok((lines, dropped).into_pyobject(py)?.into_any().unbind())
            },
        )
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
        self.simple(
            py,
            targets,
            move |c| async move { c.shutdown(timeout).await },
            |py, ()| Ok(py.None()),
        )
    }
}
