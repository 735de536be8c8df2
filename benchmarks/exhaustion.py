"""Exhaustion, measured: ``python -m benchmarks exhaustion`` writes its rows into RELIABILITY.md.

    .venv/bin/python -m benchmarks exhaustion      # root for the full-disk row (a small tmpfs is mounted)

* a worker with ``--max-memory 400Mi``: a 480 MB ``set`` (refused before decoding), a value of a few bytes that
  decodes to 480 MB (dropped), a call that grows 8 MB at a time (stopped by the watchdog): how long each took,
  the worker's resident memory after, and that it still serves;
* a checkpoint written to a disk with room for one and a half checkpoints: the error, the checkpoint left, the
  partial files left;
* a flood of 2,000 silent connections on a daemon limited to 64: refused, and the no-op call latency of a master
  connected before, during the flood against before it;
* a flood of 10,000 concurrent requests from one authenticated master: all answered, calls per second, resident
  memory before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import ddlf
from ddlf import data as datasets
from ddlf.cluster.cluster import Cluster
from ddlf.cluster.local import LocalWorkers
from ddlf.errors import CheckpointError, MemoryBudgetExceeded
from ddlf.training import checkpoint

from . import report
from .faults import DenseMnist

BUDGET = 400 * 2**20
BIG = 60_000_000  # float64 elements: 480 MB


class _Expands:
    """A few bytes on the wire, 480 MB once decoded."""

    def __reduce__(self) -> Any:
        return (np.ones, (BIG,))


def _grow(worker: Any) -> int:
    keep = []
    while True:
        keep.append(np.ones(1_000_000))
        worker.vars["grown"] = len(keep)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def _memory() -> list[str]:
    rows = []
    with LocalWorkers(1, threads=1, extra_args=["--max-memory", str(BUDGET)]) as w, Cluster(w.addresses, w.token) as c:
        before = c.status()[0]["rss_bytes"]
        for label, action in (
            ("a 480 MB `set`", lambda: c.set("big", np.zeros(BIG))),
            ("a `set` of a value that decodes to 480 MB", lambda: c.set("big", _Expands())),
            ("a call that allocates 8 MB at a time without end", lambda: c.run(_grow)),
        ):
            t0 = time.perf_counter()
            try:
                action()
                outcome = "accepted (unexpected)"
            except MemoryBudgetExceeded:
                outcome = "refused: `MemoryBudgetExceeded`"
            took = time.perf_counter() - t0
            after = c.status()[0]["rss_bytes"]
            served = c.run(lambda: "ok") == ["ok"]
            extra = f", stopped after {c.get('grown')[0] * 8} MB" if "call" in label else ""
            rows.append(
                f"| memory budget 400 MiB (`--max-memory`): {label} | {outcome}{extra}; the worker "
                f"{'still serves' if served else 'DOES NOT SERVE'}, holding {_mib(after)} (before: {_mib(before)}) "
                f"| {took:.2f} s to answer | nothing kept |"
            )
    return rows


def _full_disk(data_dir: str) -> list[str]:
    if os.geteuid() != 0:
        return ["| checkpoint on a full disk | not measured: mounting a tmpfs needs root | - | - |"]
    work = Path(tempfile.mkdtemp(prefix="ddlf-bench-disk-"))
    mnt = work / "disk"
    mnt.mkdir()
    with LocalWorkers(2, threads=1) as w, Cluster(w.addresses, w.token) as c:
        kw = {"batch_size": 64, "verbose": 0, "strategy": ddlf.ModelAveraging(every=20)}
        app = DenseMnist(c)
        app.data_dir = data_dir
        app.train(epochs=1, run=ddlf.RunConfig(seed=1, checkpoint_dir=work / "probe"), **kw)
        size = checkpoint.path_in(work / "probe").stat().st_size
        room = int(size * 1.5) // 4096 * 4096 + 4096
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={room}", "tmpfs", str(mnt)], check=True)
        try:
            app = DenseMnist(c)
            app.data_dir = data_dir
            t0 = time.perf_counter()
            try:
                app.train(epochs=3, run=ddlf.RunConfig(seed=1, checkpoint_dir=mnt), **kw)
                what = "no error (unexpected)"
            except CheckpointError as exc:
                what = f"`CheckpointError` (errno {exc.errno}): {exc}"
            took = time.perf_counter() - t0
            saved = checkpoint.load(mnt)
            left = sorted(p.name for p in mnt.iterdir() if p.name != checkpoint.FILENAME)
            served = c.run(lambda: "ok") == ["ok", "ok"]
        finally:
            subprocess.run(["umount", "-l", str(mnt)], check=False)
    kept = f"epoch {saved['epochs_done']}'s checkpoint intact" if saved else "NO CHECKPOINT"
    return [
        f"| checkpoint written to a disk with room for 1.5 checkpoints ({_mib(size)} each), 3 epochs | {what}; "
        f"workers {'still serve' if served else 'DO NOT SERVE'} | raised {took:.1f} s into the run | {kept}; "
        f"{len(left)} partial files left |"
    ]


def _latency(c: Cluster, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        c.run_on(0, "noop")
        times.append(time.perf_counter() - t0)
    return report.median(times) * 1e6


def _connection_flood(n: int) -> list[str]:
    with LocalWorkers(
        1, threads=1, extra_args=["--max-connections", "64", "--handshake-timeout", "1"]
    ) as w, Cluster(w.addresses, w.token) as c:  # fmt: skip
        c.add_function(lambda: None, "noop")
        before = _latency(c, 2000)
        host, port = w.addresses[0].rsplit(":", 1)
        flood = [socket.create_connection((host, int(port)), timeout=5) for _ in range(n)]
        try:
            during = _latency(c, 2000)
        finally:
            for s in flood:
                s.close()
        refused = c.status()[0]["connections_refused"]
        after_ok = Cluster(w.addresses, w.token).run(lambda: 1) == [1]
    return [
        f"| flood: {n:,} silent connections, `--max-connections 64`, handshake deadline 1 s | {refused:,} refused "
        f"or closed, the daemon serves; a master connected before: no-op call {before:.0f} µs before, "
        f"{during:.0f} µs during (median of 2,000); new masters connect after: {'yes' if after_ok else 'NO'} | - "
        "| - |"
    ]


def _echo(i: int, payload: bytes) -> int:
    return i


def _request_flood(n: int) -> list[str]:
    with LocalWorkers(1, threads=1) as w, Cluster(w.addresses, w.token) as c:
        c.add_function(_echo, "echo")
        before = c.status()[0]["rss_bytes"]

        async def flood() -> list[list[int]]:
            return await asyncio.gather(*(c.run_async("echo", i, b"x" * 10_000) for i in range(n)))

        t0 = time.perf_counter()
        results = asyncio.run(flood())
        took = time.perf_counter() - t0
        right = [r[0] for r in results] == list(range(n))
        after = c.status()[0]["rss_bytes"]
    return [
        f"| flood: {n:,} concurrent requests (10 kB each) from one authenticated master | "
        f"{'all answered, in order' if right else 'WRONG ANSWERS'}, {n / took:,.0f} calls/s; resident memory "
        f"{_mib(before)} before, {_mib(after)} after | - | nothing lost |"
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks exhaustion", description=__doc__)
    p.add_argument("--data", default=os.path.join("examples", "data", "mnist"))
    p.add_argument("--connections", type=int, default=2000)
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--out", default="RELIABILITY.md")
    args = p.parse_args(argv)
    data_dir = os.path.abspath(args.data)
    datasets.mnist(data_dir)  # fail early without MNIST
    t0 = time.perf_counter()
    rows = _memory() + _full_disk(data_dir) + _connection_flood(args.connections) + _request_flood(args.requests)
    body = "\n".join(
        [
            "## Exhaustion (`python -m benchmarks exhaustion`)",
            "",
            f"Machine: {report.machine()}; {time.perf_counter() - t0:.0f} s.",
            "",
            "| what was exhausted | what happened | time | data lost |",
            "| --- | --- | --- | --- |",
            *rows,
        ]
    )
    report.write_section("exhaustion", body, Path(args.out))
    print(body)


if __name__ == "__main__":
    main()
