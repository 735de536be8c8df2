"""Faults during training and between calls: workers killed (-9), stopped, restarted, added and removed; the
master killed and resumed from its checkpoint. Training must finish, lose nothing it was not told about, and
record what happened in History."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import ddlf
from ddlf.training.callbacks import LambdaCallback
from ddlf.training.run import SLOW_WORKER_ENV

from ..conftest import MNIST_DIR, POOL, REPO, Daemon, pid_alive, pool_addresses, pooled, wait_until
from .apps import FaultApp, _kill_at_round


@pytest.fixture(scope="module")
def mnist_test_split():
    _, (xt, yt) = ddlf.datasets.mnist(MNIST_DIR)
    return xt[:5000], yt[:5000]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kill_9_one_of_three_workers_mid_epoch(mode: str, mnist_test_split) -> None:
    strategy = ddlf.Asynchronous(chunk=10) if mode == "async" else ddlf.ModelAveraging(every=10)
    kw = dict(epochs=5, batch_size=32, strategy=strategy, verbose=0, run=ddlf.RunConfig(seed=3))
    lr = 3e-3 if mode == "sync" else 1e-3
    acc_ref = None
    if mode == "sync":
        # Sync is deterministic: an undisturbed run is the exact reference. Async applies deltas in arrival
        # order, so two undisturbed runs of this small, unconverged model differ by several points by
        # themselves (measured: 81% and 89%); its 0.5-point comparison is made on full MNIST, where training
        # converges, by `python -m benchmarks faults` (RELIABILITY.md).
        with pooled(3, spare=True) as c:
            undisturbed = FaultApp(c)
            undisturbed.learning_rate = lr
            undisturbed.train(**kw)
            _, acc_ref = undisturbed.evaluate(*mnist_test_split)
    with pooled(3, spare=True) as c:
        victim = POOL.pid(2, spare=True)  # the pool replaces it for the next test
        app = FaultApp(c)
        app.learning_rate = lr
        cb, when = _kill_at_round(victim, 3)
        with pytest.warns(RuntimeWarning, match="worker 2 .* lost"):
            h = app.train(**kw, callbacks=[cb])
        _, acc = app.evaluate(*mnist_test_split)
        assert len(h.history["loss"]) == 5  # training finished
        lost = [e for e in h.events if e["event"] == "lost"]
        assert [e["worker"] for e in lost] == [2]
        detect = lost[0]["time"] - when["t"]
        assert detect >= 0, detect  # noticed after the kill (how soon: `python -m benchmarks faults`)
        assert any(s.lost and s.worker == 2 for s in h.stats)
        # After the loss the survivors cover the whole dataset: every row of the last epoch is trained.
        assert sum(s.samples for s in h.stats if s.epoch == 4) == FaultApp.rows
        if mode == "async":
            # Nothing lost: the killed worker's chunk went back to the queue, so the epoch it died in is whole too.
            assert sum(s.samples for s in h.stats if s.epoch == 0) == FaultApp.rows
        assert c.lost_workers == [2]
        print(f"{mode}: accuracy undisturbed {acc_ref}, one worker killed {acc:.4f}; detected in {detect:.3f} s")
        if acc_ref is not None:
            # Losing a worker must not cost accuracy: at most 0.5 points below the undisturbed run. Above it is no
            # fault: the survivors' averages each carry more of one worker's progress, which this unconverged model
            # gains from (RELIABILITY.md: +0.70 points on the benchmark; here +0.56 on TensorFlow, within 0.5 on JAX).
            assert acc >= acc_ref - 0.005, (acc, acc_ref)
        else:
            assert acc > 0.75  # it learned


@pytest.mark.slow
def test_a_stopped_worker_is_declared_lost_within_the_heartbeat_timeout(mnist_test_split) -> None:
    c = POOL.view(3, spare=True, heartbeat_interval=0.5, heartbeat_timeout=1.5)
    victim = POOL.pid(1, spare=True)
    try:
        app = FaultApp(c)
        cb, when = _kill_at_round(victim, 2, signal.SIGSTOP)
        with pytest.warns(RuntimeWarning, match="worker 1 .* lost"):
            h = app.train(epochs=1, batch_size=32, verbose=0, callbacks=[cb], strategy=ddlf.ModelAveraging(every=10))
        lost = [e for e in h.events if e["event"] == "lost"]
        assert [e["worker"] for e in lost] == [1], (h.events, c.events)
        # Found by the heartbeat (a stopped process keeps its sockets open: nothing else would find it).
        assert lost[0]["reason"].startswith(("heartbeat failed", "no answer to a heartbeat")), lost[0]
        assert lost[0]["time"] >= when["t"], (lost[0], when)
        # Woken up, it answers again and rejoins without re-provisioning (same daemon, state intact).
        os.kill(victim, signal.SIGCONT)
        assert wait_until(lambda: c.recover() == [1] or not c.lost_workers, 10)
        assert c.call(lambda: 1) == [1, 1, 1]
        assert [e["event"] for e in c.events if e["worker"] == 1][-1] == "rejoined"
        c.close()
    finally:
        os.kill(victim, signal.SIGCONT)  # the pool's member serves the next test


@pytest.mark.fresh_daemons("every worker is killed")
@pytest.mark.parametrize(
    "strategy",
    [None, ddlf.ModelAveraging(every=5), ddlf.Asynchronous()],
    ids=["gradient-averaging", "model-averaging", "async"],
)
def test_every_worker_killed_in_the_last_epoch_is_an_error(strategy, monkeypatch: pytest.MonkeyPatch) -> None:
    # A one-epoch run: the last epoch's rounds have nothing after them that would find every worker gone, and
    # the run once ended there with an empty History, the master's initial weights and only warnings.
    monkeypatch.setenv(SLOW_WORKER_ENV, "1:1.0")  # worker 1 takes a second a batch: the epoch outlasts the kill
    with ddlf.Cluster.local(2, threads=1) as c:
        pids = [c.run_on(i, os.getpid) for i in range(2)]
        killed: list[threading.Timer] = []

        def kill_all(logs: dict | None = None) -> None:
            killed.append(threading.Timer(0.3, lambda: [os.kill(p, signal.SIGKILL) for p in pids]))
            killed[0].start()

        app = FaultApp(c)
        with pytest.warns(RuntimeWarning, match="lost"), pytest.raises(ddlf.WorkerUnavailable) as err:
            app.train(
                epochs=1, batch_size=32, strategy=strategy, verbose=0,
                callbacks=[LambdaCallback(on_train_begin=kill_all)], run=ddlf.RunConfig(rejoin_timeout=1.0),
            )  # fmt: skip
        killed[0].join()
        assert "every worker is lost" in str(err.value) and "within 1 s" in str(err.value), err.value


def _inc(x: int) -> int:
    return x + 1


@pytest.mark.fresh_daemons("a daemon killed and restarted on its own address, without a token")
def test_a_restarted_daemon_is_reprovisioned_by_replay(tmp_path: Path) -> None:
    d = Daemon("--threads", "1", token=None)
    address = d.address
    with ddlf.Cluster([address], token=None) as c:
        c.set("weights", np.arange(5.0))
        c.add_function(_inc, "inc")
        c.exec("GREETING = 'hello'\ndef greet():\n    return GREETING")
        c.put_dataset("numbers", np.arange(100))
        c.set("gone", 1)
        c.delete("gone")
        d.proc.kill()
        d.proc.wait()
        d2 = Daemon("--threads", "1", "--listen", address, token=None)
        try:
            assert c.run("inc", 41) == [42]  # by name: only there because it was replayed
            timings = c.last_call_timings()  # of the retry that answered, not of the re-provisioning
            assert list(timings) == [0] and timings[0][1] >= timings[0][0] > 0
            assert c.run("greet") == ["hello"]  # defined by the replayed exec
            np.testing.assert_array_equal(c.get("weights")[0], np.arange(5.0))
            assert c.variables() == [["weights"]]
            assert c.datasets()[0][0]["rows"] == 100
            assert [e["event"] for e in c.events] == ["restarted"]
        finally:
            d2.stop()


@pytest.mark.slow
@pytest.mark.fresh_daemons("a daemon killed and restarted on its own address, without a token")
def test_a_killed_worker_restarted_mid_training_rejoins(mnist_test_split) -> None:
    daemons = [Daemon("--threads", "1", token=None) for _ in range(2)]
    try:
        c = ddlf.Cluster([d.address for d in daemons], token=None)
        killed: dict[str, float] = {}
        back = threading.Event()

        def restart() -> None:
            daemons[1] = Daemon("--threads", "1", "--listen", c.addresses[1], token=None)
            killed["back"] = time.time()
            back.set()

        def on_round_end(r: int, logs: dict) -> None:
            if r == 2 and "t" not in killed:
                killed["t"] = time.time()
                daemons[1].proc.kill()
                threading.Thread(target=restart).start()
            elif r > 2 and "held" not in killed:
                # One worker's rounds take milliseconds here: training could end before a new daemon has even
                # started (seen in CI). Hold it once until the daemon is back, plus one rejoin interval (1 s),
                # so that the next round's check finds it: the rejoin is what is tested, not that race.
                killed["held"] = time.time()
                assert back.wait(60), "the daemon did not restart"
                time.sleep(1.1)

        app = FaultApp(c)
        with pytest.warns(RuntimeWarning, match="worker 1 .* lost"):
            h = app.train(
                epochs=4,
                batch_size=32,
                verbose=0,
                callbacks=[LambdaCallback(on_round_end=on_round_end)],
                strategy=ddlf.ModelAveraging(every=5),
            )
        events = [e["event"] for e in h.events if e.get("worker") == 1]
        assert events[:3] == ["lost", "restarted", "joined"], h.events
        joined = next(e for e in h.events if e["event"] == "joined")
        lost = next(e for e in h.events if e["event"] == "lost")
        back = [
            s
            for s in h.stats
            if s.worker == 1 and s.samples > 0 and (s.epoch, s.round) > (lost["epoch"], lost["round"])
        ]
        assert back, "the restarted worker never trained again"
        print(f"rejoined {back[0].round - lost['round']} rounds after it was lost")
        assert joined["round"] <= back[0].round
        c.close()
    finally:
        for d in daemons:
            d.stop()


@pytest.mark.slow
def test_workers_added_and_removed_during_training() -> None:
    first, second, extra = pool_addresses(3, spare=True)
    try:
        c = ddlf.Cluster([first, second], token=POOL.token)

        def on_round_end(r: int, logs: dict) -> None:
            if r == 1:
                c.add_worker(extra)
            if r == 6:
                c.remove_worker(0)

        app = FaultApp(c)
        h = app.train(
            epochs=2,
            batch_size=32,
            verbose=0,
            callbacks=[LambdaCallback(on_round_end=on_round_end)],
            strategy=ddlf.ModelAveraging(every=5),
        )
        assert len(h.history["loss"]) == 2
        assert [e["event"] for e in h.events if e["event"] in ("added", "removed", "joined")] == [
            "added",
            "joined",
            "removed",
        ]
        assert c.addresses == [second, extra]
        # The added worker trained (index 2 before the removal, 1 after), and the last epoch covered every row.
        assert any(s.worker == 2 and s.samples > 0 for s in h.stats)
        assert sum(s.samples for s in h.stats if s.epoch == 1) == FaultApp.rows
        assert c.run(lambda worker: (worker.id, worker.n_workers)) == [(0, 2), (1, 2)]
    finally:
        c.close()


def test_sync_resume_from_checkpoint_reaches_the_same_weights(cluster: ddlf.Cluster, tmp_path: Path) -> None:
    kw = dict(batch_size=32, strategy=ddlf.ModelAveraging(every=20), verbose=0)
    straight = FaultApp(cluster)
    straight.train(epochs=3, run=ddlf.RunConfig(seed=7, checkpoint_dir=tmp_path / "a"), **kw)
    first = FaultApp(cluster)
    first.train(epochs=2, run=ddlf.RunConfig(seed=7, checkpoint_dir=tmp_path / "b"), **kw)  # "interrupted" after 2
    resumed = FaultApp(cluster)
    h = resumed.train(epochs=3, run=ddlf.RunConfig(seed=7, checkpoint_dir=tmp_path / "b", resume=True), **kw)
    for a, b in zip(straight.model.get_weights(), resumed.model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert len(h.history["loss"]) == 3
    assert [e["event"] for e in h.events] == ["resumed"]
    assert not list((tmp_path / "b").glob(".*tmp"))  # no partial files left


def test_resuming_with_the_default_strategy_keeps_the_rate_a_callback_left(cluster: ddlf.Cluster, tmp_path) -> None:
    """The default strategy scales the rate by the workers on the workers: a resumed run must not take the saved,
    already scaled rate as its base (it doubled at every resume), and trains on at the rate a callback left on
    the master, as ``BackupAndRestore`` restores it."""
    import keras

    def lower_rate(app: FaultApp) -> keras.callbacks.LambdaCallback:
        def at_end(epoch: int, logs: dict) -> None:
            if epoch == 0:
                app.model.optimizer.learning_rate.assign(2e-4)

        return keras.callbacks.LambdaCallback(on_epoch_end=at_end)

    straight = FaultApp(cluster)
    whole = straight.train(epochs=4, batch_size=32, verbose=0, callbacks=[lower_rate(straight)])
    run = ddlf.RunConfig(checkpoint_dir=tmp_path, resume=True)
    first = FaultApp(cluster)
    first.train(epochs=2, batch_size=32, verbose=0, run=run, callbacks=[lower_rate(first)])
    for epochs in (3, 4):  # resumed twice, in new apps (as new scripts would), without the callback
        resumed = FaultApp(cluster)
        h = resumed.train(epochs=epochs, batch_size=32, verbose=0, run=run)
        assert "resumed" in [e["event"] for e in h.events]
        assert float(resumed.model.optimizer.learning_rate) == pytest.approx(2e-4)
    np.testing.assert_array_equal(h.history["loss"], whole.history["loss"])
    for a, b in zip(straight.model.get_weights(), resumed.model.get_weights()):
        np.testing.assert_array_equal(a, b)


MASTER_SCRIPT = """
import sys, ddlf
sys.path.insert(0, {repo!r})
from tests.e2e.apps import FaultApp
with ddlf.Cluster({addresses!r}, token={token!r}) as c:
    h = FaultApp(c).train(epochs=4, batch_size=32, strategy=ddlf.ModelAveraging(every=5), verbose=0,
                          run=ddlf.RunConfig(checkpoint_dir={ckpt!r}, resume=True))
    print("EPOCHS", len(h.history["loss"]), [e["event"] for e in h.events])
"""


@pytest.mark.slow
def test_master_killed_mid_epoch_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    addresses = pool_addresses(2, spare=True)
    # The pool's daemons: they outlive the killed master, as hand-started ones do.
    ckpt = tmp_path / "ckpt"
    script = tmp_path / "master.py"
    script.write_text(
        textwrap.dedent(MASTER_SCRIPT).format(repo=REPO, addresses=addresses, token=POOL.token, ckpt=str(ckpt))
    )
    env = dict(os.environ)
    master = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    started = wait_until(lambda: (ckpt / "ddlf-checkpoint.pkl").exists() or master.poll() is not None, 120)
    assert started and master.poll() is None, master.stderr.read().decode() if master.poll() is not None else ""
    time.sleep(0.5)  # into the next epoch
    master.kill()
    master.wait()
    # The daemons kept serving, with their dataset still loaded.
    assert all(pid_alive(POOL.pid(i, spare=True)) for i in range(2))
    with ddlf.Cluster(addresses, token=POOL.token) as c:
        assert all(any(ds["key"] == FaultApp.dataset_key for ds in w) for w in c.datasets())
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "EPOCHS 4" in out.stdout and "'resumed'" in out.stdout, out.stdout


def test_bad_fault_handling_inputs_are_clear_errors(cluster: ddlf.Cluster, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no worker at '127\.0\.0\.1:1'"):
        cluster.remove_worker("127.0.0.1:1")
    with pytest.raises(IndexError, match="out of range"):
        cluster.remove_worker(7)
    with pytest.raises(ValueError, match=r"resume=True\) needs the checkpoint_dir"):
        FaultApp(cluster).train(epochs=1, verbose=0, run=ddlf.RunConfig(resume=True))
    (tmp_path / "ddlf-checkpoint.pkl").write_bytes(b"not a pickle at all")
    with pytest.raises(ValueError, match="not a readable ddlf checkpoint"):
        FaultApp(cluster).train(epochs=1, verbose=0, run=ddlf.RunConfig(checkpoint_dir=tmp_path, resume=True))
    assert cluster.run(lambda: "still serving") == ["still serving", "still serving"]


@pytest.mark.fresh_daemons("a daemon killed and restarted on its own address, without a token")
def test_check_finds_a_daemon_restarted_while_the_master_was_idle() -> None:
    d = Daemon("--threads", "1", token=None)
    try:
        with ddlf.Cluster([d.address], token=None) as c:
            c.set("x", 1)
            assert c.check() == []  # nothing happened
            d.proc.kill()
            d.proc.wait()
            d = Daemon("--threads", "1", "--listen", c.addresses[0], token=None)
            assert [e["event"] for e in c.check()] == ["restarted"]
            assert c.get("x") == [1]
    finally:
        d.stop()
