"""End-to-end tests of the core runtime: real daemons on loopback, every public call of the Cluster API."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import ddlf
from ddlf import _ddlf

from ..conftest import MNIST_DIR, Daemon, ctrl_c_interrupts, pid_alive, wait_until
from .apps import SmallMnist

# -- variables -----------------------------------------------------------------------------------------


def test_set_get_delete_variables(cluster: ddlf.Cluster) -> None:
    cluster.set("lr", 0.01)
    assert cluster.get("lr") == [0.01, 0.01]
    cluster.set("cfg", {"layers": [1, 2], "name": "x"})
    assert cluster.variables() == [["cfg", "lr"], ["cfg", "lr"]]
    cluster.delete("lr")
    assert cluster.variables() == [["cfg"], ["cfg"]]


def test_scatter_gives_each_worker_its_own_value(cluster: ddlf.Cluster) -> None:
    a0, a1 = np.arange(5, dtype=np.float32), np.ones((2, 3), dtype=np.float64)
    cluster.scatter("shard", [a0, a1])
    got = cluster.get("shard")
    np.testing.assert_array_equal(got[0], a0)
    np.testing.assert_array_equal(got[1], a1)
    assert got[1].dtype == np.float64 and got[1].shape == (2, 3)


def test_scatter_needs_one_value_per_worker(cluster: ddlf.Cluster) -> None:
    with pytest.raises(ValueError, match="one per worker"):
        cluster.scatter("x", [1, 2, 3])


def test_set_on_a_subset_of_workers(cluster: ddlf.Cluster) -> None:
    cluster.set("only1", 5, workers=[1])
    assert cluster.variables() == [[], ["only1"]]
    with pytest.raises(IndexError):
        cluster.set("x", 1, workers=[7])


def test_unknown_variable_is_a_clear_error_naming_it(cluster: ddlf.Cluster) -> None:
    with pytest.raises(ddlf.NotFoundError, match="no variable named 'nope'") as info:
        cluster.get("nope")
    assert info.value.worker_id == 0
    assert info.value.address == cluster.addresses[0]
    with pytest.raises(ddlf.NotFoundError, match="nope"):
        cluster.delete("nope")


def test_except_ddlf_error_catches_what_the_cluster_refuses(cluster: ddlf.Cluster) -> None:
    """Each is a ``ddlf.DdlfError`` and still the built-in a Python user would catch (ddlf.errors' contract)."""
    with pytest.raises(ddlf.DdlfError) as info:
        cluster.get("nope")  # a variable a worker does not hold
    assert isinstance(info.value, ddlf.NotFoundError) and isinstance(info.value, KeyError)
    assert "no variable named 'nope'" in str(info.value) and not str(info.value).startswith(("'", '"'))
    with pytest.raises(ddlf.DdlfError) as info:
        cluster.set("x", 1, workers=[7])  # a worker the cluster does not have
    assert isinstance(info.value, ddlf.OutOfRangeError) and isinstance(info.value, IndexError)
    with pytest.raises(ddlf.DdlfError) as info:
        cluster.scatter("x", [1, 2, 3])  # one value too many
    assert isinstance(info.value, ddlf.ConfigError) and isinstance(info.value, ValueError)
    with pytest.raises(ddlf.DdlfError) as info:
        cluster.add_function(42)  # type: ignore[arg-type]  # not a function
    assert isinstance(info.value, ddlf.ConfigTypeError) and isinstance(info.value, TypeError)
    with pytest.raises(ddlf.DdlfError) as info:
        cluster.allreduce("nope")  # ddlf's own lookup on the workers: their NotFoundError comes back
    assert isinstance(info.value, ddlf.RemoteError) and info.value.raised("NotFoundError")
    assert cluster.run(lambda: "alive") == ["alive", "alive"]


# -- functions ------------------------------------------------------------------------------------------


def step(worker, x):
    worker.vars["n"] = worker.vars.get("n", 0) + x
    return worker.id, worker.vars["n"]


def test_functions_persist_and_receive_the_worker_context(cluster: ddlf.Cluster) -> None:
    assert cluster.add_function(step) == "step"
    assert cluster.functions() == [["step"], ["step"]]
    assert cluster.run("step", 1) == [(0, 1), (1, 1)]
    assert cluster.run(step, 1) == [(0, 2), (1, 2)]
    assert cluster.run_on(1, "step", 5) == (1, 7)
    assert cluster.run_each("step", [(1,), (2,)]) == [(0, 3), (1, 9)]
    assert cluster.run(lambda worker: worker.n_workers) == [2, 2]
    cluster.remove_function("step")
    assert "step" not in cluster.functions()[0]
    with pytest.raises(ddlf.NotFoundError, match="no function named 'step'"):
        cluster.run("step", 1)


def test_functions_are_sent_once_then_called_by_name(cluster: ddlf.Cluster) -> None:
    def square(x):
        return x * x

    before = [s["requests_served"] for s in cluster.status()]
    for i in range(5):
        assert cluster.run(square, i) == [i * i, i * i]
    after = [s["requests_served"] for s in cluster.status()]
    # One push of the function plus five calls by name on each worker: never a second push.
    assert [a - b for a, b in zip(after, before)] == [6, 6]


def test_closures_lambdas_and_kwargs(cluster: ddlf.Cluster) -> None:
    offset = 10

    def add(x, *, y=0):
        return x + y + offset

    assert cluster.run(add, 1, y=2) == [13, 13]
    assert cluster.call(add, (1,), {"y": 5}, workers=[0]) == [16]
    assert cluster.run(lambda a, b: a * b, 3, 4) == [12, 12]


def test_a_changed_function_is_pushed_again(cluster: ddlf.Cluster) -> None:
    def f():
        return 1

    assert cluster.run(f) == [1, 1]

    def f():
        return 2

    assert cluster.run(f) == [2, 2]


def test_exec_names_persist_in_worker_globals(cluster: ddlf.Cluster) -> None:
    cluster.exec("import math\nk = math.pi\ndef twice(x):\n    return 2 * x\n")
    assert cluster.run(lambda worker: worker.globals["k"]) == [np.pi, np.pi]
    assert cluster.run("twice", 21) == [42, 42]


def test_numpy_arrays_round_trip_without_pickling_inline(cluster: ddlf.Cluster) -> None:
    w = [np.random.default_rng(0).standard_normal((256, 128)).astype(np.float32), np.arange(10)]
    out = cluster.run(lambda ws: [x * 2 for x in ws], w)
    for got in out:
        np.testing.assert_array_equal(got[0], w[0] * 2)
        np.testing.assert_array_equal(got[1], w[1] * 2)


def test_async_twins(cluster: ddlf.Cluster) -> None:
    async def main():
        await cluster.set_async("a", 3)
        r1, r2 = await asyncio.gather(
            cluster.run_async(lambda worker: worker.vars["a"] + worker.id),
            cluster.get_async("a"),
        )
        return r1, r2

    assert asyncio.run(main()) == ([3, 4], [3, 3])


def test_upload_module_makes_local_code_importable(cluster: ddlf.Cluster, tmp_path) -> None:
    pkg = tmp_path / "mylocalpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .helpers import triple\n")
    (pkg / "helpers.py").write_text("def triple(x):\n    return 3 * x\n")
    assert cluster.upload_module(pkg) == "mylocalpkg"

    def use():
        import mylocalpkg

        return mylocalpkg.triple(7)

    assert cluster.run(use) == [21, 21]
    # A new version replaces the old one.
    (pkg / "helpers.py").write_text("def triple(x):\n    return 300 * x\n")
    cluster.upload_module(pkg)
    assert cluster.run(use) == [2100, 2100]


def test_upload_module_rejects_bad_input(cluster: ddlf.Cluster, tmp_path) -> None:
    with pytest.raises(ValueError):
        cluster.upload_module(tmp_path / "missing.py")
    empty_dir = tmp_path / "notapackage"
    empty_dir.mkdir()
    with pytest.raises(ValueError, match="not a package"):
        cluster.upload_module(empty_dir)


# -- errors ---------------------------------------------------------------------------------------------


def test_remote_exception_carries_type_message_traceback_and_worker(cluster: ddlf.Cluster) -> None:
    def fails(worker):
        if worker.id == 1:
            raise ValueError(f"bad value on {worker.id}")
        return "ok"

    with pytest.raises(ddlf.RemoteError) as info:
        cluster.run(fails)
    err = info.value
    assert err.worker_id == 1
    assert err.address == cluster.addresses[1]
    assert err.remote_type == "ValueError"
    assert err.remote_message == "bad value on 1"
    assert "in fails" in err.remote_traceback and "raise ValueError" in err.remote_traceback
    assert "_executor.py" not in err.remote_traceback
    # The worker keeps serving.
    assert cluster.run(lambda: "alive") == ["alive", "alive"]


def test_remote_traceback_shows_lines_only_the_master_has(cluster: ddlf.Cluster) -> None:
    # A notebook cell: its source lives in the master's linecache, never in a file the worker could read.
    import linecache

    source = "def cell_fn(worker):\n    return {}['missing key']\n"
    name = "<ipython-input-7-ddlf>"
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    namespace: dict = {}
    exec(compile(source, name, "exec"), namespace)
    try:
        with pytest.raises(ddlf.RemoteError) as info:
            cluster.run_on(0, namespace["cell_fn"])
    finally:
        linecache.cache.pop(name, None)
    assert info.value.remote_type == "KeyError"
    assert f"File \"{name}\", line 2, in cell_fn\n    return {{}}['missing key']" in info.value.remote_traceback
    assert cluster.run(lambda: "alive") == ["alive", "alive"]


def test_unpicklable_result_is_a_clear_error(cluster: ddlf.Cluster) -> None:
    with pytest.raises(ddlf.SerializationError, match="cannot be pickled"):
        cluster.run(lambda: __import__("threading").Lock())
    assert cluster.run(lambda: 1) == [1, 1]


def test_unpicklable_argument_is_a_clear_error(cluster: ddlf.Cluster) -> None:
    import threading

    with pytest.raises(ddlf.SerializationError, match="cannot serialize"):
        cluster.run(lambda x: x, threading.Lock())


def test_function_that_cannot_load_on_workers(cluster: ddlf.Cluster, tmp_path) -> None:
    # A function pickled by reference to a module that only exists on the master, found on a directory that is
    # neither the script's nor the working one (so not shipped automatically, see test_script_code.py).
    (tmp_path / "masteronly_mod.py").write_text("def f():\n    return 1\n")
    sys.path.append(str(tmp_path))
    try:
        import masteronly_mod

        with pytest.raises(ddlf.RemoteError, match="upload_module"):
            cluster.add_function(masteronly_mod.f)
        cluster.upload_module(tmp_path / "masteronly_mod.py")
        assert cluster.run(masteronly_mod.f) == [1, 1]
    finally:
        sys.path.remove(str(tmp_path))


def test_malformed_requests_are_refused_and_the_worker_keeps_serving(cluster: ddlf.Cluster) -> None:
    client = cluster._client
    # Garbage where a pickle should be.
    [reply] = client.call([0], _ddlf.OPS["SET_VAR"], "x", "", b"\x80\x05garbage", [], 5.0)
    assert isinstance(reply.error, ddlf.RemoteError) and reply.error.kind == "bad_request"
    # An operation code the protocol does not define.
    [reply] = client.call([0], 999, "x", "", b"", [], 5.0)
    assert isinstance(reply.error, ddlf.RequestRejected) and reply.error.code == "malformed"
    # A function payload that is not a function.
    [reply] = client.call([0], _ddlf.OPS["ADD_FUNCTION"], "f", "d", b"not a pickle", [], 5.0)
    assert isinstance(reply.error, ddlf.RemoteError)
    # Empty names.
    with pytest.raises(ddlf.RemoteError, match="non-empty name"):
        cluster.set("", 1)
    # Module paths that escape the module directory.
    [reply] = client.call(
        [0], _ddlf.OPS["UPLOAD_MODULE"], "evil", "", __import__("pickle").dumps({"../evil.py": b"x"}), [], 5.0
    )
    assert isinstance(reply.error, ddlf.RemoteError) and "refusing module path" in reply.error.remote_message
    assert cluster.run(lambda: "still serving") == ["still serving", "still serving"]
    assert cluster.status()[0]["requests_rejected"] >= 1


@pytest.mark.fresh_daemons("a daemon started with --max-message-size")
def test_oversized_request_is_refused_and_the_worker_keeps_serving() -> None:
    d = Daemon("--max-message-size", "100000")
    try:
        c = ddlf.Cluster([d.address], d.token)
        with pytest.raises(ddlf.RequestRejected, match="exceeds the limit of 100000 bytes"):
            c.set("big", np.zeros(1_000_000, dtype=np.uint8))
        c.set("small", np.zeros(10))
        assert c.variables() == [["small"]]
    finally:
        d.stop()


def _wait_for_gate(path: str) -> str:
    """Block until the test creates ``path`` (at most 30 s): a call that ends only after the master has moved on."""
    deadline = time.monotonic() + 30
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    return "released" if os.path.exists(path) else "gave up"


def test_timeout_gives_deadline_exceeded_not_a_hang(cluster: ddlf.Cluster, tmp_path) -> None:
    gate = str(tmp_path / "gate")
    try:
        with pytest.raises(ddlf.DeadlineExceeded) as info:
            # the call cannot end before the gate opens, which happens only after the deadline was raised
            cluster.run_on(0, _wait_for_gate, gate, timeout=0.3)
    finally:
        open(gate, "w").close()
    assert isinstance(info.value, ddlf.WorkerUnavailable)
    assert isinstance(info.value, TimeoutError)


def test_ping_and_status_answer_while_a_function_runs(cluster: ddlf.Cluster) -> None:
    async def main():
        slow = asyncio.ensure_future(cluster.run_on_async(0, lambda: time.sleep(1.0) or "done"))
        await asyncio.sleep(0.3)
        # deadlines shorter than what is left of the function: a ping or status queued behind it would fail
        rtts = cluster.ping(timeout=0.5)
        status = cluster.status(timeout=0.5)
        return await slow, rtts, status

    result, rtts, status = asyncio.run(main())
    assert result == "done"
    assert len(rtts) == 2 and all(r >= 0 for r in rtts)
    # answered while the function ran (its status says so), not queued behind it
    assert status[0]["running"] == "run:<lambda>#" + status[0]["running"].split("#")[1]
    assert status[0]["running_for_s"] > 0.1
    assert status[1]["running"] is None


# -- persistence, connections, auth ---------------------------------------------------------------------


def test_state_persists_across_separate_connections(daemon: Daemon) -> None:
    first = ddlf.Cluster([daemon.address], daemon.token)
    first.set("kept", [1, 2, 3])

    def remembered(worker):
        return worker.vars["kept"][::-1]

    first.add_function(remembered)
    first.close()
    # A second script: a new process connecting later sees what the first left.
    code = textwrap.dedent(
        f"""
        import ddlf
        c = ddlf.Cluster([{daemon.address!r}], {daemon.token!r})
        print(c.get("kept")[0], c.run("remembered")[0], c.functions()[0])
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[1, 2, 3] [3, 2, 1] ['remembered']"


def test_wrong_or_missing_token_is_refused_and_nothing_runs(daemon: Daemon, tmp_path) -> None:
    marker = tmp_path / "side-effect"
    good = ddlf.Cluster([daemon.address], daemon.token)
    # Counted since the daemon started: an earlier test on the shared daemon may have had a request refused.
    before = good.status()[0]["requests_rejected"]
    with pytest.raises(ddlf.AuthenticationError) as info:
        ddlf.Cluster([daemon.address], "wrong-token", connect_timeout=5)
    assert info.value.address == daemon.address
    with pytest.raises(ddlf.AuthenticationError):
        _connect_without_token(daemon.address)
    # Even a hand-built call with the wrong token: refused before the body is decoded; the file never appears.
    assert good.status()[0]["requests_rejected"] == before + 2
    bad_client = _raw_client_or_none(daemon.address, "wrong-token")
    assert bad_client is None
    assert not marker.exists()
    good.run(lambda p: open(p, "w").close(), str(marker))
    assert marker.exists()


def _connect_without_token(address: str) -> ddlf.Cluster:
    saved = os.environ.pop("DDLF_TOKEN", None)
    try:
        return ddlf.Cluster([address], None, connect_timeout=5)
    finally:
        if saved is not None:
            os.environ["DDLF_TOKEN"] = saved


def _raw_client_or_none(address: str, token: str):
    try:
        return _ddlf.Client([address], token, 5.0)
    except ddlf.AuthenticationError:
        return None


def test_non_loopback_without_token_refuses_to_start() -> None:
    env = {k: v for k, v in os.environ.items() if k != "DDLF_TOKEN"}
    out = subprocess.run(
        [sys.executable, "-m", "ddlf.worker", "--listen", "0.0.0.0:0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert out.returncode == 2
    assert "--insecure" in out.stderr


@pytest.mark.fresh_daemons("a daemon started with --token-file")
def test_token_file_is_used(tmp_path) -> None:
    tf = tmp_path / "token"
    tf.write_text("from-a-file\n")
    d = Daemon("--token-file", str(tf), token=None)
    try:
        assert ddlf.Cluster([d.address], "from-a-file").ping()[0] < 1
        with pytest.raises(ddlf.AuthenticationError):
            ddlf.Cluster([d.address], "other")
    finally:
        d.stop()


def test_unreachable_address_raises_worker_unavailable_quickly() -> None:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(ddlf.WorkerUnavailable, match=f"127.0.0.1:{port}") as info:
        ddlf.Cluster([f"127.0.0.1:{port}"], "t", connect_timeout=60)
    assert "refused" in str(info.value).lower(), info.value  # refused at once, not the connect timeout


def test_kill_9_mid_call_raises_worker_unavailable_without_hanging(daemon: Daemon) -> None:
    c = ddlf.Cluster([daemon.address], daemon.token)

    async def main():
        call = asyncio.ensure_future(c.run_async(lambda: time.sleep(600)))
        await asyncio.sleep(0.5)
        daemon.proc.send_signal(signal.SIGKILL)
        with pytest.raises(ddlf.WorkerUnavailable) as info:
            await asyncio.wait_for(call, 60)  # only how long a hang may last: the sleep would take 600 s
        return info.value

    err = asyncio.run(main())
    assert not isinstance(err, ddlf.DeadlineExceeded), err
    assert err.address == daemon.address
    # Later calls fail too, as unavailable: not by waiting out their deadline.
    with pytest.raises(ddlf.WorkerUnavailable) as later:
        c.run(lambda: 1, timeout=60)
    assert not isinstance(later.value, ddlf.DeadlineExceeded), later.value


def test_shutdown_request_stops_the_daemon(daemon: Daemon) -> None:
    c = ddlf.Cluster([daemon.address], daemon.token)
    c.shutdown()
    assert daemon.proc.wait(10) == 0


@pytest.mark.fresh_daemons("signals end the daemon; its log is read")
def test_sigterm_and_sigint_stop_the_daemon_cleanly() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        d = Daemon()
        d.proc.send_signal(sig)
        assert d.proc.wait(10) == 0
        assert b"worker stopped" in d.proc.stderr.read()


def _leave_traces_for_the_exit(worker, path: str) -> None:
    import atexit
    import gc
    import threading
    import time
    from pathlib import Path

    import keras  # noqa: F401  (TensorFlow loaded: its finalization is what the daemon's quick exit skips)

    class Log:
        def __init__(self) -> None:
            self.file = open(path + ".buffered", "w")  # noqa: SIM115  (left open: the worker's exit closes it)
            self.me = self  # a cycle: only the garbage collector frees it, not the reference count

    log = Log()
    log.file.write("written, never flushed by the user")
    worker.vars["log"] = log
    gc.collect()
    gc.collect()  # survived twice: in the oldest generation, as a long-lived variable would be

    def late() -> None:
        time.sleep(0.5)
        Path(path + ".thread").write_text("finished")

    threading.Thread(target=late).start()  # not a daemon thread: the exit waits for it, as Python's does
    atexit.register(lambda: Path(path + ".atexit").write_text("ran"))


@pytest.mark.fresh_daemons("the daemon is shut down; its log is read")
def test_a_worker_asked_to_shut_down_runs_its_exit_handlers_and_releases_what_it_held(tmp_path) -> None:
    """The daemon leaves without the interpreter's slow finalization, but what finalization would do for the
    user happens: its threads finish, the objects the masters left there are released (a buffered file held in
    a reference cycle is flushed) and atexit handlers run."""
    d = Daemon()
    c = ddlf.Cluster([d.address], d.token)
    try:
        path = str(tmp_path / "trace")
        c.run(_leave_traces_for_the_exit, path)
        c.shutdown()
        assert d.proc.wait(10) == 0
        assert b"worker stopped" in d.proc.stderr.read()
        assert Path(path + ".buffered").read_text() == "written, never flushed by the user"
        assert Path(path + ".thread").read_text() == "finished"
        assert Path(path + ".atexit").read_text() == "ran"
    finally:
        c.close()
        d.stop()


def test_ctrl_c_interrupts_a_waiting_master(daemon: Daemon) -> None:
    code = textwrap.dedent(
        f"""
        import time, ddlf
        c = ddlf.Cluster([{daemon.address!r}], {daemon.token!r})
        print("calling", flush=True)
        try:
            c.run(lambda: time.sleep(20))
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        """
    )
    # The 20 s call ends with KeyboardInterrupt, well before it would return by itself.
    assert "interrupted" in ctrl_c_interrupts(code)


# -- local clusters: no orphans -------------------------------------------------------------------------


@pytest.mark.fresh_daemons("Cluster.local itself is under test")
def test_local_cluster_leaves_no_processes_after_close() -> None:
    c = ddlf.Cluster.local(2, threads=1)
    pids = c._local.pids()
    assert all(pid_alive(p) for p in pids)
    c.close()
    assert wait_until(lambda: not any(pid_alive(p) for p in pids), 10)
    with pytest.raises(ddlf.DdlfError, match="closed"):
        c.run(lambda: 1)
    c.close()  # idempotent
    with pytest.raises(ddlf.DdlfError, match="closed"), c:
        pass
    # What needs workers says so at once (train() once waited the rejoin timeout, 60 s, for "every worker is lost")...
    app = SmallMnist(c)
    for use in (lambda: app.train(epochs=1, verbose=0), app.evaluate, app.predict):
        with pytest.raises(ddlf.DdlfError, match="closed"):
            use()
    # ...and the master's own data needs none, even before any train(): the model comes from create_model().
    (x, y), _ = ddlf.datasets.mnist(MNIST_DIR)
    fresh = SmallMnist(c)
    assert fresh.predict(x[:10]).shape == (10, 10)
    assert SmallMnist(c).evaluate(x[:64], y[:64], return_dict=True)["loss"] > 0


def test_local_cluster_workers_die_when_the_master_is_killed() -> None:
    code = textwrap.dedent(
        """
        import sys, time, ddlf
        c = ddlf.Cluster.local(2, threads=1)
        print(*c._local.pids(), flush=True)
        time.sleep(60)
        """
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pids = [int(x) for x in p.stdout.readline().split()]
    assert len(pids) == 2 and all(pid_alive(x) for x in pids)
    p.kill()
    p.wait()
    assert wait_until(lambda: not any(pid_alive(x) for x in pids), 10)


def test_local_cluster_stops_at_interpreter_exit() -> None:
    code = "import ddlf\nc = ddlf.Cluster.local(2, threads=1)\nprint(*c._local.pids(), flush=True)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    pids = [int(x) for x in out.stdout.split()]
    assert len(pids) == 2
    assert wait_until(lambda: not any(pid_alive(x) for x in pids), 10)


def test_version_handshake_reports_versions(cluster: ddlf.Cluster) -> None:
    info = cluster.worker_info()
    assert [i["version"] for i in info] == [ddlf.__version__] * 2
    assert all(i["protocol_version"] == ddlf.PROTOCOL_VERSION for i in info)


def test_large_values_stream_with_no_size_limit(cluster: ddlf.Cluster) -> None:
    # 10 x 16 MB float32 arrays: far above gRPC's default 4 MB message limit, streamed in chunks both ways.
    weights = [np.full(4_000_000, i, dtype=np.float32) for i in range(10)]
    cluster.set("w", weights)
    sums = cluster.run(lambda worker: [float(a.sum()) for a in worker.vars["w"]])
    assert sums == [[4_000_000.0 * i for i in range(10)]] * 2
    back = cluster.get("w", workers=[1])[0]
    assert all(np.array_equal(a, b) for a, b in zip(back, weights))


def test_received_arrays_are_writable_in_place(cluster: ddlf.Cluster) -> None:
    cluster.set("w", np.zeros(1000, np.float32))

    def bump(worker):
        w = worker.vars["w"]
        w += 1  # in place, on the received memory
        return bool(w.flags.writeable), float(worker.vars["w"].sum())

    assert cluster.run(bump) == [(True, 1000.0)] * 2
    got = cluster.get("w")[0]
    got[:10] = 5  # results on the master are writable too
    assert got.flags.writeable and float(got.sum()) == 990 + 50
    # Through shared memory (opt-in, one machine) workers read the master's pooled segment in place: read-only, as
    # Ray's object store does; writing in place is refused, a copy is writable, and no worker sees another's.
    shm = ddlf.Cluster(cluster.addresses, cluster.token, shared_memory=True)
    assert all(i["shared_memory"] for i in shm.worker_info())
    shm.set("big", np.zeros(10_000_000, np.float32))
    with pytest.raises(ddlf.RemoteError, match="read-only"):
        shm.run(lambda worker: worker.vars["big"].__iadd__(1))
    shm.run(lambda worker: worker.vars.__setitem__("big", worker.vars["big"] + (worker.id + 1)))
    assert shm.run(lambda worker: float(worker.vars["big"][:4].sum())) == [4.0, 8.0]
    shm.delete("big")
    shm.close()


@pytest.mark.fresh_daemons("a daemon started with a thread cap in its environment")
def test_worker_threads_option_caps_math_libraries_from_the_start() -> None:
    env = {k: "" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    d = Daemon("--threads", "1", env=env)
    try:
        c = ddlf.Cluster([d.address], d.token)
        got = c.run(lambda: (os.environ["OMP_NUM_THREADS"], os.environ["OPENBLAS_NUM_THREADS"]))[0]
        assert got == ("1", "1")
    finally:
        d.stop()


@pytest.mark.fresh_daemons("Cluster.local itself is under test")
def test_local_workers_started_from_a_thread_outlive_that_thread() -> None:
    # Linux's parent-death signal fires when the starting *thread* exits; local workers must not rely on it.
    import threading

    box: dict[str, ddlf.Cluster] = {}
    t = threading.Thread(target=lambda: box.setdefault("c", ddlf.Cluster.local(1, threads=1)))
    t.start()
    t.join()
    c = box["c"]
    try:
        time.sleep(1.5)
        assert all(pid_alive(p) for p in c._local.pids())
        assert c.run(lambda: "alive") == ["alive"]
    finally:
        c.close()


@pytest.mark.fresh_daemons("a daemon with its own TMPDIR, stopped to check what it left")
def test_a_worker_leaves_no_temporary_files_behind(tmp_path) -> None:
    from ..conftest import Daemon

    d = Daemon(env={"TMPDIR": str(tmp_path)})
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "leftover_probe.py").write_text("X = 1\n")
    with ddlf.Cluster([d.address], token=d.token) as c:
        c.upload_module(tmp_path / "src" / "leftover_probe.py")
        assert list(tmp_path.glob("ddlf-modules-*"))
    d.stop()
    assert not list(tmp_path.glob("ddlf-modules-*"))
