"""Training history, shaped like Keras' ``History``: per-epoch metrics plus per-round, per-worker statistics."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


@dataclass
class RoundStats:
    """What one worker did in one round (sync) or one chunk (async).

    A round, for one worker, is ``send_seconds`` (weights out), then the training call: ``compute_seconds`` on
    the worker (of which ``data_wait_seconds`` waiting for batches) and ``comm_seconds`` moving the request and
    the reply, then ``wait_seconds`` idle until the slowest worker of the round is done (sync; async: the master's
    own bookkeeping). ``bytes_sent``/``bytes_received`` are the master's view."""

    epoch: int
    round: int
    worker: int
    samples: int
    compute_seconds: float
    wait_seconds: float
    data_wait_seconds: float
    bytes_sent: int
    bytes_received: int
    staleness: int = 0
    dropped: bool = False
    lost: bool = False  # the worker was lost during this round; nothing of it was merged
    start: float = 0.0  # when the round began for this worker, in seconds since training started (master clock)
    send_seconds: float = 0.0  # the master sending this worker the weights (sync: the round's broadcast)
    comm_seconds: float = 0.0  # request and reply on the wire (call seconds less the worker's compute)
    optimizer_state_bytes: int = 0  # gradient averaging: the optimizer state the worker holds (its shard, sharded)
    resident_bytes: int = 0  # gradient averaging: the worker process's resident memory at the round's end


_SUMS = (
    "samples",
    "compute_seconds",
    "data_wait_seconds",
    "send_seconds",
    "comm_seconds",
    "wait_seconds",
    "bytes_sent",
    "bytes_received",
    "staleness",
)


def worker_totals(stats: Iterable[RoundStats]) -> dict[int, dict[str, float]]:
    """Per worker, sums over ``stats``: rounds, samples, seconds per phase, bytes, staleness (``staleness`` is
    the sum over the rounds that were not lost; ``max_staleness`` the largest), deltas dropped, rounds lost."""
    out: dict[int, dict[str, float]] = {}
    for s in stats:
        w = out.setdefault(
            s.worker, {"rounds": 0, **dict.fromkeys(_SUMS, 0), "max_staleness": 0, "dropped": 0, "lost": 0}
        )
        w["rounds"] += 1
        for key in _SUMS:
            w[key] += getattr(s, key)
        w["max_staleness"] = max(w["max_staleness"], s.staleness)
        w["dropped"] += int(s.dropped)
        w["lost"] += int(s.lost)
    return out


@dataclass
class History:
    """``history[metric]`` is a list with one value per epoch (``loss``, ``accuracy``, ``val_loss``, ...);
    ``stats`` lists every round's :class:`RoundStats`; ``epoch_seconds`` the wall time of each epoch."""

    history: dict[str, list[float]] = field(default_factory=dict)
    stats: list[RoundStats] = field(default_factory=list)
    epoch_seconds: list[float] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    """Faults and membership changes during training (worker lost, rejoined, restarted, added, removed; resumed
    from a checkpoint), each with its time, epoch and round."""

    recorded_epochs: list[int] = field(default_factory=list)
    """The index of each epoch recorded (a run from ``initial_epoch`` starts there)."""

    @property
    def epoch(self) -> list[int]:
        """Epoch indices recorded, as Keras' ``History.epoch``."""
        if len(self.recorded_epochs) == len(self.epoch_seconds):
            return list(self.recorded_epochs)
        return list(range(len(self.epoch_seconds)))  # a History from before epochs were recorded

    def record_epoch(self, logs: dict[str, float], seconds: float, epoch: int | None = None) -> None:
        """Record epoch ``epoch`` (default: the next index) with its ``logs`` and wall time."""
        for k, v in logs.items():
            self.history.setdefault(k, []).append(float(v))
        self.epoch_seconds.append(seconds)
        self.recorded_epochs.append(len(self.epoch_seconds) - 1 if epoch is None else int(epoch))

    def record_added(self, logs: dict[str, Any], recorded: Iterable[str]) -> None:
        """Add the numeric logs a callback put into an epoch's ``logs`` after :meth:`record_epoch` took the keys
        ``recorded`` (Keras' ``LearningRateScheduler`` and ``ReduceLROnPlateau`` add ``learning_rate``, which
        ``fit``'s History, the last callback, records)."""
        done = set(recorded)
        for k, v in logs.items():
            if k not in done and isinstance(v, (int, float, np.number)) and not isinstance(v, bool):
                self.history.setdefault(k, []).append(float(v))

    def summary(self) -> dict[str, Any]:
        """Totals over the run: per worker (:func:`worker_totals`) and the seconds of each epoch."""
        return {"workers": worker_totals(self.stats), "epoch_seconds": self.epoch_seconds}

    def to_json(self) -> str:
        """Everything recorded, as JSON."""
        return json.dumps(
            {
                "history": self.history,
                "epoch_seconds": self.epoch_seconds,
                "params": self.params,
                "stats": [asdict(s) for s in self.stats],
                "events": self.events,
                "summary": self.summary(),
            },
            indent=1,
        )
