"""Models with weights of every shape Keras makes train under every strategy: a learnable scalar (a custom layer's
``add_weight(shape=())``, a temperature) is a 0-d array end to end, never a 1-element one."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import ddlf


class Temperature(keras.layers.Layer):
    def build(self, input_shape):
        self.t = self.add_weight(shape=(), initializer="ones", name="t")

    def call(self, x):
        return x * self.t


class ScalarWeight(ddlf.IApp):
    dataset_key = "shapes-scalar-weight"

    def load_dataset(self):
        r = np.random.default_rng(0)
        x = r.standard_normal((512, 4)).astype(np.float32)
        return x, (x.sum(1) > 0).astype(np.float32)

    def create_model(self):
        m = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(1), Temperature(), keras.layers.Activation("sigmoid")]
        )
        m.compile(optimizer="adam", loss="binary_crossentropy")
        return m


STRATEGIES = {
    "through-master": ddlf.ModelAveraging(every=4),
    "ring": ddlf.ModelAveraging(every=4, exchange=ddlf.Ring()),
    "half-precision": ddlf.ModelAveraging(every=4, exchange=ddlf.ThroughMaster(compression="bfloat16")),
    "top-k": ddlf.ModelAveraging(every=4, exchange=ddlf.ThroughMaster(compression=ddlf.TopK(0.5))),
    "gradients": ddlf.GradientAveraging(),
    "async": ddlf.Asynchronous(chunk=4),
}


@pytest.mark.parametrize("strategy", list(STRATEGIES.values()), ids=list(STRATEGIES))
def test_a_scalar_weight_trains_under_every_strategy(cluster: ddlf.Cluster, strategy) -> None:
    app = ScalarWeight(cluster)
    h = app.train(epochs=2, batch_size=32, strategy=strategy, verbose=0)
    assert len(h.history["loss"]) == 2 and not [e for e in h.events if e["event"] == "reply_refused"], h.events
    t = app.model.get_weights()[2]
    assert np.asarray(t).shape == () and float(t) != 1.0  # still a scalar, and it learned


class HalfWeights(ScalarWeight):
    """Variables in float16 (a layer's dtype; not mixed precision, whose variables stay float32)."""

    dataset_key = "shapes-half-weights"

    def create_model(self):
        m = keras.Sequential(
            [
                keras.Input((4,)),
                keras.layers.Dense(8, activation="relu", dtype="float16"),
                keras.layers.Dense(1, activation="sigmoid", dtype="float32"),
            ]
        )
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="binary_crossentropy")
        return m


@pytest.mark.parametrize(
    "strategy",
    [STRATEGIES["through-master"], STRATEGIES["ring"], STRATEGIES["gradients"], STRATEGIES["async"]],
    ids=["through-master", "ring", "gradients", "async"],
)
def test_float16_variables_are_averaged_in_float32_and_stay_float16(cluster: ddlf.Cluster, strategy) -> None:
    app = HalfWeights(cluster)
    app.model = app.create_model()
    start = app.model.get_weights()
    assert start[0].dtype == np.float16
    h = app.train(epochs=2, batch_size=32, strategy=strategy, verbose=0)
    assert not [e for e in h.events if e["event"] == "reply_refused"], h.events
    got = app.model.get_weights()
    assert [w.dtype for w in got] == [w.dtype for w in start]
    assert not np.array_equal(got[0], start[0]) and np.isfinite(got[0].astype(np.float32)).all()


class RowCounter(keras.layers.Layer):
    """Counts the rows it trained on in an integer variable (not trainable, never averaged)."""

    def build(self, input_shape):
        self.rows = self.add_weight(shape=(), dtype="int32", initializer="zeros", trainable=False, name="rows")

    def call(self, x, training=False):
        if training:
            self.rows.assign_add(keras.ops.cast(keras.ops.shape(x)[0], "int32"))
        return x


class Counting(ScalarWeight):
    dataset_key = "shapes-scalar-weight"  # the same data: 512 rows

    def create_model(self):
        m = keras.Sequential([keras.Input((4,)), RowCounter(), keras.layers.Dense(1, activation="sigmoid")])
        m.compile(optimizer="adam", loss="binary_crossentropy")
        return m


@pytest.mark.parametrize("strategy", list(STRATEGIES.values()), ids=list(STRATEGIES))
def test_an_integer_counter_counts_every_workers_steps_as_fit_would(cluster: ddlf.Cluster, strategy) -> None:
    """Integer variables are not averaged: the master's counter is its start plus every worker's change, the
    count ``fit`` keeps in one process (2 epochs of 512 rows), under every strategy and compression; it stays int32."""
    app = Counting(cluster)
    h = app.train(epochs=2, batch_size=32, strategy=strategy, verbose=0)
    assert not [e for e in h.events if e["event"] == "reply_refused"], h.events
    (counter,) = [w for w in app.model.get_weights() if w.dtype.kind == "i"]
    assert counter.dtype == np.int32 and int(counter) == 2 * 512
