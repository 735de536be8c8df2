"""One elephas training run of the paper's CNN on MNIST, for ``python -m benchmarks elephas``; with
``--mode single``, the same model trained by one process's ``model.fit`` (no Spark): the baseline that the paper's
and the issue's overhead figures divide by.

Runs in elephas's own virtualenv (tensorflow<2.20, numpy<2, pyspark<=4.0), so it imports nothing from ddlf. Prints
one JSON line: seconds to start Spark, seconds in ``fit``, test accuracy. The caller times the whole process.

    python elephas_job.py --data examples/data/mnist --mode synchronous --epochs 2 --batch 64 --workers 2
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time

# This file's folder holds ddlf's benchmark modules: keep them from shadowing top-level packages.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]


def read_idx(path: str):
    import numpy as np

    with gzip.open(path, "rb") as f:
        raw = f.read()
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def paper_cnn_layers(layers):
    """The paper's CNN after its 28x28x1 input: Conv32-Pool-Conv64-Pool-Dropout-Dense10 (``layers``: Keras'
    ``layers`` module)."""
    return [
        layers.Conv2D(32, kernel_size=(3, 3), activation="relu"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Conv2D(64, kernel_size=(3, 3), activation="relu"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Flatten(),
        layers.Dropout(0.5),
        layers.Dense(10, activation="softmax"),
    ]


def paper_cnn():
    from tensorflow import keras
    from tensorflow.keras import layers

    model = keras.Sequential([keras.Input(shape=(28, 28, 1)), *paper_cnn_layers(layers)])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data", required=True)
    p.add_argument("--mode", choices=["synchronous", "asynchronous", "single"], default="synchronous")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--port", type=int, default=4000, help="asynchronous mode: the parameter server's port")
    args = p.parse_args()

    import numpy as np

    t0 = time.perf_counter()
    x = read_idx(os.path.join(args.data, "train-images-idx3-ubyte.gz"))
    y = read_idx(os.path.join(args.data, "train-labels-idx1-ubyte.gz"))
    xt = read_idx(os.path.join(args.data, "t10k-images-idx3-ubyte.gz"))
    yt = read_idx(os.path.join(args.data, "t10k-labels-idx1-ubyte.gz"))
    if args.limit:
        x, y = x[: args.limit], y[: args.limit]
    x = (x.astype(np.float32) / 255.0)[..., None]
    xt = (xt.astype(np.float32) / 255.0)[..., None]

    if args.mode == "single":
        model = paper_cnn()
        t_fit = time.perf_counter()
        model.fit(x, y, epochs=args.epochs, batch_size=args.batch, verbose=0, shuffle=True)
        fit_seconds = time.perf_counter() - t_fit
        _, acc = model.evaluate(xt, yt, batch_size=512, verbose=0)
        print(json.dumps({"spark_start": 0.0, "fit": fit_seconds, "accuracy": float(acc)}), flush=True)
        return

    from pyspark import SparkConf, SparkContext

    conf = (
        SparkConf()
        .setAppName("elephas-mnist")
        .setMaster(f"local[{args.workers}]")
        .set("spark.driver.memory", "4g")
        .set("spark.ui.enabled", "false")
    )
    sc = SparkContext(conf=conf)
    sc.setLogLevel("ERROR")
    spark_start = time.perf_counter() - t0

    from elephas.spark_model import SparkModel
    from elephas.utils.rdd_utils import to_simple_rdd

    model = paper_cnn()
    rdd = to_simple_rdd(sc, x, y)
    if args.mode == "synchronous":
        spark_model = SparkModel(model, num_workers=args.workers, batch_size=args.batch)
    else:
        from elephas.spark_model import AsynchronousSparkModel

        spark_model = AsynchronousSparkModel(
            model, num_workers=args.workers, batch_size=args.batch, frequency="epoch", port=args.port
        )
    t_fit = time.perf_counter()
    spark_model.fit(rdd, epochs=args.epochs, batch_size=args.batch, verbose=0, validation_split=0.0)
    fit_seconds = time.perf_counter() - t_fit
    trained = spark_model.master_network
    _, acc = trained.evaluate(xt, yt, batch_size=512, verbose=0)
    sc.stop()
    print(json.dumps({"spark_start": spark_start, "fit": fit_seconds, "accuracy": float(acc)}), flush=True)


if __name__ == "__main__":
    main()
