"""Sweeps on real daemons: trials on worker groups, ASHA stopping, cached datasets, a worker killed mid-sweep."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from pathlib import Path

import pytest

import ddlf
from ddlf.training.run import SLOW_WORKER_ENV

from ..conftest import MNIST_DIR, POOL, pooled
from .apps import SmallMnist


class Tunable(SmallMnist):
    def __init__(self, cluster: ddlf.Cluster, lr: float, width: int) -> None:
        super().__init__(cluster)
        self.lr, self.width = lr, width

    def create_model(self):
        import keras

        model = keras.Sequential(
            [
                keras.Input(shape=(784,)),
                keras.layers.Dense(self.width, activation="relu"),
                keras.layers.Dense(10, "softmax"),
            ]
        )
        model.compile(keras.optimizers.Adam(self.lr), "sparse_categorical_crossentropy", metrics=["accuracy"])
        return model


def make_app(cluster: ddlf.Cluster, config: dict) -> Tunable:
    return Tunable(cluster, config["lr"], config["width"])


@pytest.fixture(scope="module")
def val_set():
    _, (xt, yt) = ddlf.datasets.mnist(MNIST_DIR)
    return xt[:1000], yt[:1000]


class Epochs(ddlf.callbacks.Callback):
    """Records (itself, the epoch) in a list every copy shares: each trial must get its own copy."""

    seen: list[tuple[Epochs, int]] = []

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.seen.append((self, epoch))  # the copy itself, kept alive: ids of freed copies could be reused


class KillOnFirstEpoch(ddlf.callbacks.Callback):
    """Kills a daemon when the first epoch of any trial ends: the trials start together, so a slower one is
    mid-trial then, however loaded the machine. Shared by every trial (no copies)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.done = pid, threading.Event()

    def __deepcopy__(self, memo: dict) -> KillOnFirstEpoch:
        return self

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if not self.done.is_set():
            self.done.set()
            os.kill(self.pid, signal.SIGKILL)


# Strong configs first: ASHA keeps whatever is best so far at a rung, so trials that arrive in improving order all
# continue; weak ones arriving after strong ones are the ones it must stop (which is what the test checks).
CONFIGS = [{"lr": lr, "width": w} for lr in (3e-3, 1e-3, 1e-5) for w in (32, 8)]


@pytest.mark.slow
def test_a_sweep_stops_weak_trials_and_finds_a_good_one(cluster: ddlf.Cluster, val_set, tmp_path: Path) -> None:
    Epochs.seen.clear()
    result = ddlf.sweep(
        cluster, make_app, CONFIGS, epochs=4, grace_epochs=1, reduction_factor=2, validation_data=val_set,
        batch_size=64, report=tmp_path / "sweep.html", callbacks=[Epochs()],
    )  # fmt: skip
    statuses = [t.status for t in result.trials]
    # fit's callbacks reach every trial, each trial its own copy, every epoch it trained.
    per_copy: dict[int, int] = {}
    for cb, _ in Epochs.seen:
        per_copy[id(cb)] = per_copy.get(id(cb), 0) + 1
    assert sorted(per_copy.values()) == sorted(t.epochs for t in result.trials), Epochs.seen
    assert set(statuses) <= {"completed", "stopped"}, [(t.status, t.error) for t in result.trials]
    assert "stopped" in statuses and "completed" in statuses
    best = result.best
    assert best.config["lr"] != 1e-5 and best.metric is not None and best.metric > 0.8
    # Stopped trials trained fewer epochs; completed ones all of them.
    assert all(t.epochs == 4 for t in result.trials if t.status == "completed")
    assert all(t.epochs < 4 for t in result.trials if t.status == "stopped")
    # Each trial ran on one worker; each worker loaded the dataset at most once for the whole sweep.
    setups = [s for t in result.trials for s in t.history.params["setup"]]
    assert len(setups) == len(CONFIGS) and sum(not s["cached"] for s in setups) <= len(cluster)
    assert {tuple(t.workers) for t in result.trials} <= {(0,), (1,)}
    rows = result.table()
    assert len(rows) == len(CONFIGS) and all("val_accuracy" in r for r in rows)
    assert cluster.run(ddlf.training.replica.runs) == [[], []]  # no run left on the workers
    # The sweep's page: a row and a bar per trial, the best trial's metric on a card, the numbers beside it.
    page = (tmp_path / "sweep.html").read_text()
    assert re.findall(r"<tr class='(\w+)'>", page) == statuses
    assert len(re.findall(r"<rect class='trial (?:completed|stopped)'", page)) == len(CONFIGS)
    assert f"{best.metric:.4g}" in page
    numbers = json.loads((tmp_path / "sweep.json").read_text())
    assert [t["epochs"] for t in numbers["trials"]] == [t.epochs for t in result.trials]
    assert all(len(t["curve"]) == t["epochs"] for t in numbers["trials"])


@pytest.mark.slow
def test_a_lost_worker_requeues_only_its_trial(val_set, monkeypatch: pytest.MonkeyPatch) -> None:
    # Worker 2 trains slowly (50 ms a batch: the master's experiment hook), so it is mid-trial (its first of three
    # epochs, the others' trials ahead of it) when the first epoch of any trial ends and it is killed.
    monkeypatch.setenv(SLOW_WORKER_ENV, "2:0.05")
    # The pool's spares: the killed one is replaced for the next test.
    with pooled(3, spare=True, heartbeat_timeout=3.0) as c:
        killer = KillOnFirstEpoch(POOL.pid(2, spare=True))
        with pytest.warns(RuntimeWarning, match="lost"):
            result = ddlf.sweep(
                c, make_app, CONFIGS[2:], epochs=3, grace_epochs=3, validation_data=val_set,
                batch_size=64, run=ddlf.RunConfig(rejoin_timeout=1.0), callbacks=[killer],
            )  # fmt: skip
        assert killer.done.is_set()
        assert [t.status for t in result.trials] == ["completed"] * 4, [(t.status, t.error) for t in result.trials]
        assert all(t.workers != [2] for t in result.trials)  # what ran on the dead worker ran again elsewhere
        assert any(t.attempts == 2 for t in result.trials)


def test_fits_validation_split_and_validation_freq_reach_the_trials(cluster: ddlf.Cluster) -> None:
    result = ddlf.sweep(
        cluster, make_app, CONFIGS[:2], epochs=3, grace_epochs=1, validation_split=0.2, validation_freq=[1, 3],
        batch_size=64,
    )  # fmt: skip
    for t in result.trials:
        assert t.status in ("completed", "stopped"), (t.status, t.error)
        assert t.metric is not None and t.epochs >= 1
        validated = [e for e in (1, 3) if e <= t.epochs]  # the epochs, counted from 1, that validation_freq names
        assert len(t.history.history["val_accuracy"]) == len(validated), t.history.history


def test_bad_sweeps_are_refused(cluster: ddlf.Cluster, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="configs is empty"):
        ddlf.sweep(cluster, make_app, [], epochs=1)
    with pytest.raises(ValueError, match="workers_per_trial"):
        ddlf.sweep(cluster, make_app, CONFIGS, epochs=1, workers_per_trial=3)
    with pytest.raises(ValueError, match="mode"):
        ddlf.sweep(cluster, make_app, CONFIGS, epochs=1, mode="best")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="validation_data"):
        ddlf.sweep(cluster, make_app, CONFIGS, epochs=1, metric="val_accuracy")
    with pytest.raises(TypeError, match="dicts"):
        ddlf.sweep(cluster, make_app, [(1e-3, 8)], epochs=1)  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"\.html"):
        ddlf.sweep(cluster, make_app, CONFIGS, epochs=1, metric="loss", mode="min", report="sweep.txt")

    class Locked(ddlf.callbacks.Callback):
        def __init__(self) -> None:
            self.lock = threading.Lock()  # cannot be copied

    with pytest.raises(TypeError, match="its own copy"):
        ddlf.sweep(cluster, make_app, CONFIGS, epochs=1, metric="loss", mode="min", callbacks=[Locked()])
    import keras

    for writer in (keras.callbacks.BackupAndRestore(str(tmp_path)), ddlf.callbacks.ModelCheckpoint(str(tmp_path))):
        with pytest.raises(ValueError, match="write over each other"):
            ddlf.sweep(cluster, make_app, CONFIGS, epochs=1, metric="loss", mode="min", callbacks=[writer])
    # The rungs here are epochs 1, 2 and 4: validating every 2nd epoch would leave the first without the metric.
    with pytest.raises(ValueError, match=r"rungs at epochs \[1\]"):
        ddlf.sweep(
            cluster, make_app, CONFIGS, epochs=8, reduction_factor=2, validation_data=([0], [0]), validation_freq=2
        )
    # Nothing was started: the workers serve as before.
    assert cluster.run(lambda: "still serving") == ["still serving", "still serving"]
