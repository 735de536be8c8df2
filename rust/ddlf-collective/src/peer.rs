//! Peer links: how one worker opens a ring link to another worker's daemon, and how a daemon admits it.
//!
//! A peer link is a TCP connection to the other daemon's own port. It opens with [`PEER_PREFACE`] (which
//! the admission guard recognises beside HTTP/2 and lanes), then, on a cluster that uses TLS, a TLS handshake
//! (the daemon's own certificate, checked against the master's authority: [`crate::tls`]) inside which
//! everything else travels, then the cluster token, length-prefixed. The daemon
//! compares the token in constant time **before reading anything else**: a connection without it is answered
//! [`ANSWER_UNAUTHENTICATED`] and closed, its remaining bytes never decoded. Only then come the fixed-size ring
//! fields (group, the receiving rank, stream index) and the daemon answers [`ANSWER_OK`].
//!
//! Admitted links wait in this process's [`mailbox`] until the receiving rank's [`crate::Ring`] takes them (the
//! ring runs on the interpreter thread, the daemon accepts on its network runtime, and both are in one process).
//! Links nobody takes are dropped after [`MAILBOX_TTL`].
//!
//! A **liveness probe** ([`probe`]) is a peer link whose key names [`PROBE_RANK`]: the daemon answers
//! [`ANSWER_OK`] from its network runtime and closes it. A rank waiting on a silent neighbour probes it to tell
//! a neighbour still computing (its runtime answers) from one whose process is stopped or whose host is gone
//! (nothing answers, though its kernel may still accept the connection).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, LazyLock, Mutex};
use std::time::{Duration, Instant};

use ddlf_core::auth::Token;
use ddlf_net::guard::{Handover, Slot};
use ddlf_net::preface::PEER_PREFACE;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::link::Link;
use crate::tls::PeerTls;

/// The daemon's answer: admitted.
pub const ANSWER_OK: u8 = 0;
/// The daemon's answer: no token, or the wrong one.
pub const ANSWER_UNAUTHENTICATED: u8 = 1;
/// The daemon's answer: its worker is stopping ([`leave`]); it joins no ring and its rings are over.
pub const ANSWER_LEAVING: u8 = 2;

/// Set once this process's worker has been told to stop ([`leave`]).
static LEAVING: AtomicBool = AtomicBool::new(false);

/// This process's worker is stopping (SIGTERM; it still answers its master for a while): from now on its daemon
/// answers liveness probes and new links with [`ANSWER_LEAVING`], so a rank waiting on it in a ring fails at its
/// next probe (within a quarter of the ring's liveness bound) instead of waiting for a member that no longer
/// takes part, and no new ring includes it. For good: a stopping worker never comes back.
pub fn leave() {
    LEAVING.store(true, Ordering::SeqCst);
}

/// Whether [`leave`] was called.
pub fn leaving() -> bool {
    LEAVING.load(Ordering::SeqCst)
}

/// The longest token a peer may present (the daemon refuses longer ones unread).
const MAX_TOKEN: usize = 4096;

/// How long an admitted link waits to be taken.
pub const MAILBOX_TTL: Duration = Duration::from_secs(300);

/// Which link: the ring (group), the rank it goes to, and which of that rank's parallel streams.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LinkKey {
    /// The ring's group id.
    pub group: u128,
    /// The rank the link goes to (its left link), or [`PROBE_RANK`].
    pub to_rank: u32,
    /// Which of the parallel streams.
    pub stream: u32,
}

impl LinkKey {
    const BYTES: usize = 24;

    fn encode(&self) -> [u8; Self::BYTES] {
        let mut b = [0u8; Self::BYTES];
        b[..16].copy_from_slice(&self.group.to_le_bytes());
        b[16..20].copy_from_slice(&self.to_rank.to_le_bytes());
        b[20..].copy_from_slice(&self.stream.to_le_bytes());
        b
    }

    fn decode(b: &[u8; Self::BYTES]) -> Self {
        let mut group = [0u8; 16];
        group.copy_from_slice(&b[..16]);
        let word = |at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
        LinkKey {
            group: u128::from_le_bytes(group),
            to_rank: word(16),
            stream: word(20),
        }
    }
}

/// What opening a link to the right neighbour can end in (besides I/O errors).
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// Connecting, writing the hello or reading the answer failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The daemon answered, but not with [`ANSWER_OK`] (a wrong token, a TLS mismatch, ...).
    #[error("refused the link: {0}")]
    Refused(&'static str),
    /// The TLS handshake failed (the certificate, its name, the authority).
    #[error("TLS: {0}")]
    Tls(String),
}

/// Open a link to the daemon at `address` (`name`: how the ring spells it, for TLS names) for `key`, presenting
/// `token`, over TLS when `tls` is given. Blocking, bounded by `timeout` per step.
pub fn open(
    address: SocketAddr,
    name: &str,
    key: LinkKey,
    token: Option<&Token>,
    tls: Option<&PeerTls>,
    timeout: Duration,
) -> Result<Link, OpenError> {
    let mut stream = TcpStream::connect_timeout(&address, timeout)?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let secret = token.map(Token::secret).unwrap_or_default();
    let mut hello = Vec::with_capacity(PEER_PREFACE.len() + 4 + secret.len() + LinkKey::BYTES);
    hello.extend_from_slice(PEER_PREFACE);
    hello.extend_from_slice(&(secret.len() as u32).to_le_bytes());
    hello.extend_from_slice(secret);
    hello.extend_from_slice(&key.encode());
    let mut answer = [0u8; 1];
    let (got, link) = match tls {
        None => {
            stream.write_all(&hello)?;
            (stream.read(&mut answer), None)
        }
        Some(tls) => {
            // The preface goes in the clear (the daemon's admission check tells peer links from gRPC by it);
            // the handshake, the token and everything after it inside the tunnel.
            stream.write_all(PEER_PREFACE)?;
            let mut conn = tls.connect(name).map_err(OpenError::Tls)?;
            while conn.is_handshaking() {
                conn.complete_io(&mut stream).map_err(|e| match e.kind() {
                    std::io::ErrorKind::InvalidData => OpenError::Tls(e.to_string()),
                    _ => OpenError::Io(e),
                })?;
            }
            let mut tunnel = rustls::Stream::new(&mut conn, &mut stream);
            tunnel.write_all(&hello[PEER_PREFACE.len()..])?;
            tunnel.flush()?;
            let got = tunnel.read(&mut answer);
            (got, Some(conn))
        }
    };
    let link = match link {
        None => Link::from(stream),
        Some(conn) => Link::tls(stream, rustls::Connection::Client(conn)),
    };
    match got {
        Ok(1) if answer[0] == ANSWER_OK => Ok(link),
        Ok(1) if answer[0] == ANSWER_UNAUTHENTICATED => Err(OpenError::Refused(
            "wrong or missing cluster token (every worker of a ring must share the master's token)",
        )),
        // A TLS record (an alert): a TLS daemon read the plaintext hello as a broken handshake.
        Ok(1) if tls.is_none() && matches!(answer[0], 0x15 | 0x16) => Err(OpenError::Refused(
            "answered in TLS: a TLS daemon (its ring must be formed with the cluster's TLS authority)",
        )),
        Ok(1) if answer[0] == ANSWER_LEAVING => Err(OpenError::Refused(
            "its worker is stopping (told to by SIGTERM): it takes part in no ring any more",
        )),
        Ok(1) => Err(OpenError::Refused("unknown answer")),
        Ok(_) => Err(OpenError::Refused(if tls.is_some() {
            "closed without an answer (an older ddlf, or a daemon without TLS)"
        } else {
            "closed without an answer (an older ddlf, or a TLS daemon: its ring must be formed with the \
             cluster's TLS authority)"
        })),
        Err(e) => Err(e.into()),
    }
}

/// The rank a liveness probe's key names: no ring has that many ranks.
pub const PROBE_RANK: u32 = u32::MAX;

/// Ask the daemon at `address` whether its process still answers, within `timeout`: `Ok` once its network
/// runtime has checked `token` and answered. Blocking.
pub fn probe(
    address: SocketAddr,
    name: &str,
    group: u128,
    token: Option<&Token>,
    tls: Option<&PeerTls>,
    timeout: Duration,
) -> Result<(), OpenError> {
    let key = LinkKey {
        group,
        to_rank: PROBE_RANK,
        stream: 0,
    };
    open(address, name, key, token, tls, timeout).map(drop)
}

/// Links admitted by this process's daemon(s), waiting for their ring.
pub struct Mailbox {
    links: Mutex<HashMap<LinkKey, (Instant, Link, Slot)>>,
    arrived: Condvar,
}

/// This process's mailbox.
pub fn mailbox() -> &'static Mailbox {
    static MAILBOX: LazyLock<Mailbox> = LazyLock::new(|| Mailbox {
        links: Mutex::new(HashMap::new()),
        arrived: Condvar::new(),
    });
    &MAILBOX
}

impl Mailbox {
    fn put(&self, key: LinkKey, stream: Link, slot: Slot) {
        let mut links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        links.retain(|_, (at, _, _)| at.elapsed() < MAILBOX_TTL);
        // A second link for the same key replaces the first (a rank that reconnected); the first closes.
        links.insert(key, (Instant::now(), stream, slot));
        self.arrived.notify_all();
    }

    /// Take the link for `key`, waiting up to `timeout` for it to arrive.
    pub fn take(&self, key: LinkKey, timeout: Duration) -> Option<(Link, Slot)> {
        let deadline = Instant::now() + timeout;
        let mut links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some((_, stream, slot)) = links.remove(&key) {
                return Some((stream, slot));
            }
            let left = deadline.checked_duration_since(Instant::now())?;
            links = self
                .arrived
                .wait_timeout(links, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Drop every waiting link of `group` (a ring that failed or closed).
    pub fn forget(&self, group: u128) {
        let mut links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        links.retain(|k, _| k.group != group);
    }
}

/// Read a link's hello after its preface: the token (compared before anything else is read), then the key.
/// `None`: a wrong or missing token.
async fn hello<S: AsyncRead + Unpin>(
    stream: &mut S,
    token: Option<&Token>,
) -> std::io::Result<Option<LinkKey>> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).await?;
    let len = u32::from_le_bytes(len) as usize;
    let mut secret = vec![0u8; len.min(MAX_TOKEN)];
    if len <= MAX_TOKEN {
        stream.read_exact(&mut secret).await?;
    }
    let ok = len <= MAX_TOKEN && token.is_none_or(|t| t.verify(&secret));
    if !ok {
        return Ok(None);
    }
    let mut key = [0u8; LinkKey::BYTES];
    stream.read_exact(&mut key).await?;
    Ok(Some(LinkKey::decode(&key)))
}

/// Answer a hello; a link (not a probe) that was admitted is handed over, as `into_link` makes it.
async fn answer<S: AsyncWrite + Unpin>(
    mut stream: S,
    peer: SocketAddr,
    key: Option<LinkKey>,
    slot: Slot,
    rejected: &AtomicU64,
    into_link: impl FnOnce(S) -> std::io::Result<Link>,
) {
    let Some(key) = key else {
        rejected.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(%peer, "peer link refused: wrong or missing token");
        let _ = stream.write_all(&[ANSWER_UNAUTHENTICATED]).await;
        let _ = stream.flush().await;
        return;
    };
    if leaving() {
        tracing::debug!(%peer, rank = key.to_rank, "peer link or probe answered: this worker is stopping");
        let _ = stream.write_all(&[ANSWER_LEAVING]).await;
        let _ = stream.flush().await;
        return;
    }
    let answered = async {
        stream.write_all(&[ANSWER_OK]).await?;
        stream.flush().await
    };
    if answered.await.is_err() || key.to_rank == PROBE_RANK {
        // A liveness probe: answering is the whole point; nothing goes to the mailbox.
        return;
    }
    match into_link(stream) {
        Ok(link) => {
            tracing::debug!(%peer, rank = key.to_rank, stream = key.stream, tls = link.is_tls(), "peer link admitted");
            mailbox().put(key, link, slot);
        }
        Err(e) => tracing::warn!(%peer, error = %e, "cannot hand a peer link over"),
    }
}

/// The daemon's end: check a peer link's token, then its fields, and put it in the mailbox. With `tls` (a TLS
/// daemon), the handshake comes first and the hello travels inside it. `rejected` counts refused tokens (the
/// daemon's status shows it).
pub async fn welcome(
    arrival: Handover,
    token: Option<Arc<Token>>,
    tls: Option<Arc<rustls::ServerConfig>>,
    handshake_timeout: Duration,
    rejected: Arc<AtomicU64>,
) {
    let Handover {
        mut stream,
        peer,
        slot,
    } = arrival;
    let token = token.as_deref();
    let Some(tls) = tls else {
        match tokio::time::timeout(handshake_timeout, hello(&mut stream, token)).await {
            Ok(Ok(key)) => {
                answer(stream, peer, key, slot, &rejected, |s| {
                    s.into_std().map(Link::from)
                })
                .await
            }
            Ok(Err(e)) => tracing::warn!(%peer, error = %e, "peer link closed during its hello"),
            Err(_) => {
                tracing::warn!(%peer, "peer link sent no hello within the handshake deadline")
            }
        }
        return;
    };
    let accepted = tokio::time::timeout(handshake_timeout, async {
        let mut tunnel = tokio_rustls::TlsAcceptor::from(tls).accept(stream).await?;
        let key = hello(&mut tunnel, token).await?;
        Ok::<_, std::io::Error>((tunnel, key))
    })
    .await;
    match accepted {
        Ok(Ok((tunnel, key))) => {
            answer(tunnel, peer, key, slot, &rejected, |t| {
                let (sock, conn) = t.into_inner();
                Ok(Link::tls(
                    sock.into_std()?,
                    rustls::Connection::Server(conn),
                ))
            })
            .await
        }
        Ok(Err(e)) => {
            tracing::warn!(%peer, error = %e, "TLS peer link failed its handshake or hello")
        }
        Err(_) => {
            tracing::warn!(%peer, "TLS peer link sent no hello within the handshake deadline")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_keys_round_trip() {
        let k = LinkKey {
            group: u128::MAX - 7,
            to_rank: 3,
            stream: 1,
        };
        assert_eq!(LinkKey::decode(&k.encode()), k);
    }
}
