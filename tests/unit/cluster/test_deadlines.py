"""One deadline for a call that pushes its function first (``Cluster._pushed``): pure logic, no daemons."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

import ddlf
from ddlf.cluster import cluster as cluster_module


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def _cluster(push_seconds: float, clock: _Clock, default: float | None) -> tuple[Any, list[Any]]:
    pushes: list[Any] = []

    def ensure_function(fn: Any, timeout: float | None, targets: list[int] | None = None) -> tuple[str, str]:
        pushes.append(timeout)
        clock.now += push_seconds  # a worker busy with an earlier call answers the push late (or never)
        return "fn", "digest"

    c = ddlf.Cluster.__new__(ddlf.Cluster)
    c._dispatch = SimpleNamespace(timeout=default, ensure_function=ensure_function)  # type: ignore[assignment]
    return c, pushes


@pytest.mark.parametrize(
    ("timeout", "default", "push_seconds", "left"),
    [
        (3.0, None, 1.0, 2.0),  # the call gets what the push left of run(timeout=3)
        (3.0, None, 3.0, 0.001),  # the push spent it all: the call says DeadlineExceeded at once, not after 3 s more
        (None, 10.0, 4.0, 6.0),  # the cluster's default timeout is one deadline too
        (None, None, 4.0, None),  # no timeout at all: none for either
    ],
)
def test_a_pushed_function_and_its_call_share_one_deadline(
    monkeypatch: pytest.MonkeyPatch, timeout: float | None, default: float | None, push_seconds: float, left: Any
) -> None:
    clock = _Clock()
    monkeypatch.setattr(cluster_module, "time", clock)
    c, pushes = _cluster(push_seconds, clock, default)
    name, digest, call_timeout = c._pushed(lambda: 1, timeout, [0, 1])
    assert (name, digest) == ("fn", "digest")
    assert pushes == [timeout if timeout is not None else default]
    assert call_timeout == (pytest.approx(left) if left is not None else None)
