"""Fault recovery for a :class:`~ddlf.Cluster`: lost workers, restarted daemons, and the replay log that
re-provisions them.

A worker whose connection breaks is marked lost (a warning names it, and ``cluster.events`` records it). A daemon
restarted at the same address (a new *instance*) is re-provisioned the next time it is reached: its worker context
is set and everything pushed through the cluster (variables, functions, ``exec`` code, uploaded modules, datasets)
is replayed in push order from the :class:`ReplayLog`, then the call is retried once.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings
from collections import OrderedDict
from typing import Any, Protocol

from .. import _ddlf, serialization
from ..errors import (
    DdlfError,
    DeadlineExceeded,
    NotFoundError,
    WorkerLostWarning,
    WorkerRestarted,
    WorkerUnavailable,
    raise_for,
)
from ..shipping import files_digest
from .calls import Calls, Encoded, FunctionRef

log = logging.getLogger("ddlf")

OPS = _ddlf.OPS
REVIVE_TIMEOUT = 1.0  # seconds to reach a worker whose connection just broke, to see whether it restarted


class ReplayLog:
    """Everything pushed through the cluster API that a restarted daemon must get again, in push order.

    Keys are ``(kind, name)``; pushing the same key again replaces the entry and moves it to the end (a later
    push may depend on an earlier one: code that imports an uploaded module). Values are kept by reference, as
    they were serialized: nothing is copied. Variables set on some workers only are kept per address.
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

    def record_on(self, name: str, encoded: dict[str, Any]) -> None:
        """A variable set on some workers (by address): merged with what other workers hold under ``name``."""
        entry = self.entries.get(("var", name))
        merged: dict[str | None, Any] = dict(entry) if isinstance(entry, dict) else ({None: entry} if entry else {})
        merged.update(encoded)
        self.record("var", name, merged)

    def forget_on(self, name: str, addresses: set[str]) -> None:
        """A variable deleted on some workers only: those hold nothing under ``name`` any more (a marked
        absence, which the value for every worker does not fill), the others keep what they hold."""
        entry = self.entries.get(("var", name))
        if entry is None:
            return
        merged: dict[str | None, Any] = dict(entry) if isinstance(entry, dict) else {None: entry}
        merged.update(dict.fromkeys(addresses))
        if all(v is None for v in merged.values()):
            self.forget("var", name)
        else:
            self.record("var", name, merged)

    def forget(self, kind: str, name: str) -> None:
        self.entries.pop((kind, name), None)

    def clean(self) -> None:
        """What ``Cluster.clean`` drops on the workers (datasets stay)."""
        for key in [k for k in self.entries if k[0] != "dataset"]:
            del self.entries[key]

    def variable_for(self, payload: Any, address: str) -> Any:
        """What a variable's entry holds for the worker at ``address`` (None: nothing for it)."""
        if isinstance(payload, dict):
            return payload.get(address, payload.get(None))
        return payload


def broken(outcome: Any) -> bool:
    """A broken connection (not a deadline, not a restart already recognised)."""
    return (
        isinstance(outcome, WorkerUnavailable)
        and not isinstance(outcome, DeadlineExceeded)
        and not isinstance(outcome, WorkerRestarted)
    )


class Host(Protocol):
    """What recovery needs of the dispatch it serves (:class:`~.dispatch.Dispatch` is the one; recovery never
    imports it)."""

    client: Any
    calls: Calls
    connect_timeout: float

    @property
    def addresses(self) -> list[str]: ...
    def __len__(self) -> int: ...
    def send(
        self, op: int, name: str, digest: str, targets: list[int], encoded: list[Encoded], timeout: float | None
    ) -> list[Any]: ...
    def ensure_function(
        self, fn: FunctionRef, timeout: float | None, name: str | None = None, targets: list[int] | None = None
    ) -> tuple[str, str]: ...
    def context_changed(self, workers: list[int] | None = None) -> None: ...


class Recovery:
    """One cluster's fault state: which workers are lost, which daemon instance each worker is, which functions
    each holds, and what happened (``events``)."""

    def __init__(self, dispatch: Host, instances: list[int]) -> None:
        self.dispatch = dispatch
        self.lock = threading.RLock()  # membership changes and re-provisioning
        self.instances = instances
        self.known: list[dict[str, str]] = [{} for _ in instances]  # function name -> digest, per worker
        self.lost: dict[str, float] = {}  # address -> when it was lost
        self.replay = ReplayLog()
        self.events: list[dict[str, Any]] = []

    # -- calls with recovery ----------------------------------------------------------------------------------

    def invoke(
        self,
        op: int,
        name: str,
        digest: str,
        targets: list[int],
        encoded: list[Encoded],
        timeout: float | None,
        fn: FunctionRef | None = None,
    ) -> list[Any]:
        """Send, then recover: a worker whose daemon restarted is re-provisioned and a function a worker lost is
        pushed again, then those workers are asked once more; broken connections mark workers lost. ``timeout``
        is the caller's: the cluster's ``_send`` applies its default deadline, in that one place."""
        c = self.dispatch
        calls = c.calls
        outcomes = c.send(op, name, digest, targets, encoded, timeout)
        timings = calls.last_timings
        redo: list[int] = []
        reached: set[int] = set()
        addresses = c.addresses
        for k, out in enumerate(outcomes):
            restarted = isinstance(out, WorkerRestarted)
            if not restarted and broken(out) and addresses[targets[k]] not in self.lost:
                # The connection broke: if a new daemon already answers at that address, it restarted (the old
                # one, and whatever it was running, is gone), so provisioning it and asking again is safe. The
                # same daemon answering again means the call may have run: that error stands.
                before = self.instances[targets[k]]
                try:
                    self.revive(targets[k], REVIVE_TIMEOUT)
                except DdlfError:
                    continue  # gone: marked lost below
                if self.instances[targets[k]] != before:
                    redo.append(k)
                else:
                    reached.add(k)  # the same daemon answers again: the error stands, but it is not lost
                continue
            if restarted:
                try:
                    self.revive(targets[k])
                except DdlfError as exc:
                    outcomes[k] = exc
                    continue
                redo.append(k)
            elif isinstance(out, NotFoundError) and fn is not None and not isinstance(fn, str) and digest:
                self.known[targets[k]].pop(name, None)  # cleaned by another script, for instance
                redo.append(k)
        if redo:
            again_targets = [targets[k] for k in redo]
            if fn is not None and not isinstance(fn, str):
                c.ensure_function(fn, timeout, targets=again_targets)
            again_encoded = encoded if len(encoded) == 1 else [encoded[k] for k in redo]
            for k, out in zip(redo, c.send(op, name, digest, again_targets, again_encoded, timeout)):
                outcomes[k] = out
            timings = {**timings, **calls.last_timings}  # the retried workers' second try; the others' first
            calls.last_timings = timings
        for k, out in enumerate(outcomes):
            if broken(out) and k not in reached:
                self.mark_lost(targets[k], out)
        return outcomes

    # -- membership -------------------------------------------------------------------------------------------

    def event(self, event: str, worker: int, reason: str, address: str | None = None) -> None:
        self.events.append(
            {
                "time": time.time(),
                "event": event,
                "worker": worker,
                "address": address or self.dispatch.addresses[worker],
                "reason": reason,
            }
        )

    def mark_lost(self, i: int, exc: BaseException) -> None:
        address = self.dispatch.addresses[i]
        if address in self.lost:
            return
        self.lost[address] = time.monotonic()
        reason = getattr(exc, "reason", None) or str(exc)
        self.event("lost", i, reason)
        warnings.warn(f"ddlf: worker {i} ({address}) lost: {reason}", WorkerLostWarning, stacklevel=4)

    def revive(self, i: int, timeout: float | None = None) -> None:
        """Reconnect worker ``i``; provision it again if its daemon is a new instance."""
        c = self.dispatch
        with self.lock:
            info = c.client.reconnect(i, timeout or c.connect_timeout)
            fresh = int(info["instance"]) != self.instances[i]
            if fresh:
                self.known[i] = {}
                self.provision(i)
            self.instances[i] = int(info["instance"])
            address = c.addresses[i]
            was_lost = self.lost.pop(address, None) is not None
            if fresh or was_lost:
                self.event("restarted" if fresh else "rejoined", i, "re-provisioned" if fresh else "")
                log.warning("ddlf: worker %d (%s) %s", i, address, "restarted: re-provisioned" if fresh else "is back")

    def provision(self, i: int, *, context: bool = True) -> None:
        """Give worker ``i`` its context and replay, in order, everything pushed through this cluster."""
        from ..data import store

        c = self.dispatch
        send = c.send  # the cluster's default deadline, no recovery inside recovery
        if context:
            c.context_changed([i])  # told with the first request below (or the next call)
        address = c.addresses[i]
        for (kind, name), payload in list(self.replay.entries.items()):
            if kind == "var":
                encoded = self.replay.variable_for(payload, address)
                if encoded is None:
                    continue
                out = send(OPS["SET_VAR"], name, "", [i], [encoded], None)
            elif kind == "fn":
                digest, blob = payload
                out = send(OPS["ADD_FUNCTION"], name, digest, [i], [(blob, [])], None)
                if not isinstance(out[0], BaseException):
                    self.known[i][name] = digest
            elif kind == "exec":
                out = send(OPS["EXEC"], "", "", [i], [serialization.dumps(payload)], None)
            elif kind == "module":
                digest = files_digest(payload[0] if isinstance(payload, tuple) else payload)
                out = send(OPS["UPLOAD_MODULE"], name, digest, [i], [serialization.dumps(payload)], None)
            else:  # dataset
                how, what = payload
                fn = store.load if how == "load" else store.put
                fname, digest = c.ensure_function(fn, None, targets=[i])
                out = send(OPS["RUN"], fname, digest, [i], [serialization.dumps(((name, what), {}))], None)
            raise_for(out)

    def add(self, address: str, timeout: float) -> int:
        """Connect to one more daemon (the last worker), set every worker's context and provision it."""
        c = self.dispatch
        with self.lock:
            i = c.client.add(address, timeout)
            self.known.append({})
            self.instances.append(int(c.client.worker_info()[i]["instance"]))
            self.event("added", i, "")
            c.context_changed()  # the number of workers changed for every worker
            self.provision(i, context=False)
            return i

    def remove(self, i: int, *, shutdown: bool) -> str:
        """Stop using worker ``i`` (shutting its daemon down if asked); the workers after it move down."""
        c = self.dispatch
        with self.lock:
            if shutdown:
                with contextlib.suppress(DdlfError):
                    raise_for(c.client.shutdown([i], 5.0))
            address = c.client.remove(i)
            del self.known[i]
            del self.instances[i]
            self.lost.pop(address, None)
            self.event("removed", i, "", address=address)
            c.context_changed()  # the workers after it moved down, and every worker's count changed
            return address

    def check(self, timeout: float) -> list[dict[str, Any]]:
        """Heartbeat every worker: unreachable ones are marked lost; lost ones that answer again, and daemons
        that restarted, are re-provisioned. Returns the events this check caused."""
        c = self.dispatch
        before = len(self.events)
        beats = c.client.heartbeat(list(range(len(c))), timeout)
        for i, beat in enumerate(beats):
            if isinstance(beat, BaseException):
                try:
                    self.revive(i, timeout)  # a broken connection to a daemon that restarted, or is back
                except DdlfError:
                    self.mark_lost(i, beat)
            elif beat[1] != self.instances[i] or c.addresses[i] in self.lost:
                with contextlib.suppress(DdlfError):
                    self.revive(i, timeout)
        return self.events[before:]

    def recover(self, timeout: float) -> list[int]:
        """Try to reconnect every lost worker now. Returns the indices of the workers that came back."""
        back = []
        addresses = self.dispatch.addresses
        for i in [i for i, a in enumerate(addresses) if a in self.lost]:
            try:
                self.revive(i, timeout)
            except DdlfError:
                continue
            back.append(i)
        return back
