"""The MNIST app shared by the examples: the DDLF paper's CNN (Conv32-Pool-Conv64-Pool-Dropout-Dense10)."""

from __future__ import annotations

import os

import numpy as np

import ddlf

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "mnist")


class MnistApp(ddlf.IApp):
    """Trains the paper's CNN on MNIST. Workers keep the raw uint8 images (47 MB) and scale each batch."""

    dataset_key = "mnist-v1"
    data_dir = DATA
    limit: int | None = None  # train on the first `limit` samples only (quick runs)

    def load_dataset(self):
        (x, y), _ = ddlf.datasets.mnist(self.data_dir)
        if self.limit:
            x, y = x[: self.limit], y[: self.limit]
        return x, y

    def preprocess(self, x, y):
        return (x.astype(np.float32) / 255.0)[..., None], y

    def create_model(self):
        import keras
        from keras import layers

        model = keras.Sequential(
            [
                keras.Input(shape=(28, 28, 1)),
                layers.Conv2D(32, kernel_size=(3, 3), activation="relu"),
                layers.MaxPooling2D(pool_size=(2, 2)),
                layers.Conv2D(64, kernel_size=(3, 3), activation="relu"),
                layers.MaxPooling2D(pool_size=(2, 2)),
                layers.Flatten(),
                layers.Dropout(0.5),
                layers.Dense(10, activation="softmax"),
            ]
        )
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model


def test_data(directory: str = DATA):
    """The 10,000 MNIST test images and labels."""
    _, (x_test, y_test) = ddlf.datasets.mnist(directory)
    return x_test, y_test


def run(default_mode: str, description: str) -> None:
    """The command line of the MNIST examples: train on a local cluster, print the test accuracy."""
    import argparse
    import time

    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32, help="per worker (Keras's default)")
    p.add_argument("--mode", choices=["sync", "async"], default=default_mode)
    p.add_argument("--compression", choices=["float16", "bfloat16", "topk"], default=None)
    p.add_argument("--save", default=None, help="save the trained model here (.keras)")
    p.add_argument("--limit", type=int, default=None, help="train on the first N images only (quick runs)")
    p.add_argument(
        "--averaging-frequency",
        type=int,
        default=None,
        help="batches per round: sync, between averagings (default 50; 0: once per epoch); async, per pushed "
        "delta (default: ddlf's, from the number of workers)",
    )
    p.add_argument("--report", default=None, help="write an HTML training report here (and its numbers as .json)")
    p.add_argument("--tensorboard", default=None, help="write TensorBoard event files under this directory")
    args = p.parse_args()

    x_test, y_test = test_data()
    t0 = time.perf_counter()
    with ddlf.Cluster.local(n_workers=args.workers) as cluster:
        app = MnistApp(cluster)
        if args.limit:
            app.limit = args.limit
            app.dataset_key = f"mnist-v1-first-{args.limit}"  # never confused with the full set in a cache
        compression = ddlf.TopK() if args.compression == "topk" else args.compression
        strategy: ddlf.ModelAveraging | ddlf.Asynchronous
        if args.mode == "async":
            strategy = ddlf.Asynchronous(chunk=args.averaging_frequency or None, compression=compression)
        else:
            # every 50 batches: what reached 99% test accuracy in 10 epochs (BENCHMARKS.md)
            exchange = ddlf.ThroughMaster(compression=compression)
            strategy = ddlf.ModelAveraging(every=args.averaging_frequency or 50, exchange=exchange)
        history = app.train(
            epochs=args.epochs,
            batch_size=args.batch_size,
            validation_data=(x_test, y_test),
            callbacks=[ddlf.callbacks.TensorBoard(args.tensorboard)] if args.tensorboard else [],
            strategy=strategy,
            run=ddlf.RunConfig(report=args.report),
        )
        loss, acc = app.evaluate(x_test, y_test)
        if args.save:
            app.model.save(args.save)
    import keras

    print(f"train loss per epoch: {[round(v, 4) for v in history.history['loss']]}")
    print(
        f"seconds per epoch: {[round(s, 2) for s in history.epoch_seconds]}  (Keras backend: {keras.backend.backend()})"
    )
    print(
        f"test accuracy: {acc:.4f}  test loss: {loss:.4f}  ({args.mode}, {args.workers} workers, "
        f"{args.epochs} epochs, {time.perf_counter() - t0:.1f} s in all)"
    )
    if args.report:
        print(f"training report: {args.report} (numbers: {os.path.splitext(args.report)[0]}.json)")
