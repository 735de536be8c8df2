"""What runs on a worker during training. These functions are importable on every worker (ddlf is installed
there), so the master calls them by reference: only their arguments travel.

A training session holds the app, its model and its dataset (from the worker's dataset store) for one run, under
the run's id: several runs (from several masters, or one master's concurrent trainings) share a daemon without
seeing each other's model, optimizer or weights in flight (the broadcast weights live under :func:`weights_var`).
Their requests interleave on the daemon's interpreter thread. At most :data:`LIMITS.max_runs` runs hold a daemon at
once; a new run past it is refused with an error naming the runs there, unless one of them has been idle for
``LIMITS.idle_seconds`` (its master died without tearing it down): that one is evicted.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import ops
from ..datasets import STORE
from ..settings import follow_keras_backend, keras_backend_default
from . import warm
from .common import set_random_seed
from .gradients import local_mask, stepper_for, steps_whole_rounds
from .outer import Nesterov, OuterSpec


@dataclass
class Session:
    app: Any
    model: Any
    x: Any
    y: Any
    rows: int
    n_shards: int = 0  # 0: the whole dataset on every worker
    identity: bytes = b""  # digest of the app as received: names its dataset's copy on the host (node_store)
    residual: list[np.ndarray] | None = None  # top-k error feedback: what earlier rounds did not send
    # exchange="allreduce": (round, weights before it, weights after it) of the last round reduced here
    reduced: tuple[int, list[np.ndarray], list[np.ndarray]] | None = None
    # the model's training step (training.gradients), made on first use; and, with averaging="gradients", the
    # optimizer state the last round started from
    stepper: Any = None
    optimizer_start: list[np.ndarray] | None = None
    # exchange="allreduce" with an outer optimizer: its momentum, and the momentum the last round started from
    outer: Nesterov | None = None
    outer_start: list[np.ndarray] | None = None
    # what identifies the model's architecture among kept warm models (training.warm); None: not kept
    warm_key: str | None = None

    def steps(self) -> Any:
        """The model's :class:`~ddlf.training.gradients.Stepper` (traced or jitted once per run)."""
        if self.stepper is None:
            self.stepper = stepper_for(self.model)
        return self.stepper

    started: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)


@dataclass
class Limits:
    """How many training runs a daemon holds at once (``ddlf-worker --max-runs``), and after how long without a
    request a run counts as abandoned (``--run-idle-timeout``)."""

    max_runs: int = 4
    idle_seconds: float = 600.0


LIMITS = Limits()
"""This daemon's limits, set by the ``ddlf-worker`` command line."""


class TooManyRuns(RuntimeError):
    """The daemon holds ``max_runs`` training runs already; none of them is idle long enough to evict."""


log = logging.getLogger("ddlf.training")


def weights_var(run_id: str) -> str:
    """The worker variable a synchronous run broadcasts its weights in (one per run)."""
    return f"__ddlf_weights/{run_id}"


def shard_key(app: Any, shard: int, n_shards: int) -> str:
    """Store key of one shard of a sharded dataset."""
    return f"{app.dataset_key}/shard-{shard}-of-{n_shards}"


def _load(app: Any, identity: bytes, shard: int | None, n_shards: int) -> tuple[Any, bool]:
    """The app's dataset (or one shard of it) through the worker's store; ``identity``, the digest of the app as
    received, names the host's copy (no second pickle of the app here)."""
    if shard is None:
        return STORE.get_or_load(app.dataset_key, app.load_dataset, identity=identity)
    return STORE.get_or_load(
        shard_key(app, shard, n_shards),
        lambda: app.load_shard(shard, n_shards),
        shard=(shard, n_shards),
        identity=identity,
    )


_SESSIONS: dict[str, Session] = {}


def _no_report(runs: list[str]) -> None:
    pass


report_runs: Callable[[list[str]], None] = _no_report
"""Where the list of runs goes whenever it changes: the daemon's status (``ddlf status``, ``Cluster.status()``),
answered without this interpreter. Set by the executor once the daemon listens."""


def _publish() -> None:
    report_runs([f"{rid} {type(s.app).__name__}" for rid, s in sorted(_SESSIONS.items())])


def _session(run_id: str) -> Session:
    session = _SESSIONS.get(run_id)
    if session is None:
        raise LookupError(
            f"training run {run_id} is not set up on this worker (it was torn down, or evicted after "
            f"{LIMITS.idle_seconds:.0f} s idle)"
        )
    session.last_used = time.monotonic()
    return session


def _split_xy(value: Any) -> tuple[Any, Any]:
    if isinstance(value, dict):
        if "x" not in value or "y" not in value:
            raise TypeError(f"load_dataset returned a dict with keys {sorted(value)}; it needs 'x' and 'y'")
        return value["x"], value["y"]
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return value[0], value[1]
    raise TypeError("load_dataset must return (x, y) or {'x': ..., 'y': ...}")


def setup(
    worker: Any, run_id: str, app_blob: bytes, seed: int, backend: str | None = None, torch: bool | None = None
) -> dict[str, Any]:
    """Load (or reuse) the app's dataset and build its model on this worker, on the master's Keras ``backend``.
    ``torch``: the master's model is a ``TorchModel`` or Keras runs on torch (None: as far as this worker can tell,
    :func:`~ddlf.training.common.uses_torch`)."""
    import cloudpickle

    if torch:
        from ..frameworks import load_torch_compiler_first

        load_torch_compiler_first()  # before anything loads TensorFlow: the app's unpickling may
    if backend:
        follow_keras_backend(backend)
    else:
        keras_backend_default()
    app = cloudpickle.loads(app_blob)
    t0 = time.perf_counter()
    worker_seed = seed + 1000 * (worker.id + 1)
    set_random_seed(worker_seed, torch=torch)
    n_shards = worker.n_workers if app.sharded else 0
    identity = hashlib.sha256(app_blob).digest()
    item, cached = _load(app, identity, worker.id if n_shards else None, n_shards)
    x, y = _split_xy(item.value)
    model = app.create_model()
    if hasattr(model, "set_rng_state"):
        set_random_seed(worker_seed, torch=True)  # torch may have been imported by create_model itself
    _admit(worker, run_id)
    model, stepper, key = warm.lend(model)  # an earlier run's traced model, holding this one's initial state
    _SESSIONS[run_id] = Session(app, model, x, y, len(x), n_shards, stepper=stepper, warm_key=key, identity=identity)
    _publish()
    log.info("training run %s (%s) set up: %d rows, %d runs here", run_id, type(app).__name__, len(x), len(_SESSIONS))
    return {
        "rows": len(x),
        "cached": cached,
        "load_seconds": 0.0 if cached else item.load_seconds,
        "first_load_seconds": item.load_seconds,
        "setup_seconds": time.perf_counter() - t0,
    }


def _admit(worker: Any, run_id: str) -> None:
    """Make room for ``run_id``: evict runs idle past the limit when the daemon is full, else refuse."""
    if run_id in _SESSIONS or len(_SESSIONS) < LIMITS.max_runs:
        return
    now = time.monotonic()
    for other, s in sorted(_SESSIONS.items(), key=lambda kv: kv[1].last_used):
        if now - s.last_used >= LIMITS.idle_seconds:
            idle = now - s.last_used
            log.warning("training run %s evicted: idle for %.0f s, and run %s needs its place", other, idle, run_id)
            teardown(worker, other)
            if len(_SESSIONS) < LIMITS.max_runs:
                return
    held = ", ".join(
        f"{rid} ({type(s.app).__name__}, idle {now - s.last_used:.0f} s)" for rid, s in sorted(_SESSIONS.items())
    )
    raise TooManyRuns(
        f"this worker already serves {len(_SESSIONS)} training runs (--max-runs {LIMITS.max_runs}): {held}; "
        f"runs idle for {LIMITS.idle_seconds:.0f} s are evicted"
    )


def runs() -> list[dict[str, Any]]:
    """The training runs this worker serves: id, app class, rows, seconds since start and since last use."""
    now, wall = time.monotonic(), time.time()
    return [
        {
            "run_id": rid,
            "app": type(s.app).__name__,
            "rows": s.rows,
            "running_for_s": wall - s.started,
            "idle_s": now - s.last_used,
        }
        for rid, s in sorted(_SESSIONS.items())
    ]


def teardown(worker: Any, run_id: str) -> None:
    """Forget a run's session and its broadcast weights (the dataset stays cached)."""
    session = _SESSIONS.pop(run_id, None)
    if session is not None:
        warm.keep(session.warm_key, session.model, session.stepper)
        log.info("training run %s torn down", run_id)
        _publish()
    worker.vars.pop(weights_var(run_id), None)


def _rng_variables(model: Any) -> list[Any]:
    """A Keras model's variables that are neither weights nor optimizer state: random-generator states (dropout)."""
    weights = {id(w) for w in model.weights}
    return [v for v in model.variables if id(v) not in weights]


# A model is a compiled Keras model, or an adapter (ddlf.models.TorchModel) that offers its optimizer and random
# state through get_/set_optimizer_state and get_/set_rng_state.


def _optimizer_built(model: Any) -> bool:
    if hasattr(model, "get_optimizer_state"):
        return bool(model.optimizer_built)
    return bool(model.optimizer.built)


def _rng_state(model: Any) -> list[np.ndarray]:
    if hasattr(model, "get_rng_state"):
        return model.get_rng_state()
    return [np.asarray(v.numpy()) for v in _rng_variables(model)]


def _set_rng_state(model: Any, state: list[np.ndarray]) -> None:
    if hasattr(model, "set_rng_state"):
        model.set_rng_state(state)
        return
    rng = _rng_variables(model)
    if len(rng) == len(state):
        for v, s in zip(rng, state):
            v.assign(s)


def session_state(run_id: str) -> dict[str, Any]:
    """What this worker carries from round to round besides the weights: its optimizer state, its random
    generators' state and its top-k residual. Saved in checkpoints, so a resumed run continues identically."""
    session = _session(run_id)
    model = session.model
    return {
        "optimizer": _optimizer_state(model) if _optimizer_built(model) else None,
        "rng": _rng_state(model),
        "residual": session.residual,
        "outer": session.outer.state() if session.outer is not None else None,
    }


def restore_state(run_id: str, state: dict[str, Any]) -> None:
    """Put back what :func:`session_state` returned (after ``setup`` on a fresh or restarted worker)."""
    session = _session(run_id)
    model = session.model
    if state.get("optimizer") is not None:
        if not hasattr(model, "set_optimizer_state") and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        _set_optimizer_state(model, state["optimizer"])
    _set_rng_state(model, state.get("rng", []))
    session.residual = state.get("residual")
    if state.get("outer") is not None:
        session.outer = Nesterov(OuterSpec())  # the spec comes with the next round
        session.outer.load(state["outer"])


def _optimizer_state(model: Any) -> list[np.ndarray]:
    if hasattr(model, "get_optimizer_state"):
        return model.get_optimizer_state()
    return [np.asarray(v.numpy()) for v in model.optimizer.variables]


def _set_optimizer_state(model: Any, state: list[np.ndarray]) -> None:
    if hasattr(model, "set_optimizer_state"):
        # An optimizer that has not stepped yet has no state to take: it adopts the averaged one next round.
        model.set_optimizer_state(state)
        return
    variables = model.optimizer.variables
    if len(variables) != len(state):
        return  # not built yet on this worker: it builds on the first step and adopts the state next round
    for v, s in zip(variables, state):
        v.assign(s)


Seeded = tuple[int, int, list[float], int, int, int]
"""``shuffle="seeded"``: ``(seed, epoch, shares, worker, start, stop)`` of a slice of a regenerated permutation."""


def _rows(
    session: Session, indices: np.ndarray | None, seeded: Seeded | None, shard: int | None
) -> tuple[Any, Any, np.ndarray | None]:
    """The dataset a round trains on (with shard rotation, another worker's shard: loaded once, then cached here
    too) and its rows: ``indices``, or the slice ``seeded`` names of a permutation regenerated here."""
    x, y, rows = session.x, session.y, session.rows
    if session.n_shards and shard is not None:
        item, _ = _load(session.app, session.identity, shard, session.n_shards)
        x, y = _split_xy(item.value)
        rows = len(x)
    if seeded is not None:
        seed, epoch, shares, w, start, stop = seeded
        indices = ops.partition_for(rows, seed, epoch, shares, w)[start:stop]
    return x, y, indices


def train_chunk(
    worker: Any,
    run_id: str,
    indices: np.ndarray | None,
    batch_size: int,
    weights: list[np.ndarray] | None = None,
    seeded: Seeded | None = None,
    optimizer_state: list[np.ndarray] | None = None,
    return_optimizer_state: bool = False,
    return_delta: bool = False,
    compression: str | None = None,
    prefetch: int = 2,
    slow_seconds_per_batch: float = 0.0,
    shard: int | None = None,
    topk_ratio: float = 0.01,
) -> dict[str, Any]:
    """Train on the given rows, starting from ``weights`` (or from the run's broadcast variable, :func:`weights_var`).

    ``seeded``, instead of ``indices``: ``(seed, epoch, shares, worker, start, stop)``; the partition is regenerated
    here and rows ``start:stop`` of it are used. ``shard``: with a sharded dataset, which shard the rows index.
    Returns the new weights (or their delta from the start weights), samples trained, the Keras logs and timings.
    """
    session = _session(run_id)
    model = session.model
    t0 = time.perf_counter()
    x, y, indices = _rows(session, indices, seeded, shard)
    if weights is None:
        weights = worker.vars[weights_var(run_id)]
    model.set_weights(weights)
    if optimizer_state is not None:
        _set_optimizer_state(model, optimizer_state)
    model.reset_metrics()
    pipeline = ops.BatchPipeline([x, y], indices, batch_size, prefetch=prefetch)
    logs: dict[str, float] = {}
    preprocess = session.app.preprocess
    if steps_whole_rounds(model):
        # The model's state stays in the framework for the whole round; the logs are read once, at its end.
        stepper = session.steps()
        stepper.begin()
        try:
            for bx, by in pipeline:
                stepper.step(*preprocess(bx, by))
                if slow_seconds_per_batch:
                    time.sleep(slow_seconds_per_batch)
        finally:
            logs = stepper.end()
    else:
        for bx, by in pipeline:
            bx, by = preprocess(bx, by)
            out = model.train_on_batch(bx, by, return_dict=True)
            if slow_seconds_per_batch:
                time.sleep(slow_seconds_per_batch)
            logs = out
    new = model.get_weights()
    stats = pipeline.stats()
    result: dict[str, Any] = {
        "samples": int(stats["rows"]),
        "logs": {k: float(v) for k, v in logs.items()},
        "compute_seconds": time.perf_counter() - t0,
        "data_wait_seconds": float(stats["wait_seconds"]),
    }
    payload = ops.delta(new, weights) if return_delta else new
    if compression in ("float16", "bfloat16"):
        payload = ops.to_half([np.ascontiguousarray(p, dtype=np.float32) for p in payload], compression)
    elif compression == "topk":
        # Error feedback: add what earlier rounds left out, send the largest entries, keep the rest for later.
        delta = [np.ascontiguousarray(p, dtype=np.float32) for p in payload]
        if session.residual is not None:
            ops.axpy_(delta, session.residual)
        sparse = ops.topk(delta, topk_ratio)
        session.residual = ops.delta(delta, ops.densify(sparse, delta))
        payload = sparse
    result["weights"] = payload
    if return_optimizer_state:
        result["optimizer_state"] = _optimizer_state(model)
    session.last_used = time.monotonic()
    return result


def _start_weights(worker: Any, session: Session, run_id: str, round_no: int, fresh: bool) -> list[np.ndarray]:
    """Where an all-reduce round starts: the master's broadcast (``fresh``: a new member), the weights before
    this round (a redo after a failed all-reduce), or the result of the last round reduced here."""
    if fresh:
        return list(worker.vars[weights_var(run_id)])
    reduced = session.reduced
    if reduced is None or reduced[0] not in (round_no, round_no - 1):
        have = "none" if reduced is None else f"round {reduced[0]}"
        raise LookupError(f"run {run_id}: no reduced weights for round {round_no} here (have {have})")
    return reduced[1] if reduced[0] == round_no else reduced[2]


def _reduce_floats(
    arrays: list[np.ndarray], samples: float, spec: dict[str, Any], wire: str | None = None, unit: float = 1.0
) -> list[np.ndarray]:
    """The samples-weighted average over the ring's ranks of every float array: ``sum(samples_i * a_i) /
    sum(samples_i)``. Per float dtype, the arrays are scaled straight into one buffer (the only copy), with the
    sample count as its last element, reduced where it lies, and divided in place; the results are views of it.
    Other arrays (integer step counters) stay as they are here. See :func:`_weighted_mean` for ``wire``."""
    return _weighted_mean(arrays, samples, spec, wire, unit)[0]


def _weighted_mean(
    arrays: list[np.ndarray], samples: float, spec: dict[str, Any], wire: str | None = None, unit: float = 1.0
) -> tuple[list[np.ndarray], float]:
    """:func:`_reduce_floats`, and the ranks' total of ``samples`` (0: no rank had any, and the arrays are
    returned as they were).

    ``wire="float16"|"bfloat16"``: float32 arrays travel at half precision (sums in float32). The weights are then
    ``samples / unit`` (``unit``: the same on every rank, so that a weight is about 1 and a weighted value stays as
    small as the value itself: float16 ends at 65504)."""
    from ..collective import reduce_scratch

    out = list(arrays)
    total = 0.0
    weight = samples / unit
    for kind in (np.float32, np.float64):
        idx = [i for i, a in enumerate(arrays) if a.dtype == kind]
        if not idx:
            continue
        sizes = [arrays[i].size for i in idx]
        flat = np.empty(sum(sizes) + 1, dtype=kind)
        views, at = [], 0
        for i, n in zip(idx, sizes):
            view = flat[at : at + n].reshape(arrays[i].shape)
            np.multiply(arrays[i], kind(weight), out=view)
            views.append(view)
            at += n
        flat[-1] = weight
        reduce_scratch(flat, spec, "sum", wire=wire if kind == np.float32 else None)
        total = float(flat[-1]) * unit
        if total <= 0:
            return list(arrays), 0.0  # no rank trained a row: nothing to average
        flat[:-1] *= kind(1.0 / flat[-1])
        for i, view in zip(idx, views):
            out[i] = view
    return out, total


def train_reduce(
    worker: Any,
    run_id: str,
    indices: np.ndarray | None,
    batch_size: int,
    *,
    round_no: int,
    ring: dict[str, Any],
    fresh: bool = False,
    average_optimizer_state: bool = False,
    compression: str | None = None,
    round_rows: int = 1,
    prefetch: int = 2,
    seeded: Seeded | None = None,
    shard: int | None = None,
    slow_seconds_per_batch: float = 0.0,
    outer: tuple[str, float, float] | None = None,
    adopt_outer: str | None = None,
) -> dict[str, Any]:
    """One synchronous round with ``exchange="allreduce"``: train the rows, then average the weights (weighted by
    the samples each trained) with the round's other workers over the ring, worker to worker. Returns samples,
    logs and timings, never the weights. A failed all-reduce raises ``CollectiveError`` and leaves this worker
    able to redo the round from the weights it started it with.

    ``compression="float16"|"bfloat16"``: the ring averages the float32 *changes* of the round (small values,
    half precision on the wire, sums in float32), weighted by samples over ``round_rows`` (the rows of the whole
    round), and every member adds the same average to the same start. Weights that are not finite after training
    are left out of the average (weight 0) and reported (``nonfinite_weights``).

    ``outer``: ``(name, learning_rate, momentum)`` of the outer optimizer (:mod:`.outer`), applied by every member
    to the same average with the same momentum; ``adopt_outer``: some members are new and first take the momentum
    of the ``"others"`` (the members that are not new), or, all being new, of ``"any"`` member that holds one
    (restored from a checkpoint). A redo of the round starts again from the momentum this worker started it with."""
    from .replies import finite

    session = _session(run_id)
    redo = not fresh and session.reduced is not None and session.reduced[0] == round_no
    start = _start_weights(worker, session, run_id, round_no, fresh)
    held = session.outer is not None and session.outer.momentum is not None
    if outer is not None:
        if session.outer is None:
            session.outer = Nesterov(OuterSpec(*outer))
        session.outer.spec = OuterSpec(*outer)
        if redo:
            session.outer.load(session.outer_start)
        session.outer_start = session.outer.state()
    result = train_chunk(
        worker,
        run_id,
        indices,
        batch_size,
        weights=start,
        seeded=seeded,
        prefetch=prefetch,
        slow_seconds_per_batch=slow_seconds_per_batch,
        shard=shard,
    )
    new = [np.asarray(w) for w in result.pop("weights")]
    samples = int(result["samples"])
    weight = float(samples)
    if not all(finite(w) for w in new):
        # Averaged in, NaN would reach every member: this worker's round is left out.
        log.warning("run %s: non-finite weights after round %d: left out of the average", run_id, round_no)
        new, weight = [np.array(w) for w in start], 0.0
        result["nonfinite_weights"] = True
    if compression is None:
        averaged = _reduce_floats(new, weight, ring)
    else:
        halves = [a.dtype == np.float32 for a in new]
        moved = [np.subtract(a, s) if h else a for a, s, h in zip(new, start, halves)]
        mean = _reduce_floats(moved, weight, ring, wire=compression, unit=max(1, round_rows))
        averaged = [np.add(s, m) if h else m for s, m, h in zip(start, mean, halves)]
        if not all(finite(a) for a in averaged):
            # float16 overflowed on the wire (identically on every member): the round's change is dropped.
            log.warning("run %s: round %d's average overflowed %s: not applied", run_id, round_no, compression)
            averaged = list(start)
            result["wire_overflow_steps"] = 1
    model = session.model
    if session.outer is not None and outer is not None:
        trained = [not m for m in local_mask(model)]
        momentum = session.outer.ensure(averaged, trained)
        if adopt_outer is not None:
            holder = held if adopt_outer == "any" else not fresh
            session.outer.load(_adopt(momentum, holder, ring))
        averaged = session.outer.step(start, averaged, trained)
    if average_optimizer_state and _optimizer_built(model):
        # At full precision: Adam's second moments underflow float16 (and a zero there makes a huge step).
        _set_optimizer_state(model, _reduce_floats(_optimizer_state(model), weight, ring))
    # The model takes the averaged weights when the next round starts from them (train_chunk sets them).
    session.reduced = (round_no, start, averaged)
    session.last_used = time.monotonic()
    return result


def _adopt(state: list[np.ndarray], holder: bool, spec: dict[str, Any]) -> list[np.ndarray]:
    """The optimizer state of the ring's holders (who all hold the same), for every member: a new member (not a
    holder) takes it. Integer arrays (step counters) travel as float64, exactly."""
    wide = [a.astype(np.float64) if a.dtype.kind in "iub" else np.asarray(a) for a in state]
    mean, total = _weighted_mean(wide, 1.0 if holder else 0.0, spec)
    if total <= 0:
        return state
    return [np.rint(m).astype(a.dtype) if a.dtype.kind in "iub" else m for m, a in zip(mean, state)]


def train_gradients(
    worker: Any,
    run_id: str,
    indices: np.ndarray | None,
    batch_size: int,
    *,
    round_no: int,
    ring: dict[str, Any],
    steps: int,
    fresh: bool = False,
    adopt: bool = False,
    learning_rate_factor: tuple[float, float] | None = None,
    compression: str | None = None,
    bucket_cap_mb: float | None = None,
    prefetch: int = 2,
    seeded: Seeded | None = None,
    shard: int | None = None,
    slow_seconds_per_batch: float = 0.0,
) -> dict[str, Any]:
    """One synchronous round with ``averaging="gradients"``: ``steps`` optimizer steps in lockstep with the ring's
    other workers. Each step this worker computes the gradients of its next batch, the ring averages them (weighted
    by each batch's rows; a worker out of batches adds zeros with weight 0), and every worker applies the same
    average with the same optimizer state, so the replicas stay identical. At the end the untrained weights
    (BatchNorm statistics) are averaged too.

    ``adopt``: some members are new (``fresh``): first every member takes the optimizer state of the others.
    ``learning_rate_factor``: ``(first, last)`` multiples of the compiled learning rate, interpolated over the
    steps (the linear warm-up). ``compression="float16"|"bfloat16"``: float32 gradients travel at half precision
    (each weighted by its batch's share of ``batch_size``, so a weighted gradient is no larger than the gradient);
    a step whose average overflowed float16 is skipped on every member alike (``wire_overflow_steps``). A redo of
    a failed round starts again from the weights and optimizer state this worker started it with.
    ``bucket_cap_mb``: where the backend allows (PyTorch), exchange the gradients in buckets of about this size
    while the backward pass runs (:mod:`.buckets`); ``None``: in one buffer after it. Returns samples, logs and
    timings (``reduce_seconds``: the time steps waited for the exchange after their backward), never the
    weights."""
    from .replies import finite

    session = _session(run_id)
    redo = not fresh and session.reduced is not None and session.reduced[0] == round_no
    start = _start_weights(worker, session, run_id, round_no, fresh)
    model = session.model
    stepper = session.steps()
    t0 = time.perf_counter()
    x, y, indices = _rows(session, indices, seeded, shard)
    model.set_weights(start)
    if redo and session.optimizer_start is not None:
        _set_optimizer_state(model, session.optimizer_start)
    if adopt:
        stepper.build_optimizer()
        _set_optimizer_state(model, _adopt(_optimizer_state(model), not fresh, ring))
    session.optimizer_start = _optimizer_state(model) if _optimizer_built(model) else None
    model.reset_metrics()
    stepper.begin()
    pipeline = ops.BatchPipeline([x, y], indices, batch_size, prefetch=prefetch)
    batches = iter(pipeline)
    preprocess = session.app.preprocess
    factor = None
    reduce_s = 0.0
    nonfinite = overflowed = 0
    buckets = stepper.buckets(int(bucket_cap_mb * 2**20)) if bucket_cap_mb else None
    if buckets is not None:
        from ..collective import reduce_scratch

        def reduce(flat: np.ndarray) -> None:
            reduce_scratch(flat, ring, "sum", wire=compression)

    try:
        for step in range(steps):
            if learning_rate_factor is not None:
                first, last = learning_rate_factor
                f = first + (last - first) * step / max(1, steps - 1)
                if f != factor:
                    stepper.set_learning_rate_factor(f)
                    factor = f
            batch = next(batches, None)
            if buckets is not None:
                # Overlapped: the buckets go to the ring while backward runs; only the wait after it counts.
                run, n = None, 0
                if batch is not None:
                    bx, by = preprocess(*batch)
                    n = len(by)

                    def run(bx: Any = bx, by: Any = by) -> None:
                        stepper.backward(bx, by)
                        if slow_seconds_per_batch:
                            time.sleep(slow_seconds_per_batch)

                averaged, totals, bad = buckets.exchange(run, n / batch_size, reduce)
                reduce_s += buckets.waited
                total = max(totals) * batch_size
                if bad:
                    log.warning("run %s: non-finite gradients on a batch of %d rows: left out of the step", run_id, n)
                    nonfinite += 1
            elif batch is None:
                grads, n = stepper.zeros(), 0
            else:
                bx, by = preprocess(*batch)
                grads, n = stepper.gradients(bx, by), len(by)
                if slow_seconds_per_batch:
                    time.sleep(slow_seconds_per_batch)
                if not all(finite(g) for g in grads):
                    # Averaged in, NaN would reach every replica: this batch is left out of the step.
                    log.warning("run %s: non-finite gradients on a batch of %d rows: left out of the step", run_id, n)
                    grads, n = stepper.zeros(), 0
                    nonfinite += 1
            if buckets is None:
                t_reduce = time.perf_counter()
                averaged, total = _weighted_mean(grads, float(n), ring, wire=compression, unit=batch_size)
                reduce_s += time.perf_counter() - t_reduce
            if compression is not None and total > 0 and not all(finite(a) for a in averaged):
                overflowed += 1  # the same bits on every member: all skip this step
                continue
            if total > 0:
                stepper.apply(averaged)
    finally:
        logs = stepper.end()
    stats = pipeline.stats()
    samples = int(stats["rows"])
    new = model.get_weights()
    untrained = [i for i, m in enumerate(local_mask(model)) if m]
    if untrained:
        averaged = _reduce_floats([np.asarray(new[i]) for i in untrained], samples, ring)
        for i, a in zip(untrained, averaged):
            new[i] = a
    session.reduced = (round_no, start, new)
    session.last_used = time.monotonic()
    return {
        "samples": samples,
        "logs": logs,
        "compute_seconds": time.perf_counter() - t0,
        "data_wait_seconds": float(stats["wait_seconds"]),
        "reduce_seconds": reduce_s,
        "steps": steps,
        "nonfinite_batches": nonfinite,
        "wire_overflow_steps": overflowed,
    }


def reduced_weights(run_id: str, round_no: int | None = None) -> list[np.ndarray]:
    """The weights of the last round reduced here (what every member of the ring holds after it)."""
    reduced = _session(run_id).reduced
    if reduced is None or (round_no is not None and reduced[0] != round_no):
        raise LookupError(f"run {run_id}: no reduced weights for round {round_no} here")
    return reduced[2]
