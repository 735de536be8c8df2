"""A round through the master: the worker trains on its rows and returns its weights (or their change)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ... import ops
from ..messages import MasterRound, weights_var
from .state import MetricSum, keras_metrics, optimizer_state, set_optimizer_state, take_round_rates
from .steppers import steps_whole_rounds

if TYPE_CHECKING:
    from .session import Session


def train_chunk(session: Session, worker: Any, spec: MasterRound) -> dict[str, Any]:
    """Train on the round's rows, starting from ``spec.weights`` (or from the run's broadcast variable,
    :func:`~..messages.weights_var`). Returns the new weights (or their change from the start, ``return_delta``:
    at half precision, or its top-k with error feedback, as ``spec.compression`` says), samples trained, the Keras
    logs and timings, and with ``return_optimizer_state`` the optimizer state."""
    model = session.model
    t0 = time.perf_counter()
    feed = session.feed(spec.rows, spec.batch_size, spec.prefetch)
    weights = spec.weights if spec.weights is not None else worker.vars[weights_var(spec.run_id)]
    logs: dict[str, float] = {}
    stepper = session.steps() if steps_whole_rounds(model) else None
    # The optimizer's state, then the rate (one of its variables), then the weights: a stepper's round state reads
    # every variable as it starts.
    if spec.optimizer_state is not None:
        set_optimizer_state(model, spec.optimizer_state)
    take_round_rates(model, session.stepper, spec)
    if stepper is not None:
        # The model's state stays in the framework for the whole round, from the weights to the logs (read once).
        stepper.start(weights)
        try:
            for bx, by, sw, _n in feed:
                stepper.step(bx, by, sw)
                if spec.slow_seconds_per_batch:
                    time.sleep(spec.slow_seconds_per_batch)
        finally:
            logs = stepper.end()
    else:
        model.set_weights(weights)
        model.reset_metrics()
        # Keras's train_on_batch starts each batch from reset metrics: their states are added up for the
        # round's logs (fit's running values). A TorchModel's logs run from its last reset_metrics.
        total = MetricSum(model) if keras_metrics(model) else None
        for bx, by, sw, _n in feed:
            if total is not None:
                total.begin()
            if sw is None:  # a TorchModel takes no sample weights
                out = model.train_on_batch(bx, by, return_dict=True)
            else:
                out = model.train_on_batch(bx, by, sample_weight=sw, return_dict=True)
            if total is not None:
                total.add()
            if spec.slow_seconds_per_batch:
                time.sleep(spec.slow_seconds_per_batch)
            logs = out
        if total is not None:
            logs = total.results()
    # (a 0-d weight may come back from get_weights as a numpy scalar)
    new = stepper.weights() if stepper is not None else [np.asarray(w) for w in model.get_weights()]
    stats = feed.stats()
    result: dict[str, Any] = {
        "samples": int(stats["rows"]),
        "logs": {k: float(v) for k, v in logs.items()},
        "compute_seconds": time.perf_counter() - t0,
        "data_wait_seconds": float(stats["wait_seconds"]),
    }
    payload: list[Any] = ops.delta(new, weights) if spec.return_delta else new
    if spec.compression in ("float16", "bfloat16"):
        floats = [i for i, p in enumerate(payload) if not ops.is_counter(p)]  # counters travel as they are
        halves = ops.to_half(
            [np.require(payload[i], dtype=np.float32, requirements="C") for i in floats], spec.compression
        )
        payload = list(payload)
        for i, h in zip(floats, halves):
            payload[i] = h
    elif spec.compression == "topk":
        # Error feedback: add what earlier rounds left out, send the largest entries, keep the rest for later.
        delta = [np.require(p, dtype=np.float32, requirements="C") for p in payload]
        if session.residual is not None:
            ops.axpy_(delta, session.residual)
        sparse = ops.topk(delta, spec.topk_ratio)
        session.residual = ops.delta(delta, ops.densify(sparse, delta))
        payload = sparse
    result["weights"] = payload
    if spec.return_optimizer_state:
        result["optimizer_state"] = optimizer_state(model)
    session.last_used = time.monotonic()
    return result
