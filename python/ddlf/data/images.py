"""Image folders kept encoded (JPEG/PNG bytes) and decoded per batch by Rust threads."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DatasetError, OutOfRangeError
from .sources import _fs, _join, _walk, is_url

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
        from .. import ops

        idx = np.arange(len(self), dtype=np.uint32) if indices is None else np.asarray(indices)
        try:
            return ops.decode_images(self, idx)
        except ValueError as exc:
            raise DatasetError(f"encoded images: {exc}") from exc

    def __getitem__(self, item: Any) -> np.ndarray:
        if isinstance(item, (int, np.integer)):
            i = int(item) + (len(self) if item < 0 else 0)
            if not 0 <= i < len(self):
                raise OutOfRangeError(f"image {item} out of range for {len(self)} images")
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
