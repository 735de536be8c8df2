"""Datasets: loaders that run on the workers (MNIST, CIFAR-10, npy/npz, Parquet, image folders), local batches, and
the stores that keep what was loaded (a worker's :mod:`.store`, a host's shared :mod:`.node_store`).

The loaders are also ``ddlf.datasets``.
"""

from __future__ import annotations

from ..errors import DatasetError
from .batches import batches
from .images import IMAGE_EXTENSIONS, EncodedImages, image_folder
from .loaders import cifar10, mnist, npy, npz, read_cifar10_batch, read_idx
from .parquet import parquet
from .sources import is_url, read_bytes

__all__ = [
    "IMAGE_EXTENSIONS",
    "DatasetError",
    "EncodedImages",
    "batches",
    "cifar10",
    "image_folder",
    "is_url",
    "mnist",
    "npy",
    "npz",
    "parquet",
    "read_bytes",
    "read_cifar10_batch",
    "read_idx",
]
