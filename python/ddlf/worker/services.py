"""What layers above the daemon keep on a worker, registered here so the daemon can ask about it and reset it
without importing them: training registers its runs and warm models (:mod:`ddlf.training.replica`). The daemon
depends on nothing above it; what runs on it depends on the daemon."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Service:
    """One registered service: ``busy()`` describes the work it holds now (empty: none; a reset would end it),
    ``reset(worker)`` drops everything it keeps and says what it dropped (``worker``: the call's context)."""

    name: str
    busy: Callable[[], list[str]]
    reset: Callable[[Any], dict[str, Any]]


_SERVICES: dict[str, Service] = {}


def register(name: str, *, busy: Callable[[], list[str]], reset: Callable[[Any], dict[str, Any]]) -> None:
    """Register (or replace) the service ``name``."""
    _SERVICES[name] = Service(name, busy, reset)


def busy() -> list[str]:
    """The work every registered service holds now."""
    return [item for s in _SERVICES.values() for item in s.busy()]


def reset_all(worker: Any) -> dict[str, Any]:
    """Reset every registered service; what each dropped, by name."""
    return {name: s.reset(worker) for name, s in _SERVICES.items()}
