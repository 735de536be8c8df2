"""Validation of the settings a master and a daemon share, in one place.

``Cluster``, ``Cluster.local`` and the ``ddlf-worker`` command line all check ``lane_spin_us`` and timeouts here,
so a bad value gets the same clear error wherever it enters, before any daemon starts.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from .errors import ConfigError

MAX_LANE_SPIN_US = 1_000_000
"""The longest busy-poll a lane may do before it sleeps: one second."""


def is_address(value: Any) -> bool:
    """Whether ``value`` is a worker address, ``"host:port"`` (port 1-65535)."""
    if not isinstance(value, str):
        return False
    host, sep, port = value.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


def check_lane_spin_us(value: Any) -> int:
    """Check a ``lane_spin_us`` setting: whole microseconds from 0 (sleep at once) to 1 s."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LANE_SPIN_US:
        raise ConfigError(
            f"lane_spin_us must be a whole number of microseconds from 0 to {MAX_LANE_SPIN_US}, got {value!r}"
        )
    return value


def module_list(text: str) -> list[str]:
    """A comma-separated list of module names (``--preload``, ``DDLF_PRELOAD``), blanks dropped."""
    return [m.strip() for m in text.split(",") if m.strip()]


def check_seconds(value: Any, what: str) -> float:
    """Check a duration setting: a positive, finite number of seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{what} must be a positive number of seconds, got {value!r}")
    return float(value)


def read_pem(value: str | os.PathLike[str] | bytes | None, what: str) -> bytes | None:
    """A PEM setting: the bytes themselves, or a path to read them from."""
    if value is None or isinstance(value, bytes):
        return value
    try:
        return Path(value).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {os.fspath(value)!r}: {exc.strerror}") from exc
