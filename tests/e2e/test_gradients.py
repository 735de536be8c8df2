"""``averaging="gradients"``: n workers averaging gradients every step over the ring learn exactly like one process
trained on the same global batches (the union of the workers' batches of each step), in the same order."""

from __future__ import annotations

import numpy as np
import pytest

import ddlf
from ddlf.errors import NonFiniteUpdate
from ddlf.training.callbacks import LambdaCallback

from ..conftest import POOL, pool_addresses, pooled
from .apps import ROWS, Linear, Nan, Replicas, _kill_at_round, global_batches, one_process, train_replicated


@pytest.mark.parametrize(("n", "frequency", "hierarchical"), [(2, None, None), (3, 4, None), (3, None, False)])
def test_n_workers_equal_one_process_on_the_global_batches(
    n: int, frequency: int | None, hierarchical: bool | None
) -> None:
    """Local workers reduce through the host's shared memory; ``hierarchical=False`` makes them a flat ring, as
    one worker per host is, whose passes send each gradient from where it lies and write the means straight
    into the step's arrays (three ranks: means are sums scaled as each rank finishes with them)."""
    strategy = ddlf.GradientAveraging(check_in_every=frequency, ring=ddlf.Ring(hierarchical=hierarchical))
    app, start, got, h, held = train_replicated(Linear, n, strategy)
    assert h.params["exchange"] == "allreduce" and h.params["averaging"] == "gradients"
    want = one_process(app, start, global_batches(n, 16, 2, 4, frequency))
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(got, want))
    assert diff < 2e-5, diff  # float32: the mean of per-worker means against one mean over the union
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(got, start))
    assert moved > 100 * diff  # it trained: the match is not two untouched models
    # Every replica holds the very same bits, and the master fetched them.
    assert len(held.held) == n and held.identical()
    assert all(a.tobytes() == b.tobytes() for a, b in zip(held.held[0], got))
    assert sum(s.samples for s in h.stats) == 2 * ROWS


class OwnStep(Linear):
    """The same model with its own ``train_step`` (Keras' guide *Customizing what happens in fit*): a scaled loss,
    so that running the compiled loss instead would show."""

    def create_model(self):
        import keras
        import tensorflow as tf

        class Stepped(keras.Sequential):
            def train_step(self, data):
                x, y = data[0], data[1]
                with tf.GradientTape() as tape:
                    y_pred = self(x, training=True)
                    loss = 3.0 * self.compute_loss(y=y, y_pred=y_pred)
                grads = tape.gradient(loss, self.trainable_variables)
                self.optimizer.apply(grads, self.trainable_variables)
                return {"loss": loss}

        base = super().create_model()
        model = Stepped(base.layers)
        model.compile(optimizer=keras.optimizers.SGD(self.learning_rate), loss="binary_crossentropy")
        return model


def test_a_custom_train_step_averages_its_own_gradients_as_one_process() -> None:
    """Two workers averaging gradients run the model's own ``train_step`` (its optimizer's apply caught, the
    gradients averaged, then applied): the weights are one process's on the global batches with that same step."""
    with pooled(2, spare=True) as c:
        app = OwnStep(c)
        app.model = app.create_model()
        start = app.model.get_weights()
        app.train(epochs=1, batch_size=16, verbose=0, strategy=ddlf.GradientAveraging(), run=ddlf.RunConfig(seed=4))
        got = app.model.get_weights()
    want = one_process(app, start, global_batches(2, 16, 1, 4, None))
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(got, want))
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(got, start))
    assert diff < 2e-5 and moved > 100 * diff, (diff, moved)


def test_scaled_learning_rate_equals_one_process_at_n_times_the_rate() -> None:
    with pooled(2, spare=True) as c:
        app = Linear(c)
        app.model = app.create_model()
        start = app.model.get_weights()
        app.train(
            epochs=1,
            batch_size=16,
            verbose=0,
            strategy=ddlf.GradientAveraging(scale_learning_rate=True),
            run=ddlf.RunConfig(seed=2),
        )
        want = one_process(app, start, global_batches(2, 16, 1, 2, None), lr_scale=2.0)
        diff = max(float(np.max(np.abs(a - b))) for a, b in zip(app.model.get_weights(), want))
        assert diff < 2e-5, diff
        # With a warm-up the rate climbs step by step from 1x to 2x over the first epoch, then stays at 2x.
        rates: list[list[float]] = []
        probe = Replicas(c)

        def on_round_end(r: int, logs: dict) -> None:
            probe._fetch(r, logs)
            rates.append(c.run(_learning_rate, probe.run_id))

        app.train(
            epochs=2,
            batch_size=16,
            callbacks=[LambdaCallback(on_round_end=on_round_end)],
            verbose=0,
            strategy=ddlf.GradientAveraging(scale_learning_rate=True, warmup_epochs=1, check_in_every=3),
            run=ddlf.RunConfig(seed=2),
        )
        first = [r[0] / Linear.learning_rate for r in rates]
        assert all(r[0] == r[1] for r in rates)  # both workers at the same rate
        assert 1.0 < first[0] < 1.3 and first == sorted(first), first
        assert first[len(first) // 2 - 1] < 2.0 and first[-1] == pytest.approx(2.0), first


def _learning_rate(run_id: str) -> float:
    from ddlf.training.replica.registry import SESSIONS

    return float(np.asarray(SESSIONS.get(run_id).model.optimizer.learning_rate))


@pytest.mark.slow
def test_adam_replicas_stay_identical_and_learn() -> None:
    with pooled(2, spare=True) as c:
        app = AdamApp(c)
        held = Replicas(c)
        h = app.train(
            epochs=3,
            batch_size=32,
            callbacks=[held],
            verbose=0,
            strategy=ddlf.GradientAveraging(check_in_every=5),
            run=ddlf.RunConfig(seed=1),
        )
        assert h.history["loss"][-1] < h.history["loss"][0]
        assert h.history["accuracy"][-1] > 0.9
        assert len(held.held) == 2 and held.identical()


def test_options_that_do_not_fit_are_refused_before_training(cluster: ddlf.Cluster) -> None:
    app = Linear(cluster)
    # What does not fit gradient averaging cannot be written: it has no exchange but its ring, no top-k, no
    # optimizer-state averaging, no outer optimizer. What can be written wrong is refused when the option is made.
    with pytest.raises(TypeError, match="unexpected keyword argument 'optimizer_state'"):
        ddlf.GradientAveraging(optimizer_state=True)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"ring must be a ddlf\.Ring"):
        ddlf.GradientAveraging(ring=ddlf.ThroughMaster())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Ring\.compression"):
        ddlf.GradientAveraging(ring=ddlf.Ring(compression="topk"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="scale_learning_rate=True"):
        ddlf.GradientAveraging(warmup_epochs=2)
    with pytest.raises(ValueError, match="warmup_epochs must be"):
        ddlf.GradientAveraging(warmup_epochs=-1, scale_learning_rate=True)
    with pytest.raises(ValueError, match="bucket_cap_mb must be"):
        ddlf.GradientAveraging(bucket_cap_mb=0)
    with pytest.raises(TypeError, match="scale_learning_rate must be True or False"):
        app.train(epochs=1, verbose=0, strategy=ddlf.GradientAveraging(scale_learning_rate="yes"))
    with pytest.raises(ValueError, match="warmup_epochs must be"):
        app.train(
            epochs=1, verbose=0, strategy=ddlf.GradientAveraging(scale_learning_rate=True, warmup_epochs=float("nan"))
        )

    class Scheduled(Linear):
        def create_model(self):
            import keras

            model = super().create_model()
            decay = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.9)
            model.compile(optimizer=keras.optimizers.SGD(decay), loss="binary_crossentropy")
            return model

    with pytest.raises(ValueError, match="learning-rate schedule"):
        Scheduled(cluster).train(epochs=1, verbose=0, strategy=ddlf.GradientAveraging(scale_learning_rate=True))
    assert cluster.ping()
    h = Scheduled(cluster).train(epochs=1, verbose=0, strategy=ddlf.GradientAveraging())  # without scaling it trains
    assert h.history["loss"]


def test_a_model_averaging_checkpoint_is_not_resumed_by_gradient_averaging(cluster: ddlf.Cluster, tmp_path) -> None:
    """Model averaging leaves each worker its own optimizer state; gradient averaging resuming it would start its
    replicas apart. It is refused by name before any round, the checkpoint is kept, and the strategy that wrote
    it resumes it."""
    app = Linear(cluster)
    app.optimizer = "adam"
    run = ddlf.RunConfig(checkpoint_dir=str(tmp_path), seed=1)
    app.train(1, 32, strategy=ddlf.ModelAveraging(every=4), run=run, verbose=0)
    resume = ddlf.RunConfig(checkpoint_dir=str(tmp_path), seed=1, resume=True)
    with pytest.raises(ValueError, match="written by ModelAveraging; resuming it with GradientAveraging"):
        app.train(2, 32, strategy=ddlf.GradientAveraging(), run=resume, verbose=0)
    h = app.train(2, 32, strategy=ddlf.ModelAveraging(every=4), run=resume, verbose=0)
    assert len(h.history["loss"]) == 2 and any(e["event"] == "resumed" for e in h.events)


@pytest.mark.parametrize(("wire", "tol"), [("float16", 2e-3), ("bfloat16", 2e-2)])
@pytest.mark.slow
def test_half_precision_gradients_stay_near_one_process_and_replicas_identical(wire: str, tol: float) -> None:
    with pooled(3, spare=True) as c:
        app = Linear(c)
        app.model = app.create_model()
        start = app.model.get_weights()
        held = Replicas(c)
        strategy = ddlf.GradientAveraging(check_in_every=4, ring=ddlf.Ring(compression=wire))  # type: ignore[arg-type]
        h = app.train(
            epochs=2, batch_size=16, strategy=strategy, run=ddlf.RunConfig(seed=4), callbacks=[held], verbose=0
        )
        assert h.params["compression"] == wire
        got = app.model.get_weights()
        want = one_process(app, start, global_batches(3, 16, 2, 4, 4))
        moved = max(float(np.max(np.abs(a - b))) for a, b in zip(want, start))
        diff = max(float(np.max(np.abs(a - b))) for a, b in zip(got, want))
        assert 0 < diff < tol * moved * 10, (diff, moved)  # rounded on the wire, yet the same descent
        assert len(held.held) == 3 and held.identical()  # the same rounded bits applied everywhere


class Huge(Linear):
    """Targets of 1e6 under MSE: gradients far past float16's 65504."""

    dataset_key = "gradients-test-huge"

    def load_dataset(self):
        x, y = super().load_dataset()
        return x, (y * 1e6).astype(np.float32)

    def create_model(self):
        model = super().create_model()
        model.compile(optimizer=model.optimizer, loss="mse")
        return model


def test_float16_overflow_on_the_wire_skips_the_step_everywhere_and_is_reported() -> None:
    with pooled(2, spare=True) as c:
        app = Huge(c)
        app.model = app.create_model()
        start = app.model.get_weights()
        # Two workers of one host reduce through shared memory by default: float16 is for the wire between
        # hosts, so nothing is rounded there and the run trains without overflowing.
        h = app.train(
            epochs=1,
            batch_size=16,
            verbose=0,
            strategy=ddlf.GradientAveraging(ring=ddlf.Ring(compression="float16")),
            run=ddlf.RunConfig(seed=0),
        )
        assert not [e for e in h.events if e["event"] == "wire_overflow"], h.events
        assert all(np.isfinite(w).all() for w in app.model.get_weights())
        app.model.set_weights(start)
        # The flat ring puts the two workers' gradients on a TCP link in float16: they overflow there.
        with pytest.warns(RuntimeWarning, match="overflowed"):
            h = app.train(
                epochs=1,
                batch_size=16,
                verbose=0,
                strategy=ddlf.GradientAveraging(ring=ddlf.Ring(hierarchical=False, compression="float16")),
                run=ddlf.RunConfig(seed=0),
            )
        events = [e for e in h.events if e["event"] == "wire_overflow"]
        assert events and events[0]["updates"] > 0, h.events
        got = app.model.get_weights()
        assert all(np.isfinite(w).all() for w in got)  # an infinite average applied once would be everywhere
        steps = -(-ROWS // 2 // 16)  # the epoch's lockstep steps: 300 rows a worker, batches of 16
        changed = any(not np.array_equal(a, b) for a, b in zip(got, start))
        assert events[0]["updates"] <= steps
        assert changed == (events[0]["updates"] < steps)  # the steps that fit float16 applied, the others not
        # bfloat16 carries float32's range: the same run trains.
        h = app.train(
            epochs=1,
            batch_size=16,
            verbose=0,
            strategy=ddlf.GradientAveraging(ring=ddlf.Ring(compression="bfloat16")),
            run=ddlf.RunConfig(seed=0),
        )
        assert not [e for e in h.events if e["event"] == "wire_overflow"]
        assert c.ping()


def test_nan_gradients_are_left_out_of_the_step_and_reported() -> None:
    with pooled(2, spare=True) as c:
        app = Nan(c)
        with pytest.warns(RuntimeWarning, match="non-finite gradients"):
            h = app.train(
                epochs=1, batch_size=16, verbose=0, strategy=ddlf.GradientAveraging(), run=ddlf.RunConfig(seed=0)
            )
        events = [e for e in h.events if e["event"] == "nonfinite_gradients"]
        assert events and sum(e["batches"] for e in events) in (1, 2), h.events  # rows 3 and 4: one or two batches
        assert all(np.isfinite(w).all() for w in app.model.get_weights())
        with pytest.raises(NonFiniteUpdate, match="non-finite gradients"):
            app.train(
                epochs=1,
                batch_size=16,
                verbose=0,
                strategy=ddlf.GradientAveraging(),
                run=ddlf.RunConfig(seed=0, nonfinite="raise"),
            )
        assert c.ping()


class AdamApp(Linear):
    optimizer = "adam"
    learning_rate = 1e-2


@pytest.mark.slow
def test_a_worker_added_mid_training_adopts_the_optimizer_state() -> None:
    """Adam's moments and step count differ on a new worker: unless it adopts the others' state, the same averaged
    gradients move its weights differently, and the replicas' bits part."""
    first, second, extra = pool_addresses(3, spare=True)
    c = ddlf.Cluster([first, second], token=POOL.token)
    try:

        def on_round_end(r: int, logs: dict) -> None:
            if r == 1:
                c.add_worker(extra)

        app = AdamApp(c)
        held = Replicas(c)
        h = app.train(
            epochs=2,
            batch_size=16,
            callbacks=[LambdaCallback(on_round_end=on_round_end), held],
            verbose=0,
            strategy=ddlf.GradientAveraging(check_in_every=3),
            run=ddlf.RunConfig(seed=3),
        )
        assert any(s.worker == 2 and s.samples > 0 for s in h.stats)
        assert len(held.held) == 3 and held.identical()
    finally:
        c.close()


@pytest.mark.slow
def test_a_worker_killed_mid_training_is_left_out() -> None:
    with pooled(3, spare=True) as c:
        victim = POOL.pid(2, spare=True)
        cb, when = _kill_at_round(victim, 2)
        app = AdamApp(c)
        held = Replicas(c)
        with pytest.warns(RuntimeWarning, match="worker 2 .* lost"):
            h = app.train(
                epochs=3,
                batch_size=16,
                callbacks=[cb, held],
                verbose=0,
                strategy=ddlf.GradientAveraging(check_in_every=2),
                run=ddlf.RunConfig(seed=3),
            )
        lost = [e for e in h.events if e["event"] == "lost"]
        assert [e["worker"] for e in lost] == [2]
        assert 0 <= lost[0]["time"] - when["t"] < 5.0  # the ring failed at once: no step waited on the dead worker
        # The kill lands 50 ms after round 2, in epoch 0 or (rounds of 2 batches are quick) a later one: the
        # lost worker's rows of that round are not retried (ddlf.training.synchronous), and the survivors cover
        # every epoch after it.
        assert lost[0]["epoch"] < 2
        for epoch in range(lost[0]["epoch"] + 1, 3):
            assert sum(s.samples for s in h.stats if s.epoch == epoch) == ROWS, epoch
        assert len(held.held) == 2 and held.identical()
        assert h.history["accuracy"][-1] > 0.85
