"""Exact sync at the speed of model averaging: gradient averaging against model averaging on loopback.

    .venv/bin/python -m benchmarks exactsync [--repeats 3] [--epochs 3] [--rows 12000]

The wide MLP (784-2048-2048-10, 23 MB of float32 weights), Adam, MNIST rows, 2 local workers at batch 64 each;
steady seconds per epoch (the median of the epochs after the first) of:

* ``single``: ``model.fit`` in one process at the global batch (128): the work without any exchange;
* ``ma-10``: :class:`ddlf.ModelAveraging` every 10 batches on the ring;
* ``ga``: :class:`ddlf.GradientAveraging` with its defaults (on TensorFlow the reduction runs inside the step's
  graph, bucket by bucket, while backward continues: ``training/replica/graph_buckets.py``);
* ``ga-buffer``: the same with ``bucket_cap_mb=None``: the gradients handed to Python, reduced in one buffer,
  and handed back (the path before the in-graph exchange).

Each case runs in a fresh process; the cases alternate within each repeat (the order rotating), so the ratios
are measured side by side on a shared machine. The table gives medians over the repeats and the ratios of the
medians.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

from . import report

CASES = ("single", "ma-10", "ga", "ga-buffer")
BATCH = 64
WORKERS = 2


def _data_dir() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "data", "mnist")


def _model() -> Any:
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input(shape=(784,)),
            keras.layers.Dense(2048, activation="relu"),
            keras.layers.Dense(2048, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def _rows(rows: int) -> tuple[np.ndarray, np.ndarray]:
    import ddlf

    (x, y), _ = ddlf.datasets.mnist(_data_dir())
    return x[:rows], y[:rows]


def _prepare(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return x.reshape(len(x), -1).astype(np.float32) / 255.0, y


def run_case(case: str, rows: int, epochs: int) -> dict[str, Any]:
    """One case in this process: seconds of each epoch."""
    if case == "single":
        from .backends import fit_epochs

        x, y = _prepare(*_rows(rows))
        return {"seconds": fit_epochs(_model(), x, y, batch_size=BATCH * WORKERS, epochs=epochs, verbose=0)}
    import ddlf

    class WideMlp(ddlf.IApp):
        dataset_key = f"bench-exactsync-{rows}"

        def load_dataset(self) -> Any:
            return _rows(rows)

        def preprocess(self, bx: Any, by: Any) -> Any:
            return _prepare(bx, by)

        def create_model(self) -> Any:
            return _model()

    strategy: Any = {
        "ma-10": ddlf.ModelAveraging(every=10),
        "ga": ddlf.GradientAveraging(),
        "ga-buffer": ddlf.GradientAveraging(bucket_cap_mb=None),
    }[case]
    with ddlf.Cluster.local(WORKERS) as cluster:
        app = WideMlp(cluster)
        app.train(epochs=0, verbose=0)  # load the dataset (not timed: one process has it in memory)
        h = app.train(epochs=epochs, batch_size=BATCH, strategy=strategy, verbose=0)
    return {"seconds": list(h.epoch_seconds)}


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks exactsync", description=__doc__)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3, help="epochs per case (the first includes tracing)")
    p.add_argument("--rows", type=int, default=12_000)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--case", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(args.case, args.rows, args.epochs)))
        return
    cases = args.cases.split(",")
    t0 = time.perf_counter()
    steady: dict[str, list[float]] = {c: [] for c in cases}
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    for r in range(args.repeats):
        for c in cases[r % len(cases) :] + cases[: r % len(cases)]:
            cmd = [sys.executable, "-m", "benchmarks.exactsync", "--case", c]
            cmd += ["--rows", str(args.rows), "--epochs", str(args.epochs)]
            out = report.json_case(cmd, env)
            if "error" in out:
                sys.exit(f"case {c} failed: {out['error']}")
            steady[c].append(report.median(out["seconds"][1:] or out["seconds"]))
            print(f"repeat {r} {c}: {[round(s, 2) for s in out['seconds']]}", flush=True)
    med = {c: report.median(v) for c, v in steady.items()}
    ma = med.get("ma-10")
    one = med.get("single")
    rows = [
        [
            c,
            f"{med[c]:.2f}",
            " / ".join(f"{s:.2f}" for s in steady[c]),
            f"{med[c] / ma:.2f}x" if ma else "",
            f"{med[c] / one:.2f}x" if one else "",
        ]
        for c in cases
    ]
    body = (
        "## Exact sync against model averaging (`python -m benchmarks exactsync`)\n\n"
        f"`python -m benchmarks exactsync --repeats {args.repeats} --epochs {args.epochs} --rows {args.rows}` · "
        f"{report.machine()} · {time.perf_counter() - t0:.0f} s\n\n"
        f"The wide MLP (784-2048-2048-10, 23 MB of float32 weights), Adam, {args.rows:,} MNIST rows, "
        f"{WORKERS} local workers at batch {BATCH} each (one process: batch {BATCH * WORKERS}). Steady seconds per "
        f"epoch (median of the epochs after the first), medians over {args.repeats} repeats, each case a fresh "
        "process, the cases alternating. *single*: `model.fit` in one process; *ma-10*: `ModelAveraging(every=10)`; "
        "*ga*: `GradientAveraging()` (on TensorFlow the reduction runs inside the step's graph); *ga-buffer*: "
        "`GradientAveraging(bucket_cap_mb=None)`, the gradients reduced in one buffer in Python after the step.\n\n"
        + report.table(["case", "s/epoch", "each repeat", "vs ma-10", "vs single"], rows)
        + "\n"
    )
    print(body)
    report.write_section("exactsync", body)


if __name__ == "__main__":
    main(sys.argv[1:])
