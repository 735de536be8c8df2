//! Liveness while a call waits: heartbeats over gRPC, answered by a daemon's network runtime even while its
//! Python is busy, so a stopped worker is declared lost while the master waits on its lane.

use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Interrupt, PerWorker, Pool, PoolError};
use crate::client::WorkerConn;
use crate::error::NetError;

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
