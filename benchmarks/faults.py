"""Faults, measured: ``python -m benchmarks faults`` writes RELIABILITY.md.

* kill -9 one of 3 workers mid-epoch, sync and async, on full MNIST (60,000 images, a dense model), against an
  undisturbed run of the same configuration in the same invocation: accuracy, time to detect, rows skipped;
* a worker stopped with SIGSTOP (hung, not dead): time to detect with a 1.5 s heartbeat timeout;
* a killed worker restarted at the same address during training: time and rounds until it trains again;
* a soak run: 100,000 calls, then the daemon's resident memory compared with after the first 1,000.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

import ddlf
from ddlf import data as datasets
from ddlf.cluster.cluster import Cluster
from ddlf.cluster.local import LocalWorkers
from ddlf.training.app import IApp
from ddlf.training.callbacks import LambdaCallback

from . import report


class DenseMnist(IApp):
    """A dense model with dropout on full MNIST: converges within a few epochs on two cores."""

    dataset_key = "bench-faults-mnist"
    data_dir = ""

    def load_dataset(self) -> Any:
        (x, y), _ = datasets.mnist(self.data_dir)
        return x, y

    def preprocess(self, x: Any, y: Any) -> tuple[Any, Any]:
        return x.reshape(len(x), -1).astype(np.float32) / 255.0, y

    def create_model(self) -> Any:
        import keras

        model = keras.Sequential(
            [
                keras.Input(shape=(784,)),
                keras.layers.Dense(128, activation="relu"),
                keras.layers.Dropout(0.2),
                keras.layers.Dense(10, "softmax"),
            ]
        )
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model


def _at_round(at: int, action: Any) -> tuple[LambdaCallback, dict[str, float]]:
    """Run ``action`` 50 ms after round ``at`` ends (in the middle of the next round); record when."""
    when: dict[str, float] = {}

    def fire() -> None:
        when["t"] = time.time()
        action()

    def on_round_end(r: int, logs: dict[str, Any]) -> None:
        if r == at and "armed" not in when:
            when["armed"] = 1.0
            threading.Timer(0.05, fire).start()

    return LambdaCallback(on_round_end=on_round_end), when


def _train(addresses: list[str], token: str | None, mode: str, epochs: int, test: Any, cbs: list[Any]):
    with Cluster(addresses, token, heartbeat_interval=0.5, heartbeat_timeout=1.5) as c:
        app = DenseMnist(c)
        app.data_dir = DenseMnist.data_dir  # an instance attribute travels to the workers with the app
        strategy = ddlf.Asynchronous(chunk=20) if mode == "async" else ddlf.ModelAveraging(every=20)
        h = app.train(epochs=epochs, batch_size=64, strategy=strategy, verbose=0, run=ddlf.RunConfig(seed=1),
                      callbacks=cbs)  # fmt: skip
        return h, float(app.evaluate(*test)[1])


def _kill_run(mode: str, epochs: int, test: Any) -> dict[str, Any]:
    with LocalWorkers(3, threads=1) as ref_workers:
        _, acc_ref = _train(ref_workers.addresses, ref_workers.token, mode, epochs, test, [])
    with LocalWorkers(3, threads=1) as workers:
        victim = workers.pids()[2]
        cb, when = _at_round(5, lambda: os.kill(victim, signal.SIGKILL))
        h, acc = _train(workers.addresses, workers.token, mode, epochs, test, [cb])
    lost = next(e for e in h.events if e["event"] == "lost")
    per_epoch = [sum(s.samples for s in h.stats if s.epoch == e) for e in range(epochs)]
    return {
        "acc_ref": acc_ref,
        "acc": acc,
        "detect": lost["time"] - when["t"],
        "skipped": h.params["samples"] * epochs - sum(per_epoch),
        "epochs": len(h.history["loss"]),
    }


def _stop_run(test: Any) -> dict[str, Any]:
    with LocalWorkers(3, threads=1) as workers:
        victim = workers.pids()[1]
        cb, when = _at_round(3, lambda: os.kill(victim, signal.SIGSTOP))
        h, acc = _train(workers.addresses, workers.token, "sync", 1, test, [cb])
        os.kill(victim, signal.SIGCONT)
    lost = next(e for e in h.events if e["event"] == "lost")
    return {"detect": lost["time"] - when["t"], "acc": acc, "epochs": len(h.history["loss"])}


def _restart_run(test: Any) -> dict[str, Any]:
    workers = LocalWorkers(2, threads=1)
    try:
        address = workers.addresses[1]
        restarted: dict[str, Any] = {}

        def kill_and_restart() -> None:
            os.kill(workers.pids()[1], signal.SIGKILL)

            def again() -> None:
                restarted["workers"] = LocalWorkers(1, threads=1, listen=[address], token=workers.token)

            threading.Thread(target=again).start()

        cb, when = _at_round(3, kill_and_restart)
        h, acc = _train(workers.addresses, workers.token, "sync", 2, test, [cb])
        lost = next(e for e in h.events if e["event"] == "lost")
        back = next(
            s
            for s in h.stats
            if s.worker == 1 and s.samples > 0 and (s.epoch, s.round) > (lost["epoch"], lost["round"])
        )
        joined = next(e for e in h.events if e["event"] == "joined")
        return {"rounds": back.round - lost["round"], "seconds": joined["time"] - when["t"], "acc": acc}
    finally:
        workers.terminate()
        if "workers" in restarted:
            restarted["workers"].terminate()


def _soak(calls: int) -> dict[str, Any]:
    with Cluster.local(1, threads=1) as c:
        c.add_function(lambda x: x, "echo")
        for _ in range(1000):
            c.run("echo", 1)
        before = c.status()[0]["rss_bytes"]
        t0 = time.perf_counter()
        for i in range(calls):
            c.run("echo", i)
        seconds = time.perf_counter() - t0
        after = c.status()[0]["rss_bytes"]
    return {"before": before, "after": after, "growth": after / before - 1, "seconds": seconds}


def prepare(data: str) -> tuple[Any, Any]:
    """For a fault benchmark: lost-worker warnings off (they are the point), :class:`DenseMnist` reading MNIST
    from ``data``; returns the MNIST test set."""
    warnings.simplefilter("ignore", RuntimeWarning)
    DenseMnist.data_dir = os.path.abspath(data)
    _, (xt, yt) = datasets.mnist(DenseMnist.data_dir)
    return xt, yt


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks faults", description=__doc__)
    p.add_argument("--epochs", type=int, default=3, help="epochs of the kill -9 runs")
    p.add_argument("--calls", type=int, default=100_000, help="calls of the soak run")
    p.add_argument("--data", default=os.path.join("examples", "data", "mnist"))
    p.add_argument("--out", default="RELIABILITY.md")
    args = p.parse_args(argv)
    test = prepare(args.data)
    kills = {mode: _kill_run(mode, args.epochs, test) for mode in ("sync", "async")}
    stop = _stop_run(test)
    restart = _restart_run(test)
    soak = _soak(args.calls)
    rows = []
    for mode, k in kills.items():
        rows.append(
            f"| kill -9 one of 3 workers mid-epoch, {mode} | training finished ({k['epochs']} epochs) on the 2 "
            f"survivors; test accuracy {100 * k['acc']:.2f}% vs {100 * k['acc_ref']:.2f}% undisturbed "
            f"({100 * (k['acc'] - k['acc_ref']):+.2f} points) | {k['detect']:.2f} s | "
            + (
                f"no state; {k['skipped']:,} of {60000 * args.epochs:,} sample-visits skipped (the lost worker's "
                "rows of the interrupted round; re-weighted average) |"
                if mode == "sync"
                else f"nothing: its chunk went back to the queue ({k['skipped']} sample-visits skipped) |"
            )
        )
    rows.append(
        f"| SIGSTOP one of 3 workers (hung, not dead), sync, heartbeat 0.5 s / timeout 1.5 s | declared lost, the "
        f"round finished with the survivors; test accuracy after 1 epoch {100 * stop['acc']:.2f}% | "
        f"{stop['detect']:.2f} s | no state |"
    )
    rows.append(
        f"| kill -9 a worker and restart its daemon at the same address, sync | re-provisioned (functions, "
        f"variables replayed; dataset reloaded) and training again {restart['rounds']} rounds later | "
        f"back {restart['seconds']:.1f} s after the kill | no state |"
    )
    rows.append(
        f"| soak: {args.calls:,} calls to one daemon | resident memory {soak['before'] / 2**20:.1f} MiB after "
        f"1,000 calls, {soak['after'] / 2**20:.1f} MiB after {args.calls:,} more ({100 * soak['growth']:+.1f}%; "
        f"target < +5%); {soak['seconds'] / args.calls * 1e6:.0f} us per call | - | - |"
    )
    body = "\n".join(
        [
            "## Measured faults (`python -m benchmarks faults`)",
            "",
            f"Machine: {report.machine()}.",
            "",
            "| fault injected | what happened | time to detect | data lost |",
            "| --- | --- | --- | --- |",
            *rows,
        ]
    )
    path = Path(args.out)
    text = path.read_text() if path.exists() else ""
    start, end = "<!-- bench:faults:start -->", "<!-- bench:faults:end -->"
    block = f"{start}\n{body}\n{end}"
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip() + ("\n\n" if text else "") + block + "\n"
    path.write_text(text)
    print(body)
