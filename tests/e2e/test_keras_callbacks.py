"""Keras' own callbacks in ``app.train`` (``ddlf.training.keras_callbacks``): the hooks and logs they get from
``fit``, ``self.model`` the master's model, and their effects on every worker."""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np
import pytest

import ddlf

from ..conftest import MNIST_DIR
from .apps import SmallMnist


@pytest.fixture(scope="module")
def mnist_test_split() -> tuple[np.ndarray, np.ndarray]:
    _, (xt, yt) = ddlf.datasets.mnist(MNIST_DIR)
    return xt[:1000], yt[:1000]


def _worker_learning_rates(cluster: ddlf.Cluster) -> list[float]:
    def rates() -> list[float]:
        from ddlf.training.replica.registry import SESSIONS

        return [float(np.asarray(s.model.optimizer.learning_rate)) for s in SESSIONS.by_id.values()]

    return [r for per_worker in cluster.run(rates) for r in per_worker]


class Probe(keras.callbacks.Callback):
    """Records which hooks ran, with which logs, and what ``self.model`` and ``params`` were."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int | None, dict]] = []

    def on_train_begin(self, logs=None):
        self.calls.append(("train_begin", None, dict(logs or {})))

    def on_epoch_begin(self, epoch, logs=None):
        self.calls.append(("epoch_begin", epoch, dict(logs or {})))

    def on_train_batch_begin(self, batch, logs=None):
        self.calls.append(("batch_begin", batch, dict(logs or {})))

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append(("batch_end", batch, dict(logs or {})))

    def on_epoch_end(self, epoch, logs=None):
        self.calls.append(("epoch_end", epoch, dict(logs or {})))

    def on_train_end(self, logs=None):
        self.calls.append(("train_end", None, dict(logs or {})))


@pytest.mark.parametrize(
    "strategy", [ddlf.ModelAveraging(every=20), ddlf.Asynchronous(chunk=20)], ids=["sync", "async"]
)
def test_a_keras_callback_gets_fits_hooks_logs_and_model(cluster: ddlf.Cluster, strategy, mnist_test_split) -> None:
    app = SmallMnist(cluster)
    probe = Probe()
    history = app.train(
        epochs=2, batch_size=32, strategy=strategy, validation_data=mnist_test_split, callbacks=[probe], verbose=0
    )
    kinds = [c[0] for c in probe.calls]
    assert kinds[0] == "train_begin" and kinds[-1] == "train_end"
    assert [c[1] for c in probe.calls if c[0] == "epoch_begin"] == [0, 1]
    ends = [c for c in probe.calls if c[0] == "epoch_end"]
    assert [c[1] for c in ends] == [0, 1] and {"loss", "accuracy", "val_loss", "val_accuracy"} <= set(ends[0][2])
    batches = [c for c in probe.calls if c[0] == "batch_end"]
    assert batches and all("loss" in c[2] for c in batches)  # one per round or merged chunk, with its logs
    assert probe.model is app.model
    assert probe.params["epochs"] == 2 and probe.params["steps"] == 1500 // 32 + 1
    # fit's batch index: counted from each epoch's start, rising, the epoch's last batch at its end
    per_epoch: list[list[int]] = []
    for kind, index, _ in probe.calls:
        if kind == "epoch_begin":
            per_epoch.append([])
        elif kind == "batch_end":
            per_epoch[-1].append(index)
    for indices in per_epoch:
        assert indices == sorted(indices) and indices[0] >= 0 and indices[-1] == probe.params["steps"] - 1, indices
    # a round (chunk) opens as a batch does: TensorBoard counts its steps at the begin, and times them to the end
    begins = [c[1] for c in probe.calls if c[0] == "batch_begin"]
    assert len(begins) == len(batches) and begins[0] == 0 and max(begins) < probe.params["steps"]
    if isinstance(strategy, ddlf.ModelAveraging):  # one round at a time: each begin just before its end
        pairs = [c[0] for c in probe.calls if c[0].startswith("batch")]
        assert pairs == ["batch_begin", "batch_end"] * len(batches)
    assert {k: history.params[k] for k in ("epochs", "steps", "verbose")} == probe.params  # as fit's History


def test_early_stopping_stops_training_on_every_worker(cluster: ddlf.Cluster) -> None:
    class NeverBetter(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.model.stop_training = epoch >= 1  # as EarlyStopping does once patience runs out

    h = SmallMnist(cluster).train(epochs=6, batch_size=64, callbacks=[NeverBetter()], verbose=0)
    assert len(h.history["loss"]) == 2
    es = keras.callbacks.EarlyStopping(monitor="loss", patience=0, min_delta=10.0)  # nothing improves by 10
    h = SmallMnist(cluster).train(epochs=6, batch_size=64, callbacks=[es], verbose=0)
    assert len(h.history["loss"]) == 2 and es.stopped_epoch == 1


def test_a_learning_rate_set_by_a_callback_reaches_every_worker(cluster: ddlf.Cluster) -> None:
    seen: list[list[float]] = []

    class Look(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append(_worker_learning_rates(cluster))

    schedule = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 1e-3 * 0.5**epoch)
    app = SmallMnist(cluster)
    app.train(epochs=3, batch_size=64, strategy=ddlf.ModelAveraging(every=10), callbacks=[schedule, Look()], verbose=0)
    # Epoch e trains at 1e-3 / 2**e on both workers (the master's rate, set at the epoch's start).
    assert [sorted(set(np.round(r, 8))) for r in seen] == [[1e-3], [5e-4], [2.5e-4]], seen
    assert float(np.asarray(app.model.optimizer.learning_rate)) == pytest.approx(2.5e-4)


def test_history_holds_what_fits_history_holds_from_initial_epoch_with_the_learning_rate(
    cluster: ddlf.Cluster, tmp_path: Path
) -> None:
    """``History.epoch`` counts from ``initial_epoch``, and the ``learning_rate`` that ``LearningRateScheduler``
    adds to an epoch's logs reaches History and the callbacks after it (``CSVLogger``), as in ``fit``, where
    every callback shares one logs dict and History comes last."""
    x = np.random.default_rng(0).standard_normal((64, 4)).astype(np.float32)
    y = np.random.default_rng(1).standard_normal((64, 1)).astype(np.float32)

    def callbacks(csv: Path) -> list:
        schedule = keras.callbacks.LearningRateScheduler(lambda e, lr: 1e-3 * (e + 1))
        return [schedule, keras.callbacks.CSVLogger(str(csv))]

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    want = model.fit(x, y, epochs=3, initial_epoch=1, verbose=0, callbacks=callbacks(tmp_path / "fit.csv"))

    app = SmallMnist(cluster)
    got = app.train(
        epochs=3,
        initial_epoch=1,
        batch_size=64,
        verbose=0,
        callbacks=callbacks(tmp_path / "ddlf.csv"),
        strategy=ddlf.ModelAveraging(every=10),
    )
    assert got.epoch == want.epoch == [1, 2]
    assert sorted(got.history) == sorted([*want.history, "accuracy"])  # SmallMnist compiles an accuracy metric
    assert got.history["learning_rate"] == pytest.approx(want.history["learning_rate"]) == [0.002, 0.003]
    header = (tmp_path / "ddlf.csv").read_text().splitlines()[0].split(",")
    assert "learning_rate" in header and (tmp_path / "fit.csv").read_text().splitlines()[0].count("learning_rate")


def test_csv_logger_and_model_checkpoint_write_as_in_fit(cluster: ddlf.Cluster, tmp_path: Path) -> None:
    csv = tmp_path / "log.csv"
    ckpt = tmp_path / "best.weights.h5"
    cbs = [
        keras.callbacks.CSVLogger(str(csv)),
        keras.callbacks.ModelCheckpoint(str(ckpt), monitor="loss", save_weights_only=True, save_best_only=True),
    ]
    app = SmallMnist(cluster)
    app.train(epochs=2, batch_size=64, callbacks=cbs, verbose=0)
    lines = csv.read_text().splitlines()
    assert lines[0].split(",")[:1] == ["epoch"] and "loss" in lines[0] and len(lines) == 3
    model = app.create_model()
    model.load_weights(str(ckpt))
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), app.model.get_weights()))


def test_backup_and_restore_resumes_an_interrupted_run_as_fit_does(cluster: ddlf.Cluster, tmp_path: Path) -> None:
    """``keras.callbacks.BackupAndRestore``: a run interrupted after its second epoch is resumed by the next
    ``train`` with the same backup directory from its third epoch, the master's model (and so every worker)
    starting from the backed-up weights and optimizer state, as ``fit`` resumes."""

    steps: list[int] = []

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            steps.append(int(self.model.optimizer.iterations.numpy()))
            if epoch == 1:
                raise RuntimeError("preempted")

    backup_dir = str(tmp_path / "backup")
    app = SmallMnist(cluster)
    with pytest.raises(RuntimeError, match="preempted"):
        app.train(
            epochs=4,
            batch_size=64,
            verbose=0,
            callbacks=[keras.callbacks.BackupAndRestore(backup_dir), Interrupt()],
            strategy=ddlf.ModelAveraging(every=20),
        )
    backed_up = [np.array(w) for w in app.model.get_weights()]  # the backup was written before the interruption

    resumed = SmallMnist(cluster)
    seen: dict[str, list] = {"epochs": [], "start": [], "steps": []}
    probe = keras.callbacks.LambdaCallback(
        on_train_begin=lambda logs: (
            seen["start"].append([np.array(w) for w in resumed.model.get_weights()]),
            seen["steps"].append(int(resumed.model.optimizer.iterations.numpy())),
        ),
        on_epoch_begin=lambda epoch, logs: seen["epochs"].append(epoch),
    )
    history = resumed.train(
        epochs=4,
        batch_size=64,
        verbose=0,
        callbacks=[keras.callbacks.BackupAndRestore(backup_dir), probe],
        strategy=ddlf.ModelAveraging(every=20),
    )
    assert seen["epochs"] == [2, 3] and len(history.history["loss"]) == 2
    for got, want in zip(seen["start"][0], backed_up):
        np.testing.assert_array_equal(got, want)
    assert next(e for e in history.events if e["event"] == "resumed")["epochs_done"] == 2
    # the optimizer too, as fit's backup holds it: the workers go on from its step count and moments
    per_epoch = steps[0]
    assert per_epoch > 0 and steps == [per_epoch, 2 * per_epoch] and seen["steps"] == [2 * per_epoch]
    assert int(resumed.model.optimizer.iterations.numpy()) == 4 * per_epoch


def test_tensorboard_and_progbar_logger_behave_as_in_fit(
    cluster: ddlf.Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str], mnist_test_split
) -> None:
    """``TensorBoard`` writes its train and validation event files; ``ProgbarLogger`` prints fit's per-epoch bar,
    which reaches the epoch's steps (``on_train_batch_end`` carries fit's batch index)."""
    log_dir = tmp_path / "tb"
    app = SmallMnist(cluster)
    app.train(
        epochs=2,
        batch_size=64,
        verbose=1,  # as in fit, ProgbarLogger prints nothing at verbose=0
        validation_data=mnist_test_split,
        callbacks=[keras.callbacks.TensorBoard(str(log_dir)), keras.callbacks.ProgbarLogger()],
        strategy=ddlf.ModelAveraging(every=10),
    )
    for part in ("train", "validation"):
        events = list((log_dir / part).glob("events.out.tfevents.*"))
        assert events and all(e.stat().st_size > 0 for e in events), part
    out = capsys.readouterr().out
    steps = 1500 // 64 + 1
    # Keras' bar replaces ddlf's (as fit adds none of its own): each epoch's bar ends full, with the validation logs
    ends = [line for line in out.replace("\r", "\n").splitlines() if "val_loss" in line]
    assert len(ends) == 2 and all(f"{steps}/{steps}" in line for line in ends), out
    assert "Epoch 1/2 - " not in out and out.count("Epoch 1/2") == 1, out  # ddlf's own per-epoch line stepped aside


def test_callbacks_watching_a_metric_without_a_mode_decide_as_in_fit(cluster: ddlf.Cluster, tmp_path: Path) -> None:
    """``EarlyStopping(monitor="val_accuracy")`` and ``ModelCheckpoint`` without ``mode``: ``fit`` reads the
    direction off the model's built metrics; the master's never ran a step, so ``train`` raised Keras' "isn't able
    to automatically determine" at the first epoch's end. The workers' metrics decide now: accuracy is better
    higher, so nothing improves on it by 1.0 and training stops after the second epoch."""
    es = keras.callbacks.EarlyStopping(monitor="val_accuracy", patience=0, min_delta=1.0)
    best = tmp_path / "best.weights.h5"
    ckpt = keras.callbacks.ModelCheckpoint(
        str(best), monitor="val_accuracy", save_weights_only=True, save_best_only=True
    )
    h = SmallMnist(cluster).train(epochs=6, batch_size=64, validation_split=0.2, callbacks=[es, ckpt], verbose=0)
    assert len(h.history["val_accuracy"]) == 2 and es.stopped_epoch == 1
    assert es.monitor_op is keras.ops.greater and es.min_delta == 1.0  # as Keras sets them for a metric going up
    assert ckpt.monitor_op is keras.ops.greater and best.exists()


@pytest.mark.parametrize("hook", ["on_train_batch_begin", "on_train_batch_end"])
@pytest.mark.parametrize(
    "strategy", [ddlf.ModelAveraging(every=20), ddlf.Asynchronous(chunk=20)], ids=["sync", "async"]
)
def test_a_callback_that_raises_in_a_round_ends_train_with_its_error(cluster: ddlf.Cluster, strategy, hook) -> None:
    """As in ``fit``: the error is ``train()``'s (asynchronous training lost the chunk and waited for ever when a
    round's begin raised, and printed an error at its end without stopping), and the workers train on after it."""

    def fail(batch: int, logs: dict | None = None) -> None:
        if batch > 0:
            raise RuntimeError("a user's callback failed")

    app = SmallMnist(cluster)
    with pytest.raises(RuntimeError, match="a user's callback failed"):
        app.train(
            epochs=2,
            batch_size=32,
            strategy=strategy,
            verbose=0,
            callbacks=[keras.callbacks.LambdaCallback(**{hook: fail})],
        )
    assert len(app.train(epochs=1, batch_size=32, strategy=strategy, verbose=0).history["loss"]) == 1
