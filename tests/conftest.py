"""Shared fixtures: real worker daemons on loopback."""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

import ddlf

# The suite trains with Keras on TensorFlow, ddlf's default on CPU and so what a new user runs (ddlf itself sets
# nothing at import). It also runs the suite fastest here: 9.8 min for tests/e2e + tests/netns against 19.7 on JAX
# (compiling dominates short runs). `KERAS_BACKEND=jax scripts/test.sh` runs it on JAX.
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# Local daemons start bare (no Keras preloaded): most tests never train, and two cores are few. The preload has
# its own tests (test_backends.py, test_torch.py), which ask for it.
os.environ.setdefault("DDLF_PRELOAD", "")


def pytest_configure(config: pytest.Config) -> None:
    """The pytest process imports TensorFlow (Keras's data utilities do, when it is installed) and later PyTorch's
    compiler (test_torch.py): that order aborts where triton is installed, so load the compiler first
    (ddlf.frameworks.loading). Here, not at import: workers that unpickle a test's function import this module too."""
    from ddlf.frameworks.loading import load_torch_compiler_first

    load_torch_compiler_first()
    # A suite started with SIGINT ignored (`&`, `nohup`, `setsid`) would hand that on to every child it starts,
    # and the Ctrl-C tests need it as in a terminal; a handled signal is reset to its default in a child.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # Under pytest-xdist, each test process gets its own node store (ddlf.data.node_store): a daemon's clean exit
    # sweeps the entries nobody holds, which a test in the other process may be keeping on purpose.
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and "DDLF_NODE_STORE" not in os.environ and os.path.isdir("/dev/shm"):
        store = f"/dev/shm/ddlf-tests-{worker}-{os.getpid()}"
        os.makedirs(store, exist_ok=True)
        os.environ["DDLF_NODE_STORE"] = store
        config.add_cleanup(lambda: shutil.rmtree(store, ignore_errors=True))


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Helper processes (``python -m benchmarks.relay``, ``tests/netns/multihost_master.py``) import from the checkout.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
MNIST_DIR = os.path.join(REPO, "examples", "data", "mnist")


DAEMONS_STARTED = [0]
"""Worker daemons this test process started (``Cluster.local``, :class:`Daemon`, the pool): printed at the end."""
DAEMONS_BY_MODULE: collections.Counter[str] = collections.Counter()
"""The same, by the test module that started them (``pool`` for the pool's members): the summary's top lines."""
TF_DAEMONS = [0]
"""Of those, the daemons that had imported TensorFlow when they were stopped (read from ``/proc/<pid>/maps``; a
daemon a test killed is not looked at)."""
_CURRENT_MODULE = ["(no test)"]
OWN_DAEMONS: collections.Counter[str] = collections.Counter()
"""Daemons started by each test itself (its body or its function-scoped fixtures; not the pool's, not the shared
``daemon``): a test that does must say why (``@pytest.mark.fresh_daemons("why")``, or its module's
``FRESH_DAEMONS``), or it fails (:func:`_fresh_daemons_say_why`)."""
_CURRENT_TEST = [""]


def _count_start() -> None:
    DAEMONS_STARTED[0] += 1
    DAEMONS_BY_MODULE[_CURRENT_MODULE[0]] += 1
    if _CURRENT_MODULE[0] not in ("pool", "shared daemon") and _CURRENT_TEST[0]:
        OWN_DAEMONS[_CURRENT_TEST[0]] += 1


def _imported_tensorflow(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return "libtensorflow" in f.read()
    except OSError:
        return False


def _count_daemon_starts() -> None:
    from ddlf.cluster import local

    start = local.start_worker
    terminate_all = local._terminate_all

    def counted(*args: object, **kwargs: object) -> subprocess.Popen[bytes]:
        _count_start()
        return start(*args, **kwargs)  # type: ignore[arg-type]

    def looked_at(processes: list[subprocess.Popen[bytes]], directory: str) -> None:
        TF_DAEMONS[0] += sum(p.poll() is None and _imported_tensorflow(p.pid) for p in processes)
        terminate_all(processes, directory)

    local.start_worker = counted  # type: ignore[assignment]
    local._terminate_all = looked_at  # type: ignore[assignment]


_count_daemon_starts()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: object) -> Iterator[None]:
    _CURRENT_MODULE[0] = item.nodeid.split("::")[0]
    yield
    _CURRENT_MODULE[0] = "(no test)"


@pytest.fixture(autouse=True)
def _fresh_daemons_say_why(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that starts daemons of its own (not the pool's: it signals, kills or configures them, or runs a
    script that starts its own) says why, so that the suite's daemon count stays where it is on purpose."""
    _CURRENT_TEST[0] = request.node.nodeid
    try:
        yield
    finally:
        _CURRENT_TEST[0] = ""
    started = OWN_DAEMONS.get(request.node.nodeid, 0)
    says_why = request.node.get_closest_marker("fresh_daemons") or getattr(request.module, "FRESH_DAEMONS", None)
    if started and not says_why:
        pytest.fail(
            f"this test started {started} worker daemon(s) of its own: take them from the pool (`pooled`, "
            "`cluster`, `daemon`; a fault test's victims with spare=True), or say why it cannot "
            '(@pytest.mark.fresh_daemons("why"))'
        )


class DaemonPool:
    """Worker daemons this test process keeps for the tests: the ``cluster`` fixture and :func:`pooled` hand out
    views of them (a ``ddlf.Cluster`` connected to the first ``n``), reset first (``Cluster.reset``: runs,
    datasets, warm models, modules, variables, Keras' session), instead of starting daemons of their own. A member
    that died (a fault test killed it) is replaced before the next view; the pool grows to the most members asked
    for. Members preload Keras (``--preload keras``), which loads PyTorch's compiler first
    (``ddlf.frameworks.loading``): Keras and ``TorchModel`` tests share them."""

    ARGS = ("--preload", "keras")
    SPARE = 2
    """Members from this index on are spares: fault tests take their victims there (``spare=True``), away from
    members 0 and 1, which a module's ``cluster`` view holds for all of its tests."""

    def __init__(self) -> None:
        import secrets

        self.token = secrets.token_urlsafe(24)
        self.members: list[ddlf.cluster.local.LocalWorkers] = []

    def get(self, n: int = 2) -> list[str]:
        """The addresses of ``n`` live members (started or replaced as needed)."""
        from ddlf.cluster.local import LocalWorkers

        asked_by, _CURRENT_MODULE[0] = _CURRENT_MODULE[0], "pool"
        try:
            for i, member in enumerate(self.members[:n]):
                # Exited, or exiting: a leader that is a zombie while its other threads still unmap TensorFlow's
                # memory has closed its port already.
                if member.processes[0].poll() is not None or not pid_alive(member.processes[0].pid):
                    member.terminate()
                    self.members[i] = LocalWorkers(1, threads=1, token=self.token, extra_args=list(self.ARGS))
            while len(self.members) < n:
                self.members.append(LocalWorkers(1, threads=1, token=self.token, extra_args=list(self.ARGS)))
        finally:
            _CURRENT_MODULE[0] = asked_by
        return [m.addresses[0] for m in self.members[:n]]

    def view(self, n: int = 2, *, spare: bool = False, **cluster_options: Any) -> ddlf.Cluster:
        """A cluster of ``n`` members (the spares with ``spare=True``), reset; a member that cannot be reset is
        replaced (and the view made anew). ``cluster_options``: ``ddlf.Cluster``'s (a heartbeat, for one)."""
        first = self.SPARE if spare else 0
        c = ddlf.Cluster(self.get(first + n)[first:], token=self.token, **cluster_options)
        try:
            c.reset(force=True)
        except ddlf.DdlfError:
            c.close()
            self.discard()
            c = ddlf.Cluster(self.get(first + n)[first:], token=self.token, **cluster_options)
        return c

    def wait_gone(self, i: int, *, spare: bool = False, timeout: float = 60.0) -> None:
        """Wait until the view's worker ``i``, killed by a test, has exited whole: its leader turns zombie while
        its other threads still unmap TensorFlow, and its file locks (the node store's) are held until they end."""
        self.members[i + (self.SPARE if spare else 0)].processes[0].wait(timeout)

    def pid(self, i: int, *, spare: bool = False) -> int:
        """The process id of the view's worker ``i`` (a fault test's victim, ``spare=True``: the pool replaces it
        for the next view)."""
        return self.members[i + (self.SPARE if spare else 0)].processes[0].pid

    def discard(self) -> None:
        for member in self.members:
            member.terminate()
        self.members = []


POOL = DaemonPool()


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[ddlf.Cluster]:
    """Two local daemons shared by a test module; cleaned between tests. They come from this test process's
    :data:`POOL`, reset for the module, unless the module says why it needs daemons of its own
    (``FRESH_DAEMONS = "reason"``: it signals, kills or configures them, or loads frameworks in an order the
    pool's daemons may not allow)."""
    if getattr(request.module, "FRESH_DAEMONS", None):
        with ddlf.Cluster.local(n_workers=2, threads=1) as c:
            yield c
        return
    c = POOL.view(2)
    try:
        yield c
    finally:
        c.close()  # a view: the daemons stay for the next module (reset then)


@contextmanager
def pooled(n: int, *, spare: bool = False, **cluster_options: Any) -> Iterator[ddlf.Cluster]:
    """``n`` workers from this test process's :data:`POOL`, reset, as ``with ddlf.Cluster.local(n, threads=1)``
    gives: a view, closed after. A fault test may kill or stop a member (:meth:`DaemonPool.pid`; a stopped one
    must be continued before the test ends) of a view of spares (``spare=True``): only that one is replaced, for
    the next view."""
    c = POOL.view(n, spare=spare, **cluster_options)
    try:
        yield c
    finally:
        c.close()


def pool_addresses(n: int, *, spare: bool = False) -> list[str]:
    """The addresses of ``n`` pool members (spares with ``spare=True``), reset, for a test that connects its own
    ``ddlf.Cluster`` to some of them (or a master in another process: the token is ``POOL.token``)."""
    POOL.view(n, spare=spare).close()
    first = POOL.SPARE if spare else 0
    return POOL.get(first + n)[first:]


@pytest.fixture(scope="session", autouse=True)
def _pool_lifetime() -> Iterator[None]:
    yield
    POOL.discard()


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: its counts go to the controller
        workeroutput["ddlf_daemons_started"] = DAEMONS_STARTED[0]
        workeroutput["ddlf_daemons_by_module"] = dict(DAEMONS_BY_MODULE)
        workeroutput["ddlf_tf_daemons"] = TF_DAEMONS[0]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    out = getattr(node, "workeroutput", {}) or {}
    DAEMONS_STARTED[0] += int(out.get("ddlf_daemons_started", 0))
    DAEMONS_BY_MODULE.update(out.get("ddlf_daemons_by_module", {}))
    TF_DAEMONS[0] += int(out.get("ddlf_tf_daemons", 0))


def pytest_terminal_summary(terminalreporter: object) -> None:
    write = getattr(terminalreporter, "write_line", None)
    if write is not None and DAEMONS_STARTED[0]:
        write(
            f"ddlf: the tests started {DAEMONS_STARTED[0]} worker daemons (not counting scripts' own); "
            f"{TF_DAEMONS[0]} had imported TensorFlow when stopped"
        )
        top = ", ".join(f"{m.removeprefix('tests/')} {k}" for m, k in DAEMONS_BY_MODULE.most_common(12))
        write(f"ddlf: daemons started by: {top}")


@pytest.fixture(autouse=True)
def _clean_between_tests(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "cluster" in request.fixturenames:
        c = request.getfixturevalue("cluster")
        if not c.closed:
            c.clean()


def pid_alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def all_threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped. ``SIGSTOP`` stops each thread as it next runs: until then one may
    still answer (a ping lane's thread, the network runtime)."""
    states = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/stat") as f:
            states.append(f.read().rsplit(")", 1)[1].split()[0])
    return bool(states) and all(s in ("T", "t") for s in states)


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def ctrl_c_interrupts(code: str) -> str:
    """Run ``code`` in a fresh interpreter: it prints ``calling`` before a call that blocks far longer than the
    10 s allowed here (a long sleep, a stopped worker) and ``interrupted`` when ``KeyboardInterrupt`` ends it. Press
    Ctrl-C after ``calling``; returns what it printed after, which holds ``interrupted`` when the call ended with
    ``KeyboardInterrupt`` before it could end by itself (no clock is read: the 10 s is only how long a broken
    interrupt may hang the test before ``TimeoutExpired`` fails it)."""
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "calling"
        time.sleep(0.5)  # into the call
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=10)
        return out
    finally:
        p.kill()


class Daemon:
    """A `ddlf-worker` process started by a test, with its own token."""

    def __init__(
        self, *args: str, token: str | None = "test-token", env: dict[str, str] | None = None, log_file: bool = False
    ) -> None:
        import tempfile

        _count_start()

        self.dir = tempfile.mkdtemp(prefix="ddlf-test-")
        self.ready = os.path.join(self.dir, "addr")
        full_env = dict(os.environ)
        full_env.pop("DDLF_TOKEN", None)
        if token is not None:
            full_env["DDLF_TOKEN"] = token
        full_env.update(env or {})
        self.token = token
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ddlf.worker",
                "--listen",
                "127.0.0.1:0",
                "--ready-file",
                self.ready,
                *args,
            ],
            env=full_env,
            # A daemon that lives for many tests logs to a file: a pipe nobody reads would fill and stop it.
            stdout=subprocess.DEVNULL if log_file else subprocess.PIPE,
            stderr=open(os.path.join(self.dir, "log"), "wb") if log_file else subprocess.PIPE,  # noqa: SIM115
        )
        try:
            self._wait_started(log_file)
        except BaseException:
            self.stop()  # its directory too: a daemon that failed to start leaves nothing behind
            raise
        with open(self.ready) as f:
            self.address = f.read().strip()

    def _wait_started(self, log_file: bool) -> None:
        if not wait_until(lambda: os.path.exists(self.ready) or self.proc.poll() is not None, 30):
            raise RuntimeError("daemon did not start")
        if self.proc.poll() is not None:
            if log_file:
                with open(os.path.join(self.dir, "log"), "rb") as f:
                    said = f.read()
            else:
                said = self.proc.stderr.read() if self.proc.stderr else b""
            raise RuntimeError(f"daemon exited with code {self.proc.returncode}: {said.decode(errors='replace')}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            TF_DAEMONS[0] += _imported_tensorflow(self.proc.pid)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_SHARED_DAEMON: list[Daemon] = []


def _shared_daemon() -> Daemon:
    """This test process's one :class:`Daemon` with default arguments, reset; started anew when a test killed,
    stopped or shut it down (or it cannot be reset)."""
    if _SHARED_DAEMON:
        d = _SHARED_DAEMON[0]
        if pid_alive(d.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                d.proc.send_signal(signal.SIGCONT)  # a test that stopped it and failed before continuing it
            try:
                with ddlf.Cluster([d.address], d.token, connect_timeout=10, timeout=60) as c:
                    c.reset(force=True)
                return d
            except ddlf.DdlfError:
                pass
        d.stop()
        _SHARED_DAEMON.clear()
    asked_by, _CURRENT_MODULE[0] = _CURRENT_MODULE[0], "shared daemon"
    try:
        _SHARED_DAEMON.append(Daemon(log_file=True))
    finally:
        _CURRENT_MODULE[0] = asked_by
    return _SHARED_DAEMON[0]


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    """A ``ddlf-worker`` with the token ``test-token`` and default arguments: one per test process, shared by the
    tests that ask for it, reset before each (``Cluster.reset``); a test may kill, stop or shut it down (the next
    test gets a new one). A test that needs other arguments starts its own :class:`Daemon`."""
    yield _shared_daemon()


@pytest.fixture(scope="session", autouse=True)
def _shared_daemon_lifetime() -> Iterator[None]:
    yield
    for d in _SHARED_DAEMON:
        d.stop()
