"""The master's model holds the optimizer state as ``fit`` leaves it, and the next ``train`` goes on from it
(``ddlf.training.master_optimizer``)."""

from __future__ import annotations

import numpy as np
import pytest

import ddlf

from .apps import ROWS, Linear, global_batches


class AdamLinear(Linear):
    optimizer = "adam"
    learning_rate = 0.01


def _max_diff(a: list, b: list) -> float:
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))) for x, y in zip(a, b))


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_a_second_train_goes_on_from_the_optimizer_as_a_second_fit_does(cluster: ddlf.Cluster, shard: bool) -> None:
    """Two ``train(epochs=1)`` calls with gradient averaging learn as one process's two ``fit`` calls on the same
    global batches: Adam's moments and step count carry over (restarting them moves the weights 1000x more than
    float32 rounding), and the master's optimizer ends holding the very state one process's does."""
    app = AdamLinear(cluster)
    app.model = app.create_model()
    start = app.model.get_weights()
    strategy = ddlf.GradientAveraging(shard_optimizer=shard)
    for _ in range(2):
        app.train(epochs=1, batch_size=16, verbose=0, strategy=strategy, run=ddlf.RunConfig(seed=4))

    x, y = app.load_dataset()
    batches = global_batches(2, 16, 1, 4, None)
    one = app.create_model()
    one.set_weights(start)
    for rows in batches + batches:
        one.train_on_batch(x[rows], y[rows])
    restarted = app.create_model()  # what a fresh optimizer at the second train would give
    restarted.set_weights(start)
    for rows in batches:
        restarted.train_on_batch(x[rows], y[rows])
    again = app.create_model()
    again.set_weights(restarted.get_weights())
    for rows in batches:
        again.train_on_batch(x[rows], y[rows])

    diff = _max_diff(app.model.get_weights(), one.get_weights())
    assert diff < 1e-6, diff
    assert _max_diff(again.get_weights(), one.get_weights()) > 1000 * max(diff, 1e-7)
    assert int(app.model.optimizer.iterations.numpy()) == int(one.optimizer.iterations.numpy()) == 2 * len(batches)
    state, want = app.model.optimizer.variables, one.optimizer.variables
    assert len(state) == len(want)
    assert _max_diff([v.numpy() for v in state], [v.numpy() for v in want]) < 1e-6


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_model_averaging_leaves_the_mean_of_the_workers_optimizers(cluster: ddlf.Cluster, mode: str) -> None:
    """Each worker steps its own optimizer; the master's ends with their mean (the step count: a worker's steps),
    its learning rate its own."""
    app = AdamLinear(cluster)
    strategy = ddlf.Asynchronous(chunk=5) if mode == "async" else ddlf.ModelAveraging(every=5)
    app.train(epochs=2, batch_size=16, verbose=0, strategy=strategy)
    steps = 2 * (-(-(ROWS // 2) // 16))  # each worker's batches over two epochs
    optimizer = app.model.optimizer
    assert optimizer.built and abs(int(optimizer.iterations.numpy()) - steps) <= 2
    moments = [v.numpy() for v in optimizer.variables if len(v.shape)]
    assert moments and all(np.isfinite(m).all() for m in moments) and any(np.abs(m).max() > 0 for m in moments)
    assert float(optimizer.learning_rate.numpy()) == pytest.approx(AdamLinear.learning_rate)


def _worker_rate() -> list[float]:
    """The learning rate each run on this worker trains with now."""
    from ddlf.training.replica.registry import SESSIONS

    return [float(SESSIONS.get(r["run_id"]).model.optimizer.learning_rate.numpy()) for r in SESSIONS.runs()]


def test_a_scaled_learning_rate_stays_on_the_workers(cluster: ddlf.Cluster) -> None:
    """``scale_learning_rate`` multiplies the workers' rate, not the master's: a second train scales the
    compiled rate once again, not twice."""
    app = AdamLinear(cluster)
    seen: list[list[float]] = []
    probe = ddlf.callbacks.LambdaCallback(on_round_end=lambda r, logs: seen.append(cluster.run_on(0, _worker_rate)))
    strategy = ddlf.GradientAveraging(scale_learning_rate=True)
    for _ in range(2):
        seen.clear()
        app.train(epochs=1, batch_size=16, verbose=0, callbacks=[probe], strategy=strategy)
        assert seen and all(rates == [pytest.approx(2 * AdamLinear.learning_rate)] for rates in seen), seen
        assert float(app.model.optimizer.learning_rate.numpy()) == pytest.approx(AdamLinear.learning_rate)
