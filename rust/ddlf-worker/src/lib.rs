//! The ddlf worker daemon, minus Python.
//!
//! The daemon's network side runs on tokio and answers hello, ping, status and shutdown by itself. Every
//! operation that needs the interpreter becomes a [`jobs::Job`] on a queue; the interpreter thread (owned by the
//! Python bindings, which are the only layer that knows about the GIL) takes jobs in request order and answers
//! each through its oneshot channel. A long `model.fit` therefore never delays a heartbeat.
//!
//! * [`daemon`]: start/stop a daemon on its own runtime.
//! * [`service`]: the gRPC service.
//! * [`jobs`]: the queue between the service and the interpreter thread, which also reads direct lanes.
//! * [`lanes`]: the daemon's end of direct lanes (handshake, reading requests, writing replies).
//! * [`pings`]: the daemon's end of ping lanes, a thread per lane answering pings.
//! * [`requests`]: what every request goes through, whichever way it came (screening, labels, logging).
//! * [`state`]: what the daemon knows about itself (uptime, counters, what is running).
//! * [`stacks`]: every Python thread's stack, taken without the interpreter's lock.
//! * [`logs`]: its recent log lines, kept in memory for the `Logs` RPC.

pub mod daemon;
pub mod jobs;
pub mod lanes;
pub mod logs;
pub mod pings;
pub mod requests;
pub mod service;
pub mod stacks;
pub mod state;

pub use daemon::{Daemon, DaemonConfig, DaemonError};
pub use jobs::{Job, JobReceiver, Next};
