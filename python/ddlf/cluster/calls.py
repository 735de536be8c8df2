"""Calls and their outcomes: requests through the Rust client, replies turned into values or exceptions.

The Rust client answers each call with one ``_ddlf.Reply`` per worker: a value (pickle and buffers) or an
``error`` already built as a :mod:`ddlf.errors` exception. :func:`decode` turns a reply into the value or the
exception; :class:`Calls` sends and keeps each calling thread's last timings.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from .. import serialization
from ..errors import SerializationError

Encoded = tuple[bytes, list[Any]]
"""A serialized value: its pickle and its out-of-band buffers."""

FunctionRef = Callable[..., Any] | str
"""A function to run on workers: the function itself, or the name it was pushed under."""


def decode(reply: Any, addresses: Any) -> Any:
    """One worker's reply: its value, or the exception for it (returned, not raised). ``addresses`` (the worker
    addresses, or a callable returning them) names a worker whose value could not be unpickled."""
    if reply.error is not None:
        return reply.error
    try:
        return serialization.loads(reply.pickle, reply.buffers)
    except SerializationError as exc:
        known = addresses() if callable(addresses) else addresses
        exc.worker_id, exc.address = reply.worker, known[reply.worker] if reply.worker < len(known) else None
        return exc


class Calls:
    """Sends requests to workers through the Rust client: one value for all targets (serialized once) or one
    per target. Returns per-target values or exception instances, never raises for a worker's failure."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._timings = threading.local()  # per calling thread: the last call's timings

    def send(
        self,
        op: int,
        name: str,
        digest: str,
        targets: list[int],
        encoded: list[Encoded],
        timeout: float | None,
    ) -> list[Any]:
        if not targets:
            self._timings.last = {}
            return []
        if len(encoded) == 1:
            data, bufs = encoded[0]
            replies = self.client.call(targets, op, name, digest, data, [b.raw() for b in bufs], timeout)
        else:
            values = [(data, [b.raw() for b in bufs]) for data, bufs in encoded]
            replies = self.client.call_each(targets, op, name, digest, values, timeout)
        self._timings.last = {r.worker: (r.worker_seconds, r.call_seconds) for r in replies}
        return [decode(r, self._addresses) for r in replies]

    def _addresses(self) -> list[str]:
        return list(self.client.addresses)

    @property
    def last_timings(self) -> dict[int, tuple[float, float]]:
        """The calling thread's last call: ``{worker: (worker_seconds, call_seconds)}``."""
        return getattr(self._timings, "last", {})

    @last_timings.setter
    def last_timings(self, value: dict[int, tuple[float, float]]) -> None:
        self._timings.last = value


class ClosedClient:
    """Stands in for the connections of a closed cluster: every use says so clearly."""

    addresses: list[str] = []

    def __len__(self) -> int:
        return 0

    def __getattr__(self, name: str) -> Any:
        from ..errors import DdlfError

        raise DdlfError("this cluster is closed")
