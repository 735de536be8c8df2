"""Preemption and time limits (``ddlf.training.preemption``): a scheduler's signal ends training at a round boundary
with a checkpoint of the last merged round, and the resumed run goes on from the next round: in sync mode it ends
with the weights of a run never interrupted. (Slurm itself, with requeue: ``tests/slurm/``.)"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import numpy as np
import pytest

import ddlf
from ddlf.training import checkpoint

from ..conftest import POOL, pid_alive, pooled, wait_until
from .apps import FaultApp


class SignalAt(ddlf.callbacks.Callback):
    """Send this process ``signum`` when round ``at`` ends (as Slurm's warning would arrive mid-epoch)."""

    def __init__(self, at: int, signum: int) -> None:
        self.at, self.signum = at, signum

    def on_round_end(self, round: int, logs=None) -> None:
        if round == self.at:
            os.kill(os.getpid(), self.signum)


@pytest.mark.parametrize("signame", ["SIGUSR1", "SIGTERM"])
def test_a_preempted_sync_run_resumes_at_the_next_round_and_ends_as_an_uninterrupted_one(
    cluster: ddlf.Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signame: str
) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)  # not a Slurm job: nothing to requeue
    kw = dict(batch_size=32, strategy=ddlf.ModelAveraging(every=5), verbose=0)
    straight = FaultApp(cluster)
    straight.train(epochs=2, run=ddlf.RunConfig(seed=3), **kw)

    ckpt = tmp_path / "ckpt"
    first = FaultApp(cluster)
    # 6,000 rows, 2 workers x 5 batches of 32 a round: 19 rounds an epoch (0-18); round 23 is the second's fifth.
    with pytest.raises(ddlf.Preempted) as info:
        first.train(
            epochs=2,
            run=ddlf.RunConfig(seed=3, checkpoint_dir=ckpt),
            callbacks=[SignalAt(23, getattr(signal, signame))],
            **kw,
        )
    err = info.value
    assert err.signal == signame and not err.requeued and err.checkpoint == str(checkpoint.path_in(ckpt))
    assert "after 1 epochs and 1600 rows" in str(err), str(err)
    saved = checkpoint.load(ckpt)
    assert saved["epochs_done"] == 1 and saved["epoch_position"] == 5 * 2 * 5 * 32  # rounds 19-23 merged
    # Preempted: the handlers stay and ignore what follows (the scheduler's SIGTERM after a requeue)
    assert signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL
    os.kill(os.getpid(), getattr(signal, signame))  # ignored: this process goes on
    assert [e["event"] for e in saved["history"]["events"]] == ["preempted"]

    resumed = FaultApp(cluster)
    h = resumed.train(epochs=2, run=ddlf.RunConfig(seed=3, checkpoint_dir=ckpt, resume=True), **kw)
    for s in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(s, signal.SIG_DFL)  # this test's process: as it was
    for a, b in zip(straight.model.get_weights(), resumed.model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert len(h.history["loss"]) == 2
    assert [e["event"] for e in h.events] == ["preempted", "resumed"]
    assert cluster.run(lambda: 1) == [1, 1]


def test_a_preempted_run_resumes_on_another_number_of_workers(
    cluster: ddlf.Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A requeued job may get fewer (or more) nodes: the checkpoint's place is rows of the epoch's permutation,
    which the new workers split among themselves. Preempted on 2 workers mid-epoch, resumed on 1: every row of
    each epoch trained once."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    ckpt = tmp_path / "ckpt"
    kw = dict(batch_size=32, strategy=ddlf.ModelAveraging(every=5), verbose=0)
    with pytest.raises(ddlf.Preempted, match="after 0 epochs and 1920 rows"):
        FaultApp(cluster).train(
            epochs=2, run=ddlf.RunConfig(seed=3, checkpoint_dir=ckpt), callbacks=[SignalAt(5, signal.SIGUSR1)], **kw
        )
    for s in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(s, signal.SIG_DFL)  # this test's process: as it was
    h = FaultApp(cluster).train(
        epochs=2, run=ddlf.RunConfig(seed=3, checkpoint_dir=ckpt, resume=True, workers=[0]), **kw
    )
    assert [e["event"] for e in h.events] == ["preempted", "resumed"]
    for epoch in (0, 1):
        assert sum(s.samples for s in h.stats if s.epoch == epoch) == 6000, epoch
    assert sum(s.samples for s in h.stats if s.epoch == 1 and s.worker == 1) == 0  # the second run: worker 0 only
    assert h.history["accuracy"][-1] > 0.7


class StopTheJob(ddlf.callbacks.Callback):
    """What a scheduler does when it preempts or requeues a job: SIGTERM to every process of it, the workers and
    this master, here ``delay`` seconds after round ``at`` ended (while the next one trains)."""

    def __init__(self, at: int, workers: list[int], delay: float) -> None:
        self.at, self.workers, self.delay = at, workers, delay

    def on_round_end(self, round: int, logs=None) -> None:
        if round == self.at:
            threading.Timer(self.delay, self._stop).start()

    def _stop(self) -> None:
        for pid in self.workers:
            os.kill(pid, signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.slow
def test_a_sigterm_to_every_process_of_a_ring_run_loses_only_the_round_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gradient averaging on the ring (the default strategy): the weights of the last round live on the workers. A
    SIGTERM to the workers used to end them at once, and the preempted run fell back to its last epoch's
    checkpoint; now they drain (ddlf.worker.drain): the round in flight is abandoned, the master reads the last
    merged round from them, and the resumed run ends as one never interrupted."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    kw = dict(batch_size=32, strategy=ddlf.GradientAveraging(check_in_every=5), verbose=0)
    ckpt = tmp_path / "ckpt"
    with pooled(2, spare=True) as c:  # both are stopped by the test: the pool replaces them
        straight = FaultApp(c)
        straight.train(epochs=1, run=ddlf.RunConfig(seed=3), **kw)
        pids = [POOL.pid(0, spare=True), POOL.pid(1, spare=True)]
        # Worker 1 sleeps 0.1 s a batch (5 a round) in this run: the signal lands inside round 6, with worker 1
        # in its sleep and worker 0 waiting for it in the all-reduce.
        monkeypatch.setenv("DDLF_SLOW_WORKER", "1:0.1")
        first = FaultApp(c)
        with pytest.raises(ddlf.Preempted) as info:
            first.train(
                epochs=1,
                run=ddlf.RunConfig(seed=3, checkpoint_dir=ckpt),
                callbacks=[StopTheJob(5, pids, delay=0.25)],
                **kw,
            )
        monkeypatch.delenv("DDLF_SLOW_WORKER")
        for s in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(s, signal.SIG_DFL)  # this test's process: as it was
        # 6,000 rows; a round is 2 workers x 5 batches of 32: rounds 0-5 merged, round 6 abandoned.
        assert info.value.signal == "SIGTERM" and "no new checkpoint" not in str(info.value), str(info.value)
        assert "after 0 epochs and 1920 rows" in str(info.value), str(info.value)
        saved = checkpoint.load(ckpt)
        assert saved["epochs_done"] == 0 and saved["epoch_position"] == 1920
        states = saved["worker_states"]
        assert len(states) == 2 and all(s["optimizer"] is not None for s in states.values())
        # The run torn down, the workers ended their drain and exited (well within Slurm's KillWait of 30 s).
        assert wait_until(lambda: not any(pid_alive(p) for p in pids), timeout=15), "the workers did not exit"
    with pooled(2, spare=True) as c:  # the requeued job: new workers (the pool's replacements)
        resumed = FaultApp(c)
        h = resumed.train(epochs=1, run=ddlf.RunConfig(seed=3, checkpoint_dir=ckpt, resume=True), **kw)
    events = [e["event"] for e in h.events if e["event"] != "exchange"]
    assert events == ["stopping", "round_abandoned", "preempted", "resumed"], events  # worker 1's answer first
    assert sum(s.samples for s in h.stats) == 6000  # rounds 0-5 in the first run, 6-18 here: each row once
    for a, b in zip(straight.model.get_weights(), resumed.model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


class StopOneWorker(ddlf.callbacks.Callback):
    """SIGTERM to one worker when round ``at`` ends (a node drained, a pod evicted): the master is not told."""

    def __init__(self, at: int, pid: int) -> None:
        self.at, self.pid = at, pid

    def on_round_end(self, round: int, logs=None) -> None:
        if round == self.at:
            os.kill(self.pid, signal.SIGTERM)


@pytest.mark.slow
def test_a_worker_stopped_alone_is_left_out_and_training_goes_on(tmp_path: Path) -> None:
    """A worker told to stop while the master is not (no preemption) refuses new rounds while it drains: the
    failure policy takes that as a lost worker (``lost_worker="continue"``), and the run ends on the others."""
    with pooled(2, spare=True) as c:
        pid = POOL.pid(1, spare=True)
        app = FaultApp(c)
        h = app.train(
            epochs=2,
            batch_size=32,
            verbose=0,
            strategy=ddlf.GradientAveraging(check_in_every=5),
            run=ddlf.RunConfig(seed=3, checkpoint_dir=tmp_path / "ckpt"),
            callbacks=[StopOneWorker(3, pid)],
        )
        assert len(h.history["loss"]) == 2 and h.history["accuracy"][-1] > 0.7
        assert sum(s.samples for s in h.stats if s.epoch == 1 and s.worker == 1) == 0  # left out from then on
        assert sum(s.samples for s in h.stats if s.epoch == 1) == 6000  # the epoch on worker 0 alone
        stops = [e for e in h.events if e["event"] == "stopping"]
        assert [e["worker"] for e in stops] == [1], h.events  # once: left out of every later round
        assert not any(e["event"] == "allreduce_redo" and e["round"] > stops[0]["round"] + 1 for e in h.events)
        assert wait_until(lambda: not pid_alive(pid), timeout=25), "the stopped worker did not exit"


def test_a_run_that_was_not_preempted_puts_the_handlers_back(cluster: ddlf.Cluster, tmp_path: Path) -> None:
    FaultApp(cluster).train(epochs=1, batch_size=64, verbose=0, run=ddlf.RunConfig(checkpoint_dir=tmp_path))
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_preempted_async_run_resumes_after_the_rows_its_chunks_trained(
    cluster: ddlf.Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    ckpt = tmp_path / "ckpt"
    kw = dict(batch_size=32, strategy=ddlf.Asynchronous(chunk=5), verbose=0)
    first = FaultApp(cluster)
    with pytest.raises(ddlf.Preempted, match="SIGUSR1") as info:
        first.train(
            epochs=2, run=ddlf.RunConfig(seed=3, checkpoint_dir=ckpt), callbacks=[SignalAt(5, signal.SIGUSR1)], **kw
        )
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    saved = checkpoint.load(ckpt)
    assert saved["epochs_done"] == 0
    for a, b in zip(saved["weights"], first.model.get_weights()):
        assert a.shape == b.shape
    # The chunks in flight finished: the position is every row the first run trained, a prefix of the order.
    trained = sum(s["samples"] for s in saved["history"]["stats"])
    assert saved["epoch_position"] == trained >= 5 * 5 * 32, (saved["epoch_position"], trained)
    assert f"after 0 epochs and {trained} rows" in str(info.value)
    h = FaultApp(cluster).train(epochs=2, run=ddlf.RunConfig(seed=3, checkpoint_dir=ckpt, resume=True), **kw)
    # Epoch 0's rows were trained once each, across the two runs: none redone, none skipped.
    assert sum(s.samples for s in h.stats if s.epoch == 0) == 6000
    assert sum(s.samples for s in h.stats if s.epoch == 1) == 6000
    assert [e["event"] for e in h.events] == ["preempted", "resumed"]
    assert len(h.history["loss"]) == 2 and h.history["accuracy"][-1] > 0.7


def test_preemption_signals_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a signal name"):
        ddlf.RunConfig(checkpoint_dir=tmp_path, preemption_signals=("SIGNOPE",))
    with pytest.raises(ValueError, match="SIGINT"):
        ddlf.RunConfig(checkpoint_dir=tmp_path, preemption_signals=("INT",))
    with pytest.raises(TypeError, match="tuple of signals"):
        ddlf.RunConfig(checkpoint_dir=tmp_path, preemption_signals="SIGUSR1")
    assert ddlf.RunConfig(preemption_signals=("USR2", 15)).preemption_signals == ("USR2", 15)
