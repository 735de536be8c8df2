"""Projecting sync training to larger clusters from measured per-round compute and communication.

The model (the master is the parameter server, workers hang off it in a star):

    round(n, B)  = compute + comm(n, B)
    comm(n, B)   = 2 * rtt + n * (down + up) * 8 / (B * efficiency)
    epoch(n, B)  = rounds(n) * round(n, B),   rounds(n) = samples / (n * batches_per_round * batch)

``compute`` is a worker's time for one round's batches; ``down`` the bytes the master sends each worker per
round (the weights: the broadcast is serialized once but every copy crosses the master's link), ``up`` what each
worker sends back (weights, or a float16 / top-k delta); ``rtt`` the round trip of the master's link (two
requests per round); ``efficiency`` the share of the link's nominal bandwidth that ddlf achieves, calibrated
on the smallest measured cluster at 1 Gbit/s. The master's link carries ``n * (down + up)`` bytes per round,
so communication per epoch stays constant as ``n`` grows while compute per epoch shrinks as ``1/n``: speed-up
saturates once ``n * (down + up) * 8 / B`` approaches the per-round compute. That is the MareNostrum lesson, and
the reason compression (smaller ``up``) and more batches per round (fewer rounds) pay off on big clusters.

    python -m benchmarks project network.json [--samples 1000000] [--workers 8,64,512] [--gbits 10,25,100]

reads the measurements written by ``python -m benchmarks network`` (``network.json`` in the work directory it
prints).
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

BATCH = 64
AVG_FREQ = 5


def comm_seconds(n: int, gbits: float, down: float, up: float, efficiency: float, rtt: float = 0.0) -> float:
    """Seconds of communication per round for ``n`` workers on a ``gbits`` Gbit/s master link."""
    return 2 * rtt + n * (down + up) * 8 / (gbits * 1e9 * efficiency)


def epoch_seconds(
    n: int, gbits: float, samples: int, batch_seconds: float, down: float, up: float, efficiency: float,
    rtt: float = 0.0, batches_per_round: int = AVG_FREQ, batch: int = BATCH,
) -> float:  # fmt: skip
    """Projected seconds per epoch of ``samples`` rows."""
    rounds = math.ceil(samples / (n * batches_per_round * batch))
    return rounds * (batches_per_round * batch_seconds + comm_seconds(n, gbits, down, up, efficiency, rtt))


def calibrate(scaling: list[dict[str, Any]], gbits: float = 1.0) -> float:
    """Achieved share of nominal bandwidth, from the smallest measured cluster (comm = wall - compute)."""
    base = min(scaling, key=lambda r: r["workers"])
    comm = max(1e-9, base["wall"] - base["compute"])
    return base["workers"] * (base["bytes_down"] + base["bytes_up"]) * 8 / (gbits * 1e9) / comm


def check(scaling: list[dict[str, Any]], gbits: float = 1.0) -> list[dict[str, float]]:
    """Measured vs predicted round time at each measured worker count (each with its own measured compute)."""
    eff = calibrate(scaling, gbits)
    out = []
    for r in sorted(scaling, key=lambda r: r["workers"]):
        predicted = r["compute"] + comm_seconds(r["workers"], gbits, r["bytes_down"], r["bytes_up"], eff)
        out.append({"workers": r["workers"], "measured": r["wall"], "predicted": predicted})
    return out


def markdown(
    table: list[tuple[str, str | None, dict[str, Any]]],
    scaling: list[dict[str, Any]],
    samples: int = 1_000_000,
    workers: tuple[int, ...] = (8, 64, 512),
    gbits: tuple[float, ...] = (10, 25, 100),
) -> str:
    """The projection section: the model checked against the namespaces, then the projected table."""
    eff = calibrate(scaling)
    lines = [
        "### Projection to larger clusters (`benchmarks.project`)",
        "",
        "Model: round = compute + 2·rtt + n·(down + up)·8 / (B·efficiency); epoch = rounds(n) · round (see "
        f"`python/ddlf/bench/project.py`). Efficiency calibrated at {min(r['workers'] for r in scaling)} "
        f"workers, 1 Gbit/s: **{eff:.2f}** of nominal. Checked against the namespaces at 1 Gbit/s (each row "
        "with its own measured compute; the 2 cores are shared by all workers, so compute grows with n):",
        "",
        "| workers | measured s/round | predicted s/round | error |",
        "|---:|---:|---:|---:|",
    ]
    for c in check(scaling):
        err = (c["predicted"] - c["measured"]) / c["measured"] * 100
        lines.append(f"| {c['workers']} | {c['measured']:.3f} | {c['predicted']:.3f} | {err:+.0f}% |")
    fast = {comp: r for label, comp, r in table if label == "10 Gbit/s"}
    base = fast.get(None) or table[0][2]
    batch_s = base["batch_seconds"]
    lines += [
        "",
        f"Projected seconds per epoch of {samples:,} samples (wide MLP, batch {BATCH}, {AVG_FREQ} batches per "
        f"round, {batch_s * 1000:.1f} ms per batch as measured on one core here, rtt 0.1 ms), by master link "
        "speed and compression:",
        "",
        "| workers | link | none | float16 | top-k 1% | compute only |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for n in workers:
        for g in gbits:
            cells = []
            for comp in (None, "float16", "topk"):
                r = fast.get(comp, base)
                cells.append(epoch_seconds(n, g, samples, batch_s, r["bytes_down"], r["bytes_up"], eff, rtt=1e-4))
            compute_only = math.ceil(samples / (n * AVG_FREQ * BATCH)) * AVG_FREQ * batch_s
            lines.append(
                f"| {n} | {g:g} Gbit/s | " + " | ".join(f"{c:,.1f}" for c in cells) + f" | {compute_only:,.1f} |"
            )
    r0 = fast.get(None, base)
    floor = samples / (AVG_FREQ * BATCH) * (r0["bytes_down"] + r0["bytes_up"]) * 8 / (gbits[0] * 1e9 * eff)
    lines += [
        "",
        f"Reading it: each round the master's link carries n copies of the weights down and n replies up, while "
        f"the rounds per epoch shrink as 1/n, so communication per epoch does not shrink with n: with no "
        f"compression it is about {floor:,.0f} s per epoch at {gbits[0]:g} Gbit/s whatever the cluster size, and "
        "compute only shrinks under it. Compressing the upload (float16, top-k) lowers that floor, the dense "
        "download of the averaged weights does not shrink; beyond it, fewer rounds (a larger "
        "`averaging_frequency`) or a hierarchical / all-reduce exchange (not in ddlf yet) is what scales.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks project", description=__doc__)
    p.add_argument("measurements", help="network.json written by python -m benchmarks network")
    p.add_argument("--samples", type=int, default=1_000_000)
    p.add_argument("--workers", default="8,64,512")
    p.add_argument("--gbits", default="10,25,100")
    args = p.parse_args(argv)
    with open(args.measurements) as f:
        data = json.load(f)
    table = [(label, comp, r) for label, comp, r in data["table"]]
    print(
        markdown(
            table,
            data["scaling"],
            samples=args.samples,
            workers=tuple(int(w) for w in args.workers.split(",")),
            gbits=tuple(float(g) for g in args.gbits.split(",")),
        )
    )


if __name__ == "__main__":
    main()
