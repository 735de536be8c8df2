"""The master's handle on a set of worker daemons: persistent variables and functions, calls, status.

A :class:`Cluster` connects to daemons that are already running (``Cluster([...addresses], token=...)``) or
starts its own on this machine (``Cluster.local(n)``). Values and functions pushed to workers stay there until
deleted, cleaned or shut down, even after this script ends. Every blocking method has an ``*_async`` twin that
can be awaited from asyncio.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import weakref
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from . import _ddlf, serialization
from .errors import (
    DdlfError,
    NotFoundError,
    RemoteError,
    SerializationError,
    WorkerUnavailable,
)
from .local import LocalWorkers

OPS = _ddlf.OPS
KINDS = _ddlf.ERROR_KINDS
_OK, _REMOTE_ERROR, _NET_ERROR = 0, 1, 2

T = TypeVar("T")
FunctionRef = Callable[..., Any] | str


class Cluster:
    """Connections to worker daemons, in a fixed worker order (worker ``i`` is ``addresses[i]``).

    Args:
        addresses: ``host:port`` of each worker daemon.
        token: the shared token (default: the ``DDLF_TOKEN`` environment variable).
        connect_timeout: seconds allowed to connect to each worker and check its version.
        timeout: default deadline in seconds for every call (``None``: no deadline; a dead worker is still
            detected by heartbeats within about 15 s). Each method also takes its own ``timeout=``.
        shared_memory: opt in to passing values of 32 MiB or more to workers on this machine through one
            shared-memory file (``/dev/shm``) that they all map, instead of the socket. Workers elsewhere, or that
            cannot see our ``/dev/shm``, use TCP; so does everything when ``/dev/shm`` is full. Off by default: it
            measured faster in some runs and slower in others (see BENCHMARKS.md).
    """

    def __init__(
        self,
        addresses: Sequence[str],
        token: str | None = None,
        *,
        connect_timeout: float = 10.0,
        timeout: float | None = None,
        shared_memory: bool = False,
        _local: LocalWorkers | None = None,
    ) -> None:
        if isinstance(addresses, str):
            addresses = [addresses]
        if token is None:
            token = os.environ.get("DDLF_TOKEN") or None
        self._local = _local
        self._client = _ddlf.Client(list(addresses), token, connect_timeout, shared_memory=shared_memory)
        self.timeout = timeout
        self._closed = False
        # What each worker is known to hold, by function name -> digest, to avoid a miss round trip.
        self._known: list[dict[str, str]] = [{} for _ in addresses]
        self._pickled: weakref.WeakKeyDictionary[Any, tuple[str, str, bytes]] = weakref.WeakKeyDictionary()
        self._set_context()

    # -- construction and lifetime ----------------------------------------------------------------------

    @classmethod
    def local(
        cls,
        n_workers: int = 2,
        *,
        threads: int | None = None,
        timeout: float | None = None,
        start_timeout: float = 60.0,
        worker_args: Sequence[str] = (),
        shared_memory: bool = False,
    ) -> Cluster:
        """Start ``n_workers`` daemons on free loopback ports and connect to them.

        The daemons get a fresh random token and stop when the cluster is closed, when the ``with`` block is
        left, at interpreter exit, or when this process dies. ``threads`` caps each worker's math-library
        thread pools (default: the machine's cores divided among the workers).
        """
        if threads is None:
            from .threads import cpu_count

            threads = max(1, cpu_count() // n_workers)
        local = LocalWorkers(n_workers, threads=threads, start_timeout=start_timeout, extra_args=list(worker_args))
        try:
            return cls(local.addresses, local.token, timeout=timeout, shared_memory=shared_memory, _local=local)
        except BaseException:
            local.terminate()
            raise

    def close(self) -> None:
        """Disconnect; for a :meth:`local` cluster, also stop its daemons. Idempotent."""
        if self._closed:
            return
        self._closed = True
        client, self._client = self._client, _ClosedClient()
        try:
            if self._local is not None:
                client.shutdown(list(range(len(client))), 2.0)
        finally:
            # Dropping the connections lets the daemons' graceful shutdown finish at once.
            del client
            if self._local is not None:
                self._local.wait(3.0)
                self._local.terminate()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self._client)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def __repr__(self) -> str:
        kind = "local " if self._local is not None else ""
        return f"<ddlf.Cluster {kind}workers={self.addresses}>"

    @property
    def n_workers(self) -> int:
        """Number of workers."""
        return len(self._client)

    @property
    def addresses(self) -> list[str]:
        """Worker addresses, in worker order."""
        return list(self._client.addresses)

    @property
    def token(self) -> str | None:
        """The token of a :meth:`local` cluster (pass it to a second script to connect to the same daemons)."""
        return self._local.token if self._local is not None else None

    def worker_info(self) -> list[dict[str, Any]]:
        """What each worker reported at connect time: version, pid, hostname, name."""
        return list(self._client.worker_info())

    # -- variables ----------------------------------------------------------------------------------------

    def set(self, name: str, value: Any, *, workers: Iterable[int] | None = None, timeout: float | None = None) -> None:
        """Store ``value`` under ``name`` on every worker (serialized once, sent to all concurrently)."""
        self._call_same(OPS["SET_VAR"], name, "", value, workers, timeout)

    def scatter(self, name: str, values: Sequence[Any], *, timeout: float | None = None) -> None:
        """Store ``values[i]`` under ``name`` on worker ``i``."""
        self._check_per_worker(values, "values")
        self._call_each(OPS["SET_VAR"], name, "", list(values), timeout)

    def get(self, name: str, *, workers: Iterable[int] | None = None, timeout: float | None = None) -> list[Any]:
        """The value of ``name`` on each worker."""
        return self._call_same(OPS["GET_VAR"], name, "", None, workers, timeout)

    def delete(self, name: str, *, workers: Iterable[int] | None = None, timeout: float | None = None) -> None:
        """Delete variable ``name`` on every worker."""
        self._call_same(OPS["DEL_VAR"], name, "", None, workers, timeout)

    def variables(self, *, timeout: float | None = None) -> list[list[str]]:
        """Names of the variables each worker holds."""
        return self._call_same(OPS["LIST_VARS"], "", "", None, None, timeout)

    # -- functions ----------------------------------------------------------------------------------------

    def add_function(self, fn: Callable[..., Any], name: str | None = None, *, timeout: float | None = None) -> str:
        """Push ``fn`` to every worker (once: a function already there is not sent again). Returns its name.

        A function whose first parameter is named ``worker`` receives the worker context (``.id``,
        ``.n_workers``, ``.vars``). Functions from ``__main__``, closures and lambdas travel by value.
        """
        if not callable(fn):
            raise TypeError(f"expected a function, got {type(fn).__name__}")
        return self._ensure_function(fn, timeout, name)[0]

    def remove_function(self, name: str, *, timeout: float | None = None) -> None:
        """Remove function ``name`` from every worker."""
        try:
            self._call_same(OPS["REMOVE_FUNCTION"], name, "", None, None, timeout)
        finally:
            for known in self._known:
                known.pop(name, None)

    def functions(self, *, timeout: float | None = None) -> list[list[str]]:
        """Names of the functions each worker holds."""
        return self._call_same(OPS["LIST_FUNCTIONS"], "", "", None, None, timeout)

    def run(self, fn: FunctionRef, *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every worker; returns the results in worker order.

        ``fn`` is a pushed function's name, or a function object (pushed first if the workers lack it).
        ``timeout`` is ddlf's deadline, not passed to ``fn``; use :meth:`call` to pass a ``timeout`` argument.
        """
        return self.call(fn, args, kwargs, timeout=timeout)

    def run_on(self, worker: int, fn: FunctionRef, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """Call ``fn(*args, **kwargs)`` on worker ``worker`` only; returns its result."""
        return self.call(fn, args, kwargs, workers=[worker], timeout=timeout)[0]

    def run_each(
        self,
        fn: FunctionRef,
        args: Sequence[Sequence[Any]],
        kwargs: Sequence[dict[str, Any]] | None = None,
        *,
        timeout: float | None = None,
    ) -> list[Any]:
        """Call ``fn(*args[i], **kwargs[i])`` on worker ``i``; returns the results in worker order."""
        self._check_per_worker(args, "args")
        kw = list(kwargs) if kwargs is not None else [{} for _ in args]
        self._check_per_worker(kw, "kwargs")
        name, digest = self._ensure_function(fn, timeout)
        values = [(tuple(a), dict(k)) for a, k in zip(args, kw)]
        return self._with_function_retry(
            name, digest, fn, timeout, lambda: self._call_each(OPS["RUN"], name, digest, values, timeout)
        )

    def call(
        self,
        fn: FunctionRef,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        workers: Iterable[int] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """The general form of :meth:`run`: explicit ``args``/``kwargs`` and an optional subset of workers."""
        name, digest = self._ensure_function(fn, timeout)
        value = (tuple(args), dict(kwargs or {}))
        return self._with_function_retry(
            name,
            digest,
            fn,
            timeout,
            lambda: self._call_same(OPS["RUN"], name, digest, value, workers, timeout),
        )

    def exec(self, code: str, *, timeout: float | None = None) -> None:
        """Run a code segment on every worker; the names it defines persist in the worker's globals
        (functions defined there can then be called by name with :meth:`run`)."""
        self._call_same(OPS["EXEC"], "", "", code, None, timeout)

    def upload_module(self, module: ModuleType | str | os.PathLike[str], *, timeout: float | None = None) -> str:
        """Ship a local module or package (a module object, or a path to a ``.py`` file or a package directory)
        to every worker, where it becomes importable. Returns the module name."""
        name, files = _module_files(module)
        self._call_same(OPS["UPLOAD_MODULE"], name, "", files, None, timeout)
        return name

    def clean(self, *, timeout: float | None = None) -> None:
        """Drop every variable, function and exec global on every worker."""
        self._call_same(OPS["CLEAN"], "", "", None, None, timeout)
        for known in self._known:
            known.clear()

    # -- datasets ---------------------------------------------------------------------------------------------

    def load_dataset(
        self, key: str, loader: Callable[[], Any], *, timeout: float | None = None
    ) -> list[dict[str, Any]]:
        """Have every worker load ``loader()`` into its dataset store under ``key``, unless it already holds
        ``key`` (then nothing is loaded). Returns each worker's description, with ``cached`` telling which."""
        from .datasets import _remote_load

        return self.call(_remote_load, (key, loader), timeout=timeout)

    def put_dataset(self, key: str, value: Any, *, timeout: float | None = None) -> list[dict[str, Any]]:
        """Send arrays (an array, or a tuple of arrays with the same number of rows) to every worker's store."""
        from .datasets import _remote_put

        return self.call(_remote_put, (key, value), timeout=timeout)

    def datasets(self, *, timeout: float | None = None) -> list[list[dict[str, Any]]]:
        """What each worker's dataset store holds: key, rows, arrays, bytes, load time, memory-mapped."""
        from .datasets import _remote_describe

        return self.call(_remote_describe, timeout=timeout)

    def drop_dataset(self, key: str, *, timeout: float | None = None) -> list[bool]:
        """Free dataset ``key`` on every worker; returns whether each worker held it."""
        from .datasets import _remote_drop

        return self.call(_remote_drop, (key,), timeout=timeout)

    # -- health -------------------------------------------------------------------------------------------

    def ping(self, *, timeout: float | None = 10.0) -> list[float]:
        """Round-trip seconds to each worker (answered without the worker's Python thread)."""
        return self._raise_first(self._client.ping(list(range(len(self))), timeout))

    def status(self, *, timeout: float | None = 10.0) -> list[dict[str, Any]]:
        """Each worker's status: version, uptime, memory, what it is running, request counters."""
        return self._raise_first(self._client.status(list(range(len(self))), timeout))

    def shutdown(self, *, timeout: float | None = 10.0) -> None:
        """Stop every worker daemon (their state is lost)."""
        self._raise_first(self._client.shutdown(list(range(len(self))), timeout))
        if self._local is not None:
            self._local.wait(5.0)

    # -- internals ----------------------------------------------------------------------------------------

    def _targets(self, workers: Iterable[int] | None) -> list[int]:
        if workers is None:
            return list(range(len(self)))
        targets = [int(w) for w in workers]
        for w in targets:
            if not 0 <= w < len(self):
                raise IndexError(f"worker {w} out of range: the cluster has {len(self)} workers")
        return targets

    def _check_per_worker(self, values: Sequence[Any], what: str) -> None:
        if len(values) != len(self):
            raise ValueError(f"{what} has {len(values)} entries for {len(self)} workers: give one per worker")

    def _deadline(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def _call_same(
        self,
        op: int,
        name: str,
        digest: str,
        value: Any,
        workers: Iterable[int] | None,
        timeout: float | None,
    ) -> list[Any]:
        targets = self._targets(workers)
        data, bufs = serialization.dumps(value)
        outcomes = self._client.call(targets, op, name, digest, data, [b.raw() for b in bufs], self._deadline(timeout))
        return self._results(targets, outcomes, name)

    def _call_each(self, op: int, name: str, digest: str, values: list[Any], timeout: float | None) -> list[Any]:
        targets = list(range(len(self)))
        encoded = []
        for v in values:
            data, bufs = serialization.dumps(v)
            encoded.append((data, [b.raw() for b in bufs]))
        outcomes = self._client.call_each(targets, op, name, digest, encoded, self._deadline(timeout))
        return self._results(targets, outcomes, name)

    def _results(self, targets: list[int], outcomes: list[tuple[Any, ...]], name: str) -> list[Any]:
        results: list[Any] = []
        errors: list[BaseException] = []
        for worker, (status, a, b, _compute) in zip(targets, outcomes):
            if status == _OK:
                try:
                    results.append(serialization.loads(a, b))
                except SerializationError as exc:
                    exc.worker_id, exc.address = worker, self.addresses[worker]
                    errors.append(exc)
            elif status == _REMOTE_ERROR:
                errors.append(self._remote_error(worker, a, b, name))
            else:
                errors.append(a)
        if errors:
            first = errors[0]
            first.other_errors = errors[1:]  # type: ignore[attr-defined]
            raise first
        return results

    def _remote_error(self, worker: int, kind: int, exc: tuple[str, str, str], name: str) -> DdlfError:
        type_name, message, tb = exc
        address = self.addresses[worker]
        where = f"worker {worker} ({address})"
        if kind in (KINDS["NOT_FOUND"], KINDS["MISSING_FUNCTION"]):
            return NotFoundError(f"{where}: {message}", address=address, worker_id=worker, name=name)
        if kind == KINDS["SERIALIZATION"]:
            return SerializationError(f"{where}: {message}", address=address, worker_id=worker)
        return RemoteError(
            f"{where} raised {type_name}: {message}",
            address=address,
            worker_id=worker,
            remote_type=type_name,
            remote_message=message,
            remote_traceback=tb,
        )

    def _raise_first(self, outcomes: list[Any]) -> list[Any]:
        for o in outcomes:
            if isinstance(o, BaseException):
                raise o
        return outcomes

    def _set_context(self) -> None:
        n = len(self)
        self._call_each(OPS["CONTEXT"], "", "", [{"worker_id": i, "n_workers": n} for i in range(n)], None)

    def _pickle_function(self, fn: Callable[..., Any], name: str | None) -> tuple[str, str, bytes]:
        if not callable(fn):
            raise TypeError(f"expected a function, got {type(fn).__name__}")
        cached = None
        with contextlib.suppress(TypeError):  # not weak-referenceable: no cache
            cached = self._pickled.get(fn)
        if cached is None or (name is not None and cached[0] != name):
            blob, digest = serialization.dump_function(fn)
            fname = name or serialization.function_name(fn)
            if fname == "<lambda>":
                fname = f"<lambda>#{digest[:12]}"
            cached = (fname, digest, blob)
            with contextlib.suppress(TypeError):
                self._pickled[fn] = cached
        return cached

    def _push(self, name: str, digest: str, blob: bytes, targets: list[int], timeout: float | None) -> None:
        outcomes = self._client.call(targets, OPS["ADD_FUNCTION"], name, digest, blob, [], self._deadline(timeout))
        self._results(targets, outcomes, name)
        for i in targets:
            self._known[i][name] = digest

    def _ensure_function(self, fn: FunctionRef, timeout: float | None, name: str | None = None) -> tuple[str, str]:
        """Name and digest of ``fn``, pushed first to the workers not known to hold this version."""
        if isinstance(fn, str):
            return fn, ""
        fname, digest, blob = self._pickle_function(fn, name)
        missing = [i for i in range(len(self)) if self._known[i].get(fname) != digest]
        if missing:
            self._push(fname, digest, blob, missing, timeout)
        return fname, digest

    def _with_function_retry(
        self, name: str, digest: str, fn: FunctionRef, timeout: float | None, call: Callable[[], list[Any]]
    ) -> list[Any]:
        try:
            return call()
        except NotFoundError:
            # A worker lost the function (cleaned by another script, or restarted): push it again, once.
            if isinstance(fn, str) or not digest:
                raise
            for known in self._known:
                known.pop(name, None)
            self._ensure_function(fn, timeout)
            return call()

    # -- asyncio twins ------------------------------------------------------------------------------------

    async def _in_thread(self, method: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, functools.partial(method, *args, **kwargs))


class _ClosedClient:
    """Stands in for the connections of a closed cluster: every use says so clearly."""

    def __len__(self) -> int:
        return 0

    def __getattr__(self, name: str) -> Any:
        raise DdlfError("this cluster is closed")


def _make_async(name: str) -> Callable[..., Any]:
    method = getattr(Cluster, name)

    async def twin(self: Cluster, *args: Any, **kwargs: Any) -> Any:
        return await self._in_thread(getattr(self, name), *args, **kwargs)

    twin.__name__ = f"{name}_async"
    twin.__qualname__ = f"Cluster.{name}_async"
    twin.__doc__ = f"Awaitable form of :meth:`{name}` (runs it without blocking the event loop)."
    twin.__wrapped__ = method  # type: ignore[attr-defined]
    return twin


_ASYNC_METHODS = (
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
    "call",
    "exec",
    "upload_module",
    "clean",
    "load_dataset",
    "put_dataset",
    "datasets",
    "drop_dataset",
    "ping",
    "status",
    "shutdown",
)
for _name in _ASYNC_METHODS:
    setattr(Cluster, f"{_name}_async", _make_async(_name))


def _module_files(module: ModuleType | str | os.PathLike[str]) -> tuple[str, dict[str, bytes]]:
    if isinstance(module, ModuleType):
        file = getattr(module, "__file__", None)
        if file is None:
            raise ValueError(f"module {module.__name__!r} has no source file to upload")
        path = Path(file)
        if path.name == "__init__.py":
            path = path.parent
        top = module.__name__.split(".")[0]
        if top != module.__name__:
            raise ValueError(f"upload the top-level package {top!r} rather than {module.__name__!r}")
    else:
        path = Path(module)
    path = path.resolve()
    if path.is_dir():
        if not (path / "__init__.py").exists():
            raise ValueError(f"{path} is not a package (no __init__.py)")
        files = {
            str(p.relative_to(path.parent).as_posix()): p.read_bytes()
            for p in sorted(path.rglob("*.py"))
            if "__pycache__" not in p.parts
        }
        return path.name, files
    if path.suffix == ".py" and path.is_file():
        return path.stem, {path.name: path.read_bytes()}
    raise ValueError(f"cannot upload {module!r}: expected a module, a .py file or a package directory")


__all__ = ["Cluster", "WorkerUnavailable"]
