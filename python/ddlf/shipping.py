"""Local modules and packages as files to ship to workers.

Two ways in: :meth:`Cluster.upload_module` ships what the user names, and every value, function or app a master
sends ships the *local* modules it refers to (:func:`local_modules_for`): a module beside the script or in the
working directory, which workers elsewhere could not import. Installed packages, the standard library and ddlf
itself are never shipped; ``__main__`` travels by value inside the pickle instead (:mod:`ddlf.serialization`).
"""

from __future__ import annotations

import hashlib
import os
import re
import site
import sys
import sysconfig
from collections.abc import Iterable
from pathlib import Path
from types import FunctionType, ModuleType

from .errors import ConfigError

SHIP_LIMIT = 16 * 1024 * 1024
"""The most source bytes one local module (or top-level package) may have to be shipped automatically; a larger
one must be installed on the workers or shipped once with ``Cluster.upload_module``."""


def source_path(file: str | os.PathLike[str]) -> Path:
    """What to ship for a module whose ``__file__`` is ``file``: the file, or its package directory."""
    path = Path(file)
    return path.parent if path.name == "__init__.py" else path


def in_package(name: str, top: str) -> bool:
    """Whether module ``name`` is ``top`` or one of its submodules."""
    return name == top or name.startswith(top + ".")


def module_files(module: ModuleType | str | os.PathLike[str]) -> tuple[str, dict[str, bytes]]:
    """``(module name, {relative path: source bytes})`` for a module object, a ``.py`` file or a package."""
    if isinstance(module, ModuleType):
        file = getattr(module, "__file__", None)
        if file is None:
            raise ConfigError(f"module {module.__name__!r} has no source file to upload")
        path = source_path(file)
        top = module.__name__.split(".")[0]
        if top != module.__name__:
            raise ConfigError(f"upload the top-level package {top!r} rather than {module.__name__!r}")
    else:
        path = Path(module)
    path = path.resolve()
    return (path.name if path.is_dir() else path.stem), {rel: p.read_bytes() for rel, p in _sources(path, module)}


def _sources(path: Path, what: object) -> list[tuple[str, Path]]:
    """``(relative path, file)`` of every source of the module file or package directory at ``path``."""
    if path.is_dir():
        if not (path / "__init__.py").exists():
            raise ConfigError(f"{path} is not a package (no __init__.py)")
        return [
            (p.relative_to(path.parent).as_posix(), p)
            for p in sorted(path.rglob("*.py"))
            if "__pycache__" not in p.parts
        ]
    if path.suffix == ".py" and path.is_file():
        return [(path.name, path)]
    raise ConfigError(f"cannot upload {what!r}: expected a module, a .py file or a package directory")


def _stamp(path: Path) -> tuple[tuple[str, int, int], ...]:
    """Names, modification times and sizes of a module's sources: changes when a file is edited, added or removed."""
    stamp = []
    for rel, p in _sources(path, path):
        st = p.stat()
        stamp.append((rel, st.st_mtime_ns, st.st_size))
    return tuple(stamp)


def files_digest(files: dict[str, bytes]) -> str:
    """A digest of a module's files (names and contents): equal digests, equal code."""
    h = hashlib.sha256()
    for rel in sorted(files):
        content = files[rel]
        h.update(f"{rel}\0{len(content)}\0".encode())
        h.update(content)
    return h.hexdigest()


# -- which modules are local ------------------------------------------------------------------------------

_verdicts: dict[str, bool] = {}  # top-level module name -> local?


def _installed_roots() -> list[str]:
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sysconfig.get_path("stdlib") or ""}
    roots.update(site.getsitepackages() if hasattr(site, "getsitepackages") else [])
    user = site.getusersitepackages() if hasattr(site, "getusersitepackages") else ""
    roots.add(user if isinstance(user, str) else "")
    roots.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # ddlf's own tree
    return [os.path.realpath(r) + os.sep for r in roots if r]


def _local_roots() -> list[str]:
    """Where a user's own modules live: the script's directory (``sys.path[0]`` at start, and the directory of
    ``__main__``'s file, which stays right when the script puts another path first) and the working directory."""
    cwd = os.getcwd()
    first = sys.path[0] if sys.path else ""
    roots = {os.path.realpath(first or cwd), os.path.realpath(cwd)}
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    if isinstance(script, str) and script:
        roots.add(os.path.dirname(os.path.realpath(script)))
    return [r.rstrip(os.sep) + os.sep for r in roots]


def is_local(name: str) -> bool:
    """Whether module ``name`` (or the top-level package it belongs to) is the user's own code beside the script
    or in the working directory, as opposed to an installed package, the standard library or ddlf itself."""
    top = name.partition(".")[0]
    verdict = _verdicts.get(top)
    if verdict is None:
        verdict = _judge(top)
        if top in sys.modules:  # not yet imported: judge again later
            _verdicts[top] = verdict
    return verdict


def _judge(top: str) -> bool:
    if top in ("__main__", "ddlf", "__mp_main__") or top in sys.builtin_module_names:
        return False
    module = sys.modules.get(top)
    path = getattr(module, "__file__", None) if module is not None else None
    if not path:
        return False
    path = os.path.realpath(path)
    if any(path.startswith(r) for r in _installed_roots()):
        return False
    return any(path.startswith(r) for r in _local_roots())


_patterns: tuple[int, list[tuple[str, re.Pattern[bytes]]]] = (-1, [])


def local_module_patterns() -> list[tuple[str, re.Pattern[bytes]]]:
    """``(top-level name, pattern)`` for each imported local module: the pattern finds the module's name as a
    pickle names a global's module (a short string that is the name or starts with ``name.``)."""
    global _patterns
    if _patterns[0] != len(sys.modules):
        n = len(sys.modules)
        tops = sorted({name.partition(".")[0] for name in list(sys.modules)})
        _patterns = (n, [(top, _module_string(top)) for top in tops if is_local(top)])
    return _patterns[1]


def _module_string(top: str) -> re.Pattern[bytes]:
    # How protocol 4+ names a global: the module as SHORT_BINUNICODE (0x8c, a length byte, "top" or "top.sub"),
    # MEMOIZE (0x94), the qualified name (a new short string, memoized, or a BINGET/LONG_BINGET of one), then
    # STACK_GLOBAL (0x93). The length byte is checked by names_module.
    return re.compile(
        rb"\x8c([\x01-\xff])("
        + re.escape(top.encode())
        + rb"(?:\.[A-Za-z0-9_.]+)?)\x94(?:\x8c[\x01-\xff][A-Za-z0-9_.<>]+\x94|h.|j....)\x93",
        re.S,
    )


def names_module(pattern: re.Pattern[bytes], data: bytes) -> bool:
    """Whether a pickle stream names a global of a module matched by ``pattern`` (of
    :func:`local_module_patterns`)."""
    return any(m.group(1)[0] == len(m.group(2)) for m in pattern.finditer(data))


def _refers_to(module: ModuleType) -> set[str]:
    """Local top-level modules that ``module``'s globals refer to (modules, classes, functions)."""
    out = set()
    for value in list(vars(module).values()):
        if isinstance(value, ModuleType):
            name = value.__name__
        elif isinstance(value, (type, FunctionType)):
            name = getattr(value, "__module__", None) or ""
        else:
            continue
        if name and is_local(name):
            out.add(name.partition(".")[0])
    return out


def local_closure(names: Iterable[str]) -> list[str]:
    """The top-level local modules among ``names`` and every local module they import, in a stable order."""
    todo = sorted({n.partition(".")[0] for n in names if is_local(n)})
    seen: list[str] = []
    while todo:
        top = todo.pop()
        if top in seen:
            continue
        seen.append(top)
        for name, module in list(sys.modules.items()):
            if module is not None and in_package(name, top):
                todo.extend(t for t in _refers_to(module) if t not in seen)
    return sorted(seen)


class Shipment:
    """A local module's files as they are on disk now, capped at :data:`SHIP_LIMIT`: read again only when a
    source was edited, added or removed since (a ``stat`` of each), so the digest always matches what a worker on
    this host would import itself (sources gone from disk since they were read: what was read). A snapshot kept
    from the first read would differ from the disk after an edit under a running script, and the worker would then
    get a copy in a temporary directory, where paths computed from ``__file__`` (data beside the code) break."""

    _cache: dict[str, tuple[tuple[tuple[str, int, int], ...], str, dict[str, bytes]]] = {}

    @staticmethod
    def origin(name: str) -> str:
        """Where local top-level module ``name`` lives on this host: its ``.py`` file or package directory."""
        return str(source_path(sys.modules[name].__file__ or "").resolve())

    @classmethod
    def files(cls, name: str) -> tuple[str, dict[str, bytes]]:
        """``(digest, files)`` of local top-level module ``name``; :class:`~ddlf.errors.ConfigError` (naming it and
        the fix) when it cannot be shipped."""
        module = sys.modules[name]
        cached = cls._cache.get(name)
        try:
            stamp = _stamp(source_path(module.__file__ or "").resolve())
        except (OSError, ValueError) as exc:
            if cached is not None:  # its sources left this host since they were read: ship what was read
                return cached[1], cached[2]
            raise ConfigError(f"local module {name!r} cannot be shipped: {exc}") from None
        if cached is not None and cached[0] == stamp:
            return cached[1], cached[2]
        _, files = module_files(module)
        size = sum(len(c) for c in files.values())
        if size > SHIP_LIMIT:
            raise ConfigError(
                f"local module {name!r} ({_size(size)} in {len(files)} files) is referenced by code sent "
                f"to the workers but is over the {_size(SHIP_LIMIT)} limit for shipping it "
                f"automatically: install it on every worker (pip install), or ship it once with "
                f"cluster.upload_module({name!r})"
            )
        digest = files_digest(files)
        cls._cache[name] = (stamp, digest, files)
        return digest, files


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"
