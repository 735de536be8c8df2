"""Warm start: how long until training can take its first step, for the paper's CNN on 2 local workers. From a
fresh script (daemons started, Keras imported, dataset loaded, models built), with and without the daemons
preloading Keras, and on a warm cluster (dataset cached, Keras loaded); then the first epoch against the next.
Each configuration runs in a fresh process, in one invocation."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from . import report


def _case(preload: bool, rows: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    sys.path.insert(0, os.path.join(os.getcwd(), "examples"))
    import mnist_common  # noqa: I001 (from examples/, after the path is set)

    import ddlf

    out: dict[str, Any] = {}
    with ddlf.Cluster.local(2, preload="keras" if preload else None) as cluster:
        out["daemons_up_s"] = time.perf_counter() - t0
        app = mnist_common.MnistApp(cluster)
        app.limit, app.dataset_key = rows, f"mnist-v1-first-{rows}"
        t1 = time.perf_counter()
        app.train(epochs=0, verbose=0)
        out["first_ready_s"] = time.perf_counter() - t1
        out["script_to_ready_s"] = time.perf_counter() - t0
        warm = []
        for _ in range(3):
            again = mnist_common.MnistApp(cluster)
            again.limit, again.dataset_key = rows, f"mnist-v1-first-{rows}"
            t2 = time.perf_counter()
            again.train(epochs=0, verbose=0)
            warm.append(time.perf_counter() - t2)
        out["warm_ready_s"] = report.median(warm)
        h = again.train(epochs=3, verbose=0)
        out["epochs_s"] = list(h.epoch_seconds)
        # A second training run of the same architecture: the workers lend it the first run's traced model.
        second = mnist_common.MnistApp(cluster)
        second.limit, second.dataset_key = rows, f"mnist-v1-first-{rows}"
        h = second.train(epochs=3, verbose=0)
        out["second_epochs_s"] = list(h.epoch_seconds)
        t_end = time.perf_counter()
    out["close_s"] = time.perf_counter() - t_end  # the daemons shut down and exited
    return out


def _bare_exit_s() -> float:
    """Seconds a bare ``python -c "import keras"`` takes to exit after its last line: the interpreter's
    finalization with the framework loaded, which a daemon's exit skips (``ddlf.worker.main.exit_quickly``)."""
    code = "import keras, time; keras.backend.backend(); print(time.time(), flush=True)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    return time.time() - float(done.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks warmstart", description=__doc__)
    p.add_argument("--rows", type=int, default=6000, help="MNIST training rows for the epoch timings")
    p.add_argument("--case", choices=["preload", "nopreload"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case:
        print(json.dumps(_case(args.case == "preload", args.rows)))
        return
    results = {}
    for case in ("preload", "nopreload", "preload", "nopreload"):  # interleaved, two of each
        cmd = [sys.executable, "-m", "benchmarks.warmstart", "--case", case, "--rows", str(args.rows)]
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=1800, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
        )
        if done.returncode != 0:
            raise SystemExit(done.stderr[-3000:])
        results.setdefault(case, []).append(json.loads(done.stdout.strip().splitlines()[-1]))
    bare_exit = report.median([_bare_exit_s() for _ in range(3)])
    backend = subprocess.run(
        [sys.executable, "-c", "from ddlf.frameworks.keras_backend import keras_backend_default as k; print(k())"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    rows = []
    for case, runs in results.items():
        med = {
            k: report.median([r[k] for r in runs])
            for k in ("daemons_up_s", "first_ready_s", "script_to_ready_s", "warm_ready_s", "close_s")
        }
        first = report.median([r["epochs_s"][0] for r in runs])
        later = report.median([report.median(r["epochs_s"][1:]) for r in runs])
        first2 = report.median([r["second_epochs_s"][0] for r in runs])
        later2 = report.median([report.median(r["second_epochs_s"][1:]) for r in runs])
        rows.append(
            [
                "daemons preload Keras" if case == "preload" else "no preload",
                f"{med['daemons_up_s']:.2f}",
                f"{med['first_ready_s']:.2f}",
                f"{med['script_to_ready_s']:.2f}",
                f"{med['warm_ready_s']:.2f}",
                f"{first:.2f} / {later:.2f}",
                f"{first2:.2f} / {later2:.2f}",
                f"{med['close_s']:.2f}",
            ]
        )
    table = report.table(
        [
            "daemons",
            "Cluster.local s",
            "first train() to ready s",
            "script start to ready s",
            "warm train() to ready s (target 0.5)",
            "epoch 1 / later s/epoch",
            "second train(), warm model: epoch 1 / later s/epoch",
            "close s",
        ],
        rows,
    )
    body = f"""## Warm start (`python -m benchmarks warmstart`)

{report.machine()}; Keras backend {backend}

The paper's CNN, 2 local workers, the first {args.rows:,} MNIST rows. "Ready" is `app.train(epochs=0)` returning:
the dataset is in every worker's store and every worker has built its model. "Warm" is a new app on the same
cluster (dataset cached, Keras loaded): median of 3. The epoch columns are a 3-epoch run on the warm cluster: the
first epoch includes the framework's tracing and compiling. "Second train()" is another 3-epoch run of a new app
with the same model on the same cluster: each worker lends it the first run's traced model (`training.replica.warm`),
so its first epoch has nothing to trace. "Close" is leaving the cluster's `with` block: the daemons shut down and
exit; for scale, in the same run a bare `python -c "import keras"` took {bare_exit:.2f} s to exit after its last line
(the interpreter's finalization, which the daemons skip: `ddlf.worker.main.exit_quickly`). Medians of 2 fresh
processes per row, interleaved.

{table}
"""
    print(body)
    report.write_section("warmstart", body)


if __name__ == "__main__":
    main(sys.argv[1:])
