"""Batches for a local loop (evaluation on the master), decoding encoded images batch by batch."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np


def batches(
    arrays: Any,
    indices: Any = None,
    batch_size: int = 32,
    *,
    prefetch: int = 2,
    epochs: int | None = 1,
    seed: int | None = None,
    preprocess: Callable[..., Any] | None = None,
) -> Iterator[Any]:
    """Batches of ``arrays`` (one array or a tuple with the same number of rows), gathered in Rust and prefetched
    by a background thread (an epoch of at most 1 MiB of rows in memory: gathered as each batch is asked for):
    usable in a plain loop or as ``model.fit(ddlf.datasets.batches(...), steps_per_epoch=...)``.

    ``indices``: the rows to visit (default: all, in order). ``seed``: reshuffle them each epoch (seeded
    permutation of ``indices``). ``epochs=None`` repeats forever (what Keras expects from a generator).
    ``preprocess(*batch)`` turns each raw batch into model inputs.
    """
    from .. import ops

    arrays = list(arrays) if isinstance(arrays, (tuple, list)) else [arrays]
    # Indices go to the pipeline as given: it refuses non-integers and rows out of range (a cast here would wrap).
    idx = np.arange(len(arrays[0]), dtype=np.uint32) if indices is None else np.asarray(indices)
    epoch = 0
    while epochs is None or epoch < epochs:
        order = idx if seed is None else idx[ops.permutation(len(idx), seed, epoch)]
        for batch in ops.BatchPipeline(arrays, order, batch_size, prefetch=prefetch):
            if preprocess is not None:
                batch = preprocess(*batch) if isinstance(batch, tuple) else preprocess(batch)
            yield batch
        epoch += 1
