"""The master's wait for its own preemption signal when a worker goes away (no daemons): a scheduler signals every
process of a job in no set order, so a lost worker first gives the master's signal a moment to arrive."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from ddlf import process
from ddlf.errors import RemoteError, WorkerUnavailable
from ddlf.training.preemption import Preemption
from ddlf.training.run import _going_away


# The grace here is an hour: a settle that waited it out instead of returning would fail by pytest-timeout's limit,
# not by a clock read in the test.
@pytest.mark.timeout(120)
def test_settle_returns_once_the_signal_arrives_and_not_before() -> None:
    with Preemption(("SIGUSR1",)) as p:
        t0 = time.monotonic()
        assert p.settle(0.2) is False  # nothing came: it waited the whole grace
        assert time.monotonic() - t0 >= 0.2  # a lower bound: it holds however loaded the machine is
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        assert p.settle(3600.0) is True  # when it arrives, not at the end of the hour
        assert p.requested == "SIGUSR1"


@pytest.mark.timeout(120)
def test_settle_does_not_wait_where_no_signal_is_caught() -> None:
    p = Preemption(())
    with p:
        assert p.settle(3600.0) is False  # nothing caught: no wait at all
    assert Preemption(("SIGUSR1",)).settle(3600.0) is False  # outside its block: nothing installed


def test_a_worker_lost_or_stopping_is_going_away_and_its_own_error_is_not() -> None:
    assert _going_away(WorkerUnavailable("worker 1 lost", worker_id=1))
    stopping = RemoteError("worker 1 raised WorkerStopping", remote_type="ddlf.WorkerStopping")
    assert _going_away(stopping)
    assert not _going_away(RemoteError("worker 1 raised ValueError", remote_type="builtins.ValueError"))
    assert not _going_away(ValueError("no"))


def _kill_and_wait(signum: int) -> None:
    os.kill(os.getpid(), signum)
    time.sleep(0.05)  # the handler runs on this (the main) thread between bytecodes


def test_a_warning_before_train_is_kept_and_taken_by_the_next_run_that_catches_it() -> None:
    previous = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    try:
        process.hold_signals()
        process.hold_signals()  # idempotent
        _kill_and_wait(signal.SIGUSR1)  # the default action would end this process
        assert process.held() == "SIGUSR1"
        with Preemption(()) as p:  # a run without checkpoint_dir catches nothing: the warning stays kept
            assert p.requested is None
        assert process.held() == "SIGUSR1"
        with Preemption(("SIGUSR1", "SIGTERM")) as p:
            assert p.requested == "SIGUSR1"  # the run stops before its first round, with a checkpoint
        assert process.held() is None
        # Preempted: the run's handler stays, ignoring the signals that follow (as before)
        _kill_and_wait(signal.SIGUSR1)
        assert process.held() is None
    finally:
        signal.signal(signal.SIGUSR1, previous[0])
        signal.signal(signal.SIGTERM, previous[1])


def test_after_a_run_that_was_not_preempted_warnings_are_kept_again() -> None:
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        process.hold_signals()
        with Preemption(("SIGUSR1",)) as p:
            assert p.requested is None
        _kill_and_wait(signal.SIGUSR1)
        assert process.take_held([int(signal.SIGTERM)]) is None  # not one of those
        assert process.take_held([int(signal.SIGUSR1)]) == "SIGUSR1"
        assert process.held() is None
    finally:
        signal.signal(signal.SIGUSR1, previous)
