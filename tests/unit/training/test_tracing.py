"""Each TensorFlow step of ddlf is traced once for batches of any size (``ddlf.training.replica.tracing``), as
``fit`` traces its step: the epoch's last, short batch runs the graph the full ones run, where a second trace
cost half a second of the first epoch (issue 37). In one process, no daemons."""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")
if keras.backend.backend() != "tensorflow":
    pytest.skip("traced steps are Keras on TensorFlow's", allow_module_level=True)

import tensorflow as tf  # noqa: E402

from ddlf.training.replica.steppers import stepper_for  # noqa: E402
from ddlf.training.replica.tracing import any_batch_size  # noqa: E402


def _model() -> keras.Model:
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input(shape=(6,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(3)])
    m.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m


def _rows(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 6)).astype(np.float32), rng.integers(0, 3, n)


def test_a_function_traced_for_any_batch_size_serves_full_and_short_batches() -> None:
    @tf.function(reduce_retracing=True, autograph=False)
    def total(x, y, sw):
        return tf.reduce_sum(x["a"]) + tf.cast(tf.reduce_sum(y), tf.float32)

    x, y = _rows(64)
    any_batch_size(tf, total, {"a": x}, y, None)
    assert float(total({"a": x}, y, None)) == pytest.approx(float(x.sum() + y.sum()), rel=1e-5)
    assert float(total({"a": x[:5]}, y[:5], None)) == pytest.approx(float(x[:5].sum() + y[:5].sum()), rel=1e-5)
    assert total.experimental_get_tracing_count() == 1


def test_a_function_that_needs_the_batch_size_is_traced_at_its_call_as_before() -> None:
    @tf.function(autograph=False)
    def fixed(x):
        if x.shape[0] is None:
            raise ValueError("this step needs a known batch size (a stateful RNN's)")
        return tf.reduce_sum(x)

    x, _ = _rows(8)
    any_batch_size(tf, fixed, x)  # no error: nothing traced yet
    assert fixed.experimental_get_tracing_count() == 0
    assert float(fixed(x)) == pytest.approx(float(x.sum()), rel=1e-5)


def test_grouped_steps_and_gradients_trace_once_across_a_short_last_batch() -> None:
    stepper = stepper_for(_model())
    x, y = _rows(70)
    for _round in range(2):  # two rounds of 16 full batches and a short one, as a worker steps them
        stepper.begin()
        for a in range(0, 70, 4):
            stepper.step(x[a : a + 4], y[a : a + 4])
        stepper.end()
    assert stepper._grouped_steps.experimental_get_tracing_count() == 1
    assert stepper._one_step.experimental_get_tracing_count() == 0  # every batch went through a stack
    for n in (8, 3, 8):
        grads = stepper.gradients(*_rows(n, seed=n))
        assert all(np.isfinite(g).all() for g in grads)
    assert stepper._gradients.experimental_get_tracing_count() == 1
