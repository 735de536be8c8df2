//! How a ring's passes watch its neighbours ([`Watcher`]): their daemons' addresses resolved once, and a
//! liveness probe of either one (see [`RingSpec::liveness`](crate::RingSpec::liveness)).

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use ddlf_core::auth::Token;

use crate::peer;
use crate::ring::Side;
use crate::tls::PeerTls;
use crate::{CollectiveError, Ring};

impl Ring {
    /// Rank `rank`'s daemon address, resolved.
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

    /// How a pass of this ring watches its neighbours (see [`RingSpec::liveness`](crate::RingSpec::liveness)).
    pub(crate) fn watcher(&self) -> Result<Watcher, CollectiveError> {
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
}

/// What a ring's passes need to probe its neighbours (owned, so the parallel streams' threads share it).
pub(crate) struct Watcher {
    group: u128,
    /// Each neighbour's resolved address, and as the ring spells it (for TLS names).
    left: (SocketAddr, String),
    pub(crate) right: (SocketAddr, String),
    token: Option<Token>,
    tls: Option<PeerTls>,
    answer_within: Duration,
    /// How often a pass probes a neighbour that makes no progress.
    pub(crate) every: Duration,
}

impl Watcher {
    /// Ask the neighbour on `side`'s daemon whether its process still answers.
    pub(crate) fn probe(&self, side: Side) -> Result<(), String> {
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
