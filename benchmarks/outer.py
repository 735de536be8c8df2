"""The outer optimizer against plain model averaging: test accuracy after the same epochs, and bytes on the wire.

    .venv/bin/python -m benchmarks outer [--workers 2] [--epochs 2] [--repeats 2]

The paper's CNN on 12,000 MNIST rows (the ``cnn`` task of :mod:`benchmarks.averaging`: Adam 1e-3, batch 32 per
worker), ddlf sync on local workers with the master exchange, each case in its own process, one after another:

* averaging every 10 batches (the usual setting), every 100 batches, both as plain model averaging;
* averaging every 100 batches with ``outer_optimizer="nesterov"`` (DiLoCo's learning rate 0.7, momentum 0.9).

Bytes on the wire are what the master sent and received over the run (``history.stats``): the weights each round,
so a tenth of the rounds is a tenth of the bytes. Accuracies are medians over ``--repeats`` seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

from . import report
from .averaging import build, data, prepare

CASES = {  # label -> (batches per round, outer optimizer)
    "every 10 batches": (10, None),
    "every 100 batches": (100, None),
    "every 100 batches, Nesterov outer step": (100, "nesterov"),
}


def run_case(label: str, n: int, epochs: int, seed: int) -> dict[str, Any]:
    import ddlf

    frequency, outer = CASES[label]
    _, _, xt, yt = data("cnn")

    class Cnn(ddlf.IApp):
        dataset_key = "outer-bench-cnn"

        def load_dataset(self) -> Any:
            return data("cnn")[:2]

        def preprocess(self, bx: Any, by: Any) -> Any:
            return prepare("cnn", bx), by

        def create_model(self) -> Any:
            return build("cnn")

    with ddlf.Cluster.local(n) as cluster:
        app = Cnn(cluster)
        app.train(epochs=0, verbose=0)
        h = app.train(
            epochs=epochs,
            batch_size=32,
            verbose=0,
            strategy=ddlf.ModelAveraging(every=frequency, outer=ddlf.Nesterov() if outer == "nesterov" else None),
            run=ddlf.RunConfig(seed=seed),
        )
        _, acc = app.evaluate(xt, yt)
    wire = sum(s.bytes_sent + s.bytes_received for s in h.stats)
    return {"accuracy": float(acc), "bytes": wire, "rounds": len({(s.epoch, s.round) for s in h.stats})}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks outer", description=__doc__)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--case", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case:
        label, seed = args.case
        print(json.dumps(run_case(label, args.workers, args.epochs, int(seed))))
        return
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    rows = []
    for label in CASES:
        accs, wire, rounds = [], 0, 0
        for seed in range(args.repeats):
            cmd = [sys.executable, "-m", "benchmarks.outer", "--case", label, str(seed)]
            cmd += ["--workers", str(args.workers), "--epochs", str(args.epochs)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if out.returncode != 0:
                sys.stderr.write(out.stderr[-3000:])
                raise SystemExit(f"{label}: exit {out.returncode}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            accs.append(r["accuracy"])
            wire, rounds = r["bytes"], r["rounds"]
        print(label, accs, wire, flush=True)
        rows.append(
            [
                label,
                f"{100 * report.median(accs):.1f}%",
                f"{100 * min(accs):.1f}-{100 * max(accs):.1f}",
                rounds,
                f"{wire / 1e6:,.1f}",
            ]
        )
    import keras

    body = (
        "## Outer optimizer: averaging 10x less often (`python -m benchmarks outer`)\n\n"
        f"`python -m benchmarks outer --workers {args.workers} --epochs {args.epochs} --repeats {args.repeats}` "
        f"(Keras on {keras.backend.backend()}; the paper's CNN, 12,000 MNIST rows, Adam 1e-3, batch 32 per worker, "
        f"{args.workers} local workers, master exchange; test accuracy on 2,000 test images after {args.epochs} "
        "epochs, median over seeds), on: "
        + report.machine()
        + "\n\n"
        + report.table(["averaging", "test accuracy (median)", "range", "rounds", "MB on the wire (master)"], rows)
        + "\n"
    )
    print(body)
    report.write_section("outer", body)


if __name__ == "__main__":
    main()
