"""What a training script's terminal shows: ddlf's progress and the user's own prints and warnings, workers'
included, but not the frameworks' start-up notices (ddlf.frameworks.console), which stay in the daemons' logs and
come back with DDLF_LOG=debug."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ddlf.frameworks.loading import installed

pytestmark = pytest.mark.skipif(not installed("tensorflow"), reason="the notices are TensorFlow's")

NOTICES = ("oneDNN", "cpu_feature_guard", "absl::InitializeLog", "TF_ENABLE_ONEDNN_OPTS", "This TensorFlow binary")

SCRIPT = """
import warnings

import numpy as np

import ddlf


class Tiny(ddlf.IApp):
    dataset_key = "console-tiny"

    def load_dataset(self):
        print("user print on a worker", flush=True)
        warnings.warn("user warning on a worker")
        x = np.random.default_rng(0).random((256, 8), dtype=np.float32)
        return x, (x.sum(axis=1) > 4).astype(np.int64)

    def create_model(self):
        import keras

        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2, activation="softmax")])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model


with ddlf.Cluster.local(2) as cluster:
    Tiny(cluster).train(epochs=1, batch_size=32)
    notices = {NOTICES!r}
    found = [sum(any(n in line for n in notices) for line in cluster.logs(i, 0)) for i in range(2)]
    print("notices in the workers' logs:", found)
"""


def _train(tmp_path, **env: str) -> str:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.replace("{NOTICES!r}", repr(NOTICES)))
    full_env = dict(os.environ)
    for name in ("DDLF_LOG", "DDLF_PRELOAD", "TF_CPP_MIN_LOG_LEVEL"):  # what a user gets: the defaults
        full_env.pop(name, None)
    full_env.update(KERAS_BACKEND="tensorflow", **env)
    out = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout
    return out.stdout


def _notices_at_import() -> int:
    """How many of TensorFlow's start-up notice lines a bare ``import tensorflow`` prints in this environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "DDLF_LOG")}
    done = subprocess.run(
        [sys.executable, "-c", "import tensorflow"], env=env, capture_output=True, text=True, timeout=300
    )
    return sum(any(n in line for n in NOTICES) for line in done.stderr.splitlines())


@pytest.mark.slow
def test_the_terminal_shows_progress_and_user_output_but_no_framework_notices(tmp_path) -> None:
    quiet = _train(tmp_path)
    assert "Epoch 1/1" in quiet and "samples/s" in quiet  # ddlf's progress line
    # (one worker loads the host's one copy of the dataset: ddlf.data.node_store)
    assert "user print on a worker" in quiet and "UserWarning: user warning on a worker" in quiet
    assert [n for n in NOTICES if n in quiet] == [], quiet
    # Each worker's notices are in its own log, which `ddlf logs` reads: as many as TensorFlow prints at import
    # here (2.21: absl's preamble and cpu_feature_guard's; earlier versions add oneDNN's two).
    expected = _notices_at_import()
    assert expected >= 1 and f"notices in the workers' logs: [{expected}, {expected}]" in quiet, (expected, quiet)

    loud = _train(tmp_path, DDLF_LOG="debug")
    assert "Epoch 1/1" in loud
    # The master's and both workers' notices, each process's as a bare import prints them.
    printed = sum(any(n in line for n in NOTICES) for line in loud.splitlines())
    assert printed == 3 * expected, (expected, loud)
    assert "cpu_feature_guard" in loud and "absl::InitializeLog" in loud
