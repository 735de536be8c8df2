//! What one rank knows of its ring ([`RingSpec`]): the ring's group, its ranks' daemons, how many links join two
//! neighbours, how long a rank waits, how fast a dead neighbour is detected, TLS, and its host's group.

use std::time::Duration;

use crate::node::LocalSpec;
use crate::tls::PeerTls;

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
    /// waiting on a silent neighbour probes its daemon every quarter of it ([`peer::probe`](crate::peer::probe),
    /// answered by the daemon's network runtime even while its Python computes; a stopped process or a frozen or
    /// cut-off host does not answer within three quarters of it). TCP keepalive and `TCP_USER_TIMEOUT` bound a
    /// link whose host vanished in the same time. A neighbour whose process dies is detected at once (its links
    /// close).
    pub liveness: Duration,
    /// Open TLS peer links, checking neighbours' certificates with this (a cluster that uses TLS); `None`:
    /// plaintext links.
    pub tls: Option<PeerTls>,
    /// Hierarchical mode: this rank's place among the ring's members on its host. The members reduce through
    /// shared memory ([`node`](crate::node)), and only the host's leader (local index 0) takes part in the ring,
    /// whose `addresses` and `rank` then name the hosts' leaders. `None`: every member is a rank of a flat ring.
    pub local: Option<LocalSpec>,
}
