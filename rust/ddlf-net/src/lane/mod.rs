//! Direct lanes: `Call`s as length-prefixed frames on a plain TCP connection, read and answered by the worker's
//! interpreter thread itself (the protocol is described under "Direct lanes" in `proto/ddlf.proto`).
//!
//! Over gRPC a call crosses threads twice on the worker (network runtime to interpreter and back) and pays for
//! HTTP/2 framing on both ends; on a lane, the master's calling thread writes the request and blocks reading the
//! reply, and the worker's interpreter thread reads, runs and writes: the shape of a raw socket echo. Both ends
//! share the framing: [`write_frame`] and [`FrameReader`]. [`Lane`] is the master's end.
//!
//! * `frame`: the framing both ends share.
//! * [`Lane`], [`LaneCall`]: the master's end, one call at a time.
//! * `ping`: [`PingLane`], a second lane whose pings a daemon thread of their own answers.

mod frame;
mod ping;

pub use frame::*;
pub use ping::{PingCall, PingLane};

use std::io;
use std::net::TcpStream;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ddlf_core::auth::Token;
use ddlf_core::frame::FrameLimits;
use ddlf_proto::{
    CallReply, CallRequest, LaneFrame, LaneHello, LaneKind, LaneWelcome, Refusal, PROTOCOL_VERSION,
};
use tokio::io::AsyncWriteExt;

use crate::error::NetError;
use crate::preface::LANE_PREFACE;

/// How long a blocking read or write on the master's end of a lane waits (its socket timeout) before it checks
/// the call's deadline, the caller's interrupt and the worker's liveness again.
pub const MASTER_POLL: Duration = Duration::from_millis(50);

/// The master's end of a lane to one worker. One call at a time: a thread that finds it busy uses gRPC.
#[derive(Debug)]
pub struct Lane {
    address: String,
    io: Mutex<Slot>,
    limits: FrameLimits,
    instance: u64,
    token: Option<Token>,
    timeout: Duration,
    spin: Duration,
    kind: LaneKind,
}

/// Connect to `address`, pass the handshake of a lane of `kind` within `timeout`: the connection and the
/// daemon's instance.
async fn connect(
    address: &str,
    token: Option<&Token>,
    timeout: Duration,
    kind: LaneKind,
) -> Result<(LaneIo, u64), NetError> {
    let unavailable = |reason: String| NetError::Unavailable {
        address: address.to_string(),
        reason: format!("direct lane: {reason}"),
    };
    let handshake = async {
        let mut stream = tokio::net::TcpStream::connect(address).await?;
        let hello = LaneHello {
            protocol_version: PROTOCOL_VERSION,
            authorization: token.map(Token::header_value).unwrap_or_default(),
            kind: kind as i32,
        };
        let mut out = LANE_PREFACE.to_vec();
        out.extend(handshake_bytes(&hello));
        stream.write_all(&out).await?;
        let welcome: LaneWelcome = read_handshake(&mut stream).await?;
        Ok::<_, LaneError>((stream, welcome))
    };
    let (stream, welcome) = match tokio::time::timeout(timeout, handshake).await {
        Err(_) => {
            return Err(NetError::DeadlineExceeded {
                address: address.to_string(),
                after: timeout,
            })
        }
        Ok(Err(e)) => return Err(unavailable(e.to_string())),
        Ok(Ok(x)) => x,
    };
    let refusal = welcome.refusal();
    if refusal != Refusal::None || !welcome.refused.is_empty() {
        // A daemon may refuse without a code only if it is broken: call that malformed.
        let refusal = if refusal == Refusal::None {
            Refusal::Malformed
        } else {
            refusal
        };
        return Err(NetError::refused(
            address.to_string(),
            refusal,
            format!("direct lane refused: {}", welcome.refused),
        ));
    }
    if welcome.kind() != kind {
        // A daemon that predates this kind of lane took it for a call lane: closing it is all it sees.
        return Err(unavailable(format!(
            "the daemon serves no {} lane",
            kind.as_str_name()
        )));
    }
    let stream = stream
        .into_std()
        .and_then(|s| s.set_nonblocking(false).map(|()| s))
        .and_then(|s| configure(&s, MASTER_POLL).map(|()| s))
        .map_err(|e| unavailable(e.to_string()))?;
    let io = LaneIo {
        stream,
        reader: FrameReader::default(),
    };
    Ok((io, welcome.instance))
}

/// A lane's connection: free for a call, taken by one, or closed after a failure.
#[derive(Debug)]
enum Slot {
    Free(LaneIo),
    Busy,
    Broken,
}

#[derive(Debug)]
struct LaneIo {
    stream: TcpStream,
    reader: FrameReader,
}

impl Lane {
    /// Open a lane to `address` and pass its handshake within `timeout`.
    pub async fn open(
        address: &str,
        token: Option<&Token>,
        timeout: Duration,
        limits: FrameLimits,
        spin: Duration,
    ) -> Result<Lane, NetError> {
        Self::open_kind(address, token, timeout, limits, spin, LaneKind::Calls).await
    }

    async fn open_kind(
        address: &str,
        token: Option<&Token>,
        timeout: Duration,
        limits: FrameLimits,
        spin: Duration,
        kind: LaneKind,
    ) -> Result<Lane, NetError> {
        let (io, instance) = connect(address, token, timeout, kind).await?;
        Ok(Lane {
            address: address.to_string(),
            io: Mutex::new(Slot::Free(io)),
            limits,
            instance,
            token: token.cloned(),
            timeout,
            spin,
            kind,
        })
    }

    /// After the lane broke (a deadline, Ctrl-C, a reset) and the worker has since answered over gRPC: open a
    /// fresh connection to the same daemon instance. Does nothing if the lane is open.
    pub async fn reopen(&self) -> Result<(), NetError> {
        if !matches!(*self.slot(), Slot::Broken) {
            return Ok(());
        }
        let (io, instance) =
            connect(&self.address, self.token.as_ref(), self.timeout, self.kind).await?;
        if instance != self.instance {
            return Err(NetError::Restarted {
                address: self.address.clone(),
            });
        }
        let mut slot = self.slot();
        if matches!(*slot, Slot::Broken) {
            *slot = Slot::Free(io);
        }
        Ok(())
    }

    /// Whether the lane is open (free, or carrying a call), rather than broken.
    pub fn is_open(&self) -> bool {
        !matches!(*self.slot(), Slot::Broken)
    }

    fn slot(&self) -> std::sync::MutexGuard<'_, Slot> {
        self.io.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The lane for one call, unless another thread is using it or it broke.
    pub fn begin(&self) -> Option<LaneCall<'_>> {
        let mut slot = self.slot();
        match std::mem::replace(&mut *slot, Slot::Busy) {
            Slot::Free(io) => Some(LaneCall {
                lane: self,
                io: Some(io),
            }),
            other => {
                *slot = other;
                None
            }
        }
    }

    /// The daemon instance that answered the handshake.
    pub fn instance(&self) -> u64 {
        self.instance
    }
}

/// One call on a lane, holding it (other threads meanwhile use gRPC). Any failure closes the lane (its state
/// is unknown): later calls use gRPC.
pub struct LaneCall<'a> {
    lane: &'a Lane,
    io: Option<LaneIo>,
}

impl Drop for LaneCall<'_> {
    fn drop(&mut self) {
        let mut slot = self.lane.slot();
        *slot = match self.io.take() {
            Some(io) => Slot::Free(io),
            None => Slot::Broken,
        };
    }
}

impl LaneCall<'_> {
    fn fail(&mut self, e: LaneError, deadline: Option<(Instant, Duration)>) -> NetError {
        self.io = None;
        let address = self.lane.address.clone();
        match e {
            LaneError::Io(e) if waiting(&e) => NetError::DeadlineExceeded {
                address,
                after: deadline.map(|(_, t)| t).unwrap_or_default(),
            },
            LaneError::Io(e) if e.kind() == io::ErrorKind::Interrupted => {
                NetError::Interrupted { address }
            }
            LaneError::Io(e) if e.kind() == io::ErrorKind::ConnectionAborted => {
                NetError::Unavailable {
                    address,
                    reason: e.to_string(),
                }
            }
            LaneError::Io(_) | LaneError::Closed => NetError::Unavailable {
                address,
                reason: format!("the connection broke (direct lane): {e}"),
            },
            invalid => NetError::InvalidReply {
                address,
                reason: invalid.to_string(),
            },
        }
    }

    /// Send `request` to the worker.
    pub fn send(
        &mut self,
        mut request: CallRequest,
        deadline: Option<(Instant, Duration)>,
        on_wait: OnWait<'_>,
    ) -> Result<(), NetError> {
        request.instance = self.lane.instance;
        let value = request.value.take().unwrap_or_default();
        request.value = message_value(&value);
        let frame = LaneFrame {
            request: Some(request),
            ..Default::default()
        };
        let Some(io) = self.io.as_mut() else {
            return Err(self.fail(LaneError::Closed, deadline));
        };
        write_frame(
            &mut io.stream,
            frame,
            &value.pickle,
            &value.buffers,
            on_wait,
        )
        .map_err(|e| self.fail(e, deadline))
    }

    /// Wait for the reply to the request sent.
    pub fn receive(
        &mut self,
        deadline: Option<(Instant, Duration)>,
        on_wait: OnWait<'_>,
    ) -> Result<CallReply, NetError> {
        let limits = self.lane.limits;
        let Some(io) = self.io.as_mut() else {
            return Err(self.fail(LaneError::Closed, deadline));
        };
        io.reader.spin_for(&io.stream, self.lane.spin);
        let result = (|| {
            let frame = io.reader.read_message(&mut io.stream, &mut *on_wait)?;
            if frame.refusal() != Refusal::None {
                return Ok(Err(frame));
            }
            let value = io
                .reader
                .read_parts(&io.stream, &frame.lengths, limits, &mut *on_wait)?;
            Ok(Ok((frame, value)))
        })();
        match result {
            Err(e) => Err(self.fail(e, deadline)),
            Ok(Err(refused)) => Err(NetError::refused(
                self.lane.address.clone(),
                refused.refusal(),
                refused.refused_message,
            )),
            Ok(Ok((frame, parts))) => {
                let mut reply = frame.reply.unwrap_or_default();
                reply.value = Some(joined_value(reply.value.take(), parts));
                Ok(reply)
            }
        }
    }
}

/// The master's `on_wait` for a call with an optional deadline: give up once it passes (as a timeout), otherwise
/// run `check` (Ctrl-C), whose error ends the wait.
pub fn deadline_wait(
    deadline: Option<(Instant, Duration)>,
    mut check: impl FnMut() -> io::Result<()>,
) -> impl FnMut() -> io::Result<()> {
    move || {
        if deadline.is_some_and(|(at, _)| Instant::now() >= at) {
            return Err(io::ErrorKind::TimedOut.into());
        }
        check()
    }
}
