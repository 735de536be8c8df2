"""Parquet converted once, row group by row group, into memory-mapped files on a local disk: datasets larger
than memory.

``ddlf.datasets.parquet(..., cache_dir=DIR)`` comes here. The conversion streams: it holds one batch of rows at a
time, appends it to ``.npy`` files whose header already states the final shape (encoded images: their bytes to one
file, their offsets kept as an ``.npy``), and writes what it wrote back to disk and out of the page cache every
32 MiB, so its memory does not grow with the dataset, page cache included. The result is returned
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

#: The most rows read from Parquet at a time.
BATCH_ROWS = 16_384

#: About how many bytes of rows (uncompressed) are read at a time: decoding a batch of a list column takes about ten
#: times its values' bytes in Arrow (repetition and definition levels per element), so batches are cut by size.
BATCH_BYTES = 2 << 20


def batch_rows(metadata: Any) -> int:
    """Rows per batch for a Parquet file with this metadata: :data:`BATCH_BYTES` of its rows, 64 to
    :data:`BATCH_ROWS`."""
    rows = sum(metadata.row_group(i).num_rows for i in range(metadata.num_row_groups))
    size = sum(metadata.row_group(i).total_byte_size for i in range(metadata.num_row_groups))
    per_row = max(1, size // max(1, rows))
    return min(BATCH_ROWS, max(64, BATCH_BYTES // per_row))


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
    source: str = "the source",
) -> dict[str, Any]:
    """The entry for ``describe`` under ``cache_dir``, converting it first if it is not there (``source`` names
    the data in errors): ``batches`` yields
    Arrow tables (at most :data:`BATCH_ROWS` rows each, ``rows`` in all) and ``to_arrays`` turns one into
    ``{"x": array | ("images", data, offsets), "y": array?}``. Returns the entry's arrays, memory-mapped: numpy
    arrays, or for images ``("images", data, offsets)``."""
    from ..errors import DatasetError

    if rows == 0:
        raise DatasetError(f"{source}: no rows")
    base = os.fspath(cache_dir)
    final = os.path.join(base, entry_name(describe))
    try:
        os.makedirs(base, exist_ok=True)
        if not os.path.isdir(final):
            with _exclusive(final + ".lock"):
                if not os.path.isdir(final):  # another worker may have finished it while this one waited
                    _convert_into(final, describe, batches, rows, to_arrays, source)
    except OSError as exc:  # not a folder, not writable, full
        raise DatasetError(
            f"{source}: cannot convert into cache_dir {base!r} ({exc}): it must be a writable folder on a local "
            "disk with room for the dataset"
        ) from None
    try:
        return _read(final)
    except (OSError, ValueError) as exc:
        raise DatasetError(f"{final}: a converted dataset that cannot be read ({exc}); remove the folder") from exc


def _convert_into(
    final: str, describe: dict[str, Any], batches: Iterator[Any], rows: int, to_arrays: Any, source: str
) -> None:
    """Write the entry in a temporary folder next to ``final`` and rename it: it appears whole or not at all."""
    tmp = f"{final}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        _write(tmp, batches, rows, to_arrays, source)
        with open(os.path.join(tmp, "source.json"), "w") as f:
            json.dump(describe, f, indent=1, default=str)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class _Sink:
    """One output file written front to back with ``write`` (not a memory map: dirty mapped pages are not throttled
    and, under a memory limit, were what ran a conversion out of memory). Every :data:`WRITE_BACK` bytes it writes
    them to disk and drops them from the page cache, so the conversion's memory stays flat."""

    def __init__(self, path: str, header: dict[str, Any] | None = None) -> None:
        self.file = open(path, "wb")  # noqa: SIM115 - closed by close()
        if header is not None:
            np.lib.format.write_array_header_2_0(self.file, header)
        self.synced = 0
        self.dtype = None if header is None else np.dtype(header["descr"])
        self.shape = None if header is None else tuple(header["shape"][1:])

    def write(self, a: np.ndarray) -> None:
        self.file.write(np.require(a, requirements="C").data)
        if self.file.tell() - self.synced >= WRITE_BACK:
            self._write_back()

    def _write_back(self) -> None:
        self.file.flush()
        fd, end = self.file.fileno(), self.file.tell()
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, end, os.POSIX_FADV_DONTNEED)
        self.synced = end

    def close(self) -> None:
        if not self.file.closed:
            self._write_back()
            self.file.close()


#: Bytes a conversion writes to each file before it writes them back and drops them from the page cache.
WRITE_BACK = 32 << 20


def _write(tmp: str, batches: Iterator[Any], rows: int, to_arrays: Any, source: str) -> None:
    """Stream ``batches`` into files under ``tmp``."""
    from ..errors import DatasetError

    out: dict[str, _Sink] = {}
    offsets_parts: list[np.ndarray] = [np.zeros(1, np.uint64)]
    image_bytes = 0
    at = 0
    with contextlib.ExitStack() as files:
        data_file = None
        for table in batches:
            arrays = to_arrays(table)
            k = table.num_rows
            if at + k > rows:
                raise DatasetError(f"{source}: more rows than its metadata says ({rows})")
            for name, a in arrays.items():
                if isinstance(a, tuple):  # encoded images: ("images", data, offsets)
                    _, data, offsets = a
                    if data_file is None:
                        data_file = _Sink(os.path.join(tmp, "data.bin"))
                        files.callback(data_file.close)
                    data_file.write(data)
                    offsets_parts.append(offsets[1:].astype(np.uint64) + np.uint64(image_bytes))
                    image_bytes += int(offsets[-1])
                    continue
                if name not in out:
                    header = {
                        "descr": np.lib.format.dtype_to_descr(a.dtype),
                        "fortran_order": False,
                        "shape": (rows, *a.shape[1:]),
                    }
                    out[name] = _Sink(os.path.join(tmp, f"{name}.npy"), header)
                    files.callback(out[name].close)
                dst = out[name]
                if a.shape[1:] != dst.shape or a.dtype != dst.dtype:
                    raise DatasetError(
                        f"{source}: column(s) {name!r}: rows of {a.dtype} {a.shape[1:]} after rows of {dst.dtype} "
                        f"{dst.shape} (parts of different types: pass dtype= to cast them all)"
                    )
                dst.write(a)
            at += k
        if at != rows:
            raise DatasetError(f"{source}: {at} rows, its metadata says {rows}")
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
