"""This process and the processes it starts: thread budgets, the allocator policy, dying with the parent."""

from __future__ import annotations

import atexit
import os
import threading
import time

_VARIABLES = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "TF_NUM_INTRAOP_THREADS",
    "TF_NUM_INTEROP_THREADS",
)


def thread_env(threads: int) -> dict[str, str]:
    """Environment variables that cap BLAS/OpenMP, TensorFlow, torch, XLA (JAX) and ddlf's image-decoding pools
    at ``threads``."""
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    env = {name: str(threads) for name in _VARIABLES}
    env["DDLF_THREADS"] = str(threads)  # ddlf's own pools: image decoding on the prefetch threads
    ours = ("--xla_cpu_multi_thread_eigen=", "intra_op_parallelism_threads=")
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(ours)]
    extra = [
        f"--xla_cpu_multi_thread_eigen={'true' if threads > 1 else 'false'}",
        f"intra_op_parallelism_threads={threads}",
    ]
    env["XLA_FLAGS"] = " ".join(kept + extra)
    return env


def in_effect(threads: int) -> bool:
    """Whether this process was started with :func:`thread_env` for ``threads`` (the libraries read it at load
    time, so it must be in the environment before they are imported)."""
    return all(os.environ.get(k) == v for k, v in thread_env(threads).items())


def cpu_count() -> int:
    """Cores this process may use (honours affinity masks and cgroup-limited containers)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


PARENT_POLL_SECONDS = 0.5


PARENT_ENV = "DDLF_PARENT_PID"


def die_with_parent() -> None:
    """Called first thing by a local worker daemon (``DDLF_PARENT_PID`` set): exit as soon as the master that
    started it is gone (checked twice a second by a watchdog thread), and at once if it is already gone.

    Not ``prctl(PR_SET_PDEATHSIG)``: the kernel fires that when the *thread* that started the child exits, so a
    cluster started from any thread but the main one lost its workers when that thread ended. And not a
    ``preexec_fn`` either: a pre-exec hook forces fork() from the master, and forking a multi-threaded process
    (JAX, TensorFlow and torch all start threads) can deadlock the child.
    """
    expected = os.environ.get(PARENT_ENV)
    if not expected:
        return
    parent = int(expected)
    if os.getppid() != parent:  # the master died before we got here
        os._exit(0)

    def watch() -> None:
        while True:
            time.sleep(PARENT_POLL_SECONDS)
            if os.getppid() != parent:  # re-parented: the master is gone
                os._exit(0)

    threading.Thread(target=watch, name="ddlf-parent-watch", daemon=True).start()


_prepared = False


def prepare_process() -> None:
    """What a process that moves tensors needs, done when a cluster, a worker or a training run starts (never at
    import): the allocator policy for large transfers (``DDLF_MALLOC=system`` keeps glibc's defaults), and removal
    of this process's pooled shared-memory segments at exit. Idempotent."""
    global _prepared
    if _prepared:
        return

    from . import _ddlf

    _ddlf.tune_allocator()
    # Receivers that still map a segment keep their mapping.
    atexit.register(_ddlf.release_shared_memory)
    _prepared = True
