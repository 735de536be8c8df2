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
    found = [sum("oneDNN" in line for line in cluster.logs(i, 0)) for i in range(2)]
    print("notices in the workers' logs:", found)
"""


def _train(tmp_path, **env: str) -> str:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
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


@pytest.mark.slow
def test_the_terminal_shows_progress_and_user_output_but_no_framework_notices(tmp_path) -> None:
    quiet = _train(tmp_path)
    assert "Epoch 1/1" in quiet and "samples/s" in quiet  # ddlf's progress line
    # (one worker loads the host's one copy of the dataset: ddlf.data.node_store)
    assert "user print on a worker" in quiet and "UserWarning: user warning on a worker" in quiet
    assert [n for n in NOTICES if n in quiet] == [], quiet
    # Each worker printed them (twice: TensorFlow's two libraries) into its own log, which `ddlf logs` reads.
    assert "notices in the workers' logs: [2, 2]" in quiet, quiet

    loud = _train(tmp_path, DDLF_LOG="debug")
    assert "Epoch 1/1" in loud
    # The master's and both workers' notices: absl's preamble and oneDNN's line twice in each process.
    assert loud.count("oneDNN custom operations are on") == 6, loud
    assert "cpu_feature_guard" in loud and "absl::InitializeLog" in loud
