"""A replica's round of batches (``Feed``) and where the pipeline gathers them: a small round of rows in memory on
the training thread (``BatchPipeline.inline``), everything else on the pipeline's prefetch thread; either way the
same batches."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import numpy as np
import pytest

from ddlf import ops
from ddlf.data.structure import Parts, as_arrays
from ddlf.training.messages import FitData
from ddlf.training.replica.dataset import Feed

INLINE_BYTES = 1 << 20  # ddlf_core::prefetch::INLINE_BYTES


def _x(rows: int, width: int = 784) -> np.ndarray:
    return np.arange(rows * width, dtype=np.uint8).reshape(rows, width)


def test_a_small_round_of_memory_arrays_is_gathered_inline() -> None:
    x, y = _x(12000), np.arange(12000, dtype=np.int64)
    assert ops.BatchPipeline([x, y], np.arange(64, dtype=np.uint32), 32).inline
    # Past the limit (over every array's bytes), or all 9.5 MB of the dataset, the prefetch thread gathers.
    rows_over = INLINE_BYTES // (784 + 8) + 1
    assert not ops.BatchPipeline([x, y], np.arange(rows_over, dtype=np.uint32), 32).inline
    assert ops.BatchPipeline([x, y], np.arange(rows_over - 1, dtype=np.uint32), 32).inline
    assert not ops.BatchPipeline([x, y], np.arange(12000, dtype=np.uint32), 32).inline
    # Asked for either way, whatever the size.
    assert not ops.BatchPipeline([x, y], np.arange(64, dtype=np.uint32), 32, inline=False).inline
    assert ops.BatchPipeline([x, y], np.arange(12000, dtype=np.uint32), 32, inline=True).inline


def test_a_file_mapped_from_disk_goes_through_the_thread_even_when_cached(tmp_path: Path) -> None:
    """Linux's mincore says "resident" for every page of a file this process may neither write nor own, so a
    memmap of a file on disk is never taken to be in memory; its batches are the same."""
    if str(tmp_path).startswith("/dev/shm/"):
        pytest.skip("the test's files are under /dev/shm: host copies, not files on disk")
    on_disk = tmp_path / "x.npy"
    np.save(on_disk, _x(4000))
    rows = np.arange(0, 4000, 400, dtype=np.uint32)  # 10 rows, 7.8 KB
    mapped = np.load(on_disk, mmap_mode="r")
    np.asarray(mapped).sum()  # every page read: cached
    pipe = ops.BatchPipeline([mapped], rows, 4)
    assert not pipe.inline
    batches = list(pipe)
    assert all(type(b) is np.ndarray for b in batches)  # plain arrays, not memmaps of nothing
    np.testing.assert_array_equal(np.concatenate(batches), _x(4000)[rows])


def test_a_mapping_seen_as_a_plain_array_is_told_by_its_pages(tmp_path: Path) -> None:
    """The same file's memory as a plain array (what ``np.frombuffer`` of an mmap gives): inline only once the
    round's pages are in memory (this process owns the file, so mincore tells)."""
    on_disk = tmp_path / "x.npy"
    np.save(on_disk, _x(4000))
    rows = np.arange(0, 4000, 400, dtype=np.uint32)
    with open(on_disk, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # out of the page cache: on disk only
    mapped = np.load(on_disk, mmap_mode="r")
    plain = np.ndarray(mapped.shape, mapped.dtype, buffer=mapped)
    assert type(plain) is np.ndarray
    dropped = not ops.BatchPipeline([plain], rows, 4).inline
    np.testing.assert_array_equal(np.concatenate(list(ops.BatchPipeline([plain], rows, 4))), _x(4000)[rows])
    assert ops.BatchPipeline([plain], rows, 4).inline  # read: now cached
    if not dropped:
        pytest.skip(f"the page cache kept {tmp_path}'s pages (tmpfs?): the pages-on-disk case was not shown")


def test_a_dataset_not_in_c_order_is_made_so_when_loaded() -> None:
    """The pipeline reads C-ordered rows (it would copy the whole array every round otherwise): the loaded dataset,
    what the worker's store keeps, is made so once; so is a ``train(sample_weight=...)`` array."""
    x = np.asfortranarray(_x(100).astype(np.float32))
    loaded = as_arrays(({"a": x, "b": x[:, ::2]}, np.arange(200)[::2]))
    for leaf in (loaded[0]["a"], loaded[0]["b"], loaded[1]):
        assert leaf.flags.c_contiguous
    np.testing.assert_array_equal(loaded[0]["a"], x)
    np.testing.assert_array_equal(loaded[0]["b"], x[:, ::2])
    assert loaded[0]["a"].dtype == x.dtype
    c = np.ascontiguousarray(x)
    assert as_arrays((c, None))[0] is c  # already in C order: not copied
    pandas = pytest.importorskip("pandas")
    frame = pandas.DataFrame(x)  # its values come back in Fortran order
    assert as_arrays((frame, None))[0].flags.c_contiguous
    parts = Parts.loaded((c, np.arange(100))).with_sample_weight(np.ones(200, np.float32)[::2])
    assert all(leaf.flags.c_contiguous for leaf in parts.leaves)


def test_the_hosts_copy_under_dev_shm_is_gathered_inline() -> None:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    shm = Path("/dev/shm") / f"ddlf-test-{uuid.uuid4().hex}.npy"
    try:
        np.save(shm, _x(100))
        mapped = np.load(shm, mmap_mode="r")
        pipe = ops.BatchPipeline([mapped], np.arange(10, dtype=np.uint32), 4)
        assert pipe.inline
        np.testing.assert_array_equal(np.concatenate(list(pipe)), _x(100)[:10])
    finally:
        shm.unlink(missing_ok=True)


@pytest.mark.parametrize("rows", [64, 2000])
def test_a_feed_gives_the_same_batches_either_way(rows: int) -> None:
    x, y = _x(3000).astype(np.float32), np.arange(3000, dtype=np.int64)  # 3 KB a row: 2000 rows pass the limit
    parts = Parts.loaded((x, y))
    order = np.random.default_rng(0).permutation(3000).astype(np.uint32)[:rows]
    feed = Feed(parts, order, 32, 2, lambda a, b: (a, b), FitData())
    assert feed.pipeline.inline == (rows == 64)
    got = list(feed)
    want = list(ops.BatchPipeline([x, y], order, 32, inline=rows != 64))  # the other way
    assert len(got) == len(want) == -(-rows // 32)
    for (gx, gy, sw, n), (wx, wy) in zip(got, want):
        np.testing.assert_array_equal(gx, wx)
        np.testing.assert_array_equal(gy, wy)
        assert sw is None and n == len(wx)
    stats = feed.stats()
    assert stats["rows"] == rows and stats["batches"] == len(want)
    assert stats["gather_seconds"] > 0
    if rows == 64:  # gathered while the training thread waited
        assert stats["wait_seconds"] >= stats["gather_seconds"]
