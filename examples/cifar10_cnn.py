"""Train a small CNN on CIFAR-10 (binary version) on a local cluster.

    python examples/cifar10_cnn.py --data /path/to/cifar-10-batches-bin [--epochs 10] [--workers 2] [--mode sync]

The directory holds data_batch_1.bin ... data_batch_5.bin and test_batch.bin (each record: 1 label byte and
3072 pixel bytes), as distributed at https://www.cs.toronto.edu/~kriz/cifar.html ("CIFAR-10 binary version").
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import ddlf


class Cifar10App(ddlf.IApp):
    """Workers keep the uint8 images (150 MB) in their dataset cache and scale each batch."""

    dataset_key = "cifar10-bin-v1"
    data_dir = ""
    limit: int | None = None

    def load_dataset(self):
        (x, y), _ = ddlf.datasets.cifar10(self.data_dir)
        if self.limit:
            x, y = x[: self.limit], y[: self.limit]
        return x, y

    def preprocess(self, x, y):
        return x.astype(np.float32) / 255.0, y

    def create_model(self):
        import keras
        from keras import layers

        model = keras.Sequential(
            [
                keras.Input(shape=(32, 32, 3)),
                layers.Conv2D(32, 3, padding="same", activation="relu"),
                layers.Conv2D(32, 3, activation="relu"),
                layers.MaxPooling2D(),
                layers.Dropout(0.25),
                layers.Conv2D(64, 3, padding="same", activation="relu"),
                layers.Conv2D(64, 3, activation="relu"),
                layers.MaxPooling2D(),
                layers.Dropout(0.25),
                layers.Flatten(),
                layers.Dense(512, activation="relu"),
                layers.Dropout(0.5),
                layers.Dense(10, activation="softmax"),
            ]
        )
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="directory of the CIFAR-10 binary batches")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--mode", choices=["sync", "async"], default="sync")
    p.add_argument("--limit", type=int, default=None, help="train on the first N images only")
    args = p.parse_args()

    _, (x_test, y_test) = ddlf.datasets.cifar10(args.data)
    Cifar10App.data_dir = args.data
    Cifar10App.limit = args.limit
    if args.limit:
        Cifar10App.dataset_key = f"cifar10-bin-v1-first-{args.limit}"
    t0 = time.perf_counter()
    with ddlf.Cluster.local(n_workers=args.workers) as cluster:
        app = Cifar10App(cluster)
        strategy = ddlf.Asynchronous(chunk=50) if args.mode == "async" else ddlf.ModelAveraging(every=50)
        app.train(epochs=args.epochs, batch_size=args.batch_size, strategy=strategy)
        loss, acc = app.evaluate(x_test, y_test)
    print(f"test accuracy: {acc:.4f}  test loss: {loss:.4f}  ({time.perf_counter() - t0:.1f} s in all)")


if __name__ == "__main__":
    main()
