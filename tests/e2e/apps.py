"""The apps, callbacks and helpers the end-to-end tests share (imported from here, never from another test
module). They travel to the workers by value, like any class a script defines beside it."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np

import ddlf
from ddlf import ops
from ddlf.training.callbacks import LambdaCallback
from ddlf.training.plan import whole_batch_sizes

from ..conftest import MNIST_DIR, pooled


class SmallMnist(ddlf.IApp):
    """A small dense model on the first 3,000 MNIST images: seconds per epoch on two cores."""

    dataset_key = "mnist-small-test"
    rows = 3000

    def load_dataset(self):
        (x, y), _ = ddlf.datasets.mnist(MNIST_DIR)
        return x[: self.rows], y[: self.rows]

    def preprocess(self, x, y):
        return x.reshape(len(x), -1).astype(np.float32) / 255.0, y

    def create_model(self):
        import keras

        model = keras.Sequential(
            [keras.Input(shape=(784,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10, "softmax")]
        )
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model


class FaultApp(SmallMnist):
    """A small dense model with dropout (so random-generator state matters) on 6,000 MNIST images."""

    dataset_key = "mnist-fault-test"
    rows = 6000
    learning_rate = 1e-3

    def create_model(self):
        import keras

        model = keras.Sequential(
            [
                keras.Input(shape=(784,)),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dropout(0.2),
                keras.layers.Dense(10, "softmax"),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(self.learning_rate),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
        return model


def _kill_at_round(pid: int, at: int, sig: int = signal.SIGKILL) -> tuple[LambdaCallback, dict[str, float]]:
    """A callback that sends ``sig`` to ``pid`` 50 ms after round ``at`` ends: in the middle of the next round
    when rounds take longer than that, and in any case before the round after it starts (a later round's end
    waits for the signal: a warm model's rounds may take less than 50 ms, and the run must not end first)."""
    when: dict[str, float] = {}
    timer: list[threading.Timer] = []

    def fire() -> None:
        when["t"] = time.time()
        os.kill(pid, sig)

    def on_round_end(r: int, logs: dict) -> None:
        if r == at and not timer:
            timer.append(threading.Timer(0.05, fire))
            timer[0].start()
        elif r > at and timer:
            timer[0].join()

    return LambdaCallback(on_round_end=on_round_end), when


ROWS = 600


class Linear(ddlf.IApp):
    """A two-layer MLP on a fixed synthetic task, trained with plain SGD and no dropout (nothing random per step)."""

    dataset_key = "gradients-test-linear"
    learning_rate = 0.05
    optimizer = "sgd"
    nan_rows: tuple[int, ...] = ()

    def load_dataset(self):
        rng = np.random.default_rng(7)
        x = rng.standard_normal((ROWS, 12)).astype(np.float32)
        y = (x @ rng.standard_normal(12) > 0).astype(np.float32)
        x[list(self.nan_rows)] = np.nan
        return x, y

    def create_model(self):
        import keras

        model = keras.Sequential(
            [keras.Input((12,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1, activation="sigmoid")]
        )
        opt = (
            keras.optimizers.SGD(self.learning_rate)
            if self.optimizer == "sgd"
            else keras.optimizers.Adam(self.learning_rate)
        )
        model.compile(optimizer=opt, loss="binary_crossentropy", metrics=["accuracy"])
        return model


class Nan(Linear):
    dataset_key = "gradients-test-nan"
    nan_rows = (3, 4)


def global_batches(n: int, batch: int, epochs: int, seed: int, frequency: int | None) -> list[np.ndarray]:
    """The rows of each step as one process sees them: the union of the n workers' batches of that step, following
    the master's plan (the epoch's permutation, cut into rounds and split among the workers)."""
    out = []
    for epoch in range(epochs):
        perm = ops.permutation(ROWS, seed, epoch)
        lo = 0
        while lo < ROWS:
            total = min(ROWS - lo, frequency * batch * n) if frequency else ROWS - lo
            parts = []
            for size in whole_batch_sizes(total, [1.0] * n, batch):
                parts.append(perm[lo : lo + int(size)])
                lo += int(size)
            steps = max(-(-len(p) // batch) for p in parts)
            for s in range(steps):
                out.append(np.concatenate([p[s * batch : (s + 1) * batch] for p in parts]))
    return out


def one_process(app: ddlf.IApp, start: list[np.ndarray], batches: list[np.ndarray], lr_scale: float = 1.0):
    x, y = app.load_dataset()
    model = app.create_model()
    model.set_weights(start)
    model.optimizer.learning_rate = app.learning_rate * lr_scale
    for rows in batches:
        model.train_on_batch(x[rows], y[rows])
    return model.get_weights()


class Replicas(LambdaCallback):
    """Every live worker's copy of the weights after each round (the run is torn down when training ends)."""

    def __init__(self, c: ddlf.Cluster) -> None:
        super().__init__(on_round_end=self._fetch)
        self.cluster = c
        self.run_id = ""
        self.held: list[list[np.ndarray]] = []

    def _fetch(self, r: int, logs: dict) -> None:
        from ddlf.training import replica as remote

        if not self.run_id:  # the only run these tests have on their workers
            live = [w for w in range(len(self.cluster)) if w not in self.cluster.lost_workers]
            (run,) = self.cluster.run_on(live[0], remote.runs)
            self.run_id = run["run_id"]
        got = self.cluster.call(remote.reduced_weights, (self.run_id,), return_exceptions=True)
        self.held = [w for w in got if not isinstance(w, BaseException)]

    def identical(self) -> bool:
        first = self.held[0]
        return all(a.tobytes() == b.tobytes() for r in self.held[1:] for a, b in zip(r, first))


def train_replicated(app_class: type[ddlf.IApp], n: int, strategy: object, epochs: int = 2, seed: int = 4):
    """A fresh ``app_class`` trained from its ``create_model()`` weights on ``n`` local workers (batch 16 each),
    every replica's weights held after each round: ``(app, start, got, history, replicas)``."""
    with pooled(n) as c:
        app = app_class(c)
        app.model = app.create_model()
        start = app.model.get_weights()
        held = Replicas(c)
        h = app.train(
            epochs=epochs, batch_size=16, callbacks=[held], verbose=0, strategy=strategy, run=ddlf.RunConfig(seed=seed)
        )
        got = app.model.get_weights()
    return app, start, got, h, held


SEPARABLE_ROWS = 1024


def separable(shift: float = 0.0, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Two separable classes in 8 features (of ``scale`` and offset ``shift``: what a Normalization adapts to)."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(SEPARABLE_ROWS, 8)).astype(np.float32)
    y = (x[:, :4].sum(axis=1) > 0).astype(np.int32)
    return x * scale + shift, y


def flat(weights: list) -> np.ndarray:
    """A model's weights as one vector."""
    return np.concatenate([np.asarray(w).ravel() for w in weights])
