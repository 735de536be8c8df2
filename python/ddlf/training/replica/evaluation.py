"""Evaluation and prediction on a worker, over the rows it holds: ``validation_split``'s held-out rows after each
epoch, ``app.evaluate()`` and ``app.predict()`` over the cached dataset.

The replica's model takes the weights the master sends for the call and gives its own back afterwards (a round on
the ring starts from the weights this worker holds). Keras metrics come back as their *state* (a Mean's total and
count, AUC's confusion counts), which the master adds up over the workers and turns into results on one of them
(:func:`metric_results`): the same numbers ``evaluate`` gives over all the rows in one process, for every metric whose
state adds up over rows, as all of Keras' built-in ones do.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from ...data.structure import concatenate_rows
from ...frameworks.adapter import adapter_for
from .dataset import Feed
from .state import MetricSum, keras_metrics
from .state import metric_results as state_results

if TYPE_CHECKING:
    from .session import Session


def _rows(session: Session, part: tuple[int, int] | None) -> np.ndarray:
    """Row indices of ``part`` (``None``: the rows ``validation_split`` holds out here)."""
    start, stop = part if part is not None else (session.rows, session.parts.rows)
    return np.arange(start, stop, dtype=np.uint32)


class _Weights:
    """The master's ``weights`` in the replica's model for the duration of a call, its own put back after."""

    def __init__(self, model: Any, weights: list[np.ndarray] | None) -> None:
        self.model, self.weights, self.saved = model, weights, None

    def __enter__(self) -> None:
        if self.weights is not None:
            self.saved = self.model.get_weights()
            self.model.set_weights(self.weights)

    def __exit__(self, *exc: object) -> None:
        if self.saved is not None:
            self.model.set_weights(self.saved)


def evaluate(
    session: Session, weights: list[np.ndarray] | None, part: tuple[int, int] | None, batch_size: int
) -> dict[str, Any]:
    """Evaluate ``weights`` on rows ``part`` of this worker's dataset (the app's ``preprocess`` applied, the
    loader's sample weights counted, ``class_weight`` not: as ``fit`` validates). Returns the rows and, for a
    Keras model, its metric state (``state``); for a :class:`~ddlf.models.TorchModel`, its logs (``logs``), which the
    master averages by rows."""
    model, indices = session.model, _rows(session, part)
    if not len(indices):
        return {"rows": 0}
    fit = dataclasses.replace(session.fit, class_weight=None)
    feed = Feed(session.parts, indices, batch_size, 2, session.app.preprocess, fit)
    with _Weights(model, weights):
        if not keras_metrics(model):
            seen, sums = 0, dict[str, float]()
            for x, y, _sw, n in feed:
                logs = model.evaluate(x, y, batch_size=batch_size, return_dict=True)
                for k, v in logs.items():
                    sums[k] = sums.get(k, 0.0) + float(v) * n
                seen += n
            return {"rows": seen, "logs": {k: v / seen for k, v in sums.items()}}
        # test_on_batch starts each batch from reset metrics: the batches' states are added up instead.
        seen, total = 0, MetricSum(model)
        for x, y, sw, n in feed:
            total.begin()
            model.test_on_batch(x, y, sample_weight=sw)
            total.add()
            seen += n
        model.reset_metrics()
    return {"rows": seen, "state": total.state}


def metric_results(session: Session, state: list[np.ndarray]) -> dict[str, float]:
    """The metrics' results for ``state`` (the workers' metric states added up)."""
    out = state_results(session.model, state)
    session.model.reset_metrics()
    return out


def metric_directions(session: Session) -> dict[str, str]:
    """Each compiled metric's name and whether higher is better (``"up"``/``"down"``: Keras' ``_direction``), read
    off this worker's model, whose metrics its steps built (the master's never ran a step)."""
    out: dict[str, str] = {}
    for holder in getattr(session.model, "metrics", None) or []:
        for m in getattr(holder, "metrics", None) or []:  # CompileMetrics and MetricsList hold the metrics
            direction = getattr(m, "_direction", None)
            if direction in ("up", "down"):
                out[m.name] = direction
    return out


def predict(
    session: Session, weights: list[np.ndarray] | None, part: tuple[int, int], batch_size: int
) -> list[np.ndarray] | Any:
    """The model's predictions for rows ``part`` of this worker's dataset (the app's ``preprocess`` applied), in
    row order: an array, or the model's structure of them (a multi-output model)."""
    model, indices = session.model, _rows(session, part)
    fit = dataclasses.replace(session.fit, class_weight=None, sample_weight=None)
    outputs: list[Any] = []
    adapter = adapter_for(model)
    with _Weights(model, weights):
        for x, _y, _sw, _n in Feed(session.parts, indices, batch_size, 2, session.app.preprocess, fit):
            outputs.append(adapter.predict_on_batch(x))
    return concatenate_rows(outputs)
