"""The call path's guard (issue 62): the rpc benchmark's ratios, checked at a wide margin, for CI.

``python -m benchmarks guard`` measures what ``python -m benchmarks rpc`` measures (a no-op call to one worker and to
all workers over the direct lanes, with and without busy-polling, a call over gRPC only, Rust's ping on its lane and
over gRPC) beside the raw
socket echo in the same process and the same rounds, and fails (exit status 1) when a path's time over its floor
passes its limit. Only ratios are checked, never an absolute time: a shared or slower machine moves the floor and
the paths alike. Each ratio is the median over rounds of that round's medians (the rounds interleave the contenders,
so drift hits them alike).

Every process runs on one CPU: where the scheduler puts two processes that ping-pong moves a plain round trip about
3x on a small VM (22 µs on one core, 65 µs across two, where every reply wakes the other core), which would drown a
2x regression; on one CPU the ratios repeat within a few percent from run to run on one machine.

Across machines of the same kind they do not: on two 2-core AMD EPYC VMs of this workplace (kernels fc-v657 and
fc-v669) the same tree (cadf44d, where the guard was set) measured a call to one worker at 1.11x and 1.75-1.86x the
echo, a call to all workers at 2.54x and 4.8-5.0x, Rust's ping at 3.5x and 4.6-4.7x: a cheap process pair (the
echo) gets 1.13x slower from the one VM to the other, ddlf's paths 1.5-2.1x (large processes with many threads,
switched on one CPU). So each path is checked over the cheaper path it is built on, whose processes are as large:
a call over Rust's gRPC ping (the Python dispatch and the lane over a gRPC round trip of the same daemons), a call
to all workers over a call to one, a lane without busy-polling over one with it, gRPC calls over the gRPC ping;
only the pings are checked over the echo, and the call over the echo at a margin that holds on both VMs. The ping
lane (issue 62's last part) was measured on one VM only: its limit catches a ping that falls back to gRPC. The
other ratios moved at most 1.3x between the two VMs; the limits sit 1.5x or more above the higher one
(``typical``), and below twice the lower one: a path that becomes twice as slow fails on either, noise does not. A
check that fails is measured again, up to ``--attempts`` times, and fails the guard only if it failed every time (a
burst of load from outside passes; a regression fails each time). Nothing is written to BENCHMARKS.md: this is a
check, the rpc benchmark is the record.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass

from . import report
from .rpc import run


@dataclass(frozen=True)
class Limit:
    """A path's time over its floor's, at most ``most`` (today's value on the CI machine: ``typical``)."""

    path: str
    floor: str
    most: float
    typical: float

    @property
    def name(self) -> str:
        return f"{self.path} over {self.floor}"


def limits(n_workers: int) -> list[Limit]:
    """What is checked, each path over the path it builds on, every process on one CPU (``rpc.run(one_cpu=True)``:
    the same placement in every run, so the ratios move with the code, not with the scheduler). ``typical``: the
    higher of the two VMs' values (the other's in the comment)."""
    one, every = "ddlf call, 1 worker", f"ddlf call, all {n_workers} workers"
    echo, ping = "raw socket echo", "ddlf ping, gRPC only"
    return [
        # Measured on one VM only (fc-v669, 2026-11-29): 0.57x; below twice that, so a ping that falls back to gRPC
        # (4.7x) or twice as slow a lane fails.
        Limit("ddlf ping (Rust only, ping lane)", echo, 1.1, 0.57),
        Limit(ping, echo, 6.2, 4.7),  # 3.53x on the other VM
        Limit(one, ping, 0.58, 0.38),  # 0.31x
        Limit(every, one, 3.9, 2.7),  # 2.30x
        Limit(f"{one}, lane without busy-polling", one, 1.6, 1.04),  # 0.98x
        Limit(f"{one}, gRPC only", ping, 3.4, 2.34),  # 1.80x
        Limit(one, echo, 2.9, 1.86),  # 1.11x: the "call over echo", at a margin both VMs pass
    ]


def round_ratios(samples: dict[str, list[float]], path: str, floor: str, rounds: int) -> list[float]:
    """Per round, the path's median over the floor's median (``run`` appends the same count per round)."""
    per = len(samples[path]) // rounds
    per_floor = len(samples[floor]) // rounds
    return [
        report.median(samples[path][r * per : (r + 1) * per])
        / report.median(samples[floor][r * per_floor : (r + 1) * per_floor])
        for r in range(rounds)
    ]


def measure(rounds: int, calls: int, n_workers: int, spin_us: int) -> dict[str, float]:
    """Each check's ratio (by :attr:`Limit.name`) in one run."""
    samples = run(rounds, calls, n_workers, spin_us, one_cpu=True)
    return {
        lim.name: statistics.median(round_ratios(samples, lim.path, lim.floor, rounds)) for lim in limits(n_workers)
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks guard", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--calls", type=int, default=300, help="calls per round per contender")
    p.add_argument("--workers", type=int, default=2, help="the limits are set for 2 (what CI runs)")
    p.add_argument("--spin-us", type=int, default=100)
    p.add_argument("--attempts", type=int, default=3, help="measurements a failing check gets before it fails")
    args = p.parse_args(argv)
    for name in ("rounds", "calls", "workers", "attempts"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.spin_us < 0:
        p.error(f"--spin-us must be >= 0, got {args.spin_us}")
    checks = limits(args.workers)
    failing: list[Limit] = []
    best: dict[str, float] = {}
    for attempt in range(1, args.attempts + 1):
        ratios = measure(args.rounds, args.calls, args.workers, args.spin_us)
        for lim in checks:
            best[lim.name] = min(best.get(lim.name, ratios[lim.name]), ratios[lim.name])
        failing = [lim for lim in checks if best[lim.name] > lim.most]
        print(f"attempt {attempt}: " + ", ".join(f"{lim.name} {ratios[lim.name]:.2f}x" for lim in checks))
        if not failing:
            break
    rows = [
        [
            lim.path,
            lim.floor,
            f"{best[lim.name]:.2f}x",
            f"{lim.typical:.2f}x",
            f"{lim.most:.2f}x",
            "ok" if best[lim.name] <= lim.most else "TOO SLOW",
        ]
        for lim in checks
    ]
    print(report.table(["path", "over", "ratio (best attempt)", "typical", "limit", ""], rows))
    print(f"Machine: {report.machine()}")
    if failing:
        names = "; ".join(f"{lim.name}: {best[lim.name]:.2f}x (limit {lim.most:.2f}x)" for lim in failing)
        print(f"\nthe call path is slower than its guard allows, in every one of {args.attempts} attempts: {names}")
        sys.exit(1)


if __name__ == "__main__":
    main()
