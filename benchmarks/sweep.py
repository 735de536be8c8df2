"""A hyperparameter sweep three ways: ``ddlf.sweep`` on local workers, Ray Tune (``ray[tune]``) with its
``ASHAScheduler``, and the same trials one after another in one Keras process. 16 trials (a learning rate x width
grid) of an MNIST MLP, one worker (one CPU share) per trial, the same early-stopping rule everywhere: asynchronous
successive halving with Ray Tune's cut (a trial reaching a rung stops when its metric is below the
``1 - 1/reduction_factor`` percentile of what reached that rung before it).

Each contender runs in its own process, started fresh, and contenders are interleaved over ``--repeats`` rounds;
the table quotes medians of the wall time from process start to exit (imports, cluster or Ray start-up, every
trial) and of the sweep alone, and the best configuration each found. The math libraries of every concurrent
trial are capped at the same number of threads in ddlf and in Ray (cores / concurrent trials), so neither
oversubscribes the machine; the sequential process uses every core.

    python -m benchmarks sweep --repeats 3

Ray Tune is installed into this virtualenv (``pip install "ray[tune]"``) when it is missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

import ddlf
from ddlf.tune.asha import _Asha

from . import report

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "data", "mnist")
LEARNING_RATES = (3e-4, 1e-3, 3e-3, 1e-2)
WIDTHS = (16, 32, 64, 128)
CONTENDERS = ("ddlf", "ray", "sequential")


def configs() -> list[dict[str, Any]]:
    """The 16 trials, weakest-looking first (so early stopping has something to stop)."""
    return [{"lr": lr, "width": w} for w in WIDTHS for lr in LEARNING_RATES]


def build(config: dict[str, Any]) -> Any:
    import keras
    from keras import layers

    net = keras.Sequential(
        [keras.Input(shape=(784,)), layers.Dense(config["width"], activation="relu"), layers.Dense(10)]
    )
    net.compile(
        optimizer=keras.optimizers.Adam(config["lr"]),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return net


def flat(x: np.ndarray) -> np.ndarray:
    return x.reshape(len(x), -1).astype(np.float32) / 255.0


def data(rows: int, val_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Raw uint8 training and validation images (ddlf's app scales each batch: ``SweepApp.preprocess``)."""
    (x, y), (xt, yt) = ddlf.datasets.mnist(DATA)
    return x[:rows], y[:rows], xt[:val_rows], yt[:val_rows]


class SweepApp(ddlf.IApp):
    """One trial: the MLP of ``config`` on the first ``rows`` MNIST images (each worker loads them once)."""

    def __init__(self, cluster: Any, config: dict[str, Any], rows: int, val_rows: int) -> None:
        super().__init__(cluster)
        self.config, self.rows, self.val_rows = config, rows, val_rows
        self.dataset_key = f"sweep-bench-mnist-{rows}"

    def load_dataset(self) -> Any:
        x, y, _, _ = data(self.rows, self.val_rows)
        return x, y

    def preprocess(self, xb: Any, yb: Any) -> Any:
        return flat(xb), yb

    def create_model(self) -> Any:
        return build(self.config)


def run_ddlf(args: argparse.Namespace, threads: int) -> dict[str, Any]:
    _, _, xv, yv = data(args.rows, args.val_rows)

    def make_app(cluster: Any, config: dict[str, Any]) -> SweepApp:
        return SweepApp(cluster, config, args.rows, args.val_rows)

    with ddlf.Cluster.local(args.workers, threads=threads) as cluster:
        t0 = time.perf_counter()
        result = ddlf.sweep(
            cluster,
            make_app,
            configs(),
            epochs=args.epochs,
            metric="val_accuracy",
            grace_epochs=1,
            reduction_factor=args.rf,
            validation_data=(xv, yv),
            batch_size=args.batch,
        )
        sweep_s = time.perf_counter() - t0
    best = result.best
    return {
        "sweep_s": sweep_s,
        "best": best.config,
        "best_metric": best.metric,
        "epochs": sum(t.epochs for t in result.trials),
        "stopped": sum(t.status == "stopped" for t in result.trials),
    }


def _ray_trainable(config: dict[str, Any], x: Any = None, y: Any = None, xv: Any = None, yv: Any = None) -> None:
    from ray import tune

    net, xf = build(config), flat(x)
    for _ in range(config["epochs"]):
        net.fit(xf, y, batch_size=config["batch"], epochs=1, verbose=0)
        _, acc = net.evaluate(xv, yv, verbose=0)
        tune.report({"val_accuracy": float(acc)})


def run_ray(args: argparse.Namespace, threads: int) -> dict[str, Any]:
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    from ddlf.process import thread_env

    x, y, xv, yv = data(args.rows, args.val_rows)
    env = {**thread_env(threads), "KERAS_BACKEND": os.environ.get("KERAS_BACKEND", "tensorflow")}
    ray.init(
        num_cpus=args.workers,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": env},
        logging_level="ERROR",
    )
    t0 = time.perf_counter()
    space = {
        "lr": tune.grid_search(list(LEARNING_RATES)),
        "width": tune.grid_search(list(WIDTHS)),
        "epochs": args.epochs,
        "batch": args.batch,
    }
    with tempfile.TemporaryDirectory(prefix="ray-sweep-") as storage:
        tuner = tune.Tuner(
            tune.with_resources(tune.with_parameters(_ray_trainable, x=x, y=y, xv=flat(xv), yv=yv), {"cpu": 1}),
            param_space=space,
            tune_config=tune.TuneConfig(
                metric="val_accuracy",
                mode="max",
                scheduler=ASHAScheduler(max_t=args.epochs, grace_period=1, reduction_factor=args.rf),
                max_concurrent_trials=args.workers,
            ),
            run_config=tune.RunConfig(storage_path=storage, verbose=0),
        )
        results = tuner.fit()
        sweep_s = time.perf_counter() - t0
        best = results.get_best_result(metric="val_accuracy", mode="max", scope="all")
        frame = results.get_dataframe()
    ray.shutdown()
    trained = sum(int(r.metrics.get("training_iteration", 0)) for r in results)
    return {
        "sweep_s": sweep_s,
        "best": {"lr": best.config["lr"], "width": best.config["width"]},
        "best_metric": float(frame["val_accuracy"].max()),
        "epochs": trained,
        "stopped": sum(int(r.metrics.get("training_iteration", 0)) < args.epochs for r in results),
    }


def run_sequential(args: argparse.Namespace) -> dict[str, Any]:
    x, y, xv, yv = data(args.rows, args.val_rows)
    x, xv = flat(x), flat(xv)
    cut = _Asha(args.epochs, 1, args.rf, "max")  # the cut ddlf.sweep and Ray Tune make
    t0 = time.perf_counter()
    best: tuple[float, dict[str, Any]] = (-1.0, {})
    trained = stopped = 0
    for config in configs():
        net = build(config)
        for epoch in range(args.epochs):
            net.fit(x, y, batch_size=args.batch, epochs=1, verbose=0)
            _, acc = net.evaluate(xv, yv, verbose=0)
            trained += 1
            best = max(best, (float(acc), config), key=lambda b: b[0])
            if not cut.keep_going(epoch + 1, float(acc)):
                stopped += 1
                break
    return {
        "sweep_s": time.perf_counter() - t0,
        "best": best[1],
        "best_metric": best[0],
        "epochs": trained,
        "stopped": stopped,
    }


def _contender(name: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.sweep", "--contender", name]
    for flag in ("workers", "epochs", "rows", "val_rows", "batch", "rf"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "KERAS_BACKEND": args.backend}
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "wall_s": wall}


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks sweep", description=__doc__)
    p.add_argument("--workers", type=int, default=4, help="concurrent trials (ddlf workers, Ray CPUs)")
    p.add_argument("--epochs", type=int, default=9, help="the most epochs a trial trains (ASHA's max_t)")
    p.add_argument("--rf", type=float, default=3.0, help="ASHA's reduction factor (grace period: 1 epoch)")
    p.add_argument("--rows", type=int, default=12_000, help="MNIST training rows")
    p.add_argument("--val-rows", type=int, default=2_000, help="MNIST test rows used for validation")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="rounds, contenders interleaved")
    p.add_argument("--backend", default="tensorflow", help="Keras backend for every contender")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--contender", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from ddlf.process import cpu_count

    threads = max(1, cpu_count() // args.workers)
    if args.contender:
        run = {"ddlf": lambda: run_ddlf(args, threads), "ray": lambda: run_ray(args, threads)}
        run["sequential"] = lambda: run_sequential(args)
        print(json.dumps(run[args.contender]()))
        return
    names = args.contenders.split(",")
    if "ray" in names and importlib.util.find_spec("ray") is None:
        print("installing ray[tune] for the Ray Tune contender", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "ray[tune]>=2.9"], check=True)
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(args.repeats):
        for name in names:
            res = _contender(name, args)
            runs[name].append(res)
            print(f"round {r + 1} {name}: {res}", flush=True)
    wall = {n: report.median([x["wall_s"] for x in runs[n]]) for n in names}
    sweep_s = {n: report.median([x["sweep_s"] for x in runs[n]]) for n in names}
    rows = []
    for n in names:
        bests = [f"lr {x['best']['lr']:g} w {x['best']['width']}" for x in runs[n]]
        rows.append(
            [
                n,
                f"{wall[n]:.1f}",
                f"{wall[n] / wall['ray']:.2f}x" if "ray" in wall else "",
                f"{sweep_s[n]:.1f}",
                f"{report.median([x['epochs'] for x in runs[n]]):.0f}",
                f"{report.median([x['stopped'] for x in runs[n]]):.0f}",
                "; ".join(bests),
                f"{100 * report.median([x['best_metric'] for x in runs[n]]):.1f}%",
            ]
        )
    table = report.table(
        [
            "contender",
            "wall s (process)",
            "vs Ray Tune",
            "sweep s",
            "epochs trained",
            "trials stopped",
            "best config per round",
            "best val acc",
        ],
        rows,
    )
    lines = [
        "## Hyperparameter sweep: ddlf.sweep vs Ray Tune vs one process",
        "",
        f"Command: `python -m benchmarks sweep --repeats {args.repeats}` ({args.epochs} epochs at most, rf "
        f"{args.rf:g}, grace 1 epoch, {args.rows} MNIST rows, {args.val_rows} validation rows, batch {args.batch}, "
        f"{args.workers} concurrent trials with {threads} math thread(s) each, Keras on {args.backend}).",
        f"Machine: {report.machine()}.",
        "",
        "16 trials (learning rate {3e-4, 1e-3, 3e-3, 1e-2} x hidden width {16, 32, 64, 128}) of a one-hidden-layer "
        "MLP, one worker per trial, the same ASHA cut in all three; each contender a fresh process, rounds "
        f"interleaved, medians of {args.repeats}. Wall: process start to exit. Sweep: the sweep call alone.",
        "",
        table,
    ]
    if "ray" in wall and "ddlf" in wall:
        lines += [
            "",
            f"Target (issue 16): ddlf at most 0.8x Ray Tune's wall time: {wall['ddlf'] / wall['ray']:.2f}x "
            f"(sweep alone {sweep_s['ddlf'] / sweep_s['ray']:.2f}x).",
        ]
    path = report.write_section("sweep", "\n".join(lines))
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
