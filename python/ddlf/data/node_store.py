"""One copy of a dataset per host: the first local worker that loads a dataset writes its arrays as ``.npy`` files
into a directory under ``/dev/shm``; every worker on the host (that one included) maps them read-only, so four
workers hold one copy in memory, not four.

Layout: ``/dev/shm/ddlf-datasets-<uid>/`` (mode 0700, checked to be this user's before use), one entry per
dataset: ``<key>-<digest>/`` holding ``manifest.json`` and ``0.npy``, ``1.npy``, ... The digest covers the key and
the loader's pickle, so another loader under the same key is another entry. An entry appears whole or not at all
(written under a temporary name, then renamed). Its lock files order the rest: every worker that maps the entry
holds ``<entry>.lock`` shared for as long as it does (removing takes it exclusively, so a held entry stays), and
the worker that loads and writes it holds ``<entry>.init.lock`` exclusively meanwhile (the others wait on it).
An entry outlives the worker that wrote it (a restarted worker maps it again without loading); it is removed by
the last holder to let go of it on ``drop_dataset``, or when a worker exits cleanly and nobody else holds it.

``DDLF_NODE_STORE=off`` (or ``0``) keeps every dataset in each worker's own memory, as before; another path puts
the entries there instead of ``/dev/shm`` (a local disk for datasets larger than memory: pages come and go
through the page cache).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger("ddlf.node_store")

_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


def root() -> str | None:
    """The directory entries live in, or ``None`` when the node store is off or unavailable here."""
    chosen = os.environ.get("DDLF_NODE_STORE", "")
    if chosen.lower() in ("off", "0", "false", "no"):
        return None
    base = chosen or "/dev/shm"
    if not os.path.isdir(base):
        return None
    return os.path.join(base, f"ddlf-datasets-{os.getuid()}")


def _plain(a: Any) -> bool:
    return isinstance(a, np.ndarray) and not isinstance(a, np.memmap) and a.dtype.kind in "biufc"


def shareable(value: Any) -> bool:
    """Whether ``value`` is arrays the store can hold: an array (or encoded images), a tuple/list of them or a
    str-keyed mapping of them, every array of plain numbers (no objects), in memory (a memory-mapped file is
    shared already)."""
    from .images import EncodedImages

    if isinstance(value, (np.ndarray, EncodedImages)):
        items = [value]
    elif isinstance(value, (tuple, list)):
        items = list(value)
    elif isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            return False
        items = list(value.values())
    else:
        return False
    return bool(items) and all(
        _plain(a) or (isinstance(a, EncodedImages) and _plain(a.data) and _plain(a.offsets)) for a in items
    )


def entry_name(key: str, loader: Callable[[], Any], identity: bytes | None = None) -> str | None:
    """The entry of ``key`` loaded by ``loader``, or ``None`` when the loader cannot be pickled (then the dataset
    is not shared: two loaders that cannot be told apart must not meet under one name). ``identity``: bytes that
    tell the loader apart already (a training run passes the digest of the app it received), instead of
    pickling it again."""
    if identity is not None:
        blob = identity
    else:
        import cloudpickle

        try:
            blob = cloudpickle.dumps(loader)
        except Exception:
            return None
    digest = hashlib.sha256(key.encode() + b"\0" + blob).hexdigest()[:20]
    return f"{_SAFE.sub('_', key)[:80]}-{digest}"


@dataclass
class Mapped:
    """A worker's hold on an entry: the shared lock that keeps it while the worker maps its arrays."""

    path: str
    lock_fd: int

    def release(self, remove: bool) -> bool:
        """Let go of the entry; with ``remove``, delete it if nobody else holds it. Returns whether it was deleted."""
        fd, self.lock_fd = self.lock_fd, -1
        if fd < 0:
            return False
        if not remove:
            os.close(fd)
            return False
        return _remove_if_unheld(fd, self.path)  # another worker that maps it keeps it: the last one out removes it


def _remove_if_unheld(fd: int, path: str) -> bool:
    """Remove entry ``path`` if nobody else holds its lock (``fd``, open on it); closes ``fd``. Whether removed."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    else:
        _remove(path)
        return True
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    for lock in (".init.lock", ".lock"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path + lock)


def _own_dir(path: str) -> None:
    """Create ``path`` (0700) if needed and check it is this user's and nobody else can write to it: another user
    must not be able to plant arrays that a worker would train on."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise PermissionError(f"{path} is not a directory of this user's that only it can write to")


def _write(value: Any, final: str) -> None:
    from .images import EncodedImages

    tmp = f"{final}.tmp-{os.getpid()}-{threading.get_ident()}"
    _remove(tmp)
    os.mkdir(tmp, 0o700)
    try:
        if isinstance(value, (np.ndarray, EncodedImages)):
            kind, names, items = "array", [], [value]
        elif isinstance(value, Mapping):
            kind, names, items = "dict", list(value), list(value.values())
        else:
            kind, names, items = ("list" if isinstance(value, list) else "tuple"), [], list(value)
        arrays: list[np.ndarray] = []
        described: list[dict[str, Any]] = []
        for item in items:
            if isinstance(item, EncodedImages):
                described.append(
                    {
                        "images": [len(arrays), len(arrays) + 1],
                        "size": list(item.size),
                        "channels": item.channels,
                        "flip": item.flip,
                        "classes": list(item.classes),
                    }
                )
                arrays += [item.data, item.offsets]
            else:
                described.append({"array": len(arrays)})
                arrays.append(item)
        for i, a in enumerate(arrays):
            np.save(os.path.join(tmp, f"{i}.npy"), np.require(a, requirements="C"), allow_pickle=False)
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            json.dump({"kind": kind, "names": names, "count": len(arrays), "items": described}, f)
        os.rename(tmp, final)
    except BaseException:
        _remove(tmp)
        raise


def _read(path: str) -> Any:
    from .images import EncodedImages

    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    arrays = [np.load(os.path.join(path, f"{i}.npy"), mmap_mode="r") for i in range(int(manifest["count"]))]
    items: list[Any] = []
    for d in manifest.get("items") or [{"array": i} for i in range(len(arrays))]:
        if "images" in d:
            data, offsets = (arrays[i] for i in d["images"])
            items.append(EncodedImages(data, offsets, tuple(d["size"]), d["channels"], d["flip"], d["classes"]))
        else:
            items.append(arrays[d["array"]])
    kind = manifest["kind"]
    if kind == "array":
        return items[0]
    if kind == "dict":
        return dict(zip(manifest["names"], items))
    return list(items) if kind == "list" else tuple(items)


def load(key: str, loader: Callable[[], Any], identity: bytes | None = None) -> tuple[Any, Mapped | None]:
    """``loader()``'s value for ``key``, through this host's entry: mapped if another worker (or an earlier life of
    this one) wrote it, else loaded here, written, and mapped. Returns ``(value, hold)``; ``hold`` is ``None``
    when the value stays in this process (the store is off, the value is not plain arrays, or writing failed:
    then the loaded value is used as it is, and the failure is logged)."""
    base = root()
    name = entry_name(key, loader, identity) if base is not None else None
    if base is None or name is None:
        return loader(), None
    try:
        _own_dir(base)
    except OSError as exc:
        log.warning("dataset %r: node store %s unusable (%s): kept in this worker only", key, base, exc)
        return loader(), None
    path = os.path.join(base, name)
    for _ in range(8):  # another worker's sweep may remove the entry between two of these steps: look again
        # Holders lock the entry shared (a remover needs it exclusively, so nothing is removed while held);
        # whoever creates it also holds the creation lock exclusively, so the others wait, then map it.
        fd = _lock(path + ".lock", fcntl.LOCK_SH)
        try:
            if not os.path.isdir(path):
                init = _lock(path + ".init.lock", fcntl.LOCK_EX)
                try:
                    if not os.path.isdir(path):
                        value = loader()
                        if not shareable(value):
                            os.close(fd)
                            return value, None
                        try:
                            _write(value, path)
                        except OSError as exc:  # /dev/shm full, a read-only disk: this worker keeps its own copy
                            log.warning(
                                "dataset %r: could not write the host's copy to %s (%s): kept here", key, path, exc
                            )
                            os.close(fd)
                            return value, None
                        del value
                finally:
                    os.close(init)
            if os.path.isdir(path):
                return _read(path), Mapped(path, fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        os.close(fd)
    return loader(), None


def _lock(lock_path: str, how: int) -> int:
    """An open lock file, locked ``how``; the file still at ``lock_path`` (not one a sweep just removed)."""
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, how)
            if os.fstat(fd).st_ino == os.stat(lock_path).st_ino:
                return fd
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def sweep() -> list[str]:
    """Remove the entries nobody holds (called when a worker exits cleanly). Returns what was removed."""
    base = root()
    removed: list[str] = []
    if base is None or not os.path.isdir(base):
        return removed
    for f in os.listdir(base):
        if not f.endswith(".lock") or f.endswith(".init.lock"):
            continue
        path = os.path.join(base, f[: -len(".lock")])
        try:
            fd = os.open(os.path.join(base, f), os.O_RDWR)
        except OSError:
            continue
        if _remove_if_unheld(fd, path):
            removed.append(path)
    return removed
