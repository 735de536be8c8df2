"""Which runs that all-reduce worker to worker a daemon admits beside another (``Sessions.ring_free``): pure logic
on the worker's registry, no daemons."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

import ddlf
from ddlf.training.replica.registry import RING_GONE_SECONDS, Sessions
from ddlf.training.replica.session import Session


class App:
    pass


def _sessions(**runs: tuple[bool, float]) -> tuple[Sessions, SimpleNamespace]:
    """A registry holding ``runs``: run id -> (all-reduces worker to worker, seconds since last used)."""
    sessions, now = Sessions(), time.monotonic()
    for run_id, (collective, idle) in runs.items():
        s = Session(run_id=run_id, app=App(), model=None, parts=None, rows=0, collective=collective)  # type: ignore[arg-type]
        s.last_used = now - idle
        sessions.by_id[run_id] = s
    return sessions, SimpleNamespace(vars={})


def test_a_ring_run_in_use_refuses_another_naming_itself() -> None:
    sessions, worker = _sessions(holder=(True, 1.0), through_master=(False, 0.0))
    with pytest.raises(ddlf.RingBusy, match=r"training run holder .*App.* all-reduces worker to worker") as info:
        sessions.ring_free(worker, "newcomer")
    assert isinstance(info.value, ddlf.TooManyRuns)  # the family a daemon's refusals belong to
    assert set(sessions.by_id) == {"holder", "through_master"}  # nothing evicted


def test_runs_that_do_not_all_reduce_and_the_run_itself_never_refuse() -> None:
    sessions, worker = _sessions(through_master=(False, 0.0), newcomer=(True, 0.0))
    sessions.ring_free(worker, "newcomer")  # its own session (set up again) does not count


def test_a_ring_run_silent_past_the_bound_is_not_waited_for_and_one_past_the_idle_limit_is_evicted() -> None:
    sessions, worker = _sessions(silent=(True, RING_GONE_SECONDS + 1))
    sessions.ring_free(worker, "newcomer")  # its master most likely died: not waited for...
    assert "silent" in sessions.by_id  # ...but kept, should it come back
    sessions, worker = _sessions(abandoned=(True, sessions.limits.idle_seconds + 1))
    sessions.ring_free(worker, "newcomer")
    assert sessions.by_id == {}  # evicted, as the run limit evicts
