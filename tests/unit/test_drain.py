"""A worker told to stop while it serves a run (``ddlf.worker.drain``): the call in flight is interrupted, new work
refused, the rest answered until the runs are gone; a worker serving nothing exits at once. No daemons: the
handler, the executor's answer and the session's checkpoint state are driven directly."""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest

from ddlf.worker import drain
from ddlf.worker.drain import Drain, Draining


def _never() -> None:
    raise AssertionError("a worker that exits at once has no ring to leave")


@pytest.fixture(autouse=True)
def _not_draining(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(drain, "_since", None)
    monkeypatch.setattr(drain, "_call", None)


def test_a_worker_serving_no_run_exits_at_the_signal() -> None:
    d = Drain(10.0, serving=lambda: False, leave=_never)
    with pytest.raises(SystemExit):
        d.on_signal(signal.SIGTERM, None)
    assert not drain.draining()
    d = Drain(0.0, serving=lambda: True, leave=_never)  # --drain-seconds 0
    with pytest.raises(SystemExit):
        d.on_signal(signal.SIGTERM, None)


def test_a_serving_worker_interrupts_its_call_refuses_new_work_and_exits_when_the_runs_are_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runs = ["r1 App"]
    signalled: list[tuple[int, int]] = []
    monkeypatch.setattr(drain.os, "kill", lambda pid, sig: signalled.append((pid, sig)))
    left: list[bool] = []
    d = Drain(30.0, serving=lambda: bool(runs), leave=lambda: left.append(True))
    drain.round_started()  # a round runs
    with pytest.raises(Draining, match="SIGTERM received"):
        d.on_signal(signal.SIGTERM, None)  # a round was running: interrupted
    assert drain.draining() and left == [True]  # out of every ring: a peer waiting on it fails at its next probe
    with pytest.raises(Draining, match="no new round"):
        drain.refuse_new_work("round")
    drain.call_ended()
    d.on_signal(signal.SIGTERM, None)  # srun passes on the SIGTERM slurmstepd sent too: the same stop, ignored
    time.sleep(0.3)
    assert signalled == []  # the run is still there: the worker waits for its master
    runs.clear()  # the master tore its run down (its checkpoint written)
    deadline = time.monotonic() + 5
    while not signalled and time.monotonic() < deadline:
        time.sleep(0.02)
    assert signalled and signalled[0][1] == signal.SIGTERM  # well before the 30 s
    with pytest.raises(SystemExit):  # that signal (or a second one from outside) ends the worker
        d.on_signal(signal.SIGTERM, None)


def test_an_idle_worker_is_not_interrupted_and_the_drain_ends_at_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    signalled: list[int] = []
    monkeypatch.setattr(drain.os, "kill", lambda pid, sig: signalled.append(sig))
    d = Drain(0.3, serving=lambda: True, leave=lambda: None)
    t0 = time.monotonic()
    d.on_signal(signal.SIGTERM, None)  # nothing runs: nothing raised, serving goes on
    assert drain.draining()
    while not signalled and time.monotonic() - t0 < 5:
        time.sleep(0.02)
    # at its deadline, not before (the loop gives up after 5 s: a drain that never ends leaves signalled empty)
    assert signalled == [signal.SIGTERM] and time.monotonic() - t0 >= 0.25


def test_the_executor_answers_an_interrupted_call_as_worker_stopping_and_serves_on() -> None:
    from ddlf import serialization
    from ddlf.worker.executor import KINDS, OPS, Executor

    ex = Executor()

    def interrupted() -> None:
        raise Draining("SIGTERM received")

    ex.namespace["f"] = interrupted  # as `cluster.exec` leaves a function
    data, bufs = serialization.dumps(((), {}))
    kind, (type_name, message, _tb) = ex.handle(OPS["RUN"], "f", "", data, [b.raw() for b in bufs])
    assert kind == KINDS["USER"] and type_name == "WorkerStopping" and "SIGTERM" in message
    assert not drain.interruptible()
    data, bufs = serialization.dumps(7)
    assert ex.handle(OPS["SET_VAR"], "v", "", data, [b.raw() for b in bufs])[0] == 0  # still serving
    assert ex.variables["v"] == 7


def test_a_checkpoint_during_an_unfinished_round_takes_the_optimizer_state_it_started_from() -> None:
    from ddlf.training.replica.session import Session

    class Model:
        optimizer = type("Optimizer", (), {"built": False})()
        weights: list = []
        variables: list = []

    s = Session(run_id="r", app=None, model=Model(), parts=None, rows=0)  # type: ignore[arg-type]
    start = [np.ones(3, np.float32)]
    s.optimizer_start, s.in_flight = start, 4
    state = s.state()
    assert state["optimizer"] is start  # not the part-way state of round 4
    s.in_flight = None
    assert s.state()["optimizer"] is None  # ended: the model's own (none built here)


def test_drain_seconds_on_the_command_line() -> None:
    from ddlf.worker.main import _parser

    assert _parser().parse_args([]).drain_seconds == drain.DEFAULT_SECONDS
    assert _parser().parse_args(["--drain-seconds", "0"]).drain_seconds == 0.0
    for bad in ("-1", "nan", "inf", "soon"):
        with pytest.raises(SystemExit):
            _parser().parse_args(["--drain-seconds", bad])


def test_a_round_that_recorded_its_result_is_not_interrupted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reply of a round that ended here goes out: the master and the workers then agree on the last round."""
    signalled: list[int] = []
    monkeypatch.setattr(drain.os, "kill", lambda pid, sig: signalled.append(sig))
    runs = ["r1 App"]
    d = Drain(30.0, serving=lambda: bool(runs), leave=lambda: None)
    drain.round_started()
    drain.call_settled()
    d.on_signal(signal.SIGTERM, None)  # nothing raised
    assert drain.draining()
    with pytest.raises(Draining):
        drain.refuse_new_work("round")  # but nothing new starts
    runs.clear()  # the drain's end, while this test's stand-in for os.kill is in place
    assert _wait(lambda: signalled == [signal.SIGTERM])


def _wait(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


def test_a_stopping_worker_counts_as_a_lost_one_for_the_failure_policy() -> None:
    import ddlf
    from ddlf.errors import RemoteError

    stopping = RemoteError("the worker is stopping: SIGTERM received", remote_type="WorkerStopping")
    assert ddlf.FailurePolicy().decide(stopping) == "continue"  # training goes on without it, as without a lost one
    assert ddlf.FailurePolicy(lost_worker="raise").decide(stopping) == "raise"
    assert ddlf.FailurePolicy().decide(RemoteError("boom", remote_type="ValueError")) == "raise"


def test_a_remote_error_names_the_type_it_raised() -> None:
    from ddlf.errors import RemoteError

    assert RemoteError("x", remote_type="ddlf.errors.CollectiveError").raised("CollectiveError")
    assert RemoteError("x", remote_type="WorkerStopping").raised("WorkerStopping")
    assert not RemoteError("x", remote_type="my.WorkerStoppingSoon").raised("WorkerStopping")
    assert not RemoteError("x").raised("WorkerStopping")
