"""A replica's dataset: the app's (or one shard of it) through the worker's store, and its ``(x, y)``."""

from __future__ import annotations

from typing import Any

from ...data.store import STORE


def shard_key(app: Any, shard: int, n_shards: int) -> str:
    """Store key of one shard of a sharded dataset."""
    return f"{app.dataset_key}/shard-{shard}-of-{n_shards}"


def load(app: Any, identity: bytes, shard: int | None, n_shards: int) -> tuple[Any, bool]:
    """The app's dataset (or one shard of it) through the worker's store, and whether it was cached; ``identity``,
    the digest of the app as received, names the host's copy (no second pickle of the app here)."""
    if shard is None:
        return STORE.get_or_load(app.dataset_key, app.load_dataset, identity=identity)
    return STORE.get_or_load(
        shard_key(app, shard, n_shards),
        lambda: app.load_shard(shard, n_shards),
        shard=(shard, n_shards),
        identity=identity,
    )


def split_xy(value: Any) -> tuple[Any, Any]:
    """``(x, y)`` of what ``load_dataset`` returned: a pair, or a dict with ``"x"`` and ``"y"``."""
    if isinstance(value, dict):
        if "x" not in value or "y" not in value:
            raise TypeError(f"load_dataset returned a dict with keys {sorted(value)}; it needs 'x' and 'y'")
        return value["x"], value["y"]
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return value[0], value[1]
    raise TypeError("load_dataset must return (x, y) or {'x': ..., 'y': ...}")
