//! The local stage of a hierarchical all-reduce: the members of a ring on one host reduce through shared memory,
//! only their leader (local index 0) runs the ring between hosts, and the result fans back out through shared
//! memory. Loopback TCP carries nothing.
//!
//! A control file per node (a header page: the barrier words, each member's call shape, a failure flag and its
//! reason) and data files for the calls (a header page, one slot per member and a result region; a file serves
//! every call of its element size and tag whose length it holds, see [`Node::segment_for`]), both under
//! `/dev/shm`, created by the leader and removed as soon as every member has mapped them (a crash leaves nothing
//! behind). A call goes:
//!
//! 0. every member publishes its call's shape; **barrier**; members that disagree fail together (no hang);
//! 1. every member copies its data into its slot, all but its own `1/k` chunk; **barrier**;
//! 2. member `j` sums its chunk of the result: its own data's and the other `k - 1` slots', in member order (the
//!    members reduce in parallel); **barrier**;
//! 3. the leader all-reduces the result with the other hosts' leaders (the inter-host ring, sum); **barrier**;
//! 4. every member copies the result out (scaled by `1/n` for a mean over all `n` ranks of every host).
//!
//! Every member ends with the same bits (it copies the same result; the local sum runs in member order).
//!
//! The halves of a call, for sharded optimizers ([`Node::reduce_scatter`], [`Node::allgather`]): a member's
//! shard is its `1/k` sub-chunk of its host's chunk of the hosts' ring ([`Node::shard`]). The reduce-scatter runs
//! steps 0-2, the leaders' ring runs only its own reduce-scatter in step 3, and step 4 copies out the shard
//! alone. The all-gather skips the slots: after step 0 every member writes its shard straight into the result
//! region; **barrier**; the leaders' ring all-gathers the hosts' chunks; **barrier**; every member copies the
//! whole result out. A barrier
//! waits while it may (the ring's `timeout`: a member may still be computing), probing the daemon of a member
//! it waits on every quarter of the liveness bound ([`crate::peer::probe`]): a member whose process died or
//! stopped fails the call on every member within that bound. Any member that fails marks the control file failed with
//! its reason, and the others stop at once; the node is then spent, as a ring is.
//!
//! A host that holds every rank (no ring between hosts) skips step 3 and its barrier, and takes the mean's scale in
//! step 2, so step 4 is a plain copy.
//!
//! The files: this one, the node and its calls (their shapes checked, a failure marked for every member);
//! `steps.rs`, a call's steps 0-4 and the all-gather's; `barrier.rs`, the members waiting for each other, the
//! failure flag and the liveness probes; `files.rs`, the shared-memory files named, made, mapped and chosen for a
//! call; `segment.rs`, one file's layout and mapping.

mod barrier;
mod files;
mod segment;
mod steps;

use std::net::{SocketAddr, ToSocketAddrs};
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use ddlf_core::auth::Token;

use crate::ring::{Elem, Op};
use crate::tls::PeerTls;
use crate::CollectiveError;

use segment::Segment;
pub use segment::MAX_MEMBERS;

/// One member's place in its host's group.
#[derive(Clone, Debug)]
pub struct LocalSpec {
    /// This member's index on its host (0: the leader, which runs the ring between hosts).
    pub index: usize,
    /// The daemon addresses of the host's members, in local order (for liveness probes).
    pub addresses: Vec<String>,
    /// Ranks in the whole reduction (every host's members): a mean divides by it.
    pub total: usize,
}

/// One member of a host's group (see the module docs).
pub struct Node {
    group: u128,
    spec: LocalSpec,
    peers: Vec<SocketAddr>,
    token: Option<Token>,
    tls: Option<PeerTls>,
    timeout: Duration,
    liveness: Duration,
    /// Barriers, shapes and failures, for the node's life.
    control: Option<Segment>,
    /// The data files kept (oldest first; see [`Node::segment_for`]).
    segments: Vec<Segment>,
    /// Data files made so far (every member makes the same sequence, so the count names the next file).
    serial: u64,
    barrier: u64,
    spent: Option<String>,
    /// The call in progress ([`crate::activity`]; set by the ring).
    pub(crate) activity: u64,
}
/// Tags ([`Io::Shared`]) travel in the top 24 bits of a member's published call shape.
pub const MAX_TAG: u32 = 1 << 24;

/// Refuse a tag that [`Io::Shared`] cannot take: 0 (every other call's) or one past 24 bits.
pub fn check_tag(tag: u32) -> Result<(), CollectiveError> {
    if tag == 0 || tag >= MAX_TAG {
        return Err(CollectiveError::Invalid(format!(
            "a tag of {tag}: a result left in shared memory takes a tag from 1 to {}, its own (0 is every \
             other call's)",
            MAX_TAG - 1
        )));
    }
    Ok(())
}

/// Which call a member makes (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
enum Mode {
    /// The whole all-reduce.
    Both,
    /// The reduce-scatter: only this member's shard (these elements) comes out.
    Scatter(Range<usize>),
    /// The all-gather: only this member's shard (these elements) goes in.
    Gather(Range<usize>),
}

/// Where a call reads its data and writes its result.
pub enum Io<'a, 'b, 'c, T> {
    /// The same arrays.
    InPlace(&'a mut [&'b mut [T]]),
    /// The sources (only read), and the arrays the result goes to (as many elements, cut as the caller likes;
    /// written only after the last step that can fail).
    Into(&'a [&'c [T]], &'a mut [&'b mut [T]]),
    /// The sources (only read), and where the result is left: in shared memory, handed out as
    /// [`SharedResult`] (one host holding every rank only; see [`Node::single_host`]). The region is written
    /// again by the next call with the same tag (the `u32`, which every member passes alike; no other call
    /// touches it), and every member reaches that call's writes only after each has entered that call: a
    /// member reads its result before it makes its next call with the tag.
    Shared(&'a [&'c [T]], u32, &'a mut Option<SharedResult>),
}

/// A call's result left in shared memory: `len` bytes at byte `start` of `map` (on a cache line), which the `Arc`
/// keeps mapped however long the caller holds it.
pub struct SharedResult {
    /// The host's mapping of the call's shared-memory file.
    pub map: Arc<memmap2::MmapMut>,
    /// The result's first byte in it.
    pub start: usize,
    /// The result's length in bytes.
    pub len: usize,
}

/// A call whose steps that can fail are done: the result lies in segment `current`'s result region, to be copied
/// out (times `scale`, if any).
struct Ready {
    current: usize,
    /// The call's elements (the segment may hold more: see [`Node::segment_for`]).
    len: usize,
    scale: Option<f64>,
}

impl Node {
    /// Check `spec` and resolve the members' addresses; the shared-memory files are made on the first call.
    pub fn new(
        group: u128,
        spec: LocalSpec,
        token: Option<Token>,
        tls: Option<PeerTls>,
        timeout: Duration,
        liveness: Duration,
    ) -> Result<Node, CollectiveError> {
        let k = spec.addresses.len();
        if k == 0 || spec.index >= k || k > MAX_MEMBERS || spec.total < k {
            return Err(CollectiveError::Invalid(format!(
                "local index {} of {k} members (at most {MAX_MEMBERS}), {} ranks in all",
                spec.index, spec.total
            )));
        }
        if !ddlf_core::shm::available() {
            return Err(CollectiveError::Invalid(
                "a hierarchical all-reduce needs /dev/shm; use a flat ring".into(),
            ));
        }
        let peers = spec
            .addresses
            .iter()
            .enumerate()
            .map(|(rank, a)| {
                a.to_socket_addrs()
                    .ok()
                    .and_then(|mut it| it.next())
                    .ok_or_else(|| CollectiveError::Resolve {
                        rank,
                        address: a.clone(),
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Node {
            group,
            spec,
            peers,
            token,
            tls,
            timeout,
            liveness,
            control: None,
            segments: Vec::new(),
            serial: 0,
            barrier: 0,
            spent: None,
            activity: 0,
        })
    }

    /// Whether this member runs the ring between hosts.
    pub fn is_leader(&self) -> bool {
        self.spec.index == 0
    }

    /// How many data files this member's host stage has made so far (each made file is a new mapping whose pages
    /// are faulted in on first use: a diagnostic of how well calls reuse them).
    pub fn files_made(&self) -> u64 {
        self.serial
    }

    /// Whether this host holds every rank (no ring between hosts): then a result can stay in shared memory
    /// ([`Io::Shared`]).
    pub fn single_host(&self) -> bool {
        self.spec.total == self.members()
    }

    fn members(&self) -> usize {
        self.spec.addresses.len()
    }

    fn fail(&self, index: usize, reason: String) -> CollectiveError {
        CollectiveError::Local {
            rank: index,
            address: self.spec.addresses[index].clone(),
            reason,
        }
    }

    /// All-reduce `data` with the other members (and, through the leader's `inter`, the other hosts).
    ///
    /// The leader runs `prepare` before the local stage (opening its ring links, so that a failure here closes
    /// them and the other hosts' leaders fail at once instead of waiting for links that never come).
    ///
    /// The parts of `io` are reduced as one sequence of elements (their concatenation, in order): a list of arrays
    /// goes through shared memory as one array of the same size would, each part copied into this member's slot
    /// and the result copied back into it ([`Io::InPlace`]) or into other arrays ([`Io::Into`]: the sources only
    /// read), with no buffer in between.
    pub fn allreduce<T: Elem>(
        &mut self,
        io: Io<'_, '_, '_, T>,
        op: Op,
        prepare: impl FnOnce() -> Result<(), CollectiveError>,
        inter: impl FnOnce(&mut [T]) -> Result<(), CollectiveError>,
    ) -> Result<(), CollectiveError> {
        self.call(io, op, Mode::Both, prepare, inter)
    }

    /// This member's shard of `len` elements (see the module docs), given its host's rank among `hosts`.
    pub fn shard(&self, len: usize, host: usize, hosts: usize) -> Range<usize> {
        let ours = crate::ring::chunk(len, hosts, host);
        let sub = crate::ring::chunk(ours.len(), self.members(), self.spec.index);
        ours.start + sub.start..ours.start + sub.end
    }

    /// The reduce-scatter: afterwards `data[shard]` holds the reduction over every rank of every host (the rest
    /// of `data` as it was). `shard`: [`Node::shard`]; `inter`: the leaders' reduce-scatter over the hosts (a sum,
    /// leaving each host's chunk whole). See [`Node::allreduce`] for `prepare`.
    pub fn reduce_scatter<T: Elem>(
        &mut self,
        data: &mut [T],
        op: Op,
        shard: Range<usize>,
        prepare: impl FnOnce() -> Result<(), CollectiveError>,
        inter: impl FnOnce(&mut [T]) -> Result<(), CollectiveError>,
    ) -> Result<(), CollectiveError> {
        self.call(
            Io::InPlace(&mut [data]),
            op,
            Mode::Scatter(shard),
            prepare,
            inter,
        )
    }

    /// The all-gather: `data[shard]` goes to every rank, and `data` ends with every rank's shard. `inter`: the
    /// leaders' all-gather of the hosts' chunks.
    pub fn allgather<T: Elem>(
        &mut self,
        data: &mut [T],
        shard: Range<usize>,
        prepare: impl FnOnce() -> Result<(), CollectiveError>,
        inter: impl FnOnce(&mut [T]) -> Result<(), CollectiveError>,
    ) -> Result<(), CollectiveError> {
        self.call(
            Io::InPlace(&mut [data]),
            Op::Sum,
            Mode::Gather(shard),
            prepare,
            inter,
        )
    }

    fn call<T: Elem>(
        &mut self,
        io: Io<'_, '_, '_, T>,
        op: Op,
        mode: Mode,
        prepare: impl FnOnce() -> Result<(), CollectiveError>,
        inter: impl FnOnce(&mut [T]) -> Result<(), CollectiveError>,
    ) -> Result<(), CollectiveError> {
        if let Some(why) = &self.spent {
            return Err(CollectiveError::Spent(why.clone()));
        }
        if let Io::Into(src, dst) = &io {
            let (from, to) = (total(src), total(dst));
            if from != to {
                return Err(CollectiveError::Invalid(format!(
                    "an all-reduce of {from} elements into {to}"
                )));
            }
        }
        if let Io::Shared(_, tag, _) = &io {
            check_tag(*tag)?;
        }
        if matches!(io, Io::Shared(..)) && !(self.single_host() && matches!(mode, Mode::Both)) {
            return Err(CollectiveError::Invalid(
                "a result left in shared memory needs an all-reduce on one host holding every rank"
                    .into(),
            ));
        }
        let result = match &io {
            Io::InPlace(parts) => {
                let src: Vec<&[T]> = parts.iter().map(|p| &**p).collect();
                self.run(&src, op, &mode, 0, prepare, inter)
            }
            Io::Into(src, _) => self.run(src, op, &mode, 0, prepare, inter),
            Io::Shared(src, tag, _) => self.run(src, op, &mode, *tag, prepare, inter),
        };
        let result = result.map(|ready| match io {
            Io::InPlace(dst) | Io::Into(_, dst) => self.finish(ready, dst, &mode),
            Io::Shared(_, _, out) => {
                // One host: the sums are scaled already (`ready.scale` is None), so the region is the result.
                let (map, start, len) =
                    self.segments[ready.current].shared_region(self.members(), ready.len);
                *out = Some(SharedResult { map, start, len });
            }
        });
        if let Err(e) = &result {
            let why = e.to_string();
            let blamed = match e {
                CollectiveError::Local { rank, .. } => *rank,
                _ => self.spec.index,
            };
            // The others stop at their next look at the control file.
            if let Some(control) = &self.control {
                control.set_failed(blamed, &why);
            }
            self.spent = Some(why);
            self.segments.clear();
        }
        result
    }
}

/// How many elements `parts` hold together.
fn total<T, P: AsRef<[T]>>(parts: &[P]) -> usize {
    parts.iter().map(|p| p.as_ref().len()).sum()
}
