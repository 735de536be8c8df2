"""How a :class:`~ddlf.Cluster`'s requests reach the workers, below its facade: values encoded (and the local modules
they refer to shipped first), functions pushed once per version, requests sent with recovery (:mod:`.recovery`)
or without it, and each worker's context.

:class:`Cluster` (the facade) and :class:`~.recovery.Recovery` (lost and restarted workers) both work through one
``Dispatch``: recovery re-sends, re-pushes and re-provisions through it, and never reaches into the facade.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Iterable
from typing import Any

from .. import _ddlf, serialization
from ..errors import SerializationError, WorkerUnavailable, raise_for
from ..shipping import Shipment, local_closure
from .calls import Calls, ClosedClient, Encoded, FunctionRef
from .recovery import Recovery

log = logging.getLogger("ddlf")

OPS = _ddlf.OPS


class Dispatch:
    """One cluster's connection (``client``), its calls, its function registry and its shipped modules."""

    def __init__(self, client: Any, timeout: float | None, connect_timeout: float) -> None:
        self.client = client
        self.calls = Calls(client)
        self.timeout = timeout
        """The default deadline of a request (``None``: none)."""
        self.connect_timeout = connect_timeout
        self.recovery = Recovery(self, [int(i["instance"]) for i in client.worker_info()])
        self.replay = self.recovery.replay
        self.pickled = serialization.PickledFunctions()
        self.shipped: dict[str, str] = {}
        """Local module -> digest shipped to the workers (``"uploaded"``: by ``upload_module``, which wins)."""
        self.closures: dict[frozenset[str], list[str]] = {}
        """Each set of modules sent code referred to, with the local modules they import in turn."""
        self.context_due: set[int] = set(range(len(client)))
        """Workers not yet told their index and the number of workers (:meth:`context_changed`): told with the first
        request that reaches their Python, so that connecting needs no answer from it (``ddlf status`` and
        ``ddlf stacks`` connect to a worker that is busy, or stuck, and must answer at once)."""
        self._context_lock = threading.Lock()

    def close(self) -> Any:
        """Stop sending; returns the client that was open (for the caller to shut daemons down through)."""
        client, self.client = self.client, ClosedClient()
        self.calls = Calls(self.client)
        return client

    def __len__(self) -> int:
        return len(self.client)

    @property
    def addresses(self) -> list[str]:
        """Worker addresses, in worker order."""
        return list(self.client.addresses)

    @property
    def live_workers(self) -> list[int]:
        """Workers not marked lost."""
        lost = self.recovery.lost
        return [i for i, a in enumerate(self.addresses) if a not in lost]

    # -- requests ---------------------------------------------------------------------------------------------

    def send(
        self,
        op: int,
        name: str,
        digest: str,
        targets: list[int],
        encoded: list[Encoded],
        timeout: float | None,
    ) -> list[Any]:
        """One request per target, without recovery (see :mod:`ddlf.cluster.calls`)."""
        timeout = self.timeout if timeout is None else timeout
        if self.context_due:
            self._tell_context(targets, timeout)
        return self.calls.send(op, name, digest, targets, encoded, timeout)

    def _tell_context(self, targets: list[int], timeout: float | None) -> None:
        """Send the targets whose context is due their index and the number of workers, before the request that
        needs it. A worker that cannot be told stays due; the request that follows meets the same fault."""
        with self._context_lock:
            due = [t for t in targets if t in self.context_due]
            if not due:
                return
            n = len(self)
            contexts = [serialization.dumps({"worker_id": t, "n_workers": n}) for t in due]
            for t, out in zip(due, self.calls.send(OPS["CONTEXT"], "", "", due, contexts, timeout)):
                if not isinstance(out, BaseException):
                    self.context_due.discard(t)

    def call(
        self,
        op: int,
        name: str,
        digest: str,
        value: Any,
        targets: list[int],
        timeout: float | None,
        *,
        fn: FunctionRef | None = None,
        return_exceptions: bool = False,
        each: bool = False,
    ) -> list[Any]:
        """One request per target, with recovery: ``value`` goes to every target (serialized once), or with
        ``each=True`` it is a list holding one value per target."""
        encoded = [self.encode(v) for v in value] if each else [self.encode(value)]
        outcomes = self.recovery.invoke(op, name, digest, targets, encoded, timeout, fn)
        return outcomes if return_exceptions else raise_for(outcomes)

    def encode(self, value: Any) -> Encoded:
        """Pickle a value for the workers, first shipping the local modules it refers to."""
        modules: set[str] = set()
        encoded = serialization.dumps(value, modules=modules)
        if modules:
            self.ship(modules, None)
        return encoded

    def ship(self, modules: Iterable[str], timeout: float | None) -> str:
        """Make the local modules (beside the script) that code or values sent to workers refer to importable on
        every worker, with the local modules they import in turn: each version once (the workers skip a version
        they hold; a module edited since is shipped again, and the workers import it anew), replayed to a daemon
        that restarts. See :mod:`ddlf.shipping`. Returns a digest of the versions now in place (it changes when
        any of them is edited)."""
        asked = frozenset(modules)
        closure = self.closures.get(asked)
        if closure is None:
            closure = self.closures[asked] = local_closure(asked)
        elif self._ship_each(closure, timeout):
            closure = self.closures[asked] = local_closure(asked)  # an edit may import other local modules now
        self._ship_each(closure, timeout)
        h = hashlib.sha256()
        for name in closure:
            h.update(f"{name}\0{self.shipped.get(name, '')}\0".encode())
        return h.hexdigest()

    def _ship_each(self, names: list[str], timeout: float | None) -> bool:
        """Ship each of ``names`` whose version on disk the workers were not given yet (a ``stat`` of its sources
        tells); returns whether any was."""
        shipped_any = False
        for name in names:
            if self.shipped.get(name) == "uploaded":
                continue
            try:
                digest, files = Shipment.files(name)
            except ValueError as exc:
                raise SerializationError(str(exc)) from None
            if self.shipped.get(name) == digest:
                continue
            options = {"prefer_native": True, "origin": Shipment.origin(name)}
            # First ask, without the files: a worker on this host (or with the module installed) has them.
            targets = self.live_workers
            held = self.upload(name, digest, ({}, {**options, "probe": True}), targets, timeout)
            need = [t for t, ok in zip(targets, held) if not ok]
            shipment = (files, options)
            if need:
                log.info("ddlf: shipping local module %r (%d files) to workers %s", name, len(files), need)
                self.upload(name, digest, shipment, need, timeout)
            self.replay.record("module", name, shipment)
            self.shipped[name] = digest
            shipped_any = True
        return shipped_any

    def upload(self, name: str, digest: str, payload: Any, targets: list[int], timeout: float | None) -> list[Any]:
        """Upload a module's files (or a probe for them) to the targets."""
        # Module sources are plain bytes: encoded directly, never looked into for modules to ship.
        encoded = serialization.dumps(payload)
        return raise_for(self.recovery.invoke(OPS["UPLOAD_MODULE"], name, digest, targets, [encoded], timeout))

    def context_changed(self, workers: list[int] | None = None) -> None:
        """The index and the number of workers that ``workers`` (None: every worker) know are out of date (a worker
        added or removed, a daemon restarted): each is told with its next request (:meth:`send`)."""
        with self._context_lock:
            self.context_due.update(range(len(self)) if workers is None else workers)

    def push(self, name: str, digest: str, blob: bytes, targets: list[int], timeout: float | None) -> None:
        """Add function ``name`` (this version) on the targets, and record it for replay."""
        # Through recovery, as a call goes: a worker whose connection broke is marked lost (a restarted one is
        # provisioned and asked again). An unreachable worker's error is left to the call that follows (which
        # fails on it too, and is returned with the others' results where the caller asks for exceptions).
        outcomes = self.recovery.invoke(OPS["ADD_FUNCTION"], name, digest, targets, [(blob, [])], timeout)
        raise_for([None if isinstance(o, WorkerUnavailable) else o for o in outcomes])
        for i, out in zip(targets, outcomes):
            if not isinstance(out, BaseException):
                self.recovery.known[i][name] = digest
        self.replay.record("fn", name, (digest, blob))

    def ensure_function(
        self,
        fn: FunctionRef,
        timeout: float | None,
        name: str | None = None,
        targets: list[int] | None = None,
    ) -> tuple[str, str]:
        """Name and digest of ``fn``, pushed first to the targets not known to hold this version."""
        if isinstance(fn, str):
            return fn, ""
        fname, digest, blob, modules = self.pickled.get(fn, name)
        if modules:
            # The function's version includes the modules it refers to: one edited since is pushed again, and the
            # workers unpickle it anew, so that its globals refer to the new module (as a master's reload does).
            versions = self.ship(modules, timeout)
            digest = hashlib.sha256(f"{digest}\0{versions}".encode()).hexdigest()
        pool = range(len(self)) if targets is None else targets
        known = self.recovery.known
        missing = [i for i in pool if known[i].get(fname) != digest]
        if missing:
            self.push(fname, digest, blob, missing, timeout)
        return fname, digest
