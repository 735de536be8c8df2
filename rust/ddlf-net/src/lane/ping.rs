//! Ping lanes, the master's end: a lane opened with `LaneKind::Ping`, whose pings the daemon answers on a thread
//! that serves only that lane (`ddlf_worker::pings`). A ping then costs one plain round trip: no HTTP/2 framing,
//! no hand-over between the client runtime's threads (over gRPC the master's side of a ping cost more CPU than
//! its wall time), and like the gRPC ping it is answered while the worker's interpreter runs a job.

use std::io;
use std::time::{Duration, Instant};

use ddlf_core::auth::Token;
use ddlf_core::frame::FrameLimits;
use ddlf_proto::{LaneFrame, LaneKind, PingReply, PingRequest, Refusal};

use super::{write_frame, Lane, LaneCall, LaneError, OnWait};
use crate::error::NetError;

/// The master's end of a ping lane to one worker. One ping at a time: a thread that finds it busy uses gRPC.
#[derive(Debug)]
pub struct PingLane(Lane);

impl PingLane {
    /// Open a ping lane to `address` and pass its handshake within `timeout`; a reply is spun for up to `spin`
    /// before the thread blocks (as a call lane's).
    pub async fn open(
        address: &str,
        token: Option<&Token>,
        timeout: Duration,
        spin: Duration,
    ) -> Result<PingLane, NetError> {
        let limits = FrameLimits::default();
        Lane::open_kind(address, token, timeout, limits, spin, LaneKind::Ping)
            .await
            .map(PingLane)
    }

    /// Open a broken ping lane again (to the same daemon instance); see [`Lane::reopen`].
    pub async fn reopen(&self) -> Result<(), NetError> {
        self.0.reopen().await
    }

    /// Whether the lane is open (free, or carrying a ping), rather than broken.
    pub fn is_open(&self) -> bool {
        self.0.is_open()
    }

    /// The daemon instance that answered the handshake.
    pub fn instance(&self) -> u64 {
        self.0.instance()
    }

    /// The lane for one ping, unless another thread is using it or it broke.
    pub fn begin(&self) -> Option<PingCall<'_>> {
        self.0.begin().map(PingCall)
    }
}

/// One ping on a ping lane, holding it. Any failure closes the lane (its state is unknown): later pings use gRPC
/// until it is opened again.
pub struct PingCall<'a>(LaneCall<'a>);

impl PingCall<'_> {
    /// Send a ping carrying `nonce`.
    pub fn send(
        &mut self,
        nonce: u64,
        deadline: Option<(Instant, Duration)>,
        on_wait: OnWait<'_>,
    ) -> Result<(), NetError> {
        let call = &mut self.0;
        let frame = LaneFrame {
            ping: Some(PingRequest { nonce }),
            ..Default::default()
        };
        let Some(io) = call.io.as_mut() else {
            return Err(call.fail(LaneError::Closed, deadline));
        };
        write_frame(&mut io.stream, frame, &[], &[], on_wait).map_err(|e| call.fail(e, deadline))
    }

    /// The lane's socket, to wait for its answer with others' (`poll(2)`); None once it failed.
    pub fn fd(&self) -> Option<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        self.0.io.as_ref().map(|io| io.stream.as_raw_fd())
    }

    /// Whether bytes of the answer (or the end of the connection) are here, without blocking.
    pub fn ready(&mut self) -> bool {
        match self.0.io.as_mut() {
            Some(io) => io.reader.has_buffered() || io.reader.try_fill(&io.stream),
            None => true, // failed: `receive` reports it at once
        }
    }

    /// Give up on the answer (a deadline passed, the caller was interrupted): the lane closes, since its answer
    /// may still come, and `why` is the error ([`io::ErrorKind::TimedOut`] reads as the deadline).
    pub fn abandon(&mut self, why: io::Error, deadline: Option<(Instant, Duration)>) -> NetError {
        self.0.fail(LaneError::Io(why), deadline)
    }

    /// Wait for the answer to the ping sent with `nonce`.
    pub fn receive(
        &mut self,
        nonce: u64,
        deadline: Option<(Instant, Duration)>,
        on_wait: OnWait<'_>,
    ) -> Result<PingReply, NetError> {
        let call = &mut self.0;
        let spin = call.lane.spin;
        let Some(io) = call.io.as_mut() else {
            return Err(call.fail(LaneError::Closed, deadline));
        };
        io.reader.spin_for(&io.stream, spin);
        let frame = match io.reader.read_message(&mut io.stream, on_wait) {
            Ok(frame) => frame,
            Err(e) => return Err(call.fail(e, deadline)),
        };
        if frame.refusal() != Refusal::None {
            let refused = NetError::refused(
                call.lane.address.clone(),
                frame.refusal(),
                frame.refused_message,
            );
            // Nothing else follows a refusal on a ping lane: the daemon closes it.
            call.io = None;
            return Err(refused);
        }
        match frame.pong {
            Some(pong) if pong.nonce == nonce && frame.lengths.iter().all(|&l| l == 0) => Ok(pong),
            Some(_) => Err(call.fail(LaneError::Unexpected("a pong to another ping"), deadline)),
            None => Err(call.fail(LaneError::Unexpected("a frame without a pong"), deadline)),
        }
    }
}
