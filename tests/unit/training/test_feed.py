"""A replica's round of batches (``Feed``): small rounds of in-memory arrays are gathered on the training thread,
everything else by the Rust pipeline's prefetch thread; either way the same batches."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import numpy as np
import pytest

from ddlf import ops
from ddlf.data.images import EncodedImages
from ddlf.data.structure import Parts
from ddlf.training.messages import FitData
from ddlf.training.replica.dataset import INLINE_BYTES, Feed, InlineBatches, gathers_inline


def _x(rows: int, width: int = 784) -> np.ndarray:
    return np.arange(rows * width, dtype=np.uint8).reshape(rows, width)


def test_a_small_round_of_memory_arrays_is_gathered_inline() -> None:
    x, y = _x(12000), np.arange(12000, dtype=np.int64)
    two_batches = np.arange(64, dtype=np.uint32)
    assert gathers_inline([x, y], two_batches)
    # Past the limit, or without indices, the pipeline gathers.
    rows_over = INLINE_BYTES // (784 + 8) + 1
    assert not gathers_inline([x, y], np.arange(rows_over, dtype=np.uint32))
    assert gathers_inline([x, y], np.arange(rows_over - 1, dtype=np.uint32))
    assert not gathers_inline([x, y], None)


def test_mapped_files_count_as_memory_only_under_dev_shm(tmp_path: Path) -> None:
    on_disk = tmp_path / "x.npy"
    np.save(on_disk, _x(100))
    rows = np.arange(10, dtype=np.uint32)
    assert not gathers_inline([np.load(on_disk, mmap_mode="r")], rows)  # its pages may still be on disk
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    shm = Path("/dev/shm") / f"ddlf-test-{uuid.uuid4().hex}.npy"
    try:
        np.save(shm, _x(100))
        mapped = np.load(shm, mmap_mode="r")
        assert gathers_inline([mapped], rows)
        batches = list(InlineBatches([mapped], rows, 4))
        assert all(type(b) is np.ndarray for b in batches)  # plain arrays, not memmaps of nothing
        np.testing.assert_array_equal(np.concatenate(batches), _x(100)[:10])
    finally:
        shm.unlink(missing_ok=True)


def test_encoded_images_go_through_the_pipeline() -> None:
    images = EncodedImages.__new__(EncodedImages)
    assert not gathers_inline([images], np.arange(2, dtype=np.uint32))


@pytest.mark.parametrize("rows", [64, 2000])
def test_a_feed_gives_the_same_batches_either_way(rows: int) -> None:
    x, y = _x(3000).astype(np.float32), np.arange(3000, dtype=np.int64)  # 3 KB a row: 2000 rows pass the limit
    parts = Parts.loaded((x, y))
    order = np.random.default_rng(0).permutation(3000).astype(np.uint32)[:rows]
    feed = Feed(parts, order, 32, 2, lambda a, b: (a, b), FitData())
    assert isinstance(feed.pipeline, InlineBatches) == (rows == 64)
    got = list(feed)
    want = list(ops.BatchPipeline([x, y], order, 32))
    assert len(got) == len(want) == -(-rows // 32)
    for (gx, gy, sw, n), (wx, wy) in zip(got, want):
        np.testing.assert_array_equal(gx, wx)
        np.testing.assert_array_equal(gy, wy)
        assert sw is None and n == len(wx)
    assert feed.stats()["rows"] == rows and feed.stats()["batches"] == len(want)
