"""``GradientAveraging`` equals one process on Keras's TensorFlow and PyTorch backends, whatever backend the rest of
the suite trains on (TensorFlow unless ``KERAS_BACKEND`` says otherwise: tests/conftest.py): each backend in a master
process of its own, since a process has one Keras backend (the workers follow the master's), which trains both
cases (unsharded, and Adam's state sharded) one after the other on one local cluster."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest

from ..conftest import REPO

SCRIPT = """
import numpy as np, ddlf
from tests.e2e.apps import Linear, global_batches, one_process
with ddlf.Cluster.local(2, threads=1) as c:
    for shard in (0, 1):
        if shard:
            c.reset()  # the second case on workers as they started, as the first
        app = Linear(c)
        if shard:  # Adam: state to shard
            app.optimizer, app.learning_rate = "adam", 0.01
        app.model = app.create_model()
        start = app.model.get_weights()
        strategy = ddlf.GradientAveraging(shard_optimizer=bool(shard))
        h = app.train(epochs=1, batch_size=16, strategy=strategy, run=ddlf.RunConfig(seed=4), verbose=0)
        want = one_process(app, start, global_batches(2, 16, 1, 4, None))
        got = app.model.get_weights()
        print(f"DIFF{shard}", max(float(np.max(np.abs(a - b))) for a, b in zip(got, want)))
        print(f"MOVED{shard}", max(float(np.max(np.abs(a - b))) for a, b in zip(got, start)))
    import keras
    print("BACKEND", keras.backend.backend())
"""


@functools.cache
def _trained_on(backend: str) -> dict[str, str]:
    """What :data:`SCRIPT` printed, run once per backend for both of its cases."""
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": REPO}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.split(" ", 1)[0].isupper())


@pytest.mark.parametrize(
    ("backend", "shard"), [("tensorflow", False), ("torch", False), ("tensorflow", True), ("torch", True)]
)
@pytest.mark.slow
def test_gradient_averaging_equals_one_process_on(backend: str, shard: bool) -> None:
    """Unsharded, and with sharded optimizer state (Adam)."""
    pytest.importorskip(backend)
    values = _trained_on(backend)
    diff, moved = float(values[f"DIFF{int(shard)}"]), float(values[f"MOVED{int(shard)}"])
    assert values["BACKEND"] == backend
    assert diff < 2e-5 and moved > 100 * diff, (diff, moved)
