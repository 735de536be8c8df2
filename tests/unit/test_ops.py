"""ddlf.ops: the Rust kernels against numpy, and every bad input."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from ddlf import ops


def rng() -> np.random.Generator:
    return np.random.default_rng(0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_weighted_average_matches_numpy(dtype) -> None:
    r = rng()
    lists = [[r.standard_normal((300, 700)).astype(dtype), r.standard_normal(5).astype(dtype)] for _ in range(3)]
    w = [1.0, 2.0, 5.0]
    got = ops.weighted_average(lists, w)
    for j in range(2):
        want = sum(wi * lst[j] for wi, lst in zip(w, lists)) / sum(w)
        assert got[j].dtype == dtype and got[j].shape == lists[0][j].shape
        np.testing.assert_allclose(got[j], want, rtol=1e-5, atol=1e-6)
    eq = ops.weighted_average(lists)
    np.testing.assert_allclose(eq[1], np.mean([lst[1] for lst in lists], axis=0), rtol=1e-5)


def test_weighted_average_bad_inputs() -> None:
    a = [np.ones(3, np.float32)]
    with pytest.raises(ValueError, match="nothing to average"):
        ops.weighted_average([])
    with pytest.raises(ValueError, match="weights"):
        ops.weighted_average([a, a], [1.0])
    with pytest.raises(ValueError):
        ops.weighted_average([a, a], [0.0, 0.0])
    with pytest.raises(ValueError, match="shape"):
        ops.weighted_average([a, [np.ones(4, np.float32)]])
    with pytest.raises(ValueError, match="arrays"):
        ops.weighted_average([a, a + a])
    # integers (counters) are not averaged: the first list's, shapes still checked
    assert ops.weighted_average([[np.ones(3, np.int64)], [np.full(3, 5, np.int64)]])[0].tolist() == [1, 1, 1]
    with pytest.raises(ValueError, match="shape"):
        ops.weighted_average([[np.ones(3, np.int64)], [np.ones(4, np.int64)]])
    with pytest.raises(ValueError, match="contiguous"):
        ops.weighted_average([[np.ones((4, 4), np.float32)[:, ::2]], [np.ones((4, 2), np.float32)]])


def test_axpy_in_place_and_delta() -> None:
    r = rng()
    old = [r.standard_normal((100, 100)).astype(np.float32), r.standard_normal(7)]
    new = [o + 1.5 for o in old]
    d = ops.delta(new, old)
    np.testing.assert_allclose(d[0], 1.5, rtol=1e-6)
    w = [o.copy() for o in old]
    ops.axpy_(w, d, 2.0)
    np.testing.assert_allclose(w[0], old[0] + 3.0, rtol=1e-5)
    np.testing.assert_allclose(w[1], old[1] + 3.0)
    ro = old[0].copy()
    ro.flags.writeable = False
    with pytest.raises((ValueError, BufferError)):
        ops.axpy_([ro], [d[0]])
    with pytest.raises(ValueError):
        ops.axpy_(w, d[:1])
    with pytest.raises(ValueError):
        ops.delta(new, old[:1])


def test_half_precision_round_trip() -> None:
    x = [rng().standard_normal((64, 64)).astype(np.float32)]
    h = ops.to_half(x)
    assert h[0].dtype == np.float16 and h[0].nbytes == x[0].nbytes // 2
    np.testing.assert_allclose(ops.from_half(h)[0], x[0], atol=5e-3)
    np.testing.assert_array_equal(h[0], x[0].astype(np.float16))
    b = ops.to_half(x, "bfloat16")
    assert str(b[0].dtype) == "bfloat16"
    np.testing.assert_allclose(ops.from_half(b)[0], x[0], rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="dtype"):
        ops.to_half(x, "int8")
    with pytest.raises(TypeError, match="float32"):
        ops.to_half([np.ones(3)])
    with pytest.raises(TypeError):
        ops.from_half(x)
    # what averaging rounds ask of every array: half precision, and nothing else of two bytes
    assert ops.is_half(h[0]) and ops.is_half(b[0])
    assert not any(ops.is_half(np.zeros(2, t)) for t in (np.float32, np.float64, np.int16, np.uint16, np.int8))


def test_permutation_and_partitions() -> None:
    p = ops.permutation(1000, 3, 1)
    assert p.dtype == np.uint32 and sorted(p.tolist()) == list(range(1000))
    np.testing.assert_array_equal(p, ops.permutation(1000, 3, 1))
    assert not np.array_equal(p, ops.permutation(1000, 3, 2))
    parts = ops.partitions(1001, 3, 1, [1, 1, 1])
    assert [len(x) for x in parts] == [334, 334, 333] == ops.split_sizes(1001, [1, 1, 1])
    assert sorted(np.concatenate(parts).tolist()) == list(range(1001))
    for w in range(3):
        np.testing.assert_array_equal(parts[w], ops.partition_for(1001, 3, 1, [1, 1, 1], w))
    uneven = ops.partitions(100, 0, 0, [3, 1])
    assert [len(x) for x in uneven] == [75, 25]
    with pytest.raises(ValueError):
        ops.partitions(10, 0, 0, [])
    with pytest.raises(ValueError):
        ops.partitions(10, 0, 0, [-1, 2])
    with pytest.raises(ValueError):
        ops.partition_for(10, 0, 0, [1, 1], 5)


def test_gather_matches_fancy_indexing() -> None:
    x = rng().integers(0, 255, (500, 28, 28), dtype=np.uint8)
    idx = rng().integers(0, 500, 64)
    np.testing.assert_array_equal(ops.gather(x, idx), x[idx])
    y = np.arange(500, dtype=np.int64)
    np.testing.assert_array_equal(ops.gather(y, idx), y[idx])
    with pytest.raises(ValueError, match="out of range"):
        ops.gather(x, [0, 500])
    with pytest.raises(ValueError, match="negative"):
        ops.gather(x, [-1])
    with pytest.raises(TypeError, match="integers"):
        ops.gather(x, [0.5])


def test_batch_pipeline_yields_the_gathered_batches() -> None:
    x = rng().standard_normal((1000, 8)).astype(np.float32)
    y = np.arange(1000, dtype=np.int32)
    idx = ops.permutation(1000, 1, 0)[:250]
    pl = ops.BatchPipeline([x, y], idx, 64, prefetch=3)
    assert len(pl) == 4
    seen = 0
    for b, (bx, by) in enumerate(pl):
        chunk = idx[b * 64 : (b + 1) * 64]
        np.testing.assert_array_equal(bx, x[chunk])
        np.testing.assert_array_equal(by, y[chunk])
        seen += len(bx)
    assert seen == 250
    stats = pl.stats()
    assert stats["batches"] == 4 and stats["rows"] == 250
    assert len(ops.BatchPipeline([x], idx, 64, drop_last=True)) == 3
    single = list(ops.BatchPipeline([x], idx[:10], 4))
    assert isinstance(single[0], np.ndarray) and single[-1].shape == (2, 8)


def test_batch_pipeline_reads_a_file_mapping_not_in_the_cache(tmp_path) -> None:
    # A dataset larger than memory: a mapped .npy whose pages are on disk only. The pipeline marks the mapping
    # for random access and reads the next batches' pages ahead; the batches are the same as numpy's.
    import os

    from ddlf import data as datasets

    x = rng().integers(0, 255, (20_000, 300), dtype=np.uint8)  # 300 B rows: several per page, some across two
    np.save(tmp_path / "x.npy", x)
    fd = os.open(tmp_path / "x.npy", os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    mapped = datasets.npy(tmp_path / "x.npy")
    idx = ops.permutation(len(x), 3, 0)
    batches = list(ops.BatchPipeline([mapped], idx, 96, prefetch=2))
    np.testing.assert_array_equal(np.concatenate(batches), x[idx])
    # Read in order afterwards (the mapping's default access is back), and a second pipeline agrees.
    np.testing.assert_array_equal(np.asarray(mapped), x)
    again = list(ops.BatchPipeline([mapped], idx[:500], 96, prefetch=2))
    np.testing.assert_array_equal(np.concatenate(again), x[idx[:500]])


def test_batch_pipeline_bad_inputs() -> None:
    x = np.zeros((10, 2), np.float32)
    with pytest.raises(ValueError, match="out of range"):
        ops.BatchPipeline([x], [0, 10], 2)
    with pytest.raises(ValueError, match="rows"):
        ops.BatchPipeline([x, np.zeros(9)], [0], 2)
    with pytest.raises(ValueError, match="batch_size"):
        ops.BatchPipeline([x], [0], 0)
    with pytest.raises(ValueError):
        ops.BatchPipeline([], [0], 1)
    with pytest.raises(ValueError, match="batch_size must be at least 1, not -2"):
        ops.BatchPipeline([x], [0], -2)
    with pytest.raises(ValueError, match="prefetch must be 0 or more, not -1"):
        ops.BatchPipeline([x], [0], 2, prefetch=-1)
    with pytest.raises(TypeError, match=r"pass one array as \[array\]"):
        ops.BatchPipeline(x, [0], 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="0-d"):
        ops.BatchPipeline([np.float32(3.0)], [0], 1)
    with pytest.raises(TypeError, match="integers"):
        ops.BatchPipeline([x], [0.5], 1)
    assert list(ops.BatchPipeline([x], [], 2)) == []  # no rows: numpy calls [] float64


def test_batch_pipeline_any_prefetch_and_dtypes_the_buffer_protocol_lacks() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.arange(40, dtype=np.float32).reshape(10, 4)
    order = np.array([9, 3, 0, 7, 7])
    # More batches ahead than there are: at most every batch (the channel's slots were allocated up front).
    for prefetch in (10**9, 2**62):
        got = list(ops.BatchPipeline([x], order, 2, prefetch=prefetch, inline=False))
        np.testing.assert_array_equal(np.concatenate(got), x[order])
    # Dtypes numpy cannot export through the buffer protocol: copied as bytes, returned as themselves.
    leaves = [
        x.astype(ml_dtypes.bfloat16),
        x.astype(ml_dtypes.float8_e4m3fn),
        np.arange(10).astype("datetime64[s]"),
        np.arange(20).reshape(10, 2).astype("timedelta64[ms]")[:, ::-1],
    ]
    for inline in (True, False):
        batches = list(ops.BatchPipeline(leaves, order, 2, inline=inline))
        for i, leaf in enumerate(leaves):
            part = np.concatenate([b[i] for b in batches])
            assert part.dtype == leaf.dtype and part.shape == (5, *leaf.shape[1:])
            np.testing.assert_array_equal(part.view(np.uint8), np.ascontiguousarray(leaf[order]).view(np.uint8))


def _threads() -> int:
    """This process's OS threads (Rust's prefetch threads included, which ``threading`` does not see)."""
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc to count threads")
def test_batch_pipeline_dropped_early_releases_its_thread() -> None:
    x = np.zeros((100_000, 16), np.float32)
    pl = ops.BatchPipeline([x], np.arange(100_000), 100, prefetch=2)
    next(iter(pl))
    del pl  # a first one: whatever pools it starts once stay
    baseline = _threads()
    for _ in range(20):
        pl = ops.BatchPipeline([x], np.arange(100_000), 100, prefetch=2)
        next(iter(pl))
        assert _threads() > baseline  # its prefetch thread runs, blocked on a full queue
        del pl  # dropping must unblock and join it
    deadline = time.monotonic() + 10
    while _threads() > baseline and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _threads() == baseline  # none of the 20 threads leaked


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc to count threads")
def test_a_small_round_in_memory_is_gathered_without_a_thread() -> None:
    x, y = np.ones((1000, 16), np.float32), np.arange(1000)
    order = np.arange(64)[::-1].copy()
    list(ops.BatchPipeline([x, y], order, 32))  # a first one: whatever pools it starts once stay
    baseline = _threads()
    pl = ops.BatchPipeline([x, y], order, 32)
    assert pl.inline and _threads() <= baseline  # none started (one left by another test may end meanwhile)
    batches = list(pl)
    assert _threads() <= baseline
    assert [len(bx) for bx, _ in batches] == [32, 32] and batches[0][1].tolist() == list(range(63, 31, -1))
    assert pl.stats()["rows"] == 64 and next(iter(pl), None) is None
    with pytest.raises(TypeError, match="inline"):
        ops.BatchPipeline([x, y], order, 32, inline="yes")  # type: ignore[arg-type]
    assert not ops.BatchPipeline([x, y], order, 32, inline=False).inline  # refused, then as asked


def test_topk_and_densify() -> None:
    x = np.array([[0.1, -5.0, 2.0], [0.0, -0.3, 4.0]], dtype=np.float32)
    [(idx, vals)] = ops.topk([x], 0.5)
    assert idx.tolist() == [1, 2, 5] and vals.tolist() == [-5.0, 2.0, 4.0]
    dense = ops.densify([(idx, vals)], [x])[0]
    assert dense.shape == x.shape and dense.tolist() == [[0, -5, 2], [0, 0, 4]]
    big = np.random.default_rng(0).standard_normal(100_000).astype(np.float32)
    [(i, v)] = ops.topk([big], 0.01)
    assert len(i) == 1000 and np.abs(v).min() >= np.sort(np.abs(big))[-1000]
    with pytest.raises(ValueError, match="ratio"):
        ops.topk([x], 0.0)
    with pytest.raises(TypeError, match="float32"):
        ops.topk([x.astype(np.float64)], 0.5)


def test_integer_counters_are_never_averaged_and_sum_every_replicas_change() -> None:
    """A layer's int counter beside float weights: delta keeps its dtype, weighted_average leaves it alone,
    add_counter_changes sums the replicas' changes, axpy_ adds its whole change whatever alpha."""
    start = [np.zeros(3, np.float32), np.array(10, np.int32)]
    a = [np.ones(3, np.float32), np.array(14, np.int32)]
    b = [np.full(3, 3.0, np.float32), np.array(12, np.int32)]
    d = ops.delta(a, start)
    assert d[1].dtype == np.int32 and d[1].shape == () and int(d[1]) == 4
    merged = ops.weighted_average([a, b], [1.0, 1.0])
    assert merged[0].tolist() == [2.0, 2.0, 2.0] and int(merged[1]) == 14
    ops.add_counter_changes(merged, start, [a, b])
    assert int(merged[1]) == 16 and merged[1].dtype == np.int32
    w = [np.zeros(3, np.float32), np.array(1, np.int64)]
    ops.axpy_(w, [np.ones(3, np.float32), np.array(5, np.int64)], 0.5)
    assert w[0].tolist() == [0.5, 0.5, 0.5] and int(w[1]) == 6
