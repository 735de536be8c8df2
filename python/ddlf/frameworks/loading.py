"""Two frameworks in one process: TensorFlow and PyTorch's compiler each carry their own copy of LLVM.

With ``triton`` installed (PyPI's Linux wheel of torch brings it), loading triton's native library (which
``torch._dynamo`` does, and every ``torch.optim`` optimizer loads that on first use) *after* TensorFlow aborts the
process (``LLVM ERROR: inconsistency in registered CommandLine options``); the other order works. ddlf loads
PyTorch's compiler first where a run needs it (a ``TorchModel`` or Keras on torch: ``seeding.set_random_seed``, the
master telling its workers), only triton's library (:data:`COMPILER_LLVM`, 0.1 s) in a daemon that preloads
TensorFlow (a later run may bring a ``TorchModel``: torch's compiler can then load after TensorFlow), and turns the
abort into an error everywhere else: ``TorchModel`` checks, and :func:`guard_torch_compiler` (installed when an app
or a worker starts) refuses the import itself, wherever it comes from (an optimizer built before its
``TorchModel``, ``torch.compile``). Nowhere else: the whole compiler costs 3.3 s and about 900 MB of mappings per
process.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType

from ..errors import FrameworkClash


def installed(name: str) -> bool:
    """Whether top-level module ``name`` can be imported here (without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@functools.cache
def clash_possible() -> bool:
    """Whether loading TensorFlow and PyTorch's compiler in one process depends on their order here (asked once:
    ddlf asks before every seeding)."""
    return installed("triton") and installed("torch") and installed("tensorflow")


COMPILER_LLVM = "triton._C.libtriton"
"""The native library of PyTorch's compiler that carries its LLVM: the part whose order against TensorFlow matters."""


def compiler_llvm_loaded() -> bool:
    """Whether this process has loaded the LLVM of PyTorch's compiler (so that the compiler itself can load now,
    TensorFlow or not: it was loaded first, or the process would have aborted)."""
    return COMPILER_LLVM in sys.modules or "torch._dynamo" in sys.modules


def load_torch_compiler_first() -> None:
    """Before this process loads TensorFlow, for a run that uses torch: load ``torch._dynamo`` first where the
    order matters (the run's optimizer loads it anyway)."""
    if "tensorflow" not in sys.modules and "torch._dynamo" not in sys.modules and clash_possible():
        import torch._dynamo  # noqa: F401


def load_compiler_llvm_first() -> None:
    """Before this process loads TensorFlow, for a daemon that may serve a ``TorchModel`` later: load only the LLVM
    of PyTorch's compiler (:data:`COMPILER_LLVM`, 0.1 s against 3.3 s for the compiler) where the order matters;
    the compiler itself can then load after TensorFlow. Where triton lays its library out otherwise, the whole
    compiler."""
    if "tensorflow" in sys.modules or compiler_llvm_loaded() or not clash_possible():
        return
    try:
        importlib.import_module(COMPILER_LLVM)
    except Exception:  # a triton laid out otherwise, or whose library will not load alone: the whole compiler
        load_torch_compiler_first()


def check_torch_compiler_can_load() -> None:
    """Before PyTorch's compiler (or its LLVM) loads: refuse with :class:`~ddlf.errors.FrameworkClash`, and the
    fix, where it would abort the process."""
    if "tensorflow" in sys.modules and not compiler_llvm_loaded() and installed("triton"):
        raise FrameworkClash(
            "TensorFlow is loaded in this process and PyTorch's compiler (torch._dynamo, loaded by every torch "
            "optimizer) is not: with triton installed, loading it now would abort the process (two copies of "
            "LLVM). Load PyTorch first (`import torch._dynamo` before anything imports tensorflow or keras; in a "
            "notebook, restart its kernel first), or run Keras on another backend (KERAS_BACKEND=jax); on a worker "
            "daemon, start it with --preload torch,keras"
        )


class _TorchCompilerGuard(importlib.abc.MetaPathFinder):
    """Asked first about every import: refuses ``torch._dynamo`` (and triton's LLVM) where loading it would abort
    the process."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname in ("torch._dynamo", COMPILER_LLVM):
            check_torch_compiler_can_load()
        return None  # the other finders find it


def guard_torch_compiler() -> None:
    """From now on, importing PyTorch's compiler where it would abort this process (after TensorFlow, triton
    installed) raises :class:`~ddlf.errors.FrameworkClash` instead, whatever imports it: a ``torch.optim``
    optimizer built before its ``TorchModel`` could check, for one. Called when an app or a worker starts (ddlf
    changes nothing at import); once per process."""
    if not any(isinstance(f, _TorchCompilerGuard) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchCompilerGuard())
