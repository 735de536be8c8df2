//! The daemon's end of direct lanes (see `ddlf_net::lane` and "Direct lanes" in `proto/ddlf.proto`).
//!
//! The network runtime checks a new lane's hello (token and protocol version, within the handshake deadline),
//! then hands the socket to the interpreter thread, which from then on reads requests from it between jobs
//! ([`crate::jobs::JobReceiver::next`]) and writes each reply itself when the job is done.

use ddlf_net::refusal;
use ddlf_proto::Refusal;
use std::io;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use ddlf_core::auth::Token;
use ddlf_core::frame::{FrameError, FrameLimits};
use ddlf_net::guard::{Handover, Slot};
use ddlf_net::lane::{
    configure, handshake_bytes, joined_value, message_value, read_handshake, write_frame,
    FrameReader, LaneError,
};
use ddlf_proto::{
    CallReply, CallRequest, LaneFrame, LaneHello, LaneKind, LaneWelcome, PROTOCOL_VERSION,
};
use tokio::io::AsyncWriteExt;
use tonic::Status;

use crate::requests::screen;
use crate::state::WorkerState;

/// How long a lane may stall in the middle of a frame (or a reply write) before the daemon closes it. The
/// interpreter thread is the one waiting, so this is short; a master never pauses inside a frame.
const STALL: Duration = Duration::from_secs(10);

/// The most bytes of a refused request the daemon reads and discards to keep its lane in step; past it the lane is
/// closed after the refusal (the master opens it again).
const DRAIN_LIMIT: u64 = 16 << 20;

/// Check a new lane's hello and, if it passes, `deliver` a call lane to the interpreter thread (false: it is
/// shutting down), or serve a ping lane on a thread of its own until `stopped` ([`crate::pings`]).
pub(crate) async fn welcome(
    arrival: Handover,
    token: Option<Arc<Token>>,
    handshake_timeout: Duration,
    state: Arc<WorkerState>,
    deliver: impl FnOnce(LaneIn) -> bool,
    stopped: tokio::sync::watch::Receiver<bool>,
) {
    let Handover {
        mut stream,
        peer,
        slot,
    } = arrival;
    let hello =
        match tokio::time::timeout(handshake_timeout, read_handshake::<LaneHello>(&mut stream))
            .await
        {
            Ok(Ok(hello)) => hello,
            Ok(Err(e)) => return refuse_silently(&state, peer, &e.to_string()),
            Err(_) => {
                return refuse_silently(&state, peer, "no hello within the handshake deadline")
            }
        };
    let (refusal, refused) = if hello.protocol_version != PROTOCOL_VERSION {
        let why = format!(
            "the master speaks protocol {}, this worker protocol {PROTOCOL_VERSION} (ddlf {})",
            hello.protocol_version,
            ddlf_proto::VERSION
        );
        (Refusal::Protocol, why)
    } else if token
        .as_ref()
        .is_some_and(|t| !t.verify_header(hello.authorization.as_bytes()))
    {
        state
            .rejected
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let why = if hello.authorization.is_empty() {
            "this worker requires a token and none was sent"
        } else {
            "wrong token"
        };
        (Refusal::Unauthenticated, why.to_string())
    } else {
        (Refusal::None, String::new())
    };
    if !refused.is_empty() {
        tracing::warn!(%peer, reason = %refused, "direct lane refused");
    }
    let answer = LaneWelcome {
        protocol_version: PROTOCOL_VERSION,
        instance: state.instance,
        refused: refused.clone(),
        refusal: refusal as i32,
        // A kind this daemon does not know reads as the default (calls): the master then closes the lane.
        kind: hello.kind() as i32,
    };
    if let Err(e) = stream.write_all(&handshake_bytes(&answer)).await {
        return refuse_silently(&state, peer, &e.to_string());
    }
    if !refused.is_empty() {
        return;
    }
    if hello.kind() == LaneKind::Ping {
        match stream
            .into_std()
            .and_then(|s| s.set_nonblocking(false).map(|()| s))
        {
            Ok(s) => crate::pings::serve(s, peer, slot, state, stopped),
            Err(e) => tracing::warn!(%peer, error = %e, "cannot set up a ping lane"),
        }
        return;
    }
    let stream = match stream
        .into_std()
        .and_then(|s| s.set_nonblocking(false).map(|()| s))
        .and_then(|s| configure(&s, STALL).map(|()| s))
    {
        Ok(s) => s,
        Err(e) => return tracing::warn!(%peer, error = %e, "cannot set up a direct lane"),
    };
    match LaneIn::new(stream, peer, slot) {
        Ok(lane) => {
            if deliver(lane) {
                tracing::debug!(%peer, "direct lane open");
            }
        }
        Err(e) => tracing::warn!(%peer, error = %e, "cannot set up a direct lane"),
    }
}

fn refuse_silently(state: &WorkerState, peer: SocketAddr, why: &str) {
    state
        .connections
        .refused
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    tracing::warn!(%peer, reason = why, "direct lane refused: bad hello");
}

/// The interpreter thread's side of a lane: where requests are read.
pub(crate) struct LaneIn {
    stream: TcpStream,
    reader: FrameReader,
    out: Arc<LaneOut>,
    _slot: Slot,
}

/// What reading a lane gave.
// Returned once per request and unpacked at once; boxing would add an allocation to every call.
#[allow(clippy::large_enum_variant)]
pub(crate) enum LaneRead {
    /// A request to run.
    Request(CallRequest),
    /// A request refused without running; the refusal was written and the lane stays open.
    Answered,
    /// The lane is closed (by the master, or by us after a broken frame): drop it.
    Closed,
}

fn give_up() -> io::Result<()> {
    Err(io::ErrorKind::TimedOut.into())
}

impl LaneIn {
    fn new(stream: TcpStream, peer: SocketAddr, slot: Slot) -> io::Result<Self> {
        let out = Arc::new(LaneOut {
            stream: stream.try_clone()?,
            peer,
        });
        Ok(LaneIn {
            stream,
            reader: FrameReader::default(),
            out,
            _slot: slot,
        })
    }

    pub(crate) fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    pub(crate) fn has_buffered(&self) -> bool {
        self.reader.has_buffered()
    }

    /// Take whatever has arrived without blocking; whether anything (or the end of the stream) did.
    pub(crate) fn try_fill(&mut self) -> bool {
        self.reader.try_fill(&self.stream)
    }

    /// Where this lane's replies are written.
    pub(crate) fn out(&self) -> Arc<LaneOut> {
        self.out.clone()
    }

    /// Read the next request (the socket is readable, or bytes are buffered) and screen it as the gRPC service
    /// does; a refused request is answered here.
    pub(crate) fn read(&mut self, state: &WorkerState, limits: FrameLimits) -> LaneRead {
        let peer = self.out.peer;
        let frame = match self.reader.read_message(&mut self.stream, &mut give_up) {
            Ok(f) => f,
            Err(LaneError::Closed) => {
                tracing::debug!(%peer, "direct lane closed by the master");
                return LaneRead::Closed;
            }
            Err(e) => return self.broken(state, &e),
        };
        let Some(mut request) = frame.request else {
            return self.broken(state, &"a frame without a request");
        };
        let value = match self
            .reader
            .read_parts(&self.stream, &frame.lengths, limits, &mut give_up)
        {
            Ok(v) => v,
            Err(LaneError::Limits(e @ FrameError::TooLarge { declared, .. })) => {
                // The same words as a streamed request refused over gRPC.
                let status = state.reject(refusal::status(Refusal::TooLarge, e.to_string()));
                // Keep the lane in step by reading past the refused bytes, unless there are too many of them.
                let keep = declared <= DRAIN_LIMIT
                    && self
                        .reader
                        .skip(&mut self.stream, declared, &mut give_up)
                        .is_ok();
                self.out.refuse(&status);
                return if keep {
                    LaneRead::Answered
                } else {
                    LaneRead::Closed
                };
            }
            Err(e) => return self.broken(state, &e),
        };
        request.value = Some(joined_value(request.value.take(), value));
        match screen(state, &request) {
            Ok(()) => LaneRead::Request(request),
            Err(status) => {
                self.out.refuse(&status);
                LaneRead::Answered
            }
        }
    }

    fn broken(&self, state: &WorkerState, why: &dyn std::fmt::Display) -> LaneRead {
        state
            .rejected
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tracing::warn!(peer = %self.out.peer, reason = %why, "direct lane closed: malformed frame");
        LaneRead::Closed
    }
}

/// Where a lane's replies are written (by the interpreter thread, once its job is done).
pub struct LaneOut {
    stream: TcpStream,
    peer: SocketAddr,
}

impl LaneOut {
    /// Write `reply`. A failure (the master went away) is logged; the lane's reader then finds it closed.
    pub(crate) fn send(&self, mut reply: CallReply) {
        let value = reply.value.take().unwrap_or_default();
        reply.value = message_value(&value);
        let frame = LaneFrame {
            reply: Some(reply),
            ..Default::default()
        };
        self.write(frame, &value.pickle, &value.buffers);
    }

    fn refuse(&self, status: &Status) {
        // Every refusal the daemon makes carries its code; a status without one (none is made today) is
        // reported as malformed rather than dropped.
        let frame = LaneFrame {
            refusal: refusal::of_status(status).unwrap_or(Refusal::Malformed) as i32,
            refused_message: status.message().to_string(),
            ..Default::default()
        };
        self.write(frame, &[], &[]);
    }

    fn write(&self, frame: LaneFrame, pickle: &[u8], buffers: &[bytes::Bytes]) {
        if let Err(e) = write_frame(&mut &self.stream, frame, pickle, buffers, &mut give_up) {
            tracing::debug!(peer = %self.peer, error = %e, "reply not delivered: the direct lane broke");
            let _ = self.stream.shutdown(std::net::Shutdown::Both);
        }
    }
}
