"""How Python values travel: pickle protocol 5 with out-of-band buffers.

numpy arrays (and anything else that supports ``PickleBuffer``) are not copied into the pickle stream: their
memory travels as separate raw buffers, and on the receiving side the arrays are rebuilt directly on the
received bytes.

What is defined in the script travels by value: the C pickler is tried first (plain data keeps its speed); a
stream that refers to ``__main__`` (a dataclass instance, a loader function passed as an argument) or a value it
cannot pickle by reference (lambdas, closures) is pickled again by ``cloudpickle``, the script's classes and
functions by value. Classes and functions of *local* modules (beside the script, see
:mod:`ddlf.shipping`) stay references; ``dumps(..., modules=set())`` collects their modules, which the cluster ships
to the workers before the value.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import pickle
import sys
import weakref
from collections import ChainMap
from collections.abc import Callable, Sequence
from types import CodeType, FunctionType, ModuleType
from typing import Any

import cloudpickle

from .errors import ConfigTypeError, SerializationError
from .shipping import is_local, local_module_patterns, names_module

PROTOCOL = 5
_MAIN_MARKER = b"_main__"  # in "__main__" and "__mp_main__"


def _note(obj: Any, modules: set[str] | None) -> None:
    """For a class, function or module met while pickling by value: note its module when it is local."""
    if modules is None:
        return
    if isinstance(obj, ModuleType):
        name: Any = obj.__name__
    elif isinstance(obj, (type, FunctionType)):
        name = getattr(obj, "__module__", None)
    else:
        return
    if isinstance(name, str) and is_local(name):
        modules.add(name.partition(".")[0])


def _code_with_filename(rebuild: Callable[..., CodeType], args: tuple[Any, ...], filename: str) -> CodeType:
    """Rebuild a code object as cloudpickle reduced it, under the file name it had where it was defined."""
    return rebuild(*args).replace(co_filename=filename)


def _reduce_code(code: CodeType) -> tuple[Any, ...]:
    """cloudpickle's reduction of a code object, keeping ``co_filename``.

    cloudpickle >= 3.1.3 names every code object ``<dynamic-code>``, which leaves a remote traceback without the
    file and its source lines; the name travels beside cloudpickle's own reduction instead."""
    rebuild, args = cloudpickle.Pickler.dispatch_table[CodeType](code)[:2]
    return _code_with_filename, (rebuild, args, code.co_filename)


def _script_by_value() -> None:
    """In a process started by multiprocessing's spawn or forkserver, the script runs as ``__mp_main__``, which
    cloudpickle would pickle by reference like any module (and no worker has it): send it by value, as
    ``__main__``."""
    mp_main = sys.modules.get("__mp_main__")
    if mp_main is not None:
        cloudpickle.register_pickle_by_value(mp_main)  # a set of names: idempotent


class _ValuePickler(cloudpickle.Pickler):
    """cloudpickle's pickler (``__main__``, lambdas and closures by value), noting local modules and keeping the
    file names of the code it sends (remote tracebacks name them and show their lines)."""

    dispatch_table = ChainMap({CodeType: _reduce_code}, cloudpickle.Pickler.dispatch_table)

    def __init__(self, file: Any, buffer_callback: Any, modules: set[str] | None) -> None:
        super().__init__(file, protocol=PROTOCOL, buffer_callback=buffer_callback)
        self.modules = modules

    def reducer_override(self, obj: Any) -> Any:
        _note(obj, self.modules)
        return super().reducer_override(obj)


def _by_value(obj: Any, modules: set[str] | None, buffers: list[pickle.PickleBuffer] | None) -> bytes:
    _script_by_value()
    out = io.BytesIO()
    _ValuePickler(out, None if buffers is None else buffers.append, modules).dump(obj)
    return out.getvalue()


def dumps(obj: Any, *, modules: set[str] | None = None) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """Serialize ``obj`` to ``(pickle_stream, out_of_band_buffers)``. ``modules``: a set that receives the local
    modules the value refers to by reference (they must be shipped to the workers first).

    The C pickler runs first, unhooked; a stream that names ``__main__`` (a class or function of the script,
    pickled by reference: no worker could load it) or that the C pickler refuses (lambdas, closures) is made
    again by cloudpickle, the script's code by value."""
    buffers: list[pickle.PickleBuffer] = []
    try:
        data = pickle.dumps(obj, protocol=PROTOCOL, buffer_callback=buffers.append)
    except (pickle.PicklingError, AttributeError, TypeError):
        pass
    except RecursionError as exc:
        raise SerializationError(_cannot(obj, exc)) from exc
    else:
        if _MAIN_MARKER not in data:
            if modules is not None:
                modules.update(referenced_local_modules(data))
            return data, buffers
    buffers = []
    try:
        data = _by_value(obj, modules, buffers)
    except Exception as exc:
        raise SerializationError(_cannot(obj, exc)) from exc
    return data, buffers


def referenced_local_modules(data: bytes) -> set[str]:
    """The imported local modules (top-level names) that a pickle stream refers to by name."""
    return {top for top, pattern in local_module_patterns() if top.encode() in data and names_module(pattern, data)}


def _cannot(obj: Any, exc: BaseException) -> str:
    return (
        f"cannot serialize {type(obj).__name__}: {exc} (values sent to workers must be picklable: open files, "
        "locks, sockets and live connections are not; send what rebuilds them instead)"
    )


def loads(data: bytes, buffers: Sequence[Any] = ()) -> Any:
    """Rebuild a value from :func:`dumps` output; arrays are built on ``buffers`` without a copy."""
    try:
        return pickle.loads(data, buffers=buffers)
    except Exception as exc:
        raise SerializationError(f"cannot deserialize a value: {type(exc).__name__}: {exc}") from exc


def dumps_inline(obj: Any, modules: set[str] | None = None) -> bytes:
    """One self-contained blob (arrays inline), ``__main__``'s classes and functions by value; ``modules``
    receives the local modules it refers to (see :func:`dumps`). For apps and other values kept as bytes."""
    try:
        return _by_value(obj, modules, None)
    except Exception as exc:
        raise SerializationError(_cannot(obj, exc)) from exc


def dump_function(fn: Callable[..., Any], modules: set[str] | None = None) -> tuple[bytes, str]:
    """Serialize a function by value (closures, lambdas, ``__main__`` functions) and return its content digest.
    ``modules`` receives the local modules it refers to (see :func:`dumps`)."""
    try:
        blob = _by_value(fn, modules, None)  # one blob: captured arrays inline
    except Exception as exc:
        raise SerializationError(f"cannot serialize function {function_name(fn)!r}: {exc}") from exc
    return blob, hashlib.sha256(blob).hexdigest()


INTERNAL_PREFIX = "ddlf."
"""The names of ddlf's own functions on the workers start with this (a user's never do: a function's name has no
dot); they are left out of a worker's list of functions and of what a clean reports dropped."""


def function_name(fn: Callable[..., Any]) -> str:
    """The name a pushed function is registered under on the workers: its ``__name__``, as the user calls it by;
    ddlf's own functions by their module and qualified name (``ddlf.data.store.describe``), so that they never take
    the place of a user's function of the same name."""
    name = getattr(fn, "__name__", None) or type(fn).__name__
    module = getattr(fn, "__module__", None) or ""
    if module == "ddlf" or module.startswith(INTERNAL_PREFIX):
        return f"{module}.{getattr(fn, '__qualname__', name)}"
    return name


class PickledFunctions:
    """Each function's ``(name, digest, pickle, local modules)``, made once and kept while the function lives (a
    weak cache: a function that is not weak-referenceable is pickled each time)."""

    def __init__(self) -> None:
        self._cache: weakref.WeakKeyDictionary[Any, tuple[str, str, bytes, frozenset[str]]] = (
            weakref.WeakKeyDictionary()
        )

    def get(self, fn: Callable[..., Any], name: str | None) -> tuple[str, str, bytes, frozenset[str]]:
        if not callable(fn):
            raise ConfigTypeError(f"expected a function, got {type(fn).__name__}")
        cached = None
        with contextlib.suppress(TypeError):  # not weak-referenceable: no cache
            cached = self._cache.get(fn)
        if cached is None or (name is not None and cached[0] != name):
            modules: set[str] = set()
            blob, digest = dump_function(fn, modules)
            fname = name or function_name(fn)
            if fname.endswith("<lambda>"):
                fname = f"{fname}#{digest[:12]}"  # (ddlf's own keep their module: left out of the user's list)
            cached = (fname, digest, blob, frozenset(modules))
            with contextlib.suppress(TypeError):
                self._cache[fn] = cached
        return cached
