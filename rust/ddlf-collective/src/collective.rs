//! [`Ring::run`]: one code path for every [`Request`]. It first refuses what the request itself makes impossible
//! (the ring stays usable), then, guarded ([`Ring::guarded`]: a failure spends the ring), runs the call where the
//! ring does its work: a hierarchical ring on its host's stage ([`node`]), whose leader runs the hosts' ring
//! between its two steps; a flat ring on its passes (`passes.rs`); a ring of one nowhere (its sum and its mean are
//! its data).

use std::cell::RefCell;
use std::ops::Range;

use crate::node;
use crate::passes::{into_mismatch, out_of_place};
use crate::request::{Call, Done, Io};
use crate::ring::{Codec, Elem, Op, Phase};
use crate::{CollectiveError, Request, Ring};

/// What a hierarchical ring's host stage runs ([`Ring::on_node`]).
enum Stage<'a, 'b, 'c, T> {
    /// The whole all-reduce, with its data and where the result goes.
    AllReduce(node::Io<'a, 'b, 'c, T>, Op),
    /// The reduce-scatter of the data, down to this member's shard.
    ReduceScatter(&'a mut [T], Op, Range<usize>),
    /// The all-gather of the data, from this member's shard.
    AllGather(&'a mut [T], Range<usize>),
}

impl Ring {
    /// Run `request` with the other ranks, and hand back its result (see [`Request`] for each call and what it
    /// returns). A call the request itself makes impossible is refused with an `Invalid` error before it starts,
    /// and the ring stays usable: outputs that do not hold as many elements as the sources
    /// ([`Request::allreduce_into`]), a result left in shared memory where no one host holds every rank or under a
    /// tag out of range ([`Request::allreduce_shared`]), an atomic request that is not an all-reduce in place
    /// ([`Request::atomic`]). Any other failure names the rank at fault and spends the ring: its links close, and
    /// every later call is refused with `Spent` (form a new ring from the ranks still alive).
    pub fn run<T: Elem, R, C: Codec<T>>(
        &mut self,
        request: Request<'_, '_, T, R, C>,
    ) -> Result<R, CollectiveError> {
        let Request {
            call,
            atomic,
            result,
            ..
        } = request;
        self.refuse(&call, atomic)?;
        let what = describe(&call);
        let done = self.guarded(&what, move |ring| ring.dispatch::<T, C>(call, atomic))?;
        result(done).ok_or_else(|| CollectiveError::Invalid("the call left no result".into()))
    }

    /// Refuse `call` before it starts, where the request itself makes it impossible: a caller's mistake does not
    /// spend the ring.
    fn refuse<T: Elem>(&self, call: &Call<'_, '_, T>, atomic: bool) -> Result<(), CollectiveError> {
        match call {
            Call::AllReduce {
                io: Io::One(_) | Io::Parts(_),
                ..
            } => Ok(()),
            _ if atomic => Err(CollectiveError::Invalid(
                "only an all-reduce in place can promise to leave its data as it was on failure (atomic)".into(),
            )),
            Call::AllReduce {
                io: Io::Into(parts, into),
                ..
            } => {
                let (len, out) = (total(parts), total(into));
                match len == out {
                    true => Ok(()),
                    false => Err(into_mismatch(len, out)),
                }
            }
            Call::AllReduce {
                io: Io::Shared(_, tag),
                ..
            } => {
                if !self.shares_results() {
                    return Err(CollectiveError::Invalid(
                        "a result stays in shared memory only on one host holding every rank".into(),
                    ));
                }
                node::check_tag(*tag)
            }
            Call::ReduceScatter { .. } | Call::AllGather { .. } => Ok(()),
        }
    }

    /// Run `call` (not refused; inside the guard) where this ring does its work (see the module docs).
    fn dispatch<T: Elem, C: Codec<T>>(
        &mut self,
        call: Call<'_, '_, T>,
        atomic: bool,
    ) -> Result<Done, CollectiveError> {
        let hosts = self.n();
        match call {
            Call::AllReduce {
                op,
                io: Io::One(data),
            } => self.dispatch::<T, C>(
                Call::AllReduce {
                    op,
                    io: Io::Parts(&mut [data]),
                },
                atomic,
            ),
            Call::AllReduce {
                op,
                io: Io::Parts(parts),
            } => {
                match self.node.take() {
                    Some(node) => {
                        self.on_node::<T, C>(node, Stage::AllReduce(node::Io::InPlace(parts), op))?
                    }
                    None if hosts == 1 => {}
                    None => self.flat_in_place::<T, C>(parts, op, atomic)?,
                }
                Ok(Done::Reduced)
            }
            Call::AllReduce {
                op,
                io: Io::Into(parts, into),
            } => {
                match self.node.take() {
                    Some(node) => self
                        .on_node::<T, C>(node, Stage::AllReduce(node::Io::Into(parts, into), op))?,
                    None => {
                        // The pass reads the parts where they lie and writes the results into `into`: nothing in
                        // between.
                        let into: Vec<&mut [T]> = into.iter_mut().map(|p| &mut **p).collect();
                        let mut data = out_of_place(parts.to_vec(), into)?;
                        if hosts == 1 {
                            data.copy();
                        } else {
                            self.reduce_into::<T, C>(data, op)?;
                        }
                    }
                }
                Ok(Done::Reduced)
            }
            Call::AllReduce {
                op,
                io: Io::Shared(parts, tag),
            } => {
                let Some(node) = self.node.take() else {
                    return Err(CollectiveError::Invalid(
                        "a hierarchical ring without its node".into(),
                    ));
                };
                let mut out = None;
                let io = node::Io::Shared(parts, tag, &mut out);
                self.on_node::<T, C>(node, Stage::AllReduce(io, op))?;
                Ok(Done::Shared(out))
            }
            Call::ReduceScatter { op, data } => {
                let shard = self.shard(data.len());
                match self.node.take() {
                    Some(node) => {
                        self.on_node::<T, C>(node, Stage::ReduceScatter(data, op, shard.clone()))?
                    }
                    None if hosts == 1 => {}
                    None => self.phase::<T, C>(data, op, Phase::Scatter)?,
                }
                Ok(Done::Shard(shard))
            }
            Call::AllGather { data } => {
                let shard = self.shard(data.len());
                match self.node.take() {
                    Some(node) => self.on_node::<T, C>(node, Stage::AllGather(data, shard))?,
                    None if hosts == 1 => {}
                    None => self.phase::<T, C>(data, Op::Sum, Phase::Gather)?,
                }
                Ok(Done::Reduced)
            }
        }
    }

    /// `stage` on this hierarchical ring's `node` (taken out of the ring for the call, put back after it): the
    /// host's members reduce through shared memory, and the leader runs the matching part of the hosts' ring (a
    /// sum) on their result.
    fn on_node<T: Elem, C: Codec<T>>(
        &mut self,
        mut node: node::Node,
        stage: Stage<'_, '_, '_, T>,
    ) -> Result<(), CollectiveError> {
        let leads = node.is_leader() && self.n() > 1;
        let phase = match &stage {
            Stage::AllReduce(..) => Phase::Both,
            Stage::ReduceScatter(..) => Phase::Scatter,
            Stage::AllGather(..) => Phase::Gather,
        };
        // The leader opens its links before the local stage and runs the hosts' ring after it: the two steps run
        // one after the other, each borrowing the ring.
        let this = RefCell::new(&mut *self);
        let prepare = || this.borrow_mut().open_if(leads);
        let inter = |all: &mut [T]| match (leads, phase) {
            (false, _) => Ok(()),
            (true, Phase::Both) => this.borrow_mut().reduce::<T, C>(all, Op::Sum),
            (true, phase) => this.borrow_mut().phase::<T, C>(all, Op::Sum, phase),
        };
        let r = match stage {
            Stage::AllReduce(io, op) => node.allreduce(io, op, prepare, inter),
            Stage::ReduceScatter(data, op, shard) => {
                node.reduce_scatter(data, op, shard, prepare, inter)
            }
            Stage::AllGather(data, shard) => node.allgather(data, shard, prepare, inter),
        };
        self.node = Some(node);
        r
    }
}

/// What `call` does, for [`crate::activity`] (e.g. "all-reduce of 1000 float32").
fn describe<T: Elem>(call: &Call<'_, '_, T>) -> String {
    let (what, len) = match call {
        Call::AllReduce { io, .. } => (
            "all-reduce",
            match io {
                Io::One(data) => data.len(),
                Io::Parts(parts) => total(parts),
                Io::Into(parts, _) | Io::Shared(parts, _) => total(parts),
            },
        ),
        Call::ReduceScatter { data, .. } => ("reduce-scatter", data.len()),
        Call::AllGather { data } => ("all-gather", data.len()),
    };
    format!("{what} of {len} {}", T::NAME)
}

/// How many elements `parts` hold together.
fn total<T, P: AsRef<[T]>>(parts: &[P]) -> usize {
    parts.iter().map(|p| p.as_ref().len()).sum()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::{CollectiveError, F16Wire, Op, Request, Ring, RingSpec};

    /// A flat ring of `addresses.len()` ranks, this one rank 0.
    fn ring(group: u128, addresses: Vec<String>) -> Ring {
        let spec = RingSpec {
            group,
            rank: 0,
            addresses,
            streams: 1,
            timeout: Duration::from_secs(1),
            liveness: Duration::from_secs(1),
            tls: None,
            local: None,
        };
        Ring::new(spec, None).unwrap()
    }

    fn invalid<R>(r: Result<R, CollectiveError>) -> bool {
        matches!(r, Err(CollectiveError::Invalid(_)))
    }

    #[test]
    fn a_ring_of_one_runs_every_request_without_a_link() {
        // Its sum and its mean are its data: no call opens a link (the address is never dialled).
        let mut ring = ring(1, vec!["127.0.0.1:9".into()]);
        let mut data = [1f32, 2.0, 3.0];
        ring.run(Request::allreduce(&mut data, Op::Mean).codec::<F16Wire>())
            .unwrap();
        assert_eq!(data, [1.0, 2.0, 3.0]);
        let (mut a, mut b) = ([4f64, 5.0], [6f64]);
        ring.run(Request::allreduce_parts(&mut [&mut a, &mut b], Op::Sum).atomic(true))
            .unwrap();
        assert_eq!((a, b), ([4.0, 5.0], [6.0]));
        // Out of place, the outputs cut elsewhere than the sources: the sources copied.
        let (mut x, mut y) = ([0f32; 1], [0f32; 2]);
        let sources: [&[f32]; 3] = [&[1.0, 2.0], &[], &[3.0]];
        ring.run(Request::allreduce_into(
            &sources,
            &mut [&mut x, &mut y],
            Op::Sum,
        ))
        .unwrap();
        assert_eq!((x, y), ([1.0], [2.0, 3.0]));
        let mut data = [7f32; 5];
        let shard = ring
            .run(Request::reduce_scatter(&mut data, Op::Mean))
            .unwrap();
        assert_eq!((shard, ring.shard(5)), (0..5, 0..5));
        ring.run(Request::allgather(&mut data)).unwrap();
        assert_eq!(data, [7.0; 5]);
    }

    #[test]
    fn requests_a_ring_cannot_run_are_refused_before_the_call_and_leave_it_usable() {
        let mut ring = ring(2, vec!["127.0.0.1:9".into()]);
        let mut data = [1f32; 4];
        let mut out = [0f32; 4];
        // Only an all-reduce in place promises to leave its data as it was.
        assert!(invalid(
            ring.run(Request::reduce_scatter(&mut data, Op::Sum).atomic(true))
        ));
        assert!(invalid(
            ring.run(Request::allgather(&mut data).atomic(true))
        ));
        assert!(invalid(ring.run(
            Request::allreduce_into(&[&[1.0; 4]], &mut [&mut out], Op::Sum).atomic(true)
        )));
        // Outputs that do not hold as many elements as the sources.
        let mut short = [0f32; 3];
        assert!(invalid(ring.run(Request::allreduce_into(
            &[&[1.0; 4]],
            &mut [&mut short],
            Op::Sum
        ))));
        // A result left in shared memory: only on a host holding every rank (a flat ring has no host stage).
        assert!(!ring.shares_results());
        assert!(invalid(ring.run(Request::allreduce_shared(
            &[&[1f32; 4]],
            Op::Sum,
            1
        ))));
        // None of them spent the ring.
        ring.run(Request::allreduce(&mut data, Op::Sum).atomic(true))
            .unwrap();
    }

    #[test]
    fn a_failed_call_spends_the_ring_for_every_kind_of_request() {
        // A neighbour whose daemon is gone: its port refuses the link.
        let gone = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = gone.local_addr().unwrap().to_string();
        drop(gone);
        let mut ring = ring(3, vec![address.clone(), address]);
        let mut data = [1f32; 4];
        let failed = ring.run(Request::reduce_scatter(&mut data, Op::Sum));
        assert!(
            matches!(failed, Err(CollectiveError::Open { rank: 1, .. })),
            "{failed:?}"
        );
        let spent = |r: Result<(), CollectiveError>| matches!(r, Err(CollectiveError::Spent(_)));
        assert!(spent(ring.run(Request::allreduce(&mut data, Op::Sum))));
        assert!(spent(
            ring.run(Request::allreduce(&mut data, Op::Sum).atomic(true))
        ));
        assert!(spent(ring.run(Request::allgather(&mut data))));
        let mut out = [0f32; 4];
        assert!(spent(ring.run(Request::allreduce_into(
            &[&[1.0; 4]],
            &mut [&mut out],
            Op::Sum
        ))));
        assert!(spent(
            ring.run(Request::reduce_scatter(&mut data, Op::Sum))
                .map(|_| ())
        ));
        // A request refused before the call is still refused as such.
        let mut short = [0f32; 3];
        assert!(invalid(ring.run(Request::allreduce_into(
            &[&[1.0; 4]],
            &mut [&mut short],
            Op::Sum
        ))));
    }
}
