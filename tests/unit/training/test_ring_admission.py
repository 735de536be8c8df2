"""Which runs that all-reduce worker to worker a daemon admits beside another (``Sessions.ring_free``): pure logic
on the worker's registry, no daemons."""

from __future__ import annotations

import contextlib
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
    # Raises RingBusy (failing the test) if a run through the master, or the newcomer's own session (set up again),
    # counted as another ring run.
    sessions.ring_free(worker, "newcomer")
    assert set(sessions.by_id) == {"through_master", "newcomer"}  # admitted beside them, nothing evicted


def test_a_ring_run_whose_master_went_silent_is_not_waited_for_but_kept() -> None:
    for idle in (RING_GONE_SECONDS + 1, Sessions().limits.idle_seconds + 1):
        sessions, worker = _sessions(silent=(True, idle))
        sessions.ring_free(worker, "newcomer")  # no keepalive for this long: its master most likely died...
        assert "silent" in sessions.by_id  # ...but kept (only the run limit evicts), should it come back


def test_a_keepalive_marks_a_run_used_and_ignores_one_not_here(monkeypatch: pytest.MonkeyPatch) -> None:
    from ddlf.training import replica

    sessions, worker = _sessions(holder=(True, RING_GONE_SECONDS + 5))
    monkeypatch.setattr(replica, "SESSIONS", sessions)
    replica.touch("holder")
    replica.touch("not-here")  # torn down meanwhile: nothing
    with pytest.raises(ddlf.RingBusy):
        sessions.ring_free(worker, "newcomer")  # alive again: waited for


def test_a_long_call_counts_as_use_until_it_ends_however_it_ends() -> None:
    """A ring round, an evaluation or a prediction that outlasts ``RING_GONE_SECONDS`` keeps its run waited for:
    ``Sessions.using`` marks the run used when the call begins and again when it ends, raising or not."""
    sessions, worker = _sessions(holder=(True, 0.0))
    for fails in (False, True):
        with pytest.raises(RuntimeError) if fails else contextlib.nullcontext(), sessions.using("holder") as session:
            assert session is sessions.by_id["holder"]
            session.last_used -= RING_GONE_SECONDS + 1  # as if the call had run that long
            if fails:
                raise RuntimeError("the round failed")
        with pytest.raises(ddlf.RingBusy):
            sessions.ring_free(worker, "newcomer")  # used just now: waited for
    with pytest.raises(ddlf.errors.NotFoundError, match="not set up on this worker"), sessions.using("gone"):
        pass
