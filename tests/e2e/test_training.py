"""IApp training end to end on a local 2-worker cluster: sync, async, determinism, compression, callbacks."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import ddlf
from ddlf.training.callbacks import EarlyStopping, LambdaCallback, ModelCheckpoint

from ..conftest import MNIST_DIR
from .apps import SmallMnist


@pytest.fixture(scope="module")
def mnist_test_split():
    _, (xt, yt) = ddlf.datasets.mnist(MNIST_DIR)
    return xt[:2000], yt[:2000]


def test_sync_training_learns_and_records_history(cluster: ddlf.Cluster, mnist_test_split) -> None:
    app = SmallMnist(cluster)
    h = app.train(
        epochs=3, batch_size=32, validation_data=mnist_test_split, verbose=0, strategy=ddlf.ModelAveraging(every=20)
    )
    assert set(h.history) >= {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert len(h.history["loss"]) == 3
    assert h.history["loss"][-1] < h.history["loss"][0]
    _, acc = app.evaluate(*mnist_test_split)
    assert acc > 0.80
    # 1,500 rows per worker, 20 batches of 32 per round: 3 rounds per epoch, one stats row per worker per round.
    assert len(h.stats) == 3 * 3 * 2
    assert sum(s.samples for s in h.stats) == 3 * 3000
    assert all(s.bytes_sent > 0 and s.bytes_received > 0 for s in h.stats)
    assert '"summary"' in h.to_json()


def test_sync_is_deterministic_and_seeded_mode_matches_index_mode(cluster: ddlf.Cluster) -> None:
    runs = []
    for send in ("indices", "indices", "seed"):
        app = SmallMnist(cluster)
        app.train(epochs=2, batch_size=64, run=ddlf.RunConfig(seed=7), data=ddlf.DataConfig(send=send), verbose=0)
        runs.append(app.model.get_weights())
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            np.testing.assert_array_equal(a, b)


def test_second_run_reuses_the_cached_dataset(cluster: ddlf.Cluster) -> None:
    SmallMnist(cluster).train(epochs=0, batch_size=32, verbose=0)
    app = SmallMnist(cluster)
    h = app.train(epochs=1, batch_size=64, verbose=0)
    assert all(i["cached"] for i in h.params["setup"])
    assert all(i["load_seconds"] == 0.0 for i in h.params["setup"])


def test_async_training_learns_and_reports_staleness(cluster: ddlf.Cluster, mnist_test_split) -> None:
    app = SmallMnist(cluster)
    h = app.train(epochs=3, batch_size=32, verbose=0, strategy=ddlf.Asynchronous(chunk=5, staleness=ddlf.DynSGD()))
    _, acc = app.evaluate(*mnist_test_split)
    assert acc > 0.75  # async runs are not bit-reproducible: a margin below the sync test's bar
    assert sum(s.samples for s in h.stats) == 3 * 3000
    assert {s.worker for s in h.stats} == {0, 1}
    assert max(s.staleness for s in h.stats) >= 1  # two workers interleave


def test_async_max_staleness_drops_stale_deltas(cluster: ddlf.Cluster) -> None:
    h = SmallMnist(cluster).train(
        epochs=1, batch_size=32, verbose=0, strategy=ddlf.Asynchronous(chunk=2, max_staleness=0)
    )
    dropped = [s for s in h.stats if s.dropped]
    assert all(s.staleness > 0 for s in dropped)
    assert all(not s.dropped for s in h.stats if s.staleness == 0)


@pytest.mark.parametrize("compression", ["float16", "bfloat16"])
def test_compression_halves_bytes_back_at_equal_accuracy(cluster: ddlf.Cluster, mnist_test_split, compression) -> None:
    accuracy, received = {}, {}
    for c in (None, compression):
        app = SmallMnist(cluster)
        strategy = ddlf.ModelAveraging(every=20, exchange=ddlf.ThroughMaster(compression=c))
        h = app.train(epochs=2, batch_size=32, strategy=strategy, run=ddlf.RunConfig(seed=3), verbose=0)
        accuracy[c] = app.evaluate(*mnist_test_split)[1]
        received[c] = h.stats[0].bytes_received
    assert received[compression] * 2 == received[None]
    assert accuracy[compression] > 0.7  # 2 epochs on 3,000 images
    assert abs(accuracy[compression] - accuracy[None]) < 0.02


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_topk_compression_with_error_feedback(cluster: ddlf.Cluster, mnist_test_split, mode) -> None:
    app = SmallMnist(cluster)

    def strategy(compression: ddlf.TopK | None) -> ddlf.ModelAveraging | ddlf.Asynchronous:
        if mode == "async":
            return ddlf.Asynchronous(chunk=10, compression=compression)
        return ddlf.ModelAveraging(every=10, exchange=ddlf.ThroughMaster(compression=compression))

    h = app.train(epochs=3, batch_size=32, strategy=strategy(ddlf.TopK(0.05)), run=ddlf.RunConfig(seed=1), verbose=0)
    plain = SmallMnist(cluster).train(epochs=1, batch_size=32, strategy=strategy(None), verbose=0)
    # 5% of the entries, 8 bytes each (index + value) instead of 4: about a tenth of the dense bytes.
    sent_back = np.mean([s.bytes_received for s in h.stats])
    dense = np.mean([s.bytes_received for s in plain.stats])
    assert 0.05 < sent_back / dense < 0.15
    assert app.evaluate(*mnist_test_split)[1] > 0.7
    with pytest.raises(ValueError, match=r"TopK\.ratio"):
        ddlf.TopK(2.0)


def test_optimizer_state_averaging_and_uneven_shares(cluster: ddlf.Cluster) -> None:
    h = SmallMnist(cluster).train(
        epochs=1,
        batch_size=32,
        verbose=0,
        strategy=ddlf.ModelAveraging(every=10, optimizer_state=True),
        data=ddlf.DataConfig(worker_shares=[3, 1]),
    )
    per_worker = h.summary()["workers"]
    assert per_worker[0]["samples"] == 2250 and per_worker[1]["samples"] == 750


def test_callbacks(cluster: ddlf.Cluster, mnist_test_split, tmp_path) -> None:
    seen = []
    stop = EarlyStopping(monitor="loss", patience=0, min_delta=10.0)
    ckpt = ModelCheckpoint(str(tmp_path / "e{epoch}.weights.h5"), monitor="val_accuracy")
    hook = LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append((epoch, round(logs["loss"], 6))))
    h = SmallMnist(cluster).train(
        epochs=5, batch_size=64, validation_data=mnist_test_split, callbacks=[stop, ckpt, hook], verbose=0
    )
    assert len(h.history["loss"]) == 2  # the second epoch did not improve by 10: stop
    assert [e for e, _ in seen] == [0, 1]
    assert sorted(os.listdir(tmp_path)) == ["e1.weights.h5", "e2.weights.h5"]


def test_progress_bar_prints_epochs(cluster: ddlf.Cluster, capsys) -> None:
    SmallMnist(cluster).train(epochs=1, batch_size=64, verbose=1)
    out = capsys.readouterr().out
    assert "ddlf: sync training on 2 workers" in out
    assert "Epoch 1/1" in out and "samples/s" in out and "loss:" in out


def test_bad_training_arguments(cluster: ddlf.Cluster) -> None:
    app = SmallMnist(cluster)
    with pytest.raises(TypeError, match="strategy must be"):
        app.train(strategy="eventual")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="compression"):
        app.train(strategy=ddlf.ModelAveraging(exchange=ddlf.ThroughMaster(compression="int3")))
    with pytest.raises(ValueError, match="send"):
        app.train(data=ddlf.DataConfig(send="random"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="staleness"):
        app.train(strategy=ddlf.Asynchronous(staleness="wild"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one per worker"):
        app.train(data=ddlf.DataConfig(worker_shares=[1, 1, 1]))


class Overriding(SmallMnist):
    """Overrides ``train_sync`` as the docs allow: it sees the frozen options and trains with a changed copy."""

    seen: list[ddlf.TrainConfig] = []

    def train_sync(self, cfg, validation_data=None, callbacks=(), initial_epoch=0):
        self.seen.append(cfg)
        return super().train_sync(dataclasses.replace(cfg, epochs=1), validation_data, callbacks, initial_epoch)


def test_a_train_sync_override_gets_the_frozen_options_and_the_run_keeps_its_own_state(cluster: ddlf.Cluster) -> None:
    app = Overriding(cluster)
    history = app.train(epochs=3, batch_size=64, verbose=0)  # ddlf's default strategy: a reason is recorded
    (cfg,) = app.seen
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.epochs = 5  # type: ignore[misc]
    assert cfg.epochs == 3 and len(history.history["loss"]) == 1  # the override's copy is what trained
    assert history.params["strategy_reason"]  # the run's own state reached the run through the override
    assert len(history.params["run_id"]) == 12
    again = app.train(epochs=1, batch_size=64, verbose=0)
    assert again.params["run_id"] != history.params["run_id"]  # each run its own id


def test_failing_load_dataset_is_a_remote_error(cluster: ddlf.Cluster) -> None:
    class Broken(SmallMnist):
        dataset_key = "broken"

        def load_dataset(self):
            return ddlf.datasets.mnist("/nonexistent/mnist")

    with pytest.raises(ddlf.RemoteError, match="not found"):
        Broken(cluster).train(epochs=1, verbose=0)

    class WrongKeys(SmallMnist):
        dataset_key = "wrong-keys"

        def load_dataset(self):
            return {"images": np.zeros((4, 784), np.uint8), "labels": np.zeros(4, np.uint8)}

    with pytest.raises(ddlf.RemoteError, match=r"keys \['images', 'labels'\]; it takes 'x', 'y'"):
        WrongKeys(cluster).train(epochs=1, verbose=0)
    assert cluster.run(lambda: "still serving") == ["still serving"] * 2


class ShardedMnist(SmallMnist):
    """Each worker loads only its own half of the 3,000 images."""

    dataset_key = "mnist-small-sharded"
    sharded = True

    def load_shard(self, shard, n_shards):
        (x, y), _ = ddlf.datasets.mnist(MNIST_DIR)
        x, y = x[: self.rows], y[: self.rows]
        return x[shard::n_shards], y[shard::n_shards]

    def load_dataset(self):
        raise AssertionError("a sharded app never loads the whole dataset")


def _drop_shards(cluster: ddlf.Cluster) -> None:
    """Shards another test of the module left (rotated, say), whatever order the tests ran in."""
    for w in cluster.datasets():
        for key in [d["key"] for d in w if "sharded" in d["key"]]:
            cluster.drop_dataset(key)


def test_sharded_dataset_each_worker_holds_only_its_shard(cluster: ddlf.Cluster, mnist_test_split) -> None:
    _drop_shards(cluster)
    app = ShardedMnist(cluster)
    h = app.train(epochs=3, batch_size=32, verbose=0, strategy=ddlf.ModelAveraging(every=20))
    held = cluster.datasets()
    assert [[d["key"] for d in w if "sharded" in d["key"]] for w in held] == [
        ["mnist-small-sharded/shard-0-of-2"],
        ["mnist-small-sharded/shard-1-of-2"],
    ]
    assert all(d["rows"] == 1500 for w in held for d in w if "sharded" in d["key"])
    assert sum(s.samples for s in h.stats) == 3 * 3000
    assert app.evaluate(*mnist_test_split)[1] > 0.75


def test_sharded_dataset_rotation_and_seeded_mode(cluster: ddlf.Cluster) -> None:
    _drop_shards(cluster)
    runs = []
    for send in ("indices", "seed"):
        app = ShardedMnist(cluster)
        data = ddlf.DataConfig(rotate_shards_every=1, send=send)
        app.train(epochs=2, batch_size=64, data=data, run=ddlf.RunConfig(seed=5), verbose=0)
        runs.append(app.model.get_weights())
    # With rotation every epoch, both workers have held both shards.
    for w in cluster.datasets():
        assert sorted(d["key"] for d in w if "sharded" in d["key"]) == [
            "mnist-small-sharded/shard-0-of-2",
            "mnist-small-sharded/shard-1-of-2",
        ]
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)
    h = ShardedMnist(cluster).train(
        epochs=1, batch_size=64, verbose=0, strategy=ddlf.Asynchronous(), data=ddlf.DataConfig(rotate_shards_every=1)
    )
    assert sum(s.samples for s in h.stats) == 3000
    with pytest.raises(ValueError, match="sharded"):
        SmallMnist(cluster).train(verbose=0, data=ddlf.DataConfig(rotate_shards_every=2))


@pytest.mark.slow
def test_app_subclassing_an_app_from_a_neighbour_module(tmp_path) -> None:
    """A script's app that subclasses an app defined in a file beside the script: workers, started elsewhere,
    cannot import that file, so its module travels by value too (not only the script's own class)."""
    scripts, elsewhere = tmp_path / "scripts", tmp_path / "elsewhere"
    scripts.mkdir()
    elsewhere.mkdir()
    (scripts / "base_app.py").write_text(
        textwrap.dedent(
            f"""
            import numpy as np
            import ddlf

            class BaseApp(ddlf.IApp):
                dataset_key = "mnist-neighbour-test"
                def load_dataset(self):
                    (x, y), _ = ddlf.datasets.mnist({str(MNIST_DIR)!r})
                    return x[: self.rows], y[: self.rows]
                def preprocess(self, x, y):
                    return x.reshape(len(x), -1).astype(np.float32) / 255.0, y
                def create_model(self):
                    import keras
                    model = keras.Sequential([keras.Input(shape=(784,)), keras.layers.Dense(10, "softmax")])
                    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
                    return model
            """
        )
    )
    (scripts / "main.py").write_text(
        textwrap.dedent(
            """
            import ddlf
            from base_app import BaseApp

            class Mine(BaseApp):
                rows = 600

            if __name__ == "__main__":
                with ddlf.Cluster.local(1) as cluster:
                    h = Mine(cluster).train(epochs=1, batch_size=64, verbose=0)
                    print("samples", sum(s.samples for s in h.stats))
            """
        )
    )
    out = subprocess.run(
        [sys.executable, str(scripts / "main.py")], cwd=elsewhere, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "samples 600" in out.stdout
