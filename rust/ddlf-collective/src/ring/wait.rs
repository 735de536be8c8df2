//! Waiting for the links: `poll(2)` on the left link (readable) and the right one (writable), a stall clock that
//! fails a pass whose neighbour made no progress for too long, and liveness probes that tell a neighbour still
//! computing from one whose process is stopped or whose host is gone ([`Watch`]). The one `unsafe` of the ring is
//! the `poll` call here.

use std::io;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use super::{Links, RingError, Side};

/// How long one `poll` waits before the stall clock is checked again.
const POLL_SLICE: Duration = Duration::from_millis(200);

/// Asks whether the neighbour on one side is still alive (its daemon answers), and says why not.
pub type Probe<'a> = &'a (dyn Fn(Side) -> Result<(), String> + Sync);

/// How long a pass waits for its neighbours, and how it tells a slow neighbour from a dead one.
///
/// A neighbour may legitimately go quiet for a long time (still computing before it joins the reduction), so
/// silence alone fails a pass only after `stall`. A neighbour whose process is stopped (`SIGSTOP`, swapped out,
/// a debugger) or whose host froze keeps its TCP connections open, and its kernel even answers keepalives: only
/// asking its process tells it apart. After `probe_every` without progress, and again every `probe_every`, the
/// pass calls `probe` for the neighbour it waits on; a probe that fails ends the pass at once.
#[derive(Clone, Copy)]
pub struct Watch<'a> {
    /// How long a pass may make no progress.
    pub stall: Duration,
    /// How long without progress before the first probe, and between probes.
    pub probe_every: Duration,
    /// Asks a neighbour's daemon whether its process still answers; `None`: never probe.
    pub probe: Option<Probe<'a>>,
    /// The call's [`crate::activity`] id (0: none), so that its waits show in `ddlf stacks`...
    pub activity: u64,
    /// ...with its neighbours named (left, right).
    pub names: Option<&'a [String; 2]>,
}

impl Watch<'static> {
    /// Fail after `stall` without progress; never probe.
    pub fn stall(stall: Duration) -> Self {
        Watch {
            stall,
            probe_every: stall,
            probe: None,
            activity: 0,
            names: None,
        }
    }
}

/// The progress clock of one pass: when something last moved, and when the neighbours last proved alive.
pub(super) struct Clock {
    last: Instant,
    alive: Instant,
}

impl Clock {
    pub(super) fn new() -> Self {
        let now = Instant::now();
        Clock {
            last: now,
            alive: now,
        }
    }

    pub(super) fn progressed(&mut self) {
        self.last = Instant::now();
    }
}

pub(super) fn retry(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
    )
}

pub(super) fn io_error(side: Side, source: io::Error) -> RingError {
    match source.kind() {
        io::ErrorKind::ConnectionReset
        | io::ErrorKind::BrokenPipe
        | io::ErrorKind::ConnectionAborted
        | io::ErrorKind::UnexpectedEof => RingError::Closed { side },
        _ => RingError::Io { side, source },
    }
}

/// Wait until the left link is readable (`want_in`) or the right writable (`want_out`), failing once nothing has
/// moved for `watch.stall`, or once the neighbour waited on fails a liveness probe (see [`Watch`]).
pub(super) fn wait(
    links: &Links,
    want_in: bool,
    want_out: bool,
    clock: &mut Clock,
    watch: Watch<'_>,
) -> Result<(), RingError> {
    let waited = clock.last.elapsed();
    let stall = watch.stall;
    crate::activity::waiting(
        watch.activity,
        || {
            let (i, what) = if want_in {
                (0, "receiving from")
            } else {
                (1, "sending to")
            };
            let name = watch.names.map_or("", |n| n[i].as_str());
            format!("{what} the {} neighbour {name}", ["left", "right"][i])
        },
        clock.last,
    );
    if waited >= stall {
        // Blame the side we were waiting for; waiting to send means the right neighbour stopped reading.
        let side = if want_in { Side::Left } else { Side::Right };
        return Err(RingError::Stalled { side, after: stall });
    }
    if let Some(probe) = watch.probe {
        if clock.last.max(clock.alive).elapsed() >= watch.probe_every {
            let sides = [(want_in, Side::Left), (want_out, Side::Right)];
            for (_, side) in sides.into_iter().filter(|(wanted, _)| *wanted) {
                if let Err(reason) = probe(side) {
                    return Err(RingError::Unresponsive {
                        side,
                        after: clock.last.elapsed(),
                        reason,
                    });
                }
            }
            clock.alive = Instant::now();
        }
    }
    let mut fds = [
        libc::pollfd {
            fd: links.left.as_raw_fd(),
            events: if want_in { libc::POLLIN } else { 0 },
            revents: 0,
        },
        libc::pollfd {
            fd: links.right.as_raw_fd(),
            events: if want_out { libc::POLLOUT } else { 0 },
            revents: 0,
        },
    ];
    let ms = (stall - waited).min(POLL_SLICE).as_millis().max(1) as libc::c_int;
    // SAFETY: `fds` is a valid array of two initialised `pollfd`s that outlives the call, and its length is
    // passed exactly; both descriptors belong to sockets `links` keeps open for the whole call.
    let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(RingError::Io {
                side: Side::Left,
                source: e,
            });
        }
    }
    Ok(())
}
