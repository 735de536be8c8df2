"""Conformance with Keras' own guides (issue 36): the model-building and training patterns the guides teach
(Sequential, functional and subclassed models, custom layers, losses, metrics, ``train_step``/``test_step`` and
callbacks, masking, RNNs, CNNs, BatchNormalization, transfer learning, dict and list inputs and outputs, sample
and class weights, dtype policies, schedules, ``add_loss``, pandas input, ...), each trained by Keras' ``model.fit``
in this process (the reference) and by ``app.train`` in every mode:

* ``fit``: the reference itself learns (its score falls by at least :data:`FIT_GAIN`), so the pattern is a fair
  test of the others.
* ``model-averaging``, ``gradient-averaging``, ``async``: two workers, ``ModelAveraging(every=2)``,
  ``GradientAveraging()``, ``Asynchronous(chunk=2)``. History has ``fit``'s keys, one value per epoch; the weights
  keep their shapes and dtypes and are finite; the master's model is in ``fit``'s band (:func:`in_band`); and the
  pattern's own checks hold (frozen layers unchanged, a callback's hooks, ...).
* ``exact-1-worker``: one worker, ``GradientAveraging()``, ``shuffle=False``, the batch size of ``fit(shuffle=False)``
  and the same start weights: the same weights and History as ``fit`` within float32 rounding (:data:`RTOL`).

Each pattern is a small builder (seeded synthetic data with a learnable signal, 256 rows, and a function that returns
the compiled model); ``fit``'s run is made once per pattern and shared by its modes. The suite writes its results
to ``docs/CONFORMANCE.md`` with ``DDLF_WRITE_CONFORMANCE=1`` (its last test writes it), and checks that the
committed table lists exactly its patterns and modes.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pandas as pd
import pytest
from keras import ops

import ddlf

from ..conftest import REPO

ROWS = 256
BATCH = 32
EPOCHS = 2
SEED = 5
FIT_GAIN = 0.10
"""``fit`` must lower its score by at least this share of the initial score: a pattern whose reference barely learns
cannot tell a working mode from a broken one."""
BAND = 0.25
"""Two workers must achieve at least this share of ``fit``'s improvement of the score (:func:`in_band`)."""
RTOL, ATOL = 1e-5, 1e-6
"""The exact mode's tolerance: float32 rounding (the worker computes the gradients and applies them in two compiled
calls where ``fit`` fuses them into one step, so the last bits may differ; measured over the same row order: most
patterns bit-identical, the CNN within 7.5e-6 relative). ``ATOL`` is for weights that end near zero, where a
relative bound means nothing: 1e-6 is float32's epsilon times a weight of order 10."""

MODES: dict[str, Any] = {
    "fit": None,
    "model-averaging": ddlf.ModelAveraging(every=2),
    "gradient-averaging": ddlf.GradientAveraging(),
    "async": ddlf.Asynchronous(chunk=2),
    "exact-1-worker": ddlf.GradientAveraging(),
}
DOC = Path(REPO) / "docs" / "CONFORMANCE.md"
WRITE_ENV = "DDLF_WRITE_CONFORMANCE"


# -- patterns -------------------------------------------------------------------------------------------------


@dataclass
class Data:
    """A pattern's training data, as ``fit`` takes it."""

    x: Any
    y: Any
    sample_weight: np.ndarray | None = None
    score_weight: np.ndarray | None = None
    """Row weights of the score (default: ``sample_weight``): a class-weighted pattern is scored as it is trained."""
    validation: tuple[Any, Any] | None = None


@dataclass(frozen=True)
class Pattern:
    """One pattern of a Keras guide: its data, its compiled model, and what both ``fit`` and ``train`` get."""

    name: str
    guide: str
    """The Keras guide (keras.io/guides) it follows."""
    data: Callable[[], Data]
    model: Callable[[], Any]
    dataset: str = "tuple"
    """What ``load_dataset`` returns: ``"tuple"`` ``(x, y)``; ``"triple"`` ``(x, y, sample_weight)``; ``"dict"``
    ``{"x": ..., "y": ...}``. With ``"tuple"`` or ``"dict"`` a ``sample_weight`` goes as ``sample_weight=``."""
    extra: Callable[[Data], dict[str, Any]] = field(default=lambda d: {})
    """More arguments of both ``fit`` and ``train`` (``class_weight``, ``callbacks`` made fresh per run, ...)."""
    score: Callable[[Any, Data], float] | None = None
    """The lower the better; default: the compiled loss on the training rows (weighted as trained)."""
    check: Callable[[Run], None] | None = None
    """The pattern's own assertions on a finished run, in every mode."""


@dataclass
class Run:
    """A finished training run of a pattern, for its checks."""

    mode: str
    model: Any
    history: dict[str, list[float]]
    start: list[np.ndarray]
    extra: dict[str, Any]


def _rng(name: str) -> np.random.Generator:
    return np.random.default_rng(sum(name.encode()))


def _features(name: str, cols: int = 8) -> tuple[np.random.Generator, np.ndarray]:
    r = _rng(name)
    return r, r.standard_normal((ROWS, cols)).astype(np.float32)


def three_classes() -> Data:
    r, x = _features("three")
    return Data(x, np.argmax(x @ r.standard_normal((8, 3)), axis=1).astype(np.int32))


def binary() -> Data:
    r, x = _features("binary")
    return Data(x, (x @ r.standard_normal(8) > 0).astype(np.float32)[:, None])


def regression() -> Data:
    r, x = _features("regression")
    y = x @ r.standard_normal(8) + 0.1 * r.standard_normal(ROWS)
    return Data(x, y.astype(np.float32)[:, None])


def _compile(model: Any, loss: Any = "binary_crossentropy", metrics: Any = ("accuracy",), lr: float = 0.01) -> Any:
    model.compile(optimizer=keras.optimizers.Adam(lr), loss=loss, metrics=list(metrics))
    return model


def _dense_binary(*hidden: Any, cols: int = 8) -> Any:
    return keras.Sequential([keras.Input((cols,)), *hidden, keras.layers.Dense(1, activation="sigmoid")])


@contextlib.contextmanager
def dtype_policy(name: str) -> Iterator[None]:
    """Keras's global dtype policy set to ``name`` while a model is built (as the mixed precision guide does), and
    put back after: the policy is process-wide, and the other patterns run in the same processes."""
    before = keras.config.dtype_policy()
    keras.config.set_dtype_policy(name)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(before)


# The Sequential model.
def sequential_mlp() -> Any:
    m = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3, activation="softmax")]
    )
    return _compile(m, "sparse_categorical_crossentropy")


# The Functional API: a residual connection.
def functional_residual() -> Any:
    inputs = keras.Input((8,), name="features")
    h = keras.layers.Dense(8, activation="tanh")(inputs)
    h = keras.layers.Add()([inputs, h])
    outputs = keras.layers.Dense(1, activation="sigmoid")(h)
    return _compile(keras.Model(inputs, outputs))


# Making new layers and models via subclassing: a model.
class SubclassedMLP(keras.Model):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.out = keras.layers.Dense(1, activation="sigmoid")

    def call(self, x: Any) -> Any:
        return self.out(self.hidden(x))


def subclassed_model() -> Any:
    m = SubclassedMLP()
    m(np.zeros((1, 8), np.float32))  # built by a first call, so that its weights exist before training
    return _compile(m)


# Making new layers and models via subclassing: a layer with add_weight, and a learnable 0-d scalar.
class Linear(keras.layers.Layer):
    def __init__(self, units: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape: Any) -> None:
        self.w = self.add_weight(shape=(input_shape[-1], self.units), initializer="random_normal", trainable=True)
        self.b = self.add_weight(shape=(self.units,), initializer="zeros", trainable=True)

    def call(self, x: Any) -> Any:
        return ops.matmul(x, self.w) + self.b


class Temperature(keras.layers.Layer):
    def build(self, input_shape: Any) -> None:
        self.t = self.add_weight(shape=(), initializer="ones", name="t")

    def call(self, x: Any) -> Any:
        return x * self.t


def custom_layer() -> Any:
    tanh, sigmoid = keras.layers.Activation("tanh"), keras.layers.Activation("sigmoid")
    m = keras.Sequential([keras.Input((8,)), Linear(8), tanh, Linear(1), Temperature(), sigmoid])
    return _compile(m, lr=0.03)


def check_scalar_weight(run: Run) -> None:
    t = run.model.layers[-2].get_weights()[0]
    assert np.asarray(t).shape == () and float(t) != 1.0, t  # still a 0-d weight, and it learned


# Training & evaluation with the built-in methods: a custom loss (a Loss subclass with a parameter).
class CustomMSE(keras.losses.Loss):
    def __init__(self, regularization_factor: float = 0.1, name: str = "custom_mse") -> None:
        super().__init__(name=name)
        self.regularization_factor = regularization_factor

    def call(self, y_true: Any, y_pred: Any) -> Any:
        mse = ops.mean(ops.square(y_true - y_pred), axis=-1)
        reg = ops.mean(ops.square(0.5 - y_pred), axis=-1)
        return mse + reg * self.regularization_factor


def custom_loss() -> Any:
    m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    return _compile(m, CustomMSE(0.05), metrics=("mae",))


# Training & evaluation with the built-in methods: a custom metric with its own state.
class CategoricalTruePositives(keras.metrics.Metric):
    def __init__(self, name: str = "categorical_true_positives", **kwargs: Any) -> None:
        super().__init__(name=name, **kwargs)
        self.true_positives = self.add_variable(shape=(), name="ctp", initializer="zeros")

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        y_pred = ops.reshape(ops.argmax(y_pred, axis=1), (-1, 1))
        values = ops.cast(ops.cast(y_true, "int32") == ops.cast(y_pred, "int32"), "float32")
        if sample_weight is not None:
            values = ops.multiply(values, ops.cast(sample_weight, "float32"))
        self.true_positives.assign_add(ops.sum(values))

    def result(self) -> Any:
        return self.true_positives

    def reset_state(self) -> None:
        self.true_positives.assign(0.0)


def custom_metric() -> Any:
    m = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3, activation="softmax")]
    )
    return _compile(m, "sparse_categorical_crossentropy", metrics=(CategoricalTruePositives(),))


def three_classes_column() -> Data:
    d = three_classes()
    return Data(d.x, d.y[:, None])  # CategoricalTruePositives compares (rows, 1) labels


# Customizing what happens in fit(): a train_step of its own, its own loss and metrics, compiled with only an
# optimizer (the guide's "going lower-level").
class OwnTrainStep(keras.Model):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.out = keras.layers.Dense(1)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
        self.loss_fn = keras.losses.MeanSquaredError()

    def call(self, x: Any) -> Any:
        return self.out(self.hidden(x))

    def train_step(self, data: Any) -> dict[str, Any]:
        import tensorflow as tf

        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.loss_fn(y, y_pred)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        self.loss_tracker.update_state(loss)
        self.mae_metric.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

    @property
    def metrics(self) -> list[Any]:
        return [self.loss_tracker, self.mae_metric]


def custom_train_step() -> Any:
    m = OwnTrainStep()
    m(np.zeros((1, 8), np.float32))
    m.compile(optimizer=keras.optimizers.Adam(0.01))
    return m


def mse_score(model: Any, d: Data) -> float:
    return float(np.mean((model.predict(d.x, batch_size=256, verbose=0) - d.y) ** 2))


# Customizing what happens in fit(): a test_step of its own, run by validation.
class OwnTestStep(keras.Model):
    # Keras' Model.test_step overridden (not a pytest test: pytest collects no class outside Test*). What fails
    # it is check_validation below: val_loss missing or non-finite for every epoch in every mode.
    def _own_test_step(self, data: Any) -> dict[str, Any]:
        # Keras' hook (bound as test_step below); check_validation fails it (no finite val_loss from this step).
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}

    test_step = _own_test_step  # Keras looks the hook up by this name; defined under another, pytest sees no test


def custom_test_step() -> Any:
    inputs = keras.Input((8,))
    outputs = keras.layers.Dense(1)(keras.layers.Dense(16, activation="relu")(inputs))
    return _compile(OwnTestStep(inputs, outputs), "mse", metrics=("mae",))


def regression_with_validation() -> Data:
    d = regression()
    return Data(d.x[:192], d.y[:192], validation=(d.x[192:], d.y[192:]))


def check_validation(run: Run) -> None:
    assert len(run.history["val_loss"]) == EPOCHS and np.isfinite(run.history["val_loss"]).all()


# Writing your own callbacks.
class EpochRecorder(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.began = self.ended = 0
        self.epochs: list[tuple[int, list[str]]] = []

    def on_train_begin(self, logs: Any = None) -> None:
        self.began += 1

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.epochs.append((epoch, sorted(logs or {})))

    def on_train_end(self, logs: Any = None) -> None:
        self.ended += 1


def check_callback(run: Run) -> None:
    (cb,) = run.extra["callbacks"]
    assert (cb.began, cb.ended) == (1, 1)
    assert cb.epochs == [(e, sorted(run.history)) for e in range(EPOCHS)], cb.epochs
    assert cb.model is run.model  # the master's model, as fit's is the model it trains


# Understanding masking & padding: Embedding(mask_zero=True) in front of an LSTM.
def padded_sequences() -> Data:
    r = _rng("padded")
    lengths = r.integers(2, 11, ROWS)
    tokens = r.integers(1, 20, (ROWS, 10))
    x = np.where(np.arange(10)[None, :] < lengths[:, None], tokens, 0).astype(np.int32)
    mean = (x.sum(1) / lengths).astype(np.float32)
    return Data(x, (mean > np.median(mean)).astype(np.float32)[:, None])


def masking_lstm() -> Any:
    m = keras.Sequential(
        [
            keras.Input((10,), dtype="int32"),
            keras.layers.Embedding(20, 8, mask_zero=True),
            keras.layers.LSTM(8),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )
    return _compile(m, lr=0.03)


# Working with RNNs: a bidirectional LSTM under a GRU.
def sequences() -> Data:
    r = _rng("sequences")
    x = r.standard_normal((ROWS, 6, 3)).astype(np.float32)
    return Data(x, (x[:, :, 0].sum(1) > 0).astype(np.float32)[:, None])


def rnn_bidirectional_gru() -> Any:
    m = keras.Sequential(
        [
            keras.Input((6, 3)),
            keras.layers.Bidirectional(keras.layers.LSTM(8, return_sequences=True)),
            keras.layers.GRU(8),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )
    return _compile(m, lr=0.03)


# A small convnet (Conv2D, MaxPooling2D), as the Sequential model and transfer learning guides build them.
def images() -> Data:
    r = _rng("images")
    x = r.standard_normal((ROWS, 8, 8, 1)).astype(np.float32) * 0.5
    y = r.integers(0, 2, ROWS)
    x[y == 1, :, :4] += 1.0  # class 1 is bright on the left
    return Data(x, y.astype(np.int32))


def conv2d_cnn() -> Any:
    m = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(2, activation="softmax"),
        ]
    )
    return _compile(m, "sparse_categorical_crossentropy")


# BatchNormalization: moving statistics that no optimizer trains.
def batch_normalization() -> Any:
    return _compile(
        _dense_binary(keras.layers.Dense(16), keras.layers.BatchNormalization(), keras.layers.Activation("relu"))
    )


def check_moving_statistics(run: Run) -> None:
    mean, var = run.model.layers[1].get_weights()[2:]
    assert not np.array_equal(mean, 0) and not np.array_equal(var, 1)  # they follow the batches


# Dropout, seeded (the layer's own seed: its masks are the same in any process).
def dropout() -> Any:
    return _compile(_dense_binary(keras.layers.Dense(32, activation="relu"), keras.layers.Dropout(0.3, seed=3)))


# Transfer learning & fine-tuning: a frozen base (with BatchNormalization, run in inference mode) under a new head.
def frozen_base() -> Any:
    base = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.BatchNormalization()], name="base"
    )
    base.trainable = False
    inputs = keras.Input((8,))
    h = base(inputs, training=False)
    outputs = keras.layers.Dense(1, activation="sigmoid")(h)
    return _compile(keras.Model(inputs, outputs))


def check_frozen(run: Run) -> None:
    base = run.model.get_layer("base")
    assert not base.trainable_weights and len(base.non_trainable_weights) == 6
    frozen = len(base.weights)  # the base's weights come first in the model's
    for got, start in zip(run.model.get_weights()[:frozen], run.start[:frozen]):
        np.testing.assert_array_equal(got, start)  # frozen: not one bit moved, BatchNorm's statistics included


# The Functional API: several inputs, given by name (a dict).
def named_inputs() -> Data:
    r = _rng("named")
    title = r.integers(1, 30, (ROWS, 6)).astype(np.int32)
    features = r.standard_normal((ROWS, 4)).astype(np.float32)
    y = ((title < 10).sum(1) + features[:, 0] > 2).astype(np.float32)[:, None]
    return Data({"title": title, "features": features}, y)


def multi_input_dict() -> Any:
    title = keras.Input((6,), dtype="int32", name="title")
    features = keras.Input((4,), name="features")
    t = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(30, 8)(title))
    h = keras.layers.Dense(8, activation="relu")(keras.layers.Concatenate()([t, features]))
    out = keras.layers.Dense(1, activation="sigmoid")(h)
    return _compile(keras.Model({"title": title, "features": features}, out))


# The Functional API: several outputs, by name, each with its loss, loss weight and metrics.
def named_outputs() -> Data:
    r, x = _features("outputs")
    priority = (x @ r.standard_normal(8)).astype(np.float32)[:, None]
    department = np.argmax(x @ r.standard_normal((8, 3)), axis=1).astype(np.int32)
    return Data(x, {"priority": priority, "department": department})


def multi_output_dict() -> Any:
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu")(inputs)
    outputs = {
        "priority": keras.layers.Dense(1, name="priority")(h),
        "department": keras.layers.Dense(3, activation="softmax", name="department")(h),
    }
    m = keras.Model(inputs, outputs)
    m.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss={"priority": "mse", "department": "sparse_categorical_crossentropy"},
        loss_weights={"priority": 1.0, "department": 0.2},
        metrics={"priority": ["mae"], "department": ["accuracy"]},
    )
    return m


# The Functional API: several inputs, as a list.
def two_inputs() -> Data:
    r = _rng("list")
    a = r.standard_normal((ROWS, 4)).astype(np.float32)
    b = r.standard_normal((ROWS, 3)).astype(np.float32)
    return Data([a, b], (a[:, 0] - b[:, 1] > 0).astype(np.float32)[:, None])


def list_inputs() -> Any:
    a, b = keras.Input((4,)), keras.Input((3,))
    h = keras.layers.Dense(8, activation="relu")(keras.layers.Concatenate()([a, b]))
    return _compile(keras.Model([a, b], keras.layers.Dense(1, activation="sigmoid")(h)))


# Training & evaluation with the built-in methods: sample weights. A fifth of the labels are flipped and weighted 0:
# a run that drops the weights learns the noise.
def weighted_rows(name: str) -> Data:
    d = binary()
    r = _rng(name)
    noisy = r.random(ROWS) < 0.2
    y = np.where(noisy[:, None], 1.0 - d.y, d.y).astype(np.float32)
    return Data(d.x, y, sample_weight=np.where(noisy, 0.0, 1.5).astype(np.float32))


def plain_mlp() -> Any:
    return _compile(_dense_binary(keras.layers.Dense(16, activation="relu")))


# Training & evaluation with the built-in methods: class weights on imbalanced classes.
CLASS_WEIGHT = {0: 0.625, 1: 2.5}


def imbalanced() -> Data:
    r, x = _features("imbalanced")
    score = x @ r.standard_normal(8)
    y = (score > np.quantile(score, 0.8)).astype(np.float32)[:, None]
    return Data(x, y, score_weight=np.where(y[:, 0] > 0, CLASS_WEIGHT[1], CLASS_WEIGHT[0]).astype(np.float32))


# Mixed precision: the mixed_float16 policy (float16 compute, float32 variables, loss scaling), the output in float32.
def mixed_float16() -> Any:
    with dtype_policy("mixed_float16"):
        m = _dense_binary(keras.layers.Dense(16, activation="relu"))
        m.layers[-1].activation = keras.activations.linear
        m.add(keras.layers.Activation("sigmoid", dtype="float32"))
        return _compile(m)


def check_mixed(run: Run) -> None:
    assert run.model.layers[0].compute_dtype == "float16" and run.model.layers[0].kernel.dtype == "float32"
    assert isinstance(run.model.optimizer, keras.optimizers.LossScaleOptimizer)


# Mixed precision guide's dtype policies: a float64 model, all its variables in float64.
def binary64() -> Data:
    d = binary()
    return Data(d.x.astype(np.float64), d.y.astype(np.float64))


def float64_model() -> Any:
    with dtype_policy("float64"):
        m = keras.Sequential(
            [
                keras.Input((8,), dtype="float64"),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(1, activation="sigmoid"),
            ]
        )
        return _compile(m)


def check_float64(run: Run) -> None:
    assert {w.dtype for w in run.model.get_weights()} == {np.dtype(np.float64)}


# The Sequential model: regression with MSE (and plain SGD with momentum).
def regression_mse() -> Any:
    m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    m.compile(optimizer=keras.optimizers.SGD(0.02, momentum=0.9), loss="mse", metrics=["mae"])
    return m


# Binary classification with a sigmoid, accuracy and AUC (a metric with thresholds' state).
def binary_sigmoid() -> Any:
    m = _dense_binary(keras.layers.Dense(16, activation="relu"))
    m.compile(
        optimizer=keras.optimizers.RMSprop(0.005),
        loss="binary_crossentropy",
        metrics=["accuracy", keras.metrics.AUC(name="auc")],
    )
    return m


# Training & evaluation with the built-in methods: a learning-rate schedule in the optimizer.
def lr_schedule() -> Any:
    schedule = keras.optimizers.schedules.ExponentialDecay(0.2, decay_steps=4, decay_rate=0.7)
    m = _dense_binary(keras.layers.Dense(16, activation="relu"))
    m.compile(optimizer=keras.optimizers.SGD(schedule), loss="binary_crossentropy", metrics=["accuracy"])
    return m


# Making new layers and models via subclassing: add_loss (an activity regularizer), and a kernel regularizer.
class ActivityRegularization(keras.layers.Layer):
    def __init__(self, rate: float = 1e-2, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rate = rate

    def call(self, x: Any) -> Any:
        self.add_loss(self.rate * ops.mean(ops.square(x)))
        return x


def add_loss_regularization() -> Any:
    return _compile(
        _dense_binary(
            keras.layers.Dense(16, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-3)),
            ActivityRegularization(1e-2),
        )
    )


# Text classification from scratch: Embedding, Conv1D and GlobalAveragePooling1D.
def token_sequences() -> Data:
    r = _rng("text")
    x = r.integers(1, 30, (ROWS, 12)).astype(np.int32)
    good = (x < 8).sum(1)
    return Data(x, (good > np.median(good)).astype(np.float32)[:, None])


def conv1d_text() -> Any:
    m = keras.Sequential(
        [
            keras.Input((12,), dtype="int32"),
            keras.layers.Embedding(30, 8),
            keras.layers.Conv1D(8, 3, activation="relu"),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )
    return _compile(m, lr=0.02)


# Making new layers and models via subclassing: a non-trainable integer variable (a counter of training calls).
class CallCounter(keras.layers.Layer):
    def build(self, input_shape: Any) -> None:
        self.calls = self.add_weight(shape=(), dtype="int32", initializer="zeros", trainable=False, name="calls")

    def call(self, x: Any, training: bool = False) -> Any:
        if training:
            self.calls.assign_add(1)
        return x


def int_counter() -> Any:
    return _compile(_dense_binary(keras.layers.Dense(16, activation="relu"), CallCounter()))


def check_counter(run: Run) -> None:
    calls = run.model.layers[1].get_weights()[0]
    assert calls.dtype == np.int32 and calls.shape == () and int(calls) >= 1, calls  # still an int, and it counted


# Training & evaluation with the built-in methods: a pandas DataFrame of named columns and a Series of labels.
def dataframe() -> Data:
    d = binary()
    return Data(pd.DataFrame(d.x, columns=[f"f{i}" for i in range(8)]), pd.Series(d.y[:, 0], name="label"))


SEQUENTIAL = "The Sequential model"
FUNCTIONAL = "The Functional API"
SUBCLASSING = "Making new layers and models via subclassing"
BUILT_IN = "Training & evaluation with the built-in methods"
CUSTOM_FIT = "Customizing what happens in fit()"

PATTERN_LIST = [
    Pattern("sequential_mlp", SEQUENTIAL, three_classes, sequential_mlp),
    Pattern("functional_residual", FUNCTIONAL, binary, functional_residual),
    Pattern("subclassed_model", SUBCLASSING, binary, subclassed_model),
    Pattern("custom_layer_add_weight", SUBCLASSING, binary, custom_layer, check=check_scalar_weight),
    Pattern("custom_loss", BUILT_IN, regression, custom_loss),
    Pattern("custom_metric", BUILT_IN, three_classes_column, custom_metric),
    Pattern("custom_train_step", CUSTOM_FIT, regression, custom_train_step, score=mse_score),
    Pattern(
        "custom_test_step",
        CUSTOM_FIT,
        regression_with_validation,
        custom_test_step,
        extra=lambda d: {"validation_data": d.validation},
        check=check_validation,
    ),
    Pattern(
        "custom_callback",
        "Writing your own callbacks",
        binary,
        plain_mlp,
        extra=lambda d: {"callbacks": [EpochRecorder()]},
        check=check_callback,
    ),
    Pattern("masking_padding", "Understanding masking & padding", padded_sequences, masking_lstm),
    Pattern("rnn_bidirectional_gru", "Working with RNNs", sequences, rnn_bidirectional_gru),
    Pattern("conv2d_cnn", SEQUENTIAL, images, conv2d_cnn),
    Pattern("batch_normalization", SEQUENTIAL, binary, batch_normalization, check=check_moving_statistics),
    Pattern("dropout", SEQUENTIAL, binary, dropout),
    Pattern("transfer_frozen_base", "Transfer learning & fine-tuning", binary, frozen_base, check=check_frozen),
    Pattern("multi_input_dict", FUNCTIONAL, named_inputs, multi_input_dict),
    Pattern("multi_output_dict", FUNCTIONAL, named_outputs, multi_output_dict, dataset="dict"),
    Pattern("list_inputs", FUNCTIONAL, two_inputs, list_inputs),
    Pattern("sample_weight", BUILT_IN, lambda: weighted_rows("sample_weight"), plain_mlp),
    Pattern("sample_weight_in_dataset", BUILT_IN, lambda: weighted_rows("in_dataset"), plain_mlp, dataset="triple"),
    Pattern("class_weight", BUILT_IN, imbalanced, plain_mlp, extra=lambda d: {"class_weight": CLASS_WEIGHT}),
    Pattern("mixed_float16", "Mixed precision", binary, mixed_float16, check=check_mixed),
    Pattern("float64_policy", "Mixed precision", binary64, float64_model, check=check_float64),
    Pattern("regression_mse", SEQUENTIAL, regression, regression_mse),
    Pattern("binary_sigmoid_auc", BUILT_IN, binary, binary_sigmoid),
    Pattern("lr_schedule", BUILT_IN, binary, lr_schedule),
    Pattern("add_loss_regularizers", SUBCLASSING, binary, add_loss_regularization),
    Pattern("conv1d_text", "Text classification from scratch", token_sequences, conv1d_text),
    Pattern("int_counter_variable", SUBCLASSING, binary, int_counter, check=check_counter),
    Pattern("pandas_dataframe", BUILT_IN, dataframe, plain_mlp),
]
PATTERNS = {p.name: p for p in PATTERN_LIST}
assert len(PATTERNS) == len(PATTERN_LIST)


# -- running them ---------------------------------------------------------------------------------------------


class ConformanceApp(ddlf.IApp):
    """Trains the pattern it names (the workers import this module and look it up)."""

    def __init__(self, cluster: ddlf.Cluster, pattern: str) -> None:
        self.pattern = pattern
        self.dataset_key = f"conformance-{pattern}"
        super().__init__(cluster)

    def load_dataset(self) -> Any:
        p = PATTERNS[self.pattern]
        d = p.data()
        if p.dataset == "triple":
            return d.x, d.y, d.sample_weight
        if p.dataset == "dict":
            return {"x": d.x, "y": d.y}
        return d.x, d.y

    def create_model(self) -> Any:
        return PATTERNS[self.pattern].model()


def default_score(model: Any, d: Data) -> float:
    weight = d.score_weight if d.score_weight is not None else d.sample_weight
    return float(model.evaluate(d.x, d.y, sample_weight=weight, batch_size=ROWS, verbose=0, return_dict=True)["loss"])


def score(p: Pattern, model: Any, d: Data) -> float:
    return (p.score or default_score)(model, d)


def fit_args(p: Pattern, d: Data) -> dict[str, Any]:
    """What ``fit`` gets besides ``x`` and ``y``; ``train`` gets the same, less what ``load_dataset`` returns."""
    args = dict(p.extra(d))
    if d.sample_weight is not None:
        args["sample_weight"] = d.sample_weight
    return args


def train_args(p: Pattern, d: Data) -> dict[str, Any]:
    args = fit_args(p, d)
    if p.dataset == "triple":
        del args["sample_weight"]
    return args


@dataclass
class Reference:
    """``fit``'s run of a pattern (``shuffle=False``), and a model that scores others' weights."""

    data: Data
    start: list[np.ndarray]
    weights: list[np.ndarray]
    history: dict[str, list[float]]
    start_score: float
    fit_score: float
    scorer: Any
    run: Run


REFERENCES: dict[str, Reference] = {}


def reference(p: Pattern) -> Reference:
    """``fit``'s run of ``p``, made on first use and shared by the pattern's modes."""
    if p.name not in REFERENCES:
        d = p.data()
        keras.utils.set_random_seed(SEED)
        model = p.model()
        start = [np.array(w) for w in model.get_weights()]
        before = score(p, model, d)
        args = fit_args(p, d)
        h = model.fit(d.x, d.y, epochs=EPOCHS, batch_size=BATCH, shuffle=False, verbose=0, **args)
        weights = [np.array(w) for w in model.get_weights()]
        run = Run("fit", model, h.history, start, args)
        REFERENCES[p.name] = Reference(d, start, weights, h.history, before, score(p, model, d), model, run)
    return REFERENCES[p.name]


def in_band(ref: Reference, got: float) -> None:
    """Two workers learn: the master's model scores below the start, and has at least :data:`BAND` of ``fit``'s
    improvement. Each worker trains half of the rows each epoch: model averaging moves about as far as one of the
    two half-trajectories it averages, gradient averaging takes half of ``fit``'s steps at twice the batch, and
    asynchronous training takes all of them from weights a chunk stale; so about half of ``fit``'s improvement is
    expected (measured here: 0.5 to 1.2 of it), and a quarter leaves a factor of two for the noise of 256 rows. The
    band catches a mode that does not learn, or learns far less than fit; the exact mode catches the rest."""
    gained, fit_gained = ref.start_score - got, ref.start_score - ref.fit_score
    assert got < ref.start_score and gained >= BAND * fit_gained, (
        f"score {got:.4f}: from {ref.start_score:.4f} fit reached {ref.fit_score:.4f}; "
        f"this run gained {gained:.4f}, less than {BAND} of fit's {fit_gained:.4f}"
    )


RESULTS: dict[tuple[str, str], str] = {}
"""``(pattern, mode)`` -> ``"passed"`` or what failed; written to the table."""


def _check(p: Pattern, mode: str, cluster: ddlf.Cluster) -> None:
    ref = reference(p)
    if mode == "fit":
        gained = ref.start_score - ref.fit_score
        assert gained >= FIT_GAIN * ref.start_score, (ref.start_score, ref.fit_score)
        assert all(len(v) == EPOCHS for v in ref.history.values())
        if p.check:
            p.check(ref.run)
        return
    exact = mode == "exact-1-worker"
    app = ConformanceApp(cluster, p.name)
    # The master's model holds the weights every worker starts from (train() builds it, seeded by RunConfig.seed,
    # only when app.model is None): here, fit's start. Random state beyond the weights is each worker's own (seeded
    # from RunConfig.seed and its index), so the dropout pattern gives its layer a seed of its own, as fit needs too
    # for repeatable masks.
    app.model = app.create_model()
    app.model.set_weights(ref.start)
    args = train_args(p, ref.data)
    if exact:
        args.update(shuffle=False, run=ddlf.RunConfig(workers=(0,), seed=SEED))
    else:
        args.update(run=ddlf.RunConfig(seed=SEED))
    h = app.train(epochs=EPOCHS, batch_size=BATCH, strategy=MODES[mode], verbose=0, **args)
    got = [np.asarray(w) for w in app.model.get_weights()]
    assert sorted(h.history) == sorted(ref.history), (sorted(h.history), sorted(ref.history))
    assert all(len(v) == EPOCHS for v in h.history.values())
    assert [(w.shape, w.dtype) for w in got] == [(w.shape, w.dtype) for w in ref.weights]
    assert all(np.isfinite(w).all() for w in got if w.dtype.kind == "f")
    if exact:
        for i, (a, b) in enumerate(zip(got, ref.weights)):
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL, err_msg=f"weight {i}")
        for k, v in ref.history.items():
            np.testing.assert_allclose(h.history[k], v, rtol=RTOL, atol=ATOL, err_msg=k)
    else:
        ref.scorer.set_weights(got)
        try:
            in_band(ref, score(p, ref.scorer, ref.data))
        finally:
            ref.scorer.set_weights(ref.weights)
    if p.check:
        p.check(Run(mode, app.model, h.history, ref.start, args))  # args: the callbacks this run got


CASES = [(p, m) for p in PATTERNS for m in MODES]


@pytest.mark.parametrize(("pattern", "mode"), CASES, ids=[f"{p}-{m}" for p, m in CASES])
def test_pattern_trains_as_fit_does(cluster: ddlf.Cluster, pattern: str, mode: str) -> None:
    """A Keras guide's pattern under one mode: what the module's docstring says each mode checks."""
    try:
        _check(PATTERNS[pattern], mode, cluster)
    except BaseException as exc:
        RESULTS[(pattern, mode)] = f"failed: {summary(exc)}"
        raise
    RESULTS[(pattern, mode)] = "passed"


ADDRESS = re.compile(r" \(\d{1,3}(?:\.\d{1,3}){3}:\d+\)")
ERROR_LINE = re.compile(r"^(?:\w+\.)*\w*(?:Error|Exception): ")


def summary(exc: BaseException) -> str:
    """One line saying why a case failed: the error's type and first line (without the workers' ports, which
    change from run to run), and for an error that wraps another (TensorFlow's "in user code:"), its cause's."""
    lines = [line.strip() for line in ADDRESS.sub("", str(exc)).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    causes = [line for line in lines[1:] if ERROR_LINE.match(line)]
    if causes and text.endswith(":"):
        text = f"{text} ... {causes[-1]}"
    text = text if len(text) <= 200 else text[:197] + "..."
    return f"{type(exc).__name__}: {text}"


# -- the table ------------------------------------------------------------------------------------------------

HEADER = """# Conformance with Keras' guides

The model-building and training patterns of Keras' own guides (keras.io/guides), each trained by `model.fit` in one
process and by `app.train` on a local cluster (`tests/e2e/test_conformance.py`, issue 36; Keras on TensorFlow).
Each pattern is tiny: {rows} rows of seeded synthetic data with a learnable signal, {epochs} epochs, batches of
{batch}.

What each column checks:

- **fit**: the reference, `model.fit(shuffle=False)`: it learns (its score, the compiled loss on the training rows
  weighted as trained, falls by at least {fit_gain:.0%}), so the pattern can tell a working mode from a broken one.
- **model-averaging** (`ModelAveraging(every=2)`), **gradient-averaging** (`GradientAveraging()`), **async**
  (`Asynchronous(chunk=2)`), each on two workers: History has `fit`'s keys with one value per epoch, the weights
  keep their shapes and dtypes and are finite, the pattern's own checks hold (frozen layers unchanged, a callback's
  hooks, a float64 model stays float64, ...), and the master's model is in `fit`'s **band**: its score is below
  the start's and it gained at least {band:.0%} of what `fit` gained (each worker trains half of the rows per epoch,
  so about half is expected; a quarter leaves a factor of two for the noise of {rows} rows).
- **exact-1-worker**: one worker (`RunConfig(workers=[0])`), `GradientAveraging()`, `shuffle=False`, `fit`'s batch
  size and start weights: the same weights and History as `fit` within float32 rounding (rtol {rtol}, atol {atol}).

A cell says passed only when that test passed. Regenerate (the whole module, without `-x`):

```bash
DDLF_WRITE_CONFORMANCE=1 pytest tests/e2e/test_conformance.py
```
"""


def _e(x: float) -> str:
    return f"{x:.0e}".replace("e-0", "e-")


def render(results: dict[tuple[str, str], str]) -> str:
    modes = list(MODES)
    out = [
        HEADER.format(
            rows=ROWS, epochs=EPOCHS, batch=BATCH, fit_gain=FIT_GAIN, band=BAND, rtol=_e(RTOL), atol=_e(ATOL)
        ).rstrip(),
        "",
        "| pattern | guide | " + " | ".join(modes) + " |",
        "|---|---|" + "---|" * len(modes),
    ]
    for p in PATTERN_LIST:
        cells = ["passed" if results[(p.name, m)] == "passed" else "**failed**" for m in modes]
        out.append(f"| `{p.name}` | {p.guide} | " + " | ".join(cells) + " |")
    failures = [(k, v) for k, v in results.items() if v != "passed"]
    if failures:
        out += ["", "Why each failed case failed (its error's first line):", ""]
        for (name, mode), why in failures:
            out.append(f"- `{name}` / {mode}: {why.removeprefix('failed: ').replace('|', '/')}")
    return "\n".join(out) + "\n"


ROW = re.compile(r"^\| `(?P<name>[^`]+)` \|")


def table_of(text: str) -> tuple[list[str], list[str]]:
    """The modes (columns after the guide) and patterns (rows) of a written table."""
    header = next(line for line in text.splitlines() if line.startswith("| pattern |"))
    modes = [c.strip() for c in header.strip("|").split("|")][2:]
    return modes, [m.group("name") for line in text.splitlines() if (m := ROW.match(line))]


def test_the_conformance_table_lists_every_pattern_and_mode() -> None:
    """docs/CONFORMANCE.md lists exactly the suite's patterns (in order) and modes: a pattern added without
    regenerating it fails here. With ``DDLF_WRITE_CONFORMANCE=1`` this (the module's last test) writes it first,
    from this session's results, which must cover every case."""
    if os.environ.get(WRITE_ENV):
        missing = [f"{p}-{m}" for p, m in CASES if (p, m) not in RESULTS]
        assert not missing, f"{WRITE_ENV}=1 needs the whole module's results; not run: {missing[:5]}..."
        DOC.write_text(render(RESULTS))
    modes, patterns = table_of(DOC.read_text())
    assert modes == list(MODES)
    assert patterns == list(PATTERNS), f"regenerate: {WRITE_ENV}=1 pytest tests/e2e/test_conformance.py"
