"""Validation of the settings a master and a daemon share, in one place.

``Cluster``, ``Cluster.local`` and the ``ddlf-worker`` command line all check ``lane_spin_us`` and timeouts here,
so a bad value gets the same clear error wherever it enters, before any daemon starts.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

MAX_LANE_SPIN_US = 1_000_000
"""The longest busy-poll a lane may do before it sleeps: one second."""


def check_lane_spin_us(value: Any) -> int:
    """Check a ``lane_spin_us`` setting: whole microseconds from 0 (sleep at once) to 1 s."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LANE_SPIN_US:
        raise ValueError(
            f"lane_spin_us must be a whole number of microseconds from 0 to {MAX_LANE_SPIN_US}, got {value!r}"
        )
    return value


def check_seconds(value: Any, what: str) -> float:
    """Check a duration setting: a positive, finite number of seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a positive number of seconds, got {value!r}")
    return float(value)


def read_pem(value: str | os.PathLike[str] | bytes | None, what: str) -> bytes | None:
    """A PEM setting: the bytes themselves, or a path to read them from."""
    if value is None or isinstance(value, bytes):
        return value
    try:
        return Path(value).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {what} {os.fspath(value)!r}: {exc.strerror}") from exc


def keras_backend_default() -> None:
    """Choose Keras's backend for this process unless the user did (``KERAS_BACKEND`` always wins): called when
    a training run or a worker starts, never at import."""
    os.environ.setdefault("KERAS_BACKEND", "jax")


_prepared = False


def prepare_process() -> None:
    """What a process that moves tensors needs, done when a cluster, a worker or a training run starts (never at
    import): the allocator policy for large transfers (``DDLF_MALLOC=system`` keeps glibc's defaults), and removal
    of this process's pooled shared-memory segments at exit. Idempotent."""
    global _prepared
    if _prepared:
        return
    import atexit

    from . import _ddlf

    _ddlf.tune_allocator()
    # Receivers that still map a segment keep their mapping.
    atexit.register(_ddlf.release_shared_memory)
    _prepared = True
