"""``fit``'s arguments and data shapes in ``app.train``, with ``fit``'s meanings: named inputs and outputs (dicts,
lists), pandas frames, ``sample_weight`` (from the loader, an array, a function of the batch), ``class_weight``,
``validation_split``/``validation_freq``, ``shuffle=False``, and ``app.evaluate()``/``app.predict()`` over the
workers' data. Exactness is checked the strict way: one worker, gradient averaging, rows in order, against
``model.fit`` from the same weights."""

from __future__ import annotations

import warnings
from typing import Any

import keras
import numpy as np
import pytest

import ddlf

ROWS = 192


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((ROWS, 6)).astype(np.float32)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.int64)
    return x, y


class Plain(ddlf.IApp):
    """A small classifier with plain SGD (nothing random per step: the strict comparisons hold exactly)."""

    dataset_key = "fit-args-plain"

    def load_dataset(self) -> Any:
        return _data()

    def create_model(self) -> Any:
        model = keras.Sequential(
            [keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2, activation="softmax")]
        )
        model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy", metrics=["accuracy"])
        return model


class LoaderWeights(Plain):
    """Sample weights as the loader's third part."""

    dataset_key = "fit-args-loader-weights"

    def load_dataset(self) -> Any:
        x, y = _data()
        return x, y, np.linspace(0.2, 2.0, ROWS).astype(np.float32)


def _row_weights(x: Any, y: Any) -> np.ndarray:
    return np.where(y == 1, 2.5, 0.5).astype(np.float32)


def _fit_reference(app: ddlf.IApp, start: list[np.ndarray], epochs: int, batch: int, **fit_kwargs: Any) -> Any:
    """``model.fit`` in this process from ``start``, rows in order."""
    loaded = app.load_dataset()
    x, y = loaded[0], loaded[1]
    if len(loaded) == 3:
        fit_kwargs["sample_weight"] = loaded[2]
    model = app.create_model()
    model.set_weights(start)
    history = model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0, **fit_kwargs)
    return model, history


EXACT_CASES = {
    "class_weight": (Plain, {"class_weight": {0: 0.3, 1: 2.0}}),
    "loader_sample_weight": (LoaderWeights, {}),
    "sample_weight_array": (Plain, {"sample_weight": np.linspace(1.5, 0.1, ROWS).astype(np.float32)}),
    "validation_split": (Plain, {"validation_split": 0.25}),
}


@pytest.mark.parametrize("case", list(EXACT_CASES))
def test_one_worker_in_order_matches_fit_exactly(cluster: ddlf.Cluster, case: str) -> None:
    """One worker averaging gradients with ``shuffle=False`` takes fit's steps: weights within float32 rounding
    of ``model.fit(shuffle=False)`` with the same argument, and the same logs (``val_*`` included)."""
    cls, kwargs = EXACT_CASES[case]
    app = cls(cluster)
    app.model = app.create_model()
    start = [np.array(w) for w in app.model.get_weights()]
    history = app.train(
        epochs=2,
        batch_size=16,
        shuffle=False,
        verbose=0,
        strategy=ddlf.GradientAveraging(),
        run=ddlf.RunConfig(workers=[0]),
        **kwargs,
    )
    reference, ref_history = _fit_reference(app, start, 2, 16, **kwargs)
    for got, want in zip(app.model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert sorted(history.history) == sorted(ref_history.history)
    for key, values in ref_history.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=1e-4, err_msg=key)


class OneRow(Plain):
    """One row for two workers: one of them has no batch at all."""

    dataset_key = "fit-args-one-row"

    def load_dataset(self) -> Any:
        x, y = _data()
        return x[:1], y[:1]


@pytest.mark.parametrize(
    "strategy",
    [ddlf.GradientAveraging(), ddlf.ModelAveraging(every=2), ddlf.Asynchronous(chunk=2)],
    ids=["gradients", "model", "async"],
)
def test_fewer_rows_than_workers_train_as_fit_trains_them(cluster: ddlf.Cluster, strategy: Any) -> None:
    """A worker whose share is no row trains nothing (its metrics were never built: no logs from it) and the run
    reports what the other's batch gave; with gradient averaging the one step is fit's own."""
    app = OneRow(cluster)
    app.model = app.create_model()
    start = app.model.get_weights()
    h = app.train(epochs=1, batch_size=32, verbose=0, strategy=strategy, shuffle=False)
    one = app.create_model()
    one.set_weights(start)
    x, y = app.load_dataset()
    want = one.fit(x, y, epochs=1, batch_size=32, shuffle=False, verbose=0)
    assert sorted(h.history) == sorted(want.history) and np.isfinite(h.history["loss"]).all()
    if isinstance(strategy, ddlf.GradientAveraging):
        assert h.history["loss"] == pytest.approx(want.history["loss"], rel=1e-5)
        for a, b in zip(app.model.get_weights(), one.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert cluster.run(lambda: "serving") == ["serving", "serving"]


class Empty(Plain):
    dataset_key = "fit-args-empty"

    def load_dataset(self) -> Any:
        x, y = _data()
        return x[:0], y[:0]


class RaggedRows(Plain):
    dataset_key = "fit-arguments-ragged"

    def load_dataset(self) -> Any:
        x, y = _data()
        return x[:100], y[:90]


class NotAModel(Plain):
    def create_model(self) -> Any:
        return "a model"


def test_no_rows_and_no_model_are_refused_clearly_and_batch_size_none_is_32(
    cluster: ddlf.Cluster,
) -> None:
    from ddlf.training import replica

    with pytest.raises(ddlf.DatasetError, match=r"Empty\.load_dataset returned no rows"):
        Empty(cluster).train(epochs=1, verbose=0, strategy=ddlf.ModelAveraging())
    assert cluster.run(replica.runs) == [[], []]  # the refused run does not stay on the workers
    # Refused by the workers at set-up: ddlf.DatasetError as documented (it came as a bare RemoteError).
    with pytest.raises(ddlf.DatasetError, match="different numbers of rows"):
        RaggedRows(cluster).train(epochs=1, verbose=0, strategy=ddlf.ModelAveraging())
    assert cluster.run(replica.runs) == [[], []]
    with pytest.raises(TypeError, match=r"create_model\(\) must return a compiled Keras model .* not str"):
        NotAModel(cluster).train(epochs=1, verbose=0)
    h = Plain(cluster).train(epochs=1, batch_size=None, verbose=0, strategy=ddlf.ModelAveraging())
    assert h.params["batch_size"] == 32
    assert cluster.run(lambda: "serving") == ["serving", "serving"]


def test_a_sample_weight_function_weighs_each_batch_as_the_same_array_would(cluster: ddlf.Cluster) -> None:
    """``sample_weight=f`` (run on the workers, on each raw batch) trains as fit with ``f``'s weights as an array."""
    app = Plain(cluster)
    app.model = app.create_model()
    start = [np.array(w) for w in app.model.get_weights()]
    app.train(
        epochs=1,
        batch_size=16,
        shuffle=False,
        verbose=0,
        sample_weight=_row_weights,
        strategy=ddlf.GradientAveraging(),
        run=ddlf.RunConfig(workers=[0]),
    )
    x, y = _data()
    reference, _ = _fit_reference(app, start, 1, 16, sample_weight=_row_weights(x, y))
    for got, want in zip(app.model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


class NamedInputsOutputs(ddlf.IApp):
    """A functional model with two named inputs and two named outputs (per-output losses, weights, metrics),
    its dataset dicts of arrays."""

    dataset_key = "fit-args-named"

    def load_dataset(self) -> Any:
        rng = np.random.default_rng(5)
        image = rng.standard_normal((ROWS, 4, 4, 1)).astype(np.float32)
        meta = rng.standard_normal((ROWS, 3)).astype(np.float32)
        label = (image.mean(axis=(1, 2, 3)) + meta[:, 0] > 0).astype(np.int64)
        score = (meta.sum(axis=1, keepdims=True)).astype(np.float32)
        return {"image": image, "meta": meta}, {"label": label, "score": score}

    def create_model(self) -> Any:
        image, meta = keras.Input((4, 4, 1), name="image"), keras.Input((3,), name="meta")
        h = keras.layers.Concatenate()([keras.layers.Flatten()(image), meta])
        h = keras.layers.Dense(16, activation="relu")(h)
        outputs = {
            "label": keras.layers.Dense(2, activation="softmax", name="label")(h),
            "score": keras.layers.Dense(1, name="score")(h),
        }
        model = keras.Model({"image": image, "meta": meta}, outputs)
        model.compile(
            keras.optimizers.Adam(0.01),
            loss={"label": "sparse_categorical_crossentropy", "score": "mse"},
            loss_weights={"label": 1.0, "score": 0.5},
            metrics={"label": ["accuracy"]},
        )
        return model


@pytest.mark.parametrize(
    "strategy",
    [ddlf.ModelAveraging(every=2), ddlf.GradientAveraging(), ddlf.Asynchronous(chunk=2)],
    ids=["model-averaging", "gradient-averaging", "async"],
)
def test_named_inputs_and_outputs_train_and_validate_on_the_workers(cluster: ddlf.Cluster, strategy: Any) -> None:
    """Dicts of named arrays reach the model as fit gives them, under every strategy; ``validation_split`` gives
    the per-output ``val_*`` logs, and they are what the master's model gets from ``evaluate`` on the held-out rows
    (the workers' metric states added up); ``app.evaluate()`` and ``app.predict()`` cover every row."""
    app = NamedInputsOutputs(cluster)
    history = app.train(epochs=3, batch_size=16, validation_split=0.25, verbose=0, strategy=strategy)
    logs = history.history
    for key in ("loss", "label_loss", "score_loss", "label_accuracy", "val_loss", "val_label_accuracy"):
        assert len(logs[key]) == 3, key
    assert logs["loss"][-1] < logs["loss"][0]
    x, y = app.load_dataset()
    held_out = {k: v[144:] for k, v in x.items()}, {k: v[144:] for k, v in y.items()}
    want = app.model.evaluate(*held_out, batch_size=16, verbose=0, return_dict=True)
    for key, value in want.items():
        assert logs[f"val_{key}"][-1] == pytest.approx(value, rel=1e-4), key
    everything = app.evaluate(return_dict=True)
    local = app.model.evaluate(x, y, batch_size=256, verbose=0, return_dict=True)
    assert everything.keys() == local.keys()
    for key, value in local.items():
        assert everything[key] == pytest.approx(value, rel=1e-4), key
    predicted = app.predict()
    assert sorted(predicted) == ["label", "score"]
    # Keras arguments these whole-dataset passes do not take are refused, not dropped.
    with pytest.raises(ValueError, match="takes no steps"):
        app.evaluate(steps=2)
    with pytest.raises(ValueError, match="takes no steps"):
        app.predict(steps=2)
    np.testing.assert_allclose(predicted["label"], app.model.predict(x, verbose=0)["label"], rtol=1e-5, atol=1e-6)


def test_validation_freq_and_validation_data_as_in_fit(cluster: ddlf.Cluster) -> None:
    """``validation_freq=2`` validates after epochs 2 and 4 only; ``validation_data`` wins over
    ``validation_split`` (every row then trains), as in fit."""
    app = Plain(cluster)
    x, y = _data()
    history = app.train(epochs=4, batch_size=32, validation_split=0.5, validation_freq=2, verbose=0)
    assert len(history.history["loss"]) == 4 and len(history.history["val_loss"]) == 2
    assert history.params["samples"] == ROWS // 2
    history = app.train(epochs=1, batch_size=32, validation_split=0.5, validation_data=(x[:10], y[:10]), verbose=0)
    assert history.params["samples"] == ROWS
    want = app.model.evaluate(x[:10], y[:10], verbose=0, return_dict=True)
    assert history.history["val_loss"][-1] == pytest.approx(want["loss"], rel=1e-5)


def test_validation_freq_past_the_last_epoch_warns(cluster: ddlf.Cluster) -> None:
    """``validation_freq`` that names no epoch of the run trains without validating, as fit does, and says so
    (a ``ConfigWarning``, before any worker is asked); a run that reaches its epoch does not warn."""
    app = Plain(cluster)
    with pytest.warns(ddlf.ConfigWarning, match=r"validation_freq=2 validates after none of this run's epochs"):
        history = app.train(epochs=1, batch_size=32, validation_split=0.5, validation_freq=2, verbose=0)
    assert "val_loss" not in history.history and len(history.history["loss"]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", ddlf.ConfigWarning)
        history = app.train(epochs=2, batch_size=32, validation_split=0.5, validation_freq=2, verbose=0)
    assert len(history.history["val_loss"]) == 1


class Frames(ddlf.IApp):
    """The loader returns a pandas DataFrame and Series, as fit takes them."""

    dataset_key = "fit-args-pandas"

    def load_dataset(self) -> Any:
        import pandas as pd

        x, y = _data()
        return pd.DataFrame(x, columns=[f"f{i}" for i in range(6)]), pd.Series(y, name="label")

    create_model = Plain.create_model


def test_pandas_frames_from_the_loader_train_as_their_values(cluster: ddlf.Cluster) -> None:
    pytest.importorskip("pandas")
    app = Frames(cluster)
    app.model = app.create_model()
    start = [np.array(w) for w in app.model.get_weights()]
    app.train(
        epochs=1,
        batch_size=16,
        shuffle=False,
        verbose=0,
        strategy=ddlf.GradientAveraging(),
        run=ddlf.RunConfig(workers=[0]),
    )
    reference, _ = _fit_reference(Plain(cluster), start, 1, 16)
    for got, want in zip(app.model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


class ObjectColumn(Plain):
    dataset_key = "fit-args-objects"

    def load_dataset(self) -> Any:
        x, y = _data()
        return {"numbers": x, "text": np.array(["a"] * ROWS, dtype=object)}, y


class TwoOutputs(NamedInputsOutputs):
    dataset_key = "fit-args-named"  # the same data: reused from the store


@pytest.mark.parametrize(
    ("app_cls", "kwargs", "message"),
    [
        (ObjectColumn, {}, r"x\['text'\] holds Python objects"),
        (Plain, {"sample_weight": np.ones(5)}, "5 entries for a dataset of 192 rows"),
        (TwoOutputs, {"class_weight": {0: 2.0}}, "class_weight needs a single array of labels"),
    ],
    ids=["object-column", "short-sample-weight", "class-weight-two-outputs"],
)
def test_data_a_model_cannot_train_on_is_refused_before_training(
    cluster: ddlf.Cluster, app_cls: type, kwargs: dict, message: str
) -> None:
    """The error names the part and what to do; it comes from set-up (no round runs); the workers serve on."""
    history_seen: list[int] = []
    probe = ddlf.callbacks.LambdaCallback(on_round_end=lambda r, logs: history_seen.append(r))
    with pytest.raises(ddlf.RemoteError, match=message):
        app_cls(cluster).train(epochs=1, verbose=0, callbacks=[probe], **kwargs)
    assert history_seen == []
    assert cluster.run(lambda: "still serving") == ["still serving"] * 2


def test_invalid_fit_arguments_fail_before_any_worker_is_asked(cluster: ddlf.Cluster) -> None:
    app = Plain(cluster)
    for kwargs, message in [
        ({"validation_split": 1.5}, "validation_split"),
        ({"shuffle": "batch"}, "shuffle must be True or False"),
        ({"class_weight": {0: 1.0}, "sample_weight": np.ones(ROWS)}, "cannot be given together"),
        ({"validation_freq": 0}, "validation_freq"),
    ]:
        with pytest.raises((TypeError, ValueError), match=message):
            app.train(epochs=1, verbose=0, **kwargs)
    assert cluster.run(lambda: __import__("ddlf.training.replica", fromlist=["runs"]).runs()) == [[], []]
