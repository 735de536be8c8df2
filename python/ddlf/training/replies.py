"""What a worker sends back is checked before the master merges it.

A training chunk's reply comes from user code on another host: a bug (a model rebuilt with other layers, a
float64 cast, a diverged optimizer) or a compromised worker can send weights of the wrong count, shapes or dtypes,
non-finite values, top-k indices outside the tensor, or far more data than asked for. Merged as they are, these
crash the master or quietly corrupt every replica. :func:`check_reply` turns a reply into a
:class:`~ddlf.training.run.WorkerResult` only when it is well formed, and raises :class:`~ddlf.errors.BadWorkerReply`
(or :class:`~ddlf.errors.NonFiniteUpdate`) naming the worker and what is wrong otherwise; the loops then leave that
reply out of the round (a warning and a ``reply_refused`` event in ``History.events``), or stop the run when
the run's ``RunConfig(nonfinite="raise")`` and the values were not finite.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import ops
from ..errors import BadWorkerReply, NonFiniteUpdate
from .messages import WorkerResult, finite
from .numerics import decode_payload

HALF = ("float16", "bfloat16")


def check_reply(
    worker: int,
    reply: Any,
    like: Sequence[np.ndarray],
    *,
    rows: int,
    compression: str | None,
    weights_expected: bool = True,
) -> WorkerResult:
    """Check worker ``worker``'s training reply against the weights it trained from (``like``) and the ``rows`` it
    was given. Returns the typed result; its ``payload`` holds the decoded weights (or delta), arrays shaped like
    ``like`` (empty when ``weights_expected`` is false: the workers averaged among themselves)."""

    def bad(reason: str) -> BadWorkerReply:
        return BadWorkerReply(f"worker {worker} sent a malformed training reply: {reason}", worker_id=worker)

    if not isinstance(reply, dict):
        raise bad(f"expected a dict, got {type(reply).__name__}")
    samples = reply.get("samples")
    if not isinstance(samples, (int, np.integer)) or isinstance(samples, bool) or not 0 <= samples <= rows:
        raise bad(f"samples={samples!r}, expected an integer from 0 to the {rows} rows it was given")
    for key in ("compute_seconds", "data_wait_seconds"):
        value = reply.get(key)
        if not isinstance(value, (int, float, np.floating, np.integer)) or not math.isfinite(value) or value < 0:
            raise bad(f"{key}={value!r}, expected a finite number of seconds")
    logs = reply.get("logs", {})
    if not isinstance(logs, dict) or not all(
        isinstance(k, str) and isinstance(v, (int, float, np.floating, np.integer)) for k, v in logs.items()
    ):
        raise bad("logs must map metric names to numbers")
    raw = reply.get("weights", [])
    if not isinstance(raw, (list, tuple)):
        raise bad(f"weights must be a list, got {type(raw).__name__}")
    if not weights_expected:
        if raw:
            raise bad(f"{len(raw)} weight arrays, where the all-reduce leaves none to send")
        decoded: list[np.ndarray] = []
    else:
        decoded = _check_weights(raw, like, compression, bad)
    state = reply.get("optimizer_state")
    if state is not None:
        if not isinstance(state, (list, tuple)) or not all(isinstance(a, np.ndarray) for a in state):
            raise bad("optimizer_state must be a list of arrays")
        if any(a.dtype.kind == "O" for a in state):
            raise bad("optimizer_state holds object arrays")
    result = WorkerResult.from_reply(worker, reply)
    result.payload = decoded
    if not all(finite(a) for a in decoded) or (state is not None and not all(finite(a) for a in state)):
        raise NonFiniteUpdate(
            f"worker {worker} sent non-finite weights (NaN or infinity): its model diverged, or its reply is corrupt",
            worker_id=worker,
        )
    return result


def _check_weights(
    raw: Sequence[Any], like: Sequence[np.ndarray], compression: str | None, bad: Any
) -> list[np.ndarray]:
    if len(raw) != len(like):
        raise bad(f"{len(raw)} weight arrays, expected {len(like)} (the model's)")
    if compression == "topk":
        for j, (item, ref) in enumerate(zip(raw, like)):
            if not (isinstance(item, tuple) and len(item) == 2 and all(isinstance(a, np.ndarray) for a in item)):
                raise bad(f"weight {j}: expected an (indices, values) pair of arrays")
            idx, vals = item
            if idx.dtype.kind not in "iu" or idx.ndim != 1 or vals.ndim != 1 or len(idx) != len(vals):
                raise bad(f"weight {j}: indices must be 1-D integers, as many as the values")
            if vals.dtype != np.float32:
                raise bad(f"weight {j}: top-k values are {vals.dtype}, expected float32")
            if len(idx) > ref.size or (len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= ref.size)):
                raise bad(f"weight {j}: indices outside the tensor's {ref.size} elements")
        return decode_payload(list(raw), list(like))
    for j, (a, ref) in enumerate(zip(raw, like)):
        if not isinstance(a, np.ndarray):
            raise bad(f"weight {j} is a {type(a).__name__}, not an array")
        want = HALF if compression in HALF and not ops.is_counter(ref) else (str(ref.dtype),)
        if compression not in HALF and str(ref.dtype) in HALF:
            want = (str(ref.dtype), "float32")  # a half-precision weight's change travels in float32 (ops.delta)
        if str(a.dtype) not in want:
            raise bad(f"weight {j} is {a.dtype}, expected {' or '.join(want)}")
        if a.shape != ref.shape:
            raise bad(f"weight {j} has shape {a.shape}, expected {ref.shape}")
    if compression in HALF:
        if len({str(a.dtype) for a in raw if not ops.is_counter(a)}) > 1:
            raise bad("half-precision weights of mixed dtypes")
        return decode_payload(list(raw))
    return [np.require(a, requirements="C") for a in raw]


def check_states(results: list[WorkerResult]) -> list[tuple[WorkerResult, str]]:
    """The results whose optimizer state does not match the first one's (count, shapes, dtypes): averaging them
    together is impossible. Returns ``(result, reason)`` for each to refuse."""
    first = next((r.optimizer_state for r in results if r.optimizer_state is not None), None)
    if first is None:
        return []
    shape = [(a.shape, a.dtype) for a in first]
    return [
        (r, f"worker {r.worker} sent an optimizer state shaped unlike the other workers'")
        for r in results
        if r.optimizer_state is None or [(a.shape, a.dtype) for a in r.optimizer_state] != shape
    ]
