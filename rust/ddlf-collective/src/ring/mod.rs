//! The ring all-reduce itself: reduce-scatter then all-gather over one left and one right TCP link, pipelined.
//!
//! `data` is cut into `n` chunks (sizes differ by at most one element). In step `t` of `2(n-1)`, rank `r` sends
//! chunk `(r - t) mod n` to its right neighbour and receives chunk `(r - t - 1) mod n` from its left one: during the
//! first `n - 1` steps (reduce-scatter) the received elements are added to its own, during the last `n - 1`
//! (all-gather) they replace them. Each rank thus sends and receives `2(n-1)/n` times the data, whatever `n`.
//!
//! Everything runs on the calling thread over non-blocking sockets and `poll(2)`: bytes of step `t + 1` go out as
//! soon as the same elements of step `t` have been received and reduced, so sending, receiving and adding overlap
//! within a step (the kernel's socket buffers carry the transfer while this thread adds). One thread owns `data`
//! throughout, so there is no shared mutable memory; the one `unsafe` is the `poll(2)` call in `wait.rs`, on
//! two descriptors the links keep open.
//!
//! Why the all-gather never overwrites an element before this rank has sent its reduce-scatter value: the value
//! that arrives for element `i` of chunk `c` in the all-gather is the finished sum, which includes what this rank
//! sent for `i` during the reduce-scatter, so that send happened first.
//!
//! Every call starts by exchanging a 16-byte header with both neighbours (element type, wire type and count), so
//! ranks that disagree about what they reduce fail with [`RingError::Mismatch`] instead of adding unrelated bytes.
//!
//! **Half precision on the wire** ([`allreduce_over`] with a [`Codec`] such as [`F16Wire`]): every hop sends the
//! elements as float16 or bfloat16 (half the bytes) and every rank adds in float32. In the all-gather each reduced
//! chunk leaves its owner rounded to the wire type, and the owner keeps the same rounded value, so every rank still
//! ends with identical bits (a received value re-encodes to the same bits it arrived as).
//!
//! **Out of place** ([`allreduce_into_over`]): the pass reads the caller's arrays where they lie and writes the
//! results into other arrays, both cut anywhere ([`OutOfPlace`]), so a list of gradients needs no buffer. A mean
//! is scaled as the pass finishes with each chunk, not in a pass over the results afterwards.
//!
//! The parts, in the order a call meets them: the element types and how they travel (`codec.rs`), the call
//! header (`header.rs`), where a pass reads and writes (`target.rs`), the pipelined pass (`pass.rs`), and the
//! poll loop with its stall clock and liveness probes (`wait.rs`).

mod codec;
mod header;
mod pass;
mod target;
mod wait;

#[cfg(test)]
mod tests;

use std::io;
use std::ops::Range;
use std::time::Duration;

pub use crate::link::Link;
pub use codec::{Bf16Wire, Codec, Elem, F16Wire, Plain};
pub use wait::{Probe, Watch};

use header::exchange_header;
use pass::Pass;
pub use pass::Phase;
pub use target::OutOfPlace;
use target::{scale, Target};
use wait::io_error;

/// What one reduction does with the summed values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// The element-wise sum over ranks.
    Sum,
    /// The element-wise mean over ranks (the sum divided by `n`).
    Mean,
}

/// Why one ring pass failed. The caller knows the neighbours' ranks and addresses and names them.
#[derive(Debug, thiserror::Error)]
pub enum RingError {
    /// A link's socket failed.
    #[error("the link to the {side} neighbour failed: {source}")]
    Io {
        /// Which link.
        side: Side,
        /// The system's error.
        source: io::Error,
    },
    /// A neighbour closed its link (its process ended, or its ring failed).
    #[error("the {side} neighbour closed the link")]
    Closed {
        /// Which neighbour.
        side: Side,
    },
    /// Nothing moved for [`Watch::stall`].
    #[error("the {side} neighbour made no progress for {after:?} (stopped, or its link is down)")]
    Stalled {
        /// The neighbour waited on.
        side: Side,
        /// How long nothing moved.
        after: Duration,
    },
    #[error(
        "the {side} neighbour made no progress for {after:?} and its daemon did not answer a liveness probe \
         ({reason}): its process is stopped or its host unreachable"
    )]
    /// Nothing moved, and the neighbour's daemon failed a liveness probe.
    Unresponsive {
        /// The neighbour waited on.
        side: Side,
        /// How long nothing had moved.
        after: Duration,
        /// Why the probe failed.
        reason: String,
    },
    #[error(
        "the left neighbour reduces {their_len} {their_type} elements and this rank {our_len} {our_type}: \
         every rank must pass arrays of the same dtypes and sizes, with the same wire precision"
    )]
    /// The left neighbour's call header names other elements than this rank's.
    Mismatch {
        /// The neighbour's element count.
        their_len: u64,
        /// The neighbour's element and wire type.
        their_type: String,
        /// This rank's element count.
        our_len: u64,
        /// This rank's element and wire type.
        our_type: String,
    },
    /// The left neighbour's call header is not a ring's.
    #[error("the left neighbour sent an unreadable header (not a ddlf ring)")]
    BadHeader,
}

/// Which neighbour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The rank before this one: data comes in from it.
    Left,
    /// The rank after this one: data goes out to it.
    Right,
}

impl std::fmt::Display for Side {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Side::Left => "left",
            Side::Right => "right",
        })
    }
}

/// One rank's two links in one ring: data comes in from the left, goes out to the right. Both non-blocking.
#[derive(Debug)]
pub struct Links {
    /// From the left neighbour (this rank reads it).
    pub left: Link,
    /// To the right neighbour (this rank writes it).
    pub right: Link,
}

impl Links {
    /// Push encrypted bytes still waiting on the right link (TLS); whether any moved.
    fn flush(&mut self) -> Result<bool, RingError> {
        self.right.flush().map_err(|e| io_error(Side::Right, e))
    }
}

/// The element range of chunk `c` of `n` over `len` elements.
pub fn chunk(len: usize, n: usize, c: usize) -> Range<usize> {
    let at = |i: usize| ((i as u128 * len as u128) / n as u128) as usize;
    at(c)..at(c + 1)
}

/// All-reduce `data` in place with the ranks of this ring. `n == 1` leaves `data` as it is (a mean of one).
/// `watch`: how long either neighbour may go without progress, and how its liveness is checked meanwhile.
pub fn allreduce<T: Elem>(
    data: &mut [T],
    rank: usize,
    n: usize,
    links: &mut Links,
    op: Op,
    watch: Watch<'_>,
) -> Result<(), RingError> {
    allreduce_over::<T, Plain>(data, rank, n, links, op, watch)
}

/// [`allreduce`] with the elements sent as `C::W` (see the module docs on half precision).
pub fn allreduce_over<T: Elem, C: Codec<T>>(
    data: &mut [T],
    rank: usize,
    n: usize,
    links: &mut Links,
    op: Op,
    watch: Watch<'_>,
) -> Result<(), RingError> {
    all_reduce::<T, C, [T]>(data, rank, n, links, op, watch)
}

/// [`allreduce_over`] out of place: `data`'s input is only read (sent from where it lies) and the results are
/// written into its output, with no buffer in between. A ring of one copies the input.
pub fn allreduce_into_over<T: Elem, C: Codec<T>>(
    data: &mut OutOfPlace<'_, T>,
    rank: usize,
    n: usize,
    links: &mut Links,
    op: Op,
    watch: Watch<'_>,
) -> Result<(), RingError> {
    all_reduce::<T, C, _>(data, rank, n, links, op, watch)
}

fn all_reduce<T: Elem, C: Codec<T>, D: Target<T> + ?Sized>(
    data: &mut D,
    rank: usize,
    n: usize,
    links: &mut Links,
    op: Op,
    watch: Watch<'_>,
) -> Result<(), RingError> {
    if n <= 1 {
        data.unreduced();
        return Ok(());
    }
    let len = data.elements();
    exchange_header::<T, C>(len as u64, Phase::Both, links, watch)?;
    let pass = Pass::new(len, rank, n, Phase::Both);
    let pass = if op == Op::Mean {
        pass.scaled(1.0 / n as f64)
    } else {
        pass
    };
    pass.run::<T, C, D>(data, links, watch)
}

/// The elements rank `rank` of `n` owns between [`reduce_scatter_over`] and [`allgather_over`]: chunk `rank`.
pub fn shard(len: usize, n: usize, rank: usize) -> Range<usize> {
    chunk(len, n, rank)
}

/// The first half of [`allreduce_over`]: afterwards this rank's [`shard`] of `data` holds the reduction over the
/// ranks (the sum, or the mean), and the rest of `data` partial sums that mean nothing. Each rank sends and
/// receives `(n-1)/n` times the data. Returns the shard.
pub fn reduce_scatter_over<T: Elem, C: Codec<T>>(
    data: &mut [T],
    rank: usize,
    n: usize,
    links: &mut Links,
    op: Op,
    watch: Watch<'_>,
) -> Result<Range<usize>, RingError> {
    let mine = shard(data.len(), n.max(1), rank);
    if n <= 1 {
        return Ok(mine);
    }
    exchange_header::<T, C>(data.len() as u64, Phase::Scatter, links, watch)?;
    Pass::new(data.len(), rank, n, Phase::Scatter).run::<T, C, [T]>(data, links, watch)?;
    if op == Op::Mean {
        scale(&mut data[mine.clone()], 1.0 / n as f64);
    }
    Ok(mine)
}

/// The second half of [`allreduce_over`]: each rank's [`shard`] of `data` goes to every rank, so that all end
/// with the same `data` (with a half-precision `C`, each shard leaves its owner rounded, and the owner keeps the
/// rounded value too). Each rank sends and receives `(n-1)/n` times the data.
pub fn allgather_over<T: Elem, C: Codec<T>>(
    data: &mut [T],
    rank: usize,
    n: usize,
    links: &mut Links,
    watch: Watch<'_>,
) -> Result<(), RingError> {
    if n <= 1 {
        return Ok(());
    }
    exchange_header::<T, C>(data.len() as u64, Phase::Gather, links, watch)?;
    Pass::new(data.len(), rank, n, Phase::Gather).run::<T, C, [T]>(data, links, watch)
}
