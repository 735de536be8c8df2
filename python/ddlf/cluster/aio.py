"""The awaitable twins of :class:`~ddlf.Cluster`'s blocking methods (``run_async`` for ``run``, ...): each runs
its method on the event loop's default executor, so asyncio code never blocks on a call to the workers."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

ASYNC_METHODS = (
    "set",
    "scatter",
    "get",
    "delete",
    "variables",
    "add_function",
    "remove_function",
    "functions",
    "run",
    "run_on",
    "run_each",
    "allreduce",
    "call",
    "exec",
    "upload_module",
    "clean",
    "reset",
    "load_dataset",
    "put_dataset",
    "datasets",
    "drop_dataset",
    "ping",
    "status",
    "shutdown",
)


def _make_async(cls: type, name: str) -> Callable[..., Any]:
    method = getattr(cls, name)

    async def twin(self: Any, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, functools.partial(getattr(self, name), *args, **kwargs))

    twin.__name__ = f"{name}_async"
    twin.__qualname__ = f"{cls.__name__}.{name}_async"
    twin.__doc__ = f"Awaitable form of :meth:`{name}` (runs it without blocking the event loop)."
    twin.__wrapped__ = method  # type: ignore[attr-defined]
    return twin


def add_async_twins(cls: type) -> None:
    """Give ``cls`` an ``<name>_async`` twin of each method in :data:`ASYNC_METHODS`."""
    for name in ASYNC_METHODS:
        setattr(cls, f"{name}_async", _make_async(cls, name))
