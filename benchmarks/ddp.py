"""ddlf's exact sync on a ``TorchModel`` against PyTorch's own ``DistributedDataParallel``.

    .venv/bin/python -m benchmarks ddp [--procs 1,2,4] [--repeats 2] [--epochs 3] [--rows 12000]

The same model, data and seeds under both: a 784-1024-1024-10 MLP (``torch.manual_seed(0)``), Adam (lr 1e-3),
the first ``--rows`` MNIST rows as float32 in memory, batch 64 per process, one math thread per process
(``torch.set_num_threads(1)``), ``--epochs`` epochs:

* ``ddp-N``: N processes of ``torch.nn.parallel.DistributedDataParallel`` over gloo on the CPU (NCCL, one GPU per
  rank, with ``--device cuda``), a ``DistributedSampler`` shuffling each epoch (its rows gathered a batch at a
  time from the in-memory tensors), its default 25 MB buckets;
* ``loop-1`` (``--procs 1``): the same loop in one process without DDP, the peer of one ddlf worker;
* ``ddlf-N``: ``ddlf.Cluster.local(N, threads=1)`` and ``app.train(strategy=ddlf.GradientAveraging())`` (its
  gradient buckets, 25 MB by default, reduced while backward runs), the app's ``create_model`` returning a
  ``TorchModel`` (``device="auto"``: the worker's GPU with ``--device cuda`` and ``Cluster.local(gpus="auto")``).

Steady seconds per epoch: the median of the epochs after the first (DDP: measured on rank 0 between barriers;
ddlf: the History's ``epoch_seconds``), then the median over the repeats; final accuracy on the 10,000 test rows.
Each case runs in a fresh process; the cases alternate within each repeat (the order rotating), so the ratios are
measured side by side on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from typing import Any

import numpy as np

from . import report
from .backends import DATA

BATCH = 64
LR = 1e-3


def _data(rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    import ddlf

    (x, y), (xt, yt) = ddlf.datasets.mnist(DATA)

    def prepared(a: np.ndarray) -> np.ndarray:
        return a.reshape(len(a), -1).astype(np.float32) / 255.0

    return prepared(x[:rows]), y[:rows].astype(np.int64), prepared(xt), yt.astype(np.int64)


def _module() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(784, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    )


# -- DistributedDataParallel ------------------------------------------------------------------------------------


def _ddp_rank(rank: int, world: int, port: int, rows: int, epochs: int, device: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.utils.data import DistributedSampler

    torch.set_num_threads(1)
    on_gpu = device == "cuda"
    backend = "nccl" if on_gpu else "gloo"
    where = torch.device(f"cuda:{rank}") if on_gpu else torch.device("cpu")
    alone = world == 1  # the plain loop: no process group, no DDP
    if not alone:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    x, y, xt, yt = _data(rows)
    model: Any = _module().to(where)
    if not alone:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank] if on_gpu else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    loss_fn = torch.nn.CrossEntropyLoss()
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    sampler = DistributedSampler(tx, num_replicas=world, rank=rank, shuffle=True, seed=0)
    barrier = (lambda: None) if alone else dist.barrier
    seconds = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        barrier()
        t0 = time.perf_counter()
        model.train()
        order = torch.tensor(list(sampler))
        for at in range(0, len(order), BATCH):
            # In-memory rows gathered a batch at a time (a DataLoader's per-row collation would cost DDP ~25%).
            rows = order[at : at + BATCH]
            bx, by = tx[rows], ty[rows]
            if on_gpu:
                bx, by = bx.pin_memory().to(where, non_blocking=True), by.pin_memory().to(where, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(bx), by).backward()
            optimizer.step()
        if on_gpu:
            torch.cuda.synchronize()
        barrier()
        seconds.append(time.perf_counter() - t0)
    if rank == 0:
        model.eval()
        with torch.no_grad():
            logits = getattr(model, "module", model)(torch.from_numpy(xt).to(where))
        accuracy = float((logits.argmax(1).cpu().numpy() == yt).mean())
        with open(out, "w") as f:
            json.dump({"seconds": seconds, "accuracy": accuracy}, f)
    if not alone:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ddp(world: int, rows: int, epochs: int, device: str) -> dict[str, Any]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        if world == 1:
            _ddp_rank(0, 1, 0, rows, epochs, device, out)
            with open(out) as f:
                return json.load(f)
        mp.start_processes(
            _ddp_rank, args=(world, _free_port(), rows, epochs, device, out), nprocs=world, start_method="spawn"
        )
        with open(out) as f:
            return json.load(f)


# -- ddlf -------------------------------------------------------------------------------------------------------


def run_ddlf(world: int, rows: int, epochs: int, device: str) -> dict[str, Any]:
    import torch

    import ddlf
    from ddlf.models import TorchModel

    torch.set_num_threads(1)

    class Mlp(ddlf.IApp):
        dataset_key = f"bench-ddp-{rows}"

        def load_dataset(self) -> Any:
            x, y, _, _ = _data(rows)
            return x, y

        def create_model(self) -> Any:
            return TorchModel(_module(), lambda p: torch.optim.Adam(p, lr=LR), torch.nn.CrossEntropyLoss())

    _, _, xt, yt = _data(rows)
    gpus: Any = "auto" if device == "cuda" else None
    with ddlf.Cluster.local(world, threads=1, preload="torch", gpus=gpus) as cluster:
        app = Mlp(cluster)
        app.train(epochs=0, verbose=0)  # load the dataset (DDP's processes hold it in memory before they time)
        h = app.train(epochs=epochs, batch_size=BATCH, strategy=ddlf.GradientAveraging(), verbose=0)
        _, accuracy = app.evaluate(xt, yt, batch_size=1000)
    return {"seconds": list(h.epoch_seconds), "accuracy": float(accuracy)}


def run_case(case: str, rows: int, epochs: int, device: str) -> dict[str, Any]:
    system, world = case.rsplit("-", 1)
    return (run_ddlf if system == "ddlf" else run_ddp)(int(world), rows, epochs, device)


def _reference(n: int) -> str:
    """The peer of ``ddlf-n``: DDP in ``n`` processes, or one process's plain loop."""
    return "loop-1" if n == 1 else f"ddp-{n}"


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks ddp", description=__doc__)
    p.add_argument("--procs", default="1,2,4", help="process counts (comma-separated)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3, help="epochs per case (the first is not steady)")
    p.add_argument("--rows", type=int, default=12_000)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--case", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(args.case, args.rows, args.epochs, args.device)))
        return
    procs = [int(n) for n in args.procs.split(",")]
    cases = [c for n in procs for c in (_reference(n), f"ddlf-{n}")]
    t0 = time.perf_counter()
    steady: dict[str, list[float]] = {c: [] for c in cases}
    accuracy: dict[str, list[float]] = {c: [] for c in cases}
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1"}
    for r in range(args.repeats):
        for c in cases[r % len(cases) :] + cases[: r % len(cases)]:
            cmd = [sys.executable, "-m", "benchmarks.ddp", "--case", c, "--rows", str(args.rows)]
            cmd += ["--epochs", str(args.epochs), "--device", args.device]
            out = report.json_case(cmd, env)
            if "error" in out:
                sys.exit(f"case {c} failed: {out['error']}")
            steady[c].append(report.median(out["seconds"][1:] or out["seconds"]))
            accuracy[c].append(out["accuracy"])
            print(f"repeat {r} {c}: {[round(s, 2) for s in out['seconds']]} accuracy {out['accuracy']:.4f}", flush=True)
    med = {c: report.median(v) for c, v in steady.items()}
    rows = []
    for c in cases:
        ref = med[_reference(int(c.rsplit("-", 1)[1]))]
        rows.append(
            [
                c,
                f"{med[c]:.2f}",
                " / ".join(f"{s:.2f}" for s in steady[c]),
                f"{med[c] / ref:.2f}x",
                " / ".join(f"{a:.4f}" for a in accuracy[c]),
            ]
        )
    where = "one GPU per process, NCCL" if args.device == "cuda" else "CPU, gloo, one math thread per process"
    body = (
        "## Exact sync on PyTorch against DistributedDataParallel (`python -m benchmarks ddp`)\n\n"
        f"`python -m benchmarks ddp --procs {args.procs} --repeats {args.repeats} --epochs {args.epochs} --rows "
        f"{args.rows} --device {args.device}` · {report.machine()} · {time.perf_counter() - t0:.0f} s\n\n"
        f"A 784-1024-1024-10 MLP, Adam (lr {LR}), {args.rows:,} MNIST rows, batch {BATCH} per process, {where}, the "
        "same seed for the weights. *ddp-N*: `torch.nn.parallel.DistributedDataParallel` in N processes (a "
        "`DistributedSampler`, 25 MB buckets); *ddlf-N*: a `TorchModel` on `Cluster.local(N, threads=1)` with "
        "`GradientAveraging()` (25 MB buckets reduced while backward runs); *loop-1*: a plain training loop in one "
        "process, the peer of *ddlf-1* (one worker). Steady seconds per epoch (median of the "
        f"epochs after the first), medians over {args.repeats} repeats, each case a fresh process, the cases "
        "alternating; accuracy on the 10,000 test rows after the last epoch, each repeat.\n\n"
        + report.table(["case", "s/epoch", "each repeat", "vs ddp (loop: 1 process)", "test accuracy"], rows)
        + "\n"
    )
    print(body)
    report.write_section("ddp", body)


if __name__ == "__main__":
    main(sys.argv[1:])
