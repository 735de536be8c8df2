"""Property tests (hypothesis) of ``ddlf.datasets`` and the batch pipeline (``ddlf.ops.BatchPipeline``): for any
arrays (every dtype and layout of :mod:`.test_ops_properties`), any indices (negative, past the end, past 2**32,
floats, booleans) and any batch settings, the batches equal numpy's indexing or a clear ``TypeError``/``ValueError``
is raised; for any bytes in a dataset file, the reader returns what the header declares or raises
``DatasetError``. Never a crash, never a silent wrong answer."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddlf import data as datasets
from ddlf import ops
from ddlf.errors import DatasetError

from .test_ops_properties import DTYPES, LAYOUTS, make

CLEAR = (TypeError, ValueError)
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

row_shapes = st.one_of(st.just(()), st.tuples(st.integers(0, 4)), st.tuples(st.integers(1, 3), st.integers(1, 3)))
index_values = st.one_of(
    st.integers(-3, 40),
    st.sampled_from([2**32 - 1, 2**32, 2**32 + 1, 2**63 - 1]),
)


@st.composite
def datasets_and_indices(draw: Any) -> tuple[list[np.ndarray], Any]:
    rows = draw(st.integers(0, 30))
    arrays = []
    for _ in range(draw(st.integers(1, 3))):
        dtype, layout = draw(st.sampled_from(DTYPES)), draw(st.sampled_from(LAYOUTS))
        arrays.append(make(dtype, (rows, *draw(row_shapes)), layout, draw(st.integers(0, 999))))
    if draw(st.booleans()) and rows > 0 and len(arrays) > 1:  # a second array with another row count
        arrays[-1] = arrays[-1][: rows - 1]
    kind = draw(st.sampled_from(["int64", "uint32", "uint64", "int32", "float64", "bool", "list", "2d"]))
    values = draw(st.lists(index_values, max_size=20))
    idx: Any
    if kind == "list":
        idx = values
    elif kind == "2d":
        idx = np.array(values[: len(values) // 2 * 2], dtype=np.int64).reshape(-1, 2) if values else np.zeros((0, 2))
    elif kind == "bool":
        idx = np.array([v % 2 == 0 for v in values], dtype=bool)
    elif kind.startswith("uint"):
        idx = np.array([v for v in values if v >= 0], dtype=np.uint64).astype(kind)
    else:
        idx = np.array([v for v in values if abs(v) < 2**62]).astype(kind)
    return arrays, idx


def _expected_indices(idx: Any) -> np.ndarray | None:
    """The rows a correct pipeline visits for ``idx`` (None: it must refuse them)."""
    a = np.asarray(idx)
    if a.dtype.kind not in "iu":
        return None if a.size else a.astype(np.int64).reshape(-1)  # an empty list is float64 in numpy
    return a.reshape(-1)


@SETTINGS
@given(
    data=datasets_and_indices(),
    batch_size=st.integers(0, 7),
    prefetch=st.integers(0, 3),
    drop_last=st.booleans(),
    inline=st.sampled_from([None, False, True]),
)
def test_pipeline_equals_numpy_or_refuses(
    data: tuple[list[np.ndarray], Any], batch_size: int, prefetch: int, drop_last: bool, inline: bool | None
) -> None:
    """Gathered on the prefetch thread or inline (as asked, or as the size decides), the batches are numpy's."""
    arrays, idx = data
    try:
        pipe = ops.BatchPipeline(arrays, idx, batch_size, prefetch=prefetch, drop_last=drop_last, inline=inline)
        got = list(pipe)
    except CLEAR:
        return
    assert inline is None or pipe.inline == inline
    want_idx = _expected_indices(idx)
    assert want_idx is not None, f"accepted indices of dtype {np.asarray(idx).dtype}"
    rows = len(arrays[0])
    assert batch_size >= 1, "accepted batch_size 0"
    assert all(len(a) == rows for a in arrays), "accepted arrays with different row counts"
    assert not any(a.dtype.hasobject for a in arrays), "batched references to Python objects"
    assert all(0 <= int(i) < rows for i in want_idx), "accepted an index out of range"
    starts = range(0, len(want_idx), batch_size)
    if drop_last:
        starts = range(0, len(want_idx) - len(want_idx) % batch_size, batch_size)
    assert len(got) == len(starts)
    for batch, start in zip(got, starts):
        parts = batch if isinstance(batch, tuple) else (batch,)
        assert len(parts) == len(arrays)
        rows_here = want_idx[start : start + batch_size].astype(np.int64)
        for part, a in zip(parts, arrays):
            want = np.asarray(a)[rows_here]
            assert part.dtype == a.dtype and part.shape == want.shape
            np.testing.assert_array_equal(part, want)
    stats = pipe.stats()
    assert (stats["batches"], stats["rows"]) == (len(got), sum(len(b[0] if isinstance(b, tuple) else b) for b in got))


@SETTINGS
@given(
    rows=st.integers(1, 40),
    batch_size=st.integers(1, 9),
    epochs=st.integers(1, 3),
    seed=st.one_of(st.none(), st.integers(0, 2**31)),
)
def test_batches_visit_every_row_once_per_epoch(rows: int, batch_size: int, epochs: int, seed: int | None) -> None:
    x = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
    y = np.arange(rows, dtype=np.int64)
    seen = [b for _, b in datasets.batches((x, y), batch_size=batch_size, epochs=epochs, seed=seed)]
    per_epoch = -(-rows // batch_size)
    assert len(seen) == per_epoch * epochs
    for e in range(epochs):
        order = np.concatenate(seen[e * per_epoch : (e + 1) * per_epoch])
        assert sorted(order.tolist()) == list(range(rows))
        if seed is None:
            assert order.tolist() == list(range(rows))


@pytest.mark.parametrize("bad", [np.array([-1]), np.array([2**32 + 1], np.uint64), np.array([1.5]), [True]])
def test_batches_refuse_bad_indices(bad: Any) -> None:
    with pytest.raises(CLEAR):
        list(datasets.batches(np.arange(10), indices=bad, batch_size=2))


IDX_CODES = {0x08: "u1", 0x09: "i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


@st.composite
def idx_files(draw: Any) -> bytes:
    """IDX files: valid ones, and ones with a wrong magic, type code, dimension count, huge or lying dims, or
    truncated or trailing data."""
    code = draw(st.sampled_from([*IDX_CODES, 0x00, 0x0A, 0xFF]))
    dims = draw(
        st.lists(st.one_of(st.integers(0, 6), st.sampled_from([2**16, 2**31, 2**32 - 1])), min_size=0, max_size=4)
    )
    zero = draw(st.sampled_from([0, 0, 0, 1, 0x0800]))
    header = struct.pack(">HBB", zero, code, len(dims)) + struct.pack(f">{len(dims)}I", *dims)
    n = int(np.prod(dims, dtype=object)) if dims else 0
    itemsize = np.dtype(IDX_CODES.get(code, "u1")).itemsize
    size = n * itemsize if n * itemsize < 4096 else draw(st.integers(0, 64))
    size += draw(st.sampled_from([0, 0, 0, -1, 1]))
    body = draw(st.binary(min_size=max(0, size), max_size=max(0, size)))
    data = header + body
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    return gzip.compress(data) if draw(st.booleans()) else data


@SETTINGS
@given(data=idx_files())
def test_read_idx_returns_what_the_header_says_or_refuses(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "file.idx"
    path.write_bytes(data)
    try:
        a = datasets.read_idx(path)
    except DatasetError:
        return
    raw = gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data
    zero, code, ndim = struct.unpack(">HBB", raw[:4])
    dims = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    assert zero == 0 and code in IDX_CODES and ndim > 0
    assert a.shape == dims
    want = np.frombuffer(raw, dtype=IDX_CODES[code], offset=4 + 4 * ndim)
    assert want.size == a.size
    np.testing.assert_array_equal(a.reshape(-1), want)


@SETTINGS
@given(data=st.binary(max_size=3 * 3073 + 2), labels=st.lists(st.integers(0, 255), max_size=3))
def test_read_cifar_batch_whole_records_or_refuses(tmp_path: Path, data: bytes, labels: list[int]) -> None:
    records = bytearray(data)
    for i, label in enumerate(labels):  # sometimes whole records with chosen labels
        if len(records) >= (i + 1) * 3073:
            records[i * 3073] = label
    path = tmp_path / "batch.bin"
    path.write_bytes(bytes(records))
    try:
        x, y = datasets.read_cifar10_batch(path)
    except DatasetError:
        return
    assert len(records) % 3073 == 0 and len(records) > 0
    assert x.shape == (len(records) // 3073, 32, 32, 3) and y.shape == (len(x),)
    assert int(y.max()) <= 9
    assert bytes(y) == bytes(records[::3073])


@SETTINGS
@given(data=st.binary(max_size=300))
def test_npy_and_npz_refuse_garbage(tmp_path: Path, data: bytes) -> None:
    for name, reader in (("a.npy", datasets.npy), ("a.npz", datasets.npz)):
        path = tmp_path / name
        path.write_bytes(data)
        try:
            out = reader(path)
        except DatasetError:
            continue
        # Random bytes that happen to be a valid file: then it must read back as numpy reads it.
        if name.endswith(".npy"):
            np.testing.assert_array_equal(out, np.load(path, allow_pickle=False))


def test_npy_refuses_pickled_objects(tmp_path: Path) -> None:
    path = tmp_path / "objects.npy"
    np.save(path, np.array([1, None], dtype=object), allow_pickle=True)
    with pytest.raises(DatasetError):
        datasets.npy(path)
    with pytest.raises(DatasetError):
        datasets.npy(path, mmap=False)
