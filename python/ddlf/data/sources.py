"""Where data is read from: local paths and URLs (fsspec), gzip or not."""

from __future__ import annotations

import gzip
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import DatasetError


def is_url(path: Any) -> bool:
    """Whether ``path`` names remote storage (``scheme://...``, other than ``file://``)."""
    return isinstance(path, str) and "://" in path and not path.startswith("file://")


def _fs(url: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, str]:
    try:
        import fsspec
    except ImportError:
        raise DatasetError(f"{url}: reading URLs needs fsspec (pip install fsspec, and s3fs for s3://)") from None
    try:
        return fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    except (ImportError, ValueError) as exc:
        raise DatasetError(f"{url}: {exc}") from exc


def read_bytes(path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> bytes:
    """The whole content of a local file or of a URL on shared storage."""
    if not is_url(path):
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise DatasetError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    fs, where = _fs(str(path), storage_options)
    try:
        return fs.cat_file(where)
    except FileNotFoundError as exc:
        raise DatasetError(f"{path}: file not found") from exc
    except Exception as exc:  # the storage library's own errors (permissions, network) name the cause
        raise DatasetError(f"{path}: cannot read: {exc}") from exc


def _exists(path: str, storage_options: Mapping[str, Any] | None) -> bool:
    if not is_url(path):
        return Path(path).exists()
    fs, where = _fs(path, storage_options)
    return bool(fs.exists(where))


def _join(directory: str | os.PathLike[str], name: str) -> str:
    d = os.fspath(directory)
    return f"{d.rstrip('/')}/{name}" if is_url(d) else str(Path(d) / name)


def _open_maybe_gz(path: Any, storage_options: Mapping[str, Any] | None = None) -> bytes:
    raw = read_bytes(path, storage_options)
    if raw[:2] == b"\x1f\x8b":
        try:
            return gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise DatasetError(f"{path}: corrupt gzip data: {exc}") from exc
    return raw


def _walk(fs: Any, where: str) -> list[str]:
    """Every file under ``where`` (sub-folders included)."""
    if fs is not None:
        return [str(f) for f in fs.find(where)]
    return [os.path.join(d, f) for d, _, fs_ in os.walk(where) for f in fs_]
