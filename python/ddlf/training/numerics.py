"""Array helpers of the master's loops: sizes, decoding what workers send, averaging optimizer states."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import ops


def nbytes(arrays: Any) -> int:
    """Bytes of the arrays in a (nested) list/tuple/dict."""
    if isinstance(arrays, np.ndarray):
        return arrays.nbytes
    if isinstance(arrays, dict):
        return sum(nbytes(v) for v in arrays.values())
    if isinstance(arrays, (list, tuple)):
        return sum(nbytes(v) for v in arrays)
    return 0


def decode_payload(arrays: list[Any], like: list[np.ndarray] | None = None) -> list[np.ndarray]:
    """Decode what a worker sent: half-precision arrays to float32, top-k ``(indices, values)`` pairs to dense
    arrays shaped like ``like``; anything else passes through."""
    if arrays and isinstance(arrays[0], tuple):
        return ops.densify(arrays, like if like is not None else [])
    half = [i for i, a in enumerate(arrays) if ops.is_half(a)]
    if half:  # integer counters travel as they are, beside the half-precision floats
        wide = ops.from_half([arrays[i] for i in half])
        out = list(arrays)
        for i, a in zip(half, wide):
            out[i] = a
        return out
    return arrays


def average_states(states: list[list[np.ndarray]], weights: list[float]) -> list[np.ndarray]:
    """Average optimizer states: float arrays weighted, integer ones (step counters) from the first worker."""
    out = []
    for j in range(len(states[0])):
        arrays = [s[j] for s in states]
        if arrays[0].dtype.kind == "f" and arrays[0].dtype.itemsize in (4, 8):
            out.append(ops.weighted_average([[np.require(a, requirements="C")] for a in arrays], weights)[0])
        else:
            out.append(np.array(arrays[0]))
    return out
