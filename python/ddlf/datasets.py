"""Dataset loaders, and the worker-side dataset store.

Loaders return numpy arrays: MNIST (IDX, gzip or raw), CIFAR-10 (binary version), ``.npy``/``.npz`` files
(``.npy`` memory-mapped, so worker processes on one machine share one copy through the page cache), Parquet tables
and arrays registered from Python. Image folders and Parquet columns of encoded images load as
:class:`EncodedImages`: the files' bytes, decoded batch by batch on the pipeline's Rust threads.

Every loader takes a local path or a URL on shared storage: ``s3://bucket/mnist``, ``gs://...``,
``hdfs://namenode/...``, ``https://...``: anything `fsspec <https://filesystem-spec.readthedocs.io>`_ opens
(``pip install s3fs`` for S3, ``gcsfs`` for GCS, pyarrow for HDFS). ``storage_options`` go to the filesystem
(for S3: ``key``, ``secret``, ``endpoint_url`` for MinIO/Ceph and other S3-compatible stores); without them the
usual environment (``AWS_*`` variables, instance roles) applies.

The store keeps what ``load_dataset`` returned on each worker under a key chosen by the app, for the life of
the daemon: a second run (another app, another script) with the same key skips loading entirely.
"""

from __future__ import annotations

import gzip
import math
import os
import struct
import threading
import time
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


class DatasetError(ValueError):
    """A dataset file is missing, malformed or inconsistent. The message names the file."""


# -- MNIST ------------------------------------------------------------------------------------------------

_IDX_TYPES: dict[int, Any] = {
    0x08: np.uint8,
    0x09: np.int8,
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
}


def is_url(path: Any) -> bool:
    """Whether ``path`` names remote storage (``scheme://...``, other than ``file://``)."""
    return isinstance(path, str) and "://" in path and not path.startswith("file://")


def _fs(url: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, str]:
    try:
        import fsspec
    except ImportError:
        raise DatasetError(f"{url}: reading URLs needs fsspec (pip install fsspec, and s3fs for s3://)") from None
    try:
        return fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    except (ImportError, ValueError) as exc:
        raise DatasetError(f"{url}: {exc}") from exc


def read_bytes(path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> bytes:
    """The whole content of a local file or of a URL on shared storage."""
    if not is_url(path):
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise DatasetError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    fs, where = _fs(str(path), storage_options)
    try:
        return fs.cat_file(where)
    except FileNotFoundError as exc:
        raise DatasetError(f"{path}: file not found") from exc
    except Exception as exc:  # the storage library's own errors (permissions, network) name the cause
        raise DatasetError(f"{path}: cannot read: {exc}") from exc


def _exists(path: str, storage_options: Mapping[str, Any] | None) -> bool:
    if not is_url(path):
        return Path(path).exists()
    fs, where = _fs(path, storage_options)
    return bool(fs.exists(where))


def _join(directory: str | os.PathLike[str], name: str) -> str:
    d = os.fspath(directory)
    return f"{d.rstrip('/')}/{name}" if is_url(d) else str(Path(d) / name)


def _open_maybe_gz(path: Any, storage_options: Mapping[str, Any] | None = None) -> bytes:
    raw = read_bytes(path, storage_options)
    if raw[:2] == b"\x1f\x8b":
        try:
            return gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise DatasetError(f"{path}: corrupt gzip data: {exc}") from exc
    return raw


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


# -- CIFAR-10 ---------------------------------------------------------------------------------------------

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


# -- numpy files ------------------------------------------------------------------------------------------


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


# -- Parquet ----------------------------------------------------------------------------------------------


def parquet(
    path: str | os.PathLike[str],
    columns: Sequence[str] | None = None,
    label: str | None = None,
    *,
    dtype: Any = None,
    image_size: tuple[int, int] | None = None,
    channels: int = 3,
    flip: bool = False,
    shard: tuple[int, int] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Any:
    """Arrays from a Parquet file or a directory of them (a Spark/pandas export), local or a URL.

    ``shard=(i, n)`` reads only shard ``i`` of ``n`` (for a sharded app's ``load_shard``): every ``n``-th part
    file of a directory from the ``i``-th, or, with fewer part files than shards, the ``i``-th of ``n`` near-equal
    row ranges.

    ``columns`` (default: every column but ``label``) are the features: numeric scalar columns are stacked into
    one ``(rows, len(columns))`` array (of their common type, or ``dtype``); a single column of lists of one length
    (fixed-size or not, nested for more dimensions: Spark's arrays) becomes a ``(rows, *shape)`` tensor; a single binary
    column of encoded JPEG/PNG images (or a struct with a ``bytes`` field, as Spark's and Hugging Face's image
    columns are) becomes :class:`EncodedImages` of ``image_size`` (``(height, width)``, required for images),
    ``channels`` and ``flip``. Returns ``(x, y)`` with ``label``, else ``x``. Missing values, lists of varying
    length and strings are refused with the column's name. Needs pyarrow (``pip install pyarrow``).

    ``cache_dir`` (a folder on a local disk): for data larger than memory. The first call converts the data there
    one batch of rows at a time (its memory does not grow with the dataset) into ``.npy`` files, and every call
    returns them memory-mapped: the workers of a host share one copy through the page cache, rows are read from
    disk as the epochs visit them (prefetched by the pipeline's thread), and the next script skips the conversion
    while the source files are unchanged (see :mod:`ddlf.disk_cache`)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    import pyarrow as pa

    filesystem, where = (None, os.fspath(path)) if not is_url(path) else _fs(str(path), storage_options)
    source: str | list[str] = where
    wanted = None if columns is None else [*columns, *([label] if label is not None and label not in columns else [])]
    rows: tuple[int, int] | None = None
    if shard is not None or cache_dir is not None:
        i, n = shard if shard is not None else (0, 1)
        if not (isinstance(n, int) and isinstance(i, int) and 0 <= i < n):
            raise DatasetError(f"{path}: shard must be (i, n) with 0 <= i < n, not {shard!r}")
        try:
            is_dir = filesystem.isdir(where) if filesystem is not None else os.path.isdir(where)
            found = _walk(filesystem, where) if is_dir else [where]
        except OSError as exc:
            raise DatasetError(f"{path}: {exc}") from exc
        parts = sorted(f for f in found if not f.rsplit("/", 1)[-1].startswith(("_", ".")))
        if len(parts) >= n:
            source = parts[i::n]
        else:
            rows = (i, n)
    if cache_dir is not None:
        files = source if isinstance(source, list) else parts
        images = (image_size, channels, flip)
        return _parquet_to_disk(path, filesystem, files, wanted, columns, label, dtype, images, rows, cache_dir)
    try:
        table = pq.read_table(source, filesystem=filesystem, columns=wanted)
    except (OSError, KeyError, pa.ArrowException) as exc:
        raise DatasetError(f"{path}: not a readable Parquet file or directory with those columns: {exc}") from exc
    if rows is not None:
        start, stop = (table.num_rows * k // rows[1] for k in (rows[0], rows[0] + 1))
        table = table.slice(start, stop - start)
    x, y = _table_arrays(path, table, columns, label, dtype, (image_size, channels, flip))
    return x if label is None else (x, y)


def _table_arrays(
    path: Any, table: Any, columns: Sequence[str] | None, label: str | None, dtype: Any, images: Any
) -> tuple[Any, np.ndarray | None]:
    """The features (an array, or :class:`EncodedImages`) and the label (or ``None``) of an Arrow table."""
    image_size, channels, flip = images
    if label is not None and label not in table.column_names:
        raise DatasetError(f"{path}: no label column {label!r} (columns: {table.column_names})")
    names = [n for n in table.column_names if n != label] if columns is None else list(columns)
    if not names:
        raise DatasetError(f"{path}: no feature columns (columns: {table.column_names})")
    y = None if label is None else _column_array(path, label, table.column(label))
    encoded = [n for n in names if _binary(table.column(n).type)]
    if encoded:
        if len(names) != 1:
            raise DatasetError(f"{path}: image column {encoded[0]!r} must be read alone (columns=[{encoded[0]!r}])")
        if image_size is None:
            raise DatasetError(
                f"{path}: column {encoded[0]!r} holds encoded images: pass image_size=(height, width) to decode them"
            )
        return _image_column(path, encoded[0], table.column(encoded[0]), image_size, channels, flip), y
    return _features(path, table, names, dtype), y


def _parquet_to_disk(
    path: Any,
    filesystem: Any,
    files: list[str],
    wanted: list[str] | None,
    columns: Sequence[str] | None,
    label: str | None,
    dtype: Any,
    images: tuple[Any, int, bool],
    rows: tuple[int, int] | None,
    cache_dir: str | os.PathLike[str],
) -> Any:
    """:func:`parquet` through :mod:`ddlf.disk_cache`: converted once, returned memory-mapped."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from . import disk_cache

    def open_part(f: str) -> Any:
        try:
            # Read as a stream, in batches of a few MB (disk_cache.batch_rows): a conversion's memory then stays
            # flat whatever the table's or its row groups' size.
            source = f if filesystem is None else filesystem.open(f, "rb")
            return pq.ParquetFile(source, pre_buffer=False, buffer_size=1 << 20)
        except (OSError, pa.ArrowException) as exc:
            raise DatasetError(f"{path}: {f} is not a readable Parquet file: {exc}") from exc

    if not files:
        raise DatasetError(f"{path}: no Parquet files")
    total = sum(open_part(f).metadata.num_rows for f in files)
    start, stop = (0, total) if rows is None else (total * rows[0] // rows[1], total * (rows[0] + 1) // rows[1])
    describe = {
        "files": disk_cache.file_stamps(filesystem, files),
        "columns": None if columns is None else list(columns),
        "label": label,
        "dtype": None if dtype is None else np.dtype(dtype).str,
        "rows": [start, stop],
        "images": [images[0] and list(images[0]), images[1], images[2]],
    }

    def tables() -> Iterator[Any]:
        seen = 0
        for f in files:
            try:
                part = open_part(f)
                size = disk_cache.batch_rows(part.metadata)
                for batch in part.iter_batches(batch_size=size, columns=wanted, use_threads=False):
                    lo, hi = max(start - seen, 0), min(stop - seen, batch.num_rows)
                    seen += batch.num_rows
                    if hi > lo:
                        yield pa.Table.from_batches([batch.slice(lo, hi - lo)])
            except (OSError, KeyError, pa.ArrowException) as exc:
                raise DatasetError(f"{path}: {f}: not readable with those columns: {exc}") from exc

    def to_arrays(table: Any) -> dict[str, Any]:
        x, y = _table_arrays(path, table, columns, label, dtype, images)
        out: dict[str, Any] = {"x": ("images", x.data, x.offsets) if isinstance(x, EncodedImages) else x}
        return out if y is None else {**out, "y": y}

    got = disk_cache.convert(cache_dir, describe, tables(), stop - start, to_arrays, source=str(path))
    x = got["x"]
    if isinstance(x, tuple):
        x = EncodedImages(x[1], x[2], images[0], images[1], images[2])
    return x if label is None else (x, got["y"])


def _features(path: Any, table: Any, names: Sequence[str], dtype: Any) -> np.ndarray:
    """Feature columns of an Arrow table as one array: one column as its tensor (a scalar column as ``(rows,
    1)``), several scalar columns stacked into ``(rows, len(names))``; cast to ``dtype`` if given."""
    blocks = [_column_array(path, n, table.column(n)) for n in names]
    if len(blocks) == 1:
        x = blocks[0] if blocks[0].ndim > 1 else blocks[0].reshape(-1, 1)
    elif all(b.ndim == 1 for b in blocks):
        x = np.stack(blocks, axis=1)  # of the columns' common type
    else:
        shaped = [n for n, b in zip(names, blocks) if b.ndim > 1]
        raise DatasetError(
            f"{path}: columns {shaped} are tensors: read a tensor column alone (columns=[{shaped[0]!r}]) or "
            "only scalar columns together"
        )
    return x if dtype is None else x.astype(dtype, copy=False)


def _column_array(path: Any, name: str, column: Any) -> np.ndarray:
    """One Arrow column as a numpy array: numbers as they are, lists of one length (fixed-size, or Spark's and
    pandas' variable-size lists that all have the same length) as extra dimensions."""
    import pyarrow as pa

    if column.null_count:
        raise DatasetError(f"{path}: column {name!r} has {column.null_count} missing values")
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    shape = [len(array)]
    while True:
        if pa.types.is_fixed_size_list(array.type):
            shape.append(array.type.list_size)
            # Offsets into the child when the array is a slice; the child's own nulls are checked below.
            start = array.offset * array.type.list_size
            array = array.values.slice(start, len(array) * array.type.list_size)
        elif pa.types.is_list(array.type) or pa.types.is_large_list(array.type):
            # Spark and pandas write arrays as variable-size lists: a tensor when every list has one length.
            lengths = np.diff(np.asarray(array.offsets))
            if len(lengths) and (lengths != lengths[0]).any():
                raise DatasetError(
                    f"{path}: column {name!r} holds lists of varying length ({int(lengths.min())} to "
                    f"{int(lengths.max())}); a tensor column needs lists of one length"
                )
            shape.append(int(lengths[0]) if len(lengths) else 0)
            array = array.flatten()
        else:
            break
        if array.null_count:
            raise DatasetError(f"{path}: column {name!r} has missing values inside its lists")
    t = array.type
    if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)):
        raise DatasetError(f"{path}: column {name!r} is {t}, not numbers (decode or encode it before exporting)")
    return array.to_numpy(zero_copy_only=False).reshape(shape)


def _binary(t: Any) -> bool:
    """Whether an Arrow type holds encoded files: binary, or a struct with a binary ``bytes`` field."""
    import pyarrow as pa

    if pa.types.is_struct(t):
        i = t.get_field_index("bytes")
        return i >= 0 and _binary(t.field(i).type)
    return bool(pa.types.is_binary(t) or pa.types.is_large_binary(t))


def _image_column(path: Any, name: str, column: Any, size: tuple[int, int], channels: int, flip: bool) -> EncodedImages:
    """A binary Arrow column as encoded images, sharing the column's buffers where it can."""
    import pyarrow as pa

    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_struct(array.type):
        array = array.field("bytes")
    if array.null_count:
        raise DatasetError(f"{path}: column {name!r} has {array.null_count} missing images")
    _, offsets_buf, data_buf = array.buffers()[:3]
    width = np.int64 if pa.types.is_large_binary(array.type) else np.int32
    offsets = np.frombuffer(offsets_buf, dtype=width)[array.offset : array.offset + len(array) + 1]
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    first = int(offsets[0]) if len(offsets) else 0
    return EncodedImages(
        data[first : int(offsets[-1]) if len(offsets) else 0],
        (offsets - first).astype(np.uint64),
        size,
        channels,
        flip,
    )


# -- encoded images ---------------------------------------------------------------------------------------

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")


@dataclass(frozen=True, eq=False)
class EncodedImages:
    """A column of encoded JPEG/PNG images: every file's bytes back to back in ``data`` (``uint8``), image ``i``
    being ``data[offsets[i]:offsets[i + 1]]`` (``offsets``: ``n + 1`` of them, ``uint64``).

    Kept encoded (a tenth of the decoded size for JPEG), it is decoded batch by batch on the pipeline's Rust
    threads (:func:`batches`, and every training round): each image to ``size`` (``(height, width)``, resized
    bilinearly when it differs) with ``channels`` (3: RGB, 1: grayscale), flipped left-right at random when
    ``flip`` (training augmentation). Batches are ``uint8`` arrays of shape ``(rows, height, width, channels)``:
    scale them in the model (``keras.layers.Rescaling(1 / 255)``) or in ``preprocess``. Indexing or
    ``numpy.asarray`` decodes (without flips), so ``evaluate`` and ``predict`` take it as they take arrays.
    ``classes``: the class names of an image folder, in label order.
    """

    data: np.ndarray
    offsets: np.ndarray
    size: tuple[int, int]
    channels: int = 3
    flip: bool = False
    classes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        data, offsets = np.asanyarray(self.data), np.asarray(self.offsets)  # a memory map stays one
        if data.dtype != np.uint8 or data.ndim != 1:
            raise DatasetError(f"encoded images: data must be a 1-d uint8 array, not {data.dtype} {data.shape}")
        if offsets.ndim != 1 or len(offsets) < 1 or offsets.dtype.kind not in "iu":
            raise DatasetError("encoded images: offsets must be n + 1 integers for n images")
        if offsets[0] != 0 or (np.diff(offsets.astype(np.int64)) < 0).any() or offsets[-1] > len(data):
            raise DatasetError("encoded images: offsets must start at 0, never decrease and end within the data")
        size = tuple(self.size)
        if len(size) != 2 or not all(isinstance(s, (int, np.integer)) and 0 < s <= 16384 for s in size):
            raise DatasetError(f"encoded images: size must be (height, width), each 1..16384, not {self.size!r}")
        if self.channels not in (1, 3):
            raise DatasetError(f"encoded images have 1 (grayscale) or 3 (RGB) channels, not {self.channels!r}")
        object.__setattr__(self, "data", data)
        object.__setattr__(self, "offsets", np.ascontiguousarray(offsets, dtype=np.uint64))
        object.__setattr__(self, "size", (int(size[0]), int(size[1])))
        object.__setattr__(self, "classes", tuple(self.classes))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The decoded shape: ``(images, height, width, channels)``."""
        return (len(self), *self.size, self.channels)

    @property
    def dtype(self) -> np.dtype[Any]:
        """Decoded images are ``uint8``."""
        return np.dtype(np.uint8)

    @property
    def ndim(self) -> int:
        return 4

    @property
    def nbytes(self) -> int:
        """Bytes held (encoded), not decoded."""
        return int(self.data.nbytes + self.offsets.nbytes)

    def __ddlf_images__(self) -> tuple[np.ndarray, np.ndarray, tuple[int, int], int, bool]:
        """What the Rust pipeline reads: ``(data, offsets, size, channels, flip)``."""
        return self.data, self.offsets, self.size, self.channels, self.flip

    def decode(self, indices: Any = None) -> np.ndarray:
        """The images at ``indices`` (default: all), decoded without flips: ``uint8``, ``(n, height, width,
        channels)``. A file that does not decode raises :class:`DatasetError` naming its row."""
        from . import ops

        idx = np.arange(len(self), dtype=np.uint32) if indices is None else np.asarray(indices)
        try:
            return ops.decode_images(self, idx)
        except ValueError as exc:
            raise DatasetError(f"encoded images: {exc}") from exc

    def __getitem__(self, item: Any) -> np.ndarray:
        if isinstance(item, (int, np.integer)):
            i = int(item) + (len(self) if item < 0 else 0)
            if not 0 <= i < len(self):
                raise IndexError(f"image {item} out of range for {len(self)} images")
            return self.decode([i])[0]
        return self.decode(np.arange(len(self))[item])

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.decode()
        return out if dtype is None else out.astype(dtype)

    def __repr__(self) -> str:
        return (
            f"EncodedImages({len(self)} images, {self.nbytes / 1e6:.1f} MB encoded, size={self.size}, "
            f"channels={self.channels}, flip={self.flip})"
        )


def image_folder(
    path: str | os.PathLike[str],
    size: tuple[int, int] = (256, 256),
    *,
    channels: int = 3,
    flip: bool = False,
    class_names: Sequence[str] | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[EncodedImages, np.ndarray]:
    """Images in one sub-folder per class (Keras' ``image_dataset_from_directory`` layout), local or a URL:
    ``(images, labels)``, ``images`` an :class:`EncodedImages` of the files' bytes (not decoded here: batches are
    decoded to ``size`` on the pipeline's threads), ``labels`` ``int32`` class indices in the order of
    ``class_names`` (default: the sub-folders sorted by name; ``images.classes`` keeps them). Files ending in
    ``.jpg``, ``.jpeg`` or ``.png`` count; other files are skipped. A file that is not an image is found when its
    batch is decoded: :class:`DatasetError` naming its row."""
    fs, root = _fs(str(path), storage_options) if is_url(path) else (None, os.fspath(path))
    try:
        if fs is None:
            folders = sorted(e.name for e in os.scandir(root) if e.is_dir())
        else:
            folders = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False) if fs.isdir(p))
    except OSError as exc:
        raise DatasetError(f"{path}: not a readable folder of class sub-folders: {exc}") from exc
    names = list(class_names) if class_names is not None else folders
    missing = sorted(set(names) - set(folders))
    if missing:
        raise DatasetError(f"{path}: no sub-folder for classes {missing} (found: {folders})")
    files: list[tuple[str, int]] = []
    for label, name in enumerate(names):
        where = _join(root, name)
        found = _walk(fs, where)
        files += [(f, label) for f in sorted(found) if f.lower().endswith(IMAGE_EXTENSIONS)]
    if not files:
        raise DatasetError(f"{path}: no .jpg, .jpeg or .png files in the class sub-folders {names}")
    blobs = [(fs.cat_file(f) if fs is not None else Path(f).read_bytes()) for f, _ in files]
    offsets = np.zeros(len(blobs) + 1, dtype=np.uint64)
    np.cumsum([len(b) for b in blobs], out=offsets[1:])
    data = np.frombuffer(b"".join(blobs), dtype=np.uint8)
    labels = np.fromiter((label for _, label in files), dtype=np.int32, count=len(files))
    return EncodedImages(data, offsets, size, channels, flip, tuple(names)), labels


def _walk(fs: Any, where: str) -> list[str]:
    """Every file under ``where`` (sub-folders included)."""
    if fs is not None:
        return [str(f) for f in fs.find(where)]
    return [os.path.join(d, f) for d, _, fs_ in os.walk(where) for f in fs_]


# -- feeding a training loop ------------------------------------------------------------------------------


def batches(
    arrays: Any,
    indices: Any = None,
    batch_size: int = 32,
    *,
    prefetch: int = 2,
    epochs: int | None = 1,
    seed: int | None = None,
    preprocess: Callable[..., Any] | None = None,
) -> Iterator[Any]:
    """Batches of ``arrays`` (one array or a tuple with the same number of rows), gathered in Rust and prefetched
    by a background thread: usable in a plain loop or as ``model.fit(ddlf.datasets.batches(...),
    steps_per_epoch=...)``.

    ``indices``: the rows to visit (default: all, in order). ``seed``: reshuffle them each epoch (seeded
    permutation of ``indices``). ``epochs=None`` repeats forever (what Keras expects from a generator).
    ``preprocess(*batch)`` turns each raw batch into model inputs.
    """
    from . import ops

    arrays = list(arrays) if isinstance(arrays, (tuple, list)) else [arrays]
    # Indices go to the pipeline as given: it refuses non-integers and rows out of range (a cast here would wrap).
    idx = np.arange(len(arrays[0]), dtype=np.uint32) if indices is None else np.asarray(indices)
    epoch = 0
    while epochs is None or epoch < epochs:
        order = idx if seed is None else idx[ops.permutation(len(idx), seed, epoch)]
        for batch in ops.BatchPipeline(arrays, order, batch_size, prefetch=prefetch):
            if preprocess is not None:
                batch = preprocess(*batch) if isinstance(batch, tuple) else preprocess(batch)
            yield batch
        epoch += 1


# -- the worker-side store ----------------------------------------------------------------------------------


@dataclass
class StoredDataset:
    """A dataset held by a worker: its arrays and how it got there."""

    key: str
    value: Any
    load_seconds: float
    loaded_at: float = field(default_factory=time.time)
    shard: tuple[int, int] | None = None
    hold: Any = None  # a node_store.Mapped when the arrays are the host's one copy, mapped read-only

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in _arrays(self.value))

    def describe(self) -> dict[str, Any]:
        arrays = _arrays(self.value)
        return {
            "key": self.key,
            "nbytes": self.nbytes,
            "rows": len(arrays[0]) if arrays else 0,
            "arrays": [(tuple(a.shape), str(a.dtype)) for a in arrays],
            "load_seconds": self.load_seconds,
            "memory_mapped": any(isinstance(a.data if isinstance(a, EncodedImages) else a, np.memmap) for a in arrays),
            "node_shared": self.hold is not None,
            "shard": self.shard,
        }


def _arrays(value: Any) -> list[Any]:
    """The arrays (and encoded images) of a dataset value."""
    kinds = (np.ndarray, EncodedImages)
    if isinstance(value, kinds):
        return [value]
    if isinstance(value, Mapping):
        return [v for v in value.values() if isinstance(v, kinds)]
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, kinds)]
    return []


class DatasetStore:
    """The datasets a worker process holds, by key. One per process (:data:`STORE`)."""

    def __init__(self) -> None:
        self._items: dict[str, StoredDataset] = {}
        self._lock = threading.Lock()

    def get_or_load(
        self,
        key: str,
        loader: Callable[[], Any],
        shard: tuple[int, int] | None = None,
        share: bool = True,
        identity: bytes | None = None,
    ) -> tuple[StoredDataset, bool]:
        """The dataset under ``key``, loading it with ``loader()`` if absent. Returns ``(dataset, was_cached)``.

        With ``share`` the arrays go through the host's one copy (:mod:`ddlf.node_store`): the first worker on the
        host to load them writes them there, every worker maps them read-only. ``identity`` names the loader for
        that copy (see :func:`ddlf.node_store.entry_name`)."""
        from . import node_store

        with self._lock:
            item = self._items.get(key)
            if item is not None:
                return item, True
            t0 = time.perf_counter()
            value, hold = node_store.load(key, loader, identity) if share else (loader(), None)
            try:
                arrays = _arrays(value)
                if not arrays:
                    raise TypeError(f"load_dataset for {key!r} returned {type(value).__name__}, not numpy arrays")
                rows = {len(a) for a in arrays}
                if len(rows) != 1:
                    raise ValueError(f"dataset {key!r}: arrays have different numbers of rows {sorted(rows)}")
            except BaseException:
                if hold is not None:
                    hold.release(remove=True)
                raise
            item = StoredDataset(key, value, time.perf_counter() - t0, shard=shard, hold=hold)
            self._items[key] = item
            return item, False

    def put(self, key: str, value: Any) -> StoredDataset:
        """Register arrays under ``key`` (replacing any previous value)."""
        self.drop(key)
        return self.get_or_load(key, lambda: value, share=False)[0]

    def get(self, key: str) -> StoredDataset:
        try:
            return self._items[key]
        except KeyError:
            raise KeyError(f"no dataset {key!r} on this worker (held: {sorted(self._items)})") from None

    def drop(self, key: str) -> bool:
        """Forget ``key``; the host's copy of it goes when its last holder lets go."""
        with self._lock:
            item = self._items.pop(key, None)
        if item is None:
            return False
        if item.hold is not None:
            item.value = None  # unmapped once no batch refers to the arrays any more
            item.hold.release(remove=True)
        return True

    def close(self) -> None:
        """Let go of everything (a worker's clean exit): host copies that nobody else holds are removed."""
        from . import node_store

        for key in list(self._items):
            self.drop(key)
        node_store.sweep()

    def describe(self) -> list[dict[str, Any]]:
        return [d.describe() for d in self._items.values()]


STORE = DatasetStore()
"""This process's dataset store (on a worker: kept for the daemon's lifetime)."""


# Functions the master runs on workers through the cluster (importable there, so they travel by reference).


def _remote_describe() -> list[dict[str, Any]]:
    return STORE.describe()


def _remote_drop(key: str) -> bool:
    return STORE.drop(key)


def _remote_put(key: str, value: Any) -> dict[str, Any]:
    # Received arrays already own their memory (the assembled stream, or a private mapping): stored as they are.
    return STORE.put(key, tuple(value) if isinstance(value, list) else value).describe()


def _remote_load(key: str, loader: Callable[[], Any]) -> dict[str, Any]:
    item, cached = STORE.get_or_load(key, loader)
    info = item.describe()
    info["cached"] = cached
    return info
