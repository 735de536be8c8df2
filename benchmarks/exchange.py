"""Who carries the bytes: the master exchange against the ring, and model against gradient averaging, on hosts in
network namespaces with every link capped (``tbf``) at 1 Gbit/s.

    sudo .venv/bin/python -m benchmarks exchange [--hosts 2,4,6,8] [--rounds 6]   # from the repository root

The wide MLP of :mod:`benchmarks.network` (784-2048-2048-10, 23 MB of float32 weights), sync mode, 5 batches of 64
per worker per round, TCP between namespaces. Per worker count, in one run:

* ``master / weights``: model averaging through the master (the paper's exchange: n copies down, n replies up);
* ``allreduce / weights``: model averaging over the workers' ring (the master sends no weights);
* ``allreduce / gradients``: gradients averaged every step over the ring (5 all-reduces per round), at float32
  and with ``compression="float16"``;
* ``one process``: the same round's samples in one process on one math thread (5 batches of n x 64): what one
  machine of the same kind would take for the work of the round, without any exchange.

Bytes are *measured*: each namespace's ``eth0`` counters (``/proc/net/dev``) before and after the run, divided by
the run's rounds (the first round and the set-up included). The projection (:mod:`benchmarks.project`) takes the
rows of both exchanges and checks its per-round model against each measured worker count.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import netns, report
from .network import AVG_FREQ, BATCH, TOKEN, WideMlp, _mnist_dir

RATE = 1_000  # Mbit/s on every link
CASES: list[tuple[str, str, str | None]] = [  # (exchange, averaging, compression)
    ("master", "weights", None),
    ("allreduce", "weights", None),
    ("allreduce", "gradients", None),
    ("allreduce", "gradients", "float16"),
]


def _link_bytes(net: netns.VirtualNetwork, hosts: list[netns.Host]) -> dict[str, tuple[int, int]]:
    """(received, sent) bytes of each host's ``eth0`` so far."""
    out = {}
    for h in hosts:
        done = net.run(h, ["cat", "/proc/net/dev"])
        for line in done.stdout.splitlines():
            name, _, rest = line.partition(":")
            if name.strip() == "eth0":
                f = rest.split()
                out[h.name] = (int(f[0]), int(f[8]))
    return out


def one_process(spec: dict[str, Any]) -> dict[str, Any]:
    """Run in the master's namespace: seconds for one round's samples in one process (5 batches of n x 64, one
    math thread, as each worker has), median over rounds after the first."""
    import os

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import numpy as np

    app = WideMlp(None)  # type: ignore[arg-type]  # no cluster: only its dataset and model are used
    app.data_dir = spec["data_dir"]
    app.rows = spec["rounds"] * spec["workers"] * AVG_FREQ * BATCH
    try:  # the same math-thread setting as the workers (ddlf-worker --threads 1)
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    except Exception:  # another backend
        pass
    x, y = app.preprocess(*app.load_dataset())
    model = app.create_model()
    batch = spec["workers"] * BATCH
    times = []
    for r in range(spec["rounds"]):
        t = time.perf_counter()
        for b in range(AVG_FREQ):
            lo = (r * AVG_FREQ + b) * batch
            model.train_on_batch(x[lo : lo + batch], y[lo : lo + batch])
        times.append(time.perf_counter() - t)
    return {"wall": float(np.median(times[1:])), "compute": float(np.median(times[1:]))}


def master(spec: dict[str, Any]) -> dict[str, Any]:
    """Run in the master's namespace: train ``rounds`` rounds with the case's exchange, return per-round medians
    (the first round, with its compilation, left out)."""
    import numpy as np

    import ddlf

    with ddlf.Cluster(spec["addresses"], token=TOKEN, heartbeat_timeout=120, timeout=600) as cluster:
        app = WideMlp(cluster)
        app.data_dir = spec["data_dir"]
        app.rows = spec["rounds"] * len(cluster) * AVG_FREQ * BATCH
        app.dataset_key = f"{WideMlp.dataset_key}-{app.rows}"
        weights_bytes = sum(w.nbytes for w in app.create_model().get_weights())
        h = app.train(
            epochs=1,
            batch_size=BATCH,
            averaging_frequency=AVG_FREQ,
            exchange=spec["exchange"],
            averaging=spec["averaging"],
            compression=spec["compression"],
            verbose=0,
        )
    rounds: dict[int, list[Any]] = {}
    for s in h.stats:
        rounds.setdefault(s.round, []).append(s)
    walls, computes = [], []
    for _round, ss in sorted(rounds.items())[1:]:
        walls.append(max(s.send_seconds + s.compute_seconds + s.comm_seconds + s.wait_seconds for s in ss))
        computes.append(max(s.compute_seconds for s in ss))
    return {
        "wall": float(np.median(walls)),
        "compute": float(np.median(computes)),
        "rounds": len(rounds),
        "weights_bytes": weights_bytes,
    }


def _run(net: netns.VirtualNetwork, mode: str, spec: dict[str, Any]) -> dict[str, Any]:
    hosts = [net.master, *net.hosts[: spec["workers"]]]
    before = _link_bytes(net, hosts)
    done = net.run(net.master, [sys.executable, "-m", "benchmarks.exchange", f"--{mode}", json.dumps(spec)])
    after = _link_bytes(net, hosts)
    if done.returncode != 0:
        raise RuntimeError(f"the {mode} failed: {done.stderr[-3000:]}")
    res = json.loads(done.stdout.strip().splitlines()[-1])
    rounds = res.get("rounds", spec["rounds"])
    workers = [h.name for h in hosts[1:]]
    res["master_mb"] = sum(after[net.master.name][i] - before[net.master.name][i] for i in (0, 1)) / rounds / 1e6
    res["worker_sent_mb"] = sum(after[w][1] - before[w][1] for w in workers) / len(workers) / rounds / 1e6
    return res


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks exchange", description=__doc__)
    p.add_argument("--hosts", default="2,4,6,8", help="worker counts (one namespace host each)")
    p.add_argument("--rounds", type=int, default=6, help="rounds per measurement (the first is left out)")
    p.add_argument("--gradient-hosts", default="2,6", help="worker counts for the gradient-averaging rows")
    p.add_argument("--master", help=argparse.SUPPRESS)
    p.add_argument("--one-process", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.master:
        print(json.dumps(master(json.loads(args.master))))
        return
    if args.one_process:
        print(json.dumps(one_process(json.loads(args.one_process))))
        return
    ok, why = netns.available()
    if not ok:
        sys.exit(f"python -m benchmarks exchange: {why}")
    counts = [int(c) for c in args.hosts.split(",")]
    grad_counts = {int(c) for c in args.gradient_hosts.split(",")}
    work = tempfile.mkdtemp(prefix="ddlf-bench-exchange-")
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    with netns.VirtualNetwork(max(counts)) as net:
        for host in [net.master, *net.hosts]:
            net.shape(host, RATE)
        addresses = netns.start_workers(net, work, token=TOKEN, threads=1)
        for n in counts:
            base = {"workers": n, "rounds": args.rounds, "data_dir": _mnist_dir()}
            cases: list[tuple[str, str | None, str | None, str | None]] = [("one process", None, None, None)]
            cases += [(ex, avg, comp, ex) for ex, avg, comp in CASES if avg == "weights" or n in grad_counts]
            for label, averaging, comp, exchange in cases:
                if averaging is None:
                    res = _run(net, "one-process", base)
                else:
                    spec = {**base, "addresses": addresses[:n], "exchange": exchange, "averaging": averaging}
                    res = _run(net, "master", {**spec, "compression": comp})
                res.update(workers=n, exchange=label, averaging=averaging or "-", compression=comp)
                rows.append(res)
                print(
                    f"{n} hosts {label:>11} {averaging or '-':>9} {comp or 'none':>7}: {res['wall']:.3f} s/round, "
                    f"compute {res['compute']:.3f} s, master link {res['master_mb']:.1f} MB/round, "
                    f"worker sent {res['worker_sent_mb']:.1f} MB/round",
                    flush=True,
                )
    Path(work, "exchange.json").write_text(json.dumps(rows, indent=1))
    from . import project

    body = _markdown(rows, time.perf_counter() - t0) + "\n\n" + project.ring_markdown(rows)
    path = report.write_section("exchange", body)
    print(f"wrote the exchange section of {path}; measurements in {work}/exchange.json")


def _markdown(rows: list[dict[str, Any]], took: float) -> str:
    master_wall = {r["workers"]: r["wall"] for r in rows if r["exchange"] == "master"}
    lines = [
        "## Master exchange against the ring, model against gradient averaging (1 Gbit/s links)",
        "",
        f"`sudo .venv/bin/python -m benchmarks exchange` · {report.machine()} · {took:.0f} s",
        "",
        f"Each worker and the master in its own network namespace, every link capped at {RATE // 1000} Gbit/s "
        f"(`tbf` on both ends); the wide MLP (23.3 MB of float32 weights), sync, {AVG_FREQ} batches of {BATCH} "
        "per worker per round; medians over the rounds after the first. *one process*: the round's samples "
        f"({AVG_FREQ} batches of n x {BATCH}) in one process on one math thread, in the same run. MB per round are "
        "measured on the links (`/proc/net/dev` of each namespace, whole run / rounds): the master's link both "
        "ways, and what each worker sent. All on one 2-core machine: n workers share 2 cores, so compute grows "
        "with n; compare exchanges within a worker count.",
        "",
        "| workers | exchange | averaging | compression | s/round | vs master exchange | worker compute s | "
        "master link MB/round | MB sent per worker/round |",
        "|---:|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = r["wall"] / master_wall[r["workers"]] if r["workers"] in master_wall else float("nan")
        lines.append(
            f"| {r['workers']} | {r['exchange']} | {r['averaging']} | {r['compression'] or 'none'} | "
            f"{r['wall']:.3f} | {ratio:.2f}x | {r['compute']:.3f} | {r['master_mb']:.1f} | "
            f"{r['worker_sent_mb']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
