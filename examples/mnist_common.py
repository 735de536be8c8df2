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
