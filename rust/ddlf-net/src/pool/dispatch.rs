//! Dispatch: one call to many workers, over their direct lanes when every one is free (on the calling thread, or
//! a thread per lane for large requests), else over gRPC on the pool's runtime, one task per worker.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::RecvTimeoutError;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ddlf_proto::CallRequest;
use futures_util::future::join_all;

use super::liveness::Beats;
use super::{AbortOnDrop, Answer, Call, Interrupt, Outcome, Outgoing, Pool, PoolError};
use crate::client::WorkerConn;
use crate::error::NetError;
use crate::lane::{deadline_wait, value_bytes, LaneCall, MASTER_POLL};

/// Lane requests of at least this many bytes (all targets together) go out on a thread per lane, so the copies
/// overlap; smaller ones are written one after another by the calling thread (a thread costs more than they do).
pub const LANES_AT_ONCE_BYTES: usize = 1 << 20;

/// Request ids, unique within this process: the worker's log lines about a request carry its id, and so does
/// the error the master raises when the request fails.
static NEXT_REQUEST_ID: AtomicU64 = AtomicU64::new(1);

impl Pool {
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
}
