//! ddlf's collective: workers reducing among themselves, ring all-reduce over direct worker-to-worker links.
//!
//! * [`ring`]: the algorithm (reduce-scatter then all-gather, pipelined on non-blocking sockets), over any two
//!   connected links.
//! * [`peer`]: opening a link to another worker's daemon (token checked before anything is decoded), and the
//!   mailbox where a daemon leaves the links it admitted for this process's ring.
//! * [`link`]: one end of a peer link, plaintext or TLS, for the ring's non-blocking I/O; [`tls`]: the TLS
//!   configurations of both ends.
//! * [`node`]: a hierarchical ring's local stage, the members on one host reducing through shared memory.
//! * [`Ring`]: one rank's membership in a ring: its spec ([`RingSpec`]), its links (opened on first use and kept
//!   for the following reductions), and errors that name the neighbour at fault ([`CollectiveError`]).
//! * [`Request`]: one call a [`Ring`] runs ([`Ring::run`]): an all-reduce (in place, into other arrays, or
//!   left in a host's shared memory) or one of its halves, the elements' [`Codec`] on the wire, and whether a
//!   failure leaves the data as it was.
//!
//! A ring that fails once is spent: its links are closed (so both neighbours fail at once instead of waiting for
//! their stall timeout, and the failure travels around the ring in a few round trips) and every later call
//! refuses. Whoever formed it (the master) forms a new one, with a new group id, from the ranks still alive.
//!
//! The crate sits beside the master's side of `ddlf-net`, on top of it: a daemon's admission guard
//! (`ddlf_net::guard`) recognises a peer link by its preface (`ddlf_net::preface::PEER_PREFACE`) and hands it
//! over, the daemon (`ddlf-worker`) passes it to [`peer::welcome`], and Python's `ddlf._ddlf.Ring` (`ddlf-py`)
//! drives a [`Ring`] on the worker's interpreter thread. `ddlf-net` knows nothing of this crate.
//!
//! The files: `spec.rs` ([`RingSpec`]), `error.rs` ([`CollectiveError`]), `ring_handle.rs` (the [`Ring`], its life
//! and the guard that spends it), `request.rs` ([`Request`]), `collective.rs` ([`Ring::run`]: a request
//! dispatched), `passes.rs` (the ring's passes and its kept buffer), `streams.rs` (opening the links, running a
//! pass over them), `watch.rs` (probing the neighbours).

#![deny(missing_docs)]

pub mod activity;
mod collective;
mod error;
pub mod link;
pub mod node;
mod passes;
pub mod peer;
mod request;
pub mod ring;
mod ring_handle;
mod spec;
mod streams;
pub mod tls;
mod watch;

use std::sync::OnceLock;

use ddlf_core::auth::Token;

pub use error::CollectiveError;
pub use link::Link;
pub use node::LocalSpec;
pub use request::Request;
pub use ring::{Bf16Wire, Codec, Elem, F16Wire, Op, Phase, Plain, RingError, Side, Watch};
pub use ring_handle::Ring;
pub use spec::RingSpec;
pub use tls::PeerTls;

/// The token this process presents on the peer links it opens: the one its daemon was started with (set by
/// the daemon at start; workers of one cluster share the master's token).
pub fn set_local_token(token: Option<Token>) {
    let _ = LOCAL_TOKEN.set(token);
}

/// See [`set_local_token`].
pub fn local_token() -> Option<&'static Token> {
    LOCAL_TOKEN.get().and_then(Option::as_ref)
}

static LOCAL_TOKEN: OnceLock<Option<Token>> = OnceLock::new();
