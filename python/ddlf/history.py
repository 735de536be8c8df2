"""Training history, shaped like Keras' ``History``: per-epoch metrics plus per-round, per-worker statistics."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RoundStats:
    """What one worker did in one round (sync) or one chunk (async)."""

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


RoundStats.__doc__ = """What one worker did in one round (sync) or one chunk (async).

A round, for one worker, is ``send_seconds`` (weights out), then the training call: ``compute_seconds`` on the
worker (of which ``data_wait_seconds`` waiting for batches) and ``comm_seconds`` moving the request and the reply,
then ``wait_seconds`` idle until the slowest worker of the round is done (sync; async: the master's own
bookkeeping). ``bytes_sent``/``bytes_received`` are the master's view."""


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

    @property
    def epoch(self) -> list[int]:
        """Epoch indices recorded (Keras compatibility)."""
        return list(range(len(self.epoch_seconds)))

    def record_epoch(self, logs: dict[str, float], seconds: float) -> None:
        for k, v in logs.items():
            self.history.setdefault(k, []).append(float(v))
        self.epoch_seconds.append(seconds)

    def summary(self) -> dict[str, Any]:
        """Totals over the run: bytes on the wire, compute and wait time per worker, staleness."""
        per_worker: dict[int, dict[str, float]] = {}
        for s in self.stats:
            w = per_worker.setdefault(
                s.worker,
                {
                    "rounds": 0,
                    "samples": 0,
                    "compute_seconds": 0.0,
                    "wait_seconds": 0.0,
                    "data_wait_seconds": 0.0,
                    "bytes_sent": 0,
                    "bytes_received": 0,
                    "max_staleness": 0,
                    "dropped": 0,
                    "lost": 0,
                },
            )
            w["rounds"] += 1
            w["samples"] += s.samples
            w["compute_seconds"] += s.compute_seconds
            w["wait_seconds"] += s.wait_seconds
            w["data_wait_seconds"] += s.data_wait_seconds
            w["bytes_sent"] += s.bytes_sent
            w["bytes_received"] += s.bytes_received
            w["max_staleness"] = max(w["max_staleness"], s.staleness)
            w["dropped"] += int(s.dropped)
            w["lost"] += int(s.lost)
        return {"workers": per_worker, "epoch_seconds": self.epoch_seconds}

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
