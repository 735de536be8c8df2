"""The sharded optimizer's pure parts, without daemons: which optimizers can be sharded, a step on a ring of one
(the whole model's shard) against the model's own optimizer, the master joining shards for a checkpoint, and the
checkpoint's refusal of the other setting."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ddlf.frameworks.shard_optimizers import KerasShard
from ddlf.training import checkpoint
from ddlf.training.replica.sharded import Held, ShardedOptimizer, check_shardable, join, redistribute

from ..backend_script import run_on_backend


class OneRank:
    """A ring of one: every collective leaves the data as it is."""

    def shard(self, length: int) -> tuple[int, int]:
        return 0, length

    def reduce_scatter_(self, array: np.ndarray, op: str = "mean", wire: Any = None) -> tuple[int, int]:
        return 0, len(array)

    def allgather_(self, array: np.ndarray, wire: Any = None) -> None:
        pass

    def allreduce_(self, arrays: list[np.ndarray], op: str = "mean", atomic: bool = True, wire: Any = None) -> None:
        pass


def _model(optimizer: Any) -> Any:
    import keras

    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer, loss="mse")
    return model


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW", "RMSprop", "Lion"])
def test_three_steps_on_a_ring_of_one_are_the_optimizers_own_steps(name: str) -> None:
    import keras

    make = getattr(keras.optimizers, name)
    kwargs = {"momentum": 0.9} if name == "SGD" else {}
    sharded_model = _model(make(0.01, **kwargs))
    own = _model(make(0.01, **kwargs))
    start = [v.numpy() for v in sharded_model.trainable_weights]
    shard = ShardedOptimizer(sharded_model)
    shard.begin(OneRank(), "fresh", False, None, start)
    rng = np.random.default_rng(0)
    for _ in range(3):
        grads = [rng.standard_normal(w.shape).astype(np.float32) for w in start]
        assert shard.step(grads, 1.0, OneRank(), None) == "step"
        own.optimizer.apply([keras.ops.convert_to_tensor(g) for g in grads], own.trainable_weights)
    for view, w in zip(shard.weight_views, own.trainable_weights):
        np.testing.assert_allclose(view, w.numpy(), rtol=1e-6, atol=1e-7)
    assert not sharded_model.optimizer.built  # the model's own optimizer holds no state
    assert int(np.asarray(shard.local.optimizer.iterations.numpy())) == 3
    # A batch that no rank had takes no step.
    assert shard.step(None, 0.0, OneRank(), None) == "none"


def test_what_a_rank_holds_survives_being_redistributed_over_a_ring_of_one() -> None:
    model = _model("adam")
    start = [v.numpy() for v in model.trainable_weights]
    shard = ShardedOptimizer(model)
    shard.begin(OneRank(), "fresh", False, None, start)
    shard.step([np.ones(w.shape, np.float32) for w in start], 1.0, OneRank(), None)
    held = shard.held()
    assert held is not None and held.start == 0 and held.stop == shard.length == 5 * 4 + 4 + 4 + 1
    slots, scalars, missing = redistribute(held, shard.length, (2, len(held.scalars)), (0, shard.length), OneRank())
    assert missing == 0 and scalars is not None
    assert all(np.array_equal(a, b) for a, b in zip(slots, held.slots))
    # Nothing held anywhere (a torch optimizer before its first step): zeros, no step count, and nothing counted
    # as lost with a worker.
    slots, scalars, missing = redistribute(None, shard.length, (2, 2), (0, shard.length), OneRank())
    assert scalars is None and missing == 0 and not any(s.any() for s in slots)
    # Held, but part of the weights not covered (a lost worker's shard): those elements are counted.
    part = Held(held.length, 0, [s[:10] for s in held.slots], held.scalars)
    slots, scalars, missing = redistribute(part, shard.length, (2, len(held.scalars)), (0, shard.length), OneRank())
    assert missing == shard.length - 10 and scalars is not None
    assert np.array_equal(slots[0][:10], held.slots[0][:10]) and not slots[0][10:].any()
    # An optimizer with no per-weight state (SGD without momentum) loses nothing with a worker.
    _, _, missing = redistribute(Held(held.length, 0, [], held.scalars[:1]), shard.length, (0, 1), (0, 29), OneRank())
    assert missing == 0


def test_the_master_joins_shards_and_counts_what_none_covered() -> None:
    parts = [
        Held(10, 0, [np.arange(4, dtype=np.float32)], [np.array(7)]).to_dict(),
        Held(10, 4, [np.arange(4, 7, dtype=np.float32)], [np.array(7)]).to_dict(),
    ]
    whole = join(parts)
    assert whole is not None and whole["missing"] == 3 and whole["start"] == 0
    np.testing.assert_array_equal(whole["slots"][0], [0, 1, 2, 3, 4, 5, 6, 0, 0, 0])
    assert int(whole["scalars"][0]) == 7
    with pytest.raises(ValueError, match="different models"):
        join([*parts, Held(11, 0, [np.zeros(11, np.float32)], [np.array(7)]).to_dict()])


def _optimizer(kind: str) -> Any:
    import keras

    return {
        "clipnorm": lambda: keras.optimizers.Adam(clipnorm=1.0),
        "ema": lambda: keras.optimizers.Adam(use_ema=True),
        "accumulation": lambda: keras.optimizers.Adam(gradient_accumulation_steps=2),
        "lamb": lambda: keras.optimizers.Lamb(),
    }[kind]()


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("clipnorm", "clipnorm=1.0"),
        ("ema", "use_ema"),
        ("accumulation", "gradient_accumulation_steps"),
        ("lamb", "Lamb is not one whose state"),
    ],
)
def test_optimizers_whose_state_cannot_be_cut_are_refused_with_the_reason(kind: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        check_shardable(_model(_optimizer(kind)))


def test_weight_decay_for_some_weights_only_is_refused_and_for_all_is_kept() -> None:
    import keras

    check_shardable(_model(keras.optimizers.AdamW(weight_decay=0.1)))
    opt = keras.optimizers.AdamW(weight_decay=0.1)
    opt.exclude_from_weight_decay(var_names=["bias"])
    with pytest.raises(ValueError, match="decays some weights and not others"):
        check_shardable(_model(opt))


def test_a_checkpoint_is_resumed_only_with_the_sharding_that_wrote_it() -> None:
    sharded = {"strategy": "GradientAveraging", "worker_states": {0: {"optimizer_shard": {"length": 3}}}}
    whole = {"strategy": "GradientAveraging", "worker_states": {0: {"optimizer": [np.zeros(3)]}}}
    checkpoint.check_resumable(sharded, True, sharded=True)
    checkpoint.check_resumable(whole, True, sharded=False)
    with pytest.raises(ValueError, match="holds sharded optimizer state; resuming it without"):
        checkpoint.check_resumable(sharded, True, sharded=False)
    with pytest.raises(ValueError, match="holds whole optimizer state; resuming it with"):
        checkpoint.check_resumable(whole, True, sharded=True)


@pytest.mark.parametrize("optimizer", ["adam", "sgd", "rmsprop"])
def test_the_optimizer_state_bytes_a_round_reports_are_those_of_its_arrays(optimizer: str) -> None:
    """A gradient-averaging round reports the optimizer state a worker holds: read off the optimizer's variables
    (no copy of the state each round), the same count as the arrays themselves (counters included)."""
    from ddlf.training.replica.state import optimizer_state, optimizer_state_bytes

    model = _model(optimizer)
    model.optimizer.build(model.trainable_weights)
    arrays = optimizer_state(model)
    assert optimizer_state_bytes(model) == sum(a.nbytes for a in arrays) > 0


def test_a_torch_models_optimizer_state_bytes_are_those_of_its_arrays() -> None:
    torch = pytest.importorskip("torch")
    from ddlf.models import TorchModel
    from ddlf.training.replica.state import optimizer_state, optimizer_state_bytes
    from ddlf.training.replica.steppers import stepper_for

    model = TorchModel(torch.nn.Linear(5, 3), lambda p: torch.optim.Adam(p, lr=1e-3), torch.nn.MSELoss())
    assert optimizer_state_bytes(model) == 0 == len(optimizer_state(model))  # no state before the first step
    stepper_for(model).build_optimizer()
    assert optimizer_state_bytes(model) == sum(a.nbytes for a in optimizer_state(model)) > 0


_ON_JAX = """
import json
import numpy as np, keras
from ddlf.training.replica.graph_buckets import aligned  # starts on 64 bytes: where JAX keeps an array's memory
from ddlf.frameworks.shard_optimizers import KerasShard
from ddlf.training.replica.steppers import stepper_for

# The canary: does this JAX keep an assigned aligned array's memory? (If not, the copies guard nothing here.)
canary, probe = keras.Variable(np.zeros(1024, np.float32)), aligned((1024,))
canary.assign(probe)
probe[:] = 3.0
aliases = bool(np.asarray(canary.numpy())[0] == 3.0)

model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4)])
model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
shard = KerasShard(model)
shard.build(1024)
buffer = aligned((1024,))
buffer[:] = 1.0
shard.write(buffer)
buffer[:] = 7.0  # the next step's gradients go where the weights were
shard_kept = bool(np.all(np.asarray(shard.variable.numpy()) == 1.0))

stepper = stepper_for(model)
sizes = [int(np.prod(w.shape)) for w in model.trainable_weights]
flat = aligned((sum(sizes) + 16 * len(sizes),))
views, at = [], 0
for w, n in zip(model.trainable_weights, sizes):
    views.append(flat[at : at + n].reshape(w.shape))
    at += n + (-n % 16)  # each view on 64 bytes
flat[:] = 2.0
stepper.set_trainable(views)
flat[:] = 9.0
model_kept = all(bool(np.all(np.asarray(w.numpy()) == 2.0)) for w in model.trainable_weights)

# The shard's compiled step against the optimizer's own eager step, the rate changed after the first (as a
# warm-up or a callback changes the model's optimizer's).
own = keras.optimizers.Adam.from_config(model.optimizer.get_config())
weights = keras.Variable(np.ones(1024, np.float32))
own.build([weights])
rng = np.random.default_rng(0)
errors = []
for i in range(3):
    if i == 1:
        model.optimizer.learning_rate = 0.05
        own.learning_rate = 0.05
    grad = rng.standard_normal(1024).astype(np.float32)
    got = shard.step(grad)
    own.apply([keras.ops.convert_to_tensor(grad)], [weights])
    want = np.asarray(weights.numpy())
    errors.append(float(np.max(np.abs(got - want) / (np.abs(want) + 1e-6))))
print(json.dumps({
    "aliases": aliases, "shard_kept": shard_kept, "model_kept": model_kept, "compiled": shard._apply is not None,
    "errors": errors, "iterations": int(np.asarray(shard.optimizer.iterations.numpy())),
    "moved": float(np.max(np.abs(np.asarray(shard.variable.numpy()) - 1.0))),
}))
"""


@pytest.fixture(scope="module")
def on_jax() -> dict[str, Any]:
    """What :data:`_ON_JAX` found in a process on Keras's JAX backend."""
    return run_on_backend("jax", _ON_JAX)


def test_on_jax_weights_written_from_a_reused_buffer_do_not_follow_it(on_jax: dict[str, Any]) -> None:
    """Keras on JAX keeps a 64-byte aligned numpy array's memory as a variable's value: the shard's weights and the
    weights the all-gather writes into the model are views of buffers the next step overwrites, so both are
    copied."""
    if not on_jax["aliases"]:
        pytest.skip("this JAX copies what a variable is assigned: no aliasing to guard against")
    assert on_jax["shard_kept"], "the shard's weights changed with the caller's buffer"
    assert on_jax["model_kept"], "the model's weights changed with the caller's buffer"


def test_on_jax_the_shard_step_is_compiled_and_takes_the_optimizers_steps(on_jax: dict[str, Any]) -> None:
    assert on_jax["compiled"]
    assert on_jax["iterations"] == 3
    assert on_jax["moved"] > 0.05  # the steps did something (3 steps of Adam at 0.01, then 0.05)
    assert max(on_jax["errors"]) < 1e-5, on_jax["errors"]  # float32 rounding of the eager step, the rate followed


def test_on_tensorflow_the_shard_step_is_one_graph_and_the_optimizers_own_steps() -> None:
    import keras

    if keras.backend.backend() != "tensorflow":
        pytest.skip("the unit tests run on TensorFlow")
    model = _model(keras.optimizers.Adam(0.01))
    shard = KerasShard(model)
    shard.build(1024)
    assert shard._apply is not None
    shard.write(np.ones(1024, np.float32))
    own = keras.optimizers.Adam.from_config(model.optimizer.get_config())
    weights = keras.Variable(np.ones(1024, np.float32))
    own.build([weights])
    rng = np.random.default_rng(0)
    for i in range(3):
        if i == 1:  # a warm-up or a callback changes the model's optimizer's rate: the graph reads it
            model.optimizer.learning_rate = 0.05
            own.learning_rate = 0.05
        grad = rng.standard_normal(1024).astype(np.float32)
        got = shard.step(grad)
        own.apply([keras.ops.convert_to_tensor(grad)], [weights])
        np.testing.assert_array_equal(got, weights.numpy())  # the same kernels as the eager step
    assert float(np.max(np.abs(got - 1.0))) > 0.05
    # A model that runs eagerly (run_eagerly=True) gets an eager shard step, as fit would.
    eager = _model(keras.optimizers.Adam(0.01))
    eager.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", run_eagerly=True)
    kept = KerasShard(eager)
    kept.build(16)
    assert kept._apply is None
