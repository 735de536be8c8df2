"""This process and the processes it starts: thread budgets, the allocator policy (and returning free memory),
the garbage collector's long-lived objects, a scheduler's warning kept for the training run, dying with the
parent."""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType

from .errors import ConfigError

log = logging.getLogger("ddlf.process")

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
        raise ConfigError(f"threads must be at least 1, got {threads}")
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


_worker_daemon = False


def mark_worker_daemon() -> None:
    """This process is a worker daemon (``ddlf-worker``): it starts no daemons of its own (:func:`in_worker_daemon`)."""
    global _worker_daemon
    _worker_daemon = True


def in_worker_daemon() -> bool:
    """Whether this process is a worker daemon (code the master sent runs here, modules beside its script import
    here)."""
    return _worker_daemon


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


RETURN_AFTER_IDLE = 0.5
"""Seconds a worker daemon stays idle (no training run held) before it returns its free memory: long enough for
the next ``train()`` or ``evaluate()`` of a script that calls them back to back to come first (its transfers reuse the
heap), short beside the time between scripts."""

_pending_lock = threading.Lock()
_pending: threading.Timer | None = None


def return_free_memory(wait: bool = True) -> None:
    """Hand the memory the allocator keeps free back to the system: a process running ddlf keeps up to 256 MiB of
    freed heap for its next transfer (the allocator policy of :func:`prepare_process`), which a daemon that serves
    runs for days should not hold while idle. ``wait``: now (a reset, after its collection; a refused request).
    Else (a worker daemon whose last run was torn down) after :data:`RETURN_AFTER_IDLE` seconds, on a timer
    thread, unless :func:`keep_free_memory` is called first (the next run's set-up: back-to-back runs keep the
    heap their transfers reuse). What is free by then goes back (a reset collects the garbage first). Milliseconds,
    without the interpreter lock; best effort; a no-op where the allocator is not glibc's."""
    from . import _ddlf

    if wait:
        keep_free_memory()  # a pending one would only repeat this
        _ddlf.return_free_memory()
        return
    global _pending
    with _pending_lock:
        if _pending is not None:
            _pending.cancel()
        timer = threading.Timer(RETURN_AFTER_IDLE, _ddlf.return_free_memory)
        timer.name, timer.daemon = "ddlf-return-memory", True
        _pending = None
        try:
            timer.start()
        except RuntimeError as exc:  # no thread to be had: the memory stays with the allocator
            log.debug("free memory not returned: %s", exc)
            return
        _pending = timer


def keep_free_memory() -> None:
    """Cancel a pending :func:`return_free_memory` (``wait=False``): a run starts."""
    global _pending
    with _pending_lock:
        if _pending is not None:
            _pending.cancel()
            _pending = None


# -- the cyclic garbage collector ----------------------------------------------------------------------------

_holders: set[object] = set()
_heap_lock = threading.Lock()


def freeze_heap(holder: object | None = None) -> None:
    """Take every object alive now out of the cyclic garbage collector's scans (``gc.freeze``): for ``holder``
    until :func:`release_heap` (``None``: for good, or until the last holder is released).

    A process that has loaded TensorFlow, Keras or torch and traced a model holds some 700,000 objects that the
    collector tracks; every full collection walks all of them, about 0.4-0.5 s here with the interpreter lock
    held. A run of many small rounds triggers one every few seconds, so an asynchronous epoch that takes 0.2 s
    took 0.6 s whenever one fell into it (issue 37). Frozen, those long-lived objects are still freed when their
    last reference goes; only cycles among them wait for :func:`release_heap`. The young generations are
    collected first, so the garbage of the last moments is not frozen with them. Called by a worker daemon after
    its preload and after each run's first round (its model built and traced: the run holds the freeze until it
    is torn down), and by the master for the duration of ``train()`` (:func:`frozen_heap`)."""
    with _heap_lock:
        if holder is not None:
            _holders.add(holder)
        gc.collect(1)
        gc.freeze()


def release_heap(holder: object) -> None:
    """``holder`` no longer needs the freeze: the frozen objects go back to the collector (``gc.unfreeze``), so
    that the cycles a finished run left behind can be freed. Where other holders remain (a worker's other runs,
    a sweep's other trials), those cycles are collected now and the rest frozen again: one full collection
    (about half a second), instead of a finished run's model kept frozen until the last one ends."""
    with _heap_lock:
        if holder not in _holders:
            return
        _holders.discard(holder)
        gc.unfreeze()
        if _holders:
            gc.collect()
            gc.freeze()


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """:func:`freeze_heap` for the duration of the block (the master's ``train()``), released after it."""
    token = object()
    freeze_heap(token)
    try:
        yield
    finally:
        release_heap(token)


# -- a scheduler's warning kept for the training run ------------------------------------------------------------

_held: str | None = None
"""The signal :func:`hold_signals` kept, until a training run takes it."""


def hold_signals(signals: tuple[int, ...] = (signal.SIGUSR1,)) -> None:
    """From now on keep ``signals`` (Slurm's advance warning before the time limit) that arrive where no
    ``train()`` catches them (outside ``train()``, or in one without a ``checkpoint_dir``) for the next
    ``train()`` that does (:mod:`ddlf.training.preemption`), instead of letting their default action end the
    process. Main thread only (elsewhere nothing is installed). Idempotent."""
    if threading.current_thread() is not threading.main_thread():
        return
    for number in signals:
        if signal.getsignal(number) is not _keep:
            signal.signal(number, _keep)


def _keep(signum: int, frame: FrameType | None) -> None:
    global _held
    if _held is None:
        _held = signal.Signals(signum).name
        logging.getLogger("ddlf.preemption").warning(
            "%s arrived where no train() catches it: kept; the next train() with a checkpoint_dir stops at its "
            "start with a checkpoint",
            _held,
        )


def held() -> str | None:
    """The name of the signal kept and not taken yet, if any."""
    return _held


def take_held(signals: list[int]) -> str | None:
    """The kept signal if it is one of ``signals`` (it is then no longer kept), else ``None``."""
    global _held
    if _held is not None and int(signal.Signals[_held]) in signals:
        name, _held = _held, None
        return name
    return None
