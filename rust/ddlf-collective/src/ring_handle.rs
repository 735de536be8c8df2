//! [`Ring`]: one rank's membership in a ring: its spec, its links (opened on first use and kept for the following
//! calls), its host's stage, and the guard around every call that spends the ring when the call fails.
//!
//! What a call does is [`Ring::run`]'s (`collective.rs`); how the links open and a pass runs over them,
//! `streams.rs`; how the neighbours are watched, `watch.rs`.

use std::ops::Range;
use std::time::Duration;

use ddlf_core::auth::Token;

use crate::ring::{self, Side};
use crate::streams::Stream;
use crate::watch::Watcher;
#[cfg(doc)]
use crate::Request;
use crate::{activity, node, peer, CollectiveError, RingSpec};

/// One rank's membership in a ring (see the module docs).
pub struct Ring {
    pub(crate) spec: RingSpec,
    pub(crate) token: Option<Token>,
    pub(crate) streams: Option<Vec<Stream>>,
    /// The neighbours' addresses resolved once, for their liveness probes (made with the links).
    pub(crate) watcher: Option<Watcher>,
    pub(crate) spent: Option<String>,
    /// Hierarchical mode's local stage (see [`RingSpec::local`]).
    pub(crate) node: Option<node::Node>,
    /// The call in progress ([`activity`]; 0 between calls).
    pub(crate) activity: u64,
    /// A flat ring's buffer for the results of a list of parts reduced in place (and of an atomic call's one
    /// array), kept between calls (a fresh one each call would fault in its pages every time). It is as large as the
    /// largest such call so far, for the ring's life (a worker keeps its few latest rings open:
    /// `ddlf.worker.collective`).
    pub(crate) scratch: Vec<u64>,
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

    /// How many ranks the ring has (a hierarchical ring's: its hosts).
    pub(crate) fn n(&self) -> usize {
        self.spec.addresses.len()
    }

    /// The rank on `side` and its daemon's address.
    pub(crate) fn neighbour(&self, side: Side) -> (usize, String) {
        let n = self.n();
        let rank = match side {
            Side::Left => (self.spec.rank + n - 1) % n,
            Side::Right => (self.spec.rank + 1) % n,
        };
        (rank, self.spec.addresses[rank].clone())
    }

    /// How many shared-memory data files this rank's host stage has made ([`node::Node::files_made`]); `None` on a
    /// flat ring, which has no host stage.
    pub fn shared_files_made(&self) -> Option<u64> {
        self.node.as_ref().map(node::Node::files_made)
    }

    /// Whether a failed all-reduce in place ([`Request::allreduce`]) leaves `data` as it was: true for a
    /// hierarchical rank (the host's stage works on shared memory and writes `data` only after the last step that
    /// can fail) and for a ring of one; a flat ring's passes write `data` as they go (unless the request is
    /// [`Request::atomic`]).
    pub fn leaves_data_on_failure(&self) -> bool {
        self.node.is_some() || self.n() == 1
    }

    /// Whether a result can stay in shared memory ([`Request::allreduce_shared`]): a hierarchical ring whose
    /// one host holds every rank.
    pub fn shares_results(&self) -> bool {
        self.node.as_ref().is_some_and(|n| n.single_host())
    }

    /// The elements of `len` this rank owns between [`Request::reduce_scatter`] and [`Request::allgather`]:
    /// chunk `rank` of a flat ring; on a hierarchical one, this member's sub-chunk of its host's chunk. The
    /// ranks' shards are disjoint, cover `0..len` and are the same on every call with `len` elements.
    pub fn shard(&self, len: usize) -> Range<usize> {
        match &self.node {
            Some(node) => node.shard(len, self.spec.rank, self.n()),
            None => ring::shard(len, self.n(), self.spec.rank),
        }
    }

    /// Run `call` (`what` it does, for [`activity`]), refusing it on a spent ring and spending the ring when it
    /// fails.
    pub(crate) fn guarded<R>(
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
}

impl Drop for Ring {
    fn drop(&mut self) {
        peer::mailbox().forget(self.spec.group);
    }
}
