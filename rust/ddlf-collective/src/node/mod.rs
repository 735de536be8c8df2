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
//! The files' layout, and how they are made and mapped, is `segment.rs`; this file is the protocol over them.

mod segment;

use std::fs::{File, OpenOptions};
use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ddlf_core::auth::Token;

use crate::peer;
use crate::ring::{Elem, Op};
use crate::tls::PeerTls;
use crate::CollectiveError;

pub use segment::MAX_MEMBERS;
use segment::{
    allocate, map, Segment, HEADER, MAGIC, W_ARRIVED, W_ELEM, W_LEN, W_MAGIC, W_MEMBERS, W_SHAPE,
};

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

/// Data files a node keeps mapped.
const KEEP_SEGMENTS: usize = 4;
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

    /// Ask member `i`'s daemon whether its process still answers.
    fn probe(&self, i: usize) -> Result<(), String> {
        let within = self.liveness * 3 / 4;
        peer::probe(
            self.peers[i],
            &self.spec.addresses[i],
            self.group,
            self.token.as_ref(),
            self.tls.as_ref(),
            within,
        )
        .map_err(|e| format!("its daemon did not answer a liveness probe within {within:?}: {e}"))
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

    fn path(&self, what: &str) -> PathBuf {
        // The group and the first member's whole address: hosts that are network namespaces of one machine
        // share /dev/shm, and their members may listen on the same ports.
        let first: String = self.peers[0]
            .to_string()
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        let name = format!(
            "{}node-{:032x}-{first}-{what}",
            ddlf_core::shm::PREFIX,
            self.group,
        );
        PathBuf::from(ddlf_core::shm::DIR).join(name)
    }

    /// Steps 0-3 of a call (or the all-gather's), reading `parts`; [`Node::finish`] is step 4.
    fn run<T: Elem>(
        &mut self,
        parts: &[&[T]],
        op: Op,
        mode: &Mode,
        tag: u32,
        prepare: impl FnOnce() -> Result<(), CollectiveError>,
        inter: impl FnOnce(&mut [T]) -> Result<(), CollectiveError>,
    ) -> Result<Ready, CollectiveError> {
        let (k, j, len, elem) = (
            self.members(),
            self.spec.index,
            parts.iter().map(|p| p.len()).sum::<usize>(),
            std::mem::size_of::<T>(),
        );
        if self.control.is_none() {
            let control = self.attach(&self.path("control"), 0, 1)?;
            self.control = Some(control);
        }
        if self.is_leader() {
            prepare()?;
        }
        // 0. Agree on the call's shape (members that disagree fail together, instead of waiting apart).
        let control = self.control()?;
        control
            .word(W_SHAPE + 2 * j)
            .store(len as u64, Ordering::Relaxed);
        let code = match mode {
            Mode::Both => 0u64,
            Mode::Scatter(_) => 1,
            Mode::Gather(_) => 2,
        };
        if let Mode::Scatter(r) | Mode::Gather(r) = mode {
            if r.end > len || r.start > r.end {
                return Err(CollectiveError::Invalid(format!(
                    "a shard {r:?} of {len} elements"
                )));
            }
        }
        control.word(W_SHAPE + 2 * j + 1).store(
            elem as u64 | code << 32 | (tag as u64) << 40,
            Ordering::Relaxed,
        );
        self.wait_all()?;
        if let Some(control) = self.control.as_mut() {
            // Every member has mapped the control file: nobody needs its name any more.
            control.unlink();
        }
        let control = self.control()?;
        for i in 0..k {
            let theirs = (
                control.word(W_SHAPE + 2 * i).load(Ordering::Relaxed) as usize,
                control.word(W_SHAPE + 2 * i + 1).load(Ordering::Relaxed) as usize,
            );
            let ours = elem | (code as usize) << 32 | (tag as usize) << 40;
            if theirs != (len, ours) {
                let call = |c: usize| {
                    ["an all-reduce", "a reduce-scatter", "an all-gather"]
                        [((c >> 32) & 0xff).min(2)]
                };
                return Err(self.fail(
                    i,
                    format!(
                        "members disagree: member {i} makes {} of {} elements of {} bytes (tag {}), member {j} {} \
                         of {len} of {elem} (tag {tag})",
                        call(theirs.1),
                        theirs.0,
                        theirs.1 & 0xffff_ffff,
                        theirs.1 >> 40,
                        call(ours),
                    ),
                ));
            }
        }
        let current = self.segment_for(len, elem, tag)?;
        if let Mode::Gather(shard) = mode {
            return self.gather(current, parts, shard.clone(), inter);
        }
        // One host holding every rank: no ring between hosts, so the mean is taken as the sums are made.
        let single = self.spec.total == k;
        let by = match op {
            Op::Sum => None,
            Op::Mean => Some(1.0 / self.spec.total as f64),
        };
        // 1. Into this member's slot, every chunk of its data but its own (which it sums from `parts` itself).
        let mine = crate::ring::chunk(len, k, j);
        let seg = &self.segments[current];
        // SAFETY: `region` checked that `len` elements of `T` at slot `j` lie inside the mapping, aligned. Slot `j`
        // is written by this member only, and read by others only after the barrier below.
        let slot = unsafe { std::slice::from_raw_parts_mut(seg.region::<T>(j, len), len) };
        for (piece, at) in pieces(parts, 0..len) {
            for r in [
                at.start..at.end.min(mine.start),
                at.start.max(mine.end)..at.end,
            ] {
                if r.start < r.end {
                    slot[r.clone()].copy_from_slice(&piece[r.start - at.start..r.end - at.start]);
                }
            }
        }
        self.wait_all()?;
        // Every member has mapped the data file: nobody needs its name any more.
        self.segments[current].unlink();
        // 2. This member's chunk of the sum, the members' terms in member order (scaled for a mean on one host).
        let seg = &self.segments[current];
        // SAFETY: the result region holds `len` elements (checked by `region`); this member writes only its own
        // chunk of it (chunks of different members are disjoint), and nobody reads it before the next barrier.
        let out = unsafe {
            std::slice::from_raw_parts_mut(seg.region::<T>(k, len).add(mine.start), mine.len())
        };
        for i in 0..k {
            let last = if single && i + 1 == k { by } else { None };
            if i == j {
                for (piece, at) in pieces(parts, mine.clone()) {
                    combine(
                        &mut out[at.start - mine.start..at.end - mine.start],
                        piece,
                        i == 0,
                        last,
                    );
                }
            } else {
                // SAFETY: slot `i` holds `len` elements, all written before the barrier passed and not written
                // again before the next call's barriers, which this member has not reached.
                let src = unsafe {
                    std::slice::from_raw_parts(seg.region::<T>(i, len).add(mine.start), mine.len())
                };
                combine(out, src, i == 0, last);
            }
        }
        self.wait_all()?;
        // 3. The hosts' sums (or, for a reduce-scatter, each host's chunk of them), on the leaders' ring.
        if !single {
            self.leaders(current, len, inter)?;
        }
        // On one host the sums are scaled already.
        Ok(Ready {
            current,
            len,
            scale: if single { None } else { by },
        })
    }

    /// The index of the data file for a call of `len` elements of `elem` bytes with `tag`: the smallest kept file
    /// of that element size and tag whose regions hold at least `len` elements, or a new one of exactly `len`
    /// (the oldest dropped once [`KEEP_SEGMENTS`] are kept). A file serves every shorter call too, so the buckets of
    /// a model (lengths that differ, and often more of them than the files kept) reuse one file instead of making
    /// and faulting in a new one per call. Every member makes the same calls in the same order, so all choose the
    /// same file.
    fn segment_for(&mut self, len: usize, elem: usize, tag: u32) -> Result<usize, CollectiveError> {
        let fits = self
            .segments
            .iter()
            .enumerate()
            .filter(|(_, s)| s.elem == elem && s.tag == tag && s.len >= len)
            .min_by_key(|(_, s)| s.len)
            .map(|(i, _)| i);
        if let Some(i) = fits {
            return Ok(i);
        }
        self.serial += 1;
        let mut seg = self.attach(&self.path(&self.serial.to_string()), len, elem)?;
        seg.tag = tag;
        if self.segments.len() == KEEP_SEGMENTS {
            self.segments.remove(0);
        }
        self.segments.push(seg);
        Ok(self.segments.len() - 1)
    }

    /// Step 4, the result (or this member's shard of it) to every member: `dst` is written only now, after the
    /// last step that can fail.
    fn finish<T: Elem>(&self, ready: Ready, dst: &mut [&mut [T]], mode: &Mode) {
        let len = total(dst);
        let seg = &self.segments[ready.current];
        // SAFETY: the last barrier passed (every chunk summed, the leader's ring done); the next call writes the
        // result region only after a barrier of its own, which every member reaches only after this copy. The
        // region holds `len` elements: `run` checked the call's shape, and `dst` holds as many as the sources.
        let all = unsafe { std::slice::from_raw_parts(seg.region::<T>(self.members(), len), len) };
        if let Mode::Scatter(shard) = mode {
            if let [data] = dst {
                combine(
                    &mut data[shard.clone()],
                    &all[shard.clone()],
                    true,
                    ready.scale,
                );
            }
            return;
        }
        let mut at = 0;
        for part in dst.iter_mut() {
            combine(part, &all[at..at + part.len()], true, ready.scale);
            at += part.len();
        }
    }

    /// The leaders' stage (step 3, or the all-gather's): the leader runs `inter` on the result region of segment
    /// `current`, then every member waits for it at a barrier. Called once every member has written its part of
    /// the region (a barrier passed).
    fn leaders<T: Elem>(
        &mut self,
        current: usize,
        len: usize,
        inter: impl FnOnce(&mut [T]) -> Result<(), CollectiveError>,
    ) -> Result<(), CollectiveError> {
        if self.is_leader() {
            let seg = &self.segments[current];
            // SAFETY: every member finished its part of the region (the caller's barrier passed); until the next
            // barrier only the leader touches it, and `region` checked that `len` elements fit.
            let all = unsafe {
                std::slice::from_raw_parts_mut(seg.region::<T>(self.members(), len), len)
            };
            inter(all)?;
        }
        self.wait_all()
    }

    /// The all-gather's steps after the shapes agreed (see the module docs).
    fn gather<T: Elem>(
        &mut self,
        current: usize,
        parts: &[&[T]],
        shard: Range<usize>,
        inter: impl FnOnce(&mut [T]) -> Result<(), CollectiveError>,
    ) -> Result<Ready, CollectiveError> {
        let [data] = parts else {
            return Err(CollectiveError::Invalid(
                "an all-gather takes one array".into(),
            ));
        };
        let (k, len) = (self.members(), data.len());
        let seg = &self.segments[current];
        // SAFETY: the result region holds `len` elements (checked by `region`). Every member passed this call's
        // first barrier, so none still reads the region for an earlier call; each writes only its own shard
        // (the members' shards are disjoint), and nobody reads the region before the next barrier.
        let out = unsafe {
            std::slice::from_raw_parts_mut(seg.region::<T>(k, len).add(shard.start), shard.len())
        };
        out.copy_from_slice(&data[shard]);
        self.wait_all()?;
        self.segments[current].unlink();
        self.leaders(current, len, inter)?;
        Ok(Ready {
            current,
            len,
            scale: None,
        })
    }

    fn control(&self) -> Result<&Segment, CollectiveError> {
        self.control
            .as_ref()
            .ok_or_else(|| CollectiveError::Invalid("a node without its control file".into()))
    }

    /// Look at the control file: has a member failed the call?
    fn failed(&self) -> Result<(), CollectiveError> {
        match self.control.as_ref().and_then(Segment::failure) {
            Some((who, reason)) => Err(self.fail(who, reason)),
            None => Ok(()),
        }
    }

    /// Arrive at the next barrier and wait for every member (see the module docs on how long, and probes).
    fn wait_all(&mut self) -> Result<(), CollectiveError> {
        self.barrier += 1;
        let b = self.barrier;
        let (k, j) = (self.members(), self.spec.index);
        let control = self.control()?;
        control.word(W_ARRIVED + j).store(b, Ordering::Release);
        let t0 = Instant::now();
        let mut alive = t0;
        let mut spins = 0u32;
        loop {
            self.failed()?;
            let late = (0..k).find(|&i| control.word(W_ARRIVED + i).load(Ordering::Acquire) < b);
            let Some(late) = late else {
                return Ok(());
            };
            if spins.is_multiple_of(256) {
                crate::activity::waiting(
                    self.activity,
                    || {
                        format!(
                            "member {late} ({}) at this host's shared-memory barrier",
                            self.spec.addresses[late]
                        )
                    },
                    t0,
                );
            }
            if t0.elapsed() >= self.timeout {
                return Err(self.fail(
                    late,
                    format!("did not reach the local barrier within {:?}", self.timeout),
                ));
            }
            if alive.elapsed() >= self.liveness / 4 {
                if let Err(why) = self.probe(late) {
                    return Err(self.fail(late, why));
                }
                alive = Instant::now();
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else if spins < 256 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// The file at `path` for `len` elements of `elem` bytes (0 elements: the control file): the leader makes
    /// it, the others wait for it (watching the control file, if any, for a failure) and map it.
    fn attach(
        &self,
        path: &std::path::Path,
        len: usize,
        elem: usize,
    ) -> Result<Segment, CollectiveError> {
        let k = self.members();
        let size = Segment::size(k, len, elem);
        let io = |what: &str, e: io::Error| {
            CollectiveError::Invalid(format!("shared memory {}: {what}: {e}", path.display()))
        };
        if self.is_leader() {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(path)
                .map_err(|e| io("create", e))?;
            // Reserve every page now: a full /dev/shm is an error here, not a SIGBUS later.
            let grown = file
                .set_len(size as u64)
                .and_then(|_| allocate(&file, size));
            let seg = map(
                &file,
                path.to_path_buf(),
                k,
                len,
                elem,
                HEADER.max(size),
                false,
            );
            if let Err(e) = grown {
                drop(seg);
                let _ = std::fs::remove_file(path);
                return Err(self.fail(
                    0,
                    format!(
                        "cannot reserve {size} bytes in {} ({e}): too little shared memory for a hierarchical \
                         all-reduce of this size (use a flat ring, or a larger /dev/shm)",
                        ddlf_core::shm::DIR
                    ),
                ));
            }
            let seg = seg.map_err(|e| io("map", e))?;
            for (w, v) in [(W_MEMBERS, k), (W_LEN, len), (W_ELEM, elem)] {
                seg.word(w).store(v as u64, Ordering::Relaxed);
            }
            seg.word(W_MAGIC).store(MAGIC, Ordering::Release);
            return Ok(seg);
        }
        // A member: wait for the leader's file (the leader may still be computing), probing it meanwhile.
        let t0 = Instant::now();
        let mut alive = t0;
        loop {
            self.failed()?;
            if let Ok(file) = File::options().read(true).write(true).open(path) {
                let mut word = [0u8; 8];
                let ready =
                    file.read_exact_at(&mut word, 0).is_ok() && u64::from_le_bytes(word) == MAGIC;
                if ready {
                    // Members never remove the file (the leader does, once all have mapped it).
                    let seg = map(&file, path.to_path_buf(), k, len, elem, size, true)
                        .map_err(|e| io("map", e))?;
                    let theirs = (
                        seg.word(W_MEMBERS).load(Ordering::Relaxed) as usize,
                        seg.word(W_LEN).load(Ordering::Relaxed) as usize,
                        seg.word(W_ELEM).load(Ordering::Relaxed) as usize,
                    );
                    if theirs != (k, len, elem) {
                        return Err(self.fail(
                            0,
                            format!(
                                "the leader's file is for {theirs:?} (members, elements, bytes)"
                            ),
                        ));
                    }
                    return Ok(seg);
                }
            }
            if t0.elapsed() >= self.timeout {
                return Err(self.fail(
                    0,
                    format!(
                        "made no shared memory for the call within {:?}",
                        self.timeout
                    ),
                ));
            }
            if alive.elapsed() >= self.liveness / 4 {
                if let Err(why) = self.probe(0) {
                    return Err(self.fail(0, why));
                }
                alive = Instant::now();
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// How many elements `parts` hold together.
fn total<T, P: AsRef<[T]>>(parts: &[P]) -> usize {
    parts.iter().map(|p| p.as_ref().len()).sum()
}

/// The pieces of `parts` (one sequence of elements, their concatenation) that fall in `range`: each as the slice
/// and the range of the sequence it covers.
fn pieces<'a, T>(
    parts: &'a [&[T]],
    range: Range<usize>,
) -> impl Iterator<Item = (&'a [T], Range<usize>)> {
    let mut at = 0;
    parts.iter().filter_map(move |part| {
        let whole = at..at + part.len();
        at = whole.end;
        let (start, end) = (whole.start.max(range.start), whole.end.min(range.end));
        (start < end).then(|| (&part[start - whole.start..end - whole.start], start..end))
    })
}

/// One member's term of a sum: `dst = src` (the first term) or `dst += src`, then, for the last term of a mean,
/// times `by`; with `first`, also a copy out, scaled or not (a scaled sum has the same bits either way).
fn combine<T: Elem>(dst: &mut [T], src: &[T], first: bool, by: Option<f64>) {
    match (first, by) {
        (true, None) => dst.copy_from_slice(src),
        (true, Some(by)) => dst.iter_mut().zip(src).for_each(|(d, s)| *d = s.scale(by)),
        (false, None) => dst.iter_mut().zip(src).for_each(|(d, s)| *d = d.add(*s)),
        (false, Some(by)) => dst
            .iter_mut()
            .zip(src)
            .for_each(|(d, s)| *d = d.add(*s).scale(by)),
    }
}

#[cfg(test)]
mod tests {
    use super::{combine, pieces};

    #[test]
    fn pieces_cover_a_range_of_the_parts_concatenation_in_order() {
        let (a, b, c, e) = (
            vec![0, 1, 2],
            vec![3, 4],
            vec![5, 6, 7, 8],
            Vec::<i32>::new(),
        );
        let parts: Vec<&[i32]> = vec![&a, &e, &b, &c];
        let got = |r| {
            pieces(&parts, r)
                .map(|(p, at)| (p.to_vec(), at))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            got(2..6),
            vec![(vec![2], 2..3), (vec![3, 4], 3..5), (vec![5], 5..6)]
        );
        assert_eq!(got(0..9).len(), 3); // the empty part yields nothing
        assert_eq!(got(3..5), vec![(vec![3, 4], 3..5)]);
        assert!(got(4..4).is_empty());
    }

    #[test]
    fn combined_terms_are_the_sum_in_order_then_the_scale() {
        let terms = [[1.5f32, -2.0], [0.25, 4.0], [3.0, 1.0]];
        let mut out = [0f32; 2];
        for (i, t) in terms.iter().enumerate() {
            combine(&mut out, t, i == 0, (i == 2).then_some(1.0 / 3.0));
        }
        let want = |i: usize| ((terms[0][i] + terms[1][i] + terms[2][i]) as f64 / 3.0) as f32;
        assert_eq!(out, [want(0), want(1)]);
        let mut one = [0f32; 2];
        combine(&mut one, &terms[0], true, Some(0.5));
        assert_eq!(one, [0.75, -1.0]);
    }
}
