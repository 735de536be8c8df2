//! [`Pool`]: the master's connections to its workers, and the dispatch policy of every call.
//!
//! A call goes to many workers at once and comes back as one typed [`Answer`] per worker, so a failure of one
//! worker never hides the answers of the others. The pool decides, per call:
//!
//! * **the path** (`dispatch.rs`): requests of any size ride the direct lanes when every target's lane is free
//!   (the calling thread writes and reads the frames itself, or a thread per lane for large ones, so they
//!   overlap); anything else (a lane busy or broken, TLS daemons) goes over gRPC on the pool's runtime. Lanes
//!   write buffers from where they lie and read them into their final allocation, in a fraction of the time of
//!   gRPC's chunked stream (`BENCHMARKS.md`, *Tensor data plane*);
//! * **shared memory**: a large value for workers on this machine is written once into a pooled segment that
//!   they all map (see [`outgoing`]); a segment a worker may not have taken is retired;
//! * **liveness** (`liveness.rs`): pings ride the ping lanes (answered by a daemon thread of their own) when
//!   every target's is free, else gRPC; a wait on a lane pings the worker over gRPC every keepalive interval, so
//!   a stopped worker is declared lost as the gRPC path's keepalive would;
//! * **request ids**, unique in this process, and **lane revival** once a worker answers over gRPC again.
//!
//! Waits never hold a lock the caller cares about and poll an [`Interrupt`] (Ctrl-C in the Python bindings)
//! every [`INTERRUPT_POLL`].

mod dispatch;
mod liveness;
pub mod outgoing;

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use ddlf_proto::{CallReply, ErrorKind, StacksReply, StatusReply, Value};
use futures_util::future::join_all;

pub use dispatch::LANES_AT_ONCE_BYTES;
pub use outgoing::{write_shm, Outgoing, POOL_THRESHOLD, SHM_THRESHOLD};

use crate::client::{ClientConfig, WorkerConn};
use crate::error::NetError;

/// Tasks of one call, aborted if the call is dropped before they finish (Ctrl-C).
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

/// Per target: its result, or why it has none.
pub type PerWorker<T> = Vec<Result<T, NetError>>;

/// What went wrong with a pool operation as a whole (a worker's own failure is an [`Outcome::Failed`]).
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// A pool needs at least one address.
    #[error("a cluster needs at least one worker address")]
    NoWorkers,
    /// A target index past the last worker.
    #[error("worker index {index} out of range: the cluster has {len} workers")]
    NoSuchWorker {
        /// The index asked for.
        index: usize,
        /// Workers in the pool.
        len: usize,
    },
    /// A call whose values do not match its targets.
    #[error("{values} values for {targets} workers")]
    ValueCount {
        /// Values given.
        values: usize,
        /// Targets given.
        targets: usize,
    },
    /// Connecting to worker `index` failed.
    #[error("{source}")]
    Connect {
        /// The worker's index.
        index: usize,
        /// Why.
        #[source]
        source: NetError,
    },
    /// The caller's [`Interrupt`] ended the wait: whether the workers ran the request is unknown.
    #[error("interrupted")]
    Interrupted,
    /// The pool's tokio runtime could not start.
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
        /// Which kind of failure (user code raised, an unknown name, an undecodable request, ...).
        kind: ErrorKind,
        /// The exception's class name.
        type_name: String,
        /// The exception's message.
        message: String,
        /// The worker's formatted traceback.
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
    /// What the worker made of the call.
    pub outcome: Outcome,
    /// Seconds the worker's interpreter spent on it (0 when it did not answer).
    pub worker_seconds: f64,
    /// Seconds from sending the request to having the whole reply.
    pub call_seconds: f64,
    /// The request's id, in the worker's log lines about it.
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
    /// The function or variable the call names.
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
        let threads = ddlf_core::parallel::cores().min(4);
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
        let spin = self.config.lane_spin;
        self.rt.block_on(async move {
            tokio::pin!(fut);
            let mut fut = Spin {
                fut,
                until: Instant::now() + spin,
            };
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

    /// Each target's Python stacks and what its interpreter thread serves.
    pub fn stacks(
        &self,
        targets: &[usize],
        timeout: Option<Duration>,
        interrupt: Interrupt<'_>,
    ) -> Result<PerWorker<StacksReply>, PoolError> {
        self.each(
            targets,
            move |c| async move { c.stacks(timeout).await },
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

/// A future polled without parking its thread until `until`: while it is pending, the thread yields the CPU and
/// wakes itself, so a reply that comes within the spin (a ping, a status, a quick gRPC call) is picked up without
/// the futex wake-up of a parked thread (an inter-processor interrupt, costly in a VM): the technique of the
/// lanes' busy-polling ([`crate::lane::default_spin`], `Cluster(lane_spin_us=...)`), applied to the wait on the
/// pool's runtime. After `until` it parks as any future does.
struct Spin<'a, F: Future> {
    fut: Pin<&'a mut F>,
    until: Instant,
}

impl<F: Future> Future for Spin<'_, F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        match self.fut.as_mut().poll(cx) {
            Poll::Ready(out) => Poll::Ready(out),
            Poll::Pending => {
                if Instant::now() < self.until {
                    std::thread::yield_now();
                    cx.waker().wake_by_ref();
                }
                Poll::Pending
            }
        }
    }
}
