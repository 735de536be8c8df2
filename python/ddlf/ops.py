"""Rust kernels for weight lists and index handling. Each releases the GIL and splits large arrays across cores.

Weight lists are sequences of float32/float64 numpy arrays (any shapes, C-contiguous), as returned by
``model.get_weights()``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from . import _ddlf
from .errors import ConfigError

BatchPipeline = _ddlf.BatchPipeline


def _vectors(arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The arrays as the kernels take them: a 0-d array (an optimizer's step counter, a learning rate) exports no
    buffer shape, so it goes as a 1-element view of the same memory (written through by the in-place kernels)."""
    return [np.reshape(a, -1) if np.ndim(a) == 0 else a for a in arrays]


def _shaped(out: list[np.ndarray], like: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Kernel results with the 0-d arrays of ``like`` made 0-d again."""
    return [o.reshape(()) if np.ndim(a) == 0 else o for o, a in zip(out, like)]


def is_half(a: np.ndarray) -> bool:
    """Whether ``a`` holds float16 or bfloat16 values (Keras' ``"float16"``/``"bfloat16"`` variables)."""
    dtype = a.dtype
    # itemsize first: str(dtype) costs about 3 us, and every averaging round asks this of every array
    return dtype.itemsize == 2 and str(dtype) in ("float16", "bfloat16")


def is_counter(a: np.ndarray) -> bool:
    """Whether ``a`` holds integers (a layer's step or row counter, an optimizer's iteration count): such arrays
    are never averaged; what the kernels below do with them is said in each."""
    return np.asarray(a).dtype.kind in "iu"


def add_counter_changes(
    merged: list[np.ndarray], start: Sequence[np.ndarray], news: Sequence[Sequence[np.ndarray]]
) -> None:
    """In place: each integer array of ``merged`` becomes ``start`` plus the sum of every replica's change
    (``news[k] - start``): counters count what all replicas did, as one process counts every step."""
    for i, s in enumerate(start):
        if is_counter(s):
            merged[i] = np.asarray(s + sum(np.asarray(n[i]) - s for n in news)).astype(s.dtype)


def weighted_average(lists: Sequence[Sequence[np.ndarray]], weights: Sequence[float] | None = None) -> list[np.ndarray]:
    """``sum_i weights[i] * lists[i] / sum(weights)``, array by array (equal weights by default). Half-precision
    arrays (float16, bfloat16) are averaged in float32 and returned in their own dtype; integer arrays are not
    averaged: the result holds the first list's (:func:`add_counter_changes` sums their changes instead)."""
    if not lists:
        return _ddlf.weighted_average([], None)
    like = lists[0]
    counters = [i for i, a in enumerate(like) if is_counter(a)]
    if counters:  # integers are not averaged: the first list's, here (see add_counter_changes)
        for lst in lists:
            if len(lst) != len(like):
                raise ConfigError(f"weighted_average: lists of {len(like)} and {len(lst)} arrays")
            for i in counters:
                if np.shape(lst[i]) != np.shape(like[i]):
                    raise ConfigError(
                        f"weighted_average: array {i} has shape {np.shape(lst[i])} and {np.shape(like[i])}"
                    )
        floats = [i for i in range(len(like)) if i not in counters]
        part = weighted_average([[lst[i] for i in floats] for lst in lists], weights) if floats else []
        out_all = [np.array(a) for a in like]
        for i, a in zip(floats, part):
            out_all[i] = a
        return out_all
    half = [i for i, a in enumerate(like) if is_half(a)]
    if half:
        lists = [[np.asarray(a, np.float32) if i in half else a for i, a in enumerate(lst)] for lst in lists]
    out = _ddlf.weighted_average(
        [_vectors(lst) for lst in lists], None if weights is None else [float(w) for w in weights]
    )
    out = _shaped(out, like)
    for i in half:
        out[i] = out[i].astype(like[i].dtype)
    return out


def axpy_(weights: Sequence[np.ndarray], delta: Sequence[np.ndarray], alpha: float = 1.0) -> None:
    """In place: ``weights[i] += alpha * delta[i]`` (a half-precision weight computed in float32, then rounded;
    an integer counter takes its whole change, unscaled)."""
    if len(weights) != len(delta):
        raise ConfigError(f"axpy_: {len(weights)} weights but {len(delta)} deltas: one per weight")
    for i, w in enumerate(weights):
        if is_counter(w):
            w[...] = w + np.asarray(delta[i]).astype(w.dtype)
    half = {i for i, w in enumerate(weights) if is_half(w)}
    skip = half | {i for i, w in enumerate(weights) if is_counter(w)}
    pairs = [(w, d) for i, (w, d) in enumerate(zip(weights, delta)) if i not in skip]
    if pairs:
        _ddlf.axpy_(_vectors([w for w, _ in pairs]), _vectors([d for _, d in pairs]), float(alpha))
    for i in half:
        w = weights[i]
        w[...] = (w.astype(np.float32) + np.float32(alpha) * np.asarray(delta[i], np.float32)).astype(w.dtype)


def delta(new: Sequence[np.ndarray], old: Sequence[np.ndarray]) -> list[np.ndarray]:
    """``new[i] - old[i]`` for every array (for half-precision ones, in float32: a change of a float16 weight is
    often below float16's resolution at that weight's size; integer counters in their own dtype)."""
    if len(new) != len(old):
        raise ConfigError(f"delta: {len(new)} new arrays but {len(old)} old ones: one per array")
    counters = [i for i, a in enumerate(new) if is_counter(a)]
    if counters:
        floats = [i for i in range(len(new)) if i not in counters]
        part = delta([new[i] for i in floats], [old[i] for i in floats]) if floats else []
        out: list[np.ndarray] = [np.asarray(np.subtract(np.asarray(n), np.asarray(o))) for n, o in zip(new, old)]
        for i, a in zip(floats, part):
            out[i] = a
        return out
    half = {i for i, a in enumerate(new) if is_half(a)}
    if not half:
        return _shaped(_ddlf.delta(_vectors(new), _vectors(old)), new)
    wide_new = [np.asarray(a, np.float32) if i in half else a for i, a in enumerate(new)]
    wide_old = [np.asarray(a, np.float32) if i in half else a for i, a in enumerate(old)]
    return _shaped(_ddlf.delta(_vectors(wide_new), _vectors(wide_old)), new)


def to_half(arrays: Sequence[np.ndarray], dtype: str = "float16") -> list[np.ndarray]:
    """float32 arrays to ``"float16"`` or ``"bfloat16"`` (halves the bytes on the wire)."""
    return _shaped(_ddlf.to_half(_vectors(arrays), dtype), arrays)


def from_half(arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """float16/bfloat16 arrays back to float32."""
    flags = [str(a.dtype) == "bfloat16" for a in arrays]
    views = [a.view(np.uint16) if bf else a for a, bf in zip(arrays, flags)]
    return _shaped(_ddlf.from_half(_vectors(views), flags), arrays)


def topk(arrays: Sequence[np.ndarray], ratio: float) -> list[tuple[np.ndarray, np.ndarray]]:
    """Top-k sparsification of float32 arrays: for each, ``(indices, values)`` of the ``ratio`` share of entries
    with the largest magnitude (indices into the flattened array, ascending)."""
    return _ddlf.topk(_vectors([np.require(a, requirements="C") for a in arrays]), float(ratio))


def densify(sparse: Sequence[tuple[np.ndarray, np.ndarray]], like: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Dense float32 arrays shaped like ``like`` from :func:`topk` output (zeros elsewhere)."""
    out = []
    for (idx, vals), ref in zip(sparse, like):
        dense = np.zeros(ref.size, dtype=np.float32)
        dense[idx] = vals
        out.append(dense.reshape(ref.shape))
    return out


def permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """The seeded permutation of ``range(n)`` for ``(seed, epoch)`` (uint32), identical on every machine."""
    return _ddlf.permutation(int(n), int(seed), int(epoch))


def partitions(n: int, seed: int, epoch: int, shares: Sequence[float]) -> list[np.ndarray]:
    """Each worker's indices for one epoch: a seeded permutation split in proportion to ``shares``
    (equal shares: sizes differ by at most one; every sample is assigned)."""
    return _ddlf.partitions(int(n), int(seed), int(epoch), [float(s) for s in shares])


def split_sizes(n: int, shares: Sequence[float]) -> list[int]:
    """The sizes :func:`partitions` gives each worker, without drawing the permutation."""
    return _ddlf.split_sizes(int(n), [float(s) for s in shares])


def partition_for(n: int, seed: int, epoch: int, shares: Sequence[float], worker: int) -> np.ndarray:
    """Worker ``worker``'s partition, regenerated locally from the same inputs as :func:`partitions`."""
    return _ddlf.partition_for(int(n), int(seed), int(epoch), [float(s) for s in shares], int(worker))


def gather(array: np.ndarray, indices: np.ndarray | Sequence[int]) -> np.ndarray:
    """``array[indices]`` along the first axis, gathered in Rust into a new contiguous array."""
    if np.ndim(array) == 0:
        raise ConfigError("gather needs an array with at least one axis (rows to gather), got a 0-d array")
    return _ddlf.gather(array, indices)


def decode_images(images: object, indices: np.ndarray | Sequence[int], threads: int | None = None) -> np.ndarray:
    """The encoded images (:class:`ddlf.datasets.EncodedImages`) at ``indices``, decoded and resized in Rust
    without the GIL: ``uint8``, ``(len(indices), height, width, channels)``."""
    return _ddlf.decode_images(images, indices, threads)


__all__ = [
    "BatchPipeline",
    "axpy_",
    "decode_images",
    "delta",
    "densify",
    "from_half",
    "gather",
    "partition_for",
    "partitions",
    "permutation",
    "split_sizes",
    "to_half",
    "topk",
    "weighted_average",
]
