"""Chaos, measured: ``python -m benchmarks chaos`` trains while random workers are killed, hung and restarted, and
writes what happened into RELIABILITY.md.

    .venv/bin/python -m benchmarks chaos [--minutes 10] [--seed 0]

Three runs, one per way of training (sync through the master, sync over the workers' ring, async), each on 4 local
workers of the dense MNIST model of :mod:`benchmarks.faults`, share the time. During each run a chaos thread picks,
every 15-30 s (seeded), a random worker and one of:

* ``kill``: SIGKILL, then a new daemon at the same address 2-5 s later (the run re-provisions it);
* ``hang``: SIGSTOP, then SIGCONT 3-8 s later (a hung, not dead, worker: found by the heartbeat).

One fault at a time, so a worker is always there. Each run writes a checkpoint every epoch; after every epoch the
benchmark reads it back (it must load, and hold the epochs done so far: no checkpoint lost or torn). A run must end
within ``--hang-factor`` times its undisturbed twin's time (else it is reported as hung), and its test accuracy is
compared with that twin's: the same configuration, seed and epochs, in the same invocation, without chaos.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ddlf
from ddlf.cluster.cluster import Cluster
from ddlf.cluster.local import LocalWorkers
from ddlf.training import checkpoint
from ddlf.training.callbacks import LambdaCallback

from . import report
from .faults import DenseMnist, prepare

WORKERS = 4
MODES = {  # label -> train() strategy
    "sync, master exchange": ddlf.ModelAveraging(every=20),
    "sync, ring all-reduce": ddlf.ModelAveraging(every=20, exchange=ddlf.Ring()),
    "async": ddlf.Asynchronous(chunk=20),
}
RUN_NAMES = ("master", "ring", "async")  # --runs names of MODES, in order
BAND_POINTS = 1.0  # the accuracy band around the undisturbed run, in percentage points


@dataclass
class Fault:
    kind: str  # "kill" or "hang"
    worker: int
    at: float  # time.time() of the signal
    back: float = 0.0  # when the daemon was restarted (kill) or continued (hang)
    detect: float | None = None  # seconds from the signal to the master's "lost" event
    rejoin: float | None = None  # seconds from the restart or SIGCONT to the worker's "joined" event


@dataclass
class Slots:
    """The worker daemons of one run by slot, with the daemons restarted in their place."""

    workers: LocalWorkers
    extra: list[LocalWorkers] = field(default_factory=list)
    pid: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.pid = dict(enumerate(self.workers.pids()))

    def restart(self, i: int) -> None:
        again = LocalWorkers(1, threads=1, listen=[self.workers.addresses[i]], token=self.workers.token)
        self.extra.append(again)
        self.pid[i] = again.pids()[0]

    def close(self) -> None:
        for w in [self.workers, *self.extra]:
            w.terminate()


def _chaos(slots: Slots, faults: list[Fault], stop: threading.Event, rng: random.Random) -> None:
    while not stop.wait(rng.uniform(15, 30)):
        i = rng.randrange(WORKERS)
        kind = rng.choice(["kill", "hang"])
        pause = rng.uniform(2, 5) if kind == "kill" else rng.uniform(3, 8)
        fault = Fault(kind, i, time.time())
        os.kill(slots.pid[i], signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        faults.append(fault)
        if stop.wait(pause) and kind == "kill":
            return
        if kind == "kill":
            slots.restart(i)
        else:
            os.kill(slots.pid[i], signal.SIGCONT)
        fault.back = time.time()


def _run(label: str, kw: dict[str, Any], epochs: int, test: Any, chaos: bool, seed: int) -> dict[str, Any]:
    slots = Slots(LocalWorkers(WORKERS, threads=1))
    faults: list[Fault] = []
    stop = threading.Event()
    ckpt = tempfile.mkdtemp(prefix="ddlf-chaos-")
    problems: list[str] = []

    def check_checkpoint(epoch: int, logs: dict[str, Any]) -> None:
        # Written after the epoch ends: what is on disk now holds the epochs before this one.
        try:
            saved = checkpoint.load(ckpt)
        except ValueError as exc:
            problems.append(f"epoch {epoch}: unreadable checkpoint: {exc}")
            return
        done = 0 if saved is None else saved["epochs_done"]
        if done != epoch:
            problems.append(f"epoch {epoch}: the checkpoint holds {done} epochs, not {epoch}")

    try:
        chaos_thread = None
        if chaos:
            chaos_thread = threading.Thread(target=_chaos, args=(slots, faults, stop, random.Random(seed)))
            chaos_thread.start()
        t0 = time.perf_counter()
        with Cluster(slots.workers.addresses, slots.workers.token, heartbeat_interval=0.5, heartbeat_timeout=1.5) as c:
            app = DenseMnist(c)
            app.data_dir = DenseMnist.data_dir
            h = app.train(
                epochs=epochs,
                batch_size=64,
                strategy=kw,
                verbose=0,
                run=ddlf.RunConfig(seed=1, checkpoint_dir=ckpt),
                callbacks=[LambdaCallback(on_epoch_end=check_checkpoint)],
            )
            seconds = time.perf_counter() - t0
            acc = float(app.evaluate(*test)[1])
        stop.set()
        if chaos_thread is not None:
            chaos_thread.join()
        final = checkpoint.load(ckpt)
        if final is None or final["epochs_done"] != epochs:
            problems.append(f"the last checkpoint holds {final and final['epochs_done']} epochs, not {epochs}")
    finally:
        stop.set()
        slots.close()
    events = [e for e in h.events if e.get("event") in ("lost", "joined", "restarted", "rejoined")]
    for f in faults:
        lost = next((e for e in events if e["event"] == "lost" and e.get("worker") == f.worker and e["time"] >= f.at),
                    None)  # fmt: skip
        # A restarted daemon is set up for the run again ("joined"); a hung one that continues keeps its setup and
        # comes back as "rejoined".
        again = "joined" if f.kind == "kill" else "rejoined"
        back = next(
            (e for e in events if e["event"] == again and e.get("worker") == f.worker and e["time"] >= f.back),
            None,
        )
        f.detect = (lost["time"] - f.at) if lost else None
        f.rejoin = (back["time"] - f.back) if back and f.back else None
    return {
        "label": label,
        "seconds": seconds,
        "acc": acc,
        "epochs": len(h.history["loss"]),
        "epoch_seconds": list(h.epoch_seconds),
        "faults": faults,
        "problems": problems,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks chaos", description=__doc__)
    p.add_argument("--minutes", type=float, default=10.0, help="chaos time in all (shared by the three runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hang-factor", type=float, default=3.0)
    p.add_argument("--data", default=os.path.join("examples", "data", "mnist"))
    p.add_argument("--out", default="RELIABILITY.md")
    p.add_argument(
        "--runs",
        default=",".join(RUN_NAMES),
        help=f"which runs, comma-separated from {','.join(RUN_NAMES)} (a subset writes its own section)",
    )
    args = p.parse_args(argv)
    chosen = args.runs.split(",")
    unknown = [r for r in chosen if r not in RUN_NAMES]
    if unknown:
        p.error(f"unknown runs {unknown}: choose from {','.join(RUN_NAMES)}")
    modes = {label: kw for name, (label, kw) in zip(RUN_NAMES, MODES.items()) if name in chosen}
    test = prepare(args.data)
    per_run = args.minutes * 60 / len(modes)
    rows = []
    t_all = time.perf_counter()
    for k, (label, kw) in enumerate(modes.items()):
        # A short undisturbed run first: its steady time per epoch sets the epochs that fill this run's share.
        probe = _run(label, kw, 2, test, chaos=False, seed=0)
        epochs = max(2, round(per_run / probe["epoch_seconds"][-1]))
        ref = _run(label, kw, epochs, test, chaos=False, seed=0)
        run = _run(label, kw, epochs, test, chaos=True, seed=args.seed + k)
        hung = run["seconds"] > args.hang_factor * ref["seconds"]
        rows.append((run, ref, hung))
        print(
            f"{label}: {epochs} epochs, {run['seconds']:.0f} s with {len(run['faults'])} faults vs "
            f"{ref['seconds']:.0f} s undisturbed; accuracy {100 * run['acc']:.2f}% vs {100 * ref['acc']:.2f}%; "
            f"problems: {run['problems']}",
            flush=True,
        )
    took = time.perf_counter() - t_all
    section = "chaos" if len(modes) == len(MODES) else "chaos-" + "-".join(chosen)
    _write(Path(args.out), _markdown(rows, args, took), section)


def _markdown(rows: list[tuple[dict[str, Any], dict[str, Any], bool]], args: Any, took: float) -> str:
    lines = [
        "## Chaos (`python -m benchmarks chaos"
        + ("" if args.runs == ",".join(RUN_NAMES) else f" --runs {args.runs} --minutes {args.minutes:g}")
        + "`)",
        "",
        f"Machine: {report.machine()}; {took / 60:.1f} minutes in all, seed {args.seed}.",
        "",
        f"{WORKERS} local workers, the dense MNIST model, checkpoints every epoch; every 15-30 s a random worker is "
        "killed (SIGKILL, a new daemon at its address 2-5 s later) or hung (SIGSTOP, SIGCONT 3-8 s later); heartbeat "
        f"0.5 s, timeout 1.5 s. Each run against its undisturbed twin (same seed, epochs) in this invocation; "
        f"accuracy band ±{BAND_POINTS:g} point(s).",
        "",
        "| run | epochs | faults (kill / hang) | finished | wall s (undisturbed) | test accuracy (undisturbed) | "
        "in band | checkpoints | time to detect: median (max) | back in training after restart/continue: median "
        "(max) |",
        "| --- | ---: | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run, ref, hung in rows:
        faults = run["faults"]
        kills = sum(f.kind == "kill" for f in faults)
        detect = [f.detect for f in faults if f.detect is not None]
        rejoin = [f.rejoin for f in faults if f.rejoin is not None]
        diff = 100 * (run["acc"] - ref["acc"])

        def stat(xs: list[float], n: int) -> str:
            if not xs:
                return "-"
            return f"{report.median(xs):.2f} s ({max(xs):.2f} s), {len(xs)} of {n}"

        lines.append(
            f"| {run['label']} | {run['epochs']} | {len(faults)} ({kills} / {len(faults) - kills}) | "
            f"{'no: hung' if hung else 'yes'} | {run['seconds']:.0f} ({ref['seconds']:.0f}) | "
            f"{100 * run['acc']:.2f}% ({100 * ref['acc']:.2f}%, {diff:+.2f}) | "
            f"{'yes' if abs(diff) <= BAND_POINTS else 'no'} | "
            f"{'all intact' if not run['problems'] else '; '.join(run['problems'])} | {stat(detect, len(faults))} | "
            f"{stat(rejoin, len(faults))} |"
        )
    lines += [
        "",
        "Every fault of the runs, in order (seconds from the signal to the master's `lost` event, and from the "
        "restart to the worker's `joined` event (set up for the run again), or from SIGCONT to its `rejoined` event; "
        "'-': not seen, e.g. a hang shorter than the heartbeat timeout, or a fault in the run's last seconds):",
        "",
        "| run | fault | worker | detected after | back after |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for run, _, _ in rows:
        for f in run["faults"]:
            d, r = f.detect, f.rejoin
            lines.append(
                f"| {run['label']} | {f.kind} | {f.worker} | {'-' if d is None else f'{d:.2f} s'} | "
                f"{'-' if r is None else f'{r:.2f} s'} |"
            )
    return "\n".join(lines)


def _write(path: Path, body: str, section: str) -> None:
    report.write_section(section, body, path)
    print(body)


if __name__ == "__main__":
    main()
