"""Soak, measured: ``python -m benchmarks soak`` has long-lived daemons serve hundreds of short training runs, each
from a fresh master process (as scripts and notebooks come and go on ``ddlf up`` workers), and records each
worker's resident memory, open file descriptors, threads and the host's shared-memory dataset files after every
run; writes RELIABILITY.md.

A daemon holds one Keras backend for life (and loads PyTorch's compiler before TensorFlow only when started so), so
each framework has its own two daemons: Keras on TensorFlow, Keras on JAX, and a ``TorchModel`` (``--preload
torch``). Runs cycle through model averaging, gradient averaging and asynchronous training, and every other run
ends with ``Cluster.reset()`` (the others leave their dataset cached and their model kept warm, as a script that
does not reset does). Each worker is sampled once it is idle, as it waits for the next script: a daemon hands the
memory its allocator keeps free for transfers back to the system ``ddlf.process.RETURN_AFTER_IDLE`` seconds after its
last run ends. Growth is measured from the state after the first 20 runs (imports, caches and the allocator's arenas
settle there) to the end: a leak grows with the runs, a warm-up does not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ddlf.process import RETURN_AFTER_IDLE

from . import report

FRAMEWORKS = ("tensorflow", "jax", "torch")
STRATEGIES = ("model averaging", "gradient averaging", "asynchronous")
SETTLE = 20
"""Runs after which the baseline is taken."""

RUN = r"""
import json, os, sys
import numpy as np

framework, strategy, reset, addresses, token = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4], sys.argv[5]
if framework == "torch":
    import torch  # as a TorchModel script does, at its top (ddlf.frameworks.seeding then loads its compiler first)
import ddlf


class Soak(ddlf.IApp):
    dataset_key = "soak-" + framework

    def load_dataset(self):
        rng = np.random.default_rng(0)
        x = rng.normal(size=(1024, 8)).astype(np.float32)
        return x, (x[:, :4].sum(axis=1) > 0).astype(np.int64)

    def create_model(self):
        if framework == "torch":
            import torch
            from ddlf.models import TorchModel

            net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
            return TorchModel(net, lambda p: torch.optim.Adam(p, lr=1e-2), torch.nn.CrossEntropyLoss())
        import keras

        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)])
        model.compile(
            optimizer=keras.optimizers.Adam(1e-2),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        return model


strategies = {
    "model averaging": ddlf.ModelAveraging(every=8),
    "gradient averaging": ddlf.GradientAveraging(),
    "asynchronous": ddlf.Asynchronous(),
}
with ddlf.Cluster(addresses.split(","), token=token) as cluster:
    history = Soak(cluster).train(epochs=2, batch_size=32, strategy=strategies[strategy], verbose=0)
    if reset:
        cluster.reset()
print(json.dumps({"accuracy": history.history["accuracy"][-1]}))
"""


BASELINE = r"""
import gc, json, os, sys
import numpy as np

framework, n = sys.argv[1], int(sys.argv[2])
if framework == "torch":
    import torch


def rss():
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) * 1024


rng = np.random.default_rng(0)
x = rng.normal(size=(1024, 8)).astype(np.float32)
y = (x[:, :4].sum(axis=1) > 0).astype(np.int64)
out = []
for _ in range(n):
    if framework == "torch":
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        opt = torch.optim.Adam(net.parameters(), lr=1e-2)
        xt, yt = torch.from_numpy(x), torch.from_numpy(y)
        for _epoch in range(2):
            for i in range(0, 1024, 32):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(net(xt[i : i + 32]), yt[i : i + 32]).backward()
                opt.step()
        del net, opt
    else:
        import keras

        m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)])
        m.compile(
            optimizer=keras.optimizers.Adam(1e-2),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        m.fit(x, y, epochs=2, batch_size=32, verbose=0)
        del m
        keras.utils.clear_session()
    gc.collect()
    out.append(rss())
print(json.dumps(out))
"""
"""One process that builds and fits a new model ``n`` times (Keras: ``fit`` then ``clear_session``; torch: a plain
loop), its resident memory after each: what the framework itself keeps per model, the soak's baseline."""


def _baseline(framework: str, n: int) -> list[int]:
    backend = "tensorflow" if framework == "torch" else framework
    env = {**os.environ, "KERAS_BACKEND": backend}
    done = subprocess.run(
        [sys.executable, "-c", BASELINE, framework, str(n)], env=env, capture_output=True, text=True, timeout=1800
    )
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-2000:])
        return []
    return json.loads(done.stdout.strip().splitlines()[-1])


def _proc(pid: int) -> dict[str, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {
        "rss_bytes": int(fields["VmRSS"].split()[0]) * 1024,
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": int(fields["Threads"].strip()),
    }


def _shm_files(store: str) -> int:
    return sum(len(files) for _, _, files in os.walk(store)) if os.path.isdir(store) else 0


def _growth(first: float, last: float) -> float:
    return (last - first) / first * 100 if first else 0.0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks soak", description=__doc__)
    p.add_argument("--runs", type=int, default=300, help="training runs in all (default 300)")
    p.add_argument("--out", default="RELIABILITY.md")
    args = p.parse_args(argv)
    from ddlf.cluster.local import LocalWorkers

    store = os.path.join("/dev/shm", f"ddlf-soak-{os.getpid()}")
    os.makedirs(store, exist_ok=True)
    env = {"DDLF_NODE_STORE": store, "DDLF_PRELOAD": ""}
    pools: dict[str, Any] = {}
    t0 = time.perf_counter()
    samples: dict[str, list[dict[str, Any]]] = {f: [] for f in FRAMEWORKS}
    failures: list[str] = []
    try:
        for framework in FRAMEWORKS:
            extra = ["--preload", "torch"] if framework == "torch" else []
            backend = "tensorflow" if framework == "torch" else framework
            pools[framework] = LocalWorkers(2, threads=1, extra_args=extra, env={**env, "KERAS_BACKEND": backend})
        for i in range(args.runs):
            framework = FRAMEWORKS[i % len(FRAMEWORKS)]
            k = i // len(FRAMEWORKS)
            strategy = STRATEGIES[k % len(STRATEGIES)]
            reset = (k // len(STRATEGIES)) % 2 == 1
            pool = pools[framework]
            backend = "tensorflow" if framework == "torch" else framework
            child = {**os.environ, **env, "KERAS_BACKEND": backend}
            done = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    RUN,
                    framework,
                    strategy,
                    "1" if reset else "0",
                    ",".join(pool.addresses),
                    pool.token,
                ],
                env=child,
                capture_output=True,
                text=True,
                timeout=600,
            )
            if done.returncode != 0:
                failures.append(f"run {i} ({framework}, {strategy}): {done.stderr.strip().splitlines()[-1:]}")
            time.sleep(RETURN_AFTER_IDLE + 0.2)  # idle, as between scripts: the daemon's free memory handed back
            procs = [_proc(pid) for pid in pool.pids()]
            samples[framework].append({"run": i, "procs": procs, "shm": _shm_files(store), "reset": reset})
            print(
                f"soak: run {i + 1}/{args.runs} {framework} {strategy} reset={reset} rc={done.returncode} "
                f"rss={[p['rss_bytes'] >> 20 for p in procs]} MiB",
                flush=True,
            )
    finally:
        for pool in pools.values():
            pool.terminate()
    took = time.perf_counter() - t0
    rows = []
    worst = 0.0
    for framework in FRAMEWORKS:
        series = samples[framework]
        settle = max(0, min(len(series) - 1, SETTLE // len(FRAMEWORKS)))
        if not series:
            continue
        base, last = series[settle], series[-1]
        for w in range(2):
            cells = []
            for key in ("rss_bytes", "fds", "threads"):
                a, b = base["procs"][w][key], last["procs"][w][key]
                g = _growth(a, b)
                worst = max(worst, g)
                shown = f"{a / 2**20:.0f} → {b / 2**20:.0f} MiB" if key == "rss_bytes" else f"{a} → {b}"
                cells.append(f"{shown} ({g:+.1f}%)")
            rows.append([framework, w, len(series), *cells])
    per_run = []
    for framework in FRAMEWORKS:
        series = samples[framework]
        if len(series) <= SETTLE // len(FRAMEWORKS) + 1:
            continue
        settle = SETTLE // len(FRAMEWORKS)
        runs = len(series) - 1 - settle
        grew = sum(series[-1]["procs"][w]["rss_bytes"] - series[settle]["procs"][w]["rss_bytes"] for w in range(2)) / 2
        by_reset = {}
        for reset in (False, True):
            steps = [
                series[j]["procs"][0]["rss_bytes"] - series[j - 1]["procs"][0]["rss_bytes"]
                for j in range(settle + 1, len(series))
                if series[j - 1]["reset"] == reset  # the run after a reset builds and traces a new model
            ]
            by_reset[reset] = sum(steps) / len(steps) / 2**20 if steps else float("nan")
        base = _baseline(framework, 30)
        fit_per_model = (base[-1] - base[9]) / 20 / 2**20 if len(base) == 30 else float("nan")
        per_run.append(
            [
                framework,
                f"{grew / runs / 2**20:.2f}",
                f"{by_reset[False]:.2f}",
                f"{by_reset[True]:.2f}",
                f"{fit_per_model:.2f}",
            ]
        )
    shm = [s["shm"] for f in FRAMEWORKS for s in samples[f]]
    body = "\n".join(
        [
            "## Soak (`python -m benchmarks soak`)",
            "",
            f"Machine: {report.machine()}; {args.runs} runs in {took / 60:.1f} min.",
            "",
            __doc__.split("\n\n", 1)[1].strip(),
            "",
            report.table(
                [
                    "daemons",
                    "worker",
                    "runs served",
                    f"resident memory, after run {SETTLE} → last",
                    "open file descriptors",
                    "threads",
                ],
                rows,
            ),
            "",
            "Resident memory per run, in MiB (worker 0 from the settled state on; a run after one without a "
            "reset lends the kept warm model, one after a reset builds and traces a new one), beside the "
            "framework's own: one process building and fitting a new model 30 times (Keras: `fit` then "
            "`clear_session()`; torch: a plain loop), MiB per model from the 10th on:",
            "",
            report.table(
                [
                    "daemons",
                    "MiB per run, all",
                    "runs without reset",
                    "runs after a reset",
                    "one process, per new model",
                ],
                per_run,
            ),
            "",
            f"Shared-memory dataset files on the host after each run: at most {max(shm, default=0)} (a dataset is "
            "dropped with its last holder, and by a reset). Largest growth after the first runs: "
            f"{worst:+.1f}% (the bound: 5%). Runs that failed: {len(failures)}"
            + ("" if not failures else " — " + "; ".join(failures[:5])),
        ]
    )
    print(body)
    report.write_section("soak", body, Path(args.out))
    print(json.dumps({"worst_growth_percent": worst, "failures": len(failures)}))
