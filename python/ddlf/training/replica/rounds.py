"""A round through the master: the worker trains on its rows and returns its weights (or their change)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ... import ops
from ..messages import Seeded, weights_var
from .sessions import Session, _load, _session, _split_xy
from .state import _optimizer_state, _set_optimizer_state
from .steppers import steps_whole_rounds


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
