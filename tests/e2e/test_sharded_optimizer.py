"""``GradientAveraging(shard_optimizer=True)`` (ZeRO stage 1): each worker holds the optimizer state of its shard of
the weights only, and n workers still learn exactly as one process on the global batches, with bit-identical
replicas; the state survives checkpoints (on another number of workers) and lost workers."""

from __future__ import annotations

import numpy as np
import pytest

import ddlf

from ..conftest import POOL, pooled
from .apps import ROWS, Linear, Replicas, global_batches, one_process, train_replicated


class AdamLinear(Linear):
    dataset_key = "sharded-test-linear"
    optimizer = "adam"
    learning_rate = 0.01


class ClippedAdamW(AdamLinear):
    """AdamW under a cosine schedule, clipped by the global norm (what transformers train with): the norm is over
    every rank's shard, the schedule follows the shard optimizer's own step count."""

    dataset_key = "sharded-test-adamw"

    def create_model(self):
        import keras

        model = super().create_model()
        schedule = keras.optimizers.schedules.CosineDecay(0.02, decay_steps=60, warmup_target=None)
        opt = keras.optimizers.AdamW(schedule, weight_decay=0.05, global_clipnorm=0.05)
        model.compile(optimizer=opt, loss="binary_crossentropy", metrics=["accuracy"])
        return model


def test_adamw_with_a_schedule_and_global_norm_clipping_shards_exactly() -> None:
    with pooled(2, spare=True) as c:
        app = ClippedAdamW(c)
        app.model = app.create_model()
        start = app.model.get_weights()
        held = Replicas(c)
        strategy = ddlf.GradientAveraging(shard_optimizer=True)
        app.train(epochs=1, batch_size=16, callbacks=[held], verbose=0, strategy=strategy, run=ddlf.RunConfig(seed=4))
        got = app.model.get_weights()
    batches = global_batches(2, 16, 1, 4, None)
    x, y = app.load_dataset()
    model = app.create_model()  # one process: the same optimizer, its schedule untouched (one_process sets a rate)
    model.set_weights(start)
    for rows in batches:
        model.train_on_batch(x[rows], y[rows])
    want = model.get_weights()
    diff = _max_diff(got, want)
    assert diff < 5e-5, diff
    assert _max_diff(got, start) > 100 * diff
    assert held.identical()
    # Without the clipping the weights end elsewhere: the norm was over the whole gradient, and it clipped.
    unclipped = ClippedAdamW(None).create_model()
    unclipped.optimizer.global_clipnorm = None
    unclipped.set_weights(start)
    for rows in batches:
        unclipped.train_on_batch(x[rows], y[rows])
    assert _max_diff(unclipped.get_weights(), want) > 20 * diff


def _max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.slow
def test_sharded_adam_on_n_workers_equals_one_process_and_the_replicas_are_identical(n: int) -> None:
    strategy = ddlf.GradientAveraging(shard_optimizer=True)
    app, start, got, h, held = train_replicated(AdamLinear, n, strategy)
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


@pytest.mark.slow
def test_a_sharded_checkpoint_resumes_on_another_number_of_workers_with_its_whole_state(tmp_path) -> None:
    """One epoch on 3 workers writes the checkpoint (the master joins the three shards); the second epoch resumes
    on 2, which cut the whole state into their own shards: the result is one process's over both epochs' global
    batches with Adam's moments carried across (restarting them from zeros would show)."""
    strategy = ddlf.GradientAveraging(shard_optimizer=True)
    with pooled(3, spare=True) as c:
        app = AdamLinear(c)
        app.model = app.create_model()
        start = app.model.get_weights()
        app.train(1, 16, verbose=0, strategy=strategy, run=ddlf.RunConfig(seed=4, checkpoint_dir=str(tmp_path)))
        resume = ddlf.RunConfig(seed=4, checkpoint_dir=str(tmp_path), resume=True, workers=[0, 1])
        h = app.train(2, 16, verbose=0, strategy=strategy, run=resume)
        got = app.model.get_weights()
        # The unsharded setting refuses the sharded checkpoint by name.
        with pytest.raises(ValueError, match="sharded optimizer state"):
            app.train(3, 16, verbose=0, strategy=ddlf.GradientAveraging(), run=resume)
    assert any(e["event"] == "resumed" for e in h.events)
    first = global_batches(3, 16, 1, 4, None)
    second = global_batches(2, 16, 2, 4, None)[len(global_batches(2, 16, 1, 4, None)) :]
    want = one_process(app, start, first + second)
    diff = _max_diff(got, want)
    assert diff < 5e-5, diff
    fresh_moments = AdamLinear(None)
    restarted = one_process(fresh_moments, one_process(fresh_moments, start, first), second)
    assert _max_diff(restarted, want) > 20 * diff  # moments restarted would not pass


def test_a_worker_killed_mid_round_is_left_out_and_its_shard_restarts_with_a_warning() -> None:
    from .apps import _kill_at_round

    with pooled(3, spare=True) as c:
        victim = POOL.pid(2, spare=True)
        cb, _when = _kill_at_round(victim, 2)
        app = AdamLinear(c)
        held = Replicas(c)
        with pytest.warns(RuntimeWarning, match="optimizer state of .* weights went with a lost worker"):
            h = app.train(
                epochs=2,
                batch_size=16,
                callbacks=[cb, held],
                verbose=0,
                strategy=ddlf.GradientAveraging(check_in_every=2, shard_optimizer=True),
                run=ddlf.RunConfig(seed=3),
            )
    assert [e["worker"] for e in h.events if e["event"] == "lost"] == [2]
    (lost_state,) = [e for e in h.events if e["event"] == "optimizer_state_lost"]
    assert 0 < lost_state["elements"] <= -(-225 // 3)
    assert sum(s.samples for s in h.stats if s.epoch == 1) == ROWS  # the survivors cover the last epoch
    assert len(held.held) == 2 and held.identical()
    # The survivors each hold half of the state now.
    assert sorted(s.optimizer_state_bytes for s in h.stats if s.epoch == 1)[-1] <= -(-225 // 2) * 2 * 4
    assert h.history["accuracy"][-1] > 0.85


class Clipped(AdamLinear):
    dataset_key = "sharded-test-clipped"

    def create_model(self):
        import keras

        model = super().create_model()
        model.compile(optimizer=keras.optimizers.Adam(0.01, clipnorm=1.0), loss="binary_crossentropy")
        return model


class Lamb(AdamLinear):
    dataset_key = "sharded-test-lamb"

    def create_model(self):
        import keras

        model = super().create_model()
        model.compile(optimizer=keras.optimizers.Lamb(0.01), loss="binary_crossentropy")
        return model


@pytest.mark.parametrize(("app_class", "reason"), [(Clipped, "clipnorm"), (Lamb, "Lamb is not one whose state")])
def test_an_optimizer_that_cannot_be_sharded_is_refused_before_training(cluster, app_class, reason) -> None:
    app = app_class(cluster)
    with pytest.raises(ValueError, match=reason):
        app.train(1, 16, verbose=0, strategy=ddlf.GradientAveraging(shard_optimizer=True))
    # Refused after the workers set it up: they forgot it (a run left there held their ring for the next one).
    assert cluster.run(ddlf.training.replica.runs) == [[]] * len(cluster)
    # Unsharded, the same model trains on the same workers.
    h = app.train(1, 16, verbose=0, strategy=ddlf.GradientAveraging())
    assert len(h.history["loss"]) == 1
