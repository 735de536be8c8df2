"""A scaling curve on one many-core machine: 1, 2, 4, 8 local CPU workers (the cores split evenly among them)
against one process on all the cores, the paper's CNN on MNIST, for model averaging over the master exchange and
over the ring (``exchange="allreduce"``) and for gradient averaging (``averaging="gradients"``): samples per second
of a steady epoch, the ratio to one process, and test accuracy. Each case runs in its own process, one after
another in one invocation."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from . import report
from .backends import _data, build, fit_epochs, shape_inputs

VARIANTS = ("master", "allreduce", "gradients")


def _strategy(variant: str, every: int) -> Any:
    """The ``train`` strategy of a variant, averaging (or checking in) every ``every`` batches."""
    import ddlf

    if variant == "allreduce":
        return ddlf.ModelAveraging(every=every, exchange=ddlf.Ring())
    if variant == "gradients":
        return ddlf.GradientAveraging(check_in_every=every)
    return ddlf.ModelAveraging(every=every)


def run_case(variant: str, workers: int, rows: int, epochs: int, batch: int, frequency: int) -> dict[str, Any]:
    import keras

    x, y, xt, yt = _data(rows)
    keras.utils.set_random_seed(0)
    if variant == "single":
        net = build("cnn")
        seconds = fit_epochs(net, shape_inputs("cnn", x), y, batch_size=batch, epochs=epochs, verbose=0)
        _, acc = net.evaluate(shape_inputs("cnn", xt), yt, verbose=0)
        return {"seconds": seconds, "accuracy": float(acc)}
    import ddlf

    from .backends import _make_app

    cores = len(os.sched_getaffinity(0))
    with ddlf.Cluster.local(workers, threads=max(1, cores // workers)) as cluster:
        app = _make_app("cnn", rows)(cluster)
        app.train(epochs=0, verbose=0)
        h = app.train(epochs=epochs, batch_size=batch, strategy=_strategy(variant, frequency), verbose=0)
        _, acc = app.evaluate(xt, yt)
    return {"seconds": list(h.epoch_seconds), "accuracy": float(acc)}


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks scaling", description=__doc__)
    p.add_argument("--rows", type=int, default=20_000)
    p.add_argument("--epochs", type=int, default=2, help="the first includes compiling; the rest are steady")
    p.add_argument("--batch", type=int, default=32, help="per worker")
    p.add_argument("--frequency", type=int, default=10, help="batches per round (model averaging)")
    p.add_argument("--workers", default="1,2,4,8")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--case", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case:
        variant, n = args.case[0], int(args.case[1])
        print(json.dumps(run_case(variant, n, args.rows, args.epochs, args.batch, args.frequency)))
        return
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "", "JAX_PLATFORMS": "cpu"}
    common = ["--rows", str(args.rows), "--epochs", str(args.epochs), "--batch", str(args.batch)]
    common += ["--frequency", str(args.frequency)]

    def case(variant: str, n: int) -> dict[str, Any]:
        cmd = [sys.executable, "-m", "benchmarks.scaling", "--case", variant, str(n), *common]
        r = report.json_case(cmd, env)
        print(variant, n, r, flush=True)
        return r

    def rate(r: dict[str, Any]) -> float:
        return args.rows / report.median(r["seconds"][1:] or r["seconds"])

    single = case("single", 1)
    base = rate(single) if "seconds" in single else float("nan")
    rows = [["one process", "-", f"{base:,.0f}", "1.00x", "", f"{100 * single.get('accuracy', float('nan')):.1f}%"]]
    for variant in args.variants.split(","):
        first = None
        for n in (int(w) for w in args.workers.split(",")):
            r = case(variant, n)
            if "error" in r:
                rows.append([variant, n, r["error"][:80], "", "", ""])
                continue
            thr = rate(r)
            first = first or thr
            rows.append(
                [variant, n, f"{thr:,.0f}", f"{thr / base:.2f}x", f"{thr / first:.2f}x", f"{100 * r['accuracy']:.1f}%"]
            )
    cores = len(os.sched_getaffinity(0))
    body = (
        "## Scaling on one many-core machine: local CPU workers against one process\n\n"
        f"`python -m benchmarks scaling` (Keras on {os.environ.get('KERAS_BACKEND', 'the default backend')}, CPU; "
        f"the paper's CNN, MNIST {args.rows:,} rows, {args.epochs} epochs, batch {args.batch} per worker, "
        f"{cores} cores split evenly among the workers; model averaging every {args.frequency} batches), on: "
        + report.machine()
        + "\n\n"
        + report.table(
            ["exchange", "workers", "samples/s (steady epoch)", "vs one process", "vs 1 worker", "test accuracy"],
            rows,
        )
        + "\n"
    )
    print(body)
    report.write_section("scaling", body)


if __name__ == "__main__":
    main(sys.argv[1:])
