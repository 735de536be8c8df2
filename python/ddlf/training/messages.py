r"""The contract between the master's loops and the workers' replicas: names, round arguments, results, checks.

The master sends each worker one typed round (:class:`MasterRound`, :class:`RingRound` or :class:`GradientRound`,
all :class:`RoundSpec`\ s naming their :class:`Rows`); the worker answers a dict that :class:`WorkerResult` reads
(after :mod:`.replies` checked it). Both sides import this module and nothing of each other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..ring_spec import RingSpec


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
"""``DataConfig(send="seed")``: ``(seed, epoch, shares, worker, start, stop)`` of a slice of a regenerated
permutation."""


@dataclass(frozen=True, eq=False)
class Rows:
    """Which rows a worker trains in a round: ``indices`` into its dataset, or the slice ``seeded`` names of a
    permutation it regenerates; ``shard``: with a sharded dataset, the shard they index (None: its own)."""

    indices: np.ndarray | None = None
    seeded: Seeded | None = None
    shard: int | None = None

    def count(self) -> int:
        """The most rows this can train: its indices, or its slice's bounds."""
        if self.indices is not None:
            return len(self.indices)
        if self.seeded is None:
            return 0
        _seed, _epoch, _shares, _w, start, stop = self.seeded
        return max(0, stop - start)


@dataclass(frozen=True, eq=False, kw_only=True)
class RoundSpec:
    """What every kind of round asks of a worker: the run, its rows, how to batch them."""

    run_id: str
    rows: Rows
    batch_size: int
    prefetch: int = 2
    compression: str | None = None
    """``"float16"``/``"bfloat16"``: what travels is half precision; ``"topk"``: the largest entries only."""
    slow_seconds_per_batch: float = 0.0
    """Sleep after each batch (``DDLF_SLOW_WORKER``: experiments with stragglers)."""
    learning_rate: float | None = None
    """The learning rate to train with from this round on: set when a callback changed the master's."""


@dataclass(frozen=True, eq=False, kw_only=True)
class MasterRound(RoundSpec):
    """A round through the master (synchronous, or an asynchronous chunk): train from ``weights`` (None: the run's
    broadcast variable, :func:`weights_var`) and return the weights, or their change (``return_delta``)."""

    weights: list[np.ndarray] | None = None
    optimizer_state: list[np.ndarray] | None = None
    return_optimizer_state: bool = False
    return_delta: bool = False
    topk_ratio: float = 0.01


@dataclass(frozen=True, eq=False, kw_only=True)
class RingRound(RoundSpec):
    """A model-averaging round on the ring: train, then average the weights with the other members (``ring``: this
    member's part of the plan). ``fresh``: a new member, starting from the broadcast weights. ``round_rows``: the
    whole round's rows (weights of half-precision changes). ``outer``: ``(name, learning_rate, momentum)`` of the
    outer optimizer; ``adopt_outer``: ``"others"``/``"any"``, whose momentum new members take."""

    round_no: int
    ring: RingSpec
    fresh: bool = False
    average_optimizer_state: bool = False
    round_rows: int = 1
    outer: tuple[str, float, float] | None = None
    adopt_outer: str | None = None


@dataclass(frozen=True, eq=False, kw_only=True)
class GradientRound(RoundSpec):
    """A gradient-averaging round: ``steps`` optimizer steps in lockstep with the ring's other members.
    ``adopt``: new members take the others' optimizer state first; ``learning_rate_factor``: ``(first, last)``
    multiples of the compiled learning rate over the steps; ``bucket_cap_mb``: gradient buckets on PyTorch."""

    round_no: int
    ring: RingSpec
    steps: int
    fresh: bool = False
    adopt: bool = False
    learning_rate_factor: tuple[float, float] | None = None
    bucket_cap_mb: float | None = None
