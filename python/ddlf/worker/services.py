"""What layers above the daemon keep on a worker, registered here so the daemon can configure them, ask about them
and reset them without importing them: training registers its runs and warm models (:mod:`ddlf.training.replica`,
when a master's first training call imports it on this worker). The daemon depends on nothing above it; what runs
on it depends on the daemon.

The daemon states its settings once (:func:`configure`: its limits, where a service reports what it holds); a
service that registers later is handed them as it registers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Service:
    """One registered service: ``busy()`` describes the work it holds now (empty: none; a reset would end it),
    ``reset(worker)`` drops everything it keeps and says what it dropped (``worker``: the call's context),
    ``configure(**settings)`` takes the daemon's settings (see :func:`configure`)."""

    name: str
    busy: Callable[[], list[str]]
    reset: Callable[[Any], dict[str, Any]]
    configure: Callable[..., None] | None = None


_SERVICES: dict[str, Service] = {}
_SETTINGS: dict[str, Any] = {}


def configure(
    *,
    max_runs: int | None = None,
    idle_seconds: float | None = None,
    report_runs: Callable[[list[str]], None] | None = None,
) -> None:
    """The daemon's settings, for every service registered now or later: ``max_runs`` and ``idle_seconds``
    (``ddlf-worker --max-runs``, ``--run-idle-timeout``) and ``report_runs``, where a service reports the work it
    holds whenever it changes (the daemon's status answers with it). None: unchanged."""
    given = {"max_runs": max_runs, "idle_seconds": idle_seconds, "report_runs": report_runs}
    settings = {k: v for k, v in given.items() if v is not None}
    _SETTINGS.update(settings)
    for s in _SERVICES.values():
        if s.configure is not None:
            s.configure(**settings)


def register(
    name: str,
    *,
    busy: Callable[[], list[str]],
    reset: Callable[[Any], dict[str, Any]],
    configure: Callable[..., None] | None = None,
) -> None:
    """Register (or replace) the service ``name``; it is handed the daemon's settings so far at once."""
    _SERVICES[name] = Service(name, busy, reset, configure)
    if configure is not None and _SETTINGS:
        configure(**_SETTINGS)


def busy() -> list[str]:
    """The work every registered service holds now."""
    return [item for s in _SERVICES.values() for item in s.busy()]


def reset_all(worker: Any) -> dict[str, Any]:
    """Reset every registered service; what each dropped, by name."""
    return {name: s.reset(worker) for name, s in _SERVICES.items()}
