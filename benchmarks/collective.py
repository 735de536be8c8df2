"""The workers' ring all-reduce (``cluster.allreduce``): time, algorithm bandwidth and bus bandwidth.

    .venv/bin/python -m benchmarks collective [--mb 100] [--repeat 5]            # loopback only
    sudo .venv/bin/python -m benchmarks collective --hosts 4,8 --rates 1000,10000 # + hosts in network namespaces

NCCL's definitions: ``algbw = size / time``; ``busbw = algbw * 2 (n-1) / n``, the rate each rank's link carries
in a ring all-reduce (so busbw is comparable with the link rate whatever ``n``). Loopback: ``n`` local workers
against a raw TCP socket moving the same bytes between two threads of one process, in the same run (the
machine's loopback copy rate). Namespaces: one worker per host, every link (the master's too) capped with
``tbf`` on both ends; the data is made on the workers, so only the ring's bytes cross the links. Medians over
``--repeat`` reductions after one warm-up (which opens the ring's links).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

import ddlf

from . import netns, report

TOKEN = "bench-collective"


BUCKETS = 6
"""Arrays of distinct lengths that :func:`measure` reduces one call each, as a model's gradient buckets go."""


def bucket_lengths(elements: int) -> list[int]:
    """:data:`BUCKETS` distinct lengths (in the ratios 6:5:4:3:2:1, as a model's layers differ) that hold
    ``elements`` together."""
    weights = range(BUCKETS, 0, -1)
    lengths = [elements * w // sum(weights) for w in weights]
    lengths[0] += elements - sum(lengths)
    return lengths


def fill(worker: Any, elements: int, seed: int, parts: int = 4) -> int:
    """Run on a worker: the variable ``x`` holds ``elements`` float32 values of its own, ``xs`` as many as a
    list of ``parts`` arrays (model weights are lists), and ``b0``, ``b1``, ... as many as :data:`BUCKETS`
    arrays of distinct lengths."""
    worker.vars["x"] = np.random.default_rng(seed).standard_normal(elements, dtype=np.float32)
    worker.vars["xs"] = [a.copy() for a in np.array_split(worker.vars["x"], parts)]
    at = 0
    for i, length in enumerate(bucket_lengths(elements)):
        worker.vars[f"b{i}"] = worker.vars["x"][at : at + length].copy()
        at += length
    return int(worker.vars["x"].nbytes)


def measure(
    cluster: ddlf.Cluster, mb: float, repeat: int, streams: int = 1, hierarchical: bool | None = None
) -> dict[str, Any]:
    """Median seconds of ``cluster.allreduce`` over ``mb`` megabytes as one array, as a list of four arrays, and
    as :data:`BUCKETS` arrays of distinct lengths, one call each (a model's gradient buckets; the three
    interleaved), and the one array's bandwidths."""
    n = len(cluster)
    elements = int(mb * 1e6) // 4
    size = cluster.run_each(fill, [(elements, i) for i in range(n)])[0]
    calls = {"x": ["x"], "xs": ["xs"], "buckets": [f"b{i}" for i in range(BUCKETS)]}
    times: dict[str, list[float]] = {what: [] for what in calls}
    for names in calls.values():  # warm-up: opens the ring's links, maps the shared memory
        for name in names:
            cluster.allreduce(name, "sum", streams=streams, hierarchical=hierarchical)
    for _ in range(repeat):
        for what, got in times.items():
            t0 = time.perf_counter()
            for name in calls[what]:
                cluster.allreduce(name, "sum", streams=streams, hierarchical=hierarchical)
            got.append(time.perf_counter() - t0)
    t = report.median(times["x"])
    algbw = size / t
    mode = {None: "auto", True: "hierarchical", False: "flat"}[hierarchical]
    return {
        "n": n,
        "mode": mode,
        "bytes": size,
        "seconds": t,
        "list_seconds": report.median(times["xs"]),
        "buckets_seconds": report.median(times["buckets"]),
        "algbw": algbw,
        "busbw": algbw * 2 * (n - 1) / n,
    }


def memcpy(nbytes: int, repeat: int) -> float:
    """Median seconds of one numpy copy of ``nbytes`` into a warm destination (the machine's memory anchor)."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    times = []
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return report.median(times[1:])


def raw_socket(nbytes: int, repeat: int) -> float:
    """Median seconds to move ``nbytes`` through one loopback TCP connection (sender and receiver threads)."""
    payload = np.ones(nbytes, np.uint8)
    sink = bytearray(1 << 22)
    times = []
    for _ in range(repeat):
        srv = socket.create_server(("127.0.0.1", 0))
        a = socket.create_connection(srv.getsockname())
        b, _ = srv.accept()

        def send(a: socket.socket = a) -> None:
            a.sendall(memoryview(payload))

        t0 = time.perf_counter()
        th = threading.Thread(target=send)
        th.start()
        got = 0
        view = memoryview(sink)
        while got < nbytes:
            got += b.recv_into(view)
        th.join()
        times.append(time.perf_counter() - t0)
        for s in (a, b, srv):
            s.close()
    return report.median(times)


def raw_serve(port: int, nbytes: int, repeat: int) -> None:
    """Run on a host: receive ``nbytes`` ``repeat`` times on ``port``, answering one byte after each."""
    srv = socket.create_server(("0.0.0.0", port))
    print("ready", flush=True)
    sink = memoryview(bytearray(1 << 22))
    for _ in range(repeat):
        conn, _ = srv.accept()
        got = 0
        while got < nbytes:
            k = conn.recv_into(sink)
            if not k:
                break
            got += k
        conn.sendall(b"k")
        conn.close()


def raw_send(address: str, nbytes: int, repeat: int) -> float:
    """Run on a host: median seconds to send ``nbytes`` to :func:`raw_serve` and hear that all arrived."""
    host, port = address.rsplit(":", 1)
    payload = memoryview(np.ones(nbytes, np.uint8))
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        with socket.create_connection((host, int(port))) as s:
            s.sendall(payload)
            s.recv(1)
        times.append(time.perf_counter() - t0)
    return report.median(times)


def master(spec: dict[str, Any]) -> dict[str, Any]:
    """Run in the master's namespace."""
    with ddlf.Cluster(spec["addresses"], token=TOKEN, timeout=600) as c:
        return measure(c, spec["mb"], spec["repeat"], spec.get("streams", 1))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks collective", description=__doc__)
    p.add_argument("--mb", type=float, default=100.0, help="megabytes reduced (float32)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--local", default="2,4", help="local worker counts on loopback")
    p.add_argument("--hosts", default="", help="host counts in network namespaces (needs root), e.g. 4,8")
    p.add_argument("--rates", default="1000,10000", help="link caps in Mbit/s for the namespace hosts")
    p.add_argument("--master", help=argparse.SUPPRESS)
    p.add_argument("--raw-serve", help=argparse.SUPPRESS)
    p.add_argument("--raw-send", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.master:
        print(json.dumps(master(json.loads(args.master))))
        return
    if args.raw_serve:
        raw_serve(**json.loads(args.raw_serve))
        return
    if args.raw_send:
        print(json.dumps(raw_send(**json.loads(args.raw_send))))
        return
    t_start = time.perf_counter()
    local_rows = []
    for n in [int(x) for x in args.local.split(",") if x]:
        # No framework preload: its imports would compete with the first measurements for the cores.
        with ddlf.Cluster.local(n, threads=1, preload=None) as c:
            # Flat: every worker on the loopback ring; hierarchical: one host, so all of it in shared memory.
            rows = [measure(c, args.mb, args.repeat, hierarchical=h) for h in (False, True)]
        raw = raw_socket(rows[0]["bytes"], args.repeat)
        copy = memcpy(rows[0]["bytes"], args.repeat)
        for r in rows:
            r["raw_bw"] = r["bytes"] / raw
            r["memcpy_bw"] = r["bytes"] / copy
            r["memcpy_seconds"] = copy
            local_rows.append(r)
            print(
                f"loopback n={n} {r['mode']}: {r['seconds']:.3f} s (list of 4: {r['list_seconds']:.3f} s, "
                f"{BUCKETS} buckets: {r['buckets_seconds']:.3f} s), busbw "
                f"{r['busbw'] / 1e9:.2f} GB/s, raw socket "
                f"{r['raw_bw'] / 1e9:.2f} GB/s, memcpy {r['memcpy_bw'] / 1e9:.2f} GB/s"
            )
    ns_rows = []
    counts = [int(x) for x in args.hosts.split(",") if x]
    if counts:
        ok, why = netns.available()
        if not ok:
            sys.exit(f"ddlf bench collective: {why}")
        work = tempfile.mkdtemp(prefix="ddlf-bench-collective-")
        with netns.VirtualNetwork(max(counts)) as net:
            addresses = netns.start_workers(net, work, token=TOKEN, threads=1)
            for rate in [float(x) for x in args.rates.split(",") if x]:
                for host in [net.master, *net.hosts]:
                    net.shape(host, rate)
                raw = _raw_between(net, int(args.mb * 1e6) // 4 * 4, args.repeat)
                for n in counts:
                    spec = {"addresses": addresses[:n], "mb": args.mb, "repeat": args.repeat}
                    argv_m = [sys.executable, "-m", "benchmarks.collective", "--master", json.dumps(spec)]
                    done = net.run(net.master, argv_m, timeout=900)
                    if done.returncode != 0:
                        raise RuntimeError(f"the master failed: {done.stderr[-3000:]}")
                    r = json.loads(done.stdout.strip().splitlines()[-1])
                    r["rate_bps"] = rate * 1e6 / 8
                    r["raw_bw"] = raw
                    ns_rows.append(r)
                    print(
                        f"{rate:.0f} Mbit/s n={n}: {r['seconds']:.3f} s, busbw {r['busbw'] * 8 / 1e6:.0f} Mbit/s "
                        f"({100 * r['busbw'] / r['rate_bps']:.0f}% of the link)"
                    )
    body = _markdown(args, local_rows, ns_rows, time.perf_counter() - t_start)
    path = report.write_section("collective", body)
    print(f"wrote the collective section of {path}")


def _raw_between(net: netns.VirtualNetwork, nbytes: int, repeat: int) -> float:
    """Bytes per second of one raw TCP stream from host 0 to host 1 over the same shaped links."""
    server = net.popen(
        net.hosts[1],
        [
            sys.executable,
            "-m",
            "benchmarks.collective",
            "--raw-serve",
            json.dumps({"port": 7999, "nbytes": nbytes, "repeat": repeat}),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        spec = {"address": f"{net.hosts[1].ip}:7999", "nbytes": nbytes, "repeat": repeat}
        done = net.run(net.hosts[0], [sys.executable, "-m", "benchmarks.collective", "--raw-send", json.dumps(spec)])
        if done.returncode != 0:
            raise RuntimeError(f"the raw sender failed: {done.stderr[-2000:]}")
        return nbytes / float(done.stdout.strip().splitlines()[-1])
    finally:
        server.wait(30)


def _markdown(args: argparse.Namespace, local_rows: list[dict], ns_rows: list[dict], took: float) -> str:
    cmd = "python -m benchmarks collective"
    if args.hosts:
        cmd = f"sudo .venv/bin/{cmd} --hosts {args.hosts} --rates {args.rates}"
    lines = [
        "## Ring all-reduce among workers (`cluster.allreduce`)",
        "",
        f"`{cmd}` · {report.machine()} · {took:.0f} s",
        "",
        f"{args.mb:.0f} MB of float32 summed across n workers, worker to worker over a ring (reduce-scatter then "
        f"all-gather, pipelined; the master carries no data). Medians of {args.repeat} after a warm-up. "
        "algbw = size / time; busbw = algbw x 2(n-1)/n (NCCL's definition: what each worker's link carries).",
    ]
    if local_rows:
        lines += [
            "",
            "Loopback, local workers (one process each) on one host: *flat* is the ring over loopback TCP; "
            "*hierarchical* (the default when a host runs several workers) sums through shared memory and opens "
            "no socket. Anchors from the same run: one raw TCP socket moving the same bytes, and one numpy copy "
            "of them (the hierarchical stage reads every member's array and writes the result back to each). "
            "*list of 4* reduces the same bytes as a list of four arrays (model weights are lists), interleaved "
            f"with the one array; *{BUCKETS} buckets* reduces the same bytes as {BUCKETS} arrays of distinct lengths "
            "(6:5:4:3:2:1), one call each, as a model's gradient buckets go at every step (a host keeps 4 "
            "shared-memory files; a call reuses any that holds at least its length); *copies* is the one array's "
            "time in numpy copies of its size:",
            "",
            report.table(
                [
                    "workers",
                    "mode",
                    "seconds",
                    "list of 4 s",
                    "list / one array",
                    f"{BUCKETS} buckets s",
                    "buckets / one array",
                    "copies",
                    "algbw GB/s",
                    "busbw GB/s",
                    "raw socket GB/s",
                    "busbw / raw socket",
                    "memcpy GB/s",
                ],
                [
                    [
                        r["n"],
                        r["mode"],
                        f"{r['seconds']:.3f}",
                        f"{r['list_seconds']:.3f}",
                        f"{r['list_seconds'] / r['seconds']:.2f}",
                        f"{r['buckets_seconds']:.3f}",
                        f"{r['buckets_seconds'] / r['seconds']:.2f}",
                        f"{r['seconds'] / r['memcpy_seconds']:.1f}",
                        f"{r['algbw'] / 1e9:.2f}",
                        f"{r['busbw'] / 1e9:.2f}",
                        f"{r['raw_bw'] / 1e9:.2f}",
                        f"{r['busbw'] / r['raw_bw']:.2f}",
                        f"{r['memcpy_bw'] / 1e9:.2f}",
                    ]
                    for r in local_rows
                ],
            ),
        ]
    if ns_rows:
        lines += [
            "",
            "Hosts in network namespaces, one worker each, every link capped with `tbf` on both ends; *raw TCP* is "
            "one plain socket moving the same bytes from host 0 to host 1 over the same shaped links, in the same "
            "run:",
            "",
            report.table(
                [
                    "link",
                    "hosts",
                    "seconds",
                    "algbw Mbit/s",
                    "busbw Mbit/s",
                    "busbw / link",
                    "raw TCP Mbit/s",
                    "busbw / raw TCP",
                ],
                [
                    [
                        f"{r['rate_bps'] * 8 / 1e6:.0f} Mbit/s",
                        r["n"],
                        f"{r['seconds']:.3f}",
                        f"{r['algbw'] * 8 / 1e6:.0f}",
                        f"{r['busbw'] * 8 / 1e6:.0f}",
                        f"{100 * r['busbw'] / r['rate_bps']:.0f}%",
                        f"{r['raw_bw'] * 8 / 1e6:.0f}",
                        f"{r['busbw'] / r['raw_bw']:.2f}",
                    ]
                    for r in ns_rows
                ],
            ),
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
