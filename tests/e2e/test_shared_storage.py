"""Datasets on shared storage: loaders read ``s3://`` URLs through fsspec, tested against a local S3-compatible
server (moto's, on loopback), from the master and from worker daemons training on it."""

from __future__ import annotations

import glob
import os
import socket

import numpy as np
import pytest

import ddlf
from ddlf.data import store
from ddlf.errors import DatasetError

from ..conftest import MNIST_DIR

s3fs = pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

BUCKET = "ddlf-data"


@pytest.fixture(scope="module")
def s3() -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    options = {"key": "testing", "secret": "testing", "endpoint_url": f"http://127.0.0.1:{port}"}
    fs = s3fs.S3FileSystem(**options)
    fs.mkdir(BUCKET)
    for path in glob.glob(os.path.join(MNIST_DIR, "*-ubyte*")):
        fs.put_file(path, f"{BUCKET}/mnist/{os.path.basename(path)}")
    np.save("/tmp/ddlf-s3-test.npy", np.arange(12, dtype=np.float32).reshape(3, 4))
    fs.put_file("/tmp/ddlf-s3-test.npy", f"{BUCKET}/arrays/a.npy")
    os.unlink("/tmp/ddlf-s3-test.npy")
    yield options
    server.stop()


def test_mnist_and_npy_from_s3_match_the_local_files(s3: dict) -> None:
    (x, y), (xt, yt) = ddlf.datasets.mnist(f"s3://{BUCKET}/mnist", storage_options=s3)
    (lx, ly), (lxt, lyt) = ddlf.datasets.mnist(MNIST_DIR)
    assert x.shape == (60000, 28, 28) and np.array_equal(x, lx) and np.array_equal(y, ly)
    assert np.array_equal(xt, lxt) and np.array_equal(yt, lyt)
    a = ddlf.datasets.npy(f"s3://{BUCKET}/arrays/a.npy", storage_options=s3)
    assert np.array_equal(a, np.arange(12, dtype=np.float32).reshape(3, 4))


def test_bad_urls_give_clear_errors(s3: dict) -> None:
    with pytest.raises(DatasetError, match=r"s3://ddlf-data/nothing-here/train-images-idx3-ubyte\[\.gz\]: file not"):
        ddlf.datasets.mnist(f"s3://{BUCKET}/nothing-here", storage_options=s3)
    with pytest.raises(DatasetError, match=r"a-missing\.npy: file not found"):
        ddlf.datasets.npy(f"s3://{BUCKET}/arrays/a-missing.npy", storage_options=s3)
    with pytest.raises(DatasetError, match="nosuchproto://"):
        ddlf.datasets.npy("nosuchproto://x/y.npy")


class S3Mnist(ddlf.IApp):
    """Each worker reads its dataset from the S3 server, once."""

    dataset_key = "mnist-s3-test"
    url = f"s3://{BUCKET}/mnist"
    storage_options: dict = {}

    def load_dataset(self):
        (x, y), _ = ddlf.datasets.mnist(self.url, storage_options=self.storage_options)
        return x[:3000], y[:3000]

    def preprocess(self, x, y):
        return x.reshape(len(x), -1).astype(np.float32) / 255.0, y

    def create_model(self):
        import keras

        model = keras.Sequential([keras.Input(shape=(784,)), keras.layers.Dense(10, activation="softmax")])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model


def test_workers_train_on_a_dataset_read_from_s3(cluster: ddlf.Cluster, s3: dict) -> None:
    app = S3Mnist(cluster)
    app.storage_options = s3
    h = app.train(epochs=2, batch_size=32, verbose=0)
    assert sum(s.samples for s in h.stats) == 2 * 3000
    assert h.history["accuracy"][-1] > 0.75
    held = cluster.call(store.describe)
    assert all(any(d["key"] == "mnist-s3-test" for d in worker) for worker in held)
