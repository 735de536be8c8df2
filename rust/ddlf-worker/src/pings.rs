//! The daemon's end of ping lanes (`LaneKind` in `proto/ddlf.proto`; the master's end is `ddlf_net::lane::PingLane`).
//!
//! Each ping lane is answered by a thread of its own (`ddlf-ping`), blocked on its socket between pings: a ping
//! never waits for the interpreter thread (a job may run for hours) nor for the network runtime, and costs the
//! daemon one read and one write. A lane ends when its master closes it, sends something that is not a ping
//! (counted as rejected and logged), or the daemon stops.

use std::io;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use ddlf_net::guard::Slot;
use ddlf_net::lane::{configure, write_frame, FrameReader, LaneError};
use ddlf_proto::{LaneFrame, PingReply};
use tokio::sync::watch;

use crate::state::WorkerState;

/// How often a ping lane's thread, blocked on its socket, checks whether the daemon is stopping.
const POLL: Duration = Duration::from_millis(250);

/// Serve the ping lane `stream` (its handshake passed) on a thread of its own until it ends.
pub(crate) fn serve(
    stream: TcpStream,
    peer: SocketAddr,
    slot: Slot,
    state: Arc<WorkerState>,
    stopped: watch::Receiver<bool>,
) {
    let spawned = std::thread::Builder::new()
        .name("ddlf-ping".into())
        .spawn(move || {
            let _slot = slot;
            match answer(&stream, &state, &stopped) {
                _ if *stopped.borrow() => {
                    tracing::debug!(%peer, "ping lane closed: the daemon stops")
                }
                Ok(()) | Err(LaneError::Closed) => tracing::debug!(%peer, "ping lane closed"),
                Err(LaneError::Io(e)) => tracing::debug!(%peer, error = %e, "ping lane broke"),
                Err(e) => {
                    state.rejected.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(%peer, reason = %e, "ping lane closed: not a ping");
                }
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(%peer, error = %e, "no thread for a ping lane: its master pings over gRPC");
    }
}

/// Answer pings on `stream` until it closes (`Err(Closed)`), breaks, carries something else, or the daemon stops
/// (`Ok`, or the wait's error): a ping that arrives once the daemon stops is not answered.
fn answer(
    stream: &TcpStream,
    state: &WorkerState,
    stopped: &watch::Receiver<bool>,
) -> Result<(), LaneError> {
    configure(stream, POLL)?;
    let mut reader = FrameReader::default();
    let mut wait = || match *stopped.borrow() {
        true => Err(io::ErrorKind::TimedOut.into()),
        false => Ok(()),
    };
    loop {
        let frame = reader.read_message(&mut &*stream, &mut wait)?;
        let ping = match frame {
            LaneFrame {
                ping: Some(ping),
                request: None,
                reply: None,
                ref lengths,
                ..
            } if lengths.iter().all(|&l| l == 0) => ping,
            _ => {
                return Err(LaneError::Unexpected(
                    "a frame without a ping on a ping lane",
                ))
            }
        };
        if *stopped.borrow() {
            return Ok(());
        }
        let pong = LaneFrame {
            pong: Some(PingReply {
                nonce: ping.nonce,
                uptime_ms: state.started.elapsed().as_millis() as u64,
                instance: state.instance,
            }),
            ..Default::default()
        };
        write_frame(&mut &*stream, pong, &[], &[], &mut wait)?;
        state.lane_pings.fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ddlf_proto::{CallRequest, PingRequest};
    use std::net::TcpListener;

    fn lane() -> (
        TcpStream,
        watch::Sender<bool>,
        std::thread::JoinHandle<Result<(), LaneError>>,
    ) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let master = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (daemon, _) = l.accept().unwrap();
        configure(&master, Duration::from_secs(5)).unwrap();
        let (stop, stopped) = watch::channel(false);
        let state = Arc::new(WorkerState::new("test".into()));
        let served = std::thread::spawn(move || answer(&daemon, &state, &stopped));
        (master, stop, served)
    }

    fn give_up() -> io::Result<()> {
        Err(io::ErrorKind::TimedOut.into())
    }

    fn ping(master: &mut TcpStream, reader: &mut FrameReader, nonce: u64) -> LaneFrame {
        let frame = LaneFrame {
            ping: Some(PingRequest { nonce }),
            ..Default::default()
        };
        write_frame(master, frame, &[], &[], &mut give_up).unwrap();
        reader.read_message(master, &mut give_up).unwrap()
    }

    #[test]
    fn pings_are_answered_in_order_until_the_master_closes() {
        let (mut master, _stop, served) = lane();
        let mut reader = FrameReader::default();
        for nonce in [7, 8, u64::MAX] {
            let pong = ping(&mut master, &mut reader, nonce).pong.unwrap();
            assert_eq!(pong.nonce, nonce);
            assert_ne!(pong.instance, 0);
        }
        drop(master);
        assert!(matches!(served.join().unwrap(), Err(LaneError::Closed)));
    }

    #[test]
    fn a_call_on_a_ping_lane_closes_it_unanswered() {
        let (mut master, _stop, served) = lane();
        let mut reader = FrameReader::default();
        assert_eq!(ping(&mut master, &mut reader, 1).pong.unwrap().nonce, 1);
        let call = LaneFrame {
            request: Some(CallRequest::default()),
            ..Default::default()
        };
        write_frame(&mut master, call, b"pickle", &[], &mut give_up).unwrap();
        assert!(matches!(
            served.join().unwrap(),
            Err(LaneError::Unexpected(_))
        ));
        assert!(matches!(
            reader.read_message(&mut master, &mut give_up),
            Err(LaneError::Closed)
        ));
    }

    #[test]
    fn a_stopping_daemon_ends_an_idle_ping_lane() {
        let (_master, stop, served) = lane();
        stop.send(true).unwrap();
        let ended = served.join().unwrap();
        assert!(matches!(ended, Err(LaneError::Io(e)) if e.kind() == io::ErrorKind::TimedOut));
    }

    #[test]
    fn a_ping_after_the_daemon_stops_is_not_answered() {
        let (mut master, stop, served) = lane();
        let mut reader = FrameReader::default();
        assert_eq!(ping(&mut master, &mut reader, 3).pong.unwrap().nonce, 3);
        stop.send(true).unwrap();
        let frame = LaneFrame {
            ping: Some(PingRequest { nonce: 4 }),
            ..Default::default()
        };
        // The daemon may already have closed its end (the write may then fail): either way, no pong comes.
        let _ = write_frame(&mut master, frame, &[], &[], &mut give_up);
        // It ended on reading the ping (`Ok`) or on noticing the stop while waiting for it.
        let ended = served.join().unwrap();
        assert!(matches!(ended, Ok(()) | Err(LaneError::Io(_))), "{ended:?}");
        assert!(reader.read_message(&mut master, &mut give_up).is_err());
    }
}
