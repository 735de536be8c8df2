"""The master of the Slurm tests, run by ``sbatch deploy/slurm/ddlf.sbatch tests/slurm/slurm_job.py OUT.json``
on the first node of a real (namespace) Slurm cluster: it starts the allocation's workers with
``Cluster.from_slurm()``, trains the tests' small MNIST model and appends one JSON line about the run to OUT.json.

Environment: ``EPOCHS`` (default 2), ``CKPT`` (a checkpoint directory: resume from it, and checkpoint there),
``EVERY`` (batches a round, default 10), ``STRATEGY`` (``gradients``: gradient averaging, the default strategy,
checking in every ``EVERY`` batches; else model averaging every ``EVERY`` batches), ``BEFORE_TRAIN`` (seconds the
first run spends between starting its workers and ``train()``, as a script that loads its data: it writes
``OUT.json.started`` first), ``ROUND_SLEEP`` (seconds the first run sleeps after each round: a slower job).
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import ddlf
from tests.e2e.apps import SmallMnist


class SlurmMnist(SmallMnist):
    dataset_key = "mnist-slurm"
    rows = 6000


class SlowRounds(ddlf.callbacks.Callback):
    """Sleeps after each round: a job whose training takes longer than its time limit."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_round_end(self, round: int, logs: dict | None = None) -> None:
        time.sleep(self.seconds)


def main(out: str) -> None:
    t0 = time.time()
    ckpt = os.environ.get("CKPT")
    run = ddlf.RunConfig(checkpoint_dir=ckpt, resume=True, seed=7) if ckpt else ddlf.RunConfig(seed=7)
    record: dict[str, object] = {"job": os.environ["SLURM_JOB_ID"], "restart": os.environ.get("SLURM_RESTART_COUNT")}
    with ddlf.Cluster.from_slurm(per="task", token=os.environ.get("TOKEN")) as cluster:
        info = cluster.worker_info()
        record["workers"] = [(i["hostname"], i["name"]) for i in info]
        record["addresses"] = cluster.addresses
        record["token"] = cluster.token
        app = SlurmMnist(cluster)
        if os.environ.get("BEFORE_TRAIN") and record["restart"] in (None, "0"):
            open(out + ".started", "w").close()
            time.sleep(float(os.environ["BEFORE_TRAIN"]))  # loading its data, say
        every = int(os.environ.get("EVERY", "10"))
        strategy: ddlf.ModelAveraging | ddlf.GradientAveraging = ddlf.ModelAveraging(every=every)
        if os.environ.get("STRATEGY") == "gradients":  # the default strategy, with a check-in (a round) every EVERY
            strategy = ddlf.GradientAveraging(scale_learning_rate=True, check_in_every=every)
        callbacks = []
        if os.environ.get("ROUND_SLEEP") and record["restart"] in (None, "0"):
            callbacks.append(SlowRounds(float(os.environ["ROUND_SLEEP"])))
        try:
            history = app.train(
                epochs=int(os.environ.get("EPOCHS", "2")),
                batch_size=64,
                verbose=0,
                run=run,
                strategy=strategy,
                callbacks=callbacks,
            )
        except ddlf.Preempted as exc:
            # Written at once: Slurm ends this job KillWait seconds after its SIGTERM.
            record.update(status="preempted", preempted=str(exc), requeued=exc.requeued, seconds=time.time() - t0)
            _write(out, record)
            raise
        record["status"] = "done"
        record["epochs"] = len(history.history["loss"])
        record["events"] = [e["event"] for e in history.events]
        resumed = [e for e in history.events if e["event"] == "resumed"]
        preempted = [e for e in history.events if e["event"] == "preempted"]
        if resumed:  # where the resumed run started: the preemption's checkpoint, or an epoch's
            at = preempted[-1] if preempted else {"epochs_done": resumed[-1]["epochs_done"], "position": 0}
            record["resumed_from"] = [at["epochs_done"], at.get("position", 0)]
        record["samples"] = sum(s.samples for s in history.stats)
        x, y = app.load_dataset()
        x, y = app.preprocess(x[:1000], y[:1000])
        record["accuracy"] = float(app.model.evaluate(x, y, verbose=0, return_dict=True)["accuracy"])
    record["seconds"] = time.time() - t0
    _write(out, record)


def _write(out: str, record: dict[str, object]) -> None:
    with open(out, "a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
