//! What can go wrong in a collective ([`CollectiveError`]), naming the rank (and address) at fault.

use std::time::Duration;

use crate::peer;
use crate::ring::RingError;

/// What can go wrong in a collective, naming the rank (and address) at fault.
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    /// The ring cannot work as specified: a bad spec (ranks, streams, timeouts, a host's group), or no usable
    /// shared memory for a hierarchical one.
    #[error("invalid ring: {0}")]
    Invalid(String),
    /// A rank's address that resolves to nothing.
    #[error("cannot resolve rank {rank}'s address {address:?}")]
    Resolve {
        /// The rank.
        rank: usize,
        /// Its address, as the spec gives it.
        address: String,
    },
    /// The right neighbour's daemon did not take the link.
    #[error("cannot open a peer link to rank {rank} ({address}): {source}")]
    Open {
        /// The right neighbour's rank.
        rank: usize,
        /// Its daemon's address.
        address: String,
        /// Why.
        source: peer::OpenError,
    },
    /// The left neighbour's link did not arrive in time.
    #[error("rank {rank} ({address}) opened no peer link within {timeout:?}")]
    NoLink {
        /// The left neighbour's rank.
        rank: usize,
        /// Its daemon's address.
        address: String,
        /// How long this rank waited.
        timeout: Duration,
    },
    /// A pass failed, blaming the neighbour on `source`'s side.
    #[error("all-reduce failed with rank {rank} ({address}): {source}")]
    Ring {
        /// The neighbour's rank.
        rank: usize,
        /// Its daemon's address.
        address: String,
        /// What the pass saw.
        source: RingError,
    },
    /// The ring failed before; it refuses every later call.
    #[error("this ring failed before ({0}); form a new one from the ranks still alive")]
    Spent(String),
    /// A hierarchical ring's local stage failed, blaming a member on this host.
    #[error("local all-reduce failed with member {rank} on this host ({address}): {reason}")]
    Local {
        /// The member's local index.
        rank: usize,
        /// Its daemon's address.
        address: String,
        /// What went wrong.
        reason: String,
    },
}
