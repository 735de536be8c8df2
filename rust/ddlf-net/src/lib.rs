//! ddlf networking: the master's connections to worker daemons and the plumbing every daemon's server shares.
//!
//! * [`client`]: connect with a deadline, version handshake, calls with deadlines, ping/status/shutdown.
//! * [`server`]: the configured tonic server builder, token authentication, listener.
//! * [`preface`]: the one table of what a connection to a daemon may open with, and [`preface::judge`].
//! * [`guard`]: admission control in front of a daemon's server (connection cap, handshake check, logging).
//! * [`lane`]: direct lanes, calls framed on plain TCP and answered by the worker's interpreter thread itself.
//! * [`stream`]: values cut into chunks for streamed calls, and read back (both ends).
//! * [`pool`]: [`Pool`], the master's connections to all its workers and the dispatch policy (lane or gRPC,
//!   shared memory, liveness while waiting, typed [`pool::Outcome`]s).
//! * [`refusal`]: a daemon's refusal codes on gRPC statuses.
//! * [`error`]: [`NetError`], what can go wrong talking to a worker, always naming its address.

#![deny(missing_docs)]

pub mod client;
pub mod error;
pub mod guard;
pub mod lane;
pub mod pool;
pub mod preface;
pub mod refusal;
pub mod server;
pub mod stream;

pub use client::{ClientConfig, ClientTls, WorkerConn};
pub use error::NetError;
pub use guard::{ConnStats, GuardConfig};
pub use pool::{Answer, Outcome, Outgoing, Pool};
pub use server::{ServerAuth, ServerConfig, ServerTls};

/// HTTP/2 flow-control windows. The defaults (64 KiB) throttle bulk transfers on fast links; weights are
/// tens to hundreds of megabytes, so both sides advertise large windows.
pub const STREAM_WINDOW: u32 = 16 * 1024 * 1024;
/// See [`STREAM_WINDOW`].
pub const CONNECTION_WINDOW: u32 = 64 * 1024 * 1024;

/// HTTP/2 frame size we accept (the protocol's default is 16 KiB): bulk data then moves in few large frames
/// instead of thousands of small ones.
pub const MAX_FRAME: u32 = 1 << 20;
