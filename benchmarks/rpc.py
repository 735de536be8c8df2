"""RPC latency: a no-op call to one worker and to all workers, next to a raw Python socket echo (the floor)."""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from typing import Any

from ddlf.cluster.cluster import Cluster

from . import report
from .baselines import RawEcho


def _noop() -> None:
    return None


def _timed(samples: list[float], calls: int, fn: Any, *args: Any) -> None:
    for _ in range(calls):
        t0 = time.perf_counter()
        fn(*args)
        samples.append(time.perf_counter() - t0)


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process ``pid`` onto ``cpus`` (``sched_setaffinity`` moves one thread; threads started later
    inherit their creator's mask)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that has just ended
            os.sched_setaffinity(int(tid), cpus)


def run(
    rounds: int = 10, calls_per_round: int = 500, n_workers: int = 2, spin_us: int = 100, one_cpu: bool = False
) -> dict[str, list[float]]:
    """Each contender's call times (seconds), ``calls_per_round`` per round. ``one_cpu``: the master (this
    process) and every server (daemons, the echo's servers) on one CPU, so that every run has the same placement:
    where the scheduler puts two processes that ping-pong moves a plain round trip about 3x on a small VM (22 µs on
    one core, 65 µs across two, where each reply wakes the other core), and on one CPU what a round trip costs is
    the software's own work, which is what a change of the code moves."""
    one, every = "ddlf call, 1 worker", f"ddlf call, all {n_workers} workers"
    floor, floor_spin = "raw socket echo", f"raw socket echo, both ends busy-polling {spin_us} µs"
    no_spin = ", lane without busy-polling"
    samples: dict[str, list[float]] = {
        floor: [],
        floor_spin: [],
        "ddlf ping (Rust only, ping lane)": [],
        "ddlf ping, gRPC only": [],
        one: [],
        every: [],
        one + no_spin: [],
        every + no_spin: [],
        f"{one}, gRPC only": [],
        f"{every}, gRPC only": [],
    }
    with (
        Cluster.local(n_workers, threads=1, lane_spin_us=spin_us) as cluster,
        Cluster.local(n_workers, threads=1, lane_spin_us=0) as quiet,
    ):
        # The first daemons again, through a second master that never opens direct lanes: what the lanes save.
        assert cluster._local is not None
        grpc = Cluster(cluster.addresses, cluster._local.token, direct_lane=False)
        for c in (cluster, quiet):
            c.add_function(_noop, "noop")
        echo, echo_spin = RawEcho(), RawEcho(spin_us=spin_us)
        mask = os.sched_getaffinity(0)
        if one_cpu:
            assert quiet._local is not None
            cpu = {min(mask)}
            for pid in [*cluster._local.pids(), *quiet._local.pids(), echo.proc.pid, echo_spin.proc.pid]:
                pin(pid, cpu)
            pin(os.getpid(), cpu)
        payload = b"x" * 64
        client = cluster._client
        # Warm up every path.
        for _ in range(200):
            echo.round_trip(payload)
            echo_spin.round_trip(payload)
            for c in (cluster, quiet, grpc):
                c.run_on(0, "noop")
                c.run("noop")
        for _ in range(rounds):  # interleaved blocks, so drift hits every contender alike
            samples[floor] += [echo.round_trip(payload) for _ in range(calls_per_round)]
            samples[floor_spin] += [echo_spin.round_trip(payload) for _ in range(calls_per_round)]
            samples["ddlf ping (Rust only, ping lane)"] += [client.heartbeat([0])[0][0] for _ in range(calls_per_round)]
            samples["ddlf ping, gRPC only"] += [grpc._client.heartbeat([0])[0][0] for _ in range(calls_per_round)]
            for c, suffix in ((cluster, ""), (quiet, no_spin), (grpc, ", gRPC only")):
                _timed(samples[one + suffix], calls_per_round, c.run_on, 0, "noop")
                _timed(samples[every + suffix], calls_per_round, c.run, "noop")
        echo.close()
        echo_spin.close()
        grpc.close()
        if one_cpu:
            pin(os.getpid(), mask)
    return samples


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks rpc", description=__doc__)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--calls", type=int, default=500, help="calls per round per contender")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--spin-us", type=int, default=100, help="busy-polling of the lanes (and of the raw echo's row)")
    p.add_argument(
        "--one-cpu",
        action="store_true",
        help="every process on one CPU (the guard's placement; BENCHMARKS.md section rpc-one-cpu)",
    )
    args = p.parse_args(argv)
    samples = run(args.rounds, args.calls, args.workers, args.spin_us, one_cpu=args.one_cpu)
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
            "## RPC latency (no-op call)" + (", every process on one CPU" if args.one_cpu else ""),
            "",
            f"Command: `python -m benchmarks rpc --rounds {args.rounds} --calls {args.calls} "
            f"--workers {args.workers} --spin-us {args.spin_us}{' --one-cpu' if args.one_cpu else ''}`  ",
            f"Machine: {report.machine()}",
            "",
            f"{args.rounds} interleaved rounds of {args.calls} sequential calls per contender; the raw socket echo "
            "is a length-prefixed 64-byte echo between two Python processes over loopback TCP (the floor). "
            "A ddlf call is `cluster.run_on(0, 'noop')` (or `cluster.run('noop')` on all workers): pickle the "
            "arguments, send them on the worker's direct lane (a plain TCP connection whose frames the worker's "
            "interpreter thread reads and answers itself), run, pickle the result, and back. The 'gRPC only' rows "
            "are the same calls from a second master connected to the same daemons with `direct_lane=False`: "
            "HTTP/2 to the daemon's network thread, handed to its Python thread and back. Rust's ping is "
            "`Cluster.ping()` to worker 0 (no Python on the worker): on the master's ping lane, a third connection "
            "whose pings a daemon thread of their own reads and answers, and from the gRPC-only master over gRPC, "
            "answered by the daemon's network thread. On a lane both ends "
            f"busy-poll up to {args.spin_us} µs (non-blocking reads, yielding the CPU) before they sleep, so a quick "
            "reply or next request costs no wake-up; the 'without busy-polling' rows are a second set of daemons "
            "and master with `lane_spin_us=0`, and the busy-polling raw echo applies the same technique to the "
            "floor. Ratios are to the plain raw echo, measured in the same run."
            + (
                " Here the master, the daemons and the echo's servers all run on one CPU (the placement of "
                "`python -m benchmarks guard`): no reply wakes another core, so what is left is each path's own "
                "work, and the ratios repeat within a few percent from run to run."
                if args.one_cpu
                else " Where the scheduler puts two processes that ping-pong moves every path that sleeps between "
                "messages (the plain echo, a lane without busy-polling, gRPC) by up to 3x from run to run on a "
                "2-core VM: 22 µs on one core, 65 µs across two, where each reply wakes the other core. Compare "
                "ratios from one run only; `--one-cpu` fixes the placement."
            ),
            "",
            report.table(["path", "p50 (µs)", "p99 (µs)", "calls/s at p50", "p50 vs floor"], rows),
            "",
            "Targets: a no-op call to one worker at most 1.5x the raw echo (issue 2); at most 1.0x, to all workers "
            "and Rust's ping at most 1.5x (issue 62, on the default placement).",
        ]
    )
    path = report.write_section("rpc-one-cpu" if args.one_cpu else "rpc", body)
    print(body)
    print(f"\nwritten to {path}")
