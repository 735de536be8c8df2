//! The queue between the network side and the interpreter thread.
//!
//! The gRPC service turns each `Call` into a [`Job`] and awaits its reply; the interpreter thread blocks on
//! [`JobReceiver::next`] (it releases the GIL while it waits) and answers each job in arrival order. The same
//! wait also watches the daemon's direct lanes ([`crate::lanes`]): a request arriving on one is read, and later
//! answered, by the interpreter thread itself.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ddlf_core::frame::FrameLimits;
use ddlf_proto::{CallReply, CallRequest};
use tokio::sync::oneshot;

use crate::lanes::{LaneIn, LaneOut, LaneRead};
use crate::requests::{label, log_reply};
use crate::state::WorkerState;

// Moved once per request; boxing would add an allocation to every call for no gain.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Message {
    Job(Job),
    Lane(LaneIn),
    Shutdown,
}

/// Where a job's reply goes.
enum ReplyTo {
    /// The gRPC call awaiting it on the network runtime.
    Grpc(oneshot::Sender<CallReply>),
    /// Written by the interpreter thread to the lane the request came on.
    Lane(Arc<LaneOut>),
}

/// One request for the interpreter.
pub struct Job {
    pub request: CallRequest,
    pub enqueued_at: Instant,
    reply: ReplyTo,
    state: Arc<WorkerState>,
}

impl Job {
    /// A short label for logs and status: `run:step`, `set_var:lr`, ...
    pub fn label(&self) -> String {
        label(&self.request)
    }

    /// Whether this thread writes the reply itself, before it takes another job (a lane's request): the reply's
    /// buffers may then be lent from the Python objects instead of copied, as nothing else runs meanwhile.
    pub fn replies_in_place(&self) -> bool {
        matches!(self.reply, ReplyTo::Lane(_))
    }

    /// Send the reply back: to the waiting service call (if the master is still waiting), or on the lane.
    pub fn respond(self, mut reply: CallReply) {
        reply.queue_seconds = reply.queue_seconds.max(0.0);
        self.state.end();
        match self.reply {
            ReplyTo::Grpc(tx) => {
                if tx.send(reply).is_err() {
                    tracing::debug!("reply dropped: the master stopped waiting");
                }
            }
            ReplyTo::Lane(out) => {
                log_reply(&reply, self.enqueued_at.elapsed());
                out.send(reply);
            }
        }
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

/// The interpreter thread's end: the queue, and the lanes it reads itself.
struct Inbox {
    rx: mpsc::Receiver<Message>,
    lanes: Vec<LaneIn>,
    /// Woken (one byte) whenever something is queued, so a wait that polls the lanes also sees the queue.
    wake: UnixStream,
}

/// The interpreter thread's end of the queue.
pub struct JobReceiver {
    // Behind a mutex only so that the receiver is `Sync` (the interpreter thread waits on it with the GIL
    // released); there is one consumer, so the lock is never contended.
    inbox: Mutex<Inbox>,
    state: Arc<WorkerState>,
    limits: FrameLimits,
    spin: Duration,
}

impl JobReceiver {
    /// Wait up to `timeout` for the next job, from the queue or from a lane.
    pub fn next(&self, timeout: Duration) -> Next {
        let deadline = Instant::now() + timeout;
        let mut inbox = self.inbox.lock().unwrap_or_else(|e| e.into_inner());
        let mut spun = false;
        loop {
            // Everything already queued first (lanes that arrived are added on the way).
            loop {
                match inbox.rx.try_recv() {
                    Ok(message) => {
                        if let Some(next) = self.accept(&mut inbox, message) {
                            return next;
                        }
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => return Next::Shutdown,
                }
            }
            // Bytes already read past the previous request are a request the socket will not poll for.
            if let Some(i) = inbox.lanes.iter().position(|l| l.has_buffered()) {
                if let Some(job) = self.read_lane(&mut inbox, i) {
                    return self.started(job);
                }
                continue;
            }
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Next::Idle;
            }
            if inbox.lanes.is_empty() {
                // Nothing to poll but the queue: block on it.
                match inbox.rx.recv_timeout(remaining) {
                    Ok(message) => match self.accept(&mut inbox, message) {
                        Some(next) => return next,
                        None => continue,
                    },
                    Err(mpsc::RecvTimeoutError::Timeout) => return Next::Idle,
                    Err(mpsc::RecvTimeoutError::Disconnected) => return Next::Shutdown,
                }
            }
            // Before sleeping, spin a little: a master making calls back to back sends the next one within
            // microseconds of our reply, and catching it awake saves the wake-up.
            if !spun {
                spun = true;
                if spin_for_work(&mut inbox, self.spin.min(remaining)) {
                    continue;
                }
            }
            let ready = poll_ready(&inbox, remaining);
            if ready.first() == Some(&0) {
                drain(&mut inbox.wake);
            }
            // The first ready lane is served; it then goes to the back, so busy lanes take turns.
            if let Some(&i) = ready.iter().find(|&&i| i > 0) {
                if let Some(job) = self.read_lane(&mut inbox, i - 1) {
                    return self.started(job);
                }
            }
        }
    }

    fn started(&self, job: Job) -> Next {
        self.state.begin(&job.label());
        Next::Job(job)
    }

    /// A message from the queue: what `next` returns for it, or None for a lane (kept, to be polled).
    fn accept(&self, inbox: &mut Inbox, message: Message) -> Option<Next> {
        match message {
            Message::Job(job) => {
                self.state.queued.fetch_sub(1, Ordering::Relaxed);
                Some(self.started(job))
            }
            Message::Lane(lane) => {
                inbox.lanes.push(lane);
                None
            }
            Message::Shutdown => Some(Next::Shutdown),
        }
    }

    /// Read the next request on lane `i`: a job to run, or None (refused and answered, or the lane closed).
    fn read_lane(&self, inbox: &mut Inbox, i: usize) -> Option<Job> {
        let mut lane = inbox.lanes.remove(i);
        let job = match lane.read(&self.state, self.limits) {
            LaneRead::Request(request) => Some(Job {
                request,
                enqueued_at: Instant::now(),
                reply: ReplyTo::Lane(lane.out()),
                state: self.state.clone(),
            }),
            LaneRead::Answered => None,
            LaneRead::Closed => return None,
        };
        inbox.lanes.push(lane);
        job
    }
}

/// Wait until the wake socket (index 0) or lanes (index i + 1) are readable, or `timeout`; the ready indices.
fn poll_ready(inbox: &Inbox, timeout: Duration) -> Vec<usize> {
    let mut fds: Vec<libc::pollfd> = std::iter::once(inbox.wake.as_raw_fd())
        .chain(inbox.lanes.iter().map(|l| l.fd()))
        .map(|fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let millis = timeout.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
    // SAFETY: `fds` is a valid array of `fds.len()` pollfd structs that outlives the call.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, millis) };
    if n <= 0 {
        return Vec::new(); // timeout, or EINTR: the caller loops and re-checks its deadline
    }
    fds.iter()
        .enumerate()
        .filter(|(_, p)| p.revents != 0)
        .map(|(i, _)| i)
        .collect()
}

/// Drain the wake socket; whether it held anything (something was queued).
fn drain(wake: &mut UnixStream) -> bool {
    let mut sink = [0u8; 256];
    let mut any = false;
    while matches!(wake.read(&mut sink), Ok(n) if n > 0) {
        any = true;
    }
    any
}

/// Non-blocking checks of every lane and of the queue's wake socket for up to `spin`, yielding the CPU between
/// rounds; whether something arrived.
fn spin_for_work(inbox: &mut Inbox, spin: Duration) -> bool {
    if spin.is_zero() {
        return false;
    }
    let start = Instant::now();
    loop {
        if inbox.lanes.iter_mut().any(|l| l.try_fill()) || drain(&mut inbox.wake) {
            return true;
        }
        if start.elapsed() >= spin {
            return false;
        }
        std::thread::yield_now();
    }
}

/// The network side's end of the queue.
#[derive(Clone)]
pub struct JobSender {
    tx: mpsc::Sender<Message>,
    wake: Arc<UnixStream>,
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
            reply: ReplyTo::Grpc(reply),
            state: self.state.clone(),
        };
        self.state.queued.fetch_add(1, Ordering::Relaxed);
        if !self.send(Message::Job(job)) {
            self.state.queued.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        Some(rx)
    }

    /// Hand a lane that passed its handshake to the interpreter thread.
    pub(crate) fn add_lane(&self, lane: LaneIn) -> bool {
        self.send(Message::Lane(lane))
    }

    /// Wake the interpreter thread and tell it to leave its loop.
    pub fn shutdown(&self) {
        self.send(Message::Shutdown);
    }

    fn send(&self, message: Message) -> bool {
        if self.tx.send(message).is_err() {
            return false;
        }
        // Non-blocking: when the socket is full the interpreter has wake-ups pending anyway.
        let _ = (&*self.wake).write(&[1]);
        true
    }
}

/// A connected sender/receiver pair sharing `state`; requests read from lanes are held to `limits`, and the
/// interpreter thread spins up to `spin` for the next request before it sleeps.
pub fn queue(
    state: Arc<WorkerState>,
    limits: FrameLimits,
    spin: Duration,
) -> std::io::Result<(JobSender, JobReceiver)> {
    let (tx, rx) = mpsc::channel();
    let (wake_rx, wake_tx) = UnixStream::pair()?;
    wake_rx.set_nonblocking(true)?;
    wake_tx.set_nonblocking(true)?;
    Ok((
        JobSender {
            tx,
            wake: Arc::new(wake_tx),
            state: state.clone(),
        },
        JobReceiver {
            inbox: Mutex::new(Inbox {
                rx,
                lanes: Vec::new(),
                wake: wake_rx,
            }),
            state,
            limits,
            spin,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ddlf_proto::Op;

    #[test]
    fn jobs_flow_in_order_and_replies_come_back() {
        let state = Arc::new(WorkerState::new("t".into()));
        let (tx, rx) = queue(state.clone(), FrameLimits::default(), Duration::ZERO).unwrap();
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
        let (tx, rx) = queue(state, FrameLimits::default(), Duration::ZERO).unwrap();
        drop(rx);
        assert!(tx.submit(CallRequest::default()).is_none());
    }
}
