"""Warm models: a second ``train()`` with the same architecture reuses each worker's traced model, and learns
exactly what a cold run learns (weights, optimizer state, random generators and BatchNorm statistics all reset to
the new run's)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest

import ddlf

from ..conftest import POOL, REPO, pool_addresses, pooled
from .apps import SmallMnist


class DropoutMnist(SmallMnist):
    """Dropout (a random generator in the model) and BatchNorm (non-trainable statistics), Adam."""

    def create_model(self) -> Any:
        import keras

        model = keras.Sequential(
            [
                keras.Input(shape=(784,)),
                keras.layers.Dense(32, activation="relu"),
                keras.layers.BatchNormalization(),
                keras.layers.Dropout(0.3),
                keras.layers.Dense(10, "softmax"),
            ]
        )
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model


class WiderMnist(SmallMnist):
    def create_model(self) -> Any:
        import keras

        model = keras.Sequential(
            [keras.Input(shape=(784,)), keras.layers.Dense(48, activation="relu"), keras.layers.Dense(10, "softmax")]
        )
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model


def _kept() -> list[int]:
    from ddlf.training.replica import warm

    return sorted(id(model) for model, _ in warm._KEPT.values())


def _train(app: ddlf.IApp, **kw: Any) -> ddlf.History:
    strategy = kw.pop("strategy", ddlf.ModelAveraging(every=10))
    return app.train(epochs=2, batch_size=32, strategy=strategy, run=ddlf.RunConfig(seed=11), verbose=0, **kw)


STRATEGIES = {
    "master": {},
    "ring": {"strategy": ddlf.ModelAveraging(every=10, exchange=ddlf.Ring())},
    "gradients": {"strategy": ddlf.GradientAveraging(check_in_every=10)},
}


@pytest.mark.slow
@pytest.mark.parametrize("kw", list(STRATEGIES.values()), ids=list(STRATEGIES))
def test_a_warm_run_learns_exactly_what_a_cold_run_learns(kw: dict[str, Any]) -> None:
    with pooled(2) as c:
        cold = DropoutMnist(c)
        h_cold = _train(cold, **kw)
        kept = c.call(_kept)
        assert all(len(k) == 1 for k in kept), kept  # each worker keeps the traced model
        warm = DropoutMnist(c)
        h_warm = _train(warm, **kw)
        # The same model objects were lent to the second run and kept again after it.
        assert c.call(_kept) == kept
        assert h_warm.history == h_cold.history
        for a, b in zip(cold.model.get_weights(), warm.model.get_weights(), strict=True):
            np.testing.assert_array_equal(a, b)


def test_another_architecture_is_built_fresh_and_both_are_kept() -> None:
    with pooled(1) as c:
        _train(SmallMnist(c))
        first = c.call(_kept)[0]
        h = _train(WiderMnist(c))
        both = c.call(_kept)[0]
        assert len(both) == 2 and set(first) < set(both)
        assert h.history["loss"][-1] < h.history["loss"][0]


class RankedLabels(ddlf.IApp):
    """The same model for labels shaped ``(n,)`` or ``(n, 1)``: a step traced for one rank cannot take the other."""

    def __init__(self, cluster: ddlf.Cluster, column: bool) -> None:
        super().__init__(cluster)
        self.column = column
        self.dataset_key = f"warm-ranked-labels-{column}"

    def load_dataset(self) -> Any:
        rng = np.random.default_rng(0)
        x = rng.standard_normal((200, 6)).astype(np.float32)
        y = (x[:, 0] > 0).astype(np.int64)
        return x, (y[:, None] if self.column else y)

    def create_model(self) -> Any:
        import keras

        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2, activation="softmax")])
        model.compile("sgd", "sparse_categorical_crossentropy")
        return model


@pytest.mark.parametrize("strategy", [ddlf.GradientAveraging(), ddlf.ModelAveraging(every=5)], ids=["ga", "ma"])
def test_a_kept_model_is_not_lent_to_data_of_another_shape(cluster: ddlf.Cluster, strategy: Any) -> None:
    """The same architecture fed labels of another rank trains as a cold run does (a fresh model, traced for its
    data), and each kind of data then finds its own kept model."""
    losses = []
    for column in (False, True, False, True):
        h = RankedLabels(cluster, column).train(epochs=1, batch_size=32, verbose=0, strategy=strategy)
        losses.append(h.history["loss"][0])
    assert all(np.isfinite(losses))
    assert losses[0] == losses[2] and losses[1] == losses[3]  # warm runs learn what the cold ones did
    assert [len(k) for k in cluster.run(_kept)] == [2, 2]


_TORCH_FIRST = textwrap.dedent(
    """
    import json, sys
    import torch  # as a script that also trains PyTorch models does, before Keras is loaded
    import ddlf
    from tests.e2e.test_warm_models import DropoutMnist

    addresses, token = json.loads(sys.argv[1])
    with ddlf.Cluster(addresses, token=token) as cluster:
        runs = []
        for _ in range(2):
            app = DropoutMnist(cluster)
            h = app.train(epochs=1, batch_size=32, run=ddlf.RunConfig(seed=11), verbose=0)
            runs.append({"history": h.history, "weights": [float(w.sum()) for w in app.model.get_weights()]})
    print(json.dumps(runs))
    """
)


@pytest.mark.slow
def test_a_scripts_first_run_learns_what_the_same_seed_learns_later() -> None:
    """A script that imported torch leaves Keras unloaded when a run seeds; the Keras model's ``create_model()``
    then loads it, and Keras' import draws from Python's generator: the first run's initial weights were not the
    seed's (its histories differed from every later run's with the same seed)."""
    pytest.importorskip("torch")
    spec = json.dumps([pool_addresses(2), POOL.token])
    done = subprocess.run(
        [sys.executable, "-c", _TORCH_FIRST, spec], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = json.loads(done.stdout.strip().splitlines()[-1])
    assert first == second
