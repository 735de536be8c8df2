"""On JAX, an asynchronous chunk starts its round in the stepper's state, not in the model's variables
(``_JaxStepper.start``): it must train exactly as ``set_weights``, ``reset_metrics`` and ``begin`` do, round after
round, whatever changed on the worker in between."""

from __future__ import annotations

from .backend_script import run_on_backend

_COMPARE = r"""
import json
import numpy as np
import keras
from ddlf.frameworks.adapter import adapter_for
from ddlf.training.replica import steppers

class OwnStep(keras.Sequential):
    def train_step(self, state, data):  # a user's train_step (Keras's guide): its logs are not read as metrics
        logs, state = super().train_step(state, data)
        return {**logs, "own": 1.0}, state

class OwnReset(keras.Sequential):
    def reset_metrics(self):  # a user's reset_metrics: called every round
        super().reset_metrics()

KINDS = {"plain": keras.Sequential, "own_step": OwnStep, "own_reset": OwnReset}

def make(kind):
    keras.utils.set_random_seed(3)
    m = KINDS[kind]([
        keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.BatchNormalization(),
        keras.layers.Dropout(0.25), keras.layers.Dense(3),
    ])
    m.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
    return m

rng = np.random.default_rng(0)
x = rng.normal(size=(64, 6)).astype(np.float32)
y = rng.integers(0, 3, 64)

def between(model, rnd):
    # What may change on a worker between two chunks: the master's learning rate, an optimizer variable.
    if rnd == 2:
        adapter_for(model).set_learning_rate(0.003)
    if rnd == 3:
        model.optimizer.iterations.assign(100)

def start_weights(model, rnd):
    w = [np.asarray(a) for a in model.get_weights()]
    w = [a + np.float32(0.01 * (rnd + 1)) if a.dtype == np.float32 else a for a in w]  # the master's merge
    return [a.astype(np.float64) for a in w] if rnd == 4 else w  # float64: converted, as set_weights does

def aligned(a):
    # 64-byte aligned, as a received buffer may be: JAX on CPU would take such an array's memory as its own.
    buf = np.empty(a.nbytes + 64, np.uint8)
    off = (-buf.ctypes.data) % 64
    out = buf[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out

def rounds(through_keras, kind="plain"):
    model = make(kind)
    stepper = steppers.stepper_for(model)
    out, slow = [], 0
    keras_set = model.set_weights

    def counted(ws):
        nonlocal slow
        slow += 1
        keras_set(ws)

    model.set_weights = counted

    def begin_round(w):
        if through_keras:  # what a round did before stepper.start()
            model.set_weights(w)
            model.reset_metrics()
            stepper.begin()
        else:
            stepper.start(w)

    for rnd in range(6):
        between(model, rnd)
        begin_round(start_weights(model, rnd))
        for a in range(0, 64, 16):
            stepper.step(x[a:a + 16], y[a:a + 16])
        logs = stepper.end()
        weights = stepper.weights() if not through_keras else [np.asarray(a) for a in model.get_weights()]
        state = [np.asarray(v.numpy()).tolist() for v in model.optimizer.variables + model.metrics_variables]
        out.append({"logs": logs, "weights": [a.tolist() for a in weights], "state": state,
                    "variables": [np.asarray(v.numpy()).tolist() for v in model.weights]})
    # A chunk without a batch (fewer rows than workers): the weights it returns and writes are its start weights,
    # copied, even where the caller then reuses the buffer they came in.
    w = [aligned(a) for a in start_weights(model, 6)]
    begin_round(w)
    expected = [a.copy() for a in w]
    for a in w:
        a[...] = 99
    stepper.end()
    kept = all(np.array_equal(u, v) for u, v in zip(stepper.weights(), expected))
    kept = kept and all(np.array_equal(u, v) for u, v in zip(model.get_weights(), expected))
    try:
        stepper.start([np.zeros((5, 5), np.float32)] + start_weights(model, 0)[1:])
        wrong = "accepted"
    except ValueError as exc:
        wrong = str(exc)
    return out, slow, wrong, kept

reference, slow_reference, _, _ = rounds(True)
fast, slow_fast, wrong, kept = rounds(False)
own_reference, _, _, _ = rounds(True, "own_step")
own_fast, slow_own, _, _ = rounds(False, "own_step")
reset_reference, _, _, _ = rounds(True, "own_reset")
reset_fast, slow_reset, _, kept_reset = rounds(False, "own_reset")
print(json.dumps({"same": reference == fast, "slow": [slow_reference, slow_fast, slow_own, slow_reset],
                  "wrong": wrong, "differ": [k for r, f in zip(reference, fast) for k in r if r[k] != f[k]],
                  "kept": [kept, kept_reset],
                  "own_same": own_reference == own_fast, "own_logs": own_fast[-1]["logs"],
                  "reset_same": reset_reference == reset_fast, "iterations": fast[-1]["state"][0]}))
"""


def test_rounds_started_in_the_state_train_as_through_keras() -> None:
    result = run_on_backend("jax", _COMPARE)
    # Bit for bit, every round: logs, weights returned, the variables written back, optimizer and metric state.
    assert result["same"], result["differ"]
    # Through Keras: 7 rounds and the wrong shape. In the state: only the first round, then the wrong shape
    # (refused by Keras itself); a model with its own reset_metrics goes through Keras every round.
    assert result["slow"] == [8, 2, 2, 8], result
    # A round without a batch copies its start weights, in the state and through Keras (where set_weights alone
    # would keep the aligned buffer as the variables' memory).
    assert result["kept"] == [True, True], result
    # A model with its own train_step starts in the state too; its round's logs are the metrics' results, as
    # before (not the step's own logs, which add "own").
    assert result["own_same"], result
    assert set(result["own_logs"]) == {"loss", "accuracy"}, result
    assert result["reset_same"], result
    assert "shape" in result["wrong"], result["wrong"]
    assert result["iterations"] == 100 + 3 * 4, result["iterations"]  # rounds 3, 4, 5: the assigned counter was read
