"""Tensor data plane: weight lists round-tripping to workers, next to a raw socket and memcpy in the same run;
the merge kernels against numpy; bytes on the wire with each compression option."""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ddlf import ops
from ddlf.cluster import Cluster

from . import report
from .baselines import RawEcho


def _echo(x):
    return x


def _weights(total_mb: float, n_arrays: int) -> list[np.ndarray]:
    per = int(total_mb * 1e6 / 4 / n_arrays)
    rng = np.random.default_rng(0)
    return [rng.standard_normal(per, dtype=np.float32) for _ in range(n_arrays)]


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return report.median(times)


def round_trips(repeats: int) -> list[list[str]]:
    rows = []
    with Cluster.local(2, threads=1, shared_memory=True) as shm:
        tcp = Cluster(shm.addresses, shm.token, shared_memory=False)
        grpc = Cluster(shm.addresses, shm.token, shared_memory=False, direct_lane=False)
        shm.add_function(_echo, "echo")
        echoes = [RawEcho(), RawEcho()]
        senders = ThreadPoolExecutor(2)

        def raw_both(view: memoryview, into: list[bytearray]) -> None:
            """The raw floor for two receivers at once: one sending thread per echo process."""
            list(senders.map(lambda k: echoes[k].round_trip_buffer(view, into[k]), (0, 1)))

        for label, total_mb, n_arrays in (("100 MB (10 x 10 MB)", 100.0, 10), ("small CNN, 4 MB (20 arrays)", 4.0, 20)):
            w = _weights(total_mb, n_arrays)
            nbytes = sum(a.nbytes for a in w)
            flat = np.concatenate(w)
            into = [bytearray(nbytes), bytearray(nbytes)]
            dst = np.empty_like(flat)
            contenders = {
                "tcp1": lambda w=w: tcp.run_on(0, "echo", w),
                "tcp2": lambda w=w: tcp.run("echo", w),
                "grpc1": lambda w=w: grpc.run_on(0, "echo", w),
                "grpc2": lambda w=w: grpc.run("echo", w),
                "shm1": lambda w=w: shm.run_on(0, "echo", w),
                "shm2": lambda w=w: shm.run("echo", w),
            }
            samples: dict[str, list[float]] = {k: [] for k in ("raw", "raw2", "memcpy", *contenders)}
            for fn in contenders.values():
                fn()
            for _ in range(repeats):  # interleaved
                view = memoryview(flat).cast("B")
                samples["raw"].append(echoes[0].round_trip_buffer(view, into[0]))
                t0 = time.perf_counter()
                raw_both(view, into)
                samples["raw2"].append(time.perf_counter() - t0)
                for key, fn in contenders.items():
                    t0 = time.perf_counter()
                    fn()
                    samples[key].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                np.copyto(dst, flat)
                samples["memcpy"].append(time.perf_counter() - t0)
            raw = {1: report.median(samples["raw"]), 2: report.median(samples["raw2"])}
            for key, name, moved in (
                ("memcpy", "numpy memcpy (one copy, one way)", nbytes),
                ("raw", "raw Python socket, round trip", 2 * nbytes),
                ("raw2", "raw Python socket, 2 receivers at once (a sending thread each)", 4 * nbytes),
                ("tcp1", "ddlf over TCP, 1 worker", 2 * nbytes),
                ("tcp2", "ddlf over TCP, 2 workers at once", 4 * nbytes),
                ("grpc1", "ddlf over gRPC only (`direct_lane=False`), 1 worker", 2 * nbytes),
                ("grpc2", "ddlf over gRPC only (`direct_lane=False`), 2 workers at once", 4 * nbytes),
                ("shm1", "ddlf shared memory, 1 worker", 2 * nbytes),
                ("shm2", "ddlf shared memory, 2 workers at once", 4 * nbytes),
            ):
                t = report.median(samples[key])
                rows.append(
                    [
                        label,
                        name,
                        f"{t * 1e3:.1f}",
                        f"{moved / t / 1e9:.2f}",
                        f"{t / raw[2 if key.endswith('2') else 1]:.2f}x" if key != "memcpy" else "",
                    ]
                )
        for echo in echoes:
            echo.close()
        senders.shutdown()
        tcp.close()
        grpc.close()
    return rows


def merge_kernels(repeats: int, n_lists: int, mb: float) -> list[list[str]]:
    lists = [_weights(mb, 10) for _ in range(n_lists)]
    weights = [float(i + 1) for i in range(n_lists)]
    nbytes = sum(a.nbytes for a in lists[0])
    moved = nbytes * (n_lists + 1)  # every input read once, the output written once

    def with_numpy():
        total = sum(weights)
        return [sum(w * lst[j] for w, lst in zip(weights, lists)) / total for j in range(len(lists[0]))]

    src = np.concatenate(lists[0])
    dst = np.empty_like(src)
    t_ddlf = _median_time(lambda: ops.weighted_average(lists, weights), repeats)
    t_np = _median_time(with_numpy, repeats)
    t_copy = _median_time(lambda: np.copyto(dst, src), repeats)
    return [
        ["ddlf.ops.weighted_average", f"{t_ddlf * 1e3:.0f}", f"{moved / t_ddlf / 1e9:.2f}", f"{t_np / t_ddlf:.2f}x"],
        ["numpy sum(w*x)/sum(w)", f"{t_np * 1e3:.0f}", f"{moved / t_np / 1e9:.2f}", "1.00x"],
        [
            "numpy memcpy of one list (floor: 2 bytes moved per byte)",
            f"{t_copy * 1e3:.1f}",
            f"{2 * nbytes / t_copy / 1e9:.2f}",
            "",
        ],
    ]


def wire_bytes() -> list[list[str]]:
    w = _weights(100.0, 10)
    f32 = sum(a.nbytes for a in w)
    rows = [["none (float32)", f"{f32 / 1e6:.1f}", "1.00x"]]
    for kind in ("float16", "bfloat16"):
        h = ops.to_half(w, kind)
        b = sum(a.nbytes for a in h)
        rows.append([kind, f"{b / 1e6:.1f}", f"{b / f32:.2f}x"])
    for ratio in (0.1, 0.01):
        sparse = ops.topk(w, ratio)
        b = sum(i.nbytes + v.nbytes for i, v in sparse)
        rows.append([f"topk {ratio:g} (uint32 index + float32 value)", f"{b / 1e6:.1f}", f"{b / f32:.2f}x"])
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks tensor", description=__doc__)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--merge-lists", type=int, default=8)
    p.add_argument("--merge-mb", type=float, default=100.0)
    args = p.parse_args(argv)
    rt = round_trips(args.repeats)
    mk = merge_kernels(max(3, args.repeats // 2), args.merge_lists, args.merge_mb)
    wb = wire_bytes()
    body = "\n".join(
        [
            "## Tensor data plane",
            "",
            f"Command: `python -m benchmarks tensor --repeats {args.repeats} --merge-lists {args.merge_lists} "
            f"--merge-mb {args.merge_mb:g}`  ",
            f"Machine: {report.machine()}",
            "",
            "### Weight-list round trips (medians of interleaved repeats)",
            "",
            "A ddlf round trip is `cluster.run_on(0, 'echo', weights)` (or `cluster.run` for all workers): the list "
            "goes to the worker, is unpickled there on the received memory, and comes back. 'over TCP' sends it "
            "on the direct lane on loopback (`shared_memory=False`; 'over gRPC only' turns the lane off and streams "
            "it in chunks); 'shared memory' writes it once into a segment of the sender's /dev/shm pool that every "
            "local worker reads in place (reply likewise) (`shared_memory=True`, opt-in). The raw socket moves the "
            "same bytes to an echo process and back on loopback (for 2 workers at once: two echo processes, one "
            "sending thread each; the 2-worker rows are compared with that); memcpy copies them once.",
            "",
            report.table(["payload", "path", "ms", "GB/s moved", "time vs raw socket"], rt),
            "",
            f"### Merge kernel: weighted average of {args.merge_lists} lists of {args.merge_mb:g} MB",
            "",
            report.table(["implementation", "ms", "GB/s (inputs read + output written)", "speed-up vs numpy"], mk),
            "",
            "### Bytes on the wire per weight transfer (100 MB of float32 weights)",
            "",
            report.table(["compression", "MB", "ratio"], wb),
        ]
    )
    path = report.write_section("tensor", body)
    print(body)
    print(f"\nwritten to {path}")
