"""Keras backends on this machine: TensorFlow, JAX and PyTorch (those installed), for the paper's CNN, an MLP, an
LSTM and a small transformer encoder on MNIST: seconds per epoch in one process (``model.fit``) and in ddlf sync
training on 2 local workers, the first epoch (compile included), and test accuracy. Each case runs in its own
process (a process has one Keras backend); cases run one after another in one invocation, so the ratios between
backends are measured side by side."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from typing import Any

import numpy as np

from ddlf.frameworks.keras_backend import KERAS_BACKENDS, installed_keras_backends

from . import report

MODELS = ("cnn", "mlp", "lstm", "transformer")
DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "data", "mnist")


def build(model: str) -> Any:
    """A compiled Keras model for 28x28 MNIST images (inputs shaped by :func:`shape_inputs`)."""
    import keras
    from keras import layers

    if model == "cnn":  # the DDLF paper's
        net = keras.Sequential(
            [
                keras.Input(shape=(28, 28, 1)),
                layers.Conv2D(32, (3, 3), activation="relu"),
                layers.MaxPooling2D((2, 2)),
                layers.Conv2D(64, (3, 3), activation="relu"),
                layers.MaxPooling2D((2, 2)),
                layers.Flatten(),
                layers.Dropout(0.5),
                layers.Dense(10, activation="softmax"),
            ]
        )
    elif model == "mlp":
        net = keras.Sequential(
            [
                keras.Input(shape=(784,)),
                layers.Dense(256, activation="relu"),
                layers.Dense(128, activation="relu"),
                layers.Dense(10, activation="softmax"),
            ]
        )
    elif model == "lstm":  # rows of the image as a sequence of 28 steps
        net = keras.Sequential([keras.Input(shape=(28, 28)), layers.LSTM(64), layers.Dense(10, activation="softmax")])
    elif model == "transformer":  # one encoder block over the 28 rows
        inputs = keras.Input(shape=(28, 28))
        h = layers.Dense(64)(inputs)
        a = layers.MultiHeadAttention(num_heads=4, key_dim=16)(h, h)
        h = layers.LayerNormalization()(h + a)
        f = layers.Dense(128, activation="relu")(h)
        h = layers.LayerNormalization()(h + layers.Dense(64)(f))
        h = layers.GlobalAveragePooling1D()(h)
        net = keras.Model(inputs, layers.Dense(10, activation="softmax")(h))
    else:
        raise ValueError(f"unknown model {model!r}")
    net.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return net


def fit_epochs(net: Any, *args: Any, **kwargs: Any) -> list[float]:
    """``net.fit(*args, **kwargs)``; returns the seconds of each epoch."""
    import keras

    seconds: list[float] = []

    class EpochTimer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self.t0 = time.perf_counter()

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            seconds.append(time.perf_counter() - self.t0)

    net.fit(*args, callbacks=[EpochTimer()], **kwargs)
    return seconds


def shape_inputs(model: str, x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float32) / 255.0
    if model == "cnn":
        return x[..., None]
    if model == "mlp":
        return x.reshape(len(x), -1)
    return x


def _data(rows: int) -> tuple[Any, Any, Any, Any]:
    import ddlf

    (x, y), (xt, yt) = ddlf.datasets.mnist(DATA)
    return x[:rows], y[:rows], xt[:2000], yt[:2000]


def _make_app(model: str, rows: int) -> Any:
    import ddlf

    class BackendApp(ddlf.IApp):
        dataset_key = f"backends-mnist-{rows}"

        def load_dataset(self) -> Any:
            x, y, _, _ = _data(rows)
            return x, y

        def preprocess(self, x: Any, y: Any) -> Any:
            return shape_inputs(model, x), y

        def create_model(self) -> Any:
            return build(model)

    return BackendApp


def run_case(model: str, mode: str, rows: int, epochs: int, batch: int) -> dict[str, Any]:
    """One case in this process (its Keras backend is already chosen): per-epoch seconds and test accuracy."""
    import keras

    x, y, xt, yt = _data(rows)
    keras.utils.set_random_seed(0)
    if mode == "single":
        net = build(model)
        seconds = fit_epochs(net, shape_inputs(model, x), y, batch_size=batch, epochs=epochs, verbose=0)
        _, acc = net.evaluate(shape_inputs(model, xt), yt, verbose=0)
    else:
        import ddlf

        with ddlf.Cluster.local(2) as cluster:
            app = _make_app(model, rows)(cluster)
            app.train(epochs=0, verbose=0)  # load the dataset (not timed: the single-process case has it too)
            h = app.train(epochs=epochs, batch_size=batch, verbose=0, strategy=ddlf.ModelAveraging(every=50))
            seconds = list(h.epoch_seconds)
            _, acc = app.evaluate(xt, yt)  # the app preprocesses
    return {"seconds": seconds, "accuracy": float(acc)}


def _subprocess_case(backend: str, model: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "2"}
    cmd = [sys.executable, "-m", "benchmarks.backends", "--case", model, mode]
    cmd += ["--rows", str(args.rows), "--epochs", str(args.epochs), "--batch", str(args.batch)]
    return report.json_case(cmd, env)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks backends", description=__doc__)
    p.add_argument("--rows", type=int, default=12_000, help="MNIST training rows")
    p.add_argument("--epochs", type=int, default=3, help="epochs per case (the first includes compiling)")
    p.add_argument("--batch", type=int, default=32, help="batch size (per worker in ddlf)")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--backends", default=None, help="default: every installed one")
    p.add_argument("--case", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(args.case[0], args.case[1], args.rows, args.epochs, args.batch)))
        return
    backends = args.backends.split(",") if args.backends else installed_keras_backends()
    rows = []
    best: dict[str, float] = {}
    results: dict[tuple[str, str, str], dict[str, Any]] = {}
    for model in args.models.split(","):
        for backend in backends:
            for mode in ("single", "ddlf"):
                r = _subprocess_case(backend, model, mode, args)
                results[(model, backend, mode)] = r
                print(model, backend, mode, r, flush=True)
            single = results[(model, backend, "single")]
            if "seconds" in single:
                steady = report.median(single["seconds"][1:] or single["seconds"])
                best[model] = min(best.get(model, steady), steady)
    for (model, backend, mode), r in results.items():
        if mode != "single":
            continue
        d = results[(model, backend, "ddlf")]
        if "error" in r or "error" in d:
            rows.append([model, backend, r.get("error", "") or d.get("error", ""), "", "", "", "", ""])
            continue
        s_steady = report.median(r["seconds"][1:] or r["seconds"])
        d_steady = report.median(d["seconds"][1:] or d["seconds"])
        rows.append(
            [
                model,
                backend,
                f"{s_steady:.2f}",
                f"{s_steady / best[model]:.2f}x",
                f"{r['seconds'][0]:.2f}",
                f"{d_steady:.2f} ({d_steady / best[model]:.2f}x)",
                f"{d['seconds'][0]:.2f}",
                f"{100 * r['accuracy']:.1f}% / {100 * d['accuracy']:.1f}%",
            ]
        )
    table = report.table(
        [
            "model",
            "backend",
            "one process s/epoch",
            "vs fastest",
            "first epoch s",
            "ddlf sync 2 workers s/epoch (vs fastest one process)",
            "ddlf first epoch s",
            "test acc one / ddlf",
        ],
        rows,
    )
    versions = []
    for name in backends:
        if name in KERAS_BACKENDS:
            try:
                versions.append(f"{name} {importlib.import_module(name).__version__}")
            except Exception as exc:  # a backend that does not import is reported, not fatal
                versions.append(f"{name} (import failed: {type(exc).__name__})")
    body = f"""## Keras backends on CPU (`python -m benchmarks backends`)

{report.machine()}; {", ".join(versions)}

MNIST, the first {args.rows:,} training rows, {args.epochs} epochs per case, batch {args.batch} (per worker in ddlf,
sync with averaging every 50 batches); test accuracy on 2,000 test images after the last epoch. "s/epoch" is the
median of the epochs after the first; "first epoch" includes tracing and compiling. One process uses every core;
each of the 2 ddlf workers gets half. "vs fastest" is against the fastest backend's one-process s/epoch for the same
model in this run.

{table}
"""
    print(body)
    report.write_section("backends", body)


if __name__ == "__main__":
    main(sys.argv[1:])
