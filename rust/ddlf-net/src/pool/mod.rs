//! [`Pool`]: the master's connections to its workers, and the dispatch policy of every call.
//!
//! A call goes to many workers at once and comes back as one typed [`Answer`] per worker, so a failure of one
//! worker never hides the answers of the others. The pool decides, per call:
//!
//! * **the path**: requests of any size ride the direct lanes when every target's lane is free (the calling
//!   thread writes and reads the frames itself, or a thread per lane for large ones, so they overlap); anything
//!   else (a lane busy or broken, TLS daemons) goes over gRPC on the pool's runtime. Lanes write buffers from
//!   where they lie and read them into their final allocation: 100 MB took 0.39x the time it takes over gRPC's
//!   chunked stream (`BENCHMARKS.md`, *Tensor data plane*);
//! * **shared memory**: a large value for workers on this machine is written once into a pooled segment that
//!   they all map (see [`outgoing`]); a segment a worker may not have taken is retired;
//! * **liveness**: a wait on a lane pings the worker over gRPC every keepalive interval, so a stopped worker is
//!   declared lost as the gRPC path's keepalive would;
//! * **request ids**, unique in this process, and **lane revival** once a worker answers over gRPC again.
//!
//! Waits never hold a lock the caller cares about and poll an [`Interrupt`] (Ctrl-C in the Python bindings)
//! every [`INTERRUPT_POLL`].

pub mod outgoing;

use std::future::Future;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::RecvTimeoutError;
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use ddlf_proto::{CallReply, CallRequest, ErrorKind, StatusReply, Value};
use futures_util::future::join_all;

pub use outgoing::{write_shm, Outgoing, POOL_THRESHOLD, SHM_THRESHOLD};

use crate::client::{ClientConfig, WorkerConn};
use crate::error::NetError;
use crate::lane::{deadline_wait, value_bytes, LaneCall, MASTER_POLL};

/// Lane requests of at least this many bytes (all targets together) go out on a thread per lane, so the copies
/// overlap; smaller ones are written one after another by the calling thread (a thread costs more than they do).
pub const LANES_AT_ONCE_BYTES: usize = 1 << 20;

/// Tasks of one call, aborted if the call is dropped before they finish.
struct AbortOnDrop<T>(Vec<tokio::task::JoinHandle<T>>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}

/// How often a waiting call checks its [`Interrupt`].
pub const INTERRUPT_POLL: Duration = Duration::from_millis(50);

/// Checked while a call waits, without any lock held: an error ends the wait ([`PoolError::Interrupted`]).
pub type Interrupt<'a> = &'a (dyn Fn() -> io::Result<()> + Sync);

/// An [`Interrupt`] that never interrupts (`&never`).
pub fn never() -> io::Result<()> {
    Ok(())
}

/// Request ids, unique within this process: the worker's log lines about a request carry its id, and so does
/// the error the master raises when the request fails.
static NEXT_REQUEST_ID: AtomicU64 = AtomicU64::new(1);

/// Per target: its result, or why it has none.
pub type PerWorker<T> = Vec<Result<T, NetError>>;

/// What went wrong with a pool operation as a whole (a worker's own failure is an [`Outcome::Failed`]).
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error("a cluster needs at least one worker address")]
    NoWorkers,
    #[error("worker index {index} out of range: the cluster has {len} workers")]
    NoSuchWorker { index: usize, len: usize },
    #[error("{values} values for {targets} workers")]
    ValueCount { values: usize, targets: usize },
    /// Connecting to worker `index` failed.
    #[error("{source}")]
    Connect {
        index: usize,
        #[source]
        source: NetError,
    },
    /// The caller's [`Interrupt`] ended the wait: whether the workers ran the request is unknown.
    #[error("interrupted")]
    Interrupted,
    #[error("cannot start the client runtime: {0}")]
    Runtime(io::Error),
}

/// What one worker made of a call.
#[derive(Debug)]
pub enum Outcome {
    /// It ran, and this is the result.
    Reply(Value),
    /// It ran and raised, or could not run it (unknown name, undecodable value): the worker keeps serving.
    Remote {
        kind: ErrorKind,
        type_name: String,
        message: String,
        traceback: String,
    },
    /// The request or its reply failed on the way (worker unreachable, deadline, refusal).
    Failed(NetError),
}

/// One worker's answer to a call.
#[derive(Debug)]
pub struct Answer {
    /// The worker's index in the pool.
    pub worker: usize,
    pub outcome: Outcome,
    /// Seconds the worker's interpreter spent on it (0 when it did not answer).
    pub worker_seconds: f64,
    /// Seconds from sending the request to having the whole reply.
    pub call_seconds: f64,
    pub request_id: u64,
}

impl Answer {
    fn new(worker: usize, result: Result<CallReply, NetError>, seconds: f64, id: u64) -> Self {
        let (outcome, worker_seconds) = match result {
            Ok(reply) => {
                let s = reply.compute_seconds;
                match ErrorKind::try_from(reply.error).unwrap_or(ErrorKind::User) {
                    ErrorKind::None => (Outcome::Reply(reply.value.unwrap_or_default()), s),
                    kind => {
                        let e = reply.exception.unwrap_or_default();
                        let remote = Outcome::Remote {
                            kind,
                            type_name: e.type_name,
                            message: e.message,
                            traceback: e.traceback,
                        };
                        (remote, s)
                    }
                }
            }
            Err(e) => (Outcome::Failed(e), 0.0),
        };
        Answer {
            worker,
            outcome,
            worker_seconds,
            call_seconds: seconds,
            request_id: id,
        }
    }

    /// The worker received the request's value (it answered, and not that the value was unreadable or that
    /// keeping it would pass the worker's memory budget).
    fn took_value(&self) -> bool {
        match &self.outcome {
            Outcome::Reply(_) => true,
            Outcome::Remote { kind, .. } => {
                !matches!(kind, ErrorKind::BadRequest | ErrorKind::ResourceExhausted)
            }
            Outcome::Failed(_) => false,
        }
    }
}

/// What a call asks of each worker.
#[derive(Clone, Debug)]
pub struct Call {
    /// The operation code (`ddlf_proto::Op`); a code the daemon does not know is refused by it, not here.
    pub op: i32,
    pub name: String,
    /// Content hash of the function the master expects `name` to be (run, add function).
    pub digest: String,
}

/// Connections to a list of worker daemons. Workers can be added, removed and reconnected (a daemon restarted
/// at the same address); the list is read under a lock and each call works on a snapshot of it.
pub struct Pool {
    rt: tokio::runtime::Runtime,
    // Shared, not cloned per call: a call takes a snapshot of the list by bumping reference counts.
    conns: RwLock<Vec<Arc<WorkerConn>>>,
    config: ClientConfig,
}

impl Pool {
    /// Connect to every address concurrently and check versions; the first failure is the error.
    pub fn connect(
        addresses: &[String],
        config: ClientConfig,
        interrupt: Interrupt<'_>,
    ) -> Result<Pool, PoolError> {
        if addresses.is_empty() {
            return Err(PoolError::NoWorkers);
        }
        // The gRPC connections live on a runtime thread of their own, so they are serviced even while no call
        // is in flight: keepalive pings are answered and sent (the daemon drops a connection whose master stops
        // answering them; with calls on the direct lanes, gRPC can sit unused for minutes). The calling
        // thread still polls its own call inside `block_on`; calls on the lanes skip this runtime altogether.
        // Calls to several workers run as tasks on it, one per worker: with one runtime thread, sending 100 MB to
        // two workers took twice as long as to one (each byte is framed, written and read back on that thread).
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(4));
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("ddlf-client")
            .enable_all()
            .build()
            .map_err(PoolError::Runtime)?;
        let pool = Pool {
            rt,
            conns: RwLock::new(vec![]),
            config,
        };
        let config = &pool.config;
        let results = pool.wait(
            join_all(addresses.iter().map(|a| WorkerConn::connect(a, config))),
            interrupt,
        )?;
        let mut conns = Vec::with_capacity(results.len());
        for (index, r) in results.into_iter().enumerate() {
            conns.push(Arc::new(
                r.map_err(|source| PoolError::Connect { index, source })?,
            ));
        }
        *pool.write() = conns;
        Ok(pool)
    }

    /// Run `fut` on the pool's runtime on this thread, checking `interrupt` every [`INTERRUPT_POLL`].
    pub fn wait<F: Future>(
        &self,
        fut: F,
        interrupt: Interrupt<'_>,
    ) -> Result<F::Output, PoolError> {
        self.rt.block_on(async move {
            tokio::pin!(fut);
            loop {
                tokio::select! {
                    out = &mut fut => return Ok(out),
                    _ = tokio::time::sleep(INTERRUPT_POLL) => {
                        interrupt().map_err(|_| PoolError::Interrupted)?;
                    }
                }
            }
        })
    }

    fn read(&self) -> RwLockReadGuard<'_, Vec<Arc<WorkerConn>>> {
        self.conns.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, Vec<Arc<WorkerConn>>> {
        self.conns.write().unwrap_or_else(|e| e.into_inner())
    }

    /// The number of workers.
    pub fn len(&self) -> usize {
        self.read().len()
    }

    /// Whether the pool has no workers (every one was removed).
    pub fn is_empty(&self) -> bool {
        self.read().is_empty()
    }

    /// The connections now, in worker order (a snapshot).
    pub fn connections(&self) -> Vec<Arc<WorkerConn>> {
        self.read().clone()
    }

    /// The connections to `targets`, in that order.
    pub fn targets(&self, targets: &[usize]) -> Result<Vec<Arc<WorkerConn>>, PoolError> {
        let conns = self.read();
        targets
            .iter()
            .map(|&index| {
                conns.get(index).cloned().ok_or(PoolError::NoSuchWorker {
                    index,
                    len: conns.len(),
                })
            })
            .collect()
    }

    fn connect_one(
        &self,
        address: String,
        index: usize,
        timeout: Option<Duration>,
        interrupt: Interrupt<'_>,
    ) -> Result<WorkerConn, PoolError> {
        let mut config = self.config.clone();
        if let Some(t) = timeout {
            config.connect_timeout = t;
        }
        self.wait(
            async move { WorkerConn::connect(&address, &config).await },
            interrupt,
        )?
        .map_err(|source| PoolError::Connect { index, source })
    }

    /// Replace worker `index`'s connection with a fresh one to the same address (after its daemon restarted, or
    /// its link came back). Returns the new connection.
    pub fn reconnect(
        &self,
        index: usize,
        timeout: Option<Duration>,
        interrupt: Interrupt<'_>,
    ) -> Result<Arc<WorkerConn>, PoolError> {
        let address = self.targets(&[index])?[0].address().to_string();
        let conn = Arc::new(self.connect_one(address, index, timeout, interrupt)?);
        if let Some(slot) = self.write().get_mut(index) {
            *slot = conn.clone();
        }
        Ok(conn)
    }

    /// Connect to one more worker; it becomes the last one. Returns its index.
    pub fn add(
        &self,
        address: String,
        timeout: Option<Duration>,
        interrupt: Interrupt<'_>,
    ) -> Result<usize, PoolError> {
        let index = self.len();
        let conn = self.connect_one(address, index, timeout, interrupt)?;
        let mut conns = self.write();
        conns.push(Arc::new(conn));
        Ok(conns.len() - 1)
    }

    /// Drop worker `index`'s connection; the workers after it move down by one. Returns its address.
    pub fn remove(&self, index: usize) -> Result<String, PoolError> {
        let mut conns = self.write();
        if index >= conns.len() {
            return Err(PoolError::NoSuchWorker {
                index,
                len: conns.len(),
            });
        }
        Ok(conns.remove(index).address().to_string())
    }

    /// Run `call` on each target: target `i` gets `values[which[i]]` (one value for all, serialized once, or
    /// one per target). Large buffers for workers on this machine go through shared memory written once per
    /// value whatever the number of workers that map it; everyone else gets them over the socket.
    pub fn call(
        &self,
        targets: &[usize],
        call: &Call,
        mut values: Vec<Outgoing>,
        which: &[usize],
        timeout: Option<Duration>,
        interrupt: Interrupt<'_>,
    ) -> Result<Vec<Answer>, PoolError> {
        if which.len() != targets.len() || which.iter().any(|&v| v >= values.len()) {
            return Err(PoolError::ValueCount {
                values: values.len(),
                targets: targets.len(),
            });
        }
        let conns = self.targets(targets)?;
        let via_shm = |conn: &WorkerConn, out: &Outgoing| conn.shared_memory() && out.wants_shm();
        let mut readers = vec![0u64; values.len()];
        for (conn, &v) in conns.iter().zip(which) {
            readers[v] += u64::from(via_shm(conn, &values[v]));
        }
        let requests: Vec<CallRequest> = conns
            .iter()
            .zip(which)
            .map(|(conn, &v)| {
                let shm_readers = via_shm(conn, &values[v]).then_some(readers[v]);
                CallRequest {
                    op: call.op,
                    name: call.name.clone(),
                    digest: call.digest.clone(),
                    value: Some(values[v].value(shm_readers)),
                    request_id: NEXT_REQUEST_ID.fetch_add(1, Ordering::Relaxed),
                    reply_shm: conn.shared_memory(),
                    instance: 0, // set by the connection
                }
            })
            .collect();
        let answers = self.fan_out(targets, &conns, requests, timeout, interrupt);
        for (v, out) in values.iter().enumerate() {
            let failed = match &answers {
                Err(_) => true, // interrupted: whether the workers took it is unknown
                Ok(answers) => answers
                    .iter()
                    .zip(which)
                    .any(|(a, &w)| w == v && !a.took_value()),
            };
            out.finish(failed);
        }
        answers
    }

    /// Send one request per connection concurrently and wait for every answer.
    fn fan_out(
        &self,
        targets: &[usize],
        conns: &[Arc<WorkerConn>],
        requests: Vec<CallRequest>,
        timeout: Option<Duration>,
        interrupt: Interrupt<'_>,
    ) -> Result<Vec<Answer>, PoolError> {
        // Every target must have its lane free; otherwise the call goes over gRPC, all of it.
        let lanes: Vec<LaneCall<'_>> = conns.iter().map_while(|c| c.lane()).collect();
        if lanes.len() == conns.len() {
            return self.over_lanes(targets, conns, lanes, requests, timeout, interrupt);
        }
        async fn timed(
            worker: usize,
            c: Arc<WorkerConn>,
            req: CallRequest,
            timeout: Option<Duration>,
        ) -> Answer {
            let id = req.request_id;
            let start = Instant::now();
            let result = c.call(req, timeout).await;
            Answer::new(worker, result, start.elapsed().as_secs_f64(), id)
        }
        // One task per worker, so the runtime's threads frame, write and read the workers' bytes at once. Dropped
        // unfinished (Ctrl-C), the guard aborts them, as dropping the futures did.
        let mut tasks = AbortOnDrop(
            targets
                .iter()
                .zip(conns)
                .zip(requests)
                .map(|((&w, c), req)| self.rt.spawn(timed(w, Arc::clone(c), req, timeout)))
                .collect(),
        );
        self.wait(
            async move {
                let joined = join_all(tasks.0.iter_mut()).await;
                let answers: Vec<Answer> = joined
                    .into_iter()
                    .zip(targets.iter().zip(conns))
                    .map(|(joined, (&worker, conn))| {
                        joined.unwrap_or_else(|e| {
                            let failed = Err(NetError::Unavailable {
                                address: conn.address().to_string(),
                                reason: format!("the call's task ended without an answer: {e}"),
                            });
                            Answer::new(worker, failed, 0.0, 0)
                        })
                    })
                    .collect();
                // A worker that answered is alive: a lane of its that broke earlier is worth opening again.
                for (c, a) in conns.iter().zip(&answers) {
                    if !matches!(a.outcome, Outcome::Failed(_)) {
                        c.revive_lane().await;
                    }
                }
                answers
            },
            interrupt,
        )
    }

    /// One call over the direct lanes of its targets, on this thread: every request is written, then every reply
    /// read. Waits wake every `MASTER_POLL` to check the deadline and the interrupt, and every heartbeat interval
    /// ping the worker over gRPC (answered by its network thread even while its Python is busy).
    fn over_lanes(
        &self,
        targets: &[usize],
        conns: &[Arc<WorkerConn>],
        mut lanes: Vec<LaneCall<'_>>,
        requests: Vec<CallRequest>,
        timeout: Option<Duration>,
        interrupt: Interrupt<'_>,
    ) -> Result<Vec<Answer>, PoolError> {
        let deadline = timeout.map(|t| (Instant::now() + t, t));
        let bytes: usize = requests.iter().map(|r| value_bytes(r.value.as_ref())).sum();
        if lanes.len() > 1 && bytes >= LANES_AT_ONCE_BYTES {
            return self.over_lanes_at_once(targets, conns, lanes, requests, deadline, interrupt);
        }
        let mut interrupted = false;
        let check = |interrupted: &mut bool| -> io::Result<()> {
            if !*interrupted && interrupt().is_err() {
                *interrupted = true;
            }
            match interrupted {
                true => Err(io::ErrorKind::Interrupted.into()),
                false => Ok(()),
            }
        };
        // Every worker still owing a reply is pinged each heartbeat interval, whichever request is being written
        // or reply read: a stopped worker is found within interval + timeout of the call, not after the workers
        // before it answer, and a request that fills the socket of a stopped worker does not wait forever.
        let mut beats = Beats::new(lanes.len(), self.config.keepalive_interval);
        let sent: Vec<_> = lanes
            .iter_mut()
            .zip(requests)
            .enumerate()
            .map(|(i, (lane, req))| {
                let (id, start) = (req.request_id, Instant::now());
                let mut wait = deadline_wait(deadline, || {
                    check(&mut interrupted)?;
                    beats.watch(self, conns, i, i + 1)
                });
                (id, start, lane.send(req, deadline, &mut wait))
            })
            .collect();
        let mut answers = Vec::with_capacity(lanes.len());
        for (i, ((lane, &worker), (id, start, sent))) in
            lanes.iter_mut().zip(targets).zip(sent).enumerate()
        {
            let mut wait = deadline_wait(deadline, || {
                check(&mut interrupted)?;
                beats.watch(self, conns, i, conns.len())
            });
            let result = sent.and_then(|()| lane.receive(deadline, &mut wait));
            answers.push(Answer::new(
                worker,
                result,
                start.elapsed().as_secs_f64(),
                id,
            ));
        }
        match interrupted {
            true => Err(PoolError::Interrupted),
            false => Ok(answers),
        }
    }

    /// [`Self::over_lanes`] for large requests: each lane's request is written and its reply read on a thread of its
    /// own, so the copies into and out of the sockets overlap (on one thread, a second worker's 4 MB waited for the
    /// first's). The calling thread waits for the answers and polls `interrupt` (only it sees Ctrl-C); an interrupt
    /// or a passed deadline ends every lane's wait at its next poll.
    fn over_lanes_at_once(
        &self,
        targets: &[usize],
        conns: &[Arc<WorkerConn>],
        lanes: Vec<LaneCall<'_>>,
        requests: Vec<CallRequest>,
        deadline: Option<(Instant, Duration)>,
        interrupt: Interrupt<'_>,
    ) -> Result<Vec<Answer>, PoolError> {
        let interrupted = AtomicBool::new(false);
        let n = lanes.len();
        let mut answers: Vec<Option<Answer>> = (0..n).map(|_| None).collect();
        std::thread::scope(|s| {
            let (tx, rx) = std::sync::mpsc::channel::<(usize, Answer)>();
            for (i, (mut lane, req)) in lanes.into_iter().zip(requests).enumerate() {
                let (tx, interrupted, worker) = (tx.clone(), &interrupted, targets[i]);
                let conn = &conns[i..i + 1];
                let spawned = std::thread::Builder::new()
                    .name("ddlf-lane".into())
                    .spawn_scoped(s, move || {
                        let (id, start) = (req.request_id, Instant::now());
                        let mut beats = Beats::new(1, self.config.keepalive_interval);
                        let mut wait = deadline_wait(deadline, || {
                            if interrupted.load(Ordering::Relaxed) {
                                return Err(io::ErrorKind::Interrupted.into());
                            }
                            beats.watch(self, conn, 0, 1)
                        });
                        let result = lane
                            .send(req, deadline, &mut wait)
                            .and_then(|()| lane.receive(deadline, &mut wait));
                        let _ = tx.send((
                            i,
                            Answer::new(worker, result, start.elapsed().as_secs_f64(), id),
                        ));
                    });
                if let Err(e) = spawned {
                    // No thread to be had: this worker's call fails, the others go on.
                    let failed = Err(NetError::Unavailable {
                        address: conns[i].address().to_string(),
                        reason: format!("no thread to send on its direct lane: {e}"),
                    });
                    answers[i] = Some(Answer::new(worker, failed, 0.0, 0));
                }
            }
            drop(tx);
            loop {
                match rx.recv_timeout(MASTER_POLL) {
                    Ok((i, answer)) => answers[i] = Some(answer),
                    Err(RecvTimeoutError::Timeout) => {
                        if interrupt().is_err() {
                            interrupted.store(true, Ordering::Relaxed);
                        }
                    }
                    Err(RecvTimeoutError::Disconnected) => break,
                }
            }
        });
        if interrupted.into_inner() {
            return Err(PoolError::Interrupted);
        }
        Ok(answers
            .into_iter()
            .zip(targets.iter().zip(conns))
            .map(|(a, (&worker, conn))| {
                a.unwrap_or_else(|| {
                    let failed = Err(NetError::Unavailable {
                        address: conn.address().to_string(),
                        reason: "its direct lane's thread ended without an answer".into(),
                    });
                    Answer::new(worker, failed, 0.0, 0)
                })
            })
            .collect())
    }

    /// Heartbeats over gRPC to `conns` at once, each within the keepalive timeout (blocking): why each that failed
    /// did.
    fn alive_all(&self, conns: &[Arc<WorkerConn>]) -> Vec<Result<(), String>> {
        let t = self.config.keepalive_timeout;
        let beats = conns.iter().map(|c| c.heartbeat(Some(t)));
        self.rt
            .block_on(futures_util::future::join_all(beats))
            .into_iter()
            .map(|r| match r {
                Ok(_) => Ok(()),
                Err(NetError::DeadlineExceeded { .. }) => Err(format!(
                    "no answer to a heartbeat within {:.1} s",
                    t.as_secs_f64()
                )),
                Err(e) => Err(format!("heartbeat failed: {e}")),
            })
            .collect()
    }

    /// Run `f` on each target concurrently (requests the daemon's network side answers by itself).
    pub fn each<T, F, Fut>(
        &self,
        targets: &[usize],
        f: F,
        interrupt: Interrupt<'_>,
    ) -> Result<PerWorker<T>, PoolError>
    where
        F: Fn(Arc<WorkerConn>) -> Fut,
        Fut: Future<Output = Result<T, NetError>>,
    {
        let conns = self.targets(targets)?;
        self.wait(join_all(conns.into_iter().map(f)), interrupt)
    }

    /// `(round trip, daemon instance)` per target. An instance other than at connect time: the daemon restarted.
    pub fn heartbeat(
        &self,
        targets: &[usize],
        timeout: Option<Duration>,
        interrupt: Interrupt<'_>,
    ) -> Result<PerWorker<(Duration, u64)>, PoolError> {
        self.each(
            targets,
            move |c| async move { c.heartbeat(timeout).await },
            interrupt,
        )
    }

    /// Each target's status.
    pub fn status(
        &self,
        targets: &[usize],
        timeout: Option<Duration>,
        interrupt: Interrupt<'_>,
    ) -> Result<PerWorker<StatusReply>, PoolError> {
        self.each(
            targets,
            move |c| async move { c.status(timeout).await },
            interrupt,
        )
    }

    /// Each target's last `lines` log lines (0: all it keeps) and how many fell out of its buffer.
    pub fn logs(
        &self,
        targets: &[usize],
        lines: u32,
        timeout: Option<Duration>,
        interrupt: Interrupt<'_>,
    ) -> Result<PerWorker<(Vec<String>, u64)>, PoolError> {
        self.each(
            targets,
            move |c| async move { c.logs(lines, timeout).await },
            interrupt,
        )
    }

    /// Ask each target daemon to exit.
    pub fn shutdown(
        &self,
        targets: &[usize],
        timeout: Option<Duration>,
        interrupt: Interrupt<'_>,
    ) -> Result<PerWorker<()>, PoolError> {
        self.each(
            targets,
            move |c| async move { c.shutdown(timeout).await },
            interrupt,
        )
    }
}

/// The heartbeats of one call over lanes: which workers failed one, and when the next is due.
struct Beats {
    dead: Vec<Option<String>>,
    next: Instant,
    every: Duration,
}

impl Beats {
    fn new(n: usize, every: Duration) -> Self {
        Beats {
            dead: vec![None; n],
            next: Instant::now() + every,
            every,
        }
    }

    /// While waiting on worker `i`: when a beat is due, ping workers `i..upto` at once (those still owing a
    /// reply); an error once worker `i` failed one.
    fn watch(
        &mut self,
        pool: &Pool,
        conns: &[Arc<WorkerConn>],
        i: usize,
        upto: usize,
    ) -> io::Result<()> {
        if self.dead[i].is_none() && Instant::now() >= self.next {
            for (k, failed) in pool.alive_all(&conns[i..upto]).into_iter().enumerate() {
                if let Err(why) = failed {
                    self.dead[i + k].get_or_insert(why);
                }
            }
            self.next = Instant::now() + self.every;
        }
        match &self.dead[i] {
            Some(why) => Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                why.clone(),
            )),
            None => Ok(()),
        }
    }
}
