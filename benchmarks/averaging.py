"""Model averaging against gradient averaging: test accuracy after the same epochs, and seconds per epoch.

Rows: one process at batch ``b`` and at ``n x b`` (what n workers of ``b`` amount to per step), and ddlf sync on
``n`` local workers with ``averaging="weights"`` (every ``--frequency`` batches, the paper's algorithm),
``averaging="gradients"`` (every step, over the ring) and ``averaging="gradients"`` with the learning rate scaled
by ``n`` (``scale_learning_rate=True``). Two tasks: the issue's 20-feature binary task (4,000 rows, a 32-unit MLP,
Adam, batch 64, 3 epochs) and the paper's CNN on MNIST. Each case runs in its own process, one after another in
one invocation; accuracies are medians over ``--repeats`` seeds."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

import numpy as np

from . import report
from .apps import task_app
from .backends import fit_epochs

TASKS = {
    # rows, epochs, batch, learning rate
    "binary": (4000, 3, 64, 1e-3),
    "cnn": (12_000, 2, 32, 1e-3),
}
DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "data", "mnist")


def _binary(rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows + 2000, 20)).astype(np.float32)
    w = rng.standard_normal(20)
    logits = x @ w + 0.5 * np.sin(3 * x[:, 0]) * x[:, 1]
    y = (logits + 0.5 * rng.standard_normal(len(x)) > 0).astype(np.float32)
    return x[:rows], y[:rows], x[rows:], y[rows:]


def data(task: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rows = TASKS[task][0]
    if task == "binary":
        return _binary(rows)
    import ddlf

    (x, y), (xt, yt) = ddlf.datasets.mnist(DATA)
    return x[:rows], y[:rows], xt[:2000], yt[:2000]


def prepare(task: str, x: np.ndarray) -> np.ndarray:
    return x if task == "binary" else (x.astype(np.float32) / 255.0)[..., None]


def build(task: str) -> Any:
    import keras
    from keras import layers

    lr = TASKS[task][3]
    if task == "binary":
        net = keras.Sequential(
            [keras.Input((20,)), layers.Dense(32, activation="relu"), layers.Dense(1, activation="sigmoid")]
        )
        net.compile(optimizer=keras.optimizers.Adam(lr), loss="binary_crossentropy", metrics=["accuracy"])
        return net
    from .backends import build as build_mnist

    net = build_mnist("cnn")
    net.compile(optimizer=keras.optimizers.Adam(lr), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return net


def run_case(task: str, case: str, n: int, seed: int, frequency: int) -> dict[str, Any]:
    import keras

    _rows, epochs, batch, _lr = TASKS[task]
    x, y, xt, yt = data(task)
    keras.utils.set_random_seed(seed)
    if case.startswith("single"):
        b = batch * (n if case == "single-nb" else 1)
        net = build(task)
        seconds = fit_epochs(net, prepare(task, x), y, batch_size=b, epochs=epochs, verbose=0)
        _, acc = net.evaluate(prepare(task, xt), yt, verbose=0)
        return {"accuracy": float(acc), "seconds": report.median(seconds[1:] or seconds)}
    import ddlf

    Task = task_app(
        f"averaging-bench-{task}", lambda: data(task)[:2], lambda bx: prepare(task, bx), lambda: build(task)
    )

    strategy: ddlf.ModelAveraging | ddlf.GradientAveraging = (
        ddlf.ModelAveraging(every=frequency)
        if case == "weights"
        else ddlf.GradientAveraging(scale_learning_rate=case == "gradients-scaled")
    )
    with ddlf.Cluster.local(n) as cluster:
        app = Task(cluster)
        app.train(epochs=0, verbose=0)
        h = app.train(epochs=epochs, batch_size=batch, strategy=strategy, run=ddlf.RunConfig(seed=seed), verbose=0)
        _, acc = app.evaluate(xt, yt)
    return {"accuracy": float(acc), "seconds": report.median(h.epoch_seconds[1:] or h.epoch_seconds)}


CASES = ("single-b", "single-nb", "weights", "gradients", "gradients-scaled")


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks averaging", description=__doc__)
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--workers", default="2")
    p.add_argument("--repeats", type=int, default=3, help="seeds per case (accuracy: median)")
    p.add_argument("--frequency", type=int, default=10, help='batches per round for averaging="weights"')
    p.add_argument("--case", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case:
        task, case, n, seed = args.case
        print(json.dumps(run_case(task, case, int(n), int(seed), args.frequency)))
        return
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    rows = []
    for task in args.tasks.split(","):
        for n in (int(w) for w in args.workers.split(",")):
            for case in CASES:
                accs, secs, err = [], [], ""
                for seed in range(args.repeats):
                    cmd = [sys.executable, "-m", "benchmarks.averaging", "--case", task, case, str(n), str(seed)]
                    out = subprocess.run(
                        [*cmd, "--frequency", str(args.frequency)], env=env, capture_output=True, text=True
                    )
                    if out.returncode != 0:
                        err = (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]
                        sys.stderr.write(out.stderr[-3000:])
                        break
                    r = json.loads(out.stdout.strip().splitlines()[-1])
                    accs.append(r["accuracy"])
                    secs.append(r["seconds"])
                print(task, n, case, accs, secs, err, flush=True)
                per_step = {"single-b": "b", "single-nb": "n x b"}.get(case, "n x b (b per worker)")
                if err:
                    rows.append([task, n, case, per_step, err[:80], "", ""])
                    continue
                spread = f"{100 * min(accs):.1f}-{100 * max(accs):.1f}"
                acc = f"{100 * report.median(accs):.1f}%"
                rows.append([task, n, case, per_step, acc, spread, f"{report.median(secs):.2f}"])
    table = report.table(["task", "n", "run", "batch per step", "test accuracy (median)", "range", "s/epoch"], rows)
    import keras

    body = (
        "## Model averaging against gradient averaging (accuracy per epoch)\n\n"
        f"`python -m benchmarks averaging --repeats {args.repeats}` (Keras on {keras.backend.backend()}; "
        f"binary: 4,000 rows of 20 features, 32-unit MLP, Adam 1e-3, b = 64, 3 epochs; cnn: the paper's CNN, "
        f"12,000 MNIST rows, Adam 1e-3, b = 32, 2 epochs; `weights` averages every {args.frequency} batches; "
        "`gradients-scaled` multiplies the learning rate by n; s/epoch: median of the epochs after the first, which "
        "compiles), on: " + report.machine() + "\n\n" + table + "\n"
    )
    print(body)
    report.write_section("averaging", body)


if __name__ == "__main__":
    main(sys.argv[1:])
