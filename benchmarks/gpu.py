"""GPUs: ddlf with one worker per GPU (``Cluster.local(gpus="auto")``) against single-process ``model.fit`` on the
same GPU, for the paper's CNN on MNIST and a ResNet-style CIFAR-10 model: seconds per epoch (median of the epochs
after the first), the first epoch (compile included), and the device each ran on. Each case runs in its own
process, one after another in one invocation, so the ratios are measured side by side.

The CIFAR-10 rows are synthetic (seeded random 32x32x3 images and labels of CIFAR-10's shape and size): this
benchmark measures time per epoch, which does not depend on the pixels, and the machines it runs on have no
network to fetch CIFAR-10 from. Accuracy is reported for MNIST only."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import numpy as np

from . import report
from .backends import DATA, fit_epochs, shape_inputs
from .backends import build as build_mnist

MODELS = ("cnn", "resnet")
MODES = ("single", "ddlf", "ddlf-gradients")


def build(model: str) -> Any:
    """A compiled Keras model: the paper's CNN, or a ResNet-20-style network (3 stages of 2 residual blocks,
    16/32/64 filters, BatchNorm) for 32x32x3 images."""
    if model == "cnn":
        return build_mnist("cnn")
    import keras
    from keras import layers

    def block(h: Any, filters: int, stride: int) -> Any:
        shortcut = h
        h = layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False)(h)
        h = layers.ReLU()(layers.BatchNormalization()(h))
        h = layers.Conv2D(filters, 3, padding="same", use_bias=False)(h)
        h = layers.BatchNormalization()(h)
        if stride != 1 or shortcut.shape[-1] != filters:
            shortcut = layers.BatchNormalization()(layers.Conv2D(filters, 1, strides=stride, use_bias=False)(shortcut))
        return layers.ReLU()(h + shortcut)

    inputs = keras.Input(shape=(32, 32, 3))
    h = layers.ReLU()(layers.BatchNormalization()(layers.Conv2D(16, 3, padding="same", use_bias=False)(inputs)))
    for filters, stride in ((16, 1), (16, 1), (32, 2), (32, 1), (64, 2), (64, 1)):
        h = block(h, filters, stride)
    outputs = layers.Dense(10, activation="softmax")(layers.GlobalAveragePooling2D()(h))
    net = keras.Model(inputs, outputs)
    net.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return net


def data(model: str, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Training rows and (MNIST only) 2,000 test rows."""
    if model == "cnn":
        import ddlf

        (x, y), (xt, yt) = ddlf.datasets.mnist(DATA)
        return x[:rows], y[:rows], xt[:2000], yt[:2000]
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, (rows, 32, 32, 3), dtype=np.uint8), rng.integers(0, 10, rows), None, None


def inputs(model: str, x: np.ndarray) -> np.ndarray:
    return shape_inputs("cnn", x) if model == "cnn" else x.astype(np.float32) / 255.0


def _device() -> str:
    import keras

    if keras.backend.backend() == "jax":
        import jax

        d = jax.devices()[0]
        return f"{d.platform} {d.device_kind}"
    if keras.backend.backend() == "torch":
        import torch

        return f"cuda {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "cpu"
    return keras.backend.backend()


def run_case(model: str, mode: str, rows: int, epochs: int, batch: int) -> dict[str, Any]:
    """One case in this process: per-epoch seconds, test accuracy (MNIST) and the device."""
    import keras

    x, y, xt, yt = data(model, rows)
    keras.utils.set_random_seed(0)
    acc = float("nan")
    if mode == "single":
        net = build(model)
        seconds = fit_epochs(net, inputs(model, x), y, batch_size=batch, epochs=epochs, verbose=0)
        if xt is not None:
            _, acc = net.evaluate(inputs(model, xt), yt, verbose=0)
        device = _device()
    else:
        import ddlf

        class GpuApp(ddlf.IApp):
            dataset_key = f"gpu-bench-{model}-{rows}"

            def load_dataset(self) -> Any:
                return data(model, rows)[:2]

            def preprocess(self, bx: Any, by: Any) -> Any:
                return inputs(model, bx), by

            def create_model(self) -> Any:
                return build(model)

        strategy = ddlf.GradientAveraging() if mode == "ddlf-gradients" else ddlf.ModelAveraging()
        with ddlf.Cluster.local(gpus="auto") as cluster:
            app = GpuApp(cluster)
            app.train(epochs=0, verbose=0)  # load the dataset (not timed: the single-process case has it in memory)
            h = app.train(epochs=epochs, batch_size=batch, strategy=strategy, verbose=0)
            seconds = list(h.epoch_seconds)
            if xt is not None:
                _, acc = app.evaluate(xt, yt)
            device = cluster.run(_device)[0]
    return {"seconds": seconds, "accuracy": float(acc), "device": device}


def _subprocess_case(model: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    env.setdefault("KERAS_BACKEND", args.backend)
    cmd = [sys.executable, "-m", "benchmarks.gpu", "--case", model, mode]
    cmd += ["--epochs", str(args.epochs), "--batch", str(args.batch), "--rows", str(args.rows.get(model, 0))]
    return report.json_case(cmd, env)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks gpu", description=__doc__)
    p.add_argument("--epochs", type=int, default=4, help="epochs per case (the first includes compiling)")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of every mode, interleaved (single, ddlf, ... then again): the table gives medians over the "
        "rounds, and each ratio is the median of the ratios within a round",
    )
    p.add_argument("--backend", default="jax", help="Keras backend (KERAS_BACKEND wins)")
    p.add_argument("--mnist-rows", type=int, default=60_000)
    p.add_argument("--cifar-rows", type=int, default=50_000)
    p.add_argument("--case", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    p.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(args.case[0], args.case[1], args.rows, args.epochs, args.batch)))
        return
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    args.rows = {"cnn": args.mnist_rows, "resnet": args.cifar_rows}
    modes = args.modes.split(",")
    if "single" not in modes:
        p.error("--modes must include single (the baseline)")
    rows = []
    for model in args.models.split(","):
        rounds: list[dict[str, dict[str, Any]]] = []
        for i in range(args.repeats):
            results = {}
            for mode in modes:
                results[mode] = r = _subprocess_case(model, mode, args)
                print(model, mode, f"round {i + 1}", r, flush=True)
            rounds.append(results)
        rows += _rows(model, modes, rounds)
    repeats = "" if args.repeats == 1 else f", {args.repeats} interleaved rounds"
    body = (
        "## GPUs: one worker per GPU against one process on the same GPU\n\n"
        f"`python -m benchmarks gpu` (Keras on {os.environ.get('KERAS_BACKEND', args.backend)}, batch {args.batch}, "
        f"{args.epochs} epochs{repeats}; MNIST {args.mnist_rows:,} rows, CIFAR-10-shaped {args.cifar_rows:,} "
        "synthetic rows), on: "
        + report.machine()
        + "\n\n"
        + report.table(
            [
                "model",
                "run",
                "device",
                "s/epoch (steady)",
                "vs one process",
                "ratio per round",
                "first epoch s",
                "test accuracy",
            ],
            rows,
        )
        + '\n\n`ddlf` is `app.train()` with its defaults on `Cluster.local(gpus="auto")` (one worker, that GPU '
        "only visible to it); `ddlf-gradients` the same with `strategy=ddlf.GradientAveraging()`. Steady: median "
        "of the epochs after the first. The baseline is `model.fit` in one process on the same GPU, measured in the "
        "same run; with several rounds each mode runs once per round, in turn, every case in a fresh process, and "
        "'vs one process' is the median of the rounds' ratios (each round's ratio beside it).\n"
    )
    print(body)
    report.write_section("gpu", body)


def _steady(r: dict[str, Any]) -> float:
    seconds = r["seconds"]
    return report.median(seconds[1:] or seconds)


def _rows(model: str, modes: list[str], rounds: list[dict[str, dict[str, Any]]]) -> list[list[str]]:
    """One table row per mode: medians over the rounds that ran; ratios paired within a round."""
    out = []
    for mode in modes:
        done = [rd for rd in rounds if "error" not in rd[mode]]
        if not done:
            out.append([model, mode, rounds[0][mode]["error"][:80], "", "", "", "", ""])
            continue
        paired = [_steady(rd[mode]) / _steady(rd["single"]) for rd in done if "error" not in rd["single"]]
        accs = [rd[mode]["accuracy"] for rd in done if rd[mode]["accuracy"] == rd[mode]["accuracy"]]
        out.append(
            [
                model,
                mode,
                done[0][mode]["device"],
                f"{report.median([_steady(rd[mode]) for rd in done]):.2f}",
                f"{report.median(paired):.2f}x" if paired else "",
                " / ".join(f"{x:.2f}" for x in paired),
                f"{report.median([rd[mode]['seconds'][0] for rd in done]):.2f}",
                f"{100 * report.median(accs):.1f}%" if accs else "",
            ]
        )
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
