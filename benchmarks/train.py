"""Training: the paper's CNN on MNIST with 2 local workers. Accuracy in sync and async mode, overhead against a
single-process `model.fit`, start-up with a warm cache, a deliberately slowed worker, compression, thread caps."""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

import ddlf
from ddlf.cluster.cluster import Cluster
from ddlf.training.run import SLOW_WORKER_ENV

from . import report


def _app_module():
    examples = os.path.join(os.getcwd(), "examples")
    if not os.path.isdir(examples):
        raise SystemExit("run from the repository root (examples/ is needed)")
    sys.path.insert(0, examples)
    import mnist_common

    return mnist_common


def _single_process_epoch(mc, x, y, batch: int, seed: int) -> float:
    import keras

    keras.utils.set_random_seed(seed)
    app = mc.MnistApp(None)  # only create_model / preprocess are used
    model = app.create_model()
    xp, yp = app.preprocess(x, y)
    t0 = time.perf_counter()
    model.fit(xp, yp, batch_size=batch, epochs=1, verbose=0, shuffle=True)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks train", description=__doc__)
    p.add_argument("--epochs", type=int, default=10, help="epochs of the accuracy runs")
    p.add_argument("--batch", type=int, default=32, help="batch size per worker (Keras's default)")
    p.add_argument("--avg", type=int, default=50, help="sync averaging frequency (batches)")
    p.add_argument("--slow-ms", type=float, default=20.0, help="sleep per batch of the slowed worker")
    args = p.parse_args(argv)
    mc = _app_module()
    x_test, y_test = mc.test_data()
    (x, y), _ = __import__("ddlf").datasets.mnist(mc.DATA)
    out = [
        "## Training (the paper's CNN on MNIST, 2 local workers)",
        "",
        f"Command: `python -m benchmarks train --epochs {args.epochs} --batch {args.batch} --avg {args.avg} "
        f"--slow-ms {args.slow_ms:g}`  ",
        f"Machine: {report.machine()}",
        "",
    ]

    with Cluster.local(2) as cluster:
        app = mc.MnistApp(cluster)
        app.train(epochs=0, verbose=0)  # load the dataset into the workers' caches
        t0 = time.perf_counter()
        app.train(epochs=0, verbose=0)
        warm_start = time.perf_counter() - t0

        # Accuracy.
        acc_rows = []
        strategies = {"sync": ddlf.ModelAveraging(every=args.avg), "async": ddlf.Asynchronous()}
        for mode, strategy in strategies.items():
            app = mc.MnistApp(cluster)
            h = app.train(epochs=args.epochs, batch_size=args.batch, strategy=strategy, verbose=0)
            _, acc = app.evaluate(x_test, y_test)
            acc_rows.append(
                [mode, f"{100 * acc:.2f}%", f"{report.median(h.epoch_seconds):.1f}", f"{sum(h.epoch_seconds):.0f}"]
            )
        out += [
            f"### Test accuracy after {args.epochs} epochs (target: at least 99.0% in both modes)",
            "",
            report.table(["mode", "test accuracy", "median s/epoch", "total s"], acc_rows),
            "",
        ]

        # Overhead against single-process Keras, interleaved.
        ddlf_s, single_s = [], []
        for _ in range(2):
            app = mc.MnistApp(cluster)
            h = app.train(epochs=1, batch_size=args.batch, verbose=0, strategy=ddlf.ModelAveraging(every=args.avg))
            ddlf_s.append(h.epoch_seconds[0])
            single_s.append(_single_process_epoch(mc, x, y, args.batch, 0))
        d, s1 = report.median(ddlf_s), report.median(single_s)
        out += [
            "### Overhead against single-process `model.fit` (same data, same epochs, interleaved)",
            "",
            report.table(
                ["run", "s/epoch (median of 2)", "ratio"],
                [
                    ["single process, model.fit (all cores)", f"{s1:.1f}", "1.00x"],
                    ["ddlf sync, 2 local workers", f"{d:.1f}", f"{d / s1:.2f}x"],
                ],
            ),
            "",
            f"Time from `train()` to the first step with a warm dataset cache: {warm_start:.2f} s "
            "(workers build the model; the dataset is not reloaded).",
            "",
        ]

        # Slowed worker: sync waits for it every round, async does not.
        slow_rows = []
        os.environ[SLOW_WORKER_ENV] = f"1:{args.slow_ms / 1000}"  # worker 1 sleeps per batch in these runs
        for mode, strategy in strategies.items():
            app = mc.MnistApp(cluster)
            t0 = time.perf_counter()
            app.train(epochs=2, batch_size=args.batch, strategy=strategy, verbose=0)
            wall = time.perf_counter() - t0
            _, acc = app.evaluate(x_test, y_test)
            slow_rows.append([mode, f"{wall:.0f}", f"{100 * acc:.2f}%"])
        ratio = float(slow_rows[1][1]) / float(slow_rows[0][1])
        out += [
            f"### One worker slowed by {args.slow_ms:g} ms per batch, 2 epochs (target: async at least 25% "
            "sooner at equal accuracy)",
            "",
            report.table(["mode", "wall s", "test accuracy"], slow_rows),
            "",
            f"async / sync wall time: {ratio:.2f}",
            "",
        ]

        del os.environ[SLOW_WORKER_ENV]

        # Compression.
        comp_rows = []
        for comp in (None, "float16", "topk"):
            app = mc.MnistApp(cluster)
            exchange = ddlf.ThroughMaster(compression=ddlf.TopK(0.05) if comp == "topk" else comp)
            h = app.train(
                epochs=2,
                batch_size=args.batch,
                strategy=ddlf.ModelAveraging(every=args.avg, exchange=exchange),
                verbose=0,
            )
            _, acc = app.evaluate(x_test, y_test)
            back = np.mean([s.bytes_received for s in h.stats])
            sent = np.mean([s.bytes_sent for s in h.stats])
            comp_rows.append([comp or "none", f"{sent / 1e3:.0f}", f"{back / 1e3:.0f}", f"{100 * acc:.2f}%"])
        out += [
            "### Bytes per round per worker and accuracy after 2 epochs, by compression (topk ratio 0.05)",
            "",
            report.table(["compression", "KB master -> worker", "KB worker -> master", "test accuracy"], comp_rows),
            "",
        ]

    # Thread caps: 2 workers sharing 2 cores, capped to one math thread each vs each using every core.
    thr_rows = []
    for threads in (1, max(2, os.cpu_count() or 2)):
        with Cluster.local(2, threads=threads) as cluster:
            app = mc.MnistApp(cluster)
            h = app.train(epochs=1, batch_size=args.batch, verbose=0, strategy=ddlf.ModelAveraging(every=args.avg))
            thr_rows.append([f"threads={threads} per worker", f"{h.epoch_seconds[0]:.1f}"])
    out += [
        "### Math-library threads per worker (2 workers on this machine)",
        "",
        report.table(["setting", "s/epoch"], thr_rows),
        "",
        "The paper's own comparison, against elephas on Spark: `python -m benchmarks elephas` (its own section).",
    ]
    body = "\n".join(out)
    path = report.write_section("train", body)
    print(body)
    print(f"\nwritten to {path}")
