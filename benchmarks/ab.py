"""This tree against a baseline build, side by side in one run: the RPC floor and tensor round trips.

``python -m benchmarks ab --baseline DIR`` where ``DIR`` is the ``python/`` folder of another checkout with its
extension built in place (for example ``git worktree add /tmp/before <commit>``, ``cargo build --release -p
ddlf-py``, copy ``target/release/lib_ddlf.so`` to ``/tmp/before/python/ddlf/_ddlf.<abi>.so``). Each round starts one
measuring process per build, alternating which goes first, each with its own local daemons (they run the same
build: ``PYTHONPATH`` reaches them); the table gives medians over rounds and the ratio of this tree to the baseline.
Only the public API is used, so any two builds compare.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from . import report

PROBE = r"""
import json, sys, time
import numpy as np
import ddlf

def echo(x):
    return x

def keras_loaded():
    # Blocks until the daemon's background preload of Keras has finished (the import lock): timing a daemon still
    # importing it measures a busy CPU, where a wake-up is cheap (a ping took 55 us there against 135 us idle).
    import keras
    return keras.__version__

def med(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]

calls, repeats = int(sys.argv[1]), int(sys.argv[2])
out = {"ddlf": ddlf.__file__}
with ddlf.Cluster.local(1, threads=1) as tcp_c, ddlf.Cluster.local(1, threads=1, shared_memory=True) as shm_c:
    for c in (tcp_c, shm_c):
        c.run(keras_loaded)
        c.add_function(echo, "echo")
        for _ in range(300):
            c.run_on(0, "echo", None)
    t = []
    for _ in range(calls):
        t0 = time.perf_counter(); tcp_c.run_on(0, "echo", None); t.append(time.perf_counter() - t0)
    out["noop_us"] = med(t) * 1e6
    t = []
    for _ in range(calls // 4):
        t0 = time.perf_counter(); tcp_c.ping(); t.append(time.perf_counter() - t0)
    out["ping_us"] = med(t) * 1e6
    rng = np.random.default_rng(0)
    for label, mb, n in (("100MB", 100.0, 10), ("4MB", 4.0, 20)):
        w = [rng.standard_normal(int(mb * 1e6 / 4 / n), dtype=np.float32) for _ in range(n)]
        for name, c in (("tcp", tcp_c), ("shm", shm_c)):
            c.run_on(0, "echo", w)
            t = []
            for _ in range(repeats):
                t0 = time.perf_counter(); c.run_on(0, "echo", w); t.append(time.perf_counter() - t0)
            out[f"{label}_{name}_ms"] = med(t) * 1e3
    # Fan-out: the same list to 2 workers at once over TCP.
    w = [rng.standard_normal(50_000, dtype=np.float32) for _ in range(20)]
    with ddlf.Cluster.local(2, threads=1) as two:
        two.run(keras_loaded)
        two.add_function(echo, "echo")
        for _ in range(300):
            two.run("echo", None)
        t = []
        for _ in range(calls):
            t0 = time.perf_counter(); two.run("echo", None); t.append(time.perf_counter() - t0)
        out["noop_all_us"] = med(t) * 1e6
        two.run("echo", w)
        t = []
        for _ in range(repeats):
            t0 = time.perf_counter(); two.run("echo", w); t.append(time.perf_counter() - t0)
        out["4MB_tcp2_ms"] = med(t) * 1e3
    # A sync round on the ring: an MLP of 1.1 MB of weights, 2 workers, rounds of 10 batches of 32, the workers
    # averaging worker to worker. Written for either train() API (flat keywords before the typed options).
    import keras

    class Ring(ddlf.IApp):
        dataset_key = "ab-ring-mlp"

        def load_dataset(self):
            r = np.random.default_rng(1)
            x = r.standard_normal((6400, 256), dtype=np.float32)
            return x, (x[:, 0] > 0).astype(np.int64)

        def create_model(self):
            m = keras.Sequential([keras.Input((256,)), keras.layers.Dense(512, activation="relu"),
                                  keras.layers.Dense(256, activation="relu"), keras.layers.Dense(2)])
            m.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            return m

    if hasattr(ddlf, "Ring"):
        ring_kw = {"strategy": ddlf.ModelAveraging(every=10, exchange=ddlf.Ring())}
    else:
        ring_kw = {"averaging_frequency": 10, "exchange": "allreduce"}
    with ddlf.Cluster.local(2, threads=1) as two:
        Ring(two).train(epochs=1, batch_size=32, verbose=0, **ring_kw)  # load, trace, open the ring's links
        h = Ring(two).train(epochs=2, batch_size=32, verbose=0, **ring_kw)
        rounds = len({(s.epoch, s.round) for s in h.stats if s.epoch == 1})
        out["ring_round_ms"] = h.epoch_seconds[-1] / rounds * 1e3
print(json.dumps(out))
"""

METRICS = [
    ("noop_us", "no-op call, 1 worker, p50 (µs)"),
    ("noop_all_us", "no-op call, all 2 workers, p50 (µs)"),
    ("ping_us", "cluster.ping(), 1 worker (Rust only; a ping lane where the tree has one), p50 (µs)"),
    ("100MB_tcp_ms", "100 MB round trip over TCP (ms)"),
    ("100MB_shm_ms", "100 MB round trip through shared memory (ms)"),
    ("4MB_tcp_ms", "4 MB round trip over TCP (ms)"),
    ("4MB_shm_ms", "4 MB round trip through shared memory (ms)"),
    ("4MB_tcp2_ms", "4 MB round trip over TCP, 2 workers at once (ms)"),
    ("ring_round_ms", "sync round on the ring, 2 workers, MLP 1.1 MB, 10 batches (ms)"),
]


def probe(python_dir: str | None, calls: int, repeats: int) -> dict[str, float]:
    env = dict(os.environ)
    if python_dir is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (python_dir, env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(calls), str(repeats)], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks ab", description=__doc__)
    p.add_argument("--baseline", required=True, help="python/ folder of the baseline checkout (extension built)")
    p.add_argument("--label", default="baseline", help="what the baseline is (a commit), for the table")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument(
        "--section",
        default="ab",
        help="BENCHMARKS.md section to write (ab: refactors; another name keeps a change's own comparison)",
    )
    p.add_argument("--title", default="This tree against a baseline build (refactors)")
    args = p.parse_args(argv)
    baseline = str(Path(args.baseline).resolve())
    samples: dict[str, dict[str, list[float]]] = {"baseline": {}, "this tree": {}}
    where: dict[str, str] = {}
    t0 = time.perf_counter()
    for r in range(args.rounds):
        order = [("baseline", baseline), ("this tree", None)]
        for name, path in order if r % 2 == 0 else order[::-1]:
            out = probe(path, args.calls, args.repeats)
            where[name] = str(out.pop("ddlf"))
            for k, v in out.items():
                samples[name].setdefault(k, []).append(float(v))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    if not where["baseline"].startswith(baseline):
        raise SystemExit(f"the baseline run imported {where['baseline']}, not from {baseline}")
    rows = []
    for key, label in METRICS:
        b, t = report.median(samples["baseline"][key]), report.median(samples["this tree"][key])
        rows.append([label, f"{b:.1f}", f"{t:.1f}", f"{t / b:.2f}x"])
    body = "\n".join(
        [
            f"## {args.title}",
            "",
            f"Command: `python -m benchmarks ab --baseline <{args.label} checkout>/python --label {args.label} "
            f"--rounds {args.rounds} --calls {args.calls} --repeats {args.repeats}"
            + (f' --section {args.section} --title "{args.title}"' if args.section != "ab" else "")
            + "`  ",
            f"Machine: {report.machine()}",
            "",
            f"{args.rounds} rounds; each round runs one measuring process per build (alternating which goes first), "
            "each with its own local daemon of the same build: a no-op `run_on` "
            f"({args.calls} calls, median), the same to 2 workers (`run`), `ping()` ({args.calls // 4} calls), "
            "and a list of float32 arrays echoed by the worker "
            f"({args.repeats} times, median) over TCP and through the shared-memory pool, and to 2 workers at once "
            "over TCP, and a synchronous training round on the ring (2 workers, 10 batches of an MLP, the second "
            "epoch's seconds per round). The table gives the "
            "median over rounds; the ratio is this tree's time over the baseline's "
            f"(the run took {time.perf_counter() - t0:.0f} s).",
            "",
            report.table(["measure", f"{args.label}", "this tree", "ratio"], rows),
        ]
    )
    report.write_section(args.section, body)
    print(body)
