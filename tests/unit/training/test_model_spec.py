"""What the master's model carries to the workers' replicas beyond its weights (``ddlf.frameworks.model_spec``), and
the data checks at a run's setup, without daemons: two builds of one ``create_model`` stand in for the master's
model and a worker's."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import ddlf
from ddlf.data.structure import Parts, as_arrays
from ddlf.frameworks import model_spec, torch_spec
from ddlf.training.replica.dataset import check_model_data, first_batch


def _model(lr: float = 1e-3, frozen: bool = False) -> Any:
    import keras

    base = keras.layers.Dense(4, activation="relu", name="base")
    base.trainable = not frozen
    norm = keras.layers.Normalization()
    norm.adapt(np.arange(12, dtype=np.float32).reshape(4, 3))
    model = keras.Sequential([keras.Input((3,)), norm, base, keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(lr), loss="mse", metrics=["mae"])
    return model


def test_a_model_built_as_the_masters_takes_nothing() -> None:
    master, worker = _model(), _model()
    assert model_spec.apply(worker, model_spec.describe(master)) == []
    assert model_spec.differs(worker, model_spec.describe(master)) is None


def test_unfrozen_layers_and_a_recompile_reach_the_replica() -> None:
    import keras

    master, worker = _model(frozen=True), _model(frozen=True)
    master.get_layer("base").trainable = True
    master.compile(optimizer=keras.optimizers.SGD(1e-9, momentum=0.5), loss="mae", metrics=["mse"])
    changes = model_spec.apply(worker, model_spec.describe(master))
    assert changes[:2] == ["trainable", "compile"]  # (and the rate, where the rebuilt optimizer rounds it)
    assert worker.get_layer("base").trainable
    assert len(worker.trainable_weights) == len(master.trainable_weights) == 4
    assert isinstance(worker.optimizer, keras.optimizers.SGD)
    assert worker.optimizer.momentum == 0.5
    assert float(np.asarray(worker.optimizer.learning_rate)) == pytest.approx(1e-9)
    assert model_spec.compile_key(worker) == model_spec.compile_key(master)
    assert worker.get_compile_config()["loss"] == "mae"


def test_a_rate_and_a_hyperparameter_set_by_hand_reach_the_replica() -> None:
    master, worker = _model(), _model()
    master.optimizer.learning_rate = 0.25
    assert model_spec.apply(worker, model_spec.describe(master)) == ["learning_rate"]  # no recompile for a rate
    assert float(np.asarray(worker.optimizer.learning_rate)) == 0.25
    master.optimizer.beta_1 = 0.5  # a Python float of the traced step: a recompile carries it
    assert "compile" in model_spec.apply(worker, model_spec.describe(master))
    assert worker.optimizer.beta_1 == 0.5


def test_an_adapted_layer_reaches_the_replica_with_its_constants() -> None:
    master, worker = _model(), _model()
    master.layers[0].adapt(np.full((4, 3), 7.0, np.float32) + np.arange(4, dtype=np.float32)[:, None])
    assert model_spec.preprocessing_digest(master) != model_spec.preprocessing_digest(worker)
    changes = model_spec.apply(worker, model_spec.describe(master))
    assert changes == [f"preprocessing:{worker.layers[0].name}"]
    np.testing.assert_allclose(np.asarray(worker.layers[0].mean), np.asarray(master.layers[0].mean))
    x = np.ones((2, 3), np.float32)
    worker.set_weights(master.get_weights())
    np.testing.assert_allclose(worker.predict(x, verbose=0), master.predict(x, verbose=0), rtol=1e-6)
    assert model_spec.preprocessing_digest(master) == model_spec.preprocessing_digest(worker)


def test_run_eagerly_set_after_compile_reaches_the_replica() -> None:
    master, worker = _model(), _model()
    master.run_eagerly = True
    assert model_spec.apply(worker, model_spec.describe(master)) == ["run_eagerly"]
    assert worker.run_eagerly


def test_another_architecture_is_reported_and_another_layer_count_refused() -> None:
    import keras

    master = _model()
    other = keras.Sequential(
        [keras.Input((3,)), keras.layers.Normalization(), keras.layers.Dense(4, "tanh"), keras.layers.Dense(1)]
    )
    other.layers[0].adapt(np.arange(12, dtype=np.float32).reshape(4, 3))
    other.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse", metrics=["mae"])
    assert "another configuration" in (model_spec.differs(other, model_spec.describe(master)) or "")
    smaller = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    smaller.compile(optimizer="adam", loss="mse")
    differ = r"create_model\(\) built on this worker differ \(weight 0 is \(3,\) on the master"
    with pytest.raises(ddlf.ModelMismatchError, match=differ):
        model_spec.apply(smaller, model_spec.describe(master))


def test_the_masters_dtype_policy_is_the_one_create_model_runs_under() -> None:
    import keras

    spec = model_spec.ModelSpec(framework="keras", dtype_policy="mixed_float16")
    before = keras.config.dtype_policy().name
    with model_spec.building_as(spec):
        assert keras.config.dtype_policy().name == "mixed_float16"
        layer = keras.layers.Dense(2)
    assert layer.dtype_policy.name == "mixed_float16"
    assert keras.config.dtype_policy().name == before


def test_a_model_built_on_its_first_batch() -> None:
    import keras

    model = keras.Sequential([keras.layers.Dense(4), keras.layers.Dense(1)])
    assert model_spec.needs_build(model)
    model_spec.build_from(model, np.zeros((2, 5), np.float32))
    assert not model_spec.needs_build(model)
    assert [tuple(w.shape) for w in model.weights] == [(5, 4), (4,), (4, 1), (1,)]
    assert not model_spec.needs_build(_model())


def test_torch_groups_and_frozen_parameters_reach_the_replica() -> None:
    torch = pytest.importorskip("torch")
    from ddlf.models import TorchModel

    def build() -> Any:
        net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
        return TorchModel(net, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), torch.nn.MSELoss(), metrics=())

    master, worker = build(), build()
    assert model_spec.apply(worker, model_spec.describe(master)) == []
    master.optimizer.param_groups[0]["lr"] = 0.0
    master.optimizer.param_groups[0]["weight_decay"] = 0.01
    master.module[0].weight.requires_grad_(False)
    assert model_spec.apply(worker, model_spec.describe(master)) == ["requires_grad", "optimizer"]
    assert worker.optimizer.param_groups[0]["lr"] == 0.0
    assert worker.optimizer.param_groups[0]["weight_decay"] == 0.01
    assert not worker.module[0].weight.requires_grad
    other = TorchModel(torch.nn.Linear(3, 1), lambda p: torch.optim.Adam(p), torch.nn.MSELoss(), metrics=())
    with pytest.raises(
        ddlf.ModelMismatchError, match=r"module has 4 parameters, the one create_model\(\) built here 2"
    ):
        model_spec.apply(other, model_spec.describe(master))
    assert torch_spec.optimizer_groups(_model()) is None


def test_the_masters_own_torch_optimizer_and_loss_are_built_on_the_replica() -> None:
    """What the user replaced on the master's TorchModel: an optimizer of another class, or over a part of the
    module (fine-tuning its head), and the loss; a module printing otherwise is named."""
    torch = pytest.importorskip("torch")
    from ddlf.models import TorchModel

    def build(p: float = 0.0) -> Any:
        net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(p), torch.nn.Linear(4, 1))
        return TorchModel(net, lambda ps: torch.optim.Adam(ps, lr=0.1), torch.nn.MSELoss(), metrics=())

    master, worker = build(), build()
    master.optimizer = torch.optim.SGD(master.module[2].parameters(), lr=0.5, momentum=0.9)
    master.loss_fn = torch.nn.L1Loss()
    spec = model_spec.describe(master)
    assert model_spec.apply(worker, spec) == ["optimizer", "loss"]
    assert isinstance(worker.optimizer, torch.optim.SGD)
    assert [p for g in worker.optimizer.param_groups for p in g["params"]] == list(worker.module[2].parameters())
    assert worker.optimizer.param_groups[0]["lr"] == 0.5 and worker.optimizer.param_groups[0]["momentum"] == 0.9
    assert isinstance(worker.loss_fn, torch.nn.L1Loss)
    assert model_spec.apply(worker, spec) == []  # as the master's now
    assert model_spec.differs(worker, spec) is None
    assert "Dropout's p" in (model_spec.differs(build(0.5), spec) or "")

    class Odd(torch.optim.SGD):  # takes another first argument
        def __init__(self, module: Any) -> None:
            super().__init__(module.parameters(), lr=0.1)

    master.optimizer = Odd(master.module)
    with pytest.raises(ddlf.ModelMismatchError, match="could not build from its parameter groups"):
        model_spec.apply(build(), model_spec.describe(master))
    outside = torch.nn.Parameter(torch.zeros(1))  # a temperature, say: not the module's, not rebuilt elsewhere
    master.optimizer = torch.optim.Adam([*master.module[2].parameters(), outside])
    with pytest.raises(ddlf.ModelMismatchError, match="not all of its parameters are the module's"):
        model_spec.apply(build(), model_spec.describe(master))


def test_lists_and_pandas_become_arrays_and_structure_is_kept() -> None:
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    y = np.array([0, 1, 0, 1])
    converted = as_arrays((x.tolist(), y.tolist()))
    np.testing.assert_array_equal(converted[0], x)
    np.testing.assert_array_equal(converted[1], y)
    both = as_arrays({"x": [x, x], "y": y})  # two inputs stay two
    assert isinstance(both["x"], list) and len(both["x"]) == 2
    pd = pytest.importorskip("pandas")
    frame = as_arrays((pd.DataFrame(x, columns=["a", "b", "c"]), pd.Series(y)))
    np.testing.assert_array_equal(frame[0], x)
    assert isinstance(frame[1], np.ndarray)


def test_strings_for_the_model_are_refused_naming_the_part() -> None:
    parts = Parts.loaded(({"ids": np.zeros((3, 2), np.int32), "text": np.array(["a", "b", "c"])}, np.zeros(3)))
    x, y = first_batch(parts, lambda x, y: (x, y))
    with pytest.raises(ddlf.DatasetError, match=r"x\['text'\] as load_dataset returned holds strings \(dtype <U1\)"):
        check_model_data(x, y, preprocessed=False)
    # strings a preprocess() turns into numbers are fine
    x, y = first_batch(parts, lambda x, y: (x["ids"], y))
    check_model_data(x, y, preprocessed=True)
    assert first_batch(Parts.loaded((np.zeros((0, 2)), np.zeros(0))), lambda x, y: (x, y)) == (None, None)
