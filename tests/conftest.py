"""Shared fixtures: real worker daemons on loopback."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

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


@pytest.fixture(scope="module")
def cluster() -> Iterator[ddlf.Cluster]:
    """Two local daemons shared by a test module; cleaned between tests."""
    with ddlf.Cluster.local(n_workers=2, threads=1) as c:
        yield c


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


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def ctrl_c_interrupts(code: str, within: float = 2.0) -> float:
    """Run ``code`` in a fresh interpreter: it prints ``calling`` before a call that blocks and ``interrupted`` when
    ``KeyboardInterrupt`` ends it. Press Ctrl-C half a second after ``calling``, check that the call ended within
    ``within`` seconds, and return how long it took."""
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "calling"
        time.sleep(0.5)
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=10)
        assert "interrupted" in out
        took = time.monotonic() - t0
        assert took < within
        return took
    finally:
        p.kill()


class Daemon:
    """A `ddlf-worker` process started by a test, with its own token."""

    def __init__(self, *args: str, token: str | None = "test-token", env: dict[str, str] | None = None) -> None:
        import tempfile

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
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        if not wait_until(lambda: os.path.exists(self.ready) or self.proc.poll() is not None, 30):
            raise RuntimeError("daemon did not start")
        if self.proc.poll() is not None:
            raise RuntimeError(f"daemon exited: {self.proc.stderr.read().decode()}")
        with open(self.ready) as f:
            self.address = f.read().strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    d = Daemon()
    yield d
    d.stop()
