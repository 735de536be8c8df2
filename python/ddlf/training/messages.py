"""The contract between the master's loops and the workers' replicas: names, round arguments, results, checks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np


def finite(a: np.ndarray) -> bool:
    """Whether every element of float array ``a`` is finite (other dtypes always are): one pass summing in
    float64, where a finite float32 tensor cannot overflow; the exact check only when the sum is not finite."""
    if a.dtype.kind != "f" or a.size == 0:
        return True
    if a.dtype.itemsize <= 4 and math.isfinite(float(np.add.reduce(a, axis=None, dtype=np.float64))):
        return True
    return bool(np.isfinite(a).all())


@dataclass
class WorkerResult:
    """What one worker's training chunk returned (``training.worker.train_chunk``)."""

    worker: int
    samples: int
    weights: list[Any]
    """Its weights, or its delta (compressed: half precision, or top-k ``(indices, values)`` pairs); empty when
    the workers averaged among themselves (the ring exchange (:class:`~ddlf.Ring`))."""
    compute_seconds: float
    data_wait_seconds: float
    logs: dict[str, float] = field(default_factory=dict)
    optimizer_state: list[np.ndarray] | None = None
    payload: list[np.ndarray] = field(default_factory=list)
    """``weights`` decoded (float32, shaped like the model's), set by :func:`~.replies.check_reply` once the
    reply passed its checks (empty for an all-reduce round: the workers averaged among themselves)."""

    @classmethod
    def from_reply(cls, worker: int, reply: dict[str, Any]) -> WorkerResult:
        return cls(
            worker=worker,
            samples=int(reply["samples"]),
            weights=list(reply.get("weights", [])),
            compute_seconds=float(reply["compute_seconds"]),
            data_wait_seconds=float(reply["data_wait_seconds"]),
            logs=dict(reply.get("logs", {})),
            optimizer_state=reply.get("optimizer_state"),
        )


def weights_var(run_id: str) -> str:
    """The worker variable a synchronous run broadcasts its weights in (one per run)."""
    return f"__ddlf_weights/{run_id}"


Seeded = tuple[int, int, list[float], int, int, int]
"""``shuffle="seeded"``: ``(seed, epoch, shares, worker, start, stop)`` of a slice of a regenerated permutation."""
