"""On TensorFlow, model averaging's rounds step small batches several to a compiled call
(ddlf.training.replica.steppers._Grouped): the same steps, in the same order, as one call each."""

from __future__ import annotations

import numpy as np
import pytest

from ddlf.training.replica import steppers as gradients
from ddlf.training.replica.steppers import _Grouped

from .backend_script import run_on_backend


class Recorder:
    """Stands in for a framework: records every batch stepped, one call or several."""

    def __init__(self) -> None:
        self.steps: list[tuple[np.ndarray, np.ndarray]] = []
        self.calls: list[str] = []
        self.stacks: list[np.ndarray] = []

    def one(self, x: object, y: object, sw: object = None) -> None:
        self.calls.append("one" if sw is None else "weighted")
        self.steps.append((np.array(x), np.array(y)))

    def many(self, xs: np.ndarray, ys: np.ndarray, n: int) -> None:
        self.calls.append(f"many{n}")
        self.stacks.append(xs)
        self.steps.extend((xs[i].copy(), ys[i].copy()) for i in range(n))


def _batches(sizes: list[int], width: int = 3) -> list[tuple[np.ndarray, np.ndarray]]:
    out, start = [], 0
    for size in sizes:
        x = np.arange(start * width, (start + size) * width, dtype=np.float32).reshape(size, width)
        out.append((x, np.arange(start, start + size, dtype=np.int64)))
        start += size
    return out


def _same(a: list[tuple[np.ndarray, np.ndarray]], b: list[tuple[np.ndarray, np.ndarray]]) -> bool:
    return len(a) == len(b) and all(
        np.array_equal(x1, x2) and np.array_equal(y1, y2) and x1.shape == x2.shape for (x1, y1), (x2, y2) in zip(a, b)
    )


def test_full_stacks_then_the_rest_at_flush_in_order() -> None:
    rec = Recorder()
    grouped = _Grouped(rec.one, rec.many)
    batches = _batches([4] * (2 * gradients.GROUP_STEPS + 3))
    for x, y in batches:
        grouped.add(x, y)
    assert rec.calls == [f"many{gradients.GROUP_STEPS}"] * 2
    grouped.flush()
    grouped.flush()  # nothing left: no call
    assert rec.calls == [f"many{gradients.GROUP_STEPS}"] * 2 + ["many3"]
    assert _same(rec.steps, batches)


def test_a_batch_of_another_shape_or_dtype_closes_the_stack() -> None:
    rec = Recorder()
    grouped = _Grouped(rec.one, rec.many)
    batches = _batches([4, 4, 4, 2])  # an epoch's last batch is smaller
    x64 = batches[0][0].astype(np.float64)
    batches.append((x64, batches[0][1]))
    for x, y in batches:
        grouped.add(x, y)
    grouped.flush()
    assert rec.calls == ["many3", "many1", "many1"]
    assert _same(rec.steps, batches)
    assert rec.stacks[-1].dtype == np.float64


def test_tensors_and_large_batches_step_one_call_each_after_what_was_gathered() -> None:
    rec = Recorder()
    grouped = _Grouped(rec.one, rec.many)
    small = _batches([2, 2])
    grouped.add(*small[0])
    grouped.add([[1.0, 2.0, 3.0]], small[1][1])  # not a numpy array (a framework tensor, a list): alone
    big = np.zeros((gradients.GROUP_BYTES // 4 + 1,), np.float32)  # a stack of two would pass GROUP_BYTES
    grouped.add(big, np.zeros(1, np.int64))
    grouped.add(*small[1])
    grouped.flush()
    assert rec.calls == ["many1", "one", "one", "many1"]
    assert np.array_equal(rec.steps[0][0], small[0][0]) and np.array_equal(rec.steps[3][0], small[1][0])


def test_each_stack_is_a_new_array() -> None:
    """The framework may keep a reference to a stack after the call returns (TensorFlow can alias numpy memory)."""
    rec = Recorder()
    grouped = _Grouped(rec.one, rec.many)
    for x, y in _batches([1] * (3 * gradients.GROUP_STEPS)):
        grouped.add(x, y)
    assert len(rec.stacks) == 3
    assert len({id(s) for s in rec.stacks}) == 3
    assert [float(s[0, 0, 0]) for s in rec.stacks] == [0.0, 3.0 * gradients.GROUP_STEPS, 6.0 * gradients.GROUP_STEPS]


_COMPARE = r"""
import json
import numpy as np
import keras
from ddlf.training.replica import steppers as gradients

def make():
    keras.utils.set_random_seed(1)
    m = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
    m.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
    return m

rng = np.random.default_rng(0)
x = rng.normal(size=(150, 6)).astype(np.float32)
y = rng.integers(0, 3, 150)
sizes = [4] * 35 + [10]  # two full stacks, a partial one, and a last batch of another shape
bounds = list(zip(np.cumsum([0] + sizes)[:-1], np.cumsum(sizes)))

def rounds(group_steps):
    gradients.GROUP_STEPS = group_steps  # 1: every batch one call, as before grouping
    model = make()
    stepper = gradients.stepper_for(model)
    for rnd in range(2):  # two rounds: the stepper is reused, as a worker's is
        stepper.begin()
        for a, b in bounds:
            if (rnd == 0) == (a < 70):
                stepper.step(x[a:b], y[a:b])
        logs = stepper.end()
    return model, logs

reference = make()
for a, b in bounds:
    reference.train_on_batch(x[a:b], y[a:b])
one_each, one_each_logs = rounds(1)
grouped, grouped_logs = rounds(16)

def diff(m):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(reference.get_weights(), m.get_weights()))

print(json.dumps({"one_each": diff(one_each), "grouped": diff(grouped),
                  "logs": [one_each_logs["loss"], grouped_logs["loss"]],
                  "iterations": int(np.asarray(grouped.optimizer.iterations))}))
"""


def test_grouped_rounds_train_as_one_call_per_batch_on_tensorflow() -> None:
    result = run_on_backend("tensorflow", _COMPARE)
    assert result["iterations"] == 36
    assert result["one_each"] < 1e-5, result  # the stepper trains as train_on_batch
    assert result["grouped"] < 1e-5, result  # and so it does with its steps grouped
    assert result["logs"][1] == pytest.approx(result["logs"][0], rel=1e-5)


def test_weighted_and_named_input_batches_step_alone_in_order() -> None:
    """A batch with sample weights, or whose x is a dict of named inputs, cannot join a stack: it steps alone,
    after what was gathered, with its weights."""
    rec = Recorder()
    grouped = _Grouped(rec.one, rec.many)
    small = _batches([2, 2, 2])
    grouped.add(*small[0])
    grouped.add(*small[1], np.ones(2, np.float32))
    grouped.add({"a": small[2][0]}, small[2][1])
    grouped.flush()
    assert rec.calls == ["many1", "weighted", "one"]
    assert [int(y[0]) for _, y in rec.steps] == [0, 2, 4]
