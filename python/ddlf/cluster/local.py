"""Worker daemons started on this machine by ``Cluster.local``.

Each daemon is a child process on a free loopback port with a fresh random token. The children die with their
master: on ``close()``, at interpreter exit, and (Linux) even when the master is killed with ``kill -9``, through
the parent-death signal. No orphan processes, ever.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Sequence
from pathlib import Path

from ..errors import ConfigError, LaunchError, WorkerStartError
from ..frameworks.keras_backend import keras_backend_in_use
from ..process import PARENT_ENV, in_worker_daemon, thread_env
from ..settings import check_lane_spin_us, module_list


def start_worker(
    listen: str, name: str, ready_file: str, env: dict[str, str], args: list[str]
) -> subprocess.Popen[bytes]:
    """A ``ddlf-worker`` child process (this interpreter) listening on ``listen``; it writes its address to
    ``ready_file`` once it serves (see :func:`wait_ready`)."""
    cmd = [sys.executable, "-m", "ddlf.worker", "--listen", listen, "--name", name, "--ready-file", ready_file]
    return subprocess.Popen(
        [*cmd, *args],
        env=env,
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # Ctrl-C reaches the master, which then stops its workers
    )


def wait_ready(proc: subprocess.Popen[bytes], ready_file: str, timeout: float) -> str:
    """The address a worker started by :func:`start_worker` serves on, once it does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(ready_file):
            return Path(ready_file).read_text().strip()
        code = proc.poll()
        if code is not None:
            raise WorkerStartError(f"local worker exited with code {code} before it was ready (see its stderr)")
        time.sleep(0.01)
    raise WorkerStartError(f"local worker did not start within {timeout:.0f} s")


class LocalWorkers:
    """A set of daemon processes on loopback. Use through :meth:`ddlf.Cluster.local`."""

    def __init__(
        self,
        n_workers: int,
        *,
        threads: int | None = None,
        start_timeout: float = 60.0,
        extra_args: list[str] | None = None,
        worker_args: list[list[str]] | None = None,
        env: dict[str, str] | None = None,
        listen: list[str] | None = None,
        token: str | None = None,
    ) -> None:
        if n_workers < 1:
            raise ConfigError(f"n_workers must be at least 1, got {n_workers}")
        if listen is not None and len(listen) != n_workers:
            raise ConfigError(f"listen has {len(listen)} addresses for {n_workers} workers")
        self.token = token or secrets.token_urlsafe(24)
        self._dir = tempfile.mkdtemp(prefix="ddlf-local-")
        self.processes: list[subprocess.Popen[bytes]] = []
        self.addresses: list[str] = []
        child_env = dict(os.environ)
        child_env["DDLF_TOKEN"] = self.token
        child_env[PARENT_ENV] = str(os.getpid())
        # Local daemons share the user's terminal: only warnings and errors, unless DDLF_LOG says otherwise.
        child_env.setdefault("DDLF_LOG", "warn")
        if threads is not None:
            child_env.update(thread_env(threads))
        if env:
            child_env.update(env)
        ready_files = []
        try:
            for i in range(n_workers):
                ready = os.path.join(self._dir, f"worker-{i}.addr")
                ready_files.append(ready)
                self.processes.append(
                    start_worker(
                        listen[i] if listen else "127.0.0.1:0",
                        f"local-{i}",
                        ready,
                        child_env,
                        [
                            *(extra_args or []),
                            *(worker_args[i] if worker_args else []),
                            *(["--threads", str(threads)] if threads is not None else []),
                        ],
                    )
                )
            self.addresses = [wait_ready(p, f, start_timeout) for p, f in zip(self.processes, ready_files)]
        except BaseException:
            self.terminate()
            raise
        self._finalizer = weakref.finalize(self, _terminate_all, list(self.processes), self._dir)
        atexit.register(self._finalizer)

    def __enter__(self) -> LocalWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.terminate()

    def pids(self) -> list[int]:
        """Process ids of the daemons."""
        return [p.pid for p in self.processes]

    def wait(self, timeout: float) -> bool:
        """Wait for every daemon to exit on its own; True if all did."""
        deadline = time.monotonic() + timeout
        for p in self.processes:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def terminate(self) -> None:
        """Stop every daemon: SIGTERM, then SIGKILL for any still alive after a grace period."""
        _terminate_all(self.processes, self._dir)
        fin = getattr(self, "_finalizer", None)
        if fin is not None:
            fin.detach()
            atexit.unregister(fin)


def _terminate_all(processes: list[subprocess.Popen[bytes]], directory: str) -> None:
    for p in processes:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
    # A worker that still held a run (its master stopped before tearing it down) drains on SIGTERM, waiting for that
    # master (ddlf.worker.drain); this master is the one stopping it: SIGINT (Ctrl-C) ends it at once.
    deadline = time.monotonic() + 0.3
    for p in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 5.0
    for p in processes:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait()
    with contextlib.suppress(OSError):
        for f in os.listdir(directory):
            os.unlink(os.path.join(directory, f))
        os.rmdir(directory)


def default_preload() -> str:
    """What local daemons preload unless told: what this script trains with. ``"torch"`` for a script that has
    imported torch and not Keras (a ``TorchModel``: the daemons need neither Keras nor TensorFlow, 4-5 CPU-seconds
    and hundreds of MB each), else ``"keras"`` (on this process's backend)."""
    if "torch" in sys.modules and "keras" not in sys.modules and keras_backend_in_use() != "torch":
        return "torch"
    return "keras"


def start_local(
    n_workers: int | None,
    *,
    threads: int | None,
    start_timeout: float,
    worker_args: Sequence[str],
    lane_spin_us: int | None,
    preload: str | Sequence[str] | None,
    gpus: str | Sequence[int | str] | None,
) -> LocalWorkers:
    """The daemons of ``Cluster.local`` (its arguments, documented there), started and ready."""
    if in_worker_daemon():
        # Each worker would start workers of its own, and each of those its own, until the machine runs out.
        raise LaunchError(
            f"Cluster.local() was called inside a ddlf worker (pid {os.getpid()}): a worker starts no workers of its "
            "own. Most likely a module that the master's code refers to trains when it is imported (workers import "
            'the modules beside the script): put that code under `if __name__ == "__main__":`'
        )
    per_worker: list[list[str]] | None = None
    if gpus is not None:
        from ..devices import choose_gpus

        ids = choose_gpus(gpus)
        if n_workers is not None and n_workers != len(ids):
            raise ConfigError(f"n_workers={n_workers} but gpus gives {len(ids)} GPUs {ids}: one worker per GPU")
        n_workers = len(ids)
        per_worker = [["--gpu", gpu] for gpu in ids]
    if n_workers is None:
        n_workers = 2
    if isinstance(n_workers, bool) or not isinstance(n_workers, int) or n_workers < 1:
        # (checked here, not only by LocalWorkers: the thread split below divides by it)
        raise ConfigError(f"n_workers must be a whole number of at least 1, got {n_workers!r}")
    if threads is None:
        from ..process import cpu_count

        threads = max(1, cpu_count() // n_workers)
    args = list(worker_args)
    env = {}
    if preload == "default":
        preload = os.environ.get("DDLF_PRELOAD", default_preload())
    modules = module_list(preload) if isinstance(preload, str) else list(preload or [])
    if "keras" in modules:
        from ..frameworks.loading import installed

        if not installed("keras"):
            modules.remove("keras")
        else:
            env["KERAS_BACKEND"] = keras_backend_in_use()  # the workers load what this process runs
    if modules and not any(a == "--preload" or a.startswith("--preload=") for a in args):
        args += ["--preload", ",".join(modules)]
    if lane_spin_us is not None:
        args += ["--lane-spin-us", str(check_lane_spin_us(lane_spin_us))]
    return LocalWorkers(
        n_workers, threads=threads, start_timeout=start_timeout, extra_args=args, worker_args=per_worker, env=env
    )
