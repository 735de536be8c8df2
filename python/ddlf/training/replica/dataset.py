"""A replica's dataset: the app's (or one shard of it) through the worker's store, as
:class:`~ddlf.data.structure.Parts`, and a round's batches from it (:class:`Feed`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ... import ops
from ...data.store import STORE
from ...data.structure import Parts, as_arrays, class_weights, rows_of
from ...errors import DatasetError
from ..messages import FitData


def shard_key(app: Any, shard: int, n_shards: int) -> str:
    """Store key of one shard of a sharded dataset."""
    return f"{app.dataset_key}/shard-{shard}-of-{n_shards}"


def load(app: Any, identity: bytes, shard: int | None, n_shards: int) -> tuple[Any, bool]:
    """The app's dataset (or one shard of it) through the worker's store, and whether it was cached; ``identity``,
    the digest of the app as received, names the host's copy (no second pickle of the app here)."""
    if shard is None:
        return STORE.get_or_load(app.dataset_key, lambda: as_arrays(app.load_dataset()), identity=identity)
    return STORE.get_or_load(
        shard_key(app, shard, n_shards),
        lambda: as_arrays(app.load_shard(shard, n_shards)),
        shard=(shard, n_shards),
        identity=identity,
    )


def parts_of(value: Any, fit: FitData) -> Parts:
    """The parts of what the loader returned, with ``train(sample_weight=array)`` as their sample weights."""
    parts = Parts.loaded(value)
    if fit.sample_weight is not None and not callable(fit.sample_weight):
        parts = parts.with_sample_weight(fit.sample_weight)
    if parts.specs[1] is None:
        raise DatasetError("the dataset has no y: load_dataset must return (x, y) (a model trains against targets)")
    if fit.class_weight is not None and parts.specs[1] != "leaf":
        raise DatasetError(
            "class_weight needs a single array of labels y (as in fit: models with one output); for several "
            "outputs give sample_weight instead"
        )
    return parts


def training_rows(rows: int, fit: FitData) -> int:
    """The rows that train: all but the last ``validation_split`` share (``fit``'s split: before shuffling)."""
    if not fit.validation_split:
        return rows
    split_at = int(np.floor(rows * (1.0 - fit.validation_split)))
    if split_at in (0, rows):
        raise DatasetError(
            f"validation_split={fit.validation_split} leaves {'no' if split_at == 0 else 'all'} of the "
            f"{rows} rows for training: choose a share that splits them"
        )
    return split_at


Batch = tuple[Any, Any, Any, int]
"""``(x, y, sample_weight, rows)`` of one batch, ready for the model (after the app's ``preprocess``)."""


class Feed:
    """A round's batches: the rows gathered by the Rust pipeline (one pass over every array of the dataset, ahead on
    a thread, or a small round's on the training thread: :class:`ddlf.ops.BatchPipeline`), put back into the
    dataset's structure, preprocessed by the app, with their sample weights (from the loader, an
    array, ``class_weight`` or a function of the batch)."""

    def __init__(
        self,
        parts: Parts,
        indices: np.ndarray,
        batch_size: int,
        prefetch: int,
        preprocess: Callable[[Any, Any], tuple[Any, Any]],
        fit: FitData,
    ) -> None:
        self.parts = parts
        self.pipeline = ops.BatchPipeline(parts.leaves, indices, batch_size, prefetch=prefetch)
        self.preprocess = preprocess
        self.fit = fit

    def __iter__(self) -> Iterator[Batch]:
        parts, preprocess, fit = self.parts, self.preprocess, self.fit
        weigh = fit.class_weight is not None or callable(fit.sample_weight)
        for raw in self.pipeline:
            x, y, sw = parts.pack(raw)
            if weigh:
                sw = (
                    class_weights(y, fit.class_weight)
                    if fit.class_weight is not None
                    else np.asarray(fit.sample_weight(x, y), dtype=np.float32)
                )
            n = rows_of(x)
            if sw is not None and np.shape(sw)[:1] != (n,):
                raise DatasetError(
                    f"sample_weight(x, y) returned weights of shape {np.shape(sw)} for a batch of {n} rows: "
                    "give one weight per row"
                )
            x, y = preprocess(x, y)
            yield x, y, sw, n

    def stats(self) -> dict[str, Any]:
        """The pipeline's counters: rows gathered, seconds waited for data."""
        return self.pipeline.stats()


def first_batch(parts: Parts, preprocess: Callable[[Any, Any], tuple[Any, Any]], rows: int = 2) -> tuple[Any, Any]:
    """``(x, y)`` of the dataset's first ``rows`` rows, after ``preprocess`` (None: the dataset has no rows): what a
    model that ``fit`` builds on its first batch is built from, and what :func:`check_model_data` reads."""
    n = min(rows, parts.rows)
    if n == 0:
        return None, None
    feed = Feed(parts, np.arange(n, dtype=np.uint32), n, 1, preprocess, FitData())
    x, y, _sw, _n = next(iter(feed))
    return x, y


def check_model_data(x: Any, y: Any, preprocessed: bool) -> None:
    """Refuse, before any round, a batch a model cannot take (``fit`` refuses it too, with a backend's error on
    the first step): strings or Python objects in ``x`` or ``y``, named, with what to return instead."""
    for part, value in (("x", x), ("y", y)):
        for where, leaf in _named_leaves(value, part):
            dtype = getattr(leaf, "dtype", None)
            if dtype is None or np.dtype(dtype).kind not in "USO":
                continue
            what = "strings" if np.dtype(dtype).kind in "US" else "Python objects"
            source = "preprocess() returned" if preprocessed else "load_dataset returned"
            raise DatasetError(
                f"{where} as {source} holds {what} (dtype {np.dtype(dtype)}): a model trains on numbers. Turn them "
                "into numbers in load_dataset or preprocess: text as integer token ids (keras.layers.TextVectorization "
                "or StringLookup, adapted, applied to the data rather than inside the model), categories as ids or "
                "one-hot arrays"
            )


def _named_leaves(value: Any, where: str) -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in _named_leaves(v, f"{where}[{k!r}]")]
    if isinstance(value, (tuple, list)):
        return [leaf for i, v in enumerate(value) for leaf in _named_leaves(v, f"{where}[{i}]")]
    return [(where, value)] if value is not None else []
