"""Dataset loaders (real MNIST, CIFAR-10 files written by the test, numpy files) and the worker-side store."""

from __future__ import annotations

import gzip
import hashlib
import shutil
from pathlib import Path

import numpy as np
import pytest

import ddlf
from ddlf import data as datasets
from ddlf.errors import DatasetError

from ..conftest import MNIST_DIR


def test_mnist_loads_the_real_files() -> None:
    (x, y), (xt, yt) = datasets.mnist(MNIST_DIR)
    assert x.shape == (60000, 28, 28) and x.dtype == np.uint8
    assert y.shape == (60000,) and xt.shape == (10000, 28, 28) and yt.shape == (10000,)
    assert y[:5].tolist() == [5, 0, 4, 1, 9]
    # The canonical MD5 of the uncompressed training labels (see shared/data/mnist/README.md).
    raw = gzip.decompress(Path(f"{MNIST_DIR}/train-labels-idx1-ubyte.gz").read_bytes())
    assert hashlib.md5(raw).hexdigest() == "a25bea736e30d166cdddb491f175f624"


def test_mnist_reads_uncompressed_files_too(tmp_path) -> None:
    for name in (
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    ):
        (tmp_path / name).write_bytes(gzip.decompress(Path(f"{MNIST_DIR}/{name}.gz").read_bytes()))
    (_, y), _ = datasets.mnist(tmp_path)
    assert y[:3].tolist() == [5, 0, 4]


def _copy_mnist(tmp_path):
    for f in (
        "train-images-idx3-ubyte.gz",
        "train-labels-idx1-ubyte.gz",
        "t10k-images-idx3-ubyte.gz",
        "t10k-labels-idx1-ubyte.gz",
    ):
        shutil.copy(f"{MNIST_DIR}/{f}", tmp_path / f)


def test_bad_idx_files_give_errors_naming_the_file(tmp_path) -> None:
    _copy_mnist(tmp_path)
    labels = tmp_path / "t10k-labels-idx1-ubyte.gz"
    raw = gzip.decompress(labels.read_bytes())
    # Wrong magic.
    labels.write_bytes(gzip.compress(b"\xff\xff" + raw[2:]))
    with pytest.raises(DatasetError, match=r"t10k-labels-idx1-ubyte.gz: wrong magic"):
        datasets.mnist(tmp_path)
    # Truncated data.
    labels.write_bytes(gzip.compress(raw[:-10]))
    with pytest.raises(DatasetError, match=r"t10k-labels.*header says"):
        datasets.mnist(tmp_path)
    # Count mismatch between labels and images.
    fewer = raw[:4] + (9999).to_bytes(4, "big") + raw[8:-1]
    labels.write_bytes(gzip.compress(fewer))
    with pytest.raises(DatasetError, match="9999 labels for 10000 images"):
        datasets.mnist(tmp_path)
    # Corrupt gzip and a missing file.
    labels.write_bytes(b"\x1f\x8b" + b"garbage")
    with pytest.raises(DatasetError, match="corrupt gzip"):
        datasets.mnist(tmp_path)
    labels.unlink()
    with pytest.raises(DatasetError, match="not found"):
        datasets.mnist(tmp_path)


def _write_cifar(path, images: np.ndarray, labels: np.ndarray) -> None:
    records = np.concatenate([labels[:, None], images.transpose(0, 3, 1, 2).reshape(len(labels), -1)], axis=1)
    records.astype(np.uint8).tofile(path)


def test_cifar10_binary_format(tmp_path) -> None:
    r = np.random.default_rng(0)
    batches = []
    for i in range(1, 3):
        imgs = r.integers(0, 256, (7, 32, 32, 3), dtype=np.uint8)
        labels = r.integers(0, 10, 7, dtype=np.uint8)
        _write_cifar(tmp_path / f"data_batch_{i}.bin", imgs, labels)
        batches.append((imgs, labels))
    test_imgs = r.integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
    _write_cifar(tmp_path / "test_batch.bin", test_imgs, np.array([1, 2, 3], np.uint8))
    (x, y), (xt, yt) = datasets.cifar10(tmp_path)
    assert x.shape == (14, 32, 32, 3) and y.shape == (14,)
    np.testing.assert_array_equal(x[:7], batches[0][0])
    np.testing.assert_array_equal(y[7:], batches[1][1])
    np.testing.assert_array_equal(xt, test_imgs)
    assert yt.tolist() == [1, 2, 3]
    # A truncated record and an out-of-range label are errors naming the file.
    with open(tmp_path / "data_batch_2.bin", "ab") as f:
        f.write(b"\x00" * 10)
    with pytest.raises(DatasetError, match=r"data_batch_2.bin: .* not a whole number"):
        datasets.cifar10(tmp_path)
    _write_cifar(tmp_path / "data_batch_2.bin", batches[1][0], np.full(7, 12, np.uint8))
    with pytest.raises(DatasetError, match="label 12"):
        datasets.cifar10(tmp_path)


def test_npy_is_memory_mapped_and_npz_loads(tmp_path) -> None:
    a = np.arange(20, dtype=np.float32).reshape(5, 4)
    np.save(tmp_path / "a.npy", a)
    m = datasets.npy(tmp_path / "a.npy")
    assert isinstance(m, np.memmap)
    np.testing.assert_array_equal(m, a)
    np.savez(tmp_path / "z.npz", x=a, y=np.arange(5))
    z = datasets.npz(tmp_path / "z.npz")
    assert set(z) == {"x", "y"}
    (tmp_path / "bad.npy").write_bytes(b"not numpy")
    with pytest.raises(DatasetError, match=r"bad.npy"):
        datasets.npy(tmp_path / "bad.npy")


def test_worker_store_loads_once_and_lists_and_drops(cluster: ddlf.Cluster, tmp_path) -> None:
    np.save(tmp_path / "x.npy", np.arange(1000, dtype=np.float32).reshape(250, 4))
    path = str(tmp_path / "x.npy")

    def loader():
        import time

        time.sleep(0.2)
        return (ddlf.datasets.npy(path), np.arange(250))

    first = cluster.load_dataset("store-test", loader)
    assert [i["cached"] for i in first] == [False, False]
    assert all(i["memory_mapped"] and i["rows"] == 250 and i["load_seconds"] >= 0.2 for i in first)
    second = cluster.load_dataset("store-test", loader)
    assert [i["cached"] for i in second] == [True, True]
    listed = cluster.datasets()
    assert [d["key"] for d in listed[0]] == ["store-test"]
    assert listed[0][0]["nbytes"] == 1000 * 4 + 250 * 8
    cluster.put_dataset("pushed", (np.ones((3, 2)), np.zeros(3)))
    assert {d["key"] for d in cluster.datasets()[1]} == {"store-test", "pushed"}
    assert cluster.drop_dataset("store-test") == [True, True]
    assert cluster.drop_dataset("store-test") == [False, False]
    cluster.drop_dataset("pushed")


def test_store_rejects_bad_loader_results(cluster: ddlf.Cluster) -> None:
    """Refused by the workers with ddlf's own classes, as documented: ``except ddlf.DatasetError`` (a
    ``ValueError``) and ``except ddlf.ConfigTypeError`` (a ``TypeError``) catch them; they are remote errors
    (``RemoteError``) too, with the worker's traceback."""
    with pytest.raises(ddlf.ConfigTypeError, match="not numpy arrays") as wrong_type:
        cluster.load_dataset("bad1", lambda: "text")
    assert isinstance(wrong_type.value, ddlf.RemoteError) and isinstance(wrong_type.value, TypeError)
    with pytest.raises(ddlf.DatasetError, match="different numbers of rows") as info:
        cluster.load_dataset("bad2", lambda: (np.zeros(3), np.zeros(4)))
    assert isinstance(info.value, ddlf.RemoteError) and isinstance(info.value, ValueError)
    assert all(e.raised("DatasetError") and e.remote_traceback for e in info.value.exceptions)  # both workers
    assert cluster.datasets() == [[], []]


def test_batches_feed_keras_fit_and_plain_loops() -> None:
    import keras

    (x, y), _ = datasets.mnist(MNIST_DIR)
    x, y = x[:1024], y[:1024]

    def prep(bx, by):
        return bx.reshape(len(bx), -1).astype("float32") / 255.0, by

    seen = [len(bx) for bx, _ in datasets.batches((x, y), batch_size=100, preprocess=prep)]
    assert seen == [100] * 10 + [24]
    first = [by[:5].tolist() for _, by in datasets.batches((x, y), batch_size=256, epochs=2, seed=3)]
    assert len(first) == 8 and first[0] != first[4]  # reshuffled each epoch
    model = keras.Sequential([keras.Input(shape=(784,)), keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    gen = datasets.batches((x, y), batch_size=64, epochs=None, seed=0, preprocess=prep)
    hist = model.fit(gen, steps_per_epoch=16, epochs=2, verbose=0)
    assert hist.history["loss"][1] < hist.history["loss"][0]
