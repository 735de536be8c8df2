"""RPC latency: a no-op call to one worker and to all workers, next to a raw Python socket echo (the floor)."""

from __future__ import annotations

import argparse
import time

from ..cluster import Cluster
from . import report
from .baselines import RawEcho


def _noop() -> None:
    return None


def run(rounds: int = 10, calls_per_round: int = 500, n_workers: int = 2) -> dict[str, list[float]]:
    one, every = "ddlf call, 1 worker", f"ddlf call, all {n_workers} workers"
    samples: dict[str, list[float]] = {
        "raw socket echo": [],
        "ddlf ping (Rust only, gRPC)": [],
        one: [],
        every: [],
        f"{one}, gRPC only": [],
        f"{every}, gRPC only": [],
    }
    with Cluster.local(n_workers, threads=1) as cluster:
        cluster.add_function(_noop, "noop")
        # The same daemons through a second master that never opens direct lanes: what the lanes save.
        assert cluster._local is not None
        grpc = Cluster(cluster.addresses, cluster._local.token, direct_lane=False)
        echo = RawEcho()
        payload = b"x" * 64
        client = cluster._client
        # Warm up every path.
        for _ in range(200):
            echo.round_trip(payload)
            for c in (cluster, grpc):
                c.run_on(0, "noop")
                c.run("noop")
        for _ in range(rounds):  # interleaved blocks, so drift hits every contender alike
            s = samples["raw socket echo"]
            for _ in range(calls_per_round):
                s.append(echo.round_trip(payload))
            s = samples["ddlf ping (Rust only, gRPC)"]
            for _ in range(calls_per_round):
                s.append(client.heartbeat([0])[0][0])
            for c, suffix in ((cluster, ""), (grpc, ", gRPC only")):
                s = samples[one + suffix]
                for _ in range(calls_per_round):
                    t0 = time.perf_counter()
                    c.run_on(0, "noop")
                    s.append(time.perf_counter() - t0)
                s = samples[every + suffix]
                for _ in range(calls_per_round):
                    t0 = time.perf_counter()
                    c.run("noop")
                    s.append(time.perf_counter() - t0)
        echo.close()
        grpc.close()
    return samples


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ddlf.bench rpc", description=__doc__)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--calls", type=int, default=500, help="calls per round per contender")
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args(argv)
    samples = run(args.rounds, args.calls, args.workers)
    floor = report.median(samples["raw socket echo"])
    rows = []
    for name, s in samples.items():
        p50 = report.median(s)
        rows.append(
            [
                name,
                f"{p50 * 1e6:.0f}",
                f"{report.percentile(s, 99) * 1e6:.0f}",
                f"{1 / p50:,.0f}",
                f"{p50 / floor:.2f}x",
            ]
        )
    body = "\n".join(
        [
            "## RPC latency (no-op call)",
            "",
            f"Command: `python -m ddlf.bench rpc --rounds {args.rounds} --calls {args.calls} "
            f"--workers {args.workers}`  ",
            f"Machine: {report.machine()}",
            "",
            f"{args.rounds} interleaved rounds of {args.calls} sequential calls per contender; the raw socket echo "
            "is a length-prefixed 64-byte echo between two Python processes over loopback TCP (the floor). "
            "A ddlf call is `cluster.run_on(0, 'noop')` (or `cluster.run('noop')` on all workers): pickle the "
            "arguments, send them on the worker's direct lane (a plain TCP connection whose frames the worker's "
            "interpreter thread reads and answers itself), run, pickle the result, and back. The 'gRPC only' rows "
            "are the same calls from a second master connected to the same daemons with `direct_lane=False`: "
            "HTTP/2 to the daemon's network thread, handed to its Python thread and back.",
            "",
            report.table(["path", "p50 (µs)", "p99 (µs)", "calls/s at p50", "p50 vs floor"], rows),
            "",
            "Target (issue 2): p50 no-op call to one worker at most 1.5x the raw-socket floor.",
        ]
    )
    path = report.write_section("rpc", body)
    print(body)
    print(f"\nwritten to {path}")
