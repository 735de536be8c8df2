"""Parquet files and directories as numpy arrays, optionally converted once to a disk cache."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import DatasetError
from .images import EncodedImages
from .sources import _fs, _walk, is_url


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
    while the source files are unchanged (see :mod:`ddlf.data.parquet_cache`)."""
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
    """:func:`parquet` through :mod:`ddlf.data.parquet_cache`: converted once, returned memory-mapped."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from . import parquet_cache as disk_cache

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
