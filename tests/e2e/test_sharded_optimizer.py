"""``GradientAveraging(shard_optimizer=True)`` (ZeRO stage 1): each worker holds the optimizer state of its shard of
the weights only, and n workers still learn exactly as one process on the global batches, with bit-identical
replicas; the state survives checkpoints (on another number of workers) and lost workers."""

from __future__ import annotations

import numpy as np
import pytest

import ddlf

from .apps import Linear, Replicas, global_batches, one_process


class AdamLinear(Linear):
    dataset_key = "sharded-test-linear"
    optimizer = "adam"
    learning_rate = 0.01


def _max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


@pytest.mark.parametrize("n", [2, 3])
def test_sharded_adam_on_n_workers_equals_one_process_and_the_replicas_are_identical(n: int) -> None:
    with ddlf.Cluster.local(n, threads=1) as c:
        app = AdamLinear(c)
        app.model = app.create_model()
        start = app.model.get_weights()
        held = Replicas(c)
        h = app.train(
            epochs=2,
            batch_size=16,
            callbacks=[held],
            verbose=0,
            strategy=ddlf.GradientAveraging(shard_optimizer=True),
            run=ddlf.RunConfig(seed=4),
        )
        got = app.model.get_weights()
    assert h.params["shard_optimizer"] is True
    want = one_process(app, start, global_batches(n, 16, 2, 4, None))
    diff = _max_diff(got, want)
    assert diff < 5e-5, diff
    assert _max_diff(got, start) > 100 * diff  # it trained
    assert len(held.held) == n and held.identical()
    # Each worker held about 1/n of Adam's two moments (12*16 + 16 + 16 + 1 = 225 weights).
    per_worker = [s.optimizer_state_bytes for s in h.stats if s.epoch == 1]
    assert len(per_worker) == n
    assert sum(per_worker) == 2 * 225 * 4, per_worker
    assert max(per_worker) <= -(-225 // n) * 2 * 4
