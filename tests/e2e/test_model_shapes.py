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
