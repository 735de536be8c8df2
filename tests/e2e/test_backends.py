"""Which Keras backend runs: ddlf's default when the user chose none, the user's choice otherwise, and workers on
the master's backend (following it, or refusing clearly when they already run another)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

import ddlf
from ddlf.frameworks.keras_backend import installed_keras_backend, installed_keras_backends

from ..conftest import MNIST_DIR
from .apps import SmallMnist

MASTER = os.environ["KERAS_BACKEND"]  # this process's backend (tests/conftest.py sets the suite's)
OTHER = next((b for b in installed_keras_backends() if b != MASTER), None)

_SCRIPT = textwrap.dedent(
    """
    import json
    import numpy as np
    import ddlf

    class Tiny(ddlf.IApp):
        dataset_key = "backends-600"
        def load_dataset(self):
            (x, y), _ = ddlf.datasets.mnist(MNIST_DIR)
            return x[:600], y[:600]
        def preprocess(self, x, y):
            return x.reshape(len(x), -1).astype(np.float32) / 255.0, y
        def create_model(self):
            import keras
            model = keras.Sequential([keras.Input(shape=(784,)), keras.layers.Dense(10, activation="softmax")])
            model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
            return model

    def worker_backend():
        import keras
        return keras.backend.backend()

    with ddlf.Cluster.local(2) as cluster:
        h = Tiny(cluster).train(epochs=1, batch_size=64, verbose=0)
        import keras
        print(json.dumps({"master": keras.backend.backend(), "workers": cluster.run(worker_backend),
                          "samples": sum(s.samples for s in h.stats)}))
    """
)


FRESH_DAEMONS = "its daemons must start without a Keras backend loaded (each test picks one)"


def _train_in_fresh_process(tmp_path, backend: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    env["KERAS_HOME"] = str(tmp_path)  # no keras.json of the user's
    if backend:
        env["KERAS_BACKEND"] = backend
    code = f"MNIST_DIR = {MNIST_DIR!r}\n{_SCRIPT}"  # no conftest here: ddlf's default applies
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_nothing_chosen_trains_on_the_fastest_installed_backend_everywhere(tmp_path) -> None:
    out = _train_in_fresh_process(tmp_path, None)
    expected = installed_keras_backend()
    assert out == {"master": expected, "workers": [expected, expected], "samples": 600}


@pytest.mark.slow
def test_the_users_backend_wins_on_master_and_workers(tmp_path) -> None:
    out = _train_in_fresh_process(tmp_path, "jax")
    assert out == {"master": "jax", "workers": ["jax", "jax"], "samples": 600}


@pytest.mark.skipif(OTHER is None, reason="needs a second Keras backend")
def test_a_worker_already_on_another_backend_refuses_with_the_fix() -> None:
    # The master runs the suite's backend; its worker loads Keras on another one first.
    def load_keras_on(backend):
        os.environ["KERAS_BACKEND"] = backend
        import keras

        return keras.backend.backend()

    with ddlf.Cluster.local(1, preload=None) as cluster:  # (a preload would load the master's backend)
        assert cluster.run(load_keras_on, OTHER) == [OTHER]
        app = SmallMnist(cluster)
        with pytest.raises(ddlf.RemoteError, match=rf"runs Keras on '{OTHER}'.*KERAS_BACKEND={MASTER}"):
            app.train(epochs=1, verbose=0)
        assert cluster.run(lambda: "still serving") == ["still serving"]


@pytest.mark.slow
def test_local_daemons_preload_keras_on_the_masters_backend() -> None:
    def loaded():
        import sys

        if "keras" not in sys.modules:
            return None
        import keras  # waits for the preload thread's import to complete

        return keras.backend.backend()

    with ddlf.Cluster.local(2, preload="keras") as cluster:  # the suite's backend (tests/conftest.py)
        assert wait_for(lambda: cluster.run(loaded) == [MASTER, MASTER], timeout=60)
    with ddlf.Cluster.local(1, preload=None) as cluster:
        assert cluster.run(loaded) == [None]


def test_a_request_during_the_preload_waits_for_it_instead_of_racing_its_imports(tmp_path, monkeypatch) -> None:
    # Two modules that import each other and use each other's names as they load, as TensorFlow and Keras do
    # (TensorFlow's __init__ imports keras.src.optimizers): the preload imports one, a request imports the other
    # meanwhile. Python breaks the two threads' lock cycle by handing one of them the other module half-imported,
    # which fails (with TensorFlow: _DeadlockError or AttributeError in both threads, and TensorFlow broken in that
    # process from then on). Requests wait for the preload instead.
    (tmp_path / "ddlf_race_a.py").write_text(
        "import time\ntime.sleep(3.0)\nimport ddlf_race_b\nREADY = ddlf_race_b.VALUE\n"
    )
    (tmp_path / "ddlf_race_b.py").write_text("import ddlf_race_a  # noqa: F401\nVALUE = 2\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))

    def imports_the_other_one():
        import sys

        done_first = hasattr(sys.modules.get("ddlf_race_a"), "READY")  # before this call imports anything
        # The other one first, as a request importing TensorFlow while Keras preloads.
        import ddlf_race_b  # isort: skip
        import ddlf_race_a  # isort: skip

        return done_first, ddlf_race_a.READY, ddlf_race_b.VALUE

    with ddlf.Cluster.local(1, preload="ddlf_race_a") as cluster:
        t0 = time.monotonic()
        assert cluster.run(imports_the_other_one) == [(True, 2, 2)]
        assert time.monotonic() - t0 > 1.0  # it did arrive while the preload slept, and waited
        logs = cluster.logs(0, 0)
        assert any("preloaded ddlf_race_a" in line for line in logs), logs
        assert any("a request waited" in line and "for the preload of ddlf_race_a" in line for line in logs), logs
        assert not any("preloading ddlf_race_a failed" in line for line in logs), logs
        assert cluster.run(lambda: "still serving") == ["still serving"]


def wait_for(predicate, timeout: float) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False
