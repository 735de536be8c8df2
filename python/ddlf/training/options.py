"""What ``app.train`` was asked to do: Keras' own arguments, plus a few typed options for the distributed choices.

``train`` takes ``fit``'s arguments with ``fit``'s names and meanings, and four objects (in the manner of Ray Train's
``ScalingConfig``/``RunConfig``), each validating itself when it is made, so an invalid combination cannot be
written and each name has one meaning:

- ``strategy``: how the workers learn together. :class:`ModelAveraging` (the paper's: each worker steps on its own
  for ``every`` batches, then the weights are averaged; :class:`Nesterov` as DiLoCo's outer step), or
  :class:`GradientAveraging` (PyTorch DDP's and Horovod's: every step's gradients averaged on a ring), or
  :class:`Asynchronous` (each worker at its own pace, its changes merged by the master).
  Without one, :mod:`ddlf.training.defaults` chooses (gradient averaging with the learning rate scaled, where the
  model allows it).
- the exchange of model averaging (``ModelAveraging(exchange=...)``): :class:`ThroughMaster`, :class:`Ring` or
  :class:`AutoExchange`; gradient averaging always uses a :class:`Ring`.
- ``data``: :class:`DataConfig`, how rows reach the workers.
- ``run``: :class:`RunConfig`, which workers, seed, checkpoints, report and what failures do.

``train_sync``/``train_async`` overrides receive the whole request as one :class:`TrainConfig`.

```python
history = app.train(
    epochs=10, batch_size=64, validation_data=(x_val, y_val),
    strategy=ddlf.ModelAveraging(every=50, exchange=ddlf.Ring(compression="bfloat16")),
    run=ddlf.RunConfig(checkpoint_dir="ckpt", resume=True),
)
```
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection, Sized
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from ..errors import ConfigError, ConfigTypeError, OutOfRangeError
from .messages import FitData
from .outer import OuterSpec
from .policy import FailurePolicy

HalfPrecision = Literal["float16", "bfloat16"]
"""Compression to half precision: ``"bfloat16"`` keeps float32's range; ``"float16"`` is more precise but
overflows past 65504 (such an update is skipped on every worker and reported)."""


def _positive_int(value: Any, what: str, *, none: bool = False) -> None:
    if value is None and none:
        return
    wrong_type = isinstance(value, bool) or not isinstance(value, int)
    if wrong_type or value < 1:
        # a wrong type is a ConfigTypeError (a TypeError too), as the error contract says; a bad number a ConfigError
        raise (ConfigTypeError if wrong_type else ConfigError)(
            f"{what} must be an integer >= 1{' or None' if none else ''}, not {value!r}"
        )


def _number(
    value: Any, what: str, *, low: float, high: float = math.inf, open_low: bool = False, closed_high: bool = False
) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if open_low else value >= low) and (value <= high if closed_high else value < high)
    if not ok:
        bound = f"> {low}" if open_low else f">= {low}"
        upper = "" if high == math.inf else f" and {'<=' if closed_high else '<'} {high}"
        raise ConfigError(f"{what} must be a finite number {bound}{upper}, not {value!r}")


def _half(value: Any, what: str, *, topk: bool = False) -> None:
    if value not in (None, "float16", "bfloat16"):
        choices = "None, 'float16', 'bfloat16' or a ddlf.TopK" if topk else "None, 'float16' or 'bfloat16'"
        raise ConfigError(f"{what} must be {choices}, not {value!r}")


# -- compression and exchanges --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TopK:
    """Workers send only the ``ratio`` share of their change's entries of largest magnitude, keeping the rest as
    error feedback for their next round (nothing is lost, only delayed). Through the master only: the ring sums
    dense arrays."""

    ratio: float = 0.01

    def __post_init__(self) -> None:
        _number(self.ratio, "TopK.ratio (the share sent)", low=0.0, high=1.0, open_low=True, closed_high=True)


@dataclass(frozen=True)
class ThroughMaster:
    """The master exchange: the master sends the weights, every worker returns its own (or their change), the master
    averages them. Every byte crosses the master's link (``2 n W`` per round); on one host the weights go once to
    shared memory for all workers. ``compression``: workers send their change at half precision, or its top-k."""

    compression: HalfPrecision | TopK | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.compression, TopK):
            _half(self.compression, "ThroughMaster.compression", topk=True)


@dataclass(frozen=True)
class Ring:
    """The all-reduce: workers average among themselves over a ring, worker to worker (each sends ``2(n-1)/n`` times
    the weights per round whatever ``n``); the master carries no weights per round.

    ``hierarchical``: workers on one host reduce through shared memory and one per host joins the ring between
    hosts (default: when some host runs more than one of the workers; ``False``: one flat ring).
    ``compression``: every link carries float32 values at half precision, sums stay float32 (model averaging
    reduces each round's change, gradient averaging the gradients); a hierarchical ring sums a host's workers in
    float32 and rounds only what crosses the network."""

    hierarchical: bool | None = None
    compression: HalfPrecision | None = None

    def __post_init__(self) -> None:
        if self.hierarchical not in (None, True, False):
            raise ConfigError(f"Ring.hierarchical must be None, True or False, not {self.hierarchical!r}")
        _half(self.compression, "Ring.compression")


@dataclass(frozen=True)
class AutoExchange:
    """:class:`Ring` when the run's workers are on more than one host (the master's link is the bottleneck it
    removes), :class:`ThroughMaster` when they share one (where the master writes the weights once to shared
    memory for all of them). ``compression`` applies to whichever is chosen."""

    compression: HalfPrecision | None = None
    hierarchical: bool | None = None

    def __post_init__(self) -> None:
        Ring(self.hierarchical, self.compression)  # the same checks

    def resolve(self, hosts: int) -> ThroughMaster | Ring:
        """The exchange for a run whose workers span ``hosts`` hosts."""
        if hosts > 1:
            return Ring(self.hierarchical, self.compression)
        return ThroughMaster(self.compression)


Exchange = ThroughMaster | Ring | AutoExchange


# -- strategies -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Nesterov:
    """DiLoCo's outer optimizer for model averaging (Douillard et al. 2023): each round's averaged change is applied
    through Nesterov momentum instead of replacing the weights with the average, so workers can average much less
    often at equal quality (see :mod:`ddlf.training.outer`). DiLoCo's values are the defaults."""

    learning_rate: float = 0.7
    momentum: float = 0.9

    def __post_init__(self) -> None:
        self.spec().check()

    def spec(self) -> OuterSpec:
        """What travels to the workers."""
        return OuterSpec("nesterov", self.learning_rate, self.momentum)


@dataclass(frozen=True)
class ModelAveraging:
    """Synchronous model averaging (the DDLF paper's): each worker takes its own optimizer steps for ``every``
    batches (default: its whole partition of the epoch, one round per epoch), then the weights are averaged.

    ``optimizer_state``: also average the optimizer state (Adam's moments) each round. ``outer``: step with the
    round's averaged change through :class:`Nesterov` instead of taking the average. ``exchange``: how the round's
    workers agree on the average (:class:`ThroughMaster`, :class:`Ring` or :class:`AutoExchange`)."""

    lockstep: ClassVar[bool] = False
    """Each worker takes its own optimizer steps on its rows (its step count is its own)."""

    every: int | None = None
    optimizer_state: bool = False
    outer: Nesterov | None = None
    exchange: ThroughMaster | Ring | AutoExchange = field(default_factory=ThroughMaster)

    def __post_init__(self) -> None:
        _positive_int(self.every, "ModelAveraging.every (batches per round)", none=True)
        if not isinstance(self.optimizer_state, bool):
            raise ConfigTypeError(f"ModelAveraging.optimizer_state must be True or False, not {self.optimizer_state!r}")
        if self.outer is not None and not isinstance(self.outer, Nesterov):
            raise ConfigTypeError(f"ModelAveraging.outer must be None or a ddlf.Nesterov, not {self.outer!r}")
        if not isinstance(self.exchange, (ThroughMaster, Ring, AutoExchange)):
            raise ConfigTypeError(
                "ModelAveraging.exchange must be a ddlf.ThroughMaster, ddlf.Ring or ddlf.AutoExchange, "
                f"not {self.exchange!r}"
            )


@dataclass(frozen=True)
class GradientAveraging:
    """Synchronous gradient averaging (PyTorch DDP's and Horovod's): every step the workers average their batches'
    gradients over a :class:`Ring` and apply the same step, so ``n`` workers learn exactly as one process at ``n``
    times the batch (see :mod:`ddlf.training.replica.steppers`).

    ``scale_learning_rate``: multiply the compiled learning rate by the number of workers (Goyal et al. 2017's linear
    scaling rule), reached linearly over ``warmup_epochs``. ``bucket_cap_mb``: on PyTorch and on Keras with
    TensorFlow, gradients go to the ring in buckets of about this many MB while backward still runs (DDP's
    ``bucket_cap_mb``; on TensorFlow the reduction and the optimizer's step run inside the step's graph, and
    overlap backward only where TensorFlow has two or more inter-op threads, not on a worker started with
    ``--threads 1``; ``None``: one buffer after backward). ``check_in_every``: batches between the workers'
    replies to the master (progress, faults; default one per epoch's partition).

    ``shard_optimizer``: each worker keeps the optimizer state of ``1/n`` of the weights only (DeepSpeed's ZeRO
    stage 1; :mod:`ddlf.training.replica.sharded`): the ring reduce-scatters the gradients, each worker steps its
    shard with the model's own optimizer, and the ring all-gathers the new weights. The same bytes on the wire as
    an all-reduce and the same result (bit-identical replicas); optimizer state per worker ``1/n``. For float32
    weights and an element-wise optimizer: Keras's SGD, Adam, AdamW, RMSprop, Adagrad, Adadelta, Adamax, Nadam,
    Lion, Ftrl, or, for a :class:`ddlf.models.TorchModel`, ``torch.optim``'s SGD, Adam, AdamW, RMSprop, Adagrad,
    Adadelta, Adamax, NAdam, RAdam with one parameter group; anything else is refused with the reason before training
    starts. ``bucket_cap_mb`` does not apply (the gradients go in one buffer after backward). Checkpoints hold the
    whole state and resume on any number of workers; a lost worker's shard restarts from zeros (History notes it)."""

    lockstep: ClassVar[bool] = True
    """Every worker takes every step, whatever its rows (one without a batch adds zeros with weight 0)."""

    scale_learning_rate: bool = False
    warmup_epochs: float = 0.0
    bucket_cap_mb: float | None = 25.0
    check_in_every: int | None = None
    ring: Ring = field(default_factory=Ring)
    shard_optimizer: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.scale_learning_rate, bool):
            raise ConfigTypeError(f"scale_learning_rate must be True or False, not {self.scale_learning_rate!r}")
        _number(self.warmup_epochs, "GradientAveraging.warmup_epochs", low=0.0)
        if self.warmup_epochs and not self.scale_learning_rate:
            raise ConfigError("warmup_epochs warms up the scaled learning rate: set scale_learning_rate=True too")
        if self.bucket_cap_mb is not None:
            _number(self.bucket_cap_mb, "GradientAveraging.bucket_cap_mb", low=0.0, open_low=True)
        _positive_int(self.check_in_every, "GradientAveraging.check_in_every", none=True)
        if not isinstance(self.shard_optimizer, bool):
            raise ConfigTypeError(
                f"GradientAveraging.shard_optimizer must be True or False, not {self.shard_optimizer!r}"
            )
        if not isinstance(self.ring, Ring):
            raise ConfigTypeError(f"GradientAveraging.ring must be a ddlf.Ring, not {self.ring!r}")

    def learning_rate_factor(self, workers: int, progress: float) -> float:
        """The learning rate's multiple ``progress`` epochs into training: ``workers`` with
        ``scale_learning_rate``, reached linearly from 1 over ``warmup_epochs``; 1 otherwise."""
        if not self.scale_learning_rate:
            return 1.0
        if self.warmup_epochs <= 0:
            return float(workers)
        return 1.0 + (workers - 1) * min(1.0, max(0.0, progress) / self.warmup_epochs)


@dataclass(frozen=True)
class DynSGD:
    """Staleness-aware merging for asynchronous training (DynSGD): a change computed from weights ``s`` versions
    old is scaled by ``1/(s+1)`` before it is merged."""


STALE_STEPS = 2
"""The staleness, in the other workers' steps, that :class:`Asynchronous`'s default chunk allows."""
SOLO_CHUNK = 10
""":class:`Asynchronous`'s default chunk for one worker, whose changes are never stale."""


@dataclass(frozen=True)
class Asynchronous:
    """Asynchronous training: each worker trains ``chunk`` batches at its own pace from the newest weights it has,
    and the master merges its change as it arrives; a slow worker never stalls the others.

    ``chunk``: batches per chunk; ``None`` (the default) picks it from the number of workers ``n``
    (:meth:`chunk_batches`): a change merged into weights that moved under it is stale by about ``(n - 1) x
    chunk`` of the other workers' steps, and measured accuracy falls with that staleness (issue 37: on 2 workers
    chunks of 10 batches ended 1-9 points below one process after the same epochs, chunks of 1-2 within 1), so the
    default keeps it at about :data:`STALE_STEPS` steps: 2 batches on 2 workers, 1 on 3 or more, 10 on one
    (nothing is stale).

    ``staleness``: :class:`DynSGD` scales stale changes down; ``None`` merges them as they are. ``max_staleness``:
    a change computed from weights more than this many versions old is dropped (the worker pulls fresh weights).
    ``compression``: workers send their change at half precision, or its top-k (:class:`TopK`)."""

    lockstep: ClassVar[bool] = False
    """Each worker steps at its own pace."""

    chunk: int | None = None
    staleness: DynSGD | None = None
    max_staleness: int | None = None
    compression: HalfPrecision | TopK | None = None

    def __post_init__(self) -> None:
        _positive_int(self.chunk, "Asynchronous.chunk (batches per chunk)", none=True)
        if self.staleness is not None and not isinstance(self.staleness, DynSGD):
            raise ConfigTypeError(f"Asynchronous.staleness must be None or a ddlf.DynSGD, not {self.staleness!r}")
        m = self.max_staleness
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 0):
            raise ConfigError(f"Asynchronous.max_staleness must be an integer >= 0 or None, not {m!r}")
        if not isinstance(self.compression, TopK):
            _half(self.compression, "Asynchronous.compression", topk=True)

    def chunk_batches(self, workers: int) -> int:
        """Batches per chunk with ``workers`` training: ``chunk`` if set; else 10 alone, and otherwise the most
        that keeps a merged change at most :data:`STALE_STEPS` of the other workers' steps stale."""
        if self.chunk is not None:
            return self.chunk
        if workers <= 1:
            return SOLO_CHUNK
        return max(1, STALE_STEPS // (workers - 1))


Strategy = ModelAveraging | GradientAveraging | Asynchronous


# -- data and run ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataConfig:
    """How rows reach the workers (their data is preloaded once; only indices or a seed travel).

    ``send``: each epoch the master sends every worker its ``"indices"`` (its partition of the shuffled rows), or
    only the ``"seed"`` (workers regenerate the same partition). ``worker_shares``: relative amount of data per
    worker, for workers of unequal speed (with gradient averaging kept to a whole batch: a round is split in whole
    batches, with its one partial batch, if any, on one worker). ``rotate_shards_every``: sharded apps: every k
    epochs each worker moves on to the next worker's shard, so every worker eventually sees all the data.
    ``prefetch``: batches each worker prepares ahead of its training step, on a thread of its own (a round of at
    most 1 MiB of rows held in memory, such as an ``Asynchronous()`` chunk of a small dataset, is gathered on the
    training thread instead: the thread would cost more than the gathering it hides)."""

    send: Literal["indices", "seed"] = "indices"
    worker_shares: tuple[float, ...] | None = None
    rotate_shards_every: int | None = None
    prefetch: int = 2

    def __post_init__(self) -> None:
        if self.send not in ("indices", "seed"):
            raise ConfigError(f"DataConfig.send must be 'indices' or 'seed', not {self.send!r}")
        if self.worker_shares is not None:
            shares = tuple(self.worker_shares)
            for s in shares:
                _number(s, "each of DataConfig.worker_shares", low=0.0, open_low=True)
            object.__setattr__(self, "worker_shares", tuple(float(s) for s in shares))
        _positive_int(self.rotate_shards_every, "DataConfig.rotate_shards_every (epochs)", none=True)
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ConfigError(f"DataConfig.prefetch must be an integer >= 0, not {self.prefetch!r}")


@dataclass(frozen=True)
class RunConfig:
    """Where and how safely a run trains.

    ``workers``: train on these workers of the cluster only (indices; runs are isolated on their workers, so one
    master can train several apps at once on disjoint groups and several masters can share daemons). ``seed``:
    seeds Python, numpy, Keras (and torch) on the master and every worker, and the epochs' shuffles.
    ``checkpoint_dir``: a checkpoint there after every epoch, atomically (weights, optimizer and random states,
    epoch, History; see :mod:`ddlf.training.checkpoint`); ``resume``: continue from it if there is one (in sync
    mode the resumed run ends with the same weights as an uninterrupted one). ``report``: a self-contained HTML
    report there when training ends or fails, its numbers as JSON beside it (:mod:`ddlf.report`).
    ``failure_policy``: what a worker's failure does (:class:`ddlf.FailurePolicy`). ``rejoin_timeout``: when every
    worker is lost, how long to wait for one to come back. ``nonfinite``: a worker's reply holding NaN or infinity
    is left out of its round (``"skip"``: a :class:`~ddlf.errors.ReplyRefusedWarning` and an event) or stops
    training (``"raise"``: :class:`~ddlf.errors.NonFiniteUpdate`). ``preemption_signals``: with a
    ``checkpoint_dir``, these signals end training at a round boundary with a checkpoint of the last merged round
    (and, for SIGUSR1 in a Slurm job, requeue it), then raise :class:`~ddlf.errors.Preempted`
    (:mod:`ddlf.training.preemption`); ``()``: none caught."""

    workers: tuple[int, ...] | None = None
    seed: int = 0
    checkpoint_dir: str | os.PathLike[str] | None = None
    resume: bool = False
    report: str | os.PathLike[str] | None = None
    failure_policy: FailurePolicy = field(default_factory=FailurePolicy)
    rejoin_timeout: float = 60.0
    nonfinite: Literal["skip", "raise"] = "skip"
    preemption_signals: tuple[str | int, ...] = ("SIGUSR1", "SIGTERM")

    def __post_init__(self) -> None:
        from .preemption import signal_number

        if isinstance(self.preemption_signals, (str, int)):
            raise ConfigTypeError(
                f"RunConfig.preemption_signals must be a tuple of signals, not {self.preemption_signals!r}"
            )
        for s in self.preemption_signals:
            signal_number(s)  # ConfigError naming it
        if any(signal_number(s) == 2 for s in self.preemption_signals):
            raise ConfigError("RunConfig.preemption_signals cannot take SIGINT: Ctrl-C stops training at once")
        object.__setattr__(self, "preemption_signals", tuple(self.preemption_signals))
        if self.workers is not None:
            w = self.workers
            if isinstance(w, (str, bytes)) or not all(
                (isinstance(i, int) and not isinstance(i, bool)) or type(i).__module__ == "numpy" for i in w
            ):
                raise ConfigTypeError(f"RunConfig.workers must be a sequence of worker indices, not {w!r}")
            subset = tuple(sorted({int(i) for i in w}))
            if not subset:
                raise ConfigError("RunConfig.workers is empty: name at least one worker")
            if subset[0] < 0:
                raise OutOfRangeError(f"RunConfig.workers {[i for i in subset if i < 0]} out of range")
            object.__setattr__(self, "workers", subset)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigTypeError(f"RunConfig.seed must be an integer, not {self.seed!r}")
        if self.checkpoint_dir is not None:
            object.__setattr__(self, "checkpoint_dir", os.fspath(self.checkpoint_dir))
        if self.report is not None:
            object.__setattr__(self, "report", os.fspath(self.report))
        if not isinstance(self.resume, bool):
            raise ConfigTypeError(f"RunConfig.resume must be True or False, not {self.resume!r}")
        if self.resume and self.checkpoint_dir is None:
            raise ConfigError("RunConfig(resume=True) needs the checkpoint_dir to resume from")
        if not isinstance(self.failure_policy, FailurePolicy):
            raise ConfigTypeError(
                f"RunConfig.failure_policy must be a ddlf.FailurePolicy, not {type(self.failure_policy).__name__}"
            )
        _number(self.rejoin_timeout, "RunConfig.rejoin_timeout", low=0.0)
        if self.nonfinite not in ("skip", "raise"):
            raise ConfigError(f"RunConfig.nonfinite must be 'skip' or 'raise', not {self.nonfinite!r}")


# -- the whole request ----------------------------------------------------------------------------------------


def validates(freq: int | Collection[int], epoch: int) -> bool:
    """Whether ``fit``'s ``validation_freq`` (every ``freq`` epochs, or the epochs listed, counted from 1) runs
    validation after epoch ``epoch`` (counted from 0)."""
    if isinstance(freq, int):
        return (epoch + 1) % freq == 0
    return epoch + 1 in freq


@dataclass(frozen=True)
class TrainConfig:
    """Everything one ``app.train`` call asked for: what ``train_sync``/``train_async`` overrides receive, frozen
    (``dataclasses.replace`` makes a changed copy). The run's own state (its id, clock, resume data) is not here:
    :class:`ddlf.training.run.RunState`.

    The loops read the resolved values through the properties below (``round_batches``, ``compression``, ...);
    ``exchange`` is the one model averaging uses once resolved for the cluster (``None`` for the others)."""

    epochs: int
    batch_size: int
    strategy: Strategy = field(default_factory=ModelAveraging)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)
    verbose: int = 1
    fit: FitData = field(default_factory=FitData)
    """``fit``'s data arguments (``validation_split``, ``shuffle``, ``class_weight``, ``sample_weight``)."""
    validation_freq: int | tuple[int, ...] = 1
    """As in ``fit``: validate every this many epochs, or after the epochs listed (counted from 1)."""
    exchange: ThroughMaster | Ring | None = None
    """How model averaging exchanges, resolved for the cluster (``train`` sets it); gradient averaging's ring."""

    def __post_init__(self) -> None:
        if any(isinstance(v, Sized) and not isinstance(v, str) for v in (self.epochs, self.batch_size)):  # fit(x, y)
            raise ConfigTypeError(
                "train() takes no data: each worker trains on the rows its load_dataset() returns (see IApp); its "
                "first arguments are epochs and batch_size, e.g. app.train(epochs=5, batch_size=64)"
            )
        _positive_int(self.batch_size, "batch_size")
        if isinstance(self.epochs, bool) or not isinstance(self.epochs, int) or self.epochs < 0:
            raise ConfigError(f"epochs must be an integer >= 0, not {self.epochs!r}")
        if not isinstance(self.strategy, (ModelAveraging, GradientAveraging, Asynchronous)):
            raise ConfigTypeError(
                "strategy must be a ddlf.ModelAveraging, ddlf.GradientAveraging or ddlf.Asynchronous, "
                f"not {self.strategy!r}"
            )
        if not isinstance(self.data, DataConfig):
            raise ConfigTypeError(f"data must be a ddlf.DataConfig, not {self.data!r}")
        if not isinstance(self.run, RunConfig):
            raise ConfigTypeError(f"run must be a ddlf.RunConfig, not {self.run!r}")
        if isinstance(self.strategy, GradientAveraging):
            object.__setattr__(self, "exchange", self.strategy.ring)
        freq = self.validation_freq
        if isinstance(freq, (list, tuple, set, frozenset, range)):
            freq = tuple(sorted(freq))
            object.__setattr__(self, "validation_freq", freq)
            if not all(isinstance(e, int) and not isinstance(e, bool) and e >= 1 for e in freq):
                raise ConfigError(f"validation_freq as a list holds epochs counted from 1, not {freq!r}")
        else:
            _positive_int(freq, "validation_freq")
        if not isinstance(self.fit, FitData):
            raise ConfigTypeError(f"fit must be a FitData, not {self.fit!r}")

    def validates(self, epoch: int) -> bool:
        """Whether validation runs after epoch ``epoch`` (counted from 0), as ``validation_freq`` says."""
        return validates(self.validation_freq, epoch)

    # -- resolved values the loops read ------------------------------------------------------------------------

    @property
    def mode(self) -> Literal["sync", "async"]:
        """``"async"`` for :class:`Asynchronous`, else ``"sync"``."""
        return "async" if isinstance(self.strategy, Asynchronous) else "sync"

    @property
    def averaging(self) -> Literal["weights", "gradients"]:
        """What a synchronous run averages: ``"gradients"`` for :class:`GradientAveraging`, else ``"weights"``."""
        return "gradients" if isinstance(self.strategy, GradientAveraging) else "weights"

    @property
    def round_batches(self) -> int | None:
        """Batches a worker trains between two replies to the master (a round, a chunk, a check-in); ``None``: its
        whole partition of the epoch."""
        s = self.strategy
        if isinstance(s, ModelAveraging):
            return s.every
        if isinstance(s, GradientAveraging):
            return s.check_in_every
        return s.chunk

    @property
    def ring(self) -> Ring | None:
        """The ring this run reduces on, if it does."""
        return self.exchange if isinstance(self.exchange, Ring) else None

    def _compression(self) -> HalfPrecision | TopK | None:
        if isinstance(self.strategy, Asynchronous):
            return self.strategy.compression
        exchange: ThroughMaster | Ring | AutoExchange | None = self.exchange
        if exchange is None:
            exchange = self.strategy.ring if isinstance(self.strategy, GradientAveraging) else self.strategy.exchange
        return exchange.compression

    @property
    def compression(self) -> Literal["float16", "bfloat16", "topk"] | None:
        """What workers send at reduced size: half precision, ``"topk"``, or ``None``."""
        c = self._compression()
        return "topk" if isinstance(c, TopK) else c

    @property
    def topk_ratio(self) -> float:
        """The share of entries a :class:`TopK` compression sends (its default otherwise)."""
        c = self._compression()
        return c.ratio if isinstance(c, TopK) else TopK().ratio

    @property
    def average_optimizer_state(self) -> bool:
        """Model averaging also averages the optimizer state."""
        return isinstance(self.strategy, ModelAveraging) and self.strategy.optimizer_state

    def outer(self) -> OuterSpec | None:
        """The outer optimizer of model averaging, as the workers receive it; ``None`` without one."""
        s = self.strategy
        return s.outer.spec() if isinstance(s, ModelAveraging) and s.outer is not None else None

    @property
    def scale_learning_rate(self) -> bool:
        """Gradient averaging scales the learning rate by the number of workers."""
        return isinstance(self.strategy, GradientAveraging) and self.strategy.scale_learning_rate

    @property
    def gradients(self) -> GradientAveraging | None:
        """The gradient-averaging options, for a run that averages gradients."""
        return self.strategy if isinstance(self.strategy, GradientAveraging) else None

    def learning_rate_factor(self, workers: int, progress: float) -> float:
        """The learning rate's multiple (:meth:`GradientAveraging.learning_rate_factor`; 1 otherwise)."""
        g = self.gradients
        return g.learning_rate_factor(workers, progress) if g is not None else 1.0
