"""Learning quality (issue 37): what ddlf's defaults learn in an epoch, against the user's one-process ``fit``.

Asynchronous training with its default chunk learns as one process does after the same epochs. With chunks of 10
batches (the default before issue 37) four workers ended 15-27 points below one process on MNIST (each change
merged into weights that had moved by the other workers' 30 steps); the default chunk keeps that staleness near
two steps. ``python -m benchmarks accuracy`` has the tables.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import ddlf

from ..conftest import MNIST_DIR, pooled

ROWS, EPOCHS, BATCH = 6000, 3, 64


class Mlp(ddlf.IApp):
    """The issue's MNIST MLP (784-128-10, Adam 1e-3) on the first 6,000 rows."""

    dataset_key = "mnist-quality-test"

    def load_dataset(self):
        (x, y), _ = ddlf.datasets.mnist(MNIST_DIR)
        return x[:ROWS], y[:ROWS]

    def preprocess(self, x, y):
        return x.reshape(len(x), -1).astype(np.float32) / 255.0, y

    def create_model(self):
        model = keras.Sequential(
            [keras.Input((784,)), keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10, "softmax")]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy", metrics=["accuracy"]
        )
        return model


@pytest.fixture(scope="module")
def mnist_rows():
    """2,000 test rows, raw as the workers hold theirs (``app.evaluate`` runs ``preprocess`` on them)."""
    _, (xt, yt) = ddlf.datasets.mnist(MNIST_DIR)
    return xt[:2000], yt[:2000]


def _one_process(seed: int, mnist_rows) -> float:
    keras.utils.set_random_seed(seed)
    app = Mlp(None)
    x, y = app.preprocess(*app.load_dataset())
    model = app.create_model()
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0)
    return float(model.evaluate(*app.preprocess(*mnist_rows), verbose=0)[1])


@pytest.mark.slow
def test_async_on_four_workers_learns_as_one_process(mnist_rows) -> None:
    """Four workers, ``Asynchronous()``: the test accuracy after the same epochs within 2 points of one process at
    the same batch (measured: within 1 at 12,000 rows; chunks of 10 batches were 15-27 points below there, and
    here 44.6% against one process's 89.0%)."""
    single = _one_process(0, mnist_rows)
    with pooled(4) as cluster:
        app = Mlp(cluster)
        h = app.train(EPOCHS, BATCH, strategy=ddlf.Asynchronous(), run=ddlf.RunConfig(seed=0), verbose=0)
        _, acc = app.evaluate(*mnist_rows)
    assert len(h.history["loss"]) == EPOCHS
    assert max(s.staleness for s in h.stats) >= 1  # the four really ran at once
    assert acc >= single - 0.02, (acc, single)
    assert {s.samples for s in h.stats} <= {BATCH, ROWS % BATCH}  # chunks of one batch on four workers


@pytest.mark.slow
def test_sync_defaults_on_four_workers_learn_as_one_process(mnist_rows) -> None:
    """Four workers, no strategy given: ddlf's default (gradient averaging, learning rate x 4) within 1.5 points of
    one process at the same batch after the same epochs (measured: 89.8% against 89.0%). Model averaging once per
    epoch, the default before, ended 4.1 points below (84.9%) on the same seed."""
    single = _one_process(0, mnist_rows)
    with pooled(4) as cluster:
        app = Mlp(cluster)
        h = app.train(EPOCHS, BATCH, run=ddlf.RunConfig(seed=0), verbose=0)
        _, acc = app.evaluate(*mnist_rows)
    assert h.params["strategy"] == "GradientAveraging"
    assert h.params["scale_learning_rate"] is True
    assert "learning rate x 4" in h.params["strategy_reason"]
    assert len(h.history["loss"]) == EPOCHS
    assert acc >= single - 0.015, (acc, single)
