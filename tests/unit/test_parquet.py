"""ddlf.datasets.parquet: columns to arrays, tensors from fixed-size lists, and clear refusals (no daemons)."""

from __future__ import annotations

import numpy as np
import pytest

from ddlf import data as datasets
from ddlf.errors import DatasetError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

IMAGES = np.arange(7 * 4 * 3, dtype=np.float32).reshape(7, 4, 3)


def tensor(a: np.ndarray):
    """``a`` as nested fixed-size lists (how Arrow, Spark and pandas write tensors)."""
    out = pa.array(a.reshape(-1))
    for size in reversed(a.shape[1:]):
        out = pa.FixedSizeListArray.from_arrays(out, size)
    return out


@pytest.fixture
def table_path(tmp_path) -> str:
    t = pa.table(
        {
            "a": pa.array(range(7), pa.int32()),
            "b": pa.array(np.linspace(0, 1, 7), pa.float64()),
            "c": pa.array([True, False] * 3 + [True]),
            "img": tensor(IMAGES),
            "y": pa.array([0, 1, 2, 0, 1, 2, 0], pa.int8()),
        }
    )
    path = str(tmp_path / "t.parquet")
    pq.write_table(t, path, row_group_size=3)  # several row groups: chunks that are slices of one buffer
    return path


def test_scalar_columns_stack_into_features_and_the_label_comes_apart(table_path: str) -> None:
    x, y = datasets.parquet(table_path, columns=["a", "b"], label="y")
    assert x.shape == (7, 2) and x.dtype == np.float64 and y.dtype == np.int8
    np.testing.assert_array_equal(x[:, 0], np.arange(7))
    np.testing.assert_array_equal(y, [0, 1, 2, 0, 1, 2, 0])
    x32 = datasets.parquet(table_path, columns=["a", "c"], dtype=np.float32)
    assert x32.dtype == np.float32 and x32.shape == (7, 2) and x32[1, 1] == 0.0
    one = datasets.parquet(table_path, columns=["b"])
    assert one.shape == (7, 1)


def test_a_fixed_size_list_column_is_a_tensor(table_path: str) -> None:
    x, y = datasets.parquet(table_path, columns=["img"], label="y")
    assert x.shape == (7, 4, 3) and x.dtype == np.float32 and len(y) == 7
    np.testing.assert_array_equal(x, IMAGES)


def test_a_directory_of_parts_reads_as_one_table(tmp_path) -> None:
    (tmp_path / "export").mkdir()
    for i in range(3):  # a Spark export: part files, and a marker that is not data
        rows = np.arange(i * 10, i * 10 + 10)
        pq.write_table(
            pa.table({"f": pa.array(rows, pa.float32()), "y": pa.array(rows % 2, pa.int64())}),
            str(tmp_path / "export" / f"part-{i:05d}.parquet"),
        )
    (tmp_path / "export" / "_SUCCESS").write_text("")
    x, y = datasets.parquet(str(tmp_path / "export"), label="y")
    assert x.shape == (30, 1) and sorted(x[:, 0].tolist()) == list(range(30))
    np.testing.assert_array_equal(y, x[:, 0].astype(np.int64) % 2)


@pytest.mark.parametrize(
    ("column", "message"),
    [
        (pa.array([1.0, None, 3.0]), "1 missing values"),
        (pa.array([[1, 2], [3], [4, 5]], pa.list_(pa.int64())), "lists of varying length"),
        (pa.array(["a", "b", "c"]), "not numbers"),
        (pa.array([b"\x89PNG", b"x", b"y"]), "encoded images: pass image_size"),
        (pa.FixedSizeListArray.from_arrays(pa.array([1, None, 3, 4, 5, 6]), 2), "inside its lists"),
    ],
)
def test_columns_that_are_not_tensors_are_refused_by_name(tmp_path, column, message: str) -> None:
    path = str(tmp_path / "bad.parquet")
    pq.write_table(pa.table({"bad": column, "y": pa.array([0, 1, 0])}), path)
    with pytest.raises(DatasetError, match=f"'bad'.*{message}|{message}"):
        datasets.parquet(path, columns=["bad"], label="y")


def test_missing_files_columns_and_labels_are_clear(tmp_path, table_path: str) -> None:
    with pytest.raises(DatasetError, match="no label column 'nope'"):
        datasets.parquet(table_path, label="nope")
    with pytest.raises(DatasetError, match="not a readable Parquet"):
        datasets.parquet(table_path, columns=["nope"])
    with pytest.raises(DatasetError, match="not a readable Parquet"):
        datasets.parquet(str(tmp_path / "missing.parquet"))
    (tmp_path / "text.parquet").write_text("not parquet at all")
    with pytest.raises(DatasetError, match="not a readable Parquet"):
        datasets.parquet(str(tmp_path / "text.parquet"))
    with pytest.raises(DatasetError, match="are tensors"):
        datasets.parquet(table_path, label="y")  # every column: scalars and a tensor together


def _export(root, parts: int, rows: int) -> np.ndarray:
    """A Spark-style export of ``parts`` part files with several row groups each: rows ``k`` have features
    ``[k, -k]`` and label ``k % 3``. Returns the features in file order."""
    root.mkdir(exist_ok=True)
    feats = []
    for i in range(parts):
        k = np.arange(i * rows, (i + 1) * rows)
        f = np.stack([k, -k], axis=1).astype(np.float32)
        feats.append(f)
        table = pa.table({"f": pa.array(list(f), pa.list_(pa.float32())), "y": pa.array(k % 3, pa.int64())})
        pq.write_table(table, str(root / f"part-{i:05d}.parquet"), row_group_size=max(1, rows // 3))
    (root / "_SUCCESS").write_text("")
    return np.concatenate(feats)


def test_cache_dir_converts_once_in_batches_and_maps_the_result(tmp_path, monkeypatch) -> None:
    from ddlf.data import parquet_cache as disk_cache

    monkeypatch.setattr(disk_cache, "BATCH_ROWS", 7)  # many batches, cutting row groups and files
    want = _export(tmp_path / "export", parts=3, rows=20)
    cache = tmp_path / "cache"
    x, y = datasets.parquet(str(tmp_path / "export"), columns=["f"], label="y", cache_dir=cache)
    assert isinstance(x, np.memmap) and isinstance(y, np.memmap)
    assert x.shape == (60, 2) and x.dtype == np.float32 and y.dtype == np.int64
    np.testing.assert_array_equal(x, want)
    np.testing.assert_array_equal(y, np.arange(60) % 3)
    in_memory = datasets.parquet(str(tmp_path / "export"), columns=["f"], label="y")
    np.testing.assert_array_equal(np.sort(in_memory[0][:, 0]), x[:, 0])
    (entry,) = [p for p in cache.iterdir() if p.is_dir()]
    made = (entry / "x.npy").stat().st_mtime_ns

    # The same call again (the next script, another worker) maps the entry without converting.
    monkeypatch.setattr(disk_cache, "_write", lambda *a: pytest.fail("converted again"))
    x2, _ = datasets.parquet(str(tmp_path / "export"), columns=["f"], label="y", cache_dir=cache)
    np.testing.assert_array_equal(x2, want)
    assert (entry / "x.npy").stat().st_mtime_ns == made

    # Shards of a cached export are their own entries: every n-th part file, as without the cache.
    monkeypatch.undo()
    s1, _ = datasets.parquet(str(tmp_path / "export"), columns=["f"], label="y", shard=(1, 3), cache_dir=cache)
    np.testing.assert_array_equal(s1, want[20:40])
    few, _ = datasets.parquet(str(tmp_path / "export"), columns=["f"], label="y", shard=(2, 4), cache_dir=cache)
    np.testing.assert_array_equal(few, want[30:45])  # fewer parts than shards: the 3rd of 4 row ranges
    np.testing.assert_array_equal(few, datasets.parquet(str(tmp_path / "export"), columns=["f"], shard=(2, 4)))

    # A changed source is converted anew, never served stale.
    _export(tmp_path / "export", parts=1, rows=5)
    for p in (tmp_path / "export").glob("part-0000[12].parquet"):
        p.unlink()
    x3, y3 = datasets.parquet(str(tmp_path / "export"), columns=["f"], label="y", cache_dir=cache)
    assert x3.shape == (5, 2) and y3.tolist() == [0, 1, 2, 0, 1]


def test_cache_dir_refuses_what_it_cannot_convert_and_leaves_nothing_behind(tmp_path) -> None:
    root = tmp_path / "export"
    _export(root, parts=1, rows=6)
    pq.write_table(  # a second part whose features are float64: no common type without dtype=
        pa.table({"f": pa.array([[1.0, 2.0]], pa.list_(pa.float64())), "y": pa.array([0])}),
        str(root / "part-00001.parquet"),
    )
    cache = tmp_path / "cache"
    with pytest.raises(DatasetError, match="pass dtype="):
        datasets.parquet(str(root), columns=["f"], label="y", cache_dir=cache)
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []
    x, _ = datasets.parquet(str(root), columns=["f"], label="y", dtype=np.float32, cache_dir=cache)
    assert x.shape == (7, 2) and x.dtype == np.float32 and x[-1].tolist() == [1.0, 2.0]
    with pytest.raises(DatasetError, match="no label column 'nope'"):
        datasets.parquet(str(root), label="nope", cache_dir=cache)
    with pytest.raises(DatasetError, match=r"no Parquet files|not a readable"):
        datasets.parquet(str(tmp_path / "missing"), cache_dir=cache)
    (tmp_path / "a-file").write_text("")  # a cache_dir that cannot hold anything: named, with what it must be
    with pytest.raises(DatasetError, match=r"export: cannot convert into cache_dir .*a-file.*writable folder"):
        datasets.parquet(str(root), columns=["f"], label="y", dtype=np.float32, cache_dir=tmp_path / "a-file")
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"f": pa.array([], pa.float32())}), str(empty))
    with pytest.raises(DatasetError, match="no rows"):
        datasets.parquet(str(empty), cache_dir=cache)
