"""The master's handle on a set of worker daemons: persistent variables and functions, calls, status.

A :class:`Cluster` connects to daemons that are already running (``Cluster([...addresses], token=...)``) or
starts its own on this machine (``Cluster.local(n)``). Values and functions pushed to workers stay there until
deleted, cleaned or shut down, even after this script ends. Every blocking method has an ``*_async`` twin that
can be awaited from asyncio.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType
from typing import Any

from .. import _ddlf
from ..data import store
from ..errors import ConfigError, ConfigTypeError, DdlfError, OutOfRangeError, ResetRefused, raise_for
from ..process import prepare_process
from ..settings import check_lane_spin_us, is_address, read_pem
from ..shipping import files_digest, module_files
from .aio import AsyncVerbs
from .calls import FunctionRef
from .collective_verbs import Collectives
from .dispatch import Dispatch
from .launchers import Launchers
from .local import LocalWorkers
from .rings import Rings
from .slurm import SlurmWorkers

log = logging.getLogger("ddlf")

OPS = _ddlf.OPS


class Cluster(Launchers, Collectives, AsyncVerbs):
    """Connections to worker daemons, in a fixed worker order (worker ``i`` is ``addresses[i]``).

    Args:
        addresses: ``host:port`` of each worker daemon.
        token: the shared token (default: the ``DDLF_TOKEN`` environment variable).
        connect_timeout: seconds allowed to connect to each worker and check its version.
        timeout: default deadline in seconds for every call (``None``: no deadline; a dead worker is still
            detected by heartbeats within about 15 s). Each method also takes its own ``timeout=``.
        shared_memory: opt in to passing values of 1 MiB or more to workers on this machine through a segment of
            this process's shared-memory pool (``/dev/shm``) that they all map, written once, instead of the
            socket. Workers elsewhere, or that cannot see our ``/dev/shm``, use TCP; so does everything when
            ``/dev/shm`` is full. Off by default (see BENCHMARKS.md).
        heartbeat_interval: every gRPC connection sends an HTTP/2 PING each ``heartbeat_interval`` seconds,
            answered by the daemon's network thread even while its Python is busy, and a call waiting on a direct
            lane pings the worker over gRPC as often.
        heartbeat_timeout: a worker that leaves a PING unanswered for ``heartbeat_timeout`` seconds (process
            stopped, host gone, link down) is declared lost and every call waiting on it fails with
            :class:`~ddlf.errors.WorkerUnavailable`. A killed daemon is noticed at once (its socket closes).
        tls_ca: talk TLS to the daemons (started with ``--tls-cert/--tls-key``), trusting this certificate
            authority: a path to a PEM file, or the PEM bytes. ``tls_domain``: the name their certificates are
            checked against (default: each address's host).
        direct_lane: besides its gRPC connection, open a direct lane to each plaintext daemon: a second TCP
            connection on the same port that carries calls as plain frames, read and answered by the worker's
            interpreter thread itself, with no HTTP/2 and no hand-over between threads: about half the latency
            of a gRPC call, and large values written and read in place (see BENCHMARKS.md); and a ping lane, a
            third connection whose pings (``ping()``) a daemon thread of their own answers, also while a job runs.
            TLS, heartbeats while a call waits, and calls (or pings) made while another thread uses the lane go
            over gRPC. ``False``: everything over gRPC.
        lane_spin_us: microseconds a call on a lane spins (non-blocking reads, yielding the CPU) for its reply
            before it sleeps, and a call over gRPC (``status``, TLS daemons) polls before its thread
            parks; a reply within it costs no wake-up (default: ``DDLF_LANE_SPIN_US``, else 100; 0 sleeps at
            once). ``Cluster.local`` gives its daemons the same setting.

    Fault handling (:mod:`ddlf.cluster.recovery`): a worker whose connection breaks is marked lost (a warning names it,
    and :attr:`events` records it). A daemon restarted at the same address is re-provisioned automatically the
    next time it is reached: its worker context is set and everything pushed through this cluster (variables,
    functions, ``exec`` code, uploaded modules, datasets loaded or put) is replayed in order, then the call is
    retried.

    Errors: a call that fails on one worker raises that worker's error; on several, a
    :class:`~ddlf.errors.WorkerErrorGroup` of them (see :mod:`ddlf.errors`).
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
        _local: LocalWorkers | SlurmWorkers | None = None,
    ) -> None:
        if isinstance(addresses, str):
            addresses = [addresses]
        bad = [a for a in addresses if not is_address(a)]
        if bad:
            raise ConfigError(f'worker addresses must be "host:port" (the port the daemon listens on), not {bad}')
        if token is None:
            token = os.environ.get("DDLF_TOKEN") or None
        if lane_spin_us is not None:
            lane_spin_us = check_lane_spin_us(lane_spin_us)
        prepare_process()
        self._local = _local
        self._token = token
        ca_pem = read_pem(tls_ca, "tls_ca")
        client = _ddlf.Client(
            list(addresses),
            token,
            connect_timeout,
            heartbeat_interval,
            heartbeat_timeout,
            shared_memory=shared_memory,
            tls_ca=ca_pem,
            tls_domain=tls_domain,
            direct_lane=direct_lane,
            lane_spin_us=lane_spin_us,
        )
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.uses_tls = tls_ca is not None
        self._tls = (ca_pem, tls_domain) if ca_pem is not None else None
        self._rings = Rings()
        self._closed = False
        self._dispatch = Dispatch(client, timeout, connect_timeout)
        self._recovery = self._dispatch.recovery
        self._replay = self._dispatch.replay
        # No request to the workers' Python here: each learns its index with its first request (Dispatch.send), so
        # that connecting to a busy or stuck worker (ddlf status, ddlf stacks) answers at once.

    # -- lifetime (the constructors beyond __init__: .launchers) ------------------------------------------

    def close(self) -> None:
        """Disconnect; for a :meth:`local` or :meth:`from_slurm` cluster, also stop its daemons. Idempotent."""
        if self._closed:
            return
        self._closed = True
        client = self._dispatch.close()
        try:
            if self._local is not None:
                client.shutdown(list(range(len(client))), 2.0)
        finally:
            # Dropping the connections lets the daemons' graceful shutdown finish at once.
            del client
            if self._local is not None:
                self._local.wait(getattr(self._local, "exit_grace", 3.0))
                self._local.terminate()

    def __enter__(self) -> Cluster:
        if self._closed:
            raise DdlfError("this cluster is closed")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self._client)

    @property
    def _client(self) -> Any:
        """The Rust connection (``ddlf._ddlf.Client``; a closed one after :meth:`close`)."""
        return self._dispatch.client

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def __repr__(self) -> str:
        kind = "" if self._local is None else "local " if isinstance(self._local, LocalWorkers) else "slurm "
        return f"<ddlf.Cluster {kind}workers={self.addresses}>"

    @property
    def events(self) -> list[dict[str, Any]]:
        """What happened to workers: ``{"time", "event": "lost"|"rejoined"|"restarted"|"added"|"removed",
        "worker", "address", "reason"}``, oldest first."""
        return self._recovery.events

    def instance(self, worker: int) -> int:
        """The id of the daemon instance this cluster provisioned as worker ``worker``: a new id at the same
        address means its daemon restarted (and was re-provisioned). Training uses it to set workers up again."""
        return self._recovery.instances[worker]

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
        """The token this cluster connected with: a :meth:`local` cluster's random one (pass it to a second script
        to connect to the same daemons), or the one given (or read from ``DDLF_TOKEN``); None: none."""
        return self._local.token if self._local is not None else self._token

    def worker_info(self) -> list[dict[str, Any]]:
        """What each worker reported at connect time (version, protocol_version, pid, hostname, name, instance),
        with ``shared_memory`` (large buffers go through /dev/shm), ``direct_lane`` (calls have a direct lane
        open now) and ``ping_lane`` (pings have their lane open now) for this master's connection."""
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
        encoded = self._dispatch.encode(value)
        outcomes = self._recovery.invoke(OPS["SET_VAR"], name, "", targets, [encoded], timeout)
        if return_exceptions:
            if workers is None:
                self._replay.record("var", name, encoded)
            return outcomes
        raise_for(outcomes)
        if workers is None:
            self._replay.record("var", name, encoded)
        else:
            addresses = self.addresses
            self._replay.record_on(name, {addresses[i]: encoded for i in targets})
        return None

    def scatter(self, name: str, values: Sequence[Any], *, timeout: float | None = None) -> None:
        """Store ``values[i]`` under ``name`` on worker ``i``."""
        self._check_per_worker(values, "values")
        encoded = [self._dispatch.encode(v) for v in values]
        targets = list(range(len(self)))
        raise_for(self._recovery.invoke(OPS["SET_VAR"], name, "", targets, encoded, timeout))
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
            addresses = self.addresses
            self._replay.forget_on(name, {addresses[i] for i in self._targets(workers)})

    def variables(self, *, timeout: float | None = None) -> list[list[str]]:
        """Names of the variables each worker holds."""
        return self._call(OPS["LIST_VARS"], "", "", None, None, timeout)

    # -- functions ----------------------------------------------------------------------------------------

    def add_function(self, fn: Callable[..., Any], name: str | None = None, *, timeout: float | None = None) -> str:
        """Push ``fn`` to every worker (once: a function already there is not sent again). Returns its name.

        A function whose first parameter is named ``worker`` receives the worker context (``.id``,
        ``.n_workers``, ``.vars``). Functions from ``__main__``, closures and lambdas travel by value.
        """
        if not callable(fn):
            raise ConfigTypeError(f"expected a function, got {type(fn).__name__}")
        return self._dispatch.ensure_function(fn, timeout, name)[0]

    def remove_function(self, name: str, *, timeout: float | None = None) -> None:
        """Remove function ``name`` from every worker."""
        try:
            self._call(OPS["REMOVE_FUNCTION"], name, "", None, None, timeout)
        finally:
            for known in self._recovery.known:
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
            raise ConfigError(f"args has {len(args)} entries for {len(targets)} workers: give one per worker")
        kw = list(kwargs) if kwargs is not None else [{} for _ in args]
        if len(kw) != len(targets):
            raise ConfigError(f"kwargs has {len(kw)} entries for {len(targets)} workers: give one per worker")
        name, digest, timeout = self._pushed(fn, timeout, targets)
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
        name, digest, timeout = self._pushed(fn, timeout, targets)
        value = (tuple(args), dict(kwargs or {}))
        return self._call(OPS["RUN"], name, digest, value, targets, timeout, fn=fn, return_exceptions=return_exceptions)

    def _pushed(self, fn: FunctionRef, timeout: float | None, targets: list[int]) -> tuple[str, str, float | None]:
        """``fn``'s name and digest, pushed first where needed, and what is left of ``timeout`` (default: the
        cluster's) for the call after it: one deadline for both, so that a busy worker's call does not wait twice
        (once for the push, once for the call)."""
        timeout = self._dispatch.timeout if timeout is None else timeout
        start = time.monotonic()
        name, digest = self._dispatch.ensure_function(fn, timeout, targets=targets)
        if timeout is not None:
            timeout = max(timeout - (time.monotonic() - start), 0.001)  # spent: the call says DeadlineExceeded
        return name, digest, timeout

    def exec(self, code: str, *, timeout: float | None = None) -> None:
        """Run a code segment on every worker; the names it defines persist in the worker's globals
        (functions defined there can then be called by name with :meth:`run`)."""
        self._call(OPS["EXEC"], "", "", code, None, timeout)
        self._replay.record("exec", "", code)

    def upload_module(self, module: ModuleType | str | os.PathLike[str], *, timeout: float | None = None) -> str:
        """Ship a local module or package (a module object, or a path to a ``.py`` file or a package directory)
        to every worker, where it becomes importable. Returns the module name."""
        name, files = module_files(module)
        self._dispatch.upload(name, files_digest(files), files, self._targets(None), timeout)
        self._replay.record("module", name, files)
        self._dispatch.shipped[name] = "uploaded"  # the user's choice wins over automatic shipping
        return name

    def clean(self, *, timeout: float | None = None) -> None:
        """Drop every variable, function and exec global on every worker (datasets, warm models, uploaded modules
        and training runs stay: :meth:`reset` drops those too)."""
        self._call(OPS["CLEAN"], "", "", None, None, timeout)
        for known in self._recovery.known:
            known.clear()
        self._replay.clean()

    def reset(self, *, force: bool = False, timeout: float | None = None) -> list[dict[str, Any]]:
        """Every worker back to the state it started in, without a restart: training runs torn down, warm models
        dropped, cached datasets dropped (the host's shared copy too, when no other worker maps it), uploaded
        modules forgotten, Keras' session and JAX's compiled functions cleared, random generators reseeded from
        fresh entropy, and (as :meth:`clean`) every variable, function and ``exec`` global dropped. Returns what
        each worker dropped.

        Use :meth:`clean` between the steps of one script (datasets and warm models stay: the next ``train()``
        starts at once); use ``reset`` when a long-lived daemon (``ddlf up``, a hand-started ``ddlf-worker``) is
        handed to a new script or notebook, or to give a test a fresh worker without a restart.

        Raises :class:`~ddlf.errors.ResetRefused`, before any worker is reset, when a worker serves a training run
        (another master's, or one left behind): ``force=True`` tears those down too. A worker lost during the reset
        is reported as any call reports it (:class:`~ddlf.errors.WorkerUnavailable`; the others are reset)."""
        from ..worker import reset as worker_reset

        if not force:
            held = self.call(worker_reset.held, timeout=timeout, return_exceptions=True)
            busy = [
                f"worker {i} ({self.addresses[i]}): {', '.join(h)}"
                for i, h in enumerate(held)
                if isinstance(h, list) and h
            ]
            if busy:
                raise ResetRefused(
                    "reset refused, nothing was reset: " + "; ".join(busy) + " (reset(force=True) tears them down)"
                )
        try:
            # every worker that answers is reset; one lost on the way raises afterwards, as any call does
            return raise_for(self.call(worker_reset.reset, (force,), timeout=timeout, return_exceptions=True))
        finally:
            # the workers hold nothing pushed before: push everything again when next needed, replay nothing
            for known in self._recovery.known:
                known.clear()
            self._replay.entries.clear()
            self._dispatch.shipped.clear()
            self._dispatch.closures.clear()

    # -- datasets ---------------------------------------------------------------------------------------------

    def load_dataset(
        self, key: str, loader: Callable[[], Any], *, timeout: float | None = None
    ) -> list[dict[str, Any]]:
        """Have every worker load ``loader()`` into its dataset store under ``key``, unless it already holds
        ``key`` (then nothing is loaded). Returns each worker's description, with ``cached`` telling which."""
        out = self.call(store.load, (key, loader), timeout=timeout)
        self._replay.record("dataset", key, ("load", loader))
        return out

    def put_dataset(self, key: str, value: Any, *, timeout: float | None = None) -> list[dict[str, Any]]:
        """Send arrays (an array, or a tuple of arrays with the same number of rows) to every worker's store."""
        out = self.call(store.put, (key, value), timeout=timeout)
        self._replay.record("dataset", key, ("put", value))
        return out

    def datasets(self, *, timeout: float | None = None) -> list[list[dict[str, Any]]]:
        """What each worker's dataset store holds: key, rows, arrays, bytes, load time, memory-mapped."""
        return self.call(store.describe, timeout=timeout)

    def drop_dataset(self, key: str, *, timeout: float | None = None) -> list[bool]:
        """Free dataset ``key`` on every worker; returns whether each worker held it."""
        out = self.call(store.drop, (key,), timeout=timeout)
        self._replay.forget("dataset", key)
        return out

    # -- health -------------------------------------------------------------------------------------------

    def ping(self, *, timeout: float | None = 10.0) -> list[float]:
        """Round-trip seconds to each worker, answered without the worker's Python thread (so also while a job
        runs): over the workers' ping lanes when every one is free, else over gRPC (TLS, ``direct_lane=False``,
        another thread pinging). ``timeout=None``: a worker that leaves a ping unanswered for
        ``heartbeat_interval + heartbeat_timeout`` raises :class:`~ddlf.errors.WorkerUnavailable`."""
        beats = raise_for(self._client.heartbeat(list(range(len(self))), timeout))
        return [rtt for rtt, _instance in beats]

    def status(self, *, timeout: float | None = 10.0) -> list[dict[str, Any]]:
        """Each worker's status: version, uptime, memory, what it is running, request counters, connections, and
        ``lane_pings``: pings answered on ping lanes since the daemon started."""
        return raise_for(self._client.status(list(range(len(self))), timeout))

    def logs(self, worker: int, n: int = 100, *, timeout: float | None = 10.0) -> list[str]:
        """The last ``n`` lines (``n=0``: all it keeps, up to 10,000) of a worker daemon's log, oldest first: a
        line per request (with its id and function, at ``DDLF_LOG_KEEP`` level ``debug``, the default), every
        warning and error, and what user code logged with Python's ``logging``. Answered without the worker's
        Python thread, so it works while a function runs. A ``RemoteError``'s ``request_id`` finds its lines."""
        if n < 0:
            raise ConfigError(f"n must be >= 0, got {n}")
        n = min(n, 2**32 - 1)  # the daemon keeps 10,000 lines at most anyway
        lines, _dropped = raise_for(self._client.logs(self._targets([worker]), n, timeout))[0]
        return lines

    def stacks(self, workers: Sequence[int] | None = None, *, timeout: float | None = 2.0) -> list[dict[str, Any]]:
        """Where each worker is now: ``python``, every thread of its interpreter with its stack (most recent call
        first, faulthandler's format; the thread serving requests is the one in ``ddlf/worker``), and what its
        interpreter thread serves: ``running`` (the request, ``op:name``, or None), ``running_for_s``,
        ``queue_depth``, ``runs``, and ``collectives``: each ring call in progress (all-reduce, reduce-scatter,
        all-gather: which ring, how many elements, for how long) and on whom it waits (a neighbour's link, a member
        at the host's shared-memory barrier, a link not opened yet), with how long nothing moved. Answered by each
        daemon's network side without its interpreter's lock, so a worker stuck in a computation, a collective or
        a deadlock answers too. ``workers``: indices (default all)."""
        return raise_for(self._client.stacks(self._targets(workers), timeout))

    def shutdown(self, *, timeout: float | None = 10.0) -> None:
        """Stop every worker daemon (their state is lost)."""
        raise_for(self._client.shutdown(list(range(len(self))), timeout))
        if self._local is not None:
            self._local.wait(5.0)

    # -- membership and faults ------------------------------------------------------------------------------

    @property
    def lost_workers(self) -> list[int]:
        """Indices of the workers whose connection broke and that have not been reached again since."""
        lost = self._recovery.lost
        return [i for i, a in enumerate(self.addresses) if a in lost]

    @property
    def live_workers(self) -> list[int]:
        """Indices of the workers not marked lost."""
        lost = self._recovery.lost
        return [i for i, a in enumerate(self.addresses) if a not in lost]

    def check(self, *, timeout: float = 2.0) -> list[dict[str, Any]]:
        """Heartbeat every worker now: unreachable ones are marked lost; lost ones that answer again, and
        daemons that restarted, are re-provisioned. Returns the events this check caused."""
        return self._recovery.check(timeout)

    def recover(self, *, timeout: float = 2.0) -> list[int]:
        """Try to reconnect every lost worker now (re-provisioning those whose daemon restarted). Returns the
        indices of the workers that came back."""
        return self._recovery.recover(timeout)

    def add_worker(self, address: str, *, timeout: float | None = None) -> int:
        """Connect to one more daemon and provision it with everything pushed so far. Returns its index (the
        last). Every worker's ``n_workers`` changes; training picks the worker up at its next round."""
        return self._recovery.add(address, timeout or self.connect_timeout)

    def remove_worker(self, worker: int | str, *, shutdown: bool = False) -> str:
        """Stop using a worker (by index or address); the workers after it move down by one. Its daemon keeps
        running (and keeps its state) unless ``shutdown=True``. Returns its address."""
        if isinstance(worker, str):
            if worker not in self.addresses:
                raise ConfigError(f"no worker at {worker!r}: the cluster's workers are {self.addresses}")
            worker = self.addresses.index(worker)
        return self._recovery.remove(self._targets([int(worker)])[0], shutdown=shutdown)

    # -- internals ----------------------------------------------------------------------------------------

    def _targets(self, workers: Iterable[int] | None) -> list[int]:
        if self._closed:
            raise DdlfError("this cluster is closed")
        if workers is None:
            return list(range(len(self)))
        targets = [int(w) for w in workers]
        for w in targets:
            if not 0 <= w < len(self):
                raise OutOfRangeError(f"worker {w} out of range: the cluster has {len(self)} workers")
        if len(set(targets)) != len(targets):
            twice = sorted({w for w in targets if targets.count(w) > 1})
            raise ConfigError(f"workers names worker {', '.join(map(str, twice))} more than once: name each once")
        return targets

    def _check_per_worker(self, values: Sequence[Any], what: str) -> None:
        if len(values) != len(self):
            raise ConfigError(f"{what} has {len(values)} entries for {len(self)} workers: give one per worker")

    def _call(
        self,
        op: int,
        name: str,
        digest: str,
        value: Any,
        workers: Iterable[int] | None,
        timeout: float | None,
        **kw: Any,
    ) -> list[Any]:
        return self._dispatch.call(op, name, digest, value, self._targets(workers), timeout, **kw)

    def _ship(self, modules: Iterable[str], timeout: float | None) -> None:
        """Ship the local modules that code sent to workers refers to (see :meth:`.dispatch.Dispatch.ship`)."""
        self._dispatch.ship(modules, timeout)

    def last_call_timings(self) -> dict[int, tuple[float, float]]:
        """For the calling thread's last call: ``{worker: (worker_seconds, call_seconds)}``, the seconds the
        worker's interpreter spent on it and the seconds from sending the request to having the whole reply. The
        difference is transfer and queueing (the training report's "communication")."""
        return dict(self._dispatch.calls.last_timings)


__all__ = ["Cluster"]
