//! The queue between the gRPC service (tokio) and the interpreter thread.
//!
//! The service turns each `Call` into a [`Job`] and awaits its reply; the interpreter thread blocks on
//! [`JobReceiver::next`] (it releases the GIL while it waits) and answers each job in arrival order.

use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ddlf_proto::{CallReply, CallRequest, Op};
use tokio::sync::oneshot;

use crate::state::WorkerState;

// Moved once per request; boxing would add an allocation to every call for no gain.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Message {
    Job(Job),
    Shutdown,
}

/// One request for the interpreter.
pub struct Job {
    pub request: CallRequest,
    pub enqueued_at: Instant,
    reply: oneshot::Sender<CallReply>,
    state: Arc<WorkerState>,
}

impl Job {
    /// A short label for logs and status: `run:step`, `set_var:lr`, ...
    pub fn label(&self) -> String {
        label(&self.request)
    }

    /// Send the reply back to the waiting service call (if the master is still waiting).
    pub fn respond(self, mut reply: CallReply) {
        reply.queue_seconds = reply.queue_seconds.max(0.0);
        self.state.end();
        if self.reply.send(reply).is_err() {
            tracing::debug!("reply dropped: the master stopped waiting");
        }
    }
}

/// `op:name`, for logs and status.
pub fn label(request: &CallRequest) -> String {
    let op = Op::try_from(request.op).unwrap_or(Op::Unspecified);
    let op = op
        .as_str_name()
        .trim_start_matches("OP_")
        .to_ascii_lowercase();
    if request.name.is_empty() {
        op
    } else {
        format!("{op}:{}", request.name)
    }
}

/// What the interpreter thread gets from [`JobReceiver::next`].
#[allow(clippy::large_enum_variant)]
pub enum Next {
    Job(Job),
    /// Nothing arrived within the wait; a chance to check for signals.
    Idle,
    /// The daemon is stopping: leave the loop.
    Shutdown,
}

/// The interpreter thread's end of the queue.
pub struct JobReceiver {
    // Behind a mutex only so that the receiver is `Sync` (the interpreter thread waits on it with the GIL
    // released); there is one consumer, so the lock is never contended.
    rx: Mutex<mpsc::Receiver<Message>>,
    state: Arc<WorkerState>,
}

impl JobReceiver {
    /// Wait up to `timeout` for the next job.
    pub fn next(&self, timeout: Duration) -> Next {
        let rx = self.rx.lock().unwrap_or_else(|e| e.into_inner());
        match rx.recv_timeout(timeout) {
            Ok(Message::Job(job)) => {
                self.state.queued.fetch_sub(1, Ordering::Relaxed);
                self.state.begin(&job.label());
                Next::Job(job)
            }
            Ok(Message::Shutdown) | Err(mpsc::RecvTimeoutError::Disconnected) => Next::Shutdown,
            Err(mpsc::RecvTimeoutError::Timeout) => Next::Idle,
        }
    }
}

/// The service's end of the queue.
#[derive(Clone)]
pub struct JobSender {
    tx: mpsc::Sender<Message>,
    state: Arc<WorkerState>,
}

impl JobSender {
    /// Queue `request`; the returned receiver yields the interpreter's reply, or an error if the interpreter
    /// is gone.
    pub fn submit(&self, request: CallRequest) -> Option<oneshot::Receiver<CallReply>> {
        let (reply, rx) = oneshot::channel();
        let job = Job {
            request,
            enqueued_at: Instant::now(),
            reply,
            state: self.state.clone(),
        };
        self.state.queued.fetch_add(1, Ordering::Relaxed);
        if self.tx.send(Message::Job(job)).is_err() {
            self.state.queued.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        Some(rx)
    }

    /// Wake the interpreter thread and tell it to leave its loop.
    pub fn shutdown(&self) {
        let _ = self.tx.send(Message::Shutdown);
    }
}

/// A connected sender/receiver pair sharing `state`.
pub fn queue(state: Arc<WorkerState>) -> (JobSender, JobReceiver) {
    let (tx, rx) = mpsc::channel();
    (
        JobSender {
            tx,
            state: state.clone(),
        },
        JobReceiver {
            rx: Mutex::new(rx),
            state,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_flow_in_order_and_replies_come_back() {
        let state = Arc::new(WorkerState::new("t".into()));
        let (tx, rx) = queue(state.clone());
        let mut waits = Vec::new();
        for i in 0..3 {
            let req = CallRequest {
                op: Op::Run as i32,
                name: format!("f{i}"),
                ..Default::default()
            };
            waits.push(tx.submit(req).unwrap());
        }
        assert_eq!(state.queued.load(Ordering::Relaxed), 3);
        for i in 0..3 {
            match rx.next(Duration::from_millis(10)) {
                Next::Job(job) => {
                    assert_eq!(job.request.name, format!("f{i}"));
                    assert_eq!(job.label(), format!("run:f{i}"));
                    assert_eq!(state.running().unwrap().0, format!("run:f{i}"));
                    job.respond(CallReply {
                        compute_seconds: i as f64,
                        ..Default::default()
                    });
                }
                _ => panic!("expected a job"),
            }
        }
        for (i, w) in waits.into_iter().enumerate() {
            assert_eq!(w.blocking_recv().unwrap().compute_seconds, i as f64);
        }
        assert!(matches!(rx.next(Duration::from_millis(1)), Next::Idle));
        tx.shutdown();
        assert!(matches!(rx.next(Duration::from_millis(1)), Next::Shutdown));
    }

    #[test]
    fn submit_fails_when_interpreter_is_gone() {
        let state = Arc::new(WorkerState::new("t".into()));
        let (tx, rx) = queue(state);
        drop(rx);
        assert!(tx.submit(CallRequest::default()).is_none());
    }
}
