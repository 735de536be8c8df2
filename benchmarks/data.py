"""Worker-side datasets: bytes sent per epoch, gather speed, step time as the dataset grows, reload skipped."""

from __future__ import annotations

import argparse
import os
import pickle
import time

import numpy as np

from ddlf import data as datasets
from ddlf import ops, serialization
from ddlf.cluster.cluster import Cluster

from . import report

MNIST_ROWS, MNIST_ROW = 60_000, 784


def _mnist_dir() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    for candidate in (
        os.path.join(os.getcwd(), "examples", "data", "mnist"),
        os.path.join(here, "..", "..", "..", "examples", "data", "mnist"),
    ):
        if os.path.isdir(candidate):
            return os.path.abspath(candidate)
    raise SystemExit("examples/data/mnist not found: run from the repository root")


def _wire(value) -> int:
    data, bufs = serialization.dumps(value)
    return len(data) + sum(b.raw().nbytes for b in bufs)


def bytes_per_epoch(n_workers: int = 2) -> list[list[str]]:
    parts = ops.partitions(MNIST_ROWS, 0, 1, [1.0] * n_workers)
    ddlf_indices = sum(_wire(p) for p in parts)
    ddlf_seeded = sum(_wire((0, 1, [1.0] * n_workers, w, 0, len(parts[w]))) for w in range(n_workers))
    perm = ops.permutation(MNIST_ROWS, 0, 1).tolist()
    paper = n_workers * len(pickle.dumps(perm))  # the whole permutation, pickled, to every worker
    data = MNIST_ROWS * (MNIST_ROW + 1)  # the images and labels themselves (uint8), as Spark ships them
    rows = []
    for name, b in (
        ("ddlf seeded mode (seed, epoch, share)", ddlf_seeded),
        ("ddlf index partitions (packed uint32)", ddlf_indices),
        ("original DDLF code (pickled 60,000-entry permutation to each worker)", paper),
        ("sending the data itself (Spark-style)", data),
    ):
        rows.append([name, f"{b:,}", f"{b / ddlf_indices:.3g}x"])
    return rows


def gather_speed(repeats: int) -> list[list[str]]:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 255, (MNIST_ROWS, MNIST_ROW), dtype=np.uint8)
    idx = ops.permutation(MNIST_ROWS, 0, 0)
    flat = x.reshape(-1)
    dst = np.empty_like(flat)
    t_ddlf = report.median([_timed(lambda: ops.gather(x, idx)) for _ in range(repeats)])
    t_np = report.median([_timed(lambda: x[idx]) for _ in range(repeats)])
    t_copy = report.median([_timed(lambda: np.copyto(dst, flat)) for _ in range(repeats)])
    n = x.nbytes
    return [
        [
            "ddlf.ops.gather (Rust, GIL released)",
            f"{t_ddlf * 1e3:.1f}",
            f"{n / t_ddlf / 1e9:.2f}",
            f"{t_np / t_ddlf:.2f}x",
        ],
        ["numpy fancy indexing x[idx]", f"{t_np * 1e3:.1f}", f"{n / t_np / 1e9:.2f}", "1.00x"],
        ["numpy memcpy of the same bytes (floor)", f"{t_copy * 1e3:.1f}", f"{n / t_copy / 1e9:.2f}", ""],
    ]


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def step_time(scales: list[int], batch: int, steps: int) -> list[list[str]]:
    """A fixed per-step compute (a matmul on the batch) fed by the pipeline, datasets of growing size."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((MNIST_ROW, 1024)).astype(np.float32)
    rows = []
    base = None
    for scale in scales:
        n = MNIST_ROWS * scale
        x = rng.integers(0, 255, (n, MNIST_ROW), dtype=np.uint8)
        y = rng.integers(0, 10, n, dtype=np.uint8)
        idx = ops.permutation(n, 0, 0)[: batch * steps]
        for mode in ("ddlf pipeline (prefetch 2)", "inline numpy x[idx] (no prefetch)"):
            t0 = time.perf_counter()
            step_times = []
            if mode.startswith("ddlf"):
                pipeline = ops.BatchPipeline([x, y], idx, batch, prefetch=2)
                last = time.perf_counter()
                for bx, _by in pipeline:
                    _ = (bx.astype(np.float32) / 255.0) @ w
                    now = time.perf_counter()
                    step_times.append(now - last)
                    last = now
                waited = pipeline.stats()["wait_seconds"]
            else:
                waited = 0.0
                last = time.perf_counter()
                for s in range(steps):
                    t_data = time.perf_counter()
                    chunk = idx[s * batch : (s + 1) * batch]
                    bx, _by = x[chunk], y[chunk]
                    waited += time.perf_counter() - t_data
                    _ = (bx.astype(np.float32) / 255.0) @ w
                    now = time.perf_counter()
                    step_times.append(now - last)
                    last = now
            total = time.perf_counter() - t0
            med = report.median(step_times[5:])
            if mode.startswith("ddlf") and base is None:
                base = med
            rows.append(
                [
                    f"{scale}x MNIST ({x.nbytes / 1e6:,.0f} MB)",
                    mode,
                    f"{med * 1e3:.2f}",
                    f"{med / base:.2f}x" if mode.startswith("ddlf") else "",
                    f"{100 * waited / total:.1f}%",
                ]
            )
        del x, y
    return rows


def step_time_isolated(scales: list[int], batch: int, steps: int) -> list[list[str]]:
    """:func:`step_time` in a fresh process whose math libraries use one thread, as a worker given
    ``threads=1`` does; otherwise BLAS threads take both cores and starve the prefetch thread."""
    import json
    import subprocess
    import sys

    from ddlf.process import thread_env

    code = (
        "import json, sys; from benchmarks.data import step_time; "
        f"print(json.dumps(step_time({scales!r}, {batch}, {steps})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **thread_env(1)}, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def reload_skipped() -> list[list[str]]:
    directory = _mnist_dir()

    def load():
        (x, y), _ = datasets.mnist(directory)
        return x, y

    with Cluster.local(2, threads=1) as cluster:
        t0 = time.perf_counter()
        first = cluster.load_dataset("bench-mnist", load)
        t_first = time.perf_counter() - t0
        t0 = time.perf_counter()
        second = cluster.load_dataset("bench-mnist", load)
        t_second = time.perf_counter() - t0
    assert not any(i["cached"] for i in first) and all(i["cached"] for i in second)
    return [
        ["first run: every worker loads MNIST", f"{t_first * 1e3:.0f}", "1.00x"],
        ["second run, same key: cached on every worker", f"{t_second * 1e3:.1f}", f"{t_second / t_first:.3f}x"],
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks data", description=__doc__)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--scales", default="1,4,16", help="dataset sizes in multiples of MNIST")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=120)
    args = p.parse_args(argv)
    scales = [int(s) for s in args.scales.split(",")]
    sections = [
        "## Worker-side datasets",
        "",
        f"Command: `python -m benchmarks data --repeats {args.repeats} --scales {args.scales} --batch {args.batch} "
        f"--steps {args.steps}`  ",
        f"Machine: {report.machine()}",
        "",
        "### Bytes sent per epoch: 60,000 samples, 2 workers",
        "",
        report.table(["what the master sends", "bytes per epoch", "vs ddlf index partitions"], bytes_per_epoch()),
        "",
        "### Gather: one epoch of MNIST-sized rows (60,000 x 784 B) in a random order",
        "",
        report.table(["implementation", "ms", "GB/s", "speed-up vs numpy"], gather_speed(args.repeats)),
        "",
        f"### Step time as the dataset grows (batch {args.batch}, {args.steps} steps, a fixed 784x1024 matmul "
        "per step, math libraries on one thread)",
        "",
        "The training loop's time blocked on data is the share of wall time spent waiting for the next batch "
        "(for the pipeline: inside `next()`; inline: the gather itself).",
        "",
        report.table(
            ["dataset", "feeding", "median step (ms)", "vs 1x", "time blocked on data"],
            step_time(scales, args.batch, args.steps),
        ),
        "",
        "### Reload skipped: `cluster.load_dataset` of MNIST on 2 local workers",
        "",
        report.table(["run", "ms", "vs first"], reload_skipped()),
    ]
    body = "\n".join(sections)
    path = report.write_section("data", body)
    print(body)
    print(f"\nwritten to {path}")
