"""Small models: is ddlf's per-round overhead small enough that a 100k-parameter MLP trains as fast as one process?

The model: 784 -> 128 -> 10 (101,770 parameters, 0.4 MB of float32 weights), Adam, on the first 12,000 MNIST rows,
batch 32. One process runs ``model.fit`` on all the rows (every core); ddlf trains on 2 local workers in sync mode
(averaging every 50 batches) and in async mode, each worker on half the rows. Every case is a fresh process on every
installed Keras backend for one process, and ddlf on the default backend (what a new user gets) and on the fastest
one-process backend; cases alternate over the repeats, so the ratios are side by side. "s/epoch" is the median of the
epochs after the first (which traces and compiles); the ratio is against the fastest one-process run. ddlf's split: of
a steady epoch, the share the slowest worker spent computing (``history.stats``) and the rest (dispatch, weights in
and out, averaging).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from ddlf.frameworks.keras_backend import installed_keras_backends

from . import report
from .backends import DATA, fit_epochs

MODES = ("single", "sync", "async")
DEFAULTS = ("sync-default", "async-default")
"""Cases timed whole, start-up included: the first ``train()`` of the app on a warm cluster with the strategy a user
gets (``strategy=None``: scaled gradient averaging; ``Asynchronous()``: its default chunk), against ``model.fit``
from building the model to its last epoch."""


def _build() -> Any:
    import keras
    from keras import layers

    net = keras.Sequential(
        [keras.Input(shape=(784,)), layers.Dense(128, activation="relu"), layers.Dense(10, activation="softmax")]
    )
    net.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return net


def _data(rows: int) -> tuple[Any, Any, Any, Any]:
    import ddlf

    (x, y), (xt, yt) = ddlf.datasets.mnist(DATA)
    return x[:rows], y[:rows], xt[:2000], yt[:2000]


def _flat(x: Any) -> Any:
    return x.reshape(len(x), -1).astype("float32") / 255.0


def run_case(mode: str, rows: int, epochs: int, batch: int) -> dict[str, Any]:
    import keras

    import ddlf

    x, y, xt, yt = _data(rows)
    keras.utils.set_random_seed(0)
    if mode == "single":
        t0 = time.perf_counter()  # Keras imported and the rows in memory: from building the model on
        net = _build()
        seconds = fit_epochs(net, _flat(x), y, batch_size=batch, epochs=epochs, verbose=0)
        total = time.perf_counter() - t0
        _, acc = net.evaluate(_flat(xt), yt, verbose=0)
        return {"seconds": seconds, "total": total, "accuracy": float(acc), "backend": keras.backend.backend()}

    class SmallMlp(ddlf.IApp):
        dataset_key = f"smallmodel-mnist-{rows}"

        def load_dataset(self) -> Any:
            return _data(rows)[:2]

        def preprocess(self, x: Any, y: Any) -> Any:
            return _flat(x), y

        def create_model(self) -> Any:
            return _build()

    if mode in DEFAULTS:
        with ddlf.Cluster.local(2) as cluster:
            cluster.run(time.time)  # a warm cluster: the daemons listen and have preloaded Keras
            t0 = time.perf_counter()  # the whole first train(): the workers load the dataset, build and trace
            app = SmallMlp(cluster)
            strategy = ddlf.Asynchronous() if mode == "async-default" else None
            h = app.train(epochs=epochs, batch_size=batch, strategy=strategy, verbose=0)
            total = time.perf_counter() - t0
            _, acc = app.evaluate(xt, yt)
        return {"seconds": list(h.epoch_seconds), "total": total, "accuracy": float(acc)}

    with ddlf.Cluster.local(2) as cluster:
        app = SmallMlp(cluster)
        app.train(epochs=0, verbose=0)  # load the dataset (not timed: the single process has it in memory too)
        strategy = ddlf.Asynchronous(chunk=50) if mode == "async" else ddlf.ModelAveraging(every=50)
        h = app.train(epochs=epochs, batch_size=batch, strategy=strategy, verbose=0)
        _, acc = app.evaluate(xt, yt)
    compute: list[float] = []
    for e in range(epochs):
        per_worker: dict[int, float] = {}
        for s in h.stats:
            if s.epoch == e:
                per_worker[s.worker] = per_worker.get(s.worker, 0.0) + s.compute_seconds
        compute.append(max(per_worker.values(), default=0.0))
    return {"seconds": list(h.epoch_seconds), "compute": compute, "accuracy": float(acc)}


def _subprocess_case(mode: str, args: argparse.Namespace, backend: str | None = None) -> dict[str, Any]:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("KERAS_BACKEND", None)
    if backend is not None:
        env["KERAS_BACKEND"] = backend
    cmd = [sys.executable, "-m", "benchmarks.smallmodel", "--case", mode]
    cmd += ["--rows", str(args.rows), "--epochs", str(args.epochs), "--batch", str(args.batch)]
    out = report.json_case(cmd, env, timeout=1800)
    if "error" in out:
        raise SystemExit(f"case {mode} failed: {out['error']}")
    return out


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks smallmodel", description=__doc__)
    p.add_argument("--rows", type=int, default=12_000)
    p.add_argument("--epochs", type=int, default=4, help="epochs per case (the first includes compiling)")
    p.add_argument("--batch", type=int, default=32, help="batch size (per worker in ddlf)")
    p.add_argument("--repeats", type=int, default=2, help="fresh processes per mode, alternating")
    p.add_argument("--case", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(args.case, args.rows, args.epochs, args.batch)))
        return
    backends = installed_keras_backends()
    # (mode, backend) -> runs; ddlf runs on the default backend and on the fastest one-process backend.
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}

    def case(mode: str, backend: str | None) -> dict[str, Any]:
        out = _subprocess_case(mode, args, backend)
        runs.setdefault((mode, backend or default), []).append(out)
        print(mode, backend or default, out, flush=True)
        return out

    def steady(xs: list[float]) -> float:
        return report.median(xs[1:] or xs)

    first = _subprocess_case("single", args, None)
    default = first["backend"]
    runs[("single", default)] = [first]
    print("single", default, first, flush=True)
    for b in backends:
        if b != default:
            case("single", b)
    one = {b: report.median([steady(o["seconds"]) for o in runs[("single", b)]]) for b in backends}
    fastest_backend = min(one, key=one.__getitem__)
    ddlf_backends = [default] + ([fastest_backend] if fastest_backend != default else [])
    for r in range(args.repeats):
        order = [("single", b) for b in backends] + [(m, b) for b in ddlf_backends for m in MODES[1:] + DEFAULTS]
        for mode, b in order if r % 2 == 0 else order[::-1]:
            if r == 0 and mode == "single":
                continue  # ran above, to find the fastest backend
            case(mode, None if b == default else b)
    one = {b: report.median([steady(o["seconds"]) for o in runs[("single", b)]]) for b in backends}
    fastest = min(one.values())
    rows = []
    for b in backends:
        acc = report.median([o["accuracy"] for o in runs[("single", b)]])
        label = f"one process, `model.fit`, {b}" + (" (the default)" if b == default else "")
        rows.append([label, f"{one[b]:.3f}", f"{one[b] / fastest:.2f}x", "-", "-", f"{100 * acc:.1f}%"])
    for b in ddlf_backends:
        for mode in MODES[1:]:
            rs = runs[(mode, b)]
            sec = report.median([steady(o["seconds"]) for o in rs])
            acc = report.median([o["accuracy"] for o in rs])
            c = report.median([steady(o["compute"]) for o in rs])
            rows.append(
                [
                    f"ddlf {mode}, 2 local workers, {b}",
                    f"{sec:.3f}",
                    f"{sec / fastest:.2f}x",
                    f"{sec / one[b]:.2f}x",
                    f"{c:.3f} ({100 * c / sec:.0f}%)",
                    f"{100 * acc:.1f}%",
                ]
            )
    totals = []
    for b in ddlf_backends:
        fit_total = report.median([o["total"] for o in runs[("single", b)]])
        totals.append([f"one process, `model.fit`, {b}", f"{fit_total:.2f}", "1.00x", "-"])
        for mode in DEFAULTS:
            rs = runs[(mode, b)]
            t = report.median([o["total"] for o in rs])
            acc = report.median([o["accuracy"] for o in rs])
            label = "`strategy=None` (gradient averaging)" if mode == "sync-default" else "`Asynchronous()`"
            totals.append(
                [
                    f"ddlf {label}, first `train()` on a warm cluster, {b}",
                    f"{t:.2f}",
                    f"{t / fit_total:.2f}x",
                    f"{100 * acc:.1f}%",
                ]
            )
    totals_tbl = report.table(["run", f"total s ({args.epochs} epochs)", "vs `model.fit`", "test accuracy"], totals)
    tbl = report.table(
        [
            "run",
            "s/epoch",
            "vs fastest one process",
            "vs one process, same backend",
            "worker compute s (share)",
            "test accuracy",
        ],
        rows,
    )
    body = f"""## Small models: per-round overhead (`python -m benchmarks smallmodel`)

{report.machine()}; Keras's default backend here: {default}

`python -m benchmarks smallmodel --rows {args.rows} --epochs {args.epochs} --batch {args.batch} --repeats \
{args.repeats}`: a 784-128-10 MLP (101,770 parameters), Adam, the first {args.rows:,} MNIST rows, batch {args.batch}
(per worker in ddlf; sync averages every 50 batches). Each case a fresh process, modes alternating; s/epoch is the
median over epochs after the first and over {args.repeats} processes. *worker compute*: of a ddlf epoch, what the
slowest worker spent in its training calls; the rest is ddlf's (dispatch, weights, averaging, waiting).
Target (issue 21): at most 1.3x one process in both modes.

{tbl}

Start-up included (issue 62: at most 1.2x `fit` in both modes), the defaults a user gets: the whole first
`app.train(epochs={args.epochs}, batch_size={args.batch})` on a warm 2-worker cluster (daemons started, Keras
preloaded; the workers load the dataset, build and trace within it), against one process from building the model
to the end of `fit` (Keras imported and the rows in memory before either clock starts). Medians over
{args.repeats} processes.

{totals_tbl}
"""
    report.write_section("smallmodel", body)
    print(body)


if __name__ == "__main__":
    main(sys.argv[1:])
