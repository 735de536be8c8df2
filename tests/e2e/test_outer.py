"""The outer optimizer (DiLoCo's Nesterov step on each round's averaged change) with both exchanges: the ring's
replicas stay bit-identical and end where the master exchange does, a worker that joins adopts the momentum,
and what cannot work is refused before training starts."""

from __future__ import annotations

import numpy as np
import pytest

import ddlf
from ddlf.training.callbacks import LambdaCallback

from ..conftest import POOL, pool_addresses, pooled
from .apps import FaultApp, Linear, Replicas

KW = {"epochs": 2, "batch_size": 32, "run": ddlf.RunConfig(seed=5), "verbose": 0}
OUTER = ddlf.Nesterov(learning_rate=0.7, momentum=0.9)


def _off(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


@pytest.mark.slow
def test_ring_and_master_exchange_agree_and_the_step_changes_the_result() -> None:
    # A smooth model (tanh, plain SGD, no dropout), so that the exchanges' rounding difference stays rounding. With
    # ReLU and Adam it need not: on TensorFlow the dropout MLP's hidden unit 55 sat at its threshold in the first
    # round of epoch 2, the 1e-7 difference switched it on for one path only, and Adam turned that into steps of
    # the learning rate's size (3.8e-4 apart after the round; indices, step counts and dropout seeds identical).
    kw = {"epochs": 4, "batch_size": 32, "run": ddlf.RunConfig(seed=5), "verbose": 0}
    with pooled(3) as c:
        plain = Linear(c)
        plain.train(**kw, strategy=ddlf.ModelAveraging(every=2))
        master = Linear(c)
        hm = master.train(**kw, strategy=ddlf.ModelAveraging(every=2, outer=OUTER))
        ring = Linear(c)
        held = Replicas(c)
        ring.train(**kw, strategy=ddlf.ModelAveraging(every=2, outer=OUTER, exchange=ddlf.Ring()), callbacks=[held])
        assert hm.params["outer_optimizer"] == "nesterov"
        assert len({(s.epoch, s.round) for s in hm.stats}) >= 12  # enough rounds for the momentum to matter
        # Every member applied the same step to the same average with the same momentum: identical bits.
        assert len(held.held) == 3 and held.identical()
        # The ring sums in another order than the master: float32 rounding apart, amplified a little by momentum
        # (measured 1.2e-6 on TensorFlow, 8e-7 on JAX).
        assert _off(master.model.get_weights(), ring.model.get_weights()) < 1e-5
        # And the outer step is really applied: far from plain averaging (measured 0.38).
        assert _off(master.model.get_weights(), plain.model.get_weights()) > 1e-1
        assert np.isfinite(hm.history["loss"]).all() and hm.history["loss"][-1] < hm.history["loss"][0]


@pytest.mark.slow
def test_learning_rate_one_without_momentum_is_model_averaging() -> None:
    with pooled(2) as c:
        plain, outer = FaultApp(c), FaultApp(c)
        plain.train(**KW, strategy=ddlf.ModelAveraging(every=10))
        outer.train(**KW, strategy=ddlf.ModelAveraging(every=10, outer=ddlf.Nesterov(learning_rate=1.0, momentum=0.0)))
        assert _off(plain.model.get_weights(), outer.model.get_weights()) < 1e-5


@pytest.mark.slow
def test_a_worker_that_joins_the_ring_adopts_the_momentum() -> None:
    *pair, extra = pool_addresses(3)
    with ddlf.Cluster(pair, token=POOL.token) as c:
        app = FaultApp(c)
        added: dict[str, bool] = {}

        def on_round_end(r: int, logs: dict) -> None:
            if r == 4 and not added:
                added["yes"] = True
                c.add_worker(extra)

        held = Replicas(c)  # after add_worker: fetches from the three workers at the end of every round
        cbs = [LambdaCallback(on_round_end=on_round_end), held]
        h = app.train(**KW, strategy=ddlf.ModelAveraging(every=10, outer=OUTER, exchange=ddlf.Ring()), callbacks=cbs)
        assert any(e["event"] == "joined" for e in h.events), h.events
        # The newcomer adopted the others' momentum: after its rounds every replica holds the same bits (with
        # zeros in its momentum instead, its outer step would part from theirs).
        assert len(held.held) == 3 and held.identical()


def test_what_cannot_work_is_refused_before_training(cluster: ddlf.Cluster) -> None:
    app = FaultApp(cluster)
    # The outer optimizer exists only on ModelAveraging: gradient averaging and asynchronous training have no
    # such field, so those combinations cannot be written. What can be written wrong is refused when made.
    with pytest.raises(TypeError, match=r"outer must be None or a ddlf\.Nesterov"):
        ddlf.ModelAveraging(outer="adam")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Nesterov\.momentum"):
        ddlf.Nesterov(momentum=1.5)
    with pytest.raises(ValueError, match=r"Nesterov\.learning_rate"):
        app.train(epochs=1, verbose=0, strategy=ddlf.ModelAveraging(outer=ddlf.Nesterov(learning_rate=0)))
    assert cluster.ping()
