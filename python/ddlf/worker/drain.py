"""A worker told to stop while it serves a training run: it hands its state over before it exits.

A scheduler stops a job by signalling every process of it at once, the workers with the master: Slurm sends SIGTERM
when it preempts or requeues a job (``scontrol requeue``) and SIGKILL ``KillWait`` seconds later (30 by default);
Kubernetes sends SIGTERM and SIGKILL after the pod's grace period (30 s by default). A worker that exited at the
SIGTERM took with it what only it held: on the ring (:class:`ddlf.Ring`, gradient averaging, the default) the
weights of the last round live on the workers, and the master holds them only at epoch ends, so a preempted run
lost everything it had trained since the last epoch.

So on SIGTERM a worker that serves a training run *drains* (:class:`Drain`):

* the call in flight (a round) is interrupted at once with :class:`Draining`, answered to the master as
  ``WorkerStopping``; new rounds and new runs are refused the same way (:func:`refuse_new_work`);
* its daemon answers ring links and liveness probes with "stopping" (``ddlf._ddlf.leave_rings``): a worker of
  the ring still waiting on it (one whose step runs inside a compiled graph, which no signal interrupts) fails at
  its next probe, within a quarter of the ring's liveness bound;
* the worker keeps answering everything else: the master reads the last merged round's weights and each worker's
  optimizer state for its preemption checkpoint (:mod:`ddlf.training.preemption`);
* it exits once the masters have torn their runs down (the checkpoint is written), or after ``--drain-seconds``
  (:data:`DEFAULT_SECONDS`), or at a second SIGTERM (one within :data:`REPEAT_SECONDS` of the first is the same
  stop delivered twice), whichever comes first.

A round whose result is recorded (:func:`call_settled`) is not interrupted: its reply goes out, so that the master
and the workers agree on the last round that ended.

A worker that serves no run, or one started with ``--drain-seconds 0``, exits at the SIGTERM as before. SIGINT
(Ctrl-C) always stops at once.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType

from .. import _ddlf

log = logging.getLogger("ddlf.worker")

#: Seconds a draining worker waits for its masters to tear their runs down (within Slurm's KillWait and
#: Kubernetes' grace period, both 30 s by default).
DEFAULT_SECONDS = 20.0
#: A second SIGTERM this soon after the first is the same stop delivered twice (srun passes on the SIGTERM that
#: slurmstepd also sends its tasks) and is ignored; a later one ends the drain at once.
REPEAT_SECONDS = 2.0
#: How often the drain looks whether the runs are gone.
POLL_SECONDS = 0.05


class Draining(BaseException):
    """Raised in the call a stop interrupted, and by calls that would start work while the worker drains. A
    ``BaseException``, as ``SystemExit`` is, so that user code's ``except Exception`` does not swallow it; the
    executor answers it as ``WorkerStopping`` and the worker keeps serving."""


_since: float | None = None
"""When this process started draining (``time.monotonic()``); None: it is not."""
_call: str | None = None
"""The call on the interpreter thread: None (none), ``"running"`` (a stop interrupts it) or ``"settled"`` (its
result is recorded: it finishes, so that the master hears of a round that really ended)."""


def draining() -> bool:
    """Whether this worker is draining."""
    return _since is not None


def refuse_new_work(what: str) -> None:
    """Raise :class:`Draining` if this worker is draining: it takes no new round or run (``what``)."""
    if _since is not None:
        raise Draining(f"the worker is stopping (SIGTERM {time.monotonic() - _since:.1f} s ago): no new {what}")


def round_started(what: str = "round") -> None:
    """A training round starts on the interpreter thread: refused (:class:`Draining`) if this worker is draining,
    else a stop from now on interrupts it (other calls, such as the master's reads for its checkpoint, are never
    interrupted)."""
    global _call
    refuse_new_work(what)
    _call = "running"


def call_settled() -> None:
    """The call in flight has recorded its result (a round's reduced weights): a stop no longer interrupts it."""
    global _call
    if _call is not None:
        _call = "settled"


def call_ended() -> None:
    """The executor's call returned (or raised): the next call is not interruptible unless it is a round."""
    global _call
    _call = None


def interruptible() -> bool:
    """Whether a stop now interrupts the call in flight."""
    return _call == "running"


class Drain:
    """The SIGTERM handler of a worker daemon (installed by :mod:`.main` on its interpreter thread).

    ``seconds``: the longest drain (0: exit at once). ``serving()``: whether any training run is set up here (the
    drain ends when none is). ``leave()``: take this worker out of every ring (the daemon's answer to probes and
    links).
    """

    def __init__(
        self, seconds: float, serving: Callable[[], bool], leave: Callable[[], None] = _ddlf.leave_rings
    ) -> None:
        self.seconds = seconds
        self.serving = serving
        self.leave = leave
        self.done = False
        """Set by the drain's end, just before it signals this process to exit."""

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        global _since
        if _since is not None:
            if self.done or time.monotonic() - _since >= REPEAT_SECONDS:
                raise SystemExit(0)
            return  # the same stop, delivered twice
        if self.seconds <= 0 or not self.serving():
            raise SystemExit(0)
        _since = time.monotonic()
        self.leave()
        log.warning(
            "%s: stopping; the call in flight is interrupted and the master may read this worker's state for up "
            "to %.0f s",
            signal.Signals(signum).name,
            self.seconds,
        )
        threading.Thread(target=self._end, args=(_since + self.seconds,), name="ddlf-drain", daemon=True).start()
        if interruptible():
            raise Draining(f"{signal.Signals(signum).name} received")

    def _end(self, deadline: float) -> None:
        """Signal this process again (the handler then exits) once no run is left here, or at ``deadline``."""
        while time.monotonic() < deadline and self.serving():
            time.sleep(POLL_SECONDS)
        log.info("drained (%s): exiting", "no run left" if not self.serving() else "time is up")
        self.done = True
        os.kill(os.getpid(), signal.SIGTERM)
