"""The README's demo against single-process Keras: what a new user gets on this machine.

    .venv/bin/python -m benchmarks demo [--epochs 3] [--repeats 2]

The demo is ``examples/mnist_sync.py`` run as ``scripts/demo.sh`` runs it: a fresh process with the user's
environment (no ``KERAS_BACKEND``: ddlf's default backend), a local 2-worker cluster, the paper's CNN on the 60,000
MNIST training images, batch 32 per worker, synchronous averaging every 50 batches, validation on the 10,000 test
images after each epoch. Its seconds per epoch are the History's. Against it, in fresh processes and alternated with
it: the same model on the same data with ``model.fit`` in one process using every core (batch 32, shuffled, the
same validation data), on each installed Keras backend. Reported: the median of the epochs after the first (the
first includes tracing and, for the demo, starting the workers), the first epoch, test accuracy, and the demo's
steady epoch against the fastest backend's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import report
from .backends import fit_epochs

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def fit_case(epochs: int, batch: int) -> dict[str, Any]:
    """In this (fresh) process: the demo's model and data with ``model.fit`` on every core."""
    import keras
    import numpy as np

    sys.path.insert(0, str(EXAMPLES))
    import ddlf
    from mnist_common import DATA, MnistApp

    (x, y), (xt, yt) = ddlf.datasets.mnist(DATA)
    prep = lambda a: (a.astype(np.float32) / 255.0)[..., None]  # noqa: E731 - as MnistApp.preprocess
    model = MnistApp.create_model(None)  # type: ignore[arg-type]  # builds from nothing on the app
    seconds = fit_epochs(
        model, prep(x), y, batch_size=batch, epochs=epochs, shuffle=True, validation_data=(prep(xt), yt), verbose=0
    )
    _, acc = model.evaluate(prep(xt), yt, verbose=0)
    return {"backend": keras.backend.backend(), "epoch_s": seconds, "accuracy": float(acc)}


def demo_case(epochs: int) -> dict[str, Any]:
    """The demo in a fresh process, as a user runs it; its epochs' seconds and test accuracy from its output."""
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "mnist_sync.py"), "--epochs", str(epochs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if out.returncode != 0:
        sys.stderr.write(out.stderr[-3000:])
        return {"error": (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]}
    seconds = re.search(r"seconds per epoch: (\[.*\])", out.stdout)
    acc = re.search(r"test accuracy: ([0-9.]+)", out.stdout)
    backend = re.search(r"backend: (\w+)", out.stdout)
    if not (seconds and acc):
        return {"error": f"unexpected output: {out.stdout[-500:]}"}
    return {
        "backend": backend.group(1) if backend else "?",
        "epoch_s": json.loads(seconds.group(1)),
        "accuracy": float(acc.group(1)),
        "wall_s": time.perf_counter() - t0,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks demo", description=__doc__)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--case", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case:
        print(json.dumps(fit_case(args.epochs, args.batch)))
        return
    from ddlf.frameworks.keras_backend import installed_keras_backends

    t_start = time.perf_counter()
    backends = installed_keras_backends()
    runs: dict[str, list[dict[str, Any]]] = {"demo": [], **{b: [] for b in backends}}
    for r in range(args.repeats):
        order = ["demo", *backends]
        for which in order if r % 2 == 0 else order[::-1]:
            if which == "demo":
                res = demo_case(args.epochs)
            else:
                cmd = [sys.executable, "-m", "benchmarks", "demo", "--case", which, "--epochs", str(args.epochs)]
                cmd += ["--batch", str(args.batch)]
                env = {**os.environ, "KERAS_BACKEND": which, "TF_CPP_MIN_LOG_LEVEL": "3"}
                res = report.json_case(cmd, env)
            print(which, res, flush=True)
            runs[which].append(res)
    summary: dict[str, dict[str, Any]] = {}
    for which, results in runs.items():
        ok = [r for r in results if "error" not in r]
        if ok:
            summary[which] = {
                "steady": report.median([report.median(r["epoch_s"][1:] or r["epoch_s"]) for r in ok]),
                "first": report.median([r["epoch_s"][0] for r in ok]),
                "accuracy": report.median([r["accuracy"] for r in ok]),
                "backend": ok[0]["backend"],
            }
    fits = {b: s for b, s in summary.items() if b != "demo"}
    fastest = min(fits, key=lambda b: fits[b]["steady"]) if fits else None
    rows = []
    for which, s in summary.items():
        label = (
            f"demo: `scripts/demo.sh` (2 local workers, Keras on {s['backend']})"
            if which == "demo"
            else (f"one process, `model.fit`, Keras on {which}")
        )
        ratio = s["steady"] / fits[fastest]["steady"] if fastest else float("nan")
        rows.append([label, f"{s['steady']:.2f}", f"{ratio:.2f}x", f"{s['first']:.2f}", f"{100 * s['accuracy']:.2f}%"])
    for which, results in runs.items():
        if which not in summary:
            rows.append([which, "failed: " + results[0]["error"], "", "", ""])
    verdict = ""
    if "demo" in summary and fastest:
        r = summary["demo"]["steady"] / fits[fastest]["steady"]
        verdict = f"The demo's steady epoch is **{r:.2f}x** one process on the fastest backend here ({fastest})."
    body = "\n".join(
        [
            "## The demo against single-process Keras (`python -m benchmarks demo`)",
            "",
            f"`python -m benchmarks demo --epochs {args.epochs} --repeats {args.repeats}` · {report.machine()} · "
            f"{time.perf_counter() - t_start:.0f} s",
            "",
            f"The paper's CNN on the 60,000 MNIST training images, {args.epochs} epochs, batch {args.batch} (per "
            "worker in the demo, which averages every 50 batches), validated on the 10,000 test images each "
            f"epoch. Fresh processes, alternated, medians of {args.repeats}; *steady*: the median of the epochs "
            "after the first.",
            "",
            report.table(["run", "steady s/epoch", "vs fastest one process", "first epoch s", "test accuracy"], rows),
            "",
            verdict,
        ]
    )
    print(body)
    report.write_section("demo", body)


if __name__ == "__main__":
    main()
