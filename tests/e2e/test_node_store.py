"""One copy of a dataset per host, with real worker daemons: the first worker to load it writes it to /dev/shm, the
others map it; it outlives a killed worker and another script's daemons map it without loading; drop_dataset and
the last worker's clean exit remove it."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

import ddlf
from ddlf.data import node_store

from ..conftest import POOL, pooled

pytestmark = pytest.mark.skipif(node_store.root() is None, reason="needs /dev/shm")


def make_loader(log_path: str, rows: int):
    def loader():
        import numpy as np

        with open(log_path, "a") as f:
            f.write("loaded\n")
        rng = np.random.default_rng(7)
        return rng.standard_normal((rows, 28, 28)).astype(np.float32), rng.integers(0, 10, rows).astype(np.uint8)

    return loader


def checksum(key: str) -> tuple[float, int, bool]:
    from ddlf.data.store import STORE

    x, y = STORE.get(key).value
    return float(np.sum(x, dtype=np.float64)), int(np.sum(y, dtype=np.int64)), bool(x.flags.writeable)


def loads(log: str) -> int:
    """How many times a loader made by :func:`make_loader` ran (on any process)."""
    with open(log) as f:
        return f.read().count("loaded")


def checksum_of(key: str) -> tuple[float, int, bool]:
    from ddlf.data.store import STORE

    x, y = STORE.get(key).value
    return float(np.sum(x, dtype=np.float64)), int(np.sum(y)), bool(x.flags.writeable)


def entries(key: str) -> list[str]:
    base = node_store.root()
    assert base is not None
    if not os.path.isdir(base):
        return []
    return [n for n in os.listdir(base) if n.startswith(key + "-") and not n.endswith(".lock")]


def test_workers_of_a_host_load_once_and_map_one_copy(tmp_path) -> None:
    log = str(tmp_path / "loads")
    loader = make_loader(log, 5000)
    key = f"node-store-{os.getpid()}"
    with pooled(3) as c:
        out = c.load_dataset(key, loader)
        assert loads(log) == 1  # one worker loaded, the other two mapped its copy
        assert [i["cached"] for i in out] == [False] * 3
        assert all(i["node_shared"] and i["memory_mapped"] and i["rows"] == 5000 for i in out)
        assert len(entries(key)) == 1
        sums = c.run(checksum, key)
        want = loader()
        assert sums == [(float(np.sum(want[0], dtype=np.float64)), int(np.sum(want[1])), False)] * 3
        assert c.drop_dataset(key) == [True] * 3
        assert not entries(key)  # the last holder let go: removed
    assert loads(log) == 2  # the worker's load and the master's check above


def test_the_copy_outlives_a_killed_loader_and_serves_the_next_daemons(tmp_path) -> None:
    log = str(tmp_path / "loads")
    loader = make_loader(log, 3000)
    key = f"node-store-kill-{os.getpid()}"
    # Other daemons (another script's), reset before the loader starts: nothing between the kill and their load
    # may sweep the host's store (a reset or a clean exit would remove a copy nobody holds).
    with pooled(2) as c:
        with pooled(1, spare=True) as first:
            assert first.load_dataset(key, loader)[0]["node_shared"]
            victim = POOL.pid(0, spare=True)
            os.kill(victim, signal.SIGKILL)  # no clean exit: nothing lets go of the copy
            POOL.wait_gone(0, spare=True)
        assert len(entries(key)) == 1
        out = c.load_dataset(key, loader)  # they map it, nobody loads
        assert all(i["node_shared"] and not i["cached"] for i in out)
        assert loads(log) == 1
        assert len(set(c.run(checksum, key))) == 1
        assert c.drop_dataset(key) == [True, True]
    assert not entries(key)  # the last holder let go: removed (a clean exit does too: the next test)


@pytest.mark.fresh_daemons("the daemons' clean exit is under test")
def test_the_last_clean_exit_removes_the_hosts_copy(tmp_path) -> None:
    key = f"node-store-exit-{os.getpid()}"
    with ddlf.Cluster.local(2, threads=1) as c:
        c.load_dataset(key, make_loader(str(tmp_path / "loads"), 100))
        assert len(entries(key)) == 1
    assert not entries(key)


@pytest.mark.slow
@pytest.mark.parametrize("on_disk", [False, True], ids=["host-copy", "cache-dir"])
def test_training_reads_a_parquet_export_through_the_hosts_copy(tmp_path, on_disk: bool) -> None:
    """Loaded into the host's one copy, or (``cache_dir``, for data larger than memory) converted once on local
    disk and mapped by both workers."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2000, 20)).astype(np.float32)
    export = tmp_path / "export"
    export.mkdir()
    for i in range(2):  # as Spark writes a DataFrame: part files
        part = x[i * 1000 : (i + 1) * 1000]
        columns = {f"f{j}": pa.array(part[:, j]) for j in range(20)}
        columns["label"] = pa.array((part[:, 0] > 0).astype(np.float32))
        pq.write_table(pa.table(columns), str(export / f"part-{i:05d}.parquet"))

    class Exported(ddlf.IApp):
        dataset_key = f"node-store-parquet-{os.getpid()}"
        path = str(export)
        cache = str(tmp_path / "cache") if on_disk else None

        def load_dataset(self):
            return ddlf.datasets.parquet(self.path, label="label", cache_dir=self.cache)

        def create_model(self):
            import keras

            model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(1, activation="sigmoid")])
            model.compile(optimizer=keras.optimizers.Adam(0.05), loss="binary_crossentropy", metrics=["accuracy"])
            return model

    with pooled(2) as c:
        h = Exported(c).train(epochs=3, batch_size=32, verbose=0)
        want = (float(np.sum(x, dtype=np.float64)), int(np.sum(x[:, 0] > 0)), False)
        assert c.run(checksum_of, Exported.dataset_key) == [want, want]  # the export, row for row
        held = [d for w in c.datasets() for d in w if d["key"] == Exported.dataset_key]
        assert len(held) == 2 and all(d["node_shared"] is not on_disk and d["rows"] == 2000 for d in held)
        if on_disk:  # one conversion, mapped by both workers
            assert len([e for e in os.listdir(Exported.cache) if not e.endswith(".lock")]) == 1
        assert held[0]["arrays"] == [((2000, 20), "float32"), ((2000,), "float32")]
        assert h.history["accuracy"][-1] > 0.9
