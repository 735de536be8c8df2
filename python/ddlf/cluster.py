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
import logging
import os
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from . import _ddlf, serialization
from .errors import (
    DdlfError,
    DeadlineExceeded,
    NotFoundError,
    RemoteError,
    SerializationError,
    WorkerRestarted,
    WorkerUnavailable,
)
from .local import LocalWorkers

log = logging.getLogger("ddlf")

OPS = _ddlf.OPS
REVIVE_TIMEOUT = 1.0  # seconds to reach a worker whose connection just broke, to see whether it restarted
KINDS = _ddlf.ERROR_KINDS
_OK, _REMOTE_ERROR, _NET_ERROR = 0, 1, 2

T = TypeVar("T")

MAX_LANE_SPIN_US = 1_000_000


def check_lane_spin_us(value: Any) -> int:
    """Check a ``lane_spin_us`` setting: whole microseconds from 0 (sleep at once) to 1 s."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LANE_SPIN_US:
        raise ValueError(
            f"lane_spin_us must be a whole number of microseconds from 0 to {MAX_LANE_SPIN_US}, got {value!r}"
        )
    return value


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
        heartbeat_interval, heartbeat_timeout: every connection sends an HTTP/2 PING each ``heartbeat_interval``
            seconds, answered by the daemon's network thread even while its Python is busy; a worker that leaves
            one unanswered for ``heartbeat_timeout`` seconds (process stopped, host gone, link down) is declared
            lost and every call waiting on it fails with :class:`~ddlf.errors.WorkerUnavailable`. A killed daemon
            is noticed at once (its socket closes).
        tls_ca: talk TLS to the daemons (started with ``--tls-cert/--tls-key``), trusting this certificate
            authority: a path to a PEM file, or the PEM bytes. ``tls_domain``: the name their certificates are
            checked against (default: each address's host).
        direct_lane: besides its gRPC connection, open a direct lane to each plaintext daemon: a second TCP
            connection on the same port that carries small calls (requests up to 1 MiB on the wire; values in
            shared memory count as their reference) as plain frames, read
            and answered by the worker's interpreter thread itself, with no HTTP/2 and no hand-over between
            threads: about half the latency of a gRPC call (see BENCHMARKS.md). Large values, TLS, heartbeats
            and calls made while another thread uses the lane go over gRPC. ``False``: everything over gRPC.
        lane_spin_us: microseconds a call on a lane spins (non-blocking reads, yielding the CPU) for its reply
            before it sleeps; a reply within it costs no wake-up (default: ``DDLF_LANE_SPIN_US``, else 100;
            0 sleeps at once). ``Cluster.local`` gives its daemons the same setting.

    Fault handling: a worker whose connection breaks is marked lost (a warning names it, and :attr:`events`
    records it). A daemon restarted at the same address is re-provisioned automatically the next time it is
    reached: its worker context is set and everything pushed through this cluster (variables, functions,
    ``exec`` code, uploaded modules, datasets loaded or put) is replayed in order, then the call is retried.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        token: str | None = None,
        *,
        connect_timeout: float = 10.0,
        timeout: float | None = None,
        shared_memory: bool = False,
        heartbeat_interval: float = 2.0,
        heartbeat_timeout: float = 10.0,
        tls_ca: str | os.PathLike[str] | bytes | None = None,
        tls_domain: str | None = None,
        direct_lane: bool = True,
        lane_spin_us: int | None = None,
        _local: LocalWorkers | None = None,
    ) -> None:
        if isinstance(addresses, str):
            addresses = [addresses]
        if token is None:
            token = os.environ.get("DDLF_TOKEN") or None
        if lane_spin_us is not None:
            lane_spin_us = check_lane_spin_us(lane_spin_us)
        self._local = _local
        self._client = _ddlf.Client(
            list(addresses),
            token,
            connect_timeout,
            heartbeat_interval,
            heartbeat_timeout,
            shared_memory=shared_memory,
            tls_ca=_read_pem(tls_ca, "tls_ca"),
            tls_domain=tls_domain,
            direct_lane=direct_lane,
            lane_spin_us=lane_spin_us,
        )
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._closed = False
        self._lock = threading.RLock()  # membership changes and re-provisioning
        # What each worker is known to hold, by function name -> digest, to avoid a miss round trip.
        self._known: list[dict[str, str]] = [{} for _ in addresses]
        self._instances: list[int] = [int(i["instance"]) for i in self._client.worker_info()]
        self._lost: dict[str, float] = {}  # address -> when it was lost
        self._replay = _ReplayLog()
        self.events: list[dict[str, Any]] = []
        """What happened to workers: ``{"time", "event": "lost"|"rejoined"|"restarted"|"added"|"removed",
        "worker", "address", "reason"}``, oldest first."""
        self._pickled: weakref.WeakKeyDictionary[Any, tuple[str, str, bytes]] = weakref.WeakKeyDictionary()
        self._timings = threading.local()  # per calling thread: the last call's timings (see last_call_timings)
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
        direct_lane: bool = True,
        lane_spin_us: int | None = None,
    ) -> Cluster:
        """Start ``n_workers`` daemons on free loopback ports and connect to them.

        The daemons get a fresh random token and stop when the cluster is closed, when the ``with`` block is
        left, at interpreter exit, or when this process dies. ``threads`` caps each worker's math-library
        thread pools (default: the machine's cores divided among the workers).
        """
        if threads is None:
            from .threads import cpu_count

            threads = max(1, cpu_count() // n_workers)
        args = list(worker_args)
        if lane_spin_us is not None:
            args += ["--lane-spin-us", str(check_lane_spin_us(lane_spin_us))]
        local = LocalWorkers(n_workers, threads=threads, start_timeout=start_timeout, extra_args=args)
        try:
            return cls(
                local.addresses,
                local.token,
                timeout=timeout,
                shared_memory=shared_memory,
                direct_lane=direct_lane,
                lane_spin_us=lane_spin_us,
                _local=local,
            )
        except BaseException:
            local.terminate()
            raise

    @classmethod
    def from_config(cls, path: str | os.PathLike[str], **overrides: Any) -> Cluster:
        """Connect to the workers listed in a ``cluster.toml`` (see :mod:`ddlf.config`); keyword arguments
        override the file's settings."""
        from .config import load

        cfg = load(path)
        return cls(cfg.workers, **{**cfg.cluster_kwargs(), **overrides})

    @classmethod
    def from_kubernetes(
        cls,
        service: str = "ddlf-workers",
        namespace: str | None = None,
        replicas: int | None = None,
        *,
        port: int = 7070,
        statefulset: str | None = None,
        cluster_domain: str = "cluster.local",
        **kwargs: Any,
    ) -> Cluster:
        """Connect to the workers of a StatefulSet behind a headless Service (``deploy/kubernetes``), by their
        stable DNS names ``<statefulset>-<i>.<service>.<namespace>.svc.<cluster_domain>:<port>``. ``namespace``
        defaults to ``DDLF_K8S_NAMESPACE``, then the pod's own namespace, then ``default``; ``replicas=None``
        counts the pods whose names resolve. The token comes from ``token=`` or ``DDLF_TOKEN``."""
        from .config import kubernetes_addresses

        addresses = kubernetes_addresses(
            service, namespace, replicas, port=port, statefulset=statefulset, cluster_domain=cluster_domain
        )
        return cls(addresses, **kwargs)

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
        """What each worker reported at connect time (version, protocol_version, pid, hostname, name, instance),
        with ``shared_memory`` (large buffers go through /dev/shm) and ``direct_lane`` (small calls have a direct
        lane open now) for this master's connection."""
        return list(self._client.worker_info())

    # -- variables ----------------------------------------------------------------------------------------

    def set(
        self,
        name: str,
        value: Any,
        *,
        workers: Iterable[int] | None = None,
        timeout: float | None = None,
        return_exceptions: bool = False,
    ) -> list[Any] | None:
        """Store ``value`` under ``name`` on every worker (serialized once, sent to all concurrently).
        ``return_exceptions=True``: returns each worker's outcome (None, or its exception) instead of raising."""
        targets = self._targets(workers)
        encoded = serialization.dumps(value)
        outcomes = self._invoke(OPS["SET_VAR"], name, "", targets, [encoded], timeout)
        if return_exceptions:
            if workers is None:
                self._replay.record("var", name, encoded)
            return outcomes
        self._raise_first(outcomes)
        if workers is None:
            self._replay.record("var", name, encoded)
        else:
            self._record_per_worker(name, {self.addresses[i]: encoded for i in targets})
        return None

    def scatter(self, name: str, values: Sequence[Any], *, timeout: float | None = None) -> None:
        """Store ``values[i]`` under ``name`` on worker ``i``."""
        self._check_per_worker(values, "values")
        encoded = [serialization.dumps(v) for v in values]
        targets = list(range(len(self)))
        self._raise_first(self._invoke(OPS["SET_VAR"], name, "", targets, encoded, timeout))
        self._replay.record("var", name, {self.addresses[i]: e for i, e in zip(targets, encoded)})

    def get(self, name: str, *, workers: Iterable[int] | None = None, timeout: float | None = None) -> list[Any]:
        """The value of ``name`` on each worker."""
        return self._call(OPS["GET_VAR"], name, "", None, workers, timeout)

    def delete(self, name: str, *, workers: Iterable[int] | None = None, timeout: float | None = None) -> None:
        """Delete variable ``name`` on every worker."""
        self._call(OPS["DEL_VAR"], name, "", None, workers, timeout)
        if workers is None:
            self._replay.forget("var", name)
        else:
            entry = self._replay.entries.get(("var", name))
            gone = {self.addresses[i] for i in self._targets(workers)}
            kept = {a: e for a, e in entry.items() if a not in gone} if isinstance(entry, dict) else None
            if kept:
                self._replay.record("var", name, kept)
            else:
                self._replay.forget("var", name)

    def variables(self, *, timeout: float | None = None) -> list[list[str]]:
        """Names of the variables each worker holds."""
        return self._call(OPS["LIST_VARS"], "", "", None, None, timeout)

    def _record_per_worker(self, name: str, encoded: dict[str | None, Any]) -> None:
        entry = self._replay.entries.get(("var", name))
        merged: dict[str | None, Any] = dict(entry) if isinstance(entry, dict) else ({None: entry} if entry else {})
        merged.update(encoded)
        self._replay.record("var", name, merged)

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
            self._call(OPS["REMOVE_FUNCTION"], name, "", None, None, timeout)
        finally:
            for known in self._known:
                known.pop(name, None)
            self._replay.forget("fn", name)

    def functions(self, *, timeout: float | None = None) -> list[list[str]]:
        """Names of the functions each worker holds."""
        return self._call(OPS["LIST_FUNCTIONS"], "", "", None, None, timeout)

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
        workers: Sequence[int] | None = None,
        timeout: float | None = None,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """Call ``fn(*args[i], **kwargs[i])`` on the ``i``-th worker (of ``workers``, default all); returns the
        results in that order. ``return_exceptions=True``: a failed worker's entry is its exception instead of
        the whole call raising (as ``asyncio.gather`` does)."""
        targets = self._targets(workers)
        if len(args) != len(targets):
            raise ValueError(f"args has {len(args)} entries for {len(targets)} workers: give one per worker")
        kw = list(kwargs) if kwargs is not None else [{} for _ in args]
        if len(kw) != len(targets):
            raise ValueError(f"kwargs has {len(kw)} entries for {len(targets)} workers: give one per worker")
        name, digest = self._ensure_function(fn, timeout, targets=targets)
        values = [(tuple(a), dict(k)) for a, k in zip(args, kw)]
        return self._call(
            OPS["RUN"], name, digest, values, targets, timeout, fn=fn, return_exceptions=return_exceptions, each=True
        )

    def call(
        self,
        fn: FunctionRef,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        workers: Iterable[int] | None = None,
        timeout: float | None = None,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """The general form of :meth:`run`: explicit ``args``/``kwargs``, an optional subset of workers, and
        ``return_exceptions`` (see :meth:`run_each`)."""
        targets = self._targets(workers)
        name, digest = self._ensure_function(fn, timeout, targets=targets)
        value = (tuple(args), dict(kwargs or {}))
        return self._call(OPS["RUN"], name, digest, value, targets, timeout, fn=fn, return_exceptions=return_exceptions)

    def exec(self, code: str, *, timeout: float | None = None) -> None:
        """Run a code segment on every worker; the names it defines persist in the worker's globals
        (functions defined there can then be called by name with :meth:`run`)."""
        self._call(OPS["EXEC"], "", "", code, None, timeout)
        self._replay.record("exec", "", code)

    def upload_module(self, module: ModuleType | str | os.PathLike[str], *, timeout: float | None = None) -> str:
        """Ship a local module or package (a module object, or a path to a ``.py`` file or a package directory)
        to every worker, where it becomes importable. Returns the module name."""
        name, files = _module_files(module)
        self._call(OPS["UPLOAD_MODULE"], name, "", files, None, timeout)
        self._replay.record("module", name, files)
        return name

    def clean(self, *, timeout: float | None = None) -> None:
        """Drop every variable, function and exec global on every worker."""
        self._call(OPS["CLEAN"], "", "", None, None, timeout)
        for known in self._known:
            known.clear()
        self._replay.clean()

    # -- datasets ---------------------------------------------------------------------------------------------

    def load_dataset(
        self, key: str, loader: Callable[[], Any], *, timeout: float | None = None
    ) -> list[dict[str, Any]]:
        """Have every worker load ``loader()`` into its dataset store under ``key``, unless it already holds
        ``key`` (then nothing is loaded). Returns each worker's description, with ``cached`` telling which."""
        from .datasets import _remote_load

        out = self.call(_remote_load, (key, loader), timeout=timeout)
        self._replay.record("dataset", key, ("load", loader))
        return out

    def put_dataset(self, key: str, value: Any, *, timeout: float | None = None) -> list[dict[str, Any]]:
        """Send arrays (an array, or a tuple of arrays with the same number of rows) to every worker's store."""
        from .datasets import _remote_put

        out = self.call(_remote_put, (key, value), timeout=timeout)
        self._replay.record("dataset", key, ("put", value))
        return out

    def datasets(self, *, timeout: float | None = None) -> list[list[dict[str, Any]]]:
        """What each worker's dataset store holds: key, rows, arrays, bytes, load time, memory-mapped."""
        from .datasets import _remote_describe

        return self.call(_remote_describe, timeout=timeout)

    def drop_dataset(self, key: str, *, timeout: float | None = None) -> list[bool]:
        """Free dataset ``key`` on every worker; returns whether each worker held it."""
        from .datasets import _remote_drop

        out = self.call(_remote_drop, (key,), timeout=timeout)
        self._replay.forget("dataset", key)
        return out

    # -- health -------------------------------------------------------------------------------------------

    def ping(self, *, timeout: float | None = 10.0) -> list[float]:
        """Round-trip seconds to each worker (answered without the worker's Python thread)."""
        beats = self._raise_first(self._client.heartbeat(list(range(len(self))), timeout))
        return [rtt for rtt, _instance in beats]

    def status(self, *, timeout: float | None = 10.0) -> list[dict[str, Any]]:
        """Each worker's status: version, uptime, memory, what it is running, request counters."""
        return self._raise_first(self._client.status(list(range(len(self))), timeout))

    def logs(self, worker: int, n: int = 100, *, timeout: float | None = 10.0) -> list[str]:
        """The last ``n`` lines (``n=0``: all it keeps, up to 10,000) of a worker daemon's log, oldest first: a
        line per request (with its id and function, at ``DDLF_LOG_KEEP`` level ``debug``, the default), every
        warning and error, and what user code logged with Python's ``logging``. Answered without the worker's
        Python thread, so it works while a function runs. A ``RemoteError``'s ``request_id`` finds its lines."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        n = min(n, 2**32 - 1)  # the daemon keeps 10,000 lines at most anyway
        lines, _dropped = self._raise_first(self._client.logs(self._targets([worker]), n, timeout))[0]
        return lines

    def shutdown(self, *, timeout: float | None = 10.0) -> None:
        """Stop every worker daemon (their state is lost)."""
        self._raise_first(self._client.shutdown(list(range(len(self))), timeout))
        if self._local is not None:
            self._local.wait(5.0)

    # -- membership and faults ------------------------------------------------------------------------------

    @property
    def lost_workers(self) -> list[int]:
        """Indices of the workers whose connection broke and that have not been reached again since."""
        return [i for i, a in enumerate(self.addresses) if a in self._lost]

    @property
    def live_workers(self) -> list[int]:
        """Indices of the workers not marked lost."""
        return [i for i, a in enumerate(self.addresses) if a not in self._lost]

    def check(self, *, timeout: float = 2.0) -> list[dict[str, Any]]:
        """Heartbeat every worker now: unreachable ones are marked lost; lost ones that answer again, and
        daemons that restarted, are re-provisioned. Returns the events this check caused."""
        before = len(self.events)
        beats = self._client.heartbeat(list(range(len(self))), timeout)
        for i, beat in enumerate(beats):
            if isinstance(beat, BaseException):
                try:
                    self._revive(i, timeout)  # a broken connection to a daemon that restarted, or is back
                except DdlfError:
                    self._mark_lost(i, beat)
            elif beat[1] != self._instances[i] or self.addresses[i] in self._lost:
                with contextlib.suppress(DdlfError):
                    self._revive(i, timeout)
        return self.events[before:]

    def recover(self, *, timeout: float = 2.0) -> list[int]:
        """Try to reconnect every lost worker now (re-provisioning those whose daemon restarted). Returns the
        indices of the workers that came back."""
        back = []
        for i in self.lost_workers:
            try:
                self._revive(i, timeout)
            except DdlfError:
                continue
            back.append(i)
        return back

    def add_worker(self, address: str, *, timeout: float | None = None) -> int:
        """Connect to one more daemon and provision it with everything pushed so far. Returns its index (the
        last). Every worker's ``n_workers`` changes; training picks the worker up at its next round."""
        with self._lock:
            i = self._client.add(address, timeout or self.connect_timeout)
            self._known.append({})
            self._instances.append(int(self._client.worker_info()[i]["instance"]))
            self._event("added", i, "")
            self._set_context()
            self._provision(i, context=False)
            return i

    def remove_worker(self, worker: int | str, *, shutdown: bool = False) -> str:
        """Stop using a worker (by index or address); the workers after it move down by one. Its daemon keeps
        running (and keeps its state) unless ``shutdown=True``. Returns its address."""
        with self._lock:
            if isinstance(worker, str):
                if worker not in self.addresses:
                    raise ValueError(f"no worker at {worker!r}: the cluster's workers are {self.addresses}")
                i = self.addresses.index(worker)
            else:
                i = int(worker)
            self._targets([i])
            if shutdown:
                with contextlib.suppress(DdlfError):
                    self._raise_first(self._client.shutdown([i], 5.0))
            address = self._client.remove(i)
            del self._known[i]
            del self._instances[i]
            self._lost.pop(address, None)
            self._event("removed", i, "", address=address)
            if len(self):
                with contextlib.suppress(DdlfError):
                    self._set_context()
            return address

    def _event(self, event: str, worker: int, reason: str, address: str | None = None) -> None:
        self.events.append(
            {
                "time": time.time(),
                "event": event,
                "worker": worker,
                "address": address or self.addresses[worker],
                "reason": reason,
            }
        )

    def _mark_lost(self, i: int, exc: BaseException) -> None:
        address = self.addresses[i]
        if address in self._lost:
            return
        self._lost[address] = time.monotonic()
        reason = getattr(exc, "reason", None) or str(exc)
        self._event("lost", i, reason)
        warnings.warn(f"ddlf: worker {i} ({address}) lost: {reason}", RuntimeWarning, stacklevel=3)

    def _revive(self, i: int, timeout: float | None = None) -> None:
        """Reconnect worker ``i``; provision it again if its daemon is a new instance."""
        with self._lock:
            info = self._client.reconnect(i, timeout or self.connect_timeout)
            fresh = int(info["instance"]) != self._instances[i]
            if fresh:
                self._known[i] = {}
                self._provision(i)
            self._instances[i] = int(info["instance"])
            was_lost = self._lost.pop(self.addresses[i], None) is not None
            if fresh or was_lost:
                self._event("restarted" if fresh else "rejoined", i, "re-provisioned" if fresh else "")
                log.warning(
                    "ddlf: worker %d (%s) %s", i, self.addresses[i], "restarted: re-provisioned" if fresh else "is back"
                )

    def _provision(self, i: int, *, context: bool = True) -> None:
        """Give worker ``i`` its context and replay, in order, everything pushed through this cluster."""
        from .datasets import _remote_load, _remote_put

        if context:
            ctx = serialization.dumps({"worker_id": i, "n_workers": len(self)})
            self._raise_first(self._send(OPS["CONTEXT"], "", "", [i], [ctx], None))
        for (kind, name), payload in list(self._replay.entries.items()):
            if kind == "var":
                encoded = payload.get(self.addresses[i], payload.get(None)) if isinstance(payload, dict) else payload
                if encoded is None:
                    continue
                out = self._send(OPS["SET_VAR"], name, "", [i], [encoded], None)
            elif kind == "fn":
                digest, blob = payload
                out = self._send(OPS["ADD_FUNCTION"], name, digest, [i], [(blob, [])], None)
                if not isinstance(out[0], BaseException):
                    self._known[i][name] = digest
            elif kind == "exec":
                out = self._send(OPS["EXEC"], "", "", [i], [serialization.dumps(payload)], None)
            elif kind == "module":
                out = self._send(OPS["UPLOAD_MODULE"], name, "", [i], [serialization.dumps(payload)], None)
            else:  # dataset
                how, what = payload
                fn = _remote_load if how == "load" else _remote_put
                fname, digest = self._ensure_function(fn, None, targets=[i])
                out = self._send(OPS["RUN"], fname, digest, [i], [serialization.dumps(((name, what), {}))], None)
            self._raise_first(out)

    # -- internals ----------------------------------------------------------------------------------------

    def _targets(self, workers: Iterable[int] | None) -> list[int]:
        if self._closed:
            raise DdlfError("this cluster is closed")
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

    def _send(
        self,
        op: int,
        name: str,
        digest: str,
        targets: list[int],
        encoded: list[tuple[bytes, list[Any]]],
        timeout: float | None,
    ) -> list[Any]:
        """One request per target: ``encoded`` holds one ``(pickle, buffers)`` for all targets (serialized once)
        or one per target. Returns per-target values or exception instances."""
        if not targets:
            self._timings.last = {}
            return []
        deadline = self._deadline(timeout)
        if len(encoded) == 1:
            data, bufs = encoded[0]
            raw = self._client.call(targets, op, name, digest, data, [b.raw() for b in bufs], deadline)
        else:
            values = [(data, [b.raw() for b in bufs]) for data, bufs in encoded]
            raw = self._client.call_each(targets, op, name, digest, values, deadline)
        return self._decode(targets, raw, name)

    def last_call_timings(self) -> dict[int, tuple[float, float]]:
        """For the calling thread's last call: ``{worker: (worker_seconds, call_seconds)}``, the seconds the
        worker's interpreter spent on it and the seconds from sending the request to having the whole reply. The
        difference is transfer and queueing (the training report's "communication")."""
        return dict(getattr(self._timings, "last", {}))

    def _decode(self, targets: list[int], raw: list[tuple[Any, ...]], name: str) -> list[Any]:
        out: list[Any] = []
        timings: dict[int, tuple[float, float]] = {}
        self._timings.last = timings
        for worker, (status, a, b, worker_s, call_s, request_id) in zip(targets, raw):
            timings[worker] = (worker_s, call_s)
            if status == _OK:
                try:
                    out.append(serialization.loads(a, b))
                except SerializationError as exc:
                    exc.worker_id, exc.address = worker, self.addresses[worker]
                    out.append(exc)
            elif status == _REMOTE_ERROR:
                out.append(self._remote_error(worker, a, b, name, request_id))
            else:
                out.append(a)
        return out

    def _invoke(
        self,
        op: int,
        name: str,
        digest: str,
        targets: list[int],
        encoded: list[tuple[bytes, list[Any]]],
        timeout: float | None,
        fn: FunctionRef | None = None,
    ) -> list[Any]:
        """:meth:`_send` plus fault handling: a worker whose daemon restarted is re-provisioned and a function a
        worker lost is pushed again, then those workers are asked once more; broken connections mark workers
        lost."""
        outcomes = self._send(op, name, digest, targets, encoded, timeout)
        timings = self._timings.last
        redo: list[int] = []
        reached: set[int] = set()
        for k, out in enumerate(outcomes):
            restarted = isinstance(out, WorkerRestarted)
            if not restarted and _broken(out) and self.addresses[targets[k]] not in self._lost:
                # The connection broke: if a new daemon already answers at that address, it restarted (the old
                # one, and whatever it was running, is gone), so provisioning it and asking again is safe. The
                # same daemon answering again means the call may have run: that error stands.
                before = self._instances[targets[k]]
                try:
                    self._revive(targets[k], REVIVE_TIMEOUT)
                except DdlfError:
                    continue  # gone: marked lost below
                if self._instances[targets[k]] != before:
                    redo.append(k)
                else:
                    reached.add(k)  # the same daemon answers again: the error stands, but it is not lost
                continue
            if restarted:
                try:
                    self._revive(targets[k])
                except DdlfError as exc:
                    outcomes[k] = exc
                    continue
                redo.append(k)
            elif isinstance(out, NotFoundError) and fn is not None and not isinstance(fn, str) and digest:
                self._known[targets[k]].pop(name, None)  # cleaned by another script, for instance
                redo.append(k)
        if redo:
            again_targets = [targets[k] for k in redo]
            if fn is not None and not isinstance(fn, str):
                self._ensure_function(fn, timeout, targets=again_targets)
            again_encoded = encoded if len(encoded) == 1 else [encoded[k] for k in redo]
            for k, out in zip(redo, self._send(op, name, digest, again_targets, again_encoded, timeout)):
                outcomes[k] = out
            timings.update(self._timings.last)  # the retried workers' second try; the others' first
            self._timings.last = timings
        for k, out in enumerate(outcomes):
            if _broken(out) and k not in reached:
                self._mark_lost(targets[k], out)
        return outcomes

    def _call(
        self,
        op: int,
        name: str,
        digest: str,
        value: Any,
        workers: Iterable[int] | None,
        timeout: float | None,
        *,
        fn: FunctionRef | None = None,
        return_exceptions: bool = False,
        each: bool = False,
    ) -> list[Any]:
        """One request per target: ``value`` goes to every target (serialized once), or with ``each=True`` it is
        a list holding one value per target."""
        targets = self._targets(workers)
        encoded = [serialization.dumps(v) for v in value] if each else [serialization.dumps(value)]
        outcomes = self._invoke(op, name, digest, targets, encoded, timeout, fn)
        return outcomes if return_exceptions else self._raise_first(outcomes)

    def _remote_error(
        self, worker: int, kind: int, exc: tuple[str, str, str], name: str, request_id: int | None = None
    ) -> DdlfError:
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
            request_id=request_id,
        )

    def _raise_first(self, outcomes: list[Any]) -> list[Any]:
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        if errors:
            first = errors[0]
            first.other_errors = errors[1:]  # type: ignore[attr-defined]
            raise first
        return outcomes

    def _set_context(self) -> None:
        n = len(self)
        targets = self.live_workers
        contexts = [{"worker_id": i, "n_workers": n} for i in targets]
        self._call(OPS["CONTEXT"], "", "", contexts, targets, None, each=True)

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
        self._raise_first(self._send(OPS["ADD_FUNCTION"], name, digest, targets, [(blob, [])], timeout))
        for i in targets:
            self._known[i][name] = digest
        self._replay.record("fn", name, (digest, blob))

    def _ensure_function(
        self,
        fn: FunctionRef,
        timeout: float | None,
        name: str | None = None,
        targets: list[int] | None = None,
    ) -> tuple[str, str]:
        """Name and digest of ``fn``, pushed first to the targets not known to hold this version."""
        if isinstance(fn, str):
            return fn, ""
        fname, digest, blob = self._pickle_function(fn, name)
        pool = range(len(self)) if targets is None else targets
        missing = [i for i in pool if self._known[i].get(fname) != digest]
        if missing:
            self._push(fname, digest, blob, missing, timeout)
        return fname, digest

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


def _broken(outcome: Any) -> bool:
    """A broken connection (not a deadline, not a restart already recognised)."""
    return (
        isinstance(outcome, WorkerUnavailable)
        and not isinstance(outcome, DeadlineExceeded)
        and not isinstance(outcome, WorkerRestarted)
    )


def _read_pem(value: str | os.PathLike[str] | bytes | None, what: str) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    try:
        return Path(value).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {what} {os.fspath(value)!r}: {exc.strerror}") from exc


class _ReplayLog:
    """Everything pushed through the cluster API that a restarted daemon must get again, in push order.

    Keys are ``(kind, name)``; pushing the same key again replaces the entry and moves it to the end (a later
    push may depend on an earlier one: code that imports an uploaded module). Values are kept by reference, as
    they were serialized: nothing is copied.
    """

    def __init__(self) -> None:
        self.entries: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._exec_no = 0

    def record(self, kind: str, name: str, payload: Any) -> None:
        if name.startswith("__ddlf"):
            return  # training's per-round values are re-sent by training itself
        if kind == "exec":
            self._exec_no += 1
            name = f"{self._exec_no:08d}"
        key = (kind, name)
        self.entries.pop(key, None)
        self.entries[key] = payload

    def forget(self, kind: str, name: str) -> None:
        self.entries.pop((kind, name), None)

    def clean(self) -> None:
        """What ``Cluster.clean`` drops on the workers (datasets stay)."""
        for key in [k for k in self.entries if k[0] != "dataset"]:
            del self.entries[key]
