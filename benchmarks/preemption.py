"""Preemption under a real Slurm, measured: ``sudo python -m benchmarks preemption`` writes RELIABILITY.md.

On a Slurm cluster in network namespaces (:mod:`benchmarks.slurm`, 2 nodes), the same training job
(``tests/slurm/slurm_job.py`` through ``deploy/slurm/ddlf.sbatch``: 2 workers, the tests' MNIST model, 6,000 rows,
the default strategy (gradient averaging on the ring, checking in every 5 batches; ``--strategy weights``: model
averaging every 5 batches), a checkpoint directory) runs undisturbed, then preempted once after its first
epoch's checkpoint, by ``scontrol requeue`` (SIGTERM to every process, the job back in the queue) and by the
time-limit warning (SIGUSR1 to the batch shell; the master requeues). Per run: wall time from submission to
completion, rows trained against an undisturbed run (rows lost to the preemption, or trained twice), final
accuracy on 1,000 held rows. Needs root (namespaces) and Debian's Slurm (``scripts/install-system.sh``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from . import report, slurm

REPO = Path(__file__).resolve().parents[1]
ROWS = 6000
STRATEGIES = {
    "gradients": "`GradientAveraging(scale_learning_rate=True, check_in_every=5)` (the default strategy, on the ring)",
    "weights": "`ModelAveraging(every=5)` (on the ring)",
}


def _run(cluster: slurm.SlurmCluster, work: Path, name: str, epochs: int, how: str | None, strategy: str) -> dict:
    out = work / f"{name}.json"
    ckpt = work / f"{name}-ckpt"
    env = {
        "DDLF_PYTHON": sys.executable,
        "DDLF_RUN_DIR": str(work / f"{name}-run"),
        "PATH": os.path.dirname(sys.executable) + ":" + os.environ["PATH"],
        "EPOCHS": str(epochs),
        "EVERY": "5",
        "CKPT": str(ckpt),
        "STRATEGY": strategy,
    }
    t0 = time.monotonic()
    queued = 0.0
    at_signal = None
    job = cluster.sbatch(
        [
            f"--job-name={name}",
            "--nodes=2",
            "--ntasks-per-node=1",
            "--cpus-per-task=1",
            f"--output={work / name}-%j.log",
            str(REPO / "deploy" / "slurm" / "ddlf.sbatch"),
            str(REPO / "tests" / "slurm" / "slurm_job.py"),
            str(out),
        ],
        cwd=work,
        env=env,
    )
    if how is not None:
        from ddlf.training import checkpoint

        while True:  # preempt once the first epoch is checkpointed
            saved = None
            with contextlib.suppress(ValueError):
                saved = checkpoint.load(ckpt)
            if saved is not None and saved["epochs_done"] >= 1:
                break
            if time.monotonic() - t0 > 300:
                raise TimeoutError(f"{name}: no checkpoint after 300 s")
            time.sleep(0.5)
        argv = (
            ["scontrol", "requeue", str(job)] if how == "requeue" else ["scancel", "--batch", "--signal=USR1", str(job)]
        )
        at_signal = checkpoint.load(ckpt)
        done = cluster.client(argv)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {done.stderr}")
        # How long the requeued job then waits in the queue (Slurm's hold on requeued jobs), apart from ddlf's time.
        pending = running = None
        while running is None and time.monotonic() - t0 < 900:
            s = cluster.job(job).get("JobState")
            if s == "PENDING" and pending is None:
                pending = time.monotonic()
            if s == "RUNNING" and pending is not None:
                running = time.monotonic()
            time.sleep(0.2)
        queued = (running or time.monotonic()) - (pending or time.monotonic())
    state = cluster.wait_job(job, 900)
    wall = time.monotonic() - t0
    records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    last = records[-1] if records else {}
    resumed_from = last.get("resumed_from")
    return {
        "queued": queued if how is not None else 0.0,
        "resumed_from": resumed_from,
        "epoch_checkpoint": [at_signal["epochs_done"], 0] if how is not None and at_signal else None,
        "state": state,
        "restarts": int(cluster.job(job).get("Restarts", "0")),
        "wall": wall,
        "samples": last.get("samples", 0),
        "accuracy": last.get("accuracy", float("nan")),
        "preempted_at": next((r["preempted"] for r in records if r.get("status") == "preempted"), ""),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks preemption", description=__doc__)
    p.add_argument("--epochs", type=int, default=8, help="epochs per run (the signal comes after the first)")
    p.add_argument("--repeat", type=int, default=1, help="runs of each kind (medians are reported)")
    p.add_argument(
        "--strategy",
        choices=("gradients", "weights"),
        default="gradients",
        help="gradients: the default strategy (gradient averaging on the ring); weights: model averaging",
    )
    p.add_argument("--out", default="RELIABILITY.md")
    args = p.parse_args(argv)
    ok, why = slurm.available()
    if not ok:
        raise SystemExit(f"benchmarks preemption: {why}")
    runs: dict[str, list[dict]] = {"undisturbed": [], "requeue": [], "warning": []}
    with (
        tempfile.TemporaryDirectory(prefix="ddlf-preemption-") as tmp,
        slurm.SlurmCluster(Path(tmp) / "slurm", nodes=2, cpus=2) as cluster,
    ):
        for i in range(args.repeat):
            for kind in runs:
                how = None if kind == "undisturbed" else kind
                runs[kind].append(_run(cluster, Path(tmp), f"{kind}{i}", args.epochs, how, args.strategy))
    full = args.epochs * ROWS
    base = statistics.median(r["wall"] for r in runs["undisturbed"])
    labels = {
        "undisturbed": "undisturbed",
        "requeue": "`scontrol requeue` after epoch 1 (SIGTERM to all; Slurm requeues)",
        "warning": "time-limit warning after epoch 1 (SIGUSR1 to the batch shell; the master requeues)",
    }
    rows = []
    for kind, rs in runs.items():
        wall = statistics.median(r["wall"] for r in rs)
        samples = statistics.median(r["samples"] for r in rs)
        acc = statistics.median(r["accuracy"] for r in rs)
        states = ", ".join(sorted({f"{r['state']} after {r['restarts']} requeue(s)" for r in rs}))
        queued = statistics.median(r["queued"] for r in rs)
        ddlf_wall = wall - queued
        froms = "; ".join(
            f"epoch {r['resumed_from'][0]} + {r['resumed_from'][1]:,} rows" if r["resumed_from"] else "-" for r in rs
        )
        rows.append(
            f"| {labels[kind]} | {states} | {froms} | {wall:.1f} s | {queued:.1f} s | {ddlf_wall:.1f} s "
            f"({ddlf_wall / base:.2f}x) | {samples:,.0f} of {full:,} | {acc:.3f} |"
        )
    notes = [r["preempted_at"] for rs in runs.values() for r in rs if r["preempted_at"]]
    body = "\n".join(
        [
            f"## Preemption under Slurm (`sudo python -m benchmarks preemption --epochs {args.epochs} --strategy "
            f"{args.strategy}`)",
            "",
            f"Machine: {report.machine()}. A real Slurm (slurmctld and 2 slurmd in network namespaces, "
            f"`benchmarks/slurm.py`, KillWait 30 s); the job: `deploy/slurm/ddlf.sbatch tests/slurm/slurm_job.py`, "
            f"2 workers, {args.epochs} epochs of {ROWS:,} MNIST rows, {STRATEGIES[args.strategy]}, checkpoints on; "
            f"medians of {args.repeat} run(s) each. Wall time: submission to completion, requeue and the second "
            "start included; Slurm holds a requeued job about 120 s before it may start again, shown apart. Resumed "
            "from: the checkpoint the requeued job went on from (the preemption's own: the last merged round "
            "before the signal; an epoch's: everything since that epoch redone). Rows in the final History: "
            "below the undisturbed run's by the rows of the round abandoned in flight, if any.",
            "",
            "| run | outcome | resumed from | wall time | of it queued (Slurm's requeue hold) | the rest (vs "
            "undisturbed) | rows in the final History | accuracy |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
            *rows,
            "",
            "Where the preempted runs stopped: " + "; ".join(f"“{n}”" for n in notes),
        ]
    )
    report.write_section("preemption", body, Path(args.out))
    print(body)


if __name__ == "__main__":
    main()
