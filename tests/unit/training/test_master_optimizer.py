"""The master's optimizer taking and giving the workers' state (``ddlf.training.master_optimizer``), in one process:
the means of several workers' states, and the sharded (flat) form mapped to and from a Keras optimizer's
variables. End to end: ``tests/e2e/test_optimizer_state.py``."""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from ddlf.frameworks.shard_optimizers import KerasShard  # noqa: E402
from ddlf.training import master_optimizer  # noqa: E402


def _model(optimizer: str | keras.optimizers.Optimizer = "adam") -> keras.Model:
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input(shape=(4,)), keras.layers.Dense(3, activation="relu"), keras.layers.Dense(2)])
    m.compile(optimizer=optimizer, loss="mse")
    return m


def _stepped(optimizer: str | keras.optimizers.Optimizer = "adam", steps: int = 3) -> keras.Model:
    m = _model(optimizer)
    rng = np.random.default_rng(0)
    for _ in range(steps):
        m.train_on_batch(rng.standard_normal((8, 4)).astype(np.float32), rng.standard_normal((8, 2)).astype(np.float32))
    return m


def test_the_mean_keeps_each_dtype_and_rounds_step_counts() -> None:
    ints = [np.array(3, np.int64), np.array(4, np.int64), np.array(4, np.int64)]
    assert master_optimizer._mean(ints).dtype == np.int64 and int(master_optimizer._mean(ints)) == 4
    floats = [np.array([1.0, 2.0], np.float32), np.array([2.0, 4.0], np.float32)]
    got = master_optimizer._mean(floats)
    assert got.dtype == np.float32 and got.tolist() == [1.5, 3.0]
    one = [np.array([7.0], np.float32)]
    assert master_optimizer._mean(one) is one[0]


def test_an_unbuilt_optimizer_takes_the_mean_but_keeps_its_own_learning_rate() -> None:
    a, b = _stepped(steps=2), _stepped(steps=4)
    states = [[np.asarray(v.numpy()) for v in m.optimizer.variables] for m in (a, b)]
    states[1][1] = np.array(0.5, np.float32)  # a worker whose rate was scaled: not the master's
    master = _model()
    assert not master.optimizer.built
    assert master_optimizer.set_mean(master, states)
    got = {v.name: np.asarray(v.numpy()) for v in master.optimizer.variables}
    assert int(got["iteration"]) == 3 and float(got["learning_rate"]) == pytest.approx(0.001)
    for i, v in enumerate(master.optimizer.variables[2:], start=2):
        np.testing.assert_allclose(v.numpy(), (states[0][i] + states[1][i]) / 2, rtol=1e-6)


def test_a_state_that_does_not_fit_is_not_taken() -> None:
    master = _model()
    assert not master_optimizer.set_mean(master, [[np.zeros(3, np.float32)]])
    assert int(master.optimizer.iterations.numpy()) == 0


@pytest.mark.parametrize("name", ["adam", "sgd_momentum", "nadam", "rmsprop"])
def test_the_flat_state_steps_as_the_whole_optimizer_does(name: str) -> None:
    """The sharded form read off a stepped optimizer, loaded into the shard optimizer (the model's optimizer on
    one flat variable, as a sharded run steps), takes the very step the whole optimizer takes; and put back into
    a fresh model's optimizer, it is the state it was read from."""
    make = {
        "adam": lambda: keras.optimizers.Adam(0.01),
        "sgd_momentum": lambda: keras.optimizers.SGD(0.01, momentum=0.9),
        "nadam": lambda: keras.optimizers.Nadam(0.01),
        "rmsprop": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5),
    }[name]
    a = _stepped(make())
    whole = master_optimizer.whole_state(a)
    assert whole is not None and whole["start"] == 0
    weights = [np.asarray(w.numpy()) for w in a.trainable_weights]
    assert whole["length"] == sum(w.size for w in weights)

    b = _model(make())
    b.optimizer.build(b.trainable_variables)
    assert master_optimizer.set_whole(b, whole)
    for x, y in zip(a.optimizer.variables, b.optimizer.variables):
        np.testing.assert_array_equal(x.numpy(), y.numpy())

    grads = [np.random.default_rng(i).standard_normal(w.shape).astype(np.float32) for i, w in enumerate(weights)]
    shard = KerasShard(a)
    shard.build(whole["length"])
    shard.load(whole["slots"], whole["scalars"])
    shard.write(np.concatenate([w.ravel() for w in weights]))
    flat = np.asarray(shard.step(np.concatenate([g.ravel() for g in grads])))
    a.optimizer.apply(grads, a.trainable_variables)
    want = np.concatenate([np.asarray(w.numpy()).ravel() for w in a.trainable_weights])
    np.testing.assert_allclose(flat, want, rtol=1e-6, atol=1e-7)
