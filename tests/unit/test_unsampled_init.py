"""``initial_weights_unsampled``: a worker's replica on JAX is built without sampling the initial weights that the
master's overwrite (each shape's sampler is a compilation), and nothing else changes: the seed stream moves on as
it would have, a random tensor the model's own code draws is sampled, and outside the block Keras samples again."""

from __future__ import annotations

import pytest

from .backend_script import run_on_backend

_SCRIPT = r"""
import json
import keras
import numpy as np
from ddlf.frameworks.keras_backend import initial_weights_unsampled


def build():
    gen = keras.random.SeedGenerator(1)  # an initializer drawing its seeds from a generator moves it on
    init = keras.initializers.GlorotUniform(seed=gen)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2, kernel_initializer=init)])
    drawn = keras.random.normal((5,))  # the model's code drawing for itself, not an initializer
    return model, np.asarray(drawn), np.asarray(keras.random.uniform((3,), seed=gen))


keras.utils.set_random_seed(0)
sampled, drawn_sampled, gen_sampled = build()
after_sampled = np.asarray(keras.random.uniform((4,)))
keras.utils.set_random_seed(0)
with initial_weights_unsampled():
    unsampled, drawn_unsampled, gen_unsampled = build()
after_unsampled = np.asarray(keras.random.uniform((4,)))
again, _, _ = build()
with initial_weights_unsampled() as handle:
    model, _, _ = build()
    beside = keras.Variable(keras.initializers.GlorotUniform()((4, 4)))  # drawn by the app's code: sampled
    kept = keras.layers.Dense(3)  # a layer the app keeps beside the model: its kernel is not the model's
    kept.build((None, 4))
    import threading

    other = []
    thread = threading.Thread(target=lambda: other.append(build()[0]))  # another thread: sampled as usual
    thread.start()
    thread.join()
outside_before = float(np.abs(np.asarray(kept.kernel)).sum())
sampled_after = handle.sample_outside(model)
print(json.dumps({
    "kernels_sampled": [float(np.abs(w).sum()) for w in sampled.get_weights()[::2]],
    "kernels_unsampled": [float(np.abs(w).sum()) for w in unsampled.get_weights()],
    "own_draw_equal": bool(np.array_equal(drawn_sampled, drawn_unsampled)),
    "stream_equal": bool(np.array_equal(after_sampled, after_unsampled)),
    "generator_equal": bool(np.array_equal(gen_sampled, gen_unsampled)),
    "after_block_sampled": float(np.abs(again.get_weights()[0]).sum()),
    "beside_sampled": float(np.abs(np.asarray(beside)).sum()),
    "outside_before": outside_before,
    "outside_sampled_after": sampled_after,
    "outside_after": float(np.abs(np.asarray(kept.kernel)).sum()),
    "model_still_unsampled": float(np.abs(model.get_weights()[0]).sum()),
    "other_thread_sampled": float(np.abs(other[0].get_weights()[0]).sum()),
}))
"""


def test_a_replica_on_jax_is_built_without_sampling_its_initial_weights() -> None:
    got = run_on_backend("jax", _SCRIPT)
    assert all(total > 0 for total in got["kernels_sampled"])
    assert got["kernels_unsampled"] == [0.0, 0.0, 0.0, 0.0]  # kernels and biases: zeros, not sampled
    assert got["own_draw_equal"]  # what the model's code draws itself is sampled, from the same seed
    assert got["stream_equal"]  # the global seed stream moved on as sampling would have moved it
    assert got["generator_equal"]  # and so did an initializer's own seed generator
    assert got["after_block_sampled"] > 0  # Keras samples again after the block
    assert got["beside_sampled"] > 0  # a value the app's code draws itself, even of an initializer
    assert got["outside_before"] == 0 and got["outside_sampled_after"] == 1 and got["outside_after"] > 0
    assert got["model_still_unsampled"] == 0  # the model's own weights: the master's overwrite them
    assert got["other_thread_sampled"] > 0


def test_other_backends_sample_as_usual() -> None:
    keras = pytest.importorskip("keras")
    if keras.backend.backend() == "jax":
        pytest.skip("this process runs Keras on JAX")
    from ddlf.frameworks.keras_backend import initial_weights_unsampled

    with initial_weights_unsampled():
        layer = keras.layers.Dense(3)
        layer.build((None, 4))
    assert float(abs(keras.ops.convert_to_numpy(layer.kernel)).sum()) > 0
