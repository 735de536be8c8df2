"""Tensor data plane: weight lists round-tripping to workers, next to a raw socket and memcpy in the same run;
the merge kernels against numpy; bytes on the wire with each compression option."""

from __future__ import annotations

import argparse
import random
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ddlf import ops
from ddlf.cluster.cluster import Cluster

from . import report
from .baselines import RawEcho


def _echo(x):
    return x


def _preloaded() -> None:
    import keras  # noqa: F401  (the request waits until the worker's background preload is done)


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


def round_trips(repeats: int, small_repeats: int) -> list[list[str]]:
    rows = []
    with Cluster.local(2, threads=1, shared_memory=True) as shm:
        tcp = Cluster(shm.addresses, shm.token, shared_memory=False)
        grpc = Cluster(shm.addresses, shm.token, shared_memory=False, direct_lane=False)
        shm.add_function(_echo, "echo")
        shm.run(_preloaded)
        echoes = [RawEcho(), RawEcho()]
        senders = ThreadPoolExecutor(2)

        def raw_both(view: memoryview, into: list[bytearray]) -> None:
            """The raw floor for two receivers at once: one sending thread per echo process."""
            list(senders.map(lambda k: echoes[k].round_trip_buffer(view, into[k]), (0, 1)))

        payloads = (
            ("100 MB (10 x 10 MB)", 100.0, 10, repeats),
            ("small CNN, 4 MB (20 arrays)", 4.0, 20, small_repeats),
        )
        for label, total_mb, n_arrays, n_repeats in payloads:
            w = _weights(total_mb, n_arrays)
            nbytes = sum(a.nbytes for a in w)
            flat = np.concatenate(w)
            into = [bytearray(nbytes), bytearray(nbytes)]
            dst = np.empty_like(flat)
            view = memoryview(flat).cast("B")
            contenders = {
                "raw": lambda v=view, i=into: echoes[0].round_trip_buffer(v, i[0]),
                "raw2": lambda v=view, i=into: raw_both(v, i),
                "tcp1": lambda w=w: tcp.run_on(0, "echo", w),
                "tcp2": lambda w=w: tcp.run("echo", w),
                "grpc1": lambda w=w: grpc.run_on(0, "echo", w),
                "grpc2": lambda w=w: grpc.run("echo", w),
                "shm1": lambda w=w: shm.run_on(0, "echo", w),
                "shm2": lambda w=w: shm.run("echo", w),
                "memcpy": lambda d=dst, f=flat: np.copyto(d, f),
            }
            samples: dict[str, list[float]] = {k: [] for k in contenders}
            for fn in contenders.values():
                fn()
            order = list(contenders)
            shuffle = random.Random(0)
            for _ in range(n_repeats):  # interleaved, in a new order each time: no path always follows the same one
                shuffle.shuffle(order)
                for key in order:
                    t0 = time.perf_counter()
                    contenders[key]()
                    samples[key].append(time.perf_counter() - t0)
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
    p.add_argument("--repeats", type=int, default=7, help="interleaved repeats of the 100 MB round trips")
    p.add_argument(
        "--small-repeats",
        type=int,
        default=35,
        help="interleaved repeats of the 4 MB round trips (a few ms each: the noise of this VM needs more samples)",
    )
    p.add_argument("--merge-lists", type=int, default=8)
    p.add_argument("--merge-mb", type=float, default=100.0)
    args = p.parse_args(argv)
    rt = round_trips(args.repeats, args.small_repeats)
    mk = merge_kernels(max(3, args.repeats // 2), args.merge_lists, args.merge_mb)
    wb = wire_bytes()
    body = "\n".join(
        [
            "## Tensor data plane",
            "",
            f"Command: `python -m benchmarks tensor --repeats {args.repeats} --small-repeats {args.small_repeats} "
            f"--merge-lists {args.merge_lists} "
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
            "sending thread each; the 2-worker rows are compared with that); memcpy copies them once. The workers "
            "start as `Cluster.local` starts them (Keras preloaded in the background); measuring begins once that "
            "import is done, so a TensorFlow import on the same 2 cores is not timed as the data plane.",
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
