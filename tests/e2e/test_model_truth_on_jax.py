"""test_model_truth.py's cases again with Keras on JAX (the suite runs Keras on TensorFlow): in a fresh pytest
process, whose daemons follow its backend. A module of its own so that ``scripts/test.sh`` can run it in its side
stream, beside the end-to-end tests (it is the suite's longest test, and mostly a process of its own)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

MODULE = Path(__file__).with_name("test_model_truth.py")


@pytest.mark.slow
def test_every_case_of_model_truth_holds_with_keras_on_jax_too() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_XDIST_WORKER", "DDLF_NODE_STORE")}
    env["KERAS_BACKEND"] = "jax"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", str(MODULE), "-q", "-p", "no:cacheprovider"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout
