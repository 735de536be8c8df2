//! ddlf's collective: workers reducing among themselves, ring all-reduce over direct worker-to-worker links.
//!
//! * [`ring`]: the algorithm (reduce-scatter then all-gather, pipelined on non-blocking sockets), over any two
//!   connected links.
//! * [`peer`]: opening a link to another worker's daemon (token checked before anything is decoded), and the
//!   mailbox where a daemon leaves the links it admitted for this process's ring.
//! * [`link`]: one end of a peer link, plaintext or TLS, for the ring's non-blocking I/O; [`tls`]: the TLS
//!   configurations of both ends.
//! * [`node`]: a hierarchical ring's local stage, the members on one host reducing through shared memory.
//! * [`Ring`]: one rank's membership in a ring: its spec, its links (opened on first use and kept for the
//!   following reductions), and errors that name the neighbour at fault.
//!
//! A ring that fails once is spent: its links are closed (so both neighbours fail at once instead of waiting for
//! their stall timeout, and the failure travels around the ring in a few round trips) and every later call
//! refuses. Whoever formed it (the master) forms a new one, with a new group id, from the ranks still alive.
//!
//! The crate sits beside the master's side of `ddlf-net`, on top of it: a daemon's admission guard
//! (`ddlf_net::guard`) recognises a peer link by its preface (`ddlf_net::preface::PEER_PREFACE`) and hands it
//! over, the daemon (`ddlf-worker`) passes it to [`peer::welcome`], and Python's `ddlf._ddlf.Ring` (`ddlf-py`)
//! drives a [`Ring`] on the worker's interpreter thread. `ddlf-net` knows nothing of this crate.

#![deny(missing_docs)]

pub mod activity;
pub mod link;
pub mod node;
pub mod peer;
pub mod ring;
pub mod tls;

use std::net::{SocketAddr, ToSocketAddrs};
use std::ops::Range;
use std::sync::OnceLock;
use std::time::Duration;

use ddlf_core::auth::Token;
use ddlf_net::guard::Slot;

pub use link::Link;
pub use node::LocalSpec;
pub use ring::{Bf16Wire, Codec, Elem, F16Wire, Op, Phase, Plain, RingError, Side, Watch};
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

/// One rank's view of a ring.
#[derive(Clone, Debug)]
pub struct RingSpec {
    /// Unique per ring: links of two rings never mix.
    pub group: u128,
    /// This rank's place in the ring (its index in `addresses`).
    pub rank: usize,
    /// Every rank's daemon address, in ring order.
    pub addresses: Vec<String>,
    /// Parallel links per neighbour (each carries its own contiguous slice of the data).
    pub streams: usize,
    /// How long a rank waits for its neighbours to join (a slow one may still be computing), and the longest a
    /// neighbour may make no progress during a reduction.
    pub timeout: Duration,
    /// A neighbour that stops answering is detected within about this long, whatever it was doing: a rank
    /// waiting on a silent neighbour probes its daemon every quarter of it ([`peer::probe`], answered by the
    /// daemon's network runtime even while its Python computes; a stopped process or a frozen or cut-off host
    /// does not answer within three quarters of it). TCP keepalive and `TCP_USER_TIMEOUT` bound a link whose host
    /// vanished in the same time. A neighbour whose process dies is detected at once (its links close).
    pub liveness: Duration,
    /// Open TLS peer links, checking neighbours' certificates with this (a cluster that uses TLS); `None`:
    /// plaintext links.
    pub tls: Option<PeerTls>,
    /// Hierarchical mode: this rank's place among the ring's members on its host. The members reduce through
    /// shared memory ([`node`]), and only the host's leader (local index 0) takes part in the ring, whose
    /// `addresses` and `rank` then name the hosts' leaders. `None`: every member is a rank of a flat ring.
    pub local: Option<LocalSpec>,
}

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

struct Stream {
    links: ring::Links,
    _slot: Slot,
}

/// One rank's membership in a ring (see the module docs).
pub struct Ring {
    spec: RingSpec,
    token: Option<Token>,
    streams: Option<Vec<Stream>>,
    /// The neighbours' addresses resolved once, for their liveness probes (made with the links).
    watcher: Option<Watcher>,
    spent: Option<String>,
    /// Hierarchical mode's local stage (see [`RingSpec::local`]).
    node: Option<node::Node>,
    /// The call in progress ([`activity`]; 0 between calls).
    activity: u64,
    /// A flat ring's buffer for the results of a list of parts reduced in place (and of an atomic call's one
    /// array), kept between calls (a fresh one each call would fault in its pages every time). It is as large as the
    /// largest such call so far, for the ring's life (a worker keeps its few latest rings open:
    /// `ddlf.worker.collective`).
    scratch: Vec<u64>,
}

impl Ring {
    /// Check the spec; links open on the first reduction.
    pub fn new(spec: RingSpec, token: Option<Token>) -> Result<Ring, CollectiveError> {
        let n = spec.addresses.len();
        if n == 0 || spec.rank >= n {
            return Err(CollectiveError::Invalid(format!(
                "rank {} of {n} addresses",
                spec.rank
            )));
        }
        if spec.streams == 0 || spec.streams > 16 {
            return Err(CollectiveError::Invalid(format!(
                "streams must be 1 to 16, not {}",
                spec.streams
            )));
        }
        if spec.timeout.is_zero() || spec.liveness < Duration::from_secs(1) {
            return Err(CollectiveError::Invalid(
                "timeout must be positive and liveness at least 1 s".into(),
            ));
        }
        let node = match &spec.local {
            Some(local) => Some(node::Node::new(
                spec.group,
                local.clone(),
                token.clone(),
                spec.tls.clone(),
                spec.timeout,
                spec.liveness,
            )?),
            None => None,
        };
        Ok(Ring {
            spec,
            token,
            streams: None,
            watcher: None,
            spent: None,
            node,
            activity: 0,
            scratch: Vec::new(),
        })
    }

    /// The ring's spec.
    pub fn spec(&self) -> &RingSpec {
        &self.spec
    }

    fn n(&self) -> usize {
        self.spec.addresses.len()
    }

    fn neighbour(&self, side: Side) -> (usize, String) {
        let n = self.n();
        let rank = match side {
            Side::Left => (self.spec.rank + n - 1) % n,
            Side::Right => (self.spec.rank + 1) % n,
        };
        (rank, self.spec.addresses[rank].clone())
    }

    fn resolve(&self, rank: usize) -> Result<SocketAddr, CollectiveError> {
        let address = &self.spec.addresses[rank];
        address
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| CollectiveError::Resolve {
                rank,
                address: address.clone(),
            })
    }

    /// How a pass of this ring watches its neighbours (see [`RingSpec::liveness`]).
    fn watcher(&self) -> Result<Watcher, CollectiveError> {
        let (left, _) = self.neighbour(Side::Left);
        let (right, _) = self.neighbour(Side::Right);
        Ok(Watcher {
            group: self.spec.group,
            left: (self.resolve(left)?, self.spec.addresses[left].clone()),
            right: (self.resolve(right)?, self.spec.addresses[right].clone()),
            token: self.token.clone(),
            tls: self.spec.tls.clone(),
            answer_within: self.spec.liveness * 3 / 4,
            every: self.spec.liveness / 4,
        })
    }

    /// Open every stream's link to the right neighbour, then take the left neighbour's from the mailbox.
    fn connect(&mut self) -> Result<Vec<Stream>, CollectiveError> {
        let (right, right_address) = self.neighbour(Side::Right);
        let (left, left_address) = self.neighbour(Side::Left);
        let watcher = self.watcher()?;
        let to = watcher.right.0;
        // The right neighbour's daemon admits links from its network runtime whatever its Python does: a live one
        // answers at once.
        let open_within = self.spec.liveness.min(self.spec.timeout);
        let mut rights = Vec::with_capacity(self.spec.streams);
        for stream in 0..self.spec.streams {
            let key = peer::LinkKey {
                group: self.spec.group,
                to_rank: right as u32,
                stream: stream as u32,
            };
            let link = peer::open(
                to,
                &right_address,
                key,
                self.token.as_ref(),
                self.spec.tls.as_ref(),
                open_within,
            )
            .map_err(|source| CollectiveError::Open {
                rank: right,
                address: right_address.clone(),
                source,
            })?;
            rights.push(link);
        }
        let mut streams = Vec::with_capacity(self.spec.streams);
        for (stream, right) in rights.into_iter().enumerate() {
            let key = peer::LinkKey {
                group: self.spec.group,
                to_rank: self.spec.rank as u32,
                stream: stream as u32,
            };
            // The left neighbour may still be computing: wait for its link up to the timeout, probing it while
            // waiting so that a stopped or unreachable one fails the ring within the liveness bound.
            let t0 = std::time::Instant::now();
            let (left_link, slot) = loop {
                activity::waiting(
                    self.activity,
                    || {
                        format!("the link from the left neighbour, rank {left} ({left_address}), not opened yet")
                    },
                    t0,
                );
                let left_time = self.spec.timeout.saturating_sub(t0.elapsed());
                if let Some(got) = peer::mailbox().take(key, left_time.min(watcher.every)) {
                    break got;
                }
                if t0.elapsed() >= self.spec.timeout {
                    return Err(CollectiveError::NoLink {
                        rank: left,
                        address: left_address.clone(),
                        timeout: self.spec.timeout,
                    });
                }
                if let Err(reason) = watcher.probe(Side::Left) {
                    return Err(CollectiveError::Ring {
                        rank: left,
                        address: left_address.clone(),
                        source: RingError::Unresponsive {
                            side: Side::Left,
                            after: t0.elapsed(),
                            reason,
                        },
                    });
                }
            };
            let liveness = self.spec.liveness;
            let configure = |link: &Link| {
                let s = link.socket();
                s.set_nonblocking(true)?;
                s.set_nodelay(true)?;
                let sock = socket2::SockRef::from(s);
                // The kernel takes keepalive times in whole seconds, and refuses 0 (EINVAL): a liveness under
                // 4 s (a cluster with a short heartbeat timeout) would round the probe down to 0 and fail every
                // ring. TCP_USER_TIMEOUT still bounds unacknowledged data at `liveness`.
                let probe = (liveness / 4).max(Duration::from_secs(1));
                sock.set_tcp_keepalive(
                    &socket2::TcpKeepalive::new()
                        .with_time(probe)
                        .with_interval(probe)
                        .with_retries(3),
                )?;
                sock.set_tcp_user_timeout(Some(liveness))
            };
            configure(&left_link)
                .and_then(|_| configure(&right))
                .map_err(|source| CollectiveError::Ring {
                    rank: left,
                    address: left_address.clone(),
                    source: RingError::Io {
                        side: Side::Left,
                        source,
                    },
                })?;
            streams.push(Stream {
                links: ring::Links {
                    left: left_link,
                    right,
                },
                _slot: slot,
            });
        }
        self.watcher = Some(watcher);
        Ok(streams)
    }

    /// How many shared-memory data files this rank's host stage has made ([`node::Node::files_made`]); `None` on a
    /// flat ring, which has no host stage.
    pub fn shared_files_made(&self) -> Option<u64> {
        self.node.as_ref().map(node::Node::files_made)
    }

    /// Whether a failed [`Ring::allreduce`] leaves `data` as it was: true for a hierarchical rank (the host's
    /// stage works on shared memory and writes `data` only after the last step that can fail) and for a ring of
    /// one; a flat ring's passes write `data` as they go.
    pub fn leaves_data_on_failure(&self) -> bool {
        self.node.is_some() || self.n() == 1
    }

    /// All-reduce `data` in place with the other ranks. Every rank must pass the same element type and count.
    pub fn allreduce<T: Elem>(&mut self, data: &mut [T], op: Op) -> Result<(), CollectiveError> {
        self.allreduce_over::<T, Plain>(data, op)
    }

    /// [`Ring::allreduce`] with the elements sent as `C::W` (half precision on the wire, sums in `T`).
    pub fn allreduce_over<T: Elem, C: Codec<T>>(
        &mut self,
        data: &mut [T],
        op: Op,
    ) -> Result<(), CollectiveError> {
        self.allreduce_parts_over::<T, C>(&mut [data], op)
    }

    /// [`Ring::allreduce_over`] of several slices reduced as one (their concatenation, in order; every rank
    /// passes the same total, however it is cut). A hierarchical rank copies each part into shared memory and
    /// the result back into it, as it does one slice: a list costs what one array of its size does. A flat
    /// ring's pass reads several parts where they lie and writes the results into one buffer, scattered back
    /// after the reduction succeeded (so on failure they are unchanged); one part is reduced where it lies.
    pub fn allreduce_parts_over<T: Elem, C: Codec<T>>(
        &mut self,
        parts: &mut [&mut [T]],
        op: Op,
    ) -> Result<(), CollectiveError> {
        let hosts = self.n();
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let what = format!("all-reduce of {len} {}", T::NAME);
        self.guarded(&what, move |ring| match ring.node.take() {
            Some(node) => ring.on_node::<T, C>(node, node::Io::InPlace(parts), op),
            None if hosts == 1 => Ok(()),
            None => match parts {
                [one] => ring.reduce::<T, C>(one, op),
                _ => ring.through_buffer::<T, C>(parts, len, op),
            },
        })
    }

    /// [`Ring::allreduce_over`] of one slice that a failure leaves as it was: a hierarchical rank (or a ring of
    /// one) writes it only after the last step that can fail anyway; a flat ring, whose passes write as they go,
    /// reduces a copy in the buffer it keeps between calls (warm memory, not a fresh allocation) and copies the
    /// result back on success.
    pub fn allreduce_atomic_over<T: Elem, C: Codec<T>>(
        &mut self,
        data: &mut [T],
        op: Op,
    ) -> Result<(), CollectiveError> {
        if self.leaves_data_on_failure() {
            return self.allreduce_parts_over::<T, C>(&mut [data], op);
        }
        let len = data.len();
        let what = format!("all-reduce of {len} {}", T::NAME);
        self.guarded(&what, move |ring| {
            ring.through_buffer::<T, C>(&mut [data], len, op)
        })
    }

    /// A flat ring's reduction of `parts` (`len` elements together) through its kept buffer: the pass reads the
    /// parts where they lie and writes the results into the buffer, which is copied back only if the reduction
    /// succeeded.
    fn through_buffer<T: Elem, C: Codec<T>>(
        &mut self,
        parts: &mut [&mut [T]],
        len: usize,
        op: Op,
    ) -> Result<(), CollectiveError> {
        let mut scratch = std::mem::take(&mut self.scratch);
        let flat = flat_buffer::<T>(&mut scratch, len);
        let input: Vec<&[T]> = parts.iter().map(|p| &**p).collect();
        let r = out_of_place(input, vec![&mut *flat])
            .and_then(|data| self.reduce_into::<T, C>(data, op));
        if r.is_ok() {
            copy_concatenation(&[&*flat], parts);
        }
        self.scratch = scratch;
        r
    }

    /// [`Ring::allreduce_parts_over`] out of place: `parts` are only read and the result is written into `into`
    /// (as many elements, cut however the caller likes; on failure `into` holds nothing meaningful). A
    /// hierarchical rank reads the parts into shared memory and copies the result straight into `into`, so
    /// no copy is added: a gradient goes to the reduction from the buffer its framework made, and the result
    /// into a buffer the framework then reads. A flat ring's pass does the same over the wire: it sends the parts
    /// from where they lie and writes the results straight into `into` ([`ring::OutOfPlace`]).
    pub fn allreduce_parts_into_over<T: Elem, C: Codec<T>>(
        &mut self,
        parts: &[&[T]],
        into: &mut [&mut [T]],
        op: Op,
    ) -> Result<(), CollectiveError> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let out: usize = into.iter().map(|p| p.len()).sum();
        if len != out {
            return Err(into_mismatch(len, out));
        }
        if self.node.is_none() {
            // The pass reads the parts where they lie and writes the results into `into`: nothing in between.
            let hosts = self.n();
            let what = format!("all-reduce of {len} {}", T::NAME);
            let into: Vec<&mut [T]> = into.iter_mut().map(|p| &mut **p).collect();
            let mut data = out_of_place(parts.to_vec(), into)?;
            return self.guarded(&what, move |ring| {
                if hosts == 1 {
                    data.copy();
                    return Ok(());
                }
                ring.reduce_into::<T, C>(data, op)
            });
        }
        self.on_host::<T, C>(len, node::Io::Into(parts, into), op)
    }

    /// Whether a result can stay in shared memory ([`Ring::allreduce_parts_shared_over`]): a hierarchical ring
    /// whose one host holds every rank.
    pub fn shares_results(&self) -> bool {
        self.node.as_ref().is_some_and(|n| n.single_host())
    }

    /// [`Ring::allreduce_parts_into_over`] with the result left in shared memory, no copy out: the mean (or sum)
    /// of the parts' concatenation as bytes of the host's mapping, for one host holding every rank
    /// ([`Ring::shares_results`]; else an `Invalid` error). The region is rewritten only by the next call with
    /// the same `tag` (every rank passes the same; 0 is every other call's), once every member has entered it:
    /// a rank reads its result before it makes that call. The mapping stays valid while the result is held.
    pub fn allreduce_parts_shared_over<T: Elem, C: Codec<T>>(
        &mut self,
        parts: &[&[T]],
        op: Op,
        tag: u32,
    ) -> Result<node::SharedResult, CollectiveError> {
        if !self.shares_results() {
            return Err(CollectiveError::Invalid(
                "a result stays in shared memory only on one host holding every rank".into(),
            ));
        }
        // Refused before the call: a caller's mistake does not spend the ring.
        node::check_tag(tag)?;
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let mut out = None;
        self.on_host::<T, C>(len, node::Io::Shared(parts, tag, &mut out), op)?;
        out.ok_or_else(|| CollectiveError::Invalid("the call left no result".into()))
    }

    /// An all-reduce of `len` elements on this hierarchical ring's host ([`Ring::on_node`]), guarded.
    fn on_host<T: Elem, C: Codec<T>>(
        &mut self,
        len: usize,
        io: node::Io<'_, '_, '_, T>,
        op: Op,
    ) -> Result<(), CollectiveError> {
        let what = format!("all-reduce of {len} {}", T::NAME);
        self.guarded(&what, move |ring| match ring.node.take() {
            Some(node) => ring.on_node::<T, C>(node, io, op),
            None => Err(CollectiveError::Invalid(
                "a hierarchical ring without its node".into(),
            )),
        })
    }

    /// A hierarchical all-reduce on `node` (taken out of the ring for the call, put back after it): the host's
    /// members sum through shared memory, and the leader sums the hosts' results on the ring.
    fn on_node<T: Elem, C: Codec<T>>(
        &mut self,
        mut node: node::Node,
        io: node::Io<'_, '_, '_, T>,
        op: Op,
    ) -> Result<(), CollectiveError> {
        let leads = node.is_leader() && self.n() > 1;
        // The leader opens its links before the local stage and reduces on them after it: the two steps run one
        // after the other, each borrowing the ring.
        let this = std::cell::RefCell::new(&mut *self);
        let r = node.allreduce(
            io,
            op,
            || this.borrow_mut().open_if(leads),
            |all| match leads {
                true => this.borrow_mut().reduce::<T, C>(all, Op::Sum),
                false => Ok(()),
            },
        );
        self.node = Some(node);
        r
    }

    /// The elements of `len` this rank owns between [`Ring::reduce_scatter_over`] and [`Ring::allgather_over`]:
    /// chunk `rank` of a flat ring; on a hierarchical one, this member's sub-chunk of its host's chunk. The
    /// ranks' shards are disjoint, cover `0..len` and are the same on every call with `len` elements.
    pub fn shard(&self, len: usize) -> Range<usize> {
        match &self.node {
            Some(node) => node.shard(len, self.spec.rank, self.n()),
            None => ring::shard(len, self.n(), self.spec.rank),
        }
    }

    /// The first half of an all-reduce (a sharded optimizer's gradients): afterwards `data[self.shard(len)]`
    /// holds the reduction over every rank; the rest of `data` means nothing. Each rank sends about `(n-1)/n`
    /// times the data, half of what an all-reduce sends. The flat ring runs it on its first stream. Returns the
    /// shard. A failure leaves `data` changed, and the ring spent.
    pub fn reduce_scatter_over<T: Elem, C: Codec<T>>(
        &mut self,
        data: &mut [T],
        op: Op,
    ) -> Result<Range<usize>, CollectiveError> {
        let mine = self.shard(data.len());
        let hosts = self.n();
        let shard = mine.clone();
        let what = format!("reduce-scatter of {} {}", data.len(), T::NAME);
        self.guarded(&what, move |ring| match ring.node.take() {
            Some(mut node) => {
                let leads = node.is_leader() && hosts > 1;
                let this = std::cell::RefCell::new(&mut *ring);
                let r = node.reduce_scatter(
                    data,
                    op,
                    shard,
                    || this.borrow_mut().open_if(leads),
                    |all| match leads {
                        true => this
                            .borrow_mut()
                            .phase::<T, C>(all, Op::Sum, Phase::Scatter),
                        false => Ok(()),
                    },
                );
                ring.node = Some(node);
                r
            }
            None if hosts == 1 => Ok(()),
            None => ring.phase::<T, C>(data, op, Phase::Scatter),
        })?;
        Ok(mine)
    }

    /// The second half of an all-reduce (a sharded optimizer's new weights): every rank passes `data` with its
    /// [`Ring::shard`] filled in, and all end with every rank's shard. With a half-precision `C` each shard
    /// travels rounded (its owner keeps the rounded value too), so every rank ends with the same bits.
    pub fn allgather_over<T: Elem, C: Codec<T>>(
        &mut self,
        data: &mut [T],
    ) -> Result<(), CollectiveError> {
        let shard = self.shard(data.len());
        let hosts = self.n();
        let what = format!("all-gather of {} {}", data.len(), T::NAME);
        self.guarded(&what, move |ring| match ring.node.take() {
            Some(mut node) => {
                let leads = node.is_leader() && hosts > 1;
                let this = std::cell::RefCell::new(&mut *ring);
                let r = node.allgather(
                    data,
                    shard,
                    || this.borrow_mut().open_if(leads),
                    |all| match leads {
                        true => this.borrow_mut().phase::<T, C>(all, Op::Sum, Phase::Gather),
                        false => Ok(()),
                    },
                );
                ring.node = Some(node);
                r
            }
            None if hosts == 1 => Ok(()),
            None => ring.phase::<T, C>(data, Op::Sum, Phase::Gather),
        })
    }

    /// Run `call` (`what` it does, for [`activity`]), refusing it on a spent ring and spending the ring when it
    /// fails.
    fn guarded<R>(
        &mut self,
        what: &str,
        call: impl FnOnce(&mut Ring) -> Result<R, CollectiveError>,
    ) -> Result<R, CollectiveError> {
        if let Some(why) = &self.spent {
            return Err(CollectiveError::Spent(why.clone()));
        }
        let mut described = format!(
            "{what} on ring {:032x}, rank {} of {}",
            self.spec.group,
            self.spec.rank,
            self.n()
        );
        if let Some(local) = &self.spec.local {
            described.push_str(&format!(
                " (member {} of {} on this host)",
                local.index,
                local.addresses.len()
            ));
        }
        let activity = activity::Activity::begin(described);
        self.activity = activity.id();
        if let Some(node) = self.node.as_mut() {
            node.activity = activity.id();
        }
        let result = call(self);
        self.activity = 0;
        if let Err(e) = &result {
            self.spent = Some(e.to_string());
            self.streams = None;
            self.watcher = None;
            peer::mailbox().forget(self.spec.group);
        }
        result
    }

    /// Open the leader's links now (before a local stage: see [`node::Node::allreduce`]).
    fn open_if(&mut self, leads: bool) -> Result<(), CollectiveError> {
        if leads && self.streams.is_none() {
            self.streams = Some(self.connect()?);
        }
        Ok(())
    }

    /// One half of the ring's pass over `data`, on the first stream.
    fn phase<T: Elem, C: Codec<T>>(
        &mut self,
        data: &mut [T],
        op: Op,
        phase: Phase,
    ) -> Result<(), CollectiveError> {
        let (rank, n) = (self.spec.rank, self.n());
        self.on_links(|streams, watch| {
            let links = &mut streams[0].links;
            match phase {
                Phase::Gather => ring::allgather_over::<T, C>(data, rank, n, links, watch),
                _ => ring::reduce_scatter_over::<T, C>(data, rank, n, links, op, watch).map(|_| ()),
            }
        })
    }

    /// Run `pass` over this rank's links (opened on first use) with the watch of their neighbours; the links are
    /// kept for the next call when it succeeds, and its error names the neighbour it blames.
    fn on_links(
        &mut self,
        pass: impl FnOnce(&mut [Stream], Watch<'_>) -> Result<(), RingError>,
    ) -> Result<(), CollectiveError> {
        let mut streams = match self.streams.take() {
            Some(s) => s,
            None => self.connect()?,
        };
        let Some(watcher) = self.watcher.as_ref() else {
            return Err(CollectiveError::Invalid(
                "a ring's links without their watcher".into(),
            ));
        };
        let probe = |side: Side| watcher.probe(side);
        let names = self.names();
        let watch = Watch {
            stall: self.spec.timeout,
            probe_every: watcher.every,
            probe: Some(&probe),
            activity: self.activity,
            names: Some(&names),
        };
        if let Err(source) = pass(&mut streams, watch) {
            return Err(self.blame(source));
        }
        self.streams = Some(streams);
        Ok(())
    }

    /// Run `pass` on the links of each of the ring's streams, each over its own consecutive part of a call's
    /// `len` elements (`split` cuts the call at the lengths it is given: the same cut on every rank, since it
    /// depends on the length only), the streams in parallel where there are several.
    fn on_streams<P: Send>(
        &mut self,
        len: usize,
        split: impl FnOnce(&[usize]) -> Vec<P>,
        pass: impl Fn(P, &mut ring::Links, Watch<'_>) -> Result<(), RingError> + Sync,
    ) -> Result<(), CollectiveError> {
        self.on_links(|streams, watch| {
            let k = streams.len();
            let mut rest = len;
            let lens: Vec<usize> = (0..k)
                .map(|i| {
                    let part = ring::chunk(rest, k - i, 0).len();
                    rest -= part;
                    part
                })
                .collect();
            let mut parts = split(&lens);
            debug_assert_eq!(
                parts.len(),
                k,
                "one part per stream, or a stream's peers would wait forever"
            );
            if k == 1 {
                return match parts.pop() {
                    Some(part) => pass(part, &mut streams[0].links, watch),
                    None => Ok(()),
                };
            }
            let pass = &pass;
            std::thread::scope(|s| {
                let handles: Vec<_> = parts
                    .into_iter()
                    .zip(streams.iter_mut())
                    .map(|(part, st)| s.spawn(move || pass(part, &mut st.links, watch)))
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().unwrap_or(Err(RingError::BadHeader)))
                    .collect::<Vec<_>>()
                    .into_iter()
                    .collect::<Result<(), RingError>>()
            })
        })
    }

    /// How the neighbours are named in `ddlf stacks` (left, right).
    fn names(&self) -> [String; 2] {
        [Side::Left, Side::Right].map(|side| {
            let (rank, address) = self.neighbour(side);
            format!("rank {rank} ({address})")
        })
    }

    /// The error of a failed pass, naming the neighbour it blames.
    fn blame(&self, source: RingError) -> CollectiveError {
        let side = match &source {
            RingError::Io { side, .. }
            | RingError::Closed { side }
            | RingError::Stalled { side, .. }
            | RingError::Unresponsive { side, .. } => *side,
            RingError::Mismatch { .. } | RingError::BadHeader => Side::Left,
        };
        let (rank, address) = self.neighbour(side);
        CollectiveError::Ring {
            rank,
            address,
            source,
        }
    }

    fn reduce<T: Elem, C: Codec<T>>(
        &mut self,
        data: &mut [T],
        op: Op,
    ) -> Result<(), CollectiveError> {
        let (rank, n, len) = (self.spec.rank, self.n(), data.len());
        let split = |lens: &[usize]| {
            let mut parts: Vec<&mut [T]> = Vec::with_capacity(lens.len());
            let mut rest = data;
            for &len in lens {
                let (head, tail) = rest.split_at_mut(len);
                parts.push(head);
                rest = tail;
            }
            parts
        };
        self.on_streams(len, split, |part, links, watch| {
            ring::allreduce_over::<T, C>(part, rank, n, links, op, watch)
        })
    }

    /// [`Ring::reduce`] out of place: `data`'s input only read, its results written.
    fn reduce_into<T: Elem, C: Codec<T>>(
        &mut self,
        data: ring::OutOfPlace<'_, T>,
        op: Op,
    ) -> Result<(), CollectiveError> {
        let (rank, n) = (self.spec.rank, self.n());
        self.on_streams(
            data.len(),
            |lens| data.split(lens),
            |mut part, links, watch| {
                ring::allreduce_into_over::<T, C>(&mut part, rank, n, links, op, watch)
            },
        )
    }
}

/// What a ring's passes need to probe its neighbours (owned, so the parallel streams' threads share it).
struct Watcher {
    group: u128,
    /// Each neighbour's resolved address, and as the ring spells it (for TLS names).
    left: (SocketAddr, String),
    right: (SocketAddr, String),
    token: Option<Token>,
    tls: Option<PeerTls>,
    answer_within: Duration,
    every: Duration,
}

impl Watcher {
    fn probe(&self, side: Side) -> Result<(), String> {
        let (to, name) = match side {
            Side::Left => &self.left,
            Side::Right => &self.right,
        };
        let to = *to;
        peer::probe(
            to,
            name,
            self.group,
            self.token.as_ref(),
            self.tls.as_ref(),
            self.answer_within,
        )
        .map_err(|e| format!("{to}: no answer within {:?}: {e}", self.answer_within))
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        peer::mailbox().forget(self.spec.group);
    }
}

/// The first `len` elements of `scratch` as `T`s, grown (never shrunk) to hold them: `u64` storage is aligned for
/// every element type a ring reduces (4 or 8 bytes).
fn flat_buffer<T: Elem>(scratch: &mut Vec<u64>, len: usize) -> &mut [T] {
    let words = (len * std::mem::size_of::<T>()).div_ceil(8);
    if scratch.len() < words {
        scratch.resize(words, 0);
    }
    &mut bytemuck::cast_slice_mut::<u64, T>(&mut scratch[..words])[..len]
}

/// The refusal of an out-of-place call whose output does not hold as many elements as its input.
fn into_mismatch(len: usize, out: usize) -> CollectiveError {
    CollectiveError::Invalid(format!("an all-reduce of {len} elements into {out}"))
}

/// `input` and `out` as one out-of-place call's target, or [`into_mismatch`].
fn out_of_place<'a, T: Elem>(
    input: Vec<&'a [T]>,
    out: Vec<&'a mut [T]>,
) -> Result<ring::OutOfPlace<'a, T>, CollectiveError> {
    let len = input.iter().map(|i| i.len()).sum();
    let held = out.iter().map(|o| o.len()).sum();
    ring::OutOfPlace::new(input, out).ok_or_else(|| into_mismatch(len, held))
}

/// `dst`'s parts filled, in order, with the concatenation of `src`'s (the two hold as many elements).
fn copy_concatenation<T: Copy>(src: &[&[T]], dst: &mut [&mut [T]]) {
    let mut from = src.iter().copied().filter(|s| !s.is_empty());
    let mut current: &[T] = &[];
    for part in dst.iter_mut() {
        let mut rest: &mut [T] = part;
        while !rest.is_empty() {
            if current.is_empty() {
                match from.next() {
                    Some(next) => current = next,
                    None => return,
                }
            }
            let n = current.len().min(rest.len());
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(n);
            head.copy_from_slice(&current[..n]);
            rest = tail;
            current = &current[n..];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{copy_concatenation, flat_buffer};

    #[test]
    fn a_concatenation_is_copied_however_both_sides_are_cut() {
        let src: [&[i32]; 4] = [&[1, 2, 3], &[], &[4], &[5, 6, 7, 8]];
        let (mut a, mut b, mut c) = ([0; 2], [0; 0], [0; 6]);
        copy_concatenation(&src, &mut [&mut a, &mut b, &mut c]);
        assert_eq!((a, c), ([1, 2], [3, 4, 5, 6, 7, 8]));
    }

    #[test]
    fn the_flat_buffer_grows_to_the_call_and_keeps_its_memory() {
        let mut scratch = Vec::new();
        assert_eq!(flat_buffer::<f32>(&mut scratch, 5).len(), 5);
        assert_eq!(scratch.len(), 3); // 20 bytes in 8-byte words
        let first = scratch.as_ptr();
        assert_eq!(flat_buffer::<f64>(&mut scratch, 2).len(), 2);
        assert_eq!(flat_buffer::<f32>(&mut scratch, 0).len(), 0);
        assert_eq!((scratch.len(), scratch.as_ptr()), (3, first)); // smaller calls reuse it
    }
}
