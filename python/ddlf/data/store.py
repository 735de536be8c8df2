"""The worker's dataset store: datasets loaded once per worker, kept across runs and scripts."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ConfigTypeError, DatasetError, NotFoundError
from .images import EncodedImages


@dataclass
class StoredDataset:
    """A dataset held by a worker: its arrays and how it got there."""

    key: str
    value: Any
    load_seconds: float
    loaded_at: float = field(default_factory=time.time)
    shard: tuple[int, int] | None = None
    hold: Any = None  # a node_store.Mapped when the arrays are the host's one copy, mapped read-only

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in _arrays(self.value))

    def describe(self) -> dict[str, Any]:
        arrays = _arrays(self.value)
        return {
            "key": self.key,
            "nbytes": self.nbytes,
            "rows": len(arrays[0]) if arrays else 0,
            "arrays": [(tuple(a.shape), str(a.dtype)) for a in arrays],
            "load_seconds": self.load_seconds,
            "memory_mapped": any(isinstance(a.data if isinstance(a, EncodedImages) else a, np.memmap) for a in arrays),
            "node_shared": self.hold is not None,
            "shard": self.shard,
        }


def _arrays(value: Any) -> list[Any]:
    """The arrays (and encoded images, and pandas frames) of a dataset value, nested dicts, tuples and lists
    walked (a model's named inputs)."""
    kinds = (np.ndarray, EncodedImages)
    if isinstance(value, kinds) or type(value).__module__.startswith("pandas."):
        return [value]
    if isinstance(value, Mapping):
        return [a for v in value.values() for a in _arrays(v)]
    if isinstance(value, (tuple, list)):
        return [a for v in value for a in _arrays(v)]
    return []


def _refuse_rows(key: str, value: Any, rows: set[int]) -> None:
    """Refuse a dataset whose arrays differ in rows, each part named as ``fit`` names it where the value has
    ``fit``'s shape (:meth:`.structure.Parts.of` says so: ``x: 1500, y: 2000``)."""
    from .structure import Parts

    split = Parts.split(value)
    if split is not None:
        try:
            Parts.of(*split)
        except DatasetError as exc:
            raise DatasetError(f"dataset {key!r}: {exc}") from None
    raise DatasetError(f"dataset {key!r}: arrays have different numbers of rows {sorted(rows)}")


def _describe(value: Any) -> str:
    """What a dataset value holds, by type: ``tuple of Tensor, Tensor`` (a few leaves named at most)."""
    if isinstance(value, (tuple, list)) and value:
        inner = ", ".join(type(v).__name__ for v in value[:4]) + (", ..." if len(value) > 4 else "")
        return f"{type(value).__name__} of {inner}"
    if isinstance(value, Mapping) and value:
        inner = ", ".join(f"{k!r}: {type(v).__name__}" for k, v in list(value.items())[:4])
        return f"{type(value).__name__} of {{{inner}}}"
    return type(value).__name__


class DatasetStore:
    """The datasets a worker process holds, by key. One per process (:data:`STORE`)."""

    def __init__(self) -> None:
        self._items: dict[str, StoredDataset] = {}
        self._lock = threading.Lock()

    def get_or_load(
        self,
        key: str,
        loader: Callable[[], Any],
        shard: tuple[int, int] | None = None,
        share: bool = True,
        identity: bytes | None = None,
    ) -> tuple[StoredDataset, bool]:
        """The dataset under ``key``, loading it with ``loader()`` if absent. Returns ``(dataset, was_cached)``.

        With ``share`` the arrays go through the host's one copy (:mod:`ddlf.data.node_store`): the first worker on the
        host to load them writes them there, every worker maps them read-only. ``identity`` names the loader for
        that copy (see :func:`ddlf.data.node_store.entry_name`)."""
        from . import node_store

        with self._lock:
            item = self._items.get(key)
            if item is not None:
                return item, True
            t0 = time.perf_counter()
            value, hold = node_store.load(key, loader, identity) if share else (loader(), None)
            try:
                arrays = _arrays(value)
                if not arrays:
                    raise ConfigTypeError(
                        f"load_dataset for {key!r} returned {_describe(value)}, not numpy arrays (a torch tensor: "
                        "tensor.numpy(); a list of rows: np.asarray)"
                    )
                rows = {len(a) for a in arrays}
                if len(rows) != 1:
                    _refuse_rows(key, value, rows)
            except BaseException:
                if hold is not None:
                    hold.release(remove=True)
                raise
            item = StoredDataset(key, value, time.perf_counter() - t0, shard=shard, hold=hold)
            self._items[key] = item
            return item, False

    def put(self, key: str, value: Any) -> StoredDataset:
        """Register arrays under ``key`` (replacing any previous value)."""
        self.drop(key)
        return self.get_or_load(key, lambda: value, share=False)[0]

    def get(self, key: str) -> StoredDataset:
        try:
            return self._items[key]
        except KeyError:
            raise NotFoundError(f"no dataset {key!r} on this worker (held: {sorted(self._items)})") from None

    def keys(self) -> list[str]:
        """The keys held, sorted."""
        with self._lock:
            return sorted(self._items)

    def drop(self, key: str) -> bool:
        """Forget ``key``; the host's copy of it goes when its last holder lets go."""
        with self._lock:
            item = self._items.pop(key, None)
        if item is None:
            return False
        if item.hold is not None:
            item.value = None  # unmapped once no batch refers to the arrays any more
            item.hold.release(remove=True)
        return True

    def close(self) -> None:
        """Let go of everything (a worker's clean exit): host copies that nobody else holds are removed."""
        from . import node_store

        for key in list(self._items):
            self.drop(key)
        node_store.sweep()

    def describe(self) -> list[dict[str, Any]]:
        return [d.describe() for d in self._items.values()]


STORE = DatasetStore()
"""This process's dataset store (on a worker: kept for the daemon's lifetime)."""


# -- the endpoints the master calls on every worker (by reference: ``cluster.call(store.load, ...)``) ----------


def describe() -> list[dict[str, Any]]:
    """What this worker's store holds: one description per dataset (``cluster.datasets()``)."""
    return STORE.describe()


def drop(key: str) -> bool:
    """Drop dataset ``key`` from this worker's store; whether it was there (``cluster.drop_dataset``)."""
    return STORE.drop(key)


def put(key: str, value: Any) -> dict[str, Any]:
    """Store ``value`` (arrays sent by the master) under ``key``; its description (``cluster.put_dataset``)."""
    # Received arrays already own their memory (the assembled stream, or a private mapping): stored as they are.
    return STORE.put(key, tuple(value) if isinstance(value, list) else value).describe()


def load(key: str, loader: Callable[[], Any]) -> dict[str, Any]:
    """Dataset ``key``, loaded with ``loader`` unless this worker holds it already; its description with
    ``cached`` (``cluster.load_dataset``)."""
    item, cached = STORE.get_or_load(key, loader)
    info = item.describe()
    info["cached"] = cached
    return info
