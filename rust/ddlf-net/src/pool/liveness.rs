//! Liveness: `heartbeat` (the user's `Cluster.ping`) over the ping lanes, or gRPC; and while a call waits on its
//! lane, heartbeats over gRPC, answered by a daemon's network runtime even while its Python is busy, so a stopped
//! worker is declared lost while the master waits on its lane.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::join_all;

use super::{AbortOnDrop, Interrupt, PerWorker, Pool, PoolError};
use crate::client::WorkerConn;
use crate::error::NetError;
use crate::lane::{deadline_wait, PingCall, MASTER_POLL};

impl Pool {
    /// Heartbeats over gRPC to `conns` at once, each within the keepalive timeout (blocking): why each that failed
    /// did.
    pub(super) fn alive_all(&self, conns: &[Arc<WorkerConn>]) -> Vec<Result<(), String>> {
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

    /// `(round trip, daemon instance)` per target. An instance other than at connect time: the daemon restarted.
    ///
    /// Over the targets' ping lanes, on this thread, when every one is free: every ping is written, then each
    /// answer is read as it comes (`poll(2)`), so one slow worker delays no other's answer or round trip. A ping
    /// lane that fails other than by the deadline (a reset: the daemon may have restarted) is retried over gRPC at
    /// once, within what is left of `timeout`, and that answer counts. Without a `timeout`, a lane left unanswered
    /// for the keepalive interval plus its timeout fails as gRPC's keepalive would: the worker is unavailable.
    /// Otherwise (a lane busy or missing), every ping goes over gRPC.
    pub fn heartbeat(
        &self,
        targets: &[usize],
        timeout: Option<Duration>,
        interrupt: Interrupt<'_>,
    ) -> Result<PerWorker<(Duration, u64)>, PoolError> {
        let conns = self.targets(targets)?;
        let pings: Vec<PingCall<'_>> = conns.iter().map_while(|c| c.ping_lane()).collect();
        if pings.len() < conns.len() {
            drop(pings);
            let beats = conns.iter().map(|c| heartbeat_grpc(c.clone(), timeout));
            return self.wait(join_all(beats), interrupt);
        }
        let keepalive = self.config.keepalive_interval + self.config.keepalive_timeout;
        let (limit, lost) = match timeout {
            Some(t) => (t, false),
            None => (keepalive, true),
        };
        let start = Instant::now();
        let deadline = (start + limit, limit);
        // Retries run on the runtime while the other lanes are read; aborted if this call is (Ctrl-C).
        let (mut which, mut retries) = (vec![], AbortOnDrop(vec![]));
        let mut retry = |i: usize| {
            let left = timeout.map(|t| t.saturating_sub(start.elapsed()));
            which.push(i);
            retries
                .0
                .push(self.rt.spawn(heartbeat_grpc(conns[i].clone(), left)));
        };
        let spin = self.config.lane_spin; // every lane's, as they were opened
        let mut beats = over_ping_lanes(pings, deadline, spin, interrupt, &mut retry)?;
        if lost {
            for (beat, conn) in beats.iter_mut().zip(&conns) {
                if let Some(Err(NetError::DeadlineExceeded { .. })) = beat {
                    *beat = Some(Err(NetError::Unavailable {
                        address: conn.address().to_string(),
                        reason: format!(
                            "no answer to a ping within {:.1} s (the heartbeat interval and timeout)",
                            keepalive.as_secs_f64()
                        ),
                    }));
                }
            }
        }
        let joined = self.wait(join_all(retries.0.iter_mut()), interrupt)?;
        for (i, result) in which.into_iter().zip(joined) {
            let beat = result.unwrap_or_else(|e| {
                Err(NetError::Unavailable {
                    address: conns[i].address().to_string(),
                    reason: format!("the ping's task ended without an answer: {e}"),
                })
            });
            // A retry ran within the time left: its deadline is still the caller's.
            beats[i] = Some(match (beat, timeout) {
                (Err(NetError::DeadlineExceeded { address, .. }), Some(after)) => {
                    Err(NetError::DeadlineExceeded { address, after })
                }
                (beat, _) => beat,
            });
        }
        let answered = beats.into_iter().zip(&conns).map(|(beat, conn)| {
            beat.unwrap_or_else(|| {
                Err(NetError::Unavailable {
                    address: conn.address().to_string(),
                    reason: "the ping was neither answered nor retried".into(),
                })
            })
        });
        Ok(answered.collect())
    }
}

/// A ping over gRPC; a worker that answered as the same daemon instance gets its broken lanes opened again
/// (within what is left of `timeout`: a ping is not held up by a reconnection).
async fn heartbeat_grpc(conn: Arc<WorkerConn>, timeout: Option<Duration>) -> Beat {
    let start = Instant::now();
    let beat = conn.heartbeat(timeout).await;
    if let Ok((_, instance)) = &beat {
        if *instance == conn.hello().instance {
            let revive = conn.revive_lane();
            match timeout.map(|t| t.saturating_sub(start.elapsed())) {
                Some(left) => {
                    let _ = tokio::time::timeout(left, revive).await;
                }
                None => revive.await,
            }
        }
    }
    beat
}

/// One worker's answer to a ping: `(round trip, daemon instance)`, or why there is none.
type Beat = Result<(Duration, u64), NetError>;

/// Pings told apart on a lane (a late answer to an abandoned ping is never taken for the next one's).
static NEXT_NONCE: AtomicU64 = AtomicU64::new(1);

/// One ping on each of `pings` on this thread, each answer read as it arrives (spinning up to `spin`, the lanes'
/// busy-polling, then `poll(2)`, checking `interrupt` at most every `MASTER_POLL`): `(round trip, instance)` per lane, each
/// timed from its send to its answer. A lane that fails other than by the deadline is closed and handed to
/// `retry` at once (its entry stays None): closed first, so that the retry's answer can open it again.
fn over_ping_lanes(
    pings: Vec<PingCall<'_>>,
    deadline: (Instant, Duration),
    spin: Duration,
    interrupt: Interrupt<'_>,
    retry: &mut dyn FnMut(usize),
) -> Result<Vec<Option<Beat>>, PoolError> {
    let on_time = Some(deadline);
    // Waits inside one frame (an answer that came in pieces) keep to the deadline and the interrupt too.
    let mut give_up = deadline_wait(on_time, interrupt);
    let nonce = NEXT_NONCE.fetch_add(1, Ordering::Relaxed);
    let mut pings: Vec<Option<PingCall<'_>>> = pings.into_iter().map(Some).collect();
    let mut beats: Vec<Option<Beat>> = pings.iter().map(|_| None).collect();
    let mut sent = Vec::with_capacity(pings.len());
    for i in 0..pings.len() {
        sent.push(Instant::now());
        // A ping is a few bytes: it fits the socket's buffer, so the write never waits.
        let failed = pings[i]
            .as_mut()
            .and_then(|p| p.send(nonce, on_time, &mut give_up).err());
        if let Some(e) = failed {
            settle(i, Err(e), &mut pings, &mut beats, retry)?;
        }
    }
    let spin_until = (Instant::now() + spin).min(deadline.0);
    let mut next_check = Instant::now();
    loop {
        let mut pending = false;
        for i in 0..pings.len() {
            let Some(p) = pings[i].as_mut() else { continue };
            if p.ready() {
                let beat = p.receive(nonce, on_time, &mut give_up);
                let beat = beat.map(|pong| (sent[i].elapsed(), pong.instance));
                settle(i, beat, &mut pings, &mut beats, retry)?;
            } else {
                pending = true;
            }
        }
        if !pending {
            return Ok(beats);
        }
        let now = Instant::now();
        if now < spin_until {
            std::thread::yield_now();
            continue;
        }
        if now >= next_check {
            if interrupt().is_err() {
                abandon(&mut pings, io::ErrorKind::Interrupted.into(), on_time);
                return Err(PoolError::Interrupted);
            }
            next_check = now + MASTER_POLL;
        }
        if now >= deadline.0 {
            for (p, beat) in pings.iter_mut().zip(beats.iter_mut()) {
                if let Some(mut late) = p.take() {
                    *beat = Some(Err(late.abandon(io::ErrorKind::TimedOut.into(), on_time)));
                }
            }
            return Ok(beats);
        }
        let wait = deadline.0.min(next_check).saturating_duration_since(now);
        let waiting: Vec<usize> = (0..pings.len()).filter(|&i| pings[i].is_some()).collect();
        let mut fds: Vec<libc::pollfd> = waiting
            .iter()
            .map(|&i| libc::pollfd {
                fd: pings[i].as_ref().and_then(PingCall::fd).unwrap_or(-1),
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        // SAFETY: `fds` is a valid array of `fds.len()` pollfd structures for the duration of the call, and every
        // fd in it belongs to a lane `pings` holds open (a negative one, which none is, would be ignored).
        let rc = unsafe {
            libc::poll(
                fds.as_mut_ptr(),
                fds.len() as libc::nfds_t,
                wait.as_millis().clamp(1, MASTER_POLL.as_millis()) as libc::c_int,
            )
        };
        if rc < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                // Cannot wait on these sockets: every lane still waiting fails, and is retried over gRPC.
                for &i in &waiting {
                    if let Some(p) = pings[i].as_mut() {
                        let failed = p.abandon(io::Error::new(e.kind(), e.to_string()), on_time);
                        settle(i, Err(failed), &mut pings, &mut beats, retry)?;
                    }
                }
            }
        }
        // Whatever woke the poll (an answer, the end of the connection, a reset) is `ready` at the loop's top.
    }
}

/// Record lane `i`'s outcome and let its lane go (free after an answer, closed after a failure): an answer or the
/// deadline is kept; an interrupt ends the call (every other lane closed); any other failure starts a retry.
fn settle(
    i: usize,
    beat: Beat,
    pings: &mut [Option<PingCall<'_>>],
    beats: &mut [Option<Beat>],
    retry: &mut dyn FnMut(usize),
) -> Result<(), PoolError> {
    pings[i] = None;
    match beat {
        Err(NetError::Interrupted { .. }) => {
            abandon(pings, io::ErrorKind::Interrupted.into(), None);
            Err(PoolError::Interrupted)
        }
        Err(e) if !matches!(e, NetError::DeadlineExceeded { .. }) => {
            retry(i);
            Ok(())
        }
        beat => {
            beats[i] = Some(beat);
            Ok(())
        }
    }
}

/// Close every lane still waiting for its answer (`why`: the caller's reason, for the log of none).
fn abandon(
    pings: &mut [Option<PingCall<'_>>],
    why: io::Error,
    deadline: Option<(Instant, Duration)>,
) {
    for p in pings.iter_mut() {
        if let Some(mut p) = p.take() {
            let _ = p.abandon(io::Error::new(why.kind(), why.to_string()), deadline);
        }
    }
}

/// The heartbeats of one call over lanes: which workers failed one, and when the next is due.
pub(super) struct Beats {
    dead: Vec<Option<String>>,
    next: Instant,
    every: Duration,
}

impl Beats {
    pub(super) fn new(n: usize, every: Duration) -> Self {
        Beats {
            dead: vec![None; n],
            next: Instant::now() + every,
            every,
        }
    }

    /// While waiting on worker `i`: when a beat is due, ping workers `i..upto` at once (those still owing a
    /// reply); an error once worker `i` failed one.
    pub(super) fn watch(
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
