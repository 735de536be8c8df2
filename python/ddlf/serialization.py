"""How Python values travel: pickle protocol 5 with out-of-band buffers.

numpy arrays (and anything else that supports ``PickleBuffer``) are not copied into the pickle stream: their
memory travels as separate raw buffers, and on the receiving side the arrays are rebuilt directly on the
received bytes. Plain ``pickle`` is tried first (fast, C); values it cannot handle (lambdas, closures,
classes defined in ``__main__``) fall back to ``cloudpickle``.
"""

from __future__ import annotations

import contextlib
import hashlib
import pickle
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle

from .errors import SerializationError

PROTOCOL = 5


def dumps(obj: Any) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """Serialize ``obj`` to ``(pickle_stream, out_of_band_buffers)``."""
    buffers: list[pickle.PickleBuffer] = []
    try:
        data = pickle.dumps(obj, protocol=PROTOCOL, buffer_callback=buffers.append)
    except (pickle.PicklingError, AttributeError, TypeError):
        buffers = []
        try:
            data = cloudpickle.dumps(obj, protocol=PROTOCOL, buffer_callback=buffers.append)
        except Exception as exc:
            raise SerializationError(f"cannot serialize {type(obj).__name__}: {exc}") from exc
    return data, buffers


def loads(data: bytes, buffers: Sequence[Any] = ()) -> Any:
    """Rebuild a value from :func:`dumps` output; arrays are built on ``buffers`` without a copy."""
    try:
        return pickle.loads(data, buffers=buffers)
    except Exception as exc:
        raise SerializationError(f"cannot deserialize a value: {type(exc).__name__}: {exc}") from exc


def dump_function(fn: Callable[..., Any]) -> tuple[bytes, str]:
    """Serialize a function by value (closures, lambdas, ``__main__`` functions) and return its content digest."""
    try:
        blob = cloudpickle.dumps(fn, protocol=PROTOCOL)
    except Exception as exc:
        raise SerializationError(f"cannot serialize function {function_name(fn)!r}: {exc}") from exc
    return blob, hashlib.sha256(blob).hexdigest()


def function_name(fn: Callable[..., Any]) -> str:
    """The name a pushed function is registered under on the workers."""
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return name


class PickledFunctions:
    """Each function's ``(name, digest, pickle)``, made once and kept while the function lives (a weak cache: a
    function that is not weak-referenceable is pickled each time)."""

    def __init__(self) -> None:
        self._cache: weakref.WeakKeyDictionary[Any, tuple[str, str, bytes]] = weakref.WeakKeyDictionary()

    def get(self, fn: Callable[..., Any], name: str | None) -> tuple[str, str, bytes]:
        if not callable(fn):
            raise TypeError(f"expected a function, got {type(fn).__name__}")
        cached = None
        with contextlib.suppress(TypeError):  # not weak-referenceable: no cache
            cached = self._cache.get(fn)
        if cached is None or (name is not None and cached[0] != name):
            blob, digest = dump_function(fn)
            fname = name or function_name(fn)
            if fname == "<lambda>":
                fname = f"<lambda>#{digest[:12]}"
            cached = (fname, digest, blob)
            with contextlib.suppress(TypeError):
                self._cache[fn] = cached
        return cached
