"""Which Keras backend a process uses: the user's choice, the installed ones, and the master's on its workers."""

from __future__ import annotations

import os

from ..errors import FrameworkClash

KERAS_BACKENDS = ("tensorflow", "jax", "torch")
"""Keras backends in ddlf's order of preference when the user has not chosen: the order ``python -m benchmarks
backends`` measures for ddlf training on CPU (the figures are in BENCHMARKS.md, *Keras backends on CPU*)."""


def users_keras_backend() -> str | None:
    """The Keras backend the user chose: ``KERAS_BACKEND``, else the ``backend`` of ``$KERAS_HOME/keras.json``
    (default ``~/.keras/keras.json``), else None. A file saying ``"tensorflow"`` does not count: Keras writes
    that file itself, with that default, the first time it is imported (and TensorFlow is ddlf's first choice
    anyway when it is installed)."""
    chosen = os.environ.get("KERAS_BACKEND")
    if chosen:
        return chosen
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    try:
        import json

        with open(os.path.join(home, "keras.json")) as f:
            backend = json.load(f).get("backend")
    except (OSError, ValueError, AttributeError):
        return None
    return backend if isinstance(backend, str) and backend and backend != "tensorflow" else None


def installed_keras_backends() -> list[str]:
    """The :data:`KERAS_BACKENDS` whose framework (a module of the same name) is installed, in that order."""
    from .loading import installed

    return [name for name in KERAS_BACKENDS if installed(name)]


def installed_keras_backend() -> str:
    """The first of :data:`KERAS_BACKENDS` whose framework is installed (``jax`` when none is)."""
    return (installed_keras_backends() or ["jax"])[0]


def _loaded_keras_backend() -> str | None:
    """The backend of this process's Keras if Keras is loaded (or being loaded by another thread: importing waits
    until it is complete), else None."""
    import importlib
    import sys

    if "keras" not in sys.modules:
        return None
    return str(importlib.import_module("keras").backend.backend())


def keras_backend_default() -> str:
    """Choose Keras's backend for this process unless the user did (``KERAS_BACKEND`` or ``keras.json`` always
    win): the fastest installed one (:data:`KERAS_BACKENDS`). Called when a training run or a worker starts,
    never at import. Returns the backend in effect."""
    chosen = users_keras_backend()
    if chosen is None:
        chosen = installed_keras_backend()
        os.environ["KERAS_BACKEND"] = chosen
    return chosen


def keras_backend_in_use() -> str:
    """This process's Keras backend: Keras's own answer once it is imported, else what it will pick."""
    return _loaded_keras_backend() or keras_backend_default()


def follow_keras_backend(master: str | None) -> None:
    """On a worker, before a training run builds its model: run the master's Keras backend. Keras cannot change
    backend once imported, so a worker that already runs another one refuses with what to do."""
    if not master:
        return
    mine = _loaded_keras_backend()
    if mine is None:
        os.environ["KERAS_BACKEND"] = master
    elif mine != master:
        raise FrameworkClash(
            f"this worker runs Keras on {mine!r} (loaded already) but the master runs {master!r}: a process keeps "
            f"its first backend, so start this worker with KERAS_BACKEND={master} (or the master with "
            f"KERAS_BACKEND={mine})"
        )
