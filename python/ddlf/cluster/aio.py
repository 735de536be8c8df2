"""The awaitable twins of :class:`~ddlf.Cluster`'s blocking methods (``run_async`` for ``run``, ...): each runs
its method on the event loop's default executor, so asyncio code never blocks on a call to the workers. Written out
(:class:`AsyncVerbs`, mixed into :class:`~ddlf.Cluster`) so that type checkers and editors see every twin with its
method's signature; a test checks that they stay alike."""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar, cast

from .calls import FunctionRef

if TYPE_CHECKING:
    from .cluster import Cluster

_T = TypeVar("_T")


async def _offload(call: Callable[[], _T]) -> _T:
    """Run ``call`` on the running loop's default executor."""
    return await asyncio.get_running_loop().run_in_executor(None, call)


class AsyncVerbs:
    """The ``*_async`` twins of :class:`~ddlf.Cluster` (mixed into it)."""

    def _cluster(self) -> Cluster:
        return cast("Cluster", self)

    async def set_async(
        self,
        name: str,
        value: Any,
        *,
        workers: Iterable[int] | None = None,
        timeout: float | None = None,
        return_exceptions: bool = False,
    ) -> list[Any] | None:
        """Awaitable :meth:`~ddlf.Cluster.set`."""
        return await _offload(
            functools.partial(
                self._cluster().set, name, value, workers=workers, timeout=timeout, return_exceptions=return_exceptions
            )
        )

    async def scatter_async(self, name: str, values: Sequence[Any], *, timeout: float | None = None) -> None:
        """Awaitable :meth:`~ddlf.Cluster.scatter`."""
        return await _offload(functools.partial(self._cluster().scatter, name, values, timeout=timeout))

    async def get_async(
        self, name: str, *, workers: Iterable[int] | None = None, timeout: float | None = None
    ) -> list[Any]:
        """Awaitable :meth:`~ddlf.Cluster.get`."""
        return await _offload(functools.partial(self._cluster().get, name, workers=workers, timeout=timeout))

    async def delete_async(
        self, name: str, *, workers: Iterable[int] | None = None, timeout: float | None = None
    ) -> None:
        """Awaitable :meth:`~ddlf.Cluster.delete`."""
        return await _offload(functools.partial(self._cluster().delete, name, workers=workers, timeout=timeout))

    async def variables_async(self, *, timeout: float | None = None) -> list[list[str]]:
        """Awaitable :meth:`~ddlf.Cluster.variables`."""
        return await _offload(functools.partial(self._cluster().variables, timeout=timeout))

    async def add_function_async(
        self, fn: Callable[..., Any], name: str | None = None, *, timeout: float | None = None
    ) -> str:
        """Awaitable :meth:`~ddlf.Cluster.add_function`."""
        return await _offload(functools.partial(self._cluster().add_function, fn, name, timeout=timeout))

    async def remove_function_async(self, name: str, *, timeout: float | None = None) -> None:
        """Awaitable :meth:`~ddlf.Cluster.remove_function`."""
        return await _offload(functools.partial(self._cluster().remove_function, name, timeout=timeout))

    async def functions_async(self, *, timeout: float | None = None) -> list[list[str]]:
        """Awaitable :meth:`~ddlf.Cluster.functions`."""
        return await _offload(functools.partial(self._cluster().functions, timeout=timeout))

    async def run_async(self, fn: FunctionRef, *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Awaitable :meth:`~ddlf.Cluster.run`."""
        return await _offload(functools.partial(self._cluster().run, fn, *args, timeout=timeout, **kwargs))

    async def run_on_async(
        self, worker: int, fn: FunctionRef, *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> Any:
        """Awaitable :meth:`~ddlf.Cluster.run_on`."""
        return await _offload(functools.partial(self._cluster().run_on, worker, fn, *args, timeout=timeout, **kwargs))

    async def run_each_async(
        self,
        fn: FunctionRef,
        args: Sequence[Sequence[Any]],
        kwargs: Sequence[dict[str, Any]] | None = None,
        *,
        workers: Sequence[int] | None = None,
        timeout: float | None = None,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """Awaitable :meth:`~ddlf.Cluster.run_each`."""
        return await _offload(
            functools.partial(
                self._cluster().run_each,
                fn,
                args,
                kwargs,
                workers=workers,
                timeout=timeout,
                return_exceptions=return_exceptions,
            )
        )

    async def allreduce_async(
        self,
        name: str,
        op: str = "mean",
        *,
        workers: Iterable[int] | None = None,
        streams: int = 1,
        timeout: float | None = None,
        compression: str | None = None,
        hierarchical: bool | None = None,
    ) -> None:
        """Awaitable :meth:`~ddlf.Cluster.allreduce`."""
        return await _offload(
            functools.partial(
                self._cluster().allreduce,
                name,
                op,
                workers=workers,
                streams=streams,
                timeout=timeout,
                compression=compression,
                hierarchical=hierarchical,
            )
        )

    async def call_async(
        self,
        fn: FunctionRef,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        workers: Iterable[int] | None = None,
        timeout: float | None = None,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """Awaitable :meth:`~ddlf.Cluster.call`."""
        return await _offload(
            functools.partial(
                self._cluster().call,
                fn,
                args,
                kwargs,
                workers=workers,
                timeout=timeout,
                return_exceptions=return_exceptions,
            )
        )

    async def exec_async(self, code: str, *, timeout: float | None = None) -> None:
        """Awaitable :meth:`~ddlf.Cluster.exec`."""
        return await _offload(functools.partial(self._cluster().exec, code, timeout=timeout))

    async def upload_module_async(
        self, module: ModuleType | str | os.PathLike[str], *, timeout: float | None = None
    ) -> str:
        """Awaitable :meth:`~ddlf.Cluster.upload_module`."""
        return await _offload(functools.partial(self._cluster().upload_module, module, timeout=timeout))

    async def clean_async(self, *, timeout: float | None = None) -> None:
        """Awaitable :meth:`~ddlf.Cluster.clean`."""
        return await _offload(functools.partial(self._cluster().clean, timeout=timeout))

    async def reset_async(self, *, force: bool = False, timeout: float | None = None) -> list[dict[str, Any]]:
        """Awaitable :meth:`~ddlf.Cluster.reset`."""
        return await _offload(functools.partial(self._cluster().reset, force=force, timeout=timeout))

    async def load_dataset_async(
        self, key: str, loader: Callable[[], Any], *, timeout: float | None = None
    ) -> list[dict[str, Any]]:
        """Awaitable :meth:`~ddlf.Cluster.load_dataset`."""
        return await _offload(functools.partial(self._cluster().load_dataset, key, loader, timeout=timeout))

    async def put_dataset_async(self, key: str, value: Any, *, timeout: float | None = None) -> list[dict[str, Any]]:
        """Awaitable :meth:`~ddlf.Cluster.put_dataset`."""
        return await _offload(functools.partial(self._cluster().put_dataset, key, value, timeout=timeout))

    async def datasets_async(self, *, timeout: float | None = None) -> list[list[dict[str, Any]]]:
        """Awaitable :meth:`~ddlf.Cluster.datasets`."""
        return await _offload(functools.partial(self._cluster().datasets, timeout=timeout))

    async def drop_dataset_async(self, key: str, *, timeout: float | None = None) -> list[bool]:
        """Awaitable :meth:`~ddlf.Cluster.drop_dataset`."""
        return await _offload(functools.partial(self._cluster().drop_dataset, key, timeout=timeout))

    async def ping_async(self, *, timeout: float | None = 10.0) -> list[float]:
        """Awaitable :meth:`~ddlf.Cluster.ping`."""
        return await _offload(functools.partial(self._cluster().ping, timeout=timeout))

    async def status_async(self, *, timeout: float | None = 10.0) -> list[dict[str, Any]]:
        """Awaitable :meth:`~ddlf.Cluster.status`."""
        return await _offload(functools.partial(self._cluster().status, timeout=timeout))

    async def shutdown_async(self, *, timeout: float | None = 10.0) -> None:
        """Awaitable :meth:`~ddlf.Cluster.shutdown`."""
        return await _offload(functools.partial(self._cluster().shutdown, timeout=timeout))
