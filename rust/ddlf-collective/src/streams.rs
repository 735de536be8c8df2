//! A ring's streams: each a pair of links to the neighbours (in from the left, out to the right), opened on a
//! ring's first call ([`Ring::connect`]) and kept for the next; and how a pass runs over them, naming the
//! neighbour it blames when it fails.

use std::time::Duration;

use ddlf_net::guard::Slot;

use crate::ring::{self, RingError, Side, Watch};
use crate::{activity, peer, CollectiveError, Link, Ring};

/// One stream's links, and the daemon's slot that admitted the left one (held while the link lives).
pub(crate) struct Stream {
    pub(crate) links: ring::Links,
    _slot: Slot,
}

impl Ring {
    /// Open every stream's link to the right neighbour, then take the left neighbour's from the mailbox.
    pub(crate) fn connect(&mut self) -> Result<Vec<Stream>, CollectiveError> {
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

    /// Open the leader's links now (before a local stage: see [`Node::allreduce`](crate::node::Node::allreduce)).
    pub(crate) fn open_if(&mut self, leads: bool) -> Result<(), CollectiveError> {
        if leads && self.streams.is_none() {
            self.streams = Some(self.connect()?);
        }
        Ok(())
    }

    /// Run `pass` over this rank's links (opened on first use) with the watch of their neighbours; the links are
    /// kept for the next call when it succeeds, and its error names the neighbour it blames.
    pub(crate) fn on_links(
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
    pub(crate) fn on_streams<P: Send>(
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
}
