"""A dataset's parts as ``fit`` takes them, and the flat list of row-aligned arrays the batch pipeline gathers.

``load_dataset`` returns ``(x, y)``, ``(x, y, sample_weight)`` or ``{"x": ..., "y": ..., "sample_weight": ...}``;
``x`` and ``y`` may each be an array, a dict of named arrays (a functional model's named inputs or outputs), a
tuple or list of arrays, or a pandas DataFrame or Series (converted as ``fit`` converts them: to their numpy
values). :class:`Parts` flattens them into *leaves*, the arrays the Rust pipeline gathers rows from (one pass,
every leaf the same rows), and :meth:`Parts.pack` puts each gathered batch back into the same structure. A plain
``(array, array)`` dataset stays two leaves and packs with no work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import DatasetError

Spec = Any
"""The shape of one part: ``None`` (absent), ``"leaf"``, ``("dict", keys, specs)`` or ``("tuple"|"list", specs)``."""


def _is_pandas(value: Any) -> bool:
    module = type(value).__module__
    return module.startswith("pandas.") and type(value).__name__ in ("DataFrame", "Series")


def is_array_like(value: list[Any] | tuple[Any, ...]) -> bool:
    """Whether a list or tuple is one array's rows (numbers, strings or nested lists of them: ``x.tolist()``), as
    ``np.asarray`` takes it, rather than several arrays (a model's inputs: arrays, frames, dicts)."""
    return bool(value) and all(
        isinstance(v, (int, float, complex, str, bytes, np.generic, list, tuple)) for v in value[:64]
    )


def as_arrays(value: Any) -> Any:
    """What ``load_dataset`` returned, each part's array-likes as numpy arrays, as ``fit`` converts them: pandas
    DataFrames and Series to their values, lists of numbers (``x.tolist()``) through ``np.asarray``; the
    structure (``(x, y)``, dicts of named inputs, lists of arrays) kept; arrays not in C order (pandas' values are
    often in Fortran order) copied into it, as the batch pipeline reads rows. Converted once, when the worker loads
    the dataset (so the host's one copy holds such arrays, and no round copies them again)."""
    if isinstance(value, dict):
        return {k: _arrayed(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)) and len(value) in (2, 3):
        return type(value)(_arrayed(v) for v in value)
    return value


def _arrayed(part: Any) -> Any:
    if _is_pandas(part):
        part = part.to_numpy()
    if isinstance(part, np.ndarray):
        return _c_ordered(part)
    if isinstance(part, dict):
        return {k: _arrayed(v) for k, v in part.items()}
    if isinstance(part, (tuple, list)):
        if is_array_like(part):
            return np.asarray(part)
        return type(part)(_arrayed(v) for v in part)
    return part


def _leaf(value: Any, where: str) -> Any:
    """One array of a part, as the pipeline takes it: numpy arrays as they are (in C order: a loaded dataset's
    already are, :func:`as_arrays`), pandas' values as numpy, other array-likes (lists, framework tensors) through
    ``np.asarray``; Python objects refused with the part named."""
    if _is_pandas(value):
        value = value.to_numpy()
    elif not isinstance(value, np.ndarray) and not hasattr(value, "row_bytes"):  # EncodedImages pass as they are
        value = np.asarray(value)
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            raise DatasetError(
                f"{where} holds Python objects (dtype object), which cannot be batched: convert it to numbers "
                "(strings: encode them as integer ids, e.g. with keras.layers.StringLookup outside the model; "
                "ragged rows: pad them to one length)"
            )
        if value.ndim == 0:
            raise DatasetError(f"{where} is a 0-d array (a single value): give it one entry per row")
        value = _c_ordered(value)  # train(sample_weight=...) arrays (loaded ones already are: as_arrays)
    return value


def _c_ordered(a: np.ndarray) -> np.ndarray:
    """``a`` in C order, as the batch pipeline reads rows (it would copy the whole array every round otherwise):
    ``a`` itself when it is (a memmap stays one: the pipeline tells files on disk by it), else a C-ordered copy."""
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def _flatten(value: Any, where: str, leaves: list[Any]) -> Spec:
    if value is None:
        return None
    if isinstance(value, dict):
        keys = list(value)
        bad = [k for k in keys if not isinstance(k, str)]
        if bad:
            raise DatasetError(f"{where} is a dict with keys {bad!r}: name the model's inputs or outputs with strings")
        if not keys:
            raise DatasetError(f"{where} is an empty dict: it needs at least one array")
        return ("dict", keys, [_flatten(value[k], f"{where}[{k!r}]", leaves) for k in keys])
    if isinstance(value, (tuple, list)) and not is_array_like(value):
        if not value:
            raise DatasetError(f"{where} is an empty {type(value).__name__}: it needs at least one array")
        kind = "tuple" if isinstance(value, tuple) else "list"
        return (kind, [_flatten(v, f"{where}[{i}]", leaves) for i, v in enumerate(value)])
    leaves.append(_leaf(value, where))
    return "leaf"


def _unflatten(spec: Spec, leaves: Any) -> Any:
    if spec is None:
        return None
    if spec == "leaf":
        return next(leaves)
    if spec[0] == "dict":
        return {k: _unflatten(s, leaves) for k, s in zip(spec[1], spec[2])}
    items = [_unflatten(s, leaves) for s in spec[1]]
    return tuple(items) if spec[0] == "tuple" else items


@dataclass
class Parts:
    """``x``, ``y`` and (optionally) ``sample_weight`` of a dataset, flattened into :attr:`leaves`."""

    leaves: list[Any]
    """The row-aligned arrays, ``x``'s first, then ``y``'s, then the sample weights."""
    specs: tuple[Spec, Spec, Spec]
    """How the leaves make up ``x``, ``y`` and ``sample_weight``."""
    rows: int

    @classmethod
    def of(cls, x: Any, y: Any, sample_weight: Any = None) -> Parts:
        """The parts of a dataset; raises :class:`~ddlf.DatasetError` naming the part that cannot be batched or
        whose row count differs."""
        leaves: list[Any] = []
        specs = (
            _flatten(x, "x", leaves),
            _flatten(y, "y", leaves),
            _flatten(sample_weight, "sample_weight", leaves),
        )
        if specs[0] is None:
            raise DatasetError("the dataset has no x: load_dataset must return (x, y)")
        parts = cls(leaves, specs, 0)
        names = parts.names()
        counts = {name: len(leaf) for name, leaf in zip(names, leaves)}
        if len(set(counts.values())) > 1:
            listed = ", ".join(f"{k}: {v}" for k, v in counts.items())
            raise DatasetError(f"the dataset's arrays have different numbers of rows ({listed}): give each one per row")
        parts.rows = next(iter(counts.values()))
        return parts

    @classmethod
    def loaded(cls, value: Any) -> Parts:
        """The parts of what ``load_dataset`` (or ``load_shard``) returned."""
        if isinstance(value, dict):
            unknown = sorted(set(value) - {"x", "y", "sample_weight"})
            if "x" not in value or unknown:
                raise DatasetError(
                    f"load_dataset returned a dict with keys {sorted(value)}; it takes 'x', 'y' and optionally "
                    "'sample_weight' (a dict of a model's named inputs goes under 'x')"
                )
        split = cls.split(value)
        if split is not None:
            return cls.of(*split)
        raise DatasetError(
            "load_dataset must return (x, y), (x, y, sample_weight) or {'x': ..., 'y': ..., 'sample_weight': ...}, "
            f"not {type(value).__name__}"
        )

    @staticmethod
    def split(value: Any) -> tuple[Any, Any, Any] | None:
        """``(x, y, sample_weight)`` of a value in ``fit``'s shape (a 2- or 3-tuple or list, a dict with ``x``);
        None for another."""
        if isinstance(value, dict) and "x" in value:
            return value["x"], value.get("y"), value.get("sample_weight")
        if isinstance(value, (tuple, list)) and len(value) in (2, 3):
            return (*value, None) if len(value) == 2 else tuple(value)
        return None

    def names(self) -> list[str]:
        """Each leaf's place, as ``x['image']`` or ``y[1]``."""
        out: list[str] = []

        def walk(spec: Spec, where: str) -> None:
            if spec is None:
                return
            if spec == "leaf":
                out.append(where)
            elif spec[0] == "dict":
                for k, s in zip(spec[1], spec[2]):
                    walk(s, f"{where}[{k!r}]")
            else:
                for i, s in enumerate(spec[1]):
                    walk(s, f"{where}[{i}]")

        for spec, name in zip(self.specs, ("x", "y", "sample_weight")):
            walk(spec, name)
        return out

    @property
    def simple(self) -> bool:
        """An array ``x``, an array (or no) ``y`` and no sample weights: a batch is its leaves as they are."""
        return self.specs[0] == "leaf" and self.specs[1] in ("leaf", None) and self.specs[2] is None

    def pack(self, batch: Any) -> tuple[Any, Any, Any]:
        """``(x, y, sample_weight)`` of one gathered batch (the pipeline's tuple of leaves, in order)."""
        if self.simple:
            return batch[0], (batch[1] if len(batch) > 1 else None), None
        it = iter(batch)
        x = _unflatten(self.specs[0], it)
        y = _unflatten(self.specs[1], it)
        return x, y, _unflatten(self.specs[2], it)

    def with_sample_weight(self, weights: Any) -> Parts:
        """These parts with per-row ``weights`` (``train(sample_weight=array)``) as their sample weights."""
        if self.specs[2] is not None:
            raise DatasetError("both load_dataset and train(sample_weight=...) give sample weights: keep one of them")
        leaf = _leaf(weights, "sample_weight")
        if len(leaf) != self.rows:
            raise DatasetError(f"sample_weight has {len(leaf)} entries for a dataset of {self.rows} rows: one per row")
        return Parts([*self.leaves, leaf], (self.specs[0], self.specs[1], "leaf"), self.rows)

    def slice(self, start: int, stop: int) -> tuple[Any, Any, Any]:
        """``(x, y, sample_weight)`` of rows ``start:stop`` (views where the arrays allow)."""
        return self.pack([leaf[start:stop] for leaf in self.leaves])


def class_weights(y: Any, class_weight: dict[int, float]) -> np.ndarray:
    """Per-row weights from a batch's labels, as ``fit`` derives them from ``class_weight``: integer labels (or
    ``(n, 1)``), or one-hot rows (their argmax); classes not in the dict weigh 1."""
    labels = np.asarray(y)
    if labels.ndim > 1:
        labels = np.argmax(labels, axis=-1) if labels.shape[-1] != 1 else np.squeeze(labels, axis=-1)
    labels = np.round(labels).astype(np.int64)
    table = np.ones(int(max(labels.max(initial=0), max(class_weight, default=0))) + 1, dtype=np.float32)
    for k, v in class_weight.items():
        table[int(k)] = float(v)
    return table[labels]


def rows_of(value: Any) -> int:
    """Rows of a batch part: the length of its first array."""
    while isinstance(value, (dict, tuple, list)):
        value = next(iter(value.values())) if isinstance(value, dict) else value[0]
    return len(value)


def concatenate_rows(batches: list[Any]) -> Any:
    """The batches' rows in order, in the structure of one batch (an array, or a list, tuple or dict of them: a
    multi-output model's predictions)."""
    if not batches:
        return np.zeros((0,), np.float32)
    first = batches[0]
    if isinstance(first, dict):
        return {k: concatenate_rows([b[k] for b in batches]) for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(concatenate_rows([b[i] for b in batches]) for i in range(len(first)))
    return np.concatenate([np.asarray(b) for b in batches])
