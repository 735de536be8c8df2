"""Training over simulated networks: seconds per round and the share spent communicating, per link setting and
compression, on hosts in network namespaces (see :mod:`benchmarks.netns`); then how the measured per-round time
scales with the number of workers against the model of :mod:`benchmarks.project`.

    sudo .venv/bin/python -m benchmarks network [--rounds 6]   # from the repository root (needs root: namespaces)

The model is a wide MLP (784-2048-2048-10, 5.8 M parameters, 23 MB of float32 weights): big enough that the
network matters, small enough to compute on a laptop core. Each worker runs in its own namespace behind a veth
link; bandwidth caps are ``tbf`` qdiscs on both ends of every link (the master's included), added latency is
the delay relay (``benchmarks.relay``; this kernel has no ``sch_netem``), one-way on each of the master's
connections. Sync mode, 5 batches of 64 per round, TCP (no shared memory between namespaces).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import ddlf

from . import netns, report

TOKEN = "bench-network"
BATCH = 64
AVG_FREQ = 5
SETTINGS = [  # (label, Mbit/s or None, added one-way ms)
    ("no cap, no delay", None, 0.0),
    ("10 Gbit/s", 10_000, 0.0),
    ("1 Gbit/s", 1_000, 0.0),
    ("10 Gbit/s + 1 ms", 10_000, 1.0),
    ("10 Gbit/s + 10 ms", 10_000, 10.0),
    ("10 Gbit/s + 50 ms", 10_000, 50.0),
]
COMPRESSIONS: list[str | None] = [None, "float16", "topk"]


def _mnist_dir() -> str:
    here = Path(__file__).resolve()
    for root in (Path.cwd(), *here.parents):
        d = root / "examples" / "data" / "mnist"
        if d.is_dir():
            return str(d)
    raise FileNotFoundError("run from the ddlf repository: examples/data/mnist is needed")


class WideMlp(ddlf.IApp):
    """784-2048-2048-10 on MNIST rows: 23 MB of weights per round each way."""

    dataset_key = "mnist-bench-network"
    rows = 6000
    data_dir = ""

    def load_dataset(self):
        (x, y), _ = ddlf.datasets.mnist(self.data_dir)
        return x[: self.rows], y[: self.rows]

    def preprocess(self, x, y):
        return x.reshape(len(x), -1).astype(np.float32) / 255.0, y

    def create_model(self):
        import keras

        model = keras.Sequential(
            [
                keras.Input(shape=(784,)),
                keras.layers.Dense(2048, activation="relu"),
                keras.layers.Dense(2048, activation="relu"),
                keras.layers.Dense(10, activation="softmax"),
            ]
        )
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model


def train_wide_mlp(spec: dict[str, Any], **kw: Any) -> tuple[Any, int]:
    """In the master's namespace: train one epoch of ``spec["rounds"]`` rounds on ``spec["addresses"]`` with the
    ``train()`` keywords ``kw``. Returns History and the model's bytes of weights."""
    with ddlf.Cluster(spec["addresses"], token=TOKEN, heartbeat_timeout=120, timeout=600) as cluster:
        app = WideMlp(cluster)
        app.data_dir = spec["data_dir"]
        app.rows = spec["rounds"] * len(cluster) * AVG_FREQ * BATCH
        app.dataset_key = f"{WideMlp.dataset_key}-{app.rows}"
        weights_bytes = sum(w.nbytes for w in app.create_model().get_weights())
        h = app.train(epochs=1, batch_size=BATCH, strategy=strategy_for(**kw), verbose=0)
    return h, weights_bytes


def strategy_for(
    exchange: str = "master",
    averaging: str = "weights",
    compression: str | None = None,
    bucket_cap_mb: float | None = 25.0,
    shard_optimizer: bool = False,
) -> Any:
    """The strategy a benchmark case names, with rounds of :data:`AVG_FREQ` batches: model averaging through the
    master (``exchange="master"``) or over the ring (``"allreduce"``), or gradient averaging on the ring
    (``averaging="gradients"``, checking in with the master every round)."""
    if averaging == "gradients":
        return ddlf.GradientAveraging(
            bucket_cap_mb=bucket_cap_mb,
            check_in_every=AVG_FREQ,
            ring=ddlf.Ring(compression=compression),
            shard_optimizer=shard_optimizer,
        )
    if averaging != "weights":
        raise ValueError(f"averaging must be 'weights' or 'gradients', not {averaging!r}")
    ex = ddlf.Ring(compression=compression) if exchange == "allreduce" else ddlf.ThroughMaster(compression=compression)
    return ddlf.ModelAveraging(every=AVG_FREQ, exchange=ex)


def steady_rounds(h: Any) -> list[dict[str, float]]:
    """Per round after the first (which compiles): the round's wall time (its slowest worker), the slowest
    worker's compute and send, and the mean bytes up and down per worker."""
    rounds: dict[int, list[Any]] = {}
    for s in h.stats:
        rounds.setdefault(s.round, []).append(s)
    return [
        {
            "wall": max(s.send_seconds + s.compute_seconds + s.comm_seconds + s.wait_seconds for s in ss),
            "compute": max(s.compute_seconds for s in ss),
            "send": max(s.send_seconds for s in ss),
            "bytes_up": float(np.mean([s.bytes_received for s in ss])),
            "bytes_down": float(np.mean([s.bytes_sent for s in ss])),
        }
        for _round, ss in sorted(rounds.items())[1:]
    ]


def master(spec: dict[str, Any]) -> dict[str, Any]:
    """Run in the master's namespace: train ``rounds`` rounds, return per-round medians (first round, with its
    compilation, left out)."""
    h, weights_bytes = train_wide_mlp(spec, compression=spec["compression"])
    per_round = steady_rounds(h)
    med = {k: float(np.median([p[k] for p in per_round])) for k in per_round[0]}
    med["workers"] = len(spec["addresses"])
    med["weights_bytes"] = weights_bytes
    med["batch_seconds"] = med["compute"] / AVG_FREQ
    return med


def _run_setting(
    net: netns.VirtualNetwork, addresses: list[str], rate: float | None, delay_ms: float, compression: str | None,
    rounds: int,
) -> dict[str, Any]:  # fmt: skip
    for host in [net.master, *net.hosts]:
        net.shape(host, rate)
    relay = None
    targets = addresses
    if delay_ms > 0:
        pairs = [f"127.0.0.1:{9100 + i}={a}" for i, a in enumerate(addresses)]
        relay = net.popen(
            net.master,
            [sys.executable, "-m", "benchmarks.relay", "--delay-ms", str(delay_ms), *pairs],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert relay.stdout is not None and relay.stdout.readline().strip() == "ready"
        targets = [f"127.0.0.1:{9100 + i}" for i in range(len(addresses))]
    spec = {"addresses": targets, "compression": compression, "rounds": rounds, "data_dir": _mnist_dir()}
    try:
        done = net.run(net.master, [sys.executable, "-m", "benchmarks.network", "--master", json.dumps(spec)])
    finally:
        if relay is not None:
            relay.terminate()
            relay.wait()
    if done.returncode != 0:
        raise RuntimeError(f"the master failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks network", description=__doc__)
    p.add_argument("--rounds", type=int, default=6, help="rounds per measurement (the first is left out)")
    p.add_argument("--scaling", default="2,4,6", help="worker counts for the scaling check (at 1 Gbit/s)")
    p.add_argument("--master", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.master:
        print(json.dumps(master(json.loads(args.master))))
        return
    ok, why = netns.available()
    if not ok:
        sys.exit(f"ddlf bench network: {why}")
    counts = [int(c) for c in args.scaling.split(",")]
    work = tempfile.mkdtemp(prefix="ddlf-bench-network-")
    table: list[tuple[str, str | None, dict[str, Any]]] = []
    scaling: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    with netns.VirtualNetwork(max([2, *counts])) as net:
        addresses = netns.start_workers(net, work, token=TOKEN, threads=1)
        for label, rate, delay in SETTINGS:
            for comp in COMPRESSIONS:
                res = _run_setting(net, addresses[:2], rate, delay, comp, args.rounds)
                table.append((label, comp, res))
                print(f"{label:>20} {comp or 'none':>8}: {res['wall']:.3f} s/round, compute {res['compute']:.3f} s")
        for n in counts:
            res = _run_setting(net, addresses[:n], 1_000, 0.0, None, args.rounds)
            scaling.append(res)
            print(f"scaling {n} workers at 1 Gbit/s: {res['wall']:.3f} s/round, compute {res['compute']:.3f} s")
    from . import project

    body = _markdown(table, scaling, time.perf_counter() - t0)
    body += "\n\n" + project.markdown(table, scaling)
    path = report.write_section("network", body)
    Path(work, "network.json").write_text(json.dumps({"table": table, "scaling": scaling}, indent=1))
    print(f"wrote the network section of {path}; measurements in {work}/network.json (python -m benchmarks project)")


def _markdown(table: list[tuple[str, str | None, dict[str, Any]]], scaling: list[dict[str, Any]], took: float) -> str:
    first = table[0][2]
    lines = [
        "## Training over simulated networks (hosts in network namespaces)",
        "",
        f"`sudo .venv/bin/python -m benchmarks network` · {report.machine()} · {took:.0f} s",
        "",
        f"2 workers and the master, each in its own network namespace on a bridge; the wide MLP "
        f"({first['weights_bytes'] / 1e6:.1f} MB of float32 weights), sync mode, {AVG_FREQ} batches of {BATCH} per "
        "round; medians over the rounds after the first. Bandwidth: `tbf` on both ends of every link. Latency: "
        "one-way delay added by `benchmarks.relay` on each master connection (the kernel here has no "
        "`sch_netem`). *comm share* = 1 - (slowest worker's compute) / (round wall time). All on one 2-core "
        "machine: worker compute is slowed by sharing cores, so read the comm column, and ratios within a row.",
        "",
        "| link | compression | s/round | compute s | comm share | MB up per worker | MB down per worker |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for label, comp, r in table:
        share = max(0.0, 1 - r["compute"] / r["wall"]) if r["wall"] else 0.0
        lines.append(
            f"| {label} | {comp or 'none'} | {r['wall']:.3f} | {r['compute']:.3f} | {100 * share:.0f}% | "
            f"{r['bytes_up'] / 1e6:.2f} | {r['bytes_down'] / 1e6:.2f} |"
        )
    lines += [
        "",
        "What to pick: on a fast LAN the round is compute-bound and compression buys little; as bandwidth drops "
        "the weights on the wire dominate, and float16 halves and top-k (1%) nearly removes the upload (the "
        "download, the averaged weights, stays dense). Latency costs a fixed few round trips per round, so it "
        "matters only when rounds are short: raise `ModelAveraging(every=)` on high-latency links.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
