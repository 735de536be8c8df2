"""The worker side of every operation: what a daemon's interpreter thread runs for each request.

One :class:`Executor` lives as long as its daemon. It holds the persistent state that masters push: variables,
functions, the globals of executed code segments and uploaded modules. It outlives connections, so a second
script that connects later finds everything the first one left.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import inspect
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import cloudpickle

from .. import _ddlf, serialization
from ..errors import DdlfError, MemoryBudgetExceeded
from ..process import freeze_heap
from ..shipping import files_digest, in_package, module_files, source_path
from . import drain, services
from .drain import Draining
from .memory_budget import MemoryBudget
from .stacks import StackDumps

OPS = _ddlf.OPS
KINDS = _ddlf.ERROR_KINDS
PRELOAD_WAIT = 120.0
"""Seconds a request waits at most for the daemon's preload (``--preload``) to finish."""

log = logging.getLogger("ddlf.worker")


class _Failure(DdlfError):
    """An expected failure reported with a specific error kind (not a user exception)."""

    def __init__(self, kind: str, type_name: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.type_name = type_name


class WorkerContext:
    """What a function whose first parameter is named ``worker`` receives.

    Attributes:
        id: this worker's 0-based index in the connected cluster.
        n_workers: the number of workers in that cluster.
        vars: the persistent variables (a dict shared with ``cluster.set``/``get``).
        globals: the namespace of code run with ``cluster.exec``.
        address: the address the daemon listens on.
    """

    def __init__(self, executor: Executor) -> None:
        self._executor = executor
        self.id = 0
        self.n_workers = 1

    @property
    def vars(self) -> dict[str, Any]:
        return self._executor.variables

    @property
    def globals(self) -> dict[str, Any]:
        return self._executor.namespace

    @property
    def address(self) -> str:
        return self._executor.address

    def __repr__(self) -> str:
        return f"<WorkerContext id={self.id} n_workers={self.n_workers} address={self.address}>"


class _Function:
    __slots__ = ("digest", "fn", "wants_worker")

    def __init__(self, fn: Callable[..., Any], digest: str) -> None:
        self.fn = fn
        self.digest = digest
        self.wants_worker = _first_parameter(fn) == "worker"


def _first_parameter(fn: Callable[..., Any]) -> str | None:
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return params[0] if params else None


class Executor:
    """Runs the operations of one worker daemon. Called only from the daemon's interpreter thread."""

    def __init__(
        self,
        ready_file: str | None = None,
        module_dir: str | None = None,
        preload: Sequence[str] = (),
        max_memory: int | None = None,
        on_ready: Callable[[str], None] | None = None,
    ) -> None:
        self.preload = list(preload)
        self._preloaded: threading.Event | None = None
        """Set once the preload thread is done (``None``: nothing to preload); requests wait for it."""
        self._on_ready = on_ready
        self.budget = MemoryBudget(max_memory)
        """Resident memory this worker may hold (``--max-memory``): see :mod:`ddlf.worker.memory_budget`."""
        self.variables: dict[str, Any] = {}
        self.functions: dict[str, _Function] = {}
        self.namespace: dict[str, Any] = {"__name__": "__ddlf_worker__"}
        self.context = WorkerContext(self)
        self.address = ""
        self._ready_file = ready_file
        self._stacks: StackDumps | None = None
        self.runs: list[str] = []
        """The training runs set up here (a stop waits for them to be torn down: :mod:`.drain`)."""
        self._module_dir: Path | None = Path(module_dir) if module_dir else None
        self._own_module_dir = False
        # (uploaded module, shipped automatically?) -> the digest of the version in use
        self._module_digests: dict[tuple[str, bool], str] = {}
        self._handlers: dict[int, Callable[[str, str, Any], Any]] = {
            OPS["SET_VAR"]: self._set_var,
            OPS["GET_VAR"]: self._get_var,
            OPS["DEL_VAR"]: self._del_var,
            OPS["LIST_VARS"]: lambda name, digest, value: sorted(self.variables),
            OPS["ADD_FUNCTION"]: self._add_function,
            OPS["REMOVE_FUNCTION"]: self._remove_function,
            OPS["LIST_FUNCTIONS"]: lambda name, digest, value: sorted(self._user_functions()),
            OPS["RUN"]: self._run,
            OPS["EXEC"]: self._exec,
            OPS["CLEAN"]: self._clean,
            OPS["UPLOAD_MODULE"]: self._upload_module,
            OPS["CONTEXT"]: self._set_context,
        }
        # Operations that import nothing (the others wait for the preload: _wait_for_preload). CONTEXT's value is
        # the master's plain dict of numbers, sent before its first request.
        self._import_free = {
            OPS[op]
            for op in ("LIST_VARS", "LIST_FUNCTIONS", "GET_VAR", "DEL_VAR", "REMOVE_FUNCTION", "CLEAN", "CONTEXT")
        }
        # Operations that keep or run something: checked against the memory budget before they are decoded.
        self._budgeted = {
            OPS["SET_VAR"]: "set",
            OPS["ADD_FUNCTION"]: "add_function",
            OPS["RUN"]: "the call",
            OPS["EXEC"]: "exec",
            OPS["UPLOAD_MODULE"]: "the module upload",
        }

    # -- called by the Rust daemon ------------------------------------------------------------------------

    def module_dir(self) -> Path:
        """Where uploaded modules go (importable): made on the first upload, removed by :meth:`close`."""
        if self._module_dir is None:
            self._module_dir = Path(tempfile.mkdtemp(prefix="ddlf-modules-"))
            self._own_module_dir = True
        self._module_dir.mkdir(parents=True, exist_ok=True)
        if str(self._module_dir) not in sys.path:
            sys.path.insert(0, str(self._module_dir))
        return self._module_dir

    def release(self) -> None:
        """Let go of everything the masters put here (variables, functions, the ``exec`` namespace): the daemon
        stops."""
        self._clean("", "", None)

    def close(self) -> None:
        """Remove what this worker created on disk (its uploaded-modules directory, its stack file)."""
        if self._stacks is not None:
            self._stacks.close()
            self._stacks = None
        if self._own_module_dir and self._module_dir is not None:
            shutil.rmtree(self._module_dir, ignore_errors=True)
            self._own_module_dir = False

    def on_listening(self, address: str, daemon: Any) -> None:
        """The daemon is bound to ``address``; tell whoever waits for it (``Cluster.local``), then start loading
        the modules to preload in the background. ``daemon`` (a ``ServingDaemon``) takes the training runs this
        worker serves, which its status requests report."""
        self.address = address
        self._stacks = StackDumps(daemon)

        def report_runs(runs: list[str]) -> None:
            self.runs = list(runs)
            daemon.set_runs(runs)

        services.configure(report_runs=report_runs)  # training's runs, when a master sets one up here
        if self.preload:
            self._preloaded = threading.Event()
            args = (self.preload, self._preloaded)
            threading.Thread(target=_preload, args=args, name="ddlf-preload", daemon=True).start()
        if self._ready_file:
            tmp = self._ready_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(address)
            os.replace(tmp, self._ready_file)
        if self._on_ready is not None:
            self._on_ready(address)

    def handle(self, op: int, name: str, digest: str, pickle: bytes, buffers: list[Any]) -> tuple[Any, ...]:
        """Run one operation. Returns ``(0, pickle, buffers)`` or ``(kind, (type, message, traceback))``."""
        refused: str | None = None
        try:
            if op not in self._import_free:
                self._wait_for_preload()
            handler = self._handlers.get(op)
            if handler is None:
                raise _Failure("BAD_REQUEST", "ProtocolError", f"unknown operation code {op}")
            what = self._budgeted.get(op)
            if what is not None:
                # The request's bytes are in memory already; unpickling builds about len(pickle) more (arrays
                # are decoded in place from their buffers).
                self.budget.check(len(pickle), f"{what} {name!r}" if name else what)
            value = self._decode(op, pickle, buffers)
            try:  # a training round marks itself interruptible by a stop (SIGTERM): drain.round_started
                if op == OPS["RUN"] or op == OPS["EXEC"]:
                    with self.budget:  # the watchdog stops the call if it takes the worker past its budget
                        result = handler(name, digest, value)
                else:
                    result = handler(name, digest, value)
            finally:
                drain.call_ended()
        except Draining as exc:  # SIGTERM: this call is abandoned, the worker serves on for a while (drain.py)
            return (KINDS["USER"], ("WorkerStopping", f"the worker is stopping: {exc}", ""))
        except MemoryBudgetExceeded as exc:
            refused = str(exc)
        except _Failure as f:
            return (KINDS[f.kind], (f.type_name, str(f), ""))
        except Exception as exc:
            return (KINDS["USER"], _describe(exc))
        if refused is not None:
            # Out of the except block, whose traceback held the stopped call's frames: what they held is free
            # now, and goes back to the system.
            self.budget.release()
            return (KINDS["RESOURCE_EXHAUSTED"], ("MemoryBudgetExceeded", refused, ""))
        try:
            data, bufs = serialization.dumps(result)
        except Exception as exc:
            return (
                KINDS["SERIALIZATION"],
                (
                    "SerializationError",
                    f"the result of {name or 'the call'} ({type(result).__name__}) cannot be pickled: {exc}",
                    "",
                ),
            )
        return (0, data, [b.raw() for b in bufs])

    def _wait_for_preload(self) -> None:
        """Wait until the preload thread is done. A request decodes and runs the master's code, which may import
        what the preload is importing: two threads importing modules that import each other (TensorFlow's
        ``__init__`` imports Keras) make Python raise ``_DeadlockError`` in one of them, and a framework left
        half-imported by either is broken for the daemon's life. Only the first requests of a daemon's life wait
        (the preload starts as the daemon listens), for what they would mostly have waited for anyway. A preload
        still running after :data:`PRELOAD_WAIT` seconds (an import that hangs) is no longer waited for."""
        done = self._preloaded
        if done is None:
            return
        t0 = time.monotonic()
        if not done.is_set():
            if done.wait(PRELOAD_WAIT):
                log.info(
                    "a request waited %.2f s for the preload of %s", time.monotonic() - t0, ", ".join(self.preload)
                )
            else:
                log.warning(
                    "the preload of %s is still running after %.0f s: requests no longer wait for it",
                    ", ".join(self.preload),
                    PRELOAD_WAIT,
                )
        self._preloaded = None  # waited once: nothing to wait for any more

    @staticmethod
    def _decode(op: int, pickle: bytes, buffers: list[Any]) -> Any:
        if not pickle:
            return None
        if op == OPS["ADD_FUNCTION"]:
            return pickle  # unpickled by _add_function, with a clearer error
        try:
            return serialization.loads(pickle, buffers)
        except Exception as exc:
            raise _Failure("BAD_REQUEST", "SerializationError", f"cannot decode the request: {exc}") from exc

    # -- operations ---------------------------------------------------------------------------------------

    def _set_var(self, name: str, digest: str, value: Any) -> None:
        _check_name(name, "variable")
        old = self.variables.get(name, _MISSING)
        self.variables[name] = value
        try:
            self.budget.check_after(f"set {name!r}")
        except MemoryBudgetExceeded:
            if old is _MISSING:
                del self.variables[name]
            else:
                self.variables[name] = old
            raise

    def _get_var(self, name: str, digest: str, value: Any) -> Any:
        try:
            return self.variables[name]
        except KeyError:
            raise _Failure("NOT_FOUND", "NotFoundError", f"no variable named {name!r}") from None

    def _del_var(self, name: str, digest: str, value: Any) -> None:
        if self.variables.pop(name, _MISSING) is _MISSING:
            raise _Failure("NOT_FOUND", "NotFoundError", f"no variable named {name!r}")

    def _add_function(self, name: str, digest: str, blob: bytes) -> None:
        _check_name(name, "function")
        try:
            fn = cloudpickle.loads(blob)
        except Exception as exc:
            raise _Failure(
                "USER",
                type(exc).__qualname__,
                f"cannot load function {name!r} on this worker: {exc} "
                "(if it imports a local module, ship it with cluster.upload_module)",
            ) from exc
        if not callable(fn):
            raise _Failure("BAD_REQUEST", "TypeError", f"{name!r} is not callable")
        self.functions[name] = _Function(fn, digest)

    def _remove_function(self, name: str, digest: str, value: Any) -> None:
        if self.functions.pop(name, None) is None:
            raise _Failure("NOT_FOUND", "NotFoundError", f"no function named {name!r}")

    def _run(self, name: str, digest: str, value: Any) -> Any:
        args, kwargs = value if value is not None else ((), {})
        entry = self.functions.get(name)
        if entry is None:
            if digest:
                raise _Failure("MISSING_FUNCTION", "NotFoundError", f"function {name!r} not pushed yet")
            fn = self.namespace.get(name)
            if not callable(fn):
                raise _Failure("NOT_FOUND", "NotFoundError", f"no function named {name!r}")
            entry = _Function(fn, "")
        elif digest and entry.digest != digest:
            raise _Failure("MISSING_FUNCTION", "NotFoundError", f"function {name!r} has changed")
        if entry.wants_worker:
            return entry.fn(self.context, *args, **kwargs)
        return entry.fn(*args, **kwargs)

    def _user_functions(self) -> list[str]:
        """The functions pushed by users (ddlf's own, pushed by its master side, are left out)."""
        return [n for n in self.functions if not n.startswith(serialization.INTERNAL_PREFIX)]

    def _exec(self, name: str, digest: str, code: Any) -> None:
        if not isinstance(code, str):
            raise _Failure("BAD_REQUEST", "TypeError", "exec expects source code as a string")
        compiled = compile(code, "<ddlf exec>", "exec")
        exec(compiled, self.namespace)

    def _clean(self, name: str, digest: str, value: Any) -> dict[str, int]:
        dropped = {"variables": len(self.variables), "functions": len(self._user_functions())}
        self.variables.clear()
        self.functions.clear()
        self.namespace.clear()
        self.namespace["__name__"] = "__ddlf_worker__"
        return dropped

    def forget_modules(self) -> list[str]:
        """Forget every uploaded module (``Cluster.reset``): their files removed from the uploads directory and
        their imported versions from this interpreter (a module a master ships again is written anew). Returns
        their names."""
        names = sorted({name for name, _ in self._module_digests})
        if self._module_dir is not None and self._module_dir.is_dir():
            for entry in list(self._module_dir.iterdir()):
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
            dir_ = str(self._module_dir.resolve())
            for mod_name, mod in list(sys.modules.items()):
                file = getattr(mod, "__file__", None)
                if isinstance(file, str) and os.path.realpath(file).startswith(dir_ + os.sep):
                    del sys.modules[mod_name]
        for name in names:
            _forget_module(name)
        self._module_digests.clear()
        importlib.invalidate_caches()
        return names

    def _set_context(self, name: str, digest: str, value: Any) -> None:
        self.context.id = int(value["worker_id"])
        self.context.n_workers = int(value["n_workers"])

    def _upload_module(self, name: str, digest: str, value: Any) -> bool:
        """Make module ``name`` importable. ``value``: ``{path: source}`` from Cluster.upload_module, or
        ``(files, {"prefer_native": True, "origin": path, "probe": bool})`` when shipped automatically with code
        that refers to it (see ddlf.shipping): a probe carries no files and asks whether this worker has that
        version already. Returns whether it is in place (a probe: False when the files must come)."""
        files, options = value if isinstance(value, tuple) else (value, {})
        if not isinstance(files, dict) or not isinstance(options, dict):
            raise _Failure("BAD_REQUEST", "TypeError", "a module upload is a {path: bytes} dict")
        key = (name, bool(options.get("prefer_native")))
        held = self._module_digests.get(key)
        if digest and held == digest:
            return True  # this version is here already (shipped by another master, or replayed)
        if key[1] and digest and self._native_digest(name) == digest:
            # The very same code is importable here already (the same file on this host, or installed): use it,
            # so that its __file__ (and the data files beside it) stay where they are. An older version this
            # interpreter imported (the file was edited since) is forgotten: the next import reads the new one.
            if held is not None:
                _forget_module(name)
            self._module_digests[key] = digest
            return True
        origin = options.get("origin")
        if key[1] and digest and isinstance(origin, str) and _digest_at(origin) == digest:
            # The master's own file is here too (this host, or a shared file system): import it from where the
            # master does, so that paths computed from its __file__ mean the same on both sides.
            parent = str(Path(origin).parent)
            if parent not in sys.path:
                sys.path.insert(0, parent)
            _forget_module(name)
            self._module_digests[key] = digest
            return True
        if options.get("probe"):
            return False
        written = []
        root = self.module_dir().resolve()
        for rel, content in files.items():
            path = PurePosixPath(rel)
            if not isinstance(content, bytes) or path.is_absolute() or ".." in path.parts or not path.parts:
                raise _Failure("BAD_REQUEST", "ValueError", f"refusing module path {rel!r}")
            target = root.joinpath(*path.parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_suffix(target.suffix + ".tmp")
            tmp.write_bytes(content)
            os.replace(tmp, target)
            written.append(str(target))
        _forget_module(name)  # any previously imported version: the next import sees the new code
        self._module_digests = {k: v for k, v in self._module_digests.items() if k[0] != name}
        if digest:
            self._module_digests[key] = digest
        return bool(written) or not files

    def _native_digest(self, name: str) -> str | None:
        """The digest of the files module ``name`` would be imported from on this worker without uploads."""
        shipped = str(self._module_dir) if self._module_dir is not None else None
        path_list = [p for p in sys.path if p != shipped]
        try:
            spec = importlib.machinery.PathFinder.find_spec(name, path_list)
            if spec is None or not spec.origin or not spec.origin.endswith(".py"):
                return None
        except (ImportError, ValueError):
            return None
        return _digest_at(str(source_path(spec.origin)))


def _forget_module(name: str) -> None:
    """Drop module ``name`` and its submodules from this interpreter, so that the next import reads them anew."""
    for mod in [m for m in sys.modules if in_package(m, name)]:
        del sys.modules[mod]
    importlib.invalidate_caches()


def _digest_at(path: str) -> str | None:
    """The digest of the module file or package directory at ``path`` on this host, if there is one."""
    try:
        _, files = module_files(path)
    except (OSError, ValueError):
        return None
    return files_digest(files)


def _preload(modules: list[str], done: threading.Event) -> None:
    """Import ``modules`` (a worker's ``--preload``) so that the first training run finds them loaded, then set
    ``done``: requests that arrive meanwhile wait for it (:meth:`Executor._wait_for_preload`)."""
    from ..frameworks.console import quiet_start

    try:
        for name in modules:
            t0 = time.perf_counter()
            try:
                with quiet_start():  # the framework's start-up notices go to this daemon's log, not stderr
                    module = importlib.import_module(name)
                    if name == "keras":
                        module.backend.backend()  # loads the backend's own framework too
                    elif name == "torch":
                        from ..frameworks.loading import load_torch_compiler_first

                        # torch.optim loads it at a first step anyway; in first, a later run may bring TensorFlow
                        load_torch_compiler_first()
            except BaseException as exc:  # a worker must serve whatever its preload does
                log.warning("preloading %s failed: %s: %s", name, type(exc).__name__, exc)
                continue
            log.info("preloaded %s in %.2f s", name, time.perf_counter() - t0)
        # The frameworks' modules live as long as the daemon: out of the garbage collector's full scans
        freeze_heap()
    finally:
        done.set()


_MISSING = object()


def _check_name(name: str, what: str) -> None:
    if not name or not isinstance(name, str):
        raise _Failure("BAD_REQUEST", "ValueError", f"a {what} needs a non-empty name")


def _describe(exc: BaseException) -> tuple[str, str, str]:
    cls = type(exc)
    module = cls.__module__
    type_name = cls.__qualname__ if module in ("builtins", "__main__") else f"{module}.{cls.__qualname__}"
    # Drop ddlf's own frames: the traceback starts in the user's code.
    tb_obj = exc.__traceback__
    while tb_obj is not None and tb_obj.tb_frame.f_code.co_filename == __file__:
        tb_obj = tb_obj.tb_next
    tb = "".join(traceback.format_exception(cls, exc, tb_obj))
    return type_name, str(exc), tb
