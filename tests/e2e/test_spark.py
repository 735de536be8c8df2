"""Spark as the data supplier, with pyspark in local mode and real ddlf workers: a DataFrame exported once and
loaded by shard, and workers hosted inside a barrier stage beside their partitions."""

from __future__ import annotations

import glob
import os
import shutil
import sys

import numpy as np
import pytest

import ddlf

from ..conftest import pooled

pyspark = pytest.importorskip("pyspark")
if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
    pytest.skip("Spark needs a Java runtime", allow_module_level=True)

import ddlf.spark  # noqa: E402


@pytest.fixture(scope="module")
def spark():
    from pyspark.sql import SparkSession

    # Executors run this interpreter (the one ddlf is installed in), as a cluster's nodes would have it.
    saved = os.environ.get("PYSPARK_PYTHON")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    session = (
        SparkSession.builder.master("local[2]")
        .appName("ddlf-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.host", "127.0.0.1")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
    if saved is None:
        os.environ.pop("PYSPARK_PYTHON", None)
    else:
        os.environ["PYSPARK_PYTHON"] = saved


def frame(spark, rows: int = 2000, seed: int = 0):
    """A DataFrame as an ETL job leaves it: a Spark ML vector of features and a label."""
    from pyspark.ml.linalg import Vectors

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 8)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.float32)
    data = [(Vectors.dense(r.tolist()), float(v)) for r, v in zip(x, y)]
    return spark.createDataFrame(data, ["features", "label"]).repartition(2), x, y


def model():
    import keras

    m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1, activation="sigmoid")])
    m.compile(optimizer=keras.optimizers.Adam(0.05), loss="binary_crossentropy", metrics=["accuracy"])
    return m


@pytest.mark.slow
def test_an_exported_dataframe_trains_by_shard(spark, tmp_path) -> None:
    df, x, y = frame(spark)
    path = ddlf.spark.export(df, str(tmp_path / "export"))

    class Exported(ddlf.IApp):
        sharded = True
        dataset_key = f"spark-export-{os.getpid()}"

        def load_shard(self, shard, n_shards):
            return ddlf.datasets.parquet(path, columns=["features"], label="label", shard=(shard, n_shards))

        def create_model(self):
            return model()

    # The export holds every row once, vectors as float32 tensors.
    fx, fy = ddlf.datasets.parquet(path, columns=["features"], label="label")
    assert sorted(fy.tolist()) == sorted(y.tolist())
    assert fx.shape == (2000, 8) and fx.dtype == np.float32
    assert np.isclose(np.sort(fx.sum(axis=1)), np.sort(x.sum(axis=1)), atol=1e-4).all()
    with pooled(2) as c:
        h = Exported(c).train(epochs=3, batch_size=32, verbose=0)
        held = [d for w in c.datasets() for d in w if d["key"].startswith(Exported.dataset_key)]
        assert sorted(d["shard"][0] for d in held) == [0, 1]
        assert sum(d["rows"] for d in held) == 2000  # each worker its share, nothing twice
    assert h.history["accuracy"][-1] > 0.9


@pytest.mark.slow
def test_workers_hosted_in_a_barrier_stage_train_beside_their_partitions(spark) -> None:
    df, x, _ = frame(spark, seed=1)

    class FromSpark(ddlf.spark.SparkApp):
        def create_model(self):
            return model()

    before = set(glob.glob("/dev/shm/ddlf-spark-*"))
    # token= is a Cluster argument like the others: the stage's workers take it instead of one made for them (the
    # master authenticates with it, so connecting at all shows they did).
    with ddlf.spark.hosted(df, "features", "label", num_workers=2, token="chosen-by-the-user") as c:
        assert len(c) == 2
        h = FromSpark(c).train(epochs=3, batch_size=32, verbose=0)
        shapes = c.run(lambda: [a.shape for a in ddlf.spark.partition()])
        assert sum(s[0][0] for s in shapes) == 2000 and all(s[0][1:] == (8,) for s in shapes)
        sums = c.run(lambda: float(np.sum(ddlf.spark.partition()[0], dtype=np.float64)))
        assert np.isclose(sum(sums), float(np.sum(x, dtype=np.float64)), rtol=1e-5)
    assert h.history["accuracy"][-1] > 0.9
    # The stage ended with the block: its workers are gone and their shared-memory partitions removed.
    assert set(glob.glob("/dev/shm/ddlf-spark-*")) <= before
    assert spark.range(3).count() == 3  # Spark goes on serving


def test_partition_outside_a_hosted_worker_is_a_clear_error() -> None:
    with pytest.raises(ddlf.datasets.DatasetError, match="hosted"):
        ddlf.spark.partition()
