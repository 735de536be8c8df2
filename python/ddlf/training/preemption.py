"""Preemption and time limits: a signal ends the run at a round boundary with a checkpoint, and requeues the job.

A batch scheduler warns before it takes the nodes away: Slurm sends the signal named by
``#SBATCH --signal=B:USR1@120`` before the time limit, and SIGTERM when it preempts, requeues (``scontrol
requeue``) or cancels a job (``deploy/slurm/ddlf.sbatch`` passes both to the master). While ``train()`` runs with a
``checkpoint_dir``, :class:`Preemption` catches them (``RunConfig.preemption_signals``) instead of letting the
process die:

* the loop finishes the round in flight (SIGUSR1: the workers are still there) or abandons it (SIGTERM: Slurm
  signalled the workers too, and the round fails), then writes the checkpoint of the last merged round: weights,
  History and the position in the epoch's permutation, so the resumed run starts at the next round. Work lost:
  at most the round in flight. On the ring the last round's weights (and each worker's optimizer state) are on
  the workers: a worker signalled with SIGTERM abandons its round but answers the master until the run is torn
  down (:mod:`ddlf.worker.drain`), so the master reads them from there.
* on SIGUSR1 inside a Slurm job the master requeues it (``scontrol requeue``); on SIGTERM it does not (Slurm
  requeues a preempted job itself, and a cancelled one must stay cancelled);
* ``train()`` raises :class:`~ddlf.errors.Preempted`. The requeued job runs the same script, whose
  ``resume=True`` picks the checkpoint up, on whatever nodes and worker count it gets.

A warning that arrives outside ``train()`` (while the script loads its data, or between two ``train()`` calls)
would end the process with the signal's default action. Inside an allocation :meth:`ddlf.Cluster.from_slurm` calls
:func:`ddlf.process.hold_signals`: from then on such a warning is kept, and the next ``train()`` with a
``checkpoint_dir`` takes it at its start, before any round: it writes its checkpoint (the state it started from),
requeues the job and raises :class:`~ddlf.errors.Preempted`. One that comes after the last ``train()`` is only
logged: the script ends by itself or at the time limit.

Signals after the first are ignored, during the checkpoint and after ``train()`` returns (the script may write
what it wants before it exits; the scheduler's SIGKILL ends a process that lingers). Ctrl-C (SIGINT) keeps its
meaning (stop now).

A scheduler signals every process of the job at once, the workers too, in no set order: a worker may be gone
before the master's own signal arrives. So when a worker is lost while signals are caught, the master first waits
up to :data:`GRACE_SECONDS` for a signal of its own (:meth:`Preemption.settle`) before it calls the loss a failure:
a preempted job ends as preempted, with its checkpoint, instead of failing on its lost workers (and then dying of
the signal that arrives once ``train()`` has given its handlers back).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from types import FrameType
from typing import Any

from ..errors import ConfigError
from ..process import held, take_held

log = logging.getLogger("ddlf.preemption")

#: The signals caught by default while a run with a checkpoint directory trains.
DEFAULT_SIGNALS = ("SIGUSR1", "SIGTERM")
#: The signals after which the master requeues its Slurm job itself (the scheduler's advance warning).
REQUEUE_ON = ("SIGUSR1",)
#: How long a master that lost a worker waits for a preemption signal of its own before failing (a scheduler signals
#: the nodes of a job one by one: seconds apart on a loaded machine; Slurm's KillWait leaves 30 s by default).
GRACE_SECONDS = 5.0


def signal_number(name: str | int) -> int:
    """``"SIGUSR1"``, ``"USR1"`` or ``10`` -> 10; ValueError for anything else."""
    if isinstance(name, int) and not isinstance(name, bool):
        return int(signal.Signals(name))
    text = str(name).upper()
    try:
        return int(signal.Signals[text if text.startswith("SIG") else "SIG" + text])
    except KeyError:
        raise ConfigError(f"{name!r} is not a signal name (e.g. 'SIGUSR1', 'SIGTERM')") from None


class Preemption:
    """Catches ``signals`` for the duration of a ``with`` block (in the main thread only: elsewhere Python cannot
    install handlers, and nothing is caught). :attr:`requested` names the first signal caught."""

    def __init__(self, signals: tuple[str | int, ...]) -> None:
        self.signals = [signal_number(s) for s in signals]
        self.requested: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._caught)
            taken = take_held(self.signals)  # after the handlers: one that comes meanwhile is caught, not lost
            if taken is not None and self.requested is None:
                self.requested = taken
                log.warning("%s arrived before train(): checkpointing at its start, then stopping", taken)
            elif held() is not None:
                log.warning(
                    "%s arrived outside train() and is kept: this train() catches no preemption signal (no "
                    "checkpoint_dir, preemption_signals=(), or not on the main thread)",
                    held(),
                )
        elif self.signals:
            log.info("train() runs outside the main thread: preemption signals are not caught")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.requested is None:
            for s, previous in self._previous.items():
                signal.signal(s, previous)
        # Preempted: the handlers stay, ignoring the signals that follow (Slurm's SIGTERM after the master's own
        # requeue, the batch shell's forwarded copy), so the script can finish writing what it wants before it
        # exits; the scheduler's SIGKILL after KillWait still ends a process that lingers.
        self._previous.clear()

    def _caught(self, signum: int, frame: FrameType | None) -> None:
        if self.requested is None:
            self.requested = signal.Signals(signum).name
            log.warning("%s: checkpointing at the end of this round, then stopping", self.requested)

    def settle(self, seconds: float = GRACE_SECONDS) -> bool:
        """Whether a signal was caught, waiting up to ``seconds`` for one (at once when none is being caught). The
        master asks when it lost a worker: the scheduler may be stopping the whole job."""
        if self.requested is not None or not self._previous:
            return self.requested is not None
        deadline = time.monotonic() + seconds
        while self.requested is None and time.monotonic() < deadline:
            time.sleep(0.02)  # the handler runs on this (the main) thread, between these sleeps
        return self.requested is not None

    def requeue(self) -> bool:
        """Requeue this Slurm job if the signal was the scheduler's advance warning; whether it was requeued."""
        job = os.environ.get("SLURM_JOB_ID")
        if self.requested not in REQUEUE_ON or not job:
            return False
        scontrol = shutil.which("scontrol")
        if scontrol is None:
            log.warning("SLURM_JOB_ID is set but scontrol is not on PATH: job %s not requeued", job)
            return False
        done = subprocess.run([scontrol, "requeue", job], capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            log.warning("scontrol requeue %s failed: %s", job, done.stderr.strip())
            return False
        return True
