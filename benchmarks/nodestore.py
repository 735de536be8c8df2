"""One copy of a dataset per host (``ddlf.data.node_store``) against a copy per worker: memory, load time, supply rate.

    .venv/bin/python -m benchmarks nodestore [--mb 400] [--workers 4]

A ``--mb`` dataset (float32 rows of 784 features and int64 labels, an uncompressed ``.npz`` on local disk) is
loaded by ``--workers`` local workers with the node store on (the default) and off (``DDLF_NODE_STORE=off``, a copy
in every worker, as before), in the same run. Reported for each:

- **host memory for the dataset**: the workers' anonymous resident memory (``RssAnon``) plus the machine's
  shared memory (``Shmem`` in ``/proc/meminfo``, where ``/dev/shm`` files live), after minus before the load, once
  every worker has read every row; as a multiple of the dataset's size;
- **load**: wall time of ``cluster.load_dataset`` on every worker at once, and for the node store, of a second
  set of daemons (another script) that finds the host's copy and only maps it;
- **supply**: each worker gathers one epoch of shuffled 128-row batches through the Rust prefetch pipeline (as
  training does), all workers at once; median GB/s per worker, next to one numpy copy of the same bytes in
  this process (the memory anchor of the same run); and from the host's one copy, the curve with 1, 2 and 4
  workers gathering at once.
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
import time
from typing import Any

import numpy as np

import ddlf

from . import report


def meminfo(field: str) -> int:
    """A /proc/meminfo field, in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def touch(key: str) -> float:
    """Run on a worker: read every byte of the dataset (so its pages are resident in this process)."""
    from ddlf.data.store import STORE

    return float(sum(float(np.sum(a, dtype=np.float64)) for a in STORE.get(key).value))


def supply(key: str, batch_size: int) -> float:
    """Run on a worker: GB/s of one epoch of shuffled batches gathered by the prefetch pipeline."""
    from ddlf import ops
    from ddlf.data.store import STORE

    arrays = list(STORE.get(key).value)
    rows = len(arrays[0])
    order = np.random.default_rng(0).permutation(rows).astype(np.int64)
    nbytes = sum(a.nbytes for a in arrays)
    t0 = time.perf_counter()
    for _ in ops.BatchPipeline(arrays, order, batch_size, prefetch=4):
        pass
    return nbytes / (time.perf_counter() - t0) / 1e9


def load(path: str) -> tuple[np.ndarray, np.ndarray]:
    """The loader the workers run: the arrays of an .npz file."""
    z = ddlf.datasets.npz(path)
    return z["x"], z["y"]


def one_mode(mode: str, path: str, key: str, workers: int, size: int) -> dict[str, Any]:
    if mode == "off":
        os.environ["DDLF_NODE_STORE"] = "off"
    else:
        os.environ.pop("DDLF_NODE_STORE", None)
    loader = functools.partial(load, path)
    out: dict[str, Any] = {"mode": mode}
    with ddlf.Cluster.local(workers, threads=1, preload=None) as c:
        pids = c._local.pids()
        c.ping()
        anon0, shmem0 = sum(rss_anon(p) for p in pids), meminfo("Shmem")
        t0 = time.perf_counter()
        c.load_dataset(key, loader, timeout=600)
        out["load_s"] = time.perf_counter() - t0
        c.run(touch, key, timeout=600)
        anon1, shmem1 = sum(rss_anon(p) for p in pids), meminfo("Shmem")
        out["memory"] = (anon1 - anon0) + (shmem1 - shmem0)
        out["ratio"] = out["memory"] / size
        out["supply_gbs"] = report.median(c.run(supply, key, 128, timeout=600))
        if mode == "on":
            # The supply curve: 1, 2, 4... of the workers gathering at once from the host's one copy.
            counts = sorted({n for n in (1, 2, 4, workers) if n <= workers})
            out["curve"] = {n: c.call(supply, (key, 128), {}, workers=list(range(n)), timeout=600) for n in counts}
        if mode == "on":
            with ddlf.Cluster.local(workers, threads=1, preload=None) as again:
                t0 = time.perf_counter()
                described = again.load_dataset(key, loader, timeout=600)
                out["map_s"] = time.perf_counter() - t0
                assert all(d["node_shared"] for d in described)
        c.drop_dataset(key)
    os.environ.pop("DDLF_NODE_STORE", None)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks nodestore", description=__doc__)
    p.add_argument("--mb", type=float, default=400.0, help="dataset size in megabytes")
    p.add_argument("--workers", type=int, default=4)
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    rows = int(args.mb * 1e6) // (784 * 4 + 8)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="ddlf-bench-nodestore-") as d:
        path = os.path.join(d, "data.npz")
        x = rng.standard_normal((rows, 784), dtype=np.float32)
        y = rng.integers(0, 10, rows)
        np.savez(path, x=x, y=y)
        size = x.nbytes + y.nbytes
        dst = np.empty_like(x)
        copies = []
        for _ in range(4):
            t0 = time.perf_counter()
            np.copyto(dst, x)
            copies.append(time.perf_counter() - t0)
        memcpy = x.nbytes / report.median(copies[1:]) / 1e9
        del x, y, dst
        results = [one_mode(m, path, f"bench-nodestore-{os.getpid()}-{m}", args.workers, size) for m in ("off", "on")]
    for r in results:
        print(
            f"{r['mode']}: {r['memory'] / 1e6:.0f} MB for the dataset ({r['ratio']:.2f}x), load {r['load_s']:.2f} s, "
            f"supply {r['supply_gbs']:.2f} GB/s per worker" + (f", map {r['map_s']:.2f} s" if "map_s" in r else "")
        )
    print(f"memcpy {memcpy:.2f} GB/s")
    body = "\n".join(
        [
            "## One copy per host (`ddlf.data.node_store`)",
            "",
            f"`python -m benchmarks nodestore --mb {args.mb:.0f} --workers {args.workers}` · {report.machine()} · "
            f"{time.perf_counter() - t_start:.0f} s",
            "",
            f"A {size / 1e6:.0f} MB dataset ({rows:,} rows of 784 float32 and an int64 label, an `.npz` on local disk) "
            f"loaded by {args.workers} local workers at once. *Host memory* = the workers' `RssAnon` plus the "
            "machine's `Shmem`, after minus before, once every worker has read every row. *Supply*: one epoch "
            "of shuffled 128-row batches through the Rust prefetch pipeline on every worker at once, median per "
            f"worker, next to one numpy copy of the same bytes in the same run ({memcpy:.2f} GB/s).",
            "",
            report.table(
                [
                    "dataset copies",
                    "host memory MB",
                    "x dataset",
                    "load s",
                    "next script: map s",
                    "supply GB/s per worker",
                    "supply / memcpy",
                ],
                [
                    [
                        "one per host (default)" if r["mode"] == "on" else "one per worker (`DDLF_NODE_STORE=off`)",
                        f"{r['memory'] / 1e6:.0f}",
                        f"{r['ratio']:.2f}",
                        f"{r['load_s']:.2f}",
                        f"{r['map_s']:.2f}" if "map_s" in r else "-",
                        f"{r['supply_gbs']:.2f}",
                        f"{r['supply_gbs'] / memcpy:.2f}",
                    ]
                    for r in results
                ],
            ),
            "",
            "Supply from the host's one copy with 1, 2, ... workers gathering at the same time (each its own "
            f"shuffled epoch; {os.cpu_count()} cores on this machine):",
            "",
            report.table(
                ["workers at once", "median GB/s per worker", "all workers GB/s", "per worker / memcpy"],
                [
                    [
                        str(n),
                        f"{report.median(v):.2f}",
                        f"{sum(v):.2f}",
                        f"{report.median(v) / memcpy:.2f}",
                    ]
                    for r in results
                    if "curve" in r
                    for n, v in r["curve"].items()
                ],
            ),
        ]
    )
    path = report.write_section("nodestore", body)
    print(f"written to {path}")


if __name__ == "__main__":
    main()
