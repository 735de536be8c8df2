"""Loaders of the classic formats: MNIST (IDX), CIFAR-10 batches, ``.npy`` and ``.npz``."""

from __future__ import annotations

import math
import os
import struct
import zipfile
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import DatasetError
from .sources import _exists, _join, _open_maybe_gz, is_url, read_bytes

_IDX_TYPES: dict[int, Any] = {
    0x08: np.uint8,
    0x09: np.int8,
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
}


def read_idx(path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> np.ndarray:
    """Read one IDX file (optionally gzip-compressed; a path or URL) into an array of its declared type and
    shape."""
    data = _open_maybe_gz(path, storage_options)
    if len(data) < 4:
        raise DatasetError(f"{path}: too short for an IDX header")
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code not in _IDX_TYPES or ndim == 0:
        raise DatasetError(f"{path}: wrong magic number {data[:4].hex()} (not an IDX file)")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DatasetError(f"{path}: truncated header")
    dims = struct.unpack(">" + "I" * ndim, data[4:header])
    dtype = np.dtype(_IDX_TYPES[dtype_code])
    expected = math.prod(dims) * dtype.itemsize  # exact: np.prod would wrap around for huge declared shapes
    if len(data) - header != expected:
        raise DatasetError(
            f"{path}: header says {dims} ({expected} bytes of data) but the file holds {len(data) - header} bytes"
        )
    try:
        array = np.frombuffer(data, dtype=dtype, offset=header).reshape(dims)
    except ValueError as exc:  # an empty array whose other dimensions numpy cannot address
        raise DatasetError(f"{path}: header declares an impossible shape {dims}: {exc}") from exc
    return array.astype(dtype.newbyteorder("="), copy=False)


def _find(directory: str | os.PathLike[str], stem: str, storage_options: Mapping[str, Any] | None) -> str:
    for name in (stem + ".gz", stem):
        candidate = _join(directory, name)
        if _exists(candidate, storage_options):
            return candidate
    raise DatasetError(f"{_join(directory, stem)}[.gz]: file not found")


def mnist(
    directory: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """MNIST from a directory (or URL prefix) of the four IDX files: ``((x_train, y_train), (x_test,
    y_test))``, uint8, images of shape (N, 28, 28)."""
    out = []
    for split in ("train", "t10k"):
        images_path = _find(directory, f"{split}-images-idx3-ubyte", storage_options)
        labels_path = _find(directory, f"{split}-labels-idx1-ubyte", storage_options)
        x, y = read_idx(images_path, storage_options), read_idx(labels_path, storage_options)
        if x.ndim != 3:
            raise DatasetError(f"{images_path}: expected 3 dimensions (images), found {x.ndim}")
        if y.ndim != 1:
            raise DatasetError(f"{labels_path}: expected 1 dimension (labels), found {y.ndim}")
        if len(x) != len(y):
            raise DatasetError(f"{labels_path}: {len(y)} labels for {len(x)} images in {images_path}")
        out.append((x, y))
    return out[0], out[1]


CIFAR_RECORD = 1 + 3 * 32 * 32


def read_cifar10_batch(
    path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 binary batch file (a path or URL): ``(images (N, 32, 32, 3) uint8, labels (N,) uint8)``."""
    raw = np.frombuffer(read_bytes(path, storage_options), dtype=np.uint8)
    if raw.size == 0 or raw.size % CIFAR_RECORD:
        raise DatasetError(f"{path}: {raw.size} bytes is not a whole number of {CIFAR_RECORD}-byte CIFAR-10 records")
    records = raw.reshape(-1, CIFAR_RECORD)
    labels = records[:, 0].copy()
    if labels.max(initial=0) > 9:
        raise DatasetError(f"{path}: label {int(labels.max())} out of range 0-9")
    images = records[:, 1:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1).copy()
    return images, labels


def cifar10(
    directory: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """CIFAR-10 (binary version) from its directory (or URL prefix): ``data_batch_1..5.bin`` and
    ``test_batch.bin``."""
    so = storage_options
    parts = [_join(directory, f"data_batch_{i}.bin") for i in range(1, 6)]
    train = [read_cifar10_batch(p, so) for p in parts if _exists(p, so)]
    if not train:
        raise DatasetError(f"{directory}: no data_batch_*.bin files")
    test_path = _join(directory, "test_batch.bin")
    if not _exists(test_path, so):
        raise DatasetError(f"{test_path}: file not found")
    x_test, y_test = read_cifar10_batch(test_path, so)
    return (np.concatenate([x for x, _ in train]), np.concatenate([y for _, y in train])), (x_test, y_test)


# What numpy raises for a file that is not what it should be: empty (EOFError), a broken zip, a bad header.
_UNREADABLE = (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError)


def npy(
    path: str | os.PathLike[str], mmap: bool = True, storage_options: Mapping[str, Any] | None = None
) -> np.ndarray:
    """A ``.npy`` array, memory-mapped read-only by default (processes on one machine share its pages). From a
    URL it is read into memory."""
    if is_url(path):
        import io

        try:
            out = np.load(io.BytesIO(read_bytes(path, storage_options)), allow_pickle=False)
        except _UNREADABLE as exc:
            raise DatasetError(f"{path}: not a readable .npy file: {exc}") from exc
    else:
        try:
            out = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
        except _UNREADABLE as exc:
            raise DatasetError(f"{path}: not a readable .npy file: {exc}") from exc
    if not isinstance(out, np.ndarray):  # an .npz archive: a mapping of arrays
        out.close()
        raise DatasetError(f"{path}: an .npz archive, not an .npy file (read it with ddlf.datasets.npz)")
    return out


def npz(path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` archive, a path or URL (loaded into memory; use ``.npy`` files to memory-map)."""
    import io

    source: Any = io.BytesIO(read_bytes(path, storage_options)) if is_url(path) else path
    try:
        z = np.load(source, allow_pickle=False)
    except _UNREADABLE as exc:
        raise DatasetError(f"{path}: not a readable .npz archive: {exc}") from exc
    if isinstance(z, np.ndarray):
        raise DatasetError(f"{path}: an .npy array, not an .npz archive (read it with ddlf.datasets.npy)")
    try:
        with z:
            return {k: z[k] for k in z.files}
    except _UNREADABLE as exc:
        raise DatasetError(f"{path}: not a readable .npz archive: {exc}") from exc
