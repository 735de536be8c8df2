//! One collective call, as a value ([`Request`]): which collective (an all-reduce or one of its halves), where its
//! data comes from and where its result goes, how the elements travel ([`Codec`]) and whether a failure must leave
//! the data as it was. [`Ring::run`](crate::Ring::run) takes it and dispatches on it, so that a caller names what
//! it wants instead of picking one of several entry points.
//!
//! ```no_run
//! # use ddlf_collective::{CollectiveError, F16Wire, Op, Request, Ring};
//! # fn calls(ring: &mut Ring, data: &mut [f32], a: &mut [f32], b: &mut [f32]) -> Result<(), CollectiveError> {
//! // The sum of `data` over the ranks, in place.
//! ring.run(Request::allreduce(data, Op::Sum))?;
//! // The mean of a list of arrays (their concatenation), sent at half precision, unchanged if the call fails.
//! ring.run(Request::allreduce_parts(&mut [a, b], Op::Mean).codec::<F16Wire>().atomic(true))?;
//! // The first half of an all-reduce: the shard this rank now holds reduced.
//! let shard = ring.run(Request::reduce_scatter(data, Op::Mean))?;
//! # let _ = shard;
//! # Ok(())
//! # }
//! ```

use std::marker::PhantomData;
use std::ops::Range;

use crate::node::SharedResult;
use crate::ring::{Codec, Elem, Op, Plain};

/// One collective call for [`Ring::run`](crate::Ring::run), which returns an `R`: `()` for an all-reduce, the
/// rank's shard for a reduce-scatter, the result's place in shared memory for
/// [`Request::allreduce_shared`]. `C`: how the elements travel between hosts ([`Plain`], or half precision on
/// the wire with [`F16Wire`](crate::F16Wire) or [`Bf16Wire`](crate::Bf16Wire), sums in `T`), chosen with
/// [`Request::codec`]. Every rank of a ring makes the same calls, in the same order, with the same element
/// type, element count and codec.
///
/// The constructors name the collective and where the result goes:
///
/// | constructor                   | the data                                     | `R`: the result         |
/// |-------------------------------|----------------------------------------------|-------------------------|
/// | [`Request::allreduce`]        | one slice, reduced in place                  | `()`                    |
/// | [`Request::allreduce_parts`]  | several slices reduced as one, in place      | `()`                    |
/// | [`Request::allreduce_into`]   | sources only read, the result into outputs   | `()`                    |
/// | [`Request::allreduce_shared`] | sources only read, the result left in shared memory | [`SharedResult`] |
/// | [`Request::reduce_scatter`]   | one slice, this rank's shard reduced         | the shard, a `Range`    |
/// | [`Request::allgather`]        | one slice, every rank's shard gathered       | `()`                    |
#[must_use = "a request does nothing until a ring runs it"]
pub struct Request<'a, 'b, T, R = (), C = Plain> {
    pub(crate) call: Call<'a, 'b, T>,
    /// A failure must leave the data as it was ([`Request::atomic`]).
    pub(crate) atomic: bool,
    /// The caller's result, out of what the call returned (`None`: the call left none).
    pub(crate) result: fn(Done) -> Option<R>,
    codec: PhantomData<fn() -> C>,
}

/// Which collective a [`Request`] makes, on which data.
pub(crate) enum Call<'a, 'b, T> {
    /// The whole all-reduce.
    AllReduce {
        /// The sum, or the mean over every rank.
        op: Op,
        /// Where the data comes from and the result goes.
        io: Io<'a, 'b, T>,
    },
    /// The first half of an all-reduce: this rank's shard of `data` reduced.
    ReduceScatter {
        /// The shard's sum, or mean.
        op: Op,
        /// Every rank's data; only the shard means something afterwards.
        data: &'a mut [T],
    },
    /// The second half of an all-reduce: every rank's shard of `data` to every rank.
    AllGather {
        /// This rank's shard filled in; every rank's afterwards.
        data: &'a mut [T],
    },
}

/// Where an all-reduce reads its data and leaves its result.
pub(crate) enum Io<'a, 'b, T> {
    /// One slice, reduced where it lies.
    One(&'a mut [T]),
    /// Slices reduced as one sequence (their concatenation, in order), each where it lies.
    Parts(&'a mut [&'b mut [T]]),
    /// Sources only read, and the outputs the result is written into (as many elements in all).
    Into(&'a [&'b [T]], &'a mut [&'b mut [T]]),
    /// Sources only read, and the result left in shared memory under a tag (1 to [`crate::node::MAX_TAG`] - 1).
    Shared(&'a [&'b [T]], u32),
}

/// What a call hands back, before [`Request`]'s `result` makes the caller's type of it.
pub(crate) enum Done {
    /// Nothing: the result is in the caller's arrays.
    Reduced,
    /// A reduce-scatter: the shard this rank holds reduced.
    Shard(Range<usize>),
    /// The result left in shared memory (`None`: the host's stage left none).
    Shared(Option<SharedResult>),
}

impl<'a, 'b, T: Elem> Request<'a, 'b, T> {
    /// All-reduce `data` in place with the other ranks (every rank passes the same element count). A failure
    /// leaves `data` as it was on a hierarchical ring or a ring of one (see
    /// [`Ring::leaves_data_on_failure`](crate::Ring::leaves_data_on_failure)); a flat ring's passes write `data`
    /// as they go, unless the request is [`Request::atomic`].
    pub fn allreduce(data: &'a mut [T], op: Op) -> Self {
        Self::new(Call::AllReduce {
            op,
            io: Io::One(data),
        })
    }

    /// [`Request::allreduce`] of several slices reduced as one (their concatenation, in order; every rank passes
    /// the same total, however it is cut). A hierarchical rank copies each part into shared memory and the
    /// result back into it, as it does one slice: a list costs what one array of its size does. A flat ring's
    /// pass reads several parts where they lie and writes the results into a buffer the ring keeps, scattered
    /// back after the reduction succeeded (so on failure they are unchanged, atomic or not); one part is
    /// reduced where it lies, as [`Request::allreduce`] reduces it.
    pub fn allreduce_parts(parts: &'a mut [&'b mut [T]], op: Op) -> Self {
        Self::new(Call::AllReduce {
            op,
            io: Io::Parts(parts),
        })
    }

    /// [`Request::allreduce_parts`] out of place: `parts` are only read and the result is written into `into`
    /// (as many elements, cut however the caller likes; a call with another count is refused before it starts,
    /// with an `Invalid` error that leaves the ring usable; on failure `into` holds nothing meaningful). A
    /// hierarchical rank reads the parts into shared memory and copies the result straight into `into`, so no
    /// copy is added: a gradient goes to the reduction from the buffer its framework made, and the result into
    /// a buffer the framework then reads. A flat ring's pass does the same over the wire: it sends the parts from
    /// where they lie and writes the results straight into `into` ([`crate::ring::OutOfPlace`]).
    pub fn allreduce_into(parts: &'a [&'b [T]], into: &'a mut [&'b mut [T]], op: Op) -> Self {
        Self::new(Call::AllReduce {
            op,
            io: Io::Into(parts, into),
        })
    }

    /// The second half of an all-reduce (a sharded optimizer's new weights): every rank passes `data` with its
    /// [`Ring::shard`](crate::Ring::shard) filled in, and all end with every rank's shard. With a half-precision
    /// codec each shard travels rounded (its owner keeps the rounded value too), so every rank ends with the same
    /// bits. A failure leaves `data` changed, and the ring spent.
    pub fn allgather(data: &'a mut [T]) -> Self {
        Self::new(Call::AllGather { data })
    }

    fn new(call: Call<'a, 'b, T>) -> Self {
        Request {
            call,
            atomic: false,
            result: |_| Some(()),
            codec: PhantomData,
        }
    }
}

impl<'a, 'b, T: Elem> Request<'a, 'b, T, SharedResult> {
    /// [`Request::allreduce_into`] with the result left in shared memory, no copy out: the mean (or sum) of the
    /// parts' concatenation as bytes of the host's mapping, for one host holding every rank
    /// ([`Ring::shares_results`](crate::Ring::shares_results); else an `Invalid` error, before the call). The
    /// region is rewritten only by the next call with the same `tag` (every rank passes the same; 0 is every
    /// other call's, and a tag travels in 24 bits: either is refused before the call), once every member has
    /// entered it: a rank reads its result before it makes that call. The mapping stays valid while the result
    /// is held.
    pub fn allreduce_shared(parts: &'a [&'b [T]], op: Op, tag: u32) -> Self {
        Request {
            call: Call::AllReduce {
                op,
                io: Io::Shared(parts, tag),
            },
            atomic: false,
            result: |done| match done {
                Done::Shared(shared) => shared,
                _ => None,
            },
            codec: PhantomData,
        }
    }
}

impl<'a, 'b, T: Elem> Request<'a, 'b, T, Range<usize>> {
    /// The first half of an all-reduce (a sharded optimizer's gradients): afterwards
    /// `data[ring.shard(data.len())]` holds the reduction over every rank, and the rest of `data` means nothing;
    /// the call returns that shard ([`Ring::shard`](crate::Ring::shard)). Each rank sends about `(n-1)/n` times
    /// the data, half of what an all-reduce sends. A flat ring runs it on its first stream. A failure leaves
    /// `data` changed, and the ring spent.
    pub fn reduce_scatter(data: &'a mut [T], op: Op) -> Self {
        Request {
            call: Call::ReduceScatter { op, data },
            atomic: false,
            result: |done| match done {
                Done::Shard(shard) => Some(shard),
                _ => None,
            },
            codec: PhantomData,
        }
    }
}

impl<'a, 'b, T: Elem, R, C: Codec<T>> Request<'a, 'b, T, R, C> {
    /// The same call with the elements sent as `D::W` (half precision on the wire with
    /// [`F16Wire`](crate::F16Wire) or [`Bf16Wire`](crate::Bf16Wire), sums in `T`; [`Plain`] unless chosen).
    pub fn codec<D: Codec<T>>(self) -> Request<'a, 'b, T, R, D> {
        Request {
            call: self.call,
            atomic: self.atomic,
            result: self.result,
            codec: PhantomData,
        }
    }

    /// Whether a failure must leave the data as it was (default: no). Only an all-reduce in place
    /// ([`Request::allreduce`], [`Request::allreduce_parts`]) can promise it: a hierarchical ring or a ring of
    /// one writes the data only after the last step that can fail anyway; a flat ring, whose passes write as
    /// they go, reduces into the buffer it keeps between calls (warm memory, not a fresh allocation) and copies
    /// the result back on success. Any other request made atomic is refused before the call, with an `Invalid`
    /// error that leaves the ring usable.
    pub fn atomic(self, atomic: bool) -> Self {
        Request { atomic, ..self }
    }
}
