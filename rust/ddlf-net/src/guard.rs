//! Admission control in front of a daemon's gRPC server.
//!
//! Every accepted TCP connection must, within a handshake deadline, start with what a real master sends first:
//! the HTTP/2 client preface on a plaintext daemon, a TLS handshake record on a TLS one. Anything else (random
//! bytes, an HTTP/1 request, TLS to a plaintext port, plaintext to a TLS port, a half-open connection that
//! sends nothing) is refused, logged with the peer's address and counted, before tonic or hyper ever see it.
//! A cap on open connections keeps a flood of them from exhausting the daemon's file descriptors and memory.
//!
//! The bytes read for the check are replayed to the server, so an accepted connection is untouched.
//!
//! A plaintext daemon also admits direct lanes (see [`crate::lane`]), and every daemon peer links (the
//! `ddlf-collective` crate): a connection that opens with [`LANE_PREFACE`] or [`PEER_PREFACE`] is handed to the
//! daemon's handler for it instead of the gRPC server (on a TLS daemon, a peer link's handshake follows its
//! preface). What each kind opens with, and how the first bytes are judged, is [`crate::preface`]'s table.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::{Connected, TcpConnectInfo};

use crate::preface::{judge, needed, Admission, Rejection, H2_PREFACE, LANE_PREFACE, PEER_PREFACE};

/// Limits of the admission check.
#[derive(Clone, Debug)]
pub struct GuardConfig {
    /// Connections open at once; more are refused (closed at once and logged).
    pub max_connections: u64,
    /// How long a new connection may take to send its first bytes.
    pub handshake_timeout: Duration,
    /// The daemon speaks TLS: connections must open with a TLS handshake record.
    pub tls: bool,
}

impl Default for GuardConfig {
    fn default() -> Self {
        GuardConfig {
            max_connections: 1024,
            handshake_timeout: Duration::from_secs(10),
            tls: false,
        }
    }
}

/// Connection counters, shared with the daemon's status.
#[derive(Debug, Default)]
pub struct ConnStats {
    /// Connections open now (admitted or still being judged).
    pub open: AtomicU64,
    /// Connections rejected since the daemon started.
    pub refused: AtomicU64,
}

/// Holds one connection slot; releases it when dropped (with the connection it was taken for).
#[derive(Debug)]
pub struct Slot(Arc<ConnStats>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// An admitted connection: the bytes read by the check are served again before the socket's own.
#[derive(Debug)]
pub struct Admitted {
    stream: TcpStream,
    prefix: Vec<u8>,
    pos: usize,
    info: TcpConnectInfo,
    _slot: Slot,
}

impl Connected for Admitted {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.info.clone()
    }
}

impl AsyncRead for Admitted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.pos < self.prefix.len() {
            let n = (self.prefix.len() - self.pos).min(buf.remaining());
            let start = self.pos;
            buf.put_slice(&self.prefix[start..start + n]);
            self.pos += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Admitted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

/// A direct lane or peer link that passed the preface check, for the daemon's handler of it (which checks its
/// hello).
#[derive(Debug)]
pub struct Handover {
    /// The socket, its preface read.
    pub stream: TcpStream,
    /// The other end's address.
    pub peer: SocketAddr,
    /// Keep it as long as the lane is open: the lane counts against the connection limit.
    pub slot: Slot,
}

/// An admitted connection of either kind.
enum Arrival {
    Grpc(Admitted),
    Lane(Handover),
    Peer(Handover),
}

/// Read the first bytes of a connection (within the handshake deadline) and judge them.
async fn read_first(
    stream: &mut TcpStream,
    config: &GuardConfig,
) -> Result<(Admission, Vec<u8>), Rejection> {
    let mut want = needed(config.tls);
    let mut first = vec![0u8; H2_PREFACE.len().max(PEER_PREFACE.len())];
    let mut got = 0;
    let read = async {
        while got < want {
            match stream.read(&mut first[got..want]).await {
                Ok(0) | Err(_) => return Err(Rejection::Closed),
                Ok(n) => got += n,
            }
            // Decide as early as the bytes allow: garbage need not wait for 24 bytes.
            let so_far = &first[..got];
            let plausible = if config.tls {
                so_far[0] == 0x16 || PEER_PREFACE.starts_with(so_far)
            } else {
                H2_PREFACE.starts_with(so_far)
                    || LANE_PREFACE.starts_with(so_far)
                    || PEER_PREFACE.starts_with(so_far)
            };
            if !plausible {
                return judge(so_far, config.tls);
            }
            if config.tls && so_far[0] != 0x16 {
                // A TLS daemon's peer link: its whole preface comes before its handshake.
                want = PEER_PREFACE.len();
            }
        }
        judge(&first[..got], config.tls)
    };
    match tokio::time::timeout(config.handshake_timeout, read).await {
        Err(_) => Err(Rejection::Silent(config.handshake_timeout)),
        Ok(Err(r)) => Err(r),
        Ok(Ok(a)) => {
            first.truncate(got);
            Ok((a, first))
        }
    }
}

async fn admit(
    mut stream: TcpStream,
    peer: SocketAddr,
    config: &GuardConfig,
    slot: Slot,
) -> Result<Arrival, Rejection> {
    let (admission, first) = match read_first(&mut stream, config).await {
        Ok(x) => x,
        Err(reason) => {
            // Counted while the stream is still open: whoever sees it close sees the count.
            slot.0.refused.fetch_add(1, Ordering::Relaxed);
            return Err(reason);
        }
    };
    // A lane's or peer link's preface was read whole (it is exactly as long as the read): its hello comes next.
    match admission {
        Admission::Lane => return Ok(Arrival::Lane(Handover { stream, peer, slot })),
        Admission::Peer => return Ok(Arrival::Peer(Handover { stream, peer, slot })),
        Admission::Grpc => {}
    }
    let info = TcpConnectInfo {
        local_addr: stream.local_addr().ok(),
        remote_addr: Some(peer),
    };
    Ok(Arrival::Grpc(Admitted {
        stream,
        prefix: first,
        pos: 0,
        info,
        _slot: slot,
    }))
}

/// Where a daemon's non-gRPC connections go; `None` refuses that kind.
#[derive(Clone, Default)]
pub struct Handlers {
    /// Where direct lanes go.
    pub lanes: Option<mpsc::UnboundedSender<Handover>>,
    /// Where peer links go.
    pub peers: Option<mpsc::UnboundedSender<Handover>>,
}

/// Accept connections on `listener`, check each one concurrently, and yield the admitted gRPC ones; direct lanes
/// and peer links go to `handlers`. Stops accepting (and closes the listening socket) when the returned stream
/// is dropped.
pub fn guarded(
    listener: TcpListener,
    config: GuardConfig,
    stats: Arc<ConnStats>,
    handlers: Handlers,
) -> ReceiverStream<io::Result<Admitted>> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                _ = tx.closed() => break,
                a = listener.accept() => a,
            };
            let (stream, peer) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            let open = stats.open.fetch_add(1, Ordering::Relaxed) + 1;
            let slot = Slot(stats.clone());
            if open > config.max_connections {
                stats.refused.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%peer, reason = %Rejection::TooMany(open - 1), "connection refused");
                continue; // dropping the stream closes it; dropping the slot frees it
            }
            let (tx, stats, config, handlers) =
                (tx.clone(), stats.clone(), config.clone(), handlers.clone());
            tokio::spawn(async move {
                match admit(stream, peer, &config, slot).await {
                    Ok(Arrival::Grpc(conn)) => {
                        tracing::debug!(%peer, "connection admitted");
                        let _ = tx.send(Ok(conn)).await;
                    }
                    Ok(Arrival::Lane(lane)) => hand_over(
                        lane,
                        handlers.lanes.as_ref(),
                        "direct lane",
                        &stats,
                        Rejection::LanesOff,
                    ),
                    Ok(Arrival::Peer(link)) => hand_over(
                        link,
                        handlers.peers.as_ref(),
                        "peer link",
                        &stats,
                        Rejection::PeersOff,
                    ),
                    Err(reason) => {
                        // Counted by `admit` before the connection closed.
                        tracing::warn!(%peer, %reason, "connection refused");
                    }
                }
            });
        }
        tracing::debug!("stopped accepting connections");
    });
    ReceiverStream::new(rx)
}

fn hand_over(
    arrival: Handover,
    to: Option<&mpsc::UnboundedSender<Handover>>,
    what: &str,
    stats: &ConnStats,
    off: Rejection,
) {
    let peer = arrival.peer;
    match to {
        Some(to) => {
            tracing::debug!(%peer, "{what} admitted");
            let _ = to.send(arrival);
        }
        None => {
            stats.refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%peer, reason = %off, "connection refused");
        }
    }
}
