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
        "`ModelAveraging.every`) or the ring (`ddlf.Ring`: its rows and projection are in the next "
        "section) is what scales.",
    ]
    return "\n".join(lines)


def ring_comm_seconds(
    n: int, gbits: float, weights_bytes: float, efficiency: float, hop_latency: float = 0.0, reduces: int = 1
) -> float:
    """Seconds of communication per round for ``n`` workers averaging over a ring, each on its own ``gbits``
    Gbit/s link: every all-reduce moves 2(n-1)/n of the weights through each worker's link each way (reduce-scatter
    then all-gather) in 2(n-1) steps, each paying a hop's latency once (the chunks behind it are pipelined).
    ``reduces``: all-reduces per round (1 for model averaging, one per batch for gradient averaging)."""
    if n <= 1:
        return 0.0
    return reduces * (2 * (n - 1) / n * weights_bytes * 8 / (gbits * 1e9 * efficiency) + 2 * (n - 1) * hop_latency)


def _ring_rows(rows: list[dict[str, Any]], averaging: str) -> list[dict[str, Any]]:
    return sorted(
        (r for r in rows if r["exchange"] == "allreduce" and r["averaging"] == averaging and not r["compression"]),
        key=lambda r: r["workers"],
    )


def calibrate_ring(rows: list[dict[str, Any]], gbits: float = 1.0) -> float:
    """Achieved share of each link's nominal bandwidth on the ring, from the smallest measured model-averaging
    run (comm = wall - compute: a ring round's compute excludes the all-reduce)."""
    base = _ring_rows(rows, "weights")[0]
    comm = max(1e-9, base["wall"] - base["compute"])
    return ring_comm_seconds(base["workers"], gbits, base["weights_bytes"], 1.0) / comm


def ring_markdown(
    rows: list[dict[str, Any]],
    samples: int = 1_000_000,
    workers: tuple[int, ...] = (8, 64, 512),
    gbits: tuple[float, ...] = (10, 25, 100),
    rtt: float = 1e-4,
) -> str:
    """The projection for both exchanges, from ``python -m benchmarks exchange``'s rows (1 Gbit/s): each model
    checked against every measured worker count, then seconds per epoch and communication share projected."""
    masters = sorted((r for r in rows if r["exchange"] == "master"), key=lambda r: r["workers"])
    ring_w, ring_g = _ring_rows(rows, "weights"), _ring_rows(rows, "gradients")
    w = float(ring_w[0]["weights_bytes"])
    m0 = masters[0]
    eff_m = m0["workers"] * 2 * w * 8 / 1e9 / max(1e-9, m0["wall"] - m0["compute"])
    eff_r = calibrate_ring(rows)
    compute_w = {r["workers"]: r["compute"] for r in ring_w}
    checks: list[tuple[str, int, float, float]] = []
    for r in masters:
        predicted = r["compute"] + comm_seconds(r["workers"], 1.0, w, w, eff_m)
        checks.append(("master, weights", r["workers"], r["wall"], predicted))
    for r in ring_w:
        predicted = r["compute"] + ring_comm_seconds(r["workers"], 1.0, w, eff_r)
        checks.append(("ring, weights", r["workers"], r["wall"], predicted))
    for r in ring_g:  # its compute includes the ring: take the same batches' compute from model averaging
        if r["workers"] in compute_w:
            pred = compute_w[r["workers"]] + ring_comm_seconds(r["workers"], 1.0, w, eff_r, reduces=AVG_FREQ)
            checks.append(("ring, gradients", r["workers"], r["wall"], pred))
    lines = [
        "### Projection for both exchanges (`benchmarks.project`)",
        "",
        "Master exchange: round = compute + n·2W·8 / (B·eff) (the master's link carries every copy). Ring: "
        "round = compute + k·(2(n-1)/n·W·8 / (B·eff) + 2(n-1)·hop latency), k all-reduces per round (1 for model "
        f"averaging, {AVG_FREQ} for gradient averaging), each worker on its own link of B. Efficiency calibrated "
        f"on the smallest measured run of each exchange at 1 Gbit/s: master **{eff_m:.2f}**, ring **{eff_r:.2f}** "
        "of nominal (the gradient rows use the ring's, not their own). Checked against every measured worker "
        "count, each with its own measured compute:",
        "",
        "| exchange | workers | measured s/round | predicted s/round | error |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, n, measured, predicted in checks:
        lines.append(
            f"| {label} | {n} | {measured:.3f} | {predicted:.3f} | {(predicted - measured) / measured * 100:+.0f}% |"
        )
    batch_s = min(masters, key=lambda r: r["workers"])["compute"] / AVG_FREQ
    lines += [
        "",
        f"Projected seconds per epoch of {samples:,} samples and the share of it spent communicating (wide MLP, "
        f"{w / 1e6:.1f} MB, batch {BATCH}, {AVG_FREQ} batches per round, {batch_s * 1000:.1f} ms per batch as "
        f"measured here with 2 workers, rtt {rtt * 1e3:g} ms, hop latency rtt/2):",
        "",
        "| workers | link | master s/epoch (comm) | ring s/epoch (comm) | ring gradients s/epoch (comm) | "
        "compute only |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for n in workers:
        rounds = math.ceil(samples / (n * AVG_FREQ * BATCH))
        compute = rounds * AVG_FREQ * batch_s
        for g in gbits:
            cells = []
            for comm in (
                2 * rtt + comm_seconds(n, g, w, w, eff_m),
                ring_comm_seconds(n, g, w, eff_r, rtt / 2),
                ring_comm_seconds(n, g, w, eff_r, rtt / 2, reduces=AVG_FREQ),
            ):
                total = compute + rounds * comm
                cells.append(f"{total:,.1f} ({rounds * comm / total:.0%})")
            lines.append(f"| {n} | {g:g} Gbit/s | " + " | ".join(cells) + f" | {compute:,.1f} |")
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
