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

from ...data.store import STORE
from ...errors import TooManyRuns
from ...frameworks.keras_backend import follow_keras_backend, keras_backend_default
from ...frameworks.seeding import set_random_seed
from ..messages import weights_var
from ..outer import OuterMomentum
from . import warm
from .steppers import stepper_for


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
    # the ring exchange: (round, weights before it, weights after it) of the last round reduced here
    reduced: tuple[int, list[np.ndarray], list[np.ndarray]] | None = None
    # the model's training step (training.gradients), made on first use; and, with gradient averaging, the
    # optimizer state the last round started from
    stepper: Any = None
    optimizer_start: list[np.ndarray] | None = None
    # the ring exchange with an outer optimizer: its momentum, and the momentum the last round started from
    outer: OuterMomentum | None = None
    outer_start: list[np.ndarray] | None = None
    # what identifies the model's architecture among kept warm models (training.warm); None: not kept
    warm_key: str | None = None

    def steps(self) -> Any:
        """The model's :class:`~ddlf.training.replica.steppers.Stepper` (traced or jitted once per run)."""
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


log = logging.getLogger("ddlf.training")


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


_report_runs: Callable[[list[str]], None] = _no_report


def configure(
    *,
    max_runs: int | None = None,
    idle_seconds: float | None = None,
    report_runs: Callable[[list[str]], None] | None = None,
) -> None:
    """Set by the daemon that hosts the replicas (``ddlf-worker``): its limits on runs (``--max-runs``,
    ``--run-idle-timeout``), and ``report_runs``, where the list of runs goes whenever it changes (the daemon's
    status, answered without this interpreter)."""
    global _report_runs
    if max_runs is not None:
        LIMITS.max_runs = max_runs
    if idle_seconds is not None:
        LIMITS.idle_seconds = idle_seconds
    if report_runs is not None:
        _report_runs = report_runs


def _publish() -> None:
    _report_runs([f"{rid} {type(s.app).__name__}" for rid, s in sorted(_SESSIONS.items())])


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
    :func:`~ddlf.frameworks.seeding.uses_torch`)."""
    import cloudpickle

    if torch:
        from ...frameworks.loading import load_torch_compiler_first

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
