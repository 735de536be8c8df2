"""Spark as the data supplier: from a DataFrame to a trained model, ddlf against elephas on the same DataFrame.

    .venv/bin/python -m benchmarks spark [--epochs 1,2] [--repeats 1]

The DataFrame is what an ETL job leaves: MNIST's 60,000 training images as a Spark ML vector of 784 floats and a
label, cached in a ``local[2]`` Spark session. From that moment (the clock starts) each contender trains the DDLF
paper's CNN (a Reshape in front, for the vectors) with batch 64 on 2 workers until its ``fit`` returns:

- **elephas**: ``ElephasEstimator.fit(df)`` (synchronous mode, Spark ML's estimator API);
- **ddlf hosted**: ``ddlf.spark.hosted(df, ...)`` starts a ddlf worker in each task of a barrier stage beside its
  partition, written once to shared memory; a :class:`ddlf.spark.SparkApp` trains on them;
- **ddlf export**: ``ddlf.spark.export(df, path)`` writes Parquet once; local ddlf workers load their shards
  (``ddlf.datasets.parquet(..., shard=(i, n))``) and train.

Every run is a fresh process in elephas's virtualenv (tensorflow<2.20, numpy<2, pyspark<=4.0: see
``benchmarks/vs_elephas.py``; ddlf is built from this tree into it), all on TensorFlow. Each contender runs with
``E1`` and ``E2`` epochs (``--epochs``), interleaved: seconds per epoch = (T(E2) - T(E1)) / (E2 - E1), and time
from the DataFrame to the first training step = T(E1) - E1 x seconds per epoch (start-up, data hand-over, model
build), the same arithmetic for every contender, none of which reports its first step itself. Test accuracy
after E2 epochs shows each one trained.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import report
from .elephas_job import paper_cnn_layers
from .vs_elephas import ELEPHAS_REQUIREMENTS, ensure_venv, install_ddlf

MNIST = "examples/data/mnist"
SPARK_EXTRA = ["pyarrow>=15,<20", "pandas>=2.2,<3"]  # pyarrow 20+ needs numpy 2
BATCH, WORKERS = 64, 2


def _model(keras: Any) -> Any:
    from keras import layers

    # The Spark frame holds 784-vectors: the paper's CNN behind a reshape.
    return keras.Sequential([keras.Input(shape=(784,)), layers.Reshape((28, 28, 1)), *paper_cnn_layers(layers)])


def _session() -> Any:
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master(f"local[{WORKERS}]")
        .appName("ddlf-bench-spark")
        .config("spark.driver.memory", "4g")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _frame(spark: Any) -> Any:
    """MNIST's training set as an ETL job leaves it: a vector column and a label, cached, partitioned by worker."""
    import numpy as np
    import pandas as pd
    from pyspark.ml.functions import array_to_vector

    from ddlf import data as datasets

    (x, y), _ = datasets.mnist(MNIST)
    x = (x.reshape(len(x), -1).astype(np.float32) / 255.0).astype(np.float64)
    pdf = pd.DataFrame({"pixels": list(x), "label": y.astype(np.float64)})
    df = spark.createDataFrame(pdf, schema="pixels array<double>, label double").repartition(WORKERS)
    df = df.select(array_to_vector("pixels").alias("features"), "label").cache()
    assert df.count() == len(x)
    return df


def _test_set() -> tuple[Any, Any]:
    import numpy as np

    from ddlf import data as datasets

    _, (xt, yt) = datasets.mnist(MNIST)
    return xt.reshape(len(xt), -1).astype(np.float32) / 255.0, yt


def _elephas(df: Any, epochs: int) -> float:
    import keras
    from elephas.ml_model import ElephasEstimator

    model = _model(keras)
    est = ElephasEstimator()
    est.set_keras_model_config(model.to_json())
    est.set_optimizer_config(keras.optimizers.serialize(keras.optimizers.Adam()))
    est.set_mode("synchronous")
    est.set_loss("categorical_crossentropy")
    est.set_metrics(["accuracy"])
    est.set_categorical_labels(True)
    est.set_nb_classes(10)
    est.set_num_workers(WORKERS)
    est.set_epochs(epochs)
    est.set_batch_size(BATCH)
    est.set_validation_split(0.0)
    est.set_verbosity(0)
    est.setFeaturesCol("features")
    est.setLabelCol("label")
    fitted = est.fit(df)
    trained = fitted.get_model()  # the architecture; the trained weights are the transformer's
    trained.set_weights(fitted.weights)
    trained.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    xt, yt = _test_set()
    return float(trained.evaluate(xt, yt, batch_size=512, verbose=0)[1])


def _compiled() -> Any:
    import keras

    model = _model(keras)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def _ddlf_app() -> Any:
    import ddlf.spark

    class MnistFromSpark(ddlf.spark.SparkApp):
        def create_model(self) -> Any:
            return _compiled()

    return MnistFromSpark


def _ddlf_hosted(df: Any, epochs: int) -> float:
    import ddlf.spark

    app_class = _ddlf_app()
    with ddlf.spark.hosted(df, "features", "label", num_workers=WORKERS) as cluster:
        app = app_class(cluster)
        app.train(epochs=epochs, batch_size=BATCH, verbose=0)
        xt, yt = _test_set()
        return float(app.evaluate(xt, yt)[1])


def _ddlf_export(df: Any, epochs: int, directory: str) -> float:
    import ddlf
    import ddlf.spark

    path = ddlf.spark.export(df, os.path.join(directory, "mnist.parquet"))

    class Exported(ddlf.IApp):
        sharded = True
        dataset_key = f"bench-spark-export-{os.getpid()}"

        def load_shard(self, shard: int, n_shards: int) -> Any:
            return ddlf.datasets.parquet(path, columns=["features"], label="label", shard=(shard, n_shards))

        def create_model(self) -> Any:
            return _compiled()

    with ddlf.Cluster.local(WORKERS) as cluster:
        app = Exported(cluster)
        app.train(epochs=epochs, batch_size=BATCH, verbose=0)
        xt, yt = _test_set()
        return float(app.evaluate(xt, yt)[1])


def job(contender: str, epochs: int) -> None:
    """One run, in elephas's virtualenv: prints ``{"seconds": from the cached DataFrame to trained, ...}``."""
    spark = _session()
    df = _frame(spark)
    with tempfile.TemporaryDirectory(dir=os.getcwd(), prefix="ddlf-bench-spark-") as directory:
        t0 = time.perf_counter()
        if contender == "elephas":
            acc = _elephas(df, epochs)
        elif contender == "ddlf-hosted":
            acc = _ddlf_hosted(df, epochs)
        else:
            acc = _ddlf_export(df, epochs, directory)
        seconds = time.perf_counter() - t0
    spark.stop()
    print(json.dumps({"seconds": seconds, "accuracy": acc}), flush=True)


CONTENDERS = {
    "elephas": f"elephas {ELEPHAS_REQUIREMENTS[0].split('==')[1]} `ElephasEstimator.fit(df)`, synchronous",
    "ddlf-hosted": "ddlf `spark.hosted(df)`: workers in a barrier stage, partitions in shared memory",
    "ddlf-export": "ddlf `spark.export(df)` to Parquet, local workers load their shards",
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks spark", description=__doc__)
    p.add_argument("--epochs", default="1,2", help="the two epoch counts E1,E2 (seconds per epoch from the gap)")
    p.add_argument("--repeats", type=int, default=1, help="interleaved rounds")
    p.add_argument("--venv", default=".venv-elephas", help="elephas's virtualenv (made if missing)")
    p.add_argument("--job", choices=list(CONTENDERS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    e1, e2 = (int(e) for e in args.epochs.split(","))
    if args.job:
        job(args.job, e1)
        return
    if not os.path.isdir(MNIST):
        raise SystemExit("run from the repository root (examples/data/mnist is needed)")
    python = ensure_venv(Path(args.venv).absolute())
    if subprocess.run([str(python), "-c", "import pyarrow, pandas"], capture_output=True).returncode != 0:
        # ddlf's `spark` extra (Arrow for mapInArrow and Parquet), within elephas's numpy<2.
        subprocess.run([str(python), "-m", "pip", "install", "-q", *SPARK_EXTRA], check=True)
    install_ddlf(python)
    env = dict(os.environ, PYSPARK_PYTHON=str(python), PYSPARK_DRIVER_PYTHON=str(python), KERAS_BACKEND="tensorflow")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    times: dict[tuple[str, int], list[float]] = {}
    accs: dict[str, list[float]] = {}
    for r in range(args.repeats):
        for epochs in (e1, e2):
            for name in CONTENDERS:
                cmd = [str(python), "-m", "benchmarks", "spark", "--epochs", f"{epochs},{epochs}", "--job", name]
                out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
                if out.returncode != 0:
                    raise SystemExit(f"{name} failed ({out.returncode}):\n{out.stderr[-4000:]}")
                result = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
                times.setdefault((name, epochs), []).append(result["seconds"])
                if epochs == e2:
                    accs.setdefault(name, []).append(result["accuracy"])
                print(f"round {r + 1}: {name}, {epochs} epochs: {result}", file=sys.stderr, flush=True)
    per_epoch = {n: (report.median(times[(n, e2)]) - report.median(times[(n, e1)])) / (e2 - e1) for n in CONTENDERS}
    first = {n: report.median(times[(n, e1)]) - e1 * per_epoch[n] for n in CONTENDERS}
    rows = [
        [
            text,
            f"{first[n]:.1f}",
            f"{first[n] / first['elephas']:.2f}x",
            f"{per_epoch[n]:.1f}",
            f"{per_epoch[n] / per_epoch['elephas']:.2f}x",
            f"{report.median(times[(n, e2)]):.1f}",
            " / ".join(f"{100 * a:.2f}%" for a in accs[n]),
        ]
        for n, text in CONTENDERS.items()
    ]
    body = "\n".join(
        [
            "## Spark as the data supplier: a DataFrame to a trained model, ddlf against elephas",
            "",
            f"Command: `python -m benchmarks spark --epochs {args.epochs} --repeats {args.repeats}`  ",
            f"Machine: {report.machine()}",
            "",
            f"MNIST's 60,000 training images as a cached DataFrame (Spark ML vector of 784 floats, a label) in a "
            f"`local[{WORKERS}]` session; the paper's CNN, batch {BATCH}, {WORKERS} workers, TensorFlow, fresh "
            f"process per run (elephas's virtualenv), {args.repeats} interleaved round(s), medians. Seconds per "
            f"epoch = (T({e2}) - T({e1})) / {e2 - e1}; DataFrame to first step = T({e1}) - {e1} x seconds per epoch.",
            "",
            report.table(
                [
                    "contender",
                    "DataFrame to first step, s",
                    "vs elephas",
                    "s/epoch",
                    "vs elephas",
                    f"DataFrame to trained ({e2} epochs), s",
                    f"test accuracy after {e2}",
                ],
                rows,
            ),
            "",
        ]
    )
    print(body)
    report.write_section("spark", body)


if __name__ == "__main__":
    main()
