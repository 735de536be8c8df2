"""Time to accuracy: does ddlf, with the defaults a new user gets, learn as the user's one-process ``model.fit`` does?

Four tasks (issue 37): ``binary`` (4,000 rows of 20 features, a 32-unit MLP), ``mlp`` (12,000 MNIST rows, a
784-128-10 MLP), ``sequence`` (4,000 integer sequences, Embedding + LSTM: does token 1 come before token 2) and
``cnn`` (the DDLF paper's CNN on 12,000 MNIST rows); Adam 1e-3 everywhere. Each case trains with the test split as
``validation_data`` (evaluated after every epoch on both sides, so both pay for it) until its validation accuracy
reaches the task's target or ``max_epochs`` pass, and reports:

* the test accuracy after the task's ``epochs`` (equal epochs: the same rows seen as one process);
* epochs and seconds to the target (the sum of the epochs' wall times, first epoch and compilation included; the
  workers' start and dataset load, done once per cluster, are not: one process has its data in memory too);
* medians over ``--repeats`` seeds, each case in its own process.

Cases: ``single-b`` (``model.fit`` at batch ``b``, what the user ran before), ``single-nb`` (at ``n x b``), ``sync``
and ``async`` (``app.train(epochs, b)`` with no strategy, and with ``Asynchronous()``: ddlf's defaults; the
synchronous default is chosen by ``ddlf.training.defaults``, gradient averaging with the learning rate scaled by
n for these models), and the alternatives the defaults were chosen against (``--cases``): ``ma-epoch`` (model
averaging once per epoch, the synchronous default before issue 37), ``ma-10`` (every 10 batches), ``ga``
(gradient averaging), ``ga-scaled`` (with the learning rate scaled by n), ``async-10`` (chunks of 10 batches, the
asynchronous default before issue 37).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import report
from .apps import task_app
from .backends import DATA


@dataclass(frozen=True)
class Task:
    rows: int
    epochs: int  # the equal-epochs comparison
    batch: int
    target: float
    max_epochs: int


TASKS = {
    "binary": Task(4000, 3, 64, 0.88, 8),
    "mlp": Task(12_000, 4, 64, 0.93, 10),
    "sequence": Task(4000, 6, 64, 0.99, 12),
    "cnn": Task(12_000, 2, 32, 0.97, 6),
}
CASES = ("single-b", "single-nb", "sync", "async", "ma-epoch", "ma-10", "ga", "ga-scaled", "async-10")
DEFAULT_CASES = ("single-b", "single-nb", "sync", "async")


def data(task: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(x, y, x_test, y_test)`` of a task, the same on every call (seeded)."""
    rows = TASKS[task].rows
    rng = np.random.default_rng(0)
    if task == "binary":
        x = rng.standard_normal((rows + 2000, 20)).astype(np.float32)
        w = rng.standard_normal(20)
        logits = x @ w + 0.5 * np.sin(3 * x[:, 0]) * x[:, 1]
        y = (logits + 0.5 * rng.standard_normal(len(x)) > 0).astype(np.float32)
        return x[:rows], y[:rows], x[rows:], y[rows:]
    if task == "sequence":
        n = rows + 2000
        x = rng.integers(3, 20, (n, 20)).astype(np.int32)
        at = rng.integers(0, 20, (n, 2))
        keep = at[:, 0] != at[:, 1]
        x, at = x[keep], at[keep]
        x[np.arange(len(x)), at[:, 0]] = 1
        x[np.arange(len(x)), at[:, 1]] = 2
        y = (at[:, 0] < at[:, 1]).astype(np.float32)
        return x[:rows], y[:rows], x[rows : rows + 2000], y[rows : rows + 2000]
    import ddlf

    (x, y), (xt, yt) = ddlf.datasets.mnist(DATA)
    return x[:rows], y[:rows], xt[:5000], yt[:5000]


def prepare(task: str, x: np.ndarray) -> np.ndarray:
    """The model's input from a task's stored rows (MNIST stays uint8 until here, as a worker holds it)."""
    if task == "mlp":
        return x.reshape(len(x), -1).astype(np.float32) / 255.0
    if task == "cnn":
        return (x.astype(np.float32) / 255.0)[..., None]
    return x


def build(task: str) -> Any:
    import keras
    from keras import layers

    if task == "binary":
        net = keras.Sequential([keras.Input((20,)), layers.Dense(32, activation="relu"), layers.Dense(1, "sigmoid")])
        loss = "binary_crossentropy"
    elif task == "sequence":
        net = keras.Sequential(
            [
                keras.Input((20,), dtype="int32"),
                layers.Embedding(20, 16),
                layers.LSTM(32),
                layers.Dense(1, activation="sigmoid"),
            ]
        )
        loss = "binary_crossentropy"
    elif task == "mlp":
        net = keras.Sequential([keras.Input((784,)), layers.Dense(128, activation="relu"), layers.Dense(10, "softmax")])
        loss = "sparse_categorical_crossentropy"
    else:
        from .backends import build as build_mnist

        net = build_mnist("cnn")
        loss = "sparse_categorical_crossentropy"
    net.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss, metrics=["accuracy"])
    return net


def strategy(case: str) -> Any:
    import ddlf

    return {
        "sync": None,
        "async": ddlf.Asynchronous(),
        "ma-epoch": ddlf.ModelAveraging(),
        "ma-10": ddlf.ModelAveraging(every=10),
        "ga": ddlf.GradientAveraging(),
        "ga-scaled": ddlf.GradientAveraging(scale_learning_rate=True),
        "async-10": ddlf.Asynchronous(chunk=10),
    }[case]


def _stopper(target: float, min_epochs: int) -> Any:
    import keras

    class StopAtTarget(keras.callbacks.Callback):
        """Stop once validation accuracy reaches ``target`` and the equal-epochs point has passed."""

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            if epoch + 1 >= min_epochs and (logs or {}).get("val_accuracy", 0.0) >= target:
                self.model.stop_training = True

    return StopAtTarget()


def run_case(task: str, case: str, n: int, seed: int) -> dict[str, Any]:
    import keras

    t = TASKS[task]
    x, y, xt, yt = data(task)
    keras.utils.set_random_seed(seed)
    stop = _stopper(t.target, t.epochs)
    if case.startswith("single"):
        net = build(task)
        b = t.batch * (n if case == "single-nb" else 1)
        seconds: list[float] = []
        h = net.fit(
            prepare(task, x),
            y,
            batch_size=b,
            epochs=t.max_epochs,
            validation_data=(prepare(task, xt), yt),
            verbose=0,
            callbacks=[stop, _timer(seconds)],
        )
        return _result(h.history["val_accuracy"], seconds, t)
    import ddlf

    TaskApp = task_app(
        f"accuracy-bench-{task}", lambda: data(task)[:2], lambda bx: prepare(task, bx), lambda: build(task)
    )
    with ddlf.Cluster.local(n) as cluster:
        app = TaskApp(cluster)
        app.train(epochs=0, verbose=0)  # start the workers and load the dataset, once per cluster
        h = app.train(
            epochs=t.max_epochs,
            batch_size=t.batch,
            strategy=strategy(case),
            validation_data=(xt, yt),  # raw rows, as the workers hold them: ddlf runs preprocess on them
            callbacks=[stop],
            run=ddlf.RunConfig(seed=seed),
            verbose=0,
        )
    return _result(h.history["val_accuracy"], list(h.epoch_seconds), t)


def _timer(seconds: list[float]) -> Any:
    import keras

    class EpochTimer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self.t0 = time.perf_counter()

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            seconds.append(time.perf_counter() - self.t0)  # after validation: the callbacks run after it

    return EpochTimer()


def _result(accs: list[float], seconds: list[float], t: Task) -> dict[str, Any]:
    reached = next((i for i, a in enumerate(accs) if a >= t.target), None)
    return {
        "accuracy": float(accs[t.epochs - 1]),
        "epochs_to_target": None if reached is None else reached + 1,
        "seconds_to_target": None if reached is None else float(sum(seconds[: reached + 1])),
        "accuracies": [round(float(a), 4) for a in accs],
        "seconds": [round(s, 3) for s in seconds],
    }


def _median_or_none(values: list[float | None]) -> float | None:
    """The median when at least half the seeds reached the target (the others count as never)."""
    got = sorted(v for v in values if v is not None)
    if len(got) * 2 < len(values) or not got:
        return None
    padded = got + [float("inf")] * (len(values) - len(got))
    return report.median(padded)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks accuracy", description=__doc__)
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--workers", default="2,4")
    p.add_argument("--repeats", type=int, default=3, help="seeds per case (medians)")
    p.add_argument("--cases", default=",".join(DEFAULT_CASES), help=f"of {','.join(CASES)}")
    p.add_argument("--section", default="accuracy", help="the BENCHMARKS.md section to write")
    p.add_argument("--case", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case:
        task, case, n, seed = args.case
        print(json.dumps(run_case(task, case, int(n), int(seed))))
        return
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    cases = args.cases.split(",")
    rows = []
    for task in args.tasks.split(","):
        baseline: float | None = None
        for n in (int(w) for w in args.workers.split(",")):
            for case in cases:
                if case == "single-b" and baseline is not None:
                    continue  # the same runs for every n
                results, err = [], ""
                # Seeds alternate with nothing else here: each case's seeds run back to back, cases in order.
                for seed in range(args.repeats):
                    cmd = [sys.executable, "-m", "benchmarks.accuracy", "--case", task, case, str(n), str(seed)]
                    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
                    if out.returncode != 0:
                        err = (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]
                        sys.stderr.write(out.stderr[-3000:])
                        break
                    results.append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(task, n, case, json.dumps(results), err, flush=True)
                if err:
                    rows.append([task, "" if case == "single-b" else n, case, err[:80], "", "", "", ""])
                    continue
                accs = [r["accuracy"] for r in results]
                secs = _median_or_none([r["seconds_to_target"] for r in results])
                epochs = _median_or_none([r["epochs_to_target"] for r in results])
                if case == "single-b":
                    baseline = secs
                ratio = f"{secs / baseline:.2f}" if secs is not None and baseline else ""
                rows.append(
                    [
                        task,
                        "1" if case.startswith("single") else n,
                        case,
                        f"{100 * report.median(accs):.1f}%",
                        f"{100 * min(accs):.1f}-{100 * max(accs):.1f}",
                        "not reached" if epochs is None else f"{epochs:g}",
                        "" if secs is None else f"{secs:.1f}",
                        ratio,
                    ]
                )
    headers = ["task", "n", "case", "accuracy, equal epochs", "range", "epochs to target", "s to target", "x single-b"]
    tasks = "; ".join(
        f"{k}: {v.rows:,} rows, b = {v.batch}, {v.epochs} epochs, target {100 * v.target:g}%"
        for k, v in TASKS.items()
        if k in args.tasks.split(",")
    )
    import keras

    body = (
        f"## Time to accuracy: {args.tasks.replace(',', ', ')} on {args.workers.replace(',', ' and ')} workers\n\n"
        f"`python -m benchmarks accuracy --repeats {args.repeats} --workers {args.workers} --cases {args.cases}` "
        f"(Keras on {keras.backend.backend()}; Adam 1e-3; {tasks}; medians over {args.repeats} seeds; s to target: "
        "the epochs' wall times summed, validation included on both sides), on: "
        + report.machine()
        + "\n\n"
        + report.table(headers, rows)
        + "\n"
    )
    print(body)
    report.write_section(args.section, body)


if __name__ == "__main__":
    main(sys.argv[1:])
