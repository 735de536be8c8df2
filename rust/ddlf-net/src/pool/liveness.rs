//! Liveness: `heartbeat` (the user's `Cluster.ping`) over the ping lanes, or gRPC; and while a call waits on its
//! lane, heartbeats over gRPC, answered by a daemon's network runtime even while its Python is busy, so a stopped
//! worker is declared lost while the master waits on its lane.

use std::cell::Cell;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::join_all;

use super::{Interrupt, PerWorker, Pool, PoolError};
use crate::client::WorkerConn;
use crate::error::NetError;
use crate::lane::{deadline_wait, PingCall};

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
    /// Over the targets' ping lanes, on this thread, when every one is free (every ping is written, then every
    /// answer read); otherwise over gRPC. A ping lane that fails other than by the deadline (a reset: the daemon
    /// may have restarted) is tried again over gRPC within what is left of `timeout`, and that answer counts.
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
            return self.heartbeat_grpc(&conns, timeout, interrupt);
        }
        let start = Instant::now();
        let mut beats = over_ping_lanes(pings, timeout, interrupt)?;
        let again: Vec<usize> = (0..beats.len())
            .filter(
                |&i| matches!(&beats[i], Err(e) if !matches!(e, NetError::DeadlineExceeded { .. })),
            )
            .collect();
        if !again.is_empty() {
            let left = timeout.map(|t| t.saturating_sub(start.elapsed()));
            let retry: Vec<_> = again.iter().map(|&i| conns[i].clone()).collect();
            for (i, beat) in again
                .into_iter()
                .zip(self.heartbeat_grpc(&retry, left, interrupt)?)
            {
                beats[i] = beat;
            }
        }
        Ok(beats)
    }

    /// [`Self::heartbeat`] over gRPC; a worker that answered gets its broken lanes opened again.
    fn heartbeat_grpc(
        &self,
        conns: &[Arc<WorkerConn>],
        timeout: Option<Duration>,
        interrupt: Interrupt<'_>,
    ) -> Result<PerWorker<(Duration, u64)>, PoolError> {
        let beats = conns.iter().map(|c| async move {
            let beat = c.heartbeat(timeout).await;
            if beat.is_ok() {
                c.revive_lane().await;
            }
            beat
        });
        self.wait(join_all(beats), interrupt)
    }
}

/// Pings told apart on a lane (a late answer to an abandoned ping is never taken for the next one's).
static NEXT_NONCE: AtomicU64 = AtomicU64::new(1);

/// One ping on each of `pings`, on this thread, within `timeout`: `(round trip, instance)` per lane. Waits wake
/// every `MASTER_POLL` to check the deadline and `interrupt`.
fn over_ping_lanes(
    mut pings: Vec<PingCall<'_>>,
    timeout: Option<Duration>,
    interrupt: Interrupt<'_>,
) -> Result<PerWorker<(Duration, u64)>, PoolError> {
    let deadline = timeout.map(|t| (Instant::now() + t, t));
    let interrupted = Cell::new(false);
    let mut wait = deadline_wait(deadline, || {
        if interrupted.get() || interrupt().is_err() {
            interrupted.set(true);
            return Err(io::ErrorKind::Interrupted.into());
        }
        Ok(())
    });
    let nonce = NEXT_NONCE.fetch_add(1, Ordering::Relaxed);
    let sent: Vec<_> = pings
        .iter_mut()
        .map(|p| (Instant::now(), p.send(nonce, deadline, &mut wait)))
        .collect();
    let beats = pings
        .iter_mut()
        .zip(sent)
        .map(|(p, (start, sent))| {
            let pong = sent.and_then(|()| p.receive(nonce, deadline, &mut wait))?;
            Ok((start.elapsed(), pong.instance))
        })
        .collect();
    match interrupted.get() {
        true => Err(PoolError::Interrupted),
        false => Ok(beats),
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
