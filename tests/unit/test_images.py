"""Encoded-image datasets without daemons: image folders, Parquet image columns, decoding in the Rust pipeline
(sizes, channels, flips, order), bad files and bad descriptions, and the host's copy of them."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest

from ddlf import ops
from ddlf.data import node_store
from ddlf.data.images import EncodedImages, image_folder
from ddlf.data.parquet import parquet
from ddlf.errors import DatasetError

Image = pytest.importorskip("PIL.Image")


def encode(pixels: np.ndarray, fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def folder(tmp_path, classes=("cat", "dog"), per_class=6, shape=(12, 16, 3)) -> dict[str, list[np.ndarray]]:
    """Class sub-folders of PNG (lossless: decoded exactly) and JPEG images; returns the PNG pixels by class."""
    rng = np.random.default_rng(1)
    pngs: dict[str, list[np.ndarray]] = {}
    for c in classes:
        (tmp_path / c).mkdir()
        pngs[c] = []
        for i in range(per_class):
            px = rng.integers(0, 256, shape, dtype=np.uint8)
            if i % 2:
                (tmp_path / c / f"{i:02d}.png").write_bytes(encode(px, "PNG"))
                pngs[c].append(px)
            else:
                (tmp_path / c / f"{i:02d}.jpg").write_bytes(encode(px, "JPEG"))
    (tmp_path / "cat" / "notes.txt").write_text("not an image: skipped")
    return pngs


def test_an_image_folder_loads_encoded_with_labels_in_class_order(tmp_path) -> None:
    pngs = folder(tmp_path)
    x, y = image_folder(tmp_path, size=(12, 16))
    assert isinstance(x, EncodedImages) and x.classes == ("cat", "dog")
    assert len(x) == 12 and x.shape == (12, 12, 16, 3) and x.dtype == np.uint8
    assert y.dtype == np.int32 and y.tolist() == [0] * 6 + [1] * 6
    files = sorted(os.listdir(tmp_path / "cat"))[:6]
    assert (
        x.nbytes
        == sum((tmp_path / "cat" / f).stat().st_size for f in files)
        + sum((tmp_path / "dog" / f).stat().st_size for f in sorted(os.listdir(tmp_path / "dog")))
        + 13 * 8
    )
    decoded = x.decode()
    # PNG decodes exactly; files are in name order within a class (01.png is row 1, 03.png row 3).
    assert np.array_equal(decoded[1], pngs["cat"][0]) and np.array_equal(decoded[9], pngs["dog"][1])
    assert np.array_equal(x[1], pngs["cat"][0]) and np.array_equal(np.asarray(x)[3], pngs["cat"][1])
    assert x[-1].shape == (12, 16, 3) and x[2:5].shape == (3, 12, 16, 3)
    with pytest.raises(IndexError):
        x[12]
    # An explicit class order relabels (dog's images now come first, as class 0); a class without a folder is
    # refused.
    x2, y2 = image_folder(tmp_path, size=(12, 16), class_names=["dog", "cat"])
    assert x2.classes == ("dog", "cat") and y2.tolist() == [0] * 6 + [1] * 6
    assert np.array_equal(x2[1], pngs["dog"][0])
    with pytest.raises(DatasetError, match="bird"):
        image_folder(tmp_path, class_names=["cat", "bird"])


def test_images_are_resized_and_greyscaled_on_decode(tmp_path) -> None:
    folder(tmp_path, shape=(30, 40, 3))
    x, _ = image_folder(tmp_path, size=(15, 20), channels=1)
    out = x.decode([1, 3])
    assert out.shape == (2, 15, 20, 1) and out.dtype == np.uint8
    # A flat image stays flat whatever the filter.
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "a.png").write_bytes(encode(np.full((31, 17, 3), 77, np.uint8), "PNG"))
    f, _ = image_folder(tmp_path, size=(5, 9), class_names=["flat"])
    assert np.all(f.decode() == 77)


def test_the_pipeline_decodes_batches_in_index_order_and_flips_about_half(tmp_path) -> None:
    pngs = folder(tmp_path, per_class=40)
    x, y = image_folder(tmp_path, size=(12, 16))
    order = np.array([1, 3, 41, 5, 43, 7], dtype=np.uint32)  # PNG rows only
    want = [pngs["cat"][0], pngs["cat"][1], pngs["dog"][0], pngs["cat"][2], pngs["dog"][1], pngs["cat"][3]]
    batches = list(ops.BatchPipeline([x, y], order, 4, decode_threads=2))
    assert [b[0].shape for b in batches] == [(4, 12, 16, 3), (2, 12, 16, 3)]
    got = np.concatenate([b[0] for b in batches])
    assert all(np.array_equal(g, w) for g, w in zip(got, want))
    assert np.concatenate([b[1] for b in batches]).tolist() == y[order].tolist()

    flipping = EncodedImages(x.data, x.offsets, x.size, flip=True)
    rows = np.arange(1, 80, 2, dtype=np.uint32)  # the 40 PNGs
    src = x.decode(rows)
    out = np.concatenate(list(ops.BatchPipeline([flipping], rows, 8, seed=3)))
    same = [np.array_equal(o, s) for o, s in zip(out, src)]
    mirrored = [np.array_equal(o, s[:, ::-1]) for o, s in zip(out, src)]
    assert all(a or b for a, b in zip(same, mirrored))
    assert 8 <= sum(mirrored) <= 32  # about half of 40
    again = np.concatenate(list(ops.BatchPipeline([flipping], rows, 8, seed=3)))
    assert np.array_equal(out, again)  # the same seed flips the same images
    assert np.array_equal(flipping.decode(rows), src)  # decode() never flips


def test_a_file_that_does_not_decode_is_an_error_naming_its_row(tmp_path) -> None:
    folder(tmp_path)
    (tmp_path / "dog" / "99.jpg").write_bytes(b"\xff\xd8 truncated jpeg")
    x, y = image_folder(tmp_path, size=(12, 16))
    assert len(x) == 13
    with pytest.raises(DatasetError, match="row 12"):
        x.decode()
    with pytest.raises(ValueError, match=r"row 12 .*could not be decoded"):
        list(ops.BatchPipeline([x, y], np.arange(13), 5))
    assert x.decode(np.arange(12)).shape == (12, 12, 16, 3)  # the others still decode
    # A loop that skips the bad batch gets the others, then the end (the failed batch is spent), in either mode.
    for inline in (True, False):
        pl = ops.BatchPipeline([x, y], np.array([12, 0, 1, 2, 3, 4, 5]), 3, inline=inline)
        got, errors = [], 0
        for _ in range(10):
            try:
                got.append(next(pl))
            except StopIteration:
                break
            except ValueError:
                errors += 1
        assert errors == 1 and [len(b[1]) for b in got] == [3, 1], (inline, errors, got)
        assert next(pl, None) is None


def test_malformed_descriptions_are_refused() -> None:
    data = np.zeros(10, np.uint8)
    with pytest.raises(DatasetError, match="uint8"):
        EncodedImages(data.astype(np.int16), np.array([0, 10]), (4, 4))
    with pytest.raises(DatasetError, match="offsets"):
        EncodedImages(data, np.array([0, 11]), (4, 4))
    with pytest.raises(DatasetError, match="offsets"):
        EncodedImages(data, np.array([0, 6, 3, 10]), (4, 4))
    with pytest.raises(DatasetError, match="offsets"):
        EncodedImages(data, np.array([2, 10]), (4, 4))
    with pytest.raises(DatasetError, match="size"):
        EncodedImages(data, np.array([0, 10]), (0, 4))
    with pytest.raises(DatasetError, match="size"):
        EncodedImages(data, np.array([0, 10]), (4, 4, 4))  # type: ignore[arg-type]
    with pytest.raises(DatasetError, match="channels"):
        EncodedImages(data, np.array([0, 10]), (4, 4), channels=4)
    with pytest.raises(ValueError, match="encoded images"):
        ops.decode_images(np.zeros((3, 4)), [0])
    with pytest.raises(DatasetError, match=r"no .jpg"):
        image_folder(os.path.dirname(__file__), size=(4, 4))


def test_an_image_too_large_to_decode_safely_is_refused() -> None:
    # A PNG header claiming 100000 x 100000 pixels: refused before any allocation of that size.
    import struct
    import zlib

    ihdr = struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    png = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk))
    x = EncodedImages(np.frombuffer(png, np.uint8), np.array([0, len(png)]), (8, 8))
    with pytest.raises(DatasetError, match="row 0"):
        x.decode()


def test_parquet_image_columns_load_as_encoded_images(tmp_path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rng = np.random.default_rng(2)
    pixels = [rng.integers(0, 256, (8, 10, 3), dtype=np.uint8) for _ in range(9)]
    files = [encode(p, "PNG") for p in pixels]
    labels = np.arange(9, dtype=np.int64) % 3
    pq.write_table(pa.table({"image": pa.array(files, pa.binary()), "label": labels}), str(tmp_path / "flat.parquet"))
    # Spark's and Hugging Face's image columns: a struct with the file's bytes (and its path).
    struct = pa.array([{"bytes": f, "path": f"{i}.png"} for i, f in enumerate(files)])
    table = pa.table({"image": struct, "label": labels})
    (tmp_path / "export").mkdir()
    pq.write_table(table.slice(0, 5), str(tmp_path / "export" / "part-0.parquet"))
    pq.write_table(table.slice(5), str(tmp_path / "export" / "part-1.parquet"))
    for path in (tmp_path / "flat.parquet", tmp_path / "export"):
        x, y = parquet(str(path), columns=["image"], label="label", image_size=(8, 10))
        assert isinstance(x, EncodedImages) and len(x) == 9 and y.tolist() == labels.tolist()
        assert all(np.array_equal(d, p) for d, p in zip(x.decode(), pixels))
    # Converted to local disk (larger than memory): the files' bytes mapped, offsets running on across parts.
    cache = tmp_path / "cache"
    x, y = parquet(str(tmp_path / "export"), columns=["image"], label="label", image_size=(8, 10), cache_dir=cache)
    assert isinstance(x.data, np.memmap) and len(x) == 9 and y.tolist() == labels.tolist()
    assert all(np.array_equal(d, p) for d, p in zip(x.decode(), pixels))
    with pytest.raises(DatasetError, match="image_size"):
        parquet(str(tmp_path / "flat.parquet"), label="label")
    pq.write_table(
        pa.table({"image": pa.array(files, pa.binary()), "k": labels, "label": labels}), str(tmp_path / "two.parquet")
    )
    with pytest.raises(DatasetError, match="alone"):
        parquet(str(tmp_path / "two.parquet"), label="label", image_size=(8, 10))
    pq.write_table(pa.table({"image": pa.array([files[0], None], pa.binary())}), str(tmp_path / "null.parquet"))
    with pytest.raises(DatasetError, match="missing"):
        parquet(str(tmp_path / "null.parquet"), image_size=(8, 10))


def test_the_hosts_copy_keeps_encoded_images(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DDLF_NODE_STORE", str(tmp_path))
    (tmp_path / "imgs").mkdir()
    pngs = folder(tmp_path / "imgs")
    x, y = image_folder(tmp_path / "imgs", size=(12, 16), flip=True)
    assert node_store.shareable((x, y)) and node_store.shareable({"x": x, "y": y})
    value, hold = node_store.load("images", lambda: (x, y))
    try:
        assert hold is not None
        mx, my = value
        assert isinstance(mx, EncodedImages) and isinstance(mx.data, np.memmap)
        assert (mx.size, mx.channels, mx.flip, mx.classes) == ((12, 16), 3, True, ("cat", "dog"))
        assert np.array_equal(my, y) and np.array_equal(mx.decode([1])[0], pngs["cat"][0])
    finally:
        assert hold is not None
        hold.release(remove=True)
