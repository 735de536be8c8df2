"""``cluster.stacks()`` and ``ddlf stacks``: every worker's Python stacks, from a busy, a stuck and an idle worker,
answered by the daemon's network side without the interpreter."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import ddlf
from ddlf.cli.main import format_stacks

from ..conftest import Daemon


def _train_of_thought(started: str, stop: str) -> str:
    """A function the test looks for on the worker's stack, busy in pure Python until the test has read it."""
    import os
    import time

    open(started, "w").close()
    deadline = time.monotonic() + 120
    while not os.path.exists(stop) and time.monotonic() < deadline:
        for _ in range(10_000):
            pass
    return "thought"


def _hold_the_gil(n: int, started: str | None = None) -> bool:
    """A regular expression that backtracks for seconds inside C, never letting go of the GIL."""
    if started is not None:
        open(started, "w").close()
    return re.match(r"(a+)+$", "a" * n + "b") is not None


def _wait_for(path: Path, what: str, runner: threading.Thread, result: dict[str, object]) -> None:
    """Until ``path`` exists: the worker says it began, however long a loaded machine took to get there. A call that
    ended without saying so fails here, with what it returned; one that never ends, by the suite's timeout."""
    while not path.exists():
        assert runner.is_alive(), f"{what} ended without beginning: {result}"
        time.sleep(0.02)


def _stacks_while(
    cluster: ddlf.Cluster, fn: object, *args: object, started: Path, stop: Path | None = None, settle: float = 0.0
) -> tuple[list[dict], object]:
    """Stacks read while worker 0 runs ``fn(*args)``: once ``fn`` has said it began (and ``settle`` seconds more),
    then ``stop`` is created to let it finish."""
    result: dict[str, object] = {}
    runner = threading.Thread(target=lambda: result.setdefault("value", cluster.run_on(0, fn, *args)))
    runner.start()
    try:
        _wait_for(started, getattr(fn, "__name__", "the function"), runner, result)
        time.sleep(settle)
        stacks = cluster.stacks()
    finally:
        if stop is not None:
            stop.touch()
        runner.join(120)
    return stacks, result.get("value")


def test_stacks_of_a_busy_worker_show_the_user_function(cluster: ddlf.Cluster, tmp_path: Path) -> None:
    started, stop = tmp_path / "started", tmp_path / "stop"
    stacks, value = _stacks_while(
        cluster, _train_of_thought, str(started), str(stop), started=started, stop=stop, settle=0.6
    )
    assert value == "thought"  # (the stack below was read while it ran: answered without waiting for it)
    busy, idle = stacks
    assert busy["running"] == "run:_train_of_thought" and busy["running_for_s"] > 0.5, busy
    assert "_train_of_thought" in busy["python"] and "test_stacks.py" in busy["python"], busy["python"]
    assert "most recent call first" in busy["python"] and busy["error"] is None
    assert idle["running"] is None and "_train_of_thought" not in idle["python"]
    assert busy["pid"] != idle["pid"] and busy["address"] == cluster.addresses[0]
    assert cluster.run_on(0, lambda: 5) == 5  # the worker still serves


def test_stacks_of_a_worker_holding_the_gil_are_answered_without_it(cluster: ddlf.Cluster, tmp_path: Path) -> None:
    # Calibrated here: the match takes long enough to ask during it on this machine, whatever its speed.
    t0 = time.perf_counter()
    cluster.run_on(0, _hold_the_gil, 18)
    per_step = time.perf_counter() - t0
    n = 18
    while per_step < 2.5 and n < 32:
        n += 1
        per_step *= 2
    started = tmp_path / "started"
    stacks, value = _stacks_while(cluster, _hold_the_gil, n, str(started), started=started)
    assert value is False
    # read while the interpreter held the GIL in the match: answered without the interpreter
    assert "_hold_the_gil" in stacks[0]["python"], stacks[0]["python"]
    assert stacks[0]["running"] == "run:_hold_the_gil"


def test_stacks_bad_input(cluster: ddlf.Cluster) -> None:
    with pytest.raises(IndexError):
        cluster.stacks([5])
    one = cluster.stacks([1])
    assert len(one) == 1 and one[0]["address"] == cluster.addresses[1]
    assert "ddlf/worker" in one[0]["python"]  # the interpreter thread, waiting for its next request


def test_ddlf_stacks_command(daemon: Daemon) -> None:
    env = {**os.environ, "DDLF_TOKEN": daemon.token or ""}
    out = subprocess.run(
        [sys.executable, "-m", "ddlf.cli", "stacks", daemon.address],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("==> ") and daemon.address in out.stdout, out.stdout
    assert "idle; 0 queued" in out.stdout and "most recent call first" in out.stdout, out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "ddlf.cli", "stacks", daemon.address, "127.0.0.1:1", "--timeout", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert bad.returncode == 1 and "127.0.0.1:1" in bad.stderr and daemon.address in bad.stdout


def _open_files(pid: int) -> list[str]:
    """What a process's descriptors point at now (one closed while they are read is left out)."""
    targets = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):  # the daemon closed it meanwhile (a connection, a file it read)
            targets.append(os.readlink(fd))
    return targets


def test_the_stack_file_has_no_name_a_killed_daemon_could_leave(daemon: Daemon) -> None:
    """The daemon keeps its stack file open without a name: SIGKILL leaves nothing in the temporary directory."""
    files = [target for target in _open_files(daemon.proc.pid) if "ddlf-stacks-" in target]
    assert files and all(f.endswith(" (deleted)") for f in files), files
    assert not any(Path(f.removesuffix(" (deleted)")).exists() for f in files), files
    text = subprocess.run(
        [sys.executable, "-m", "ddlf.cli", "stacks", daemon.address],
        capture_output=True,
        text=True,
        env={**os.environ, "DDLF_TOKEN": daemon.token or ""},
        timeout=60,
    )
    assert text.returncode == 0 and "most recent call first" in text.stdout, text.stderr


def _reduce_ones(spec: object) -> float:
    import numpy as np

    from ddlf.worker.reduction import reduce_arrays

    data = np.ones(1000, np.float32)
    reduce_arrays([data], spec, "sum")
    return float(data[0])


@pytest.mark.parametrize("hierarchical", [True, False])
def test_stacks_say_on_whom_a_waiting_collective_waits(cluster: ddlf.Cluster, hierarchical: bool) -> None:
    """Worker 0 enters an all-reduce that worker 1 has not joined: its stacks name the call and whom it waits on
    (the member at the host's barrier, or the left neighbour's link); once worker 1 joins, both finish and the
    call is gone from the list."""
    ring = cluster.ring([0, 1], hierarchical=hierarchical)
    assert all(not s["collectives"] for s in cluster.stacks())  # both idle: no collective listed
    result: dict[str, object] = {}
    first = threading.Thread(target=lambda: result.setdefault("0", cluster.run_on(0, _reduce_ones, ring.spec(0))))
    first.start()
    try:
        # Answered while worker 0 waits in the ring: read until it is there (it cannot end before worker 1 joins).
        while not (waiting := cluster.stacks([0])[0])["collectives"]:
            assert first.is_alive(), (result, waiting)
            time.sleep(0.05)
        (call,) = waiting["collectives"]
        assert call.startswith("all-reduce of 1000 float32 on ring"), call
        who = "member 1" if hierarchical else "rank 1"
        assert "waiting on" in call and who in call and cluster.addresses[1] in call, call
        assert "_reduce_ones" in waiting["python"], waiting["python"]
        assert "collective: all-reduce of 1000 float32" in format_stacks(waiting)
    finally:
        # Pass or fail, worker 1 joins: worker 0 must not wait out the barrier into the next test.
        joined = cluster.run_on(1, _reduce_ones, ring.spec(1)) if first.is_alive() else None
        first.join(60)
    assert joined == 2.0
    assert result["0"] == 2.0
    assert not cluster.stacks([0])[0]["collectives"]
    cluster.retire_ring(ring)
