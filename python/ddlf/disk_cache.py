"""Parquet converted once, row group by row group, into memory-mapped files on a local disk: datasets larger
than memory.

``ddlf.datasets.parquet(..., cache_dir=DIR)`` comes here. The conversion streams: it holds one batch of rows at a
time and writes into ``.npy`` files preallocated at their final size (encoded images: their bytes appended to one
file, their offsets kept as an ``.npy``), so its memory does not grow with the dataset. The result is returned
memory-mapped, so the training loop's index-only epochs read rows from the page cache, prefetched by the
pipeline's thread (``ddlf_core::advice``) when they are not resident.

An entry is named by a digest of what decides its content: the source files with their sizes and modification
times, the columns, the label, ``dtype``, the shard and the image settings. Another source file, or a changed
one, is another entry; the same call in the next script (or by the other workers on the host) maps the finished
entry without reading any Parquet. Entries appear whole: written into a temporary folder and renamed, under an
exclusive lock that the other workers of the host wait on. Nothing removes old entries: ``cache_dir`` is the
user's folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

#: Rows read from Parquet at a time.
BATCH_ROWS = 16_384


def entry_name(describe: dict[str, Any]) -> str:
    """The entry's folder name for a conversion described by ``describe`` (JSON-able)."""
    blob = json.dumps(describe, sort_keys=True, default=str).encode()
    return "parquet-" + hashlib.sha256(blob).hexdigest()[:24]


def file_stamps(filesystem: Any, files: Sequence[str]) -> list[list[Any]]:
    """``[path, size, modified]`` for each file: what tells a changed source from the one converted."""
    stamps = []
    for f in files:
        if filesystem is None:
            st = os.stat(f)
            stamps.append([os.path.abspath(f), st.st_size, st.st_mtime_ns])
        else:
            info = filesystem.info(f)
            keys = ("mtime", "LastModified", "last_modified", "ETag", "etag")
            changed = next((info[k] for k in keys if k in info), None)
            stamps.append([str(f), info.get("size"), str(changed)])
    return stamps


@contextlib.contextmanager
def _exclusive(path: str) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def convert(
    cache_dir: str | os.PathLike[str],
    describe: dict[str, Any],
    batches: Iterator[Any],
    rows: int,
    to_arrays: Any,
) -> dict[str, Any]:
    """The entry for ``describe`` under ``cache_dir``, converting it first if it is not there: ``batches`` yields
    Arrow tables (at most :data:`BATCH_ROWS` rows each, ``rows`` in all) and ``to_arrays`` turns one into
    ``{"x": array | ("images", data, offsets), "y": array?}``. Returns the entry's arrays, memory-mapped: numpy
    arrays, or for images ``("images", data, offsets)``."""
    from .datasets import DatasetError

    if rows == 0:
        raise DatasetError("the source has no rows")
    base = os.fspath(cache_dir)
    os.makedirs(base, exist_ok=True)
    final = os.path.join(base, entry_name(describe))
    if not os.path.isdir(final):
        with _exclusive(final + ".lock"):
            if not os.path.isdir(final):  # another worker may have finished it while this one waited
                tmp = f"{final}.tmp-{os.getpid()}"
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
                try:
                    _write(tmp, batches, rows, to_arrays)
                    with open(os.path.join(tmp, "source.json"), "w") as f:
                        json.dump(describe, f, indent=1, default=str)
                    os.rename(tmp, final)
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
    try:
        return _read(final)
    except (OSError, ValueError) as exc:
        raise DatasetError(f"{final}: a converted dataset that cannot be read ({exc}); remove the folder") from exc


def _write(tmp: str, batches: Iterator[Any], rows: int, to_arrays: Any) -> None:
    """Stream ``batches`` into files under ``tmp``."""
    from .datasets import DatasetError

    out: dict[str, np.memmap] = {}
    offsets_parts: list[np.ndarray] = [np.zeros(1, np.uint64)]
    image_bytes = 0
    at = 0
    with contextlib.ExitStack() as files:
        data_file = None
        for table in batches:
            arrays = to_arrays(table)
            k = table.num_rows
            if at + k > rows:
                raise DatasetError(f"the source has more rows than its metadata says ({rows})")
            for name, a in arrays.items():
                if isinstance(a, tuple):  # encoded images: ("images", data, offsets)
                    _, data, offsets = a
                    if data_file is None:
                        data_file = files.enter_context(open(os.path.join(tmp, "data.bin"), "wb"))
                    data_file.write(np.ascontiguousarray(data).data)
                    offsets_parts.append(offsets[1:].astype(np.uint64) + np.uint64(image_bytes))
                    image_bytes += int(offsets[-1])
                    continue
                if name not in out:
                    path = os.path.join(tmp, f"{name}.npy")
                    out[name] = np.lib.format.open_memmap(path, mode="w+", dtype=a.dtype, shape=(rows, *a.shape[1:]))
                    files.callback(out[name].flush)
                dst = out[name]
                if a.shape[1:] != dst.shape[1:] or a.dtype != dst.dtype:
                    raise DatasetError(
                        f"column(s) {name!r}: rows of {a.dtype} {a.shape[1:]} after rows of {dst.dtype} "
                        f"{dst.shape[1:]} (parts of different types: pass dtype= to cast them all)"
                    )
                dst[at : at + k] = a
            at += k
        if at != rows:
            raise DatasetError(f"the source has {at} rows, its metadata says {rows}")
        if data_file is not None:
            np.save(os.path.join(tmp, "offsets.npy"), np.concatenate(offsets_parts))


def _read(final: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("x", "y"):
        path = os.path.join(final, f"{name}.npy")
        if os.path.exists(path):
            out[name] = np.load(path, mmap_mode="r")
    if os.path.exists(os.path.join(final, "offsets.npy")):
        offsets = np.load(os.path.join(final, "offsets.npy"), mmap_mode="r")
        size = os.path.getsize(os.path.join(final, "data.bin"))
        data = np.memmap(os.path.join(final, "data.bin"), np.uint8, "r") if size else np.zeros(0, np.uint8)
        out["x"] = ("images", data, offsets)
    return out
