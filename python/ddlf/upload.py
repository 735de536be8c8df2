"""Local modules and packages as files to ship to workers (``Cluster.upload_module``)."""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType


def module_files(module: ModuleType | str | os.PathLike[str]) -> tuple[str, dict[str, bytes]]:
    """``(module name, {relative path: source bytes})`` for a module object, a ``.py`` file or a package."""
    if isinstance(module, ModuleType):
        file = getattr(module, "__file__", None)
        if file is None:
            raise ValueError(f"module {module.__name__!r} has no source file to upload")
        path = Path(file)
        if path.name == "__init__.py":
            path = path.parent
        top = module.__name__.split(".")[0]
        if top != module.__name__:
            raise ValueError(f"upload the top-level package {top!r} rather than {module.__name__!r}")
    else:
        path = Path(module)
    path = path.resolve()
    if path.is_dir():
        if not (path / "__init__.py").exists():
            raise ValueError(f"{path} is not a package (no __init__.py)")
        files = {
            str(p.relative_to(path.parent).as_posix()): p.read_bytes()
            for p in sorted(path.rglob("*.py"))
            if "__pycache__" not in p.parts
        }
        return path.name, files
    if path.suffix == ".py" and path.is_file():
        return path.stem, {path.name: path.read_bytes()}
    raise ValueError(f"cannot upload {module!r}: expected a module, a .py file or a package directory")
