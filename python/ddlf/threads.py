"""Thread-pool limits for math libraries, so that several workers on one machine share its cores instead of
each one starting a pool as large as the machine."""

from __future__ import annotations

import os

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
