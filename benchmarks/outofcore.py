"""A dataset larger than memory: step time as it grows from 1x to 8x a process's memory budget.

    .venv/bin/python -m benchmarks outofcore [--budget-mb 256] [--scales 1,2,4,8] [--steps 400]

The dataset is MNIST-shaped rows (784 uint8 features, a uint8 label) in ``.npy`` files on local disk, memory-mapped
read-only (``ddlf.datasets.npy``, what a ``load_dataset`` returns for data that does not fit). Each measurement
runs in a fresh process inside a memory cgroup limited to ``--budget-mb`` (resident memory *and* page cache:
the kernel keeps at most the budget of the file cached and reads the rest from disk as the shuffled batches touch
it). The process feeds a fixed per-step compute (a 784x1024 matmul on the batch, math libraries on one thread, as a
worker given ``threads=1``) from the Rust prefetch pipeline, as the worker's training loop does; one epoch's worth
of warm-up steps first fills the cache, then ``--steps`` steps are timed. Before each scale the file's pages are
dropped from the cache.

Reported per scale: the median step time, against the 1x step time of the same run and against the same loop on
the same rows held in memory (no cgroup); the share of the loop's wall time blocked waiting for a batch; the bytes
the process had read from disk per step (page faults and readahead); and the cgroup's peak memory, which shows
the budget held. Then (unless ``--no-parquet``) the largest scale once more from a Parquet export: converted by
``datasets.parquet(..., cache_dir=)`` inside the same budget (time and peak memory reported), and trained from the
converted files. Run as root (cgroup v1 or v2 memory controller); the Parquet row needs pyarrow.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from . import report

ROW = 784


# -- the measured process -------------------------------------------------------------------------------------


def _read_bytes() -> int:
    """Bytes this process has caused to be read from storage (page faults and readahead alike)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def steps(x_path: str, y_path: str, rows: int, batch: int, warm: int, timed: int, in_memory: bool) -> dict[str, Any]:
    """Run in the measured process: ``warm`` untimed then ``timed`` timed steps on the first ``rows`` rows."""
    from ddlf import data as datasets
    from ddlf import ops

    x, y = datasets.npy(x_path)[:rows], datasets.npy(y_path)[:rows]
    if in_memory:
        x, y = np.array(x), np.array(y)
    w = np.random.default_rng(0).standard_normal((ROW, 1024)).astype(np.float32)
    order = ops.permutation(rows, 1, 0)
    needed = (warm + timed) * batch
    order = np.resize(order, needed) if len(order) < needed else order[:needed]
    pipeline = ops.BatchPipeline([x, y], order, batch, prefetch=4)
    step_times: list[float] = []
    read0 = 0
    waited0 = 0.0
    start = last = time.perf_counter()
    for i, (bx, _by) in enumerate(pipeline):
        _ = (bx.astype(np.float32) / 255.0) @ w
        now = time.perf_counter()
        if i == warm - 1 or (warm == 0 and i == 0):
            read0 = _read_bytes()
            waited0 = pipeline.stats()["wait_seconds"]
            start = now
        elif i >= warm:
            step_times.append(now - last)
        last = now
    total = time.perf_counter() - start
    return {
        "step_s": report.median(step_times),
        "blocked": (pipeline.stats()["wait_seconds"] - waited0) / total,
        "read_per_step": (_read_bytes() - read0) / max(1, len(step_times)),
    }


def convert(parquet_dir: str, cache_dir: str) -> dict[str, Any]:
    """Run in the measured process: the Parquet export converted to ``.npy`` files by ``datasets.parquet``."""
    from ddlf import data as datasets

    t0 = time.perf_counter()
    x, y = datasets.parquet(parquet_dir, columns=["x"], label="y", cache_dir=cache_dir)
    return {"seconds": time.perf_counter() - t0, "x": x.filename, "y": y.filename, "rows": len(x)}


# -- the memory budget -------------------------------------------------------------------------------------------


class Budget:
    """A memory cgroup (v1 or v2) that holds a process's memory, page cache included, to ``limit`` bytes."""

    def __init__(self, limit: int) -> None:
        name = f"ddlf-bench-outofcore-{os.getpid()}"
        v1 = "/sys/fs/cgroup/memory"
        if os.path.isdir(v1):
            self.path = os.path.join(v1, name)
            self.limit_file, self.peak_file = "memory.limit_in_bytes", "memory.max_usage_in_bytes"
        elif os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
            self.path, self.limit_file, self.peak_file = f"/sys/fs/cgroup/{name}", "memory.max", "memory.peak"
        else:
            raise SystemExit("no memory cgroup controller found: this benchmark needs one (and root)")
        try:
            os.mkdir(self.path)
            self._write(self.limit_file, str(limit))
        except PermissionError as exc:
            raise SystemExit(f"cannot create a memory cgroup ({exc}): run as root") from exc

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def enter(self) -> None:
        """In the child, before exec: join the cgroup."""
        self._write("cgroup.procs", str(os.getpid()))

    def peak(self) -> int:
        with open(os.path.join(self.path, self.peak_file)) as f:
            return int(f.read())

    def reset_peak(self) -> None:
        if self.peak_file == "memory.max_usage_in_bytes":
            self._write(self.peak_file, "0")

    def close(self) -> None:
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except OSError:
                time.sleep(0.1)


def run(budget: Budget | None, args: tuple[Any, ...], fn: str = "steps") -> dict[str, Any]:
    from ddlf.process import thread_env

    code = f"import json; from benchmarks.outofcore import {fn}; print(json.dumps({fn}(*{args!r})))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **thread_env(1)},
        capture_output=True,
        text=True,
        preexec_fn=budget.enter if budget else None,
        timeout=1800,
    )
    if out.returncode != 0:
        raise SystemExit(f"the measured process failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def budgeted(limit: int, args: tuple[Any, ...], fn: str = "steps") -> tuple[dict[str, Any], int]:
    """:func:`run` in a fresh memory cgroup of ``limit`` bytes: its result and the cgroup's peak memory."""
    budget = Budget(limit)
    try:
        budget.reset_peak()
        return run(budget, args, fn), budget.peak()
    finally:
        budget.close()


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def write_dataset(directory: str, rows: int) -> tuple[str, str]:
    """Random rows written in chunks (never the whole dataset in this process's memory)."""
    rng = np.random.default_rng(0)
    x_path, y_path = os.path.join(directory, "x.npy"), os.path.join(directory, "y.npy")
    x = np.lib.format.open_memmap(x_path, mode="w+", dtype=np.uint8, shape=(rows, ROW))
    step = 1 << 16
    for i in range(0, rows, step):
        x[i : i + step] = rng.integers(0, 256, (min(step, rows - i), ROW), dtype=np.uint8)
    x.flush()
    del x
    np.save(y_path, rng.integers(0, 10, rows, dtype=np.uint8))
    return x_path, y_path


def write_parquet(directory: str, x_path: str, y_path: str) -> str:
    """The dataset as a Spark-style Parquet export (part files of 256k rows in row groups of :data:`ROW_GROUP`; the
    features a fixed-size list column), written in chunks."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = os.path.join(directory, "export")
    os.mkdir(out)
    x, y = np.load(x_path, mmap_mode="r"), np.load(y_path, mmap_mode="r")
    step, per_part = 1 << 16, 1 << 18
    for part, start in enumerate(range(0, len(x), per_part)):
        with pq.ParquetWriter(os.path.join(out, f"part-{part:05d}.parquet"), _schema()) as w:
            for i in range(start, min(start + per_part, len(x)), step):
                flat = pa.array(np.ascontiguousarray(x[i : i + step]).reshape(-1))
                w.write_table(
                    pa.table({"x": pa.FixedSizeListArray.from_arrays(flat, ROW), "y": pa.array(y[i : i + step])}),
                    row_group_size=ROW_GROUP,
                )
    return out


#: Rows per row group of the Parquet export (12.8 MB of features): converting holds about three decoded row groups.
ROW_GROUP = 16_384


def _schema() -> Any:
    import pyarrow as pa

    return pa.schema([("x", pa.list_(pa.uint8(), ROW)), ("y", pa.uint8())])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks outofcore", description=__doc__)
    p.add_argument("--budget-mb", type=int, default=256, help="the measured process's memory budget")
    p.add_argument("--scales", default="1,2,4,8", help="dataset sizes in multiples of the budget")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=400, help="timed steps per scale (after as many warm-up steps)")
    p.add_argument("--dir", default=None, help="where the dataset files go (a local disk; default: the repo's)")
    p.add_argument(
        "--no-parquet", dest="parquet", action="store_false", help="skip the largest scale read from a Parquet export"
    )
    args = p.parse_args(argv)
    scales = [int(s) for s in args.scales.split(",")]
    budget_bytes = args.budget_mb << 20
    rows_of = {s: s * budget_bytes // (ROW + 1) for s in scales}
    directory = tempfile.mkdtemp(prefix="ddlf-outofcore-", dir=args.dir or os.getcwd())
    try:
        x_path, y_path = write_dataset(directory, max(rows_of.values()))
        warm = args.steps
        # Held in memory: the reference loop, on the 1x rows, no budget.
        ref = run(None, (x_path, y_path, rows_of[scales[0]], args.batch, warm, args.steps, True))
        rows = []
        base = 0.0

        def row(label: str, r: dict[str, Any], peak: int) -> list[str]:
            return [
                label,
                f"{r['step_s'] * 1e3:.2f}",
                f"{r['step_s'] / base:.2f}x",
                f"{r['step_s'] / ref['step_s']:.2f}x",
                f"{100 * r['blocked']:.1f}%",
                f"{r['read_per_step'] / 1e3:.0f}",
                f"{peak / 2**20:.0f}",
            ]

        for scale in scales:
            drop_cache(x_path)
            r, peak = budgeted(budget_bytes, (x_path, y_path, rows_of[scale], args.batch, warm, args.steps, False))
            base = base or r["step_s"]
            rows.append(row(f"{scale}x ({rows_of[scale] * (ROW + 1) / 1e6:,.0f} MB, {rows_of[scale]:,} rows)", r, peak))
            print(rows[-1], file=sys.stderr)
        parquet_note = ""
        if args.parquet:
            # The largest scale again, from a Parquet export converted by `datasets.parquet(cache_dir=)` inside the
            # same budget (its memory must not grow with the data), then trained from the converted files.
            top = max(scales)
            export = write_parquet(directory, x_path, y_path)
            conv, conv_peak = budgeted(budget_bytes, (export, os.path.join(directory, "cache")), fn="convert")
            drop_cache(conv["x"])
            r, peak = budgeted(budget_bytes, (conv["x"], conv["y"], rows_of[top], args.batch, warm, args.steps, False))
            rows.append(row(f"{top}x from Parquet (`cache_dir`)", r, peak))
            mb = conv["rows"] * (ROW + 1) / 1e6
            parquet_note = (
                f"The last row reads the {top}x rows from a Parquet export (part files of 262,144 rows in row groups "
                f"of {ROW_GROUP:,}, the features a fixed-size list column): `datasets.parquet(..., cache_dir=)` "
                "converted it to `.npy` files in "
                f"{conv['seconds']:.1f} s ({mb / conv['seconds']:.0f} MB/s) inside the same {args.budget_mb} MiB "
                f"budget (cgroup peak {conv_peak / 2**20:.0f} MiB during the conversion), and the loop trained from "
                "the converted files."
            )
            print(rows[-1], parquet_note, file=sys.stderr)
    finally:
        import shutil

        shutil.rmtree(directory, ignore_errors=True)
    body = "\n".join(
        [
            "## Larger than memory: step time as the dataset grows past the memory budget",
            "",
            f"Command: `python -m benchmarks outofcore --budget-mb {args.budget_mb} --scales {args.scales} "
            f"--batch {args.batch} --steps {args.steps}`  ",
            f"Machine: {report.machine()}",
            "",
            f"Memory budget {args.budget_mb} MiB (a memory cgroup: resident memory and page cache). Batch "
            f"{args.batch} of 784-byte rows memory-mapped from `.npy` files on local disk, shuffled; a fixed 784x1024 "
            f"matmul per step on one thread; {args.steps} warm-up then {args.steps} timed steps per scale. Reference: "
            f"the same loop with the 1x rows in memory, no budget: {ref['step_s'] * 1e3:.2f} ms per step, "
            f"{100 * ref['blocked']:.1f}% blocked.",
            "",
            report.table(
                [
                    "dataset (x budget)",
                    "median step ms",
                    "vs 1x",
                    "vs in memory",
                    "loop blocked on data",
                    "read from disk per step, KB",
                    "cgroup peak MiB",
                ],
                rows,
            ),
            "",
            parquet_note,
        ]
    )
    print(body)
    report.write_section("outofcore", body)


if __name__ == "__main__":
    main()
