"""Direct lanes: calls travel as plain frames read by the worker's interpreter thread, pings on a lane of their
own answered by a daemon thread; concurrent callers and masters that opt out use gRPC. Either way the results,
errors and faults are the same."""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import ddlf

from ..conftest import POOL, Daemon, all_threads_stopped, ctrl_c_interrupts, wait_until


def _ident(x):
    return x


def _boom():
    raise ValueError("raised on the worker")


@pytest.fixture
def both(daemon: Daemon):
    """Two masters on one daemon: one with a direct lane, one over gRPC only."""
    lane = ddlf.Cluster([daemon.address], daemon.token)
    grpc = ddlf.Cluster([daemon.address], daemon.token, direct_lane=False)
    yield lane, grpc
    lane.close()
    grpc.close()


def _sleep_then_mark(seconds: float, path: str) -> None:
    time.sleep(seconds)
    with open(path, "w"):
        pass


def test_a_master_opens_a_lane_unless_told_not_to(both) -> None:
    lane, grpc = both
    assert lane.worker_info()[0]["direct_lane"] is True
    assert lane.worker_info()[0]["ping_lane"] is True
    assert grpc.worker_info()[0]["direct_lane"] is False
    assert grpc.worker_info()[0]["ping_lane"] is False


def _wait_for_then_mark(release: str, marker: str) -> None:
    """A job that runs until the test creates ``release`` (at most five minutes: a cap for a test that died, long
    past what a loaded machine takes for the pings meanwhile), then leaves ``marker``."""
    end = time.monotonic() + 300
    while not os.path.exists(release) and time.monotonic() < end:
        time.sleep(0.01)
    with open(marker, "w"):
        pass


def test_pings_ride_their_own_lane_and_are_answered_while_a_job_runs(both, tmp_path) -> None:
    lane, grpc = both
    release, marker = tmp_path / "release", tmp_path / "done"
    before = grpc.status()[0]["lane_pings"]
    for _ in range(20):
        assert lane.ping(timeout=10)[0] > 0
    assert grpc.status()[0]["lane_pings"] == before + 20  # every one on the lane (status itself is gRPC)
    job = threading.Thread(target=lane.run, args=(_wait_for_then_mark, str(release), str(marker)))
    job.start()
    try:
        assert wait_until(lambda: grpc.status()[0]["running"] is not None, 10)
        errors: list[BaseException] = []

        def pings(c: ddlf.Cluster) -> None:
            try:
                for _ in range(50):
                    (rtt,) = c.ping(timeout=10)
                    assert rtt > 0
            except BaseException as exc:  # reported by the assertion below
                errors.append(exc)

        # Three threads on the lane master at once (one holds the ping lane, the others fall back to gRPC) and one
        # on the gRPC master, all while the worker's interpreter is held in the job.
        threads = [threading.Thread(target=pings, args=(c,)) for c in (lane, lane, lane, grpc)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert not marker.exists() and grpc.status()[0]["running"] is not None
        assert lane.worker_info()[0]["ping_lane"] is True
        assert grpc.status()[0]["lane_pings"] > before + 20
    finally:
        release.touch()
        job.join(60)
    assert marker.exists()


@pytest.mark.fresh_daemons("one daemon stopped, one killed and restarted on its own address")
def test_a_stopped_worker_holds_up_no_other_workers_ping() -> None:
    stopped, other = Daemon("--threads", "1", token=None), Daemon("--threads", "1", token=None)
    again: Daemon | None = None
    try:
        # Two masters, each with its lanes open to both daemons (a deadline closes a lane: each scenario gets one).
        c, d = (ddlf.Cluster([stopped.address, other.address], token=None) for _ in range(2))
        old = c.worker_info()[1]["instance"]
        stopped.proc.send_signal(signal.SIGSTOP)
        try:
            assert wait_until(lambda: all_threads_stopped(stopped.proc.pid))
            beats = c._client.heartbeat([0, 1], 5.0)
            assert isinstance(beats[0], ddlf.DeadlineExceeded), beats
            # Worker 1's answer is read when it comes: read after worker 0's deadline, it would be 5 s or more.
            rtt, instance = beats[1]
            assert rtt < 5.0 and instance == old
            # Worker 1 restarts: its ping lane breaks, and the ping is retried over gRPC at once, within the
            # time left, not after worker 0's deadline: the new daemon's answer comes back.
            other.proc.kill()
            other.proc.wait()
            again = Daemon("--threads", "1", "--listen", other.address, token=None)
            assert d.worker_info()[0]["ping_lane"] and d.worker_info()[1]["ping_lane"]
            beats = d._client.heartbeat([0, 1], 5.0)
            assert isinstance(beats[0], ddlf.DeadlineExceeded), beats
            assert not isinstance(beats[1], BaseException), beats
            assert beats[1][1] != old
        finally:
            stopped.proc.send_signal(signal.SIGCONT)
        c.close()
        d.close()
    finally:
        for d in (stopped, other, again):
            if d is not None:
                d.stop()


def test_a_stopped_workers_ping_times_out_then_its_ping_lane_comes_back(daemon: Daemon) -> None:
    c = ddlf.Cluster([daemon.address], daemon.token)
    instance = c.worker_info()[0]["instance"]
    assert c.ping()[0] > 0
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        assert wait_until(lambda: all_threads_stopped(daemon.proc.pid))  # else a ping may still be answered
        with pytest.raises(ddlf.DeadlineExceeded):
            c.ping(timeout=0.3)
        # An answer may still come on it: the lane is closed, and the next ping goes over gRPC.
        assert c.worker_info()[0]["ping_lane"] is False
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    assert c.ping(timeout=10)[0] > 0
    # That answer showed the worker alive: its ping lane opened again, to the same daemon.
    assert c.worker_info()[0]["ping_lane"] is True
    assert c.worker_info()[0]["instance"] == instance
    assert c.ping(timeout=10)[0] > 0
    c.close()


def test_ctrl_c_ends_a_ping_to_a_stopped_worker(daemon: Daemon) -> None:
    code = "import contextlib, os, signal, time, ddlf\n" + inspect.getsource(all_threads_stopped)
    code += textwrap.dedent(
        f"""
        c = ddlf.Cluster([{daemon.address!r}], {daemon.token!r})
        assert c.worker_info()[0]["ping_lane"]
        c.ping()
        os.kill({daemon.proc.pid}, signal.SIGSTOP)
        while not all_threads_stopped({daemon.proc.pid}):  # else a ping may still be answered
            time.sleep(0.01)
        print("calling", flush=True)
        try:
            c.ping(timeout=None)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        """
    )
    try:
        assert "interrupted" in ctrl_c_interrupts(code)
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    with ddlf.Cluster([daemon.address], daemon.token) as c:
        assert c.ping()[0] > 0


def test_lane_and_grpc_give_the_same_values_small_and_large(both) -> None:
    lane, grpc = both
    small = {"a": [1, 2.5, "x"], "arr": np.arange(10, dtype=np.float32)}
    mid = np.random.default_rng(0).random(400_000)  # 3.2 MB: a small CNN's weights, on the lane
    large = np.random.default_rng(0).random(1_200_000)  # 9.6 MB: more than the sockets' buffers hold
    for c in both:
        out = c.run(_ident, small)[0]
        assert out["a"] == small["a"]
        np.testing.assert_array_equal(out["arr"], small["arr"])
        np.testing.assert_array_equal(c.run(_ident, mid)[0], mid)
        np.testing.assert_array_equal(c.run(_ident, large)[0], large)
        # A small request with a large reply comes back on the lane.
        c.set("big", large)
        np.testing.assert_array_equal(c.get("big")[0], large)
    assert lane.run(_ident, 7) == grpc.run(_ident, 7) == [7]


def test_remote_errors_are_the_same_on_the_lane(both) -> None:
    for c in both:
        with pytest.raises(ddlf.RemoteError, match="raised on the worker") as info:
            c.run(_boom)
        assert info.value.remote_type == "ValueError"
        assert "_boom" in info.value.remote_traceback
        with pytest.raises(ddlf.NotFoundError, match="no_such_function"):
            c.run("no_such_function")
        assert c.run(_ident, 1) == [1]  # still serving


def test_concurrent_callers_share_the_lane_or_fall_back_to_grpc(both) -> None:
    lane, _ = both
    errors: list[BaseException] = []
    results: dict[int, list[int]] = {}

    def caller(k: int) -> None:
        try:
            results[k] = [lane.run_on(0, _ident, k * 1000 + i) for i in range(50)]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert results == {k: [k * 1000 + i for i in range(50)] for k in range(4)}


def test_a_deadline_on_the_lane_then_calls_go_on(both, tmp_path) -> None:
    lane, _ = both
    marker = str(tmp_path / "slept")
    with pytest.raises(ddlf.DeadlineExceeded):
        lane.run(_sleep_then_mark, 1.0, marker, timeout=0.2)
    assert not os.path.exists(marker)  # raised while the worker still slept, not when the call ended
    # The lane's state is unknown after a deadline: it is closed, and the next call goes over gRPC (waiting its
    # turn behind the sleep still running on the worker). That answer shows the worker alive: the lane reopens.
    assert lane.worker_info()[0]["direct_lane"] is False
    assert lane.run(_ident, "after") == ["after"]
    assert lane.worker_info()[0]["direct_lane"] is True
    assert lane.run(_ident, "on the new lane") == ["on the new lane"]


def test_a_killed_worker_fails_a_lane_call_with_worker_unavailable(daemon: Daemon) -> None:
    c = ddlf.Cluster([daemon.address], daemon.token)
    assert c.run(_ident, 1) == [1]
    box: dict[str, BaseException] = {}

    def call() -> None:
        try:
            c.run(time.sleep, 600)
        except BaseException as exc:
            box["exc"] = exc

    t = threading.Thread(target=call)
    t.start()
    time.sleep(0.5)
    daemon.proc.kill()
    t.join(60)  # only how long a hang may last: the sleep would take 600 s
    assert not t.is_alive()
    assert isinstance(box.get("exc"), ddlf.WorkerUnavailable), box
    assert not isinstance(box["exc"], ddlf.DeadlineExceeded), box
    assert daemon.address in str(box["exc"])


def test_a_large_lane_request_to_a_stopped_worker_fails_within_the_heartbeat_bound(daemon: Daemon) -> None:
    """An 8 MB request does not fit the sockets' buffers: its write waits on a stopped worker, and the master's
    heartbeat, not the (absent) deadline, ends the wait."""
    c = ddlf.Cluster([daemon.address], daemon.token, heartbeat_interval=0.5, heartbeat_timeout=1.5)
    big = np.ones(1_000_000)  # 8 MB: more than the sockets' buffers hold
    np.testing.assert_array_equal(c.run(_ident, big)[0], big)
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.warns(RuntimeWarning, match="lost"), pytest.raises(ddlf.WorkerUnavailable, match="heartbeat"):
            c.run(_ident, big)
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    # Woken, the worker answers again: the broken lane is reopened or gRPC carries the call.
    assert wait_until(lambda: c.recover() == [0] or not c.lost_workers, 10)
    np.testing.assert_array_equal(c.run(_ident, big)[0], big)
    c.close()


@pytest.mark.fresh_daemons("a daemon started with --keepalive")
def test_grpc_stays_healthy_while_only_the_lane_is_used() -> None:
    # The daemon pings each master every 0.3 s and drops it after 0.5 s without an answer. With every call on the
    # lane, the master's gRPC connection carries nothing for seconds; it must still answer those pings.
    d = Daemon("--keepalive", "0.3", "0.5")
    try:
        c = ddlf.Cluster([d.address], d.token)
        assert c.run(_ident, 1) == [1]  # waits for the daemon's preload: on a loaded machine that may take seconds
        # At least 3 s of lane-only traffic (6 keepalive timeouts), and at least 20 calls however slow the machine.
        end, calls = time.monotonic() + 3.0, 1
        while time.monotonic() < end or calls < 20:
            assert c.run(_ident, 1) == [1]
            calls += 1
            time.sleep(0.01)
        assert c.status()[0]["requests_served"] > 10  # status is gRPC only
        big = np.arange(300_000, dtype=np.float64)  # 2.4 MB
        np.testing.assert_array_equal(c.run(_ident, big)[0], big)
        assert not c.lost_workers and not c.events
        c.close()
    finally:
        d.stop()


def test_values_in_shared_memory_ride_the_lane_as_a_reference(daemon: Daemon) -> None:
    # 9.6 MB, but through shared memory only its reference is on the wire.
    big = np.random.default_rng(1).random(1_200_000)
    with ddlf.Cluster([daemon.address], daemon.token, shared_memory=True) as c:
        info = c.worker_info()[0]
        assert info["shared_memory"] is True and info["direct_lane"] is True
        for _ in range(3):  # pooled segments are reused call after call
            out = c.run(_ident, big)[0]
            np.testing.assert_array_equal(out, big)
        assert c.worker_info()[0]["direct_lane"] is True
    # The pool is this process's: leave it empty for tests that count its segments.
    ddlf._ddlf.release_shared_memory()


@pytest.mark.fresh_daemons("Cluster.local's refusals are under test")
def test_bad_lane_settings_are_refused_clearly() -> None:
    for bad in (-1, 2_000_000, 1.5, True):
        with pytest.raises(ValueError, match="lane_spin_us must be a whole number of microseconds"):
            ddlf.Cluster(["127.0.0.1:1"], "t", lane_spin_us=bad)
    with pytest.raises(ValueError, match="lane_spin_us"):
        ddlf.Cluster.local(1, lane_spin_us=-5)  # refused before any daemon starts
    for args, words in (
        (["--lane-spin-us", "-1"], "--lane-spin-us: whole microseconds from 0 to 1000000"),
        (["--keepalive", "0", "1"], "--keepalive: a positive number of seconds"),
        (["--handshake-timeout", "nan"], "--handshake-timeout: a positive number of seconds"),
    ):
        out = subprocess.run(
            [sys.executable, "-m", "ddlf.worker", "--listen", "127.0.0.1:0", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2, out.stderr
        assert words in out.stderr


def test_large_lane_requests_to_several_workers_go_out_at_once() -> None:
    """3 MB to each of two workers (over the 1 MiB that puts each lane's request on its own thread): each gets its
    own value; a stopped worker fails the call by the heartbeat while the other answers; Ctrl-C ends the wait."""
    c = POOL.view(2, spare=True, heartbeat_interval=0.5, heartbeat_timeout=1.5)
    addresses, stopped = c.addresses, POOL.pid(1, spare=True)
    try:
        assert all(info["direct_lane"] for info in c.worker_info())
        values = [np.random.default_rng(k).random(400_000) for k in range(2)]  # 3.2 MB each
        c.scatter("w", values)
        for got, want in zip(c.get("w"), values):
            np.testing.assert_array_equal(got, want)
        for got in c.run(_ident, values[0]):
            np.testing.assert_array_equal(got, values[0])

        os.kill(stopped, signal.SIGSTOP)
        try:
            with pytest.warns(RuntimeWarning, match="lost"), pytest.raises(ddlf.WorkerUnavailable, match="heartbeat"):
                c.run(_ident, values[1])
            np.testing.assert_array_equal(c.run_on(0, _ident, values[1]), values[1])  # the other one still serves
        finally:
            os.kill(stopped, signal.SIGCONT)
        assert wait_until(lambda: c.recover() == [1] or not c.lost_workers, 10)
        c.close()

        code = textwrap.dedent(
            f"""
            import os, signal, numpy as np, ddlf
            c = ddlf.Cluster({addresses!r}, {POOL.token!r}, heartbeat_interval=30)
            c.run(lambda: 1)
            os.kill({stopped}, signal.SIGSTOP)
            print("calling", flush=True)
            try:
                c.run(lambda x: len(x), np.ones(400_000))
            except KeyboardInterrupt:
                print("interrupted", flush=True)
            """
        )
        try:
            # the call blocked on a stopped worker ends on Ctrl-C, not by itself
            assert "interrupted" in ctrl_c_interrupts(code)
        finally:
            os.kill(stopped, signal.SIGCONT)
        with ddlf.Cluster(addresses, POOL.token) as again:
            assert again.run(lambda: 2) == [2, 2]
    finally:
        os.kill(stopped, signal.SIGCONT)  # the pool's member serves the next test
        c.close()
