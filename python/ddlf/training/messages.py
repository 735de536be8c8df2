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

from ..errors import ConfigError, ConfigTypeError
from ..ring_spec import RingSpec


def finite(a: np.ndarray) -> bool:
    """Whether every element of float array ``a`` is finite (other dtypes always are): one pass summing it in its
    own precision (a non-finite element makes the sum inf or nan; numpy's pairwise sum runs at memory speed,
    about 3.7x faster than summing float32 in float64 on 23 MB here), and the exact check only when the sum is
    not finite (an element that is, or finite values whose sum overflowed)."""
    if a.dtype.kind != "f" or a.size == 0:
        return True
    if math.isfinite(float(np.add.reduce(a, axis=None))):
        return True
    return bool(np.isfinite(a).all())


@dataclass(frozen=True, eq=False)
class FitData:
    """What ``train``'s data arguments ask of every worker's dataset, with ``fit``'s meanings: sent once, at set-up.

    ``validation_split``: the last share of the rows (before any shuffling) is held out of training, for
    validation on the workers. ``shuffle``: each epoch visits the training rows in a fresh seeded order (False:
    in order). ``class_weight``: per-class weights turned into each batch's sample weights from its labels.
    ``sample_weight``: per-row weights, an array with one entry per row, or a function ``(x, y) -> weights`` of
    each raw batch (run on the workers)."""

    validation_split: float = 0.0
    shuffle: bool = True
    class_weight: dict[int, float] | None = None
    sample_weight: Any = None

    def __post_init__(self) -> None:
        split = self.validation_split
        if isinstance(split, bool) or not isinstance(split, (int, float)) or not 0.0 <= split < 1.0:
            raise ConfigError(f"validation_split must be a number >= 0 and < 1, not {split!r}")
        if self.shuffle not in (True, False):
            raise ConfigError(f"shuffle must be True or False, not {self.shuffle!r}")
        cw = self.class_weight
        if cw is not None:
            if not isinstance(cw, dict) or not cw:
                raise ConfigTypeError(f"class_weight must be a dict {{class index: weight}}, not {cw!r}")
            for k, v in cw.items():
                if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
                    raise ConfigError(f"class_weight's keys must be class indices (integers >= 0), not {k!r}")
                if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not math.isfinite(v):
                    raise ConfigError(f"class_weight[{k}] must be a finite number, not {v!r}")
            if self.sample_weight is not None:
                raise ConfigError("class_weight and sample_weight cannot be given together (as in fit): keep one")
        sw = self.sample_weight
        if sw is not None and not callable(sw):
            a = np.asarray(sw)
            if a.dtype.kind not in "fiu" or a.ndim < 1:
                raise ConfigTypeError(
                    "sample_weight must be an array of numbers with one entry per row, or a function "
                    f"(x, y) -> weights of each batch, not {type(sw).__name__}"
                )
            if not np.isfinite(a.astype(np.float64)).all():
                raise ConfigError("sample_weight holds NaN or infinite values")

    @property
    def plain(self) -> bool:
        """``fit``'s defaults: every row trains, shuffled, unweighted (nothing to send the workers)."""
        return not self.validation_split and self.shuffle and self.class_weight is None and self.sample_weight is None


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
    optimizer_state_bytes: int = 0
    """Gradient averaging: the optimizer state the worker holds (its shard, with sharded state)..."""
    resident_bytes: int = 0
    """...and its process's resident memory at the round's end."""
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
            optimizer_state_bytes=int(reply.get("optimizer_state_bytes") or 0),
            resident_bytes=int(reply.get("resident_bytes") or 0),
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
    optimizer_groups: tuple[dict[str, Any], ...] | None = None
    """A ``TorchModel``'s optimizer hyperparameters, group by group, to train with from this round on: set when the
    master's changed (a torch scheduler stepped from a callback, ``group["lr"] = ...``)."""


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
    multiples of the compiled learning rate over the steps; ``bucket_cap_mb``: gradient buckets on PyTorch and
    TensorFlow; ``shard``: sharded optimizer state."""

    round_no: int
    ring: RingSpec
    steps: int
    fresh: bool = False
    adopt: bool = False
    learning_rate_factor: tuple[float, float] | None = None
    bucket_cap_mb: float | None = None
    shard: str | None = None
    """With sharded optimizer state (:mod:`.replica.sharded`): ``"keep"``, ``"redo"``, ``"reshard"`` or
    ``"fresh"`` (see ``ShardedOptimizer.begin``); None: every worker holds the whole state."""
