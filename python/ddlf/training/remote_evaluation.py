"""Evaluation and prediction on the workers, over the data they hold (the master's side of
:mod:`ddlf.training.replica.evaluation`): ``validation_split``'s held-out rows after an epoch, and ``app.evaluate()``
/ ``app.predict()`` without arrays.

Each worker takes a contiguous part of the rows and the master's weights; Keras metrics come back as their state,
added up here and turned into results on one worker, so the numbers are those of ``evaluate`` over all the rows
in one process (see the replica's module for which metrics).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..data.structure import concatenate_rows
from . import replica as remote


def contiguous_parts(start: int, stop: int, n: int, batch_size: int = 1) -> list[tuple[int, int]]:
    """``[start, stop)`` cut into ``n`` contiguous parts, in order, each a whole number of ``batch_size`` batches
    (but the last): the batches are those one process makes, so metrics that count batches rather than rows (a
    multi-output model's per-output losses) come out as in ``evaluate``. Part sizes differ by at most a batch."""
    batches = -(-max(0, stop - start) // batch_size)
    base, extra = divmod(batches, max(1, n))
    out, lo = [], start
    for i in range(n):
        hi = min(stop, lo + (base + (1 if i < extra else 0)) * batch_size)
        out.append((lo, hi))
        lo = hi
    return out


def merge_evaluations(cluster: Any, run_id: str, workers: list[int], outs: list[dict[str, Any]]) -> dict[str, float]:
    """One set of results from the workers' :func:`~.replica.evaluate` replies: Keras metric states added up
    and turned into results on a worker that replied; a TorchModel's logs averaged by rows."""
    replied = [(w, o) for w, o in zip(workers, outs) if o["rows"]]
    if not replied:
        return {}
    states = [o["state"] for _, o in replied if "state" in o]
    if states:
        summed = [np.sum([s[i] for s in states], axis=0) for i in range(len(states[0]))]
        return dict(cluster.call(remote.metric_results, (run_id, summed), workers=[replied[0][0]])[0])
    total = sum(o["rows"] for _, o in replied)
    # In the model's order (loss first, as evaluate lists them): `loss, acc = app.evaluate()` unpacks them.
    keys = list(dict.fromkeys(k for _, o in replied for k in o["logs"]))
    return {k: sum(o["logs"].get(k, 0.0) * o["rows"] for _, o in replied) / total for k in keys}


def evaluate_on_workers(
    cluster: Any,
    run_id: str,
    workers: list[int],
    weights: list[np.ndarray] | None,
    parts: list[tuple[int, int] | None],
    batch_size: int,
) -> dict[str, float]:
    """Evaluate ``weights`` on rows ``parts[i]`` of worker ``workers[i]`` (None: its held-out validation rows)."""
    args = [(run_id, weights, part, batch_size) for part in parts]
    outs = cluster.run_each(remote.evaluate, args, workers=workers)
    return merge_evaluations(cluster, run_id, workers, outs)


def predict_on_workers(
    cluster: Any,
    run_id: str,
    workers: list[int],
    weights: list[np.ndarray] | None,
    parts: list[tuple[int, int]],
    batch_size: int,
) -> Any:
    """Predictions for rows ``parts[i]`` of worker ``workers[i]``, concatenated in order."""
    args = [(run_id, weights, part, batch_size) for part in parts]
    outs = cluster.run_each(remote.predict, args, workers=workers)
    return concatenate_rows([o for o, (lo, hi) in zip(outs, parts) if hi > lo])
