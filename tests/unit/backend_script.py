"""Run a script in a fresh interpreter with Keras on a given backend (a process holds one backend), for unit tests
that compare a framework's own behaviour with ddlf's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from ddlf.frameworks.keras_backend import installed_keras_backends


def run_on_backend(backend: str, script: str, timeout: float = 300) -> dict[str, Any]:
    """Run ``script`` with ``KERAS_BACKEND=backend`` (the test is skipped where that backend is not installed);
    returns the JSON object its last line of output prints."""
    if backend not in installed_keras_backends():
        pytest.skip(f"Keras's {backend} backend is not installed")
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result
